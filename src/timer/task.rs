//! What the wheel holds for the timer: a user's task or a sleep's signal, behind
//! one thin trait object, and the task handed back unrun.

use std::any::Any;
use std::fmt;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};

use std::sync::{Arc, Weak};
use std::task::Waker;
use std::time::Duration;

use tokio::time::Instant;

use super::error::{ScheduleError, TimerError};
use crate::clock::deadline_after;
use crate::contain::{drop_payload, Panics};
use crate::core::{Closed, Core, Job, Refused, TimerKey};
use crate::sync::{lock, Mutex};

/// What the wheel holds: a user's task or a sleep's signal, behind one thin
/// trait object (16 bytes, so a wheel entry stays at 40).
pub(crate) trait TaskFn: Send {
    /// The deadline passed: runs the task, or wakes the sleep. Returns
    /// whether it did its work (`false`: a repeating or async task cancelled
    /// after the reaper's turn took its entry out, which the turn does not
    /// count as an expiry).
    fn call(self: Box<Self>) -> bool;
    /// The caller's own value, so a refused task goes back as the `F` it came as.
    fn into_any(self: Box<Self>) -> Box<dyn Any + Send>;
    /// The timer stopped first: a user's task comes back to be handed over; a
    /// sleep is told why and dropped.
    fn stopped(self: Box<Self>, why: Closed) -> Option<Box<dyn TaskFn>>;
    /// Whether the entry keeps its room under the limit when a turn takes it
    /// out, to give back itself (a repeating task, which goes back in).
    fn keeps_room(&self) -> bool {
        false
    }
}

impl<F: FnOnce() + Send + 'static> TaskFn for F {
    fn call(self: Box<Self>) -> bool {
        (*self)();
        true
    }

    fn into_any(self: Box<Self>) -> Box<dyn Any + Send> {
        self
    }

    fn stopped(self: Box<Self>, _: Closed) -> Option<Box<dyn TaskFn>> {
        Some(self)
    }
}

const WAITING: u8 = 0;
const FIRED: u8 = 1;
const SHUT_DOWN: u8 = 2;
const REAPER_GONE: u8 = 3;
/// The sleep was dropped before it fired: firing it now wakes nobody, and
/// is not counted.
const DROPPED: u8 = 4;

/// What the wheel holds for a [`Sleep`]: the outcome and the waker to call.
///
/// The waker is kept under a plain lock, not in an `AtomicWaker`: a waker's
/// `clone`, `wake` and `Drop` are user code (a waker built from a raw vtable),
/// so they run here with no lock held, and a panic in one leaves the signal
/// as it was (an `AtomicWaker` whose `register` unwound out of a `clone`
/// stays locked, and never wakes anyone again).
#[derive(Default)]
pub(crate) struct SleepSignal {
    state: AtomicU8,
    /// Set once a poll has kept a waker: a sleep never polled (or done at
    /// its first poll) is dropped without taking the waker's lock.
    polled: AtomicBool,
    waker: Mutex<Option<Waker>>,
}

/// The outcome only: the waker's lock is not held while a formatter writes.
impl fmt::Debug for SleepSignal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SleepSignal")
            .field("outcome", &self.outcome())
            .finish_non_exhaustive()
    }
}

impl SleepSignal {
    /// The deadline passed: wakes the sleep. Returns whether it fired (not
    /// when the sleep was dropped first).
    pub(crate) fn fire(&self) -> bool {
        self.finish(FIRED)
    }

    pub(crate) fn abandon(&self, why: Closed) {
        self.finish(match why {
            Closed::Shutdown => SHUT_DOWN,
            Closed::ReaperGone => REAPER_GONE,
        });
    }

    /// The sleep is being dropped unfired: its entry, if a turn took it out
    /// already, fires nothing.
    pub(super) fn dropped(&self) {
        let _ = self
            .state
            .compare_exchange(WAITING, DROPPED, Ordering::AcqRel, Ordering::Acquire);
    }

    fn finish(&self, state: u8) -> bool {
        let won = self
            .state
            .compare_exchange(WAITING, state, Ordering::AcqRel, Ordering::Acquire)
            .is_ok();
        if won {
            let waker = lock(&self.waker).take();
            if let Some(waker) = waker {
                waker.wake();
            }
        }
        won
    }

