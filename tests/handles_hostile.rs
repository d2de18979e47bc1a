//! The handles used hostilely: `OperationHandle` and `OpRef` in every state
//! (statuses after each kind of finish, what `cancel`, `update`, `reset` and
//! `try_complete` return once finished, after shutdown and with the purgatory
//! dropped, `Drop` at every state), outputs whose `Drop` panics or calls back
//! in on every path, wakers that panic or call back in, operations dropping
//! or cancelling their own handle, `WeakPurgatory` during a close, the error
//! and completion values, and a cross-thread stress of all of it.

mod support;

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, RawWaker, RawWakerVTable, Waker};
use std::time::Duration;

use support::{balanced, ms, settle};
use tokio::time::advance;
use tokio_purgatory::{
    Completion, OpRef, Operation, OperationError, OperationHandle, OperationStatus, Purgatory,
    WatchError, WatchErrorKind,
};

// ---------------------------------------------------------------- helpers

/// An output that counts its drops, and may panic or run a hook when dropped.
struct Out {
    drops: Arc<AtomicUsize>,
    panic: bool,
    hook: Option<Box<dyn FnOnce() + Send>>,
}

impl std::fmt::Debug for Out {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Out")
    }
}

impl Drop for Out {
    fn drop(&mut self) {
        self.drops.fetch_add(1, Ordering::SeqCst);
        if let Some(h) = self.hook.take() {
            h();
        }
        if self.panic {
            panic!("hostile output drop");
        }
    }
}

/// Run once, when set.
type Hook = Arc<Mutex<Option<Box<dyn FnOnce() + Send>>>>;
/// Run in each check, when set.
type CheckHook = Arc<Mutex<Option<Box<dyn FnMut() + Send>>>>;

/// A configurable operation.
struct Op {
    ready: Arc<AtomicBool>,
    drops: Arc<AtomicUsize>,
    out_drops: Arc<AtomicUsize>,
    out_panics: bool,
    drop_panics: bool,
    expiry_panics: bool,
    /// Run once in the op's Drop.
    drop_hook: Hook,
    /// Run in on_expiration.
    expiry_hook: Hook,
    /// Run in each try_complete.
    check_hook: CheckHook,
    /// Run in the output's Drop.
    out_hook: Hook,
}

impl Op {
    fn new() -> Op {
        Op {
            ready: Arc::new(AtomicBool::new(false)),
            drops: Arc::new(AtomicUsize::new(0)),
            out_drops: Arc::new(AtomicUsize::new(0)),
            out_panics: false,
            drop_panics: false,
            expiry_panics: false,
            drop_hook: Arc::new(Mutex::new(None)),
            expiry_hook: Arc::new(Mutex::new(None)),
            check_hook: Arc::new(Mutex::new(None)),
            out_hook: Arc::new(Mutex::new(None)),
        }
    }
    fn out(&self) -> Out {
        Out {
            drops: self.out_drops.clone(),
            panic: self.out_panics,
            hook: self.out_hook.lock().unwrap().take(),
        }
    }
}

impl Operation for Op {
    type Output = Out;
    fn try_complete(&mut self) -> Option<Out> {
        let hook = self.check_hook.lock().unwrap().take();
        if let Some(mut h) = hook {
            h();
            *self.check_hook.lock().unwrap() = Some(h);
        }
        self.ready.load(Ordering::SeqCst).then(|| self.out())
    }
    fn on_expiration(self) -> Out {
        let hook = self.expiry_hook.lock().unwrap().take();
        if let Some(h) = hook {
            h();
        }
        if self.expiry_panics {
            panic!("hostile expiry");
        }
        self.out()
    }
}

impl Drop for Op {
    fn drop(&mut self) {
        self.drops.fetch_add(1, Ordering::SeqCst);
        let hook = self.drop_hook.lock().unwrap().take();
        if let Some(h) = hook {
            h();
        }
        if self.drop_panics {
            panic!("hostile op drop");
        }
    }
}

type P = Purgatory<u32, Op>;

fn purg(name: &str) -> P {
    Purgatory::builder().name(name).build().unwrap()
}

fn noop_waker() -> Waker {
    futures::task::noop_waker()
}

fn poll_once<F: Future + Unpin>(f: &mut F) -> Poll<F::Output> {
    let w = noop_waker();
    let mut cx = Context::from_waker(&w);
    Pin::new(f).poll(&mut cx)
}

/// Waits for the reaper, then checks the books: nothing pending, balanced,
/// nothing watched, no tombstones, no keys.
async fn assert_clean(p: &P) {
    settle().await;
    let m = p.metrics();
    assert_eq!(m.delayed, 0, "{m:?}");
    assert!(balanced(&m), "{m:?}");
    assert_eq!(m.watched, 0, "{m:?}");
    assert_eq!(m.tombstones, 0, "{m:?}");
    assert_eq!(m.keys, 0, "{m:?}");
}

// ---------------------------------------------------------------- statuses

