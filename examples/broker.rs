//! A broker's produce and fetch paths, on two purgatories sharing one reaper.
//!
//! Run: `cargo run --release --example broker`
//!
//! Producers append batches to partitions of a topic and register a
//! `DelayedProduce` (`acks=all`) that waits until every in-sync replica has
//! acknowledged the batch's last offset: it watches each partition it wrote to
//! **at that offset** (`Watch::level`). Replica fetchers acknowledge offsets
//! and, when a partition's high watermark moves, call `try_complete_reached`
//! with it: only the produces the new high watermark covers are checked, not
//! every one in flight. One replica is stuck on partition 3, so requests that
//! touch it time out.
//!
//! Consumers long-poll with a `DelayedFetch` that waits for `MIN_RECORDS` past
//! their position or `MAX_WAIT`, watching their partition at the log end it
//! needs; each append advances the partition's log end the same way.
//!
//! Request handlers await their handles; at the end the program prints a
//! summary and checks the purgatories' counts balance.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;
use tokio_purgatory::{Completion, Operation, Purgatory, Reaper, Watch};

const PARTITIONS: usize = 8;
const REPLICAS: usize = 3; // the leader and two followers
const STUCK_PARTITION: usize = 3;
const REQUESTS: u64 = 20_000;
const TIMEOUT: Duration = Duration::from_millis(100);
const CONSUMERS: usize = 16;
const MIN_RECORDS: u64 = 200;
const MAX_WAIT: Duration = Duration::from_millis(20);

/// A partition's leader log end and each replica's acknowledged offset.
struct Partition {
    log_end: AtomicU64,
    acked: [AtomicU64; REPLICAS],
}

struct Cluster {
    partitions: Vec<Partition>,
}

impl Cluster {
    fn high_watermark(&self, p: usize) -> u64 {
        let part = &self.partitions[p];
        part.acked
            .iter()
            .map(|a| a.load(Ordering::Acquire))
            .min()
            .unwrap_or(0)
    }
}

