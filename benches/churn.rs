//! Steady-state cost of one request, in a tight loop: `cargo bench --bench churn`.
//!
//! A window of `--window` requests (default 20,000) is kept pending. Each step
//! registers one request on 3 keys drawn at random from 1,000 (timeout one
//! hour), and completes the request registered `--window` steps earlier by
//! reference, running its check. That is the registration and completion
//! work of `purgatory_perf --mode kafka` without the rate limiter, the
//! completion driver's clock or the expiries, so that two builds compare
//! within a few percent where the rate-limited runs cannot.
//!
//! The same steps run against a one-lock purgatory (`DelayQueue`, slab with
//! generation-checked ids, `HashMap<u32, Vec<Id>>` behind one mutex; it runs
//! the same checks and prunes its lists once dead ids outnumber
//! max(1,000, live ones), in one pass), and against that purgatory under this
//! crate's rules (`lean`: no check and no drop of an operation under its lock;
//! a check takes the operation out under the lock and runs with it released,
//! registration checks again after it watches, and each reference holds the
//! purgatory's `Arc`, as an `OpRef` does, two of its ten atomic
//! read-modify-writes): what the rules cost, with that. `lean-wheel` is the
//! same with this crate's timing wheel (`src/wheel.rs`) in place of
//! `DelayQueue`. `--impl purgatory|fair|lean|lean-wheel` runs one of them; `--rounds N` (default 5) repeats, printing ns per request for each
//! round and the median; `--window N` and `--steps N` (default 1,000,000)
//! size the run. Under `valgrind --tool=callgrind`, the difference between
//! two `--steps` counts gives instructions per request (see
//! `docs/performance.md`).
//!
//! `--walks N` measures key walks instead: the window's requests are
//! registered and left pending, then N walks of keys drawn at random run
//! every live watcher's check (none completes) and drop dead ids, printing ns
//! per check. The fair peer runs the checks under its lock; the lean ones take
//! each operation out under the lock and check it with the lock released, as
//! this crate does.

use std::collections::{HashMap, VecDeque};
use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio_purgatory::{OpRef, Operation, Purgatory};
use tokio_util::time::{delay_queue, DelayQueue};

/// Requests with a sequence number below this may complete.
static DONE_BELOW: AtomicU64 = AtomicU64::new(0);

struct Op {
    seq: u64,
    _payload: usize,
}

impl Op {
    fn check(&mut self) -> Option<()> {
        (DONE_BELOW.load(Ordering::Relaxed) > self.seq).then_some(())
    }
}

impl Operation for Op {
    type Output = ();
    fn try_complete(&mut self) -> Option<()> {
        self.check()
    }
    fn on_expiration(self) {}
}

/// xorshift64*: keys drawn at random, the same sequence for every run.
struct Rng(u64);

impl Rng {
    fn keys(&mut self) -> [u32; 3] {
        let mut k = [0u32; 3];
        for slot in &mut k {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            *slot = (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) as u32 % 1000;
        }
        k
    }
}

#[path = "../tests/support/one_lock.rs"]
#[allow(unreachable_pub)]
mod one_lock;
use one_lock::Id;
use one_lock::{vacant, watch};

struct Pending {
    op: Op,
    timer: delay_queue::Key,
    keys: u32,
}

#[derive(Default)]
struct Slot {
    generation: u32,
    pending: Option<Pending>,
}

/// Both one-lock purgatories' purge: once dead ids outnumber
/// max(1,000, live ones), every list is swept in one pass.
fn purge(
    watchers: &mut HashMap<u32, Vec<Id>>,
    live: usize,
    dead: &mut usize,
    is_live: impl Fn(Id) -> bool,
) {
    if *dead > live.max(1000) {
        watchers.retain(|_, ids| {
            let before = ids.len();
            ids.retain(|id| is_live(*id));
            *dead -= before - ids.len();
            !ids.is_empty()
        });
    }
}

#[derive(Default)]
struct Fair {
    queue: DelayQueue<Id>,
    slots: Vec<Slot>,
    free: Vec<u32>,
    watchers: HashMap<u32, Vec<Id>>,
    live: usize,
    dead: usize,
}

impl Fair {
    fn is_live(slots: &[Slot], id: Id) -> bool {
        let s = &slots[id.index as usize];
        s.generation == id.generation && s.pending.is_some()
    }

