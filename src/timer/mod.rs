//! The standalone timer: one-shot tasks and sleeps on the timing wheel.
//!
//! [`Timer`] plays the part of Netty's `HashedWheelTimer` for a Tokio program:
//! retries, heartbeats and one-shot timeouts, by the million, each costing a few
//! dozen bytes and no task of its own. See the [crate docs](crate) for the
//! guarantees it shares with the purgatory.

mod error;
mod future;

use std::any::Any;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

pub use self::error::{BuildError, ScheduleError, TimerError};
pub use self::future::Sleep;
use self::future::SleepSignal;
use crate::reaper::{
    deadline_after, drop_contained, note_panic, run_contained, Closed, Core, CoreConfig, Job,
    Refused, TimerKey,
};

/// What the wheel holds: a user's task or a sleep's signal, behind one thin
/// trait object (16 bytes, so a wheel entry stays at 40).
pub(crate) trait TaskFn: Send {
    /// The deadline passed.
    fn call(self: Box<Self>);
    /// The caller's own value, so a refused task goes back as the `F` it came as.
    fn into_any(self: Box<Self>) -> Box<dyn Any + Send>;
    /// The timer stopped first: a user's task comes back to be handed over; a
    /// sleep is told why and dropped.
    fn stopped(self: Box<Self>, why: Closed) -> Option<Box<dyn TaskFn>>;
}

impl<F: FnOnce() + Send + 'static> TaskFn for F {
    fn call(self: Box<Self>) {
        (*self)()
    }

    fn into_any(self: Box<Self>) -> Box<dyn Any + Send> {
        self
    }

    fn stopped(self: Box<Self>, _: Closed) -> Option<Box<dyn TaskFn>> {
        Some(self)
    }
}

/// A sleep's entry in the wheel.
struct Wake(Arc<SleepSignal>);

impl TaskFn for Wake {
    fn call(self: Box<Self>) {
        self.0.fire();
    }

    fn into_any(self: Box<Self>) -> Box<dyn Any + Send> {
        self
    }

    fn stopped(self: Box<Self>, why: Closed) -> Option<Box<dyn TaskFn>> {
        self.0.abandon(why);
        None
    }
}

/// A task as the wheel holds it.
pub(crate) struct TimerJob(Box<dyn TaskFn>);

impl TimerJob {
    pub(crate) fn sleep(signal: Arc<SleepSignal>) -> TimerJob {
        TimerJob(Box::new(Wake(signal)))
    }
}

impl fmt::Debug for TimerJob {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("TimerJob(..)")
    }
}

impl Job for TimerJob {
    fn expire(self) {
        self.0.call();
    }

    fn abandon(self, why: Closed) {
        // A user's task is dropped unrun (`Timer::shutdown` hands them back
        // instead); a sleep resolves with the reason.
        drop(self.0.stopped(why));
    }
}

fn refused_error<T>(refused: Refused<T>) -> TimerError {
    match refused {
        Refused::AtCapacity(_) => TimerError::AtCapacity,
        Refused::Closed(_, Closed::Shutdown) => TimerError::Shutdown,
        Refused::Closed(_, Closed::ReaperGone) => TimerError::ReaperGone,
    }
}

/// Settings shared by the timer and purgatory builders.
#[derive(Debug, Clone)]
pub(crate) struct WheelSettings {
    pub(crate) tick: Duration,
    pub(crate) slots: usize,
    pub(crate) levels: usize,
    pub(crate) shards: usize,
    pub(crate) batch: usize,
}

impl Default for WheelSettings {
    fn default() -> Self {
        WheelSettings {
            tick: Duration::from_millis(1),
            slots: 64,
            levels: 6,
            shards: std::thread::available_parallelism()
                .map_or(4, |n| n.get())
                .clamp(1, 16),
            batch: 1024,
        }
    }
}

impl WheelSettings {
    pub(crate) fn validate(&self) -> Result<(), BuildError> {
        if self.tick.is_zero() {
            return Err(BuildError::invalid("tick must be longer than zero"));
        }
        if !(2..=64).contains(&self.slots) {
            return Err(BuildError::invalid("slots_per_level must be in 2..=64"));
        }
        if crate::wheel::Wheel::<()>::new(self.slots, self.levels).is_err() {
            return Err(BuildError::invalid(
                "levels must be at least 1 and slots_per_level^levels below 2^62",
            ));
        }
        if self.shards == 0 || self.shards > 1024 {
            return Err(BuildError::invalid("shards must be in 1..=1024"));
        }
        if self.batch == 0 {
            return Err(BuildError::invalid("batch_size must be at least 1"));
        }
        Ok(())
    }

