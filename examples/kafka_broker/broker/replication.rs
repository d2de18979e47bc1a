//! Simulated followers: each copies every append a fixed lag after it
//! happened, and moves the partition's high watermark when it was the last
//! one behind. A follower that has not caught up for `replica_lag_max` leaves
//! the partition's ISR (checked every half of it, as Kafka's ISR expiration
//! task does), which lets the high watermark go on without it (each append
//! recomputes it, so with no follower in the ISR it follows the log end); it
//! joins again once it has copied up to the high watermark.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;

use super::{Broker, Config, Partition};

/// A copy to make: the partition, its log end at the append, and when the
/// append happened (the copy is done a lag later).
type Copy = (Arc<Partition>, u64, Instant);

struct Follower {
    tx: Mutex<Option<mpsc::UnboundedSender<Copy>>>,
    stuck: AtomicBool,
}

/// The followers of every partition (follower `f` of each partition is
/// served by one task).
pub struct Followers {
    each: Vec<Arc<Follower>>,
}

impl Followers {
    pub fn start(broker: Weak<Broker>, config: &Config) -> Followers {
        let lag = config.replica_lag;
        let each = (0..config.followers)
            .map(|f| {
                let (tx, rx) = mpsc::unbounded_channel();
                let follower = Arc::new(Follower {
                    tx: Mutex::new(Some(tx)),
                    stuck: AtomicBool::new(config.stuck_follower == Some(f)),
                });
                tokio::spawn(copy(f, follower.clone(), rx, broker.clone(), lag));
                follower
            })
            .collect();
        if config.followers > 0 {
            tokio::spawn(expire_isr(broker, config.replica_lag_max));
        }
        Followers { each }
    }

    /// `part` grew to `log_end`: each follower copies it after the lag, and
    /// the high watermark is recomputed at once, as Kafka's leader does after
    /// each append: with no follower in the ISR (none at all, or each left
    /// it) the leader alone is the in-sync set, and the high watermark
    /// follows the log end.
    pub fn appended(&self, broker: &Broker, part: &Arc<Partition>, log_end: u64) {
        let now = Instant::now();
        for f in &self.each {
            if let Some(tx) = &*f.tx.lock().unwrap() {
                let _ = tx.send((part.clone(), log_end, now));
            }
        }
        if let Some(hw) = part.advance_high_watermark() {
            broker.high_watermark_moved(part, hw);
        }
    }

    pub fn set_stuck(&self, broker: &Broker, f: usize, stuck: bool) {
        let Some(follower) = self.each.get(f) else {
            return;
        };
        follower.stuck.store(stuck, Ordering::SeqCst);
        if !stuck {
            // Catch up on everything appended while stuck (a lag from now).
            let now = Instant::now();
            if let Some(tx) = &*follower.tx.lock().unwrap() {
                for part in broker.topics.all_partitions() {
                    let _ = tx.send((part.clone(), part.log_end(), now));
                }
            }
        }
    }

    /// Ends the follower tasks and the ISR check.
    pub fn stop(&self) {
        for f in &self.each {
            f.tx.lock().unwrap().take();
        }
    }

    fn is_stopped(&self) -> bool {
        self.each.iter().all(|f| f.tx.lock().unwrap().is_none())
    }
}

async fn copy(
    f: usize,
    me: Arc<Follower>,
    mut rx: mpsc::UnboundedReceiver<Copy>,
    broker: Weak<Broker>,
    lag: Duration,
) {
    while let Some((part, log_end, appended)) = rx.recv().await {
        // Tokio's timer rounds a deadline up to its next millisecond, so a
        // sleep until a deadline already reached (a lag of 0, or copies
        // queued behind a slow one) would still wait up to a millisecond.
        if Instant::now() < appended + lag {
            tokio::time::sleep_until(appended + lag).await;
        }
        if me.stuck.load(Ordering::SeqCst) {
            continue;
        }
        let Some(broker) = broker.upgrade() else {
            return;
        };
        if let Some(hw) = part.copied(f, log_end, appended) {
            broker.high_watermark_moved(&part, hw);
        }
    }
}

/// Every half of `max_lag`, takes out of each partition's ISR the followers
/// that have not caught up for `max_lag`, and moves the high watermarks that
/// frees (checking the produces parked on them). Ends with the broker.
async fn expire_isr(broker: Weak<Broker>, max_lag: Duration) {
    let mut every = tokio::time::interval((max_lag / 2).max(Duration::from_millis(1)));
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        let Some(broker) = broker.upgrade() else {
            return;
        };
        if broker.followers.is_stopped() {
            return;
        }
        let now = Instant::now();
        for part in broker.topics.all_partitions() {
            if let Some(hw) = part.shrink_isr(now, max_lag) {
                broker.high_watermark_moved(&part, hw);
            }
        }
    }
}
