//! Simulated followers: each copies every append a fixed lag after it
//! happened, and moves the partition's high watermark when it was the last
//! one behind.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};

use tokio::sync::mpsc;
use tokio::time::Instant;

use super::{Broker, Config, Partition};

/// A copy to make: the partition, its log end at the append, and when the
/// copy is done.
type Copy = (Arc<Partition>, u64, Instant);

struct Follower {
    tx: Mutex<Option<mpsc::UnboundedSender<Copy>>>,
    stuck: AtomicBool,
}

/// The followers of every partition (follower `f` of each partition is
/// served by one task).
pub struct Followers {
    each: Vec<Arc<Follower>>,
    lag: std::time::Duration,
}

impl Followers {
    pub fn start(broker: Weak<Broker>, config: &Config) -> Followers {
        let each = (0..config.followers)
            .map(|f| {
                let (tx, rx) = mpsc::unbounded_channel();
                let follower = Arc::new(Follower {
                    tx: Mutex::new(Some(tx)),
                    stuck: AtomicBool::new(config.stuck_follower == Some(f)),
                });
                tokio::spawn(copy(f, follower.clone(), rx, broker.clone()));
                follower
            })
            .collect();
        Followers {
            each,
            lag: config.replica_lag,
        }
    }

    /// `part` grew to `log_end`: each follower copies it after the lag. With
    /// no followers the leader alone is the in-sync set.
    pub fn appended(&self, broker: &Broker, part: &Arc<Partition>, log_end: u64) {
        if self.each.is_empty() {
            if let Some(hw) = part.advance_high_watermark() {
                broker.high_watermark_moved(part, hw);
            }
            return;
        }
        let due = Instant::now() + self.lag;
        for f in &self.each {
            if let Some(tx) = &*f.tx.lock().unwrap() {
                let _ = tx.send((part.clone(), log_end, due));
            }
        }
    }

    pub fn set_stuck(&self, broker: &Broker, f: usize, stuck: bool) {
        let Some(follower) = self.each.get(f) else {
            return;
        };
        follower.stuck.store(stuck, Ordering::SeqCst);
        if !stuck {
            // Catch up on everything appended while stuck.
            let now = Instant::now();
            if let Some(tx) = &*follower.tx.lock().unwrap() {
                for part in broker.topics.all_partitions() {
                    let _ = tx.send((part.clone(), part.log_end(), now));
                }
            }
        }
    }

    /// Ends the follower tasks.
    pub fn stop(&self) {
        for f in &self.each {
            f.tx.lock().unwrap().take();
        }
    }
}

async fn copy(
    f: usize,
    me: Arc<Follower>,
    mut rx: mpsc::UnboundedReceiver<Copy>,
    broker: Weak<Broker>,
) {
    while let Some((part, log_end, due)) = rx.recv().await {
        tokio::time::sleep_until(due).await;
        if me.stuck.load(Ordering::SeqCst) {
            continue;
        }
        let Some(broker) = broker.upgrade() else {
            return;
        };
        if let Some(hw) = part.copied(f, log_end) {
            broker.high_watermark_moved(&part, hw);
        }
    }
}
