//! Deadlines given as instants off the tick grid, on paused Tokio time:
//! seeded sweeps of `try_complete_else_watch_at` and its levels form,
//! `try_complete_else_watch_levels_at`, with deadlines up to a quarter of
//! the span in the past and up to twelve ticks ahead, forty pending at once
//! while time moves in odd steps, over ticks from 1 ns to 3 s (ticks that
//! do not divide a second among them) and wheels of 2 slots by 20 levels,
//! 3 by 3 and 64 by 3, each built on a clock moved off the grid first. It
//! holds the crate to "Never early": "Nothing expires before its deadline.
//! Deadlines are rounded up to the tick ..., so expiry is late by less than
//! one tick plus the time the reaper waits to be scheduled (... adds up to
//! 2 ms more). A deadline already reached (a zero timeout, a past instant)
//! runs on the reaper's next turn": each operation expires at or after its
//! deadline, late by less than a tick plus 2 ms, and one whose deadline had
//! passed when it registered with no time passing.

use std::time::Duration;

use tokio::time::{advance, sleep, Instant};
use tokio_purgatory::{Completion, Operation, Purgatory, Watch};

mod support;
use support::rng::Rng;

fn ns(n: u64) -> Duration {
    Duration::from_nanos(n)
}

/// The slack the docs allow beyond one tick: "Tokio's own timer ... adds up to 2 ms".
const TOKIO_SLACK: Duration = Duration::from_millis(2);

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

/// For 12 seeds, every tick and wheel shape: 40 operations registered at
/// instants off the grid (every other one at a level), some already past,
/// with odd sleeps between the registrations. Each expires never early and
/// late by less than a tick plus Tokio's 2 ms after its deadline, or, when
/// that deadline had passed, with no time passing after its registration.
#[tokio::test(start_paused = true)]
async fn off_grid_instants_over_odd_ticks_and_small_wheels() {
    let ticks = [
        ns(1),
        ns(3),
        ns(1_001),
        Duration::from_micros(333),
        Duration::from_millis(7),
        ns(999_999_999),
        Duration::from_millis(1_500),
        Duration::from_secs(3),
    ];
    for seed in 1..=12u64 {
        let mut rng = Rng(0x5eed ^ seed);
        for tick in ticks {
            for (slots, levels) in [(2, 20), (3, 3), (64, 3)] {
                let what = format!("seed {seed}, tick {tick:?}, {slots} x {levels}");
                // The clock off the grid before the build.
                advance(ns(1 + rng.below(1_000_000_007))).await;
                let p: Purgatory<u32, Never> = Purgatory::builder()
                    .tick(tick)
                    .slots_per_level(slots)
                    .levels(levels)
                    .build()
                    .unwrap();
                let tick_ns = tick.as_nanos() as u64;
                let span = (tick_ns * 12).min(20_000_000_000);
                let mut waits = Vec::new();
                for i in 0..40u32 {
                    let now = Instant::now();
                    let off = rng.below(span) as i64 - (span / 4) as i64;
                    let deadline = if off < 0 {
                        now.checked_sub(ns(off.unsigned_abs())).unwrap_or(now)
                    } else {
                        now + ns(off as u64)
                    };
                    let h = if i % 2 == 0 {
                        p.try_complete_else_watch_at(Never, deadline, [i])
                    } else {
                        p.try_complete_else_watch_levels_at(Never, deadline, [Watch::level(i, 5)])
                    }
                    .unwrap();
                    waits.push(tokio::spawn(async move { (now, deadline, h.await) }));
                    if rng.below(3) == 0 {
                        sleep(ns(rng.below(tick_ns.min(3_000_000_000)))).await;
                    }
                }
                for w in waits {
                    let (registered, deadline, out) = w.await.unwrap();
                    let Ok(Completion::Expired(fired)) = out else {
                        panic!("{what}: {out:?}")
                    };
                    assert!(
                        fired >= deadline,
                        "{what}: early (deadline {deadline:?}, fired {fired:?})"
                    );
                    if deadline <= registered {
                        assert_eq!(
                            fired, registered,
                            "{what}: a deadline already passed waited"
                        );
                    } else {
                        assert!(
                            fired - deadline < tick + TOKIO_SLACK,
                            "{what}: late by {:?}",
                            fired - deadline
                        );
                    }
                }
                drop(p.shutdown());
            }
        }
    }
}
