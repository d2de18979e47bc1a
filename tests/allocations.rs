//! Allocations on the event path: a key walk and the prune after it reuse
//! their buffers, so once warmed up they allocate nothing while holding a
//! watch list's lock, or at all. Counted per thread by a global allocator (its
//! own binary, so no other test shares the allocator).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio_purgatory::{Operation, Purgatory};

mod support;
use support::alloc;

#[global_allocator]
static GLOBAL: alloc::Counting = alloc::Counting;

struct Op(Arc<AtomicBool>);

impl Operation for Op {
    type Output = ();
    fn try_complete(&mut self) -> Option<()> {
        self.0.load(Ordering::SeqCst).then_some(())
    }
    fn on_expiration(self) {}
}

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
