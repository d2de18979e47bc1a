//! The group coordinator: consumer groups on two purgatories and a timer, as
//! Kafka's `GroupCoordinator` keeps them on its join purgatory and heartbeats.
//!
//! - **Joins** wait in the join purgatory, watching the group's id, until
//!   every member the group knows has joined this round (the join that makes
//!   it so completes the round and walks the key) or the round's rebalance
//!   deadline (the longest rebalance timeout of its members) passes; then the
//!   members that did not join are dropped and the round ends with those that
//!   did. Each waiting join completes with its own answer: the leader gets the
//!   members and their metadata, and assigns partitions itself (client-side
//!   assignment, as in Kafka).
//! - **Syncs** of followers wait in the sync purgatory until the leader's sync
//!   brings the assignments (or a new rebalance begins: they then answer
//!   `REBALANCE_IN_PROGRESS`).
//! - **Sessions**: each member has a timer entry for its session timeout,
//!   moved by every heartbeat, join and sync (`TaskHandle::reset`); when it
//!   fires, the member is dropped and the group rebalances.
//! - **Offsets** committed per group, fetched back by consumers.
//!
//! Generations, `MEMBER_ID_REQUIRED`, `REBALANCE_IN_PROGRESS`,
//! `UNKNOWN_MEMBER_ID` and `ILLEGAL_GENERATION` as in Kafka. Static
//! membership (`group.instance.id`) is not served: such members are treated
//! as dynamic ones.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use bytes::Bytes;
use kafka_protocol::error::ResponseError;
use kafka_protocol::messages::join_group_response::JoinGroupResponseMember;
use kafka_protocol::messages::leave_group_response::MemberResponse;
use kafka_protocol::messages::offset_commit_response::{
    OffsetCommitResponsePartition, OffsetCommitResponseTopic,
};
use kafka_protocol::messages::offset_fetch_response::{
    OffsetFetchResponsePartition, OffsetFetchResponseTopic,
};
use kafka_protocol::messages::*;
use kafka_protocol::protocol::StrBytes;
use tokio::time::Instant;
use tokio_purgatory::{Completion, Operation, Purgatory, TaskHandle, Timer};

use super::Gone;

/// The coordinator's limits (bounded memory whatever clients send).
#[derive(Debug, Clone)]
pub struct GroupLimits {
    /// Groups held at most. A group is held while it has members, member
    /// ids handed out, or committed offsets; offsets are kept until the
    /// broker stops (Kafka expires those of empty groups after
    /// `offsets.retention.minutes`), so clients committing to many groups
    /// of their own can take every place: a new group is then refused with
    /// `COORDINATOR_NOT_AVAILABLE`, which clients retry.
    pub max_groups: usize,
    /// Members (joined or given an id) per group at most (Kafka's
    /// `group.max.size`).
    pub max_members: usize,
    /// Committed offsets held at most, across every group (each with at
    /// most 4 KiB of metadata, as Kafka's `offset.metadata.max.bytes`, and a
    /// topic name of at most 249 bytes), of partitions that exist; past it,
    /// a commit of a new partition is refused with `INVALID_COMMIT_OFFSET_SIZE`.
    pub max_offsets: usize,
    /// The session timeouts accepted (Kafka's `group.min.session.timeout.ms`
    /// and `group.max.session.timeout.ms`: 6 s and 30 min).
    pub min_session: Duration,
    pub max_session: Duration,
    /// Bytes of members' protocols (names and metadata), of assignments and
    /// of member ids handed out and not joined yet (each [`PENDING_COST`]
    /// and its id, kept up to its session) across every group at most: a
    /// join or a leader's sync that would pass it is answered
    /// `COORDINATOR_LOAD_IN_PROGRESS` (a join) or `COORDINATOR_NOT_AVAILABLE`
    /// (a sync), which clients retry.
    pub max_kept_bytes: usize,
    /// Bytes of committed offsets kept across every group at most (each
    /// [`OFFSET_COST`], its topic name and its metadata, up to 4096
    /// characters of up to 3 bytes): past it, a commit that would keep more
    /// is refused with `INVALID_COMMIT_OFFSET_SIZE`, as past `max_offsets`.
    pub max_offset_bytes: usize,
}

/// What a member id handed out and not joined yet keeps besides its id: its
/// entry in the group's map and its expiry in the timer (about 400 bytes
/// measured, rounded up).
pub const PENDING_COST: usize = 512;

/// What a committed offset keeps besides its topic name and metadata: its
/// entry in the group's map (with the map's spare room).
pub const OFFSET_COST: usize = 192;

