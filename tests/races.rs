//! Real threads racing each other on one purgatory. Threads registering
//! (keys whose `Hash` or `Clone` panic, levels), walking, advancing,
//! checking by reference, resetting, cancelling and dropping handles at
//! once, while the clock moves, with operations whose checks walk and
//! advance other keys or panic and whose drops and expiries walk keys or
//! panic: once every key is advanced past every need and walked from every
//! thread at once, nothing is left pending (no event missed), each
//! operation finished and was dropped once, and the counts balance. The
//! same racing a `shutdown` or the last clone dropped by whichever thread
//! lets go last, on paused time and on a multi-thread runtime with real
//! time: every handle resolves, each operation finishes at most once and is
//! dropped once, and what shutdown hands back never completed or expired.
//! Two threads checking operations that walk (or ready) each other's keys:
//! both complete when they ready each other, and walks that only ask each
//! other for re-runs return long before the timeout, which ends them at the
//! latest. Each race is bounded in time; a failing seed is named, and
//! `PURGATORY_RACES_SEED` replays it.

mod support;

use std::hash::{Hash, Hasher};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex, OnceLock};
use std::time::{Duration, Instant};

use tokio::time::advance;
use tokio_purgatory::{
    Completion, OpRef, Operation, OperationError, OperationHandle, Purgatory, Watch, WeakPurgatory,
};

use support::rng::Rng;
use support::{balanced, ms, settle, within};

/// Keys `0..NK` are used; 98 and 99 are hostile.
const NK: u32 = 6;

/// A key whose `Hash` panics for 99 and whose `Clone` panics for 98.
#[derive(PartialEq, Eq, Debug)]
struct K(u32);

impl Hash for K {
    fn hash<H: Hasher>(&self, h: &mut H) {
        if self.0 == 99 {
            panic!("hash of 99");
        }
        self.0.hash(h)
    }
}

impl Clone for K {
    fn clone(&self) -> K {
        if self.0 == 98 {
            panic!("clone of 98");
        }
        K(self.0)
    }
}

/// What became of one operation, as its own code saw it.
#[derive(Default)]
struct Fate {
    busy: AtomicBool,
    checks: AtomicUsize,
    completed: AtomicUsize,
    expired: AtomicUsize,
    drops: AtomicUsize,
    finished: AtomicBool,
}

/// What one race's operations share.
struct World {
    /// Each key's level.
    hw: Vec<AtomicU64>,
    ops: Mutex<Vec<Arc<Fate>>>,
    /// What operation code saw go wrong (it cannot fail the test itself: the
    /// purgatory catches its panics).
    bad: Mutex<Vec<String>>,
    weak: WeakPurgatory<K, Op>,
    /// Calls back in from operation code are on.
    chaos: AtomicBool,
}

impl World {
    fn new(p: &Purgatory<K, Op>) -> Arc<World> {
        Arc::new(World {
            hw: (0..NK).map(|_| AtomicU64::new(0)).collect(),
            ops: Mutex::default(),
            bad: Mutex::default(),
            weak: p.downgrade(),
            chaos: AtomicBool::new(true),
        })
    }

    fn bad(&self, s: &str) {
        self.bad.lock().unwrap().push(s.to_string());
    }

    fn bad_so_far(&self) -> Vec<String> {
        self.bad.lock().unwrap().clone()
    }

    fn fates(&self) -> Vec<Arc<Fate>> {
        self.ops.lock().unwrap().clone()
    }
}

