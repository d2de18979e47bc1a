//! Hostile use of the less-travelled APIs: `OpRef` (update, reset, cancel,
//! check from inside an operation's own check and from other threads), level
//! watches (several per key, beside plain ones, levels 0 and `u64::MAX`,
//! advances from expiries and drops), `cancel_for_key` and `drain` with
//! levels, the pending limit's room given back every way, weak handles on the
//! reaper, and the metrics' balance after a cross-thread stress of all of it
//! (on real threads and time, as the suite's other stress test).

mod support;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio_purgatory::{
    Completion, OpRef, Operation, OperationError, OperationStatus, Purgatory, Watch, WatchError,
};

use support::{balanced, ms, paused_within, settle, within};

type CheckFn = Box<dyn FnMut(Option<u64>) -> Option<u64> + Send>;

/// An operation whose check, expiry and drop are closures.
struct H {
    check: CheckFn,
    expire: Option<Box<dyn FnOnce() -> u64 + Send>>,
    on_drop: Option<Box<dyn FnOnce() + Send>>,
    checks: Arc<AtomicUsize>,
}

impl H {
    fn new(check: impl FnMut(Option<u64>) -> Option<u64> + Send + 'static) -> H {
        H {
            check: Box::new(check),
            expire: None,
            on_drop: None,
            checks: Arc::default(),
        }
    }
    fn never() -> H {
        H::new(|_| None)
    }
    fn on_expire(mut self, f: impl FnOnce() -> u64 + Send + 'static) -> H {
        self.expire = Some(Box::new(f));
        self
    }
    fn on_drop(mut self, f: impl FnOnce() + Send + 'static) -> H {
        self.on_drop = Some(Box::new(f));
        self
    }
    fn counted(mut self, c: &Arc<AtomicUsize>) -> H {
        self.checks = c.clone();
        self
    }
}

impl Operation for H {
    type Output = u64;
    fn try_complete(&mut self) -> Option<u64> {
        self.checks.fetch_add(1, Ordering::SeqCst);
        (self.check)(None)
    }
    fn try_complete_reached(&mut self, reached: u64) -> Option<u64> {
        self.checks.fetch_add(1, Ordering::SeqCst);
        (self.check)(Some(reached))
    }
    fn on_expiration(mut self) -> u64 {
        match self.expire.take() {
            Some(f) => f(),
            None => 0,
        }
    }
}

impl Drop for H {
    fn drop(&mut self) {
        if let Some(f) = self.on_drop.take() {
            f();
        }
    }
}

type P = Purgatory<u32, H>;

fn quiet_invariants(p: &P) {
    let m = p.metrics();
    assert_eq!(m.delayed, 0, "{m:?}");
    assert!(balanced(&m), "unbalanced {m:?}");
    assert_eq!(m.watched, m.tombstones, "watched vs tombstones {m:?}");
}

type Slot<T> = Arc<OnceLock<T>>;

// ---------------------------------------------------------------------------
// OpRef

/// A check cancels its own operation through its OpRef: the cancel is deferred
/// to the check, the operation ends Cancelled, room under max_pending comes back.
#[tokio::test(start_paused = true)]
async fn cancel_from_inside_own_check_gives_room_back() {
    let p: P = Purgatory::builder().max_pending(1).build().unwrap();
    let me: Slot<OpRef<u32, H>> = Arc::default();
    let saw: Arc<Mutex<Vec<(bool, OperationStatus)>>> = Arc::default();
    let armed = Arc::new(AtomicBool::new(false));
    let (m2, s2, a2) = (me.clone(), saw.clone(), armed.clone());
    let h = p
        .try_complete_else_watch(
            H::new(move |_| {
                if a2.load(Ordering::SeqCst) {
                    let r = m2.get().unwrap();
                    let got = r.cancel().is_some();
                    s2.lock().unwrap().push((got, r.status()));
                }
                None
            }),
            ms(1000),
            [1],
        )
        .unwrap();
    me.set(h.op_ref().unwrap()).ok().unwrap();
    armed.store(true, Ordering::SeqCst);
    assert_eq!(p.try_complete_watched(&1), 0);
    assert_eq!(*saw.lock().unwrap(), [(false, OperationStatus::Pending)]);
    assert_eq!(h.await, Err(OperationError::Cancelled));
    assert_eq!(me.get().unwrap().status(), OperationStatus::Cancelled);
    // Room is back.
    let h2 = p.try_complete_else_watch(H::never(), ms(10), [2]).unwrap();
    assert_eq!(h2.await, Ok(Completion::Expired(0)));
    quiet_invariants(&p);
    assert_eq!(p.metrics().cancelled, 1);
}

/// OpRef::try_complete re-entered from its own check: false, no deadlock; and
/// update from its own check: None.
#[test]
fn try_complete_and_update_from_own_check() {
    paused_within(10, || async {
        let p: P = Purgatory::new();
        let me: Slot<OpRef<u32, H>> = Arc::default();
        let log: Arc<Mutex<Vec<String>>> = Arc::default();
        let (m2, l2) = (me.clone(), log.clone());
        let h = p
            .try_complete_else_watch(
                H::new(move |_| {
                    if let Some(r) = m2.get() {
                        let a = r.try_complete();
                        let b = r.update(|_| 1);
                        let c = r.reset(ms(5000));
                        l2.lock().unwrap().push(format!("{a} {b:?} {c}"));
                        return Some(7);
                    }
                    None
                }),
                ms(1000),
                [1],
            )
            .unwrap();
        let r = h.op_ref().unwrap();
        me.set(r.clone()).ok().unwrap();
        assert!(r.try_complete());
        assert_eq!(*log.lock().unwrap(), ["false None true"]);
        assert_eq!(h.await, Ok(Completion::Completed(7)));
        let m = p.metrics();
        assert_eq!(m.checks.by_reference.walks, 2, "{m:?}");
        assert_eq!(m.checks.by_reference.completed, 1, "{m:?}");
        quiet_invariants(&p);
    })
}

