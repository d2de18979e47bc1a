//! The per-operation cell: the state machine, the operation, and where its
//! outcome goes.
//!
//! # Ground rules
//!
//! Who may touch what, and under which lock:
//!
//! - **The life word** (lock-free, `state.rs`, in the slab's dense array of
//!   life words for the cell's page): decides who owns the operation at each
//!   moment. Only the owner of `CHECKING` touches `op` to check it; only
//!   whoever sets `FINISHED` takes `op` out (or, for a registration whose
//!   second check completes it, drops the operation it still holds) and calls
//!   [`Op::finish`]. So the operation finishes exactly once.
//! - **`op`**: empty until the registration's second check says "not yet"
//!   (that check runs on the operation the registration still holds, with no
//!   lock); the registration puts it in before it lets go of `CHECKING`. Its
//!   mutex is held while an owner runs `try_complete` on it (by design: it is
//!   what serialises checks with taking the operation out), and for the moment
//!   it takes to move the operation in or out. No other user code runs under
//!   it, and the operation is always dropped after the guard is gone.
//! - **The outcome slot** ([`Delivery`]): a short lock around the outcome and
//!   the waker, taken only while a handle may read them (a delivery to a
//!   detached handle takes none). No user code runs under it: outcomes and
//!   wakers are moved out, and dropped or woken after it is released.
//! - **The timer key** ([`TimerSlot`]): lock-free. The registration records it
//!   unless the finish came first, and the finish takes it for good, so
//!   exactly one of them removes the entry. A reset moves it under the outcome
//!   slot's lock (resets wait for each other, as two resets must both take
//!   effect), taking it out while it moves.
//! - **Drops.** Every user value this cell drops (the operation, an outcome nobody
//!   will read) is dropped inside `catch_unwind` with no lock held, after the
//!   state says `FINISHED`; a panic there is counted and reported, and the outcome is
//!   still delivered.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::task::Waker;
use std::time::Duration;

use super::books::Fate;
use super::error::OperationError;
use super::operation::{Completion, Operation};
use super::shared::Shared;
use super::slab::{FreeLink, Id};
use super::state::{AfterNotYet, Begin, Claim, Life, Owner, CANCEL, EXPIRE};
use super::WatchKey;
use crate::core::TimerKey;
use crate::sync::{lock, thread_index, touch, AtomicU16, AtomicU64, AtomicU8, Mutex};

/// What an operation handle resolves to.
pub(crate) type Outcome<T> = Result<Completion<T>, OperationError>;

/// Where an outcome waits for its handle: a one-slot mailbox with a waker.
/// Loom checks it (`loom_delivery`).
///
/// `state` says what the slot holds and whether the handle is gone, so that
/// the calls that usually find nothing to do (a handle detached before its
/// outcome, a cell set up again for a new operation or freed) do it without
/// taking the lock. A view: the cell keeps `state` among its small words
/// ([`Owner`]), where it takes no room of its own, and the slot after the
/// operation.
#[derive(Debug)]
pub(crate) struct Delivery<'a, T> {
    state: &'a AtomicU8,
    slot: &'a Mutex<Slot<T>>,
}

/// The outcome slot a [`Delivery`] guards.
#[derive(Debug)]
pub(crate) struct Slot<T> {
    result: Option<T>,
    waker: Option<Waker>,
}

impl<T> Default for Slot<T> {
    fn default() -> Self {
        Slot {
            result: None,
            waker: None,
        }
    }
}

/// Nobody will ever read an outcome: don't keep one.
const DETACHED: u8 = 1;
/// An outcome is stored.
const FULL: u8 = 2;
/// A waker is stored.
const WAITING: u8 = 4;

/// What [`Delivery::deliver`] leaves the caller to do once the lock is gone.
#[derive(Debug)]
pub(crate) struct Delivered<T> {
    /// The task to wake.
    pub(crate) waker: Option<Waker>,
    /// The outcome, back because nobody will read it: drop it.
    pub(crate) unread: Option<T>,
}

impl<'a, T> Delivery<'a, T> {
    pub(crate) fn new(state: &'a AtomicU8, slot: &'a Mutex<Slot<T>>) -> Self {
        Delivery { state, slot }
    }

    /// Makes the slot ready for a new use of its cell (nothing else reaches
    /// it). The slot is empty: a freed cell's was emptied by [`take_all`](Self::take_all).
    pub(crate) fn restart(&self) {
        self.state.store(0, Ordering::Release);
    }