thread_local! {
    /// Calls back in from operation code nested on this thread (bounded, or
    /// the operations' calls into each other would multiply without end).
    /// Per thread, and each race runs on threads of its own.
    static DEPTH: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Runs `f` on the purgatory from operation code, unless calls back in are
/// off, the thread is nested deep enough already or the purgatory is gone.
fn nested(w: &World, f: impl FnOnce(&Purgatory<K, Op>)) {
    struct Back(usize);
    impl Drop for Back {
        fn drop(&mut self) {
            DEPTH.with(|d| d.set(self.0));
        }
    }
    let depth = DEPTH.with(|d| d.get());
    if !w.chaos.load(Ordering::SeqCst) || depth >= 2 {
        return;
    }
    let Some(p) = w.weak.upgrade() else { return };
    DEPTH.with(|d| d.set(depth + 1));
    let _back = Back(depth);
    f(&p);
}

/// An operation on key `key` that completes once the key's level reaches
/// `need`, and whose code calls back in.
struct Op {
    fate: Arc<Fate>,
    w: Arc<World>,
    key: u32,
    need: u64,
    /// What every third check does from inside: 0 nothing, 1 walk `other`,
    /// 2 advance `other` to its level, 3 (every check) panic every third.
    mode: u8,
    other: u32,
    drop_walks: bool,
    expiry_walks: bool,
    drop_panics: bool,
    expiry_panics: bool,
}

impl Op {
    fn run(&mut self, reached: Option<u64>) -> Option<u64> {
        struct Free<'a>(&'a AtomicBool);
        impl Drop for Free<'_> {
            fn drop(&mut self) {
                self.0.store(false, Ordering::SeqCst);
            }
        }
        if self.fate.busy.swap(true, Ordering::SeqCst) {
            self.w.bad("checks overlap");
        }
        if self.fate.finished.load(Ordering::SeqCst) {
            self.w.bad("checked after it finished");
        }
        let _free = Free(&self.fate.busy);
        let n = self.fate.checks.fetch_add(1, Ordering::SeqCst);
        // Decide first, from the level the call names (or the stored one)...
        let level = reached.unwrap_or_else(|| self.w.hw[self.key as usize].load(Ordering::SeqCst));
        let done = level >= self.need;
        // ... then act, which may call back in or panic.
        if n.is_multiple_of(3) || self.mode == 3 {
            let (mode, other, w) = (self.mode, self.other, &self.w);
            nested(w, |p| match mode {
                1 => {
                    p.try_complete_watched(&K(other));
                }
                2 => {
                    let l = w.hw[other as usize].load(Ordering::SeqCst);
                    p.try_complete_reached(&K(other), l);
                }
                3 if n % 3 == 2 => panic!("check panics"),
                _ => {}
            });
        }
        if !done {
            return None;
        }
        if self.fate.completed.fetch_add(1, Ordering::SeqCst) != 0 {
            self.w.bad("completed twice");
        }
        self.fate.finished.store(true, Ordering::SeqCst);
        Some(level)
    }
}

impl Operation for Op {
    type Output = u64;
    fn try_complete(&mut self) -> Option<u64> {
        self.run(None)
    }
    fn try_complete_reached(&mut self, reached: u64) -> Option<u64> {
        self.run(Some(reached))
    }
    fn on_expiration(self) -> u64 {
        if self.fate.finished.swap(true, Ordering::SeqCst) {
            self.w.bad("expired after it finished");
        }
        self.fate.expired.fetch_add(1, Ordering::SeqCst);
        if self.expiry_walks {
            nested(&self.w, |p| {
                p.try_complete_watched(&K(self.other));
            });
        }
        if self.expiry_panics {
            panic!("expiry panics");
        }
        u64::MAX
    }
}

impl Drop for Op {
    fn drop(&mut self) {
        if self.fate.drops.fetch_add(1, Ordering::SeqCst) != 0 {
            self.w.bad("dropped twice");
        }
        if self.drop_walks {
            let other = self.other;
            nested(&self.w, |p| {
                p.try_complete_watched(&K(other));
            });
        }
        if self.drop_panics && !std::thread::panicking() {
            panic!("drop panics");
        }
    }
}

/// Drops what the purgatory handed back one by one, each drop contained
/// (an operation's `Drop` may panic).
fn quiet_drop<T>(v: impl IntoIterator<Item = T>) {
    for x in v {
        let _ = catch_unwind(AssertUnwindSafe(move || drop(x)));
    }
}

/// Keeps the panics the operations and keys raise on purpose out of the
/// output (each test wraps the hook it finds; the wrappers agree).
fn quiet_panics() {
    const MINE: [&str; 5] = [
        "hash of 99",
        "clone of 98",
        "check panics",
        "drop panics",
        "expiry panics",
    ];
    let prev = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let msg = info.payload().downcast_ref::<&str>().copied();
        if !msg.is_some_and(|m| MINE.contains(&m)) {
            prev(info)
        }
    }));
}

/// The seeds a test runs: `PURGATORY_RACES_SEED` alone if set, else
/// `rounds` from `base`.
fn seeds(base: u64, rounds: u64) -> std::ops::Range<u64> {
    match std::env::var("PURGATORY_RACES_SEED") {
        Ok(s) => {
            let seed = s.parse().expect("PURGATORY_RACES_SEED is a number");
            seed..seed + 1
        }
        Err(_) => base..base + rounds,
    }
}

