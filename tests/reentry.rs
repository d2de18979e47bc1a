//! Checks that call back into the purgatory, and events raised on the thread
//! that runs a check by what that check caused. An operation whose check walked
//! another key, and was made ready and had its key walked by what that walk ran
//! (another operation's check, the first or a later check of an operation it
//! registered, an expiry left to a nested check, the drop of an operation it
//! completed or that was cancelled during its check), checks once more before
//! the outside event returns instead of waiting for its timeout; so does one
//! whose nested check asks and then panics, or one in another purgatory, told
//! the level it was advanced to. A level handed over by another thread while a
//! check runs survives a nested advance on the checking thread; a cancel racing
//! such a re-run wins once. Checks that walk each other's keys every time they
//! run, in rings and in lines, end: each check an event (or a registration)
//! reaches re-runs at most once, and what those re-runs reach asks for no
//! re-run, so a line of n such checks costs at most n² checks per event.

mod support;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio::time::advance;
use tokio_purgatory::{Completion, Operation, OperationError, Purgatory, Watch, WatchKey};

use support::{ms, paused_within, settle, within};

type Hook = Arc<dyn Fn(Option<u64>) -> Option<u32> + Send + Sync>;
type Plain = Arc<dyn Fn() + Send + Sync>;

/// An operation whose check, expiry and drop are closures. Its check is
/// told the level of the advance that runs it, if any; two of its checks
/// that overlap panic, which the purgatory catches and counts (each test
/// checks `panicked`).
struct Op {
    check: Hook,
    expire: Option<Plain>,
    on_drop: Option<Plain>,
    checks: Arc<AtomicUsize>,
    busy: Arc<AtomicBool>,
}

impl Op {
    fn new(check: impl Fn(Option<u64>) -> Option<u32> + Send + Sync + 'static) -> Op {
        Op {
            check: Arc::new(check),
            expire: None,
            on_drop: None,
            checks: Arc::default(),
            busy: Arc::default(),
        }
    }

    fn run(&mut self, reached: Option<u64>) -> Option<u32> {
        struct Free<'a>(&'a AtomicBool);
        impl Drop for Free<'_> {
            fn drop(&mut self) {
                self.0.store(false, Ordering::SeqCst);
            }
        }
        assert!(!self.busy.swap(true, Ordering::SeqCst), "checks overlap");
        let _free = Free(&self.busy);
        self.checks.fetch_add(1, Ordering::SeqCst);
        (self.check)(reached)
    }
}

impl Operation for Op {
    type Output = u32;
    fn try_complete(&mut self) -> Option<u32> {
        self.run(None)
    }
    fn try_complete_reached(&mut self, reached: u64) -> Option<u32> {
        self.run(Some(reached))
    }
    fn on_expiration(self) -> u32 {
        if let Some(e) = &self.expire {
            e();
        }
        0
    }
}

impl Drop for Op {
    fn drop(&mut self) {
        if let Some(d) = self.on_drop.take() {
            d();
        }
    }
}

type P = Purgatory<&'static str, Op>;

/// A purgatory its operations' code can reach.
type Slot<K> = Arc<OnceLock<Purgatory<K, Op>>>;

fn slot_of<K: WatchKey>(p: &Purgatory<K, Op>) -> Slot<K> {
    let slot = Arc::new(OnceLock::new());
    slot.set(p.clone()).ok();
    slot
}

/// Holds a check on the thread running it until the test lets it go.
struct Gate {
    inside_tx: SyncSender<()>,
    inside_rx: Mutex<Receiver<()>>,
    go_tx: SyncSender<()>,
    go_rx: Mutex<Receiver<()>>,
}

impl Gate {
    fn new() -> Arc<Gate> {
        let (inside_tx, inside_rx) = sync_channel(1);
        let (go_tx, go_rx) = sync_channel(1);
        Arc::new(Gate {
            inside_tx,
            inside_rx: Mutex::new(inside_rx),
            go_tx,
            go_rx: Mutex::new(go_rx),
        })
    }

    /// From the held code: says it is there, and waits to be let go.
    fn hold(&self) {
        self.inside_tx.send(()).unwrap();
        let go = self.go_rx.lock().unwrap();
        go.recv_timeout(Duration::from_secs(10)).expect("let go");
    }

    /// From the test: waits until the held code is there.
    fn reached(&self) {
        let inside = self.inside_rx.lock().unwrap();
        inside
            .recv_timeout(Duration::from_secs(5))
            .expect("the check reached the gate");
    }

    fn open(&self) {
        self.go_tx.send(()).unwrap();
    }
}

// ---------------------------------------------------------------------------
// An event raised on the checking thread by code the check caused that is
// not another operation's plain check: an expiry, a drop, a registration.