    /// Stores the outcome for the handle, or hands it back when the handle is
    /// gone; takes the waker either way. A handle detached before the outcome
    /// took what the slot held (a detach sets `DETACHED` before it looks), and
    /// nothing is stored for it after: its outcome comes back with no lock taken.
    pub(crate) fn deliver(&self, result: T) -> Delivered<T> {
        if self.state.load(Ordering::Acquire) & (DETACHED | WAITING) == DETACHED {
            return Delivered {
                waker: None,
                unread: Some(result),
            };
        }
        let mut s = lock(self.slot);
        let waker = s.waker.take();
        if waker.is_some() {
            self.state.fetch_and(!WAITING, Ordering::AcqRel);
        }
        let mut unread = Some(result);
        if self.state.load(Ordering::Acquire) & DETACHED == 0 {
            s.result = unread.take();
            // Stored unless the handle went meanwhile: a detach that sees
            // `FULL` takes the outcome (under this lock, after us); one that
            // came first makes this fail, and the outcome is handed back.
            let stored = self
                .state
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |st| {
                    (st & DETACHED == 0).then_some(st | FULL)
                })
                .is_ok();
            if !stored {
                unread = s.result.take();
            }
        }
        Delivered { waker, unread }
    }

    /// Whether an outcome is stored, for the handle to take without waiting.
    pub(crate) fn is_full(&self) -> bool {
        self.state.load(Ordering::Acquire) & FULL != 0
    }

    /// Takes the outcome, or registers `waker` to be woken when there is one.
    /// Also returns a waker the slot holds no more (a clone that was not
    /// needed, or the one `waker` replaced), for the caller to drop contained:
    /// a waker's `Drop` may be user code, and a panic in it must not lose the
    /// outcome taken here.
    pub(crate) fn poll(&self, waker: &Waker) -> (Option<T>, Option<Waker>) {
        // A waker's `clone` may be user code (a waker built from a raw
        // vtable), so it is cloned with no lock held: before the lock, unless
        // an outcome is already there to take.
        let mut fresh = (self.state.load(Ordering::Acquire) & FULL == 0).then(|| waker.clone());
        loop {
            let mut s = lock(self.slot);
            if let Some(r) = s.result.take() {
                self.state.fetch_and(!FULL, Ordering::AcqRel);
                return (Some(r), fresh);
            }
            if s.waker.as_ref().is_some_and(|w| w.will_wake(waker)) {
                return (None, fresh);
            }
            let Some(new) = fresh.take() else {
                // (Not reached: polls of one handle never overlap, so an
                // outcome seen before the lock is still there.)
                drop(s);
                fresh = Some(waker.clone());
                continue;
            };
            let old = s.waker.replace(new);
            self.state.fetch_or(WAITING, Ordering::AcqRel);
            return (None, old);
        }
    }

    /// Nobody will read the outcome: returns any stored one (and the waker) to be
    /// dropped, and makes later deliveries hand theirs back.
    pub(crate) fn detach(&self) -> (Option<T>, Option<Waker>) {
        let before = self.state.fetch_or(DETACHED, Ordering::AcqRel);
        if before & (FULL | WAITING) == 0 {
            return (None, None);
        }
        self.take_all()
    }

    /// Takes whatever the slot holds (the cell is being freed, or its handle
    /// detached): nothing to take unless `state` says so.
    pub(crate) fn take_all(&self) -> (Option<T>, Option<Waker>) {
        if self.state.load(Ordering::Acquire) & (FULL | WAITING) == 0 {
            return (None, None);
        }
        let mut s = lock(self.slot);
        self.state.fetch_and(!(FULL | WAITING), Ordering::AcqRel);
        (s.result.take(), s.waker.take())
    }

    /// Holds off other resets while `f` runs (see [`TimerSlot::move_with`]).
    pub(crate) fn serialise<R>(&self, f: impl FnOnce() -> R) -> R {
        let _resets = lock(self.slot);
        f()
    }
}

/// The key of the operation's timer entry, kept in two atomics: a word and
/// the shard's number (among the owner's small words, where it takes no room
/// of its own). A view, as [`Delivery`] is. Loom checks it (`loom_timer_slot`).
///
/// The word holds a key, or [`NO_TIMER`] (none recorded yet, or a reset is
/// moving it), or [`TIMER_TAKEN`] (the finish took it; nothing is recorded
/// after). The shard is written only by whoever is about to put a key in the
/// word, and read only by whoever took one out.
#[derive(Debug)]
pub(crate) struct TimerSlot<'a> {
    word: &'a AtomicU64,
    shard: &'a AtomicU16,
}

/// No key in the word: none recorded yet, or a reset is moving it. A key's
/// word never has index `u32::MAX`.
pub(crate) const NO_TIMER: u64 = u32::MAX as u64;
/// The finish took the key: none may be recorded from now on.
const TIMER_TAKEN: u64 = NO_TIMER | 1 << 32;

impl<'a> TimerSlot<'a> {
    #[inline]
    pub(crate) fn new(word: &'a AtomicU64, shard: &'a AtomicU16) -> Self {
        TimerSlot { word, shard }
    }

    /// Makes the slot ready for a new use of its cell (nothing else reaches it).
    #[inline]
    pub(crate) fn restart(&self) {
        self.word.store(NO_TIMER, Ordering::Relaxed);
    }

    /// Records `key` (the registration's entry), unless the finish came first:
    /// then the key comes back, for the caller to remove.
    #[inline]
    pub(crate) fn set(&self, key: TimerKey) -> Result<(), TimerKey> {
        let (bits, shard) = key.to_bits();
        self.shard.store(shard, Ordering::Relaxed);
        self.word
            .compare_exchange(NO_TIMER, bits, Ordering::Release, Ordering::Relaxed)
            .map(drop)
            .map_err(|_| key)
    }

    /// Takes the key for the finish, for good: a registration or a reset that
    /// comes later removes its entry itself. `None` when no key is recorded
    /// (not yet, or a reset holds it: that one removes the entry).
    #[inline]
    pub(crate) fn take_final(&self) -> Option<TimerKey> {
        let bits = self.word.swap(TIMER_TAKEN, Ordering::Acquire);
        TimerKey::from_bits(bits, self.shard.load(Ordering::Relaxed))
    }

    /// Moves the entry with `move_entry` (given its key, returning the new key,
    /// in the same shard, or `None` when the entry has left the timer), holding
    /// the key out of the word meanwhile; the caller keeps other moves off
    /// ([`Delivery::serialise`]). A finish that comes meanwhile finds no key,
    /// so the new entry is removed here, with `remove`. Returns whether the
    /// entry was moved: `false` when the finish took the key first, or the
    /// entry had left the timer (its expiry is under way). A finish after the
    /// move (the moved entry's own expiry, when its deadline has passed, or a
    /// completion or cancel) does not undo it: `true`.
    pub(crate) fn move_with(
        &self,
        move_entry: impl FnOnce(TimerKey) -> Option<TimerKey>,
        remove: impl FnOnce(TimerKey),
    ) -> bool {
        let bits = self.word.load(Ordering::Acquire);
        let Some(key) = TimerKey::from_bits(bits, self.shard.load(Ordering::Relaxed)) else {
            return false;
        };
        if self
            .word
            .compare_exchange(bits, NO_TIMER, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            return false; // the finish took it
        }
        let Some(moved) = move_entry(key) else {
            return false;
        };
        if let Err(moved) = self.set(moved) {
            // The finish came meanwhile and found no key: the moved entry
            // goes (if it is still there; a deadline already past may have
            // fired it, which is what finished the operation). The move took
            // effect all the same.
            remove(moved);
        }
        true
    }
}

