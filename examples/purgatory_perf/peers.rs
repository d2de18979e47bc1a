//! The peers this crate is measured against: a task per request, the fair
//! one-lock purgatory, and that purgatory under this crate's rules (no user
//! code under its lock), with `DelayQueue` or with this crate's wheel.

use super::*;

// ---- peer (a): a task per request, `tokio::time::timeout` on a signal, DashMap of watchers

/// A watcher of the task-per-request peer: when it completes, and its signal.
pub(crate) type Watcher = (
    Option<Instant>,
    Option<Level>,
    Arc<Mutex<Option<oneshot::Sender<()>>>>,
);

pub(crate) struct TaskPeer {
    pub(crate) watchers: DashMap<u32, HashMap<u64, Watcher>>,
    pub(crate) next_id: AtomicU64,
}

impl TaskPeer {
    pub(crate) fn register(
        self: &Arc<Self>,
        op: FakeOp,
        keys: &[u32],
        token_signal: bool,
    ) -> Option<Token> {
        let (tx, rx) = oneshot::channel();
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let tx = Arc::new(Mutex::new(Some(tx)));
        for k in keys {
            self.watchers
                .entry(*k)
                .or_default()
                .insert(id, (op.completes_at, op.level.clone(), tx.clone()));
        }
        let me = self.clone();
        let keys = keys.to_vec();
        let deadline = op.deadline;
        let completes = op.completes_at.is_some();
        tokio::spawn(async move {
            match tokio::time::timeout_at(deadline, rx).await {
                Ok(Ok(())) => {
                    op.counts.completed.fetch_add(1, Ordering::Relaxed);
                }
                Ok(Err(_)) => {
                    // Nobody can signal any more: only the timeout is left.
                    tokio::time::sleep_until(deadline).await;
                    op.counts.expired_at(deadline);
                }
                Err(_) => op.counts.expired_at(deadline),
            }
            for k in &keys {
                if let Some(mut w) = me.watchers.get_mut(k) {
                    w.remove(&id);
                }
            }
        });
        (token_signal && completes)
            .then(|| Token::Signal(tx.lock().unwrap().take().expect("fresh")))
    }

    pub(crate) fn complete_key(&self, key: u32) {
        let now = Instant::now();
        let due: Vec<_> = match self.watchers.get(&key) {
            Some(w) => w
                .values()
                .filter(|(at, level, _)| match level {
                    Some(l) => l.reached(),
                    None => at.is_some_and(|t| now >= t),
                })
                .map(|(_, _, tx)| tx.clone())
                .collect(),
            None => return,
        };
        for tx in due {
            if let Some(tx) = tx.lock().unwrap().take() {
                let _ = tx.send(());
            }
        }
    }
}

// ---- peer (b): the fair one-lock purgatory
//
// What a competent team writes in an afternoon instead of taking this crate: one
// mutex around a `DelayQueue`, a slab of requests with generation-checked ids
// and `HashMap<key, Vec<id>>` watch lists. It does the work this crate does:
// completing a request by reference runs its check and completes it only if
// the check says so; a walk runs the check of every live watcher of the key and
// drops dead ids from that list; a purge sweeps every list once dead ids exceed
// max(1,000, live ids) (this crate's threshold: Kafka's own purges once
// completed operations still watched exceed `purgeInterval`), in slices of 128
// entries per call as this crate's does, so no call stalls the others for a
// pass over every list; its memory stays flat; expiry is one task awaiting the
// queue, taking up to 64 due entries per hold of the lock. Checks run under the
// one lock (there is no other lock to run them under, and checking outside it
// would race events).

#[path = "../../tests/support/one_lock.rs"]
#[allow(unreachable_pub)]
mod one_lock;
pub(crate) use one_lock::Id;
use one_lock::{vacant, watch};

/// A pending request in the fair peer.
pub(crate) struct Pending {
    pub(crate) op: FakeOp,
    pub(crate) timer: tokio_util::time::delay_queue::Key,
    pub(crate) keys: u32,
    /// `--mode awaited`: the task awaiting this request.
    pub(crate) done: Option<oneshot::Sender<()>>,
}

#[derive(Default)]
pub(crate) struct Slot {
    pub(crate) generation: u32,
    pub(crate) pending: Option<Pending>,
}

pub(crate) struct FairState {
    pub(crate) queue: tokio_util::time::DelayQueue<Id>,
    pub(crate) slots: Vec<Slot>,
    pub(crate) free: Vec<u32>,
    pub(crate) lists: Lists,
}

impl FairState {
    pub(crate) fn new() -> FairState {
        FairState {
            queue: tokio_util::time::DelayQueue::new(),
            slots: Vec::new(),
            free: Vec::new(),
            lists: Lists::default(),
        }
    }

    pub(crate) fn is_live(slots: &[Slot], id: Id) -> bool {
        let s = &slots[id.index as usize];
        s.generation == id.generation && s.pending.is_some()
    }

    /// An empty slot's id, for [`fill`](Self::fill) (the timer entry is made
    /// between the two, with the id it carries).
    pub(crate) fn vacant(&mut self) -> Id {
        vacant(&mut self.slots, &mut self.free, |s| s.generation)
    }

    pub(crate) fn fill(&mut self, id: Id, pending: Pending) {
        self.slots[id.index as usize].pending = Some(pending);
    }

    /// Takes a finished request out of its slot: its list entries are dead now.
    pub(crate) fn take(
        slots: &mut [Slot],
        free: &mut Vec<u32>,
        live: &mut usize,
        dead: &mut usize,
        id: Id,
    ) -> Pending {
        let slot = &mut slots[id.index as usize];
        let pending = slot.pending.take().expect("a live id");
        slot.generation = slot.generation.wrapping_add(1);
        free.push(id.index);
        *live -= pending.keys as usize;
        *dead += pending.keys as usize;
        pending
    }

