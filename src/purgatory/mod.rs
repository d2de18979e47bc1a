//! The purgatory: operations that wait on watch keys until they complete or time
//! out.
//!
//! See [`Purgatory`] and the [crate docs](crate). Every item here is also at the
//! crate's root.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
//! use std::sync::atomic::{AtomicBool, Ordering};
//! use std::sync::Arc;
//! use std::time::Duration;
//! use tokio_purgatory::purgatory::{Completion, Operation, Purgatory};
//!
//! /// Done once the flag is set; "timed out" otherwise.
//! struct Wait(Arc<AtomicBool>);
//! impl Operation for Wait {
//!     type Output = &'static str;
//!     fn try_complete(&mut self) -> Option<&'static str> {
//!         self.0.load(Ordering::Acquire).then_some("done")
//!     }
//!     fn on_expiration(self) -> &'static str {
//!         "timed out"
//!     }
//! }
//!
//! let p: Purgatory<&str, Wait> = Purgatory::new();
//! let ready = Arc::new(AtomicBool::new(false));
//! let handle = p
//!     .try_complete_else_watch(Wait(ready.clone()), Duration::from_secs(1), ["topic-0"])
//!     .unwrap();
//! ready.store(true, Ordering::Release);
//! assert_eq!(p.try_complete_watched("topic-0"), 1);
//! assert_eq!(handle.await, Ok(Completion::Completed("done")));
//! # }
//! ```

mod books;
mod builder;
mod cell;
mod error;
mod handle;
mod keys;
mod operation;
mod shared;
mod slab;
mod state;

use std::borrow::Borrow;
use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hash};
use std::marker::PhantomData;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use self::books::Fate;
pub use self::builder::PurgatoryBuilder;
use self::cell::OpCell;
pub use self::error::{OperationError, WatchError, WatchErrorKind};
use self::handle::CellRef;
pub use self::handle::{OpRef, OperationHandle, OperationStatus};
pub use self::keys::Watch;
use self::keys::{KeyPanic, Taken, Watches};
pub use self::operation::{Completion, Operation, WatchKey};
use self::shared::{closed_refusal, Shared};
use crate::clock::deadline_after;
pub use crate::core::RefusedMetrics;
pub use crate::histogram::Histogram;
pub use crate::reaper::ReaperMetrics;
use crate::settings::Settings;
use crate::sync::thread_index;

/// Shuts the purgatory down when the last [`Purgatory`] clone is dropped.
struct Owner<K: WatchKey, O: Operation> {
    shared: Arc<Shared<K, O>>,
}

impl<K: WatchKey, O: Operation> Drop for Owner<K, O> {
    fn drop(&mut self) {
        // Pending operations are dropped unrun; their handles see `Shutdown`.
        let ops = self.shared.close(Fate::Cancelled);
        for op in ops {
            self.shared.drop_contained("drop of an operation", op);
        }
    }
}

/// Operations waiting on watch keys until they complete or time out: Kafka's
/// `DelayedOperationPurgatory` for Tokio.
///
/// Each operation is registered under one or more **watch keys** (partitions,
/// group ids) with a **timeout**, and finishes exactly once: when a check run by
/// [`try_complete_watched`](Purgatory::try_complete_watched) (or through its
/// [`OpRef`]) finds it completable, or when its timeout fires. Cheap to clone;
/// `Send + Sync`; all clones share one purgatory.
///
/// `S` is the hasher of the watcher map (default std's `RandomState`; see
/// [`PurgatoryBuilder::hasher`] and [`Purgatory::with_hasher`]). Handles do not
/// carry it.
///
/// # Concurrency
///
/// All methods may be called from any number of threads at once. What runs
/// under which lock:
///
/// - Operation code (`try_complete`, `on_expiration`) and every drop of a user
///   value the purgatory performs (operations, outputs, keys) run with no lock of
///   the purgatory's held, so they may call back into it. The one lock held around
///   user code is the operation's own, around its `try_complete`, which is how
///   checks of one operation never overlap; an event that arrives while one runs
///   makes it check again (unless it is cancelled or its timeout fires
///   meanwhile: it then finishes so).
/// - A key's `Eq` runs under the lock of the watcher-map shard that holds the
///   key (see [`WatchKey`]): it must not call back into the purgatory. So do
///   the key's `Borrow::borrow` and the borrowed form's `Eq`, for the methods
///   that look a key up by a borrowed form (`&Q`). Its `Clone` and `Hash`, and
///   the chosen hasher, run before any lock is taken.
///
/// # Panics in user code
///
/// A panic in `try_complete`, `on_expiration` or the `Drop` of an operation,
/// output or key is caught, counted in [`PurgatoryMetrics::panicked`] and reported
/// through `tracing`; the call that ran it finishes its work, and every handle
/// still resolves exactly once. A panic in a key's `Hash`, `Eq` or `Clone`, or
/// in the hasher, propagates to the caller of the method that ran it, after the purgatory has
/// been put back as it was before the call (see
/// [`try_complete_else_watch`](Purgatory::try_complete_else_watch)).
///
/// # Memory
///
/// A finished operation is dropped at once, and an output is dropped as soon as
/// its handle reads it or is dropped. Each operation lives in a **cell** of
/// [`Purgatory::cell_bytes`] bytes (room for the operation, `size_of::<Op>()`,
/// for its outcome, `size_of::<Op::Output>()`, and about 70 bytes of the
/// cell's own state, its waker and its timer key). A cell is free again once the
/// operation has finished and its handle and every [`OpRef`] to it are gone,
/// and the next registration reuses it: the purgatory keeps cells for the
/// most operations it has had in cells at once (pending, or finished with a
/// handle or `OpRef` still held), in pages of up to 1,024 cells, as a `Vec`
/// keeps its capacity, and a registration allocates nothing once it has grown
/// to that. Box a large operation or output (`Box<LargeState>`) to keep cells
/// small; only the box stays then.
///
/// The operation's entries in the watch lists of its other keys become
/// **tombstones** (8 bytes each, 24 for an entry at a level: they name the
/// cell's use, which has ended, and keep nothing alive) until that key is
/// next walked (an entry at a level: until an advance reaches its level) or
/// the amortised purge, which runs in bounded slices, reaches them (see
/// [`PurgatoryBuilder::purge_interval`]). An expiry or cancellation that
/// leaves tombstones as many as live entries (and at least 16), or leaves
/// nothing pending, starts a purge at once, whatever the interval;
/// completions look only when the reaper sleeps with nothing scheduled
/// (one load), and then apply the same rule; otherwise the reaper's next
/// turn, which comes by the earliest timeout the finished operations had
/// (the alarm set for them stays: with far timeouts and no registration or
/// walk after them, tombstones stay that long), finds the wheels emptied
/// and starts it. Keys whose lists empty are removed.
/// [`PurgatoryMetrics::tombstones`] counts them, apart from live watch
/// entries. A key's list keeps the room it grew to, up to 4,096 entries of
/// each kind (8 bytes each, 24 at a level), whatever it holds; one a burst grew past that gives the room back once it
/// holds under a quarter of it (keeping twice what it holds, and at least
/// 1,024).
///
/// # Shutdown
///
/// [`shutdown`](Purgatory::shutdown) hands back every pending operation, and their
/// handles resolve to [`OperationError::Shutdown`]; registration afterwards hands
/// the operation back in [`WatchError::Shutdown`]. Dropping the last clone does the
/// same but drops the operations. If the reaper's runtime shuts down first, pending
/// operations are dropped, handles resolve to [`OperationError::ReaperGone`], and
/// registration fails with [`WatchError::ReaperGone`].
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
/// use std::sync::atomic::{AtomicU64, Ordering};
/// use std::sync::Arc;
/// use std::time::Duration;
/// use tokio_purgatory::{Completion, Operation, Purgatory};
///
/// /// A fetch that waits for the log to reach `min_offset`.
/// struct DelayedFetch { log_end: Arc<AtomicU64>, min_offset: u64 }
///
/// impl Operation for DelayedFetch {
///     type Output = u64;
///     fn try_complete(&mut self) -> Option<u64> {
///         let end = self.log_end.load(Ordering::Acquire);
///         (end >= self.min_offset).then_some(end)
///     }
///     fn on_expiration(self) -> u64 {
///         self.log_end.load(Ordering::Acquire)
///     }
/// }
///
/// let purgatory: Purgatory<&str, DelayedFetch> = Purgatory::builder().name("fetch").build().unwrap();
/// let log_end = Arc::new(AtomicU64::new(0));
/// let op = DelayedFetch { log_end: log_end.clone(), min_offset: 10 };
/// let handle = purgatory
///     .try_complete_else_watch(op, Duration::from_millis(500), ["topic-0"])
///     .unwrap();
///
/// log_end.store(12, Ordering::Release); // the producer appended
/// assert_eq!(purgatory.try_complete_watched(&"topic-0"), 1);
/// assert_eq!(handle.await.unwrap(), Completion::Completed(12));
/// # }
/// ```
pub struct Purgatory<K: WatchKey, O: Operation, S = RandomState> {
    owner: Arc<Owner<K, O>>,
    /// The hasher's type; the hasher itself is in the watcher map.
    hasher: PhantomData<fn() -> S>,
}