/// What the threads of one race keep: handles, references, refusals.
#[derive(Default)]
struct Kept {
    handles: Mutex<Vec<OperationHandle<K, Op>>>,
    refs: Mutex<Vec<OpRef<K, Op>>>,
    refused: AtomicUsize,
    /// Registrations a key's panic unwound out of.
    unwound: AtomicUsize,
}

fn make_op(w: &Arc<World>, rng: &mut Rng) -> Op {
    let fate = Arc::new(Fate::default());
    w.ops.lock().unwrap().push(fate.clone());
    let key = rng.below(NK as u64) as u32;
    Op {
        fate,
        w: w.clone(),
        key,
        need: w.hw[key as usize].load(Ordering::SeqCst) + 1 + rng.below(100),
        mode: rng.below(4) as u8,
        other: rng.below(NK as u64) as u32,
        drop_walks: rng.below(4) == 0,
        expiry_walks: rng.below(4) == 0,
        drop_panics: rng.below(8) == 0,
        expiry_panics: rng.below(8) == 0,
    }
}

/// One random call by a racing thread.
fn step(p: &Purgatory<K, Op>, w: &Arc<World>, kept: &Kept, rng: &mut Rng) {
    let roll = rng.below(100);
    if roll < 30 {
        let op = make_op(w, rng);
        let (key, need, other) = (op.key, op.need, op.other);
        let timeout = ms(1 + rng.below(300));
        let hostile = rng.below(40) == 0;
        let r = catch_unwind(AssertUnwindSafe(|| match rng.below(3) {
            0 => p.try_complete_else_watch(
                op,
                timeout,
                [K(key), K(other), K(if hostile { 98 } else { key })],
            ),
            1 => p.try_complete_else_watch_levels(
                op,
                timeout,
                [
                    Watch::level(K(key), need - rng.below(3).min(need)),
                    Watch::key(K(if hostile { 99 } else { other })),
                ],
            ),
            _ => p.try_complete_else_watch_levels(
                op,
                timeout,
                [Watch::above(K(key), need - 1), Watch::key(K(other))],
            ),
        }));
        match r {
            Err(_) => {
                kept.unwound.fetch_add(1, Ordering::SeqCst);
            }
            Ok(Err(e)) => {
                kept.refused.fetch_add(1, Ordering::SeqCst);
                quiet_drop([e.into_inner()]);
            }
            Ok(Ok(h)) => {
                if let Some(r) = h.op_ref() {
                    kept.refs.lock().unwrap().push(r);
                }
                match rng.below(10) {
                    0..=3 => h.detach(),
                    4 => drop(h),
                    _ => kept.handles.lock().unwrap().push(h),
                }
            }
        }
    } else if roll < 50 {
        let k = rng.below(NK as u64) as usize;
        let l = w.hw[k].fetch_add(rng.below(8), Ordering::SeqCst);
        let l = l.max(w.hw[k].load(Ordering::SeqCst));
        p.try_complete_reached(&K(k as u32), l);
    } else if roll < 62 {
        p.try_complete_watched(&K(rng.below(NK as u64) as u32));
    } else if roll < 64 {
        if rng.below(4) == 0 {
            quiet_drop(p.cancel_for_key(&K(rng.below(NK as u64) as u32)));
        }
    } else if roll < 65 {
        let _ = catch_unwind(AssertUnwindSafe(|| p.try_complete_watched(&K(99))));
    } else if roll < 88 {
        let r = {
            let refs = kept.refs.lock().unwrap();
            if refs.is_empty() {
                return;
            }
            refs[rng.below(refs.len() as u64) as usize].clone()
        };
        match rng.below(6) {
            0 | 4 => {
                r.try_complete();
            }
            1 => {
                r.reset(ms(rng.below(300)));
            }
            2 if rng.below(3) == 0 => quiet_drop(r.cancel()),
            _ => {
                let _ = r.status();
            }
        }
    } else if roll < 91 {
        let h = {
            let mut hs = kept.handles.lock().unwrap();
            if hs.is_empty() {
                return;
            }
            let i = rng.below(hs.len() as u64) as usize;
            hs.swap_remove(i)
        };
        drop(h);
    }
    let mut refs = kept.refs.lock().unwrap();
    if refs.len() > 500 {
        refs.retain(|r| !r.is_finished());
    }
}

