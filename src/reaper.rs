//! The concurrent timer core and its reaper task.
//!
//! It wraps the pure [`Wheel`](crate::wheel::Wheel) in `N` mutex-guarded shards (an
//! inserting thread keeps to one shard, so producers on different threads rarely
//! meet), converts [`Instant`]s to ticks, and runs the reaper: one Tokio task that
//! sleeps until the earliest bucket of any shard is due, takes the due entries out
//! in bounded batches under the shard lock, and runs them with every lock released.
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
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;

use crate::loom::MutexGuard;

use tokio::sync::Notify;
use tokio::time::Instant;

use crate::clock::{far_future, Clock};
use crate::loom::{lock, thread_index, Mutex};
use crate::settings::Settings;
use crate::wheel::{Key, Wheel};

/// Work stored in the wheel: what to do when it expires, and when it is cleared out
/// unrun.
pub(crate) trait Job: Send + 'static {
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

/// Keeps a value on cache lines of its own (each shard's lock, and the
/// purgatory's hot counters).
#[derive(Debug)]
#[repr(align(128))]
pub(crate) struct Padded<T>(pub(crate) T);

/// Counters kept by the core (all monotonic).
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) wakeups: AtomicU64,
    pub(crate) expired: AtomicU64,
    pub(crate) panicked: AtomicU64,
}

/// Shards of wheels, the clock and the reaper's wake-up state.
#[derive(Debug)]
pub(crate) struct Core<J> {
    shards: Box<[Padded<Mutex<Shard<J>>>]>,
    clock: Clock,
    wake: WakeTarget,
    notify: Notify,
    state: AtomicU8,
    /// Pending jobs, kept only when a limit is set (a shared counter is the one
    /// thing all producers would contend on).
    pending: AtomicUsize,
    max_pending: Option<usize>,
    batch: usize,
    pub(crate) counters: Counters,
    pub(crate) name: Arc<str>,
}

