//! Soak: a mixed load for a given time, then a check that everything drains and
//! memory comes back.
//!
//! ```sh
//! cargo run --release --example soak -- --minutes 10
//! ```
//!
//! The load (default 50,000 operations/s): each operation watches 2 keys out of
//! 10,000 with a timeout of 50-250 ms. Of them, 40% are completed by a key event
//! and 15% through their `OpRef`, both fired by a `Timer` 0-100 ms later; 10% are
//! cancelled by key, 10% have their handle dropped, and the rest expire. The timer
//! also carries retry-style tasks, half of them cancelled. Once a second it prints
//! RSS, pending counts and expiry lateness. After the load it waits for the
//! purgatory and timer to drain and exits non-zero unless pending counts are zero,
//! the counters balance, the live heap is back within 10% (plus 50 KB) of its size
//! before the load, and RSS is back within 10% of its level before the load;
//! both allow for cells the purgatory made for a peak above the warm-up's,
//! which it keeps for the operations that follow (its `cells` metric).
//!
//! RSS measures what the process holds only if the C allocator gives freed memory
//! back, and glibc's defaults do not. Each thread keeps up to seven freed chunks
//! of every small size class in its cache (tcache); scattered over the arena,
//! those chunks pin pages and stop free neighbours from merging, so after a
//! heavy load of small allocations RSS stays near its peak however much was
//! freed. On glibc the soak therefore runs itself again with that cache off
//! (`GLIBC_TUNABLES=glibc.malloc.tcache_count=0`), and it reads RSS both as left
//! and after `malloc_trim(0)`, at both points, checking the trimmed figure.
//! Neither setting can release live memory, so a leak in the crate still fails
//! the check, and the live-heap count (exact, from a counting allocator) must
//! match too. `--allocator-defaults` keeps glibc's defaults, to see what a
//! service on them would see.
//!
//! Options: `--minutes M` (fractions allowed), `--rate R`, `--allocator-defaults`.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hdrhistogram::Histogram;
use tokio::time::Instant;
use tokio_purgatory::{Operation, Purgatory, Timer};

static LATENESS: Mutex<Option<Histogram<u64>>> = Mutex::new(None);

/// Counts live heap bytes, so that memory this program holds can be told apart
/// from memory the C allocator keeps after it was freed.
#[path = "../tests/support/alloc.rs"]
mod alloc;

#[global_allocator]
static GLOBAL: alloc::Counting = alloc::Counting;

fn live_mb() -> f64 {
    alloc::live_bytes() as f64 / (1024.0 * 1024.0)
}

struct Op {
    ready: Arc<AtomicBool>,
    deadline: Instant,
    _payload: Vec<u8>,
}

impl Operation for Op {
    type Output = ();
    fn try_complete(&mut self) -> Option<()> {
        self.ready.load(Ordering::Acquire).then_some(())
    }
    fn on_expiration(self) {
        let late = Instant::now().saturating_duration_since(self.deadline);
        if let Some(h) = LATENESS.lock().unwrap().as_mut() {
            h.record(late.as_micros().max(1) as u64).ok();
        }
    }
}

#[path = "../tests/support/proc.rs"]
mod procfs;

fn rss_mb() -> f64 {
    procfs::status_mb("VmRSS")
}

/// RSS as the allocator left it, then RSS after asking it to release free pages
/// (the two are equal where no trim is available).
fn rss_untrimmed_and_trimmed() -> (f64, f64) {
    let untrimmed = rss_mb();
    alloc::trim();
    (untrimmed, rss_mb())
}

#[path = "../tests/support/rng.rs"]
mod rng;
use rng::Rng;

fn arg(name: &str, default: f64) -> f64 {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(|v| {
            v.parse()
                .unwrap_or_else(|_| panic!("{name}: not a number: {v}"))
        })
        .unwrap_or(default)
}

/// The glibc tunable that turns the per-thread cache off.
const NO_TCACHE: &str = "glibc.malloc.tcache_count=0";

