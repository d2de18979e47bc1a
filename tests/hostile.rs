//! User code that fights back: keys, operations, outputs and timer tasks whose
//! `Hash`, `Clone` or `Drop` panic or call back into the crate, and clocks that are
//! not on the tick grid. Each test is named after the promise it pins.
//!
//! Scenarios that deadlocked before they were fixed run on their own thread under
//! a bound (`within`), so a regression fails instead of hanging the suite.

use std::hash::{Hash, Hasher};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::time::{advance, Instant};
use tokio_purgatory::{Completion, Operation, OperationError, Purgatory, Timer, Watch};

mod support;
use support::{balanced, ms, paused_within, settle, within, FlagOp};

type Hook = Arc<dyn Fn() + Send + Sync>;

/// What an operation and its output do, and what they saw happen to them.
#[derive(Clone, Default)]
struct Hooks {
    ready: Arc<AtomicBool>,
    check_panics: Arc<AtomicBool>,
    op_drops: Arc<AtomicUsize>,
    out_drops: Arc<AtomicUsize>,
    op_drop_panics: bool,
    out_drop_panics: bool,
    on_op_drop: Option<Hook>,
    on_out_drop: Option<Hook>,
}

impl Hooks {
    fn set_ready(&self) {
        self.ready.store(true, Ordering::SeqCst);
    }
    fn op_drops(&self) -> usize {
        self.op_drops.load(Ordering::SeqCst)
    }
    fn out_drops(&self) -> usize {
        self.out_drops.load(Ordering::SeqCst)
    }
}

/// An operation whose drop and output can be made hostile.
struct Op(Hooks);

/// Its output.
struct Out(Hooks);

impl Drop for Op {
    fn drop(&mut self) {
        self.0.op_drops.fetch_add(1, Ordering::SeqCst);
        if let Some(h) = &self.0.on_op_drop {
            h();
        }
        if self.0.op_drop_panics && !std::thread::panicking() {
            panic!("hostile operation drop");
        }
    }
}

impl Drop for Out {
    fn drop(&mut self) {
        self.0.out_drops.fetch_add(1, Ordering::SeqCst);
        if let Some(h) = &self.0.on_out_drop {
            h();
        }
        if self.0.out_drop_panics && !std::thread::panicking() {
            panic!("hostile output drop");
        }
    }
}

impl std::fmt::Debug for Out {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Out")
    }
}

impl Operation for Op {
    type Output = Out;
    fn try_complete(&mut self) -> Option<Out> {
        if self.0.check_panics.load(Ordering::SeqCst) {
            panic!("hostile check");
        }
        self.0
            .ready
            .load(Ordering::SeqCst)
            .then(|| Out(self.0.clone()))
    }
    fn on_expiration(self) -> Out {
        Out(self.0.clone())
    }
}

fn purgatory<K: tokio_purgatory::WatchKey>() -> Purgatory<K, Op> {
    Purgatory::builder()
        .name("hostile")
        .purge_interval(1_000_000)
        .build()
        .unwrap()
}

/// Registers `n` plain operations on `key` (a second away); their hooks and handles.
fn plain_ops_on(
    p: &Purgatory<u32, Op>,
    key: u32,
    n: usize,
) -> (Vec<Hooks>, Vec<tokio_purgatory::OperationHandle<u32, Op>>) {
    let hooks: Vec<Hooks> = (0..n).map(|_| Hooks::default()).collect();
    let handles = hooks
        .iter()
        .map(|h| {
            p.try_complete_else_watch(Op(h.clone()), ms(1000), [key])
                .unwrap()
        })
        .collect();
    (hooks, handles)
}

/// A hook that calls back into the purgatory `slot` will hold: walks `key` and
/// reads the metrics (which takes every shard lock in turn).
fn calls_back(slot: &Arc<OnceLock<Purgatory<u32, Op>>>, key: u32) -> Hook {
    let slot = slot.clone();
    Arc::new(move || {
        if let Some(p) = slot.get() {
            p.try_complete_watched(&key);
            let _ = p.metrics();
        }
    })
}

/// A key compared and hashed by its id, whose `Drop` runs `on_drop` (clones
/// share it, so the map's copies do too).
#[derive(Clone)]
struct HookKey {
    id: u32,
    on_drop: Option<Hook>,
}

impl HookKey {
    fn plain(id: u32) -> HookKey {
        HookKey { id, on_drop: None }
    }
}

impl PartialEq for HookKey {
    fn eq(&self, o: &Self) -> bool {
        self.id == o.id
    }
}

impl Eq for HookKey {}

impl Hash for HookKey {
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.id.hash(h);
    }
}

impl Drop for HookKey {
    fn drop(&mut self) {
        if let Some(h) = &self.on_drop {
            h();
        }
    }
}

// ---------------------------------------------------------------------------
// No user drop under a lock of ours.

/// An output left in a finished operation's cell, dropped when a walk of its
/// other key removes the last tombstone, used to be dropped under that key's
/// shard lock: an output whose `Drop` walked the key again deadlocked.
#[test]
fn an_output_dropped_by_a_later_walk_may_call_back_in() {
    paused_within(20, || async {
        let slot = Arc::new(OnceLock::new());
        let p = purgatory::<u32>();
        slot.set(p.clone()).ok();
        let hooks = Hooks {
            on_out_drop: Some(calls_back(&slot, 2)),
            ..Hooks::default()
        };
        let handle = p
            .try_complete_else_watch(Op(hooks.clone()), ms(1000), [1, 2])
            .unwrap();
        hooks.set_ready();
        assert_eq!(p.try_complete_watched(&1), 1);
        drop(handle); // never polled
        p.try_complete_watched(&2);
        assert_eq!(hooks.out_drops(), 1);
        assert_eq!(p.metrics().watched, 0);
        drop(slot);
    });
}

/// The same through the amortised purge, which walks every key.
#[test]
fn an_output_dropped_by_the_purge_may_call_back_in() {
    paused_within(20, || async {
        let slot = Arc::new(OnceLock::new());
        let p: Purgatory<u32, Op> = Purgatory::builder()
            .name("hostile")
            .purge_interval(0)
            .build()
            .unwrap();
        slot.set(p.clone()).ok();
        let hooks = Hooks {
            on_out_drop: Some(calls_back(&slot, 2)),
            ..Hooks::default()
        };
        let handle = p
            .try_complete_else_watch(Op(hooks.clone()), ms(1000), [1, 2])
            .unwrap();
        hooks.set_ready();
        // Completed through its reference: both entries become tombstones.
        assert!(handle.op_ref().unwrap().try_complete());
        drop(handle);
        // Registration purges (tombstones exceed the live entries).
        let other = Hooks::default();
        let h2 = p
            .try_complete_else_watch(Op(other.clone()), ms(1000), [3])
            .unwrap();
        assert_eq!(hooks.out_drops(), 1);
        drop(h2);
        drop(slot);
    });
}

/// A key the map stores is dropped when its list empties; a key whose `Drop`
/// read the metrics deadlocked on the shard lock it was dropped under.
#[test]
fn a_key_dropped_by_the_map_may_call_back_in() {
    paused_within(20, || async {
        let slot: Arc<OnceLock<Purgatory<HookKey, Op>>> = Arc::new(OnceLock::new());
        let p = purgatory::<HookKey>();
        slot.set(p.clone()).ok();
        let reads_metrics: Hook = {
            let slot = slot.clone();
            Arc::new(move || {
                if let Some(p) = slot.get() {
                    let _ = p.metrics();
                }
            })
        };
        let key = |id| HookKey {
            id,
            on_drop: Some(reads_metrics.clone()),
        };
        let a = Hooks::default();
        let b = Hooks::default();
        // A second watch of a key already in the map (the map keeps its own copy).
        let ha = p
            .try_complete_else_watch(Op(a.clone()), ms(100), [key(1), key(2)])
            .unwrap();
        let hb = p
            .try_complete_else_watch(Op(b.clone()), ms(100), [key(1)])
            .unwrap();
        a.set_ready();
        b.set_ready();
        assert_eq!(p.try_complete_watched(&key(1)), 2); // key 1's list empties
        assert!(p.cancel_for_key(&key(2)).is_empty()); // key 2 taken
        assert!(ha.await.unwrap().is_completed());
        assert!(hb.await.unwrap().is_completed());
        assert_eq!(p.metrics().keys, 0);
        // Shutdown drains the map too.
        let c = Hooks::default();
        let hc = p
            .try_complete_else_watch(Op(c.clone()), ms(100), [key(3)])
            .unwrap();
        assert_eq!(p.shutdown().len(), 1);
        assert_eq!(hc.await.unwrap_err(), OperationError::Shutdown);
        drop(slot);
    });
}

// ---------------------------------------------------------------------------
// A dropped handle frees a stored output.

/// An output stored for a handle nobody polls used to stay in the cell until the
/// operation's other keys were walked or purged.
#[tokio::test(start_paused = true)]
async fn dropping_a_never_polled_handle_frees_its_output_at_once() {
    let p = purgatory::<u32>();
    let hooks = Hooks::default();
    let handle = p
        .try_complete_else_watch(Op(hooks.clone()), ms(1000), [1, 2, 3])
        .unwrap();
    hooks.set_ready();
    assert_eq!(p.try_complete_watched(&1), 1);
    assert_eq!(hooks.out_drops(), 0, "stored for the handle");
    drop(handle);
    assert_eq!(hooks.out_drops(), 1, "freed with the handle");

    // The same for an expired operation.
    let late = Hooks::default();
    let handle = p
        .try_complete_else_watch(Op(late.clone()), ms(10), [1, 2, 3])
        .unwrap();
    advance(ms(11)).await;
    settle().await;
    assert!(handle.is_finished());
    assert_eq!(late.out_drops(), 0);
    drop(handle);
    assert_eq!(late.out_drops(), 1);
}

// ---------------------------------------------------------------------------
// A panic in key code during registration leaves no ghost.

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Fault {
    None,
    Hash,
    Clone,
    Eq,
}

/// A key whose `Hash`, `Clone` or `Eq` panics.
#[derive(Debug)]
struct BadKey(u32, Fault);

