//! A port of Kafka's `TestPurgatoryPerformance`, with Rust peers side by side.
//!
//! ```sh
//! cargo run --release --example purgatory_perf -- --num 1000000 --rate 200000 \
//!     --key-space-size 1000 --keys 3 --timeout 200 --pct50 50 --pct75 150
//! ```
//!
//! Options (Kafka's, same meanings): `--num` requests, `--rate` per second
//! (Poisson arrivals), `--keys` per request (default 3) named from
//! `--key-space-size` (default 100), `--timeout` ms, `--pct50` / `--pct75` ms of a
//! log-normal completion latency (mu = ln pct50, sigma = (ln pct75 - ln pct50) /
//! 0.674490), `--size` bytes of payload per request (default 0). A request whose
//! sampled latency is below the timeout is completed at arrival + latency by a
//! completion driver (the original Scala version's semantics); the rest expire.
//!
//! Added:
//! - `--mode kafka|key|awaited`: `kafka` (all requests watch the same `--keys`
//!   keys; the driver completes the request itself, as Kafka's completion thread
//!   calls `forceComplete`), `key` (each request watches `--keys` random keys; the
//!   driver calls `try_complete_watched` on its first key), `awaited` (as `kafka`,
//!   but every request is a task awaiting its handle).
//! - `--impl purgatory|task|delayqueue`: this crate; a task per request awaiting
//!   `tokio::time::timeout` on a completion signal with a `DashMap` of key ->
//!   watchers; a purgatory built on one `tokio_util::time::DelayQueue`.
//! - `--runtime current|multi` (multi: 2 workers).
//! - `--compare`: runs every implementation (each in its own process, so CPU and
//!   peak RSS are its own) and prints a table.
//! - `--sweep R1,R2,...`: runs every implementation at each target rate and writes
//!   `--out` (default `target/purgatory-perf`) `.csv` and `.svg`: achieved against
//!   target rate, as in Kafka's 2015 purgatory redesign write-up.
//!
//! Printed per run: Kafka's line (elapsed ms, target rate, actual rate, process
//! CPU ms), then peak RSS, completed and expired counts, expiry lateness
//! p50/p99/max (expiry time minus deadline), and a progress line while it runs.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dashmap::DashMap;
use hdrhistogram::Histogram;
use tokio::sync::oneshot;
use tokio::time::Instant;
use tokio_purgatory::{OpRef, Operation, Purgatory};

// ---------------------------------------------------------------- options

#[derive(Debug, Clone)]
struct Opts {
    num: usize,
    rate: f64,
    keys: usize,
    key_space: usize,
    timeout_ms: u64,
    pct50: f64,
    pct75: f64,
    size: usize,
    mode: String,
    imp: String,
    runtime: String,
    compare: bool,
    sweep: Option<Vec<f64>>,
    out: String,
    chart: Option<String>,
    quiet: bool,
}

