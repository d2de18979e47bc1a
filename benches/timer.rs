//! Timer benchmark: our `Timer` against the peers a Rust user would pick instead.
//!
//! Run: `cargo bench --bench timer` (add `-- --quick` for 100,000 timers).
//!
//! Workload: N timers with delays uniform in 1..1000 ms, 80% cancelled
//! soon after being scheduled (in batches of 1,000: schedule the batch, cancel 800
//! of it), the rest expiring. Reported per implementation, runtime flavour and
//! producer count: schedule and cancel throughput (time spent in those calls
//! only), bytes per pending timer (pointer-sized payload; 1,000,000 pending, no
//! cancels, counted by a global allocator), and expiry lateness p50/p99/max
//! (time of running minus deadline).
//!
//! Peers:
//! - `task-per-timer`: `tokio::spawn` of `sleep(d)` per timer, cancelled by `abort`.
//! - `DelayQueue`: `tokio_util::time::DelayQueue` behind a mutex, driven by one task.
//! - `BinaryHeap`: a min-heap with lazy cancellation behind a mutex, driven by one
//!   task sleeping until the earliest deadline.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashSet};
use std::hint::black_box;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hdrhistogram::Histogram;
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_purgatory::Timer;

#[path = "../tests/support/alloc.rs"]
mod alloc;

#[global_allocator]
static GLOBAL: alloc::Counting = alloc::Counting;

const BATCH: usize = 1000;
const CANCEL_PER_BATCH: usize = 800;

#[path = "../tests/support/rng.rs"]
mod rng;
use rng::Rng;

fn delay(rng: &mut Rng) -> Duration {
    Duration::from_millis(1 + rng.next() % 999)
}

/// One histogram for whichever implementation is running: a static, so that no
/// implementation's timers carry (and clone) a reference to it.
static LATENESS: Mutex<Option<Histogram<u64>>> = Mutex::new(None);

/// Handle passed around for symmetry; all record into `LATENESS`.
#[derive(Clone, Copy)]
struct Lateness;

fn record(_: &Lateness, deadline: Instant) {
    let late = Instant::now()
        .saturating_duration_since(deadline)
        .as_micros() as u64;
    if let Some(h) = LATENESS.lock().unwrap().as_mut() {
        h.record(late.max(1)).ok();
    }
}

/// One implementation under test: schedule returns a cancel token.
trait Peer: Send + Sync + 'static {
    type Token: Send;
    fn schedule(&self, delay: Duration, payload: usize, late: &Lateness) -> Self::Token;
    fn cancel(&self, t: Self::Token);
}

struct Ours(Timer);
impl Peer for Ours {
    type Token = tokio_purgatory::timer::Timeout;
    fn schedule(&self, delay: Duration, payload: usize, late: &Lateness) -> Self::Token {
        let deadline = Instant::now() + delay;
        let late = *late;
        self.0
            .schedule_at(deadline, move || {
                black_box(payload);
                record(&late, deadline);
            })
            .unwrap()
    }
    fn cancel(&self, t: Self::Token) {
        t.cancel();
    }
}

struct TaskPerTimer;
impl Peer for TaskPerTimer {
    type Token = tokio::task::JoinHandle<()>;
    fn schedule(&self, delay: Duration, payload: usize, late: &Lateness) -> Self::Token {
        let deadline = Instant::now() + delay;
        let late = *late;
        tokio::spawn(async move {
            tokio::time::sleep_until(deadline).await;
            black_box(payload);
            record(&late, deadline);
        })
    }
    fn cancel(&self, t: Self::Token) {
        t.abort();
    }
}

type Entry = (usize, Instant);

struct Dq {
    q: Mutex<tokio_util::time::DelayQueue<Entry>>,
}
impl Peer for Dq {
    type Token = tokio_util::time::delay_queue::Key;
    fn schedule(&self, delay: Duration, payload: usize, _: &Lateness) -> Self::Token {
        let deadline = Instant::now() + delay;
        self.q
            .lock()
            .unwrap()
            .insert_at((payload, deadline), deadline)
    }
    fn cancel(&self, t: Self::Token) {
        self.q.lock().unwrap().try_remove(&t);
    }
}

