//! Errors of the standalone timer.

use std::fmt;

use crate::core::{Closed, Refused};

/// The timer refused a task; the task is handed back unrun. Returned by
/// [`Timer::schedule`](crate::Timer::schedule),
/// [`schedule_at`](crate::Timer::schedule_at),
/// [`schedule_repeating`](crate::Timer::schedule_repeating) (with the closure)
/// and [`schedule_async`](crate::Timer::schedule_async) (with the future).
/// [`kind`](ScheduleError::kind) gives the reason without the task (a
/// [`TimerError`]: `Copy`, `Send + Sync`), and `?` converts it to one.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
/// use std::time::Duration;
/// use tokio_purgatory::timer::{ScheduleError, TaskHandle, TimerError};
/// use tokio_purgatory::Timer;
///
/// let timer = Timer::new();
/// drop(timer.shutdown());
/// // The refused task comes back, to run here instead.
/// match timer.schedule(Duration::from_secs(1), || println!("flush")) {
///     Err(ScheduleError::Shutdown(flush)) => flush(),
///     other => panic!("expected a refusal, got {other:?}"),
/// }
///
/// // Or the reason alone, through `?`.
/// fn arm(timer: &Timer) -> Result<TaskHandle, TimerError> {
///     Ok(timer.schedule(Duration::from_secs(1), || {})?)
/// }
/// assert_eq!(arm(&timer).unwrap_err(), TimerError::Shutdown);
/// # }
/// ```
#[derive(PartialEq, Eq)]
#[non_exhaustive]
pub enum ScheduleError<T> {
    /// The timer holds its configured maximum of pending entries
    /// ([`TimerBuilder::max_pending`](crate::TimerBuilder::max_pending)).
    AtCapacity(T),
    /// The timer was shut down ([`Timer::shutdown`](crate::Timer::shutdown)).
    Shutdown(T),
    /// The reaper task is gone (aborted, or its runtime shut down) without a
    /// shutdown; nothing would ever run the task.
    ReaperGone(T),
}

impl<T> ScheduleError<T> {
    /// The task that was refused.
    ///
    /// ```
    /// use tokio_purgatory::timer::ScheduleError;
    /// assert_eq!(ScheduleError::Shutdown(5).into_inner(), 5);
    /// ```
    pub fn into_inner(self) -> T {
        match self {
            ScheduleError::AtCapacity(t)
            | ScheduleError::Shutdown(t)
            | ScheduleError::ReaperGone(t) => t,
        }
    }

    /// Why it was refused, without the task.
    ///
    /// ```
    /// use tokio_purgatory::timer::{ScheduleError, TimerError};
    /// assert_eq!(ScheduleError::AtCapacity(()).kind(), TimerError::AtCapacity);
    /// ```
    pub fn kind(&self) -> TimerError {
        match self {
            ScheduleError::AtCapacity(_) => TimerError::AtCapacity,
            ScheduleError::Shutdown(_) => TimerError::Shutdown,
            ScheduleError::ReaperGone(_) => TimerError::ReaperGone,
        }
    }
}

impl<T> From<ScheduleError<T>> for TimerError {
    fn from(e: ScheduleError<T>) -> Self {
        e.kind()
    }
}

impl<T> fmt::Debug for ScheduleError<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ScheduleError::AtCapacity(_) => f.write_str("AtCapacity(..)"),
            ScheduleError::Shutdown(_) => f.write_str("Shutdown(..)"),
            ScheduleError::ReaperGone(_) => f.write_str("ReaperGone(..)"),
        }
    }
}

impl<T> fmt::Display for ScheduleError<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.kind(), f)
    }
}

impl<T> std::error::Error for ScheduleError<T> {}

/// Why the timer could not keep a deadline, without a task: what a
/// [`Sleep`](crate::timer::Sleep) resolves to when it ends without its deadline
/// being reached, the reason inside [`TimeoutError::Timer`], and the
/// [`kind`](ScheduleError::kind) of a [`ScheduleError`].
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
/// use std::time::Duration;
/// use tokio_purgatory::timer::TimerError;
/// use tokio_purgatory::Timer;
///
/// let timer = Timer::builder().max_pending(1).build().unwrap();
/// let _held = timer.sleep(Duration::from_secs(60)); // takes the one place
/// assert_eq!(timer.sleep(Duration::from_secs(1)).await, Err(TimerError::AtCapacity));
/// let refused = timer.schedule(Duration::from_secs(1), || {}).unwrap_err();
/// assert_eq!(refused.kind(), TimerError::AtCapacity);
/// # }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TimerError {
    /// The timer held its configured maximum of pending entries when the sleep
    /// was created, or the task was scheduled.
    AtCapacity,
    /// The timer was shut down (or, for a sleep, its last
    /// [`Timer`](crate::Timer) clone dropped).
    Shutdown,
    /// The reaper task is gone (aborted, or its runtime shut down).
    ReaperGone,
}

impl fmt::Display for TimerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TimerError::AtCapacity => "timer is at its limit of pending entries",
            TimerError::Shutdown => "timer is shut down",
            TimerError::ReaperGone => "timer's reaper task is gone",
        })
    }
}

impl std::error::Error for TimerError {}

impl<T> From<&Refused<T>> for TimerError {
    fn from(refused: &Refused<T>) -> Self {
        match refused {
            Refused::AtCapacity(_) => TimerError::AtCapacity,
            Refused::Closed(_, why) => (*why).into(),
        }
    }
}

impl From<Closed> for TimerError {
    fn from(why: Closed) -> Self {
        match why {
            Closed::Shutdown => TimerError::Shutdown,
            Closed::ReaperGone => TimerError::ReaperGone,
        }
    }
}

/// A [`TimeoutFuture`](crate::timer::TimeoutFuture) ended without its inner
/// future's output.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
/// use std::error::Error;
/// use std::time::Duration;
/// use tokio_purgatory::timer::{TimeoutError, TimerError};
/// use tokio_purgatory::Timer;
///
/// let timer = Timer::new();
/// let slow = timer.timeout(Duration::from_millis(10), std::future::pending::<()>());
/// assert_eq!(slow.await, Err(TimeoutError::Elapsed));
///
/// // A shutdown leaves the deadline unkept: the reason is the error's source.
/// let waiting = timer.timeout(Duration::from_secs(60), std::future::pending::<()>());
/// drop(timer.shutdown());
/// let err = waiting.await.unwrap_err();
/// assert_eq!(err, TimeoutError::Timer(TimerError::Shutdown));
/// assert!(err.source().is_some());
/// # }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TimeoutError {
    /// The deadline passed first.
    Elapsed,
    /// The timer could not keep the deadline: it was at capacity when the future
    /// was made, shut down, or lost its reaper.
    Timer(TimerError),
}

impl fmt::Display for TimeoutError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TimeoutError::Elapsed => f.write_str("deadline has elapsed"),
            TimeoutError::Timer(e) => write!(f, "deadline cannot be kept: {e}"),
        }
    }
}

impl std::error::Error for TimeoutError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            TimeoutError::Elapsed => None,
            TimeoutError::Timer(e) => Some(e),
        }
    }
}