    /// The outcome, or `None` after registering `waker` to be woken with it.
    /// The waker it replaces is dropped in `panics`.
    pub(super) fn poll_outcome(
        &self,
        waker: &Waker,
        panics: &Panics,
    ) -> Option<Result<(), TimerError>> {
        if let Some(out) = self.outcome() {
            return Some(out);
        }
        let kept = lock(&self.waker)
            .as_ref()
            .is_some_and(|w| w.will_wake(waker));
        if !kept {
            // Cloned with no lock held; the one replaced, dropped likewise.
            let fresh = waker.clone();
            self.polled.store(true, Ordering::Relaxed);
            let old = lock(&self.waker).replace(fresh);
            panics.drop_value("drop of a waker", old);
        }
        // Looked at again: the reaper may have fired before the waker was
        // there (the lock orders its take after this store, or this look
        // after its state).
        self.outcome()
    }

    /// The waker kept from the last poll, if the reaper has not taken it.
    /// Called by the sleep's owner, which also polls it: it sees its own
    /// polls' flag.
    pub(super) fn take_waker(&self) -> Option<Waker> {
        if !self.polled.load(Ordering::Relaxed) {
            return None;
        }
        lock(&self.waker).take()
    }

    pub(super) fn outcome(&self) -> Option<Result<(), TimerError>> {
        match self.state.load(Ordering::Acquire) {
            WAITING | DROPPED => None,
            FIRED => Some(Ok(())),
            SHUT_DOWN => Some(Err(TimerError::Shutdown)),
            _ => Some(Err(TimerError::ReaperGone)),
        }
    }
}

/// A sleep's entry in the wheel.
struct SleepEntry(Arc<SleepSignal>);

impl TaskFn for SleepEntry {
    fn call(self: Box<Self>) -> bool {
        self.0.fire()
    }

    fn into_any(self: Box<Self>) -> Box<dyn Any + Send> {
        self
    }

    fn stopped(self: Box<Self>, why: Closed) -> Option<Box<dyn TaskFn>> {
        self.0.abandon(why);
        None
    }
}

/// A running repeating task's room under the timer's limit: given back
/// when dropped, unless `kept` (the chain went back into the wheel).
struct Room {
    core: Weak<Core<TimerJob>>,
    kept: bool,
}

impl Drop for Room {
    fn drop(&mut self) {
        if !self.kept {
            if let Some(core) = self.core.upgrade() {
                core.give_back_room();
            }
        }
    }
}

/// What a repeating task and its [`TaskHandle`](super::TaskHandle) share: the key of
/// its current entry (`None` while it runs, or once it stopped), and whether it
/// was stopped. The key's lock serialises a rescheduling with a cancel or reset
/// through the handle; no user code runs under it.
#[derive(Debug, Default)]
pub(crate) struct Chain {
    pub(crate) key: Mutex<Option<TimerKey>>,
    pub(crate) stopped: AtomicBool,
}

/// A repeating task in the wheel: runs `f`, and goes back in after the delay it
/// returns. It holds its timer weakly, so it never keeps a dropped timer alive.
pub(crate) struct Repeating<F> {
    pub(crate) f: F,
    pub(crate) chain: Arc<Chain>,
    pub(crate) core: Weak<Core<TimerJob>>,
    /// Handed back by a shutdown: whoever runs it runs it once.
    pub(crate) handed_back: bool,
}

/// Ends a chain when dropped, unless the run rescheduled it: every way out of a
/// run (`f` returned `None`, panicked, or its `Drop` did; the timer is gone or
/// shut down; the handle cancelled it meanwhile) leaves the one state a
/// finished chain has, so [`TaskHandle::cancel`](super::TaskHandle::cancel) finds it
/// stopped and returns `false`. The flag is set under the key's lock, as the
/// handle sets it, so a cancel sees the chain either running or ended.
struct EndsChain {
    chain: Arc<Chain>,
    /// Set when nothing is left for the guard to do: the chain was
    /// rescheduled, or is already marked ended.
    settled: bool,
}

impl Drop for EndsChain {
    fn drop(&mut self) {
        if !self.settled {
            let _key = lock(&self.chain.key);
            self.chain.stopped.store(true, Ordering::Release);
        }
    }
}

