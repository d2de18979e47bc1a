//! Topics, partitions and their in-memory logs.
//!
//! A partition's log is the record batches producers sent, stored as they
//! arrived (format v2, any compression: the broker never opens them) with
//! their base offset rewritten, as Kafka's leader does. The CRC of a v2 batch
//! starts after the base offset, so the rewrite keeps it valid.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use bytes::{Buf, Bytes, BytesMut};
use tokio::time::Instant;

/// A partition's watch key in the purgatories: topic number and partition,
/// packed so hashing it is one `u64`.
pub type PartitionKey = u64;

/// One stored record batch.
struct Batch {
    base: u64,
    /// One past its last offset.
    end: u64,
    max_timestamp: i64,
    bytes: Bytes,
}

/// Why an append was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AppendError {
    /// Not record batches of format v2, cut short, or failing their CRC
    /// (Kafka's `CORRUPT_MESSAGE`).
    Corrupt,
    /// Well-formed batches whose contents disagree: a record count that is
    /// not the last offset delta + 1, or records out of order (Kafka's
    /// `INVALID_RECORD`).
    Invalid,
}

/// What a read found below the high watermark.
pub struct Read {
    pub records: Bytes,
    pub high_watermark: u64,
}

/// A partition: its log, its log end, its high watermark, and how far each
/// follower has copied it.
pub struct Partition {
    pub key: PartitionKey,
    pub index: i32,
    log: Mutex<Vec<Batch>>,
    log_end: AtomicU64,
    high_watermark: AtomicU64,
    /// Each follower's copied offset (its log end).
    copied: Vec<AtomicU64>,
    /// Each follower's place in the in-sync replica set.
    isr: Mutex<Vec<Replica>>,
    /// Woken at each high watermark move, for the `Notify` way of waiting.
    pub notify: tokio::sync::Notify,
}

/// A follower as the leader tracks it for the ISR (Kafka's `Replica`).
#[derive(Clone, Copy)]
struct Replica {
    in_sync: bool,
    /// The latest time at which the follower had all the leader had then:
    /// the append time of the newest copy it made (Kafka's
    /// `lastCaughtUpTimeMs`).
    caught_up: Instant,
}

impl Partition {
    fn new(key: PartitionKey, index: i32, followers: usize) -> Partition {
        Partition {
            key,
            index,
            log: Mutex::new(Vec::new()),
            log_end: AtomicU64::new(0),
            high_watermark: AtomicU64::new(0),
            copied: (0..followers).map(|_| AtomicU64::new(0)).collect(),
            isr: Mutex::new(vec![
                Replica {
                    in_sync: true,
                    caught_up: Instant::now(),
                };
                followers
            ]),
            notify: tokio::sync::Notify::new(),
        }
    }

    pub fn log_end(&self) -> u64 {
        self.log_end.load(Ordering::Acquire)
    }

    pub fn high_watermark(&self) -> u64 {
        self.high_watermark.load(Ordering::Acquire)
    }

    /// Appends the batches in `records`, giving them the next offsets.
    /// Returns the first and one past the last offset given.
    pub fn append(&self, records: &Bytes, now_ms: i64) -> Result<(u64, u64), AppendError> {
        let batches = split_batches(records)?;
        let mut log = self.log.lock().unwrap();
        let first = self.log_end.load(Ordering::Relaxed);
        let mut next = first;
        for (raw, count, max_timestamp) in batches {
            let mut batch = BytesMut::from(&raw[..]);
            batch[..8].copy_from_slice(&(next as i64).to_be_bytes());
            let max_timestamp = if max_timestamp < 0 {
                now_ms
            } else {
                max_timestamp
            };
            log.push(Batch {
                base: next,
                end: next + count,
                max_timestamp,
                bytes: batch.freeze(),
            });
            next += count;
        }
        // Published under the lock, so log ends only grow.
        self.log_end.store(next, Ordering::Release);
        Ok((first, next))
    }

    /// Records follower `f` as having copied up to `offset`, which was the
    /// leader's log end at `appended`; returns the new high watermark if it
    /// moved. A follower out of the ISR that has reached the high watermark
    /// joins it again (Kafka's `maybeExpandIsr`).
    pub fn copied(&self, f: usize, offset: u64, appended: Instant) -> Option<u64> {
        self.copied[f].fetch_max(offset, Ordering::AcqRel);
        {
            let mut isr = self.isr.lock().unwrap();
            let r = &mut isr[f];
            r.caught_up = r.caught_up.max(appended);
            if !r.in_sync && offset >= self.high_watermark() {
                r.in_sync = true;
                tracing::info!(
                    partition = self.key,
                    follower = f,
                    "follower back in the ISR"
                );
            }
        }
        self.advance_high_watermark()
    }

