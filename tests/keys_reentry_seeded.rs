//! Seeded rounds of keys whose `Hash` and `Drop` call back in or panic, on
//! paused Tokio time. Each round draws a pending limit, a purge interval, a
//! call of key code to act on and an action for it: shut the purgatory down,
//! start a drain, register, cancel by key, make every operation ready and
//! walk a key, read the figures, or panic on every third call from then on.
//! That key code runs wherever the crate hashes or drops a key (walks, the
//! purge, registrations and their refusals, cancellations by key, shutdown)
//! among 30 random steps of registrations, walks, cancels by key and by
//! handle, dropped handles, drains and time moved by hand; then a shutdown.
//! It holds the crate to "Exactly once" ("An operation finishes once, by
//! completion, expiry, cancellation or shutdown, however these race; its
//! handle yields that one outcome"), "No lock of ours is held while operation
//! code runs, nor while the crate drops a user value, so ... keys ... may
//! call back in (including `shutdown()`) from their code and their `Drop`",
//! "A panic in a key's `Hash` ... propagates to the caller, with the
//! purgatory left as it was before the call", "Nothing is lost on
//! rejection" and "Shutdown loses nothing": every operation is dropped
//! exactly once, comes back to the caller at most once and never after it
//! finished, every handle resolves with the operation's own output, each
//! registration that returned is counted once (registered or refused), the
//! counts balance, and nothing is left pending, watched or in the key map.
//! The default runs 200 seeds; `PURGATORY_KEYS_REENTRY_SEEDS` runs more.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use tokio::time::advance;
use tokio_purgatory::{
    Completion, Operation, OperationError, OperationHandle, Purgatory, WeakPurgatory,
};

mod support;
use support::{balanced, ms, rng::Rng, settle};

/// Seeds run by default, about 1 ms each in a release build.
const SEEDS: u64 = 200;

/// What key code does on the call it acts on.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Action {
    ShutDown,
    StartDrain,
    Register,
    CancelByKey,
    ReadyAllAndWalk,
    /// Panics on every third call of key code from the chosen one on.
    Panic,
    ReadFigures,
}

const ACTIONS: [Action; 7] = [
    Action::ShutDown,
    Action::StartDrain,
    Action::Register,
    Action::CancelByKey,
    Action::ReadyAllAndWalk,
    Action::Panic,
    Action::ReadFigures,
];

/// One round's state, shared by its keys and operations.
struct World {
    /// Drops of each operation, by id.
    op_drops: Mutex<HashMap<u32, u32>>,
    /// Operations that came back to the caller (shutdown, cancels,
    /// refusals), by id.
    back: Mutex<Vec<u32>>,
    /// Calls of key code so far (`Hash` and `Drop`).
    calls: AtomicUsize,
    /// The call of key code that acts.
    fire_at: usize,
    action: Action,
    fired: AtomicBool,
    /// Set while a key's `Hash` runs key code (which may hash keys again).
    in_hash: AtomicBool,
    p: OnceLock<WeakPurgatory<Key, Op>>,
    next_id: AtomicUsize,
    handles: Mutex<Vec<(u32, OperationHandle<Key, Op>)>>,
    ready: Mutex<HashMap<u32, Arc<AtomicBool>>>,
    /// Registrations that returned (accepted or not).
    returned: AtomicU64,
}

impl World {
    fn new(fire_at: usize, action: Action) -> Arc<World> {
        Arc::new(World {
            op_drops: Mutex::default(),
            back: Mutex::default(),
            calls: AtomicUsize::new(0),
            fire_at,
            action,
            fired: AtomicBool::new(false),
            in_hash: AtomicBool::new(false),
            p: OnceLock::new(),
            next_id: AtomicUsize::new(0),
            handles: Mutex::default(),
            ready: Mutex::default(),
            returned: AtomicU64::new(0),
        })
    }

    /// A new operation, its readiness kept by id.
    fn op(self: &Arc<Self>) -> Op {
        let id = self.next_id.fetch_add(1, Ordering::SeqCst) as u32 + 1;
        let ready = Arc::new(AtomicBool::new(false));
        self.ready.lock().unwrap().insert(id, ready.clone());
        Op {
            id,
            ready,
            w: self.clone(),
        }
    }

