//! The concurrent timer core: the pure [`Wheel`](crate::wheel::Wheel) in `N`
//! mutex-guarded shards (an inserting thread keeps to one shard, so producers on
//! different threads rarely meet), [`Instant`]s turned into ticks, the limit on
//! pending jobs, and one turn of expiries. The reaper task (`reaper.rs`) runs
//! the turns; the wake protocol (`wake.rs`) tells it when.
//!
//! # Ground rules
//!
//! - **Under a shard lock** only the wheel's own arithmetic runs: inserting,
//!   removing, polling and draining entries. Jobs are moved out of the wheel and
//!   run, dropped or handed back after the lock is released, so no user code (a
//!   task, a task's `Drop`, an operation's cell) ever runs under it. The one
//!   exception is a batch of removals ([`Core::remove_soon`]), which drops its
//!   jobs under the lock: only for jobs with nothing to drop (a purgatory's
//!   operation id), which a compile-time assertion enforces.
//! - **The clock.** The reaper reads Tokio's clock at the start of a turn (and
//!   at its end, for the turn's duration); inserts are given
//!   the caller's "now" (registration and `schedule` read it to compute the
//!   deadline anyway), so that a deadline already past is due at once instead of
//!   being rounded up to the next tick.

use std::fmt;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::clock::{far_future, Clock};
use crate::contain::{quietly, Panics};
use crate::histogram::Recorder;
use crate::reaper::{Host, Hub, Next, ReaperMetrics, Served, Turn};
use crate::settings::{BuildError, Settings};
use crate::sync::{lock, thread_index, Mutex, MutexGuard, Padded, Striped};
use crate::wake::{WakeTarget, NEVER};
use crate::wheel::{Key, Wheel};

/// Work stored in the wheel: what to do when it expires, and when it is cleared out
/// unrun.
pub(crate) trait Job: Send + 'static {
    /// What the core serves, for reports: `"purgatory"` or `"timer"`.
    const KIND: &'static str;
    /// What the core keeps for its jobs and lends each of them when it runs
    /// (the purgatory's jobs name operations in a table they reach through it).
    type Ctx: Send + Sync + 'static;
    /// The deadline passed `late` ago (`None` past the clock's horizon);
    /// runs on the reaper task with no lock held. Returns whether it expired
    /// anything (an operation that finished meanwhile has nothing left to
    /// expire; one whose check runs is left to that check, which tells
    /// [`Core::expired_later`] if it expires it).
    fn expire(self, ctx: &Self::Ctx, late: Option<Duration>) -> bool;
    /// The timer stopped before the deadline (`why` says how); runs with no lock held.
    fn abandon(self, ctx: &Self::Ctx, why: Closed);
    /// Whether the job keeps its room under the limit when a turn takes its
    /// entry out (and gives it back through [`Core::give_back_room`], or
    /// hands it to [`Core::reinsert`]).
    fn keeps_room(&self) -> bool {
        false
    }
    /// At the end of each turn: housekeeping of the core's owner left to the
    /// reaper (a purgatory's purge of a map with nothing pending). `emptied`
    /// says the turn left no entry in the wheels (nothing has a timeout
    /// pending, unless it is on its way in). Returns whether more is left:
    /// the reaper takes another turn at once.
    fn after_turn(_ctx: &Self::Ctx, _emptied: bool) -> bool {
        false
    }
    /// A turn that left the wheels empty ended with nothing scheduled (the
    /// wake target reads "never", see [`Core::sleeps_with_nothing`]): the
    /// owner's look at what a finish racing the turn's end left behind. Runs
    /// on the reaper task, with no lock held.
    fn after_idle(_ctx: &Self::Ctx) {}
    /// The reaper task is gone and every job was abandoned: the owner's
    /// housekeeping it would have done (a purgatory's purge left to its
    /// turns) is done now.
    fn after_reaper_gone(_ctx: &Self::Ctx) {}
}

/// Why a timer stopped accepting work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Closed {
    /// `shutdown()` was called, or the last owning handle was dropped.
    Shutdown,
    /// The reaper task ended without a shutdown: aborted, or its runtime stopped.
    ReaperGone,
}

/// Most entries the reaper takes from a shard per acquisition of its lock.
const LOCK_RUN: usize = 64;

/// Entries of finished jobs a thread stripe gathers before removing them
/// under one hold of each shard's lock (see [`Core::remove_soon`]).
const DEAD_BATCH: usize = 64;