    /// The purge (see [`Lists::maybe_purge`]).
    pub(crate) fn maybe_purge(&mut self) {
        let slots = &self.slots;
        self.lists.maybe_purge(|id| Self::is_live(slots, id));
    }
}

/// The watch lists of a one-lock peer: each key's ids, how many ids are of
/// pending requests (`live`) and how many of finished ones (`dead`), and a
/// purge under way (the keys it will visit, and the next one).
#[derive(Default)]
pub(crate) struct Lists {
    pub(crate) watchers: HashMap<u32, Vec<Id>>,
    pub(crate) live: usize,
    pub(crate) dead: usize,
    pub(crate) purge: Option<(Vec<u32>, usize)>,
}

impl Lists {
    /// Puts `id` on the list of each of `keys` once; returns how many lists
    /// it went on.
    fn watch(&mut self, keys: &[u32], id: Id) -> u32 {
        let n = watch(&mut self.watchers, keys, id);
        self.live += n as usize;
        n
    }

    /// The one-lock peers' purge: once dead ids outnumber max(1,000, live
    /// ids), sweep every list (the keys taken when the purge starts), a slice
    /// per call ([`sweep_slice`]), dropping the ids `is_live` refuses.
    fn maybe_purge(&mut self, is_live: impl Fn(Id) -> bool) {
        if self.purge.is_none() {
            if self.dead <= self.live.max(1_000) {
                return;
            }
            self.purge = Some((self.watchers.keys().copied().collect(), 0));
        }
        sweep_slice(&mut self.watchers, &mut self.purge, &mut self.dead, is_live);
    }
}

/// Goes on with the purge under way in `purge` (the keys taken when it
/// started, and the next to visit): at most 128 entries per call (a list is
/// visited whole), dropping the ids `is_live` refuses (each counted off
/// `count`) and giving back the room of lists that shrank a lot. Returns
/// whether the purge is done.
fn sweep_slice(
    watchers: &mut HashMap<u32, Vec<Id>>,
    purge: &mut Option<(Vec<u32>, usize)>,
    count: &mut usize,
    is_live: impl Fn(Id) -> bool,
) -> bool {
    let (keys, next) = purge.as_mut().expect("a purge under way");
    let mut budget = 128usize;
    while budget > 0 && *next < keys.len() {
        let key = keys[*next];
        *next += 1;
        let Some(ids) = watchers.get_mut(&key) else {
            continue;
        };
        let before = ids.len();
        ids.retain(|id| is_live(*id));
        *count -= before - ids.len();
        budget = budget.saturating_sub(before);
        if ids.is_empty() {
            watchers.remove(&key);
        } else if ids.capacity() > 16 && ids.len() * 4 < ids.capacity() {
            ids.shrink_to_fit();
        }
    }
    let done = *next >= keys.len();
    if done {
        *purge = None;
    }
    done
}

pub(crate) struct FairPeer {
    pub(crate) state: Mutex<FairState>,
}

impl Rules for FairPeer {
    /// Checks `op`, and registers it on `keys` unless it completed: one lock
    /// held throughout, so no event is lost between the check and the watch.
    fn register(
        &self,
        mut op: FakeOp,
        keys: &[u32],
        awaited: bool,
    ) -> (Option<Id>, Option<oneshot::Receiver<()>>) {
        // Made before the lock is taken, and dropped after it if unused.
        let (done, rx) = if awaited {
            let (tx, rx) = oneshot::channel();
            (Some(tx), Some(rx))
        } else {
            (None, None)
        };
        let mut s = self.state.lock().unwrap();
        if op.try_complete().is_some() {
            drop(s);
            return (None, None);
        }
        let id = s.vacant();
        let timer = s.queue.insert_at(id, op.deadline);
        let n = s.lists.watch(keys, id);
        s.fill(
            id,
            Pending {
                op,
                timer,
                keys: n,
                done,
            },
        );
        s.maybe_purge();
        (Some(id), rx)
    }

    /// Completes the request `id` if its check says it can.
    fn complete(&self, id: Id) {
        let finished = {
            let mut s = self.state.lock().unwrap();
            let FairState {
                queue,
                slots,
                free,
                lists: Lists { live, dead, .. },
                ..
            } = &mut *s;
            let slot = &mut slots[id.index as usize];
            if slot.generation != id.generation {
                return;
            }
            let completes = match slot.pending.as_mut() {
                Some(p) => p.op.try_complete().is_some(),
                None => false,
            };
            if !completes {
                return;
            }
            let p = FairState::take(slots, free, live, dead, id);
            queue.remove(&p.timer);
            p
        };
        if let Some(tx) = finished.done {
            let _ = tx.send(());
        }
    }

    /// Runs the check of every live watcher of `key`, completes those that
    /// can, and drops dead ids from the list. The buffer of finished requests
    /// is kept per thread, so a warmed-up walk allocates nothing.
    fn complete_key(&self, key: u32) {
        thread_local! {
            static FINISHED: std::cell::RefCell<Vec<Pending>> = const { std::cell::RefCell::new(Vec::new()) };
        }
        let mut finished = FINISHED.with(|f| std::mem::take(&mut *f.borrow_mut()));
        {
            let mut s = self.state.lock().unwrap();
            let FairState {
                queue,
                slots,
                free,
                lists:
                    Lists {
                        watchers,
                        live,
                        dead,
                        ..
                    },
            } = &mut *s;
            let Some(ids) = watchers.get_mut(&key) else {
                drop(s);
                FINISHED.with(|f| *f.borrow_mut() = finished);
                return;
            };
            ids.retain(|&id| {
                if !FairState::is_live(slots, id) {
                    *dead -= 1;
                    return false;
                }
                let p = slots[id.index as usize].pending.as_mut().expect("live");
                if p.op.try_complete().is_none() {
                    return true;
                }
                let p = FairState::take(slots, free, live, dead, id);
                *dead -= 1; // this entry goes now
                queue.remove(&p.timer);
                finished.push(p);
                false
            });
            if ids.is_empty() {
                watchers.remove(&key);
            }
            s.maybe_purge();
        }
        for p in finished.drain(..) {
            if let Some(tx) = p.done {
                let _ = tx.send(());
            }
        }
        FINISHED.with(|f| *f.borrow_mut() = finished);
    }
}

