//! A cell's life and the completion state machine of the operation in it, in
//! one word per cell ([`Life`]), on its own so that loom can check every
//! interleaving of it (`RUSTFLAGS="--cfg purgatory_loom" cargo test --release --lib loom`).
//!
//! The word holds the cell's generation (high 32 bits), `FREE`, `FINISHED`
//! (terminal for the use), `CHECKING` (one caller owns the operation and runs
//! its check), the requests left for that caller (`RERUN`: another caller
//! asked for a check meanwhile; `EXPIRE` and `CANCEL`: the timeout fired, or a
//! cancel arrived, meanwhile), and a count of the references that keep the
//! cell.
//!
//! - A check starts only by setting `CHECKING` on a live use without it; if it
//!   is set, the caller sets `RERUN` and leaves, and the owner checks once more
//!   before releasing. So checks never overlap and an event that arrives during
//!   a check is never lost (Kafka's KAFKA-6653), unless a cancel or the
//!   timeout left during that check finishes the operation instead (below).
//! - Expiry and cancellation claim the operation (`-> FINISHED`) when no check
//!   runs; if one does, they leave a request bit and the owner acts on it after
//!   its check returns "not yet", before any re-run asked meanwhile. So expiry
//!   code never runs beside a check (KAFKA-19312), a check that succeeds wins
//!   over a concurrent timeout, and a storm of events asking for re-runs
//!   faster than the check runs keeps its owner re-running at most until the
//!   operation's timeout fires or it is cancelled (a re-run first would let
//!   such a storm hold the owner, and the operation, for ever).
//! - Whoever sets `FINISHED` alone finishes the operation: exactly once.
//! - **Who keeps the cell.** Each reference (the handle, each `OpRef`, a call
//!   using the cell for a moment) is counted. `CHECKING` keeps the cell too, so
//!   a walk checks an operation it found by id with one read-modify-write to
//!   begin and one to end, and takes no reference. Setting `FINISHED` adds a
//!   reference, the finisher's, let go once the outcome is delivered. The
//!   last release of a finished cell that nobody checks frees it: the
//!   generation moves on, and every id of the old use fails from then on.
//! - Beginning a check, claiming and acquiring all name the use by its
//!   generation, so an id kept in a watch list or the timer (which keeps
//!   nothing alive) can never reach a later use of its cell.
//!
//! A check told a level (`try_complete_reached`) that asks for a re-run
//! leaves its level in [`Handed`] before it sets `RERUN`, so the re-run is
//! told it; the models below check that no level is lost or left behind.
//!
//! The owner's thread is recorded while it checks (in the cell, beside the
//! word), so that its own check calling back into itself (walking its own key)
//! is not taken for an outside event: a re-run for that would loop forever.
//! Code the check runs that is not the check itself (another operation's
//! check, expiry or drop, reached through a walk the check made) may find
//! the operation ready, after the check read its state: it asks for a re-run
//! from inside ([`Life::ask_from_inside`]), and a flag beside the thread id
//! marks that re-run, which the check loop runs quiet (no such asks), so
//! that checks walking each other's keys cannot loop.

use std::collections::HashMap;
use std::hash::Hash;
use std::num::NonZeroU32;
use std::sync::atomic::Ordering;

use crate::sync::{lock, AtomicU16, AtomicU32, AtomicU64, AtomicU8, Mutex};

/// The reference count's bits.
const REFS: u64 = (1 << 26) - 1;
/// Past this many references to one cell (`OpRef`s leaked with
/// `mem::forget`, say), the process aborts, as `Arc` does past `isize::MAX`:
/// the count must never carry into the bits above it. Half the field, so
/// that threads adding at once cannot carry it either.
const MAX_REFS: u64 = REFS / 2;
/// Request bit: a cancel arrived during a check.
pub(crate) const CANCEL: u64 = 1 << 26;
/// Request bit: the timeout fired during a check.
pub(crate) const EXPIRE: u64 = 1 << 27;
const RERUN: u64 = 1 << 28;
const CHECKING: u64 = 1 << 29;
const FINISHED: u64 = 1 << 30;
const FREE: u64 = 1 << 31;
const REQUESTS: u64 = RERUN | EXPIRE | CANCEL;
const GENERATION_SHIFT: u32 = 32;

/// Checker flag: code the check runs asked for a re-run from the checking
/// thread (see [`Life::ask_from_inside`]).
const ASKED_HERE: u64 = 1 << 63;
/// Checker flag: this run is a re-run code the run before it asked for from
/// the checking thread (the check loop runs it quiet: see `Innermost` in
/// `cell.rs`).
const RERUN_HERE: u64 = 1 << 62;
/// The checker word's thread id, below its flags.
const THREAD: u64 = RERUN_HERE - 1;

#[cold]
fn too_many_references() -> ! {
    std::process::abort()
}

/// What a check that returned "not yet" must do next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AfterNotYet {
    /// Another caller asked for a check meanwhile: run it again.
    Recheck,
    /// Nothing was asked: the operation is released, still pending.
    Release,
    /// A cancel arrived meanwhile: the caller now finishes it (`FINISHED`,
    /// with the finisher's reference) as cancelled.
    Cancel,
    /// The timeout fired meanwhile: the caller now finishes it (`FINISHED`,
    /// with the finisher's reference) as expired.
    Expire,
}

/// What [`Life::begin_check_or_ask`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Begin {
    /// The caller owns the check now.
    Checking,
    /// Another caller is checking: it was asked to check again.
    Asked,
    /// Nothing: the use is over.
    Nothing,
    /// The caller's thread is the one checking: the call comes from code
    /// that check runs (see [`Life::ask_from_inside`]).
    Mine,
}

/// What a claim (by expiry or cancellation) found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Claim {
    /// The caller finishes the operation now (`FINISHED`, with the
    /// finisher's reference).
    Won,
    /// A check is running; it will act on the request when it returns "not yet".
    Deferred,
    /// Already finished, or the cell has moved on.
    Finished,
}

