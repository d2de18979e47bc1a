//! The standalone timer, on paused Tokio time.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::{advance, Instant};
use tokio_purgatory::timer::{ScheduleError, TaskStatus, TimerError};
use tokio_purgatory::Timer;

mod support;
use support::{ms, settle};

fn counter() -> (Arc<AtomicUsize>, impl Fn() -> Box<dyn FnOnce() + Send>) {
    let n = Arc::new(AtomicUsize::new(0));
    let m = n.clone();
    (n, move || {
        let m = m.clone();
        Box::new(move || {
            m.fetch_add(1, Ordering::SeqCst);
        })
    })
}

#[tokio::test(start_paused = true)]
async fn fires_no_earlier_than_its_deadline_and_within_a_tick() {
    let timer = Timer::new();
    let fired_at = Arc::new(Mutex::new(None));
    let f = fired_at.clone();
    let start = Instant::now();
    timer
        .schedule(ms(100), move || *f.lock().unwrap() = Some(Instant::now()))
        .unwrap();
    advance(ms(99)).await;
    settle().await;
    assert!(fired_at.lock().unwrap().is_none(), "fired early");
    advance(ms(1)).await;
    settle().await;
    let at = fired_at.lock().unwrap().expect("fired at the deadline");
    assert!(
        at - start >= ms(100) && at - start <= ms(101),
        "{:?}",
        at - start
    );
}

#[tokio::test(start_paused = true)]
async fn zero_and_past_delays_run_on_the_reapers_next_turn() {
    let timer = Timer::new();
    let (n, task) = counter();
    timer.schedule(Duration::ZERO, task()).unwrap();
    timer.schedule_at(Instant::now() - ms(500), task()).unwrap();
    assert_eq!(n.load(Ordering::SeqCst), 0, "never run inline");
    settle().await;
    assert_eq!(n.load(Ordering::SeqCst), 2);
}

/// Kafka `TimerTest.testAlreadyExpiredTask`: a task added after its deadline runs
/// at once; one in the future does not.
#[tokio::test(start_paused = true)]
async fn kafka_already_expired_task() {
    let timer = Timer::builder().slots_per_level(3).build().unwrap();
    let (n, task) = counter();
    for _ in 0..5 {
        timer.schedule_at(Instant::now() - ms(5), task()).unwrap();
    }
    timer.schedule(ms(10), task()).unwrap();
    settle().await;
    assert_eq!(n.load(Ordering::SeqCst), 5);
    advance(ms(10)).await;
    settle().await;
    assert_eq!(n.load(Ordering::SeqCst), 6);
}

/// Kafka `TimerTest.testTaskExpiration` on a 3-slot wheel: delays 0-4, 10-99 twice
/// each and 100-499 all fire exactly once, in deadline order.
#[tokio::test(start_paused = true)]
async fn kafka_task_expiration_with_three_slots() {
    let timer = Timer::builder()
        .slots_per_level(3)
        .levels(4) // horizon 81 ticks: most tasks start in the overflow list
        .shards(1)
        .build()
        .unwrap();
    let output = Arc::new(Mutex::new(Vec::new()));
    let mut ids = Vec::new();
    let mut delays: Vec<u64> = (0..5).collect();
    for i in 10..100 {
        delays.push(i);
        delays.push(i);
    }
    delays.extend(100..500);
    for &d in &delays {
        let out = output.clone();
        timer
            .schedule(ms(d), move || out.lock().unwrap().push(d))
            .unwrap();
        ids.push(d);
    }
    advance(ms(2000)).await;
    settle().await;
    ids.sort();
    assert_eq!(*output.lock().unwrap(), ids);
    assert!(timer.is_empty());
}

#[tokio::test(start_paused = true)]
async fn duration_max_saturates_and_never_fires() {
    let timer = Timer::new();
    let (n, task) = counter();
    let t = timer.schedule(Duration::MAX, task()).unwrap();
    let sleep = timer.sleep(Duration::MAX);
    advance(Duration::from_secs(86_400 * 365 * 5)).await;
    settle().await;
    assert_eq!(n.load(Ordering::SeqCst), 0);
    assert!(t.is_pending());
    assert!(!sleep.is_elapsed());
    assert!(t.cancel());
    assert_eq!(t.status(), TaskStatus::Cancelled);
}

#[tokio::test(start_paused = true)]
async fn long_uptime_then_short_timers() {
    let timer = Timer::new();
    // More than 2^36 ms, the span of the default wheel.
    advance(Duration::from_millis((1 << 36) + 12_345)).await;
    settle().await;
    let (n, task) = counter();
    timer.schedule(ms(5), task()).unwrap();
    timer.schedule(ms(70_000), task()).unwrap();
    advance(ms(4)).await;
    settle().await;
    assert_eq!(n.load(Ordering::SeqCst), 0);
    advance(ms(1)).await;
    settle().await;
    assert_eq!(n.load(Ordering::SeqCst), 1);
    advance(ms(70_000)).await;
    settle().await;
    assert_eq!(n.load(Ordering::SeqCst), 2);
}

#[tokio::test(start_paused = true)]
async fn earlier_deadline_inserted_while_reaper_sleeps_on_a_later_one() {
    let timer = Timer::new();
    let (n, task) = counter();
    timer.schedule(Duration::from_secs(60), task()).unwrap();
    settle().await; // the reaper is now asleep until t+60s
    timer.schedule(ms(10), task()).unwrap();
    advance(ms(10)).await;
    settle().await;
    assert_eq!(
        n.load(Ordering::SeqCst),
        1,
        "re-armed for the earlier deadline"
    );
}