impl Default for GroupLimits {
    fn default() -> Self {
        GroupLimits {
            max_groups: 1000,
            max_members: 1000,
            max_offsets: 100_000,
            min_session: Duration::from_secs(6),
            max_session: Duration::from_secs(1800),
            max_kept_bytes: 64 << 20,
            max_offset_bytes: 64 << 20,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Empty,
    /// Waiting for members to join.
    Preparing,
    /// Joined; waiting for the leader's assignments.
    Completing,
    Stable,
}

struct Member {
    /// The client id and address of its first join (Kafka does not change
    /// them after), shown by DescribeGroups.
    client_id: StrBytes,
    client_host: StrBytes,
    session: Duration,
    rebalance: Duration,
    protocol_type: StrBytes,
    protocols: Vec<(StrBytes, Bytes)>,
    /// Joined in the round under way.
    joined: bool,
    /// Its sync waits for the leader's assignments (it sends no heartbeats
    /// meanwhile).
    syncing: bool,
    /// Which of its syncs is the waiting one: only that one's end (answered,
    /// expired or cancelled) may clear `syncing` (an earlier sync whose
    /// connection is found gone after a new sync was sent must not).
    sync: u64,
    /// Its session counts from here at the latest: the end of a round, or
    /// the answer to a sync it waited in (it heartbeats again from there).
    since: Instant,
    /// Its session timeout in the timer.
    session_timer: Option<TaskHandle>,
    /// Which of its session timers is the current one: only that one may
    /// expire it (one that fired as it was moved, and ran after, must not).
    timer: u64,
}

impl Member {
    /// Its session counts from `now` (the end of a join or sync it waited
    /// in): its timer, which may have been moved past the wait, is moved
    /// back to a session from now.
    fn restart(&mut self, now: Instant) {
        self.since = now;
        if let Some(t) = &self.session_timer {
            t.reset_at(now + self.session);
        }
    }

    /// The bytes its protocols keep.
    fn kept(&self) -> usize {
        protocols_bytes(&self.protocols)
            + self.protocol_type.len()
            + self.client_id.len()
            + self.client_host.len()
    }
}

fn protocols_bytes(protocols: &[(StrBytes, Bytes)]) -> usize {
    protocols.iter().map(|(n, m)| n.len() + m.len() + 64).sum()
}

struct Group {
    phase: Phase,
    generation: i32,
    /// Join rounds completed; a join waits for the round after the one it
    /// joined in.
    rounds: u64,
    /// When the round under way ends, joined or not.
    deadline: Instant,
    protocol_type: Option<StrBytes>,
    protocol: Option<StrBytes>,
    leader: Option<StrBytes>,
    members: BTreeMap<StrBytes, Member>,
    /// Ids handed out with `MEMBER_ID_REQUIRED`, not joined yet, with their
    /// expiry in the timer.
    pending: HashMap<StrBytes, TaskHandle>,
    assignments: HashMap<StrBytes, Bytes>,
    /// Committed: offset, leader epoch (-1 when the commit gave none) and
    /// metadata, by topic and partition.
    offsets: HashMap<(StrBytes, i32), (i64, i32, Option<StrBytes>)>,
    /// How many members speak each protocol: those every member speaks are
    /// the candidates, found without comparing every member's list with
    /// every other's (a join naming thousands of protocols stays linear).
    speakers: HashMap<StrBytes, usize>,
    /// Ends the round under way at its deadline, even when no join of it is
    /// still waiting (their clients hung up), and the round it is for.
    round_timer: Option<(u64, TaskHandle)>,
    /// Bytes kept by members' protocols and the assignments, shared across
    /// the coordinator's groups.
    kept: Arc<AtomicUsize>,
    /// Which group of this id it is (a forgotten group's timers must not
    /// reach a later one).
    incarnation: u64,
}

impl Group {
    fn new(kept: Arc<AtomicUsize>, incarnation: u64) -> Group {
        Group {
            phase: Phase::Empty,
            generation: 0,
            rounds: 0,
            deadline: Instant::now(),
            protocol_type: None,
            protocol: None,
            leader: None,
            members: BTreeMap::new(),
            pending: HashMap::new(),
            assignments: HashMap::new(),
            offsets: HashMap::new(),
            speakers: HashMap::new(),
            round_timer: None,
            kept,
            incarnation,
        }
    }

    /// Counts `m`'s protocols in (`add`) or out of the speakers, and its
    /// bytes in or out of what is kept.
    fn count(&mut self, m: &Member, add: bool) {
        for (name, _) in &m.protocols {
            if add {
                *self.speakers.entry(name.clone()).or_default() += 1;
            } else if let Some(n) = self.speakers.get_mut(name) {
                *n -= 1;
                if *n == 0 {
                    self.speakers.remove(name);
                }
            }
        }
        if add {
            self.kept.fetch_add(m.kept(), Ordering::Relaxed);
        } else {
            self.kept.fetch_sub(m.kept(), Ordering::Relaxed);
        }
    }

    /// Whether every member speaks `name`.
    fn all_speak(&self, name: &StrBytes) -> bool {
        self.speakers.get(name) == Some(&self.members.len())
    }

    /// Hands out `id` as a member id not joined yet, counting what it keeps.
    fn add_pending(&mut self, id: StrBytes, expiry: TaskHandle) {
        self.kept
            .fetch_add(PENDING_COST + id.len(), Ordering::Relaxed);
        self.pending.insert(id, expiry);
    }

    /// Forgets a member id handed out (joined, left or expired), giving back
    /// what it kept and cancelling its expiry; whether it was pending.
    fn forget_pending(&mut self, id: &StrBytes) -> bool {
        match self.pending.remove_entry(id) {
            Some((id, expiry)) => {
                expiry.cancel();
                self.kept
                    .fetch_sub(PENDING_COST + id.len(), Ordering::Relaxed);
                true
            }
            None => false,
        }
    }

    /// Forgets the assignments, giving back what they kept.
    fn clear_assignments(&mut self) {
        let bytes: usize = self
            .assignments
            .iter()
            .map(|(id, a)| id.len() + a.len() + 64)
            .sum();
        self.kept.fetch_sub(bytes, Ordering::Relaxed);
        self.assignments.clear();
    }

    /// Starts a rebalance round, if none is under way: every member must
    /// join again before the deadline.
    fn prepare(&mut self) {
        if self.phase == Phase::Preparing {
            return;
        }
        self.phase = Phase::Preparing;
        let longest = self
            .members
            .values()
            .map(|m| m.rebalance)
            .max()
            .unwrap_or(Duration::ZERO);
        self.deadline = Instant::now() + longest;
        self.clear_assignments();
        let now = Instant::now();
        for m in self.members.values_mut() {
            m.joined = false;
            if std::mem::take(&mut m.syncing) {
                m.restart(now);
            }
        }
    }

    /// The group's state as Kafka names it.
    fn state(&self) -> &'static str {
        state_name(self.phase)
    }

    fn all_joined(&self) -> bool {
        !self.members.is_empty() && self.members.values().all(|m| m.joined)
    }

    /// Ends the round: members that did not join are dropped, a new
    /// generation begins with the rest (or the group is empty).
    fn complete_join(&mut self) {
        let gone: Vec<StrBytes> = self
            .members
            .iter()
            .filter(|(_, m)| !m.joined)
            .map(|(id, _)| id.clone())
            .collect();
        for id in gone {
            self.remove(&id);
        }
        self.generation += 1;
        self.rounds += 1;
        if self.members.is_empty() {
            self.phase = Phase::Empty;
            self.protocol = None;
            self.protocol_type = None;
            self.leader = None;
            self.end_round_timer();
            return;
        }
        if !self
            .leader
            .as_ref()
            .is_some_and(|l| self.members.contains_key(l))
        {
            self.leader = self.members.keys().next().cloned();
        }
        // Kafka's vote: each member votes for the protocol it prefers most
        // among those every member speaks; the most votes win (a tie goes to
        // the leader's preference).
        let mut votes: HashMap<&StrBytes, usize> = HashMap::new();
        for m in self.members.values() {
            if let Some((name, _)) = m.protocols.iter().find(|(n, _)| self.all_speak(n)) {
                *votes.entry(name).or_default() += 1;
            }
        }
        let leader = &self.members[self.leader.as_ref().unwrap()];
        let mut best: Option<(&StrBytes, usize)> = None;
        for (name, _) in &leader.protocols {
            let n = votes.get(name).copied().unwrap_or(0);
            if n > 0 && best.is_none_or(|(_, b)| n > b) {
                best = Some((name, n));
            }
        }
        self.protocol = best.map(|(name, _)| name.clone());
        self.protocol_type = Some(leader.protocol_type.clone());
        self.phase = Phase::Completing;
        let now = Instant::now();
        for m in self.members.values_mut() {
            m.restart(now);
        }
        self.end_round_timer();
    }

    /// The round's timer is done with: the round ended.
    fn end_round_timer(&mut self) {
        if let Some((_, t)) = self.round_timer.take() {
            t.cancel();
        }
    }

    /// Drops a member (its session timer with it).
    fn remove(&mut self, id: &StrBytes) -> bool {
        match self.members.remove(id) {
            Some(m) => {
                self.count(&m, false);
                if let Some(t) = m.session_timer {
                    t.cancel();
                }
                true
            }
            None => false,
        }
    }

    /// What a member that left or expired leaves behind: a rebalance of the
    /// others, or an empty group.
    fn after_removal(&mut self) {
        if self.members.is_empty() {
            if self.phase != Phase::Empty {
                self.generation += 1;
                self.rounds += 1;
            }
            self.phase = Phase::Empty;
            self.leader = None;
            self.protocol = None;
            // As when a round ends with no member: the type is a member's
            // (up to 32 KiB), not counted in what groups keep once no
            // member holds it.
            self.protocol_type = None;
            self.clear_assignments();
            self.end_round_timer();
        } else if self.phase == Phase::Preparing {
            if self.all_joined() {
                self.complete_join();
            }
        } else {
            self.prepare();
        }
    }

    /// The answer to `member`'s join of the round that has completed. It
    /// shares the group's bytes (a leader's, every member's metadata); the
    /// server charges its encoding to the memory budget before making it
    /// (`server::charged`), as it is sent again to each join that asks.
    fn join_answer(&self, member: &StrBytes) -> JoinGroupResponse {
        if !self.members.contains_key(member) {
            return JoinGroupResponse::default()
                .with_error_code(ResponseError::UnknownMemberId.code())
                .with_member_id(member.clone())
                .with_generation_id(-1);
        }
        let leader = self.leader.clone().unwrap_or_default();
        let mut r = JoinGroupResponse::default()
            .with_generation_id(self.generation)
            .with_protocol_type(self.protocol_type.clone())
            .with_protocol_name(self.protocol.clone())
            .with_leader(leader.clone())
            .with_member_id(member.clone());
        if *member == leader {
            let protocol = self.protocol.clone().unwrap_or_default();
            r.members = self
                .members
                .iter()
                .map(|(id, m)| {
                    let metadata = m
                        .protocols
                        .iter()
                        .find(|(n, _)| *n == protocol)
                        .map(|(_, md)| md.clone())
                        .unwrap_or_default();
                    JoinGroupResponseMember::default()
                        .with_member_id(id.clone())
                        .with_metadata(metadata)
                })
                .collect();
        }
        r
    }

    /// Checks a member's generation: `Ok` when it is current.
    fn check_member(&self, member: &StrBytes, generation: i32) -> Result<(), ResponseError> {
        if !self.members.contains_key(member) {
            return Err(ResponseError::UnknownMemberId);
        }
        if generation != self.generation {
            return Err(ResponseError::IllegalGeneration);
        }
        Ok(())
    }
}

/// A group forgotten takes its round's timer with it: a later group of the
/// same id starts its rounds again from 0, and must not be ended by it.
impl Drop for Group {
    fn drop(&mut self) {
        self.end_round_timer();
    }
}

type Groups = Mutex<HashMap<StrBytes, Group>>;

/// A copy of a string from a request, for keeping: the decoder hands out
/// slices of the request's frame, and one kept slice would keep the whole
/// frame (up to the largest request taken) alive for as long as it is kept.
fn own(s: &StrBytes) -> StrBytes {
    StrBytes::from_string(s.to_string())
}

/// A copy of bytes from a request, for keeping (see [`own`]).
fn own_bytes(b: &Bytes) -> Bytes {
    Bytes::copy_from_slice(b)
}

/// Forgets `id` if nothing is left of it (no member, no id handed out, no
/// committed offset): a group exists only while it holds something, so
/// requests for made-up groups leave nothing behind.
fn tidy(groups: &mut HashMap<StrBytes, Group>, id: &StrBytes) {
    if groups.get(id).is_some_and(|g| {
        g.phase == Phase::Empty
            && g.members.is_empty()
            && g.pending.is_empty()
            && g.offsets.is_empty()
    }) {
        groups.remove(id);
    }
}

/// A phase as Kafka names the group's state.
fn state_name(phase: Phase) -> &'static str {
    match phase {
        Phase::Empty => "Empty",
        Phase::Preparing => "PreparingRebalance",
        Phase::Completing => "CompletingRebalance",
        Phase::Stable => "Stable",
    }
}