/// Awaits every kept handle, each for at most a second; `Err` for one that
/// did not resolve.
fn outcomes(
    rt: &tokio::runtime::Runtime,
    kept: &Kept,
) -> Vec<Result<Result<Completion<u64>, OperationError>, tokio::time::error::Elapsed>> {
    let hs = std::mem::take(&mut *kept.handles.lock().unwrap());
    rt.block_on(async {
        let mut v = Vec::new();
        for h in hs {
            v.push(tokio::time::timeout(Duration::from_secs(1), h).await);
        }
        v
    })
}

/// Waits until the threads have made `target` calls in all (`made`), or
/// `done()` holds, or the real-time `give_up` has passed: the clock's moves
/// are paced by the threads' progress, not by a fixed pause, so each move
/// falls among their calls however fast or slow the machine is. Pacing
/// only: past `give_up` it waits no more (a thread that hangs is reported
/// by the test's own bound).
fn pace(made: &AtomicUsize, target: usize, done: impl Fn() -> bool, give_up: Instant) {
    while made.load(Ordering::SeqCst) < target && !done() && Instant::now() < give_up {
        std::thread::yield_now();
    }
}

/// `threads` threads make `steps` random calls each while the paused clock
/// moves in steps; then, time frozen, every key is set past every need and
/// advanced and walked from every thread at once: nothing may stay pending;
/// then time runs out and the books must balance.
fn race_then_walk_every_key(seed: u64, threads: u64, steps: usize) {
    let rt = support::paused();
    let p: Purgatory<K, Op> = {
        let _in = rt.enter();
        Purgatory::builder()
            .purge_interval(20)
            .max_pending(48)
            .build()
            .unwrap()
    };
    let w = World::new(&p);
    let kept = Arc::new(Kept::default());
    let stop = Arc::new(AtomicBool::new(false));
    let frozen = Arc::new(Barrier::new(threads as usize + 1));
    let go = Arc::new(Barrier::new(threads as usize + 1));
    let done = Arc::new(Barrier::new(threads as usize + 1));
    // Calls made by all the threads, and threads done making them.
    let made = Arc::new(AtomicUsize::new(0));
    let stepped = Arc::new(AtomicUsize::new(0));
    let ts: Vec<_> = (0..threads)
        .map(|t| {
            let (p, w, kept, stop) = (p.clone(), w.clone(), kept.clone(), stop.clone());
            let (frozen, go, done) = (frozen.clone(), go.clone(), done.clone());
            let (made, stepped) = (made.clone(), stepped.clone());
            let handle = rt.handle().clone();
            std::thread::spawn(move || {
                let _in = handle.enter();
                let mut rng = Rng(seed * 1000 + t);
                let mut n = 0;
                while !stop.load(Ordering::SeqCst) && n < steps {
                    step(&p, &w, &kept, &mut rng);
                    n += 1;
                    made.fetch_add(1, Ordering::SeqCst);
                }
                stepped.fetch_add(1, Ordering::SeqCst);
                frozen.wait();
                go.wait();
                // Every key, in this thread's order, advanced past every
                // need and walked plainly.
                let mut keys: Vec<u32> = (0..NK).collect();
                for i in (1..keys.len()).rev() {
                    keys.swap(i, rng.below(i as u64 + 1) as usize);
                }
                for k in keys {
                    p.try_complete_reached(&K(k), 1_000_000);
                    p.try_complete_watched(&K(k));
                }
                done.wait();
            })
        })
        .collect();
    // The clock moves while the threads work: 200 moves, each after the
    // threads made another 1/200 of their calls.
    let all = threads as usize * steps;
    let give_up = Instant::now() + Duration::from_secs(10);
    rt.block_on(async {
        for i in 1..=200 {
            advance(ms(1)).await;
            settle().await;
            pace(
                &made,
                i * all / 200,
                || stepped.load(Ordering::SeqCst) == threads as usize,
                give_up,
            );
        }
    });
    stop.store(true, Ordering::SeqCst);
    frozen.wait();
    // Time frozen (the runtime is not driven): every need is met.
    for hw in &w.hw {
        hw.store(1_000_000, Ordering::SeqCst);
    }
    let pending_at_freeze = p.metrics().delayed;
    go.wait();
    done.wait();
    for t in ts {
        t.join().unwrap();
    }
    let missed = p.metrics().delayed;
    let left: Vec<String> = {
        let refs = kept.refs.lock().unwrap();
        refs.iter()
            .filter(|r| !r.is_finished())
            .map(|r| format!("{:?}", r.status()))
            .collect()
    };
    // Time runs out for whatever is left.
    rt.block_on(async {
        advance(Duration::from_secs(10)).await;
        settle().await;
    });
    w.chaos.store(false, Ordering::SeqCst);
    let outcomes = outcomes(&rt, &kept);
    kept.refs.lock().unwrap().clear();
    // Completions leave tombstones under keys nobody walks again (only an
    // expiry or cancel leaving nothing pending purges): walk every key.
    for k in 0..NK {
        p.try_complete_reached(&K(k), u64::MAX);
    }
    let m = p.metrics();
    let bad = w.bad_so_far();
    let fates = w.fates();
    let created = fates.len();
    let dropped_once = fates
        .iter()
        .filter(|f| f.drops.load(Ordering::SeqCst) == 1)
        .count();
    let completed: usize = fates
        .iter()
        .map(|f| f.completed.load(Ordering::SeqCst))
        .sum();
    let expired: usize = fates.iter().map(|f| f.expired.load(Ordering::SeqCst)).sum();
    let unresolved = outcomes.iter().filter(|o| o.is_err()).count();
    let (refused, unwound) = (
        kept.refused.load(Ordering::SeqCst),
        kept.unwound.load(Ordering::SeqCst),
    );
    let summary = format!(
        "rerun with PURGATORY_RACES_SEED={seed}: created {created}, refused {refused}, \
         unwound {unwound}, pending at the freeze {pending_at_freeze}, left pending \
         after the walks {missed} {left:?}, handles {} unresolved {unresolved}, \
         bad {:?}; {m:?}",
        outcomes.len(),
        &bad[..bad.len().min(5)],
    );
    assert!(bad.is_empty(), "{summary}");
    assert_eq!(missed, 0, "missed events: {summary}");
    assert_eq!(unresolved, 0, "{summary}");
    assert_eq!(dropped_once, created, "each dropped once: {summary}");
    assert_eq!(m.delayed, 0, "{summary}");
    assert!(balanced(&m), "{summary}");
    assert_eq!(m.completed as usize, completed, "{summary}");
    assert_eq!(m.expired as usize, expired, "{summary}");
    assert_eq!(
        m.registered as usize + refused + unwound,
        created,
        "{summary}"
    );
    assert_eq!(
        (m.watched, m.tombstones, m.keys),
        (0, 0, 0),
        "the map empty once nothing is pending: {summary}"
    );
}