const RUNNING: u8 = 0;
const SHUT_DOWN: u8 = 1;
const REAPER_GONE: u8 = 2;

/// Why an insert was refused; the job comes back with it.
#[derive(Debug)]
pub(crate) enum Refused<J> {
    AtCapacity(J),
    Closed(J, Closed),
}

/// A timer entry's address: shard and wheel key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TimerKey {
    /// The shard's index plus one (so that an `Option<TimerKey>` takes no
    /// more room than a key).
    shard: NonZeroU32,
    key: Key,
}

impl TimerKey {
    #[inline]
    fn new(shard: usize, key: Key) -> TimerKey {
        let shard = u32::try_from(shard + 1).expect("shards fit in a u32");
        TimerKey {
            shard: NonZeroU32::new(shard).expect("one more than an index"),
            key,
        }
    }

    #[inline]
    fn shard(self) -> usize {
        self.shard.get() as usize - 1
    }

    /// The key as a word and its shard's number (at most 1,024 shards, so
    /// it fits in 16 bits), for a holder that keeps it in atomics. The word's
    /// index is never `u32::MAX` (see [`Key::to_bits`]).
    #[inline]
    pub(crate) fn to_bits(self) -> (u64, u16) {
        let shard = u16::try_from(self.shard.get()).expect("at most 1,024 shards");
        (self.key.to_bits(), shard)
    }

    /// The key [`to_bits`](TimerKey::to_bits) gave these for; `None` for a word
    /// no key has.
    #[inline]
    pub(crate) fn from_bits(bits: u64, shard: u16) -> Option<TimerKey> {
        Some(TimerKey {
            shard: NonZeroU32::new(u32::from(shard))?,
            key: Key::from_bits(bits)?,
        })
    }
}

#[derive(Debug)]
struct Shard<J> {
    wheel: Wheel<J>,
}

/// Registrations and schedules refused, by reason: each was handed back
/// in its error ([`WatchError`](crate::WatchError) or
/// [`ScheduleError`](crate::ScheduleError)), or, for a sleep or a timeout,
/// its entry was refused when it was made. A refused operation or task is
/// not counted anywhere else (a purgatory's
/// [`registered`](crate::PurgatoryMetrics::registered) counts only those it
/// took). A registration that raced a shutdown after it was taken is not a
/// refusal: it is counted as registered and handed back. Registrations whose
/// key code panicked are not counted either (the panic reaches the caller).
///
/// Counts only grow, and keep their values after a shutdown. Read with
/// [`Purgatory::metrics`](crate::Purgatory::metrics) and
/// [`Timer::metrics`](crate::Timer::metrics); exported as
/// `tokio_purgatory_refused_total` with a `reason` label (the `metrics`
/// feature).
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
/// use std::time::Duration;
/// use tokio_purgatory::{Operation, Purgatory, Timer};
///
/// struct Op;
/// impl Operation for Op {
///     type Output = ();
///     fn try_complete(&mut self) -> Option<()> { None }
///     fn on_expiration(self) {}
/// }
///
/// let p: Purgatory<u32, Op> = Purgatory::builder().max_pending(1).build().unwrap();
/// let _held = p.try_complete_else_watch(Op, Duration::from_secs(1), [1]).unwrap();
/// assert!(p.try_complete_else_watch(Op, Duration::from_secs(1), [2]).is_err());
/// assert!(p.try_complete_else_watch(Op, Duration::from_secs(1), Vec::<u32>::new()).is_err());
/// let refused = p.metrics().refused;
/// assert_eq!((refused.at_capacity, refused.no_keys, refused.total()), (1, 1, 2));
/// assert_eq!(p.metrics().registered, 1, "refusals are not registrations");
///
/// let timer = Timer::new();
/// timer.shutdown();
/// assert!(timer.schedule(Duration::from_secs(1), || {}).is_err());
/// assert_eq!(timer.metrics().refused.shutdown, 1);
/// # }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct RefusedMetrics {
    /// Refused at the limit of pending operations or entries
    /// ([`max_pending`](crate::PurgatoryBuilder::max_pending)), or because a
    /// purgatory holds as many operations as it can name.
    pub at_capacity: u64,
    /// Refused after [`shutdown`](crate::Purgatory::shutdown).
    pub shutdown: u64,
    /// Refused because the reaper task was gone.
    pub reaper_gone: u64,
    /// Refused while a purgatory drains ([`drain`](crate::Purgatory::drain));
    /// always 0 for a timer.
    pub draining: u64,
    /// Refused for an empty key list; always 0 for a timer.
    pub no_keys: u64,
}

