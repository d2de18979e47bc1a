//! The Kafka-protocol broker example's memory stays within its bounds
//! whatever clients send: it keeps nothing of a request's frame beyond what
//! it stores (a request that waits holds its own state, not its frame, and
//! overlong strings are refused), answers a client does not read (records,
//! metadata, group answers) stay within its memory budget, member ids
//! handed out stay within their bound, retention does not move its whole
//! order at each append, compressed batches read for their timestamps
//! decode no more than the lookup's read bound, and the descriptor watched
//! for a hang-up goes with its request.
//! The live heap and the descriptors are counted process-wide, so the tests
//! here run one at a time; real sockets, each test bounded by a timeout.

#[path = "../examples/kafka_broker/broker/mod.rs"]
#[allow(dead_code)]
mod broker;
#[path = "../examples/kafka_broker/wire.rs"]
#[allow(dead_code)]
mod wire;

mod support;
use support::alloc;

/// The live-heap count, and a count of the allocations and reallocations of
/// at least [`BIG`] bytes (a measure of the whole retention order being
/// moved: nothing else here is that large).
struct CountingBig;

static BIG_ONES: AtomicU64 = AtomicU64::new(0);
const BIG: usize = 1 << 20;

// SAFETY: forwards every call unchanged to `alloc::Counting`.
unsafe impl GlobalAlloc for CountingBig {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        if l.size() >= BIG {
            BIG_ONES.fetch_add(1, Ordering::Relaxed);
        }
        unsafe { alloc::Counting.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { alloc::Counting.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        if new.max(l.size()) >= BIG {
            BIG_ONES.fetch_add(1, Ordering::Relaxed);
        }
        unsafe { alloc::Counting.realloc(p, l, new) }
    }
}

#[global_allocator]
static GLOBAL: CountingBig = CountingBig;

use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use broker::{BrokerHandle, Config};
use kafka_protocol::messages::offset_commit_request::{
    OffsetCommitRequestPartition, OffsetCommitRequestTopic,
};
use kafka_protocol::messages::{GroupId, OffsetCommitRequest, TopicName};
use kafka_protocol::protocol::StrBytes;
use wire::Wire;

fn s(v: &str) -> StrBytes {
    StrBytes::from_string(v.to_string())
}

/// A commit of one offset with one byte of metadata, in a frame of about
/// 4 MiB: 128 more partitions whose 30,000-byte metadata is refused
/// (OFFSET_METADATA_TOO_LARGE), as a hostile client would pad it.
fn padded_commit(partition: i32) -> OffsetCommitRequest {
    let big = "x".repeat(30_000);
    let mut partitions = vec![OffsetCommitRequestPartition::default()
        .with_partition_index(partition)
        .with_committed_offset(1)
        .with_committed_metadata(Some(s("m")))];
    partitions.extend((0..128).map(|i| {
        OffsetCommitRequestPartition::default()
            .with_partition_index(10_000 + i)
            .with_committed_offset(1)
            .with_committed_metadata(Some(s(&big)))
    }));
    OffsetCommitRequest::default()
        .with_group_id(GroupId(s("g")))
        .with_generation_id_or_member_epoch(-1)
        .with_member_id(s(""))
        .with_topics(vec![OffsetCommitRequestTopic::default()
            .with_name(TopicName(s("t")))
            .with_partitions(partitions)])
}

/// The tests here one at a time: each measures the whole process's heap.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_offsets_keep_none_of_their_frames() {
    let _alone = ONE_AT_A_TIME.lock().await;
    tokio::time::timeout(Duration::from_secs(60), async {
        let b = BrokerHandle::start(Config {
            listen: "127.0.0.1:0".parse().unwrap(),
            max_request_bytes: 8 << 20,
            // Offsets are stored only for partitions that exist.
            topics: vec!["t".into()],
            partitions: 32,
            ..Config::default()
        })
        .await
        .expect("the broker starts");
        let mut w = Wire::connect(b.addr).await.unwrap();
        // Warm up (the group, the first allocations), then measure.
        let r = w.call(&padded_commit(0), 7).await.unwrap();
        assert_eq!(r.topics[0].partitions[0].error_code, 0);
        let before = alloc::live_bytes();
        for p in 1..=20 {
            let r = w.call(&padded_commit(p), 7).await.unwrap();
            assert_eq!(r.topics[0].partitions[0].error_code, 0, "stored");
            assert_eq!(r.topics[0].partitions[1].error_code, 12, "refused");
        }
        drop(w);
        // The connection's own buffers go when its task ends.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        let grown = loop {
            let grown = alloc::live_bytes() - before;
            if grown < 1 << 20 || tokio::time::Instant::now() > deadline {
                break grown;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        assert!(
            grown < 1 << 20,
            "20 stored offsets of one byte each kept {grown} bytes (their frames were 4 MiB each)"
        );
        assert_eq!(b.broker.budget.in_use(), 0);
        b.shutdown().await;
    })
    .await
    .expect("bounded");
}

/// Twenty clients fetch up to 50 MiB each and never read: their answers are
/// charged to the budget before their records are copied, so what they hold
/// stays within it (each answer carries what the budget had room for).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_nobody_reads_stay_within_the_budget() {
    let _alone = ONE_AT_A_TIME.lock().await;
    tokio::time::timeout(Duration::from_secs(60), async {
        let budget = 4 << 20;
        let b = BrokerHandle::start(Config {
            listen: "127.0.0.1:0".parse().unwrap(),
            max_request_bytes: 1 << 20,
            max_decoded_bytes: 1 << 20,
            memory_budget: budget,
            topics: vec!["t".into()],
            ..Config::default()
        })
        .await
        .expect("the broker starts");
        let mut w = Wire::connect(b.addr).await.unwrap();
        let value = vec![7u8; 900 << 10];
        for _ in 0..40 {
            let r = w.append("t", 0, &[&value]).await.unwrap();
            assert_eq!(wire::produce_error(&r), 0);
        }
        let before = alloc::live_bytes();
        let mut silent = Vec::new();
        for _ in 0..20 {
            let mut c = Wire::connect(b.addr).await.unwrap();
            let fetch = wire::fetch("t", &[(0, 0)], Duration::ZERO, 0, 50 << 20);
            c.send(&fetch, wire::FETCH_VERSION).await.unwrap();
            silent.push(c); // never read
        }
        // Time for the answers (due at once) to be built; those the sockets'
        // buffers do not take wait to be written: until the heap holds still.
        heap_settled().await;
        let grown = alloc::live_bytes() - before;
        assert!(
            b.broker.budget.in_use() <= budget,
            "{} charged",
            b.broker.budget.in_use()
        );
        // The budget, and the sockets' own buffers and the frames' slack.
        assert!(
            grown < (budget as isize) * 2 + (4 << 20),
            "unread answers hold {grown} bytes with a {budget}-byte budget"
        );
        // A reading client still gets an answer (perhaps without records
        // while the budget is spent).
        let r = w
            .call(
                &wire::fetch("t", &[(0, 0)], Duration::ZERO, 0, 1 << 20),
                wire::FETCH_VERSION,
            )
            .await
            .unwrap();
        assert_eq!(r.responses[0].partitions[0].error_code, 0);
        drop(silent);
        b.shutdown().await;
    })
    .await
    .expect("bounded");
}

/// A fetch naming four partitions 100,000 times over, parked in the
/// purgatory, holds what it stays charged and no more: Kafka keys a fetch's
/// partitions by topic and partition, so it is four partitions, four
/// watches. And it lets go of its frame and decoded request before it waits
/// (as Kafka releases a request's buffer once its handler returns): it used
/// to keep them, and their charge (some 10 MiB here), for its whole wait, up
/// to `i32::MAX` ms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_fetch_holds_no_more_than_its_charge() {
    use kafka_protocol::messages::fetch_request::{FetchPartition, FetchTopic};
    use kafka_protocol::messages::{BrokerId, FetchRequest};
    let _alone = ONE_AT_A_TIME.lock().await;
    tokio::time::timeout(Duration::from_secs(60), async {
        let b = BrokerHandle::start(Config {
            listen: "127.0.0.1:0".parse().unwrap(),
            followers: 0,
            topics: vec!["t".into()],
            ..Config::default()
        })
        .await
        .expect("the broker starts");
        let req = FetchRequest::default()
            .with_replica_id(BrokerId(-1))
            .with_max_wait_ms(60_000)
            .with_min_bytes(1)
            .with_max_bytes(1 << 20)
            .with_session_epoch(-1)
            .with_topics(vec![FetchTopic::default()
                .with_topic(TopicName(s("t")))
                .with_partitions(
                    (0..100_000)
                        .map(|i| {
                            FetchPartition::default()
                                .with_partition(i % 4)
                                .with_fetch_offset(0)
                                .with_partition_max_bytes(1 << 20)
                        })
                        .collect(),
                )]);
        let mut w = Wire::connect(b.addr).await.unwrap();
        let before = alloc::live_bytes();
        w.send(&req, 11).await.unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while b.broker.fetches.delayed() != 1 || b.broker.fetches.metrics().watched == 0 {
            assert!(tokio::time::Instant::now() < deadline, "parked");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // (Time for a registration of more watches to finish: a wait for
        // something that must not happen, so a short fixed one.)
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(b.broker.fetches.metrics().watched, 4);
        let grown = alloc::live_bytes() - before;
        let charged = b.broker.budget.in_use() as isize;
        assert!(
            grown < charged + (512 << 10),
            "one parked fetch holds {grown} bytes, {charged} charged"
        );
        assert!(
            charged < 64 << 10,
            "one parked fetch of four partitions stays charged {charged} bytes"
        );
        drop(w);
        b.shutdown().await;
    })
    .await
    .expect("bounded");
}

