//! Reapers, shared and of their own, used hostilely around shutdowns, lost
//! runtimes, drains and weak handles. A timer shut down by a neighbour's task
//! on their shared reaper keeps its counters; a repeating task's run under way
//! when a shutdown comes on another thread is not handed back (real threads,
//! bounded); a timer or purgatory attached to a shared reaper during its turn
//! (by a task that turn runs, or by another thread meanwhile) is not slept
//! through; a reaper on a runtime without time reads as lost; a kept `Reaper`
//! outlives everything it served and ends with its last handle; a purgatory or
//! timer keeps the clock of its reaper's runtime, whichever runtime builds it.
//! When the reaper's runtime is dropped: tasks awaiting every kind of handle,
//! operations and tasks whose `Drop` panics, a drain waiting on another
//! runtime, registrations racing on other threads (each handed back or
//! resolving `ReaperGone`, none lost), async tasks not started, and a large
//! watcher map, which empties. One purgatory shut down from another's expiry,
//! keys whose `Drop` panics or calls back in during a shutdown, a weak
//! heartbeat that stops with its timer. A reaper of its own ends with its
//! purgatory or timer, whatever handles are still held.

mod support;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio::time::advance;
use tokio_purgatory::{
    Completion, Operation, OperationError, OperationStatus, Purgatory, Reaper, TaskStatus,
    TimeoutError, Timer, TimerError, TimerMetrics, WatchError, WatchErrorKind, WeakPurgatory,
};

use support::{balanced, ms, settle, within};

fn alive_tasks() -> usize {
    tokio::runtime::Handle::current()
        .metrics()
        .num_alive_tasks()
}

struct Never;
impl Operation for Never {
    type Output = ();
    fn try_complete(&mut self) -> Option<()> {
        None
    }
    fn on_expiration(self) {}
}

/// Counts its drops.
struct Counted(Arc<AtomicUsize>);
impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

// ---------------------------------------------------------------------------
// Shutdown on a shared reaper.

/// `TimerMetrics`: "The counters keep their values after a shutdown", for a
/// timer shut down by a task of another timer on the same shared reaper.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn shared_timer_shut_down_by_a_neighbours_task_keeps_its_counters() {
    let reaper = Reaper::start().unwrap();
    let a = Timer::builder().name("a").reaper(&reaper).build().unwrap();
    let b = Timer::builder().name("b").reaper(&reaper).build().unwrap();
    b.sleep(ms(5)).await.unwrap();
    let _later = b.schedule(ms(60_000), || {}).unwrap();
    settle().await;
    let seen: Arc<Mutex<Option<(usize, TimerMetrics)>>> = Arc::default();
    let (s, b2) = (seen.clone(), b.clone());
    a.schedule(ms(10), move || {
        let back = b2.shutdown().len();
        *s.lock().unwrap() = Some((back, b2.metrics()));
    })
    .unwrap();
    advance(ms(11)).await;
    settle().await;
    let (back, at_shutdown) = seen.lock().unwrap().take().expect("a's task ran");
    assert_eq!(back, 1);
    for _ in 0..5 {
        advance(ms(100)).await;
        settle().await;
    }
    assert_eq!(
        b.metrics(),
        at_shutdown,
        "TimerMetrics: \"The counters keep their values after a shutdown\""
    );
}

/// The same, shut down from outside the reaper: the neighbour is still
/// served.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn shared_timer_shut_down_from_outside_keeps_its_counters() {
    let reaper = Reaper::start().unwrap();
    let a = Timer::builder().name("a").reaper(&reaper).build().unwrap();
    let b = Timer::builder().name("b").reaper(&reaper).build().unwrap();
    b.sleep(ms(5)).await.unwrap();
    drop(b.shutdown());
    let at_shutdown = b.metrics();
    a.schedule(ms(10), || {}).unwrap();
    for _ in 0..5 {
        advance(ms(10)).await;
        settle().await;
    }
    assert_eq!(a.metrics().expired, 1);
    assert_eq!(b.metrics(), at_shutdown);
}

/// `schedule_repeating`: "A run under way when the shutdown comes ...
/// finishes, and the chain ends there: nothing is handed back for it". A run
/// on the reaper's worker asks to go on just after a `shutdown` on another
/// thread began, while that shutdown drains loaded shards one by one.
/// Returns how many tasks the shutdown handed back, and whether the chain
/// ran again when they were run.
fn repeating_run_racing_a_shutdown(load_per_shard: usize) -> (usize, bool) {
    let rt = support::multi();
    let timer = Timer::builder()
        .shards(SHARDS)
        .build_on(rt.handle())
        .unwrap();
    // Load the shards (a thread schedules on the shard of its index), so
    // that the shutdown's drain of those before the reaper's takes a while.
    for _ in 0..SHARDS {
        let t = timer.clone();
        let h = rt.handle().clone();
        std::thread::spawn(move || {
            let _in = h.enter();
            for _ in 0..load_per_shard {
                t.schedule(Duration::from_secs(3600), || {}).unwrap();
            }
        })
        .join()
        .unwrap();
    }
    let entered = Arc::new(std::sync::Barrier::new(2));
    let runs_after = Arc::new(AtomicUsize::new(0));
    let weak = timer.downgrade();
    let (e, r) = (entered.clone(), runs_after.clone());
    let mut first = true;
    let handle = {
        let _in = rt.enter();
        timer
            .schedule_repeating(Duration::ZERO, move || {
                if first {
                    first = false;
                    e.wait();
                    // Wait until the shutdown has begun (its state is set
                    // before its shards are drained), then ask to go on.
                    while !weak.upgrade().is_none_or(|t| t.is_shutdown()) {
                        std::hint::spin_loop();
                    }
                    Some(Duration::from_secs(3600))
                } else {
                    r.fetch_add(1, Ordering::SeqCst);
                    None
                }
            })
            .unwrap()
    };
    entered.wait();
    let back = timer.shutdown();
    let n = back.len();
    for t in back {
        t.run();
    }
    assert_eq!(handle.status(), TaskStatus::Done);
    drop(timer);
    drop(rt);
    (n, runs_after.load(Ordering::SeqCst) > 0)
}