impl RefusedMetrics {
    /// Refusals for every reason.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let timer = tokio_purgatory::Timer::new();
    /// assert_eq!(timer.metrics().refused.total(), 0);
    /// # }
    /// ```
    pub fn total(&self) -> u64 {
        self.at_capacity
            .saturating_add(self.shutdown)
            .saturating_add(self.reaper_gone)
            .saturating_add(self.draining)
            .saturating_add(self.no_keys)
    }

    /// Each reason with its label in the exported metric, and its count; the
    /// reasons only a purgatory has come last.
    #[cfg(feature = "metrics")]
    pub(crate) fn by_reason(&self) -> [(&'static str, u64); 5] {
        [
            ("at_capacity", self.at_capacity),
            ("shutdown", self.shutdown),
            ("reaper_gone", self.reaper_gone),
            ("draining", self.draining),
            ("no_keys", self.no_keys),
        ]
    }
}

/// Counters kept by the core (all monotonic), written by the reaper (and,
/// for an expiry a turn left to a running check, by that check).
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) wakeups: AtomicU64,
    pub(crate) expired: AtomicU64,
    /// How late each expiry was taken out, from its deadline tick.
    pub(crate) lateness: Recorder,
    /// Reaper turns, their summed and longest duration (ns), and the most
    /// entries one turn expired.
    pub(crate) turns: AtomicU64,
    pub(crate) turn_nanos: AtomicU64,
    pub(crate) longest_turn_nanos: AtomicU64,
    pub(crate) largest_batch: AtomicU64,
    /// Inserts refused: at the limit, shut down, reaper gone.
    pub(crate) refused_at_capacity: AtomicU64,
    pub(crate) refused_shutdown: AtomicU64,
    pub(crate) refused_reaper_gone: AtomicU64,
}

impl Counters {
    /// Counts an insert refused.
    fn refused<J>(&self, why: &Refused<J>) {
        let counter = match why {
            Refused::AtCapacity(_) => &self.refused_at_capacity,
            Refused::Closed(_, Closed::Shutdown) => &self.refused_shutdown,
            Refused::Closed(_, Closed::ReaperGone) => &self.refused_reaper_gone,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// The inserts refused so far (the timer's refusals).
    pub(crate) fn refusals(&self) -> RefusedMetrics {
        RefusedMetrics {
            at_capacity: self.refused_at_capacity.load(Ordering::Relaxed),
            shutdown: self.refused_shutdown.load(Ordering::Relaxed),
            reaper_gone: self.refused_reaper_gone.load(Ordering::Relaxed),
            draining: 0,
            no_keys: 0,
        }
    }

    /// The reaper's work so far.
    pub(crate) fn reaper(&self) -> ReaperMetrics {
        ReaperMetrics {
            turns: self.turns.load(Ordering::Relaxed),
            busy: Duration::from_nanos(self.turn_nanos.load(Ordering::Relaxed)),
            longest_turn: Duration::from_nanos(self.longest_turn_nanos.load(Ordering::Relaxed)),
            largest_batch: self.largest_batch.load(Ordering::Relaxed),
        }
    }
}

/// Shards of wheels, the clock and the reaper's wake-up state.
pub(crate) struct Core<J, C = ()> {
    shards: Box<[Padded<Mutex<Shard<J>>>]>,
    clock: Clock,
    wake: WakeTarget,
    /// The reaper that serves this core (its own, or one shared with others).
    hub: Arc<Hub>,
    /// The reaper's buffer of due jobs (with their deadline ticks), kept
    /// between turns for its capacity.
    scratch: Mutex<Vec<(u64, J)>>,
    /// Entries whose jobs finished before their deadline, gathered per thread
    /// stripe and removed in batches ([`remove_soon`](Self::remove_soon)),
    /// and whether any stripe may hold some (the reaper removes them all
    /// before each turn).
    dead: Striped<Mutex<Vec<TimerKey>>>,
    dead_waiting: AtomicBool,
    state: AtomicU8,
    /// Pending jobs, kept only when a limit is set (a shared counter is the one
    /// thing all producers would contend on).
    pending: AtomicUsize,
    max_pending: Option<usize>,
    batch: usize,
    pub(crate) counters: Counters,
    /// The lateness histogram in the `metrics` facade, bound to the recorder
    /// installed when the core was built.
    #[cfg(feature = "metrics")]
    lateness_export: metrics::Histogram,
    /// Panics caught in the jobs it runs or drops.
    pub(crate) panics: Panics,
    pub(crate) name: Arc<str>,
    /// What the jobs are lent when they run (`J::Ctx`; a parameter of its
    /// own so that the core's auto traits do not go through `J`'s impl).
    pub(crate) ctx: C,
}

/// Names the core and says whether it is open. The wheels are not printed:
/// they may hold millions of entries, and reading them takes the shard
/// locks, which must not be held while a formatter writes (the writer is
/// the caller's code).
impl<J, C> fmt::Debug for Core<J, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match self.state.load(Ordering::Acquire) {
            RUNNING => "running",
            SHUT_DOWN => "shut down",
            _ => "reaper gone",
        };
        f.debug_struct("Core")
            .field("name", &&*self.name)
            .field("state", &state)
            .field("shards", &self.shards.len())
            .finish_non_exhaustive()
    }
}