impl<K: WatchKey, O: Operation, S> Clone for Purgatory<K, O, S> {
    fn clone(&self) -> Self {
        Purgatory {
            owner: self.owner.clone(),
            hasher: PhantomData,
        }
    }
}

/// A handle to a [`Purgatory`] that does not keep it alive (as `std::sync::Weak`
/// and tokio's `WeakSender`): for operations that call back into their own
/// purgatory, which would otherwise hold a strong clone from inside it, a cycle
/// that keeps everything alive. Made by [`Purgatory::downgrade`].
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
/// let p: Purgatory<u32, Op> = Purgatory::builder().name("demo").build().unwrap();
/// let weak = p.downgrade();
/// assert!(weak.upgrade().is_some());
/// drop(p); // the last strong handle: the purgatory shuts down
/// assert!(weak.upgrade().is_none());
/// # }
/// ```
pub struct WeakPurgatory<K: WatchKey, O: Operation, S = RandomState> {
    owner: std::sync::Weak<Owner<K, O>>,
    hasher: PhantomData<fn() -> S>,
}

impl<K: WatchKey, O: Operation, S> WeakPurgatory<K, O, S> {
    /// The purgatory, if a [`Purgatory`] handle still keeps it alive.
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
    /// let p: tokio_purgatory::Purgatory<u32, Op> = tokio_purgatory::Purgatory::new();
    /// let weak = p.downgrade();
    /// assert!(weak.upgrade().is_some());
    /// drop(p);
    /// assert!(weak.upgrade().is_none());
    /// # }
    /// ```
    pub fn upgrade(&self) -> Option<Purgatory<K, O, S>> {
        self.owner.upgrade().map(|owner| Purgatory {
            owner,
            hasher: PhantomData,
        })
    }
}

impl<K: WatchKey, O: Operation, S> Clone for WeakPurgatory<K, O, S> {
    fn clone(&self) -> Self {
        WeakPurgatory {
            owner: self.owner.clone(),
            hasher: PhantomData,
        }
    }
}

impl<K: WatchKey, O: Operation, S> std::fmt::Debug for WeakPurgatory<K, O, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WeakPurgatory").finish_non_exhaustive()
    }
}

impl<K: WatchKey, O: Operation, S> std::fmt::Debug for Purgatory<K, O, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Purgatory")
            .field("name", &self.shared().name())
            .field("delayed", &self.delayed())
            .field("watched", &self.watched())
            .finish()
    }
}

impl<K: WatchKey, O: Operation> Purgatory<K, O> {
    /// A purgatory with default settings, its reaper spawned on the current
    /// runtime (as `Timer::new`).
    ///
    /// # Panics
    ///
    /// Outside a Tokio runtime; use [`Purgatory::builder`] and `build_on` there.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// # struct Join;
    /// # impl tokio_purgatory::Operation for Join {
    /// #     type Output = ();
    /// #     fn try_complete(&mut self) -> Option<()> { None }
    /// #     fn on_expiration(self) {}
    /// # }
    /// use tokio_purgatory::Purgatory;
    ///
    /// let joins: Purgatory<String, Join> = Purgatory::new();
    /// assert_eq!(joins.delayed(), 0);
    /// # }
    /// ```
    #[track_caller]
    #[allow(clippy::new_without_default)] // `Default` would hide the runtime it needs
    pub fn new() -> Purgatory<K, O> {
        Purgatory::builder()
            .build()
            .expect("Purgatory::new must be called within a Tokio runtime")
    }

    /// A builder with default settings (as `Timer::builder`).
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// # struct Join;
    /// # impl tokio_purgatory::Operation for Join {
    /// #     type Output = ();
    /// #     fn try_complete(&mut self) -> Option<()> { None }
    /// #     fn on_expiration(self) {}
    /// # }
    /// use tokio_purgatory::Purgatory;
    ///
    /// let joins: Purgatory<String, Join> = Purgatory::builder().name("join").build().unwrap();
    /// assert!(!joins.is_shutdown());
    /// # }
    /// ```
    pub fn builder() -> PurgatoryBuilder<K, O> {
        PurgatoryBuilder {
            name: "purgatory".into(),
            wheel: Settings::default(),
            reaper: None,
            watcher_shards: 64,
            purge_interval: 1000,
            max_pending: None,
            hasher: RandomState::new(),
            _types: PhantomData,
        }
    }
}

impl<K: WatchKey, O: Operation, S: BuildHasher + Send + Sync + 'static> Purgatory<K, O, S> {
    /// A purgatory with default settings that hashes keys with `hasher` (as
    /// `HashMap::with_hasher`), its reaper spawned on the current runtime.
    /// [`PurgatoryBuilder::hasher`] sets it along with other settings.
    ///
    /// # Panics
    ///
    /// Outside a Tokio runtime.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// # struct Join;
    /// # impl tokio_purgatory::Operation for Join {
    /// #     type Output = ();
    /// #     fn try_complete(&mut self) -> Option<()> { None }
    /// #     fn on_expiration(self) {}
    /// # }
    /// use std::hash::{BuildHasherDefault, DefaultHasher};
    /// use tokio_purgatory::Purgatory;
    ///
    /// // A fixed-seed hasher (any `BuildHasher`: ahash, fxhash, ...).
    /// type Fixed = BuildHasherDefault<DefaultHasher>;
    /// let joins: Purgatory<String, Join, Fixed> = Purgatory::with_hasher(Fixed::default());
    /// assert_eq!(joins.delayed(), 0);
    /// # }
    /// ```
    #[track_caller]
    pub fn with_hasher(hasher: S) -> Purgatory<K, O, S> {
        Purgatory::builder()
            .hasher(hasher)
            .build()
            .expect("Purgatory::with_hasher must be called within a Tokio runtime")
    }
}

impl<K: WatchKey, O: Operation, S> Purgatory<K, O, S> {
    /// A handle that does not keep the purgatory alive (see [`WeakPurgatory`]).
    /// Dropping the last `Purgatory` shuts it down even while weak handles exist.
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
    /// let p: Purgatory<u32, Op> = Purgatory::new();
    /// let weak = p.downgrade();
    /// assert!(weak.upgrade().is_some());
    /// drop(p);
    /// assert!(weak.upgrade().is_none(), "the last clone is gone");
    /// # }
    /// ```
    pub fn downgrade(&self) -> WeakPurgatory<K, O, S> {
        WeakPurgatory {
            owner: Arc::downgrade(&self.owner),
            hasher: PhantomData,
        }
    }

    fn from_shared(shared: Arc<Shared<K, O>>) -> Self {
        Purgatory {
            owner: Arc::new(Owner { shared }),
            hasher: PhantomData,
        }
    }

    fn shared(&self) -> &Arc<Shared<K, O>> {
        &self.owner.shared
    }

    /// Checks `op` once; if it cannot complete, watches it under every key in
    /// `keys`, checks it again (so an event that arrived during registration is
    /// not missed), and starts its timeout. Returns the handle to await.
    ///
    /// Duplicate keys are watched once. A timeout too large for `Instant`
    /// saturates to about 30 years. A zero timeout expires on the reaper's next
    /// turn.
    ///
    /// # Errors
    ///
    /// Hands `op` back, unchecked or checked but not completed, when `keys` is
    /// empty, the purgatory is at its pending limit, shut down, or has lost its
    /// reaper.
    ///
    /// # Panics
    ///
    /// When a key's `Hash`, `Eq` or `Clone` panics, that panic propagates from
    /// this call, and the operation is dropped unregistered: no handle, no
    /// timeout, no counter changed (`registered` does not count it), and any
    /// watch entries already made are tombstones that later walks remove. A panic
    /// in the operation's own code is contained (see [`Purgatory`]).
    ///
    /// # Concurrent calls
    ///
    /// A [`shutdown`](Purgatory::shutdown) racing this call either takes the
    /// operation (the handle resolves to [`OperationError::Shutdown`]) or this
    /// call fails with [`WatchError::Shutdown`]: the operation is never lost. An
    /// event on one of the keys while this call runs is acted on by this call
    /// before it returns (its second check runs after every watch is in
    /// place). A [`cancel_for_key`](Purgatory::cancel_for_key) of one of the
    /// keys while this call runs comes either before the operation watches
    /// that key, and finds nothing of it to cancel (as if it came before this
    /// call: the operation goes on registering), or after, and is then carried
    /// out by this call before it returns (the handle resolves to
    /// [`OperationError::Cancelled`]), unless this call's second check
    /// completes the operation first (as for any cancel left to a running
    /// check). The code of a key (its `Clone`, run
    /// when the key is first watched) that cancels by that same key is of the
    /// first kind.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// use std::time::Duration;
    /// use tokio_purgatory::{Completion, Operation, Purgatory};
    ///
    /// struct Never;
    /// impl Operation for Never {
    ///     type Output = &'static str;
    ///     fn try_complete(&mut self) -> Option<&'static str> { None }
    ///     fn on_expiration(self) -> &'static str { "timed out" }
    /// }
    ///
    /// let p: Purgatory<u32, Never> = Purgatory::builder().name("demo").build().unwrap();
    /// let handle = p.try_complete_else_watch(Never, Duration::from_millis(5), [1, 2]).unwrap();
    /// assert_eq!(handle.await, Ok(Completion::Expired("timed out")));
    ///
    /// // No keys: the operation comes back.
    /// let refused = p.try_complete_else_watch(Never, Duration::from_millis(5), []);
    /// assert!(matches!(refused.unwrap_err().into_inner(), Never));
    /// # }
    /// ```
    pub fn try_complete_else_watch<I>(
        &self,
        op: O,
        timeout: Duration,
        keys: I,
    ) -> Result<OperationHandle<K, O>, WatchError<O>>
    where
        I: IntoIterator<Item = K>,
    {
        let now = Instant::now();
        self.register(
            op,
            now,
            deadline_after(now, timeout),
            |k| Watches::plain(k, |k| self.shared().hash_key(k)),
            keys,
        )
    }

