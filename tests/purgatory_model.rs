//! Model test: random streams of register / event / cancel / drop / advance against
//! a plain reference (`HashMap` of live operations), checked after every step.
//! Some operations watch keys at levels (`Watch::level`), alone or beside plain
//! watches, and level steps move a key's level up or down
//! (`try_complete_reached`): the reference tracks the level each such watch is
//! armed at (its own, then one above each advance that checked it and found it
//! not yet completable) and predicts exactly which operations each advance
//! checks and completes.
//! Prints the seed on failure; rerun one with `PURGATORY_MODEL_SEED=<seed>`.
//!
//! The hostile rounds add user code that fights back at random points: keys whose
//! `Hash` or `Clone` panics, checks that panic, operations and outputs whose
//! `Drop` panics or calls back into the purgatory (metrics, walks, cancels).
//! After every step: the counters balance, nothing is pending that the reference
//! says finished (no ghost), and every finished handle holds the expected
//! outcome. At the end: every operation and output created was dropped once.

use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::FutureExt;
use tokio::time::Instant;
use tokio_purgatory::{
    Completion, OpRef, Operation, OperationError, OperationHandle, Purgatory, Watch,
};

mod support;
use support::rng::Rng;
use support::settle;

/// A key; `fault` makes its `Hash` or `Clone` panic.
#[derive(Debug)]
struct Key {
    id: u8,
    fault: Fault,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    None,
    Hash,
    Clone,
}

impl Key {
    fn plain(id: u8) -> Key {
        Key {
            id,
            fault: Fault::None,
        }
    }
}

impl Clone for Key {
    fn clone(&self) -> Key {
        if self.fault == Fault::Clone {
            panic!("model: hostile key clone");
        }
        Key::plain(self.id)
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
        if self.fault == Fault::Hash {
            panic!("model: hostile key hash");
        }
        self.id.hash(h);
    }
}

/// What a value's `Drop` does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OnDrop {
    Nothing,
    Panic,
    CallBack,
}

/// What every value of one run shares.
#[derive(Default)]
struct World {
    slot: Mutex<Option<Purgatory<Key, Op>>>,
    ops_made: AtomicUsize,
    ops_dropped: AtomicUsize,
    outs_made: AtomicUsize,
    outs_dropped: AtomicUsize,
    /// Calls back from a drop that found something wrong.
    violations: AtomicUsize,
    /// Set during an event step, when operations are ready: a call back's walk
    /// may then complete some of them itself (counted here).
    in_event: AtomicBool,
    completed_by_call_backs: AtomicUsize,
    /// Each key's level, as the operations' checks read it.
    levels: [AtomicU64; 8],
}

impl World {
    fn reached(&self, needs: &[(u8, u64)]) -> bool {
        !needs.is_empty()
            && needs
                .iter()
                .all(|&(k, l)| self.levels[k as usize].load(Ordering::SeqCst) >= l)
    }
}

impl World {
    /// A drop calling back in: reads the metrics (every shard lock), walks an
    /// unknown key and a real one, cancels an unknown key. Outside an event step
    /// nothing live can complete, so none of this may complete or cancel anything.
    fn call_back(&self, key: u8) {
        let p = self.slot.lock().unwrap().clone();
        if let Some(p) = p {
            let _ = p.metrics();
            let n =
                p.try_complete_watched(&Key::plain(200)) + p.try_complete_watched(&Key::plain(key));
            let c = p.cancel_for_key(&Key::plain(201)).len();
            if self.in_event.load(Ordering::SeqCst) {
                self.completed_by_call_backs.fetch_add(n, Ordering::SeqCst);
            } else if n != 0 {
                self.violations.fetch_add(1, Ordering::SeqCst);
            }
            if c != 0 {
                self.violations.fetch_add(1, Ordering::SeqCst);
            }
        }
    }
}

