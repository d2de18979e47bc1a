//! Timer benchmark: our `Timer` against the peers a Rust user would pick instead.
//!
//! Run: `cargo bench --bench timer` (add `-- --quick` for 100,000 timers,
//! `-- --repeat N` for N repetitions, default 3). Every run is a process of its
//! own, and the runs are interleaved (each repetition runs every
//! implementation once per configuration); the table shows medians with
//! [min..max]. `-- --child NAME FLAVOUR PRODUCERS` makes one run and prints its
//! row (for profiling one implementation, e.g. `--child tokio-purgatory
//! multi_thread 1`). Byte counts are exact and taken once, in the parent;
//! children do not count bytes, since the counter is an atomic every
//! allocation would update.
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
    type Token = tokio_purgatory::timer::TaskHandle;
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

/// The implementations, in the order they run within each repetition.
const IMPLS: [&str; 4] = [
    "tokio-purgatory",
    "task-per-timer",
    "DelayQueue",
    "BinaryHeap",
];

/// The (runtime flavour, producers) configurations.
const CONFIGS: [(&str, usize); 3] = [
    ("current_thread", 1),
    ("multi_thread", 1),
    ("multi_thread", 2),
];

/// One implementation, one runtime, one producer count: the run a child
/// process makes.
async fn one(name: &'static str, flavour: &'static str, n: usize, producers: usize) -> Row {
    let late = hist();
    match name {
        "tokio-purgatory" => {
            let tick_us: u64 = std::env::var("TIMER_TICK_US")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(1000);
            let timer = Timer::builder()
                .tick(Duration::from_micros(tick_us))
                .build()
                .unwrap();
            let timer = Arc::new(Ours(timer));
            let row = run_peer(name, flavour, timer.clone(), n, producers, late).await;
            timer.0.shutdown();
            row
        }
        "task-per-timer" => {
            run_peer(name, flavour, Arc::new(TaskPerTimer), n, producers, late).await
        }
        "DelayQueue" => {
            let stop = Arc::new(Notify::new());
            let dq = Arc::new(Dq {
                q: Mutex::new(tokio_util::time::DelayQueue::new()),
            });
            let driver = tokio::spawn(drive_dq(dq.clone(), late, stop.clone()));
            let row = run_peer(name, flavour, dq, n, producers, late).await;
            stop.notify_one();
            driver.await.unwrap();
            row
        }
        _ => {
            let stop = Arc::new(Notify::new());
            let heap = Arc::new(Heap {
                inner: Mutex::new(HeapInner {
                    heap: BinaryHeap::new(),
                    cancelled: HashSet::new(),
                    next_id: 0,
                }),
                notify: Notify::new(),
            });
            let driver = tokio::spawn(drive_heap(heap.clone(), late, stop.clone()));
            let row = run_peer("BinaryHeap", flavour, heap, n, producers, late).await;
            stop.notify_one();
            driver.await.unwrap();
            row
        }
    }
}

fn runtime(flavour: &str) -> tokio::runtime::Runtime {
    if flavour == "current_thread" {
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
    }
}

fn static_name(name: &str) -> &'static str {
    IMPLS
        .iter()
        .chain(CONFIGS.iter().map(|(f, _)| f))
        .find(|n| **n == name)
        .copied()
        .unwrap_or_else(|| panic!("unknown name {name:?}"))
}

/// A child's run, printed as one tab-separated `ROW` line.
fn child(name: &str, flavour: &str, producers: usize, n: usize) {
    // Counting bytes costs every allocation a shared atomic: off while
    // throughput is measured, so that it taxes no implementation.
    alloc::pause_counting(true);
    let r = runtime(flavour).block_on(one(static_name(name), static_name(flavour), n, producers));
    println!(
        "ROW\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}",
        r.name,
        r.flavour,
        r.producers,
        r.schedule_rate,
        r.cancel_rate,
        r.p50,
        r.p99,
        r.max,
        r.fired
    );
}

fn parse_row(line: &str) -> Option<Row> {
    let f: Vec<&str> = line.strip_prefix("ROW\t")?.split('\t').collect();
    Some(Row {
        name: static_name(f[0]),
        flavour: static_name(f[1]),
        producers: f[2].parse().ok()?,
        schedule_rate: f[3].parse().ok()?,
        cancel_rate: f[4].parse().ok()?,
        p50: f[5].parse().ok()?,
        p99: f[6].parse().ok()?,
        max: f[7].parse().ok()?,
        fired: f[8].parse().ok()?,
    })
}

