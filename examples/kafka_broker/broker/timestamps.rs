//! The records' own timestamps inside a stored batch, for `ListOffsets` by
//! time, which Kafka answers per record (`FileRecords.searchForTimestamp`,
//! `RecordBatch.offsetOfMaxTimestamp`), not per batch.
//!
//! A batch is stored as it arrived (format v2), compressed or not. Its
//! records are read as a stream, one at a time, keeping only each one's
//! timestamp and offset deltas (keys, values and headers are skipped): what
//! reading a batch takes is its codec's state, not its records. That state
//! is charged first, to the broker's memory budget, for as long as that
//! batch is read (given back when its read returns, not held until the
//! answer is written): a gzip stream's window, tables, buffer and header
//! fields, the largest snappy block, an LZ4 frame's blocks as its header
//! declares their size. And the bytes one lookup reads, decompressed or
//! not, batch headers included, are bounded ([`Limits::read_left`]): what a
//! codec makes before any of it is read is taken from that bound first,
//! before it is decompressed (a snappy block's whole claimed length, an LZ4
//! frame's buffers as its header sizes them), so a few bytes claiming a
//! large block cost the lookup what decoding them costs the broker, and a
//! claim past what is left is never decompressed. A snappy block claiming
//! more than its bytes can make (snappy makes at most 64 bytes of 3) is
//! corrupt, refused before its output is allocated. A batch whose records
//! cannot be read within them, or are not what their codec makes, is
//! [`Scan::Unreadable`]: the caller answers for it at batch granularity.
//!
//! So is every zstd batch: the pure-Rust decoder at hand (ruzstd 0.8)
//! decodes a whole block before its first byte can be read and never checks
//! that a block makes at most the 128 KiB the format allows, so a frame of a
//! few KB makes gigabytes (and its sequence sum can overflow and panic)
//! before any read bound applies.

use std::io::{self, Read};

use super::frame::{Budget, Held};

/// A v2 batch's header: base offset, length, leader epoch, magic, CRC,
/// attributes, last offset delta, base and max timestamps, producer id and
/// epoch, base sequence, record count.
const HEADER: usize = 61;

/// What a gzip stream's decoder keeps: its inflater (a 32 KiB window and
/// its tables, some 11 KiB), the 32 KiB buffer `read::MultiGzDecoder` reads
/// its input through, and the header's name, comment and extra field,
/// each up to 64 KiB.
const GZIP_STATE: usize = (64 << 10) + (32 << 10) + 3 * (64 << 10);
/// What a reader over a decoder keeps (its buffer).
const BUFFER: usize = 8 << 10;
/// The window an LZ4 decoder keeps past its blocks (linked blocks).
const LZ4_WINDOW: usize = 64 << 10;
/// The xerial framing Kafka's Java clients write snappy in (snappy-java's
/// `SnappyOutputStream`): this magic, a version and a compatible version,
/// then blocks, each an int32 size and raw snappy. librdkafka writes raw
/// snappy, one block.
const XERIAL: [u8; 8] = [0x82, b'S', b'N', b'A', b'P', b'P', b'Y', 0];

/// An LZ4 frame's magic number (little-endian). The legacy frame format
/// (whose blocks are 8 MiB whatever the data) is not what Kafka writes, and
/// is refused.
const LZ4_MAGIC: [u8; 4] = [0x04, 0x22, 0x4d, 0x18];
/// An LZ4 frame descriptor's flag: blocks compressed independently (the
/// decoder keeps one block, not two and a window).
const LZ4_INDEPENDENT: u8 = 0x20;

/// The most a snappy block of `compressed` bytes (its length header
/// included) can make: its largest element, a 3-byte copy, makes 64 bytes.
fn snappy_most(compressed: usize) -> usize {
    compressed.saturating_mul(64) / 3
}

/// What reading a lookup's batches may take.
pub struct Limits<'a> {
    /// Bytes of batch headers and records (decompressed, or as stored when
    /// not compressed) the lookup may still read.
    pub read_left: usize,
    /// What a batch's codec allocates is charged to, while that batch is
    /// read.
    pub budget: &'a Budget,
}

/// What a batch's records say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scan {
    /// The first record picked: its offset and timestamp.
    Found(u64, i64),
    /// No record picked.
    NotFound,
    /// The records could not be read within the limits, or are not what the
    /// batch's codec makes.
    Unreadable,
}