    /// As [`try_complete_else_watch`](Purgatory::try_complete_else_watch), with the
    /// timeout given as an instant (tokio's `timeout_at`, `DelayQueue::insert_at`).
    /// A deadline already reached expires on the reaper's next turn, unless the
    /// checks at registration complete the operation.
    ///
    /// # Errors
    ///
    /// As [`try_complete_else_watch`](Purgatory::try_complete_else_watch).
    ///
    /// # Panics
    ///
    /// As [`try_complete_else_watch`](Purgatory::try_complete_else_watch).
    ///
    /// # Concurrent calls
    ///
    /// As [`try_complete_else_watch`](Purgatory::try_complete_else_watch): a
    /// racing shutdown either takes the operation or refuses it (handed back),
    /// and an event or cancellation by key during the call is acted on.
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
    /// use tokio_purgatory::{Completion, Operation, Purgatory};
    ///
    /// struct Fetch;
    /// impl Operation for Fetch {
    ///     type Output = &'static str;
    ///     fn try_complete(&mut self) -> Option<&'static str> { None }
    ///     fn on_expiration(self) -> &'static str { "empty" }
    /// }
    ///
    /// let p: Purgatory<u32, Fetch> = Purgatory::builder().name("fetch").build().unwrap();
    /// // The request arrived a while ago; its `max_wait` counts from then.
    /// let arrived = Instant::now();
    /// tokio::time::sleep(Duration::from_millis(30)).await;
    /// let handle = p
    ///     .try_complete_else_watch_at(Fetch, arrived + Duration::from_millis(100), [0])
    ///     .unwrap();
    /// assert_eq!(handle.await, Ok(Completion::Expired("empty")));
    /// assert_eq!(arrived.elapsed(), Duration::from_millis(100));
    /// # }
    /// ```
    pub fn try_complete_else_watch_at<I, D>(
        &self,
        op: O,
        deadline: D,
        keys: I,
    ) -> Result<OperationHandle<K, O>, WatchError<O>>
    where
        I: IntoIterator<Item = K>,
        D: Into<Instant>,
    {
        let deadline = deadline.into();
        self.register(
            op,
            Instant::now(),
            deadline,
            |k| Watches::plain(k, |k| self.shared().hash_key(k)),
            keys,
        )
    }

    /// As [`try_complete_else_watch`](Purgatory::try_complete_else_watch), with
    /// some keys watched **at a level** ([`Watch::level`]): a `u64` the key's
    /// number must reach (an offset, a high watermark, a log end in bytes)
    /// before the operation is checked for it. Plain watches ([`Watch::key`],
    /// or a key converted with `.into()`) may be mixed in, on the same keys or
    /// others.
    ///
    /// A watch at a level is served by
    /// [`try_complete_reached`](Purgatory::try_complete_reached): the key's
    /// watchers at a level are kept ordered by level, and an advance takes out
    /// exactly those at or below the new level, in O(k log n) for k of them
    /// among n, without looking at the others. This is the produce with
    /// `acks=all` waiting for the high watermark to cover its last offset: each
    /// advance checks the produces it satisfies, not every one in flight.
    ///
    /// As for plain watches, the operation is checked before it watches and
    /// again after, so an event between the two is not missed: one registered at
    /// level 100 on a key already at 120 completes here if its check says so.
    /// Plain duplicate keys are watched once; a key given at several levels is
    /// watched at each, and an advance past several of them checks the
    /// operation once for each (the first check that completes it ends the
    /// others). Give each key once, at the lowest level that matters.
    ///
    /// # Errors
    ///
    /// As [`try_complete_else_watch`](Purgatory::try_complete_else_watch)
    /// ([`WatchError::NoKeys`] when `watches` is empty).
    ///
    /// # Panics
    ///
    /// As [`try_complete_else_watch`](Purgatory::try_complete_else_watch).
    ///
    /// # Concurrent calls
    ///
    /// As [`try_complete_else_watch`](Purgatory::try_complete_else_watch): a
    /// racing shutdown either takes the operation or refuses it (handed back),
    /// and an event or cancellation by key during the call is acted on.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// use std::sync::atomic::{AtomicU64, Ordering};
    /// use std::sync::Arc;
    /// use std::time::Duration;
    /// use tokio_purgatory::{Completion, Operation, Purgatory, Watch};
    ///
    /// /// A produce with `acks=all`: done once the high watermark passes `last`.
    /// struct Produce { hw: Arc<AtomicU64>, last: u64 }
    /// impl Operation for Produce {
    ///     type Output = &'static str;
    ///     // Registration's checks: the high watermark may have passed `last`
    ///     // before the watch was in place, so read where it is stored.
    ///     fn try_complete(&mut self) -> Option<&'static str> {
    ///         self.try_complete_reached(self.hw.load(Ordering::Acquire))
    ///     }
    ///     // An advance's checks: told the new high watermark.
    ///     fn try_complete_reached(&mut self, hw: u64) -> Option<&'static str> {
    ///         (hw > self.last).then_some("ok")
    ///     }
    ///     fn on_expiration(self) -> &'static str { "REQUEST_TIMED_OUT" }
    /// }
    ///
    /// let produces: Purgatory<&str, Produce> = Purgatory::new();
    /// let hw = Arc::new(AtomicU64::new(0));
    /// let mut handles = Vec::new();
    /// for last in [9, 19, 29] {
    ///     // Checked once the high watermark passes `last` (reaches `last + 1`).
    ///     let watch = [Watch::above("orders-0", last)];
    ///     let op = Produce { hw: hw.clone(), last };
    ///     handles.push(produces.try_complete_else_watch_levels(op, Duration::from_secs(30), watch).unwrap());
    /// }
    /// // A follower caught up to offset 20: store it, then advance.
    /// hw.store(20, Ordering::Release);
    /// assert_eq!(produces.try_complete_reached("orders-0", 20), 2);
    /// assert_eq!(produces.delayed(), 1);
    /// # for h in handles.drain(..2) { assert_eq!(h.await, Ok(Completion::Completed("ok"))); }
    /// # }
    /// ```
    pub fn try_complete_else_watch_levels<I>(
        &self,
        op: O,
        timeout: Duration,
        watches: I,
    ) -> Result<OperationHandle<K, O>, WatchError<O>>
    where
        I: IntoIterator<Item = Watch<K>>,
    {
        let now = Instant::now();
        self.register(
            op,
            now,
            deadline_after(now, timeout),
            |w| Watches::mixed(w, |k| self.shared().hash_key(k)),
            watches,
        )
    }

