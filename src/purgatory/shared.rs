//! The books every purgatory handle and operation cell share: the timer core, the
//! watcher map, the counters, the purge policy, and how closing works.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, TryLockError};

use super::cell::{Fate, OpCell};
use super::error::{OperationError, WatchError};
use super::operation::Operation;
use super::WatchKey;
use crate::contain::Panics;
use crate::core::{Closed, Core, Job};
use crate::sync::{Padded, Striped};
use crate::watchers::{KeyHasher, Removed, Sweep, Watchers};
use tokio::sync::Notify;

/// The most watch-list entries one call visits for the purge.
pub(crate) const SWEEP_SLICE: usize = 128;

/// The timer job of an operation: its cell.
pub(crate) struct Expiry<K: WatchKey, O: Operation>(pub(crate) Arc<OpCell<K, O>>);

impl<K: WatchKey, O: Operation> Job for Expiry<K, O> {
    const KIND: &'static str = "purgatory";

    fn expire(self) {
        self.0.expire();
    }

    fn abandon(self, why: Closed) {
        // Dropped unrun: the purgatory itself is gone, or its reaper is.
        let cell = self.0;
        if let Some(op) = cell.cancel(why.into(), Fate::Cancelled) {
            cell.shared.panics.drop_value("drop of an operation", op);
        }
    }
}

impl From<Closed> for OperationError {
    fn from(why: Closed) -> Self {
        match why {
            Closed::Shutdown => OperationError::Shutdown,
            Closed::ReaperGone => OperationError::ReaperGone,
        }
    }
}

/// How a registration refused because the purgatory closed hands `op` back.
pub(crate) fn closed_refusal<O>(op: O, why: Closed) -> WatchError<O> {
    match why {
        Closed::Shutdown => WatchError::Shutdown(op),
        Closed::ReaperGone => WatchError::ReaperGone(op),
    }
}

/// A purge under way (`maybe_purge`), a flag to skip its lock when none is,
/// and the entries purged so far.
#[derive(Debug)]
pub(crate) struct Purge {
    sweep: Mutex<Option<Sweep>>,
    sweeping: AtomicBool,
    pub(crate) purged: AtomicU64,
}

/// One thread stripe's share of the per-operation counts.
///
/// Each fact is counted once: an admission, a turning back, and each fate. What
/// follows from them is derived when read: registered operations are those
/// admitted and not turned back, and those that left are the ones turned back
/// plus every fate. So a registration changes one count, and a finish one.
#[derive(Debug, Default)]
struct Stripe {
    /// Operations admitted. With the counts of those that left (`turned_back`
    /// and the fates), all only grow, so a sum read in the right order never
    /// misses an operation pending throughout the read (see `delayed_now`).
    admitted: AtomicU64,
    /// Admitted, then turned back before registering (refused while draining,
    /// or a key's code panicked).
    turned_back: AtomicU64,
    completed: AtomicU64,
    expired: AtomicU64,
    cancelled: AtomicU64,
    handed_back: AtomicU64,
    /// Watch-list entries of finished operations (tombstones) made and
    /// removed: a finish adds its keys, a removal takes off what it removed.
    /// Wrapping, so a stripe may go below zero; the sum is exact.
    tombstones: AtomicU64,
}

impl Stripe {
    /// Operations that left: turned back, or finished with any fate.
    fn left(&self) -> u64 {
        self.turned_back.load(Ordering::SeqCst)
            + self.completed.load(Ordering::SeqCst)
            + self.expired.load(Ordering::SeqCst)
            + self.cancelled.load(Ordering::SeqCst)
            + self.handed_back.load(Ordering::SeqCst)
    }
}

/// The per-operation counts, striped by thread. Every registration and every
/// outcome changes them; one shared word per count would bounce its cache line
/// between the registering, completing and expiring threads on every operation.
/// A thread writes its own stripe; readers sum all of them, which is exact when
/// no call races the read. Watch-list entries are counted by the watcher map
/// (all of them) and here (tombstones); live entries are the difference.
#[derive(Debug, Default)]
pub(crate) struct Books {
    stripes: Striped<Stripe>,
}