#[test]
fn racing_threads_then_walks_of_every_key_leave_nothing_pending_and_balance() {
    quiet_panics();
    for seed in seeds(1, 3) {
        within(20, move || race_then_walk_every_key(seed, 4, 4000));
    }
}

/// How a race ends: a `shutdown`, or the last clone dropped.
#[derive(Clone, Copy, Debug)]
enum End {
    Shutdown,
    LastClone,
}

/// `threads` threads make random calls, operation code holding clones for a
/// moment too, while the purgatory is shut down by one of them (and by this
/// thread once they are done), or its last clone is dropped by whichever
/// thread lets go last; on a paused runtime, or on a multi-thread one with
/// real time. Every handle resolves, every operation is dropped once and
/// finishes at most once, what shutdown hands back never completed or
/// expired, and the books balance.
fn race_to_the_end(seed: u64, threads: u64, end: End, real: bool) {
    let rt = if real {
        support::multi()
    } else {
        support::paused()
    };
    let p: Purgatory<K, Op> = {
        let _in = rt.enter();
        Purgatory::builder()
            .purge_interval(20)
            .max_pending(48)
            .build()
            .unwrap()
    };
    let w = World::new(&p);
    let kept = Arc::new(Kept::default());
    let handed: Arc<Mutex<Vec<Op>>> = Arc::default();
    let start = Arc::new(Barrier::new(threads as usize + 1));
    let shutdown = matches!(end, End::Shutdown);
    // Calls made by all the threads.
    let made = Arc::new(AtomicUsize::new(0));
    let ts: Vec<_> = (0..threads)
        .map(|t| {
            let (w, kept, start, handed) = (w.clone(), kept.clone(), start.clone(), handed.clone());
            let made = made.clone();
            let handle = rt.handle().clone();
            let weak = p.downgrade();
            let mut anchor = Some(p.clone());
            std::thread::spawn(move || {
                let _in = handle.enter();
                let mut rng = Rng(seed * 7919 + t);
                let let_go = 200 + rng.below(800) as usize;
                let close_at = (t == 0 && shutdown).then(|| 100 + rng.below(600) as usize);
                start.wait();
                let mut n = 0;
                // A few steps after letting go and after the shutdown.
                let last = let_go.max(close_at.unwrap_or(0)) + 50;
                while let Some(p) = weak.upgrade() {
                    step(&p, &w, &kept, &mut rng);
                    n += 1;
                    made.fetch_add(1, Ordering::SeqCst);
                    if close_at == Some(n) {
                        handed.lock().unwrap().extend(p.shutdown());
                    }
                    if n == let_go {
                        anchor = None;
                    }
                    if n > last {
                        break;
                    }
                }
                drop(anchor);
            })
        })
        .collect();
    // This thread keeps a clone only to shut down what is left.
    let keep = shutdown.then(|| p.clone());
    drop(p);
    start.wait();
    // The clock moves while the threads work, a millisecond (real or
    // paused) each time the threads made two more calls each (about their
    // average number of calls over 300 moves), until they are all done.
    let give_up = Instant::now() + Duration::from_secs(10);
    rt.block_on(async {
        for i in 1..=300 {
            if real {
                // Real time is the point here: expiries race the threads.
                tokio::time::sleep(ms(1)).await;
            } else {
                advance(ms(1)).await;
            }
            settle().await;
            pace(
                &made,
                i * 2 * threads as usize,
                || ts.iter().all(|t| t.is_finished()),
                give_up,
            );
            if ts.iter().all(|t| t.is_finished()) {
                break;
            }
        }
    });
    if let Some(p) = &keep {
        if !p.is_shutdown() {
            handed.lock().unwrap().extend(p.shutdown());
        }
    }
    for t in ts {
        t.join().unwrap();
    }
    // The purgatory is closed: what its reaper still runs ends, and every
    // operation not handed back to a caller is dropped.
    let handed_n = handed.lock().unwrap().len();
    let dropped = || {
        w.fates()
            .iter()
            .filter(|f| f.drops.load(Ordering::SeqCst) != 0)
            .count()
    };
    if real {
        // Polled: the reaper's workers drop what is left as they get to it
        // (the assertions below name what was not).
        let deadline = Instant::now() + Duration::from_secs(5);
        while dropped() + handed_n < w.fates().len() && Instant::now() < deadline {
            std::thread::sleep(ms(1));
        }
    } else {
        rt.block_on(async {
            advance(Duration::from_secs(10)).await;
            settle().await;
        });
    }
    let outcomes = outcomes(&rt, &kept);
    let m = keep.as_ref().map(|p| p.metrics());
    drop(keep);
    w.chaos.store(false, Ordering::SeqCst);
    kept.refs.lock().unwrap().clear();
    let handed: Vec<Op> = std::mem::take(&mut *handed.lock().unwrap());
    let mut bad = w.bad_so_far();
    for op in &handed {
        if op.fate.completed.load(Ordering::SeqCst) + op.fate.expired.load(Ordering::SeqCst) != 0 {
            bad.push("handed back after it finished".into());
        }
    }
    quiet_drop(handed);
    let fates = w.fates();
    let created = fates.len();
    let dropped_once = fates
        .iter()
        .filter(|f| f.drops.load(Ordering::SeqCst) == 1)
        .count();
    let two_fates = fates
        .iter()
        .filter(|f| f.completed.load(Ordering::SeqCst) + f.expired.load(Ordering::SeqCst) > 1)
        .count();
    let unresolved = outcomes.iter().filter(|o| o.is_err()).count();
    let errors: Vec<OperationError> = outcomes
        .iter()
        .filter_map(|o| match o {
            Ok(Err(e)) => Some(*e),
            _ => None,
        })
        .collect();
    let summary = format!(
        "rerun with PURGATORY_RACES_SEED={seed} ({end:?}, real time {real}): created \
         {created}, refused {}, unwound {}, handed back {handed_n}, handles {} unresolved \
         {unresolved}, errors {} (shutdown {}), bad {:?}; {m:?}",
        kept.refused.load(Ordering::SeqCst),
        kept.unwound.load(Ordering::SeqCst),
        outcomes.len(),
        errors.len(),
        errors
            .iter()
            .filter(|e| **e == OperationError::Shutdown)
            .count(),
        &bad[..bad.len().min(5)],
    );
    assert!(bad.is_empty(), "{summary}");
    assert_eq!(unresolved, 0, "{summary}");
    assert_eq!(two_fates, 0, "{summary}");
    assert_eq!(dropped_once, created, "each dropped once: {summary}");
    if let Some(m) = m {
        assert!(balanced(&m) && m.delayed == 0, "{summary}");
        assert!(m.handed_back as usize >= handed_n, "{summary}");
    }
}

