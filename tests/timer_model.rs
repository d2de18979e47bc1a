//! The standalone timer against models of what it promises, on paused time,
//! seeded and reproducible (failure messages name the seed and the timer's
//! shape).
//!
//! A random stream of schedules, cancels, takes, resets, sleeps, timeouts,
//! panicking tasks and steps of time (odd `advance` steps and auto-advancing
//! sleeps) on timers of odd ticks (7.9 µs to 123 ms) and wheel shapes, built
//! off the tick and millisecond grids, with and without a pending limit:
//! never early, late by at most a tick plus 2 ms, each task run at most once
//! and ended one documented way, and the counts balancing
//! (`PURGATORY_TIMER_MODEL_SEEDS` runs more seeds than the default). The room
//! under `max_pending` after every kind of entry came and went, repeating
//! chains ending every way, timeouts won in the deadline's own turn: exactly
//! the limit fits again once idle (`PURGATORY_TIMER_ROOM_SEEDS` runs more).
//! Deep wheels (up to 61 levels at a 1 ns tick) holding many entries at once
//! with deadlines up to decades out, reset and cancelled while cascades are
//! under way: every task once, never early, late by less than a tick plus
//! 2 ms.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use tokio::time::{advance, Instant};
use tokio_purgatory::timer::{ScheduleError, TaskHandle, TaskStatus, TimeoutError, TimerError};
use tokio_purgatory::Timer;

mod support;
use support::rng::Rng;

/// Seeds the model runs by default, about 0.75 s each in a debug build (the
/// eighth is the first with a pending limit).
const MODEL_SEEDS: u64 = 8;
/// Seeds the room test runs by default, about 0.1 s each in a debug build
/// (together every tick, shard count, wheel width and batch size it draws).
const ROOM_SEEDS: u64 = 20;

/// How many seeds to run: the number in the environment variable `var` if
/// set, else `default`.
fn seed_count(var: &str, default: u64) -> u64 {
    match std::env::var(var) {
        Ok(s) => s.parse().unwrap_or_else(|_| panic!("{var} is a number")),
        Err(_) => default,
    }
}

/// What Tokio's timer adds to the reaper's sleep (its millisecond grid).
const SLACK: Duration = Duration::from_millis(2);

fn ns(n: u64) -> Duration {
    Duration::from_nanos(n)
}

/// Lets the reaper and the tasks it woke run: `yields` yields, with no time
/// passing (more than `support::settle` gives, where one turn wakes many
/// tasks).
async fn settle_for(yields: u32) {
    for _ in 0..yields {
        tokio::task::yield_now().await;
    }
}

/// What the model knows of one task it scheduled.
struct ModelTask {
    /// Runs by the timer.
    ran: AtomicU32,
    /// The deadline in force (now, for one scheduled or reset into the past).
    deadline: Mutex<Instant>,
    panics: bool,
    /// Taken back by `cancel_and_take` and run by the model (not judged).
    taken: AtomicBool,
}

/// Where the current manual `advance` started (`None` while time moves by
/// auto-advancing sleeps): a firing seen at the end of such a step may be
/// late by the part of the step that jumped over its deadline.
#[derive(Default)]
struct Clockwork {
    step_start: Mutex<Option<Instant>>,
}

fn poll_once<F: Future + Unpin>(f: &mut F) -> Poll<F::Output> {
    Pin::new(f).poll(&mut Context::from_waker(Waker::noop()))
}

