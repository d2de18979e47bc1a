//! Hostile bytes against the broker example (`examples/kafka_broker`):
//! seeded random and mutated frames of every served API and version (valid
//! frames with counts, lengths and sizes perturbed, truncations, insertions,
//! garbage bodies).
//!
//! - In process, each frame goes through the walk that runs before decoding
//!   and, if admitted, through the decoder the broker uses, with this
//!   thread's heap measured: decoding never takes more than the walk charged.
//! - Over sockets, against a running broker: after each batch of frames the
//!   broker still answers a bystander connection, the memory it holds for
//!   requests stays within its budget, and its logs hold only batches that
//!   well-formed requests sent.
//! - Over one connection, mutated and whole batches, reads at the logs'
//!   edges and replication in random order against small logs: retention
//!   keeps them within their limit and whole after every request.
//!
//! The seed is printed; `PURGATORY_FUZZ_SEED=n cargo test --test
//! kafka_broker_fuzz` replays a run. Real sockets on 127.0.0.1 and real time,
//! each bounded by a timeout.

#[path = "../examples/kafka_broker/broker/mod.rs"]
#[allow(dead_code)]
mod broker;
#[path = "../examples/kafka_broker/wire.rs"]
#[allow(dead_code)]
mod wire;

mod support;

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use broker::server::{supported, SUPPORTED};
use broker::shape;
use broker::{BrokerHandle, Config};
use bytes::{Buf, BufMut, Bytes, BytesMut};
use kafka_protocol::messages::api_versions_request::ApiVersionsRequest;
use kafka_protocol::messages::fetch_request::{FetchPartition, FetchTopic, ForgottenTopic};
use kafka_protocol::messages::list_offsets_request::{ListOffsetsPartition, ListOffsetsTopic};
use kafka_protocol::messages::metadata_request::MetadataRequestTopic;
use kafka_protocol::messages::produce_request::{PartitionProduceData, TopicProduceData};
use kafka_protocol::messages::*;
use kafka_protocol::protocol::{Decodable, Encodable, StrBytes};
use support::alloc;
use support::rng::Rng;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

#[global_allocator]
static GLOBAL: alloc::Counting = alloc::Counting;

/// The decode limit the in-process runs walk with.
const MAX_DECODED: usize = 4 << 20;

/// What the decoder may allocate beyond what the walk charged: its error
/// messages and the like.
const SLACK: isize = 8 << 10;

