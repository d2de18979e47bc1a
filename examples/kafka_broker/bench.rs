//! Parked consumers woken by produces: this broker's fetch purgatory against
//! the same broker answering fetches by sleep-polling and by a per-partition
//! `Notify` under `tokio::time::timeout`.
//!
//! Each run starts the broker as its own process (`serve`), so its CPU is
//! read from `/proc/<pid>/stat` apart from the load generator's. Runs are
//! interleaved (A B C A B C ...) and the table gives medians with
//! [min..max].
//!
//! The load: `--consumers` connections, each long-polling one of
//! `--partitions` partitions (`--min-bytes`, `max_wait` 1 s) from its
//! position; one producer writing one record at a time (`acks=1`) to the
//! partitions in turn at `--rate` records/s, each record carrying its send
//! time. Wake-up latency is a fetch's arrival minus the send time of the
//! newest record it carries (the produce that satisfied it); answers that
//! came at `max_wait` with less than `min_bytes` are counted apart.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clap::Parser;
use hdrhistogram::Histogram;
use kafka_protocol::records::RecordBatchDecoder;
use tokio::time::Instant;

use crate::wire::{self, Wire};

#[path = "../../tests/support/proc.rs"]
mod procfs;

#[derive(Parser, Debug, Clone)]
pub struct BenchArgs {
    /// Parked consumers (one connection each).
    #[arg(long, default_value_t = 10_000)]
    consumers: usize,
    /// Partitions they spread over.
    #[arg(long, default_value_t = 100)]
    partitions: i32,
    /// Records produced per second, in all.
    #[arg(long, default_value_t = 500)]
    rate: u64,
    /// Seconds measured in each run (after one second of warm-up).
    #[arg(long, default_value_t = 5)]
    seconds: u64,
    /// Runs of each strategy.
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// Strategies, comma-separated: purgatory, poll, notify.
    #[arg(long, value_delimiter = ',', default_value = "purgatory,poll,notify")]
    strategies: Vec<String>,
    /// Each fetch's `min_bytes` (a one-record batch is about 70 bytes).
    #[arg(long, default_value_t = 1)]
    min_bytes: i32,
    /// The sleep-poll interval, ms.
    #[arg(long, default_value_t = 10)]
    poll_ms: u64,
}

/// One run's figures.
#[derive(Clone, Copy, Debug)]
struct Run {
    cpu_ms: f64,
    requests: f64,
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
    empty: f64,
}

