//! The reaper task, and [`Reaper`], the handle of one shared by several cores.
//!
//! One reaper task serves one core (a purgatory's or a timer's own) or several
//! (a shared [`Reaper`]): the task holds a [`Hub`] listing the cores, each seen
//! through the [`Served`] trait whatever its jobs' type, and sleeps on the
//! earliest of their targets. Each core keeps its own wake target (`wake.rs`);
//! they share the hub's `Notify`. The task lets go of a core once it is closed,
//! and ends when no core is left and no `Reaper` handle can attach another.

use std::future::Future;
use std::sync::Arc;

use tokio::sync::Notify;
use tokio::time::Instant;

use crate::clock::far_future;
use crate::contain::quietly;
use crate::settings::{runtime_handle, BuildError};
use crate::sync::{lock, Mutex};

/// What the reaper task needs of a core, whatever its jobs' type: one task can
/// so serve the cores of several purgatories and timers.
pub(crate) trait Served: Send + Sync {
    /// The reaper's turn begins: inserts from now on lower the core's wake
    /// target silently (see `wake.rs`), whichever core the reaper serves, until
    /// [`end_turn`](Self::end_turn). The reaper begins the turn of every core
    /// it serves before it serves any, so that a task of one core scheduling
    /// on another costs no wake-up.
    fn begin_turn(&self);
    /// Runs what is due, the turn begun.
    fn serve(&self) -> Turn;
    /// The turn ends, after every core was served: what the reaper does next
    /// for this core.
    fn end_turn(&self, turn: Turn) -> Next;
    /// Whether the core is closed (the reaper lets go of it).
    fn is_closed(&self) -> bool;
    /// The reaper woke from a sleep.
    fn woke(&self);
    /// The reaper task is gone: closes the core and abandons what waits in it.
    fn reaper_gone(&self);
}

/// What a core's turn found: whether a batch was cut short, the earliest
/// due tick left in its wheels, the tick the turn read as now, and whether
/// it left the wheels empty.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Turn {
    pub(crate) more: bool,
    pub(crate) next: u64,
    pub(crate) now: u64,
    pub(crate) emptied: bool,
}

/// What a core asks of the reaper after a turn.
pub(crate) enum Next {
    /// More is due right now.
    Again,
    /// Sleep until this instant at the latest (`None`: nothing is scheduled).
    Sleep(Option<Instant>),
}

/// Where a new core's reaper comes from.
pub(crate) enum Host<'a> {
    /// A reaper of its own, spawned on this runtime; it ends with the core.
    Own(tokio::runtime::Handle),
    /// A reaper shared with other cores.
    Shared(&'a Reaper),
}

impl<'a> Host<'a> {
    /// Where a core's reaper comes from: the shared one given, or one of its
    /// own spawned on `handle`'s runtime (the current one when `None`).
    pub(crate) fn new(
        shared: Option<&'a Reaper>,
        handle: Option<&tokio::runtime::Handle>,
    ) -> Result<Host<'a>, BuildError> {
        match shared {
            Some(reaper) => Ok(Host::Shared(reaper)),
            None => Ok(Host::Own(runtime_handle(handle)?)),
        }
    }

    /// The clock's reading on the reaper's runtime, where the reaper reads
    /// it: a core's origin. Read here, in the builder's context, it would be
    /// another runtime's when the two differ (a paused runtime's clock runs
    /// ahead of or behind the real one), and every deadline would be judged
    /// against that.
    pub(crate) fn now(&self) -> tokio::time::Instant {
        let runtime = match self {
            Host::Own(rt) => Some(rt.clone()),
            Host::Shared(reaper) => lock(&reaper.hub.inner).runtime.clone(),
        };
        let _on = runtime.as_ref().map(tokio::runtime::Handle::enter);
        tokio::time::Instant::now()
    }
}

