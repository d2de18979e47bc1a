//! The per-operation completion state machine, on its own so that loom can check
//! every interleaving of it (`RUSTFLAGS="--cfg purgatory_loom" cargo test --release --lib loom`).
//!
//! Five bits: `CHECKING` (one caller owns the operation and runs its check),
//! `RERUN` (another caller asked for a check meanwhile), `EXPIRE` and `CANCEL`
//! (the timeout fired, or a cancel arrived, meanwhile), `FINISHED` (terminal).
//!
//! - A check starts only by setting `CHECKING` on a state without it; if it is
//!   set, the caller sets `RERUN` and leaves, and the owner checks once more
//!   before releasing. So checks never overlap and an event that arrives during a
//!   check is never lost (Kafka's KAFKA-6653).
//! - Expiry and cancellation claim the operation (`-> FINISHED`) when no check runs;
//!   if one does, they leave a request bit and the owner acts on it after its check
//!   returns "not yet". So expiry code never runs beside a check (KAFKA-19312),
//!   and a check that succeeds wins over a concurrent timeout.
//! - Whoever sets `FINISHED` alone finishes the operation: exactly once.
//!
//! The owner's thread is recorded while it checks, so that its own check calling
//! back into itself (walking its own key) is not taken for an outside event: a
//! re-run for that would loop forever.

use std::sync::atomic::Ordering;

use crate::sync::{AtomicU64, AtomicU8};

const CHECKING: u8 = 1;
const RERUN: u8 = 2;
/// Request bit: the timeout fired during a check.
pub(crate) const EXPIRE: u8 = 4;
/// Request bit: a cancel arrived during a check.
pub(crate) const CANCEL: u8 = 8;
const FINISHED: u8 = 16;

/// What a check that returned "not yet" must do next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AfterNotYet {
    /// Another caller asked for a check meanwhile: run it again.
    Recheck,
    /// Nothing was asked: the operation is released, still pending.
    Release,
    /// A cancel arrived meanwhile: the caller now owns it (`FINISHED`) and cancels it.
    Cancel,
    /// The timeout fired meanwhile: the caller now owns it (`FINISHED`) and expires it.
    Expire,
}

/// What a claim (by expiry or cancellation) found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Claim {
    /// The caller owns the operation now (`FINISHED`).
    Won,
    /// A check is running; it will act on the request when it returns "not yet".
    Deferred,
    /// Already finished.
    Finished,
}

#[derive(Debug)]
pub(crate) struct State {
    bits: AtomicU8,
    /// How it finished (a `Fate` code, 0 until recorded), recorded by whoever
    /// set `FINISHED` before any user code runs after it. Outside the protocol
    /// above: only read for status reports.
    fate: AtomicU8,
    /// The checking thread's id while `CHECKING` is set, else 0.
    checker: AtomicU64,
}

impl State {
    #[cfg(all(test, purgatory_loom))]
    pub(crate) fn new() -> State {
        State {
            bits: AtomicU8::new(0),
            fate: AtomicU8::new(0),
            checker: AtomicU64::new(0),
        }
    }

    /// The state of a cell never used: finished, as a freed one is.
    pub(crate) fn unused() -> State {
        State {
            bits: AtomicU8::new(FINISHED),
            fate: AtomicU8::new(0),
            checker: AtomicU64::new(0),
        }
    }

    /// A state whose check is already owned by thread `me` (a registration, which
    /// runs the operation's second check itself once it is watched).
    #[cfg(all(test, purgatory_loom))]
    pub(crate) fn checked_by(me: u64) -> State {
        State {
            bits: AtomicU8::new(CHECKING),
            fate: AtomicU8::new(0),
            checker: AtomicU64::new(me),
        }
    }