/// What a release found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Released {
    /// Other references remain, or the operation has not finished.
    Kept,
    /// That was the last reference to a finished cell nobody checks: the
    /// caller frees it.
    Last,
}

/// A cell's life and its operation's state (see the module's notes).
#[derive(Debug)]
pub(crate) struct Life(AtomicU64);

/// Who checks the operation in a cell, how it finished, how many watch
/// lists hold it, and what its outcome slot holds: the cell's small words,
/// kept together at its start (its [`Life`] is in the slab's dense array of
/// life words).
#[derive(Debug)]
pub(crate) struct Owner {
    /// The checking thread's id while `CHECKING` is set, else 0, with the
    /// flags [`ASKED_HERE`] and [`RERUN_HERE`] above it.
    checker: AtomicU64,
    /// Number of watch lists holding the cell (tombstone accounting), set at
    /// registration. Outside the protocol above. While the cell is free, the
    /// slab links its free list through it ([`FreeLink`](super::slab::FreeLink)).
    keys: AtomicU32,
    /// How it finished (a `Fate` code, 0 until recorded), recorded by whoever
    /// set `FINISHED` before any user code runs after it. Outside the protocol
    /// above: only read for status reports.
    fate: AtomicU8,
    /// The outcome slot's state (see `Delivery` in `cell.rs`), kept here
    /// where it takes no room of its own. Outside the protocol above.
    outcome: AtomicU8,
    /// The shard of the timer entry's key (see `TimerSlot` in `cell.rs`),
    /// kept here for the same reason. Outside the protocol above.
    timer_shard: AtomicU16,
}

impl Default for Owner {
    fn default() -> Self {
        Owner {
            checker: AtomicU64::new(0),
            keys: AtomicU32::new(0),
            fate: AtomicU8::new(0),
            outcome: AtomicU8::new(0),
            timer_shard: AtomicU16::new(0),
        }
    }
}

impl Owner {
    /// Sets up a cell being taken into use under `keys` keys, whose check
    /// thread `me` owns from the start (nothing else reaches the cell yet).
    #[inline]
    pub(crate) fn restart(&self, me: u64, keys: u32) {
        self.fate.store(0, Ordering::Relaxed);
        self.keys.store(keys, Ordering::Relaxed);
        self.checker.store(me, Ordering::Relaxed);
    }

    /// Whether the run of the check under way (by the thread reading) is a
    /// re-run asked from inside the run before it
    /// ([`Life::ask_from_inside`]).
    #[inline]
    pub(crate) fn is_rerun_here(&self) -> bool {
        self.checker.load(Ordering::Relaxed) & RERUN_HERE != 0
    }

    /// The number of watch lists holding the cell.
    #[inline]
    pub(crate) fn keys(&self) -> u32 {
        self.keys.load(Ordering::Relaxed)
    }

    /// The word the slab links free cells through (the key count's, which a
    /// free cell does not need).
    #[inline]
    pub(crate) fn free_link(&self) -> &AtomicU32 {
        &self.keys
    }

    /// The outcome slot's state word.
    #[inline]
    pub(crate) fn outcome(&self) -> &AtomicU8 {
        &self.outcome
    }

    /// Where the timer entry's shard is kept.
    #[inline]
    pub(crate) fn timer_shard(&self) -> &AtomicU16 {
        &self.timer_shard
    }

    /// Records how the operation finished (`code` > 0), by whoever set
    /// `FINISHED`.
    #[inline]
    pub(crate) fn record_fate(&self, code: u8) {
        self.fate.store(code, Ordering::Release);
    }

    /// The recorded fate code, 0 while none is.
    #[inline]
    pub(crate) fn fate(&self) -> u8 {
        self.fate.load(Ordering::Acquire)
    }
}

/// Levels handed to a running check by the advances that asked it to run
/// again, by the id of the use (`I`). A check told a level
/// (`try_complete_reached`) that finds another caller checking leaves its
/// level here before it sets `RERUN`; the checker takes it for its re-run.
/// Kept apart from the cells, which would each need room for one: a
/// hand-over needs a check running on another thread at that very moment,
/// so this holds at most about one entry per thread.
///
/// Who removes an entry: the checker, when it re-runs or completes, or when
/// a cancel or the timeout left meanwhile finishes the operation instead of
/// the re-run; the asker, when it finds the use over or becomes the checker
/// itself instead.
#[derive(Debug)]
pub(crate) struct Handed<I> {
    /// Entries held, read without the lock to skip it while there are none
    /// (written under it).
    held: AtomicU64,
    levels: Mutex<HashMap<I, u64>>,
}

impl<I> Default for Handed<I> {
    fn default() -> Self {
        Handed {
            held: AtomicU64::new(0),
            levels: Mutex::new(HashMap::new()),
        }
    }
}

impl<I: Hash + Eq> Handed<I> {
    /// Leaves `level` for the checker of `id` (the highest left stays).
    pub(crate) fn offer(&self, id: I, level: u64) {
        let mut levels = lock(&self.levels);
        let left = levels.entry(id).or_insert(level);
        *left = (*left).max(level);
        self.held.store(levels.len() as u64, Ordering::Release);
    }

    /// Takes the level left for `id`, if any.
    #[inline]
    pub(crate) fn take(&self, id: &I) -> Option<u64> {
        if self.held.load(Ordering::Acquire) == 0 {
            return None;
        }
        let mut levels = lock(&self.levels);
        let level = levels.remove(id);
        self.held.store(levels.len() as u64, Ordering::Release);
        level
    }
}

impl Life {
    /// A cell never used: free, generation 1.
    pub(crate) fn new() -> Life {
        Life(AtomicU64::new(1 << GENERATION_SHIFT | FREE))
    }

    #[inline]
    fn generation(word: u64) -> u32 {
        (word >> GENERATION_SHIFT) as u32
    }

