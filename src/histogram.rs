//! A histogram of durations in fixed log-scaled buckets: recording is a few
//! instructions, a relaxed atomic add, a compare-and-swap and a load, nothing allocates after it is
//! built, and its memory is fixed (about 2.5 KiB).
//!
//! Buckets are microseconds: 0 to 7 µs exactly, then eight buckets per power of
//! two (so a bucket's width is at most 1/8 of its lower bound: quantiles are
//! within 12.5% above the true value) up to 2^40 µs (about 12.7 days), and one
//! bucket for everything longer (recorded as at most about 35 years).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Buckets per power of two, and the exact buckets below the first power.
const SUB: u64 = 8;
/// The largest power of two with buckets of its own.
const TOP: u64 = 40;
/// The exact buckets, eight per power of two from 2^3 to 2^39, and one for
/// everything from 2^40 µs on.
const BUCKETS: usize = (SUB + (TOP - 3) * SUB + 1) as usize;

/// The largest duration recorded, in µs (about 35 years): longer ones are
/// recorded as this.
const CAP: u64 = 1 << 50;

/// The bucket of `us` microseconds.
fn bucket_of(us: u64) -> usize {
    if us < SUB {
        return us as usize;
    }
    let exp = (63 - us.leading_zeros() as u64).min(TOP);
    if exp >= TOP {
        return BUCKETS - 1;
    }
    let sub = (us >> (exp - 3)) & (SUB - 1);
    (SUB + (exp - 3) * SUB + sub) as usize
}

/// The largest value (in µs) bucket `i` holds.
fn upper_of(i: usize) -> u64 {
    if i == BUCKETS - 1 {
        return CAP;
    }
    let i = i as u64;
    if i < SUB {
        return i;
    }
    let exp = 3 + (i - SUB) / SUB;
    let sub = (i - SUB) % SUB;
    ((SUB + sub) << (exp - 3)) + (1 << (exp - 3)) - 1
}

/// Where durations are recorded (shared by the threads that record).
#[derive(Debug)]
pub(crate) struct Recorder {
    buckets: Box<[AtomicU64]>,
    sum_us: AtomicU64,
    max_us: AtomicU64,
}

impl Default for Recorder {
    fn default() -> Self {
        Recorder {
            buckets: (0..BUCKETS).map(|_| AtomicU64::new(0)).collect(),
            sum_us: AtomicU64::new(0),
            max_us: AtomicU64::new(0),
        }
    }
}

impl Recorder {
    /// Records one duration.
    pub(crate) fn record(&self, d: Duration) {
        let us = u64::try_from(d.as_micros()).unwrap_or(CAP).min(CAP);
        self.buckets[bucket_of(us)].fetch_add(1, Ordering::Relaxed);
        // Saturating: a sum past u64::MAX µs (585,000 years) stays there.
        let _ = self
            .sum_us
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |s| {
                Some(s.saturating_add(us))
            });
        if us > self.max_us.load(Ordering::Relaxed) {
            self.max_us.fetch_max(us, Ordering::Relaxed);
        }
    }

    /// What has been recorded so far. Taken while others record, it may count
    /// a sample in one field and not yet in another.
    pub(crate) fn snapshot(&self) -> Histogram {
        Histogram {
            counts: self
                .buckets
                .iter()
                .map(|b| b.load(Ordering::Relaxed))
                .collect(),
            sum_us: self.sum_us.load(Ordering::Relaxed),
            max_us: self.max_us.load(Ordering::Relaxed),
        }
    }
}

