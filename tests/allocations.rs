//! Allocations on the event path: a key walk and the prune after it reuse
//! their buffers, so once warmed up they allocate nothing while holding a
//! watch list's lock, or at all. Counted per thread by a global allocator (its
//! own binary, so no other test shares the allocator).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio_purgatory::Purgatory;

mod support;
use support::alloc;
use support::FlagOp as Op;

#[global_allocator]
static GLOBAL: alloc::Counting = alloc::Counting;

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn walks_reuse_their_buffers() {
    let p: Purgatory<u32, Op> = Purgatory::new();
    let flags: Vec<_> = (0..3).map(|_| Arc::new(AtomicBool::new(false))).collect();
    let mut handles = Vec::new();
    for i in 0..300 {
        let h = p
            .try_complete_else_watch(Op(flags[i % 3].clone()), Duration::from_secs(60), [1, 2])
            .unwrap();
        handles.push(h);
    }

    // Warm up: the first walks grow this thread's buffers, the first that
    // completes and prunes grows the one for what it takes out.
    assert_eq!(p.try_complete_watched(&1), 0);
    flags[0].store(true, Ordering::SeqCst);
    assert_eq!(p.try_complete_watched(&1), 100);
    assert_eq!(p.try_complete_watched(&2), 0);

    let before = alloc::allocations_here();
    for _ in 0..10 {
        assert_eq!(p.try_complete_watched(&1), 0);
        assert_eq!(p.try_complete_watched(&2), 0);
    }
    assert_eq!(
        alloc::allocations_here() - before,
        0,
        "walks that complete nothing allocate nothing"
    );

    // Another hundred become completable: the walk completes them (the
    // handles take their outcomes in place) and prunes them from the list
    // into the kept buffer; the other key's walk drops its tombstones.
    flags[1].store(true, Ordering::SeqCst);
    let before = alloc::allocations_here();
    assert_eq!(p.try_complete_watched(&1), 100);
    assert_eq!(p.try_complete_watched(&2), 0);
    assert_eq!(
        alloc::allocations_here() - before,
        0,
        "a walk that completes and prunes allocates nothing"
    );
    assert_eq!(p.delayed(), 100);
    for (i, h) in handles.iter().enumerate() {
        assert_eq!(h.is_finished(), i % 3 < 2, "operation {i}");
    }
}

/// What one operation allocates in the steady state, on each path: pinned, so
/// that a change that adds an allocation per operation is seen here rather
/// than in a benchmark. Today's figures: none per registration (the
/// operation's cell is a slab cell freed by the operation before it), none to
/// complete it by reference, none to expire it, none to drop its handle. The
/// slab, the watch lists and the timer wheel reuse their room once warm.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn no_allocation_per_operation_in_the_steady_state() {
    let p: Purgatory<u32, Op> = Purgatory::new();
    let done = Arc::new(AtomicBool::new(false));
    let never = Arc::new(AtomicBool::new(false));
    // Operations pending throughout, as in a busy purgatory: the wheel never
    // empties (an empty wheel gives its room back).
    // They watch every key the rounds use, so no list empties (a key whose
    // list empties leaves the map, and comes back with a new list).
    for i in 0..15u32 {
        p.try_complete_else_watch(Op(never.clone()), Duration::from_secs(3600), [i])
            .unwrap()
            .detach();
    }
    // Warm up: lists, wheel slots and kept buffers reach their working size.
    let round = |n: u32| {
        let mut refs = Vec::with_capacity(100);
        let mut allocs = [0u64; 3];
        for i in 0..100u32 {
            let before = alloc::allocations_here();
            let h = p
                .try_complete_else_watch(
                    Op(done.clone()),
                    Duration::from_secs(60),
                    [i % 7, 7 + i % 5, 12 + n % 3],
                )
                .unwrap();
            allocs[0] += alloc::allocations_here() - before;
            refs.push(h.op_ref().unwrap());
            let before = alloc::allocations_here();
            h.detach();
            allocs[2] += alloc::allocations_here() - before;
        }
        done.store(true, Ordering::SeqCst);
        let before = alloc::allocations_here();
        for r in &refs {
            assert!(r.try_complete());
        }
        allocs[1] += alloc::allocations_here() - before;
        done.store(false, Ordering::SeqCst);
        drop(refs);
        // Walks drop the round's tombstones, so the lists keep their size
        // (and no purge, which notes the keys it will visit, has to run).
        for k in 0..15 {
            assert_eq!(p.try_complete_watched(&k), 0);
        }
        allocs
    };
    for n in 0..20 {
        round(n);
    }
    let [registered, completed, detached] = round(20);
    assert_eq!(registered, 0, "a registration reuses a freed cell");
    assert_eq!(completed, 0, "completing by reference allocates nothing");
    assert_eq!(detached, 0, "detaching a handle allocates nothing");

    // Expiry: the reaper's turn allocates nothing per operation.
    for i in 0..100u32 {
        p.try_complete_else_watch(Op(never.clone()), Duration::from_millis(10), [i % 7])
            .unwrap()
            .detach();
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
    for i in 0..100u32 {
        p.try_complete_else_watch(Op(never.clone()), Duration::from_millis(10), [i % 7])
            .unwrap()
            .detach();
    }
    let before = alloc::allocations_here();
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(p.delayed(), 15);
    assert_eq!(
        alloc::allocations_here() - before,
        0,
        "expiring a hundred operations allocates nothing"
    );
}

/// The cancellation that leaves a large map with nothing pending starts the
/// purge of the whole map, and does a bounded part of it in the call: that
/// part notes the keys of the shards it reaches (a word each), not every key
/// of the map. 100,000 keys noted at once would take 800 KB on this thread;
/// a shard's share (64 shards) is about 12 KB.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn the_call_that_starts_an_idle_purge_notes_a_shard_not_the_map() {
    const KEYS: u32 = 100_000;
    let p: Purgatory<u32, Op> = Purgatory::new();
    let flag = Arc::new(AtomicBool::new(false));
    let mut handles: Vec<_> = (0..KEYS)
        .map(|k| {
            p.try_complete_else_watch(Op(flag.clone()), Duration::from_secs(60), [k])
                .unwrap()
        })
        .collect();
    let last = handles.pop().unwrap();
    drop(handles); // cancelled: tombstones, the map marked for a purge
    assert_eq!(p.metrics().keys, KEYS as usize, "nothing has purged yet");

    let held = alloc::reset_peak_here();
    drop(last); // nothing pending: this call starts the purge of the map
    let peak = alloc::peak_here() - held;
    let m = p.metrics();
    assert!(m.keys < KEYS as usize, "the call purged a part: {m:?}");
    assert!(
        peak < 200_000,
        "the call took {peak} bytes at its peak; the whole map's hashes are 800,000"
    );

    // The reaper's turns purge the rest.
    for _ in 0..10_000 {
        if p.metrics().keys == 0 {
            break;
        }
        tokio::task::yield_now().await;
    }
    let m = p.metrics();
    assert_eq!((m.keys, m.watched), (0, 0), "{m:?}");
}
