//! The handle of a scheduled task.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::task::{Chain, TimerJob, UnrunTask};
use crate::clock::deadline_after;
use crate::core::{Closed, Core, TimerKey};
use crate::sync::{lock, Mutex};

/// What became of a scheduled task, as read through its [`TaskHandle`]
/// ([`TaskHandle::status`]).
///
/// `Cancelled` is final, and so is `Done` for a one-shot task, which reads
/// `Done` from the moment the reaper takes it out to run it. A repeating task
/// reads `Done` while a run is under way and `Pending` again once the run has
/// put it back in the wheel.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
/// use std::time::Duration;
/// use tokio_purgatory::timer::TaskStatus;
/// use tokio_purgatory::Timer;
///
/// let timer = Timer::new();
/// let ran = timer.schedule(Duration::from_millis(10), || {}).unwrap();
/// let cancelled = timer.schedule(Duration::from_millis(10), || {}).unwrap();
/// let handed_back = timer.schedule(Duration::from_secs(60), || {}).unwrap();
/// assert_eq!(ran.status(), TaskStatus::Pending);
/// assert!(cancelled.cancel());
/// tokio::time::sleep(Duration::from_millis(20)).await;
/// assert_eq!(timer.shutdown().len(), 1);
/// assert_eq!(ran.status(), TaskStatus::Done);
/// assert_eq!(cancelled.status(), TaskStatus::Cancelled);
/// assert_eq!(handed_back.status(), TaskStatus::Done);
/// # }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TaskStatus {
    /// Waiting for its deadline.
    Pending,
    /// Cancelled through this handle: a one-shot task never ran; a repeating
    /// task was stopped before its chain ended (its earlier runs happened).
    Cancelled,
    /// No longer waiting: it ran (or panicked while running), or the timer was
    /// shut down (the task was handed back by `shutdown` or dropped).
    Done,
}

/// The handle of a scheduled task: cancel it, move it, or ask what became of
/// it (Netty calls it a `Timeout`). It is not a future: to bound how long a
/// future may run, use [`Timer::timeout`](super::Timer::timeout), which
/// returns a [`TimeoutFuture`](super::TimeoutFuture).
///
/// The handle holds a generation-tagged key, so a handle whose task is gone
/// does not touch a newer task that reuses the slot. The generation is 32
/// bits: only a handle kept while its slot is reused 2^32 times (each reset
/// takes the slot anew: about 50 days of 1,000 resets a second of one task)
/// could name a newer task again. It holds a reference to the
/// timer's wheels but does not keep the timer open: dropping the last
/// [`Timer`](super::Timer) clone shuts the timer down while handles exist.
/// Dropping the handle does **not** cancel the task.
///
/// # Concurrency
///
/// Its methods take `&self` and may be called from any thread, so it can be
/// shared (in an `Arc`) between the code that resets a timeout and the code that
/// cancels it. Resets and cancels through the same handle are serialised;
/// racing the reaper, each method's docs say which side wins.
///
/// # Shutdown
///
/// Once the timer is shut down (or its reaper is lost), the task is no longer in
/// the wheel: [`cancel`](Self::cancel) and [`reset`](Self::reset) return
/// `false`, [`cancel_and_take`](Self::cancel_and_take) returns `None`, and the
/// status reads [`Done`](TaskStatus::Done). A task not yet run comes back from
/// [`Timer::shutdown`](super::Timer::shutdown).
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
/// use std::sync::atomic::{AtomicBool, Ordering};
/// use std::sync::Arc;
/// use std::time::Duration;
/// use tokio_purgatory::timer::TaskStatus;
/// use tokio_purgatory::Timer;
///
/// let timer = Timer::new();
/// let fired = Arc::new(AtomicBool::new(false));
/// let flag = fired.clone();
/// let handle = timer
///     .schedule(Duration::from_millis(10), move || flag.store(true, Ordering::SeqCst))
///     .unwrap();
/// drop(handle); // does not cancel the task
/// tokio::time::sleep(Duration::from_millis(20)).await;
/// assert!(fired.load(Ordering::SeqCst));
///
/// // A request timeout, pushed back once and then cancelled by the answer.
/// let timeout = timer.schedule(Duration::from_secs(1), || println!("timed out")).unwrap();
/// assert!(timeout.reset(Duration::from_secs(2)));
/// assert!(timeout.cancel());
/// assert_eq!(timeout.status(), TaskStatus::Cancelled);
/// # }
/// ```
pub struct TaskHandle {
    core: Arc<Core<TimerJob>>,
    entry: Entry,
    cancelled: AtomicBool,
}

