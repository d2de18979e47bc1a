//! The purge of a purgatory's watch lists once nothing is pending:
//! completions that leave it idle (by reference, by a registration's second
//! check, by advances at levels, from inside another operation's check,
//! held on another thread past their deadline), the reaper's turns that
//! purge (its own reaper's or a shared one's, at the finished operations'
//! alarm), tombstones of `Duration::MAX` timeouts kept until registrations
//! purge them, and shutdowns, drains and last clones dropped racing
//! completions. Wherever nothing is left pending, the map ends empty (no
//! entries, tombstones or keys) and the counts balance.
//!
//! Paused time throughout, but for the tests on real threads, each bounded.

mod support;

use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use tokio::time::advance;
use tokio_purgatory::{
    Completion, Operation, OperationHandle, Purgatory, Reaper, Timer, Watch, WatchError, WatchKey,
};

use support::{balanced, ms, paused_within, settle, within};

/// Code an operation runs inside its check, after it decided, told whether
/// it completes.
type InCheck = Box<dyn FnMut(bool) + Send>;

/// Completes once `ready` is set and it has been checked at least `after`
/// times (1: the first check); outputs 1, or 0 on expiry. May run code
/// inside its check (after it decided) and in its `Drop`.
struct Op {
    ready: Arc<AtomicBool>,
    after: usize,
    checks: Arc<AtomicUsize>,
    in_check: Option<InCheck>,
    on_drop: Option<Box<dyn FnOnce() + Send>>,
}

impl Op {
    /// Completes at the first check after `ready` is set.
    fn new(ready: &Arc<AtomicBool>) -> Op {
        Op {
            ready: ready.clone(),
            after: 0,
            checks: Arc::default(),
            in_check: None,
            on_drop: None,
        }
    }

    /// Completes at its second check: a registration's check after the
    /// watch, with nothing else happening.
    fn at_second_check() -> Op {
        let mut op = Op::new(&Arc::new(AtomicBool::new(true)));
        op.after = 2;
        op
    }
}

impl Operation for Op {
    type Output = u32;
    fn try_complete(&mut self) -> Option<u32> {
        let n = self.checks.fetch_add(1, Ordering::SeqCst) + 1;
        let ready = self.ready.load(Ordering::SeqCst) && n >= self.after;
        if let Some(f) = &mut self.in_check {
            f(ready);
        }
        ready.then_some(1)
    }
    fn on_expiration(self) -> u32 {
        0
    }
}

impl Drop for Op {
    fn drop(&mut self) {
        if let Some(f) = self.on_drop.take() {
            f();
        }
    }
}

/// Code a key runs when it is dropped, once it is armed, and only once for
/// all the keys that share it.
struct Hook {
    armed: AtomicBool,
    f: Box<dyn Fn() + Send + Sync>,
}

impl Hook {
    fn new(armed: bool, f: impl Fn() + Send + Sync + 'static) -> Arc<Hook> {
        Arc::new(Hook {
            armed: AtomicBool::new(armed),
            f: Box::new(f),
        })
    }
}

/// A key equal to (and hashing as) its `id`, whose drop may run a [`Hook`].
#[derive(Clone)]
struct HKey {
    id: u32,
    hook: Option<Arc<Hook>>,
}

impl HKey {
    fn plain(id: u32) -> HKey {
        HKey { id, hook: None }
    }
    fn hooked(id: u32, hook: &Arc<Hook>) -> HKey {
        HKey {
            id,
            hook: Some(hook.clone()),
        }
    }
}

impl PartialEq for HKey {
    fn eq(&self, o: &Self) -> bool {
        self.id == o.id
    }
}
impl Eq for HKey {}
impl Hash for HKey {
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.id.hash(h)
    }
}
impl Drop for HKey {
    fn drop(&mut self) {
        if let Some(h) = &self.hook {
            if h.armed.swap(false, Ordering::SeqCst) {
                (h.f)();
            }
        }
    }
}

/// What the watch lists hold: `(delayed, watched, tombstones, keys)`.
fn shape<K: WatchKey, O: Operation, S>(p: &Purgatory<K, O, S>) -> (usize, usize, usize, usize) {
    let m = p.metrics();
    (m.delayed, m.watched, m.tombstones, m.keys)
}

/// Waits (on real time, yielding) until `done` holds, failing after `secs`
/// seconds with `what` and the last value `done` saw.
fn wait_until<T: std::fmt::Debug>(secs: u64, what: &str, mut done: impl FnMut() -> (bool, T)) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        let (ok, seen) = done();
        if ok {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: not within {secs} s: {seen:?}"
        );
        std::thread::yield_now();
    }
}

/// Says "inside" on one channel, then waits (bounded) on the other.
struct Gate(mpsc::Sender<()>, mpsc::Receiver<()>);

impl Gate {
    fn pass(self) {
        self.0.send(()).unwrap();
        self.1.recv_timeout(Duration::from_secs(10)).unwrap();
    }
}

/// A gate, the receiver told when a thread is inside it, and the sender
/// that lets it go on.
fn gate() -> (Gate, mpsc::Receiver<()>, mpsc::Sender<()>) {
    let (inside_tx, inside_rx) = mpsc::channel();
    let (go_tx, go_rx) = mpsc::channel();
    (Gate(inside_tx, go_rx), inside_rx, go_tx)
}