struct Op {
    id: u64,
    ready: Arc<AtomicBool>,
    /// Keys and levels it waits for (completable once all are reached).
    needs: Vec<(u8, u64)>,
    check_panics: bool,
    on_drop: OnDrop,
    out_drop: OnDrop,
    world: Arc<World>,
}

struct Out {
    id: u64,
    on_drop: OnDrop,
    world: Arc<World>,
}

impl Out {
    fn new(op: &Op) -> Out {
        op.world.outs_made.fetch_add(1, Ordering::SeqCst);
        Out {
            id: op.id,
            on_drop: op.out_drop,
            world: op.world.clone(),
        }
    }
}

impl std::fmt::Debug for Out {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Out({})", self.id)
    }
}

fn hostile_drop(on_drop: OnDrop, world: &World, id: u64) {
    match on_drop {
        OnDrop::Nothing => {}
        OnDrop::CallBack => world.call_back((id % 8) as u8),
        OnDrop::Panic => {
            if !std::thread::panicking() {
                panic!("model: hostile drop");
            }
        }
    }
}

impl Drop for Op {
    fn drop(&mut self) {
        self.world.ops_dropped.fetch_add(1, Ordering::SeqCst);
        hostile_drop(self.on_drop, &self.world, self.id);
    }
}

impl Drop for Out {
    fn drop(&mut self) {
        self.world.outs_dropped.fetch_add(1, Ordering::SeqCst);
        hostile_drop(self.on_drop, &self.world, self.id);
    }
}

impl Operation for Op {
    type Output = Out;
    fn try_complete(&mut self) -> Option<Out> {
        if self.check_panics {
            panic!("model: hostile check");
        }
        (self.ready.load(Ordering::SeqCst) || self.world.reached(&self.needs))
            .then(|| Out::new(self))
    }
    fn on_expiration(self) -> Out {
        // Drop the operation before making the output: when a parameter's drop
        // panics after the return value exists, Rust leaks that value
        // (rust-lang/rust#47949), which this test would count as our leak.
        let world = self.world.clone();
        let (id, on_drop) = (self.id, self.out_drop);
        drop(self);
        world.outs_made.fetch_add(1, Ordering::SeqCst);
        Out { id, on_drop, world }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    Completed,
    Expired,
    /// Expired, but the operation's drop (inside `on_expiration`) panicked.
    ExpiryPanicked,
    Cancelled,
}

struct Live {
    keys: Vec<u8>,
    /// Level watches: key, the level it is armed at, the level it needs.
    levels: Vec<(u8, u64)>,
    needs: Vec<(u8, u64)>,
    deadline: Instant,
    ready: Arc<AtomicBool>,
    check_panics: bool,
    drop_panics: bool,
}

impl Live {
    fn completable(&self, world: &World) -> bool {
        !self.check_panics && (self.ready.load(Ordering::SeqCst) || world.reached(&self.needs))
    }

    fn watches(&self, key: u8) -> bool {
        self.keys.contains(&key) || self.levels.iter().any(|&(k, _)| k == key)
    }