/// A join waiting for its round to end (Kafka's `DelayedJoin`, one per
/// member here: each completes with its own answer).
pub struct DelayedJoin {
    groups: Arc<Groups>,
    closing: Arc<AtomicBool>,
    group: StrBytes,
    /// Which group of this id it joined (one deleted or forgotten and made
    /// again is another: its rounds count from 0 again).
    incarnation: u64,
    member: StrBytes,
    /// The rounds completed when it joined.
    round: u64,
}

impl Operation for DelayedJoin {
    type Output = JoinGroupResponse;

    fn try_complete(&mut self) -> Option<JoinGroupResponse> {
        if self.closing.load(Ordering::SeqCst) {
            return Some(error_join(ResponseError::NotCoordinator, &self.member));
        }
        let groups = self.groups.lock().unwrap();
        let Some(g) = (groups.get(&self.group)).filter(|g| g.incarnation == self.incarnation)
        else {
            return Some(error_join(ResponseError::UnknownMemberId, &self.member));
        };
        (g.rounds > self.round).then(|| g.join_answer(&self.member))
    }

    fn on_expiration(self) -> JoinGroupResponse {
        // The round's deadline: it ends with the members that joined (the
        // first of its joins to expire ends it; the others find it ended).
        let mut groups = self.groups.lock().unwrap();
        let Some(g) = (groups.get_mut(&self.group)).filter(|g| g.incarnation == self.incarnation)
        else {
            return error_join(ResponseError::UnknownMemberId, &self.member);
        };
        if g.rounds == self.round && g.phase == Phase::Preparing {
            g.complete_join();
        }
        let answer = g.join_answer(&self.member);
        tidy(&mut groups, &self.group);
        answer
    }
}

fn error_join(e: ResponseError, member: &StrBytes) -> JoinGroupResponse {
    JoinGroupResponse::default()
        .with_error_code(e.code())
        .with_generation_id(-1)
        .with_member_id(member.clone())
}

/// A follower's sync waiting for the leader's assignments.
pub struct DelayedSync {
    groups: Arc<Groups>,
    closing: Arc<AtomicBool>,
    group: StrBytes,
    /// Which group of this id it synced with (see [`DelayedJoin`]).
    incarnation: u64,
    member: StrBytes,
    generation: i32,
    /// Its member's `sync` while it is the member's waiting sync.
    token: u64,
}

impl Operation for DelayedSync {
    type Output = SyncGroupResponse;

    fn try_complete(&mut self) -> Option<SyncGroupResponse> {
        if self.closing.load(Ordering::SeqCst) {
            return Some(error_sync(ResponseError::NotCoordinator));
        }
        let groups = self.groups.lock().unwrap();
        let Some(g) = (groups.get(&self.group)).filter(|g| g.incarnation == self.incarnation)
        else {
            return Some(error_sync(ResponseError::UnknownMemberId));
        };
        if g.generation != self.generation || g.phase == Phase::Preparing {
            return Some(error_sync(ResponseError::RebalanceInProgress));
        }
        match g.phase {
            Phase::Stable => Some(sync_answer(g, &self.member)),
            Phase::Empty => Some(error_sync(ResponseError::UnknownMemberId)),
            _ => None,
        }
    }

    fn on_expiration(self) -> SyncGroupResponse {
        error_sync(ResponseError::RebalanceInProgress)
    }
}

/// A follower's sync that goes unanswered by the leader's assignments (it
/// expired, or its client hung up and it was cancelled) no longer keeps its
/// member alive: its session counts from here, as Kafka removes members that
/// have not synced within the rebalance timeout. (Kept `syncing`, a member
/// gone would be kept for as long as its leader heartbeats without syncing.)
/// Answered by the leader's sync or a new round, it finds `syncing` cleared
/// already; superseded by a later sync of its member, it leaves `syncing`
/// to that one.
impl Drop for DelayedSync {
    fn drop(&mut self) {
        let Ok(mut groups) = self.groups.lock() else {
            return;
        };
        let Some(g) = (groups.get_mut(&self.group)).filter(|g| g.incarnation == self.incarnation)
        else {
            return;
        };
        if g.generation != self.generation || g.phase != Phase::Completing {
            return;
        }
        // Only if it is still the member's waiting sync: a later one (sent
        // again, on a new connection) keeps its member alive.
        if let Some(m) = g.members.get_mut(&self.member) {
            if m.sync == self.token && std::mem::take(&mut m.syncing) {
                m.restart(Instant::now());
            }
        }
    }
}

fn error_sync(e: ResponseError) -> SyncGroupResponse {
    SyncGroupResponse::default().with_error_code(e.code())
}

/// The member's assignment, shared with the group; its encoding is charged
/// by the server before it is made (see [`Group::join_answer`]).
fn sync_answer(g: &Group, member: &StrBytes) -> SyncGroupResponse {
    SyncGroupResponse::default()
        .with_protocol_type(g.protocol_type.clone())
        .with_protocol_name(g.protocol.clone())
        .with_assignment(g.assignments.get(member).cloned().unwrap_or_default())
}

/// Who sent a join. Kafka keeps a member's client id and address, and
/// DescribeGroups shows them.
pub struct Caller {
    /// The member id's prefix, as in Kafka: the client id, cut short and
    /// kept to plain characters.
    pub prefix: String,
    /// The client id of the request's header, whole (copied out of the
    /// frame).
    pub client_id: StrBytes,
    /// The client's address as Kafka shows it (`/127.0.0.1`).
    pub host: StrBytes,
}

/// The least a waiting member's session timer is moved on when it fires.
const REARM_AFTER: Duration = Duration::from_millis(100);

/// The coordinator.
pub struct Coordinator {
    groups: Arc<Groups>,
    pub joins: Purgatory<StrBytes, DelayedJoin>,
    pub syncs: Purgatory<StrBytes, DelayedSync>,
    /// Session timeouts and pending member ids' expiry.
    pub sessions: Timer,
    closing: Arc<AtomicBool>,
    limits: GroupLimits,
    /// Committed offsets held, across groups, and the bytes they keep.
    offsets: AtomicUsize,
    offset_bytes: AtomicUsize,
    /// Bytes kept by members' protocols and assignments, across groups.
    kept: Arc<AtomicUsize>,
    next_id: AtomicU64,
    me: Weak<Coordinator>,
}

impl Coordinator {
    pub fn new(
        joins: Purgatory<StrBytes, DelayedJoin>,
        syncs: Purgatory<StrBytes, DelayedSync>,
        sessions: Timer,
        closing: Arc<AtomicBool>,
        limits: GroupLimits,
    ) -> Arc<Coordinator> {
        Arc::new_cyclic(|me| Coordinator {
            groups: Arc::new(Mutex::new(HashMap::new())),
            joins,
            syncs,
            sessions,
            closing,
            limits,
            offsets: AtomicUsize::new(0),
            offset_bytes: AtomicUsize::new(0),
            kept: Arc::new(AtomicUsize::new(0)),
            next_id: AtomicU64::new(1),
            me: me.clone(),
        })
    }

