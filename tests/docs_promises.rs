//! Statements of the rustdoc and the README that no other test file pins,
//! each checked as written: a purgatory's reaper batches, cell sizes and
//! pages, `Debug` output read before it is written, `Reaper::serving`, a
//! shutdown meeting a check that completes, when keys are cloned, the
//! lateness histogram's buckets, the lateness of past deadlines, which
//! tombstones walks and advances remove and when a purge starts at once,
//! the reaper's `tracing` span, what counts as a refusal, what an
//! `UnrunTask` does with its task, the tick below a millisecond and a
//! timer reset racing the reaper.
//!
//! Tokio's paused time everywhere but the last test, which races the reaper
//! on real threads. A check held on another thread and tasks run on a plain
//! thread need one thread more; every test that blocks a thread is bounded.

mod support;

use std::future::Future;
use std::hash::{Hash, Hasher};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::task::{Context, Poll};
use std::time::Duration;

use support::{ms, settle, FlagOp};
use tokio::time::{advance, Instant};
use tokio_purgatory::timer::TaskStatus;
use tokio_purgatory::{
    Completion, Histogram, Operation, OperationStatus, Purgatory, Reaper, Timer, Watch,
};

// ---------------------------------------------------------------------------
// Shared test types.

/// Never completes; expires to `()`.
struct Never;

impl Operation for Never {
    type Output = ();
    fn try_complete(&mut self) -> Option<()> {
        None
    }
    fn on_expiration(self) {}
}

/// An operation of `N` bytes whose outcome takes `M`.
struct Bytes<const N: usize, const M: usize>(#[allow(dead_code)] [u8; N]);

impl<const N: usize, const M: usize> Operation for Bytes<N, M> {
    type Output = [u8; M];
    fn try_complete(&mut self) -> Option<[u8; M]> {
        None
    }
    fn on_expiration(self) -> [u8; M] {
        [0; M]
    }
}

/// How often a [`CountedKey`]'s code ran.
#[derive(Default)]
struct KeyCalls {
    clones: AtomicUsize,
    drops: AtomicUsize,
}

impl KeyCalls {
    fn clones(&self) -> usize {
        self.clones.load(Ordering::SeqCst)
    }
    fn drops(&self) -> usize {
        self.drops.load(Ordering::SeqCst)
    }
}

/// A key that counts its clones and drops.
struct CountedKey(u32, Arc<KeyCalls>);

impl Clone for CountedKey {
    fn clone(&self) -> Self {
        self.1.clones.fetch_add(1, Ordering::SeqCst);
        CountedKey(self.0, self.1.clone())
    }
}

impl PartialEq for CountedKey {
    fn eq(&self, other: &Self) -> bool {
        self.0 == other.0
    }
}

impl Eq for CountedKey {}

impl Hash for CountedKey {
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.0.hash(h)
    }
}

impl Drop for CountedKey {
    fn drop(&mut self) {
        self.1.drops.fetch_add(1, Ordering::SeqCst);
    }
}

/// Says "not yet" to its registration's two checks; its third check waits
/// at `entered` until `release`, then completes it.
struct HeldThenDone {
    checks: usize,
    entered: Arc<Barrier>,
    release: Arc<Barrier>,
}

impl Operation for HeldThenDone {
    type Output = &'static str;
    fn try_complete(&mut self) -> Option<&'static str> {
        self.checks += 1;
        if self.checks < 3 {
            return None;
        }
        self.entered.wait();
        self.release.wait();
        Some("done")
    }
    fn on_expiration(self) -> &'static str {
        "expired"
    }
}

/// Panics when dropped.
struct PanicOnDrop;

impl Drop for PanicOnDrop {
    fn drop(&mut self) {
        panic!("a task's drop panics");
    }
}

/// A future that records whether it was polled and whether it was dropped.
struct Probe {
    polled: Arc<AtomicBool>,
    dropped: Arc<AtomicBool>,
}

impl Probe {
    fn new() -> (Probe, Arc<AtomicBool>, Arc<AtomicBool>) {
        let (polled, dropped) = (Arc::default(), Arc::default());
        let probe = Probe {
            polled: Arc::clone(&polled),
            dropped: Arc::clone(&dropped),
        };
        (probe, polled, dropped)
    }
}