    #[inline]
    fn is_use(word: u64, generation: NonZeroU32) -> bool {
        Self::generation(word) == generation.get() && word & (FREE | FINISHED) == 0
    }

    /// Takes a free cell into use, with one reference (the caller's) and its
    /// check owned by the caller (a registration, which runs the operation's
    /// second check itself once it is watched, so an event meanwhile only asks
    /// for that check to run again). The caller owns the cell until it hands
    /// out the returned generation; it records itself as the checker first.
    #[inline]
    pub(crate) fn start(&self) -> NonZeroU32 {
        let word = self.0.load(Ordering::Acquire);
        debug_assert!(word & FREE != 0, "only a free cell starts a use");
        let generation = NonZeroU32::new(Self::generation(word)).expect("generations skip 0");
        self.0.store(
            u64::from(generation.get()) << GENERATION_SHIFT | CHECKING | 1,
            Ordering::Release,
        );
        generation
    }

    /// A new reference to the use `generation`, unless it has finished or the
    /// cell has moved on.
    #[inline]
    pub(crate) fn acquire(&self, generation: NonZeroU32) -> bool {
        let mut word = self.0.load(Ordering::Acquire);
        loop {
            if !Self::is_use(word, generation) {
                return false;
            }
            if word & REFS >= MAX_REFS {
                too_many_references();
            }
            match self
                .0
                .compare_exchange_weak(word, word + 1, Ordering::Acquire, Ordering::Acquire)
            {
                Ok(_) => return true,
                Err(now) => word = now,
            }
        }
    }

    /// Another reference, from a caller that holds one.
    #[inline]
    pub(crate) fn add_ref(&self) {
        let before = self.0.fetch_add(1, Ordering::Relaxed);
        if before & REFS >= MAX_REFS {
            too_many_references();
        }
    }

    /// Whether the use `generation` is over (finished, or the cell moved on).
    #[inline]
    pub(crate) fn is_over(&self, generation: NonZeroU32) -> bool {
        !Self::is_use(self.0.load(Ordering::Acquire), generation)
    }

    /// Whether the operation has finished, for a caller that keeps the cell.
    #[inline]
    pub(crate) fn is_finished(&self) -> bool {
        self.0.load(Ordering::Acquire) & FINISHED != 0
    }

    /// Drops a reference (a holder's, or the finisher's).
    #[inline]
    pub(crate) fn release(&self) -> Released {
        let before = self.0.fetch_sub(1, Ordering::AcqRel);
        debug_assert!(before & REFS > 0, "a release without a reference");
        // Every transition to FINISHED clears CHECKING: a check in progress
        // and a finished operation never meet, so the last reference to a
        // finished cell is the last thing keeping it.
        debug_assert!(before & (FINISHED | CHECKING) != FINISHED | CHECKING);
        if before & REFS == 1 && before & FINISHED != 0 {
            Released::Last
        } else {
            Released::Kept
        }
    }

    /// Frees the cell after [`Released::Last`]: the next use gets the next
    /// generation. Returns `false` when the cell has had its last generation:
    /// it stays free and is never used again, so that no id of an earlier use
    /// (a tombstone nobody walked, a level never reached) can ever name a
    /// later one. One cell in 4 billion uses of it.
    #[inline]
    pub(crate) fn free(&self) -> bool {
        let word = self.0.load(Ordering::Acquire);
        match Self::generation(word).checked_add(1) {
            Some(next) => {
                self.0.store(
                    u64::from(next) << GENERATION_SHIFT | FREE,
                    Ordering::Release,
                );
                true
            }
            None => {
                self.0.store(
                    word & !(REFS | REQUESTS | CHECKING) | FREE,
                    Ordering::Release,
                );
                false
            }
        }
    }

    /// Whether thread `me` is running this cell's check right now (so code it
    /// calls is inside that check). A thread reads its own id in `checker`
    /// only while it owns `CHECKING`: the word is cleared before `CHECKING`
    /// goes, and written by the next owner only after it set `CHECKING`.
    #[inline]
    pub(crate) fn is_checked_by(&self, me: u64, owner: &Owner) -> bool {
        self.0.load(Ordering::Acquire) & CHECKING != 0
            && owner.checker.load(Ordering::Acquire) & THREAD == me
    }

    /// Tries to become the checker of the use `generation` (thread `me`, never
    /// 0). Returns `false` when the use is over, when another caller checks it
    /// (it is asked to check again), or when `me` is that caller re-entering
    /// its own check. No reference is needed: `CHECKING` keeps the cell until
    /// [`end_check`](Self::end_check) or [`complete`](Self::complete).
    #[cfg(all(test, purgatory_loom))]
    pub(crate) fn begin_check(&self, generation: NonZeroU32, me: u64, owner: &Owner) -> bool {
        self.begin_check_or_ask(generation, me, owner, || {}) == Begin::Checking
    }

