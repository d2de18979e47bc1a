//! The broker example's group coordinator against Kafka's behaviour and a
//! hostile client, over real sockets (real time, every test bounded): members
//! that die mid-rebalance, rounds whose joins hung up, commits in each phase
//! and to partitions that do not exist, answers and kept state charged to
//! their bounds, and Kafka's error codes where the coordinator used to
//! differ.

#[path = "../examples/kafka_broker/broker/mod.rs"]
#[allow(dead_code)]
mod broker;
#[path = "../examples/kafka_broker/wire.rs"]
#[allow(dead_code)]
mod wire;

use std::alloc::{GlobalAlloc, Layout, System};
use std::future::Future;
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::Duration;

use broker::groups::GroupLimits;
use broker::{BrokerHandle, Config};
use bytes::Bytes;
use kafka_protocol::error::ResponseError;
use kafka_protocol::messages::join_group_request::JoinGroupRequestProtocol;
use kafka_protocol::messages::leave_group_request::MemberIdentity;
use kafka_protocol::messages::offset_commit_request::{
    OffsetCommitRequestPartition, OffsetCommitRequestTopic,
};
use kafka_protocol::messages::offset_fetch_request::OffsetFetchRequestTopic;
use kafka_protocol::messages::sync_group_request::SyncGroupRequestAssignment;
use kafka_protocol::messages::*;
use kafka_protocol::protocol::StrBytes;
use tokio::time::Instant;
use wire::Wire;

// ---- a process-wide heap counter with a peak ----------------------------

struct Peak;
static LIVE: AtomicIsize = AtomicIsize::new(0);
static PEAK: AtomicIsize = AtomicIsize::new(0);

