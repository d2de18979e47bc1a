//! Topics, partitions and their in-memory logs.
//!
//! A partition's log is the record batches producers sent, one per produce
//! and partition, each checked as Kafka checks what it stores ([`check`]) and
//! stored as it arrived (format v2, any compression: storing it never
//! decompresses it; only `ListOffsets` by time reads the records' timestamps
//! inside it, see [`super::timestamps`]) with its base offset rewritten, as
//! Kafka's leader does. The
//! CRC of a v2 batch starts after the base offset, so the rewrite keeps it
//! valid.
//!
//! The logs together hold at most `max_log_bytes` (each batch counted with
//! what keeping it costs): past it the oldest batches go first, across
//! partitions, and each partition's log start offset moves up past what it
//! lost, as Kafka's size-based retention drops a partition's oldest segments.
//! Like Kafka's, it drops only what is replicated (below the high watermark):
//! it looks past up to [`LOOK_PAST`] batches not replicated yet at the front
//! of the order for replicated ones of other partitions. An append that would
//! need more room than that frees is refused, and then drops nothing.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use bytes::{Buf, Bytes, BytesMut};
use tokio::time::Instant;

use super::timestamps::{first_record, Limits, Scan};

/// A partition's watch key in the purgatories: topic number and partition,
/// packed so hashing it is one `u64`.
pub type PartitionKey = u64;

/// One stored record batch.
struct Batch {
    base: u64,
    /// One past its last offset.
    end: u64,
    max_timestamp: i64,
    /// Bytes appended to the partition before it (its position in the log,
    /// as a segment file's): what lies between two batches is the difference
    /// of their positions, whatever was dropped before them.
    position: u64,
    bytes: Bytes,
}

/// A stored batch's entry in the retention order: its partition, its end,
/// and what keeping it costs (its bytes and [`BATCH_COST`]).
struct Kept {
    part: Arc<Partition>,
    end: u64,
    cost: usize,
}

/// What keeping a batch costs beyond its bytes: its entries in the
/// partition's log and in the retention order (each queue's room up to twice
/// what it holds, see [`shrink`]), and its allocation's bookkeeping. Counted
/// against `max_log_bytes`, so that a flood of tiny batches is bounded too.
pub const BATCH_COST: usize = 2 * (std::mem::size_of::<Batch>() + std::mem::size_of::<Kept>()) + 32;

/// Why an append was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AppendError {
    /// Not a record batch of a format Kafka knows, failing its CRC, too
    /// short for its header, or flagged with a codec that does not exist or
    /// holding bytes that are not that codec's (Kafka's `CORRUPT_MESSAGE`).
    Corrupt,
    /// A record set Kafka refuses with `INVALID_RECORD`: no batch, more than
    /// one, one of an older format (magic 0 or 1), a base offset other than
    /// 0, or a well-formed batch whose contents disagree (a record count that
    /// is not the last offset delta + 1, records out of order).
    Invalid,
    /// A batch over `max.message.bytes` (Kafka's `MESSAGE_TOO_LARGE`).
    TooLarge,
    /// Zstandard in a produce older than version 7 (Kafka's
    /// `UNSUPPORTED_COMPRESSION_TYPE`).
    UnsupportedCompression,
    /// The logs are full of what cannot be dropped yet, because it is not
    /// replicated (Kafka's answer when it cannot write its log,
    /// `KAFKA_STORAGE_ERROR`, retriable).
    Full,
}

/// A record set that passed [`check`]: its one batch.
pub struct Checked {
    batch: Bytes,
    count: u64,
    max_timestamp: i64,
}

/// What a read found below the high watermark.
pub struct Read {
    pub records: Bytes,
    pub high_watermark: u64,
    /// The log start when it read: a position below it is out of range.
    pub log_start: u64,
}

/// A partition's log: its batches, oldest first.
#[derive(Default)]
struct Log {
    batches: VecDeque<Batch>,
    /// Bytes appended since the partition was made: the next batch's
    /// position.
    appended: u64,
}

/// A partition: its log, its log start and end, its high watermark, and how
/// far each follower has copied it.
pub struct Partition {
    pub key: PartitionKey,
    pub index: i32,
    log: Mutex<Log>,
    /// The first offset the log holds (Kafka's log start offset): 0 until
    /// retention drops batches.
    log_start: AtomicU64,
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
            log: Mutex::new(Log::default()),
            log_start: AtomicU64::new(0),
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

