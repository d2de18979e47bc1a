//! The Kafka-protocol broker example (`examples/kafka_broker`) checked by a
//! Kafka client library nobody here wrote (rskafka), and by raw requests for
//! what rskafka does not send (`acks` 0 and 1, a fetch abandoned mid-wait).
//!
//! Real sockets on 127.0.0.1 and real time: few tests, each bounded by a
//! timeout.

#[path = "../examples/kafka_broker/broker/mod.rs"]
#[allow(dead_code)]
mod broker;
#[path = "../examples/kafka_broker/wire.rs"]
#[allow(dead_code)]
mod wire;

use std::future::Future;
use std::time::Duration;

use broker::{BrokerHandle, Config};
use kafka_protocol::error::ResponseError;
use rskafka::chrono::{TimeZone, Utc};
use rskafka::client::error::{Error as ClientError, ProtocolError};
use rskafka::client::partition::{Compression, PartitionClient, UnknownTopicHandling};
use rskafka::client::ClientBuilder;
use rskafka::record::Record;
use tokio::time::Instant;
use wire::Wire;

const TOPIC: &str = "t";

/// Every test's body runs under this bound.
async fn bounded<F: Future>(f: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(30), f)
        .await
        .expect("the test finished in time")
}

async fn start(config: Config) -> BrokerHandle {
    BrokerHandle::start(Config {
        listen: "127.0.0.1:0".parse().unwrap(),
        ..config
    })
    .await
    .expect("the broker starts")
}

fn record(value: &[u8]) -> Record {
    Record {
        key: None,
        value: Some(value.to_vec()),
        headers: Default::default(),
        timestamp: Utc.timestamp_millis_opt(wire::now_ms()).unwrap(),
    }
}

/// A client with its own connection (one request at a time per connection).
async fn client(b: &BrokerHandle, p: i32) -> PartitionClient {
    ClientBuilder::new(vec![b.addr.to_string()])
        .build()
        .await
        .expect("connects")
        .partition_client(TOPIC, p, UnknownTopicHandling::Retry)
        .await
        .expect("partition client")
}