    fn register(
        lock: &Mutex<Fair>,
        mut op: Op,
        keys: [u32; 3],
        deadline: tokio::time::Instant,
    ) -> Option<Id> {
        let mut s = lock.lock().unwrap();
        let s = &mut *s;
        if op.check().is_some() {
            return None;
        }
        let id = vacant(&mut s.slots, &mut s.free, |s| s.generation);
        let timer = s.queue.insert_at(id, deadline);
        let n = watch(&mut s.watchers, &keys, id);
        s.live += n as usize;
        s.slots[id.index as usize].pending = Some(Pending { op, timer, keys: n });
        let Fair {
            slots,
            watchers,
            live,
            dead,
            ..
        } = &mut *s;
        purge(watchers, *live, dead, |id| Fair::is_live(slots, id));
        Some(id)
    }

    fn complete(lock: &Mutex<Fair>, id: Id) -> bool {
        // The request leaves the lock with the lock released, as the
        // benchmark's fair peer hands its outcome on.
        let done = {
            let mut s = lock.lock().unwrap();
            let Fair {
                queue,
                slots,
                free,
                live,
                dead,
                ..
            } = &mut *s;
            let slot = &mut slots[id.index as usize];
            if slot.generation != id.generation {
                return false;
            }
            let completes = match slot.pending.as_mut() {
                Some(p) => p.op.check().is_some(),
                None => false,
            };
            if !completes {
                return false;
            }
            let p = slot.pending.take().expect("checked");
            slot.generation = slot.generation.wrapping_add(1);
            free.push(id.index);
            *live -= p.keys as usize;
            *dead += p.keys as usize;
            queue.remove(&p.timer);
            p
        };
        black_box(done);
        true
    }
}

impl Fair {
    /// Runs the check of every live watcher of `key` under the lock,
    /// completing those that say so and dropping dead ids; returns how many
    /// it checked.
    fn walk(lock: &Mutex<Fair>, key: u32) -> usize {
        let mut done = Vec::new();
        let mut checked = 0;
        {
            let mut s = lock.lock().unwrap();
            let Fair {
                queue,
                slots,
                free,
                watchers,
                live,
                dead,
            } = &mut *s;
            if let Some(ids) = watchers.get_mut(&key) {
                ids.retain(|id| {
                    let slot = &mut slots[id.index as usize];
                    let Some(p) = slot
                        .pending
                        .as_mut()
                        .filter(|_| slot.generation == id.generation)
                    else {
                        *dead -= 1;
                        return false;
                    };
                    checked += 1;
                    if p.op.check().is_none() {
                        return true;
                    }
                    let p = slot.pending.take().expect("checked");
                    slot.generation = slot.generation.wrapping_add(1);
                    free.push(id.index);
                    *live -= p.keys as usize;
                    *dead += p.keys as usize - 1;
                    queue.remove(&p.timer);
                    done.push(p);
                    false
                });
            }
        }
        black_box(done);
        checked
    }
}

/// The lean peer's request slot: the operation is taken out while a check
/// runs (with the lock released), and `rerun` records a check asked for
/// meanwhile.
struct LeanSlot<K> {
    generation: u32,
    pending: bool,
    checking: bool,
    rerun: bool,
    op: Option<Op>,
    timer: Option<K>,
    keys: u32,
}

impl<K> Default for LeanSlot<K> {
    fn default() -> Self {
        LeanSlot {
            generation: 0,
            pending: false,
            checking: false,
            rerun: false,
            op: None,
            timer: None,
            keys: 0,
        }
    }
}

/// The lean peer's timer: `DelayQueue`, or this crate's timing wheel
/// (`src/wheel.rs`, compiled into the bench) under the same lock.
trait Timers: Default {
    type Key;
    fn insert(&mut self, id: Id, deadline: tokio::time::Instant) -> Self::Key;
    fn remove(&mut self, key: &Self::Key);
}

impl Timers for DelayQueue<Id> {
    type Key = delay_queue::Key;
    fn insert(&mut self, id: Id, deadline: tokio::time::Instant) -> Self::Key {
        self.insert_at(id, deadline)
    }
    fn remove(&mut self, key: &Self::Key) {
        DelayQueue::remove(self, key);
    }
}

#[allow(dead_code)]
#[path = "../src/wheel.rs"]
mod wheel;
// The wheel's own tests, compiled with it here, use the crate's test generator.
#[cfg(test)]
#[path = "../tests/support/rng.rs"]
#[allow(unreachable_pub)]
mod test_rng;