/// The first record of `batch` (a whole stored v2 batch whose first offset
/// is `base`) whose timestamp `pick` takes, as Kafka reads a record's
/// timestamp: the batch's max timestamp when the batch is stamped with log
/// append time (attribute bit 3), else its base timestamp plus the record's
/// delta.
pub fn first_record(
    batch: &[u8],
    base: u64,
    limits: &mut Limits,
    pick: impl FnMut(i64) -> bool,
) -> Scan {
    if batch.len() < HEADER {
        return Scan::Unreadable;
    }
    let attributes = i16::from_be_bytes([batch[21], batch[22]]);
    let int64 = |at: usize| i64::from_be_bytes(batch[at..at + 8].try_into().unwrap());
    let head = Head {
        base,
        base_timestamp: int64(27),
        max_timestamp: int64(35),
        log_append_time: attributes & 0x08 != 0,
        count: i32::from_be_bytes(batch[57..61].try_into().unwrap()),
    };
    // Its header is read too, so many small batches are walked within the
    // same bound as a few large ones.
    let Some(left) = limits.read_left.checked_sub(HEADER) else {
        return Scan::Unreadable;
    };
    limits.read_left = left;
    let records = &batch[HEADER..];
    // This batch's codec state, given back when its read returns.
    let held = Held::default();
    let budget = limits.budget;
    let mut charge = |bytes: usize| budget.try_charge(bytes, &held);
    let charge: &mut dyn FnMut(usize) -> bool = &mut charge;
    let left = &mut limits.read_left;
    let found = match attributes & 0x07 {
        // Already in memory, nothing decompressed, but read against the
        // same bound: a log of batches whose headers claim a newer record
        // than they hold is not walked whole by each lookup.
        0 => head.walk(Capped(records, left), pick),
        1 => {
            if !charge(GZIP_STATE + BUFFER) {
                return Scan::Unreadable;
            }
            let gz = flate2::read::MultiGzDecoder::new(records);
            head.walk(io::BufReader::new(Capped(gz, left)), pick)
        }
        2 => {
            if let Some(framed) = records.strip_prefix(&XERIAL) {
                // The version and compatible version, then the blocks.
                let Some(blocks) = framed.get(8..) else {
                    return Scan::Unreadable;
                };
                // Each block's claimed length is taken from `left` before
                // it is decompressed (see `Xerial`): not wrapped in `Capped`.
                let xerial = Xerial {
                    rest: blocks,
                    block: Vec::new(),
                    at: 0,
                    charged: 0,
                    charge,
                    left,
                };
                head.walk(xerial, pick)
            } else {
                let Ok(n) = snap::raw::decompress_len(records) else {
                    return Scan::Unreadable;
                };
                // The whole block is made (and its buffer zeroed) before
                // any of it is read: its claimed length is taken from the
                // lookup's bound first.
                if n > *left || n > snappy_most(records.len()) || !charge(n) {
                    return Scan::Unreadable;
                }
                *left -= n;
                let Ok(out) = snap::raw::Decoder::new().decompress_vec(records) else {
                    return Scan::Unreadable;
                };
                head.walk(&out[..], pick)
            }
        }
        3 => {
            let Some(ahead) = lz4_ahead(records) else {
                return Scan::Unreadable;
            };
            // The frame descriptor's block size: lz4_flex keeps a block and
            // its output (twice a block and the 64 KiB window linked blocks
            // keep), charged to the budget; and it zeroes its output buffer
            // and makes a whole block before any of it is read, taken from
            // the lookup's bound first (what is then read is counted too).
            let Some(block) = lz4_block(records) else {
                return Scan::Unreadable;
            };
            if ahead > *left || !charge(3 * block + LZ4_WINDOW + BUFFER) {
                return Scan::Unreadable;
            }
            *left -= ahead;
            let lz4 = lz4_flex::frame::FrameDecoder::new(records);
            head.walk(io::BufReader::new(Capped(lz4, left)), pick)
        }
        // zstd: never decoded (see the module's comment).
        4 => return Scan::Unreadable,
        _ => return Scan::Unreadable,
    };
    found.unwrap_or(Scan::Unreadable)
}

/// The block size an LZ4 frame's descriptor declares (`None` for anything
/// but a standard frame with a block size Kafka's clients use).
fn lz4_block(records: &[u8]) -> Option<usize> {
    if records.get(..4)? != LZ4_MAGIC {
        return None;
    }
    match (records.get(5)? >> 4) & 0x07 {
        4 => Some(64 << 10),
        5 => Some(256 << 10),
        6 => Some(1 << 20),
        7 => Some(4 << 20),
        _ => None,
    }
}