/// update from another thread while a check runs waits for it, and sees what the
/// check left; the check that follows sees the update.
#[test]
fn update_from_another_thread_during_a_check() {
    within(20, || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_time()
            .build()
            .unwrap();
        let _g = rt.enter();
        let p: P = Purgatory::new();
        let entered = Arc::new(std::sync::Barrier::new(2));
        let release = Arc::new(std::sync::Barrier::new(2));
        let hold = Arc::new(AtomicBool::new(false));
        let value = Arc::new(AtomicU64::new(0));
        let (e2, r2, h2, v2) = (
            entered.clone(),
            release.clone(),
            hold.clone(),
            value.clone(),
        );
        let h = p
            .try_complete_else_watch(
                H::new(move |_| {
                    if h2.swap(false, Ordering::SeqCst) {
                        e2.wait();
                        r2.wait();
                    }
                    let v = v2.load(Ordering::SeqCst);
                    (v >= 3).then_some(v)
                }),
                Duration::from_secs(30),
                [1],
            )
            .unwrap();
        let r = h.op_ref().unwrap();
        hold.store(true, Ordering::SeqCst);
        let walker = {
            let p = p.clone();
            std::thread::spawn(move || p.try_complete_watched(&1))
        };
        entered.wait();
        // Updater blocks until the check is released.
        let updater = {
            let r = r.clone();
            let value = value.clone();
            std::thread::spawn(move || {
                r.update(|_| {
                    value.store(3, Ordering::SeqCst);
                })
            })
        };
        // The update has not run yet (the check holds the op).
        for _ in 0..1000 {
            std::thread::yield_now();
        }
        assert_eq!(value.load(Ordering::SeqCst), 0, "update ran beside a check");
        release.wait();
        assert_eq!(walker.join().unwrap(), 0);
        assert_eq!(updater.join().unwrap(), Some(()));
        assert!(r.try_complete());
        assert_eq!(r.status(), OperationStatus::Completed);
        drop(h);
        drop(r);
        quiet_invariants(&p);
    })
}

// ---------------------------------------------------------------------------
// Levels

/// One operation watching one key at several levels and plainly: an advance
/// past all of them completes it once; counts and tombstones balance.
#[tokio::test(start_paused = true)]
async fn several_levels_and_plain_on_one_key() {
    let p: P = Purgatory::new();
    let c = Arc::new(AtomicUsize::new(0));
    let h = p
        .try_complete_else_watch_levels(
            H::new(|l| l.filter(|l| *l >= 20)).counted(&c),
            ms(1000),
            [
                Watch::level(1, 5),
                Watch::level(1, 10),
                Watch::key(1),
                Watch::level(2, 3),
            ],
        )
        .unwrap();
    assert_eq!(p.metrics().watched, 4);
    c.store(0, Ordering::SeqCst);
    assert_eq!(p.try_complete_reached(&1, 12), 0);
    assert_eq!(c.swap(0, Ordering::SeqCst), 3, "two levels + plain");
    assert_eq!(
        p.try_complete_reached(&1, 12),
        1 - 1,
        "at 13 now: plain only"
    );
    assert_eq!(c.swap(0, Ordering::SeqCst), 1);
    assert_eq!(p.try_complete_reached(&1, 20), 1);
    assert_eq!(c.swap(0, Ordering::SeqCst), 1, "the first check completes");
    assert_eq!(h.await, Ok(Completion::Completed(20)));
    quiet_invariants(&p);
}

/// Level 0 and u64::MAX: a watch at 0 is checked by an advance to 0; one at
/// u64::MAX (or above it) only by an advance to u64::MAX, which never loops.
#[tokio::test(start_paused = true)]
async fn levels_zero_and_max() {
    let p: P = Purgatory::new();
    let c0 = Arc::new(AtomicUsize::new(0));
    let cm = Arc::new(AtomicUsize::new(0));
    let go = Arc::new(AtomicBool::new(false));
    let g = go.clone();
    let h0 = p
        .try_complete_else_watch_levels(
            H::new(|l| l.map(|_| 0)).counted(&c0),
            ms(1000),
            [Watch::level(0, 0)],
        )
        .unwrap();
    let hm = p
        .try_complete_else_watch_levels(
            H::new(move |l| (l == Some(u64::MAX) && g.load(Ordering::SeqCst)).then_some(1))
                .counted(&cm),
            ms(1000),
            [Watch::level(0, u64::MAX), Watch::above(0, u64::MAX)],
        )
        .unwrap();
    cm.store(0, Ordering::SeqCst);
    assert_eq!(p.try_complete_reached(&0, 0), 1);
    assert_eq!(h0.await, Ok(Completion::Completed(0)));
    assert_eq!(cm.load(Ordering::SeqCst), 0);
    assert_eq!(p.try_complete_reached(&0, u64::MAX - 1), 0);
    assert_eq!(cm.load(Ordering::SeqCst), 0);
    for _ in 0..3 {
        assert_eq!(p.try_complete_reached(&0, u64::MAX), 0);
    }
    assert_eq!(
        cm.swap(0, Ordering::SeqCst),
        6,
        "two watches x three advances"
    );
    go.store(true, Ordering::SeqCst);
    assert_eq!(p.try_complete_reached(&0, u64::MAX), 1);
    assert_eq!(hm.await, Ok(Completion::Completed(1)));
    quiet_invariants(&p);
}

/// An advance from inside on_expiration (on the reaper) checks the others.
#[tokio::test(start_paused = true)]
async fn advance_from_on_expiration() {
    let p: P = Purgatory::new();
    let slot: Slot<P> = Arc::default();
    slot.set(p.clone()).ok().unwrap();
    let s = slot.clone();
    let a = p
        .try_complete_else_watch_levels(
            H::never().on_expire(move || s.get().unwrap().try_complete_reached(&2, 10) as u64),
            ms(10),
            [Watch::level(2, 0)],
        )
        .unwrap();
    let b = p
        .try_complete_else_watch_levels(
            H::new(|l| l.filter(|l| *l >= 10)),
            ms(1000),
            [Watch::level(2, 5)],
        )
        .unwrap();
    assert_eq!(a.await, Ok(Completion::Expired(1)));
    assert_eq!(b.await, Ok(Completion::Completed(10)));
    quiet_invariants(&p);
}