    pub(crate) fn core_config(&self, name: Arc<str>, max_pending: Option<usize>) -> CoreConfig {
        CoreConfig {
            tick: self.tick,
            slots: self.slots,
            levels: self.levels,
            shards: self.shards,
            max_pending,
            batch: self.batch,
            name,
        }
    }
}

pub(crate) fn runtime_handle(
    given: Option<&tokio::runtime::Handle>,
) -> Result<tokio::runtime::Handle, BuildError> {
    match given {
        Some(h) => Ok(h.clone()),
        None => tokio::runtime::Handle::try_current().map_err(|_| BuildError::no_runtime()),
    }
}

/// The wheel settings both builders share (the timer's and the purgatory's).
macro_rules! wheel_setters {
    () => {
        /// The tick: the wheel's unit of time (default 1 ms). Deadlines are rounded
        /// up to whole ticks, so a timeout is late by less than one tick, never
        /// early. A larger tick means fewer reaper wake-ups for dense timeouts.
        pub fn tick(mut self, tick: Duration) -> Self {
            self.wheel.tick = tick;
            self
        }

        /// Slots per wheel level, 2 to 64 (default 64). Powers of two are fastest.
        pub fn slots_per_level(mut self, slots: usize) -> Self {
            self.wheel.slots = slots;
            self
        }

        /// Number of wheel levels (default 6: with 64 slots of 1 ms, 2^36 ms, about
        /// 2.2 years). Later deadlines are still accepted and never fire early;
        /// they wait in an overflow list revisited once per turn of the top level.
        pub fn levels(mut self, levels: usize) -> Self {
            self.wheel.levels = levels;
            self
        }

        /// Most entries the reaper expires from one shard before yielding to other
        /// tasks (default 1024), so a million timeouts sharing a deadline cannot
        /// starve the runtime.
        pub fn batch_size(mut self, batch: usize) -> Self {
            self.wheel.batch = batch;
            self
        }
    };
}
pub(crate) use wheel_setters;

/// Builds a [`Timer`]: wheel shape, tick, sharding and an optional limit.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use std::time::Duration;
/// use tokio_purgatory::Timer;
///
/// let timer = Timer::builder()
///     .name("retries")
///     .tick(Duration::from_millis(10))
///     .max_pending(100_000)
///     .build()
///     .unwrap();
/// assert!(timer.is_empty());
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct TimerBuilder {
    wheel: WheelSettings,
    max_pending: Option<usize>,
    name: Arc<str>,
}

impl TimerBuilder {
    wheel_setters!();

    /// Number of independently locked wheels (default: the machine's parallelism,
    /// at most 16). A thread always inserts into the same shard, so producers on
    /// different threads rarely contend.
    pub fn shards(mut self, shards: usize) -> Self {
        self.wheel.shards = shards;
        self
    }

    /// Limit on pending timeouts (default: none). At the limit, `schedule`
    /// returns the task in [`ScheduleError::AtCapacity`]. Counting pending entries
    /// needs one shared counter, which costs some multi-producer throughput.
    pub fn max_pending(mut self, max: usize) -> Self {
        self.max_pending = Some(max);
        self
    }

    /// A name for `tracing` events (default `"timer"`).
    pub fn name(mut self, name: &str) -> Self {
        self.name = name.into();
        self
    }

    /// Builds the timer and spawns its reaper on the current Tokio runtime.
    ///
    /// # Errors
    ///
    /// When a setting is out of range, or no runtime is current.
    pub fn build(self) -> Result<Timer, BuildError> {
        self.build_inner(None)
    }

    /// Builds the timer and spawns its reaper on the runtime of `handle`.
    ///
    /// # Errors
    ///
    /// When a setting is out of range.
    pub fn build_on(self, handle: &tokio::runtime::Handle) -> Result<Timer, BuildError> {
        self.build_inner(Some(handle))
    }

    fn build_inner(self, handle: Option<&tokio::runtime::Handle>) -> Result<Timer, BuildError> {
        self.wheel.validate()?;
        if self.max_pending == Some(0) {
            return Err(BuildError::invalid("max_pending must be at least 1"));
        }
        let rt = runtime_handle(handle)?;
        let core = Core::start(&self.wheel.core_config(self.name, self.max_pending), &rt);
        Ok(Timer {
            owner: Arc::new(Owner { core }),
        })
    }
}

/// Stops the reaper when the last [`Timer`] clone is dropped.
#[derive(Debug)]
struct Owner {
    core: Arc<Core<TimerJob>>,
}

impl Drop for Owner {
    fn drop(&mut self) {
        if let Some(jobs) = self.core.close(Closed::Shutdown) {
            for job in jobs {
                // Each task is dropped on its own: a panicking `Drop` is counted and
                // does not stop the others.
                run_contained(&self.core.name, &self.core.counters, || {
                    job.abandon(Closed::Shutdown)
                });
            }
        }
    }
}