    /// Makes this state that of a new registration whose check thread `me`
    /// owns (as [`checked_by`](Self::checked_by)), for a cell nothing else can
    /// reach yet (a slab cell being reused).
    pub(crate) fn restart(&self, me: u64) {
        self.fate.store(0, Ordering::Relaxed);
        self.checker.store(me, Ordering::Relaxed);
        self.bits.store(CHECKING, Ordering::Release);
    }

    /// Records how the operation finished (`code` > 0), by whoever set
    /// `FINISHED`.
    pub(crate) fn record_fate(&self, code: u8) {
        self.fate.store(code, Ordering::Release);
    }

    /// The recorded fate code, 0 while none is.
    pub(crate) fn fate(&self) -> u8 {
        self.fate.load(Ordering::Acquire)
    }

    pub(crate) fn is_finished(&self) -> bool {
        self.bits.load(Ordering::Acquire) & FINISHED != 0
    }

    /// Tries to become the checker (thread `me`, never 0). Returns `false` when the
    /// operation is finished, when another caller checks it (it is asked to check
    /// again), or when `me` is that caller re-entering its own check.
    pub(crate) fn begin_check(&self, me: u64) -> bool {
        let mut s = self.bits.load(Ordering::Acquire);
        loop {
            let want = if s & FINISHED != 0 {
                return false;
            } else if s & CHECKING != 0 {
                if self.checker.load(Ordering::Acquire) == me {
                    return false;
                }
                s | RERUN
            } else {
                s | CHECKING
            };
            match self
                .bits
                .compare_exchange(s, want, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) if s & CHECKING != 0 => return false,
                Ok(_) => {
                    self.checker.store(me, Ordering::Release);
                    return true;
                }
                Err(actual) => s = actual,
            }
        }
    }

    /// The owner's check completed the operation. Requests left meanwhile lose.
    pub(crate) fn complete(&self) {
        self.checker.store(0, Ordering::Release);
        // A read-modify-write, like every other transition of `bits`: a plain
        // store racing a requester's CAS is where loom found the state left at
        // CHECKING|RERUN after completion.
        self.bits.swap(FINISHED, Ordering::AcqRel);
    }

    /// The owner gives the operation up unfinished (its registration failed):
    /// `FINISHED`, whatever was asked meanwhile. Requests left meanwhile lose, as on
    /// completion.
    pub(crate) fn abandon(&self) {
        self.complete();
    }

    /// The owner's check returned "not yet": release, or act on what was asked.
    pub(crate) fn end_check(&self, me: u64) -> AfterNotYet {
        // Clear the checker first: a thread must never find its own id here unless
        // it really is the one checking (a stale id would make it drop an event).
        self.checker.store(0, Ordering::Release);
        let mut s = self.bits.load(Ordering::Acquire);
        loop {
            let (want, then) = if s & RERUN != 0 {
                (s & !RERUN, AfterNotYet::Recheck)
            } else if s & CANCEL != 0 {
                (FINISHED, AfterNotYet::Cancel)
            } else if s & EXPIRE != 0 {
                (FINISHED, AfterNotYet::Expire)
            } else {
                (0, AfterNotYet::Release)
            };
            match self
                .bits
                .compare_exchange(s, want, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    if then == AfterNotYet::Recheck {
                        self.checker.store(me, Ordering::Release);
                    }
                    return then;
                }
                Err(actual) => s = actual,
            }
        }
    }

    /// Claims the operation for expiry or cancellation (`request` is [`EXPIRE`] or
    /// [`CANCEL`]) unless a check runs, in which case the request is left for it.
    pub(crate) fn claim(&self, request: u8) -> Claim {
        let mut s = self.bits.load(Ordering::Acquire);
        loop {
            let want = if s & FINISHED != 0 {
                return Claim::Finished;
            } else if s & CHECKING != 0 {
                s | request
            } else {
                FINISHED
            };
            match self
                .bits
                .compare_exchange(s, want, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) if want == FINISHED => return Claim::Won,
                Ok(_) => return Claim::Deferred,
                Err(actual) => s = actual,
            }
        }
    }
}