/// An operation's Drop (after it completed by an advance of a key) advances the
/// same key again and registers at a level on it: no deadlock, nothing lost.
#[test]
fn advance_and_register_from_a_drop_during_an_advance() {
    paused_within(10, || async {
        let p: P = Purgatory::new();
        let slot: Slot<P> = Arc::default();
        slot.set(p.clone()).ok().unwrap();
        let s = slot.clone();
        let follow: Arc<Mutex<Vec<tokio_purgatory::OperationHandle<u32, H>>>> = Arc::default();
        let f2 = follow.clone();
        let other = p
            .try_complete_else_watch_levels(
                H::new(|l| l.filter(|l| *l >= 30)),
                ms(1000),
                [Watch::level(1, 25)],
            )
            .unwrap();
        let a = p
            .try_complete_else_watch_levels(
                H::new(|l| l.filter(|l| *l >= 10)).on_drop(move || {
                    let p = s.get().unwrap();
                    let h = p
                        .try_complete_else_watch_levels(
                            H::new(|l| l.filter(|l| *l >= 40)),
                            ms(1000),
                            [Watch::level(1, 11)],
                        )
                        .unwrap();
                    f2.lock().unwrap().push(h);
                    assert_eq!(p.try_complete_reached(&1, 30), 1, "completes `other`");
                }),
                ms(1000),
                [Watch::level(1, 10)],
            )
            .unwrap();
        assert_eq!(p.try_complete_reached(&1, 10), 1);
        assert_eq!(a.await, Ok(Completion::Completed(10)));
        assert_eq!(other.await, Ok(Completion::Completed(30)));
        let h = follow.lock().unwrap().pop().unwrap();
        assert_eq!(p.try_complete_reached(&1, 40), 1);
        assert_eq!(h.await, Ok(Completion::Completed(40)));
        quiet_invariants(&p);
    })
}

/// cancel_for_key on a key watched at levels (one operation at two levels and
/// plainly, others at one level): each operation comes back once.
#[tokio::test(start_paused = true)]
async fn cancel_for_key_at_levels() {
    let p: P = Purgatory::builder().max_pending(3).build().unwrap();
    let a = p
        .try_complete_else_watch_levels(
            H::never(),
            ms(1000),
            [
                Watch::level(1, 5),
                Watch::level(1, 50),
                Watch::key(1),
                Watch::key(2),
            ],
        )
        .unwrap();
    let b = p
        .try_complete_else_watch_levels(
            H::never(),
            ms(1000),
            [Watch::level(1, 7), Watch::level(3, 1)],
        )
        .unwrap();
    let c = p
        .try_complete_else_watch_levels(H::never(), ms(1000), [Watch::level(3, 9)])
        .unwrap();
    assert!(matches!(
        p.try_complete_else_watch(H::never(), ms(1000), [9]),
        Err(WatchError::AtCapacity(_))
    ));
    let back = p.cancel_for_key(&1);
    assert_eq!(back.len(), 2);
    assert_eq!(a.await, Err(OperationError::Cancelled));
    assert_eq!(b.await, Err(OperationError::Cancelled));
    let m = p.metrics();
    assert_eq!(m.delayed, 1, "{m:?}");
    // Room is back: two registrations fit.
    let d = p.try_complete_else_watch(H::never(), ms(5), [9]).unwrap();
    let e = p.try_complete_else_watch(H::never(), ms(5), [9]).unwrap();
    drop(back);
    assert!(d.await.is_ok() && e.await.is_ok());
    assert_eq!(p.try_complete_reached(&3, 100), 0);
    drop(c);
    settle().await;
    quiet_invariants(&p);
}

/// drain waits for level watches and ends once an advance completes them.
#[tokio::test(start_paused = true)]
async fn drain_with_level_watches() {
    let p: P = Purgatory::new();
    let h = p
        .try_complete_else_watch_levels(
            H::new(|l| l.filter(|l| *l >= 5)),
            ms(100_000),
            [Watch::level(1, 5)],
        )
        .unwrap()
        .into_op_ref()
        .unwrap();
    let p2 = p.clone();
    let drainer = tokio::spawn(async move { p2.drain().await });
    settle().await;
    assert!(!drainer.is_finished());
    assert!(matches!(
        p.try_complete_else_watch_levels(H::never(), ms(10), [Watch::level(1, 1)]),
        Err(WatchError::Draining(_))
    ));
    assert_eq!(p.try_complete_reached(&1, 4), 0);
    settle().await;
    assert!(!drainer.is_finished());
    assert_eq!(p.try_complete_reached(&1, 5), 1);
    tokio::time::timeout(ms(10), drainer)
        .await
        .expect("drain ended")
        .unwrap();
    assert_eq!(h.status(), OperationStatus::Completed);
    quiet_invariants(&p);
}

/// max_pending with levels: completed at registration, refused, cancelled,
/// shut down: room given back exactly.
#[tokio::test(start_paused = true)]
async fn max_pending_with_levels_every_way() {
    let p: P = Purgatory::builder().max_pending(2).build().unwrap();
    for _ in 0..5 {
        let h = p
            .try_complete_else_watch_levels(H::new(|_| Some(1)), ms(10), [Watch::level(1, 5)])
            .unwrap();
        assert_eq!(h.await, Ok(Completion::Completed(1)));
    }
    let a = p
        .try_complete_else_watch_levels(H::never(), ms(1000), [Watch::level(1, 5)])
        .unwrap();
    let b = p
        .try_complete_else_watch_levels(H::never(), ms(1000), [Watch::level(1, 6)])
        .unwrap();
    for _ in 0..3 {
        let e = p
            .try_complete_else_watch_levels(H::never(), ms(1000), [Watch::level(1, 6)])
            .unwrap_err();
        assert!(matches!(e, WatchError::AtCapacity(_)));
    }
    assert!(a.op_ref().unwrap().cancel().is_some());
    let c = p
        .try_complete_else_watch_levels(H::never(), ms(1000), [Watch::level(2, 6)])
        .unwrap();
    assert_eq!(p.shutdown().len(), 2);
    assert_eq!(b.await, Err(OperationError::Shutdown));
    assert_eq!(c.await, Err(OperationError::Shutdown));
    let m = p.metrics();
    assert_eq!(m.delayed, 0);
    assert!(balanced(&m), "{m:?}");
    assert_eq!(m.watched, 0, "{m:?}");
}

// ---------------------------------------------------------------------------
// WeakPurgatory from drops on the reaper