/// Polls `cond` on the wall clock (the broker is real) for up to 10 s.
async fn until(what: &str, cond: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "waited too long until {what}");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acks_all_then_the_same_records_are_consumed() {
    bounded(async {
        let b = start(Config::default()).await;
        let c = client(&b, 0).await;
        let offsets = c
            .produce(vec![record(b"a"), record(b"b")], Compression::NoCompression)
            .await
            .unwrap();
        assert_eq!(offsets, vec![0, 1]);
        let more = c
            .produce(vec![record(b"c")], Compression::NoCompression)
            .await
            .unwrap();
        assert_eq!(more, vec![2]);
        // acks=all answered: the high watermark covers the records.
        assert_eq!(
            b.broker
                .topics
                .partition(TOPIC, 0)
                .unwrap()
                .high_watermark(),
            3
        );
        let (records, hw) = c.fetch_records(0, 1..1_000_000, 1_000).await.unwrap();
        assert_eq!(hw, 3);
        let values: Vec<_> = records
            .iter()
            .map(|r| (r.offset, r.record.value.clone().unwrap()))
            .collect();
        assert_eq!(
            values,
            vec![(0, b"a".to_vec()), (1, b"b".to_vec()), (2, b"c".to_vec())]
        );
        // From the middle of a batch: the client drops what it did not ask for.
        let (records, _) = c.fetch_records(1, 1..1_000_000, 1_000).await.unwrap();
        assert_eq!(records.first().map(|r| r.offset), Some(1));
        assert_eq!(
            c.get_offset(rskafka::client::partition::OffsetAt::Latest)
                .await
                .unwrap(),
            3
        );
        b.shutdown().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_fetch_answers_at_its_max_wait() {
    bounded(async {
        let b = start(Config::default()).await;
        let c = client(&b, 1).await;
        let t = Instant::now();
        let (records, hw) = c.fetch_records(0, 1..1_000_000, 500).await.unwrap();
        let took = t.elapsed();
        assert!(records.is_empty());
        assert_eq!(hw, 0);
        assert!(
            took >= Duration::from_millis(500),
            "answered early: {took:?}"
        );
        // A few ms on a quiet machine; room here for a loaded 2-core CI.
        assert!(took < Duration::from_millis(560), "answered late: {took:?}");
        b.shutdown().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fetch_parked_on_min_bytes_answers_soon_after_the_produce_that_fills_it() {
    bounded(async {
        let b = start(Config::default()).await;
        let producer = client(&b, 2).await;
        let consumer = client(&b, 2).await;
        // One small record is about 70 bytes: a fetch wanting 100 waits for two.
        let fetch = tokio::spawn(async move {
            let r = consumer.fetch_records(0, 100..1_000_000, 10_000).await;
            (r, Instant::now())
        });
        until("the fetch is parked", || b.broker.fetches.delayed() == 1).await;
        producer
            .produce(vec![record(b"one")], Compression::NoCompression)
            .await
            .unwrap();
        // Replicated (acks=all answered), checked, and not enough: still parked.
        assert_eq!(b.broker.fetches.delayed(), 1, "not enough bytes yet");
        producer
            .produce(vec![record(b"two")], Compression::NoCompression)
            .await
            .unwrap();
        let acked = Instant::now();
        let (r, answered) = fetch.await.unwrap();
        let (records, hw) = r.unwrap();
        assert_eq!(records.len(), 2);
        assert_eq!(hw, 2);
        let after = answered.saturating_duration_since(acked);
        assert!(
            after < Duration::from_millis(50),
            "woke {after:?} after the produce"
        );
        b.shutdown().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_fetch_misses_a_produce_that_races_its_registration() {
    bounded(async {
        let b = start(Config {
            followers: 0, // the high watermark moves in the produce's own request
            topics: vec![TOPIC.into()],
            ..Config::default()
        })
        .await;
        let addr = b.addr;
        let mut producer = Wire::connect(addr).await.unwrap();
        let mut consumer = Wire::connect(addr).await.unwrap();
        for offset in 0..200i64 {
            // The fetch and the produce go out together: the produce lands
            // before, during or after the fetch's read and registration.
            let fetch = wire::fetch(TOPIC, &[(3, offset)], Duration::from_secs(5), 1, 1 << 20);
            let produce = wire::produce(TOPIC, 3, 1, Duration::from_secs(5), wire::batch(&[b"x"]));
            let t = Instant::now();
            let (f, p) = tokio::join!(
                consumer.call(&fetch, wire::FETCH_VERSION),
                producer.call(&produce, wire::PRODUCE_VERSION)
            );
            assert_eq!(wire::produce_error(&p.unwrap()), 0);
            let f = f.unwrap();
            let took = t.elapsed();
            assert!(
                took < Duration::from_secs(1),
                "round {offset}: a wake-up was lost ({took:?})"
            );
            let part = &f.responses[0].partitions[0];
            assert_eq!(part.error_code, 0);
            assert!(part.records.as_ref().is_some_and(|r| !r.is_empty()));
        }
        b.shutdown().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_follower_times_out_acks_all_but_not_acks_1() {
    bounded(async {
        let b = start(Config {
            stuck_follower: Some(1),
            max_produce_wait: Duration::from_millis(200),
            ..Config::default()
        })
        .await;
        let c = client(&b, 0).await;
        let t = Instant::now();
        let result = c
            .produce(vec![record(b"stuck")], Compression::NoCompression)
            .await;
        let took = t.elapsed();
        assert!(
            matches!(
                result,
                Err(ClientError::ServerError {
                    protocol_error: ProtocolError::RequestTimedOut,
                    ..
                })
            ),
            "{result:?}"
        );
        assert!(took >= Duration::from_millis(200), "{took:?}");
        let mut raw = Wire::connect(b.addr).await.unwrap();
        let r = raw.append(TOPIC, 0, &[b"leader"]).await.unwrap();
        assert_eq!(wire::produce_error(&r), 0);
        assert_eq!(r.responses[0].partition_responses[0].base_offset, 1);
        // acks=0: no answer; the next request's answer is the next one read.
        raw.send(
            &wire::produce(
                TOPIC,
                0,
                0,
                Duration::from_secs(5),
                wire::batch(&[b"quiet"]),
            ),
            wire::PRODUCE_VERSION,
        )
        .await
        .unwrap();
        let r = raw.append(TOPIC, 0, &[b"after"]).await.unwrap();
        assert_eq!(r.responses[0].partition_responses[0].base_offset, 3);
        let part = b.broker.topics.partition(TOPIC, 0).unwrap();
        assert_eq!((part.log_end(), part.high_watermark()), (4, 0));
        // The follower comes back: the high watermark catches up.
        b.broker.set_stuck(1, false);
        until("caught up", || part.high_watermark() == 4).await;
        b.shutdown().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fetch_limits_and_errors_per_partition() {
    bounded(async {
        let b = start(Config {
            followers: 0,
            ..Config::default()
        })
        .await;
        let mut raw = Wire::connect(b.addr).await.unwrap();
        // Make the topic, then two batches on partition 0 and one on 1.
        let _ = client(&b, 0).await;
        for (p, v) in [(0, &b"first"[..]), (0, b"second"), (1, b"other")] {
            let r = raw.append(TOPIC, p, &[v]).await.unwrap();
            assert_eq!(wire::produce_error(&r), 0);
        }
        // max_bytes 1: the first batch comes whole (a consumer must progress),
        // nothing else fits.
        let f = raw
            .call(
                &wire::fetch(TOPIC, &[(0, 0), (1, 0)], Duration::ZERO, 1, 1),
                wire::FETCH_VERSION,
            )
            .await
            .unwrap();
        let parts = &f.responses[0].partitions;
        let first = parts[0].records.clone().unwrap();
        assert!(!first.is_empty());
        let batches =
            kafka_protocol::records::RecordBatchDecoder::decode_all(&mut first.clone()).unwrap();
        assert_eq!(batches.len(), 1);
        assert!(parts[1].records.as_ref().unwrap().is_empty());
        assert_eq!((parts[0].high_watermark, parts[1].high_watermark), (2, 1));
        // Out of range, and unknown partition: answered at once with errors.
        let t = Instant::now();
        let f = raw
            .call(
                &wire::fetch(
                    TOPIC,
                    &[(0, 99), (77, 0)],
                    Duration::from_secs(10),
                    1,
                    1 << 20,
                ),
                wire::FETCH_VERSION,
            )
            .await
            .unwrap();
        assert!(t.elapsed() < Duration::from_secs(1));
        let codes: Vec<_> = f.responses[0]
            .partitions
            .iter()
            .map(|p| p.error_code)
            .collect();
        assert_eq!(
            codes,
            vec![
                ResponseError::OffsetOutOfRange.code(),
                ResponseError::UnknownTopicOrPartition.code()
            ]
        );
        // Not record batches: refused, nothing appended.
        let r = raw
            .call(
                &wire::produce(
                    TOPIC,
                    1,
                    1,
                    Duration::from_secs(5),
                    bytes::Bytes::from_static(b"junk"),
                ),
                wire::PRODUCE_VERSION,
            )
            .await
            .unwrap();
        assert_eq!(
            wire::produce_error(&r),
            ResponseError::CorruptMessage.code()
        );
        assert_eq!(b.broker.topics.partition(TOPIC, 1).unwrap().log_end(), 1);
        b.shutdown().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hang_up_cancels_and_shutdown_answers_what_waits() {
    bounded(async {
        let b = start(Config {
            stuck_follower: Some(0),
            ..Config::default()
        })
        .await;
        let _ = client(&b, 0).await; // makes the topic
        let mut gone = Wire::connect(b.addr).await.unwrap();
        gone.send(
            &wire::fetch(TOPIC, &[(0, 0)], Duration::from_secs(30), 1, 1 << 20),
            wire::FETCH_VERSION,
        )
        .await
        .unwrap();
        until("parked", || b.broker.fetches.delayed() == 1).await;
        drop(gone);
        until("cancelled", || b.broker.fetches.delayed() == 0).await;
        // The same with a request pipelined behind the parked fetch: the
        // broker holds that frame and still sees the hang-up.
        let mut gone = Wire::connect(b.addr).await.unwrap();
        gone.send(
            &wire::fetch(TOPIC, &[(0, 0)], Duration::from_secs(30), 1, 1 << 20),
            wire::FETCH_VERSION,
        )
        .await
        .unwrap();
        until("parked", || b.broker.fetches.delayed() == 1).await;
        gone.send(&kafka_protocol::messages::ApiVersionsRequest::default(), 0)
            .await
            .unwrap();
        // Time for the broker to read the pipelined frame (the hang-up is
        // seen either way).
        tokio::time::sleep(Duration::from_millis(50)).await;
        drop(gone);
        until("cancelled", || b.broker.fetches.delayed() == 0).await;
        assert_eq!(
            b.broker.budget.in_use(),
            0,
            "the held frame's memory is back"
        );

        let mut waiting = Vec::new();
        for p in 0..2 {
            let mut w = Wire::connect(b.addr).await.unwrap();
            let req = wire::produce(TOPIC, p, -1, Duration::from_secs(30), wire::batch(&[b"x"]));
            waiting.push(tokio::spawn(async move {
                w.call(&req, wire::PRODUCE_VERSION).await
            }));
        }
        let mut w = Wire::connect(b.addr).await.unwrap();
        let fetch = tokio::spawn(async move {
            w.call(
                &wire::fetch(TOPIC, &[(1, 0)], Duration::from_secs(30), 1 << 20, 1 << 20),
                wire::FETCH_VERSION,
            )
            .await
        });
        until("2 produces and a fetch wait", || {
            b.broker.produces.delayed() == 2 && b.broker.fetches.delayed() == 1
        })
        .await;
        let broker = b.broker.clone();
        b.shutdown().await;
        for w in waiting {
            let r = w
                .await
                .unwrap()
                .expect("answered before the connection closed");
            assert_eq!(
                wire::produce_error(&r),
                ResponseError::NotEnoughReplicasAfterAppend.code()
            );
        }
        let f = fetch.await.unwrap().expect("answered");
        assert_eq!(f.responses[0].partitions[0].error_code, 0);
        assert_eq!(broker.produces.delayed() + broker.fetches.delayed(), 0);
    })
    .await
}

/// Reads from `conn` until the broker closes it; `false` if it stays open
/// past `within`.
async fn closed_within(conn: &mut tokio::net::TcpStream, within: Duration) -> bool {
    use tokio::io::AsyncReadExt;
    let mut sink = Vec::new();
    matches!(
        tokio::time::timeout(within, conn.read_to_end(&mut sink)).await,
        Ok(Ok(_)) | Ok(Err(_))
    )
}

/// The broker still answers a new connection.
async fn answers(b: &BrokerHandle) {
    let mut w = Wire::connect(b.addr).await.unwrap();
    let r = w
        .call(&kafka_protocol::messages::ApiVersionsRequest::default(), 0)
        .await
        .expect("the broker answers");
    assert_eq!(r.error_code, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_22_bytes_that_aborted_the_broker_close_only_their_connection() {
    use tokio::io::AsyncWriteExt;
    bounded(async {
        let b = start(Config::default()).await;
        let mut bystander = Wire::connect(b.addr).await.unwrap();
        // Metadata v1 claiming 2^31-1 topics: the decoder would reserve
        // 154 GB for them, and a failed allocation aborts the process.
        let bytes = [
            0, 0, 0, 0x12, 0, 3, 0, 1, 0, 0, 0, 7, 0, 4, b'f', b'u', b'z', b'z', 0x7f, 0xff, 0xff,
            0xff,
        ];
        // The same claim in the compact (flexible) form, through Fetch v12's
        // topics and Produce v9's topics.
        let header = |key: u8, version: u8| {
            let mut f = vec![0, key, 0, version, 0, 0, 0, 7, 0, 4];
            f.extend_from_slice(b"fuzz");
            f.push(0); // no tagged fields
            f
        };
        let framed = |body: Vec<u8>| {
            let mut f = (body.len() as i32).to_be_bytes().to_vec();
            f.extend(body);
            f
        };
        let huge = [0xff, 0xff, 0xff, 0xff, 0x0f];
        // Fetch v12: replica id, waits, sizes, isolation, session (25 bytes).
        let mut fetch_v12 = header(1, 12);
        fetch_v12.extend([0; 25]);
        fetch_v12.extend(huge);
        let fetch_v12 = framed(fetch_v12);
        // Produce v9: no transactional id, acks, timeout.
        let mut produce_v9 = header(0, 9);
        produce_v9.extend([0; 7]);
        produce_v9.extend(huge);
        let produce_v9 = framed(produce_v9);
        for frame in [&bytes[..], &fetch_v12[..], &produce_v9[..]] {
            let mut raw = tokio::net::TcpStream::connect(b.addr).await.unwrap();
            raw.write_all(frame).await.unwrap();
            assert!(closed_within(&mut raw, Duration::from_secs(5)).await);
        }
        let r = bystander
            .call(&kafka_protocol::messages::ApiVersionsRequest::default(), 0)
            .await
            .expect("a connection open before still answers");
        assert_eq!(r.error_code, 0);
        assert_eq!(
            b.broker
                .stats
                .connections_refused
                .load(std::sync::atomic::Ordering::Relaxed),
            3
        );
        assert_eq!(b.broker.budget.in_use(), 0);
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_that_lie_are_refused_per_partition_and_never_stored() {
    use kafka_protocol::messages::produce_request::{PartitionProduceData, TopicProduceData};
    use kafka_protocol::messages::{ProduceRequest, TopicName};
    use kafka_protocol::protocol::StrBytes;
    bounded(async {
        let b = start(Config {
            followers: 0,
            topics: vec![TOPIC.into()],
            ..Config::default()
        })
        .await;
        let mut w = Wire::connect(b.addr).await.unwrap();
        let part = |i: i32, records: bytes::Bytes| {
            PartitionProduceData::default()
                .with_index(i)
                .with_records(Some(records))
        };
        // One request: a one-record batch claiming 2^31 records, a batch
        // failing its CRC, a batch cut short, and a good batch.
        let mut short = wire::batch(&[b"short"]).to_vec();
        short.truncate(short.len() - 3);
        let request = ProduceRequest::default()
            .with_acks(1)
            .with_timeout_ms(5000)
            .with_topic_data(vec![TopicProduceData::default()
                .with_name(TopicName(StrBytes::from_static_str(TOPIC)))
                .with_partition_data(vec![
                    part(0, wire::lying_batch(&[b"x"], i32::MAX)),
                    part(1, wire::corrupt_batch(&[b"y"])),
                    part(2, short.into()),
                    part(3, wire::batch(&[b"good"])),
                ])]);
        let r = w.call(&request, wire::PRODUCE_VERSION).await.unwrap();
        let codes: Vec<i16> = r.responses[0]
            .partition_responses
            .iter()
            .map(|p| p.error_code)
            .collect();
        assert_eq!(
            codes,
            [
                ResponseError::InvalidRecord.code(),
                ResponseError::CorruptMessage.code(),
                ResponseError::CorruptMessage.code(),
                0
            ]
        );
        // A record count that disagrees with the records, and records whose
        // offset deltas are out of order, both with a right CRC.
        let mut two = wire::batch(&[b"a", b"b"]).to_vec();
        two[57..61].copy_from_slice(&1i32.to_be_bytes());
        two[23..27].copy_from_slice(&0i32.to_be_bytes());
        let crc = crc32c::crc32c(&two[21..]);
        two[17..21].copy_from_slice(&crc.to_be_bytes());
        let r = w
            .call(
                &wire::produce(TOPIC, 0, 1, Duration::from_secs(5), two.into()),
                wire::PRODUCE_VERSION,
            )
            .await
            .unwrap();
        assert_ne!(wire::produce_error(&r), 0);
        let topic = b.broker.topics.get(TOPIC).unwrap();
        let ends: Vec<u64> = topic.partitions.iter().map(|p| p.log_end()).collect();
        assert_eq!(ends, [0, 0, 0, 1], "only the good batch was stored");
        assert_eq!(topic.partitions[0].high_watermark(), 0);
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn announced_sizes_reserve_nothing_and_slow_frames_are_closed() {
    use tokio::io::AsyncWriteExt;
    bounded(async {
        let b = start(Config {
            frame_timeout: Duration::from_millis(500),
            ..Config::default()
        })
        .await;
        // 300 connections each announcing 100 MiB and sending a few bytes:
        // what they hold is what arrived, rounded up to a first buffer.
        let mut held = Vec::new();
        for _ in 0..300 {
            let mut c = tokio::net::TcpStream::connect(b.addr).await.unwrap();
            c.write_all(&(100i32 << 20).to_be_bytes()).await.unwrap();
            c.write_all(&[0, 18, 0, 0]).await.unwrap();
            held.push(c);
        }
        until("all 300 frames have begun", || {
            b.broker.budget.in_use() >= 300 * 4096
        })
        .await;
        assert!(
            b.broker.budget.in_use() <= 300 * 4096,
            "{} bytes held",
            b.broker.budget.in_use()
        );
        answers(&b).await;
        // Frames that do not arrive within the frame timeout close their
        // connection and give their memory back.
        for c in &mut held {
            assert!(closed_within(c, Duration::from_secs(5)).await);
        }
        until("the memory is back", || b.broker.budget.in_use() == 0).await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frame_over_the_limit_is_refused_and_idle_connections_close() {
    use tokio::io::AsyncWriteExt;
    bounded(async {
        // A budget smaller than one request and its decoding is refused.
        let too_small = BrokerHandle::start(Config {
            listen: "127.0.0.1:0".parse().unwrap(),
            memory_budget: 1 << 20,
            ..Config::default()
        })
        .await;
        assert!(too_small.is_err());
        let b = start(Config {
            memory_budget: 1 << 20,
            max_request_bytes: 512 << 10,
            max_decoded_bytes: 256 << 10,
            idle_timeout: Duration::from_millis(300),
            ..Config::default()
        })
        .await;
        let mut c = tokio::net::TcpStream::connect(b.addr).await.unwrap();
        c.write_all(&(2i32 << 20).to_be_bytes()).await.unwrap();
        assert!(closed_within(&mut c, Duration::from_secs(5)).await);
        // An idle connection, and one that answered a request, then idled.
        let mut idle = tokio::net::TcpStream::connect(b.addr).await.unwrap();
        let mut w = Wire::connect(b.addr).await.unwrap();
        w.call(&kafka_protocol::messages::ApiVersionsRequest::default(), 0)
            .await
            .unwrap();
        let t = Instant::now();
        assert!(closed_within(&mut idle, Duration::from_secs(5)).await);
        assert!(t.elapsed() >= Duration::from_millis(250));
        // The other one idles from its answer on, a little later.
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert!(w
            .call(&kafka_protocol::messages::ApiVersionsRequest::default(), 0)
            .await
            .is_err());
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metadata_answers_an_empty_list_with_no_topics_and_creates_only_when_allowed() {
    use kafka_protocol::messages::metadata_request::MetadataRequestTopic;
    use kafka_protocol::messages::{MetadataRequest, TopicName};
    use kafka_protocol::protocol::StrBytes;
    bounded(async {
        let b = start(Config {
            topics: vec!["existing".into()],
            ..Config::default()
        })
        .await;
        let mut w = Wire::connect(b.addr).await.unwrap();
        let ask = |names: Option<Vec<&'static str>>, allow: bool| {
            MetadataRequest::default()
                .with_topics(names.map(|ns| {
                    ns.into_iter()
                        .map(|n| {
                            MetadataRequestTopic::default()
                                .with_name(Some(TopicName(StrBytes::from_static_str(n))))
                        })
                        .collect()
                }))
                .with_allow_auto_topic_creation(allow)
        };
        // From version 1, an empty list asks for no topics; null for all.
        let r = w.call(&ask(Some(vec![]), true), 12).await.unwrap();
        assert!(r.topics.is_empty());
        let r = w.call(&ask(None, true), 12).await.unwrap();
        assert_eq!(r.topics.len(), 1);
        // In version 0, an empty list asks for all.
        let r = w
            .call(&MetadataRequest::default().with_topics(Some(vec![])), 0)
            .await
            .unwrap();
        assert_eq!(r.topics.len(), 1);
        // Creation on first use only when the request allows it.
        let r = w.call(&ask(Some(vec!["fresh"]), false), 12).await.unwrap();
        assert_eq!(
            r.topics[0].error_code,
            ResponseError::UnknownTopicOrPartition.code()
        );
        assert!(b.broker.topics.get("fresh").is_none());
        let r = w.call(&ask(Some(vec!["fresh"]), true), 12).await.unwrap();
        assert_eq!(r.topics[0].error_code, 0);
        assert!(b.broker.topics.get("fresh").is_some());
        // A name repeated is answered once: the answer grows with distinct
        // topics, not with the request's repetitions.
        let r = w
            .call(&ask(Some(vec!["existing"; 1000]), true), 12)
            .await
            .unwrap();
        assert_eq!(r.topics.len(), 1);
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metrics_page_is_prometheus_text_with_every_purgatory() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    bounded(async {
        let b = start(Config {
            followers: 0,
            topics: vec![TOPIC.into()],
            metrics_addr: Some("127.0.0.1:0".parse().unwrap()),
            ..Config::default()
        })
        .await;
        // One fetch that waits out its max_wait: one expiry in the fetch purgatory.
        let mut w = Wire::connect(b.addr).await.unwrap();
        w.call(
            &wire::fetch(TOPIC, &[(0, 0)], Duration::from_millis(20), 1, 1 << 20),
            wire::FETCH_VERSION,
        )
        .await
        .unwrap();
        let mut http = tokio::net::TcpStream::connect(b.metrics_addr.unwrap())
            .await
            .unwrap();
        http.write_all(b"GET /metrics HTTP/1.1\r\nHost: t\r\n\r\n")
            .await
            .unwrap();
        let mut page = String::new();
        http.read_to_string(&mut page).await.unwrap();
        let (head, body) = page.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 200 OK"), "{head}");
        let mut values = std::collections::HashMap::new();
        for line in body.lines().filter(|l| !l.starts_with('#')) {
            let (key, value) = line.rsplit_once(' ').unwrap();
            let v: f64 = value.parse().unwrap_or_else(|_| panic!("{line}"));
            values.insert(key.to_string(), v);
        }
        let count = values["tokio_purgatory_lateness_seconds_count{name=\"fetch\"}"];
        assert_eq!(count, 1.0);
        assert_eq!(
            values["tokio_purgatory_lateness_seconds_bucket{name=\"fetch\",le=\"+Inf\"}"],
            count
        );
        assert_eq!(values["tokio_purgatory_expired_total{name=\"fetch\"}"], 1.0);
        assert_eq!(values["tokio_purgatory_delayed{name=\"produce\"}"], 0.0);
        assert!(values.contains_key("tokio_purgatory_checks_total{name=\"fetch\",walk=\"level\"}"));
        assert!(values["broker_requests_total"] >= 1.0);
        b.shutdown().await;
    })
    .await
}

/// The partition's ISR as Metadata shows it (node ids; the leader is 0).
async fn isr(w: &mut Wire, p: usize) -> Vec<i32> {
    use kafka_protocol::messages::metadata_request::MetadataRequestTopic;
    use kafka_protocol::messages::{MetadataRequest, TopicName};
    use kafka_protocol::protocol::StrBytes;
    let r = w
        .call(
            &MetadataRequest::default().with_topics(Some(vec![MetadataRequestTopic::default()
                .with_name(Some(TopicName(StrBytes::from_static_str(TOPIC))))])),
            9,
        )
        .await
        .unwrap();
    r.topics[0].partitions[p]
        .isr_nodes
        .iter()
        .map(|n| n.0)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_follower_leaves_the_isr_and_the_parked_produce_completes() {
    bounded(async {
        let b = start(Config {
            topics: vec![TOPIC.into()],
            stuck_follower: Some(1),
            replica_lag_max: Duration::from_millis(300),
            max_produce_wait: Duration::from_secs(10),
            ..Config::default()
        })
        .await;
        let mut w = Wire::connect(b.addr).await.unwrap();
        assert_eq!(isr(&mut w, 0).await, [0, 1, 2]);
        // acks=all waits for the stuck follower until it leaves the ISR
        // (300 ms without catching up, checked every 150 ms); then the high
        // watermark goes on without it and the produce completes. The last
        // check before the append found the follower caught up, up to 150 ms
        // before this produce was sent, so it leaves 150-450 ms after (as in
        // Kafka, where the clock runs from the follower's last fetch). Only
        // a check delayed by more than 150 ms (a loaded machine) takes it out
        // sooner; 100 ms is still well above a produce that did not wait
        // (about a millisecond).
        let t = Instant::now();
        let r = w
            .call(
                &wire::produce(TOPIC, 0, -1, Duration::from_secs(10), wire::batch(&[b"x"])),
                wire::PRODUCE_VERSION,
            )
            .await
            .unwrap();
        let took = t.elapsed();
        assert_eq!(wire::produce_error(&r), 0);
        assert!(
            took >= Duration::from_millis(100) && took < Duration::from_secs(2),
            "{took:?}"
        );
        assert_eq!(isr(&mut w, 0).await, [0, 1]);
        let part = b.broker.topics.partition(TOPIC, 0).unwrap();
        assert_eq!(part.high_watermark(), 1);
        // acks=1 records are readable at once now.
        w.append(TOPIC, 0, &[b"y"]).await.unwrap();
        until("the watermark covers acks=1", || part.high_watermark() == 2).await;
        // The follower comes back, catches up, and joins the ISR again.
        b.broker.set_stuck(1, false);
        until("back in the ISR", || part.in_sync_followers() == [0, 1]).await;
        assert_eq!(isr(&mut w, 0).await, [0, 1, 2]);
        b.shutdown().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn min_insync_replicas_refuses_acks_all_once_the_isr_is_too_small() {
    bounded(async {
        let b = start(Config {
            topics: vec![TOPIC.into()],
            stuck_follower: Some(0),
            replica_lag_max: Duration::from_millis(200),
            min_insync_replicas: 3,
            max_produce_wait: Duration::from_secs(10),
            ..Config::default()
        })
        .await;
        let mut w = Wire::connect(b.addr).await.unwrap();
        // Taken (three in sync), then covered once follower 0 leaves the ISR:
        // too few in sync by then, so Kafka's NOT_ENOUGH_REPLICAS_AFTER_APPEND.
        let produce = || wire::produce(TOPIC, 0, -1, Duration::from_secs(10), wire::batch(&[b"x"]));
        let r = w.call(&produce(), wire::PRODUCE_VERSION).await.unwrap();
        assert_eq!(
            wire::produce_error(&r),
            ResponseError::NotEnoughReplicasAfterAppend.code()
        );
        // Now refused before appending.
        let end = b.broker.topics.partition(TOPIC, 0).unwrap().log_end();
        let r = w.call(&produce(), wire::PRODUCE_VERSION).await.unwrap();
        assert_eq!(
            wire::produce_error(&r),
            ResponseError::NotEnoughReplicas.code()
        );
        assert_eq!(b.broker.topics.partition(TOPIC, 0).unwrap().log_end(), end);
        b.shutdown().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_consumers_split_four_partitions_and_the_survivor_takes_all() {
    use wire::GroupMember as Member;
    const G: &str = "g";
    bounded(async {
        let b = start(Config {
            topics: vec![TOPIC.into()],
            groups: broker::groups::GroupLimits {
                min_session: Duration::from_millis(50),
                ..Default::default()
            },
            ..Config::default()
        })
        .await;
        // A alone: generation 1, all four partitions.
        let mut a = Member::connect(b.addr).await.unwrap();
        assert_eq!(a.rejoin(G, 10_000).await.unwrap(), [0, 1, 2, 3]);
        assert_eq!(a.generation, 1);
        // B joins: its join waits until A, told by its heartbeat that a
        // rebalance is under way, joins again; then two each.
        let mut bee = Member::connect(b.addr).await.unwrap();
        let b_joined = tokio::spawn(async move {
            let mine = bee.rejoin(G, 300).await.unwrap();
            (bee, mine)
        });
        until("B's join waits", || b.broker.groups.joins.delayed() == 1).await;
        assert_eq!(
            a.heartbeat(G).await.unwrap(),
            ResponseError::RebalanceInProgress.code()
        );
        let a_mine = a.rejoin(G, 10_000).await.unwrap();
        let (mut bee, b_mine) = b_joined.await.unwrap();
        assert_eq!(a.generation, 2);
        let mut all: Vec<i32> = a_mine.iter().chain(&b_mine).copied().collect();
        all.sort();
        assert_eq!(all, [0, 1, 2, 3]);
        assert_eq!((a_mine.len(), b_mine.len()), (2, 2));
        assert_eq!(bee.heartbeat(G).await.unwrap(), 0);
        // Errors as Kafka's: an old generation, an unknown member.
        bee.generation -= 1;
        assert_eq!(
            bee.heartbeat(G).await.unwrap(),
            ResponseError::IllegalGeneration.code()
        );
        bee.generation += 1;
        // Commits, read back by anyone.
        assert_eq!(
            bee.commit(G, TOPIC, &[(1, 17), (3, 4)]).await.unwrap(),
            [0, 0]
        );
        // A leaves: B, told by its heartbeat, takes all four.
        assert_eq!(a.leave(G).await.unwrap(), 0);
        assert_eq!(
            bee.heartbeat(G).await.unwrap(),
            ResponseError::RebalanceInProgress.code()
        );
        assert_eq!(bee.rejoin(G, 300).await.unwrap(), [0, 1, 2, 3]);
        assert_eq!(bee.generation, 3);
        // B dies (no more heartbeats): its session (300 ms) expires and the
        // group is empty; a new consumer finds the commits and all four.
        let t = Instant::now();
        drop(bee);
        until("B's session expired", || {
            b.broker
                .groups
                .describe(G)
                .is_some_and(|(_, m)| m.is_empty())
        })
        .await;
        let expired_after = t.elapsed();
        assert!(
            expired_after >= Duration::from_millis(250),
            "{expired_after:?}"
        );
        let mut c = Member::connect(b.addr).await.unwrap();
        assert_eq!(
            c.committed(G, TOPIC).await.unwrap(),
            [(0, -1), (1, 17), (2, -1), (3, 4)]
        );
        assert_eq!(c.rejoin(G, 10_000).await.unwrap(), [0, 1, 2, 3]);
        assert_eq!(c.heartbeat(G).await.unwrap(), 0);
        let mut stranger = Member::connect(b.addr).await.unwrap();
        stranger.id = "nobody".into();
        stranger.generation = c.generation;
        assert_eq!(
            stranger.heartbeat(G).await.unwrap(),
            ResponseError::UnknownMemberId.code()
        );
        // Refused requests for made-up groups leave nothing behind (a
        // generation of a group the broker does not know is Kafka's
        // ILLEGAL_GENERATION).
        assert_eq!(
            stranger.commit("made-up", TOPIC, &[(0, 1)]).await.unwrap(),
            [ResponseError::IllegalGeneration.code()]
        );
        assert!(b.broker.groups.describe("made-up").is_none());
        let joins = b.broker.groups.joins.metrics();
        assert!(joins.completed >= 4, "{joins:?}");
        b.shutdown().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn caught_up_followers_stay_in_the_isr_after_an_idle_spell() {
    bounded(async {
        // Copies take 200 ms. The ISR checks are made here, at chosen
        // moments, with a 200 ms limit (the broker's own run every half hour
        // and stay out of the way). After 400 ms idle, an append must not
        // make the caught-up followers look 400 ms stale while its copy is in
        // flight (the high watermark would jump past what they hold).
        let max_lag = Duration::from_millis(200);
        let b = start(Config {
            topics: vec![TOPIC.into()],
            replica_lag: Duration::from_millis(200),
            replica_lag_max: Duration::from_secs(3600),
            ..Config::default()
        })
        .await;
        let mut w = Wire::connect(b.addr).await.unwrap();
        w.append(TOPIC, 0, &[b"first"]).await.unwrap();
        let part = b.broker.topics.partition(TOPIC, 0).unwrap();
        until("replicated", || part.high_watermark() == 1).await;
        tokio::time::sleep(Duration::from_millis(400)).await;
        // A check while idle: nobody is behind, nobody leaves.
        assert_eq!(part.shrink_isr(tokio::time::Instant::now(), max_lag), None);
        w.append(TOPIC, 0, &[b"second"]).await.unwrap();
        // A check while the copies are in flight: they were caught up at the
        // last check, moments ago, not 400 ms ago.
        assert_eq!(part.shrink_isr(tokio::time::Instant::now(), max_lag), None);
        assert_eq!(part.in_sync_followers(), [0, 1]);
        assert_eq!(part.high_watermark(), 1, "not covered before it is copied");
        until("replicated", || part.high_watermark() == 2).await;
        assert_eq!(isr(&mut w, 0).await, [0, 1, 2]);
        b.shutdown().await;
    })
    .await
}

/// ListOffsets by time answers as Kafka does (at batch granularity): the
/// first batch with a record at least that new, with its timestamp; offset
/// and timestamp -1 when there is none (Java's `offsetsForTimes` rejects a
/// found offset with a negative timestamp); and `MAX_TIMESTAMP` (-3, from
/// version 7) the batch with the newest timestamp.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_offsets_by_time_answers_as_kafka_does() {
    use kafka_protocol::messages::list_offsets_request::{ListOffsetsPartition, ListOffsetsTopic};
    use kafka_protocol::messages::{BrokerId, ListOffsetsRequest, TopicName};
    use kafka_protocol::protocol::StrBytes;
    bounded(async {
        let b = start(Config::default()).await;
        let _ = client(&b, 0).await; // makes the topic
        let mut w = Wire::connect(b.addr).await.unwrap();
        let now = wire::now_ms();
        for ts in [1_000_000i64, now] {
            let req = wire::produce(
                TOPIC,
                0,
                -1,
                Duration::from_secs(5),
                wire::batch_at(ts, &[b"v"]),
            );
            let r = w.call(&req, wire::PRODUCE_VERSION).await.unwrap();
            assert_eq!(wire::produce_error(&r), 0);
        }
        let ask = |ts: i64| {
            ListOffsetsRequest::default()
                .with_replica_id(BrokerId(-1))
                .with_topics(vec![ListOffsetsTopic::default()
                    .with_name(TopicName(StrBytes::from_static_str(TOPIC)))
                    .with_partitions(vec![ListOffsetsPartition::default()
                        .with_partition_index(0)
                        .with_timestamp(ts)])])
        };
        let mut got = Vec::new();
        for ts in [500_000i64, 1_000_001, now + 3_600_000, -3, -1, -2] {
            let r = w.call(&ask(ts), 7).await.unwrap();
            let p = &r.topics[0].partitions[0];
            assert_eq!(p.error_code, 0);
            got.push((p.offset, p.timestamp));
        }
        assert_eq!(got[0], (0, 1_000_000), "the found batch's timestamp");
        assert_eq!(got[1], (1, now));
        assert_eq!(got[2], (-1, -1), "no record that new");
        assert_eq!(got[3], (1, now), "MAX_TIMESTAMP");
        assert_eq!(got[4], (2, -1), "latest: the high watermark");
        assert_eq!(got[5], (0, -1), "earliest");
        b.shutdown().await;
    })
    .await
}