/// The logs hold at most `max_log_bytes` of the heap, in large batches or
/// in many small ones (each counted with what keeping it costs): the oldest
/// go as new ones come.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_logs_stay_within_max_log_bytes() {
    let _alone = ONE_AT_A_TIME.lock().await;
    tokio::time::timeout(Duration::from_secs(60), async {
        let limit = 4 << 20;
        let b = BrokerHandle::start(Config {
            listen: "127.0.0.1:0".parse().unwrap(),
            followers: 0,
            topics: vec!["t".into()],
            max_log_bytes: limit,
            ..Config::default()
        })
        .await
        .expect("the broker starts");
        let mut w = Wire::connect(b.addr).await.unwrap();
        w.append("t", 0, &[b"warm"]).await.unwrap();
        let before = alloc::live_bytes();
        let value = vec![7u8; 900 << 10];
        for _ in 0..20 {
            let r = w.append("t", 0, &[&value]).await.unwrap();
            assert_eq!(wire::produce_error(&r), 0);
        }
        let grown = alloc::live_bytes() - before;
        assert!(
            grown < limit as isize + (1 << 20),
            "20 batches of 900 KiB hold {grown} bytes with a {limit}-byte limit"
        );
        // 20,000 batches of one record of one byte, sent with acks=0, then
        // one more whose answer says they were all handled.
        for i in 0..20_000 {
            let p = wire::produce("t", i % 4, 0, Duration::ZERO, wire::batch(&[b"v"]));
            w.send(&p, wire::PRODUCE_VERSION).await.unwrap();
        }
        let r = w.append("t", 0, &[b"v"]).await.unwrap();
        assert_eq!(wire::produce_error(&r), 0);
        let grown = alloc::live_bytes() - before;
        assert!(
            grown < limit as isize + (1 << 20),
            "small batches hold {grown} bytes with a {limit}-byte limit"
        );
        assert!(b.broker.topics.log_bytes() <= limit);
        b.shutdown().await;
    })
    .await
    .expect("bounded");
}

/// One produce (acks=1) of a one-record batch of `value` to each of
/// partitions `0..parts` of "t".
fn to_every_partition(parts: i32, value: &[u8]) -> kafka_protocol::messages::ProduceRequest {
    use kafka_protocol::messages::produce_request::{PartitionProduceData, TopicProduceData};
    let batch = wire::batch(&[value]);
    kafka_protocol::messages::ProduceRequest::default()
        .with_acks(1)
        .with_timeout_ms(5000)
        .with_topic_data(vec![TopicProduceData::default()
            .with_name(TopicName(s("t")))
            .with_partition_data(
                (0..parts)
                    .map(|p| {
                        PartitionProduceData::default()
                            .with_index(p)
                            .with_records(Some(batch.clone()))
                    })
                    .collect(),
            )])
}

/// The retention order (one queue of every stored batch) gives room back
/// with hysteresis: with the logs full and the order just past half its
/// room (as right after it doubled), appends that each drop two older
/// batches (one entry fewer each time) once shrank it to its length at every
/// append and had the push after double it again, two moves of the whole
/// order per append under its lock. 2,000 such appends now move it a few
/// times at most.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_does_not_reallocate_its_order_at_each_append() {
    let _alone = ONE_AT_A_TIME.lock().await;
    tokio::time::timeout(Duration::from_secs(60), async {
        let parts = 1000;
        // Each stored tiny batch's cost, measured below; the logs hold
        // 2^17 + 2 of them, so the order has just doubled to 2^18 entries of
        // room (several MiB: each of its moves is a BIG reallocation).
        let held = (1 << 17) + 2;
        let tiny = wire::batch(&[b"x"]).len();
        let probe = BrokerHandle::start(Config {
            listen: "127.0.0.1:0".parse().unwrap(),
            followers: 0,
            topics: vec!["t".into()],
            ..Config::default()
        })
        .await
        .expect("the broker starts");
        Wire::connect(probe.addr)
            .await
            .unwrap()
            .append("t", 0, &[b"x"])
            .await
            .unwrap();
        let cost = probe.broker.topics.log_bytes();
        let batch_cost = cost - tiny;
        probe.shutdown().await;
        let limit = held * cost;
        let b = BrokerHandle::start(Config {
            listen: "127.0.0.1:0".parse().unwrap(),
            followers: 0,
            partitions: parts,
            topics: vec!["t".into()],
            max_log_bytes: limit,
            ..Config::default()
        })
        .await
        .expect("the broker starts");
        let mut w = Wire::connect(b.addr).await.unwrap();
        // Fill the logs with tiny batches, and go on past the limit.
        let to_all = to_every_partition(parts, b"x");
        let p0 = b.broker.topics.partition("t", 0).unwrap();
        for round in 0.. {
            let r = w.call(&to_all, wire::PRODUCE_VERSION).await.unwrap();
            assert_eq!(produce_errors(&r), 0);
            if p0.log_start() > 5 {
                break;
            }
            assert!(round < 1000, "the logs filled");
        }
        assert_eq!(b.broker.topics.log_bytes(), limit);
        // Batches that each cost exactly two tiny ones: each append drops two.
        let value = (0..4096)
            .map(|v| vec![0u8; v])
            .find(|v| wire::batch(&[v]).len() == 2 * tiny + batch_cost)
            .expect("a value of that size");
        let to_all = to_every_partition(parts, &value);
        let before = BIG_ONES.load(Ordering::Relaxed);
        for _ in 0..2 {
            let r = w.call(&to_all, wire::PRODUCE_VERSION).await.unwrap();
            assert_eq!(produce_errors(&r), 0);
        }
        let big = BIG_ONES.load(Ordering::Relaxed) - before;
        assert_eq!(b.broker.topics.log_bytes(), limit);
        assert!(
            big <= 4,
            "2,000 appends moved the retention order {big} times (amortized: a few)"
        );
        b.shutdown().await;
    })
    .await
    .expect("bounded");
}

/// Partitions refused in a produce's answer.
fn produce_errors(r: &kafka_protocol::messages::ProduceResponse) -> usize {
    r.responses
        .iter()
        .flat_map(|t| &t.partition_responses)
        .filter(|p| p.error_code != 0)
        .count()
}

/// A raw request frame (size, header, body), for requests written several at
/// a time on one connection.
fn raw_frame<R: kafka_protocol::protocol::Request>(req: &R, version: i16, id: i32) -> Vec<u8> {
    use bytes::BufMut;
    use kafka_protocol::messages::RequestHeader;
    use kafka_protocol::protocol::Encodable;
    let mut out = bytes::BytesMut::new();
    out.put_i32(0);
    RequestHeader::default()
        .with_request_api_key(R::KEY)
        .with_request_api_version(version)
        .with_correlation_id(id)
        .with_client_id(Some(s("raw")))
        .encode(&mut out, R::header_version(version))
        .unwrap();
    req.encode(&mut out, version).unwrap();
    let size = (out.len() - 4) as i32;
    out[..4].copy_from_slice(&size.to_be_bytes());
    out.to_vec()
}

/// Reads one whole answer frame: its correlation id; `None` once closed.
async fn answer_id(c: &mut tokio::net::TcpStream) -> Option<i32> {
    use tokio::io::AsyncReadExt;
    let size = c.read_i32().await.ok()?;
    let mut body = vec![0; size.clamp(4, 1 << 24) as usize];
    c.read_exact(&mut body).await.ok()?;
    Some(i32::from_be_bytes(body[..4].try_into().unwrap()))
}