fn parse() -> Opts {
    let mut o = Opts {
        num: 1_000_000,
        rate: 200_000.0,
        keys: 3,
        key_space: 100,
        timeout_ms: 200,
        pct50: 50.0,
        pct75: 150.0,
        size: 0,
        mode: "kafka".into(),
        imp: "purgatory".into(),
        runtime: "multi".into(),
        compare: false,
        sweep: None,
        out: "target/purgatory-perf".into(),
        chart: None,
        quiet: false,
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < args.len() {
        let flag = args[i].as_str();
        let val = || {
            args.get(i + 1)
                .cloned()
                .unwrap_or_else(|| usage(&format!("{flag} needs a value")))
        };
        let num = |v: String| -> f64 {
            v.parse()
                .unwrap_or_else(|_| usage(&format!("{flag}: not a number: {v}")))
        };
        match flag {
            "--num" => o.num = num(val()) as usize,
            "--rate" => o.rate = num(val()),
            "--keys" => o.keys = num(val()) as usize,
            "--key-space-size" => o.key_space = num(val()) as usize,
            "--timeout" => o.timeout_ms = num(val()) as u64,
            "--pct50" => o.pct50 = num(val()),
            "--pct75" => o.pct75 = num(val()),
            "--size" => o.size = num(val()) as usize,
            "--mode" => o.mode = val(),
            "--impl" => o.imp = val(),
            "--runtime" => o.runtime = val(),
            "--out" => o.out = val(),
            "--chart" => o.chart = Some(val()),
            "--sweep" => {
                o.sweep = Some(val().split(',').map(|r| num(r.to_string())).collect());
            }
            "--compare" => {
                o.compare = true;
                i += 1;
                continue;
            }
            "--quiet" => {
                o.quiet = true;
                i += 1;
                continue;
            }
            "--help" | "-h" => usage(""),
            other => usage(&format!("unknown option {other}")),
        }
        i += 2;
    }
    if !["kafka", "key", "awaited"].contains(&o.mode.as_str()) {
        usage("--mode is kafka, key or awaited");
    }
    if !["purgatory", "task", "delayqueue"].contains(&o.imp.as_str()) {
        usage("--impl is purgatory, task or delayqueue");
    }
    if !["current", "multi"].contains(&o.runtime.as_str()) {
        usage("--runtime is current or multi");
    }
    if o.keys == 0
        || o.key_space == 0
        || o.num == 0
        || o.rate <= 0.0
        || o.pct50 <= 0.0
        || o.pct75 < o.pct50
    {
        usage("--num, --rate, --keys, --key-space-size must be positive and pct75 >= pct50 > 0");
    }
    o
}

fn usage(err: &str) -> ! {
    if !err.is_empty() {
        eprintln!("error: {err}");
    }
    eprintln!(
        "usage: purgatory_perf [--num N] [--rate R] [--keys K] [--key-space-size S] [--timeout MS]\n\
         \t[--pct50 MS] [--pct75 MS] [--size BYTES] [--mode kafka|key|awaited]\n\
         \t[--impl purgatory|task|delayqueue] [--runtime current|multi]\n\
         \t[--compare] [--sweep R1,R2,..] [--out PREFIX] [--chart CSV] [--quiet]"
    );
    std::process::exit(if err.is_empty() { 0 } else { 2 })
}

// ---------------------------------------------------------------- sampling

#[path = "../tests/support/rng.rs"]
mod rng;
use rng::Rng;

// ---------------------------------------------------------------- measurements

/// Process CPU time (user + system) in ms, from /proc/self/stat.
fn cpu_ms() -> u64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command name (which may hold spaces) start after ')'.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    // `rest` starts at field 3 (state); utime and stime are fields 14 and 15.
    let f: Vec<&str> = rest.split_whitespace().collect();
    let field = |i: usize| f.get(i).and_then(|x| x.parse::<u64>().ok()).unwrap_or(0);
    let ticks = field(11) + field(12);
    ticks * 1000 / 100 // USER_HZ is 100 on Linux
}

#[path = "../tests/support/proc.rs"]
mod procfs;

/// Peak resident set size in MB.
fn peak_rss_mb() -> f64 {
    procfs::status_mb("VmHWM")
}

#[derive(Default)]
struct Counts {
    completed: AtomicUsize,
    expired: AtomicUsize,
    lateness: Mutex<Option<Histogram<u64>>>,
}

impl Counts {
    fn expired_at(&self, deadline: Instant) {
        let late = Instant::now()
            .saturating_duration_since(deadline)
            .as_micros() as u64;
        if let Some(h) = self.lateness.lock().unwrap().as_mut() {
            h.record(late.max(1)).ok();
        }
        self.expired.fetch_add(1, Ordering::Relaxed);
    }
    fn done(&self) -> usize {
        self.completed.load(Ordering::Relaxed) + self.expired.load(Ordering::Relaxed)
    }
}

// ---------------------------------------------------------------- the request

/// Kafka's `FakeOperation`: completable once its completion time has come.
struct FakeOp {
    completes_at: Option<Instant>,
    deadline: Instant,
    _data: Vec<u8>,
    counts: Arc<Counts>,
}

impl FakeOp {
    fn completable(&self) -> bool {
        self.completes_at.is_some_and(|t| Instant::now() >= t)
    }
}

impl Operation for FakeOp {
    type Output = ();
    fn try_complete(&mut self) -> Option<()> {
        self.completable().then(|| {
            self.counts.completed.fetch_add(1, Ordering::Relaxed);
        })
    }
    fn on_expiration(self) {
        self.counts.expired_at(self.deadline);
    }
}

/// What the completion driver acts on when a request's time comes.
enum Token {
    Op(OpRef<u32, FakeOp>),
    Key(u32),
    Signal(oneshot::Sender<()>),
    Id(u64),
}