impl FairPeer {
    pub(crate) async fn drive(self: Arc<Self>, stop: Arc<tokio::sync::Notify>) {
        drive_queue(
            &self.state,
            stop,
            |s| &mut s.queue,
            |s, id| {
                let FairState {
                    slots,
                    free,
                    lists: Lists { live, dead, .. },
                    ..
                } = s;
                Some(FairState::take(slots, free, live, dead, id))
            },
            |p: Pending| {
                // An awaiting task sees the sender dropped: expired.
                drop(p.done);
                p.op.on_expiration();
            },
        )
        .await
    }
}

/// Expires a one-lock peer's `DelayQueue` from one task: up to 64 due entries
/// per hold of the lock (as this crate's reaper takes them), each handed to
/// `take` under the lock (`None`: left to the request's checker), and what it
/// gives to `run` with the lock released.
async fn drive_queue<S, D>(
    state: &Mutex<S>,
    stop: Arc<tokio::sync::Notify>,
    queue: impl Fn(&mut S) -> &mut tokio_util::time::DelayQueue<Id>,
    mut take: impl FnMut(&mut S, Id) -> Option<D>,
    mut run: impl FnMut(D),
) {
    use std::future::poll_fn;
    use std::task::Poll;
    let stopped = stop.notified();
    tokio::pin!(stopped);
    let mut due: Vec<D> = Vec::with_capacity(64);
    loop {
        let stop = poll_fn(|cx| {
            if stopped.as_mut().poll(cx).is_ready() {
                return Poll::Ready(true);
            }
            let mut s = state.lock().unwrap();
            while due.len() < 64 {
                match queue(&mut s).poll_expired(cx) {
                    Poll::Ready(Some(e)) => {
                        if let Some(d) = take(&mut s, e.into_inner()) {
                            due.push(d);
                        }
                    }
                    Poll::Ready(None) | Poll::Pending => break,
                }
            }
            if due.is_empty() {
                Poll::Pending
            } else {
                Poll::Ready(false)
            }
        })
        .await;
        if stop {
            return;
        }
        for d in due.drain(..) {
            run(d);
        }
    }
}

use std::future::Future;

// ---- peer (c): the one-lock purgatory under this crate's rules
//
// The fair peer, changed only where this crate's rules require: no check,
// expiry or drop of a request runs under the lock. A check takes the request
// out of its slot under the lock (marking it checked), runs with the lock
// released, and finishes it or puts it back under the lock again; a check
// asked for meanwhile (`rerun`) is run by the checker before it puts the
// request back, and a timeout meanwhile (`expire`) is acted on by the checker
// once its check says "not yet". Registration checks before it watches and
// again after, with the lock released, as this crate does. A walk takes the
// requests of every live id out in one hold of the lock and finishes them in
// one more (and one more per round of re-checks asked for meanwhile); the ids
// of those it finishes stay in the walked list until a later walk or the
// purge drops them. With `DelayQueue` (`lean`) it shows what the rules cost a
// one-lock design; with this crate's timing wheel in its place (`lean-wheel`),
// what such a design costs with this crate's timer.

/// A request's slot in the rule-following peer, whose timer's keys are `K`.
pub(crate) struct LeanSlot<K> {
    pub(crate) generation: u32,
    pub(crate) pending: bool,
    pub(crate) checking: bool,
    pub(crate) rerun: bool,
    pub(crate) expire: bool,
    /// `None` while a check runs.
    pub(crate) op: Option<FakeOp>,
    /// `None` once the timer has handed the entry out.
    pub(crate) timer: Option<K>,
    pub(crate) keys: u32,
    pub(crate) done: Option<oneshot::Sender<()>>,
}

impl<K> Default for LeanSlot<K> {
    fn default() -> Self {
        LeanSlot {
            generation: 0,
            pending: false,
            checking: false,
            rerun: false,
            expire: false,
            op: None,
            timer: None,
            keys: 0,
            done: None,
        }
    }
}

impl<K> LeanSlot<K> {
    /// A registration's slot, from the registration's hold of the lock: pending,
    /// checked by the registration (its second check), on `keys` lists.
    fn start(&mut self, timer: K, keys: u32, done: Option<oneshot::Sender<()>>) {
        self.pending = true;
        self.checking = true;
        self.timer = Some(timer);
        self.keys = keys;
        self.done = done;
    }
}

/// A rule-following registration's first check, before it takes any lock:
/// `None` when `op` completed at once, else the request's completion
/// signal (a channel when its outcome is awaited).
#[allow(clippy::type_complexity)]
fn first_check(
    op: &mut FakeOp,
    awaited: bool,
) -> Option<(Option<oneshot::Sender<()>>, Option<oneshot::Receiver<()>>)> {
    if op.try_complete().is_some() {
        return None;
    }
    Some(if awaited {
        let (tx, rx) = oneshot::channel();
        (Some(tx), Some(rx))
    } else {
        (None, None)
    })
}

/// The rule-following peer's timer: `DelayQueue`, or this crate's timing
/// wheel (`src/wheel.rs`, compiled into the benchmark) under the same lock.
pub(crate) trait LeanTimers: Default + Send + 'static {
    type Key: Send;
    /// Arms `id`'s timeout; says whether the driver must be woken for it.
    fn insert(&mut self, id: Id, deadline: Instant) -> (Self::Key, bool);
    fn remove(&mut self, key: &Self::Key);
}

