//! The timing promises used hostilely, on paused Tokio time: timers of very
//! different ticks sharing one reaper while time moves in odd steps,
//! deadlines on cascade boundaries, taken before the build, years out over
//! tiny wheels and near the wheel's horizon, repeating periods below and off
//! the tick, a tick below Tokio's millisecond, lateness samples; and what the
//! reaper's wake-ups cost: one per distinct due time, on a shared reaper too
//! (a task or an expiry scheduling on another timer or purgatory it serves, an
//! insert later than its alarm), and at most one for each alarm left by an
//! entry that left before it was due (moved later, completed, cancelled, a
//! timeout whose future won).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::{advance, Instant};
use tokio_purgatory::timer::TimeoutError;
use tokio_purgatory::{Completion, Operation, Purgatory, Reaper, Timer};

mod support;
use support::{ms, paused_within, settle, FlagOp};

fn ns(n: u64) -> Duration {
    Duration::from_nanos(n)
}

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

/// What the docs allow beyond one tick: Tokio's own timer "adds up to 2 ms".
const TOKIO_SLACK: Duration = Duration::from_millis(2);

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

/// Moves time on by `steps` steps of `step`, letting the reaper run after each.
async fn step_by(step: Duration, steps: u64) {
    for _ in 0..steps {
        advance(step).await;
        settle().await;
    }
}

/// A repeating task of one timer schedules a one-shot 5 ms on, from inside
/// its run: on a timer of its own reaper, and on another timer served by the
/// same shared reaper. Either way the insert made in the reaper's turn costs
/// no wake-up: exactly one per distinct due time (two per period).
#[test]
fn a_task_scheduling_on_another_timer_of_its_shared_reaper_costs_no_wakeup() {
    paused_within(30, || async {
        let periods = 20u64;
        for shared in [false, true] {
            let reaper = Reaper::start().unwrap();
            let (a, b) = if shared {
                (
                    Timer::builder().reaper(&reaper).build().unwrap(),
                    Timer::builder().reaper(&reaper).build().unwrap(),
                )
            } else {
                let a = Timer::new();
                (a.clone(), a)
            };
            settle().await;
            let runs_b = Arc::new(AtomicUsize::new(0));
            let (weak_b, rb) = (b.downgrade(), runs_b.clone());
            let mut k = 0;
            a.schedule_repeating(ms(10), move || {
                if let Some(b) = weak_b.upgrade() {
                    let rb = rb.clone();
                    b.schedule(ms(5), move || {
                        rb.fetch_add(1, Ordering::SeqCst);
                    })
                    .unwrap();
                }
                k += 1;
                (k < periods).then_some(ms(10))
            })
            .unwrap();
            // The first entry sets the idle reaper's alarm; counted from there.
            settle().await;
            let before = a.metrics().reaper_wakeups;
            step_by(ms(1), periods * 10 + 20).await;
            assert_eq!(runs_b.load(Ordering::SeqCst), periods as usize);
            assert!(a.is_empty() && b.is_empty());
            let woke = a.metrics().reaper_wakeups - before;
            assert_eq!(
                woke,
                2 * periods,
                "shared {shared}: {woke} wake-ups for {} distinct due times",
                2 * periods
            );
        }
    });
}

/// A shared reaper sleeps on timer A's deadline; from outside the reaper,
/// timer B gets an entry 5 ms after it. B's entry is not due before
/// everything pending, so it costs no wake-up: two per period, one per due
/// time. With a reaper each, B's sleeps on nothing and each insert wakes it
/// once more to set its alarm: at most three per period between them.
#[test]
fn an_insert_later_than_the_shared_reapers_alarm_costs_no_wakeup() {
    paused_within(30, || async {
        let periods = 20u64;
        for shared in [false, true] {
            let reaper = Reaper::start().unwrap();
            let (a, b) = if shared {
                (
                    Timer::builder().reaper(&reaper).build().unwrap(),
                    Timer::builder().reaper(&reaper).build().unwrap(),
                )
            } else {
                (Timer::new(), Timer::new())
            };
            settle().await;
            let start = Instant::now();
            for i in 1..=periods {
                a.schedule_at(start + ms(10 * i), || {}).unwrap();
            }
            settle().await;
            let (wa, wb) = (a.metrics().reaper_wakeups, b.metrics().reaper_wakeups);
            for i in 1..=periods {
                // The reaper sleeps until A's deadline at 10 i ms.
                b.schedule_at(start + ms(10 * i + 5), || {}).unwrap();
                settle().await;
                tokio::time::sleep_until(start + ms(10 * i + 9)).await;
                settle().await;
            }
            assert!(a.is_empty() && b.is_empty());
            assert_eq!(a.metrics().expired + b.metrics().expired, 2 * periods);
            let (da, db) = (
                a.metrics().reaper_wakeups - wa,
                b.metrics().reaper_wakeups - wb,
            );
            if shared {
                assert_eq!(db, da, "one reaper, one count in each it serves");
                assert_eq!(
                    da,
                    2 * periods,
                    "shared: {da} wake-ups for {} distinct due times",
                    2 * periods
                );
            } else {
                assert!(
                    da + db <= 3 * periods,
                    "a reaper each: {da} + {db} wake-ups for {} due times and {periods} alarms set",
                    2 * periods
                );
            }
        }
    });
}

