//! The demonstration: a broker on an ephemeral port, driven by rskafka (and,
//! for what rskafka does not expose, by the raw wire client).

use std::time::Duration;

use kafka_protocol::error::ResponseError;
use kafka_protocol::messages::ProduceRequest;
use rskafka::chrono::{TimeZone, Utc};
use rskafka::client::error::{Error as ClientError, ProtocolError};
use rskafka::client::partition::{Compression, PartitionClient, UnknownTopicHandling};
use rskafka::client::ClientBuilder;
use rskafka::record::Record;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::Instant;

use crate::broker::{BrokerHandle, Config};
use crate::wire::{self, Wire};

const TOPIC: &str = "demo";

pub fn record(value: &str) -> Record {
    Record {
        key: None,
        value: Some(value.as_bytes().to_vec()),
        headers: Default::default(),
        timestamp: Utc
            .timestamp_millis_opt(wire::now_ms())
            .single()
            .expect("a valid time"),
    }
}

/// A client of its own (its own connection: Kafka answers one request at a
/// time per connection, so a parked fetch would hold up a produce behind it).
pub async fn partition(addr: std::net::SocketAddr, p: i32) -> PartitionClient {
    let client = ClientBuilder::new(vec![addr.to_string()])
        .build()
        .await
        .expect("client connects");
    client
        .partition_client(TOPIC, p, UnknownTopicHandling::Retry)
        .await
        .expect("partition client")
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1e3)
}