impl LeanTimers for tokio_util::time::DelayQueue<Id> {
    type Key = tokio_util::time::delay_queue::Key;
    fn insert(&mut self, id: Id, deadline: Instant) -> (Self::Key, bool) {
        // The queue wakes its driver itself.
        (self.insert_at(id, deadline), false)
    }
    fn remove(&mut self, key: &Self::Key) {
        tokio_util::time::DelayQueue::remove(self, key);
    }
}

#[allow(dead_code)]
#[path = "../../src/wheel.rs"]
mod wheel;
// The wheel's own tests, compiled with it under `cfg(test)`, use the crate's
// test generator.
#[cfg(test)]
#[path = "../../tests/support/rng.rs"]
#[allow(unreachable_pub)]
mod test_rng;

/// This crate's wheel at its default shape (64 slots, 6 levels) and tick
/// (100 µs), with deadlines in ticks from when it was made, and the tick its
/// driver last went to sleep until (`u64::MAX`: until woken), lowered by each
/// registration that wakes it; while the driver works it is stale, and a
/// registration may wake it needlessly.
pub(crate) struct WheelTimers {
    wheel: wheel::Wheel<Id>,
    origin: Instant,
    sleeping_until: u64,
}

impl Default for WheelTimers {
    fn default() -> Self {
        WheelTimers {
            wheel: wheel::Wheel::new(64, 6).expect("a valid shape"),
            origin: Instant::now(),
            sleeping_until: u64::MAX,
        }
    }
}

impl WheelTimers {
    const TICK_US: u64 = 100;

    fn tick_of(&self, at: Instant) -> u64 {
        at.saturating_duration_since(self.origin).as_micros() as u64 / Self::TICK_US
    }

    fn instant_of(&self, tick: u64) -> Instant {
        self.origin + Duration::from_micros(tick * Self::TICK_US)
    }
}

impl LeanTimers for WheelTimers {
    type Key = wheel::Key;
    fn insert(&mut self, id: Id, deadline: Instant) -> (Self::Key, bool) {
        // Rounded up, so an entry never fires before its deadline.
        let tick = self.tick_of(deadline) + 1;
        let wake = tick < self.sleeping_until;
        if wake {
            self.sleeping_until = tick;
        }
        (self.wheel.insert(tick, id), wake)
    }
    fn remove(&mut self, key: &Self::Key) {
        self.wheel.remove(*key);
    }
}

pub(crate) struct LeanState<Q: LeanTimers> {
    pub(crate) timers: Q,
    pub(crate) slots: Vec<LeanSlot<Q::Key>>,
    pub(crate) free: Vec<u32>,
    pub(crate) lists: Lists,
    /// `key-sharded`: the shard's lock-free record of which of its slots
    /// are live, for the other shards' lists (`None` for the other peers).
    pub(crate) lives: Option<Arc<Lives>>,
    /// `key-sharded`: ids on this shard's lists, and how many its last
    /// purge kept.
    pub(crate) entries: usize,
    pub(crate) kept: usize,
}

/// What a finished request leaves to be done with the lock released.
pub(crate) enum Leftover {
    Completed(FakeOp, Option<oneshot::Sender<()>>),
    Expired(FakeOp, Option<oneshot::Sender<()>>),
}

impl Leftover {
    fn run(self) {
        match self {
            Leftover::Completed(op, done) => {
                drop(op);
                if let Some(tx) = done {
                    let _ = tx.send(());
                }
            }
            Leftover::Expired(op, done) => {
                drop(done);
                op.on_expiration();
            }
        }
    }
}

/// A check's result, to act on under the lock.
enum After {
    Finished(Leftover),
    Recheck(FakeOp),
    Pending,
}

impl<Q: LeanTimers> Default for LeanState<Q> {
    fn default() -> Self {
        LeanState {
            timers: Q::default(),
            slots: Vec::new(),
            free: Vec::new(),
            lists: Lists::default(),
            lives: None,
            entries: 0,
            kept: 0,
        }
    }
}

impl<Q: LeanTimers> LeanState<Q> {
    fn is_live(slots: &[LeanSlot<Q::Key>], id: Id) -> bool {
        let s = &slots[id.index as usize];
        s.generation == id.generation && s.pending
    }

    /// Frees `id`'s slot (its request has finished); its list entries are dead now.
    fn free_slot(&mut self, id: Id) -> Option<oneshot::Sender<()>> {
        let slot = &mut self.slots[id.index as usize];
        slot.pending = false;
        slot.checking = false;
        slot.rerun = false;
        slot.expire = false;
        slot.generation = slot.generation.wrapping_add(1);
        let timer = slot.timer.take();
        let done = slot.done.take();
        let keys = slot.keys as usize;
        if let Some(lives) = &self.lives {
            lives.set(id.index, id.generation, false);
        }
        self.free.push(id.index);
        self.lists.live -= keys;
        self.lists.dead += keys;
        if let Some(t) = timer {
            self.timers.remove(&t);
        }
        done
    }

    /// The checker of `id` is back with `op` and its check's verdict.
    fn after_check(&mut self, id: Id, op: FakeOp, completed: bool) -> After {
        if completed {
            return After::Finished(Leftover::Completed(op, self.free_slot(id)));
        }
        let slot = &mut self.slots[id.index as usize];
        if slot.rerun {
            slot.rerun = false;
            return After::Recheck(op);
        }
        if slot.expire {
            return After::Finished(Leftover::Expired(op, self.free_slot(id)));
        }
        slot.checking = false;
        slot.op = Some(op);
        After::Pending
    }

    /// The purge, as the fair peer's (see [`Lists::maybe_purge`]).
    fn maybe_purge(&mut self) {
        let slots = &self.slots;
        self.lists.maybe_purge(|id| Self::is_live(slots, id));
    }
}

