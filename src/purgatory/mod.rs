//! The purgatory: operations that wait on watch keys until they complete or time
//! out.
//!
//! See [`Purgatory`] and the [crate docs](crate).

mod error;
mod handle;
mod operation;
mod state;

use std::hash::Hash;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, AtomicIsize, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

pub use self::error::{OperationError, WatchError};
pub use self::handle::{OpRef, OperationHandle};
pub use self::operation::{Completion, Operation};
use self::operation::{Fate, OpCell};
use crate::reaper::{deadline_after, panic_message, Closed, Core, Job, Refused};
use crate::timer::{runtime_handle, BuildError, WheelSettings};
use crate::watchers::Watchers;

/// What a watch key must be: hashable, comparable, cloneable and shareable.
/// Implemented for every such type (strings, integers, `(topic, partition)`
/// tuples, ...).
///
/// A key whose `Hash` and `Eq` disagree does not corrupt anything: at worst the
/// operations watching it are not found by `try_complete_watched` and finish by
/// their timeout.
pub trait WatchKey: Hash + Eq + Clone + Send + Sync + 'static {}

impl<T: Hash + Eq + Clone + Send + Sync + 'static> WatchKey for T {}

/// The timer job of an operation: its cell.
struct Expiry<K: WatchKey, O: Operation>(Arc<OpCell<K, O>>);

impl<K: WatchKey, O: Operation> Job for Expiry<K, O> {
    fn expire(self) {
        self.0.expire();
    }

    fn abandon(self, why: Closed) {
        // Dropped unrun: the purgatory itself is gone, or its reaper is.
        drop(self.0.cancel(closed_error(why), Fate::Cancelled));
    }
}

/// What a handle sees when the purgatory closed under its operation.
fn closed_error(why: Closed) -> OperationError {
    match why {
        Closed::Shutdown => OperationError::Shutdown,
        Closed::ReaperGone => OperationError::ReaperGone,
    }
}

/// How a registration refused because the purgatory closed hands `op` back.
fn closed_refusal<O>(op: O, why: Closed) -> WatchError<O> {
    match why {
        Closed::Shutdown => WatchError::Shutdown(op),
        Closed::ReaperGone => WatchError::ReaperGone(op),
    }
}

#[derive(Debug, Default)]
struct Counters {
    registered: AtomicU64,
    completed: AtomicU64,
    expired: AtomicU64,
    cancelled: AtomicU64,
    handed_back: AtomicU64,
    purged: AtomicU64,
    panicked: AtomicU64,
}

/// State shared by the purgatory handles and every operation cell.
pub(crate) struct Shared<K: WatchKey, O: Operation> {
    core: Arc<Core<Expiry<K, O>>>,
    watchers: Watchers<K, Arc<OpCell<K, O>>>,
    /// Operations registered and not finished (Kafka's `numDelayed`).
    delayed: AtomicUsize,
    /// Watch-list entries, tombstones included (Kafka's `watched`).
    watched: AtomicUsize,
    /// Watch-list entries of finished operations. May dip below zero briefly when
    /// an entry is removed just before its operation's finish is counted.
    tombstones: AtomicIsize,
    purging: AtomicBool,
    purge_interval: usize,
    max_pending: Option<usize>,
    counters: Counters,
    name: Arc<str>,
}

impl<K: WatchKey, O: Operation> Shared<K, O> {
    fn note_panic(&self, what: &str, panic: &(dyn std::any::Any + Send)) {
        self.counters.panicked.fetch_add(1, Ordering::Relaxed);
        tracing::error!(
            purgatory = &*self.name,
            callback = what,
            panic = panic_message(panic),
            "an operation panicked; the purgatory carries on"
        );
    }