/// Waits (briefly, on the wall clock: the broker is real) until `cond`.
async fn until(what: &str, cond: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

pub async fn run() -> i32 {
    let config = Config {
        listen: "127.0.0.1:0".parse().unwrap(),
        partitions: 4,
        followers: 2,
        replica_lag: Duration::from_millis(2),
        max_produce_wait: Duration::from_millis(300),
        metrics_addr: Some("127.0.0.1:0".parse().unwrap()),
        groups: crate::broker::groups::GroupLimits {
            min_session: Duration::from_millis(100),
            ..Default::default()
        },
        ..Config::default()
    };
    let handle = BrokerHandle::start(config).await.expect("broker starts");
    let addr = handle.addr;
    let broker = handle.broker.clone();
    println!("broker on {addr}: 4 partitions a topic, 2 followers copying 2 ms after each append");

    // 1. acks=all, then read it back.
    let p0 = partition(addr, 0).await;
    let t = Instant::now();
    let offsets = p0
        .produce(
            vec![record("a"), record("b"), record("c")],
            Compression::NoCompression,
        )
        .await
        .expect("produce");
    println!(
        "\n[acks=all] 3 records at offsets {offsets:?}, acknowledged after {} (both followers copied them)",
        ms(t.elapsed())
    );
    let (records, hw) = p0
        .fetch_records(0, 1..1_000_000, 1_000)
        .await
        .expect("fetch");
    let values: Vec<String> = records
        .iter()
        .map(|r| String::from_utf8_lossy(r.record.value.as_deref().unwrap_or_default()).into())
        .collect();
    println!("[fetch] read back {values:?}, high watermark {hw}");

    // 2. Parked fetches woken by a produce.
    const PARKED: usize = 20;
    let mut fetchers = Vec::new();
    for _ in 0..PARKED {
        let c = partition(addr, 1).await;
        fetchers.push(tokio::spawn(async move {
            c.fetch_records(0, 1..1_000_000, 5_000)
                .await
                .expect("fetch");
            Instant::now()
        }));
    }
    until("the fetches are parked", || {
        broker.fetches.delayed() == PARKED
    })
    .await;
    let producer = partition(addr, 1).await;
    let sent = Instant::now();
    producer
        .produce(vec![record("wake up")], Compression::NoCompression)
        .await
        .expect("produce");
    let acked = Instant::now();
    let mut woke: Vec<Duration> = Vec::new();
    for f in fetchers {
        woke.push(f.await.unwrap().saturating_duration_since(sent));
    }
    woke.sort();
    let after_ack = |d: Duration| ms(d.saturating_sub(acked - sent));
    println!(
        "\n[long poll] {PARKED} fetches parked on partition 1 (max_wait 5 s); one produce (acks=all) sent:\n  \
         produce acknowledged after {} (replication); fetches answered after {} (first) / {} (median) / {} (last),\n  \
         that is {} / {} / {} after the acknowledgement (the same high watermark move completes both)",
        ms(acked - sent),
        ms(woke[0]),
        ms(woke[PARKED / 2]),
        ms(woke[PARKED - 1]),
        after_ack(woke[0]),
        after_ack(woke[PARKED / 2]),
        after_ack(woke[PARKED - 1]),
    );

    // 3. An empty partition: the fetch answers at max_wait.
    let p2 = partition(addr, 2).await;
    let t = Instant::now();
    let (records, _) = p2.fetch_records(0, 1..1_000_000, 500).await.expect("fetch");
    println!(
        "\n[max_wait] fetch of empty partition 2 with max_wait 500 ms: {} records after {}",
        records.len(),
        ms(t.elapsed())
    );

    // 4. A stuck follower: acks=all times out, acks=1 succeeds.
    broker.set_stuck(1, true);
    let p3 = partition(addr, 3).await;
    let t = Instant::now();
    let result = p3
        .produce(vec![record("never replicated")], Compression::NoCompression)
        .await;
    let why = match result {
        Err(ClientError::ServerError {
            protocol_error: ProtocolError::RequestTimedOut,
            ..
        }) => "REQUEST_TIMED_OUT".to_string(),
        other => format!("unexpected: {other:?}"),
    };
    println!(
        "\n[stuck follower] follower 1 stopped copying; acks=all produce to partition 3: {why} after {} (the broker's cap on waiting)",
        ms(t.elapsed())
    );
    let mut raw = Wire::connect(addr).await.expect("connect");
    let t = Instant::now();
    let r = raw
        .append(TOPIC, 3, &[b"leader only"])
        .await
        .expect("produce");
    println!(
        "[stuck follower] acks=1 produce to partition 3: error code {} (none) after {}",
        wire::produce_error(&r),
        ms(t.elapsed())
    );
    broker.set_stuck(1, false);
    until("partition 3 catches up", || {
        broker.topics.partition(TOPIC, 3).unwrap().high_watermark() == 2
    })
    .await;
    println!("[stuck follower] follower 1 back: partition 3's high watermark caught up to 2");

    // 5. A client that hangs up while its fetch waits.
    let mut gone = Wire::connect(addr).await.expect("connect");
    gone.send(
        &wire::fetch(TOPIC, &[(2, 0)], Duration::from_secs(30), 1, 1 << 20),
        wire::FETCH_VERSION,
    )
    .await
    .expect("send");
    until("the fetch is parked", || broker.fetches.delayed() == 1).await;
    let t = Instant::now();
    drop(gone);
    until("the fetch is cancelled", || broker.fetches.delayed() == 0).await;
    println!(
        "\n[hang-up] a client sent a fetch (max_wait 30 s) and hung up: the fetch left the purgatory {} later",
        ms(t.elapsed())
    );

    // 6. Hostile bytes: a 22-byte Metadata request claiming 2^31-1 topics
    // (a decoder that reserves for the count first asks for 154 GB and aborts
    // the process), and batches that lie.
    let mut raw = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let hostile = [
        0, 0, 0, 0x12, 0, 3, 0, 1, 0, 0, 0, 7, 0, 4, b'f', b'u', b'z', b'z', 0x7f, 0xff, 0xff, 0xff,
    ];
    raw.write_all(&hostile).await.expect("write");
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(5), raw.read_to_end(&mut rest))
        .await
        .is_ok_and(|r| r.is_ok());
    let mut w = Wire::connect(addr).await.expect("connect");
    let lying = wire::produce(
        TOPIC,
        0,
        1,
        Duration::from_secs(5),
        wire::lying_batch(&[b"x"], i32::MAX),
    );
    let lying = wire::produce_error(&w.call(&lying, wire::PRODUCE_VERSION).await.expect("answer"));
    let corrupt = wire::produce(
        TOPIC,
        0,
        1,
        Duration::from_secs(5),
        wire::corrupt_batch(&[b"x"]),
    );
    let corrupt = wire::produce_error(
        &w.call(&corrupt, wire::PRODUCE_VERSION)
            .await
            .expect("answer"),
    );
    println!(
        "\n[hostile] a 22-byte Metadata request claiming 2^31-1 topics: {} (the broker lives on); a one-record batch claiming 2^31 records: error {lying} ({} = INVALID_RECORD); a batch failing its CRC: error {corrupt} ({} = CORRUPT_MESSAGE)",
        if closed { "that connection closed" } else { "NOT CLOSED" },
        ResponseError::InvalidRecord.code(),
        ResponseError::CorruptMessage.code(),
    );

    // 7. A consumer group: joins wait in the join purgatory for the group's
    // members, sessions live in the timer and move with each heartbeat.
    const GROUP: &str = "demo-group";
    let mut a = wire::GroupMember::connect(addr).await.expect("connect");
    let alone = a.rejoin(GROUP, 500).await.expect("A joins");
    let mut b = wire::GroupMember::connect(addr).await.expect("connect");
    let t = Instant::now();
    let b_joins = tokio::spawn(async move {
        let mine = b.rejoin(GROUP, 500).await.expect("B joins");
        (b, mine)
    });
    until("B's join waits", || broker.groups.joins.delayed() == 1).await;
    let told = a.heartbeat(GROUP).await.expect("heartbeat");
    let a_mine = a.rejoin(GROUP, 500).await.expect("A joins again");
    let (b, b_mine) = b_joins.await.expect("B's task");
    let rebalance = t.elapsed();
    println!(
        "\n[group] A alone holds partitions {alone:?}; B joins, A's heartbeat says {told} (REBALANCE_IN_PROGRESS), both join again: generation {}, A {a_mine:?}, B {b_mine:?}, in {}",
        a.generation,
        ms(rebalance)
    );
    // B dies: no more heartbeats. Its session (500 ms) expires in the timer,
    // A hears of the rebalance from its next heartbeat and takes all four.
    let t = Instant::now();
    drop(b);
    loop {
        tokio::time::sleep(Duration::from_millis(50)).await;
        if a.heartbeat(GROUP).await.expect("heartbeat") != 0 {
            break;
        }
    }
    let all = a.rejoin(GROUP, 500).await.expect("A joins again");
    let (generation, members) = broker.groups.describe(GROUP).expect("the group");
    let joins = broker.groups.joins.metrics();
    let sessions = broker.groups.sessions.metrics();
    println!(
        "[group] B killed: A holds {all:?} after {} (generation {generation}, members {}); join purgatory: {} joins waited, {} completed by a walk of the group, {} at the deadline; session timer: {} expired",
        ms(t.elapsed()),
        members.len(),
        joins.registered,
        joins.completed,
        joins.expired,
        sessions.expired,
    );
    // Commits outlive the consumer that made them.
    let codes = a
        .commit(GROUP, TOPIC, &[(0, 1), (1, 5)])
        .await
        .expect("commit");
    let _ = a.leave(GROUP).await;
    drop(a);
    let mut restarted = wire::GroupMember::connect(addr).await.expect("connect");
    let committed = restarted.committed(GROUP, TOPIC).await.expect("offsets");
    println!("[group] A committed (errors {codes:?}) and left; a restarted consumer reads the commits back: {committed:?}");

    // 8. The metrics page, as Prometheus scrapes it.
    let at = handle.metrics_addr.expect("metrics served");
    let mut http = tokio::net::TcpStream::connect(at).await.expect("connect");
    http.write_all(b"GET /metrics HTTP/1.1\r\nHost: demo\r\n\r\n")
        .await
        .expect("write");
    let mut page = String::new();
    http.read_to_string(&mut page).await.expect("read");
    let lines: Vec<&str> = page
        .lines()
        .filter(|l| {
            l.starts_with("tokio_purgatory_lateness_seconds_count")
                || l.starts_with("tokio_purgatory_checks_total{name=\"fetch\",walk=\"level\"")
                || l.starts_with("tokio_purgatory_delayed")
        })
        .collect();
    println!(
        "\n[metrics] http://{at}/metrics serves {} lines of Prometheus text, among them:\n  {}",
        page.lines().count(),
        lines.join("\n  ")
    );

    // 9. Shutdown answers what waits.
    broker.set_stuck(0, true);
    let mut waiting = Vec::new();
    for i in 0..3 {
        let mut w = Wire::connect(addr).await.expect("connect");
        let req: ProduceRequest = wire::produce(
            TOPIC,
            i,
            -1,
            Duration::from_secs(30),
            wire::batch(&[b"late"]),
        );
        waiting.push(tokio::spawn(async move {
            w.call(&req, wire::PRODUCE_VERSION)
                .await
                .map(|r| wire::produce_error(&r))
        }));
    }
    let mut fetches = Vec::new();
    for _ in 0..5 {
        let mut w = Wire::connect(addr).await.expect("connect");
        fetches.push(tokio::spawn(async move {
            // Partition 2 is empty: a fetch wanting a megabyte waits.
            w.call(
                &wire::fetch(TOPIC, &[(2, 0)], Duration::from_secs(30), 1 << 20, 1 << 20),
                wire::FETCH_VERSION,
            )
            .await
            .map(|r| r.responses[0].partitions[0].error_code)
        }));
    }
    until("3 produces and 5 fetches wait", || {
        broker.produces.delayed() == 3 && broker.fetches.delayed() == 5
    })
    .await;
    let t = Instant::now();
    handle.shutdown().await;
    let mut produce_codes = Vec::new();
    for w in waiting {
        produce_codes.push(w.await.unwrap().expect("answered"));
    }
    for f in fetches {
        f.await.unwrap().expect("answered");
    }
    let expected = ResponseError::NotEnoughReplicasAfterAppend.code();
    println!(
        "\n[shutdown] 3 produces and 5 fetches waiting; shutdown answered all in {}: produces with error {produce_codes:?} ({expected} = NOT_ENOUGH_REPLICAS_AFTER_APPEND), fetches with the data readable",
        ms(t.elapsed())
    );
    let s = &broker.stats;
    println!(
        "\n{} requests served, {} fetches parked, {} produces timed out, {} connections hung up while waiting, {} closed for bad frames, {} batches refused, {} bytes of request memory held at the end",
        s.requests.load(std::sync::atomic::Ordering::Relaxed),
        s.fetches_parked.load(std::sync::atomic::Ordering::Relaxed),
        s.produces_timed_out.load(std::sync::atomic::Ordering::Relaxed),
        s.connections_dropped_while_waiting.load(std::sync::atomic::Ordering::Relaxed),
        s.connections_refused.load(std::sync::atomic::Ordering::Relaxed),
        s.batches_refused.load(std::sync::atomic::Ordering::Relaxed),
        broker.budget.in_use(),
    );
    let produces = (broker.produces.lateness(), broker.produces.metrics());
    let fetches = (broker.fetches.lateness(), broker.fetches.metrics());
    for (name, (late, m)) in [("produce", produces), ("fetch", fetches)] {
        let advances = m.checks.level_advances;
        println!(
            "{name} purgatory: {} expiries, lateness p50 {} p99 {} max {}; {} high-watermark advances checked {} requests and completed {}",
            late.count(),
            ms(late.quantile(0.5)),
            ms(late.quantile(0.99)),
            ms(late.max()),
            advances.walks,
            advances.checked,
            advances.completed,
        );
    }
    0
}