fn grow(n: isize) {
    let now = LIVE.fetch_add(n, Ordering::Relaxed) + n;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

unsafe impl GlobalAlloc for Peak {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        grow(l.size() as isize);
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        grow(-(l.size() as isize));
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        grow(new as isize - l.size() as isize);
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static GLOBAL: Peak = Peak;

fn live() -> isize {
    LIVE.load(Ordering::SeqCst)
}
fn reset_peak() -> isize {
    let l = live();
    PEAK.store(l, Ordering::SeqCst);
    l
}
fn peak() -> isize {
    PEAK.load(Ordering::SeqCst)
}

/// One test at a time (heap measured process-wide, timings).
static ONE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn bounded<F: Future>(f: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(40), f)
        .await
        .expect("the test finished in time")
}

fn s(v: &str) -> StrBytes {
    StrBytes::from_string(v.to_string())
}

const T: &str = "t";

async fn start(mut config: Config) -> BrokerHandle {
    config.listen = "127.0.0.1:0".parse().unwrap();
    BrokerHandle::start(config)
        .await
        .expect("the broker starts")
}

fn quick() -> Config {
    Config {
        topics: vec![T.into()],
        groups: GroupLimits {
            min_session: Duration::from_millis(50),
            ..Default::default()
        },
        ..Config::default()
    }
}

fn code(e: ResponseError) -> i16 {
    e.code()
}

// ---- a raw group client ---------------------------------------------------

struct M {
    w: Wire,
    id: String,
    gen: i32,
    leader: bool,
    members: Vec<String>,
    session: i32,
    rebalance: i32,
    protocols: Vec<(String, Bytes)>,
}

impl M {
    async fn new(b: &BrokerHandle) -> M {
        M {
            w: Wire::connect(b.addr).await.unwrap(),
            id: String::new(),
            gen: -1,
            leader: false,
            members: vec![],
            session: 300,
            rebalance: 300,
            protocols: vec![("range".into(), Bytes::from_static(b"meta"))],
        }
    }

    fn join_req(&self, group: &str) -> JoinGroupRequest {
        JoinGroupRequest::default()
            .with_group_id(GroupId(s(group)))
            .with_session_timeout_ms(self.session)
            .with_rebalance_timeout_ms(self.rebalance)
            .with_member_id(s(&self.id))
            .with_protocol_type(s("consumer"))
            .with_protocols(
                self.protocols
                    .iter()
                    .map(|(n, m)| {
                        JoinGroupRequestProtocol::default()
                            .with_name(s(n))
                            .with_metadata(m.clone())
                    })
                    .collect(),
            )
    }

    /// One JoinGroup at `v`; records what it learnt; the raw answer.
    async fn join_once(&mut self, group: &str, v: i16) -> JoinGroupResponse {
        let r = self.w.call(&self.join_req(group), v).await.unwrap();
        if !r.member_id.is_empty() {
            self.id = r.member_id.to_string();
        }
        if r.error_code == 0 {
            self.gen = r.generation_id;
            self.leader = r.leader == r.member_id;
            self.members = r.members.iter().map(|m| m.member_id.to_string()).collect();
        }
        r
    }

    /// Join (both steps at v5).
    async fn join(&mut self, group: &str) -> i16 {
        loop {
            let r = self.join_once(group, 5).await;
            if r.error_code == code(ResponseError::MemberIdRequired) {
                continue;
            }
            return r.error_code;
        }
    }

    async fn sync_v(&mut self, group: &str, v: i16, name: Option<&str>) -> SyncGroupResponse {
        let mut assignments = vec![];
        if self.leader {
            for m in &self.members {
                assignments.push(
                    SyncGroupRequestAssignment::default()
                        .with_member_id(s(m))
                        .with_assignment(Bytes::from(m.clone().into_bytes())),
                );
            }
        }
        let mut req = SyncGroupRequest::default()
            .with_group_id(GroupId(s(group)))
            .with_generation_id(self.gen)
            .with_member_id(s(&self.id))
            .with_assignments(assignments);
        if v >= 5 {
            req = req
                .with_protocol_type(Some(s("consumer")))
                .with_protocol_name(name.map(s));
        }
        self.w.call(&req, v).await.unwrap()
    }

    async fn sync(&mut self, group: &str) -> i16 {
        self.sync_v(group, 3, None).await.error_code
    }

    async fn heartbeat(&mut self, group: &str) -> i16 {
        self.w
            .call(
                &HeartbeatRequest::default()
                    .with_group_id(GroupId(s(group)))
                    .with_generation_id(self.gen)
                    .with_member_id(s(&self.id)),
                3,
            )
            .await
            .unwrap()
            .error_code
    }

    async fn commit(&mut self, group: &str, topic: &str, offs: &[(i32, i64)]) -> Vec<i16> {
        let r = self
            .w
            .call(&commit_req(group, self.gen, &self.id, topic, offs), 7)
            .await
            .unwrap();
        r.topics[0]
            .partitions
            .iter()
            .map(|p| p.error_code)
            .collect()
    }
}

fn commit_req(
    group: &str,
    gen: i32,
    id: &str,
    topic: &str,
    offs: &[(i32, i64)],
) -> OffsetCommitRequest {
    OffsetCommitRequest::default()
        .with_group_id(GroupId(s(group)))
        .with_generation_id_or_member_epoch(gen)
        .with_member_id(s(id))
        .with_topics(vec![OffsetCommitRequestTopic::default()
            .with_name(TopicName(s(topic)))
            .with_partitions(
                offs.iter()
                    .map(|&(p, o)| {
                        OffsetCommitRequestPartition::default()
                            .with_partition_index(p)
                            .with_committed_offset(o)
                    })
                    .collect(),
            )])
}

/// Polls on the wall clock for up to `secs`.
async fn until(secs: u64, what: &str, cond: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !cond() {
        assert!(Instant::now() < deadline, "waited too long until {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Waits (up to 10 s) until the live heap holds still: the same at four
/// looks 5 ms apart (tasks ended, frames and answers dropped).
async fn heap_settled() {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut last = live();
    let mut same = 0;
    while same < 3 {
        assert!(
            Instant::now() < deadline,
            "waited too long for the heap to settle"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
        let now = live();
        same = if now == last { same + 1 } else { 0 };
        last = now;
    }
}

/// A stable group of one: `a` joined (leader) and synced.
async fn stable_alone(b: &BrokerHandle, g: &str) -> M {
    let mut a = M::new(b).await;
    assert_eq!(a.join(g).await, 0);
    assert!(a.leader);
    assert_eq!(a.sync(g).await, 0);
    a
}

// ===========================================================================
// Faults the coordinator had, each as found
// ===========================================================================

/// A leader that never sends SyncGroup (it crashed after its JoinGroup
/// answer) is expired by its session timeout, as Kafka does (Kafka's
/// `MemberMetadata.hasSatisfiedHeartbeat`: only a member whose join or sync is
/// parked is exempt; in CompletingRebalance the leader must sync or
/// heartbeat). Every member of a CompletingRebalance group used to be kept
/// alive for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_that_never_syncs_is_expired() {
    let _one = ONE.lock().await;
    bounded(async {
        let b = start(quick()).await;
        let mut a = M::new(&b).await;
        a.session = 100;
        a.rebalance = 100;
        assert_eq!(a.join("g").await, 0);
        assert!(a.leader);
        // Never syncs, never heartbeats, connection gone; ten session
        // timeouts later:
        drop(a);
        // Polled, at most 10 s (100 session timeouts).
        let t = Instant::now();
        let members = loop {
            let (_, members) = b.broker.groups.describe("g").unwrap_or_default();
            if members.is_empty() || t.elapsed() > Duration::from_secs(10) {
                break members;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        assert!(
            members.is_empty(),
            "a dead leader still holds the group after 100 session timeouts: {members:?}"
        );
        b.shutdown().await;
    })
    .await
}

/// The same, with a live follower, which used to be stuck for ever (its
/// parked syncs timed out with REBALANCE_IN_PROGRESS, its rejoins got the
/// same generation back with the dead leader). As in Kafka, the leader
/// expires after its session timeout, the follower's parked sync answers
/// REBALANCE_IN_PROGRESS and its rejoin makes it the leader of the next
/// generation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_gets_past_a_dead_leader() {
    let _one = ONE.lock().await;
    bounded(async {
        let b = start(quick()).await;
        let mut a = stable_alone(&b, "g").await; // leader, generation 1
        let mut f = M::new(&b).await;
        let fj = tokio::spawn(async move {
            let c = f.join("g").await;
            (f, c)
        });
        until(5, "F's join parked", || b.broker.groups.joins.delayed() == 1).await;
        assert_eq!(a.join("g").await, 0); // generation 2, A leads
        assert!(a.leader);
        let (mut f, c) = fj.await.unwrap();
        assert_eq!(c, 0);
        drop(a); // the leader dies before its SyncGroup
        let t = Instant::now();
        let mut gen_leader = None;
        while t.elapsed() < Duration::from_secs(3) {
            let code = f.sync("g").await;
            if code == 0 {
                break;
            }
            assert_eq!(code, code_of(ResponseError::RebalanceInProgress));
            assert_eq!(f.join("g").await, 0);
            if f.leader {
                gen_leader = Some(f.gen);
                break;
            }
        }
        assert!(
            gen_leader.is_some(),
            "after 3 s (10 session timeouts) the follower is still behind the dead leader (generation {})",
            f.gen
        );
        b.shutdown().await;
    })
    .await
}

fn code_of(e: ResponseError) -> i16 {
    e.code()
}

/// Kafka ends a rebalance at the rebalance timeout whether or not the joins
/// that wait for it are still connected (its DelayedJoin belongs to the group,
/// not to a request): members that did not rejoin are removed. The round used
/// to end only when a parked join's own timeout fired; when every parked
/// join's connection dropped, it never ended, and a member that kept
/// heartbeating without rejoining (a consumer stuck in processing, the case
/// `max.poll.interval.ms` exists for) held the group in PreparingRebalance
/// for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rebalance_timeout_holds_when_the_joins_hang_up() {
    let _one = ONE.lock().await;
    bounded(async {
        let b = start(quick()).await;
        let mut a = stable_alone(&b, "g").await; // rebalance timeout 300 ms
        let mut n = M::new(&b).await;
        n.session = 60_000;
        let req = n.join_req("g");
        n.w.send(&req, 3).await.unwrap(); // v3: no two-step; parks
        until(5, "N's join parked", || {
            b.broker.groups.joins.delayed() == 1
        })
        .await;
        drop(n); // hangs up: its join is cancelled
        until(5, "cancelled", || b.broker.groups.joins.delayed() == 0).await;
        // A heartbeats (every 100 ms) but never rejoins, for 5x the
        // rebalance timeout: in Kafka A is out after 300 ms.
        let t = Instant::now();
        let mut last = 0;
        while t.elapsed() < Duration::from_millis(1500) {
            last = a.heartbeat("g").await;
            if last == code_of(ResponseError::UnknownMemberId) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(
            last,
            code_of(ResponseError::UnknownMemberId),
            "the round never ended: A still told {last} after 5 rebalance timeouts"
        );
        b.shutdown().await;
    })
    .await
}

/// Kafka's `doCommitOffsets`: in PreparingRebalance a member of the current
/// generation may commit (consumers commit in `onPartitionsRevoked`, before
/// rejoining); in CompletingRebalance commits answer REBALANCE_IN_PROGRESS.
/// It used to be the other way round.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commits_during_a_rebalance_as_kafka() {
    let _one = ONE.lock().await;
    bounded(async {
        let b = start(quick()).await;
        let mut a = stable_alone(&b, "g").await;
        a.session = 10_000;
        let mut n = M::new(&b).await;
        n.session = 10_000;
        let nj = tokio::spawn(async move {
            let c = n.join("g").await;
            (n, c)
        });
        until(5, "N's join parked", || {
            b.broker.groups.joins.delayed() == 1
        })
        .await;
        // PreparingRebalance, A still in generation 1: Kafka stores it.
        let preparing = a.commit("g", T, &[(0, 5)]).await;
        assert_eq!(a.join("g").await, 0);
        let (mut n, _) = nj.await.unwrap();
        // CompletingRebalance, generation 2, nobody synced: Kafka refuses.
        let completing = n.commit("g", T, &[(1, 7)]).await;
        assert_eq!(
            (preparing[0], completing[0]),
            (0, code_of(ResponseError::RebalanceInProgress)),
            "Kafka: (0, 27) — commit in PreparingRebalance stored, in CompletingRebalance refused"
        );
        b.shutdown().await;
    })
    .await
}

/// Kafka (KafkaApis.handleOffsetCommitRequest) answers UNKNOWN_TOPIC_OR_PARTITION
/// for a commit to a topic or partition that does not exist, and stores
/// nothing for it. Anything used to be stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commits_to_unknown_topics_and_partitions_are_refused() {
    let _one = ONE.lock().await;
    bounded(async {
        let b = start(Config {
            auto_create_topics: false,
            ..quick()
        })
        .await;
        let mut w = Wire::connect(b.addr).await.unwrap();
        let r = w
            .call(&commit_req("g", -1, "", "no-such-topic", &[(0, 1)]), 7)
            .await
            .unwrap();
        let unknown_topic = r.topics[0].partitions[0].error_code;
        let r = w
            .call(&commit_req("g", -1, "", T, &[(99, 1), (-1, 1)]), 7)
            .await
            .unwrap();
        let bad_parts: Vec<i16> = r.topics[0]
            .partitions
            .iter()
            .map(|p| p.error_code)
            .collect();
        let utp = code_of(ResponseError::UnknownTopicOrPartition);
        assert_eq!(
            (unknown_topic, bad_parts),
            (utp, vec![utp, utp]),
            "Kafka answers UNKNOWN_TOPIC_OR_PARTITION (3)"
        );
        b.shutdown().await;
    })
    .await
}

/// One client's commits to made-up partitions in its own "simple" group
/// used to fill the global offset store (100,000 offsets, never expired), and
/// every group's commits were refused from then on; as in Kafka, they are
/// answered UNKNOWN_TOPIC_OR_PARTITION and nothing is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn made_up_partitions_cannot_fill_the_offset_store() {
    let _one = ONE.lock().await;
    bounded(async {
        let b = start(quick()).await;
        let mut evil = Wire::connect(b.addr).await.unwrap();
        for chunk in 0..10 {
            let offs: Vec<(i32, i64)> = (0..10_000).map(|i| (chunk * 10_000 + i, 0)).collect();
            evil.call(&commit_req("evil", -1, "", "made-up", &offs), 7)
                .await
                .unwrap();
        }
        let mut a = stable_alone(&b, "victim").await;
        assert_eq!(
            a.commit("victim", T, &[(0, 42)]).await,
            [0],
            "a legitimate consumer's commit is refused once another client filled the store"
        );
        b.shutdown().await;
    })
    .await
}

/// OffsetFetch answers each partition named with its committed metadata (up
/// to 4 KiB), as often as it is named: a 64 KiB request naming one partition
/// 16,000 times asks for a ~64 MiB answer, which used to be built outside the
/// memory budget (at the decoded cap, 4M indexes, a 16 GiB answer: the
/// allocation failed and the process aborted). The answer is charged to the
/// budget first, and one with no room is COORDINATOR_LOAD_IN_PROGRESS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_offset_fetch_answer_is_charged_to_the_budget() {
    let _one = ONE.lock().await;
    bounded(async {
        let budget = 20 << 20;
        let b = start(Config {
            max_request_bytes: 4 << 20,
            max_decoded_bytes: 4 << 20,
            memory_budget: budget,
            ..quick()
        })
        .await;
        let mut w = Wire::connect(b.addr).await.unwrap();
        let mut c = commit_req("g", -1, "", T, &[(0, 1)]);
        c.topics[0].partitions[0].committed_metadata = Some(s(&"m".repeat(4096)));
        let r = w.call(&c, 7).await.unwrap();
        assert_eq!(r.topics[0].partitions[0].error_code, 0);
        let n = 16_000;
        let req = OffsetFetchRequest::default()
            .with_group_id(GroupId(s("g")))
            .with_topics(Some(vec![OffsetFetchRequestTopic::default()
                .with_name(TopicName(s(T)))
                .with_partition_indexes(vec![0; n])]));
        let mut raw = tokio::net::TcpStream::connect(b.addr).await.unwrap();
        let mut frame = bytes::BytesMut::new();
        {
            use bytes::BufMut;
            use kafka_protocol::protocol::{Encodable, HeaderVersion, Request};
            frame.put_i32(0);
            RequestHeader::default()
                .with_request_api_key(OffsetFetchRequest::KEY)
                .with_request_api_version(6)
                .with_correlation_id(1)
                .encode(&mut frame, OffsetFetchRequest::header_version(6))
                .unwrap();
            req.encode(&mut frame, 6).unwrap();
            let n = (frame.len() - 4) as i32;
            frame[..4].copy_from_slice(&n.to_be_bytes());
        }
        drop(req);
        let sent = frame.len();
        let before = reset_peak();
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        raw.write_all(&frame).await.unwrap();
        // Read the answer and throw it away, 64 KiB at a time.
        let size = raw.read_i32().await.unwrap() as usize;
        let mut buf = vec![0u8; 64 << 10];
        let mut left = size;
        while left > 0 {
            let k = raw.read(&mut buf[..left.min(64 << 10)]).await.unwrap();
            assert!(k > 0);
            left -= k;
        }
        let grown = peak() - before;
        drop(w);
        assert!(
            grown < budget as isize,
            "a {}-byte OffsetFetch (a {size}-byte answer) made the broker allocate {} MiB (budget {} MiB)",
            sent,
            grown >> 20,
            budget >> 20
        );
        b.shutdown().await;
    })
    .await
}

/// JoinGroup protocol metadata is kept for the member's life: it used to be
/// charged to no bound (ten joins of 7 MiB held 70 MiB on a broker whose
/// memory budget is 10 MiB). What members' protocols keep is bounded across
/// groups (`max_kept_bytes`): a join past it is COORDINATOR_LOAD_IN_PROGRESS
/// (clients retry), and a member that leaves gives its room back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn join_metadata_is_kept_within_its_bound() {
    let _one = ONE.lock().await;
    bounded(async {
        let bound = 24 << 20;
        let b = start(Config {
            max_request_bytes: 8 << 20,
            max_decoded_bytes: 1 << 20,
            memory_budget: 10 << 20,
            groups: GroupLimits {
                max_kept_bytes: bound,
                ..quick().groups
            },
            ..quick()
        })
        .await;
        let before = live();
        let big = Bytes::from(vec![7u8; 7 << 20]);
        let mut members = Vec::new();
        let mut codes = Vec::new();
        for i in 0..5 {
            let mut m = M::new(&b).await;
            m.session = 30_000;
            m.protocols = vec![("range".into(), big.clone())];
            // v3: no two-step; alone in its group, answered at once.
            codes.push(m.join_once(&format!("g{i}"), 3).await.error_code);
            members.push(m);
        }
        let busy = code(ResponseError::CoordinatorLoadInProgress);
        assert_eq!(codes, [0, 0, 0, busy, busy], "three fit in 24 MiB");
        drop(big);
        heap_settled().await;
        let grown = live() - before;
        assert!(
            grown < (bound + (8 << 20)) as isize,
            "members hold {} MiB with a {} MiB bound",
            grown >> 20,
            bound >> 20
        );
        // The first leaves: its room is free for a retry.
        let mut first = members.remove(0);
        let leave = LeaveGroupRequest::default()
            .with_group_id(GroupId(s("g0")))
            .with_members(vec![MemberIdentity::default().with_member_id(s(&first.id))]);
        let r = first.w.call(&leave, 3).await.unwrap();
        assert_eq!(r.members[0].error_code, 0);
        let mut again = M::new(&b).await;
        again.session = 30_000;
        again.protocols = vec![("range".into(), Bytes::from(vec![7u8; 7 << 20]))];
        assert_eq!(again.join_once("g3", 3).await.error_code, 0);
        b.shutdown().await;
    })
    .await
}