impl<F: FnMut() -> Option<Duration> + Send + 'static> TaskFn for Repeating<F> {
    fn call(self: Box<Self>) -> bool {
        let mut me = self;
        if me.handed_back {
            if let Err(panic) = catch_unwind(AssertUnwindSafe(|| (me.f)())) {
                drop_then_resume(me, panic);
            }
            return true;
        }
        // The room the entry held under the limit stays the chain's while it
        // runs (the turn did not give it back), and goes back on every way
        // out but a rescheduling, which keeps it for the next entry.
        let mut room = Room {
            core: me.core.clone(),
            kept: false,
        };
        // The entry left the wheel: its key is stale.
        lock(&me.chain.key).take();
        if me.chain.stopped.load(Ordering::Acquire) {
            // Cancelled after the turn took the entry out: it does not run.
            return false;
        }
        // Declared after `me`, so dropped before it: the chain reads as ended
        // before the task (user code) is dropped. A panic in `f` ends the
        // chain too (the reaper contains and counts the panic).
        let mut end = EndsChain {
            chain: me.chain.clone(),
            settled: false,
        };
        let delay = match catch_unwind(AssertUnwindSafe(|| (me.f)())) {
            Ok(delay) => delay,
            Err(panic) => {
                drop(end);
                drop_then_resume(me, panic);
            }
        };
        let Some(delay) = delay else {
            return true;
        };
        let Some(core) = me.core.upgrade() else {
            return true;
        };
        let mut key = lock(&end.chain.key);
        if end.chain.stopped.load(Ordering::Acquire) {
            // Cancelled while it ran: `me` is dropped after the lock is gone.
            end.settled = true;
            drop(key);
            return true;
        }
        let now = Instant::now();
        // The new entry takes the room over (given back by the core if it is
        // closed).
        room.kept = true;
        match core.reinsert(now, deadline_after(now, delay), TimerJob(me)) {
            Ok(moved) => {
                *key = Some(moved);
                end.settled = true;
            }
            Err(job) => {
                // The timer was shut down meanwhile: the chain ends, marked
                // under the lock still held (a cancel sees it ended, not
                // running), and the task is dropped once the lock is gone.
                end.chain.stopped.store(true, Ordering::Release);
                end.settled = true;
                drop(key);
                drop(job);
            }
        }
        true
    }

    fn into_any(self: Box<Self>) -> Box<dyn Any + Send> {
        Box::new(self.f)
    }

    fn keeps_room(&self) -> bool {
        !self.handed_back
    }

    fn stopped(mut self: Box<Self>, _: Closed) -> Option<Box<dyn TaskFn>> {
        // Under the key's lock, as a cancel through the handle sets it: a
        // cancel that came after the shutdown took the entry out, and
        // before this, stopped the chain (it returned `true`), so the task
        // is not handed back to run: it is dropped here, where the caller
        // contains a panic in its `Drop` as it does for the tasks it drops.
        let cancelled = {
            let _key = lock(&self.chain.key);
            self.chain.stopped.swap(true, Ordering::AcqRel)
        };
        if cancelled {
            return None;
        }
        self.handed_back = true;
        Some(self)
    }
}

/// A repeating task's closure panicked: drops the task with a panic in its
/// `Drop` caught and counted (one raised while the first unwound would abort
/// the process), then lets the first panic go on to the reaper, which counts
/// it too.
fn drop_then_resume<F>(me: Box<Repeating<F>>, panic: Box<dyn Any + Send>) -> ! {
    let core = me.core.clone();
    if let Err(again) = catch_unwind(AssertUnwindSafe(move || drop(me))) {
        match core.upgrade() {
            Some(core) => core.panics.caught("drop of a task", again),
            None => drop_payload(again),
        }
    }
    resume_unwind(panic)
}

/// A task as the wheel holds it.
pub(crate) struct TimerJob(pub(super) Box<dyn TaskFn>);

impl TimerJob {
    pub(crate) fn sleep(signal: Arc<SleepSignal>) -> TimerJob {
        TimerJob(Box::new(SleepEntry(signal)))
    }
}

impl fmt::Debug for TimerJob {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("TimerJob(..)")
    }
}

impl Job for TimerJob {
    const KIND: &'static str = "timer";
    type Ctx = ();

    fn expire(self, _: &(), _: Option<std::time::Duration>) -> bool {
        self.0.call()
    }

    fn keeps_room(&self) -> bool {
        self.0.keeps_room()
    }

    fn abandon(self, _: &(), why: Closed) {
        // A user's task is dropped unrun (`Timer::shutdown` hands them back
        // instead); a sleep resolves with the reason.
        drop(self.0.stopped(why));
    }
}