fn open_descriptors() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// A request that waits with bytes pipelined behind it has the socket's
/// descriptor duplicated to watch for the client hanging up; the duplicate
/// goes when the request ends, answered or cancelled by the hang-up, and
/// does not pile up per request. (Descriptors are counted process-wide,
/// hence here, one test at a time.)
#[cfg(target_os = "linux")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hang_up_watch_keeps_no_descriptor_past_its_request() {
    use kafka_protocol::messages::ApiVersionsRequest;
    use tokio::io::AsyncWriteExt;
    let _alone = ONE_AT_A_TIME.lock().await;
    tokio::time::timeout(Duration::from_secs(60), async {
        let b = BrokerHandle::start(Config {
            listen: "127.0.0.1:0".parse().unwrap(),
            followers: 0,
            topics: vec!["t".into()],
            ..Config::default()
        })
        .await
        .expect("the broker starts");
        // Each round: a fetch that waits 15 ms, an ApiVersions behind it.
        let round = |i: i32| {
            let fetch = wire::fetch("t", &[(0, 0)], Duration::from_millis(15), 1, 1 << 20);
            let mut both = raw_frame(&fetch, wire::FETCH_VERSION, 2 * i);
            both.extend(raw_frame(&ApiVersionsRequest::default(), 0, 2 * i + 1));
            both
        };
        let mut c = tokio::net::TcpStream::connect(b.addr).await.unwrap();
        // Warm up (the runtime's threads, the first connection's descriptors).
        c.write_all(&round(0)).await.unwrap();
        assert_eq!(answer_id(&mut c).await, Some(0));
        assert_eq!(answer_id(&mut c).await, Some(1));
        let before = open_descriptors();
        for i in 1..=100 {
            c.write_all(&round(i)).await.unwrap();
            assert_eq!(answer_id(&mut c).await, Some(2 * i));
            assert_eq!(answer_id(&mut c).await, Some(2 * i + 1));
        }
        assert!(
            open_descriptors() <= before,
            "descriptors left by answered requests"
        );
        // Clients hanging up while their fetch waits, half a frame behind it.
        for i in 0..30 {
            let mut c = tokio::net::TcpStream::connect(b.addr).await.unwrap();
            let long = wire::fetch("t", &[(0, 0)], Duration::from_secs(30), 1, 1 << 20);
            let mut both = raw_frame(&long, wire::FETCH_VERSION, i);
            both.extend_from_slice(&[0, 0]);
            c.write_all(&both).await.unwrap();
            let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
            while b.broker.fetches.delayed() == 0 {
                assert!(tokio::time::Instant::now() < deadline, "parked");
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            drop(c);
            while b.broker.fetches.delayed() > 0 {
                assert!(tokio::time::Instant::now() < deadline, "cancelled");
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
        // Each connection's task ends as it sees its hang-up.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while open_descriptors() > before {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{} descriptors open, {before} before",
                open_descriptors()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        drop(c);
        b.shutdown().await;
    })
    .await
    .expect("bounded");
}

// ---- groups and small APIs: what requests keep is bounded -----------------

#[path = "support/kafka_raw.rs"]
mod kafka_raw;

use kafka_protocol::error::ResponseError;
use kafka_protocol::messages::join_group_request::JoinGroupRequestProtocol;
use kafka_protocol::messages::metadata_request::MetadataRequestTopic;
use kafka_protocol::messages::sync_group_request::SyncGroupRequestAssignment;
use kafka_protocol::messages::{
    ApiVersionsRequest, JoinGroupRequest, MetadataRequest, SyncGroupRequest,
};

/// Runs a test body on a broker of `config` (listening on an ephemeral
/// port), one test at a time, bounded by a minute.
async fn alone_with<F: std::future::Future<Output = ()>>(
    config: Config,
    body: impl FnOnce(BrokerHandle) -> F,
) {
    let _alone = ONE_AT_A_TIME.lock().await;
    tokio::time::timeout(Duration::from_secs(60), async {
        let b = BrokerHandle::start(Config {
            listen: "127.0.0.1:0".parse().unwrap(),
            ..config
        })
        .await
        .expect("the broker starts");
        body(b).await
    })
    .await
    .expect("bounded");
}

fn join_req(group: &str, id: &str, session: i32, rebalance: i32) -> JoinGroupRequest {
    JoinGroupRequest::default()
        .with_group_id(GroupId(s(group)))
        .with_session_timeout_ms(session)
        .with_rebalance_timeout_ms(rebalance)
        .with_member_id(s(id))
        .with_protocol_type(s("consumer"))
        .with_protocols(vec![JoinGroupRequestProtocol::default()
            .with_name(s("range"))
            .with_metadata(bytes::Bytes::from_static(b"m"))])
}

/// A bystander's ApiVersions is answered within 5 s.
async fn bystander(b: &BrokerHandle) -> bool {
    tokio::time::timeout(Duration::from_secs(5), async {
        let mut w = Wire::connect(b.addr).await.ok()?;
        w.call(&ApiVersionsRequest::default(), 2).await.ok()
    })
    .await
    .ok()
    .flatten()
    .is_some_and(|r| r.error_code == 0)
}

/// Polls on the wall clock for up to `secs`.
async fn until(secs: u64, what: &str, cond: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    while !cond() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "waited too long until {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Waits (up to 10 s) until the live heap holds still: the same at four
/// looks 5 ms apart (tasks spawned, frames and answers dropped).
async fn heap_settled() {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut last = alloc::live_bytes();
    let mut same = 0;
    while same < 3 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "waited too long for the heap to settle"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
        let now = alloc::live_bytes();
        same = if now == last { same + 1 } else { 0 };
        last = now;
    }
}

/// Waits until every answer has been written and what its request was
/// charged given back (nothing charged: no request waits), then until the
/// heap holds still.
async fn answered_and_settled(b: &BrokerHandle) {
    until(10, "nothing is charged", || b.broker.budget.in_use() == 0).await;
    heap_settled().await;
}

/// Metadata for every topic is a ~20-byte request whose answer grows with
/// what the broker holds (here ~10 MB: 6,000 topics of 200-character names,
/// 16 partitions each), held until written (up to `frame_timeout`). It was
/// never charged to the memory budget, as fetch and offset fetch answers
/// are: 40 clients that asked and never read (small receive buffers) held
/// 312 MiB on a 64 MiB budget. Charged now, an answer with no room closes
/// its connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metadata_answers_are_charged_to_the_budget() {
    let budget = 64 << 20;
    let config = Config {
        partitions: 16,
        max_request_bytes: 8 << 20,
        max_decoded_bytes: 8 << 20,
        memory_budget: budget,
        ..Config::default()
    };
    alone_with(config, |b| async move {
        let mut w = Wire::connect(b.addr).await.unwrap();
        for chunk in 0..6 {
            let names: Vec<MetadataRequestTopic> = (0..1000)
                .map(|i| {
                    MetadataRequestTopic::default().with_name(Some(TopicName(s(&format!(
                        "{chunk}-{i:05}-{}",
                        "n".repeat(190)
                    )))))
                })
                .collect();
            let r = w
                .call(
                    &MetadataRequest::default()
                        .with_topics(Some(names))
                        .with_allow_auto_topic_creation(true),
                    9,
                )
                .await
                .unwrap();
            assert!(r.topics.iter().all(|t| t.error_code == 0));
        }
        drop(w);
        heap_settled().await;
        let before = alloc::live_bytes();
        let mut socks = vec![];
        for i in 0..40 {
            let sock = tokio::net::TcpSocket::new_v4().unwrap();
            sock.set_recv_buffer_size(4096).unwrap();
            let mut st = sock.connect(b.addr).await.unwrap();
            let all = MetadataRequest::default().with_topics(None);
            tokio::io::AsyncWriteExt::write_all(&mut st, &kafka_raw::frame(&all, 1, i))
                .await
                .unwrap();
            socks.push(st);
        }
        let mut most = 0;
        // Sampled over 3 s of real time: the answers are held until written
        // or their frame timeout, and the most they hold at once is measured.
        for _ in 0..30 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            most = most.max(alloc::live_bytes() - before);
        }
        assert!(bystander(&b).await);
        assert!(
            most <= budget as isize + (8 << 20),
            "40 unread Metadata answers hold {} MiB (budget {} MiB)",
            most >> 20,
            budget >> 20
        );
        drop(socks);
        b.shutdown().await;
    })
    .await
}

/// Kafka's generated decoders refuse any string longer than 0x7fff bytes
/// (`"string field groupId had invalid length"`), compact ones included, and
/// Kafka closes the connection of a request it cannot parse. Compact
/// (flexible-version) strings here could be as long as the frame: 16 commits
/// (OffsetCommit v8) to groups whose ids were 4 MiB each kept 64 MiB for as
/// long as the broker runs, and 16 v7 joins (two-step, pending ids held for
/// the session) as much again. Now each connection is closed, nothing kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlong_compact_group_ids_are_not_kept() {
    let config = Config {
        topics: vec!["t".into()],
        ..Config::default()
    };
    alone_with(config, |b| async move {
        heap_settled().await;
        let before = alloc::live_bytes();
        let mut kept = 0;
        for i in 0..16 {
            let g = format!("{i:02}{}", "g".repeat(4 << 20));
            let mut w = Wire::connect(b.addr).await.unwrap();
            let commit = OffsetCommitRequest::default()
                .with_group_id(GroupId(s(&g)))
                .with_generation_id_or_member_epoch(-1)
                .with_topics(vec![OffsetCommitRequestTopic::default()
                    .with_name(TopicName(s("t")))
                    .with_partitions(vec![OffsetCommitRequestPartition::default()
                        .with_partition_index(0)
                        .with_committed_offset(1)])]);
            if w.call(&commit, 8).await.is_ok() {
                kept += 1;
            }
            let g = format!("j{i:02}{}", "g".repeat(4 << 20));
            let mut w = Wire::connect(b.addr).await.unwrap();
            if w.call(&join_req(&g, "", 1_800_000, 1000), 7).await.is_ok() {
                kept += 1;
            }
        }
        heap_settled().await;
        let grown = alloc::live_bytes() - before;
        assert!(bystander(&b).await);
        assert!(
            kept == 0 && grown < 4 << 20,
            "group ids of 4 MiB: {kept} requests answered, {} MiB held",
            grown >> 20
        );
        // At the limit, a group id is taken.
        let mut w = Wire::connect(b.addr).await.unwrap();
        let g = "g".repeat(0x7fff);
        let r = w.call(&join_req(&g, "", 10_000, 1000), 7).await.unwrap();
        assert_eq!(r.error_code, ResponseError::MemberIdRequired.code());
        b.shutdown().await;
    })
    .await
}