impl Clone for BadKey {
    fn clone(&self) -> Self {
        if self.1 == Fault::Clone {
            panic!("hostile key clone");
        }
        BadKey(self.0, self.1)
    }
}

impl PartialEq for BadKey {
    fn eq(&self, o: &Self) -> bool {
        if self.1 == Fault::Eq || o.1 == Fault::Eq {
            panic!("hostile key eq");
        }
        self.0 == o.0
    }
}

impl Eq for BadKey {}

impl Hash for BadKey {
    fn hash<H: Hasher>(&self, h: &mut H) {
        if self.1 == Fault::Hash {
            panic!("hostile key hash");
        }
        self.0.hash(h);
    }
}

/// Registration with keys `[good, bad]` used to unwind after the counters were
/// raised and before the timeout was armed: `delayed` stayed 1 forever.
#[tokio::test(start_paused = true)]
async fn a_panicking_key_during_registration_leaves_no_ghost() {
    for fault in [Fault::Hash, Fault::Clone, Fault::Eq] {
        let p = purgatory::<BadKey>();
        let hooks = Hooks::default();
        let r = catch_unwind(AssertUnwindSafe(|| {
            let _ = p.try_complete_else_watch(
                Op(hooks.clone()),
                ms(100),
                [BadKey(1, Fault::None), BadKey(2, fault)],
            );
        }));
        assert!(r.is_err(), "{fault:?}: the key's panic reaches the caller");
        let m = p.metrics();
        assert_eq!(m.delayed, 0, "{fault:?}: {m:?}");
        assert!(balanced(&m), "{fault:?}: {m:?}");
        assert_eq!(hooks.op_drops(), 1, "{fault:?}: the operation was dropped");
        // Nothing of it can complete or expire later.
        hooks.set_ready();
        assert_eq!(p.try_complete_watched(&BadKey(1, Fault::None)), 0);
        advance(ms(200)).await;
        settle().await;
        let m = p.metrics();
        assert_eq!((m.expired, m.completed, m.delayed), (0, 0, 0), "{m:?}");
        assert_eq!(m.watched, 0, "{fault:?}: {m:?}");
        // The purgatory still works.
        let ok = Hooks::default();
        let h = p
            .try_complete_else_watch(Op(ok.clone()), ms(10), [BadKey(1, Fault::None)])
            .unwrap();
        advance(ms(11)).await;
        assert!(h.await.unwrap().is_expired());
    }
}

// ---------------------------------------------------------------------------
// Every drop of a user value is contained, and the handle always resolves.

/// A completed operation whose `Drop` panicked used to leave its handle pending
/// forever and `delayed` at 1 (the drop ran before the outcome was delivered).
#[tokio::test(start_paused = true)]
async fn a_completed_operation_whose_drop_panics_still_resolves_its_handle() {
    let p = purgatory::<u32>();
    let hooks = Hooks {
        op_drop_panics: true,
        ..Hooks::default()
    };
    let handle = p
        .try_complete_else_watch(Op(hooks.clone()), ms(1000), [1])
        .unwrap();
    hooks.set_ready();
    let walked = catch_unwind(AssertUnwindSafe(|| p.try_complete_watched(&1)));
    assert_eq!(walked.ok(), Some(1), "the walk neither panics nor loses it");
    assert!(handle.await.unwrap().is_completed());
    let m = p.metrics();
    assert_eq!(m.delayed, 0);
    assert!(balanced(&m), "{m:?}");
    assert_eq!(m.panicked, 1, "the drop's panic is counted");
}

/// The same when the first check, during registration, completes it: the output
/// used to be lost in the unwinding.
#[tokio::test(start_paused = true)]
async fn an_operation_completed_at_registration_whose_drop_panics_is_delivered() {
    let p = purgatory::<u32>();
    let hooks = Hooks {
        op_drop_panics: true,
        ..Hooks::default()
    };
    hooks.set_ready();
    let r = catch_unwind(AssertUnwindSafe(|| {
        p.try_complete_else_watch(Op(hooks.clone()), ms(1000), [1])
    }));
    let handle = r.expect("no panic reaches the caller").unwrap();
    let out = handle.await.unwrap();
    assert!(out.is_completed());
    drop(out);
    assert_eq!(hooks.out_drops(), 1);
    let m = p.metrics();
    assert!(balanced(&m) && m.delayed == 0, "{m:?}");
}

/// Cancelling by key used to unwind half-way when dropping a tombstone ran a
/// panicking output `Drop`: the operations already cancelled were lost (their
/// handles said `Cancelled`, yet they were neither handed back nor dropped).
#[tokio::test(start_paused = true)]
async fn a_panicking_drop_inside_cancel_for_key_loses_nothing() {
    let p = purgatory::<u32>();
    let bad = Hooks {
        out_drop_panics: true,
        ..Hooks::default()
    };
    let hb = p
        .try_complete_else_watch(Op(bad.clone()), ms(1000), [1, 2])
        .unwrap();
    bad.set_ready();
    assert_eq!(p.try_complete_watched(&1), 1);
    let (_, handles) = plain_ops_on(&p, 2, 3);
    drop(hb); // its output's drop panics (contained)
    let back = catch_unwind(AssertUnwindSafe(|| p.cancel_for_key(&2)))
        .expect("no panic reaches the caller");
    assert_eq!(back.len(), 3, "every pending operation is handed back");
    for h in handles {
        assert_eq!(h.await.unwrap_err(), OperationError::Cancelled);
    }
    drop(back);
    let m = p.metrics();
    assert!(balanced(&m) && m.delayed == 0, "{m:?}");
    assert_eq!(m.watched, 0, "{m:?}");
}

/// A walk whose tombstone's drop panics still checks every live operation.
#[tokio::test(start_paused = true)]
async fn a_panicking_drop_inside_a_walk_leaves_it_whole() {
    let p = purgatory::<u32>();
    let bad = Hooks {
        out_drop_panics: true,
        op_drop_panics: true,
        ..Hooks::default()
    };
    let hb = p
        .try_complete_else_watch(Op(bad.clone()), ms(1000), [1, 2])
        .unwrap();
    bad.set_ready();
    assert!(hb.op_ref().unwrap().try_complete());
    drop(hb);
    let (good, handles) = plain_ops_on(&p, 2, 4);
    for h in &good {
        h.set_ready();
    }
    let walked = catch_unwind(AssertUnwindSafe(|| p.try_complete_watched(&2)));
    assert_eq!(walked.ok(), Some(4));
    for h in handles {
        assert!(h.await.unwrap().is_completed());
    }
    let m = p.metrics();
    assert!(balanced(&m) && m.delayed == 0, "{m:?}");
}

/// Dropping the last purgatory clone drops every pending operation, each drop
/// contained: one that panics does not stop the others.
#[tokio::test(start_paused = true)]
async fn dropping_the_purgatory_contains_panicking_operation_drops() {
    let p = purgatory::<u32>();
    let bad = Hooks {
        op_drop_panics: true,
        ..Hooks::default()
    };
    let good = Hooks::default();
    let h1 = p
        .try_complete_else_watch(Op(bad.clone()), ms(1000), [1])
        .unwrap();
    let h2 = p
        .try_complete_else_watch(Op(good.clone()), ms(1000), [1])
        .unwrap();
    let h3 = p
        .try_complete_else_watch(Op(good.clone()), ms(1000), [2])
        .unwrap();
    let dropped = catch_unwind(AssertUnwindSafe(|| drop(p)));
    assert!(dropped.is_ok(), "no panic reaches the caller");
    assert_eq!(bad.op_drops() + good.op_drops(), 3);
    for h in [h1, h2, h3] {
        assert_eq!(h.await.unwrap_err(), OperationError::Shutdown);
    }
}

/// A handle dropped while its operation is pending drops the operation: a
/// panicking drop stays inside.
#[tokio::test(start_paused = true)]
async fn dropping_a_handle_contains_a_panicking_operation_drop() {
    let p = purgatory::<u32>();
    let bad = Hooks {
        op_drop_panics: true,
        ..Hooks::default()
    };
    let h = p
        .try_complete_else_watch(Op(bad.clone()), ms(1000), [1])
        .unwrap();
    assert!(catch_unwind(AssertUnwindSafe(|| drop(h))).is_ok());
    assert_eq!(bad.op_drops(), 1);
    let m = p.metrics();
    assert_eq!((m.delayed, m.cancelled, m.panicked), (0, 1, 1), "{m:?}");
}

/// Operation and output drops may call back into the purgatory (walk a key,
/// register, read metrics) wherever the crate drops them.
#[test]
fn operation_and_output_drops_may_call_back_in_everywhere() {
    paused_within(20, || async {
        let slot = Arc::new(OnceLock::new());
        let p = purgatory::<u32>();
        slot.set(p.clone()).ok();
        let hooks = || Hooks {
            on_op_drop: Some(calls_back(&slot, 9)),
            on_out_drop: Some(calls_back(&slot, 9)),
            ..Hooks::default()
        };
        // Completed by a walk, by reference, at registration; expired;
        // cancelled by key, by handle; shut down.
        let a = hooks();
        let ha = p
            .try_complete_else_watch(Op(a.clone()), ms(50), [1, 9])
            .unwrap();
        let b = hooks();
        let hb = p
            .try_complete_else_watch(Op(b.clone()), ms(50), [2, 9])
            .unwrap();
        let c = hooks();
        c.set_ready();
        let hc = p
            .try_complete_else_watch(Op(c.clone()), ms(50), [3])
            .unwrap();
        let d = hooks();
        let hd = p
            .try_complete_else_watch(Op(d.clone()), ms(5), [4, 9])
            .unwrap();
        let e = hooks();
        let he = p
            .try_complete_else_watch(Op(e.clone()), ms(50), [5, 9])
            .unwrap();
        let f = hooks();
        let hf = p
            .try_complete_else_watch(Op(f.clone()), ms(50), [6, 9])
            .unwrap();
        let g = hooks();
        let hg = p
            .try_complete_else_watch(Op(g.clone()), ms(50), [7, 9])
            .unwrap();
        a.set_ready();
        assert_eq!(p.try_complete_watched(&1), 1);
        b.set_ready();
        assert!(hb.op_ref().unwrap().try_complete());
        advance(ms(6)).await;
        settle().await;
        assert_eq!(p.cancel_for_key(&5).len(), 1);
        drop(hf);
        assert_eq!(p.shutdown().len(), 1);
        for h in [ha, hb, hc, hd] {
            drop(h.await.unwrap());
        }
        assert_eq!(he.await.unwrap_err(), OperationError::Cancelled);
        assert_eq!(hg.await.unwrap_err(), OperationError::Shutdown);
        for x in [&a, &b, &c, &d, &e, &f, &g] {
            assert_eq!(x.op_drops(), 1);
        }
        for x in [&a, &b, &c, &d] {
            assert_eq!(x.out_drops(), 1);
        }
        drop(slot);
    });
}