    /// As [`begin_check`](Self::begin_check), telling apart what happened,
    /// and calling `ask` before each attempt to ask the running checker to
    /// check again (so that what `ask` leaves for that checker is in place
    /// before the checker can see the request; it may be called more than
    /// once, and also when the request is not made in the end).
    ///
    /// Inlined by force into `Op::check_reached` (`cell.rs`), which a
    /// walk runs once per live watcher.
    #[inline(always)]
    pub(crate) fn begin_check_or_ask(
        &self,
        generation: NonZeroU32,
        me: u64,
        owner: &Owner,
        mut ask: impl FnMut(),
    ) -> Begin {
        let mut s = self.0.load(Ordering::Acquire);
        loop {
            let want = if !Self::is_use(s, generation) {
                return Begin::Nothing;
            } else if s & CHECKING != 0 {
                if owner.checker.load(Ordering::Acquire) & THREAD == me {
                    return Begin::Mine;
                }
                ask();
                s | RERUN
            } else {
                s | CHECKING
            };
            match self
                .0
                .compare_exchange(s, want, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) if s & CHECKING != 0 => return Begin::Asked,
                Ok(_) => {
                    owner.checker.store(me, Ordering::Release);
                    return Begin::Checking;
                }
                Err(actual) => s = actual,
            }
        }
    }

    /// Thread `me`, which runs the check of the use `generation`
    /// ([`Begin::Mine`]), asks from inside it for the check to run again once
    /// it ends: the call comes from code the check runs, not from the check
    /// itself (another operation's check, expiry or drop, reached through a
    /// walk of its own, found this operation ready: the answer the check is
    /// about to give was read before). The re-run is marked as asked so
    /// ([`Owner::is_rerun_here`]). Returns whether it asked (not when the
    /// caller is not the checker).
    pub(crate) fn ask_from_inside(&self, generation: NonZeroU32, me: u64, owner: &Owner) -> bool {
        // Only this thread writes the word while it checks.
        let checker = owner.checker.load(Ordering::Relaxed);
        if checker & THREAD != me {
            return false;
        }
        let mut s = self.0.load(Ordering::Acquire);
        loop {
            if !Self::is_use(s, generation) || s & CHECKING == 0 {
                return false;
            }
            match self
                .0
                .compare_exchange(s, s | RERUN, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => break,
                Err(actual) => s = actual,
            }
        }
        owner.checker.store(checker | ASKED_HERE, Ordering::Relaxed);
        true
    }

    /// The owner's check completed the operation: `FINISHED`, with the
    /// finisher's reference in place of `CHECKING`. Requests left meanwhile
    /// lose (their bits stay, unread: nothing reads requests once finished).
    /// Returns whether an expiry was left meanwhile (what it left beside the
    /// word, before its request, is the completer's to take back).
    #[inline]
    pub(crate) fn complete(&self, owner: &Owner) -> bool {
        owner.checker.store(0, Ordering::Release);
        // CHECKING (bit 29) is set and FINISHED (bit 30) is not: adding bit
        // 29 carries into bit 30, so one add moves CHECKING to FINISHED and
        // counts the finisher's reference.
        let before = self.0.fetch_add(CHECKING + 1, Ordering::AcqRel);
        debug_assert!(
            before & (CHECKING | FINISHED) == CHECKING,
            "the owner completes"
        );
        if before & REFS >= MAX_REFS {
            too_many_references();
        }
        before & EXPIRE != 0
    }

    /// The owner gives the operation up unfinished (its registration failed):
    /// as [`complete`](Self::complete).
    #[inline]
    pub(crate) fn abandon(&self, owner: &Owner) {
        self.complete(owner);
    }

    /// The owner's check returned "not yet": release, or act on what was asked.
    #[inline]
    pub(crate) fn end_check(&self, me: u64, owner: &Owner) -> AfterNotYet {
        // Clear the checker first: a thread must never find its own id here unless
        // it really is the one checking (a stale id would make it drop an event).
        let asked_here = owner.checker.load(Ordering::Relaxed) & ASKED_HERE != 0;
        owner.checker.store(0, Ordering::Release);
        let mut s = self.0.load(Ordering::Acquire);
        loop {
            // A cancel or the timeout wins over a re-run asked meanwhile.
            let (want, then) = if s & CANCEL != 0 {
                (Self::finished_by_owner(s), AfterNotYet::Cancel)
            } else if s & EXPIRE != 0 {
                (Self::finished_by_owner(s), AfterNotYet::Expire)
            } else if s & RERUN != 0 {
                (s & !RERUN, AfterNotYet::Recheck)
            } else {
                (s & !CHECKING, AfterNotYet::Release)
            };
            match self
                .0
                .compare_exchange(s, want, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    if then == AfterNotYet::Recheck {
                        let flag = if asked_here { RERUN_HERE } else { 0 };
                        owner.checker.store(me | flag, Ordering::Release);
                    }
                    return then;
                }
                Err(actual) => s = actual,
            }
        }
    }

    /// The word of a use the owner of `CHECKING` finishes: `FINISHED`, no
    /// check, no requests, and the finisher's reference.
    #[inline]
    fn finished_by_owner(s: u64) -> u64 {
        if s & REFS >= MAX_REFS {
            too_many_references();
        }
        (s & !(CHECKING | REQUESTS) | FINISHED) + 1
    }

    /// Claims the use `generation` for expiry or cancellation (`request` is
    /// [`EXPIRE`] or [`CANCEL`]) unless a check runs, in which case the
    /// request is left for it. Needs no reference: a claim that wins adds the
    /// finisher's.
    #[inline]
    pub(crate) fn claim(&self, generation: NonZeroU32, request: u64) -> Claim {
        self.claim_or_ask(generation, request, || {})
    }

    /// As [`claim`](Self::claim), calling `ask` before each attempt to leave
    /// the request for a running check (so that what `ask` leaves for that
    /// checker is in place before the checker can see the request; it may be
    /// called more than once, and also when the request is not left in the
    /// end).
    #[inline]
    pub(crate) fn claim_or_ask(
        &self,
        generation: NonZeroU32,
        request: u64,
        mut ask: impl FnMut(),
    ) -> Claim {
        let mut s = self.0.load(Ordering::Acquire);
        loop {
            let want = if !Self::is_use(s, generation) {
                return Claim::Finished;
            } else if s & CHECKING != 0 {
                ask();
                s | request
            } else {
                if s & REFS >= MAX_REFS {
                    too_many_references();
                }
                (s | FINISHED) + 1
            };
            match self
                .0
                .compare_exchange(s, want, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) if want & FINISHED != 0 => return Claim::Won,
                Ok(_) => return Claim::Deferred,
                Err(actual) => s = actual,
            }
        }
    }

    /// A free cell at generation `generation` (for tests of the last one).
    #[cfg(all(test, not(purgatory_loom)))]
    pub(crate) fn at_generation(generation: u32) -> Life {
        Life(AtomicU64::new(
            u64::from(generation) << GENERATION_SHIFT | FREE,
        ))
    }

    /// Whether the cell is free (for tests).
    #[cfg(all(test, not(purgatory_loom)))]
    pub(crate) fn is_free(&self) -> bool {
        self.0.load(Ordering::Acquire) & FREE != 0
    }
}

