//! The broker example's command-line options, run as the real binary
//! (`target/debug/examples/kafka_broker serve ...`, built once by the first
//! test): a value the broker cannot serve is refused with a message naming
//! the option and a non-zero exit, never an abort (a signal) at start or on a
//! client's first request, and never taken silently; extreme values it can
//! serve, it serves.
//!
//! Every child runs under `ulimit -v` (4 GB of address space), so an
//! allocation sized by an option fails fast instead of taking the machine's
//! memory, and under a wall-clock bound; each is killed by its own pid.
//! Real sockets: a broker that starts is asked something, each call bounded.

#[path = "../examples/kafka_broker/wire.rs"]
#[allow(dead_code)]
mod wire;

use std::io::{BufRead, BufReader, Read};
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kafka_protocol::messages::metadata_request::MetadataRequestTopic;
use kafka_protocol::messages::*;
use kafka_protocol::protocol::StrBytes;
use wire::Wire;

/// The example binary, built once (quick when up to date).
fn binary() -> String {
    static BUILT: std::sync::Once = std::sync::Once::new();
    let root = env!("CARGO_MANIFEST_DIR");
    BUILT.call_once(|| {
        let ok = Command::new(env!("CARGO"))
            .args(["build", "--all-features", "--example", "kafka_broker"])
            .current_dir(root)
            .status()
            .expect("cargo runs");
        assert!(ok.success(), "the example builds");
    });
    // Where that build put it: CARGO_TARGET_DIR if set (relative to the
    // package), else the package's target directory.
    let target = match std::env::var("CARGO_TARGET_DIR") {
        Ok(d) if std::path::Path::new(&d).is_absolute() => d,
        Ok(d) => format!("{root}/{d}"),
        Err(_) => format!("{root}/target"),
    };
    format!("{target}/debug/examples/kafka_broker")
}

/// A broker child: its first stdout line (if any), the lines after it, and
/// stderr collected.
struct Broker {
    child: Child,
    /// "listening on ADDR" once printed.
    listening: Option<std::net::SocketAddr>,
    /// The stdout lines after the first.
    stdout: mpsc::Receiver<String>,
    stderr: mpsc::Receiver<String>,
}

impl Broker {
    /// `serve --listen 127.0.0.1:0 <args>` under a 4 GB address-space limit;
    /// waits up to `secs` for the "listening on" line or an exit.
    fn start(args: &[&str], secs: u64) -> Broker {
        Broker::start_with(args, secs, None)
    }

    /// `start`, with `RUST_LOG` set to `rust_log` (unset when `None`).
    fn start_with(args: &[&str], secs: u64, rust_log: Option<&str>) -> Broker {
        let quoted: Vec<String> = args
            .iter()
            .map(|a| format!("'{}'", a.replace('\'', "'\\''")))
            .collect();
        let script = format!(
            "ulimit -v 4000000; exec '{}' serve --listen 127.0.0.1:0 {}",
            binary(),
            quoted.join(" ")
        );
        let mut command = Command::new("sh");
        command.env_remove("RUST_LOG");
        if let Some(filter) = rust_log {
            command.env("RUST_LOG", filter);
        }
        let mut child = command
            .args(["-c", &script])
            .env("RUST_BACKTRACE", "0")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawns");
        let stdout = child.stdout.take().unwrap();
        let mut stderr_pipe = child.stderr.take().unwrap();
        let (etx, erx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = stderr_pipe.read_to_string(&mut s);
            let _ = etx.send(s);
        });
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(l);
            }
        });
        let listening = rx
            .recv_timeout(Duration::from_secs(secs))
            .ok()
            .and_then(|l| l.strip_prefix("listening on ").map(|a| a.parse().unwrap()));
        Broker {
            child,
            listening,
            stdout: rx,
            stderr: erx,
        }
    }

    /// Where the metrics are served, from the "metrics on
    /// http://ADDR/metrics" line (`--metrics-addr` given), within 5 s.
    fn metrics_addr(&self) -> std::net::SocketAddr {
        let line = self
            .stdout
            .recv_timeout(Duration::from_secs(5))
            .expect("a line saying where the metrics are served");
        line.strip_prefix("metrics on http://")
            .and_then(|l| l.strip_suffix("/metrics"))
            .unwrap_or_else(|| panic!("not where the metrics are: {line:?}"))
            .parse()
            .unwrap()
    }

    /// Waits up to `secs` for the child to exit on its own.
    fn exited(&mut self, secs: u64) -> Option<ExitStatus> {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return Some(s);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Kills the child (by its own pid) and returns what it wrote on stderr.
    fn stop(mut self) -> String {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.stderr
            .recv_timeout(Duration::from_secs(5))
            .unwrap_or_default()
    }
}

