//! The handle of a scheduled task.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::task::TimerJob;
use crate::reaper::{drop_contained, note_panic, Core, TimerKey};

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
    pub(super) fn new(core: Arc<Core<TimerJob>>, key: TimerKey) -> Timeout {
        Timeout {
            core,
            key,
            cancelled: AtomicBool::new(false),
        }
    }
}

impl Timeout {
    /// Cancels the task if it has not run: O(1), and the task is dropped at once,
    /// on this thread, with no lock held (a panic in its `Drop` is caught and
    /// counted in [`TimerStats::panicked`](super::TimerStats::panicked)). Returns whether this call cancelled it.
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