impl<J: Job> Core<J> {
    /// Builds the core and spawns its reaper on `rt`. `settings` were validated
    /// by the builder.
    pub(crate) fn start(
        settings: &Settings,
        name: Arc<str>,
        max_pending: Option<usize>,
        rt: &tokio::runtime::Handle,
    ) -> Arc<Core<J>> {
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
        let core = Arc::new(Core {
            shards,
            clock: Clock::new(Instant::now(), settings.tick),
            wake: WakeTarget::new(),
            notify: Notify::new(),
            state: AtomicU8::new(RUNNING),
            pending: AtomicUsize::new(0),
            max_pending,
            batch: settings.batch.max(1),
            counters: Counters::default(),
            name,
        });
        let guard = ReaperGuard(core.clone());
        rt.spawn(run_reaper(guard));
        core
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
        let shard = (thread_index() % self.shards.len() as u64) as usize;
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
            self.notify.notify_one();
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
        self.notify.notify_one();
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
                    run_contained(&self.name, &self.counters, || job.expire());
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

/// Drops `value` with a panic in its `Drop` caught and handed to `on_panic`.
pub(crate) fn drop_contained<T>(value: T, on_panic: impl FnOnce(&(dyn std::any::Any + Send))) {
    if std::mem::needs_drop::<T>() {
        if let Err(panic) = catch_unwind(AssertUnwindSafe(move || drop(value))) {
            on_panic(&*panic);
        }
    }
}

/// Drops each of `values` on its own, containing each panic as [`drop_contained`]
/// does (a panic in one drop does not skip the rest).
pub(crate) fn drop_each_contained<T>(
    values: impl IntoIterator<Item = T>,
    mut on_panic: impl FnMut(&(dyn std::any::Any + Send)),
) {
    if std::mem::needs_drop::<T>() {
        for v in values {
            drop_contained(v, &mut on_panic);
        }
    }
}

/// Runs user code, containing and reporting a panic.
pub(crate) fn run_contained(name: &str, counters: &Counters, f: impl FnOnce()) {
    if let Err(panic) = catch_unwind(AssertUnwindSafe(f)) {
        note_panic(name, counters, &*panic);
    }
}

/// Counts and reports a panic caught in a timer task (or its `Drop`).
pub(crate) fn note_panic(name: &str, counters: &Counters, panic: &(dyn std::any::Any + Send)) {
    counters.panicked.fetch_add(1, Ordering::Relaxed);
    tracing::error!(
        timer = name,
        panic = panic_message(panic),
        "a timer task panicked; the reaper carries on"
    );
}

/// The text of a panic payload, when it has one.
pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("<non-string panic payload>")
}

/// Owned by the reaper task. If the task is dropped without the core having been
/// shut down (aborted, or its runtime stopped), the core is closed as
/// [`Closed::ReaperGone`] and every waiting job is abandoned, so nothing waits on a
/// timer that will never fire.
struct ReaperGuard<J: Job>(Arc<Core<J>>);

impl<J: Job> Drop for ReaperGuard<J> {
    fn drop(&mut self) {
        if let Some(jobs) = self.0.close(Closed::ReaperGone) {
            tracing::warn!(
                timer = &*self.0.name,
                abandoned = jobs.len(),
                "timer reaper stopped without a shutdown"
            );
            for job in jobs {
                run_contained(&self.0.name, &self.0.counters, || {
                    job.abandon(Closed::ReaperGone)
                });
            }
        }
    }
}

async fn run_reaper<J: Job>(guard: ReaperGuard<J>) {
    let core = &*guard.0;
    let mut scratch = Vec::with_capacity(core.batch.min(4096));
    let mut sleep = std::pin::pin!(tokio::time::sleep_until(far_future(Instant::now())));
    loop {
        if core.closed().is_some() {
            break;
        }
        core.wake.begin_turn();
        let (more, next, now) = core.turn(&mut scratch);
        let target = core.wake.end_turn(next);
        if more || target <= now {
            // More is due now (a batch was cut short, or a task run this turn
            // scheduled work already due): let other tasks run, then go on.
            tokio::task::yield_now().await;
            continue;
        }
        let wake_at = (target != NEVER)
            .then(|| core.clock.instant_of(target))
            .flatten();
        tracing::trace!(timer = &*core.name, target, "reaper sleeping");
        match wake_at {
            Some(at) => {
                sleep.as_mut().reset(at);
                // Whichever comes first: a notification (checked first) or the sleep.
                let mut notified = std::pin::pin!(core.notify.notified());
                std::future::poll_fn(|cx| {
                    if notified.as_mut().poll(cx).is_ready() || sleep.as_mut().poll(cx).is_ready() {
                        std::task::Poll::Ready(())
                    } else {
                        std::task::Poll::Pending
                    }
                })
                .await;
            }
            None => core.notify.notified().await,
        }
        core.counters.wakeups.fetch_add(1, Ordering::Relaxed);
    }
    // Closed by `close`, which already took every job out: dropping the guard
    // finds nothing left to abandon.
    drop(guard);
}

/// A tick meaning "nothing scheduled": the largest the wake target holds.
const NEVER: u64 = TURNING - 1;
/// Set while the reaper is in a turn.
const TURNING: u64 = 1 << 63;

/// The reaper's next wake-up tick, and whether it is in a turn (see the module's
/// wake protocol).
#[derive(Debug)]
pub(crate) struct WakeTarget(crate::loom::AtomicU64);

impl WakeTarget {
    pub(crate) fn new() -> WakeTarget {
        WakeTarget(crate::loom::AtomicU64::new(NEVER))
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

    #[test]
    fn panic_messages_are_read_from_either_payload() {
        let text: Box<dyn std::any::Any + Send> = Box::new("boom");
        assert_eq!(panic_message(&*text), "boom");
        let owned: Box<dyn std::any::Any + Send> = Box::new(String::from("owned boom"));
        assert_eq!(panic_message(&*owned), "owned boom");
        let other: Box<dyn std::any::Any + Send> = Box::new(7u32);
        assert_eq!(panic_message(&*other), "<non-string panic payload>");
    }

    #[test]
    fn each_drop_is_contained_on_its_own() {
        struct Loud(bool, std::sync::Arc<AtomicUsize>);
        impl Drop for Loud {
            fn drop(&mut self) {
                self.1.fetch_add(1, Ordering::SeqCst);
                if self.0 {
                    panic!("loud drop");
                }
            }
        }
        let dropped = std::sync::Arc::new(AtomicUsize::new(0));
        let mut caught = Vec::new();
        let values = [true, false, true, false].map(|p| Loud(p, dropped.clone()));
        drop_each_contained(values, |p| caught.push(panic_message(p).to_string()));
        assert_eq!(dropped.load(Ordering::SeqCst), 4, "every value dropped");
        assert_eq!(caught, ["loud drop", "loud drop"]);
        let mut seen = None;
        drop_contained(Loud(true, dropped.clone()), |p| {
            seen = Some(panic_message(p).to_string())
        });
        assert_eq!(seen.as_deref(), Some("loud drop"));
        // Values without drop glue are not even looked at.
        drop_contained(5u32, |_| unreachable!());
    }
}