/// Its status and kind, read before anything is written (no lock of the
/// timer's is held while the formatter writes).
impl std::fmt::Debug for TaskHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let status = self.status();
        f.debug_struct("TaskHandle")
            .field("status", &status)
            .field("repeating", &matches!(self.entry, Entry::Repeating(_)))
            .finish_non_exhaustive()
    }
}

/// Where the task's entry is.
#[derive(Debug)]
enum Entry {
    /// A one-shot task's entry; `reset` moves it, and so changes its key
    /// (always `Some`: kept in an `Option` to share code with a chain's).
    Once(Mutex<Option<TimerKey>>),
    /// A repeating task's current entry, shared with the task.
    Repeating(Arc<Chain>),
}

impl TaskHandle {
    pub(super) fn new(core: Arc<Core<TimerJob>>, key: TimerKey) -> TaskHandle {
        TaskHandle {
            core,
            entry: Entry::Once(Mutex::new(Some(key))),
            cancelled: AtomicBool::new(false),
        }
    }

    pub(super) fn repeating(core: Arc<Core<TimerJob>>, chain: Arc<Chain>) -> TaskHandle {
        TaskHandle {
            core,
            entry: Entry::Repeating(chain),
            cancelled: AtomicBool::new(false),
        }
    }
}

impl TaskHandle {
    /// Cancels the task if it has not run: O(1), and the task is dropped at once,
    /// on this thread, with no lock held (a panic in its `Drop` is caught and
    /// counted in [`TimerMetrics::panicked`](super::TimerMetrics::panicked)). Returns whether this call cancelled it.
    /// A repeating task ([`Timer::schedule_repeating`](super::Timer::schedule_repeating))
    /// stops: `true` when this call stopped it, and no run starts afterwards. A
    /// chain that ended on its own (its task returned `None` or panicked, or the
    /// timer shut down) is not stopped again: `false`, and the status stays
    /// [`Done`](TaskStatus::Done).
    ///
    /// # Concurrent calls
    ///
    /// Racing the reaper, exactly one wins: either the task runs and `cancel`
    /// returns `false`, or it returns `true` and the task never runs. A
    /// repeating task running at that moment finishes that run and is then
    /// dropped (on the reaper) instead of rescheduled. Racing a shutdown,
    /// likewise: from the moment the timer reads shut down
    /// ([`Timer::is_shutdown`](super::Timer::is_shutdown)), `false`, and the
    /// shutdown hands the task back; a cancel that came first returns `true`,
    /// and the task is not handed back.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// use std::time::Duration;
    /// use tokio_purgatory::timer::TaskStatus;
    ///
    /// let timer = tokio_purgatory::Timer::new();
    /// let t = timer.schedule(Duration::from_secs(1), || unreachable!()).unwrap();
    /// assert!(t.cancel());
    /// assert!(!t.cancel(), "once");
    /// assert_eq!(t.status(), TaskStatus::Cancelled);
    /// # }
    /// ```
    pub fn cancel(&self) -> bool {
        let (cancelled, removed) = self.stop();
        if let Some(job) = removed {
            self.core.panics.drop_value("drop of a task", job);
        }
        cancelled
    }

