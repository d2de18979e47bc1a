//! The Kafka-protocol broker example (`examples/kafka_broker`) checked by a
//! Kafka client library nobody here wrote (rskafka), and by raw requests for
//! what rskafka does not send (`acks` 0 and 1, a fetch abandoned mid-wait).
//!
//! Real sockets on 127.0.0.1 and real time: few tests, each bounded by a
//! timeout (but for the accept loop's pause, driven with a stand-in listener
//! in paused time).

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
        // Not a record batch (Kafka finds none in 4 bytes): refused,
        // nothing appended.
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
        assert_eq!(wire::produce_error(&r), ResponseError::InvalidRecord.code());
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
        // The same with two requests pipelined behind the parked fetch: they
        // wait unread in the socket, and the hang-up is still seen.
        let mut gone = Wire::connect(b.addr).await.unwrap();
        gone.send(
            &wire::fetch(TOPIC, &[(0, 0)], Duration::from_secs(30), 1, 1 << 20),
            wire::FETCH_VERSION,
        )
        .await
        .unwrap();
        until("parked", || b.broker.fetches.delayed() == 1).await;
        for _ in 0..2 {
            gone.send(&kafka_protocol::messages::ApiVersionsRequest::default(), 0)
                .await
                .unwrap();
        }
        // Time for the pipelined frames to arrive before the hang-up (their
        // arrival in the broker's socket is not observable from here; short,
        // and the hang-up is seen either way).
        tokio::time::sleep(Duration::from_millis(50)).await;
        drop(gone);
        until("cancelled", || b.broker.fetches.delayed() == 0).await;
        // The request's memory goes back as its connection's task ends.
        until("the request's memory is back", || {
            b.broker.budget.in_use() == 0
        })
        .await;

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

/// A hang-up behind a partial frame pipelined after a waiting request is
/// seen at once, also after more bytes of that frame arrived while it
/// waited (each wakes the watch, which then waits again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hang_up_behind_a_partial_frame_is_seen_at_once() {
    use std::sync::atomic::Ordering;
    use tokio::io::AsyncWriteExt;
    bounded(async {
        let b = start(Config {
            followers: 0,
            topics: vec![TOPIC.into()],
            ..Config::default()
        })
        .await;
        let mut c = tokio::net::TcpStream::connect(b.addr).await.unwrap();
        let long = wire::fetch(TOPIC, &[(0, 0)], Duration::from_secs(30), 1, 1 << 20);
        let mut all = raw_frame(&long, wire::FETCH_VERSION, 1);
        // A size and part of a header.
        all.extend_from_slice(&[0, 0, 0, 40, 0, 18]);
        c.write_all(&all).await.unwrap();
        until("parked", || b.broker.fetches.delayed() == 1).await;
        for _ in 0..5 {
            c.write_all(&[0]).await.unwrap();
            // Time for the byte to wake the watch, which must wait again
            // (not observable from here; short).
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(b.broker.fetches.delayed(), 1);
        drop(c);
        until("cancelled", || b.broker.fetches.delayed() == 0).await;
        assert_eq!(
            b.broker
                .stats
                .connections_dropped_while_waiting
                .load(Ordering::Relaxed),
            1
        );
        b.shutdown().await;
    })
    .await
}

