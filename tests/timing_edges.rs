//! The timing promises at their edges, on paused Tokio time: ticks that do
//! not divide a second or are a few nanoseconds, clocks and deadlines off the
//! tick grid, odd wheel shapes, time moved by hand in odd steps, zero, past
//! and far deadlines, long uptimes, and the reaper's wake-ups while idle.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::{advance, Instant};
use tokio_purgatory::{Completion, Operation, Purgatory, Reaper, Timer};

mod support;
use support::{ms, settle};

fn ns(n: u64) -> Duration {
    Duration::from_nanos(n)
}

const YEAR: Duration = Duration::from_secs(365 * 86_400);

/// Never completes; expires with the instant it expired at.
struct Never;
impl Operation for Never {
    type Output = Instant;
    fn try_complete(&mut self) -> Option<Instant> {
        None
    }
    fn on_expiration(self) -> Instant {
        Instant::now()
    }
}

/// The slack the docs allow beyond one tick: "Tokio's own timer ... adds up to 2 ms".
const TOKIO_SLACK: Duration = Duration::from_millis(2);

fn tick_shapes() -> Vec<Duration> {
    vec![
        ns(1),
        ns(2),
        ns(3),
        Duration::from_micros(1),
        ns(999_999),
        ns(1_000_001),
        Duration::from_micros(1_500),
        ms(3),
        ms(7),
        Duration::from_secs(1),
        Duration::from_millis(1_500),
        ns((1 << 32) + 1), // above 2^32 ns
        Duration::from_secs(5),
    ]
}

/// Never early, late by less than a tick plus Tokio's 2 ms, for odd ticks,
/// odd offsets of the clock before the timer is built, and deadlines on, just
/// off, and far off the grid (beyond the top level for the 1 ns tick).
#[tokio::test(start_paused = true)]
async fn timer_odd_ticks_never_early_and_bounded() {
    for tick in tick_shapes() {
        advance(ns(1_234_567)).await; // odd offset before the build
        let timer = Timer::builder().tick(tick).build().unwrap();
        advance(ns(777)).await; // and after it
        let mut offs = vec![
            ns(1),
            tick.saturating_sub(ns(1)).max(ns(1)),
            tick,
            tick + ns(1),
            tick * 2 + ns(1),
            Duration::from_secs(1) + ns(1),
            Duration::from_millis(3_700),
        ];
        if tick <= ns(3) {
            offs.push(Duration::from_secs(100) + ns(3)); // past 2^36 ticks
        }
        for off in offs {
            let at = Instant::now() + off;
            timer.sleep_until(at).await.unwrap();
            let now = Instant::now();
            assert!(now >= at, "tick {tick:?}, +{off:?}: fired early");
            assert!(
                now - at < tick + TOKIO_SLACK,
                "tick {tick:?}, +{off:?}: {:?} late",
                now - at
            );
        }
        // A zero delay / a deadline already reached runs with no time passing.
        let t = Instant::now();
        timer.sleep(Duration::ZERO).await.unwrap();
        timer.sleep_until(t).await.unwrap();
        timer.sleep_until(t - ns(1)).await.unwrap();
        assert_eq!(Instant::now(), t, "tick {tick:?}: a due deadline waited");
    }
}

/// The same for purgatory expiries, registered with `_at`, and moved with
/// `reset_at` earlier and later.
#[tokio::test(start_paused = true)]
async fn purgatory_odd_ticks_never_early_and_bounded() {
    for tick in tick_shapes() {
        advance(ns(987_654_321)).await;
        let p: Purgatory<u32, Never> = Purgatory::builder().tick(tick).build().unwrap();
        advance(ns(333)).await;
        for off in [
            ns(1),
            tick.saturating_sub(ns(1)).max(ns(1)),
            tick + ns(1),
            Duration::from_millis(2_500) + ns(7),
        ] {
            let at = Instant::now() + off;
            let h = p.try_complete_else_watch_at(Never, at, [1]).unwrap();
            let Ok(Completion::Expired(fired)) = h.await else {
                panic!()
            };
            assert!(fired >= at, "tick {tick:?}, +{off:?}: expired early");
            assert!(
                fired - at < tick + TOKIO_SLACK,
                "tick {tick:?}, +{off:?}: {:?} late",
                fired - at
            );

            // Registered far out, then brought forward to `at2`.
            let at2 = Instant::now() + off;
            let h = p
                .try_complete_else_watch(Never, Duration::from_secs(3600), [2])
                .unwrap();
            assert!(h.reset_at(at2));
            let Ok(Completion::Expired(fired)) = h.await else {
                panic!()
            };
            assert!(fired >= at2, "tick {tick:?}, reset +{off:?}: early");
            assert!(
                fired - at2 < tick + TOKIO_SLACK,
                "tick {tick:?}, reset +{off:?}: {:?} late",
                fired - at2
            );

            // Registered near, pushed back through an OpRef.
            let h = p.try_complete_else_watch(Never, ns(1), [3]).unwrap();
            let at3 = Instant::now() + off + tick * 3;
            assert!(h.op_ref().unwrap().reset_at(at3));
            let Ok(Completion::Expired(fired)) = h.await else {
                panic!()
            };
            assert!(fired >= at3, "tick {tick:?}, pushed +{off:?}: early");
            assert!(
                fired - at3 < tick + TOKIO_SLACK,
                "tick {tick:?}, pushed +{off:?}: {:?} late",
                fired - at3
            );
        }
    }
}