/// A member naming one protocol twice counts it once: counted twice, the
/// protocol looked spoken by every member of a group of two where the other
/// member does not speak it, and could be chosen for the group (its other
/// member then got no metadata for a protocol it lacks).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_protocol_named_twice_counts_once() {
    let _one = ONE.lock().await;
    bounded(async {
        let b = start(quick()).await;
        let mut a = M::new(&b).await;
        a.session = 10_000;
        a.protocols = vec![("x".into(), Bytes::from_static(b"a"))];
        assert_eq!(a.join("g").await, 0);
        assert_eq!(a.sync("g").await, 0);
        let mut c = M::new(&b).await;
        c.session = 10_000;
        c.protocols = vec![
            ("p".into(), Bytes::from_static(b"c")),
            ("p".into(), Bytes::from_static(b"c")),
            ("x".into(), Bytes::from_static(b"c")),
        ];
        let joining = tokio::spawn(async move {
            loop {
                let r = c.join_once("g", 5).await;
                if r.error_code != code(ResponseError::MemberIdRequired) {
                    return r;
                }
            }
        });
        until(5, "C's join parked", || {
            b.broker.groups.joins.delayed() == 1
        })
        .await;
        let r = a.join_once("g", 5).await;
        let rc = joining.await.unwrap();
        for r in [&r, &rc] {
            assert_eq!(r.error_code, 0);
            assert_eq!(r.protocol_name.as_ref().map(|n| n.as_str()), Some("x"));
        }
        // Alone in a group, it gets the protocol it prefers: counted twice,
        // `p` looked spoken by two members of a group of one.
        let mut d = M::new(&b).await;
        d.session = 10_000;
        d.protocols = vec![
            ("p".into(), Bytes::from_static(b"d")),
            ("p".into(), Bytes::from_static(b"d")),
            ("x".into(), Bytes::from_static(b"d")),
        ];
        let r = loop {
            let r = d.join_once("alone", 5).await;
            if r.error_code != code(ResponseError::MemberIdRequired) {
                break r;
            }
        };
        assert_eq!(r.error_code, 0);
        assert_eq!(r.protocol_name.as_ref().map(|n| n.as_str()), Some("p"));
        b.shutdown().await;
    })
    .await
}

// ===========================================================================
// Kafka's error codes where the coordinator's used to differ
// ===========================================================================

/// Kafka's handleHeartbeat checks the generation before the state: a stale
/// generation is ILLEGAL_GENERATION (and does not reset the session) even
/// during PreparingRebalance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_heartbeat_during_a_rebalance_is_illegal_generation() {
    let _one = ONE.lock().await;
    bounded(async {
        let b = start(quick()).await;
        let mut a = stable_alone(&b, "g").await;
        a.session = 10_000;
        let mut n = M::new(&b).await;
        n.session = 10_000;
        let _nj = tokio::spawn(async move { n.join("g").await });
        until(5, "N's join parked", || {
            b.broker.groups.joins.delayed() == 1
        })
        .await;
        a.gen -= 1;
        assert_eq!(
            a.heartbeat("g").await,
            code_of(ResponseError::IllegalGeneration),
            "stale generation during PreparingRebalance"
        );
        b.shutdown().await;
    })
    .await
}

/// Kafka (old coordinator and the new one for v<=8): a commit with a
/// generation >= 0 to a group that does not exist is ILLEGAL_GENERATION.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_with_a_generation_to_an_unknown_group_is_illegal_generation() {
    let _one = ONE.lock().await;
    bounded(async {
        let b = start(quick()).await;
        let mut w = Wire::connect(b.addr).await.unwrap();
        let r = w
            .call(&commit_req("nope", 3, "someone", T, &[(0, 1)]), 7)
            .await
            .unwrap();
        assert_eq!(
            r.topics[0].partitions[0].error_code,
            code_of(ResponseError::IllegalGeneration)
        );
        b.shutdown().await;
    })
    .await
}

/// SyncGroup v5 carries the protocol type and name (KIP-559); Kafka answers
/// INCONSISTENT_GROUP_PROTOCOL when they do not match the group's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_v5_sync_naming_another_protocol_is_inconsistent() {
    let _one = ONE.lock().await;
    bounded(async {
        let b = start(quick()).await;
        let mut a = M::new(&b).await;
        assert_eq!(a.join("g").await, 0);
        let r = a.sync_v("g", 5, Some("bogus")).await;
        assert_eq!(
            r.error_code,
            code_of(ResponseError::InconsistentGroupProtocol)
        );
        b.shutdown().await;
    })
    .await
}

/// LeaveGroup v3+: Kafka answers an unknown group with top-level NONE and
/// UNKNOWN_MEMBER_ID per member; a pending (KIP-394) member leaving is NONE.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leave_v3_of_an_unknown_group_and_of_a_pending_member() {
    let _one = ONE.lock().await;
    bounded(async {
        let b = start(quick()).await;
        let mut w = Wire::connect(b.addr).await.unwrap();
        let leave = |g: &str, id: &str| {
            LeaveGroupRequest::default()
                .with_group_id(GroupId(s(g)))
                .with_members(vec![MemberIdentity::default().with_member_id(s(id))])
        };
        let r = w.call(&leave("nope", "x"), 3).await.unwrap();
        let unknown = (
            r.error_code,
            r.members.iter().map(|m| m.error_code).collect::<Vec<_>>(),
        );
        let mut p = M::new(&b).await;
        let j = p.join_once("g", 5).await;
        assert_eq!(j.error_code, code_of(ResponseError::MemberIdRequired));
        let r = w.call(&leave("g", &p.id), 3).await.unwrap();
        let pending = r.members[0].error_code;
        assert_eq!(
            (unknown, pending),
            ((0, vec![code_of(ResponseError::UnknownMemberId)]), 0)
        );
        b.shutdown().await;
    })
    .await
}

/// Kafka's `supportsProtocols`: an empty group refuses a join with an empty
/// protocol type (`!memberProtocolType.isEmpty && memberProtocols.nonEmpty`)
/// with INCONSISTENT_GROUP_PROTOCOL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_protocol_type_cannot_start_a_group() {
    let _one = ONE.lock().await;
    bounded(async {
        let b = start(quick()).await;
        let mut a = M::new(&b).await;
        let mut req = a.join_req("g");
        req.protocol_type = s("");
        let r = a.w.call(&req, 3).await.unwrap();
        assert_eq!(
            r.error_code,
            code_of(ResponseError::InconsistentGroupProtocol)
        );
        b.shutdown().await;
    })
    .await
}

// ===========================================================================
// The rest of the coordinator's contract
// ===========================================================================

/// KIP-394: v4+ empty member id gets MEMBER_ID_REQUIRED and an id; the id
/// joins; an unknown id is UNKNOWN_MEMBER_ID; v3 needs no second step; a
/// pending id is forgotten after its session timeout; made-up ids do not
/// create groups.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kip_394_two_step_join() {
    let _one = ONE.lock().await;
    bounded(async {
        let b = start(quick()).await;
        let mut p = M::new(&b).await;
        p.session = 100;
        let r = p.join_once("g", 4).await;
        assert_eq!(r.error_code, code_of(ResponseError::MemberIdRequired));
        assert!(!r.member_id.is_empty());
        assert!(b.broker.groups.describe("g").is_some());
        // Pending id expired (its session is 100 ms): the group is
        // forgotten and the id is unknown.
        until(10, "the pending id expired and the group forgotten", || {
            b.broker.groups.describe("g").is_none()
        })
        .await;
        let r = p.join_once("g", 4).await;
        assert_eq!(r.error_code, code_of(ResponseError::UnknownMemberId));
        // Made-up id.
        let mut x = M::new(&b).await;
        x.id = "made-up".into();
        let r = x.join_once("h", 7).await;
        assert_eq!(r.error_code, code_of(ResponseError::UnknownMemberId));
        assert!(b.broker.groups.describe("h").is_none());
        // v3: straight in.
        let mut y = M::new(&b).await;
        let r = y.join_once("k", 3).await;
        assert_eq!((r.error_code, r.generation_id), (0, 1));
        // v7 flexible path, two steps.
        let mut z = M::new(&b).await;
        z.session = 10_000;
        let r = z.join_once("z", 7).await;
        assert_eq!(r.error_code, code_of(ResponseError::MemberIdRequired));
        let r = z.join_once("z", 7).await;
        assert_eq!(r.error_code, 0);
        assert_eq!(r.protocol_type.as_deref(), Some("consumer"));
        b.shutdown().await;
    })
    .await
}