/// `n` operations with the timeout `timeout` on three keys each
/// (`i`, `i + 1000`, `i + 2000`), completed by reference once the reaper
/// has seen them: 300 tombstones for 100 operations, and nothing pending.
/// Returns the reaper's wake-ups counted before the completions.
async fn complete_by_reference(p: &Purgatory<u32, Op>, n: u32, timeout: Duration) -> u64 {
    let ready = Arc::new(AtomicBool::new(false));
    let refs: Vec<_> = (0..n)
        .map(|i| {
            p.try_complete_else_watch(Op::new(&ready), timeout, [i, i + 1000, i + 2000])
                .unwrap()
                .into_op_ref()
                .unwrap()
        })
        .collect();
    settle().await;
    let woken = p.metrics().reaper_wakeups;
    ready.store(true, Ordering::SeqCst);
    assert!(refs.iter().all(|r| r.try_complete()));
    woken
}

// ---------------------------------------------------------------------------
// Large maps idled by completions, and a completion during the reaper's
// turn.

/// 5,000 operations on three keys each, completed by reference (no walk,
/// no registration after them): completions do not look at the map, so
/// their 15,000 tombstones stay until the reaper's next turn, which the
/// alarm set for their timeouts brings (the earliest is at 60 s); that turn
/// finds the wheels emptied and starts the idle purge, which the turns
/// after it finish. No wake-up is added for it.
#[tokio::test(start_paused = true)]
async fn an_idle_purgatory_after_completions_by_reference_holds_no_keys() {
    let p: Purgatory<u32, Op> = Purgatory::new();
    let ready = Arc::new(AtomicBool::new(false));
    let refs: Vec<_> = (0..5_000u32)
        .map(|i| {
            let timeout = ms(60_000 + u64::from(i));
            p.try_complete_else_watch(Op::new(&ready), timeout, [i, i + 10_000, i + 20_000])
                .unwrap()
                .into_op_ref()
                .unwrap()
        })
        .collect();
    settle().await;
    let woken = p.metrics().reaper_wakeups;
    ready.store(true, Ordering::SeqCst);
    assert!(refs.iter().all(|r| r.try_complete()));
    drop(refs);
    advance(ms(59_000)).await;
    settle().await;
    assert_eq!(shape(&p), (0, 15_000, 15_000, 15_000), "before the turn");
    advance(ms(1_001)).await;
    settle().await;
    assert_eq!(
        shape(&p),
        (0, 0, 0, 0),
        "nothing pending, idle: {:?}",
        p.metrics()
    );
    assert_eq!(p.metrics().reaper_wakeups, woken + 1, "the alarm's one");
    assert!(balanced(&p.metrics()));
}

/// A walk completes the last of 5,000 operations, each also watching two
/// keys of its own: the walk purges one slice of the 10,000 tombstones it
/// left, and the reaper's turn at the earliest timeout the rest.
#[tokio::test(start_paused = true)]
async fn an_idle_purgatory_after_a_walk_completes_the_last_holds_no_keys() {
    let p: Purgatory<u32, Op> = Purgatory::new();
    let ready = Arc::new(AtomicBool::new(false));
    let handles: Vec<_> = (1..=5_000u32)
        .map(|i| {
            p.try_complete_else_watch(Op::new(&ready), ms(30_000), [0, i, i + 10_000])
                .unwrap()
        })
        .collect();
    ready.store(true, Ordering::SeqCst);
    assert_eq!(p.try_complete_watched(&0), 5_000);
    for h in handles {
        assert_eq!(h.await, Ok(Completion::Completed(1)));
    }
    let (delayed, _, tombstones, _) = shape(&p);
    assert_eq!(delayed, 0);
    assert!(tombstones > 0, "the walk purged a slice, not the whole map");
    advance(ms(30_001)).await;
    settle().await;
    assert_eq!(
        shape(&p),
        (0, 0, 0, 0),
        "nothing pending, idle: {:?}",
        p.metrics()
    );
    assert!(balanced(&p.metrics()));
}

/// A completion made while the reaper's turn is under way (here by a timer
/// task on the same shared reaper, served after the purgatory in that turn,
/// registering an operation that its second check completes before any
/// timeout is armed) finds the turn still going and leaves the purge to the
/// reaper, whose purgatory ends that turn with nothing scheduled: the map
/// is purged all the same.
#[tokio::test(start_paused = true)]
async fn a_completion_during_the_reapers_turn_is_purged_by_the_reaper() {
    let reaper = Reaper::start().unwrap();
    // Built first: served first in each turn of the shared reaper.
    let p: Purgatory<u32, Op> = Purgatory::builder().reaper(&reaper).build().unwrap();
    let timer = Timer::builder().reaper(&reaper).build().unwrap();
    let (registrar, registered) = (p.clone(), Arc::new(AtomicBool::new(false)));
    let done = registered.clone();
    timer
        .schedule(ms(5), move || {
            // Completed by its second check, before its timeout is armed.
            let h = registrar
                .try_complete_else_watch(Op::at_second_check(), ms(1000), [1, 2, 3])
                .unwrap();
            h.detach();
            done.store(true, Ordering::SeqCst);
        })
        .unwrap();
    advance(ms(6)).await;
    settle().await;
    assert!(registered.load(Ordering::SeqCst), "the task ran");
    assert_eq!(p.metrics().completed, 1);
    assert_eq!(
        shape(&p),
        (0, 0, 0, 0),
        "nothing pending, idle: {:?}",
        p.metrics()
    );
    assert!(balanced(&p.metrics()));
}

