//! The futures of the standalone timer.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use futures::task::AtomicWaker;
use tokio::time::Instant;

use super::error::TimerError;
use super::task::TimerJob;
use crate::reaper::{Closed, Core, TimerKey};

const WAITING: u8 = 0;
const FIRED: u8 = 1;
const SHUT_DOWN: u8 = 2;
const REAPER_GONE: u8 = 3;

/// What the wheel holds for a [`Sleep`]: the outcome and the waker to call.
#[derive(Debug, Default)]
pub(crate) struct SleepSignal {
    state: AtomicU8,
    waker: AtomicWaker,
}

impl SleepSignal {
    pub(crate) fn fire(&self) {
        self.finish(FIRED);
    }

    pub(crate) fn abandon(&self, why: Closed) {
        self.finish(match why {
            Closed::Shutdown => SHUT_DOWN,
            Closed::ReaperGone => REAPER_GONE,
        });
    }

    fn finish(&self, state: u8) {
        if self
            .state
            .compare_exchange(WAITING, state, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            self.waker.wake();
        }
    }

    fn outcome(&self) -> Option<Result<(), TimerError>> {
        match self.state.load(Ordering::Acquire) {
            WAITING => None,
            FIRED => Some(Ok(())),
            SHUT_DOWN => Some(Err(TimerError::Shutdown)),
            _ => Some(Err(TimerError::ReaperGone)),
        }
    }
}

/// A future that completes when the timer's reaper reaches its deadline.
///
/// Made by [`Timer::sleep`](crate::Timer::sleep) and
/// [`Timer::sleep_until`](crate::Timer::sleep_until). It is entered in the wheel
/// when it is created, not when first polled, so its deadline counts from the call.
///
/// It resolves to `Ok(())` no earlier than its deadline (at most about one tick
/// late, plus the time the reaper waits to be scheduled), or to an error when the
/// timer was at capacity at creation, shut down, or lost its reaper.
///
/// # Cancel safety
///
/// Dropping a `Sleep` removes its entry from the wheel at once (O(1)); nothing
/// runs afterwards. Polling it from another task replaces the waker: the last
/// task to poll is the one woken.
#[derive(Debug)]
#[must_use = "futures do nothing unless polled"]
pub struct Sleep {
    inner: Result<Registered, TimerError>,
    deadline: Instant,
}

#[derive(Debug)]
struct Registered {
    core: Arc<Core<TimerJob>>,
    key: TimerKey,
    signal: Arc<SleepSignal>,
}

impl Sleep {
    pub(crate) fn new(core: &Arc<Core<TimerJob>>, now: Instant, deadline: Instant) -> Sleep {
        let signal = Arc::new(SleepSignal::default());
        let inner = match core.insert(now, deadline, TimerJob::sleep(signal.clone())) {
            Ok(key) => Ok(Registered {
                core: core.clone(),
                key,
                signal,
            }),
            Err(refused) => Err(TimerError::from(&refused)),
        };
        Sleep { inner, deadline }
    }

    /// The instant this sleep is due.
    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// Whether the sleep has finished (fired or failed), so that polling it would
    /// return `Ready`.
    pub fn is_elapsed(&self) -> bool {
        match &self.inner {
            Ok(r) => r.signal.outcome().is_some(),
            Err(_) => true,
        }
    }
}

impl Future for Sleep {
    type Output = Result<(), TimerError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let r = match &self.inner {
            Ok(r) => r,
            Err(e) => return Poll::Ready(Err(*e)),
        };
        if let Some(out) = r.signal.outcome() {
            return Poll::Ready(out);
        }
        r.signal.waker.register(cx.waker());
        // Re-check: the reaper may have fired between the load and the register.
        match r.signal.outcome() {
            Some(out) => Poll::Ready(out),
            None => Poll::Pending,
        }
    }
}

impl Drop for Sleep {
    fn drop(&mut self) {
        if let Ok(r) = &self.inner {
            if r.signal.outcome().is_none() {
                // The job holds only a signal: dropping it under no lock is harmless.
                drop(r.core.remove(r.key));
            }
        }
    }
}