#[cfg(all(test, purgatory_loom))]
mod loom_state {
    use super::*;
    use loom::sync::atomic::{AtomicBool, AtomicUsize};
    use loom::sync::Arc;
    use loom::thread;

    /// A cell as the models see it: its life, its owner, and how many times
    /// it was freed.
    struct Cell {
        life: Life,
        owner: Owner,
        frees: AtomicUsize,
    }

    impl Cell {
        /// A pending operation nobody checks, with one reference (its
        /// handle's), and the generation of its use.
        fn pending() -> (Arc<Cell>, NonZeroU32) {
            let cell = Cell::registering(9);
            let generation = cell.life.start();
            assert_eq!(cell.life.end_check(9, &cell.owner), AfterNotYet::Release);
            (cell, generation)
        }

        /// A cell whose registration (thread `me`) owns the check.
        fn registering(me: u64) -> Arc<Cell> {
            let cell = Arc::new(Cell {
                life: Life::new(),
                owner: Owner::default(),
                frees: AtomicUsize::new(0),
            });
            cell.owner.restart(me, 1);
            cell
        }

        /// Lets go of a reference; frees the cell on the last one.
        fn release(&self) {
            if self.life.release() == Released::Last {
                assert!(self.life.free());
                self.frees.fetch_add(1, Ordering::SeqCst);
            }
        }
    }

    /// How an operation finished, counted per kind.
    #[derive(Default)]
    struct Outcomes {
        completed: AtomicUsize,
        expired: AtomicUsize,
        cancelled: AtomicUsize,
    }

    impl Outcomes {
        fn total(&self) -> usize {
            self.completed.load(Ordering::SeqCst)
                + self.expired.load(Ordering::SeqCst)
                + self.cancelled.load(Ordering::SeqCst)
        }
    }

    /// A walk's check of the use `generation` (no reference held), with
    /// "completable" read from `ready`.
    fn check(cell: &Cell, generation: NonZeroU32, me: u64, ready: &AtomicBool, out: &Outcomes) {
        if cell.life.begin_check(generation, me, &cell.owner) {
            run_checks(cell, me, ready, out);
        }
    }

    /// The check loop of `me`, owner of `CHECKING`; a finish lets go of the
    /// finisher's reference.
    fn run_checks(cell: &Cell, me: u64, ready: &AtomicBool, out: &Outcomes) {
        loop {
            if ready.load(Ordering::SeqCst) {
                cell.life.complete(&cell.owner);
                out.completed.fetch_add(1, Ordering::SeqCst);
                cell.release();
                return;
            }
            match cell.life.end_check(me, &cell.owner) {
                AfterNotYet::Recheck => continue,
                AfterNotYet::Release => return,
                AfterNotYet::Cancel => {
                    out.cancelled.fetch_add(1, Ordering::SeqCst);
                    cell.release();
                    return;
                }
                AfterNotYet::Expire => {
                    out.expired.fetch_add(1, Ordering::SeqCst);
                    cell.release();
                    return;
                }
            }
        }
    }

    fn claim(cell: &Cell, generation: NonZeroU32, request: u64, out: &Outcomes) {
        if cell.life.claim(generation, request) == Claim::Won {
            let counter = if request == EXPIRE {
                &out.expired
            } else {
                &out.cancelled
            };
            counter.fetch_add(1, Ordering::SeqCst);
            cell.release();
        }
    }

    /// Spawns a thread `me` that checks the operation, making it completable
    /// first when `set_ready` (an event).
    fn spawn_check(
        cell: &Arc<Cell>,
        generation: NonZeroU32,
        ready: &Arc<AtomicBool>,
        out: &Arc<Outcomes>,
        me: u64,
        set_ready: bool,
    ) -> thread::JoinHandle<()> {
        let (cell, ready, out) = (cell.clone(), ready.clone(), out.clone());
        thread::spawn(move || {
            if set_ready {
                ready.store(true, Ordering::SeqCst);
            }
            check(&cell, generation, me, &ready, &out);
        })
    }

    /// Spawns a thread that claims the operation for `request` (expiry or cancel).
    fn spawn_claim(
        cell: &Arc<Cell>,
        generation: NonZeroU32,
        request: u64,
        out: &Arc<Outcomes>,
    ) -> thread::JoinHandle<()> {
        let (cell, out) = (cell.clone(), out.clone());
        thread::spawn(move || claim(&cell, generation, request, &out))
    }

    /// The handle lets go at the end: a finished cell is then freed exactly
    /// once, and an unfinished one is not.
    fn handle_goes(cell: &Cell, generation: NonZeroU32, out: &Outcomes) {
        cell.release();
        let frees = cell.frees.load(Ordering::SeqCst);
        assert_eq!(frees, out.total(), "freed once when finished, else kept");
        if frees == 1 {
            assert!(cell.life.is_over(generation));
            assert!(!cell.life.acquire(generation), "the old use is over");
        }
    }

    /// An event (ready, then check) racing another check: the event is never lost,
    /// and the operation completes exactly once.
    #[test]
    fn event_during_a_check_is_not_lost() {
        loom::model(|| {
            let (cell, generation) = Cell::pending();
            let ready = Arc::new(AtomicBool::new(false));
            let out = Arc::new(Outcomes::default());
            let t = spawn_check(&cell, generation, &ready, &out, 1, false);
            ready.store(true, Ordering::SeqCst);
            check(&cell, generation, 2, &ready, &out);
            t.join().unwrap();
            assert_eq!(out.completed.load(Ordering::SeqCst), 1);
            assert_eq!(out.total(), 1);
            assert!(cell.life.is_finished());
            handle_goes(&cell, generation, &out);
        });
    }