/// Session timeout limits, empty group id, empty protocols, group max size.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn join_refusals() {
    let _one = ONE.lock().await;
    bounded(async {
        let b = start(Config {
            groups: GroupLimits {
                min_session: Duration::from_millis(50),
                max_members: 3,
                ..Default::default()
            },
            ..quick()
        })
        .await;
        let mut m = M::new(&b).await;
        for sess in [-1, 0, 49, i32::MAX] {
            m.session = sess;
            assert_eq!(
                m.join_once("g", 5).await.error_code,
                code_of(ResponseError::InvalidSessionTimeout),
                "session {sess}"
            );
        }
        m.session = 300;
        assert_eq!(
            m.join_once("", 5).await.error_code,
            code_of(ResponseError::InvalidGroupId)
        );
        m.protocols.clear();
        assert_eq!(
            m.join_once("g", 5).await.error_code,
            code_of(ResponseError::InconsistentGroupProtocol)
        );
        assert!(b.broker.groups.describe("g").is_none());
        // Group max size counts pending ids.
        let mut codes = vec![];
        for _ in 0..4 {
            let mut n = M::new(&b).await;
            n.session = 10_000;
            codes.push(n.join_once("full", 5).await.error_code);
        }
        assert_eq!(
            codes,
            [79, 79, 79, code_of(ResponseError::GroupMaxSizeReached)]
        );
        b.shutdown().await;
    })
    .await
}

/// A leader that leaves mid-rebalance (Preparing): the joined follower
/// becomes leader of the next generation at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_leaving_mid_rebalance() {
    let _one = ONE.lock().await;
    bounded(async {
        let b = start(quick()).await;
        let mut a = stable_alone(&b, "g").await;
        a.session = 10_000;
        let mut f = M::new(&b).await;
        f.session = 10_000;
        f.rebalance = 10_000;
        let fj = tokio::spawn(async move {
            let c = f.join("g").await;
            (f, c)
        });
        until(5, "F parked", || b.broker.groups.joins.delayed() == 1).await;
        let r =
            a.w.call(
                &LeaveGroupRequest::default()
                    .with_group_id(GroupId(s("g")))
                    .with_member_id(s(&a.id)),
                1,
            )
            .await
            .unwrap();
        assert_eq!(r.error_code, 0);
        let t = Instant::now();
        let (mut f, c) = fj.await.unwrap();
        assert!(t.elapsed() < Duration::from_millis(200));
        assert_eq!(c, 0);
        assert!(f.leader);
        assert_eq!(f.gen, 2);
        assert_eq!(f.members, vec![f.id.clone()]);
        assert_eq!(f.sync("g").await, 0);
        // Leader leaves during CompletingRebalance (after join, before
        // sync): the parked follower sync answers REBALANCE_IN_PROGRESS.
        let mut g2 = M::new(&b).await;
        g2.session = 10_000;
        g2.rebalance = 5_000;
        let gj = tokio::spawn(async move {
            let c = g2.join("g").await;
            (g2, c)
        });
        until(5, "G parked", || b.broker.groups.joins.delayed() == 1).await;
        assert_eq!(f.join("g").await, 0);
        let (mut g2, c) = gj.await.unwrap();
        assert_eq!(c, 0);
        assert!(f.leader && !g2.leader);
        let gs = tokio::spawn(async move {
            let c = g2.sync("g").await;
            (g2, c)
        });
        until(5, "G's sync parked", || {
            b.broker.groups.syncs.delayed() == 1
        })
        .await;
        let r =
            f.w.call(
                &LeaveGroupRequest::default()
                    .with_group_id(GroupId(s("g")))
                    .with_member_id(s(&f.id)),
                1,
            )
            .await
            .unwrap();
        assert_eq!(r.error_code, 0);
        let (mut g2, c) = gs.await.unwrap();
        assert_eq!(c, code_of(ResponseError::RebalanceInProgress));
        assert_eq!(g2.join("g").await, 0);
        assert!(g2.leader);
        assert_eq!(g2.sync("g").await, 0);
        b.shutdown().await;
    })
    .await
}

/// Stale generation / unknown member for sync, heartbeat, commit; zero
/// members; simple commits; OffsetFetch of everything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_and_empty_groups() {
    let _one = ONE.lock().await;
    bounded(async {
        let b = start(quick()).await;
        let mut a = stable_alone(&b, "g").await;
        a.session = 10_000;
        assert_eq!(a.join("g").await, 0); // leader rejoin: generation 2
        assert_eq!(a.sync("g").await, 0);
        assert_eq!(a.gen, 2);
        a.gen = 1;
        assert_eq!(a.sync("g").await, code_of(ResponseError::IllegalGeneration));
        assert_eq!(
            a.heartbeat("g").await,
            code_of(ResponseError::IllegalGeneration)
        );
        assert_eq!(
            a.commit("g", T, &[(0, 1)]).await,
            [code_of(ResponseError::IllegalGeneration)]
        );
        a.gen = 2;
        let id = a.id.clone();
        a.id = "nobody".into();
        assert_eq!(a.sync("g").await, code_of(ResponseError::UnknownMemberId));
        assert_eq!(
            a.heartbeat("g").await,
            code_of(ResponseError::UnknownMemberId)
        );
        assert_eq!(
            a.commit("g", T, &[(0, 1)]).await,
            [code_of(ResponseError::UnknownMemberId)]
        );
        // Simple commit to a group with members: UNKNOWN_MEMBER_ID.
        let mut w = Wire::connect(b.addr).await.unwrap();
        let r = w
            .call(&commit_req("g", -1, "", T, &[(0, 1)]), 7)
            .await
            .unwrap();
        assert_eq!(
            r.topics[0].partitions[0].error_code,
            code_of(ResponseError::UnknownMemberId)
        );
        a.id = id;
        assert_eq!(a.commit("g", T, &[(2, 9)]).await, [0]);
        // Last member leaves: Empty, generation 3; simple commits allowed.
        let r =
            a.w.call(
                &LeaveGroupRequest::default()
                    .with_group_id(GroupId(s("g")))
                    .with_members(vec![MemberIdentity::default().with_member_id(s(&a.id))]),
                4,
            )
            .await
            .unwrap();
        assert_eq!((r.error_code, r.members[0].error_code), (0, 0));
        assert_eq!(b.broker.groups.describe("g").unwrap(), (3, vec![]));
        assert_eq!(
            a.heartbeat("g").await,
            code_of(ResponseError::UnknownMemberId)
        );
        let r = w
            .call(&commit_req("g", -1, "", T, &[(3, 11)]), 7)
            .await
            .unwrap();
        assert_eq!(r.topics[0].partitions[0].error_code, 0);
        let r = w
            .call(
                &OffsetFetchRequest::default()
                    .with_group_id(GroupId(s("g")))
                    .with_topics(None),
                7,
            )
            .await
            .unwrap();
        let got: Vec<(i32, i64)> = r.topics[0]
            .partitions
            .iter()
            .map(|p| (p.partition_index, p.committed_offset))
            .collect();
        assert_eq!(got, [(2, 9), (3, 11)]);
        // OffsetFetch v1 for an unknown group: -1, no error.
        let r = w
            .call(
                &OffsetFetchRequest::default()
                    .with_group_id(GroupId(s("nope")))
                    .with_topics(Some(vec![OffsetFetchRequestTopic::default()
                        .with_name(TopicName(s(T)))
                        .with_partition_indexes(vec![0])])),
                1,
            )
            .await
            .unwrap();
        assert_eq!(r.topics[0].partitions[0].committed_offset, -1);
        assert_eq!(r.topics[0].partitions[0].error_code, 0);
        assert!(b.broker.groups.describe("nope").is_none());
        // Metadata too large.
        let mut c = commit_req("g", -1, "", T, &[(0, 1)]);
        c.topics[0].partitions[0].committed_metadata = Some(s(&"x".repeat(4097)));
        let r = w.call(&c, 7).await.unwrap();
        assert_eq!(
            r.topics[0].partitions[0].error_code,
            code_of(ResponseError::OffsetMetadataTooLarge)
        );
        b.shutdown().await;
    })
    .await
}

/// A follower that never syncs (the leader did) is expired by its session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_that_never_syncs_expires() {
    let _one = ONE.lock().await;
    bounded(async {
        let b = start(quick()).await;
        let mut a = stable_alone(&b, "g").await;
        a.session = 10_000;
        let mut f = M::new(&b).await;
        f.session = 200;
        let fj = tokio::spawn(async move {
            let c = f.join("g").await;
            (f, c)
        });
        until(5, "F parked", || b.broker.groups.joins.delayed() == 1).await;
        assert_eq!(a.join("g").await, 0);
        let (f, c) = fj.await.unwrap();
        assert_eq!(c, 0);
        assert_eq!(a.sync("g").await, 0);
        drop(f);
        let t = Instant::now();
        loop {
            let code = a.heartbeat("g").await;
            if code == code_of(ResponseError::RebalanceInProgress) {
                break;
            }
            assert!(t.elapsed() < Duration::from_secs(2), "F never expired");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(a.join("g").await, 0);
        assert_eq!(a.members, vec![a.id.clone()]);
        b.shutdown().await;
    })
    .await
}