/// A sum of the per-operation counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Totals {
    pub(crate) delayed: usize,
    pub(crate) registered: u64,
    pub(crate) completed: u64,
    pub(crate) expired: u64,
    pub(crate) cancelled: u64,
    pub(crate) handed_back: u64,
}

impl Books {
    fn mine(&self) -> &Stripe {
        self.stripes.mine()
    }

    /// An operation was admitted. Sequentially consistent, as the other changes
    /// and the sum are: they pair with the draining flag (see
    /// `Shared::turned_back`); on x86 a read-modify-write costs the same with any
    /// ordering.
    pub(crate) fn admitted(&self) {
        self.mine().admitted.fetch_add(1, Ordering::SeqCst);
    }

    /// An admitted operation turned back before it was registered.
    pub(crate) fn turned_back(&self) {
        self.mine().turned_back.fetch_add(1, Ordering::SeqCst);
    }

    /// An operation finished with `fate`.
    pub(crate) fn finished(&self, fate: Fate) {
        let s = self.mine();
        let counter = match fate {
            Fate::Completed => &s.completed,
            Fate::Expired => &s.expired,
            Fate::Cancelled => &s.cancelled,
            Fate::HandedBack => &s.handed_back,
        };
        counter.fetch_add(1, Ordering::SeqCst);
    }

    /// `n` watch-list entries became tombstones (negative: were removed).
    pub(crate) fn tombstones_changed(&self, n: i64) {
        self.mine()
            .tombstones
            .fetch_add(n as u64, Ordering::Relaxed);
    }

    /// Tombstones (sums the stripes: exact when no call races the read; a
    /// removal counted just before the finish that made its entries
    /// tombstones reads as none rather than below zero).
    pub(crate) fn tombstones(&self) -> usize {
        let sum = self.stripes.iter().fold(0u64, |sum, s| {
            sum.wrapping_add(s.tombstones.load(Ordering::Relaxed))
        });
        (sum as i64).max(0) as usize
    }

    /// Operations admitted and not finished. Reads every stripe's `left` before
    /// any `admitted`: an operation counted as left was admitted before, so its
    /// admission is counted too, and an operation pending throughout the read is
    /// counted in `admitted` only. Zero so means that no operation was pending
    /// throughout (what `drain` needs); racing calls may make it a little high.
    pub(crate) fn delayed_now(&self) -> usize {
        let left: u64 = self.stripes.iter().map(Stripe::left).sum();
        let admitted: u64 = self
            .stripes
            .iter()
            .map(|s| s.admitted.load(Ordering::SeqCst))
            .sum();
        admitted.saturating_sub(left) as usize
    }

    pub(crate) fn totals(&self) -> Totals {
        let mut t = Totals {
            delayed: self.delayed_now(),
            ..Totals::default()
        };
        let mut turned_back = 0;
        for s in self.stripes.iter() {
            t.registered += s.admitted.load(Ordering::Relaxed);
            turned_back += s.turned_back.load(Ordering::Relaxed);
            t.completed += s.completed.load(Ordering::Relaxed);
            t.expired += s.expired.load(Ordering::Relaxed);
            t.cancelled += s.cancelled.load(Ordering::Relaxed);
            t.handed_back += s.handed_back.load(Ordering::Relaxed);
        }
        t.registered = t.registered.saturating_sub(turned_back);
        t
    }
}