/// Timer shards: the race is there whenever the reaper's worker inserts
/// into a shard other than the first.
const SHARDS: usize = 8;

#[test]
fn a_repeating_run_under_way_racing_a_shutdown_is_not_handed_back() {
    const LOAD: usize = 5_000;
    within(20, || {
        for attempt in 0..3 {
            let (n, ran_again) = repeating_run_racing_a_shutdown(LOAD);
            assert!(
                !ran_again,
                "attempt {attempt}: the shutdown handed back {n} tasks, the running \
                 chain among them"
            );
            assert_eq!(n, SHARDS * LOAD, "attempt {attempt}: the load alone");
        }
    });
}

/// One purgatory shut down from another's expiry on the same shared reaper,
/// with operations of its own due in the same turn: each is expired or
/// handed back, exactly once, in either order of service.
struct ShutsDown(
    Arc<OnceLock<Purgatory<u32, Never>>>,
    Arc<Mutex<Option<usize>>>,
);
impl Operation for ShutsDown {
    type Output = ();
    fn try_complete(&mut self) -> Option<()> {
        None
    }
    fn on_expiration(self) {
        let back = self.0.get().unwrap().shutdown().len();
        *self.1.lock().unwrap() = Some(back);
    }
}

async fn shutdown_from_a_neighbours_expiry(victim_first: bool) {
    let reaper = Reaper::start().unwrap();
    let slot: Arc<OnceLock<Purgatory<u32, Never>>> = Arc::default();
    let build_victim =
        || -> Purgatory<u32, Never> { Purgatory::builder().reaper(&reaper).build().unwrap() };
    let (victim, killer): (Purgatory<u32, Never>, Purgatory<u32, ShutsDown>) = if victim_first {
        let v = build_victim();
        (v, Purgatory::builder().reaper(&reaper).build().unwrap())
    } else {
        let k = Purgatory::builder().reaper(&reaper).build().unwrap();
        (build_victim(), k)
    };
    slot.set(victim.clone()).ok().unwrap();
    let back = Arc::new(Mutex::new(None));
    let vh: Vec<_> = (0..5)
        .map(|i| victim.try_complete_else_watch(Never, ms(10), [i]).unwrap())
        .collect();
    let kh = killer
        .try_complete_else_watch(ShutsDown(slot.clone(), back.clone()), ms(10), [1])
        .unwrap();
    advance(ms(11)).await;
    settle().await;
    assert_eq!(kh.await, Ok(Completion::Expired(())));
    let back = back.lock().unwrap().unwrap();
    let mut outs = Vec::new();
    for h in vh {
        outs.push(h.await);
    }
    let expired = outs.iter().filter(|o| o.is_ok()).count();
    let shut = outs
        .iter()
        .filter(|o| **o == Err(OperationError::Shutdown))
        .count();
    assert_eq!(expired + shut, 5, "{outs:?}");
    assert_eq!(shut, back, "handed back = resolved Shutdown: {outs:?}");
    let m = victim.metrics();
    assert!(balanced(&m), "{m:?}");
    assert_eq!(m.handed_back as usize, back);
    assert_eq!(m.expired as usize, expired);
    assert_eq!(reaper.serving(), 1);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn shutdown_from_a_neighbours_expiry_victim_served_first() {
    shutdown_from_a_neighbours_expiry(true).await;
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn shutdown_from_a_neighbours_expiry_victim_served_second() {
    shutdown_from_a_neighbours_expiry(false).await;
}

/// What a key's `Drop` saw when it called back in during the shutdown: the
/// refusal of a registration, what a second shutdown handed back, the
/// pending count, and whether the purgatory read shut down.
type Seen = (Option<WatchErrorKind>, usize, usize, bool);

#[derive(Clone)]
struct HostileKey {
    id: u32,
    hooks: Arc<KeyHooks>,
}
struct KeyHooks {
    armed: AtomicBool,
    purgatory: OnceLock<WeakPurgatory<HostileKey, Never>>,
    seen: Mutex<Vec<Seen>>,
}
impl PartialEq for HostileKey {
    fn eq(&self, o: &Self) -> bool {
        self.id == o.id
    }
}
impl Eq for HostileKey {}
impl std::hash::Hash for HostileKey {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        self.id.hash(h)
    }
}
impl Drop for HostileKey {
    fn drop(&mut self) {
        if !self.hooks.armed.load(Ordering::SeqCst) {
            return;
        }
        if self.id.is_multiple_of(3) {
            panic!("key drop {}", self.id);
        }
        if self.id % 3 == 1 {
            if let Some(p) = self.hooks.purgatory.get().and_then(|w| w.upgrade()) {
                self.hooks.armed.store(false, Ordering::SeqCst);
                let refused = p.try_complete_else_watch(
                    Never,
                    ms(5),
                    [HostileKey {
                        id: 1000 + self.id,
                        hooks: self.hooks.clone(),
                    }],
                );
                let kind = refused.as_ref().err().map(|e| e.kind());
                drop(refused);
                let again = p.shutdown().len();
                let delayed = p.metrics().delayed;
                let shut = p.is_shutdown();
                self.hooks
                    .seen
                    .lock()
                    .unwrap()
                    .push((kind, again, delayed, shut));
                self.hooks.armed.store(true, Ordering::SeqCst);
            }
        }
    }
}

/// Keys whose `Drop` panics or calls back in (registers, shuts down again,
/// reads the metrics) during `shutdown()`: every pending operation is still
/// handed back and its handle resolves `Shutdown`, the key drops are
/// contained and counted, and the calls back in see a purgatory shut down
/// with nothing pending.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn hostile_key_drops_during_shutdown_lose_nothing() {
    let hooks = Arc::new(KeyHooks {
        armed: AtomicBool::new(false),
        purgatory: OnceLock::new(),
        seen: Mutex::new(Vec::new()),
    });
    let reaper = Reaper::start().unwrap();
    let p: Purgatory<HostileKey, Never> = Purgatory::builder().reaper(&reaper).build().unwrap();
    hooks.purgatory.set(p.downgrade()).unwrap();
    let key = |id| HostileKey {
        id,
        hooks: hooks.clone(),
    };
    let hs: Vec<_> = (0..12u32)
        .map(|i| {
            p.try_complete_else_watch(Never, ms(60_000), [key(i), key(i + 100)])
                .unwrap()
        })
        .collect();
    hooks.armed.store(true, Ordering::SeqCst);
    let back = p.shutdown();
    hooks.armed.store(false, Ordering::SeqCst);
    assert_eq!(back.len(), 12);
    for h in hs {
        assert_eq!(h.await, Err(OperationError::Shutdown));
    }
    let m = p.metrics();
    assert!(balanced(&m), "{m:?}");
    assert_eq!(
        (m.delayed, m.watched, m.keys, m.tombstones),
        (0, 0, 0, 0),
        "{m:?}"
    );
    assert!(m.panicked > 0, "{m:?}");
    let seen = hooks.seen.lock().unwrap().clone();
    assert!(!seen.is_empty(), "the keys' drops called back in");
    for s in &seen {
        assert_eq!(*s, (Some(WatchErrorKind::Shutdown), 0, 0, true), "{seen:?}");
    }
}