    /// A check, an expiry and a cancel all racing: exactly one outcome, and
    /// the cell freed once.
    #[test]
    fn check_expiry_and_cancel_race_to_one_outcome() {
        loom::model(|| {
            let (cell, generation) = Cell::pending();
            let ready = Arc::new(AtomicBool::new(false));
            let out = Arc::new(Outcomes::default());
            let checker = spawn_check(&cell, generation, &ready, &out, 1, true);
            let expirer = spawn_claim(&cell, generation, EXPIRE, &out);
            claim(&cell, generation, CANCEL, &out);
            checker.join().unwrap();
            expirer.join().unwrap();
            assert_eq!(out.total(), 1, "exactly one outcome");
            assert!(cell.life.is_finished());
            handle_goes(&cell, generation, &out);
        });
    }

    /// A check that does not complete, racing an expiry: the expiry always
    /// happens (directly, or by the checker after its check), never twice.
    #[test]
    fn expiry_during_a_failing_check_is_done_by_the_checker() {
        loom::model(|| {
            let (cell, generation) = Cell::pending();
            let ready = Arc::new(AtomicBool::new(false));
            let out = Arc::new(Outcomes::default());
            let checker = spawn_check(&cell, generation, &ready, &out, 1, false);
            claim(&cell, generation, EXPIRE, &out);
            checker.join().unwrap();
            assert_eq!(out.expired.load(Ordering::SeqCst), 1);
            assert_eq!(out.total(), 1);
            handle_goes(&cell, generation, &out);
        });
    }

    /// A walk checking by id (no reference) while the handle, the only
    /// reference, is dropped with a cancel: the cell is never freed under the
    /// check, and is freed exactly once.
    #[test]
    fn a_check_by_id_keeps_the_cell_while_the_handle_goes() {
        loom::model(|| {
            let (cell, generation) = Cell::pending();
            let ready = Arc::new(AtomicBool::new(false));
            let out = Arc::new(Outcomes::default());
            let walker = {
                let (cell, ready, out) = (cell.clone(), ready.clone(), out.clone());
                thread::spawn(move || {
                    if cell.life.begin_check(generation, 1, &cell.owner) {
                        assert_eq!(cell.frees.load(Ordering::SeqCst), 0, "freed under a check");
                        run_checks(&cell, 1, &ready, &out);
                    }
                })
            };
            // The handle is dropped: it cancels, then lets go.
            claim(&cell, generation, CANCEL, &out);
            cell.release();
            walker.join().unwrap();
            assert_eq!(out.cancelled.load(Ordering::SeqCst), 1);
            assert_eq!(cell.frees.load(Ordering::SeqCst), 1, "freed exactly once");
        });
    }

    /// A check re-entering itself (its code walks its own key) neither loops nor
    /// deadlocks, while another thread's event still triggers a re-check.
    #[test]
    fn reentrant_check_is_ignored_but_foreign_event_is_not() {
        loom::model(|| {
            let (cell, generation) = Cell::pending();
            let ready = Arc::new(AtomicBool::new(false));
            let out = Arc::new(Outcomes::default());
            let other = spawn_check(&cell, generation, &ready, &out, 2, true);
            if cell.life.begin_check(generation, 1, &cell.owner) {
                // Inside our own check: a nested request from this thread.
                assert!(!cell.life.begin_check(generation, 1, &cell.owner));
                loop {
                    if ready.load(Ordering::SeqCst) {
                        cell.life.complete(&cell.owner);
                        out.completed.fetch_add(1, Ordering::SeqCst);
                        cell.release();
                        break;
                    }
                    if cell.life.end_check(1, &cell.owner) != AfterNotYet::Recheck {
                        break;
                    }
                }
            }
            other.join().unwrap();
            assert_eq!(out.completed.load(Ordering::SeqCst), 1, "event not lost");
            handle_goes(&cell, generation, &out);
        });
    }

    /// An event from another thread makes the owner check again, and that
    /// re-check still says "not yet": the operation is released (checkable
    /// again), neither finished nor left marked as being checked.
    #[test]
    fn a_recheck_that_still_fails_releases_the_operation() {
        loom::model(|| {
            let (cell, generation) = Cell::pending();
            let ready = Arc::new(AtomicBool::new(false));
            let out = Arc::new(Outcomes::default());
            let t = spawn_check(&cell, generation, &ready, &out, 1, false);
            check(&cell, generation, 2, &ready, &out);
            t.join().unwrap();
            assert_eq!(out.total(), 0);
            let word = cell.life.0.load(Ordering::SeqCst);
            assert_eq!(word & (CHECKING | REQUESTS | FINISHED), 0, "released");
            assert_eq!(cell.owner.checker.load(Ordering::SeqCst), 0);
            ready.store(true, Ordering::SeqCst);
            check(&cell, generation, 2, &ready, &out);
            assert_eq!(out.completed.load(Ordering::SeqCst), 1);
            handle_goes(&cell, generation, &out);
        });
    }

    /// A registration owns the check from the start: an event from another
    /// thread before its second check is not lost, and a cancel meanwhile is
    /// left for it.
    #[test]
    fn an_event_or_cancel_during_registration_is_left_for_the_registrar() {
        loom::model(|| {
            let cell = Cell::registering(1);
            let generation = cell.life.start();
            let ready = Arc::new(AtomicBool::new(false));
            let out = Arc::new(Outcomes::default());
            let event = spawn_check(&cell, generation, &ready, &out, 2, true);
            let cancel = spawn_claim(&cell, generation, CANCEL, &out);
            run_checks(&cell, 1, &ready, &out);
            event.join().unwrap();
            cancel.join().unwrap();
            // The event completed it, or the cancel was acted on (by the registrar
            // if it came during its check): exactly one outcome, never none.
            assert_eq!(out.total(), 1);
            assert!(cell.life.is_finished());
            handle_goes(&cell, generation, &out);
        });
    }