/// A's check walks "b". B's check is held there (on a thread of its own)
/// while B's timeout fires: the reaper leaves the expiry to that check,
/// which says "not yet", so B expires right there, on A's checking thread,
/// inside A's check. B's expiry makes A ready and walks "a" (a member's
/// session expiry letting the group's join complete): A checks once more
/// and completes within the outside walk, as it would had the reaper run
/// B's expiry.
#[test]
fn an_expiry_run_inside_a_check_that_readies_it_is_not_lost() {
    within(20, || {
        let rt = support::paused();
        let p: P = {
            let _in = rt.enter();
            Purgatory::new()
        };
        let s = slot_of(&p);
        let a_ready = Arc::new(AtomicBool::new(false));
        let gate = Gate::new();
        let hold_b = Arc::new(AtomicBool::new(false));
        let mut b = {
            let (gate, hold_b) = (gate.clone(), hold_b.clone());
            Op::new(move |_| {
                if hold_b.swap(false, Ordering::SeqCst) {
                    gate.hold();
                }
                None
            })
        };
        b.expire = Some({
            let (s, a_ready) = (s.clone(), a_ready.clone());
            Arc::new(move || {
                a_ready.store(true, Ordering::SeqCst);
                s.get().unwrap().try_complete_watched(&"a");
            })
        });
        let walk_b = Arc::new(AtomicBool::new(false));
        let a = {
            let (s, a_ready, walk_b) = (s.clone(), a_ready.clone(), walk_b.clone());
            Op::new(move |_| {
                let ready = a_ready.load(Ordering::SeqCst);
                if walk_b.swap(false, Ordering::SeqCst) {
                    s.get().unwrap().try_complete_watched(&"b");
                }
                ready.then_some(1)
            })
        };
        let (ha, hb) = rt.block_on(async {
            let hb = p.try_complete_else_watch(b, ms(100), ["b"]).unwrap();
            let ha = p.try_complete_else_watch(a, ms(10_000), ["a"]).unwrap();
            (ha, hb)
        });
        walk_b.store(true, Ordering::SeqCst);
        hold_b.store(true, Ordering::SeqCst);
        let w = {
            let p = p.clone();
            std::thread::spawn(move || p.try_complete_watched(&"a"))
        };
        gate.reached();
        // B's check is held on W, inside A's check: B's timeout fires now.
        rt.block_on(async {
            advance(ms(101)).await;
            settle().await;
        });
        assert!(!hb.is_finished(), "the expiry was left to B's check");
        gate.open();
        assert_eq!(w.join().unwrap(), 1, "the outside walk completed A");
        assert!(ha.is_finished(), "before the walk returned");
        assert_eq!(
            rt.block_on(hb),
            Ok(Completion::Expired(0)),
            "B expired on W"
        );
        assert_eq!(rt.block_on(ha), Ok(Completion::Completed(1)));
        let m = p.metrics();
        assert_eq!((m.delayed, m.panicked), (0, 0), "{m:?}");
    });
}

/// The same expiry run by the reaper (no check holds B) while A's check is
/// held on another thread: the expiry's walk asks that check to run again,
/// and A completes there.
#[test]
fn an_expiry_on_the_reaper_that_readies_a_check_held_elsewhere_is_not_lost() {
    within(20, || {
        let rt = support::paused();
        let p: P = {
            let _in = rt.enter();
            Purgatory::new()
        };
        let s = slot_of(&p);
        let a_ready = Arc::new(AtomicBool::new(false));
        let gate = Gate::new();
        let mut b = Op::new(|_| None);
        b.expire = Some({
            let (s, a_ready) = (s.clone(), a_ready.clone());
            Arc::new(move || {
                a_ready.store(true, Ordering::SeqCst);
                s.get().unwrap().try_complete_watched(&"a");
            })
        });
        let hold = Arc::new(AtomicBool::new(false));
        let a = {
            let (a_ready, hold, gate) = (a_ready.clone(), hold.clone(), gate.clone());
            Op::new(move |_| {
                let ready = a_ready.load(Ordering::SeqCst);
                if hold.swap(false, Ordering::SeqCst) {
                    gate.hold();
                }
                ready.then_some(1)
            })
        };
        let (ha, hb) = rt.block_on(async {
            let hb = p.try_complete_else_watch(b, ms(100), ["b"]).unwrap();
            let ha = p.try_complete_else_watch(a, ms(10_000), ["a"]).unwrap();
            (ha, hb)
        });
        hold.store(true, Ordering::SeqCst);
        let w = {
            let p = p.clone();
            std::thread::spawn(move || p.try_complete_watched(&"a"))
        };
        gate.reached();
        rt.block_on(async {
            advance(ms(101)).await;
            settle().await;
        });
        assert!(hb.is_finished(), "the reaper expired B");
        gate.open();
        assert_eq!(w.join().unwrap(), 1, "the held walk completed A");
        assert_eq!(rt.block_on(hb), Ok(Completion::Expired(0)));
        assert_eq!(rt.block_on(ha), Ok(Completion::Completed(1)));
        let m = p.metrics();
        assert_eq!((m.delayed, m.panicked), (0, 0), "{m:?}");
    });
}

