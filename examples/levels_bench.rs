//! The `acks=all` produce path on one hot partition: P produces in flight, each
//! waiting for the high watermark to cover its offset, and the high watermark
//! advancing a few batches at a time. Two ways side by side:
//!
//! - `walk`: every produce watches the partition key, and each advance walks
//!   every watcher (`try_complete_watched`, Kafka's `checkAndComplete`);
//! - `levels`: every produce watches the key at its offset
//!   (`Watch::level`), and each advance checks only the produces it covers
//!   (`try_complete_reached`).
//!
//! ```sh
//! cargo run --release --example levels_bench -- --compare
//! ```
//!
//! `--compare` runs each (P, way) in its own process, interleaved (walk levels
//! walk levels ...) for `--repeat` rounds (default 3), and prints medians with
//! [min..max]: checks per advance, CPU per completed produce (the measuring
//! thread's CPU time from `/proc/thread-self/schedstat`, over the steady
//! phase), and completion latency (from the store of the new high watermark to
//! the end of the call that completed the produce, p50/p99). Each run keeps P
//! produces in flight: after each advance it registers as many new ones, at the
//! offsets above, as the advance completed.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use hdrhistogram::Histogram;
use tokio_purgatory::{Operation, Purgatory, Watch};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Way {
    /// Walk every watcher of the key on each advance.
    Walk,
    /// Watch at a level; check what each advance reaches.
    Levels,
}

/// The `acks=all` produce path on one hot partition: walking every watcher
/// against watching at levels.
#[derive(Debug, Clone, Parser)]
#[command(name = "levels_bench")]
struct Opts {
    /// Produces in flight (one run).
    #[arg(long, default_value_t = 10_000)]
    p: u64,
    /// One run's way.
    #[arg(long, value_enum, default_value_t = Way::Levels)]
    way: Way,
    /// Offsets per produce (a batch).
    #[arg(long, default_value_t = 1)]
    batch: u64,
    /// Batches the high watermark advances by at a time.
    #[arg(long, default_value_t = 4)]
    step: u64,
    /// Checks a run may spend (the walk's advances are cut to fit it; at
    /// least 200 advances are made).
    #[arg(long, default_value_t = 40_000_000)]
    budget: u64,
    /// Runs every P in `--ps` both ways, each in its own process, interleaved.
    #[arg(long)]
    compare: bool,
    /// The P values `--compare` runs.
    #[arg(long, value_delimiter = ',', default_value = "100,1000,10000,100000")]
    ps: Vec<u64>,
    /// Rounds of `--compare`.
    #[arg(long, default_value_t = 3)]
    repeat: usize,
}

/// A produce waiting for the high watermark to pass its last offset.
struct Produce {
    hw: Arc<AtomicU64>,
    last: u64,
    checks: Arc<AtomicU64>,
}

impl Operation for Produce {
    type Output = ();
    fn try_complete(&mut self) -> Option<()> {
        self.checks.fetch_add(1, Ordering::Relaxed);
        (self.hw.load(Ordering::Acquire) > self.last).then_some(())
    }
    fn on_expiration(self) {}
}

/// CPU time of this thread, in ns.
fn thread_cpu_ns() -> u64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

struct Row {
    checks_per_advance: f64,
    cpu_ns_per_op: f64,
    lat_p50_us: f64,
    lat_p99_us: f64,
}