/// One random stream of 400 steps on a timer of a random shape, judged
/// against the model.
async fn model_round(seed: u64) {
    let mut rng = Rng(seed);
    let ticks = [
        ns(7_919),
        Duration::from_micros(100),
        ns(333_333),
        Duration::from_millis(1),
        ns(2_718_281),
        Duration::from_millis(10),
        ns(123_456_789),
    ];
    let tick = ticks[rng.below(ticks.len() as u64) as usize];
    let slots = [2usize, 3, 8, 64][rng.below(4) as usize];
    let levels = [1usize, 2, 3, 6][rng.below(4) as usize];
    let shards = [1usize, 3][rng.below(2) as usize];
    let batch = [1usize, 2, 1024][rng.below(3) as usize];
    let limit = if rng.below(3) == 0 {
        Some(5 + rng.below(20) as usize)
    } else {
        None
    };
    let sleepy = rng.below(2) == 0; // step by auto-advancing sleeps
    let cfg = format!(
        "seed {seed}: tick {tick:?} slots {slots} levels {levels} shards {shards} batch {batch} limit {limit:?} sleepy {sleepy}"
    );
    // Built off every grid.
    advance(ns(1 + rng.below(9_999_999))).await;
    let mut b = Timer::builder()
        .tick(tick)
        .slots_per_level(slots)
        .levels(levels)
        .shards(shards)
        .batch_size(batch);
    if let Some(l) = limit {
        b = b.max_pending(l);
    }
    let timer = b.build().unwrap();
    let span = tick * 3 * (slots as u32).pow(levels.min(3) as u32);

    let clock = Arc::new(Clockwork::default());
    let mut tasks: Vec<(TaskHandle, Arc<ModelTask>)> = Vec::new();
    let mut cancelled = 0u64;
    let mut taken_unrun = 0u64;
    let mut refused = 0u64;
    let sleeps_fired = Arc::new(AtomicU64::new(0));
    let sleeps_other = Arc::new(AtomicU64::new(0));
    let mut joins = Vec::new();
    let mut held: Vec<(tokio_purgatory::timer::Sleep, Instant)> = Vec::new();
    let mut held_fired = 0u64;
    let late_errors = Arc::new(Mutex::new(Vec::<String>::new()));

    let check = {
        let late_errors = late_errors.clone();
        let clock = clock.clone();
        move |what: &str, deadline: Instant, at: Instant| {
            let mut bound = tick + SLACK;
            if let Some(start) = *clock.step_start.lock().unwrap() {
                if at > start {
                    bound += at - start;
                }
            }
            if at < deadline {
                late_errors
                    .lock()
                    .unwrap()
                    .push(format!("{what}: EARLY by {:?}", deadline - at));
            } else if at - deadline > bound {
                late_errors.lock().unwrap().push(format!(
                    "{what}: late by {:?} > bound {bound:?}",
                    at - deadline
                ));
            }
        }
    };

    for _step in 0..400 {
        match rng.below(20) {
            0..=5 => {
                // schedule, sometimes schedule_at in the past
                let rec = Arc::new(ModelTask {
                    ran: AtomicU32::new(0),
                    deadline: Mutex::new(Instant::now()),
                    panics: rng.below(6) == 0,
                    taken: AtomicBool::new(false),
                });
                let r = rec.clone();
                let check = check.clone();
                let f = move || {
                    r.ran.fetch_add(1, Ordering::SeqCst);
                    if !r.taken.load(Ordering::SeqCst) {
                        let d = *r.deadline.lock().unwrap();
                        check("task", d, Instant::now());
                    }
                    if r.panics {
                        panic!("hostile task");
                    }
                };
                let now = Instant::now();
                let res = if rng.below(5) == 0 {
                    let past = now.checked_sub(ns(rng.below(50_000_000))).unwrap_or(now);
                    *rec.deadline.lock().unwrap() = now; // due at once: judged from now
                    timer.schedule_at(past, f)
                } else {
                    let d = ns(rng.below(span.as_nanos() as u64 + 1));
                    *rec.deadline.lock().unwrap() = now + d;
                    timer.schedule(d, f)
                };
                match res {
                    Ok(h) => tasks.push((h, rec)),
                    Err(ScheduleError::AtCapacity(f)) => {
                        assert!(limit.is_some(), "{cfg}: refused without a limit");
                        refused += 1;
                        drop(f);
                    }
                    Err(e) => panic!("{cfg}: unexpected refusal {e:?}"),
                }
            }
            6 => {
                if !tasks.is_empty() {
                    let i = rng.below(tasks.len() as u64) as usize;
                    let (h, rec) = &tasks[i];
                    let before = rec.ran.load(Ordering::SeqCst);
                    let pending = h.is_pending();
                    if h.cancel() {
                        assert!(pending, "{cfg}: cancel true for a task not pending");
                        assert_eq!(before, 0, "{cfg}: cancel true for a task that ran");
                        cancelled += 1;
                        assert_eq!(h.status(), TaskStatus::Cancelled);
                    }
                }
            }
            7 => {
                if !tasks.is_empty() {
                    let i = rng.below(tasks.len() as u64) as usize;
                    let (h, rec) = &tasks[i];
                    if let Some(t) = h.cancel_and_take() {
                        assert_eq!(rec.ran.load(Ordering::SeqCst), 0, "{cfg}");
                        if rng.below(2) == 0 {
                            // run here: counts as a run, not a timer expiry
                            let r = rec.clone();
                            r.taken.store(true, Ordering::SeqCst);
                            let res =
                                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| t.run()));
                            assert_eq!(res.is_err(), r.panics, "{cfg}");
                            // not the timer's run: take it off the count
                            r.ran.fetch_sub(1, Ordering::SeqCst);
                        } else {
                            drop(t);
                        }
                        taken_unrun += 1;
                        assert_eq!(h.status(), TaskStatus::Cancelled, "{cfg}");
                    }
                }
            }
            8 | 9 => {
                if !tasks.is_empty() {
                    let i = rng.below(tasks.len() as u64) as usize;
                    let (h, rec) = &tasks[i];
                    let now = Instant::now();
                    let ok = if rng.below(4) == 0 {
                        let past = now.checked_sub(ns(rng.below(10_000_000))).unwrap_or(now);
                        let ok = h.reset_at(past);
                        if ok {
                            *rec.deadline.lock().unwrap() = now;
                        }
                        ok
                    } else {
                        let d = ns(rng.below(span.as_nanos() as u64 + 1));
                        let ok = h.reset(d);
                        if ok {
                            *rec.deadline.lock().unwrap() = now + d;
                        }
                        ok
                    };
                    let ran = rec.ran.load(Ordering::SeqCst);
                    assert_eq!(
                        ok,
                        ran == 0 && h.status() == TaskStatus::Pending,
                        "{cfg}: reset {ok} ran {ran} status {:?}",
                        h.status()
                    );
                }
            }
            10 => {
                // a sleep awaited by a task of its own
                let d = ns(rng.below(span.as_nanos() as u64 + 1));
                let deadline = Instant::now() + d;
                let s = timer.sleep(d);
                assert_eq!(s.deadline(), deadline, "{cfg}");
                let (f, o) = (sleeps_fired.clone(), sleeps_other.clone());
                let check = check.clone();
                joins.push(tokio::spawn(async move {
                    match s.await {
                        Ok(()) => {
                            check("sleep", deadline, Instant::now());
                            f.fetch_add(1, Ordering::SeqCst);
                        }
                        Err(TimerError::AtCapacity) => {}
                        Err(_) => {
                            o.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                }));
            }
            11 => {
                // a timeout of a pending future
                let d = ns(rng.below(span.as_nanos() as u64 + 1));
                let deadline = Instant::now() + d;
                let t = timer.timeout(d, std::future::pending::<()>());
                let (f, o) = (sleeps_fired.clone(), sleeps_other.clone());
                let check = check.clone();
                joins.push(tokio::spawn(async move {
                    match t.await {
                        Err(TimeoutError::Elapsed) => {
                            check("timeout", deadline, Instant::now());
                            f.fetch_add(1, Ordering::SeqCst);
                        }
                        Err(TimeoutError::Timer(TimerError::AtCapacity)) => {}
                        Err(_) => {
                            o.fetch_add(1, Ordering::SeqCst);
                        }
                        Ok(()) => unreachable!(),
                    }
                }));
            }
            12 => {
                // a sleep held unpolled, dropped later
                let d = ns(rng.below(span.as_nanos() as u64 + 1));
                let deadline = Instant::now() + d;
                held.push((timer.sleep(d), deadline));
            }
            13 => {
                if !held.is_empty() {
                    let i = rng.below(held.len() as u64) as usize;
                    let (mut s, deadline) = held.swap_remove(i);
                    match poll_once(&mut s) {
                        Poll::Ready(Ok(())) => {
                            assert!(Instant::now() >= deadline, "{cfg}: held sleep early");
                            held_fired += 1;
                        }
                        Poll::Ready(Err(e)) => {
                            assert_eq!(e, TimerError::AtCapacity, "{cfg}")
                        }
                        Poll::Pending => {}
                    }
                    drop(s);
                }
            }
            _ => {
                let step = match rng.below(10) {
                    0 => ns(rng.below(1_000)),
                    1..=6 => ns(rng.below(3_000_000)),
                    7 | 8 => ns(rng.below(30_000_000)),
                    _ => ns(rng.below(span.as_nanos() as u64 * 2 + 1)),
                };
                if sleepy {
                    *clock.step_start.lock().unwrap() = None;
                    tokio::time::sleep(step).await;
                    settle_for(3000).await;
                } else {
                    *clock.step_start.lock().unwrap() = Some(Instant::now());
                    advance(step).await;
                    settle_for(3000).await;
                }
                // nothing overdue is still pending: a task due before
                // now - tick - 2 ms must have run
                let now = Instant::now();
                for (h, rec) in &tasks {
                    if h.status() == TaskStatus::Pending {
                        let d = *rec.deadline.lock().unwrap();
                        assert!(
                            d + tick + SLACK > now,
                            "{cfg}: task due at -{:?} still pending after time moved",
                            now - d
                        );
                    }
                }
            }
        }
        let errs = late_errors.lock().unwrap();
        assert!(errs.is_empty(), "{cfg}: {errs:?}");
    }
    // Let everything due run, then check counts before the shutdown.
    settle_for(3000).await;
    for (s, deadline) in held.iter_mut() {
        if let Poll::Ready(r) = poll_once(s) {
            if r.is_ok() {
                assert!(Instant::now() >= *deadline, "{cfg}: held sleep early");
                held_fired += 1;
            }
        }
    }
    let ran: u64 = tasks
        .iter()
        .map(|(_, r)| u64::from(r.ran.load(Ordering::SeqCst)))
        .sum();
    for (_, r) in &tasks {
        assert!(r.ran.load(Ordering::SeqCst) <= 1, "{cfg}: ran twice");
    }
    let panicking_ran = tasks
        .iter()
        .filter(|(_, r)| r.panics && r.ran.load(Ordering::SeqCst) == 1)
        .count() as u64;
    let m = timer.metrics();
    let sleeps = sleeps_fired.load(Ordering::SeqCst);
    assert_eq!(
        m.expired,
        ran + sleeps + held_fired,
        "{cfg}: expired {} != tasks run {ran} + sleeps/timeouts fired {sleeps} + held fired {held_fired}",
        m.expired
    );
    assert_eq!(
        timer.lateness().count(),
        m.expired,
        "{cfg}: lateness samples"
    );
    assert_eq!(m.panicked, panicking_ran, "{cfg}: panicked");
    assert_eq!(m.refused.at_capacity, m.refused.total(), "{cfg}");
    // refusals: tasks counted by us; sleeps/timeouts refused too, so >=
    assert!(m.refused.at_capacity >= refused, "{cfg}");
    let pending_tasks = tasks
        .iter()
        .filter(|(h, _)| h.status() == TaskStatus::Pending)
        .count() as u64;
    let unrun = timer.shutdown();
    assert_eq!(
        unrun.len() as u64,
        pending_tasks,
        "{cfg}: shutdown hands back every pending task"
    );
    drop(unrun);
    // Every accepted task: ran, cancelled, taken, or handed back.
    assert_eq!(
        tasks.len() as u64,
        ran + cancelled + taken_unrun + pending_tasks,
        "{cfg}: accepted {} != ran {ran} + cancelled {cancelled} + taken {taken_unrun} + handed back {pending_tasks}",
        tasks.len()
    );
    for (h, _) in &tasks {
        assert_ne!(h.status(), TaskStatus::Pending, "{cfg}");
    }
    for j in joins {
        tokio::time::timeout(Duration::from_secs(1), j)
            .await
            .expect("every sleep resolves after the shutdown")
            .unwrap();
    }
    let errs = late_errors.lock().unwrap();
    assert!(errs.is_empty(), "{cfg}: {errs:?}");
    assert_eq!(timer.metrics().pending, 0, "{cfg}");
}

