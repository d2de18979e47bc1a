//! A port of Kafka's `TestPurgatoryPerformance`, with Rust peers side by side.
//!
//! ```sh
//! cargo run --release --example purgatory_perf -- --num 1000000 --rate 200000 \
//!     --key-space-size 1000 --keys 3 --timeout 200 --pct50 50 --pct75 150
//! ```
//!
//! Options (Kafka's, same meanings; `--help` lists them all): `--num` requests, `--rate` per second
//! (Poisson arrivals), `--keys` per request (default 3) named from
//! `--key-space-size` (default 100), `--timeout` ms, `--pct50` / `--pct75` ms of a
//! log-normal completion latency (mu = ln pct50, sigma = (ln pct75 - ln pct50) /
//! 0.674490), `--size` bytes of payload per request (default 0). A request whose
//! sampled latency is below the timeout is completed at arrival + latency by a
//! completion driver (the original Scala version's semantics); the rest expire.
//! The driver wakes every millisecond and works through what is due one 1 ms
//! slot at a time, yielding to the runtime between slots, so that a driver
//! behind schedule does not starve the other tasks (a reaper among them).
//!
//! Added:
//! - `--mode kafka|key|awaited|offsets`: `kafka` (each request watches `--keys`
//!   keys drawn at random, as produce requests land on different partitions;
//!   the driver completes the request by reference, running its check),
//!   `key` (the driver calls `try_complete_watched` on the request's first
//!   key, which checks every watcher of that key), `awaited` (as `kafka`, but
//!   every request is a task awaiting its handle), `offsets` (see `--help`).
//!   `--shared-keys`: in `kafka` and `awaited` modes every request watches the
//!   same `--keys` keys (Kafka's original test), so every list holds every
//!   pending request.
//! - The completion driver's lag (how late it acts on each 1 ms slot) is
//!   reported beside the generators' registration lag, so a driver falling
//!   behind is seen rather than guessed.
//! - `--impl purgatory|task|fair|floor`: this crate; a task per request awaiting
//!   `tokio::time::timeout` on a completion signal with a `DashMap` of key ->
//!   watchers; the fair one-lock purgatory (a `tokio_util::time::DelayQueue`, a
//!   slab with generation-checked ids and `HashMap<key, Vec<id>>` lists behind
//!   one mutex, running every check this crate runs and purging as Kafka); the
//!   harness alone, with no purgatory (the CPU floor under every run).
//! - `--runtime current|multi` (multi: 2 workers).
//! - `--generators N`: N generator tasks share the load, so saturation measures
//!   the implementation rather than one generator (default 1, as Kafka's).
//! - `--compare`: runs every implementation `--repeat` times (default 3),
//!   interleaved (A B C A B C ...), each run in its own process so CPU and peak
//!   RSS are its own, and prints medians with [min..max] and the ratios of this
//!   crate against the best peer. The load average is printed before each run.
//!   It runs the harness alone too, and prints each one's CPU above that floor.
//! - `--sweep R1,R2,...`: runs every implementation at each target rate and writes
//!   `--out` (default `target/purgatory-perf`) `.csv` and `.svg`: achieved against
//!   target rate, as in Kafka's 2015 purgatory redesign write-up.
//!
//! Every implementation is given the same absolute deadline per request: its
//! scheduled arrival plus the timeout. A generator running behind its schedule is
//! so not charged to any of them as lateness; that lag is reported on its own.
//!
//! Printed per run: Kafka's line (elapsed ms, target rate, actual rate, process
//! CPU ms), then peak RSS, completed and expired counts, expiry lateness
//! p50/p99/max (expiry time minus deadline), the registration lag p99 (time of
//! registration minus scheduled arrival), and a progress line while it runs.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dashmap::DashMap;
use hdrhistogram::Histogram;
use tokio::sync::oneshot;
use tokio::time::Instant;
use tokio_purgatory::{OpRef, Operation, Purgatory, Watch};