/// The three implementations, behind one face.
enum Target {
    Purgatory(Purgatory<u32, FakeOp>),
    Task(Arc<TaskPeer>),
    Dq(Arc<DqPeer>),
}

// ---- peer (a): a task per request, `tokio::time::timeout` on a signal, DashMap of watchers

/// A watcher of the task-per-request peer: when it completes, and its signal.
type Watcher = (Option<Instant>, Arc<Mutex<Option<oneshot::Sender<()>>>>);

struct TaskPeer {
    watchers: DashMap<u32, HashMap<u64, Watcher>>,
    next_id: AtomicU64,
}

impl TaskPeer {
    fn register(self: &Arc<Self>, op: FakeOp, keys: &[u32], token_signal: bool) -> Option<Token> {
        let (tx, rx) = oneshot::channel();
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let tx = Arc::new(Mutex::new(Some(tx)));
        for k in keys {
            self.watchers
                .entry(*k)
                .or_default()
                .insert(id, (op.completes_at, tx.clone()));
        }
        let me = self.clone();
        let keys = keys.to_vec();
        let deadline = op.deadline;
        let completes = op.completes_at.is_some();
        tokio::spawn(async move {
            match tokio::time::timeout_at(deadline, rx).await {
                Ok(Ok(())) => {
                    op.counts.completed.fetch_add(1, Ordering::Relaxed);
                }
                Ok(Err(_)) => {
                    // Nobody can signal any more: only the timeout is left.
                    tokio::time::sleep_until(deadline).await;
                    op.counts.expired_at(deadline);
                }
                Err(_) => op.counts.expired_at(deadline),
            }
            for k in &keys {
                if let Some(mut w) = me.watchers.get_mut(k) {
                    w.remove(&id);
                }
            }
        });
        (token_signal && completes)
            .then(|| Token::Signal(tx.lock().unwrap().take().expect("fresh")))
    }

    fn complete_key(&self, key: u32) {
        let now = Instant::now();
        let due: Vec<_> = match self.watchers.get(&key) {
            Some(w) => w
                .values()
                .filter(|(at, _)| at.is_some_and(|t| now >= t))
                .map(|(_, tx)| tx.clone())
                .collect(),
            None => return,
        };
        for tx in due {
            if let Some(tx) = tx.lock().unwrap().take() {
                let _ = tx.send(());
            }
        }
    }
}

// ---- peer (b): a purgatory on one DelayQueue (mutex-guarded, one driver task)

struct DqState {
    queue: tokio_util::time::DelayQueue<u64>,
    ops: HashMap<
        u64,
        (
            FakeOp,
            tokio_util::time::delay_queue::Key,
            Option<oneshot::Sender<()>>,
        ),
    >,
    watchers: HashMap<u32, Vec<u64>>,
    next_id: u64,
}

struct DqPeer {
    state: Mutex<DqState>,
}

impl DqPeer {
    fn register(
        &self,
        op: FakeOp,
        keys: &[u32],
        awaited: bool,
    ) -> (u64, Option<oneshot::Receiver<()>>) {
        let mut s = self.state.lock().unwrap();
        let id = s.next_id;
        s.next_id += 1;
        let key = s.queue.insert_at(id, op.deadline);
        let (tx, rx) = if awaited {
            let (tx, rx) = oneshot::channel();
            (Some(tx), Some(rx))
        } else {
            (None, None)
        };
        for k in keys {
            s.watchers.entry(*k).or_default().push(id);
        }
        s.ops.insert(id, (op, key, tx));
        (id, rx)
    }

    fn complete(&self, id: u64) {
        let done = {
            let mut s = self.state.lock().unwrap();
            let Some((op, key, tx)) = s.ops.remove(&id) else {
                return;
            };
            s.queue.remove(&key);
            (op, tx)
        };
        done.0.counts.completed.fetch_add(1, Ordering::Relaxed);
        if let Some(tx) = done.1 {
            let _ = tx.send(());
        }
    }

