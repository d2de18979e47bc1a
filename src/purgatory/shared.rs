//! What every purgatory handle and operation cell share: the timer core, the
//! watcher map, the books, the purge, the kept buffers, and how closing works.

use std::any::Any;
use std::borrow::Borrow;
use std::hash::Hash;
use std::marker::PhantomData;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, TryLockError, Weak};
use std::time::Duration;

use tokio::time::Instant;

use super::books::{Books, Fate};
use super::cell::{Checked, Innermost, Marked, Op, OpCell};
use super::error::{OperationError, WatchError};
use super::keys::Watches;
use super::operation::Operation;
use super::slab::{Id, Slab};
use super::state::Handed;
use super::WatchErrorKind;
use super::WatchKey;
use super::{ChecksMetrics, PurgatoryMetrics, WalkMetrics};
use crate::contain::Panics;
use crate::core::{Closed, Core, Job, Refused, TimerKey};
use crate::histogram::Histogram;
use crate::sync::{thread_index, Padded, Striped};
use crate::watchers::{KeyHasher, Removed, Sweep, Watchers};

/// Tombstones an expiry or cancellation leaves before it starts a purge of
/// a map where some operation is still pending (see [`Shared::tidy`]): a
/// purge lists the keys shard by shard, so it waits for this many.
const TIDY_FLOOR: usize = 16;

/// The most watch-list entries one call visits for the purge.
const SWEEP_SLICE: usize = 128;

/// Entries purged at once by an expiry or cancellation that leaves as many
/// tombstones as live entries (see [`Shared::tidy`]): a map that small is
/// purged whole.
const SMALL_LISTS: usize = 1024;
/// Slices a tidy, or a reaper turn going on with an idle purge, does at most:
/// [`SMALL_LISTS`] entries' worth, and a few more for keys whose lists are
/// only levels.
const TIDY_SLICES: usize = SMALL_LISTS / SWEEP_SLICE + 9;
/// Live cells a walk brings in (reads once, each) before it checks them.
const WARM: usize = 64;

/// What the purgatory lends its timer core: itself, once built.
pub(crate) type Lent<K, O> = OnceLock<Weak<Shared<K, O>>>;

/// The purgatory's timer core.
pub(crate) type PurgatoryCore<K, O> = Core<Expiry<K, O>, Lent<K, O>>;

/// The timer job of an operation: the id of its cell (not a reference: a
/// finished operation's entry acquires nothing).
pub(crate) struct Expiry<K: WatchKey, O: Operation>(pub(crate) Id, PhantomData<fn() -> (K, O)>);

impl<K: WatchKey, O: Operation> Expiry<K, O> {
    pub(crate) fn new(id: Id) -> Self {
        Expiry(id, PhantomData)
    }
}

impl<K: WatchKey, O: Operation> Job for Expiry<K, O> {
    const KIND: &'static str = "purgatory";
    /// The purgatory, lent to the core once it is built.
    type Ctx = Lent<K, O>;

    fn after_turn(ctx: &Self::Ctx, emptied: bool) -> bool {
        ctx.get().and_then(Weak::upgrade).is_some_and(|shared| {
            if emptied && !shared.purge_left_to_reaper() {
                // Completions (by reference, or by walks whose last slice
                // left the purge part-way) may have left it with nothing
                // pending while the reaper had an alarm set: they do not
                // look then, and this turn, which that alarm brought, does.
                // A purge this starts does this turn's part.
                shared.tidy();
                return shared.purge_left_to_reaper();
            }
            shared.continue_purge()
        })
    }

    fn after_idle(ctx: &Self::Ctx) {
        // A completion that found the turn still under way did not look;
        // its count is seen here.
        if let Some(shared) = ctx.get().and_then(Weak::upgrade) {
            shared.tidy();
        }
    }

    fn after_reaper_gone(ctx: &Self::Ctx) {
        // A purge left to the reaper's turns: the purgatory is closed now,
        // and tidy purges the whole map.
        if let Some(shared) = ctx.get().and_then(Weak::upgrade) {
            shared.tidy();
        }
    }

    fn expire(self, ctx: &Self::Ctx, late: Option<Duration>) -> bool {
        match ctx.get().and_then(Weak::upgrade) {
            Some(shared) => {
                // No reference needed: the claim names the use by its generation.
                let expired = shared.op(self.0).expire(late);
                shared.tidy();
                expired
            }
            None => false,
        }
    }