// ---------------------------------------------------------------- options

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Mode {
    /// Each request watches `--keys` keys drawn at random (all the same keys
    /// with `--shared-keys`); the driver completes each request by reference,
    /// running its check.
    Kafka,
    /// Random keys per request; the driver walks the request's first key.
    Key,
    /// As `kafka`, with a task per request awaiting its handle.
    Awaited,
    /// `acks=all` on partitions: each request is a produce at the next offset
    /// of a random partition (of `--key-space-size`), done once the
    /// partition's high watermark passes it; the driver advances the high
    /// watermark to cover each request when its completion time comes (so it
    /// covers every lower offset too). This crate watches at the offset
    /// (`Watch::level`, `try_complete_reached`); the peers walk the
    /// partition's watchers.
    Offsets,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Imp {
    /// This crate.
    Purgatory,
    /// A task per request, `tokio::time::timeout_at` on a signal, a DashMap of watchers.
    Task,
    /// The fair one-lock purgatory: a `tokio_util::time::DelayQueue`, a slab
    /// of requests with generation-checked ids and `HashMap<key, Vec<id>>`
    /// watch lists behind one mutex; it runs every check this crate runs and
    /// purges its lists as Kafka does.
    Fair,
    /// No purgatory: the harness alone (a request that would expire is counted
    /// expired at registration, one that would complete is counted when the
    /// driver reaches it). Its CPU is the floor under every implementation.
    Floor,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Runtime {
    Current,
    /// Two worker threads.
    Multi,
}

fn name<T: clap::ValueEnum>(v: &T) -> String {
    v.to_possible_value()
        .map(|p| p.get_name().to_string())
        .unwrap_or_default()
}

/// Kafka's `TestPurgatoryPerformance`, ported, with Rust peers side by side.
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "purgatory_perf")]
struct Opts {
    /// Requests to send.
    #[arg(long, default_value_t = 1_000_000)]
    num: usize,
    /// Requests per second (Poisson arrivals), across all generators.
    #[arg(long, default_value_t = 200_000.0)]
    rate: f64,
    /// Keys per request.
    #[arg(long, default_value_t = 3)]
    keys: usize,
    /// Keys are drawn from this many.
    #[arg(long = "key-space-size", default_value_t = 100)]
    key_space: usize,
    /// Timeout per request, ms.
    #[arg(long = "timeout", default_value_t = 200)]
    timeout_ms: u64,
    /// Median completion latency, ms (log-normal).
    #[arg(long, default_value_t = 50.0)]
    pct50: f64,
    /// 75th percentile completion latency, ms.
    #[arg(long, default_value_t = 150.0)]
    pct75: f64,
    /// `kafka` and `awaited` modes: every request watches the same `--keys`
    /// keys (drawn once) instead of keys drawn at random per request.
    #[arg(long)]
    shared_keys: bool,
    /// Payload bytes per request.
    #[arg(long, default_value_t = 0)]
    size: usize,
    #[arg(long, value_enum, default_value_t = Mode::Kafka)]
    mode: Mode,
    #[arg(long = "impl", value_enum, default_value_t = Imp::Purgatory)]
    imp: Imp,
    #[arg(long, value_enum, default_value_t = Runtime::Multi)]
    runtime: Runtime,
    /// This crate's wheel tick, in microseconds (default: the crate's default).
    #[arg(long)]
    tick_us: Option<u64>,
    /// Generator tasks sharing the load (1, as Kafka's).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    generators: u32,
    /// Run every implementation, interleaved, each run in its own process, and
    /// print medians and the ratios against the best peer.
    #[arg(long)]
    compare: bool,
    /// With --compare or --sweep: only these implementations (comma-separated;
    /// default all). The task-per-request peer takes seconds per run under
    /// overload, so a sweep may leave it out.
    #[arg(long, value_enum, value_delimiter = ',')]
    impls: Option<Vec<Imp>>,
    /// Repetitions of each implementation with --compare or --sweep.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    repeat: u32,
    /// Run every implementation at each of these rates (comma-separated) and
    /// write CSV and SVG charts to --out.
    #[arg(long, value_delimiter = ',')]
    sweep: Option<Vec<f64>>,
    /// Path prefix of the --sweep outputs.
    #[arg(long, default_value = "target/purgatory-perf")]
    out: String,
    /// Redraw the charts of a CSV written by --sweep.
    #[arg(long)]
    chart: Option<String>,
    /// No progress lines.
    #[arg(long)]
    quiet: bool,
}

fn parse() -> Opts {
    let o = <Opts as clap::Parser>::parse();
    if o.keys == 0
        || o.key_space == 0
        || o.num == 0
        || o.rate <= 0.0
        || o.pct50 <= 0.0
        || o.pct75 < o.pct50
    {
        <Opts as clap::CommandFactory>::command()
            .error(
                clap::error::ErrorKind::ValueValidation,
                "--num, --rate, --keys, --key-space-size must be positive and pct75 >= pct50 > 0",
            )
            .exit();
    }
    o
}

// ---------------------------------------------------------------- sampling

#[path = "../tests/support/rng.rs"]
mod rng;
use rng::Rng;

// ---------------------------------------------------------------- measurements

/// Process CPU time (user + system) in ms, from /proc/self/stat.
fn cpu_ms() -> u64 {
    procfs::cpu_ms("self")
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
    level: Option<Level>,
    _data: Vec<u8>,
    counts: Arc<Counts>,
}

impl FakeOp {
    fn completable(&self) -> bool {
        match &self.level {
            Some(l) => l.reached(),
            None => self.completes_at.is_some_and(|t| Instant::now() >= t),
        }
    }
}

/// `--mode offsets`: a produce's offset on its partition's high watermark.
#[derive(Clone)]
struct Level {
    hw: Arc<AtomicU64>,
    offset: u64,
}

impl Level {
    fn reached(&self) -> bool {
        self.hw.load(Ordering::Acquire) > self.offset
    }
}

/// `--mode offsets`: each partition's next offset and high watermark.
struct Partitions(Vec<(AtomicU64, Arc<AtomicU64>)>);

