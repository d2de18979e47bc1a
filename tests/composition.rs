//! User code that calls other public APIs: checks, expiries, drops of
//! operations, outputs and keys, wakers and timer tasks that check, reset
//! and cancel other operations by reference, poll drains, shut purgatories
//! and timers down, drop the last clone of a purgatory or timer, register,
//! cancel by key and schedule on neighbours sharing their reaper. Whatever
//! that code does, each operation finishes and is dropped once, each handle
//! resolves, what a `reset` or `cancel` answers agrees with what then
//! happens, the reaper keeps serving what is left on time, and the counts
//! balance. Time is Tokio's paused time throughout, each test bounded; a
//! check held while its deadline passes is held on a real thread, at a
//! barrier; the two cross-thread tests at the end run on a multi-thread
//! runtime in real time, each wait bounded. The seeded stress names its
//! seed on failure, and `PURGATORY_COMPOSITION_SEED` replays it.

mod support;

use std::future::Future;
use std::hash::{Hash, Hasher};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex, OnceLock};
use std::task::{Context, Wake, Waker};
use std::time::Duration;

use tokio::time::{advance, Instant};
use tokio_purgatory::{
    AsyncTaskHandle, Completion, OpRef, Operation, OperationError, OperationHandle,
    OperationStatus, Purgatory, Reaper, TaskHandle, TaskStatus, Timer, UnrunTask, Watch,
    WatchError, WatchKey, WeakPurgatory, WeakTimer,
};

use support::rng::Rng;
use support::{balanced, ms, paused_within, settle, within};

// ---------------------------------------------------------------------------
// The shared test types.

/// User code run once: an expiry's, a drop's.
type Hook = Box<dyn FnOnce() + Send>;
/// An operation's check, told the level of the advance that runs it, if any.
type Check = Box<dyn FnMut(Option<u64>) -> Option<Out> + Send>;

/// What the operations (and timer tasks) of one test did, by id.
#[derive(Default)]
struct Tally {
    dropped: Mutex<Vec<usize>>,
    /// Each expiry, with the time it ran.
    expired: Mutex<Vec<(usize, Instant)>>,
    out_dropped: Mutex<Vec<usize>>,
    /// Checks of one operation that overlapped.
    overlaps: AtomicUsize,
}

impl Tally {
    fn count(v: &Mutex<Vec<usize>>, id: usize) -> usize {
        v.lock().unwrap().iter().filter(|&&i| i == id).count()
    }
    fn drops(&self, id: usize) -> usize {
        Self::count(&self.dropped, id)
    }
    fn dropped_total(&self) -> usize {
        self.dropped.lock().unwrap().len()
    }
    fn out_drops(&self, id: usize) -> usize {
        Self::count(&self.out_dropped, id)
    }
    fn expiries(&self, id: usize) -> usize {
        self.expired
            .lock()
            .unwrap()
            .iter()
            .filter(|(i, _)| *i == id)
            .count()
    }
    fn expiry_log(&self) -> Vec<(usize, Instant)> {
        self.expired.lock().unwrap().clone()
    }
    fn overlaps(&self) -> usize {
        self.overlaps.load(Ordering::SeqCst)
    }
}

/// An operation's output: the id it was made with. Its drop is tallied and
/// may run user code.
struct Out {
    id: usize,
    tally: Arc<Tally>,
    on_drop: Option<Hook>,
}

impl Out {
    fn with(id: usize, tally: &Arc<Tally>, on_drop: impl FnOnce() + Send + 'static) -> Out {
        Out {
            id,
            tally: tally.clone(),
            on_drop: Some(Box::new(on_drop)),
        }
    }
}

fn out(id: usize, tally: &Arc<Tally>) -> Out {
    Out {
        id,
        tally: tally.clone(),
        on_drop: None,
    }
}

impl std::fmt::Debug for Out {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Out({})", self.id)
    }
}

impl PartialEq for Out {
    fn eq(&self, o: &Self) -> bool {
        self.id == o.id
    }
}

impl Drop for Out {
    fn drop(&mut self) {
        self.tally.out_dropped.lock().unwrap().push(self.id);
        if let Some(f) = self.on_drop.take() {
            f();
        }
    }
}

/// An operation whose check, expiry and drop run user code. Its drop and
/// expiry are tallied (the expiry before its code runs); its output on
/// expiry is `Out(id)`, whose drop may run code of its own; two of its
/// checks that overlap are tallied.
struct Op {
    id: usize,
    tally: Arc<Tally>,
    check: Check,
    expire: Option<Hook>,
    expire_out_drop: Option<Hook>,
    on_drop: Option<Hook>,
    busy: AtomicBool,
}

impl Op {
    /// Says "not yet" to every check, does nothing on expiry or drop.
    fn new(id: usize, tally: &Arc<Tally>) -> Op {
        Op {
            id,
            tally: tally.clone(),
            check: Box::new(|_| None),
            expire: None,
            expire_out_drop: None,
            on_drop: None,
            busy: AtomicBool::new(false),
        }
    }
    fn check(mut self, f: impl FnMut(Option<u64>) -> Option<Out> + Send + 'static) -> Op {
        self.check = Box::new(f);
        self
    }
    fn on_expire(mut self, f: impl FnOnce() + Send + 'static) -> Op {
        self.expire = Some(Box::new(f));
        self
    }
    /// Code run by the drop of the output its expiry gives.
    fn on_expiry_output_drop(mut self, f: impl FnOnce() + Send + 'static) -> Op {
        self.expire_out_drop = Some(Box::new(f));
        self
    }
    fn on_drop(mut self, f: impl FnOnce() + Send + 'static) -> Op {
        self.on_drop = Some(Box::new(f));
        self
    }
    fn run(&mut self, reached: Option<u64>) -> Option<Out> {
        if self.busy.swap(true, Ordering::SeqCst) {
            self.tally.overlaps.fetch_add(1, Ordering::SeqCst);
        }
        let o = (self.check)(reached);
        self.busy.store(false, Ordering::SeqCst);
        o
    }
}

impl Operation for Op {
    type Output = Out;
    fn try_complete(&mut self) -> Option<Out> {
        self.run(None)
    }
    fn try_complete_reached(&mut self, reached: u64) -> Option<Out> {
        self.run(Some(reached))
    }
    fn on_expiration(mut self) -> Out {
        self.tally
            .expired
            .lock()
            .unwrap()
            .push((self.id, Instant::now()));
        if let Some(f) = self.expire.take() {
            f();
        }
        Out {
            id: self.id,
            tally: self.tally.clone(),
            on_drop: self.expire_out_drop.take(),
        }
    }
}

impl Drop for Op {
    fn drop(&mut self) {
        self.tally.dropped.lock().unwrap().push(self.id);
        if let Some(f) = self.on_drop.take() {
            f();
        }
    }
}

type P = Purgatory<u32, Op>;
type Ref = Arc<OnceLock<OpRef<u32, Op>>>;
type Outcome<T> = Result<Completion<T>, OperationError>;

/// An outcome with its output read as its id.
fn fate(r: Outcome<Out>) -> Outcome<usize> {
    r.map(|c| c.map(|o| o.id))
}

/// A key whose `Drop` (of any copy: the caller's, the map's) runs user code,
/// told the key's id.
#[derive(Clone)]
struct Key {
    id: u32,
    hook: Option<KeyHook>,
}

type KeyHook = Arc<dyn Fn(u32) + Send + Sync>;

impl Key {
    fn plain(id: u32) -> Key {
        Key { id, hook: None }
    }
    fn hooked(id: u32, hook: &KeyHook) -> Key {
        Key {
            id,
            hook: Some(hook.clone()),
        }
    }
}

impl PartialEq for Key {
    fn eq(&self, o: &Key) -> bool {
        self.id == o.id
    }
}
impl Eq for Key {}
impl Hash for Key {
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.id.hash(h)
    }
}
impl Drop for Key {
    fn drop(&mut self) {
        if let Some(h) = self.hook.take() {
            h(self.id);
        }
    }
}

type KP = Purgatory<Key, Op>;

/// A waker that counts its wake-ups and runs its hook on each.
struct Wakes {
    count: AtomicUsize,
    hook: Option<Box<dyn Fn() + Send + Sync>>,
}

impl Wakes {
    fn counting() -> Arc<Wakes> {
        Arc::new(Wakes {
            count: AtomicUsize::new(0),
            hook: None,
        })
    }
    fn hooked(f: impl Fn() + Send + Sync + 'static) -> Arc<Wakes> {
        Arc::new(Wakes {
            count: AtomicUsize::new(0),
            hook: Some(Box::new(f)),
        })
    }
    fn count(&self) -> usize {
        self.count.load(Ordering::SeqCst)
    }
}

impl Wake for Wakes {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.count.fetch_add(1, Ordering::SeqCst);
        if let Some(h) = &self.hook {
            h();
        }
    }
}

/// A drain (or any future) kept by user code to poll again later.
type Kept = Pin<Box<dyn Future<Output = ()> + Send>>;
type KeptSlot = Arc<Mutex<Option<Kept>>>;

/// Polls `f` once with `waker`'s waker: whether it was ready.
fn poll_ready<F: Future + ?Sized>(f: Pin<&mut F>, waker: &Arc<Wakes>) -> bool {
    let w = Waker::from(waker.clone());
    f.poll(&mut Context::from_waker(&w)).is_ready()
}

/// A purgatory user code can drain from anywhere (`drain` borrows it).
fn leaked<T>(t: T) -> &'static T {
    Box::leak(Box::new(t))
}

/// Schedules `f` on `timer`, which must accept it.
fn schedule(timer: &Timer, delay: Duration, f: impl FnOnce() + Send + 'static) -> TaskHandle {
    timer
        .schedule(delay, f)
        .map_err(|e| e.kind())
        .expect("scheduled")
}

/// Owned by a timer task: tallies its drop, with the task's id.
struct Token {
    id: usize,
    tally: Arc<Tally>,
}

impl Drop for Token {
    fn drop(&mut self) {
        self.tally.dropped.lock().unwrap().push(self.id);
    }
}

/// Nothing pending, nothing watched but tombstones, the counts balanced.
fn quiet<K: WatchKey, O: Operation>(p: &Purgatory<K, O>) {
    let m = p.metrics();
    assert_eq!(m.delayed, 0, "{m:?}");
    assert!(balanced(&m), "unbalanced {m:?}");
    assert_eq!(m.watched, m.tombstones, "{m:?}");
}

// ---------------------------------------------------------------------------
// Checks that reach other operations.

/// Registers `op` watching `key` for 100 s and keeps a reference to it.
fn watched(p: &P, op: Op, key: u32, r: &Ref) -> OperationHandle<u32, Op> {
    let h = p
        .try_complete_else_watch(op, Duration::from_secs(100), [key])
        .unwrap();
    r.set(h.op_ref().unwrap()).ok().unwrap();
    h
}

/// A check run from inside another operation's check (through its
/// `OpRef`) that reaches back to that outer operation, still being checked
/// one frame up: `update` answers `None` at once (it does not wait for the
/// outer check), `try_complete` says `false`, and a `reset_at` into the past
/// says `true` and holds: the outer operation, still pending, expires on the
/// reaper's next turn, once.
#[test]
fn a_nested_check_updates_checks_and_resets_the_outer_operation() {
    paused_within(10, || async {
        let t = Arc::new(Tally::default());
        let p: P = Purgatory::new();
        let (a_ref, b_ref): (Ref, Ref) = Default::default();
        let armed = Arc::new(AtomicBool::new(false));
        let seen: Arc<Mutex<Vec<String>>> = Arc::default();

        let (ar, s2, t2) = (a_ref.clone(), seen.clone(), t.clone());
        let b = Op::new(2, &t).check(move |_| {
            let a = ar.get()?;
            let mut s = s2.lock().unwrap();
            s.push(format!("update={:?}", a.update(|_| 1)));
            s.push(format!("check={}", a.try_complete()));
            s.push(format!("reset={}", a.reset_at(Instant::now() - ms(1))));
            s.push(format!("status={:?}", a.status()));
            Some(out(2, &t2))
        });
        let hb = watched(&p, b, 2, &b_ref);
        let (br, arm2) = (b_ref.clone(), armed.clone());
        let a = Op::new(1, &t).check(move |_| {
            if arm2.load(Ordering::SeqCst) {
                br.get().unwrap().try_complete();
            }
            None
        });
        let ha = watched(&p, a, 1, &a_ref);
        armed.store(true, Ordering::SeqCst);

        assert_eq!(p.try_complete_watched(&1), 0);
        assert_eq!(
            *seen.lock().unwrap(),
            ["update=None", "check=false", "reset=true", "status=Pending"]
        );
        assert_eq!(hb.await.map(|c| c.is_completed()), Ok(true));
        // A's timeout was moved into the past: the reaper's next turn.
        advance(ms(1)).await;
        settle().await;
        let r = tokio::time::timeout(ms(10), ha)
            .await
            .expect("A expires at once");
        assert_eq!(fate(r), Ok(Completion::Expired(1)));
        assert_eq!(t.drops(1), 1);
        assert_eq!(t.expiries(1), 1);
        assert_eq!(t.drops(2), 1);
        assert_eq!(t.overlaps(), 0);
        quiet(&p);
        assert_eq!(p.metrics().panicked, 0);
    });
}