#[tokio::test(start_paused = true)]
async fn many_timers_on_one_deadline_are_expired_in_batches() {
    let timer = Timer::builder().batch_size(100).shards(1).build().unwrap();
    let (n, task) = counter();
    for _ in 0..10_000 {
        timer.schedule(ms(50), task()).unwrap();
    }
    // Another task due at the same instant gets to run before the reaper is done.
    let due = Instant::now() + ms(50);
    let seen = {
        let n = n.clone();
        tokio::spawn(async move {
            tokio::time::sleep_until(due).await;
            tokio::task::yield_now().await;
            n.load(Ordering::SeqCst)
        })
    };
    advance(ms(50)).await;
    let seen = seen.await.unwrap();
    assert!(seen < 10_000, "the reaper starved other tasks (saw {seen})");
    for _ in 0..200 {
        tokio::task::yield_now().await;
    }
    assert_eq!(n.load(Ordering::SeqCst), 10_000);
}

#[tokio::test(start_paused = true)]
async fn a_panicking_task_is_contained_and_later_timers_fire() {
    let timer = Timer::new();
    let (n, task) = counter();
    timer.schedule(ms(10), || panic!("task bug")).unwrap();
    timer.schedule(ms(10), task()).unwrap();
    timer.schedule(ms(20), task()).unwrap();
    advance(ms(20)).await;
    settle().await;
    assert_eq!(n.load(Ordering::SeqCst), 2);
    assert_eq!(timer.metrics().panicked, 1);
    timer.schedule(ms(5), task()).unwrap();
    advance(ms(5)).await;
    settle().await;
    assert_eq!(n.load(Ordering::SeqCst), 3, "the reaper survived");
}

#[tokio::test(start_paused = true)]
async fn idle_reaper_does_not_wake() {
    let timer = Timer::new();
    settle().await;
    advance(Duration::from_secs(3600)).await;
    settle().await;
    assert!(timer.metrics().reaper_wakeups <= 1, "{:?}", timer.metrics());
}

#[tokio::test(start_paused = true)]
async fn one_timer_ten_minutes_out_costs_at_most_two_wakeups() {
    let timer = Timer::new();
    settle().await;
    let (n, task) = counter();
    timer.schedule(Duration::from_secs(600), task()).unwrap();
    advance(Duration::from_secs(3600)).await;
    settle().await;
    assert_eq!(n.load(Ordering::SeqCst), 1);
    assert!(timer.metrics().reaper_wakeups <= 2, "{:?}", timer.metrics());
}

#[tokio::test(start_paused = true)]
async fn cancel_is_exact_and_status_tells() {
    let timer = Timer::new();
    let (n, task) = counter();
    let a = timer.schedule(ms(10), task()).unwrap();
    let b = timer.schedule(ms(10), task()).unwrap();
    assert_eq!(a.status(), TaskStatus::Pending);
    assert!(a.cancel());
    assert!(!a.cancel(), "second cancel finds nothing");
    assert_eq!(timer.len(), 1);
    advance(ms(10)).await;
    settle().await;
    assert_eq!(n.load(Ordering::SeqCst), 1);
    assert_eq!(a.status(), TaskStatus::Cancelled);
    assert_eq!(b.status(), TaskStatus::Done);
    assert!(!b.cancel());
}

#[tokio::test(start_paused = true)]
async fn stale_handle_cannot_cancel_the_task_that_reuses_its_slot() {
    let timer = Timer::builder().shards(1).build().unwrap();
    let (n, task) = counter();
    let old = timer.schedule(ms(1), task()).unwrap();
    advance(ms(1)).await;
    settle().await;
    let new = timer.schedule(ms(10), task()).unwrap(); // reuses the slot
    assert!(
        !old.is_pending(),
        "a stale handle must not see the new task"
    );
    assert_eq!(old.status(), TaskStatus::Done);
    assert!(!old.cancel());
    assert!(new.is_pending());
    advance(ms(10)).await;
    settle().await;
    assert_eq!(n.load(Ordering::SeqCst), 2);
}

#[tokio::test(start_paused = true)]
async fn capacity_limit_hands_the_task_back_and_is_freed_by_expiry_and_cancel() {
    let timer = Timer::builder().max_pending(2).build().unwrap();
    let a = timer.schedule(ms(10), || ()).unwrap();
    let _b = timer.schedule(ms(20), || ()).unwrap();
    let marker = Arc::new(());
    let m = marker.clone();
    let refused = timer.schedule(ms(10), move || drop(m)).unwrap_err();
    assert!(matches!(refused, ScheduleError::AtCapacity(_)));
    let task = refused.into_inner();
    assert_eq!(Arc::strong_count(&marker), 2, "the very task comes back");
    task();
    assert_eq!(Arc::strong_count(&marker), 1);
    assert_eq!(
        timer.sleep(ms(1)).await,
        Err(TimerError::AtCapacity),
        "sleeps count too"
    );
    assert!(a.cancel());
    timer.schedule(ms(10), || ()).unwrap();
    assert!(timer.schedule(ms(10), || ()).is_err());
    advance(ms(20)).await;
    settle().await;
    assert!(timer.is_empty());
    timer.schedule(ms(10), || ()).unwrap();
    timer.schedule(ms(10), || ()).unwrap();
}

