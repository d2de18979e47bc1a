//! The futures of the standalone timer.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use pin_project_lite::pin_project;
use tokio::time::Instant;

use super::error::{TimeoutError, TimerError};
use super::task::{SleepSignal, TimerJob};
use crate::core::{Core, TimerKey};

/// A future that completes when the timer's reaper reaches its deadline.
///
/// Made by [`Timer::sleep`](crate::Timer::sleep) and
/// [`Timer::sleep_until`](crate::Timer::sleep_until). It is entered in the wheel
/// when it is created, not when first polled, so its deadline counts from the call.
///
/// It resolves to `Ok(())` no earlier than its deadline: late by less than one
/// tick, plus the time the reaper waits to be scheduled, plus up to 2 ms from
/// Tokio's own timer (see the crate's [guarantees](crate#guarantees)). It
/// resolves to an error instead when the timer was at capacity at creation
/// ([`TimerError::AtCapacity`]), is shut down or its last
/// [`Timer`](crate::Timer) clone dropped ([`TimerError::Shutdown`]), or lost
/// its reaper ([`TimerError::ReaperGone`]). A `Sleep` does not keep the timer
/// open.
///
/// # Cancel safety
///
/// Dropping a `Sleep` removes its entry from the wheel at once (O(1)); nothing
/// runs afterwards. Polling it from another task replaces the waker: the last
/// task to poll is the one woken.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
/// use std::time::Duration;
/// use tokio::time::Instant;
/// use tokio_purgatory::timer::TimerError;
/// use tokio_purgatory::Timer;
///
/// let timer = Timer::new();
/// let start = Instant::now();
/// let nap = timer.sleep(Duration::from_millis(10));
/// assert_eq!(nap.await, Ok(()));
/// assert!(start.elapsed() >= Duration::from_millis(10));
///
/// let long = timer.sleep(Duration::from_secs(60));
/// drop(timer.shutdown());
/// assert_eq!(long.await, Err(TimerError::Shutdown));
/// # }
/// ```
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
    /// let sleep = timer.sleep(Duration::from_secs(1));
    /// assert_eq!(sleep.deadline(), start + Duration::from_secs(1));
    /// # }
    /// ```
    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// Whether the sleep has finished (fired or failed), so that polling it would
    /// return `Ready`.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// use std::time::Duration;
    ///
    /// let timer = tokio_purgatory::Timer::new();
    /// let mut sleep = timer.sleep(Duration::from_millis(10));
    /// assert!(!sleep.is_elapsed());
    /// (&mut sleep).await.unwrap();
    /// assert!(sleep.is_elapsed());
    /// # }
    /// ```
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
        match r.signal.poll_outcome(cx.waker(), &r.core.panics) {
            Some(out) => Poll::Ready(out),
            None => Poll::Pending,
        }
    }
}

impl Sleep {
    /// Gives the entry up now, as a drop does: out of the wheel, its room
    /// under the limit given back, never counted as fired. The sleep reads
    /// as elapsed afterwards (nothing polls it again: its timeout's future
    /// finished first).
    pub(super) fn disarm(&mut self) {
        if let Ok(r) = std::mem::replace(&mut self.inner, Err(TimerError::Shutdown)) {
            r.release();
        }
    }
}

impl Registered {
    fn release(&self) {
        if self.signal.outcome().is_none() {
            // A turn that took the entry out already fires nothing.
            self.signal.dropped();
            // The job holds only a signal: dropping it under no lock is harmless.
            drop(self.core.remove(self.key));
        }
        // The waker kept from the last poll is a clone the timer made:
        // dropped here, contained, not with the signal's last reference.
        self.core
            .panics
            .drop_value("drop of a waker", self.signal.take_waker());
    }
}

impl Drop for Sleep {
    fn drop(&mut self) {
        if let Ok(r) = &self.inner {
            r.release();
        }
    }
}