/// A client that shuts down its sending side (half-closes) after a request
/// that is answered at once gets its answer. One that half-closes while its
/// request waits is taken for one that hung up, as the README says: the
/// broker sees the same end of the stream either way (a peer that closed
/// the socket sends the same FIN), and it cancels at once what a client
/// that hung up left waiting. Kafka, which does not read a muted connection,
/// would answer it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_close_is_a_hang_up_once_a_request_waits() {
    use std::sync::atomic::Ordering;
    use tokio::io::AsyncWriteExt;
    bounded(async {
        let b = start(Config {
            followers: 0,
            topics: vec![TOPIC.into()],
            ..Config::default()
        })
        .await;
        let versions = kafka_protocol::messages::ApiVersionsRequest::default();
        let mut c = tokio::net::TcpStream::connect(b.addr).await.unwrap();
        c.write_all(&raw_frame(&versions, 0, 7)).await.unwrap();
        c.shutdown().await.unwrap();
        let answer = read_answer::<kafka_protocol::messages::ApiVersionsRequest>(&mut c, 0).await;
        assert_eq!(answer.map(|(id, _)| id), Some(7));
        let mut c = tokio::net::TcpStream::connect(b.addr).await.unwrap();
        let fetch = wire::fetch(TOPIC, &[(0, 0)], Duration::from_secs(30), 1, 1 << 20);
        c.write_all(&raw_frame(&fetch, wire::FETCH_VERSION, 8))
            .await
            .unwrap();
        until("parked", || b.broker.fetches.delayed() == 1).await;
        c.shutdown().await.unwrap();
        until("cancelled", || b.broker.fetches.delayed() == 0).await;
        assert!(closed_within(&mut c, Duration::from_secs(5)).await);
        assert_eq!(
            b.broker
                .stats
                .connections_dropped_while_waiting
                .load(Ordering::Relaxed),
            1
        );
        b.shutdown().await;
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

/// librdkafka's all-topics Metadata request (v12; v9 from librdkafka 2.2.0)
/// carries 3 bytes after the fields of its version, as captured from
/// confluent-kafka 2.16.1: Kafka reads the fields of the version and ignores
/// the rest, and so does the broker. Hostile bytes after a request (a count
/// of 2^31-1, a megabyte of them) are ignored too: never walked, so never
/// decoded or allocated for, charged only as part of the frame, and given
/// back with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_after_a_request_are_ignored_as_kafka_ignores_them() {
    use kafka_protocol::messages::{ApiVersionsRequest, MetadataRequest};
    use tokio::io::AsyncWriteExt;
    bounded(async {
        let b = start(Config {
            topics: vec!["listed".into()],
            ..Config::default()
        })
        .await;
        let captured = [
            0x00, 0x03, 0x00, 0x0c, 0x00, 0x00, 0x00, 0x03, 0x00, 0x07, b'r', b'd', b'k', b'a',
            b'f', b'k', b'a', 0x00, 0x00, 0x00, 0x00, 0x00, 0x01, 0x00, 0x00,
        ];
        let mut frame = (captured.len() as i32).to_be_bytes().to_vec();
        frame.extend(captured);
        let mut c = tokio::net::TcpStream::connect(b.addr).await.unwrap();
        c.write_all(&frame).await.unwrap();
        let (id, r) = read_answer::<MetadataRequest>(&mut c, 12)
            .await
            .expect("librdkafka's Metadata v12 is answered");
        assert_eq!(id, 3);
        let names: Vec<_> = r
            .topics
            .iter()
            .filter_map(|t| t.name.as_ref().map(|n| n.to_string()))
            .collect();
        assert_eq!(names, ["listed"]);
        // Hostile bytes after requests of both kinds of encoding: a huge
        // count, and a megabyte of 0xff.
        let mut v1 = raw_frame(&MetadataRequest::default(), 1, 4);
        v1.extend([0x7f, 0xff, 0xff, 0xff]);
        let mut v3 = raw_frame(
            &ApiVersionsRequest::default()
                .with_client_software_name("raw".into())
                .with_client_software_version("1".into()),
            3,
            5,
        );
        v3.extend(std::iter::repeat_n(0xff, 1 << 20));
        for f in [&mut v1, &mut v3] {
            let size = (f.len() - 4) as i32;
            f[..4].copy_from_slice(&size.to_be_bytes());
        }
        c.write_all(&v1).await.unwrap();
        let (id, _) = read_answer::<MetadataRequest>(&mut c, 1)
            .await
            .expect("answered despite the bytes after it");
        assert_eq!(id, 4);
        c.write_all(&v3).await.unwrap();
        let (id, r) = read_answer::<ApiVersionsRequest>(&mut c, 3)
            .await
            .expect("answered despite the megabyte after it");
        assert_eq!((id, r.error_code), (5, 0));
        assert_eq!(
            b.broker
                .stats
                .connections_refused
                .load(std::sync::atomic::Ordering::Relaxed),
            0
        );
        // The frames' charges went back with their answers.
        until("the frames are given back", || {
            b.broker.budget.in_use() == 0
        })
        .await;
        b.shutdown().await;
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
        // failing its CRC, a batch cut short (Kafka's iterator finds no
        // batch in it), and a good batch.
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
                ResponseError::InvalidRecord.code(),
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
        // The other one idles from its answer on, a little later: read
        // until the broker closes it (reading is no activity), at most 5 s.
        assert!(
            tokio::time::timeout(
                Duration::from_secs(5),
                w.receive::<kafka_protocol::messages::ApiVersionsRequest>(0)
            )
            .await
            .is_ok_and(|r| r.is_err()),
            "the connection that idled after its answer was not closed within 5 s"
        );
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
        // A name Kafka's `Topic.validate` refuses (characters outside
        // [a-zA-Z0-9._-], "." or "..", over 249 characters) is answered
        // INVALID_TOPIC_EXCEPTION, whether or not creation is allowed.
        let long: &'static str = "a".repeat(250).leak();
        for bad in ["bad name!", "..", ".", long, "\u{e9}"] {
            for allow in [true, false] {
                let r = w.call(&ask(Some(vec![bad]), allow), 12).await.unwrap();
                assert_eq!(
                    r.topics[0].error_code,
                    ResponseError::InvalidTopicException.code(),
                    "{bad:?}"
                );
            }
        }
        let r = w
            .call(&ask(Some(vec![&long[1..]]), false), 12)
            .await
            .unwrap();
        assert_eq!(
            r.topics[0].error_code,
            ResponseError::UnknownTopicOrPartition.code(),
            "249 characters are a valid name"
        );
        // From version 12 a topic may be asked for by ID: this broker gives
        // its topics none, so it is answered UNKNOWN_TOPIC_ID, as Kafka
        // answers an ID it does not know.
        let id = "00000000-0000-0000-0000-000000001234".parse().unwrap();
        let by_id = MetadataRequest::default().with_topics(Some(vec![
            MetadataRequestTopic::default()
                .with_topic_id(id)
                .with_name(None);
            2
        ]));
        let r = w.call(&by_id, 12).await.unwrap();
        assert_eq!(r.topics.len(), 1);
        assert_eq!(
            (r.topics[0].error_code, r.topics[0].topic_id),
            (ResponseError::UnknownTopicId.code(), id)
        );
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
        assert_eq!(values["broker_log_bytes"], 0.0, "nothing produced");
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

/// With the only follower out of the ISR the leader alone is the ISR, and,
/// as in Kafka, each append moves the high watermark to the log end: an
/// `acks=all` produce is answered at once, and retention (which drops only
/// what is replicated) keeps making room. (The high watermark once moved at
/// the ISR shrink and never again: `acks=all` timed out and, once the logs
/// were full, every append was refused.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_leader_alone_in_the_isr_each_append_commits() {
    bounded(async {
        let limit = 16 << 10;
        let b = start(Config {
            followers: 1,
            stuck_follower: Some(0),
            replica_lag_max: Duration::from_millis(300),
            max_produce_wait: Duration::from_secs(5),
            topics: vec![TOPIC.into()],
            max_message_bytes: 4096,
            max_log_bytes: limit,
            ..Config::default()
        })
        .await;
        let mut w = Wire::connect(b.addr).await.unwrap();
        let r = w.append(TOPIC, 0, &[b"a"]).await.unwrap();
        assert_eq!(wire::produce_error(&r), 0);
        let p = b.broker.topics.partition(TOPIC, 0).unwrap();
        until("the follower leaves the ISR", || {
            p.in_sync_followers().is_empty() && p.high_watermark() == 1
        })
        .await;
        // acks=1: committed by the time it is answered.
        let r = w.append(TOPIC, 0, &[b"b"]).await.unwrap();
        assert_eq!(wire::produce_error(&r), 0);
        assert_eq!((p.high_watermark(), p.log_end()), (2, 2));
        // acks=all: covered at once, not REQUEST_TIMED_OUT.
        let r = w
            .call(
                &wire::produce(TOPIC, 0, -1, Duration::from_secs(5), wire::batch(&[b"c"])),
                wire::PRODUCE_VERSION,
            )
            .await
            .unwrap();
        assert_eq!(wire::produce_error(&r), 0);
        assert_eq!(p.high_watermark(), 3);
        // Past the logs' limit, retention drops what is committed.
        for _ in 0..20 {
            let r = w.append(TOPIC, 0, &[&[1u8; 3000]]).await.unwrap();
            assert_eq!(wire::produce_error(&r), 0);
            assert_eq!(p.high_watermark(), p.log_end());
        }
        assert!(p.log_start() > 3);
        assert!(b.broker.topics.log_bytes() <= limit);
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
        // and stay out of the way). After 300 ms idle, an append must not
        // make the caught-up followers look 300 ms stale while its copy is in
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
        // Real time must pass: the idle spell must outlast the 200 ms limit
        // (by 100 ms) for a stale reading to show.
        tokio::time::sleep(Duration::from_millis(300)).await;
        // A check while idle: nobody is behind, nobody leaves.
        assert_eq!(part.shrink_isr(tokio::time::Instant::now(), max_lag), None);
        w.append(TOPIC, 0, &[b"second"]).await.unwrap();
        // A check while the copies are in flight: they were caught up at the
        // last check, moments ago, not 300 ms ago.
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

/// One record batch, record `i` stamped `timestamps[i]` with value
/// `values(i)`, compressed with `codec` (snappy in xerial framing when
/// `xerial`, as Kafka's Java clients write it; raw, as librdkafka does,
/// otherwise).
fn stamped_batch(
    timestamps: &[i64],
    values: impl Fn(usize) -> Vec<u8>,
    codec: kafka_protocol::records::Compression,
    xerial: bool,
) -> bytes::Bytes {
    use bytes::BufMut;
    use kafka_protocol::records::{Compression, Record, RecordBatchEncoder, RecordEncodeOptions};
    use std::io::Write;
    let records: Vec<Record> = timestamps
        .iter()
        .enumerate()
        // Offset minus sequence the same for each record (-1 for the
        // first: no sequence), or the encoder starts a new batch.
        .map(|(i, &timestamp)| wire::record(i, i as i32 - 1, timestamp, values(i).into()))
        .collect();
    let compress = |plain: &mut bytes::BytesMut, out: &mut bytes::BytesMut, c: Compression| {
        let packed: Vec<u8> = match c {
            Compression::None => plain.to_vec(),
            Compression::Gzip => {
                let mut e =
                    flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
                e.write_all(plain)?;
                e.finish()?
            }
            Compression::Snappy if xerial => {
                let mut v = vec![
                    0x82, b'S', b'N', b'A', b'P', b'P', b'Y', 0, 0, 0, 0, 1, 0, 0, 0, 1,
                ];
                for block in plain.chunks(32 << 10) {
                    let b = snap::raw::Encoder::new().compress_vec(block)?;
                    v.extend((b.len() as u32).to_be_bytes());
                    v.extend(b);
                }
                v
            }
            Compression::Snappy => snap::raw::Encoder::new().compress_vec(plain)?,
            Compression::Lz4 => {
                let mut e = lz4_flex::frame::FrameEncoder::new(Vec::new());
                e.write_all(plain)?;
                e.finish()?
            }
            Compression::Zstd => ruzstd::encoding::compress_to_vec(
                &plain[..],
                ruzstd::encoding::CompressionLevel::Fastest,
            ),
        };
        out.put_slice(&packed);
        Ok(())
    };
    let mut out = bytes::BytesMut::new();
    RecordBatchEncoder::encode_with_custom_compression(
        &mut out,
        &records,
        &RecordEncodeOptions {
            version: 2,
            compression: codec,
        },
        Some(compress),
    )
    .expect("the batch encodes");
    out.freeze()
}

/// A batch's attributes and max timestamp rewritten, its CRC made right
/// again (what a producer may send: the broker checks the CRC, not these).
fn restamp(batch: &bytes::Bytes, attributes_or: u8, max_timestamp: Option<i64>) -> bytes::Bytes {
    let mut b = batch.to_vec();
    b[22] |= attributes_or;
    if let Some(ts) = max_timestamp {
        b[35..43].copy_from_slice(&ts.to_be_bytes());
    }
    let crc = crc32c::crc32c(&b[21..]);
    b[17..21].copy_from_slice(&crc.to_be_bytes());
    b.into()
}

/// ListOffsets by time and `MAX_TIMESTAMP` answer per record, as Kafka's
/// `FileRecords.searchForTimestamp` and (since KAFKA-16310, Kafka 3.7.1)
/// `RecordBatch.offsetOfMaxTimestamp` do, compressed or not: 50 records in
/// one batch stamped t0, t0+2, ..., asked for t0+10, is offset 5 with its
/// own timestamp (it was the batch's first offset with its newest
/// timestamp); the newest timestamp is its first record's offset (it was
/// the batch's last); zstd batches are answered at batch granularity (see
/// `a_zstd_bomb_is_never_decoded`). A batch stamped with log append time has each record
/// at the batch's timestamp; a batch whose header claims a newer record
/// than it holds is passed over for the next, as Kafka passes it over; a
/// compression bomb past the lookup's read bound is answered at batch
/// granularity, and what its codec kept goes back to the budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_offsets_by_time_answers_per_record_compressed_or_not() {
    use kafka_protocol::messages::list_offsets_request::{ListOffsetsPartition, ListOffsetsTopic};
    use kafka_protocol::messages::{BrokerId, ListOffsetsRequest};
    use kafka_protocol::records::Compression;
    bounded(async {
        let b = start(Config {
            topics: (0..8).map(|i| format!("c{i}")).collect(),
            partitions: 1,
            followers: 0,
            max_message_bytes: 100_000,
            ..Config::default()
        })
        .await;
        let mut w = Wire::connect(b.addr).await.unwrap();
        let t0 = 1_700_000_000_000i64;
        let even: Vec<i64> = (0..50).map(|i| t0 + 2 * i).collect();
        // Newest at record 7, and again at 9: the first of them.
        let mut peaked = even.clone();
        peaked[7] = t0 + 1000;
        peaked[9] = t0 + 1000;
        let codecs = [
            (Compression::None, false),
            (Compression::Gzip, false),
            (Compression::Snappy, false),
            (Compression::Snappy, true),
            (Compression::Lz4, false),
            (Compression::Zstd, false),
        ];
        let ask = |topic: &str, ts: i64| {
            ListOffsetsRequest::default()
                .with_replica_id(BrokerId(-1))
                .with_topics(vec![ListOffsetsTopic::default()
                    .with_name(topic_name(topic))
                    .with_partitions(vec![ListOffsetsPartition::default()
                        .with_partition_index(0)
                        .with_timestamp(ts)])])
        };
        let value = |i: usize| format!("record {i} {}", "x".repeat(i * 40)).into_bytes();
        for (n, &(codec, xerial)) in codecs.iter().enumerate() {
            let topic = format!("c{n}");
            for batch in [
                stamped_batch(&even, value, codec, xerial),
                stamped_batch(&peaked, value, codec, xerial),
            ] {
                let r = w
                    .call(
                        &wire::produce(&topic, 0, -1, Duration::from_secs(5), batch),
                        wire::PRODUCE_VERSION,
                    )
                    .await
                    .unwrap();
                assert_eq!(wire::produce_error(&r), 0, "{codec:?}");
            }
            let mut got = Vec::new();
            for ts in [t0 + 10, t0 + 11, t0 + 98, t0 + 99, -3] {
                let r = w.call(&ask(&topic, ts), 7).await.unwrap();
                let p = &r.topics[0].partitions[0];
                got.push((p.error_code, p.offset, p.timestamp));
            }
            let want = if codec == Compression::Zstd {
                // zstd batches are answered at batch granularity: each
                // batch's first offset and newest timestamp.
                [
                    (0, 0, t0 + 98),
                    (0, 0, t0 + 98),
                    (0, 0, t0 + 98),
                    (0, 50, t0 + 1000),
                    (0, 50, t0 + 1000),
                ]
            } else {
                [
                    (0, 5, t0 + 10),
                    (0, 6, t0 + 12),
                    (0, 49, t0 + 98),
                    // The second batch: its record 7 (offset 57) is the
                    // first that new.
                    (0, 57, t0 + 1000),
                    (0, 57, t0 + 1000),
                ]
            };
            assert_eq!(got, want, "{codec:?} xerial {xerial}");
        }
        // Log append time: every record at the batch's max timestamp.
        let appended = restamp(
            &stamped_batch(&even, value, Compression::Lz4, false),
            0x08,
            Some(t0 + 5000),
        );
        // A header claiming a record newer than any it holds: passed over.
        let lying = restamp(
            &stamped_batch(&even, value, Compression::Snappy, true),
            0,
            Some(t0 + 9000),
        );
        let honest = stamped_batch(&[t0 + 8000, t0 + 9000], value, Compression::Gzip, false);
        for batch in [lying, honest, appended] {
            let r = w
                .call(
                    &wire::produce("c6", 0, -1, Duration::from_secs(5), batch),
                    wire::PRODUCE_VERSION,
                )
                .await
                .unwrap();
            assert_eq!(wire::produce_error(&r), 0);
        }
        let mut got = Vec::new();
        for ts in [t0 + 8500, t0 + 9000, -3, t0 + 9001] {
            let r = w.call(&ask("c6", ts), 7).await.unwrap();
            let p = &r.topics[0].partitions[0];
            got.push((p.offset, p.timestamp));
        }
        assert_eq!(
            got,
            [
                (51, t0 + 9000),
                (51, t0 + 9000),
                // The lying batch holds the newest timestamp first; no
                // record of it has it: no offset, as Kafka answers.
                (-1, -1),
                (-1, -1),
            ]
        );
        // The log append time batch alone.
        let appended = restamp(
            &stamped_batch(&even, value, Compression::Snappy, false),
            0x08,
            Some(t0 + 5000),
        );
        let r = w
            .call(
                &wire::produce("c7", 0, -1, Duration::from_secs(5), appended),
                wire::PRODUCE_VERSION,
            )
            .await
            .unwrap();
        assert_eq!(wire::produce_error(&r), 0);
        for ts in [t0, t0 + 5000, -3] {
            let r = w.call(&ask("c7", ts), 7).await.unwrap();
            let p = &r.topics[0].partitions[0];
            assert_eq!((p.offset, p.timestamp), (0, t0 + 5000), "{ts}");
        }
        // A bomb: 16 MiB of zeros in one record (16 KiB of gzip), past the
        // 64 x 100,000 bytes one lookup reads: the batch's first offset and
        // newest timestamp, at once, and nothing left charged.
        let bomb = stamped_batch(
            &[t0 + 6000, t0 + 6050],
            |i| {
                if i == 0 {
                    vec![0; 16 << 20]
                } else {
                    b"z".to_vec()
                }
            },
            Compression::Gzip,
            false,
        );
        assert!(bomb.len() < 100_000, "{}", bomb.len());
        let r = w
            .call(
                &wire::produce("c7", 0, -1, Duration::from_secs(5), bomb),
                wire::PRODUCE_VERSION,
            )
            .await
            .unwrap();
        assert_eq!(wire::produce_error(&r), 0);
        let r = w.call(&ask("c7", t0 + 6010), 7).await.unwrap();
        let p = &r.topics[0].partitions[0];
        assert_eq!((p.offset, p.timestamp), (50, t0 + 6050));
        until("the codecs' memory is given back", || {
            b.broker.budget.in_use() == 0
        })
        .await;
        b.shutdown().await;
    })
    .await
}

/// A batch of records stamped `timestamps`, in an LZ4 frame declaring 4 MiB
/// blocks (what the broker charges for reading it: some 12 MiB).
fn lz4_4mib_batch(timestamps: &[i64]) -> bytes::Bytes {
    use bytes::BufMut;
    use kafka_protocol::records::{Compression, Record, RecordBatchEncoder, RecordEncodeOptions};
    use std::io::Write;
    let records: Vec<Record> = timestamps
        .iter()
        .enumerate()
        .map(|(i, &timestamp)| {
            wire::record(
                i,
                i as i32 - 1,
                timestamp,
                format!("record {i}").into_bytes().into(),
            )
        })
        .collect();
    let compress = |plain: &mut bytes::BytesMut, out: &mut bytes::BytesMut, _: Compression| {
        let info = lz4_flex::frame::FrameInfo::new().block_size(lz4_flex::frame::BlockSize::Max4MB);
        let mut e = lz4_flex::frame::FrameEncoder::with_frame_info(info, Vec::new());
        e.write_all(plain)?;
        out.put_slice(&e.finish()?);
        Ok(())
    };
    let mut out = bytes::BytesMut::new();
    RecordBatchEncoder::encode_with_custom_compression(
        &mut out,
        &records,
        &RecordEncodeOptions {
            version: 2,
            compression: Compression::Lz4,
        },
        Some(compress),
    )
    .expect("the batch encodes");
    out.freeze()
}

/// What reading a batch's records takes (its codec's state) is charged
/// while that batch is read, not until the answer is written: one
/// `MAX_TIMESTAMP` lookup of four partitions whose batches each charge some
/// 12 MiB (LZ4, 4 MiB blocks) reads them all per record on a 30 MiB budget
/// (the charges accumulated, and the third partition's found no room: it
/// was answered at batch granularity), and nothing stays charged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_offsets_charges_each_batch_only_while_it_is_read() {
    use kafka_protocol::messages::list_offsets_request::{ListOffsetsPartition, ListOffsetsTopic};
    use kafka_protocol::messages::{BrokerId, ListOffsetsRequest};
    bounded(async {
        let b = start(Config {
            topics: vec!["t".into()],
            partitions: 4,
            followers: 0,
            max_request_bytes: 1 << 20,
            max_decoded_bytes: 1 << 20,
            memory_budget: 30 << 20,
            ..Config::default()
        })
        .await;
        let mut w = Wire::connect(b.addr).await.unwrap();
        let t0 = 1_700_000_000_000i64;
        for p in 0..4 {
            let batch = lz4_4mib_batch(&[t0, t0 + 5, t0 + 1]);
            let r = w
                .call(
                    &wire::produce("t", p, -1, Duration::from_secs(5), batch),
                    wire::PRODUCE_VERSION,
                )
                .await
                .unwrap();
            assert_eq!(wire::produce_error(&r), 0);
        }
        let ask = ListOffsetsRequest::default()
            .with_replica_id(BrokerId(-1))
            .with_topics(vec![ListOffsetsTopic::default()
                .with_name(topic_name("t"))
                .with_partitions(
                    (0..4)
                        .map(|p| {
                            ListOffsetsPartition::default()
                                .with_partition_index(p)
                                .with_timestamp(-3)
                        })
                        .collect(),
                )]);
        let r = w.call(&ask, 7).await.unwrap();
        let got: Vec<_> = r.topics[0]
            .partitions
            .iter()
            .map(|p| (p.error_code, p.offset, p.timestamp))
            .collect();
        assert_eq!(got, vec![(0, 1, t0 + 5); 4], "each read per record");
        until("nothing charged", || b.broker.budget.in_use() == 0).await;
        b.shutdown().await;
    })
    .await
}

/// Uncompressed batches are read against the lookup's read bound too: a log
/// of 200 batches whose headers each claim a record at `i64::MAX` but whose
/// records are older is not walked whole by each lookup by time (each batch
/// is passed over for the next, as Kafka passes it over); once the lookup
/// has read 64 times `max_message_bytes`, the batch it is at is answered at
/// batch granularity.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lying_uncompressed_batches_are_read_within_the_bound() {
    use kafka_protocol::messages::list_offsets_request::{ListOffsetsPartition, ListOffsetsTopic};
    use kafka_protocol::messages::{BrokerId, ListOffsetsRequest};
    use kafka_protocol::records::Compression;
    bounded(async {
        let b = start(Config {
            topics: vec!["t".into()],
            partitions: 1,
            followers: 0,
            max_message_bytes: 2_000,
            ..Config::default()
        })
        .await;
        let mut w = Wire::connect(b.addr).await.unwrap();
        let t0 = 1_700_000_000_000i64;
        let lying = restamp(
            &stamped_batch(&[t0], |_| vec![b'x'; 1_500], Compression::None, false),
            0,
            Some(i64::MAX),
        );
        assert!(lying.len() <= 2_000, "{}", lying.len());
        for _ in 0..200 {
            let r = w
                .call(
                    &wire::produce("t", 0, -1, Duration::from_secs(5), lying.clone()),
                    wire::PRODUCE_VERSION,
                )
                .await
                .unwrap();
            assert_eq!(wire::produce_error(&r), 0);
        }
        let ask = ListOffsetsRequest::default()
            .with_replica_id(BrokerId(-1))
            .with_topics(vec![ListOffsetsTopic::default()
                .with_name(topic_name("t"))
                .with_partitions(vec![ListOffsetsPartition::default()
                    .with_partition_index(0)
                    .with_timestamp(t0 + 1)])]);
        let r = w.call(&ask, 7).await.unwrap();
        let p = &r.topics[0].partitions[0];
        // 128,000 bytes read: some 80 batches of some 1,560 bytes.
        assert_eq!(p.timestamp, i64::MAX, "answered at batch granularity");
        assert!(
            (50..120).contains(&p.offset),
            "the batch reached once the bound was: {}",
            p.offset
        );
        b.shutdown().await;
    })
    .await
}

fn topic_name(s: &str) -> kafka_protocol::messages::TopicName {
    kafka_protocol::messages::TopicName(kafka_protocol::protocol::StrBytes::from_string(
        s.to_string(),
    ))
}

/// A raw request frame (size, header, body), for requests written several at
/// a time on one connection.
fn raw_frame<R: kafka_protocol::protocol::Request>(req: &R, version: i16, id: i32) -> Vec<u8> {
    use bytes::BufMut;
    use kafka_protocol::messages::RequestHeader;
    use kafka_protocol::protocol::{Encodable, StrBytes};
    let mut out = bytes::BytesMut::new();
    out.put_i32(0);
    RequestHeader::default()
        .with_request_api_key(R::KEY)
        .with_request_api_version(version)
        .with_correlation_id(id)
        .with_client_id(Some(StrBytes::from_static_str("raw")))
        .encode(&mut out, R::header_version(version))
        .unwrap();
    req.encode(&mut out, version).unwrap();
    let size = (out.len() - 4) as i32;
    out[..4].copy_from_slice(&size.to_be_bytes());
    out.to_vec()
}

/// Reads one answer to an `R` sent at `version`: its correlation id and
/// body; `None` once the broker has closed the connection.
async fn read_answer<R: kafka_protocol::protocol::Request>(
    conn: &mut tokio::net::TcpStream,
    version: i16,
) -> Option<(i32, R::Response)> {
    use kafka_protocol::messages::ResponseHeader;
    use kafka_protocol::protocol::{Decodable, HeaderVersion};
    use tokio::io::AsyncReadExt;
    let size = conn.read_i32().await.ok()?;
    let mut body = vec![0; size.clamp(0, 1 << 24) as usize];
    conn.read_exact(&mut body).await.ok()?;
    let mut body = bytes::Bytes::from(body);
    let h = ResponseHeader::decode(&mut body, R::Response::header_version(version)).unwrap();
    Some((
        h.correlation_id,
        R::Response::decode(&mut body, version).unwrap(),
    ))
}

/// The values of the records in `records` (uncompressed batches).
fn values(records: &bytes::Bytes) -> Vec<Vec<u8>> {
    kafka_protocol::records::RecordBatchDecoder::decode_all(&mut records.clone())
        .unwrap()
        .into_iter()
        .flat_map(|b| b.records)
        .map(|r| r.value.unwrap().to_vec())
        .collect()
}

/// Kafka keys a request's partitions by topic and partition: a fetch naming
/// one partition 3,000 times is one partition of its answer with one watch
/// (each high watermark move checks it once, not 3,000 times, each time over
/// 3,000 entries), and a produce naming one partition 1,000 times appends
/// once, the records named last, and answers once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_named_many_times_is_one_partition_of_the_request() {
    use kafka_protocol::messages::produce_request::{PartitionProduceData, TopicProduceData};
    use kafka_protocol::messages::{FetchRequest, ProduceRequest};
    bounded(async {
        let b = start(Config {
            followers: 0,
            topics: vec![TOPIC.into()],
            ..Config::default()
        })
        .await;
        let mut f = Wire::connect(b.addr).await.unwrap();
        let fetch = wire::fetch(
            TOPIC,
            &vec![(0, 0); 3000],
            Duration::from_millis(300),
            i32::MAX,
            1 << 20,
        );
        f.send(&fetch, wire::FETCH_VERSION).await.unwrap();
        until("parked and watching", || {
            b.broker.fetches.delayed() == 1 && b.broker.fetches.metrics().watched > 0
        })
        .await;
        // (Time for a registration of more watches to finish: a wait for
        // something that must not happen, so a short fixed one.)
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(b.broker.fetches.metrics().watched, 1, "one watch");
        let mut p = Wire::connect(b.addr).await.unwrap();
        for _ in 0..3 {
            let r = p.append(TOPIC, 0, &[b"x"]).await.unwrap();
            assert_eq!(wire::produce_error(&r), 0);
        }
        let checked = b.broker.fetches.metrics().checks.level_advances.checked;
        assert!(
            checked <= 3,
            "3 high watermark moves checked the fetch {checked} times"
        );
        let r = f
            .receive::<FetchRequest>(wire::FETCH_VERSION)
            .await
            .unwrap();
        assert_eq!(r.responses.len(), 1);
        assert_eq!(r.responses[0].partitions.len(), 1);
        assert_eq!(r.responses[0].partitions[0].error_code, 0);

        // A produce naming partition 1 a thousand times (and its topic
        // twice), acks=all.
        let entry = |v: &[u8]| {
            PartitionProduceData::default()
                .with_index(1)
                .with_records(Some(wire::batch(&[v])))
        };
        let mut first = vec![entry(b"early"); 999];
        first.push(entry(b"middle"));
        let req = ProduceRequest::default()
            .with_acks(-1)
            .with_timeout_ms(5000)
            .with_topic_data(vec![
                TopicProduceData::default()
                    .with_name(topic_name(TOPIC))
                    .with_partition_data(first),
                TopicProduceData::default()
                    .with_name(topic_name(TOPIC))
                    .with_partition_data(vec![entry(b"last")]),
            ]);
        let r = p.call(&req, wire::PRODUCE_VERSION).await.unwrap();
        assert_eq!(r.responses.len(), 1);
        assert_eq!(r.responses[0].partition_responses.len(), 1);
        assert_eq!(wire::produce_error(&r), 0);
        assert_eq!(b.broker.topics.partition(TOPIC, 1).unwrap().log_end(), 1);
        let r = p
            .call(
                &wire::fetch(TOPIC, &[(1, 0)], Duration::ZERO, 1, 1 << 20),
                wire::FETCH_VERSION,
            )
            .await
            .unwrap();
        let stored = values(r.responses[0].partitions[0].records.as_ref().unwrap());
        assert_eq!(stored, [b"last".to_vec()], "the records named last");
    })
    .await
}

/// The logs together hold at most `max_log_bytes`: past it the oldest
/// batches go first, across partitions, whole, and each partition's log
/// start moves up past what it lost, as Kafka's size-based retention does
/// (ListOffsets earliest follows it, a fetch below it is out of range); a
/// batch over `max_message_bytes` is refused MESSAGE_TOO_LARGE.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_logs_keep_at_most_max_log_bytes_dropping_the_oldest_batches() {
    use kafka_protocol::messages::list_offsets_request::{ListOffsetsPartition, ListOffsetsTopic};
    use kafka_protocol::messages::{BrokerId, ListOffsetsRequest};
    bounded(async {
        assert_eq!(
            Config::default().max_message_bytes,
            1_048_588,
            "Kafka's default"
        );
        let limit = 16 << 10;
        let b = start(Config {
            followers: 0,
            topics: vec![TOPIC.into()],
            max_message_bytes: 4096,
            max_log_bytes: limit,
            ..Config::default()
        })
        .await;
        let mut w = Wire::connect(b.addr).await.unwrap();
        let value = vec![7u8; 3000];
        // The oldest batch, on partition 1; then partition 0.
        let r = w.append(TOPIC, 1, &[&value]).await.unwrap();
        assert_eq!(wire::produce_error(&r), 0);
        let cost = b.broker.topics.log_bytes();
        let room = (limit / cost) as u64;
        assert!((2..10).contains(&room), "{room} batches fit");
        for _ in 0..10 {
            let r = w.append(TOPIC, 0, &[&value]).await.unwrap();
            assert_eq!(wire::produce_error(&r), 0);
            assert!(b.broker.topics.log_bytes() <= limit);
        }
        let (p0, p1) = (
            b.broker.topics.partition(TOPIC, 0).unwrap(),
            b.broker.topics.partition(TOPIC, 1).unwrap(),
        );
        assert_eq!(
            (p1.log_start(), p1.log_end()),
            (1, 1),
            "the oldest went first"
        );
        assert_eq!((p0.log_start(), p0.log_end()), (10 - room, 10));
        // A produce's answer carries the log start.
        let r = w.append(TOPIC, 0, &[&value]).await.unwrap();
        let start = 11 - room;
        assert_eq!(
            r.responses[0].partition_responses[0].log_start_offset,
            start as i64
        );
        // Earliest is the log start; a fetch below it is out of range; one
        // at it reads the batches kept, whole.
        let earliest = w
            .call(
                &ListOffsetsRequest::default()
                    .with_replica_id(BrokerId(-1))
                    .with_topics(vec![ListOffsetsTopic::default()
                        .with_name(topic_name(TOPIC))
                        .with_partitions(vec![ListOffsetsPartition::default()
                            .with_partition_index(0)
                            .with_timestamp(-2)])]),
                7,
            )
            .await
            .unwrap();
        assert_eq!(earliest.topics[0].partitions[0].offset, start as i64);
        let f = w
            .call(
                &wire::fetch(
                    TOPIC,
                    &[(0, 0), (0, start as i64)],
                    Duration::ZERO,
                    1,
                    1 << 20,
                ),
                wire::FETCH_VERSION,
            )
            .await
            .unwrap();
        // The same partition twice: one answer, the position named last.
        let p = &f.responses[0].partitions;
        assert_eq!(p.len(), 1);
        assert_eq!((p[0].error_code, p[0].log_start_offset), (0, start as i64));
        assert_eq!(values(p[0].records.as_ref().unwrap()).len() as u64, room);
        let f = w
            .call(
                &wire::fetch(TOPIC, &[(0, 0)], Duration::ZERO, 1, 1 << 20),
                wire::FETCH_VERSION,
            )
            .await
            .unwrap();
        assert_eq!(
            f.responses[0].partitions[0].error_code,
            ResponseError::OffsetOutOfRange.code()
        );
        // One byte over max_message_bytes is refused, at it is stored.
        let overhead = wire::batch(&[b""]).len();
        let at = vec![1u8; 4096 - overhead - 2];
        let r = w.append(TOPIC, 1, &[&at]).await.unwrap();
        assert_eq!(wire::batch(&[&at]).len(), 4096);
        assert_eq!(wire::produce_error(&r), 0);
        let over = vec![1u8; 4096 - overhead - 1];
        let r = w.append(TOPIC, 1, &[&over]).await.unwrap();
        assert_eq!(
            wire::produce_error(&r),
            ResponseError::MessageTooLarge.code()
        );
        assert_eq!(p1.log_end(), 2);
        assert!(b.broker.topics.log_bytes() <= limit);
        // A broker whose logs could not hold the largest batch is refused.
        let refused = BrokerHandle::start(Config {
            listen: "127.0.0.1:0".parse().unwrap(),
            max_log_bytes: Config::default().max_message_bytes,
            ..Config::default()
        })
        .await;
        assert!(refused.is_err());
    })
    .await
}

/// Retention drops only what is replicated, as Kafka's does: with a follower
/// stuck, the logs fill with what it has not copied, and appends past them
/// are refused KAFKA_STORAGE_ERROR (retriable) until it catches up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_drops_only_what_is_replicated() {
    bounded(async {
        let limit = 16 << 10;
        let b = start(Config {
            followers: 1,
            stuck_follower: Some(0),
            topics: vec![TOPIC.into()],
            max_message_bytes: 4096,
            max_log_bytes: limit,
            ..Config::default()
        })
        .await;
        let mut w = Wire::connect(b.addr).await.unwrap();
        let value = vec![7u8; 3000];
        let mut stored = 0;
        let code = loop {
            let r = w.append(TOPIC, 0, &[&value]).await.unwrap();
            match wire::produce_error(&r) {
                0 => stored += 1,
                code => break code,
            }
            assert!(stored < 10, "the logs keep filling past {limit} bytes");
        };
        assert_eq!(code, ResponseError::KafkaStorageError.code());
        let part = b.broker.topics.partition(TOPIC, 0).unwrap();
        assert_eq!((part.log_start(), part.log_end()), (0, stored));
        assert!(b.broker.topics.log_bytes() <= limit);
        b.broker.set_stuck(0, false);
        until("the follower catches up", || {
            part.high_watermark() == stored
        })
        .await;
        let r = w.append(TOPIC, 0, &[&value]).await.unwrap();
        assert_eq!(wire::produce_error(&r), 0);
        assert!(part.log_start() > 0);
        assert!(b.broker.topics.log_bytes() <= limit);
    })
    .await
}

