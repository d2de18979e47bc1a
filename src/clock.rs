//! The clock: Tokio instants to wheel ticks and back, in one small room (as
//! tokio's `runtime/time/source.rs`), with the one saturating place for
//! `Instant + Duration`.
//!
//! Ticks count whole `tick`s since an origin (the core's start). A deadline rounds
//! **up** to its tick, so nothing fires early; "now" rounds **down** to the last
//! tick that has passed. A deadline already reached maps to now's tick, so it is
//! due on the reaper's next turn rather than at the next tick boundary. Deadlines
//! past what `Instant` can hold saturate to about 30 years, never overflow.

use std::time::Duration;

use tokio::time::Instant;

/// The last tick the clock counts: about 2^63 ticks after its origin (292
/// years at a 1 ns tick, 29 million years at the default 100 µs), the last
/// below the reaper's wake target's "nothing scheduled" (its top bit is a
/// flag). A deadline past it never falls due, and "now" stops there: what
/// was due by then still runs, and nothing is ever early.
pub(crate) const HORIZON: u64 = crate::wake::NEVER - 1;

/// Ticks since an origin, in whole ticks of `tick_ns` nanoseconds.
#[derive(Debug)]
pub(crate) struct Clock {
    origin: Instant,
    tick_ns: u64,
    /// When a tick divides a second: ticks per second, and the reciprocal that
    /// divides a second's nanoseconds by the tick without a `div` instruction
    /// (every schedule divides twice, and a 64-bit `div` costs tens of cycles).
    split: Option<Split>,
}

#[derive(Debug, Clone, Copy)]
struct Split {
    per_sec: u64,
    /// `ceil(2^64 / tick_ns)`: `(n * recip) >> 64 == n / tick_ns` for every
    /// `n < 2^32` (the error, below `n / 2^64 < 2^-32`, is less than the
    /// `1 / tick_ns` that separates `n / tick_ns` from the next integer, as
    /// `tick_ns < 2^32`).
    recip: u64,
}

impl Split {
    fn new(tick_ns: u64) -> Option<Split> {
        (tick_ns > 1 && 1_000_000_000 % tick_ns == 0).then(|| Split {
            per_sec: 1_000_000_000 / tick_ns,
            recip: u64::MAX / tick_ns + 1,
        })
    }

    /// `n / tick_ns`, for `n < 2^32`.
    #[inline]
    fn div(self, n: u32) -> u64 {
        ((n as u128 * self.recip as u128) >> 64) as u64
    }
}

impl Clock {
    pub(crate) fn new(origin: Instant, tick: Duration) -> Clock {
        let tick_ns = u64::try_from(tick.as_nanos()).unwrap_or(u64::MAX).max(1);
        Clock {
            origin,
            tick_ns,
            split: Split::new(tick_ns),
        }
    }

    /// Whole ticks in `d`, rounded up when `up`; saturates at `u64::MAX`.
    #[inline]
    fn ticks(&self, d: Duration, up: bool) -> u64 {
        if let Some(split) = self.split {
            // A second is a whole number of ticks: divide only the part below a
            // second (below 2^31 even when rounding up), by the reciprocal.
            let sub = d.subsec_nanos() + if up { self.tick_ns as u32 - 1 } else { 0 };
            return d
                .as_secs()
                .saturating_mul(split.per_sec)
                .saturating_add(split.div(sub));
        }
        // Whole seconds and nanoseconds separately: no u128 division while
        // the nanoseconds fit in 64 bits (584 years).
        let ns = d
            .as_secs()
            .checked_mul(1_000_000_000)
            .and_then(|s| s.checked_add(d.subsec_nanos() as u64));
        match ns {
            Some(ns) if up => ns.div_ceil(self.tick_ns),
            Some(ns) => ns / self.tick_ns,
            None => {
                let (ns, tick) = (d.as_nanos(), u128::from(self.tick_ns));
                let t = if up { ns.div_ceil(tick) } else { ns / tick };
                u64::try_from(t).unwrap_or(u64::MAX)
            }
        }
    }