/// A `TimeoutFuture` whose timer's last clone is dropped while it waits
/// resolves `Shutdown`.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_timeout_future_outliving_its_timer_resolves_shutdown() {
    let reaper = Reaper::start().unwrap();
    let timer = Timer::builder().reaper(&reaper).build().unwrap();
    let fut = timer.timeout(ms(60_000), std::future::pending::<()>());
    let weak = timer.downgrade();
    drop(timer);
    assert!(weak.upgrade().is_none());
    assert_eq!(fut.await, Err(TimeoutError::Timer(TimerError::Shutdown)));
}

/// An async task handed back by a shutdown, then cancelled: "the handle
/// then reads finished, and the future is dropped unpolled when the
/// UnrunTask is run or dropped".
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn an_async_task_handed_back_then_cancelled_never_starts() {
    let reaper = Reaper::start().unwrap();
    let timer = Timer::builder().reaper(&reaper).build().unwrap();
    let polled = Arc::new(AtomicBool::new(false));
    let pl = polled.clone();
    let h = timer
        .schedule_async(ms(100), async move {
            pl.store(true, Ordering::SeqCst);
        })
        .unwrap();
    let back = timer.shutdown();
    assert_eq!(back.len(), 1);
    assert!(!h.is_pending() && !h.is_finished());
    assert!(h.cancel());
    assert!(h.is_finished());
    for t in back {
        t.run();
    }
    settle().await;
    assert!(!polled.load(Ordering::SeqCst));
    assert!(!h.cancel());
}

/// A heartbeat holding a `WeakTimer` on a shared reaper: once the last
/// `Timer` clone goes, the beat stops and its task is dropped, and the
/// reaper task ends with its last handle.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_weak_heartbeat_on_a_shared_reaper_stops_with_its_timer() {
    settle().await;
    let base = alive_tasks();
    let reaper = Reaper::start().unwrap();
    let timer = Timer::builder().reaper(&reaper).build().unwrap();
    let beats = Arc::new(AtomicUsize::new(0));
    let weak = timer.downgrade();
    let b = beats.clone();
    let dropped = Arc::new(AtomicUsize::new(0));
    let guard = Counted(dropped.clone());
    let hb = timer
        .schedule_repeating(ms(10), move || {
            let _g = &guard;
            b.fetch_add(1, Ordering::SeqCst);
            // Uses the timer it beats on while it can.
            if let Some(t) = weak.upgrade() {
                let _ = t.schedule(ms(1), || {});
            }
            Some(ms(10))
        })
        .unwrap();
    for _ in 0..5 {
        advance(ms(10)).await;
        settle().await;
    }
    assert!(beats.load(Ordering::SeqCst) >= 4);
    drop(timer);
    settle().await;
    assert_eq!(
        dropped.load(Ordering::SeqCst),
        1,
        "the chain's task is dropped"
    );
    let at = beats.load(Ordering::SeqCst);
    for _ in 0..5 {
        advance(ms(10)).await;
        settle().await;
    }
    assert_eq!(beats.load(Ordering::SeqCst), at);
    assert_eq!(hb.status(), TaskStatus::Done);
    assert!(!hb.cancel());
    assert_eq!(reaper.serving(), 0);
    drop(reaper);
    settle().await;
    assert_eq!(alive_tasks(), base);
}

// ---------------------------------------------------------------------------
// A reaper's life.

/// `Reaper::is_stopped`: "While a Reaper exists, the task does not end on
/// its own." Every timer and purgatory on it gone, the handle kept: later
/// builds are served; dropping the handle then ends the task.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_kept_reaper_outlives_everything_it_served() {
    settle().await;
    let base = alive_tasks();
    let reaper = Reaper::start().unwrap();
    for _ in 0..3 {
        let t = Timer::builder().reaper(&reaper).build().unwrap();
        let p: Purgatory<u32, Never> = Purgatory::builder().reaper(&reaper).build().unwrap();
        let h = p.try_complete_else_watch(Never, ms(5), [1]).unwrap();
        t.sleep(ms(3)).await.unwrap();
        advance(ms(3)).await;
        assert_eq!(h.await, Ok(Completion::Expired(())));
        drop(t);
        drop(p.shutdown());
        drop(p);
        settle().await;
        assert_eq!(reaper.serving(), 0);
        assert!(!reaper.is_stopped());
        assert_eq!(alive_tasks(), base + 1, "the task still runs");
        advance(ms(1000)).await;
        settle().await;
    }
    drop(reaper);
    settle().await;
    assert_eq!(alive_tasks(), base, "ended with its last handle");
}