/// A's check walks "b" and completes B there. B's `Drop` (run by A's walk,
/// on A's thread, inside A's check) makes A ready and walks "a". A's check
/// returns the "not yet" it read before, then checks once more and
/// completes within the outside walk.
#[test]
fn a_drop_run_inside_a_check_that_readies_it_is_not_lost() {
    paused_within(20, || async {
        let p: P = Purgatory::new();
        let s = slot_of(&p);
        let a_ready = Arc::new(AtomicBool::new(false));
        let b_go = Arc::new(AtomicBool::new(false));
        let mut b = {
            let b_go = b_go.clone();
            Op::new(move |_| b_go.load(Ordering::SeqCst).then_some(7))
        };
        b.on_drop = Some({
            let (s, a_ready) = (s.clone(), a_ready.clone());
            Arc::new(move || {
                a_ready.store(true, Ordering::SeqCst);
                s.get().unwrap().try_complete_watched(&"a");
            })
        });
        let hb = p.try_complete_else_watch(b, ms(1000), ["b"]).unwrap();
        let a = {
            let (s, a_ready, b_go) = (s.clone(), a_ready.clone(), b_go.clone());
            Op::new(move |_| {
                let ready = a_ready.load(Ordering::SeqCst);
                if !b_go.swap(true, Ordering::SeqCst) {
                    s.get().unwrap().try_complete_watched(&"b");
                }
                ready.then_some(1)
            })
        };
        // A registers without walking "b".
        b_go.store(true, Ordering::SeqCst);
        let ha = p.try_complete_else_watch(a, ms(1000), ["a"]).unwrap();
        b_go.store(false, Ordering::SeqCst);
        assert_eq!(
            p.try_complete_watched(&"a"),
            1,
            "the outside walk completed A"
        );
        assert!(ha.is_finished(), "before the walk returned");
        assert_eq!(hb.await, Ok(Completion::Completed(7)));
        assert_eq!(ha.await, Ok(Completion::Completed(1)));
        let m = p.metrics();
        assert_eq!((m.delayed, m.panicked), (0, 0), "{m:?}");
    });
}

/// X's check reads its state, then walks "a", where A's check is held (on
/// thread W). This thread cancels A meanwhile, which is left to that check.
/// A says "not yet", so its check ends `Cancelled` and A is dropped by X's
/// walk, on W, inside X's check. A's `Drop` makes X ready and walks "x": X
/// checks once more and completes within the outside walk, as it does when A
/// is dropped because it completed (the control below).
#[test]
fn a_drop_of_an_operation_cancelled_during_its_nested_check_readies_the_outer() {
    drop_during_a_nested_check_readies_the_outer(false);
}

/// The control: A completes in its held check instead of being cancelled,
/// and its drop readies X the same way.
#[test]
fn a_drop_of_an_operation_completed_during_its_nested_check_readies_the_outer() {
    drop_during_a_nested_check_readies_the_outer(true);
}

/// X watches "x", A watches "a"; A's drop makes X ready and walks "x". A
/// walk of "x" on thread W runs X's check, which walks "a", where A's check
/// is held; A then completes (`complete`) or is cancelled from this thread.
fn drop_during_a_nested_check_readies_the_outer(complete: bool) {
    within(20, move || {
        let rt = support::paused();
        let p: P = {
            let _in = rt.enter();
            Purgatory::new()
        };
        let s = slot_of(&p);
        let x_ready = Arc::new(AtomicBool::new(false));
        let gate = Gate::new();
        let hold = Arc::new(AtomicBool::new(false));
        let mut a = {
            let (gate, hold) = (gate.clone(), hold.clone());
            Op::new(move |_| {
                if hold.swap(false, Ordering::SeqCst) {
                    gate.hold();
                    return complete.then_some(5);
                }
                None
            })
        };
        a.on_drop = Some({
            let (s, x_ready) = (s.clone(), x_ready.clone());
            Arc::new(move || {
                x_ready.store(true, Ordering::SeqCst);
                s.get().unwrap().try_complete_watched(&"x");
            })
        });
        let walk_a = Arc::new(AtomicBool::new(false));
        let x = {
            let (s, x_ready, walk_a) = (s.clone(), x_ready.clone(), walk_a.clone());
            Op::new(move |_| {
                let ready = x_ready.load(Ordering::SeqCst);
                if walk_a.swap(false, Ordering::SeqCst) {
                    s.get().unwrap().try_complete_watched(&"a");
                }
                ready.then_some(1)
            })
        };
        let (ha, hx) = rt.block_on(async {
            let ha = p.try_complete_else_watch(a, ms(10_000), ["a"]).unwrap();
            let hx = p.try_complete_else_watch(x, ms(10_000), ["x"]).unwrap();
            (ha, hx)
        });
        let a_ref = ha.op_ref().unwrap();
        walk_a.store(true, Ordering::SeqCst);
        hold.store(true, Ordering::SeqCst);
        let w = {
            let p = p.clone();
            std::thread::spawn(move || p.try_complete_watched(&"x"))
        };
        gate.reached();
        if !complete {
            assert!(a_ref.cancel().is_none(), "left to A's check on W");
        }
        gate.open();
        let walked = w.join().unwrap();
        assert!(x_ready.load(Ordering::SeqCst), "A's drop readied X");
        assert_eq!(
            walked,
            1,
            "the outside walk completed X (X finished: {})",
            hx.is_finished()
        );
        let a_end = if complete {
            Ok(Completion::Completed(5))
        } else {
            Err(OperationError::Cancelled)
        };
        assert_eq!(rt.block_on(ha), a_end);
        assert_eq!(rt.block_on(hx), Ok(Completion::Completed(1)));
        let m = p.metrics();
        assert_eq!((m.delayed, m.panicked), (0, 0), "{m:?}");
    });
}