    /// The tick a deadline falls due in: rounded up, so it is never early.
    /// A deadline past the [`HORIZON`] is "never" (`u64::MAX`).
    #[inline]
    pub(crate) fn deadline_tick(&self, deadline: Instant) -> u64 {
        let t = self.ticks(deadline.saturating_duration_since(self.origin), true);
        if t > HORIZON {
            u64::MAX
        } else {
            t
        }
    }

    /// The tick an entry inserted at `now` with `deadline` is due in: rounded up
    /// (never early), except that a deadline already reached is due in `now`'s
    /// own tick, so it runs on the reaper's next turn instead of waiting for the
    /// next tick boundary.
    #[inline]
    pub(crate) fn tick_for(&self, now: Instant, deadline: Instant) -> u64 {
        if deadline <= now {
            self.now_tick(now)
        } else {
            self.deadline_tick(deadline)
        }
    }

    /// The last whole tick that has passed at `now`; it stops at the
    /// [`HORIZON`].
    #[inline]
    pub(crate) fn now_tick(&self, now: Instant) -> u64 {
        self.ticks(now.saturating_duration_since(self.origin), false)
            .min(HORIZON)
    }

    /// The instant tick `t` begins, or `None` when it is beyond what `Instant` holds.
    pub(crate) fn instant_of(&self, t: u64) -> Option<Instant> {
        let since = match t.checked_mul(self.tick_ns) {
            Some(ns) => Duration::from_nanos(ns),
            None => {
                let ns = u128::from(t) * u128::from(self.tick_ns);
                Duration::new(
                    u64::try_from(ns / 1_000_000_000).ok()?,
                    (ns % 1_000_000_000) as u32,
                )
            }
        };
        self.origin.checked_add(since)
    }
}

/// The deadline `delay` after `now`, saturating instead of overflowing.
pub(crate) fn deadline_after(now: Instant, delay: Duration) -> Instant {
    now.checked_add(delay).unwrap_or_else(|| far_future(now))
}

/// An instant later than any deadline the wheel can reach (about 30 years
/// on), or, on a clock that cannot hold that, the latest it holds: `now`
/// itself (which would make a "never" due at once) only when `now` is
/// already the latest instant the clock can hold.
pub(crate) fn far_future(now: Instant) -> Instant {
    const THIRTY_YEARS: Duration = Duration::from_secs(86_400 * 365 * 30);
    let mut step = THIRTY_YEARS;
    let mut far = now;
    while !step.is_zero() {
        match far.checked_add(step) {
            Some(later) => far = later,
            None => step /= 2,
        }
        if far - now >= THIRTY_YEARS {
            break;
        }
    }
    far
}

#[cfg(all(test, not(purgatory_loom)))]
mod tests {
    use super::*;

    fn clock() -> (Instant, Clock) {
        let origin = Instant::now();
        (origin, Clock::new(origin, Duration::from_millis(1)))
    }

    #[test]
    fn deadlines_round_up_and_now_rounds_down() {
        let (o, c) = clock();
        let us = Duration::from_micros;
        assert_eq!(c.deadline_tick(o), 0);
        assert_eq!(c.deadline_tick(o + us(1)), 1);
        assert_eq!(c.deadline_tick(o + us(1000)), 1);
        assert_eq!(c.deadline_tick(o + us(1001)), 2);
        assert_eq!(c.now_tick(o + us(999)), 0);
        assert_eq!(c.now_tick(o + us(1000)), 1);
        assert_eq!(c.now_tick(o + us(1999)), 1);
    }

    #[test]
    fn a_deadline_already_reached_is_due_in_nows_tick() {
        let (o, c) = clock();
        let now = o + Duration::from_micros(1300);
        assert_eq!(c.tick_for(now, now), 1, "zero delay");
        assert_eq!(c.tick_for(now, o), 1, "in the past");
        assert_eq!(
            c.tick_for(now, now + Duration::from_micros(1)),
            2,
            "future: rounded up"
        );
    }