/// State shared by the purgatory handles and every operation cell. Aligned so
/// that the `Arc`'s reference count, which every new cell bumps, has a cache
/// line to itself instead of sharing one with the fields every call reads.
#[repr(align(128))]
pub(crate) struct Shared<K: WatchKey, O: Operation> {
    pub(crate) core: Arc<Core<Expiry<K, O>>>,
    pub(crate) watchers: Watchers<K, Arc<OpCell<K, O>>>,
    /// Registered and not finished, kept only under a limit (it is the one count
    /// every registration must agree on); the books keep the same figure
    /// striped.
    admitted: Padded<AtomicUsize>,
    pub(crate) books: Books,
    /// The purge under way, on cache lines of its own: the thread purging
    /// writes it on every slice, and the threads completing operations read
    /// the fields around it on every finish.
    pub(crate) purge: Padded<Purge>,
    purge_interval: usize,
    pub(crate) max_pending: Option<usize>,
    /// Set by `drain`: registrations are refused, and each finish wakes the
    /// drainers. Read by every registration and finish, written once.
    draining: AtomicBool,
    drained: Notify,
    /// Panics caught in the purgatory's user code.
    pub(crate) panics: Panics,
    pub(crate) name: Arc<str>,
    /// Buffers kept between walks and purge slices, one set per thread stripe.
    buffers: Striped<Mutex<Buffers<K, O>>>,
}

/// What a walk or a purge slice fills while it holds a list's lock: the live
/// cells copied out and the entries taken out. Kept between calls (see
/// [`Shared::take_buffers`]) so that those calls neither allocate nor grow a
/// buffer under the lock: an allocation there could wait on the allocator's
/// own lock (which another thread takes to free what this one allocated), and
/// every thread wanting the list would wait behind it.
pub(crate) struct Buffers<K: WatchKey, O: Operation> {
    pub(crate) live: Vec<Arc<OpCell<K, O>>>,
    pub(crate) removed: Removed<K, Arc<OpCell<K, O>>>,
}

impl<K: WatchKey, O: Operation> Default for Buffers<K, O> {
    fn default() -> Self {
        Buffers {
            live: Vec::new(),
            removed: Removed::default(),
        }
    }
}

/// The most bytes a kept buffer may hold room for (1,024 cell references): a
/// buffer grown past it by one long walk is freed rather than kept.
const KEEP_BUFFER_BYTES: usize = 8 * 1024;

/// Frees `v`'s room if it is past [`KEEP_BUFFER_BYTES`].
fn cap_kept<T>(v: &mut Vec<T>) {
    if v.capacity().saturating_mul(std::mem::size_of::<T>()) > KEEP_BUFFER_BYTES {
        *v = Vec::new();
    }
}

impl<K: WatchKey, O: Operation> Shared<K, O> {
    pub(crate) fn new(
        core: Arc<Core<Expiry<K, O>>>,
        watcher_shards: usize,
        purge_interval: usize,
        max_pending: Option<usize>,
        name: Arc<str>,
        hasher: KeyHasher,
    ) -> Self {
        Shared {
            core,
            watchers: Watchers::new(watcher_shards, hasher),
            admitted: Padded(AtomicUsize::new(0)),
            books: Books::default(),
            purge: Padded(Purge {
                sweep: Mutex::new(None),
                sweeping: AtomicBool::new(false),
                purged: AtomicU64::new(0),
            }),
            purge_interval,
            max_pending,
            draining: AtomicBool::new(false),
            drained: Notify::new(),
            panics: Panics::new("purgatory", name.clone()),
            name,
            buffers: Striped::default(),
        }
    }

    fn buffer_slot(&self) -> &Mutex<Buffers<K, O>> {
        self.buffers.mine()
    }

    /// Empty buffers for a walk or a purge slice: this thread stripe's kept
    /// ones, or new ones when they are in use (another thread of the stripe,
    /// or a walk re-entered from an operation's check).
    pub(crate) fn take_buffers(&self) -> Buffers<K, O> {
        match self.buffer_slot().try_lock() {
            Ok(mut kept) => std::mem::take(&mut *kept),
            Err(_) => Buffers::default(),
        }
    }

    /// Keeps `buffers` (emptied by the caller) for the next call on this
    /// thread stripe, each unless it grew past [`KEEP_BUFFER_BYTES`]. Whatever
    /// is not kept is freed after the lock is released (empty buffers: no user
    /// code).
    pub(crate) fn keep_buffers(&self, mut buffers: Buffers<K, O>) {
        debug_assert!(buffers.live.is_empty() && buffers.removed.entries.is_empty());
        debug_assert!(buffers.removed.keys.is_empty());
        cap_kept(&mut buffers.live);
        cap_kept(&mut buffers.removed.entries);
        cap_kept(&mut buffers.removed.keys);
        if let Ok(mut kept) = self.buffer_slot().try_lock() {
            std::mem::swap(&mut *kept, &mut buffers);
        }
        drop(buffers);
    }

