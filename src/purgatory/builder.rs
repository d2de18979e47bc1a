//! The purgatory's builder.

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use super::shared::Shared;
use super::{Operation, Purgatory, WatchKey};
use crate::core::Core;
use crate::reaper::{Host, Reaper};
use crate::settings::{wheel_setters, BuildError, Settings};
use crate::watchers::KeyHasher;

/// Builds a [`Purgatory`].
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// # struct Fetch;
/// # impl tokio_purgatory::Operation for Fetch {
/// #     type Output = ();
/// #     fn try_complete(&mut self) -> Option<()> { None }
/// #     fn on_expiration(self) {}
/// # }
/// use tokio_purgatory::Purgatory;
///
/// let fetches: Purgatory<(String, u32), Fetch> = Purgatory::builder().name("fetch")
///     .purge_interval(1000)
///     .max_pending(100_000)
///     .build()
///     .unwrap();
/// assert_eq!(fetches.delayed(), 0);
/// # }
/// ```
pub struct PurgatoryBuilder<K, O, S = RandomState> {
    pub(super) name: Arc<str>,
    pub(super) wheel: Settings,
    /// A shared reaper to be served by, instead of one of its own.
    pub(super) reaper: Option<Reaper>,
    pub(super) watcher_shards: usize,
    pub(super) purge_interval: usize,
    pub(super) max_pending: Option<usize>,
    pub(super) hasher: S,
    pub(super) _types: PhantomData<fn() -> (K, O)>,
}

impl<K, O, S: Clone> Clone for PurgatoryBuilder<K, O, S> {
    fn clone(&self) -> Self {
        PurgatoryBuilder {
            name: self.name.clone(),
            wheel: self.wheel.clone(),
            reaper: self.reaper.clone(),
            hasher: self.hasher.clone(),
            _types: PhantomData,
            ..*self
        }
    }
}

impl<K, O, S> std::fmt::Debug for PurgatoryBuilder<K, O, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PurgatoryBuilder")
            .field("name", &&*self.name)
            .field("wheel", &self.wheel)
            .field("reaper", &self.reaper)
            .field("watcher_shards", &self.watcher_shards)
            .field("purge_interval", &self.purge_interval)
            .field("max_pending", &self.max_pending)
            .finish()
    }
}