    /// Cancels the task if it has not run, as [`cancel`](TaskHandle::cancel)
    /// does, and hands it back in an [`UnrunTask`] instead of dropping it: a
    /// retry cancelled because its answer came can still run its cleanup, or be
    /// scheduled again. `None` when the task ran, was cancelled before, was
    /// handed back by a shutdown, or is a repeating task (that stops, as with
    /// `cancel`, and is dropped).
    ///
    /// # Concurrent calls
    ///
    /// As `cancel`: racing the reaper, either the task runs and this returns
    /// `None`, or it returns the task and the task never runs.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// use std::time::Duration;
    ///
    /// let timer = tokio_purgatory::Timer::new();
    /// let t = timer.schedule(Duration::from_secs(1), || println!("retry")).unwrap();
    /// let task = t.cancel_and_take().expect("not run yet");
    /// assert!(t.cancel_and_take().is_none(), "once");
    /// task.run(); // here, now
    /// # }
    /// ```
    pub fn cancel_and_take(&self) -> Option<UnrunTask> {
        let (_, removed) = self.stop();
        let job = removed?;
        if matches!(self.entry, Entry::Repeating(_)) {
            self.core.panics.drop_value("drop of a task", job);
            return None;
        }
        job.0
            .stopped(Closed::Shutdown)
            .map(|task| UnrunTask { task })
    }

    /// Takes the task's entry out of the timer (stopping a repeating chain):
    /// whether this call cancelled it, and the entry it removed.
    fn stop(&self) -> (bool, Option<TimerJob>) {
        // `cancelled` is set under the lock of the slot, which `status` reads
        // under: a task never reads as done (its entry gone) and then as
        // cancelled.
        match &self.entry {
            Entry::Once(key) => {
                let key = lock(key);
                if self.core.closed().is_some() {
                    // Shut down: the shutdown hands the task back (or has).
                    return (false, None);
                }
                let removed = key.and_then(|key| self.core.remove(key));
                if removed.is_some() {
                    self.cancelled.store(true, Ordering::Release);
                }
                (removed.is_some(), removed)
            }
            Entry::Repeating(chain) => {
                let key = {
                    let mut key = lock(&chain.key);
                    // Shut down: the shutdown hands the task back (or has).
                    if self.core.closed().is_some() || chain.stopped.swap(true, Ordering::AcqRel) {
                        return (false, None);
                    }
                    self.cancelled.store(true, Ordering::Release);
                    key.take()
                };
                (true, key.and_then(|key| self.core.remove(key)))
            }
        }
    }

    /// Where the task's current entry is recorded.
    fn slot(&self) -> &Mutex<Option<TimerKey>> {
        match &self.entry {
            Entry::Once(key) => key,
            Entry::Repeating(chain) => &chain.key,
        }
    }

    /// Moves the task's deadline to `delay` from now, in O(1) (the entry moves
    /// from one bucket of the wheel to another), as tokio's
    /// [`time::Sleep::reset`](tokio::time::Sleep::reset) and tokio-util's
    /// `DelayQueue::reset` do: a heartbeat pushing a session timeout back, a
    /// retry brought forward. A deadline already past makes the task due at
    /// once. Returns whether it was moved.
    ///
    /// # Concurrent calls
    ///
    /// Returns `false`, and changes nothing, once the task has run, is running,
    /// was cancelled or handed back by `shutdown`: racing the reaper, either the
    /// reset wins and the task runs at the new deadline only, or the task runs
    /// (at the old one) and the reset returns `false`. Resets and cancels
    /// through the same handle are serialised.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// use std::sync::atomic::{AtomicBool, Ordering};
    /// use std::sync::Arc;
    /// use std::time::Duration;
    /// use tokio::time::advance;
    /// use tokio_purgatory::Timer;
    ///
    /// let timer = Timer::builder().build().unwrap();
    /// let dead = Arc::new(AtomicBool::new(false));
    /// let flag = dead.clone();
    /// let session = timer
    ///     .schedule(Duration::from_secs(10), move || flag.store(true, Ordering::SeqCst))
    ///     .unwrap();
    /// for _ in 0..3 {
    ///     advance(Duration::from_secs(8)).await;
    ///     assert!(session.reset(Duration::from_secs(10)), "heartbeat");
    /// }
    /// assert!(!dead.load(Ordering::SeqCst));
    /// advance(Duration::from_secs(10)).await;
    /// tokio::task::yield_now().await;
    /// assert!(dead.load(Ordering::SeqCst), "no heartbeat for 10 s");
    /// # }
    /// ```
    pub fn reset(&self, delay: Duration) -> bool {
        let now = Instant::now();
        self.reset_from(now, deadline_after(now, delay))
    }