    /// Counts an operation in, unless the purgatory holds `max_pending` already.
    pub(crate) fn admit(&self) -> bool {
        if let Some(max) = self.max_pending {
            if self.admitted.0.fetch_add(1, Ordering::AcqRel) >= max {
                self.admitted.0.fetch_sub(1, Ordering::AcqRel);
                return false;
            }
        }
        self.books.admitted();
        true
    }

    /// Undoes [`admit`](Self::admit) for an operation that never registered,
    /// and wakes a drainer that may be waiting for it: a registration admitted
    /// before `drain` began and turned back after (a key that panicked) is the
    /// last thing that drainer waits for.
    pub(crate) fn unadmit(&self) {
        if self.max_pending.is_some() {
            self.admitted.0.fetch_sub(1, Ordering::AcqRel);
        }
        self.books.turned_back();
        if self.draining.load(Ordering::SeqCst) {
            self.drained.notify_waiters();
        }
    }

    /// Operations registered and not finished.
    pub(crate) fn delayed(&self) -> usize {
        self.books.delayed_now()
    }

    /// Whether an admitted registration must turn back because the purgatory is
    /// draining; then it is unadmitted here. The admission's count and this read
    /// pair with `drain`'s write of the flag and read of the count (all
    /// sequentially consistent): either this sees the flag, or the drainer sees
    /// the operation and waits for it.
    pub(crate) fn turned_back(&self) -> bool {
        if !self.draining.load(Ordering::SeqCst) {
            return false;
        }
        self.unadmit();
        true
    }

    /// Stops taking operations and waits until none is pending.
    pub(crate) async fn drain(&self) {
        self.draining.store(true, Ordering::SeqCst);
        loop {
            let finished = self.drained.notified();
            let mut finished = std::pin::pin!(finished);
            finished.as_mut().enable();
            if self.books.delayed_now() == 0 {
                return;
            }
            finished.await;
        }
    }

    pub(crate) fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// Drops a user value (an operation, an output, a key) with no lock held,
    /// containing and counting a panic in its `Drop`.
    pub(crate) fn drop_contained<T>(&self, what: &str, value: T) {
        self.panics.drop_value(what, value);
    }

    /// Drops keys the purgatory holds no more, with no lock held, each drop
    /// contained.
    pub(crate) fn drop_keys(&self, keys: impl IntoIterator<Item = K>) {
        self.panics.drop_each("drop of a key", keys);
    }

    /// Drops what was taken out of the watcher map, with no lock held. The
    /// entries removed were tombstones, or are about to be (cancelled).
    /// Leaves `removed` empty, its buffers kept.
    pub(crate) fn drop_removed(&self, removed: &mut Removed<K, Arc<OpCell<K, O>>>) {
        let n = removed.entries.len();
        if n > 0 {
            self.books.tombstones_changed(-(n as i64));
        }
        self.panics.drop_each(
            "drop of a finished operation's cell",
            removed.entries.drain(..),
        );
        self.drop_keys(removed.keys.drain(..));
    }

    /// Counts a finished operation; its `keys` list entries are now tombstones.
    pub(crate) fn on_finished(&self, fate: Fate, keys: u32) {
        if self.max_pending.is_some() {
            self.admitted.0.fetch_sub(1, Ordering::AcqRel);
        }
        self.books.finished(fate);
        if self.draining.load(Ordering::SeqCst) {
            self.drained.notify_waiters();
        }
        tracing::trace!(purgatory = &*self.name, ?fate, "operation finished");
        if keys > 0 {
            self.books.tombstones_changed(i64::from(keys));
        }
        // No purge here: this runs on the reaper too, and a purge walks every
        // list. Registration and key walks purge instead (Kafka's places).
    }