pub async fn run(args: BenchArgs) -> i32 {
    println!(
        "{} consumers parked on {} partitions (min_bytes {}), {} records/s, {} s measured, {} runs each, interleaved",
        args.consumers, args.partitions, args.min_bytes, args.rate, args.seconds, args.repeat
    );
    let mut results: HashMap<String, Vec<Run>> = HashMap::new();
    for round in 0..args.repeat {
        for s in &args.strategies {
            let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
            let load = load.split_whitespace().next().unwrap_or("?").to_string();
            match one(&args, s).await {
                Ok(r) => {
                    println!(
                        "round {} {s:>9} (load {load}): broker CPU {:.0} ms for {:.0} requests, wake-up p50 {:.2} / p99 {:.2} / max {:.2} ms, {:.0} answers at max_wait",
                        round + 1,
                        r.cpu_ms,
                        r.requests,
                        r.p50_ms,
                        r.p99_ms,
                        r.max_ms,
                        r.empty
                    );
                    results.entry(s.clone()).or_default().push(r);
                }
                Err(e) => {
                    eprintln!("{s}: {e}");
                    return 1;
                }
            }
        }
    }
    println!("\n| fetch wait | broker CPU ms | CPU µs per request | wake-up p50 ms | p99 ms | max ms | CPU / purgatory's | p99 / purgatory's |");
    println!("|---|---|---|---|---|---|---|---|");
    let base = results.get("purgatory").map(|r| summary(r));
    for s in &args.strategies {
        let Some(r) = results.get(s) else { continue };
        let m = summary(r);
        let per_request: Vec<f64> = r
            .iter()
            .map(|x| x.cpu_ms * 1e3 / x.requests.max(1.0))
            .collect();
        let ratio = |f: fn(&Run) -> f64| {
            base.map_or("-".to_string(), |b| {
                format!("{:.2}", f(&m) / f(&b).max(1e-9))
            })
        };
        println!(
            "| {s} | {} | {} | {} | {} | {} | {} | {} |",
            cell(r.iter().map(|x| x.cpu_ms).collect(), 0),
            cell(per_request, 1),
            cell(r.iter().map(|x| x.p50_ms).collect(), 2),
            cell(r.iter().map(|x| x.p99_ms).collect(), 2),
            cell(r.iter().map(|x| x.max_ms).collect(), 2),
            ratio(|x| x.cpu_ms),
            ratio(|x| x.p99_ms),
        );
    }
    0
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The medians of a strategy's runs.
fn summary(r: &[Run]) -> Run {
    Run {
        cpu_ms: median(r.iter().map(|x| x.cpu_ms).collect()),
        requests: median(r.iter().map(|x| x.requests).collect()),
        p50_ms: median(r.iter().map(|x| x.p50_ms).collect()),
        p99_ms: median(r.iter().map(|x| x.p99_ms).collect()),
        max_ms: median(r.iter().map(|x| x.max_ms).collect()),
        empty: median(r.iter().map(|x| x.empty).collect()),
    }
}

/// "median [min..max]".
fn cell(v: Vec<f64>, digits: usize) -> String {
    let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    format!("{:.d$} [{:.d$}..{:.d$}]", median(v), lo, hi, d = digits)
}

/// The broker as a child process; killed when dropped.
struct Broker {
    child: Child,
    addr: SocketAddr,
}

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Broker {
    fn start(args: &BenchArgs, strategy: &str) -> Result<Broker, String> {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let mut child = Command::new(exe)
            .args(["serve", "--listen", "127.0.0.1:0", "--followers", "0"])
            .args([
                "--topics",
                "bench",
                "--partitions",
                &args.partitions.to_string(),
            ])
            .args([
                "--fetch-wait",
                strategy,
                "--poll-ms",
                &args.poll_ms.to_string(),
            ])
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| e.to_string())?;
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .map_err(|e| e.to_string())?;
        let addr = line
            .trim()
            .strip_prefix("listening on ")
            .and_then(|a| a.parse().ok())
            .ok_or_else(|| format!("broker said {line:?}"))?;
        Ok(Broker { child, addr })
    }

    fn cpu_ms(&self) -> u64 {
        procfs::cpu_ms(&self.child.id().to_string())
    }
}

/// Everything the load tasks share.
struct Shared {
    epoch: Instant,
    measuring: AtomicBool,
    stop: AtomicBool,
    latency: Mutex<Histogram<u64>>,
    answers: AtomicU64,
    empty: AtomicU64,
}