/// A nested check that cancels the outer operation, still being checked one
/// frame up: the cancel is left to that check (`cancel` answers `None`), and
/// the outer operation ends `Cancelled`, once, dropped once; the nested one
/// completes.
#[test]
fn a_nested_check_cancels_the_outer_operation() {
    paused_within(10, || async {
        let t = Arc::new(Tally::default());
        let p: P = Purgatory::new();
        let (a_ref, b_ref): (Ref, Ref) = Default::default();
        let armed = Arc::new(AtomicBool::new(false));
        let got: Arc<Mutex<Vec<bool>>> = Arc::default();

        let (ar, g2, t2) = (a_ref.clone(), got.clone(), t.clone());
        let b = Op::new(2, &t).check(move |_| {
            let a = ar.get()?;
            g2.lock().unwrap().push(a.cancel().is_some());
            Some(out(2, &t2))
        });
        let hb = watched(&p, b, 2, &b_ref);
        let (br, arm2) = (b_ref.clone(), armed.clone());
        let a = Op::new(1, &t).check(move |_| {
            if arm2.load(Ordering::SeqCst) {
                br.get().unwrap().try_complete();
            }
            None
        });
        let ha = watched(&p, a, 1, &a_ref);
        armed.store(true, Ordering::SeqCst);

        assert_eq!(p.try_complete_watched(&1), 0);
        assert_eq!(*got.lock().unwrap(), [false]);
        assert_eq!(ha.await, Err(OperationError::Cancelled));
        assert!(hb.await.is_ok());
        assert_eq!(t.drops(1), 1);
        assert_eq!(t.drops(2), 1);
        quiet(&p);
        assert_eq!(p.metrics().panicked, 0);
    });
}

/// An operation's check polls its own handle (pending: the waker is kept)
/// and then completes; the waker, woken by that completion, polls the
/// handle again from inside `wake` and reads the outcome, whose output is
/// then dropped once.
#[test]
fn a_check_polls_its_own_handle_and_its_waker_polls_it_again() {
    paused_within(10, || async {
        let t = Arc::new(Tally::default());
        let p: P = Purgatory::new();
        let slot: Arc<Mutex<Option<OperationHandle<u32, Op>>>> = Arc::default();
        let log: Arc<Mutex<Vec<String>>> = Arc::default();
        let armed = Arc::new(AtomicBool::new(false));
        let (s2, l2, a2, t2) = (slot.clone(), log.clone(), armed.clone(), t.clone());
        let a = Op::new(1, &t).check(move |_| {
            if !a2.load(Ordering::SeqCst) {
                return None;
            }
            let (s3, l3) = (s2.clone(), l2.clone());
            // Polls the handle again when woken, and reads it if ready.
            let waker = Wakes::hooked(move || {
                let mut g = s3.lock().unwrap();
                if let Some(h) = g.as_mut() {
                    let ready = poll_ready(Pin::new(h), &Wakes::counting());
                    l3.lock().unwrap().push(format!("woken: ready={ready}"));
                    if ready {
                        *g = None;
                    }
                }
            });
            let mut g = s2.lock().unwrap();
            let ready = poll_ready(Pin::new(g.as_mut().unwrap()), &waker);
            l2.lock().unwrap().push(format!("in check: ready={ready}"));
            drop(g);
            Some(out(1, &t2))
        });
        let h = p
            .try_complete_else_watch(a, Duration::from_secs(1), [1])
            .unwrap();
        *slot.lock().unwrap() = Some(h);
        armed.store(true, Ordering::SeqCst);
        assert_eq!(p.try_complete_watched(&1), 1);
        assert_eq!(
            *log.lock().unwrap(),
            ["in check: ready=false", "woken: ready=true"]
        );
        assert!(slot.lock().unwrap().is_none());
        assert_eq!(
            t.out_drops(1),
            1,
            "the output read by the waker's poll, then dropped"
        );
        quiet(&p);
    });
}

// ---------------------------------------------------------------------------
// Drains and shutdowns from user code.

/// A drain polled once from inside the check of the last pending operation,
/// and kept: it is pending then (that operation still counts), a
/// registration from that check is refused as `Draining` with its operation
/// handed back, and the check's completion wakes the drain, which is then
/// ready.
#[test]
fn a_drain_polled_from_the_last_operations_check_is_woken_by_its_completion() {
    paused_within(10, || async {
        let t = Arc::new(Tally::default());
        let p: &'static P = leaked(Purgatory::new());
        let woke = Wakes::counting();
        let kept: KeptSlot = Arc::default();
        let armed = Arc::new(AtomicBool::new(false));
        let first_poll: Arc<Mutex<Option<bool>>> = Arc::default();
        let (k2, w2, arm2, fp, t2) = (
            kept.clone(),
            woke.clone(),
            armed.clone(),
            first_poll.clone(),
            t.clone(),
        );
        let a = Op::new(1, &t).check(move |_| {
            if !arm2.load(Ordering::SeqCst) {
                return None;
            }
            let mut d: Kept = Box::pin(p.drain());
            *fp.lock().unwrap() = Some(poll_ready(d.as_mut(), &w2));
            // A registration from the check is refused now, handed back.
            match p.try_complete_else_watch(Op::new(9, &t2), ms(5), [3]) {
                Err(WatchError::Draining(op)) => assert_eq!(op.id, 9),
                other => panic!("expected Draining, got {:?}", other.map(|_| ())),
            }
            *k2.lock().unwrap() = Some(d);
            Some(out(1, &t2))
        });
        let ha = p
            .try_complete_else_watch(a, Duration::from_secs(100), [1])
            .unwrap();
        armed.store(true, Ordering::SeqCst);
        assert_eq!(p.try_complete_watched(&1), 1);
        assert_eq!(*first_poll.lock().unwrap(), Some(false), "A was pending");
        assert!(woke.count() >= 1, "drain not woken");
        let mut d = kept.lock().unwrap().take().unwrap();
        assert!(poll_ready(d.as_mut(), &woke));
        assert!(ha.await.is_ok());
        assert_eq!(t.drops(9), 1);
        assert_eq!(t.drops(1), 1);
        quiet(p);
        assert_eq!(p.metrics().panicked, 0);
        drop(p.shutdown());
    });
}

/// A drain polled from an expiry on the reaper, and kept, while another
/// operation is still pending: it stays pending, is woken once that other
/// operation expires too, and is then ready.
#[test]
fn a_drain_polled_from_an_expiry_on_the_reaper_ends_when_nothing_is_pending() {
    paused_within(10, || async {
        let t = Arc::new(Tally::default());
        let p: &'static P = leaked(Purgatory::new());
        let woke = Wakes::counting();
        let kept: KeptSlot = Arc::default();
        let (k2, w2) = (kept.clone(), woke.clone());
        let a = Op::new(1, &t).on_expire(move || {
            let mut d: Kept = Box::pin(p.drain());
            let _ = poll_ready(d.as_mut(), &w2);
            *k2.lock().unwrap() = Some(d);
        });
        let ha = p.try_complete_else_watch(a, ms(10), [1]).unwrap();
        let hb = p
            .try_complete_else_watch(Op::new(2, &t), ms(20), [1])
            .unwrap();
        assert!(ha.await.is_ok());
        let mut d = kept.lock().unwrap().take().unwrap();
        assert!(!poll_ready(d.as_mut(), &woke));
        assert!(hb.await.is_ok());
        assert!(woke.count() >= 1, "drain not woken");
        assert!(poll_ready(d.as_mut(), &woke));
        quiet(p);
        drop(p.shutdown());
    });
}

/// A registration whose second check (the one made once its keys are
/// watched) cancels by its own key, polls a drain and shuts the purgatory
/// down: the cancel by key hands out nothing (the operation is still being
/// registered), the shutdown nothing else; the registration hands the
/// operation back as `Shutdown`, or returns a handle that resolves
/// `Cancelled` or `Shutdown`; it is dropped once, the drain is ready, and
/// the counts balance with nothing watched.
#[test]
fn a_registrations_watched_check_cancels_by_key_then_shuts_down() {
    paused_within(10, || async {
        let t = Arc::new(Tally::default());
        let p: &'static P = leaked(Purgatory::new());
        let n = Arc::new(AtomicUsize::new(0));
        let woke = Wakes::counting();
        let kept: KeptSlot = Arc::default();
        let (n2, w2, k2) = (n.clone(), woke.clone(), kept.clone());
        let a = Op::new(1, &t).check(move |_| {
            if n2.fetch_add(1, Ordering::SeqCst) == 1 {
                let back = p.cancel_for_key(&1);
                assert!(back.is_empty(), "a registering op is not handed out");
                let mut d: Kept = Box::pin(p.drain());
                let _ = poll_ready(d.as_mut(), &w2);
                *k2.lock().unwrap() = Some(d);
                let back = p.shutdown();
                assert!(back.is_empty(), "nothing else pending");
            }
            None
        });
        match p.try_complete_else_watch(a, Duration::from_secs(100), [1, 2]) {
            Err(WatchError::Shutdown(op)) => {
                assert_eq!(op.id, 1);
                drop(op);
            }
            Ok(h) => {
                let o = h.await;
                assert!(
                    matches!(o, Err(OperationError::Cancelled | OperationError::Shutdown)),
                    "{o:?}"
                );
            }
            Err(e) => panic!("unexpected {:?}", e.kind()),
        }
        assert_eq!(t.drops(1), 1);
        let mut d = kept.lock().unwrap().take().unwrap();
        assert!(poll_ready(d.as_mut(), &woke));
        let m = p.metrics();
        assert!(balanced(&m), "{m:?}");
        assert_eq!(m.delayed, 0, "{m:?}");
        assert_eq!(m.watched, 0, "{m:?}");
        assert_eq!(m.panicked, 0, "{m:?}");
    });
}

// ---------------------------------------------------------------------------
// What a reaper turn's own code does to the rest of its turn and to the
// neighbours sharing its reaper.

/// Forty operations due together; the first expiry moves each of the others
/// 100 ms later. Each reset that says `true` holds (that operation expires
/// 100 ms after the first), each `false` is an expiry already under way
/// (that operation expires in the same turn).
fn resets_from_an_expiry_agree_with_the_turn(shared: bool) {
    paused_within(10, move || async move {
        let t = Arc::new(Tally::default());
        let reaper = Reaper::start().unwrap();
        let p: P = if shared {
            Purgatory::builder().reaper(&reaper).build().unwrap()
        } else {
            Purgatory::new()
        };
        let n = 40;
        let refs: Arc<OnceLock<Vec<OpRef<u32, Op>>>> = Arc::default();
        let first = Arc::new(AtomicBool::new(true));
        let resets: Arc<Mutex<Vec<(usize, bool)>>> = Arc::default();
        let start = Instant::now();
        let mut hs = Vec::new();
        for i in 0..n {
            let (r2, f2, rs2) = (refs.clone(), first.clone(), resets.clone());
            let op = Op::new(i, &t).on_expire(move || {
                if f2.swap(false, Ordering::SeqCst) {
                    for (j, r) in r2.get().unwrap().iter().enumerate() {
                        if j != i {
                            rs2.lock().unwrap().push((j, r.reset(ms(100))));
                        }
                    }
                }
            });
            hs.push(
                p.try_complete_else_watch(op, ms(10), [i as u32 % 3])
                    .unwrap(),
            );
        }
        refs.set(hs.iter().map(|h| h.op_ref().unwrap()).collect())
            .ok()
            .unwrap();
        for h in hs {
            assert!(matches!(h.await, Ok(Completion::Expired(_))));
        }
        let log = t.expiry_log();
        let resets = resets.lock().unwrap().clone();
        assert_eq!(log.len(), n);
        assert_eq!(resets.len(), n - 1);
        let first_at = log[0].1;
        for (j, moved) in resets {
            let at = log.iter().find(|(i, _)| *i == j).unwrap().1;
            if moved {
                assert!(
                    at >= first_at + ms(100),
                    "op {j}: reset returned true but it expired at {:?} (first at {:?})",
                    at - start,
                    first_at - start
                );
            } else {
                assert!(
                    at < first_at + ms(5),
                    "op {j}: reset false, expired late {:?}",
                    at - start
                );
            }
        }
        let m = p.metrics();
        assert!(balanced(&m), "{m:?}");
        assert_eq!(m.panicked, 0, "{m:?}");
        assert_eq!(t.dropped_total(), n);
    });
}

/// Resets made by an expiry to the other operations of its turn agree with
/// what then happens, on a purgatory's own reaper: a `true` holds, a `false`
/// means the operation expires in that turn.
#[test]
fn resets_from_an_expiry_agree_with_the_turn_own_reaper() {
    resets_from_an_expiry_agree_with_the_turn(false);
}

