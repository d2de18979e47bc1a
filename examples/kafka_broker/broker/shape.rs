//! A request frame's shape, checked before the decoder sees it.
//!
//! The wire decoder (`kafka-protocol`) reserves `Vec::with_capacity(n)` for
//! an array count read from the wire before it knows whether `n` elements can
//! follow: a 22-byte Metadata request claiming 2^31-1 topics asks for 154 GB,
//! and a failed allocation aborts the process (no `catch_unwind` or task
//! boundary contains it). So every frame is walked here first, field by field
//! as the decoder will read it, for the versions this broker serves:
//!
//! - every string, byte array and tagged field must fit in the bytes left,
//!   and a string must be at most [`MAX_STRING`] bytes, as Kafka reads it;
//! - every array count must be at most the bytes left (each element takes at
//!   least one byte);
//! - what the decoder will allocate for it (each array's `count *
//!   size_of::<Element>()`, each tagged field's map entry) is added up, and a
//!   frame that would take more than the limit is refused before any of it
//!   is allocated.
//!
//! The walk mirrors the decoder's reading of each version (the tests check
//! that it consumes exactly what an encoded request holds, for every served
//! version), and is stricter only where the decoder's reading is loose: a
//! known tagged field must take exactly the size it announces.
//!
//! Bytes after the fields of the request's version are ignored, as Kafka
//! ignores them (its generated `read` takes the fields of the version and
//! stops), and as the decoder does: librdkafka's all-topics Metadata request
//! (v9 and up) carries three of them. They are never walked, so they never
//! reach what the decoder allocates; they are part of the frame, read and
//! charged to the budget as it arrives and bounded by `max_request_bytes`,
//! and held no longer than the frame is ([`Shape::trailing`] counts them).

use std::mem::size_of;

use kafka_protocol::messages::create_topics_request::{
    CreatableReplicaAssignment, CreatableTopic, CreatableTopicConfig,
};
use kafka_protocol::messages::fetch_request::{FetchPartition, FetchTopic, ForgottenTopic};
use kafka_protocol::messages::join_group_request::JoinGroupRequestProtocol;
use kafka_protocol::messages::leave_group_request::MemberIdentity;
use kafka_protocol::messages::list_offsets_request::{ListOffsetsPartition, ListOffsetsTopic};
use kafka_protocol::messages::metadata_request::MetadataRequestTopic;
use kafka_protocol::messages::offset_commit_request::{
    OffsetCommitRequestPartition, OffsetCommitRequestTopic,
};
use kafka_protocol::messages::offset_fetch_request::OffsetFetchRequestTopic;
use kafka_protocol::messages::produce_request::{PartitionProduceData, TopicProduceData};
use kafka_protocol::messages::sync_group_request::SyncGroupRequestAssignment;
use kafka_protocol::messages::ApiKey;
use kafka_protocol::protocol::StrBytes;

use super::server::supported;

/// What the decoder keeps for the tagged fields it does not know: a B-tree
/// map whose first node takes about 400 bytes (11 keys and `Bytes`), and
/// whose nodes, at least half full, take under 128 bytes an entry after it.
const TAGGED_MAP: usize = 512;
const TAGGED_ENTRY: usize = 128;

/// The longest string Kafka reads (`0x7fff` bytes, as its int16 length
/// allows, whatever the encoding).
pub const MAX_STRING: usize = 0x7fff;

/// Why a frame was refused before decoding.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused(pub String);

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// A frame that may be decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// The API key, if this broker knows it.
    pub key: Option<ApiKey>,
    pub version: i16,
    /// Bytes the decoder will allocate for the header and the body (what it
    /// slices out of the frame itself is not counted: that is the frame).
    pub decoded: usize,
    /// Bytes after what was walked: ignored, as the decoder and Kafka
    /// ignore them, and charged only as part of the frame.
    pub trailing: usize,
}

