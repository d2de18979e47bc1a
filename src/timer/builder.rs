//! The timer's builder.

use std::sync::Arc;
use std::time::Duration;

use super::{Owner, Timer};
use crate::core::Core;
use crate::reaper::{Host, Reaper};
use crate::settings::{wheel_setters, BuildError, Settings};

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
    pub(super) wheel: Settings,
    /// A shared reaper to be served by, instead of one of its own.
    pub(super) reaper: Option<Reaper>,
    pub(super) max_pending: Option<usize>,
    pub(super) name: Arc<str>,
}

impl TimerBuilder {
    wheel_setters!("let _ = 0;", "tokio_purgatory::Timer::builder()");

    /// Number of independently locked wheels, 1 to 1024 (default: the machine's
    /// parallelism, at most 16). A thread always inserts into the same shard, so
    /// producers on different threads rarely contend. Outside that range, `build`
    /// fails with a [`BuildError`].
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let timer = tokio_purgatory::Timer::builder().shards(4).build().unwrap();
    /// # drop(timer);
    /// # }
    /// ```
    pub fn shards(mut self, shards: usize) -> Self {
        self.wheel.shards = shards;
        self
    }

    /// Limit on pending entries, at least 1 (default: none; `0` makes `build`
    /// fail with a [`BuildError`]). Tasks, sleeps and timeout futures count
    /// alike. At the limit, `schedule` returns the task in
    /// [`ScheduleError::AtCapacity`](super::ScheduleError::AtCapacity), a sleep
    /// made then resolves to [`TimerError::AtCapacity`](super::TimerError::AtCapacity),
    /// and a timeout future made then fails with that reason in
    /// [`TimeoutError::Timer`](super::TimeoutError::Timer) unless its future is
    /// ready first. Counting
    /// pending entries needs one shared counter, which costs some multi-producer
    /// throughput.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// use std::time::Duration;
    /// use tokio_purgatory::timer::ScheduleError;
    ///
    /// let timer = tokio_purgatory::Timer::builder().max_pending(1).build().unwrap();
    /// timer.schedule(Duration::from_secs(1), || {}).unwrap();
    /// let refused = timer.schedule(Duration::from_secs(1), || {});
    /// assert!(matches!(refused, Err(ScheduleError::AtCapacity(_))));
    /// # }
    /// ```
    pub fn max_pending(mut self, max: usize) -> Self {
        self.max_pending = Some(max);
        self
    }

    /// The name that labels this timer's `tracing` events and, with the
    /// `metrics` feature, the `name` label of every series it records
    /// (default `"timer"`).
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let timer = tokio_purgatory::Timer::builder().name("retries").build().unwrap();
    /// # drop(timer);
    /// # }
    /// ```
    pub fn name(mut self, name: &str) -> Self {
        self.name = name.into();
        self
    }

    /// Builds the timer and spawns its reaper on the current Tokio runtime (with
    /// a shared [`reaper`](Self::reaper), joins that one instead, and needs no
    /// current runtime).
    ///
    /// # Errors
    ///
    /// A [`BuildError`] when a setting is out of range (its message names the
    /// setting), when no runtime is current and no shared reaper was given
    /// ([`BuildError::is_no_runtime`]), or when the shared reaper given has
    /// stopped ([`BuildError::is_reaper_stopped`]).
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let timer = tokio_purgatory::Timer::builder().build().unwrap();
    /// assert!(timer.is_empty());
    /// # }
    /// ```
    pub fn build(self) -> Result<Timer, BuildError> {
        self.build_inner(None)
    }

    /// Builds the timer and spawns its reaper on the runtime of `handle` (with a
    /// shared [`reaper`](Self::reaper), joins that one instead, and `handle` is
    /// not used).
    ///
    /// # Errors
    ///
    /// A [`BuildError`] when a setting is out of range (its message names the
    /// setting), or when the shared reaper given has stopped
    /// ([`BuildError::is_reaper_stopped`]).
    ///
    /// # Examples
    ///
    /// ```
    /// // Built on a thread outside the runtime, its reaper spawned on that runtime.
    /// let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    /// let timer = tokio_purgatory::Timer::builder().build_on(rt.handle()).unwrap();
    /// assert!(!timer.is_shutdown());
    /// ```
    pub fn build_on(self, handle: &tokio::runtime::Handle) -> Result<Timer, BuildError> {
        self.build_inner(Some(handle))
    }

    fn build_inner(self, handle: Option<&tokio::runtime::Handle>) -> Result<Timer, BuildError> {
        self.wheel.validate()?;
        if self.max_pending == Some(0) {
            return Err(BuildError::invalid("max_pending must be at least 1"));
        }
        let host = Host::new(self.reaper.as_ref(), handle)?;
        let core = Core::start(&self.wheel, self.name, self.max_pending, host, ())?;
        Ok(Timer {
            owner: Arc::new(Owner { core }),
        })
    }
}