/// Reaper docs, Lifecycle: "Owned ...: the reaper is spawned by `build` and
/// ends when its purgatory or timer shuts down (explicitly, or when its last
/// owning clone is dropped)." An explicit shutdown, with clones and handles
/// still held.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn an_own_reaper_ends_at_an_explicit_shutdown_with_clones_and_handles_held() {
    settle().await;
    let base = alive_tasks();
    let p: Purgatory<u32, Never> = Purgatory::builder().build().unwrap();
    let p2 = p.clone();
    let timer = Timer::new();
    let t2 = timer.clone();
    settle().await;
    assert_eq!(alive_tasks(), base + 2);
    let h = p.try_complete_else_watch(Never, ms(600_000), [1]).unwrap();
    let r = h.op_ref().unwrap();
    let th = timer.schedule(ms(600_000), || {}).unwrap();
    let nap = timer.sleep(ms(600_000));
    assert_eq!(p.shutdown().len(), 1);
    assert_eq!(timer.shutdown().len(), 1);
    settle().await;
    assert_eq!(alive_tasks(), base, "both reapers ended");
    assert_eq!(h.await, Err(OperationError::Shutdown));
    assert_eq!(r.status(), OperationStatus::HandedBack);
    assert_eq!(th.status(), TaskStatus::Done);
    assert_eq!(nap.await, Err(TimerError::Shutdown));
    drop((p2, t2));
}

/// The same when the last clone goes while handles are held: every handle
/// reads finished and refuses what it no longer can do.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn an_own_reaper_ends_with_the_last_clone_while_handles_are_held() {
    settle().await;
    let base = alive_tasks();
    let p: Purgatory<u32, Never> = Purgatory::builder().build().unwrap();
    let timer = Timer::new();
    let h = p.try_complete_else_watch(Never, ms(600_000), [1]).unwrap();
    let r = h.op_ref().unwrap();
    let th = timer.schedule(ms(600_000), || {}).unwrap();
    let nap = timer.sleep(ms(600_000));
    let (wp, wt) = (p.downgrade(), timer.downgrade());
    settle().await;
    assert_eq!(alive_tasks(), base + 2);
    drop(p);
    drop(timer);
    settle().await;
    assert_eq!(alive_tasks(), base, "both reapers ended");
    assert!(wp.upgrade().is_none() && wt.upgrade().is_none());
    assert_eq!(h.await, Err(OperationError::Shutdown));
    assert_eq!(r.status(), OperationStatus::Cancelled);
    assert!(!r.try_complete() && r.cancel().is_none() && !r.reset(ms(1)));
    assert_eq!(th.status(), TaskStatus::Done);
    assert!(!th.cancel() && !th.reset(ms(1)) && th.cancel_and_take().is_none());
    assert_eq!(nap.await, Err(TimerError::Shutdown));
}

/// A purgatory whose last clone is held by a task scheduled on a timer that
/// shares no reaper with it; the timer's task drops it from that timer's
/// reaper: the purgatory's own reaper ends, its operations resolve
/// `Shutdown`, and the timer goes on.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_purgatory_dropped_by_another_reapers_task() {
    settle().await;
    let base = alive_tasks();
    let p: Purgatory<u32, Never> = Purgatory::builder().build().unwrap();
    let timer = Timer::new();
    let h = p.try_complete_else_watch(Never, ms(600_000), [1]).unwrap();
    let dropped = Arc::new(AtomicUsize::new(0));
    let d = dropped.clone();
    timer
        .schedule(ms(5), move || {
            drop(p);
            d.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
    settle().await;
    assert_eq!(alive_tasks(), base + 2);
    advance(ms(6)).await;
    settle().await;
    assert_eq!(dropped.load(Ordering::SeqCst), 1);
    assert_eq!(h.await, Err(OperationError::Shutdown));
    assert_eq!(alive_tasks(), base + 1, "the purgatory's reaper ended");
    assert_eq!(timer.sleep(ms(1)).await, Ok(()));
    drop(timer);
    settle().await;
    assert_eq!(alive_tasks(), base);
}

// ---------------------------------------------------------------------------
// A core attached during a turn. The reaper's alarm (the instant it sleeps
// until) must not still be set while it is awake: a timer or purgatory
// attached during a turn, which that turn does not serve, would find the
// previous alarm earlier than its first entry, not notify, and the reaper
// would then sleep through that entry (for ever, with nothing else due).

/// Steps the paused clock 1 ms at a time over `total`, letting the reaper
/// run after each step.
async fn step(total: Duration) {
    for _ in 0..total.as_millis() {
        advance(ms(1)).await;
        settle().await;
    }
}

/// A task of timer A, run in the shared reaper's turn, builds timer B on the
/// same reaper and schedules on it 20 ms later: B's task runs.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_timer_attached_during_a_turn_is_not_slept_through() {
    let reaper = Reaper::start().unwrap();
    let a = Timer::builder().reaper(&reaper).build().unwrap();
    let fired = Arc::new(AtomicBool::new(false));
    let kept: Arc<Mutex<Option<Timer>>> = Arc::default();
    {
        let (reaper, fired, kept) = (reaper.clone(), fired.clone(), kept.clone());
        a.schedule(ms(10), move || {
            let b = Timer::builder().reaper(&reaper).build().unwrap();
            b.schedule(ms(20), move || fired.store(true, Ordering::SeqCst))
                .unwrap();
            *kept.lock().unwrap() = Some(b);
        })
        .unwrap();
    }
    settle().await;
    step(ms(200)).await;
    let b = kept.lock().unwrap().take().expect("A's task ran");
    assert!(
        fired.load(Ordering::SeqCst),
        "B's task, due at 30 ms, had not run at 200 ms: {:?}",
        b.metrics()
    );
    assert_eq!(b.metrics().expired, 1);
}