/// How a run of checks by the owner of `CHECKING` ended.
#[derive(Debug)]
pub(crate) enum Checked<O> {
    /// A check completed the operation (finished and delivered).
    Completed,
    /// Every check said "not yet"; the operation is released, still pending.
    Pending,
    /// The timeout fired meanwhile; the operation expired (finished and delivered).
    Expired,
    /// A cancel arrived meanwhile: the caller now owns the operation
    /// (`FINISHED`), holds the finisher's reference, and must finish it
    /// ([`Op::finish`], which lets go of that reference).
    Cancelled(O),
}

/// One registered operation: its state, the operation, and where its outcome
/// goes. Cells live in the purgatory's slab ([`Slab`](super::slab::Slab)) and
/// are reused; [`Op`] is a cell together with the purgatory and the [`Id`] of
/// its current use, held while a reference to it is.
///
/// In this order (`repr(C)`): what every check and finish touches first (the
/// owner's words, the operation's lock and the start of the operation),
/// then the outcome slot. Not aligned to cache lines: the padding would cost
/// more memory (a quarter of a cell with a small operation) than the lines a
/// cell straddles cost time.
#[repr(C)]
pub(crate) struct OpCell<O: Operation> {
    /// Who checks it, how it finished, how many lists hold it (its state is
    /// in its [`Life`]).
    owner: Owner,
    /// The timer entry's key word (its shard is among the owner's words).
    timer: AtomicU64,
    op: Mutex<Option<O>>,
    /// The outcome slot (its state is among the owner's words).
    slot: Mutex<Slot<Outcome<O::Output>>>,
}

impl<O: Operation> Default for OpCell<O> {
    fn default() -> Self {
        OpCell {
            owner: Owner::default(),
            timer: AtomicU64::new(NO_TIMER),
            op: Mutex::new(None),
            slot: Mutex::new(Slot::default()),
        }
    }
}

impl<O: Operation> FreeLink for OpCell<O> {
    fn free_link(&self) -> &crate::sync::AtomicU32 {
        self.owner.free_link()
    }
}

impl<O: Operation> std::fmt::Debug for OpCell<O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpCell")
            .field("keys", &self.owner.keys())
            .finish_non_exhaustive()
    }
}

impl<O: Operation> OpCell<O> {
    /// Sets up a free cell for a registration whose check thread `me` owns
    /// from the start: registration watches it under its keys, then runs its
    /// second check as that owner, so an event meanwhile only asks for that
    /// check to run again, and nothing can finish the operation before it is
    /// fully registered. Nothing else can reach the cell yet. The operation
    /// stays with the registration until its second check says "not yet"
    /// ([`Op::first_watched_check`]): the cell holds none until then.
    pub(crate) fn start(&self, keys: u32, me: u64) {
        self.delivery().restart();
        self.timer().restart();
        self.owner.restart(me, keys);
    }

    /// Reads the cell's small words, the operation's lock and the outcome
    /// slot's lock, which lies past the operation, with no reference held
    /// (whatever use the cell is in): plain loads, so that a check that
    /// follows finds the whole of a small operation in cache.
    pub(crate) fn warm(&self) {
        std::hint::black_box(self.owner.keys());
        touch(&self.op);
        touch(&self.slot);
    }

    /// Takes out what a cell being freed still holds in its outcome slot (an
    /// outcome nobody read, a waker), to be dropped by the caller with no lock
    /// held. Its operation was taken out when it finished.
    pub(crate) fn clear(&self) -> (Option<Outcome<O::Output>>, Option<Waker>) {
        self.delivery().take_all()
    }

    /// The outcome slot and its state.
    fn delivery(&self) -> Delivery<'_, Outcome<O::Output>> {
        Delivery::new(self.owner.outcome(), &self.slot)
    }

    /// The timer entry's key.
    fn timer(&self) -> TimerSlot<'_> {
        TimerSlot::new(&self.timer, self.owner.timer_shard())
    }
}

/// A cell, with the purgatory it belongs to, the [`Id`] of its use and its
/// [`Life`]: what the cell's methods need to count, deliver and free. Held
/// with a reference to the cell, except for [`check`](Op::check),
/// [`expire`](Op::expire) and [`cancel`](Op::cancel), which need none: they
/// name the use by its generation, and keep the cell while they work on it.
pub(crate) struct Op<'a, K: WatchKey, O: Operation> {
    pub(crate) shared: &'a Shared<K, O>,
    pub(crate) id: Id,
    pub(crate) cell: &'a OpCell<O>,
    pub(crate) life: &'a Life,
}

impl<K: WatchKey, O: Operation> Clone for Op<'_, K, O> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<K: WatchKey, O: Operation> Copy for Op<'_, K, O> {}