impl Future for Probe {
    type Output = ();
    fn poll(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<()> {
        self.polled.store(true, Ordering::SeqCst);
        Poll::Ready(())
    }
}

impl Drop for Probe {
    fn drop(&mut self) {
        self.dropped.store(true, Ordering::SeqCst);
    }
}

/// An operation that never completes, on its own flag.
fn pending_op() -> FlagOp {
    FlagOp(Arc::new(AtomicBool::new(false)))
}

fn us(n: u64) -> Duration {
    Duration::from_micros(n)
}

// ---------------------------------------------------------------------------
// The reaper's batches.

/// `PurgatoryBuilder::batch_size` (src/settings.rs): "Most entries the reaper
/// expires from one shard before yielding to other tasks": ten operations
/// due at once, in batches of two, expire two per turn, and this task runs
/// between the turns.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_purgatorys_reaper_expires_a_batch_per_turn_and_yields_between() {
    let p: Purgatory<u32, Never> = Purgatory::builder()
        .batch_size(2)
        .timer_shards(1)
        .build()
        .unwrap();
    for i in 0..10 {
        p.try_complete_else_watch(Never, ms(10), [i])
            .unwrap()
            .detach();
    }
    advance(ms(10)).await;
    let mut seen = vec![p.metrics().expired];
    for _ in 0..30 {
        tokio::task::yield_now().await;
        seen.push(p.metrics().expired);
    }
    assert_eq!(*seen.last().unwrap(), 10, "{seen:?}");
    let most = seen.windows(2).map(|w| w[1] - w[0]).max().unwrap();
    assert!(most <= 2, "more than a batch between two yields: {seen:?}");
    assert!(
        seen.iter().filter(|&&n| n > 0 && n < 10).count() >= 3,
        "this task ran between the reaper's turns: {seen:?}"
    );
    assert_eq!(p.metrics().reaper.largest_batch, 2);
}

// ---------------------------------------------------------------------------
// Cells.

/// `Purgatory` docs, "Memory" (src/purgatory/mod.rs): a cell has "room for
/// the operation, `size_of::<Op>()`, for its outcome,
/// `size_of::<Op::Output>()`, and about 70 bytes of the cell's own state".
#[test]
fn a_cell_holds_the_operation_its_outcome_and_about_70_bytes() {
    let own = Purgatory::<u32, Bytes<0, 0>>::cell_bytes();
    assert!((50..=100).contains(&own), "about 70 bytes: {own}");
    let op = Purgatory::<u32, Bytes<1000, 0>>::cell_bytes();
    let out = Purgatory::<u32, Bytes<0, 1000>>::cell_bytes();
    let both = Purgatory::<u32, Bytes<1000, 1000>>::cell_bytes();
    assert!(op >= own + 1000, "{op} vs {own}");
    assert!(out >= own + 1000, "{out} vs {own}");
    assert!(both >= own + 2000, "room for both: {both} vs {own}");
}

/// `PurgatoryMetrics::cells` (src/purgatory/mod.rs): "rounded up to whole
/// pages of its slab (1,024 cells each past the first 2,048)", and "this
/// never goes down".
#[tokio::test(start_paused = true)]
async fn cells_grow_by_pages_of_1024_past_the_first_2048() {
    let p: Purgatory<u32, Bytes<0, 0>> = Purgatory::new();
    let mut held = Vec::new();
    let mut seen = Vec::new();
    for n in 1..=3073u32 {
        held.push(
            p.try_complete_else_watch(Bytes([]), Duration::from_secs(60), [n % 7])
                .unwrap(),
        );
        if [1, 32, 33, 64, 65, 2048, 2049, 3072, 3073].contains(&n) {
            seen.push((n, p.metrics().cells));
        }
    }
    assert_eq!(
        seen,
        [
            (1, 32),
            (32, 32),
            (33, 64),
            (64, 64),
            (65, 128),
            (2048, 2048),
            (2049, 3072),
            (3072, 3072),
            (3073, 4096)
        ]
    );
    drop(held);
    assert_eq!(p.metrics().delayed, 0);
    assert_eq!(p.metrics().cells, 4096, "never goes down");
}