/// A hierarchical-wheel timer driven by one Tokio task: schedule closures and
/// sleep, at O(1) cost per insert and cancel.
///
/// Cheap to clone; all clones drive the same wheel. The reaper task sleeps until
/// the earliest deadline and does not wake while nothing is scheduled.
///
/// Tasks run **on the reaper task**, one after another, with no lock held: keep
/// them short, and spawn anything long or blocking. A panicking task is caught,
/// counted in [`TimerStats::panicked`] and reported through `tracing`; later
/// tasks still run.
///
/// # Shutdown
///
/// [`shutdown`](Timer::shutdown) stops the reaper and hands back every task that
/// has not run; pending [`Sleep`]s resolve to [`TimerError::Shutdown`]. Dropping
/// the last `Timer` clone does the same but drops the tasks unrun. If the reaper's
/// runtime shuts down first, tasks are dropped unrun, sleeps resolve to
/// [`TimerError::ReaperGone`], and scheduling fails with
/// [`ScheduleError::ReaperGone`].
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
/// use std::sync::atomic::{AtomicBool, Ordering};
/// use std::sync::Arc;
/// use std::time::Duration;
/// use tokio_purgatory::Timer;
///
/// let timer = Timer::new();
/// let ran = Arc::new(AtomicBool::new(false));
/// let flag = ran.clone();
/// let retry = timer
///     .schedule(Duration::from_millis(50), move || flag.store(true, Ordering::SeqCst))
///     .unwrap();
/// timer.sleep(Duration::from_millis(60)).await.unwrap();
/// assert!(ran.load(Ordering::SeqCst));
/// assert!(!retry.cancel(), "already ran");
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct Timer {
    owner: Arc<Owner>,
}

impl Default for Timer {
    fn default() -> Self {
        Timer::new()
    }
}

impl Timer {
    /// A timer with default settings, its reaper spawned on the current runtime.
    ///
    /// # Panics
    ///
    /// Outside a Tokio runtime; use [`Timer::builder`] and `build_on` there.
    #[track_caller]
    pub fn new() -> Timer {
        Timer::builder()
            .build()
            .expect("Timer::new must be called within a Tokio runtime")
    }

    /// A builder with default settings.
    pub fn builder() -> TimerBuilder {
        TimerBuilder {
            wheel: WheelSettings::default(),
            max_pending: None,
            name: "timer".into(),
        }
    }

    fn core(&self) -> &Arc<Core<TimerJob>> {
        &self.owner.core
    }

    /// Runs `task` on the reaper task once `delay` has passed (O(1)).
    ///
    /// A zero delay runs the task on the reaper's next turn, never inline. A delay
    /// too large for `Instant` saturates to a deadline about 30 years out.
    ///
    /// # Errors
    ///
    /// Hands `task` back when the timer is at its limit, shut down, or has lost its
    /// reaper.
    pub fn schedule<F>(&self, delay: Duration, task: F) -> Result<Timeout, ScheduleError<F>>
    where
        F: FnOnce() + Send + 'static,
    {
        let now = Instant::now();
        self.insert(now, deadline_after(now, delay), task)
    }

    /// Runs `task` on the reaper task once `deadline` has passed. A deadline in
    /// the past runs on the reaper's next turn.
    ///
    /// # Errors
    ///
    /// As [`schedule`](Timer::schedule).
    pub fn schedule_at<F>(&self, deadline: Instant, task: F) -> Result<Timeout, ScheduleError<F>>
    where
        F: FnOnce() + Send + 'static,
    {
        self.insert(Instant::now(), deadline, task)
    }

    fn insert<F>(
        &self,
        now: Instant,
        deadline: Instant,
        task: F,
    ) -> Result<Timeout, ScheduleError<F>>
    where
        F: FnOnce() + Send + 'static,
    {
        let core = self.core();
        match core.insert(now, deadline, TimerJob(Box::new(task))) {
            Ok(key) => Ok(Timeout {
                core: core.clone(),
                key,
                cancelled: AtomicBool::new(false),
            }),
            Err(refused) => Err(refused_task(refused)),
        }
    }

    /// A future that resolves once `delay` has passed (see [`Sleep`]).
    pub fn sleep(&self, delay: Duration) -> Sleep {
        let now = Instant::now();
        Sleep::new(self.core(), now, deadline_after(now, delay))
    }

    /// A future that resolves once `deadline` has passed (see [`Sleep`]).
    pub fn sleep_until(&self, deadline: Instant) -> Sleep {
        Sleep::new(self.core(), Instant::now(), deadline)
    }