#[cfg(all(test, purgatory_loom))]
mod loom_state {
    use super::*;
    use loom::sync::atomic::{AtomicBool, AtomicUsize};
    use loom::sync::Arc;
    use loom::thread;

    /// How an operation finished, counted per kind.
    #[derive(Default)]
    struct Outcomes {
        completed: AtomicUsize,
        expired: AtomicUsize,
        cancelled: AtomicUsize,
    }

    impl Outcomes {
        fn total(&self) -> usize {
            self.completed.load(Ordering::SeqCst)
                + self.expired.load(Ordering::SeqCst)
                + self.cancelled.load(Ordering::SeqCst)
        }
    }

    /// The purgatory's check, with "completable" read from `ready`.
    fn check(state: &State, me: u64, ready: &AtomicBool, out: &Outcomes) {
        if state.begin_check(me) {
            run_checks(state, me, ready, out);
        }
    }

    /// The check loop of `me`, owner of `CHECKING`.
    fn run_checks(state: &State, me: u64, ready: &AtomicBool, out: &Outcomes) {
        loop {
            if ready.load(Ordering::SeqCst) {
                state.complete();
                out.completed.fetch_add(1, Ordering::SeqCst);
                return;
            }
            match state.end_check(me) {
                AfterNotYet::Recheck => continue,
                AfterNotYet::Release => return,
                AfterNotYet::Cancel => {
                    out.cancelled.fetch_add(1, Ordering::SeqCst);
                    return;
                }
                AfterNotYet::Expire => {
                    out.expired.fetch_add(1, Ordering::SeqCst);
                    return;
                }
            }
        }
    }