/// A JoinGroup that waits for its round (up to its rebalance timeout,
/// i32::MAX ms, 24.8 days) kept its whole frame charged to the memory
/// budget until it was answered, though nothing of the frame is used after
/// decoding (here 15 MiB of a tagged field the decoder keeps and the
/// coordinator ignores). Kafka releases a request's buffer once its handler
/// returns (`finally request.releaseBuffer()`), before the join waits. Four
/// such joins and a partial frame took the whole 64 MiB budget, and a
/// bystander's ApiVersions then waited for memory that did not come back.
/// A parked join now keeps only what it holds; so does a parked sync, and a
/// parked fetch (checked in `a_parked_fetch_holds_no_more_than_its_charge`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_joins_and_syncs_do_not_hold_the_budget() {
    let config = Config {
        memory_budget: 64 << 20,
        max_request_bytes: 16 << 20,
        max_decoded_bytes: 16 << 20,
        groups: broker::groups::GroupLimits {
            min_session: Duration::from_millis(50),
            ..Default::default()
        },
        ..Config::default()
    };
    alone_with(config, |b| async move {
        let padded = |r: JoinGroupRequest, i: usize| {
            let mut r = r;
            let pad = bytes::Bytes::from(vec![i as u8; 15 << 20]);
            r.unknown_tagged_fields.insert(1000, pad);
            r
        };
        // A stable member that does not rejoin: the joins wait.
        let mut w = Wire::connect(b.addr).await.unwrap();
        let r = w.call(&join_req("g", "", 60_000, 300), 3).await.unwrap();
        let (leader, gen) = (r.member_id.to_string(), r.generation_id);
        let sync = SyncGroupRequest::default()
            .with_group_id(GroupId(s("g")))
            .with_generation_id(gen)
            .with_member_id(s(&leader));
        assert_eq!(w.call(&sync, 3).await.unwrap().error_code, 0);
        let mut parked = vec![];
        for i in 0..4 {
            let mut c = Wire::connect(b.addr).await.unwrap();
            let first = c
                .call(&join_req("g", "", 60_000, i32::MAX), 6)
                .await
                .unwrap();
            assert_eq!(first.error_code, ResponseError::MemberIdRequired.code());
            let req = padded(join_req("g", &first.member_id, 60_000, i32::MAX), i);
            c.send(&req, 6).await.unwrap();
            parked.push(c);
            until(10, "the join parked", || {
                b.broker.groups.joins.delayed() == i + 1
            })
            .await;
        }
        let in_use = b.broker.budget.in_use();
        assert!(
            in_use < 1 << 20,
            "4 parked joins of 15 MiB frames hold {in_use} bytes of the budget"
        );
        // The rest of the budget, taken by a frame that arrives slowly.
        let mut slow = tokio::net::TcpStream::connect(b.addr).await.unwrap();
        use tokio::io::AsyncWriteExt;
        slow.write_all(&(15i32 << 20).to_be_bytes()).await.unwrap();
        slow.write_all(&vec![0u8; 6 << 20]).await.unwrap_or(());
        assert!(bystander(&b).await, "a bystander is answered");
        // The leader rejoins: the round ends; a follower's sync (15 MiB of
        // padding) waits for the leader's, holding none of its frame.
        let r = w
            .call(&join_req("g", &leader, 60_000, 300), 3)
            .await
            .unwrap();
        assert_eq!(r.error_code, 0);
        let gen = r.generation_id;
        let mut f = parked.pop().unwrap();
        let fr = f.receive::<JoinGroupRequest>(6).await.unwrap();
        assert_eq!((fr.error_code, fr.generation_id), (0, gen));
        let mut fsync = SyncGroupRequest::default()
            .with_group_id(GroupId(s("g")))
            .with_generation_id(gen)
            .with_member_id(fr.member_id.clone());
        fsync
            .unknown_tagged_fields
            .insert(1000, bytes::Bytes::from(vec![9u8; 15 << 20]));
        f.send(&fsync, 4).await.unwrap();
        until(10, "the sync parked", || {
            b.broker.groups.syncs.delayed() == 1
        })
        .await;
        let in_use = b.broker.budget.in_use();
        // The slow frame holds 8 MiB (its buffer doubles as it arrives).
        assert!(
            in_use < 9 << 20,
            "a parked sync of a 15 MiB frame (and the slow frame) hold {in_use} bytes"
        );
        let lsync = SyncGroupRequest::default()
            .with_group_id(GroupId(s("g")))
            .with_generation_id(gen)
            .with_member_id(s(&leader))
            .with_assignments(vec![SyncGroupRequestAssignment::default()
                .with_member_id(fr.member_id.clone())
                .with_assignment(bytes::Bytes::from_static(b"x"))]);
        assert_eq!(w.call(&lsync, 3).await.unwrap().error_code, 0);
        let fs = f.receive::<SyncGroupRequest>(4).await.unwrap();
        assert_eq!((fs.error_code, &fs.assignment[..]), (0, &b"x"[..]));
        drop((parked, slow));
        b.shutdown().await;
    })
    .await
}

/// Member ids handed out and not joined yet (KIP-394, MEMBER_ID_REQUIRED)
/// are kept up to a session (30 min at most), about 470 bytes each: the
/// coordinator could hold `max_groups` x `max_members` (1000 x 1000) of them,
/// 450 MiB, outside every byte bound. They are counted in `max_kept_bytes`
/// now: with it at 2 MiB, a flood of first-step joins is refused
/// COORDINATOR_LOAD_IN_PROGRESS once the ids given out reach it, and the
/// heap holds no more than the bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_member_ids_are_bounded_in_bytes() {
    let bound = 2 << 20;
    let config = Config {
        groups: broker::groups::GroupLimits {
            max_kept_bytes: bound,
            ..Default::default()
        },
        ..Config::default()
    };
    alone_with(config, |b| async move {
        let mut st = tokio::net::TcpStream::connect(b.addr).await.unwrap();
        // Warm up (one group, one id) so the counted growth is per id.
        let mut w = Wire::connect(b.addr).await.unwrap();
        w.call(&join_req("warm", "", 600_000, 1000), 5)
            .await
            .unwrap();
        let before = alloc::live_bytes();
        let (mut given, mut refused, mut id) = (0, 0, 0);
        let client = "c".repeat(64); // the longest kept in a member id
        for g in 0..10 {
            let mut out = Vec::new();
            for _ in 0..1000 {
                id += 1;
                let join = join_req(&format!("p{g}"), "", 1_800_000, 1000);
                out.extend(kafka_raw::frame_from(&client, &join, 5, id));
            }
            tokio::io::AsyncWriteExt::write_all(&mut st, &out)
                .await
                .unwrap();
            for _ in 0..1000 {
                let (_, r) = kafka_raw::read_answer::<JoinGroupRequest>(&mut st, 5)
                    .await
                    .unwrap();
                match r.error_code {
                    c if c == ResponseError::MemberIdRequired.code() => given += 1,
                    c if c == ResponseError::CoordinatorLoadInProgress.code() => refused += 1,
                    c => panic!("error {c}"),
                }
            }
        }
        heap_settled().await;
        let grown = alloc::live_bytes() - before;
        assert!(bystander(&b).await);
        assert!(
            refused > 0 && grown <= bound as isize,
            "{given} pending ids given ({refused} refused) hold {grown} bytes (bound {bound})"
        );
        b.shutdown().await;
    })
    .await
}