type Key = (&'static str, usize);

/// Kafka's `DelayedProduce`: done when every partition it wrote to has been
/// replicated up to its last offset.
struct DelayedProduce {
    cluster: Arc<Cluster>,
    /// (partition, last offset written)
    writes: Vec<(usize, u64)>,
    started: Instant,
}

#[derive(Debug)]
enum ProduceResponse {
    Ok { latency: Duration },
    TimedOut { lagging: Vec<usize> },
}

impl Operation for DelayedProduce {
    type Output = ProduceResponse;

    fn try_complete(&mut self) -> Option<ProduceResponse> {
        self.writes
            .iter()
            .all(|&(p, offset)| self.cluster.high_watermark(p) >= offset)
            .then(|| ProduceResponse::Ok {
                latency: self.started.elapsed(),
            })
    }

    fn on_expiration(self) -> ProduceResponse {
        let lagging = self
            .writes
            .iter()
            .filter(|&&(p, offset)| self.cluster.high_watermark(p) < offset)
            .map(|&(p, _)| p)
            .collect();
        ProduceResponse::TimedOut { lagging }
    }
}

/// Kafka's `DelayedFetch` on one partition: done once the log holds
/// `MIN_RECORDS` offsets past `position`; at `MAX_WAIT`, answers with what there
/// is.
struct DelayedFetch {
    cluster: Arc<Cluster>,
    partition: usize,
    position: u64,
}

impl DelayedFetch {
    fn available(&self) -> u64 {
        let end = self.cluster.partitions[self.partition]
            .log_end
            .load(Ordering::Acquire);
        end.saturating_sub(self.position)
    }
}

impl Operation for DelayedFetch {
    type Output = u64; // offsets returned
    fn try_complete(&mut self) -> Option<u64> {
        let n = self.available();
        (n >= MIN_RECORDS).then_some(n)
    }
    fn on_expiration(self) -> u64 {
        self.available()
    }
}

#[derive(Default)]
struct Summary {
    ok: u64,
    timed_out: u64,
    timed_out_on_stuck: u64,
    latencies_us: Vec<u64>,
}

#[tokio::main]
async fn main() {
    let cluster = Arc::new(Cluster {
        partitions: (0..PARTITIONS)
            .map(|_| Partition {
                log_end: AtomicU64::new(0),
                acked: Default::default(),
            })
            .collect(),
    });
    // One reaper task serves both purgatories.
    let reaper = Reaper::start().expect("inside a runtime");
    let purgatory: Purgatory<Key, DelayedProduce> = Purgatory::builder()
        .name("produce")
        .max_pending(50_000)
        .reaper(&reaper)
        .build()
        .expect("valid settings");
    let fetches: Purgatory<Key, DelayedFetch> = Purgatory::builder()
        .name("fetch")
        .reaper(&reaper)
        .build()
        .expect("valid settings");
    let summary = Arc::new(Mutex::new(Summary::default()));
    let started = Instant::now();

    // Followers fetch every millisecond and acknowledge what they fetched; the
    // leader acknowledges its own appends at once.
    let mut fetchers = Vec::new();
    for replica in 1..REPLICAS {
        let cluster = cluster.clone();
        let purgatory = purgatory.clone();
        fetchers.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(1));
            loop {
                tick.tick().await;
                for p in 0..PARTITIONS {
                    if p == STUCK_PARTITION && replica == 2 {
                        continue; // this follower has fallen out of sync on p3
                    }
                    let part = &cluster.partitions[p];
                    let end = part.log_end.load(Ordering::Acquire);
                    if part.acked[replica].swap(end, Ordering::AcqRel) != end {
                        // The high watermark may have moved: check the
                        // produces it now covers, and only those.
                        let hw = cluster.high_watermark(p);
                        purgatory.try_complete_reached(&("orders", p), hw);
                    }
                }
            }
        }));
    }

    // Consumers: long-poll fetches from their position, one partition each.
    let producing = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let fetch_counts = Arc::new([AtomicU64::new(0), AtomicU64::new(0)]); // [filled, at max_wait]
    let mut consumers = Vec::new();
    for c in 0..CONSUMERS {
        let (cluster, fetches) = (cluster.clone(), fetches.clone());
        let (producing, counts) = (producing.clone(), fetch_counts.clone());
        consumers.push(tokio::spawn(async move {
            let partition = c % PARTITIONS;
            let mut position = 0;
            while producing.load(Ordering::Acquire) {
                let op = DelayedFetch {
                    cluster: cluster.clone(),
                    partition,
                    position,
                };
                // Watch the partition at the log end this fetch needs.
                let needs = Watch::level(("orders", partition), position + MIN_RECORDS);
                let handle = fetches
                    .try_complete_else_watch_levels(op, MAX_WAIT, [needs])
                    .expect("fetch registered");
                match handle.await {
                    Ok(Completion::Completed(n)) => {
                        counts[0].fetch_add(1, Ordering::Relaxed);
                        position += n;
                    }
                    Ok(Completion::Expired(n)) => {
                        counts[1].fetch_add(1, Ordering::Relaxed);
                        position += n;
                    }
                    Err(e) => panic!("fetch failed: {e}"),
                }
            }
        }));
    }

    // Producers: each request writes to two partitions and waits for acks=all.
    let mut handlers = Vec::new();
    let mut arrivals = tokio::time::interval(Duration::from_micros(50));
    for i in 0..REQUESTS {
        arrivals.tick().await;
        let partitions = [(i as usize) % PARTITIONS, (i as usize * 7 + 3) % PARTITIONS];
        let mut writes = Vec::new();
        for &p in &partitions {
            let part = &cluster.partitions[p];
            let offset = part.log_end.fetch_add(10, Ordering::AcqRel) + 10;
            part.acked[0].fetch_max(offset, Ordering::AcqRel); // the leader's own ack
                                                               // The log grew: fetches waiting for this much data can answer.
            fetches.try_complete_reached(&("orders", p), offset);
            writes.push((p, offset));
        }
        writes.dedup_by_key(|w| w.0);
        let op = DelayedProduce {
            cluster: cluster.clone(),
            writes,
            started: Instant::now(),
        };
        // Each partition written, at the offset its high watermark must reach.
        let watches: Vec<Watch<Key>> = op
            .writes
            .iter()
            .map(|&(p, offset)| Watch::level(("orders", p), offset))
            .collect();
        match purgatory.try_complete_else_watch_levels(op, TIMEOUT, watches) {
            Ok(handle) => {
                let summary = summary.clone();
                handlers.push(tokio::spawn(async move {
                    let outcome = handle.await;
                    let mut s = summary.lock().unwrap();
                    match outcome {
                        Ok(Completion::Completed(ProduceResponse::Ok { latency })) => {
                            s.ok += 1;
                            s.latencies_us.push(latency.as_micros() as u64);
                        }
                        Ok(Completion::Expired(ProduceResponse::TimedOut { lagging })) => {
                            s.timed_out += 1;
                            if lagging.contains(&STUCK_PARTITION) {
                                s.timed_out_on_stuck += 1;
                            }
                        }
                        other => panic!("unexpected outcome {other:?}"),
                    }
                }));
            }
            Err(refused) => panic!("registration refused: {refused}"),
        }
    }
    for h in handlers {
        h.await.expect("handler");
    }
    producing.store(false, Ordering::Release);
    for c in consumers {
        c.await.expect("consumer");
    }
    for f in fetchers {
        f.abort();
    }

    let elapsed = started.elapsed();
    let m = purgatory.metrics();
    let mut s = summary.lock().unwrap();
    s.latencies_us.sort_unstable();
    let pct = |q: f64| {
        let v = &s.latencies_us;
        v.get(((v.len() as f64 - 1.0) * q) as usize)
            .copied()
            .unwrap_or(0) as f64
            / 1000.0
    };
    println!(
        "produce requests (acks=all): {REQUESTS} over {PARTITIONS} partitions, timeout {TIMEOUT:?}"
    );
    println!(
        "  completed: {:>6}  latency p50 {:.2} ms, p99 {:.2} ms",
        s.ok,
        pct(0.5),
        pct(0.99)
    );
    println!(
        "  timed out: {:>6}  ({} waiting on partition {STUCK_PARTITION}, whose follower is stuck)",
        s.timed_out, s.timed_out_on_stuck
    );
    println!(
        "fetch requests (min {MIN_RECORDS} offsets, max_wait {MAX_WAIT:?}) from {CONSUMERS} consumers: {} answered with enough data, {} at max_wait",
        fetch_counts[0].load(Ordering::Relaxed),
        fetch_counts[1].load(Ordering::Relaxed)
    );
    println!("  elapsed:   {:.2} s", elapsed.as_secs_f64());
    println!(
        "purgatory: registered {}, completed {}, expired {}, cancelled {}, purged tombstones {}, reaper wake-ups {}",
        m.registered, m.completed, m.expired, m.cancelled, m.purged, m.reaper_wakeups
    );
    assert_eq!(s.ok + s.timed_out, REQUESTS, "every request answered once");
    assert_eq!(
        m.registered,
        m.completed + m.expired + m.cancelled + m.handed_back
    );
    // Timing, not correctness: on an overloaded machine a healthy request can miss
    // its 100 ms too, so this is reported rather than asserted.
    if s.timed_out != s.timed_out_on_stuck {
        println!(
            "  note: {} requests timed out without waiting on partition {STUCK_PARTITION} (machine overloaded?)",
            s.timed_out - s.timed_out_on_stuck
        );
    }
    assert_eq!(purgatory.delayed(), 0);
    let f = fetches.metrics();
    assert_eq!(
        f.registered,
        f.completed + f.expired + f.cancelled + f.handed_back
    );
    assert_eq!(fetches.delayed(), 0);
}