impl Partitions {
    fn new(n: usize) -> Partitions {
        Partitions(
            (0..n)
                .map(|_| (AtomicU64::new(0), Arc::default()))
                .collect(),
        )
    }
    /// Advances partition `p`'s high watermark past `offset`; returns it.
    fn cover(&self, p: u32, offset: u64) -> u64 {
        let hw = &self.0[p as usize].1;
        hw.fetch_max(offset + 1, Ordering::AcqRel).max(offset + 1)
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
    Id(Id),
    /// `--mode offsets`: cover this partition's offset.
    Reach(u32, u64),
}

/// The completion driver's tokens, in 1 ms slots from the start; `next` is the
/// first slot it has not drained.
#[derive(Default)]
struct Buckets {
    next: usize,
    slots: Vec<Vec<Token>>,
}

/// The implementations, behind one face.
enum Target {
    Purgatory(Purgatory<u32, FakeOp>),
    Task(Arc<TaskPeer>),
    Fair(Arc<FairPeer>),
    Floor,
}

// ---- peer (a): a task per request, `tokio::time::timeout` on a signal, DashMap of watchers

/// A watcher of the task-per-request peer: when it completes, and its signal.
type Watcher = (
    Option<Instant>,
    Option<Level>,
    Arc<Mutex<Option<oneshot::Sender<()>>>>,
);

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
                .insert(id, (op.completes_at, op.level.clone(), tx.clone()));
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
                .filter(|(at, level, _)| match level {
                    Some(l) => l.reached(),
                    None => at.is_some_and(|t| now >= t),
                })
                .map(|(_, _, tx)| tx.clone())
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

// ---- peer (b): the fair one-lock purgatory
//
// What a competent team writes in an afternoon instead of taking this crate: one
// mutex around a `DelayQueue`, a slab of requests with generation-checked ids
// and `HashMap<key, Vec<id>>` watch lists. It does the work this crate does:
// completing a request by reference runs its check and completes it only if
// the check says so; a walk runs the check of every live watcher of the key and
// drops dead ids from that list; a purge sweeps every list once dead ids exceed
// max(1,000, live ids) (Kafka's policy), so its memory stays flat; expiry is one
// task awaiting the queue. Checks run under the one lock (there is no other
// lock to run them under, and checking outside it would race events).

/// A request's id: its slot, and the slot's generation when it was taken.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Id {
    index: u32,
    generation: u32,
}

/// A pending request in the fair peer.
struct Pending {
    op: FakeOp,
    timer: tokio_util::time::delay_queue::Key,
    keys: u32,
    /// `--mode awaited`: the task awaiting this request.
    done: Option<oneshot::Sender<()>>,
}

struct Slot {
    generation: u32,
    pending: Option<Pending>,
}

struct FairState {
    queue: tokio_util::time::DelayQueue<Id>,
    slots: Vec<Slot>,
    free: Vec<u32>,
    watchers: HashMap<u32, Vec<Id>>,
    /// Ids in the lists whose request is pending, and whose request finished.
    live: usize,
    dead: usize,
}

impl FairState {
    fn new() -> FairState {
        FairState {
            queue: tokio_util::time::DelayQueue::new(),
            slots: Vec::new(),
            free: Vec::new(),
            watchers: HashMap::new(),
            live: 0,
            dead: 0,
        }
    }

    fn is_live(slots: &[Slot], id: Id) -> bool {
        let s = &slots[id.index as usize];
        s.generation == id.generation && s.pending.is_some()
    }

    /// An empty slot's id, for [`fill`](Self::fill) (the timer entry is made
    /// between the two, with the id it carries).
    fn vacant(&mut self) -> Id {
        let index = self.free.pop().unwrap_or_else(|| {
            self.slots.push(Slot {
                generation: 0,
                pending: None,
            });
            self.slots.len() as u32 - 1
        });
        Id {
            index,
            generation: self.slots[index as usize].generation,
        }
    }

    fn fill(&mut self, id: Id, pending: Pending) {
        self.live += pending.keys as usize;
        self.slots[id.index as usize].pending = Some(pending);
    }

    /// Takes a finished request out of its slot: its list entries are dead now.
    fn take(
        slots: &mut [Slot],
        free: &mut Vec<u32>,
        live: &mut usize,
        dead: &mut usize,
        id: Id,
    ) -> Pending {
        let slot = &mut slots[id.index as usize];
        let pending = slot.pending.take().expect("a live id");
        slot.generation = slot.generation.wrapping_add(1);
        free.push(id.index);
        *live -= pending.keys as usize;
        *dead += pending.keys as usize;
        pending
    }

    /// Kafka's purge: once dead ids outnumber max(1,000, live ids), sweep every
    /// list, and give back the room of lists that shrank a lot.
    fn maybe_purge(&mut self) {
        if self.dead <= self.live.max(1_000) {
            return;
        }
        let slots = &self.slots;
        self.watchers.retain(|_, ids| {
            ids.retain(|id| Self::is_live(slots, *id));
            if ids.capacity() > 16 && ids.len() * 4 < ids.capacity() {
                ids.shrink_to_fit();
            }
            !ids.is_empty()
        });
        self.dead = 0;
    }
}

struct FairPeer {
    state: Mutex<FairState>,
}

impl FairPeer {
    /// Checks `op`, and registers it on `keys` unless it completed: one lock
    /// held throughout, so no event is lost between the check and the watch.
    fn register(
        &self,
        mut op: FakeOp,
        keys: &[u32],
        awaited: bool,
    ) -> (Option<Id>, Option<oneshot::Receiver<()>>) {
        let mut s = self.state.lock().unwrap();
        if op.try_complete().is_some() {
            drop(s);
            return (None, None);
        }
        let id = s.vacant();
        let timer = s.queue.insert_at(id, op.deadline);
        let (done, rx) = if awaited {
            let (tx, rx) = oneshot::channel();
            (Some(tx), Some(rx))
        } else {
            (None, None)
        };
        s.fill(
            id,
            Pending {
                op,
                timer,
                keys: keys.len() as u32,
                done,
            },
        );
        for k in keys {
            s.watchers.entry(*k).or_default().push(id);
        }
        s.maybe_purge();
        (Some(id), rx)
    }