/// An operation owning the last strong clone expires: the purgatory is dropped
/// on the reaper, inside the expiry. The others are resolved, nothing hangs.
#[test]
fn last_clone_dropped_by_an_expiry_on_the_reaper() {
    paused_within(10, || async {
        let p: P = Purgatory::new();
        let weak = p.downgrade();
        let strong = Arc::new(Mutex::new(Some(p.clone())));
        let s2 = strong.clone();
        let w2 = weak.clone();
        let a = p
            .try_complete_else_watch(
                H::never().on_expire(move || {
                    let owned = s2.lock().unwrap().take();
                    // A follow-up registered through the weak handle while alive.
                    let pp = w2.upgrade().unwrap();
                    let f = pp.try_complete_else_watch(H::never(), ms(1000), [5]);
                    drop(pp);
                    let ok = f.map(|h| h.detach()).is_ok();
                    drop(owned); // the last strong clone: shuts down here
                    assert!(w2.upgrade().is_none());
                    ok as u64
                }),
                ms(10),
                [1],
            )
            .unwrap();
        let b = p
            .try_complete_else_watch(H::never(), ms(1000), [2])
            .unwrap();
        let bref = b.op_ref().unwrap();
        drop(p);
        assert_eq!(a.await, Ok(Completion::Expired(1)));
        assert_eq!(b.await, Err(OperationError::Shutdown));
        assert_eq!(bref.status(), OperationStatus::Cancelled);
        assert!(weak.upgrade().is_none());
    })
}

/// Drops on the reaper (an expired detached operation's output-less drop)
/// upgrade the weak handle and call shutdown: no deadlock, counts balance.
#[test]
fn shutdown_from_a_drop_on_the_reaper() {
    paused_within(10, || async {
        let p: P = Purgatory::new();
        let weak = p.downgrade();
        let w2 = weak.clone();
        p.try_complete_else_watch(
            H::never().on_drop(move || {
                if let Some(p) = w2.upgrade() {
                    let back = p.shutdown();
                    assert_eq!(back.len(), 1);
                }
            }),
            ms(10),
            [1],
        )
        .unwrap()
        .detach();
        let b = p
            .try_complete_else_watch(H::never(), ms(1000), [2])
            .unwrap();
        assert_eq!(b.await, Err(OperationError::Shutdown));
        let m = p.metrics();
        assert!(balanced(&m), "{m:?}");
        assert_eq!(m.delayed, 0);
        assert_eq!((m.expired, m.handed_back), (1, 1));
    })
}

// ---------------------------------------------------------------------------
// Cross-thread hostile stress over OpRef, levels, max_pending.

use support::rng::Rng;

#[derive(Default)]
struct Tracker {
    in_check: Vec<AtomicBool>,
    finished: Vec<AtomicBool>,
    drops: Vec<AtomicUsize>,
    created: AtomicUsize,
    violations: Mutex<Vec<String>>,
    refs: Mutex<Vec<OpRef<u32, S>>>,
}

impl Tracker {
    fn new(n: usize) -> Tracker {
        Tracker {
            in_check: (0..n).map(|_| AtomicBool::new(false)).collect(),
            finished: (0..n).map(|_| AtomicBool::new(false)).collect(),
            drops: (0..n).map(|_| AtomicUsize::new(0)).collect(),
            ..Tracker::default()
        }
    }
    fn bad(&self, s: String) {
        self.violations.lock().unwrap().push(s);
    }
}

struct S {
    id: usize,
    need: u64,
    t: Arc<Tracker>,
    p: Slot<Purgatory<u32, S>>,
    me: Arc<OnceLock<OpRef<u32, S>>>,
    rng: Rng,
}

impl S {
    fn check(&mut self, reached: Option<u64>) -> Option<u64> {
        let t = self.t.clone();
        if t.in_check[self.id].swap(true, Ordering::SeqCst) {
            t.bad(format!("op {} checks overlap", self.id));
        }
        if t.finished[self.id].load(Ordering::SeqCst) {
            t.bad(format!("op {} checked after finishing", self.id));
        }
        let roll = self.rng.below(100);
        let p = self.p.get().cloned();
        let mut panic_now = false;
        match (roll, p) {
            (0..=9, Some(p)) => {
                let key = self.rng.below(4) as u32;
                let lvl = self.rng.below(200);
                p.try_complete_reached(&key, lvl);
            }
            (10..=14, Some(p)) => {
                p.try_complete_watched(&(self.rng.below(4) as u32));
            }
            (15..=19, _) => {
                if let Some(r) = self.me.get() {
                    if r.cancel().is_some() {
                        t.bad(format!("op {} taken by its own cancel mid-check", self.id));
                    }
                }
            }
            (20..=24, _) => {
                if let Some(r) = self.me.get() {
                    r.reset(Duration::from_millis(self.rng.below(30)));
                }
            }
            (25..=29, _) => {
                if let Some(r) = self.me.get() {
                    if r.update(|_| ()).is_some() {
                        t.bad(format!("op {} updated from its own check", self.id));
                    }
                    let _ = r.try_complete();
                    let _ = r.status();
                }
            }
            (30..=31, _) => panic_now = true,
            _ => {}
        }
        let done = match reached {
            Some(l) => l >= self.need,
            None => self.rng.below(20) == 0,
        } && !panic_now;
        if done && t.finished[self.id].swap(true, Ordering::SeqCst) {
            t.bad(format!("op {} finished twice (check)", self.id));
        }
        t.in_check[self.id].store(false, Ordering::SeqCst);
        if panic_now {
            panic!("hostile check");
        }
        done.then_some(self.id as u64)
    }
}

impl Operation for S {
    type Output = u64;
    fn try_complete(&mut self) -> Option<u64> {
        self.check(None)
    }
    fn try_complete_reached(&mut self, reached: u64) -> Option<u64> {
        self.check(Some(reached))
    }
    fn on_expiration(mut self) -> u64 {
        if self.t.in_check[self.id].load(Ordering::SeqCst) {
            self.t
                .bad(format!("op {} expires during its check", self.id));
        }
        if self.t.finished[self.id].swap(true, Ordering::SeqCst) {
            self.t
                .bad(format!("op {} finished twice (expiry)", self.id));
        }
        if self.rng.below(4) == 0 {
            if let Some(p) = self.p.get() {
                p.try_complete_reached(&(self.rng.below(4) as u32), self.rng.below(200));
            }
        }
        self.id as u64
    }
}