// ---------------------------------------------------------------------------
// Debug output.

/// A writer that calls `f` before each piece it is given.
struct CallsBack<F: FnMut()>(F, String);

impl<F: FnMut()> std::fmt::Write for CallsBack<F> {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        (self.0)();
        self.1.push_str(s);
        Ok(())
    }
}

fn debug_through<F: FnMut()>(value: &impl std::fmt::Debug, f: F) -> String {
    use std::fmt::Write;
    let mut w = CallsBack(f, String::new());
    write!(w, "{value:?}").unwrap();
    w.1
}

/// The `Debug` impls of `TaskHandle` and `AsyncTaskHandle`
/// (src/timer/handle.rs: "read before anything is written (no lock of the
/// timer's is held while the formatter writes)") and of `Reaper`
/// (src/reaper.rs: "no lock of the reaper's is held while the formatter
/// writes"), and the purgatory's: a writer that calls back into what it
/// prints, even to cancel it, does not deadlock, and the output says what
/// was read.
#[test]
fn debug_output_is_read_before_the_writer_runs() {
    support::paused_within(20, || async {
        let reaper = Reaper::start().unwrap();
        let timer = Arc::new(Timer::builder().reaper(&reaper).build().unwrap());

        let task = Arc::new(timer.schedule(Duration::from_secs(5), || {}).unwrap());
        let (t, tm) = (task.clone(), timer.clone());
        let out = debug_through(&task, move || {
            let _ = t.status();
            let _ = t.reset(Duration::from_secs(6));
            let _ = tm.len();
        });
        assert!(
            out.contains("Pending") && out.contains("repeating: false"),
            "{out}"
        );
        let t = task.clone();
        let _ = debug_through(&task, move || {
            let _ = t.cancel();
        });
        assert_eq!(task.status(), TaskStatus::Cancelled);

        let job = Arc::new(
            timer
                .schedule_async(Duration::from_secs(5), async {})
                .unwrap(),
        );
        let j = job.clone();
        let out = debug_through(&job, move || {
            let _ = j.is_pending();
            let _ = j.reset(Duration::from_secs(1));
        });
        assert!(out.contains("pending: true"), "{out}");

        let r = reaper.clone();
        let out = debug_through(&reaper, move || {
            let _ = r.serving();
            let _ = r.is_stopped();
            drop(r.clone());
        });
        assert!(out.contains("serving: 1"), "{out}");

        let p: Purgatory<u32, FlagOp> = Purgatory::builder()
            .name("dbg")
            .reaper(&reaper)
            .build()
            .unwrap();
        let _h = p
            .try_complete_else_watch(pending_op(), Duration::from_secs(1), [1, 2])
            .unwrap();
        let q = p.clone();
        let out = debug_through(&p, move || {
            let _ = q.metrics();
            let _ = q.try_complete_watched(&1);
        });
        assert!(
            out.contains("\"dbg\"") && out.contains("delayed: 1") && out.contains("watched: 2"),
            "{out}"
        );
    });
}

// ---------------------------------------------------------------------------
// The shared reaper.

/// `Reaper::serving` (src/reaper.rs): "one shut down is not counted from
/// then on", at once, before the task's next turn; and, with everything it
/// served gone, a kept `Reaper` still serves what is built on it later.
#[tokio::test(start_paused = true)]
async fn serving_stops_counting_a_shut_down_purgatory_at_once() {
    let reaper = Reaper::start().unwrap();
    let p: Purgatory<u32, FlagOp> = Purgatory::builder().reaper(&reaper).build().unwrap();
    let timer = Timer::builder().reaper(&reaper).build().unwrap();
    assert_eq!(reaper.serving(), 2);
    drop(p.shutdown());
    assert_eq!(reaper.serving(), 1, "no turn needed");
    drop(timer);
    assert_eq!(reaper.serving(), 0);
    advance(Duration::from_secs(3600)).await;
    settle().await;
    assert!(!reaper.is_stopped());
    let later: Purgatory<u32, FlagOp> = Purgatory::builder().reaper(&reaper).build().unwrap();
    let h = later
        .try_complete_else_watch(pending_op(), ms(10), [1])
        .unwrap();
    assert!(h.await.unwrap().is_expired());
}