/// The same on a shared reaper.
#[test]
fn resets_from_an_expiry_agree_with_the_turn_shared_reaper() {
    resets_from_an_expiry_agree_with_the_turn(true);
}

/// Cancels by reference made by an expiry to the other operations of its
/// turn agree with what then happens: a cancel that hands the operation
/// back means it never expires and its handle reads `Cancelled`; `None`
/// means it expired. Each is dropped once.
#[test]
fn cancels_from_an_expiry_agree_with_the_turn() {
    paused_within(10, || async {
        let t = Arc::new(Tally::default());
        let p: P = Purgatory::new();
        let n = 40;
        let refs: Arc<OnceLock<Vec<OpRef<u32, Op>>>> = Arc::default();
        let first = Arc::new(AtomicBool::new(true));
        let got: Arc<Mutex<Vec<(usize, bool)>>> = Arc::default();
        let mut hs = Vec::new();
        for i in 0..n {
            let (r2, f2, g2) = (refs.clone(), first.clone(), got.clone());
            let op = Op::new(i, &t).on_expire(move || {
                if f2.swap(false, Ordering::SeqCst) {
                    for (j, r) in r2.get().unwrap().iter().enumerate() {
                        if j != i {
                            let c = r.cancel();
                            if let Some(op) = &c {
                                assert_eq!(op.id, j);
                            }
                            g2.lock().unwrap().push((j, c.is_some()));
                        }
                    }
                }
            });
            hs.push(
                p.try_complete_else_watch(op, ms(10), [i as u32 % 3])
                    .unwrap(),
            );
        }
        refs.set(hs.iter().map(|h| h.op_ref().unwrap()).collect())
            .ok()
            .unwrap();
        let mut outcomes = Vec::new();
        for h in hs {
            outcomes.push(h.await);
        }
        let log = t.expiry_log();
        let got = got.lock().unwrap().clone();
        assert_eq!(got.len(), n - 1);
        for (j, taken) in got {
            let expired = log.iter().any(|(i, _)| *i == j);
            assert_eq!(expired, !taken, "op {j}");
            match &outcomes[j] {
                Ok(Completion::Expired(_)) => assert!(!taken),
                Err(OperationError::Cancelled) => assert!(taken),
                o => panic!("{o:?}"),
            }
        }
        let m = p.metrics();
        assert!(balanced(&m), "{m:?}");
        assert_eq!(m.panicked, 0, "{m:?}");
        for i in 0..n {
            assert_eq!(t.drops(i), 1, "op {i} drops");
        }
    });
}

/// `cancel_for_key` from the first expiry of a turn, on a key every
/// operation of the turn watches: what it hands back never expires and
/// reads `Cancelled`, the rest expire, each once.
#[test]
fn cancel_for_key_from_an_expiry_agrees_with_the_turn() {
    paused_within(10, || async {
        let t = Arc::new(Tally::default());
        let p: P = Purgatory::new();
        let weak = p.downgrade();
        let n = 40;
        let first = Arc::new(AtomicBool::new(true));
        let back: Arc<Mutex<Vec<usize>>> = Arc::default();
        let mut hs = Vec::new();
        for i in 0..n {
            let (w2, f2, b2) = (weak.clone(), first.clone(), back.clone());
            let op = Op::new(i, &t).on_expire(move || {
                if f2.swap(false, Ordering::SeqCst) {
                    let p = w2.upgrade().unwrap();
                    let ops = p.cancel_for_key(&7);
                    b2.lock().unwrap().extend(ops.iter().map(|o| o.id));
                }
            });
            hs.push(
                p.try_complete_else_watch(op, ms(10), [7, i as u32])
                    .unwrap(),
            );
        }
        let mut outcomes = Vec::new();
        for h in hs {
            outcomes.push(h.await);
        }
        let log = t.expiry_log();
        let back = back.lock().unwrap().clone();
        for (j, outcome) in outcomes.iter().enumerate() {
            let expired = log.iter().any(|(i, _)| *i == j);
            let taken = back.contains(&j);
            assert!(
                expired != taken,
                "op {j}: expired {expired} handed back {taken}"
            );
            match outcome {
                Ok(Completion::Expired(_)) => assert!(expired),
                Err(OperationError::Cancelled) => assert!(taken),
                o => panic!("{o:?}"),
            }
        }
        let m = p.metrics();
        assert!(balanced(&m), "{m:?}");
        assert_eq!(m.delayed, 0);
        assert_eq!(t.dropped_total(), n);
    });
}

