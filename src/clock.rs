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

/// Ticks since an origin, in whole ticks of `tick_ns` nanoseconds.
#[derive(Debug)]
pub(crate) struct Clock {
    origin: Instant,
    tick_ns: u64,
}

impl Clock {
    pub(crate) fn new(origin: Instant, tick: Duration) -> Clock {
        let tick_ns = u64::try_from(tick.as_nanos()).unwrap_or(u64::MAX).max(1);
        Clock { origin, tick_ns }
    }

    fn nanos_since_origin(&self, t: Instant) -> u64 {
        // Whole seconds and nanoseconds separately: no u128 division on the hot path.
        let d = t.saturating_duration_since(self.origin);
        d.as_secs()
            .saturating_mul(1_000_000_000)
            .saturating_add(d.subsec_nanos() as u64)
    }

    /// The tick a deadline falls due in: rounded up, so it is never early.
    /// Saturates at `u64::MAX` ("never").
    pub(crate) fn deadline_tick(&self, deadline: Instant) -> u64 {
        let ns = self.nanos_since_origin(deadline);
        if ns == u64::MAX {
            return u64::MAX;
        }
        ns.div_ceil(self.tick_ns)
    }

    /// The tick an entry inserted at `now` with `deadline` is due in: rounded up
    /// (never early), except that a deadline already reached is due in `now`'s
    /// own tick, so it runs on the reaper's next turn instead of waiting for the
    /// next tick boundary.
    pub(crate) fn tick_for(&self, now: Instant, deadline: Instant) -> u64 {
        if deadline <= now {
            self.now_tick(now)
        } else {
            self.deadline_tick(deadline)
        }
    }

    /// The last whole tick that has passed at `now`.
    pub(crate) fn now_tick(&self, now: Instant) -> u64 {
        self.nanos_since_origin(now) / self.tick_ns
    }

    /// The instant tick `t` begins, or `None` when it is beyond what `Instant` holds.
    pub(crate) fn instant_of(&self, t: u64) -> Option<Instant> {
        let ns = t.checked_mul(self.tick_ns)?;
        self.origin.checked_add(Duration::from_nanos(ns))
    }
}

/// The deadline `delay` after `now`, saturating instead of overflowing.
pub(crate) fn deadline_after(now: Instant, delay: Duration) -> Instant {
    now.checked_add(delay).unwrap_or_else(|| far_future(now))
}

/// An instant later than any deadline the wheel can reach (about 30 years on).
pub(crate) fn far_future(now: Instant) -> Instant {
    const THIRTY_YEARS: Duration = Duration::from_secs(86_400 * 365 * 30);
    now.checked_add(THIRTY_YEARS).unwrap_or(now)
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

    #[test]
    fn far_deadlines_saturate() {
        let (o, c) = clock();
        let far = deadline_after(o, Duration::MAX);
        assert!(far > o + Duration::from_secs(86_400 * 365 * 29));
        assert!(c.deadline_tick(far) > 0);
        assert_eq!(c.instant_of(u64::MAX), None);
        assert_eq!(c.instant_of(5), Some(o + Duration::from_millis(5)));
        let fine = Clock::new(o, Duration::ZERO);
        assert_eq!(
            fine.deadline_tick(o + Duration::from_nanos(7)),
            7,
            "a zero tick counts as 1 ns"
        );
    }
}