fn describe(s: &ExitStatus) -> String {
    match (s.code(), s.signal()) {
        (Some(c), _) => format!("exit code {c}"),
        (_, Some(sig)) => format!("killed by signal {sig}"),
        _ => "?".into(),
    }
}

/// The option is refused: the process exits by itself, with a non-zero code
/// (not a signal), and says why on stderr, naming an option it was given (no
/// allocation failure, no panic).
fn assert_refused(args: &[&str]) {
    let mut b = Broker::start(args, 20);
    let status = b.exited(if b.listening.is_some() { 2 } else { 20 });
    let listening = b.listening;
    let err = b.stop();
    let status = status.unwrap_or_else(|| {
        panic!("{args:?}: accepted (listening on {listening:?}); a clear error and a non-zero exit expected")
    });
    assert!(
        status.code().is_some_and(|c| c != 0),
        "{args:?}: {} (stderr: {err:?})",
        describe(&status)
    );
    assert!(
        !err.contains("panicked") && !err.contains("memory allocation"),
        "{args:?}: stderr {err:?}"
    );
    assert!(
        args.iter().any(|a| a.starts_with("--") && err.contains(a)),
        "{args:?}: the message names none of the options: {err:?}"
    );
}

/// A bystander's ApiVersions is answered within 5 s.
async fn answers(addr: std::net::SocketAddr) -> bool {
    tokio::time::timeout(Duration::from_secs(5), async {
        let mut w = Wire::connect(addr).await.ok()?;
        w.call(&ApiVersionsRequest::default(), 2).await.ok()
    })
    .await
    .ok()
    .flatten()
    .is_some_and(|r| r.error_code == 0)
}

/// The value of `key` (a metric and its labels) on the metrics page served
/// at `at`, if the page answers and has it.
async fn metric(at: std::net::SocketAddr, key: &str) -> Option<f64> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut http = tokio::net::TcpStream::connect(at).await.ok()?;
    http.write_all(b"GET /metrics HTTP/1.1\r\nHost: t\r\n\r\n")
        .await
        .ok()?;
    let mut page = String::new();
    http.read_to_string(&mut page).await.ok()?;
    let (_, body) = page.split_once("\r\n\r\n")?;
    body.lines()
        .filter_map(|l| l.rsplit_once(' '))
        .find(|(k, _)| *k == key)
        .and_then(|(_, v)| v.parse().ok())
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

// ---------------------------------------------------------------------------

/// `--partitions 2147483647` with a topic to create at start: the broker
/// built 2^31 partitions and aborted on the allocation failure (17 GB). A
/// topic has at most 10,000 partitions.
#[test]
fn huge_partitions_with_a_topic_at_start() {
    assert_refused(&["--topics", "a", "--partitions", "2147483647"]);
}

/// `--partitions 2147483647` without `--topics`: the broker started, and a
/// client's Metadata asking for a new topic (auto-creation on, as by default)
/// aborted it. Either refusing the option at start (as now) or refusing the
/// creation would do: the process must not go down, a bystander still gets
/// answers.
#[test]
fn huge_partitions_then_a_clients_metadata() {
    let mut b = Broker::start(&["--partitions", "2147483647"], 20);
    let Some(addr) = b.listening else {
        // Refused at start: that is fine, if cleanly.
        let status = b.exited(10).expect("exits if it did not listen");
        let err = b.stop();
        assert!(
            status.code().is_some_and(|c| c != 0) && !err.contains("memory allocation"),
            "{} {err:?}",
            describe(&status)
        );
        return;
    };
    let served = rt().block_on(async {
        let mut w = Wire::connect(addr).await.unwrap();
        let req = MetadataRequest::default()
            .with_topics(Some(vec![MetadataRequestTopic::default()
                .with_name(Some(TopicName(StrBytes::from_static_str("x"))))]))
            .with_allow_auto_topic_creation(true);
        let _ = tokio::time::timeout(Duration::from_secs(10), w.call(&req, 9)).await;
        answers(addr).await
    });
    let status = b.exited(1);
    let err = b.stop();
    assert!(
        served && status.is_none(),
        "after one Metadata for a new topic: bystander answered {served}, process {} (stderr tail {:?})",
        status.map_or("alive".into(), |s| describe(&s)),
        err.lines().take(2).collect::<Vec<_>>()
    );
}

/// A topic has 1 to 10,000 partitions; the topics `--topics` names fit in
/// `--max-partitions`.
#[test]
fn partitions_out_of_range() {
    assert_refused(&["--partitions", "0"]);
    assert_refused(&["--partitions", "-5"]);
    assert_refused(&["--partitions", "10001"]);
    assert_refused(&[
        "--partitions",
        "10000",
        "--topics",
        "a,b",
        "--max-partitions",
        "19999",
    ]);
}

