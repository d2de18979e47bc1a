//! The wake protocol between inserts and the reaper task.
//!
//! [`WakeTarget`] holds the tick the reaper will next wake at, and a bit saying the
//! reaper is in a turn (awake, and will read the target again before sleeping).
//! An insert lowers the target with a compare-and-swap, and notifies the reaper
//! only when it lowered the target of a reaper that is *asleep*. An insert during
//! a turn (a task rescheduling itself, or a producer racing the reaper) lowers the
//! target silently, and the reaper picks it up when it ends the turn: one wake-up
//! per distinct due time. Inserts later than the target cost one atomic load.
//! Tokio's `Notify` keeps a permit, so a notification sent between the end of a
//! turn and the start of the sleep is not lost.
//!
//! The reaper sleeps on Tokio's timer, which has millisecond resolution: a
//! sleeper wakes up to about two milliseconds after the instant it asked for.
//! Inserts read the clock anyway, so an insert that finds the target passed while
//! the reaper sleeps claims the turn ([`WakeTarget::overdue`]) and notifies: under
//! load, the load itself wakes the reaper within a tick of what is due.
//!
//! A reaper shared by several cores begins every core's turn before it serves
//! any (a task of one core scheduling on another lowers that core's target
//! silently), clears the hub's alarm as it wakes (before it lists the cores:
//! one attached meanwhile is not served in that turn), and sets the alarm to
//! the instant it then sleeps until: an insert that lowers a sleeping core's
//! target notifies only when the reaper would sleep past it (another core may
//! hold an earlier target). Loom checks the protocol (`loom_wake`).

use std::sync::atomic::Ordering;

use crate::sync::AtomicU64;

/// A tick meaning "nothing scheduled": the largest the wake target holds.
pub(crate) const NEVER: u64 = TURNING - 1;
/// Set while the reaper is in a turn.
const TURNING: u64 = 1 << 63;

/// The reaper's next wake-up tick, and whether it is in a turn (see the module's
/// wake protocol).
#[derive(Debug)]
pub(crate) struct WakeTarget(AtomicU64);

impl WakeTarget {
    pub(crate) fn new() -> WakeTarget {
        WakeTarget(AtomicU64::new(NEVER))
    }

    /// An entry due at `tick` was inserted (after it is in the wheel). Lowers the
    /// target to `tick`; returns whether the reaper must be notified: it is asleep
    /// and would wake later than `tick`.
    #[inline]
    pub(crate) fn lower(&self, tick: u64) -> bool {
        let tick = tick.min(NEVER);
        let mut cur = self.0.load(Ordering::SeqCst);
        loop {
            if tick >= cur & NEVER {
                return false;
            }
            match self.0.compare_exchange_weak(
                cur,
                (cur & TURNING) | tick,
                Ordering::SeqCst,
                Ordering::SeqCst,
            ) {
                Ok(_) => return cur & TURNING == 0,
                Err(actual) => cur = actual,
            }
        }
    }

    /// The reaper starts a turn: inserts from now on lower the target silently.
    pub(crate) fn begin_turn(&self) {
        // A read-modify-write, like every other change of the target: with a plain
        // store, loom found an insert inside the turn reading the value a racing
        // insert wrote before the turn began, and notifying.
        self.0.swap(TURNING | NEVER, Ordering::SeqCst);
    }

    /// A caller whose clock reads `now` finds the target passed while the reaper
    /// sleeps (Tokio's timer wakes a sleeper up to about two milliseconds after
    /// the instant asked for): claims the turn, as [`begin_turn`](Self::begin_turn)
    /// would, and returns true so that the caller notifies the reaper at once. A
    /// caller that finds the target ahead, or a turn already claimed, pays one
    /// atomic load. While claimed, inserts lower the target silently, as during a
    /// turn; the notification makes the reaper take the turn that ends the claim.
    #[inline]
    pub(crate) fn overdue(&self, now: u64) -> bool {
        let cur = self.0.load(Ordering::SeqCst);
        if cur & TURNING != 0 || cur & NEVER > now {
            return false;
        }
        self.0
            .compare_exchange(cur, cur | TURNING, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
    }

    /// Whether the reaper is out of a turn with nothing scheduled: it sleeps,
    /// or is about to, until an insert notifies it. A read-modify-write of
    /// the caller's own, made before this `SeqCst` load, and the reaper's end
    /// of a turn that left the target so (a `SeqCst` read-modify-write, and
    /// then its own `SeqCst` loads) cannot miss each other: either this reads
    /// the target so, or the reaper's loads after it see the caller's write.
    #[inline]
    pub(crate) fn sleeps_with_nothing(&self) -> bool {
        self.0.load(Ordering::SeqCst) == NEVER
    }

    /// The reaper ends a turn, having found `next` as the earliest due tick in the
    /// wheels: returns the tick to sleep until, the earlier of `next` and anything
    /// inserted during the turn. Inserts from now on notify.
    pub(crate) fn end_turn(&self, next: u64) -> u64 {
        let next = next.min(NEVER);
        let mut cur = self.0.load(Ordering::SeqCst);
        loop {
            let target = (cur & NEVER).min(next);
            match self
                .0
                .compare_exchange_weak(cur, target, Ordering::SeqCst, Ordering::SeqCst)
            {
                Ok(_) => return target,
                Err(actual) => cur = actual,
            }
        }
    }
}

#[cfg(all(test, purgatory_loom))]
mod loom_wake {
    //! The wake protocol under loom: the reaper's turn (read the wheels, end the
    //! turn, sleep on the target unless notified) racing an insert from another
    //! thread. The insert is never slept through, and an insert made inside the
    //! turn leaves no notification behind.

