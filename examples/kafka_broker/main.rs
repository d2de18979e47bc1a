//! A single-node Kafka-protocol broker on two purgatories, driven by a real
//! Kafka client library.
//!
//! ```sh
//! # The demonstration: starts the broker on an ephemeral port, drives it with
//! # rskafka, prints what happened, exits.
//! cargo run --release --example kafka_broker
//! # A broker for any Kafka client (kcat, librdkafka, kafkajs, ...) to talk to:
//! cargo run --release --example kafka_broker -- serve --listen 127.0.0.1:9092
//! # Parked fetches woken by produces: this broker against the same broker
//! # answering fetches by sleep-polling and by Notify + timeout.
//! cargo run --release --example kafka_broker -- bench
//! ```
//!
//! `Produce` with `acks=-1` waits in a purgatory until simulated followers
//! have copied its records (the high watermark covers them); `Fetch` waits
//! until `min_bytes` are readable or `max_wait_ms` passes. Both watch their
//! partitions at an offset (watermark keys), so a high watermark move checks
//! only the requests it can satisfy.

mod bench;
mod broker;
mod demo;
mod wire;

use std::net::SocketAddr;
use std::time::Duration;

use clap::{Parser, Subcommand};

use broker::{BrokerHandle, Config, FetchWait};

#[derive(Parser)]
#[command(about = "A Kafka-protocol broker whose waiting requests live in purgatories")]
struct Args {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Starts the broker, drives it with a Kafka client, prints what happened
    /// (the default).
    Demo,
    /// Runs the broker until Ctrl-C or SIGTERM.
    Serve(Box<ServeArgs>),
    /// Compares fetch waiting strategies under parked consumers.
    Bench(bench::BenchArgs),
}

#[derive(Parser, Debug, Clone)]
// A negative number is a value (refused by name), not an unknown flag.
#[command(allow_negative_numbers = true)]
pub struct ServeArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:9092")]
    listen: SocketAddr,
    /// `host:port` given to clients in metadata (default: the listen address);
    /// the port 1 to 65535.
    #[arg(long)]
    advertise: Option<String>,
    /// Partitions per topic created on first use or by `--topics`: 1 to
    /// 10000.
    #[arg(long, default_value_t = 4)]
    partitions: i32,
    /// Topics to create at start (comma-separated; names Kafka accepts, no
    /// more than `--max-topics` and `--max-partitions` allow).
    #[arg(long, value_delimiter = ',')]
    topics: Vec<String>,
    /// Do not create topics when clients ask for their metadata.
    #[arg(long)]
    no_auto_create: bool,
    /// Simulated followers per partition: 0 to 16.
    #[arg(long, default_value_t = 2)]
    followers: usize,
    /// Replication lag of each follower, in ms.
    #[arg(long, default_value_t = 2)]
    replica_lag_ms: u64,
    /// A follower (0-based, below `--followers`) that copies nothing:
    /// `acks=-1` produces time out.
    #[arg(long)]
    stuck_follower: Option<usize>,
    /// A follower that has not caught up for this long, in ms, leaves the ISR.
    #[arg(long, default_value_t = 30_000)]
    replica_lag_max_ms: u64,
    /// The fewest in-sync replicas (leader included) an acks=-1 produce needs.
    #[arg(long, default_value_t = 1)]
    min_insync_replicas: usize,
    /// The longest a produce waits for replication, in ms (Kafka waits the
    /// request's `timeout_ms`; this caps it).
    #[arg(long, default_value_t = 30_000)]
    max_produce_wait_ms: u64,
    /// How fetches wait: purgatory, poll, notify.
    #[arg(long, default_value = "purgatory")]
    fetch_wait: String,
    /// The sleep-poll interval, in ms, for `--fetch-wait poll`.
    #[arg(long, default_value_t = 10)]
    poll_ms: u64,
    /// The largest request frame accepted, in bytes.
    #[arg(long, default_value_t = 100 << 20)]
    max_request_bytes: usize,
    /// The most one request may allocate when decoded, in bytes.
    #[arg(long, default_value_t = 16 << 20)]
    max_decoded_bytes: usize,
    /// The memory all requests in flight share, in bytes.
    #[arg(long, default_value_t = 256 << 20)]
    memory_budget: usize,
    /// The longest a request frame may take to arrive, in ms.
    #[arg(long, default_value_t = 30_000)]
    frame_timeout_ms: u64,
    /// Idle connections are closed after this long, in ms.
    #[arg(long, default_value_t = 600_000)]
    idle_ms: u64,
    /// The most connections open at once: when every one is taken, no
    /// connection is accepted until one closes (Kafka's `max.connections`).
    #[arg(long, default_value_t = 1000)]
    max_connections: usize,
    /// The most topics the broker creates.
    #[arg(long, default_value_t = 10_000)]
    max_topics: usize,
    /// The most partitions the broker holds, across topics, whether clients
    /// create them on first use or by CreateTopics (each takes a few hundred
    /// bytes, and an all-topics Metadata answer about 250 bytes for each: at
    /// 100,000, about 25 MB of the default memory budget).
    #[arg(long, default_value_t = 100_000)]
    max_partitions: usize,
    /// The most bytes one fetch answer carries (its first batch is sent whole
    /// even if larger, as Kafka does).
    #[arg(long, default_value_t = 55 << 20)]
    fetch_max_bytes: usize,
    /// The largest record batch a produce may store (Kafka's
    /// `max.message.bytes`); larger ones get MESSAGE_TOO_LARGE.
    #[arg(long, default_value_t = 1_048_588)]
    max_message_bytes: usize,
    /// The most bytes the logs of all partitions hold together; past it the
    /// oldest replicated batches are dropped and log start offsets move up.
    #[arg(long, default_value_t = 1 << 30)]
    max_log_bytes: usize,
    /// The shortest session timeout a group member may ask for, in ms
    /// (Kafka's `group.min.session.timeout.ms`), at most the longest
    /// (1800000, Kafka's `group.max.session.timeout.ms`).
    #[arg(long, default_value_t = 6_000)]
    group_min_session_ms: u64,
    /// Serve the metrics in Prometheus' text format on this address
    /// (`curl http://ADDR/metrics`).
    #[arg(long)]
    metrics_addr: Option<SocketAddr>,
}