    /// Moves the task's deadline to `deadline`, in O(1); as
    /// [`reset`](Self::reset), with an instant.
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
    /// use tokio_purgatory::Timer;
    ///
    /// let timer = Timer::builder().build().unwrap();
    /// let retry = timer.schedule(Duration::from_secs(60), || println!("retry")).unwrap();
    /// // The peer came back: retry in 100 ms instead.
    /// assert!(retry.reset_at(Instant::now() + Duration::from_millis(100)));
    /// assert!(retry.is_pending());
    /// # }
    /// ```
    pub fn reset_at(&self, deadline: impl Into<Instant>) -> bool {
        let deadline = deadline.into();
        self.reset_from(Instant::now(), deadline)
    }

    /// Moves the entry to `deadline`, `now` read once by the caller.
    fn reset_from(&self, now: Instant, deadline: Instant) -> bool {
        let mut key = lock(self.slot());
        match key.and_then(|k| self.core.reset(k, now, deadline)) {
            Some(moved) => {
                *key = Some(moved);
                true
            }
            None => false,
        }
    }

    /// Whether the task is waiting for its deadline (a repeating task: for its
    /// next run; not while a run is under way). A snapshot: the reaper may
    /// take the task out for running, or a shutdown hand it back, right after.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// use std::time::Duration;
    ///
    /// let timer = tokio_purgatory::Timer::new();
    /// let t = timer.schedule(Duration::from_millis(10), || {}).unwrap();
    /// assert!(t.is_pending());
    /// tokio::time::sleep(Duration::from_millis(20)).await;
    /// assert!(!t.is_pending());
    /// # }
    /// ```
    pub fn is_pending(&self) -> bool {
        let key = *lock(self.slot());
        key.is_some_and(|k| self.core.contains(k))
    }

    /// What became of the task: a snapshot, which the reaper running it or a
    /// shutdown may change right after.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// use std::time::Duration;
    /// use tokio_purgatory::timer::TaskStatus;
    ///
    /// let timer = tokio_purgatory::Timer::new();
    /// let t = timer.schedule(Duration::from_millis(10), || {}).unwrap();
    /// assert_eq!(t.status(), TaskStatus::Pending);
    /// tokio::time::sleep(Duration::from_millis(20)).await;
    /// assert_eq!(t.status(), TaskStatus::Done);
    /// # }
    /// ```
    pub fn status(&self) -> TaskStatus {
        // Read under the slot's lock, under which a cancel both removes the
        // entry and marks the task cancelled (see `stop`).
        let key = lock(self.slot());
        if self.cancelled.load(Ordering::Acquire) {
            TaskStatus::Cancelled
        } else if key.is_some_and(|k| self.core.contains(k)) {
            TaskStatus::Pending
        } else {
            TaskStatus::Done
        }
    }
}