/// Random streams of schedules (some at past instants), cancels, takes
/// (run by the caller or dropped), resets (later, earlier, past), sleeps and
/// timeouts awaited, sleeps held unpolled, and steps of time, on timers of
/// odd ticks and wheel shapes, with or without a limit: nothing fires early
/// or later than a tick plus 2 ms (plus the manual step that jumped over it),
/// nothing due is left pending once time has moved past it, each task runs
/// at most once and ends one documented way (run, cancelled, taken or handed
/// back by the shutdown), and `expired`, `panicked`, the lateness samples and
/// the refusals match. `PURGATORY_TIMER_MODEL_SEEDS` runs more seeds.
#[tokio::test(start_paused = true)]
async fn randomized_model_never_early_exactly_once_counts_balance() {
    for seed in 1..=seed_count("PURGATORY_TIMER_MODEL_SEEDS", MODEL_SEEDS) {
        model_round(seed * 7919 + 13).await;
    }
}

/// Handles a repeating task may cancel or reset from inside its turn.
type Shared = Arc<Mutex<Vec<TaskHandle>>>;

/// One random mix of 300 steps under a random limit, then the room checked.
async fn room_round(seed: u64) {
    let mut rng = Rng(seed);
    let limit = 4 + rng.below(12) as usize;
    let tick = [ns(50_001), ns(1_000_000), ns(3_333_333)][rng.below(3) as usize];
    let timer = Timer::builder()
        .max_pending(limit)
        .tick(tick)
        .shards(1 + rng.below(3) as usize)
        .slots_per_level([2, 4, 64][rng.below(3) as usize])
        .levels(3)
        .batch_size(1 + rng.below(3) as usize)
        .build()
        .unwrap();
    let cfg = format!("seed {seed} limit {limit} tick {tick:?}");
    let handles: Shared = Arc::new(Mutex::new(Vec::new()));
    let mut asyncs = Vec::new();
    let mut futs = Vec::new();
    let runs = Arc::new(AtomicU32::new(0));
    for _ in 0..300 {
        let d = ns(rng.below(20_000_000));
        match rng.below(12) {
            0 | 1 => {
                let r = runs.clone();
                let p = rng.below(5) == 0;
                if let Ok(h) = timer.schedule(d, move || {
                    r.fetch_add(1, Ordering::SeqCst);
                    if p {
                        panic!("one-shot");
                    }
                }) {
                    handles.lock().unwrap().push(h);
                }
            }
            2 | 3 => {
                // repeating: ends by None, by panic, or cancels others
                let mut left = rng.below(4);
                let kind = rng.below(4);
                let period = ns(rng.below(5_000_000));
                let hs = handles.clone();
                let mut pick = Rng(rng.next());
                let res = timer.schedule_repeating(d, move || {
                    if left == 0 {
                        match kind {
                            0 => return None,
                            1 => panic!("repeating"),
                            _ => {
                                // cancel / reset random other handles,
                                // maybe itself, from inside the turn
                                let hs = hs.lock().unwrap();
                                if !hs.is_empty() {
                                    let i = pick.below(hs.len() as u64) as usize;
                                    if pick.below(2) == 0 {
                                        hs[i].cancel();
                                    } else {
                                        hs[i].reset(ns(pick.below(4_000_000)));
                                    }
                                }
                                return None;
                            }
                        }
                    }
                    left -= 1;
                    Some(period)
                });
                if let Ok(h) = res {
                    handles.lock().unwrap().push(h);
                }
            }
            4 => {
                if let Ok(h) = timer.schedule_async(d, async move {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }) {
                    asyncs.push(h);
                }
            }
            5 => {
                if !asyncs.is_empty() {
                    let i = rng.below(asyncs.len() as u64) as usize;
                    asyncs[i].cancel();
                }
            }
            6 => {
                let hs = handles.lock().unwrap();
                if !hs.is_empty() {
                    let i = rng.below(hs.len() as u64) as usize;
                    match rng.below(3) {
                        0 => {
                            hs[i].cancel();
                        }
                        1 => {
                            drop(hs[i].cancel_and_take());
                        }
                        _ => {
                            hs[i].reset(ns(rng.below(10_000_000)));
                        }
                    }
                }
            }
            7 => {
                // a timeout that wins, one that elapses, a sleep held
                let (tx, rx) = tokio::sync::oneshot::channel::<()>();
                let t = timer.timeout(d, rx);
                futs.push(tokio::spawn(async move {
                    let _ = t.await;
                }));
                if rng.below(2) == 0 {
                    drop(tx);
                } else {
                    let r = runs.clone();
                    // sent by a timer task, maybe in the deadline's own turn
                    let _ = timer.schedule(d, move || {
                        r.fetch_add(1, Ordering::SeqCst);
                        let _ = tx.send(());
                    });
                }
            }
            8 => {
                let s = timer.sleep(d);
                if rng.below(2) == 0 {
                    futs.push(tokio::spawn(async move {
                        let _ = s.await;
                    }));
                } else {
                    drop(s);
                }
            }
            _ => {
                advance(ns(rng.below(6_000_000))).await;
                settle_for(500).await;
            }
        }
        // len never above the limit
        assert!(timer.len() <= limit, "{cfg}: len {} > limit", timer.len());
    }
    // Stop everything that could go on, then let it all go.
    for h in handles.lock().unwrap().iter() {
        h.cancel();
    }
    for h in &asyncs {
        h.cancel();
    }
    for f in futs {
        f.abort();
        let _ = f.await;
    }
    for _ in 0..20 {
        advance(Duration::from_millis(50)).await;
        settle_for(500).await;
    }
    assert_eq!(timer.len(), 0, "{cfg}: entries left");
    for h in handles.lock().unwrap().iter() {
        assert_ne!(h.status(), TaskStatus::Pending, "{cfg}");
    }
    let m = timer.metrics();
    // Exactly `limit` fit.
    let mut held = Vec::new();
    for i in 0..limit {
        match timer.schedule(Duration::from_secs(60), || {}) {
            Ok(h) => held.push(h),
            Err(e) => panic!(
                "{cfg}: room drifted: refused the {}th of {limit}: {e:?}; {m:?}",
                i + 1
            ),
        }
    }
    match timer.schedule(Duration::from_secs(60), || {}) {
        Err(ScheduleError::AtCapacity(_)) => {}
        other => panic!("{cfg}: room drifted: accepted one past the limit: {other:?}"),
    }
    assert_eq!(timer.len(), limit);
    drop(timer.shutdown());
}