/// The same with a purgatory: A's task builds purgatory B on the reaper and
/// registers an operation with a 20 ms timeout on it, which expires.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_purgatory_attached_during_a_turn_is_not_slept_through() {
    let reaper = Reaper::start().unwrap();
    let a = Timer::builder().reaper(&reaper).build().unwrap();
    let kept: Arc<Mutex<Option<Purgatory<u32, Never>>>> = Arc::default();
    {
        let (reaper, kept) = (reaper.clone(), kept.clone());
        a.schedule(ms(10), move || {
            let b: Purgatory<u32, Never> = Purgatory::builder().reaper(&reaper).build().unwrap();
            b.try_complete_else_watch(Never, ms(20), [1])
                .unwrap()
                .detach();
            *kept.lock().unwrap() = Some(b);
        })
        .unwrap();
    }
    settle().await;
    step(ms(200)).await;
    let b = kept.lock().unwrap().take().expect("A's task ran");
    let m = b.metrics();
    assert_eq!(
        (m.expired, m.delayed),
        (1, 0),
        "B's operation, due at 30 ms, had not expired at 200 ms: {m:?}"
    );
    assert!(balanced(&m));
}

/// With real threads and real time: another thread builds timer B on the
/// reaper and schedules on it 30 ms later while A's task holds the reaper's
/// turn. B's task runs (waited for up to 5 s).
#[test]
fn a_timer_attached_by_another_thread_during_a_turn_is_not_slept_through() {
    within(20, || {
        let rt = support::multi();
        rt.block_on(async {
            let reaper = Reaper::start().unwrap();
            let a = Timer::builder().reaper(&reaper).build().unwrap();
            let (in_tx, in_rx) = std::sync::mpsc::sync_channel::<()>(1);
            let (go_tx, go_rx) = std::sync::mpsc::sync_channel::<()>(1);
            a.schedule(ms(10), move || {
                in_tx.send(()).unwrap();
                go_rx.recv_timeout(Duration::from_secs(10)).expect("let go");
            })
            .unwrap();
            let fired = Arc::new(AtomicBool::new(false));
            let b = {
                let (fired, reaper) = (fired.clone(), reaper.clone());
                tokio::task::spawn_blocking(move || {
                    in_rx
                        .recv_timeout(Duration::from_secs(5))
                        .expect("A's task ran");
                    // The reaper is inside A's task, in its turn.
                    let b = Timer::builder().reaper(&reaper).build().unwrap();
                    b.schedule(ms(30), move || fired.store(true, Ordering::SeqCst))
                        .unwrap();
                    go_tx.send(()).unwrap();
                    b
                })
                .await
                .unwrap()
            };
            let since = std::time::Instant::now();
            while !fired.load(Ordering::SeqCst) && since.elapsed() < Duration::from_secs(5) {
                tokio::time::sleep(ms(5)).await;
            }
            assert!(
                fired.load(Ordering::SeqCst),
                "B's task, due 30 ms after it was scheduled, had not run {:?} later: {:?}",
                since.elapsed(),
                b.metrics()
            );
        });
    });
}

// ---------------------------------------------------------------------------
// One clock: "A purgatory or timer keeps time by the clock of the runtime its
// reaper runs on, read there when it is built, whichever runtime (or none)
// builds it."

/// On the reaper's runtime `home`: a 40 ms sleep and a 50 ms timeout have
/// not fired at 30 ms, and fire at their deadlines.
fn keeps_homes_clock(home: &tokio::runtime::Runtime, timer: &Timer, p: &Purgatory<u32, Never>) {
    home.block_on(async {
        let start = tokio::time::Instant::now();
        let h = p.try_complete_else_watch(Never, ms(50), [1]).unwrap();
        let nap = timer.sleep(ms(40));
        advance(ms(30)).await;
        settle().await;
        assert!(!nap.is_elapsed(), "fired early");
        assert!(!h.is_finished(), "expired early");
        nap.await.unwrap();
        assert!(start.elapsed() >= ms(40));
        assert_eq!(h.await, Ok(Completion::Expired(())));
        assert!(start.elapsed() >= ms(50));
    });
}

/// `TimerBuilder::reaper`: "build_on's runtime is not used: the reaper runs
/// where it was started". Built with `build_on` a runtime whose clock is an
/// hour ahead, on a shared reaper started elsewhere.
#[test]
fn build_on_another_runtime_with_a_shared_reaper_uses_the_reapers_runtime_and_clock() {
    within(30, || {
        let home = support::paused();
        let reaper = Reaper::start_on(home.handle());
        let away = support::paused();
        away.block_on(advance(Duration::from_secs(3600)));
        let (timer, p) = away.block_on(async {
            let here = tokio::runtime::Handle::current();
            let t = Timer::builder().reaper(&reaper).build_on(&here).unwrap();
            let p: Purgatory<u32, Never> = Purgatory::builder()
                .reaper(&reaper)
                .build_on(&here)
                .unwrap();
            (t, p)
        });
        drop(away);
        assert!(!timer.is_shutdown() && !p.is_shutdown());
        keeps_homes_clock(&home, &timer, &p);
    });
}

/// A reaper of its own, built with `build_on(home)` from inside a runtime
/// whose clock is an hour ahead.
#[test]
fn build_on_from_a_runtime_an_hour_ahead_keeps_the_reapers_clock() {
    within(30, || {
        let home = support::paused();
        let away = support::paused();
        away.block_on(advance(Duration::from_secs(3600)));
        let home_handle = home.handle().clone();
        let (timer, p) = away.block_on(async move {
            let t = Timer::builder().build_on(&home_handle).unwrap();
            let p: Purgatory<u32, Never> = Purgatory::builder().build_on(&home_handle).unwrap();
            (t, p)
        });
        drop(away);
        keeps_homes_clock(&home, &timer, &p);
    });
}

// ---------------------------------------------------------------------------
// A lost reaper.