/// An append refused for want of room drops nothing: what dropping the
/// replicated batches would free is added up first, and here it is not
/// enough, so partition 1's replicated batch stays (it once went anyway,
/// moving its log start for an append that was then refused).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_append_drops_nothing() {
    bounded(async {
        let limit = 16 << 10;
        let b = start(Config {
            followers: 1,
            replica_lag: Duration::from_millis(1),
            topics: vec![TOPIC.into()],
            max_message_bytes: 4096,
            max_log_bytes: limit,
            ..Config::default()
        })
        .await;
        let mut w = Wire::connect(b.addr).await.unwrap();
        // One small replicated batch, on partition 1.
        let r = w.append(TOPIC, 1, &[b"keep me"]).await.unwrap();
        assert_eq!(wire::produce_error(&r), 0);
        let p1 = b.broker.topics.partition(TOPIC, 1).unwrap();
        until("it is replicated", || p1.high_watermark() == 1).await;
        // The follower stops copying; small batches it does not copy fill
        // the logs up to near the limit.
        b.broker.set_stuck(0, true);
        while b.broker.topics.log_bytes() + 600 <= limit {
            let r = w.append(TOPIC, 0, &[&[1u8; 300]]).await.unwrap();
            assert_eq!(wire::produce_error(&r), 0);
        }
        // A batch that would not fit even with the replicated one dropped.
        let big = [2u8; 3900];
        let r = w.append(TOPIC, 0, &[&big]).await.unwrap();
        assert_eq!(
            wire::produce_error(&r),
            ResponseError::KafkaStorageError.code()
        );
        assert_eq!((p1.log_start(), p1.log_end()), (0, 1), "nothing dropped");
        // Retriable: once the follower has caught up there is room.
        b.broker.set_stuck(0, false);
        let p0 = b.broker.topics.partition(TOPIC, 0).unwrap();
        until("the follower catches up", || {
            p0.high_watermark() == p0.log_end()
        })
        .await;
        let r = w.append(TOPIC, 0, &[&big]).await.unwrap();
        assert_eq!(wire::produce_error(&r), 0);
        assert_eq!(p1.log_start(), 1, "the oldest went first");
        assert!(b.broker.topics.log_bytes() <= limit);
        b.shutdown().await;
    })
    .await
}