impl<K, O> Op<'_, K, O>
where
    K: WatchKey,
    O: Operation,
{
    pub(crate) fn is_finished(&self) -> bool {
        self.life.is_finished()
    }

    /// Whether the outcome is there for the handle to take: the operation
    /// finished and its finisher delivered (after dropping the operation or
    /// running its expiry, user code that takes as long as it takes).
    pub(crate) fn is_delivered(&self) -> bool {
        self.cell.delivery().is_full()
    }

    fn generation(&self) -> std::num::NonZeroU32 {
        super::slab::Slab::<OpCell<O>>::generation(self.id)
    }

    /// How the operation stands: `None` while pending, else its fate.
    pub(crate) fn fate(&self) -> Option<Fate> {
        if !self.life.is_finished() {
            return None;
        }
        loop {
            // Recorded right after `FINISHED` is set, before any user code
            // runs: a few instructions at most to wait here.
            if let Some(fate) = Fate::from_code(self.cell.owner.fate()) {
                return Some(fate);
            }
            std::hint::spin_loop();
        }
    }

    /// Runs `f` on the pending operation under its lock (the lock its checks
    /// hold: `f` never overlaps a check); `None` once it has finished, and
    /// when called from the operation's own check on the thread running it
    /// (which holds that lock: waiting for it would never end).
    pub(crate) fn update<R>(&self, f: impl FnOnce(&mut O) -> R) -> Option<R> {
        if self.life.is_finished() || self.life.is_checked_by(thread_index(), &self.cell.owner) {
            return None;
        }
        lock(&self.cell.op).as_mut().map(f)
    }

    /// Runs the operation's check, or asks the running checker to check again.
    /// Returns whether this call completed the operation. Needs no reference.
    pub(crate) fn check(&self) -> bool {
        self.check_as(thread_index())
    }

    /// [`check`](Self::check) by thread `me` (the caller's [`thread_index`]).
    pub(crate) fn check_as(&self, me: u64) -> bool {
        self.check_reached(me, None)
    }

    /// [`check_as`](Self::check_as) for a caller that says the key reached
    /// `reached` (`try_complete_reached`): the check is told it, and so is
    /// the re-run of a check running elsewhere that this call asks for (the
    /// level is handed over before the request is made).
    ///
    /// A walk runs this, [`run_checks`](Self::run_checks) and
    /// [`not_yet`](Self::not_yet) once per live watcher: they are inlined
    /// into it by force, since the compiler left them as three calls whose
    /// frames cost about 40 instructions per operation checked.
    #[inline(always)]
    pub(crate) fn check_reached(&self, me: u64, reached: Option<u64>) -> bool {
        let handed = self.shared.handed();
        let mut offered = false;
        let begun = self
            .life
            .begin_check_or_ask(self.generation(), me, &self.cell.owner, || {
                if let Some(level) = reached {
                    handed.offer(self.id, level);
                    offered = true;
                }
            });
        let reached = match begun {
            Begin::Asked => return false,
            Begin::Mine => return self.ask_from_inside(me, reached),
            Begin::Nothing => {
                // The use is over: no re-run will take what this call left.
                if offered {
                    handed.take(&self.id);
                }
                return false;
            }
            // This call checks after all: it takes what it left (and what
            // others left meanwhile, all for this check).
            Begin::Checking if offered => handed.take(&self.id).max(reached),
            Begin::Checking => reached,
        };
        match self.run_checks(me, reached) {
            Checked::Completed => true,
            Checked::Cancelled(op) => {
                // A cancel left for this check: by a shutdown or a lost reaper
                // when the purgatory is closed (which close is told, as the
                // operations it took are), else by key or by reference. The
                // close comes before its cancels, so it is seen here.
                let why = self
                    .shared
                    .closed()
                    .map_or(OperationError::Cancelled, OperationError::from);
                // Counted out (and its handle told) before its drop runs, as
                // a cancel that is not left to a check does.
                self.finish(Err(why), Fate::Cancelled, true);
                self.shared.drop_contained("drop of an operation", op);
                // As the cancel would have, had it not been left to this check.
                self.shared.tidy();
                false
            }
            Checked::Pending | Checked::Expired => false,
        }
    }

    /// A registration's second check, by `me`, the owner of `CHECKING` since
    /// the cell was taken, of `op`, which it still holds: the check runs with
    /// no lock (nothing else can reach `op`), and only an operation still
    /// pending goes into its cell, under one hold of its lock. Then as
    /// [`run_checks`](Self::run_checks).
    pub(crate) fn first_watched_check(&self, me: u64, op: O) -> Checked<O> {
        let outer = Innermost::enter(self.cell);
        let checked = self.first_watched_check_marked(me, op);
        Innermost::leave(outer);
        checked
    }

    fn first_watched_check_marked(&self, me: u64, mut op: O) -> Checked<O> {
        match catch_unwind(AssertUnwindSafe(|| op.try_complete())) {
            Ok(Some(output)) => return self.completed(Some(op), output),
            Ok(None) => {}
            Err(panic) => self.shared.panics().caught("try_complete", panic),
        }
        let stale = lock(&self.cell.op).replace(op);
        debug_assert!(stale.is_none(), "a freed cell holds no operation");
        match self.not_yet(me) {
            Some(checked) => checked,
            None => self.run_checks(me, self.shared.handed().take(&self.id)),
        }
    }

    /// A check by `me`, the owner of `CHECKING`, said "not yet": what follows,
    /// or `None` when it must check again.
    #[inline(always)]
    fn not_yet(&self, me: u64) -> Option<Checked<O>> {
        let cell = self.cell;
        Some(match self.life.end_check(me, &cell.owner) {
            AfterNotYet::Recheck => return None,
            AfterNotYet::Release => Checked::Pending,
            AfterNotYet::Cancel => {
                self.decide(Fate::Cancelled);
                // An expiry left meanwhile lost to the cancel, and a level
                // left for a re-run that will not happen.
                self.shared.late().take(&self.id);
                self.shared.handed().take(&self.id);
                Checked::Cancelled(self.take_op())
            }
            AfterNotYet::Expire => {
                self.decide(Fate::Expired);
                // A level left for a re-run that will not happen.
                self.shared.handed().take(&self.id);
                // The reaper left its lateness sample for this expiry with it.
                if let Some(nanos) = self.shared.late().take(&self.id) {
                    self.shared.expired_later(Duration::from_nanos(nanos));
                }
                self.run_expiry(self.take_op());
                // As the reaper would have, had the expiry not been left to
                // this check.
                self.shared.tidy();
                Checked::Expired
            }
        })
    }

    /// The owner's check said the operation is done: `FINISHED`, the
    /// operation (taken out) dropped, `output` delivered.
    fn completed(&self, op: Option<O>, output: O::Output) -> Checked<O> {
        let expiry_lost = self.life.complete(&self.cell.owner);
        // A level left for a re-run that will not happen, and the lateness of
        // an expiry left meanwhile that lost to the completion (looked for
        // only then: nothing else leaves one).
        self.shared.handed().take(&self.id);
        if expiry_lost {
            self.shared.late().take(&self.id);
        }
        self.decide(Fate::Completed);
        self.shared.drop_contained("drop of an operation", op);
        self.finish(Ok(Completion::Completed(output)), Fate::Completed, true);
        Checked::Completed
    }

    /// This thread runs the operation's check, and the event comes from code
    /// that check runs. The check's own call back into itself (walking its own
    /// key) is nothing new to it; code it runs that is not the check itself
    /// (another operation's check, expiry or drop, reached through a walk it
    /// made) may have found it ready after it read its state, and so asks for
    /// a re-run, told `reached`. Not while this thread runs a re-run asked so
    /// (see [`Innermost`]): that bounds what one event costs.
    #[cold]
    fn ask_from_inside(&self, me: u64, reached: Option<u64>) -> bool {
        if Innermost::is(self.cell) || Innermost::is_quiet() {
            return false;
        }
        let asked = self
            .life
            .ask_from_inside(self.generation(), me, &self.cell.owner);
        // The re-run is this thread's, after this call returns: the level
        // may follow the request.
        if let (true, Some(level)) = (asked, reached) {
            self.shared.handed().offer(self.id, level);
        }
        false
    }

    /// The check loop of `me`, the owner of `CHECKING`, told `reached` (the
    /// level of the advance that asked for the check, if one did). A re-run is
    /// told the level handed over by the advances that asked for it, or, when
    /// none did, the level the check before it was told.
    ///
    /// Marks the cell as the one checked innermost on this thread (see
    /// [`Innermost`]) until the loop ends, after what its end runs (the
    /// operation's drop, its expiry).
    #[inline(always)]
    pub(crate) fn run_checks(&self, me: u64, reached: Option<u64>) -> Checked<O> {
        // Each run of the loop marks the cell (`Innermost::rerun`).
        let outer = Innermost::current();
        let checked = self.check_loop(me, reached, outer);
        Innermost::leave(outer);
        checked
    }

    #[inline(always)]
    fn check_loop(&self, me: u64, mut reached: Option<u64>, outer: usize) -> Checked<O> {
        let cell = self.cell;
        loop {
            // Each run marks the cell as the innermost check; one asked from
            // inside the run before it (here, or before the registration's
            // check handed over to this loop) runs quiet.
            Innermost::rerun(cell, outer, cell.owner.is_rerun_here());
            let mut guard = lock(&cell.op);
            let op = guard.as_mut().expect("a checked operation is present");
            let out = catch_unwind(AssertUnwindSafe(|| match reached {
                Some(level) => op.try_complete_reached(level),
                None => op.try_complete(),
            }));
            // Completed: the operation comes out under the same hold of its
            // lock (the state is ours until `complete`, so nothing else takes it).
            let done = match &out {
                Ok(Some(_)) => guard.take(),
                _ => None,
            };
            drop(guard);
            match out {
                Ok(Some(output)) => return self.completed(done, output),
                Ok(None) => {}
                Err(panic) => self.shared.panics().caught("try_complete", panic),
            }
            if let Some(checked) = self.not_yet(me) {
                return checked;
            }
            if let Some(level) = self.shared.handed().take(&self.id) {
                reached = Some(level);
            }
        }
    }

    fn take_op(&self) -> O {
        lock(&self.cell.op)
            .take()
            .expect("the owner of a finished operation takes it once")
    }

    /// Abandons a registration whose key code panicked, as its owner (the
    /// registration still holds the operation): marks it finished without
    /// counting it. The caller still holds the registration's reference.
    pub(crate) fn abandon_registration(&self) {
        self.life.abandon(&self.cell.owner);
        self.shared.handed().take(&self.id);
        self.cell.owner.record_fate(Fate::HandedBack.code());
        drop(self.cell.delivery().detach());
        // The finisher's reference.
        self.shared.release(self.id);
    }

    /// Claims the operation (expiry or cancellation), taking it out, unless a
    /// check is running: then the request is left for the checker.
    fn claim(&self, request: u64, fate: Fate) -> Option<O> {
        self.won(self.life.claim(self.generation(), request), fate)
    }

    /// The operation's fate is decided, by the one call that set `FINISHED`,
    /// before any user code its finish runs (its `on_expiration`, the drop of
    /// the operation): the fate is recorded (`status` reads it from now on)
    /// and its room under the pending limit is free, so that code may
    /// register another operation in its place. What the books count as
    /// finished (and a drain waits for) comes later, in [`finish`](Self::finish).
    #[inline]
    pub(crate) fn decide(&self, fate: Fate) {
        self.cell.owner.record_fate(fate.code());
        self.shared.free_room();
    }

    /// The operation taken out for `fate` when `claim` won.
    fn won(&self, claim: Claim, fate: Fate) -> Option<O> {
        match claim {
            Claim::Won => {
                self.decide(fate);
                Some(self.take_op())
            }
            Claim::Deferred | Claim::Finished => None,
        }
    }

    /// The timeout fired `late` ago (on the reaper task, with no lock held).
    /// Returns whether this call expired it (a check running at that moment
    /// expires it instead, if it says "not yet", and records `late`, left
    /// for it here, as the reaper would have).
    pub(crate) fn expire(&self, late: Option<Duration>) -> bool {
        let nanos = late.map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
        let late = self.shared.late();
        let mut offered = false;
        let claim = self.life.claim_or_ask(self.generation(), EXPIRE, || {
            if let (Some(nanos), false) = (nanos, offered) {
                late.offer(self.id, nanos);
                offered = true;
            }
        });
        if offered && claim != Claim::Deferred {
            late.take(&self.id);
        }
        match self.won(claim, Fate::Expired) {
            Some(op) => {
                self.run_expiry(op);
                true
            }
            None => false,
        }
    }

    fn run_expiry(&self, op: O) {
        let out = match catch_unwind(AssertUnwindSafe(|| op.on_expiration())) {
            Ok(output) => Ok(Completion::Expired(output)),
            Err(panic) => {
                self.shared.panics().caught("on_expiration", panic);
                Err(OperationError::Panicked)
            }
        };
        // The timer entry is already gone: it is what called us, or the checker
        // that ran us was asked by it.
        self.finish(out, Fate::Expired, false);
    }

    /// Cancels the operation: it will neither complete nor expire. Returns it when
    /// this call took it (`why` is then delivered to the handle); `None` when it
    /// had finished, or a running check will finish it.
    pub(crate) fn cancel(&self, why: OperationError, fate: Fate) -> Option<O> {
        let op = self.claim(CANCEL, fate)?;
        self.finish(Err(why), fate, true);
        Some(op)
    }

    /// Counts the finished operation (`FINISHED` is set: its list entries are
    /// tombstones from now on), delivers its outcome and removes its timer
    /// entry when `cancel_timer`; then, with no lock held, drops an outcome
    /// nobody will read, wakes the handle, and lets go of the finisher's
    /// reference (which may free the cell: the caller uses it no more).
    pub(crate) fn finish(&self, result: Outcome<O::Output>, fate: Fate, cancel_timer: bool) {
        /// Lets go of the finisher's reference however this ends.
        struct Finisher<'a, K: WatchKey, O: Operation>(&'a Shared<K, O>, Id);
        impl<K: WatchKey, O: Operation> Drop for Finisher<'_, K, O> {
            fn drop(&mut self) {
                self.0.release(self.1);
            }
        }
        let _finisher = Finisher(self.shared, self.id);
        // The final word (a cancel deferred to a check was recorded as a plain
        // cancel, which it is counted as; shutdown's hand-back is told here).
        self.cell.owner.record_fate(fate.code());
        let keys = self.cell.owner.keys();
        self.shared.on_finished(fate, keys);
        let timer = self.cell.timer().take_final();
        let d = self.cell.delivery().deliver(result);
        if cancel_timer {
            if let Some(key) = timer {
                self.shared.remove_timer_soon(key);
            }
        }
        if let Some(unread) = d.unread {
            self.shared.drop_contained("drop of an output", unread);
        }
        if let Some(w) = d.waker {
            // User code, marked as not a check running further up this
            // thread (one that cancelled this operation, say), as
            // `drop_contained` marks what it drops (see `Innermost`).
            let _marked = Innermost::mark(self.shared);
            // A waker is user code (one built from a raw vtable): a `wake`
            // that panics is contained and counted, so that the walk, expiry
            // run or cancel that finished this operation goes on with the
            // others.
            self.shared.panics().run("wake of a handle", || w.wake());
        }
        if fate == Fate::Completed {
            // Once the outcome is out: the purge this may start does not
            // hold it up.
            self.shared.after_completion(keys);
        }
    }

    /// Moves the operation's timeout to `deadline` (`now` is the caller's
    /// reading of the clock); see [`OpRef::reset_at`](super::OpRef::reset_at).
    pub(crate) fn reset(&self, now: tokio::time::Instant, deadline: tokio::time::Instant) -> bool {
        if self.is_finished() || self.shared.is_closed() {
            return false;
        }
        let shared = self.shared;
        self.cell.delivery().serialise(|| {
            self.cell.timer().move_with(
                |key| shared.reset_timer(key, now, deadline),
                |moved| shared.remove_timer(moved),
            )
        })
    }

    /// Records the timer entry, or removes it at once if the operation finished
    /// while it was being inserted.
    pub(crate) fn set_timer(&self, key: TimerKey) {
        if let Err(key) = self.cell.timer().set(key) {
            self.shared.remove_timer(key);
        }
    }

    /// Takes the outcome, or registers `waker` to be woken when there is one.
    pub(crate) fn poll_outcome(&self, waker: &Waker) -> Option<Outcome<O::Output>> {
        let (outcome, spare) = self.cell.delivery().poll(waker);
        if let Some(spare) = spare {
            self.shared.drop_contained("drop of a waker", spare);
        }
        outcome
    }

    /// Nobody will read the outcome: drop any stored and don't store one later.
    pub(crate) fn detach(&self) {
        let (stale, waker) = self.cell.delivery().detach();
        if let Some(waker) = waker {
            self.shared.drop_contained("drop of a waker", waker);
        }
        if let Some(stale) = stale {
            self.shared.drop_contained("drop of an output", stale);
        }
    }
}