/// `--followers 100000000000`: a follower task each, and a copy position per
/// follower in every partition; the broker aborted allocating them. At most
/// 16.
#[test]
fn huge_followers() {
    assert_refused(&["--followers", "100000000000"]);
}

/// An advertised port outside 1..=65535 (or negative) was given to every
/// client in Metadata and FindCoordinator: nobody can connect to it.
#[test]
fn advertised_port_out_of_range() {
    assert_refused(&["--advertise", "localhost:99999"]);
    assert_refused(&["--advertise", "localhost:-5"]);
    assert_refused(&["--advertise", "localhost:0"]);
    assert_refused(&["--advertise", ":9092"]);
}

/// `--group-min-session-ms` above the coordinator's most (30 min): every
/// JoinGroup would have been refused INVALID_SESSION_TIMEOUT.
#[test]
fn min_session_above_the_max_session() {
    assert_refused(&["--group-min-session-ms", "3600000"]);
    assert_refused(&["--group-min-session-ms", &u64::MAX.to_string()]);
}

/// `--stuck-follower 7` with 2 followers names no follower: it was silently
/// ignored.
#[test]
fn stuck_follower_that_does_not_exist() {
    assert_refused(&["--followers", "2", "--stuck-follower", "7"]);
}

/// `--topics` names Kafka would refuse (`Topic.validate`): the broker created
/// them at start, though no client could create one; and more of them than
/// `--max-topics` were silently left out.
#[test]
fn invalid_topic_names_at_start() {
    assert_refused(&["--topics", "bad name!"]);
    assert_refused(&["--topics", "a,,b"]);
    assert_refused(&["--topics", "a,b,c", "--max-topics", "2"]);
}

/// A connection limit of 0 would accept nothing: refused, naming the option.
#[test]
fn no_connections_allowed() {
    assert_refused(&["--max-connections", "0"]);
}

/// Values the broker has long refused cleanly.
#[test]
fn clean_refusals() {
    assert_refused(&["--fetch-wait", "bogus"]);
    assert_refused(&["--memory-budget", "1"]);
    assert_refused(&["--max-log-bytes", "0"]);
    assert_refused(&["--advertise", "no-colon"]);
    assert_refused(&["--partitions", "99999999999"]); // over i32: clap
    assert_refused(&["--memory-budget", "-1"]);
}

/// Extreme times it can serve, zero and u64::MAX ms (and the longest
/// minimum session it takes, the maximum's 30 min): the broker starts and
/// serves a produce (acks=1), a fetch and a bystander's ApiVersions. Every
/// case here must serve: those it refuses (a minimum session over the
/// maximum, a partition count out of range) are refused in the tests above.
#[test]
fn extreme_times_still_serve() {
    let max = u64::MAX.to_string();
    for args in [
        vec![
            "--frame-timeout-ms",
            max.as_str(),
            "--idle-ms",
            max.as_str(),
        ],
        vec![
            "--replica-lag-ms",
            max.as_str(),
            "--replica-lag-max-ms",
            max.as_str(),
        ],
        vec![
            "--max-produce-wait-ms",
            max.as_str(),
            "--replica-lag-max-ms",
            "0",
        ],
        vec!["--fetch-wait", "poll", "--poll-ms", max.as_str()],
        vec!["--fetch-wait", "poll", "--poll-ms", "0"],
        vec!["--group-min-session-ms", "1800000"],
        vec!["--group-min-session-ms", "0"],
    ] {
        let mut args = args;
        args.extend(["--topics", "t"]);
        let mut b = Broker::start(&args, 20);
        let Some(addr) = b.listening else {
            let st = b.exited(5);
            let err = b.stop();
            panic!(
                "{args:?}: not served (process {:?}, stderr {err:?})",
                st.map(|s| describe(&s))
            );
        };
        let ok = rt().block_on(async {
            let mut w = Wire::connect(addr).await.unwrap();
            let p = tokio::time::timeout(Duration::from_secs(5), w.append("t", 0, &[b"v"])).await;
            let produced = matches!(&p, Ok(Ok(r)) if r.responses.first().is_some_and(|t| t.partition_responses[0].error_code == 0));
            let f = tokio::time::timeout(
                Duration::from_secs(5),
                w.call(
                    &wire::fetch("t", &[(0, 0)], Duration::from_millis(10), 1, 1 << 20),
                    wire::FETCH_VERSION,
                ),
            )
            .await;
            (produced, f.is_ok_and(|r| r.is_ok()), answers(addr).await)
        });
        let st = b.exited(0);
        let err = b.stop();
        assert!(
            ok == (true, true, true) && st.is_none() && !err.contains("panicked"),
            "{args:?}: produce/fetch/bystander {ok:?}, process {:?}, stderr {:?}",
            st.map(|s| describe(&s)),
            err.lines().take(3).collect::<Vec<_>>()
        );
    }
}