    fn expiry(&self) -> Expect {
        if self.drop_panics {
            Expect::ExpiryPanicked
        } else {
            Expect::Expired
        }
    }
}

struct Tracked {
    handle: OperationHandle<Key, Op>,
    op_ref: Option<OpRef<Key, Op>>,
}

/// Drops a value the test was handed, whose `Drop` may panic.
fn discard<T>(v: T) {
    let _ = catch_unwind(AssertUnwindSafe(move || drop(v)));
}

fn pick_drop(rng: &mut Rng, hostile: bool) -> OnDrop {
    if !hostile {
        return OnDrop::Nothing;
    }
    match rng.below(6) {
        0 => OnDrop::Panic,
        1 => OnDrop::CallBack,
        _ => OnDrop::Nothing,
    }
}

/// `levels`: a run weighted to level watches (every operation has some, on 3
/// keys, with long timeouts and frequent level moves), so that watches re-armed
/// by one advance meet later advances and regressions.
async fn run(seed: u64, steps: usize, hostile: bool, levels: bool) -> Result<(), String> {
    let mut rng = Rng(seed);
    let world = Arc::new(World::default());
    let p: Purgatory<Key, Op> = Purgatory::builder()
        .name("model")
        .purge_interval(rng.below(20) as usize)
        .build()
        .unwrap();
    *world.slot.lock().unwrap() = Some(p.clone());
    let mut live: BTreeMap<u64, Live> = BTreeMap::new();
    let mut tracked: HashMap<u64, Tracked> = HashMap::new();
    let mut expect: HashMap<u64, Expect> = HashMap::new();
    let mut next_id = 0u64;

    let finish = |live: &mut BTreeMap<u64, Live>, expect: &mut HashMap<u64, Expect>, id, e| {
        live.remove(&id);
        expect.insert(id, e);
    };

    for step in 0..steps {
        let before = p.metrics();
        let mut choice = rng.below(15);
        if levels && choice >= 12 && rng.below(3) != 0 {
            choice = 10; // fewer time steps, more level moves
        }
        match choice {
            0..=3 => {
                let id = next_id;
                next_id += 1;
                // Plain keys, keys at levels, or both (not both under hostile
                // code: a call back's walk of a plain key could then complete an
                // operation its levels satisfy, which no step predicts).
                let shape = match (levels, hostile) {
                    (true, true) => 1,
                    (true, false) => 1 + rng.below(2),
                    (false, true) => rng.below(2),
                    (false, false) => rng.below(3),
                };
                let nkeys = if shape == 1 {
                    0
                } else {
                    1 + rng.below(3) as usize
                };
                let nlevels = if shape == 0 {
                    0
                } else {
                    1 + rng.below(2) as usize
                };
                let ids: Vec<u8> = (0..nkeys).map(|_| rng.below(8) as u8).collect();
                let needs: Vec<(u8, u64)> = (0..nlevels)
                    .map(|_| {
                        let k = rng.below(if levels { 3 } else { 8 }) as u8;
                        let now = world.levels[k as usize].load(Ordering::SeqCst);
                        (k, (now + rng.below(40)).saturating_sub(8))
                    })
                    .collect();
                let mut keys: Vec<Key> = ids
                    .iter()
                    .chain(needs.iter().map(|(k, _)| k))
                    .map(|&k| Key::plain(k))
                    .collect();
                if hostile && rng.below(8) == 0 {
                    let i = rng.below(keys.len() as u64) as usize;
                    keys[i].fault = if rng.below(2) == 0 {
                        Fault::Hash
                    } else {
                        Fault::Clone
                    };
                }
                let level_keys = keys.split_off(nkeys);
                let level_watches: Vec<Watch<Key>> = level_keys
                    .into_iter()
                    .zip(&needs)
                    .map(|(k, &(_, l))| Watch::level(k, l))
                    .collect();
                let ready = Arc::new(AtomicBool::new(rng.below(10) == 0));
                let check_panics = hostile && rng.below(10) == 0;
                let on_drop = pick_drop(&mut rng, hostile);
                let timeout = Duration::from_millis(1 + rng.below(if levels { 1000 } else { 100 }));
                world.ops_made.fetch_add(1, Ordering::SeqCst);
                let op = Op {
                    id,
                    ready: ready.clone(),
                    needs: needs.clone(),
                    check_panics,
                    on_drop,
                    out_drop: pick_drop(&mut rng, hostile),
                    world: world.clone(),
                };
                let registered = catch_unwind(AssertUnwindSafe(|| {
                    if nlevels == 0 {
                        p.try_complete_else_watch(op, timeout, keys)
                    } else {
                        let plain = keys.into_iter().map(Watch::key);
                        p.try_complete_else_watch_levels(op, timeout, plain.chain(level_watches))
                    }
                }));
                let handle = match registered {
                    Ok(r) => r.map_err(|e| format!("step {step}: registration failed: {e}"))?,
                    Err(_) => {
                        // A key's code panicked: nothing may have changed.
                        let after = p.metrics();
                        if (after.registered, after.delayed) != (before.registered, before.delayed)
                        {
                            return Err(format!(
                                "step {step}: a key panic left a ghost: {before:?} -> {after:?}"
                            ));
                        }
                        continue;
                    }
                };
                let entry = Live {
                    keys: {
                        let mut keys = ids;
                        keys.sort();
                        keys.dedup();
                        keys
                    },
                    levels: needs.clone(),
                    needs,
                    deadline: Instant::now() + timeout,
                    ready,
                    check_panics,
                    drop_panics: on_drop == OnDrop::Panic,
                };
                if entry.completable(&world) {
                    expect.insert(id, Expect::Completed);
                } else {
                    live.insert(id, entry);
                }
                let op_ref = handle.op_ref();
                tracked.insert(id, Tracked { handle, op_ref });
            }
            4..=5 => {
                // An event on a key: some of its operations become completable.
                let key = rng.below(8) as u8;
                let mut want = 0;
                let ids: Vec<u64> = live
                    .iter()
                    .filter(|(_, l)| l.keys.contains(&key))
                    .map(|(id, _)| *id)
                    .collect();
                for id in ids {
                    if rng.below(2) == 0 {
                        live[&id].ready.store(true, Ordering::SeqCst);
                    }
                    if live[&id].completable(&world) {
                        want += 1;
                        finish(&mut live, &mut expect, id, Expect::Completed);
                    }
                }
                world.in_event.store(true, Ordering::SeqCst);
                let got = catch_unwind(AssertUnwindSafe(|| {
                    p.try_complete_watched(&Key::plain(key))
                }))
                .map_err(|_| format!("step {step}: a walk panicked"))?;
                world.in_event.store(false, Ordering::SeqCst);
                let got = got + world.completed_by_call_backs.swap(0, Ordering::SeqCst);
                if got != want {
                    return Err(format!(
                        "step {step}: try_complete_watched({key}) = {got}, expected {want}"
                    ));
                }
            }
            6 => {
                // An event on one operation, through its reference.
                if let Some(&id) = live
                    .keys()
                    .nth(rng.below(live.len().max(1) as u64) as usize)
                {
                    live[&id].ready.store(true, Ordering::SeqCst);
                    let r = tracked[&id].op_ref.as_ref().expect("live ops have a ref");
                    let done = catch_unwind(AssertUnwindSafe(|| r.try_complete()))
                        .map_err(|_| format!("step {step}: a check by reference panicked"))?;
                    let want = !live[&id].check_panics;
                    if done != want {
                        return Err(format!("step {step}: op_ref.try_complete({id}) = {done}"));
                    }
                    if done {
                        finish(&mut live, &mut expect, id, Expect::Completed);
                    }
                }
            }
            7 => {
                let key = rng.below(8) as u8;
                let ids: Vec<u64> = live
                    .iter()
                    .filter(|(_, l)| l.watches(key))
                    .map(|(id, _)| *id)
                    .collect();
                let back = catch_unwind(AssertUnwindSafe(|| p.cancel_for_key(&Key::plain(key))))
                    .map_err(|_| format!("step {step}: cancel_for_key panicked"))?;
                let mut got: Vec<u64> = back.iter().map(|o| o.id).collect();
                got.sort();
                for op in back {
                    discard(op);
                }
                if got != ids {
                    return Err(format!(
                        "step {step}: cancel_for_key({key}) = {got:?}, expected {ids:?}"
                    ));
                }
                for id in ids {
                    finish(&mut live, &mut expect, id, Expect::Cancelled);
                }
            }
            8 => {
                // A client goes away: drop a live operation's handle.
                if let Some(&id) = live
                    .keys()
                    .nth(rng.below(live.len().max(1) as u64) as usize)
                {
                    let t = tracked.remove(&id).unwrap();
                    catch_unwind(AssertUnwindSafe(move || drop(t)))
                        .map_err(|_| format!("step {step}: dropping a handle panicked"))?;
                    live.remove(&id);
                }
            }
            10 | 11 => {
                // A key's level moves: mostly up, sometimes down (truncation).
                let key = rng.below(if levels { 3 } else { 8 }) as u8;
                let cur = world.levels[key as usize].load(Ordering::SeqCst);
                let level = if rng.below(5) == 0 {
                    cur.saturating_sub(rng.below(20))
                } else {
                    cur + rng.below(25)
                };
                world.levels[key as usize].store(level, Ordering::SeqCst);
                let mut want = 0;
                let ids: Vec<u64> = live.keys().copied().collect();
                for id in ids {
                    let l = live.get_mut(&id).unwrap();
                    let hit = l.levels.iter().any(|&(k, at)| k == key && at <= level);
                    if !(hit || l.keys.contains(&key)) {
                        continue;
                    }
                    if l.completable(&world) {
                        want += 1;
                        finish(&mut live, &mut expect, id, Expect::Completed);
                    } else {
                        for w in l.levels.iter_mut() {
                            if w.0 == key && w.1 <= level {
                                w.1 = level + 1;
                            }
                        }
                    }
                }
                let got = catch_unwind(AssertUnwindSafe(|| {
                    p.try_complete_reached(&Key::plain(key), level)
                }))
                .map_err(|_| format!("step {step}: an advance panicked"))?;
                if got != want {
                    return Err(format!(
                        "step {step}: try_complete_reached({key}, {level}) = {got}, expected {want}"
                    ));
                }
            }
            9 if hostile => {
                // A walk with a key whose hash panics: the panic reaches us, and
                // nothing changed.
                let bad = Key {
                    id: rng.below(8) as u8,
                    fault: Fault::Hash,
                };
                if catch_unwind(AssertUnwindSafe(|| p.try_complete_watched(&bad))).is_ok() {
                    return Err(format!("step {step}: a hostile hash did not panic"));
                }
                let after = p.metrics();
                if (after.delayed, after.completed) != (before.delayed, before.completed) {
                    return Err(format!(
                        "step {step}: a failed walk changed {before:?} -> {after:?}"
                    ));
                }
            }
            _ => {
                let by = Duration::from_millis(rng.below(40));
                tokio::time::advance(by).await;
                settle().await;
                let now = Instant::now();
                let due: Vec<(u64, Expect)> = live
                    .iter()
                    .filter(|(_, l)| l.deadline <= now)
                    .map(|(id, l)| (*id, l.expiry()))
                    .collect();
                for (id, e) in due {
                    finish(&mut live, &mut expect, id, e);
                }
            }
        }
        let m = p.metrics();
        if m.delayed != live.len() {
            return Err(format!(
                "step {step}: delayed {} but {} live",
                m.delayed,
                live.len()
            ));
        }
        if m.registered != m.completed + m.expired + m.cancelled + m.handed_back + m.delayed as u64
        {
            return Err(format!("step {step}: counters do not balance: {m:?}"));
        }
        if world.violations.load(Ordering::SeqCst) != 0 {
            return Err(format!(
                "step {step}: a call back from a drop changed something"
            ));
        }
        // Every finished operation's handle is ready with the expected outcome.
        let done: Vec<u64> = expect.keys().copied().collect();
        for id in done {
            let e = expect.remove(&id).unwrap();
            let Some(mut t) = tracked.remove(&id) else {
                continue;
            };
            let got = (&mut t.handle)
                .now_or_never()
                .ok_or_else(|| format!("step {step}: op {id} should be {e:?} but is pending"))?;
            let ok = matches!(
                (e, &got),
                (Expect::Completed, Ok(Completion::Completed(x)))
                    | (Expect::Expired, Ok(Completion::Expired(x))) if x.id == id
            ) || matches!(
                (e, &got),
                (Expect::Cancelled, Err(OperationError::Cancelled))
                    | (Expect::ExpiryPanicked, Err(OperationError::Panicked))
            );
            if !ok {
                return Err(format!("step {step}: op {id} expected {e:?}, got {got:?}"));
            }
            discard(got);
            discard(t);
        }
    }
    let back = p.shutdown();
    if back.len() != live.len() {
        return Err(format!(
            "shutdown handed back {}, {} live",
            back.len(),
            live.len()
        ));
    }
    for op in back {
        discard(op);
    }
    for (id, mut t) in tracked.drain() {
        if live.contains_key(&id) {
            let got = (&mut t.handle).now_or_never();
            if got.as_ref().map(|r| r.as_ref().err()) != Some(Some(&OperationError::Shutdown)) {
                return Err(format!("op {id} after shutdown: {got:?}"));
            }
        }
        discard(t);
    }
    let m = p.metrics();
    if m.registered != m.completed + m.expired + m.cancelled + m.handed_back || m.delayed != 0 {
        return Err(format!("counts do not balance: {m:?}"));
    }
    if m.watched != 0 || m.tombstones != 0 || m.keys != 0 {
        return Err(format!("lists not empty after shutdown: {m:?}"));
    }
    // Nothing leaks: once the purgatory is gone, every value made was dropped.
    let last = world.slot.lock().unwrap().take();
    drop(last);
    drop(p);
    let w = &world;
    let (om, od) = (
        w.ops_made.load(Ordering::SeqCst),
        w.ops_dropped.load(Ordering::SeqCst),
    );
    let (um, ud) = (
        w.outs_made.load(Ordering::SeqCst),
        w.outs_dropped.load(Ordering::SeqCst),
    );
    if om != od || um != ud {
        return Err(format!(
            "leak: {od} of {om} operations and {ud} of {um} outputs dropped"
        ));
    }
    Ok(())
}

/// Keeps the expected panics of hostile user code out of the test output.
fn quiet_hostile_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let msg = info
                .payload()
                .downcast_ref::<&str>()
                .copied()
                .unwrap_or_default();
            if !msg.starts_with("model: hostile") {
                default(info);
            }
        }));
    });
}