#[cfg(all(test, not(purgatory_loom)))]
mod tests {
    /// Events from other threads are told apart from the checker re-entering its
    /// own check by thread id: ids that collapsed to one value would drop them.
    #[test]
    fn every_thread_gets_its_own_checker_id() {
        let mine = crate::sync::thread_index();
        assert_ne!(mine, 0, "0 means no checker");
        assert_eq!(mine, crate::sync::thread_index(), "stable on one thread");
        let others: Vec<u64> = (0..4)
            .map(|_| {
                std::thread::spawn(crate::sync::thread_index)
                    .join()
                    .unwrap()
            })
            .collect();
        let mut all = others.clone();
        all.push(mine);
        all.sort();
        all.dedup();
        assert_eq!(all.len(), 5, "ids {others:?} and {mine}");
    }
}

#[cfg(all(test, purgatory_loom))]
mod loom_delivery {
    //! The handle's delivery under loom: an outcome delivered while the handle
    //! polls, or while it is dropped, is read exactly once or dropped exactly once,
    //! and a handle that registered a waker before the delivery is woken.

    use super::*;
    use loom::sync::atomic::{AtomicUsize, Ordering};
    use loom::thread;
    use std::sync::Arc;
    use std::task::Wake;

    struct Counter(AtomicUsize);