/// Where a future scheduled with
/// [`Timer::schedule_async`](super::Timer::schedule_async) stands.
#[derive(Debug)]
pub(super) enum Start {
    /// In the wheel, or handed back by a shutdown and neither run nor
    /// dropped yet (`None`); or spawned as a Tokio task whose first poll has
    /// not come yet (its abort handle, once `start` has recorded it).
    Waiting(Option<tokio::task::AbortHandle>),
    /// Polled: the future has started (its task's abort handle, once `start`
    /// has recorded it; the first poll may come first).
    Running(Option<tokio::task::AbortHandle>),
    /// Returned `Ready`, panicked, or was dropped by its runtime.
    Finished,
    /// Cancelled, before or after it started, or dropped unrun.
    Cancelled,
}

impl Start {
    /// In the wheel or handed back: not spawned.
    pub(super) fn is_unspawned(&self) -> bool {
        matches!(self, Start::Waiting(None))
    }
}

/// Marks the future finished: when it returns `Ready` (before it is
/// dropped), and when dropped at the end of its task however that comes (it
/// panicked, its task was aborted, or a runtime shutting down dropped it
/// unpolled); unless it was cancelled.
struct Finish(Arc<Mutex<Start>>);

impl Finish {
    fn mark(&self) {
        let mut s = lock(&self.0);
        if !matches!(*s, Start::Cancelled) {
            *s = Start::Finished;
        }
    }
}

impl Drop for Finish {
    fn drop(&mut self) {
        self.mark();
    }
}

/// The task that runs a scheduled future: at its first poll it starts the
/// future unless a cancel came first (then the future is dropped there,
/// unpolled, with no lock held); once the future returns `Ready` it reads
/// as finished, before its drop runs.
async fn gated<Fut>(finish: Finish, future: Fut)
where
    Fut: std::future::Future<Output = ()>,
{
    {
        let mut s = lock(&finish.0);
        match &mut *s {
            Start::Cancelled => {
                drop(s);
                drop(future);
                return;
            }
            Start::Waiting(abort) => *s = Start::Running(abort.take()),
            Start::Running(_) | Start::Finished => {}
        }
    }
    let mut future = std::pin::pin!(future);
    std::future::poll_fn(|cx| {
        let polled = future.as_mut().poll(cx);
        if polled.is_ready() {
            finish.mark();
        }
        polled
    })
    .await;
}

/// The handle of a future scheduled with
/// [`Timer::schedule_async`](super::Timer::schedule_async): it waits in the
/// timer's wheel until its deadline, then runs as a Tokio task of its own on
/// the timer's runtime, where it may `.await` (a retry that writes to a
/// socket, a heartbeat that waits for its answer) with backpressure, instead
/// of running on the reaper task as [`Timer::schedule`](super::Timer::schedule)'s
/// closures do.
///
/// Dropping the handle neither cancels the future nor stops it once running.
///
/// # Concurrency
///
/// Its methods take `&self` and may be called from any thread; racing the
/// deadline, each method's docs say which side wins.
///
/// # Shutdown
///
/// A future that has not started when the timer is shut down comes back from
/// [`Timer::shutdown`](super::Timer::shutdown) inside an
/// [`UnrunTask`](super::UnrunTask): its [`run`](super::UnrunTask::run) spawns
/// the future, and dropping the `UnrunTask` drops the future unpolled, after
/// which this handle reads finished. Until one of these happens the handle
/// reads neither pending nor finished, and [`cancel`](Self::cancel) still
/// works (returning `true`, the handle then reads finished, and the future is
/// dropped unpolled when the `UnrunTask` is run or dropped).
///
/// A future already started is a Tokio task of its own: the shutdown does not
/// touch it, it runs to completion, and `cancel` can still abort it.
///
/// Dropping the last [`Timer`](super::Timer) clone, or losing the reaper,
/// drops a future that has not started, unpolled; the handle then reads
/// finished.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
/// use std::time::Duration;
///
/// let timer = tokio_purgatory::Timer::new();
/// let (tx, rx) = tokio::sync::oneshot::channel();
/// let retry = timer
///     .schedule_async(Duration::from_millis(100), async move {
///         tokio::time::sleep(Duration::from_millis(10)).await; // the retry's own I/O
///         let _ = tx.send("retried");
///     })
///     .unwrap();
/// assert!(retry.is_pending());
/// assert_eq!(rx.await, Ok("retried"));
/// # }
/// ```
///
/// A shutdown hands back a future that has not started:
///
/// ```
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
/// use std::time::Duration;
///
/// let timer = tokio_purgatory::Timer::new();
/// let heartbeat = timer.schedule_async(Duration::from_secs(1), async {}).unwrap();
/// let unrun = timer.shutdown();
/// assert_eq!(unrun.len(), 1);
/// assert!(!heartbeat.is_pending() && !heartbeat.is_finished());
/// drop(unrun); // the future is dropped unpolled
/// assert!(heartbeat.is_finished());
/// # }
/// ```
pub struct AsyncTaskHandle {
    timeout: TaskHandle,
    start: Arc<Mutex<Start>>,
}