#[test]
fn racing_threads_across_a_shutdown_or_the_last_clone_finish_each_once() {
    quiet_panics();
    for seed in seeds(1, 2) {
        for end in [End::Shutdown, End::LastClone] {
            within(20, move || race_to_the_end(seed, 4, end, false));
        }
    }
}

/// The same on a multi-thread runtime with real time: the reaper on its
/// workers, expiries racing the threads' checks for real.
#[test]
fn racing_threads_on_a_multi_thread_runtime_across_a_shutdown_or_the_last_clone() {
    quiet_panics();
    for seed in seeds(1, 2) {
        for end in [End::Shutdown, End::LastClone] {
            within(20, move || race_to_the_end(seed, 3, end, true));
        }
    }
}

// ---------------------------------------------------------------------------
// Two threads checking operations that walk each other's keys.

/// A purgatory its operations' code can reach.
type Slot = Arc<OnceLock<Purgatory<&'static str, Walker>>>;

/// Where the two checks of a pair meet: how many of their checks are
/// running, and how many of the two threads' walks have returned.
#[derive(Default)]
struct Meet {
    in_check: AtomicUsize,
    walks_done: AtomicUsize,
}

/// An operation that completes once its flag is set. While armed, each of
/// its checks reads its flag, then sets `readies` (if any), holds if `meet`
/// is given and walks `other`. The hold waits until the pair's other check
/// is running too (so that the walk finds it under way and asks it to run
/// again), or until a thread's walk has returned (the other check will not
/// come), at most 50 ms: a signal from the other side, not a fixed pause.
struct Walker {
    slot: Slot,
    armed: Arc<AtomicBool>,
    ready: Arc<AtomicBool>,
    readies: Option<Arc<AtomicBool>>,
    other: &'static str,
    meet: Option<Arc<Meet>>,
    checks: Arc<AtomicUsize>,
}

