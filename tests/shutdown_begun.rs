//! What a shutdown promises the calls made once it has begun
//! (`Purgatory::shutdown`, "Concurrent calls": from the moment
//! `is_shutdown` reads `true`, walks, advances and cancellations by key find
//! nothing, and `OpRef::try_complete` and resets return `false`, on every
//! thread, code the shutdown itself runs included). Each operation the
//! shutdown had not reached when such a call came is handed back by it.
//!
//! The first test runs on one thread, in Tokio's paused time: the handles'
//! wakers, woken by the shutdown as it hands their operations back, walk the
//! other keys and check the other operations by reference. The others race a
//! shutdown of 20,000 ready operations from a second thread that acts once
//! it has seen `is_shutdown` read `true`; each is bounded by a wall-clock
//! timeout.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Wake, Waker};
use std::time::Duration;

use tokio_purgatory::{Completion, OperationError, Purgatory};

mod support;
use support::{within, FlagOp as Op};

/// Runs its closure when woken.
struct FnWaker(Box<dyn Fn() + Send + Sync>);
impl Wake for FnWaker {
    fn wake(self: Arc<Self>) {
        (self.0)()
    }
}

/// A handle's waker, woken by the shutdown itself as it hands an operation
/// back, walks the keys of the others (all ready to complete) and checks
/// them by reference: none completes, and the shutdown hands back all 16.
#[tokio::test(start_paused = true)]
async fn code_the_shutdown_runs_completes_nothing_it_hands_back() {
    let p: Purgatory<u32, Op> = Purgatory::builder().name("s").build().unwrap();
    let n = 16u32;
    let flags: Vec<Arc<AtomicBool>> = (0..n).map(|_| Arc::default()).collect();
    let mut handles = Vec::new();
    for i in 0..n {
        let h = p
            .try_complete_else_watch(
                Op(flags[i as usize].clone()),
                Duration::from_secs(10 + u64::from(i)),
                [i],
            )
            .unwrap();
        handles.push(h);
    }
    // Every op ready now (no event yet): any walk of its key completes it.
    for f in &flags {
        f.store(true, Ordering::SeqCst);
    }
    let walked = Arc::new(AtomicUsize::new(0));
    let by_ref = Arc::new(AtomicUsize::new(0));
    let refs: Arc<Vec<_>> = Arc::new(handles.iter().map(|h| h.op_ref().unwrap()).collect());
    let weak = p.downgrade();
    // Wakes that found the purgatory shut down (a panic in a waker would be
    // contained, so this is counted and checked after).
    let woken_shut = Arc::new(AtomicUsize::new(0));
    let mut cxs = Vec::new();
    for (i, h) in handles.iter_mut().enumerate() {
        let (w, walked, by_ref, refs, woken_shut) = (
            weak.clone(),
            walked.clone(),
            by_ref.clone(),
            refs.clone(),
            woken_shut.clone(),
        );
        let waker = Waker::from(Arc::new(FnWaker(Box::new(move || {
            let Some(p) = w.upgrade() else { return };
            if p.is_shutdown() {
                woken_shut.fetch_add(1, Ordering::SeqCst);
            }
            for k in 0..n {
                if k as usize != i {
                    walked.fetch_add(p.try_complete_watched(&k), Ordering::SeqCst);
                }
            }
            for (j, r) in refs.iter().enumerate() {
                if j != i && r.try_complete() {
                    by_ref.fetch_add(1, Ordering::SeqCst);
                }
            }
        }))));
        let mut cx = Context::from_waker(&waker);
        assert!(Pin::new(&mut *h).poll(&mut cx).is_pending());
        cxs.push(waker);
    }
    let back = p.shutdown();
    let back_n = back.len();
    drop(back);
    let mut outcomes = Vec::new();
    for h in handles {
        outcomes.push(h.await);
    }
    let completed = outcomes
        .iter()
        .filter(|o| matches!(o, Ok(Completion::Completed(_))))
        .count();
    let m = p.metrics();
    assert_eq!(
        m.registered,
        m.completed + m.expired + m.cancelled + m.handed_back
    );
    assert_eq!(
        woken_shut.load(Ordering::SeqCst),
        n as usize,
        "every waker ran, shut down"
    );
    assert_eq!(m.panicked, 0, "no waker panicked");
    assert!(
        walked.load(Ordering::SeqCst) == 0
            && by_ref.load(Ordering::SeqCst) == 0
            && back_n == n as usize,
        "shutdown() handed back {back_n} of {n} pending; walks run inside it completed {}, \
         checks by reference {}; handles completed: {completed}; metrics {m:?}",
        walked.load(Ordering::SeqCst),
        by_ref.load(Ordering::SeqCst)
    );
}