/// A group id may be 32,767 bytes. The coordinator keeps one copy of it, the
/// groups' map's key, shared by whatever of the group is kept: every
/// JoinGroup used to make a copy of its own, kept by each member id handed
/// out (its expiry timer), each member's session timer and each join that
/// waits, none of it charged (a pending id is charged `PENDING_COST` and its
/// id, a parked join its own size and member id). With a 32,000-byte group
/// id, 200 pending ids held 32,270 bytes each and 50 parked joins 36,327
/// each: at the defaults, some 126,000 pending ids fit in `max_kept_bytes`,
/// about 4 GB. Measured on the live heap: each now holds what it is charged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_group_id_is_kept_once() {
    let config = Config {
        groups: broker::groups::GroupLimits {
            min_session: Duration::from_millis(50),
            ..Default::default()
        },
        ..Config::default()
    };
    alone_with(config, |b| async move {
        let g = "g".repeat(0x7fff);
        // Pending member ids (KIP-394), each kept for its session.
        let mut w = Wire::connect(b.addr).await.unwrap();
        let first = w.call(&join_req(&g, "", 600_000, 1000), 5).await.unwrap();
        assert_eq!(first.error_code, ResponseError::MemberIdRequired.code());
        let before = alloc::live_bytes();
        for _ in 0..200 {
            let r = w.call(&join_req(&g, "", 600_000, 1000), 5).await.unwrap();
            assert_eq!(r.error_code, ResponseError::MemberIdRequired.code());
        }
        answered_and_settled(&b).await;
        let grown = alloc::live_bytes() - before;
        assert!(
            grown < 200 * 1024,
            "200 pending ids of a 32 KiB group id hold {grown} bytes"
        );
        drop(w);
        // Joins that wait for their round (up to its rebalance timeout): a
        // stable member that does not rejoin.
        let h = "h".repeat(0x7fff);
        let mut w = Wire::connect(b.addr).await.unwrap();
        let r = w.call(&join_req(&h, "", 600_000, 300), 3).await.unwrap();
        assert_eq!(r.error_code, 0);
        let sync = SyncGroupRequest::default()
            .with_group_id(GroupId(s(&h)))
            .with_generation_id(r.generation_id)
            .with_member_id(r.member_id.clone());
        assert_eq!(w.call(&sync, 3).await.unwrap().error_code, 0);
        // Each on a connection of its own, set up before measuring.
        let mut parked = vec![];
        for _ in 0..50 {
            parked.push(Wire::connect(b.addr).await.unwrap());
        }
        answered_and_settled(&b).await;
        let before = alloc::live_bytes();
        for (i, c) in parked.iter_mut().enumerate() {
            c.send(&join_req(&h, "", 600_000, 600_000), 3)
                .await
                .unwrap();
            until(10, "the join parked", || {
                b.broker.groups.joins.delayed() == i + 1
            })
            .await;
        }
        // (Each parked join keeps its own state, charged: the heap only.)
        heap_settled().await;
        let grown = alloc::live_bytes() - before;
        assert!(
            grown < 50 * 8 * 1024,
            "50 parked joins to a 32 KiB group id hold {grown} bytes"
        );
        drop((parked, w));
        b.shutdown().await;
    })
    .await
}

/// A fetch or an `acks=-1` produce that waits keeps no more than it is
/// charged: the maps that found its distinct partitions (by topic and
/// partition) used to stay alive across the wait, uncharged, its lists'
/// spare room was left out of its charge, and a watch was counted 64 bytes
/// when a key's first makes its list (measured: 135 bytes held per
/// partition of a waiting fetch, 104 charged; a lone fetch of 10,000
/// partitions held 2.8 MB, 1 MB charged). Here a fetch and then a produce of
/// 10,000 partitions each wait, the first to watch their partitions; what
/// the heap gives back when they are answered is within what they were
/// charged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_fetches_and_produces_hold_what_they_are_charged() {
    use kafka_protocol::messages::fetch_request::{FetchPartition, FetchTopic};
    use kafka_protocol::messages::{BrokerId, FetchRequest, ProduceRequest};
    let parts = 10_000;
    let config = Config {
        topics: vec!["t".into()],
        partitions: parts,
        // A follower that copies nothing: the produce waits. (Its queue of
        // copies to make stays as it is while it does: its first copy waits
        // for the lag.)
        followers: 1,
        stuck_follower: Some(0),
        replica_lag: Duration::from_secs(3600),
        max_produce_wait: Duration::from_millis(1000),
        ..Config::default()
    };
    alone_with(config, |b| async move {
        let fetch = FetchRequest::default()
            .with_replica_id(BrokerId(-1))
            .with_max_wait_ms(500)
            .with_min_bytes(1)
            .with_max_bytes(1 << 20)
            .with_session_epoch(-1)
            .with_topics(vec![FetchTopic::default()
                .with_topic(TopicName(s("t")))
                .with_partitions(
                    (0..parts)
                        .map(|i| {
                            FetchPartition::default()
                                .with_partition(i)
                                .with_fetch_offset(0)
                                .with_partition_max_bytes(1 << 20)
                        })
                        .collect(),
                )]);
        let produce = to_every_partition(parts, b"v").with_acks(-1);
        let mut c = Wire::connect(b.addr).await.unwrap();
        for fetches in [true, false] {
            let what = if fetches { "fetch" } else { "produce" };
            // The last request's watch-list entries purged first (the reaper
            // purges them over a few turns once nothing is pending): memory
            // they give back while this request waits would count as held.
            until(10, "nothing is left to purge", || {
                let (f, p) = (b.broker.fetches.metrics(), b.broker.produces.metrics());
                f.tombstones + p.tombstones + f.watched + p.watched == 0
            })
            .await;
            heap_settled().await;
            if fetches {
                c.send(&fetch, wire::FETCH_VERSION).await.unwrap();
            } else {
                c.send(&produce, wire::PRODUCE_VERSION).await.unwrap();
            }
            until(10, "it waits", || {
                if fetches {
                    b.broker.fetches.delayed() == 1
                } else {
                    b.broker.produces.delayed() == 1
                }
            })
            .await;
            until(10, "its watches are registered", || {
                if fetches {
                    b.broker.fetches.metrics().watched == parts as usize
                } else {
                    b.broker.produces.metrics().watched == parts as usize
                }
            })
            .await;
            let (parked, charged) = (alloc::live_bytes(), b.broker.budget.in_use() as isize);
            // Measured while it still waits.
            assert_eq!(
                if fetches {
                    b.broker.fetches.delayed()
                } else {
                    b.broker.produces.delayed()
                },
                1,
                "the {what} still waits"
            );
            if fetches {
                let r = c
                    .receive::<FetchRequest>(wire::FETCH_VERSION)
                    .await
                    .unwrap();
                assert_eq!(r.responses[0].partitions.len(), parts as usize);
            } else {
                let r = c
                    .receive::<ProduceRequest>(wire::PRODUCE_VERSION)
                    .await
                    .unwrap();
                assert_eq!(r.responses[0].partition_responses.len(), parts as usize);
            }
            answered_and_settled(&b).await;
            let held = parked - alloc::live_bytes();
            assert!(
                held <= charged,
                "a waiting {what} of {parts} partitions held {held} bytes, {charged} charged"
            );
        }
        b.shutdown().await;
    })
    .await
}

/// A fetch or `acks=-1` produce whose waiting state needs more of the
/// memory budget than its frame was charged (a watch per distinct
/// partition) takes the rest from the budget; with no room there it is
/// answered at once, as when its wait is over (a fetch with what there is, a
/// produce REQUEST_TIMED_OUT for what is not replicated), not left to wait
/// undercharged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_with_no_room_in_the_budget_is_answered_at_once() {
    use kafka_protocol::messages::fetch_request::{FetchPartition, FetchTopic};
    use kafka_protocol::messages::{BrokerId, FetchRequest};
    let parts = 10_000;
    let config = Config {
        topics: vec!["t".into()],
        partitions: parts,
        followers: 1,
        stuck_follower: Some(0),
        replica_lag: Duration::from_secs(3600),
        max_produce_wait: Duration::from_secs(60),
        memory_budget: 2 << 20,
        max_request_bytes: 1 << 20,
        max_decoded_bytes: 1 << 20,
        ..Config::default()
    };
    alone_with(config, |b| async move {
        let fetch = FetchRequest::default()
            .with_replica_id(BrokerId(-1))
            .with_max_wait_ms(60_000)
            .with_min_bytes(1)
            .with_max_bytes(1 << 20)
            .with_session_epoch(-1)
            .with_topics(vec![FetchTopic::default()
                .with_topic(TopicName(s("t")))
                .with_partitions(
                    (0..parts)
                        .map(|i| {
                            FetchPartition::default()
                                .with_partition(i)
                                .with_fetch_offset(0)
                                .with_partition_max_bytes(1 << 20)
                        })
                        .collect(),
                )]);
        let mut c = Wire::connect(b.addr).await.unwrap();
        let produce = to_every_partition(parts, b"v").with_acks(-1);
        let (r, codes) = tokio::time::timeout(Duration::from_secs(20), async {
            let r = c.call(&fetch, wire::FETCH_VERSION).await.unwrap();
            let p = c.call(&produce, wire::PRODUCE_VERSION).await.unwrap();
            let codes: std::collections::BTreeSet<i16> = p.responses[0]
                .partition_responses
                .iter()
                .map(|p| p.error_code)
                .collect();
            (r, codes)
        })
        .await
        .expect("answered at once, not after their 60 s waits");
        assert_eq!(r.responses[0].partitions.len(), parts as usize);
        assert_eq!(codes, [ResponseError::RequestTimedOut.code()].into());
        assert!(bystander(&b).await);
        b.shutdown().await;
    })
    .await
}