async fn drive_dq(dq: Arc<Dq>, late: Lateness, stop: Arc<Notify>) {
    use std::future::poll_fn;
    use std::task::Poll;
    let stopped = stop.notified();
    tokio::pin!(stopped);
    loop {
        let next = poll_fn(|cx| {
            if stopped.as_mut().poll(cx).is_ready() {
                return Poll::Ready(None);
            }
            match dq.q.lock().unwrap().poll_expired(cx) {
                Poll::Ready(Some(e)) => Poll::Ready(Some(e.into_inner())),
                // Empty: the waker is stored, and an insert wakes it.
                Poll::Ready(None) | Poll::Pending => Poll::Pending,
            }
        })
        .await;
        match next {
            None => return,
            Some((payload, deadline)) => {
                black_box(payload);
                record(&late, deadline);
            }
        }
    }
}

use std::future::Future;

struct Heap {
    inner: Mutex<HeapInner>,
    notify: Notify,
}
struct HeapInner {
    heap: BinaryHeap<Reverse<(Instant, u64, usize)>>,
    cancelled: HashSet<u64>,
    next_id: u64,
}
impl Peer for Heap {
    type Token = u64;
    fn schedule(&self, delay: Duration, payload: usize, _: &Lateness) -> u64 {
        let deadline = Instant::now() + delay;
        let mut g = self.inner.lock().unwrap();
        let id = g.next_id;
        g.next_id += 1;
        let earliest = g.heap.peek().is_none_or(|Reverse((d, _, _))| deadline < *d);
        g.heap.push(Reverse((deadline, id, payload)));
        drop(g);
        if earliest {
            self.notify.notify_one();
        }
        id
    }
    fn cancel(&self, id: u64) {
        self.inner.lock().unwrap().cancelled.insert(id);
    }
}

async fn drive_heap(h: Arc<Heap>, late: Lateness, stop: Arc<Notify>) {
    let stopped = stop.notified();
    tokio::pin!(stopped);
    loop {
        let now = Instant::now();
        let mut next = None;
        {
            let mut g = h.inner.lock().unwrap();
            while let Some(Reverse((d, id, payload))) = g.heap.peek().copied() {
                if d > now {
                    next = Some(d);
                    break;
                }
                g.heap.pop();
                if !g.cancelled.remove(&id) {
                    black_box(payload);
                    record(&late, d);
                }
            }
        }
        tokio::select! {
            _ = &mut stopped => return,
            _ = h.notify.notified() => {}
            _ = async {
                match next {
                    Some(d) => tokio::time::sleep_until(d).await,
                    None => std::future::pending().await,
                }
            } => {}
        }
    }
}

#[derive(Default, Clone, Copy)]
struct Result1 {
    schedule: Duration,
    cancel: Duration,
    scheduled: usize,
    cancelled: usize,
}

async fn produce<P: Peer>(peer: Arc<P>, n: usize, seed: u64, late: Lateness) -> Result1 {
    let mut rng = Rng(seed);
    let mut r = Result1::default();
    let mut tokens = Vec::with_capacity(BATCH);
    let mut done = 0;
    while done < n {
        let m = BATCH.min(n - done);
        let t0 = std::time::Instant::now();
        for i in 0..m {
            tokens.push(peer.schedule(delay(&mut rng), done + i, &late));
        }
        let t1 = std::time::Instant::now();
        let mut cancelled = 0;
        for t in tokens.drain(..).take(CANCEL_PER_BATCH * m / BATCH) {
            peer.cancel(t);
            cancelled += 1;
        }
        let t2 = std::time::Instant::now();
        r.schedule += t1 - t0;
        r.cancel += t2 - t1;
        r.scheduled += m;
        r.cancelled += cancelled;
        done += m;
        // Let the reaper or drivers run, as a real producer would between requests.
        tokio::task::yield_now().await;
    }
    r
}