/// A's check registers N. N's first check (the one before it watches) makes
/// A ready, walks "a", and completes N at once: that walk comes from code
/// A's check ran, and A checks once more and completes within the outside
/// walk.
#[test]
fn an_event_from_a_registrations_first_check_inside_a_check_is_not_lost() {
    paused_within(20, || async {
        let p: P = Purgatory::new();
        let s = slot_of(&p);
        let a_ready = Arc::new(AtomicBool::new(false));
        let go = Arc::new(AtomicBool::new(false));
        let n_done = Arc::new(AtomicBool::new(false));
        let a = {
            let (s, a_ready, go, n_done) = (s.clone(), a_ready.clone(), go.clone(), n_done.clone());
            Op::new(move |_| {
                let ready = a_ready.load(Ordering::SeqCst);
                if go.swap(false, Ordering::SeqCst) {
                    let n = {
                        let (s, a_ready) = (s.clone(), a_ready.clone());
                        Op::new(move |_| {
                            a_ready.store(true, Ordering::SeqCst);
                            s.get().unwrap().try_complete_watched(&"a");
                            Some(9)
                        })
                    };
                    let h = s.get().unwrap().try_complete_else_watch(n, ms(1000), ["n"]);
                    n_done.store(h.unwrap().is_finished(), Ordering::SeqCst);
                }
                ready.then_some(1)
            })
        };
        let ha = p.try_complete_else_watch(a, ms(1000), ["a"]).unwrap();
        go.store(true, Ordering::SeqCst);
        assert_eq!(
            p.try_complete_watched(&"a"),
            1,
            "the outside walk completed A"
        );
        assert!(
            n_done.load(Ordering::SeqCst),
            "N completed at its first check"
        );
        assert!(ha.is_finished(), "before the walk returned");
        assert_eq!(ha.await, Ok(Completion::Completed(1)));
        let m = p.metrics();
        assert_eq!((m.completed, m.delayed, m.panicked), (2, 0, 0), "{m:?}");
    });
}

/// The same from N's second check (the one after it watches), which says
/// "not yet": A checks once more and completes; N stays pending.
#[test]
fn an_event_from_a_registrations_later_check_inside_a_check_is_not_lost() {
    paused_within(20, || async {
        let p: P = Purgatory::new();
        let s = slot_of(&p);
        let a_ready = Arc::new(AtomicBool::new(false));
        let go = Arc::new(AtomicBool::new(false));
        let a = {
            let (s, a_ready, go) = (s.clone(), a_ready.clone(), go.clone());
            Op::new(move |_| {
                let ready = a_ready.load(Ordering::SeqCst);
                if go.swap(false, Ordering::SeqCst) {
                    let n = {
                        let (s, a_ready) = (s.clone(), a_ready.clone());
                        let runs = AtomicUsize::new(0);
                        Op::new(move |_| {
                            if runs.fetch_add(1, Ordering::SeqCst) == 1 {
                                a_ready.store(true, Ordering::SeqCst);
                                s.get().unwrap().try_complete_watched(&"a");
                            }
                            None
                        })
                    };
                    s.get()
                        .unwrap()
                        .try_complete_else_watch(n, ms(1000), ["n"])
                        .unwrap()
                        .detach();
                }
                ready.then_some(1)
            })
        };
        let ha = p.try_complete_else_watch(a, ms(1000), ["a"]).unwrap();
        go.store(true, Ordering::SeqCst);
        assert_eq!(p.try_complete_watched(&"a"), 1);
        assert_eq!(ha.await, Ok(Completion::Completed(1)));
        let m = p.metrics();
        assert_eq!((m.delayed, m.panicked), (1, 0), "N pending: {m:?}");
    });
}