    fn abandon(self, ctx: &Self::Ctx, why: Closed) {
        // Dropped unrun: the purgatory itself is gone, or its reaper is.
        if let Some(shared) = ctx.get().and_then(Weak::upgrade) {
            if let Some(Some(op)) =
                shared.with_op(self.0, |op| op.cancel(why.into(), Fate::Cancelled))
            {
                shared.drop_contained("drop of an operation", op);
            }
            // As after any cancellation: the last one purges the lists, which
            // nothing else would once the reaper is gone.
            shared.tidy();
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

/// Why [`Shared::admit`] turned a registration away.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Refusal {
    NoKeys,
    Closed(Closed),
    AtCapacity,
    Draining,
}

impl Refusal {
    /// The error that hands `op` back.
    pub(crate) fn with<O>(self, op: O) -> WatchError<O> {
        match self {
            Refusal::NoKeys => WatchError::NoKeys(op),
            Refusal::Closed(why) => closed_refusal(op, why),
            Refusal::AtCapacity => WatchError::AtCapacity(op),
            Refusal::Draining => WatchError::Draining(op),
        }
    }
}

/// What one slice of the purge did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slice {
    /// Another thread is on the purge.
    Busy,
    /// The pass goes on (`began`: with this slice).
    Going { began: bool },
    /// The pass ended with this slice (`began`: the pass it began).
    Done { began: bool },
}

/// A purge under way (`maybe_purge`), a flag to skip its lock when none is,
/// and the entries purged so far.
#[derive(Debug)]
struct Purge {
    /// The purge under way, or the last one, done (its room kept).
    sweep: Mutex<Sweep>,
    sweeping: AtomicBool,
    /// The purge goes on in the reaper's turns (see [`Shared::tidy`]).
    reaper_rest: AtomicBool,
    /// Another hand-over to the reaper came while it had the purge: the
    /// tombstones it saw may lie in lists the pass under way has visited.
    rest_again: AtomicBool,
    /// The pass under way began after the latest hand-over (the reaper's
    /// own, carried from turn to turn).
    rest_began: AtomicBool,
    purged: AtomicU64,
}

/// State shared by the purgatory handles and every operation's handle and
/// `OpRef`. Aligned so that the `Arc`'s reference count, which every new
/// handle bumps, has a cache line to itself instead of sharing one with the
/// fields every call reads.
#[repr(align(128))]
pub(crate) struct Shared<K: WatchKey, O: Operation> {
    core: Arc<PurgatoryCore<K, O>>,
    /// The operations' cells.
    cells: Slab<OpCell<O>>,
    watchers: Watchers<K, Id>,
    books: Books,
    /// The purge under way, on cache lines of its own: the thread purging
    /// writes it on every slice, and the threads completing operations read
    /// the fields around it on every finish.
    purge: Padded<Purge>,
    purge_interval: usize,
    /// Panics caught in the purgatory's user code.
    panics: Panics,
    name: Arc<str>,
    /// Buffers kept between walks and purge slices, one set per thread stripe.
    buffers: Striped<Mutex<Buffers<K, O>>>,
    /// Checks asked for by walks and by reference, per kind, per thread stripe.
    walks: Striped<[WalkStripe; 3]>,
    /// Levels handed from advances to the re-runs they asked for.
    handed: Handed<Id>,
    /// The lateness (ns) of expiries the reaper left to a running check, for
    /// that check to record if it expires the operation.
    late: Handed<Id>,
}

/// What walks of one kind did on one stripe (see [`WalkMetrics`]). A check by
/// reference counts one of `walks` (it did not complete) or `completed`, so
/// it costs one read-modify-write; its walks are their sum.
#[derive(Debug, Default)]
struct WalkStripe {
    walks: AtomicU64,
    checked: AtomicU64,
    completed: AtomicU64,
}

/// The kinds of walk counted apart in [`ChecksMetrics`].
#[derive(Debug, Clone, Copy)]
pub(crate) enum WalkKind {
    /// `try_complete_watched`.
    Key = 0,
    /// `try_complete_reached`.
    Level = 1,
    /// `OpRef::try_complete`.
    Reference = 2,
}

/// What a walk or a purge slice fills while it holds a list's lock: the live
/// cells copied out and the entries taken out. Kept between calls (see
/// [`Shared::take_buffers`]) so that those calls neither allocate nor grow a
/// buffer under the lock: an allocation there could wait on the allocator's
/// own lock (which another thread takes to free what this one allocated), and
/// every thread wanting the list would wait behind it.
struct Buffers<K: WatchKey, O: Operation> {
    live: Vec<Id>,
    removed: Removed<K, Id>,
    _ops: PhantomData<fn() -> O>,
}

impl<K: WatchKey, O: Operation> Default for Buffers<K, O> {
    fn default() -> Self {
        Buffers {
            live: Vec::new(),
            removed: Removed::default(),
            _ops: PhantomData,
        }
    }
}

/// The most bytes a kept buffer may hold room for (1,024 cell ids): a
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
        core: Arc<PurgatoryCore<K, O>>,
        watcher_shards: usize,
        purge_interval: usize,
        max_pending: Option<usize>,
        name: Arc<str>,
        hasher: KeyHasher,
    ) -> Self {
        Shared {
            core,
            cells: Slab::new(),
            watchers: Watchers::new(watcher_shards, hasher),
            books: Books::new(max_pending),
            purge: Padded(Purge {
                sweep: Mutex::new(Sweep::idle()),
                sweeping: AtomicBool::new(false),
                reaper_rest: AtomicBool::new(false),
                rest_again: AtomicBool::new(false),
                rest_began: AtomicBool::new(false),
                purged: AtomicU64::new(0),
            }),
            purge_interval,
            panics: Panics::new("purgatory", name.clone()),
            name,
            buffers: Striped::default(),
            walks: Striped::default(),
            handed: Handed::default(),
            late: Handed::default(),
        }
    }

    /// Lends the purgatory to its timer core, for the expiries it runs.
    pub(crate) fn lend_to_core(self: &Arc<Self>) {
        let set = self.core.ctx.set(Arc::downgrade(self));
        debug_assert!(set.is_ok(), "lent once");
    }

    /// The operations' cells.
    pub(crate) fn cells(&self) -> &Slab<OpCell<O>> {
        &self.cells
    }

    /// The operation `id` names, for a caller holding a reference to it, or
    /// for the calls of [`Op`] that need none.
    pub(crate) fn op(&self, id: Id) -> Op<'_, K, O> {
        let (life, cell) = self.cells.entry(id);
        Op {
            shared: self,
            id,
            cell,
            life,
        }
    }

    /// Runs `f` on the operation `id` names, holding a reference to it for the
    /// while; `None` when it has finished (or its cell moved on).
    pub(crate) fn with_op<R>(&self, id: Id, f: impl FnOnce(Op<'_, K, O>) -> R) -> Option<R> {
        /// Lets go of the reference however `f` ends (a waker's `wake` may
        /// panic, for one).
        struct Held<'a, K: WatchKey, O: Operation>(&'a Shared<K, O>, Id);
        impl<K: WatchKey, O: Operation> Drop for Held<'_, K, O> {
            fn drop(&mut self) {
                self.0.release(self.1);
            }
        }
        let op = self.op(id);
        if !op.life.acquire(Slab::<OpCell<O>>::generation(id)) {
            return None;
        }
        let _held = Held(self, id);
        Some(f(op))
    }

    /// Drops a reference to `id`'s cell; the last one to a finished
    /// operation's cell frees it (anything it still held is dropped here, with
    /// no lock held, contained).
    pub(crate) fn release(&self, id: Id) {
        self.cells.release(id, |cell| {
            let (out, waker) = cell.clear();
            if let Some(out) = out {
                self.drop_contained("drop of an output", out);
            }
            // Contained: a panic here would leave the cell off the free list.
            if let Some(waker) = waker {
                self.drop_contained("drop of a waker", waker);
            }
        });
    }

    /// A cell for a registration under `keys` keys, its check owned by
    /// thread `me`, with one reference (the caller's); `None` when the slab
    /// is full. The operation stays with the caller until its second check
    /// ([`settle`](Self::settle)).
    pub(crate) fn insert(&self, keys: u32, me: u64) -> Option<Id> {
        let (id, ()) = self
            .cells
            .insert((), |cell, ()| cell.start(keys, me))
            .ok()?;
        Some(id)
    }

    /// Counts a walk of `kind` that asked `checked` operations to check and
    /// completed `completed` of them.
    pub(crate) fn count_walk(&self, kind: WalkKind, checked: usize, completed: usize) {
        let w = &self.walks.mine()[kind as usize];
        if matches!(kind, WalkKind::Reference) {
            // One walk of one operation: its checks are its walks, and it
            // counts as completed or not (see `walk_metrics`).
            debug_assert!(checked == 1 && completed <= 1, "one check by reference");
            let counter = if completed > 0 {
                &w.completed
            } else {
                &w.walks
            };
            counter.fetch_add(1, Ordering::Relaxed);
            return;
        }
        w.walks.fetch_add(1, Ordering::Relaxed);
        if checked > 0 {
            w.checked.fetch_add(checked as u64, Ordering::Relaxed);
        }
        if completed > 0 {
            w.completed.fetch_add(completed as u64, Ordering::Relaxed);
        }
    }

    fn walk_metrics(&self, kind: WalkKind) -> WalkMetrics {
        let mut m = WalkMetrics::default();
        for stripe in self.walks.iter() {
            let w = &stripe[kind as usize];
            m.walks += w.walks.load(Ordering::Relaxed);
            m.checked += w.checked.load(Ordering::Relaxed);
            m.completed += w.completed.load(Ordering::Relaxed);
        }
        if matches!(kind, WalkKind::Reference) {
            m.walks += m.completed;
            m.checked = m.walks;
        }
        m
    }

    fn buffer_slot(&self) -> &Mutex<Buffers<K, O>> {
        self.buffers.mine()
    }

    /// Empty buffers for a walk or a purge slice: this thread stripe's kept
    /// ones, or new ones when they are in use (another thread of the stripe,
    /// or a walk re-entered from an operation's check).
    fn take_buffers(&self) -> Buffers<K, O> {
        match self.buffer_slot().try_lock() {
            Ok(mut kept) => std::mem::take(&mut *kept),
            Err(_) => Buffers::default(),
        }
    }

    /// Keeps `buffers` (emptied by the caller) for the next call on this
    /// thread stripe, each unless it grew past [`KEEP_BUFFER_BYTES`]. Whatever
    /// is not kept is freed after the lock is released (empty buffers: no user
    /// code).
    fn keep_buffers(&self, mut buffers: Buffers<K, O>) {
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

    /// Takes a registration in (counted in the books), or says why not: no
    /// keys, the purgatory is closed, at its limit, or draining. The caller
    /// keeps the operation and the keys either way (nothing is moved here),
    /// and on a refusal drops the keys and hands the operation back.
    pub(crate) fn admit(&self, keys: &Watches<K>) -> Result<(), Refusal> {
        if keys.is_empty() {
            Err(Refusal::NoKeys)
        } else if let Some(why) = self.core.closed() {
            Err(Refusal::Closed(why))
        } else if !self.books.admit() {
            Err(Refusal::AtCapacity)
        } else if self.books.turn_back_if_draining() {
            self.books.wake_drainers(&self.panics);
            Err(Refusal::Draining)
        } else {
            Ok(())
        }
    }

    /// Turns back a registration admitted and then refused (the slab is full).
    pub(crate) fn refuse_admitted(&self) {
        if self.books.unadmit() {
            self.books.wake_drainers(&self.panics);
        }
    }

    /// A registration's first check, before anything is watched; a panic in
    /// it is contained (and counts as "not yet").
    pub(crate) fn first_check(&self, op: &mut O) -> Option<O::Output> {
        // Not the check of an operation this thread checks: an event its
        // check raises on one of those asks for a re-run (see `Innermost`).
        let outer = Innermost::enter(self);
        let out = catch_unwind(AssertUnwindSafe(|| op.try_complete()));
        Innermost::leave(outer);
        match out {
            Ok(out) => out,
            Err(panic) => {
                self.panics.caught("try_complete", panic);
                None
            }
        }
    }

    /// Watches `id`'s cell under `keys`. When a key's code panics part-way,
    /// undoes the registration and hands the panic back: the entries made
    /// are tombstones and the registration is turned back (not counted as
    /// registered); the caller then drops the operation and the keys, each
    /// drop contained, and lets the panic go on.
    pub(crate) fn watch(&self, id: Id, keys: &Watches<K>) -> Result<(), Box<dyn Any + Send>> {
        let mut added = 0;
        let mut spare = Vec::new();
        let watched = catch_unwind(AssertUnwindSafe(|| {
            // The keys' `Eq` and `Clone` (see `walk`).
            let _marked = Innermost::mark(self);
            self.watchers
                .watch(keys.keys.iter(), &id, &mut added, &mut spare);
            self.watchers.watch_levels(
                keys.levels.iter().map(|(h, k, l)| (*h, k, *l)),
                &id,
                &mut added,
                &mut spare,
            );
        }));
        self.drop_keys(spare);
        if let Err(panic) = watched {
            self.op(id).abandon_registration();
            self.books.tombstones_changed(added as i64);
            if self.books.unadmit() {
                self.books.wake_drainers(&self.panics);
            }
            return Err(panic);
        }
        Ok(())
    }

    /// The end of a registration of `op`, its cell watched and its check
    /// owned by `me`: checks again, and arms the timeout of an operation
    /// still pending. Returns whether that check completed it (its outcome
    /// is delivered to its cell). Hands the operation back when a shutdown
    /// took it meanwhile.
    pub(crate) fn settle(
        &self,
        id: Id,
        op: O,
        me: u64,
        now: Instant,
        deadline: Instant,
    ) -> Result<bool, (O, Closed)> {
        let cell = self.op(id);
        match cell.first_watched_check(me, op) {
            Checked::Completed => Ok(true),
            Checked::Expired => Ok(false),
            Checked::Cancelled(op) => match self.core.closed() {
                // A shutdown took the entries meanwhile: hand the operation back.
                Some(why) => {
                    cell.finish(Err(why.into()), Fate::HandedBack, true);
                    Err((op, why))
                }
                None => {
                    // Cancelled by key meanwhile (its call could not tidy
                    // while this registration held the operation). Counted
                    // out before its drop runs, as any cancel is.
                    cell.finish(Err(OperationError::Cancelled), Fate::Cancelled, true);
                    self.drop_contained("drop of an operation", op);
                    self.tidy();
                    Ok(false)
                }
            },
            Checked::Pending => match self.core.insert(now, deadline, Expiry::new(id)) {
                Ok(key) => {
                    cell.set_timer(key);
                    Ok(false)
                }
                Err(Refused::Closed(_, why)) => {
                    // A shutdown ran during registration. If it did not take the
                    // operation, hand it back here.
                    match cell.cancel(why.into(), Fate::HandedBack) {
                        Some(op) => Err((op, why)),
                        None => Ok(false),
                    }
                }
                Err(Refused::AtCapacity(_)) => unreachable!("the purgatory's timer has no limit"),
            },
        }
    }

    /// Operations registered and not finished.
    pub(crate) fn delayed(&self) -> usize {
        self.books.delayed_now()
    }

    /// Stops taking operations (at once) and waits until none is pending.
    pub(crate) fn drain(&self) -> super::books::Drain<'_> {
        self.books.drain(&self.panics)
    }

    pub(crate) fn is_draining(&self) -> bool {
        self.books.is_draining()
    }

    /// Drops a user value (an operation, an output, a key) with no lock held,
    /// containing and counting a panic in its `Drop`.
    pub(crate) fn drop_contained<T>(&self, what: &str, value: T) {
        let _marked = self.mark_drops_of::<T>();
        self.panics.drop_value(what, value);
    }

    /// Marks what runs until the guard goes as not the check of an
    /// operation this thread may be checking, when dropping a `T` runs code:
    /// an event a user value's `Drop` raises on that operation asks for a
    /// re-run (see `Innermost`). Values with no drop code need no mark.
    #[inline(always)]
    fn mark_drops_of<T>(&self) -> Option<Marked> {
        std::mem::needs_drop::<T>().then(|| Innermost::mark(self))
    }

    /// Drops keys the purgatory holds no more, with no lock held, each drop
    /// contained. A key's `Drop` is not the check of an operation this thread
    /// checks (if any; the keys may be dropped by a walk, a cancellation or a
    /// registration that check made): an event it raises on that operation
    /// asks for a re-run (see `Innermost`). Keys with no drop code need no
    /// such mark.
    pub(crate) fn drop_keys(&self, keys: impl IntoIterator<Item = K>) {
        let _marked = self.mark_drops_of::<K>();
        self.panics.drop_each("drop of a key", keys);
    }

    /// Drops what was taken out of the watcher map, with no lock held. The
    /// entries removed were tombstones, or are about to be (cancelled).
    /// Leaves `removed` empty, its buffers kept.
    fn drop_removed(&self, removed: &mut Removed<K, Id>) {
        let n = removed.entries.len();
        if n > 0 {
            self.books.tombstones_changed(-(n as i64));
        }
        removed.entries.clear();
        self.drop_keys(removed.keys.drain(..));
    }

    /// An operation's fate is decided: its room under the pending limit is
    /// free (see [`Op::decide`](super::cell::Op::decide)).
    #[inline]
    pub(crate) fn free_room(&self) {
        self.books.free_room();
    }

    /// Counts a finished operation; its `keys` list entries are now tombstones.
    pub(crate) fn on_finished(&self, fate: Fate, keys: u32) {
        if self.books.finished(fate, keys) {
            self.books.wake_drainers(&self.panics);
        }
        crate::contain::quietly(|| {
            tracing::trace!(
                kind = "purgatory",
                name = &*self.name,
                ?fate,
                "operation finished"
            );
        });
        // Expiries and cancellations tidy after this; registrations and walks
        // purge (Kafka's places); a completion looks once it has delivered
        // its outcome (`after_completion`).
    }

    /// After a completion whose `keys` list entries became tombstones (counted
    /// by [`on_finished`](Self::on_finished)) delivered its outcome: looks
    /// only when the reaper sleeps with nothing scheduled (one load), since
    /// the completion may have left the purgatory with nothing pending and no
    /// turn will come to look. The tombstones were counted by a `SeqCst`
    /// read-modify-write before this `SeqCst` load, so a turn ending
    /// meanwhile sees them instead (`Job::after_idle`).
    pub(crate) fn after_completion(&self, keys: u32) {
        if keys > 0 && self.core.sleeps_with_nothing() {
            self.tidy();
        }
    }

    /// Whether a purge is left to the reaper's turns.
    fn purge_left_to_reaper(&self) -> bool {
        // `SeqCst`, as every access of it (see `leave_purge_to_reaper`).
        self.purge.0.reaper_rest.load(Ordering::SeqCst)
    }

    /// `key`'s hash by the watcher map's hasher (for a registration's keys).
    pub(crate) fn hash_key(&self, key: &K) -> u64 {
        // Key code, not the check of an operation this thread may be
        // checking (see `Innermost`).
        let _marked = Innermost::mark(self);
        self.watchers.hash(key)
    }

    /// The purgatory's name, for reports.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// Levels handed from advances to the re-runs they asked for.
    pub(crate) fn handed(&self) -> &Handed<Id> {
        &self.handed
    }

    /// The lateness of expiries left to running checks.
    pub(crate) fn late(&self) -> &Handed<Id> {
        &self.late
    }

    /// An expiry left to a running check, `late` after its deadline, which
    /// that check carried out.
    pub(crate) fn expired_later(&self, late: Duration) {
        self.core.expired_later(late);
    }

    /// Where panics in this purgatory's user code are counted and reported.
    pub(crate) fn panics(&self) -> &Panics {
        &self.panics
    }

    /// Whether the timer core is closed (shut down, or its reaper gone).
    pub(crate) fn is_closed(&self) -> bool {
        self.core.closed().is_some()
    }

    /// Why the timer core closed, if it did.
    pub(crate) fn closed(&self) -> Option<Closed> {
        self.core.closed()
    }

    /// Removes an operation's timer entry (its job, an id, is dropped here).
    pub(crate) fn remove_timer(&self, key: TimerKey) {
        let _ = self.core.remove(key);
    }

    /// Removes a finished operation's timer entry soon, in a batch (see
    /// [`Core::remove_soon`]); the entry's job would find the operation
    /// finished anyway.
    pub(crate) fn remove_timer_soon(&self, key: TimerKey) {
        self.core.remove_soon(key);
    }

    /// Moves an operation's timer entry to `deadline`; its new key, or `None`
    /// when the entry already left the wheel.
    pub(crate) fn reset_timer(
        &self,
        key: TimerKey,
        now: Instant,
        deadline: Instant,
    ) -> Option<TimerKey> {
        self.core.reset(key, now, deadline)
    }

    /// Watch-list entries, tombstones included.
    pub(crate) fn watched(&self) -> usize {
        self.watchers.len()
    }

    /// A snapshot of the counters (see [`Purgatory::metrics`](super::Purgatory::metrics)).
    pub(crate) fn metrics(&self) -> PurgatoryMetrics {
        let t = self.books.totals();
        PurgatoryMetrics {
            watched: self.watched(),
            tombstones: self.books.tombstones(),
            delayed: t.delayed,
            keys: self.watchers.keys(),
            cells: self.cells.capacity(),
            registered: t.registered,
            completed: t.completed,
            expired: t.expired,
            cancelled: t.cancelled,
            handed_back: t.handed_back,
            purged: self.purge.0.purged.load(Ordering::Relaxed),
            // With those the reaper caught around expiries (the metrics
            // recorder's, say).
            panicked: self.panics.count() + self.core.panics.count(),
            reaper_wakeups: self.core.wakeups(),
            checks: ChecksMetrics {
                key_walks: self.walk_metrics(WalkKind::Key),
                level_advances: self.walk_metrics(WalkKind::Level),
                by_reference: self.walk_metrics(WalkKind::Reference),
            },
            reaper: self.core.counters.reaper(),
            refused: self.books.refusals(),
        }
    }

    /// Counts a registration refused for `why`.
    pub(crate) fn count_refusal(&self, why: WatchErrorKind) {
        self.books.refused(why);
    }

    /// Reports the snapshot through the `metrics` facade (see
    /// [`Purgatory::record_metrics`](super::Purgatory::record_metrics)).
    #[cfg(feature = "metrics")]
    pub(crate) fn record_metrics(&self) {
        let m = self.metrics();
        let l = self.core.labels();
        l.gauge("tokio_purgatory_delayed", m.delayed as f64);
        l.gauge("tokio_purgatory_watched", m.watched as f64);
        l.gauge("tokio_purgatory_tombstones", m.tombstones as f64);
        l.gauge("tokio_purgatory_keys", m.keys as f64);
        l.gauge("tokio_purgatory_cells", m.cells as f64);
        l.counter("tokio_purgatory_registered_total", m.registered);
        l.counter("tokio_purgatory_completed_total", m.completed);
        l.counter("tokio_purgatory_expired_total", m.expired);
        l.counter("tokio_purgatory_cancelled_total", m.cancelled);
        l.counter("tokio_purgatory_handed_back_total", m.handed_back);
        l.counter("tokio_purgatory_purged_total", m.purged);
        l.counter("tokio_purgatory_panicked_total", m.panicked);
        l.refused(&m.refused.by_reason());
        for (walk, w) in [
            ("key", m.checks.key_walks),
            ("level", m.checks.level_advances),
            ("reference", m.checks.by_reference),
        ] {
            l.walk_counter("tokio_purgatory_walks_total", walk, w.walks);
            l.walk_counter("tokio_purgatory_checks_total", walk, w.checked);
            l.walk_counter("tokio_purgatory_checks_completed_total", walk, w.completed);
        }
        l.reaper(&m.reaper, m.reaper_wakeups);
    }

    /// How late expiries fired (see [`Purgatory::lateness`](super::Purgatory::lateness)).
    pub(crate) fn lateness(&self) -> Histogram {
        self.core.counters.lateness.snapshot()
    }

    /// Timer entries held (for tests).
    #[cfg(all(test, not(purgatory_loom)))]
    pub(crate) fn timers(&self) -> usize {
        self.core.len()
    }

    /// A walk of `key` (Kafka's `checkAndComplete`): checks the operations
    /// watching it (plain watches, and with `reached` those at a level at most
    /// `reached`) with no lock held, completes those that can be, and returns
    /// how many this call completed. The key is hashed once: a plain walk that
    /// completed at least a quarter of what it checked prunes the list at once,
    /// finding it by the same hash (otherwise the finished entries are
    /// tombstones the key's next walk drops anyway, and a second full walk per
    /// event would double the cost of hot keys). A panic in the key's `Hash`
    /// or `Eq` before the checks reaches the caller, nothing changed; one in
    /// the prune after them is contained.
    pub(crate) fn walk<Q>(&self, key: &Q, reached: Option<u64>) -> usize
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let kind = if reached.is_some() {
            WalkKind::Level
        } else {
            WalkKind::Key
        };
        if self.is_closed() {
            // Shut down, or being shut down: what is still watched is the
            // shutdown's to finish (a walk from a waker it wakes included).
            // Still a walk, of nothing.
            self.count_walk(kind, 0, 0);
            return 0;
        }
        // The key's `Hash` and `Eq` are not the check of an operation this
        // thread may be checking (see `Innermost`).
        let marked = Innermost::mark(self);
        let key = self.watchers.probe(key);
        let mut buffers = self.take_buffers();
        let cells = &self.cells;
        self.watchers.collect_live(
            &key,
            reached,
            &mut buffers.live,
            |id| cells.is_over(*id),
            &mut buffers.removed,
        );
        drop(marked);
        self.drop_removed(&mut buffers.removed);
        let checked = buffers.live.len();
        // A check takes no reference: beginning it names the use by its
        // generation (an operation finished meanwhile is not checked), and
        // the check keeps the cell until it ends.
        let me = thread_index();
        let mut completed = 0;
        for chunk in buffers.live.chunks(WARM) {
            // Read every live cell of the chunk once before checking any:
            // plain loads, which the processor overlaps, bring the cells in
            // together, where the checks' read-modify-writes would take each
            // cache miss one after another. Each cell is found once.
            let mut ops: [Option<Op<'_, K, O>>; WARM] = [None; WARM];
            for (op, id) in ops.iter_mut().zip(chunk) {
                let found = self.op(*id);
                found.cell.warm();
                *op = Some(found);
            }
            completed += ops
                .iter()
                .flatten()
                .filter(|op| op.check_reached(me, reached))
                .count();
        }
        self.count_walk(kind, checked, completed);
        buffers.live.clear();
        // An advance's completions sit among the level entries it put back one
        // level up: they go too, when few enough to look at.
        if completed > 0 && (reached.is_some() || completed * 4 >= checked) {
            // Room for every entry the walk completed, before the list is locked.
            buffers.removed.entries.reserve(completed);
            let pruned = catch_unwind(AssertUnwindSafe(|| {
                // The key's `Eq` again (see above).
                let _marked = Innermost::mark(self);
                match reached {
                    None => {
                        self.watchers
                            .prune(&key, |id| cells.is_over(*id), &mut buffers.removed)
                    }
                    Some(_) => self.watchers.prune_reached(
                        &key,
                        completed,
                        |id| cells.is_over(*id),
                        &mut buffers.removed,
                    ),
                }
            }));
            if let Err(panic) = pruned {
                self.panics.caught("eq of a key", panic);
            }
            self.drop_removed(&mut buffers.removed);
        }
        self.keep_buffers(buffers);
        self.maybe_purge();
        completed
    }

    /// Takes `key` and its whole list out (Kafka's `cancelForKey`), cancels
    /// every operation this call takes, and hands them back.
    pub(crate) fn cancel_for_key<Q>(&self, key: &Q) -> Vec<O>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        if self.is_closed() {
            // As for a walk: the shutdown finishes what is still watched.
            return Vec::new();
        }
        let mut removed = Removed::default();
        {
            // The key's `Hash` and `Eq` (see `walk`).
            let _marked = Innermost::mark(self);
            self.watchers.take(key, &mut removed);
        }
        let ops = removed
            .entries
            .iter()
            .filter_map(|id| {
                self.with_op(*id, |op| {
                    op.cancel(OperationError::Cancelled, Fate::Cancelled)
                })
                .flatten()
            })
            .collect();
        self.drop_removed(&mut removed);
        // The operations' other keys now hold tombstones: as after any
        // cancellation, a purge at once when they are as many as the live
        // entries, or nothing is left pending.
        self.tidy();
        self.maybe_purge();
        ops
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
        self.purge_slice(false);
    }

    /// After an operation expired or was cancelled through its handle or an
    /// `OpRef`: once tombstones are at least as many as live entries (and at
    /// least [`TIDY_FLOOR`], or every entry is one), a purge starts at once,
    /// whatever the interval, so that the keys nobody watches any more leave
    /// the map now rather than at the next walk of each key or once
    /// tombstones pass the interval. It removes at least as many entries as
    /// it keeps, so its cost stays proportional to what it removes.
    ///
    /// A small map (at most [`SMALL_LISTS`] entries) is purged whole here.
    /// A larger one is marked for the purge, which the slices of later
    /// registrations and walks carry out, so that this call (often the
    /// reaper's) never lists every key; and since no such call may follow
    /// (a purgatory gone quiet), the reaper's turns carry it too, a bounded
    /// part each ([`continue_purge`](Self::continue_purge)). Once nothing is
    /// pending, this call starts the pass and does that bounded part itself
    /// (the pass notes the keys' hashes a shard at a time, as it reaches
    /// each), and the reaper's turns the rest; a closed purgatory, whose
    /// reaper serves it no more, is purged whole here (a larger one with
    /// something pending only marked). The check sums the stripes of both
    /// counts.
    pub(crate) fn tidy(&self) {
        // Tombstones first: a removal lowers the entry count before the
        // tombstone count, so the entries read after count every removal
        // the tombstones read saw (and any other only lowers them, which
        // errs toward a purge). Read the other way round, a walk's prune
        // between the two reads made a purgatory with nothing pending look
        // busy to the reaper's last look (see `WakeTarget::sleeps_with_nothing`).
        let tombstones = self.books.tombstones();
        let entries = self.watchers.len();
        if entries == 0 {
            return;
        }
        let idle = tombstones >= entries;
        let half = tombstones >= TIDY_FLOOR && tombstones.saturating_mul(2) >= entries;
        if !idle && !half {
            return;
        }
        let closed = self.core.closed().is_some();
        if !idle && entries > SMALL_LISTS {
            self.purge.0.sweeping.store(true, Ordering::Release);
            if !closed {
                self.leave_purge_to_reaper();
            }
            return;
        }
        if idle && closed {
            // No reaper turn will take the rest, and a thread on a slice now
            // may be in a pass that visited these keys before their
            // operations finished: wait for it (it runs no user code under
            // the purge's lock), then purge the whole map.
            self.purge_slices(usize::MAX, true);
            return;
        }
        if !self.purge_slices(TIDY_SLICES, false) && idle {
            self.leave_purge_to_reaper();
        }
    }

    /// Leaves the rest of the purge to the reaper's turns: work due now for
    /// its core, notified once. A reaper that has the purge already (it is
    /// notified, or in a turn that goes on with it) is told that this
    /// call's tombstones may lie in lists its pass has visited, and goes on
    /// until a pass that began after them ends. The flag is set before the
    /// purge is claimed, both `SeqCst`, and the reaper gives the purge up
    /// before it reads the flag (`give_purge_back`): either this call finds
    /// the purge given up and notifies, or the reaper sees the flag. Called
    /// by every expiry and cancellation while tombstones are as many as live
    /// entries on a large map: one that finds the flag set and the purge
    /// the reaper's (each read after the reaper's last write of it) writes
    /// nothing.
    fn leave_purge_to_reaper(&self) {
        let purge = &self.purge.0;
        if !purge.rest_again.load(Ordering::SeqCst) {
            purge.rest_again.store(true, Ordering::SeqCst);
        }
        if !purge.reaper_rest.load(Ordering::SeqCst)
            && !purge.reaper_rest.swap(true, Ordering::SeqCst)
        {
            self.core.poke();
        }
    }

    /// Up to `slices` slices of the purge (another thread on the purge ends
    /// this, unless `wait`: then this waits for its slice); returns whether a
    /// pass ended that covers every list. A pass this call did not begin may
    /// have visited some keys before their operations finished, and would
    /// not look at them again: when it ends here, one more begins, so that
    /// the map is purged whole.
    fn purge_slices(&self, slices: usize, wait: bool) -> bool {
        let mut began = false;
        for _ in 0..slices {
            match self.purge_slice(wait) {
                Slice::Busy => return false,
                Slice::Going { began: b } => began |= b,
                Slice::Done { began: b } if began || b => return true,
                Slice::Done { .. } => {}
            }
        }
        false
    }

    /// At the end of a reaper turn: goes on with the purge [`tidy`](Self::tidy)
    /// left to the reaper, the same bounded part per turn, until a pass that
    /// began after the latest hand-over ends (a pass under way then may have
    /// visited lists before their tombstones came: when it ends, one more
    /// begins, as long as tombstones are still as many as live entries).
    /// Returns whether more is left now (the reaper takes another turn at
    /// once, after letting other tasks run); the reaper keeps the purge only
    /// then. When another thread is on a slice, with nothing pending the
    /// reaper's next turn comes at once; with operations pending it gives
    /// the purge back to the registrations and walks that go on with it,
    /// and to the next expiry or cancellation that finds tombstones as many
    /// as live entries (which hands it over again). A completion hands an idle purge over only when the reaper
    /// sleeps with nothing scheduled (see `after_completion`); otherwise the
    /// first turn that finds the wheels emptied calls [`tidy`](Self::tidy)
    /// for it (see `Job::after_turn` and `Job::after_idle`).
    pub(crate) fn continue_purge(&self) -> bool {
        let purge = &self.purge.0;
        if !purge.reaper_rest.load(Ordering::SeqCst) {
            return false;
        }
        // Only the reaper's turns write `rest_began` while it has the purge.
        let mut began = purge.rest_began.load(Ordering::Relaxed);
        if purge.rest_again.swap(false, Ordering::SeqCst) {
            began = false;
            self.see_hand_overs();
        }
        for _ in 0..TIDY_SLICES {
            if self.watchers.len() == 0 {
                return self.give_purge_back();
            }
            match self.purge_slice(false) {
                Slice::Busy => {
                    // Tombstones first, as in `tidy`.
                    let tombstones = self.books.tombstones();
                    if tombstones >= self.watchers.len() {
                        // Nothing pending: no other call will go on with it.
                        purge.rest_began.store(began, Ordering::Relaxed);
                        return true;
                    }
                    // Never kept without a turn to come: a purge the reaper
                    // has is not handed to it again (no notification).
                    return self.give_purge_back();
                }
                Slice::Going { began: b } => began |= b,
                Slice::Done { began: b } if began || b => return self.give_purge_back(),
                Slice::Done { .. } => {
                    let tombstones = self.books.tombstones();
                    let entries = self.watchers.len();
                    if tombstones == 0 || tombstones.saturating_mul(2) < entries {
                        return self.give_purge_back();
                    }
                    // One more pass, begun by the next slice.
                }
            }
        }
        purge.rest_began.store(began, Ordering::Relaxed);
        true
    }

    /// The reaper is done with the purge left to it: gives it up, unless a
    /// hand-over came meanwhile (see `leave_purge_to_reaper`); then takes it
    /// back for a pass that begins now. Returns whether it did.
    fn give_purge_back(&self) -> bool {
        let purge = &self.purge.0;
        purge.rest_began.store(false, Ordering::Relaxed);
        purge.reaper_rest.store(false, Ordering::SeqCst);
        // A hand-over that found the purge still the reaper's did not notify.
        let again = purge.rest_again.swap(false, Ordering::SeqCst)
            && !purge.reaper_rest.swap(true, Ordering::SeqCst);
        if again {
            self.see_hand_overs();
        }
        again
    }

    /// After the reaper read the flag of hand-overs (`rest_again`), which may
    /// have written nothing (see `leave_purge_to_reaper`): reads the
    /// tombstone counts, `SeqCst` read-modify-writes each hand-over made
    /// before, so that the pass that follows sees their operations finished
    /// (a read of the flags alone orders them, but does not carry what the
    /// finishing threads wrote before).
    fn see_hand_overs(&self) {
        std::hint::black_box(self.books.tombstones());
    }

    /// One slice of the purge, starting a pass if none is under way.
    /// Gives up at once when another thread is on a slice, unless `wait`.
    fn purge_slice(&self, wait: bool) -> Slice {
        let purge = &self.purge.0;
        let mut sweep = if wait {
            // The purge's own (std) mutex, as below: not one loom models.
            purge.sweep.lock().unwrap_or_else(|p| p.into_inner())
        } else {
            match purge.sweep.try_lock() {
                Ok(sweep) => sweep,
                // No code that can panic runs under this lock; recover anyway.
                Err(TryLockError::Poisoned(p)) => p.into_inner(),
                // Another thread is on the purge.
                Err(TryLockError::WouldBlock) => return Slice::Busy,
            }
        };
        // Room for a whole slice before the lists are locked: growing the
        // buffer entry by entry would allocate several times per slice, on
        // every registration while a purge is under way.
        let mut buffers = self.take_buffers();
        let removed = &mut buffers.removed;
        removed.entries.reserve(SWEEP_SLICE);
        let began = sweep.is_done();
        if began {
            self.watchers.restart_sweep(&mut sweep);
        }
        let cells = &self.cells;
        self.watchers
            .sweep(&mut sweep, SWEEP_SLICE, |id| cells.is_over(*id), removed);
        let done = sweep.is_done();
        if done {
            sweep.trim();
        }
        purge.sweeping.store(!done, Ordering::Release);
        drop(sweep);
        let purged = removed.entries.len();
        purge.purged.fetch_add(purged as u64, Ordering::Relaxed);
        self.drop_removed(removed);
        self.keep_buffers(buffers);
        crate::contain::quietly(|| {
            tracing::trace!(
                kind = "purgatory",
                name = &*self.name,
                removed = purged,
                done,
                "purged a slice of finished operations"
            );
        });
        if done {
            Slice::Done { began }
        } else {
            Slice::Going { began }
        }
    }

    /// Closes the timer and empties the watch lists; returns the operations taken.
    /// When the last handle goes (`fate` is `Cancelled`), empties the lists even
    /// if the timer was closed already, so that entries a registration racing
    /// the close left behind do not outlive the purgatory (such a registration
    /// also tidies them itself). A second `shutdown()` takes nothing: the call
    /// that closed the timer hands back every pending operation.
    pub(crate) fn close(&self, fate: Fate) -> Vec<O> {
        let jobs = match self.core.close(Closed::Shutdown) {
            Some(jobs) => jobs,
            // Shut down already, by another call, which hands back every
            // pending operation (it may be at it still): a second
            // `shutdown()` takes none of them. When the last handle goes
            // (`Cancelled`), no other call can be at work, and what the
            // lists still hold goes.
            None if fate == Fate::HandedBack => return Vec::new(),
            None => Vec::new(),
        };
        // Handles learn why: a shutdown, or the reaper lost before it (the
        // last handle dropped while the lost reaper's jobs were abandoned).
        let why = match self.core.closed() {
            Some(Closed::ReaperGone) => OperationError::ReaperGone,
            _ => OperationError::Shutdown,
        };
        let mut ops = Vec::with_capacity(jobs.len());
        let mut cancel = |id: Id| {
            if let Some(Some(op)) = self.with_op(id, |op| op.cancel(why, fate)) {
                ops.push(op);
            }
        };
        for Expiry(id, _) in jobs {
            cancel(id);
        }
        // Operations still registering are in lists but not yet in the timer.
        let mut removed = Removed::default();
        self.watchers.drain(&mut removed);
        for id in &removed.entries {
            cancel(*id);
        }
        self.drop_removed(&mut removed);
        ops
    }
}