impl<J: Job<Ctx = C>, C: Send + Sync + 'static> Core<J, C> {
    /// Builds the core and puts it in the care of a reaper: its own, spawned on
    /// the runtime given, or a shared one. `settings` were validated by the
    /// builder. Fails only when a shared reaper has stopped.
    pub(crate) fn start(
        settings: &Settings,
        name: Arc<str>,
        max_pending: Option<usize>,
        host: Host<'_>,
        ctx: C,
    ) -> Result<Arc<Core<J, C>>, BuildError> {
        let shards = (0..settings.shards.max(1))
            .map(|_| {
                let wheel = Wheel::new(settings.slots, settings.levels)
                    .expect("wheel shape is validated by the builder");
                Padded(Mutex::new(Shard { wheel }))
            })
            .collect();
        let hub = Hub::for_host(&host);
        let core = Arc::new(Core {
            shards,
            clock: Clock::new(host.now(), settings.tick),
            wake: WakeTarget::new(),
            hub: hub.clone(),
            scratch: Mutex::new(Vec::new()),
            dead: Striped::default(),
            dead_waiting: AtomicBool::new(false),
            state: AtomicU8::new(RUNNING),
            pending: AtomicUsize::new(0),
            max_pending,
            batch: settings.batch.max(1),
            counters: Counters::default(),
            #[cfg(feature = "metrics")]
            lateness_export: crate::export::Labels {
                kind: J::KIND,
                name: &name,
            }
            .lateness(),
            panics: Panics::new(J::KIND, name.clone()),
            name,
            ctx,
        });
        hub.serve(core.clone(), host)?;
        Ok(core)
    }

    /// The shard of the thread with index `thread`: a mask when the count is a
    /// power of two (the default), not a 64-bit division per insert.
    fn shard_of(&self, thread: u64) -> usize {
        let n = self.shards.len();
        if n.is_power_of_two() {
            thread as usize & (n - 1)
        } else {
            (thread % n as u64) as usize
        }
    }

    fn lock(&self, shard: usize) -> MutexGuard<'_, Shard<J>> {
        lock(&self.shards[shard].0)
    }

    /// Why the core is closed, if it is.
    pub(crate) fn closed(&self) -> Option<Closed> {
        match self.state.load(Ordering::Acquire) {
            RUNNING => None,
            SHUT_DOWN => Some(Closed::Shutdown),
            _ => Some(Closed::ReaperGone),
        }
    }

    /// Inserts `job` to expire at `deadline`; `now` is the caller's reading of the
    /// clock (see [`Clock::tick_for`]).
    pub(crate) fn insert(
        &self,
        now: Instant,
        deadline: Instant,
        job: J,
    ) -> Result<TimerKey, Refused<J>> {
        if let Some(max) = self.max_pending {
            // Taken only while there is room (see `take_room`).
            if !crate::sync::take_room(&self.pending, max) {
                // A closed core says so even while it reads as full (a
                // repeating task that shut its timer down keeps its room
                // through its run). An insert that finds room learns of a
                // close in `place`.
                let refused = match self.closed() {
                    Some(why) => Refused::Closed(job, why),
                    None => Refused::AtCapacity(job),
                };
                self.counters.refused(&refused);
                return Err(refused);
            }
        }
        self.place(now, deadline, job).map_err(|(job, why)| {
            let refused = Refused::Closed(job, why);
            self.counters.refused(&refused);
            refused
        })
    }

    /// Puts `job` in a wheel, its room under the limit already taken (given back
    /// if the core is closed, and the job with it), and wakes the reaper if it
    /// must come sooner.
    fn place(&self, now: Instant, deadline: Instant, job: J) -> Result<TimerKey, (J, Closed)> {
        let tick = self.clock.tick_for(now, deadline);
        // A thread keeps to one shard, so producers on different threads rarely meet.
        let shard = self.shard_of(thread_index());
        let key = {
            let mut s = self.lock(shard);
            // The core's state, read under the shard's lock: `close` sets it
            // before it drains the shards one by one, so an insert either
            // lands before that shard's drain (which hands it back) or sees
            // the state. A job put back by a run under way when the close
            // came (a repeating task's next run) is so refused even on a
            // shard not drained yet, instead of being handed back by that
            // drain as if it had never run.
            if let Some(why) = self.closed() {
                drop(s);
                self.release_capacity(1);
                return Err((job, why));
            }
            s.wheel.insert(tick, job)
        };
        self.entered(tick, now);
        Ok(TimerKey::new(shard, key))
    }

    /// Whether the reaper is out of a turn with nothing scheduled in this
    /// core (see [`WakeTarget::sleeps_with_nothing`]).
    #[inline]
    pub(crate) fn sleeps_with_nothing(&self) -> bool {
        self.wake.sleeps_with_nothing()
    }

    /// Work for the reaper is due now (see [`Job::after_turn`]): notifies it
    /// unless it is in a turn of this core, or will take one by now.
    pub(crate) fn poke(&self) {
        let now = Instant::now();
        self.entered(self.clock.now_tick(now), now);
    }

    /// An entry went in at `tick`: notifies the reaper if it sleeps past it, or
    /// if it is overdue (see [`WakeTarget::overdue`]).
    fn entered(&self, tick: u64, now: Instant) {
        // A lowered target notifies unless the reaper, shared with other
        // cores, already sleeps until no later than this entry is due.
        let earlier = self.wake.lower(tick) && self.hub.sleeps_past(self.clock.instant_of(tick));
        // Looked at even when the entry notifies as the earliest: one due
        // now claims the turn, so that entries after it, until the reaper
        // takes that turn, lower the target silently instead of notifying
        // again (a second notification would stay behind as a permit and
        // wake the reaper once more for nothing).
        let overdue = self.wake.overdue(self.clock.now_tick(now));
        if earlier || overdue {
            self.hub.wake();
        }
    }

    /// Puts back a job that has just run and goes on (a repeating task): as
    /// [`insert`](Self::insert), in the room it kept through its run (see
    /// [`Job::keeps_room`]), so never refused for the limit. Hands the job
    /// back when the core is closed, and its room then.
    pub(crate) fn reinsert(&self, now: Instant, deadline: Instant, job: J) -> Result<TimerKey, J> {
        self.place(now, deadline, job).map_err(|(job, _)| job)
    }

    /// A job that kept its room through its run (see [`Job::keeps_room`])
    /// ends without going back in: the room is free again.
    pub(crate) fn give_back_room(&self) {
        self.release_capacity(1);
    }

    /// Removes the entry of `key`, handing its job back; `None` when it already
    /// expired, was removed, or the timer was cleared.
    pub(crate) fn remove(&self, key: TimerKey) -> Option<J> {
        let job = {
            let mut s = self.lock(key.shard());
            let job = s.wheel.remove(key.key);
            s.wheel.shrink(); // a no-op unless that emptied the wheel
            job
        };
        if job.is_some() {
            self.release_capacity(1);
        }
        job
    }

    /// Removes the entry of `key`, whose job has nothing left to do when it
    /// expires (a purgatory's finished operation), soon: the calling thread's
    /// stripe gathers up to [`DEAD_BATCH`] keys and then removes them all
    /// under one hold of each shard's lock, so their cache misses overlap
    /// instead of each waiting behind a lock. The reaper removes what is
    /// gathered when it begins a turn, so the entries of jobs that finished
    /// before are not taken out as due (one gathered during the turn may be,
    /// and its job then finds nothing to do). Jobs with nothing to drop only:
    /// they are dropped under the shard lock.
    pub(crate) fn remove_soon(&self, key: TimerKey) {
        const {
            assert!(
                !std::mem::needs_drop::<J>(),
                "removed jobs are dropped under a lock"
            )
        };
        let slot = self.dead.mine();
        let mut dead = lock(slot);
        if dead.len() < dead.capacity() {
            dead.push(key);
            drop(dead);
            self.dead_waiting.store(true, Ordering::Release);
            return;
        }
        // Full (or never given room): remove the batch with the stripe's lock
        // released, and start the next one with this key in the same room.
        let mut batch = std::mem::take(&mut *dead);
        drop(dead);
        self.remove_batch(&mut batch);
        if batch.capacity() == 0 {
            batch.reserve(DEAD_BATCH);
        }
        batch.push(key);
        Self::give_back(slot, &mut batch);
        self.dead_waiting.store(true, Ordering::Release);
        // Another thread of the stripe gave it room meanwhile: this key goes now.
        self.remove_batch(&mut batch);
    }

    /// Removes every entry gathered by [`remove_soon`](Self::remove_soon) on
    /// any thread stripe.
    fn remove_gathered(&self) {
        if !self.dead_waiting.swap(false, Ordering::AcqRel) {
            return;
        }
        for stripe in self.dead.iter() {
            let mut batch = {
                let mut dead = lock(stripe);
                if dead.is_empty() {
                    continue;
                }
                std::mem::take(&mut *dead)
            };
            self.remove_batch(&mut batch);
            Self::give_back(stripe, &mut batch);
        }
    }

    /// Puts `batch` back in its stripe's `slot`, room and all, unless
    /// another thread of the stripe gave the slot room meanwhile; then it
    /// stays with the caller (freed, or its keys removed, with no lock held).
    fn give_back(slot: &Mutex<Vec<TimerKey>>, batch: &mut Vec<TimerKey>) {
        let mut dead = lock(slot);
        if dead.capacity() == 0 {
            std::mem::swap(&mut *dead, batch);
        }
    }

    /// Removes the entries of `keys` (leaving it empty), one hold of each
    /// shard's lock for all of that shard's keys.
    fn remove_batch(&self, keys: &mut Vec<TimerKey>) {
        // Gathered by `remove_soon` only, whose jobs have nothing to drop.
        debug_assert!(keys.is_empty() || !std::mem::needs_drop::<J>());
        keys.sort_unstable_by_key(|k| k.shard);
        let mut removed = 0;
        for run in keys.chunk_by(|a, b| a.shard == b.shard) {
            let mut s = self.lock(run[0].shard());
            for key in run {
                removed += usize::from(s.wheel.remove(key.key).is_some());
            }
            s.wheel.shrink(); // a no-op unless that emptied the wheel
        }
        keys.clear();
        self.release_capacity(removed);
    }

    /// Moves the entry of `key` to expire at `deadline` instead (O(1): out of
    /// its bucket and into another, in the same shard under one hold of its lock,
    /// so the entry is never outside the wheel and its room under the limit stays
    /// its own). `now` is the caller's reading of the clock. Returns the entry's
    /// new key, or `None` when it already expired, was removed, or the timer was
    /// cleared.
    pub(crate) fn reset(&self, key: TimerKey, now: Instant, deadline: Instant) -> Option<TimerKey> {
        let tick = self.clock.tick_for(now, deadline);
        let moved = {
            let mut s = self.lock(key.shard());
            let job = s.wheel.remove(key.key)?;
            s.wheel.insert(tick, job)
        };
        self.entered(tick, now);
        Some(TimerKey { key: moved, ..key })
    }

    /// Whether `key`'s entry is still waiting.
    pub(crate) fn contains(&self, key: TimerKey) -> bool {
        self.lock(key.shard()).wheel.contains(key.key)
    }

    /// Jobs waiting (sums the shards, once the entries gathered for removal
    /// are removed; exact when no call races it).
    pub(crate) fn len(&self) -> usize {
        self.remove_gathered();
        (0..self.shards.len())
            .map(|i| self.lock(i).wheel.len())
            .sum()
    }

    /// `n` entries left the wheel: their room under the limit is free again.
    /// Without a limit, the count is not kept.
    fn release_capacity(&self, n: usize) {
        if self.max_pending.is_some() {
            self.pending.fetch_sub(n, Ordering::AcqRel);
        }
    }

    /// Stops the core: no insert succeeds afterwards, and every job still waiting
    /// is taken out and returned. Returns `None` when it was already closed.
    pub(crate) fn close(&self, why: Closed) -> Option<Vec<J>> {
        let to = if why == Closed::Shutdown {
            SHUT_DOWN
        } else {
            REAPER_GONE
        };
        self.state
            .compare_exchange(RUNNING, to, Ordering::AcqRel, Ordering::Acquire)
            .ok()?;
        let mut jobs = Vec::new();
        for i in 0..self.shards.len() {
            jobs.append(&mut self.lock(i).wheel.drain());
        }
        self.release_capacity(jobs.len());
        // The reaper lets go of a closed core (and stops, if it was the last).
        self.hub.wake();
        Some(jobs)
    }

    /// A lateness sample, in the histogram and the application's recorder.
    fn record_lateness(&self, late: Duration) {
        self.counters.lateness.record(late);
        // The application's recorder, code of its own.
        #[cfg(feature = "metrics")]
        self.panics.run("the metrics recorder", || {
            self.lateness_export.record(late.as_secs_f64())
        });
    }

    /// An expiry a turn left to the check running at that moment (its job
    /// returned `false`), carried out by that check: counted as the turn
    /// counts its own, `late` as the turn measured it, but in no turn's batch.
    pub(crate) fn expired_later(&self, late: Duration) {
        self.counters.expired.fetch_add(1, Ordering::Relaxed);
        self.record_lateness(late);
    }

    /// One reaper turn: expires at most `batch` due jobs per shard. Returns whether
    /// more are due right now, the earliest tick anything is due otherwise, and the
    /// turn's tick.
    fn turn(&self, scratch: &mut Vec<(u64, J)>, span: &tracing::Span) -> Turn {
        // Entries of jobs that finished before the turn are not taken out as
        // due (one gathered meanwhile may be: its job finds nothing to do).
        // The turn's length on the wall clock: Tokio's may be paused (in
        // tests) or moved by hand, and the work a turn does is not.
        let wall = std::time::Instant::now();
        self.remove_gathered();
        let started = Instant::now();
        let now = self.clock.now_tick(started);
        let mut more = false;
        let mut next = u64::MAX;
        let mut expired = 0;
        for i in 0..self.shards.len() {
            let mut taken = 0;
            let shard_next = loop {
                // Hold the shard lock for a short run of polls at a time, so a
                // producer on another worker waits microseconds, not a whole batch.
                let mut s = self.lock(i);
                let run = LOCK_RUN.min(self.batch - taken);
                while scratch.len() < run {
                    match s.wheel.poll(now) {
                        Some(due) => scratch.push(due),
                        None => break,
                    }
                }
                let drained = scratch.len() < run;
                let shard_next = if drained {
                    // Give back a drained burst's slab (a no-op unless empty).
                    s.wheel.shrink();
                    Some(s.wheel.next_expiration())
                } else {
                    None
                };
                drop(s);
                taken += scratch.len();
                let kept = scratch.iter().filter(|(_, job)| job.keeps_room()).count();
                self.release_capacity(scratch.len() - kept);
                let mut ran = 0;
                for (deadline, job) in scratch.drain(..) {
                    let late = self
                        .clock
                        .instant_of(deadline)
                        .map(|due| started.saturating_duration_since(due));
                    // An expiry whose code panicked ran all the same.
                    let did = self
                        .panics
                        .run("an expiry", || job.expire(&self.ctx, late))
                        .unwrap_or(true);
                    // Counted once per expiry: a job whose operation finished
                    // meanwhile (completed, or by an earlier expiry of this
                    // batch) expired nothing.
                    if !did {
                        continue;
                    }
                    ran += 1;
                    if let Some(late) = late {
                        self.record_lateness(late);
                    }
                }
                self.counters.expired.fetch_add(ran, Ordering::Relaxed);
                expired += ran;
                if let Some(n) = shard_next {
                    break n;
                }
                if taken >= self.batch {
                    // More is due now: the reaper takes another turn at once, so
                    // this shard's next deadline is not needed.
                    more = true;
                    break None;
                }
            };
            next = next.min(shard_next.unwrap_or(u64::MAX));
        }
        // The owner's housekeeping, counted in the turn's time.
        let emptied = !more && next == u64::MAX;
        let more = J::after_turn(&self.ctx, emptied) || more;
        let c = &self.counters;
        let nanos = u64::try_from(wall.elapsed().as_nanos()).unwrap_or(u64::MAX);
        c.turns.fetch_add(1, Ordering::Relaxed);
        c.turn_nanos.fetch_add(nanos, Ordering::Relaxed);
        c.longest_turn_nanos.fetch_max(nanos, Ordering::Relaxed);
        c.largest_batch.fetch_max(expired, Ordering::Relaxed);
        // On the turn's own span (a no-op when it is disabled), never on
        // whatever span the thread has entered.
        quietly(|| {
            span.record("expired", expired);
        });
        Turn {
            more: more || next <= now,
            next,
            now,
            emptied,
        }
    }

    /// This core's labels in the `metrics` facade.
    #[cfg(feature = "metrics")]
    pub(crate) fn labels(&self) -> crate::export::Labels<'_> {
        crate::export::Labels {
            kind: J::KIND,
            name: &self.name,
        }
    }

    /// How many times the reaper has woken from a sleep.
    pub(crate) fn wakeups(&self) -> u64 {
        self.counters.wakeups.load(Ordering::Relaxed)
    }
}