// ---------------------------------------------------------------------------
// Timer tasks: drops contained.

/// A task whose `Drop` panics: cancelling it, and dropping the timer with it
/// pending, used to unwind into the caller.
#[tokio::test(start_paused = true)]
async fn timer_task_drops_are_contained() {
    struct PanicOnDrop(Arc<AtomicUsize>);
    impl Drop for PanicOnDrop {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
            if !std::thread::panicking() {
                panic!("hostile task drop");
            }
        }
    }
    let drops = Arc::new(AtomicUsize::new(0));
    let timer = Timer::new();
    let t = PanicOnDrop(drops.clone());
    let timeout = timer
        .schedule(ms(100), move || {
            let _kept = &t;
        })
        .unwrap();
    let cancelled = catch_unwind(AssertUnwindSafe(|| timeout.cancel()));
    assert_eq!(cancelled.ok(), Some(true));
    assert_eq!(drops.load(Ordering::SeqCst), 1);

    let t = PanicOnDrop(drops.clone());
    timer
        .schedule(ms(100), move || {
            let _kept = &t;
        })
        .unwrap();
    let ran = Arc::new(AtomicBool::new(false));
    let r = ran.clone();
    let later = timer.clone();
    assert!(catch_unwind(AssertUnwindSafe(|| drop(timer))).is_ok());
    // The last clone goes: the task is dropped unrun, contained.
    drop(later);
    assert_eq!(drops.load(Ordering::SeqCst), 2);
    assert!(!r.load(Ordering::SeqCst));
}

// ---------------------------------------------------------------------------
// Zero and past deadlines off the tick grid.