/// A registers watching "a" at level 10; its second check walks "b", where
/// B's check advances "a" to 12: A checks once more, told 12, and completes
/// before the registration returns.
#[test]
fn a_registrations_second_check_is_asked_from_inside_with_a_level() {
    paused_within(20, || async {
        let p: P = Purgatory::new();
        let s = slot_of(&p);
        let hw = Arc::new(AtomicU64::new(0));
        let armed = Arc::new(AtomicBool::new(false));
        let b = {
            let (s, hw, armed) = (s.clone(), hw.clone(), armed.clone());
            Op::new(move |_| {
                if armed.swap(false, Ordering::SeqCst) {
                    hw.store(12, Ordering::SeqCst);
                    s.get().unwrap().try_complete_reached(&"a", 12);
                }
                None
            })
        };
        let _hb = p.try_complete_else_watch(b, ms(1000), ["b"]).unwrap();
        let told = Arc::new(Mutex::new(Vec::new()));
        let runs = Arc::new(AtomicUsize::new(0));
        let a = {
            let (s, told, runs, armed) = (s.clone(), told.clone(), runs.clone(), armed.clone());
            Op::new(move |reached| {
                told.lock().unwrap().push(reached);
                // Trusts the level it is told (and reads nothing when told
                // none, as if its store lagged).
                if runs.fetch_add(1, Ordering::SeqCst) == 1 {
                    armed.store(true, Ordering::SeqCst);
                    s.get().unwrap().try_complete_watched(&"b");
                }
                reached.filter(|&l| l >= 10).map(|l| l as u32)
            })
        };
        let ha = p
            .try_complete_else_watch_levels(a, ms(1000), [Watch::level("a", 10)])
            .unwrap();
        assert!(ha.is_finished(), "completed as it registered");
        assert_eq!(*told.lock().unwrap(), [None, None, Some(12)]);
        assert_eq!(ha.await, Ok(Completion::Completed(12)));
        assert_eq!(p.metrics().panicked, 0);
    });
}

// ---------------------------------------------------------------------------
// Levels, other purgatories, panics and cancels around a re-run asked from
// inside.

/// A watches "a" plainly. Told a level, its check completes at 8 or more;
/// told none (registration), it reads the stored high watermark.
///
/// Thread W advances "a" to 3, which checks A (told 3). That run walks "b":
/// B's check walks "a", so A runs again (told 3 again). During that second
/// run this thread stores 8 and advances "a" to 8: A is being checked on
/// W, so its check is asked to run again, told 8. Then the second run walks
/// "b" once more, where B's check advances "a" to 8 from inside. A's third
/// run is still told 8, and A completes on W.
#[test]
fn a_level_handed_over_by_another_thread_survives_a_nested_advance() {
    paused_within(20, || async {
        let p: P = Purgatory::new();
        let s = slot_of(&p);
        let hw = Arc::new(AtomicU64::new(0));
        let told = Arc::new(Mutex::new(Vec::new()));
        // What B's check does: 0 nothing, 1 walk "a", 2 advance "a" to 8.
        let b_phase = Arc::new(AtomicUsize::new(0));
        let b = {
            let (s, b_phase) = (s.clone(), b_phase.clone());
            Op::new(move |_| {
                match b_phase.load(Ordering::SeqCst) {
                    1 => {
                        s.get().unwrap().try_complete_watched(&"a");
                    }
                    2 => {
                        s.get().unwrap().try_complete_reached(&"a", 8);
                    }
                    _ => {}
                }
                None
            })
        };
        let hb = p.try_complete_else_watch(b, ms(1000), ["b"]).unwrap();

        // A's runs since the test began (0: not begun).
        let run = Arc::new(AtomicUsize::new(0));
        let gate = Gate::new();
        let a = {
            let (s, hw, told, b_phase, run, gate) = (
                s.clone(),
                hw.clone(),
                told.clone(),
                b_phase.clone(),
                run.clone(),
                gate.clone(),
            );
            Op::new(move |reached| {
                let level = reached.unwrap_or_else(|| hw.load(Ordering::SeqCst));
                let n = run.load(Ordering::SeqCst);
                if n > 0 {
                    told.lock().unwrap().push(reached);
                    run.fetch_add(1, Ordering::SeqCst);
                }
                match n {
                    1 => {
                        b_phase.store(1, Ordering::SeqCst);
                        s.get().unwrap().try_complete_watched(&"b");
                    }
                    2 => {
                        // Let the other thread advance now.
                        gate.hold();
                        b_phase.store(2, Ordering::SeqCst);
                        s.get().unwrap().try_complete_watched(&"b");
                        b_phase.store(0, Ordering::SeqCst);
                    }
                    _ => {}
                }
                (level >= 8).then_some(level as u32)
            })
        };
        let ha = p.try_complete_else_watch(a, ms(1000), ["a"]).unwrap();
        run.store(1, Ordering::SeqCst);
        let w = {
            let p = p.clone();
            std::thread::spawn(move || p.try_complete_reached(&"a", 3))
        };
        gate.reached();
        hw.store(8, Ordering::SeqCst);
        assert_eq!(p.try_complete_reached(&"a", 8), 0, "left to W's check");
        gate.open();
        assert_eq!(w.join().unwrap(), 1, "W's advance completed A");
        run.store(0, Ordering::SeqCst);
        assert_eq!(*told.lock().unwrap(), [Some(3), Some(3), Some(8)]);
        assert!(ha.is_finished());
        assert_eq!(ha.await, Ok(Completion::Completed(8)));
        advance(ms(1001)).await;
        settle().await;
        assert_eq!(hb.await, Ok(Completion::Expired(0)));
        assert_eq!(p.metrics().panicked, 0);
    });
}