/// A tiny model test on the real reaper: tasks at random deadlines (near,
/// off-grid, beyond the top level of small wheels), time moved by hand in odd
/// steps (1 ns, tick - 1 ns, tick + 1 ns, ...). At every step: nothing fired
/// before its deadline, and everything whose deadline + tick + 2 ms has passed
/// has fired, exactly once.
#[tokio::test(start_paused = true)]
async fn manual_odd_steps_over_odd_wheels() {
    let mut rng = support::rng::Rng(0xC0FFEE);
    for (slots, levels) in [
        (2, 1),
        (3, 1),
        (2, 3),
        (3, 4),
        (5, 2),
        (63, 2),
        (64, 1),
        (64, 6),
    ] {
        for tick in [ms(1), ms(3), Duration::from_micros(100), ms(7)] {
            advance(ns(rng.below(5_000_000) + 1)).await;
            let timer = Timer::builder()
                .tick(tick)
                .slots_per_level(slots)
                .levels(levels)
                .shards(2)
                .build()
                .unwrap();
            let start = Instant::now();
            let n = 60usize;
            let fired: Arc<Mutex<Vec<Vec<Instant>>>> = Arc::new(Mutex::new(vec![Vec::new(); n]));
            let mut deadlines = Vec::new();
            for i in 0..n {
                let off = match rng.below(6) {
                    0 => ns(rng.below(3_000_000)),
                    1 => ns(rng.below(20) * tick.as_nanos() as u64),
                    2 => ns(rng.below(20) * tick.as_nanos() as u64 + 1),
                    3 => ns(rng.below(20) * tick.as_nanos() as u64).saturating_sub(ns(1)),
                    _ => ns(rng.below(400_000_000)),
                };
                let at = start + off;
                deadlines.push(at);
                let f = fired.clone();
                timer
                    .schedule_at(at, move || f.lock().unwrap()[i].push(Instant::now()))
                    .unwrap();
            }
            let last = *deadlines.iter().max().unwrap() + tick + TOKIO_SLACK;
            let t_ns = tick.as_nanos() as u64;
            while Instant::now() <= last + ms(1) {
                let step = match rng.below(8) {
                    0 => ns(1),
                    1 => ns(t_ns - 1),
                    2 => ns(t_ns + 1),
                    3 => ns(999_999),
                    4 => ns(rng.below(3 * t_ns) + 1),
                    _ => ns(rng.below(8_000_000) + 1),
                };
                advance(step).await;
                settle().await;
                let now = Instant::now();
                let f = fired.lock().unwrap();
                for (i, at) in deadlines.iter().enumerate() {
                    assert!(
                        f[i].len() <= 1,
                        "{slots}x{levels} tick {tick:?}: fired twice"
                    );
                    if let Some(when) = f[i].first() {
                        assert!(
                            *when >= *at,
                            "{slots}x{levels} tick {tick:?}: #{i} fired {:?} early",
                            *at - *when
                        );
                    } else {
                        assert!(
                            now < *at + tick + TOKIO_SLACK,
                            "{slots}x{levels} tick {tick:?}: #{i} (due +{:?}) not fired {:?} after its deadline",
                            *at - start,
                            now - *at
                        );
                    }
                }
            }
            assert!(timer.is_empty());
        }
    }
}

/// A timeout of 1 ns waits at least 1 ns; a zero timeout does not wait. For
/// the purgatory and the timer.
#[tokio::test(start_paused = true)]
async fn one_nanosecond_and_zero_timeouts() {
    for tick in [Duration::from_micros(100), Duration::from_secs(1), ns(1)] {
        advance(ns(123)).await;
        let timer = Timer::builder().tick(tick).build().unwrap();
        let p: Purgatory<u32, Never> = Purgatory::builder().tick(tick).build().unwrap();
        let t0 = Instant::now();
        timer.sleep(ns(1)).await.unwrap();
        assert!(
            Instant::now() >= t0 + ns(1),
            "tick {tick:?}: sleep(1ns) did not wait"
        );
        assert!(Instant::now() - t0 < tick + TOKIO_SLACK);
        let t0 = Instant::now();
        let Ok(Completion::Expired(at)) =
            p.try_complete_else_watch(Never, ns(1), [1]).unwrap().await
        else {
            panic!()
        };
        assert!(
            at >= t0 + ns(1),
            "tick {tick:?}: 1 ns timeout expired at once"
        );
        let t0 = Instant::now();
        let Ok(Completion::Expired(at)) = p
            .try_complete_else_watch(Never, Duration::ZERO, [1])
            .unwrap()
            .await
        else {
            panic!()
        };
        assert_eq!(at, t0, "tick {tick:?}: a zero timeout waited");
    }
}