struct Row {
    name: &'static str,
    flavour: &'static str,
    producers: usize,
    schedule_rate: f64,
    cancel_rate: f64,
    bytes: Option<f64>,
    p50: u64,
    p99: u64,
    max: u64,
    fired: u64,
}

async fn run_peer<P: Peer>(
    name: &'static str,
    flavour: &'static str,
    peer: Arc<P>,
    n: usize,
    producers: usize,
    late: Lateness,
) -> Row {
    let mut joins = Vec::new();
    for p in 0..producers {
        joins.push(tokio::spawn(produce(
            peer.clone(),
            n / producers,
            42 + p as u64,
            late,
        )));
    }
    let mut total = Result1::default();
    let mut sched_wall = Duration::ZERO;
    let mut cancel_wall = Duration::ZERO;
    for j in joins {
        let r = j.await.unwrap();
        total.scheduled += r.scheduled;
        total.cancelled += r.cancelled;
        sched_wall = sched_wall.max(r.schedule);
        cancel_wall = cancel_wall.max(r.cancel);
    }
    // Let the survivors expire.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let _ = late;
    let h = LATENESS.lock().unwrap().take().expect("histogram set");
    Row {
        name,
        flavour,
        producers,
        // With several producers, each rate is total work over the slowest
        // producer's time in that call: concurrent throughput.
        schedule_rate: total.scheduled as f64 / sched_wall.as_secs_f64(),
        cancel_rate: total.cancelled as f64 / cancel_wall.as_secs_f64(),
        bytes: None,
        p50: h.value_at_quantile(0.5),
        p99: h.value_at_quantile(0.99),
        max: h.max(),
        fired: h.len(),
    }
}

fn hist() -> Lateness {
    *LATENESS.lock().unwrap() = Some(Histogram::new(3).unwrap());
    Lateness
}

/// Bytes per pending timer with a pointer-sized payload (no lateness recording).
async fn bytes_per_pending(name: &str, n: usize) -> f64 {
    match name {
        "tokio-purgatory" => {
            let t = Timer::new();
            let base = alloc::live_bytes();
            for i in 0..n {
                // The handle lives on the caller's side (like DelayQueue's key);
                // dropping it does not cancel.
                drop(t.schedule(Duration::from_secs(3600), move || {
                    black_box(i);
                }));
            }
            let used = alloc::live_bytes() - base;
            let _ = t.shutdown();
            used as f64 / n as f64
        }
        "task-per-timer" => {
            let mut hs = Vec::with_capacity(n);
            let base = alloc::live_bytes();
            for i in 0..n {
                hs.push(tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_secs(3600)).await;
                    black_box(i);
                }));
            }
            tokio::task::yield_now().await;
            // The JoinHandles are the user's; count them as in the others' keys.
            let used = alloc::live_bytes() - base;
            for h in hs {
                h.abort();
            }
            used as f64 / n as f64
        }
        "DelayQueue" => {
            let mut q = tokio_util::time::DelayQueue::new();
            let base = alloc::live_bytes();
            for i in 0..n {
                q.insert(i, Duration::from_secs(3600));
            }
            (alloc::live_bytes() - base) as f64 / n as f64
        }
        _ => {
            let mut heap = BinaryHeap::new();
            let base = alloc::live_bytes();
            let now = Instant::now();
            for i in 0..n {
                heap.push(Reverse((now + Duration::from_secs(3600), i as u64, i)));
            }
            (alloc::live_bytes() - base) as f64 / n as f64
        }
    }
}