/// Retention looks past batches that are not replicated yet at the front of
/// its order (32 of them, with their partitions' batches behind them) for
/// the replicated batches of other partitions: one partition waiting for its
/// follower does not refuse every append. With more than that in the way,
/// an append that needs room is refused. The follower is stuck: the test
/// copies partitions by hand, as the follower would.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_looks_past_batches_not_replicated_yet() {
    bounded(async {
        let limit = 32 << 10;
        let b = start(Config {
            followers: 1,
            stuck_follower: Some(0),
            partitions: 40,
            topics: vec![TOPIC.into()],
            max_message_bytes: 4096,
            max_log_bytes: limit,
            ..Config::default()
        })
        .await;
        let mut w = Wire::connect(b.addr).await.unwrap();
        let part = |p| b.broker.topics.partition(TOPIC, p).unwrap();
        // Partition `p` copied up to its log end by the (only) follower.
        let copy = |p| {
            let p = part(p);
            if let Some(hw) = p.copied(0, p.log_end(), Instant::now()) {
                b.broker.high_watermark_moved(&p, hw);
            }
        };
        // The oldest batches: one small one on each of partitions 0 to 32,
        // none copied: 33 in the way.
        for p in 0..=32 {
            let r = w.append(TOPIC, p, &[b"wait"]).await.unwrap();
            assert_eq!(wire::produce_error(&r), 0);
        }
        // Then partition 39's, each copied at once, until the logs are full.
        let last = part(39);
        let value = vec![7u8; 3000];
        let code = loop {
            let r = w.append(TOPIC, 39, &[&value]).await.unwrap();
            match wire::produce_error(&r) {
                0 => copy(39),
                code => break code,
            }
            assert!(last.log_end() < 20, "the logs keep filling");
        };
        assert_eq!(code, ResponseError::KafkaStorageError.code());
        assert_eq!(last.log_start(), 0);
        // Partition 0's copied and dropped first: 32 left in the way, and
        // retention looks past them to partition 39's.
        copy(0);
        for _ in 0..10 {
            let r = w.append(TOPIC, 39, &[&value]).await.unwrap();
            assert_eq!(wire::produce_error(&r), 0);
            copy(39);
            assert!(b.broker.topics.log_bytes() <= limit);
        }
        assert_eq!(part(0).log_start(), 1);
        assert!(last.log_start() >= 10);
        for p in 1..=32 {
            let p = part(p);
            assert_eq!((p.log_start(), p.high_watermark(), p.log_end()), (0, 0, 1));
        }
        b.shutdown().await;
    })
    .await
}