fn main() {
    let defaults = std::env::args().any(|a| a == "--allocator-defaults");
    let tunables = std::env::var("GLIBC_TUNABLES").unwrap_or_default();
    let glibc = cfg!(all(target_os = "linux", target_env = "gnu"));
    if glibc && !defaults && !tunables.contains("tcache_count") {
        // Tunables are read at process start, so the setting needs a new process.
        let tunables = if tunables.is_empty() {
            NO_TCACHE.to_string()
        } else {
            format!("{tunables}:{NO_TCACHE}")
        };
        let status = std::process::Command::new(std::env::current_exe().expect("own path"))
            .args(std::env::args().skip(1))
            .env("GLIBC_TUNABLES", tunables)
            .status()
            .expect("run the soak again with the allocator set");
        std::process::exit(status.code().unwrap_or(1));
    }
    let allocator = if glibc {
        if tunables.contains("tcache_count") {
            format!("glibc, GLIBC_TUNABLES={tunables}")
        } else {
            "glibc defaults".to_string()
        }
    } else {
        "the system allocator".to_string()
    };
    // Exit only after the runtime is gone, so a leak checker sees its threads
    // joined and its memory freed.
    if !soak(&allocator) {
        std::process::exit(1);
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn soak(allocator: &str) -> bool {
    let minutes = arg("--minutes", 1.0);
    let rate = arg("--rate", 50_000.0);
    *LATENESS.lock().unwrap() = Some(Histogram::new(3).unwrap());

    let purgatory: Purgatory<u32, Op> = Purgatory::builder().name("soak").build().unwrap();
    let timer = Timer::new();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let cold_rss = rss_mb();
    let cold_live = live_mb();
    println!("soak: {minutes} min at {rate:.0} ops/s; allocator: {allocator}");

    // Warm-up: a short burst, drained, so the allocator and runtime reach their
    // working size. RSS after it is the level the main load must return to.
    let warmup = (minutes * 60.0 / 10.0).clamp(2.0, 10.0);
    println!("warm-up: {warmup:.0} s");
    let mut registered = load(&purgatory, &timer, Duration::from_secs_f64(warmup), rate, 1).await;
    drain(&purgatory, &timer).await;
    let (untrimmed_before, baseline) = rss_untrimmed_and_trimmed();
    let live_before = live_mb();
    let cells_before = purgatory.metrics().cells;
    println!("before load: RSS {baseline:.1} MB trimmed ({untrimmed_before:.1} MB untrimmed), live heap {live_before:.2} MB (cold start: RSS {cold_rss:.1} MB, live heap {cold_live:.2} MB)");
    registered += load(
        &purgatory,
        &timer,
        Duration::from_secs_f64(minutes * 60.0),
        rate,
        2,
    )
    .await;
    let drained = drain(&purgatory, &timer).await;

    let m = purgatory.metrics();
    let (untrimmed_after, after) = rss_untrimmed_and_trimmed();
    let live_after = live_mb();
    let balanced = m.registered == m.completed + m.expired + m.cancelled + m.handed_back;
    println!(
        "after load: registered {}, completed {}, expired {}, cancelled {}, purged {}, panicked {}",
        m.registered, m.completed, m.expired, m.cancelled, m.purged, m.panicked
    );
    println!(
        "after load: delayed {}, watched {}, keys {}, timer {}; live heap {:.2} MB (before {:.2} MB)",
        m.delayed,
        m.watched,
        m.keys,
        timer.len(),
        live_after,
        live_before
    );
    println!(
        "after load: RSS {:.1} MB trimmed (before load {:.1} MB, {:+.1}%); untrimmed {:.1} MB (before load {:.1} MB, {:+.1}%)",
        after,
        baseline,
        (after - baseline) / baseline * 100.0,
        untrimmed_after,
        untrimmed_before,
        (untrimmed_after - untrimmed_before) / untrimmed_before * 100.0,
    );
    // Cells made for a peak above the warm-up's are kept for the operations
    // that follow (the purgatory's `cells`), not leaked: they are allowed for.
    let kept_mb = m.cells.saturating_sub(cells_before) as f64
        * Purgatory::<u32, Op>::cell_bytes() as f64
        / (1024.0 * 1024.0);
    println!(
        "after load: cells {} (before load {}): {:.2} MB kept for the operations that follow",
        m.cells, cells_before, kept_mb
    );
    let rss_ok = after <= baseline * 1.10 + kept_mb;
    let heap_ok = live_after <= live_before * 1.10 + 0.05 + kept_mb;
    let ok = drained
        && balanced
        && m.delayed == 0
        && m.watched == 0
        && m.keys == 0
        && timer.is_empty()
        && rss_ok
        && heap_ok;
    println!("soak {}", if ok { "passed" } else { "FAILED" });
    assert_eq!(registered, m.registered);
    ok
}

/// Runs the mixed load for `load_for`, printing a line a second. Returns how many
/// operations it registered.
async fn load(
    purgatory: &Purgatory<u32, Op>,
    timer: &Timer,
    load_for: Duration,
    rate: f64,
    seed: u64,
) -> u64 {
    let start = Instant::now();
    let registered = Arc::new(AtomicU64::new(0));
    let generator = {
        let (p, t, registered) = (purgatory.clone(), timer.clone(), registered.clone());
        tokio::spawn(async move {
            let mut rng = Rng(0x5EED_50AC ^ seed);
            let per_ms = (rate / 1000.0).max(1.0) as u64;
            let mut tick = tokio::time::interval(Duration::from_millis(1));
            while start.elapsed() < load_for {
                tick.tick().await;
                for _ in 0..per_ms {
                    let ready = Arc::new(AtomicBool::new(false));
                    let keys = [rng.below(10_000) as u32, rng.below(10_000) as u32];
                    let timeout = Duration::from_millis(50 + rng.below(200));
                    let op = Op {
                        ready: ready.clone(),
                        deadline: Instant::now() + timeout,
                        _payload: vec![0; rng.below(256) as usize],
                    };
                    let handle = p
                        .try_complete_else_watch(op, timeout, keys)
                        .expect("accepted");
                    registered.fetch_add(1, Ordering::Relaxed);
                    let event_in = Duration::from_millis(rng.below(100));
                    match rng.below(20) {
                        0..=7 => {
                            let p = p.clone();
                            let _ = t.schedule(event_in, move || {
                                ready.store(true, Ordering::Release);
                                p.try_complete_watched(&keys[0]);
                            });
                            handle.detach();
                        }
                        8..=10 => {
                            if let Some(r) = handle.op_ref() {
                                let _ = t.schedule(event_in, move || {
                                    ready.store(true, Ordering::Release);
                                    r.try_complete();
                                });
                            }
                            handle.detach();
                        }
                        11..=12 => {
                            let p = p.clone();
                            let _ = t.schedule(event_in, move || {
                                drop(p.cancel_for_key(&keys[1]));
                            });
                            handle.detach();
                        }
                        13..=14 => drop(handle), // the client went away
                        _ => handle.detach(),    // expires
                    }
                    // Retry-style timer tasks, half cancelled.
                    if let Ok(h) = t.schedule(Duration::from_millis(rng.below(500)), || {}) {
                        if rng.below(2) == 0 {
                            h.cancel();
                        }
                    }
                }
            }
        })
    };

    let mut second = tokio::time::interval(Duration::from_secs(1));
    second.tick().await;
    while !generator.is_finished() {
        second.tick().await;
        let m = purgatory.metrics();
        let late = LATENESS
            .lock()
            .unwrap()
            .replace(Histogram::new(3).unwrap())
            .unwrap();
        println!(
            "{:>6.0} s  rss {:>6.1} MB  heap {:>6.2} MB  delayed {:>6}  watched {:>6}  keys {:>5}  timer {:>6}  expiry lateness p50 {:.2} p99 {:.2} max {:.2} ms",
            start.elapsed().as_secs_f64(),
            rss_mb(),
            live_mb(),
            m.delayed,
            m.watched,
            m.keys,
            timer.len(),
            late.value_at_quantile(0.5) as f64 / 1000.0,
            late.value_at_quantile(0.99) as f64 / 1000.0,
            late.max() as f64 / 1000.0,
        );
    }
    generator.await.unwrap();
    registered.load(Ordering::Relaxed)
}

/// Waits for everything pending to finish, then walks every key once so
/// tombstones and emptied keys go (the amortised purge would do it on the next
/// registrations). Returns whether it drained in time.
async fn drain(purgatory: &Purgatory<u32, Op>, timer: &Timer) -> bool {
    let drained = tokio::time::timeout(Duration::from_secs(10), async {
        while purgatory.delayed() > 0 || !timer.is_empty() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .is_ok();
    for k in 0..10_000u32 {
        purgatory.try_complete_watched(&k);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    drained
}