// ---------------------------------------------------------------------------
// Completions by reference: the reaper's turn at the finished operations'
// alarm purges; with far timeouts, a registration does.

/// Operations completed by reference while the reaper waits on their one-hour
/// timeouts keep their tombstones until that alarm, whose turn (one wake-up)
/// purges the map.
#[test]
fn completions_by_reference_are_purged_at_their_timeouts_alarm() {
    paused_within(10, || async {
        let p: Purgatory<u32, Op> = Purgatory::new();
        let woken = complete_by_reference(&p, 100, Duration::from_secs(3600)).await;
        advance(Duration::from_secs(3599)).await;
        settle().await;
        let before = shape(&p);
        advance(Duration::from_secs(2)).await;
        settle().await;
        assert_eq!(before, (0, 300, 300, 300));
        assert_eq!(shape(&p), (0, 0, 0, 0), "{:?}", p.metrics());
        assert_eq!(p.metrics().reaper_wakeups, woken + 1);
        assert!(balanced(&p.metrics()));
    });
}

/// Operations with a `Duration::MAX` timeout completed by reference keep
/// their tombstones while nothing else happens: their alarm is decades
/// out, and a day later all 300 are there, none purged. A registration
/// after them purges (the interval is 0 here, and the tombstones outnumber
/// the live entries): it takes a slice of the purge, and the registrations
/// after it each take the next until the pass has been through every key,
/// leaving only their own watches.
#[test]
fn far_timeout_completions_by_reference_keep_their_tombstones_until_registrations_purge_them() {
    paused_within(10, || async {
        let p: Purgatory<u32, Op> = Purgatory::builder().purge_interval(0).build().unwrap();
        complete_by_reference(&p, 100, Duration::MAX).await;
        settle().await;
        assert_eq!(shape(&p), (0, 300, 300, 300), "{:?}", p.metrics());
        advance(Duration::from_secs(24 * 3600)).await;
        settle().await;
        assert_eq!(shape(&p), (0, 300, 300, 300), "{:?}", p.metrics());
        assert_eq!(p.metrics().purged, 0);

        let never = Arc::new(AtomicBool::new(false));
        let register = |key: u32| {
            p.try_complete_else_watch(Op::new(&never), Duration::MAX, [key])
                .unwrap()
        };
        let mut later = vec![register(10_000)];
        let m = p.metrics();
        assert!(m.purged > 0, "the registration purged: {m:?}");
        assert_eq!(m.tombstones as u64 + m.purged, 300, "{m:?}");
        while p.metrics().tombstones > 0 && later.len() < 10 {
            later.push(register(10_000 + later.len() as u32));
        }
        let n = later.len();
        assert_eq!(shape(&p), (n, n, 0, n), "{:?}", p.metrics());
        assert_eq!(p.metrics().purged, 300);
    });
}

// ---------------------------------------------------------------------------
// A registration's second check completes it on an idle purgatory.

/// A registration completed by its second check (the one after the watch) on
/// an idle purgatory purges its entries in that call, with no wake-up of the
/// reaper.
#[test]
fn a_second_check_completion_on_an_idle_purgatory_purges_at_once() {
    paused_within(10, || async {
        let p: Purgatory<u32, Op> = Purgatory::new();
        settle().await;
        let woken = p.metrics().reaper_wakeups;
        let h = p
            .try_complete_else_watch(Op::at_second_check(), ms(100), [1, 2, 3])
            .unwrap();
        assert_eq!(shape(&p), (0, 0, 0, 0), "{:?}", p.metrics());
        assert_eq!(h.await, Ok(Completion::Completed(1)));
        settle().await;
        assert_eq!(p.metrics().reaper_wakeups, woken, "no wake-up");
        assert!(balanced(&p.metrics()));
    });
}

/// One operation on 100,000 keys completed by its second check on an idle
/// purgatory: the registering thread purges a bounded part (some, at most
/// 3,000 entries), the reaper the rest in at most one wake-up.
#[test]
fn a_wide_second_check_completion_is_bounded_on_the_caller_and_finished_by_the_reaper() {
    paused_within(10, || async {
        let p: Purgatory<u32, Op> = Purgatory::new();
        settle().await;
        let woken = p.metrics().reaper_wakeups;
        let h = p
            .try_complete_else_watch(Op::at_second_check(), ms(100), 0..100_000u32)
            .unwrap();
        let m = p.metrics();
        let purged_on_caller = 100_000 - m.tombstones;
        assert!(purged_on_caller > 0, "the caller started it: {m:?}");
        assert!(purged_on_caller <= 3_000, "bounded: {purged_on_caller}");
        assert_eq!(h.await, Ok(Completion::Completed(1)));
        for _ in 0..400 {
            settle().await;
            if shape(&p) == (0, 0, 0, 0) {
                break;
            }
        }
        assert_eq!(shape(&p), (0, 0, 0, 0), "{:?}", p.metrics());
        let w = p.metrics().reaper_wakeups - woken;
        assert!(w <= 1, "wake-ups {w}");
        assert!(balanced(&p.metrics()));
    });
}

/// A registration at levels (two of them on one key) beside a plain watch,
/// completed by its second check on an idle purgatory, purges its entries in
/// that call.
#[test]
fn a_level_registration_completed_by_its_second_check_purges_at_once() {
    paused_within(10, || async {
        let p: Purgatory<u32, Op> = Purgatory::new();
        settle().await;
        let h = p
            .try_complete_else_watch_levels(
                Op::at_second_check(),
                ms(1000),
                [
                    Watch::level(0, 10),
                    Watch::key(0),
                    Watch::level(1, 3),
                    Watch::level(1, 4),
                ],
            )
            .unwrap();
        assert_eq!(shape(&p), (0, 0, 0, 0), "{:?}", p.metrics());
        assert_eq!(h.await, Ok(Completion::Completed(1)));
    });
}