impl<J: Job<Ctx = C>, C: Send + Sync + 'static> Served for Core<J, C> {
    fn begin_turn(&self) {
        self.wake.begin_turn();
    }

    fn serve(&self) -> Turn {
        // The buffer is taken out of its lock: the jobs run with no lock held.
        let mut scratch = std::mem::take(&mut *lock(&self.scratch));
        // The turn's span: made, entered, left and closed by the application's
        // subscriber, each call contained (see `quietly`).
        let span = quietly(|| {
            tracing::debug_span!(
                "reaper turn",
                kind = J::KIND,
                name = &*self.name,
                expired = tracing::field::Empty
            )
        })
        .unwrap_or_else(tracing::Span::none);
        let entered = quietly(|| span.enter());
        let turn = self.turn(&mut scratch, &span);
        *lock(&self.scratch) = scratch;
        quietly(move || drop(entered));
        quietly(move || drop(span));
        turn
    }

    fn end_turn(&self, turn: Turn) -> Next {
        let target = self.wake.end_turn(turn.next);
        if target == NEVER && turn.emptied && !turn.more {
            // After the target reads "never": a finish that raced this turn
            // and found it still turning is seen here (see
            // `WakeTarget::sleeps_with_nothing`).
            J::after_idle(&self.ctx);
        }
        if turn.more || target <= turn.now {
            // A batch was cut short, or a task run this turn (of this core or
            // another served by the same reaper) scheduled work already due.
            // The next turn is claimed now: the reaper takes it after letting
            // other tasks run, and an entry put in meanwhile lowers the
            // target silently instead of claiming a turn of its own and
            // notifying (a permit Tokio's `Notify` would keep, waking the
            // reaper once more for nothing at its next sleep).
            self.wake.begin_turn();
            Next::Again
        } else {
            quietly(|| {
                tracing::trace!(
                    kind = J::KIND,
                    name = &*self.name,
                    target,
                    "core idle until its target"
                );
            });
            // A target past what `Instant` holds (a tick of centuries) sleeps
            // as long as a sleep can, then looks again.
            Next::Sleep((target != NEVER).then(|| {
                self.clock
                    .instant_of(target)
                    .unwrap_or_else(|| far_future(Instant::now()))
            }))
        }
    }

    fn is_closed(&self) -> bool {
        self.closed().is_some()
    }

    fn woke(&self) {
        self.counters.wakeups.fetch_add(1, Ordering::Relaxed);
    }

    fn reaper_gone(&self) {
        if let Some(jobs) = self.close(Closed::ReaperGone) {
            let abandoned = jobs.len();
            for job in jobs {
                self.panics.run("an abandoned job", || {
                    job.abandon(&self.ctx, Closed::ReaperGone)
                });
            }
            self.panics.run("housekeeping after a lost reaper", || {
                J::after_reaper_gone(&self.ctx)
            });
            quietly(|| {
                tracing::warn!(
                    kind = J::KIND,
                    name = &*self.name,
                    abandoned,
                    "reaper stopped without a shutdown"
                );
            });
        }
    }
}