#[tokio::test(start_paused = true)]
async fn sleep_resolves_at_its_deadline() {
    let timer = Timer::new();
    let start = Instant::now();
    let mut sleep = tokio_test::task::spawn(timer.sleep(ms(30)));
    assert!(sleep.poll().is_pending());
    advance(ms(29)).await;
    settle().await;
    assert!(!sleep.is_woken());
    assert!(sleep.poll().is_pending());
    advance(ms(1)).await;
    settle().await;
    assert!(sleep.is_woken());
    assert_eq!(sleep.poll(), std::task::Poll::Ready(Ok(())));
    assert!(Instant::now() - start >= ms(30));
}

#[tokio::test(start_paused = true)]
async fn dropping_a_sleep_removes_its_entry() {
    let timer = Timer::new();
    let sleep = timer.sleep(ms(30));
    assert_eq!(timer.len(), 1);
    drop(sleep);
    assert_eq!(timer.len(), 0);
}

#[tokio::test(start_paused = true)]
async fn shutdown_hands_back_unrun_tasks_and_fails_sleeps() {
    let timer = Timer::new();
    let (n, task) = counter();
    timer.schedule(ms(10), task()).unwrap();
    timer.schedule(ms(20), task()).unwrap();
    let sleep = timer.sleep(ms(10));
    let unrun = timer.shutdown();
    assert_eq!(unrun.len(), 2);
    assert_eq!(sleep.await, Err(TimerError::Shutdown));
    assert!(timer.is_shutdown());
    let refused = timer.schedule(ms(1), task()).unwrap_err();
    assert!(matches!(refused, ScheduleError::Shutdown(_)));
    assert!(timer.shutdown().is_empty(), "second shutdown has nothing");
    for t in unrun {
        t.run();
    }
    assert_eq!(n.load(Ordering::SeqCst), 2, "handed-back tasks are intact");
}

#[tokio::test(start_paused = true)]
async fn shutdown_from_inside_a_task_works() {
    let timer = Timer::new();
    let (n, task) = counter();
    let t2 = timer.clone();
    let unrun = Arc::new(Mutex::new(0));
    let u = unrun.clone();
    timer
        .schedule(ms(10), move || *u.lock().unwrap() = t2.shutdown().len())
        .unwrap();
    timer.schedule(ms(30), task()).unwrap();
    advance(ms(10)).await;
    settle().await;
    assert_eq!(*unrun.lock().unwrap(), 1, "the later task was handed back");
    advance(ms(30)).await;
    settle().await;
    assert_eq!(n.load(Ordering::SeqCst), 0);
}

#[tokio::test(start_paused = true)]
async fn dropping_the_last_timer_stops_the_reaper_and_fails_sleeps() {
    let timer = Timer::new();
    let (n, task) = counter();
    timer.schedule(ms(10), task()).unwrap();
    let sleep = timer.sleep(ms(10));
    let clone = timer.clone();
    drop(timer);
    assert!(!clone.is_shutdown(), "a clone keeps it running");
    drop(clone);
    assert_eq!(sleep.await, Err(TimerError::Shutdown));
    advance(ms(20)).await;
    settle().await;
    assert_eq!(n.load(Ordering::SeqCst), 0, "dropped unrun");
}

#[test]
fn reaper_gone_with_its_runtime_fails_sleeps_and_schedules() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    let timer = Timer::builder().build_on(rt.handle()).unwrap();
    let sleep = timer.sleep(ms(10));
    drop(rt);
    let other = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    assert_eq!(other.block_on(sleep), Err(TimerError::ReaperGone));
    let refused = timer.schedule(ms(1), || ()).unwrap_err();
    assert!(matches!(refused, ScheduleError::ReaperGone(_)));
}