pub(crate) struct LeanPeer<Q: LeanTimers> {
    pub(crate) state: Mutex<LeanState<Q>>,
    /// Wakes the wheel's driver for a deadline earlier than its sleep
    /// (shared by the shards of a sharded peer, which have one driver).
    pub(crate) wake: Arc<tokio::sync::Notify>,
}

impl<Q: LeanTimers> Default for LeanPeer<Q> {
    fn default() -> Self {
        LeanPeer {
            state: Mutex::default(),
            wake: Arc::default(),
        }
    }
}

/// A one-lock peer: the fair one, or the rule-following one whichever its timer.
pub(crate) trait Rules: Send + Sync {
    fn register(
        &self,
        op: FakeOp,
        keys: &[u32],
        awaited: bool,
    ) -> (Option<Id>, Option<oneshot::Receiver<()>>);
    fn complete(&self, id: Id);
    fn complete_key(&self, key: u32);
}

impl<Q: LeanTimers> LeanPeer<Q> {
    /// Checks `op` held by its checker (the lock released) until it completes
    /// or stays pending.
    fn check_loop(&self, id: Id, mut op: FakeOp) {
        loop {
            let completed = op.try_complete().is_some();
            let after = self.state.lock().unwrap().after_check(id, op, completed);
            match after {
                After::Finished(left) => return left.run(),
                After::Recheck(back) => op = back,
                After::Pending => return,
            }
        }
    }
}

impl<Q: LeanTimers> Rules for LeanPeer<Q> {
    /// Checks `op`, and registers it on `keys` unless it completed; checks it
    /// again once it is watched.
    fn register(
        &self,
        mut op: FakeOp,
        keys: &[u32],
        awaited: bool,
    ) -> (Option<Id>, Option<oneshot::Receiver<()>>) {
        let Some((done, rx)) = first_check(&mut op, awaited) else {
            return (None, None);
        };
        let (id, wake) = {
            let mut s = self.state.lock().unwrap();
            let s = &mut *s;
            let id = vacant(&mut s.slots, &mut s.free, |s| s.generation);
            let (timer, wake) = s.timers.insert(id, op.deadline);
            let n = s.lists.watch(keys, id);
            s.slots[id.index as usize].start(timer, n, done);
            s.maybe_purge();
            (id, wake)
        };
        if wake {
            self.wake.notify_one();
        }
        self.check_loop(id, op);
        (Some(id), rx)
    }

    /// Completes the request `id` if its check says it can.
    fn complete(&self, id: Id) {
        let op = {
            let mut s = self.state.lock().unwrap();
            let slot = &mut s.slots[id.index as usize];
            if slot.generation != id.generation || !slot.pending {
                return;
            }
            if slot.checking {
                slot.rerun = true;
                return;
            }
            slot.checking = true;
            slot.op.take().expect("a pending request")
        };
        self.check_loop(id, op);
    }

    /// Runs the check of every live watcher of `key` (those being checked
    /// elsewhere are asked to check again), completes those that can, and
    /// drops the ids of requests already finished from the list (those it
    /// finishes now stay until a later walk or the purge). The walk's buffers are kept per thread,
    /// as this crate keeps its own, so a warmed-up walk allocates nothing.
    fn complete_key(&self, key: u32) {
        type Walk = (Vec<(Id, Option<FakeOp>, bool)>, Vec<Leftover>);
        thread_local! {
            static WALK: std::cell::RefCell<Walk> = std::cell::RefCell::default();
        }
        WALK.with(|walk| {
            // The checks and drops below never walk again on this thread.
            let mut walk = walk.borrow_mut();
            let (taken, left) = &mut *walk;
            {
                let mut s = self.state.lock().unwrap();
                let LeanState {
                    slots,
                    lists: Lists { watchers, dead, .. },
                    ..
                } = &mut *s;
                let Some(ids) = watchers.get_mut(&key) else {
                    return;
                };
                ids.retain(|&id| {
                    if !LeanState::<Q>::is_live(slots, id) {
                        *dead -= 1;
                        return false;
                    }
                    let slot = &mut slots[id.index as usize];
                    if slot.checking {
                        slot.rerun = true;
                    } else {
                        slot.checking = true;
                        taken.push((id, slot.op.take(), false));
                    }
                    true
                });
                if ids.is_empty() {
                    watchers.remove(&key);
                }
                s.maybe_purge();
            }
            while !taken.is_empty() {
                for (_, op, completed) in taken.iter_mut() {
                    let op = op.as_mut().expect("a taken request");
                    *completed = op.try_complete().is_some();
                }
                {
                    let mut s = self.state.lock().unwrap();
                    for (id, op, completed) in taken.iter_mut() {
                        let checked = op.take().expect("a taken request");
                        match s.after_check(*id, checked, *completed) {
                            After::Finished(l) => left.push(l),
                            After::Recheck(back) => *op = Some(back),
                            After::Pending => {}
                        }
                    }
                }
                taken.retain(|(_, op, _)| op.is_some());
            }
            for l in left.drain(..) {
                l.run();
            }
        });
    }
}

impl LeanPeer<tokio_util::time::DelayQueue<Id>> {
    pub(crate) async fn drive(self: Arc<Self>, stop: Arc<tokio::sync::Notify>) {
        drive_queue(
            &self.state,
            stop,
            |s| &mut s.timers,
            |s, id| {
                let slot = &mut s.slots[id.index as usize];
                slot.timer = None;
                if slot.checking {
                    // The checker expires it if its check says "not yet".
                    slot.expire = true;
                    return None;
                }
                let op = slot.op.take().expect("a pending request");
                let done = s.free_slot(id);
                Some(Leftover::Expired(op, done))
            },
            Leftover::run,
        )
        .await
    }
}

impl LeanPeer<WheelTimers> {
    /// Expires what is due (as [`drive_wheels`]).
    pub(crate) async fn drive(self: Arc<Self>, stop: Arc<tokio::sync::Notify>) {
        drive_wheels(&[&*self], &self.wake, stop).await
    }