/// What a reaper did for one purgatory or timer: its turns (each takes out
/// and runs what is due, up to the batch size per shard), the time they took,
/// and the most entries one turn expired. A turn's time includes the
/// expiries' own code (`on_expiration`, timer tasks), and is measured on the
/// wall clock (`std::time::Instant`), so it counts under Tokio's paused or
/// advanced clock too.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
/// use std::time::Duration;
/// use tokio_purgatory::Timer;
///
/// let timer = Timer::new();
/// timer.sleep(Duration::from_millis(5)).await.unwrap();
/// let r = timer.metrics().reaper;
/// assert!(r.turns >= 1);
/// assert_eq!(r.largest_batch, 1);
/// # }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct ReaperMetrics {
    /// Turns taken: each looks at the purgatory's or timer's wheels and runs
    /// what is due. A [`Reaper`] shared with others looks at each of them on
    /// every turn it takes, so each counts every turn, whether or not it had
    /// anything due (as each counts every wake-up).
    pub turns: u64,
    /// The turns' time summed: how busy the reaper was.
    pub busy: std::time::Duration,
    /// The longest turn.
    pub longest_turn: std::time::Duration,
    /// The most entries one turn expired.
    pub largest_batch: u64,
}

/// What one reaper task serves: its cores, the [`Reaper`] handles that keep it
/// running, and the notification that wakes it.
pub(crate) struct Hub {
    notify: Notify,
    inner: Mutex<HubInner>,
    /// The instant the task sleeps until, set before it sleeps; `None` while
    /// it is awake, and while it sleeps with nothing scheduled. A core
    /// whose wake target an insert lowered notifies the task only if it
    /// sleeps past that insert's deadline ([`Hub::sleeps_past`]): another
    /// core may hold an earlier one.
    alarm: Mutex<Option<Instant>>,
}

/// Nothing behind its lock, which is not held while a formatter writes.
impl std::fmt::Debug for Hub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hub").finish_non_exhaustive()
    }
}

#[derive(Default)]
struct HubInner {
    /// The open cores it serves (a closed core is let go of on the next turn).
    cores: Vec<Arc<dyn Served>>,
    /// Live [`Reaper`] handles.
    handles: usize,
    /// The task has ended: no core can be attached any more.
    stopped: bool,
    /// The runtime a shared reaper runs on, while the task runs (`None` for
    /// a reaper of its own, whose core is given the runtime directly): let go
    /// of when the task ends, so that a `Reaper` kept past its runtime keeps
    /// none of that runtime's resources.
    runtime: Option<tokio::runtime::Handle>,
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
    fn new(runtime: Option<tokio::runtime::Handle>) -> Hub {
        Hub {
            notify: Notify::new(),
            inner: Mutex::new(HubInner {
                runtime,
                ..HubInner::default()
            }),
            alarm: Mutex::new(None),
        }
    }

    /// The hub a new core is served by: a new one for a reaper of its own, or
    /// the shared reaper's.
    pub(crate) fn for_host(host: &Host<'_>) -> Arc<Hub> {
        match host {
            Host::Own(_) => Arc::new(Hub::new(None)),
            Host::Shared(reaper) => reaper.hub.clone(),
        }
    }

    /// Puts `core` in this hub's care, and spawns the reaper task when the core
    /// has one of its own. Fails when a shared reaper has stopped.
    pub(crate) fn serve(
        self: &Arc<Self>,
        core: Arc<dyn Served>,
        host: Host<'_>,
    ) -> Result<(), BuildError> {
        {
            let mut inner = lock(&self.inner);
            if inner.stopped {
                return Err(BuildError::reaper_stopped());
            }
            inner.cores.push(core);
        }
        if let Host::Own(rt) = host {
            rt.spawn(run_reaper(ReaperGuard(self.clone())));
        }
        Ok(())
    }

    /// Wakes the reaper task (a core's target moved earlier, or is overdue).
    #[inline]
    pub(crate) fn wake(&self) {
        self.notify.notify_one();
    }

    /// Whether the task would wake later than `deadline` (`None`: past what
    /// `Instant` holds), or may: a core's insert that lowered the core's wake
    /// target then notifies it. Called after that lowering: the task clears
    /// its alarm as it wakes, before it lists the cores it serves and ends
    /// any turn, and each end of a turn reads the target the insert lowered
    /// (a read-modify-write of it), so an insert either is seen by the end
    /// of its core's turn or finds the alarm cleared or set by that turn's
    /// end; an insert into a core attached after the listing finds it
    /// cleared.
    pub(crate) fn sleeps_past(&self, deadline: Option<Instant>) -> bool {
        match (*lock(&self.alarm), deadline) {
            (None, _) => true,
            (Some(_), None) => false,
            (Some(at), Some(deadline)) => deadline < at,
        }
    }

