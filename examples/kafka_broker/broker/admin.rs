//! The administration request that changes what the broker holds:
//! `CreateTopics`, as Kafka's controller answers it, within the broker's
//! bounds on topics and partitions. (`ListGroups`, `DescribeGroups` and
//! `DeleteGroups` are the coordinator's: see `groups.rs`.)

use std::collections::HashMap;

use kafka_protocol::error::ResponseError;
use kafka_protocol::messages::create_topics_request::CreatableTopic;
use kafka_protocol::messages::create_topics_response::CreatableTopicResult;
use kafka_protocol::messages::*;
use kafka_protocol::protocol::StrBytes;

use super::frame::Held;
use super::log::{internal_topic, valid_topic_name, CreateError};
use super::{Broker, Gone, MAX_PARTITIONS};

/// Creates the topics asked for, each with the partitions it names (or the
/// broker's `--partitions` for -1) and every simulated follower as a
/// replica, and answers each topic as Kafka's controller does, checking in
/// this order:
///
/// - a name given more than once: one answer for it, `INVALID_REQUEST`
///   ("Duplicate topic name.");
/// - a name Kafka refuses, or one of its internal topics' names
///   (`__consumer_offsets`, ...: no internal topic is served here):
///   `INVALID_TOPIC_EXCEPTION`;
/// - a topic that exists: `TOPIC_ALREADY_EXISTS`, whatever else the request
///   asks of it (so a client that creates a topic if it is absent, with
///   configs, is told it exists); of two requests creating one name at
///   once, one is told so;
/// - replicas assigned by hand: `INVALID_REPLICA_ASSIGNMENT` (this broker
///   places them itself), or `INVALID_REQUEST` when partitions or a
///   replication factor are given with them, as Kafka answers;
/// - partitions 0 or below -1, or above the most a topic has here
///   (10,000): `INVALID_PARTITIONS`;
/// - a replication factor 0 or below -1, or above the replicas there are
///   (the leader and `--followers`): `INVALID_REPLICATION_FACTOR`. A factor
///   below that is accepted, and the topic still has every follower as a
///   replica (the followers are simulated, one set for every partition): the
///   answer (from version 5) and Metadata say how many it has;
/// - topic configs: `INVALID_CONFIG` (every topic uses the broker's
///   settings; a config set and ignored would be a silent surprise);
/// - a name that differs from an existing topic's only in '.' against '_'
///   (Kafka's collision: their metrics' names would be the same):
///   `INVALID_TOPIC_EXCEPTION`, checked when it would be created, so also on
///   first use (Metadata then answers the topic unknown);
/// - beyond `--max-topics` or `--max-partitions`: `POLICY_VIOLATION`, which
///   clients do not retry, with a message naming the bound.
///
/// With `validate_only`, each topic is checked as above and nothing is
/// created. Creation takes effect at once, so the request's timeout is not
/// waited on. Topics are created whether or not the broker creates them on
/// first use (`--no-auto-create` is Kafka's `auto.create.topics.enable`).
///
/// The answer, with a message for each error, is charged to the memory
/// budget first, in `held`, before anything is created (what building it
/// and encoding it take); with no room for it the connection is closed (a
/// refusal would take as much), nothing created, and the client connects
/// again and retries.
pub fn create_topics(
    broker: &Broker,
    r: &CreateTopicsRequest,
    version: i16,
    held: &Held,
) -> Result<CreateTopicsResponse, Gone> {
    const RESULT: usize = std::mem::size_of::<CreatableTopicResult>() + 64;
    /// The longest message an answer carries besides the topic's name (a
    /// collision names another topic, of up to 249 bytes).
    const MESSAGE: usize = 420;
    let mut mentions: HashMap<&str, usize> = HashMap::new();
    let mut order = Vec::new();
    for t in &r.topics {
        let n = mentions.entry(&**t.name).or_default();
        if *n == 0 {
            order.push(t);
        }
        *n += 1;
    }
    // Each topic answered once: its name (a copy, and encoded) and message
    // (built, and encoded).
    let bytes: usize = (order.iter())
        .map(|t| RESULT + 2 * MESSAGE + 3 * t.name.len())
        .sum();
    if !broker.budget.try_charge(bytes, held) {
        tracing::debug!(
            bytes,
            "a topic creation's answer has no room in the memory budget"
        );
        return Err(Gone);
    }
    let replicas = broker.topics.replicas();
    let topics = (order.into_iter())
        .map(|t| {
            let answer = CreatableTopicResult::default().with_name(t.name.clone());
            let outcome = if mentions[&**t.name] > 1 {
                Err((
                    ResponseError::InvalidRequest,
                    "Duplicate topic name.".to_string(),
                ))
            } else {
                create(broker, t, replicas, r.validate_only)
            };
            match outcome {
                Err((code, message)) => answer
                    .with_error_code(code.code())
                    .with_error_message(Some(StrBytes::from_string(message)))
                    .with_num_partitions(-1)
                    .with_replication_factor(-1)
                    .with_configs(None),
                Ok(partitions) if version >= 5 => answer
                    .with_error_message(None)
                    .with_num_partitions(partitions)
                    .with_replication_factor(replicas as i16)
                    .with_configs(Some(Vec::new())),
                Ok(_) => answer.with_error_message(None),
            }
        })
        .collect();
    Ok(CreateTopicsResponse::default().with_topics(topics))
}

