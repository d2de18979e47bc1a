//! A single-node Kafka-protocol broker, in memory, whose waiting requests live
//! in two purgatories sharing one reaper.
//!
//! - `Produce` with `acks=-1` waits in the produce purgatory until the high
//!   watermark of every partition it wrote covers its records, watching each
//!   partition **at** the offset that covers them (a watermark key).
//! - `Fetch` waits in the fetch purgatory until `min_bytes` are readable below
//!   the high watermark or `max_wait_ms` passes, watching each partition at the
//!   offset after its fetch position (one that can never have `min_bytes`
//!   waits for `max_wait_ms` alone, watching no partition).
//! - Simulated followers (tasks) copy each append after a lag and move the
//!   high watermark; each move calls `try_complete_reached` on both
//!   purgatories, which checks only the requests the new watermark can
//!   satisfy.
//!
//! The broker can also answer fetches the two ways Rust brokers commonly do,
//! for comparison: a sleep-poll loop, and a per-partition `Notify` with
//! `tokio::time::timeout` ([`FetchWait`]).

mod admin;
mod fetch;
pub mod frame;
pub mod groups;
mod log;
pub mod metrics;
mod produce;
mod replication;
pub mod server;
pub mod shape;
pub mod timestamps;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use tokio_purgatory::{Purgatory, Reaper};
use tokio_util::sync::CancellationToken;

pub use self::fetch::DelayedFetch;
pub use self::frame::Budget;
pub use self::log::{Partition, PartitionKey, Topics};
pub use self::produce::DelayedProduce;
use self::replication::Followers;

/// How the broker makes a fetch wait for data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FetchWait {
    /// In the fetch purgatory, on watermark keys (the default).
    Purgatory,
    /// Re-reading the partitions every `interval` until `min_bytes` or
    /// `max_wait_ms` (how some Kafka-compatible brokers answer fetches).
    SleepPoll(Duration),
    /// A `tokio::sync::Notify` per partition, awaited under
    /// `tokio::time::timeout` (armed before each read, so no wake-up is lost).
    Notify,
}

