//! `Produce`: append, then answer at once (`acks` 0 and 1) or once the high
//! watermark covers the records (`acks=-1`), waiting in the produce purgatory.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::mem::size_of;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kafka_protocol::error::ResponseError;
use kafka_protocol::messages::produce_request::PartitionProduceData;
use kafka_protocol::messages::produce_response::{PartitionProduceResponse, TopicProduceResponse};
use kafka_protocol::messages::{ProduceRequest, ProduceResponse, TopicName};
use kafka_protocol::protocol::StrBytes;
use tokio_purgatory::{Completion, Operation, Watch};

use super::frame::Held;
use super::log::{self, AppendError, Topic};
use super::{Broker, Gone, Partition};

/// What a produce's answer needs of each partition it wrote to.
struct Write {
    part: Arc<Partition>,
    /// One past its last record: covered once the high watermark reaches it.
    end: u64,
    /// Where its answer goes: (topic, partition) in the response.
    slot: (usize, usize),
}

/// Kafka's `DelayedProduce`: done once every partition it wrote to has been
/// copied by every follower up to its records.
pub struct DelayedProduce {
    writes: Vec<Write>,
    response: ProduceResponse,
    closing: Arc<AtomicBool>,
    /// `min.insync.replicas`: a partition covered while its ISR is smaller
    /// is answered `NOT_ENOUGH_REPLICAS_AFTER_APPEND`, as Kafka does.
    min_insync: usize,
}

impl DelayedProduce {
    fn covered(&self) -> bool {
        self.writes.iter().all(|w| w.part.high_watermark() >= w.end)
    }

    /// The response: partitions not yet covered get `error`; covered ones
    /// whose ISR shrank below `min_insync` get `NOT_ENOUGH_REPLICAS_AFTER_APPEND`.
    fn answer(&self, error: ResponseError) -> ProduceResponse {
        let mut response = self.response.clone();
        for w in &self.writes {
            let code = if w.part.high_watermark() < w.end {
                error
            } else if w.part.isr_size() < self.min_insync {
                ResponseError::NotEnoughReplicasAfterAppend
            } else {
                continue;
            };
            let p = &mut response.responses[w.slot.0].partition_responses[w.slot.1];
            p.error_code = code.code();
        }
        response
    }
}

impl Operation for DelayedProduce {
    type Output = ProduceResponse;

    fn try_complete(&mut self) -> Option<ProduceResponse> {
        // Covered: `answer` marks nothing (a covered partition stays covered).
        // Closing: what is not covered yet is in the log, not replicated.
        (self.covered() || self.closing.load(Ordering::SeqCst))
            .then(|| self.answer(ResponseError::NotEnoughReplicasAfterAppend))
    }

    fn on_expiration(self) -> ProduceResponse {
        // Kafka answers a produce whose replication did not finish in time
        // with REQUEST_TIMED_OUT for each partition not yet replicated.
        self.answer(ResponseError::RequestTimedOut)
    }
}

/// What a waiting produce keeps for each partition's watch in the purgatory
/// (as a fetch's, [`super::fetch::WATCH`]).
const WATCH: usize = super::fetch::WATCH;

