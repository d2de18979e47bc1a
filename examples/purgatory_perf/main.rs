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
//! - `--impl purgatory|task|fair|lean|lean-wheel|sharded|key-sharded|floor`: this crate; a task per request awaiting
//!   `tokio::time::timeout` on a completion signal with a `DashMap` of key ->
//!   watchers; the fair one-lock purgatory (a `tokio_util::time::DelayQueue`, a
//!   slab with generation-checked ids and `HashMap<key, Vec<id>>` lists behind
//!   one mutex, running every check this crate runs and purging as Kafka); the
//!   same one-lock purgatory under this crate's rules (`lean`: no check, expiry
//!   or drop under its lock, registration checked again after the watch), and
//!   that one with this crate's timing wheel in place of `DelayQueue`
//!   (`lean-wheel`); that one split into `--shards` shards (`sharded`, default
//!   2: a registration goes to its thread's shard, which holds its slab, wheel
//!   and watch lists; a walk visits every shard); the same with each key's
//!   list in the shard its key hashes to (`key-sharded`); the harness alone, with no
//!   purgatory (the CPU floor under every run).
//! - `--runtime current|multi` (multi: 2 workers).
//! - `--generators N`: N generator tasks share the load, so saturation measures
//!   the implementation rather than one generator (default 1, as Kafka's).
//! - `--compare`: runs every implementation `--repeat` times (default 3),
//!   interleaved (A B C A B C ...), each run in its own process so CPU and peak
//!   RSS are its own, and prints medians with [min..max] and the ratios of this
//!   crate against the best peer. The load average is printed before each run.
//!   It runs the harness alone too, and prints each one's CPU above that floor.
//!   It also prints each implementation's CPU and peak RSS paired by
//!   repetition against the fair one-lock purgatory's and `lean-wheel`'s (the
//!   median of the ratios of runs made one after the other), steadier than
//!   the ratio of the medians on a noisy machine.
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

mod peers;
mod report;
mod workload;

use peers::*;
use report::*;
use workload::*;

// ---------------------------------------------------------------- options

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Mode {
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
pub(crate) enum Imp {
    /// This crate.
    Purgatory,
    /// A task per request, `tokio::time::timeout_at` on a signal, a DashMap of watchers.
    Task,
    /// The fair one-lock purgatory: a `tokio_util::time::DelayQueue`, a slab
    /// of requests with generation-checked ids and `HashMap<key, Vec<id>>`
    /// watch lists behind one mutex; it runs every check this crate runs and
    /// purges its lists as Kafka does.
    Fair,
    /// The fair one-lock purgatory changed only where this crate's rules
    /// require: no check, expiry or drop of a request under its lock (a check
    /// takes the request out under the lock and runs with it released), and
    /// registration checks again after it watches. What the rules cost.
    Lean,
    /// As `lean`, with this crate's timing wheel (100 µs ticks) in place of
    /// `DelayQueue`, under the same lock, and its own expiry task sleeping
    /// until the wheel's next deadline.
    LeanWheel,
    /// `lean-wheel` split into `--shards` shards, each its own lock over its
    /// slab, its wheel and its requests' watch lists: a registration goes to
    /// its thread's shard, a walk walks the key in every shard, and one task
    /// expires every shard's wheel.
    Sharded,
    /// As `sharded`, with each key's watch list in the shard the key hashes
    /// to (one list per key): a registration takes its own shard's lock twice
    /// and each other shard of its keys once; a walk reads one list, then
    /// takes each shard holding a request on it twice.
    KeySharded,
    /// No purgatory: the harness alone (a request that would expire is counted
    /// expired at registration, one that would complete is counted when the
    /// driver reaches it). Its CPU is the floor under every implementation.
    Floor,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Runtime {
    Current,
    /// Two worker threads.
    Multi,
}

pub(crate) fn name<T: clap::ValueEnum>(v: &T) -> String {
    v.to_possible_value()
        .map(|p| p.get_name().to_string())
        .unwrap_or_default()
}

/// Kafka's `TestPurgatoryPerformance`, ported, with Rust peers side by side.
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "purgatory_perf")]
pub(crate) struct Opts {
    /// Requests to send.
    #[arg(long, default_value_t = 1_000_000)]
    pub(crate) num: usize,
    /// Requests per second (Poisson arrivals), across all generators.
    #[arg(long, default_value_t = 200_000.0)]
    pub(crate) rate: f64,
    /// Keys per request.
    #[arg(long, default_value_t = 3)]
    pub(crate) keys: usize,
    /// Keys are drawn from this many.
    #[arg(long = "key-space-size", default_value_t = 100)]
    pub(crate) key_space: usize,
    /// Timeout per request, ms.
    #[arg(long = "timeout", default_value_t = 200)]
    pub(crate) timeout_ms: u64,
    /// Median completion latency, ms (log-normal).
    #[arg(long, default_value_t = 50.0)]
    pub(crate) pct50: f64,
    /// 75th percentile completion latency, ms.
    #[arg(long, default_value_t = 150.0)]
    pub(crate) pct75: f64,
    /// `kafka` and `awaited` modes: every request watches the same `--keys`
    /// keys (drawn once) instead of keys drawn at random per request.
    #[arg(long)]
    pub(crate) shared_keys: bool,
    /// Payload bytes per request.
    #[arg(long, default_value_t = 0)]
    pub(crate) size: usize,
    #[arg(long, value_enum, default_value_t = Mode::Kafka)]
    pub(crate) mode: Mode,
    #[arg(long = "impl", value_enum, default_value_t = Imp::Purgatory)]
    pub(crate) imp: Imp,
    #[arg(long, value_enum, default_value_t = Runtime::Multi)]
    pub(crate) runtime: Runtime,
    /// This crate's wheel tick, in microseconds (default: the crate's default).
    #[arg(long)]
    pub(crate) tick_us: Option<u64>,
    /// `--impl sharded` and `key-sharded`: their number of shards.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=256))]
    pub(crate) shards: u32,
    /// Generator tasks sharing the load (1, as Kafka's).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) generators: u32,
    /// Run every implementation, interleaved, each run in its own process, and
    /// print medians and the ratios against the best peer.
    #[arg(long)]
    pub(crate) compare: bool,
    /// With --compare or --sweep: only these implementations (comma-separated;
    /// default all). The task-per-request peer takes seconds per run under
    /// overload, so a sweep may leave it out.
    #[arg(long, value_enum, value_delimiter = ',')]
    pub(crate) impls: Option<Vec<Imp>>,
    /// Repetitions of each implementation with --compare or --sweep.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) repeat: u32,
    /// Run every implementation at each of these rates (comma-separated) and
    /// write CSV and SVG charts to --out.
    #[arg(long, value_delimiter = ',')]
    pub(crate) sweep: Option<Vec<f64>>,
    /// Path prefix of the --sweep outputs.
    #[arg(long, default_value = "target/purgatory-perf")]
    pub(crate) out: String,
    /// Redraw the charts of a CSV written by --sweep.
    #[arg(long)]
    pub(crate) chart: Option<String>,
    /// No progress lines.
    #[arg(long)]
    pub(crate) quiet: bool,
}

pub(crate) fn parse() -> Opts {
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