/// A snapshot of a distribution of durations (how late timeouts fired), in
/// fixed log-scaled buckets: exact below 8 µs, then eight buckets per power of
/// two up to about 12.7 days, and one for anything longer. A quantile is the
/// upper bound of the bucket that holds it (at most the largest sample), so
/// it is never below the true value and at most 12.5% above it (plus under
/// 1 µs of rounding; in the last bucket, at most the largest sample).
///
/// A snapshot is a value of its own and does not change. Taken while the reaper
/// records, it may count a sample in one figure and not yet in another (in
/// [`count`](Histogram::count) but not yet in [`sum`](Histogram::sum) or
/// [`max`](Histogram::max)).
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
/// use std::time::Duration;
/// use tokio_purgatory::{Operation, Purgatory};
///
/// struct Wait;
/// impl Operation for Wait {
///     type Output = ();
///     fn try_complete(&mut self) -> Option<()> { None }
///     fn on_expiration(self) {}
/// }
///
/// let purgatory: Purgatory<u32, Wait> = Purgatory::new();
/// let handle = purgatory.try_complete_else_watch(Wait, Duration::from_millis(5), [1]).unwrap();
/// handle.await.unwrap();
/// let lateness = purgatory.lateness();
/// assert_eq!(lateness.count(), 1);
/// assert!(lateness.quantile(0.99) <= Duration::from_millis(2));
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Histogram {
    counts: Box<[u64]>,
    sum_us: u64,
    max_us: u64,
}

impl Default for Histogram {
    fn default() -> Self {
        Recorder::default().snapshot()
    }
}

impl Histogram {
    /// Samples recorded.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// use std::time::Duration;
    ///
    /// let timer = tokio_purgatory::Timer::new();
    /// for _ in 0..3 {
    ///     timer.sleep(Duration::from_millis(5)).await.unwrap();
    /// }
    /// assert_eq!(timer.lateness().count(), 3);
    /// # }
    /// ```
    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// Whether nothing was recorded.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// use std::time::Duration;
    ///
    /// let timer = tokio_purgatory::Timer::new();
    /// assert!(timer.lateness().is_empty());
    /// timer.sleep(Duration::from_millis(5)).await.unwrap();
    /// assert!(!timer.lateness().is_empty());
    /// # }
    /// ```
    pub fn is_empty(&self) -> bool {
        self.count() == 0
    }

    /// The largest sample (to the microsecond), zero when there are none.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// # use std::time::Duration;
    /// # let timer = tokio_purgatory::Timer::new();
    /// # for _ in 0..3 { timer.sleep(Duration::from_millis(5)).await.unwrap(); }
    /// let lateness = timer.lateness();
    /// // The top quantile is the largest sample.
    /// assert_eq!(lateness.quantile(1.0), lateness.max());
    /// # }
    /// ```
    pub fn max(&self) -> Duration {
        Duration::from_micros(self.max_us)
    }

    /// The sum of all samples (to the microsecond each), zero when there are
    /// none.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// # use std::time::Duration;
    /// # let timer = tokio_purgatory::Timer::new();
    /// # for _ in 0..3 { timer.sleep(Duration::from_millis(5)).await.unwrap(); }
    /// let lateness = timer.lateness();
    /// assert!(lateness.sum() >= lateness.max());
    /// assert!(lateness.sum() <= lateness.max() * 3);
    /// # }
    /// ```
    pub fn sum(&self) -> Duration {
        Duration::from_micros(self.sum_us)
    }

    /// The mean sample (to the microsecond, rounded down), zero when there are
    /// none.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// # use std::time::Duration;
    /// # let timer = tokio_purgatory::Timer::new();
    /// # for _ in 0..3 { timer.sleep(Duration::from_millis(5)).await.unwrap(); }
    /// let lateness = timer.lateness();
    /// assert!(lateness.mean() <= lateness.max());
    /// assert_eq!(tokio_purgatory::Histogram::default().mean(), Duration::ZERO);
    /// # }
    /// ```
    pub fn mean(&self) -> Duration {
        match self.count() {
            0 => Duration::ZERO,
            n => Duration::from_micros(self.sum_us / n),
        }
    }