// ---------------------------------------------------------------------------
// Keys dropped by a completion's purge, from inside another operation's
// check.

/// Handles of operations registered from inside a check.
type Registered = Arc<Mutex<Vec<OperationHandle<HKey, Op>>>>;

/// Registers A on key 0; A's first watched check (its second, the
/// registration's own) registers B on keys 100..120 that share one armed
/// hook running `on_drop`. B completes at its second check, and its
/// completion purges (B's 20 tombstones against A's one live entry): the
/// first key copy the purge drops runs `on_drop`, while A's check is still
/// running. Returns A's registration and, once registered, B's handle.
fn nested(
    p: &Purgatory<HKey, Op>,
    a_ready: &Arc<AtomicBool>,
    on_drop: impl Fn() + Send + Sync + 'static,
) -> (
    Result<OperationHandle<HKey, Op>, WatchError<Op>>,
    Registered,
) {
    let hook = Hook::new(true, on_drop);
    let inner = Registered::default();
    let purgatory = p.downgrade();
    let mut a = Op::new(a_ready);
    let (checks, done) = (a.checks.clone(), AtomicBool::new(false));
    {
        let inner = inner.clone();
        a.in_check = Some(Box::new(move |_| {
            // Only in A's first watched check (its second).
            if checks.load(Ordering::SeqCst) < 2 || done.swap(true, Ordering::SeqCst) {
                return;
            }
            let Some(p) = purgatory.upgrade() else { return };
            let keys: Vec<HKey> = (100..120).map(|id| HKey::hooked(id, &hook)).collect();
            if let Ok(h) = p.try_complete_else_watch(Op::at_second_check(), ms(50), keys) {
                inner.lock().unwrap().push(h);
            }
        }));
    }
    let a = p.try_complete_else_watch(a, ms(10_000), [HKey::plain(0)]);
    (a, inner)
}

/// B's handle, the one operation registered from inside A's check.
fn only(registered: &Registered) -> OperationHandle<HKey, Op> {
    let mut hs = std::mem::take(&mut *registered.lock().unwrap());
    assert_eq!(hs.len(), 1, "B registered once");
    hs.pop().unwrap()
}

/// A key dropped by the nested purge that makes A ready and walks A's key
/// raises an event on A's running check (which decided "not yet"): A is
/// checked again and completes, and the map ends empty.
#[test]
fn a_key_dropped_by_a_nested_completion_purge_raises_an_event_on_the_outer_check() {
    paused_within(10, || async {
        let p: Purgatory<HKey, Op> = Purgatory::new();
        settle().await;
        let a_ready = Arc::new(AtomicBool::new(false));
        let fired = Arc::new(AtomicBool::new(false));
        let (a, inner) = {
            let (w, ready, fired) = (p.downgrade(), a_ready.clone(), fired.clone());
            nested(&p, &a_ready, move || {
                fired.store(true, Ordering::SeqCst);
                ready.store(true, Ordering::SeqCst);
                if let Some(p) = w.upgrade() {
                    p.try_complete_watched(&HKey::plain(0));
                }
            })
        };
        assert!(fired.load(Ordering::SeqCst), "the purge dropped a key");
        let a = a.expect("A registered");
        let b = only(&inner);
        assert!(a.is_finished(), "A saw the event: {:?}", p.metrics());
        assert_eq!(a.await, Ok(Completion::Completed(1)));
        assert_eq!(b.await, Ok(Completion::Completed(1)));
        settle().await;
        assert_eq!(shape(&p), (0, 0, 0, 0), "{:?}", p.metrics());
        assert!(balanced(&p.metrics()));
        assert_eq!(p.metrics().panicked, 0, "what the key drop ran held");
    });
}

/// A key dropped by the nested purge that panics is contained and counted
/// once; both operations complete and the map ends empty.
#[test]
fn a_key_dropped_by_a_nested_completion_purge_may_panic() {
    paused_within(10, || async {
        let p: Purgatory<HKey, Op> = Purgatory::new();
        settle().await;
        let a_ready = Arc::new(AtomicBool::new(false));
        let (a, inner) = nested(&p, &a_ready, || panic!("key drop"));
        let a = a.expect("A registered");
        a_ready.store(true, Ordering::SeqCst);
        assert_eq!(p.try_complete_watched(&HKey::plain(0)), 1);
        for h in [a, only(&inner)] {
            assert_eq!(h.await, Ok(Completion::Completed(1)));
        }
        settle().await;
        let m = p.metrics();
        assert_eq!(m.panicked, 1, "{m:?}");
        assert_eq!(shape(&p), (0, 0, 0, 0), "{m:?}");
        assert!(balanced(&m));
    });
}