// ---------------------------------------------------------------------------
// A shutdown meeting a check.

/// `Purgatory::shutdown`, "Concurrent calls" (src/purgatory/mod.rs): "An
/// operation being checked ... at this moment is not in the list: it
/// finishes by that check": a check on another thread that completes it
/// wins over the shutdown, and the operation counts as completed.
#[test]
fn a_shutdown_leaves_an_operation_to_the_check_that_completes_it() {
    support::paused_within(20, || async {
        let p: Purgatory<u32, HeldThenDone> = Purgatory::new();
        let (entered, release) = (Arc::new(Barrier::new(2)), Arc::new(Barrier::new(2)));
        let op = HeldThenDone {
            checks: 0,
            entered: entered.clone(),
            release: release.clone(),
        };
        let h = p
            .try_complete_else_watch(op, Duration::from_secs(60), [1])
            .unwrap();
        let r = h.op_ref().unwrap();
        let checker = {
            let r = r.clone();
            std::thread::spawn(move || r.try_complete())
        };
        entered.wait();
        assert!(p.shutdown().is_empty(), "being checked: not handed back");
        release.wait();
        assert!(checker.join().unwrap(), "the check completed it");
        assert_eq!(h.await, Ok(Completion::Completed("done")));
        assert_eq!(r.status(), OperationStatus::Completed);
        let m = p.metrics();
        assert_eq!((m.completed, m.cancelled, m.handed_back), (1, 0, 0));
        assert!(support::balanced(&m));
    });
}

// ---------------------------------------------------------------------------
// Keys.

/// `WatchKey` (src/purgatory/operation.rs): "Its `Clone` (when a key is
/// first watched, the map keeps a copy)": one clone when a key is first
/// watched, plainly or at a level, none for a key the map already holds or
/// for an operation completed at its first check; every key made is
/// dropped once when nothing is pending.
#[tokio::test(start_paused = true)]
async fn a_key_is_cloned_only_when_first_watched() {
    for at_level in [false, true] {
        let calls = Arc::new(KeyCalls::default());
        let key = |k| CountedKey(k, calls.clone());
        let watch = |k| {
            if at_level {
                Watch::level(key(k), 5)
            } else {
                Watch::key(key(k))
            }
        };
        let p: Purgatory<CountedKey, FlagOp> = Purgatory::new();
        let first = p
            .try_complete_else_watch_levels(pending_op(), Duration::from_secs(10), [watch(1)])
            .unwrap();
        assert_eq!(calls.clones(), 1, "level {at_level}: the map's copy");
        let second = p
            .try_complete_else_watch_levels(
                pending_op(),
                Duration::from_secs(10),
                [watch(1), Watch::key(key(1))],
            )
            .unwrap();
        assert_eq!(calls.clones(), 1, "level {at_level}: the map holds key 1");
        let ready = FlagOp(Arc::new(AtomicBool::new(true)));
        let done = p
            .try_complete_else_watch_levels(ready, Duration::from_secs(10), [watch(2)])
            .unwrap();
        assert_eq!(calls.clones(), 1, "level {at_level}: completed at once");
        assert!(done.await.unwrap().is_completed());
        drop((first, second));
        settle().await;
        assert_eq!(p.metrics().keys, 0);
        assert_eq!(
            calls.drops(),
            4 + calls.clones(),
            "level {at_level}: every key dropped once"
        );
    }
}

// ---------------------------------------------------------------------------
// Lateness.

/// One sleep `late` past its 1 ms deadline on a timer of 1 µs ticks: one
/// lateness sample of exactly `late`.
async fn late_sample(timer: &Timer, late: Duration) {
    let sleep = timer.sleep(ms(1));
    advance(ms(1) + late).await;
    settle().await;
    assert!(sleep.is_elapsed());
}