    /// Completes the request `id` if its check says it can.
    fn complete(&self, id: Id) {
        let finished = {
            let mut s = self.state.lock().unwrap();
            let FairState {
                queue,
                slots,
                free,
                live,
                dead,
                ..
            } = &mut *s;
            let slot = &mut slots[id.index as usize];
            if slot.generation != id.generation {
                return;
            }
            let completes = match slot.pending.as_mut() {
                Some(p) => p.op.try_complete().is_some(),
                None => false,
            };
            if !completes {
                return;
            }
            let p = FairState::take(slots, free, live, dead, id);
            queue.remove(&p.timer);
            p
        };
        if let Some(tx) = finished.done {
            let _ = tx.send(());
        }
    }

    /// Runs the check of every live watcher of `key`, completes those that
    /// can, and drops dead ids from the list.
    fn complete_key(&self, key: u32) {
        let mut finished = Vec::new();
        {
            let mut s = self.state.lock().unwrap();
            let FairState {
                queue,
                slots,
                free,
                watchers,
                live,
                dead,
            } = &mut *s;
            let Some(ids) = watchers.get_mut(&key) else {
                return;
            };
            ids.retain(|&id| {
                if !FairState::is_live(slots, id) {
                    *dead -= 1;
                    return false;
                }
                let p = slots[id.index as usize].pending.as_mut().expect("live");
                if p.op.try_complete().is_none() {
                    return true;
                }
                let p = FairState::take(slots, free, live, dead, id);
                *dead -= 1; // this entry goes now
                queue.remove(&p.timer);
                finished.push(p);
                false
            });
            if ids.is_empty() {
                watchers.remove(&key);
            }
            s.maybe_purge();
        }
        for p in finished {
            if let Some(tx) = p.done {
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
                        let FairState {
                            slots,
                            free,
                            live,
                            dead,
                            ..
                        } = &mut *s;
                        Poll::Ready(Some(FairState::take(slots, free, live, dead, id)))
                    }
                    Poll::Ready(None) | Poll::Pending => Poll::Pending,
                }
            })
            .await;
            match expired {
                None => return,
                Some(p) => {
                    // An awaiting task sees the sender dropped: expired.
                    drop(p.done);
                    p.op.on_expiration();
                }
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
    lag_p99: f64,
    driver_lag_p99: f64,
}