    /// Arms the timer that ends `g`'s round at its deadline, if a round is
    /// under way and its timer is not armed yet (under the groups' lock).
    /// The round's joins end it too when they expire, but a join whose client
    /// hung up is cancelled: without this, a round whose joins all went would
    /// never end, and the members that did not join would never be dropped.
    fn arm_round(&self, group: &StrBytes, g: &mut Group) {
        if g.phase != Phase::Preparing
            || g.round_timer.as_ref().is_some_and(|(r, _)| *r == g.rounds)
        {
            return;
        }
        if let Some((_, old)) = g.round_timer.take() {
            old.cancel();
        }
        let (me, gid, round, incarnation) =
            (self.me.clone(), group.clone(), g.rounds, g.incarnation);
        if let Ok(t) = self.sessions.schedule_at(g.deadline, move || {
            if let Some(c) = me.upgrade() {
                c.round_deadline(&gid, incarnation, round);
            }
        }) {
            g.round_timer = Some((round, t));
        }
    }

    /// The deadline of `group`'s round `round` passed: it ends with the
    /// members that joined, if it has not ended yet.
    fn round_deadline(&self, group: &StrBytes, incarnation: u64, round: u64) {
        {
            let mut groups = self.groups.lock().unwrap();
            let Some(g) = groups.get_mut(group) else {
                return;
            };
            if g.incarnation != incarnation || g.rounds != round || g.phase != Phase::Preparing {
                return;
            }
            g.complete_join();
            tidy(&mut groups, group);
        }
        self.wake(group);
    }

    /// Checks every waiting join and sync of `group` (after a change made
    /// with the groups' lock released).
    fn wake(&self, group: &StrBytes) {
        self.syncs.try_complete_watched(group);
        self.joins.try_complete_watched(group);
    }

    /// Answers every waiting join and sync (at shutdown, with `closing` set).
    pub fn wake_all(&self) {
        let ids: Vec<StrBytes> = self.groups.lock().unwrap().keys().cloned().collect();
        for id in ids {
            self.wake(&id);
        }
    }

    /// (Re)starts `member`'s session countdown, under the groups' lock.
    fn touch(&self, group: &StrBytes, member: &StrBytes, m: &mut Member) {
        self.touch_at(group, member, m, Instant::now() + m.session);
    }

    /// Moves `member`'s session timer to `at`, under the groups' lock.
    ///
    /// `group` and `member` are kept by the timer: they must be the ids the
    /// coordinator keeps (the groups' and members' keys), not slices of a
    /// request (which would keep its whole frame) or copies of their own.
    fn touch_at(&self, group: &StrBytes, member: &StrBytes, m: &mut Member, at: Instant) {
        if let Some(t) = &m.session_timer {
            if t.reset_at(at) {
                return;
            }
        }
        // Its timer fired (its expiry may be waiting for the groups' lock,
        // and finds a newer timer stands) or there is none: a new one, the
        // only one that may expire it. The one it replaces is cancelled.
        if let Some(old) = m.session_timer.take() {
            old.cancel();
        }
        let timer = self.next_id.fetch_add(1, Ordering::Relaxed);
        m.timer = timer;
        let (me, g, id) = (self.me.clone(), group.clone(), member.clone());
        m.session_timer = self
            .sessions
            .schedule_at(at, move || {
                if let Some(c) = me.upgrade() {
                    c.session_expired(&g, &id, timer);
                }
            })
            .ok();
    }

    fn session_expired(&self, group: &StrBytes, member: &StrBytes, timer: u64) {
        {
            let mut groups = self.groups.lock().unwrap();
            let Some(g) = groups.get_mut(group) else {
                return;
            };
            // A timer replaced after it fired (a heartbeat moved it as it
            // fired): the newer one stands.
            if g.members.get(member).is_none_or(|m| m.timer != timer) {
                return;
            }
            // A member whose join or sync is waiting sends no heartbeats
            // meanwhile (clients stop them during a rebalance): kept alive
            // until the round ends, as Kafka keeps members awaiting a join
            // or a sync. One that is not waiting (a leader that never sends
            // its sync, a follower that never syncs) must heartbeat: its
            // session counts from the end of the round at the latest.
            //
            // A waiting member's timer is moved past its wait, not a session
            // on (a session may be 0 ms: it would fire at every turn of the
            // reaper for the whole wait); the end of the wait moves it back
            // to a session from then (`Member::restart`). A join waits until
            // the round's deadline at the latest; a sync up to its
            // rebalance timeout.
            let now = Instant::now();
            let deadline = g.deadline;
            let next = g.members.get(member).and_then(|m| {
                if now < m.since + m.session {
                    return Some(m.since + m.session);
                }
                // At least a little later: never a busy loop.
                let waits = match g.phase {
                    Phase::Preparing if m.joined => deadline + m.session,
                    Phase::Completing if m.syncing => now + m.session.max(m.rebalance),
                    _ => return None,
                };
                Some(waits.max(now + REARM_AFTER))
            });
            if let Some(at) = next {
                if let Some(m) = g.members.get_mut(member) {
                    // This entry has fired: a new one.
                    self.touch_at(group, member, m, at);
                }
                return;
            }
            if !g.remove(member) {
                return;
            }
            tracing::info!(group = %group.as_str(), member = %member.as_str(), "session expired");
            g.after_removal();
            self.arm_round(group, g);
            tidy(&mut groups, group);
        }
        self.wake(group);
    }

    fn pending_expired(&self, group: &StrBytes, member: &StrBytes) {
        let mut groups = self.groups.lock().unwrap();
        if let Some(g) = groups.get_mut(group) {
            g.forget_pending(member);
        }
        tidy(&mut groups, group);
    }