/// The room under `max_pending` never drifts, whatever mix of one-shot
/// tasks (some panicking), repeating ones (ending by `None`, by a panic, or
/// by cancelling or resetting another task, maybe themselves, from inside
/// their turn), async tasks (cancelled before or after they start), sleeps
/// (awaited or dropped) and timeouts (won by a future a timer task readies,
/// maybe in the deadline's own turn, or by a dropped sender; elapsed;
/// aborted) a timer went through: `len()` never passes the limit, and once
/// idle it is 0, exactly `max_pending` entries fit again and the next is
/// refused. `PURGATORY_TIMER_ROOM_SEEDS` runs more seeds.
#[tokio::test(start_paused = true)]
async fn room_under_the_limit_never_drifts() {
    for seed in 1..=seed_count("PURGATORY_TIMER_ROOM_SEEDS", ROOM_SEEDS) {
        room_round(seed * 104_729).await;
    }
}

/// A task of a deep wheel: its runs, its deadline in force, and where it
/// reports what it saw wrong.
struct DeepTask {
    ran: AtomicU32,
    deadline: Mutex<Instant>,
    errors: Arc<Mutex<Vec<String>>>,
}

/// One random stream of 120 steps on a wheel of `slots` x `levels`.
async fn deep_round(seed: u64, tick: Duration, slots: usize, levels: usize) {
    let mut rng = Rng(seed);
    let cfg = format!("seed {seed} tick {tick:?} {slots}x{levels}");
    advance(ns(1 + rng.below(999_999_999))).await;
    let timer = Timer::builder()
        .tick(tick)
        .slots_per_level(slots)
        .levels(levels)
        .shards(2)
        .build()
        .unwrap();
    let errors = Arc::new(Mutex::new(Vec::<String>::new()));
    let mut tasks: Vec<(TaskHandle, Arc<DeepTask>)> = Vec::new();
    let mut cancelled = 0u64;
    // Delays of every magnitude, 1 ns to 2^61 ns (about 73 years).
    let max_mag = 62u64;
    let delay = |rng: &mut Rng| -> Duration {
        let k = rng.below(max_mag);
        ns(rng.below(1u64 << k) + 1)
    };
    for _ in 0..120 {
        match rng.below(10) {
            0..=4 => {
                let rec = Arc::new(DeepTask {
                    ran: AtomicU32::new(0),
                    deadline: Mutex::new(Instant::now()),
                    errors: errors.clone(),
                });
                let d = delay(&mut rng);
                let now = Instant::now();
                *rec.deadline.lock().unwrap() = now + d;
                let r = rec.clone();
                let h = timer
                    .schedule(d, move || {
                        let n = r.ran.fetch_add(1, Ordering::SeqCst);
                        let at = Instant::now();
                        let dl = *r.deadline.lock().unwrap();
                        let mut e = r.errors.lock().unwrap();
                        if n > 0 {
                            e.push("ran twice".into());
                        }
                        if at < dl {
                            e.push(format!("EARLY by {:?}", dl - at));
                        } else if at - dl >= tick + SLACK {
                            e.push(format!("late by {:?}", at - dl));
                        }
                    })
                    .unwrap();
                tasks.push((h, rec));
            }
            5 => {
                if !tasks.is_empty() {
                    let i = rng.below(tasks.len() as u64) as usize;
                    if tasks[i].0.cancel() {
                        cancelled += 1;
                    }
                }
            }
            6 => {
                if !tasks.is_empty() {
                    let i = rng.below(tasks.len() as u64) as usize;
                    let d = delay(&mut rng);
                    let now = Instant::now();
                    let (h, rec) = &tasks[i];
                    // One thread: the task cannot run between the reset
                    // and the record's update, so it reads the deadline it
                    // was moved to.
                    if h.reset(d) {
                        *rec.deadline.lock().unwrap() = now + d;
                    }
                }
            }
            _ => {
                // Jump by auto-advance to the earliest pending deadline,
                // or somewhere random before it.
                let now = Instant::now();
                let next = tasks
                    .iter()
                    .filter(|(h, _)| h.status() == TaskStatus::Pending)
                    .map(|(_, r)| *r.deadline.lock().unwrap())
                    .min();
                let target = match next {
                    Some(n) if rng.below(2) == 0 => n + tick + ns(rng.below(3_000_000)),
                    Some(n) if n > now => {
                        now + ns(rng.below((n - now).as_nanos().min(u64::MAX as u128) as u64))
                    }
                    _ => now + delay(&mut rng),
                };
                tokio::time::sleep_until(target).await;
                settle_for(200).await;
                // Nothing overdue left waiting.
                let now = Instant::now();
                for (h, r) in &tasks {
                    if h.status() == TaskStatus::Pending {
                        let dl = *r.deadline.lock().unwrap();
                        assert!(
                            dl + tick + SLACK > now,
                            "{cfg}: due {:?} ago, still pending",
                            now - dl
                        );
                    }
                }
            }
        }
        let e = errors.lock().unwrap();
        assert!(e.is_empty(), "{cfg}: {e:?}");
    }
    let ran: u64 = tasks
        .iter()
        .map(|(_, r)| u64::from(r.ran.load(Ordering::SeqCst)))
        .sum();
    let pending = tasks
        .iter()
        .filter(|(h, _)| h.status() == TaskStatus::Pending)
        .count() as u64;
    assert_eq!(timer.len() as u64, pending, "{cfg}: len");
    assert_eq!(timer.metrics().expired, ran, "{cfg}: expired");
    assert_eq!(timer.shutdown().len() as u64, pending, "{cfg}: handed back");
    assert_eq!(tasks.len() as u64, ran + cancelled + pending, "{cfg}");
}