fn run(o: &Opts) -> Row {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let _in = rt.enter();
    let p: Purgatory<u32, Produce> = Purgatory::builder().name("produce").build().unwrap();
    let hw = Arc::new(AtomicU64::new(0));
    let checks = Arc::new(AtomicU64::new(0));
    let mut next_offset = 0u64;
    let register = |next_offset: &mut u64| {
        let last = *next_offset + o.batch - 1;
        *next_offset += o.batch;
        let op = Produce {
            hw: hw.clone(),
            last,
            checks: checks.clone(),
        };
        let h = match o.way {
            Way::Walk => p.try_complete_else_watch(op, Duration::from_secs(3600), [0]),
            Way::Levels => p.try_complete_else_watch_levels(
                op,
                Duration::from_secs(3600),
                [Watch::level(0, last + 1)],
            ),
        };
        h.unwrap().detach();
    };
    for _ in 0..o.p {
        register(&mut next_offset);
    }
    let per_advance_walk = o.p.max(1);
    let advances = match o.way {
        Way::Walk => (o.budget / per_advance_walk).clamp(200, 50_000),
        Way::Levels => 50_000,
    };
    // Warm up, then measure.
    let mut lat = Histogram::<u64>::new(3).unwrap();
    let mut completed = 0u64;
    let mut cpu = 0u64;
    checks.store(0, Ordering::Relaxed);
    for phase in 0..2 {
        let n = if phase == 0 {
            advances / 10 + 1
        } else {
            advances
        };
        let checks_before = checks.load(Ordering::Relaxed);
        let cpu_before = thread_cpu_ns();
        let mut done = 0;
        for _ in 0..n {
            let level = hw.load(Ordering::Relaxed) + o.step * o.batch;
            let t = Instant::now();
            hw.store(level, Ordering::Release);
            let c = match o.way {
                Way::Walk => p.try_complete_watched(&0),
                Way::Levels => p.try_complete_reached(&0, level),
            } as u64;
            let took = t.elapsed().as_micros() as u64;
            if phase == 1 {
                lat.record_n(took.max(1), c).ok();
            }
            done += c;
            for _ in 0..c {
                register(&mut next_offset);
            }
        }
        if phase == 1 {
            cpu = thread_cpu_ns() - cpu_before;
            completed = done;
            let spent = checks.load(Ordering::Relaxed) - checks_before;
            // Registration runs two checks per produce: count the advances' own.
            let by_advances = spent.saturating_sub(2 * done);
            return Row {
                checks_per_advance: by_advances as f64 / n as f64,
                cpu_ns_per_op: cpu as f64 / completed.max(1) as f64,
                lat_p50_us: lat.value_at_quantile(0.5) as f64,
                lat_p99_us: lat.value_at_quantile(0.99) as f64,
            };
        }
    }
    unreachable!("{cpu} {completed}")
}

fn print_row(r: &Row) {
    println!(
        "ROW\t{:.1}\t{:.1}\t{:.1}\t{:.1}",
        r.checks_per_advance, r.cpu_ns_per_op, r.lat_p50_us, r.lat_p99_us
    );
}

fn child(o: &Opts, p: u64, way: Way) -> Option<Row> {
    let way = match way {
        Way::Walk => "walk",
        Way::Levels => "levels",
    };
    let text = runs::child([
        "--p".to_string(),
        p.to_string(),
        "--way".into(),
        way.into(),
        "--batch".into(),
        o.batch.to_string(),
        "--step".into(),
        o.step.to_string(),
        "--budget".into(),
        o.budget.to_string(),
    ])?;
    let line = text.lines().find(|l| l.starts_with("ROW\t"))?;
    let v: Vec<f64> = line
        .split('\t')
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    (v.len() == 4).then(|| Row {
        checks_per_advance: v[0],
        cpu_ns_per_op: v[1],
        lat_p50_us: v[2],
        lat_p99_us: v[3],
    })
}

#[path = "../tests/support/runs.rs"]
mod runs;

fn compare(o: &Opts) {
    let ways = [Way::Walk, Way::Levels];
    let configs: Vec<(usize, u64, usize, Way)> =
        o.ps.iter()
            .enumerate()
            .flat_map(|(i, &p)| ways.iter().enumerate().map(move |(j, &w)| (i, p, j, w)))
            .collect();
    let mut rows: Vec<Vec<Vec<Row>>> =
        o.ps.iter()
            .map(|_| ways.iter().map(|_| Vec::new()).collect())
            .collect();
    let results = runs::interleave(
        o.repeat,
        &configs,
        |&(_, p, _, way)| format!("P {p} {way:?}"),
        |&(_, p, _, way)| child(o, p, way),
    );
    for (c, r) in results {
        let (i, _, j, _) = configs[c];
        rows[i][j].push(r);
    }
    println!(
        "| P | way | checks per advance | CPU per completed produce, ns | latency p50 / p99, µs | CPU walk / levels |"
    );
    println!("|---|---|---|---|---|---|");
    for (i, &p) in o.ps.iter().enumerate() {
        let cpu_median = |j: usize| runs::spread(rows[i][j].iter().map(|r| r.cpu_ns_per_op)).0;
        let ratio = cpu_median(0) / cpu_median(1);
        for (j, way) in ways.iter().enumerate() {
            let rs = &rows[i][j];
            if rs.is_empty() {
                continue;
            }
            let col = |f: fn(&Row) -> f64| runs::spread(rs.iter().map(f));
            println!(
                "| {p} | {} | {} | {} | {} / {} | {} |",
                match way {
                    Way::Walk => "walk",
                    Way::Levels => "levels",
                },
                runs::cell(col(|r| r.checks_per_advance), 1),
                runs::cell(col(|r| r.cpu_ns_per_op), 1),
                col(|r| r.lat_p50_us).0,
                col(|r| r.lat_p99_us).0,
                if j == 0 {
                    format!("{ratio:.0}x")
                } else {
                    String::new()
                },
            );
        }
    }
}

fn main() {
    let o = Opts::parse();
    if o.compare {
        compare(&o);
    } else {
        print_row(&run(&o));
    }
}
