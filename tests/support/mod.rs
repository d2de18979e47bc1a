//! Helpers shared by the integration tests (`mod support;` in each).
#![allow(dead_code)]

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::time::Duration;

/// `n` milliseconds.
pub fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// Lets spawned tasks (the reaper) run: enough yields for a reaper turn and the
/// wake-ups it causes, with no time passing.
pub async fn settle() {
    for _ in 0..50 {
        tokio::task::yield_now().await;
    }
}

/// Runs `f` on its own thread and fails if it has not returned within `secs`
/// seconds (a deadlock), re-raising its panic if it panicked.
pub fn within<T: Send + 'static>(secs: u64, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(catch_unwind(AssertUnwindSafe(f)));
    });
    match rx.recv_timeout(Duration::from_secs(secs)) {
        Ok(Ok(v)) => v,
        Ok(Err(panic)) => resume_unwind(panic),
        Err(_) => panic!("deadlock: no answer within {secs} s"),
    }
}

/// A paused current-thread runtime.
pub fn paused() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap()
}

/// Runs the future `make` gives on a paused current-thread runtime of its
/// own thread, failing as [`within`] does if it has not ended in `secs`
/// seconds.
pub fn paused_within<T, F>(secs: u64, make: impl FnOnce() -> F + Send + 'static) -> T
where
    T: Send + 'static,
    F: std::future::Future<Output = T>,
{
    within(secs, move || paused().block_on(make()))
}

/// A multi-thread runtime of two workers (the machine's cores).
pub fn multi() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// Every operation registered has finished one way or another.
pub fn balanced(m: &tokio_purgatory::PurgatoryMetrics) -> bool {
    m.registered == m.completed + m.expired + m.cancelled + m.handed_back
}

/// A slot user code reads a purgatory or timer from (set once it exists,
/// emptied to let it go).
pub type Slot<T> = std::sync::Arc<std::sync::Mutex<Option<T>>>;

/// What `slot` holds now.
pub fn get<T: Clone>(slot: &Slot<T>) -> Option<T> {
    slot.lock().unwrap().clone()
}

/// `f`'s output, failing if it has not come within an hour (of paused time,
/// in the tests that use it).
pub async fn resolve<F: std::future::Future>(f: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(3600), f)
        .await
        .expect("a handle never resolved")
}

/// An operation whose check completes it once its flag is set; it expires
/// to `()`.
pub struct FlagOp(pub std::sync::Arc<std::sync::atomic::AtomicBool>);

impl tokio_purgatory::Operation for FlagOp {
    type Output = ();
    fn try_complete(&mut self) -> Option<()> {
        self.0
            .load(std::sync::atomic::Ordering::SeqCst)
            .then_some(())
    }
    fn on_expiration(self) {}
}

pub mod alloc;
pub mod recorded;
pub mod rng;