/// A follower whose sync waited for the leader's assignments and went
/// unanswered (it expired after the rebalance timeout, or its client hung
/// up) is expired by its session from then, as Kafka removes members that
/// have not synced within the rebalance timeout. It used to stay marked as
/// syncing, which kept it alive for as long as the group stayed in
/// CompletingRebalance: a leader that heartbeats but never syncs held a dead
/// follower for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_whose_sync_went_unanswered_expires() {
    let _one = ONE.lock().await;
    bounded(async {
        let b = start(quick()).await;
        for (g, hang_up) in [("expired", false), ("hung-up", true)] {
            // The leader: alive (it heartbeats), never syncs again.
            let mut a = M::new(&b).await;
            a.session = 2000;
            assert_eq!(a.join(g).await, 0);
            assert_eq!(a.sync(g).await, 0);
            let mut f = M::new(&b).await;
            f.session = 200;
            f.rebalance = 300;
            let fj = tokio::spawn(async move {
                let c = f.join(g).await;
                (f, c)
            });
            until(5, "F's join parked", || {
                b.broker.groups.joins.delayed() == 1
            })
            .await;
            assert_eq!(a.join(g).await, 0);
            assert!(a.leader);
            let (mut f, c) = fj.await.unwrap();
            assert_eq!(c, 0);
            // F's sync waits for the leader's assignments, which never come.
            let (seen, parked) = tokio::sync::oneshot::channel::<()>();
            let fs = tokio::spawn(async move {
                if hang_up {
                    let sync = SyncGroupRequest::default()
                        .with_group_id(GroupId(s(g)))
                        .with_generation_id(f.gen)
                        .with_member_id(s(&f.id));
                    f.w.send(&sync, 3).await.unwrap();
                    // Parked (once the test has seen it so), then the
                    // client is gone.
                    let _ = parked.await;
                } else {
                    let code = f.sync(g).await;
                    assert_eq!(code, code_of(ResponseError::RebalanceInProgress));
                }
                // Nothing more from F.
            });
            until(5, "F's sync parked", || {
                b.broker.groups.syncs.delayed() == 1
            })
            .await;
            let _ = seen.send(());
            let t = Instant::now();
            loop {
                let code = a.heartbeat(g).await;
                if code == code_of(ResponseError::RebalanceInProgress) {
                    break;
                }
                assert_eq!(code, 0);
                assert!(
                    t.elapsed() < Duration::from_secs(3),
                    "a follower whose sync {} is still kept after 3 s (session 200 ms)",
                    if hang_up { "hung up" } else { "expired" }
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            fs.await.unwrap();
            assert_eq!(a.join(g).await, 0);
            assert_eq!(a.members, vec![a.id.clone()]);
        }
        b.shutdown().await;
    })
    .await
}

/// A follower's sync that its client sent again on a new connection (it
/// thought the first lost) keeps it alive while it waits, even once the
/// first sync's connection is found gone: the first sync's end used to
/// clear the member's waiting mark whichever sync had set it, so the
/// follower, still waiting, was expired by its 200 ms session. Here the
/// leader heartbeats for 1.5 s (seven sessions) past that, with no
/// rebalance, then syncs, and the follower's second sync is answered its
/// assignment. (A wait for something not to happen: with the mark cleared
/// the expiry comes some 200 ms in.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sync_sent_again_keeps_its_follower_when_the_first_goes() {
    let _one = ONE.lock().await;
    bounded(async {
        let b = start(quick()).await;
        let g = "again";
        // The leader: alive (it heartbeats).
        let mut a = M::new(&b).await;
        a.session = 2000;
        assert_eq!(a.join(g).await, 0);
        assert_eq!(a.sync(g).await, 0);
        let mut f = M::new(&b).await;
        f.session = 200;
        f.rebalance = 10_000;
        let fj = tokio::spawn(async move {
            let c = f.join(g).await;
            (f, c)
        });
        until(5, "F's join parked", || {
            b.broker.groups.joins.delayed() == 1
        })
        .await;
        assert_eq!(a.join(g).await, 0);
        assert!(a.leader);
        let (f, c) = fj.await.unwrap();
        assert_eq!(c, 0);
        let sync = SyncGroupRequest::default()
            .with_group_id(GroupId(s(g)))
            .with_generation_id(f.gen)
            .with_member_id(s(&f.id));
        // F's first sync, then the same on a new connection.
        let mut first = f.w;
        first.send(&sync, 3).await.unwrap();
        until(5, "F's first sync parked", || {
            b.broker.groups.syncs.delayed() == 1
        })
        .await;
        let mut again = Wire::connect(b.addr).await.unwrap();
        again.send(&sync, 3).await.unwrap();
        until(5, "F's second sync parked", || {
            b.broker.groups.syncs.delayed() == 2
        })
        .await;
        // The first connection is found gone: its sync is cancelled.
        drop(first);
        until(5, "F's first sync cancelled", || {
            b.broker.groups.syncs.delayed() == 1
        })
        .await;
        let t = Instant::now();
        while t.elapsed() < Duration::from_millis(1500) {
            assert_eq!(
                a.heartbeat(g).await,
                0,
                "F, still waiting in its second sync, was expired after {:?}",
                t.elapsed()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(a.sync(g).await, 0);
        let r = again.receive::<SyncGroupRequest>(3).await.unwrap();
        assert_eq!(r.error_code, 0);
        assert_eq!(&r.assignment[..], f.id.as_bytes(), "F's assignment");
        b.shutdown().await;
    })
    .await
}

/// Shutdown answers a parked join and a parked sync with NOT_COORDINATOR.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_answers_parked_joins_and_syncs() {
    let _one = ONE.lock().await;
    bounded(async {
        let b = start(quick()).await;
        // A parked sync: a follower before the leader syncs.
        let mut a = stable_alone(&b, "g").await;
        a.session = 10_000;
        let mut f = M::new(&b).await;
        f.session = 10_000;
        f.rebalance = 10_000;
        let fj = tokio::spawn(async move {
            let c = f.join("g").await;
            (f, c)
        });
        until(5, "F parked", || b.broker.groups.joins.delayed() == 1).await;
        assert_eq!(a.join("g").await, 0);
        let (mut f, _) = fj.await.unwrap();
        let fs = tokio::spawn(async move { f.sync("g").await });
        // A parked join: a new member in another group waiting for its
        // stable member.
        let mut x = stable_alone(&b, "h").await;
        x.session = 10_000;
        let mut y = M::new(&b).await;
        y.session = 10_000;
        y.rebalance = 10_000;
        let yj = tokio::spawn(async move { y.join("h").await });
        until(5, "parked", || {
            b.broker.groups.joins.delayed() == 1 && b.broker.groups.syncs.delayed() == 1
        })
        .await;
        let t = Instant::now();
        b.shutdown().await;
        assert!(t.elapsed() < Duration::from_secs(2));
        assert_eq!(fs.await.unwrap(), code_of(ResponseError::NotCoordinator));
        assert_eq!(yj.await.unwrap(), code_of(ResponseError::NotCoordinator));
        drop((a, x));
    })
    .await
}

/// Huge assignments for unknown members are not kept; duplicate assignments;
/// FindCoordinator v4 many keys answered; v0-3 and key type 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_and_find_coordinator() {
    let _one = ONE.lock().await;
    bounded(async {
        let b = start(Config {
            max_request_bytes: 8 << 20,
            ..quick()
        })
        .await;
        let mut a = M::new(&b).await;
        a.session = 10_000;
        assert_eq!(a.join("g").await, 0);
        let before = live();
        let big = Bytes::from(vec![1u8; 6 << 20]);
        let req = SyncGroupRequest::default()
            .with_group_id(GroupId(s("g")))
            .with_generation_id(a.gen)
            .with_member_id(s(&a.id))
            .with_assignments(vec![
                SyncGroupRequestAssignment::default()
                    .with_member_id(s("stranger"))
                    .with_assignment(big.clone()),
                SyncGroupRequestAssignment::default()
                    .with_member_id(s(&a.id))
                    .with_assignment(Bytes::from_static(b"one")),
                SyncGroupRequestAssignment::default()
                    .with_member_id(s(&a.id))
                    .with_assignment(Bytes::from_static(b"two")),
            ]);
        let r = a.w.call(&req, 3).await.unwrap();
        assert_eq!(r.error_code, 0);
        assert_eq!(&r.assignment[..], b"two");
        drop((big, req));
        let mut a = a; // the connection's reader keeps its buffer: close it
        let _ = &mut a.w;
        drop(a);
        heap_settled().await;
        assert!(live() - before < 1 << 20, "{}", live() - before);
        let mut w = Wire::connect(b.addr).await.unwrap();
        let keys: Vec<StrBytes> = (0..10_000).map(|i| s(&format!("k{i}"))).collect();
        let r = w
            .call(
                &FindCoordinatorRequest::default().with_coordinator_keys(keys),
                4,
            )
            .await
            .unwrap();
        assert_eq!(r.coordinators.len(), 10_000);
        assert!(r
            .coordinators
            .iter()
            .all(|c| c.error_code == 0 && c.node_id.0 == 0));
        let r = w
            .call(
                &FindCoordinatorRequest::default()
                    .with_key(s("g"))
                    .with_key_type(1),
                3,
            )
            .await
            .unwrap();
        assert_eq!(
            r.error_code,
            code_of(ResponseError::TransactionalIdAuthorizationFailed)
        );
        let r = w
            .call(&FindCoordinatorRequest::default().with_key(s("g")), 0)
            .await
            .unwrap();
        assert_eq!((r.error_code, r.port), (0, b.addr.port() as i32));
        b.shutdown().await;
    })
    .await
}

// ===========================================================================
// Kafka's answers and hostile clients, request by request
// ===========================================================================

#[path = "support/kafka_raw.rs"]
mod kafka_raw;
#[path = "support/proc.rs"]
mod procfs;

/// A join of `id` (empty: a new member) with these timeouts.
fn join_req(group: &str, id: &str, session: i32, rebalance: i32) -> JoinGroupRequest {
    JoinGroupRequest::default()
        .with_group_id(GroupId(s(group)))
        .with_session_timeout_ms(session)
        .with_rebalance_timeout_ms(rebalance)
        .with_member_id(s(id))
        .with_protocol_type(s("consumer"))
        .with_protocols(vec![JoinGroupRequestProtocol::default()
            .with_name(s("range"))
            .with_metadata(Bytes::from_static(b"m"))])
}

/// A commit to topic `T` of (partition, offset, metadata).
fn commit_md(
    group: &str,
    gen: i32,
    id: &str,
    offs: &[(i32, i64, Option<String>)],
) -> OffsetCommitRequest {
    let mut r = commit_req(
        group,
        gen,
        id,
        T,
        &offs.iter().map(|&(p, o, _)| (p, o)).collect::<Vec<_>>(),
    );
    for (p, (_, _, md)) in r.topics[0].partitions.iter_mut().zip(offs) {
        p.committed_metadata = md.as_deref().map(s);
    }
    r
}

/// An OffsetFetch of topic `T`'s `parts`.
fn offsets_req(group: &str, parts: &[i32]) -> OffsetFetchRequest {
    OffsetFetchRequest::default()
        .with_group_id(GroupId(s(group)))
        .with_topics(Some(vec![OffsetFetchRequestTopic::default()
            .with_name(TopicName(s(T)))
            .with_partition_indexes(parts.to_vec())]))
}