/// Checks one partition's records and appends them; Kafka's error for them
/// when they are refused.
fn append(
    broker: &Broker,
    part: &Arc<Partition>,
    data: &PartitionProduceData,
    version: i16,
    now: i64,
) -> Result<(u64, u64), ResponseError> {
    let appended = log::check(
        data.records.as_ref(),
        version,
        broker.config.max_message_bytes,
    )
    .and_then(|checked| broker.topics.append(part, checked, now));
    match appended {
        Ok((base, end)) => {
            broker.followers.appended(broker, part, end);
            Ok((base, end))
        }
        Err(e) => {
            if e != AppendError::Full {
                broker.stats.batches_refused.fetch_add(1, Ordering::Relaxed);
            }
            Err(match e {
                AppendError::Corrupt => ResponseError::CorruptMessage,
                AppendError::Invalid => ResponseError::InvalidRecord,
                AppendError::TooLarge => ResponseError::MessageTooLarge,
                AppendError::UnsupportedCompression => ResponseError::UnsupportedCompressionType,
                AppendError::Full => ResponseError::KafkaStorageError,
            })
        }
    }
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// Handles a produce: `Ok(None)` for `acks=0` (no answer is sent), `Err`
/// when the connection is to be closed: the broker stopped under it, or an
/// `acks=0` produce failed (Kafka closes the connection then, the only way a
/// producer that reads no answer finds out; it then refreshes its metadata).
///
/// As Kafka does, the request's partitions are keyed by topic and partition:
/// one named twice is appended once, with the records named last, and
/// answered once (a request cannot make the broker do more than its
/// distinct partitions ask).
///
/// An `acks=-1` produce that waits lets go of its request and frame first
/// (its records are in the log by then) and keeps, in `charge`, what it
/// holds meanwhile: its answer, its writes and their watches (which may take
/// more than the frame was charged: the rest is charged then, and with no
/// room for it the produce is answered at once, as when its timeout passes).
pub async fn handle(
    broker: &Broker,
    request: ProduceRequest,
    version: i16,
    charge: &Held,
) -> Result<Option<ProduceResponse>, Gone> {
    let acks = request.acks;
    // Each distinct topic once (looked up once), in the request's order,
    // with each of its distinct partitions' last entry.
    type Named<'a> = (
        &'a TopicName,
        Option<Arc<Topic>>,
        Vec<&'a PartitionProduceData>,
    );
    // The maps that find them go before a wait (they are not what it keeps).
    let topics: Vec<Named> = {
        let mut topics: Vec<Named> = Vec::new();
        let mut topic_at: HashMap<&str, usize> = HashMap::new();
        let mut slot_at: HashMap<(usize, i32), usize> = HashMap::new();
        for topic in &request.topic_data {
            let ti = *topic_at.entry(topic.name.as_str()).or_insert_with(|| {
                topics.push((&topic.name, broker.topics.get(&topic.name), Vec::new()));
                topics.len() - 1
            });
            let parts = &mut topics[ti].2;
            for data in &topic.partition_data {
                match slot_at.entry((ti, data.index)) {
                    Entry::Occupied(at) => parts[*at.get()] = data,
                    Entry::Vacant(at) => {
                        at.insert(parts.len());
                        parts.push(data);
                    }
                }
            }
        }
        topics
    };
    let mut response = ProduceResponse::default();
    let mut writes = Vec::new();
    let mut failed = false;
    let now = now_ms();
    for (ti, (name, topic, parts)) in topics.iter().enumerate() {
        let mut t = TopicProduceResponse::default().with_name((*name).clone());
        for (pi, data) in parts.iter().enumerate() {
            let mut p = PartitionProduceResponse::default()
                .with_index(data.index)
                .with_base_offset(-1)
                .with_log_append_time_ms(-1)
                .with_log_start_offset(-1);
            let part = topic.as_ref().and_then(|t| {
                usize::try_from(data.index)
                    .ok()
                    .and_then(|i| t.partitions.get(i))
            });
            let appended = if !matches!(acks, -1..=1) {
                Err(ResponseError::InvalidRequiredAcks)
            } else {
                match part {
                    None => Err(ResponseError::UnknownTopicOrPartition),
                    // Kafka refuses an acks=all produce before appending when
                    // the ISR is smaller than min.insync.replicas.
                    Some(part)
                        if acks == -1 && part.isr_size() < broker.config.min_insync_replicas =>
                    {
                        Err(ResponseError::NotEnoughReplicas)
                    }
                    Some(part) => append(broker, part, data, version, now)
                        .map(|(base, end)| (part, base, end)),
                }
            };
            match appended {
                Ok((part, base, end)) => {
                    p.base_offset = base as i64;
                    p.log_start_offset = part.log_start() as i64;
                    writes.push(Write {
                        part: part.clone(),
                        end,
                        slot: (ti, pi),
                    });
                }
                Err(e) => {
                    failed = true;
                    p.error_code = e.code();
                }
            }
            t.partition_responses.push(p);
        }
        response.responses.push(t);
    }
    if acks == 0 {
        if failed {
            tracing::debug!("an acks=0 produce failed: its connection is closed, as Kafka does");
            return Err(Gone);
        }
        return Ok(None);
    }
    if acks != -1 || writes.is_empty() {
        return Ok(Some(response));
    }
    let timeout =
        Duration::from_millis(request.timeout_ms.max(0) as u64).min(broker.config.max_produce_wait);
    // It waits: the answer's topic names are slices of the frame, copied so
    // that the frame goes with the request. What it keeps is all it stays
    // charged: its lists as allocated (their spare room let go first), the
    // names, and a watch per write.
    response.responses.shrink_to_fit();
    for t in &mut response.responses {
        t.name = TopicName(StrBytes::from_string(t.name.to_string()));
        t.partition_responses.shrink_to_fit();
    }
    writes.shrink_to_fit();
    drop(topics);
    drop(request);
    let kept: usize = response.responses.capacity() * size_of::<TopicProduceResponse>()
        + response
            .responses
            .iter()
            .map(|t| {
                t.name.len()
                    + t.partition_responses.capacity() * size_of::<PartitionProduceResponse>()
            })
            .sum::<usize>()
        + writes.capacity() * size_of::<Write>()
        + writes.len() * WATCH;
    let room = charge.hold(&broker.budget, size_of::<DelayedProduce>() + kept);
    let watches: Vec<_> = writes
        .iter()
        .map(|w| Watch::level(w.part.key, w.end))
        .collect();
    let mut op = DelayedProduce {
        writes,
        response,
        closing: broker.closing.clone(),
        min_insync: broker.config.min_insync_replicas,
    };
    if !room {
        // No room in the memory budget for what waiting keeps: answered now,
        // as when its timeout has passed (its records are in the log).
        tracing::debug!(
            kept,
            "an acks=-1 produce has no room in the memory budget to wait"
        );
        return Ok(Some(op.try_complete().unwrap_or_else(|| {
            broker
                .stats
                .produces_timed_out
                .fetch_add(1, Ordering::Relaxed);
            op.on_expiration()
        })));
    }
    match broker
        .produces
        .try_complete_else_watch_levels(op, timeout, watches)
    {
        Ok(handle) => match handle.await {
            Ok(Completion::Completed(r)) => Ok(Some(r)),
            Ok(Completion::Expired(r)) => {
                broker
                    .stats
                    .produces_timed_out
                    .fetch_add(1, Ordering::Relaxed);
                Ok(Some(r))
            }
            Err(_) => Err(Gone),
        },
        // Refused (the broker is shutting down): answer from the operation.
        Err(refused) => Ok(Some(
            refused
                .into_inner()
                .answer(ResponseError::NotEnoughReplicasAfterAppend),
        )),
    }
}