/// This crate's wheel at its default shape (64 slots, 6 levels) and tick
/// (100 µs), with deadlines in ticks from when it was made.
struct WheelTimers {
    wheel: wheel::Wheel<Id>,
    origin: tokio::time::Instant,
}

impl Default for WheelTimers {
    fn default() -> Self {
        WheelTimers {
            wheel: wheel::Wheel::new(64, 6).expect("a valid shape"),
            origin: tokio::time::Instant::now(),
        }
    }
}

impl Timers for WheelTimers {
    type Key = wheel::Key;
    fn insert(&mut self, id: Id, deadline: tokio::time::Instant) -> Self::Key {
        // Rounded up, so an entry never fires before its deadline.
        let tick = deadline.saturating_duration_since(self.origin).as_micros() as u64 / 100 + 1;
        self.wheel.insert(tick, id)
    }
    fn remove(&mut self, key: &Self::Key) {
        self.wheel.remove(*key);
    }
}

/// The one-lock purgatory under this crate's rules: no check and no drop of
/// an operation under the lock. A check takes the operation out under the
/// lock, runs with it released, and puts it back (or finishes it) under the
/// lock again; a check asked for meanwhile is recorded and run by the
/// checker. Registration checks before and after watching, as the crate does.
struct Lean<Q: Timers> {
    queue: Q,
    slots: Vec<LeanSlot<Q::Key>>,
    free: Vec<u32>,
    watchers: HashMap<u32, Vec<Id>>,
    live: usize,
    dead: usize,
}

impl<Q: Timers> Default for Lean<Q> {
    fn default() -> Self {
        Lean {
            queue: Q::default(),
            slots: Vec::new(),
            free: Vec::new(),
            watchers: HashMap::new(),
            live: 0,
            dead: 0,
        }
    }
}

impl<Q: Timers> Lean<Q> {
    fn is_live(slots: &[LeanSlot<Q::Key>], id: Id) -> bool {
        let s = &slots[id.index as usize];
        s.generation == id.generation && s.pending
    }

    fn finish(&mut self, id: Id) {
        let slot = &mut self.slots[id.index as usize];
        slot.pending = false;
        slot.checking = false;
        slot.rerun = false;
        slot.generation = slot.generation.wrapping_add(1);
        let timer = slot.timer.take().expect("armed");
        let keys = slot.keys as usize;
        self.free.push(id.index);
        self.live -= keys;
        self.dead += keys;
        self.queue.remove(&timer);
    }

    /// The owner's check loop: `op` is out of its slot, `checking` is set.
    fn settle(lock: &Mutex<Lean<Q>>, id: Id, mut op: Op) -> bool {
        loop {
            let done = op.check().is_some();
            let mut s = lock.lock().unwrap();
            if done {
                s.finish(id);
                drop(s);
                black_box(op);
                return true;
            }
            let slot = &mut s.slots[id.index as usize];
            if slot.rerun {
                slot.rerun = false;
                continue;
            }
            slot.checking = false;
            slot.op = Some(op);
            return false;
        }
    }

    fn register(
        lock: &Mutex<Lean<Q>>,
        mut op: Op,
        keys: [u32; 3],
        deadline: tokio::time::Instant,
    ) -> Option<Id> {
        if op.check().is_some() {
            return None;
        }
        let id = {
            let mut s = lock.lock().unwrap();
            let s = &mut *s;
            let id = vacant(&mut s.slots, &mut s.free, |s| s.generation);
            let timer = s.queue.insert(id, deadline);
            let n = watch(&mut s.watchers, &keys, id);
            s.live += n as usize;
            let slot = &mut s.slots[id.index as usize];
            slot.pending = true;
            slot.checking = true;
            slot.timer = Some(timer);
            slot.keys = n;
            let Lean {
                slots,
                watchers,
                live,
                dead,
                ..
            } = &mut *s;
            purge(watchers, *live, dead, |id| Lean::<Q>::is_live(slots, id));
            id
        };
        (!Lean::<Q>::settle(lock, id, op)).then_some(id)
    }

    fn complete(lock: &Mutex<Lean<Q>>, id: Id) -> bool {
        let op = {
            let mut s = lock.lock().unwrap();
            let slot = &mut s.slots[id.index as usize];
            if slot.generation != id.generation || !slot.pending {
                return false;
            }
            if slot.checking {
                slot.rerun = true;
                return false;
            }
            slot.checking = true;
            slot.op.take().expect("pending")
        };
        Lean::<Q>::settle(lock, id, op)
    }
}

/// A walk's requests taken out of their slots: the id, the operation while
/// taken, and whether its check completed it.
type Taken = Vec<(Id, Option<Op>, bool)>;