/// A key dropped by the nested purge that shuts the purgatory down: A's
/// registration either succeeds or is refused for the shutdown, every
/// handle resolves, and the map ends empty with the counts balanced.
#[test]
fn a_key_dropped_by_a_nested_completion_purge_may_shut_down() {
    paused_within(10, || async {
        let p: Purgatory<HKey, Op> = Purgatory::new();
        settle().await;
        let a_ready = Arc::new(AtomicBool::new(false));
        let w = p.downgrade();
        let (a, inner) = nested(&p, &a_ready, move || {
            if let Some(p) = w.upgrade() {
                drop(p.shutdown());
            }
        });
        let mut hs = std::mem::take(&mut *inner.lock().unwrap());
        match a {
            Ok(a) => hs.push(a),
            Err(e) => assert!(matches!(e, WatchError::Shutdown(_)), "{e:?}"),
        }
        for h in hs {
            let r = tokio::time::timeout(ms(1000), h).await;
            assert!(r.is_ok(), "resolves");
        }
        settle().await;
        let m = p.metrics();
        assert_eq!(shape(&p), (0, 0, 0, 0), "{m:?}");
        assert!(balanced(&m), "{m:?}");
        assert_eq!(m.panicked, 0, "what the key drop ran held: {m:?}");
    });
}

/// A key dropped by the nested purge that registers, walks, cancels by key
/// and registers again: A and B complete, the cancelled operation fails,
/// the other expires, and the map ends empty with the counts balanced.
#[test]
fn a_key_dropped_by_a_nested_completion_purge_may_register_walk_and_cancel() {
    paused_within(10, || async {
        let p: Purgatory<HKey, Op> = Purgatory::new();
        settle().await;
        let a_ready = Arc::new(AtomicBool::new(false));
        let extra = Registered::default();
        let (a, inner) = {
            let (w, extra) = (p.downgrade(), extra.clone());
            nested(&p, &a_ready, move || {
                if let Some(p) = w.upgrade() {
                    let never = Arc::new(AtomicBool::new(false));
                    let h1 = p
                        .try_complete_else_watch(
                            Op::new(&never),
                            ms(30),
                            [HKey::plain(7), HKey::plain(8)],
                        )
                        .unwrap();
                    p.try_complete_watched(&HKey::plain(7));
                    let gone = p.cancel_for_key(&HKey::plain(8));
                    assert_eq!(gone.len(), 1);
                    let h2 = p
                        .try_complete_else_watch(Op::new(&never), ms(30), [HKey::plain(9)])
                        .unwrap();
                    extra.lock().unwrap().extend([h1, h2]);
                }
            })
        };
        let a = a.expect("A registered");
        a_ready.store(true, Ordering::SeqCst);
        assert_eq!(p.try_complete_watched(&HKey::plain(0)), 1);
        for h in [a, only(&inner)] {
            assert_eq!(h.await, Ok(Completion::Completed(1)));
        }
        let mut ex = std::mem::take(&mut *extra.lock().unwrap());
        assert_eq!(ex.len(), 2);
        let h2 = ex.pop().unwrap();
        let h1 = ex.pop().unwrap();
        assert!(h1.await.is_err(), "cancelled");
        advance(ms(31)).await;
        assert_eq!(h2.await, Ok(Completion::Expired(0)));
        settle().await;
        let m = p.metrics();
        assert_eq!(shape(&p), (0, 0, 0, 0), "{m:?}");
        assert!(balanced(&m), "{m:?}");
        assert_eq!(m.panicked, 0, "what the key drop ran held: {m:?}");
    });
}

// ---------------------------------------------------------------------------
// Level watches completed by advances.

/// Operations watching one key at rising levels, a plain key and another
/// key at a level, moved up by advances that say "not yet" and completed
/// by one advance, leave nothing once their timeouts pass.
#[test]
fn level_watches_completed_by_advances_leave_nothing() {
    paused_within(10, || async {
        let p: Purgatory<u32, Op> = Purgatory::new();
        let ready = Arc::new(AtomicBool::new(false));
        let hs: Vec<_> = (0..50u32)
            .map(|i| {
                p.try_complete_else_watch_levels(
                    Op::new(&ready),
                    ms(1000),
                    [
                        Watch::level(0, 10 + u64::from(i)),
                        Watch::key(100 + i),
                        Watch::level(200 + i, 5),
                    ],
                )
                .unwrap()
            })
            .collect();
        for l in [5, 20, 40, 55] {
            p.try_complete_reached(&0, l);
        }
        ready.store(true, Ordering::SeqCst);
        assert_eq!(p.try_complete_reached(&0, 1000), 50);
        for h in hs {
            assert_eq!(h.await, Ok(Completion::Completed(1)));
        }
        advance(ms(1001)).await;
        settle().await;
        assert_eq!(shape(&p), (0, 0, 0, 0), "{:?}", p.metrics());
        assert!(balanced(&p.metrics()));
    });
}

// ---------------------------------------------------------------------------
// A shared reaper.