/// Many entries at once across every level of deep wheels (2 x 61, 3 x 39,
/// 7 x 22, 64 x 10, 2 x 40, the default shape's overflow list, one level
/// holding everything in overflow) at 1 ns and odd ticks, deadlines of every
/// magnitude up to decades, resets and cancels while cascades are under way,
/// and time moved by Tokio's auto-advance to random instants (so the
/// reaper's own sleeps decide when things run): every task runs once, never
/// early, late by less than a tick plus Tokio's 2 ms, nothing due is left
/// pending, and `len()`, `expired` and the shutdown's hand-back match.
#[tokio::test(start_paused = true)]
async fn deep_wheels_with_many_entries_never_early_and_bounded() {
    let shapes = [
        (ns(1), 2usize, 61usize),
        (ns(7), 3, 39),
        (ns(1), 7, 22),
        (ns(1), 64, 10),
        (ns(999_983), 2, 40),
        (Duration::from_micros(100), 64, 6), // the default: overflow list
        (ns(1), 64, 1),                      // one level: all overflow
        (ns(3_333_333), 5, 3),
    ];
    for (i, (tick, slots, levels)) in shapes.into_iter().enumerate() {
        for s in 0..12u64 {
            deep_round(1000 * i as u64 + s + 1, tick, slots, levels).await;
        }
    }
}
