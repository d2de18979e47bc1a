//! Purgatory memory and throughput: `cargo bench --bench purgatory`.
//!
//! Reports bytes per pending operation (3 keys out of 1,000, pointer-sized
//! payload, counted by a global allocator over 1,000,000 pending operations),
//! what stays behind once they complete, and registration / completion throughput
//! from one task on a current-thread runtime.

use std::hint::black_box;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio_purgatory::{Operation, Purgatory};

#[path = "../tests/support/alloc.rs"]
mod alloc;

#[global_allocator]
static GLOBAL: alloc::Counting = alloc::Counting;

/// A pointer-sized operation that completes once its key's event says so.
struct Op(usize);

static READY: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

impl Operation for Op {
    type Output = ();
    fn try_complete(&mut self) -> Option<()> {
        black_box(self.0);
        READY.load(Ordering::Relaxed).then_some(())
    }
    fn on_expiration(self) {}
}

fn allocated() -> f64 {
    alloc::live_bytes() as f64
}

fn main() {
    let n: usize = if std::env::args().any(|a| a == "--quick") {
        100_000
    } else {
        1_000_000
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let p: Purgatory<u32, Op> = Purgatory::builder().name("bench").build().unwrap();
        READY.store(false, Ordering::SeqCst);
        let base = allocated();
        let t0 = std::time::Instant::now();
        for i in 0..n {
            let k = (i * 7919) as u32;
            p.try_complete_else_watch(Op(i), Duration::from_secs(3600), [k % 1000, (k + 1) % 1000, (k + 2) % 1000])
                .unwrap()
                .detach();
        }
        let reg = t0.elapsed();
        let per_pending = (allocated() - base) / n as f64;
        READY.store(true, Ordering::SeqCst);
        let t1 = std::time::Instant::now();
        let mut completed = 0;
        for k in 0..1000u32 {
            completed += p.try_complete_watched(&k);
        }
        let comp = t1.elapsed();
        let left = (allocated() - base) / n as f64;
        let m = p.metrics();
        println!("operations: {n}, 3 keys each out of 1000, pointer-sized payload");
        println!("  bytes per pending operation: {per_pending:.0}");
        println!("  bytes per operation left after all completed by key walks: {left:.1} (watched {}, keys {})", m.watched, m.keys);
        println!("  register (try_complete_else_watch + detach): {:.2} M/s", n as f64 / reg.as_secs_f64() / 1e6);
        println!("  complete by key walk (try_complete_watched): {:.2} M/s ({completed} completed)", completed as f64 / comp.as_secs_f64() / 1e6);
        assert_eq!(completed, n);
    });
}
