//! What the wheel holds for the timer: a user's task or a sleep's signal, behind
//! one thin trait object, and the task handed back unrun.

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use super::error::ScheduleError;
use super::future::SleepSignal;
use crate::reaper::{Closed, Job, Refused};

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
struct SleepEntry(Arc<SleepSignal>);

impl TaskFn for SleepEntry {
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
    fn expire(self) {
        self.0.call();
    }

    fn abandon(self, why: Closed) {
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

/// A task handed back by [`Timer::shutdown`](super::Timer::shutdown) without having run.
pub struct UnrunTask {
    pub(super) task: Box<dyn TaskFn>,
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