/// `Histogram` (src/histogram.rs): "exact below 8 µs, then eight buckets per
/// power of two", so a quantile "is never below the true value and at most
/// 12.5% above it (plus under 1 µs of rounding)", at most the largest
/// sample; "one [bucket] for anything longer" than about 12.7 days,
/// "recorded as at most about 35 years" (2^50 µs).
#[tokio::test(start_paused = true)]
async fn the_lateness_histogram_keeps_its_documented_buckets() {
    let timer = Timer::builder().tick(us(1)).build().unwrap();
    assert_eq!(timer.lateness(), Histogram::default());
    for late in [20, 1000, 5, 3000] {
        late_sample(&timer, us(late)).await;
    }
    let h = timer.lateness();
    assert_eq!((h.count(), h.max(), h.sum()), (4, us(3000), us(4025)));
    assert_eq!(h.mean(), us(1006));
    assert_eq!(h.quantile(0.25), us(5), "exact below 8 µs");
    assert_eq!(h.quantile(0.5), us(21), "20 µs: its bucket ends at 21 µs");
    let q = h.quantile(0.75);
    assert!(q >= us(1000) && q <= us(1125), "{q:?}");
    assert_eq!(h.quantile(1.0), us(3000), "at most the largest sample");
    let buckets: Vec<_> = h.buckets().collect();
    assert_eq!(buckets.len(), 4);
    assert_eq!(buckets[..2], [(us(5), 1), (us(21), 1)]);
    for ((upper, n), sample) in buckets[2..].iter().zip([1000, 3000]) {
        assert_eq!(*n, 1);
        assert!(
            *upper >= us(sample) && *upper <= us(sample + sample / 8),
            "{upper:?} for {sample} µs"
        );
    }

    let timer = Timer::builder().tick(us(1)).build().unwrap();
    let day = Duration::from_secs(86_400);
    late_sample(&timer, day * 20).await;
    let h = timer.lateness();
    assert_eq!(h.max(), day * 20);
    assert_eq!(
        h.quantile(0.5),
        day * 20,
        "the last bucket: the largest sample"
    );
    late_sample(&timer, day * 365 * 40).await;
    let h = timer.lateness();
    assert_eq!(h.max(), us(1 << 50), "recorded as at most 2^50 µs");
    assert_eq!(h.sum(), day * 20 + us(1 << 50));
    assert_eq!(h.buckets().collect::<Vec<_>>(), [(us(1 << 50), 2)]);
}

/// `Purgatory::lateness` (src/purgatory/mod.rs): "A deadline already
/// reached at registration (zero, or past) counts from the start of the
/// tick it was registered in: it reads late by up to one tick, however far
/// past it was." Registered 5 ms into a 10 ms tick: 5 ms late, both.
#[tokio::test(start_paused = true)]
async fn a_past_deadline_reads_late_from_the_start_of_its_tick() {
    let p: Purgatory<u32, Never> = Purgatory::builder().tick(ms(10)).build().unwrap();
    advance(ms(15)).await;
    settle().await;
    let zero = p
        .try_complete_else_watch(Never, Duration::ZERO, [1])
        .unwrap();
    let hour_ago = Instant::now() - Duration::from_secs(3600);
    let past = p.try_complete_else_watch_at(Never, hour_ago, [1]).unwrap();
    assert!(zero.await.unwrap().is_expired());
    assert!(past.await.unwrap().is_expired());
    let late = p.lateness();
    assert_eq!(late.count(), 2);
    assert_eq!(late.max(), ms(5), "from the tick's start at 10 ms");
}

// ---------------------------------------------------------------------------
// Tombstones and the purge.