    /// A registration hands its operation over to the cell before it lets go
    /// of the check: whoever checks or claims the operation after that finds
    /// it there, and it is taken out exactly once.
    #[test]
    fn the_operation_is_in_its_cell_before_anyone_else_can_reach_it() {
        loom::model(|| {
            let cell = Cell::registering(1);
            let generation = cell.life.start();
            let slot = Arc::new(loom::sync::Mutex::new(None::<u32>));
            let other = {
                let (cell, slot) = (cell.clone(), slot.clone());
                thread::spawn(move || {
                    // A walk's check that finds it pending, or a cancel.
                    if cell.life.begin_check(generation, 2, &cell.owner) {
                        assert!(slot.lock().unwrap().is_some(), "checked before handed over");
                        assert_eq!(cell.life.end_check(2, &cell.owner), AfterNotYet::Release);
                    } else if cell.life.claim(generation, CANCEL) == Claim::Won {
                        assert_eq!(
                            slot.lock().unwrap().take(),
                            Some(7),
                            "claimed before handed over"
                        );
                        cell.release();
                    }
                })
            };
            // The registration's second check said "not yet": hand over, then end.
            *slot.lock().unwrap() = Some(7);
            loop {
                match cell.life.end_check(1, &cell.owner) {
                    // Asked again: this check says "not yet" again.
                    AfterNotYet::Recheck => continue,
                    AfterNotYet::Release => break,
                    AfterNotYet::Cancel => {
                        assert_eq!(slot.lock().unwrap().take(), Some(7));
                        cell.release();
                        break;
                    }
                    AfterNotYet::Expire => unreachable!("nothing expires here"),
                }
            }
            other.join().unwrap();
        });
    }

    /// A registration whose key panicked abandons the operation while a walk
    /// and a cancel reach for it by id: neither acts on it, and the cell is
    /// freed once, by the last of the registration's references.
    #[test]
    fn an_abandoned_registration_is_left_alone_and_freed_once() {
        loom::model(|| {
            let cell = Cell::registering(1);
            let generation = cell.life.start();
            let other = {
                let cell = cell.clone();
                thread::spawn(move || {
                    if cell.life.begin_check(generation, 2, &cell.owner) {
                        panic!("an abandoned operation was checked");
                    }
                    assert_ne!(cell.life.claim(generation, CANCEL), Claim::Won);
                    if cell.life.acquire(generation) {
                        cell.release();
                    }
                })
            };
            cell.life.abandon(&cell.owner);
            cell.release(); // the finisher's reference
            cell.release(); // the registration's
            other.join().unwrap();
            assert_eq!(cell.frees.load(Ordering::SeqCst), 1);
        });
    }

    /// An id of a finished use racing the cell's next use: nothing done by
    /// the old id reaches the new one.
    #[test]
    fn an_old_id_never_reaches_the_next_use_of_its_cell() {
        loom::model(|| {
            let (cell, old) = Cell::pending();
            let out = Outcomes::default();
            claim(&cell, old, CANCEL, &out);
            let stale = {
                let cell = cell.clone();
                thread::spawn(move || {
                    assert!(!cell.life.begin_check(old, 2, &cell.owner));
                    assert_ne!(cell.life.claim(old, EXPIRE), Claim::Won);
                    assert!(!cell.life.acquire(old));
                })
            };
            // The handle goes, the cell is freed and taken again.
            cell.release();
            assert_eq!(cell.frees.load(Ordering::SeqCst), 1);
            let new = cell.life.start();
            assert_ne!(new, old);
            stale.join().unwrap();
            assert_eq!(cell.life.end_check(1, &cell.owner), AfterNotYet::Release);
            assert!(!cell.life.is_over(new), "the new use is untouched");
        });
    }

    /// Two holders (a handle and an `OpRef`) let go at once after the
    /// operation finished: exactly one frees the cell.
    #[test]
    fn two_holders_release_and_one_frees() {
        loom::model(|| {
            let (cell, generation) = Cell::pending();
            cell.life.add_ref();
            let out = Outcomes::default();
            claim(&cell, generation, CANCEL, &out);
            let other = {
                let cell = cell.clone();
                thread::spawn(move || cell.release())
            };
            cell.release();
            other.join().unwrap();
            assert_eq!(cell.frees.load(Ordering::SeqCst), 1);
        });
    }

    /// A reference taken by id races the finish and the handle's release:
    /// the cell is freed exactly once, never while a reference is held.
    #[test]
    fn an_acquire_racing_the_last_release_never_sees_a_freed_cell() {
        loom::model(|| {
            let (cell, generation) = Cell::pending();
            let walker = {
                let cell = cell.clone();
                thread::spawn(move || {
                    if cell.life.acquire(generation) {
                        assert_eq!(cell.frees.load(Ordering::SeqCst), 0, "freed under a holder");
                        cell.release();
                    }
                })
            };
            // The handle cancels the operation and lets go.
            let out = Outcomes::default();
            claim(&cell, generation, CANCEL, &out);
            cell.release();
            walker.join().unwrap();
            assert_eq!(cell.frees.load(Ordering::SeqCst), 1, "freed exactly once");
            assert!(!cell.life.acquire(generation), "the old use is over");
        });
    }