/// lib.rs: "on a runtime built without [the time driver], Tokio panics in
/// the reaper task at its first sleep ..., and the purgatory or timer then
/// reads as having lost its reaper."
#[test]
fn a_reaper_on_a_runtime_without_time_reads_as_lost() {
    within(20, || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let reaper = Reaper::start_on(rt.handle());
        let p: Purgatory<u32, Never> = Purgatory::builder().reaper(&reaper).build().unwrap();
        let timer = Timer::builder().reaper(&reaper).build().unwrap();
        let own = Timer::builder().build_on(rt.handle()).unwrap();
        let (h, nap, own_nap) = {
            let _in = rt.enter();
            (
                p.try_complete_else_watch(Never, ms(10), [1]).unwrap(),
                timer.sleep(ms(10)),
                own.sleep(ms(10)),
            )
        };
        rt.block_on(settle());
        assert!(reaper.is_stopped());
        assert!(p.is_shutdown() && timer.is_shutdown() && own.is_shutdown());
        support::paused().block_on(async {
            assert_eq!(h.await, Err(OperationError::ReaperGone));
            assert_eq!(nap.await, Err(TimerError::ReaperGone));
            assert_eq!(own_nap.await, Err(TimerError::ReaperGone));
        });
        let err = Timer::builder().reaper(&reaper).build().unwrap_err();
        assert!(err.is_reaper_stopped());
        drop(rt);
    });
}

/// `AsyncTaskHandle`: "Dropping the last Timer clone, or losing the reaper,
/// drops a future that has not started, unpolled; the handle then reads
/// finished." On a shared reaper and on one of its own.
#[test]
fn an_async_task_not_started_reads_finished_once_the_reaper_is_lost() {
    within(20, || {
        let rt = support::paused();
        let reaper = Reaper::start_on(rt.handle());
        let timer = Timer::builder().reaper(&reaper).build().unwrap();
        let own = Timer::builder().build_on(rt.handle()).unwrap();
        let dropped = Arc::new(AtomicUsize::new(0));
        let (a, b) = {
            let _in = rt.enter();
            let c1 = Counted(dropped.clone());
            let c2 = Counted(dropped.clone());
            (
                timer
                    .schedule_async(ms(60_000), async move {
                        let _c = c1;
                        unreachable!("never started");
                    })
                    .unwrap(),
                own.schedule_async(ms(60_000), async move {
                    let _c = c2;
                    unreachable!("never started");
                })
                .unwrap(),
            )
        };
        assert!(a.is_pending() && b.is_pending());
        rt.block_on(settle());
        drop(rt);
        assert_eq!(dropped.load(Ordering::SeqCst), 2, "dropped unpolled");
        assert!(a.is_finished() && b.is_finished());
        assert!(!a.is_pending() && !b.is_pending());
        assert!(!a.cancel() && !b.cancel());
        assert!(!a.reset(ms(1)));
    });
}

/// An operation whose `Drop` panics if told to, counting its drops.
struct PanicsOnDrop(bool, Arc<AtomicUsize>);
impl Operation for PanicsOnDrop {
    type Output = ();
    fn try_complete(&mut self) -> Option<()> {
        None
    }
    fn on_expiration(self) {}
}
impl Drop for PanicsOnDrop {
    fn drop(&mut self) {
        self.1.fetch_add(1, Ordering::SeqCst);
        if self.0 {
            panic!("operation drop");
        }
    }
}

/// Operations and timer tasks whose `Drop` panics, abandoned by a reaper
/// lost with its runtime: contained and counted, every one dropped once,
/// every handle resolves `ReaperGone`, nothing escapes the runtime's drop.
#[test]
fn panicking_drops_while_a_lost_reaper_abandons_are_contained() {
    within(30, || {
        let rt = support::paused();
        let reaper = Reaper::start_on(rt.handle());
        let p: Purgatory<u32, PanicsOnDrop> = Purgatory::builder().reaper(&reaper).build().unwrap();
        let timer = Timer::builder().reaper(&reaper).build().unwrap();
        let drops = Arc::new(AtomicUsize::new(0));
        let task_drops = Arc::new(AtomicUsize::new(0));
        let (hs, naps) = {
            let _in = rt.enter();
            let hs: Vec<_> = (0..10u32)
                .map(|i| {
                    p.try_complete_else_watch(
                        PanicsOnDrop(i % 2 == 0, drops.clone()),
                        ms(60_000),
                        [i, 100],
                    )
                    .unwrap()
                })
                .collect();
            for i in 0..6 {
                let g = PanicsOnDrop(i % 2 == 0, task_drops.clone());
                timer
                    .schedule(ms(60_000), move || {
                        let _g = g;
                    })
                    .unwrap();
            }
            let naps: Vec<_> = (0..3).map(|_| timer.sleep(ms(60_000))).collect();
            (hs, naps)
        };
        rt.block_on(settle());
        let dropped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(rt)));
        assert!(dropped.is_ok(), "a panic escaped the runtime's drop");
        assert!(reaper.is_stopped());
        assert_eq!(drops.load(Ordering::SeqCst), 10);
        assert_eq!(task_drops.load(Ordering::SeqCst), 6);
        support::paused().block_on(async {
            for h in hs {
                assert_eq!(h.await, Err(OperationError::ReaperGone));
            }
            for n in naps {
                assert_eq!(n.await, Err(TimerError::ReaperGone));
            }
        });
        let m = p.metrics();
        assert_eq!(m.panicked, 5, "{m:?}");
        assert!(balanced(&m), "{m:?}");
        assert_eq!((m.delayed, m.watched, m.keys), (0, 0, 0), "{m:?}");
        assert_eq!(timer.metrics().panicked, 3);
        assert_eq!(timer.metrics().pending, 0);
    });
}

