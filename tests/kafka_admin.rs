//! The broker example's administration requests against Kafka's answers,
//! over real sockets (every test bounded): `CreateTopics` (each error Kafka
//! gives, the broker's bounds on topics and partitions, a validation that
//! creates nothing, two creations of one name racing), `ListGroups` and
//! `DescribeGroups` (states, filters, members with their client ids and
//! addresses, metadata shown only in `Stable`), `DeleteGroups` (what a
//! deleted group held given back), and the answers charged to the memory
//! budget before they are built.

#[path = "../examples/kafka_broker/broker/mod.rs"]
#[allow(dead_code)]
mod broker;
#[path = "../examples/kafka_broker/wire.rs"]
#[allow(dead_code)]
mod wire;

use std::future::Future;
use std::time::Duration;

use broker::{BrokerHandle, Config};
use kafka_protocol::error::ResponseError;
use kafka_protocol::messages::create_topics_request::{
    CreatableReplicaAssignment, CreatableTopic, CreatableTopicConfig,
};
use kafka_protocol::messages::*;
use kafka_protocol::protocol::StrBytes;
use wire::{GroupMember, Wire};

async fn bounded<F: Future>(f: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(30), f)
        .await
        .expect("the test finished in time")
}

fn s(v: &str) -> StrBytes {
    StrBytes::from_string(v.to_string())
}

async fn start(mut config: Config) -> BrokerHandle {
    config.listen = "127.0.0.1:0".parse().unwrap();
    BrokerHandle::start(config)
        .await
        .expect("the broker starts")
}

fn topic(name: &str, partitions: i32, replication: i16) -> CreatableTopic {
    CreatableTopic::default()
        .with_name(TopicName(s(name)))
        .with_num_partitions(partitions)
        .with_replication_factor(replication)
}

fn create(topics: Vec<CreatableTopic>, validate_only: bool) -> CreateTopicsRequest {
    CreateTopicsRequest::default()
        .with_topics(topics)
        .with_timeout_ms(5000)
        .with_validate_only(validate_only)
}

/// Each result's name and error code, in the answer's order.
fn codes(r: &CreateTopicsResponse) -> Vec<(String, i16)> {
    r.topics
        .iter()
        .map(|t| (t.name.to_string(), t.error_code))
        .collect()
}