/// `PurgatoryBuilder::purge_interval` (src/purgatory/builder.rs): "Walking a
/// key also removes its own tombstones"; `Purgatory` docs, "Memory": an
/// entry at a level stays a tombstone "until an advance reaches its level";
/// `PurgatoryMetrics::purged` counts "Tombstones removed by the amortised
/// purge (walks of keys not counted)".
#[tokio::test(start_paused = true)]
async fn walks_and_advances_remove_their_own_tombstones_uncounted() {
    let p: Purgatory<u32, FlagOp> = Purgatory::new();
    // Something stays pending: no purge of an idle map.
    let _stay = p
        .try_complete_else_watch(pending_op(), Duration::from_secs(100), [99])
        .unwrap();
    let go = Arc::new(AtomicBool::new(false));
    let h = p
        .try_complete_else_watch_levels(
            FlagOp(go.clone()),
            Duration::from_secs(100),
            [Watch::key(1), Watch::key(2), Watch::level(3, 50)],
        )
        .unwrap();
    go.store(true, Ordering::SeqCst);
    assert_eq!(p.try_complete_watched(&1), 1);
    assert!(h.await.unwrap().is_completed());
    assert_eq!(p.metrics().tombstones, 2, "in keys 2 and 3");

    assert_eq!(p.try_complete_watched(&2), 0);
    let m = p.metrics();
    assert_eq!((m.tombstones, m.purged), (1, 0), "{m:?}");
    assert_eq!(p.try_complete_reached(&3, 49), 0);
    assert_eq!(p.metrics().tombstones, 1, "level 50 not reached");
    assert_eq!(p.try_complete_reached(&3, 50), 0);
    let m = p.metrics();
    assert_eq!((m.tombstones, m.purged), (0, 0), "{m:?}");
    assert_eq!(m.keys, 1, "emptied keys are removed");
}

/// `PurgatoryBuilder::purge_interval` (src/purgatory/builder.rs): "an
/// expiry or a cancellation ... that leaves at least as many tombstones as
/// live entries, and at least 16, starts a purge at once: a map of up to
/// about 1,000 entries is purged whole in that call". Sixteen operations on
/// two keys each beside one on a key of its own: the ninth to finish
/// leaves 18 tombstones to 15 live entries, and purges them; by dropped
/// handles, and by expiries in one reaper turn.
#[tokio::test(start_paused = true)]
async fn sixteen_tombstones_as_many_as_live_entries_start_a_purge_at_once() {
    let shape = |p: &Purgatory<u32, Never>| {
        let m = p.metrics();
        (m.tombstones, m.purged)
    };

    let p: Purgatory<u32, Never> = Purgatory::new();
    let _stay = p
        .try_complete_else_watch(Never, Duration::from_secs(100), [9999])
        .unwrap();
    let mut hs: Vec<_> = (0..16u32)
        .map(|i| {
            p.try_complete_else_watch(Never, Duration::from_secs(100), [i, 1000 + i])
                .unwrap()
        })
        .collect();
    for n in 1..=8 {
        drop(hs.pop());
        assert_eq!(shape(&p), (2 * n, 0), "{n} dropped: fewer than the live");
    }
    drop(hs.pop());
    assert_eq!(shape(&p), (0, 18), "the ninth: purged in that call");
    let m = p.metrics();
    assert_eq!((m.watched, m.keys), (15, 15), "{m:?}");

    let p: Purgatory<u32, Never> = Purgatory::new();
    let _stay = p
        .try_complete_else_watch(Never, Duration::from_secs(100), [9999])
        .unwrap();
    for i in 0..16u32 {
        p.try_complete_else_watch(Never, ms(10), [i, 1000 + i])
            .unwrap()
            .detach();
    }
    advance(ms(10)).await;
    settle().await;
    assert_eq!(p.metrics().expired, 16);
    assert_eq!(
        shape(&p),
        (14, 18),
        "purged at the ninth expiry; the 14 after it are fewer than 16"
    );
}

// ---------------------------------------------------------------------------
// Tracing.

/// README, "Observability": "Each reaper turn is a `tracing` span at debug level."
#[test]
fn each_reaper_turn_is_a_debug_span() {
    use tracing_subscriber::layer::SubscriberExt;

    #[derive(Default)]
    struct Spans {
        turns: AtomicUsize,
        at_debug: AtomicUsize,
    }
    struct CountTurns(Arc<Spans>);
    impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for CountTurns {
        fn on_new_span(
            &self,
            attrs: &tracing::span::Attributes<'_>,
            _: &tracing::span::Id,
            _: tracing_subscriber::layer::Context<'_, S>,
        ) {
            if attrs.metadata().name() == "reaper turn" {
                self.0.turns.fetch_add(1, Ordering::SeqCst);
                if *attrs.metadata().level() == tracing::Level::DEBUG {
                    self.0.at_debug.fetch_add(1, Ordering::SeqCst);
                }
            }
        }
    }

    let spans = Arc::new(Spans::default());
    let subscriber = tracing_subscriber::registry().with(CountTurns(spans.clone()));
    let turns = tracing::subscriber::with_default(subscriber, || {
        support::paused().block_on(async {
            let timer = Timer::new();
            for _ in 0..3 {
                timer.sleep(ms(5)).await.unwrap();
            }
            settle().await;
            timer.metrics().reaper.turns
        })
    });
    assert!(turns >= 3);
    assert_eq!(spans.turns.load(Ordering::SeqCst) as u64, turns);
    assert_eq!(
        spans.at_debug.load(Ordering::SeqCst) as u64,
        turns,
        "every one at debug"
    );
}