/// `batch(values)` with `edit` applied and its CRC made right again.
fn edited_batch(values: &[&[u8]], edit: impl FnOnce(&mut [u8])) -> bytes::Bytes {
    let mut b = wire::batch(values).to_vec();
    edit(&mut b);
    let crc = crc32c::crc32c(&b[21..]);
    b[17..21].copy_from_slice(&crc.to_be_bytes());
    b.into()
}

/// A produce's records are refused as Kafka refuses them
/// (`ProduceRequest.validateRecords`, `UnifiedLog.analyzeAndValidateRecords`,
/// `LogValidator`): INVALID_RECORD for no batch, two batches, a batch of an
/// older format or a base offset other than 0; CORRUPT_MESSAGE for a codec
/// id that does not exist (5 to 7) or compressed bytes that are not that
/// codec's; UNSUPPORTED_COMPRESSION_TYPE for zstd before produce version 7.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn record_sets_are_refused_as_kafka_refuses_them() {
    bounded(async {
        let b = start(Config {
            followers: 0,
            topics: vec![TOPIC.into()],
            ..Config::default()
        })
        .await;
        let mut w = Wire::connect(b.addr).await.unwrap();
        let one = wire::batch(&[b"x"]);
        let codec = |id: u8| edited_batch(&[b"hello world"], |b| b[22] = (b[22] & !7) | id);
        let zstd = edited_batch(&[b"hello world"], |b| {
            b[22] = (b[22] & !7) | 4;
            b[61..65].copy_from_slice(&[0x28, 0xb5, 0x2f, 0xfd]);
        });
        let invalid = ResponseError::InvalidRecord.code();
        let corrupt = ResponseError::CorruptMessage.code();
        let cases = [
            (
                "two batches",
                [&one[..], &one[..]].concat().into(),
                7,
                invalid,
            ),
            ("no batch", bytes::Bytes::new(), 7, invalid),
            ("magic 1", edited_batch(&[b"x"], |b| b[16] = 1), 7, invalid),
            (
                "base offset 5",
                edited_batch(&[b"x"], |b| b[..8].copy_from_slice(&5i64.to_be_bytes())),
                7,
                invalid,
            ),
            ("codec 5", codec(5), 7, corrupt),
            ("codec 6", codec(6), 7, corrupt),
            ("codec 7", codec(7), 7, corrupt),
            ("gzip that is not", codec(1), 7, corrupt),
            (
                "zstd in version 3",
                zstd.clone(),
                3,
                ResponseError::UnsupportedCompressionType.code(),
            ),
        ];
        for (what, records, version, code) in cases {
            let r = w
                .call(
                    &wire::produce(TOPIC, 0, 1, Duration::from_secs(5), records),
                    version,
                )
                .await
                .unwrap();
            assert_eq!(wire::produce_error(&r), code, "{what}");
        }
        let part = b.broker.topics.partition(TOPIC, 0).unwrap();
        assert_eq!(part.log_end(), 0, "none stored");
        // Zstd from version 7 is stored as sent (this broker has no codecs:
        // it checks the stream's opening, not its contents).
        let r = w
            .call(&wire::produce(TOPIC, 0, 1, Duration::from_secs(5), zstd), 7)
            .await
            .unwrap();
        assert_eq!(wire::produce_error(&r), 0);
        assert_eq!(part.log_end(), 1);
    })
    .await
}