/// The topics the broker's Metadata lists, with their partition counts.
async fn listed(w: &mut Wire) -> Vec<(String, usize)> {
    let r = w
        .call(&MetadataRequest::default().with_topics(None), 9)
        .await
        .unwrap();
    let mut all: Vec<_> = r
        .topics
        .iter()
        .map(|t| (t.name.as_ref().unwrap().to_string(), t.partitions.len()))
        .collect();
    all.sort();
    all
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_topics_answers_each_topic_as_kafka_does() {
    bounded(async {
        let b = start(Config {
            partitions: 3,
            followers: 2,
            // Creation by request does not depend on creation on first use
            // (Kafka's auto.create.topics.enable).
            auto_create_topics: false,
            ..Config::default()
        })
        .await;
        let mut w = Wire::connect(b.addr).await.unwrap();
        let code = |e: ResponseError| e.code();
        for version in 2..=6i16 {
            let name = |n: &str| format!("{n}-v{version}");
            let r = w
                .call(
                    &create(
                        vec![
                            topic(&name("new"), 5, 3),
                            topic(&name("default"), -1, -1),
                            topic(&name("rf1"), 1, 1),
                            topic(&name("dup"), 1, -1),
                            topic(&name("dup"), 2, -1),
                            topic("bad name", 1, -1),
                            topic("__consumer_offsets", 1, -1),
                            topic(&name("zero"), 0, -1),
                            topic(&name("minus2"), -2, -1),
                            topic(&name("huge"), 10_001, -1),
                            topic(&name("rf0"), 1, 0),
                            topic(&name("rf4"), 1, 4),
                            topic(&name("assigned"), -1, -1).with_assignments(vec![
                                CreatableReplicaAssignment::default()
                                    .with_partition_index(0)
                                    .with_broker_ids(vec![BrokerId(0)]),
                            ]),
                            topic(&name("both"), 1, -1).with_assignments(vec![
                                CreatableReplicaAssignment::default()
                                    .with_partition_index(0)
                                    .with_broker_ids(vec![BrokerId(0)]),
                            ]),
                            topic(&name("configured"), 1, -1).with_configs(vec![
                                CreatableTopicConfig::default()
                                    .with_name(s("cleanup.policy"))
                                    .with_value(Some(s("compact"))),
                            ]),
                        ],
                        false,
                    ),
                    version,
                )
                .await
                .unwrap();
            assert_eq!(
                codes(&r),
                vec![
                    (name("new"), 0),
                    (name("default"), 0),
                    (name("rf1"), 0),
                    // Once, however often it is named (Kafka's controller).
                    (name("dup"), code(ResponseError::InvalidRequest)),
                    (
                        "bad name".into(),
                        code(ResponseError::InvalidTopicException)
                    ),
                    // Kafka's internal topics are not served here.
                    (
                        "__consumer_offsets".into(),
                        code(ResponseError::InvalidTopicException)
                    ),
                    (name("zero"), code(ResponseError::InvalidPartitions)),
                    (name("minus2"), code(ResponseError::InvalidPartitions)),
                    (name("huge"), code(ResponseError::InvalidPartitions)),
                    (name("rf0"), code(ResponseError::InvalidReplicationFactor)),
                    (name("rf4"), code(ResponseError::InvalidReplicationFactor)),
                    (
                        name("assigned"),
                        code(ResponseError::InvalidReplicaAssignment)
                    ),
                    (name("both"), code(ResponseError::InvalidRequest)),
                    (name("configured"), code(ResponseError::InvalidConfig)),
                ],
                "version {version}"
            );
            for t in &r.topics {
                // Every error says why; successes carry no message.
                assert_eq!(t.error_message.is_some(), t.error_code != 0, "{t:?}");
                if version >= 5 {
                    let (partitions, replicas) = match &*t.name.to_string() {
                        n if t.error_code != 0 => {
                            assert!(t.configs.is_none(), "{n}");
                            (-1, -1)
                        }
                        n if n == name("new") => (5, 3),
                        n if n == name("default") => (3, 3),
                        // Every topic has every simulated follower.
                        _ => (1, 3),
                    };
                    assert_eq!(
                        (t.num_partitions, t.replication_factor),
                        (partitions, replicas),
                        "{t:?}"
                    );
                }
            }
            // Created, with the partitions asked for (the broker's for -1),
            // and nothing else.
            let all = listed(&mut w).await;
            for (n, p) in [("new", 5), ("default", 3), ("rf1", 1)] {
                assert!(all.contains(&(name(n), p)), "{n} in {all:?}");
            }
            assert!(
                !all.iter()
                    .any(|(n, _)| n.contains("dup") || n.contains("zero")),
                "{all:?}"
            );
            // Again: it exists, and is not changed; that is answered first,
            // whatever else is asked (configs, here), as Kafka checks.
            let again = w
                .call(
                    &create(
                        vec![topic(&name("new"), 7, -1).with_configs(vec![
                            CreatableTopicConfig::default()
                                .with_name(s("retention.ms"))
                                .with_value(Some(s("1000"))),
                        ])],
                        false,
                    ),
                    version,
                )
                .await
                .unwrap();
            assert_eq!(
                codes(&again),
                vec![(name("new"), code(ResponseError::TopicAlreadyExists))]
            );
            assert!(listed(&mut w).await.contains(&(name("new"), 5)));
        }
        // A validation checks and creates nothing.
        let v = w
            .call(
                &create(vec![topic("checked", 2, -1), topic("new-v2", 1, -1)], true),
                4,
            )
            .await
            .unwrap();
        assert_eq!(
            codes(&v),
            vec![
                ("checked".into(), 0),
                ("new-v2".into(), code(ResponseError::TopicAlreadyExists))
            ]
        );
        assert!(!listed(&mut w).await.iter().any(|(n, _)| n == "checked"));
        // What was created is served: produced to and read back.
        let r = w.append("new-v2", 4, &[b"x"]).await.unwrap();
        assert_eq!(wire::produce_error(&r), 0);
        b.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_broker_bounds_refuse_with_policy_violation() {
    bounded(async {
        let b = start(Config {
            partitions: 2,
            topics: vec!["held".into()],
            max_topics: 3,
            max_partitions: 10,
            ..Config::default()
        })
        .await;
        let mut w = Wire::connect(b.addr).await.unwrap();
        let policy = ResponseError::PolicyViolation.code();
        // 2 held; 8 more fit, 9 do not (and a validation says so too).
        for validate in [true, false] {
            let r = w
                .call(&create(vec![topic("nine", 9, -1)], validate), 5)
                .await
                .unwrap();
            assert_eq!(codes(&r), vec![("nine".into(), policy)]);
            let m = r.topics[0].error_message.as_deref().unwrap();
            assert!(m.contains("--max-partitions"), "{m}");
        }
        // Nor are internal topics made on first use, or written to.
        let r = w
            .call(
                &MetadataRequest::default()
                    .with_topics(Some(vec![metadata_request::MetadataRequestTopic::default(
                    )
                    .with_name(Some(TopicName(s("__consumer_offsets"))))]))
                    .with_allow_auto_topic_creation(true),
                9,
            )
            .await
            .unwrap();
        assert_eq!(
            r.topics[0].error_code,
            ResponseError::UnknownTopicOrPartition.code()
        );
        let r = w.append("__consumer_offsets", 0, &[b"x"]).await.unwrap();
        assert_eq!(
            wire::produce_error(&r),
            ResponseError::UnknownTopicOrPartition.code()
        );
        assert!(BrokerHandle::start(Config {
            listen: "127.0.0.1:0".parse().unwrap(),
            topics: vec!["__transaction_state".into()],
            ..Config::default()
        })
        .await
        .is_err());
        let r = w
            .call(&create(vec![topic("eight", 8, -1)], false), 5)
            .await
            .unwrap();
        assert_eq!(codes(&r), vec![("eight".into(), 0)]);
        // 2 topics of 3; 10 partitions of 10: the third topic's one
        // partition does not fit; a topic of none cannot be asked for.
        let r = w
            .call(&create(vec![topic("third", 1, -1)], false), 5)
            .await
            .unwrap();
        assert_eq!(codes(&r), vec![("third".into(), policy)]);
        b.shutdown().await;
        let b = start(Config {
            max_topics: 1,
            topics: vec!["only".into()],
            ..Config::default()
        })
        .await;
        let mut w = Wire::connect(b.addr).await.unwrap();
        let r = w
            .call(&create(vec![topic("second", 1, -1)], false), 6)
            .await
            .unwrap();
        assert_eq!(codes(&r), vec![("second".into(), policy)]);
        let m = r.topics[0].error_message.as_deref().unwrap();
        assert!(m.contains("--max-topics"), "{m}");
        // An existing topic is still told it exists, bound or not.
        let r = w
            .call(&create(vec![topic("only", 1, -1)], false), 6)
            .await
            .unwrap();
        assert_eq!(
            codes(&r),
            vec![("only".into(), ResponseError::TopicAlreadyExists.code())]
        );
        b.shutdown().await;
    })
    .await;
}

/// Two connections create the same names at once: each name is created
/// once, and the other creator is told it exists.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_creations_of_one_name_create_it_once() {
    bounded(async {
        let b = start(Config::default()).await;
        let names: Vec<String> = (0..50).map(|i| format!("race-{i}")).collect();
        let go = |names: Vec<String>| {
            let addr = b.addr;
            tokio::spawn(async move {
                let mut w = Wire::connect(addr).await.unwrap();
                let mut ok = Vec::new();
                for n in names {
                    let r = w
                        .call(&create(vec![topic(&n, 2, -1)], false), 5)
                        .await
                        .unwrap();
                    ok.push(r.topics[0].error_code);
                }
                ok
            })
        };
        let (x, y) = (go(names.clone()), go(names.clone()));
        let (x, y) = (x.await.unwrap(), y.await.unwrap());
        let exists = ResponseError::TopicAlreadyExists.code();
        for (i, (a, b)) in x.iter().zip(&y).enumerate() {
            let mut pair = [*a, *b];
            pair.sort();
            assert_eq!(pair, [0, exists], "{}", names[i]);
        }
        b.shutdown().await;
    })
    .await;
}

/// A join (v5) of `group` as `member` (empty for a first join), speaking
/// `range` with `metadata`.
fn join(group: &str, member: &str, metadata: bytes::Bytes) -> JoinGroupRequest {
    JoinGroupRequest::default()
        .with_group_id(GroupId(s(group)))
        .with_session_timeout_ms(SESSION)
        .with_rebalance_timeout_ms(1000)
        .with_member_id(s(member))
        .with_protocol_type(s("consumer"))
        .with_protocols(vec![join_group_request::JoinGroupRequestProtocol::default(
        )
        .with_name(s("range"))
        .with_metadata(metadata)])
}

/// The members' sessions: long enough that members which do not heartbeat
/// stay in their group for a test, however slow the machine.
const SESSION: i32 = 60_000;

/// A stable group of two members (client id `wire`): its leader and its
/// follower.
async fn stable_pair(b: &BrokerHandle, group: &str) -> (GroupMember, GroupMember) {
    let mut a = GroupMember::connect(b.addr).await.unwrap();
    assert_eq!(a.join(group, SESSION).await.unwrap(), 0);
    assert_eq!(a.sync(group, 4).await.unwrap().0, 0);
    let mut c = GroupMember::connect(b.addr).await.unwrap();
    let g = group.to_string();
    let joined = tokio::spawn(async move {
        assert_eq!(c.join(&g, SESSION).await.unwrap(), 0);
        c
    });
    // The first member learns of the round from its heartbeat, and joins.
    loop {
        let hb = a.heartbeat(group).await.unwrap();
        if hb == ResponseError::RebalanceInProgress.code() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(a.join(group, SESSION).await.unwrap(), 0);
    let c = joined.await.unwrap();
    let (mut leader, mut follower) = if a.leader { (a, c) } else { (c, a) };
    let g = group.to_string();
    let synced = tokio::spawn(async move {
        assert_eq!(follower.sync(&g, 4).await.unwrap().0, 0);
        follower
    });
    assert_eq!(leader.sync(group, 4).await.unwrap().0, 0);
    let follower = synced.await.unwrap();
    (leader, follower)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_and_describe_groups_as_kafka_does() {
    bounded(async {
        let b = start(Config {
            topics: vec!["t".into()],
            ..Config::default()
        })
        .await;
        let mut w = Wire::connect(b.addr).await.unwrap();
        let (leader, follower) = stable_pair(&b, "g").await;
        // A group with committed offsets only (no members): Empty, and no
        // protocol type.
        let r = w.call(&commit("offsets-only", 0), 2).await.unwrap();
        assert_eq!(r.topics[0].partitions[0].error_code, 0);

        for version in 0..=5i16 {
            let r = w
                .call(&ListGroupsRequest::default(), version)
                .await
                .unwrap();
            assert_eq!(r.error_code, 0);
            let mut groups: Vec<_> = r
                .groups
                .iter()
                .map(|g| {
                    (
                        g.group_id.to_string(),
                        g.protocol_type.to_string(),
                        g.group_state.to_string(),
                        g.group_type.to_string(),
                    )
                })
                .collect();
            groups.sort();
            // State from version 4, type from 5 (empty before: not sent).
            let state = |st: &str| {
                if version >= 4 {
                    st.to_string()
                } else {
                    String::new()
                }
            };
            let kind = if version >= 5 { "classic" } else { "" };
            assert_eq!(
                groups,
                vec![
                    ("g".into(), "consumer".into(), state("Stable"), kind.into()),
                    (
                        "offsets-only".into(),
                        "".into(),
                        state("Empty"),
                        kind.into()
                    ),
                ],
                "version {version}"
            );
        }
        // Filters: by state, compared without regard to case; by type.
        let only = |r: &ListGroupsResponse| -> Vec<String> {
            let mut v: Vec<_> = r.groups.iter().map(|g| g.group_id.to_string()).collect();
            v.sort();
            v
        };
        let r = w
            .call(
                &ListGroupsRequest::default().with_states_filter(vec![s("stable")]),
                4,
            )
            .await
            .unwrap();
        assert_eq!(only(&r), vec!["g"]);
        let r = w
            .call(
                &ListGroupsRequest::default().with_states_filter(vec![s("Empty"), s("Dead")]),
                4,
            )
            .await
            .unwrap();
        assert_eq!(only(&r), vec!["offsets-only"]);
        let r = w
            .call(
                &ListGroupsRequest::default().with_types_filter(vec![s("Classic")]),
                5,
            )
            .await
            .unwrap();
        assert_eq!(only(&r), vec!["g", "offsets-only"]);
        let r = w
            .call(
                &ListGroupsRequest::default().with_types_filter(vec![s("consumer")]),
                5,
            )
            .await
            .unwrap();
        assert!(r.groups.is_empty(), "{r:?}");

        for version in 0..=5i16 {
            let r = w
                .call(
                    &DescribeGroupsRequest::default().with_groups(vec![
                        GroupId(s("g")),
                        GroupId(s("nobody")),
                        GroupId(s("g")),
                    ]),
                    version,
                )
                .await
                .unwrap();
            // Each mention answered, in order.
            let ids: Vec<_> = r.groups.iter().map(|g| g.group_id.to_string()).collect();
            assert_eq!(ids, ["g", "nobody", "g"], "version {version}");
            let g = &r.groups[0];
            assert_eq!(g, &r.groups[2]);
            assert_eq!(
                (
                    g.error_code,
                    g.group_state.as_str(),
                    g.protocol_type.as_str(),
                    g.protocol_data.as_str()
                ),
                (0, "Stable", "consumer", "roundrobin")
            );
            let mut members: Vec<_> = g
                .members
                .iter()
                .map(|m| {
                    (
                        m.member_id.to_string(),
                        m.client_id.to_string(),
                        m.client_host.to_string(),
                        m.member_metadata.clone(),
                        m.member_assignment.is_empty(),
                    )
                })
                .collect();
            members.sort();
            let mut want = vec![
                (
                    leader.id.clone(),
                    "wire".to_string(),
                    "/127.0.0.1".to_string(),
                    bytes::Bytes::from_static(b"meta"),
                    false,
                ),
                (
                    follower.id.clone(),
                    "wire".into(),
                    "/127.0.0.1".into(),
                    bytes::Bytes::from_static(b"meta"),
                    false,
                ),
            ];
            want.sort();
            assert_eq!(members, want, "version {version}");
            // A group not held: Dead, no error (before version 6).
            let dead = &r.groups[1];
            assert_eq!(
                (
                    dead.error_code,
                    dead.group_state.as_str(),
                    dead.members.len()
                ),
                (0, "Dead", 0)
            );
        }
        // Out of Stable: members are listed without metadata or
        // assignment, and with no protocol.
        let mut third = GroupMember::connect(b.addr).await.unwrap();
        let joining = tokio::spawn(async move {
            let _ = third.join("g", SESSION).await;
            third
        });
        let described = loop {
            let r = w
                .call(
                    &DescribeGroupsRequest::default().with_groups(vec![GroupId(s("g"))]),
                    5,
                )
                .await
                .unwrap();
            if r.groups[0].group_state.as_str() != "Stable" {
                break r;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        let g = &described.groups[0];
        assert_eq!(g.group_state.as_str(), "PreparingRebalance");
        assert_eq!(g.protocol_data.as_str(), "");
        assert!(g.members.len() >= 2, "{g:?}");
        assert!(
            g.members
                .iter()
                .all(|m| m.member_metadata.is_empty() && m.member_assignment.is_empty()),
            "{g:?}"
        );
        drop((leader, follower));
        joining.abort();
        b.shutdown().await;
    })
    .await;
}

/// What the answers carry is charged before they are built: a description
/// repeating a group with large metadata, a list of many groups, a creation
/// of many topics, each with no room in a small budget, are refused
/// (Kafka's retriable error for the group requests; the connection closed,
/// and nothing created, for the creation), and the budget is whole after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_are_charged_before_they_are_built() {
    bounded(async {
        let b = start(Config {
            topics: vec!["t".into()],
            memory_budget: 6 << 20,
            max_request_bytes: 2 << 20,
            max_decoded_bytes: 3 << 20,
            ..Config::default()
        })
        .await;
        let budget = b.broker.budget.in_use();
        // One member whose metadata takes 200 KB; the group described 40
        // times in one request of about 100 bytes asks for 8 MB.
        let mut w = Wire::connect(b.addr).await.unwrap();
        let big = bytes::Bytes::from(vec![7u8; 200_000]);
        let mut joined = None;
        let mut member = StrBytes::default();
        for _ in 0..2 {
            let r = w.call(&join("big", &member, big.clone()), 5).await.unwrap();
            member = r.member_id.clone();
            joined = Some(r);
        }
        let joined = joined.unwrap();
        assert_eq!(joined.error_code, 0);
        let r = w
            .call(
                &SyncGroupRequest::default()
                    .with_group_id(GroupId(s("big")))
                    .with_generation_id(joined.generation_id)
                    .with_member_id(member.clone())
                    .with_assignments(vec![
                        sync_group_request::SyncGroupRequestAssignment::default()
                            .with_member_id(member.clone())
                            .with_assignment(bytes::Bytes::from_static(b"a")),
                    ]),
                3,
            )
            .await
            .unwrap();
        assert_eq!(r.error_code, 0);
        let many = DescribeGroupsRequest::default().with_groups(vec![GroupId(s("big")); 40]);
        let r = w.call(&many, 5).await.unwrap();
        assert_eq!(r.groups.len(), 40);
        assert!(
            r.groups.iter().all(|g| g.error_code
                == ResponseError::CoordinatorLoadInProgress.code()
                && g.members.is_empty()),
            "refused, each mention"
        );
        // 80,000 mentions of a group not held, in a frame of 240 KB: not
        // even the refusal's entries fit, and the connection is closed
        // (costed once per group named, so at once).
        let mut many_small = Wire::connect(b.addr).await.unwrap();
        let r = many_small
            .call(
                &DescribeGroupsRequest::default().with_groups(vec![GroupId(s("x")); 80_000]),
                0,
            )
            .await;
        assert!(r.is_err(), "answered: {:?}", r.map(|r| r.groups.len()));
        // Described once, it fits, with the metadata.
        let one = DescribeGroupsRequest::default().with_groups(vec![GroupId(s("big"))]);
        let r = w.call(&one, 5).await.unwrap();
        assert_eq!(r.groups[0].error_code, 0);
        assert_eq!(r.groups[0].members[0].member_metadata, big);

        // Many groups of long ids (offsets only), listed: 300 groups of 30
        // KB ids ask for about 18 MB.
        for i in 0..300 {
            let id = format!("{i:0>30000}");
            let r = w.call(&commit(&id, 0), 2).await.unwrap();
            assert_eq!(r.topics[0].partitions[0].error_code, 0);
        }
        let r = w.call(&ListGroupsRequest::default(), 3).await.unwrap();
        assert_eq!(
            r.error_code,
            ResponseError::CoordinatorLoadInProgress.code()
        );
        assert!(r.groups.is_empty());
        // Filtered down to what fits, it is answered.
        let r = w
            .call(
                &ListGroupsRequest::default().with_states_filter(vec![s("Stable")]),
                4,
            )
            .await
            .unwrap();
        assert_eq!(r.error_code, 0);
        assert_eq!(r.groups.len(), 1);

        // 8,000 topics of 200-character names in one request of 1.7 MB: its
        // answer (with a message per refusal) asks for more than is free;
        // the connection is closed and nothing is created.
        let names: Vec<CreatableTopic> = (0..8000)
            .map(|i| topic(&format!("{i:0>200}"), 1, 0))
            .collect();
        let mut c = Wire::connect(b.addr).await.unwrap();
        let refused = c.call(&create(names, false), 5).await;
        assert!(
            refused.is_err(),
            "answered: {:?}",
            refused.map(|r| r.topics.len())
        );
        // Closed by the answer's charge, not refused by the walk or the
        // frame's limits before it.
        let refusals = b
            .broker
            .stats
            .connections_refused
            .load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(refusals, 0);
        let mut w2 = Wire::connect(b.addr).await.unwrap();
        assert_eq!(listed(&mut w2).await, vec![("t".into(), 4)]);
        drop(w);
        drop(c);
        drop(w2);
        let until = tokio::time::Instant::now() + Duration::from_secs(5);
        while b.broker.budget.in_use() != budget && tokio::time::Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(
            b.broker.budget.in_use(),
            budget,
            "the budget is whole again"
        );
        b.shutdown().await;
    })
    .await;
}

fn commit(group: &str, partition: i32) -> OffsetCommitRequest {
    OffsetCommitRequest::default()
        .with_group_id(GroupId(s(group)))
        .with_generation_id_or_member_epoch(-1)
        .with_topics(vec![
            offset_commit_request::OffsetCommitRequestTopic::default()
                .with_name(TopicName(s("t")))
                .with_partitions(vec![
                    offset_commit_request::OffsetCommitRequestPartition::default()
                        .with_partition_index(partition)
                        .with_committed_offset(5),
                ]),
        ])
}

fn delete(groups: &[&str]) -> DeleteGroupsRequest {
    DeleteGroupsRequest::default().with_groups_names(groups.iter().map(|g| GroupId(s(g))).collect())
}

fn deleted(r: &DeleteGroupsResponse) -> Vec<(String, i16)> {
    r.results
        .iter()
        .map(|g| (g.group_id.to_string(), g.error_code))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_groups_as_kafka_does_and_gives_their_room_back() {
    bounded(async {
        let b = start(Config {
            topics: vec!["t".into()],
            groups: broker::groups::GroupLimits {
                max_offsets: 3,
                ..Default::default()
            },
            ..Config::default()
        })
        .await;
        let mut w = Wire::connect(b.addr).await.unwrap();
        let commit_code = |r: OffsetCommitResponse| r.topics[0].partitions[0].error_code;
        // Three offsets fill the store: a fourth, elsewhere, is refused.
        for p in 0..2 {
            assert_eq!(commit_code(w.call(&commit("old", p), 2).await.unwrap()), 0);
        }
        // The empty id is a group like any other for DeleteGroups (Kafka
        // keeps it so), and commits to it are stored.
        assert_eq!(commit_code(w.call(&commit("", 0), 2).await.unwrap()), 0);
        assert_eq!(
            commit_code(w.call(&commit("new", 0), 2).await.unwrap()),
            ResponseError::InvalidCommitOffsetSize.code()
        );
        let (leader, follower) = stable_pair(&b, "busy").await;
        // A member id handed out and not joined yet (the two-step join).
        let pending = w
            .call(&join("pending", "", bytes::Bytes::from_static(b"m")), 5)
            .await
            .unwrap();
        assert_eq!(pending.error_code, ResponseError::MemberIdRequired.code());
        for version in 0..=2i16 {
            let r = w
                .call(
                    &delete(&["old", "busy", "nobody", "", "old", "pending"]),
                    version,
                )
                .await
                .unwrap();
            let (gone, again) = if version == 0 {
                (0, 0)
            } else {
                let nf = ResponseError::GroupIdNotFound.code();
                (nf, nf)
            };
            assert_eq!(
                deleted(&r),
                vec![
                    ("old".to_string(), gone),
                    ("busy".into(), ResponseError::NonEmptyGroup.code()),
                    ("nobody".into(), ResponseError::GroupIdNotFound.code()),
                    ("".into(), gone),
                    ("pending".into(), again),
                ],
                "version {version}"
            );
        }
        // The offsets went with the group, and their room with them.
        let fetched = w
            .call(
                &OffsetFetchRequest::default()
                    .with_group_id(GroupId(s("old")))
                    .with_topics(Some(vec![
                        offset_fetch_request::OffsetFetchRequestTopic::default()
                            .with_name(TopicName(s("t")))
                            .with_partition_indexes(vec![0, 1]),
                    ])),
                2,
            )
            .await
            .unwrap();
        assert!(
            fetched.topics[0]
                .partitions
                .iter()
                .all(|p| p.committed_offset == -1),
            "{fetched:?}"
        );
        assert_eq!(commit_code(w.call(&commit("new", 0), 2).await.unwrap()), 0);
        // The member id handed out went too.
        let late = w
            .call(
                &join(
                    "pending",
                    &pending.member_id,
                    bytes::Bytes::from_static(b"m"),
                ),
                5,
            )
            .await
            .unwrap();
        assert_eq!(late.error_code, ResponseError::UnknownMemberId.code());
        let listed = w.call(&ListGroupsRequest::default(), 3).await.unwrap();
        let mut ids: Vec<_> = listed
            .groups
            .iter()
            .map(|g| g.group_id.to_string())
            .collect();
        ids.sort();
        assert_eq!(ids, ["busy", "new"]);
        drop((leader, follower));
        b.shutdown().await;
    })
    .await;
}

/// Kafka keeps a member's client id and address from its first join
/// (`MemberMetadata`'s are not changed after): the member joining again
/// from another client is still shown as the first. And the address is
/// printed as Java prints it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_is_shown_with_its_first_client_id() {
    bounded(async {
        let b = start(Config {
            topics: vec!["t".into()],
            ..Config::default()
        })
        .await;
        let mut first = Wire::connect_as(b.addr, "first").await.unwrap();
        let mut r = first
            .call(&join("g", "", bytes::Bytes::from_static(b"m")), 5)
            .await
            .unwrap();
        if r.error_code == ResponseError::MemberIdRequired.code() {
            let id = r.member_id.to_string();
            r = first
                .call(&join("g", &id, bytes::Bytes::from_static(b"m")), 5)
                .await
                .unwrap();
        }
        assert_eq!(r.error_code, 0);
        let id = r.member_id.to_string();
        // Again, from another client, with other metadata (a new round).
        let mut second = Wire::connect_as(b.addr, "second").await.unwrap();
        let again = second
            .call(&join("g", &id, bytes::Bytes::from_static(b"other")), 5)
            .await
            .unwrap();
        assert_eq!(again.error_code, 0);
        let d = second
            .call(
                &DescribeGroupsRequest::default().with_groups(vec![GroupId(s("g"))]),
                5,
            )
            .await
            .unwrap();
        assert_eq!(d.groups[0].members.len(), 1);
        assert_eq!(d.groups[0].members[0].client_id.as_str(), "first");
        assert_eq!(d.groups[0].members[0].client_host.as_str(), "/127.0.0.1");
        b.shutdown().await;
    })
    .await;
}

#[test]
fn client_addresses_are_printed_as_java_prints_them() {
    use broker::server::java_host;
    let ip = |s: &str| s.parse::<std::net::IpAddr>().unwrap();
    assert_eq!(java_host(ip("127.0.0.1")), "/127.0.0.1");
    // An IPv4 client of a socket listening on IPv6.
    assert_eq!(java_host(ip("::ffff:10.1.2.3")), "/10.1.2.3");
    assert_eq!(java_host(ip("::1")), "/0:0:0:0:0:0:0:1");
    assert_eq!(java_host(ip("fe80::1:abcd")), "/fe80:0:0:0:0:0:1:abcd");
}

/// Kafka refuses a topic whose name differs from an existing one's only in
/// '.' against '_' (`Topic.hasCollision`: their metrics' names would be
/// the same), by request and on first use; the existing name is still told
/// it exists.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_that_collide_are_refused() {
    bounded(async {
        let b = start(Config::default()).await;
        let mut w = Wire::connect(b.addr).await.unwrap();
        let r = w
            .call(&create(vec![topic("a.b_c", 1, -1)], false), 5)
            .await
            .unwrap();
        assert_eq!(codes(&r), vec![("a.b_c".to_string(), 0)]);
        for other in ["a_b_c", "a.b.c", "a_b.c"] {
            let r = w
                .call(&create(vec![topic(other, 1, -1)], false), 5)
                .await
                .unwrap();
            assert_eq!(
                codes(&r),
                vec![(
                    other.to_string(),
                    ResponseError::InvalidTopicException.code()
                )]
            );
            let m = r.topics[0].error_message.as_deref().unwrap();
            assert!(m.contains("collides with existing topic: a.b_c"), "{m}");
        }
        let r = w
            .call(
                &create(vec![topic("a.b_c", 1, -1), topic("ab_c", 1, -1)], false),
                5,
            )
            .await
            .unwrap();
        assert_eq!(
            codes(&r),
            vec![
                (
                    "a.b_c".to_string(),
                    ResponseError::TopicAlreadyExists.code()
                ),
                ("ab_c".to_string(), 0)
            ]
        );
        // Not made on first use either.
        let r = w
            .call(
                &MetadataRequest::default()
                    .with_topics(Some(vec![metadata_request::MetadataRequestTopic::default(
                    )
                    .with_name(Some(TopicName(s("a_b_c"))))]))
                    .with_allow_auto_topic_creation(true),
                9,
            )
            .await
            .unwrap();
        assert_eq!(
            r.topics[0].error_code,
            ResponseError::UnknownTopicOrPartition.code()
        );
        let all = listed(&mut w).await;
        assert_eq!(all, vec![("a.b_c".to_string(), 1), ("ab_c".to_string(), 1)]);
        b.shutdown().await;
    })
    .await;
}