/// Joins alone at v3 (no two-step) on `w`, leader of a new generation, and
/// syncs: the member id and generation.
async fn stable_on(w: &mut Wire, g: &str, session: i32) -> (String, i32) {
    let r = w.call(&join_req(g, "", session, 300), 3).await.unwrap();
    assert_eq!(r.error_code, 0);
    let id = r.member_id.to_string();
    let sync = SyncGroupRequest::default()
        .with_group_id(GroupId(s(g)))
        .with_generation_id(r.generation_id)
        .with_member_id(s(&id))
        .with_assignments(vec![SyncGroupRequestAssignment::default()
            .with_member_id(s(&id))
            .with_assignment(Bytes::from_static(b"a"))]);
    assert_eq!(w.call(&sync, 3).await.unwrap().error_code, 0);
    (id, r.generation_id)
}

/// A bystander's ApiVersions is answered within 5 s.
async fn bystander(b: &BrokerHandle) -> bool {
    tokio::time::timeout(Duration::from_secs(5), async {
        let mut w = Wire::connect(b.addr).await.ok()?;
        w.call(&ApiVersionsRequest::default(), 2).await.ok()
    })
    .await
    .ok()
    .flatten()
    .is_some_and(|r| r.error_code == 0)
}

/// Kafka (`GroupCoordinator.isValidGroupId`, and `GroupCoordinatorService`'s
/// `isGroupIdNotEmpty` in the new coordinator): Heartbeat, SyncGroup and
/// LeaveGroup with an empty group id are answered INVALID_GROUP_ID (24).
/// They were answered UNKNOWN_MEMBER_ID (25), and LeaveGroup v3 NONE.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_group_id_on_heartbeat_sync_leave_is_invalid_group_id() {
    let _one = ONE.lock().await;
    bounded(async {
        let b = start(quick()).await;
        let mut w = Wire::connect(b.addr).await.unwrap();
        let hb = w
            .call(
                &HeartbeatRequest::default()
                    .with_group_id(GroupId(s("")))
                    .with_generation_id(1)
                    .with_member_id(s("m")),
                3,
            )
            .await
            .unwrap()
            .error_code;
        let sy = w
            .call(
                &SyncGroupRequest::default()
                    .with_group_id(GroupId(s("")))
                    .with_generation_id(1)
                    .with_member_id(s("m")),
                3,
            )
            .await
            .unwrap()
            .error_code;
        let lv0 = w
            .call(
                &LeaveGroupRequest::default()
                    .with_group_id(GroupId(s("")))
                    .with_member_id(s("m")),
                1,
            )
            .await
            .unwrap()
            .error_code;
        let lv3 = w
            .call(
                &LeaveGroupRequest::default()
                    .with_group_id(GroupId(s("")))
                    .with_members(vec![MemberIdentity::default().with_member_id(s("m"))]),
                3,
            )
            .await
            .unwrap()
            .error_code;
        let inv = code(ResponseError::InvalidGroupId);
        assert_eq!(
            (hb, sy, lv0, lv3),
            (inv, inv, inv, inv),
            "heartbeat, sync, leave v1, leave v3 (top level) for group \"\""
        );
        b.shutdown().await;
    })
    .await
}

/// Kafka accepts OffsetCommit and OffsetFetch for the empty group id
/// (`isValidGroupId`: "For backwards compatibility, we support the offset
/// commit APIs for the empty groupId"; the new coordinator checks only
/// `isGroupIdNotNull` for them). It was refused INVALID_GROUP_ID.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_group_id_commit_is_stored_as_kafka_does() {
    let _one = ONE.lock().await;
    bounded(async {
        let b = start(quick()).await;
        let mut w = Wire::connect(b.addr).await.unwrap();
        let r = w
            .call(&commit_md("", -1, "", &[(0, 42, None)]), 7)
            .await
            .unwrap();
        let committed = r.topics[0].partitions[0].error_code;
        let f = w.call(&offsets_req("", &[0]), 7).await.unwrap();
        assert_eq!(
            (committed, f.topics[0].partitions[0].committed_offset),
            (0, 42),
            "commit to group \"\" (code) and the offset read back"
        );
        b.shutdown().await;
    })
    .await
}

/// Kafka (`FindCoordinatorRequest.CoordinatorType.forId`): an unknown key
/// type throws InvalidRequestException, answered INVALID_REQUEST (42), at
/// v1-3 and per key at v4. It was answered COORDINATOR_NOT_AVAILABLE. A
/// transaction coordinator lookup (key type 1) is answered
/// TRANSACTIONAL_ID_AUTHORIZATION_FAILED (53), not retriable: it was
/// COORDINATOR_NOT_AVAILABLE (retriable), and aiokafka's transactional
/// producer retried it for ever in `start()`. An error answer names no node (Kafka's
/// `Node.noNode()`: id -1, host "", port -1); it carried this broker's host
/// and port.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn find_coordinator_unknown_key_type_is_invalid_request() {
    let _one = ONE.lock().await;
    bounded(async {
        let b = start(quick()).await;
        let mut w = Wire::connect(b.addr).await.unwrap();
        // Each error answer names no node, as Kafka's `Node.noNode()`: id
        // -1, host "", port -1 (it used to carry this broker's address).
        let no_node = |e: ResponseError| (code(e), -1, String::new(), -1);
        let mut got = vec![];
        let mut want = vec![];
        for kt in [5i8, -1, i8::MAX, 1] {
            let r = w
                .call(
                    &FindCoordinatorRequest::default()
                        .with_key(s("g"))
                        .with_key_type(kt),
                    3,
                )
                .await
                .unwrap();
            got.push((r.error_code, r.node_id.0, r.host.to_string(), r.port));
            let r = w
                .call(
                    &FindCoordinatorRequest::default()
                        .with_coordinator_keys(vec![s("g")])
                        .with_key_type(kt),
                    4,
                )
                .await
                .unwrap();
            let c = &r.coordinators[0];
            got.push((c.error_code, c.node_id.0, c.host.to_string(), c.port));
            let e = if kt == 1 {
                ResponseError::TransactionalIdAuthorizationFailed
            } else {
                ResponseError::InvalidRequest
            };
            want.extend([no_node(e), no_node(e)]);
        }
        assert!(bystander(&b).await);
        assert_eq!(got, want);
        b.shutdown().await;
    })
    .await
}

/// Kafka (`ClassicGroup.validateOffsetCommit`: "if (generationId < 0 &&
/// isInState(EMPTY)) return"; `OffsetMetadataManager` creates a simple group
/// for an unknown id when the generation is < 0): a commit with generation
/// -1 to an unknown or empty group is stored whatever member id it names. It
/// was refused ILLEGAL_GENERATION and UNKNOWN_MEMBER_ID.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simple_commit_naming_a_member_id_is_stored() {
    let _one = ONE.lock().await;
    bounded(async {
        let b = start(quick()).await;
        let mut w = Wire::connect(b.addr).await.unwrap();
        // Unknown group.
        let r = w
            .call(&commit_md("simple", -1, "consumer-1", &[(0, 7, None)]), 7)
            .await
            .unwrap();
        let unknown = r.topics[0].partitions[0].error_code;
        // Known, empty group (offsets only).
        let r = w
            .call(&commit_md("simple2", -1, "", &[(0, 1, None)]), 7)
            .await
            .unwrap();
        assert_eq!(r.topics[0].partitions[0].error_code, 0);
        let r = w
            .call(&commit_md("simple2", -1, "consumer-1", &[(0, 8, None)]), 7)
            .await
            .unwrap();
        let empty = r.topics[0].partitions[0].error_code;
        assert_eq!(
            (unknown, empty),
            (0, 0),
            "gen -1 + member id: to an unknown group, to an empty group"
        );
        b.shutdown().await;
    })
    .await
}

/// The leader epoch a commit gives (OffsetCommit v6 on) is kept and
/// fetched back (OffsetFetch v5 on), as Kafka keeps it; a commit without
/// one (before v6) is fetched back as -1. It was answered -1 always.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_committed_leader_epoch_is_kept() {
    let _one = ONE.lock().await;
    bounded(async {
        let b = start(quick()).await;
        let mut w = Wire::connect(b.addr).await.unwrap();
        let mut with_epoch = commit_req("epochs", -1, "", T, &[(0, 5), (1, 6)]);
        with_epoch.topics[0].partitions[0].committed_leader_epoch = 7;
        let r = w.call(&with_epoch, 6).await.unwrap();
        assert!(r.topics[0].partitions.iter().all(|p| p.error_code == 0));
        // Version 5 does not carry the epoch: it is not sent, and reads -1.
        let mut old = commit_req("epochs", -1, "", T, &[(2, 8)]);
        old.topics[0].partitions[0].committed_leader_epoch = 9;
        let r = w.call(&old, 5).await.unwrap();
        assert_eq!(r.topics[0].partitions[0].error_code, 0);
        for version in 5..=7 {
            let r = w
                .call(&offsets_req("epochs", &[0, 1, 2]), version)
                .await
                .unwrap();
            let got: Vec<_> = r.topics[0]
                .partitions
                .iter()
                .map(|p| {
                    (
                        p.partition_index,
                        p.committed_offset,
                        p.committed_leader_epoch,
                    )
                })
                .collect();
            assert_eq!(
                got,
                [(0, 5, 7), (1, 6, -1), (2, 8, -1)],
                "version {version}"
            );
        }
        b.shutdown().await;
    })
    .await
}

/// Kafka checks `offset.metadata.max.bytes` (4096) against the Java
/// string's length (`metadata.length()`, UTF-16 units): 3000 'é' (6000
/// UTF-8 bytes) fit, and were refused OFFSET_METADATA_TOO_LARGE. At the
/// edge: 4096 ASCII bytes fit, and 4096 characters of two UTF-16 units each
/// (8192 units) do not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commit_metadata_limit_counts_utf16_units() {
    let _one = ONE.lock().await;
    bounded(async {
        let b = start(quick()).await;
        let mut w = Wire::connect(b.addr).await.unwrap();
        let r = w
            .call(
                &commit_md("g", -1, "", &[(0, 1, Some("x".repeat(4096)))]),
                7,
            )
            .await
            .unwrap();
        assert_eq!(r.topics[0].partitions[0].error_code, 0, "4096 ASCII bytes");
        let r = w
            .call(
                &commit_md("g", -1, "", &[(1, 1, Some("é".repeat(3000)))]),
                7,
            )
            .await
            .unwrap();
        assert_eq!(
            r.topics[0].partitions[0].error_code, 0,
            "3000 characters (6000 bytes): Kafka stores it"
        );
        let r = w
            .call(
                &commit_md("g", -1, "", &[(2, 1, Some("\u{1F600}".repeat(4096)))]),
                7,
            )
            .await
            .unwrap();
        assert_eq!(
            r.topics[0].partitions[0].error_code,
            code(ResponseError::OffsetMetadataTooLarge),
            "8192 UTF-16 units"
        );
        b.shutdown().await;
    })
    .await
}