/// Checks one topic and, unless `dry_run`, creates it: its partitions, or
/// the error and message to answer.
fn create(
    broker: &Broker,
    t: &CreatableTopic,
    replicas: usize,
    dry_run: bool,
) -> Result<i32, (ResponseError, String)> {
    if !valid_topic_name(&t.name) {
        return Err((
            ResponseError::InvalidTopicException,
            "Topic names are 1 to 249 characters: ASCII letters, digits, '.', '_' and '-' \
             ('.' and '..' alone are refused)."
                .to_string(),
        ));
    }
    if internal_topic(&t.name) {
        return Err((
            ResponseError::InvalidTopicException,
            format!(
                "'{}' is one of Kafka's internal topics: this broker keeps group offsets \
                 itself and serves no internal topic.",
                &**t.name
            ),
        ));
    }
    let exists = || {
        (
            ResponseError::TopicAlreadyExists,
            format!("Topic '{}' already exists.", &**t.name),
        )
    };
    if broker.topics.get(&t.name).is_some() {
        return Err(exists());
    }
    if !t.assignments.is_empty() {
        return Err(if t.num_partitions != -1 || t.replication_factor != -1 {
            (
                ResponseError::InvalidRequest,
                "Both partitions or a replication factor and replica assignments were set; \
                 give one or the other."
                    .to_string(),
            )
        } else {
            (
                ResponseError::InvalidReplicaAssignment,
                "Replica assignments are not served: this broker places replicas itself."
                    .to_string(),
            )
        });
    }
    let partitions = match t.num_partitions {
        -1 => broker.topics.default_partitions(),
        n if (1..=MAX_PARTITIONS).contains(&n) => n,
        n => {
            return Err((
                ResponseError::InvalidPartitions,
                format!("A topic has 1 to {MAX_PARTITIONS} partitions here (asked: {n})."),
            ))
        }
    };
    match t.replication_factor {
        -1 => {}
        n if n >= 1 && n as usize <= replicas => {}
        n => {
            return Err((
                ResponseError::InvalidReplicationFactor,
                format!(
                    "Replication factor {n}: each partition here has {replicas} replicas \
                     (the leader and --followers); ask for 1 to {replicas}, or -1."
                ),
            ))
        }
    }
    if !t.configs.is_empty() {
        return Err((
            ResponseError::InvalidConfig,
            "Topic configs are not served: every topic uses the broker's settings.".to_string(),
        ));
    }
    match broker.topics.create_new(&t.name, partitions, dry_run) {
        Ok(_) => {
            if !dry_run {
                tracing::info!(topic = &**t.name, partitions, "topic created");
            }
            Ok(partitions)
        }
        // Made by another request since it was looked up.
        Err(CreateError::Exists(_)) => Err(exists()),
        // Kafka's words: the names differ only in '.' against '_'.
        Err(CreateError::Collides(other)) => Err((
            ResponseError::InvalidTopicException,
            format!(
                "Topic '{}' collides with existing topic: {other}",
                &**t.name
            ),
        )),
        Err(e) => Err((
            ResponseError::PolicyViolation,
            format!("Topic not created: {e}."),
        )),
    }
}
