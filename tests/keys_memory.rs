//! The key map gives its memory back. Rounds of operations on hot keys, at
//! levels and on keys of their own (new every round), finishing every way,
//! leave the heap where the first rounds left it, even after a round far
//! wider than the rest; and a key that always keeps one watcher gives back
//! the room a burst of 200,000 operations on it needed once the burst has
//! completed. The live heap is counted process-wide by a global allocator,
//! so this binary holds one test that runs the cases one after the other.

mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tokio::time::advance;
use tokio_purgatory::{Purgatory, Watch};

use support::{alloc, balanced, ms, settle, FlagOp as Op};

#[global_allocator]
static GLOBAL: alloc::Counting = alloc::Counting;

type P = Purgatory<u64, Op>;

/// Pending, watched entries, tombstones and keys.
fn shape(p: &P) -> (usize, usize, usize, usize) {
    let m = p.metrics();
    (m.delayed, m.watched, m.tombstones, m.keys)
}

/// One round: `n` operations, each on one of 8 hot keys, at one level of a
/// 9th, and on `wide` keys of its own (new every round). A quarter complete
/// by a walk of one of their own keys, a quarter by their hot key's walk, a
/// quarter are cancelled (by `cancel_for_key` of an own key, or by dropping
/// the handle), a quarter expire. The round ends with a cancellation that
/// leaves nothing pending.
async fn round(p: &P, r: u64, n: u64, wide: u64) {
    let base = 1_000_000 + r * 10_000_000;
    let flags: Vec<Arc<AtomicBool>> = (0..4).map(|_| Arc::new(AtomicBool::new(false))).collect();
    let mut handles = Vec::new();
    for i in 0..n {
        let fate = (i % 4) as usize;
        let own = (0..wide).map(|j| Watch::key(base + i * wide + j));
        let watches: Vec<Watch<u64>> = [Watch::key(i % 8), Watch::level(9, r * 1000 + i)]
            .into_iter()
            .chain(own)
            .collect();
        let timeout = if fate == 3 { ms(10) } else { ms(1_000_000) };
        handles.push(Some(
            p.try_complete_else_watch_levels(Op(flags[fate].clone()), timeout, watches)
                .unwrap(),
        ));
    }
    // Fate 0: by a walk of its own first key.
    flags[0].store(true, Ordering::SeqCst);
    for i in (0..n).filter(|i| i % 4 == 0) {
        assert_eq!(p.try_complete_watched(&(base + i * wide)), 1);
    }
    // Fate 1: by the hot keys' walks.
    flags[1].store(true, Ordering::SeqCst);
    for k in 0..8 {
        p.try_complete_watched(&k);
    }
    // Fate 2: half by key, half by the handle.
    for i in (0..n).filter(|i| i % 4 == 2) {
        if i % 8 == 2 {
            assert_eq!(p.cancel_for_key(&(base + i * wide + wide - 1)).len(), 1);
        } else {
            handles[i as usize] = None;
        }
    }
    // Fate 3: expire.
    advance(ms(11)).await;
    settle().await;
    for h in handles.into_iter().flatten() {
        h.detach();
    }
    assert_eq!(p.delayed(), 0);
    // A last cancellation, leaving nothing pending.
    let h = p
        .try_complete_else_watch(Op(Arc::new(AtomicBool::new(false))), ms(1_000), [u64::MAX])
        .unwrap();
    drop(h);
}

/// The live heap and the map's gauges return after every round, and after
/// a round far wider than the first.
async fn churn_with_ever_new_keys_gives_the_heap_back() {
    let p: P = Purgatory::new();
    // Warm-up: the cells for the peak, the buffers, the timer's slab.
    round(&p, 0, 400, 2).await;
    round(&p, 1, 400, 2).await;
    let base_heap = alloc::live_bytes();
    for r in 2..12 {
        round(&p, r, 400, 2).await;
        let grown = alloc::live_bytes() - base_heap;
        assert_eq!(shape(&p), (0, 0, 0, 0), "round {r}: {:?}", p.metrics());
        assert!(
            grown < 16 * 1024,
            "round {r}: heap grew {grown} B: {:?}",
            p.metrics()
        );
    }
    // Much wider: 400 operations on 40 keys of their own each (16,000 keys
    // at the peak), then the narrow rounds again.
    round(&p, 20, 400, 40).await;
    assert_eq!(shape(&p), (0, 0, 0, 0), "wide round: {:?}", p.metrics());
    for r in 21..24 {
        round(&p, r, 400, 2).await;
    }
    let grown = alloc::live_bytes() - base_heap;
    let m = p.metrics();
    assert!(balanced(&m));
    assert_eq!(m.delayed, 0);
    assert!(
        grown < 64 * 1024,
        "the wide round's key map was not given back: heap +{grown} B, {m:?}"
    );
}

/// A hot key that always has one watcher (so its list never empties) sees a
/// burst of 200,000 watchers, which all complete. The burst's cells are kept
/// ("cells for the peak number pending are kept", and warmed up here before
/// the heap is measured); the key's list gives back the buffer the burst
/// grew, at once and after later use.
async fn a_hot_keys_list_gives_back_a_bursts_room() {
    const BURST: u64 = 200_000;
    let p: P = Purgatory::new();
    let never = Arc::new(AtomicBool::new(false));
    let keeper = p
        .try_complete_else_watch(Op(never.clone()), ms(100_000_000), [7])
        .unwrap();
    // Grow the slab and the timer's room to the burst's size first, with
    // the burst spread over other keys (lists short enough to keep their
    // room, and gone with their keys once completed), so that neither is
    // what is measured.
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
        assert_eq!(
            p.try_complete_watched(&(1_000 + k)),
            (BURST / SPREAD) as usize
        );
    }
    for h in hs {
        h.detach();
    }
    assert_eq!(shape(&p), (1, 1, 0, 1));

    let flag = Arc::new(AtomicBool::new(false));
    let before = alloc::live_bytes();
    let hs: Vec<_> = (0..BURST)
        .map(|_| {
            p.try_complete_else_watch(Op(flag.clone()), ms(1_000_000), [7])
                .unwrap()
        })
        .collect();
    flag.store(true, Ordering::SeqCst);
    assert_eq!(p.try_complete_watched(&7), BURST as usize);
    for h in hs {
        h.detach();
    }
    assert_eq!(shape(&p), (1, 1, 0, 1));
    let kept = alloc::live_bytes() - before;
    assert!(
        kept < 64 * 1024,
        "one live watcher on the key keeps {kept} B once a burst on it completed"
    );
    // Some more walks and registrations on it.
    for _ in 0..100 {
        p.try_complete_else_watch(Op(flag.clone()), ms(1), [7])
            .unwrap()
            .detach();
        p.try_complete_watched(&7);
    }
    advance(ms(2)).await;
    settle().await;
    assert_eq!(shape(&p), (1, 1, 0, 1));
    let kept = alloc::live_bytes() - before;
    assert!(
        kept < 64 * 1024,
        "one live watcher on the key keeps {kept} B after a burst and later use: {:?}",
        p.metrics()
    );
    drop(keeper);
}

/// The cases one after the other, alone in this binary: nothing else
/// allocates while they measure.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn the_key_map_gives_its_heap_back() {
    churn_with_ever_new_keys_gives_the_heap_back().await;
    a_hot_keys_list_gives_back_a_bursts_room().await;
}