    /// Handles a join from `caller`.
    ///
    /// A join that waits lets go of its request (and so of its frame) first,
    /// and tells `keep` what it holds meanwhile.
    pub async fn join(
        &self,
        r: JoinGroupRequest,
        version: i16,
        caller: &Caller,
        keep: impl FnOnce(usize),
    ) -> Result<JoinGroupResponse, Gone> {
        let session = Duration::from_millis(r.session_timeout_ms.max(0) as u64);
        // Before version 1 the rebalance timeout is the session timeout.
        let rebalance = if version >= 1 {
            Duration::from_millis(r.rebalance_timeout_ms.max(0) as u64)
        } else {
            session
        };
        let joined = {
            let mut groups = self.groups.lock().unwrap();
            let joined = (|| {
                let asked = &r.group_id.0;
                if asked.is_empty() {
                    return Err(Box::new(error_join(
                        ResponseError::InvalidGroupId,
                        &r.member_id,
                    )));
                }
                if session < self.limits.min_session || session > self.limits.max_session {
                    return Err(Box::new(error_join(
                        ResponseError::InvalidSessionTimeout,
                        &r.member_id,
                    )));
                }
                if !groups.contains_key(asked) {
                    if groups.len() >= self.limits.max_groups {
                        return Err(Box::new(error_join(
                            ResponseError::CoordinatorNotAvailable,
                            &r.member_id,
                        )));
                    }
                    groups.insert(
                        own(asked),
                        Group::new(
                            self.kept.clone(),
                            self.next_id.fetch_add(1, Ordering::Relaxed),
                        ),
                    );
                }
                // The group's id as the map keeps it (up to 32,767 bytes):
                // the one copy, shared by whatever of the group is kept
                // (timers, a join that waits). A copy made per request would
                // be kept by each of them, uncharged.
                let group = groups
                    .get_key_value(asked)
                    .map(|(id, _)| id.clone())
                    .unwrap();
                let g = groups.get_mut(&group).unwrap();
                // Kafka's `supportsProtocols`: into an empty group, any
                // protocols of a named type; into one with members, of the
                // group's type, with one every member speaks (counted, not
                // compared member by member). A member joining again is
                // counted out of the speakers first.
                // A protocol named twice counts once (the first): counted
                // twice, it would look spoken by a member that does not.
                let mut named = std::collections::HashSet::new();
                let protocols: Vec<(StrBytes, Bytes)> = r
                    .protocols
                    .iter()
                    .filter(|p| named.insert(&p.name))
                    .map(|p| (own(&p.name), own_bytes(&p.metadata)))
                    .collect();
                let again = g.members.get(&r.member_id);
                let consistent = !protocols.is_empty()
                    && if g.members.is_empty() || (g.members.len() == 1 && again.is_some()) {
                        !r.protocol_type.is_empty()
                    } else {
                        g.protocol_type
                            .as_ref()
                            .is_none_or(|t| *t == r.protocol_type)
                            && protocols.iter().any(|(name, _)| {
                                let others = g.members.len() - usize::from(again.is_some());
                                let mut speak = g.speakers.get(name).copied().unwrap_or(0);
                                if again.is_some_and(|m| m.protocols.iter().any(|(n, _)| n == name))
                                {
                                    speak -= 1;
                                }
                                speak == others
                            })
                    };
                if !consistent {
                    return Err(Box::new(error_join(
                        ResponseError::InconsistentGroupProtocol,
                        &r.member_id,
                    )));
                }
                let known = g.members.len() + g.pending.len();
                let member = if r.member_id.is_empty() {
                    if known >= self.limits.max_members {
                        return Err(Box::new(error_join(
                            ResponseError::GroupMaxSizeReached,
                            &r.member_id,
                        )));
                    }
                    let id = StrBytes::from_string(format!(
                        "{}-{}",
                        caller.prefix,
                        self.next_id.fetch_add(1, Ordering::Relaxed)
                    ));
                    if version >= 4 {
                        // Kafka's two-step join: the member comes back with its
                        // id. What the id keeps until then is within the bound
                        // across groups.
                        if self.kept.load(Ordering::Relaxed) + PENDING_COST + id.len()
                            > self.limits.max_kept_bytes
                        {
                            return Err(Box::new(error_join(
                                ResponseError::CoordinatorLoadInProgress,
                                &r.member_id,
                            )));
                        }
                        let (me, gid, mid) = (self.me.clone(), group.clone(), id.clone());
                        if let Ok(t) = self.sessions.schedule(session, move || {
                            if let Some(c) = me.upgrade() {
                                c.pending_expired(&gid, &mid);
                            }
                        }) {
                            g.add_pending(id.clone(), t);
                        }
                        return Err(Box::new(error_join(ResponseError::MemberIdRequired, &id)));
                    }
                    id
                } else {
                    own(&r.member_id)
                };
                if !g.pending.contains_key(&member)
                    && !g.members.contains_key(&member)
                    && !r.member_id.is_empty()
                {
                    return Err(Box::new(error_join(
                        ResponseError::UnknownMemberId,
                        &r.member_id,
                    )));
                }
                // What its protocols would keep, within the bound across
                // groups (a member joining again gives its old ones back).
                // A member keeps the client id and address of its first join,
                // as Kafka's does (they are not changed after).
                let client = match g.members.get(&member) {
                    Some(m) => m.client_id.len() + m.client_host.len(),
                    None => caller.client_id.len() + caller.host.len(),
                };
                let adds = protocols_bytes(&protocols) + r.protocol_type.len() + client;
                let frees = g.members.get(&member).map_or(0, Member::kept);
                if self.kept.load(Ordering::Relaxed) + adds > self.limits.max_kept_bytes + frees {
                    return Err(Box::new(error_join(
                        ResponseError::CoordinatorLoadInProgress,
                        &r.member_id,
                    )));
                }
                g.forget_pending(&member);
                // Kafka's rule for a member already in a generation that joins
                // again with the same metadata (it may have missed the answer,
                // or its client rejoins out of caution): in Stable, a follower
                // gets the current generation back and nothing rebalances; in
                // CompletingRebalance, any member does (the leader with the
                // members again). Only a leader in Stable, or a change of
                // metadata, begins a round.
                if let Some(m) = g.members.get_mut(&member) {
                    let same = m.protocols == protocols && m.protocol_type == r.protocol_type;
                    let leads = g.leader.as_ref() == Some(&member);
                    let current = match g.phase {
                        Phase::Stable => same && !leads,
                        Phase::Completing => same,
                        _ => false,
                    };
                    if current {
                        self.touch(&group, &member, m);
                        let mut answer = g.join_answer(&member);
                        if g.phase == Phase::Stable {
                            answer.members.clear();
                        }
                        return Err(Box::new(answer));
                    }
                }
                let fresh = !g.members.contains_key(&member);
                let mut m = g.members.remove(&member).unwrap_or(Member {
                    // Counted in below, with the protocols.
                    client_id: StrBytes::default(),
                    client_host: StrBytes::default(),
                    session,
                    rebalance,
                    // Counted in below, with the protocols.
                    protocol_type: StrBytes::default(),
                    protocols: Vec::new(),
                    joined: false,
                    syncing: false,
                    sync: 0,
                    since: Instant::now(),
                    session_timer: None,
                    timer: 0,
                });
                g.count(&m, false);
                m.session = session;
                m.rebalance = rebalance;
                m.protocol_type = own(&r.protocol_type);
                m.protocols = protocols;
                if fresh {
                    m.client_id = caller.client_id.clone();
                    m.client_host = caller.host.clone();
                }
                g.count(&m, true);
                g.members.insert(member.clone(), m);
                // This join begins a round (the other members learn it from
                // their heartbeats and join again), unless one is under way.
                let started = g.phase != Phase::Preparing;
                g.prepare();
                let m = g.members.get_mut(&member).unwrap();
                m.joined = true;
                self.touch(&group, &member, m);
                let round = g.rounds;
                let completed = g.all_joined();
                if completed {
                    g.complete_join();
                } else {
                    self.arm_round(&group, g);
                }
                Ok((
                    group,
                    g.incarnation,
                    member,
                    round,
                    g.deadline,
                    started || completed,
                ))
            })();
            // A refused join leaves no group behind.
            tidy(&mut groups, &r.group_id.0);
            joined
        };
        let (group, incarnation, member, round, deadline, changed) = match joined {
            Ok(j) => j,
            Err(answer) => return Ok(*answer),
        };
        drop(r);
        keep(std::mem::size_of::<DelayedJoin>() + member.len());
        if changed {
            // Syncs waiting on the old generation answer, and joins waiting
            // on the round that just ended complete.
            self.wake(&group);
        }
        let op = DelayedJoin {
            groups: self.groups.clone(),
            closing: self.closing.clone(),
            group: group.clone(),
            incarnation,
            member,
            round,
        };
        match self.joins.try_complete_else_watch_at(op, deadline, [group]) {
            Ok(handle) => match handle.await {
                Ok(Completion::Completed(r) | Completion::Expired(r)) => Ok(r),
                Err(_) => Err(Gone),
            },
            Err(refused) => Ok(error_join(
                ResponseError::NotCoordinator,
                &refused.into_inner().member,
            )),
        }
    }