    /// Counts a finished operation; its `keys` list entries are now tombstones.
    fn on_finished(&self, fate: Fate, keys: u32) {
        self.delayed.fetch_sub(1, Ordering::AcqRel);
        let c = &self.counters;
        let counter = match fate {
            Fate::Completed => &c.completed,
            Fate::Expired => &c.expired,
            Fate::Cancelled => &c.cancelled,
            Fate::HandedBack => &c.handed_back,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        tracing::trace!(purgatory = &*self.name, ?fate, "operation finished");
        self.tombstones.fetch_add(keys as isize, Ordering::AcqRel);
        // No purge here: this runs on the reaper too, and a purge walks every
        // list. Registration and key walks purge instead (Kafka's places).
    }

    /// Watch-list entries removed: they were (or are about to be) tombstones.
    fn on_removed(&self, n: usize) {
        if n > 0 {
            self.watched.fetch_sub(n, Ordering::AcqRel);
            self.tombstones.fetch_sub(n as isize, Ordering::AcqRel);
        }
    }

    /// Kafka's `purgeInterval`, made amortised O(1): purge once tombstones exceed
    /// both the interval and the live entries, so each purge removes at least half
    /// of what it walks. Called on registration, key walks and cancellation by key,
    /// never on the reaper (expiries would wait behind the walk).
    fn maybe_purge(&self) {
        let tomb = self.tombstones.load(Ordering::Acquire).max(0) as usize;
        if tomb <= self.purge_interval {
            return;
        }
        let live = self.watched.load(Ordering::Acquire).saturating_sub(tomb);
        if tomb <= live || self.purging.swap(true, Ordering::AcqRel) {
            return;
        }
        let removed = self.watchers.purge(|c| c.is_done());
        self.on_removed(removed);
        self.counters
            .purged
            .fetch_add(removed as u64, Ordering::Relaxed);
        self.purging.store(false, Ordering::Release);
        tracing::debug!(
            purgatory = &*self.name,
            removed,
            "purged finished operations"
        );
    }
}

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
/// let fetches: Purgatory<(String, u32), Fetch> = Purgatory::builder("fetch")
///     .purge_interval(1000)
///     .max_pending(100_000)
///     .build()
///     .unwrap();
/// assert_eq!(fetches.delayed(), 0);
/// # }
/// ```
pub struct PurgatoryBuilder<K, O> {
    name: Arc<str>,
    wheel: WheelSettings,
    watcher_shards: usize,
    purge_interval: usize,
    max_pending: Option<usize>,
    _types: PhantomData<fn() -> (K, O)>,
}

impl<K, O> Clone for PurgatoryBuilder<K, O> {
    fn clone(&self) -> Self {
        PurgatoryBuilder {
            name: self.name.clone(),
            wheel: self.wheel.clone(),
            _types: PhantomData,
            ..*self
        }
    }
}

impl<K, O> std::fmt::Debug for PurgatoryBuilder<K, O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PurgatoryBuilder")
            .field("name", &&*self.name)
            .field("wheel", &self.wheel)
            .field("watcher_shards", &self.watcher_shards)
            .field("purge_interval", &self.purge_interval)
            .field("max_pending", &self.max_pending)
            .finish()
    }
}

impl<K: WatchKey, O: Operation> PurgatoryBuilder<K, O> {
    crate::timer::wheel_setters!();

    /// Independently locked timer wheels (default: the machine's parallelism, at
    /// most 16).
    pub fn timer_shards(mut self, shards: usize) -> Self {
        self.wheel.shards = shards;
        self
    }

    /// Independently locked parts of the watcher map (default 64).
    pub fn watcher_shards(mut self, shards: usize) -> Self {
        self.watcher_shards = shards;
        self
    }

    /// Finished operations left as tombstones in watch lists before a purge may
    /// run (default 1000, Kafka's `purgeInterval`). A purge runs once tombstones
    /// exceed both this and the live entries, on the thread whose operation
    /// finished; walking a key also removes its tombstones.
    pub fn purge_interval(mut self, interval: usize) -> Self {
        self.purge_interval = interval;
        self
    }

    /// Limit on pending operations (default: none). At the limit, registration
    /// hands the operation back in [`WatchError::AtCapacity`].
    pub fn max_pending(mut self, max: usize) -> Self {
        self.max_pending = Some(max);
        self
    }

    /// Builds the purgatory and spawns its reaper on the current runtime.
    ///
    /// # Errors
    ///
    /// When a setting is out of range, or no runtime is current.
    pub fn build(self) -> Result<Purgatory<K, O>, BuildError> {
        self.build_inner(None)
    }

    /// Builds the purgatory and spawns its reaper on the runtime of `handle`.
    ///
    /// # Errors
    ///
    /// When a setting is out of range.
    pub fn build_on(self, handle: &tokio::runtime::Handle) -> Result<Purgatory<K, O>, BuildError> {
        self.build_inner(Some(handle))
    }