async fn run(o: Opts) -> RunResult {
    let counts = Arc::new(Counts::default());
    *counts.lateness.lock().unwrap() = Some(Histogram::new(3).unwrap());
    let mut rng = Rng(0x5EED ^ o.num as u64);
    let shared_keys: Vec<u32> = (0..o.keys)
        .map(|_| rng.below(o.key_space as u64) as u32)
        .collect();
    let stop = Arc::new(tokio::sync::Notify::new());

    let target = match o.imp {
        Imp::Purgatory => {
            let mut b = Purgatory::builder().name("perf");
            if let Ok(v) = std::env::var("PURGE_INTERVAL") {
                b = b.purge_interval(v.parse().unwrap());
            }
            if let Some(us) = o.tick_us {
                b = b.tick(Duration::from_micros(us));
            }
            Target::Purgatory(b.build().unwrap())
        }
        Imp::Task => Target::Task(Arc::new(TaskPeer {
            watchers: DashMap::new(),
            next_id: AtomicU64::new(0),
        })),
        Imp::Fair => {
            let peer = Arc::new(FairPeer {
                state: Mutex::new(FairState::new()),
            });
            tokio::spawn(peer.clone().drive(stop.clone()));
            Target::Fair(peer)
        }
        Imp::Floor => Target::Floor,
    };
    let target = Arc::new(target);

    // The completion driver: tokens in 1 ms buckets, acted on when due.
    let start = Instant::now();
    let buckets: Arc<Mutex<Buckets>> = Arc::default();
    let partitions = Arc::new(Partitions::new(o.key_space));
    let driver = {
        let buckets = buckets.clone();
        let partitions = partitions.clone();
        let target = target.clone();
        let counts = counts.clone();
        let total = o.num;
        tokio::spawn(async move {
            // How far behind its slot's time the driver acts on each slot.
            let mut lag = Histogram::<u64>::new(3).unwrap();
            let mut tick = tokio::time::interval(Duration::from_millis(1));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            while counts.done() < total {
                tick.tick().await;
                let now_ms = start.elapsed().as_millis() as usize;
                // One 1 ms slot at a time, yielding between slots: a driver
                // behind schedule works through its backlog as a request
                // handler would, letting the other tasks on its runtime (the
                // generators, and a reaper or a DelayQueue's driver) run
                // between slots rather than starving them for the whole backlog.
                let mut worked = false;
                loop {
                    let (next_slot, due): (usize, Vec<Token>) = {
                        let mut b = buckets.lock().unwrap();
                        let next = b.next;
                        if next > now_ms || next >= b.slots.len() {
                            break;
                        }
                        b.next = next + 1;
                        // Take the slot's buffer too: a drained slot that kept its
                        // capacity would hold every token ever sent in the
                        // process's memory, the same for every implementation.
                        (next, std::mem::take(&mut b.slots[next]))
                    };
                    if due.is_empty() {
                        continue;
                    }
                    if worked {
                        tokio::task::yield_now().await;
                    }
                    worked = true;
                    let slot_time = start + Duration::from_millis(next_slot as u64);
                    lag.record(slot_time.elapsed().as_micros() as u64).ok();
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
                            (Target::Fair(peer), Token::Id(id)) => peer.complete(id),
                            (Target::Fair(peer), Token::Key(k)) => peer.complete_key(k),
                            (Target::Floor, Token::Signal(tx)) => {
                                counts.completed.fetch_add(1, Ordering::Relaxed);
                                let _ = tx.send(());
                            }
                            (Target::Floor, Token::Id(_) | Token::Key(_) | Token::Reach(..)) => {
                                counts.completed.fetch_add(1, Ordering::Relaxed);
                            }
                            (Target::Purgatory(p), Token::Reach(k, offset)) => {
                                p.try_complete_reached(&k, partitions.cover(k, offset));
                            }
                            (Target::Task(peer), Token::Reach(k, offset)) => {
                                partitions.cover(k, offset);
                                peer.complete_key(k);
                            }
                            (Target::Fair(peer), Token::Reach(k, offset)) => {
                                partitions.cover(k, offset);
                                peer.complete_key(k);
                            }
                            _ => unreachable!("token matches its target"),
                        }
                    }
                }
            }
            lag
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
    let generators: Vec<_> = (0..o.generators)
        .map(|g| {
            let share = o.num / o.generators as usize
                + usize::from((g as usize) < o.num % o.generators as usize);
            tokio::spawn(generate(Generator {
                o: o.clone(),
                seed: 0x5EED ^ o.num as u64 ^ ((g as u64) << 32),
                num: share,
                rate: o.rate / o.generators as f64,
                start,
                shared_keys: shared_keys.clone(),
                partitions: partitions.clone(),
                target: target.clone(),
                buckets: buckets.clone(),
                counts: counts.clone(),
            }))
        })
        .collect();
    let mut last_arrival = start;
    let mut lag = Histogram::<u64>::new(3).unwrap();
    for g in generators {
        let (arrival, l) = g.await.unwrap();
        last_arrival = last_arrival.max(arrival);
        lag.add(l).unwrap();
    }
    let end = Instant::now();
    let driver_lag = driver.await.unwrap();
    let done = Instant::now();
    progress.abort();
    stop.notify_one();
    let cpu = cpu_ms() - cpu0;
    let h = counts.lateness.lock().unwrap().take().unwrap();
    let ms = |v: u64| v as f64 / 1000.0;
    RunResult {
        elapsed_ms: (done - start).as_millis() as u64,
        target_rate: o.num as f64 / (last_arrival - start).as_secs_f64(),
        actual_rate: o.num as f64 / (end - start).as_secs_f64(),
        cpu_ms: cpu,
        rss_mb: peak_rss_mb(),
        completed: counts.completed.load(Ordering::Relaxed),
        expired: counts.expired.load(Ordering::Relaxed),
        p50: ms(h.value_at_quantile(0.5)),
        p99: ms(h.value_at_quantile(0.99)),
        max: ms(h.max()),
        lag_p99: ms(lag.value_at_quantile(0.99)),
        driver_lag_p99: ms(driver_lag.value_at_quantile(0.99)),
    }
}

/// One generator's share of the load.
struct Generator {
    o: Opts,
    seed: u64,
    num: usize,
    rate: f64,
    start: Instant,
    shared_keys: Vec<u32>,
    partitions: Arc<Partitions>,
    target: Arc<Target>,
    buckets: Arc<Mutex<Buckets>>,
    counts: Arc<Counts>,
}

/// Sends `g.num` requests at `g.rate` (Poisson arrivals). Returns the last
/// scheduled arrival and the registration lag (registration time minus scheduled
/// arrival, in µs).
async fn generate(g: Generator) -> (Instant, Histogram<u64>) {
    let o = &g.o;
    let mut rng = Rng(g.seed);
    let mu = o.pct50.ln();
    let sigma = (o.pct75.ln() - mu) / 0.674490;
    let timeout = Duration::from_millis(o.timeout_ms);
    let awaited = o.mode == Mode::Awaited;
    let key_driven = o.mode == Mode::Key;
    let offsets = o.mode == Mode::Offsets;
    let mut lag = Histogram::<u64>::new(3).unwrap();
    let mut arrival = g.start;
    let mut keys = g.shared_keys.clone();
    if offsets {
        keys.truncate(1); // a produce on one partition
    }
    let mean_interval_ns = 1e9 / g.rate;
    for i in 0..g.num {
        // Poisson arrivals: exponential intervals. Sleep only when at least 1 ms
        // ahead, as Kafka's generator does (its clock is in ms).
        let interval = -mean_interval_ns * rng.unit().ln();
        arrival += Duration::from_nanos(interval as u64);
        // One clock reading per request, as Kafka's generator makes: it decides
        // the sleep and measures how far behind schedule the request is (a
        // request slept for is on schedule, give or take the wake-up).
        let now = Instant::now();
        if arrival > now + Duration::from_millis(1) {
            tokio::time::sleep_until(arrival).await;
        } else if i % 256 == 0 {
            tokio::task::yield_now().await;
        }
        lag.record(now.saturating_duration_since(arrival).as_micros() as u64)
            .ok();
        let latency_ms = (mu + sigma * rng.normal()).exp();
        let completes = latency_ms < o.timeout_ms as f64;
        let completes_at =
            completes.then(|| arrival + Duration::from_secs_f64(latency_ms / 1000.0));
        if !o.shared_keys || key_driven || offsets {
            for k in keys.iter_mut() {
                *k = rng.below(o.key_space as u64) as u32;
            }
        }
        let level = offsets.then(|| {
            let (next, hw) = &g.partitions.0[keys[0] as usize];
            Level {
                hw: hw.clone(),
                offset: next.fetch_add(1, Ordering::Relaxed),
            }
        });
        let reach = level.as_ref().map(|l| Token::Reach(keys[0], l.offset));
        let deadline = arrival + timeout;
        let op = FakeOp {
            completes_at,
            deadline,
            level: level.clone(),
            _data: vec![0; o.size],
            counts: g.counts.clone(),
        };
        let token = match &*g.target {
            Target::Purgatory(p) => {
                let handle = match &level {
                    Some(l) => p.try_complete_else_watch_levels_at(
                        op,
                        deadline,
                        [Watch::level(keys[0], l.offset + 1)],
                    ),
                    None => p.try_complete_else_watch_at(op, deadline, keys.iter().copied()),
                }
                .unwrap();
                let token = if offsets {
                    reach
                } else if key_driven {
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
                let t = peer.register(op, &keys, !key_driven && !offsets);
                if offsets {
                    reach
                } else if key_driven {
                    Some(Token::Key(keys[0]))
                } else {
                    t
                }
            }
            Target::Fair(peer) => {
                let (id, rx) = peer.register(op, &keys, awaited);
                if let Some(rx) = rx {
                    tokio::spawn(async move {
                        let _ = rx.await;
                    });
                }
                if offsets {
                    reach
                } else if key_driven {
                    Some(Token::Key(keys[0]))
                } else {
                    id.map(Token::Id)
                }
            }
            Target::Floor => {
                if completes_at.is_none() {
                    g.counts.expired.fetch_add(1, Ordering::Relaxed);
                }
                drop(op);
                if awaited {
                    let (tx, rx) = oneshot::channel::<()>();
                    tokio::spawn(async move {
                        let _ = rx.await;
                    });
                    completes_at.is_some().then_some(Token::Signal(tx))
                } else if offsets {
                    reach
                } else if key_driven {
                    Some(Token::Key(keys[0]))
                } else {
                    Some(Token::Id(Id {
                        index: 0,
                        generation: 0,
                    }))
                }
            }
        };
        if let (Some(at), Some(token)) = (completes_at, token) {
            // The bucket of the first whole millisecond at or after `at`, so the
            // check the driver runs finds the request completable.
            let ms = at.saturating_duration_since(g.start).as_millis() as usize + 1;
            let mut b = g.buckets.lock().unwrap();
            // A generator behind schedule may be late for a bucket the driver
            // has drained: the token goes in the next one it will read.
            let ms = ms.max(b.next);
            if b.slots.len() <= ms {
                b.slots.resize_with(ms + 1, Vec::new);
            }
            b.slots[ms].push(token);
        }
    }
    (arrival, lag)
}

// ---------------------------------------------------------------- driving runs

fn single(o: &Opts) -> RunResult {
    let rt = if o.runtime == Runtime::Current {
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

const COLUMNS: &str = "impl\tmode\truntime\tgenerators\telapsed_ms\ttarget_rate\tactual_rate\tcpu_ms\tpeak_rss_mb\tcompleted\texpired\tlate_p50_ms\tlate_p99_ms\tlate_max_ms\tlag_p99_ms\tdriver_lag_p99_ms";

fn row(o: &Opts, r: &RunResult) -> String {
    format!(
        "{}\t{}\t{}\t{}\t{}\t{:.0}\t{:.0}\t{}\t{:.1}\t{}\t{}\t{:.2}\t{:.2}\t{:.2}\t{:.2}\t{:.2}",
        name(&o.imp),
        name(&o.mode),
        name(&o.runtime),
        o.generators,
        r.elapsed_ms,
        r.target_rate,
        r.actual_rate,
        r.cpu_ms,
        r.rss_mb,
        r.completed,
        r.expired,
        r.p50,
        r.p99,
        r.max,
        r.lag_p99,
        r.driver_lag_p99
    )
}

/// A result row read back from a child's output.
#[derive(Debug, Clone)]
struct Row {
    imp: String,
    target_rate: f64,
    actual_rate: f64,
    cpu_ms: f64,
    rss_mb: f64,
    completed: f64,
    expired: f64,
    p99: f64,
    lag_p99: f64,
    driver_lag_p99: f64,
}

fn parse_row(line: &str) -> Option<Row> {
    let f: Vec<&str> = line.split('\t').collect();
    let n = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok());
    Some(Row {
        imp: f.first()?.to_string(),
        target_rate: n(5)?,
        actual_rate: n(6)?,
        cpu_ms: n(7)?,
        rss_mb: n(8)?,
        completed: n(9)?,
        expired: n(10)?,
        p99: n(12)?,
        lag_p99: n(14)?,
        driver_lag_p99: n(15).unwrap_or(f64::NAN),
    })
}

/// Runs one configuration in a child process and returns its result row.
fn child(o: &Opts, imp: Imp, rate: f64) -> Option<String> {
    let mut args: Vec<String> = [
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
        &name(&o.mode),
        "--impl",
        &name(&imp),
        "--runtime",
        &name(&o.runtime),
        "--generators",
        &o.generators.to_string(),
        "--quiet",
    ]
    .iter()
    .map(|a| a.to_string())
    .collect();
    args.extend(o.tick_us.map(|us| format!("--tick-us={us}")));
    if o.shared_keys {
        args.push("--shared-keys".into());
    }
    let text = runs::child(args)?;
    text.lines()
        .find_map(|l| l.strip_prefix("ROW\t").map(str::to_string))
}

#[path = "../tests/support/runs.rs"]
mod runs;

const IMPS: [Imp; 3] = [Imp::Purgatory, Imp::Task, Imp::Fair];
/// `--compare` also runs the harness alone, to show the floor under every run.
const WITH_FLOOR: [Imp; 4] = [Imp::Purgatory, Imp::Task, Imp::Fair, Imp::Floor];

/// Runs every implementation `o.repeat` times at `rate`, interleaved, and returns
/// the rows, raw and parsed (printed as they come).
fn interleaved(o: &Opts, rate: f64, floor: bool) -> Vec<(String, Row)> {
    let imps: Vec<Imp> = (if floor { &WITH_FLOOR[..] } else { &IMPS[..] })
        .iter()
        .copied()
        .filter(|i| o.impls.as_ref().is_none_or(|only| only.contains(i)))
        .collect();
    runs::interleave(
        o.repeat as usize,
        &imps,
        |imp| format!("{} at {rate:.0}/s", name(imp)),
        |&imp| match child(o, imp, rate) {
            Some(r) => {
                println!("{rate:.0}\t{r}");
                let parsed = parse_row(&r)?;
                Some((format!("{rate:.0}\t{r}"), parsed))
            }
            None => {
                println!("{rate:.0}\t{}\t(failed)", name(&imp));
                None
            }
        },
    )
    .into_iter()
    .map(|(_, row)| row)
    .collect()
}

fn summary(o: &Opts, rows: &[Row]) {
    let col = |imp: &str, f: fn(&Row) -> f64| -> (f64, f64, f64) {
        runs::spread(rows.iter().filter(|r| r.imp == imp).map(f))
    };
    let cell = runs::cell;
    println!();
    println!(
        "mode {}, {} runtime, {} generator(s), {} requests at {:.0}/s, {} keys of {}, timeout {} ms; medians of {} runs [min..max]",
        name(&o.mode), name(&o.runtime), o.generators, o.num, o.rate, o.keys, o.key_space, o.timeout_ms, o.repeat
    );
    println!();
    println!("| implementation | CPU s | peak RSS MB | achieved /s | expiry lateness p99 ms | registration lag p99 ms | driver lag p99 ms | completed | expired |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for imp in WITH_FLOOR {
        let i = name(&imp);
        if !rows.iter().any(|r| r.imp == i) {
            continue;
        }
        println!(
            "| {i} | {} | {} | {} | {} | {} | {} | {} | {} |",
            cell(col(&i, |r| r.cpu_ms / 1000.0), 2),
            cell(col(&i, |r| r.rss_mb), 0),
            cell(col(&i, |r| r.actual_rate), 0),
            cell(col(&i, |r| r.p99), 1),
            cell(col(&i, |r| r.lag_p99), 1),
            cell(col(&i, |r| r.driver_lag_p99), 1),
            col(&i, |r| r.completed).0,
            col(&i, |r| r.expired).0,
        );
    }
    // Ratios of the medians: this crate against the best peer on each measure.
    let med = |imp: Imp, f: fn(&Row) -> f64| col(&name(&imp), f).0;
    let best_low = |f: fn(&Row) -> f64| med(Imp::Task, f).min(med(Imp::Fair, f));
    println!();
    println!(
        "ratios, tokio-purgatory / best peer: CPU {:.2} (one-lock peer {:.2}), peak RSS {:.2}, lateness p99 {:.2}",
        med(Imp::Purgatory, |r| r.cpu_ms) / best_low(|r| r.cpu_ms),
        med(Imp::Purgatory, |r| r.cpu_ms) / med(Imp::Fair, |r| r.cpu_ms),
        med(Imp::Purgatory, |r| r.rss_mb) / best_low(|r| r.rss_mb),
        med(Imp::Purgatory, |r| r.p99) / best_low(|r| r.p99),
    );
    // The harness's own CPU is in every run; what each implementation adds is
    // its CPU above the floor's.
    let floor = med(Imp::Floor, |r| r.cpu_ms);
    println!(
        "harness floor CPU {:.2} s; CPU above the floor, tokio-purgatory / one-lock peer: {:.2}",
        floor / 1000.0,
        (med(Imp::Purgatory, |r| r.cpu_ms) - floor) / (med(Imp::Fair, |r| r.cpu_ms) - floor),
    );
}

/// Draws one chart of the sweep: `y` of each implementation against target rate.
fn draw(rows: &[Row], path: &str, title: &str, y_desc: &str, y: fn(&Row) -> f64, diagonal: bool) {
    use plotters::prelude::*;
    let x_max = rows.iter().map(|r| r.target_rate).fold(1.0, f64::max) * 1.05;
    let mut y_max = rows
        .iter()
        .map(y)
        .filter(|v| v.is_finite())
        .fold(1.0, f64::max)
        * 1.1;
    if diagonal {
        y_max = y_max.max(x_max);
    }
    let root = SVGBackend::new(path, (760, 480)).into_drawing_area();
    root.fill(&WHITE).unwrap();
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 15))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..x_max, 0f64..y_max)
        .unwrap();
    chart
        .configure_mesh()
        .x_desc("offered rate (requests/s)")
        .y_desc(y_desc)
        .draw()
        .unwrap();
    if diagonal {
        chart
            .draw_series(LineSeries::new(
                [(0.0, 0.0), (x_max, x_max)],
                RGBColor(190, 190, 190),
            ))
            .unwrap();
    }
    let colours = [
        RGBColor(214, 39, 40),
        RGBColor(31, 119, 180),
        RGBColor(44, 160, 44),
    ];
    for (imp, colour) in IMPS.iter().zip(colours) {
        if !rows.iter().any(|r| r.imp == name(imp)) {
            continue; // left out of this sweep (`--impls`)
        }
        let label = match imp {
            Imp::Purgatory => "tokio-purgatory",
            Imp::Task => "task per request + DashMap",
            Imp::Fair => "one-lock purgatory (DelayQueue + slab + lists)",
            Imp::Floor => "the harness alone",
        };
        // The median of each rate's runs.
        let mut rates: Vec<f64> = rows
            .iter()
            .filter(|r| r.imp == name(imp))
            .map(|r| r.target_rate.round())
            .collect();
        rates.sort_by(f64::total_cmp);
        rates.dedup();
        let pts: Vec<(f64, f64)> = rates
            .iter()
            .map(|&t| {
                let ys = rows
                    .iter()
                    .filter(|r| r.imp == name(imp) && r.target_rate.round() == t)
                    .map(y);
                (t, runs::spread(ys).0)
            })
            .collect();
        chart
            .draw_series(LineSeries::new(pts.clone(), colour.stroke_width(2)))
            .unwrap()
            .label(label)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], colour.stroke_width(2))
            });
        chart
            .draw_series(pts.iter().map(|&p| Circle::new(p, 3, colour.filled())))
            .unwrap();
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .unwrap();
    root.present().unwrap();
}