    /// Takes out of the ISR every follower that is behind the log end and
    /// has not caught up for `max_lag` (Kafka's `maybeShrinkIsr` with
    /// `replica.lag.time.max.ms`); returns the new high watermark if that
    /// moved it.
    pub fn shrink_isr(&self, now: Instant, max_lag: std::time::Duration) -> Option<u64> {
        let log_end = self.log_end();
        let mut shrunk = false;
        for (f, r) in self.isr.lock().unwrap().iter_mut().enumerate() {
            let behind = self.copied[f].load(Ordering::Acquire) < log_end;
            if !behind {
                // Has all the leader has: caught up now (Kafka moves
                // lastCaughtUpTime on every fetch that reaches the log end),
                // so an idle spell does not make it look stale at the next
                // append.
                r.caught_up = now;
                continue;
            }
            if r.in_sync && now.saturating_duration_since(r.caught_up) > max_lag {
                r.in_sync = false;
                shrunk = true;
                tracing::info!(
                    partition = self.key,
                    follower = f,
                    "follower out of the ISR"
                );
            }
        }
        if shrunk {
            self.advance_high_watermark()
        } else {
            None
        }
    }

    /// Replicas in the ISR, the leader included.
    pub fn isr_size(&self) -> usize {
        1 + self
            .isr
            .lock()
            .unwrap()
            .iter()
            .filter(|r| r.in_sync)
            .count()
    }

    /// The followers in the ISR (0-based).
    pub fn in_sync_followers(&self) -> Vec<usize> {
        let isr = self.isr.lock().unwrap();
        (0..isr.len()).filter(|&f| isr[f].in_sync).collect()
    }

    /// Recomputes the high watermark (the least of the leader's log end and
    /// what each in-sync follower copied); `Some(new)` when it moved.
    pub fn advance_high_watermark(&self) -> Option<u64> {
        // Under the ISR lock, so a follower rejoining (checked against the
        // high watermark) cannot slip in between the reading and the move.
        let isr = self.isr.lock().unwrap();
        let hw = self
            .copied
            .iter()
            .zip(isr.iter())
            .filter(|(_, r)| r.in_sync)
            .map(|(c, _)| c.load(Ordering::Acquire))
            .fold(self.log_end(), u64::min);
        let before = self.high_watermark.fetch_max(hw, Ordering::AcqRel);
        drop(isr);
        (hw > before).then_some(hw)
    }

    /// Bytes of whole batches from `offset` up to the high watermark, counted
    /// until `enough` is reached.
    pub fn available(&self, offset: u64, enough: u64) -> u64 {
        let hw = self.high_watermark();
        if offset >= hw {
            return 0;
        }
        let log = self.log.lock().unwrap();
        let mut bytes = 0;
        for b in &log[first_batch(&log, offset)..] {
            if b.end > hw || bytes >= enough {
                break;
            }
            bytes += b.bytes.len() as u64;
        }
        bytes
    }

    /// Whole batches from the one holding `offset`, below the high watermark,
    /// at most `max_bytes` of them unless the first alone is larger (then just
    /// the first, so a consumer always makes progress, as Kafka does). Each
    /// batch is copied only once `charge` has taken its size (the caller's
    /// memory budget); the first it refuses ends the read.
    pub fn read(
        &self,
        offset: u64,
        max_bytes: usize,
        allow_oversized: bool,
        charge: &mut dyn FnMut(usize) -> bool,
    ) -> Read {
        let hw = self.high_watermark();
        let log = self.log.lock().unwrap();
        let mut out = BytesMut::new();
        if offset < hw {
            for b in &log[first_batch(&log, offset)..] {
                if b.end > hw {
                    break;
                }
                let fits = out.len() + b.bytes.len() <= max_bytes;
                if !(fits || out.is_empty() && allow_oversized) || !charge(b.bytes.len()) {
                    break;
                }
                out.extend_from_slice(&b.bytes);
                if !fits {
                    break;
                }
            }
        }
        Read {
            records: out.freeze(),
            high_watermark: hw,
        }
    }

    /// Kafka's offset-by-time lookup, at batch granularity, among what is
    /// replicated: the first batch whose newest record is at least
    /// `timestamp`, as (its first offset, its newest record's timestamp);
    /// `None` when no record is that new.
    pub fn offset_for_time(&self, timestamp: i64) -> Option<(u64, i64)> {
        let hw = self.high_watermark();
        let log = self.log.lock().unwrap();
        log.iter()
            .take_while(|b| b.end <= hw)
            .find(|b| b.max_timestamp >= timestamp)
            .map(|b| (b.base, b.max_timestamp))
    }