/// A drain waiting on another runtime when the reaper's runtime dies: its
/// operations resolve `ReaperGone`, the drain returns, and later
/// registrations are refused with `ReaperGone`.
#[test]
fn a_drain_waiting_when_the_reapers_runtime_dies_returns() {
    within(30, || {
        let rt = support::paused();
        let reaper = Reaper::start_on(rt.handle());
        let p: Purgatory<u32, Never> = Purgatory::builder().reaper(&reaper).build().unwrap();
        let hs: Vec<_> = {
            let _in = rt.enter();
            (0..5)
                .map(|i| p.try_complete_else_watch(Never, ms(600_000), [i]).unwrap())
                .collect()
        };
        rt.block_on(settle());
        let p2 = p.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        // Bounded by `within`: a drain that never returns never joins.
        let drainer = std::thread::spawn(move || {
            support::paused().block_on(async {
                let mut drain = std::pin::pin!(p2.drain());
                assert!(futures::poll!(drain.as_mut()).is_pending(), "waiting");
                tx.send(()).unwrap();
                drain.await;
            });
        });
        rx.recv().unwrap();
        drop(rt);
        drainer.join().unwrap();
        support::paused().block_on(async {
            for h in hs {
                assert_eq!(h.await, Err(OperationError::ReaperGone));
            }
        });
        assert!(balanced(&p.metrics()));
        let refused = p.try_complete_else_watch(Never, ms(1), [1]).unwrap_err();
        // Shut down (reaper gone) is checked before draining.
        assert_eq!(refused.kind(), WatchErrorKind::ReaperGone);
    });
}

/// Counts its drops; may read the reaper in its `Drop`.
struct Holder {
    drops: Arc<AtomicUsize>,
    reaper: Option<Reaper>,
}
impl Operation for Holder {
    type Output = ();
    fn try_complete(&mut self) -> Option<()> {
        None
    }
    fn on_expiration(self) {}
}
impl Drop for Holder {
    fn drop(&mut self) {
        self.drops.fetch_add(1, Ordering::SeqCst);
        if let Some(r) = &self.reaper {
            // Reads the reaper's state from inside its abandonment.
            let _ = format!("{r:?} {}", r.serving());
        }
    }
}

/// The reaper's runtime dropped while its own tasks await handles, sleeps,
/// timeouts and a drain, one task holding the last purgatory clone and the
/// last timer clone, and operations whose `Drop` reads the reaper: no panic
/// escapes, the last clones go with their tasks, and every operation is
/// dropped once.
#[test]
fn a_runtime_dropped_under_tasks_awaiting_everything() {
    within(30, || {
        let rt = support::paused();
        let reaper = Reaper::start_on(rt.handle());
        let p: Purgatory<u32, Holder> = Purgatory::builder().reaper(&reaper).build().unwrap();
        let timer = Timer::builder().reaper(&reaper).build().unwrap();
        let weak_p = p.downgrade();
        let weak_t = timer.downgrade();
        let drops = Arc::new(AtomicUsize::new(0));
        let mk = |r: bool| Holder {
            drops: drops.clone(),
            reaper: r.then(|| reaper.clone()),
        };
        {
            let _in = rt.enter();
            for i in 0..20u32 {
                let h = p
                    .try_complete_else_watch(mk(i % 4 == 0), ms(600_000), [i, 1000])
                    .unwrap();
                rt.spawn(async move {
                    let _ = h.await;
                });
            }
            // Detached ones too.
            for i in 0..5u32 {
                p.try_complete_else_watch(mk(true), ms(600_000), [i])
                    .unwrap()
                    .detach();
            }
            for _ in 0..5 {
                let nap = timer.sleep(ms(600_000));
                let fut = timer.timeout(ms(600_000), std::future::pending::<()>());
                rt.spawn(async move {
                    let _ = nap.await;
                    let _ = fut.await;
                });
            }
            let (p2, t2) = (p.clone(), timer.clone());
            rt.spawn(async move {
                p2.drain().await;
                drop(t2);
            });
        }
        // The runtime's tasks hold the last clones.
        drop(p);
        drop(timer);
        rt.block_on(settle());
        assert!(weak_p.upgrade().is_some());
        let dropped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(rt)));
        assert!(dropped.is_ok(), "a panic escaped the runtime's drop");
        assert!(reaper.is_stopped());
        assert!(
            weak_p.upgrade().is_none(),
            "the last clone went with its task"
        );
        assert!(weak_t.upgrade().is_none());
        assert_eq!(
            drops.load(Ordering::SeqCst),
            25,
            "each operation dropped once"
        );
    });
}