    /// As [`try_complete_else_watch_levels`](Purgatory::try_complete_else_watch_levels),
    /// with the timeout given as an instant.
    ///
    /// # Errors
    ///
    /// As [`try_complete_else_watch`](Purgatory::try_complete_else_watch).
    ///
    /// # Panics
    ///
    /// As [`try_complete_else_watch`](Purgatory::try_complete_else_watch).
    ///
    /// # Concurrent calls
    ///
    /// As [`try_complete_else_watch`](Purgatory::try_complete_else_watch): a
    /// racing shutdown either takes the operation or refuses it (handed back),
    /// and an event or cancellation by key during the call is acted on.
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
    /// use tokio_purgatory::{Completion, Operation, Purgatory, Watch};
    ///
    /// struct Replica;
    /// impl Operation for Replica {
    ///     type Output = bool;
    ///     fn try_complete(&mut self) -> Option<bool> { None }
    ///     fn on_expiration(self) -> bool { false }
    /// }
    ///
    /// let p: Purgatory<u32, Replica> = Purgatory::new();
    /// let deadline = Instant::now() + Duration::from_millis(500);
    /// let h = p.try_complete_else_watch_levels_at(Replica, deadline, [Watch::level(0, 42)]).unwrap();
    /// assert_eq!(h.await, Ok(Completion::Expired(false)));
    /// # }
    /// ```
    pub fn try_complete_else_watch_levels_at<I, D>(
        &self,
        op: O,
        deadline: D,
        watches: I,
    ) -> Result<OperationHandle<K, O>, WatchError<O>>
    where
        I: IntoIterator<Item = Watch<K>>,
        D: Into<Instant>,
    {
        let deadline = deadline.into();
        self.register(
            op,
            Instant::now(),
            deadline,
            |w| Watches::mixed(w, |k| self.shared().hash_key(k)),
            watches,
        )
    }

    /// Registers `op` on `watches`, made from `given` by `make` (which runs key
    /// code: `Hash`, once for each key, and `Eq`).
    fn register<I>(
        &self,
        mut op: O,
        now: Instant,
        deadline: Instant,
        make: impl FnOnce(I) -> Taken<K>,
        given: I,
    ) -> Result<OperationHandle<K, O>, WatchError<O>> {
        let shared = self.shared();
        // Key code may panic: nothing is counted or registered until it has
        // run, and on a panic the keys are dropped (contained) before it goes
        // on, never while it unwinds.
        // (Each key's hash is taken marked as key code, see `hash_key`; the
        // caller's own iterator is the caller's code.)
        let keys = match catch_unwind(AssertUnwindSafe(|| make(given))) {
            Ok(Ok((keys, dups))) => {
                shared.drop_keys(dups);
                keys
            }
            Ok(Err(KeyPanic { panic, keys })) => {
                shared.drop_contained("drop of an operation", op);
                shared.drop_keys(keys);
                resume_unwind(panic);
            }
            Err(panic) => {
                // The caller's own iterator panicked.
                shared.drop_contained("drop of an operation", op);
                resume_unwind(panic);
            }
        };
        if let Err(refusal) = shared.admit(&keys) {
            shared.drop_keys(keys);
            let refused = refusal.with(op);
            shared.count_refusal(refused.kind());
            return Err(refused);
        }
        crate::contain::quietly(|| {
            tracing::trace!(
                kind = "purgatory",
                name = shared.name(),
                keys = keys.len(),
                "register"
            );
        });

        // Check (Kafka's `tryComplete`): done at once, nothing is watched.
        if let Some(output) = shared.first_check(&mut op) {
            // As a completion by a later check: the room first, the count
            // once the operation's drop has run.
            shared.free_room();
            shared.drop_contained("drop of an operation", op);
            shared.on_finished(Fate::Completed, 0);
            shared.drop_keys(keys);
            return Ok(OperationHandle::ready(
                Completion::Completed(output),
                shared.clone(),
            ));
        }

        // Watch. The cell starts owned by this thread's check: until the
        // second check, events only ask for it, and nothing can finish it.
        let me = thread_index();
        let Some(id) = shared.insert(keys.len() as u32, me) else {
            // As many operations pending as the slab holds.
            shared.refuse_admitted();
            shared.drop_keys(keys);
            shared.count_refusal(WatchErrorKind::AtCapacity);
            return Err(WatchError::AtCapacity(op));
        };
        // The registration's reference to the cell, let go on every way
        // out (a key that panics during the watch included), or handed to
        // the handle.
        let cell = CellRef::new(shared.clone(), id);
        if let Err(panic) = shared.watch(id, &keys) {
            shared.drop_contained("drop of an operation", op);
            shared.drop_keys(keys);
            resume_unwind(panic);
        }

        // Check again (an event during the watch is not lost), put an
        // operation still pending in its cell, and arm its timeout.
        let settled = shared.settle(id, op, me, now, deadline);
        shared.drop_keys(keys);
        match settled {
            Ok(completed) => {
                if shared.is_closed() {
                    // Finished (completed or expired) though a shutdown
                    // emptied the lists during the watch: its entries go as
                    // below, or they would stay in a purgatory nothing purges.
                    shared.tidy();
                } else {
                    shared.maybe_purge();
                }
                if completed {
                    // Completed by the second check, so during registration
                    // as by the first: a ready handle, with no reference to
                    // hand out (nothing is left to check). The output is in
                    // the cell already, delivered by that check.
                    match cell.op().poll_outcome(std::task::Waker::noop()) {
                        Some(Ok(c)) => return Ok(OperationHandle::ready(c, shared.clone())),
                        Some(Err(_)) => unreachable!("a completion delivers its output"),
                        None => {}
                    }
                }
                Ok(OperationHandle::waiting(cell))
            }
            Err((op, why)) => {
                cell.op().detach();
                drop(cell);
                // A shutdown emptied the lists before this watch added to
                // them: its entries, tombstones now, go as any cancelled
                // operation's do (the map holds nothing else once closed).
                shared.tidy();
                Err(closed_refusal(op, why))
            }
        }
    }