/// What lz4_flex makes of an LZ4 frame before any of it can be read: its
/// output buffer, zeroed as the frame's header sizes it (a block, or two
/// and the window for linked blocks), and the block it decodes at once,
/// which may go unread when the records end mid-block.
fn lz4_ahead(records: &[u8]) -> Option<usize> {
    let block = lz4_block(records)?;
    let buffer = if records[4] & LZ4_INDEPENDENT != 0 {
        block
    } else {
        2 * block + LZ4_WINDOW
    };
    Some(buffer + block)
}

/// What the batch header says of its records.
struct Head {
    base: u64,
    base_timestamp: i64,
    max_timestamp: i64,
    log_append_time: bool,
    count: i32,
}

impl Head {
    /// Reads `count` records, each its length, attributes, timestamp delta
    /// and offset delta, skipping the rest of it.
    fn walk(&self, mut r: impl Read, mut pick: impl FnMut(i64) -> bool) -> io::Result<Scan> {
        for _ in 0..self.count.max(0) {
            let length = varlong(&mut r)?;
            let length = u64::try_from(length).map_err(|_| corrupt())?;
            let mut record = (&mut r).take(length);
            let mut attributes = [0u8];
            record.read_exact(&mut attributes)?;
            let delta = varlong(&mut record)?;
            let offset_delta = varlong(&mut record)?;
            if !(0..i64::from(self.count)).contains(&offset_delta) {
                return Err(corrupt());
            }
            io::copy(&mut record, &mut io::sink())?;
            if record.limit() != 0 {
                return Err(corrupt());
            }
            let timestamp = if self.log_append_time {
                self.max_timestamp
            } else {
                self.base_timestamp.wrapping_add(delta)
            };
            if pick(timestamp) {
                return Ok(Scan::Found(self.base + offset_delta as u64, timestamp));
            }
        }
        Ok(Scan::NotFound)
    }
}

fn corrupt() -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, "corrupt record")
}

/// A zigzag varint of up to 64 bits (Kafka's `ByteUtils.readVarlong`).
fn varlong(r: &mut impl Read) -> io::Result<i64> {
    let mut raw: u64 = 0;
    for i in 0..10 {
        let mut b = [0u8];
        r.read_exact(&mut b)?;
        raw |= u64::from(b[0] & 0x7f) << (i * 7);
        if b[0] < 0x80 {
            return Ok((raw >> 1) as i64 ^ -((raw & 1) as i64));
        }
    }
    Err(corrupt())
}

/// A reader that fails once it has read more than `left` bytes in all.
struct Capped<'a, R>(R, &'a mut usize);

impl<R: Read> Read for Capped<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if *self.1 == 0 {
            return Err(io::Error::other("the lookup's read limit"));
        }
        let most = buf.len().min(*self.1);
        let n = self.0.read(&mut buf[..most])?;
        *self.1 -= n;
        Ok(n)
    }
}

/// Snappy in xerial framing, a block at a time, each block's output
/// charged to the budget (the largest one's, as the same buffer is reused)
/// and taken whole from the lookup's read bound `left` before it is
/// decompressed: a block claiming more than is left, or more than its bytes
/// can make, is refused before its buffer is sized.
struct Xerial<'a, 'c, 'l> {
    rest: &'a [u8],
    block: Vec<u8>,
    at: usize,
    charged: usize,
    charge: &'c mut dyn FnMut(usize) -> bool,
    left: &'l mut usize,
}

impl Read for Xerial<'_, '_, '_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.at == self.block.len() {
            if self.rest.is_empty() {
                return Ok(0);
            }
            let size = self.rest.get(..4).ok_or_else(corrupt)?;
            let size = u32::from_be_bytes(size.try_into().unwrap()) as usize;
            let compressed = self.rest.get(4..4 + size).ok_or_else(corrupt)?;
            self.rest = &self.rest[4 + size..];
            let n = snap::raw::decompress_len(compressed).map_err(|_| corrupt())?;
            if n > snappy_most(compressed.len()) {
                return Err(corrupt());
            }
            if n > *self.left {
                return Err(io::Error::other("the lookup's read limit"));
            }
            *self.left -= n;
            if n > self.charged {
                if !(self.charge)(n - self.charged) {
                    return Err(io::Error::other("no room for a snappy block"));
                }
                self.charged = n;
            }
            self.block.resize(n, 0);
            snap::raw::Decoder::new()
                .decompress(compressed, &mut self.block)
                .map_err(|_| corrupt())?;
            self.at = 0;
        }
        let n = buf.len().min(self.block.len() - self.at);
        buf[..n].copy_from_slice(&self.block[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
}