    /// The reciprocal path (a tick dividing a second) agrees with plain
    /// division for every tick shape, rounding either way.
    #[test]
    fn reciprocal_division_matches_plain_division() {
        let mut rng = crate::test_rng::Rng(7);
        let ticks = [
            2,
            3,
            7,
            1_000,
            999_983,
            1_000_000,
            1_953_125,
            500_000_000,
            1_000_000_000,
            1_500_000,
        ];
        for tick_ns in ticks {
            let (o, _) = clock();
            let c = Clock::new(o, Duration::from_nanos(tick_ns));
            assert_eq!(
                c.split.is_some(),
                1_000_000_000 % tick_ns == 0,
                "tick {tick_ns}"
            );
            let mut cases: Vec<u64> = vec![
                0,
                1,
                tick_ns - 1,
                tick_ns,
                tick_ns + 1,
                999_999_999,
                1_000_000_000,
            ];
            cases.extend((0..2_000).map(|_| rng.next() % 5_000_000_000));
            cases.extend((0..200).map(|_| rng.next() % 1_000_000_000 / tick_ns * tick_ns));
            for ns in cases {
                let d = Duration::from_nanos(ns);
                assert_eq!(c.ticks(d, false), ns / tick_ns, "{ns} ns / {tick_ns}");
                assert_eq!(
                    c.ticks(d, true),
                    ns.div_ceil(tick_ns),
                    "{ns} ns / {tick_ns} up"
                );
            }
            assert_eq!(c.ticks(Duration::MAX, true), u64::MAX, "saturates");
            assert_eq!(c.ticks(Duration::MAX, false), u64::MAX, "saturates");
        }
    }

    /// Past 2^64 ns (584 years) after the origin, ticks that do not divide
    /// a second still count exactly: a deadline an hour after "now" is an
    /// hour of ticks after it, not the same saturated tick.
    #[test]
    fn ticks_past_584_years_stay_exact() {
        let o = Instant::now();
        let year = Duration::from_secs(365 * 86_400);
        let c = Clock::new(o, Duration::from_millis(3));
        let now = o + year * 585;
        let t = c.now_tick(now);
        assert_eq!(u128::from(t), (year * 585).as_nanos() / 3_000_000);
        assert_eq!(
            c.deadline_tick(now + Duration::from_secs(3600)),
            t + 1_200_000
        );
        assert!(c
            .instant_of(t)
            .is_some_and(|at| at <= now && now - at < Duration::from_millis(3)));
    }

    /// At a 1 ns tick the clock counts up to its horizon (292 years): a
    /// deadline past it is "never", and "now" stops there.
    #[test]
    fn the_horizon_bounds_ticks() {
        let o = Instant::now();
        let year = Duration::from_secs(365 * 86_400);
        let c = Clock::new(o, Duration::from_nanos(1));
        let before = o + year * 250;
        assert_eq!(u128::from(c.deadline_tick(before)), (year * 250).as_nanos());
        assert_eq!(c.now_tick(before), c.deadline_tick(before));
        assert_eq!(c.deadline_tick(o + year * 300), u64::MAX);
        assert_eq!(c.now_tick(o + year * 300), HORIZON);
        assert_eq!(
            c.tick_for(o + year * 300, o + year * 299),
            HORIZON,
            "due at once"
        );
    }

    #[test]
    fn far_deadlines_saturate() {
        let (o, c) = clock();
        let far = deadline_after(o, Duration::MAX);
        assert!(far > o + Duration::from_secs(86_400 * 365 * 29));
        assert!(c.deadline_tick(far) > 0);
        assert_eq!(
            c.instant_of(u64::MAX),
            Some(o + Duration::from_millis(u64::MAX)),
            "past 2^64 ns, exact"
        );
        assert_eq!(c.instant_of(5), Some(o + Duration::from_millis(5)));
        let huge = Clock::new(o, Duration::MAX);
        assert_eq!(huge.instant_of(u64::MAX), None, "past what Instant holds");
        let fine = Clock::new(o, Duration::ZERO);
        assert_eq!(
            fine.deadline_tick(o + Duration::from_nanos(7)),
            7,
            "a zero tick counts as 1 ns"
        );
    }
}