    /// `key` reached `level` (a high watermark advanced, a log grew): checks the
    /// operations watching `key` at a level at most `level`, and those watching
    /// it without a level (as [`try_complete_watched`](Purgatory::try_complete_watched)
    /// does), and completes those that can be. Returns how many this call
    /// completed. Operations watching `key` above `level` are not looked at:
    /// the cost is O(k log n) for the k at or below `level` among the n
    /// watching the key at a level, plus the plain watchers.
    ///
    /// Each check this call runs is told `level`
    /// ([`Operation::try_complete_reached`]), so it need not read where the
    /// level is stored. Registration's checks are told nothing, and they
    /// must see a level reached before the watch was in place: store the
    /// level where `try_complete` reads it, then call this, as for
    /// `try_complete_watched`.
    ///
    /// **A check that says "not yet"** after the key reached its level (an
    /// operation that also waits for another partition, a fetch whose
    /// `min_bytes` the new data does not fill yet) leaves the operation
    /// watching `key` one level above `level`: it is checked again by the next
    /// call whose level is higher than this one, and not by calls that do not
    /// move the key past `level`; its other watches and its timeout are
    /// unchanged. Such operations are re-checked once per advance (once per
    /// watch the advance reaches, for one watching the key at several levels,
    /// or at a level and plainly) until they complete, time out or are
    /// cancelled; the others are never touched. The watch moves up when an
    /// advance takes the operation out, before its check runs: another call
    /// for the same key at that level or lower that comes while the check
    /// runs does not reach that watch and asks for no re-run through it (the
    /// key has moved no further than the check already knows; a plain watch
    /// of the same key, if the operation has one, is reached as every call
    /// reaches plain watchers), while one past it asks for a re-run as any
    /// event does. Signal a change other than the key's
    /// level through a plain watch
    /// ([`try_complete_watched`](Purgatory::try_complete_watched)) or another
    /// key.
    ///
    /// **A level lower than before** (a leader change truncating the log)
    /// checks what watches the key at or below it, and the plain watchers, as
    /// any call does; operations waiting above it keep waiting until the key
    /// comes back up to their level. The purgatory keeps no level per key: each
    /// call says where the key stands, and checks are what decide completion.
    ///
    /// Which thread runs the checks, and what a check may do, are as for
    /// [`try_complete_watched`](Purgatory::try_complete_watched). A check that
    /// itself advances its own key (from inside its `try_complete`) is not
    /// re-run by that advance, which would loop forever for a check that
    /// always advances; the advance still moves the operation's watch past
    /// its level. Such a check should decide from the state it just changed.
    ///
    /// # Panics
    ///
    /// When the key's `Hash` or `Eq`, or the hasher, panics (nothing is
    /// changed then).
    ///
    /// # Concurrent calls
    ///
    /// As for [`try_complete_watched`](Purgatory::try_complete_watched): the
    /// entries the level reaches are taken under the list's lock and checked
    /// with it released, and an operation already being checked elsewhere is
    /// asked to check again, handed this call's level (see
    /// [`Operation::try_complete_reached`]). Advances of the same or other
    /// keys may run at once on any number of threads. Once a
    /// [`shutdown`](Purgatory::shutdown) has begun (from the moment
    /// [`is_shutdown`](Purgatory::is_shutdown) reads `true`; a lost reaper
    /// shuts it down too) this finds nothing and returns 0: the shutdown
    /// finishes what is still watched.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// use std::sync::atomic::{AtomicU64, Ordering};
    /// use std::sync::Arc;
    /// use std::time::Duration;
    /// use tokio_purgatory::{Operation, Purgatory, Watch};
    ///
    /// struct UpTo(Arc<AtomicU64>, u64);
    /// impl Operation for UpTo {
    ///     type Output = ();
    ///     fn try_complete(&mut self) -> Option<()> {
    ///         (self.0.load(Ordering::Acquire) >= self.1).then_some(())
    ///     }
    ///     fn on_expiration(self) {}
    /// }
    ///
    /// let p: Purgatory<u32, UpTo> = Purgatory::new();
    /// let hw = Arc::new(AtomicU64::new(0));
    /// for level in 1..=1000 {
    ///     p.try_complete_else_watch_levels(UpTo(hw.clone(), level), Duration::from_secs(5), [Watch::level(7, level)])
    ///         .unwrap()
    ///         .detach();
    /// }
    /// hw.store(3, Ordering::Release);
    /// assert_eq!(p.try_complete_reached(&7, 3), 3, "three checks, not a thousand");
    /// assert_eq!(p.delayed(), 997);
    /// # }
    /// ```
    pub fn try_complete_reached<Q>(&self, key: &Q, level: u64) -> usize
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.shared().walk(key, Some(level))
    }

    /// Checks the operations watching `key` and completes those that can be (Kafka's
    /// `checkAndComplete`). Returns how many this call completed. `key` may be any
    /// borrowed form of the key type (`&str` for `String` keys), as for
    /// `HashMap::get`. Also removes the
    /// tombstones it finds among the key's plain watchers, and the key itself
    /// when nothing is left under it (tombstones of watches at a level stay
    /// until an advance reaches their level, or the purge takes them).
    /// Operations this call completes are removed at once when they are at
    /// least a quarter of the list; otherwise they stay as tombstones until the
    /// key's next walk (or the amortised purge).
    ///
    /// # Panics
    ///
    /// When `key`'s `Hash` or `Eq` panics while its list is looked up, before
    /// anything was checked; the purgatory is unchanged. Once the checks have run,
    /// a panic in key code while compacting the list is contained. Panics in
    /// operation code are contained (see [`Purgatory`]).
    ///
    /// # Concurrent calls
    ///
    /// The key's list is copied under its lock and the checks run after the lock
    /// is released. An operation already being checked elsewhere is asked to check
    /// again instead (it is then not counted here). Calls for the same or other
    /// keys may run at once on any number of threads. Once a
    /// [`shutdown`](Purgatory::shutdown) has begun (from the moment
    /// [`is_shutdown`](Purgatory::is_shutdown) reads `true`; a lost reaper
    /// shuts it down too) this finds nothing and returns 0: the shutdown
    /// finishes what is still watched.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// use std::sync::atomic::{AtomicBool, Ordering};
    /// use std::sync::Arc;
    /// use std::time::Duration;
    /// use tokio_purgatory::{Operation, Purgatory};
    ///
    /// struct Flag(Arc<AtomicBool>);
    /// impl Operation for Flag {
    ///     type Output = ();
    ///     fn try_complete(&mut self) -> Option<()> { self.0.load(Ordering::SeqCst).then_some(()) }
    ///     fn on_expiration(self) {}
    /// }
    ///
    /// let p: Purgatory<&str, Flag> = Purgatory::builder().name("demo").build().unwrap();
    /// let flag = Arc::new(AtomicBool::new(false));
    /// let handle = p.try_complete_else_watch(Flag(flag.clone()), Duration::from_secs(1), ["a"]).unwrap();
    /// assert_eq!(p.try_complete_watched(&"a"), 0, "not yet");
    /// flag.store(true, Ordering::SeqCst);
    /// assert_eq!(p.try_complete_watched(&"a"), 1);
    /// assert!(handle.await.unwrap().is_completed());
    /// # }
    /// ```
    pub fn try_complete_watched<Q>(&self, key: &Q) -> usize
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.shared().walk(key, None)
    }

    /// Removes every operation watching `key` from the purgatory without completing
    /// it (Kafka's `cancelForKey`), and returns them. Their handles resolve to
    /// [`OperationError::Cancelled`]; their timeouts are cancelled; their entries
    /// under other keys become tombstones.
    ///
    /// An unknown key returns an empty list. `key` may be any borrowed form of the
    /// key type, as for `HashMap::remove`.
    ///
    /// With keys that one operation at most watches (a session per member),
    /// `cancel_for_key(&key).pop()` is the single-key form: the list holds at
    /// most one and allocates only when it does. To cancel one operation you
    /// hold a handle or an [`OpRef`] for, [`OpRef::cancel`] touches no list.
    ///
    /// # Panics
    ///
    /// When `key`'s `Hash` or `Eq` panics while its list is looked up; nothing was
    /// cancelled then. Drops the purgatory performs here are contained.
    ///
    /// # Concurrent calls
    ///
    /// An operation being checked at this very moment is not returned: if that
    /// check completes it, it completes; otherwise the checker cancels it right
    /// after (its handle resolves to `Cancelled`, and the operation is dropped).
    /// An operation still registering is cancelled the same way by its
    /// registration, once it watches `key` (a cancel that comes before finds
    /// nothing of it). Once a [`shutdown`](Purgatory::shutdown) has begun
    /// (from the moment [`is_shutdown`](Purgatory::is_shutdown) reads `true`;
    /// a lost reaper shuts it down too) this finds nothing and returns an
    /// empty list.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// use std::time::Duration;
    /// use tokio_purgatory::{Operation, OperationError, Purgatory};
    ///
    /// struct Heartbeat(u32);
    /// impl Operation for Heartbeat {
    ///     type Output = ();
    ///     fn try_complete(&mut self) -> Option<()> { None }
    ///     fn on_expiration(self) {}
    /// }
    ///
    /// let p: Purgatory<&str, Heartbeat> = Purgatory::builder().name("heartbeat").build().unwrap();
    /// let handle = p.try_complete_else_watch(Heartbeat(7), Duration::from_secs(10), ["group-a"]).unwrap();
    /// let back = p.cancel_for_key(&"group-a");
    /// assert_eq!(back.len(), 1);
    /// assert_eq!(back[0].0, 7);
    /// assert_eq!(handle.await, Err(OperationError::Cancelled));
    /// # }
    /// ```
    #[must_use = "the cancelled operations are handed back; drop them explicitly if unwanted"]
    pub fn cancel_for_key<Q>(&self, key: &Q) -> Vec<O>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.shared().cancel_for_key(key)
    }

    /// Number of watch-list entries, tombstones included (Kafka's `watched`).
    /// Sums the watcher map's shards: O(shards), and exact when no call races it.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// # struct Op;
    /// # impl tokio_purgatory::Operation for Op {
    /// #     type Output = ();
    /// #     fn try_complete(&mut self) -> Option<()> { None }
    /// #     fn on_expiration(self) {}
    /// # }
    /// use std::time::Duration;
    /// use tokio_purgatory::Purgatory;
    ///
    /// let p: Purgatory<u32, Op> = Purgatory::builder().name("demo").build().unwrap();
    /// let h = p.try_complete_else_watch(Op, Duration::from_secs(1), [1, 2, 3]).unwrap();
    /// assert_eq!(p.watched(), 3);
    /// # drop(h);
    /// # }
    /// ```
    pub fn watched(&self) -> usize {
        self.shared().watched()
    }

    /// Number of operations registered and not finished (Kafka's `numDelayed`). O(1).
    /// An expired or completed operation counts until its finish is done,
    /// the code that finish runs included (its `on_expiration`; the drop of
    /// a completed operation); a cancelled one is counted out as it is
    /// cancelled, and may be dropped (or handed back to whoever cancelled
    /// it) after. Its room under [`max_pending`](PurgatoryBuilder::max_pending)
    /// is free from the moment its fate is decided, whichever way it ends.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// # struct Op;
    /// # impl tokio_purgatory::Operation for Op {
    /// #     type Output = ();
    /// #     fn try_complete(&mut self) -> Option<()> { None }
    /// #     fn on_expiration(self) {}
    /// # }
    /// use std::time::Duration;
    /// use tokio_purgatory::Purgatory;
    ///
    /// let p: Purgatory<u32, Op> = Purgatory::builder().name("demo").build().unwrap();
    /// let h = p.try_complete_else_watch(Op, Duration::from_secs(1), [1]).unwrap();
    /// assert_eq!(p.delayed(), 1);
    /// drop(h); // cancels it
    /// assert_eq!(p.delayed(), 0);
    /// # }
    /// ```
    pub fn delayed(&self) -> usize {
        self.shared().delayed()
    }

    /// Counters since the purgatory was built.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// # struct Op;
    /// # impl tokio_purgatory::Operation for Op {
    /// #     type Output = ();
    /// #     fn try_complete(&mut self) -> Option<()> { Some(()) }
    /// #     fn on_expiration(self) {}
    /// # }
    /// use std::time::Duration;
    /// use tokio_purgatory::Purgatory;
    ///
    /// let p: Purgatory<u32, Op> = Purgatory::builder().name("demo").build().unwrap();
    /// p.try_complete_else_watch(Op, Duration::from_secs(1), [1]).unwrap().await.unwrap();
    /// let m = p.metrics();
    /// assert_eq!((m.registered, m.completed, m.delayed), (1, 1, 0));
    /// # }
    /// ```
    pub fn metrics(&self) -> PurgatoryMetrics {
        self.shared().metrics()
    }

    /// How late this purgatory's timeouts fired: for each expiry, the time
    /// from its deadline (rounded up to the tick, as the wheel holds it) to
    /// the reaper turn that took it out. Its tail says whether the reaper
    /// keeps up. A deadline already reached at registration (zero, or past)
    /// counts from the start of the tick it was registered in: it reads late
    /// by up to one tick, however far past it was.
    ///
    /// Recorded once per expiry, never on the registration path: by the
    /// reaper, or, for an expiry the reaper's turn left to a check running
    /// at that moment on another thread, by that check when it carries the
    /// expiry out (as the turn measured it; not at all if the check
    /// completes the operation instead).
    ///
    /// A snapshot (about 2.5 KiB): take it when you export, not per request.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// # struct Op;
    /// # impl tokio_purgatory::Operation for Op {
    /// #     type Output = ();
    /// #     fn try_complete(&mut self) -> Option<()> { None }
    /// #     fn on_expiration(self) {}
    /// # }
    /// use std::time::Duration;
    /// use tokio_purgatory::Purgatory;
    ///
    /// let p: Purgatory<u32, Op> = Purgatory::new();
    /// let h = p.try_complete_else_watch(Op, Duration::from_millis(10), [1]).unwrap();
    /// h.await.unwrap();
    /// let late = p.lateness();
    /// assert_eq!(late.count(), 1);
    /// println!("p99 {:?}, max {:?}", late.quantile(0.99), late.max());
    /// # }
    /// ```
    pub fn lateness(&self) -> Histogram {
        self.shared().lateness()
    }

    /// Reports this purgatory's counters and gauges through the `metrics`
    /// facade, to the recorder installed now. Call it where the exporter
    /// collects (a scrape handler, or a task every few seconds): counters are
    /// set to their totals, so calling it often costs nothing in accuracy.
    /// Lateness needs no call: it is recorded live, one sample per expiry, by
    /// the reaper or the check that carried the expiry out (see
    /// [`lateness`](Self::lateness); into the recorder installed when the
    /// purgatory was built: install it first).
    ///
    /// Every metric has the labels `kind="purgatory"` and `name` (the
    /// builder's [`name`](PurgatoryBuilder::name)); the walk counts also have
    /// `walk` (`"key"`, `"level"` or `"reference"`).
    ///
    /// | metric | type | what |
    /// |---|---|---|
    /// | `tokio_purgatory_delayed` | gauge | operations pending (Kafka's `NumDelayedOperations`) |
    /// | `tokio_purgatory_watched` | gauge | watch-list entries, tombstones included (Kafka's `PurgatorySize`) |
    /// | `tokio_purgatory_tombstones` | gauge | entries of finished operations not yet removed |
    /// | `tokio_purgatory_keys` | gauge | keys with a watch list |
    /// | `tokio_purgatory_cells` | gauge | cells held, in use or free (each [`cell_bytes`](Self::cell_bytes)) |
    /// | `tokio_purgatory_registered_total` | counter | operations registered |
    /// | `tokio_purgatory_completed_total` | counter | completed by a check |
    /// | `tokio_purgatory_expired_total` | counter | finished by their timeout |
    /// | `tokio_purgatory_cancelled_total` | counter | cancelled |
    /// | `tokio_purgatory_handed_back_total` | counter | handed back at shutdown |
    /// | `tokio_purgatory_purged_total` | counter | tombstones removed by the purge |
    /// | `tokio_purgatory_panicked_total` | counter | panics caught in user code |
    /// | `tokio_purgatory_refused_total` | counter | registrations refused, per `reason` (`at_capacity`, `shutdown`, `reaper_gone`, `draining`, `no_keys`) |
    /// | `tokio_purgatory_walks_total` | counter | walks, per `walk` |
    /// | `tokio_purgatory_checks_total` | counter | checks asked for, per `walk` |
    /// | `tokio_purgatory_checks_completed_total` | counter | checks that completed, per `walk` |
    /// | `tokio_purgatory_reaper_wakeups_total` | counter | reaper wake-ups |
    /// | `tokio_purgatory_reaper_turns_total` | counter | reaper turns |
    /// | `tokio_purgatory_reaper_busy_seconds` | gauge | the turns' time, summed |
    /// | `tokio_purgatory_reaper_longest_turn_seconds` | gauge | the longest turn |
    /// | `tokio_purgatory_reaper_largest_batch` | gauge | the most expiries in one turn |
    /// | `tokio_purgatory_lateness_seconds` | histogram | how late each expiry fired (recorded live) |
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
    /// // The service installs its exporter's recorder first
    /// // (`metrics::set_global_recorder`); without one, this does nothing.
    /// let p: Purgatory<u32, Op> = Purgatory::builder().name("produce").build().unwrap();
    /// p.record_metrics();
    /// # }
    /// ```
    #[cfg(feature = "metrics")]
    pub fn record_metrics(&self) {
        self.shared().record_metrics();
    }

    /// The bytes an operation's cell occupies on the heap (see "Memory" on
    /// [`Purgatory`]): the purgatory keeps this many bytes for each operation it
    /// has had in cells at once, for reuse. It grows with `size_of::<O>()` and
    /// `size_of::<O::Output>()`.
    ///
    /// # Examples
    ///
    /// ```
    /// # struct Small;
    /// # impl tokio_purgatory::Operation for Small {
    /// #     type Output = ();
    /// #     fn try_complete(&mut self) -> Option<()> { None }
    /// #     fn on_expiration(self) {}
    /// # }
    /// # struct Large(#[allow(dead_code)] [u8; 4096]);
    /// # impl tokio_purgatory::Operation for Large {
    /// #     type Output = ();
    /// #     fn try_complete(&mut self) -> Option<()> { None }
    /// #     fn on_expiration(self) {}
    /// # }
    /// use tokio_purgatory::Purgatory;
    ///
    /// let small = Purgatory::<u32, Small>::cell_bytes();
    /// let large = Purgatory::<u32, Large>::cell_bytes();
    /// assert!(large >= small + 4096);
    /// // Boxed, the large state leaves the cell and is freed at completion.
    /// # struct Boxed(#[allow(dead_code)] Box<[u8; 4096]>);
    /// # impl tokio_purgatory::Operation for Boxed {
    /// #     type Output = ();
    /// #     fn try_complete(&mut self) -> Option<()> { None }
    /// #     fn on_expiration(self) {}
    /// # }
    /// assert!(Purgatory::<u32, Boxed>::cell_bytes() <= small + 8);
    /// ```
    pub fn cell_bytes() -> usize {
        // The cell's life word, then the cell.
        slab::Slab::<OpCell<O>>::slot_bytes()
    }

    /// Hands back every pending operation, in no particular order, and stops
    /// serving this purgatory's timeouts (its reaper task ends, unless it is a
    /// shared [`Reaper`](crate::Reaper) that serves others or that a `Reaper`
    /// handle still names); their handles resolve to
    /// [`OperationError::Shutdown`]. Walks, advances and cancellations by key
    /// find nothing from then on (they return 0, or an empty list). Registration
    /// afterwards fails with [`WatchError::Shutdown`]. Returns an empty list when
    /// already shut down.
    ///
    /// # Concurrent calls
    ///
    /// An operation being checked or expired at this moment is not in the list: it
    /// finishes by that check or expiry, or, after a check that did not
    /// complete it, is dropped there (counted as cancelled) and its handle
    /// resolves to [`OperationError::Shutdown`]. Calling `shutdown` from inside an operation's code
    /// works.
    ///
    /// From the moment a shutdown begins ([`is_shutdown`](Self::is_shutdown)
    /// reads `true` from then on, on every thread), walks, advances and
    /// cancellations by key find nothing, and [`OpRef::try_complete`] and
    /// the resets of a handle or an `OpRef` return `false`, whatever thread
    /// calls them, code the shutdown itself runs included (a waker it wakes).
    /// Such a call already under way when the shutdown began may still
    /// complete, cancel or move an operation it had reached; a completed or
    /// cancelled one is then not in the list. A cancel by reference
    /// ([`OpRef::cancel`], [`OperationHandle::cancel`], a dropped handle)
    /// racing the shutdown finishes the operation if it comes first, as
    /// [`OpRef::cancel`] says.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// # struct Op;
    /// # impl tokio_purgatory::Operation for Op {
    /// #     type Output = ();
    /// #     fn try_complete(&mut self) -> Option<()> { None }
    /// #     fn on_expiration(self) {}
    /// # }
    /// use std::time::Duration;
    /// use tokio_purgatory::{OperationError, Purgatory, WatchError};
    ///
    /// let p: Purgatory<u32, Op> = Purgatory::builder().name("demo").build().unwrap();
    /// let h = p.try_complete_else_watch(Op, Duration::from_secs(1), [1]).unwrap();
    /// assert_eq!(p.shutdown().len(), 1);
    /// assert_eq!(h.await, Err(OperationError::Shutdown));
    /// let refused = p.try_complete_else_watch(Op, Duration::from_secs(1), [1]);
    /// assert!(matches!(refused, Err(WatchError::Shutdown(_))));
    /// # }
    /// ```
    #[must_use = "the pending operations are handed back; drop them explicitly if unwanted"]
    pub fn shutdown(&self) -> Vec<O> {
        self.shared().close(Fate::HandedBack)
    }

    /// Whether the purgatory was shut down: by [`shutdown`](Self::shutdown),
    /// or because its reaper task was lost. A purgatory that is
    /// [draining](Self::is_draining) refuses new operations too, but is not
    /// shut down.
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
    /// let p: Purgatory<u32, Op> = Purgatory::builder().name("demo").build().unwrap();
    /// assert!(!p.is_shutdown());
    /// drop(p.shutdown());
    /// assert!(p.is_shutdown());
    /// # }
    /// ```
    pub fn is_shutdown(&self) -> bool {
        self.shared().is_closed()
    }

    /// Stops taking operations and waits until every pending one has finished
    /// on its own (completed by an event, expired, or cancelled): how a broker
    /// or server stops without cutting requests short. From the first call on
    /// (the call itself, before the returned future is polled, and whether or
    /// not it ever is), registrations are refused and the operation handed
    /// back, in [`WatchError::Draining`] (or in the refusal checked before it,
    /// when one applies: no keys, shut down, at the pending limit), while
    /// events, expiries and cancellations go on as before.
    /// To bound the wait, race it with a timeout and call
    /// [`shutdown`](Self::shutdown) for what is left.
    ///
    /// # Cancellation and concurrency
    ///
    /// Dropping the future stops the wait only: the purgatory stays draining
    /// (there is no way back). Several tasks may drain at once; each returns once
    /// nothing is pending. A registration racing the first call is either refused
    /// or waited for. A shutdown during the drain hands the operations back, and
    /// the drain then returns. Operations that never finish (no event comes, and
    /// their timeout is far off) keep it waiting until they expire.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// use std::time::Duration;
    /// use tokio_purgatory::{Operation, Purgatory, WatchError};
    ///
    /// struct Fetch;
    /// impl Operation for Fetch {
    ///     type Output = ();
    ///     fn try_complete(&mut self) -> Option<()> { None }
    ///     fn on_expiration(self) {}
    /// }
    ///
    /// let fetches: Purgatory<u32, Fetch> = Purgatory::builder().name("fetch").build().unwrap();
    /// let parked = fetches.try_complete_else_watch(Fetch, Duration::from_millis(500), [1]).unwrap();
    /// let waiter = tokio::spawn(parked);
    ///
    /// // Stopping: wait at most 2 s for what is pending, then hand the rest back.
    /// let drained = tokio::time::timeout(Duration::from_secs(2), fetches.drain()).await;
    /// assert!(drained.is_ok(), "the parked fetch expired on its own");
    /// assert!(waiter.await.unwrap().is_ok());
    /// assert!(matches!(
    ///     fetches.try_complete_else_watch(Fetch, Duration::from_secs(1), [1]),
    ///     Err(WatchError::Draining(_)),
    /// ));
    /// drop(fetches.shutdown());
    /// # }
    /// ```
    pub fn drain(&self) -> impl std::future::Future<Output = ()> + Send + Sync + '_ {
        self.shared().drain()
    }

    /// Whether [`drain`](Self::drain) was called.
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
    /// let p: Purgatory<u32, Op> = Purgatory::builder().name("demo").build().unwrap();
    /// assert!(!p.is_draining());
    /// p.drain().await; // nothing pending: returns at once
    /// assert!(p.is_draining());
    /// # }
    /// ```
    pub fn is_draining(&self) -> bool {
        self.shared().is_draining()
    }
}

