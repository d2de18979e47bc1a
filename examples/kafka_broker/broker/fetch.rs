//! `Fetch`: answer at once if `min_bytes` are readable below the high
//! watermark, else wait for them or for `max_wait_ms`.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::mem::size_of;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kafka_protocol::error::ResponseError;
use kafka_protocol::messages::fetch_response::{FetchableTopicResponse, PartitionData};
use kafka_protocol::messages::{FetchRequest, FetchResponse, TopicName};
use kafka_protocol::protocol::StrBytes;
use tokio::time::Instant;
use tokio_purgatory::{Operation, Watch};

use super::frame::{Budget, Held};
use super::log::Topic;
use super::{Broker, FetchWait, Gone, Partition, CLOSING_KEY};

/// One partition of a fetch.
struct Want {
    /// The partition, or why it cannot be read.
    part: Result<Arc<Partition>, ResponseError>,
    index: i32,
    offset: u64,
    max_bytes: usize,
}

/// What a fetch asks for, and how to answer it.
#[derive(Default)]
pub struct Fetch {
    /// (topic name, its partitions), in the request's order.
    topics: Vec<(TopicName, Vec<Want>)>,
    min_bytes: u64,
    max_bytes: usize,
    closing: Arc<AtomicBool>,
    /// The memory budget the answer's records are charged to.
    budget: Option<Budget>,
}

impl Fetch {
    fn wants(&self) -> impl Iterator<Item = (&Arc<Partition>, &Want)> {
        self.topics
            .iter()
            .flat_map(|(_, ws)| ws.iter())
            .filter_map(|w| w.part.as_ref().ok().map(|p| (p, w)))
    }

    /// Bytes readable now, counted up to `min_bytes`, each partition's at
    /// most its `partition_max_bytes` (Kafka's `DelayedFetch`: "we take the
    /// partition fetch size as upper bound when accumulating the bytes").
    fn available(&self) -> u64 {
        let mut sum = 0;
        for (part, w) in self.wants() {
            if sum >= self.min_bytes {
                break;
            }
            sum += part.available(w.offset, w.max_bytes as u64);
        }
        sum
    }

    /// `min_bytes` can never be readable: each partition counts at most its
    /// `partition_max_bytes` (all 0, or too few of them), or more than the
    /// logs of all partitions hold together at most (`log_bound`:
    /// `max_log_bytes`; `min_bytes` `i32::MAX` is past the default 1 GiB).
    /// Such a fetch is answered at its `max_wait`, as Kafka answers it; it
    /// watches no partition meanwhile, so high watermark moves never check
    /// it (each check reads every partition it names: a few fetches naming
    /// thousands made every other client's produce pay for reading them).
    /// One difference follows: a watched fetch whose position retention
    /// passes is answered OFFSET_OUT_OF_RANGE at once; such a fetch learns
    /// it at its `max_wait`. (Kafka also answers at once, without waiting,
    /// a fetch whose first batch alone reaches `min_bytes`, even past its
    /// `partition_max_bytes` (KIP-74); this broker counts each partition up
    /// to its `partition_max_bytes`, before and after this rule.)
    fn never_enough(&self, log_bound: usize) -> bool {
        let most = self
            .wants()
            .try_fold(0u64, |sum, (_, w)| sum.checked_add(w.max_bytes as u64));
        self.min_bytes > 0
            && (most.is_some_and(|most| most < self.min_bytes) || self.min_bytes > log_bound as u64)
    }

    /// Answerable now: `min_bytes` are readable, or a partition's position
    /// fell below its log start (retention dropped what it was waiting at;
    /// Kafka's `DelayedFetch` completes then, answering `OFFSET_OUT_OF_RANGE`).
    fn enough(&self) -> bool {
        self.min_bytes == 0
            || self.available() >= self.min_bytes
            || self.wants().any(|(part, w)| w.offset < part.log_start())
    }