/// A zstd frame declaring a 1 KiB window, of a raw 1-byte block then one
/// compressed block of `n` RLE-mode sequences (no literals, offset 1, match
/// length 65,539): some 2.25 bytes a sequence, each making 64 KiB. The
/// format allows a block to make at most 128 KiB; ruzstd 0.8 does not check,
/// and decodes the whole block before its first byte can be read.
fn zstd_bomb(n: usize) -> Vec<u8> {
    assert!(n.is_multiple_of(4) && (128..0x7f00).contains(&n));
    // Magic; no content size, a 1 KiB window.
    let mut f = vec![0x28, 0xb5, 0x2f, 0xfd, 0x00, 0x00];
    // A raw block of one byte, not the last.
    f.extend([0x08, 0x00, 0x00, b'A']);
    // Raw literals, none; the sequence count in two bytes; every code RLE.
    let mut c = vec![0x00, ((n >> 8) + 128) as u8, n as u8, 0x54];
    // Literal length code 0, offset code 2 (offset 1), match length code 52.
    c.extend([0u8, 2, 52]);
    // 18 extra bits a sequence, all zero, then the stream's end mark.
    c.extend(std::iter::repeat_n(0u8, 18 * n / 8));
    c.push(0x01);
    // The last block, compressed.
    let header = 1u32 | (2 << 1) | ((c.len() as u32) << 3);
    f.extend(&header.to_le_bytes()[..3]);
    f.extend(&c);
    f
}

/// A zstd batch is never decoded to read its records' timestamps (see the
/// broker's `timestamps`): a 2.3 KB frame that ruzstd decodes to 64 MiB
/// before its first byte can be read (and frames like it to gigabytes, or to
/// a panic), stored as Kafka stores it (its CRC is right), is answered at
/// batch granularity by a lookup by time and by `MAX_TIMESTAMP`, with no
/// large allocation and nothing left charged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zstd_bomb_is_never_decoded() {
    use bytes::BufMut;
    use kafka_protocol::messages::list_offsets_request::{ListOffsetsPartition, ListOffsetsTopic};
    use kafka_protocol::messages::{BrokerId, ListOffsetsRequest};
    use kafka_protocol::records::{Compression, Record, RecordBatchEncoder, RecordEncodeOptions};
    let _alone = ONE_AT_A_TIME.lock().await;
    tokio::time::timeout(Duration::from_secs(60), async {
        let b = BrokerHandle::start(Config {
            listen: "127.0.0.1:0".parse().unwrap(),
            followers: 0,
            topics: vec!["t".into()],
            ..Config::default()
        })
        .await
        .expect("the broker starts");
        let t0 = 1_700_000_000_000i64;
        let records: Vec<Record> = [t0, t0 + 10]
            .iter()
            .enumerate()
            .map(|(i, &timestamp)| wire::record(i, i as i32 - 1, timestamp, b"v".to_vec().into()))
            .collect();
        let bomb = zstd_bomb(1024);
        assert!(bomb.len() < 2_400, "{}", bomb.len());
        let mut batch = bytes::BytesMut::new();
        RecordBatchEncoder::encode_with_custom_compression(
            &mut batch,
            &records,
            &RecordEncodeOptions {
                version: 2,
                compression: Compression::Zstd,
            },
            Some(|_: &mut bytes::BytesMut, out: &mut bytes::BytesMut, _| {
                out.put_slice(&bomb);
                Ok(())
            }),
        )
        .expect("the batch encodes");
        let mut w = Wire::connect(b.addr).await.unwrap();
        let r = w
            .call(
                &wire::produce("t", 0, -1, Duration::from_secs(5), batch.freeze()),
                wire::PRODUCE_VERSION,
            )
            .await
            .unwrap();
        assert_eq!(wire::produce_error(&r), 0, "stored");
        let before = BIG_ONES.load(Ordering::Relaxed);
        for ts in [t0 + 5, -3] {
            let ask = ListOffsetsRequest::default()
                .with_replica_id(BrokerId(-1))
                .with_topics(vec![ListOffsetsTopic::default()
                    .with_name(TopicName(s("t")))
                    .with_partitions(vec![ListOffsetsPartition::default()
                        .with_partition_index(0)
                        .with_timestamp(ts)])]);
            let r = w.call(&ask, 7).await.unwrap();
            let p = &r.topics[0].partitions[0];
            assert_eq!(
                (p.error_code, p.offset, p.timestamp),
                (0, 0, t0 + 10),
                "{ts}: at batch granularity"
            );
        }
        let big = BIG_ONES.load(Ordering::Relaxed) - before;
        assert_eq!(big, 0, "{big} allocations of 1 MiB or more");
        until(10, "nothing is left charged", || {
            b.broker.budget.in_use() == 0
        })
        .await;
        b.shutdown().await;
    })
    .await
    .expect("bounded");
}

/// The first record's timestamp in the batches built below; record `i` is
/// stamped `T0 + 5 * i`.
const T0: i64 = 1_700_000_000_000;

/// A v2 batch of `values`, record `i` stamped `T0 + 5 * i`, under `codec`,
/// its records packed by `pack` (which may ignore them: a bomb).
fn packed_batch(
    values: &[Vec<u8>],
    codec: kafka_protocol::records::Compression,
    pack: impl Fn(&[u8]) -> Vec<u8>,
) -> bytes::Bytes {
    use bytes::BufMut;
    use kafka_protocol::records::{Record, RecordBatchEncoder, RecordEncodeOptions};
    let records: Vec<Record> = values
        .iter()
        .enumerate()
        .map(|(i, v)| wire::record(i, i as i32 - 1, T0 + 5 * i as i64, v.clone().into()))
        .collect();
    let mut out = bytes::BytesMut::new();
    RecordBatchEncoder::encode_with_custom_compression(
        &mut out,
        &records,
        &RecordEncodeOptions {
            version: 2,
            compression: codec,
        },
        Some(
            |plain: &mut bytes::BytesMut, out: &mut bytes::BytesMut, _| {
                out.put_slice(&pack(plain));
                Ok(())
            },
        ),
    )
    .expect("the batch encodes");
    out.freeze()
}

/// Snappy in xerial framing (as Kafka's Java clients write it), `blocks`
/// each an int32 size then raw snappy.
fn xerial(blocks: &[Vec<u8>]) -> Vec<u8> {
    let mut v = vec![
        0x82, b'S', b'N', b'A', b'P', b'P', b'Y', 0, 0, 0, 0, 1, 0, 0, 0, 1,
    ];
    for b in blocks {
        v.extend((b.len() as u32).to_be_bytes());
        v.extend(b);
    }
    v
}

/// A raw snappy block of 6 bytes claiming `claim` bytes: its length, then a
/// 1-byte literal.
fn snappy_claim(claim: usize) -> Vec<u8> {
    let mut v = Vec::new();
    let mut n = claim;
    while n >= 0x80 {
        v.push((n & 0x7f) as u8 | 0x80);
        n >>= 7;
    }
    v.push(n as u8);
    v.extend([0x00, b'x']);
    v
}

fn snappy(plain: &[u8]) -> Vec<u8> {
    snap::raw::Encoder::new().compress_vec(plain).unwrap()
}

/// An LZ4 frame of `plain` declaring 4 MiB blocks, independent or linked.
fn lz4_4mib(plain: &[u8], linked: bool) -> Vec<u8> {
    use lz4_flex::frame::{BlockMode, BlockSize, FrameEncoder, FrameInfo};
    use std::io::Write;
    let mode = if linked {
        BlockMode::Linked
    } else {
        BlockMode::Independent
    };
    let info = FrameInfo::new()
        .block_size(BlockSize::Max4MB)
        .block_mode(mode);
    let mut e = FrameEncoder::with_frame_info(info, Vec::new());
    e.write_all(plain).unwrap();
    e.finish().unwrap()
}