/// A snapshot of a [`Purgatory`]'s counters, taken by
/// [`Purgatory::metrics`]. Each field is read on its own while other threads
/// go on, so a snapshot taken while operations register and finish may not
/// balance; one taken when nothing moves does.
///
/// Once nothing is pending, `registered == completed + expired + cancelled +
/// handed_back`.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
/// use std::time::Duration;
/// use tokio_purgatory::{Operation, Purgatory};
///
/// struct Op(bool);
/// impl Operation for Op {
///     type Output = ();
///     fn try_complete(&mut self) -> Option<()> { self.0.then_some(()) }
///     fn on_expiration(self) {}
/// }
///
/// let p: Purgatory<u32, Op> = Purgatory::new();
/// let expiring = p.try_complete_else_watch(Op(false), Duration::from_millis(10), [1, 2]).unwrap();
/// let m = p.metrics();
/// assert_eq!((m.delayed, m.watched, m.keys), (1, 2, 2));
/// assert!(m.cells >= 1, "the operation's cell, kept for the next");
/// assert_eq!(p.try_complete_watched(&1), 0);
/// expiring.await.unwrap();
/// let m = p.metrics();
/// assert_eq!((m.registered, m.expired, m.delayed), (1, 1, 0));
/// assert_eq!(m.registered, m.completed + m.expired + m.cancelled + m.handed_back);
/// assert_eq!(m.checks.key_walks.walks, 1);
/// # }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct PurgatoryMetrics {
    /// Watch-list entries, tombstones included.
    pub watched: usize,
    /// Watch-list entries of finished operations not yet removed (part of
    /// `watched`). Each is a bare id (8 bytes in its list) that keeps nothing
    /// else alive: the operation's cell is reused once its handle and
    /// `OpRef`s are gone. They go with the next walk of their key or the
    /// amortised purge. Live watch entries are `watched - tombstones`.
    pub tombstones: usize,
    /// Operations pending.
    pub delayed: usize,
    /// Keys with a watch list.
    pub keys: usize,
    /// Cells the purgatory holds memory for, in use or free: about the most
    /// operations it ever held at once (an operation's cell is held until it
    /// has finished and its handle and every `OpRef` to it are gone), rounded
    /// up to whole pages of its slab (1,024 cells each past the first 2,048).
    /// Each takes [`Purgatory::cell_bytes`]; free cells are kept for the
    /// operations that follow and given back when the purgatory is dropped
    /// (its last clone, and the last handle or `OpRef` of its operations),
    /// so this never goes down.
    pub cells: usize,
    /// Operations accepted by `try_complete_else_watch`.
    pub registered: u64,
    /// Completed by a check.
    pub completed: u64,
    /// Finished by their timeout (including expiries that panicked).
    pub expired: u64,
    /// Cancelled (by key, by a handle's or an `OpRef`'s `cancel`, or by a
    /// dropped handle), or dropped with the purgatory or its reaper.
    pub cancelled: u64,
    /// Handed back by `shutdown()` or by a registration that raced it.
    pub handed_back: u64,
    /// Tombstones removed by the amortised purge (walks of keys not counted).
    pub purged: u64,
    /// Panics caught in user code: `try_complete`, `on_expiration`, the
    /// `Drop` of operations, outputs and keys the purgatory dropped, the
    /// wakers it woke or dropped, and, with the `metrics` feature, the
    /// recorder's calls it made on the reaper (lateness samples).
    pub panicked: u64,
    /// Times the reaper woke from a sleep (a [`Reaper`](crate::Reaper) shared
    /// with others counts its wake-ups in each it serves).
    pub reaper_wakeups: u64,
    /// Checks asked for by events, per kind of event: how much work an event
    /// costs, and how much of it completed something.
    pub checks: ChecksMetrics,
    /// The reaper's turns on this purgatory's timeouts.
    pub reaper: ReaperMetrics,
    /// Registrations refused, by reason, each operation handed back in its
    /// [`WatchError`]; not counted in `registered`.
    pub refused: RefusedMetrics,
}

