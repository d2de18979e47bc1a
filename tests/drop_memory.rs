//! What a dropped purgatory gives back, and what a kept `OpRef` holds. The
//! docs: the cells "given back when the purgatory is dropped (its last
//! clone, and the last handle or `OpRef` of its operations)"; an `OpRef`
//! "does keep the memory the purgatory's operations share ... until the last
//! `OpRef` and `OperationHandle` of the purgatory are dropped". The live heap
//! is counted process-wide, so this binary holds one test that runs its
//! cases one after the other.

mod support;

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use tokio::time::advance;
use tokio_purgatory::Purgatory;

use support::{alloc, ms, settle, FlagOp as Op};

#[global_allocator]
static GLOBAL: alloc::Counting = alloc::Counting;

type P = Purgatory<u64, Op>;

const OPS: u64 = 50_000;

/// A purgatory that held `OPS` operations at once, on keys of their own,
/// all expired; returns the `OpRef` of the first when `keep`, after the
/// purgatory and every handle are dropped.
async fn burst(keep: bool) -> Option<tokio_purgatory::OpRef<u64, Op>> {
    let p: P = Purgatory::builder().name("burst").build().unwrap();
    let never = Arc::new(AtomicBool::new(false));
    let handles: Vec<_> = (0..OPS)
        .map(|i| {
            p.try_complete_else_watch(Op(never.clone()), ms(10), [i, OPS + i % 64])
                .unwrap()
        })
        .collect();
    let kept = keep.then(|| handles[0].op_ref().unwrap());
    assert!(p.metrics().cells >= OPS as usize);
    for h in handles {
        h.detach();
    }
    advance(ms(20)).await;
    settle().await;
    assert_eq!(p.delayed(), 0);
    drop(p);
    settle().await;
    kept
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_dropped_purgatory_gives_its_memory_back_once_no_op_ref_is_left() {
    // Warm: the runtime's own buffers, and a purgatory made and dropped.
    drop(burst(false).await);
    let base = alloc::live_bytes();

    // Dropped with nothing kept: back where it started.
    drop(burst(false).await);
    let kept = alloc::live_bytes() - base;
    assert!(kept < 64 * 1024, "a dropped purgatory keeps {kept} B");

    // An `OpRef` kept past the purgatory keeps the cells (as documented),
    // and gives them back when it goes.
    let op_ref = burst(true).await.expect("kept");
    let held = alloc::live_bytes() - base;
    let cells = OPS as isize * P::cell_bytes() as isize;
    assert!(held >= cells, "{held} B held, cells alone take {cells} B");
    assert_eq!(op_ref.status(), tokio_purgatory::OperationStatus::Expired);
    drop(op_ref);
    settle().await;
    advance(ms(1)).await;
    settle().await;
    let kept = alloc::live_bytes() - base;
    assert!(kept < 64 * 1024, "after the last OpRef went, {kept} B kept");
}
