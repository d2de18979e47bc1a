//! The concurrent timer core and its reaper task.
//!
//! It wraps the pure [`Wheel`](crate::wheel::Wheel) in `N` mutex-guarded shards (an
//! inserting thread keeps to one shard, so producers on different threads rarely
//! meet), converts [`Instant`]s to ticks, and runs the reaper: one Tokio task that
//! sleeps until the earliest bucket of any shard is due, takes the due entries out
//! in bounded batches under the shard lock, and runs them with every lock released.
//!
//! One reaper task serves one core (a purgatory's or a timer's own) or several
//! (a shared [`Reaper`]): the task holds a [`Hub`] listing the cores, each seen
//! through the [`Served`] trait whatever its jobs' type, and sleeps on the
//! earliest of their targets. Each core keeps its own wake target; they share the
//! hub's `Notify`. The task lets go of a core once it is closed, and ends when no
//! core is left and no `Reaper` handle can attach another.
//!
//! # Ground rules
//!
//! - **Under a shard lock** only the wheel's own arithmetic runs: inserting,
//!   removing, polling and draining entries. Jobs are moved out of the wheel and
//!   run, dropped or handed back after the lock is released, so no user code (a
//!   task, a task's `Drop`, an operation's cell) ever runs under it.
//! - **The clock.** The reaper reads Tokio's clock once per turn; inserts are given
//!   the caller's "now" (registration and `schedule` read it to compute the
//!   deadline anyway), so that a deadline already past is due at once instead of
//!   being rounded up to the next tick.
//!
//! # The wake protocol
//!
//! [`WakeTarget`] holds the tick the reaper will next wake at, and a bit saying the
//! reaper is in a turn (awake, and will read the target again before sleeping).
//! An insert lowers the target with a compare-and-swap, and notifies the reaper
//! only when it lowered the target of a reaper that is *asleep*. An insert during
//! a turn (a task rescheduling itself, or a producer racing the reaper) lowers the
//! target silently, and the reaper picks it up when it ends the turn: one wake-up
//! per distinct due time. Inserts later than the target cost one atomic load.
//! [`Notify`] keeps a permit, so a notification sent between the end of a turn and
//! the start of the sleep is not lost.
//!
//! The reaper sleeps on Tokio's timer, which has millisecond resolution: a
//! sleeper wakes up to about two milliseconds after the instant it asked for.
//! Inserts read the clock anyway, so an insert that finds the target passed while
//! the reaper sleeps claims the turn ([`WakeTarget::overdue`]) and notifies: under
//! load, the load itself wakes the reaper within a tick of what is due. Loom
//! checks the protocol (`loom_wake`).

use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;

use crate::sync::MutexGuard;

use tokio::sync::Notify;
use tokio::time::Instant;

use crate::clock::{far_future, Clock};
use crate::contain::Panics;
use crate::settings::{runtime_handle, BuildError, Settings};
use crate::sync::{lock, thread_index, Mutex, Padded};
use crate::wheel::{Key, Wheel};

/// Work stored in the wheel: what to do when it expires, and when it is cleared out
/// unrun.
pub(crate) trait Job: Send + 'static {
    /// What the core serves, for reports: `"purgatory"` or `"timer"`.
    const KIND: &'static str;
    /// The deadline passed; runs on the reaper task with no lock held.
    fn expire(self);
    /// The timer stopped before the deadline (`why` says how); runs with no lock held.
    fn abandon(self, why: Closed);
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
    shard: u32,
    key: Key,
}

#[derive(Debug)]
struct Shard<J> {
    wheel: Wheel<J>,
    closed: bool,
}

/// Counters kept by the core (all monotonic).
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) wakeups: AtomicU64,
    pub(crate) expired: AtomicU64,
}

