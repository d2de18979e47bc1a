//! The pending limit against registrations made from inside user code, on
//! paused Tokio time: from an operation's first check (at registration) and
//! its second (once its keys are watched), from the code an operation's
//! finish runs (its `on_expiration`, its drop after an expiry, a completion
//! by a walk or by the first check, a cancel, and the drop of its unread
//! output), and from the waker of a completed operation's handle. It holds
//! the crate to `PurgatoryBuilder::max_pending`: "An operation's room is free
//! from the moment its fate is decided, before any code its finish runs: its
//! `on_expiration` and the drop of the operation (after a completion or a
//! cancellation) may register another in its place, as a retry or a renewed
//! session does, whichever way it finished"; to `Purgatory::delayed`: "An
//! expired or completed operation counts until its finish is done, the code
//! that finish runs included (its `on_expiration`; the drop of a completed
//! operation); a cancelled one is counted out as it is cancelled, and may be
//! dropped ... after"; and to
//! "Nothing is lost on rejection": a registration refused at the limit hands
//! its operation back, is counted once in `refused`, and the counts balance.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Wake, Waker};

use tokio::time::advance;
use tokio_purgatory::{
    OpRef, Operation, OperationStatus, Purgatory, PurgatoryMetrics, WatchErrorKind, WeakPurgatory,
};

mod support;
use support::{balanced, ms, settle};

/// User code an operation or its output runs once.
type Hook = Box<dyn FnOnce() + Send>;

/// What the registrations made from inside user code got back, by label,
/// and how many refused operations came back.
#[derive(Default)]
struct Log {
    results: Mutex<Vec<(&'static str, Result<(), WatchErrorKind>)>>,
    back: AtomicUsize,
}

impl Log {
    /// What the registration labelled `what` got; fails if it never ran.
    fn result(&self, what: &str) -> Result<(), WatchErrorKind> {
        self.results
            .lock()
            .unwrap()
            .iter()
            .find(|(w, _)| *w == what)
            .unwrap_or_else(|| panic!("{what} did not run"))
            .1
    }
}

/// An output that runs its hook when dropped.
struct Out(Option<Hook>);

impl Drop for Out {
    fn drop(&mut self) {
        if let Some(h) = self.0.take() {
            h()
        }
    }
}

/// An operation that completes once `ready` is set, and runs hooks: on its
/// `n`-th check (saying whether to complete), in `on_expiration`, in its
/// `Drop`, and (handed to its output) in its output's `Drop`.
struct Op {
    id: u32,
    ready: Arc<AtomicBool>,
    checks: u32,
    at_check: Option<(u32, Box<dyn FnMut() -> bool + Send>)>,
    on_expiry: Option<Hook>,
    on_drop: Option<Hook>,
    out_drop: Option<Hook>,
}

impl Op {
    fn new(id: u32) -> Op {
        Op {
            id,
            ready: Arc::default(),
            checks: 0,
            at_check: None,
            on_expiry: None,
            on_drop: None,
            out_drop: None,
        }
    }
}

impl Drop for Op {
    fn drop(&mut self) {
        if let Some(h) = self.on_drop.take() {
            h()
        }
    }
}

impl Operation for Op {
    type Output = Out;
    fn try_complete(&mut self) -> Option<Out> {
        self.checks += 1;
        let mut done = self.ready.load(Ordering::SeqCst);
        if let Some((n, f)) = &mut self.at_check {
            if *n == self.checks {
                done |= f();
            }
        }
        done.then(|| Out(self.out_drop.take()))
    }
    fn on_expiration(mut self) -> Out {
        if let Some(h) = self.on_expiry.take() {
            h()
        }
        Out(self.out_drop.take())
    }
}

type P = Purgatory<u32, Op>;

/// Registers a plain operation `id` (a second away, on key `id`) from inside
/// user code and logs what came back under `what`: a handle is detached, a
/// refused operation must be the one given (counted in `back`).
fn register_inside(weak: &WeakPurgatory<u32, Op>, log: &Log, what: &'static str, id: u32) {
    let result = match weak.upgrade() {
        None => Err(WatchErrorKind::Shutdown),
        Some(p) => match p.try_complete_else_watch(Op::new(id), ms(1000), [id]) {
            Ok(h) => {
                h.detach();
                Ok(())
            }
            Err(e) => {
                let kind = e.kind();
                assert_eq!(e.into_inner().id, id, "the refused operation comes back");
                log.back.fetch_add(1, Ordering::SeqCst);
                Err(kind)
            }
        },
    };
    log.results.lock().unwrap().push((what, result));
}

/// The counts, for failure messages.
fn books(m: &PurgatoryMetrics) -> String {
    format!(
        "registered {} completed {} expired {} cancelled {} handed back {} delayed {} refused {:?}",
        m.registered, m.completed, m.expired, m.cancelled, m.handed_back, m.delayed, m.refused
    )
}

/// At `max_pending(1)`, an operation whose first check (at registration)
/// registers another holds the room itself, its fate not yet decided: the
/// inner registration is refused `AtCapacity` with its operation handed
/// back, whether the check then completes the outer operation or not; the
/// refusal is counted once and the counts balance.
#[tokio::test(start_paused = true)]
async fn a_first_check_registering_at_the_limit_is_refused() {
    for completes in [false, true] {
        let p: P = Purgatory::builder().max_pending(1).build().unwrap();
        let log = Arc::new(Log::default());
        let mut op = Op::new(1);
        let (w, l) = (p.downgrade(), log.clone());
        op.at_check = Some((
            1,
            Box::new(move || {
                register_inside(&w, &l, "first check", 100);
                completes
            }),
        ));
        let h = p.try_complete_else_watch(op, ms(50), [1]).unwrap();
        assert_eq!(log.result("first check"), Err(WatchErrorKind::AtCapacity));
        assert_eq!(h.await.unwrap().is_completed(), completes);
        settle().await;
        let m = p.metrics();
        assert!(balanced(&m), "{}", books(&m));
        assert_eq!(
            (m.registered, m.refused.at_capacity),
            (1, 1),
            "{}",
            books(&m)
        );
        assert_eq!(m.refused.total(), log.back.load(Ordering::SeqCst) as u64);
    }
}

/// At `max_pending(2)`, the check made once the operation's keys are
/// watched registers twice: the first takes the one room left, the second
/// is refused `AtCapacity` and handed back; the outer operation expires,
/// the inner one after it, and the counts balance.
#[tokio::test(start_paused = true)]
async fn a_second_check_registering_finds_the_room_left() {
    let p: P = Purgatory::builder().max_pending(2).build().unwrap();
    let log = Arc::new(Log::default());
    let mut op = Op::new(1);
    let (w, l) = (p.downgrade(), log.clone());
    op.at_check = Some((
        2,
        Box::new(move || {
            register_inside(&w, &l, "second check, first", 100);
            register_inside(&w, &l, "second check, second", 101);
            false
        }),
    ));
    let h = p.try_complete_else_watch(op, ms(50), [1]).unwrap();
    assert_eq!(log.result("second check, first"), Ok(()));
    assert_eq!(
        log.result("second check, second"),
        Err(WatchErrorKind::AtCapacity)
    );
    assert!(h.await.unwrap().is_expired());
    advance(ms(2000)).await;
    settle().await;
    let m = p.metrics();
    assert!(balanced(&m), "{}", books(&m));
    assert_eq!(
        (m.registered, m.expired, m.delayed),
        (2, 2, 0),
        "{}",
        books(&m)
    );
    assert_eq!(m.refused.at_capacity, 1, "{}", books(&m));
    assert_eq!(log.back.load(Ordering::SeqCst), 1);
}

/// A way an operation finishes, and where its code registers from.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Way {
    /// Its `on_expiration`.
    OnExpiration,
    /// Its drop, after `on_expiration`.
    DropAfterExpiry,
    /// Its drop, after a walk of its key completed it.
    DropAfterWalk,
    /// Its drop, after its handle was dropped (a cancel).
    DropAfterCancel,
    /// Its drop, after its first check completed it at registration.
    DropAfterFirstCheck,
    /// The drop of its output, unread, with its handle.
    OutputDrop,
}

