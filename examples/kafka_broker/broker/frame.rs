//! Reading request frames under a memory budget.
//!
//! A frame is a 4-byte size and that many bytes. The size is a claim, not a
//! fact: nothing is reserved for it up front. The frame's buffer grows as its
//! bytes arrive (doubling, so copying stays linear), and every byte of it is
//! first charged to one [`Budget`] shared by all connections. When the budget
//! is spent, connections stop reading until memory comes back, as Kafka's
//! `queued.max.request.bytes` makes them. A connection that claims 100 MiB
//! and sends nothing more so costs a first buffer (4 KiB, charged once the
//! size is whole, before the first body byte), not 100 MiB; one that sends
//! fast waits its turn.
//!
//! Once a frame is whole, [`admit`] walks it ([`super::shape`]) and charges
//! what decoding it will allocate. The frame and both charges stay held until
//! the connection has written the answer, unless the request waits (a parked
//! fetch, produce, join or sync): once decoded, it lets go of its frame and
//! keeps only what it holds while it waits ([`Held::keep`]), as Kafka
//! releases a request's buffer once its handler returns. A request waiting
//! up to `i32::MAX` ms so holds its own state, not its frame.

use std::sync::Arc;

use bytes::{BufMut, Bytes};
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use super::shape::{self, Refused, Shape};

/// The smallest buffer a frame's body starts with.
const FIRST_CHUNK: usize = 4096;

/// The memory all connections' frames in flight share: the frames' bytes and
/// what decoding them allocates.
#[derive(Debug, Clone)]
pub struct Budget {
    permits: Arc<Semaphore>,
    total: usize,
}

impl Budget {
    pub fn new(bytes: usize) -> Budget {
        let total = bytes.min(Semaphore::MAX_PERMITS);
        Budget {
            permits: Arc::new(Semaphore::new(total)),
            total,
        }
    }

    /// Bytes charged now.
    pub fn in_use(&self) -> usize {
        self.total - self.permits.available_permits()
    }

    /// Waits until `bytes` can be charged; `None` if they never can (more
    /// than the whole budget).
    async fn charge(&self, bytes: usize) -> Option<OwnedSemaphorePermit> {
        let n = u32::try_from(bytes)
            .ok()
            .filter(|&n| n as usize <= self.total)?;
        self.permits.clone().acquire_many_owned(n).await.ok()
    }
}

/// Why a connection stops reading.
#[derive(Debug)]
pub enum Close {
    /// The peer hung up (or the socket failed).
    Gone,
    /// The frame cannot be served; the reason is logged.
    Refused(Refused),
}

/// A whole frame and the memory charged for it.
#[derive(Debug)]
pub struct Frame {
    pub bytes: Bytes,
    charge: Option<OwnedSemaphorePermit>,
}

/// A frame that passed its walk, with its decoding charged.
#[derive(Debug)]
pub struct Admitted {
    pub bytes: Bytes,
    pub shape: Shape,
    /// The frame's bytes and what decoding it allocates: released when the
    /// answer has been written, or cut down to what the request keeps when
    /// it waits.
    pub charge: Held,
    /// What building the answer charged (a fetch's records), released with
    /// the rest once the answer has been written.
    pub answer: Held,
}

/// Memory an answer took from the budget, held until the answer is written.
#[derive(Debug, Default)]
pub struct Held(std::sync::Mutex<Option<OwnedSemaphorePermit>>);

impl Budget {
    /// Charges `bytes` to `held` if the budget has them free now, without
    /// waiting; `false` when it has not (an answer then carries less, as
    /// Kafka's answers may).
    pub fn try_charge(&self, bytes: usize, held: &Held) -> bool {
        if bytes == 0 {
            return true;
        }
        let Ok(n) = u32::try_from(bytes) else {
            return false;
        };
        match self.permits.clone().try_acquire_many_owned(n) {
            Ok(permit) => {
                add(&mut held.0.lock().unwrap(), permit);
                true
            }
            Err(_) => false,
        }
    }
}

impl Held {
    /// Makes what is held `bytes`: gives back the rest, or, when it holds
    /// less, charges the difference if the budget has it free now. `false`
    /// (what is held unchanged) when it has not. For a request about to wait
    /// whose state may take more than its frame and decoding were charged (a
    /// fetch's or produce's watches: a key's first watch makes its list).
    pub fn hold(&self, budget: &Budget, bytes: usize) -> bool {
        let held = self
            .0
            .lock()
            .unwrap()
            .as_ref()
            .map_or(0, |p| p.num_permits());
        if held >= bytes {
            self.keep(bytes);
            true
        } else {
            budget.try_charge(bytes - held, self)
        }
    }