/// `Duration::MAX` "becomes about 30 years": it does not fire within 29 years,
/// and does fire once 30 years (and a bit) have passed.
#[tokio::test(start_paused = true)]
async fn duration_max_becomes_about_thirty_years() {
    let timer = Timer::new();
    let p: Purgatory<u32, Never> = Purgatory::new();
    let start = Instant::now();
    let ran = Arc::new(AtomicUsize::new(0));
    let r = ran.clone();
    timer
        .schedule(Duration::MAX, move || {
            r.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
    let sleep = timer.sleep(Duration::MAX);
    assert!(sleep.deadline() >= start + YEAR * 29);
    let h = p
        .try_complete_else_watch(Never, Duration::MAX, [1])
        .unwrap();
    let op = h.op_ref().unwrap();
    advance(YEAR * 29).await;
    settle().await;
    assert_eq!(ran.load(Ordering::SeqCst), 0);
    assert!(!sleep.is_elapsed());
    assert!(!op.is_finished());
    advance(YEAR * 2).await;
    settle().await;
    assert_eq!(
        ran.load(Ordering::SeqCst),
        1,
        "Duration::MAX task never ran after 31 years"
    );
    assert!(sleep.is_elapsed());
    assert!(op.is_finished());
}

/// Instants far beyond anything sensible are accepted without panic and do
/// not fire early.
#[tokio::test(start_paused = true)]
async fn absurdly_far_instants_do_not_panic_or_fire() {
    let timer = Timer::new();
    let p: Purgatory<u32, Never> = Purgatory::new();
    let far = Instant::now() + Duration::from_secs(u64::MAX / 4);
    let t = timer.schedule_at(far, || panic!("fired")).unwrap();
    let s = timer.sleep_until(far);
    let h = p.try_complete_else_watch_at(Never, far, [1]).unwrap();
    let near = timer.schedule(ms(10), || {}).unwrap();
    assert!(near.reset_at(far));
    let h2 = p.try_complete_else_watch(Never, ms(10), [2]).unwrap();
    assert!(h2.reset_at(far));
    advance(YEAR * 100).await;
    settle().await;
    assert!(t.is_pending() && near.is_pending());
    assert!(!s.is_elapsed());
    assert!(!h.is_finished() && !h2.is_finished());
    assert_eq!(timer.metrics().panicked, 0);
}

/// Idle: one timer 10 minutes out on a wheel whose top level spans 2 ticks
/// (so the timer sits in the overflow list) costs at most two wake-ups.
#[tokio::test(start_paused = true)]
async fn overflow_timer_ten_minutes_out_costs_at_most_two_wakeups() {
    for (slots, levels, tick) in [
        (2, 1, ms(1)),
        (3, 2, ms(1)),
        (64, 1, Duration::from_micros(100)),
    ] {
        let timer = Timer::builder()
            .tick(tick)
            .slots_per_level(slots)
            .levels(levels)
            .build()
            .unwrap();
        settle().await;
        let before = timer.metrics().reaper_wakeups;
        let ran = Arc::new(AtomicUsize::new(0));
        let r = ran.clone();
        timer
            .schedule(Duration::from_secs(600), move || {
                r.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap();
        advance(Duration::from_secs(3600)).await;
        settle().await;
        assert_eq!(ran.load(Ordering::SeqCst), 1);
        let w = timer.metrics().reaper_wakeups - before;
        assert!(w <= 2, "{slots}x{levels} tick {tick:?}: {w} wake-ups");
    }
}

/// Past the default wheel's top level (2^36 ticks of 100 us, ~80 days): a
/// timer 100 days out fires at its deadline, with at most two wake-ups.
#[tokio::test(start_paused = true)]
async fn past_the_default_top_level_fires_on_time_with_two_wakeups() {
    let timer = Timer::new();
    settle().await;
    let before = timer.metrics().reaper_wakeups;
    let fired = Arc::new(Mutex::new(None));
    let f = fired.clone();
    let at = Instant::now() + Duration::from_secs(100 * 86_400) + ns(12_345);
    timer
        .schedule_at(at, move || *f.lock().unwrap() = Some(Instant::now()))
        .unwrap();
    advance(Duration::from_secs(100 * 86_400)).await;
    settle().await;
    assert!(fired.lock().unwrap().is_none(), "early");
    for _ in 0..100 {
        advance(Duration::from_micros(50)).await;
        settle().await;
    }
    let when = fired.lock().unwrap().expect("fired");
    assert!(when >= at, "early by {:?}", at - when);
    assert!(
        when - at < Duration::from_micros(100) + TOKIO_SLACK,
        "late by {:?}",
        when - at
    );
    let w = timer.metrics().reaper_wakeups - before;
    assert!(w <= 2, "{w} wake-ups");
}

/// Idle: a purgatory whose operations all finished early, a shared reaper
/// with nothing scheduled, and a timer whose tasks were all cancelled: an hour
/// of idleness wakes each reaper at most once.
#[tokio::test(start_paused = true)]
async fn idle_after_early_finishes_wakes_at_most_once_an_hour() {
    // Purgatory: operations complete by an event long before their timeouts.
    let p: Purgatory<u32, support::FlagOp> = Purgatory::new();
    let flag = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut hs = Vec::new();
    for i in 0..100u64 {
        hs.push(
            p.try_complete_else_watch(
                support::FlagOp(flag.clone()),
                Duration::from_secs(60 + i * 7),
                [1],
            )
            .unwrap(),
        );
    }
    settle().await;
    flag.store(true, Ordering::SeqCst);
    assert_eq!(p.try_complete_watched(&1), 100);
    for h in hs {
        h.await.unwrap();
    }
    settle().await;
    let before = p.metrics().reaper_wakeups;
    advance(Duration::from_secs(3600)).await;
    settle().await;
    let w = p.metrics().reaper_wakeups - before;
    assert!(w <= 1, "{w} wake-ups in an idle hour");

    // Timer: 100 tasks scheduled, all cancelled.
    let timer = Timer::new();
    let ts: Vec<_> = (0..100u64)
        .map(|i| {
            timer
                .schedule(Duration::from_secs(60 + i * 7), || {})
                .unwrap()
        })
        .collect();
    settle().await;
    for t in ts {
        assert!(t.cancel());
    }
    let before = timer.metrics().reaper_wakeups;
    advance(Duration::from_secs(3600)).await;
    settle().await;
    let w = timer.metrics().reaper_wakeups - before;
    assert!(w <= 1, "{w} wake-ups in an idle hour");

    // A shared reaper serving an idle purgatory and timer.
    let reaper = Reaper::start().unwrap();
    let p2: Purgatory<u32, Never> = Purgatory::builder().reaper(&reaper).build().unwrap();
    let t2 = Timer::builder().reaper(&reaper).build().unwrap();
    settle().await;
    let (b1, b2) = (p2.metrics().reaper_wakeups, t2.metrics().reaper_wakeups);
    advance(Duration::from_secs(3600)).await;
    settle().await;
    assert!(p2.metrics().reaper_wakeups - b1 <= 1);
    assert!(t2.metrics().reaper_wakeups - b2 <= 1);
}

/// "The reaper wakes once per distinct due time", and once more for an
/// insert due before everything pending: timers inserted latest first, the
/// reaper asleep between inserts.
#[tokio::test(start_paused = true)]
async fn wakeups_per_due_time_when_inserted_latest_first() {
    let timer = Timer::new();
    settle().await;
    let before = timer.metrics().reaper_wakeups;
    let n = 10u64;
    for i in (1..=n).rev() {
        timer.schedule(Duration::from_secs(i), || {}).unwrap();
        settle().await; // the reaper re-arms and sleeps again
    }
    for _ in 0..=n {
        advance(Duration::from_secs(1)).await;
        settle().await;
    }
    assert!(timer.is_empty());
    let w = timer.metrics().reaper_wakeups - before;
    // One per due time, and one per insert due before everything pending
    // while the reaper sleeps (to set its alarm earlier).
    assert!(w <= 2 * n, "{w} wake-ups for {n} distinct due times");
    assert!(w >= n, "{w} wake-ups: a due time was run without waking");
}

/// Repeating tasks: each run starts no earlier than the previous run's end
/// plus the delay returned, late by less than a tick plus Tokio's slack.
#[tokio::test(start_paused = true)]
async fn repeating_with_odd_delays_never_early() {
    for tick in [ms(3), ns(999_983), Duration::from_micros(100)] {
        let timer = Timer::builder().tick(tick).build().unwrap();
        advance(ns(41)).await;
        let runs = Arc::new(Mutex::new(Vec::new()));
        let r = runs.clone();
        let delays = [
            ns(1),
            ms(2) + ns(1),
            tick - ns(1),
            tick + ns(1),
            ms(17) + ns(3),
        ];
        let mut k = 0usize;
        let start = Instant::now();
        timer
            .schedule_repeating(delays[0], move || {
                r.lock().unwrap().push(Instant::now());
                k += 1;
                delays.get(k).copied()
            })
            .unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        let runs = runs.lock().unwrap().clone();
        assert_eq!(runs.len(), delays.len(), "tick {tick:?}");
        let mut prev = start;
        for (i, at) in runs.iter().enumerate() {
            let due = prev + delays[i];
            assert!(*at >= due, "tick {tick:?}: run {i} early");
            assert!(
                *at - due < tick + TOKIO_SLACK,
                "tick {tick:?}: run {i} {:?} late",
                *at - due
            );
            prev = *at;
        }
    }
}

/// Timer resets: earlier, later, past; the task runs at the new deadline only.
#[tokio::test(start_paused = true)]
async fn timer_reset_earlier_later_and_past_with_odd_ticks() {
    for tick in [ms(3), ms(7), ns(1), Duration::from_secs(1)] {
        let timer = Timer::builder()
            .tick(tick)
            .slots_per_level(3)
            .levels(2)
            .build()
            .unwrap();
        advance(ns(5_555)).await;
        let fired = Arc::new(Mutex::new(Vec::new()));
        let f = fired.clone();
        let t = timer
            .schedule(ms(50), move || f.lock().unwrap().push(Instant::now()))
            .unwrap();
        settle().await; // the reaper sleeps until 50 ms
                        // Later: past the old deadline.
        let later = Instant::now() + ms(120) + ns(1);
        assert!(t.reset_at(later));
        advance(ms(60)).await;
        settle().await;
        assert!(
            fired.lock().unwrap().is_empty(),
            "tick {tick:?}: fired at the old deadline"
        );
        // Earlier than `later`, still in the future.
        let earlier = Instant::now() + ms(5) + ns(1);
        assert!(t.reset_at(earlier));
        tokio::time::sleep_until(earlier + tick + TOKIO_SLACK).await;
        settle().await;
        let f1 = fired.lock().unwrap().clone();
        assert_eq!(f1.len(), 1, "tick {tick:?}");
        assert!(f1[0] >= earlier, "tick {tick:?}: early");
        assert!(!t.reset(ms(1)), "ran already");
        // Past: runs with no time passing.
        let f = fired.clone();
        let t2 = timer
            .schedule(Duration::from_secs(3600), move || {
                f.lock().unwrap().push(Instant::now())
            })
            .unwrap();
        settle().await;
        let now = Instant::now();
        assert!(t2.reset_at(now - ms(1)));
        settle().await;
        let f2 = fired.lock().unwrap().clone();
        assert_eq!(
            f2.len(),
            2,
            "tick {tick:?}: a past reset did not run at once"
        );
        assert_eq!(f2[1], now);
    }
}

/// A randomised model on the real reaper: schedules, cancels and resets
/// (earlier, later, past, far) interleaved with odd hand-moved steps of time,
/// on odd wheel shapes and ticks. After each step and settle: nothing ran
/// before its (latest) deadline, nothing ran twice or after a successful
/// cancel, and everything whose deadline + tick + 2 ms has passed has run.
#[tokio::test(start_paused = true)]
async fn interleaved_schedule_cancel_reset_model() {
    #[derive(Clone, Copy, PartialEq, Debug)]
    enum St {
        Live,
        Cancelled,
    }
    let mut rng = support::rng::Rng(0xBADC0DE);
    for round in 0..24u64 {
        let (slots, levels) =
            [(2, 1), (3, 2), (4, 2), (64, 1), (64, 6), (7, 3)][round as usize % 6];
        let tick =
            [ms(1), ms(3), Duration::from_micros(100), ns(1_000_001)][(round / 6) as usize % 4];
        advance(ns(rng.below(10_000_000) + 1)).await;
        let timer = Timer::builder()
            .tick(tick)
            .slots_per_level(slots)
            .levels(levels)
            .shards(1 + (round as usize % 3))
            .build()
            .unwrap();
        let t_ns = tick.as_nanos() as u64;
        let fired: Arc<Mutex<Vec<Vec<Instant>>>> = Arc::new(Mutex::new(Vec::new()));
        let mut handles = Vec::new();
        let mut deadline: Vec<Instant> = Vec::new();
        let mut state: Vec<St> = Vec::new();
        for _step in 0..400 {
            match rng.below(10) {
                0..=2 => {
                    let now = Instant::now();
                    let at = match rng.below(5) {
                        0 => now.checked_sub(ns(rng.below(3_000_000))).unwrap(),
                        1 => now + ns(rng.below(20) * t_ns + rng.below(2)),
                        2 => now + Duration::from_secs(rng.below(5)) + ns(rng.below(1_000_000)),
                        _ => now + ns(rng.below(60_000_000)),
                    };
                    let i = handles.len();
                    fired.lock().unwrap().push(Vec::new());
                    let f = fired.clone();
                    let h = timer
                        .schedule_at(at, move || f.lock().unwrap()[i].push(Instant::now()))
                        .unwrap();
                    handles.push(h);
                    deadline.push(at.max(now));
                    state.push(St::Live);
                }
                3 if !handles.is_empty() => {
                    let i = rng.below(handles.len() as u64) as usize;
                    if handles[i].cancel() {
                        assert_eq!(state[i], St::Live);
                        assert!(fired.lock().unwrap()[i].is_empty());
                        state[i] = St::Cancelled;
                    }
                }
                4 | 5 if !handles.is_empty() => {
                    let i = rng.below(handles.len() as u64) as usize;
                    let now = Instant::now();
                    let at = match rng.below(4) {
                        0 => now.checked_sub(ns(rng.below(2_000_000))).unwrap(),
                        1 => now + ns(rng.below(10) * t_ns),
                        2 => now + Duration::from_secs(rng.below(3)) + ns(rng.below(999)),
                        _ => now + ns(rng.below(30_000_000)),
                    };
                    if handles[i].reset_at(at) {
                        assert_eq!(state[i], St::Live, "reset a cancelled task");
                        deadline[i] = at.max(now);
                    }
                }
                _ => {
                    let step = match rng.below(6) {
                        0 => ns(1),
                        1 => ns(t_ns - 1),
                        2 => ns(t_ns + 1),
                        3 => ns(rng.below(50_000_000) + 1),
                        _ => ns(rng.below(4_000_000) + 1),
                    };
                    advance(step).await;
                    if rng.below(3) != 0 {
                        settle().await;
                        let now = Instant::now();
                        let f = fired.lock().unwrap();
                        for i in 0..handles.len() {
                            assert!(f[i].len() <= 1, "round {round}: #{i} ran twice");
                            match (state[i], f[i].first()) {
                                (St::Cancelled, Some(_)) => panic!("round {round}: #{i} ran after cancel"),
                                (St::Live, Some(when)) => assert!(
                                    *when >= deadline[i],
                                    "round {round} ({slots}x{levels}, tick {tick:?}): #{i} ran {:?} early",
                                    deadline[i] - *when
                                ),
                                (St::Live, None) => assert!(
                                    now < deadline[i] + tick + TOKIO_SLACK,
                                    "round {round} ({slots}x{levels}, tick {tick:?}): #{i} not run {:?} after its deadline",
                                    now - deadline[i]
                                ),
                                (St::Cancelled, None) => {}
                            }
                        }
                    }
                }
            }
        }
        drop(timer.shutdown());
    }
}

/// `Timer::schedule_async`: the future starts no earlier than its deadline,
/// reset or not.
#[tokio::test(start_paused = true)]
async fn schedule_async_starts_no_earlier_than_its_deadline() {
    for tick in [ms(3), ns(1), Duration::from_secs(1)] {
        let timer = Timer::builder().tick(tick).build().unwrap();
        advance(ns(999)).await;
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let at = Instant::now() + ms(20) + ns(1);
        let t = tx.clone();
        timer
            .schedule_async(ms(20) + ns(1), async move {
                let _ = t.send(Instant::now());
            })
            .unwrap();
        let when = rx.recv().await.unwrap();
        assert!(when >= at, "tick {tick:?}: started early");
        assert!(
            when - at < tick + TOKIO_SLACK,
            "tick {tick:?}: {:?} late",
            when - at
        );
        let t = tx.clone();
        let h = timer
            .schedule_async(Duration::from_secs(60), async move {
                let _ = t.send(Instant::now());
            })
            .unwrap();
        let at = Instant::now() + ms(7) + ns(3);
        assert!(h.reset(ms(7) + ns(3)));
        let when = rx.recv().await.unwrap();
        assert!(when >= at, "tick {tick:?}: reset future started early");
        assert!(
            when - at < tick + TOKIO_SLACK,
            "tick {tick:?}: {:?} late",
            when - at
        );
    }
}

// ---------------------------------------------------------------------------
// Centuries: far deadlines and long uptimes (contrived, but the docs promise
// saturation and "never early" without a bound).

/// A 1 ns tick: the wheel counts about 2^63 ticks (292 years) from its
/// start. A deadline 300 years out is accepted and never fires (never early);
/// past the horizon, a deadline already reached still runs at once, a future
/// one never runs early, and the reaper does not spin.
#[tokio::test(start_paused = true)]
async fn one_ns_tick_past_the_horizon_never_early_and_no_spin() {
    let timer = Timer::builder().tick(ns(1)).build().unwrap();
    let ran = Arc::new(AtomicUsize::new(0));
    let r = ran.clone();
    let at = Instant::now() + YEAR * 300;
    timer
        .schedule_at(at, move || {
            r.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
    settle().await;
    advance(YEAR * 299).await;
    settle().await;
    assert_eq!(ran.load(Ordering::SeqCst), 0, "early");
    advance(YEAR * 2).await;
    settle().await;
    assert_eq!(ran.load(Ordering::SeqCst), 0, "past the horizon: never");
    assert_eq!(timer.len(), 1);
    let before = timer.metrics();
    timer.sleep(Duration::ZERO).await.unwrap();
    let s = timer.sleep(Duration::from_secs(1));
    settle().await;
    advance(Duration::from_secs(2)).await;
    settle().await;
    assert!(
        !s.is_elapsed(),
        "past the horizon, a future deadline never comes"
    );
    let after = timer.metrics();
    let wakeups = after.reaper_wakeups - before.reaper_wakeups;
    let turns = after.reaper.turns - before.reaper.turns;
    assert!(
        wakeups <= 3 && turns <= 6,
        "{wakeups} wake-ups, {turns} turns: the reaper spins"
    );
}

/// The default tick: a deadline 600 years out (more than 2^64 ns after the
/// timer was built) fires once reached.
#[tokio::test(start_paused = true)]
async fn default_tick_deadline_600_years_out_fires_when_reached() {
    let timer = Timer::new();
    let ran = Arc::new(AtomicUsize::new(0));
    let r = ran.clone();
    timer
        .schedule_at(Instant::now() + YEAR * 600, move || {
            r.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
    settle().await;
    advance(YEAR * 599).await;
    settle().await;
    assert_eq!(ran.load(Ordering::SeqCst), 0, "early");
    advance(YEAR * 2).await;
    settle().await;
    assert_eq!(
        ran.load(Ordering::SeqCst),
        1,
        "a 600-year deadline (representable by Instant) never ran, 601 years on"
    );
}

/// A timer built, then 585 years of uptime (more than 2^64 ns): a one-hour
/// sleep must not end at once (tick 3 ms, a tick that does not divide a
/// second).
#[tokio::test(start_paused = true)]
async fn after_585_years_uptime_a_one_hour_sleep_is_not_early() {
    let timer = Timer::builder().tick(ms(3)).build().unwrap();
    settle().await;
    advance(YEAR * 585).await;
    settle().await;
    let start = Instant::now();
    let s = timer.sleep(Duration::from_secs(3600));
    settle().await;
    assert!(
        !s.is_elapsed(),
        "a 1 h sleep ended after {:?}",
        Instant::now() - start
    );
}

/// A timer built with the default tick, then 585 years of uptime: a 10 ms
/// sleep ends (within a tick and Tokio's slack) once 10 ms have passed.
#[tokio::test(start_paused = true)]
async fn after_585_years_uptime_a_10ms_sleep_still_ends() {
    let timer = Timer::new();
    settle().await;
    advance(YEAR * 585).await;
    settle().await;
    let s = timer.sleep(ms(10));
    settle().await;
    for _ in 0..100 {
        advance(ms(1)).await;
        settle().await;
    }
    assert!(s.is_elapsed(), "a 10 ms sleep had not ended 100 ms on");
}

/// Cell reuse: an operation finishes early (its timer entry is only gathered
/// for removal), and a new one with a long timeout reuses its cell at once;
/// the old deadline passes. The new operation must not expire early, whatever
/// the order of completion, registration and the reaper's turn.
#[tokio::test(start_paused = true)]
async fn a_reused_cell_is_not_expired_by_its_predecessors_deadline() {
    let p: Purgatory<u32, support::FlagOp> = Purgatory::builder()
        .tick(ms(1))
        .timer_shards(1)
        .build()
        .unwrap();
    let mut rng = support::rng::Rng(17);
    for round in 0..300u32 {
        let flag = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let short = ns(rng.below(3_000_000) + 1);
        let a = p
            .try_complete_else_watch(support::FlagOp(flag.clone()), short, [round])
            .unwrap();
        if rng.below(2) == 0 {
            settle().await;
        }
        // Time reaches (or passes) A's deadline, without the reaper running.
        let pre = short.saturating_sub(ns(rng.below(2_000_000)));
        if !pre.is_zero() {
            tokio::time::advance(pre).await;
        }
        flag.store(true, Ordering::SeqCst);
        let done = p.try_complete_watched(&round);
        drop(a);
        let born = Instant::now();
        let b = p
            .try_complete_else_watch(
                support::FlagOp(Arc::new(std::sync::atomic::AtomicBool::new(false))),
                Duration::from_secs(3600),
                [round + 1_000_000],
            )
            .unwrap();
        advance(ms(5)).await;
        settle().await;
        assert!(
            !b.is_finished(),
            "round {round}: a 1 h operation finished {:?} after registration (A completed: {done})",
            Instant::now() - born
        );
        drop(b);
    }
    settle().await;
    assert_eq!(p.delayed(), 0);
}

/// Extreme shapes and ticks build, never fire early, and fire on time.
#[tokio::test(start_paused = true)]
async fn extreme_shapes_and_ticks() {
    for (tick, slots, levels, shards, batch) in [
        (ns(1), 2, 61, 1, 1),
        (ns(1), 64, 10, 1024, 1),
        (ns(7), 3, 39, 3, 2),
        (ms(1), 64, 1, 1, 1),
        (Duration::from_secs(3600), 2, 1, 1, 1),
    ] {
        let timer = Timer::builder()
            .tick(tick)
            .slots_per_level(slots)
            .levels(levels)
            .shards(shards)
            .batch_size(batch)
            .build()
            .unwrap();
        advance(ns(3)).await;
        for off in [
            ns(1),
            ms(1) + ns(1),
            Duration::from_secs(3) + ns(5),
            Duration::from_secs(7200),
        ] {
            let at = Instant::now() + off;
            timer.sleep_until(at).await.unwrap();
            let now = Instant::now();
            assert!(now >= at, "{tick:?} {slots}x{levels}: +{off:?} early");
            assert!(
                now - at < tick + TOKIO_SLACK,
                "{tick:?} {slots}x{levels}: +{off:?} {:?} late",
                now - at
            );
        }
        // Many due at once with batch 1: all run, none early.
        let n = Arc::new(AtomicUsize::new(0));
        let at = Instant::now() + ms(5);
        for _ in 0..50 {
            let n = n.clone();
            timer
                .schedule_at(at, move || {
                    assert!(Instant::now() >= at);
                    n.fetch_add(1, Ordering::SeqCst);
                })
                .unwrap();
        }
        timer
            .sleep_until(at + tick.min(Duration::from_secs(1)))
            .await
            .unwrap();
        settle().await;
        assert_eq!(n.load(Ordering::SeqCst), 50, "{tick:?} {slots}x{levels}");
        assert_eq!(timer.metrics().panicked, 0);
    }
}

/// A tick of `Duration::MAX` (or 100 years): building works, a zero delay
/// runs at once, a 1 ms sleep is not early, nothing panics.
#[tokio::test(start_paused = true)]
async fn enormous_ticks_do_not_panic() {
    for tick in [Duration::MAX, YEAR * 100, Duration::from_nanos(u64::MAX)] {
        let timer = Timer::builder().tick(tick).build().unwrap();
        let p: Purgatory<u32, Never> = Purgatory::builder().tick(tick).build().unwrap();
        advance(ns(5)).await;
        let t0 = Instant::now();
        timer.sleep(Duration::ZERO).await.unwrap();
        assert_eq!(Instant::now(), t0);
        let h = p
            .try_complete_else_watch(Never, Duration::ZERO, [1])
            .unwrap();
        assert_eq!(h.await.unwrap(), Completion::Expired(t0));
        let s = timer.sleep(ms(1));
        let h = p.try_complete_else_watch(Never, ms(1), [1]).unwrap();
        advance(Duration::from_secs(86_400)).await;
        settle().await;
        assert!(!s.is_elapsed(), "tick {tick:?}: early?");
        assert!(!h.is_finished());
        assert!(h.reset(Duration::ZERO));
        assert!(h.await.unwrap().is_expired());
        assert_eq!(timer.metrics().panicked, 0);
    }
}

/// Auto-advance over years (past Tokio's own ~2.2-year wheel span): a sleep
/// of 10 years ends at its deadline.
#[tokio::test(start_paused = true)]
async fn auto_advance_over_ten_years() {
    let timer = Timer::new();
    let p: Purgatory<u32, Never> = Purgatory::new();
    let at = Instant::now() + YEAR * 10 + ns(17);
    timer.sleep_until(at).await.unwrap();
    let now = Instant::now();
    assert!(
        now >= at && now - at < Duration::from_micros(100) + TOKIO_SLACK,
        "{:?}",
        now - at
    );
    let at = Instant::now() + YEAR * 3 + ns(1);
    let Ok(Completion::Expired(when)) = p.try_complete_else_watch_at(Never, at, [1]).unwrap().await
    else {
        panic!()
    };
    assert!(when >= at && when - at < Duration::from_micros(100) + TOKIO_SLACK);
}

/// The 1 ns tick at its boundary: 250 years (below 2^63 ns) still fires.
#[tokio::test(start_paused = true)]
async fn one_ns_tick_deadline_250_years_fires() {
    let timer = Timer::builder().tick(ns(1)).build().unwrap();
    let ran = Arc::new(AtomicUsize::new(0));
    let r = ran.clone();
    timer
        .schedule_at(Instant::now() + YEAR * 250, move || {
            r.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
    settle().await;
    advance(YEAR * 251).await;
    settle().await;
    assert_eq!(ran.load(Ordering::SeqCst), 1);
}

/// A purgatory or timer built in one runtime whose reaper runs on another
/// keeps the reaper's clock: built inside a paused runtime whose clock ran
/// an hour ahead, its reaper on a runtime whose clock did not, nothing it
/// holds fires early on the reaper's runtime (its origin read there, where
/// the reaper reads the clock, not an hour ahead, which made every deadline
/// look passed). A reaper of its own and a shared one.
#[test]
fn a_reaper_on_another_runtime_keeps_that_runtimes_clock() {
    support::within(20, || {
        const HOUR: Duration = Duration::from_secs(3_600);
        let reaper_rt = support::paused();
        let builder_rt = support::paused();
        let shared = Reaper::start_on(reaper_rt.handle());
        let (timers, purgatories) = builder_rt.block_on(async {
            tokio::time::sleep(HOUR).await;
            let timers = [
                Timer::builder().build_on(reaper_rt.handle()).unwrap(),
                Timer::builder().reaper(&shared).build().unwrap(),
            ];
            let purgatories: [Purgatory<u32, Never>; 2] = [
                Purgatory::builder().build_on(reaper_rt.handle()).unwrap(),
                Purgatory::builder().reaper(&shared).build().unwrap(),
            ];
            (timers, purgatories)
        });
        reaper_rt.block_on(async {
            for timer in &timers {
                let start = Instant::now();
                timer.sleep(ms(5_000)).await.unwrap();
                assert!(Instant::now() - start >= ms(5_000), "early");
            }
            for p in &purgatories {
                let start = Instant::now();
                let h = p.try_complete_else_watch(Never, ms(5_000), [1]).unwrap();
                let Ok(Completion::Expired(at)) = h.await else {
                    panic!("expired")
                };
                assert!(at - start >= ms(5_000), "early");
            }
        });
    });
}
