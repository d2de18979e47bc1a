//! The workload: Kafka's fake request, the completion driver's tokens, the
//! generators, and one run against an implementation.

use super::*;

// ---------------------------------------------------------------- sampling

#[path = "../../tests/support/rng.rs"]
mod rng;
use rng::Rng;

// ---------------------------------------------------------------- measurements

/// Process CPU time (user + system) in ms, from /proc/self/stat.
pub(crate) fn cpu_ms() -> u64 {
    procfs::cpu_ms("self")
}

#[path = "../../tests/support/proc.rs"]
mod procfs;

/// Peak resident set size in MB.
pub(crate) fn peak_rss_mb() -> f64 {
    procfs::status_mb("VmHWM")
}

#[derive(Default)]
pub(crate) struct Counts {
    pub(crate) completed: AtomicUsize,
    pub(crate) expired: AtomicUsize,
    pub(crate) lateness: Mutex<Option<Histogram<u64>>>,
}

impl Counts {
    pub(crate) fn expired_at(&self, deadline: Instant) {
        let late = Instant::now()
            .saturating_duration_since(deadline)
            .as_micros() as u64;
        if let Some(h) = self.lateness.lock().unwrap().as_mut() {
            h.record(late.max(1)).ok();
        }
        self.expired.fetch_add(1, Ordering::Relaxed);
    }
    pub(crate) fn done(&self) -> usize {
        self.completed.load(Ordering::Relaxed) + self.expired.load(Ordering::Relaxed)
    }
}

// ---------------------------------------------------------------- the request

/// Kafka's `FakeOperation`: completable once its completion time has come.
pub(crate) struct FakeOp {
    pub(crate) completes_at: Option<Instant>,
    pub(crate) deadline: Instant,
    pub(crate) level: Option<Level>,
    pub(crate) _data: Vec<u8>,
    pub(crate) counts: Arc<Counts>,
}

impl FakeOp {
    pub(crate) fn completable(&self) -> bool {
        match &self.level {
            Some(l) => l.reached(),
            None => self.completes_at.is_some_and(|t| Instant::now() >= t),
        }
    }
}

/// `--mode offsets`: a produce's offset on its partition's high watermark.
#[derive(Clone)]
pub(crate) struct Level {
    pub(crate) hw: Arc<AtomicU64>,
    pub(crate) offset: u64,
}

impl Level {
    pub(crate) fn reached(&self) -> bool {
        self.hw.load(Ordering::Acquire) > self.offset
    }
}

/// `--mode offsets`: each partition's next offset and high watermark.
pub(crate) struct Partitions(Vec<(AtomicU64, Arc<AtomicU64>)>);

impl Partitions {
    pub(crate) fn new(n: usize) -> Partitions {
        Partitions(
            (0..n)
                .map(|_| (AtomicU64::new(0), Arc::default()))
                .collect(),
        )
    }
    /// Advances partition `p`'s high watermark past `offset`; returns it.
    pub(crate) fn cover(&self, p: u32, offset: u64) -> u64 {
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
pub(crate) enum Token {
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
pub(crate) struct Buckets {
    pub(crate) next: usize,
    pub(crate) slots: Vec<Vec<Token>>,
}

/// The implementations, behind one face.
pub(crate) enum Target {
    Purgatory(Purgatory<u32, FakeOp>),
    Task(Arc<TaskPeer>),
    Fair(Arc<FairPeer>),
    Lean(Arc<dyn Rules>),
    Floor,
}

// ---------------------------------------------------------------- one run

pub(crate) struct RunResult {
    pub(crate) elapsed_ms: u64,
    pub(crate) target_rate: f64,
    pub(crate) actual_rate: f64,
    pub(crate) cpu_ms: u64,
    pub(crate) rss_mb: f64,
    pub(crate) completed: usize,
    pub(crate) expired: usize,
    pub(crate) p50: f64,
    pub(crate) p99: f64,
    pub(crate) max: f64,
    pub(crate) lag_p99: f64,
    pub(crate) driver_lag_p99: f64,
}

pub(crate) async fn run(o: Opts) -> RunResult {
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
        Imp::Lean => {
            let peer = Arc::new(LeanPeer::<tokio_util::time::DelayQueue<Id>>::default());
            tokio::spawn(peer.clone().drive(stop.clone()));
            Target::Lean(peer)
        }
        Imp::LeanWheel => {
            let peer = Arc::new(LeanPeer::<WheelTimers>::default());
            tokio::spawn(peer.clone().drive(stop.clone()));
            Target::Lean(peer)
        }
        Imp::Sharded => {
            let peer = Arc::new(ShardedPeer::new(o.shards as usize));
            tokio::spawn(peer.clone().drive(stop.clone()));
            Target::Lean(peer)
        }
        Imp::KeySharded => {
            let peer = Arc::new(KeyShardedPeer::new(o.shards as usize));
            tokio::spawn(peer.clone().drive(stop.clone()));
            Target::Lean(peer)
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
                            (Target::Lean(peer), Token::Id(id)) => peer.complete(id),
                            (Target::Lean(peer), Token::Key(k)) => peer.complete_key(k),
                            (Target::Lean(peer), Token::Reach(k, offset)) => {
                                partitions.cover(k, offset);
                                peer.complete_key(k);
                            }
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

/// Registers `op` with a one-lock peer; the token its completion needs.
fn one_lock(
    peer: &dyn Rules,
    op: FakeOp,
    keys: &[u32],
    mode: Mode,
    reach: Option<Token>,
) -> Option<Token> {
    let (id, rx) = peer.register(op, keys, mode == Mode::Awaited);
    if let Some(rx) = rx {
        tokio::spawn(async move {
            let _ = rx.await;
        });
    }
    match mode {
        Mode::Offsets => reach,
        Mode::Key => Some(Token::Key(keys[0])),
        Mode::Kafka | Mode::Awaited => id.map(Token::Id),
    }
}

/// One generator's share of the load.
pub(crate) struct Generator {
    pub(crate) o: Opts,
    pub(crate) seed: u64,
    pub(crate) num: usize,
    pub(crate) rate: f64,
    pub(crate) start: Instant,
    pub(crate) shared_keys: Vec<u32>,
    pub(crate) partitions: Arc<Partitions>,
    pub(crate) target: Arc<Target>,
    pub(crate) buckets: Arc<Mutex<Buckets>>,
    pub(crate) counts: Arc<Counts>,
}

/// Sends `g.num` requests at `g.rate` (Poisson arrivals). Returns the last
/// scheduled arrival and the registration lag (registration time minus scheduled
/// arrival, in µs).
pub(crate) async fn generate(g: Generator) -> (Instant, Histogram<u64>) {
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
                if offsets || key_driven {
                    handle.detach();
                    if offsets {
                        reach
                    } else {
                        Some(Token::Key(keys[0]))
                    }
                } else if awaited {
                    let token = handle.op_ref().map(Token::Op);
                    // Detached: the driver waits until every request has finished,
                    // and a kept JoinHandle would hold the finished task's memory.
                    tokio::spawn(async move {
                        let _ = handle.await;
                    });
                    token
                } else {
                    // Nobody awaits the outcome: the handle becomes the reference
                    // the driver completes it by (`None` if it completed at once).
                    handle.into_op_ref().map(Token::Op)
                }
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
            Target::Fair(peer) => one_lock(&**peer, op, &keys, o.mode, reach),
            Target::Lean(peer) => one_lock(&**peer, op, &keys, o.mode, reach),
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