pin_project! {
    /// A future with a deadline on the timer's wheel: made by
    /// [`Timer::timeout`](crate::Timer::timeout) and
    /// [`Timer::timeout_at`](crate::Timer::timeout_at).
    ///
    /// Resolves to `Ok(output)` if the inner future finishes first, or to
    /// [`TimeoutError::Elapsed`] once the deadline has passed (then the inner future
    /// is not polled again; drop it to cancel it). If the timer is shut down or
    /// loses its reaper first, the deadline can no longer be kept, and it resolves
    /// to [`TimeoutError::Timer`] with the reason.
    ///
    /// The inner future is polled first, so a future that is ready at the deadline
    /// wins. Once it has, the deadline leaves the wheel at once (its room under
    /// [`max_pending`](crate::timer::TimerBuilder::max_pending) is free again,
    /// and it is not counted as fired), whether or not this future is kept. A
    /// deadline the reaper reached before the future was polled ready is
    /// counted as fired (in [`TimerMetrics::expired`](crate::timer::TimerMetrics::expired),
    /// with a lateness sample) even so: for example when the inner future is
    /// made ready by a task of the reaper's turn that fires the deadline, or
    /// when this future's task is polled late. It still resolves to the
    /// future's output.
    ///
    /// # Cancel safety
    ///
    /// Dropping it drops the inner future and removes the deadline from the wheel
    /// (O(1)).
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
    /// let quick = timer.timeout(Duration::from_millis(50), async { 7 });
    /// assert_eq!(quick.await, Ok(7));
    ///
    /// let slow = timer.timeout(Duration::from_millis(50), std::future::pending::<()>());
    /// assert_eq!(slow.await, Err(TimeoutError::Elapsed));
    /// # }
    /// ```
    #[derive(Debug)]
    #[must_use = "futures do nothing unless polled"]
    pub struct TimeoutFuture<F> {
        #[pin]
        future: F,
        deadline: Sleep,
        // The error it resolved to: polled again, it says the same, and the
        // inner future is not polled again.
        ended: Option<TimeoutError>,
    }
}

impl<F> TimeoutFuture<F> {
    pub(crate) fn new(future: F, deadline: Sleep) -> Self {
        TimeoutFuture {
            future,
            deadline,
            ended: None,
        }
    }

    /// The inner future.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// use std::time::Duration;
    ///
    /// let timer = tokio_purgatory::Timer::new();
    /// let t = timer.timeout(Duration::from_secs(1), std::future::ready(7));
    /// assert_eq!(t.get_ref().clone().into_inner(), 7);
    /// # }
    /// ```
    pub fn get_ref(&self) -> &F {
        &self.future
    }

    /// The inner future, mutably (it must not be moved out of its pin).
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// use std::time::Duration;
    ///
    /// let timer = tokio_purgatory::Timer::new();
    /// let mut t = timer.timeout(Duration::from_secs(1), std::future::ready(7));
    /// let _inner: &mut std::future::Ready<i32> = t.get_mut();
    /// # }
    /// ```
    pub fn get_mut(&mut self) -> &mut F {
        &mut self.future
    }

    /// The inner future, giving up the deadline.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// use std::time::Duration;
    ///
    /// let timer = tokio_purgatory::Timer::new();
    /// let t = timer.timeout(Duration::from_secs(1), async { 7 });
    /// // Give up the deadline and await the future alone.
    /// assert_eq!(t.into_inner().await, 7);
    /// # }
    /// ```
    pub fn into_inner(self) -> F {
        self.future
    }

    /// The instant the deadline falls.
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
    /// let t = timer.timeout(Duration::from_secs(1), async { 7 });
    /// assert_eq!(t.deadline(), start + Duration::from_secs(1));
    /// # }
    /// ```
    pub fn deadline(&self) -> Instant {
        self.deadline.deadline()
    }
}

impl<F: Future> Future for TimeoutFuture<F> {
    type Output = Result<F::Output, TimeoutError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        if let Some(e) = *this.ended {
            return Poll::Ready(Err(e));
        }
        if let Poll::Ready(out) = this.future.poll(cx) {
            // The deadline's entry goes now, not when this future is dropped:
            // it holds no room, and never fires, from here on.
            this.deadline.disarm();
            return Poll::Ready(Ok(out));
        }
        let e = match Pin::new(this.deadline).poll(cx) {
            Poll::Ready(Ok(())) => TimeoutError::Elapsed,
            Poll::Ready(Err(e)) => TimeoutError::Timer(e),
            Poll::Pending => return Poll::Pending,
        };
        *this.ended = Some(e);
        Poll::Ready(Err(e))
    }
}