impl Drop for S {
    fn drop(&mut self) {
        if self.t.drops[self.id].fetch_add(1, Ordering::SeqCst) != 0 {
            self.t.bad(format!("op {} dropped twice", self.id));
        }
    }
}

#[test]
fn hostile_stress_balances_and_finishes_each_once() {
    within(120, || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_time()
            .build()
            .unwrap();
        let _g = rt.enter();
        const N: usize = 40_000;
        let t = Arc::new(Tracker::new(N));
        let p: Purgatory<u32, S> = Purgatory::builder()
            .max_pending(20)
            .purge_interval(50)
            .build()
            .unwrap();
        let slot: Slot<Purgatory<u32, S>> = Arc::default();
        slot.set(p.clone()).ok().unwrap();
        let next = Arc::new(AtomicUsize::new(0));
        let refused = Arc::new(AtomicUsize::new(0));
        let handles: Arc<Mutex<Vec<tokio_purgatory::OperationHandle<u32, S>>>> = Arc::default();
        let threads: Vec<_> = (0..4u64)
            .map(|th| {
                let (t, p, slot, next, refused, handles) = (
                    t.clone(),
                    p.clone(),
                    slot.clone(),
                    next.clone(),
                    refused.clone(),
                    handles.clone(),
                );
                std::thread::spawn(move || {
                    let mut rng = Rng(0xfeed + th);
                    loop {
                        let roll = rng.below(100);
                        if roll < 40 {
                            let id = next.fetch_add(1, Ordering::SeqCst);
                            if id >= N {
                                break;
                            }
                            t.created.fetch_add(1, Ordering::SeqCst);
                            let me = Arc::new(OnceLock::new());
                            let op = S {
                                id,
                                need: rng.below(200),
                                t: t.clone(),
                                p: slot.clone(),
                                me: me.clone(),
                                rng: Rng(rng.next()),
                            };
                            let k = rng.below(4) as u32;
                            let timeout = Duration::from_millis(1 + rng.below(20));
                            let r = match rng.below(3) {
                                0 => p.try_complete_else_watch(op, timeout, [k, (k + 1) % 4]),
                                1 => p.try_complete_else_watch_levels(
                                    op,
                                    timeout,
                                    [
                                        Watch::level(k, rng.below(200)),
                                        Watch::level(k, rng.below(200)),
                                    ],
                                ),
                                _ => p.try_complete_else_watch_levels(
                                    op,
                                    timeout,
                                    [Watch::above((k + 1) % 4, rng.below(200)), Watch::key(k)],
                                ),
                            };
                            match r {
                                Ok(h) => {
                                    if let Some(r) = h.op_ref() {
                                        let _ = me.set(r.clone());
                                        t.refs.lock().unwrap().push(r);
                                    }
                                    match rng.below(3) {
                                        0 => h.detach(),
                                        1 => handles.lock().unwrap().push(h),
                                        _ => drop(h),
                                    }
                                }
                                Err(e) => {
                                    refused.fetch_add(1, Ordering::SeqCst);
                                    drop(e.into_inner());
                                }
                            }
                        } else if roll < 55 {
                            p.try_complete_reached(&(rng.below(4) as u32), rng.below(220));
                        } else if roll < 65 {
                            p.try_complete_watched(&(rng.below(4) as u32));
                        } else if roll < 67 {
                            drop(p.cancel_for_key(&(rng.below(4) as u32)));
                        } else if roll < 90 {
                            let r = {
                                let refs = t.refs.lock().unwrap();
                                if refs.is_empty() {
                                    continue;
                                }
                                refs[rng.below(refs.len() as u64) as usize].clone()
                            };
                            match rng.below(5) {
                                0 => {
                                    r.try_complete();
                                }
                                1 => {
                                    r.update(|_| ());
                                }
                                2 => {
                                    r.reset(Duration::from_millis(rng.below(20)));
                                }
                                3 => drop(r.cancel()),
                                _ => {
                                    let _ = r.status();
                                }
                            }
                        } else {
                            let mut hs = handles.lock().unwrap();
                            if !hs.is_empty() {
                                let i = rng.below(hs.len() as u64) as usize;
                                let h = hs.swap_remove(i);
                                drop(hs);
                                drop(h);
                            }
                        }
                        let mut refs = t.refs.lock().unwrap();
                        if refs.len() > 2000 {
                            refs.retain(|r| !r.is_finished());
                        }
                    }
                })
            })
            .collect();
        for th in threads {
            th.join().unwrap();
        }
        rt.block_on(async {
            for _ in 0..1000 {
                if p.delayed() == 0 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            assert_eq!(p.delayed(), 0, "nothing left pending");
        });
        let v = t.violations.lock().unwrap().clone();
        assert!(
            v.is_empty(),
            "{} violations, first: {:?}",
            v.len(),
            &v[..v.len().min(10)]
        );
        handles.lock().unwrap().clear();
        t.refs.lock().unwrap().clear();
        let created = t.created.load(Ordering::SeqCst);
        let dropped: usize = t.drops[..created]
            .iter()
            .map(|d| d.load(Ordering::SeqCst))
            .sum();
        assert_eq!(dropped, created, "every op dropped exactly once");
        let finished = t.finished[..created]
            .iter()
            .filter(|f| f.load(Ordering::SeqCst))
            .count() as u64;
        let m = p.metrics();
        assert_eq!(m.delayed, 0);
        assert!(balanced(&m), "{m:?}");
        assert_eq!(m.watched, m.tombstones, "{m:?}");
        assert_eq!(finished, m.completed + m.expired, "{m:?}");
        assert_eq!(
            m.registered + refused.load(Ordering::SeqCst) as u64,
            created as u64,
            "{m:?}"
        );
        // room under max_pending fully back
        let mut hs = Vec::new();
        for i in 0..20 {
            let op = S {
                id: i,
                need: u64::MAX,
                t: Arc::new(Tracker::new(20)),
                p: Arc::default(),
                me: Arc::default(),
                rng: Rng(1),
            };
            hs.push(
                p.try_complete_else_watch(op, Duration::from_secs(60), [9])
                    .map_err(|e| e.kind())
                    .expect("room"),
            );
        }
        drop(hs);
    })
}

