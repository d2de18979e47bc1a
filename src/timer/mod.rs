//! The standalone timer: one-shot tasks and sleeps on the timing wheel.
//!
//! [`Timer`] plays the part of Netty's `HashedWheelTimer` for a Tokio program:
//! retries, heartbeats and one-shot timeouts, by the million, each costing a few
//! dozen bytes and no task of its own. See the [crate docs](crate) for the
//! guarantees it shares with the purgatory.
//!
//! # Examples
//!
//! ```
//! # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
//! use std::time::Duration;
//! use tokio_purgatory::timer::{TimeoutError, Timer};
//!
//! let timer = Timer::new();
//! // A closure run on the reaper task, a sleep, and a deadline on a future.
//! let retry = timer.schedule(Duration::from_secs(5), || println!("retry")).unwrap();
//! timer.sleep(Duration::from_millis(10)).await.unwrap();
//! let answer = timer.timeout(Duration::from_millis(10), std::future::pending::<()>());
//! assert_eq!(answer.await, Err(TimeoutError::Elapsed));
//! assert!(retry.cancel());
//! # }
//! ```

mod builder;
mod error;
mod future;
mod handle;
mod task;

use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

pub use self::builder::TimerBuilder;
pub use self::error::{ScheduleError, TimeoutError, TimerError};
pub use self::future::{Sleep, TimeoutFuture};
pub use self::handle::{AsyncTaskHandle, TaskHandle, TaskStatus};

/// An alias of [`TaskHandle`], kept so that code using the name `Timeout`
/// (Netty's name for the handle) still compiles. Prefer `TaskHandle`: in Tokio
/// code a `Timeout` reads as a future with a deadline, which this is not (that
/// is [`TimeoutFuture`]).
///
/// ```
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
/// #![allow(deprecated)]
/// let timer = tokio_purgatory::Timer::new();
/// let t: tokio_purgatory::timer::Timeout = timer.schedule(std::time::Duration::from_secs(1), || {}).unwrap();
/// assert!(t.cancel());
/// # }
/// ```
#[deprecated(since = "0.1.0", note = "an alias of `TaskHandle`: use that name")]
pub type Timeout = TaskHandle;

/// An alias of [`AsyncTaskHandle`], kept so that code using the name
/// `AsyncTimeout` still compiles. Prefer `AsyncTaskHandle`.
///
/// ```
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
/// #![allow(deprecated)]
/// let timer = tokio_purgatory::Timer::new();
/// let t: tokio_purgatory::timer::AsyncTimeout =
///     timer.schedule_async(std::time::Duration::from_secs(1), async {}).unwrap();
/// assert!(t.cancel());
/// # }
/// ```
#[deprecated(since = "0.1.0", note = "an alias of `AsyncTaskHandle`: use that name")]
pub type AsyncTimeout = AsyncTaskHandle;

/// An alias of [`TaskStatus`], kept so that code using the name
/// `TimeoutStatus` still compiles. Prefer `TaskStatus`.
///
/// ```
/// #![allow(deprecated)]
/// use tokio_purgatory::timer::{TaskStatus, TimeoutStatus};
/// assert_eq!(TimeoutStatus::Pending, TaskStatus::Pending);
/// ```
#[deprecated(since = "0.1.0", note = "an alias of `TaskStatus`: use that name")]
pub type TimeoutStatus = TaskStatus;
pub use self::task::UnrunTask;
use self::task::{refused_task, Chain, Repeating, TimerJob};
use crate::clock::deadline_after;
pub use crate::core::RefusedMetrics;
use crate::core::{Closed, Core, Job, Refused};
pub use crate::histogram::Histogram;
pub use crate::reaper::ReaperMetrics;
use crate::settings::Settings;
use crate::sync::{lock, Mutex};

/// Shuts the timer down when the last [`Timer`] clone is dropped.
#[derive(Debug)]
pub(crate) struct Owner {
    pub(crate) core: Arc<Core<TimerJob>>,
}