/// A in purgatory P (key "a"), B in purgatory Q (key "b"): A's check walks
/// Q's "b"; B's check makes A ready and advances P's "a" to 50. A checks
/// once more, told 50, and completes within the outside advance.
#[test]
fn an_event_from_another_purgatory_inside_a_check_is_told_its_level() {
    paused_within(20, || async {
        let p: P = Purgatory::new();
        let q: P = Purgatory::new();
        let (sp, sq) = (slot_of(&p), slot_of(&q));
        let told = Arc::new(Mutex::new(Vec::new()));
        let armed = Arc::new(AtomicBool::new(false));
        let b = {
            let (sp, armed) = (sp.clone(), armed.clone());
            Op::new(move |_| {
                if armed.load(Ordering::SeqCst) {
                    sp.get().unwrap().try_complete_reached(&"a", 50);
                }
                None
            })
        };
        let a = {
            let (sq, told, armed) = (sq.clone(), told.clone(), armed.clone());
            Op::new(move |reached| {
                if !armed.load(Ordering::SeqCst) {
                    return None;
                }
                told.lock().unwrap().push(reached);
                sq.get().unwrap().try_complete_watched(&"b");
                reached.filter(|&l| l >= 50).map(|l| l as u32)
            })
        };
        let ha = p
            .try_complete_else_watch_levels(a, ms(1000), [Watch::level("a", 40)])
            .unwrap();
        let hb = q.try_complete_else_watch(b, ms(1000), ["b"]).unwrap();
        armed.store(true, Ordering::SeqCst);
        assert_eq!(p.try_complete_reached(&"a", 45), 1);
        assert_eq!(*told.lock().unwrap(), [Some(45), Some(50)]);
        assert_eq!(ha.await, Ok(Completion::Completed(50)));
        assert!(!hb.is_finished());
        assert_eq!((p.metrics().panicked, q.metrics().panicked), (0, 0));
    });
}

/// B's check makes A ready, walks A's key and then panics; A's check, which
/// ran B's, panics too: A still checks once more, and completes. Both
/// panics are caught and counted.
#[test]
fn a_nested_check_that_panics_after_asking_still_reruns_the_outer() {
    paused_within(20, || async {
        let p: P = Purgatory::new();
        let s = slot_of(&p);
        let a_ready = Arc::new(AtomicBool::new(false));
        let armed = Arc::new(AtomicBool::new(false));
        let b = {
            let (s, a_ready, armed) = (s.clone(), a_ready.clone(), armed.clone());
            Op::new(move |_| {
                if armed.load(Ordering::SeqCst) {
                    a_ready.store(true, Ordering::SeqCst);
                    s.get().unwrap().try_complete_watched(&"a");
                    panic!("B panics after asking");
                }
                None
            })
        };
        let a = {
            let (s, a_ready, armed) = (s.clone(), a_ready.clone(), armed.clone());
            Op::new(move |_| {
                let ready = a_ready.load(Ordering::SeqCst);
                if armed.load(Ordering::SeqCst) && !ready {
                    s.get().unwrap().try_complete_watched(&"b");
                    panic!("A panics too");
                }
                ready.then_some(1)
            })
        };
        let _hb = p.try_complete_else_watch(b, ms(1000), ["b"]).unwrap();
        let ha = p.try_complete_else_watch(a, ms(1000), ["a"]).unwrap();
        armed.store(true, Ordering::SeqCst);
        assert_eq!(p.try_complete_watched(&"a"), 1);
        armed.store(false, Ordering::SeqCst);
        assert_eq!(ha.await, Ok(Completion::Completed(1)));
        assert_eq!(p.metrics().panicked, 2);
    });
}