/// The broker's settings.
#[derive(Debug, Clone)]
pub struct Config {
    /// Where to listen (port 0 picks one).
    pub listen: SocketAddr,
    /// The `host:port` given to clients in metadata; the listener's own
    /// address if `None`.
    pub advertise: Option<String>,
    /// Partitions of a topic created on first use.
    pub partitions: i32,
    /// Create a topic when a client asks for its metadata.
    pub auto_create_topics: bool,
    /// Topics created at start.
    pub topics: Vec<String>,
    /// Simulated followers per partition.
    pub followers: usize,
    /// How long after an append a follower has copied it.
    pub replica_lag: Duration,
    /// A follower (0-based) that copies nothing until told otherwise.
    pub stuck_follower: Option<usize>,
    /// A follower that has not caught up for this long leaves the ISR
    /// (Kafka's `replica.lag.time.max.ms`, 30 s).
    pub replica_lag_max: Duration,
    /// The fewest replicas (the leader included) in the ISR for an
    /// `acks=-1` produce to be taken (Kafka's `min.insync.replicas`).
    pub min_insync_replicas: usize,
    /// The longest a produce waits for replication, whatever its own
    /// `timeout_ms` asks (Kafka waits `timeout_ms`; clients often send 30 s).
    pub max_produce_wait: Duration,
    /// How fetches wait.
    pub fetch_wait: FetchWait,
    /// The largest request frame accepted (Kafka's `socket.request.max.bytes`).
    pub max_request_bytes: usize,
    /// The most one request may allocate when decoded (its arrays and tagged
    /// fields; strings and records are slices of the frame). A request over
    /// it closes its connection.
    pub max_decoded_bytes: usize,
    /// The memory all connections' requests in flight share: their frames'
    /// bytes, what decoding them allocates (Kafka's
    /// `queued.max.request.bytes`), and the records of fetch answers until
    /// they are written. When it is spent, connections stop reading until
    /// memory comes back, and fetches answer with what it has room for.
    pub memory_budget: usize,
    /// The longest a frame may take to arrive, from its first byte.
    pub frame_timeout: Duration,
    /// A connection with no request for this long is closed (Kafka's
    /// `connections.max.idle.ms`).
    pub idle_timeout: Duration,
    /// The most connections open at once (Kafka's `max.connections`). When
    /// every one is taken, no connection is accepted until one closes: they
    /// wait in the listen backlog, as Kafka's acceptor waits for a slot.
    /// Each takes a descriptor (two while a request waits with bytes
    /// pipelined behind it): below the process's descriptor limit, accepting
    /// never fails for want of one because of clients. At least 1.
    pub max_connections: usize,
    /// The most topics the broker holds; creation on first use and by
    /// CreateTopics stops there.
    pub max_topics: usize,
    /// The most partitions the broker holds, across topics; creation on
    /// first use and by CreateTopics stops there. Clients create topics, and
    /// choose their partition counts: this bounds the partition state they
    /// can make the broker keep (a few hundred bytes each, with a few dozen
    /// more per follower), and the all-topics Metadata answer (about 250
    /// bytes a partition, charged to the memory budget: 100,000 by default
    /// keeps it near 25 MB of the 256 MiB budget; a million would take
    /// most of it).
    pub max_partitions: usize,
    /// The most bytes one fetch answer carries, whatever the request asks
    /// (Kafka's broker `fetch.max.bytes`), except that the first batch it
    /// finds is sent whole even if larger, as Kafka does, so that a consumer
    /// always makes progress (a batch is at most `max_message_bytes`).
    pub fetch_max_bytes: usize,
    /// The largest record batch a produce may store (Kafka's
    /// `max.message.bytes`, 1048588 by default); a larger one is refused
    /// with `MESSAGE_TOO_LARGE`.
    pub max_message_bytes: usize,
    /// The most the logs of all partitions hold together, each batch counted
    /// with what keeping it costs ([`log::BATCH_COST`]); past it the oldest
    /// replicated batches are dropped, across partitions, and their
    /// partitions' log start offsets move up (Kafka's size-based retention).
    /// Apart from `memory_budget`, which is for requests in flight.
    pub max_log_bytes: usize,
    /// Where to serve the metrics in Prometheus' text format, if anywhere.
    pub metrics_addr: Option<SocketAddr>,
    /// The group coordinator's limits.
    pub groups: groups::GroupLimits,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            listen: "127.0.0.1:9092".parse().unwrap(),
            advertise: None,
            partitions: 4,
            auto_create_topics: true,
            topics: Vec::new(),
            followers: 2,
            replica_lag: Duration::from_millis(2),
            stuck_follower: None,
            replica_lag_max: Duration::from_secs(30),
            min_insync_replicas: 1,
            max_produce_wait: Duration::from_secs(30),
            fetch_wait: FetchWait::Purgatory,
            max_request_bytes: 100 << 20,
            max_decoded_bytes: 16 << 20,
            memory_budget: 256 << 20,
            frame_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(600),
            max_connections: 1000,
            max_topics: 10_000,
            max_partitions: 100_000,
            fetch_max_bytes: 55 << 20,
            max_message_bytes: 1_048_588,
            max_log_bytes: 1 << 30,
            metrics_addr: None,
            groups: groups::GroupLimits::default(),
        }
    }
}

/// The most partitions a topic may have (`--partitions`).
pub const MAX_PARTITIONS: i32 = 10_000;
/// A watch key no partition has (a partition's is its topic's number and
/// its index, below 2^31): fetches that can never have enough bytes watch it
/// alone, and only shutdown completes what watches it.
pub const CLOSING_KEY: PartitionKey = u64::MAX;

/// The most connections `--max-connections` may allow (a semaphore's
/// permits).
pub const MAX_CONNECTIONS: usize = 1 << 24;
/// The most simulated followers (`--followers`): each is a task, and each
/// partition keeps a copy position and an ISR place for each.
pub const MAX_FOLLOWERS: usize = 16;

