//! README, Guarantees, "Memory is freed at completion": "a key's watch list
//! keeps the room it grew to up to 4,096 entries and gives back a larger
//! burst's buffer once it holds under a quarter of it". keys_memory.rs pins
//! it for plain watches only; these pin it for watches at a level. One test
//! function (the heap is counted process-wide), its cases in turn.

mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tokio_purgatory::{OperationHandle, Purgatory, Watch};

use support::{alloc, ms, settle, FlagOp as Op};

#[global_allocator]
static GLOBAL: alloc::Counting = alloc::Counting;

type P = Purgatory<u64, Op>;

const BURST: u64 = 100_000;

fn shape(p: &P) -> (usize, usize, usize, usize) {
    let m = p.metrics();
    (m.delayed, m.watched, m.tombstones, m.keys)
}

/// Warms the slab and the wheel to the burst's size on other keys.
fn warm(p: &P) {
    const SPREAD: u64 = 64;
    let flag = Arc::new(AtomicBool::new(false));
    let hs: Vec<_> = (0..BURST)
        .map(|i| {
            p.try_complete_else_watch(Op(flag.clone()), ms(1_000_000), [1_000 + i % SPREAD])
                .unwrap()
        })
        .collect();
    flag.store(true, Ordering::SeqCst);
    for k in 0..SPREAD {
        p.try_complete_watched(&(1_000 + k));
    }
    for h in hs {
        h.detach();
    }
}

/// A purgatory whose key 7 keeps one plain watcher, warmed up; the live
/// heap read then (`before`); and a burst of watches of key 7 at levels
/// 0-99, their checks reading `flag`.
struct Burst {
    p: P,
    keeper: OperationHandle<u64, Op>,
    before: isize,
    hs: Vec<OperationHandle<u64, Op>>,
}

fn level_burst(flag: &Arc<AtomicBool>) -> Burst {
    let p: P = Purgatory::new();
    let keeper = p
        .try_complete_else_watch(Op(Arc::new(AtomicBool::new(false))), ms(100_000_000), [7])
        .unwrap();
    warm(&p);
    let before = alloc::live_bytes();
    let hs = (0..BURST)
        .map(|i| {
            p.try_complete_else_watch_levels(
                Op(flag.clone()),
                ms(1_000_000),
                [Watch::level(7, i % 100)],
            )
            .unwrap()
        })
        .collect();
    Burst {
        p,
        keeper,
        before,
        hs,
    }
}

/// Case 1: a burst of level watches on key 7 (one plain watcher keeps the
/// key), all completed by one advance. Tombstones 0, watched 1: the key's
/// level heap should have given its 100,000-entry buffer back.
async fn advance_completes_a_level_burst() -> Result<(), String> {
    let flag = Arc::new(AtomicBool::new(false));
    let Burst {
        p,
        keeper,
        before,
        hs,
    } = level_burst(&flag);
    flag.store(true, Ordering::SeqCst);
    assert_eq!(p.try_complete_reached(&7, 1_000), BURST as usize);
    for h in hs {
        h.detach();
    }
    settle().await;
    assert_eq!(shape(&p), (1, 1, 0, 1), "{:?}", p.metrics());
    let kept = alloc::live_bytes() - before;
    drop(keeper);
    if kept < 64 * 1024 {
        Ok(())
    } else {
        Err(format!(
            "advance: the key (one live watcher, no tombstones) keeps {kept} B after a \
             burst of {BURST} level watches completed by one advance"
        ))
    }
}

/// Case 2: the same burst cancelled (handles dropped), then the purge is
/// carried out by later registrations and walks on the key until no
/// tombstone is left: the level heap is rebuilt by the purge and should not
/// keep the burst's room either.
async fn purge_of_a_cancelled_level_burst() -> Result<(), String> {
    let flag = Arc::new(AtomicBool::new(false));
    let Burst {
        p,
        keeper,
        before,
        hs,
    } = level_burst(&flag);
    drop(hs);
    settle().await;
    // Drive the purge: registrations (each a slice) cancelled at once.
    let mut n = 0;
    while p.metrics().tombstones > 0 && n < 10_000 {
        p.try_complete_else_watch(Op(Arc::new(AtomicBool::new(false))), ms(1_000_000), [8])
            .unwrap()
            .cancel();
        n += 1;
    }
    settle().await;
    assert_eq!(
        shape(&p),
        (1, 1, 0, 1),
        "after {n} calls: {:?}",
        p.metrics()
    );
    let kept = alloc::live_bytes() - before;
    drop(keeper);
    if kept < 64 * 1024 {
        Ok(())
    } else {
        Err(format!(
            "purge: the key (one live watcher, no tombstones) keeps {kept} B after a \
             burst of {BURST} level watches cancelled and purged ({n} calls drove it)"
        ))
    }
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_keys_level_heap_gives_back_a_bursts_room() {
    let mut failures = Vec::new();
    if let Err(e) = advance_completes_a_level_burst().await {
        failures.push(e);
    }
    if let Err(e) = purge_of_a_cancelled_level_burst().await {
        failures.push(e);
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