/// Shards of wheels, the clock and the reaper's wake-up state.
#[derive(Debug)]
pub(crate) struct Core<J> {
    shards: Box<[Padded<Mutex<Shard<J>>>]>,
    clock: Clock,
    wake: WakeTarget,
    /// The reaper that serves this core (its own, or one shared with others).
    hub: Arc<Hub>,
    /// The reaper's buffer of due jobs, kept between turns for its capacity.
    scratch: Mutex<Vec<J>>,
    state: AtomicU8,
    /// Pending jobs, kept only when a limit is set (a shared counter is the one
    /// thing all producers would contend on).
    pending: AtomicUsize,
    max_pending: Option<usize>,
    batch: usize,
    pub(crate) counters: Counters,
    /// Panics caught in the jobs it runs or drops.
    pub(crate) panics: Panics,
    pub(crate) name: Arc<str>,
}

impl<J: Job> Core<J> {
    /// Builds the core and puts it in the care of a reaper: its own, spawned on
    /// the runtime given, or a shared one. `settings` were validated by the
    /// builder. Fails only when a shared reaper has stopped.
    pub(crate) fn start(
        settings: &Settings,
        name: Arc<str>,
        max_pending: Option<usize>,
        host: Host<'_>,
    ) -> Result<Arc<Core<J>>, BuildError> {
        let shards = (0..settings.shards.max(1))
            .map(|_| {
                let wheel = Wheel::new(settings.slots, settings.levels)
                    .expect("wheel shape is validated by the builder");
                Padded(Mutex::new(Shard {
                    wheel,
                    closed: false,
                }))
            })
            .collect();
        let hub = match &host {
            Host::Own(_) => Arc::new(Hub::new()),
            Host::Shared(reaper) => reaper.hub.clone(),
        };
        let core = Arc::new(Core {
            shards,
            clock: Clock::new(Instant::now(), settings.tick),
            wake: WakeTarget::new(),
            hub: hub.clone(),
            scratch: Mutex::new(Vec::new()),
            state: AtomicU8::new(RUNNING),
            pending: AtomicUsize::new(0),
            max_pending,
            batch: settings.batch.max(1),
            counters: Counters::default(),
            panics: Panics::new(J::KIND, name.clone()),
            name,
        });
        hub.attach(core.clone())?;
        if let Host::Own(rt) = host {
            rt.spawn(run_reaper(ReaperGuard(hub)));
        }
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
            if self.pending.fetch_add(1, Ordering::AcqRel) >= max {
                self.pending.fetch_sub(1, Ordering::AcqRel);
                return Err(Refused::AtCapacity(job));
            }
        }
        self.place(now, deadline, job)
            .map_err(|(job, why)| Refused::Closed(job, why))
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
            if s.closed {
                drop(s);
                self.release_capacity(1);
                let why = self.closed().unwrap_or(Closed::Shutdown);
                return Err((job, why));
            }
            s.wheel.insert(tick, job)
        };
        self.entered(tick, now);
        Ok(TimerKey {
            shard: shard as u32,
            key,
        })
    }

    /// An entry went in at `tick`: notifies the reaper if it sleeps past it, or
    /// if it is overdue (see [`WakeTarget::overdue`]).
    fn entered(&self, tick: u64, now: Instant) {
        if self.wake.lower(tick) || self.wake.overdue(self.clock.now_tick(now)) {
            self.hub.notify.notify_one();
        }
    }

    /// Puts back a job that has just run and goes on (a repeating task): as
    /// [`insert`](Self::insert), but outside the limit's check, since the job
    /// held its room until it ran. Hands the job back when the core is closed.
    pub(crate) fn reinsert(&self, now: Instant, deadline: Instant, job: J) -> Result<TimerKey, J> {
        if self.max_pending.is_some() {
            self.pending.fetch_add(1, Ordering::AcqRel);
        }
        self.place(now, deadline, job).map_err(|(job, _)| job)
    }

    /// Removes the entry of `key`, handing its job back; `None` when it already
    /// expired, was removed, or the timer was cleared.
    pub(crate) fn remove(&self, key: TimerKey) -> Option<J> {
        let job = {
            let mut s = self.lock(key.shard as usize);
            let job = s.wheel.remove(key.key);
            s.wheel.shrink(); // a no-op unless that emptied the wheel
            job
        };
        if job.is_some() {
            self.release_capacity(1);
        }
        job
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
            let mut s = self.lock(key.shard as usize);
            let job = s.wheel.remove(key.key)?;
            s.wheel.insert(tick, job)
        };
        self.entered(tick, now);
        Some(TimerKey {
            shard: key.shard,
            key: moved,
        })
    }

    /// Whether `key`'s entry is still waiting.
    pub(crate) fn contains(&self, key: TimerKey) -> bool {
        self.lock(key.shard as usize).wheel.contains(key.key)
    }

    /// Jobs waiting (sums the shards; exact when no call races it).
    pub(crate) fn len(&self) -> usize {
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
            let mut s = self.lock(i);
            s.closed = true;
            jobs.append(&mut s.wheel.drain());
        }
        self.release_capacity(jobs.len());
        // The reaper lets go of a closed core (and stops, if it was the last).
        self.hub.notify.notify_one();
        Some(jobs)
    }

    /// One reaper turn: expires at most `batch` due jobs per shard. Returns whether
    /// more are due right now, the earliest tick anything is due otherwise, and the
    /// turn's tick.
    fn turn(&self, scratch: &mut Vec<J>) -> (bool, u64, u64) {
        let now = self.clock.now_tick(Instant::now());
        let mut more = false;
        let mut next = u64::MAX;
        for i in 0..self.shards.len() {
            let mut taken = 0;
            let shard_next = loop {
                // Hold the shard lock for a short run of polls at a time, so a
                // producer on another worker waits microseconds, not a whole batch.
                let mut s = self.lock(i);
                let run = LOCK_RUN.min(self.batch - taken);
                while scratch.len() < run {
                    match s.wheel.poll(now) {
                        Some((_, job)) => scratch.push(job),
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
                self.release_capacity(scratch.len());
                self.counters
                    .expired
                    .fetch_add(scratch.len() as u64, Ordering::Relaxed);
                for job in scratch.drain(..) {
                    self.panics.run("an expiry", || job.expire());
                }
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
        (more || next <= now, next, now)
    }

    /// How many times the reaper has woken from a sleep.
    pub(crate) fn wakeups(&self) -> u64 {
        self.counters.wakeups.load(Ordering::Relaxed)
    }
}

/// What the reaper task needs of a core, whatever its jobs' type: one task can
/// so serve the cores of several purgatories and timers.
trait Served: Send + Sync {
    /// One turn: runs what is due and returns what the reaper does next.
    fn serve(&self) -> Next;
    /// Whether the core is closed (the reaper lets go of it).
    fn is_closed(&self) -> bool;
    /// The reaper woke from a sleep.
    fn woke(&self);
    /// The reaper task is gone: closes the core and abandons what waits in it.
    fn reaper_gone(&self);
}

/// What a core asks of the reaper after a turn.
enum Next {
    /// More is due right now.
    Again,
    /// Sleep until this instant at the latest (`None`: nothing is scheduled).
    Sleep(Option<Instant>),
}

impl<J: Job> Served for Core<J> {
    fn serve(&self) -> Next {
        // The buffer is taken out of its lock: the jobs run with no lock held.
        let mut scratch = std::mem::take(&mut *lock(&self.scratch));
        self.wake.begin_turn();
        let (more, next, now) = self.turn(&mut scratch);
        let target = self.wake.end_turn(next);
        *lock(&self.scratch) = scratch;
        if more || target <= now {
            // A batch was cut short, or a task run this turn scheduled work
            // already due.
            return Next::Again;
        }
        tracing::trace!(timer = &*self.name, target, "core idle until its target");
        Next::Sleep(
            (target != NEVER)
                .then(|| self.clock.instant_of(target))
                .flatten(),
        )
    }

    fn is_closed(&self) -> bool {
        self.closed().is_some()
    }

    fn woke(&self) {
        self.counters.wakeups.fetch_add(1, Ordering::Relaxed);
    }

    fn reaper_gone(&self) {
        if let Some(jobs) = self.close(Closed::ReaperGone) {
            tracing::warn!(
                timer = &*self.name,
                abandoned = jobs.len(),
                "timer reaper stopped without a shutdown"
            );
            for job in jobs {
                self.panics
                    .run("an abandoned job", || job.abandon(Closed::ReaperGone));
            }
        }
    }
}

/// Where a new core's reaper comes from.
pub(crate) enum Host<'a> {
    /// A reaper of its own, spawned on this runtime; it ends with the core.
    Own(tokio::runtime::Handle),
    /// A reaper shared with other cores.
    Shared(&'a Reaper),
}

/// What one reaper task serves: its cores, the [`Reaper`] handles that keep it
/// running, and the notification that wakes it.
#[derive(Debug)]
struct Hub {
    notify: Notify,
    inner: Mutex<HubInner>,
}

#[derive(Default)]
struct HubInner {
    /// The open cores it serves (a closed core is let go of on the next turn).
    cores: Vec<Arc<dyn Served>>,
    /// Live [`Reaper`] handles.
    handles: usize,
    /// The task has ended: no core can be attached any more.
    stopped: bool,
}

impl std::fmt::Debug for HubInner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HubInner")
            .field("cores", &self.cores.len())
            .field("handles", &self.handles)
            .field("stopped", &self.stopped)
            .finish()
    }
}

impl Hub {
    fn new() -> Hub {
        Hub {
            notify: Notify::new(),
            inner: Mutex::new(HubInner::default()),
        }
    }

    fn attach(&self, core: Arc<dyn Served>) -> Result<(), BuildError> {
        let mut inner = lock(&self.inner);
        if inner.stopped {
            return Err(BuildError::reaper_stopped());
        }
        inner.cores.push(core);
        Ok(())
    }
}

/// A reaper task that several purgatories and timers share, instead of each
/// spawning its own.
///
/// A broker keeps several purgatories (produce, fetch, join, heartbeat) and a
/// timer or two; by default each spawns a reaper task of its own. Built with
/// [`PurgatoryBuilder::reaper`](crate::PurgatoryBuilder::reaper) or
/// [`TimerBuilder::reaper`](crate::TimerBuilder::reaper), they are served by this
/// one task instead: one sleep, on the earliest deadline of them all, and one
/// wake-up per distinct due time. Each keeps its own wheel, settings, limits,
/// counters and shutdown.
///
/// # Lifecycle
///
/// - **Owned** (the default, without a `Reaper`): the reaper is spawned by
///   `build` and ends when its purgatory or timer shuts down (explicitly, or when
///   its last owning clone is dropped).
/// - **Shared**: the task is spawned by [`Reaper::start`] and keeps running while
///   a `Reaper` clone exists or a purgatory or timer built on it is open. It ends
///   on its own once the last of these goes; shutting one purgatory down does not
///   affect the others it serves.
///
/// If the task is aborted or its runtime stops first, every purgatory and timer
/// it serves is closed as with their own reaper gone (handles resolve to
/// `ReaperGone`, registration fails) and later builds on it fail
/// ([`BuildError::is_reaper_stopped`]).
///
/// # Concurrency
///
/// Operations run by the reaper (expiries, timer tasks) run one after another on
/// its task, for every purgatory and timer it serves: a slow timer task delays
/// the expiries of the purgatories beside it. Keep tasks short, or give the slow
/// ones a reaper of their own.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
/// use std::time::Duration;
/// use tokio_purgatory::{Completion, Operation, Purgatory, Reaper, Timer};
///
/// struct Wait;
/// impl Operation for Wait {
///     type Output = &'static str;
///     fn try_complete(&mut self) -> Option<&'static str> { None }
///     fn on_expiration(self) -> &'static str { "timed out" }
/// }
///
/// let reaper = Reaper::start().unwrap();
/// let produce: Purgatory<u32, Wait> =
///     Purgatory::builder().name("produce").reaper(&reaper).build().unwrap();
/// let fetch: Purgatory<u32, Wait> =
///     Purgatory::builder().name("fetch").reaper(&reaper).build().unwrap();
/// let timer = Timer::builder().name("heartbeat").reaper(&reaper).build().unwrap();
/// assert_eq!(reaper.serving(), 3);
///
/// let a = produce.try_complete_else_watch(Wait, Duration::from_millis(30), [1]).unwrap();
/// let b = fetch.try_complete_else_watch(Wait, Duration::from_millis(20), [1]).unwrap();
/// let beat = timer.sleep(Duration::from_millis(10));
/// beat.await.unwrap();
/// assert_eq!(b.await, Ok(Completion::Expired("timed out")));
/// assert_eq!(a.await, Ok(Completion::Expired("timed out")));
///
/// // One shuts down (its last owner is dropped); the others are served on.
/// drop(fetch);
/// tokio::task::yield_now().await;
/// assert_eq!(reaper.serving(), 2);
/// # }
/// ```
#[derive(Debug)]
pub struct Reaper {
    hub: Arc<Hub>,
}

impl Reaper {
    /// Spawns a shared reaper task on the current Tokio runtime.
    ///
    /// # Errors
    ///
    /// When no runtime is current ([`BuildError::is_no_runtime`]).
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let reaper = tokio_purgatory::Reaper::start().unwrap();
    /// assert_eq!(reaper.serving(), 0);
    /// # }
    /// ```
    pub fn start() -> Result<Reaper, BuildError> {
        Ok(Reaper::start_on(&runtime_handle(None)?))
    }

    /// Spawns a shared reaper task on the runtime of `handle`.
    ///
    /// # Examples
    ///
    /// ```
    /// // Started from a thread outside the runtime.
    /// let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    /// let reaper = tokio_purgatory::Reaper::start_on(rt.handle());
    /// let timer = tokio_purgatory::Timer::builder().reaper(&reaper).build().unwrap();
    /// assert!(!timer.is_shutdown());
    /// ```
    pub fn start_on(handle: &tokio::runtime::Handle) -> Reaper {
        let hub = Arc::new(Hub::new());
        lock(&hub.inner).handles = 1;
        handle.spawn(run_reaper(ReaperGuard(hub.clone())));
        Reaper { hub }
    }

    /// How many open purgatories and timers this reaper serves (a purgatory shut
    /// down is let go of on the reaper's next turn).
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// use tokio_purgatory::{Reaper, Timer};
    /// let reaper = Reaper::start().unwrap();
    /// let timer = Timer::builder().reaper(&reaper).build().unwrap();
    /// assert_eq!(reaper.serving(), 1);
    /// # drop(timer);
    /// # }
    /// ```
    pub fn serving(&self) -> usize {
        lock(&self.hub.inner)
            .cores
            .iter()
            .filter(|c| !c.is_closed())
            .count()
    }

    /// Whether the reaper task has ended (aborted, or its runtime stopped): what
    /// it served is closed, and nothing more can be built on it. While a
    /// `Reaper` exists, the task does not end on its own.
    ///
    /// # Examples
    ///
    /// ```
    /// let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    /// let reaper = tokio_purgatory::Reaper::start_on(rt.handle());
    /// assert!(!reaper.is_stopped());
    /// drop(rt); // the runtime stops, and its tasks with it
    /// assert!(reaper.is_stopped());
    /// ```
    pub fn is_stopped(&self) -> bool {
        lock(&self.hub.inner).stopped
    }
}

impl Clone for Reaper {
    fn clone(&self) -> Reaper {
        lock(&self.hub.inner).handles += 1;
        Reaper {
            hub: self.hub.clone(),
        }
    }
}

impl Drop for Reaper {
    fn drop(&mut self) {
        let last = {
            let mut inner = lock(&self.hub.inner);
            inner.handles -= 1;
            inner.handles == 0
        };
        if last {
            // The task ends once what it serves has closed too.
            self.hub.notify.notify_one();
        }
    }
}

/// Owned by the reaper task. If the task is dropped before it ended on its own
/// (aborted, or its runtime stopped), every core it serves is closed as
/// [`Closed::ReaperGone`] and every waiting job is abandoned, so nothing waits on
/// a timer that will never fire.
struct ReaperGuard(Arc<Hub>);

impl Drop for ReaperGuard {
    fn drop(&mut self) {
        let cores = {
            let mut inner = lock(&self.0.inner);
            inner.stopped = true;
            std::mem::take(&mut inner.cores)
        };
        for core in cores {
            core.reaper_gone();
        }
    }
}

async fn run_reaper(guard: ReaperGuard) {
    let hub = &*guard.0;
    let mut serving: Vec<Arc<dyn Served>> = Vec::new();
    let mut closed: Vec<Arc<dyn Served>> = Vec::new();
    let mut sleep = std::pin::pin!(tokio::time::sleep_until(far_future(Instant::now())));
    loop {
        {
            let mut inner = lock(&hub.inner);
            let mut i = 0;
            while i < inner.cores.len() {
                if inner.cores[i].is_closed() {
                    closed.push(inner.cores.swap_remove(i));
                } else {
                    i += 1;
                }
            }
            if inner.cores.is_empty() && inner.handles == 0 {
                // Nothing to serve, and nobody can give it more.
                inner.stopped = true;
                break;
            }
            serving.extend(inner.cores.iter().cloned());
        }
        // Let go of closed cores with the lock released.
        closed.clear();
        let mut again = false;
        let mut wake_at: Option<Instant> = None;
        for core in &serving {
            match core.serve() {
                Next::Again => again = true,
                Next::Sleep(Some(at)) => wake_at = Some(wake_at.map_or(at, |w| w.min(at))),
                Next::Sleep(None) => {}
            }
        }
        if again {
            // Let other tasks run, then go on.
            serving.clear();
            tokio::task::yield_now().await;
            continue;
        }
        match wake_at {
            Some(at) => {
                sleep.as_mut().reset(at);
                // Whichever comes first: a notification (checked first) or the sleep.
                let mut notified = std::pin::pin!(hub.notify.notified());
                std::future::poll_fn(|cx| {
                    if notified.as_mut().poll(cx).is_ready() || sleep.as_mut().poll(cx).is_ready() {
                        std::task::Poll::Ready(())
                    } else {
                        std::task::Poll::Pending
                    }
                })
                .await;
            }
            None => hub.notify.notified().await,
        }
        for core in serving.drain(..) {
            core.woke();
        }
    }
    // Ended on its own: nothing is left for the guard to close.
    drop(closed);
    drop(guard);
}

/// A tick meaning "nothing scheduled": the largest the wake target holds.
const NEVER: u64 = TURNING - 1;
/// Set while the reaper is in a turn.
const TURNING: u64 = 1 << 63;

/// The reaper's next wake-up tick, and whether it is in a turn (see the module's
/// wake protocol).
#[derive(Debug)]
pub(crate) struct WakeTarget(crate::sync::AtomicU64);

impl WakeTarget {
    pub(crate) fn new() -> WakeTarget {
        WakeTarget(crate::sync::AtomicU64::new(NEVER))
    }

    /// An entry due at `tick` was inserted (after it is in the wheel). Lowers the
    /// target to `tick`; returns whether the reaper must be notified: it is asleep
    /// and would wake later than `tick`.
    pub(crate) fn lower(&self, tick: u64) -> bool {
        let tick = tick.min(NEVER);
        let mut cur = self.0.load(Ordering::SeqCst);
        loop {
            if tick >= cur & NEVER {
                return false;
            }
            match self.0.compare_exchange_weak(
                cur,
                (cur & TURNING) | tick,
                Ordering::SeqCst,
                Ordering::SeqCst,
            ) {
                Ok(_) => return cur & TURNING == 0,
                Err(actual) => cur = actual,
            }
        }
    }

    /// The reaper starts a turn: inserts from now on lower the target silently.
    pub(crate) fn begin_turn(&self) {
        // A read-modify-write, like every other change of the target: with a plain
        // store, loom found an insert inside the turn reading the value a racing
        // insert wrote before the turn began, and notifying.
        self.0.swap(TURNING | NEVER, Ordering::SeqCst);
    }

    /// A caller whose clock reads `now` finds the target passed while the reaper
    /// sleeps (Tokio's timer wakes a sleeper up to about two milliseconds after
    /// the instant asked for): claims the turn, as [`begin_turn`](Self::begin_turn)
    /// would, and returns true so that the caller notifies the reaper at once. A
    /// caller that finds the target ahead, or a turn already claimed, pays one
    /// atomic load. While claimed, inserts lower the target silently, as during a
    /// turn; the notification makes the reaper take the turn that ends the claim.
    pub(crate) fn overdue(&self, now: u64) -> bool {
        let cur = self.0.load(Ordering::SeqCst);
        if cur & TURNING != 0 || cur & NEVER > now {
            return false;
        }
        self.0
            .compare_exchange(cur, cur | TURNING, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
    }

    /// The reaper ends a turn, having found `next` as the earliest due tick in the
    /// wheels: returns the tick to sleep until, the earlier of `next` and anything
    /// inserted during the turn. Inserts from now on notify.
    pub(crate) fn end_turn(&self, next: u64) -> u64 {
        let next = next.min(NEVER);
        let mut cur = self.0.load(Ordering::SeqCst);
        loop {
            let target = (cur & NEVER).min(next);
            match self
                .0
                .compare_exchange_weak(cur, target, Ordering::SeqCst, Ordering::SeqCst)
            {
                Ok(_) => return target,
                Err(actual) => cur = actual,
            }
        }
    }
}

#[cfg(all(test, purgatory_loom))]
mod loom_wake {
    //! The wake protocol under loom: the reaper's turn (read the wheels, end the
    //! turn, sleep on the target unless notified) racing an insert from another
    //! thread. The insert is never slept through, and an insert made inside the
    //! turn leaves no notification behind.

    use super::WakeTarget;
    use loom::sync::atomic::{AtomicBool, AtomicU64};
    use loom::sync::{Arc, Mutex};
    use loom::thread;
    use std::sync::atomic::Ordering::SeqCst;

    /// The wheels, reduced to their earliest tick.
    struct Model {
        wake: WakeTarget,
        wheel: Mutex<u64>,
        /// `Notify`'s permit.
        permit: AtomicBool,
        /// The tick the reaper went to sleep on.
        slept_until: AtomicU64,
    }

    /// Returns whether it notified.
    fn insert(m: &Model, tick: u64) -> bool {
        {
            let mut w = m.wheel.lock().unwrap();
            *w = (*w).min(tick);
        }
        let notify = m.wake.lower(tick);
        if notify {
            m.permit.store(true, SeqCst);
        }
        notify
    }

    fn reaper_turn(m: &Model) {
        m.wake.begin_turn();
        let next = *m.wheel.lock().unwrap();
        m.slept_until.store(m.wake.end_turn(next), SeqCst);
    }

    fn model() -> Arc<Model> {
        Arc::new(Model {
            wake: WakeTarget::new(),
            wheel: Mutex::new(u64::MAX),
            permit: AtomicBool::new(false),
            slept_until: AtomicU64::new(0),
        })
    }

    #[test]
    fn loom_an_insert_racing_a_turn_is_never_slept_through() {
        loom::model(|| {
            let m = model();
            let t = {
                let m = m.clone();
                thread::spawn(move || {
                    insert(&m, 10);
                })
            };
            reaper_turn(&m);
            t.join().unwrap();
            let slept = m.slept_until.load(SeqCst);
            assert!(
                slept <= 10 || m.permit.load(SeqCst),
                "slept until {slept} with an entry due at 10 and no notification"
            );
        });
    }

    /// A caller that finds the reaper overdue claims the turn and notifies, while
    /// the reaper ends its turn and an insert races both: the claim never leaves
    /// the reaper asleep with the turn bit set (which would silence every later
    /// insert), and the insert is not slept through.
    #[test]
    fn loom_an_overdue_claim_racing_a_turn_and_an_insert_loses_no_wake_up() {
        loom::model(|| {
            let m = model();
            // The reaper slept until tick 5 and is late; the wheel's earliest
            // entry is at 9 by now (the one at 5 was removed: the target is a
            // lower bound).
            m.wake.begin_turn();
            m.wake.end_turn(5);
            *m.wheel.lock().unwrap() = 9;
            let poker = {
                let m = m.clone();
                thread::spawn(move || {
                    if m.wake.overdue(7) {
                        m.permit.store(true, SeqCst);
                    }
                })
            };
            let producer = {
                let m = m.clone();
                thread::spawn(move || {
                    insert(&m, 3);
                })
            };
            // The reaper wakes on its own timer meanwhile.
            reaper_turn(&m);
            poker.join().unwrap();
            producer.join().unwrap();
            // The reaper sleeps: a permit wakes it for one more turn.
            if m.permit.swap(false, SeqCst) {
                reaper_turn(&m);
            }
            let slept = m.slept_until.load(SeqCst);
            assert!(slept <= 3, "slept until {slept} with an entry due at 3");
            assert!(
                m.wake.lower(1),
                "a sleeping reaper must be reachable by the next insert"
            );
        });
    }

    #[test]
    fn loom_an_insert_during_the_turn_leaves_no_notification() {
        loom::model(|| {
            let m = model();
            // Another producer races the whole time.
            let t = {
                let m = m.clone();
                thread::spawn(move || {
                    insert(&m, 50);
                })
            };
            // A task run by the reaper reschedules itself inside the turn.
            m.wake.begin_turn();
            let notified = insert(&m, 20);
            let next = *m.wheel.lock().unwrap();
            let target = m.wake.end_turn(next);
            t.join().unwrap();
            assert!(target <= 20, "the rescheduled entry is slept until");
            assert!(!notified, "an insert inside the turn woke the reaper again");
        });
    }
}

#[cfg(all(test, not(purgatory_loom)))]
mod tests {
    use super::*;

    /// The wake protocol's answers, one step at a time: who must be notified,
    /// and what the reaper sleeps until after a turn.
    #[test]
    fn the_wake_target_notifies_only_a_sleeping_reaper_about_earlier_work() {
        let w = WakeTarget::new();
        assert!(w.lower(100), "asleep on nothing: notify");
        assert!(!w.lower(200), "later than the target: no");
        assert!(!w.lower(100), "the same tick: no");
        assert!(w.lower(50), "earlier: notify");
        w.begin_turn();
        assert!(!w.lower(10), "during a turn: lowered silently");
        assert!(!w.lower(30), "later than what the turn holds: no");
        assert_eq!(w.end_turn(70), 10, "the turn's insert is kept");
        assert!(!w.lower(20));
        assert!(w.lower(5));
        w.begin_turn();
        assert_eq!(w.end_turn(40), 40, "a turn starts from nothing");
        w.begin_turn();
        assert_eq!(w.end_turn(u64::MAX), NEVER, "nothing scheduled");
        assert!(!w.lower(u64::MAX), "never is not earlier than never");
    }

    /// An overdue target is claimed once: the first caller to see it notifies,
    /// later ones and callers during a turn do not, and the turn the claim asks
    /// for ends it.
    #[test]
    fn an_overdue_target_is_claimed_once() {
        let w = WakeTarget::new();
        assert!(!w.overdue(1_000), "nothing scheduled is never overdue");
        assert!(w.lower(100));
        assert!(!w.overdue(99), "not yet due");
        assert!(w.overdue(100), "due: the first caller claims the turn");
        assert!(!w.overdue(150), "claimed already");
        assert!(!w.lower(50), "inserts during a claim lower silently");
        w.begin_turn();
        // The turn finds the entry due at 50 in the wheel.
        assert_eq!(w.end_turn(50), 50);
        assert!(w.lower(40), "the claim ended: inserts notify again");
        assert!(!w.overdue(39));
        assert!(w.overdue(60));
        w.begin_turn();
        assert!(!w.overdue(1_000), "during a turn: no claim");
        assert_eq!(w.end_turn(u64::MAX), NEVER);
    }
}