/// Level tombstones left by completions through another key go with the purge
/// that the last cancellation starts once nothing is pending; keys leave.
#[tokio::test(start_paused = true)]
async fn level_tombstones_leave_when_nothing_is_pending() {
    let p: P = Purgatory::new();
    let ready = Arc::new(AtomicBool::new(false));
    let mut hs = Vec::new();
    for i in 0..40u32 {
        let r = ready.clone();
        hs.push(
            p.try_complete_else_watch_levels(
                H::new(move |_| r.load(Ordering::SeqCst).then_some(1)),
                ms(1000),
                [
                    Watch::key(1),
                    Watch::level(2, 100 + u64::from(i)),
                    Watch::level(3 + i % 3, 7),
                ],
            )
            .unwrap(),
        );
    }
    ready.store(true, Ordering::SeqCst);
    assert_eq!(p.try_complete_watched(&1), 40);
    let m = p.metrics();
    assert_eq!(m.watched, m.tombstones, "{m:?}");
    // One more, cancelled: nothing is pending after it.
    let h = p
        .try_complete_else_watch_levels(H::never(), ms(1000), [Watch::level(2, 5)])
        .unwrap();
    assert!(h.cancel().is_some());
    let m = p.metrics();
    assert_eq!((m.watched, m.tombstones, m.keys), (0, 0, 0), "{m:?}");
    drop(hs);
}

/// A reset to the past and then back to the far future before the reaper turns:
/// only the last deadline counts.
#[tokio::test(start_paused = true)]
async fn reset_past_then_future_before_the_reaper_turns() {
    let p: P = Purgatory::new();
    let h = p.try_complete_else_watch(H::never(), ms(50), [1]).unwrap();
    let r = h.op_ref().unwrap();
    let now = tokio::time::Instant::now();
    assert!(r.reset_at(now - ms(10)));
    assert!(r.reset(Duration::from_secs(3600)));
    settle().await;
    tokio::time::advance(ms(100)).await;
    settle().await;
    assert_eq!(r.status(), OperationStatus::Pending);
    assert!(h.reset(ms(0)));
    assert_eq!(h.await, Ok(Completion::Expired(0)));
    assert!(!r.reset(ms(10)));
    quiet_invariants(&p);
}

/// A check run by an advance cancels the key it is advanced on (cancel_for_key
/// from inside, mid-advance): the others on the key come back, itself is
/// cancelled after its check; nothing deadlocks; counts balance.
#[test]
fn cancel_for_key_from_inside_an_advance() {
    paused_within(10, || async {
        let p: P = Purgatory::builder().max_pending(5).build().unwrap();
        let slot: Slot<P> = Arc::default();
        slot.set(p.clone()).ok().unwrap();
        let s = slot.clone();
        let got = Arc::new(AtomicUsize::new(usize::MAX));
        let g = got.clone();
        let a = p
            .try_complete_else_watch_levels(
                H::new(move |l| {
                    if l.is_some() {
                        g.store(s.get().unwrap().cancel_for_key(&1).len(), Ordering::SeqCst);
                    }
                    None
                }),
                ms(1000),
                [Watch::level(1, 1)],
            )
            .unwrap();
        let others: Vec<_> = (0..3)
            .map(|i| {
                p.try_complete_else_watch_levels(
                    H::never(),
                    ms(1000),
                    [Watch::level(1, 2 + i), Watch::key(9)],
                )
                .unwrap()
            })
            .collect();
        assert_eq!(p.try_complete_reached(&1, 10), 0);
        assert_eq!(got.load(Ordering::SeqCst), 3);
        assert_eq!(a.await, Err(OperationError::Cancelled));
        for h in others {
            assert_eq!(h.await, Err(OperationError::Cancelled));
        }
        quiet_invariants(&p);
        let hs: Vec<_> = (0..5)
            .map(|_| p.try_complete_else_watch(H::never(), ms(5), [1]).unwrap())
            .collect();
        for h in hs {
            assert!(h.await.is_ok());
        }
        quiet_invariants(&p);
    })
}

/// A waker that, when its handle's operation completes, advances the key again
/// and updates another operation currently being checked on the same thread.
#[test]
fn waker_that_advances_and_updates() {
    use std::future::Future;
    use std::task::{RawWaker, RawWakerVTable, Waker};
    static P_SLOT: OnceLock<P> = OnceLock::new();
    static R_SLOT: OnceLock<OpRef<u32, H>> = OnceLock::new();
    static WOKE: AtomicUsize = AtomicUsize::new(0);
    fn clone(_: *const ()) -> RawWaker {
        RawWaker::new(std::ptr::null(), &VT)
    }
    fn wake(_: *const ()) {
        WOKE.fetch_add(1, Ordering::SeqCst);
        if let Some(p) = P_SLOT.get() {
            p.try_complete_reached(&1, 100);
        }
        if let Some(r) = R_SLOT.get() {
            let _ = r.update(|_| ());
            let _ = r.reset(ms(5));
        }
    }
    fn noop(_: *const ()) {}
    static VT: RawWakerVTable = RawWakerVTable::new(clone, wake, wake, noop);
    within(10, || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap();
        let _g = rt.enter();
        let p: P = Purgatory::new();
        P_SLOT.set(p.clone()).ok().unwrap();
        // B: its check advances key 2, which completes A (whose waker runs then,
        // inside B's check, and updates B).
        let slot: Slot<P> = Arc::default();
        slot.set(p.clone()).ok().unwrap();
        let s = slot.clone();
        let b = p
            .try_complete_else_watch_levels(
                H::new(move |l| {
                    if l == Some(50) {
                        s.get().unwrap().try_complete_reached(&2, 10);
                        return Some(2);
                    }
                    None
                }),
                ms(1000),
                [Watch::level(1, 50)],
            )
            .unwrap();
        R_SLOT.set(b.op_ref().unwrap()).ok().unwrap();
        let mut a = p
            .try_complete_else_watch_levels(
                H::new(|l| l.filter(|l| *l >= 10)),
                ms(1000),
                [Watch::level(2, 10)],
            )
            .unwrap();
        let waker = unsafe { Waker::from_raw(RawWaker::new(std::ptr::null(), &VT)) };
        let mut cx = std::task::Context::from_waker(&waker);
        assert!(std::pin::Pin::new(&mut a).poll(&mut cx).is_pending());
        assert_eq!(p.try_complete_reached(&1, 50), 1);
        assert_eq!(WOKE.load(Ordering::SeqCst), 1);
        assert!(matches!(
            std::pin::Pin::new(&mut a).poll(&mut cx),
            std::task::Poll::Ready(Ok(Completion::Completed(10)))
        ));
        rt.block_on(async {
            assert_eq!(b.await, Ok(Completion::Completed(2)));
        });
        quiet_invariants(&p);
    })
}

