//! The standalone timer at its edges, used hostilely.
//!
//! On paused time: panic payloads whose own `Drop` panics, from one-shot and
//! repeating tasks; a timeout whose future is ready at its deadline (not
//! counted as fired when polled before the reaper reaches the deadline,
//! counted when a task of the same reaper turn readied it); a fired `Sleep`
//! and an elapsed timeout polled again after the last `Timer` clone is gone.
//!
//! On real threads, each race bounded: `cancel_and_take` and an async task's
//! `reset` racing the deadline; inserts from six threads into three timers
//! (two on a shared reaper) losing no wake-up and running nothing early;
//! the room under `max_pending` never drifting while drops, cancels, takes
//! and resets race their deadlines; a shutdown racing `cancel_and_take`
//! handing each task over once; resets and a cancel through one shared
//! `TaskHandle` racing the reaper, one-shot and repeating. On real time, slow
//! tasks: a repeating task's next delay counting from the end of a slow run,
//! and a slow task on a shared reaper delaying its neighbours but losing
//! nothing and running nothing early.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::{advance, Instant};
use tokio_purgatory::timer::{ScheduleError, TaskStatus, TimeoutError, TimerError};
use tokio_purgatory::{Reaper, Timer};

mod support;
use support::{ms, settle, within};

fn us(n: u64) -> Duration {
    Duration::from_micros(n)
}

/// A panic payload whose own drop panics.
struct Bomb;
impl Drop for Bomb {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            panic!("the payload's drop");
        }
    }
}