async fn one(args: &BenchArgs, strategy: &str) -> Result<Run, String> {
    let broker = Broker::start(args, strategy)?;
    let shared = Arc::new(Shared {
        epoch: Instant::now(),
        measuring: AtomicBool::new(false),
        stop: AtomicBool::new(false),
        latency: Mutex::new(Histogram::new(3).unwrap()),
        answers: AtomicU64::new(0),
        empty: AtomicU64::new(0),
    });
    let mut consumers = Vec::with_capacity(args.consumers);
    for c in 0..args.consumers {
        let wire = Wire::connect(broker.addr)
            .await
            .map_err(|e| format!("consumer {c} cannot connect: {e}"))?;
        let p = c as i32 % args.partitions;
        consumers.push(tokio::spawn(consume(
            wire,
            p,
            args.min_bytes,
            shared.clone(),
        )));
    }
    let producer = tokio::spawn(produce(
        Wire::connect(broker.addr)
            .await
            .map_err(|e| e.to_string())?,
        args.partitions,
        args.rate,
        shared.clone(),
    ));
    tokio::time::sleep(Duration::from_secs(1)).await;
    let cpu0 = broker.cpu_ms();
    let answers0 = shared.answers.load(Ordering::Relaxed);
    let empty0 = shared.empty.load(Ordering::Relaxed);
    shared.measuring.store(true, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_secs(args.seconds)).await;
    shared.measuring.store(false, Ordering::SeqCst);
    let cpu = broker.cpu_ms() - cpu0;
    let answers = shared.answers.load(Ordering::Relaxed) - answers0;
    let empty = shared.empty.load(Ordering::Relaxed) - empty0;
    shared.stop.store(true, Ordering::SeqCst);
    let produced = producer.await.map_err(|e| e.to_string())?;
    drop(broker);
    for c in consumers {
        let _ = c.await;
    }
    let h = shared.latency.lock().unwrap();
    let ms = |q: f64| h.value_at_quantile(q) as f64 / 1e3;
    Ok(Run {
        cpu_ms: cpu as f64,
        requests: (answers + produced) as f64,
        p50_ms: ms(0.5),
        p99_ms: ms(0.99),
        max_ms: h.max() as f64 / 1e3,
        empty: empty as f64,
    })
}

/// Writes one record at a time to the partitions in turn, at `rate`; each
/// record's value is its send time (µs since the epoch). Returns the number
/// sent while measuring.
async fn produce(mut wire: Wire, partitions: i32, rate: u64, shared: Arc<Shared>) -> u64 {
    let interval = Duration::from_secs_f64(1.0 / rate.max(1) as f64);
    let mut next = Instant::now();
    let mut sent = 0;
    let mut p = 0;
    while !shared.stop.load(Ordering::SeqCst) {
        tokio::time::sleep_until(next).await;
        next += interval;
        let at = shared.epoch.elapsed().as_micros() as u64;
        let request = wire::produce(
            "bench",
            p,
            1,
            Duration::from_secs(5),
            wire::batch(&[&at.to_be_bytes()]),
        );
        if wire.call(&request, wire::PRODUCE_VERSION).await.is_err() {
            break;
        }
        if shared.measuring.load(Ordering::Relaxed) {
            sent += 1;
        }
        p = (p + 1) % partitions;
    }
    sent
}

/// Long-polls partition `p` from its start; records each answer's wake-up
/// latency.
async fn consume(mut wire: Wire, p: i32, min_bytes: i32, shared: Arc<Shared>) {
    let mut offset = 0i64;
    while !shared.stop.load(Ordering::SeqCst) {
        let request = wire::fetch(
            "bench",
            &[(p, offset)],
            Duration::from_secs(1),
            min_bytes,
            1 << 20,
        );
        let Ok(response) = wire.call(&request, wire::FETCH_VERSION).await else {
            return;
        };
        let now = shared.epoch.elapsed().as_micros() as u64;
        let measuring = shared.measuring.load(Ordering::Relaxed);
        let Some(mut records) = response.responses[0].partitions[0].records.clone() else {
            continue;
        };
        let bytes = records.len();
        let Ok(sets) = RecordBatchDecoder::decode_all(&mut records) else {
            return;
        };
        // The newest record carried: the produce that satisfied the fetch.
        let mut newest = None;
        for r in sets.iter().flat_map(|s| s.records.iter()) {
            if r.offset >= offset {
                newest = r.value.as_ref().map(|v| {
                    let mut b = [0u8; 8];
                    b.copy_from_slice(&v[..8]);
                    u64::from_be_bytes(b)
                });
                offset = r.offset + 1;
            }
        }
        if measuring {
            shared.answers.fetch_add(1, Ordering::Relaxed);
            match newest {
                Some(at) if bytes >= min_bytes as usize => {
                    let _ = shared
                        .latency
                        .lock()
                        .unwrap()
                        .record(now.saturating_sub(at).max(1));
                }
                // Answered at max_wait, with less than min_bytes.
                _ => {
                    shared.empty.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }
}