impl ServeArgs {
    pub fn config(&self) -> Result<Config, String> {
        let fetch_wait = match self.fetch_wait.as_str() {
            "purgatory" => FetchWait::Purgatory,
            "poll" => FetchWait::SleepPoll(Duration::from_millis(self.poll_ms.max(1))),
            "notify" => FetchWait::Notify,
            other => return Err(format!("unknown --fetch-wait {other}")),
        };
        Ok(Config {
            listen: self.listen,
            advertise: self.advertise.clone(),
            // Checked by the broker as it starts (`Config::check`), which
            // names the option it refuses.
            partitions: self.partitions,
            auto_create_topics: !self.no_auto_create,
            topics: self.topics.clone(),
            followers: self.followers,
            replica_lag: Duration::from_millis(self.replica_lag_ms),
            stuck_follower: self.stuck_follower,
            replica_lag_max: Duration::from_millis(self.replica_lag_max_ms),
            min_insync_replicas: self.min_insync_replicas,
            max_produce_wait: Duration::from_millis(self.max_produce_wait_ms),
            fetch_wait,
            max_request_bytes: self.max_request_bytes,
            max_decoded_bytes: self.max_decoded_bytes,
            memory_budget: self.memory_budget,
            frame_timeout: Duration::from_millis(self.frame_timeout_ms),
            idle_timeout: Duration::from_millis(self.idle_ms),
            max_connections: self.max_connections,
            max_topics: self.max_topics,
            max_partitions: self.max_partitions,
            fetch_max_bytes: self.fetch_max_bytes,
            max_message_bytes: self.max_message_bytes,
            max_log_bytes: self.max_log_bytes,
            metrics_addr: self.metrics_addr,
            groups: broker::groups::GroupLimits {
                min_session: Duration::from_millis(self.group_min_session_ms),
                ..Default::default()
            },
        })
    }
}

fn main() {
    let args = Args::parse();
    let runtime = tokio::runtime::Runtime::new().expect("a Tokio runtime");
    let code = runtime.block_on(async {
        match args.command.unwrap_or(Command::Demo) {
            Command::Demo => demo::run().await,
            Command::Serve(s) => serve(*s).await,
            Command::Bench(b) => bench::run(b).await,
        }
    });
    std::process::exit(code);
}

async fn serve(args: ServeArgs) -> i32 {
    install_log();
    let config = match args.config() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{e}");
            return 2;
        }
    };
    let handle = match BrokerHandle::start(config).await {
        Ok(h) => h,
        Err(e) => {
            eprintln!("cannot start: {e}");
            return 1;
        }
    };
    // Listened for before the broker says it is up.
    let stop = stop_signal();
    // The first line says where it listens (the benchmark reads it).
    println!("listening on {}", handle.addr);
    if let Some(at) = handle.metrics_addr {
        println!("metrics on http://{at}/metrics");
    }
    stop.await;
    handle.shutdown().await;
    0
}

/// The broker's log lines (a connection closed for a refused frame, ISR
/// changes, expired sessions) on stderr, so that stdout keeps only what the
/// benchmark and scripts read: INFO and above by default, or what `RUST_LOG`
/// says (`RUST_LOG=debug`, `RUST_LOG=kafka_broker=debug`). Only `serve`
/// installs it: the demonstration's output stays its own.
fn install_log() {
    use std::io::IsTerminal;
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colours for a terminal only, not in a log file.
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
}

/// Ctrl-C (SIGINT) or SIGTERM, what `kill`, systemd and container runtimes
/// send: either stops the broker gracefully, answering what waits. On Unix
/// both are listened for from the call on, not from the first poll.
#[cfg(unix)]
fn stop_signal() -> impl std::future::Future<Output = ()> {
    use tokio::signal::unix::{signal, SignalKind};
    let int = signal(SignalKind::interrupt());
    let term = signal(SignalKind::terminate());
    async move {
        match (int, term) {
            (Ok(mut int), Ok(mut term)) => {
                tokio::select! {
                    _ = int.recv() => {}
                    _ = term.recv() => {}
                }
            }
            _ => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
}

#[cfg(not(unix))]
fn stop_signal() -> impl std::future::Future<Output = ()> {
    async {
        let _ = tokio::signal::ctrl_c().await;
    }
}