    /// Moves up to `bytes` of what is held to `to`; returns how much moved.
    /// For an answer built from what a request was charged (a group answer
    /// takes its request's charge before it asks the budget for more, so
    /// that an answer no larger than its request never waits behind other
    /// connections for memory it just had).
    pub fn pass_to(&self, to: &Held, bytes: usize) -> usize {
        let mut mine = self.0.lock().unwrap();
        let Some(permit) = mine.as_mut() else {
            return 0;
        };
        let n = permit.num_permits().min(bytes);
        if n == 0 {
            return 0;
        }
        let moved = if n == permit.num_permits() {
            mine.take().expect("held")
        } else {
            permit.split(n).expect("no more than it holds")
        };
        drop(mine);
        add(&mut to.0.lock().unwrap(), moved);
        n
    }

    /// Gives back all but `bytes` of what is held: a request about to wait
    /// has let go of its frame and keeps only its own state, which for a join
    /// or a sync is never more than its frame and decoding were charged (each
    /// thing it keeps took more bytes in both), so what it keeps is taken out
    /// of that charge and never waits for memory. (A fetch's or produce's
    /// watches may take more: [`Held::hold`].)
    pub fn keep(&self, bytes: usize) {
        if let Some(permit) = self.0.lock().unwrap().as_mut() {
            let n = permit.num_permits();
            if n > bytes {
                drop(permit.split(n - bytes));
            }
        }
    }
}

/// Reads one connection's frames, one at a time. Every method is
/// cancel-safe: dropping its future loses no byte and no charge.
#[derive(Debug)]
pub struct Reader {
    budget: Budget,
    max_request: usize,
    size: [u8; 4],
    /// Bytes of `size` read so far.
    have_size: usize,
    /// The frame's announced size, once `size` is whole.
    want: Option<usize>,
    body: Vec<u8>,
    /// What `body`'s capacity is charged with.
    charge: Option<OwnedSemaphorePermit>,
    started: Option<Instant>,
}

impl Reader {
    pub fn new(budget: Budget, max_request: usize) -> Reader {
        Reader {
            budget,
            max_request,
            size: [0; 4],
            have_size: 0,
            want: None,
            body: Vec::new(),
            charge: None,
            started: None,
        }
    }

    /// When the first byte of the frame in progress arrived, if one has.
    pub fn started(&self) -> Option<Instant> {
        self.started
    }

    /// One read (after charging the budget for what it may bring); the frame
    /// if that made one whole.
    pub async fn step<R: AsyncRead + Unpin>(&mut self, rd: &mut R) -> Result<Option<Frame>, Close> {
        let Some(want) = self.want else {
            let n = rd
                .read(&mut self.size[self.have_size..])
                .await
                .map_err(|_| Close::Gone)?;
            if n == 0 {
                return Err(Close::Gone);
            }
            if self.have_size == 0 {
                self.started = Some(Instant::now());
            }
            self.have_size += n;
            if self.have_size == 4 {
                let size = i32::from_be_bytes(self.size);
                // A header alone (key, version, correlation id, client id
                // length) takes 10 bytes.
                let most = self.max_request.min(self.budget.total);
                if size < 10 || size as usize > most {
                    return Err(Close::Refused(Refused(format!(
                        "frame size {size} outside 10..={most}"
                    ))));
                }
                self.want = Some(size as usize);
            }
            return Ok(None);
        };
        if self.body.len() == self.body.capacity() {
            // Grow by doubling up to the announced size, charging first.
            let cap = self.body.capacity();
            let target = want.min((cap * 2).max(FIRST_CHUNK));
            let more =
                self.budget.charge(target - cap).await.ok_or_else(|| {
                    Close::Refused(Refused("frame larger than the budget".into()))
                })?;
            add(&mut self.charge, more);
            self.body.reserve_exact(target - self.body.len());
        }
        let room = want.min(self.body.capacity()) - self.body.len();
        let n = rd
            .read_buf(&mut (&mut self.body).limit(room))
            .await
            .map_err(|_| Close::Gone)?;
        if n == 0 {
            return Err(Close::Gone);
        }
        if self.body.len() < want {
            return Ok(None);
        }
        self.have_size = 0;
        self.want = None;
        self.started = None;
        Ok(Some(Frame {
            bytes: Bytes::from(std::mem::take(&mut self.body)),
            charge: self.charge.take(),
        }))
    }
}

/// Walks a whole frame and charges what decoding it allocates.
pub async fn admit(frame: Frame, budget: &Budget, max_decoded: usize) -> Result<Admitted, Close> {
    let shape = shape::check(&frame.bytes, max_decoded).map_err(Close::Refused)?;
    let mut charge = frame.charge;
    if shape.decoded > 0 {
        let more = budget.charge(shape.decoded).await.ok_or_else(|| {
            Close::Refused(Refused("decoded request larger than the budget".into()))
        })?;
        add(&mut charge, more);
    }
    Ok(Admitted {
        bytes: frame.bytes,
        shape,
        charge: Held(std::sync::Mutex::new(charge)),
        answer: Held::default(),
    })
}

/// Adds `more` to what `charge` holds.
fn add(charge: &mut Option<OwnedSemaphorePermit>, more: OwnedSemaphorePermit) {
    match charge {
        Some(c) => c.merge(more),
        None => *charge = Some(more),
    }
}