    use super::WakeTarget;
    use loom::sync::atomic::{AtomicBool, AtomicU64};
    use loom::sync::{Arc, Mutex};
    use loom::thread;
    use std::sync::atomic::Ordering::SeqCst;

    /// The wheels, reduced to their earliest tick.
    struct Model {
        wake: WakeTarget,
        wheel: Mutex<u64>,
        /// `Notify`'s permit.
        permit: AtomicBool,
        /// The tick the reaper went to sleep on.
        slept_until: AtomicU64,
    }

    /// Returns whether it notified.
    fn insert(m: &Model, tick: u64) -> bool {
        {
            let mut w = m.wheel.lock().unwrap();
            *w = (*w).min(tick);
        }
        let notify = m.wake.lower(tick);
        if notify {
            m.permit.store(true, SeqCst);
        }
        notify
    }

    fn reaper_turn(m: &Model) {
        m.wake.begin_turn();
        let next = *m.wheel.lock().unwrap();
        m.slept_until.store(m.wake.end_turn(next), SeqCst);
    }

    fn model() -> Arc<Model> {
        Arc::new(Model {
            wake: WakeTarget::new(),
            wheel: Mutex::new(u64::MAX),
            permit: AtomicBool::new(false),
            slept_until: AtomicU64::new(0),
        })
    }

    #[test]
    fn loom_an_insert_racing_a_turn_is_never_slept_through() {
        loom::model(|| {
            let m = model();
            let t = {
                let m = m.clone();
                thread::spawn(move || {
                    insert(&m, 10);
                })
            };
            reaper_turn(&m);
            t.join().unwrap();
            let slept = m.slept_until.load(SeqCst);
            assert!(
                slept <= 10 || m.permit.load(SeqCst),
                "slept until {slept} with an entry due at 10 and no notification"
            );
        });
    }

    /// A caller that finds the reaper overdue claims the turn and notifies, while
    /// the reaper ends its turn and an insert races both: the claim never leaves
    /// the reaper asleep with the turn bit set (which would silence every later
    /// insert), and the insert is not slept through.
    #[test]
    fn loom_an_overdue_claim_racing_a_turn_and_an_insert_loses_no_wake_up() {
        loom::model(|| {
            let m = model();
            // The reaper slept until tick 5 and is late; the wheel's earliest
            // entry is at 9 by now (the one at 5 was removed: the target is a
            // lower bound).
            m.wake.begin_turn();
            m.wake.end_turn(5);
            *m.wheel.lock().unwrap() = 9;
            let poker = {
                let m = m.clone();
                thread::spawn(move || {
                    if m.wake.overdue(7) {
                        m.permit.store(true, SeqCst);
                    }
                })
            };
            let producer = {
                let m = m.clone();
                thread::spawn(move || {
                    insert(&m, 3);
                })
            };
            // The reaper wakes on its own timer meanwhile.
            reaper_turn(&m);
            poker.join().unwrap();
            producer.join().unwrap();
            // The reaper sleeps: a permit wakes it for one more turn.
            if m.permit.swap(false, SeqCst) {
                reaper_turn(&m);
            }
            let slept = m.slept_until.load(SeqCst);
            assert!(slept <= 3, "slept until {slept} with an entry due at 3");
            assert!(
                m.wake.lower(1),
                "a sleeping reaper must be reachable by the next insert"
            );
        });
    }

    #[test]
    fn loom_an_insert_during_the_turn_leaves_no_notification() {
        loom::model(|| {
            let m = model();
            // Another producer races the whole time.
            let t = {
                let m = m.clone();
                thread::spawn(move || {
                    insert(&m, 50);
                })
            };
            // A task run by the reaper reschedules itself inside the turn.
            m.wake.begin_turn();
            let notified = insert(&m, 20);
            let next = *m.wheel.lock().unwrap();
            let target = m.wake.end_turn(next);
            t.join().unwrap();
            assert!(target <= 20, "the rescheduled entry is slept until");
            assert!(!notified, "an insert inside the turn woke the reaper again");
        });
    }