    /// Sets the alarm the task is about to sleep until (see [`Hub::sleeps_past`]).
    fn set_alarm(&self, at: Option<Instant>) {
        *lock(&self.alarm) = at;
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
/// assert_eq!(reaper.serving(), 2);
/// # }
/// ```
pub struct Reaper {
    hub: Arc<Hub>,
}

/// What it serves and whether it stopped, read before anything is written
/// (no lock of the reaper's is held while the formatter writes).
impl std::fmt::Debug for Reaper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (serving, stopped) = (self.serving(), self.is_stopped());
        f.debug_struct("Reaper")
            .field("serving", &serving)
            .field("stopped", &stopped)
            .finish()
    }
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

    /// Spawns a shared reaper task on the runtime of `handle`. On a runtime
    /// already shut down the task never runs: the reaper reads as stopped
    /// ([`is_stopped`](Self::is_stopped)) and builds on it fail
    /// ([`BuildError::is_reaper_stopped`]).
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
        let hub = Arc::new(Hub::new(Some(handle.clone())));
        lock(&hub.inner).handles = 1;
        handle.spawn(run_reaper(ReaperGuard(hub.clone())));
        Reaper { hub }
    }

    /// How many open purgatories and timers this reaper serves (one shut down
    /// is not counted from then on; the task lets go of it on its next turn).
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
        let (cores, runtime) = {
            let mut inner = lock(&self.0.inner);
            inner.stopped = true;
            (std::mem::take(&mut inner.cores), inner.runtime.take())
        };
        drop(runtime);
        for core in cores {
            core.reaper_gone();
            let_go(core);
        }
    }
}

/// Drops a reaper's hold on a core. The last hold drops the core, and with it
/// what the application lent it (the `metrics` recorder's handles, code of
/// the application's own): a panic there is swallowed, so that it cannot end
/// the reaper task and the other purgatories and timers it serves.
fn let_go(core: Arc<dyn Served>) {
    quietly(move || drop(core));
}

async fn run_reaper(guard: ReaperGuard) {
    let hub = &*guard.0;
    let mut serving: Vec<Arc<dyn Served>> = Vec::new();
    let mut closed: Vec<Arc<dyn Served>> = Vec::new();
    // What each core's turn found, until every core was served.
    let mut turns: Vec<Option<Turn>> = Vec::new();
    let mut sleep = std::pin::pin!(tokio::time::sleep_until(far_future(Instant::now())));
    loop {
        // Inserts notify while the task is awake, unless their core's turn has
        // begun (a core attached during this turn is not served in it).
        hub.set_alarm(None);
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
                inner.runtime = None;
                break;
            }
            serving.extend(inner.cores.iter().cloned());
        }
        turns.clear();
        turns.resize(serving.len(), None);
        // Let go of closed cores with the lock released.
        closed.drain(..).for_each(let_go);
        let mut again = false;
        let mut wake_at: Option<Instant> = None;
        serving.iter().for_each(|core| core.begin_turn());
        for (core, turn) in serving.iter().zip(turns.iter_mut()) {
            // One closed earlier in this turn (by a task or an operation of
            // another core served by this task) is left as it was closed: its
            // counters keep their values after a shutdown.
            if !core.is_closed() {
                *turn = Some(core.serve());
            }
        }
        for (core, turn) in serving.iter().zip(turns.iter_mut()) {
            let Some(turn) = turn.take() else { continue };
            match core.end_turn(turn) {
                Next::Again => again = true,
                Next::Sleep(Some(at)) => wake_at = Some(wake_at.map_or(at, |w| w.min(at))),
                Next::Sleep(None) => {}
            }
        }
        if again {
            // Let other tasks run, then go on.
            serving.drain(..).for_each(let_go);
            tokio::task::yield_now().await;
            continue;
        }
        hub.set_alarm(wake_at);
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
        // Every core served now counts the wake-up: one attached while the
        // task slept (whose first insert may be what woke it) too.
        serving.drain(..).for_each(let_go);
        serving.extend(lock(&hub.inner).cores.iter().cloned());
        for core in serving.drain(..) {
            // A core closed meanwhile (its close is what woke the task) keeps
            // its counts as they were at the close.
            if !core.is_closed() {
                core.woke();
            }
            let_go(core);
        }
    }
    // Ended on its own: nothing is left for the guard to close.
    closed.drain(..).for_each(let_go);
    drop(guard);
}
