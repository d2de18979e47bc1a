//! What building a timer core takes: its settings (shared by the timer and
//! purgatory builders, checked once here), the runtime to spawn the reaper on,
//! and the error when either is wrong.

use std::fmt;
use std::time::Duration;

use crate::wheel::{ShapeError, Wheel};

/// The timer core's settings, shared by the timer and purgatory builders.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub(crate) tick: Duration,
    pub(crate) slots: usize,
    pub(crate) levels: usize,
    pub(crate) shards: usize,
    pub(crate) batch: usize,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            tick: Duration::from_micros(100),
            slots: 64,
            levels: 6,
            shards: std::thread::available_parallelism()
                .map_or(4, |n| n.get())
                .clamp(1, 16),
            batch: 1024,
        }
    }
}

impl Settings {
    pub(crate) fn validate(&self) -> Result<(), BuildError> {
        if self.tick.is_zero() {
            return Err(BuildError::invalid("tick must be longer than zero"));
        }
        // The wheel's own check is the only one.
        match Wheel::<()>::new(self.slots, self.levels) {
            Ok(_) => {}
            Err(ShapeError::Slots) => {
                return Err(BuildError::invalid("slots_per_level must be in 2..=64"))
            }
            Err(ShapeError::Levels) => {
                return Err(BuildError::invalid(
                    "levels must be at least 1 and slots_per_level^levels below 2^62",
                ))
            }
        }
        if self.shards == 0 || self.shards > 1024 {
            return Err(BuildError::invalid("shards must be in 1..=1024"));
        }
        if self.batch == 0 {
            return Err(BuildError::invalid("batch_size must be at least 1"));
        }
        Ok(())
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

/// The setters both builders share (the timer's and the purgatory's), for a
/// builder with a `wheel: Settings` field.
macro_rules! wheel_setters {
    ($setup:literal, $builder:literal) => {
        /// The tick: the wheel's unit of time, longer than zero (default 100 µs;
        /// a zero tick makes `build` fail with a [`BuildError`](crate::BuildError)).
        /// Deadlines are rounded up to whole ticks, so a timeout is late by less
        /// than one tick, never early, plus what Tokio's timer adds to the
        /// reaper's sleep (up to 2 ms: see the crate's "Never early"
        /// guarantee). The reaper sleeps on Tokio's timer, which
        /// wakes at most once a millisecond, so a tick below 1 ms cuts lateness
        /// without adding wake-ups; a larger tick means fewer wake-ups for sparse
        /// timeouts.
        ///
        /// # Examples
        ///
        /// ```
        /// # #[tokio::main(flavor = "current_thread")] async fn main() {
        #[doc = concat!("# ", $setup)]
        /// # #[allow(unused_imports)]
        /// use std::time::Duration;
        #[doc = concat!("let built = ", $builder, ".tick(Duration::from_millis(1)).build().unwrap();")]
        /// # drop(built);
        /// # }
        /// ```
        pub fn tick(mut self, tick: Duration) -> Self {
            self.wheel.tick = tick;
            self
        }

        /// Slots per wheel level, 2 to 64 (default 64; outside that range `build`
        /// fails with a [`BuildError`](crate::BuildError)). Powers of two are
        /// fastest.
        ///
        /// # Examples
        ///
        /// ```
        /// # #[tokio::main(flavor = "current_thread")] async fn main() {
        #[doc = concat!("# ", $setup)]
        /// # #[allow(unused_imports)]
        /// use std::time::Duration;
        #[doc = concat!("let built = ", $builder, ".slots_per_level(32).build().unwrap();")]
        /// # drop(built);
        /// # }
        /// ```
        pub fn slots_per_level(mut self, slots: usize) -> Self {
            self.wheel.slots = slots;
            self
        }

        /// Number of wheel levels (default 6: with 64 slots of 100 µs, 2^36 ticks,
        /// about 80 days). Later deadlines are still accepted and never fire early;
        /// they wait in an overflow list revisited once per turn of the top level.
        ///
        /// At least 1, with `slots_per_level` to the power `levels` below 2^62
        /// (with 64 slots, at most 10 levels); otherwise `build` fails with a
        /// [`BuildError`](crate::BuildError).
        ///
        /// # Examples
        ///
        /// ```
        /// # #[tokio::main(flavor = "current_thread")] async fn main() {
        #[doc = concat!("# ", $setup)]
        /// # #[allow(unused_imports)]
        /// use std::time::Duration;
        #[doc = concat!("let built = ", $builder, ".levels(4).tick(Duration::from_millis(10)).build().unwrap();")]
        /// # drop(built);
        /// # }
        /// ```
        pub fn levels(mut self, levels: usize) -> Self {
            self.wheel.levels = levels;
            self
        }

        /// Most entries the reaper expires from one shard before yielding to other
        /// tasks, at least 1 (default 1024; `0` makes `build` fail with a
        /// [`BuildError`](crate::BuildError)), so a million timeouts sharing a
        /// deadline cannot starve the runtime.
        ///
        /// # Examples
        ///
        /// ```
        /// # #[tokio::main(flavor = "current_thread")] async fn main() {
        #[doc = concat!("# ", $setup)]
        /// # #[allow(unused_imports)]
        /// use std::time::Duration;
        #[doc = concat!("let built = ", $builder, ".batch_size(256).build().unwrap();")]
        /// # drop(built);
        /// # }
        /// ```
        pub fn batch_size(mut self, batch: usize) -> Self {
            self.wheel.batch = batch;
            self
        }

        /// Serves it from a shared [`Reaper`](crate::Reaper) task instead of
        /// spawning one of its own (the default): see the `Reaper` docs for the
        /// lifecycle. `build` then needs no current runtime, and `build_on`'s
        /// runtime is not used: the reaper runs where it was started. If that
        /// reaper has stopped by then, `build` and `build_on` fail
        /// ([`BuildError::is_reaper_stopped`](crate::BuildError::is_reaper_stopped)).
        ///
        /// # Examples
        ///
        /// ```
        /// # #[tokio::main(flavor = "current_thread")] async fn main() {
        #[doc = concat!("# ", $setup)]
        /// let reaper = tokio_purgatory::Reaper::start().unwrap();
        #[doc = concat!("let built = ", $builder, ".reaper(&reaper).build().unwrap();")]
        /// assert_eq!(reaper.serving(), 1);
        /// # drop(built);
        /// # }
        /// ```
        pub fn reaper(mut self, reaper: &crate::Reaper) -> Self {
            self.reaper = Some(reaper.clone());
            self
        }
    };
}
pub(crate) use wheel_setters;

/// A timer, purgatory or shared reaper could not be built, for one of three
/// reasons:
///
/// - a builder setting is out of range (the setters' docs give the ranges; the
///   message names the setting);
/// - no Tokio runtime was current for a `build` or [`Reaper::start`](crate::Reaper::start)
///   that needs one ([`is_no_runtime`](BuildError::is_no_runtime));
/// - the shared [`Reaper`](crate::Reaper) given to the builder has stopped
///   ([`is_reaper_stopped`](BuildError::is_reaper_stopped)).
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use tokio_purgatory::Timer;
///
/// // Settings are checked first, so this fails the same inside a runtime.
/// let err = Timer::builder().tick(Duration::ZERO).build().unwrap_err();
/// assert!(!err.is_no_runtime() && !err.is_reaper_stopped());
/// assert!(err.to_string().contains("tick"));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BuildError {
    kind: BuildErrorKind,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum BuildErrorKind {
    NoRuntime,
    ReaperStopped,
    Invalid(&'static str),
}

impl BuildError {
    pub(crate) fn no_runtime() -> BuildError {
        BuildError {
            kind: BuildErrorKind::NoRuntime,
        }
    }

    pub(crate) fn reaper_stopped() -> BuildError {
        BuildError {
            kind: BuildErrorKind::ReaperStopped,
        }
    }

    pub(crate) fn invalid(what: &'static str) -> BuildError {
        BuildError {
            kind: BuildErrorKind::Invalid(what),
        }
    }

    /// Whether the build failed because no Tokio runtime was current (use
    /// `build_on` with a [`tokio::runtime::Handle`] instead).
    ///
    /// # Examples
    ///
    /// ```
    /// // Outside a runtime, `build` fails and says why.
    /// let err = tokio_purgatory::Timer::builder().build().unwrap_err();
    /// assert!(err.is_no_runtime());
    /// ```
    pub fn is_no_runtime(&self) -> bool {
        self.kind == BuildErrorKind::NoRuntime
    }
}

impl BuildError {
    /// Whether the build failed because the shared [`Reaper`](crate::Reaper) it
    /// was given has stopped (its task was aborted, or its runtime stopped).
    ///
    /// # Examples
    ///
    /// ```
    /// use tokio_purgatory::{Reaper, Timer};
    ///
    /// let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    /// let reaper = Reaper::start_on(rt.handle());
    /// drop(rt);
    /// let err = Timer::builder().reaper(&reaper).build().unwrap_err();
    /// assert!(err.is_reaper_stopped());
    /// ```
    pub fn is_reaper_stopped(&self) -> bool {
        self.kind == BuildErrorKind::ReaperStopped
    }
}

impl fmt::Display for BuildError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            BuildErrorKind::NoRuntime => {
                f.write_str("no tokio runtime is current; build inside one or use build_on")
            }
            BuildErrorKind::ReaperStopped => f.write_str("the shared reaper has stopped"),
            BuildErrorKind::Invalid(what) => write!(f, "invalid setting: {what}"),
        }
    }
}

impl std::error::Error for BuildError {}