/// A shared reaper serving two purgatories (3,000 and 5 operations
/// completed by reference) and a timer: after a timer task's turn and the
/// finished operations' alarm, both maps are empty, each purgatory having
/// cost at most two wake-ups.
#[test]
fn a_shared_reaper_purges_each_purgatory_its_completions_left_idle() {
    paused_within(10, || async {
        let reaper = Reaper::start().unwrap();
        let p1: Purgatory<u32, Op> = Purgatory::builder().reaper(&reaper).build().unwrap();
        let p2: Purgatory<u32, Op> = Purgatory::builder().reaper(&reaper).build().unwrap();
        let t = Timer::builder().reaper(&reaper).build().unwrap();
        let ready = Arc::new(AtomicBool::new(false));
        let mut refs = Vec::new();
        for (p, n) in [(&p1, 3_000u32), (&p2, 5u32)] {
            for i in 0..n {
                refs.push(
                    p.try_complete_else_watch(Op::new(&ready), ms(60_000), [i, i + 100_000])
                        .unwrap()
                        .into_op_ref()
                        .unwrap(),
                );
            }
        }
        settle().await;
        let w0 = (p1.metrics().reaper_wakeups, p2.metrics().reaper_wakeups);
        ready.store(true, Ordering::SeqCst);
        assert!(refs.iter().all(|r| r.try_complete()));
        drop(refs);
        let ran = Arc::new(AtomicBool::new(false));
        {
            let ran = ran.clone();
            t.schedule(ms(1_000), move || ran.store(true, Ordering::SeqCst))
                .unwrap();
        }
        advance(ms(1_001)).await;
        for _ in 0..20 {
            settle().await;
        }
        assert!(ran.load(Ordering::SeqCst));
        advance(ms(60_000)).await;
        for _ in 0..20 {
            settle().await;
        }
        assert_eq!(shape(&p1), (0, 0, 0, 0), "p1 {:?}", p1.metrics());
        assert_eq!(shape(&p2), (0, 0, 0, 0), "p2 {:?}", p2.metrics());
        let w1 = (p1.metrics().reaper_wakeups, p2.metrics().reaper_wakeups);
        assert!(w1.0 - w0.0 <= 2 && w1.1 - w0.1 <= 2, "{w0:?} -> {w1:?}");
    });
}

// ---------------------------------------------------------------------------
// A completion held on another thread past its deadline (real threads).

/// What the first key the completion's purge drops does.
#[derive(Clone, Copy, Debug)]
enum KeyDrop {
    DropsTheLastClone,
    ShutsDown,
    Panics,
    Registers,
    CancelsByKey,
    /// Records whether the completed operation's handle has its outcome.
    SeesTheOutcome,
    Nothing,
}

/// Where the completing thread is held past the deadline.
#[derive(Clone, Copy, Debug)]
enum HeldIn {
    Check,
    Drop,
}

/// The last operation's expiry is left to its completion, held on another
/// thread (in its check, or in the operation's drop after it) over the
/// reaper's turn at its deadline (the reaper then sleeps with nothing
/// scheduled). The completion (through an `OpRef`, so that thread holds no
/// purgatory handle) purges the map there, and the first key it drops does
/// `action`. The check completed the operation, a key was dropped, every
/// handle resolves, and the map, if the purgatory lives, ends empty with the
/// counts balanced and no panic but the panicking key's counted.
fn held_past_its_deadline(action: KeyDrop, held_in: HeldIn) {
    within(30, move || {
        let rt = support::paused();
        let p: Purgatory<HKey, Op> = rt.block_on(async { Purgatory::new() });
        let slot = Arc::new(Mutex::new(Some(p.clone())));
        let side = Arc::new(Mutex::new(Vec::new()));
        // The completed operation's handle, where the key's drop can look.
        let watched: Arc<Mutex<Option<OperationHandle<HKey, Op>>>> = Arc::default();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let hook = {
            let (last, slot, side) = (slot.clone(), slot.clone(), side.clone());
            let (watched, seen) = (watched.clone(), seen.clone());
            let live = move || slot.lock().unwrap().clone().unwrap();
            Hook::new(false, move || match action {
                KeyDrop::DropsTheLastClone => drop(last.lock().unwrap().take()),
                KeyDrop::ShutsDown => assert!(live().shutdown().is_empty()),
                KeyDrop::Panics => panic!("key drop in the completion's purge"),
                KeyDrop::Registers => {
                    let never = Arc::new(AtomicBool::new(false));
                    let h = live()
                        .try_complete_else_watch(
                            Op::new(&never),
                            ms(5),
                            [HKey::plain(50), HKey::plain(51)],
                        )
                        .unwrap();
                    side.lock().unwrap().push(h);
                }
                KeyDrop::CancelsByKey => {
                    let p = live();
                    // The other operation's timeout fired already: nothing
                    // to cancel on its key, nor on this operation's.
                    assert!(p.cancel_for_key(&HKey::plain(40)).is_empty());
                    assert!(p.cancel_for_key(&HKey::plain(2)).is_empty());
                }
                KeyDrop::SeesTheOutcome => {
                    let finished = watched.lock().unwrap().as_ref().map(|h| h.is_finished());
                    seen.lock().unwrap().push(finished);
                }
                KeyDrop::Nothing => {}
            })
        };
        let ready = Arc::new(AtomicBool::new(false));
        let (g, inside, go) = gate();
        let mut op = Op::new(&ready);
        match held_in {
            HeldIn::Check => {
                let mut g = Some(g);
                op.in_check = Some(Box::new(move |completes| {
                    if completes {
                        if let Some(g) = g.take() {
                            g.pass();
                        }
                    }
                }));
            }
            HeldIn::Drop => op.on_drop = Some(Box::new(move || g.pass())),
        }
        let keys: Vec<HKey> = (1..=3).map(|id| HKey::hooked(id, &hook)).collect();
        let (h, other) = {
            let _in = rt.enter();
            let h = p.try_complete_else_watch(op, ms(10), keys).unwrap();
            // A second operation with the same timeout, on a key of its own.
            let other = matches!(action, KeyDrop::CancelsByKey).then(|| {
                let never = Arc::new(AtomicBool::new(false));
                p.try_complete_else_watch(Op::new(&never), ms(10), [HKey::plain(40)])
                    .unwrap()
            });
            (h, other)
        };
        let weak = p.downgrade();
        let op = h.op_ref().unwrap();
        let h = if matches!(action, KeyDrop::SeesTheOutcome) {
            *watched.lock().unwrap() = Some(h);
            None
        } else {
            Some(h)
        };
        ready.store(true, Ordering::SeqCst);
        let handle = rt.handle().clone();
        let checker = std::thread::spawn(move || {
            let _in = handle.enter();
            op.try_complete()
        });
        inside.recv_timeout(Duration::from_secs(10)).unwrap();
        rt.block_on(async {
            advance(ms(11)).await;
            settle().await;
        });
        hook.armed.store(true, Ordering::SeqCst);
        drop(p);
        go.send(()).unwrap();
        let r = checker.join();
        assert!(matches!(r, Ok(true)), "the check completed it: {r:?}");
        assert!(
            !hook.armed.load(Ordering::SeqCst),
            "the purge dropped a key"
        );
        if matches!(action, KeyDrop::SeesTheOutcome) {
            assert_eq!(
                *seen.lock().unwrap(),
                [Some(true)],
                "the purge the completion started ran after its outcome was delivered"
            );
        }
        let h = h.or_else(|| watched.lock().unwrap().take()).unwrap();
        rt.block_on(async {
            settle().await;
            let got = tokio::time::timeout(ms(1000), h).await;
            assert_eq!(got, Ok(Ok(Completion::Completed(1))));
            if let Some(o) = other {
                assert!(tokio::time::timeout(ms(1000), o).await.is_ok());
            }
            advance(ms(10)).await;
            settle().await;
            let registered = std::mem::take(&mut *side.lock().unwrap());
            for s in registered {
                assert!(tokio::time::timeout(ms(1000), s).await.is_ok());
            }
            settle().await;
        });
        match weak.upgrade() {
            None => assert!(matches!(action, KeyDrop::DropsTheLastClone)),
            Some(p) => {
                let m = p.metrics();
                assert_eq!(shape(&p), (0, 0, 0, 0), "{action:?}: {m:?}");
                assert!(balanced(&m), "{m:?}");
                // Only the panicking key's: an assertion failing in a key's
                // drop is contained and counted too.
                let panics = u64::from(matches!(action, KeyDrop::Panics));
                assert_eq!(m.panicked, panics, "{action:?}: {m:?}");
            }
        }
    });
}