    /// The response with what is readable now, at most `max_bytes` in all
    /// (the first batch found is sent whole even if larger, as Kafka does),
    /// and no more than the memory budget has free: what the records take is
    /// charged to it, in `held`, until the answer has been written, so
    /// answers a client does not read hold memory within the budget (a
    /// batch it has no room for now is left for a later fetch).
    fn answer(&self, held: &Held) -> FetchResponse {
        let mut left = self.max_bytes;
        let mut first = true;
        // Every batch is charged before it is copied; one the budget has no
        // room for now ends the answer there.
        let mut charge = |bytes: usize| match &self.budget {
            Some(budget) => budget.try_charge(bytes, held),
            None => true,
        };
        let mut response = FetchResponse::default();
        for (name, wants) in &self.topics {
            let mut t = FetchableTopicResponse::default().with_topic(name.clone());
            for w in wants {
                let mut p = PartitionData::default().with_partition_index(w.index);
                let read = w.part.as_ref().map_err(|e| *e).and_then(|part| {
                    let read = part.read(w.offset, w.max_bytes.min(left), first, &mut charge);
                    // Retention may have dropped the position while the
                    // fetch waited.
                    if w.offset < read.log_start {
                        Err(ResponseError::OffsetOutOfRange)
                    } else {
                        Ok(read)
                    }
                });
                match read {
                    Ok(read) => {
                        first &= read.records.is_empty();
                        left = left.saturating_sub(read.records.len());
                        p.high_watermark = read.high_watermark as i64;
                        p.last_stable_offset = read.high_watermark as i64;
                        p.log_start_offset = read.log_start as i64;
                        p.records = Some(read.records);
                    }
                    Err(e) => {
                        p.error_code = e.code();
                        p.high_watermark = -1;
                        p.last_stable_offset = -1;
                    }
                }
                t.partitions.push(p);
            }
            response.responses.push(t);
        }
        response
    }
}

/// Kafka's `DelayedFetch`: done once `min_bytes` are readable across its
/// partitions.
///
/// Its check only decides; the answer (reading the log, encoding) is built by
/// the request's own task once the handle resolves, so a high watermark move
/// that completes many fetches does not build all their answers in the
/// thread that moved it.
pub struct DelayedFetch(Fetch);

impl Operation for DelayedFetch {
    type Output = Fetch;

    fn try_complete(&mut self) -> Option<Fetch> {
        let f = &self.0;
        (f.enough() || f.closing.load(Ordering::SeqCst)).then(|| std::mem::take(&mut self.0))
    }

    fn on_expiration(self) -> Fetch {
        self.0
    }
}