/// Turns a refused insert back into the caller's task.
pub(super) fn refused_task<F: 'static>(refused: Refused<TimerJob>) -> ScheduleError<F> {
    let unbox = |job: TimerJob| -> F {
        *job.0
            .into_any()
            .downcast::<F>()
            .expect("a refused task is the one just boxed")
    };
    match refused {
        Refused::AtCapacity(job) => ScheduleError::AtCapacity(unbox(job)),
        Refused::Closed(job, Closed::Shutdown) => ScheduleError::Shutdown(unbox(job)),
        Refused::Closed(job, Closed::ReaperGone) => ScheduleError::ReaperGone(unbox(job)),
    }
}

/// A task handed back without having run: by
/// [`Timer::shutdown`](super::Timer::shutdown), for every task still waiting,
/// and by [`TaskHandle::cancel_and_take`](super::TaskHandle::cancel_and_take),
/// for the one it cancels.
///
/// [`run`](UnrunTask::run) runs it here and now; [`into_inner`](UnrunTask::into_inner)
/// turns it into a closure to run elsewhere. Dropping it drops the task unrun,
/// on the dropping thread: the timer no longer owns it, so a panic in the task's
/// `Drop` is not caught and counted by the timer but reaches the caller, as with
/// any value of the caller's. A future from
/// [`Timer::schedule_async`](super::Timer::schedule_async) is then dropped
/// unpolled, and its [`AsyncTaskHandle`](super::AsyncTaskHandle) reads finished.
///
/// A repeating task ([`Timer::schedule_repeating`](super::Timer::schedule_repeating))
/// handed back by a shutdown runs once when run, and is not scheduled again.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
/// use std::sync::atomic::{AtomicU32, Ordering};
/// use std::sync::Arc;
/// use std::time::Duration;
/// use tokio_purgatory::Timer;
///
/// let timer = Timer::new();
/// let runs = Arc::new(AtomicU32::new(0));
/// let (a, b) = (runs.clone(), runs.clone());
/// let retry = timer
///     .schedule(Duration::from_secs(5), move || { a.fetch_add(1, Ordering::SeqCst); })
///     .unwrap();
/// timer
///     .schedule(Duration::from_secs(60), move || { b.fetch_add(1, Ordering::SeqCst); })
///     .unwrap();
///
/// // Taken back from a handle: run it now instead of in 5 s.
/// retry.cancel_and_take().unwrap().run();
/// // Handed back by a shutdown: dropped here, unrun.
/// let left = timer.shutdown();
/// assert_eq!(left.len(), 1);
/// drop(left);
/// assert_eq!(runs.load(Ordering::SeqCst), 1);
/// # }
/// ```
pub struct UnrunTask {
    pub(super) task: Box<dyn TaskFn>,
}

impl UnrunTask {
    /// Runs the task now, on the calling thread. A future scheduled with
    /// [`Timer::schedule_async`](super::Timer::schedule_async) is spawned as
    /// a Tokio task: on the runtime the calling thread is in, or, called
    /// outside any runtime, on the one that was current where it was
    /// scheduled. If there is none (or that runtime has shut down), it is
    /// dropped unrun and its handle reads finished.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// use std::time::Duration;
    /// let timer = tokio_purgatory::Timer::new();
    /// timer.schedule(Duration::from_secs(60), || println!("flushed")).unwrap();
    /// for task in timer.shutdown() {
    ///     task.run(); // here, now
    /// }
    /// # }
    /// ```
    pub fn run(self) {
        self.task.call();
    }

    /// The task as a boxed closure.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// use std::time::Duration;
    /// let timer = tokio_purgatory::Timer::new();
    /// timer.schedule(Duration::from_secs(60), || println!("flushed")).unwrap();
    /// let tasks: Vec<Box<dyn FnOnce() + Send>> =
    ///     timer.shutdown().into_iter().map(|t| t.into_inner()).collect();
    /// std::thread::spawn(move || tasks.into_iter().for_each(|t| t())).join().unwrap();
    /// # }
    /// ```
    pub fn into_inner(self) -> Box<dyn FnOnce() + Send> {
        let task = self.task;
        Box::new(move || {
            task.call();
        })
    }
}

impl fmt::Debug for UnrunTask {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("UnrunTask(..)")
    }
}