    fn complete_key(&self, key: u32) {
        let mut done = Vec::new();
        {
            let mut s = self.state.lock().unwrap();
            let Some(mut ids) = s.watchers.remove(&key) else {
                return;
            };
            ids.retain(|id| match s.ops.get(id) {
                None => false, // finished through another key: prune
                Some((op, _, _)) if op.completable() => {
                    let (op, k, tx) = s.ops.remove(id).unwrap();
                    s.queue.remove(&k);
                    done.push((op, tx));
                    false
                }
                Some(_) => true,
            });
            if !ids.is_empty() {
                s.watchers.insert(key, ids);
            }
        }
        for (op, tx) in done {
            op.counts.completed.fetch_add(1, Ordering::Relaxed);
            if let Some(tx) = tx {
                let _ = tx.send(());
            }
        }
    }

    async fn drive(self: Arc<Self>, stop: Arc<tokio::sync::Notify>) {
        use std::future::poll_fn;
        use std::task::Poll;
        let stopped = stop.notified();
        tokio::pin!(stopped);
        loop {
            let expired = poll_fn(|cx| {
                if stopped.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(None);
                }
                let mut s = self.state.lock().unwrap();
                match s.queue.poll_expired(cx) {
                    Poll::Ready(Some(e)) => {
                        let id = e.into_inner();
                        Poll::Ready(Some(s.ops.remove(&id)))
                    }
                    Poll::Ready(None) | Poll::Pending => Poll::Pending,
                }
            })
            .await;
            match expired {
                None => return,
                Some(Some((op, _, tx))) => {
                    op.counts.expired_at(op.deadline);
                    drop(tx); // an awaiting task sees the sender dropped: expired
                }
                Some(None) => {}
            }
        }
    }
}

use std::future::Future;

// ---------------------------------------------------------------- one run

struct RunResult {
    elapsed_ms: u64,
    target_rate: f64,
    actual_rate: f64,
    cpu_ms: u64,
    rss_mb: f64,
    completed: usize,
    expired: usize,
    p50: f64,
    p99: f64,
    max: f64,
}