/// A's check (held on thread W) walks "b", whose check advances "a" from
/// inside, asking A to check once more; meanwhile this thread cancels A.
/// The cancel wins over that re-run: A is cancelled once, its handle says
/// so, and nothing is left pending of it.
#[test]
fn a_cancel_racing_a_rerun_asked_from_inside_wins_once() {
    paused_within(20, || async {
        let p: P = Purgatory::new();
        let s = slot_of(&p);
        let armed = Arc::new(AtomicBool::new(false));
        let b = {
            let (s, armed) = (s.clone(), armed.clone());
            Op::new(move |_| {
                if armed.load(Ordering::SeqCst) {
                    s.get().unwrap().try_complete_reached(&"a", 5);
                }
                None
            })
        };
        let _hb = p.try_complete_else_watch(b, ms(1000), ["b"]).unwrap();
        let gate = Gate::new();
        let a_checks = Arc::new(AtomicUsize::new(0));
        let mut a = {
            let (s, armed, gate) = (s.clone(), armed.clone(), gate.clone());
            Op::new(move |_| {
                if armed.load(Ordering::SeqCst) {
                    s.get().unwrap().try_complete_watched(&"b");
                    armed.store(false, Ordering::SeqCst);
                    gate.hold();
                }
                None
            })
        };
        a.checks = a_checks.clone();
        let ha = p.try_complete_else_watch(a, ms(1000), ["a"]).unwrap();
        assert_eq!(
            a_checks.load(Ordering::SeqCst),
            2,
            "two checks at registration"
        );
        let r = ha.op_ref().unwrap();
        armed.store(true, Ordering::SeqCst);
        let w = {
            let p = p.clone();
            std::thread::spawn(move || p.try_complete_watched(&"a"))
        };
        gate.reached();
        assert!(r.cancel().is_none(), "left to the running check");
        gate.open();
        assert_eq!(w.join().unwrap(), 0);
        assert_eq!(ha.await, Err(OperationError::Cancelled));
        assert_eq!(
            a_checks.load(Ordering::SeqCst),
            3,
            "no re-run after the cancel"
        );
        let m = p.metrics();
        assert_eq!((m.cancelled, m.delayed, m.panicked), (1, 1, 0), "{m:?}");
    });
}

// ---------------------------------------------------------------------------
// Rings and lines of checks walking each other's keys.

/// `n` operations in a line, watching keys `0..n`; the check of each walks
/// both neighbours' keys every time it runs (and never completes). One
/// outside event on key 0: the checks it cost, and whether they passed
/// `cap` (where the checks stop walking, so that the test ends).
fn line_of_neighbours(n: usize, cap: usize) -> (usize, bool) {
    let rt = support::paused();
    let _in = rt.enter();
    let p: Purgatory<usize, Op> = Purgatory::new();
    let s = slot_of(&p);
    let total = Arc::new(AtomicUsize::new(0));
    let armed = Arc::new(AtomicBool::new(false));
    let over = Arc::new(AtomicBool::new(false));
    let mut hs = Vec::new();
    for i in 0..n {
        let (s, total, armed, over) = (s.clone(), total.clone(), armed.clone(), over.clone());
        let op = Op::new(move |_| {
            if armed.load(Ordering::SeqCst) {
                if total.fetch_add(1, Ordering::SeqCst) >= cap {
                    over.store(true, Ordering::SeqCst);
                    return None;
                }
                let p = s.get().unwrap();
                if i > 0 {
                    p.try_complete_watched(&(i - 1));
                }
                if i + 1 < n {
                    p.try_complete_watched(&(i + 1));
                }
            }
            None
        });
        hs.push(p.try_complete_else_watch(op, ms(1000), [i]).unwrap());
    }
    armed.store(true, Ordering::SeqCst);
    p.try_complete_watched(&0);
    armed.store(false, Ordering::SeqCst);
    let t = total.load(Ordering::SeqCst);
    assert_eq!(p.metrics().panicked, 0, "line of {n}");
    assert_eq!(p.shutdown().len(), n, "line of {n}: all still pending");
    (t, over.load(Ordering::SeqCst))
}

/// A line of n operations whose checks walk both neighbours' keys every
/// time they run: one outside event reaches every one of them, and ends.
/// Each check it reaches re-runs at most once and what those re-runs reach
/// asks for none, which costs about n²/2 checks (13 for 4, 494 for 30):
/// at most n², never the count that doubles with each one in the line.
#[test]
fn a_line_of_neighbours_walking_each_other_ends_at_a_bounded_cost() {
    within(20, || {
        for n in [1, 2, 4, 8, 12, 14, 30] {
            let (t, over) = line_of_neighbours(n, 100_000);
            assert!(!over, "a line of {n} passed 100,000 checks for one event");
            assert!(
                (n..=n * n).contains(&t),
                "a line of {n} cost {t} checks for one event (n..=n² expected)"
            );
        }
    });
}