    /// The `q`-quantile (`q` in `0.0..=1.0`, clamped): the upper bound of the
    /// bucket holding the sample of rank `ceil(q * count)`, at most [`max`].
    /// Zero when there are no samples.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// # use std::time::Duration;
    /// # let timer = tokio_purgatory::Timer::new();
    /// # for _ in 0..3 { timer.sleep(Duration::from_millis(5)).await.unwrap(); }
    /// let lateness = timer.lateness();
    /// let (p50, p99) = (lateness.quantile(0.5), lateness.quantile(0.99));
    /// assert!(p50 <= p99 && p99 <= lateness.max());
    /// # }
    /// ```
    ///
    /// [`max`]: Histogram::max
    pub fn quantile(&self, q: f64) -> Duration {
        let n = self.count();
        if n == 0 {
            return Duration::ZERO;
        }
        let rank = ((q.clamp(0.0, 1.0) * n as f64).ceil() as u64).clamp(1, n);
        let mut seen = 0;
        for (i, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return Duration::from_micros(upper_of(i).min(self.max_us));
            }
        }
        self.max()
    }

    /// The buckets holding samples, in increasing order: each bucket's upper
    /// bound (inclusive, to the microsecond) and its count. What an exporter
    /// turns into its own buckets (Prometheus' are cumulative: add them up).
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// # use std::time::Duration;
    /// # let timer = tokio_purgatory::Timer::new();
    /// # for _ in 0..3 { timer.sleep(Duration::from_millis(5)).await.unwrap(); }
    /// let lateness = timer.lateness();
    /// let mut cumulative = 0;
    /// for (upper, n) in lateness.buckets() {
    ///     cumulative += n;
    ///     println!("le={} {cumulative}", upper.as_secs_f64());
    /// }
    /// assert_eq!(cumulative, lateness.count());
    /// # }
    /// ```
    pub fn buckets(&self) -> impl Iterator<Item = (Duration, u64)> + '_ {
        self.counts
            .iter()
            .enumerate()
            .filter(|(_, &c)| c > 0)
            .map(|(i, &c)| (Duration::from_micros(upper_of(i)), c))
    }
}

#[cfg(all(test, not(purgatory_loom)))]
mod tests {
    use super::*;

    #[test]
    fn every_value_lands_in_a_bucket_that_holds_it() {
        let mut v = 0u64;
        while v < 1 << 42 {
            let i = bucket_of(v);
            assert!(v <= upper_of(i) || i == BUCKETS - 1, "{v} in {i}");
            assert!(i == 0 || v > upper_of(i - 1), "{v} in {i}");
            v = v * 9 / 8 + 1;
        }
        for i in SUB as usize..BUCKETS - 1 {
            // Widths are at most an eighth of the lower bound.
            let lower = upper_of(i - 1) + 1;
            assert!((upper_of(i) - lower + 1) * 8 <= lower, "bucket {i}");
        }
    }

    #[test]
    fn quantiles_match_a_sorted_reference_within_the_bucket_width() {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for round in 0..50 {
            let r = Recorder::default();
            let n = 1 + next() % 5000;
            let scale = 1 + next() % 1_000_000;
            let mut samples: Vec<u64> = (0..n)
                .map(|_| {
                    // Log-uniform-ish: a spread over several powers of two.
                    let x = next() % scale;
                    x >> (next() % 12)
                })
                .collect();
            for &s in &samples {
                r.record(Duration::from_micros(s));
            }
            samples.sort_unstable();
            let h = r.snapshot();
            assert_eq!(h.count(), n);
            assert_eq!(h.max(), Duration::from_micros(*samples.last().unwrap()));
            assert_eq!(h.sum(), Duration::from_micros(samples.iter().sum()));
            for q in [0.0, 0.1, 0.5, 0.9, 0.99, 0.999, 1.0] {
                let rank = ((q * n as f64).ceil() as u64).clamp(1, n);
                let truth = samples[rank as usize - 1];
                let got = h.quantile(q).as_micros() as u64;
                assert!(
                    got >= truth && got <= truth + truth / 8 + 1,
                    "round {round}, q {q}: {got} for {truth}"
                );
            }
            let total: u64 = h.buckets().map(|(_, c)| c).sum();
            assert_eq!(total, n);
        }
    }

    #[test]
    fn saturates_and_stays_empty_until_recorded() {
        let r = Recorder::default();
        assert!(r.snapshot().is_empty());
        assert_eq!(r.snapshot().quantile(0.5), Duration::ZERO);
        r.record(Duration::from_secs(u64::MAX));
        let h = r.snapshot();
        assert_eq!(h.count(), 1);
        assert_eq!(h.max(), Duration::from_micros(CAP));
        assert_eq!(h.quantile(1.0), h.max());
        assert_eq!(h.buckets().count(), 1);
    }
}