/// Handles a fetch: answers when `min_bytes` are readable or `max_wait_ms`
/// has passed, waiting as the broker's [`FetchWait`] says. `Err` when the
/// broker stopped under it. A fetch that waits (up to `i32::MAX` ms) lets go
/// of its request and frame first and keeps, in `charge`, what it holds
/// meanwhile: its distinct partitions, their topics' names and their watches
/// (which may take more than the frame was charged: the rest is charged then,
/// and with no room for it the fetch is answered at once). `held` takes what
/// its answer's records are charged.
pub async fn handle(
    broker: &Broker,
    request: FetchRequest,
    charge: &Held,
    held: &Held,
) -> Result<FetchResponse, Gone> {
    // Fetch sessions (KIP-227) are not kept. A full fetch (epoch 0 or -1)
    // is answered in full with session id 0, which tells the client that no
    // session was made (as Kafka answers when its session cache is full); any
    // other epoch is an incremental fetch in a session this broker cannot
    // have, answered FETCH_SESSION_ID_NOT_FOUND with no partitions, as Kafka
    // answers (the client then starts over with a full fetch).
    if !matches!(request.session_epoch, -1 | 0) {
        return Ok(
            FetchResponse::default().with_error_code(ResponseError::FetchSessionIdNotFound.code())
        );
    }
    // Kafka keys a fetch's partitions by topic and partition (a linked map):
    // one named twice is one partition of the answer, with the position and
    // limit named last, and one watch; a request cannot make a high
    // watermark move check it more than once per distinct partition. Each
    // distinct topic is looked up once. The maps that find them go before a
    // wait (they are not what it keeps).
    let topics: Vec<(TopicName, Vec<Want>)> = {
        let mut topics: Vec<(TopicName, Option<Arc<Topic>>, Vec<Want>)> = Vec::new();
        let mut topic_at: HashMap<&str, usize> = HashMap::new();
        let mut want_at: HashMap<(usize, i32), usize> = HashMap::new();
        for topic in &request.topics {
            let ti = *topic_at.entry(topic.topic.as_str()).or_insert_with(|| {
                let found = broker.topics.get(&topic.topic);
                topics.push((topic.topic.clone(), found, Vec::new()));
                topics.len() - 1
            });
            let (_, found, wants) = &mut topics[ti];
            for p in &topic.partitions {
                let part = found
                    .as_ref()
                    .and_then(|t| {
                        usize::try_from(p.partition)
                            .ok()
                            .and_then(|i| t.partitions.get(i))
                    })
                    .cloned()
                    .ok_or(ResponseError::UnknownTopicOrPartition)
                    .and_then(|part| {
                        // Before the log start, or past the log end: out of range.
                        if p.fetch_offset < part.log_start() as i64
                            || p.fetch_offset as u64 > part.log_end()
                        {
                            Err(ResponseError::OffsetOutOfRange)
                        } else {
                            Ok(part)
                        }
                    });
                let want = Want {
                    part,
                    index: p.partition,
                    offset: p.fetch_offset.max(0) as u64,
                    max_bytes: p.partition_max_bytes.max(0) as usize,
                };
                match want_at.entry((ti, p.partition)) {
                    Entry::Occupied(at) => wants[*at.get()] = want,
                    Entry::Vacant(at) => {
                        at.insert(wants.len());
                        wants.push(want);
                    }
                }
            }
        }
        topics
            .into_iter()
            .map(|(name, _, wants)| (name, wants))
            .collect()
    };
    let mut fetch = Fetch {
        topics,
        min_bytes: request.min_bytes.max(0) as u64,
        max_bytes: (request.max_bytes.max(0) as usize).min(broker.config.fetch_max_bytes),
        closing: broker.closing.clone(),
        budget: Some(broker.budget.clone()),
    };
    let max_wait = Duration::from_millis(request.max_wait_ms.max(0) as u64);
    // Kafka answers at once when there is nothing to wait for, or an error.
    let errors = fetch
        .topics
        .iter()
        .flat_map(|(_, ws)| ws)
        .any(|w| w.part.is_err());
    if max_wait.is_zero() || errors || fetch.wants().next().is_none() || fetch.enough() {
        return Ok(fetch.answer(held));
    }
    // It waits: its topic names are slices of the frame, copied so that the
    // frame goes with the request, and what it keeps is all it stays charged:
    // its lists as allocated (their spare room let go first), the names, and
    // a watch per partition.
    fetch.topics.shrink_to_fit();
    for (name, wants) in &mut fetch.topics {
        *name = TopicName(StrBytes::from_string(name.to_string()));
        wants.shrink_to_fit();
    }
    drop(request);
    let kept: usize = fetch.topics.capacity() * size_of::<(TopicName, Vec<Want>)>()
        + fetch
            .topics
            .iter()
            .map(|(name, wants)| {
                name.len() + wants.capacity() * size_of::<Want>() + wants.len() * WATCH
            })
            .sum::<usize>();
    if !charge.hold(&broker.budget, size_of::<Fetch>() + kept) {
        // No room in the memory budget for what waiting keeps: answered now
        // with what there is, as when its wait is over.
        tracing::debug!(kept, "a fetch has no room in the memory budget to wait");
        return Ok(fetch.answer(held));
    }
    broker.stats.fetches_parked.fetch_add(1, Ordering::Relaxed);
    let never = fetch.never_enough(broker.config.max_log_bytes);
    match broker.config.fetch_wait {
        FetchWait::Purgatory => in_purgatory(broker, fetch, never, max_wait, held).await,
        FetchWait::SleepPoll(every) => Ok(sleep_poll(fetch, never, max_wait, every, held).await),
        FetchWait::Notify => Ok(notified(fetch, never, max_wait, held).await),
    }
}