/// `--group-min-session-ms 0` lets a member ask for a 0 ms session. A
/// member whose join waits in a round is kept alive meanwhile: its session
/// timer, when it fires, is moved past the wait. It used to be moved a
/// session on, which with a 0 ms session fired at every turn of the reaper
/// for the whole round (640 ms of CPU a second). One join of a 0 ms session
/// waiting a second now costs next to nothing, and its round ends as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zero_session_does_not_spin_the_reaper() {
    let _one = ONE.lock().await;
    bounded(async {
        let b = start(Config {
            groups: GroupLimits {
                min_session: Duration::ZERO,
                ..Default::default()
            },
            ..quick()
        })
        .await;
        let mut w = Wire::connect(b.addr).await.unwrap();
        // A stable member that does not rejoin: the round lasts the new
        // member's rebalance timeout (2 s).
        let _stable = stable_on(&mut w, "z", 10_000).await;
        let addr = b.addr;
        let j = tokio::spawn(async move {
            let mut w = Wire::connect(addr).await.unwrap();
            w.call(&join_req("z", "", 0, 2000), 3).await.unwrap()
        });
        until(5, "the join parked", || {
            b.broker.groups.joins.delayed() == 1
        })
        .await;
        let cpu0 = procfs::cpu_ms("self");
        tokio::time::sleep(Duration::from_millis(1000)).await;
        let cpu = procfs::cpu_ms("self") - cpu0;
        assert_eq!(b.broker.groups.joins.delayed(), 1, "still waiting");
        assert!(
            cpu < 300,
            "{cpu} ms of CPU in 1000 ms while one join of a 0 ms session waited"
        );
        let r = j.await.unwrap();
        assert_eq!((r.error_code, r.generation_id), (0, 2));
        assert!(bystander(&b).await);
        b.shutdown().await;
    })
    .await
}

/// Offsets at the extremes are stored and read back as sent (Kafka stores
/// the committed offset without checking it); generations at the extremes
/// get ILLEGAL_GENERATION; timeouts at the extremes get
/// INVALID_SESSION_TIMEOUT or serve.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extreme_offsets_generations_and_timeouts() {
    let _one = ONE.lock().await;
    bounded(async {
        let b = start(quick()).await;
        let mut w = Wire::connect(b.addr).await.unwrap();
        let offs = [(0, i64::MAX), (1, i64::MIN), (2, -1), (3, 0)];
        let r = w
            .call(
                &commit_md(
                    "x",
                    -1,
                    "",
                    &offs.iter().map(|&(p, o)| (p, o, None)).collect::<Vec<_>>(),
                ),
                2,
            )
            .await
            .unwrap();
        assert!(r.topics[0].partitions.iter().all(|p| p.error_code == 0));
        let f = w.call(&offsets_req("x", &[0, 1, 2, 3]), 5).await.unwrap();
        let back: Vec<(i32, i64)> = f.topics[0]
            .partitions
            .iter()
            .map(|p| (p.partition_index, p.committed_offset))
            .collect();
        assert_eq!(back, offs);
        // Generations.
        let (id, gen) = stable_on(&mut w, "g", 10_000).await;
        for g in [i32::MAX, i32::MIN, -1, gen + 1] {
            let hb = w
                .call(
                    &HeartbeatRequest::default()
                        .with_group_id(GroupId(s("g")))
                        .with_generation_id(g)
                        .with_member_id(s(&id)),
                    4,
                )
                .await
                .unwrap()
                .error_code;
            let sy = w
                .call(
                    &SyncGroupRequest::default()
                        .with_group_id(GroupId(s("g")))
                        .with_generation_id(g)
                        .with_member_id(s(&id)),
                    4,
                )
                .await
                .unwrap()
                .error_code;
            let cm = w
                .call(&commit_md("g", g, &id, &[(0, 1, None)]), 7)
                .await
                .unwrap()
                .topics[0]
                .partitions[0]
                .error_code;
            let ig = code(ResponseError::IllegalGeneration);
            assert_eq!((hb, sy, cm), (ig, ig, ig), "generation {g}");
        }
        // Rebalance timeouts: i32::MIN, 0, i32::MAX; a lone member completes
        // at once whatever it is.
        for (i, rb) in [i32::MIN, 0, i32::MAX].into_iter().enumerate() {
            let r = tokio::time::timeout(
                Duration::from_secs(5),
                w.call(&join_req(&format!("rb{i}"), "", 1000, rb), 3),
            )
            .await
            .expect("a lone join answers at once")
            .unwrap();
            assert_eq!((r.error_code, r.generation_id), (0, 1), "rebalance {rb}");
        }
        assert!(bystander(&b).await);
        b.shutdown().await;
    })
    .await
}

/// Pipelined on one connection while a rebalance prepares: Heartbeat
/// (REBALANCE_IN_PROGRESS), JoinGroup (completes the round), Produce acks=1,
/// OffsetCommit of the new generation (CompletingRebalance: REBALANCE_IN_
/// PROGRESS in Kafka), SyncGroup (leader: stable), OffsetCommit again
/// (stored), OffsetFetch. Answered in order with their correlation ids.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_group_and_produce_calls_answer_in_order() {
    let _one = ONE.lock().await;
    bounded(async {
        let b = start(quick()).await;
        let mut w = Wire::connect(b.addr).await.unwrap();
        let (a, gen) = stable_on(&mut w, "g", 10_000).await;
        drop(w);
        // A second member joins: Preparing, its join parked.
        let addr = b.addr;
        let n = tokio::spawn(async move {
            let mut w = Wire::connect(addr).await.unwrap();
            w.call(&join_req("g", "", 10_000, 5_000), 3).await.unwrap()
        });
        until(5, "the second join parked", || {
            b.broker.groups.joins.delayed() == 1
        })
        .await;
        let mut st = tokio::net::TcpStream::connect(b.addr).await.unwrap();
        let mut out = Vec::new();
        out.extend_from_slice(&kafka_raw::frame(
            &HeartbeatRequest::default()
                .with_group_id(GroupId(s("g")))
                .with_generation_id(gen)
                .with_member_id(s(&a)),
            4,
            1,
        ));
        out.extend_from_slice(&kafka_raw::frame(&join_req("g", &a, 10_000, 5_000), 3, 2));
        out.extend_from_slice(&kafka_raw::frame(
            &wire::produce(T, 0, 1, Duration::from_secs(5), wire::batch(&[b"v"])),
            wire::PRODUCE_VERSION,
            3,
        ));
        out.extend_from_slice(&kafka_raw::frame(
            &commit_md("g", gen + 1, &a, &[(0, 5, None)]),
            7,
            4,
        ));
        out.extend_from_slice(&kafka_raw::frame(
            &SyncGroupRequest::default()
                .with_group_id(GroupId(s("g")))
                .with_generation_id(gen + 1)
                .with_member_id(s(&a)),
            3,
            5,
        ));
        out.extend_from_slice(&kafka_raw::frame(
            &commit_md("g", gen + 1, &a, &[(0, 6, None)]),
            7,
            6,
        ));
        out.extend_from_slice(&kafka_raw::frame(&offsets_req("g", &[0]), 7, 7));
        tokio::io::AsyncWriteExt::write_all(&mut st, &out)
            .await
            .unwrap();
        let (c1, hb) = kafka_raw::read_answer::<HeartbeatRequest>(&mut st, 4)
            .await
            .unwrap();
        let (c2, j) = kafka_raw::read_answer::<JoinGroupRequest>(&mut st, 3)
            .await
            .unwrap();
        let (c3, p) = kafka_raw::read_answer::<ProduceRequest>(&mut st, wire::PRODUCE_VERSION)
            .await
            .unwrap();
        let (c4, cm) = kafka_raw::read_answer::<OffsetCommitRequest>(&mut st, 7)
            .await
            .unwrap();
        let (c5, sy) = kafka_raw::read_answer::<SyncGroupRequest>(&mut st, 3)
            .await
            .unwrap();
        let (c6, cm2) = kafka_raw::read_answer::<OffsetCommitRequest>(&mut st, 7)
            .await
            .unwrap();
        let (c7, f) = kafka_raw::read_answer::<OffsetFetchRequest>(&mut st, 7)
            .await
            .unwrap();
        assert_eq!((c1, c2, c3, c4, c5, c6, c7), (1, 2, 3, 4, 5, 6, 7));
        assert_eq!(hb.error_code, code(ResponseError::RebalanceInProgress));
        assert_eq!((j.error_code, j.generation_id), (0, gen + 1));
        assert_eq!(wire::produce_error(&p), 0);
        assert_eq!(
            cm.topics[0].partitions[0].error_code,
            code(ResponseError::RebalanceInProgress)
        );
        assert_eq!(sy.error_code, 0);
        assert_eq!(cm2.topics[0].partitions[0].error_code, 0);
        assert_eq!(f.topics[0].partitions[0].committed_offset, 6);
        let nj = n.await.unwrap();
        assert_eq!((nj.error_code, nj.generation_id), (0, gen + 1));
        assert!(bystander(&b).await);
        b.shutdown().await;
    })
    .await
}