    impl Wake for Counter {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// An outcome that counts its drops.
    struct Value(Arc<AtomicUsize>);

    impl Drop for Value {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// What a cell keeps for its delivery: the state word and the slot.
    #[derive(Default)]
    struct Kept {
        state: AtomicU8,
        slot: Mutex<Slot<Value>>,
    }

    impl Kept {
        fn delivery(&self) -> Delivery<'_, Value> {
            Delivery::new(&self.state, &self.slot)
        }
    }

    /// The finisher's side: deliver, then (no lock) drop what came back and wake.
    fn finish(d: &Delivery<'_, Value>, v: Value) {
        let out = d.deliver(v);
        drop(out.unread);
        if let Some(w) = out.waker {
            w.wake();
        }
    }

    #[test]
    fn loom_delivery_racing_a_poll_is_read_or_woken() {
        loom::model(|| {
            let kept = Arc::new(Kept::default());
            let drops = Arc::new(AtomicUsize::new(0));
            let woken = Arc::new(Counter(AtomicUsize::new(0)));
            let waker = Waker::from(woken.clone());
            let t = {
                let (kept, drops) = (kept.clone(), drops.clone());
                thread::spawn(move || finish(&kept.delivery(), Value(drops)))
            };
            let d = kept.delivery();
            let first = d.poll(&waker).0;
            t.join().unwrap();
            match first {
                Some(v) => drop(v),
                None => {
                    // Pending at the first poll: the delivery came after the waker
                    // was registered, so the task was woken and the next poll reads.
                    assert_eq!(woken.0.load(Ordering::SeqCst), 1, "lost wake-up");
                    drop(d.poll(&waker).0.expect("delivered"));
                }
            }
            assert_eq!(drops.load(Ordering::SeqCst), 1);
        });
    }