#[test]
fn building_outside_a_runtime_is_an_error() {
    let err = Timer::builder().build().unwrap_err();
    assert!(err.is_no_runtime());
    assert!(Timer::builder().slots_per_level(1).build().is_err());
    assert!(Timer::builder().tick(Duration::ZERO).build().is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_tasks_insert_and_cancel_at_once() {
    // Real time, but nothing here waits on the clock: all deadlines are far out
    // except the ones awaited through the timer itself.
    let timer = Timer::new();
    let mut joins = Vec::new();
    for t in 0..8 {
        let timer = timer.clone();
        joins.push(tokio::spawn(async move {
            let mut kept = 0;
            for i in 0..5_000u64 {
                let h = timer
                    .schedule(Duration::from_secs(3600 + i), || ())
                    .unwrap();
                if (i + t) % 5 != 0 {
                    assert!(h.cancel());
                } else {
                    kept += 1;
                }
            }
            kept
        }));
    }
    let mut kept = 0;
    for j in joins {
        kept += j.await.unwrap();
    }
    assert_eq!(timer.len(), kept);
    assert_eq!(timer.shutdown().len(), kept);
}

/// The reaper expires at most `batch_size` entries of a shard per turn and yields
/// between turns, so other tasks run while a burst due at one instant drains.
#[tokio::test(start_paused = true)]
async fn the_reaper_expires_at_most_a_batch_per_turn() {
    // A batch below and one above the reaper's run per lock acquisition (64).
    for batch in [10, 100] {
        let timer = Timer::builder()
            .batch_size(batch)
            .shards(1)
            .build()
            .unwrap();
        let (n, task) = counter();
        let total = batch * 10;
        for _ in 0..total {
            timer.schedule(ms(5), task()).unwrap();
        }
        advance(ms(5)).await;
        let mut last = n.load(Ordering::SeqCst);
        assert!(
            last <= batch,
            "{last} expired in the first turn (batch {batch})"
        );
        let mut turns = 0;
        while last < total {
            tokio::task::yield_now().await;
            let now = n.load(Ordering::SeqCst);
            assert!(
                now - last <= batch,
                "{} in one turn (batch {batch})",
                now - last
            );
            last = now;
            turns += 1;
            assert!(turns < 10_000, "the burst never drained");
        }
        assert!(
            turns >= 9,
            "{total} entries in batches of {batch}: {turns} turns"
        );
    }
}

/// `reaper_wakeups` counts each wake-up from a sleep: one timer, one wake-up.
#[tokio::test(start_paused = true)]
async fn each_due_time_costs_exactly_one_wakeup() {
    let timer = Timer::new();
    settle().await;
    let before = timer.metrics().reaper_wakeups;
    let (n, task) = counter();
    timer.schedule(ms(10), task()).unwrap();
    timer.schedule(ms(30), task()).unwrap();
    advance(ms(10)).await;
    settle().await;
    assert_eq!(n.load(Ordering::SeqCst), 1);
    assert_eq!(timer.metrics().reaper_wakeups, before + 1);
    advance(ms(20)).await;
    settle().await;
    assert_eq!(n.load(Ordering::SeqCst), 2);
    assert_eq!(timer.metrics().reaper_wakeups, before + 2);
}

/// `Timer::timeout`: the inner future's output if it finishes first; `Elapsed` at
/// the deadline, never before; dropping it removes the deadline from the wheel;
/// a shut-down timer reports that it cannot keep the deadline.
#[tokio::test(start_paused = true)]
async fn timeout_future_yields_the_output_or_elapsed_at_its_deadline() {
    use tokio_purgatory::timer::{TimeoutError, TimerError};
    let timer = Timer::new();
    let start = Instant::now();

    let fast = timer.timeout(ms(50), async {
        tokio::time::sleep(ms(20)).await;
        "done"
    });
    assert_eq!(fast.await, Ok("done"));
    assert_eq!(Instant::now() - start, ms(20));
    settle().await;
    assert_eq!(timer.len(), 0, "the unused deadline left the wheel");

    let start = Instant::now();
    let slow = timer.timeout(ms(30), std::future::pending::<()>());
    assert_eq!(slow.deadline(), start + ms(30));
    assert_eq!(slow.await, Err(TimeoutError::Elapsed));
    assert!(Instant::now() >= start + ms(30), "not before the deadline");
    assert!(Instant::now() <= start + ms(32), "within a tick or two");

    // Ready at the deadline: the output wins.
    let start = Instant::now();
    let tie = timer.timeout_at(start + ms(10), tokio::time::sleep_until(start + ms(10)));
    assert_eq!(tie.await, Ok(()));

    // Dropped: the deadline goes with it.
    let dropped = timer.timeout(ms(1000), std::future::pending::<()>());
    assert_eq!(timer.len(), 1);
    let _inner: &std::future::Pending<()> = dropped.get_ref();
    drop(dropped);
    assert_eq!(timer.len(), 0);

    // The inner future can be taken back.
    let kept = timer.timeout(ms(1000), async { 5 });
    assert_eq!(kept.into_inner().await, 5);

    let cut = timer.timeout(ms(1000), std::future::pending::<()>());
    let _ = timer.shutdown();
    assert_eq!(cut.await, Err(TimeoutError::Timer(TimerError::Shutdown)));
    let err = TimeoutError::Timer(TimerError::Shutdown);
    assert!(std::error::Error::source(&err).is_some());
    assert_eq!(TimeoutError::Elapsed.to_string(), "deadline has elapsed");
}

/// A heartbeat holding a weak timer beats while someone holds the timer, and
/// stops (its pending beat dropped unrun) once the last strong handle goes.
#[tokio::test(start_paused = true)]
async fn a_heartbeat_on_a_weak_timer_stops_with_the_timer() {
    use tokio_purgatory::timer::WeakTimer;
    fn beat(timer: WeakTimer, n: Arc<AtomicUsize>) {
        n.fetch_add(1, Ordering::SeqCst);
        if let Some(t) = timer.upgrade() {
            let _ = t.schedule(ms(100), move || beat(timer, n));
        }
    }
    let timer = Timer::new();
    let n = Arc::new(AtomicUsize::new(0));
    let (w, n2) = (timer.downgrade(), n.clone());
    timer.schedule(ms(100), move || beat(w, n2)).unwrap();
    for _ in 0..3 {
        advance(ms(100)).await;
        settle().await;
    }
    assert_eq!(n.load(Ordering::SeqCst), 3);
    let weak = timer.downgrade();
    drop(timer);
    assert!(weak.upgrade().is_none());
    advance(ms(1000)).await;
    settle().await;
    assert_eq!(
        n.load(Ordering::SeqCst),
        3,
        "no beat after the timer is gone"
    );
}

/// The payload-free reason of a refused task.
#[tokio::test(start_paused = true)]
async fn schedule_refusals_have_a_payload_free_kind() {
    use tokio_purgatory::timer::TimerError;
    let timer = Timer::new();
    let _ = timer.shutdown();
    let e = timer.schedule(ms(1), || {}).unwrap_err();
    assert_eq!(e.kind(), TimerError::Shutdown);
    let kind: TimerError = e.into();
    assert_eq!(kind.to_string(), "timer is shut down");
}

// ---------------------------------------------------------------- repeating tasks

/// Lets `total` pass a millisecond at a time, so the reaper runs at each
/// instant on the way (one `advance` jumps straight to its end).
async fn step(total: Duration) {
    for _ in 0..total.as_millis() {
        advance(ms(1)).await;
        settle().await;
    }
}

/// Records when each run happened, and hands out the next delay from a list.
fn runs_with(
    delays: Vec<Option<Duration>>,
) -> (
    Arc<Mutex<Vec<Instant>>>,
    impl FnMut() -> Option<Duration> + Send + 'static,
) {
    let runs = Arc::new(Mutex::new(Vec::new()));
    let r = runs.clone();
    let mut delays = delays.into_iter();
    (runs, move || {
        r.lock().unwrap().push(Instant::now());
        delays.next().flatten()
    })
}

#[tokio::test(start_paused = true)]
async fn a_repeating_task_runs_after_each_delay_it_returns_until_none() {
    let timer = Timer::new();
    let start = Instant::now();
    let (runs, task) = runs_with(vec![Some(ms(20)), Some(ms(50)), None]);
    let t = timer.schedule_repeating(ms(10), task).unwrap();
    step(ms(1_000)).await;
    settle().await;
    let at: Vec<Duration> = runs.lock().unwrap().iter().map(|i| *i - start).collect();
    assert_eq!(at.len(), 3, "{at:?}");
    for (got, want) in at.iter().zip([10, 30, 80]) {
        assert!(*got >= ms(want) && *got <= ms(want + 2), "{at:?}");
    }
    assert_eq!(t.status(), TaskStatus::Done);
    assert!(!t.cancel(), "it had stopped");
    assert!(!t.reset(ms(10)));
    assert_eq!(timer.len(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_cancelled_repeating_task_never_runs_again_and_is_dropped() {
    let timer = Timer::new();
    let (n, _) = counter();
    let dropped = Arc::new(AtomicUsize::new(0));
    struct OnDrop(Arc<AtomicUsize>);
    impl Drop for OnDrop {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
    let guard = OnDrop(dropped.clone());
    let m = n.clone();
    let t = timer
        .schedule_repeating(ms(10), move || {
            let _keep = &guard;
            m.fetch_add(1, Ordering::SeqCst);
            Some(ms(10))
        })
        .unwrap();
    step(ms(35)).await;
    assert_eq!(n.load(Ordering::SeqCst), 3);
    assert!(t.is_pending());
    assert!(t.reset(ms(100)), "the next run moves");
    step(ms(50)).await;
    assert_eq!(n.load(Ordering::SeqCst), 3, "moved past 50 ms");
    assert!(t.cancel());
    assert!(!t.cancel(), "once");
    assert_eq!(t.status(), TaskStatus::Cancelled);
    assert_eq!(dropped.load(Ordering::SeqCst), 1, "dropped at the cancel");
    step(ms(500)).await;
    assert_eq!(n.load(Ordering::SeqCst), 3);
    assert_eq!(timer.len(), 0);
}

/// A task that cancels itself through its own handle while it runs: no
/// deadlock, and no run after.
#[tokio::test(start_paused = true)]
async fn a_repeating_task_may_cancel_itself_while_it_runs() {
    let timer = Timer::new();
    let me: Arc<Mutex<Option<Arc<tokio_purgatory::timer::TaskHandle>>>> = Arc::default();
    let runs = Arc::new(AtomicUsize::new(0));
    let (slot, r) = (me.clone(), runs.clone());
    let t = Arc::new(
        timer
            .schedule_repeating(ms(10), move || {
                if r.fetch_add(1, Ordering::SeqCst) + 1 == 2 {
                    let handle = slot.lock().unwrap().take().unwrap();
                    assert!(handle.cancel());
                }
                Some(ms(10))
            })
            .unwrap(),
    );
    *me.lock().unwrap() = Some(t.clone());
    step(ms(200)).await;
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    assert_eq!(t.status(), TaskStatus::Cancelled);
    assert_eq!(timer.len(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_panicking_repeating_task_ends_its_chain_and_nothing_else() {
    let timer = Timer::new();
    let (n, task) = counter();
    let t = timer
        .schedule_repeating(ms(10), || -> Option<Duration> { panic!("boom") })
        .unwrap();
    timer.schedule(ms(30), task()).unwrap();
    step(ms(100)).await;
    assert_eq!(n.load(Ordering::SeqCst), 1, "the other task ran");
    assert_eq!(timer.metrics().panicked, 1);
    assert_eq!(t.status(), TaskStatus::Done);
    assert_eq!(timer.len(), 0);
}

/// A chain that a panic ended is ended: the handle cannot "cancel" it after,
/// and its status stays `Done` (as for a chain that returned `None`), whether
/// the panic came on the first run or a later one.
#[tokio::test(start_paused = true)]
async fn a_chain_ended_by_a_panic_cannot_be_cancelled_after() {
    for runs_before in [0, 2] {
        let timer = Timer::new();
        let mut left = runs_before;
        let t = timer
            .schedule_repeating(ms(10), move || {
                if left == 0 {
                    panic!("boom");
                }
                left -= 1;
                Some(ms(10))
            })
            .unwrap();
        step(ms(20 + 10 * runs_before as u64)).await;
        assert_eq!(timer.metrics().panicked, 1);
        assert_eq!(t.status(), TaskStatus::Done, "after {runs_before} runs");
        assert!(!t.cancel(), "the panic ended it; nothing to cancel");
        assert_eq!(t.status(), TaskStatus::Done);
        assert!(!t.reset(ms(10)));
        assert!(!t.is_pending());
        assert_eq!(timer.len(), 0);
    }
}

/// A chain that ends by returning `None` and whose task then panics in its
/// `Drop` is ended too, and the panic is contained and counted.
#[tokio::test(start_paused = true)]
async fn a_chain_whose_task_panics_in_drop_as_it_ends_is_ended() {
    struct Bomb;
    impl Drop for Bomb {
        fn drop(&mut self) {
            panic!("drop bomb");
        }
    }
    let timer = Timer::new();
    let bomb = Bomb;
    let t = timer
        .schedule_repeating(ms(10), move || -> Option<Duration> {
            let _keep = &bomb;
            None
        })
        .unwrap();
    step(ms(20)).await;
    assert_eq!(timer.metrics().panicked, 1);
    assert!(!t.cancel());
    assert_eq!(t.status(), TaskStatus::Done);
    // The timer goes on.
    let (n, task) = counter();
    timer.schedule(ms(5), task()).unwrap();
    step(ms(10)).await;
    assert_eq!(n.load(Ordering::SeqCst), 1);
}

/// A cancel that lands while a run is under way wins, even if that run then
/// panics: the cancel said `true`, so the status stays `Cancelled`, and no
/// later cancel succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_during_a_run_that_panics_stays_cancelled() {
    use std::sync::mpsc;
    let timer = Timer::new();
    let (started_tx, started) = mpsc::channel::<()>();
    let (go_tx, go) = mpsc::channel::<()>();
    let t = timer
        .schedule_repeating(Duration::ZERO, move || -> Option<Duration> {
            started_tx.send(()).unwrap();
            go.recv().unwrap();
            panic!("after the cancel");
        })
        .unwrap();
    let t = tokio::task::spawn_blocking(move || {
        started.recv_timeout(Duration::from_secs(10)).unwrap();
        let cancelled = t.cancel();
        go_tx.send(()).unwrap();
        (t, cancelled)
    });
    let (t, cancelled) = tokio::time::timeout(Duration::from_secs(10), t)
        .await
        .unwrap()
        .unwrap();
    assert!(cancelled, "the chain was running, not ended");
    tokio::time::timeout(Duration::from_secs(10), async {
        while timer.metrics().panicked == 0 {
            tokio::task::yield_now().await;
        }
    })
    .await
    .unwrap();
    assert!(!t.cancel());
    assert_eq!(t.status(), TaskStatus::Cancelled);
    assert_eq!(timer.len(), 0);
}

/// A panicking run and a cancel from another thread, raced many times: exactly
/// one of them ends the chain, a cancel that comes after the panic was counted
/// says `false`, and the handle agrees with what `cancel` said.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_racing_a_cancel_ends_the_chain_once() {
    let timer = Timer::new();
    let started = Arc::new(AtomicUsize::new(0));
    let (mut won, mut after_panic) = (0, 0);
    for i in 0..200 {
        let before = timer.metrics().panicked;
        let s = started.clone();
        let t = Arc::new(
            timer
                .schedule_repeating(Duration::ZERO, move || -> Option<Duration> {
                    s.fetch_add(1, Ordering::SeqCst);
                    panic!("race")
                })
                .unwrap(),
        );
        let (c, other) = (t.clone(), timer.clone());
        let (seen, cancelled) = std::thread::spawn(move || {
            let seen = other.metrics().panicked;
            (seen, c.cancel())
        })
        .join()
        .unwrap();
        if seen > before {
            assert!(!cancelled, "run {i}: the panic had ended the chain");
            after_panic += 1;
        }
        assert!(!t.cancel(), "run {i}: ended once already");
        let want = if cancelled {
            won += 1;
            TaskStatus::Cancelled
        } else {
            TaskStatus::Done
        };
        assert_eq!(t.status(), want, "run {i}");
        // Every run that started panicked and was counted before the next.
        let settled = tokio::time::timeout(Duration::from_secs(10), async {
            while !timer.is_empty()
                || timer.metrics().panicked != started.load(Ordering::SeqCst) as u64
            {
                tokio::task::yield_now().await;
            }
        })
        .await;
        assert!(settled.is_ok(), "run {i}: a run never finished");
        assert_eq!(t.status(), want, "run {i}: the status never changes");
    }
    // Which side wins is the scheduler's; both orders are common here.
    eprintln!("cancel won {won} of 200; {after_panic} cancels came after the panic");
}

/// A repeating task keeps its room under the limit: full, it still goes on.
#[tokio::test(start_paused = true)]
async fn a_repeating_task_at_the_limit_goes_on() {
    let timer = Timer::builder().max_pending(1).build().unwrap();
    let (n, task) = counter();
    let beats = Arc::new(AtomicUsize::new(0));
    let b = beats.clone();
    timer
        .schedule_repeating(ms(10), move || {
            b.fetch_add(1, Ordering::SeqCst);
            Some(ms(10))
        })
        .unwrap();
    assert!(matches!(
        timer.schedule(ms(10), task()),
        Err(ScheduleError::AtCapacity(_))
    ));
    step(ms(55)).await;
    assert_eq!(beats.load(Ordering::SeqCst), 5);
    assert_eq!(n.load(Ordering::SeqCst), 0);
    assert!(matches!(
        timer.schedule(ms(10), task()),
        Err(ScheduleError::AtCapacity(_))
    ));
}

/// Shutdown hands a repeating task back like any other; dropping the timer
/// drops it (the task holds the timer weakly, so it keeps nothing alive).
#[tokio::test(start_paused = true)]
async fn shutdown_hands_a_repeating_task_back_and_a_dropped_timer_drops_it() {
    let timer = Timer::new();
    let (n, _) = counter();
    let m = n.clone();
    let t = timer
        .schedule_repeating(ms(10), move || {
            m.fetch_add(1, Ordering::SeqCst);
            Some(ms(10))
        })
        .unwrap();
    let back = timer.shutdown();
    assert_eq!(back.len(), 1);
    assert!(!t.cancel(), "handed back, not cancelled");
    for task in back {
        task.run();
    }
    assert_eq!(n.load(Ordering::SeqCst), 1, "a handed-back task runs once");

    let timer = Timer::new();
    let alive = Arc::new(());
    let held = alive.clone();
    let t = timer
        .schedule_repeating(ms(10), move || {
            let _ = &held;
            Some(ms(10))
        })
        .unwrap();
    step(ms(25)).await;
    drop(timer);
    settle().await;
    assert_eq!(
        Arc::strong_count(&alive),
        1,
        "the task was dropped with the timer"
    );
    assert!(!t.is_pending());
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn cancel_and_take_hands_the_task_back_exactly_once() {
    let timer = Timer::new();
    let ran = Arc::new(AtomicUsize::new(0));
    let r = ran.clone();
    let t = timer
        .schedule(Duration::from_millis(10), move || {
            r.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
    let task = t.cancel_and_take().expect("not run yet");
    assert!(t.cancel_and_take().is_none());
    assert!(!t.cancel());
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(
        ran.load(Ordering::SeqCst),
        0,
        "cancelled: the timer never ran it"
    );
    task.run();
    assert_eq!(ran.load(Ordering::SeqCst), 1);
    // Once it ran, nothing comes back.
    let r = ran.clone();
    let t = timer
        .schedule(Duration::from_millis(10), move || {
            r.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(t.cancel_and_take().is_none());
    assert_eq!(ran.load(Ordering::SeqCst), 2);
    // A repeating task stops and is not handed back.
    let r = ran.clone();
    let t = timer
        .schedule_repeating(Duration::from_millis(5), move || {
            r.fetch_add(1, Ordering::SeqCst);
            Some(Duration::from_millis(5))
        })
        .unwrap();
    tokio::time::sleep(Duration::from_millis(12)).await;
    assert!(t.cancel_and_take().is_none());
    let runs = ran.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(ran.load(Ordering::SeqCst), runs, "stopped");
    assert_eq!(timer.metrics().pending, 0);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn async_tasks_await_on_their_own_task_and_cancel_before_or_during() {
    use tokio_purgatory::timer::ScheduleError;
    let timer = Timer::new();
    // Runs at its deadline as a task of its own, and may await.
    let (tx, rx) = tokio::sync::oneshot::channel();
    let start = Instant::now();
    let t = timer
        .schedule_async(ms(100), async move {
            tokio::time::sleep(ms(50)).await;
            let _ = tx.send(Instant::now());
        })
        .unwrap();
    assert!(t.is_pending() && !t.is_finished());
    let done = rx.await.unwrap();
    assert_eq!(done - start, ms(150));
    settle().await;
    assert!(t.is_finished());
    assert!(!t.cancel(), "finished: nothing to cancel");

    // Cancelled before its deadline: never polled, dropped at once.
    let dropped = Arc::new(AtomicUsize::new(0));
    struct Flag(Arc<AtomicUsize>);
    impl Drop for Flag {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
    let flag = Flag(dropped.clone());
    let t = timer
        .schedule_async(ms(100), async move {
            let _flag = flag;
            unreachable!("cancelled before its deadline");
        })
        .unwrap();
    assert!(t.cancel());
    assert_eq!(dropped.load(Ordering::SeqCst), 1);
    assert!(!t.cancel());
    assert!(!t.reset(ms(10)));
    tokio::time::sleep(ms(200)).await;

    // Cancelled while running: aborted at its next await.
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let t = timer
        .schedule_async(ms(10), async move {
            tokio::time::sleep(ms(1000)).await;
            let _ = tx.send(());
        })
        .unwrap();
    tokio::time::sleep(ms(20)).await;
    assert!(!t.is_pending() && !t.is_finished(), "running");
    assert!(t.cancel());
    assert!(rx.await.is_err(), "aborted: it never sent");

    // Refused: the future comes back.
    drop(timer.shutdown());
    match timer.schedule_async(ms(10), async {}) {
        Err(ScheduleError::Shutdown(_future)) => {}
        other => panic!("{:?}", other.err().map(|e| e.to_string())),
    }
}

/// A future that can no longer start (its timer dropped, or the task a
/// shutdown handed back dropped by its owner) is dropped unrun, and its
/// handle reads finished: not pending, nothing left to cancel or reset.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn an_async_task_dropped_unrun_reads_finished() {
    struct Flag(Arc<AtomicUsize>);
    impl Drop for Flag {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
    let dropped = Arc::new(AtomicUsize::new(0));

    // The last timer clone dropped.
    let timer = Timer::new();
    let flag = Flag(dropped.clone());
    let t = timer
        .schedule_async(ms(100), async move {
            let _flag = flag;
            unreachable!("its timer is gone");
        })
        .unwrap();
    drop(timer);
    settle().await;
    assert_eq!(dropped.load(Ordering::SeqCst), 1, "dropped unrun");
    assert!(!t.is_pending());
    assert!(t.is_finished());
    assert!(!t.cancel(), "nothing left to cancel");
    assert!(!t.reset(ms(10)));

    // Handed back by a shutdown, then dropped.
    let timer = Timer::new();
    let flag = Flag(dropped.clone());
    let t = timer
        .schedule_async(ms(100), async move {
            let _flag = flag;
            unreachable!("handed back and dropped");
        })
        .unwrap();
    let back = timer.shutdown();
    assert_eq!(back.len(), 1);
    assert!(!t.is_finished(), "handed back: it may still be run");
    drop(back);
    assert_eq!(dropped.load(Ordering::SeqCst), 2);
    assert!(!t.is_pending() && t.is_finished() && !t.cancel());

    // Handed back and run: it starts as usual.
    let timer = Timer::new();
    let (tx, rx) = tokio::sync::oneshot::channel();
    let t = timer
        .schedule_async(ms(100), async move {
            let _ = tx.send(());
        })
        .unwrap();
    for task in timer.shutdown() {
        task.run();
    }
    rx.await.unwrap();
    settle().await;
    assert!(t.is_finished() && !t.cancel());
}

/// A timeout that resolved to an error says the same when polled again, and
/// does not poll the inner future again.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_timeout_that_ended_does_not_poll_its_future_again() {
    use std::future::Future;
    use std::task::{Context, Poll};
    use tokio_purgatory::timer::TimeoutError;
    struct CountsPolls(Arc<AtomicUsize>);
    impl Future for CountsPolls {
        type Output = ();
        fn poll(self: std::pin::Pin<&mut Self>, _: &mut Context<'_>) -> Poll<()> {
            self.0.fetch_add(1, Ordering::SeqCst);
            Poll::Pending
        }
    }
    let timer = Timer::new();
    let polls = Arc::new(AtomicUsize::new(0));
    let mut f = Box::pin(timer.timeout(ms(10), CountsPolls(polls.clone())));
    assert_eq!((&mut f).await, Err(TimeoutError::Elapsed));
    let before = polls.load(Ordering::SeqCst);
    let waker = futures::task::noop_waker();
    let again = f.as_mut().poll(&mut Context::from_waker(&waker));
    assert_eq!(again, Poll::Ready(Err(TimeoutError::Elapsed)));
    assert_eq!(polls.load(Ordering::SeqCst), before, "not polled again");

    // Ended by a shutdown: the same.
    let mut f = Box::pin(timer.timeout(ms(10), CountsPolls(polls.clone())));
    assert_eq!(
        f.as_mut().poll(&mut Context::from_waker(&waker)),
        Poll::Pending
    );
    drop(timer.shutdown());
    let first = (&mut f).await;
    assert!(matches!(first, Err(TimeoutError::Timer(_))));
    let before = polls.load(Ordering::SeqCst);
    let again = f.as_mut().poll(&mut Context::from_waker(&waker));
    assert_eq!(again, Poll::Ready(first));
    assert_eq!(polls.load(Ordering::SeqCst), before);
}

/// A repeating task keeps its room under `max_pending` through each run, so
/// work scheduled from inside the run (or anywhere while it runs) cannot take
/// it and push the timer over its limit when the chain goes back in; the
/// room comes back when the chain ends.
#[tokio::test(start_paused = true)]
async fn a_repeating_task_keeps_its_room_through_its_runs() {
    let timer = Timer::builder().max_pending(1).build().unwrap();
    let weak = timer.downgrade();
    let refused = Arc::new(AtomicUsize::new(0));
    let (r, mut runs) = (refused.clone(), 0);
    let chain = timer
        .schedule_repeating(ms(10), move || {
            runs += 1;
            let t = weak.upgrade().unwrap();
            if matches!(
                t.schedule(ms(100), || {}),
                Err(ScheduleError::AtCapacity(_))
            ) {
                r.fetch_add(1, Ordering::SeqCst);
            }
            (runs < 3).then_some(ms(10))
        })
        .unwrap();
    for _ in 0..4 {
        advance(ms(10)).await;
        settle().await;
        assert!(timer.len() <= 1, "{} pending", timer.len());
    }
    assert_eq!(refused.load(Ordering::SeqCst), 3, "each run found no room");
    assert_eq!(chain.status(), TaskStatus::Done);
    assert_eq!(timer.len(), 0);
    // The room is back.
    assert!(timer.schedule(ms(10), || {}).is_ok());
}

/// A timeout whose future finished first gives its deadline's entry up at
/// once, kept or not: its room under `max_pending` is free, and it is never
/// counted as fired.
#[tokio::test(start_paused = true)]
async fn a_timeout_that_finished_first_leaves_the_wheel() {
    let timer = Timer::builder().max_pending(1).build().unwrap();
    let mut t = timer.timeout(ms(50), std::future::ready(7));
    assert_eq!((&mut t).await, Ok(7));
    assert_eq!(timer.len(), 0);
    let later = timer.schedule(ms(10), || {}).expect("the room is free");
    advance(ms(100)).await;
    settle().await;
    assert_eq!(later.status(), TaskStatus::Done);
    let m = timer.metrics();
    assert_eq!(m.expired, 1, "the task only: {m:?}");
    drop(t);
}