    fn build_inner(
        self,
        handle: Option<&tokio::runtime::Handle>,
    ) -> Result<Purgatory<K, O>, BuildError> {
        self.wheel.validate()?;
        if self.watcher_shards == 0 || self.watcher_shards > 65_536 {
            return Err(BuildError::invalid("watcher_shards must be in 1..=65536"));
        }
        if self.max_pending == Some(0) {
            return Err(BuildError::invalid("max_pending must be at least 1"));
        }
        let rt = runtime_handle(handle)?;
        let core = Core::start(&self.wheel.core_config(self.name.clone(), None), &rt);
        let shared = Arc::new(Shared {
            core,
            watchers: Watchers::new(self.watcher_shards),
            delayed: AtomicUsize::new(0),
            watched: AtomicUsize::new(0),
            tombstones: AtomicIsize::new(0),
            purging: AtomicBool::new(false),
            purge_interval: self.purge_interval,
            max_pending: self.max_pending,
            counters: Counters::default(),
            name: self.name,
        });
        Ok(Purgatory {
            owner: Arc::new(Owner { shared }),
        })
    }
}

/// Shuts the purgatory down when the last [`Purgatory`] clone is dropped.
struct Owner<K: WatchKey, O: Operation> {
    shared: Arc<Shared<K, O>>,
}

impl<K: WatchKey, O: Operation> Drop for Owner<K, O> {
    fn drop(&mut self) {
        // Pending operations are dropped unrun; their handles see `Shutdown`.
        // Closing the timer and draining the lists also breaks the reference
        // cycles through the cells.
        let ops = close(&self.shared, Fate::Cancelled);
        drop(ops);
    }
}

/// Closes the timer and empties the watch lists; returns the operations taken.
fn close<K: WatchKey, O: Operation>(shared: &Shared<K, O>, fate: Fate) -> Vec<O> {
    let Some(jobs) = shared.core.close(Closed::Shutdown) else {
        return Vec::new();
    };
    let mut ops = Vec::with_capacity(jobs.len());
    for Expiry(cell) in jobs {
        ops.extend(cell.cancel(OperationError::Shutdown, fate));
    }
    // Operations still registering are in lists but not yet in the timer.
    let cells = shared.watchers.drain();
    shared.on_removed(cells.len());
    for cell in cells {
        ops.extend(cell.cancel(OperationError::Shutdown, fate));
    }
    ops
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
/// # Concurrency
///
/// No map or list lock is held while user code (`try_complete`,
/// `on_expiration`, drops of operations and outputs) runs, so that code may call
/// back into the purgatory. Checks of one operation never overlap; an event that
/// arrives while one runs makes it check again.
///
/// # Memory
///
/// A finished operation is dropped at once. Its entries in the watch lists of its
/// other keys become tombstones (a pointer to its small cell) until that key is
/// next walked or the amortised purge runs (see
/// [`PurgatoryBuilder::purge_interval`]). Keys whose lists empty are removed.
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
/// let purgatory: Purgatory<&str, DelayedFetch> = Purgatory::builder("fetch").build().unwrap();
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
pub struct Purgatory<K: WatchKey, O: Operation> {
    owner: Arc<Owner<K, O>>,
}

impl<K: WatchKey, O: Operation> Clone for Purgatory<K, O> {
    fn clone(&self) -> Self {
        Purgatory {
            owner: self.owner.clone(),
        }
    }
}

impl<K: WatchKey, O: Operation> std::fmt::Debug for Purgatory<K, O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Purgatory")
            .field("name", &&*self.shared().name)
            .field("delayed", &self.delayed())
            .field("watched", &self.watched())
            .finish()
    }
}