async fn run(o: Opts) -> RunResult {
    let counts = Arc::new(Counts::default());
    *counts.lateness.lock().unwrap() = Some(Histogram::new(3).unwrap());
    let mut rng = Rng(0x5EED ^ o.num as u64);
    let mu = o.pct50.ln();
    let sigma = (o.pct75.ln() - mu) / 0.674490;
    let timeout = Duration::from_millis(o.timeout_ms);
    let shared_keys: Vec<u32> = (0..o.keys)
        .map(|_| rng.below(o.key_space as u64) as u32)
        .collect();
    let stop = Arc::new(tokio::sync::Notify::new());

    let target = match o.imp.as_str() {
        "purgatory" => Target::Purgatory(Purgatory::builder("perf").build().unwrap()),
        "task" => Target::Task(Arc::new(TaskPeer {
            watchers: DashMap::new(),
            next_id: AtomicU64::new(0),
        })),
        _ => {
            let peer = Arc::new(DqPeer {
                state: Mutex::new(DqState {
                    queue: tokio_util::time::DelayQueue::new(),
                    ops: HashMap::new(),
                    watchers: HashMap::new(),
                    next_id: 0,
                }),
            });
            tokio::spawn(peer.clone().drive(stop.clone()));
            Target::Dq(peer)
        }
    };
    let target = Arc::new(target);

    // The completion driver: tokens in 1 ms buckets, acted on when due.
    let start = Instant::now();
    let buckets: Arc<Mutex<Vec<Vec<Token>>>> = Arc::new(Mutex::new(Vec::new()));
    let driver = {
        let buckets = buckets.clone();
        let target = target.clone();
        let counts = counts.clone();
        let total = o.num;
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(1));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            let mut next = 0usize;
            while counts.done() < total {
                tick.tick().await;
                let now_ms = start.elapsed().as_millis() as usize;
                let due: Vec<Token> = {
                    let mut b = buckets.lock().unwrap();
                    let upto = (now_ms + 1).min(b.len());
                    let mut due = Vec::new();
                    for slot in b.iter_mut().take(upto).skip(next) {
                        due.append(slot);
                    }
                    next = next.max(upto);
                    due
                };
                for t in due {
                    match (&*target, t) {
                        (Target::Purgatory(_), Token::Op(r)) => {
                            r.try_complete();
                        }
                        (Target::Purgatory(p), Token::Key(k)) => {
                            p.try_complete_watched(&k);
                        }
                        (Target::Task(_), Token::Signal(tx)) => {
                            let _ = tx.send(());
                        }
                        (Target::Task(peer), Token::Key(k)) => peer.complete_key(k),
                        (Target::Dq(peer), Token::Id(id)) => peer.complete(id),
                        (Target::Dq(peer), Token::Key(k)) => peer.complete_key(k),
                        _ => unreachable!("token matches its target"),
                    }
                }
            }
        })
    };

    // Progress, once a second, on stderr.
    let progress = {
        let counts = counts.clone();
        let quiet = o.quiet;
        let num = o.num;
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            tick.tick().await;
            loop {
                tick.tick().await;
                if !quiet {
                    eprintln!(
                        "  .. {:>6.1} s: {} of {} finished ({} completed, {} expired), rss {:.0} MB",
                        start.elapsed().as_secs_f64(),
                        counts.done(),
                        num,
                        counts.completed.load(Ordering::Relaxed),
                        counts.expired.load(Ordering::Relaxed),
                        peak_rss_mb()
                    );
                }
            }
        })
    };

    let cpu0 = cpu_ms();
    let awaited = o.mode == "awaited";
    let key_driven = o.mode == "key";
    let mut arrival = start;
    let mut keys = shared_keys.clone();
    let mean_interval_ns = 1e9 / o.rate;
    for i in 0..o.num {
        // Poisson arrivals: exponential intervals. Sleep only when at least 1 ms
        // ahead, as Kafka's generator does (its clock is in ms).
        let interval = -mean_interval_ns * rng.unit().ln();
        arrival += Duration::from_nanos(interval as u64);
        let now = Instant::now();
        if arrival > now + Duration::from_millis(1) {
            tokio::time::sleep_until(arrival).await;
        } else if i % 256 == 0 {
            tokio::task::yield_now().await;
        }
        let latency_ms = (mu + sigma * rng.normal()).exp();
        let completes = latency_ms < o.timeout_ms as f64;
        let completes_at =
            completes.then(|| arrival + Duration::from_secs_f64(latency_ms / 1000.0));
        if key_driven {
            for k in keys.iter_mut() {
                *k = rng.below(o.key_space as u64) as u32;
            }
        }
        let op = FakeOp {
            completes_at,
            deadline: arrival + timeout,
            _data: vec![0; o.size],
            counts: counts.clone(),
        };
        let token = match &*target {
            Target::Purgatory(p) => {
                let handle = p
                    .try_complete_else_watch(op, timeout, keys.iter().copied())
                    .unwrap();
                let token = if key_driven {
                    Some(Token::Key(keys[0]))
                } else {
                    handle.op_ref().map(Token::Op)
                };
                if awaited {
                    // Detached: the driver waits until every request has finished,
                    // and a kept JoinHandle would hold the finished task's memory.
                    tokio::spawn(async move {
                        let _ = handle.await;
                    });
                } else {
                    handle.detach();
                }
                token
            }
            Target::Task(peer) => {
                let t = peer.register(op, &keys, !key_driven);
                if key_driven {
                    Some(Token::Key(keys[0]))
                } else {
                    t
                }
            }
            Target::Dq(peer) => {
                let (id, rx) = peer.register(op, &keys, awaited);
                if let Some(rx) = rx {
                    tokio::spawn(async move {
                        let _ = rx.await;
                    });
                }
                Some(if key_driven {
                    Token::Key(keys[0])
                } else {
                    Token::Id(id)
                })
            }
        };
        if let (Some(at), Some(token)) = (completes_at, token) {
            // The bucket of the first whole millisecond at or after `at`, so the
            // check the driver runs finds the request completable.
            let ms = at.saturating_duration_since(start).as_millis() as usize + 1;
            let mut b = buckets.lock().unwrap();
            if b.len() <= ms {
                b.resize_with(ms + 1, Vec::new);
            }
            b[ms].push(token);
        }
    }
    let end = Instant::now();
    driver.await.unwrap();
    let done = Instant::now();
    progress.abort();
    stop.notify_one();
    let cpu = cpu_ms() - cpu0;
    let h = counts.lateness.lock().unwrap().take().unwrap();
    let ms = |v: u64| v as f64 / 1000.0;
    RunResult {
        elapsed_ms: (done - start).as_millis() as u64,
        target_rate: o.num as f64 / (arrival - start).as_secs_f64(),
        actual_rate: o.num as f64 / (end - start).as_secs_f64(),
        cpu_ms: cpu,
        rss_mb: peak_rss_mb(),
        completed: counts.completed.load(Ordering::Relaxed),
        expired: counts.expired.load(Ordering::Relaxed),
        p50: ms(h.value_at_quantile(0.5)),
        p99: ms(h.value_at_quantile(0.99)),
        max: ms(h.max()),
    }
}