/// Writes the two charts of a sweep next to its CSV: achieved rate, and expiry
/// lateness p99, against offered rate.
fn charts(rows: &[Row], prefix: &str, what: &str) {
    draw(
        rows,
        &format!("{prefix}-achieved.svg"),
        &format!("achieved vs offered rate: {what}"),
        "achieved rate (requests/s)",
        |r| r.actual_rate,
        true,
    );
    draw(
        rows,
        &format!("{prefix}-lateness.svg"),
        &format!("expiry lateness p99 vs offered rate: {what}"),
        "expiry lateness p99 (ms)",
        |r| r.p99,
        false,
    );
    println!("wrote {prefix}-achieved.svg and {prefix}-lateness.svg");
}

/// Redraws the charts of a CSV written by `--sweep`.
fn chart(csv_path: &str) {
    let text = std::fs::read_to_string(csv_path).expect("read csv");
    let mut rows = Vec::new();
    let mut what = String::new();
    for line in text.lines().skip(1) {
        // The first column is the rate asked for; the rest is a result row.
        let Some((_, r)) = line.split_once('\t') else {
            continue;
        };
        let f: Vec<&str> = r.split('\t').collect();
        if f.len() > 3 {
            what = format!("mode {}, {} runtime", f[1], f[2]);
        }
        rows.extend(parse_row(r));
    }
    charts(&rows, csv_path.trim_end_matches(".csv"), &what);
}