/// Checks asked for by events, per kind (see [`PurgatoryMetrics::checks`]).
/// The checks a registration runs itself are not counted here.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
/// use std::time::Duration;
/// use tokio_purgatory::{Operation, Purgatory};
///
/// struct Op;
/// impl Operation for Op {
///     type Output = ();
///     fn try_complete(&mut self) -> Option<()> { None }
///     fn on_expiration(self) {}
/// }
///
/// let p: Purgatory<u32, Op> = Purgatory::new();
/// let h = p.try_complete_else_watch(Op, Duration::from_secs(1), [1]).unwrap();
/// let r = h.op_ref().unwrap();
/// assert!(!r.try_complete());
/// p.try_complete_watched(&1);
/// let checks = p.metrics().checks;
/// assert_eq!(checks.by_reference.checked, 1);
/// assert_eq!(checks.key_walks.walks, 1);
/// assert_eq!(checks.level_advances.walks, 0);
/// # }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct ChecksMetrics {
    /// [`Purgatory::try_complete_watched`]: walks of a key's plain watches.
    pub key_walks: WalkMetrics,
    /// [`Purgatory::try_complete_reached`]: level advances, each checking the
    /// watches its level reached.
    pub level_advances: WalkMetrics,
    /// [`OpRef::try_complete`]: one operation checked by reference (each call
    /// is one walk of one check).
    pub by_reference: WalkMetrics,
}