/// A completion held in its check past its deadline purges the map.
#[test]
fn a_check_held_past_its_deadline_completes_and_purges() {
    held_past_its_deadline(KeyDrop::Nothing, HeldIn::Check);
}

/// A completion held in the operation's drop (finished, its tombstones not
/// yet counted) past its deadline purges the map.
#[test]
fn a_drop_held_past_its_deadline_completes_and_purges() {
    held_past_its_deadline(KeyDrop::Nothing, HeldIn::Drop);
}

/// The purge such a completion starts runs once its outcome is delivered:
/// a key it drops finds the operation's handle finished.
#[test]
fn the_purge_a_completion_starts_runs_after_its_outcome_is_delivered() {
    held_past_its_deadline(KeyDrop::SeesTheOutcome, HeldIn::Check);
}

/// A completion held in its check past its deadline purges though the key
/// it drops drops the purgatory's last clone.
#[test]
fn a_check_held_past_its_deadline_purges_though_a_dropped_key_drops_the_last_clone() {
    held_past_its_deadline(KeyDrop::DropsTheLastClone, HeldIn::Check);
}

/// A completion held in its check past its deadline purges though the key
/// it drops shuts the purgatory down.
#[test]
fn a_check_held_past_its_deadline_purges_though_a_dropped_key_shuts_down() {
    held_past_its_deadline(KeyDrop::ShutsDown, HeldIn::Check);
}

/// A completion held in its check past its deadline purges though the key
/// it drops panics.
#[test]
fn a_check_held_past_its_deadline_purges_though_a_dropped_key_panics() {
    held_past_its_deadline(KeyDrop::Panics, HeldIn::Check);
}

/// A completion held in its check past its deadline purges though the key
/// it drops registers another operation.
#[test]
fn a_check_held_past_its_deadline_purges_though_a_dropped_key_registers() {
    held_past_its_deadline(KeyDrop::Registers, HeldIn::Check);
}

/// A completion held in its check past its deadline purges though the key
/// it drops cancels by key.
#[test]
fn a_check_held_past_its_deadline_purges_though_a_dropped_key_cancels_by_key() {
    held_past_its_deadline(KeyDrop::CancelsByKey, HeldIn::Check);
}

/// A completion held in the operation's drop past its deadline purges
/// though the key it drops drops the purgatory's last clone.
#[test]
fn a_drop_held_past_its_deadline_purges_though_a_dropped_key_drops_the_last_clone() {
    held_past_its_deadline(KeyDrop::DropsTheLastClone, HeldIn::Drop);
}

/// A completion held in the operation's drop past its deadline purges
/// though the key it drops registers another operation.
#[test]
fn a_drop_held_past_its_deadline_purges_though_a_dropped_key_registers() {
    held_past_its_deadline(KeyDrop::Registers, HeldIn::Drop);
}

// ---------------------------------------------------------------------------
// Registrations completed by their second check on several threads (the
// reaper has nothing scheduled: each completion tidies), racing a shutdown,
// a drain or the last clone dropped (real threads).