/// Walks `frame` (a request without its size prefix) as the decoder will, and
/// refuses it if a length or count does not fit in the bytes left or the
/// decoded request would take more than `max_decoded` bytes. The body is
/// walked only for served versions: the broker decodes no other.
pub fn check(frame: &[u8], max_decoded: usize) -> Result<Shape, Refused> {
    let mut w = Walk {
        rest: frame,
        decoded: 0,
        max_decoded,
    };
    let raw_key = w.int16()?;
    let version = w.int16()?;
    let Ok(key) = ApiKey::try_from(raw_key) else {
        return Ok(Shape {
            key: None,
            version,
            decoded: 0,
            trailing: w.rest.len(),
        });
    };
    // The header, as `RequestHeader::decode` reads it after the key and
    // version: correlation id, client id, and tagged fields from version 2.
    let header_version = key.request_header_version(version);
    w.skip(4, "correlation id")?;
    w.string(false, "client id")?;
    w.tagged(header_version >= 2, |_, _| Ok(false))?;
    if supported(key, version) {
        match key {
            ApiKey::Produce => produce(&mut w, version)?,
            ApiKey::Fetch => fetch(&mut w, version)?,
            ApiKey::ListOffsets => list_offsets(&mut w, version)?,
            ApiKey::Metadata => metadata(&mut w, version)?,
            ApiKey::ApiVersions => api_versions(&mut w, version)?,
            ApiKey::FindCoordinator => find_coordinator(&mut w, version)?,
            ApiKey::JoinGroup => join_group(&mut w, version)?,
            ApiKey::SyncGroup => sync_group(&mut w, version)?,
            ApiKey::Heartbeat => heartbeat(&mut w, version)?,
            ApiKey::LeaveGroup => leave_group(&mut w, version)?,
            ApiKey::OffsetCommit => offset_commit(&mut w, version)?,
            ApiKey::OffsetFetch => offset_fetch(&mut w, version)?,
            ApiKey::CreateTopics => create_topics(&mut w, version)?,
            ApiKey::ListGroups => list_groups(&mut w, version)?,
            ApiKey::DescribeGroups => describe_groups(&mut w, version)?,
            ApiKey::DeleteGroups => delete_groups(&mut w, version)?,
            _ => {}
        }
        // Bytes after the request's fields are ignored, as Kafka and the
        // decoder ignore them (see the module doc): the frame's own charge
        // covers them.
    }
    Ok(Shape {
        key: Some(key),
        version,
        decoded: w.decoded,
        trailing: w.rest.len(),
    })
}

type Step = Result<(), Refused>;

fn refuse<T>(what: &str, why: &str) -> Result<T, Refused> {
    Err(Refused(format!("{what}: {why}")))
}

/// A cursor over the frame, adding up what decoding it will allocate.
struct Walk<'a> {
    rest: &'a [u8],
    decoded: usize,
    max_decoded: usize,
}