fn main() {
    let o = parse();
    if let Some(csv) = &o.chart {
        chart(csv);
        return;
    }
    if let Some(rates) = &o.sweep {
        println!("target_rate_requested\t{COLUMNS}");
        let mut csv = format!("target_rate_requested\t{COLUMNS}\n");
        let mut rows = Vec::new();
        for &rate in rates {
            let o = Opts { rate, ..o.clone() };
            for (raw, parsed) in interleaved(&o, rate, false) {
                let _ = writeln!(csv, "{raw}");
                rows.push(parsed);
            }
        }
        if let Some(dir) = std::path::Path::new(&o.out).parent() {
            std::fs::create_dir_all(dir).ok();
        }
        std::fs::write(format!("{}.csv", o.out), csv).expect("write csv");
        let what = format!(
            "mode {}, {} runtime, {} requests, {} keys of {}",
            name(&o.mode),
            name(&o.runtime),
            o.num,
            o.keys,
            o.key_space
        );
        charts(&rows, &o.out, &what);
        return;
    }
    if o.compare {
        println!("rate\t{COLUMNS}");
        let rows: Vec<Row> = interleaved(&o, o.rate, true)
            .into_iter()
            .map(|(_, r)| r)
            .collect();
        summary(&o, &rows);
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
            "# peak rss {:.1} MB; completed {}, expired {}; expiry lateness p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms; registration lag p99 {:.2} ms; completion driver lag p99 {:.2} ms",
            r.rss_mb, r.completed, r.expired, r.p50, r.p99, r.max, r.lag_p99, r.driver_lag_p99
        );
    }
    println!("ROW\t{}", row(&o, &r));
}