/// How the race with the registering threads ends.
#[derive(Clone, Copy, Debug)]
enum Ender {
    Shutdown,
    Drain,
    DropLast,
    None,
}

/// Three threads register up to 3,000 wide operations each (40 keys, half
/// shared between the threads), each completed by its registration's second
/// check; once 300 are registered, `ender` runs. Once the threads are done,
/// a live purgatory's map empties (the reaper finishing any purge handed to
/// it) with the counts balanced; a dropped one is gone.
fn second_checks_racing(ender: Ender) {
    within(60, move || {
        let rt = support::multi();
        let p: Purgatory<u32, Op> = rt.block_on(async { Purgatory::new() });
        let weak = p.downgrade();
        let started = Arc::new(Barrier::new(4));
        let threads: Vec<_> = (0..3u32)
            .map(|t| {
                let (w, started) = (weak.clone(), started.clone());
                let handle = rt.handle().clone();
                std::thread::spawn(move || {
                    let _in = handle.enter();
                    started.wait();
                    for i in 0..3_000u32 {
                        let Some(p) = w.upgrade() else { break };
                        let base = (t * 1_000_000) + i * 40;
                        let keys = (0..40u32).map(|k| if k % 2 == 0 { base + k } else { k });
                        if p.try_complete_else_watch(Op::at_second_check(), ms(60_000), keys)
                            .is_err()
                        {
                            break;
                        }
                    }
                })
            })
            .collect();
        started.wait();
        wait_until(10, "300 registered", || {
            let n = p.metrics().registered;
            (n >= 300, n)
        });
        let keep = match ender {
            Ender::Shutdown => {
                drop(p.shutdown());
                Some(p)
            }
            Ender::Drain => {
                let p2 = p.clone();
                rt.block_on(async move {
                    tokio::time::timeout(Duration::from_secs(10), p2.drain())
                        .await
                        .expect("drain ends");
                });
                Some(p)
            }
            Ender::DropLast => {
                drop(p);
                None
            }
            Ender::None => Some(p),
        };
        for t in threads {
            t.join().unwrap();
        }
        match keep {
            Some(p) => {
                wait_until(10, "the map empties", || {
                    (shape(&p) == (0, 0, 0, 0), p.metrics())
                });
                let m = p.metrics();
                assert!(balanced(&m), "{ender:?}: {m:?}");
            }
            None => assert!(weak.upgrade().is_none(), "the last clone is gone"),
        }
        drop(rt);
    });
}

/// Second-check completions on three threads racing a shutdown leave an
/// empty map and balanced counts.
#[test]
fn second_checks_racing_a_shutdown_leave_an_empty_map() {
    second_checks_racing(Ender::Shutdown);
}

/// Second-check completions on three threads racing a drain: the drain ends
/// and the map empties with the counts balanced.
#[test]
fn second_checks_racing_a_drain_leave_an_empty_map() {
    second_checks_racing(Ender::Drain);
}

/// Second-check completions on three threads racing the drop of the last
/// clone: the threads end and the purgatory is gone.
#[test]
fn second_checks_racing_the_last_clone_dropped_end_with_it() {
    second_checks_racing(Ender::DropLast);
}

/// Second-check completions on three threads, with nothing racing them,
/// leave an empty map and balanced counts.
#[test]
fn second_checks_on_three_threads_leave_an_empty_map() {
    second_checks_racing(Ender::None);
}

// ---------------------------------------------------------------------------
// A shutdown racing registrations that complete as it closes (real threads).

/// Rounds: two threads register wide operations (16 keys, half shared), each
/// completed by its registration's second check, while the main thread
/// shuts the purgatory down once a number of them, varied by round, are
/// registered. Once both threads are done, nothing is pending and the
/// purgatory is closed, so its map empties (within moments, not at the last
/// clone's drop) with the counts balanced: a closed purgatory is purged
/// whole at once, its last tidy waiting for a purge slice another thread
/// has under way.
#[test]
fn registrations_completing_while_a_shutdown_closes_leave_no_tombstones() {
    within(120, || {
        let rt = support::multi();
        for round in 0..200u64 {
            let p: Purgatory<u32, Op> = rt.block_on(async { Purgatory::new() });
            let go = Arc::new(Barrier::new(3));
            let threads: Vec<_> = (0..2u32)
                .map(|t| {
                    let (p, go) = (p.clone(), go.clone());
                    let handle = rt.handle().clone();
                    std::thread::spawn(move || {
                        let _in = handle.enter();
                        go.wait();
                        for i in 0..400u32 {
                            let base = t * 1_000_000 + i * 16;
                            let keys = (0..16u32).map(|k| if k < 8 { base + k } else { k });
                            if p.try_complete_else_watch(Op::at_second_check(), ms(60_000), keys)
                                .is_err()
                            {
                                break;
                            }
                        }
                    })
                })
                .collect();
            go.wait();
            let before = 10 + (round % 7) * 40;
            wait_until(10, "registrations before the shutdown", || {
                let n = p.metrics().registered;
                (n >= before, n)
            });
            drop(p.shutdown());
            for t in threads {
                t.join().unwrap();
            }
            // The map is empty then; the reaper may still be finishing the
            // books of a slice it took (keys gone, entries still counted),
            // for some microseconds.
            wait_until(
                5,
                &format!("round {round}: closed, nothing pending"),
                || (shape(&p) == (0, 0, 0, 0), p.metrics()),
            );
            let m = p.metrics();
            assert!(balanced(&m), "{m:?}");
        }
    });
}