fn seed() -> u64 {
    let seed = std::env::var("PURGATORY_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    eprintln!("fuzz seed {seed} (replay: PURGATORY_FUZZ_SEED={seed})");
    seed
}

fn name(rng: &mut Rng, topics: &[&str]) -> StrBytes {
    StrBytes::from_string(topics[rng.below(topics.len() as u64) as usize].to_string())
}

fn tags(rng: &mut Rng, flexible: bool) -> BTreeMap<i32, Bytes> {
    let mut m = BTreeMap::new();
    if flexible && rng.below(3) == 0 {
        for _ in 0..=rng.below(2) {
            let len = rng.below(6) as usize;
            m.insert(10 + rng.below(50) as i32, Bytes::from(vec![7u8; len]));
        }
    }
    m
}

/// A well-formed request frame (header and body, no size prefix) of `key` at
/// `version`, with random contents; the record batches it carries are added
/// to `sent`.
fn valid_frame(
    rng: &mut Rng,
    key: ApiKey,
    version: i16,
    topics: &[&str],
    sent: &mut Vec<Bytes>,
) -> Vec<u8> {
    let header = RequestHeader::default()
        .with_request_api_key(key as i16)
        .with_request_api_version(version)
        .with_correlation_id(rng.next() as i32)
        .with_client_id(Some(StrBytes::from_static_str("fuzz")));
    let mut out = BytesMut::new();
    header
        .encode(&mut out, key.request_header_version(version))
        .unwrap();
    let n = |rng: &mut Rng| rng.below(4) as usize;
    match key {
        ApiKey::Produce => {
            let flex = version >= 9;
            let r = ProduceRequest::default()
                .with_acks([-1, 0, 1][rng.below(3) as usize])
                .with_timeout_ms(rng.below(200) as i32)
                .with_topic_data(
                    (0..n(rng))
                        .map(|_| {
                            TopicProduceData::default()
                                .with_name(TopicName(name(rng, topics)))
                                .with_partition_data(
                                    (0..n(rng))
                                        .map(|_| {
                                            let values: Vec<Vec<u8>> = (0..=rng.below(3))
                                                .map(|i| vec![i as u8; rng.below(20) as usize])
                                                .collect();
                                            let refs: Vec<&[u8]> =
                                                values.iter().map(|v| &v[..]).collect();
                                            let b = wire::batch(&refs);
                                            sent.push(b.clone());
                                            PartitionProduceData::default()
                                                .with_index(rng.below(5) as i32)
                                                .with_records(Some(b))
                                                .with_unknown_tagged_fields(tags(rng, flex))
                                        })
                                        .collect(),
                                )
                                .with_unknown_tagged_fields(tags(rng, flex))
                        })
                        .collect(),
                )
                .with_unknown_tagged_fields(tags(rng, flex));
            r.encode(&mut out, version).unwrap();
        }
        ApiKey::Fetch => {
            let flex = version >= 12;
            let mut r = FetchRequest::default()
                .with_replica_id(BrokerId(-1))
                .with_max_wait_ms(rng.below(50) as i32)
                .with_min_bytes(rng.below(100) as i32)
                .with_max_bytes(rng.below(1 << 20) as i32)
                .with_topics(
                    (0..n(rng))
                        .map(|_| {
                            FetchTopic::default()
                                .with_topic(TopicName(name(rng, topics)))
                                .with_partitions(
                                    (0..n(rng))
                                        .map(|_| {
                                            FetchPartition::default()
                                                .with_partition(rng.below(5) as i32)
                                                .with_fetch_offset(rng.below(10) as i64)
                                                .with_partition_max_bytes(1 << 16)
                                                .with_unknown_tagged_fields(tags(rng, flex))
                                        })
                                        .collect(),
                                )
                                .with_unknown_tagged_fields(tags(rng, flex))
                        })
                        .collect(),
                )
                .with_unknown_tagged_fields(tags(rng, flex));
            if version >= 7 {
                r = r.with_session_epoch(-1).with_forgotten_topics_data(
                    (0..n(rng))
                        .map(|_| {
                            ForgottenTopic::default()
                                .with_topic(TopicName(name(rng, topics)))
                                .with_partitions((0..n(rng) as i32).collect())
                                .with_unknown_tagged_fields(tags(rng, flex))
                        })
                        .collect(),
                );
            }
            if version >= 11 {
                r = r.with_rack_id(StrBytes::from_static_str("rack"));
            }
            if flex && rng.below(2) == 0 {
                r = r.with_cluster_id(Some(StrBytes::from_static_str("cluster")));
            }
            r.encode(&mut out, version).unwrap();
        }
        ApiKey::ListOffsets => {
            let flex = version >= 6;
            let r = ListOffsetsRequest::default()
                .with_replica_id(BrokerId(-1))
                .with_topics(
                    (0..n(rng))
                        .map(|_| {
                            ListOffsetsTopic::default()
                                .with_name(TopicName(name(rng, topics)))
                                .with_partitions(
                                    (0..n(rng))
                                        .map(|_| {
                                            ListOffsetsPartition::default()
                                                .with_partition_index(rng.below(5) as i32)
                                                .with_timestamp(-1 - rng.below(2) as i64)
                                                .with_unknown_tagged_fields(tags(rng, flex))
                                        })
                                        .collect(),
                                )
                                .with_unknown_tagged_fields(tags(rng, flex))
                        })
                        .collect(),
                )
                .with_unknown_tagged_fields(tags(rng, flex));
            r.encode(&mut out, version).unwrap();
        }
        ApiKey::Metadata => {
            let flex = version >= 9;
            let list = (0..n(rng))
                .map(|_| {
                    MetadataRequestTopic::default()
                        .with_name(Some(TopicName(name(rng, topics))))
                        .with_unknown_tagged_fields(tags(rng, flex))
                })
                .collect();
            let mut r = MetadataRequest::default()
                .with_topics((version == 0 || rng.below(4) != 0).then_some(list))
                .with_unknown_tagged_fields(tags(rng, flex));
            if version >= 4 {
                r = r.with_allow_auto_topic_creation(rng.below(2) == 0);
            }
            r.encode(&mut out, version).unwrap();
        }
        ApiKey::ApiVersions => {
            let mut r = ApiVersionsRequest::default();
            if version >= 3 {
                r = r
                    .with_client_software_name(StrBytes::from_static_str("fuzz"))
                    .with_client_software_version(StrBytes::from_static_str("1"))
                    .with_unknown_tagged_fields(tags(rng, true));
            }
            r.encode(&mut out, version).unwrap();
        }
        ApiKey::FindCoordinator => {
            let mut r = FindCoordinatorRequest::default();
            if version <= 3 {
                r = r.with_key(name(rng, topics));
            }
            if version >= 4 {
                r = r.with_coordinator_keys((0..n(rng)).map(|_| name(rng, topics)).collect());
            }
            r = r.with_unknown_tagged_fields(tags(rng, version >= 3));
            r.encode(&mut out, version).unwrap();
        }
        ApiKey::JoinGroup => {
            use kafka_protocol::messages::join_group_request::JoinGroupRequestProtocol;
            let flex = version >= 6;
            let mut r = JoinGroupRequest::default()
                .with_group_id(GroupId(name(rng, topics)))
                .with_session_timeout_ms(10_000)
                .with_member_id(name(rng, topics))
                .with_protocol_type(StrBytes::from_static_str("consumer"))
                .with_protocols(
                    (0..n(rng))
                        .map(|_| {
                            JoinGroupRequestProtocol::default()
                                .with_name(name(rng, topics))
                                .with_metadata(Bytes::from(vec![1u8; rng.below(9) as usize]))
                                .with_unknown_tagged_fields(tags(rng, flex))
                        })
                        .collect(),
                )
                .with_unknown_tagged_fields(tags(rng, flex));
            if version >= 1 {
                r = r.with_rebalance_timeout_ms(5000);
            }
            if version >= 5 && rng.below(2) == 0 {
                r = r.with_group_instance_id(Some(name(rng, topics)));
            }
            r.encode(&mut out, version).unwrap();
        }
        ApiKey::SyncGroup => {
            use kafka_protocol::messages::sync_group_request::SyncGroupRequestAssignment;
            let flex = version >= 4;
            let mut r = SyncGroupRequest::default()
                .with_group_id(GroupId(name(rng, topics)))
                .with_generation_id(rng.below(3) as i32)
                .with_member_id(name(rng, topics))
                .with_assignments(
                    (0..n(rng))
                        .map(|_| {
                            SyncGroupRequestAssignment::default()
                                .with_member_id(name(rng, topics))
                                .with_assignment(Bytes::from(vec![2u8; rng.below(9) as usize]))
                                .with_unknown_tagged_fields(tags(rng, flex))
                        })
                        .collect(),
                )
                .with_unknown_tagged_fields(tags(rng, flex));
            if version >= 5 {
                r = r
                    .with_protocol_type(Some(StrBytes::from_static_str("consumer")))
                    .with_protocol_name(Some(StrBytes::from_static_str("range")));
            }
            r.encode(&mut out, version).unwrap();
        }
        ApiKey::Heartbeat => {
            let r = HeartbeatRequest::default()
                .with_group_id(GroupId(name(rng, topics)))
                .with_generation_id(rng.below(3) as i32)
                .with_member_id(name(rng, topics))
                .with_unknown_tagged_fields(tags(rng, version >= 4));
            r.encode(&mut out, version).unwrap();
        }
        ApiKey::LeaveGroup => {
            use kafka_protocol::messages::leave_group_request::MemberIdentity;
            let flex = version >= 4;
            let mut r = LeaveGroupRequest::default()
                .with_group_id(GroupId(name(rng, topics)))
                .with_unknown_tagged_fields(tags(rng, flex));
            if version <= 2 {
                r = r.with_member_id(name(rng, topics));
            } else {
                r = r.with_members(
                    (0..n(rng))
                        .map(|_| {
                            MemberIdentity::default()
                                .with_member_id(name(rng, topics))
                                .with_unknown_tagged_fields(tags(rng, flex))
                        })
                        .collect(),
                );
            }
            r.encode(&mut out, version).unwrap();
        }
        ApiKey::OffsetCommit => {
            use kafka_protocol::messages::offset_commit_request::*;
            let flex = version >= 8;
            let r = OffsetCommitRequest::default()
                .with_group_id(GroupId(name(rng, topics)))
                .with_generation_id_or_member_epoch(-1)
                .with_topics(
                    (0..n(rng))
                        .map(|_| {
                            OffsetCommitRequestTopic::default()
                                .with_name(TopicName(name(rng, topics)))
                                .with_partitions(
                                    (0..n(rng))
                                        .map(|_| {
                                            OffsetCommitRequestPartition::default()
                                                .with_partition_index(rng.below(5) as i32)
                                                .with_committed_offset(rng.below(100) as i64)
                                                .with_unknown_tagged_fields(tags(rng, flex))
                                        })
                                        .collect(),
                                )
                                .with_unknown_tagged_fields(tags(rng, flex))
                        })
                        .collect(),
                )
                .with_unknown_tagged_fields(tags(rng, flex));
            r.encode(&mut out, version).unwrap();
        }
        ApiKey::OffsetFetch => {
            use kafka_protocol::messages::offset_fetch_request::*;
            let flex = version >= 6;
            let list = (0..n(rng))
                .map(|_| {
                    OffsetFetchRequestTopic::default()
                        .with_name(TopicName(name(rng, topics)))
                        .with_partition_indexes((0..n(rng) as i32).collect())
                        .with_unknown_tagged_fields(tags(rng, flex))
                })
                .collect();
            let r = OffsetFetchRequest::default()
                .with_group_id(GroupId(name(rng, topics)))
                .with_topics((version < 2 || rng.below(4) != 0).then_some(list))
                .with_unknown_tagged_fields(tags(rng, flex));
            r.encode(&mut out, version).unwrap();
        }
        ApiKey::CreateTopics => {
            use kafka_protocol::messages::create_topics_request::{
                CreatableReplicaAssignment, CreatableTopic, CreatableTopicConfig,
            };
            let flex = version >= 5;
            let r = CreateTopicsRequest::default()
                .with_topics(
                    (0..n(rng))
                        .map(|_| {
                            CreatableTopic::default()
                                .with_name(TopicName(name(rng, topics)))
                                .with_num_partitions(rng.below(4) as i32 - 1)
                                .with_replication_factor(rng.below(4) as i16 - 1)
                                .with_assignments(
                                    (0..n(rng) / 2)
                                        .map(|p| {
                                            CreatableReplicaAssignment::default()
                                                .with_partition_index(p as i32)
                                                .with_broker_ids(
                                                    (0..n(rng))
                                                        .map(|b| BrokerId(b as i32))
                                                        .collect(),
                                                )
                                                .with_unknown_tagged_fields(tags(rng, flex))
                                        })
                                        .collect(),
                                )
                                .with_configs(
                                    (0..n(rng) / 2)
                                        .map(|_| {
                                            CreatableTopicConfig::default()
                                                .with_name(name(rng, topics))
                                                .with_value(
                                                    (rng.below(2) == 0).then(|| name(rng, topics)),
                                                )
                                                .with_unknown_tagged_fields(tags(rng, flex))
                                        })
                                        .collect(),
                                )
                                .with_unknown_tagged_fields(tags(rng, flex))
                        })
                        .collect(),
                )
                .with_timeout_ms(rng.below(1000) as i32)
                .with_validate_only(rng.below(2) == 0)
                .with_unknown_tagged_fields(tags(rng, flex));
            r.encode(&mut out, version).unwrap();
        }
        ApiKey::ListGroups => {
            let mut r = ListGroupsRequest::default();
            if version >= 4 {
                r = r.with_states_filter((0..n(rng)).map(|_| name(rng, topics)).collect());
            }
            if version >= 5 {
                r = r.with_types_filter((0..n(rng)).map(|_| name(rng, topics)).collect());
            }
            r = r.with_unknown_tagged_fields(tags(rng, version >= 3));
            r.encode(&mut out, version).unwrap();
        }
        ApiKey::DescribeGroups => {
            let mut r = DescribeGroupsRequest::default()
                .with_groups((0..n(rng)).map(|_| GroupId(name(rng, topics))).collect());
            if version >= 3 {
                r = r.with_include_authorized_operations(rng.below(2) == 0);
            }
            r = r.with_unknown_tagged_fields(tags(rng, version >= 5));
            r.encode(&mut out, version).unwrap();
        }
        ApiKey::DeleteGroups => {
            let r = DeleteGroupsRequest::default()
                .with_groups_names((0..n(rng)).map(|_| GroupId(name(rng, topics))).collect())
                .with_unknown_tagged_fields(tags(rng, version >= 2));
            r.encode(&mut out, version).unwrap();
        }
        _ => unreachable!(),
    }
    out.to_vec()
}

fn any_served(rng: &mut Rng) -> (ApiKey, i16) {
    let (key, lo, hi) = SUPPORTED[rng.below(SUPPORTED.len() as u64) as usize];
    (key, lo + rng.below((hi - lo + 1) as u64) as i16)
}

/// The ways a frame is damaged.
const CLASSES: [&str; 8] = [
    "int32 overwritten",
    "bytes overwritten",
    "varint overwritten",
    "truncated",
    "bytes inserted",
    "garbage body",
    "bytes appended",
    "unchanged",
];

/// A frame of a random served API and version, damaged in one of `CLASSES`
/// ways (returned with it).
fn mutated_frame(rng: &mut Rng, topics: &[&str], sent: &mut Vec<Bytes>) -> (usize, Vec<u8>) {
    let (key, version) = any_served(rng);
    let mut f = valid_frame(rng, key, version, topics, sent);
    let class = rng.below(CLASSES.len() as u64) as usize;
    // Past the API key and version, so the frame still names a served API.
    let at = |rng: &mut Rng, f: &Vec<u8>| {
        4 + rng.below(f.len().saturating_sub(4).max(1) as u64) as usize
    };
    match class {
        0 => {
            let big = [i32::MAX, -1, -2, 1 << 20, 1 << 30, rng.next() as i32];
            let v = big[rng.below(big.len() as u64) as usize].to_be_bytes();
            let i = at(rng, &f).min(f.len().saturating_sub(4));
            for (k, b) in v.iter().enumerate() {
                if let Some(x) = f.get_mut(i + k) {
                    *x = *b;
                }
            }
        }
        1 => {
            for _ in 0..=rng.below(3) {
                let i = at(rng, &f);
                if let Some(x) = f.get_mut(i) {
                    *x = [0xff, 0x7f, 0x80, 0x00, rng.next() as u8][rng.below(5) as usize];
                }
            }
        }
        2 => {
            // A varint of up to five bytes, as large as it gets.
            let i = at(rng, &f);
            for k in 0..5 {
                if let Some(x) = f.get_mut(i + k) {
                    *x = if k < 4 { 0xff } else { 0x0f };
                }
            }
        }
        3 => f.truncate(at(rng, &f)),
        4 => {
            let i = at(rng, &f).min(f.len());
            let extra: Vec<u8> = (0..=rng.below(8)).map(|_| rng.next() as u8).collect();
            f.splice(i..i, extra);
        }
        5 => {
            // A v1 header (key, version, correlation id, client id "fuzz"),
            // then random bytes.
            f.truncate(14);
            f.extend((0..rng.below(200)).map(|_| rng.next() as u8));
        }
        6 => {
            // After the request's end (ignored, as Kafka ignores it):
            // random bytes, or counts and varints as large as they get.
            let tails: [&[u8]; 3] = [
                &[0x7f, 0xff, 0xff, 0xff],
                &[0xff, 0xff, 0xff, 0xff, 0x0f],
                &[],
            ];
            f.extend_from_slice(tails[rng.below(3) as usize]);
            f.extend((0..rng.below(64)).map(|_| rng.next() as u8));
        }
        _ => {}
    }
    (class, f)
}

/// Decodes `frame` as the broker does after the walk admitted it.
fn decode_like_the_broker(frame: &[u8], s: &shape::Shape) {
    let Some(key) = s.key else { return };
    let mut buf = Bytes::copy_from_slice(frame);
    if RequestHeader::decode(&mut buf, key.request_header_version(s.version)).is_err() {
        return;
    }
    if !supported(key, s.version) {
        return;
    }
    let v = s.version;
    let _ = match key {
        ApiKey::Produce => ProduceRequest::decode(&mut buf, v).map(drop),
        ApiKey::Fetch => FetchRequest::decode(&mut buf, v).map(drop),
        ApiKey::ListOffsets => ListOffsetsRequest::decode(&mut buf, v).map(drop),
        ApiKey::Metadata => MetadataRequest::decode(&mut buf, v).map(drop),
        ApiKey::ApiVersions => ApiVersionsRequest::decode(&mut buf, v).map(drop),
        ApiKey::FindCoordinator => FindCoordinatorRequest::decode(&mut buf, v).map(drop),
        ApiKey::JoinGroup => JoinGroupRequest::decode(&mut buf, v).map(drop),
        ApiKey::SyncGroup => SyncGroupRequest::decode(&mut buf, v).map(drop),
        ApiKey::Heartbeat => HeartbeatRequest::decode(&mut buf, v).map(drop),
        ApiKey::LeaveGroup => LeaveGroupRequest::decode(&mut buf, v).map(drop),
        ApiKey::OffsetCommit => OffsetCommitRequest::decode(&mut buf, v).map(drop),
        ApiKey::OffsetFetch => OffsetFetchRequest::decode(&mut buf, v).map(drop),
        ApiKey::CreateTopics => CreateTopicsRequest::decode(&mut buf, v).map(drop),
        ApiKey::ListGroups => ListGroupsRequest::decode(&mut buf, v).map(drop),
        ApiKey::DescribeGroups => DescribeGroupsRequest::decode(&mut buf, v).map(drop),
        ApiKey::DeleteGroups => DeleteGroupsRequest::decode(&mut buf, v).map(drop),
        _ => Ok(()),
    };
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The frame that aborted the broker before the walk: Metadata v1 claiming
/// 2^31-1 topics, in 22 bytes (with its size).
const ABORTING: &str = "000000120003000100000007000466757a7a7fffffff";

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

#[test]
fn the_walk_reads_every_served_version_exactly_as_encoded() {
    let mut rng = Rng(seed());
    let mut sent = Vec::new();
    for &(key, lo, hi) in SUPPORTED {
        for version in lo..=hi {
            for _ in 0..30 {
                let f = valid_frame(&mut rng, key, version, &["a", "bb"], &mut sent);
                let s = shape::check(&f, MAX_DECODED)
                    .unwrap_or_else(|e| panic!("{key:?} v{version} refused: {e}: {}", hex(&f)));
                assert_eq!(s.key, Some(key));
                assert_eq!(s.trailing, 0, "{key:?} v{version}: {}", hex(&f));
                // Bytes after the request are ignored, as Kafka ignores them
                // (librdkafka's Metadata sends three), however hostile: never
                // walked, so never charged to what decoding allocates, and
                // never allocated for by the decoder either.
                let after: &[&[u8]] = &[
                    &[0x01, 0x00, 0x00],
                    &[0x7f, 0xff, 0xff, 0xff],
                    &[0xff, 0xff, 0xff, 0xff, 0x0f],
                    &[0xff; 4096],
                ];
                for tail in after {
                    let mut longer = f.clone();
                    longer.extend_from_slice(tail);
                    let l = shape::check(&longer, MAX_DECODED).unwrap_or_else(|e| {
                        panic!("{key:?} v{version} with bytes after it refused: {e}")
                    });
                    assert_eq!(l.trailing, tail.len(), "{key:?} v{version}");
                    assert_eq!(l.decoded, s.decoded, "{key:?} v{version}");
                    let base = alloc::reset_peak_here();
                    decode_like_the_broker(&longer, &l);
                    let grew = alloc::peak_here() - base;
                    assert!(
                        grew <= l.decoded as isize + SLACK,
                        "{key:?} v{version}: decoding took {grew}, charged {}",
                        l.decoded
                    );
                }
            }
        }
    }
}

#[test]
fn the_22_bytes_and_their_kin_are_refused_before_decoding() {
    let frame = unhex(ABORTING);
    assert_eq!(frame.len(), 22);
    let refused = shape::check(&frame[4..], MAX_DECODED).unwrap_err();
    assert!(refused.0.contains("metadata topics"), "{refused}");
    // A compact (flexible) Metadata v9 claiming 2^32-2 topics.
    let mut f = vec![0, 3, 0, 9, 0, 0, 0, 7, 0, 4];
    f.extend_from_slice(b"fuzz");
    f.push(0); // header tagged fields
    f.extend_from_slice(&[0xff, 0xff, 0xff, 0xff, 0x0f]);
    assert!(shape::check(&f, MAX_DECODED).is_err());
    // A decoded size over the limit is refused even when the bytes are there:
    // 100,000 topics of Metadata v1 with empty names (2 bytes each).
    let mut f = vec![0, 3, 0, 1, 0, 0, 0, 7, 0, 4];
    f.extend_from_slice(b"fuzz");
    f.extend_from_slice(&100_000i32.to_be_bytes());
    f.extend(std::iter::repeat_n(0u8, 200_000));
    let e = shape::check(&f, 1 << 20).unwrap_err();
    assert!(e.0.contains("decoding would allocate"), "{e}");
    assert!(shape::check(&f, 64 << 20).is_ok());
}

#[test]
fn mutated_frames_never_make_the_decoder_allocate_past_what_the_walk_charged() {
    let seed = seed();
    let mut rng = Rng(seed);
    let started = std::time::Instant::now();
    let frames = 200_000;
    let mut per_class = [(0u32, 0u32); CLASSES.len()]; // (tried, refused by the walk)
    let mut worst: isize = 0;
    let mut sent = Vec::new();
    for i in 0..frames {
        let (class, f) = mutated_frame(&mut rng, &["a", "topic"], &mut sent);
        sent.clear();
        per_class[class].0 += 1;
        match shape::check(&f, MAX_DECODED) {
            Err(_) => per_class[class].1 += 1,
            Ok(s) => {
                let base = alloc::reset_peak_here();
                decode_like_the_broker(&f, &s);
                let grew = alloc::peak_here() - base;
                worst = worst.max(grew - s.decoded as isize);
                assert!(
                    grew <= s.decoded as isize + SLACK,
                    "seed {seed}, frame {i} ({}): decoding took {grew} bytes, the walk charged {}: {}",
                    CLASSES[class],
                    s.decoded,
                    hex(&f)
                );
            }
        }
    }
    eprintln!(
        "{frames} frames in {:.1} s; worst decode over the charge: {worst} bytes",
        started.elapsed().as_secs_f64()
    );
    for (c, (tried, refused)) in CLASSES.iter().zip(per_class) {
        eprintln!("  {c}: {tried} tried, {refused} refused by the walk");
    }
}

/// Splits a log read into its batches.
fn batches(mut records: Bytes) -> Vec<Bytes> {
    let mut out = Vec::new();
    while records.len() >= 12 {
        let size = 12 + (&records[8..12]).get_i32() as usize;
        out.push(records.split_to(size));
    }
    assert!(records.is_empty());
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_frames_over_sockets_leave_the_broker_serving_and_its_logs_clean() {
    let seed = seed();
    let budget = 32 << 20;
    let handle = BrokerHandle::start(Config {
        listen: "127.0.0.1:0".parse().unwrap(),
        partitions: 4,
        followers: 0,
        topics: vec!["a".into(), "topic".into()],
        max_produce_wait: Duration::from_millis(50),
        max_request_bytes: 8 << 20,
        max_decoded_bytes: 4 << 20,
        memory_budget: budget,
        max_topics: 20,
        ..Config::default()
    })
    .await
    .expect("the broker starts");
    let addr = handle.addr;
    let b = handle.broker.clone();
    let mut bystander = wire::Wire::connect(addr).await.unwrap();
    let mut rng = Rng(seed);
    let mut sent = Vec::new();
    let started = std::time::Instant::now();
    let mut answers = 0;
    let heap_at_start = alloc::live_bytes();
    let rounds = 60;
    let per_round = 50;
    let topics = ["a", "topic", "new-1", "new-2"];
    for round in 0..rounds {
        // Each frame on a connection of its own, all at once: a bad frame
        // closes only its own connection.
        let mut conns = tokio::task::JoinSet::new();
        for _ in 0..per_round {
            let (_, f) = mutated_frame(&mut rng, &topics, &mut sent);
            conns.spawn(async move {
                let mut conn = TcpStream::connect(addr).await.unwrap();
                let mut framed = BytesMut::new();
                framed.put_i32(f.len() as i32);
                framed.extend_from_slice(&f);
                if conn.write_all(&framed).await.is_err() {
                    return false;
                }
                // The answer, or the close; a request that waits (a fetch
                // told to wait long) is dropped with its connection.
                let read = async {
                    let size = conn.read_i32().await?;
                    let mut body = vec![0; size.clamp(0, 1 << 20) as usize];
                    conn.read_exact(&mut body).await
                };
                matches!(
                    tokio::time::timeout(Duration::from_millis(150), read).await,
                    Ok(Ok(_))
                )
            });
        }
        while let Some(answered) = conns.join_next().await {
            if answered.unwrap() {
                answers += 1;
            }
        }
        let answered = tokio::time::timeout(
            Duration::from_secs(5),
            bystander.call(&ApiVersionsRequest::default(), 0),
        )
        .await;
        assert!(
            matches!(answered, Ok(Ok(_))),
            "seed {seed}, round {round}: the bystander got no answer"
        );
        assert!(b.budget.in_use() <= budget, "seed {seed}: over the budget");
        // The whole process's heap: what it held at the start, the budget,
        // and room for the logs and the test's own records.
        assert!(
            alloc::live_bytes() < heap_at_start + budget as isize + (32 << 20),
            "seed {seed}, round {round}: {} heap bytes live",
            alloc::live_bytes()
        );
    }
    // Every batch in every log is one a well-formed request sent (compared
    // from the magic byte on: the broker rewrites the base offset, and the
    // length and leader epoch are not what a damaged frame can change
    // without the CRC or the framing noticing).
    // (A record set the encoder wrote may hold several batches.)
    let sent: HashSet<Bytes> = sent
        .iter()
        .flat_map(|records| batches(records.clone()))
        .map(|b| b.slice(16..))
        .collect();
    let mut stored = 0;
    for part in b.topics.all_partitions() {
        for batch in batches(part.read(0, usize::MAX, true, &mut |_| true).records) {
            assert!(
                sent.contains(&batch.slice(16..)),
                "seed {seed}: a batch no well-formed request sent is in the log: {}",
                hex(&batch)
            );
            stored += 1;
        }
    }
    let s = &b.stats;
    eprintln!(
        "{} frames over sockets in {:.1} s: {answers} answered, {} requests decoded, {} connections closed for bad frames, {} batches refused, {stored} batches stored, {} topics",
        rounds * per_round,
        started.elapsed().as_secs_f64(),
        s.requests.load(std::sync::atomic::Ordering::Relaxed),
        s.connections_refused.load(std::sync::atomic::Ordering::Relaxed),
        s.batches_refused.load(std::sync::atomic::Ordering::Relaxed),
        b.topics.all().len(),
    );
    assert!(stored > 0, "some well-formed produces were stored");
    assert!(b.topics.all().len() <= 20);
    handle.shutdown().await;
}

fn pick<T: Copy>(rng: &mut Rng, xs: &[T]) -> T {
    xs[rng.below(xs.len() as u64) as usize]
}

/// A one-record batch, and whether it is left as made; else damaged in a
/// few places (a byte, its length, magic, codec, last offset delta, record
/// count, a truncation, bytes added, a codec's opening), its CRC made right
/// again most of the time.
fn mutated_batch(rng: &mut Rng) -> (Bytes, bool) {
    let value = vec![rng.below(256) as u8; rng.below(2000) as usize];
    let mut b = wire::batch(&[&value]).to_vec();
    if rng.below(4) == 0 {
        return (b.into(), true);
    }
    for _ in 0..1 + rng.below(3) {
        if b.len() < 61 {
            break;
        }
        match rng.below(9) {
            0 => {
                let i = rng.below(b.len() as u64) as usize;
                b[i] = rng.below(256) as u8;
            }
            1 => {
                let len = b.len() as i32;
                let v = pick(
                    rng,
                    &[
                        i32::MIN,
                        -1,
                        0,
                        13,
                        14,
                        15,
                        48,
                        49,
                        len - 13,
                        len - 12,
                        len - 11,
                        i32::MAX,
                    ],
                );
                b[8..12].copy_from_slice(&v.to_be_bytes());
            }
            2 => b[16] = pick(rng, &[0u8, 1, 2, 3, 0x80, 0xff]),
            3 => b[22] = (b[22] & !7) | rng.below(8) as u8,
            4 => {
                let v = pick(rng, &[i32::MIN, -1, 0, 1, 2, 3, i32::MAX]);
                b[23..27].copy_from_slice(&v.to_be_bytes());
            }
            5 => {
                let v = pick(rng, &[i32::MIN, -1, 0, 1, 2, 3, i32::MAX]);
                b[57..61].copy_from_slice(&v.to_be_bytes());
            }
            6 => b.truncate(rng.below(b.len() as u64 + 1) as usize),
            7 => {
                let extra = rng.below(80) as usize;
                b.extend((0..extra).map(|_| rng.below(256) as u8));
            }
            _ => {
                if b.len() > 65 {
                    b[22] = (b[22] & !7) | pick(rng, &[1u8, 2, 3, 4]);
                    let mark: &[u8] = pick(
                        rng,
                        &[
                            &[0x1f, 0x8b][..],
                            &[0x04, 0x22, 0x4d, 0x18],
                            &[0x28, 0xb5, 0x2f, 0xfd],
                        ],
                    );
                    b[61..61 + mark.len()].copy_from_slice(mark);
                }
            }
        }
    }
    if b.len() >= 21 && rng.below(4) != 0 {
        let crc = crc32c::crc32c(&b[21..]);
        b[17..21].copy_from_slice(&crc.to_be_bytes());
    }
    (b.into(), false)
}

/// Mutated and whole batches, fetches and offset lookups at the logs' edges
/// (below, at and past the log start and end), and replication in random
/// order (the follower is stuck: the test copies partitions by hand, as it
/// would), on one connection against a broker whose logs hold 16 KiB: the
/// connection stays up, a whole batch is stored or refused only for want of
/// room, and after every request the logs are within `max_log_bytes` with
/// log start <= high watermark <= log end for each partition. Every so
/// often everything is copied and what retention counts is checked against
/// what the logs hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_and_reads_at_the_log_edges_keep_the_logs_whole() {
    let seed = seed();
    let limit = 16 << 10;
    let handle = BrokerHandle::start(Config {
        listen: "127.0.0.1:0".parse().unwrap(),
        followers: 1,
        stuck_follower: Some(0),
        partitions: 3,
        topics: vec!["t".into()],
        max_message_bytes: 4096,
        max_log_bytes: limit,
        ..Config::default()
    })
    .await
    .expect("the broker starts");
    let b = handle.broker.clone();
    let mut w = wire::Wire::connect(handle.addr).await.unwrap();
    let part = |p: i32| b.topics.partition("t", p).unwrap();
    let copy = |p: i32| {
        let p = part(p);
        if let Some(hw) = p.copied(0, p.log_end(), tokio::time::Instant::now()) {
            b.high_watermark_moved(&p, hw);
        }
    };
    // What keeping a batch costs beyond its bytes.
    let first = wire::batch(&[b"first"]);
    let r = w.append("t", 0, &[b"first"]).await.unwrap();
    assert_eq!(wire::produce_error(&r), 0);
    let batch_cost = b.topics.log_bytes() - first.len();
    let mut rng = Rng(seed);
    let run = async {
        for i in 0..4000 {
            let p = pick(&mut rng, &[-1, 0, 1, 2, 3]);
            let at = |p: i32| {
                b.topics
                    .partition("t", p.max(0))
                    .map_or((0, 0), |p| (p.log_start() as i64, p.log_end() as i64))
            };
            match rng.below(8) {
                0..=2 => {
                    let (records, whole) = mutated_batch(&mut rng);
                    let version = pick(&mut rng, &[3i16, 7, 9]);
                    let produce = wire::produce("t", p, 1, Duration::from_secs(5), records);
                    let r = w
                        .call(&produce, version)
                        .await
                        .expect("the connection stays up");
                    let code = wire::produce_error(&r);
                    if whole && (0..3).contains(&p) {
                        assert!(
                            code == 0
                                || code
                                    == kafka_protocol::error::ResponseError::KafkaStorageError
                                        .code(),
                            "seed {seed}, step {i}: a whole batch refused with {code}"
                        );
                    }
                }
                3 | 4 => {
                    let (start, end) = at(p);
                    let offset = pick(
                        &mut rng,
                        &[
                            -2,
                            -1,
                            0,
                            start - 1,
                            start,
                            start + 1,
                            end - 1,
                            end,
                            end + 1,
                            i64::MAX,
                        ],
                    );
                    let max_bytes = pick(&mut rng, &[i32::MIN, -1, 0, 1, 100, 5000, i32::MAX]);
                    let min_bytes = pick(&mut rng, &[i32::MIN, 0, 1, 1000, i32::MAX]);
                    let other = pick(&mut rng, &[0, 1, 2]);
                    let fetch = wire::fetch(
                        "t",
                        &[(p, offset), (other, offset)],
                        Duration::from_millis(rng.below(4)),
                        min_bytes,
                        max_bytes,
                    );
                    w.call(&fetch, wire::FETCH_VERSION)
                        .await
                        .expect("the connection stays up");
                }
                5 => {
                    let ts = pick(
                        &mut rng,
                        &[i64::MIN, -4, -3, -2, -1, 0, wire::now_ms(), i64::MAX],
                    );
                    let other = pick(&mut rng, &[0, 1, 2, 3]);
                    let req = ListOffsetsRequest::default()
                        .with_replica_id(BrokerId(-1))
                        .with_topics(vec![ListOffsetsTopic::default()
                            .with_name(TopicName(StrBytes::from_static_str("t")))
                            .with_partitions(vec![
                                ListOffsetsPartition::default()
                                    .with_partition_index(p)
                                    .with_timestamp(ts),
                                ListOffsetsPartition::default()
                                    .with_partition_index(other)
                                    .with_timestamp(ts),
                            ])]);
                    w.call(&req, 7).await.expect("the connection stays up");
                }
                // Partition 2 is not copied every other 500 steps: its
                // batches are then in the way of the others' at the front of
                // the retention order.
                _ => {
                    let q = pick(&mut rng, &[0, 0, 0, 1, 1, 2]);
                    if q != 2 || (i / 500) % 2 == 0 {
                        copy(q);
                    }
                }
            }
            assert!(
                b.topics.log_bytes() <= limit,
                "seed {seed}, step {i}: the logs hold {} bytes",
                b.topics.log_bytes()
            );
            for q in b.topics.all_partitions() {
                let (s, h, e) = (q.log_start(), q.high_watermark(), q.log_end());
                assert!(
                    s <= h && h <= e,
                    "seed {seed}, step {i}: start {s} hw {h} end {e}"
                );
            }
            if i % 500 == 499 {
                // Everything copied, so readable: the logs' batches and their
                // costs are what retention counts.
                let mut held = 0;
                for p in 0..3 {
                    copy(p);
                    let q = part(p);
                    let read = q.read(q.log_start(), usize::MAX, true, &mut |_| true);
                    let kept = batches(read.records);
                    held += kept.iter().map(|k| k.len() + batch_cost).sum::<usize>();
                }
                assert_eq!(held, b.topics.log_bytes(), "seed {seed}, step {i}");
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .expect("in time");
    handle.shutdown().await;
}