/// Forty timer tasks due in one turn with a purgatory's expiry on the same
/// shared reaper; whichever of them runs first moves the even tasks 100 ms
/// later and cancels the odd ones. A reset that says `true` means the task
/// runs once, 100 ms later; a cancel that says `true` means it never runs;
/// a `false` means it ran in that turn. The expiry happens, and no task is
/// left pending.
#[test]
fn timer_resets_and_cancels_from_a_turn_agree() {
    paused_within(10, || async {
        let t = Arc::new(Tally::default());
        let reaper = Reaper::start().unwrap();
        let timer = Timer::builder().reaper(&reaper).build().unwrap();
        let p: P = Purgatory::builder().reaper(&reaper).build().unwrap();
        let n = 40;
        let ran: Arc<Mutex<Vec<(usize, Instant)>>> = Arc::default();
        let handles: Arc<OnceLock<Vec<TaskHandle>>> = Arc::default();
        // What was done to each task, and what the call said.
        type Acts = Mutex<Vec<(usize, &'static str, bool)>>;
        let acts: Arc<Acts> = Arc::default();
        let acted_at: Arc<Mutex<Option<Instant>>> = Arc::default();
        let first = Arc::new(AtomicBool::new(true));
        // Moves or cancels every task but `me`, if nothing did so before.
        let act: Arc<dyn Fn(Option<usize>) + Send + Sync> = {
            let (handles, acts, acted_at) = (handles.clone(), acts.clone(), acted_at.clone());
            Arc::new(move |me| {
                if !first.swap(false, Ordering::SeqCst) {
                    return;
                }
                *acted_at.lock().unwrap() = Some(Instant::now());
                for (j, h) in handles.get().unwrap().iter().enumerate() {
                    if Some(j) == me {
                        continue;
                    }
                    if j % 2 == 0 {
                        acts.lock().unwrap().push((j, "reset", h.reset(ms(100))));
                    } else {
                        acts.lock().unwrap().push((j, "cancel", h.cancel()));
                    }
                }
            })
        };
        let mut hs = Vec::new();
        for i in 0..n {
            let (r2, a2) = (ran.clone(), act.clone());
            hs.push(schedule(&timer, ms(10), move || {
                r2.lock().unwrap().push((i, Instant::now()));
                a2(Some(i));
            }));
        }
        handles.set(hs).ok().unwrap();
        let a3 = act.clone();
        let h = p
            .try_complete_else_watch(Op::new(999, &t).on_expire(move || a3(None)), ms(10), [1])
            .unwrap();
        let start = Instant::now();
        tokio::time::sleep(ms(200)).await;
        settle().await;
        assert_eq!(fate(h.await), Ok(Completion::Expired(999)));
        let ran = ran.lock().unwrap().clone();
        let first_at = acted_at
            .lock()
            .unwrap()
            .expect("a task or the expiry acted");
        let acts = acts.lock().unwrap().clone();
        assert!(acts.len() >= n - 1, "{acts:?}");
        for (j, what, ok) in acts {
            let runs: Vec<_> = ran
                .iter()
                .filter(|(i, _)| *i == j)
                .map(|(_, t)| *t)
                .collect();
            match (what, ok) {
                ("reset", true) => {
                    assert_eq!(runs.len(), 1, "task {j}");
                    assert!(
                        runs[0] >= first_at + ms(100),
                        "task {j} ran at {:?}",
                        runs[0] - start
                    );
                }
                ("cancel", true) => assert!(runs.is_empty(), "cancelled task {j} ran"),
                (_, false) => {
                    assert_eq!(runs.len(), 1, "task {j}");
                    assert!(runs[0] < first_at + ms(5));
                }
                _ => unreachable!(),
            }
        }
        let tm = timer.metrics();
        assert_eq!(tm.pending, 0, "{tm:?}");
        assert_eq!(tm.panicked, 0, "{tm:?}");
    });
}

/// On a shared reaper, a timer task brings a purgatory's operation an hour
/// out forward (`OpRef::reset_at` into the past) and a purgatory's expiry
/// brings a timer task an hour out forward (`TaskHandle::reset` to zero):
/// both run at once, not at their old deadlines.
#[test]
fn bringing_a_neighbours_entry_forward_from_a_turn_runs_it_at_once() {
    paused_within(10, || async {
        let t = Arc::new(Tally::default());
        let reaper = Reaper::start().unwrap();
        let timer = Timer::builder().reaper(&reaper).build().unwrap();
        let p: P = Purgatory::builder().reaper(&reaper).build().unwrap();
        let far = p
            .try_complete_else_watch(Op::new(1, &t), Duration::from_secs(3600), [1])
            .unwrap();
        let far_ref = far.op_ref().unwrap();
        let ran_far = Arc::new(Mutex::new(None));
        let rf = ran_far.clone();
        let far_task = Arc::new(schedule(&timer, Duration::from_secs(3600), move || {
            *rf.lock().unwrap() = Some(Instant::now());
        }));
        let start = Instant::now();
        schedule(&timer, ms(10), move || {
            assert!(far_ref.reset_at(Instant::now() - ms(5)));
        });
        let ft = far_task.clone();
        let _near = p
            .try_complete_else_watch(
                Op::new(2, &t).on_expire(move || assert!(ft.reset(Duration::ZERO))),
                ms(20),
                [2],
            )
            .unwrap();
        let r = tokio::time::timeout(ms(15), far)
            .await
            .expect("brought forward");
        assert_eq!(fate(r), Ok(Completion::Expired(1)));
        assert!(start.elapsed() <= ms(12), "{:?}", start.elapsed());
        tokio::time::sleep(ms(15)).await;
        settle().await;
        let at = ran_far
            .lock()
            .unwrap()
            .expect("far task brought forward ran");
        assert!(at - start <= ms(22), "{:?}", at - start);
        assert_eq!(p.metrics().panicked, 0);
        assert_eq!(timer.metrics().panicked, 0);
    });
}

/// An expiry on the reaper advances a level key; the operations watching it
/// complete there (detached), and the drop of each of their outputs shuts
/// the purgatory down while the reaper's batch still has operations due.
/// Each handle reads `Expired` or `Shutdown`, every operation is dropped
/// once and expires at most once, no output is dropped twice, no check
/// overlaps or panics, and the counts balance.
#[test]
fn an_expiry_advances_and_a_dropped_output_shuts_down_mid_batch() {
    paused_within(10, || async {
        let t = Arc::new(Tally::default());
        let p: P = Purgatory::new();
        let weak = p.downgrade();
        let back: Arc<Mutex<Vec<Op>>> = Arc::default();
        for i in 0..4 {
            let (w2, b2, t2) = (weak.clone(), back.clone(), t.clone());
            let op = Op::new(50 + i, &t).check(move |r| {
                r?;
                let (w3, b3) = (w2.clone(), b2.clone());
                Some(Out::with(50 + i, &t2, move || {
                    if let Some(p) = w3.upgrade() {
                        b3.lock().unwrap().extend(p.shutdown());
                    }
                }))
            });
            p.try_complete_else_watch_levels(op, Duration::from_secs(100), [Watch::level(9, 5)])
                .unwrap()
                .detach();
        }
        let mut hs = Vec::new();
        for i in 0..10 {
            let w2 = weak.clone();
            let op = Op::new(i, &t).on_expire(move || {
                if let Some(p) = w2.upgrade() {
                    p.try_complete_reached(&9, 10);
                }
            });
            hs.push(p.try_complete_else_watch(op, ms(10), [i as u32]).unwrap());
        }
        let mut expired = 0;
        let mut shut = 0;
        for h in hs {
            match h.await {
                Ok(Completion::Expired(_)) => expired += 1,
                Err(OperationError::Shutdown) => shut += 1,
                other => panic!("{other:?}"),
            }
        }
        let handed: Vec<Op> = std::mem::take(&mut *back.lock().unwrap());
        let handed_ids: Vec<usize> = handed.iter().map(|x| x.id).collect();
        drop(handed);
        assert_eq!(expired + shut, 10);
        for i in 0..10 {
            assert_eq!(t.drops(i), 1, "op {i}");
            assert!(t.expiries(i) <= 1, "op {i}");
        }
        for i in 50..54 {
            assert_eq!(t.drops(i), 1, "level op {i}");
            assert!(t.out_drops(i) <= 1);
        }
        let m = p.metrics();
        assert!(balanced(&m), "{m:?} handed {handed_ids:?}");
        assert_eq!(m.delayed, 0);
        assert_eq!(m.panicked, 0, "{m:?}");
        assert_eq!(t.overlaps(), 0);
    });
}

/// An expiry on the reaper checks another operation through its `OpRef`;
/// that check reads the expiring operation (finished: `reset` says `false`,
/// its status `Expired`), shuts the purgatory down, registers again (refused
/// as `Shutdown`, handed back) and completes. A third operation due in the
/// same turn either expires or is handed back by that shutdown; every
/// operation is dropped once and the counts balance.
#[test]
fn an_expiry_checks_another_whose_check_shuts_down_and_registers() {
    paused_within(10, || async {
        let t = Arc::new(Tally::default());
        let p: P = Purgatory::new();
        let weak = p.downgrade();
        let (a_ref, b_ref): (Ref, Ref) = Default::default();
        let armed = Arc::new(AtomicBool::new(false));
        let seen: Arc<Mutex<Vec<String>>> = Arc::default();
        let back: Arc<Mutex<Vec<Op>>> = Arc::default();
        let (ar, w2, s2, arm2, t2, b2) = (
            a_ref.clone(),
            weak.clone(),
            seen.clone(),
            armed.clone(),
            t.clone(),
            back.clone(),
        );
        let b = Op::new(2, &t).check(move |_| {
            if !arm2.load(Ordering::SeqCst) {
                return None;
            }
            let a = ar.get().unwrap();
            s2.lock().unwrap().push(format!(
                "a reset={} status={:?}",
                a.reset(ms(1)),
                a.status()
            ));
            let p = w2.upgrade().unwrap();
            b2.lock().unwrap().extend(p.shutdown());
            match p.try_complete_else_watch(Op::new(9, &t2), ms(5), [3]) {
                Err(WatchError::Shutdown(op)) => s2.lock().unwrap().push(format!("back {}", op.id)),
                other => s2
                    .lock()
                    .unwrap()
                    .push(format!("?? {:?}", other.map(|_| ()).map_err(|e| e.kind()))),
            }
            Some(out(2, &t2))
        });
        let hb = watched(&p, b, 2, &b_ref);
        let (br, arm3) = (b_ref.clone(), armed.clone());
        let a = Op::new(1, &t).on_expire(move || {
            arm3.store(true, Ordering::SeqCst);
            assert!(br.get().unwrap().try_complete());
        });
        let ha = p.try_complete_else_watch(a, ms(10), [1]).unwrap();
        a_ref.set(ha.op_ref().unwrap()).ok().unwrap();
        let c = p
            .try_complete_else_watch(Op::new(3, &t), ms(10), [1])
            .unwrap();
        assert!(matches!(ha.await, Ok(Completion::Expired(_))));
        assert!(matches!(hb.await, Ok(Completion::Completed(_))));
        let rc = c.await;
        let handed: Vec<usize> = back.lock().unwrap().drain(..).map(|x| x.id).collect();
        match rc {
            Ok(Completion::Expired(_)) => assert!(handed.is_empty()),
            Err(OperationError::Shutdown) => assert_eq!(handed, [3]),
            other => panic!("{other:?}"),
        }
        assert_eq!(
            *seen.lock().unwrap(),
            ["a reset=false status=Expired", "back 9"]
        );
        for i in [1, 2, 3, 9] {
            assert_eq!(t.drops(i), 1, "op {i}");
            assert!(t.expiries(i) <= 1, "op {i}");
        }
        let m = p.metrics();
        assert!(balanced(&m), "{m:?}");
        assert_eq!(m.delayed, 0);
        assert_eq!(m.panicked, 0, "{m:?}");
    });
}

/// Detached operations' unread expiry outputs are dropped on the reaper;
/// the first such drop drops the last clone of their purgatory while the
/// same turn still has operations of it due, on a reaper shared with a
/// second purgatory. Every handle resolves at once (`Expired` with its own
/// output, or `Shutdown`), every operation is dropped once and expires at
/// most once, and the second purgatory's later operation still expires on
/// time.
#[test]
fn an_unread_output_dropped_on_the_reaper_drops_the_last_clone_mid_batch() {
    paused_within(10, || async {
        let t = Arc::new(Tally::default());
        let reaper = Reaper::start().unwrap();
        let p: P = Purgatory::builder().reaper(&reaper).build().unwrap();
        let q: P = Purgatory::builder().reaper(&reaper).build().unwrap();
        let slot: Arc<Mutex<Option<P>>> = Arc::default();
        let mut hs = Vec::new();
        for i in 0..10 {
            let s2 = slot.clone();
            let op = Op::new(i, &t).on_expiry_output_drop(move || drop(s2.lock().unwrap().take()));
            let h = p.try_complete_else_watch(op, ms(10), [i as u32]).unwrap();
            if i % 2 == 0 {
                h.detach();
            } else {
                hs.push((i, h));
            }
        }
        let later = q
            .try_complete_else_watch(Op::new(100, &t), ms(30), [1])
            .unwrap();
        let weak = p.downgrade();
        *slot.lock().unwrap() = Some(p);
        let start = Instant::now();
        for (i, h) in hs {
            let r = tokio::time::timeout(ms(15), h).await.expect("resolves");
            match fate(r) {
                // (its own output's drop may be the one that closes)
                Ok(Completion::Expired(id)) => assert_eq!(id, i),
                Err(OperationError::Shutdown) => {}
                other => panic!("op {i}: {other:?}"),
            }
        }
        assert!(weak.upgrade().is_none(), "closed from the output drop");
        for i in 0..10 {
            assert_eq!(t.drops(i), 1, "op {i}");
            assert!(t.expiries(i) <= 1);
        }
        assert!(matches!(later.await, Ok(Completion::Expired(_))));
        let e = start.elapsed();
        assert!(e >= ms(30) && e <= ms(33), "{e:?}");
        quiet(&q);
    });
}

/// On a shared reaper, user code calls back in and then panics: an expiry
/// that registers a new operation (zero timeout), a timer task that shuts a
/// third purgatory down, an unread output whose drop cancels by key. The
/// reaper goes on: the panicking expiry's handle reads `Panicked`, the
/// cancelled and shut-down operations resolve at once, the new operation
/// expires on the next turn and a later one on time; every operation is
/// dropped once, and the panics are counted where they happened.
#[test]
fn reaper_code_that_calls_back_in_and_then_panics_stops_nothing() {
    paused_within(10, || async {
        let t = Arc::new(Tally::default());
        let reaper = Reaper::start().unwrap();
        let p: P = Purgatory::builder().reaper(&reaper).build().unwrap();
        let r: P = Purgatory::builder().reaper(&reaper).build().unwrap();
        let timer = Timer::builder().reaper(&reaper).build().unwrap();
        let made: Arc<Mutex<Vec<_>>> = Arc::default();
        let (w, m2, t2) = (p.downgrade(), made.clone(), t.clone());
        let a = Op::new(1, &t).on_expire(move || {
            let p = w.upgrade().unwrap();
            m2.lock().unwrap().push(
                p.try_complete_else_watch(Op::new(2, &t2), Duration::ZERO, [5])
                    .unwrap(),
            );
            panic!("after registering");
        });
        let ha = p.try_complete_else_watch(a, ms(10), [1]).unwrap();
        // A detached operation whose unread output cancels key 7 and panics.
        let w3 = p.downgrade();
        let b = Op::new(3, &t).on_expiry_output_drop(move || {
            let p = w3.upgrade().unwrap();
            drop(p.cancel_for_key(&7));
            panic!("output drop");
        });
        p.try_complete_else_watch(b, ms(10), [6]).unwrap().detach();
        let hc = p
            .try_complete_else_watch(Op::new(4, &t), Duration::from_secs(100), [7])
            .unwrap();
        // A third purgatory with work pending, shut down by a panicking task.
        let hr = r
            .try_complete_else_watch(Op::new(5, &t), Duration::from_secs(100), [1])
            .unwrap();
        let wr = r.downgrade();
        schedule(&timer, ms(10), move || {
            drop(wr.upgrade().unwrap().shutdown());
            panic!("task after shutdown");
        });
        let start = Instant::now();
        assert_eq!(ha.await, Err(OperationError::Panicked));
        assert_eq!(
            tokio::time::timeout(ms(5), hc).await.unwrap(),
            Err(OperationError::Cancelled)
        );
        assert_eq!(
            tokio::time::timeout(ms(5), hr).await.unwrap(),
            Err(OperationError::Shutdown)
        );
        let h2 = made.lock().unwrap().pop().unwrap();
        assert!(matches!(
            tokio::time::timeout(ms(2), h2).await.unwrap(),
            Ok(Completion::Expired(_))
        ));
        let late = p
            .try_complete_else_watch(Op::new(6, &t), ms(20), [1])
            .unwrap();
        assert!(late.await.is_ok());
        let e = start.elapsed();
        assert!(e >= ms(30) && e <= ms(34), "{e:?}");
        for i in 1..=6 {
            assert_eq!(t.drops(i), 1, "op {i}");
        }
        let m = p.metrics();
        assert!(balanced(&m), "{m:?}");
        assert_eq!(m.panicked, 2, "{m:?}");
        assert_eq!(timer.metrics().panicked, 1);
        assert!(balanced(&r.metrics()));
    });
}

/// On a shared reaper, a timer task drops the last clone of a purgatory
/// whose pending operations, as they are dropped, register on a second
/// purgatory (zero timeout), read its metrics and schedule on the timer
/// (zero delay). Their handles read `Shutdown` at once; the new operations
/// and tasks, all due at once, are served within a few milliseconds (not
/// left for an unrelated wake-up); every operation is dropped once and
/// expires at most once, and later work on the reaper still runs on time.
#[test]
fn a_timer_task_drops_the_last_purgatory_whose_drops_feed_the_neighbours() {
    paused_within(10, || async {
        let t = Arc::new(Tally::default());
        let reaper = Reaper::start().unwrap();
        let p1: P = Purgatory::builder().reaper(&reaper).build().unwrap();
        let p2: P = Purgatory::builder().reaper(&reaper).build().unwrap();
        let timer = Timer::builder().reaper(&reaper).build().unwrap();
        let ran = Arc::new(AtomicUsize::new(0));
        let p2_handles: Arc<Mutex<Vec<_>>> = Arc::default();
        let mut hs = Vec::new();
        for i in 0..5 {
            let (p2c, tc, r2, hs2, t2) = (
                p2.downgrade(),
                timer.downgrade(),
                ran.clone(),
                p2_handles.clone(),
                t.clone(),
            );
            let op = Op::new(i, &t).on_drop(move || {
                let p2 = p2c.upgrade().unwrap();
                let h = p2
                    .try_complete_else_watch(Op::new(100 + i, &t2), Duration::ZERO, [7])
                    .unwrap();
                hs2.lock().unwrap().push(h);
                let _ = p2.metrics();
                schedule(&tc.upgrade().unwrap(), Duration::ZERO, move || {
                    r2.fetch_add(1, Ordering::SeqCst);
                });
            });
            hs.push(
                p1.try_complete_else_watch(op, Duration::from_secs(100), [i as u32])
                    .unwrap(),
            );
        }
        let slot = Arc::new(Mutex::new(Some(p1)));
        let s2 = slot.clone();
        schedule(&timer, ms(5), move || drop(s2.lock().unwrap().take()));
        let start = Instant::now();
        for h in hs {
            assert_eq!(h.await, Err(OperationError::Shutdown));
        }
        assert!(start.elapsed() <= ms(7), "{:?}", start.elapsed());
        tokio::time::sleep(ms(5)).await;
        settle().await;
        assert_eq!(ran.load(Ordering::SeqCst), 5);
        let hs2: Vec<_> = std::mem::take(&mut *p2_handles.lock().unwrap());
        assert_eq!(hs2.len(), 5);
        for h in hs2 {
            assert!(h.is_finished());
            assert!(matches!(h.await, Ok(Completion::Expired(_))));
        }
        for i in 0..5 {
            assert_eq!(t.drops(i), 1);
            assert_eq!(t.expiries(100 + i), 1);
        }
        quiet(&p2);
        let late = p2
            .try_complete_else_watch(Op::new(200, &t), ms(50), [1])
            .unwrap();
        let s = Instant::now();
        assert!(late.await.is_ok());
        let e = s.elapsed();
        assert!(e >= ms(50) && e <= ms(53), "{e:?}");
    });
}

// ---------------------------------------------------------------------------
// Keys dropped by the purge, by a shutdown and by the last clone, calling
// back in.

/// An expiry leaves twenty tombstones beside one live entry: the purge
/// starts at once on the reaper, and the first key it drops drops the last
/// purgatory clone. The expiry's handle reads `Expired`, the pending
/// operation's `Shutdown` at once, the purgatory is gone, and each
/// operation is dropped once.
#[test]
fn a_key_dropped_by_the_expirys_purge_drops_the_last_clone() {
    paused_within(10, || async {
        let t = Arc::new(Tally::default());
        let slot: Arc<Mutex<Option<KP>>> = Arc::default();
        let fired = Arc::new(AtomicUsize::new(0));
        let (s2, f2) = (slot.clone(), fired.clone());
        let hook: KeyHook = Arc::new(move |_| {
            f2.fetch_add(1, Ordering::SeqCst);
            drop(s2.lock().unwrap().take());
        });
        let p: KP = Purgatory::new();
        let weak = p.downgrade();
        let keys: Vec<Key> = (0..20).map(|i| Key::hooked(i, &hook)).collect();
        let a = p
            .try_complete_else_watch(Op::new(1, &t), ms(10), keys)
            .unwrap();
        let b = p
            .try_complete_else_watch(Op::new(2, &t), ms(1000), [Key::plain(100)])
            .unwrap();
        *slot.lock().unwrap() = Some(p);
        let s = Instant::now();
        assert_eq!(fate(a.await), Ok(Completion::Expired(1)));
        let r = tokio::time::timeout(ms(5), b).await;
        assert!(
            fired.load(Ordering::SeqCst) > 0,
            "no key dropped by the purge"
        );
        assert_eq!(
            r,
            Ok(Err(OperationError::Shutdown)),
            "after {:?}",
            s.elapsed()
        );
        assert!(weak.upgrade().is_none());
        settle().await;
        assert_eq!(t.drops(1), 1);
        assert_eq!(t.drops(2), 1);
    });
}

/// The reaper's idle purge, in turns, of 3,000 keys whose map copies, as
/// they are dropped, read the metrics, register new operations on fresh
/// keys (the first five) and cancel by key (the next five): the new
/// operations expire on time, every handle reads `Expired` or `Cancelled`,
/// the map empties, the counts balance and every operation is dropped once.
#[test]
fn keys_dropped_by_the_idle_purge_register_and_cancel() {
    paused_within(20, || async {
        let t = Arc::new(Tally::default());
        let p: KP = Purgatory::new();
        let weak = p.downgrade();
        let made: Arc<Mutex<Vec<_>>> = Arc::default();
        let n_made = Arc::new(AtomicUsize::new(0));
        let armed = Arc::new(AtomicBool::new(false));
        let hook: KeyHook = {
            let (w, made, n_made, t, armed) = (
                weak.clone(),
                made.clone(),
                n_made.clone(),
                t.clone(),
                armed.clone(),
            );
            Arc::new(move |id| {
                if !armed.load(Ordering::SeqCst) {
                    return;
                }
                let Some(p) = w.upgrade() else { return };
                let _ = p.metrics();
                let k = n_made.fetch_add(1, Ordering::SeqCst);
                if k < 5 {
                    let h = p
                        .try_complete_else_watch(
                            Op::new(10_000 + k, &t),
                            ms(7),
                            [Key::plain(50_000 + k as u32)],
                        )
                        .map_err(|e| e.kind())
                        .unwrap();
                    made.lock().unwrap().push((10_000 + k, Instant::now(), h));
                } else if k < 10 {
                    drop(p.cancel_for_key(&Key::plain(id + 1)));
                }
            })
        };
        // 3,000 operations, one key each, all expiring at 10 ms.
        let mut hs = Vec::new();
        for i in 0..3000u32 {
            hs.push(
                p.try_complete_else_watch(Op::new(i as usize, &t), ms(10), [Key::hooked(i, &hook)])
                    .unwrap(),
            );
        }
        armed.store(true, Ordering::SeqCst);
        let mut expired = 0;
        let mut cancelled = 0;
        for h in hs {
            match h.await {
                Ok(Completion::Expired(_)) => expired += 1,
                Err(OperationError::Cancelled) => cancelled += 1,
                o => panic!("{o:?}"),
            }
        }
        assert_eq!(expired + cancelled, 3000);
        // Let the idle purge run its turns.
        for _ in 0..50 {
            settle().await;
            advance(ms(1)).await;
        }
        let made: Vec<_> = std::mem::take(&mut *made.lock().unwrap());
        assert_eq!(made.len(), 5, "the key drops registered");
        let log = t.expiry_log();
        for (id, at, h) in made {
            assert!(
                h.is_finished(),
                "a registration from a key drop never expired"
            );
            assert_eq!(h.await.map(|c| c.is_expired()), Ok(true));
            let fired = log.iter().find(|(i, _)| *i == id).unwrap().1;
            assert!(
                fired >= at + ms(7) && fired <= at + ms(9),
                "op {id} registered at {at:?} expired at {fired:?}"
            );
        }
        let m = p.metrics();
        assert!(balanced(&m), "{m:?}");
        assert_eq!(m.delayed, 0, "{m:?}");
        assert_eq!(m.keys, 0, "{m:?}");
        assert_eq!(m.watched, 0, "{m:?}");
        assert_eq!(t.dropped_total(), 3005);
        for i in 0..3000 {
            assert_eq!(t.drops(i), 1, "op {i}");
        }
    });
}

/// A key's map copy dropped by the purge at once after an expiry shuts the
/// purgatory down while operations are still pending beside it: they are
/// handed back to that key's code (a registration there is refused as
/// `Shutdown`), their handles read `Shutdown` at once, and the map
/// empties.
#[test]
fn a_key_dropped_by_the_purge_shuts_down() {
    paused_within(10, || async {
        let t = Arc::new(Tally::default());
        let p: KP = Purgatory::new();
        let weak = p.downgrade();
        let back: Arc<Mutex<Vec<usize>>> = Arc::default();
        let once = Arc::new(AtomicBool::new(false));
        let hook: KeyHook = {
            let (w, b, once, t) = (weak.clone(), back.clone(), once.clone(), t.clone());
            Arc::new(move |_| {
                if !once.swap(false, Ordering::SeqCst) {
                    return;
                }
                if let Some(p) = w.upgrade() {
                    let ops = p.shutdown();
                    b.lock().unwrap().extend(ops.iter().map(|o| o.id));
                    let r = p.try_complete_else_watch(Op::new(77, &t), ms(1), [Key::plain(1)]);
                    assert!(matches!(r, Err(WatchError::Shutdown(_))));
                }
            })
        };
        let keys: Vec<Key> = (0..20).map(|i| Key::hooked(i, &hook)).collect();
        let a = p
            .try_complete_else_watch(Op::new(1, &t), ms(10), keys)
            .unwrap();
        let others: Vec<_> = (0..3)
            .map(|i| {
                p.try_complete_else_watch(
                    Op::new(2 + i, &t),
                    ms(1000),
                    [Key::plain(100 + i as u32)],
                )
                .unwrap()
            })
            .collect();
        once.store(true, Ordering::SeqCst);
        assert_eq!(fate(a.await), Ok(Completion::Expired(1)));
        for h in others {
            let r = tokio::time::timeout(ms(5), h).await;
            assert_eq!(r, Ok(Err(OperationError::Shutdown)));
        }
        let mut back = back.lock().unwrap().clone();
        back.sort();
        assert_eq!(back, [2, 3, 4]);
        assert_eq!(t.drops(77), 1, "the refused registration's operation");
        let m = p.metrics();
        assert!(balanced(&m), "{m:?}");
        assert_eq!(m.delayed, 0);
        assert_eq!(m.keys, 0, "{m:?}");
    });
}

/// Keys dropped by `shutdown()` call back in: a second shutdown hands back
/// nothing, a registration is refused as `Shutdown`, and a drain polled
/// there is ready (everything was handed back before the keys go); every
/// handle reads `Shutdown`. Keys dropped by the last clone's drop find the
/// weak handle dead, and the pending operation's handle reads `Shutdown`.
#[test]
fn keys_dropped_by_a_shutdown_and_by_the_last_clone_call_back_in() {
    paused_within(10, || async {
        let t = Arc::new(Tally::default());
        let p: &'static KP = leaked(Purgatory::new());
        let armed = Arc::new(AtomicBool::new(false));
        let saw: Arc<Mutex<Vec<String>>> = Arc::default();
        let hook: KeyHook = {
            let (armed, saw, t) = (armed.clone(), saw.clone(), t.clone());
            Arc::new(move |id| {
                if !armed.load(Ordering::SeqCst) {
                    return;
                }
                let again = p.shutdown().len();
                let r = p.try_complete_else_watch(
                    Op::new(1000 + id as usize, &t),
                    ms(5),
                    [Key::plain(1)],
                );
                let refused = matches!(r, Err(WatchError::Shutdown(_)));
                let mut d = Box::pin(p.drain());
                let ready = poll_ready(d.as_mut(), &Wakes::counting());
                saw.lock()
                    .unwrap()
                    .push(format!("{again} {refused} {ready}"));
            })
        };
        let mut hs = Vec::new();
        for i in 0..5u32 {
            hs.push(
                p.try_complete_else_watch(
                    Op::new(i as usize, &t),
                    ms(100),
                    [Key::hooked(i, &hook)],
                )
                .unwrap(),
            );
        }
        armed.store(true, Ordering::SeqCst);
        let back = p.shutdown();
        assert_eq!(back.len(), 5);
        drop(back);
        for h in hs {
            assert_eq!(h.await, Err(OperationError::Shutdown));
        }
        let saw = saw.lock().unwrap().clone();
        assert_eq!(saw.len(), 5, "{saw:?}");
        assert!(saw.iter().all(|s| s == "0 true true"), "{saw:?}");
        assert!(balanced(&p.metrics()), "{:?}", p.metrics());

        // The last clone's drop.
        let q: KP = Purgatory::new();
        let weak = q.downgrade();
        let dead = Arc::new(AtomicUsize::new(0));
        let (d2, w2) = (dead.clone(), weak.clone());
        let hook2: KeyHook = Arc::new(move |_| {
            if w2.upgrade().is_none() {
                d2.fetch_add(1, Ordering::SeqCst);
            }
        });
        let h = q
            .try_complete_else_watch(Op::new(7, &t), ms(100), [Key::hooked(1, &hook2)])
            .unwrap();
        drop(q);
        assert_eq!(h.await, Err(OperationError::Shutdown));
        assert!(dead.load(Ordering::SeqCst) >= 1);
        assert_eq!(t.drops(7), 1);
    });
}

// ---------------------------------------------------------------------------
// A check the reaper left an expiry to: the check is held on another thread
// while the deadline passes, so the reaper leaves the expiry to it, and then
// calls back in.

/// One operation (id 1, watching key 1, due in 10 ms) whose first check
/// after registration is held at `entered` until `release`, then runs
/// `body`, given the operation's own reference and the tally.
struct Held {
    p: Option<P>,
    h: OperationHandle<u32, Op>,
    me: Ref,
    entered: Arc<Barrier>,
    release: Arc<Barrier>,
    t: Arc<Tally>,
}

fn held(
    mut body: impl FnMut(&OpRef<u32, Op>, &Arc<Tally>) -> Option<Out> + Send + 'static,
) -> Held {
    let t = Arc::new(Tally::default());
    let p: P = Purgatory::new();
    let entered = Arc::new(Barrier::new(2));
    let release = Arc::new(Barrier::new(2));
    let armed = Arc::new(AtomicBool::new(false));
    let me: Ref = Arc::default();
    let (e2, r2, a2, m2, t2) = (
        entered.clone(),
        release.clone(),
        armed.clone(),
        me.clone(),
        t.clone(),
    );
    let op = Op::new(1, &t).check(move |_| {
        if !a2.swap(false, Ordering::SeqCst) {
            return None;
        }
        e2.wait();
        r2.wait();
        body(m2.get().unwrap(), &t2)
    });
    let h = p.try_complete_else_watch(op, ms(10), [1]).unwrap();
    me.set(h.op_ref().unwrap()).ok().unwrap();
    armed.store(true, Ordering::SeqCst);
    Held {
        p: Some(p),
        h,
        me,
        entered,
        release,
        t,
    }
}

impl Held {
    /// Runs the held check on another thread, lets the deadline pass so the
    /// reaper leaves the expiry to it, then releases it: what the check
    /// call returned.
    async fn run(&self) -> bool {
        let r = self.me.get().unwrap().clone();
        let checker = std::thread::spawn(move || r.try_complete());
        self.entered.wait();
        advance(ms(15)).await;
        settle().await;
        if let Some(p) = &self.p {
            assert_eq!(p.metrics().expired, 0, "left to the check");
        }
        self.release.wait();
        checker.join().unwrap()
    }
}

/// A check the expiry was left to moves its own timeout later: the reset
/// says `false` (its expiry is under way), as does `update`, the status
/// still reads `Pending`; the operation then expires once, at once, not at
/// the new deadline, with one lateness sample.
#[test]
fn a_reset_from_a_check_holding_a_left_expiry_says_false() {
    paused_within(10, || async {
        let saw: Arc<Mutex<Vec<String>>> = Arc::default();
        let s2 = saw.clone();
        let s = held(move |me, _| {
            let r = me.reset(Duration::from_secs(10));
            let u = me.update(|_| ()).is_some();
            s2.lock()
                .unwrap()
                .push(format!("reset={r} update={u} status={:?}", me.status()));
            None
        });
        assert!(!s.run().await);
        let saw = saw.lock().unwrap().clone();
        let p = s.p.as_ref().unwrap();
        let out = tokio::time::timeout(ms(1), s.h).await.expect("resolved");
        assert_eq!(fate(out), Ok(Completion::Expired(1)), "saw {saw:?}");
        assert_eq!(saw, ["reset=false update=false status=Pending"]);
        assert_eq!(s.t.expiries(1), 1);
        assert_eq!(s.t.drops(1), 1);
        let m = p.metrics();
        assert!(balanced(&m), "{m:?}");
        assert_eq!(p.lateness().count(), 1);
        // Nothing fires later either.
        advance(Duration::from_secs(20)).await;
        settle().await;
        assert_eq!(s.t.expiries(1), 1);
        assert_eq!(p.metrics().expired, 1);
    });
}

/// A check the expiry was left to cancels its own operation and says "not
/// yet": `OpRef::cancel` answers `None` (the cancel is left to the check),
/// and the cancel wins over the expiry left before it, as its docs say: the
/// operation ends `Cancelled`, is never expired, has no lateness sample, and
/// is dropped once.
#[test]
fn a_cancel_left_to_a_check_holding_a_left_expiry_wins() {
    paused_within(10, || async {
        let said: Arc<Mutex<Option<bool>>> = Arc::default();
        let s2 = said.clone();
        let s = held(move |me, _| {
            *s2.lock().unwrap() = Some(me.cancel().is_some());
            None
        });
        assert!(!s.run().await);
        assert_eq!(*said.lock().unwrap(), Some(false), "left to the check");
        let p = s.p.as_ref().unwrap();
        let r = tokio::time::timeout(ms(1), s.h).await.expect("resolved");
        assert_eq!(fate(r), Err(OperationError::Cancelled));
        advance(Duration::from_secs(20)).await;
        settle().await;
        assert_eq!(s.t.expiries(1), 0);
        assert_eq!(s.t.drops(1), 1);
        let m = p.metrics();
        assert!(balanced(&m), "{m:?}");
        assert_eq!((m.cancelled, m.expired), (1, 0));
        assert_eq!(p.lateness().count(), 0);
    });
}

/// A check the expiry was left to resets its timeout and then completes:
/// the operation is completed, once, with no lateness sample, and nothing
/// expires later at the reset's deadline.
#[test]
fn a_check_holding_a_left_expiry_resets_then_completes() {
    paused_within(10, || async {
        let s = held(move |me, t| {
            let _ = me.reset(Duration::from_secs(10));
            Some(out(1, t))
        });
        assert!(s.run().await);
        let p = s.p.as_ref().unwrap();
        let r = tokio::time::timeout(ms(1), s.h).await.unwrap();
        assert_eq!(fate(r), Ok(Completion::Completed(1)));
        advance(Duration::from_secs(20)).await;
        settle().await;
        assert_eq!(s.t.expiries(1), 0);
        let m = p.metrics();
        assert!(balanced(&m), "{m:?}");
        assert_eq!((m.completed, m.expired), (1, 0));
        assert_eq!(p.lateness().count(), 0);
        assert_eq!(m.delayed, 0);
    });
}

/// A check the expiry was left to shuts its purgatory down and then says
/// "not yet": the shutdown hands back nothing (the operation is being
/// checked), and the operation has one outcome (`Expired` or `Shutdown`),
/// counted once, expired at most once, dropped once, with a lateness sample
/// only if it expired.
#[test]
fn a_check_holding_a_left_expiry_shuts_down() {
    paused_within(10, || async {
        let slot: Arc<OnceLock<WeakPurgatory<u32, Op>>> = Arc::default();
        let back = Arc::new(AtomicUsize::new(0));
        let (sl, b2) = (slot.clone(), back.clone());
        let s = held(move |_, _| {
            let p = sl.get().unwrap().upgrade().unwrap();
            b2.fetch_add(p.shutdown().len(), Ordering::SeqCst);
            None
        });
        slot.set(s.p.as_ref().unwrap().downgrade()).ok().unwrap();
        assert!(!s.run().await);
        let out = fate(tokio::time::timeout(ms(1), s.h).await.unwrap());
        assert!(
            matches!(
                out,
                Ok(Completion::Expired(1)) | Err(OperationError::Shutdown)
            ),
            "{out:?}"
        );
        let p = s.p.as_ref().unwrap();
        let m = p.metrics();
        assert!(balanced(&m), "{m:?}");
        assert_eq!(back.load(Ordering::SeqCst), 0);
        assert_eq!(s.t.drops(1), 1);
        assert_eq!(s.t.expiries(1), usize::from(out.is_ok()));
        assert_eq!(p.lateness().count(), m.expired);
    });
}

/// A check the expiry was left to drops the last purgatory clone: the
/// purgatory is gone once the check returns, the handle resolves once
/// (`Expired` or `Shutdown`), and the operation is dropped once.
#[test]
fn a_check_holding_a_left_expiry_drops_the_last_clone() {
    paused_within(10, || async {
        let slot: Arc<Mutex<Option<P>>> = Arc::default();
        let s2 = slot.clone();
        let mut s = held(move |_, _| {
            drop(s2.lock().unwrap().take());
            None
        });
        let weak = s.p.as_ref().unwrap().downgrade();
        *slot.lock().unwrap() = s.p.take();
        assert!(!s.run().await);
        assert!(weak.upgrade().is_none());
        let out = fate(tokio::time::timeout(ms(1), s.h).await.unwrap());
        assert!(
            matches!(
                out,
                Ok(Completion::Expired(1)) | Err(OperationError::Shutdown)
            ),
            "{out:?}"
        );
        assert_eq!(s.t.drops(1), 1);
    });
}

/// A check the expiry was left to polls a drain once (pending: the
/// operation itself) and keeps it: the expiry that follows its "not yet"
/// wakes the drain, which is then ready.
#[test]
fn a_drain_polled_by_a_check_holding_a_left_expiry_is_woken() {
    paused_within(10, || async {
        let kept: KeptSlot = Arc::default();
        let woke = Wakes::counting();
        let pslot: Arc<OnceLock<&'static P>> = Arc::default();
        let pending = Arc::new(Mutex::new(None));
        let (k2, w2, ps, pd) = (kept.clone(), woke.clone(), pslot.clone(), pending.clone());
        let mut s = held(move |_, _| {
            let p = *ps.get().unwrap();
            let mut d: Kept = Box::pin(p.drain());
            *pd.lock().unwrap() = Some(!poll_ready(d.as_mut(), &w2));
            *k2.lock().unwrap() = Some(d);
            None
        });
        let p: &'static P = leaked(s.p.take().unwrap());
        pslot.set(p).ok().unwrap();
        s.p = Some(p.clone());
        assert!(!s.run().await);
        assert_eq!(*pending.lock().unwrap(), Some(true), "the drain waited");
        let out = tokio::time::timeout(ms(1), s.h).await.unwrap();
        assert_eq!(fate(out), Ok(Completion::Expired(1)));
        assert!(woke.count() >= 1, "drain never woken");
        let mut d = kept.lock().unwrap().take().unwrap();
        assert!(poll_ready(d.as_mut(), &woke));
        drop(p.shutdown());
    });
}

/// A check the expiry was left to runs another operation's check through
/// its `OpRef`, and that nested check resets and cancels the outer one:
/// both say `false`/`None` (the outer's expiry is under way); the outer
/// still ends once (`Expired` or `Cancelled`, expired at most once), the
/// inner completes, the counts balance.
#[test]
fn a_nested_check_touches_an_operation_holding_a_left_expiry() {
    paused_within(10, || async {
        let inner_ref: Ref = Arc::default();
        let outer_ref: Ref = Arc::default();
        let saw: Arc<Mutex<Vec<String>>> = Arc::default();
        let i2 = inner_ref.clone();
        let s = held(move |_, _| {
            i2.get().unwrap().try_complete();
            None
        });
        let p = s.p.as_ref().unwrap();
        let (or2, s2, t2) = (outer_ref.clone(), saw.clone(), s.t.clone());
        let armed = Arc::new(AtomicBool::new(false));
        let a2 = armed.clone();
        let inner = Op::new(2, &s.t).check(move |_| {
            if !a2.load(Ordering::SeqCst) {
                return None;
            }
            let a = or2.get().unwrap();
            let r = a.reset(Duration::from_secs(10));
            let c = a.cancel().is_some();
            s2.lock().unwrap().push(format!("reset={r} cancel={c}"));
            Some(out(2, &t2))
        });
        let hi = watched(p, inner, 2, &inner_ref);
        armed.store(true, Ordering::SeqCst);
        outer_ref.set(s.me.get().unwrap().clone()).ok().unwrap();
        assert!(!s.run().await);
        let out = fate(tokio::time::timeout(ms(1), s.h).await.unwrap());
        let saw = saw.lock().unwrap().clone();
        assert!(
            matches!(
                out,
                Ok(Completion::Expired(1)) | Err(OperationError::Cancelled)
            ),
            "{out:?} {saw:?}"
        );
        assert_eq!(saw, ["reset=false cancel=false"], "out {out:?}");
        assert_eq!(fate(hi.await), Ok(Completion::Completed(2)));
        assert_eq!(s.t.drops(1), 1);
        let m = p.metrics();
        assert!(balanced(&m), "{m:?}");
        assert_eq!(m.delayed, 0);
        advance(Duration::from_secs(20)).await;
        settle().await;
        assert_eq!(s.t.expiries(1), usize::from(out.is_ok()));
    });
}

// ---------------------------------------------------------------------------
// The timer beside purgatories.

/// Twenty tasks due together on a timer with its own reaper; the first to
/// run drops the last `Timer` clone. Some task runs; each runs at most once
/// and is dropped once (run or not); every handle then reads `Done`, and
/// `cancel` and `reset` on it say `false`.
#[test]
fn a_task_drops_the_last_timer_clone_mid_batch() {
    paused_within(10, || async {
        let t = Arc::new(Tally::default());
        let timer = Timer::new();
        let slot: Arc<Mutex<Option<Timer>>> = Arc::default();
        let ran: Arc<Mutex<Vec<usize>>> = Arc::default();
        let mut hs = Vec::new();
        for i in 0..20 {
            let token = Token {
                id: i,
                tally: t.clone(),
            };
            let (s2, r2) = (slot.clone(), ran.clone());
            hs.push(schedule(&timer, ms(10), move || {
                let _token = &token;
                r2.lock().unwrap().push(i);
                drop(s2.lock().unwrap().take());
            }));
        }
        *slot.lock().unwrap() = Some(timer);
        advance(ms(11)).await;
        settle().await;
        let ran = ran.lock().unwrap().clone();
        assert!(!ran.is_empty());
        for (i, h) in hs.iter().enumerate() {
            assert!(ran.iter().filter(|&&x| x == i).count() <= 1);
            assert_eq!(t.drops(i), 1, "task {i} dropped");
            assert_eq!(h.status(), TaskStatus::Done, "task {i}");
            assert!(!h.cancel());
            assert!(!h.reset(ms(5)));
        }
    });
}

/// A repeating task's third run checks an operation through its `OpRef`;
/// that check tries to move the repeating task (`false`: it is running)
/// and cancels it (`true`): the run under way finishes, none follows, the
/// task reads `Cancelled`, the operation completes and the timer has
/// nothing pending.
#[test]
fn a_repeating_run_is_stopped_from_a_nested_check() {
    paused_within(10, || async {
        let t = Arc::new(Tally::default());
        let reaper = Reaper::start().unwrap();
        let timer = Timer::builder().reaper(&reaper).build().unwrap();
        let p: P = Purgatory::builder().reaper(&reaper).build().unwrap();
        let task: Arc<OnceLock<TaskHandle>> = Arc::default();
        let armed = Arc::new(AtomicBool::new(false));
        let saw: Arc<Mutex<Vec<(bool, bool)>>> = Arc::default();
        let (task2, a2, s2, t2) = (task.clone(), armed.clone(), saw.clone(), t.clone());
        let h = p
            .try_complete_else_watch(
                Op::new(1, &t).check(move |_| {
                    if !a2.load(Ordering::SeqCst) {
                        return None;
                    }
                    let th = task2.get().unwrap();
                    let r = th.reset(ms(1));
                    let c = th.cancel();
                    s2.lock().unwrap().push((r, c));
                    Some(out(1, &t2))
                }),
                Duration::from_secs(100),
                [1],
            )
            .unwrap();
        let op: OpRef<u32, Op> = h.op_ref().unwrap();
        let runs = Arc::new(AtomicUsize::new(0));
        let (r2, a3) = (runs.clone(), armed.clone());
        let th = timer
            .schedule_repeating(ms(5), move || {
                if r2.fetch_add(1, Ordering::SeqCst) == 2 {
                    a3.store(true, Ordering::SeqCst);
                    op.try_complete();
                }
                Some(ms(5))
            })
            .map_err(|e| e.kind())
            .unwrap();
        task.set(th).ok().unwrap();
        tokio::time::sleep(ms(100)).await;
        settle().await;
        assert_eq!(runs.load(Ordering::SeqCst), 3, "no run after the cancel");
        assert_eq!(
            *saw.lock().unwrap(),
            [(false, true)],
            "reset of a running task says false; the cancel stopped the chain"
        );
        assert_eq!(task.get().unwrap().status(), TaskStatus::Cancelled);
        assert_eq!(fate(h.await), Ok(Completion::Completed(1)));
        assert_eq!(timer.metrics().pending, 0);
    });
}

/// An async task already awaiting an operation's handle is cancelled
/// (aborted) from reaper code in a later turn: from a purgatory's expiry,
/// and from a timer task due with that expiry on the shared reaper. The
/// cancel says `true`, the task goes no further and reads finished, its
/// dropped handle cancels the operation (dropped once), and the counts
/// balance.
#[test]
fn reaper_code_aborts_an_async_task_awaiting_a_handle() {
    for from_expiry in [true, false] {
        paused_within(10, move || async move {
            let t = Arc::new(Tally::default());
            let reaper = Reaper::start().unwrap();
            let timer = Timer::builder().reaper(&reaper).build().unwrap();
            let p: P = Purgatory::builder().reaper(&reaper).build().unwrap();
            let waited = p
                .try_complete_else_watch(Op::new(1, &t), Duration::from_secs(100), [1])
                .unwrap();
            let wref = waited.op_ref().unwrap();
            let after = Arc::new(AtomicBool::new(false));
            let af = after.clone();
            let at: Arc<AsyncTaskHandle> = Arc::new(
                timer
                    .schedule_async(ms(1), async move {
                        let _ = waited.await;
                        af.store(true, Ordering::SeqCst);
                    })
                    .map_err(|e| e.kind())
                    .unwrap(),
            );
            advance(ms(2)).await;
            settle().await;
            assert!(!at.is_pending(), "started");
            let cancelled = Arc::new(Mutex::new(None));
            let (at2, c2) = (at.clone(), cancelled.clone());
            let abort = move || *c2.lock().unwrap() = Some(at2.cancel());
            let killer = if from_expiry {
                Op::new(2, &t).on_expire(abort)
            } else {
                schedule(&timer, ms(5), abort);
                Op::new(2, &t)
            };
            let hk = p.try_complete_else_watch(killer, ms(5), [2]).unwrap();
            assert!(hk.await.is_ok());
            settle().await;
            assert_eq!(*cancelled.lock().unwrap(), Some(true), "{from_expiry}");
            assert!(at.is_finished());
            assert!(!after.load(Ordering::SeqCst));
            assert_eq!(wref.status(), OperationStatus::Cancelled);
            assert_eq!(t.drops(1), 1);
            let m = p.metrics();
            assert!(balanced(&m), "{m:?}");
            assert_eq!(m.delayed, 0);
        });
    }
}

/// An async task that cancels itself from inside: the cancel says `true`,
/// it then reads not pending and a reset says `false`; the task goes no
/// further than its next await, reads finished, and leaves nothing pending.
#[test]
fn an_async_task_cancels_itself() {
    paused_within(10, || async {
        let timer = Timer::new();
        let me: Arc<OnceLock<AsyncTaskHandle>> = Arc::default();
        let got = Arc::new(Mutex::new(None));
        let after = Arc::new(AtomicBool::new(false));
        let (m2, g2, a2) = (me.clone(), got.clone(), after.clone());
        let wt = timer.downgrade();
        let h = timer
            .schedule_async(ms(1), async move {
                let h = m2.get().unwrap();
                *g2.lock().unwrap() = Some((h.cancel(), h.is_pending(), h.reset(ms(1))));
                if let Some(t) = wt.upgrade() {
                    let _ = t.sleep(ms(1)).await;
                }
                a2.store(true, Ordering::SeqCst);
            })
            .map_err(|e| e.kind())
            .unwrap();
        me.set(h).ok().unwrap();
        advance(ms(5)).await;
        settle().await;
        assert_eq!(*got.lock().unwrap(), Some((true, false, false)));
        assert!(!after.load(Ordering::SeqCst));
        assert!(me.get().unwrap().is_finished());
        assert_eq!(timer.metrics().pending, 0);
    });
}

/// On a shared reaper, woken in the reaper's turn: a sleep whose waker
/// drops that sleep, and a timeout over an operation's handle whose waker
/// drops the timeout (and with it the handle, cancelling the operation,
/// whose drop registers a new one). No deadlock; both wakers ran; the
/// operation is cancelled and dropped once; the new registration expires on
/// time; nothing is left pending.
#[test]
fn wakers_that_drop_their_own_sleep_and_timeout_on_the_reaper() {
    type Slot<T> = Arc<Mutex<Option<Pin<Box<T>>>>>;
    paused_within(10, || async {
        let t = Arc::new(Tally::default());
        let reaper = Reaper::start().unwrap();
        let timer = Timer::builder().reaper(&reaper).build().unwrap();
        let p: P = Purgatory::builder().reaper(&reaper).build().unwrap();
        // The sleep, and its waker dropping it.
        let sleep_slot: Slot<tokio_purgatory::Sleep> =
            Arc::new(Mutex::new(Some(Box::pin(timer.sleep(ms(5))))));
        let s2 = sleep_slot.clone();
        let sleep_waker = Wakes::hooked(move || drop(s2.lock().unwrap().take()));
        {
            let mut g = sleep_slot.lock().unwrap();
            assert!(!poll_ready(g.as_mut().unwrap().as_mut(), &sleep_waker));
        }
        // The timeout over a handle, and its waker dropping it.
        let again: Arc<Mutex<Option<OperationHandle<u32, Op>>>> = Arc::default();
        let (w, a2, t2) = (p.downgrade(), again.clone(), t.clone());
        let op = Op::new(1, &t).on_drop(move || {
            if let Some(p) = w.upgrade() {
                let h = p
                    .try_complete_else_watch(Op::new(2, &t2), ms(10), [3])
                    .map_err(|e| e.kind())
                    .unwrap();
                *a2.lock().unwrap() = Some(h);
            }
        });
        let h = p
            .try_complete_else_watch(op, Duration::from_secs(100), [1])
            .unwrap();
        let href = h.op_ref().unwrap();
        let tslot: Slot<tokio_purgatory::TimeoutFuture<OperationHandle<u32, Op>>> =
            Arc::new(Mutex::new(Some(Box::pin(timer.timeout(ms(5), h)))));
        let ts2 = tslot.clone();
        let timeout_waker = Wakes::hooked(move || drop(ts2.lock().unwrap().take()));
        {
            let mut g = tslot.lock().unwrap();
            assert!(!poll_ready(g.as_mut().unwrap().as_mut(), &timeout_waker));
        }
        let start = Instant::now();
        advance(ms(6)).await;
        settle().await;
        let woken = sleep_waker.count() + timeout_waker.count();
        assert!(woken >= 2, "woken {woken}");
        assert!(sleep_slot.lock().unwrap().is_none());
        assert!(tslot.lock().unwrap().is_none());
        assert_eq!(href.status(), OperationStatus::Cancelled);
        assert_eq!(t.drops(1), 1);
        let h2 = again
            .lock()
            .unwrap()
            .take()
            .expect("registered from the drop");
        assert_eq!(fate(h2.await), Ok(Completion::Expired(2)));
        let e = start.elapsed();
        assert!(e >= ms(15) && e <= ms(18), "{e:?}");
        let m = p.metrics();
        assert!(balanced(&m), "{m:?}");
        assert_eq!(timer.metrics().pending, 0);
    });
}

/// A purgatory's expiry shuts down the timer sharing its reaper while that
/// timer has ten tasks due in the same turn, whichever of the two was built
/// first: each task runs in the turn or is handed back (and runs when the
/// caller runs it), never both and never lost; each is dropped once and its
/// handle reads `Done`.
#[test]
fn an_expiry_shuts_down_a_neighbour_timer_with_tasks_due_in_the_same_turn() {
    for timer_first in [true, false] {
        paused_within(10, move || async move {
            let t = Arc::new(Tally::default());
            let reaper = Reaper::start().unwrap();
            let build_timer = || Timer::builder().reaper(&reaper).build().unwrap();
            let build_p = || -> P { Purgatory::builder().reaper(&reaper).build().unwrap() };
            let (timer, p) = if timer_first {
                let timer = build_timer();
                (timer, build_p())
            } else {
                let p = build_p();
                (build_timer(), p)
            };
            let runs: Arc<Mutex<Vec<usize>>> = Arc::default();
            let mut hs = Vec::new();
            for i in 0..10 {
                let token = Token {
                    id: i,
                    tally: t.clone(),
                };
                let r = runs.clone();
                hs.push(schedule(&timer, ms(10), move || {
                    let _token = &token;
                    r.lock().unwrap().push(i);
                }));
            }
            let back: Arc<Mutex<Vec<UnrunTask>>> = Arc::default();
            let (wt, b2) = (timer.downgrade(), back.clone());
            let shuts_down = Op::new(100, &t).on_expire(move || {
                if let Some(timer) = wt.upgrade() {
                    b2.lock().unwrap().extend(timer.shutdown());
                }
            });
            let h = p.try_complete_else_watch(shuts_down, ms(10), [1]).unwrap();
            assert_eq!(fate(h.await), Ok(Completion::Expired(100)));
            settle().await;
            let in_turn = runs.lock().unwrap().len();
            let unrun: Vec<_> = std::mem::take(&mut *back.lock().unwrap());
            let n_back = unrun.len();
            for task in unrun {
                task.run();
            }
            let after = runs.lock().unwrap().clone();
            for (i, h) in hs.iter().enumerate() {
                assert_eq!(
                    after.iter().filter(|&&x| x == i).count(),
                    1,
                    "task {i} ran once (timer first: {timer_first})"
                );
                assert_eq!(t.drops(i), 1);
                assert_eq!(h.status(), TaskStatus::Done);
            }
            assert_eq!(in_turn + n_back, 10, "timer first: {timer_first}");
        });
    }
}

// ---------------------------------------------------------------------------
// Real threads.

/// Waits (real time) until `done` holds, failing after 3 s.
async fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    let start = std::time::Instant::now();
    while !done() {
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "{what}: not within 3 s"
        );
        tokio::time::sleep(ms(1)).await;
    }
}