#[tokio::test(start_paused = true)]
async fn status_after_each_kind_of_finish() {
    let p = purg("status");

    // Completed by a walk.
    let op = Op::new();
    let ready = op.ready.clone();
    let h = p.try_complete_else_watch(op, ms(100), [1, 2]).unwrap();
    let r = h.op_ref().unwrap();
    assert_eq!(r.status(), OperationStatus::Pending);
    ready.store(true, Ordering::SeqCst);
    assert_eq!(p.try_complete_watched(&1), 1);
    assert_eq!(r.status(), OperationStatus::Completed);
    assert!(r.is_finished());
    assert!(h.is_finished());
    assert!(h.await.unwrap().is_completed());
    assert_eq!(r.status(), OperationStatus::Completed);
    drop(r);

    // Completed by reference.
    let op = Op::new();
    let ready = op.ready.clone();
    let h = p.try_complete_else_watch(op, ms(100), [1, 2]).unwrap();
    let r = h.op_ref().unwrap();
    ready.store(true, Ordering::SeqCst);
    assert!(r.try_complete());
    assert!(!r.try_complete());
    assert_eq!(r.status(), OperationStatus::Completed);
    assert!(h.await.unwrap().is_completed());

    // Expired.
    let h = p
        .try_complete_else_watch(Op::new(), ms(100), [1, 2])
        .unwrap();
    let r = h.op_ref().unwrap();
    assert!(h.await.unwrap().is_expired());
    assert_eq!(r.status(), OperationStatus::Expired);
    assert!(!r.reset(ms(10)));
    assert!(r.cancel().is_none());
    assert!(r.update(|_| ()).is_none());

    // Expiry panicked: Expired status, Panicked outcome.
    let mut op = Op::new();
    op.expiry_panics = true;
    let h = p.try_complete_else_watch(op, ms(100), [1, 2]).unwrap();
    let r = h.op_ref().unwrap();
    assert_eq!(h.await.unwrap_err(), OperationError::Panicked);
    assert_eq!(r.status(), OperationStatus::Expired);

    // Cancelled by handle.cancel().
    let h = p
        .try_complete_else_watch(Op::new(), ms(100), [1, 2])
        .unwrap();
    let r = h.op_ref().unwrap();
    let back = h.cancel();
    assert!(back.is_some());
    assert_eq!(r.status(), OperationStatus::Cancelled);
    drop(back);

    // Cancelled by dropping the handle.
    let op = Op::new();
    let drops = op.drops.clone();
    let h = p.try_complete_else_watch(op, ms(100), [1, 2]).unwrap();
    let r = h.op_ref().unwrap();
    drop(h);
    assert_eq!(drops.load(Ordering::SeqCst), 1, "dropped at once");
    assert_eq!(r.status(), OperationStatus::Cancelled);

    // Cancelled by OpRef.
    let h = p
        .try_complete_else_watch(Op::new(), ms(100), [1, 2])
        .unwrap();
    let r = h.op_ref().unwrap();
    assert!(r.cancel().is_some());
    assert!(r.cancel().is_none());
    assert_eq!(r.status(), OperationStatus::Cancelled);
    assert_eq!(h.await.unwrap_err(), OperationError::Cancelled);

    // Cancelled by key.
    let h = p
        .try_complete_else_watch(Op::new(), ms(100), [1, 2])
        .unwrap();
    let r = h.op_ref().unwrap();
    assert_eq!(p.cancel_for_key(&2).len(), 1);
    assert_eq!(r.status(), OperationStatus::Cancelled);
    assert_eq!(h.await.unwrap_err(), OperationError::Cancelled);

    assert_clean(&p).await;
    let m = p.metrics();
    assert_eq!(
        (
            m.registered,
            m.completed,
            m.expired,
            m.cancelled,
            m.handed_back
        ),
        (8, 2, 2, 4, 0),
        "{m:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn status_after_shutdown_and_after_drop() {
    let p = purg("shutdown");
    let h = p
        .try_complete_else_watch(Op::new(), ms(100), [1, 2])
        .unwrap();
    let r = h.op_ref().unwrap();
    let h2 = p
        .try_complete_else_watch(Op::new(), ms(100), [2, 3])
        .unwrap();
    let r2 = h2.into_op_ref().unwrap();
    let back = p.shutdown();
    assert_eq!(back.len(), 2);
    assert_eq!(r.status(), OperationStatus::HandedBack);
    assert_eq!(r2.status(), OperationStatus::HandedBack);
    assert!(!r.try_complete());
    assert!(r.cancel().is_none());
    assert!(!r.reset(ms(1)));
    assert!(r.update(|_| 1).is_none());
    assert_eq!(h.await.unwrap_err(), OperationError::Shutdown);
    drop(back);
    let m = p.metrics();
    assert_eq!(m.handed_back, 2);
    assert!(balanced(&m));
    assert_eq!(
        (m.delayed, m.watched, m.tombstones, m.keys),
        (0, 0, 0, 0),
        "{m:?}"
    );
    let w = p.downgrade();
    assert!(w.upgrade().is_some(), "shut down, still alive");
    assert!(w.upgrade().unwrap().is_shutdown());

    // Dropped with its purgatory.
    let p = purg("dropped");
    let op = Op::new();
    let drops = op.drops.clone();
    let h = p.try_complete_else_watch(op, ms(100), [1, 2]).unwrap();
    let r = h.op_ref().unwrap();
    let w = p.downgrade();
    drop(p);
    assert!(
        w.upgrade().is_none(),
        "handles and OpRefs do not keep it alive"
    );
    assert_eq!(drops.load(Ordering::SeqCst), 1);
    assert_eq!(r.status(), OperationStatus::Cancelled);
    assert!(!r.try_complete());
    assert!(r.cancel().is_none());
    assert!(!r.reset(ms(1)));
    assert!(r.update(|_| 1).is_none());
    assert!(r.is_finished());
    assert_eq!(h.await.unwrap_err(), OperationError::Shutdown);
    drop(r);
}

// ---------------------------------------------------------------- cancel return values

#[tokio::test(start_paused = true)]
async fn handle_cancel_in_every_state() {
    let p = purg("cancel");

    // Ready (completed at registration): None, output dropped at once.
    let op = Op::new();
    op.ready.store(true, Ordering::SeqCst);
    let out_drops = op.out_drops.clone();
    let h = p.try_complete_else_watch(op, ms(100), [1]).unwrap();
    assert!(h.is_finished());
    assert!(h.op_ref().is_none());
    assert!(!h.reset(ms(1)));
    assert!(h.cancel().is_none());
    assert_eq!(out_drops.load(Ordering::SeqCst), 1);

    // Finished, outcome unread: None, output dropped at once.
    let op = Op::new();
    let out_drops = op.out_drops.clone();
    let h = p.try_complete_else_watch(op, ms(10), [1]).unwrap();
    advance(ms(20)).await;
    settle().await;
    assert!(h.is_finished());
    assert_eq!(out_drops.load(Ordering::SeqCst), 0, "kept for the handle");
    assert!(h.cancel().is_none());
    assert_eq!(out_drops.load(Ordering::SeqCst), 1, "dropped at once");

    // Pending: Some.
    let op = Op::new();
    let drops = op.drops.clone();
    let h = p.try_complete_else_watch(op, ms(10), [1]).unwrap();
    let back = h.cancel().unwrap();
    assert_eq!(drops.load(Ordering::SeqCst), 0);
    drop(back);

    // Polled to Ready through &mut: None afterwards.
    let mut h = p.try_complete_else_watch(Op::new(), ms(10), [1]).unwrap();
    assert!((&mut h).await.unwrap().is_expired());
    assert!(h.is_finished());
    assert!(h.op_ref().is_none());
    assert!(!h.reset(ms(1)));
    assert!(h.cancel().is_none());

    assert_clean(&p).await;
}

// ---------------------------------------------------------------- drops at every state

#[tokio::test(start_paused = true)]
async fn handle_drop_at_every_state_frees_at_once() {
    let p = purg("drops");

    // Ready, never polled.
    let op = Op::new();
    op.ready.store(true, Ordering::SeqCst);
    let (drops, out_drops) = (op.drops.clone(), op.out_drops.clone());
    let h = p.try_complete_else_watch(op, ms(100), [1]).unwrap();
    assert_eq!(drops.load(Ordering::SeqCst), 1, "op dropped at completion");
    drop(h);
    assert_eq!(out_drops.load(Ordering::SeqCst), 1);

    // Waiting, pending.
    let op = Op::new();
    let (drops, out_drops) = (op.drops.clone(), op.out_drops.clone());
    let h = p.try_complete_else_watch(op, ms(100), [1]).unwrap();
    drop(h);
    assert_eq!(drops.load(Ordering::SeqCst), 1);
    assert_eq!(out_drops.load(Ordering::SeqCst), 0);

    // Waiting, completed unread.
    let op = Op::new();
    let (drops, out_drops, ready) = (op.drops.clone(), op.out_drops.clone(), op.ready.clone());
    let h = p.try_complete_else_watch(op, ms(100), [1]).unwrap();
    ready.store(true, Ordering::SeqCst);
    assert_eq!(p.try_complete_watched(&1), 1);
    assert_eq!(drops.load(Ordering::SeqCst), 1);
    assert_eq!(out_drops.load(Ordering::SeqCst), 0);
    drop(h);
    assert_eq!(out_drops.load(Ordering::SeqCst), 1);

    // Waiting, polled once (waker stored), then dropped.
    let op = Op::new();
    let drops = op.drops.clone();
    let mut h = p.try_complete_else_watch(op, ms(100), [1]).unwrap();
    assert!(poll_once(&mut h).is_pending());
    drop(h);
    assert_eq!(drops.load(Ordering::SeqCst), 1);

    // Taken (polled to Ready) then dropped.
    let op = Op::new();
    let out_drops = op.out_drops.clone();
    let mut h = p.try_complete_else_watch(op, ms(10), [1]).unwrap();
    let out = (&mut h).await.unwrap();
    drop(h);
    assert_eq!(out_drops.load(Ordering::SeqCst), 0, "the caller has it");
    drop(out);
    assert_eq!(out_drops.load(Ordering::SeqCst), 1);

    assert_clean(&p).await;
    let m = p.metrics();
    assert_eq!((m.completed, m.expired, m.cancelled), (2, 1, 2), "{m:?}");
}

#[tokio::test(start_paused = true)]
#[should_panic(expected = "polled after it returned Ready")]
async fn poll_after_ready_panics_ready_variant() {
    let p = purg("poll");
    let op = Op::new();
    op.ready.store(true, Ordering::SeqCst);
    let mut h = p.try_complete_else_watch(op, ms(100), [1]).unwrap();
    assert!(poll_once(&mut h).is_ready());
    let _ = poll_once(&mut h);
}

#[tokio::test(start_paused = true)]
#[should_panic(expected = "polled after it returned Ready")]
async fn poll_after_ready_panics_waiting_variant() {
    let p = purg("poll");
    let mut h = p.try_complete_else_watch(Op::new(), ms(10), [1]).unwrap();
    let _ = (&mut h).await;
    let _ = poll_once(&mut h);
}

// ---------------------------------------------------------------- hostile outputs

#[tokio::test(start_paused = true)]
async fn panicking_output_drops_are_contained_everywhere() {
    let p = purg("outpanic");
    let mut panics = 0;

    // Ready handle dropped.
    let mut op = Op::new();
    op.out_panics = true;
    op.ready.store(true, Ordering::SeqCst);
    drop(p.try_complete_else_watch(op, ms(100), [1]).unwrap());
    panics += 1;
    assert_eq!(p.metrics().panicked, panics);

    // Ready handle cancelled / detached / into_op_ref.
    for way in 0..3 {
        let mut op = Op::new();
        op.out_panics = true;
        op.ready.store(true, Ordering::SeqCst);
        let h = p.try_complete_else_watch(op, ms(100), [1]).unwrap();
        match way {
            0 => assert!(h.cancel().is_none()),
            1 => h.detach(),
            _ => assert!(h.into_op_ref().is_none()),
        }
        panics += 1;
        assert_eq!(p.metrics().panicked, panics, "way {way}");
    }

    // Waiting handle with unread outcome: drop / cancel / detach / into_op_ref.
    for way in 0..4 {
        let mut op = Op::new();
        op.out_panics = true;
        let ready = op.ready.clone();
        let h = p.try_complete_else_watch(op, ms(100), [1]).unwrap();
        ready.store(true, Ordering::SeqCst);
        assert_eq!(p.try_complete_watched(&1), 1);
        match way {
            0 => drop(h),
            1 => assert!(h.cancel().is_none()),
            2 => h.detach(),
            _ => {
                let r = h.into_op_ref().expect("registered");
                assert_eq!(r.status(), OperationStatus::Completed);
            }
        }
        panics += 1;
        assert_eq!(p.metrics().panicked, panics, "way {way}");
    }

    // Detached before completion: dropped at delivery.
    let mut op = Op::new();
    op.out_panics = true;
    let ready = op.ready.clone();
    p.try_complete_else_watch(op, ms(100), [1])
        .unwrap()
        .detach();
    ready.store(true, Ordering::SeqCst);
    assert_eq!(p.try_complete_watched(&1), 1);
    panics += 1;
    assert_eq!(p.metrics().panicked, panics);

    // Detached, expires.
    let mut op = Op::new();
    op.out_panics = true;
    p.try_complete_else_watch(op, ms(10), [1]).unwrap().detach();
    advance(ms(20)).await;
    settle().await;
    panics += 1;
    assert_eq!(p.metrics().panicked, panics);

    assert_clean(&p).await;
}

/// An output whose Drop re-enters the purgatory (registers, walks, cancels,
/// shuts down) when the handle drops it unread.
#[tokio::test(start_paused = true)]
async fn output_drop_reenters_from_every_handle_path() {
    for way in 0..4 {
        let p = purg("outreenter");
        let op = Op::new();
        let ready = op.ready.clone();
        let pp = p.clone();
        let registered = Arc::new(AtomicBool::new(false));
        let reg = registered.clone();
        *op.out_hook.lock().unwrap() = Some(Box::new(move || {
            let h = pp.try_complete_else_watch(Op::new(), ms(50), [9]).unwrap();
            h.detach();
            pp.try_complete_watched(&9);
            drop(pp.cancel_for_key(&7));
            reg.store(true, Ordering::SeqCst);
            drop(pp.shutdown());
        }));
        let h = p.try_complete_else_watch(op, ms(100), [1]).unwrap();
        ready.store(true, Ordering::SeqCst);
        assert_eq!(p.try_complete_watched(&1), 1);
        support::within(5, move || match way {
            0 => drop(h),
            1 => assert!(h.cancel().is_none()),
            2 => h.detach(),
            _ => drop(h.into_op_ref()),
        });
        assert!(registered.load(Ordering::SeqCst));
        assert!(p.is_shutdown());
        let m = p.metrics();
        assert_eq!(m.delayed, 0, "{m:?}");
        assert!(balanced(&m), "{m:?}");
        assert_eq!(
            (m.watched, m.tombstones, m.keys),
            (0, 0, 0),
            "way {way}: {m:?}"
        );
    }
}

// ---------------------------------------------------------------- OpRef from inside

#[tokio::test(start_paused = true)]
async fn opref_from_inside_on_expiration_and_drop() {
    let p = purg("inside");
    let op = Op::new();
    let slot: Arc<Mutex<Option<OpRef<u32, Op>>>> = Arc::new(Mutex::new(None));
    let seen = Arc::new(Mutex::new(Vec::new()));
    {
        let (slot, seen) = (slot.clone(), seen.clone());
        *op.expiry_hook.lock().unwrap() = Some(Box::new(move || {
            let r = slot.lock().unwrap().clone().unwrap();
            seen.lock().unwrap().push(format!(
                "exp {:?} {} {} {} {:?}",
                r.status(),
                r.is_finished(),
                r.try_complete(),
                r.reset(ms(1)),
                r.update(|_| ()).is_some(),
            ));
            assert!(r.cancel().is_none());
        }));
    }
    {
        let (slot, seen) = (slot.clone(), seen.clone());
        *op.drop_hook.lock().unwrap() = Some(Box::new(move || {
            let r = slot.lock().unwrap().take().unwrap();
            seen.lock().unwrap().push(format!(
                "drop {:?} {} {} {} {:?}",
                r.status(),
                r.is_finished(),
                r.try_complete(),
                r.reset(ms(1)),
                r.update(|_| ()).is_some(),
            ));
            assert!(r.cancel().is_none());
        }));
    }
    let h = p.try_complete_else_watch(op, ms(10), [1]).unwrap();
    *slot.lock().unwrap() = h.op_ref();
    let out = h.await;
    assert!(out.unwrap().is_expired());
    assert_eq!(
        *seen.lock().unwrap(),
        vec![
            "exp Expired true false false false".to_string(),
            "drop Expired true false false false".to_string()
        ]
    );
    assert_clean(&p).await;
}

/// The operation holds its own handle (through a slot) and drops it from
/// its check, its expiry, or its Drop.
#[tokio::test(start_paused = true)]
async fn operation_drops_its_own_handle() {
    type Slot = Arc<Mutex<Option<OperationHandle<u32, Op>>>>;
    // From its check, then says not yet: cancelled.
    let p = purg("own");
    let op = Op::new();
    let slot: Slot = Arc::new(Mutex::new(None));
    let drops = op.drops.clone();
    {
        let slot = slot.clone();
        *op.check_hook.lock().unwrap() = Some(Box::new(move || {
            let h = slot.lock().unwrap().take();
            if let Some(h) = h {
                assert!(h.cancel().is_none(), "its check is running");
            }
        }));
    }
    let h = p.try_complete_else_watch(op, ms(100), [1]).unwrap();
    let r = h.op_ref().unwrap();
    *slot.lock().unwrap() = Some(h);
    assert_eq!(p.try_complete_watched(&1), 0);
    assert_eq!(r.status(), OperationStatus::Cancelled);
    assert_eq!(drops.load(Ordering::SeqCst), 1);
    drop(r);
    assert_clean(&p).await;

    // From its check, then completes: completed, output dropped.
    let op = Op::new();
    let slot: Slot = Arc::new(Mutex::new(None));
    let (ready, out_drops) = (op.ready.clone(), op.out_drops.clone());
    {
        let slot = slot.clone();
        *op.check_hook.lock().unwrap() = Some(Box::new(move || {
            drop(slot.lock().unwrap().take());
        }));
    }
    let h = p.try_complete_else_watch(op, ms(100), [1]).unwrap();
    let r = h.op_ref().unwrap();
    *slot.lock().unwrap() = Some(h);
    ready.store(true, Ordering::SeqCst);
    assert_eq!(p.try_complete_watched(&1), 1);
    assert_eq!(r.status(), OperationStatus::Completed);
    assert_eq!(out_drops.load(Ordering::SeqCst), 1);
    drop(r);
    assert_clean(&p).await;

    // From its expiry.
    let op = Op::new();
    let slot: Slot = Arc::new(Mutex::new(None));
    let out_drops = op.out_drops.clone();
    {
        let slot = slot.clone();
        *op.expiry_hook.lock().unwrap() = Some(Box::new(move || {
            let h = slot.lock().unwrap().take().unwrap();
            // Expiring (its state reads finished), its outcome not yet there.
            assert!(!h.is_finished());
            assert!(h.cancel().is_none());
        }));
    }
    let h = p.try_complete_else_watch(op, ms(10), [1]).unwrap();
    let r = h.op_ref().unwrap();
    *slot.lock().unwrap() = Some(h);
    advance(ms(20)).await;
    settle().await;
    assert_eq!(r.status(), OperationStatus::Expired);
    assert_eq!(out_drops.load(Ordering::SeqCst), 1);
    drop(r);
    assert_clean(&p).await;

    // From its Drop, when completed.
    let op = Op::new();
    let slot: Slot = Arc::new(Mutex::new(None));
    let (ready, out_drops) = (op.ready.clone(), op.out_drops.clone());
    {
        let slot = slot.clone();
        *op.drop_hook.lock().unwrap() = Some(Box::new(move || {
            let h = slot.lock().unwrap().take().unwrap();
            drop(h);
        }));
    }
    let h = p.try_complete_else_watch(op, ms(100), [1]).unwrap();
    let r = h.op_ref().unwrap();
    *slot.lock().unwrap() = Some(h);
    ready.store(true, Ordering::SeqCst);
    assert_eq!(p.try_complete_watched(&1), 1);
    assert_eq!(r.status(), OperationStatus::Completed);
    assert_eq!(out_drops.load(Ordering::SeqCst), 1);
    drop(r);
    assert_clean(&p).await;
    let m = p.metrics();
    assert_eq!(
        (m.registered, m.completed, m.expired, m.cancelled),
        (4, 2, 1, 1)
    );
}

// ---------------------------------------------------------------- wakers

thread_local! {
    static CLONE_PANICS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    static DROP_PANICS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    static WAKE_PANICS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}
static WAKES: AtomicUsize = AtomicUsize::new(0);

fn hostile_waker(tag: usize) -> Waker {
    fn clone(p: *const ()) -> RawWaker {
        if CLONE_PANICS.with(|c| c.get()) {
            panic!("hostile waker clone");
        }
        RawWaker::new(p, &VTABLE)
    }
    fn wake(p: *const ()) {
        WAKES.fetch_add(1, Ordering::SeqCst);
        if WAKE_PANICS.with(|c| c.get()) {
            panic!("hostile wake");
        }
        drop_it(p)
    }
    fn wake_by_ref(_: *const ()) {
        WAKES.fetch_add(1, Ordering::SeqCst);
        if WAKE_PANICS.with(|c| c.get()) {
            panic!("hostile wake");
        }
    }
    fn drop_it(_: *const ()) {
        if DROP_PANICS.with(|c| c.get()) {
            panic!("hostile waker drop");
        }
    }
    static VTABLE: RawWakerVTable = RawWakerVTable::new(clone, wake, wake_by_ref, drop_it);
    // SAFETY: the vtable never dereferences the data pointer (used as a tag).
    unsafe { Waker::from_raw(RawWaker::new(tag as *const (), &VTABLE)) }
}

#[test]
fn waker_clone_panic_propagates_and_the_handle_still_resolves() {
    support::paused_within(10, || async {
        let p = purg("clonepanic");
        let mut h = p.try_complete_else_watch(Op::new(), ms(10), [1]).unwrap();
        let w = hostile_waker(1);
        CLONE_PANICS.with(|c| c.set(true));
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut cx = Context::from_waker(&w);
            Pin::new(&mut h).poll(&mut cx)
        }));
        CLONE_PANICS.with(|c| c.set(false));
        assert!(r.is_err(), "clone's panic reaches the poller");
        drop(w);
        assert!(h.await.unwrap().is_expired());
        assert_clean(&p).await;
    });
}