/// Runs `rounds` seeds from `base` on their own thread, bounded in time (a
/// deadlock fails the test instead of hanging it).
fn rounds(hostile: bool, levels: bool, default_base: u64) {
    quiet_hostile_panics();
    let fixed = std::env::var("PURGATORY_MODEL_SEED")
        .ok()
        .and_then(|s| s.parse().ok());
    let base: u64 = fixed.unwrap_or(default_base);
    let rounds = if fixed.is_some() { 1 } else { 40 };
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for round in 0..rounds {
            let seed = base.wrapping_add(round);
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .start_paused(true)
                .build()
                .unwrap();
            let r = catch_unwind(AssertUnwindSafe(|| {
                rt.block_on(run(seed, 1500, hostile, levels))
            }));
            let r = match r {
                Ok(r) => r,
                Err(_) => Err("a panic escaped the purgatory".to_string()),
            };
            if let Err(e) = r {
                let _ = tx.send(Err(format!("{e}; rerun with PURGATORY_MODEL_SEED={seed}")));
                return;
            }
        }
        let _ = tx.send(Ok(()));
    });
    match rx.recv_timeout(Duration::from_secs(120)) {
        Ok(Ok(())) => {}
        Ok(Err(e)) => panic!("purgatory model failed: {e}"),
        Err(_) => panic!("purgatory model deadlocked (no answer in 120 s)"),
    }
}

#[test]
fn purgatory_matches_the_reference_model() {
    rounds(false, false, 0xC0FFEE);
}

#[test]
fn purgatory_matches_the_reference_model_under_hostile_user_code() {
    rounds(true, false, 0xBAD_C0DE);
}

#[test]
fn level_watches_match_the_reference_model() {
    rounds(false, true, 0x1E7E1);
}

#[test]
fn level_watches_match_the_reference_model_under_hostile_user_code() {
    rounds(true, true, 0x1E7E_1BAD);
}