/// Three threads register 600 operations (two keys each) and walk keys on a
/// multi-thread runtime while the operations' own code polls drains from
/// checks and keeps them, walks neighbouring keys from checks, and shuts
/// the purgatory down from expiries. Every handle resolves, every kept
/// drain ends, every operation (accepted or refused) is dropped once, no
/// check overlaps, and the counts balance.
#[test]
fn drains_from_checks_and_shutdowns_from_expiries_across_threads() {
    const N: usize = 600;
    for round in 0..5u64 {
        within(30, move || {
            support::multi().block_on(async move {
                let t = Arc::new(Tally::default());
                let p: &'static P = leaked(Purgatory::new());
                let kept: Arc<Mutex<Vec<Kept>>> = Arc::default();
                let woke = Wakes::counting();
                let ready = Arc::new(AtomicBool::new(false));
                let handles: Arc<Mutex<Vec<_>>> = Arc::default();
                let barrier = Arc::new(Barrier::new(3));
                let op = {
                    let (t, kept, woke, ready) =
                        (t.clone(), kept.clone(), woke.clone(), ready.clone());
                    move |id: usize| {
                        let (t2, kept, woke, ready) =
                            (t.clone(), kept.clone(), woke.clone(), ready.clone());
                        let (w, w2) = (p.downgrade(), p.downgrade());
                        Op::new(id, &t)
                            .check(move |_| {
                                if id % 7 == 3 && id > 450 {
                                    let mut d: Kept = Box::pin(p.drain());
                                    if !poll_ready(d.as_mut(), &woke) {
                                        kept.lock().unwrap().push(d);
                                    }
                                }
                                if id % 11 == 5 {
                                    if let Some(p) = w.upgrade() {
                                        p.try_complete_watched(&((id as u32 + 1) % 4));
                                    }
                                }
                                ready.load(Ordering::SeqCst).then(|| out(id, &t2))
                            })
                            .on_expire(move || {
                                if id.is_multiple_of(13) && id > 300 {
                                    if let Some(p) = w2.upgrade() {
                                        drop(p.shutdown());
                                    }
                                }
                            })
                    }
                };
                let mut threads = Vec::new();
                for th in 0..3usize {
                    let (op, ready, handles, barrier) =
                        (op.clone(), ready.clone(), handles.clone(), barrier.clone());
                    let rt = tokio::runtime::Handle::current();
                    threads.push(std::thread::spawn(move || {
                        let _g = rt.enter();
                        barrier.wait();
                        for i in (th..N).step_by(3) {
                            let to = ms(1 + (i as u64 * 7 + round) % 40);
                            match p.try_complete_else_watch(op(i), to, [(i as u32) % 4, 9]) {
                                Ok(h) => handles.lock().unwrap().push(h),
                                Err(e) => drop(e.into_inner()),
                            }
                            if i % 50 == 0 {
                                ready.store(true, Ordering::SeqCst);
                                p.try_complete_watched(&9);
                                ready.store(false, Ordering::SeqCst);
                            }
                            if i % 5 == 0 {
                                p.try_complete_watched(&((i as u32) % 4));
                            }
                        }
                    }));
                }
                for th in threads {
                    th.join().unwrap();
                }
                let hs: Vec<_> = std::mem::take(&mut *handles.lock().unwrap());
                for h in hs {
                    let _ = tokio::time::timeout(Duration::from_secs(3), h)
                        .await
                        .unwrap_or_else(|_| panic!("round {round}: a handle never resolved"));
                }
                // Every kept drain ends now.
                let ds: Vec<_> = std::mem::take(&mut *kept.lock().unwrap());
                for d in ds {
                    tokio::time::timeout(Duration::from_secs(3), d)
                        .await
                        .unwrap_or_else(|_| panic!("round {round}: a drain never ended"));
                }
                drop(p.shutdown());
                eventually("every operation dropped", || t.dropped_total() >= N).await;
                for i in 0..N {
                    assert_eq!(t.drops(i), 1, "round {round}: op {i}");
                }
                assert_eq!(t.overlaps(), 0, "round {round}");
                let m = p.metrics();
                assert!(balanced(&m), "round {round}: {m:?}");
                assert_eq!(m.delayed, 0, "round {round}: {m:?}");
            });
        });
    }
}