/// Where the future stands, read before anything is written (no lock of the
/// timer's is held while the formatter writes).
impl std::fmt::Debug for AsyncTaskHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (pending, finished) = (self.is_pending(), self.is_finished());
        f.debug_struct("AsyncTaskHandle")
            .field("pending", &pending)
            .field("finished", &finished)
            .finish_non_exhaustive()
    }
}

impl AsyncTaskHandle {
    pub(super) fn new(timeout: TaskHandle, start: Arc<Mutex<Start>>) -> AsyncTaskHandle {
        AsyncTaskHandle { timeout, start }
    }

    pub(super) fn waiting() -> Arc<Mutex<Start>> {
        Arc::new(Mutex::new(Start::Waiting(None)))
    }

    /// Spawns `future` unless it was cancelled first: what the wheel's task
    /// does at the deadline, on the reaper task (inside the timer's runtime),
    /// or wherever a task handed back by a shutdown is run: on the runtime
    /// current there, else on `scheduled_on` (the one current when it was
    /// scheduled). With neither, it cannot start: it is dropped unrun, and
    /// its handle reads cancelled. Returns whether it was spawned.
    pub(super) fn start<Fut>(
        start: &Arc<Mutex<Start>>,
        future: Fut,
        scheduled_on: Option<&tokio::runtime::Handle>,
    ) -> bool
    where
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        if matches!(*lock(start), Start::Cancelled) {
            drop(future); // the user's value, with no lock of ours held
            return false;
        }
        let runtime = match tokio::runtime::Handle::try_current() {
            Ok(current) => current,
            Err(_) => match scheduled_on {
                Some(handle) => handle.clone(),
                None => {
                    *lock(start) = Start::Cancelled;
                    drop(future); // with no lock of ours held
                    return false;
                }
            },
        };
        // Spawned with no lock held (a runtime shutting down drops the
        // future inside `spawn`). Whether the future starts is decided at
        // the task's first poll, under the lock (see `gated`): a cancel that
        // lands before it keeps it from starting, even while this call has
        // not recorded the task yet; one that lands after aborts the task.
        let abort = runtime
            .spawn(gated(Finish(start.clone()), future))
            .abort_handle();
        let mut s = lock(start);
        match &mut *s {
            Start::Waiting(kept) | Start::Running(kept) => *kept = Some(abort),
            Start::Cancelled => {
                drop(s);
                abort.abort();
            }
            Start::Finished => {}
        }
        true
    }

    /// Cancels the future: before its deadline it is taken out of the wheel
    /// and dropped unpolled (on this thread, with no lock of ours held);
    /// once running, its task is aborted (dropped at its next `.await`, on
    /// the runtime). Returns whether this call cancelled it: `false` once it
    /// has finished (returned `Ready`, panicked, or was dropped with its
    /// runtime) or was cancelled before.
    ///
    /// # Concurrent calls
    ///
    /// Racing the deadline, the future either never starts (`true`; if its
    /// task was already spawned, it drops the future unpolled), or has
    /// started and its task is aborted (`true`; a future that returns
    /// `Ready` before its next `.await` still completes), or had already
    /// finished (`false`). What the future does between its last statement
    /// and returning `Ready` races the cancel like any code of a task being
    /// aborted.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// use std::time::Duration;
    /// let timer = tokio_purgatory::Timer::new();
    /// let t = timer.schedule_async(Duration::from_secs(1), async { unreachable!() }).unwrap();
    /// assert!(t.cancel());
    /// assert!(!t.cancel(), "once");
    /// tokio::time::sleep(Duration::from_secs(2)).await; // never runs
    /// # }
    /// ```
    pub fn cancel(&self) -> bool {
        let mut s = lock(&self.start);
        match std::mem::replace(&mut *s, Start::Cancelled) {
            Start::Waiting(spawned) => {
                // Out of the wheel if still there (it never starts); if the
                // reaper is running its task right now, that task finds the
                // state cancelled and does not spawn it, and a task spawned
                // already drops it at its first poll.
                let taken = self.timeout.cancel_and_take();
                drop(s);
                if let Some(abort) = spawned {
                    abort.abort();
                }
                // The future, unpolled: the user's value, its drop contained.
                self.timeout.core.panics.drop_value("drop of a task", taken);
                true
            }
            Start::Running(abort) => {
                drop(s);
                // Not recorded yet: `start` aborts it when it finds the
                // state cancelled.
                if let Some(abort) = abort {
                    abort.abort();
                }
                true
            }
            Start::Finished => {
                *s = Start::Finished;
                false
            }
            Start::Cancelled => false,
        }
    }

    /// Moves the deadline to `delay` from now, if the future has not started
    /// (see [`TaskHandle::reset`]). Returns whether it moved: `false` once the
    /// future has started, was cancelled, or was handed back by a shutdown.
    ///
    /// # Concurrent calls
    ///
    /// Racing the deadline, either the reset wins and the future starts at the
    /// new deadline only, or the reaper has already taken it out to start it
    /// (at the old deadline) and the reset returns `false`, changing nothing.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// use std::time::Duration;
    /// let timer = tokio_purgatory::Timer::new();
    /// let heartbeat = timer.schedule_async(Duration::from_secs(3), async {}).unwrap();
    /// assert!(heartbeat.reset(Duration::from_secs(3)), "pushed back");
    /// # }
    /// ```
    pub fn reset(&self, delay: Duration) -> bool {
        lock(&self.start).is_unspawned() && self.timeout.reset(delay)
    }

    /// Whether the future is still waiting for its deadline.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// use std::time::Duration;
    /// let timer = tokio_purgatory::Timer::new();
    /// let t = timer.schedule_async(Duration::from_millis(5), async {}).unwrap();
    /// assert!(t.is_pending());
    /// tokio::time::sleep(Duration::from_millis(10)).await;
    /// assert!(!t.is_pending());
    /// # }
    /// ```
    pub fn is_pending(&self) -> bool {
        lock(&self.start).is_unspawned() && self.timeout.is_pending()
    }

    /// Whether the future has finished: run to completion (from the moment
    /// it returned `Ready`), panicked, cancelled, or dropped unrun because it
    /// can no longer start (its last `Timer` clone was dropped, or a shutdown
    /// handed it back and that task was dropped) or with its runtime.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// use std::time::Duration;
    /// let timer = tokio_purgatory::Timer::new();
    /// let t = timer.schedule_async(Duration::from_millis(5), async {}).unwrap();
    /// assert!(!t.is_finished());
    /// tokio::time::sleep(Duration::from_millis(10)).await;
    /// tokio::task::yield_now().await; // its task runs
    /// assert!(t.is_finished());
    /// # }
    /// ```
    pub fn is_finished(&self) -> bool {
        matches!(*lock(&self.start), Start::Finished | Start::Cancelled)
    }
}