/// Reading a compressed batch's records for their timestamps takes what
/// its codec makes before any of it is read from the lookup's read bound
/// first, and decodes nothing past it: a snappy block (raw, or in xerial
/// framing) claiming more than is left, or more than its bytes can make,
/// is refused before its buffer is sized (a 6-byte block claiming 120 MiB
/// once had each lookup zero 120 MiB, checked only against the free memory
/// budget), and an LZ4 frame's buffers, as its header sizes them, are taken
/// whole. `first_record` is called directly, its thread's heap measured.
#[test]
fn codec_claims_are_taken_from_the_read_bound_before_decoding() {
    use broker::timestamps::{first_record, Limits, Scan};
    use kafka_protocol::records::Compression;
    const HEADER: usize = 61;
    let _alone = ONE_AT_A_TIME.blocking_lock();
    let budget = broker::Budget::new(256 << 20);
    // The scan of `batch` with `read_left`: what it found, what is left of
    // the bound, and how far this thread's heap grew meanwhile.
    let scan = |batch: &bytes::Bytes, read_left: usize| {
        let mut limits = Limits {
            read_left,
            budget: &budget,
        };
        let at = alloc::reset_peak_here();
        let found = first_record(batch, 0, &mut limits, |ts| ts > T0);
        let grew = alloc::peak_here() - at;
        assert_eq!(budget.in_use(), 0, "the codec's charge given back");
        (found, limits.read_left, grew)
    };
    let small = 64 << 10;
    let values = || vec![vec![0u8; 2 << 20], b"z".to_vec()];
    let found = Scan::Found(1, T0 + 5);

    // Bombs: 6 bytes claiming 120 MiB, whatever the bound.
    let bomb = snappy_claim(120 << 20);
    for (what, batch) in [
        (
            "xerial",
            packed_batch(&values(), Compression::Snappy, |_| {
                xerial(std::slice::from_ref(&bomb))
            }),
        ),
        (
            "raw",
            packed_batch(&values(), Compression::Snappy, |_| bomb.clone()),
        ),
    ] {
        let (got, _, grew) = scan(&batch, usize::MAX);
        assert_eq!(got, Scan::Unreadable, "{what} bomb");
        assert!(grew < small, "{what} bomb: the heap grew by {grew}");
    }

    // Honest snappy blocks of 2 MiB: refused undecoded one byte short of
    // their claim, read per record with it, the claim taken whole.
    for xerial_framed in [true, false] {
        let claim = std::cell::Cell::new(0);
        let batch = packed_batch(&values(), Compression::Snappy, |plain| {
            let block = snappy(plain);
            claim.set(snap::raw::decompress_len(&block).unwrap());
            if xerial_framed {
                xerial(&[block])
            } else {
                block
            }
        });
        let claim = claim.get();
        assert!(batch.len() < claim / 16, "{} bytes", batch.len());
        let (got, left, grew) = scan(&batch, HEADER + claim - 1);
        assert_eq!(got, Scan::Unreadable, "xerial {xerial_framed}");
        assert_eq!(left, claim - 1, "nothing taken but the header");
        assert!(grew < small, "xerial {xerial_framed}: grew by {grew}");
        let (got, left, _) = scan(&batch, 64 << 20);
        assert_eq!(got, found, "xerial {xerial_framed}");
        assert!(left <= (64 << 20) - HEADER - claim, "{left} left");
    }

    // LZ4 frames declaring 4 MiB blocks, of a few bytes: the decoder zeroes
    // one block (independent) or two and the 64 KiB window (linked), and
    // decodes a block at once.
    let mib = 1usize << 20;
    for (linked, ahead) in [(false, 8 * mib), (true, 12 * mib + (64 << 10))] {
        let values = vec![b"y".to_vec(), b"z".to_vec()];
        let batch = packed_batch(&values, Compression::Lz4, |plain| lz4_4mib(plain, linked));
        assert!(batch.len() < 200, "{} bytes", batch.len());
        let (got, left, grew) = scan(&batch, HEADER + ahead - 1);
        assert_eq!(got, Scan::Unreadable, "linked {linked}");
        assert_eq!(left, ahead - 1, "nothing taken but the header");
        assert!(grew < small, "linked {linked}: grew by {grew}");
        let (got, left, _) = scan(&batch, 64 << 20);
        assert_eq!(got, found, "linked {linked}");
        assert!(left <= (64 << 20) - HEADER - ahead, "{left} left");
    }
}

/// ListOffsets by time over thirty partitions each holding a 91-byte snappy
/// batch in xerial framing whose block claims 120 MiB (which once had every
/// lookup zero 120 MiB on a runtime worker, seconds a request) answers each
/// at batch granularity with no allocation of 1 MiB or more and nothing
/// left charged; and over thirty partitions of honest batches of 4 MiB of
/// records (196 KiB of snappy each), one request decompresses no more than
/// its bound (64 times `max_message_bytes`) across them: the partitions
/// whose claims fit in it are read per record, in order, the rest answered
/// at batch granularity without being decompressed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_offsets_decompresses_within_one_bound_across_partitions() {
    use kafka_protocol::messages::list_offsets_request::{ListOffsetsPartition, ListOffsetsTopic};
    use kafka_protocol::messages::produce_request::{PartitionProduceData, TopicProduceData};
    use kafka_protocol::messages::{BrokerId, ListOffsetsRequest, ProduceRequest};
    use kafka_protocol::records::Compression;
    const PARTS: i32 = 30;
    const HEADER: usize = 61;
    let _alone = ONE_AT_A_TIME.lock().await;
    tokio::time::timeout(Duration::from_secs(60), async {
        let b = BrokerHandle::start(Config {
            listen: "127.0.0.1:0".parse().unwrap(),
            followers: 0,
            partitions: PARTS,
            topics: vec!["bombs".into(), "honest".into()],
            ..Config::default()
        })
        .await
        .expect("the broker starts");
        let values = vec![vec![0u8; 4 << 20], b"z".to_vec()];
        let bomb = packed_batch(&values, Compression::Snappy, |_| {
            xerial(&[snappy_claim(120 << 20)])
        });
        assert!(bomb.len() < 100, "{}", bomb.len());
        let claim = std::cell::Cell::new(0);
        let honest = packed_batch(&values, Compression::Snappy, |plain| {
            let block = snappy(plain);
            claim.set(snap::raw::decompress_len(&block).unwrap());
            xerial(&[block])
        });
        let claim = claim.get();
        let mut w = Wire::connect(b.addr).await.unwrap();
        for (topic, batch) in [("bombs", &bomb), ("honest", &honest)] {
            let produce = ProduceRequest::default()
                .with_acks(1)
                .with_timeout_ms(5000)
                .with_topic_data(vec![TopicProduceData::default()
                    .with_name(TopicName(s(topic)))
                    .with_partition_data(
                        (0..PARTS)
                            .map(|p| {
                                PartitionProduceData::default()
                                    .with_index(p)
                                    .with_records(Some(batch.clone()))
                            })
                            .collect(),
                    )]);
            let r = w.call(&produce, 7).await.unwrap();
            assert_eq!(produce_errors(&r), 0, "{topic}: stored");
        }
        let ask = |topic: &str| {
            ListOffsetsRequest::default()
                .with_replica_id(BrokerId(-1))
                .with_topics(vec![ListOffsetsTopic::default()
                    .with_name(TopicName(s(topic)))
                    .with_partitions(
                        (0..PARTS)
                            .map(|p| {
                                ListOffsetsPartition::default()
                                    .with_partition_index(p)
                                    .with_timestamp(T0 + 1)
                            })
                            .collect(),
                    )])
        };
        let answers = |r: &kafka_protocol::messages::ListOffsetsResponse| -> Vec<(i16, i64, i64)> {
            r.topics[0]
                .partitions
                .iter()
                .map(|p| (p.error_code, p.offset, p.timestamp))
                .collect()
        };
        // Per record: offset 1, its own timestamp. At batch granularity:
        // the batch's first offset and its newest timestamp.
        let per_record = (0, 1, T0 + 5);
        let per_batch = (0, 0, T0 + 5);
        let before = BIG_ONES.load(Ordering::Relaxed);
        let r = w.call(&ask("bombs"), 7).await.unwrap();
        let big = BIG_ONES.load(Ordering::Relaxed) - before;
        assert_eq!(answers(&r), vec![per_batch; PARTS as usize]);
        assert_eq!(big, 0, "{big} allocations of 1 MiB or more");
        until(10, "nothing is left charged", || {
            b.broker.budget.in_use() == 0
        })
        .await;
        let bound = 64 * b.broker.config.max_message_bytes;
        let fit = bound / (HEADER + claim);
        assert!((1..PARTS as usize).contains(&fit), "{fit}");
        let r = w.call(&ask("honest"), 7).await.unwrap();
        let mut want = vec![per_record; fit];
        want.resize(PARTS as usize, per_batch);
        assert_eq!(
            answers(&r),
            want,
            "{fit} claims of {claim} bytes fit in the request's {bound}"
        );
        until(10, "nothing is left charged", || {
            b.broker.budget.in_use() == 0
        })
        .await;
        b.shutdown().await;
    })
    .await
    .expect("bounded");
}

/// The budget of the group answer tests: a 7 MiB answer fits, two do not.
const ANSWERS_BUDGET: usize = 10 << 20;

fn group_answers_config() -> Config {
    Config {
        max_request_bytes: 8 << 20,
        max_decoded_bytes: 1 << 20,
        memory_budget: ANSWERS_BUDGET,
        groups: broker::groups::GroupLimits {
            min_session: Duration::from_millis(50),
            ..Default::default()
        },
        ..Config::default()
    }
}

fn join_with(id: &str, metadata: bytes::Bytes) -> JoinGroupRequest {
    join_req("g", id, 30_000, 30_000).with_protocols(vec![JoinGroupRequestProtocol::default()
        .with_name(s("range"))
        .with_metadata(metadata)])
}