    pub fn log_start(&self) -> u64 {
        self.log_start.load(Ordering::Acquire)
    }

    pub fn log_end(&self) -> u64 {
        self.log_end.load(Ordering::Acquire)
    }

    pub fn high_watermark(&self) -> u64 {
        self.high_watermark.load(Ordering::Acquire)
    }

    /// Appends `checked`'s batch, giving it the next offsets, and puts it in
    /// `order` for retention (under the log's lock, so each partition's
    /// entries there are in its log's order). Returns the first and one past
    /// the last offset given.
    fn append(self: &Arc<Self>, checked: Checked, now_ms: i64, order: &Order) -> (u64, u64) {
        let mut log = self.log.lock().unwrap();
        let base = self.log_end.load(Ordering::Relaxed);
        let end = base + checked.count;
        let mut batch = BytesMut::from(&checked.batch[..]);
        batch[..8].copy_from_slice(&(base as i64).to_be_bytes());
        let max_timestamp = if checked.max_timestamp < 0 {
            now_ms
        } else {
            checked.max_timestamp
        };
        let position = log.appended;
        let cost = batch.len() + BATCH_COST;
        log.appended += batch.len() as u64;
        log.batches.push_back(Batch {
            base,
            end,
            max_timestamp,
            position,
            bytes: batch.freeze(),
        });
        order.lock().unwrap().push_back(Kept {
            part: self.clone(),
            end,
            cost,
        });
        // Published under the lock, so log ends only grow.
        self.log_end.store(end, Ordering::Release);
        (base, end)
    }