    /// Takes up to 64 due requests out under one hold of the lock (those
    /// being checked are left to their checker) into `due`. When none is due,
    /// records that the driver sleeps until the wheel's next deadline (a
    /// registration before it wakes the driver) and returns that deadline
    /// (`None`: nothing pending).
    fn take_due(&self, due: &mut Vec<Leftover>) -> Option<Option<Instant>> {
        let mut s = self.state.lock().unwrap();
        let now = s.timers.tick_of(Instant::now());
        let before = due.len();
        while due.len() < before + 64 {
            let Some((_, id)) = s.timers.wheel.poll(now) else {
                break;
            };
            let slot = &mut s.slots[id.index as usize];
            slot.timer = None;
            if slot.checking {
                // The checker expires it if its check says "not yet".
                slot.expire = true;
                continue;
            }
            let op = slot.op.take().expect("a pending request");
            let done = s.free_slot(id);
            due.push(Leftover::Expired(op, done));
        }
        if due.len() > before {
            return None;
        }
        let next = s.timers.wheel.next_expiration().unwrap_or(u64::MAX);
        s.timers.sleeping_until = next;
        Some((next != u64::MAX).then(|| s.timers.instant_of(next)))
    }
}

/// The expiry task of the wheel peers: visits each shard's wheel in turn,
/// expiring up to 64 entries per hold of its lock and yielding after 1,024
/// per turn (as this crate's reaper), and sleeps until the earliest deadline
/// of all shards or a registration's earlier one (`wake`). A shard found with
/// nothing due records its own next deadline as the driver's sleep; the
/// driver sleeps until the earliest, so a registration later than its own
/// shard's next deadline needs no wake.
async fn drive_wheels(
    shards: &[&LeanPeer<WheelTimers>],
    wake: &tokio::sync::Notify,
    stop: Arc<tokio::sync::Notify>,
) {
    let stopped = stop.notified();
    tokio::pin!(stopped);
    let mut due: Vec<Leftover> = Vec::with_capacity(64);
    let mut turn = 0usize;
    loop {
        let mut earliest: Option<Instant> = None;
        let mut expired = false;
        for shard in shards {
            match shard.take_due(&mut due) {
                None => {
                    expired = true;
                    turn += due.len();
                    for l in due.drain(..) {
                        l.run();
                    }
                }
                Some(next) => {
                    earliest = match (earliest, next) {
                        (Some(a), Some(b)) => Some(a.min(b)),
                        (a, b) => a.or(b),
                    };
                }
            }
        }
        if expired {
            if turn >= 1024 {
                turn = 0;
                tokio::task::yield_now().await;
            }
            continue;
        }
        turn = 0;
        let sleep = async {
            match earliest {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = &mut stopped => return,
            _ = sleep => {}
            _ = wake.notified() => {}
        }
    }
}

// ---- peer (d): the rule-following wheel peer, split into shards
//
// The prototype of a layout for this crate: `lean-wheel`, one per shard, each
// shard its own lock over its slab, its wheel and the watch lists of the
// requests it holds. A registration goes to the shard of its thread (threads
// take shards in turn), so registrations on different threads never meet, and
// it takes that one lock twice, as `lean-wheel` does, whatever its keys. A
// completion by reference goes to the request's shard. A walk of a key walks
// that key's list in every shard, one shard after another (two holds of each
// shard's lock, and a hash lookup that misses in a shard with no watcher of
// the key). One expiry task visits every shard's wheel. A shard's purge reads
// only its own slab. An id names its shard in its index's top 8 bits.

/// `#[repr(align(128))]`: a shard's lock on cache lines of its own.
#[repr(align(128))]
pub(crate) struct Padded<T>(pub(crate) T);

pub(crate) struct ShardedPeer {
    pub(crate) shards: Box<[Padded<LeanPeer<WheelTimers>>]>,
    wake: Arc<tokio::sync::Notify>,
}

impl ShardedPeer {
    const SHIFT: u32 = 24;

    pub(crate) fn new(shards: usize) -> Self {
        assert!((1..=256).contains(&shards), "1 to 256 shards");
        let wake: Arc<tokio::sync::Notify> = Arc::default();
        let shards = (0..shards)
            .map(|_| {
                Padded(LeanPeer {
                    state: Mutex::default(),
                    wake: wake.clone(),
                })
            })
            .collect();
        ShardedPeer { shards, wake }
    }

    /// The calling thread's shard of `shards`: threads take shards in turn,
    /// on first use.
    fn mine(shards: usize) -> usize {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        thread_local! {
            static STRIPE: usize = NEXT.fetch_add(1, Ordering::Relaxed);
        }
        STRIPE.with(|s| *s) % shards
    }

    pub(crate) async fn drive(self: Arc<Self>, stop: Arc<tokio::sync::Notify>) {
        // The shards without their padding, for the driver.
        let shards: Vec<&LeanPeer<WheelTimers>> = self.shards.iter().map(|p| &p.0).collect();
        drive_wheels(&shards, &self.wake, stop).await
    }
}

impl Rules for ShardedPeer {
    fn register(
        &self,
        op: FakeOp,
        keys: &[u32],
        awaited: bool,
    ) -> (Option<Id>, Option<oneshot::Receiver<()>>) {
        let shard = Self::mine(self.shards.len());
        let (id, rx) = self.shards[shard].0.register(op, keys, awaited);
        let id = id.map(|id| {
            assert!(
                id.index < 1 << Self::SHIFT,
                "fewer than 2^24 requests per shard"
            );
            Id {
                index: id.index | (shard as u32) << Self::SHIFT,
                generation: id.generation,
            }
        });
        (id, rx)
    }

    fn complete(&self, id: Id) {
        let shard = (id.index >> Self::SHIFT) as usize;
        self.shards[shard].0.complete(Id {
            index: id.index & ((1 << Self::SHIFT) - 1),
            generation: id.generation,
        });
    }

    fn complete_key(&self, key: u32) {
        for shard in self.shards.iter() {
            shard.0.complete_key(key);
        }
    }
}

// ---- peer (e): the rule-following wheel peer in shards, each key's list in one shard
//
// As `sharded`, except that a key's watch list lives in the shard its key
// hashes to, whichever thread registered the requests on it: one list per
// key. A registration takes its own shard's lock twice (its slot, its timer,
// and the lists of its keys that hash there; then its second check's
// outcome), plus the lock of each other shard its keys hash to, once. A walk
// takes its key's shard twice, as `lean-wheel` does, for the list and that
// shard's own requests on it (out, then back or finished), and each other
// shard holding one of them twice too. A slot's liveness is also kept
// lock-free beside its shard ([`Lives`]), so that a list's shard can tell
// another shard's dead ids from live ones when it walks or purges. A shard purges its lists once the ids
// added since its last purge outnumber max(1,000, the ids it kept then).

/// Which slots of a shard are live: a word per slot (its generation, and
/// whether it is live), written under the shard's lock and read by any
/// thread without it. Pages of 16,384 words, made as the shard's slab grows.
pub(crate) struct Lives {
    pages: Box<[std::sync::OnceLock<Box<[std::sync::atomic::AtomicU32]>>]>,
}

impl Lives {
    const PAGE: usize = 1 << 14;

    fn new() -> Self {
        Lives {
            pages: (0..(1 << ShardedPeer::SHIFT) / Self::PAGE)
                .map(|_| std::sync::OnceLock::new())
                .collect(),
        }
    }

    fn word(generation: u32, live: bool) -> u32 {
        generation << 1 | live as u32
    }

    /// Under the shard's lock.
    fn set(&self, index: u32, generation: u32, live: bool) {
        let page = self.pages[index as usize / Self::PAGE].get_or_init(|| {
            (0..Self::PAGE)
                .map(|_| std::sync::atomic::AtomicU32::new(0))
                .collect()
        });
        page[index as usize % Self::PAGE].store(Self::word(generation, live), Ordering::Release);
    }

    fn is_live(&self, index: u32, generation: u32) -> bool {
        self.pages[index as usize / Self::PAGE]
            .get()
            .is_some_and(|p| {
                p[index as usize % Self::PAGE].load(Ordering::Acquire)
                    == Self::word(generation, true)
            })
    }
}

/// A key-sharded shard: the rule-following wheel peer's state (its slab and
/// wheel for the requests homed here, its lists for the keys that hash
/// here), and its record of live slots.
pub(crate) struct KeyShard {
    peer: LeanPeer<WheelTimers>,
    lives: Arc<Lives>,
}

pub(crate) struct KeyShardedPeer {
    shards: Box<[Padded<KeyShard>]>,
    wake: Arc<tokio::sync::Notify>,
}

/// A walk's buffers, kept per thread: the live ids read from the list; the
/// requests taken out, each with its shard, its op and its check's verdict;
/// what finished.
type KeyWalk = (
    Vec<Id>,
    Vec<(usize, Id, Option<FakeOp>, bool)>,
    Vec<Leftover>,
);

impl KeyShardedPeer {
    pub(crate) fn new(shards: usize) -> Self {
        assert!((1..=256).contains(&shards), "1 to 256 shards");
        let wake: Arc<tokio::sync::Notify> = Arc::default();
        let shards: Box<[Padded<KeyShard>]> = (0..shards)
            .map(|_| {
                let lives = Arc::new(Lives::new());
                let state = LeanState::<WheelTimers> {
                    lives: Some(lives.clone()),
                    ..LeanState::default()
                };
                Padded(KeyShard {
                    peer: LeanPeer {
                        state: Mutex::new(state),
                        wake: wake.clone(),
                    },
                    lives,
                })
            })
            .collect();
        KeyShardedPeer { shards, wake }
    }

    fn key_shard(&self, key: u32) -> usize {
        // A multiplicative hash: keys that are consecutive numbers spread.
        ((key as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as usize % self.shards.len()
    }

    fn split(id: Id) -> (usize, Id) {
        (
            (id.index >> ShardedPeer::SHIFT) as usize,
            Id {
                index: id.index & ((1 << ShardedPeer::SHIFT) - 1),
                generation: id.generation,
            },
        )
    }

    fn is_live(&self, id: Id) -> bool {
        let (shard, local) = Self::split(id);
        self.shards[shard]
            .0
            .lives
            .is_live(local.index, local.generation)
    }

    /// Puts `id` on the lists of the `keys` that hash to `shard` (each key
    /// once), in `state`, the shard's state under its lock; purges a slice of
    /// the shard's lists when due. Returns how many lists it went on.
    fn watch_here(
        &self,
        shard: usize,
        state: &mut LeanState<WheelTimers>,
        keys: &[u32],
        id: Id,
    ) -> u32 {
        let mut n = 0;
        for (i, k) in keys.iter().enumerate() {
            if self.key_shard(*k) == shard && !keys[..i].contains(k) {
                state.lists.watchers.entry(*k).or_default().push(id);
                n += 1;
            }
        }
        state.entries += n as usize;
        self.maybe_purge(state);
        n
    }

    /// The purge of one shard's lists: once the ids added since its last
    /// purge outnumber max(1,000, the ids it kept then), every list is swept
    /// (at most 128 entries per call, a list whole), dropping dead ids.
    fn maybe_purge(&self, state: &mut LeanState<WheelTimers>) {
        let LeanState {
            lists: Lists {
                watchers, purge, ..
            },
            entries,
            kept,
            ..
        } = state;
        if purge.is_none() {
            if entries.saturating_sub(*kept) <= (*kept).max(1_000) {
                return;
            }
            *purge = Some((watchers.keys().copied().collect(), 0));
        }
        if sweep_slice(watchers, purge, entries, |id| self.is_live(id)) {
            *kept = *entries;
        }
    }

    pub(crate) async fn drive(self: Arc<Self>, stop: Arc<tokio::sync::Notify>) {
        let shards: Vec<&LeanPeer<WheelTimers>> = self.shards.iter().map(|p| &p.0.peer).collect();
        drive_wheels(&shards, &self.wake, stop).await
    }
}

impl Rules for KeyShardedPeer {
    fn register(
        &self,
        mut op: FakeOp,
        keys: &[u32],
        awaited: bool,
    ) -> (Option<Id>, Option<oneshot::Receiver<()>>) {
        let Some((done, rx)) = first_check(&mut op, awaited) else {
            return (None, None);
        };
        let home = ShardedPeer::mine(self.shards.len());
        let shard = &self.shards[home].0;
        let (id, global, wake) = {
            let mut s = shard.peer.state.lock().unwrap();
            let s = &mut *s;
            let id = vacant(&mut s.slots, &mut s.free, |s| s.generation);
            assert!(
                id.index < 1 << ShardedPeer::SHIFT,
                "fewer than 2^24 requests per shard"
            );
            let global = Id {
                index: id.index | (home as u32) << ShardedPeer::SHIFT,
                generation: id.generation,
            };
            let (timer, wake) = s.timers.insert(id, op.deadline);
            shard.lives.set(id.index, id.generation, true);
            self.watch_here(home, s, keys, global);
            // Its lists' purge is its key shards' own: `keys` is not counted.
            s.slots[id.index as usize].start(timer, 0, done);
            (id, global, wake)
        };
        // The other shards its keys hash to, each once.
        for (i, k) in keys.iter().enumerate() {
            let other = self.key_shard(*k);
            if other == home || keys[..i].iter().any(|k| self.key_shard(*k) == other) {
                continue;
            }
            let mut s = self.shards[other].0.peer.state.lock().unwrap();
            self.watch_here(other, &mut s, keys, global);
        }
        if wake {
            self.wake.notify_one();
        }
        shard.peer.check_loop(id, op);
        (Some(global), rx)
    }

    fn complete(&self, id: Id) {
        let (shard, local) = Self::split(id);
        self.shards[shard].0.peer.complete(local);
    }

    /// Under the lock of `key`'s shard, drops the dead ids from its list and
    /// takes out that shard's own live requests (those being checked are
    /// asked to check again); takes the other shards' requests out, one hold
    /// of each such shard's lock; checks them all with no lock; puts back or
    /// finishes them, one more hold of each shard's lock (and one more per
    /// round of re-checks asked for meanwhile).
    fn complete_key(&self, key: u32) {
        thread_local! {
            static WALK: std::cell::RefCell<KeyWalk> = std::cell::RefCell::default();
        }
        WALK.with(|walk| {
            let mut walk = walk.borrow_mut();
            let (ids, taken, left) = &mut *walk;
            {
                let ks = self.key_shard(key);
                let mut guard = self.shards[ks].0.peer.state.lock().unwrap();
                let LeanState {
                    lists: Lists { watchers, .. },
                    slots,
                    entries,
                    ..
                } = &mut *guard;
                let Some(list) = watchers.get_mut(&key) else {
                    return;
                };
                let before = list.len();
                list.retain(|&id| {
                    let (home, local) = Self::split(id);
                    if home != ks {
                        // Another shard's request: taken out below, under
                        // its shard's lock.
                        let live = self.is_live(id);
                        if live {
                            ids.push(id);
                        }
                        return live;
                    }
                    // This shard's own: taken out in this hold.
                    let slot = &mut slots[local.index as usize];
                    if slot.generation != local.generation || !slot.pending {
                        return false;
                    }
                    if slot.checking {
                        slot.rerun = true;
                    } else {
                        slot.checking = true;
                        taken.push((ks, local, slot.op.take(), false));
                    }
                    true
                });
                *entries -= before - list.len();
                if list.is_empty() {
                    watchers.remove(&key);
                }
                self.maybe_purge(&mut guard);
            }
            // Other shards' requests, grouped by shard, so that each shard's
            // lock is taken once per pass (after this shard's, which come
            // first in `taken`).
            ids.sort_unstable_by_key(|id| id.index >> ShardedPeer::SHIFT);
            for group in
                ids.chunk_by(|a, b| a.index >> ShardedPeer::SHIFT == b.index >> ShardedPeer::SHIFT)
            {
                let shard = (group[0].index >> ShardedPeer::SHIFT) as usize;
                let mut s = self.shards[shard].0.peer.state.lock().unwrap();
                for &id in group {
                    let (_, local) = Self::split(id);
                    let slot = &mut s.slots[local.index as usize];
                    if slot.generation != local.generation || !slot.pending {
                        continue;
                    }
                    if slot.checking {
                        slot.rerun = true;
                    } else {
                        slot.checking = true;
                        taken.push((shard, local, slot.op.take(), false));
                    }
                }
            }
            ids.clear();
            while !taken.is_empty() {
                for (_, _, op, completed) in taken.iter_mut() {
                    let op = op.as_mut().expect("a taken request");
                    *completed = op.try_complete().is_some();
                }
                for group in taken.chunk_by_mut(|a, b| a.0 == b.0) {
                    let mut s = self.shards[group[0].0].0.peer.state.lock().unwrap();
                    for (_, id, op, completed) in group.iter_mut() {
                        let checked = op.take().expect("a taken request");
                        match s.after_check(*id, checked, *completed) {
                            After::Finished(l) => left.push(l),
                            After::Recheck(back) => *op = Some(back),
                            After::Pending => {}
                        }
                    }
                }
                taken.retain(|(_, _, op, _)| op.is_some());
            }
            for l in left.drain(..) {
                l.run();
            }
        });
    }
}
