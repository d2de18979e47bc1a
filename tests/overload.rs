//! Overload: a burst far over the pending limit is refused without loss, and
//! memory is linear in pending operations and returned after expiry. One test in this binary: it counts heap bytes with a
//! global allocator, which other tests running at once would disturb.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::advance;
use tokio_purgatory::{Operation, Purgatory, WatchError};

mod support;
use support::settle;

use support::alloc;

#[global_allocator]
static GLOBAL: alloc::Counting = alloc::Counting;

struct Op(Arc<AtomicBool>, u64);

impl Operation for Op {
    type Output = u64;
    fn try_complete(&mut self) -> Option<u64> {
        self.0.load(Ordering::SeqCst).then_some(self.1)
    }
    fn on_expiration(self) -> u64 {
        self.1
    }
}

#[tokio::test(start_paused = true)]
async fn overload_is_refused_without_loss_and_memory_is_linear() {
    // --- A burst far above the limit is refused, every operation handed back.
    let limit = 100;
    let p: Purgatory<u32, Op> = Purgatory::builder()
        .name("limited")
        .max_pending(limit)
        .build()
        .unwrap();
    let flag = Arc::new(AtomicBool::new(false));
    let mut accepted = Vec::new();
    let mut refused = Vec::new();
    for i in 0..10_000u64 {
        match p.try_complete_else_watch(
            Op(flag.clone(), i),
            Duration::from_millis(50),
            [(i % 10) as u32],
        ) {
            Ok(h) => accepted.push(h),
            Err(WatchError::AtCapacity(op)) => refused.push(op.1),
            Err(other) => panic!("unexpected {other}"),
        }
        assert!(p.delayed() <= limit, "never above the limit");
    }
    assert_eq!(accepted.len(), limit);
    assert_eq!(
        refused.len(),
        10_000 - limit,
        "each refused operation came back"
    );
    assert_eq!(refused[0], limit as u64, "the very operations, in order");

    // Capacity comes back as operations finish, however they finish.
    flag.store(true, Ordering::SeqCst);
    for k in 0..5u32 {
        p.try_complete_watched(&k); // completes half
    }
    drop(p.cancel_for_key(&5)); // cancels a tenth
    accepted.truncate(accepted.len() - 10); // drops ten handles: cancelled
    assert!(p.delayed() < limit);
    advance(Duration::from_millis(50)).await;
    settle().await;
    assert_eq!(p.delayed(), 0, "the rest expired");
    let m = p.metrics();
    assert_eq!(
        m.registered, limit as u64,
        "refusals are not counted as registered"
    );
    assert_eq!(
        m.registered,
        m.completed + m.expired + m.cancelled + m.handed_back,
        "{m:?}"
    );
    for _ in 0..limit {
        p.try_complete_else_watch(Op(flag.clone(), 0), Duration::from_millis(50), [1])
            .map(|h| h.detach())
            .map_err(|_| "full capacity is available again")
            .unwrap();
    }
    drop(accepted);

    // --- Without a limit, memory grows linearly with pending operations; what
    // they own returns once they expire, and their cells are kept for the next
    // burst, which allocates none: no queue of expired work builds up anywhere.
    let q: Purgatory<u32, Op> = Purgatory::builder().name("unlimited").build().unwrap();
    let never = Arc::new(AtomicBool::new(false));
    let base = alloc::live_bytes();
    let burst = |q: &Purgatory<u32, Op>, at: &mut Vec<(usize, isize)>| {
        for n in [20_000u64, 40_000, 80_000] {
            for i in 0..n / 2 {
                q.try_complete_else_watch(
                    Op(never.clone(), i),
                    Duration::from_secs(10),
                    [(i % 1000) as u32, 5000],
                )
                .unwrap()
                .detach();
            }
            at.push((q.delayed(), alloc::live_bytes() - base));
        }
    };
    let mut at = Vec::new();
    burst(&q, &mut at);
    // Pending 10k, 30k, 70k: bytes per pending operation stay within 25% of each
    // other (linear, no hidden per-operation growth).
    let per: Vec<f64> = at.iter().map(|(d, b)| *b as f64 / *d as f64).collect();
    let (lo, hi) = per
        .iter()
        .fold((f64::MAX, 0f64), |(lo, hi), v| (lo.min(*v), hi.max(*v)));
    assert!(hi / lo < 1.25, "bytes per pending operation {per:?}");
    let expire_all = || async {
        advance(Duration::from_secs(10)).await;
        for _ in 0..200 {
            tokio::task::yield_now().await;
        }
        assert_eq!(q.delayed(), 0);
        for k in (0..1000).chain([5000]) {
            q.try_complete_watched(&k);
        }
    };
    expire_all().await;
    // What stays is the cells, kept for reuse (the peak pending, 70k, rounded
    // up to a page of 1,024 cells, each `cell_bytes` and up to 8 bytes on a
    // free list), and beside them a bounded rest, not proportional to the
    // burst: a drained timer shard keeps at most 64 slab entries, and a watcher
    // shard at most a small table (room for 64 keys; larger ones shrink as keys
    // go).
    let cells = ((70_000 + 1024) * (Purgatory::<u32, Op>::cell_bytes() + 8)) as isize;
    let left = alloc::live_bytes() - base;
    let peak = at.last().unwrap().1;
    assert!(
        left < cells + peak / 20,
        "after every operation expired, {left} bytes are still held \
         (peak {peak}, cells kept {cells})"
    );
    // The same burst again reuses those cells: the peak does not grow.
    let mut again = Vec::new();
    burst(&q, &mut again);
    let second = again.last().unwrap().1;
    assert!(
        second < peak + peak / 20,
        "a second burst of the same size reached {second} bytes (first {peak})"
    );
    expire_all().await;
}