    /// Drops the batches that end at or before `end` and moves the log
    /// start past them (what they cost is given back by the caller, which
    /// took their entries out of the retention order).
    fn drop_until(&self, end: u64) {
        let mut log = self.log.lock().unwrap();
        while log.batches.front().is_some_and(|b| b.end <= end) {
            let b = log.batches.pop_front().unwrap();
            self.log_start.fetch_max(b.end, Ordering::AcqRel);
        }
        shrink(&mut log.batches);
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

    /// Bytes of whole batches from the one holding `offset` up to the high
    /// watermark, at most `most` (Kafka's `DelayedFetch` counts at most a
    /// partition's `partition_max_bytes` of it towards `min_bytes`). Two
    /// binary searches and the batches' positions: the same cost whatever
    /// the log holds.
    pub fn available(&self, offset: u64, most: u64) -> u64 {
        let hw = self.high_watermark();
        if offset >= hw {
            return 0;
        }
        let log = self.log.lock().unwrap();
        let from = first_batch(&log.batches, offset);
        // The high watermark is always at a batch's end.
        let to = log.batches.partition_point(|b| b.end <= hw);
        if from >= to {
            return 0;
        }
        let last = &log.batches[to - 1];
        let bytes = last.position + last.bytes.len() as u64 - log.batches[from].position;
        bytes.min(most)
    }

    /// Whole batches from the one holding `offset`, below the high watermark,
    /// at most `max_bytes` of them unless the first alone is larger (then just
    /// the first, so a consumer always makes progress, as Kafka does). Each
    /// batch is copied only once `charge` has taken its size (the caller's
    /// memory budget); the first it refuses ends the read. Nothing below the
    /// log start (the caller answers `OFFSET_OUT_OF_RANGE`).
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
        // The log start moves under the log's lock: read with it.
        let log_start = self.log_start();
        if offset < hw && offset >= log_start {
            for b in log.batches.range(first_batch(&log.batches, offset)..) {
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
            log_start,
        }
    }

    /// Kafka's offset-by-time lookup (`FileRecords.searchForTimestamp`),
    /// among what is kept and replicated: in the first batch whose newest
    /// record is at least `timestamp`, the first record at least that new,
    /// as (its offset, its timestamp); when none is (a batch's header says
    /// more than its records), the next such batch. `None` when no record is
    /// that new. Each batch's records are read outside the log's lock, within
    /// `limits` (see [`super::timestamps`]); a batch they cannot be read
    /// within is answered at batch granularity (its first offset, its newest
    /// timestamp), which is never past the record asked for.
    pub fn offset_for_time(&self, timestamp: i64, limits: &mut Limits) -> Option<(u64, i64)> {
        let mut from = 0;
        loop {
            let (bytes, base, end, newest) = {
                let hw = self.high_watermark();
                let log = self.log.lock().unwrap();
                let b = log
                    .batches
                    .range(first_batch(&log.batches, from)..)
                    .take_while(|b| b.end <= hw)
                    .find(|b| b.max_timestamp >= timestamp)?;
                (b.bytes.clone(), b.base, b.end, b.max_timestamp)
            };
            match first_record(&bytes, base, limits, |ts| ts >= timestamp) {
                Scan::Found(offset, ts) => return Some((offset, ts)),
                Scan::NotFound => from = end,
                Scan::Unreadable => return Some((base, newest)),
            }
        }
    }

    /// Kafka's `MAX_TIMESTAMP` lookup (as of KAFKA-16310, Kafka 3.7.1),
    /// among what is kept and replicated: in the first batch holding the
    /// newest timestamp, the first record with that timestamp, as (its
    /// offset, the timestamp); `None` when nothing is kept, or when no record
    /// of that batch has it (as Kafka, which then answers no offset). A batch
    /// whose records cannot be read within `limits` is answered with its
    /// first offset.
    pub fn newest_timestamp(&self, limits: &mut Limits) -> Option<(u64, i64)> {
        let (bytes, base, newest) = {
            let hw = self.high_watermark();
            let log = self.log.lock().unwrap();
            let b = log.batches.iter().take_while(|b| b.end <= hw).fold(
                None,
                |best: Option<&Batch>, b| match best {
                    Some(m) if m.max_timestamp >= b.max_timestamp => Some(m),
                    _ => Some(b),
                },
            )?;
            (b.bytes.clone(), b.base, b.max_timestamp)
        };
        match first_record(&bytes, base, limits, |ts| ts == newest) {
            Scan::Found(offset, _) => Some((offset, newest)),
            Scan::NotFound => None,
            Scan::Unreadable => Some((base, newest)),
        }
    }
}

/// Index of the batch holding `offset` (or the first after it).
fn first_batch(log: &VecDeque<Batch>, offset: u64) -> usize {
    log.partition_point(|b| b.end <= offset)
}

/// Gives back a queue's room once it holds under half of it, keeping room for
/// half as much again as it holds. Its room so stays within twice what it
/// holds (as [`BATCH_COST`] counts it; a queue that emptied after a burst
/// does not keep the burst's size), and a reallocation either way is
/// followed by at least a quarter of the length in pushes or pops before the
/// next: amortized, as its growth is. (Giving it back down to exactly its
/// length would have the next push double it again: a queue at half its
/// room, popped twice and pushed once per append, would be reallocated
/// whole twice per append.)
fn shrink<T>(queue: &mut VecDeque<T>) {
    if queue.capacity() > 4 && queue.len() < queue.capacity() / 2 {
        queue.shrink_to(queue.len() + queue.len() / 2);
    }
}

/// Every stored batch in the order it was appended: the order retention
/// drops them in.
type Order = Mutex<VecDeque<Kept>>;

/// How many batches retention looks past at the front of the order when they
/// cannot be dropped yet (not replicated), for replicated batches of other
/// partitions behind them. Bounded, so that an append's search under the
/// order's lock is too: with more than this many in the way, an append that
/// needs room is refused.
const LOOK_PAST: usize = 32;

/// The room the logs share.
struct Store {
    /// The most the logs hold, each batch counted with [`BATCH_COST`].
    limit: usize,
    /// What they hold, and what appends under way have reserved.
    used: AtomicUsize,
    order: Order,
}

impl Store {
    /// Reserves `cost` bytes, dropping the oldest batches that can be
    /// dropped until it fits: the replicated ones from the front of the
    /// order, looking past up to [`LOOK_PAST`] that cannot be. What they
    /// would free is added up first: when it is not enough, nothing is
    /// dropped and nothing reserved (`false`).
    fn reserve(&self, cost: usize) -> bool {
        if self.used.fetch_add(cost, Ordering::AcqRel) + cost <= self.limit {
            return true;
        }
        let taken = {
            let mut order = self.order.lock().unwrap();
            // Others may have made room meanwhile (what is dropped is given
            // back under this lock).
            let Some(need) = self
                .used
                .load(Ordering::Acquire)
                .checked_sub(self.limit)
                .filter(|&n| n > 0)
            else {
                return true;
            };
            // The positions of the batches left in place. (A partition's
            // batches behind one of them are not replicated either, unless
            // its high watermark moves meanwhile: then dropping a later one
            // drops the one left too, replicated by then, whose cost stays
            // counted until its entry is taken, dropping nothing more.)
            let mut left = [0usize; LOOK_PAST];
            let (mut skipped, mut freed, mut upto) = (0, 0, 0);
            for (i, k) in order.iter().enumerate() {
                if k.end <= k.part.high_watermark() {
                    freed += k.cost;
                    if freed >= need {
                        upto = i + 1;
                        break;
                    }
                } else if skipped == LOOK_PAST {
                    break;
                } else {
                    left[skipped] = i;
                    skipped += 1;
                }
            }
            if upto == 0 {
                drop(order);
                self.used.fetch_sub(cost, Ordering::AcqRel);
                return false;
            }
            // Enough: take the droppable batches of the first `upto` out of
            // the order, and put the others back in front, in order.
            let mut taken = Vec::with_capacity(upto - skipped);
            let mut back = Vec::with_capacity(skipped);
            let mut next_left = left[..skipped].iter().peekable();
            for (i, k) in order.drain(..upto).enumerate() {
                if next_left.next_if_eq(&&i).is_some() {
                    back.push(k);
                } else {
                    taken.push(k);
                }
            }
            for k in back.into_iter().rev() {
                order.push_front(k);
            }
            shrink(&mut order);
            // Given back now, under the lock, so that the next append to
            // look counts it.
            self.used.fetch_sub(freed, Ordering::AcqRel);
            taken
        };
        // The order's lock is never held while a log's is taken (an append
        // takes them the other way round).
        for k in taken {
            k.part.drop_until(k.end);
        }
        true
    }
}

/// The v2 batch header: base offset (8), length (4), leader epoch (4), magic
/// (1), CRC (4), attributes (2), last offset delta (4), first timestamp (8),
/// max timestamp (8), producer id (8), producer epoch (2), base sequence (4),
/// record count (4).
const HEADER: usize = 61;

/// The base offset and length that open every batch, whatever its format
/// (Kafka's `LOG_OVERHEAD`).
const LOG_OVERHEAD: usize = 12;

/// The smallest length a batch of any format may announce (Kafka's
/// `RECORD_OVERHEAD_V0`).
const MIN_LENGTH: i32 = 14;

/// Checks a produce's records as Kafka does before it stores them, in
/// Kafka's order: `ProduceRequest.validateRecords` (versions 3 and up:
/// exactly one batch, of format v2, zstd only from version 7), then
/// `UnifiedLog.analyzeAndValidateRecords` (base offset 0, at most
/// `max_message_bytes`, CRC-32C) and `LogValidator` (the record count against
/// the last offset delta; each record's framing and offset delta when
/// uncompressed). A compressed batch is not decompressed to store it: its
/// codec must be one Kafka knows, and its records must begin as
/// that codec's stream does (gzip, LZ4 frame, zstd frame; snappy has no such
/// mark).
pub fn check(
    records: Option<&Bytes>,
    version: i16,
    max_message_bytes: usize,
) -> Result<Checked, AppendError> {
    // Kafka's batch iterator finds no batch in fewer bytes than a batch's
    // opening, or than the first batch announces.
    let Some(records) = records else {
        return Err(AppendError::Invalid);
    };
    if records.len() < LOG_OVERHEAD {
        return Err(AppendError::Invalid);
    }
    let length = (&records[8..12]).get_i32();
    if length < MIN_LENGTH {
        return Err(AppendError::Corrupt);
    }
    if records.len() <= 16 {
        return Err(AppendError::Invalid);
    }
    let magic = records[16] as i8;
    if !(0..=2).contains(&magic) {
        return Err(AppendError::Corrupt);
    }
    let size = LOG_OVERHEAD + length as usize;
    if records.len() < size || magic != 2 {
        return Err(AppendError::Invalid);
    }
    // A v2 batch's attributes follow its CRC (a length of at least 14 puts
    // them inside it).
    match records[22] & 0x07 {
        // Kafka: "Unknown compression type id" (an exception of no API error
        // of its own; CORRUPT_MESSAGE says what is wrong).
        5..=7 => return Err(AppendError::Corrupt),
        4 if version < 7 => return Err(AppendError::UnsupportedCompression),
        _ => {}
    }
    if records.len() > size {
        return Err(AppendError::Invalid);
    }
    if (&records[..8]).get_i64() != 0 {
        return Err(AppendError::Invalid);
    }
    if size > max_message_bytes {
        return Err(AppendError::TooLarge);
    }
    if size < HEADER {
        return Err(AppendError::Corrupt);
    }
    check_batch(records)
}

/// Checks one whole v2 batch of at least a header: its CRC-32C (over
/// everything after the CRC), its record count against its last offset
/// delta, and its records (see [`check`]).
fn check_batch(batch: &Bytes) -> Result<Checked, AppendError> {
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
    let records = &batch[HEADER..];
    let stream_opens_with: &[u8] = match attributes & 0x07 {
        0 => return check_records(records, count).map(|()| checked(batch, count, max_timestamp)),
        1 => &[0x1f, 0x8b],             // gzip
        3 => &[0x04, 0x22, 0x4d, 0x18], // LZ4 frame
        4 => &[0x28, 0xb5, 0x2f, 0xfd], // zstd frame
        _ => &[],                       // snappy
    };
    if !records.starts_with(stream_opens_with) {
        return Err(AppendError::Corrupt);
    }
    Ok(checked(batch, count, max_timestamp))
}

fn checked(batch: &Bytes, count: i32, max_timestamp: i64) -> Checked {
    Checked {
        batch: batch.clone(),
        count: count as u64,
        max_timestamp,
    }
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

/// Every topic, created on first use with `partitions` partitions, and the
/// room their logs share.
pub struct Topics {
    by_name: RwLock<HashMap<Arc<str>, Arc<Topic>>>,
    partitions: i32,
    followers: usize,
    auto_create: bool,
    max_topics: usize,
    /// The most partitions held in all: what clients can make the broker
    /// keep by creating topics is bounded by this as well as by
    /// `max_topics`.
    max_partitions: usize,
    /// Partitions held (changed under `by_name`'s write lock).
    held: AtomicUsize,
    store: Store,
}

impl Topics {
    pub fn new(
        partitions: i32,
        followers: usize,
        auto_create: bool,
        max_topics: usize,
        max_partitions: usize,
        max_log_bytes: usize,
    ) -> Topics {
        Topics {
            by_name: RwLock::new(HashMap::new()),
            partitions,
            followers,
            auto_create,
            max_topics,
            max_partitions,
            held: AtomicUsize::new(0),
            store: Store {
                limit: max_log_bytes,
                used: AtomicUsize::new(0),
                order: Mutex::new(VecDeque::new()),
            },
        }
    }

    /// Appends a checked batch to `part`, first dropping the oldest
    /// replicated batches of any partition if the logs have no room for it
    /// (see the module docs). Returns the first and one past the last offset
    /// given.
    pub fn append(
        &self,
        part: &Arc<Partition>,
        checked: Checked,
        now_ms: i64,
    ) -> Result<(u64, u64), AppendError> {
        if !self.store.reserve(checked.batch.len() + BATCH_COST) {
            return Err(AppendError::Full);
        }
        Ok(part.append(checked, now_ms, &self.store.order))
    }

    /// What the logs hold now, each batch counted with [`BATCH_COST`].
    pub fn log_bytes(&self) -> usize {
        self.store.used.load(Ordering::Acquire)
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
        if !(create && self.auto_create && valid_topic_name(name) && !internal_topic(name)) {
            return None;
        }
        self.create(name, self.partitions)
    }

    /// Creates `name` with `partitions` partitions, or returns it if it
    /// exists; `None` if it is new and the broker holds its most topics or
    /// would hold more than its most partitions.
    pub fn create(&self, name: &str, partitions: i32) -> Option<Arc<Topic>> {
        match self.create_new(name, partitions, false) {
            Ok(topic) => topic,
            Err(CreateError::Exists(topic)) => Some(topic),
            Err(e) => {
                tracing::warn!(topic = name, reason = %e, "topic not created");
                None
            }
        }
    }

    /// Creates `name` with `partitions` partitions (at least one), unless
    /// it exists or the broker would then hold more than its most topics or
    /// partitions: decided under one hold of the map's lock, so of two
    /// creations of one name, one is told it exists. With `dry_run`, only
    /// says whether it would create it (`Ok(None)`); else `Ok(Some(topic))`.
    pub fn create_new(
        &self,
        name: &str,
        partitions: i32,
        dry_run: bool,
    ) -> Result<Option<Arc<Topic>>, CreateError> {
        let mut map = self.by_name.write().unwrap();
        if let Some(topic) = map.get(name) {
            return Err(CreateError::Exists(topic.clone()));
        }
        // Kafka's `Topic.hasCollision`: names equal once '.' and '_' are
        // taken as one character collide (their metrics' names would). Two
        // such names differ in a '.' or a '_', so a name with neither
        // collides with none.
        if name.contains(['.', '_']) {
            let same =
                |a: u8, b: u8| a == b || (matches!(a, b'.' | b'_') && matches!(b, b'.' | b'_'));
            if let Some(other) = map.keys().find(|k| {
                k.len() == name.len() && k.bytes().zip(name.bytes()).all(|(a, b)| same(a, b))
            }) {
                return Err(CreateError::Collides(other.clone()));
            }
        }
        let number = map.len() as u64;
        if number as usize >= self.max_topics {
            return Err(CreateError::TooManyTopics(self.max_topics));
        }
        let held = self.held.load(Ordering::Relaxed);
        let more = usize::try_from(partitions).unwrap_or(0);
        if held.saturating_add(more) > self.max_partitions {
            return Err(CreateError::TooManyPartitions {
                held,
                max: self.max_partitions,
            });
        }
        if dry_run {
            return Ok(None);
        }
        self.held.store(held + more, Ordering::Relaxed);
        let name: Arc<str> = Arc::from(name);
        let topic = Arc::new(Topic {
            partitions: (0..partitions)
                .map(|p| {
                    let key = number << 32 | p as u32 as u64;
                    Arc::new(Partition::new(key, p, self.followers))
                })
                .collect(),
            name: name.clone(),
        });
        map.insert(name, topic.clone());
        Ok(Some(topic))
    }

    /// Replicas of each partition: the leader and every simulated follower.
    pub fn replicas(&self) -> usize {
        1 + self.followers
    }

    /// Partitions a topic gets when its creator does not say.
    pub fn default_partitions(&self) -> i32 {
        self.partitions
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

/// Why a topic was not created.
pub enum CreateError {
    /// A topic of that name exists: this one.
    Exists(Arc<Topic>),
    /// A topic whose name differs only in '.' against '_' exists: this one.
    Collides(Arc<str>),
    /// The broker holds its most topics already.
    TooManyTopics(usize),
    /// The topic's partitions would take the broker past its most.
    TooManyPartitions { held: usize, max: usize },
}

impl std::fmt::Display for CreateError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CreateError::Exists(_) => f.write_str("the topic exists"),
            CreateError::Collides(other) => {
                write!(f, "the name collides with the existing topic {other}")
            }
            CreateError::TooManyTopics(max) => {
                write!(f, "the broker holds its most topics ({max}, --max-topics)")
            }
            CreateError::TooManyPartitions { held, max } => write!(
                f,
                "the broker holds {held} partitions and at most {max} (--max-partitions)"
            ),
        }
    }
}

/// Whether `name` is one of Kafka's internal topics (`Topic.isInternal`):
/// Kafka keeps group offsets, transactions' state and share groups' state in
/// them, and refuses clients' writes to them. This broker keeps offsets in
/// memory and serves no internal topic, so none of them is made (a client
/// writing to one is told the topic is unknown).
pub fn internal_topic(name: &str) -> bool {
    matches!(
        name,
        "__consumer_offsets" | "__transaction_state" | "__share_group_state"
    )
}

/// Kafka's rule: 1 to 249 characters of ASCII letters, digits, '.', '_', '-'.
pub fn valid_topic_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() < 250
        && name != "."
        && name != ".."
        && name
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_' | b'-'))
}