/// At 300 µs past a tick boundary, a zero delay, a deadline 100 µs in the past
/// and a zero sleep used to wait for the next tick (a deadline rounds up, "now"
/// rounds down). They run on the reaper's next turn, with no time passing.
#[tokio::test(start_paused = true)]
async fn zero_and_past_deadlines_off_the_tick_grid_run_at_once() {
    let timer = Timer::new();
    advance(Duration::from_micros(300)).await;
    let t0 = Instant::now();
    timer.sleep(Duration::ZERO).await.unwrap();
    assert_eq!(Instant::now(), t0, "sleep(ZERO) waited for a tick");

    let ran = Arc::new(AtomicUsize::new(0));
    let r = ran.clone();
    timer
        .schedule(Duration::ZERO, move || {
            r.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
    let r = ran.clone();
    timer
        .schedule_at(t0 - Duration::from_micros(100), move || {
            r.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
    timer.sleep_until(t0).await.unwrap();
    settle().await;
    assert_eq!(ran.load(Ordering::SeqCst), 2);
    assert_eq!(Instant::now(), t0, "past deadlines waited for a tick");

    // The purgatory: a zero timeout expires on the reaper's next turn.
    let p = purgatory::<u32>();
    advance(Duration::from_micros(300)).await;
    let t1 = Instant::now();
    let h = p
        .try_complete_else_watch(Op(Hooks::default()), Duration::ZERO, [1])
        .unwrap();
    assert!(h.await.unwrap().is_expired());
    assert_eq!(Instant::now(), t1, "a zero timeout waited for a tick");
}

/// A future deadline off the grid still never fires early.
#[tokio::test(start_paused = true)]
async fn a_deadline_off_the_grid_is_never_early() {
    let timer = Timer::new();
    advance(Duration::from_micros(300)).await;
    let t0 = Instant::now();
    for us in [1, 200, 699, 700, 701, 1500] {
        let at = t0 + Duration::from_micros(us);
        timer.sleep_until(at).await.unwrap();
        assert!(Instant::now() >= at, "{us} µs: fired early");
    }
}

/// Ticks of every shape: ones that divide a second (converted by a
/// reciprocal multiply) and ones that do not (3 ms, 7 ms, a prime number of
/// nanoseconds, 1.5 ms; converted by division). Whatever the tick, a deadline
/// off its grid, near or a second or more out (so the whole-seconds part of
/// the conversion counts), fires no earlier than asked, and late by less than
/// a tick plus the 2 ms Tokio's timer may add to the reaper's sleep (its
/// millisecond rounding, and whole-millisecond parks from an off-grid clock);
/// a zero delay off the grid runs with no time passing.
#[tokio::test(start_paused = true)]
async fn every_tick_shape_is_never_early_and_late_by_at_most_a_tick_and_tokios_rounding() {
    for tick in [
        Duration::from_micros(100),
        ms(1),
        Duration::from_micros(1_500),
        ms(3),
        ms(7),
        Duration::from_nanos(999_983),
        ms(250),
    ] {
        let timer = Timer::builder().tick(tick).build().unwrap();
        advance(Duration::from_micros(1_234)).await;
        let t0 = Instant::now();
        for us in [1, 999, 1_001, 2_999, 1_000_000, 1_000_001, 2_345_678] {
            let at = t0 + Duration::from_micros(us);
            timer.sleep_until(at).await.unwrap();
            let now = Instant::now();
            assert!(now >= at, "tick {tick:?}, {us} µs: fired early");
            assert!(
                now - at < tick + ms(2),
                "tick {tick:?}, {us} µs: {:?} late",
                now - at
            );
        }
        let t1 = Instant::now();
        timer.sleep(Duration::ZERO).await.unwrap();
        assert_eq!(Instant::now(), t1, "tick {tick:?}: a zero delay waited");
    }
}

// ---------------------------------------------------------------------------
// One wake-up per distinct due time.

/// A heartbeat that schedules its next beat from inside its own run used to
/// cost two reaper wake-ups per beat: the insert during the reaper's turn left a
/// notification, so the reaper woke at once with nothing due.
#[tokio::test(start_paused = true)]
async fn a_task_that_reschedules_itself_costs_one_wakeup_per_beat() {
    fn beat(timer: Timer, beats: Arc<AtomicUsize>, left: usize) {
        beats.fetch_add(1, Ordering::SeqCst);
        if left > 0 {
            let t = timer.clone();
            timer
                .schedule(ms(100), move || beat(t, beats, left - 1))
                .unwrap();
        }
    }
    let timer = Timer::new();
    let beats = Arc::new(AtomicUsize::new(0));
    let (t, b) = (timer.clone(), beats.clone());
    timer.schedule(ms(100), move || beat(t, b, 99)).unwrap();
    let before = timer.metrics().reaper_wakeups;
    tokio::time::sleep(Duration::from_secs(11)).await;
    assert_eq!(beats.load(Ordering::SeqCst), 100);
    let wakeups = timer.metrics().reaper_wakeups - before;
    assert!(
        wakeups <= 101,
        "{wakeups} reaper wake-ups for 100 beats (one per beat expected)"
    );
}

// ---------------------------------------------------------------------------
// A check that panics, and expiry with hostile values.

/// A panicking check counts as "not yet": the operation still expires, and its
/// panicking output drop (after the handle read it) stays with the reader.
#[tokio::test(start_paused = true)]
async fn a_panicking_check_still_expires_and_balances() {
    let p = purgatory::<u32>();
    let hooks = Hooks::default();
    hooks.check_panics.store(true, Ordering::SeqCst);
    let r = catch_unwind(AssertUnwindSafe(|| {
        p.try_complete_else_watch(Op(hooks.clone()), ms(10), [1])
    }));
    let h = r.expect("a check's panic is contained").unwrap();
    assert_eq!(p.try_complete_watched(&1), 0);
    advance(ms(11)).await;
    let out = h.await.unwrap();
    assert!(matches!(out, Completion::Expired(_)));
    let m = p.metrics();
    assert!(balanced(&m) && m.delayed == 0, "{m:?}");
    assert_eq!(m.panicked, 3, "two at registration, one in the walk");
}

/// A detached operation's output is dropped as soon as it is produced, whether
/// by a check or by expiry: nobody will read it.
#[tokio::test(start_paused = true)]
async fn a_detached_operations_output_is_dropped_at_once() {
    let p = purgatory::<u32>();
    let done = Hooks::default();
    p.try_complete_else_watch(Op(done.clone()), ms(1000), [1, 2])
        .unwrap()
        .detach();
    done.set_ready();
    assert_eq!(p.try_complete_watched(&1), 1);
    assert_eq!(done.out_drops(), 1, "completed: dropped by the walk");

    let late = Hooks::default();
    p.try_complete_else_watch(Op(late.clone()), ms(10), [1, 2])
        .unwrap()
        .detach();
    advance(ms(11)).await;
    settle().await;
    assert_eq!(late.out_drops(), 1, "expired: dropped by the reaper");
    let m = p.metrics();
    assert!(balanced(&m) && m.delayed == 0, "{m:?}");
}

/// A key whose `Drop` panics, dropped by the crate (the map's copy when its list
/// empties, a duplicate at registration): contained and counted; the call that
/// dropped it finishes its work.
#[tokio::test(start_paused = true)]
async fn a_panicking_key_drop_is_contained() {
    let grenade = || HookKey {
        id: 7,
        on_drop: Some(Arc::new(|| {
            if !std::thread::panicking() {
                panic!("hostile key drop");
            }
        })),
    };
    let p = purgatory::<HookKey>();
    let a = Hooks::default();
    // A duplicate key 7 is dropped at registration.
    let ha = catch_unwind(AssertUnwindSafe(|| {
        p.try_complete_else_watch(Op(a.clone()), ms(100), [grenade(), grenade()])
    }))
    .expect("a duplicate's drop is contained")
    .unwrap();
    a.set_ready();
    // The walk empties key 7's list: the map's copy is dropped.
    let walked = catch_unwind(AssertUnwindSafe(|| {
        p.try_complete_watched(&HookKey::plain(1))
    }));
    assert_eq!(walked.ok(), Some(0));
    // A probe without the hook: the test's own key is not the crate's to drop.
    let walked = catch_unwind(AssertUnwindSafe(|| {
        p.try_complete_watched(&HookKey::plain(7))
    }));
    assert_eq!(walked.ok(), Some(1), "the walk finished its work");
    assert!(ha.await.unwrap().is_completed());
    let m = p.metrics();
    assert_eq!((m.keys, m.watched, m.delayed), (0, 0, 0), "{m:?}");
    assert!(m.panicked >= 2, "both drops counted: {m:?}");
}

/// A panic payload whose own `Drop` panics (`std::panic::panic_any` takes any
/// type): dropping it after the catch would unwind again, past the
/// bookkeeping that follows the catch.
struct PayloadBomb;

impl Drop for PayloadBomb {
    fn drop(&mut self) {
        panic!("the payload's drop panicked too");
    }
}

/// Its checks and its expiry panic with a [`PayloadBomb`].
struct BombOp;

impl Operation for BombOp {
    type Output = ();
    fn try_complete(&mut self) -> Option<()> {
        std::panic::panic_any(PayloadBomb)
    }
    fn on_expiration(self) {
        std::panic::panic_any(PayloadBomb)
    }
}

/// Checks at registration, checks run by a walk and an expiry that panic with a
/// payload whose drop panics: each panic is contained and counted, the
/// operation still expires, its handle resolves, and the counts balance.
#[tokio::test(start_paused = true)]
async fn a_panic_payload_whose_drop_panics_is_contained_in_checks_and_expiry() {
    let p: Purgatory<u32, BombOp> = Purgatory::builder().name("bombs").build().unwrap();
    let h = p.try_complete_else_watch(BombOp, ms(10), [1]).unwrap();
    // Registration checks twice: before watching, and once watched.
    assert_eq!(p.metrics().panicked, 2, "the checks at registration");
    assert_eq!(p.try_complete_watched(&1), 0);
    assert_eq!(p.metrics().panicked, 3, "the walk's check");
    assert_eq!(p.delayed(), 1, "still pending after two panicking checks");
    advance(ms(11)).await;
    settle().await;
    assert_eq!(h.await, Err(OperationError::Panicked));
    let m = p.metrics();
    assert_eq!(m.panicked, 4, "{m:?}");
    assert_eq!(m.delayed, 0);
    assert!(balanced(&m), "{m:?}");
}

/// A timer task panicking with such a payload: the reaper goes on, and later
/// tasks run.
#[tokio::test(start_paused = true)]
async fn a_timer_task_whose_panic_payload_panics_on_drop_stops_nothing() {
    let timer = Timer::new();
    let ran = Arc::new(AtomicUsize::new(0));
    timer
        .schedule(ms(5), || std::panic::panic_any(PayloadBomb))
        .unwrap();
    let r = ran.clone();
    timer
        .schedule(ms(5), move || {
            r.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
    let r = ran.clone();
    timer
        .schedule(ms(20), move || {
            r.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
    advance(ms(25)).await;
    settle().await;
    assert_eq!(ran.load(Ordering::SeqCst), 2);
    assert_eq!(timer.metrics().panicked, 1);
    assert_eq!(timer.len(), 0);
}

/// An operation that never completes by itself.
struct Plain;

impl Operation for Plain {
    type Output = ();
    fn try_complete(&mut self) -> Option<()> {
        None
    }
    fn on_expiration(self) {}
}

/// A key whose `Hash` or `Eq` may panic, and whose `Drop` may panic too.
#[derive(Clone)]
struct Volatile {
    id: u32,
    hash_panics: bool,
    eq_panics: bool,
    drop_panics: bool,
}

impl Volatile {
    fn new(id: u32) -> Volatile {
        Volatile {
            id,
            hash_panics: false,
            eq_panics: false,
            drop_panics: false,
        }
    }
}

impl Hash for Volatile {
    fn hash<H: Hasher>(&self, h: &mut H) {
        assert!(!self.hash_panics, "hostile hash");
        self.id.hash(h);
    }
}

impl PartialEq for Volatile {
    fn eq(&self, o: &Self) -> bool {
        assert!(!(self.eq_panics || o.eq_panics), "hostile eq");
        self.id == o.id
    }
}

impl Eq for Volatile {}

impl Drop for Volatile {
    fn drop(&mut self) {
        if self.drop_panics && !std::thread::panicking() {
            panic!("hostile drop");
        }
    }
}

/// Key code panicking while a registration takes its keys in, with keys
/// whose `Drop` panics among them: the keys are dropped (each drop
/// contained and counted) before the panic reaches the caller, not while it
/// unwinds, and nothing is registered. The `Drop` above stays quiet during an
/// unwind only so that a regression fails this test instead of aborting the
/// whole test binary; the purgatory must not rely on it: it counts the drop
/// panics it contained.
#[tokio::test(start_paused = true)]
async fn key_code_panicking_beside_keys_whose_drop_panics_is_contained() {
    let p: Purgatory<Volatile, Plain> = Purgatory::new();
    let loud = |id| Volatile {
        drop_panics: true,
        ..Volatile::new(id)
    };
    // `Hash` panics on the third key, past two loud ones.
    let keys = vec![
        loud(1),
        loud(2),
        Volatile {
            hash_panics: true,
            ..Volatile::new(3)
        },
        loud(4),
    ];
    let r = catch_unwind(AssertUnwindSafe(|| {
        let _ = p.try_complete_else_watch(Plain, ms(10), keys);
    }));
    assert!(r.is_err(), "the hash's panic reaches the caller");
    assert_eq!(p.metrics().panicked, 3, "three loud drops, each contained");
    // `Eq` panics while duplicates are looked for.
    let keys = vec![
        loud(5),
        Volatile {
            eq_panics: true,
            ..Volatile::new(6)
        },
    ];
    let r = catch_unwind(AssertUnwindSafe(|| {
        let _ = p.try_complete_else_watch(Plain, ms(10), keys);
    }));
    assert!(r.is_err(), "the eq's panic reaches the caller");
    assert_eq!(p.metrics().panicked, 4);
    // Past 16 keys, and at levels.
    let mut many: Vec<Volatile> = (10..40).map(loud).collect();
    many[20].hash_panics = true;
    let r = catch_unwind(AssertUnwindSafe(|| {
        let _ = p.try_complete_else_watch(Plain, ms(10), many);
    }));
    assert!(r.is_err());
    assert_eq!(
        p.metrics().panicked,
        4 + 30,
        "every loud key, the hostile one too"
    );
    let watches = vec![
        Watch::level(loud(50), 1),
        Watch::level(
            Volatile {
                hash_panics: true,
                ..Volatile::new(51)
            },
            2,
        ),
        Watch::key(loud(52)),
    ];
    let r = catch_unwind(AssertUnwindSafe(|| {
        let _ = p.try_complete_else_watch_levels(Plain, ms(10), watches);
    }));
    assert!(r.is_err());
    assert_eq!(p.metrics().panicked, 4 + 30 + 2);
    let m = p.metrics();
    assert_eq!((m.delayed, m.watched, m.registered), (0, 0, 0), "{m:?}");
}

/// `OpRef::update` from several threads racing checks loses no change, and a
/// panic in the closure reaches its caller and leaves the operation
/// registered with what it changed.
#[test]
fn updates_racing_checks_lose_nothing_and_a_panicking_update_leaves_it_pending() {
    struct Sum {
        total: u64,
        due: u64,
    }
    impl tokio_purgatory::Operation for Sum {
        type Output = u64;
        fn try_complete(&mut self) -> Option<u64> {
            (self.total >= self.due).then_some(self.total)
        }
        fn on_expiration(self) -> u64 {
            self.total
        }
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_time()
        .build()
        .unwrap();
    rt.block_on(async {
        let p: tokio_purgatory::Purgatory<u32, Sum> = tokio_purgatory::Purgatory::new();
        let h = p
            .try_complete_else_watch(
                Sum {
                    total: 0,
                    due: 4000,
                },
                std::time::Duration::from_secs(60),
                [1],
            )
            .unwrap();
        let op = h.op_ref().unwrap();
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            op.update(|s| {
                s.total += 1;
                panic!("in the update");
            })
        }));
        assert!(panicked.is_err());
        assert!(!op.is_finished());
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let op = op.clone();
                let p = p.clone();
                std::thread::spawn(move || {
                    for _ in 0..1000 {
                        if op.update(|s| s.total += 1).is_none() {
                            break;
                        }
                        p.try_complete_watched(&1);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        // 4000 updates are needed past the one from the panicking update:
        // the last one makes the check say done, whichever thread ran it.
        let out = h.await.unwrap();
        assert!(
            matches!(out, tokio_purgatory::Completion::Completed(n) if n >= 4000),
            "{out:?}"
        );
        assert_eq!(op.update(|s| s.total), None);
    });
}

/// An operation that waits for its timeout.
struct Waits;

impl Operation for Waits {
    type Output = &'static str;
    fn try_complete(&mut self) -> Option<&'static str> {
        None
    }
    fn on_expiration(self) -> &'static str {
        "expired"
    }
}

thread_local! {
    /// What the raw waker below runs when it is cloned.
    static ON_CLONE: std::cell::RefCell<Option<Box<dyn Fn()>>> = const { std::cell::RefCell::new(None) };
}

/// A waker built from a raw vtable whose `clone` runs `ON_CLONE`: user code
/// that the crate runs when it keeps the waker of a pending handle.
fn waker_calling_back() -> std::task::Waker {
    use std::task::{RawWaker, RawWakerVTable, Waker};
    fn clone(_: *const ()) -> RawWaker {
        ON_CLONE.with(|hook| {
            if let Some(hook) = hook.borrow().as_ref() {
                hook();
            }
        });
        RawWaker::new(std::ptr::null(), &VTABLE)
    }
    fn noop(_: *const ()) {}
    static VTABLE: RawWakerVTable = RawWakerVTable::new(clone, noop, noop, noop);
    // SAFETY: every function of the vtable ignores the (null) data pointer.
    unsafe { Waker::from_raw(RawWaker::new(std::ptr::null(), &VTABLE)) }
}

#[test]
fn a_waker_whose_clone_resets_its_own_operation_does_not_deadlock() {
    paused_within(10, || async {
        let p: Purgatory<u32, Waits> = Purgatory::builder().name("waker").build().unwrap();
        let start = Instant::now();
        let mut handle = p
            .try_complete_else_watch(Waits, Duration::from_secs(1), [1])
            .unwrap();
        let r = handle.op_ref().expect("pending");
        let resets = Arc::new(AtomicUsize::new(0));
        let seen = resets.clone();
        ON_CLONE.with(|hook| {
            *hook.borrow_mut() = Some(Box::new(move || {
                // The handle's poll is keeping this waker: move the timeout.
                assert!(r.reset(Duration::from_secs(5)), "the reset takes effect");
                seen.fetch_add(1, Ordering::SeqCst);
            }));
        });
        let waker = waker_calling_back();
        let mut cx = std::task::Context::from_waker(&waker);
        assert!(std::future::Future::poll(std::pin::Pin::new(&mut handle), &mut cx).is_pending());
        assert_eq!(resets.load(Ordering::SeqCst), 1, "the waker was kept once");
        ON_CLONE.with(|hook| *hook.borrow_mut() = None);
        let out = handle.await;
        assert_eq!(out, Ok(Completion::Expired("expired")));
        assert!(
            Instant::now() >= start + Duration::from_secs(5),
            "expired at the reset deadline"
        );
    });
}

/// A purgatory of flag operations named `name`, and the flag they share
/// (inside a runtime).
fn flagged(name: &str) -> (Purgatory<u32, FlagOp>, Arc<AtomicBool>) {
    let p = Purgatory::builder().name(name).build().unwrap();
    (p, Arc::new(AtomicBool::new(false)))
}

/// Registers a flag operation on key 1, a second away.
fn watch_flag(
    p: &Purgatory<u32, FlagOp>,
    ready: &Arc<AtomicBool>,
) -> tokio_purgatory::OperationHandle<u32, FlagOp> {
    p.try_complete_else_watch(FlagOp(ready.clone()), Duration::from_secs(1), [1])
        .unwrap()
}

/// A waker built from a raw vtable whose `wake` (or, with `DROP_PANICS`, its
/// `Drop`) panics.
fn waker_panicking_on_wake() -> std::task::Waker {
    use std::task::{RawWaker, RawWakerVTable, Waker};
    fn clone(_: *const ()) -> RawWaker {
        RawWaker::new(std::ptr::null(), &VTABLE)
    }
    fn wake(_: *const ()) {
        panic!("hostile wake");
    }
    fn drop_it(_: *const ()) {
        if DROP_PANICS.with(|d| d.get()) {
            panic!("hostile waker drop");
        }
    }
    static VTABLE: RawWakerVTable = RawWakerVTable::new(clone, wake, wake, drop_it);
    // SAFETY: every function of the vtable ignores the (null) data pointer.
    unsafe { Waker::from_raw(RawWaker::new(std::ptr::null(), &VTABLE)) }
}

thread_local! {
    /// Whether the waker above panics when dropped.
    static DROP_PANICS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// A walk completes several operations and wakes their handles: one whose
/// waker panics in `wake` does not keep the walk from checking and
/// completing the others, and its own outcome is delivered too.
#[test]
fn a_waker_that_panics_on_wake_during_a_walk_leaves_the_others_finished() {
    paused_within(10, || async {
        let (p, ready) = flagged("wake");
        let mut handles: Vec<_> = (0..4).map(|_| watch_flag(&p, &ready)).collect();
        let waker = waker_panicking_on_wake();
        let mut cx = std::task::Context::from_waker(&waker);
        for h in &mut handles[..2] {
            assert!(std::future::Future::poll(std::pin::Pin::new(h), &mut cx).is_pending());
        }
        ready.store(true, Ordering::SeqCst);
        assert_eq!(p.try_complete_watched(&1), 4, "every one completed");
        assert_eq!(p.metrics().panicked, 2, "both wakes caught");
        assert_eq!(p.delayed(), 0);
        for h in handles {
            assert_eq!(h.await, Ok(Completion::Completed(())));
        }
    });
}

/// A handle kept a waker whose `Drop` panics: detaching the handle drops the
/// waker, and the panic is contained there; the operation goes on and
/// completes.
#[test]
fn a_waker_that_panics_on_drop_is_contained_when_the_handle_detaches() {
    paused_within(10, || async {
        let (p, ready) = flagged("drop");
        let mut h = watch_flag(&p, &ready);
        let r = h.op_ref().unwrap();
        let waker = waker_panicking_on_wake();
        let mut cx = std::task::Context::from_waker(&waker);
        assert!(std::future::Future::poll(std::pin::Pin::new(&mut h), &mut cx).is_pending());
        DROP_PANICS.with(|d| d.set(true));
        h.detach();
        DROP_PANICS.with(|d| d.set(false));
        assert_eq!(p.metrics().panicked, 1, "the waker's drop was caught");
        ready.store(true, Ordering::SeqCst);
        assert!(r.try_complete());
        assert_eq!(p.delayed(), 0);
        drop(waker);
    });
}

/// A task waits in `drain()` with a waker whose `wake` panics: the finish that
/// wakes it is not cut short (the operation's outcome is delivered, and the
/// walk goes on to the other operations), the panic is counted, and the drain
/// still ends.
#[test]
fn a_drain_waker_that_panics_on_wake_cuts_no_finish_short() {
    paused_within(10, || async {
        let (p, ready) = flagged("drain");
        let handles: Vec<_> = (0..3).map(|_| watch_flag(&p, &ready)).collect();
        let mut drain = Box::pin(p.drain());
        let waker = waker_panicking_on_wake();
        let mut cx = std::task::Context::from_waker(&waker);
        assert!(std::future::Future::poll(drain.as_mut(), &mut cx).is_pending());
        ready.store(true, Ordering::SeqCst);
        assert_eq!(p.try_complete_watched(&1), 3, "every one completed");
        assert!(p.metrics().panicked >= 1, "the drainer's wake was caught");
        assert_eq!(p.delayed(), 0);
        for h in handles {
            assert_eq!(h.await, Ok(Completion::Completed(())));
        }
        drain.await;
    });
}

/// A sleep waits with a waker whose `wake` panics when the timer shuts down:
/// the shutdown still hands back every unrun task and tells every other
/// sleep, and the panic is counted.
#[test]
fn a_sleep_waker_that_panics_on_wake_cuts_no_shutdown_short() {
    paused_within(10, || async {
        let timer = Timer::new();
        let ran = Arc::new(AtomicUsize::new(0));
        for _ in 0..2 {
            let ran = ran.clone();
            timer
                .schedule(Duration::from_secs(1), move || {
                    ran.fetch_add(1, Ordering::SeqCst);
                })
                .unwrap();
        }
        let mut hostile = Box::pin(timer.sleep(Duration::from_secs(1)));
        let waker = waker_panicking_on_wake();
        let mut cx = std::task::Context::from_waker(&waker);
        assert!(std::future::Future::poll(hostile.as_mut(), &mut cx).is_pending());
        let other = timer.sleep(Duration::from_secs(1));
        let unrun = timer.shutdown();
        assert_eq!(unrun.len(), 2, "both tasks handed back");
        assert_eq!(timer.metrics().panicked, 1, "the wake was caught");
        assert!(other.await.is_err(), "the other sleep was told");
        for t in unrun {
            t.run();
        }
        assert_eq!(ran.load(Ordering::SeqCst), 2);
        drop(hostile);
    });
}

/// An operation done at its first check gives a ready handle holding its
/// output: however that handle goes without being awaited, an output whose
/// `Drop` panics is dropped contained (counted, not raised).
#[tokio::test(start_paused = true)]
async fn an_output_that_panics_on_drop_is_contained_when_a_ready_handle_goes() {
    let p = purgatory::<u32>();
    let ready = || {
        let hooks = Hooks {
            out_drop_panics: true,
            ..Hooks::default()
        };
        hooks.set_ready();
        let h = p
            .try_complete_else_watch(Op(hooks.clone()), ms(100), [1])
            .unwrap();
        assert!(h.is_finished(), "done at the first check");
        (hooks, h)
    };
    let (a, h) = ready();
    drop(h);
    let (b, h) = ready();
    h.detach();
    let (c, h) = ready();
    assert!(h.cancel().is_none(), "nothing left to cancel");
    let (d, h) = ready();
    assert!(h.into_op_ref().is_none(), "nothing left to reference");
    for hooks in [a, b, c, d] {
        assert_eq!(hooks.out_drops(), 1, "each output dropped once");
    }
    let m = p.metrics();
    assert_eq!(m.panicked, 4, "each drop caught: {m:?}");
    assert_eq!(m.completed, 4, "{m:?}");
}

/// A handle polled again with another waker replaces the first, which is
/// dropped; polled again with the same one, the clone made for it is not
/// needed and is dropped. A waker whose `Drop` panics there is contained, and
/// the outcome is still read.
#[test]
fn a_waker_that_panics_on_drop_in_a_poll_loses_no_outcome() {
    paused_within(10, || async {
        let (p, ready) = flagged("poll");
        let mut h = watch_flag(&p, &ready);
        let hostile = waker_panicking_on_wake();
        let mut cx = std::task::Context::from_waker(&hostile);
        assert!(std::future::Future::poll(std::pin::Pin::new(&mut h), &mut cx).is_pending());
        DROP_PANICS.with(|d| d.set(true));
        // The same waker: the spare clone is dropped.
        assert!(std::future::Future::poll(std::pin::Pin::new(&mut h), &mut cx).is_pending());
        // Another waker: the kept hostile one is dropped.
        let plain = futures::task::noop_waker();
        let mut plain_cx = std::task::Context::from_waker(&plain);
        let polled = std::future::Future::poll(std::pin::Pin::new(&mut h), &mut plain_cx);
        DROP_PANICS.with(|d| d.set(false));
        assert!(polled.is_pending());
        assert!(p.metrics().panicked >= 1, "the waker drops were caught");
        ready.store(true, Ordering::SeqCst);
        assert_eq!(p.try_complete_watched(&1), 1);
        assert_eq!(h.await, Ok(Completion::Completed(())));
        drop(hostile);
    });
}

/// A value whose `Drop` always panics, even while another panic unwinds.
struct AlwaysPanicsOnDrop(Arc<AtomicUsize>);

impl Drop for AlwaysPanicsOnDrop {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
        panic!("hostile drop");
    }
}

/// A repeating task whose closure panics and whose own `Drop` panics as well
/// (while the first panic would be unwinding) used to abort the process.
/// Both panics are counted; the chain ends; the timer goes on.
#[test]
fn a_repeating_task_that_panics_and_panics_again_on_drop_is_contained() {
    paused_within(10, || async {
        let timer = Timer::new();
        let drops = Arc::new(AtomicUsize::new(0));
        let guard = AlwaysPanicsOnDrop(drops.clone());
        let t = timer
            .schedule_repeating(ms(10), move || {
                let _keep = &guard;
                panic!("hostile repeating task");
            })
            .unwrap();
        let ran = Arc::new(AtomicBool::new(false));
        let flag = ran.clone();
        timer
            .schedule(ms(20), move || flag.store(true, Ordering::SeqCst))
            .unwrap();
        advance(ms(30)).await;
        settle().await;
        assert_eq!(drops.load(Ordering::SeqCst), 1, "the task was dropped once");
        assert_eq!(timer.metrics().panicked, 2, "its run and its drop");
        assert!(ran.load(Ordering::SeqCst), "the other task still ran");
        assert!(!t.cancel(), "the chain ended");
    });
}

/// Cancelling an async task before its deadline drops its future unpolled:
/// a future whose `Drop` panics is contained there.
#[tokio::test(start_paused = true)]
async fn an_async_task_whose_future_panics_on_drop_is_cancelled_contained() {
    let timer = Timer::new();
    let drops = Arc::new(AtomicUsize::new(0));
    let guard = AlwaysPanicsOnDrop(drops.clone());
    let t = timer
        .schedule_async(ms(10), async move {
            let _keep = &guard;
        })
        .unwrap();
    assert!(t.cancel(), "cancelled before its deadline");
    assert_eq!(drops.load(Ordering::SeqCst), 1);
    assert_eq!(timer.metrics().panicked, 1);
    advance(ms(20)).await;
    settle().await;
    assert_eq!(timer.metrics().panicked, 1, "nothing ran later");
}

/// The caller's key iterator panics after giving two keys whose `Drop`
/// panics: the keys taken so far used to be dropped while the iterator's
/// panic unwound, which aborted the process. Now the iterator's panic reaches
/// the caller, each key's drop is contained, and nothing is registered.
#[tokio::test(start_paused = true)]
async fn a_key_iterator_that_panics_drops_the_keys_taken_contained() {
    let p: Purgatory<HookKey, Op> = purgatory();
    let drops = Arc::new(AtomicUsize::new(0));
    let hooks = Hooks::default();
    // Each key's `Drop` panics, even while another panic unwinds.
    let loud: Hook = {
        let drops = drops.clone();
        Arc::new(move || {
            drops.fetch_add(1, Ordering::SeqCst);
            panic!("hostile key drop");
        })
    };
    let keys = (0..3u32).map(move |id| {
        if id == 2 {
            panic!("hostile key iterator");
        }
        HookKey {
            id,
            on_drop: Some(loud.clone()),
        }
    });
    let r = catch_unwind(AssertUnwindSafe(|| {
        let _ = p.try_complete_else_watch(Op(hooks.clone()), ms(100), keys);
    }));
    let panic = r.expect_err("the iterator's panic reaches the caller");
    assert_eq!(
        panic.downcast_ref::<&str>(),
        Some(&"hostile key iterator"),
        "the first panic, not a key's"
    );
    assert_eq!(drops.load(Ordering::SeqCst), 2, "both keys dropped");
    assert_eq!(hooks.op_drops(), 1, "the operation dropped");
    let m = p.metrics();
    assert_eq!(m.panicked, 2, "{m:?}");
    assert_eq!((m.registered, m.delayed, m.watched), (0, 0, 0), "{m:?}");
}

/// The caller's key iterator gives every key, then panics in its own `Drop`:
/// the keys taken used to be leaked (plain keys) or dropped while that panic
/// unwound (keys at a level: a key whose `Drop` panicked then aborted the
/// process). Now the iterator's panic reaches the caller, each key's drop is
/// contained, and nothing is registered.
#[tokio::test(start_paused = true)]
async fn a_key_iterator_whose_drop_panics_drops_the_keys_taken_contained() {
    struct PanicsOnDrop<I>(I);
    impl<I: Iterator> Iterator for PanicsOnDrop<I> {
        type Item = I::Item;
        fn next(&mut self) -> Option<I::Item> {
            self.0.next()
        }
    }
    impl<I> Drop for PanicsOnDrop<I> {
        fn drop(&mut self) {
            panic!("hostile key iterator drop");
        }
    }
    for level in [false, true] {
        let p: Purgatory<HookKey, Op> = purgatory();
        let drops = Arc::new(AtomicUsize::new(0));
        let hooks = Hooks::default();
        // Each key's `Drop` panics, even while another panic unwinds.
        let loud: Hook = {
            let drops = drops.clone();
            Arc::new(move || {
                drops.fetch_add(1, Ordering::SeqCst);
                panic!("hostile key drop");
            })
        };
        let keys = PanicsOnDrop((0..3u32).map(move |id| {
            let key = HookKey {
                id,
                on_drop: Some(loud.clone()),
            };
            if level {
                Watch::level(key, 5)
            } else {
                Watch::key(key)
            }
        }));
        let r = catch_unwind(AssertUnwindSafe(|| {
            let _ = p.try_complete_else_watch_levels(Op(hooks.clone()), ms(100), keys);
        }));
        let panic = r.expect_err("the iterator's panic reaches the caller");
        assert_eq!(
            panic.downcast_ref::<&str>(),
            Some(&"hostile key iterator drop"),
            "level {level}: the iterator's panic, not a key's"
        );
        assert_eq!(
            drops.load(Ordering::SeqCst),
            3,
            "level {level}: every key dropped"
        );
        assert_eq!(hooks.op_drops(), 1, "the operation dropped");
        let m = p.metrics();
        assert_eq!(m.panicked, 3, "level {level}: {m:?}");
        assert_eq!((m.registered, m.delayed, m.watched), (0, 0, 0), "{m:?}");
    }
}

/// Two tasks wait in `drain()`, one with a waker that panics in `wake`: the
/// other is still woken, and both drains end.
#[test]
fn a_drain_waker_that_panics_on_wake_leaves_the_other_drainers_woken() {
    use std::future::Future;
    paused_within(10, || async {
        let (p, ready) = flagged("drains");
        let h = watch_flag(&p, &ready);
        let woken = Arc::new(AtomicUsize::new(0));
        let counting = {
            struct Count(Arc<AtomicUsize>);
            impl std::task::Wake for Count {
                fn wake(self: Arc<Self>) {
                    self.0.fetch_add(1, Ordering::SeqCst);
                }
            }
            std::task::Waker::from(Arc::new(Count(woken.clone())))
        };
        let hostile = waker_panicking_on_wake();
        // The hostile drainer between two others.
        let mut first = Box::pin(p.drain());
        let mut second = Box::pin(p.drain());
        let mut third = Box::pin(p.drain());
        let mut hostile_cx = std::task::Context::from_waker(&hostile);
        let mut counting_cx = std::task::Context::from_waker(&counting);
        assert!(first.as_mut().poll(&mut counting_cx).is_pending());
        assert!(second.as_mut().poll(&mut hostile_cx).is_pending());
        assert!(third.as_mut().poll(&mut counting_cx).is_pending());
        ready.store(true, Ordering::SeqCst);
        assert_eq!(p.try_complete_watched(&1), 1);
        assert_eq!(p.metrics().panicked, 1, "the hostile wake was caught");
        assert_eq!(woken.load(Ordering::SeqCst), 2, "both other drainers woken");
        assert!(first.as_mut().poll(&mut counting_cx).is_ready());
        assert!(third.as_mut().poll(&mut counting_cx).is_ready());
        assert!(second.as_mut().poll(&mut counting_cx).is_ready());
        assert_eq!(h.await, Ok(Completion::Completed(())));
    });
}

/// A task waits in `drain()` with a waker whose `clone` finishes the last
/// pending operation (calls back into the purgatory): no deadlock, and the
/// drain ends.
#[test]
fn a_drain_waker_whose_clone_calls_back_in_does_not_deadlock() {
    use std::future::Future;
    paused_within(10, || async {
        let (p, ready) = flagged("drain");
        let h = watch_flag(&p, &ready);
        let calls = Arc::new(AtomicUsize::new(0));
        {
            let (p, ready, calls) = (p.clone(), ready.clone(), calls.clone());
            ON_CLONE.with(|hook| {
                *hook.borrow_mut() = Some(Box::new(move || {
                    calls.fetch_add(1, Ordering::SeqCst);
                    ready.store(true, Ordering::SeqCst);
                    p.try_complete_watched(&1);
                }))
            });
        }
        let waker = waker_calling_back();
        let mut cx = std::task::Context::from_waker(&waker);
        let mut drain = Box::pin(p.drain());
        // The poll clones the waker, which completes the operation: the
        // drain finds nothing pending.
        assert!(drain.as_mut().poll(&mut cx).is_ready());
        ON_CLONE.with(|hook| hook.borrow_mut().take());
        assert!(calls.load(Ordering::SeqCst) >= 1);
        assert_eq!(h.await, Ok(Completion::Completed(())));
    });
}

/// A sleep polled with a waker whose `clone` panics: the panic reaches that
/// poll, and the sleep is left as it was, so a task awaiting it later is
/// still woken at its deadline. Polled with a waker whose `Drop` panics and
/// then another, the first is dropped contained.
#[test]
fn a_sleep_polled_with_hostile_wakers_still_wakes_its_task() {
    use std::future::Future;
    paused_within(10, || async {
        let timer = Timer::new();
        let mut sleep = Box::pin(timer.sleep(ms(10)));
        let bad_clone = waker_calling_back();
        ON_CLONE.with(|hook| *hook.borrow_mut() = Some(Box::new(|| panic!("hostile clone"))));
        let r = catch_unwind(AssertUnwindSafe(|| {
            let mut cx = std::task::Context::from_waker(&bad_clone);
            let _ = sleep.as_mut().poll(&mut cx);
        }));
        ON_CLONE.with(|hook| hook.borrow_mut().take());
        assert!(r.is_err(), "the clone's panic reaches the poll");
        let bad_drop = waker_panicking_on_wake();
        let mut cx = std::task::Context::from_waker(&bad_drop);
        assert!(sleep.as_mut().poll(&mut cx).is_pending());
        DROP_PANICS.with(|d| d.set(true));
        let plain = futures::task::noop_waker();
        let polled = sleep
            .as_mut()
            .poll(&mut std::task::Context::from_waker(&plain));
        DROP_PANICS.with(|d| d.set(false));
        assert!(polled.is_pending());
        assert_eq!(
            timer.metrics().panicked,
            1,
            "the replaced waker's drop was caught"
        );
        // Awaited now: woken at the deadline (the runtime's clock moves
        // on by itself only when the task would otherwise never wake).
        sleep.await.unwrap();
        drop(bad_drop);
    });
}

/// A sleep polled once keeps a clone of the poller's waker; dropping the
/// sleep before it fires drops that clone, and a `Drop` that panics there is
/// contained (and counted) instead of escaping the sleep's drop.
#[test]
fn a_sleep_dropped_with_a_waker_that_panics_on_drop_is_contained() {
    use std::future::Future;
    paused_within(10, || async {
        let timer = Timer::new();
        let mut sleep = Box::pin(timer.sleep(ms(10)));
        let hostile = waker_panicking_on_wake();
        let mut cx = std::task::Context::from_waker(&hostile);
        assert!(sleep.as_mut().poll(&mut cx).is_pending());
        DROP_PANICS.with(|d| d.set(true));
        drop(sleep);
        DROP_PANICS.with(|d| d.set(false));
        assert_eq!(
            timer.metrics().panicked,
            1,
            "the kept waker's drop was caught"
        );
        assert!(timer.is_empty(), "its entry left the wheel");
        timer.sleep(ms(10)).await.unwrap();
        drop(hostile);
    });
}

/// A timer's `Debug` does not print its wheel (a million entries would be
/// printed, behind locks held while the formatter writes).
#[tokio::test(start_paused = true)]
async fn a_timers_debug_output_does_not_grow_with_its_entries() {
    let timer = Timer::builder().name("debug").build().unwrap();
    let empty = format!("{timer:?}");
    let handles: Vec<_> = (0..1000)
        .map(|i| timer.schedule(ms(1000 + i), || {}).unwrap())
        .collect();
    let sleep = timer.sleep(ms(10));
    assert_eq!(format!("{timer:?}"), empty);
    assert!(format!("{:?}", handles[0]).len() < 200, "{:?}", handles[0]);
    assert!(format!("{sleep:?}").len() < 400, "{sleep:?}");
}

/// A future scheduled with `schedule_async` and handed back by a shutdown,
/// then run from a thread outside any runtime, is spawned on the runtime it
/// was scheduled from (it used to panic there, in `tokio::spawn`).
#[test]
fn an_async_task_handed_back_and_run_outside_a_runtime_still_starts() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let timer = rt.block_on(async { Timer::new() });
    let (tx, rx) = tokio::sync::oneshot::channel();
    let t = rt
        .block_on(async {
            timer.schedule_async(Duration::from_secs(60), async move {
                let _ = tx.send("ran");
            })
        })
        .unwrap();
    let unrun = timer.shutdown();
    assert_eq!(unrun.len(), 1);
    // Here, on a thread with no runtime entered.
    for task in unrun {
        task.run();
    }
    let got = rt.block_on(async { tokio::time::timeout(Duration::from_secs(5), rx).await });
    assert_eq!(got.unwrap(), Ok("ran"));
    assert!(t.is_finished());
}

/// A `tracing` subscriber whose `event` panics: the application's code too.
struct PanickingSubscriber;

impl tracing::Subscriber for PanickingSubscriber {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, e: &tracing::Event<'_>) {
        if *e.metadata().level() == tracing::Level::ERROR {
            panic!("hostile subscriber");
        }
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

/// A caught panic is reported through `tracing`; a subscriber that panics
/// on that report does not unwind out of the walk that caught the first
/// panic: the other operations are still checked and completed.
#[tokio::test(start_paused = true)]
async fn a_subscriber_that_panics_on_the_report_cuts_no_walk_short() {
    let p = purgatory::<u32>();
    let (hooks, handles) = plain_ops_on(&p, 1, 3);
    hooks[0].check_panics.store(true, Ordering::SeqCst);
    for h in &hooks[1..] {
        h.set_ready();
    }
    let completed =
        tracing::subscriber::with_default(PanickingSubscriber, || p.try_complete_watched(&1));
    assert_eq!(completed, 2, "the other two completed");
    assert_eq!(p.metrics().panicked, 1);
    let mut handles = handles.into_iter();
    drop(handles.next());
    for h in handles {
        assert!(h.await.unwrap().is_completed());
    }
}

/// A key whose `Eq` answers "different" on its first call and panics on the
/// second (from then on, armed), and whose `Drop` panics while armed.
#[derive(Clone)]
struct FickleKey(u32, Arc<FickleState>);

#[derive(Default)]
struct FickleState {
    armed: AtomicBool,
    eqs: AtomicUsize,
    drops: AtomicUsize,
}

impl PartialEq for FickleKey {
    fn eq(&self, o: &Self) -> bool {
        if self.1.armed.load(Ordering::SeqCst) {
            if self.1.eqs.fetch_add(1, Ordering::SeqCst) >= 1 {
                panic!("hostile key eq");
            }
            return false;
        }
        self.0 == o.0
    }
}

impl Eq for FickleKey {}

impl Hash for FickleKey {
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.0.hash(h);
    }
}

impl Drop for FickleKey {
    fn drop(&mut self) {
        if self.1.armed.load(Ordering::SeqCst) {
            self.1.drops.fetch_add(1, Ordering::SeqCst);
            panic!("hostile key drop");
        }
    }
}

/// A key already watched, registered again by a key whose `Eq` first says
/// "not this one" (so the map makes a copy to add it as new) and then
/// panics when the map looks again: the copy used to be dropped while that
/// panic unwound, and a copy whose `Drop` panics aborted the process. Now the
/// panic reaches the caller, every drop is contained, and the purgatory is
/// as it was.
#[tokio::test(start_paused = true)]
async fn a_key_whose_eq_panics_on_the_second_look_drops_its_copy_contained() {
    let state = Arc::new(FickleState::default());
    let p: Purgatory<FickleKey, Op> = purgatory();
    let first = Hooks::default();
    let h = p
        .try_complete_else_watch(Op(first.clone()), ms(100), [FickleKey(1, state.clone())])
        .unwrap();
    state.armed.store(true, Ordering::SeqCst);
    let second = Hooks::default();
    let r = catch_unwind(AssertUnwindSafe(|| {
        let _ =
            p.try_complete_else_watch(Op(second.clone()), ms(100), [FickleKey(1, state.clone())]);
    }));
    let panic = r.expect_err("the key's panic reaches the caller");
    assert_eq!(panic.downcast_ref::<&str>(), Some(&"hostile key eq"));
    assert_eq!(
        state.drops.load(Ordering::SeqCst),
        2,
        "the copy and the key itself"
    );
    state.armed.store(false, Ordering::SeqCst);
    let m = p.metrics();
    assert_eq!(m.panicked, 2, "both key drops caught: {m:?}");
    assert_eq!((m.registered, m.delayed), (1, 1), "{m:?}");
    assert_eq!(second.op_drops(), 1, "the refused operation was dropped");
    first.set_ready();
    assert_eq!(p.try_complete_watched(&FickleKey(1, state.clone())), 1);
    assert!(h.await.unwrap().is_completed());
}

/// An operation that keeps its own `OpRef` and updates itself from its
/// `try_complete` (it has itself by `&mut` there already) gets `None`
/// instead of waiting forever for the lock its own check holds.
#[test]
fn an_update_of_an_operation_from_its_own_check_does_not_deadlock() {
    struct SelfUpdating {
        me: Arc<OnceLock<tokio_purgatory::OpRef<u32, SelfUpdating>>>,
        saw: Arc<AtomicUsize>,
        ready: Arc<AtomicBool>,
    }
    impl Operation for SelfUpdating {
        type Output = ();
        fn try_complete(&mut self) -> Option<()> {
            if let Some(me) = self.me.get() {
                assert!(me.update(|_| ()).is_none(), "not from its own check");
                self.saw.fetch_add(1, Ordering::SeqCst);
            }
            self.ready.load(Ordering::SeqCst).then_some(())
        }
        fn on_expiration(self) {}
    }
    paused_within(10, || async {
        let p: Purgatory<u32, SelfUpdating> = Purgatory::builder().name("self").build().unwrap();
        let me = Arc::new(OnceLock::new());
        let saw = Arc::new(AtomicUsize::new(0));
        let ready = Arc::new(AtomicBool::new(false));
        let op = SelfUpdating {
            me: me.clone(),
            saw: saw.clone(),
            ready: ready.clone(),
        };
        let h = p.try_complete_else_watch(op, ms(1000), [1]).unwrap();
        let r = h.op_ref().unwrap();
        assert!(me.set(r.clone()).is_ok());
        assert_eq!(p.try_complete_watched(&1), 0, "checked, not ready");
        assert_eq!(r.update(|_| 7), Some(7), "from outside, it runs");
        ready.store(true, Ordering::SeqCst);
        assert!(r.try_complete());
        assert_eq!(saw.load(Ordering::SeqCst), 2);
        assert_eq!(p.metrics().panicked, 0);
        assert_eq!(h.await, Ok(Completion::Completed(())));
    });
}

/// An operation whose first check shuts its purgatory down: the
/// registration goes on past the shutdown (the shutdown emptied the watch
/// lists before this registration added to them), and is refused with the
/// operation handed back. Its watch-list entries and key copies go too:
/// nothing is left watched after the shutdown.
#[tokio::test(start_paused = true)]
async fn a_registration_racing_a_shutdown_leaves_nothing_watched() {
    struct ShutsDown(Arc<OnceLock<Purgatory<u32, ShutsDown>>>, u32);
    impl Operation for ShutsDown {
        type Output = ();
        fn try_complete(&mut self) -> Option<()> {
            // The first check only (a second shutdown would empty the lists
            // again).
            if let Some(p) = self.0.get().filter(|p| !p.is_shutdown()) {
                assert!(p.shutdown().is_empty(), "nothing pending yet");
            }
            None
        }
        fn on_expiration(self) {}
    }
    let slot = Arc::new(OnceLock::new());
    let p: Purgatory<u32, ShutsDown> = Purgatory::builder().name("race").build().unwrap();
    assert!(slot.set(p.clone()).is_ok());
    let refused = p.try_complete_else_watch(ShutsDown(slot.clone(), 7), ms(100), [1, 2, 3]);
    match refused {
        Err(tokio_purgatory::WatchError::Shutdown(op)) => assert_eq!(op.1, 7, "handed back"),
        other => panic!(
            "expected a refusal: {:?}",
            other.map(|_| ()).map_err(|e| e.to_string())
        ),
    }
    let m = p.metrics();
    assert_eq!((m.watched, m.tombstones, m.keys), (0, 0, 0), "{m:?}");
    assert!(balanced(&m), "{m:?}");
}

/// The same race, with the registration's second check completing the
/// operation instead: it is not refused (it finished), and its watch-list
/// entries, made after the shutdown emptied the lists, go all the same.
#[tokio::test(start_paused = true)]
async fn a_registration_completed_past_a_shutdown_leaves_nothing_watched() {
    struct ShutsDownThenDone(Arc<OnceLock<Purgatory<u32, ShutsDownThenDone>>>);
    impl Operation for ShutsDownThenDone {
        type Output = &'static str;
        fn try_complete(&mut self) -> Option<&'static str> {
            match self.0.get().filter(|p| !p.is_shutdown()) {
                Some(p) => {
                    assert!(p.shutdown().is_empty(), "nothing pending yet");
                    None
                }
                None => Some("done"),
            }
        }
        fn on_expiration(self) -> &'static str {
            "expired"
        }
    }
    let slot = Arc::new(OnceLock::new());
    let p: Purgatory<u32, ShutsDownThenDone> = Purgatory::new();
    assert!(slot.set(p.clone()).is_ok());
    let h = p
        .try_complete_else_watch(ShutsDownThenDone(slot.clone()), ms(100), [1, 2, 3])
        .unwrap();
    assert_eq!(h.await, Ok(tokio_purgatory::Completion::Completed("done")));
    let m = p.metrics();
    assert_eq!((m.watched, m.tombstones, m.keys), (0, 0, 0), "{m:?}");
    assert!(balanced(&m), "{m:?}");
}

/// Keys whose `Hash` is the same for all (every key collides, whatever the
/// hasher): finished operations' entries and emptied keys still go, by
/// walks and by the purge, as with any keys.
#[tokio::test(start_paused = true)]
async fn keys_that_all_hash_alike_are_purged_like_any_others() {
    #[derive(Clone, PartialEq, Eq, Debug)]
    struct Same(u32);
    impl Hash for Same {
        fn hash<H: Hasher>(&self, h: &mut H) {
            0u8.hash(h);
        }
    }
    let p: Purgatory<Same, Op> = purgatory();
    // A key watched throughout, first in the table.
    let stays = p
        .try_complete_else_watch(Op(Hooks::default()), ms(10_000), [Same(999)])
        .unwrap();
    let hooks: Vec<Hooks> = (0..40).map(|_| Hooks::default()).collect();
    let handles: Vec<_> = hooks
        .iter()
        .enumerate()
        .map(|(i, h)| {
            let i = i as u32;
            p.try_complete_else_watch(Op(h.clone()), ms(100), [Same(i), Same(i + 100)])
                .unwrap()
        })
        .collect();
    assert_eq!(p.metrics().keys, 81);
    // Half complete by their first key; the rest expire.
    for (i, h) in hooks.iter().enumerate().take(20) {
        h.set_ready();
        assert_eq!(p.try_complete_watched(&Same(i as u32)), 1);
    }
    advance(ms(101)).await;
    settle().await;
    for h in handles {
        assert!(h.await.is_ok());
    }
    // The expiries left tombstones in most lists: the purge they started
    // went through every key (the one watched throughout comes first in
    // the probe order of their common hash, and used to be the only one
    // visited), leaving fewer than the 16 it waits for (as keys that
    // hash apart do).
    let m = p.metrics();
    assert!(m.purged > 40, "{m:?}");
    assert!(m.tombstones < 16, "{m:?}");
    assert_eq!(m.keys, m.watched, "each key left holds one entry: {m:?}");
    drop(stays);
}

/// Two `shutdown()` calls, the second made once `is_shutdown()` is true
/// while the first is still handing back: "Returns an empty list when
/// already shut down." The second used to take part of the first one's
/// operations (the first then handed back only some of them).
#[test]
fn a_second_shutdown_takes_nothing_from_the_first() {
    within(60, || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let _entered = rt.enter();
        for _ in 0..5 {
            let p: Purgatory<u32, Op> = purgatory();
            let handles: Vec<_> = (0..20_000u32)
                .map(|i| {
                    p.try_complete_else_watch(Op(Hooks::default()), ms(30_000), [i % 64])
                        .unwrap()
                })
                .collect();
            let second = {
                let p = p.clone();
                std::thread::spawn(move || {
                    while !p.is_shutdown() {
                        std::hint::spin_loop();
                    }
                    p.shutdown().len()
                })
            };
            let first = p.shutdown().len();
            assert_eq!((first, second.join().unwrap()), (20_000, 0));
            drop(handles);
        }
    });
}

/// "Bad input gets a clear error": a level count far too large for any
/// wheel is refused by both builders, not met with an overflow, a capacity
/// panic or an allocation that aborts the process.
#[tokio::test(start_paused = true)]
async fn a_huge_level_count_is_a_clear_error() {
    for levels in [63, 1 << 40, 1 << 60, usize::MAX / 2, usize::MAX] {
        let e = Timer::builder().levels(levels).build().unwrap_err();
        assert!(e.to_string().contains("levels"), "{levels}: {e}");
        let e = Purgatory::<u32, Op>::builder()
            .levels(levels)
            .build()
            .unwrap_err();
        assert!(e.to_string().contains("levels"), "{levels}: {e}");
    }
    assert!(Timer::builder()
        .slots_per_level(2)
        .levels(61)
        .build()
        .is_ok());
}

/// `cancel_for_key` is a cancellation like the others: when it leaves
/// nothing pending, or as many tombstones (at least 16) as live entries, the
/// tombstones it left in the operations' other keys are purged at once,
/// whatever the purge interval.
#[tokio::test(start_paused = true)]
async fn cancel_for_key_purges_at_once_like_other_cancellations() {
    // Nothing left pending.
    let p = purgatory::<u32>();
    let handles: Vec<_> = (0..3)
        .map(|i| {
            p.try_complete_else_watch(Op(Hooks::default()), ms(1000), [7, 100 + i])
                .unwrap()
        })
        .collect();
    assert_eq!(p.cancel_for_key(&7).len(), 3);
    let m = p.metrics();
    assert_eq!(
        (m.delayed, m.watched, m.tombstones, m.keys),
        (0, 0, 0, 0),
        "{m:?}"
    );
    drop(handles);
    // Half the entries left are tombstones.
    let p = purgatory::<u32>();
    let handles: Vec<_> = (0..100u32)
        .map(|i| {
            let keys: Vec<u32> = if i < 50 {
                vec![i, 1000 + i, 5000]
            } else {
                vec![i, 1000 + i]
            };
            p.try_complete_else_watch(Op(Hooks::default()), ms(1000), keys)
                .unwrap()
        })
        .collect();
    assert_eq!(p.cancel_for_key(&5000).len(), 50);
    let m = p.metrics();
    assert_eq!((m.delayed, m.tombstones, m.watched), (50, 0, 100), "{m:?}");
    drop(handles);
}

/// An advance that completes a key's watchers at a level takes their
/// entries out as a walk does (and the key, once its list empties), rather
/// than leaving them as tombstones one level up until a later advance or a
/// purge.
#[tokio::test(start_paused = true)]
async fn an_advance_takes_out_what_it_completed_as_a_walk_does() {
    let p = purgatory::<u32>();
    let hooks: Vec<Hooks> = (0..8).map(|_| Hooks::default()).collect();
    let handles: Vec<_> = hooks
        .iter()
        .enumerate()
        .map(|(i, h)| {
            p.try_complete_else_watch_levels(
                Op(h.clone()),
                ms(1000),
                [Watch::level(2, 10 + i as u64)],
            )
            .unwrap()
        })
        .collect();
    for h in &hooks {
        h.set_ready();
    }
    assert_eq!(p.try_complete_reached(&2, 13), 4, "the four at 10..=13");
    let m = p.metrics();
    assert_eq!((m.watched, m.tombstones, m.keys), (4, 0, 1), "{m:?}");
    assert_eq!(p.try_complete_reached(&2, 100), 4, "the rest");
    let m = p.metrics();
    assert_eq!(
        (m.delayed, m.watched, m.tombstones, m.keys),
        (0, 0, 0, 0),
        "{m:?}"
    );
    for h in handles {
        assert!(h.await.unwrap().is_completed());
    }
}