/// `serve` logs a connection it closes for a refused frame on stderr, as
/// the README promises ("a log line"; nothing was printed: no subscriber was
/// installed), at INFO by default, and `RUST_LOG` rules it (`warn`: not
/// shown).
#[test]
fn serve_logs_a_refused_connection_and_honours_rust_log() {
    use std::io::Write;
    // Metadata v1 claiming 2^31-1 topics: refused before decoding.
    let frame = [
        0, 0, 0, 0x12, 0, 3, 0, 1, 0, 0, 0, 7, 0, 4, b'f', b'u', b'z', b'z', 0x7f, 0xff, 0xff, 0xff,
    ];
    for (rust_log, shown) in [(None, true), (Some("warn"), false)] {
        let b = Broker::start_with(&[], 20, rust_log);
        let addr = b.listening.expect("the broker starts");
        let mut c = std::net::TcpStream::connect(addr).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        c.write_all(&frame).unwrap();
        let mut rest = Vec::new();
        let closed = c.read_to_end(&mut rest).is_ok();
        let err = b.stop();
        assert!(closed, "the connection was closed");
        let logged = err.lines().any(|l| {
            l.contains("INFO") && l.contains("connection closed") && l.contains("metadata topics")
        });
        assert_eq!(logged, shown, "RUST_LOG {rust_log:?}: stderr {err:?}");
        assert!(!err.contains('\u{1b}'), "no colours in a log file: {err:?}");
    }
}

/// SIGTERM (what `kill`, systemd and container runtimes send) stops `serve`
/// as Ctrl-C does: what waits is answered (a produce parked on a stuck
/// follower gets NOT_ENOUGH_REPLICAS_AFTER_APPEND, a parked fetch its empty
/// answer) and the process exits 0. It was killed by the signal, its
/// clients' requests unanswered.
#[test]
fn sigterm_shuts_down_gracefully_answering_what_waits() {
    let b = Broker::start(
        &[
            "--topics",
            "t",
            "--followers",
            "1",
            "--stuck-follower",
            "0",
            "--metrics-addr",
            "127.0.0.1:0",
        ],
        20,
    );
    let addr = b.listening.expect("the broker starts");
    let metrics = b.metrics_addr();
    let mut b = b;
    let pid = b.child.id();
    let (produced, fetched, status) = rt().block_on(async {
        let mut p = Wire::connect(addr).await.unwrap();
        let mut f = Wire::connect(addr).await.unwrap();
        let produce = wire::produce("t", 0, -1, Duration::from_secs(30), wire::batch(&[b"v"]));
        p.send(&produce, wire::PRODUCE_VERSION).await.unwrap();
        let fetch = wire::fetch("t", &[(0, 0)], Duration::from_secs(30), 1, 1 << 20);
        f.send(&fetch, wire::FETCH_VERSION).await.unwrap();
        // Both parked (the follower copies nothing; nothing is replicated
        // for the fetch to read): polled on the metrics page, at most 10 s.
        let give_up = Instant::now() + Duration::from_secs(10);
        loop {
            let produce = metric(metrics, "tokio_purgatory_delayed{name=\"produce\"}").await;
            let fetch = metric(metrics, "tokio_purgatory_delayed{name=\"fetch\"}").await;
            if produce == Some(1.0) && fetch == Some(1.0) {
                break;
            }
            assert!(
                Instant::now() < give_up,
                "the produce and fetch not parked within 10 s: {produce:?} {fetch:?} waiting"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let killed = Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .unwrap();
        assert!(killed.success());
        let within = Duration::from_secs(5);
        let produced =
            tokio::time::timeout(within, p.receive::<ProduceRequest>(wire::PRODUCE_VERSION)).await;
        let fetched =
            tokio::time::timeout(within, f.receive::<FetchRequest>(wire::FETCH_VERSION)).await;
        (produced, fetched, b.exited(5))
    });
    let err = b.stop();
    let produced = produced
        .expect("the produce is answered at shutdown")
        .expect("an answer, not a closed connection");
    assert_eq!(
        wire::produce_error(&produced),
        kafka_protocol::error::ResponseError::NotEnoughReplicasAfterAppend.code()
    );
    let fetched = fetched
        .expect("the fetch is answered at shutdown")
        .expect("an answer, not a closed connection");
    assert_eq!(fetched.responses[0].partitions[0].error_code, 0);
    let status = status.expect("the broker exits after SIGTERM");
    assert_eq!(
        status.code(),
        Some(0),
        "{} (stderr {err:?})",
        describe(&status)
    );
}