    /// Kafka's `MAX_TIMESTAMP` lookup, at batch granularity, among what is
    /// replicated: the last offset of the (first) batch holding the newest
    /// timestamp, with that timestamp; `None` when nothing is.
    pub fn newest_timestamp(&self) -> Option<(u64, i64)> {
        let hw = self.high_watermark();
        let log = self.log.lock().unwrap();
        log.iter()
            .take_while(|b| b.end <= hw)
            .fold(None, |best: Option<&Batch>, b| match best {
                Some(m) if m.max_timestamp >= b.max_timestamp => Some(m),
                _ => Some(b),
            })
            .map(|b| (b.end - 1, b.max_timestamp))
    }
}

/// Index of the batch holding `offset` (or the first after it).
fn first_batch(log: &[Batch], offset: u64) -> usize {
    log.partition_point(|b| b.end <= offset)
}

/// Splits `records` into v2 batches, each checked as Kafka's `LogValidator`
/// checks what it stores: (bytes, record count, max timestamp).
fn split_batches(records: &Bytes) -> Result<Vec<(Bytes, u64, i64)>, AppendError> {
    let mut rest = records.clone();
    let mut out = Vec::new();
    while !rest.is_empty() {
        if rest.len() < HEADER {
            return Err(AppendError::Corrupt);
        }
        let length = (&rest[8..12]).get_i32();
        let magic = rest[16];
        if length < (HEADER - 12) as i32 || magic != 2 {
            return Err(AppendError::Corrupt);
        }
        let size = 12 + length as usize;
        if rest.len() < size {
            return Err(AppendError::Corrupt);
        }
        let batch = rest.split_to(size);
        out.push(check_batch(&batch)?);
    }
    if out.is_empty() {
        return Err(AppendError::Corrupt);
    }
    Ok(out)
}

/// The v2 batch header: base offset (8), length (4), leader epoch (4), magic
/// (1), CRC (4), attributes (2), last offset delta (4), first timestamp (8),
/// max timestamp (8), producer id (8), producer epoch (2), base sequence (4),
/// record count (4).
const HEADER: usize = 61;

/// Checks one whole v2 batch: its CRC-32C (over everything after the CRC),
/// its record count against its last offset delta, and, when it is not
/// compressed, each record's framing and offset delta. This broker has no
/// codecs, so a compressed batch's records are not opened (Kafka decompresses
/// and checks them too).
fn check_batch(batch: &Bytes) -> Result<(Bytes, u64, i64), AppendError> {
    let crc = (&batch[17..21]).get_u32();
    if crc32c::crc32c(&batch[21..]) != crc {
        return Err(AppendError::Corrupt);
    }
    let attributes = (&batch[21..23]).get_i16();
    let last_delta = (&batch[23..27]).get_i32();
    let max_timestamp = (&batch[35..43]).get_i64();
    let count = (&batch[57..61]).get_i32();
    // Kafka: "Header-level record count does not match the last offset".
    if count <= 0 || last_delta.checked_add(1) != Some(count) {
        return Err(AppendError::Invalid);
    }
    if attributes & 0x07 == 0 {
        check_records(&batch[HEADER..], count)?;
    }
    Ok((batch.clone(), count as u64, max_timestamp))
}

/// Walks the records of an uncompressed batch: `count` records, each exactly
/// the length it announces, with offset deltas 0, 1, ... in order, and nothing
/// after the last.
fn check_records(mut records: &[u8], count: i32) -> Result<(), AppendError> {
    for expected in 0..count {
        let length = varint(&mut records)?;
        let length = usize::try_from(length).map_err(|_| AppendError::Corrupt)?;
        if length > records.len() {
            return Err(AppendError::Corrupt);
        }
        let (mut record, rest) = records.split_at(length);
        records = rest;
        take(&mut record, 1)?; // attributes
        varint(&mut record)?; // timestamp delta
        if varint(&mut record)? != i64::from(expected) {
            return Err(AppendError::Invalid);
        }
        field(&mut record)?; // key
        field(&mut record)?; // value
        let headers = varint(&mut record)?;
        if headers < 0 || headers as usize > record.len() {
            return Err(AppendError::Corrupt);
        }
        for _ in 0..headers {
            // A header's key may not be null; its value may.
            let key = varint(&mut record)?;
            let key = usize::try_from(key).map_err(|_| AppendError::Corrupt)?;
            take(&mut record, key)?;
            field(&mut record)?;
        }
        if !record.is_empty() {
            return Err(AppendError::Corrupt);
        }
    }
    if records.is_empty() {
        Ok(())
    } else {
        Err(AppendError::Corrupt)
    }
}
/// Takes `n` bytes off the front of `buf`.
fn take<'a>(buf: &mut &'a [u8], n: usize) -> Result<&'a [u8], AppendError> {
    if n > buf.len() {
        return Err(AppendError::Corrupt);
    }
    let (head, rest) = buf.split_at(n);
    *buf = rest;
    Ok(head)
}