/// A ring A -> B -> C -> ... -> A, each check walking the next one's key
/// every time it runs: one outside event checks each at least once and at
/// most twice, and ends.
#[test]
fn a_ring_of_checks_ends_with_each_at_most_twice() {
    within(20, || {
        let rt = support::paused();
        let _in = rt.enter();
        for n in [2usize, 3, 5, 17] {
            let p: Purgatory<usize, Op> = Purgatory::new();
            let s = slot_of(&p);
            let armed = Arc::new(AtomicBool::new(false));
            let mut counts = Vec::new();
            let mut hs = Vec::new();
            for i in 0..n {
                let (s, armed) = (s.clone(), armed.clone());
                let mut op = Op::new(move |_| {
                    if armed.load(Ordering::SeqCst) {
                        s.get().unwrap().try_complete_watched(&((i + 1) % n));
                    }
                    None
                });
                let c = Arc::new(AtomicUsize::new(0));
                op.checks = c.clone();
                counts.push(c);
                hs.push(p.try_complete_else_watch(op, ms(1000), [i]).unwrap());
            }
            let before: Vec<usize> = counts.iter().map(|c| c.load(Ordering::SeqCst)).collect();
            armed.store(true, Ordering::SeqCst);
            p.try_complete_watched(&0);
            armed.store(false, Ordering::SeqCst);
            let after: Vec<usize> = counts
                .iter()
                .zip(&before)
                .map(|(c, b)| c.load(Ordering::SeqCst) - b)
                .collect();
            assert!(
                after.iter().all(|&c| (1..=2).contains(&c)),
                "ring of {n}: {after:?}"
            );
            assert_eq!(p.metrics().panicked, 0, "ring of {n}");
            assert_eq!(p.shutdown().len(), n, "ring of {n}: all still pending");
        }
    });
}

/// N's check walks "b" every time it runs; B's check walks "n" every time.
/// Each check an event reaches re-runs at most once, the re-run asked from
/// inside running quiet (what it reaches asks for none): a walk of "n" from
/// outside runs N twice, and N's registration runs it three times (its
/// first check, its second once it watches, one quiet re-run), not four.
#[test]
fn a_registrations_rerun_asked_from_inside_runs_quiet() {
    paused_within(20, || async {
        let p: P = Purgatory::new();
        let s = slot_of(&p);
        let b = {
            let s = s.clone();
            Op::new(move |_| {
                s.get().unwrap().try_complete_watched(&"n");
                None
            })
        };
        let hb = p.try_complete_else_watch(b, ms(1000), ["b"]).unwrap();
        let n = {
            let s = s.clone();
            Op::new(move |_| {
                s.get().unwrap().try_complete_watched(&"b");
                None
            })
        };
        let n_checks = n.checks.clone();
        let hn = p.try_complete_else_watch(n, ms(1000), ["n"]).unwrap();
        let at_registration = n_checks.swap(0, Ordering::SeqCst);
        p.try_complete_watched(&"n");
        let per_walk = n_checks.load(Ordering::SeqCst);
        assert_eq!(per_walk, 2, "a walk: the check and one quiet re-run");
        assert_eq!(
            at_registration, 3,
            "registration: first check, second check, one quiet re-run"
        );
        assert!(!hb.is_finished() && !hn.is_finished());
        assert_eq!(p.metrics().panicked, 0);
    });
}

/// A ring whose last check makes the first one ready (and walks its key):
/// the first completes within the same outside event.
#[test]
fn a_ring_whose_last_readies_the_first_completes_it() {
    paused_within(20, || async {
        for n in [2usize, 3, 6] {
            let p: Purgatory<usize, Op> = Purgatory::new();
            let s = slot_of(&p);
            let armed = Arc::new(AtomicBool::new(false));
            let first_ready = Arc::new(AtomicBool::new(false));
            let mut hs = Vec::new();
            for i in 0..n {
                let (s, armed, first_ready) = (s.clone(), armed.clone(), first_ready.clone());
                let op = Op::new(move |_| {
                    let ready = i == 0 && first_ready.load(Ordering::SeqCst);
                    if armed.load(Ordering::SeqCst) {
                        if i == n - 1 {
                            first_ready.store(true, Ordering::SeqCst);
                        }
                        s.get().unwrap().try_complete_watched(&((i + 1) % n));
                    }
                    ready.then_some(i as u32)
                });
                hs.push(p.try_complete_else_watch(op, ms(1000), [i]).unwrap());
            }
            armed.store(true, Ordering::SeqCst);
            assert_eq!(p.try_complete_watched(&0), 1, "ring of {n}");
            armed.store(false, Ordering::SeqCst);
            assert!(hs[0].is_finished(), "ring of {n}: the first was readied");
            assert_eq!(p.metrics().panicked, 0, "ring of {n}");
            assert_eq!(p.shutdown().len(), n - 1, "ring of {n}: the rest pending");
        }
    });
}