// The seeded stress: operations whose code calls the public API at random.

const STRESS_KEYS: u32 = 6;
const STRESS_MAX_OPS: usize = 3000;

/// What the stress's operations share: the purgatory and timer (weakly),
/// references and handles to pick from, and what each operation did.
struct World {
    p: WeakPurgatory<u32, Op>,
    timer: WeakTimer,
    tally: Arc<Tally>,
    refs: Mutex<Vec<OpRef<u32, Op>>>,
    handles: Mutex<Vec<(usize, OperationHandle<u32, Op>)>>,
    next_id: AtomicUsize,
    seed: AtomicU64,
    /// 1 once completed by a check, 2 once expired.
    fates: Vec<AtomicUsize>,
    ready: Vec<AtomicBool>,
    /// Registrations user code may still make.
    budget: AtomicUsize,
    /// The latest deadline under 5 s set by a registration or a reset, in
    /// nanoseconds from `origin` (real time).
    origin: std::time::Instant,
    short_due: AtomicU64,
}

impl World {
    fn rng(&self) -> Rng {
        Rng(self.seed.fetch_add(0x9E37_79B9, Ordering::Relaxed))
    }

    /// Notes a short deadline `d` from now.
    fn short(&self, d: Duration) {
        let due = (self.origin.elapsed() + d).as_nanos() as u64;
        self.short_due.fetch_max(due, Ordering::SeqCst);
    }