/// What the walks of one kind did.
///
/// `completed / checked` is the trigger-hit ratio: near 1, events reach the
/// operations they finish; near 0, most checks are wasted (keys watched by
/// many operations an event rarely finishes: watch at a level instead, see
/// [`Watch::level`]).
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
/// use std::sync::atomic::{AtomicBool, Ordering};
/// use std::sync::Arc;
/// use std::time::Duration;
/// use tokio_purgatory::{Operation, Purgatory};
///
/// struct Op(Arc<AtomicBool>);
/// impl Operation for Op {
///     type Output = ();
///     fn try_complete(&mut self) -> Option<()> { self.0.load(Ordering::Acquire).then_some(()) }
///     fn on_expiration(self) {}
/// }
///
/// let p: Purgatory<&str, Op> = Purgatory::new();
/// let ready = Arc::new(AtomicBool::new(false));
/// let waiting: Vec<_> = (0..4)
///     .map(|_| p.try_complete_else_watch(Op(ready.clone()), Duration::from_secs(1), ["k"]).unwrap())
///     .collect();
/// p.try_complete_watched("k"); // four checks, none completes
/// ready.store(true, Ordering::Release);
/// p.try_complete_watched("k"); // four checks, four completions
/// let walks = p.metrics().checks.key_walks;
/// assert_eq!((walks.walks, walks.checked, walks.completed), (2, 8, 4));
/// let hit_ratio = walks.completed as f64 / walks.checked as f64;
/// assert_eq!(hit_ratio, 0.5);
/// # drop(waiting);
/// # }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct WalkMetrics {
    /// Walks (calls).
    pub walks: u64,
    /// Operations asked to check, one for each watch the walk reached (an
    /// operation watching the key at several levels, or at a level and
    /// plainly, counts once for each). One already being checked by another
    /// thread is asked to check again rather than checked twice at once.
    pub checked: u64,
    /// Operations those walks completed.
    pub completed: u64,
}

#[cfg(all(test, not(purgatory_loom)))]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    struct Op(Arc<std::sync::atomic::AtomicBool>);

    impl Operation for Op {
        type Output = ();
        fn try_complete(&mut self) -> Option<()> {
            self.0.load(Ordering::SeqCst).then_some(())
        }
        fn on_expiration(self) {}
    }

    /// However an operation finishes before its deadline, its timer entry goes
    /// with it: otherwise the wheel would hold request rate x timeout entries.
    #[tokio::test(start_paused = true)]
    async fn finishing_early_removes_the_timer_entry() {
        let p: Purgatory<u32, Op> = Purgatory::builder().name("t").build().unwrap();
        let timers = || p.shared().timers();
        let op = |ready: bool| Op(Arc::new(ready.into()));
        let long = Duration::from_secs(3600);

        // Completed by a walk.
        let a = op(false);
        let flag = a.0.clone();
        let h = p.try_complete_else_watch(a, long, [1]).unwrap();
        assert_eq!(timers(), 1);
        flag.store(true, Ordering::SeqCst);
        assert_eq!(p.try_complete_watched(&1), 1);
        assert_eq!(timers(), 0, "completed by a walk");
        drop(h);

        // Completed through its reference.
        let a = op(false);
        let flag = a.0.clone();
        let h = p.try_complete_else_watch(a, long, [1]).unwrap();
        flag.store(true, Ordering::SeqCst);
        assert!(h.op_ref().unwrap().try_complete());
        assert_eq!(timers(), 0, "completed by reference");
        drop(h);

        // Cancelled by key, by its handle, and shut down.
        let h = p.try_complete_else_watch(op(false), long, [2]).unwrap();
        assert_eq!(p.cancel_for_key(&2).len(), 1);
        assert_eq!(timers(), 0, "cancelled by key");
        drop(h);
        let h = p.try_complete_else_watch(op(false), long, [3]).unwrap();
        drop(h);
        assert_eq!(timers(), 0, "cancelled by its handle");
        // Completed at registration: never armed.
        let h = p.try_complete_else_watch(op(true), long, [4]).unwrap();
        assert_eq!(timers(), 0, "completed at registration");
        drop(h);
        let _h = p.try_complete_else_watch(op(false), long, [5]).unwrap();
        assert_eq!(timers(), 1);
        assert_eq!(p.shutdown().len(), 1);
        assert_eq!(timers(), 0, "shut down");
    }

    /// However an operation finishes, its cell is freed once the last handle
    /// or reference to it goes, and the next registration reuses it: the slab
    /// does not grow with operations that have come and gone.
    #[tokio::test(start_paused = true)]
    async fn every_way_of_finishing_frees_the_cell() {
        let p: Purgatory<u32, Op> = Purgatory::builder().name("t").build().unwrap();
        let cells = || p.shared().cells().in_use();
        let op = |ready: bool| Op(Arc::new(ready.into()));
        let long = Duration::from_secs(3600);
        for round in 0..3 {
            // Completed by a walk, handle detached.
            let a = op(false);
            let flag = a.0.clone();
            p.try_complete_else_watch(a, long, [1, 2]).unwrap().detach();
            flag.store(true, Ordering::SeqCst);
            assert_eq!(p.try_complete_watched(&1), 1);
            // Completed at a level.
            let a = op(false);
            let flag = a.0.clone();
            let h = p
                .try_complete_else_watch_levels(a, long, [Watch::level(9, 5)])
                .unwrap();
            flag.store(true, Ordering::SeqCst);
            assert_eq!(p.try_complete_reached(&9, 5), 1);
            assert!(h.await.is_ok());
            // Completed through a reference kept past the handle.
            let a = op(false);
            let flag = a.0.clone();
            let h = p.try_complete_else_watch(a, long, [1]).unwrap();
            let r = h.op_ref().unwrap();
            let r2 = r.clone();
            h.detach();
            flag.store(true, Ordering::SeqCst);
            assert!(r.try_complete());
            drop(r);
            assert_eq!(r2.status(), OperationStatus::Completed);
            drop(r2);
            // Expired, awaited and not.
            let h = p
                .try_complete_else_watch(op(false), Duration::from_millis(5), [3])
                .unwrap();
            p.try_complete_else_watch(op(false), Duration::from_millis(5), [3])
                .unwrap()
                .detach();
            assert!(h.await.is_ok());
            // Cancelled by key, by its handle, by cancel().
            let h = p.try_complete_else_watch(op(false), long, [4]).unwrap();
            assert_eq!(p.cancel_for_key(&4).len(), 1);
            drop(h);
            drop(p.try_complete_else_watch(op(false), long, [5]).unwrap());
            let h = p.try_complete_else_watch(op(false), long, [6]).unwrap();
            assert!(h.cancel().is_some());
            // Completed at registration: no cell.
            drop(p.try_complete_else_watch(op(true), long, [7]).unwrap());
            tokio::time::sleep(Duration::from_millis(10)).await;
            assert_eq!(p.delayed(), 0);
            assert_eq!(cells(), 0, "round {round}: every cell is free");
        }
        let grown = p.shared().cells().grown();
        assert!(grown <= 3, "cells are reused: grown to {grown}");
        // A key that panics while being watched turns the registration back,
        // and its cell is freed with it.
        #[derive(PartialEq, Eq, Hash)]
        struct Bad(u32, bool);
        impl Clone for Bad {
            fn clone(&self) -> Self {
                assert!(!self.1, "a key whose clone panics");
                Bad(self.0, self.1)
            }
        }
        let q: Purgatory<Bad, Op> = Purgatory::builder().name("bad").build().unwrap();
        for _ in 0..3 {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                q.try_complete_else_watch(op(false), long, [Bad(1, false), Bad(2, true)])
                    .map(|h| h.detach())
            }));
            assert!(r.is_err(), "the key's panic reaches the caller");
            assert_eq!(q.shared().cells().in_use(), 0, "the cell is freed");
        }
        assert_eq!(q.shared().cells().grown(), 1, "and reused");

        // Pending at shutdown: handed back, its cell freed with its handle.
        let h = p.try_complete_else_watch(op(false), long, [8]).unwrap();
        assert_eq!(p.shutdown().len(), 1);
        assert!(h.await.is_err());
        assert_eq!(cells(), 0);
    }
}