impl Operation for Walker {
    type Output = u32;
    fn try_complete(&mut self) -> Option<u32> {
        self.checks.fetch_add(1, Ordering::SeqCst);
        let ready = self.ready.load(Ordering::SeqCst);
        if self.armed.load(Ordering::SeqCst) {
            if let Some(r) = &self.readies {
                r.store(true, Ordering::SeqCst);
            }
            if let Some(m) = &self.meet {
                m.in_check.fetch_add(1, Ordering::SeqCst);
                let give_up = Instant::now() + ms(50);
                while m.in_check.load(Ordering::SeqCst) < 2
                    && m.walks_done.load(Ordering::SeqCst) == 0
                    && Instant::now() < give_up
                {
                    std::thread::yield_now();
                }
            }
            self.slot.get().unwrap().try_complete_watched(&self.other);
            if let Some(m) = &self.meet {
                m.in_check.fetch_sub(1, Ordering::SeqCst);
            }
        }
        ready.then_some(1)
    }
    fn on_expiration(self) -> u32 {
        0
    }
}

/// A on "a" walking "b" and B on "b" walking "a", on a purgatory of `rt`
/// (their flags, the readying ones, their meeting (held checks) if `hold`,
/// and timeout as given).
struct Pair {
    p: Purgatory<&'static str, Walker>,
    meet: Option<Arc<Meet>>,
    armed: Arc<AtomicBool>,
    checks: Arc<AtomicUsize>,
    a: OperationHandle<&'static str, Walker>,
    b: OperationHandle<&'static str, Walker>,
}

