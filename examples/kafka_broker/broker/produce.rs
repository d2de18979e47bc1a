//! `Produce`: append, then answer at once (`acks` 0 and 1) or once the high
//! watermark covers the records (`acks=-1`), waiting in the produce purgatory.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kafka_protocol::error::ResponseError;
use kafka_protocol::messages::produce_response::{PartitionProduceResponse, TopicProduceResponse};
use kafka_protocol::messages::{ProduceRequest, ProduceResponse};
use tokio_purgatory::{Completion, Operation, Watch};

use super::log::AppendError;
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

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// Handles a produce: `Ok(None)` for `acks=0` (no answer is sent), `Err`
/// when the broker stopped under it (the connection is closed).
pub async fn handle(
    broker: &Broker,
    request: ProduceRequest,
) -> Result<Option<ProduceResponse>, Gone> {
    let acks = request.acks;
    let mut response = ProduceResponse::default();
    let mut writes = Vec::new();
    let now = now_ms();
    for (ti, topic) in request.topic_data.iter().enumerate() {
        let mut t = TopicProduceResponse::default().with_name(topic.name.clone());
        for (pi, data) in topic.partition_data.iter().enumerate() {
            let mut p = PartitionProduceResponse::default()
                .with_index(data.index)
                .with_base_offset(-1)
                .with_log_append_time_ms(-1);
            let error = if !matches!(acks, -1..=1) {
                Some(ResponseError::InvalidRequiredAcks)
            } else {
                match broker.topics.partition(&topic.name, data.index) {
                    None => Some(ResponseError::UnknownTopicOrPartition),
                    // Kafka refuses an acks=all produce before appending when
                    // the ISR is smaller than min.insync.replicas.
                    Some(part)
                        if acks == -1 && part.isr_size() < broker.config.min_insync_replicas =>
                    {
                        Some(ResponseError::NotEnoughReplicas)
                    }
                    Some(part) => match data.records.as_ref().map(|r| part.append(r, now)) {
                        Some(Ok((base, end))) => {
                            broker.followers.appended(broker, &part, end);
                            p.base_offset = base as i64;
                            writes.push(Write {
                                part,
                                end,
                                slot: (ti, pi),
                            });
                            None
                        }
                        None | Some(Err(AppendError::Corrupt)) => {
                            broker.stats.batches_refused.fetch_add(1, Ordering::Relaxed);
                            Some(ResponseError::CorruptMessage)
                        }
                        Some(Err(AppendError::Invalid)) => {
                            broker.stats.batches_refused.fetch_add(1, Ordering::Relaxed);
                            Some(ResponseError::InvalidRecord)
                        }
                    },
                }
            };
            if let Some(e) = error {
                p.error_code = e.code();
            }
            t.partition_responses.push(p);
        }
        response.responses.push(t);
    }
    if acks != -1 || writes.is_empty() {
        return Ok((acks != 0).then_some(response));
    }
    let watches: Vec<_> = writes
        .iter()
        .map(|w| Watch::level(w.part.key, w.end))
        .collect();
    let op = DelayedProduce {
        writes,
        response,
        closing: broker.closing.clone(),
        min_insync: broker.config.min_insync_replicas,
    };
    let timeout =
        Duration::from_millis(request.timeout_ms.max(0) as u64).min(broker.config.max_produce_wait);
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