/// Resets racing the reaper on real threads: a reset that returned true
/// leaves the operation pending (its old deadline, a few milliseconds off,
/// passes while the test waits, and does not fire); one that returned false
/// found it expired. The test waits for a sentinel registered last and due
/// 6 ms after the latest old deadline: once the reaper has expired it, it
/// has passed every old deadline.
#[test]
fn resets_racing_the_reaper_either_win_or_say_false() {
    within(60, || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_time()
            .build()
            .unwrap();
        let _g = rt.enter();
        let p: P = Purgatory::new();
        let refs: Vec<_> = (0..2000u32)
            .map(|i| {
                let timeout = Duration::from_micros(100 + u64::from(i % 7) * 300);
                p.try_complete_else_watch(H::never(), timeout, [i % 16])
                    .unwrap()
                    .into_op_ref()
                    .unwrap()
            })
            .collect();
        // Due after every old deadline (the latest 1.9 ms from its
        // registration), by several ticks.
        let sentinel = p
            .try_complete_else_watch(H::never(), Duration::from_millis(8), [999])
            .unwrap();
        let refs = Arc::new(refs);
        let results: Vec<Vec<(usize, bool)>> = (0..2)
            .map(|t| {
                let refs = refs.clone();
                std::thread::spawn(move || {
                    (0..refs.len())
                        .filter(|i| i % 2 == t)
                        .map(|i| (i, refs[i].reset(Duration::from_secs(3600))))
                        .collect::<Vec<_>>()
                })
            })
            .map(|h| h.join().unwrap())
            .collect();
        // Real time is the point (the reaper runs on it): wait until the
        // reaper has expired the sentinel, so has passed every old deadline.
        let out = rt
            .block_on(tokio::time::timeout(Duration::from_secs(10), sentinel))
            .expect("the sentinel expired within 10 s");
        assert!(
            matches!(out, Ok(Completion::Expired(_))),
            "sentinel: {out:?}"
        );
        for (i, ok) in results.into_iter().flatten() {
            let st = refs[i].status();
            if ok {
                assert_eq!(st, OperationStatus::Pending, "op {i}: reset said true");
            } else {
                assert_eq!(st, OperationStatus::Expired, "op {i}: reset said false");
            }
        }
        drop(p.shutdown());
    })
}

/// The public types are `Send`, `Sync` and `Unpin` where their docs and
/// use across tasks need them: handles move between tasks and threads,
/// purgatories and timers are shared, futures are polled by `&mut`.
#[test]
fn public_types_are_send_sync_and_unpin_as_used() {
    struct Quiet;
    impl Operation for Quiet {
        type Output = ();
        fn try_complete(&mut self) -> Option<()> {
            None
        }
        fn on_expiration(self) {}
    }
    fn send<T: Send>() {}
    fn sync<T: Sync>() {}
    fn unpin<T: Unpin>() {}
    send::<Purgatory<u32, Quiet>>();
    sync::<Purgatory<u32, Quiet>>();
    send::<tokio_purgatory::WeakPurgatory<u32, Quiet>>();
    sync::<tokio_purgatory::WeakPurgatory<u32, Quiet>>();
    send::<tokio_purgatory::OperationHandle<u32, Quiet>>();
    unpin::<tokio_purgatory::OperationHandle<u32, Quiet>>();
    send::<tokio_purgatory::OpRef<u32, Quiet>>();
    sync::<tokio_purgatory::OpRef<u32, Quiet>>();
    send::<tokio_purgatory::Timer>();
    sync::<tokio_purgatory::Timer>();
    send::<tokio_purgatory::WeakTimer>();
    sync::<tokio_purgatory::WeakTimer>();
    send::<tokio_purgatory::TaskHandle>();
    sync::<tokio_purgatory::TaskHandle>();
    send::<tokio_purgatory::AsyncTaskHandle>();
    sync::<tokio_purgatory::AsyncTaskHandle>();
    send::<tokio_purgatory::Sleep>();
    sync::<tokio_purgatory::Sleep>();
    unpin::<tokio_purgatory::Sleep>();
    send::<tokio_purgatory::TimeoutFuture<std::future::Ready<()>>>();
    unpin::<tokio_purgatory::TimeoutFuture<std::future::Ready<()>>>();
    send::<tokio_purgatory::Reaper>();
    sync::<tokio_purgatory::Reaper>();
    send::<tokio_purgatory::UnrunTask>();
    send::<tokio_purgatory::BuildError>();
    sync::<tokio_purgatory::BuildError>();
    send::<tokio_purgatory::WatchError<Quiet>>();
    sync::<tokio_purgatory::WatchError<Quiet>>();
    send::<tokio_purgatory::TimerError>();
    sync::<tokio_purgatory::TimerError>();
    send::<tokio_purgatory::ScheduleError<fn()>>();
    // `drain`'s wait, held across an `.await` in a spawned task.
    fn sendable<F: std::future::Future + Send>(_: &F) {}
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let p: Purgatory<u32, Quiet> = Purgatory::builder().build_on(rt.handle()).unwrap();
    sendable(&p.drain());
}

/// Says "not yet", and on the check after `arm` holds at `entered` until
/// `release` (on whichever thread runs it).
struct Holds {
    armed: Arc<AtomicBool>,
    entered: Arc<std::sync::Barrier>,
    release: Arc<std::sync::Barrier>,
}

impl Holds {
    fn new() -> (
        Holds,
        Arc<AtomicBool>,
        Arc<std::sync::Barrier>,
        Arc<std::sync::Barrier>,
    ) {
        let armed = Arc::new(AtomicBool::new(false));
        let entered = Arc::new(std::sync::Barrier::new(2));
        let release = Arc::new(std::sync::Barrier::new(2));
        let op = Holds {
            armed: armed.clone(),
            entered: entered.clone(),
            release: release.clone(),
        };
        (op, armed, entered, release)
    }
}