/// Kafka's `KafkaApis.handleProduceRequest`: an acks=0 produce that fails
/// closes its connection (the producer reads no answer; the close is how it
/// finds out, and it refreshes its metadata). One that succeeds does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acks_0_produce_that_fails_closes_its_connection() {
    use kafka_protocol::messages::ApiVersionsRequest;
    use tokio::io::AsyncWriteExt;
    bounded(async {
        let b = start(Config {
            followers: 0,
            topics: vec![TOPIC.into()],
            ..Config::default()
        })
        .await;
        let ok = wire::batch(&[b"x"]);
        for (what, topic, partition, records, closes) in [
            ("appended", TOPIC, 0, ok.clone(), false),
            ("unknown topic", "nope", 0, ok.clone(), true),
            ("unknown partition", TOPIC, 99, ok, true),
            (
                "corrupt batch",
                TOPIC,
                0,
                wire::corrupt_batch(&[b"x"]),
                true,
            ),
        ] {
            let mut c = tokio::net::TcpStream::connect(b.addr).await.unwrap();
            let req = wire::produce(topic, partition, 0, Duration::from_secs(5), records);
            let mut both = raw_frame(&req, wire::PRODUCE_VERSION, 1);
            both.extend(raw_frame(&ApiVersionsRequest::default(), 0, 2));
            c.write_all(&both).await.unwrap();
            let next = read_answer::<ApiVersionsRequest>(&mut c, 0).await;
            assert_eq!(next.is_none(), closes, "{what}");
        }
        assert_eq!(b.broker.topics.partition(TOPIC, 0).unwrap().log_end(), 1);
    })
    .await
}

/// Kafka mutes a connection while its request is in flight and reads the
/// next one after answering: a request pipelined behind a fetch that waits
/// longer than `frame_timeout` waits its turn and is answered, in order
/// (Java producers pipeline up to five requests).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_pipelined_behind_a_waiting_one_are_answered_in_order() {
    use kafka_protocol::messages::{ApiVersionsRequest, FetchRequest};
    use tokio::io::AsyncWriteExt;
    bounded(async {
        let b = start(Config {
            followers: 0,
            topics: vec![TOPIC.into()],
            frame_timeout: Duration::from_millis(200),
            ..Config::default()
        })
        .await;
        let mut c = tokio::net::TcpStream::connect(b.addr).await.unwrap();
        let fetch = wire::fetch(TOPIC, &[(0, 0)], Duration::from_millis(600), 1, 1 << 20);
        let mut all = raw_frame(&fetch, wire::FETCH_VERSION, 1);
        for id in 2..4 {
            all.extend(raw_frame(&ApiVersionsRequest::default(), 0, id));
        }
        c.write_all(&all).await.unwrap();
        let t = Instant::now();
        let (id, _) = read_answer::<FetchRequest>(&mut c, wire::FETCH_VERSION)
            .await
            .expect("the fetch is answered at its max_wait");
        assert_eq!(id, 1);
        assert!(t.elapsed() >= Duration::from_millis(500));
        for want in 2..4 {
            let (id, r) = read_answer::<ApiVersionsRequest>(&mut c, 0)
                .await
                .expect("answered");
            assert_eq!((id, r.error_code), (want, 0));
        }
    })
    .await
}

/// Kafka's `DelayedFetch` counts at most a partition's
/// `partition_max_bytes` towards `min_bytes`: three batches readable, of
/// which one batch's size counts, do not meet twice that; the fetch waits
/// for its `max_wait`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn min_bytes_counts_at_most_partition_max_bytes_of_each_partition() {
    bounded(async {
        let b = start(Config {
            followers: 0,
            topics: vec![TOPIC.into()],
            ..Config::default()
        })
        .await;
        let mut w = Wire::connect(b.addr).await.unwrap();
        for _ in 0..3 {
            w.append(TOPIC, 0, &[&[0u8; 30]]).await.unwrap();
        }
        let one = wire::batch(&[&[0u8; 30]]).len() as i32;
        let fetch = wire::fetch(TOPIC, &[(0, 0)], Duration::from_millis(300), 2 * one, one);
        let t = Instant::now();
        let f = w.call(&fetch, wire::FETCH_VERSION).await.unwrap();
        assert!(
            t.elapsed() >= Duration::from_millis(250),
            "answered after {:?}",
            t.elapsed()
        );
        assert_eq!(
            values(f.responses[0].partitions[0].records.as_ref().unwrap()).len(),
            1
        );
        // Counted in full, the same three batches meet it at once.
        let fetch = wire::fetch(TOPIC, &[(0, 0)], Duration::from_secs(10), 2 * one, 3 * one);
        let t = Instant::now();
        w.call(&fetch, wire::FETCH_VERSION).await.unwrap();
        assert!(t.elapsed() < Duration::from_secs(5));
    })
    .await
}

/// Smaller answers as Kafka gives them: a produce's `log_start_offset`; a
/// ListOffsets naming a partition twice (INVALID_REQUEST at each mention);
/// ApiVersions v3 with a client software name Kafka refuses
/// (INVALID_REQUEST); an incremental fetch in a session the broker does not
/// have (FETCH_SESSION_ID_NOT_FOUND, no partitions: sessions are not kept,
/// and a full fetch is answered with session id 0, no session made); and
/// ApiVersions at a version the broker does not serve (answered v0,
/// UNSUPPORTED_VERSION, with the versions it does).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smaller_answers_as_kafka_gives_them() {
    use bytes::BufMut;
    use kafka_protocol::messages::list_offsets_request::{ListOffsetsPartition, ListOffsetsTopic};
    use kafka_protocol::messages::{ApiVersionsRequest, BrokerId, ListOffsetsRequest};
    use kafka_protocol::protocol::StrBytes;
    use tokio::io::AsyncWriteExt;
    bounded(async {
        let b = start(Config {
            followers: 0,
            topics: vec![TOPIC.into()],
            ..Config::default()
        })
        .await;
        let mut w = Wire::connect(b.addr).await.unwrap();
        let r = w.append(TOPIC, 0, &[b"x"]).await.unwrap();
        assert_eq!(r.responses[0].partition_responses[0].log_start_offset, 0);
        let at = |p: i32, ts: i64| {
            ListOffsetsPartition::default()
                .with_partition_index(p)
                .with_timestamp(ts)
        };
        let lo = w
            .call(
                &ListOffsetsRequest::default()
                    .with_replica_id(BrokerId(-1))
                    .with_topics(vec![
                        ListOffsetsTopic::default()
                            .with_name(topic_name(TOPIC))
                            .with_partitions(vec![at(0, -1), at(1, -1)]),
                        ListOffsetsTopic::default()
                            .with_name(topic_name(TOPIC))
                            .with_partitions(vec![at(0, -2)]),
                    ]),
                5,
            )
            .await
            .unwrap();
        let codes: Vec<Vec<i16>> = lo
            .topics
            .iter()
            .map(|t| t.partitions.iter().map(|p| p.error_code).collect())
            .collect();
        let dup = ResponseError::InvalidRequest.code();
        assert_eq!(codes, [vec![dup, 0], vec![dup]]);
        // ApiVersions v3 names the client's software.
        let named = |name: &'static str| {
            ApiVersionsRequest::default()
                .with_client_software_name(StrBytes::from_static_str(name))
                .with_client_software_version(StrBytes::from_static_str("1.0"))
        };
        for (name, code) in [
            ("rskafka", 0),
            ("a", 0),
            ("bad name!", dup),
            ("-dash", dup),
            ("dot.", dup),
            ("", dup),
        ] {
            let r = w.call(&named(name), 3).await.unwrap();
            assert_eq!(r.error_code, code, "{name:?}");
            assert_eq!(r.api_keys.is_empty(), code != 0);
        }
        // Fetch sessions.
        for (epoch, code) in [
            (5, ResponseError::FetchSessionIdNotFound.code()),
            (-7, 70),
            (0, 0),
        ] {
            let f = w
                .call(
                    &wire::fetch(TOPIC, &[(0, 0)], Duration::ZERO, 1, 1 << 20)
                        .with_session_id(123)
                        .with_session_epoch(epoch),
                    wire::FETCH_VERSION,
                )
                .await
                .unwrap();
            assert_eq!((f.error_code, f.session_id), (code, 0), "epoch {epoch}");
            assert_eq!(f.responses.is_empty(), code != 0);
        }
        // ApiVersions at versions not served, header v2 from version 3 on
        // (what a flexible client sends), else v1.
        for v in [4i16, 5, 127, -1, i16::MIN] {
            let mut c = tokio::net::TcpStream::connect(b.addr).await.unwrap();
            let mut out = bytes::BytesMut::new();
            out.put_i32(0);
            out.put_i16(18);
            out.put_i16(v);
            out.put_i32(9);
            out.put_i16(1);
            out.put_u8(b'c');
            if v >= 3 {
                out.put_u8(0); // header tags
                out.put_u8(2); // compact "x"
                out.put_u8(b'x');
                out.put_u8(2);
                out.put_u8(b'1');
                out.put_u8(0); // body tags
            }
            let size = (out.len() - 4) as i32;
            out[..4].copy_from_slice(&size.to_be_bytes());
            c.write_all(&out).await.unwrap();
            let (id, r) = read_answer::<ApiVersionsRequest>(&mut c, 0)
                .await
                .unwrap_or_else(|| panic!("v{v}: closed"));
            assert_eq!(id, 9);
            assert_eq!(
                r.error_code,
                ResponseError::UnsupportedVersion.code(),
                "v{v}"
            );
            assert!(!r.api_keys.is_empty());
        }
    })
    .await
}

