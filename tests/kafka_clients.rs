//! The broker example's consumer groups driven by kafka-python, a Kafka
//! client nobody on this project wrote (installed from PyPI, pinned, by
//! `scripts/install-clients` into `target/clients`, once):
//! `scripts/group_scenario.py` runs two consumers that split four
//! partitions, one leaving, one killed with SIGKILL, every record read by the group,
//! commits surviving a restart. Real sockets and real time, bounded.

#[path = "../examples/kafka_broker/broker/mod.rs"]
#[allow(dead_code)]
mod broker;

use std::process::Command;
use std::time::Duration;

use broker::{BrokerHandle, Config};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_python_consumer_groups_split_rebalance_and_keep_commits() {
    let root = env!("CARGO_MANIFEST_DIR");
    let install = Command::new(format!("{root}/scripts/install-clients"))
        .status()
        .expect("scripts/install-clients runs");
    assert!(
        install.success(),
        "installing kafka-python from PyPI failed (the test needs the Python registry)"
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