    /// Kafka's `purgeInterval`, made amortised O(1) and incremental. A purge
    /// starts once tombstones exceed both the interval and the live entries (so
    /// it removes at least half of what it walks), and goes on in slices of at
    /// most [`SWEEP_SLICE`] entries, one slice per call, until it has visited
    /// every key: no call stalls for a pass over every list (with Kafka's
    /// semantics three lists hold every pending operation, and one pass took
    /// milliseconds, which delayed the reaper on the same runtime). Called on
    /// registration, key walks and cancellation by key, never on the reaper.
    /// A call that finds another thread on the purge goes on without waiting.
    pub(crate) fn maybe_purge(&self) {
        let purge = &self.purge.0;
        if !purge.sweeping.load(Ordering::Acquire) {
            let tomb = self.books.tombstones();
            if tomb <= self.purge_interval {
                return;
            }
            // Live entries are all entries but the tombstones.
            if tomb.saturating_mul(2) <= self.watchers.len() {
                return;
            }
        }
        let mut sweep = match purge.sweep.try_lock() {
            Ok(sweep) => sweep,
            // No code that can panic runs under this lock; recover anyway.
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            // Another thread is on the purge.
            Err(TryLockError::WouldBlock) => return,
        };
        // Room for a whole slice before the lists are locked: growing the
        // buffer entry by entry would allocate several times per slice, on
        // every registration while a purge is under way.
        let mut buffers = self.take_buffers();
        let removed = &mut buffers.removed;
        removed.entries.reserve(SWEEP_SLICE);
        let state = sweep.get_or_insert_with(|| self.watchers.start_sweep());
        self.watchers
            .sweep(state, SWEEP_SLICE, |c| c.is_finished(), removed);
        let done = state.is_done();
        if done {
            *sweep = None;
        }
        purge.sweeping.store(!done, Ordering::Release);
        drop(sweep);
        let purged = removed.entries.len();
        purge.purged.fetch_add(purged as u64, Ordering::Relaxed);
        self.drop_removed(removed);
        self.keep_buffers(buffers);
        tracing::trace!(
            purgatory = &*self.name,
            removed = purged,
            done,
            "purged a slice of finished operations"
        );
    }

    /// Closes the timer and empties the watch lists; returns the operations taken.
    /// Empties the lists even when the timer was closed already, so that entries a
    /// registration racing the close left behind do not outlive the purgatory.
    pub(crate) fn close(&self, fate: Fate) -> Vec<O> {
        let jobs = self.core.close(Closed::Shutdown).unwrap_or_default();
        let mut ops = Vec::with_capacity(jobs.len());
        for Expiry(cell) in jobs {
            ops.extend(cell.cancel(OperationError::Shutdown, fate));
        }
        // Operations still registering are in lists but not yet in the timer.
        let mut removed = Removed::default();
        self.watchers.drain(&mut removed);
        for cell in &removed.entries {
            ops.extend(cell.cancel(OperationError::Shutdown, fate));
        }
        self.drop_removed(&mut removed);
        ops
    }
}

#[cfg(all(test, not(purgatory_loom)))]
mod tests {
    use super::{Books, Fate};

    #[test]
    fn tombstones_are_counted_once_and_a_dip_reads_as_none() {
        let b = Books::default();
        b.tombstones_changed(3); // a three-key operation finished
        assert_eq!(b.tombstones(), 3);
        b.tombstones_changed(-2); // two removed by walks
        assert_eq!(b.tombstones(), 1);
        b.tombstones_changed(-2); // removed by a cancel just before its finish is counted
        assert_eq!(b.tombstones(), 0, "a dip reads as none");
        b.tombstones_changed(2); // the finish of that two-key operation
        assert_eq!(b.tombstones(), 1);
    }

    #[test]
    fn registered_and_pending_follow_from_admissions_and_fates() {
        let b = Books::default();
        for _ in 0..5 {
            b.admitted();
        }
        b.turned_back();
        b.finished(Fate::Completed);
        b.finished(Fate::Expired);
        let t = b.totals();
        assert_eq!((t.registered, t.delayed), (4, 2));
        assert_eq!(
            (t.completed, t.expired, t.cancelled, t.handed_back),
            (1, 1, 0, 0)
        );
    }
}