// ---------------------------------------------------------------- driving runs

fn single(o: &Opts) -> RunResult {
    let rt = if o.runtime == "current" {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
    }
    .unwrap();
    rt.block_on(run(o.clone()))
}

const COLUMNS: &str = "impl\tmode\truntime\telapsed_ms\ttarget_rate\tactual_rate\tcpu_ms\tpeak_rss_mb\tcompleted\texpired\tlate_p50_ms\tlate_p99_ms\tlate_max_ms";

fn row(o: &Opts, r: &RunResult) -> String {
    format!(
        "{}\t{}\t{}\t{}\t{:.0}\t{:.0}\t{}\t{:.1}\t{}\t{}\t{:.2}\t{:.2}\t{:.2}",
        o.imp,
        o.mode,
        o.runtime,
        r.elapsed_ms,
        r.target_rate,
        r.actual_rate,
        r.cpu_ms,
        r.rss_mb,
        r.completed,
        r.expired,
        r.p50,
        r.p99,
        r.max
    )
}

/// Runs one configuration in a child process and returns its result row.
fn child(o: &Opts, imp: &str, rate: f64) -> Option<String> {
    let exe = std::env::current_exe().ok()?;
    let out = std::process::Command::new(exe)
        .args([
            "--num",
            &o.num.to_string(),
            "--rate",
            &rate.to_string(),
            "--keys",
            &o.keys.to_string(),
            "--key-space-size",
            &o.key_space.to_string(),
            "--timeout",
            &o.timeout_ms.to_string(),
            "--pct50",
            &o.pct50.to_string(),
            "--pct75",
            &o.pct75.to_string(),
            "--size",
            &o.size.to_string(),
            "--mode",
            &o.mode,
            "--impl",
            imp,
            "--runtime",
            &o.runtime,
            "--quiet",
        ])
        .stderr(std::process::Stdio::inherit())
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    text.lines()
        .find_map(|l| l.strip_prefix("ROW\t").map(str::to_string))
}

fn svg(rows: &[(String, f64, f64)], path: &str, title: &str) -> std::io::Result<()> {
    let (w, h, m) = (720.0, 480.0, 70.0);
    let max = rows.iter().map(|r| r.1.max(r.2)).fold(1.0, f64::max) * 1.05;
    let x = |v: f64| m + v / max * (w - 2.0 * m);
    let y = |v: f64| h - m - v / max * (h - 2.0 * m);
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(
        s,
        r#"<rect width="100%" height="100%" fill="white"/><text x="{}" y="24" text-anchor="middle" font-size="14">{title}</text>"#,
        w / 2.0
    );
    let _ = writeln!(
        s,
        r#"<line x1="{m}" y1="{}" x2="{}" y2="{}" stroke="black"/><line x1="{m}" y1="{m}" x2="{m}" y2="{}" stroke="black"/>"#,
        h - m,
        w - m,
        h - m,
        h - m
    );
    for i in 0..=5 {
        let v = max * i as f64 / 5.0;
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="middle">{:.0}k</text><text x="{}" y="{}" text-anchor="end">{:.0}k</text>"#,
            x(v),
            h - m + 18.0,
            v / 1000.0,
            m - 6.0,
            y(v) + 4.0,
            v / 1000.0
        );
    }
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">target rate (requests/s)</text><text x="18" y="{}" transform="rotate(-90 18 {})" text-anchor="middle">achieved rate (requests/s)</text>"#,
        w / 2.0,
        h - 20.0,
        h / 2.0,
        h / 2.0
    );
    let _ = writeln!(
        s,
        r##"<line x1="{}" y1="{}" x2="{}" y2="{}" stroke="#bbb" stroke-dasharray="4"/>"##,
        x(0.0),
        y(0.0),
        x(max),
        y(max)
    );
    let colours = ["#d62728", "#1f77b4", "#2ca02c", "#9467bd"];
    let mut names: Vec<&String> = rows.iter().map(|r| &r.0).collect();
    names.dedup();
    for (i, name) in names.iter().enumerate() {
        let c = colours[i % colours.len()];
        let pts: Vec<String> = rows
            .iter()
            .filter(|r| &r.0 == *name)
            .map(|r| format!("{:.1},{:.1}", x(r.1), y(r.2)))
            .collect();
        let _ = writeln!(
            s,
            r#"<polyline fill="none" stroke="{c}" stroke-width="2" points="{}"/>"#,
            pts.join(" ")
        );
        for p in &pts {
            let (px, py) = p.split_once(',').unwrap();
            let _ = writeln!(s, r#"<circle cx="{px}" cy="{py}" r="3" fill="{c}"/>"#);
        }
        let label = match name.as_str() {
            "purgatory" => "tokio-purgatory",
            "task" => "task per request + DashMap",
            "delayqueue" => "purgatory on one DelayQueue",
            other => other,
        };
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" fill="{c}">{label}</text>"#,
            m + 12.0,
            m + 16.0 * i as f64
        );
    }
    s.push_str("</svg>\n");
    std::fs::write(path, s)
}