    /// Notes operations that came back to the caller.
    fn came_back(&self, ops: Vec<Op>) {
        self.back.lock().unwrap().extend(ops.iter().map(|op| op.id));
    }

    /// Registers `op` on `keys`, keeping its handle or noting it came back.
    fn register(&self, p: &Purgatory<Key, Op>, op: Op, timeout_ms: u64, keys: Vec<Key>) {
        let id = op.id;
        let r = p.try_complete_else_watch(op, ms(timeout_ms), keys);
        self.returned.fetch_add(1, Ordering::SeqCst);
        match r {
            Ok(h) => self.handles.lock().unwrap().push((id, h)),
            Err(e) => self.came_back(vec![e.into_inner()]),
        }
    }

    /// Key code ran: on the chosen call, act.
    fn key_code(self: &Arc<Self>) {
        let n = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        if self.action == Action::Panic
            && n >= self.fire_at
            && n.is_multiple_of(3)
            && !std::thread::panicking()
        {
            panic!("key code panics on call {n}");
        }
        if n != self.fire_at || self.fired.swap(true, Ordering::SeqCst) {
            return;
        }
        let Some(p) = self.p.get().and_then(WeakPurgatory::upgrade) else {
            return;
        };
        match self.action {
            Action::ShutDown => self.came_back(p.shutdown()),
            Action::StartDrain => drop(p.drain()),
            Action::Register => self.register(&p, self.op(), 30, vec![Key::new(7, self)]),
            Action::CancelByKey => self.came_back(p.cancel_for_key(&Key::new(1, self))),
            Action::ReadyAllAndWalk => {
                for r in self.ready.lock().unwrap().values() {
                    r.store(true, Ordering::SeqCst);
                }
                p.try_complete_watched(&Key::new(2, self));
            }
            Action::Panic => {}
            Action::ReadFigures => drop(p.metrics()),
        }
    }
}

/// A key whose `Hash` and `Drop` run the round's key code.
#[derive(Clone)]
struct Key {
    id: u32,
    w: Arc<World>,
}

impl Key {
    fn new(id: u32, w: &Arc<World>) -> Key {
        Key { id, w: w.clone() }
    }
}

impl PartialEq for Key {
    fn eq(&self, o: &Key) -> bool {
        self.id == o.id
    }
}

impl Eq for Key {}

impl Hash for Key {
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.id.hash(h);
        if !self.w.in_hash.swap(true, Ordering::SeqCst) {
            self.w.key_code();
            self.w.in_hash.store(false, Ordering::SeqCst);
        }
    }
}

impl Drop for Key {
    fn drop(&mut self) {
        self.w.key_code();
    }
}

/// Completes with its id once ready; expires with its id. Counts its drops.
struct Op {
    id: u32,
    ready: Arc<AtomicBool>,
    w: Arc<World>,
}

impl Drop for Op {
    fn drop(&mut self) {
        *self.w.op_drops.lock().unwrap().entry(self.id).or_default() += 1;
    }
}

impl Operation for Op {
    type Output = u32;
    fn try_complete(&mut self) -> Option<u32> {
        self.ready.load(Ordering::SeqCst).then_some(self.id)
    }
    fn on_expiration(self) -> u32 {
        self.id
    }
}

/// One step of the round: a panic from key code reaches here and is let go.
fn step(rng: &mut Rng, w: &Arc<World>, p: &Purgatory<Key, Op>) {
    let keys: Vec<Key> = (0..1 + rng.below(3))
        .map(|_| Key::new(rng.below(5) as u32, w))
        .collect();
    match rng.below(8) {
        0..=2 => {
            let op = w.op();
            if rng.below(4) == 0 {
                op.ready.store(true, Ordering::SeqCst);
            }
            w.register(p, op, 1 + rng.below(40), keys);
        }
        3 => w.came_back(p.cancel_for_key(&Key::new(rng.below(5) as u32, w))),
        4 => {
            let ids: Vec<u32> = w.ready.lock().unwrap().keys().copied().collect();
            if !ids.is_empty() {
                let id = ids[rng.below(ids.len() as u64) as usize];
                w.ready.lock().unwrap()[&id].store(true, Ordering::SeqCst);
            }
            p.try_complete_watched(&Key::new(rng.below(5) as u32, w));
        }
        5 => {
            let taken = {
                let mut hs = w.handles.lock().unwrap();
                let n = hs.len() as u64;
                (n > 0).then(|| hs.swap_remove(rng.below(n) as usize))
            };
            if let Some((_, h)) = taken {
                if rng.below(2) == 0 {
                    w.came_back(h.cancel().into_iter().collect());
                } else {
                    drop(h);
                }
            }
        }
        6 => drop(p.drain()),
        _ => {}
    }
}

