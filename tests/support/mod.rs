//! Helpers shared by the integration tests (`mod support;` in each).
#![allow(dead_code)]

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

/// Every operation registered has finished one way or another.
pub fn balanced(m: &tokio_purgatory::PurgatoryMetrics) -> bool {
    m.registered == m.completed + m.expired + m.cancelled + m.handed_back
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
pub mod rng;
