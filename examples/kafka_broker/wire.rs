//! A minimal Kafka wire client over `kafka-protocol`, for what the client
//! library used elsewhere does not expose: `acks` 0 and 1, a fetch sent and
//! abandoned, many raw fetches on their own connections (the benchmark).

use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use kafka_protocol::messages::fetch_request::{FetchPartition, FetchTopic};
use kafka_protocol::messages::produce_request::{PartitionProduceData, TopicProduceData};
use kafka_protocol::messages::*;
use kafka_protocol::protocol::{Decodable, Encodable, HeaderVersion, Request, StrBytes};
use kafka_protocol::records::{
    Compression, Record, RecordBatchEncoder, RecordEncodeOptions, TimestampType,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The versions this client speaks.
pub const PRODUCE_VERSION: i16 = 7;
pub const FETCH_VERSION: i16 = 11;

/// One connection; requests go one at a time.
pub struct Wire {
    stream: TcpStream,
    next_id: i32,
}

impl Wire {
    pub async fn connect(addr: std::net::SocketAddr) -> std::io::Result<Wire> {
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        Ok(Wire { stream, next_id: 0 })
    }

    /// Sends a request without waiting for its answer; returns its
    /// correlation id.
    pub async fn send<R: Request>(&mut self, request: &R, version: i16) -> std::io::Result<i32> {
        self.next_id += 1;
        let header = RequestHeader::default()
            .with_request_api_key(R::KEY)
            .with_request_api_version(version)
            .with_correlation_id(self.next_id)
            .with_client_id(Some(StrBytes::from_static_str("wire")));
        let mut out = BytesMut::new();
        out.put_i32(0);
        header
            .encode(&mut out, R::header_version(version))
            .map_err(std::io::Error::other)?;
        request
            .encode(&mut out, version)
            .map_err(std::io::Error::other)?;
        let size = (out.len() - 4) as i32;
        out[..4].copy_from_slice(&size.to_be_bytes());
        self.stream.write_all(&out).await?;
        Ok(self.next_id)
    }

    /// Reads the next answer, to a request of type `R` sent at `version`.
    pub async fn receive<R: Request>(&mut self, version: i16) -> std::io::Result<R::Response> {
        let size = self.stream.read_i32().await?;
        let mut body = vec![0; size.max(0) as usize];
        self.stream.read_exact(&mut body).await?;
        let mut body = Bytes::from(body);
        ResponseHeader::decode(&mut body, R::Response::header_version(version))
            .map_err(std::io::Error::other)?;
        R::Response::decode(&mut body, version).map_err(std::io::Error::other)
    }

    pub async fn call<R: Request>(
        &mut self,
        request: &R,
        version: i16,
    ) -> std::io::Result<R::Response> {
        self.send(request, version).await?;
        self.receive::<R>(version).await
    }

    /// Produces `values` as one batch to one partition with `acks` 1 (answered
    /// once the leader has appended) and reads the answer.
    pub async fn append(
        &mut self,
        topic: &str,
        partition: i32,
        values: &[&[u8]],
    ) -> std::io::Result<ProduceResponse> {
        let request = produce(topic, partition, 1, Duration::from_secs(5), batch(values));
        self.call(&request, PRODUCE_VERSION).await
    }
}

/// One record batch of `values` (format v2, uncompressed).
pub fn batch(values: &[&[u8]]) -> Bytes {
    let now = now_ms();
    let records: Vec<Record> = values
        .iter()
        .enumerate()
        .map(|(i, v)| Record {
            transactional: false,
            control: false,
            delete_horizon: false,
            partition_leader_epoch: 0,
            producer_id: -1,
            producer_epoch: -1,
            timestamp_type: TimestampType::Creation,
            offset: i as i64,
            sequence: -1,
            timestamp: now,
            key: None,
            value: Some(Bytes::copy_from_slice(v)),
            headers: Default::default(),
        })
        .collect();
    let mut out = BytesMut::new();
    RecordBatchEncoder::encode(
        &mut out,
        &records,
        &RecordEncodeOptions {
            version: 2,
            compression: Compression::None,
        },
    )
    .expect("an uncompressed batch encodes");
    out.freeze()
}

/// `batch(values)` with its last offset delta set to `delta` and its CRC
/// made right again: a well-formed batch that lies about its size (Kafka
/// refuses it with `INVALID_RECORD`).
pub fn lying_batch(values: &[&[u8]], delta: i32) -> Bytes {
    let mut b = BytesMut::from(&batch(values)[..]);
    b[23..27].copy_from_slice(&delta.to_be_bytes());
    let crc = crc32c::crc32c(&b[21..]);
    b[17..21].copy_from_slice(&crc.to_be_bytes());
    b.freeze()
}

/// `batch(values)` with its last byte flipped after the CRC was computed
/// (Kafka refuses it with `CORRUPT_MESSAGE`).
pub fn corrupt_batch(values: &[&[u8]]) -> Bytes {
    let mut b = BytesMut::from(&batch(values)[..]);
    let last = b.len() - 1;
    b[last] ^= 0xff;
    b.freeze()
}

/// Milliseconds since the Unix epoch (record timestamps).
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// A produce of `records` to one partition.
pub fn produce(
    topic: &str,
    partition: i32,
    acks: i16,
    timeout: Duration,
    records: Bytes,
) -> ProduceRequest {
    ProduceRequest::default()
        .with_acks(acks)
        .with_timeout_ms(timeout.as_millis() as i32)
        .with_topic_data(vec![TopicProduceData::default()
            .with_name(TopicName(StrBytes::from_string(topic.to_string())))
            .with_partition_data(vec![PartitionProduceData::default()
                .with_index(partition)
                .with_records(Some(records))])])
}

/// A fetch from `offset` of each partition in `partitions`.
pub fn fetch(
    topic: &str,
    partitions: &[(i32, i64)],
    max_wait: Duration,
    min_bytes: i32,
    max_bytes: i32,
) -> FetchRequest {
    FetchRequest::default()
        .with_replica_id(BrokerId(-1))
        .with_max_wait_ms(max_wait.as_millis() as i32)
        .with_min_bytes(min_bytes)
        .with_max_bytes(max_bytes)
        .with_session_epoch(-1)
        .with_topics(vec![FetchTopic::default()
            .with_topic(TopicName(StrBytes::from_string(topic.to_string())))
            .with_partitions(
                partitions
                    .iter()
                    .map(|&(p, offset)| {
                        FetchPartition::default()
                            .with_partition(p)
                            .with_fetch_offset(offset)
                            .with_partition_max_bytes(max_bytes)
                    })
                    .collect(),
            )])
}

/// The error code of a produce answer's only partition.
pub fn produce_error(r: &ProduceResponse) -> i16 {
    r.responses[0].partition_responses[0].error_code
}