    /// One random call on the public API, from user code `depth` deep.
    fn act(self: &Arc<Self>, depth: u32) {
        if depth > 2 {
            return;
        }
        let mut r = self.rng();
        let Some(p) = self.p.upgrade() else { return };
        let n = self.refs.lock().unwrap().len();
        let pick = r.next();
        let other = || -> Option<OpRef<u32, Op>> {
            (n > 0).then(|| self.refs.lock().unwrap()[(pick % n as u64) as usize].clone())
        };
        match r.below(24) {
            0 => {
                if let Some(o) = other() {
                    o.try_complete();
                }
            }
            1 => {
                if let Some(o) = other() {
                    let d = ms(r.below(20));
                    self.short(d);
                    o.reset(d);
                }
            }
            2 if r.below(4) == 0 => {
                if let Some(o) = other() {
                    drop(o.cancel());
                }
            }
            3 => {
                p.try_complete_watched(&(r.below(STRESS_KEYS as u64) as u32));
            }
            4 => {
                let k = r.below(STRESS_KEYS as u64) as u32;
                p.try_complete_reached(&k, r.below(100));
            }
            5 if r.below(6) == 0 => {
                drop(p.cancel_for_key(&(r.below(STRESS_KEYS as u64) as u32)));
            }
            6 | 7 => {
                if self.budget.fetch_sub(1, Ordering::SeqCst) > 0 {
                    self.register(&p, &mut r);
                } else {
                    self.budget.store(0, Ordering::SeqCst);
                }
            }
            8 => {
                let m = p.metrics();
                let _ = (m.delayed, m.watched);
            }
            9 => {
                if let Some(t) = self.timer.upgrade() {
                    let w = self.clone();
                    if let Ok(h) = t.schedule(ms(r.below(5)), move || w.act(0)) {
                        if r.below(3) == 0 {
                            h.cancel();
                        }
                    }
                }
            }
            10 | 12..=16 => {
                // Make someone ready and walk its key.
                let i = r.below(self.ready.len() as u64) as usize;
                self.ready[i].store(true, Ordering::SeqCst);
                p.try_complete_watched(&((i as u32) % STRESS_KEYS));
            }
            _ => {
                let _ = p.delayed();
            }
        }
    }