impl Drop for Owner {
    fn drop(&mut self) {
        if let Some(jobs) = self.core.close(Closed::Shutdown) {
            for job in jobs {
                // Each task is dropped on its own: a panicking `Drop` is counted and
                // does not stop the others.
                self.core
                    .panics
                    .run("drop of a task", || job.abandon(&(), Closed::Shutdown));
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
/// counted in [`TimerMetrics::panicked`] and reported through `tracing`; later
/// tasks still run. One case no library can contain: a one-shot task panics
/// while a value it captured also panics in its `Drop`. Calling the task
/// consumes it, so Rust drops its captures while the first panic unwinds,
/// and a second panic then aborts the process, as it would anywhere. A
/// repeating task's captures are dropped after the panic is caught, and
/// such a `Drop` panic there is contained and counted.
///
/// # Concurrency
///
/// All methods may be called from any number of threads at once, and from
/// inside a task the timer runs. What runs where:
///
/// - Tasks run on the reaper task with no lock of the timer's held, so they may
///   call back into it (schedule, cancel, reset, even shut it down).
/// - A task the timer drops unrun (cancelled, or left when the last clone is
///   dropped or the reaper is lost) is dropped with no lock of the timer's held;
///   a panic in its `Drop` is caught and counted like a panic in a task. A
///   cancelled task is dropped by [`TaskHandle::cancel`], on the calling thread.
/// - The waker of a [`Sleep`] is woken and dropped with no lock held, a panic
///   in it caught and counted.
///
/// # Shutdown
///
/// [`shutdown`](Timer::shutdown) closes the timer and hands back every task that
/// has not run; pending [`Sleep`]s resolve to [`TimerError::Shutdown`]. The reaper
/// lets go of the timer: a reaper of its own ends, while a shared
/// [`Reaper`](crate::Reaper) goes on serving the other purgatories and timers
/// built on it. Dropping the last `Timer` clone does the same but drops the tasks
/// unrun (handles such as [`TaskHandle`], [`Sleep`] and [`WeakTimer`] do not keep
/// the timer open). If the reaper task ends first (its runtime shuts down, or it
/// is aborted), tasks are dropped unrun, sleeps resolve to
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
    pub(crate) owner: Arc<Owner>,
}

/// A handle to a [`Timer`] that does not keep it alive: for tasks that reschedule
/// themselves (a heartbeat), which would otherwise hold a strong clone from inside
/// the timer, a cycle that keeps it running after every other handle is gone.
/// Made by [`Timer::downgrade`].
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
/// use std::time::Duration;
/// use tokio_purgatory::timer::WeakTimer;
/// use tokio_purgatory::Timer;
///
/// /// Beats every 100 ms for as long as anyone else holds the timer.
/// fn beat(timer: WeakTimer) {
///     if let Some(t) = timer.upgrade() {
///         let _ = t.schedule(Duration::from_millis(100), move || beat(timer));
///     }
/// }
///
/// let timer = Timer::new();
/// beat(timer.downgrade());
/// tokio::time::sleep(Duration::from_millis(350)).await;
/// assert_eq!(timer.len(), 1, "the next beat is pending");
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct WeakTimer {
    owner: std::sync::Weak<Owner>,
}

impl WeakTimer {
    /// The timer, if a [`Timer`] handle still keeps it alive.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let timer = tokio_purgatory::Timer::new();
    /// let weak = timer.downgrade();
    /// assert!(weak.upgrade().is_some());
    /// drop(timer);
    /// assert!(weak.upgrade().is_none());
    /// # }
    /// ```
    pub fn upgrade(&self) -> Option<Timer> {
        self.owner.upgrade().map(|owner| Timer { owner })
    }
}

/// A timer with default settings, as [`Timer::new`].
///
/// # Panics
///
/// Outside a Tokio runtime, as [`Timer::new`] does ([`Purgatory`](crate::Purgatory)
/// has no `Default` for that reason; the timer keeps its for the common
/// `#[derive(Default)]` on a struct built inside a runtime). Use
/// [`Timer::builder`] and `build` or `build_on` for an error instead.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// #[derive(Default)]
/// struct Session {
///     timer: tokio_purgatory::Timer,
/// }
/// let session = Session::default();
/// assert!(session.timer.is_empty());
/// # }
/// ```
impl Default for Timer {
    #[track_caller]
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
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let timer = tokio_purgatory::Timer::new();
    /// assert!(timer.is_empty());
    /// # }
    /// ```
    #[track_caller]
    pub fn new() -> Timer {
        Timer::builder()
            .build()
            .expect("Timer::new must be called within a Tokio runtime")
    }

    /// A builder with default settings.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// use std::time::Duration;
    /// let timer = tokio_purgatory::Timer::builder()
    ///     .name("heartbeats")
    ///     .tick(Duration::from_millis(1))
    ///     .build()
    ///     .unwrap();
    /// assert!(!timer.is_shutdown());
    /// # }
    /// ```
    pub fn builder() -> TimerBuilder {
        TimerBuilder {
            wheel: Settings::default(),
            reaper: None,
            max_pending: None,
            name: "timer".into(),
        }
    }

    /// A handle that does not keep the timer alive (see [`WeakTimer`]). Dropping
    /// the last `Timer` shuts it down even while weak handles exist.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// use std::time::Duration;
    /// use tokio_purgatory::timer::TimerError;
    /// use tokio_purgatory::Timer;
    ///
    /// let timer = Timer::new();
    /// let weak = timer.downgrade();
    /// let nap = timer.sleep(Duration::from_secs(60));
    /// assert!(weak.upgrade().is_some());
    /// // The weak handle does not keep the timer open.
    /// drop(timer);
    /// assert_eq!(nap.await, Err(TimerError::Shutdown));
    /// assert!(weak.upgrade().is_none());
    /// # }
    /// ```
    pub fn downgrade(&self) -> WeakTimer {
        WeakTimer {
            owner: Arc::downgrade(&self.owner),
        }
    }

    fn core(&self) -> &Arc<Core<TimerJob>> {
        &self.owner.core
    }

    /// Runs `task` on the reaper task once `delay` has passed (O(1)).
    ///
    /// A zero delay runs the task on the reaper, never inline: at its next
    /// turn, or later in the turn under way when called from a task of a
    /// turn that still has due entries to take (it takes them in batches,
    /// and looks again after each). A delay too large for `Instant`
    /// saturates to a deadline about 30 years out.
    ///
    /// # Errors
    ///
    /// Hands `task` back when the timer is at its limit, shut down, or has lost its
    /// reaper.
    ///
    /// # Concurrent calls
    ///
    /// Racing a [`shutdown`](Timer::shutdown), the task is either refused, and
    /// handed back in [`ScheduleError::Shutdown`], or accepted and then handed back
    /// in the list the shutdown returns: never both, never lost.
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
    /// let fired = Arc::new(AtomicBool::new(false));
    /// let f = fired.clone();
    /// timer.schedule(Duration::from_millis(50), move || f.store(true, Ordering::SeqCst)).unwrap();
    /// tokio::time::sleep(Duration::from_millis(60)).await;
    /// assert!(fired.load(Ordering::SeqCst));
    /// # }
    /// ```
    pub fn schedule<F>(&self, delay: Duration, task: F) -> Result<TaskHandle, ScheduleError<F>>
    where
        F: FnOnce() + Send + 'static,
    {
        let now = Instant::now();
        self.insert(now, deadline_after(now, delay), task)
    }

    /// Runs `future` as a Tokio task of its own once `delay` has passed: it
    /// waits in the wheel like any entry (O(1) to schedule, cancel and
    /// reset), then is spawned on the timer's runtime, where it may `.await`.
    /// For retries and heartbeats that do I/O: the closures of
    /// [`schedule`](Timer::schedule) run on the reaper task and must not
    /// block.
    ///
    /// A panic in the future ends its own task only (Tokio contains it).
    ///
    /// # Shutdown
    ///
    /// A future that has not started when the timer shuts down comes back from
    /// [`shutdown`](Timer::shutdown) inside an [`UnrunTask`], whose
    /// [`run`](UnrunTask::run) spawns it; dropping that `UnrunTask` drops the
    /// future unpolled, and its handle then reads finished. A future already
    /// started is a Tokio task of its own: the shutdown does not touch it. See
    /// [`AsyncTaskHandle`].
    ///
    /// # Errors
    ///
    /// As [`schedule`](Timer::schedule), with the future handed back; racing a
    /// shutdown, as there too.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// use std::time::Duration;
    ///
    /// let timer = tokio_purgatory::Timer::new();
    /// let (tx, mut rx) = tokio::sync::mpsc::channel(1);
    /// timer
    ///     .schedule_async(Duration::from_millis(100), async move {
    ///         // A bounded send: the retry waits for room instead of piling up.
    ///         tx.send("retry").await.unwrap();
    ///     })
    ///     .unwrap();
    /// assert_eq!(rx.recv().await, Some("retry"));
    /// # }
    /// ```
    pub fn schedule_async<Fut>(
        &self,
        delay: Duration,
        future: Fut,
    ) -> Result<AsyncTaskHandle, ScheduleError<Fut>>
    where
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let start = AsyncTaskHandle::waiting();
        // Kept where a refusal can take it back.
        let slot = Arc::new(Mutex::new(Some(future)));
        let entry = AsyncEntry {
            unrun: Unrun(start.clone()),
            future: slot.clone(),
            // The runtime current here, for a task handed back by a shutdown
            // and run outside any runtime (the reaper runs it inside its own).
            scheduled_on: tokio::runtime::Handle::try_current().ok(),
        };
        let core = self.core();
        let now = Instant::now();
        match core.insert(now, deadline_after(now, delay), TimerJob(Box::new(entry))) {
            Ok(key) => Ok(AsyncTaskHandle::new(
                TaskHandle::new(core.clone(), key),
                start,
            )),
            Err(refused) => {
                let why = match &refused {
                    Refused::AtCapacity(_) => None,
                    Refused::Closed(_, why) => Some(*why),
                };
                // The entry (and its hold on the start) goes first: its
                // guard reads `Waiting`, and marks it cancelled, which
                // nobody reads.
                drop(refused);
                let future = lock(&slot).take().expect("a refused task never ran");
                Err(match why {
                    None => ScheduleError::AtCapacity(future),
                    Some(Closed::Shutdown) => ScheduleError::Shutdown(future),
                    Some(Closed::ReaperGone) => ScheduleError::ReaperGone(future),
                })
            }
        }
    }

    /// Runs `task` on the reaper task once `deadline` has passed. A deadline in
    /// the past runs on the reaper's next turn.
    ///
    /// # Errors
    ///
    /// As [`schedule`](Timer::schedule). Racing a [`shutdown`](Timer::shutdown),
    /// the task is either refused in [`ScheduleError::Shutdown`] or handed back by
    /// the shutdown, as there.
    ///
    /// `deadline` may be a `tokio::time::Instant` or a `std::time::Instant`
    /// (converted with `From`). Under Tokio's paused time only Tokio's clock
    /// is paused: take deadlines from `tokio::time::Instant::now()` there.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// use std::time::Duration;
    /// use tokio::time::Instant;
    /// use tokio_purgatory::Timer;
    ///
    /// let timer = Timer::new();
    /// let retry = timer
    ///     .schedule_at(Instant::now() + Duration::from_secs(5), || println!("retry"))
    ///     .unwrap();
    /// assert!(retry.is_pending());
    /// # }
    /// ```
    pub fn schedule_at<F>(
        &self,
        deadline: impl Into<Instant>,
        task: F,
    ) -> Result<TaskHandle, ScheduleError<F>>
    where
        F: FnOnce() + Send + 'static,
    {
        self.insert(Instant::now(), deadline.into(), task)
    }

    /// Runs `task` on the reaper once `delay` has passed, and again after each
    /// delay it returns, until it returns `None` or is cancelled through the
    /// returned [`TaskHandle`]: heartbeats (return the same period each time),
    /// retries with backoff (return the next backoff, or `None` once done). The
    /// next delay counts from the end of each run (a fixed delay, as Netty's
    /// rescheduled tasks and tokio's `MissedTickBehavior::Delay`), so a slow run
    /// never makes runs pile up. The task may hold a [`WeakTimer`] to schedule
    /// other work; it never needs its own handle to go on.
    ///
    /// One entry in the wheel at a time, moved back in O(1) after each run, and
    /// kept under [`max_pending`](TimerBuilder::max_pending) by the room it held
    /// (a rescheduling is never refused for the limit). A panic in the task ends
    /// the chain (caught, counted and reported as for any task) as returning
    /// `None` does: the handle's status is then `Done`, and `cancel` returns
    /// `false`.
    ///
    /// # Cancellation and shutdown
    ///
    /// [`TaskHandle::cancel`] stops it (a run under way finishes, and none starts
    /// after); [`TaskHandle::reset`] moves the next run. Dropping the `TaskHandle`
    /// does not stop it. [`shutdown`](Self::shutdown) hands it back like any
    /// pending task, when it is waiting for its next run; running the
    /// handed-back task runs it once. A run under way when the shutdown comes
    /// (or the run that calls `shutdown` itself) finishes, and the chain ends
    /// there: nothing is handed back for it, and its handle reads
    /// [`Done`](TaskStatus::Done).
    ///
    /// # Errors
    ///
    /// As [`schedule`](Timer::schedule): the task comes back when the timer is at
    /// its limit, shut down, or has lost its reaper.
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
    /// // A retry with exponential backoff, giving up after 5 attempts.
    /// let attempts = Arc::new(AtomicU32::new(0));
    /// let seen = attempts.clone();
    /// let mut backoff = Duration::from_millis(100);
    /// timer
    ///     .schedule_repeating(backoff, move || {
    ///         let n = seen.fetch_add(1, Ordering::SeqCst) + 1;
    ///         backoff *= 2;
    ///         (n < 5).then_some(backoff)
    ///     })
    ///     .unwrap();
    /// tokio::time::sleep(Duration::from_secs(4)).await; // 100+200+400+800+1600 ms
    /// assert_eq!(attempts.load(Ordering::SeqCst), 5);
    ///
    /// // A heartbeat every second, until cancelled.
    /// let beats = Arc::new(AtomicU32::new(0));
    /// let b = beats.clone();
    /// let heartbeat = timer
    ///     .schedule_repeating(Duration::from_secs(1), move || {
    ///         b.fetch_add(1, Ordering::SeqCst);
    ///         Some(Duration::from_secs(1))
    ///     })
    ///     .unwrap();
    /// tokio::time::sleep(Duration::from_millis(3_500)).await;
    /// assert!(heartbeat.cancel());
    /// tokio::time::sleep(Duration::from_secs(5)).await;
    /// assert_eq!(beats.load(Ordering::SeqCst), 3);
    /// # }
    /// ```
    pub fn schedule_repeating<F>(
        &self,
        delay: Duration,
        task: F,
    ) -> Result<TaskHandle, ScheduleError<F>>
    where
        F: FnMut() -> Option<Duration> + Send + 'static,
    {
        let core = self.core();
        let chain = Arc::new(Chain::default());
        let job = TimerJob(Box::new(Repeating {
            f: task,
            chain: chain.clone(),
            core: Arc::downgrade(core),
            handed_back: false,
        }));
        let now = Instant::now();
        // The key is recorded under the chain's lock, so the first run (which
        // may start at once on another thread) finds it.
        let mut key = lock(&chain.key);
        match core.insert(now, deadline_after(now, delay), job) {
            Ok(k) => *key = Some(k),
            Err(refused) => {
                drop(key);
                return Err(refused_task(refused));
            }
        }
        drop(key);
        Ok(TaskHandle::repeating(core.clone(), chain))
    }

    fn insert<F>(
        &self,
        now: Instant,
        deadline: Instant,
        task: F,
    ) -> Result<TaskHandle, ScheduleError<F>>
    where
        F: FnOnce() + Send + 'static,
    {
        let core = self.core();
        match core.insert(now, deadline, TimerJob(Box::new(task))) {
            Ok(key) => Ok(TaskHandle::new(core.clone(), key)),
            Err(refused) => Err(refused_task(refused)),
        }
    }

    /// A future that resolves once `delay` has passed (see [`Sleep`]).
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// use std::time::Duration;
    /// use tokio::time::Instant;
    ///
    /// let timer = tokio_purgatory::Timer::new();
    /// let start = Instant::now();
    /// timer.sleep(Duration::from_millis(100)).await.unwrap();
    /// assert!(start.elapsed() >= Duration::from_millis(100));
    /// # }
    /// ```
    pub fn sleep(&self, delay: Duration) -> Sleep {
        let now = Instant::now();
        Sleep::new(self.core(), now, deadline_after(now, delay))
    }

    /// A future that resolves once `deadline` has passed (see [`Sleep`]).
    ///
    /// `deadline` may be a `tokio::time::Instant` or a `std::time::Instant`
    /// (converted with `From`). Under Tokio's paused time only Tokio's clock
    /// is paused: take deadlines from `tokio::time::Instant::now()` there.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// use std::time::Duration;
    /// use tokio::time::Instant;
    ///
    /// let timer = tokio_purgatory::Timer::new();
    /// let deadline = Instant::now() + Duration::from_millis(100);
    /// timer.sleep_until(deadline).await.unwrap();
    /// assert!(Instant::now() >= deadline);
    /// # }
    /// ```
    pub fn sleep_until(&self, deadline: impl Into<Instant>) -> Sleep {
        let deadline = deadline.into();
        Sleep::new(self.core(), Instant::now(), deadline)
    }

    /// Requires `future` to finish within `duration` (tokio's `time::timeout`, on
    /// this timer's wheel): see [`TimeoutFuture`]. The deadline is entered in the
    /// wheel now, O(1).
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// use std::time::Duration;
    /// use tokio_purgatory::timer::TimeoutError;
    /// use tokio_purgatory::Timer;
    ///
    /// let timer = Timer::new();
    /// let reply = timer.timeout(Duration::from_secs(1), async { "pong" }).await;
    /// assert_eq!(reply, Ok("pong"));
    /// let never = timer.timeout(Duration::from_secs(1), std::future::pending::<()>()).await;
    /// assert_eq!(never, Err(TimeoutError::Elapsed));
    /// # }
    /// ```
    pub fn timeout<F: Future>(&self, duration: Duration, future: F) -> TimeoutFuture<F> {
        TimeoutFuture::new(future, self.sleep(duration))
    }

    /// Requires `future` to finish by `deadline`: see [`TimeoutFuture`].
    ///
    /// `deadline` may be a `tokio::time::Instant` or a `std::time::Instant`
    /// (converted with `From`). Under Tokio's paused time only Tokio's clock
    /// is paused: take deadlines from `tokio::time::Instant::now()` there.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// use std::time::Duration;
    /// use tokio::time::Instant;
    /// use tokio_purgatory::Timer;
    ///
    /// let timer = Timer::new();
    /// let by = Instant::now() + Duration::from_millis(100);
    /// let fut = timer.timeout_at(by, tokio::time::sleep(Duration::from_millis(10)));
    /// assert_eq!(fut.deadline(), by);
    /// assert!(fut.await.is_ok());
    /// # }
    /// ```
    pub fn timeout_at<F: Future>(
        &self,
        deadline: impl Into<Instant>,
        future: F,
    ) -> TimeoutFuture<F> {
        let deadline = deadline.into();
        TimeoutFuture::new(future, self.sleep_until(deadline))
    }

    /// Pending entries: tasks, sleeps and timeouts. Exact when no other call races it.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// use std::time::Duration;
    /// let timer = tokio_purgatory::Timer::new();
    /// timer.schedule(Duration::from_secs(1), || {}).unwrap();
    /// assert_eq!(timer.len(), 1);
    /// # }
    /// ```
    pub fn len(&self) -> usize {
        self.core().len()
    }

    /// Whether nothing is pending.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let timer = tokio_purgatory::Timer::new();
    /// assert!(timer.is_empty());
    /// # }
    /// ```
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the timer no longer accepts work (shut down, or reaper gone).
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let timer = tokio_purgatory::Timer::new();
    /// drop(timer.shutdown());
    /// assert!(timer.is_shutdown());
    /// # }
    /// ```
    pub fn is_shutdown(&self) -> bool {
        self.core().closed().is_some()
    }

    /// Counters since the timer was built.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// use std::time::Duration;
    ///
    /// let timer = tokio_purgatory::Timer::new();
    /// timer.schedule(Duration::from_millis(10), || {}).unwrap();
    /// tokio::time::sleep(Duration::from_millis(20)).await;
    /// let m = timer.metrics();
    /// assert_eq!((m.pending, m.expired, m.panicked), (0, 1, 0));
    /// # }
    /// ```
    pub fn metrics(&self) -> TimerMetrics {
        let c = &self.core().counters;
        TimerMetrics {
            pending: self.len(),
            expired: c.expired.load(Ordering::Relaxed),
            panicked: self.core().panics.count(),
            reaper_wakeups: self.core().wakeups(),
            reaper: c.reaper(),
            refused: c.refusals(),
        }
    }

    /// How late this timer's entries fired (tasks run, sleeps and timeouts
    /// woken): for each, the time from its deadline (rounded up to the tick)
    /// to the reaper turn that took it out. A deadline already reached when it
    /// was scheduled (zero, or past) counts from the start of the tick it was
    /// scheduled in: it reads late by up to one tick, however far past it
    /// was, since what this measures is how long the reaper took. Recorded
    /// once per expiry by the reaper. A snapshot of about 2.5 KiB.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// use std::time::Duration;
    /// use tokio_purgatory::Timer;
    ///
    /// let timer = Timer::new();
    /// timer.sleep(Duration::from_millis(5)).await.unwrap();
    /// assert_eq!(timer.lateness().count(), 1);
    /// # }
    /// ```
    pub fn lateness(&self) -> Histogram {
        self.core().counters.lateness.snapshot()
    }

    /// Reports this timer's counters and gauges through the `metrics` facade,
    /// to the recorder installed now; call it where the exporter collects.
    /// Lateness is recorded live (`tokio_purgatory_lateness_seconds`, into the
    /// recorder installed when the timer was built). Labels: `kind="timer"`
    /// and `name` (the builder's [`name`](TimerBuilder::name)).
    ///
    /// | metric | type | what |
    /// |---|---|---|
    /// | `tokio_purgatory_timer_pending` | gauge | tasks, sleeps and timeouts waiting |
    /// | `tokio_purgatory_timer_expired_total` | counter | entries that reached their deadline |
    /// | `tokio_purgatory_panicked_total` | counter | panics caught in user code ([`TimerMetrics::panicked`]) |
    /// | `tokio_purgatory_refused_total` | counter | schedules refused, per `reason` (`at_capacity`, `shutdown`, `reaper_gone`) |
    /// | `tokio_purgatory_reaper_wakeups_total`, `_turns_total` | counter | as for a purgatory |
    /// | `tokio_purgatory_reaper_busy_seconds`, `_longest_turn_seconds`, `_largest_batch` | gauge | as for a purgatory |
    /// | `tokio_purgatory_lateness_seconds` | histogram | how late each entry fired (recorded live) |
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let timer = tokio_purgatory::Timer::builder().name("retries").build().unwrap();
    /// timer.record_metrics(); // a no-op until a recorder is installed
    /// # }
    /// ```
    #[cfg(feature = "metrics")]
    pub fn record_metrics(&self) {
        let m = self.metrics();
        let l = self.core().labels();
        l.gauge("tokio_purgatory_timer_pending", m.pending as f64);
        l.counter("tokio_purgatory_timer_expired_total", m.expired);
        l.counter("tokio_purgatory_panicked_total", m.panicked);
        // A timer never refuses for `draining` or `no_keys` (the last two).
        l.refused(&m.refused.by_reason()[..3]);
        l.reaper(&m.reaper, m.reaper_wakeups);
    }

    /// Closes the timer and hands back every task that has not run, in no
    /// particular order. Pending [`Sleep`]s resolve to [`TimerError::Shutdown`].
    /// Afterwards `schedule` (and every other `schedule_*` method) fails with
    /// [`ScheduleError::Shutdown`].
    ///
    /// The reaper lets go of the timer: a reaper of its own ends; a shared
    /// [`Reaper`](crate::Reaper) goes on serving the other purgatories and timers
    /// built on it. A repeating task comes back as one task that runs once; a
    /// [`schedule_async`](Timer::schedule_async) future not yet started comes back
    /// as a task that spawns it, and one already started goes on as its own Tokio
    /// task. The [`TaskHandle`]s of the tasks handed back read [`TaskStatus::Done`].
    ///
    /// Returns an empty list when the timer was already shut down.
    ///
    /// # Concurrent calls
    ///
    /// A task the reaper has already taken out for running still runs (it is not
    /// in the list); a `schedule` racing the shutdown either lands in the list or
    /// fails. Calling `shutdown` from inside a task works.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// use std::time::Duration;
    ///
    /// let timer = tokio_purgatory::Timer::new();
    /// timer.schedule(Duration::from_secs(60), || println!("flush")).unwrap();
    /// // Stopping: run what was left now instead of dropping it.
    /// for task in timer.shutdown() {
    ///     task.run();
    /// }
    /// assert!(timer.schedule(Duration::from_secs(1), || {}).is_err());
    /// # }
    /// ```
    pub fn shutdown(&self) -> Vec<UnrunTask> {
        let core = self.core();
        let Some(jobs) = core.close(Closed::Shutdown) else {
            return Vec::new();
        };
        let mut unrun = Vec::new();
        for job in jobs {
            // A sleep's entry wakes its task, whose waker is user code (one
            // built from a raw vtable may panic in `wake`): caught and counted,
            // so that every other task is still handed back and every other
            // sleep told.
            let mut job = Some(job);
            core.panics.run("wake of a sleep", || {
                if let Some(task) = job.take().and_then(|j| j.0.stopped(Closed::Shutdown)) {
                    unrun.push(UnrunTask { task });
                }
            });
        }
        unrun
    }
}

/// Counters of a [`Timer`], read by [`Timer::metrics`].
///
/// A snapshot: the fields are read one after another while the timer runs, so
/// under concurrent use they may disagree slightly with each other. The counters
/// keep their values after a shutdown; `pending` is then zero. A shutdown
/// called from one of the timer's own tasks comes in the middle of a reaper
/// turn: that turn (the task, and the rest of its batch, which still run) is
/// counted as it ends, in `expired` and the reaper's figures, so read the
/// final values once the task has returned.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
/// use std::time::Duration;
/// use tokio_purgatory::Timer;
///
/// let timer = Timer::new();
/// timer.schedule(Duration::from_millis(10), || {}).unwrap();
/// let later = timer.schedule(Duration::from_secs(60), || {}).unwrap();
/// tokio::time::sleep(Duration::from_millis(20)).await;
/// let m = timer.metrics();
/// assert_eq!(m.pending, 1, "the later task");
/// assert_eq!(m.expired, 1);
/// assert_eq!(m.panicked, 0);
/// assert!(m.reaper.turns >= 1);
/// # drop(later);
/// # }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct TimerMetrics {
    /// Entries waiting: tasks, sleeps and timeouts.
    pub pending: usize,
    /// Entries that reached their deadline and were carried out: tasks run
    /// (an async task spawned), sleeps and timeouts fired. A repeating or
    /// async task cancelled, or a sleep dropped, in the reaper's turn that
    /// took its entry out, before it ran, is not counted (nor given a
    /// lateness sample).
    pub expired: u64,
    /// Panics caught in user code (the reaper went on): tasks, and the
    /// drops, wakers and `metrics` recorder calls the timer ran for them.
    pub panicked: u64,
    /// Times the reaper woke from a sleep. Stays put while nothing is scheduled
    /// (a [`Reaper`](crate::Reaper) shared with others counts its wake-ups in
    /// each it serves, and wakes for their deadlines too).
    pub reaper_wakeups: u64,
    /// The reaper's turns on this timer's entries.
    pub reaper: ReaperMetrics,
    /// Schedules refused, by reason: tasks, repeating and async tasks handed
    /// back in a [`ScheduleError`], and sleeps and timeouts whose entry was
    /// refused when they were made (a sleep then resolves to the
    /// [`TimerError`] at once, a timeout too unless its future is ready
    /// first).
    pub refused: RefusedMetrics,
}

/// A [`Timer::schedule_async`] entry in the wheel: spawns the future at the
/// deadline, unless it was cancelled first.
struct AsyncEntry<Fut> {
    unrun: Unrun,
    /// The future, where a refusal takes it back from.
    future: Arc<Mutex<Option<Fut>>>,
    scheduled_on: Option<tokio::runtime::Handle>,
}

impl<Fut> task::TaskFn for AsyncEntry<Fut>
where
    Fut: Future<Output = ()> + Send + 'static,
{
    /// Whether the future started (a cancel after the reaper's turn took the
    /// entry out drops it unpolled).
    fn call(self: Box<Self>) -> bool {
        let future = lock(&self.future).take();
        match future {
            Some(future) => {
                AsyncTaskHandle::start(&self.unrun.0, future, self.scheduled_on.as_ref())
            }
            None => false,
        }
    }

    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any + Send> {
        self
    }

    fn stopped(self: Box<Self>, _: Closed) -> Option<Box<dyn task::TaskFn>> {
        Some(self)
    }
}

/// Owned by a [`Timer::schedule_async`] entry: when the entry is dropped
/// without having run (the last `Timer` clone dropped, or a task handed back
/// by a shutdown and dropped), the future's handle reads cancelled instead
/// of waiting for a start that will never come. After a run the start has
/// moved on from `Waiting`, and this changes nothing.
struct Unrun(Arc<Mutex<handle::Start>>);

impl Drop for Unrun {
    fn drop(&mut self) {
        let mut start = lock(&self.0);
        if start.is_unspawned() {
            *start = handle::Start::Cancelled;
        }
    }
}
