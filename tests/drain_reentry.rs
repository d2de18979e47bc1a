//! Drains meeting user code and other threads: drains whose wakers call back
//! in (one shuts the purgatory down, one registers) beside a drain dropped
//! while it waits, on paused Tokio time; and a drain waiting through a
//! shutdown while the last pending operation's check is held on another
//! thread (real threads, bounded). It holds the crate to `Purgatory::drain`:
//! "Several tasks may drain at once; each returns once nothing is pending",
//! "Dropping the future stops the wait only", "A shutdown during the drain
//! hands the operations back, and the drain then returns", registrations
//! "refused and the operation handed back, in `WatchError::Draining` (or in
//! the refusal checked before it ...: shut down ...)"; to
//! `Purgatory::shutdown`: "An operation being checked ... at this moment is
//! not in the list: it finishes by that check ..., or, after a check that did
//! not complete it, is dropped there (counted as cancelled) and its handle
//! resolves to `OperationError::Shutdown`"; and to "No lock of ours is held
//! while operation code runs", wakers included: nothing deadlocks and the
//! counts balance.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use tokio_purgatory::{Operation, OperationError, Purgatory, WatchErrorKind};
use tokio_test::{assert_pending, assert_ready, task};

mod support;
use support::{balanced, ms, paused_within, settle};

/// Completes once `ready` is set. With a gate, each check first says it has
/// entered and then waits to be released.
struct Op {
    id: u32,
    ready: Arc<AtomicBool>,
    gate: Option<Gate>,
}

/// Where a check says it entered, and what it waits on.
type Gate = (mpsc::Sender<()>, Arc<Mutex<mpsc::Receiver<()>>>);

impl Op {
    fn new(id: u32) -> Op {
        Op {
            id,
            ready: Arc::default(),
            gate: None,
        }
    }
}

impl Operation for Op {
    type Output = ();
    fn try_complete(&mut self) -> Option<()> {
        if let Some((entered, release)) = &self.gate {
            if entered.send(()).is_ok() {
                let _ = release.lock().unwrap().recv();
            }
        }
        self.ready.load(Ordering::SeqCst).then_some(())
    }
    fn on_expiration(self) {}
}

type P = Purgatory<u32, Op>;

/// Runs its closure when woken.
struct FnWaker(Box<dyn Fn() + Send + Sync>);

impl Wake for FnWaker {
    fn wake(self: Arc<Self>) {
        (self.0)()
    }
    fn wake_by_ref(self: &Arc<Self>) {
        (self.0)()
    }
}

/// A waker running `f`.
fn waker(f: impl Fn() + Send + Sync + 'static) -> Waker {
    Waker::from(Arc::new(FnWaker(Box::new(f))))
}

/// Polls `d` once with `w`.
fn poll<F: Future<Output = ()>>(d: &mut Pin<Box<F>>, w: &Waker) -> Poll<()> {
    d.as_mut().poll(&mut Context::from_waker(w))
}

