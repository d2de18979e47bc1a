//! The broker example driven by Kafka clients nobody on this project wrote
//! (installed from PyPI, pinned, by `scripts/install-clients` into
//! `target/clients`, once):
//!
//! - kafka-python: `scripts/group_scenario.py` runs two consumers that split
//!   four partitions, one leaving, one killed with SIGKILL, every record read
//!   by the group, commits surviving a restart.
//! - confluent-kafka (librdkafka, what kcat is built on): listing every
//!   topic (librdkafka's Metadata request carries bytes after its fields),
//!   an `acks=all` produce read back, and a lookup by time.
//!
//! Real sockets and real time, bounded.

#[path = "../examples/kafka_broker/broker/mod.rs"]
#[allow(dead_code)]
mod broker;

use std::process::Command;
use std::time::Duration;

use broker::{BrokerHandle, Config};

/// Runs `scripts/install-clients` once for the tests of this file (which
/// may run at once): `true` when the clients are installed.
fn install_clients() -> bool {
    static INSTALLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *INSTALLED.get_or_init(|| {
        let root = env!("CARGO_MANIFEST_DIR");
        Command::new(format!("{root}/scripts/install-clients"))
            .status()
            .expect("scripts/install-clients runs")
            .success()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_python_consumer_groups_split_rebalance_and_keep_commits() {
    let root = env!("CARGO_MANIFEST_DIR");
    assert!(
        install_clients(),
        "installing kafka-python and confluent-kafka from PyPI failed (the test needs the Python registry)"
    );
    let b = BrokerHandle::start(Config {
        listen: "127.0.0.1:0".parse().unwrap(),
        topics: vec!["groups".into()],
        ..Config::default()
    })
    .await
    .expect("the broker starts");
    let addr = b.addr.to_string();
    let run = tokio::process::Command::new(format!("{root}/target/clients/bin/python"))
        .arg(format!("{root}/scripts/group_scenario.py"))
        .arg(&addr)
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(90), run)
        .await
        .expect("the scenario finished within 90 s")
        .expect("python runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    eprintln!("kafka-python group scenario: {stdout}");
    // The killed consumer's partitions come back once its 6 s session
    // expires (the timer), not before, and not much after.
    let kill: f64 = stdout
        .split("\"rebalance_after_kill_s\": ")
        .nth(1)
        .and_then(|r| r.split([',', '}']).next())
        .and_then(|v| v.parse().ok())
        .expect("the kill timing");
    assert!((5.0..9.0).contains(&kill), "{kill} s after the kill");
    let joins = b.broker.groups.joins.metrics();
    assert!(joins.completed >= 4, "{joins:?}");
    assert!(b.broker.groups.sessions.metrics().expired >= 1);
    b.shutdown().await;
}

/// What the confluent-kafka test runs (each call bounded): every topic
/// listed by the admin client and by a consumer (librdkafka's all-topics
/// Metadata v12 carries 3 bytes after its fields: the broker closed the
/// connection, and `list_topics`, `kcat -L` and regex subscriptions never
/// worked), 50 records produced with `acks=all` (LZ4, stamped t0, t0+2, ...)
/// read back, the first record at t0+10 looked up by time, a topic created
/// by the admin client (and one it cannot create), and a consumer group
/// listed and described by it.
const LIBRDKAFKA_SCENARIO: &str = r#"
import json, sys, time
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic
addr, out, errors = sys.argv[1], {}, []
started = time.time()
out["admin_topics"] = sorted(AdminClient({"bootstrap.servers": addr}).list_topics(timeout=5).topics)
c = Consumer({"bootstrap.servers": addr, "group.id": "rt", "enable.auto.commit": False})
out["consumer_topics"] = sorted(c.list_topics(timeout=5).topics)
p = Producer({"bootstrap.servers": addr, "acks": "all", "linger.ms": 5,
              "compression.type": "lz4", "message.timeout.ms": 5000})
t0 = int(time.time() * 1000) - 60_000
def delivered(e, m):
    if e: errors.append(str(e))
for i in range(50):
    p.produce("rt", value=b"v%d" % i, partition=0, timestamp=t0 + 2 * i, on_delivery=delivered)
out["unflushed"] = p.flush(5)
c.assign([TopicPartition("rt", 0, 0)])
got, deadline = [], time.time() + 5
while len(got) < 50 and time.time() < deadline:
    for m in c.consume(50, 0.2):
        if m.error(): errors.append(str(m.error()))
        else: got.append(m.value().decode())
out["consumed"] = got
found = c.offsets_for_times([TopicPartition("rt", 0, t0 + 10)], timeout=5)[0]
out["by_time"] = [found.offset, found.error is None]
c.close()
admin = AdminClient({"bootstrap.servers": addr})
made = {}
for name, f in admin.create_topics([NewTopic("made", 3, replication_factor=1), NewTopic("rt", 1)],
                                   request_timeout=5).items():
    try:
        f.result(); made[name] = "created"
    except Exception as e:
        made[name] = e.args[0].name()
out["created"] = made
out["made_partitions"] = len(admin.list_topics(timeout=5).topics["made"].partitions)
g = Consumer({"bootstrap.servers": addr, "group.id": "described", "client.id": "describer",
              "session.timeout.ms": 6000})
g.subscribe(["made"])
deadline = time.time() + 10
while not g.assignment() and time.time() < deadline:
    g.poll(0.1)
groups = admin.list_consumer_groups(request_timeout=5).result()
out["listed"] = sorted(x.group_id for x in groups.valid)
d = admin.describe_consumer_groups(["described"], request_timeout=5)["described"].result()
out["described"] = [str(d.state).split(".")[-1], d.partition_assignor,
                    [[m.client_id, m.host, sorted(tp.partition for tp in m.assignment.topic_partitions)]
                     for m in d.members]]
g.close()
out["errors"], out["seconds"] = errors, round(time.time() - started, 2)
for name, value in out.items():
    print(name, json.dumps(value))
"#;

/// librdkafka against the broker: its all-topics Metadata request, an
/// `acks=all` round trip and a lookup by time (see [`LIBRDKAFKA_SCENARIO`]).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn librdkafka_lists_topics_and_round_trips_acks_all() {
    let root = env!("CARGO_MANIFEST_DIR");
    assert!(
        install_clients(),
        "installing kafka-python and confluent-kafka from PyPI failed (the test needs the Python registry)"
    );
    let b = BrokerHandle::start(Config {
        listen: "127.0.0.1:0".parse().unwrap(),
        topics: vec!["rt".into(), "other".into()],
        ..Config::default()
    })
    .await
    .expect("the broker starts");
    let run = tokio::process::Command::new(format!("{root}/target/clients/bin/python"))
        .args(["-c", LIBRDKAFKA_SCENARIO, &b.addr.to_string()])
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(40), run)
        .await
        .expect("the scenario finished within 40 s")
        .expect("python runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    eprintln!("librdkafka scenario: {stdout}");
    // One line a field: its name, then its value in JSON.
    let field = |name: &str| {
        stdout
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
            .unwrap_or_else(|| panic!("{name} in {stdout}"))
            .to_string()
    };
    assert_eq!(field("admin_topics"), r#"["other", "rt"]"#);
    assert_eq!(field("consumer_topics"), r#"["other", "rt"]"#);
    assert_eq!(field("unflushed"), "0");
    let want: Vec<String> = (0..50).map(|i| format!("\"v{i}\"")).collect();
    assert_eq!(field("consumed"), format!("[{}]", want.join(", ")));
    // The record stamped t0+10 is the sixth: offset 5, as Kafka answers.
    assert_eq!(field("by_time"), "[5, true]");
    assert_eq!(
        field("created"),
        r#"{"made": "created", "rt": "TOPIC_ALREADY_EXISTS"}"#
    );
    assert_eq!(field("made_partitions"), "3");
    // The group with its one member (librdkafka commits nothing here, so the
    // other consumer, assigned by hand, made no group).
    assert_eq!(field("listed"), r#"["described"]"#);
    assert_eq!(
        field("described"),
        r#"["STABLE", "range", [["describer", "/127.0.0.1", [0, 1, 2]]]]"#
    );
    assert_eq!(field("errors"), "[]");
    assert_eq!(
        b.broker
            .stats
            .connections_refused
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    b.shutdown().await;
}