/// Extreme values are answered as Kafka answers them, and nothing hangs:
/// offsets and partitions out of range both ways, negative limits, extreme
/// ListOffsets timestamps, a fetch waiting `i32::MAX` ms whose client hangs
/// up, acks=all with the longest timeout, timeouts of zero and below with a
/// stuck follower (REQUEST_TIMED_OUT at once), and acks values Kafka refuses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extreme_values_are_answered_as_kafka_answers_them() {
    use kafka_protocol::messages::list_offsets_request::{ListOffsetsPartition, ListOffsetsTopic};
    use kafka_protocol::messages::{BrokerId, ListOffsetsRequest};
    bounded(async {
        let b = start(Config {
            followers: 0,
            topics: vec![TOPIC.into()],
            ..Config::default()
        })
        .await;
        let mut w = Wire::connect(b.addr).await.unwrap();
        w.append(TOPIC, 0, &[b"x"]).await.unwrap();
        // Partition 0 named three times is one partition, the position
        // named last (-1: out of range).
        let t = Instant::now();
        let f = w
            .call(
                &wire::fetch(
                    TOPIC,
                    &[
                        (0, i64::MIN),
                        (0, i64::MAX),
                        (0, -1),
                        (i32::MIN, 0),
                        (i32::MAX, 0),
                    ],
                    Duration::from_secs(20),
                    i32::MAX,
                    i32::MAX,
                ),
                wire::FETCH_VERSION,
            )
            .await
            .unwrap();
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "errors are answered at once"
        );
        let codes: Vec<_> = f.responses[0]
            .partitions
            .iter()
            .map(|p| p.error_code)
            .collect();
        assert_eq!(codes, [1, 3, 3]);
        // Negative limits: answered at once with the first batch (Kafka's
        // minOneMessage).
        let f = w
            .call(
                &wire::fetch(TOPIC, &[(0, 0)], Duration::ZERO, -5, -5).with_max_wait_ms(-1),
                wire::FETCH_VERSION,
            )
            .await
            .unwrap();
        assert!(!f.responses[0].partitions[0]
            .records
            .as_ref()
            .unwrap()
            .is_empty());
        let at = |p: i32, ts: i64| {
            ListOffsetsPartition::default()
                .with_partition_index(p)
                .with_timestamp(ts)
        };
        let lo = w
            .call(
                &ListOffsetsRequest::default()
                    .with_replica_id(BrokerId(-1))
                    .with_topics(vec![ListOffsetsTopic::default()
                        .with_name(topic_name(TOPIC))
                        .with_partitions(vec![at(0, i64::MAX), at(1, i64::MIN), at(-1, -1)])]),
                7,
            )
            .await
            .unwrap();
        let got: Vec<_> = lo.topics[0]
            .partitions
            .iter()
            .map(|p| (p.error_code, p.offset, p.timestamp))
            .collect();
        assert_eq!(got, [(0, -1, -1), (0, -1, -1), (3, -1, -1)]);
        // A fetch waiting i32::MAX ms whose client hangs up: cancelled.
        let mut gone = Wire::connect(b.addr).await.unwrap();
        gone.send(
            &wire::fetch(TOPIC, &[(0, 1)], Duration::ZERO, i32::MAX, 1 << 20)
                .with_max_wait_ms(i32::MAX),
            wire::FETCH_VERSION,
        )
        .await
        .unwrap();
        until("parked", || b.broker.fetches.delayed() == 1).await;
        drop(gone);
        until("cancelled", || b.broker.fetches.delayed() == 0).await;
        // acks=all with the longest timeout completes once replicated.
        let r = w
            .call(
                &wire::produce(TOPIC, 0, -1, Duration::ZERO, wire::batch(&[b"y"]))
                    .with_timeout_ms(i32::MAX),
                wire::PRODUCE_VERSION,
            )
            .await
            .unwrap();
        assert_eq!(wire::produce_error(&r), 0);
        b.shutdown().await;

        let b = start(Config {
            topics: vec![TOPIC.into()],
            stuck_follower: Some(0),
            ..Config::default()
        })
        .await;
        let mut w = Wire::connect(b.addr).await.unwrap();
        for timeout in [0, -5, i32::MIN] {
            let t = Instant::now();
            let r = w
                .call(
                    &wire::produce(TOPIC, 0, -1, Duration::ZERO, wire::batch(&[b"x"]))
                        .with_timeout_ms(timeout),
                    wire::PRODUCE_VERSION,
                )
                .await
                .unwrap();
            assert_eq!(
                wire::produce_error(&r),
                ResponseError::RequestTimedOut.code()
            );
            assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        }
        for acks in [2, -2, i16::MIN, i16::MAX] {
            let r = w
                .call(
                    &wire::produce(TOPIC, 1, acks, Duration::ZERO, wire::batch(&[b"x"])),
                    wire::PRODUCE_VERSION,
                )
                .await
                .unwrap();
            assert_eq!(
                wire::produce_error(&r),
                ResponseError::InvalidRequiredAcks.code()
            );
        }
        assert_eq!(b.broker.topics.partition(TOPIC, 1).unwrap().log_end(), 0);
    })
    .await
}

/// Kafka's `UnifiedLog.fetchOffsetByTimestamp` answers EARLIEST_LOCAL_TIMESTAMP
/// (-4) with the log start offset when remote storage is off (all of a log
/// here is local), whatever the request's version: the same answer as
/// EARLIEST (-2). It was answered "no such record" (-1, -1).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_offsets_earliest_local_is_the_log_start() {
    use kafka_protocol::messages::list_offsets_request::{ListOffsetsPartition, ListOffsetsTopic};
    use kafka_protocol::messages::{BrokerId, ListOffsetsRequest};
    bounded(async {
        let b = start(Config {
            topics: vec![TOPIC.into()],
            ..Config::default()
        })
        .await;
        let mut w = Wire::connect(b.addr).await.unwrap();
        for _ in 0..2 {
            let r = w.append(TOPIC, 0, &[b"v"]).await.unwrap();
            assert_eq!(wire::produce_error(&r), 0);
        }
        let ask = |ts: i64| {
            ListOffsetsRequest::default()
                .with_replica_id(BrokerId(-1))
                .with_topics(vec![ListOffsetsTopic::default()
                    .with_name(topic_name(TOPIC))
                    .with_partitions(vec![ListOffsetsPartition::default()
                        .with_partition_index(0)
                        .with_timestamp(ts)])])
        };
        let mut got = vec![];
        for ts in [-2i64, -4] {
            let r = w.call(&ask(ts), 7).await.unwrap();
            let p = &r.topics[0].partitions[0];
            got.push((p.error_code, p.offset, p.timestamp));
        }
        assert_eq!(got[0], (0, 0, -1));
        assert_eq!(got[1], got[0], "-4 against -2 (error, offset, timestamp)");
        b.shutdown().await;
    })
    .await
}

/// Topics created on first use stop at `max_partitions` as at `max_topics`:
/// the partition state clients can make the broker keep is bounded however
/// many partitions a topic has (a topic it does not create is answered
/// UNKNOWN_TOPIC_OR_PARTITION, as one past `max_topics` is).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn creation_on_first_use_stops_at_max_partitions() {
    use kafka_protocol::messages::metadata_request::MetadataRequestTopic;
    use kafka_protocol::messages::MetadataRequest;
    bounded(async {
        let b = start(Config {
            partitions: 4,
            max_partitions: 10,
            ..Config::default()
        })
        .await;
        let mut w = Wire::connect(b.addr).await.unwrap();
        let mut codes = vec![];
        for name in ["a", "b", "c", "a"] {
            let req = MetadataRequest::default()
                .with_topics(Some(vec![
                    MetadataRequestTopic::default().with_name(Some(topic_name(name)))
                ]))
                .with_allow_auto_topic_creation(true);
            let r = w.call(&req, 9).await.unwrap();
            codes.push((r.topics[0].error_code, r.topics[0].partitions.len()));
        }
        let unknown = ResponseError::UnknownTopicOrPartition.code();
        assert_eq!(codes, [(0, 4), (0, 4), (unknown, 0), (0, 4)]);
        assert_eq!(b.broker.topics.all_partitions().len(), 8);
        b.shutdown().await;
    })
    .await
}