/// What the finishing operation's code saw: its status through its `OpRef`
/// (`None`: completed at registration, it never had one), `delayed()` before
/// and after its registration, and what the registration got.
#[derive(Debug, Clone, PartialEq)]
struct Seen {
    status: Option<OperationStatus>,
    delayed: usize,
    delayed_after: usize,
    registered: Result<(), WatchErrorKind>,
}

/// At `max_pending(1)`, an operation finishes `way` and its code there
/// registers a follow-up: what it saw. Once the follow-up has expired too,
/// the counts balance, and every refusal counted came back.
async fn follow_up(way: Way) -> Seen {
    let p: P = Purgatory::builder().max_pending(1).build().unwrap();
    let log = Arc::new(Log::default());
    let seen: Arc<Mutex<Option<Seen>>> = Arc::default();
    let me: Arc<Mutex<Option<OpRef<u32, Op>>>> = Arc::default();
    let hook: Hook = {
        let (w, l, s, me) = (p.downgrade(), log.clone(), seen.clone(), me.clone());
        Box::new(move || {
            let status = me.lock().unwrap().as_ref().map(OpRef::status);
            let delayed = w.upgrade().expect("the purgatory is alive").delayed();
            register_inside(&w, &l, "follow-up", 100);
            let delayed_after = w.upgrade().unwrap().delayed();
            *s.lock().unwrap() = Some(Seen {
                status,
                delayed,
                delayed_after,
                registered: l.result("follow-up"),
            });
        })
    };
    let mut op = Op::new(1);
    let ready = op.ready.clone();
    match way {
        Way::OnExpiration => op.on_expiry = Some(hook),
        Way::OutputDrop => op.out_drop = Some(hook),
        _ => op.on_drop = Some(hook),
    }
    if way == Way::DropAfterFirstCheck {
        ready.store(true, Ordering::SeqCst);
    }
    let h = p.try_complete_else_watch(op, ms(10), [1]).unwrap();
    *me.lock().unwrap() = h.op_ref();
    match way {
        Way::OnExpiration | Way::DropAfterExpiry => {
            h.detach();
            advance(ms(20)).await;
        }
        Way::DropAfterFirstCheck => h.detach(),
        Way::DropAfterWalk => {
            h.detach();
            ready.store(true, Ordering::SeqCst);
            assert_eq!(p.try_complete_watched(&1), 1);
        }
        Way::DropAfterCancel => drop(h),
        Way::OutputDrop => {
            ready.store(true, Ordering::SeqCst);
            assert_eq!(p.try_complete_watched(&1), 1);
            drop(h); // unread: the output goes with it
        }
    }
    settle().await;
    me.lock().unwrap().take();
    let seen = seen.lock().unwrap().take().expect("the hook ran");
    advance(ms(5000)).await;
    settle().await;
    let m = p.metrics();
    assert!(balanced(&m), "{way:?}: {}", books(&m));
    assert_eq!(m.delayed, 0, "{way:?}: {}", books(&m));
    assert_eq!(m.registered, 2, "{way:?}: {}", books(&m));
    assert_eq!(
        m.refused.total(),
        log.back.load(Ordering::SeqCst) as u64,
        "{way:?}: {}",
        books(&m)
    );
    assert_eq!(m.refused.total(), 0, "{way:?}: {}", books(&m));
    seen
}