// ---------------------------------------------------------------------------
// The timer.

/// `RefusedMetrics` (src/core.rs): "Registrations and schedules refused, by
/// reason: each was handed back in its error ... or, for a sleep or a
/// timeout, its entry was refused when it was made." A repeating task
/// whose run shuts its timer down ends its chain; that is no schedule of
/// the caller's, and nothing is counted as refused.
#[tokio::test(start_paused = true)]
async fn a_repeating_chain_ended_by_a_shutdown_is_no_refusal() {
    let timer = Timer::new();
    let weak = timer.downgrade();
    let runs = Arc::new(AtomicUsize::new(0));
    let r = runs.clone();
    timer
        .schedule_repeating(ms(10), move || {
            r.fetch_add(1, Ordering::SeqCst);
            if let Some(t) = weak.upgrade() {
                drop(t.shutdown());
            }
            Some(ms(10))
        })
        .unwrap();
    advance(ms(50)).await;
    settle().await;
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert!(timer.is_shutdown());
    assert_eq!(timer.metrics().refused.total(), 0);
}

/// `UnrunTask` (src/timer/task.rs): "Dropping it drops the task unrun, on
/// the dropping thread: the timer no longer owns it, so a panic in the
/// task's `Drop` is not caught and counted by the timer but reaches the
/// caller". A task cancelled through its handle is still the timer's: the
/// same panic is caught and counted.
#[tokio::test(start_paused = true)]
async fn a_panic_dropping_an_unrun_task_reaches_the_caller() {
    let timer = Timer::new();
    let guard = PanicOnDrop;
    timer
        .schedule(Duration::from_secs(1), move || {
            let _g = &guard;
        })
        .unwrap();
    let back = timer.shutdown();
    assert_eq!(back.len(), 1);
    let dropped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(back)));
    assert!(dropped.is_err(), "the panic reaches the caller");
    assert_eq!(timer.metrics().panicked, 0, "not the timer's");

    let timer = Timer::new();
    let guard = PanicOnDrop;
    let h = timer
        .schedule(Duration::from_secs(1), move || {
            let _g = &guard;
        })
        .unwrap();
    assert!(h.cancel());
    assert_eq!(timer.metrics().panicked, 1, "caught and counted");
}

/// `UnrunTask::run` (src/timer/task.rs): a future from `schedule_async` is
/// spawned "called outside any runtime, on the one that was current where
/// it was scheduled": run on a plain thread, it is spawned on that runtime,
/// which then runs it.
#[test]
fn an_unrun_async_task_run_outside_any_runtime_starts_on_its_own() {
    support::within(20, || {
        let rt = support::paused();
        let (tx, rx) = tokio::sync::oneshot::channel();
        let (h, back) = rt.block_on(async {
            let timer = Timer::new();
            let h = timer
                .schedule_async(Duration::from_secs(60), async move {
                    let _ = tx.send(());
                })
                .unwrap();
            (h, timer.shutdown())
        });
        assert_eq!(back.len(), 1);
        std::thread::spawn(move || back.into_iter().for_each(|t| t.run()))
            .join()
            .unwrap();
        rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(10), rx)
                .await
                .expect("spawned on the runtime it was scheduled on")
                .unwrap();
            settle().await;
        });
        assert!(h.is_finished());
    });
}