impl<K: WatchKey, O: Operation> Purgatory<K, O> {
    /// A builder with default settings; `name` labels `tracing` events.
    pub fn builder(name: &str) -> PurgatoryBuilder<K, O> {
        PurgatoryBuilder {
            name: name.into(),
            wheel: WheelSettings::default(),
            watcher_shards: 64,
            purge_interval: 1000,
            max_pending: None,
            _types: PhantomData,
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
    /// saturates to about 30 years.
    ///
    /// # Errors
    ///
    /// Hands `op` back, unchecked or checked but not completed, when `keys` is
    /// empty, the purgatory is at its pending limit, shut down, or has lost its
    /// reaper.
    ///
    /// # Concurrent calls
    ///
    /// A [`shutdown`](Purgatory::shutdown) racing this call either takes the
    /// operation (the handle resolves to [`OperationError::Shutdown`]) or this
    /// call fails with [`WatchError::Shutdown`]: the operation is never lost.
    pub fn try_complete_else_watch<I>(
        &self,
        mut op: O,
        timeout: Duration,
        keys: I,
    ) -> Result<OperationHandle<K, O>, WatchError<O>>
    where
        I: IntoIterator<Item = K>,
    {
        let shared = self.shared();
        let keys = dedup(keys);
        if keys.is_empty() {
            return Err(WatchError::NoKeys(op));
        }
        if let Some(why) = shared.core.closed() {
            return Err(closed_refusal(op, why));
        }
        let delayed = shared.delayed.fetch_add(1, Ordering::AcqRel);
        if shared.max_pending.is_some_and(|max| delayed >= max) {
            shared.delayed.fetch_sub(1, Ordering::AcqRel);
            return Err(WatchError::AtCapacity(op));
        }
        shared.counters.registered.fetch_add(1, Ordering::Relaxed);
        let deadline = deadline_after(Instant::now(), timeout);
        tracing::trace!(
            purgatory = &*shared.name,
            keys = keys.len(),
            ?timeout,
            "register"
        );

        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| op.try_complete())) {
            Ok(Some(output)) => {
                shared.on_finished(Fate::Completed, 0);
                return Ok(OperationHandle::ready(Completion::Completed(output)));
            }
            Ok(None) => {}
            Err(panic) => shared.note_panic("try_complete", &*panic),
        }

        let cell = Arc::new(OpCell::new(op, keys.len() as u32, shared.clone()));
        shared.watched.fetch_add(keys.len(), Ordering::AcqRel);
        shared.watchers.watch(&keys, &cell);
        if cell.check() {
            // Completed by the check after watching: no timeout to start.
            return Ok(OperationHandle::waiting(cell));
        }
        match shared.core.insert(deadline, Expiry(cell.clone())) {
            Ok(key) => cell.set_timer(key),
            Err(Refused::Closed(job, why)) => {
                drop(job);
                // A shutdown ran during registration. If it did not take the
                // operation, hand it back here.
                if let Some(op) = cell.cancel(closed_error(why), Fate::HandedBack) {
                    for key in &keys {
                        shared.on_removed(shared.watchers.prune(key, |c| c.is_done()));
                    }
                    return Err(closed_refusal(op, why));
                }
            }
            Err(Refused::AtCapacity(_)) => unreachable!("the purgatory's timer has no limit"),
        }
        shared.maybe_purge();
        Ok(OperationHandle::waiting(cell))
    }

    /// Checks the operations watching `key` and completes those that can be (Kafka's
    /// `checkAndComplete`). Returns how many this call completed. Also removes the
    /// tombstones it finds in the key's list, and the key itself when its list
    /// empties. Operations this call completes are removed at once when they are at
    /// least a quarter of the list; otherwise they stay as tombstones until the
    /// key's next walk (or the amortised purge).
    ///
    /// # Concurrent calls
    ///
    /// The key's list is copied under its lock and the checks run after the lock
    /// is released. An operation already being checked elsewhere is asked to check
    /// again instead (it is then not counted here). Calls for the same or other
    /// keys may run at once on any number of threads.
    pub fn try_complete_watched(&self, key: &K) -> usize {
        let shared = self.shared();
        let mut live = Vec::new();
        shared.on_removed(
            shared
                .watchers
                .collect_live(key, &mut live, |c| c.is_done()),
        );
        let checked = live.len();
        let completed = live.iter().filter(|cell| cell.check()).count();
        drop(live);
        // Compact now only when much of the list finished: otherwise the finished
        // entries are tombstones the key's next walk drops anyway, and a second
        // full walk per event would double the cost of hot keys.
        if completed > 0 && completed * 4 >= checked {
            shared.on_removed(shared.watchers.prune(key, |c| c.is_done()));
        }
        shared.maybe_purge();
        completed
    }