#[test]
fn waker_wake_and_drop_panics_are_contained_and_counted() {
    support::paused_within(10, || async {
        let p = purg("wakepanic");
        // Poll with waker 1 (drop panics), then with waker 2: 1 is replaced and dropped.
        let op = Op::new();
        let ready = op.ready.clone();
        let mut h = p.try_complete_else_watch(op, ms(100), [1]).unwrap();
        let w1 = hostile_waker(1);
        let w2 = hostile_waker(2);
        assert!(Pin::new(&mut h)
            .poll(&mut Context::from_waker(&w1))
            .is_pending());
        DROP_PANICS.with(|c| c.set(true));
        assert!(Pin::new(&mut h)
            .poll(&mut Context::from_waker(&w2))
            .is_pending());
        let after_replace = p.metrics().panicked;
        assert_eq!(after_replace, 1, "the replaced waker's drop");
        // Completion wakes waker 2, whose wake panics (and the drop inside it).
        WAKE_PANICS.with(|c| c.set(true));
        ready.store(true, Ordering::SeqCst);
        let before = WAKES.load(Ordering::SeqCst);
        assert_eq!(p.try_complete_watched(&1), 1);
        WAKE_PANICS.with(|c| c.set(false));
        assert_eq!(WAKES.load(Ordering::SeqCst), before + 1);
        assert_eq!(p.metrics().panicked, 2);
        // The outcome is there.
        let got = Pin::new(&mut h).poll(&mut Context::from_waker(&w2));
        // the clone of w2 is not taken when an outcome is stored
        assert!(matches!(got, Poll::Ready(Ok(Completion::Completed(_)))));
        DROP_PANICS.with(|c| c.set(false));
        drop(w1);
        drop(w2);
        drop(h);
        assert_clean(&p).await;
    });
}