    /// Pending timeouts and sleeps. Exact when no other call races it.
    pub fn len(&self) -> usize {
        self.core().len()
    }

    /// Whether nothing is pending.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the timer no longer accepts work (shut down, or reaper gone).
    pub fn is_shutdown(&self) -> bool {
        self.core().closed().is_some()
    }

    /// Counters since the timer was built.
    pub fn stats(&self) -> TimerStats {
        let c = &self.core().counters;
        TimerStats {
            pending: self.len(),
            expired: c.expired.load(Ordering::Relaxed),
            panicked: c.panicked.load(Ordering::Relaxed),
            reaper_wakeups: self.core().wakeups(),
        }
    }

    /// Stops the reaper and hands back every task that has not run, in no
    /// particular order. Pending [`Sleep`]s resolve to [`TimerError::Shutdown`].
    /// Afterwards `schedule` fails with [`ScheduleError::Shutdown`].
    ///
    /// Returns an empty list when the timer was already shut down.
    ///
    /// # Concurrent calls
    ///
    /// A task the reaper has already taken out for running still runs (it is not
    /// in the list); a `schedule` racing the shutdown either lands in the list or
    /// fails. Calling `shutdown` from inside a task works.
    pub fn shutdown(&self) -> Vec<UnrunTask> {
        let Some(jobs) = self.core().close(Closed::Shutdown) else {
            return Vec::new();
        };
        jobs.into_iter()
            .filter_map(|job| job.0.stopped(Closed::Shutdown))
            .map(|task| UnrunTask { task })
            .collect()
    }
}

/// Turns a refused insert back into the caller's task.
fn refused_task<F: 'static>(refused: Refused<TimerJob>) -> ScheduleError<F> {
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

/// Counters of a [`Timer`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct TimerStats {
    /// Timeouts and sleeps waiting.
    pub pending: usize,
    /// Entries that reached their deadline (tasks run, sleeps woken).
    pub expired: u64,
    /// Tasks that panicked (caught; the reaper went on).
    pub panicked: u64,
    /// Times the reaper woke from a sleep. Stays put while nothing is scheduled.
    pub reaper_wakeups: u64,
}

/// A task handed back by [`Timer::shutdown`] without having run.
pub struct UnrunTask {
    task: Box<dyn TaskFn>,
}

impl UnrunTask {
    /// Runs the task now, on the calling thread.
    pub fn run(self) {
        self.task.call()
    }

    /// The task as a boxed closure.
    pub fn into_inner(self) -> Box<dyn FnOnce() + Send> {
        let task = self.task;
        Box::new(move || task.call())
    }
}

impl fmt::Debug for UnrunTask {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("UnrunTask(..)")
    }
}

/// What became of a scheduled task, as seen by its [`Timeout`] handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TimeoutStatus {
    /// Waiting for its deadline.
    Pending,
    /// Cancelled through this handle; it never ran.
    Cancelled,
    /// No longer waiting: it ran (or panicked while running), or the timer was
    /// shut down (the task was handed back by `shutdown` or dropped).
    Done,
}

/// The handle of a scheduled task: cancel it, or ask what became of it.
///
/// Holding it keeps no memory of the timer's alive beyond a reference count: the
/// handle is a generation-tagged key, so a handle whose task is gone can never
/// touch a newer task that reuses the slot. Dropping the handle does **not**
/// cancel the task.
#[derive(Debug)]
pub struct Timeout {
    core: Arc<Core<TimerJob>>,
    key: TimerKey,
    cancelled: AtomicBool,
}

impl Timeout {
    /// Cancels the task if it has not run: O(1), and the task is dropped at once,
    /// on this thread, with no lock held (a panic in its `Drop` is caught and
    /// counted in [`TimerStats::panicked`]). Returns whether this call cancelled it.
    ///
    /// # Concurrent calls
    ///
    /// Racing the reaper, exactly one wins: either the task runs and `cancel`
    /// returns `false`, or it returns `true` and the task never runs.
    pub fn cancel(&self) -> bool {
        match self.core.remove(self.key) {
            Some(job) => {
                self.cancelled.store(true, Ordering::Release);
                drop_contained(job, |panic| {
                    note_panic(&self.core.name, &self.core.counters, panic)
                });
                true
            }
            None => false,
        }
    }

    /// Whether the task is still waiting for its deadline.
    pub fn is_pending(&self) -> bool {
        self.core.contains(self.key)
    }

    /// What became of the task.
    pub fn status(&self) -> TimeoutStatus {
        if self.cancelled.load(Ordering::Acquire) {
            TimeoutStatus::Cancelled
        } else if self.is_pending() {
            TimeoutStatus::Pending
        } else {
            TimeoutStatus::Done
        }
    }
}