    /// Handles a sync. A follower's sync that waits lets go of its request
    /// (and so of its frame) first, and tells `keep` what it holds meanwhile.
    pub async fn sync(
        &self,
        r: SyncGroupRequest,
        keep: impl FnOnce(usize),
    ) -> Result<SyncGroupResponse, Gone> {
        // Kafka (`isValidGroupId`): an empty group id is INVALID_GROUP_ID.
        if r.group_id.is_empty() {
            return Ok(error_sync(ResponseError::InvalidGroupId));
        }
        let (group, incarnation, member, wait, led, token) = {
            let mut groups = self.groups.lock().unwrap();
            // The group's own id, shared with a sync that waits.
            let Some(group) = groups
                .get_key_value(&r.group_id.0)
                .map(|(id, _)| id.clone())
            else {
                return Ok(error_sync(ResponseError::UnknownMemberId));
            };
            let g = groups.get_mut(&group).unwrap();
            if let Err(e) = g.check_member(&r.member_id, r.generation_id) {
                return Ok(error_sync(e));
            }
            // KIP-559 (v5): a protocol type or name given must be the group's.
            let differs = |given: &Option<StrBytes>, group: &Option<StrBytes>| {
                given.as_ref().is_some_and(|t| group.as_ref() != Some(t))
            };
            if differs(&r.protocol_type, &g.protocol_type) || differs(&r.protocol_name, &g.protocol)
            {
                return Ok(error_sync(ResponseError::InconsistentGroupProtocol));
            }
            if g.phase == Phase::Preparing {
                return Ok(error_sync(ResponseError::RebalanceInProgress));
            }
            // Its id as the group keeps it (its session timer keeps it, and
            // a sync that waits: not a slice of the request's frame).
            let member = g
                .members
                .get_key_value(&r.member_id)
                .map(|(id, _)| id.clone())
                .unwrap();
            let m = g.members.get_mut(&member).unwrap();
            self.touch(&group, &member, m);
            let rebalance = m.rebalance;
            let mut led = false;
            if g.phase == Phase::Completing && g.leader.as_ref() == Some(&r.member_id) {
                // What the assignments keep, within the bound across groups
                // (a duplicate's last assignment is the one kept).
                let mut assignments: HashMap<StrBytes, Bytes> = HashMap::new();
                for a in r
                    .assignments
                    .iter()
                    .filter(|a| g.members.contains_key(&a.member_id))
                {
                    assignments.insert(a.member_id.clone(), a.assignment.clone());
                }
                let bytes: usize = assignments
                    .iter()
                    .map(|(id, a)| id.len() + a.len() + 64)
                    .sum();
                if self.kept.load(Ordering::Relaxed) + bytes > self.limits.max_kept_bytes {
                    return Ok(error_sync(ResponseError::CoordinatorNotAvailable));
                }
                self.kept.fetch_add(bytes, Ordering::Relaxed);
                g.clear_assignments();
                g.assignments = assignments
                    .iter()
                    .map(|(id, a)| (own(id), own_bytes(a)))
                    .collect();
                g.phase = Phase::Stable;
                // Followers waiting for the assignments heartbeat again from
                // their answer (Kafka's `propagateAssignment`).
                let now = Instant::now();
                for m in g.members.values_mut() {
                    if std::mem::take(&mut m.syncing) {
                        m.restart(now);
                    }
                }
                led = true;
            }
            if g.phase == Phase::Stable {
                let answer = sync_answer(g, &r.member_id);
                drop(groups);
                if led {
                    self.wake(&group);
                }
                return Ok(answer);
            }
            // A follower waiting for the assignments: kept alive meanwhile.
            // (Until its sync is answered or goes: `DelayedSync`'s drop.)
            let token = self.next_id.fetch_add(1, Ordering::Relaxed);
            if let Some(m) = g.members.get_mut(&member) {
                m.syncing = true;
                m.sync = token;
            }
            (group, g.incarnation, member, rebalance, led, token)
        };
        debug_assert!(!led);
        // A member's id: a few dozen bytes (it names a member).
        let generation = r.generation_id;
        drop(r);
        keep(std::mem::size_of::<DelayedSync>() + member.len());
        let op = DelayedSync {
            groups: self.groups.clone(),
            closing: self.closing.clone(),
            group: group.clone(),
            incarnation,
            member,
            generation,
            token,
        };
        match self.syncs.try_complete_else_watch(op, wait, [group]) {
            Ok(handle) => match handle.await {
                Ok(Completion::Completed(r) | Completion::Expired(r)) => Ok(r),
                Err(_) => Err(Gone),
            },
            Err(_) => Ok(error_sync(ResponseError::NotCoordinator)),
        }
    }

    pub fn heartbeat(&self, r: &HeartbeatRequest) -> HeartbeatResponse {
        let error = (|| {
            // Kafka (`isValidGroupId`): an empty group id is INVALID_GROUP_ID.
            if r.group_id.is_empty() {
                return Err(ResponseError::InvalidGroupId);
            }
            let mut groups = self.groups.lock().unwrap();
            let g = groups
                .get_mut(&r.group_id.0)
                .ok_or(ResponseError::UnknownMemberId)?;
            if !g.members.contains_key(&r.member_id) {
                return Err(ResponseError::UnknownMemberId);
            }
            let phase = g.phase;
            // Kafka checks the generation first, and a stale heartbeat
            // keeps nobody alive.
            if r.generation_id != g.generation {
                return Err(ResponseError::IllegalGeneration);
            }
            // The ids the coordinator keeps, for its session timer (slices
            // of the request would keep its whole frame for a session).
            let (group, _) = groups.get_key_value(&r.group_id.0).unwrap();
            let group = group.clone();
            let g = groups.get_mut(&group).unwrap();
            let (member, _) = g.members.get_key_value(&r.member_id).unwrap();
            let member = member.clone();
            let m = g.members.get_mut(&member).unwrap();
            self.touch(&group, &member, m);
            if phase == Phase::Preparing {
                return Err(ResponseError::RebalanceInProgress);
            }
            Ok(())
        })()
        .err();
        HeartbeatResponse::default().with_error_code(error.map_or(0, |e| e.code()))
    }

    pub fn leave(&self, r: &LeaveGroupRequest, version: i16) -> LeaveGroupResponse {
        // Kafka (`isValidGroupId`): an empty group id is INVALID_GROUP_ID, for
        // the whole request (no member answered).
        if r.group_id.is_empty() {
            return LeaveGroupResponse::default()
                .with_error_code(ResponseError::InvalidGroupId.code());
        }
        let ids: Vec<StrBytes> = if version <= 2 {
            vec![r.member_id.clone()]
        } else {
            r.members.iter().map(|m| m.member_id.clone()).collect()
        };
        let mut results = Vec::new();
        {
            let mut groups = self.groups.lock().unwrap();
            // The group's id as the map keeps it: a round's timer armed here
            // keeps it (a copy of the request's would be kept uncharged).
            let group = groups
                .get_key_value(&r.group_id.0)
                .map(|(id, _)| id.clone());
            match group
                .as_ref()
                .and_then(|id| Some((id, groups.get_mut(id)?)))
            {
                // Kafka: per member UNKNOWN_MEMBER_ID (v3 and later, under a
                // top-level NONE).
                None => results.extend(ids.iter().map(|id| (id.clone(), false))),
                Some((group, g)) => {
                    let mut any = false;
                    for id in &ids {
                        // A member id handed out and not joined yet leaves too.
                        let pending = g.forget_pending(id);
                        let gone = g.remove(id);
                        any |= gone;
                        results.push((id.clone(), gone || pending));
                    }
                    if any {
                        g.after_removal();
                        self.arm_round(group, g);
                    }
                }
            }
            tidy(&mut groups, &r.group_id.0);
        }
        self.wake(&r.group_id.0);
        let mut response = LeaveGroupResponse::default();
        if version <= 2 {
            if !results[0].1 {
                response.error_code = ResponseError::UnknownMemberId.code();
            }
        } else {
            response.members = results
                .into_iter()
                .map(|(id, gone)| {
                    MemberResponse::default()
                        .with_member_id(id)
                        .with_error_code(if gone {
                            0
                        } else {
                            ResponseError::UnknownMemberId.code()
                        })
                })
                .collect();
        }
        response
    }