/// Sends `request` on eight connections that do not read their answers,
/// waits until the broker has answered all eight and its heap holds still,
/// and checks that the heap grew by less than the budget; then reads each
/// answer (each, its `answer` or `refused`), checks that each is one of the
/// two and that both were given, and returns the answers given whole.
async fn eight_unread<R>(
    b: &BrokerHandle,
    request: &R,
    version: i16,
    error: impl Fn(&R::Response) -> i16,
    refused: ResponseError,
) -> Vec<R::Response>
where
    R: kafka_protocol::protocol::Request,
{
    use std::sync::atomic::Ordering::Relaxed;
    answered_and_settled(b).await;
    let before = alloc::live_bytes();
    let asked = b.broker.stats.requests.load(Relaxed);
    let mut conns = Vec::new();
    for _ in 0..8 {
        let mut c = Wire::connect(b.addr).await.unwrap();
        c.send(request, version).await.unwrap();
        conns.push(c);
    }
    until(10, "all eight are answered", || {
        b.broker.stats.requests.load(Relaxed) >= asked + 8
    })
    .await;
    heap_settled().await;
    let grown = alloc::live_bytes() - before;
    let in_use = b.broker.budget.in_use();
    assert!(
        grown < ANSWERS_BUDGET as isize,
        "eight unread answers hold {} MiB of heap ({} KiB charged) on a {} MiB budget",
        grown >> 20,
        in_use >> 10,
        ANSWERS_BUDGET >> 20
    );
    let mut whole = Vec::new();
    let mut codes = Vec::new();
    for c in &mut conns {
        let r = c.receive::<R>(version).await.unwrap();
        codes.push(error(&r));
        if error(&r) == 0 {
            whole.push(r);
        }
    }
    assert!(
        codes.iter().all(|&c| c == 0 || c == refused.code()),
        "{codes:?}"
    );
    assert!(codes.contains(&0), "one had room: {codes:?}");
    assert!(codes.contains(&refused.code()), "not all had: {codes:?}");
    answered_and_settled(b).await;
    whole
}

/// A member's SyncGroup in a stable group is answered with its stored
/// assignment, whatever the request's size: eight 60-byte syncs on
/// connections that never read once held eight copies of a 7 MiB
/// assignment (+49 MiB of heap on a 10 MiB budget), uncharged, each up to
/// `frame_timeout`. The answer is charged first now: the leader's own sync
/// of a 7 MiB frame is answered whole (its frame's charge goes back before
/// its answer is charged); with the budget taken, a sync is answered
/// COORDINATOR_NOT_AVAILABLE (which clients retry); unread answers hold
/// less heap than the budget, and those without room were refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unread_sync_answers_are_charged_to_the_budget() {
    alone_with(group_answers_config(), |b| async move {
        let mut a = Wire::connect(b.addr).await.unwrap();
        // v3: no two-step join; alone, answered at once as leader.
        let j = a
            .call(&join_with("", bytes::Bytes::from_static(b"m")), 3)
            .await
            .unwrap();
        assert_eq!(j.error_code, 0);
        let id = j.member_id.to_string();
        let sync = |assign: Option<bytes::Bytes>| {
            SyncGroupRequest::default()
                .with_group_id(GroupId(s("g")))
                .with_generation_id(j.generation_id)
                .with_member_id(s(&id))
                .with_assignments(
                    assign
                        .map(|x| {
                            vec![SyncGroupRequestAssignment::default()
                                .with_member_id(s(&id))
                                .with_assignment(x)]
                        })
                        .unwrap_or_default(),
                )
        };
        let r = a
            .call(&sync(Some(bytes::Bytes::from(vec![7u8; 7 << 20]))), 3)
            .await
            .unwrap();
        assert_eq!((r.error_code, r.assignment.len()), (0, 7 << 20));
        answered_and_settled(&b).await;
        // The budget taken but for 1 MiB: no room for the answer.
        let hog = broker::frame::Held::default();
        assert!(b.broker.budget.try_charge(ANSWERS_BUDGET - (1 << 20), &hog));
        let r = a.call(&sync(None), 3).await.unwrap();
        assert_eq!(
            (r.error_code, r.assignment.len()),
            (ResponseError::CoordinatorNotAvailable.code(), 0)
        );
        drop(hog);
        let r = a.call(&sync(None), 3).await.unwrap();
        assert_eq!((r.error_code, r.assignment.len()), (0, 7 << 20));
        let whole = eight_unread(
            &b,
            &sync(None),
            3,
            |r| r.error_code,
            ResponseError::CoordinatorNotAvailable,
        )
        .await;
        assert!(whole.iter().all(|r| r.assignment.len() == 7 << 20));
        b.shutdown().await;
    })
    .await
}

/// The leader of a group completing a rebalance that joins again with the
/// same metadata gets every member's metadata back each time (as Kafka
/// answers it): eight such joins unread once held eight copies of seven
/// members' 1 MiB, uncharged. Charged first now, as sync answers are; with
/// no room, answered COORDINATOR_LOAD_IN_PROGRESS (which clients retry,
/// and a member of the completed round gets its generation back).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unread_leader_join_answers_are_charged_to_the_budget() {
    alone_with(group_answers_config(), |b| async move {
        let small = bytes::Bytes::from_static(b"m");
        let mut a = Wire::connect(b.addr).await.unwrap();
        let j = a.call(&join_with("", small.clone()), 3).await.unwrap();
        assert_eq!(j.error_code, 0);
        let leader = j.member_id.to_string();
        // Seven followers with 1 MiB of metadata each join; their joins
        // wait for the round, which the leader's rejoin completes.
        let mut followers = Vec::new();
        for _ in 0..7 {
            let mut w = Wire::connect(b.addr).await.unwrap();
            w.send(&join_with("", bytes::Bytes::from(vec![1u8; 1 << 20])), 3)
                .await
                .unwrap();
            followers.push(w);
        }
        until(10, "the followers' joins wait", || {
            b.broker.groups.joins.delayed() == 7
        })
        .await;
        let rejoin = join_with(&leader, small.clone());
        let r = a.call(&rejoin, 3).await.unwrap();
        assert_eq!((r.error_code, r.members.len()), (0, 8));
        for w in &mut followers {
            let r = w.receive::<JoinGroupRequest>(3).await.unwrap();
            assert_eq!((r.error_code, r.generation_id), (0, j.generation_id + 1));
        }
        answered_and_settled(&b).await;
        let hog = broker::frame::Held::default();
        assert!(b.broker.budget.try_charge(ANSWERS_BUDGET - (1 << 20), &hog));
        let r = a.call(&rejoin, 3).await.unwrap();
        assert_eq!(
            (r.error_code, r.members.len()),
            (ResponseError::CoordinatorLoadInProgress.code(), 0)
        );
        drop(hog);
        let r = a.call(&rejoin, 3).await.unwrap();
        assert_eq!(
            (r.error_code, r.generation_id, r.members.len()),
            (0, j.generation_id + 1, 8),
            "the same generation back"
        );
        let whole = eight_unread(
            &b,
            &rejoin,
            3,
            |r| r.error_code,
            ResponseError::CoordinatorLoadInProgress,
        )
        .await;
        assert!(whole.iter().all(|r| r.members.len() == 8));
        drop(followers);
        b.shutdown().await;
    })
    .await
}

/// A group answer takes its request's own charge before it asks the budget
/// for more (`Held::pass_to`): Tokio's semaphore gives permits handed back to
/// the connections already waiting, so a request that let go of its charge
/// and then asked again found nothing while anyone waited, and a 100-byte
/// answer was refused behind others' large frames. Passed over, the charge
/// never goes through the semaphore: the waiter stays waiting, the answer
/// holds what it needs, and the request's surplus goes back.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_group_answer_takes_its_requests_charge_before_the_budget() {
    use broker::frame::{Budget, Held};
    let budget = Budget::new(1000);
    let (request, answer) = (Held::default(), Held::default());
    assert!(budget.try_charge(600, &request));
    let hog = Held::default();
    assert!(budget.try_charge(400, &hog));
    // Another connection waits for 300 (more than is free: nothing is).
    let waiting = {
        let budget = budget.clone();
        tokio::spawn(async move {
            let held = Held::default();
            while !budget.try_charge(300, &held) {
                tokio::task::yield_now().await;
            }
            held
        })
    };
    tokio::task::yield_now().await;
    assert_eq!(request.pass_to(&answer, 100), 100);
    assert_eq!(budget.in_use(), 1000, "moved, not given back and taken");
    assert!(
        !budget.try_charge(1, &answer),
        "nothing free while it waits"
    );
    request.keep(0);
    assert_eq!(budget.in_use(), 500, "the request's surplus went back");
    let held = tokio::time::timeout(Duration::from_secs(1), waiting)
        .await
        .expect("the waiter got the surplus")
        .unwrap();
    assert_eq!(budget.in_use(), 800);
    // Passing more than is held moves what there is; from nothing, nothing.
    assert_eq!(answer.pass_to(&request, 500), 100);
    assert_eq!(answer.pass_to(&request, 1), 0);
    drop((held, hog, request));
    assert_eq!(budget.in_use(), 0);
}