/// One round for `seed`, then its accounting checked.
async fn round(seed: u64) {
    let mut rng = Rng(seed);
    let p: Purgatory<Key, Op> = Purgatory::builder()
        .purge_interval(rng.below(3) as usize)
        .max_pending(1 + rng.below(12) as usize)
        .build()
        .unwrap();
    let fire_at = 1 + rng.below(60) as usize;
    let w = World::new(fire_at, ACTIONS[rng.below(ACTIONS.len() as u64) as usize]);
    w.p.set(p.downgrade()).ok();
    for _ in 0..30 {
        // A panicking `Hash` reaches the caller: allowed.
        let _ = catch_unwind(AssertUnwindSafe(|| step(&mut rng, &w, &p)));
        if rng.below(3) == 0 {
            advance(ms(rng.below(20))).await;
            settle().await;
        }
    }
    w.came_back(p.shutdown());
    advance(ms(100)).await;
    settle().await;
    let handles = std::mem::take(&mut *w.handles.lock().unwrap());
    let mut outcomes = HashMap::new();
    for (id, h) in handles {
        let out = tokio::time::timeout(ms(10_000), h)
            .await
            .unwrap_or_else(|_| panic!("seed {seed}: handle {id} never resolved"));
        outcomes.insert(id, out);
    }
    settle().await;
    let back = std::mem::take(&mut *w.back.lock().unwrap());
    let drops = w.op_drops.lock().unwrap().clone();
    let made = w.next_id.load(Ordering::SeqCst) as u32;
    for id in 1..=made {
        let n_back = back.iter().filter(|b| **b == id).count();
        let n_drops = drops.get(&id).copied().unwrap_or(0);
        let outcome = outcomes.get(&id);
        assert!(n_back <= 1, "seed {seed}: op {id} came back {n_back} times");
        assert_eq!(
            n_drops, 1,
            "seed {seed}: op {id} dropped {n_drops} times (back {n_back}, outcome {outcome:?})"
        );
        match outcome {
            Some(Ok(Completion::Completed(x) | Completion::Expired(x))) => {
                assert_eq!(*x, id, "seed {seed}: another op's output");
                assert_eq!(n_back, 0, "seed {seed}: op {id} finished and came back");
            }
            Some(Err(OperationError::Shutdown | OperationError::Cancelled)) | None => {}
            Some(Err(e)) => panic!("seed {seed}: op {id} {e:?}"),
        }
    }
    let m = p.metrics();
    assert!(balanced(&m), "seed {seed}: {m:?}");
    assert_eq!(
        m.registered + m.refused.total(),
        w.returned.load(Ordering::SeqCst),
        "seed {seed}: each registration that returned counted once: {m:?}"
    );
    assert_eq!(
        (m.delayed, m.watched, m.keys),
        (0, 0, 0),
        "seed {seed}: {m:?}"
    );
}

/// Rounds of keys whose `Hash` and `Drop` call back in (shutdown, drain,
/// registration, cancellation by key, a walk, the figures) or panic, on the
/// call each seed picks: every operation is dropped once and accounted for
/// once, every handle resolves with its own output, each registration that
/// returned is counted once, the counts balance and nothing is left behind.
/// `PURGATORY_KEYS_REENTRY_SEEDS` runs more seeds than the default 200.
#[tokio::test(start_paused = true)]
async fn key_code_calling_back_in_on_a_chosen_call_loses_nothing() {
    let seeds = match std::env::var("PURGATORY_KEYS_REENTRY_SEEDS") {
        Ok(s) => s.parse().expect("PURGATORY_KEYS_REENTRY_SEEDS is a number"),
        Err(_) => SEEDS,
    };
    for seed in 1..=seeds {
        round(seed).await;
    }
}