/// Connections past `max_connections` wait for a place (as Kafka's acceptor
/// waits for a slot at `max.connections`): with two allowed and two open, a
/// third is not accepted, its request unanswered, until one of the two
/// closes; then it is served. One client can no longer open connections
/// until the process has no descriptor left (where accepting failed at once,
/// and the accept loop spun: see `out_of_descriptors_the_accept_loop_pauses`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_limit_wait_for_a_place() {
    use kafka_protocol::messages::ApiVersionsRequest;
    bounded(async {
        let b = start(Config {
            max_connections: 2,
            ..Config::default()
        })
        .await;
        let versions = ApiVersionsRequest::default();
        let mut one = Wire::connect(b.addr).await.unwrap();
        let mut two = Wire::connect(b.addr).await.unwrap();
        for w in [&mut one, &mut two] {
            assert_eq!(w.call(&versions, 2).await.unwrap().error_code, 0);
        }
        assert_eq!(b.broker.open_connections(), 2);
        // The kernel completes the third's handshake (the listen backlog);
        // the broker does not take it.
        let mut three = Wire::connect(b.addr).await.unwrap();
        three.send(&versions, 2).await.unwrap();
        let early = tokio::time::timeout(
            Duration::from_millis(300),
            three.receive::<ApiVersionsRequest>(2),
        )
        .await;
        assert!(early.is_err(), "answered past the limit: {early:?}");
        assert_eq!(b.broker.open_connections(), 2);
        // The second still serves.
        assert_eq!(two.call(&versions, 2).await.unwrap().error_code, 0);
        drop(one);
        let r = three.receive::<ApiVersionsRequest>(2).await.unwrap();
        assert_eq!(r.error_code, 0, "served once a place is free");
        assert_eq!(b.broker.open_connections(), 2);
        b.shutdown().await;
    })
    .await
}

/// A listener whose every accept fails with the OS error `errno` (24,
/// `EMFILE`: the process is out of file descriptors), counting the tries;
/// past `limit` it never answers again (a loop that retries at once stops
/// there, and the count says so).
struct Failing {
    tries: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    errno: i32,
    limit: usize,
}

impl broker::server::Accept for Failing {
    type Conn = ();
    fn accept(&self) -> impl Future<Output = std::io::Result<()>> + Send + '_ {
        let n = self.tries.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        async move {
            if n >= self.limit {
                std::future::pending::<()>().await;
            }
            Err(std::io::Error::from_raw_os_error(self.errno))
        }
    }
}

/// Failures that are the network's (`ENETDOWN`, `ENETUNREACH`,
/// `EHOSTUNREACH`) or the connection's (`ECONNABORTED`), which Linux's
/// accept(2) asks to retry as `EAGAIN` is, are retried at once: no pause
/// (paused time does not move while 50 of each are tried).
#[cfg(target_os = "linux")]
#[tokio::test(start_paused = true)]
async fn network_failures_of_accept_are_retried_at_once() {
    use broker::server::accept_loop;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    for errno in [100, 101, 113, 103] {
        let tries = Arc::new(AtomicUsize::new(0));
        let stop = tokio_util::sync::CancellationToken::new();
        let start = tokio::time::Instant::now();
        let task = tokio::spawn(accept_loop(
            Failing {
                tries: tries.clone(),
                errno,
                limit: 50,
            },
            Arc::new(tokio::sync::Semaphore::new(4)),
            stop.clone(),
            |(), _place| async {},
        ));
        // Yielding keeps the runtime busy, so paused time never moves: a
        // loop that pauses stays short of the 51 tries.
        for _ in 0..10_000 {
            if tries.load(Ordering::SeqCst) > 50 {
                break;
            }
            tokio::task::yield_now().await;
        }
        let n = tries.load(Ordering::SeqCst);
        assert!(n > 50, "errno {errno}: {n} tries, then a pause");
        assert_eq!(start.elapsed(), Duration::ZERO, "errno {errno}");
        stop.cancel();
        task.await.unwrap();
    }
}

/// Out of file descriptors, `accept` fails at once, again and again: the
/// accept loop retried at once, spinning a worker and logging a warning per
/// try for as long as the descriptors stayed taken (idle connections: ten
/// minutes). It pauses now, 10 ms doubling to 1 s: over 10 s (paused time)
/// a listener that always fails is tried some 16 times (7 in the first
/// 1.27 s, then once a second), not until it stops answering; and the loop
/// still stops when told, mid-pause.
#[tokio::test(start_paused = true)]
async fn out_of_descriptors_the_accept_loop_pauses() {
    use broker::server::{accept_loop, ACCEPT_PAUSE_MAX, ACCEPT_PAUSE_MIN};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    assert_eq!(
        (ACCEPT_PAUSE_MIN, ACCEPT_PAUSE_MAX),
        (Duration::from_millis(10), Duration::from_secs(1))
    );
    let tries = Arc::new(AtomicUsize::new(0));
    let stop = tokio_util::sync::CancellationToken::new();
    let places = Arc::new(tokio::sync::Semaphore::new(4));
    let task = tokio::spawn(accept_loop(
        Failing {
            tries: tries.clone(),
            errno: 24,
            limit: 1000,
        },
        places.clone(),
        stop.clone(),
        |(), _place| async {},
    ));
    tokio::time::sleep(Duration::from_secs(10)).await;
    let n = tries.load(Ordering::SeqCst);
    assert!((14..=18).contains(&n), "{n} tries in 10 s");
    assert_eq!(places.available_permits(), 3, "one place taken, to accept");
    stop.cancel();
    task.await.unwrap();
    assert_eq!(places.available_permits(), 4, "given back");
}

/// A fetch that can never have `min_bytes` (every `partition_max_bytes` 0,
/// or their sum short of it; or `min_bytes` past all the logs can hold,
/// `max_log_bytes`: `i32::MAX` against 1 GiB) is answered at its `max_wait`,
/// as Kafka answers it, and watches no partition meanwhile: such fetches
/// naming thousands of partitions were each checked in full (every
/// partition read) at every high watermark move of any, and made another
/// client's produce 25 times slower. Watches and checks counted: two such
/// fetches of 200 partitions watch one key each (no partition's); a produce
/// checks neither (the fetch purgatory's count of checks does not move); a
/// satisfiable fetch watches all 200 (live watch-list entries, tombstones
/// not counted) and the next produce completes it; a short one answers at
/// its `max_wait`, with what there is; shutdown answers the two at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fetches_that_can_never_complete_watch_no_partition() {
    use kafka_protocol::messages::FetchRequest;
    const PARTS: i32 = 200;
    bounded(async {
        let b = start(Config {
            followers: 0,
            partitions: PARTS,
            topics: vec![TOPIC.into()],
            ..Config::default()
        })
        .await;
        let every: Vec<(i32, i64)> = (0..PARTS).map(|p| (p, 0)).collect();
        let minute = Duration::from_secs(60);
        let fetches = &b.broker.fetches;
        // Watch-list entries of fetches that wait (those of finished ones
        // go lazily).
        let live = || {
            let m = fetches.metrics();
            m.watched - m.tombstones
        };
        let mut never = Vec::new();
        for fetch in [
            wire::fetch(TOPIC, &every, minute, 1, 0),
            wire::fetch(TOPIC, &every, minute, i32::MAX, 1 << 20),
        ] {
            let mut w = Wire::connect(b.addr).await.unwrap();
            w.send(&fetch, wire::FETCH_VERSION).await.unwrap();
            never.push(w);
        }
        // A registration counts as pending before its watches are in.
        until("both wait, watching", || {
            fetches.delayed() == 2 && live() >= 2
        })
        .await;
        assert_eq!(live(), 2, "one watch each, on no partition");
        // A produce moves a high watermark: nothing is checked.
        let checked = || fetches.metrics().checks.level_advances.checked;
        let before = checked();
        let mut w = Wire::connect(b.addr).await.unwrap();
        w.append(TOPIC, 7, &[b"x"]).await.unwrap();
        let seven = b.broker.topics.partition(TOPIC, 7).unwrap();
        until("the high watermark moved", || seven.high_watermark() == 1).await;
        assert_eq!((checked() - before, fetches.delayed()), (0, 2));
        let mut satisfiable = Wire::connect(b.addr).await.unwrap();
        // From the log end of each partition.
        let ends: Vec<(i32, i64)> = (0..PARTS).map(|p| (p, i64::from(p == 7))).collect();
        let fetch = wire::fetch(TOPIC, &ends, minute, 1, 1 << 20);
        satisfiable.send(&fetch, wire::FETCH_VERSION).await.unwrap();
        until("the third waits, watching", || {
            fetches.delayed() == 3 && live() >= 2 + PARTS as usize
        })
        .await;
        assert_eq!(live(), 2 + PARTS as usize);
        w.append(TOPIC, 5, &[b"x"]).await.unwrap();
        let r = satisfiable
            .receive::<FetchRequest>(wire::FETCH_VERSION)
            .await
            .unwrap();
        let got: Vec<_> = r.responses[0]
            .partitions
            .iter()
            .filter(|p| p.records.as_ref().is_some_and(|r| !r.is_empty()))
            .map(|p| p.partition_index)
            .collect();
        assert_eq!(got, [5]);
        until("the satisfiable one answered", || fetches.delayed() == 2).await;
        assert_eq!(live(), 2);
        // A short one: answered at its max_wait, every partition empty but
        // partitions 5 and 7 (their first batch, sent whole: Kafka's
        // progress rule).
        let wait = Duration::from_millis(300);
        let t = Instant::now();
        let r = w
            .call(&wire::fetch(TOPIC, &every, wait, 1, 0), wire::FETCH_VERSION)
            .await
            .unwrap();
        assert!(t.elapsed() >= wait, "answered after {:?}", t.elapsed());
        let parts = &r.responses[0].partitions;
        assert_eq!(parts.len(), PARTS as usize);
        assert!(parts.iter().all(|p| p.error_code == 0
            && ([5, 7].contains(&p.partition_index)
                || p.records.as_ref().is_none_or(|r| r.is_empty()))));
        // Shutdown answers what watches no partition, at once (the test's
        // bound is half their wait).
        assert_eq!(fetches.delayed(), 2);
        b.shutdown().await;
        for mut w in never {
            let r = w
                .receive::<FetchRequest>(wire::FETCH_VERSION)
                .await
                .unwrap();
            assert_eq!(r.responses[0].partitions.len(), PARTS as usize);
        }
    })
    .await
}