    /// Two cores on one shared reaper, as `run_reaper` serves them: the hub's
    /// alarm cleared as the task wakes, every turn begun before any core is
    /// served, each turn ended, the alarm set to the earliest target.
    /// An insert into the second core (a task of the first running in the
    /// turn, or a producer racing it) notifies only when the reaper would
    /// sleep past it (`Hub::sleeps_past`): it is never slept through, and one
    /// made inside the turn leaves no notification.
    #[test]
    fn loom_a_shared_reaper_never_sleeps_through_an_insert_into_another_core() {
        struct Shared {
            a: Model,
            b: Model,
            /// The hub's alarm: `None` between turns' ends and the sleep.
            alarm: Mutex<Option<u64>>,
        }
        fn insert_b(m: &Shared, tick: u64) -> bool {
            {
                let mut w = m.b.wheel.lock().unwrap();
                *w = (*w).min(tick);
            }
            let earlier =
                m.b.wake.lower(tick) && m.alarm.lock().unwrap().is_none_or(|at| tick < at);
            if earlier {
                m.a.permit.store(true, SeqCst);
            }
            earlier
        }
        fn turn(m: &Shared) -> u64 {
            *m.alarm.lock().unwrap() = None;
            m.a.wake.begin_turn();
            m.b.wake.begin_turn();
            let (next_a, next_b) = (*m.a.wheel.lock().unwrap(), *m.b.wheel.lock().unwrap());
            let at = m.a.wake.end_turn(next_a).min(m.b.wake.end_turn(next_b));
            *m.alarm.lock().unwrap() = Some(at);
            at
        }
        loom::model(|| {
            let m = Arc::new(Shared {
                a: Model {
                    wake: WakeTarget::new(),
                    wheel: Mutex::new(30),
                    permit: AtomicBool::new(false),
                    slept_until: AtomicU64::new(0),
                },
                b: Model {
                    wake: WakeTarget::new(),
                    wheel: Mutex::new(u64::MAX),
                    permit: AtomicBool::new(false),
                    slept_until: AtomicU64::new(0),
                },
                alarm: Mutex::new(None),
            });
            // The reaper sleeps until 30, the first core's earliest entry:
            // an insert into the second core due later wakes nobody.
            assert_eq!(turn(&m), 30);
            assert!(!insert_b(&m, 40), "an insert past the alarm notified");
            // At 30 the reaper wakes on its own timer and runs the entry due
            // then (the first core's next is at 100), while a producer
            // inserts into the second core an entry due at 35: past the old
            // alarm, before what the reaper would sleep until without it.
            *m.a.wheel.lock().unwrap() = 100;
            let producer = {
                let m = m.clone();
                thread::spawn(move || {
                    insert_b(&m, 35);
                })
            };
            let slept = turn(&m);
            producer.join().unwrap();
            assert!(
                slept <= 35 || m.a.permit.load(SeqCst),
                "slept until {slept} with an entry due at 35 and no notification"
            );
            // A task of the first core scheduling on the second inside the
            // turn leaves no notification behind.
            m.a.permit.store(false, SeqCst);
            m.a.wake.begin_turn();
            m.b.wake.begin_turn();
            assert!(!insert_b(&m, 5), "an insert inside the turn notified");
        });
    }
}

#[cfg(all(test, not(purgatory_loom)))]
mod tests {
    use super::*;

    /// The wake protocol's answers, one step at a time: who must be notified,
    /// and what the reaper sleeps until after a turn.
    #[test]
    fn the_wake_target_notifies_only_a_sleeping_reaper_about_earlier_work() {
        let w = WakeTarget::new();
        assert!(w.lower(100), "asleep on nothing: notify");
        assert!(!w.lower(200), "later than the target: no");
        assert!(!w.lower(100), "the same tick: no");
        assert!(w.lower(50), "earlier: notify");
        w.begin_turn();
        assert!(!w.lower(10), "during a turn: lowered silently");
        assert!(!w.lower(30), "later than what the turn holds: no");
        assert_eq!(w.end_turn(70), 10, "the turn's insert is kept");
        assert!(!w.lower(20));
        assert!(w.lower(5));
        w.begin_turn();
        assert_eq!(w.end_turn(40), 40, "a turn starts from nothing");
        w.begin_turn();
        assert_eq!(w.end_turn(u64::MAX), NEVER, "nothing scheduled");
        assert!(!w.lower(u64::MAX), "never is not earlier than never");
    }

    /// An overdue target is claimed once: the first caller to see it notifies,
    /// later ones and callers during a turn do not, and the turn the claim asks
    /// for ends it.
    #[test]
    fn an_overdue_target_is_claimed_once() {
        let w = WakeTarget::new();
        assert!(!w.overdue(1_000), "nothing scheduled is never overdue");
        assert!(w.lower(100));
        assert!(!w.overdue(99), "not yet due");
        assert!(w.overdue(100), "due: the first caller claims the turn");
        assert!(!w.overdue(150), "claimed already");
        assert!(!w.lower(50), "inserts during a claim lower silently");
        w.begin_turn();
        // The turn finds the entry due at 50 in the wheel.
        assert_eq!(w.end_turn(50), 50);
        assert!(w.lower(40), "the claim ended: inserts notify again");
        assert!(!w.overdue(39));
        assert!(w.overdue(60));
        w.begin_turn();
        assert!(!w.overdue(1_000), "during a turn: no claim");
        assert_eq!(w.end_turn(u64::MAX), NEVER);
    }
}