/// Counts its drops.
struct CountedOp(Arc<AtomicUsize>);
impl Operation for CountedOp {
    type Output = ();
    fn try_complete(&mut self) -> Option<()> {
        None
    }
    fn on_expiration(self) {}
}
impl Drop for CountedOp {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// Registrations racing the loss of the reaper, from two other threads:
/// each operation is either handed back in the error, or accepted and then
/// dropped by the crate with its handle resolving `ReaperGone`; none is
/// dropped twice or silently, and the counts balance.
#[test]
fn registrations_racing_a_lost_reaper_are_handed_back_or_resolve() {
    within(60, || {
        for round in 0..6 {
            let rt = support::multi();
            let reaper = Reaper::start_on(rt.handle());
            let p: Purgatory<u32, CountedOp> = Purgatory::builder()
                .timer_shards(4)
                .reaper(&reaper)
                .build()
                .unwrap();
            let drops = Arc::new(AtomicUsize::new(0));
            let stop = Arc::new(AtomicBool::new(false));
            let started = Arc::new(std::sync::Barrier::new(3));
            let mut threads = Vec::new();
            for t in 0..2u32 {
                let (p, drops, stop, started) =
                    (p.clone(), drops.clone(), stop.clone(), started.clone());
                let h = rt.handle().clone();
                threads.push(std::thread::spawn(move || {
                    let _in = h.enter();
                    let mut ok = Vec::new();
                    let mut refused = Vec::new();
                    let mut n = 0u32;
                    started.wait();
                    while (!stop.load(Ordering::SeqCst) || n < 50) && n < 200_000 {
                        n += 1;
                        match p.try_complete_else_watch(
                            CountedOp(drops.clone()),
                            ms(600_000),
                            [t * 1_000_000 + n, n % 7],
                        ) {
                            Ok(h) => ok.push(h),
                            Err(WatchError::ReaperGone(op)) => refused.push(op),
                            Err(e) => panic!("unexpected refusal {:?}", e.kind()),
                        }
                    }
                    (ok, refused)
                }));
            }
            started.wait();
            // Lose the reaper once the registrations are under way.
            while p.metrics().registered < 100 {
                std::thread::yield_now();
            }
            drop(rt);
            stop.store(true, Ordering::SeqCst);
            let mut ok = Vec::new();
            let mut refused = Vec::new();
            for t in threads {
                let (o, r) = t.join().unwrap();
                ok.extend(o);
                refused.extend(r);
            }
            assert!(reaper.is_stopped());
            let dropped_by_crate = drops.load(Ordering::SeqCst);
            let gone = ok.len();
            support::paused().block_on(async {
                for h in ok {
                    assert_eq!(h.await, Err(OperationError::ReaperGone), "round {round}");
                }
            });
            assert_eq!(
                dropped_by_crate, gone,
                "round {round}: the crate dropped exactly the accepted ones"
            );
            let n_refused = refused.len();
            drop(refused);
            assert_eq!(drops.load(Ordering::SeqCst), gone + n_refused);
            let m = p.metrics();
            assert!(balanced(&m), "round {round}: {m:?}");
            assert_eq!(m.delayed, 0, "{m:?}");
        }
    });
}

/// The futures of a timer whose reaper is gone: a sleep reads elapsed and
/// resolves `ReaperGone`, a timeout resolves `ReaperGone` unless its future
/// is ready (polled first, it wins), and a shutdown finds nothing.
#[test]
fn futures_of_a_timer_whose_reaper_is_gone() {
    within(20, || {
        let rt = support::paused();
        let reaper = Reaper::start_on(rt.handle());
        let timer = Timer::builder().reaper(&reaper).build().unwrap();
        rt.block_on(settle());
        drop(rt);
        support::paused().block_on(async {
            assert!(timer.sleep(ms(1)).is_elapsed());
            assert_eq!(timer.sleep(ms(1)).await, Err(TimerError::ReaperGone));
            assert_eq!(
                timer.timeout(ms(1), std::future::pending::<()>()).await,
                Err(TimeoutError::Timer(TimerError::ReaperGone))
            );
            // "The inner future is polled first, so a future that is ready
            // at the deadline wins."
            assert_eq!(timer.timeout(ms(1), async { 5 }).await, Ok(5));
            assert!(timer.shutdown().is_empty());
            assert!(timer.is_shutdown());
            assert_eq!(timer.metrics().pending, 0);
        });
    });
}

/// A key that counts how many of its copies are alive.
struct Key(u32, Arc<AtomicUsize>);
impl PartialEq for Key {
    fn eq(&self, o: &Self) -> bool {
        self.0 == o.0
    }
}
impl Eq for Key {}
impl std::hash::Hash for Key {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        self.0.hash(h)
    }
}
impl Clone for Key {
    fn clone(&self) -> Self {
        self.1.fetch_add(1, Ordering::SeqCst);
        Key(self.0, self.1.clone())
    }
}
impl Drop for Key {
    fn drop(&mut self) {
        self.1.fetch_sub(1, Ordering::SeqCst);
    }
}

/// `n` operations on two keys each, their reaper (shared or its own) lost
/// with its runtime. Purgatory docs (Memory): "An expiry or cancellation
/// that ... leaves nothing pending, starts a purge at once, whatever the
/// interval. Keys whose lists empty are removed." Nothing can carry a purge
/// on after this (the purgatory is closed), so the lost reaper's
/// cancellations empty the map themselves, however large, and no key is
/// kept alive; a shutdown afterwards finds nothing.
fn a_lost_reaper_empties_the_map(n: u32, shared: bool) {
    within(60, move || {
        let rt = support::paused();
        let reaper = Reaper::start_on(rt.handle());
        let live = Arc::new(AtomicUsize::new(0));
        let p: Purgatory<Key, Never> = if shared {
            Purgatory::builder().reaper(&reaper).build().unwrap()
        } else {
            Purgatory::builder().build_on(rt.handle()).unwrap()
        };
        let key = |i| {
            live.fetch_add(1, Ordering::SeqCst);
            Key(i, live.clone())
        };
        let hs: Vec<_> = {
            let _in = rt.enter();
            (0..n)
                .map(|i| {
                    p.try_complete_else_watch(Never, ms(600_000), [key(i), key(1_000_000 + i)])
                        .unwrap()
                })
                .collect()
        };
        rt.block_on(settle());
        drop(rt);
        assert!(p.is_shutdown());
        support::paused().block_on(async {
            for h in hs {
                assert_eq!(h.await, Err(OperationError::ReaperGone));
            }
        });
        let m = p.metrics();
        assert!(balanced(&m), "{m:?}");
        assert_eq!(m.delayed, 0);
        assert_eq!(
            (m.watched, m.tombstones, m.keys),
            (0, 0, 0),
            "{n} operations on 2 keys each, reaper lost: {m:?}; keys still alive: {}",
            live.load(Ordering::SeqCst)
        );
        assert_eq!(live.load(Ordering::SeqCst), 0, "keys kept alive");
        assert!(p.shutdown().is_empty());
        let m = p.metrics();
        assert_eq!((m.watched, m.keys), (0, 0), "after shutdown(): {m:?}");
    });
}

#[test]
fn a_lost_reaper_empties_a_small_map() {
    a_lost_reaper_empties_the_map(200, true);
}

#[test]
fn a_lost_shared_reaper_empties_a_large_map() {
    a_lost_reaper_empties_the_map(3000, true);
}

#[test]
fn a_lost_own_reaper_empties_a_large_map() {
    a_lost_reaper_empties_the_map(3000, false);
}