/// At `max_pending(1)`, the code a finishing operation runs registers a
/// follow-up, and it fits (`Ok`) every way it finishes: `on_expiration`, the
/// drop of the operation after an expiry, a completion by a walk, a cancel
/// and a completion by the first check at registration, and the drop of its
/// unread output. `delayed()` still counts the operation (1) in its
/// `on_expiration` and in its drop after an expiry or a completion (by a
/// walk or at registration); it reads 0 in the drop after a cancel (the
/// cancel hands the operation back to the caller once its finish is done)
/// and in the output's drop. The follow-up counts at once (one more). The
/// operation reads finished through its `OpRef` wherever it has one.
#[tokio::test(start_paused = true)]
async fn a_finished_operations_code_registers_in_the_room_it_gave_back() {
    use OperationStatus::{Cancelled, Completed, Expired};
    for (way, status, delayed) in [
        (Way::OnExpiration, Some(Expired), 1),
        (Way::DropAfterExpiry, Some(Expired), 1),
        (Way::DropAfterWalk, Some(Completed), 1),
        (Way::DropAfterCancel, Some(Cancelled), 0),
        (Way::DropAfterFirstCheck, None, 1),
        (Way::OutputDrop, Some(Completed), 0),
    ] {
        let seen = follow_up(way).await;
        assert_eq!(
            seen,
            Seen {
                status,
                delayed,
                delayed_after: delayed + 1,
                registered: Ok(()),
            },
            "{way:?}"
        );
    }
}

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

/// At `max_pending(1)`, the waker of a pending operation's handle registers
/// another when a walk completes the operation and wakes it: the completed
/// operation's room is free by then, so the registration fits, and the
/// counts balance once it has expired.
#[tokio::test(start_paused = true)]
async fn a_completed_operations_waker_registers_in_its_room() {
    let p: P = Purgatory::builder().max_pending(1).build().unwrap();
    let log = Arc::new(Log::default());
    let op = Op::new(1);
    let ready = op.ready.clone();
    let mut h = p.try_complete_else_watch(op, ms(10), [1]).unwrap();
    let waker = {
        let (w, l) = (p.downgrade(), log.clone());
        Waker::from(Arc::new(FnWaker(Box::new(move || {
            register_inside(&w, &l, "waker", 200)
        }))))
    };
    let mut cx = Context::from_waker(&waker);
    assert!(Pin::new(&mut h).poll(&mut cx).is_pending());
    ready.store(true, Ordering::SeqCst);
    assert_eq!(p.try_complete_watched(&1), 1);
    assert_eq!(
        log.result("waker"),
        Ok(()),
        "the room is free when it wakes"
    );
    assert!(Pin::new(&mut h).poll(&mut cx).is_ready());
    advance(ms(5000)).await;
    settle().await;
    let m = p.metrics();
    assert!(balanced(&m), "{}", books(&m));
    assert_eq!(
        (m.registered, m.completed, m.expired),
        (2, 1, 1),
        "{}",
        books(&m)
    );
    assert_eq!(m.refused.total(), 0, "{}", books(&m));
}