/// `UnrunTask::run` (src/timer/task.rs): "If there is none (or that runtime
/// has shut down), it is dropped unrun and its handle reads finished."
#[test]
fn an_unrun_async_task_whose_runtime_is_gone_is_dropped_unpolled() {
    let rt = support::paused();
    let (future, polled, dropped) = Probe::new();
    let (h, back) = rt.block_on(async {
        let timer = Timer::new();
        let h = timer
            .schedule_async(Duration::from_secs(1), future)
            .unwrap();
        (h, timer.shutdown())
    });
    drop(rt);
    assert!(!h.is_finished(), "handed back: it may still be run");
    for task in back {
        task.run();
    }
    assert!(dropped.load(Ordering::SeqCst), "dropped");
    assert!(!polled.load(Ordering::SeqCst), "unpolled");
    assert!(h.is_finished());
    assert!(!h.cancel());
}

/// `tick` (src/settings.rs): "The reaper sleeps on Tokio's timer, which
/// wakes at most once a millisecond, so a tick below 1 ms cuts lateness
/// without adding wake-ups": 100 sleeps 10 µs apart cost a timer of 10 µs
/// ticks no more wake-ups than one of 1 ms ticks.
#[tokio::test(start_paused = true)]
async fn a_tick_below_a_millisecond_adds_no_wake_ups() {
    let mut wakeups = Vec::new();
    for tick in [us(10), ms(1)] {
        let timer = Timer::builder().tick(tick).build().unwrap();
        settle().await;
        let before = timer.metrics().reaper_wakeups;
        let sleeps: Vec<_> = (0..100).map(|i| timer.sleep(us(1000 + i * 10))).collect();
        for sleep in sleeps {
            sleep.await.unwrap();
        }
        wakeups.push(timer.metrics().reaper_wakeups - before);
    }
    assert!(
        wakeups[0] <= wakeups[1],
        "10 µs and 1 ms ticks: {wakeups:?}"
    );
}

/// `TaskHandle::reset`, "Concurrent calls" (src/timer/handle.rs): "racing
/// the reaper, either the reset wins and the task runs at the new deadline
/// only, or the task runs (at the old one) and the reset returns `false`".
/// Real threads: resets from this thread race the reaper on a two-worker
/// runtime; a `true` leaves the task pending and unrun after its old
/// deadline has passed, a `false` means it ran once.
#[test]
fn a_timer_reset_racing_the_reaper_either_wins_or_says_false() {
    support::within(30, || {
        let rt = support::multi();
        let _in = rt.enter();
        let timer = Timer::builder().tick(us(10)).build().unwrap();
        for round in 0..20 {
            let runs: Vec<_> = (0..32).map(|_| Arc::new(AtomicUsize::new(0))).collect();
            let handles: Vec<_> = runs
                .iter()
                .enumerate()
                .map(|(i, ran)| {
                    let ran = ran.clone();
                    timer
                        .schedule(us(100 + 20 * i as u64), move || {
                            ran.fetch_add(1, Ordering::SeqCst);
                        })
                        .unwrap()
                })
                .collect();
            let start = std::time::Instant::now();
            while start.elapsed() < us(300 + 20 * round) {
                std::hint::spin_loop();
            }
            let moved: Vec<_> = handles
                .iter()
                .map(|h| h.reset(Duration::from_secs(3600)))
                .collect();
            // Until each task whose reset lost has run (bounded), rather
            // than a fixed pause a slow machine could outlast.
            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            while runs
                .iter()
                .zip(&moved)
                .any(|(ran, moved)| !moved && ran.load(Ordering::SeqCst) == 0)
                && std::time::Instant::now() < deadline
            {
                std::thread::yield_now();
            }
            for (i, h) in handles.iter().enumerate() {
                let ran = runs[i].load(Ordering::SeqCst);
                if moved[i] {
                    assert_eq!(ran, 0, "round {round} task {i}: reset won, yet it ran");
                    assert_eq!(h.status(), TaskStatus::Pending);
                    assert!(h.cancel());
                } else {
                    assert_eq!(ran, 1, "round {round} task {i}: reset lost, so it ran");
                    assert_eq!(h.status(), TaskStatus::Done);
                }
            }
        }
        assert!(timer.is_empty());
    });
}