    #[test]
    fn loom_delivery_racing_a_dropped_handle_is_freed_once() {
        loom::model(|| {
            let kept = Arc::new(Kept::default());
            let drops = Arc::new(AtomicUsize::new(0));
            let t = {
                let (kept, drops) = (kept.clone(), drops.clone());
                thread::spawn(move || finish(&kept.delivery(), Value(drops)))
            };
            let d = kept.delivery();
            // The handle goes away: whatever was stored comes back to be dropped.
            let (stale, _) = d.detach();
            drop(stale);
            t.join().unwrap();
            // Freed at once whichever came first, and exactly once; nothing is
            // left in the slot for the cell to keep.
            assert_eq!(drops.load(Ordering::SeqCst), 1);
            assert!(lock(&kept.slot).result.is_none());
        });
    }
}

#[cfg(all(test, purgatory_loom))]
mod loom_timer_slot {
    //! The timer key under loom: whatever order a registration recording it, a
    //! reset moving it and the finish taking it come in, the entry in the
    //! timer is removed exactly once, by whoever holds its current key.

    use super::*;
    use loom::thread;
    use std::sync::Arc;

    /// What a cell keeps for its timer key, and a stand-in for the timer: the
    /// words of the entries in it.
    #[derive(Default)]
    struct Kept {
        word: AtomicU64,
        shard: AtomicU16,
        resets: Mutex<()>,
        timer: Mutex<Vec<u64>>,
    }

    impl Kept {
        fn new() -> Arc<Kept> {
            let k = Kept::default();
            k.slot().restart();
            Arc::new(k)
        }

        /// A cell whose registration recorded its entry (key 7).
        fn armed() -> Arc<Kept> {
            let kept = Kept::new();
            let key = kept.insert(7);
            kept.slot().set(key).expect("nothing finished yet");
            kept
        }

        /// A reset to the key with `bits`, on a thread of its own.
        fn spawn_reset(self: &Arc<Kept>, bits: u64) -> thread::JoinHandle<bool> {
            let kept = self.clone();
            thread::spawn(move || kept.reset(bits))
        }

        /// The expiry of the entry with `bits`, on a thread of its own: the
        /// reaper takes the entry out of the timer (if it is still there),
        /// then the finish takes the key and removes nothing (the entry has
        /// left). Whether it fired.
        fn spawn_expiry(self: &Arc<Kept>, bits: u64) -> thread::JoinHandle<bool> {
            let kept = self.clone();
            thread::spawn(move || {
                let fired = kept.take(bits);
                if fired {
                    kept.slot().take_final();
                }
                fired
            })
        }

        fn slot(&self) -> TimerSlot<'_> {
            TimerSlot::new(&self.word, &self.shard)
        }

        fn key(bits: u64) -> TimerKey {
            TimerKey::from_bits(bits, 3).expect("a key")
        }

        /// Puts an entry in the timer; its key.
        fn insert(&self, bits: u64) -> TimerKey {
            lock(&self.timer).push(bits);
            Kept::key(bits)
        }

        /// Takes the entry with `bits` out of the timer, if it is there.
        fn take(&self, bits: u64) -> bool {
            let mut t = lock(&self.timer);
            let at = t.iter().position(|&b| b == bits);
            at.map(|at| t.swap_remove(at)).is_some()
        }

        /// Removes `key`'s entry, which must be there.
        fn remove(&self, key: TimerKey) {
            assert!(self.take(key.to_bits().0), "removes a current entry");
        }

        /// A finish: takes the key for good and removes its entry.
        fn finish(&self) {
            if let Some(key) = self.slot().take_final() {
                self.remove(key);
            }
        }

        /// A reset: moves the entry to the key with `bits`.
        fn reset(&self, bits: u64) -> bool {
            let _resets = lock(&self.resets);
            self.slot().move_with(
                |old| {
                    self.remove(old);
                    Some(self.insert(bits))
                },
                |moved| self.remove(moved),
            )
        }
    }

    #[test]
    fn loom_timer_key_recorded_racing_the_finish_is_removed_once() {
        loom::model(|| {
            let kept = Kept::new();
            let t = {
                let kept = kept.clone();
                thread::spawn(move || kept.finish())
            };
            let key = kept.insert(7);
            if let Err(key) = kept.slot().set(key) {
                kept.remove(key);
            }
            t.join().unwrap();
            assert!(lock(&kept.timer).is_empty(), "an entry left behind");
        });
    }