/// Three drains wait on three pending operations: the first's waker shuts
/// the purgatory down, the second's registers, the third is dropped while
/// it waits. One completion wakes them: the shutdown hands back the other
/// two operations (their handles read `Shutdown`), the registration is
/// refused (`Draining` or `Shutdown`, whichever its waker met first) with
/// its operation handed back and counted once, the dropped drain is never
/// woken, both others end, and the counts balance.
#[tokio::test(start_paused = true)]
async fn drain_wakers_that_shut_down_and_register_beside_a_dropped_drain() {
    let p: P = Purgatory::builder().build().unwrap();
    let a = Op::new(1);
    let ready = a.ready.clone();
    let ha = p.try_complete_else_watch(a, ms(1000), [1]).unwrap();
    let hb = p
        .try_complete_else_watch(Op::new(2), ms(1000), [2])
        .unwrap();
    let hc = p
        .try_complete_else_watch(Op::new(3), ms(1000), [3])
        .unwrap();

    let handed: Arc<Mutex<Vec<u32>>> = Arc::default();
    let refused: Arc<Mutex<Vec<WatchErrorKind>>> = Arc::default();
    let shuts_down = {
        let (weak, handed) = (p.downgrade(), handed.clone());
        waker(move || {
            if let Some(p) = weak.upgrade() {
                let back = p.shutdown();
                handed.lock().unwrap().extend(back.iter().map(|op| op.id));
            }
        })
    };
    let registers = {
        let (weak, refused) = (p.downgrade(), refused.clone());
        waker(move || {
            if let Some(p) = weak.upgrade() {
                match p.try_complete_else_watch(Op::new(9), ms(10), [9]) {
                    Ok(_) => panic!("a draining purgatory took an operation"),
                    Err(e) => {
                        refused.lock().unwrap().push(e.kind());
                        assert_eq!(e.into_inner().id, 9, "handed back");
                    }
                }
            }
        })
    };
    let woke_dropped = Arc::new(AtomicUsize::new(0));
    let counts = {
        let woke = woke_dropped.clone();
        waker(move || {
            woke.fetch_add(1, Ordering::SeqCst);
        })
    };
    let mut first = Box::pin(p.drain());
    let mut second = Box::pin(p.drain());
    let mut dropped = Box::pin(p.drain());
    assert!(poll(&mut first, &shuts_down).is_pending());
    assert!(poll(&mut second, &registers).is_pending());
    assert!(poll(&mut dropped, &counts).is_pending());
    drop(dropped);
    ready.store(true, Ordering::SeqCst);
    assert_eq!(p.try_complete_watched(&1), 1);
    let mut handed = std::mem::take(&mut *handed.lock().unwrap());
    handed.sort();
    assert_eq!(handed, [2, 3], "the shutdown handed back the other two");
    let refused = refused.lock().unwrap().clone();
    assert!(
        matches!(
            refused[..],
            [WatchErrorKind::Draining | WatchErrorKind::Shutdown]
        ),
        "{refused:?}"
    );
    assert!(poll(&mut first, &shuts_down).is_ready());
    assert!(poll(&mut second, &registers).is_ready());
    assert_eq!(
        woke_dropped.load(Ordering::SeqCst),
        0,
        "a dropped drain is not woken"
    );
    assert!(ha.await.is_ok());
    assert_eq!(hb.await, Err(OperationError::Shutdown));
    assert_eq!(hc.await, Err(OperationError::Shutdown));
    let m = p.metrics();
    assert!(balanced(&m), "{m:?}");
    assert_eq!(
        (m.registered, m.completed, m.handed_back),
        (3, 1, 2),
        "{m:?}"
    );
    assert_eq!(m.refused.total(), 1, "{m:?}");
}

/// A drain waits while the last pending operation's check is held on
/// another thread; a shutdown then hands back nothing (the operation is
/// being checked). The drain still waits for that check, and ends once it
/// returns: completed, the operation counts as such; told "not yet", it is
/// dropped there, counted as cancelled, and its handle reads `Shutdown`.
/// Bounded: 20 s, and 10 s for the check to start.
#[test]
fn a_drain_waits_for_a_check_running_through_a_shutdown() {
    for completes in [false, true] {
        paused_within(20, move || async move {
            let p: P = Purgatory::builder().build().unwrap();
            let (entered_tx, entered) = mpsc::channel();
            let (release, release_rx) = mpsc::channel::<()>();
            let op = Op::new(1);
            let ready = op.ready.clone();
            let h = p.try_complete_else_watch(op, ms(1000), [1]).unwrap();
            // The gate goes in after the registration's own checks.
            let r = h.op_ref().unwrap();
            r.update(|op| op.gate = Some((entered_tx, Arc::new(Mutex::new(release_rx)))));
            let walker = {
                let p = p.clone();
                std::thread::spawn(move || p.try_complete_watched(&1))
            };
            entered
                .recv_timeout(Duration::from_secs(10))
                .expect("the walk's check started");
            let mut d = task::spawn(p.drain());
            assert_pending!(d.poll());
            assert!(p.shutdown().is_empty(), "being checked: not handed back");
            settle().await;
            assert_pending!(d.poll(), "the check still runs: the operation is pending");
            ready.store(completes, Ordering::SeqCst);
            release.send(()).unwrap();
            drop(release);
            assert_eq!(walker.join().unwrap(), usize::from(completes));
            assert!(d.is_woken());
            assert_ready!(d.poll());
            let out = h.await;
            if completes {
                assert!(out.is_ok(), "{out:?}");
            } else {
                assert_eq!(out, Err(OperationError::Shutdown));
            }
            let m = p.metrics();
            assert!(balanced(&m), "{m:?}");
            assert_eq!(
                (m.completed, m.cancelled, m.handed_back),
                (u64::from(completes), u64::from(!completes), 0),
                "{m:?}"
            );
            assert_eq!(m.delayed, 0, "{m:?}");
        });
    }
}