/// An expiry on purgatory P1 registers an operation on P2, which shares P1's
/// reaper, 5 ms on: the registration made in the reaper's turn costs no
/// wake-up, exactly one per distinct due time.
#[test]
fn a_registration_from_an_expiry_on_the_shared_reaper_costs_no_wakeup() {
    struct Chain {
        next: Arc<Mutex<Option<Purgatory<u32, Leaf>>>>,
        fired: Arc<AtomicUsize>,
    }
    struct Leaf(Arc<AtomicUsize>);
    impl Operation for Leaf {
        type Output = ();
        fn try_complete(&mut self) -> Option<()> {
            None
        }
        fn on_expiration(self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
    impl Operation for Chain {
        type Output = ();
        fn try_complete(&mut self) -> Option<()> {
            None
        }
        fn on_expiration(self) {
            if let Some(p2) = self.next.lock().unwrap().as_ref() {
                p2.try_complete_else_watch(Leaf(self.fired.clone()), ms(5), [1])
                    .unwrap()
                    .detach();
            }
        }
    }
    paused_within(30, || async {
        let reaper = Reaper::start().unwrap();
        let p1: Purgatory<u32, Chain> = Purgatory::builder().reaper(&reaper).build().unwrap();
        let p2: Purgatory<u32, Leaf> = Purgatory::builder().reaper(&reaper).build().unwrap();
        let slot = Arc::new(Mutex::new(Some(p2.clone())));
        let fired = Arc::new(AtomicUsize::new(0));
        let start = Instant::now();
        let periods = 20u64;
        for i in 1..=periods {
            let chain = Chain {
                next: slot.clone(),
                fired: fired.clone(),
            };
            p1.try_complete_else_watch_at(chain, start + ms(10 * i), [1])
                .unwrap()
                .detach();
        }
        settle().await;
        let before = p1.metrics().reaper_wakeups;
        step_by(ms(1), 10 * periods + 10).await;
        assert_eq!(fired.load(Ordering::SeqCst), periods as usize);
        assert_eq!(p2.metrics().expired, periods);
        let woke = p1.metrics().reaper_wakeups - before;
        slot.lock().unwrap().take();
        assert_eq!(
            woke,
            2 * periods,
            "{woke} wake-ups for {} distinct due times",
            2 * periods
        );
    });
}

/// A heartbeat pushes a timeout 10 s out every 8 s, so it is never due. Each
/// reset leaves the alarm set for the old deadline: the reaper wakes at most
/// once there and sleeps on. A reset itself wakes nothing; when the beats
/// stop, the timeout fires once, never early. For the timer's task and a
/// purgatory's operation alike.
#[test]
fn heartbeat_resets_cost_at_most_one_wakeup_per_alarm_left_behind() {
    paused_within(30, || async {
        let beats = 50u64;
        let timer = Timer::new();
        let ran = Arc::new(Mutex::new(Vec::new()));
        let r = ran.clone();
        let task = timer
            .schedule(secs(10), move || r.lock().unwrap().push(Instant::now()))
            .unwrap();
        let p: Purgatory<u32, Never> = Purgatory::new();
        let op = p.try_complete_else_watch(Never, secs(10), [1]).unwrap();
        settle().await;
        let woken = || (timer.metrics().reaper_wakeups, p.metrics().reaper_wakeups);
        let start = woken();
        let mut deadline = Instant::now() + secs(10);
        for beat in 0..beats {
            let was = woken();
            advance(secs(8)).await;
            settle().await;
            let now = woken();
            // The alarm left by the previous reset (none before the first).
            let allowed = u64::from(beat > 0);
            assert!(
                now.0 - was.0 <= allowed && now.1 - was.1 <= allowed,
                "beat {beat}: {:?} wake-ups with {allowed} alarm left behind",
                (now.0 - was.0, now.1 - was.1)
            );
            assert!(task.reset(secs(10)) && op.reset(secs(10)), "beat {beat}");
            deadline = Instant::now() + secs(10);
            settle().await;
            assert_eq!(woken(), now, "beat {beat}: a reset later woke the reaper");
            assert!(ran.lock().unwrap().is_empty() && !op.is_finished());
        }
        let was = woken();
        assert!(
            was.0 - start.0 < beats && was.1 - start.1 < beats,
            "{:?} wake-ups over {beats} beats, nothing due",
            (was.0 - start.0, was.1 - start.1)
        );
        // One alarm left by the last reset, then the deadline; time moved by
        // Tokio's auto-advance, so the reaper runs at the instant it wakes.
        tokio::time::sleep(secs(13)).await;
        settle().await;
        let now = woken();
        assert!(
            now.0 - was.0 <= 2 && now.1 - was.1 <= 2,
            "{:?} wake-ups for one alarm left and one due time",
            (now.0 - was.0, now.1 - was.1)
        );
        let ran = ran.lock().unwrap().clone();
        assert_eq!(ran.len(), 1);
        assert!(ran[0] >= deadline && ran[0] - deadline < TOKIO_SLACK);
        let Ok(Completion::Expired(at)) = op.await else {
            panic!("the operation did not expire")
        };
        assert!(at >= deadline && at - deadline < TOKIO_SLACK);
        assert_eq!((timer.metrics().expired, p.metrics().expired), (1, 1));
    });
}

/// Operations completed early, one at a time: each registration sets the
/// idle reaper's alarm (one wake-up), the completion wakes nothing, the
/// alarm it leaves costs at most one wake-up, and after it nothing at all.
#[test]
fn an_early_completion_costs_at_most_one_wakeup_at_its_old_deadline() {
    paused_within(30, || async {
        let p: Purgatory<u32, FlagOp> = Purgatory::new();
        settle().await;
        let woken = || p.metrics().reaper_wakeups;
        let start = woken();
        let n = 20u32;
        for i in 0..n {
            let flag = Arc::new(AtomicBool::new(false));
            let was = woken();
            let h = p
                .try_complete_else_watch(FlagOp(flag.clone()), secs(10), [i])
                .unwrap();
            settle().await;
            assert!(
                woken() - was <= 1,
                "round {i}: a registration woke it twice"
            );
            let was = woken();
            advance(secs(1)).await;
            flag.store(true, Ordering::SeqCst);
            assert_eq!(p.try_complete_watched(&i), 1);
            assert!(matches!(h.await, Ok(Completion::Completed(()))));
            settle().await;
            assert_eq!(woken(), was, "round {i}: the completion woke the reaper");
            // Past the deadline the completed operation left.
            advance(secs(10)).await;
            settle().await;
            assert!(woken() - was <= 1, "round {i}: {} wake-ups", woken() - was);
            let was = woken();
            advance(secs(100)).await;
            settle().await;
            assert_eq!(woken(), was, "round {i}: woke with nothing scheduled");
        }
        assert_eq!(p.metrics().expired, 0);
        assert_eq!(p.metrics().completed, u64::from(n));
        let woke = woken() - start;
        assert!(
            woke <= 2 * u64::from(n),
            "{woke} wake-ups for {n} alarms set and {n} left"
        );
    });
}

/// Timeouts whose futures win, cancelled tasks and dropped sleeps: each
/// leaves its alarm, so the reaper wakes at most once at the old deadline,
/// finds nothing due, and then stays asleep while nothing is scheduled.
#[test]
fn entries_that_left_early_cost_at_most_one_wakeup_each_then_none() {
    paused_within(30, || async {
        let timer = Timer::new();
        settle().await;
        let woken = || timer.metrics().reaper_wakeups;
        for round in 0..30 {
            if round < 20 {
                // A request answering in 1 ms, under a 1 s timeout.
                let reply = timer
                    .timeout(secs(1), async {
                        tokio::time::sleep(ms(1)).await;
                        7
                    })
                    .await;
                assert_eq!(reply, Ok(7));
            } else {
                // A task cancelled and a sleep dropped, due at the same tick.
                let task = timer.schedule(secs(1), || {}).unwrap();
                settle().await;
                assert!(task.cancel());
                drop(timer.sleep(secs(1)));
            }
            assert_eq!(timer.len(), 0, "round {round}: nothing scheduled");
            let was = woken();
            advance(secs(2)).await;
            settle().await;
            assert!(
                woken() - was <= 1,
                "round {round}: {} wake-ups for the one alarm left",
                woken() - was
            );
            let was = woken();
            advance(secs(3600)).await;
            settle().await;
            assert_eq!(woken(), was, "round {round}: woke with nothing scheduled");
        }
        assert_eq!(timer.metrics().expired, 0);
    });
}

/// A tick below Tokio's millisecond: never early, late by less than one tick
/// plus Tokio's 2 ms, and each sleep costs at most the wake-up setting the
/// idle reaper's alarm and the one at its deadline.
#[test]
fn a_tick_below_a_millisecond_is_late_by_less_than_a_tick_and_tokios_2_ms() {
    paused_within(30, || async {
        for tick in [ns(1), ns(7), Duration::from_micros(100), ns(999_983)] {
            let timer = Timer::builder().tick(tick).build().unwrap();
            advance(ns(123_457)).await;
            for off in [ns(1), tick + ns(1), ms(1) + ns(1), ms(5) + ns(77), tick * 3] {
                settle().await;
                let was = timer.metrics().reaper_wakeups;
                let at = Instant::now() + off;
                timer.sleep_until(at).await.unwrap();
                let late = Instant::now() - at;
                assert!(Instant::now() >= at, "tick {tick:?} +{off:?}: early");
                assert!(
                    late < tick + TOKIO_SLACK,
                    "tick {tick:?} +{off:?}: late by {late:?}"
                );
                let woke = timer.metrics().reaper_wakeups - was;
                assert!(woke <= 2, "tick {tick:?} +{off:?}: {woke} wake-ups");
            }
        }
    });
}

/// A shared reaper serving timers of very different ticks (1 ns to 3 s) and
/// wheel shapes, tasks at random deadlines on, beside and off each grid, time
/// moved in odd steps: each runs exactly once, never early, late by less
/// than its own timer's tick plus Tokio's 2 ms.
#[test]
fn a_shared_reaper_keeps_each_timers_tick_under_odd_steps() {
    paused_within(120, || async {
        let mut rng = support::rng::Rng(0x7157);
        let ticks = [
            ns(1),
            ns(7),
            Duration::from_micros(999),
            Duration::from_micros(1_500),
            secs(3),
        ];
        for round in 0..4 {
            advance(ns(rng.below(9_999_999) + 1)).await;
            let reaper = Reaper::start().unwrap();
            let timers: Vec<Timer> = ticks
                .iter()
                .map(|&t| {
                    Timer::builder()
                        .tick(t)
                        .slots_per_level([2usize, 3, 64, 5, 8][rng.below(5) as usize])
                        .levels(1 + rng.below(4) as usize)
                        .reaper(&reaper)
                        .build()
                        .unwrap()
                })
                .collect();
            advance(ns(rng.below(999_999) + 1)).await;
            let start = Instant::now();
            let n = 150;
            let fired: Arc<Mutex<Vec<Vec<Instant>>>> = Arc::new(Mutex::new(vec![Vec::new(); n]));
            let mut entries = Vec::new();
            for i in 0..n {
                let ti = rng.below(ticks.len() as u64) as usize;
                let tick_ns = ticks[ti].as_nanos() as u64;
                let on_grid = ns((rng.below(30) * tick_ns).min(9_000_000_000));
                let off = match rng.below(5) {
                    0 => ns(rng.below(3_000_000)),
                    1 => on_grid,
                    2 => on_grid + ns(1),
                    3 => on_grid.saturating_sub(ns(1)),
                    _ => ns(rng.below(9_000_000_000)),
                };
                let at = start + off;
                let f = fired.clone();
                timers[ti]
                    .schedule_at(at, move || f.lock().unwrap()[i].push(Instant::now()))
                    .unwrap();
                entries.push((at, ti));
            }
            let last = entries.iter().map(|e| e.0).max().unwrap() + secs(3) + TOKIO_SLACK;
            let mut steps = 0;
            while Instant::now() <= last + ms(1) {
                steps += 1;
                assert!(steps < 40_000, "round {round}: time did not reach the end");
                let step = match rng.below(6) {
                    0 => ns(1),
                    1 => ns(999_999),
                    2 => ns(1_000_001),
                    3 => ns(rng.below(3_000_000) + 1),
                    4 => ns(rng.below(300_000_000) + 1),
                    _ => ns(rng.below(10_000) + 1),
                };
                advance(step).await;
                settle().await;
                let now = Instant::now();
                let f = fired.lock().unwrap();
                for (i, (at, ti)) in entries.iter().enumerate() {
                    let tick = ticks[*ti];
                    assert!(f[i].len() <= 1, "round {round}: #{i} ran twice");
                    match f[i].first() {
                        Some(ran) => assert!(
                            *ran >= *at,
                            "round {round}: #{i} (tick {tick:?}) ran {:?} early",
                            *at - *ran
                        ),
                        None => assert!(
                            now < *at + tick + TOKIO_SLACK,
                            "round {round}: #{i} (tick {tick:?}, due +{:?}) not run {:?} after",
                            *at - start,
                            now - *at
                        ),
                    }
                }
            }
            for t in &timers {
                assert!(t.is_empty(), "round {round}");
            }
            let expired: u64 = timers.iter().map(|t| t.metrics().expired).sum();
            assert_eq!(expired, n as u64);
            let samples: u64 = timers.iter().map(|t| t.lateness().count()).sum();
            assert_eq!(samples, n as u64, "one lateness sample per expiry");
        }
    });
}

/// Deadlines exactly on cascade boundaries (slots^k ticks from the origin,
/// the wheel's clock moved to an odd tick first), and 1 ns either side, with
/// odd ticks and shapes: nothing at 1 ns before, and then run late by less
/// than a tick plus Tokio's 2 ms (and the step time was moved by).
#[test]
fn deadlines_on_cascade_boundaries_with_odd_ticks() {
    paused_within(60, || async {
        for (tick, slots, levels) in [
            (ns(7), 4usize, 3usize),
            (Duration::from_micros(1_500), 3, 3),
            (Duration::from_micros(999), 2, 5),
            (ns(1), 64, 2),
        ] {
            let shape = format!("tick {tick:?} {slots}x{levels}");
            advance(ns(1_234_567)).await;
            let timer = Timer::builder()
                .tick(tick)
                .slots_per_level(slots)
                .levels(levels)
                .shards(1)
                .build()
                .unwrap();
            let origin = Instant::now();
            advance(tick * 5 + ns(3)).await;
            timer.sleep(Duration::ZERO).await.unwrap();
            let step = ns(997).max(tick / 3);
            let mut k = 1u32;
            for _ in 0..=levels + 1 {
                k = k.saturating_mul(slots as u32);
                for at in [
                    origin + tick * k - ns(1),
                    origin + tick * k,
                    origin + tick * k + ns(1),
                ] {
                    if at <= Instant::now() {
                        continue;
                    }
                    let hit = Arc::new(Mutex::new(None));
                    let h = hit.clone();
                    timer
                        .schedule_at(at, move || *h.lock().unwrap() = Some(Instant::now()))
                        .unwrap();
                    settle().await;
                    let now = Instant::now();
                    if at - now > ns(1) {
                        advance(at - now - ns(1)).await;
                        settle().await;
                        assert!(hit.lock().unwrap().is_none(), "{shape} k {k}: early");
                    }
                    advance(ns(1)).await;
                    settle().await;
                    let mut steps = 0;
                    while hit.lock().unwrap().is_none() {
                        steps += 1;
                        assert!(steps < 10_000, "{shape} k {k}: never ran");
                        advance(step).await;
                        settle().await;
                    }
                    let ran = hit.lock().unwrap().unwrap();
                    assert!(ran >= at, "{shape} k {k}: early by {:?}", at - ran);
                    assert!(
                        ran - at < tick + TOKIO_SLACK + step,
                        "{shape} k {k}: late by {:?}",
                        ran - at
                    );
                }
            }
        }
    });
}

/// Deadlines from an instant taken before the timer or purgatory was built,
/// with ticks that do not divide the offset: past ones (even by 1 ns) are
/// met at once, future ones (even by 1 ns) never early and late by less than
/// a tick plus Tokio's 2 ms.
#[test]
fn deadlines_from_instants_taken_before_the_build() {
    paused_within(30, || async {
        for tick in [ns(7), Duration::from_micros(1_500), secs(3), ns(999_983)] {
            let t0 = Instant::now();
            advance(ns(1_234_567)).await;
            let timer = Timer::builder().tick(tick).build().unwrap();
            let p: Purgatory<u32, Never> = Purgatory::builder().tick(tick).build().unwrap();
            advance(ns(11)).await;
            for off in [
                ns(0),
                ns(1_234_567),
                ns(1_234_567 + 11),
                ns(1_234_567 + 12),
                ms(5) + ns(3),
                tick * 2 + ns(1),
            ] {
                let check = |what: &str, at: Instant, now: Instant, done: Instant| {
                    assert!(done >= at, "tick {tick:?} +{off:?}: {what} early");
                    if at <= now {
                        assert_eq!(done, now, "tick {tick:?} +{off:?}: past {what} waited");
                    } else {
                        assert!(
                            done - at < tick + TOKIO_SLACK,
                            "tick {tick:?} +{off:?}: {what} late by {:?}",
                            done - at
                        );
                    }
                };
                // Measured from before the build, and as far from now.
                for at in [t0 + off, Instant::now() + off] {
                    let now = Instant::now();
                    timer.sleep_until(at).await.unwrap();
                    check("sleep", at, now, Instant::now());
                    let now = Instant::now();
                    let h = p.try_complete_else_watch_at(Never, at, [1]).unwrap();
                    let Ok(Completion::Expired(done)) = h.await else {
                        panic!("tick {tick:?} +{off:?}: the operation did not expire")
                    };
                    check("expiry", at, now, done);
                }
            }
        }
    });
}

/// Lateness samples, one per expiry, within what the docs say, for odd
/// ticks: deadlines already reached read late by at most a tick (the
/// histogram's microsecond at least); future ones by less than a tick plus
/// Tokio's 2 ms.
#[test]
fn lateness_samples_stay_within_the_documented_bound() {
    paused_within(30, || async {
        for tick in [ns(7), Duration::from_micros(1_500), secs(3), ns(999_983)] {
            let timer = Timer::builder().tick(tick).build().unwrap();
            advance(ns(1_234_567)).await;
            for _ in 0..5 {
                timer.sleep(Duration::ZERO).await.unwrap();
                timer.sleep_until(Instant::now() - secs(100)).await.unwrap();
                advance(ns(333_333)).await;
            }
            let past = timer.lateness();
            assert_eq!(past.count(), 10, "tick {tick:?}");
            assert!(
                past.max() <= tick.max(Duration::from_micros(1)),
                "tick {tick:?}: past deadlines read late by {:?}",
                past.max()
            );
            for off in [ns(1), ms(1) + ns(1), ms(5) + ns(77), tick + ns(1)] {
                timer.sleep(off).await.unwrap();
            }
            let all = timer.lateness();
            assert_eq!(all.count(), 14, "tick {tick:?}");
            assert!(
                all.max() < tick + TOKIO_SLACK,
                "tick {tick:?}: read late by {:?}",
                all.max()
            );
        }
    });
}

/// 300 tasks at one off-grid deadline over three shards, run one per batch:
/// all run, none early, none late past a tick plus Tokio's 2 ms, each counted
/// once with one lateness sample.
#[test]
fn many_tasks_at_one_off_grid_deadline_one_per_batch() {
    paused_within(30, || async {
        let tick = Duration::from_micros(1_500);
        let timer = Timer::builder()
            .tick(tick)
            .shards(3)
            .batch_size(1)
            .build()
            .unwrap();
        advance(ns(777)).await;
        let at = Instant::now() + ms(4) + ns(1);
        let ran = Arc::new(Mutex::new(Vec::new()));
        for _ in 0..300 {
            let ran = ran.clone();
            timer
                .schedule_at(at, move || ran.lock().unwrap().push(Instant::now()))
                .unwrap();
        }
        tokio::time::sleep_until(at + ms(10)).await;
        settle().await;
        let ran = ran.lock().unwrap().clone();
        assert_eq!(ran.len(), 300);
        for when in ran {
            assert!(when >= at, "early by {:?}", at - when);
            assert!(when - at < tick + TOKIO_SLACK, "late by {:?}", when - at);
        }
        assert_eq!(timer.metrics().expired, 300);
        assert_eq!(timer.lateness().count(), 300);
    });
}

/// Deadlines years out over tiny wheels with odd ticks, time jumped to 1 ns
/// before each and then on in odd steps: nothing early, each task and
/// operation met by its deadline plus a tick and Tokio's 2 ms.
#[test]
fn year_jumps_over_small_wheels_with_odd_ticks() {
    paused_within(60, || async {
        for (tick, slots, levels) in [
            (secs(3), 2usize, 1usize),
            (Duration::from_micros(1_500), 3, 2),
            (ns(7), 2, 3),
            (Duration::from_micros(999), 64, 1),
        ] {
            let shape = format!("tick {tick:?} {slots}x{levels}");
            advance(ns(987_654_321)).await;
            let timer = Timer::builder()
                .tick(tick)
                .slots_per_level(slots)
                .levels(levels)
                .build()
                .unwrap();
            let p: Purgatory<u32, Never> = Purgatory::builder()
                .tick(tick)
                .slots_per_level(slots)
                .levels(levels)
                .build()
                .unwrap();
            advance(ns(13)).await;
            let start = Instant::now();
            let offs = [
                YEAR * 3 + ns(1),
                YEAR * 3 + secs(7) + ns(5),
                YEAR * 7,
                YEAR * 7 - ns(1),
                secs(86_400 * 40) + ns(999),
            ];
            let fired = Arc::new(Mutex::new(vec![None; offs.len()]));
            let mut ops = Vec::new();
            for (i, off) in offs.iter().enumerate() {
                let f = fired.clone();
                timer
                    .schedule_at(start + *off, move || {
                        f.lock().unwrap()[i] = Some(Instant::now())
                    })
                    .unwrap();
                ops.push(
                    p.try_complete_else_watch_at(Never, start + *off, [i as u32])
                        .unwrap(),
                );
            }
            let mut order: Vec<(Duration, usize)> =
                offs.iter().enumerate().map(|(i, o)| (*o, i)).collect();
            order.sort();
            for (off, i) in order {
                let at = start + off;
                let now = Instant::now();
                if at > now + ns(1) {
                    advance(at - now - ns(1)).await;
                    settle().await;
                    assert!(fired.lock().unwrap()[i].is_none(), "{shape}: #{i} early");
                    assert!(!ops[i].is_finished(), "{shape}: operation #{i} early");
                }
                let bound = at + tick + TOKIO_SLACK;
                let step = ns(333_333).max(tick / 50);
                while Instant::now() < bound {
                    advance(step.min(bound - Instant::now())).await;
                    settle().await;
                }
                let ran = fired.lock().unwrap()[i]
                    .unwrap_or_else(|| panic!("{shape}: #{i} (+{off:?}) not run by its bound"));
                assert!(ran >= at, "{shape}: #{i} early");
                assert!(ops[i].is_finished(), "{shape}: operation #{i} not expired");
            }
            for (i, op) in ops.into_iter().enumerate() {
                let Ok(Completion::Expired(done)) = op.await else {
                    panic!("{shape}: operation #{i} did not expire")
                };
                assert!(done >= start + offs[i], "{shape}: operation #{i} early");
            }
            assert_eq!(timer.lateness().count(), offs.len() as u64);
            assert_eq!(p.lateness().count(), offs.len() as u64);
        }
    });
}

/// Repeating tasks whose period is below the tick or not a multiple of it:
/// each run never early and late by less than a tick plus Tokio's 2 ms after
/// the previous run plus the period, one wake-up per run (and one to set the
/// idle reaper's alarm).
#[test]
fn repeating_periods_below_and_off_the_tick() {
    paused_within(30, || async {
        for (tick, period) in [
            (ms(3), ms(1)),
            (ms(3), Duration::from_micros(4_500)),
            (ns(7), ns(1)),
            (ns(7), ns(10)),
            (Duration::from_micros(1_500), ms(1)),
            (secs(3), ms(100)),
        ] {
            let timer = Timer::builder().tick(tick).build().unwrap();
            advance(ns(4_321)).await;
            let runs = Arc::new(Mutex::new(Vec::new()));
            let r = runs.clone();
            let start = Instant::now();
            let before = timer.metrics().reaper_wakeups;
            let h = timer
                .schedule_repeating(period, move || {
                    let mut r = r.lock().unwrap();
                    r.push(Instant::now());
                    (r.len() < 30).then_some(period)
                })
                .unwrap();
            tokio::time::sleep(secs(200)).await;
            let runs = runs.lock().unwrap().clone();
            assert_eq!(runs.len(), 30, "tick {tick:?} period {period:?}");
            let mut prev = start;
            for (i, at) in runs.iter().enumerate() {
                let due = prev + period;
                assert!(
                    *at >= due,
                    "tick {tick:?} period {period:?}: run {i} early by {:?}",
                    due - *at
                );
                assert!(
                    *at - due < tick + TOKIO_SLACK,
                    "tick {tick:?} period {period:?}: run {i} late by {:?}",
                    *at - due
                );
                prev = *at;
            }
            let woke = timer.metrics().reaper_wakeups - before;
            assert!(
                woke <= 31,
                "tick {tick:?} period {period:?}: {woke} wake-ups for 30 runs"
            );
            assert!(!h.cancel(), "the chain ended");
        }
    });
}

/// `Timer::timeout_at` with a future ready exactly at the deadline: the
/// inner future is polled first, so it wins; a future never ready elapses,
/// never before the deadline and late by less than a tick plus Tokio's 2 ms.
#[test]
fn a_future_ready_at_the_timeouts_deadline_wins() {
    paused_within(30, || async {
        for tick in [ns(7), Duration::from_micros(1_500), secs(3)] {
            let timer = Timer::builder().tick(tick).build().unwrap();
            advance(ns(1_111)).await;
            let at = Instant::now() + ms(5) + ns(3);
            let r = timer.timeout_at(at, tokio::time::sleep_until(at)).await;
            assert_eq!(r, Ok(()), "tick {tick:?}: the ready future lost");
            assert!(Instant::now() >= at);
            let at = Instant::now() + ms(5) + ns(3);
            let r = timer.timeout_at(at, std::future::pending::<()>()).await;
            assert_eq!(r, Err(TimeoutError::Elapsed), "tick {tick:?}");
            let late = Instant::now() - at;
            assert!(Instant::now() >= at, "tick {tick:?}: elapsed early");
            assert!(late < tick + TOKIO_SLACK, "tick {tick:?}: late by {late:?}");
        }
    });
}

/// Entries spread over every wheel level (and past the top of small wheels),
/// scheduled earliest first with odd ticks, time moved by Tokio's
/// auto-advance: each runs once, never early, and the reaper wakes once per
/// distinct due time, plus once to set its alarm for the first.
#[test]
fn one_wakeup_per_distinct_due_time_across_levels() {
    paused_within(30, || async {
        for (tick, slots, levels) in [
            (Duration::from_micros(1_500), 3usize, 2usize),
            (Duration::from_micros(1_500), 64, 6),
            (ms(3), 2, 3),
            (secs(3), 2, 1),
            (Duration::from_micros(999), 5, 4),
        ] {
            let shape = format!("tick {tick:?} {slots}x{levels}");
            let timer = Timer::builder()
                .tick(tick)
                .slots_per_level(slots)
                .levels(levels)
                .build()
                .unwrap();
            advance(ns(777_777)).await;
            settle().await;
            let start = Instant::now();
            let mut offs: Vec<Duration> = Vec::new();
            let mut k = 1u32;
            while offs.len() < 25 {
                offs.push(tick * k + ns(u64::from(k) * 13));
                k = k * 2 + 1;
            }
            let early = Arc::new(AtomicUsize::new(0));
            let n = Arc::new(AtomicUsize::new(0));
            let before = timer.metrics().reaper_wakeups;
            for off in &offs {
                let at = start + *off;
                let (n, early) = (n.clone(), early.clone());
                timer
                    .schedule_at(at, move || {
                        if Instant::now() < at {
                            early.fetch_add(1, Ordering::SeqCst);
                        }
                        n.fetch_add(1, Ordering::SeqCst);
                    })
                    .unwrap();
            }
            let last = start + *offs.last().unwrap() + tick + TOKIO_SLACK;
            tokio::time::sleep_until(last).await;
            settle().await;
            assert_eq!(n.load(Ordering::SeqCst), offs.len(), "{shape}");
            assert_eq!(early.load(Ordering::SeqCst), 0, "{shape}: early");
            let woke = timer.metrics().reaper_wakeups - before;
            assert!(
                woke <= offs.len() as u64 + 1,
                "{shape}: {woke} wake-ups for {} distinct due times",
                offs.len()
            );
        }
    });
}

/// Wheels spanning up to 2^61 ticks and deadlines decades out (past the top
/// level of the narrower ones), jumped to 1 ns before and then on: nothing
/// early, each met by its deadline plus a tick and Tokio's 2 ms.
#[test]
fn far_deadlines_over_wheels_of_huge_span() {
    paused_within(30, || async {
        for (tick, slots, levels, off) in [
            (ns(1), 2usize, 61usize, YEAR * 100 + ns(3)),
            (ns(1), 64, 10, YEAR * 150 + ns(1)),
            (ns(7), 3, 39, YEAR * 200 + ns(11)),
            (Duration::from_micros(1_500), 2, 61, YEAR * 400 + ns(1)),
            (ns(1), 2, 61, YEAR * 36 + ns(5)),
        ] {
            let shape = format!("tick {tick:?} {slots}x{levels} +{off:?}");
            let timer = Timer::builder()
                .tick(tick)
                .slots_per_level(slots)
                .levels(levels)
                .build()
                .unwrap();
            advance(ns(999_999_937)).await;
            let at = Instant::now() + off;
            let hit = Arc::new(Mutex::new(None));
            let h = hit.clone();
            timer
                .schedule_at(at, move || *h.lock().unwrap() = Some(Instant::now()))
                .unwrap();
            let sleep = timer.sleep_until(at);
            settle().await;
            advance(at - Instant::now() - ns(1)).await;
            settle().await;
            assert!(hit.lock().unwrap().is_none(), "{shape}: early");
            assert!(!sleep.is_elapsed(), "{shape}: sleep early");
            advance(ns(1)).await;
            settle().await;
            step_by(ms(1), 2 + (tick.as_nanos() / 1_000_000) as u64).await;
            let ran = hit.lock().unwrap().expect("ran by its bound");
            assert!(ran >= at, "{shape}: early");
            assert!(
                ran - at < tick + TOKIO_SLACK,
                "{shape}: late by {:?}",
                ran - at
            );
            assert!(sleep.is_elapsed(), "{shape}: sleep not elapsed");
        }
    });
}

/// "An entry due before everything else pending wakes a sleeping reaper
/// once more": several entries already due, put in before the reaper has
/// run, wake it once between them, not once each (the first claims the
/// turn; the rest lower the target silently). A timer's tasks at a past
/// instant, and a purgatory's operations with past deadlines.
#[tokio::test(start_paused = true)]
async fn entries_already_due_before_the_reaper_runs_cost_one_wakeup() {
    let timer = Timer::new();
    let p: Purgatory<u32, FlagOp> = Purgatory::new();
    settle().await;
    advance(ms(10)).await;
    let (t0, p0) = (timer.metrics().reaper_wakeups, p.metrics().reaper_wakeups);
    let past = Instant::now() - ms(5);
    for _ in 0..3 {
        timer.schedule_at(past, || {}).unwrap();
    }
    for k in 0..3 {
        p.try_complete_else_watch_at(FlagOp(Arc::new(AtomicBool::new(false))), past, [k])
            .unwrap()
            .detach();
    }
    settle().await;
    let (tm, pm) = (timer.metrics(), p.metrics());
    assert_eq!((tm.expired, pm.expired), (3, 3));
    assert_eq!(tm.reaper_wakeups - t0, 1, "{tm:?}");
    assert_eq!(pm.reaper_wakeups - p0, 1, "{pm:?}");
}

/// The same between the turns a reaper takes at once (a batch cut short):
/// entries already due, put in while it lets other tasks run before its
/// next turn, add no wake-up; that turn takes them.
#[tokio::test(start_paused = true)]
async fn entries_due_put_in_between_turns_taken_at_once_cost_no_wakeup() {
    let timer = Timer::builder().batch_size(1).build().unwrap();
    settle().await;
    advance(ms(10)).await;
    let w0 = timer.metrics().reaper_wakeups;
    let past = Instant::now() - ms(5);
    for _ in 0..4 {
        timer.schedule_at(past, || {}).unwrap();
    }
    // The reaper takes one a turn, yielding between: each of these goes in
    // between two of its turns.
    for _ in 0..4 {
        tokio::task::yield_now().await;
        timer.schedule_at(past, || {}).unwrap();
    }
    settle().await;
    let m = timer.metrics();
    assert_eq!(m.expired, 8);
    assert_eq!(m.reaper_wakeups - w0, 1, "{m:?}");
}