fn pair(rt: &tokio::runtime::Runtime, ready: bool, hold: bool, timeout: Duration) -> Pair {
    let meet = hold.then(|| Arc::new(Meet::default()));
    let p = Purgatory::builder().build_on(rt.handle()).unwrap();
    let slot: Slot = Arc::new(OnceLock::new());
    slot.set(p.clone()).ok();
    let armed = Arc::new(AtomicBool::new(false));
    let checks = Arc::new(AtomicUsize::new(0));
    let (ra, rb) = (Arc::default(), Arc::default());
    let walker = |mine: &Arc<AtomicBool>, theirs: &Arc<AtomicBool>, other| Walker {
        slot: slot.clone(),
        armed: armed.clone(),
        ready: mine.clone(),
        readies: ready.then(|| theirs.clone()),
        other,
        meet: meet.clone(),
        checks: checks.clone(),
    };
    let _in = rt.enter();
    let a = p
        .try_complete_else_watch(walker(&ra, &rb, "b"), timeout, ["a"])
        .unwrap();
    let b = p
        .try_complete_else_watch(walker(&rb, &ra, "a"), timeout, ["b"])
        .unwrap();
    Pair {
        p,
        meet,
        armed,
        checks,
        a,
        b,
    }
}

/// Walks "a" and "b" from two threads at once; returns what they completed.
fn walk_both_at_once(pair: &Pair) -> usize {
    let barrier = Arc::new(Barrier::new(2));
    let ws: Vec<_> = ["a", "b"]
        .into_iter()
        .map(|k| {
            let (p, barrier, meet) = (pair.p.clone(), barrier.clone(), pair.meet.clone());
            std::thread::spawn(move || {
                barrier.wait();
                let done = p.try_complete_watched(&k);
                if let Some(m) = meet {
                    m.walks_done.fetch_add(1, Ordering::SeqCst);
                }
                done
            })
        })
        .collect();
    ws.into_iter().map(|w| w.join().unwrap()).sum()
}

/// Two threads each walking one key over and over, A's check walking B's
/// key and B's walking A's every time they run, neither ever ready: the
/// walks return, and both operations expire at their timeout.
#[test]
fn checks_walking_each_others_keys_from_two_threads_end_by_the_timeout() {
    within(20, || {
        let rt = support::multi();
        let pair = pair(&rt, false, false, ms(100));
        pair.armed.store(true, Ordering::SeqCst);
        let ws: Vec<_> = ["a", "b"]
            .into_iter()
            .map(|k| {
                let p = pair.p.clone();
                std::thread::spawn(move || {
                    for _ in 0..50 {
                        p.try_complete_watched(&k);
                    }
                })
            })
            .collect();
        let a = rt.block_on(pair.a);
        let b = rt.block_on(pair.b);
        for w in ws {
            w.join().unwrap();
        }
        assert_eq!(a, Ok(Completion::Expired(0)));
        assert_eq!(b, Ok(Completion::Expired(0)));
        let m = pair.p.metrics();
        assert!(balanced(&m) && m.delayed == 0, "{m:?}");
    });
}

/// Round after round, one thread walks "a" while another walks "b": A's
/// check readies B and walks "b", B's readies A and walks "a". However the
/// two checks meet, both complete within those walks, each once.
#[test]
fn two_threads_readying_each_other_both_complete() {
    within(20, || {
        let rt = support::multi();
        for round in 0..200 {
            let pair = pair(&rt, true, false, ms(10_000));
            pair.armed.store(true, Ordering::SeqCst);
            let done = walk_both_at_once(&pair);
            pair.armed.store(false, Ordering::SeqCst);
            assert!(
                pair.a.is_finished() && pair.b.is_finished(),
                "round {round}: A finished {}, B finished {}, the walks completed {done}",
                pair.a.is_finished(),
                pair.b.is_finished()
            );
            let m = pair.p.metrics();
            assert_eq!((m.completed, m.delayed), (2, 0), "round {round}: {m:?}");
        }
    });
}

/// Checks that walk each other's keys every time they run, each held until
/// the other is under way (or its thread's walk has returned), and one
/// outside event on each key from two threads at once: each check asks the
/// one running on the other thread to run again, yet
/// the two walks return long before the operations' timeout (500 ms), after
/// a handful of checks.
#[test]
fn one_event_on_each_of_two_threads_ends_long_before_the_timeout() {
    within(20, || {
        let rt = support::multi();
        for round in 0..5 {
            let pair = pair(&rt, false, true, ms(500));
            let before = pair.checks.load(Ordering::SeqCst);
            pair.armed.store(true, Ordering::SeqCst);
            let t0 = Instant::now();
            walk_both_at_once(&pair);
            let took = t0.elapsed();
            pair.armed.store(false, Ordering::SeqCst);
            let checks = pair.checks.load(Ordering::SeqCst) - before;
            assert!(
                took < ms(250) && !pair.a.is_finished() && !pair.b.is_finished(),
                "round {round}: the two walks took {took:?} ({checks} checks)"
            );
        }
    });
}