#[derive(Debug, Default)]
struct Round {
    n: usize,
    handed_back: usize,
    /// What the calls made once `is_shutdown()` read `true` did: operations
    /// completed or cancelled, resets that returned `true`.
    took_effect: usize,
    completed_outcomes: usize,
    cancelled_outcomes: usize,
    shutdown_outcomes: usize,
}

#[derive(Clone, Copy, PartialEq)]
enum Act {
    Walk,
    CancelKey,
    ByRef,
    Reset,
}

fn round(n: usize, act: Act) -> Round {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let _g = rt.enter();
    let p: Purgatory<u32, Op> = Purgatory::builder().name("after").build().unwrap();
    let ready = Arc::new(AtomicBool::new(false));
    let mut handles = Vec::with_capacity(n);
    for i in 0..n {
        handles.push(
            p.try_complete_else_watch(Op(ready.clone()), Duration::from_secs(3600), [i as u32])
                .unwrap(),
        );
    }
    ready.store(true, Ordering::SeqCst);
    let refs: Vec<_> = handles.iter().map(|h| h.op_ref().unwrap()).collect();
    let go = Arc::new(AtomicBool::new(false));
    let took_effect = Arc::new(AtomicUsize::new(0));
    let other = {
        let rt_h = rt.handle().clone();
        let (p, go, took) = (p.clone(), go.clone(), took_effect.clone());
        std::thread::spawn(move || {
            let _g = rt_h.enter();
            go.store(true, Ordering::SeqCst);
            while !p.is_shutdown() {
                std::hint::spin_loop();
            }
            // From here on, the shutdown has happened as far as this thread
            // can tell.
            for k in (0..n as u32).rev() {
                let did = match act {
                    Act::Walk => p.try_complete_watched(&k),
                    Act::CancelKey => p.cancel_for_key(&k).len(),
                    Act::ByRef => usize::from(refs[k as usize].try_complete()),
                    Act::Reset => usize::from(refs[k as usize].reset(Duration::from_secs(7200))),
                };
                took.fetch_add(did, Ordering::SeqCst);
            }
        })
    };
    while !go.load(Ordering::SeqCst) {
        std::hint::spin_loop();
    }
    let back = p.shutdown();
    let handed_back = back.len();
    drop(back);
    other.join().unwrap();
    let mut r = Round {
        n,
        handed_back,
        took_effect: took_effect.load(Ordering::SeqCst),
        ..Round::default()
    };
    let outs: Vec<_> = rt.block_on(async {
        let mut v = Vec::new();
        for h in handles {
            v.push(
                tokio::time::timeout(Duration::from_secs(10), h)
                    .await
                    .expect("resolves"),
            );
        }
        v
    });
    for o in outs {
        match o {
            Ok(Completion::Completed(_)) => r.completed_outcomes += 1,
            Err(OperationError::Cancelled) => r.cancelled_outcomes += 1,
            Err(OperationError::Shutdown) => r.shutdown_outcomes += 1,
            other => panic!("{other:?}"),
        }
    }
    let m = p.metrics();
    assert_eq!(
        m.registered,
        m.completed + m.expired + m.cancelled + m.handed_back,
        "{m:?}"
    );
    drop(p);
    rt.shutdown_timeout(Duration::from_secs(5));
    r
}

/// Five rounds of 20,000 ready operations: a call of `act` on every key or
/// operation, made once `is_shutdown()` read `true`, does nothing, and the
/// shutdown hands back all of them.
fn late_calls_do_nothing(act: Act, what: &str) {
    let rounds = within(120, move || {
        (0..5).map(|_| round(20_000, act)).collect::<Vec<_>>()
    });
    let bad: Vec<_> = rounds
        .iter()
        .filter(|r| r.took_effect > 0 || r.handed_back != r.n)
        .collect();
    assert!(
        bad.is_empty(),
        "{} of {} rounds: {what} after is_shutdown() took effect: {:?}",
        bad.len(),
        rounds.len(),
        bad
    );
}

/// Walks complete nothing: the shutdown hands back what they would have.
#[test]
fn walks_once_is_shutdown_reads_true_complete_nothing() {
    late_calls_do_nothing(Act::Walk, "walks");
}

/// `cancel_for_key` takes nothing.
#[test]
fn cancels_by_key_once_is_shutdown_reads_true_take_nothing() {
    late_calls_do_nothing(Act::CancelKey, "cancel_for_key");
}

/// `OpRef::try_complete` completes nothing.
#[test]
fn checks_by_reference_once_is_shutdown_reads_true_complete_nothing() {
    late_calls_do_nothing(Act::ByRef, "OpRef::try_complete");
}

/// `OpRef::reset` returns `false`.
#[test]
fn resets_once_is_shutdown_reads_true_return_false() {
    late_calls_do_nothing(Act::Reset, "OpRef::reset");
}