/// Draws the SVG of a CSV written by `--sweep` (next to it, same name).
fn chart(csv_path: &str) {
    let text = std::fs::read_to_string(csv_path).expect("read csv");
    let mut points = Vec::new();
    let mut title = String::new();
    for line in text.lines().skip(1) {
        let f: Vec<&str> = line.split('\t').collect();
        if f.len() < 7 {
            continue;
        }
        title = format!("achieved vs target rate: mode {}, {} runtime", f[2], f[3]);
        let t: f64 = f[5].parse().unwrap_or(0.0);
        let a: f64 = f[6].parse().unwrap_or(0.0);
        points.push((f[1].to_string(), t, a));
    }
    points.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.total_cmp(&b.1)));
    let out = csv_path.trim_end_matches(".csv").to_string() + ".svg";
    svg(&points, &out, &title).expect("write svg");
    println!("wrote {out}");
}

fn main() {
    let o = parse();
    if let Some(csv) = &o.chart {
        chart(csv);
        return;
    }
    let imps = ["purgatory", "task", "delayqueue"];
    if let Some(rates) = &o.sweep {
        let mut csv = String::from("target_rate_requested\t");
        csv.push_str(COLUMNS);
        csv.push('\n');
        let mut points = Vec::new();
        for &rate in rates {
            for imp in imps {
                if let Some(r) = child(&o, imp, rate) {
                    println!("{rate:.0}\t{r}");
                    let f: Vec<&str> = r.split('\t').collect();
                    let t: f64 = f[4].parse().unwrap_or(0.0);
                    let a: f64 = f[5].parse().unwrap_or(0.0);
                    points.push((imp.to_string(), t, a));
                    let _ = writeln!(csv, "{rate}\t{r}");
                }
            }
        }
        std::fs::create_dir_all(
            std::path::Path::new(&o.out)
                .parent()
                .unwrap_or(std::path::Path::new(".")),
        )
        .ok();
        std::fs::write(format!("{}.csv", o.out), csv).expect("write csv");
        points.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.total_cmp(&b.1)));
        let title = format!(
            "achieved vs target rate: mode {}, {} runtime, {} requests, {} keys of {}",
            o.mode, o.runtime, o.num, o.keys, o.key_space
        );
        svg(&points, &format!("{}.svg", o.out), &title).expect("write svg");
        println!("wrote {0}.csv and {0}.svg", o.out);
        return;
    }
    if o.compare {
        println!("{COLUMNS}");
        for imp in imps {
            match child(&o, imp, o.rate) {
                Some(r) => println!("{r}"),
                None => println!("{imp}\t(failed)"),
            }
        }
        return;
    }
    let r = single(&o);
    if !o.quiet {
        println!("# <elapsed time ms>\t<target rate>\t<actual rate>\t<process cpu time ms>");
        println!(
            "{}\t{:.6}\t{:.6}\t{}",
            r.elapsed_ms, r.target_rate, r.actual_rate, r.cpu_ms
        );
        println!(
            "# peak rss {:.1} MB; completed {}, expired {}; expiry lateness p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
            r.rss_mb, r.completed, r.expired, r.p50, r.p99, r.max
        );
    }
    println!("ROW\t{}", row(&o, &r));
}