async fn all(flavour: &'static str, n: usize, producers: usize, rows: &mut Vec<Row>) {
    let stop = Arc::new(Notify::new());
    // `TIMER_BENCH_ONLY=ours` measures our timer alone (for profiling).
    let only_ours = std::env::var("TIMER_BENCH_ONLY").is_ok_and(|v| v == "ours");

    let late = hist();
    let tick_us: u64 = std::env::var("TIMER_TICK_US")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    let timer = Timer::builder()
        .tick(Duration::from_micros(tick_us))
        .build()
        .unwrap();
    let timer = Arc::new(Ours(timer));
    rows.push(
        run_peer(
            "tokio-purgatory",
            flavour,
            timer.clone(),
            n,
            producers,
            late,
        )
        .await,
    );
    timer.0.shutdown();
    if only_ours {
        return;
    }

    let late = hist();
    rows.push(
        run_peer(
            "task-per-timer",
            flavour,
            Arc::new(TaskPerTimer),
            n,
            producers,
            late,
        )
        .await,
    );

    let late = hist();
    let dq = Arc::new(Dq {
        q: Mutex::new(tokio_util::time::DelayQueue::new()),
    });
    let driver = tokio::spawn(drive_dq(dq.clone(), late, stop.clone()));
    rows.push(run_peer("DelayQueue", flavour, dq, n, producers, late).await);
    stop.notify_one();
    driver.await.unwrap();

    let late = hist();
    let heap = Arc::new(Heap {
        inner: Mutex::new(HeapInner {
            heap: BinaryHeap::new(),
            cancelled: HashSet::new(),
            next_id: 0,
        }),
        notify: Notify::new(),
    });
    let driver = tokio::spawn(drive_heap(heap.clone(), late, stop.clone()));
    rows.push(run_peer("BinaryHeap", flavour, heap, n, producers, late).await);
    stop.notify_one();
    driver.await.unwrap();
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let n = if quick { 100_000 } else { 1_000_000 };
    let mut rows = Vec::new();
    for (flavour, producers) in [
        ("current_thread", 1),
        ("multi_thread", 1),
        ("multi_thread", 2),
    ] {
        let rt = if flavour == "current_thread" {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
        } else {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap()
        };
        rt.block_on(all(flavour, n, producers, &mut rows));
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    for name in [
        "tokio-purgatory",
        "task-per-timer",
        "DelayQueue",
        "BinaryHeap",
    ] {
        if std::env::var("TIMER_BENCH_ONLY").is_ok_and(|v| v == "ours") && name != "tokio-purgatory"
        {
            continue;
        }
        let b = rt.block_on(bytes_per_pending(name, n));
        for r in rows.iter_mut().filter(|r| r.name == name) {
            r.bytes = Some(b);
        }
    }

    println!(
        "timers: {n}, delays 1..1000 ms, {}% cancelled",
        CANCEL_PER_BATCH * 100 / BATCH
    );
    println!(
        "| implementation | runtime | producers | schedule M/s | cancel M/s | bytes/pending | lateness p50 / p99 / max (ms) | fired |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for r in &rows {
        println!(
            "| {} | {} | {} | {:.2} | {:.2} | {:.0} | {:.2} / {:.2} / {:.2} | {} |",
            r.name,
            r.flavour,
            r.producers,
            r.schedule_rate / 1e6,
            r.cancel_rate / 1e6,
            r.bytes.unwrap_or(f64::NAN),
            r.p50 as f64 / 1000.0,
            r.p99 as f64 / 1000.0,
            r.max as f64 / 1000.0,
            r.fired
        );
    }
    println!();
    println!("ratios (ours / peer, same runtime and producers):");
    for r in rows.iter().filter(|r| r.name != "tokio-purgatory") {
        if let Some(o) = rows.iter().find(|o| {
            o.name == "tokio-purgatory" && o.flavour == r.flavour && o.producers == r.producers
        }) {
            println!(
                "  vs {:<15} {:<14} x{}: schedule {:.1}x, cancel {:.1}x, bytes {:.2}x",
                r.name,
                r.flavour,
                r.producers,
                o.schedule_rate / r.schedule_rate,
                o.cancel_rate / r.cancel_rate,
                o.bytes.unwrap_or(f64::NAN) / r.bytes.unwrap_or(f64::NAN)
            );
        }
    }
}