    #[test]
    fn loom_timer_key_moved_racing_the_finish_is_removed_once() {
        loom::model(|| {
            let kept = Kept::armed();
            let t = kept.spawn_reset(8);
            kept.finish();
            // Moved or not, depending on who came first: either way, no entry
            // is left and no later reset takes effect.
            t.join().unwrap();
            assert!(lock(&kept.timer).is_empty(), "an entry left behind");
            assert!(!kept.reset(9), "no reset after the finish");
        });
    }

    #[test]
    fn loom_timer_key_moved_racing_an_expiry_is_removed_once() {
        loom::model(|| {
            let kept = Kept::armed();
            // The expiry of the entry the registration recorded.
            let t = kept.spawn_expiry(7);
            // A reset that finds the entry gone leaves it to the expiry.
            let moved = {
                let _resets = lock(&kept.resets);
                kept.slot().move_with(
                    |old| kept.take(old.to_bits().0).then(|| kept.insert(8)),
                    |moved| kept.remove(moved),
                )
            };
            let fired = t.join().unwrap();
            assert!(moved != fired, "the entry either moved or fired");
            if !fired {
                kept.finish(); // the moved entry's job, cancelled instead
            }
            assert!(lock(&kept.timer).is_empty(), "an entry left behind");
        });
    }

    #[test]
    fn loom_a_reset_whose_moved_entry_fires_at_once_took_effect() {
        loom::model(|| {
            let kept = Kept::armed();
            // The expiry of the moved entry (its deadline already past).
            let t = kept.spawn_expiry(8);
            let moved = {
                let _resets = lock(&kept.resets);
                kept.slot().move_with(
                    |old| {
                        kept.remove(old);
                        Some(kept.insert(8))
                    },
                    // As the timer's own removal: nothing when it has fired.
                    |moved| {
                        kept.take(moved.to_bits().0);
                    },
                )
            };
            let fired = t.join().unwrap();
            assert!(moved, "the move took effect, whether or not it fired first");
            if !fired {
                kept.finish();
            }
            assert!(lock(&kept.timer).is_empty(), "an entry left behind");
        });
    }

    #[test]
    fn loom_two_resets_both_take_effect() {
        loom::model(|| {
            let kept = Kept::armed();
            let t = kept.spawn_reset(8);
            assert!(
                kept.reset(9),
                "a reset with nothing finished moves the entry"
            );
            assert!(t.join().unwrap(), "so does the other");
            assert_eq!(lock(&kept.timer).len(), 1, "one entry, at the last key");
            kept.finish();
            assert!(lock(&kept.timer).is_empty());
        });
    }
}

/// What runs innermost on this thread, for events on an operation this
/// thread checks: the cell whose check (with what its end runs: the
/// operation's drop, its expiry) or registration check runs innermost, and
/// whether a re-run asked from inside runs around it ("quiet"). One word,
/// the marked thing's address (a cell, or the purgatory for a registration's
/// check before its cell: both aligned to more than a byte) with the quiet
/// bit as its lowest; 0 when nothing runs.
///
/// An event on an operation this thread checks is the check's own doing
/// when that check is the innermost (it walked its own key: nothing new to
/// it); otherwise it comes from code the check ran (another operation's
/// check, expiry or drop), and asks for a re-run once the check ends. While
/// such a re-run runs, and whatever it runs, no such ask is made: one event
/// so re-runs each check it reaches on this thread at most once, and what
/// those re-runs reach not at all (checks that walk each other's keys every
/// time they run would otherwise re-run each other for ever, or at a cost
/// doubling with each one in a line).
pub(crate) struct Innermost;

/// What [`Innermost::mark`] began: puts the word back when dropped.
pub(crate) struct Marked(usize);

impl Drop for Marked {
    #[inline(always)]
    fn drop(&mut self) {
        Innermost::leave(self.0);
    }
}

thread_local! {
    static INNERMOST: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

impl Innermost {
    /// The word for `at`, quiet or not.
    #[inline(always)]
    fn word<T>(at: &T, quiet: bool) -> usize {
        debug_assert!(std::mem::align_of::<T>() > 1);
        std::ptr::from_ref(at).addr() | usize::from(quiet)
    }

    /// `at`'s check (or a registration's) begins on this thread, quiet if
    /// what it runs inside is; returns the word to put back.
    #[inline(always)]
    pub(crate) fn enter<T>(at: &T) -> usize {
        INNERMOST.with(|c| {
            let outer = c.get();
            c.set(Self::word(at, outer & 1 != 0));
            outer
        })
    }

    /// A run of `at`'s check begins (inside what `outer` marked), quiet if
    /// it is a re-run asked from inside or what it runs inside is quiet.
    #[inline(always)]
    fn rerun<T>(at: &T, outer: usize, asked_from_inside: bool) {
        INNERMOST.with(|c| c.set(Self::word(at, outer & 1 != 0 || asked_from_inside)));
    }

    /// The word now: what a check beginning runs inside.
    #[inline(always)]
    fn current() -> usize {
        INNERMOST.with(std::cell::Cell::get)
    }

    /// What [`enter`](Self::enter) began ended: `outer` again.
    #[inline(always)]
    pub(crate) fn leave(outer: usize) {
        INNERMOST.with(|c| c.set(outer));
    }

    /// Marks what runs until the guard goes (key code a call runs for the
    /// caller: `Hash`, `Eq`, `Clone`) as `at`'s, not the check of an
    /// operation this thread checks; the guard puts the word back, also
    /// when that code panics.
    #[inline(always)]
    pub(crate) fn mark<T>(at: &T) -> Marked {
        Marked(Self::enter(at))
    }

    /// Whether `at`'s check is the one running innermost on this thread.
    fn is<T>(at: &T) -> bool {
        INNERMOST.with(|c| c.get() & !1 == Self::word(at, false))
    }

    /// Whether a re-run asked from inside runs on this thread.
    fn is_quiet() -> bool {
        INNERMOST.with(|c| c.get() & 1 != 0)
    }
}
