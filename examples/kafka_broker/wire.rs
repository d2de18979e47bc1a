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
    /// The client id its requests carry.
    client: String,
}

impl Wire {
    pub async fn connect(addr: std::net::SocketAddr) -> std::io::Result<Wire> {
        Wire::connect_as(addr, "wire").await
    }

    /// A connection whose requests carry `client` as their client id.
    pub async fn connect_as(addr: std::net::SocketAddr, client: &str) -> std::io::Result<Wire> {
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        Ok(Wire {
            stream,
            next_id: 0,
            client: client.to_string(),
        })
    }

    /// Sends a request without waiting for its answer; returns its
    /// correlation id.
    pub async fn send<R: Request>(&mut self, request: &R, version: i16) -> std::io::Result<i32> {
        self.next_id += 1;
        let header = RequestHeader::default()
            .with_request_api_key(R::KEY)
            .with_request_api_version(version)
            .with_correlation_id(self.next_id)
            .with_client_id(Some(StrBytes::from_string(self.client.clone())));
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

/// One record batch of `values` (format v2, uncompressed), stamped now.
pub fn batch(values: &[&[u8]]) -> Bytes {
    batch_at(now_ms(), values)
}

/// A plain record (no key, no headers, no producer) at `offset` of its
/// batch, with `sequence`, stamped `timestamp` (ms).
pub fn record(offset: usize, sequence: i32, timestamp: i64, value: Bytes) -> Record {
    Record {
        transactional: false,
        control: false,
        delete_horizon: false,
        partition_leader_epoch: 0,
        producer_id: -1,
        producer_epoch: -1,
        timestamp_type: TimestampType::Creation,
        offset: offset as i64,
        sequence,
        timestamp,
        key: None,
        value: Some(value),
        headers: Default::default(),
    }
}

/// One record batch of `values`, every record stamped `timestamp` (ms).
pub fn batch_at(timestamp: i64, values: &[&[u8]]) -> Bytes {
    let records: Vec<Record> = values
        .iter()
        .enumerate()
        .map(|(i, v)| record(i, -1, timestamp, Bytes::copy_from_slice(v)))
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

/// A consumer group member on its own connection, assigning partitions
/// round-robin when it leads (client-side assignment, as Kafka clients do).
pub struct GroupMember {
    pub w: Wire,
    pub id: String,
    pub generation: i32,
    pub leader: bool,
    /// The members, when this one leads.
    pub members: Vec<String>,
}

impl GroupMember {
    pub const JOIN_VERSION: i16 = 5;
    pub const SYNC_VERSION: i16 = 3;
    pub const HEARTBEAT_VERSION: i16 = 3;

    pub async fn connect(addr: std::net::SocketAddr) -> std::io::Result<GroupMember> {
        Ok(GroupMember {
            w: Wire::connect(addr).await?,
            id: String::new(),
            generation: -1,
            leader: false,
            members: Vec::new(),
        })
    }

    /// Joins (both steps of a first join); the error code.
    pub async fn join(&mut self, group: &str, session_ms: i32) -> std::io::Result<i16> {
        use kafka_protocol::messages::join_group_request::JoinGroupRequestProtocol;
        loop {
            let r = self
                .w
                .call(
                    &JoinGroupRequest::default()
                        .with_group_id(GroupId(s(group)))
                        .with_session_timeout_ms(session_ms)
                        .with_rebalance_timeout_ms(5000)
                        .with_member_id(s(&self.id))
                        .with_protocol_type(s("consumer"))
                        .with_protocols(vec![JoinGroupRequestProtocol::default()
                            .with_name(s("roundrobin"))
                            .with_metadata(Bytes::from_static(b"meta"))]),
                    Self::JOIN_VERSION,
                )
                .await?;
            self.id = r.member_id.to_string();
            if r.error_code == kafka_protocol::error::ResponseError::MemberIdRequired.code() {
                continue;
            }
            self.generation = r.generation_id;
            self.leader = r.leader == r.member_id;
            self.members = r.members.iter().map(|m| m.member_id.to_string()).collect();
            return Ok(r.error_code);
        }
    }

    /// Syncs; a leader assigns `partitions` round-robin over its members
    /// sorted. The error code and the partitions assigned here.
    pub async fn sync(&mut self, group: &str, partitions: i32) -> std::io::Result<(i16, Vec<i32>)> {
        use kafka_protocol::messages::sync_group_request::SyncGroupRequestAssignment;
        let mut assignments = Vec::new();
        if self.leader {
            let mut members = self.members.clone();
            members.sort();
            for (i, m) in members.iter().enumerate() {
                let mine: Vec<u8> = (0..partitions)
                    .filter(|p| *p as usize % members.len() == i)
                    .map(|p| p as u8)
                    .collect();
                assignments.push(
                    SyncGroupRequestAssignment::default()
                        .with_member_id(s(m))
                        .with_assignment(mine.into()),
                );
            }
        }
        let r = self
            .w
            .call(
                &SyncGroupRequest::default()
                    .with_group_id(GroupId(s(group)))
                    .with_generation_id(self.generation)
                    .with_member_id(s(&self.id))
                    .with_assignments(assignments),
                Self::SYNC_VERSION,
            )
            .await?;
        Ok((
            r.error_code,
            r.assignment.iter().map(|&p| p as i32).collect(),
        ))
    }

    pub async fn heartbeat(&mut self, group: &str) -> std::io::Result<i16> {
        let r = self
            .w
            .call(
                &HeartbeatRequest::default()
                    .with_group_id(GroupId(s(group)))
                    .with_generation_id(self.generation)
                    .with_member_id(s(&self.id)),
                Self::HEARTBEAT_VERSION,
            )
            .await?;
        Ok(r.error_code)
    }

    pub async fn leave(&mut self, group: &str) -> std::io::Result<i16> {
        let r = self
            .w
            .call(
                &LeaveGroupRequest::default()
                    .with_group_id(GroupId(s(group)))
                    .with_member_id(s(&self.id)),
                1,
            )
            .await?;
        Ok(r.error_code)
    }

    /// Joins and syncs until a generation is stable; the partitions of a
    /// 4-partition topic assigned here.
    pub async fn rejoin(&mut self, group: &str, session_ms: i32) -> std::io::Result<Vec<i32>> {
        use kafka_protocol::error::ResponseError;
        loop {
            let code = self.join(group, session_ms).await?;
            if code != 0 {
                return Err(std::io::Error::other(format!("join: error {code}")));
            }
            let (code, mine) = self.sync(group, 4).await?;
            if code == 0 {
                return Ok(mine);
            }
            if code != ResponseError::RebalanceInProgress.code() {
                return Err(std::io::Error::other(format!("sync: error {code}")));
            }
        }
    }

    /// Commits `offsets` of `topic`; each partition's error code.
    pub async fn commit(
        &mut self,
        group: &str,
        topic: &str,
        offsets: &[(i32, i64)],
    ) -> std::io::Result<Vec<i16>> {
        use kafka_protocol::messages::offset_commit_request::*;
        let r = self
            .w
            .call(
                &OffsetCommitRequest::default()
                    .with_group_id(GroupId(s(group)))
                    .with_generation_id_or_member_epoch(self.generation)
                    .with_member_id(s(&self.id))
                    .with_topics(vec![OffsetCommitRequestTopic::default()
                        .with_name(TopicName(s(topic)))
                        .with_partitions(
                            offsets
                                .iter()
                                .map(|&(p, o)| {
                                    OffsetCommitRequestPartition::default()
                                        .with_partition_index(p)
                                        .with_committed_offset(o)
                                })
                                .collect(),
                        )]),
                7,
            )
            .await?;
        Ok(r.topics[0]
            .partitions
            .iter()
            .map(|p| p.error_code)
            .collect())
    }

    /// The committed offsets of partitions 0-3 of `topic` (-1: none).
    pub async fn committed(
        &mut self,
        group: &str,
        topic: &str,
    ) -> std::io::Result<Vec<(i32, i64)>> {
        use kafka_protocol::messages::offset_fetch_request::*;
        let r = self
            .w
            .call(
                &OffsetFetchRequest::default()
                    .with_group_id(GroupId(s(group)))
                    .with_topics(Some(vec![OffsetFetchRequestTopic::default()
                        .with_name(TopicName(s(topic)))
                        .with_partition_indexes((0..4).collect())])),
                6,
            )
            .await?;
        Ok(r.topics[0]
            .partitions
            .iter()
            .map(|p| (p.partition_index, p.committed_offset))
            .collect())
    }
}

fn s(v: &str) -> StrBytes {
    StrBytes::from_string(v.to_string())
}