/// A zigzag varint (up to 64 bits, as Kafka's `ByteUtils.readVarlong`).
fn varint(buf: &mut &[u8]) -> Result<i64, AppendError> {
    let mut raw: u64 = 0;
    for i in 0..10 {
        let b = take(buf, 1)?[0];
        raw |= u64::from(b & 0x7f) << (i * 7);
        if b < 0x80 {
            return Ok((raw >> 1) as i64 ^ -((raw & 1) as i64));
        }
    }
    Err(AppendError::Corrupt)
}

/// A length-prefixed field that may be null (length -1).
fn field(buf: &mut &[u8]) -> Result<(), AppendError> {
    match varint(buf)? {
        -1 => Ok(()),
        n if n < 0 => Err(AppendError::Corrupt),
        n => take(buf, usize::try_from(n).map_err(|_| AppendError::Corrupt)?).map(drop),
    }
}

/// A topic: its name and partitions.
pub struct Topic {
    pub name: Arc<str>,
    pub partitions: Vec<Arc<Partition>>,
}

/// Every topic, created on first use with `partitions` partitions.
pub struct Topics {
    by_name: RwLock<HashMap<Arc<str>, Arc<Topic>>>,
    partitions: i32,
    followers: usize,
    auto_create: bool,
    max_topics: usize,
}

impl Topics {
    pub fn new(partitions: i32, followers: usize, auto_create: bool, max_topics: usize) -> Topics {
        Topics {
            by_name: RwLock::new(HashMap::new()),
            partitions,
            followers,
            auto_create,
            max_topics,
        }
    }

    pub fn get(&self, name: &str) -> Option<Arc<Topic>> {
        self.by_name.read().unwrap().get(name).cloned()
    }

    pub fn partition(&self, name: &str, index: i32) -> Option<Arc<Partition>> {
        let topic = self.get(name)?;
        usize::try_from(index)
            .ok()
            .and_then(|i| topic.partitions.get(i).cloned())
    }

    /// The topic, created if it is new, `create` is set, creation on first
    /// use is on, and the broker holds fewer than its most topics.
    pub fn get_or_create(&self, name: &str, create: bool) -> Option<Arc<Topic>> {
        if let Some(t) = self.get(name) {
            return Some(t);
        }
        if !(create && self.auto_create && valid_topic_name(name)) {
            return None;
        }
        self.create(name, self.partitions)
    }

    /// Creates `name` with `partitions` partitions, or returns it if it
    /// exists; `None` if it is new and the broker holds its most topics.
    pub fn create(&self, name: &str, partitions: i32) -> Option<Arc<Topic>> {
        let mut map = self.by_name.write().unwrap();
        let number = map.len() as u64;
        if number as usize >= self.max_topics && !map.contains_key(name) {
            tracing::warn!(
                topic = name,
                max = self.max_topics,
                "topic not created: too many topics"
            );
            return None;
        }
        let topic = map
            .entry(Arc::from(name))
            .or_insert_with(|| {
                let name: Arc<str> = Arc::from(name);
                Arc::new(Topic {
                    partitions: (0..partitions)
                        .map(|p| {
                            let key = number << 32 | p as u32 as u64;
                            Arc::new(Partition::new(key, p, self.followers))
                        })
                        .collect(),
                    name,
                })
            })
            .clone();
        Some(topic)
    }

    pub fn all(&self) -> Vec<Arc<Topic>> {
        let mut all: Vec<_> = self.by_name.read().unwrap().values().cloned().collect();
        all.sort_by(|a, b| a.name.cmp(&b.name));
        all
    }

    pub fn all_partitions(&self) -> Vec<Arc<Partition>> {
        self.all()
            .iter()
            .flat_map(|t| t.partitions.iter().cloned())
            .collect()
    }
}

/// Kafka's rule: 1 to 249 characters of ASCII letters, digits, '.', '_', '-'.
fn valid_topic_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() < 250
        && name != "."
        && name != ".."
        && name
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_' | b'-'))
}