/// 300 members join one group (v3, each on its own connection, a 1 s
/// rebalance timeout, a 300 ms session) and all hang up mid-rebalance; a
/// bystander group keeps working meanwhile; the group ends empty and is
/// forgotten; a stale member id then rejoining is UNKNOWN_MEMBER_ID; the
/// heap comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_members_join_then_vanish() {
    let _one = ONE.lock().await;
    bounded(async {
        let b = start(quick()).await;
        let before = live();
        let mut w0 = Wire::connect(b.addr).await.unwrap();
        let (first, _) = stable_on(&mut w0, "crowd", 300).await;
        drop(w0);
        let mut conns = vec![];
        for _ in 0..300 {
            let mut w = Wire::connect(b.addr).await.unwrap();
            w.send(&join_req("crowd", "", 300, 1000), 3).await.unwrap();
            conns.push(w);
        }
        until(10, "the joins parked", || {
            b.broker.groups.joins.delayed() >= 250
        })
        .await;
        drop(conns); // every one hangs up mid-rebalance
        let mut by = Wire::connect(b.addr).await.unwrap();
        let (bid, bgen) = stable_on(&mut by, "other", 10_000).await;
        until(10, "the crowd forgotten", || {
            b.broker
                .groups
                .describe("crowd")
                .is_none_or(|(_, m)| m.is_empty())
        })
        .await;
        let hb = by
            .call(
                &HeartbeatRequest::default()
                    .with_group_id(GroupId(s("other")))
                    .with_generation_id(bgen)
                    .with_member_id(s(&bid)),
                4,
            )
            .await
            .unwrap();
        assert_eq!(hb.error_code, 0);
        let r = by
            .call(&join_req("crowd", &first, 300, 300), 3)
            .await
            .unwrap();
        assert_eq!(r.error_code, code(ResponseError::UnknownMemberId));
        drop(by);
        until(10, "no join waits", || b.broker.groups.joins.delayed() == 0).await;
        heap_settled().await;
        assert_eq!(b.broker.groups.joins.delayed(), 0);
        let grown = live() - before;
        assert!(grown < 1 << 20, "heap grew {grown} bytes");
        b.shutdown().await;
    })
    .await
}

/// What members' protocols and assignments keep is given back: 300 rounds of
/// a member joining with 256 KiB of metadata, a changed rejoin, a 256 KiB
/// assignment, a leave (300 x 768 KiB, far past the 64 MiB bound if any of
/// it stayed counted); then a join with 1 MiB of metadata is still taken.
/// Also a follower's sync that hangs up while parked leaves the group
/// working.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kept_bytes_are_given_back() {
    let _one = ONE.lock().await;
    bounded(async {
        let b = start(quick()).await;
        let mut w = Wire::connect(b.addr).await.unwrap();
        let big = Bytes::from(vec![7u8; 256 << 10]);
        let join = |id: &str, md: Bytes| {
            JoinGroupRequest::default()
                .with_group_id(GroupId(s("k")))
                .with_session_timeout_ms(10_000)
                .with_rebalance_timeout_ms(1000)
                .with_member_id(s(id))
                .with_protocol_type(s("consumer"))
                .with_protocols(vec![JoinGroupRequestProtocol::default()
                    .with_name(s("range"))
                    .with_metadata(md)])
        };
        for i in 0..300 {
            let r = w.call(&join("", big.clone()), 3).await.unwrap();
            assert_eq!(r.error_code, 0, "round {i}: join");
            let id = r.member_id.to_string();
            let r = w.call(&join(&id, big.slice(1..)), 3).await.unwrap();
            assert_eq!(r.error_code, 0, "round {i}: changed rejoin");
            let sync = SyncGroupRequest::default()
                .with_group_id(GroupId(s("k")))
                .with_generation_id(r.generation_id)
                .with_member_id(s(&id))
                .with_assignments(vec![SyncGroupRequestAssignment::default()
                    .with_member_id(s(&id))
                    .with_assignment(big.clone())]);
            assert_eq!(
                w.call(&sync, 3).await.unwrap().error_code,
                0,
                "round {i}: sync"
            );
            let r = w
                .call(
                    &LeaveGroupRequest::default()
                        .with_group_id(GroupId(s("k")))
                        .with_member_id(s(&id)),
                    1,
                )
                .await
                .unwrap();
            assert_eq!(r.error_code, 0);
        }
        let r = w
            .call(&join("", Bytes::from(vec![1u8; 1 << 20])), 3)
            .await
            .unwrap();
        assert_eq!(r.error_code, 0, "a 1 MiB join after the rounds");
        let (leader, gen) = (r.member_id.to_string(), r.generation_id);
        let _ = gen;
        // A follower joins; the leader rejoins; the follower's sync parks,
        // then its client hangs up; the leader syncs; the follower comes back
        // on a new connection and heartbeats.
        let addr = b.addr;
        let f = tokio::spawn(async move {
            let mut w = Wire::connect(addr).await.unwrap();
            let r = w.call(&join_req("k", "", 10_000, 1000), 3).await.unwrap();
            (w, r)
        });
        until(5, "the follower's join parked", || {
            b.broker.groups.joins.delayed() == 1
        })
        .await;
        let r = w
            .call(&join(&leader, Bytes::from(vec![1u8; 1 << 20])), 3)
            .await
            .unwrap();
        assert_eq!(r.error_code, 0);
        let gen = r.generation_id;
        let (mut fw, fr) = f.await.unwrap();
        assert_eq!((fr.error_code, fr.generation_id), (0, gen));
        let fid = fr.member_id.to_string();
        fw.send(
            &SyncGroupRequest::default()
                .with_group_id(GroupId(s("k")))
                .with_generation_id(gen)
                .with_member_id(s(&fid)),
            3,
        )
        .await
        .unwrap();
        until(5, "the follower's sync parked", || {
            b.broker.groups.syncs.delayed() == 1
        })
        .await;
        drop(fw);
        until(5, "the parked sync cancelled", || {
            b.broker.groups.syncs.delayed() == 0
        })
        .await;
        let sync = SyncGroupRequest::default()
            .with_group_id(GroupId(s("k")))
            .with_generation_id(gen)
            .with_member_id(s(&leader))
            .with_assignments(vec![SyncGroupRequestAssignment::default()
                .with_member_id(s(&fid))
                .with_assignment(Bytes::from_static(b"x"))]);
        assert_eq!(w.call(&sync, 3).await.unwrap().error_code, 0);
        let mut fw = Wire::connect(b.addr).await.unwrap();
        let hb = fw
            .call(
                &HeartbeatRequest::default()
                    .with_group_id(GroupId(s("k")))
                    .with_generation_id(gen)
                    .with_member_id(s(&fid)),
                4,
            )
            .await
            .unwrap();
        assert_eq!(hb.error_code, 0);
        let sy = fw
            .call(
                &SyncGroupRequest::default()
                    .with_group_id(GroupId(s("k")))
                    .with_generation_id(gen)
                    .with_member_id(s(&fid)),
                3,
            )
            .await
            .unwrap();
        assert_eq!((sy.error_code, &sy.assignment[..]), (0, &b"x"[..]));
        b.shutdown().await;
    })
    .await
}

/// Committed offsets are kept for as long as the broker runs, each with up
/// to 4096 characters of metadata (up to 12 KiB): `max_offsets` (100,000)
/// of them could keep over 1 GB, outside every byte bound. What they keep is
/// bounded in bytes too (`max_offset_bytes`): here 1 MiB takes some 240
/// offsets of 4 KiB, the rest are refused INVALID_COMMIT_OFFSET_SIZE (as
/// past `max_offsets`), the heap holds no more than the bound, and an offset
/// committed again with less metadata is still taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn committed_offsets_are_bounded_in_bytes() {
    let _one = ONE.lock().await;
    bounded(async {
        let bound = 1 << 20;
        let b = start(Config {
            partitions: 1001,
            groups: GroupLimits {
                min_session: Duration::from_millis(50),
                max_offset_bytes: bound,
                ..Default::default()
            },
            ..quick()
        })
        .await;
        let mut w = Wire::connect(b.addr).await.unwrap();
        // Warm up (the group, the first allocations).
        let r = w
            .call(&commit_md("g", -1, "", &[(0, 1, None)]), 7)
            .await
            .unwrap();
        assert_eq!(r.topics[0].partitions[0].error_code, 0);
        heap_settled().await;
        let before = live();
        let md = "m".repeat(4096);
        let (mut taken, mut refused) = (0, 0);
        for chunk in 0..10 {
            let offs: Vec<_> = (0..100)
                .map(|i| (1 + chunk * 100 + i, 7, Some(md.clone())))
                .collect();
            let r = w.call(&commit_md("g", -1, "", &offs), 7).await.unwrap();
            for p in &r.topics[0].partitions {
                match p.error_code {
                    0 => taken += 1,
                    c if c == code(ResponseError::InvalidCommitOffsetSize) => refused += 1,
                    c => panic!("partition {}: error {c}", p.partition_index),
                }
            }
        }
        heap_settled().await;
        let grown = live() - before;
        assert!(
            refused > 0 && taken * 4096 <= bound,
            "{taken} offsets of 4 KiB taken, {refused} refused, within {bound} bytes"
        );
        assert!(
            grown < bound as isize + (256 << 10),
            "{taken} offsets of 4 KiB keep {grown} bytes (bound {bound})"
        );
        // Full: one more offset of 4 KiB has no room.
        let big = commit_md("g", -1, "", &[(999, 8, Some(md.clone()))]);
        let r = w.call(&big, 7).await.unwrap();
        assert_eq!(
            r.topics[0].partitions[0].error_code,
            code(ResponseError::InvalidCommitOffsetSize)
        );
        // Two taken, committed again without metadata: taken, and they give
        // back 8 KiB, room for it (which they would not if a commit of a
        // partition kept were charged again, its old cost not given back).
        let r = w
            .call(&commit_md("g", -1, "", &[(1, 8, None), (2, 8, None)]), 7)
            .await
            .unwrap();
        assert!(r.topics[0].partitions.iter().all(|p| p.error_code == 0));
        let r = w.call(&big, 7).await.unwrap();
        assert_eq!(
            r.topics[0].partitions[0].error_code, 0,
            "the room given back by re-commits is taken"
        );
        let f = w.call(&offsets_req("g", &[1, 2, 999]), 7).await.unwrap();
        let got: Vec<i64> = f.topics[0]
            .partitions
            .iter()
            .map(|p| p.committed_offset)
            .collect();
        assert_eq!(got, [8, 8, 8]);
        assert!(bystander(&b).await);
        b.shutdown().await;
    })
    .await
}