impl Config {
    /// Refuses settings the broker cannot serve, naming the option: sizes
    /// that would make it allocate without a bound, and options that would
    /// be ignored or give clients what they cannot use. Returns the
    /// advertised host and port.
    pub fn check(&self, listening: SocketAddr) -> Result<(String, i32), String> {
        if !(1..=MAX_PARTITIONS).contains(&self.partitions) {
            return Err(format!(
                "--partitions {}: a topic has 1 to {MAX_PARTITIONS} partitions",
                self.partitions
            ));
        }
        if self.followers > MAX_FOLLOWERS {
            return Err(format!(
                "--followers {}: at most {MAX_FOLLOWERS}",
                self.followers
            ));
        }
        if let Some(f) = self.stuck_follower {
            if f >= self.followers {
                return Err(format!(
                    "--stuck-follower {f}: followers are numbered 0 to {} (--followers {})",
                    self.followers as i64 - 1,
                    self.followers
                ));
            }
        }
        if self.topics.len().saturating_mul(self.partitions as usize) > self.max_partitions {
            return Err(format!(
                "--topics names {} topics of --partitions {}: more than --max-partitions {}",
                self.topics.len(),
                self.partitions,
                self.max_partitions
            ));
        }
        if self.topics.len() > self.max_topics {
            return Err(format!(
                "--topics names {} topics, more than --max-topics {}",
                self.topics.len(),
                self.max_topics
            ));
        }
        if let Some(bad) = self.topics.iter().find(|t| !log::valid_topic_name(t)) {
            return Err(format!(
                "--topics {bad:?}: a topic name is 1 to 249 ASCII letters, digits, '.', '_' or '-' (not \".\" or \"..\")"
            ));
        }
        if let Some(internal) = self.topics.iter().find(|t| log::internal_topic(t)) {
            return Err(format!(
                "--topics {internal:?}: one of Kafka's internal topics, which this broker does not serve"
            ));
        }
        if !(1..=MAX_CONNECTIONS).contains(&self.max_connections) {
            return Err(format!(
                "--max-connections {}: 1 to {MAX_CONNECTIONS}",
                self.max_connections
            ));
        }
        if self.groups.min_session > self.groups.max_session {
            return Err(format!(
                "--group-min-session-ms {}: above the longest session accepted ({} ms)",
                self.groups.min_session.as_millis(),
                self.groups.max_session.as_millis()
            ));
        }
        match &self.advertise {
            None => Ok((listening.ip().to_string(), i32::from(listening.port()))),
            Some(a) => {
                let bad = || format!("--advertise {a:?}: host:port, the port 1 to 65535");
                let (host, port) = a.rsplit_once(':').ok_or_else(bad)?;
                let port = port
                    .parse::<u16>()
                    .ok()
                    .filter(|&p| p > 0)
                    .ok_or_else(bad)?;
                if host.is_empty() {
                    return Err(bad());
                }
                Ok((host.to_string(), i32::from(port)))
            }
        }
    }
}

/// Counts of what the broker did, for the demonstration and benchmark.
#[derive(Debug, Default)]
pub struct Stats {
    pub requests: AtomicU64,
    pub produces_timed_out: AtomicU64,
    pub fetches_parked: AtomicU64,
    pub connections_dropped_while_waiting: AtomicU64,
    /// Connections closed for a refused frame, a slow frame, or idleness.
    pub connections_refused: AtomicU64,
    /// Partitions of produce requests refused for a corrupt, invalid or
    /// oversized batch.
    pub batches_refused: AtomicU64,
}

/// The broker stopped under a waiting request (its purgatory was shut down
/// or its reaper is gone): the connection is closed without an answer.
#[derive(Debug)]
pub struct Gone;

/// The broker's shared state.
pub struct Broker {
    pub config: Config,
    pub topics: Topics,
    pub produces: Purgatory<PartitionKey, DelayedProduce>,
    pub fetches: Purgatory<PartitionKey, DelayedFetch>,
    /// Consumer groups: joins and syncs in purgatories, sessions in a timer.
    pub groups: Arc<groups::Coordinator>,
    pub stats: Stats,
    /// The memory requests in flight share.
    pub budget: Budget,
    /// A place per open connection, `max_connections` of them (the accept
    /// loop holds one while it waits for a connection).
    pub connections: Arc<Semaphore>,
    /// Connections open now.
    pub open: std::sync::atomic::AtomicUsize,
    /// Set at shutdown: every waiting request's check answers at once.
    closing: Arc<AtomicBool>,
    followers: Followers,
    advertised: (String, i32),
}

impl Broker {
    /// The partition's high watermark moved to `hw`: checks the produces and
    /// fetches that watch it at or below `hw`, and wakes the comparison
    /// strategies' waiters.
    pub fn high_watermark_moved(&self, part: &Partition, hw: u64) {
        self.produces.try_complete_reached(&part.key, hw);
        self.fetches.try_complete_reached(&part.key, hw);
        part.notify.notify_waiters();
    }

    /// Connections open now (each holds one of `max_connections` places).
    pub fn open_connections(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }

    /// Makes follower `f` stop copying (`true`) or copy again and catch up.
    pub fn set_stuck(&self, f: usize, stuck: bool) {
        self.followers.set_stuck(self, f, stuck);
    }
}

/// A running broker: its address, its state, and its shutdown.
pub struct BrokerHandle {
    pub addr: SocketAddr,
    /// Where the metrics are served, if they are.
    pub metrics_addr: Option<SocketAddr>,
    pub broker: Arc<Broker>,
    stop: CancellationToken,
    server: JoinHandle<()>,
    _reaper: Reaper,
}