/// What a waiting fetch keeps for each partition besides its entry: its
/// watch in the purgatory (an entry at a level, 24 bytes, and for a key's
/// first watch the key's list: some 240 bytes in all, measured), or its
/// `Notify` waiter; rounded up.
pub const WATCH: usize = 256;

/// Waits in the fetch purgatory, watching each partition at the offset after
/// its position: the first high watermark move that makes a byte readable
/// checks it; a check that finds too few bytes leaves it watching one level
/// higher. A fetch that can `never` have enough watches only
/// [`CLOSING_KEY`], which no partition has and only shutdown completes: it
/// waits for its `max_wait`.
async fn in_purgatory(
    broker: &Broker,
    fetch: Fetch,
    never: bool,
    max_wait: Duration,
    held: &Held,
) -> Result<FetchResponse, Gone> {
    let watches: Vec<_> = if never {
        vec![Watch::above(CLOSING_KEY, 0)]
    } else {
        fetch
            .wants()
            .map(|(part, w)| Watch::above(part.key, w.offset))
            .collect()
    };
    match broker
        .fetches
        .try_complete_else_watch_levels(DelayedFetch(fetch), max_wait, watches)
    {
        // Dropping this future (the client hung up) drops the handle, which
        // takes the fetch out of the purgatory.
        Ok(handle) => match handle.await {
            Ok(done) => Ok(done.into_inner().answer(held)),
            Err(_) => Err(Gone),
        },
        Err(refused) => Ok(refused.into_inner().0.answer(held)),
    }
}

/// Re-reads every `every` until enough bytes or the deadline (a fetch that
/// can `never` have enough reads nothing: it waits for the deadline, or
/// shutdown).
async fn sleep_poll(
    fetch: Fetch,
    never: bool,
    max_wait: Duration,
    every: Duration,
    held: &Held,
) -> FetchResponse {
    let deadline = Instant::now() + max_wait;
    loop {
        let next = (Instant::now() + every).min(deadline);
        tokio::time::sleep_until(next).await;
        if next >= deadline || (!never && fetch.enough()) || fetch.closing.load(Ordering::SeqCst) {
            return fetch.answer(held);
        }
    }
}

/// Awaits any of its partitions' `Notify` under `tokio::time::timeout`,
/// re-reading after each wake-up. Each waiter is armed (`enable`) before the
/// read that decides to wait, so a move between the read and the wait is not
/// lost. A fetch that can `never` have enough awaits its first partition's
/// only (shutdown wakes every partition's) and reads nothing.
async fn notified(fetch: Fetch, never: bool, max_wait: Duration, held: &Held) -> FetchResponse {
    let deadline = Instant::now() + max_wait;
    loop {
        let parts: Vec<Arc<Partition>> = fetch
            .wants()
            .map(|(p, _)| p.clone())
            .take(if never { 1 } else { usize::MAX })
            .collect();
        let mut waits: Vec<_> = parts
            .iter()
            .map(|p| Box::pin(p.notify.notified()))
            .collect();
        for w in &mut waits {
            w.as_mut().enable();
        }
        if (!never && fetch.enough()) || fetch.closing.load(Ordering::SeqCst) {
            return fetch.answer(held);
        }
        let any = futures::future::select_all(waits);
        if tokio::time::timeout_at(deadline, any).await.is_err() {
            return fetch.answer(held);
        }
    }
}