    /// An operation whose check (sometimes), expiry, output drops and drop
    /// (some) act on the API.
    fn op(self: &Arc<Self>, id: usize, act_in_check: bool) -> Op {
        let (wc, we) = (self.clone(), self.clone());
        let mut op = Op::new(id, &self.tally)
            .check(move |_| {
                if act_in_check {
                    wc.act(1);
                }
                if !wc.ready[id].load(Ordering::SeqCst) {
                    return None;
                }
                wc.fates[id].fetch_add(1, Ordering::SeqCst);
                Some(if id.is_multiple_of(3) {
                    let w = wc.clone();
                    Out::with(id, &wc.tally, move || w.act(1))
                } else {
                    out(id, &wc.tally)
                })
            })
            .on_expire(move || {
                we.fates[id].fetch_add(2, Ordering::SeqCst);
                we.act(1);
            });
        if id.is_multiple_of(2) {
            let w = self.clone();
            op = op.on_expiry_output_drop(move || w.act(1));
        }
        if id % 4 == 1 {
            let w = self.clone();
            op = op.on_drop(move || w.act(2));
        }
        op
    }

    fn register(self: &Arc<Self>, p: &P, r: &mut Rng) {
        let id = self.next_id.fetch_add(1, Ordering::SeqCst);
        if id >= STRESS_MAX_OPS {
            return;
        }
        let op = self.op(id, r.below(2) == 0);
        let k1 = r.below(STRESS_KEYS as u64) as u32;
        let k2 = (id as u32) % STRESS_KEYS;
        let timeout = if r.below(5) == 0 {
            Duration::from_secs(5)
        } else {
            let d = ms(1 + r.below(30));
            self.short(d);
            d
        };
        let res = if r.below(2) == 0 {
            p.try_complete_else_watch(op, timeout, [k1, k2])
        } else {
            let watches = [Watch::level(k1, r.below(100)), Watch::key(k2)];
            p.try_complete_else_watch_levels(op, timeout, watches)
        };
        match res {
            Ok(h) => {
                if let Some(rf) = h.op_ref() {
                    self.refs.lock().unwrap().push(rf);
                }
                if r.below(4) == 0 {
                    h.detach();
                } else if r.below(30) == 0 {
                    drop(h); // cancels
                } else {
                    self.handles.lock().unwrap().push((id, h));
                }
            }
            Err(e) => drop(e.into_inner()),
        }
    }
}

/// One round of the stress for `seed`: three threads register and act
/// while the reaper runs expiries and timer tasks that act too, for about
/// 100 ms; then a shutdown.
fn stress_round(seed: u64) {
    within(30, move || {
        support::multi().block_on(async move {
            let reaper = Reaper::start().unwrap();
            let p: P = Purgatory::builder().reaper(&reaper).build().unwrap();
            let timer = Timer::builder().reaper(&reaper).build().unwrap();
            let w = Arc::new(World {
                p: p.downgrade(),
                timer: timer.downgrade(),
                tally: Arc::default(),
                refs: Mutex::default(),
                handles: Mutex::default(),
                next_id: AtomicUsize::new(0),
                seed: AtomicU64::new(seed),
                fates: (0..STRESS_MAX_OPS).map(|_| AtomicUsize::new(0)).collect(),
                ready: (0..STRESS_MAX_OPS)
                    .map(|_| AtomicBool::new(false))
                    .collect(),
                budget: AtomicUsize::new(800),
                origin: std::time::Instant::now(),
                short_due: AtomicU64::new(0),
            });
            let mut threads = Vec::new();
            for th in 0..3u64 {
                let (w, p) = (w.clone(), p.clone());
                let rt = tokio::runtime::Handle::current();
                threads.push(std::thread::spawn(move || {
                    let _g = rt.enter();
                    let mut r = Rng(seed ^ (th * 7919 + 1));
                    for i in 0..300 {
                        w.register(&p, &mut r);
                        w.act(0);
                        if i % 50 == 0 {
                            // Lets the reaper's expiries and tasks interleave:
                            // waits for the next expiry (the short timeouts
                            // run on real time, 1 to 30 ms), or until nothing
                            // is pending; pacing only, so at most 1 s.
                            let expired = p.metrics().expired;
                            let give_up = std::time::Instant::now() + Duration::from_secs(1);
                            while p.metrics().expired == expired
                                && p.delayed() > 0
                                && std::time::Instant::now() < give_up
                            {
                                std::thread::sleep(Duration::from_micros(200));
                            }
                        }
                    }
                }));
            }
            for th in threads {
                th.join().unwrap();
            }
            // Let the short timeouts expire (their code acting too): real
            // time must pass for that, until the latest short deadline set
            // (their code may set more meanwhile), and the reaper's tick and
            // wake-up after it; then the shutdown hands back the rest
            // (pacing only: their code stops setting more soon, and past 10 s
            // this waits no more).
            let give_up = w.origin.elapsed() + Duration::from_secs(10);
            loop {
                let due = Duration::from_nanos(w.short_due.load(Ordering::SeqCst)) + ms(3);
                let now = w.origin.elapsed();
                if now >= due.min(give_up) {
                    break;
                }
                tokio::time::sleep(due - now).await;
            }
            // Stop: shutdown hands back what is left.
            drop(p.shutdown());
            let hs: Vec<_> = std::mem::take(&mut *w.handles.lock().unwrap());
            for (id, h) in hs {
                let out = tokio::time::timeout(Duration::from_secs(3), h)
                    .await
                    .unwrap_or_else(|_| panic!("handle {id} never resolved"));
                let fate = w.fates[id].load(Ordering::SeqCst);
                match out {
                    Ok(Completion::Completed(_)) => assert_eq!(fate, 1, "op {id}"),
                    Ok(Completion::Expired(_)) => assert_eq!(fate, 2, "op {id}"),
                    Err(OperationError::Cancelled | OperationError::Shutdown) => {
                        assert_eq!(fate, 0, "op {id}")
                    }
                    Err(e) => panic!("op {id}: {e:?}"),
                }
            }
            drop(timer.shutdown());
            let made = || w.next_id.load(Ordering::SeqCst).min(STRESS_MAX_OPS);
            eventually("every operation dropped", || {
                w.tally.dropped_total() >= made()
            })
            .await;
            let n = made();
            for id in 0..n {
                assert_eq!(w.tally.drops(id), 1, "op {id} drops");
                assert!(w.fates[id].load(Ordering::SeqCst) <= 2, "op {id} fates");
            }
            assert_eq!(w.tally.overlaps(), 0, "overlapping checks");
            let m = p.metrics();
            assert!(balanced(&m), "{m:?}");
            assert_eq!(m.delayed, 0, "{m:?}");
            let with_fate = |f: usize| {
                (0..n)
                    .filter(|&i| w.fates[i].load(Ordering::SeqCst) == f)
                    .count()
            };
            assert_eq!(m.completed as usize, with_fate(1), "{m:?}");
            assert_eq!(m.expired as usize, with_fate(2), "{m:?}");
            // The operations hold the world; let it go.
            w.refs.lock().unwrap().clear();
        });
    });
}

/// The seeds the stress runs: `PURGATORY_COMPOSITION_SEED` alone if set,
/// else 1 to 4.
fn stress_seeds() -> std::ops::Range<u64> {
    match std::env::var("PURGATORY_COMPOSITION_SEED") {
        Ok(s) => {
            let seed: u64 = s.parse().expect("PURGATORY_COMPOSITION_SEED is a number");
            seed..seed + 1
        }
        Err(_) => 1..5,
    }
}

/// Three threads register operations (plain and at levels) and act while
/// the reaper runs expiries and timer tasks on a shared reaper, all of
/// their code (checks, expiries, drops of operations and outputs, timer
/// tasks) calling the public API at random: checks, resets and cancels by
/// reference of other operations, walks, advances, cancels by key,
/// registrations, metrics, weak upgrades, timer schedules and cancels.
/// Every handle resolves with the outcome the operation's own code saw
/// (completed, expired, or neither), every operation is dropped once, no
/// checks overlap, the counts balance and match what the operations saw,
/// and nothing hangs.
#[test]
fn user_code_composing_the_api_at_random_across_threads() {
    for seed in stress_seeds() {
        if let Err(e) = catch_unwind(AssertUnwindSafe(|| stress_round(seed))) {
            let why = e
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| e.downcast_ref::<&str>().copied())
                .unwrap_or("a panic");
            panic!("seed {seed}: {why}; replay with PURGATORY_COMPOSITION_SEED={seed}");
        }
    }
}