impl<'a> Walk<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], Refused> {
        if n > self.rest.len() {
            return refuse(
                what,
                &format!("{n} bytes announced, {} left", self.rest.len()),
            );
        }
        let (head, rest) = self.rest.split_at(n);
        self.rest = rest;
        Ok(head)
    }

    fn skip(&mut self, n: usize, what: &str) -> Step {
        self.take(n, what).map(drop)
    }

    fn int16(&mut self) -> Result<i16, Refused> {
        let b = self.take(2, "int16")?;
        Ok(i16::from_be_bytes([b[0], b[1]]))
    }

    fn int32(&mut self, what: &str) -> Result<i32, Refused> {
        let b = self.take(4, what)?;
        Ok(i32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    /// An unsigned varint read exactly as the decoder reads one: at most five
    /// bytes, the bits past 32 dropped.
    fn uvarint(&mut self, what: &str) -> Result<u32, Refused> {
        let mut value: u32 = 0;
        for i in 0..5 {
            let b = u32::from(self.take(1, what)?[0]);
            value |= (b & 0x7f).wrapping_shl(i * 7);
            if b < 0x80 {
                break;
            }
        }
        Ok(value)
    }

    /// Adds `bytes` to what decoding allocates, refusing past the limit.
    fn charge(&mut self, bytes: usize, what: &str) -> Step {
        self.decoded = self.decoded.saturating_add(bytes);
        if self.decoded > self.max_decoded {
            return refuse(
                what,
                &format!(
                    "decoding would allocate over {} bytes (limit {})",
                    self.decoded, self.max_decoded
                ),
            );
        }
        Ok(())
    }

    /// A length or count as the decoder reads one: `compact`, a varint of
    /// the value + 1 (0 is null); else an int32 (`wide`) or an int16, -1
    /// null, below that refused. `None` for null.
    fn length(&mut self, compact: bool, wide: bool, what: &str) -> Result<Option<usize>, Refused> {
        let n = if compact {
            i64::from(self.uvarint(what)?) - 1
        } else if wide {
            i64::from(self.int32(what)?)
        } else {
            i64::from(self.int16()?)
        };
        match n {
            -1 => Ok(None),
            n if n < 0 => refuse(what, &format!("negative length {n}")),
            n => Ok(Some(n as usize)),
        }
    }

    /// A string (int16 length when not `compact`; null allowed), at most
    /// 32767 bytes: Kafka's decoders refuse a longer one, compact ones
    /// included ("string field ... had invalid length"), and Kafka closes
    /// the connection of a request it cannot parse. Without this, a compact
    /// group id could be as long as the frame and be kept for as long as the
    /// broker runs.
    fn string(&mut self, compact: bool, what: &str) -> Step {
        match self.length(compact, false, what)? {
            None => Ok(()),
            Some(n) if n > MAX_STRING => refuse(
                what,
                &format!("a string of {n} bytes (at most {MAX_STRING})"),
            ),
            Some(n) => self.skip(n, what),
        }
    }

    /// Bytes (int32 length when not `compact`; null allowed).
    fn bytes(&mut self, compact: bool, what: &str) -> Step {
        match self.length(compact, true, what)? {
            None => Ok(()),
            Some(n) => self.skip(n, what),
        }
    }

    /// An array of `T` (int32 count when not `compact`; null allowed), each
    /// element walked by `each`.
    fn array<T>(
        &mut self,
        compact: bool,
        what: &str,
        mut each: impl FnMut(&mut Self) -> Step,
    ) -> Step {
        let Some(count) = self.length(compact, true, what)? else {
            return Ok(());
        };
        if count > self.rest.len() {
            return refuse(
                what,
                &format!("{count} elements announced, {} bytes left", self.rest.len()),
            );
        }
        self.charge(count.saturating_mul(size_of::<T>()), what)?;
        for _ in 0..count {
            each(self)?;
        }
        Ok(())
    }

    /// Tagged fields (only in `flexible` versions). `known(walk, tag)` walks a
    /// field the decoder reads itself and returns `true`, returns `false` for
    /// one it keeps as bytes, or refuses one the decoder refuses.
    fn tagged(
        &mut self,
        flexible: bool,
        mut known: impl FnMut(&mut Self, u32) -> Result<bool, Refused>,
    ) -> Step {
        if !flexible {
            return Ok(());
        }
        let count = self.uvarint("tagged fields")? as usize;
        // A tag and a size: at least two bytes each.
        if count > self.rest.len() / 2 {
            return refuse(
                "tagged fields",
                &format!("{count} announced, {} bytes left", self.rest.len()),
            );
        }
        if count > 0 {
            let map = TAGGED_MAP.saturating_add(count.saturating_mul(TAGGED_ENTRY));
            self.charge(map, "tagged fields")?;
        }
        for _ in 0..count {
            let tag = self.uvarint("tag")?;
            let size = self.uvarint("tag size")? as usize;
            if size > self.rest.len() {
                return refuse(
                    "tagged field",
                    &format!("{size} bytes announced, {} left", self.rest.len()),
                );
            }
            let before = self.rest.len();
            if known(self, tag)? {
                if before - self.rest.len() != size {
                    return refuse("tagged field", "its value does not fill its size");
                }
            } else {
                self.skip(size, "tagged field")?;
            }
        }
        Ok(())
    }

    fn no_known_tags(&mut self, flexible: bool) -> Step {
        self.tagged(flexible, |_, _| Ok(false))
    }
}

fn produce(w: &mut Walk, v: i16) -> Step {
    let flex = v >= 9;
    w.string(flex, "transactional id")?;
    w.skip(2 + 4, "acks and timeout")?;
    w.array::<TopicProduceData>(flex, "produce topics", |w| {
        w.string(flex, "topic name")?;
        w.array::<PartitionProduceData>(flex, "produce partitions", |w| {
            w.skip(4, "partition")?;
            w.bytes(flex, "records")?;
            w.no_known_tags(flex)
        })?;
        w.no_known_tags(flex)
    })?;
    w.no_known_tags(flex)
}

fn fetch(w: &mut Walk, v: i16) -> Step {
    let flex = v >= 12;
    // Replica id, max wait, min bytes, max bytes, isolation level.
    w.skip(4 + 4 + 4 + 4 + 1, "fetch limits")?;
    if v >= 7 {
        w.skip(4 + 4, "session")?;
    }
    w.array::<FetchTopic>(flex, "fetch topics", |w| {
        w.string(flex, "topic name")?;
        w.array::<FetchPartition>(flex, "fetch partitions", |w| {
            let mut n = 4 + 8 + 4; // partition, fetch offset, partition max bytes
            if v >= 9 {
                n += 4; // current leader epoch
            }
            if v >= 12 {
                n += 4; // last fetched epoch
            }
            if v >= 5 {
                n += 8; // log start offset
            }
            w.skip(n, "fetch partition")?;
            // Tags 0 and 1 are fields of versions 17 and 18: the decoder
            // refuses them before.
            w.tagged(flex, |_, tag| match tag {
                0 | 1 => refuse("fetch partition", "a tag of a later version"),
                _ => Ok(false),
            })
        })?;
        w.no_known_tags(flex)
    })?;
    if v >= 7 {
        w.array::<ForgottenTopic>(flex, "forgotten topics", |w| {
            w.string(flex, "topic name")?;
            w.array::<i32>(flex, "forgotten partitions", |w| w.skip(4, "partition"))?;
            w.no_known_tags(flex)
        })?;
    }
    if v >= 11 {
        w.string(flex, "rack id")?;
    }
    // Tag 0 is the cluster id, read by the decoder; tag 1 is a field of
    // version 15 on, refused before.
    w.tagged(flex, |w, tag| match tag {
        0 => w.string(true, "cluster id").map(|()| true),
        1 => refuse("fetch", "a tag of a later version"),
        _ => Ok(false),
    })
}

fn list_offsets(w: &mut Walk, v: i16) -> Step {
    let flex = v >= 6;
    w.skip(4, "replica id")?;
    if v >= 2 {
        w.skip(1, "isolation level")?;
    }
    w.array::<ListOffsetsTopic>(flex, "list offsets topics", |w| {
        w.string(flex, "topic name")?;
        w.array::<ListOffsetsPartition>(flex, "list offsets partitions", |w| {
            w.skip(if v >= 4 { 4 + 4 + 8 } else { 4 + 8 }, "partition")?;
            w.no_known_tags(flex)
        })?;
        w.no_known_tags(flex)
    })?;
    w.no_known_tags(flex)
}

fn metadata(w: &mut Walk, v: i16) -> Step {
    let flex = v >= 9;
    w.array::<MetadataRequestTopic>(flex, "metadata topics", |w| {
        if v >= 10 {
            w.skip(16, "topic id")?;
        }
        w.string(flex, "topic name")?;
        w.no_known_tags(flex)
    })?;
    if v >= 4 {
        w.skip(1, "allow auto topic creation")?;
    }
    if (8..=10).contains(&v) {
        w.skip(1, "include cluster authorized operations")?;
    }
    if v >= 8 {
        w.skip(1, "include topic authorized operations")?;
    }
    w.no_known_tags(flex)
}

fn api_versions(w: &mut Walk, v: i16) -> Step {
    let flex = v >= 3;
    if flex {
        w.string(true, "client software name")?;
        w.string(true, "client software version")?;
    }
    w.no_known_tags(flex)
}

fn find_coordinator(w: &mut Walk, v: i16) -> Step {
    let flex = v >= 3;
    if v <= 3 {
        w.string(flex, "key")?;
    }
    if v >= 1 {
        w.skip(1, "key type")?;
    }
    if v >= 4 {
        w.array::<StrBytes>(true, "coordinator keys", |w| w.string(true, "key"))?;
    }
    w.no_known_tags(flex)
}

fn join_group(w: &mut Walk, v: i16) -> Step {
    let flex = v >= 6;
    w.string(flex, "group id")?;
    w.skip(if v >= 1 { 8 } else { 4 }, "timeouts")?;
    w.string(flex, "member id")?;
    if v >= 5 {
        w.string(flex, "group instance id")?;
    }
    w.string(flex, "protocol type")?;
    w.array::<JoinGroupRequestProtocol>(flex, "protocols", |w| {
        w.string(flex, "protocol name")?;
        w.bytes(flex, "protocol metadata")?;
        w.no_known_tags(flex)
    })?;
    if v >= 8 {
        w.string(true, "reason")?;
    }
    w.no_known_tags(flex)
}

fn sync_group(w: &mut Walk, v: i16) -> Step {
    let flex = v >= 4;
    group_member(w, flex, v >= 3)?;
    if v >= 5 {
        w.string(true, "protocol type")?;
        w.string(true, "protocol name")?;
    }
    w.array::<SyncGroupRequestAssignment>(flex, "assignments", |w| {
        w.string(flex, "member id")?;
        w.bytes(flex, "assignment")?;
        w.no_known_tags(flex)
    })?;
    w.no_known_tags(flex)
}

fn heartbeat(w: &mut Walk, v: i16) -> Step {
    let flex = v >= 4;
    group_member(w, flex, v >= 3)?;
    w.no_known_tags(flex)
}

/// The fields that open a member's request in a generation (SyncGroup,
/// Heartbeat, OffsetCommit): group id, generation, member id, and from
/// some version the group instance id.
fn group_member(w: &mut Walk, flex: bool, instance_id: bool) -> Step {
    w.string(flex, "group id")?;
    w.skip(4, "generation")?;
    w.string(flex, "member id")?;
    if instance_id {
        w.string(flex, "group instance id")?;
    }
    Ok(())
}

fn leave_group(w: &mut Walk, v: i16) -> Step {
    let flex = v >= 4;
    w.string(flex, "group id")?;
    if v <= 2 {
        w.string(false, "member id")?;
    } else {
        w.array::<MemberIdentity>(flex, "members", |w| {
            w.string(flex, "member id")?;
            w.string(flex, "group instance id")?;
            if v >= 5 {
                w.string(true, "reason")?;
            }
            w.no_known_tags(flex)
        })?;
    }
    w.no_known_tags(flex)
}

fn offset_commit(w: &mut Walk, v: i16) -> Step {
    let flex = v >= 8;
    group_member(w, flex, v >= 7)?;
    if v <= 4 {
        w.skip(8, "retention time")?;
    }
    w.array::<OffsetCommitRequestTopic>(flex, "commit topics", |w| {
        w.string(flex, "topic name")?;
        w.array::<OffsetCommitRequestPartition>(flex, "commit partitions", |w| {
            w.skip(if v >= 6 { 4 + 8 + 4 } else { 4 + 8 }, "partition")?;
            w.string(flex, "committed metadata")?;
            w.no_known_tags(flex)
        })?;
        w.no_known_tags(flex)
    })?;
    w.no_known_tags(flex)
}

fn offset_fetch(w: &mut Walk, v: i16) -> Step {
    let flex = v >= 6;
    w.string(flex, "group id")?;
    w.array::<OffsetFetchRequestTopic>(flex, "fetch offsets topics", |w| {
        w.string(flex, "topic name")?;
        w.array::<i32>(flex, "partition indexes", |w| w.skip(4, "partition"))?;
        w.no_known_tags(flex)
    })?;
    if v >= 7 {
        w.skip(1, "require stable")?;
    }
    w.no_known_tags(flex)
}

fn create_topics(w: &mut Walk, v: i16) -> Step {
    let flex = v >= 5;
    w.array::<CreatableTopic>(flex, "create topics", |w| {
        w.string(flex, "topic name")?;
        w.skip(4 + 2, "partitions and replication factor")?;
        w.array::<CreatableReplicaAssignment>(flex, "assignments", |w| {
            w.skip(4, "partition")?;
            w.array::<i32>(flex, "broker ids", |w| w.skip(4, "broker id"))?;
            w.no_known_tags(flex)
        })?;
        w.array::<CreatableTopicConfig>(flex, "configs", |w| {
            w.string(flex, "config name")?;
            w.string(flex, "config value")?;
            w.no_known_tags(flex)
        })?;
        w.no_known_tags(flex)
    })?;
    w.skip(4 + 1, "timeout and validate only")?;
    w.no_known_tags(flex)
}

fn list_groups(w: &mut Walk, v: i16) -> Step {
    let flex = v >= 3;
    if v >= 4 {
        w.array::<StrBytes>(true, "states filter", |w| w.string(true, "state"))?;
    }
    if v >= 5 {
        w.array::<StrBytes>(true, "types filter", |w| w.string(true, "type"))?;
    }
    w.no_known_tags(flex)
}

fn describe_groups(w: &mut Walk, v: i16) -> Step {
    let flex = v >= 5;
    w.array::<StrBytes>(flex, "groups", |w| w.string(flex, "group id"))?;
    if v >= 3 {
        w.skip(1, "include authorized operations")?;
    }
    w.no_known_tags(flex)
}

fn delete_groups(w: &mut Walk, v: i16) -> Step {
    let flex = v >= 2;
    w.array::<StrBytes>(flex, "groups", |w| w.string(flex, "group id"))?;
    w.no_known_tags(flex)
}