    /// Stores committed offsets of partitions that exist (`exists` says
    /// which).
    pub fn commit(
        &self,
        r: &OffsetCommitRequest,
        exists: impl Fn(&str, i32) -> bool,
    ) -> OffsetCommitResponse {
        // Kafka takes commits for the empty group id ("for backwards
        // compatibility", `isValidGroupId`), unlike every other group request.
        // Looked up by the request's id: a copy is made only for a new group.
        let group = &r.group_id.0;
        let mut groups = self.groups.lock().unwrap();
        // A generation below 0: a commit from outside group management
        // (Kafka's "simple" consumers), whatever member id it names.
        let outside = r.generation_id_or_member_epoch < 0;
        let error = if !groups.contains_key(group) && !outside {
            // Kafka: a generation of a group it does not know.
            Some(ResponseError::IllegalGeneration)
        } else if !groups.contains_key(group) && groups.len() >= self.limits.max_groups {
            Some(ResponseError::CoordinatorNotAvailable)
        } else {
            if !groups.contains_key(group) {
                groups.insert(
                    own(group),
                    Group::new(
                        self.kept.clone(),
                        self.next_id.fetch_add(1, Ordering::Relaxed),
                    ),
                );
            }
            let g = groups.get_mut(group).unwrap();
            if outside && g.phase == Phase::Empty {
                // Stored, as Kafka's `validateOffsetCommit` returns early for
                // a generation below 0 on an empty group. To a group with
                // members it is checked as a member's (UNKNOWN_MEMBER_ID or
                // ILLEGAL_GENERATION), as there.
                None
            } else if let Err(e) = g.check_member(&r.member_id, r.generation_id_or_member_epoch) {
                Some(e)
            } else if g.phase == Phase::Completing {
                // Kafka stores commits while a rebalance prepares (members
                // commit before they rejoin), and refuses them until the
                // leader's assignments come.
                Some(ResponseError::RebalanceInProgress)
            } else {
                None
            }
        };
        let mut response = OffsetCommitResponse::default();
        for t in &r.topics {
            let mut rt = OffsetCommitResponseTopic::default().with_name(t.name.clone());
            for p in &t.partitions {
                let code = match error {
                    Some(e) => e.code(),
                    None => {
                        let g = groups.get_mut(group).unwrap();
                        let key = (own(&t.name.0), p.partition_index);
                        // Kafka counts `offset.metadata.max.bytes` (4096)
                        // against the Java string's length: UTF-16 units.
                        let metadata_ok = p
                            .committed_metadata
                            .as_ref()
                            .is_none_or(|m| m.encode_utf16().count() <= 4096);
                        let cost = |md: Option<&StrBytes>| {
                            OFFSET_COST + t.name.0.len() + md.map_or(0, |m| m.len())
                        };
                        let old = g.offsets.get(&key).map(|(_, _, md)| cost(md.as_ref()));
                        let is_new = old.is_none();
                        let new = cost(p.committed_metadata.as_ref());
                        if !metadata_ok {
                            ResponseError::OffsetMetadataTooLarge.code()
                        } else if t.name.0.len() > 249 {
                            ResponseError::InvalidTopicException.code()
                        } else if !exists(&t.name.0, p.partition_index) {
                            ResponseError::UnknownTopicOrPartition.code()
                        } else if (is_new
                            && self.offsets.load(Ordering::Relaxed) >= self.limits.max_offsets)
                            || self.offset_bytes.load(Ordering::Relaxed) + new
                                > self.limits.max_offset_bytes + old.unwrap_or(0)
                        {
                            ResponseError::InvalidCommitOffsetSize.code()
                        } else {
                            if is_new {
                                self.offsets.fetch_add(1, Ordering::Relaxed);
                            }
                            // Under the groups' lock: `old` is what it was.
                            self.offset_bytes.fetch_add(new, Ordering::Relaxed);
                            self.offset_bytes
                                .fetch_sub(old.unwrap_or(0), Ordering::Relaxed);
                            g.offsets.insert(
                                key,
                                (
                                    p.committed_offset,
                                    p.committed_leader_epoch,
                                    p.committed_metadata.as_ref().map(own),
                                ),
                            );
                            0
                        }
                    }
                };
                rt.partitions.push(
                    OffsetCommitResponsePartition::default()
                        .with_partition_index(p.partition_index)
                        .with_error_code(code),
                );
            }
            response.topics.push(rt);
        }
        // A refused commit leaves no group behind.
        tidy(&mut groups, group);
        response
    }

    /// The committed offsets asked for. The answer is charged first, by
    /// `charge`, with what building and writing it takes: a request names a
    /// partition in 4 bytes and its answer takes about 100 more, with up to
    /// 4 KiB of metadata (one naming the same partition a thousand times
    /// asks for a thousand copies). When the budget has no room for it, the
    /// answer is `COORDINATOR_LOAD_IN_PROGRESS`, which clients retry; a
    /// version 1 answer has no such error, and its connection is closed.
    pub fn fetch_offsets(
        &self,
        r: &OffsetFetchRequest,
        version: i16,
        mut charge: impl FnMut(usize) -> bool,
    ) -> Result<OffsetFetchResponse, Gone> {
        const PARTITION: usize = std::mem::size_of::<OffsetFetchResponsePartition>() + 64;
        const TOPIC: usize = std::mem::size_of::<OffsetFetchResponseTopic>() + 32;
        let groups = self.groups.lock().unwrap();
        let g = groups.get(&r.group_id.0);
        let metadata = |topic: &StrBytes, p: i32| {
            g.and_then(|g| g.offsets.get(&(topic.clone(), p)))
                .and_then(|(_, _, md)| md.as_ref())
                .map_or(0, |md| md.len())
        };
        let bytes: usize = match &r.topics {
            Some(ts) => ts
                .iter()
                .map(|t| {
                    TOPIC
                        + 2 * t.name.0.len()
                        + t.partition_indexes
                            .iter()
                            .map(|&p| PARTITION + 2 * metadata(&t.name.0, p))
                            .sum::<usize>()
                })
                .sum(),
            None => g.map_or(0, |g| {
                g.offsets
                    .iter()
                    .map(|((t, _), (_, _, md))| {
                        TOPIC + 2 * t.len() + PARTITION + 2 * md.as_ref().map_or(0, |m| m.len())
                    })
                    .sum()
            }),
        };
        if !charge(bytes) {
            tracing::debug!(
                bytes,
                "an offset fetch's answer has no room in the memory budget"
            );
            return if version >= 2 {
                Ok(OffsetFetchResponse::default()
                    .with_error_code(ResponseError::CoordinatorLoadInProgress.code()))
            } else {
                Err(Gone)
            };
        }
        let offset = |topic: &StrBytes, p: i32| {
            g.and_then(|g| g.offsets.get(&(topic.clone(), p)))
                .cloned()
                .unwrap_or((-1, -1, Some(StrBytes::default())))
        };
        let partition = |topic: &StrBytes, p: i32| {
            let (o, epoch, md) = offset(topic, p);
            OffsetFetchResponsePartition::default()
                .with_partition_index(p)
                .with_committed_offset(o)
                .with_committed_leader_epoch(epoch)
                .with_metadata(md.or(Some(StrBytes::default())))
        };
        let topics = match &r.topics {
            Some(ts) => ts
                .iter()
                .map(|t| {
                    OffsetFetchResponseTopic::default()
                        .with_name(t.name.clone())
                        .with_partitions(
                            t.partition_indexes
                                .iter()
                                .map(|&p| partition(&t.name.0, p))
                                .collect(),
                        )
                })
                .collect(),
            None => {
                // Every partition the group committed.
                let mut by_topic: BTreeMap<StrBytes, Vec<i32>> = BTreeMap::new();
                for (t, p) in g.map(|g| g.offsets.keys()).into_iter().flatten() {
                    by_topic.entry(t.clone()).or_default().push(*p);
                }
                by_topic
                    .into_iter()
                    .map(|(t, mut ps)| {
                        ps.sort_unstable();
                        OffsetFetchResponseTopic::default()
                            .with_name(TopicName(t.clone()))
                            .with_partitions(ps.iter().map(|&p| partition(&t, p)).collect())
                    })
                    .collect()
            }
        };
        Ok(OffsetFetchResponse::default().with_topics(topics))
    }

    /// The groups held, as Kafka's ListGroups lists them: every group with
    /// members, member ids handed out or committed offsets, with its
    /// protocol type (empty for a group with offsets only), its state (from
    /// version 4) and its type, `classic` (from version 5). A states or
    /// types filter keeps the groups whose state or type it names, compared
    /// without regard to case as Kafka compares them; an empty filter keeps
    /// every group.
    ///
    /// The answer grows with the groups held, not with the request, and is
    /// charged first by `charge` (ids of up to 32 KiB, a few thousand
    /// groups); with no room for it, it is `COORDINATOR_LOAD_IN_PROGRESS`,
    /// which clients retry.
    pub fn list_groups(
        &self,
        r: &ListGroupsRequest,
        charge: impl FnOnce(usize) -> bool,
    ) -> ListGroupsResponse {
        use kafka_protocol::messages::list_groups_response::ListedGroup;
        const GROUP: usize = std::mem::size_of::<ListedGroup>() + 64;
        // The filters read once, before the lock: each group is then a test
        // of its state against four answers (a filter of any length is not
        // scanned once per group held).
        let named = |filter: &[StrBytes], value: &str| {
            filter.is_empty() || filter.iter().any(|f| f.eq_ignore_ascii_case(value))
        };
        let phases = [
            Phase::Empty,
            Phase::Preparing,
            Phase::Completing,
            Phase::Stable,
        ];
        let states = phases.map(|p| named(&r.states_filter, state_name(p)));
        let classic = named(&r.types_filter, "classic");
        let groups = self.groups.lock().unwrap();
        let listed: Vec<(&StrBytes, &Group)> = groups
            .iter()
            .filter(|(_, g)| classic && states[phases.iter().position(|&p| p == g.phase).unwrap()])
            .collect();
        let bytes: usize = listed
            .iter()
            .map(|(id, g)| GROUP + 2 * (id.len() + g.protocol_type.as_ref().map_or(0, |t| t.len())))
            .sum();
        if !charge(bytes) {
            tracing::debug!(bytes, "a group list has no room in the memory budget");
            return ListGroupsResponse::default()
                .with_error_code(ResponseError::CoordinatorLoadInProgress.code());
        }
        ListGroupsResponse::default().with_groups(
            listed
                .into_iter()
                .map(|(id, g)| {
                    ListedGroup::default()
                        .with_group_id(GroupId(id.clone()))
                        .with_protocol_type(g.protocol_type.clone().unwrap_or_default())
                        .with_group_state(StrBytes::from_static_str(g.state()))
                        .with_group_type(StrBytes::from_static_str("classic"))
                })
                .collect(),
        )
    }