impl<K: WatchKey, O: Operation, S: BuildHasher + Send + Sync + 'static> PurgatoryBuilder<K, O, S> {
    wheel_setters!(
        "struct Op; impl tokio_purgatory::Operation for Op { type Output = (); fn try_complete(&mut self) -> Option<()> { None } fn on_expiration(self) {} }",
        "tokio_purgatory::Purgatory::<u32, Op>::builder()"
    );

    /// The name that labels this purgatory's `tracing` events and, with the
    /// `metrics` feature, the `name` label of every series it records
    /// (default `"purgatory"`).
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// # struct Op;
    /// # impl tokio_purgatory::Operation for Op {
    /// #     type Output = ();
    /// #     fn try_complete(&mut self) -> Option<()> { None }
    /// #     fn on_expiration(self) {}
    /// # }
    /// let produce: tokio_purgatory::Purgatory<u32, Op> =
    ///     tokio_purgatory::Purgatory::builder().name("produce").build().unwrap();
    /// # drop(produce);
    /// # }
    /// ```
    pub fn name(mut self, name: &str) -> Self {
        self.name = name.into();
        self
    }

    /// Independently locked timer wheels, 1 to 1,024 (default: the machine's
    /// parallelism, at most 16).
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// # struct Op;
    /// # impl tokio_purgatory::Operation for Op {
    /// #     type Output = ();
    /// #     fn try_complete(&mut self) -> Option<()> { None }
    /// #     fn on_expiration(self) {}
    /// # }
    /// let p: tokio_purgatory::Purgatory<u32, Op> =
    ///     tokio_purgatory::Purgatory::builder().timer_shards(4).build().unwrap();
    /// # drop(p);
    /// # }
    /// ```
    pub fn timer_shards(mut self, shards: usize) -> Self {
        self.wheel.shards = shards;
        self
    }

    /// Independently locked parts of the watcher map (default 64; from 1 to
    /// 65,536, or [`build`](Self::build) fails).
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// # struct Op;
    /// # impl tokio_purgatory::Operation for Op {
    /// #     type Output = ();
    /// #     fn try_complete(&mut self) -> Option<()> { None }
    /// #     fn on_expiration(self) {}
    /// # }
    /// // Few keys (a handful of consumer groups): few shards suffice.
    /// let p: tokio_purgatory::Purgatory<String, Op> =
    ///     tokio_purgatory::Purgatory::builder().watcher_shards(8).build().unwrap();
    /// # drop(p);
    /// # }
    /// ```
    pub fn watcher_shards(mut self, shards: usize) -> Self {
        self.watcher_shards = shards;
        self
    }

    /// Finished operations left as tombstones in watch lists before a purge may
    /// run (default 1000, Kafka's `purgeInterval`). A purge starts once
    /// tombstones exceed both this and the live entries, so it removes at least
    /// as many entries as it keeps. It runs in slices on the threads of
    /// registrations, key walks and cancellations by key: each such call
    /// visits at most 128 plain entries (a key's watches at a
    /// level, kept in a heap, are visited in one go when the purge reaches
    /// them), and the purge ends once it has been through every key. No call stalls for a pass over every list;
    /// the purge notes the keys of one watcher shard at a time as it reaches
    /// it, one word per key. Walking a key also removes its own tombstones.
    ///
    /// Whatever the interval, an expiry or a cancellation (by a dropped
    /// handle, `cancel` or [`OpRef::cancel`](crate::OpRef::cancel)) that
    /// leaves at least as many tombstones as live entries, and at least 16,
    /// starts a purge at once: a map of up to about 1,000 entries is purged
    /// whole in that call (on the reaper, or the thread that cancelled), a
    /// larger one by the slices of the registrations and walks that follow
    /// and by the reaper task, up to about 2,000 entries a turn (woken once
    /// for it when the call was not on the reaper), so that it ends though
    /// no registration or walk follows.
    /// So the keys of hang-ups and expiries that nobody else watches leave
    /// the map soon after their tombstones come to equal the live entries.
    /// The expiry or cancellation that leaves nothing pending starts a purge
    /// of the whole map, whatever the count: that call does a bounded part
    /// (up to about 2,000 entries, and the keys of the shards it reaches,
    /// noted and sorted a shard at a time), and the reaper task the rest, as
    /// much again per turn, between its other work. A completion that leaves
    /// nothing pending starts it so when the reaper sleeps with nothing
    /// scheduled; otherwise the reaper's next turn (which comes by the
    /// earliest timeout the finished operations had: with far timeouts, and
    /// no registration or walk after them, not for that long) does. The keys
    /// a now idle purgatory
    /// held leave the map so, with no further call; a closed purgatory, which
    /// its reaper serves no more (shut down, or its reaper lost), is purged
    /// whole at once.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// # struct Op;
    /// # impl tokio_purgatory::Operation for Op {
    /// #     type Output = ();
    /// #     fn try_complete(&mut self) -> Option<()> { None }
    /// #     fn on_expiration(self) {}
    /// # }
    /// use tokio_purgatory::Purgatory;
    ///
    /// // Purge as soon as tombstones outnumber live entries.
    /// let p: Purgatory<u32, Op> = Purgatory::builder().name("eager").purge_interval(0).build().unwrap();
    /// assert_eq!(p.metrics().purged, 0);
    /// # }
    /// ```
    pub fn purge_interval(mut self, interval: usize) -> Self {
        self.purge_interval = interval;
        self
    }

    /// Limit on pending operations (default: none; at least 1, or
    /// [`build`](Self::build) fails). At the limit, registration hands the
    /// operation back in [`WatchError::AtCapacity`](super::WatchError::AtCapacity).
    ///
    /// An operation's room is free from the moment its fate is decided,
    /// before any code its finish runs: its
    /// [`on_expiration`](super::Operation::on_expiration) and the drop of the
    /// operation (after a completion or a cancellation) may register another
    /// in its place, as a retry or a renewed session does, whichever way it
    /// finished. (What [`delayed`](super::Purgatory::delayed) and a
    /// [`drain`](super::Purgatory::drain) count is said on `delayed`.)
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// # struct Op;
    /// # impl tokio_purgatory::Operation for Op {
    /// #     type Output = ();
    /// #     fn try_complete(&mut self) -> Option<()> { None }
    /// #     fn on_expiration(self) {}
    /// # }
    /// use std::time::Duration;
    /// use tokio_purgatory::{Purgatory, WatchError};
    ///
    /// let p: Purgatory<u32, Op> = Purgatory::builder().max_pending(1).build().unwrap();
    /// let first = p.try_complete_else_watch(Op, Duration::from_secs(1), [1]).unwrap();
    /// let refused = p.try_complete_else_watch(Op, Duration::from_secs(1), [1]);
    /// assert!(matches!(refused, Err(WatchError::AtCapacity(_))));
    /// # drop(first);
    /// # }
    /// ```
    pub fn max_pending(mut self, max: usize) -> Self {
        self.max_pending = Some(max);
        self
    }

    /// The hasher of the watcher map (default std's `RandomState`, SipHash
    /// with a random seed, as `HashMap`'s). Each key a call is given is
    /// hashed once, before any lock is taken (a key given twice is hashed
    /// twice, save a plain duplicate among a registration's first 16 keys,
    /// which `Eq` finds unhashed; a walk hashes its one key once and finds
    /// its list by that hash again for the prune after); a faster hasher (ahash,
    /// fxhash) cuts that cost, at the price of `RandomState`'s resistance to
    /// keys chosen to collide when keys come from untrusted clients. A panic in
    /// the hasher propagates to the caller as one in the key's `Hash` does,
    /// with the purgatory left as it was.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// # struct Op;
    /// # impl tokio_purgatory::Operation for Op {
    /// #     type Output = ();
    /// #     fn try_complete(&mut self) -> Option<()> { None }
    /// #     fn on_expiration(self) {}
    /// # }
    /// use std::hash::{BuildHasherDefault, DefaultHasher};
    /// use tokio_purgatory::Purgatory;
    ///
    /// type Fixed = BuildHasherDefault<DefaultHasher>;
    /// let p: Purgatory<String, Op, Fixed> = Purgatory::builder()
    ///     .name("join")
    ///     .hasher(Fixed::default())
    ///     .build()
    ///     .unwrap();
    /// assert_eq!(p.try_complete_watched("group-1"), 0);
    /// # }
    /// ```
    pub fn hasher<T: BuildHasher + Send + Sync + 'static>(
        self,
        hasher: T,
    ) -> PurgatoryBuilder<K, O, T> {
        PurgatoryBuilder {
            name: self.name,
            wheel: self.wheel,
            reaper: self.reaper,
            watcher_shards: self.watcher_shards,
            purge_interval: self.purge_interval,
            max_pending: self.max_pending,
            hasher,
            _types: PhantomData,
        }
    }

    /// Builds the purgatory and spawns its reaper on the current runtime (with
    /// a shared [`reaper`](Self::reaper), joins that one instead, and needs
    /// no current runtime).
    ///
    /// # Errors
    ///
    /// When a setting is out of range (the error names it), no runtime
    /// is current and no shared reaper was given
    /// ([`BuildError::is_no_runtime`]), or the shared
    /// [`Reaper`](crate::Reaper) given to [`reaper`](Self::reaper) has stopped
    /// ([`BuildError::is_reaper_stopped`]).
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// # struct Op;
    /// # impl tokio_purgatory::Operation for Op {
    /// #     type Output = ();
    /// #     fn try_complete(&mut self) -> Option<()> { None }
    /// #     fn on_expiration(self) {}
    /// # }
    /// let p: tokio_purgatory::Purgatory<u32, Op> =
    ///     tokio_purgatory::Purgatory::builder().name("produce").build().unwrap();
    /// # drop(p);
    /// # }
    /// ```
    pub fn build(self) -> Result<Purgatory<K, O, S>, BuildError> {
        self.build_inner(None)
    }

    /// Builds the purgatory and spawns its reaper on the runtime of `handle`
    /// (with a shared [`reaper`](Self::reaper), joins that one instead, and
    /// `handle` is not used).
    ///
    /// # Errors
    ///
    /// When a setting is out of range (the error names it), or the
    /// shared [`Reaper`](crate::Reaper) given to [`reaper`](Self::reaper) has
    /// stopped ([`BuildError::is_reaper_stopped`]).
    ///
    /// # Examples
    ///
    /// ```
    /// # struct Op;
    /// # impl tokio_purgatory::Operation for Op {
    /// #     type Output = ();
    /// #     fn try_complete(&mut self) -> Option<()> { None }
    /// #     fn on_expiration(self) {}
    /// # }
    /// // Built on a thread outside the runtime, its reaper spawned on that runtime.
    /// let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    /// let p: tokio_purgatory::Purgatory<u32, Op> =
    ///     tokio_purgatory::Purgatory::builder().build_on(rt.handle()).unwrap();
    /// assert!(!p.is_shutdown());
    /// ```
    pub fn build_on(
        self,
        handle: &tokio::runtime::Handle,
    ) -> Result<Purgatory<K, O, S>, BuildError> {
        self.build_inner(Some(handle))
    }

    fn build_inner(
        self,
        handle: Option<&tokio::runtime::Handle>,
    ) -> Result<Purgatory<K, O, S>, BuildError> {
        // The application's hasher first: a build that fails drops it, and a
        // panic in its `Drop` is then contained.
        let hasher = KeyHasher::new(self.hasher, self.name.clone());
        // The timer's `shards` is this builder's `timer_shards`: the error
        // names the setting as this builder calls it.
        if self.wheel.shards == 0 || self.wheel.shards > 1024 {
            return Err(BuildError::invalid("timer_shards must be in 1..=1024"));
        }
        self.wheel.validate()?;
        if self.watcher_shards == 0 || self.watcher_shards > 65_536 {
            return Err(BuildError::invalid("watcher_shards must be in 1..=65536"));
        }
        if self.max_pending == Some(0) {
            return Err(BuildError::invalid("max_pending must be at least 1"));
        }
        let host = Host::new(self.reaper.as_ref(), handle)?;
        let core = Core::start(
            &self.wheel,
            self.name.clone(),
            None,
            host,
            std::sync::OnceLock::new(),
        )?;
        let shared = Arc::new(Shared::new(
            core,
            self.watcher_shards,
            self.purge_interval,
            self.max_pending,
            self.name,
            hasher,
        ));
        shared.lend_to_core();
        Ok(Purgatory::from_shared(shared))
    }
}