    fn claim(state: &State, request: u8, out: &Outcomes) {
        if state.claim(request) == Claim::Won {
            let counter = if request == EXPIRE {
                &out.expired
            } else {
                &out.cancelled
            };
            counter.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// Spawns a thread `me` that checks the operation, making it completable
    /// first when `set_ready` (an event).
    fn spawn_check(
        state: &Arc<State>,
        ready: &Arc<AtomicBool>,
        out: &Arc<Outcomes>,
        me: u64,
        set_ready: bool,
    ) -> thread::JoinHandle<()> {
        let (state, ready, out) = (state.clone(), ready.clone(), out.clone());
        thread::spawn(move || {
            if set_ready {
                ready.store(true, Ordering::SeqCst);
            }
            check(&state, me, &ready, &out);
        })
    }

    /// Spawns a thread that claims the operation for `request` (expiry or cancel).
    fn spawn_claim(state: &Arc<State>, request: u8, out: &Arc<Outcomes>) -> thread::JoinHandle<()> {
        let (state, out) = (state.clone(), out.clone());
        thread::spawn(move || claim(&state, request, &out))
    }

    /// An event (ready, then check) racing another check: the event is never lost,
    /// and the operation completes exactly once.
    #[test]
    fn event_during_a_check_is_not_lost() {
        loom::model(|| {
            let state = Arc::new(State::new());
            let ready = Arc::new(AtomicBool::new(false));
            let out = Arc::new(Outcomes::default());
            let t = spawn_check(&state, &ready, &out, 1, false);
            ready.store(true, Ordering::SeqCst);
            check(&state, 2, &ready, &out);
            t.join().unwrap();
            assert_eq!(out.completed.load(Ordering::SeqCst), 1);
            assert_eq!(out.total(), 1);
            assert!(
                state.is_finished(),
                "bits {} after {} outcomes",
                state.bits.load(Ordering::SeqCst),
                out.total()
            );
        });
    }

    /// A check, an expiry and a cancel all racing: exactly one outcome.
    #[test]
    fn check_expiry_and_cancel_race_to_one_outcome() {
        loom::model(|| {
            let state = Arc::new(State::new());
            let ready = Arc::new(AtomicBool::new(false));
            let out = Arc::new(Outcomes::default());
            let checker = spawn_check(&state, &ready, &out, 1, true);
            let expirer = spawn_claim(&state, EXPIRE, &out);
            claim(&state, CANCEL, &out);
            checker.join().unwrap();
            expirer.join().unwrap();
            assert_eq!(out.total(), 1, "exactly one outcome");
            assert!(
                state.is_finished(),
                "bits {} after {} outcomes",
                state.bits.load(Ordering::SeqCst),
                out.total()
            );
        });
    }

    /// A check that does not complete, racing an expiry: the expiry always
    /// happens (directly, or by the checker after its check), never twice.
    #[test]
    fn expiry_during_a_failing_check_is_done_by_the_checker() {
        loom::model(|| {
            let state = Arc::new(State::new());
            let ready = Arc::new(AtomicBool::new(false));
            let out = Arc::new(Outcomes::default());
            let checker = spawn_check(&state, &ready, &out, 1, false);
            claim(&state, EXPIRE, &out);
            checker.join().unwrap();
            assert_eq!(out.expired.load(Ordering::SeqCst), 1);
            assert_eq!(out.total(), 1);
        });
    }

    /// A check re-entering itself (its code walks its own key) neither loops nor
    /// deadlocks, while another thread's event still triggers a re-check.
    #[test]
    fn reentrant_check_is_ignored_but_foreign_event_is_not() {
        loom::model(|| {
            let state = Arc::new(State::new());
            let ready = Arc::new(AtomicBool::new(false));
            let out = Arc::new(Outcomes::default());
            let other = spawn_check(&state, &ready, &out, 2, true);
            if state.begin_check(1) {
                // Inside our own check: a nested request from this thread.
                assert!(!state.begin_check(1));
                loop {
                    if ready.load(Ordering::SeqCst) {
                        state.complete();
                        out.completed.fetch_add(1, Ordering::SeqCst);
                        break;
                    }
                    if state.end_check(1) != AfterNotYet::Recheck {
                        break;
                    }
                }
            }
            other.join().unwrap();
            assert_eq!(out.completed.load(Ordering::SeqCst), 1, "event not lost");
        });
    }

    /// An event from another thread makes the owner check again, and that
    /// re-check still says "not yet": the operation is released (checkable
    /// again), neither finished nor left marked as being checked.
    #[test]
    fn a_recheck_that_still_fails_releases_the_operation() {
        loom::model(|| {
            let state = Arc::new(State::new());
            let ready = Arc::new(AtomicBool::new(false));
            let out = Arc::new(Outcomes::default());
            let t = spawn_check(&state, &ready, &out, 1, false);
            check(&state, 2, &ready, &out);
            t.join().unwrap();
            assert_eq!(out.total(), 0);
            assert_eq!(state.bits.load(Ordering::SeqCst), 0, "released");
            assert_eq!(state.checker.load(Ordering::SeqCst), 0);
            ready.store(true, Ordering::SeqCst);
            check(&state, 2, &ready, &out);
            assert_eq!(out.completed.load(Ordering::SeqCst), 1);
        });
    }

    /// A registration owns the check from the start (`checked_by`): an event
    /// from another thread before its second check is not lost, and a cancel
    /// meanwhile is left for it.
    #[test]
    fn an_event_or_cancel_during_registration_is_left_for_the_registrar() {
        loom::model(|| {
            let state = Arc::new(State::checked_by(1));
            let ready = Arc::new(AtomicBool::new(false));
            let out = Arc::new(Outcomes::default());
            let event = spawn_check(&state, &ready, &out, 2, true);
            let cancel = spawn_claim(&state, CANCEL, &out);
            run_checks(&state, 1, &ready, &out);
            event.join().unwrap();
            cancel.join().unwrap();
            // The event completed it, or the cancel was acted on (by the registrar
            // if it came during its check): exactly one outcome, never none.
            assert_eq!(out.total(), 1);
            assert!(state.is_finished());
        });
    }
}
