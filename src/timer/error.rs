//! Errors of the standalone timer.

use std::fmt;

use crate::core::{Closed, Refused};

/// [`Timer::schedule`](crate::Timer::schedule) refused a task; the task is handed
/// back unrun. [`kind`](ScheduleError::kind) gives the reason without the task
/// (`Copy`, `Send + Sync`), for `?`.
#[derive(PartialEq, Eq)]
#[non_exhaustive]
pub enum ScheduleError<T> {
    /// The timer holds its configured maximum of pending timeouts.
    AtCapacity(T),
    /// The timer was shut down (or its last [`Timer`](crate::Timer) handle dropped).
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

/// A [`Sleep`](crate::timer::Sleep) ended without its deadline being reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TimerError {
    /// The timer held its configured maximum of pending timeouts when the sleep
    /// was created.
    AtCapacity,
    /// The timer was shut down (or its last handle dropped).
    Shutdown,
    /// The reaper task is gone (aborted, or its runtime shut down).
    ReaperGone,
}

impl fmt::Display for TimerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TimerError::AtCapacity => "timer is at its limit of pending timeouts",
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