    /// Removes every operation watching `key` from the purgatory without completing
    /// it (Kafka's `cancelForKey`), and returns them. Their handles resolve to
    /// [`OperationError::Cancelled`]; their timeouts are cancelled; their entries
    /// under other keys become tombstones.
    ///
    /// An unknown key returns an empty list.
    ///
    /// # Concurrent calls
    ///
    /// An operation being checked at this very moment is not returned: if that
    /// check completes it, it completes; otherwise the checker cancels it right
    /// after (its handle resolves to `Cancelled`, and the operation is dropped).
    pub fn cancel_for_key(&self, key: &K) -> Vec<O> {
        let shared = self.shared();
        let cells = shared.watchers.take(key);
        shared.on_removed(cells.len());
        let ops = cells
            .iter()
            .filter_map(|cell| cell.cancel(OperationError::Cancelled, Fate::Cancelled))
            .collect();
        shared.maybe_purge();
        ops
    }

    /// Number of watch-list entries, tombstones included (Kafka's `watched`). O(1).
    pub fn watched(&self) -> usize {
        self.shared().watched.load(Ordering::Acquire)
    }

    /// Number of operations registered and not finished (Kafka's `numDelayed`). O(1).
    pub fn delayed(&self) -> usize {
        self.shared().delayed.load(Ordering::Acquire)
    }

    /// Counters since the purgatory was built.
    pub fn metrics(&self) -> PurgatoryMetrics {
        let s = self.shared();
        let c = &s.counters;
        PurgatoryMetrics {
            watched: self.watched(),
            delayed: self.delayed(),
            keys: s.watchers.keys(),
            registered: c.registered.load(Ordering::Relaxed),
            completed: c.completed.load(Ordering::Relaxed),
            expired: c.expired.load(Ordering::Relaxed),
            cancelled: c.cancelled.load(Ordering::Relaxed),
            handed_back: c.handed_back.load(Ordering::Relaxed),
            purged: c.purged.load(Ordering::Relaxed),
            panicked: c.panicked.load(Ordering::Relaxed),
            reaper_wakeups: s.core.wakeups(),
        }
    }

    /// Stops the reaper and hands back every pending operation, in no particular
    /// order; their handles resolve to [`OperationError::Shutdown`]. Registration
    /// afterwards fails with [`WatchError::Shutdown`]. Returns an empty list when
    /// already shut down.
    ///
    /// # Concurrent calls
    ///
    /// An operation being checked or expired at this moment is not in the list: it
    /// finishes by that check or expiry, or is cancelled right after a check that
    /// did not complete it. Calling `shutdown` from inside an operation's code
    /// works.
    pub fn shutdown(&self) -> Vec<O> {
        close(self.shared(), Fate::HandedBack)
    }

    /// Whether the purgatory no longer accepts operations.
    pub fn is_shutdown(&self) -> bool {
        self.shared().core.closed().is_some()
    }
}

/// A snapshot of a [`Purgatory`]'s counters.
///
/// Once nothing is pending, `registered == completed + expired + cancelled +
/// handed_back`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct PurgatoryMetrics {
    /// Watch-list entries, tombstones included.
    pub watched: usize,
    /// Operations pending.
    pub delayed: usize,
    /// Keys with a watch list.
    pub keys: usize,
    /// Operations accepted by `try_complete_else_watch`.
    pub registered: u64,
    /// Completed by a check.
    pub completed: u64,
    /// Finished by their timeout (including expiries that panicked).
    pub expired: u64,
    /// Cancelled by key or by a dropped handle, or dropped with the purgatory.
    pub cancelled: u64,
    /// Handed back by `shutdown()` or by a registration that raced it.
    pub handed_back: u64,
    /// Tombstones removed by the amortised purge (walks of keys not counted).
    pub purged: u64,
    /// Panics caught in `try_complete` or `on_expiration`.
    pub panicked: u64,
    /// Times the reaper woke from a sleep.
    pub reaper_wakeups: u64,
}

fn dedup<K: WatchKey>(keys: impl IntoIterator<Item = K>) -> Vec<K> {
    let mut out: Vec<K> = Vec::new();
    for k in keys {
        if out.len() < 16 {
            if !out.contains(&k) {
                out.push(k);
            }
        } else {
            out.push(k);
        }
    }
    if out.len() > 16 {
        let mut seen = std::collections::HashSet::with_capacity(out.len());
        out.retain(|k| seen.insert(k.clone()));
    }
    out
}