impl BrokerHandle {
    /// Starts a broker on the current runtime.
    pub async fn start(config: Config) -> std::io::Result<BrokerHandle> {
        // A request must fit in the budget with what decoding it takes, or
        // its connection would wait on memory only its own release frees.
        if config.memory_budget
            < config
                .max_request_bytes
                .saturating_add(config.max_decoded_bytes)
        {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "--memory-budget (memory_budget) must be at least --max-request-bytes + --max-decoded-bytes",
            ));
        }
        // The logs must have room for the largest batch.
        if config.max_log_bytes < config.max_message_bytes.saturating_add(log::BATCH_COST) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "--max-log-bytes (max_log_bytes) must be at least --max-message-bytes + {}",
                    log::BATCH_COST
                ),
            ));
        }
        // Checked before binding, with the address asked for (its port may
        // be 0); the advertised address is taken again once bound.
        config
            .check(config.listen)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        let listener = TcpListener::bind(config.listen).await?;
        let addr = listener.local_addr()?;
        let advertised = config
            .check(addr)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        let reaper = Reaper::start().map_err(std::io::Error::other)?;
        let produces = Purgatory::builder()
            .name("produce")
            .reaper(&reaper)
            .build()
            .map_err(std::io::Error::other)?;
        let fetches = Purgatory::builder()
            .name("fetch")
            .reaper(&reaper)
            .build()
            .map_err(std::io::Error::other)?;
        let closing = Arc::new(AtomicBool::new(false));
        let coordinator = groups::Coordinator::new(
            Purgatory::builder()
                .name("join")
                .reaper(&reaper)
                .build()
                .map_err(std::io::Error::other)?,
            Purgatory::builder()
                .name("sync")
                .reaper(&reaper)
                .build()
                .map_err(std::io::Error::other)?,
            tokio_purgatory::Timer::builder()
                .name("sessions")
                .reaper(&reaper)
                .build()
                .map_err(std::io::Error::other)?,
            closing.clone(),
            config.groups.clone(),
        );
        let topics = Topics::new(
            config.partitions,
            config.followers,
            config.auto_create_topics,
            config.max_topics,
            config.max_partitions,
            config.max_log_bytes,
        );
        for t in &config.topics {
            topics.create(t, config.partitions);
        }
        let broker = Arc::new_cyclic(|weak| Broker {
            followers: Followers::start(weak.clone(), &config),
            budget: Budget::new(config.memory_budget),
            connections: Arc::new(Semaphore::new(config.max_connections)),
            open: std::sync::atomic::AtomicUsize::new(0),
            config,
            topics,
            produces,
            fetches,
            groups: coordinator,
            stats: Stats::default(),
            closing,
            advertised,
        });
        let stop = CancellationToken::new();
        let metrics_addr = match broker.config.metrics_addr {
            Some(at) => {
                let l = TcpListener::bind(at).await?;
                let bound = l.local_addr()?;
                tokio::spawn(metrics::serve(l, broker.clone(), stop.clone()));
                Some(bound)
            }
            None => None,
        };
        let server = tokio::spawn(server::accept(listener, broker.clone(), stop.clone()));
        Ok(BrokerHandle {
            addr,
            metrics_addr,
            broker,
            stop,
            server,
            _reaper: reaper,
        })
    }

    /// Stops the broker: no new connections; every waiting request is
    /// answered now with what it has (a fetch with the data readable, a
    /// produce with `NOT_ENOUGH_REPLICAS_AFTER_APPEND` for partitions not yet
    /// replicated); connections close once their answer is written. Returns
    /// when the listener and every connection are gone.
    pub async fn shutdown(self) {
        let broker = &self.broker;
        broker.closing.store(true, Ordering::SeqCst);
        // Each waiting request's check now answers at once: ask every one.
        // A request registering meanwhile sees `closing` in its own check.
        for part in broker.topics.all_partitions() {
            broker.produces.try_complete_reached(&part.key, u64::MAX);
            broker.fetches.try_complete_reached(&part.key, u64::MAX);
            part.notify.notify_waiters();
        }
        // And the fetches that watch no partition.
        broker.fetches.try_complete_reached(&CLOSING_KEY, u64::MAX);
        // Waiting joins and syncs answer NOT_COORDINATOR.
        broker.groups.wake_all();
        self.stop.cancel();
        let _ = self.server.await;
        // Anything still registered would be a request that slipped past both:
        // none can, and the counts say so.
        debug_assert_eq!(broker.produces.delayed() + broker.fetches.delayed(), 0);
        debug_assert_eq!(
            broker.groups.joins.delayed() + broker.groups.syncs.delayed(),
            0
        );
        drop(broker.produces.shutdown());
        drop(broker.fetches.shutdown());
        drop(broker.groups.joins.shutdown());
        drop(broker.groups.syncs.shutdown());
        drop(broker.groups.sessions.shutdown());
        broker.followers.stop();
    }
}