impl Operation for Holds {
    type Output = ();
    fn try_complete(&mut self) -> Option<()> {
        if self.armed.swap(false, Ordering::SeqCst) {
            self.entered.wait();
            self.release.wait();
        }
        None
    }
    fn on_expiration(self) {}
}

fn nothing_watched<K: tokio_purgatory::WatchKey, O: Operation>(p: &Purgatory<K, O>) {
    let m = p.metrics();
    assert_eq!(m.delayed, 0, "{m:?}");
    assert_eq!((m.watched, m.tombstones, m.keys), (0, 0, 0), "{m:?}");
    assert!(balanced(&m), "{m:?}");
}

/// A cancellation or expiry that arrives while the operation is being
/// checked is left to that check, which carries it out; when that leaves
/// nothing pending, the purge at once follows all the same, and the keys go:
/// a cancel from inside the operation's own check; an expiry, and a handle
/// dropped, while another thread checks it.
#[test]
fn a_finish_left_to_a_running_check_still_purges_when_nothing_is_pending() {
    // Its own check cancels it.
    paused_within(20, || async {
        struct SelfCancel(Arc<OnceLock<tokio_purgatory::OpRef<u32, SelfCancel>>>);
        impl Operation for SelfCancel {
            type Output = ();
            fn try_complete(&mut self) -> Option<()> {
                if let Some(me) = self.0.get() {
                    assert!(me.cancel().is_none(), "left to this check");
                }
                None
            }
            fn on_expiration(self) {}
        }
        let p: Purgatory<u32, SelfCancel> = Purgatory::new();
        let me = Arc::new(OnceLock::new());
        let h = p
            .try_complete_else_watch(SelfCancel(me.clone()), ms(1000), [1, 2])
            .unwrap();
        let r = h.op_ref().unwrap();
        assert!(me.set(r.clone()).is_ok());
        assert!(!r.try_complete());
        assert_eq!(h.await, Err(OperationError::Cancelled));
        nothing_watched(&p);
    });
    // Its expiry, and its handle dropped, while another thread checks it.
    for drop_handle in [false, true] {
        paused_within(20, move || async move {
            let p: Purgatory<u32, Holds> = Purgatory::new();
            let (op, armed, entered, release) = Holds::new();
            let h = p.try_complete_else_watch(op, ms(10), [1, 2]).unwrap();
            let r = h.op_ref().unwrap();
            armed.store(true, Ordering::SeqCst);
            let checker = {
                let r = r.clone();
                std::thread::spawn(move || r.try_complete())
            };
            entered.wait();
            let h = if drop_handle {
                drop(h);
                None
            } else {
                tokio::time::advance(ms(20)).await;
                settle().await;
                Some(h)
            };
            release.wait();
            assert!(!checker.join().unwrap());
            if let Some(h) = h {
                assert_eq!(h.await, Ok(tokio_purgatory::Completion::Expired(())));
            }
            drop(r);
            nothing_watched(&p);
        });
    }
}

/// A registration whose second check cancels one of its own keys: the
/// cancel is left to the registration, which carries it out, and the other
/// key's entry goes with the purge that follows.
#[tokio::test(start_paused = true)]
async fn a_cancel_by_key_during_its_registration_leaves_nothing_watched() {
    struct CancelsKey(Arc<OnceLock<Purgatory<u32, CancelsKey>>>, usize);
    impl Operation for CancelsKey {
        type Output = ();
        fn try_complete(&mut self) -> Option<()> {
            self.1 += 1;
            if self.1 == 2 {
                let p = self.0.get().unwrap();
                assert!(p.cancel_for_key(&1).is_empty(), "left to the registration");
            }
            None
        }
        fn on_expiration(self) {}
    }
    let p: Purgatory<u32, CancelsKey> = Purgatory::new();
    let slot = Arc::new(OnceLock::new());
    assert!(slot.set(p.clone()).is_ok());
    let h = p
        .try_complete_else_watch(CancelsKey(slot.clone(), 0), ms(1000), [1, 2])
        .unwrap();
    assert_eq!(h.await, Err(OperationError::Cancelled));
    nothing_watched(&p);
}

/// `is_finished` says the handle would not wait: it stays false while the
/// thread that completed the operation is still dropping it (user code),
/// and turns true with the outcome.
#[test]
fn is_finished_waits_for_the_outcome() {
    struct SlowDrop {
        ready: Arc<AtomicBool>,
        in_drop: Arc<std::sync::Barrier>,
        go_on: Arc<std::sync::Barrier>,
    }
    impl Operation for SlowDrop {
        type Output = ();
        fn try_complete(&mut self) -> Option<()> {
            self.ready.load(Ordering::SeqCst).then_some(())
        }
        fn on_expiration(self) {}
    }
    impl Drop for SlowDrop {
        fn drop(&mut self) {
            if self.ready.load(Ordering::SeqCst) {
                self.in_drop.wait();
                self.go_on.wait();
            }
        }
    }
    paused_within(20, || async {
        use std::future::Future;
        let p: Purgatory<u32, SlowDrop> = Purgatory::new();
        let in_drop = Arc::new(std::sync::Barrier::new(2));
        let go_on = Arc::new(std::sync::Barrier::new(2));
        let ready = Arc::new(AtomicBool::new(false));
        let op = SlowDrop {
            ready: ready.clone(),
            in_drop: in_drop.clone(),
            go_on: go_on.clone(),
        };
        let mut h = p.try_complete_else_watch(op, ms(1000), [1]).unwrap();
        let r = h.op_ref().unwrap();
        ready.store(true, Ordering::SeqCst);
        let walker = {
            let p = p.clone();
            std::thread::spawn(move || p.try_complete_watched(&1))
        };
        in_drop.wait();
        // Completed (its state says so), its outcome not yet delivered.
        assert!(r.is_finished());
        assert!(!h.is_finished());
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        assert!(std::pin::Pin::new(&mut h).poll(&mut cx).is_pending());
        go_on.wait();
        assert_eq!(walker.join().unwrap(), 1);
        assert!(h.is_finished());
        assert_eq!(h.await, Ok(tokio_purgatory::Completion::Completed(())));
    });
}