    /// Each group asked for, as Kafka's DescribeGroups describes it: its
    /// state, protocol type, and members with their client ids and
    /// addresses; in `Stable`, also the protocol chosen and each member's
    /// metadata for it and assignment. A group this coordinator does not
    /// hold is `Dead`, with no error, as Kafka answers before version 6.
    /// Each mention of a group is answered, as in Kafka.
    ///
    /// The answer carries what members sent (their metadata and
    /// assignments, up to the coordinator's bound on what it keeps) once per
    /// mention, so it is charged first by `charge`, costed once per group
    /// named (under the groups' lock, so the work before the charge grows
    /// with the request and the groups held, not with their product). With
    /// no room for it, each mention is answered `COORDINATOR_LOAD_IN_PROGRESS`,
    /// which clients retry, if there is room for that answer; else `Err`
    /// (the connection is closed; the client connects again and retries).
    pub fn describe_groups(
        &self,
        r: &DescribeGroupsRequest,
        mut charge: impl FnMut(usize) -> bool,
    ) -> Result<DescribeGroupsResponse, Gone> {
        use kafka_protocol::messages::describe_groups_response::{
            DescribedGroup, DescribedGroupMember,
        };
        const GROUP: usize = std::mem::size_of::<DescribedGroup>() + 64;
        const MEMBER: usize = std::mem::size_of::<DescribedGroupMember>() + 64;
        let groups = self.groups.lock().unwrap();
        // What one member shows: its metadata for the group's protocol and
        // its assignment, in Stable only (Kafka's `summary`).
        let shown = |g: &Group, id: &StrBytes, m: &Member| -> (Bytes, Bytes) {
            if g.phase != Phase::Stable {
                return (Bytes::new(), Bytes::new());
            }
            let metadata = (m.protocols.iter())
                .find(|(name, _)| Some(name) == g.protocol.as_ref())
                .map(|(_, md)| md.clone())
                .unwrap_or_default();
            let assignment = g.assignments.get(id).cloned().unwrap_or_default();
            (metadata, assignment)
        };
        // Each mention's own entry, built and encoded (refused or not).
        let base: usize = (r.groups.iter()).map(|id| GROUP + 2 * id.len()).sum();
        // What each group held adds to every mention of it, costed once.
        let mut costs: HashMap<&str, usize> = HashMap::new();
        let mut details = 0usize;
        for id in &r.groups {
            let cost = *costs.entry(&**id).or_insert_with(|| {
                groups.get(&id.0).map_or(0, |g| {
                    2 * (g.protocol_type.as_ref().map_or(0, |t| t.len())
                        + g.protocol.as_ref().map_or(0, |p| p.len()))
                        + (g.members.iter())
                            .map(|(mid, m)| {
                                let (md, a) = shown(g, mid, m);
                                MEMBER
                                    + 2 * (mid.len()
                                        + m.client_id.len()
                                        + m.client_host.len()
                                        + md.len()
                                        + a.len())
                            })
                            .sum::<usize>()
                })
            });
            details = details.saturating_add(cost);
        }
        let room = charge(base.saturating_add(details));
        if !room {
            tracing::debug!(
                bytes = base.saturating_add(details),
                "a group description has no room in the memory budget"
            );
            if !charge(base) {
                return Err(Gone);
            }
        }
        let described = (r.groups.iter())
            .map(|id| {
                let answer = DescribedGroup::default().with_group_id(id.clone());
                if !room {
                    return answer.with_error_code(ResponseError::CoordinatorLoadInProgress.code());
                }
                let Some(g) = groups.get(&id.0) else {
                    return answer.with_group_state(StrBytes::from_static_str("Dead"));
                };
                let protocol = match g.phase {
                    Phase::Stable => g.protocol.clone().unwrap_or_default(),
                    _ => StrBytes::default(),
                };
                answer
                    .with_group_state(StrBytes::from_static_str(g.state()))
                    .with_protocol_type(g.protocol_type.clone().unwrap_or_default())
                    .with_protocol_data(protocol)
                    .with_members(
                        (g.members.iter())
                            .map(|(mid, m)| {
                                let (metadata, assignment) = shown(g, mid, m);
                                DescribedGroupMember::default()
                                    .with_member_id(mid.clone())
                                    .with_client_id(m.client_id.clone())
                                    .with_client_host(m.client_host.clone())
                                    .with_member_metadata(metadata)
                                    .with_member_assignment(assignment)
                            })
                            .collect(),
                    )
            })
            .collect();
        Ok(DescribeGroupsResponse::default().with_groups(described))
    }

    /// Deletes each group named, as Kafka's DeleteGroups does (each name
    /// answered once, however often it is named): a group with no members
    /// goes with its committed offsets and the member ids handed out and not
    /// joined (their expiry cancelled; a join with one of them is then
    /// `UNKNOWN_MEMBER_ID`), what they kept given back to the coordinator's
    /// bounds; a group with members is `NON_EMPTY_GROUP`, one not held
    /// `GROUP_ID_NOT_FOUND`. The empty id is a group id like any other here,
    /// as Kafka keeps it for DeleteGroups (commits to it are stored).
    ///
    /// The answer (an entry per name) is charged first by `charge`; with no
    /// room for it nothing is deleted and `Err` closes the connection.
    pub fn delete_groups(
        &self,
        r: &DeleteGroupsRequest,
        charge: impl FnOnce(usize) -> bool,
    ) -> Result<DeleteGroupsResponse, Gone> {
        use kafka_protocol::messages::delete_groups_response::DeletableGroupResult;
        const RESULT: usize = std::mem::size_of::<DeletableGroupResult>() + 64;
        let mut named = std::collections::HashSet::new();
        let distinct: Vec<&GroupId> = (r.groups_names.iter())
            .filter(|id| named.insert(&id.0))
            .collect();
        let bytes: usize = distinct.iter().map(|id| RESULT + 2 * id.len()).sum();
        if !charge(bytes) {
            tracing::debug!(
                bytes,
                "a group deletion's answer has no room in the memory budget"
            );
            return Err(Gone);
        }
        let mut groups = self.groups.lock().unwrap();
        let results = (distinct.into_iter())
            .map(|id| {
                let error = match groups.get_mut(&id.0) {
                    None => Some(ResponseError::GroupIdNotFound),
                    Some(g) if !g.members.is_empty() || g.phase != Phase::Empty => {
                        Some(ResponseError::NonEmptyGroup)
                    }
                    Some(g) => {
                        let pending: Vec<StrBytes> = g.pending.keys().cloned().collect();
                        for p in &pending {
                            g.forget_pending(p);
                        }
                        for ((topic, _), (_, _, md)) in g.offsets.drain() {
                            let cost = OFFSET_COST + topic.len() + md.map_or(0, |m| m.len());
                            self.offsets.fetch_sub(1, Ordering::Relaxed);
                            self.offset_bytes.fetch_sub(cost, Ordering::Relaxed);
                        }
                        tidy(&mut groups, &id.0);
                        None
                    }
                };
                DeletableGroupResult::default()
                    .with_group_id(id.clone())
                    .with_error_code(error.map_or(0, |e| e.code()))
            })
            .collect();
        Ok(DeleteGroupsResponse::default().with_results(results))
    }

    /// Members and generation of a group, for the demonstration and tests.
    pub fn describe(&self, group: &str) -> Option<(i32, Vec<String>)> {
        let groups = self.groups.lock().unwrap();
        let g = groups.get(&StrBytes::from_string(group.to_string()))?;
        Some((
            g.generation,
            g.members.keys().map(|k| k.to_string()).collect(),
        ))
    }
}