// ---------------------------------------------------------------- shutdown / walks from finishing code

/// on_expiration shuts its purgatory down; its Drop (on completion) does too.
#[tokio::test(start_paused = true)]
async fn shutdown_from_on_expiration_balances_the_books() {
    let p = purg("expshut");
    let op = Op::new();
    let pp = p.clone();
    *op.expiry_hook.lock().unwrap() = Some(Box::new(move || {
        assert!(pp.shutdown().is_empty());
    }));
    let h = p.try_complete_else_watch(op, ms(10), [1, 2]).unwrap();
    assert!(h.await.unwrap().is_expired());
    settle().await;
    let m = p.metrics();
    assert!(balanced(&m), "{m:?}");
    assert_eq!(
        (m.delayed, m.watched, m.tombstones, m.keys),
        (0, 0, 0, 0),
        "{m:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn shutdown_from_drop_on_completion_balances_the_books() {
    let p = purg("dropshut");
    let op = Op::new();
    let ready = op.ready.clone();
    let pp = p.clone();
    *op.drop_hook.lock().unwrap() = Some(Box::new(move || {
        assert!(pp.shutdown().is_empty());
    }));
    let h = p.try_complete_else_watch(op, ms(10), [1, 2]).unwrap();
    ready.store(true, Ordering::SeqCst);
    assert_eq!(p.try_complete_watched(&1), 1);
    assert!(h.await.unwrap().is_completed());
    settle().await;
    let m = p.metrics();
    assert!(balanced(&m), "{m:?}");
    assert_eq!(
        (m.delayed, m.watched, m.tombstones, m.keys),
        (0, 0, 0, 0),
        "{m:?}"
    );
}

/// cancel_for_key and a walk of its other key from its on_expiration.
#[tokio::test(start_paused = true)]
async fn walks_from_on_expiration_balance_the_books() {
    let p = purg("expwalk");
    let op = Op::new();
    let pp = p.clone();
    *op.expiry_hook.lock().unwrap() = Some(Box::new(move || {
        assert!(pp.cancel_for_key(&1).is_empty());
        assert_eq!(pp.try_complete_watched(&2), 0);
    }));
    let h = p.try_complete_else_watch(op, ms(10), [1, 2, 3]).unwrap();
    assert!(h.await.unwrap().is_expired());
    settle().await;
    let m = p.metrics();
    assert!(balanced(&m), "{m:?}");
    assert!(m.tombstones <= m.watched, "{m:?}");
    assert_eq!(
        (m.delayed, m.watched, m.tombstones, m.keys),
        (0, 0, 0, 0),
        "{m:?}"
    );
}

// ---------------------------------------------------------------- WeakPurgatory

#[tokio::test(start_paused = true)]
async fn weak_upgrade_from_drops_during_close() {
    // During shutdown(): the operation is handed back, the caller drops it: Some.
    let p = purg("weak");
    let w = p.downgrade();
    let op = Op::new();
    let seen = Arc::new(Mutex::new(Vec::new()));
    {
        let (w, seen) = (w.clone(), seen.clone());
        *op.drop_hook.lock().unwrap() = Some(Box::new(move || {
            let up = w.upgrade();
            seen.lock()
                .unwrap()
                .push(up.as_ref().map(|p| p.is_shutdown()));
        }));
    }
    let h = p.try_complete_else_watch(op, ms(100), [1]).unwrap();
    drop(p.shutdown());
    assert_eq!(*seen.lock().unwrap(), vec![Some(true)]);
    assert_eq!(h.await.unwrap_err(), OperationError::Shutdown);

    // During the last clone's drop: None, and no resurrection.
    let p = purg("weak2");
    let w = p.downgrade();
    let op = Op::new();
    let seen = Arc::new(Mutex::new(Vec::new()));
    {
        let (w, seen) = (w.clone(), seen.clone());
        *op.drop_hook.lock().unwrap() = Some(Box::new(move || {
            seen.lock().unwrap().push(w.upgrade().is_some());
        }));
    }
    let h = p.try_complete_else_watch(op, ms(100), [1]).unwrap();
    drop(p);
    assert_eq!(*seen.lock().unwrap(), vec![false]);
    assert!(w.upgrade().is_none());
    assert_eq!(h.await.unwrap_err(), OperationError::Shutdown);
}

/// The operation holds the last purgatory clone; dropping / cancelling its
/// handle drops it, which shuts the purgatory down from inside the handle call.
#[tokio::test(start_paused = true)]
async fn op_holding_the_last_clone_dropped_by_its_handle() {
    /// Holds the purgatory (`_p`) until dropped.
    struct Holder(Option<P>, Arc<AtomicUsize>);
    impl Drop for Holder {
        fn drop(&mut self) {
            self.1.fetch_add(1, Ordering::SeqCst);
            drop(self.0.take());
        }
    }
    for way in 0..3 {
        let p = purg("holder");
        let w = p.downgrade();
        let other = p.try_complete_else_watch(Op::new(), ms(100), [5]).unwrap();
        let other_ref = other.op_ref().unwrap();
        let op = Op::new();
        let drops = op.drops.clone();
        let holder = Arc::new(Mutex::new(Some(Holder(
            Some(p),
            Arc::new(AtomicUsize::new(0)),
        ))));
        {
            let holder = holder.clone();
            *op.drop_hook.lock().unwrap() = Some(Box::new(move || {
                drop(holder.lock().unwrap().take());
            }));
        }
        let pp = w.upgrade().unwrap();
        let h = pp.try_complete_else_watch(op, ms(100), [1]).unwrap();
        drop(pp);
        let r = h.op_ref().unwrap();
        support::within(5, move || match way {
            0 => drop(h),
            1 => drop(h.cancel()),
            _ => drop(r.cancel()),
        });
        assert_eq!(drops.load(Ordering::SeqCst), 1);
        assert!(
            w.upgrade().is_none(),
            "way {way}: the last clone went with the op"
        );
        assert_eq!(other_ref.status(), OperationStatus::Cancelled);
        assert_eq!(other.await.unwrap_err(), OperationError::Shutdown);
    }
}

// ---------------------------------------------------------------- wakers that re-enter on drop

struct ReWaker {
    on_drop: Mutex<Option<Box<dyn FnOnce() + Send>>>,
    wakes: AtomicUsize,
}
impl std::task::Wake for ReWaker {
    fn wake(self: Arc<Self>) {
        self.wakes.fetch_add(1, Ordering::SeqCst);
    }
}
impl Drop for ReWaker {
    fn drop(&mut self) {
        if let Some(f) = self.on_drop.get_mut().unwrap().take() {
            f();
        }
    }
}

#[test]
fn waker_whose_drop_reenters_from_every_handle_path() {
    for way in 0..5 {
        support::paused_within(10, move || async move {
            let p = purg("wakerdrop");
            let op = Op::new();
            let ready = op.ready.clone();
            let mut h = p.try_complete_else_watch(op, ms(100), [1]).unwrap();
            let r = h.op_ref().unwrap();
            let pp = p.clone();
            let dropped = Arc::new(AtomicBool::new(false));
            let d2 = dropped.clone();
            let rw = Arc::new(ReWaker {
                on_drop: Mutex::new(Some(Box::new(move || {
                    pp.try_complete_else_watch(Op::new(), ms(10), [1])
                        .unwrap()
                        .detach();
                    pp.try_complete_watched(&1);
                    drop(pp.shutdown());
                    d2.store(true, Ordering::SeqCst);
                }))),
                wakes: AtomicUsize::new(0),
            });
            let waker = Waker::from(rw.clone());
            drop(rw);
            assert!(Pin::new(&mut h)
                .poll(&mut Context::from_waker(&waker))
                .is_pending());
            drop(waker); // the handle holds the only one now
            assert!(!dropped.load(Ordering::SeqCst));
            match way {
                0 => drop(h),
                1 => drop(h.cancel()),
                2 => h.detach(),
                3 => drop(h.into_op_ref()),
                _ => {
                    // finished: the waker is woken (and so dropped) by the finish
                    ready.store(true, Ordering::SeqCst);
                    assert_eq!(p.try_complete_watched(&1), 1);
                    assert!(poll_once(&mut h).is_ready());
                }
            }
            assert!(dropped.load(Ordering::SeqCst), "way {way}");
            drop(r);
            settle().await;
            let m = p.metrics();
            assert!(balanced(&m), "way {way} {m:?}");
            assert_eq!(
                (m.delayed, m.watched, m.tombstones, m.keys),
                (0, 0, 0, 0),
                "way {way}: {m:?}"
            );
        });
    }
}

// ---------------------------------------------------------------- values

#[test]
fn error_and_completion_values() {
    fn is_error<E: std::error::Error + Send + Sync + 'static>() {}
    is_error::<OperationError>();
    is_error::<WatchErrorKind>();
    is_error::<WatchError<()>>();
    for e in [
        OperationError::Cancelled,
        OperationError::Shutdown,
        OperationError::ReaperGone,
        OperationError::Panicked,
    ] {
        assert!(!e.to_string().is_empty());
        assert!(!format!("{e:?}").is_empty());
        let boxed: Box<dyn std::error::Error + Send + Sync> = Box::new(e);
        assert_eq!(boxed.downcast_ref::<OperationError>(), Some(&e));
    }
    // A WatchError whose operation is not Debug still debugs and displays.
    struct Opaque;
    let all = [
        WatchError::NoKeys(Opaque),
        WatchError::AtCapacity(Opaque),
        WatchError::Shutdown(Opaque),
        WatchError::ReaperGone(Opaque),
        WatchError::Draining(Opaque),
    ];
    for e in all {
        let kind = e.kind();
        assert_eq!(e.to_string(), kind.to_string());
        assert!(!format!("{e:?}").contains("Opaque"));
        let k2: WatchErrorKind = e.into();
        assert_eq!(k2, kind);
    }
    assert!(matches!(WatchError::Draining(7).into_inner(), 7));
    let c = Completion::Completed(3);
    assert_eq!(c.map(|x| x + 1), Completion::Completed(4));
    assert!(Completion::Expired(()).is_expired());
    assert_eq!(Completion::Expired(5).as_ref().into_inner(), &5);
}

/// The refused operation comes back whole from each refusal, and is not dropped.
#[tokio::test(start_paused = true)]
async fn refusals_hand_the_operation_back_undropped() {
    let p: P = Purgatory::builder()
        .name("refuse")
        .max_pending(1)
        .build()
        .unwrap();
    let op = Op::new();
    let drops = op.drops.clone();
    let back = p.try_complete_else_watch(op, ms(10), []).unwrap_err();
    assert_eq!(back.kind(), WatchErrorKind::NoKeys);
    let op = back.into_inner();
    let _first = p.try_complete_else_watch(Op::new(), ms(10), [1]).unwrap();
    let back = p.try_complete_else_watch(op, ms(10), [1]).unwrap_err();
    assert_eq!(back.kind(), WatchErrorKind::AtCapacity);
    let op = back.into_inner();
    drop(p.shutdown());
    let back = p.try_complete_else_watch(op, ms(10), [1]).unwrap_err();
    assert_eq!(back.kind(), WatchErrorKind::Shutdown);
    assert_eq!(drops.load(Ordering::SeqCst), 0);
    drop(back);
    assert_eq!(drops.load(Ordering::SeqCst), 1);
    let m = p.metrics();
    assert_eq!(m.registered, 1, "{m:?}");
    assert!(balanced(&m));
}

// ---------------------------------------------------------------- cross-thread stress of handle paths

#[test]
fn handle_paths_racing_finish_each_once() {
    support::within(60, || {
        let rt = support::multi();
        rt.block_on(async {
            let p = purg("stress");
            const N: usize = 2000;
            let op_drops = Arc::new(AtomicUsize::new(0));
            let out_drops = Arc::new(AtomicUsize::new(0));
            let mut handles = Vec::new();
            let mut refs = Vec::new();
            let mut flags = Vec::new();
            for i in 0..N {
                let mut op = Op::new();
                op.drops = op_drops.clone();
                op.out_drops = out_drops.clone();
                flags.push(op.ready.clone());
                let h = p
                    .try_complete_else_watch(
                        op,
                        Duration::from_micros(200 + (i as u64 % 7) * 100),
                        [i as u32 % 13, 100 + i as u32 % 5],
                    )
                    .unwrap();
                refs.push(h.op_ref().unwrap());
                handles.push(Some(h));
            }
            let flags = Arc::new(flags);
            let refs = Arc::new(refs);
            let t1 = {
                let (refs, flags) = (refs.clone(), flags.clone());
                std::thread::spawn(move || {
                    for (i, r) in refs.iter().enumerate() {
                        if i % 3 == 0 {
                            flags[i].store(true, Ordering::SeqCst);
                            r.try_complete();
                        } else if i % 3 == 1 {
                            drop(r.cancel());
                        } else {
                            r.reset(Duration::from_micros(50));
                        }
                    }
                })
            };
            let t2 = {
                let p = p.clone();
                let flags = flags.clone();
                std::thread::spawn(move || {
                    for i in 0..N {
                        flags[(i * 7) % N].store(true, Ordering::SeqCst);
                        p.try_complete_watched(&(i as u32 % 13));
                    }
                })
            };
            let mut outcomes = Vec::new();
            for (i, slot) in handles.iter_mut().enumerate() {
                let h = slot.take().unwrap();
                match i % 4 {
                    0 => outcomes.push(Some(h.await)),
                    1 => drop(h),
                    2 => drop(h.cancel()),
                    _ => h.detach(),
                }
            }
            t1.join().unwrap();
            t2.join().unwrap();
            // The timeouts (0.05 to 0.8 ms) run on real time: wait until
            // nothing is pending and every operation is dropped (polled,
            // at most 10 s; the assertions below say what was not).
            let give_up = std::time::Instant::now() + Duration::from_secs(10);
            while (p.delayed() != 0 || op_drops.load(Ordering::SeqCst) != N)
                && std::time::Instant::now() < give_up
            {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            let m = p.metrics();
            assert_eq!(m.delayed, 0, "{m:?}");
            assert!(balanced(&m), "{m:?}");
            assert_eq!(m.registered as usize, N);
            assert_eq!(op_drops.load(Ordering::SeqCst), N, "every op dropped once");
            drop(std::mem::take(&mut outcomes));
            let give_up = std::time::Instant::now() + Duration::from_secs(10);
            while out_drops.load(Ordering::SeqCst) as u64 != m.completed + m.expired
                && std::time::Instant::now() < give_up
            {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            assert_eq!(
                out_drops.load(Ordering::SeqCst) as u64,
                m.completed + m.expired,
                "every output dropped once {m:?}"
            );
            for r in refs.iter() {
                assert_ne!(r.status(), OperationStatus::Pending);
            }
            drop(outcomes);
            drop(refs);
            let m2 = p.metrics();
            assert_eq!(m2.panicked, 0);
        });
    });
}

/// Promises about a cancel left to a running check (the operation cancels
/// itself from its `try_complete`: through its `OpRef`, by its key, or by
/// dropping its own handle), and about an operation completed by its
/// registration's second check. `delayed`: "a cancelled one is counted out
/// as it is cancelled, and may be dropped (or handed back to whoever
/// cancelled it) after"; `op_ref` and `into_op_ref`: "`None` when the
/// operation completed during registration".
mod left_to_a_check {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use tokio_purgatory::{
        Completion, OpRef, Operation, OperationError, OperationStatus, Purgatory, WeakPurgatory,
    };

    type P = Purgatory<u32, Op>;
    type RefSlot = Arc<Mutex<Option<OpRef<u32, Op>>>>;

    /// What the op's Drop saw.
    #[derive(Debug, Default, Clone, PartialEq)]
    struct AtDrop {
        delayed: usize,
        cancelled_counted: u64,
        status: Option<OperationStatus>,
    }

    #[derive(Clone, Copy, PartialEq, Debug)]
    enum SelfAct {
        None,
        /// try_complete cancels itself through its OpRef.
        CancelRef,
        /// try_complete cancels its own key.
        CancelKey,
        /// try_complete drops its own handle.
        DropHandle,
    }

    struct Op {
        key: u32,
        act: SelfAct,
        armed: Arc<AtomicBool>,
        me: RefSlot,
        handle: Arc<Mutex<Option<tokio_purgatory::OperationHandle<u32, Op>>>>,
        p: Arc<Mutex<Option<WeakPurgatory<u32, Op>>>>,
        at_drop: Arc<Mutex<Option<AtDrop>>>,
        /// How many times try_complete ran; completes on call number `complete_on`.
        calls: Arc<AtomicUsize>,
        complete_on: usize,
    }

    impl Op {
        fn new(key: u32, act: SelfAct) -> Op {
            Op {
                key,
                act,
                armed: Arc::default(),
                me: Arc::default(),
                handle: Arc::default(),
                p: Arc::default(),
                at_drop: Arc::default(),
                calls: Arc::default(),
                complete_on: usize::MAX,
            }
        }
    }

    impl Operation for Op {
        type Output = u32;
        fn try_complete(&mut self) -> Option<u32> {
            let n = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
            if n == self.complete_on {
                return Some(7);
            }
            if self.armed.swap(false, Ordering::SeqCst) {
                match self.act {
                    SelfAct::None => {}
                    SelfAct::CancelRef => {
                        let r = self.me.lock().unwrap().clone().unwrap();
                        assert!(r.cancel().is_none(), "left to this very check");
                    }
                    SelfAct::CancelKey => {
                        let p = self.p.lock().unwrap().clone().unwrap().upgrade().unwrap();
                        assert!(p.cancel_for_key(&self.key).is_empty());
                    }
                    SelfAct::DropHandle => {
                        drop(self.handle.lock().unwrap().take());
                    }
                }
            }
            None
        }
        fn on_expiration(self) -> u32 {
            9
        }
    }

    impl Drop for Op {
        fn drop(&mut self) {
            let p = self.p.lock().unwrap().clone().and_then(|w| w.upgrade());
            let status = self.me.lock().unwrap().as_ref().map(|r| r.status());
            if let Some(p) = p {
                let m = p.metrics();
                *self.at_drop.lock().unwrap() = Some(AtDrop {
                    delayed: p.delayed(),
                    cancelled_counted: m.cancelled,
                    status,
                });
            }
        }
    }

    fn purg() -> P {
        Purgatory::builder().name("scratch").build().unwrap()
    }

    /// Baseline: a cancel by reference from outside any check. The docs of
    /// `delayed` (src/purgatory/mod.rs): "a cancelled one is counted out as it
    /// is cancelled, and may be dropped (or handed back to whoever cancelled it)
    /// after". Its drop sees 0 pending and the cancel counted.
    #[tokio::test(start_paused = true)]
    async fn direct_cancel_is_counted_out_before_the_drop() {
        let p = purg();
        let op = Op::new(1, SelfAct::None);
        let (at_drop, me, pw) = (op.at_drop.clone(), op.me.clone(), op.p.clone());
        *pw.lock().unwrap() = Some(p.downgrade());
        let h = p
            .try_complete_else_watch(op, Duration::from_secs(10), [1])
            .unwrap();
        *me.lock().unwrap() = h.op_ref();
        let back = h.op_ref().unwrap().cancel().expect("taken");
        drop(back);
        let seen = at_drop.lock().unwrap().clone().unwrap();
        assert_eq!(seen.delayed, 0, "{seen:?}");
        assert_eq!(seen.cancelled_counted, 1, "{seen:?}");
        assert_eq!(h.await, Err(OperationError::Cancelled));
    }

    /// A cancel left to the running check (the op cancels itself through its
    /// OpRef, by its key, or by dropping its own handle, from its try_complete):
    /// the check carries it out. Per the docs of `delayed`, the cancelled
    /// operation is counted out as it is cancelled and dropped after; what does
    /// its drop see?
    async fn deferred(act: SelfAct) -> AtDrop {
        let p = purg();
        let op = Op::new(1, act);
        let (at_drop, me, pw, armed, hslot) = (
            op.at_drop.clone(),
            op.me.clone(),
            op.p.clone(),
            op.armed.clone(),
            op.handle.clone(),
        );
        *pw.lock().unwrap() = Some(p.downgrade());
        let h = p
            .try_complete_else_watch(op, Duration::from_secs(10), [1])
            .unwrap();
        *me.lock().unwrap() = h.op_ref();
        let keep = h.op_ref().unwrap();
        let awaited = if act == SelfAct::DropHandle {
            *hslot.lock().unwrap() = Some(h);
            None
        } else {
            Some(h)
        };
        armed.store(true, Ordering::SeqCst);
        assert_eq!(p.try_complete_watched(&1), 0);
        assert_eq!(keep.status(), OperationStatus::Cancelled);
        if let Some(h) = awaited {
            assert_eq!(h.await, Err(OperationError::Cancelled));
        }
        let m = p.metrics();
        assert_eq!((m.cancelled, m.delayed), (1, 0));
        let seen = at_drop.lock().unwrap().clone().unwrap();
        seen
    }

    #[tokio::test(start_paused = true)]
    async fn deferred_cancel_by_ref_is_counted_out_before_the_drop() {
        let seen = deferred(SelfAct::CancelRef).await;
        assert_eq!(
            (seen.delayed, seen.cancelled_counted),
            (0, 1),
            "the op's Drop after a cancel left to its check: {seen:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn deferred_cancel_by_key_is_counted_out_before_the_drop() {
        let seen = deferred(SelfAct::CancelKey).await;
        assert_eq!(
            (seen.delayed, seen.cancelled_counted),
            (0, 1),
            "the op's Drop after a cancel by key left to its check: {seen:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn deferred_cancel_by_handle_drop_is_counted_out_before_the_drop() {
        let seen = deferred(SelfAct::DropHandle).await;
        assert_eq!(
            (seen.delayed, seen.cancelled_counted),
            (0, 1),
            "the op's Drop after its handle was dropped from its check: {seen:?}"
        );
    }

    /// `OperationHandle::op_ref` (handle.rs): "`None` when the operation
    /// completed during registration (there is nothing left to check)".
    /// Registration "checks `op` once; if it cannot complete, watches it ...,
    /// checks it again" (mod.rs). An op completed by the second check of its
    /// registration: what do `op_ref` and `into_op_ref` say?
    #[tokio::test(start_paused = true)]
    async fn a_completion_by_the_second_check_gives_a_ready_handle() {
        let p = purg();
        let mut op = Op::new(1, SelfAct::None);
        op.complete_on = 2; // the first check says not yet, the second completes
        let calls = op.calls.clone();
        let h = p
            .try_complete_else_watch(op, Duration::from_secs(10), [1])
            .unwrap();
        assert_eq!(
            calls.load(Ordering::SeqCst),
            2,
            "both registration checks ran"
        );
        assert_eq!(p.metrics().completed, 1, "completed during registration");
        assert!(h.is_finished());
        let r = h.op_ref();
        let status = r.as_ref().map(|r| r.status());
        drop(r);
        let mut op2 = Op::new(2, SelfAct::None);
        op2.complete_on = 2;
        let h2 = p
            .try_complete_else_watch(op2, Duration::from_secs(10), [2])
            .unwrap();
        let into = h2.into_op_ref().map(|r| r.status());
        assert_eq!(h.await, Ok(Completion::Completed(7)));
        assert!(
            status.is_none() && into.is_none(),
            "completed during registration, yet op_ref() gave a reference reading {status:?} \
             and into_op_ref() one reading {into:?}"
        );
    }
}