    /// A check told a level (`try_complete_reached`), as `Op::check_reached`
    /// runs it with its hand-over: the operation completes once `completes`
    /// says so of the level the check was told.
    fn check_told(
        cell: &Cell,
        generation: NonZeroU32,
        me: u64,
        reached: Option<u64>,
        handed: &Handed<u32>,
        completes: impl Fn(Option<u64>) -> bool,
        out: &Outcomes,
    ) {
        let id = generation.get();
        let mut offered = false;
        let begun = cell
            .life
            .begin_check_or_ask(generation, me, &cell.owner, || {
                if let Some(level) = reached {
                    handed.offer(id, level);
                    offered = true;
                }
            });
        let mut reached = match begun {
            Begin::Asked => return,
            Begin::Nothing | Begin::Mine => {
                if offered {
                    handed.take(&id);
                }
                return;
            }
            Begin::Checking if offered => handed.take(&id).max(reached),
            Begin::Checking => reached,
        };
        loop {
            if completes(reached) {
                cell.life.complete(&cell.owner);
                handed.take(&id);
                out.completed.fetch_add(1, Ordering::SeqCst);
                cell.release();
                return;
            }
            match cell.life.end_check(me, &cell.owner) {
                AfterNotYet::Recheck => {
                    if let Some(level) = handed.take(&id) {
                        reached = Some(level);
                    }
                }
                AfterNotYet::Release => return,
                // A cancel or the timeout left meanwhile wins over a re-run:
                // the level left for it goes.
                AfterNotYet::Cancel | AfterNotYet::Expire => {
                    handed.take(&id);
                    out.cancelled.fetch_add(1, Ordering::SeqCst);
                    cell.release();
                    return;
                }
            }
        }
    }

    /// An advance to level 5 racing a check of the operation by an event
    /// without a level: whichever way they meet, some check is told 5 (the
    /// operation completes, once), and nothing is left handed over.
    #[test]
    fn a_level_reaches_the_check_it_asked_for() {
        loom::model(|| {
            let (cell, generation) = Cell::pending();
            let handed = Arc::new(Handed::<u32>::default());
            let out = Arc::new(Outcomes::default());
            let at_5 = |level: Option<u64>| level >= Some(5);
            let event = {
                let (cell, handed, out) = (cell.clone(), handed.clone(), out.clone());
                thread::spawn(move || check_told(&cell, generation, 1, None, &handed, at_5, &out))
            };
            check_told(&cell, generation, 2, Some(5), &handed, at_5, &out);
            event.join().unwrap();
            assert_eq!(out.completed.load(Ordering::SeqCst), 1);
            assert_eq!(handed.take(&generation.get()), None, "nothing left over");
            handle_goes(&cell, generation, &out);
        });
    }

    /// A re-run asked and a timeout left during one check: the timeout wins,
    /// so a storm of re-runs cannot hold the operation past it.
    #[test]
    fn a_timeout_left_during_a_check_wins_over_a_rerun() {
        loom::model(|| {
            let (cell, generation) = Cell::pending();
            assert!(cell.life.begin_check(generation, 1, &cell.owner));
            let asker = {
                let cell = cell.clone();
                thread::spawn(move || {
                    assert_eq!(
                        cell.life
                            .begin_check_or_ask(generation, 2, &cell.owner, || {}),
                        Begin::Asked,
                        "the check runs"
                    );
                })
            };
            assert_eq!(cell.life.claim(generation, EXPIRE), Claim::Deferred);
            asker.join().unwrap();
            assert_eq!(cell.life.end_check(1, &cell.owner), AfterNotYet::Expire);
            cell.release();
            assert!(cell.life.is_finished());
        });
    }

    /// An advance to level 5 racing a check that a cancel left meanwhile
    /// finishes: one outcome, and whichever way they meet, no level is left
    /// handed over (the owner takes back what the advance left for the
    /// re-run the cancel wins over; an advance that finds the use over takes
    /// back its own).
    #[test]
    fn a_level_handed_to_a_check_that_is_cancelled_is_not_kept() {
        loom::model(|| {
            let (cell, generation) = Cell::pending();
            let handed = Arc::new(Handed::<u32>::default());
            let out = Arc::new(Outcomes::default());
            assert!(cell.life.begin_check(generation, 1, &cell.owner));
            let advance = {
                let (cell, handed, out) = (cell.clone(), handed.clone(), out.clone());
                let never = |_: Option<u64>| false;
                thread::spawn(move || {
                    check_told(&cell, generation, 2, Some(5), &handed, never, &out)
                })
            };
            assert_eq!(cell.life.claim(generation, CANCEL), Claim::Deferred);
            // The owner's check says "not yet": the cancel wins.
            assert_eq!(cell.life.end_check(1, &cell.owner), AfterNotYet::Cancel);
            handed.take(&generation.get());
            out.cancelled.fetch_add(1, Ordering::SeqCst);
            cell.release();
            advance.join().unwrap();
            assert_eq!(out.total(), 1, "cancelled once");
            assert_eq!(handed.take(&generation.get()), None, "nothing left over");
            handle_goes(&cell, generation, &out);
        });
    }

    /// An advance racing an event that makes the operation completable
    /// whatever the level: it completes once, and no level is left behind,
    /// whichever check completes it.
    #[test]
    fn levels_handed_to_a_check_that_completes_are_not_kept() {
        loom::model(|| {
            let (cell, generation) = Cell::pending();
            let handed = Arc::new(Handed::<u32>::default());
            let out = Arc::new(Outcomes::default());
            let ready = Arc::new(AtomicBool::new(false));
            let advance = |me: u64, level: u64| {
                let (cell, handed, out) = (cell.clone(), handed.clone(), out.clone());
                let ready = ready.clone();
                thread::spawn(move || {
                    let ready = |_: Option<u64>| ready.load(Ordering::SeqCst);
                    check_told(&cell, generation, me, Some(level), &handed, ready, &out)
                })
            };
            let a = advance(1, 5);
            ready.store(true, Ordering::SeqCst);
            let ready = |_: Option<u64>| ready.load(Ordering::SeqCst);
            check_told(&cell, generation, 3, None, &handed, ready, &out);
            a.join().unwrap();
            assert_eq!(out.completed.load(Ordering::SeqCst), 1);
            assert_eq!(handed.take(&generation.get()), None, "nothing left over");
            handle_goes(&cell, generation, &out);
        });
    }
}