impl<Q: Timers> Lean<Q> {
    /// Takes the operation of every live watcher of `key` out in one hold of
    /// the lock (asking one being checked elsewhere to check again, and
    /// dropping dead ids), checks them with the lock released, and finishes
    /// or puts them back in one more hold (one more per round of re-checks
    /// asked for meanwhile); returns how many it checked.
    fn walk(lock: &Mutex<Lean<Q>>, key: u32, taken: &mut Taken) -> usize {
        {
            let mut s = lock.lock().unwrap();
            let Lean {
                slots,
                watchers,
                dead,
                ..
            } = &mut *s;
            if let Some(ids) = watchers.get_mut(&key) {
                ids.retain(|&id| {
                    if !Lean::<Q>::is_live(slots, id) {
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
            }
        }
        let checked = taken.len();
        let mut finished = Vec::new();
        while !taken.is_empty() {
            for (_, op, done) in taken.iter_mut() {
                *done = op.as_mut().expect("taken").check().is_some();
            }
            let mut s = lock.lock().unwrap();
            for (id, op, done) in taken.iter_mut() {
                if *done {
                    s.finish(*id);
                    finished.push(op.take());
                    continue;
                }
                let slot = &mut s.slots[id.index as usize];
                if slot.rerun {
                    slot.rerun = false;
                } else {
                    slot.checking = false;
                    slot.op = op.take();
                }
            }
            drop(s);
            taken.retain(|(_, op, _)| op.is_some());
        }
        black_box(finished);
        checked
    }
}

/// The steps against the lean peer with timer `Q`; ns per request.
async fn lean<Q: Timers>(
    window: u64,
    steps: u64,
    rng: &mut Rng,
    deadline: tokio::time::Instant,
) -> f64 {
    // Each reference holds the purgatory, as an `OpRef` does.
    let p = std::sync::Arc::new(Mutex::new(Lean::<Q>::default()));
    let mut ids: VecDeque<(std::sync::Arc<Mutex<Lean<Q>>>, Id)> = VecDeque::new();
    let mut t0 = Instant::now();
    for seq in 0..window + steps {
        if seq == window {
            t0 = Instant::now();
        }
        let id = Lean::register(&p, Op { seq, _payload: 0 }, rng.keys(), deadline);
        ids.push_back((p.clone(), id.expect("pending")));
        if seq >= window {
            let (r, id) = ids.pop_front().expect("a window");
            DONE_BELOW.store(seq - window + 1, Ordering::Relaxed);
            assert!(black_box(Lean::complete(&r, id)));
        }
        if seq % 1024 == 0 {
            tokio::task::yield_now().await;
        }
    }
    t0.elapsed().as_nanos() as f64 / steps as f64
}

/// `--walks`: registers `window` requests that stay pending, then walks
/// `walks` keys drawn at random; ns per check.
async fn walk_round(name: &str, window: u64, walks: u64) -> f64 {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(3600);
    let mut keys = Rng(0x2545_f491_4f6c_dd1d);
    let mut checked = 0;
    let t0;
    match name {
        "purgatory" => {
            let p: Purgatory<u32, Op> = Purgatory::new();
            let mut handles = Vec::new();
            for seq in 0..window {
                let op = Op { seq, _payload: 0 };
                handles.push(
                    p.try_complete_else_watch_at(op, deadline, rng.keys())
                        .unwrap(),
                );
            }
            let before = p.metrics().checks.key_walks.checked;
            t0 = Instant::now();
            for _ in 0..walks / 3 {
                for k in keys.keys() {
                    black_box(p.try_complete_watched(&k));
                }
            }
            checked = (p.metrics().checks.key_walks.checked - before) as usize;
        }
        "fair" => {
            let p = Mutex::new(Fair::default());
            for seq in 0..window {
                Fair::register(&p, Op { seq, _payload: 0 }, rng.keys(), deadline).expect("pending");
            }
            t0 = Instant::now();
            for _ in 0..walks / 3 {
                for k in keys.keys() {
                    checked += Fair::walk(&p, k);
                }
            }
        }
        _ => {
            async fn lean_walks<Q: Timers>(
                window: u64,
                walks: u64,
                rng: &mut Rng,
                keys: &mut Rng,
                deadline: tokio::time::Instant,
            ) -> (Instant, usize) {
                let p = Mutex::new(Lean::<Q>::default());
                for seq in 0..window {
                    Lean::register(&p, Op { seq, _payload: 0 }, rng.keys(), deadline)
                        .expect("pending");
                }
                let mut taken = Vec::new();
                let mut checked = 0;
                let t0 = Instant::now();
                for _ in 0..walks / 3 {
                    for k in keys.keys() {
                        checked += Lean::walk(&p, k, &mut taken);
                    }
                }
                (t0, checked)
            }
            (t0, checked) = if name == "lean" {
                lean_walks::<DelayQueue<Id>>(window, walks, &mut rng, &mut keys, deadline).await
            } else {
                lean_walks::<WheelTimers>(window, walks, &mut rng, &mut keys, deadline).await
            };
        }
    }
    t0.elapsed().as_nanos() as f64 / checked.max(1) as f64
}

fn arg(name: &str) -> Option<String> {
    let mut args = std::env::args();
    while let Some(a) = args.next() {
        if a == name {
            return args.next();
        }
    }
    None
}

fn main() {
    let window: u64 = arg("--window").map_or(20_000, |v| v.parse().unwrap());
    let steps: u64 = arg("--steps").map_or(1_000_000, |v| v.parse().unwrap());
    let rounds: usize = arg("--rounds").map_or(5, |v| v.parse().unwrap());
    let which = arg("--impl");
    let walks: Option<u64> = arg("--walks").map(|v| v.parse().unwrap());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    for name in ["purgatory", "fair", "lean", "lean-wheel"] {
        if which.as_deref().is_some_and(|w| w != name) {
            continue;
        }
        let mut per = Vec::new();
        for _ in 0..rounds {
            let ns = rt.block_on(async {
                DONE_BELOW.store(0, Ordering::Relaxed);
                if let Some(walks) = walks {
                    return walk_round(name, window, walks).await;
                }
                let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
                let deadline = tokio::time::Instant::now() + Duration::from_secs(3600);
                if name == "purgatory" {
                    let p: Purgatory<u32, Op> = Purgatory::new();
                    let mut refs: VecDeque<OpRef<u32, Op>> = VecDeque::new();
                    let mut t0 = Instant::now();
                    for seq in 0..window + steps {
                        if seq == window {
                            t0 = Instant::now();
                        }
                        let h = p
                            .try_complete_else_watch_at(
                                Op { seq, _payload: 0 },
                                deadline,
                                rng.keys(),
                            )
                            .unwrap();
                        refs.push_back(h.into_op_ref().expect("pending"));
                        if seq >= window {
                            let r = refs.pop_front().expect("a window");
                            DONE_BELOW.store(seq - window + 1, Ordering::Relaxed);
                            assert!(black_box(r.try_complete()));
                        }
                        if seq % 1024 == 0 {
                            tokio::task::yield_now().await;
                        }
                    }
                    t0.elapsed().as_nanos() as f64 / steps as f64
                } else if name == "lean" {
                    lean::<DelayQueue<Id>>(window, steps, &mut rng, deadline).await
                } else if name == "lean-wheel" {
                    lean::<WheelTimers>(window, steps, &mut rng, deadline).await
                } else {
                    let p = Mutex::new(Fair::default());
                    let mut ids: VecDeque<Id> = VecDeque::new();
                    let mut t0 = Instant::now();
                    for seq in 0..window + steps {
                        if seq == window {
                            t0 = Instant::now();
                        }
                        let id = Fair::register(&p, Op { seq, _payload: 0 }, rng.keys(), deadline);
                        ids.push_back(id.expect("pending"));
                        if seq >= window {
                            let id = ids.pop_front().expect("a window");
                            DONE_BELOW.store(seq - window + 1, Ordering::Relaxed);
                            assert!(black_box(Fair::complete(&p, id)));
                        }
                        if seq % 1024 == 0 {
                            tokio::task::yield_now().await;
                        }
                    }
                    t0.elapsed().as_nanos() as f64 / steps as f64
                }
            });
            per.push(ns);
        }
        let mut sorted = per.clone();
        sorted.sort_by(f64::total_cmp);
        let (digits, unit) = match walks {
            Some(_) => (1, "check"),
            None => (0, "request"),
        };
        let rounds: Vec<String> = per.iter().map(|v| format!("{v:.digits$}")).collect();
        println!(
            "{name}: median {:.digits$} ns per {unit} [{:.digits$}..{:.digits$}] ({})",
            sorted[sorted.len() / 2],
            sorted[0],
            sorted[sorted.len() - 1],
            rounds.join(" ")
        );
    }
}