#[path = "../tests/support/runs.rs"]
mod runs;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let n = if quick { 100_000 } else { 1_000_000 };
    if let Some(i) = args.iter().position(|a| a == "--child") {
        let producers = args[i + 3].parse().expect("producers");
        child(&args[i + 1], &args[i + 2], producers, n);
        return;
    }
    let repeat: usize = args
        .iter()
        .position(|a| a == "--repeat")
        .map(|i| args[i + 1].parse().expect("--repeat N"))
        .unwrap_or(3)
        .max(1);

    // Every run in its own process, interleaved: A B C D A B C D ...
    let configs: Vec<(&str, &str, usize)> = CONFIGS
        .iter()
        .flat_map(|&(flavour, producers)| IMPLS.iter().map(move |&name| (name, flavour, producers)))
        .collect();
    let rows: Vec<Row> = runs::interleave(
        repeat,
        &configs,
        |(name, flavour, producers)| format!("{name} {flavour} x{producers}"),
        |&(name, flavour, producers)| {
            let producers = producers.to_string();
            let mut args = vec!["--child", name, flavour, &producers];
            if quick {
                args.push("--quick");
            }
            runs::child(args).and_then(|text| text.lines().find_map(parse_row))
        },
    )
    .into_iter()
    .map(|(_, row)| row)
    .collect();
    assert_eq!(
        rows.len(),
        configs.len() * repeat,
        "a child run failed (its error is above)"
    );

    // Bytes per pending timer: exact counts, the same in every run; once each.
    let rt = runtime("current_thread");
    let bytes: Vec<(&str, f64)> = IMPLS
        .iter()
        .map(|name| (*name, rt.block_on(bytes_per_pending(name, n))))
        .collect();
    let bytes_of = |name: &str| {
        bytes
            .iter()
            .find(|(b, _)| *b == name)
            .map_or(f64::NAN, |(_, v)| *v)
    };

    println!(
        "timers: {n}, delays 1..1000 ms, {}% cancelled; medians of {repeat} interleaved runs, each in its own process, [min..max]",
        CANCEL_PER_BATCH * 100 / BATCH
    );
    println!(
        "| implementation | runtime | producers | schedule M/s | cancel M/s | bytes/pending | lateness p50 / p99 / max (ms) | fired |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let mut medians: Vec<(&str, &str, usize, f64, f64)> = Vec::new();
    for (flavour, producers) in CONFIGS {
        for name in IMPLS {
            let these: Vec<&Row> = rows
                .iter()
                .filter(|r| r.name == name && r.flavour == flavour && r.producers == producers)
                .collect();
            let col = |f: fn(&Row) -> f64| runs::spread(these.iter().map(|r| f(r)));
            let (s, s0, s1) = col(|r| r.schedule_rate / 1e6);
            let (c, c0, c1) = col(|r| r.cancel_rate / 1e6);
            let (p50, ..) = col(|r| r.p50 as f64 / 1000.0);
            let (p99, p99a, p99b) = col(|r| r.p99 as f64 / 1000.0);
            let (max, ..) = col(|r| r.max as f64 / 1000.0);
            let (fired, ..) = col(|r| r.fired as f64);
            println!(
                "| {name} | {flavour} | {producers} | {s:.2} [{s0:.2}..{s1:.2}] | {c:.2} [{c0:.2}..{c1:.2}] | {:.0} | {p50:.2} / {p99:.2} [{p99a:.2}..{p99b:.2}] / {max:.2} | {fired:.0} |",
                bytes_of(name)
            );
            medians.push((name, flavour, producers, s, c));
        }
    }
    println!();
    println!("ratios of medians (ours / peer, same runtime and producers):");
    for &(name, flavour, producers, s, c) in medians.iter().filter(|m| m.0 != IMPLS[0]) {
        if let Some(&(_, _, _, os, oc)) = medians
            .iter()
            .find(|o| o.0 == IMPLS[0] && o.1 == flavour && o.2 == producers)
        {
            println!(
                "  vs {name:<15} {flavour:<14} x{producers}: schedule {:.2}x, cancel {:.2}x, bytes {:.2}x",
                os / s,
                oc / c,
                bytes_of(IMPLS[0]) / bytes_of(name)
            );
        }
    }
}