/// `Timer`'s docs: "A panicking task is caught, counted in
/// `TimerMetrics::panicked` ...; later tasks still run", here with a payload
/// whose own drop panics too (the "User panics are contained" guarantee), from
/// a one-shot task and from a repeating one (whose chain it ends): each
/// panic counted once, a later task runs, and the timer still sleeps.
#[tokio::test(start_paused = true)]
async fn panic_payloads_whose_drop_panics_are_contained() {
    let timer = Timer::builder().shards(1).build().unwrap();
    let ran = Arc::new(AtomicUsize::new(0));
    timer
        .schedule(ms(5), || std::panic::panic_any(Bomb))
        .unwrap();
    let mut n = 0;
    let rep = timer
        .schedule_repeating(ms(5), move || {
            n += 1;
            if n == 2 {
                std::panic::panic_any(Bomb);
            }
            Some(ms(1))
        })
        .unwrap();
    let r = ran.clone();
    timer
        .schedule(ms(20), move || {
            r.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
    tokio::time::sleep(ms(30)).await;
    settle().await;
    assert_eq!(ran.load(Ordering::SeqCst), 1, "later task ran");
    assert_eq!(
        rep.status(),
        TaskStatus::Done,
        "the chain ended by its panic"
    );
    assert!(!rep.cancel());
    let m = timer.metrics();
    // one-shot panic + repeating panic (its drop of the Bomb payload is
    // swallowed, not a second count)
    assert_eq!(m.panicked, 2, "{m:?}");
    // still works
    timer.sleep(ms(1)).await.unwrap();
}

/// `TimeoutFuture`'s docs: "The inner future is polled first, so a future
/// that is ready at the deadline wins. Once it has, the deadline leaves the
/// wheel at once (its room under `max_pending` is free again, and it is not
/// counted as fired)". A future ready at exactly the deadline, polled before
/// the reaper reaches it: `Ok`, and no `expired` count nor lateness sample.
#[tokio::test(start_paused = true)]
async fn a_future_ready_at_the_deadline_wins_and_is_not_counted_as_fired() {
    let timer = Timer::builder()
        .tick(Duration::from_millis(1))
        .build()
        .unwrap();
    let at = Instant::now() + ms(5);
    let r = timer.timeout_at(at, tokio::time::sleep_until(at)).await;
    assert_eq!(r, Ok(()), "the ready future won");
    let m = timer.metrics();
    assert_eq!(
        (m.expired, timer.lateness().count()),
        (0, 0),
        "a timeout whose future won was counted as fired: {m:?}"
    );
}

/// The same with the future made ready by a timer task due in the same tick
/// as the deadline (scheduled first, so in the same reaper turn): the
/// future wins, and the deadline the reaper reached before it was polled
/// ready is counted as fired, with its lateness sample (`TimeoutFuture`'s
/// docs).
#[tokio::test(start_paused = true)]
async fn a_future_readied_by_a_task_of_the_same_turn_wins_and_its_deadline_counts() {
    let timer = Timer::builder().shards(1).tick(ms(1)).build().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<u8>();
    timer
        .schedule(ms(5), move || {
            let _ = tx.send(7);
        })
        .unwrap();
    let r = timer.timeout(ms(5), rx).await;
    assert_eq!(r.map(|x| x.unwrap()), Ok(7), "the ready future won");
    let m = timer.metrics();
    assert_eq!(
        (m.expired, m.pending),
        (2, 0),
        "the task and the deadline: {m:?}"
    );
    assert_eq!(timer.lateness().count(), 2);
}

/// `TaskHandle::cancel_and_take`'s docs: "racing the reaper, either the task
/// runs and this returns `None`, or it returns the task and the task never
/// runs", on real threads: each task runs once (by the timer or by the
/// caller that took it), the status then reads `Cancelled` or `Done`, and
/// `expired` counts the timer's runs only.
#[test]
fn cancel_and_take_racing_the_deadline_is_exactly_once() {
    within(60, || {
        let rt = support::multi();
        for round in 0..30 {
            let timer = rt.block_on(async {
                Timer::builder()
                    .tick(Duration::from_micros(50))
                    .build()
                    .unwrap()
            });
            let _g = rt.enter();
            let n = 300;
            let runs: Vec<Arc<AtomicU32>> = (0..n).map(|_| Arc::new(AtomicU32::new(0))).collect();
            let handles: Vec<_> = runs
                .iter()
                .enumerate()
                .map(|(i, r)| {
                    let r = r.clone();
                    timer
                        .schedule(
                            Duration::from_micros(500 + (i as u64 % 7) * 100),
                            move || {
                                r.fetch_add(1, Ordering::SeqCst);
                            },
                        )
                        .unwrap()
                })
                .collect();
            std::thread::sleep(Duration::from_micros(400 + round * 20));
            let mut taken = Vec::new();
            for (i, h) in handles.iter().enumerate() {
                if let Some(t) = h.cancel_and_take() {
                    taken.push((i, t));
                }
            }
            // wait (bounded) until every task not taken ran
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            loop {
                let done = handles.iter().all(|h| h.status() != TaskStatus::Pending);
                let ran: u32 = runs.iter().map(|r| r.load(Ordering::SeqCst)).sum();
                if done && ran as usize + taken.len() == n {
                    break;
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "round {round}: ran {ran} + taken {} != {n}",
                    taken.len()
                );
                std::thread::yield_now();
            }
            for (i, _) in &taken {
                assert_eq!(
                    runs[*i].load(Ordering::SeqCst),
                    0,
                    "round {round}: taken and run"
                );
                assert_eq!(handles[*i].status(), TaskStatus::Cancelled);
            }
            for (i, h) in handles.iter().enumerate() {
                assert!(runs[i].load(Ordering::SeqCst) <= 1);
                if runs[i].load(Ordering::SeqCst) == 1 {
                    assert_eq!(h.status(), TaskStatus::Done, "round {round}");
                }
            }
            let taken_count = taken.len();
            // run the taken ones here: each runs once
            for (i, t) in taken {
                t.run();
                assert_eq!(runs[i].load(Ordering::SeqCst), 1);
            }
            let m = timer.metrics();
            assert_eq!(
                m.expired,
                (n - taken_count) as u64,
                "round {round}: expired counts the runs by the timer"
            );
        }
    });
}

/// `AsyncTaskHandle::reset`'s docs: "Racing the deadline, either the reset
/// wins and the future starts at the new deadline only, or the reaper has
/// already taken it out to start it (at the old deadline) and the reset
/// returns `false`, changing nothing", on real threads.
#[test]
fn async_reset_racing_the_deadline() {
    within(60, || {
        let rt = support::multi();
        for round in 0..30u64 {
            let timer = rt.block_on(async {
                Timer::builder()
                    .tick(Duration::from_micros(50))
                    .build()
                    .unwrap()
            });
            let _g = rt.enter();
            let n = 200;
            let started: Vec<Arc<AtomicBool>> =
                (0..n).map(|_| Arc::new(AtomicBool::new(false))).collect();
            let handles: Vec<_> = started
                .iter()
                .map(|s| {
                    let s = s.clone();
                    timer
                        .schedule_async(Duration::from_micros(600), async move {
                            s.store(true, Ordering::SeqCst);
                        })
                        .unwrap()
                })
                .collect();
            std::thread::sleep(Duration::from_micros(300 + round * 20));
            let moved: Vec<bool> = handles
                .iter()
                .map(|h| h.reset(Duration::from_secs(3600)))
                .collect();
            // those not moved start (bounded wait)
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            loop {
                let all = (0..n)
                    .filter(|&i| !moved[i])
                    .all(|i| started[i].load(Ordering::SeqCst));
                if all {
                    break;
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "round {round}: a future whose reset failed never started"
                );
                std::thread::yield_now();
            }
            // those moved must not start before an hour; give the reaper a while
            std::thread::sleep(Duration::from_millis(5));
            for i in 0..n {
                if moved[i] {
                    assert!(
                        !started[i].load(Ordering::SeqCst),
                        "round {round}: reset won but the future started"
                    );
                    assert!(handles[i].is_pending());
                }
            }
            drop(timer.shutdown());
        }
    });
}

/// Inserts from many threads (inside and outside the runtime) with random
/// small delays on a timer with a small tick, plus a shared reaper serving
/// several timers: every task runs, never early, and none waits for an
/// unrelated wake-up (a lost wake-up shows as lateness of hundreds of ms).
#[test]
fn inserts_from_many_threads_lose_no_wakeup() {
    within(120, || {
        let rt = support::multi();
        let reaper = rt.block_on(async { Reaper::start().unwrap() });
        let timers: Vec<Timer> = {
            let _g = rt.enter();
            vec![
                Timer::builder()
                    .tick(Duration::from_micros(100))
                    .build()
                    .unwrap(),
                Timer::builder()
                    .tick(Duration::from_nanos(333_331))
                    .reaper(&reaper)
                    .build()
                    .unwrap(),
                Timer::builder()
                    .tick(Duration::from_micros(1_700))
                    .slots_per_level(3)
                    .levels(3)
                    .reaper(&reaper)
                    .build()
                    .unwrap(),
            ]
        };
        let worst = Arc::new(Mutex::new(Vec::<(Duration, Duration, usize)>::new()));
        let early = Arc::new(AtomicUsize::new(0));
        let ran = Arc::new(AtomicUsize::new(0));
        let per = 400;
        let threads = 6;
        let mut joins = Vec::new();
        for t in 0..threads {
            let timers = timers.clone();
            let handle = rt.handle().clone();
            let (worst, early, ran) = (worst.clone(), early.clone(), ran.clone());
            joins.push(std::thread::spawn(move || {
                let _g = handle.enter();
                let mut rng = support::rng::Rng(t as u64 + 99);
                for i in 0..per {
                    let which = rng.below(3) as usize;
                    let timer = &timers[which];
                    let tick = [
                        Duration::from_micros(100),
                        Duration::from_nanos(333_331),
                        Duration::from_micros(1_700),
                    ][which];
                    let d = Duration::from_nanos(rng.below(8_000_000));
                    let at = Instant::now() + d;
                    let (worst, early, ran) = (worst.clone(), early.clone(), ran.clone());
                    timer
                        .schedule_at(at, move || {
                            let now = Instant::now();
                            if now < at {
                                early.fetch_add(1, Ordering::SeqCst);
                            } else {
                                let late = now - at;
                                if late > tick + Duration::from_millis(50) {
                                    worst.lock().unwrap().push((late, tick, which));
                                }
                            }
                            ran.fetch_add(1, Ordering::SeqCst);
                        })
                        .unwrap();
                    if i % 37 == 0 {
                        std::thread::sleep(Duration::from_micros(rng.below(3_000)));
                    }
                }
            }));
        }
        for j in joins {
            j.join().unwrap();
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while ran.load(Ordering::SeqCst) < per * threads {
            assert!(
                std::time::Instant::now() < deadline,
                "only {} of {} ran",
                ran.load(Ordering::SeqCst),
                per * threads
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(early.load(Ordering::SeqCst), 0, "tasks ran early");
        let w = worst.lock().unwrap();
        assert!(
            w.len() <= 3,
            "tasks much later than a tick (lost wake-ups?): {} e.g. {:?}",
            w.len(),
            &w[..w.len().min(5)]
        );
    });
}

/// `Timer`'s docs: "Dropping the last `Timer` clone does the same [as
/// `shutdown`] but drops the tasks unrun": a `Sleep` made before and polled
/// after resolves `Shutdown`; one that fired before stays `Ok` after, polled
/// again too.
#[tokio::test(start_paused = true)]
async fn a_fired_sleep_polled_after_the_timer_is_gone_stays_ok() {
    let timer = Timer::new();
    let mut fired = timer.sleep(ms(1));
    let mut pending = timer.sleep(ms(100));
    advance(ms(5)).await;
    settle().await;
    assert!(fired.is_elapsed());
    drop(timer);
    assert_eq!((&mut fired).await, Ok(()));
    assert_eq!((&mut fired).await, Ok(()), "polled again");
    assert_eq!((&mut pending).await, Err(TimerError::Shutdown));
    assert_eq!((&mut pending).await, Err(TimerError::Shutdown));
}

/// A timeout polled again after it elapsed says the same; after the timer
/// is dropped too.
#[tokio::test(start_paused = true)]
async fn an_elapsed_timeout_polled_after_the_timer_is_gone() {
    let timer = Timer::new();
    let mut t = timer.timeout(ms(1), std::future::pending::<()>());
    assert_eq!((&mut t).await, Err(TimeoutError::Elapsed));
    drop(timer);
    assert_eq!((&mut t).await, Err(TimeoutError::Elapsed));
}

/// `Timer::schedule_repeating`'s docs: "The next delay counts from the end
/// of each run (a fixed delay ...), so a slow run never makes runs pile up",
/// on real time: runs of 25 ms every 10 ms start at least 10 ms after the
/// last one ended.
#[test]
fn a_slow_repeating_run_delays_the_next_from_its_end() {
    within(30, || {
        let rt = support::multi();
        let _g = rt.enter();
        let timer = Timer::builder()
            .tick(Duration::from_micros(100))
            .build()
            .unwrap();
        let runs: Arc<Mutex<Vec<(std::time::Instant, std::time::Instant)>>> =
            Arc::new(Mutex::new(Vec::new()));
        let r = runs.clone();
        let period = Duration::from_millis(10);
        let h = timer
            .schedule_repeating(period, move || {
                let start = std::time::Instant::now();
                // a slow run: longer than the period
                std::thread::sleep(Duration::from_millis(25));
                let end = std::time::Instant::now();
                let mut v = r.lock().unwrap();
                v.push((start, end));
                (v.len() < 5).then_some(period)
            })
            .unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while runs.lock().unwrap().len() < 5 {
            assert!(std::time::Instant::now() < deadline, "runs stalled");
            std::thread::sleep(Duration::from_millis(2));
        }
        let v = runs.lock().unwrap();
        for w in v.windows(2) {
            let gap = w[1].0 - w[0].1;
            assert!(
                gap >= period,
                "next run {gap:?} after the end of the last: piled up"
            );
        }
        assert!(!h.cancel(), "ended by None");
    });
}

/// `Reaper`'s docs: "a slow timer task delays the expiries of the purgatories
/// beside it", on real time: a 50 ms task delays a neighbour timer's 200
/// tasks, but none runs early, none is lost, each runs once.
#[test]
fn a_slow_task_on_a_shared_reaper_delays_but_loses_nothing() {
    within(30, || {
        let rt = support::multi();
        let _g = rt.enter();
        let reaper = Reaper::start().unwrap();
        let slow = Timer::builder().reaper(&reaper).build().unwrap();
        let other = Timer::builder()
            .reaper(&reaper)
            .tick(Duration::from_nanos(77_777))
            .build()
            .unwrap();
        slow.schedule(Duration::from_millis(5), || {
            std::thread::sleep(Duration::from_millis(50))
        })
        .unwrap();
        let ran = Arc::new(AtomicUsize::new(0));
        let early = Arc::new(AtomicUsize::new(0));
        let n = 200;
        for i in 0..n {
            let at = Instant::now() + Duration::from_micros(4_000 + i * 100);
            let (r, e) = (ran.clone(), early.clone());
            other
                .schedule_at(at, move || {
                    if Instant::now() < at {
                        e.fetch_add(1, Ordering::SeqCst);
                    }
                    r.fetch_add(1, Ordering::SeqCst);
                })
                .unwrap();
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while ran.load(Ordering::SeqCst) < n as usize {
            assert!(
                std::time::Instant::now() < deadline,
                "lost: {} of {n}",
                ran.load(Ordering::SeqCst)
            );
            std::thread::sleep(Duration::from_millis(2));
        }
        // The reaper counts a batch's runs after the batch.
        while other.metrics().expired < n {
            assert!(std::time::Instant::now() < deadline, "runs not counted");
            std::thread::yield_now();
        }
        assert_eq!(ran.load(Ordering::SeqCst), n as usize);
        assert_eq!(early.load(Ordering::SeqCst), 0);
        assert_eq!(other.metrics().expired, n);
        assert_eq!(other.len(), 0);
    });
}

/// The room under `max_pending` never drifts when drops of sleeps and
/// timeouts, timeouts whose future wins, and cancels, takes and resets of
/// one-shot, repeating and async tasks race their deadlines on four threads:
/// once idle, `len()` is 0 and exactly `max_pending` entries fit again.
#[test]
fn room_never_drifts_under_racing_drops_and_cancels() {
    within(120, || {
        let rt = support::multi();
        for round in 0..20u64 {
            let limit = 64;
            let timer = rt.block_on(async {
                Timer::builder()
                    .max_pending(limit)
                    .tick(us(37))
                    .shards(3)
                    .batch_size(3)
                    .build()
                    .unwrap()
            });
            let ran = Arc::new(AtomicUsize::new(0));
            let mut joins = Vec::new();
            for t in 0..4u64 {
                let timer = timer.clone();
                let handle = rt.handle().clone();
                let ran = ran.clone();
                joins.push(std::thread::spawn(move || {
                    let _g = handle.enter();
                    let mut rng = support::rng::Rng(round * 31 + t + 1);
                    for _ in 0..400 {
                        let d = us(rng.below(300));
                        match rng.below(6) {
                            0 => {
                                let s = timer.sleep(d);
                                std::thread::sleep(us(rng.below(300)));
                                drop(s);
                            }
                            1 => {
                                let f = timer.timeout(d, std::future::pending::<()>());
                                std::thread::sleep(us(rng.below(300)));
                                drop(f);
                            }
                            2 => {
                                // a timeout whose future wins racing the deadline
                                let mut f = Box::pin(timer.timeout(d, std::future::ready(())));
                                std::thread::sleep(us(rng.below(300)));
                                let w = std::task::Waker::noop();
                                let mut cx = std::task::Context::from_waker(w);
                                let _ = f.as_mut().poll(&mut cx);
                                std::thread::sleep(us(rng.below(100)));
                                drop(f);
                            }
                            3 => {
                                let r = ran.clone();
                                if let Ok(h) = timer.schedule(d, move || {
                                    r.fetch_add(1, Ordering::SeqCst);
                                }) {
                                    std::thread::sleep(us(rng.below(300)));
                                    match rng.below(3) {
                                        0 => {
                                            h.cancel();
                                        }
                                        1 => drop(h.cancel_and_take()),
                                        _ => {
                                            h.reset(us(rng.below(200)));
                                        }
                                    }
                                }
                            }
                            4 => {
                                let mut n = rng.below(3);
                                if let Ok(h) = timer.schedule_repeating(d, move || {
                                    if n == 0 {
                                        None
                                    } else {
                                        n -= 1;
                                        Some(us(50))
                                    }
                                }) {
                                    std::thread::sleep(us(rng.below(300)));
                                    if rng.below(2) == 0 {
                                        h.cancel();
                                    } else {
                                        h.reset(us(rng.below(100)));
                                    }
                                }
                            }
                            _ => {
                                if let Ok(h) = timer.schedule_async(d, async {}) {
                                    std::thread::sleep(us(rng.below(300)));
                                    if rng.below(2) == 0 {
                                        h.cancel();
                                    } else {
                                        h.reset(us(rng.below(100)));
                                    }
                                }
                            }
                        }
                    }
                }));
            }
            for j in joins {
                j.join().unwrap();
            }
            // Everything left runs or ends within a bounded wait.
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while !timer.is_empty() {
                assert!(
                    std::time::Instant::now() < deadline,
                    "round {round}: {} entries left",
                    timer.len()
                );
                std::thread::sleep(Duration::from_millis(1));
            }
            // Async tasks spawned finish; repeating chains ended.
            std::thread::sleep(Duration::from_millis(20));
            assert_eq!(timer.len(), 0);
            let _g = rt.enter();
            let mut held = Vec::new();
            for i in 0..limit {
                match timer.schedule(Duration::from_secs(60), || {}) {
                    Ok(h) => held.push(h),
                    Err(e) => panic!(
                        "round {round}: room drifted: the {}th of {limit} refused: {e:?} {:?}",
                        i + 1,
                        timer.metrics()
                    ),
                }
            }
            assert!(
                matches!(
                    timer.schedule(Duration::from_secs(60), || {}),
                    Err(ScheduleError::AtCapacity(_))
                ),
                "round {round}: one past the limit accepted"
            );
            drop(timer.shutdown());
        }
    });
}

/// `Timer::shutdown`'s docs: it "hands back every task that has not run";
/// `TaskHandle::cancel_and_take`'s: it "returns the task and the task never
/// runs". Racing each other (two takers from either end) and the reaper on
/// real threads: every task is exactly one of run, taken or handed back.
#[test]
fn shutdown_racing_cancel_and_take_hands_each_task_over_once() {
    within(120, || {
        let rt = support::multi();
        for round in 0..40u64 {
            let timer = rt.block_on(async { Timer::builder().tick(us(20)).build().unwrap() });
            let _g = rt.enter();
            let n = 400usize;
            let runs: Arc<Vec<AtomicU32>> = Arc::new((0..n).map(|_| AtomicU32::new(0)).collect());
            let handles: Arc<Vec<_>> = Arc::new(
                (0..n)
                    .map(|i| {
                        let runs = runs.clone();
                        timer
                            .schedule(us(200 + (i as u64 % 13) * 40), move || {
                                runs[i].fetch_add(1, Ordering::SeqCst);
                            })
                            .unwrap()
                    })
                    .collect(),
            );
            let barrier = Arc::new(std::sync::Barrier::new(3));
            let take = |from_end: bool| {
                let (handles, barrier) = (handles.clone(), barrier.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    let mut got = Vec::new();
                    let order: Vec<usize> = if from_end {
                        (0..n).rev().collect()
                    } else {
                        (0..n).collect()
                    };
                    for i in order {
                        if let Some(t) = handles[i].cancel_and_take() {
                            got.push((i, t));
                        }
                    }
                    got
                })
            };
            let a = take(false);
            let b = take(true);
            barrier.wait();
            std::thread::sleep(us(100 + round * 7));
            let back = timer.shutdown();
            let a = a.join().unwrap();
            let b = b.join().unwrap();
            let mut seen = vec![0u32; n];
            for (i, _) in a.iter().chain(b.iter()) {
                seen[*i] += 1;
            }
            let handed = back.len();
            let taken = a.len() + b.len();
            // Tasks the reaper took out before the shutdown finish their runs
            // (bounded).
            let by_timer = || -> u32 { runs.iter().map(|r| r.load(Ordering::SeqCst)).sum() };
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while handed + taken + (by_timer() as usize) < n {
                assert!(
                    std::time::Instant::now() < deadline,
                    "round {round}: handed back {handed} + taken {taken} + run {}",
                    by_timer()
                );
                std::thread::yield_now();
            }
            let by_timer = by_timer();
            assert_eq!(
                handed + taken + by_timer as usize,
                n,
                "round {round}: handed back {handed} + taken {taken} + run {by_timer}"
            );
            // run what shutdown handed back: marks it
            for t in back {
                t.run();
            }
            for i in 0..n {
                let r = runs[i].load(Ordering::SeqCst);
                // r counts timer runs + runs of handed-back ones
                assert!(seen[i] <= 1, "round {round}: task {i} taken twice");
                assert!(
                    r + seen[i] == 1,
                    "round {round}: task {i}: runs {r} (timer or handed back) + taken {}",
                    seen[i]
                );
                assert_ne!(handles[i].status(), TaskStatus::Pending);
                if seen[i] == 1 {
                    assert_eq!(handles[i].status(), TaskStatus::Cancelled);
                }
            }
        }
    });
}

/// `TaskHandle`'s docs: "it can be shared (in an `Arc`) between the code that
/// resets a timeout and the code that cancels it. Resets and cancels through
/// the same handle are serialised; racing the reaper, each method's docs say
/// which side wins." Resets hammering a handle from one
/// thread, a cancel from another, the reaper firing: the task either ran
/// once (no cancel returned true) or never ran (exactly one cancel true),
/// and no reset succeeds after the cancel did, for one-shot and repeating.
#[test]
fn resets_and_a_cancel_through_one_shared_handle_race_the_reaper() {
    within(120, || {
        let rt = support::multi();
        let _g = rt.enter();
        for round in 0..200u64 {
            let timer = Timer::builder().tick(us(10)).build().unwrap();
            let ran = Arc::new(AtomicU32::new(0));
            let r = ran.clone();
            let repeating = round % 2 == 1;
            let h = Arc::new(if repeating {
                let mut n = 0;
                timer
                    .schedule_repeating(us(150), move || {
                        r.fetch_add(1, Ordering::SeqCst);
                        n += 1;
                        (n < 3).then_some(us(50))
                    })
                    .unwrap()
            } else {
                timer
                    .schedule(us(150), move || {
                        r.fetch_add(1, Ordering::SeqCst);
                    })
                    .unwrap()
            });
            let cancelled_at = Arc::new(std::sync::Mutex::new(None::<u32>));
            let resetter = {
                let h = h.clone();
                let cancelled_at = cancelled_at.clone();
                let handle = rt.handle().clone();
                std::thread::spawn(move || {
                    let _g = handle.enter();
                    let mut late_success = 0;
                    for i in 0..400u64 {
                        let was = cancelled_at.lock().unwrap().is_some();
                        let ok = h.reset(us(20 + (i % 5) * 30));
                        if ok && was {
                            late_success += 1;
                        }
                    }
                    late_success
                })
            };
            std::thread::sleep(us(50 + round % 300));
            let c = h.cancel();
            if c {
                *cancelled_at.lock().unwrap() = Some(ran.load(Ordering::SeqCst));
            }
            let late = resetter.join().unwrap();
            assert!(!h.cancel(), "round {round}: cancelled twice");
            // settle
            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            while h.status() == TaskStatus::Pending {
                assert!(
                    std::time::Instant::now() < deadline,
                    "round {round}: still pending"
                );
                std::thread::sleep(us(200));
            }
            std::thread::sleep(Duration::from_millis(2));
            let runs = ran.load(Ordering::SeqCst);
            assert_eq!(late, 0, "round {round}: a reset succeeded after the cancel");
            if repeating {
                if c {
                    assert!(runs < 3, "round {round}: cancelled chain ran to its end");
                    let at = cancelled_at.lock().unwrap().unwrap();
                    assert!(
                        runs <= at + 1,
                        "round {round}: runs after the cancel: {at} then {runs}"
                    );
                    assert_eq!(h.status(), TaskStatus::Cancelled);
                } else {
                    assert_eq!(runs, 3, "round {round}");
                    assert_eq!(h.status(), TaskStatus::Done);
                }
            } else if c {
                assert_eq!(runs, 0, "round {round}: cancelled and ran");
                assert_eq!(h.status(), TaskStatus::Cancelled);
            } else {
                assert_eq!(runs, 1, "round {round}: neither ran nor cancelled");
                assert_eq!(h.status(), TaskStatus::Done);
            }
            assert_eq!(timer.len(), 0);
        }
    });
}
