//! Model test: random streams of register / event / cancel / drop / advance against
//! a plain reference (`HashMap` of live operations). Prints the seed on failure;
//! rerun one with `PURGATORY_MODEL_SEED=<seed>`.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use tokio::time::Instant;
use tokio_purgatory::{Completion, OpRef, Operation, OperationError, OperationHandle, Purgatory};

#[path = "support/rng.rs"]
mod rng;
use rng::Rng;

struct Op {
    id: u64,
    ready: Arc<AtomicBool>,
}

impl Operation for Op {
    type Output = u64;
    fn try_complete(&mut self) -> Option<u64> {
        self.ready.load(Ordering::SeqCst).then_some(self.id)
    }
    fn on_expiration(self) -> u64 {
        self.id
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    Completed,
    Expired,
    Cancelled,
}

struct Live {
    keys: Vec<u8>,
    deadline: Instant,
    ready: Arc<AtomicBool>,
}

struct Tracked {
    handle: OperationHandle<u8, Op>,
    op_ref: Option<OpRef<u8, Op>>,
}

async fn settle() {
    for _ in 0..20 {
        tokio::task::yield_now().await;
    }
}

async fn run(seed: u64, steps: usize) -> Result<(), String> {
    let mut rng = Rng(seed);
    let p: Purgatory<u8, Op> = Purgatory::builder("model")
        .purge_interval(rng.below(20) as usize)
        .build()
        .unwrap();
    let mut live: BTreeMap<u64, Live> = BTreeMap::new();
    let mut tracked: HashMap<u64, Tracked> = HashMap::new();
    let mut expect: HashMap<u64, Expect> = HashMap::new();
    let mut next_id = 0u64;

    let finish = |live: &mut BTreeMap<u64, Live>, expect: &mut HashMap<u64, Expect>, id, e| {
        live.remove(&id);
        expect.insert(id, e);
    };

    for step in 0..steps {
        match rng.below(12) {
            0..=3 => {
                let id = next_id;
                next_id += 1;
                let nkeys = 1 + rng.below(3) as usize;
                let mut keys: Vec<u8> = (0..nkeys).map(|_| rng.below(8) as u8).collect();
                let ready = Arc::new(AtomicBool::new(rng.below(10) == 0));
                let timeout = Duration::from_millis(1 + rng.below(100));
                let op = Op {
                    id,
                    ready: ready.clone(),
                };
                let handle = p
                    .try_complete_else_watch(op, timeout, keys.clone())
                    .map_err(|e| format!("step {step}: registration failed: {e}"))?;
                if ready.load(Ordering::SeqCst) {
                    expect.insert(id, Expect::Completed);
                } else {
                    keys.sort();
                    keys.dedup();
                    live.insert(
                        id,
                        Live {
                            keys,
                            deadline: Instant::now() + timeout,
                            ready,
                        },
                    );
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
                    if live[&id].ready.load(Ordering::SeqCst) {
                        want += 1;
                        finish(&mut live, &mut expect, id, Expect::Completed);
                    }
                }
                let got = p.try_complete_watched(&key);
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
                    if !r.try_complete() {
                        return Err(format!(
                            "step {step}: op_ref.try_complete({id}) did not complete"
                        ));
                    }
                    finish(&mut live, &mut expect, id, Expect::Completed);
                }
            }
            7 => {
                let key = rng.below(8) as u8;
                let ids: Vec<u64> = live
                    .iter()
                    .filter(|(_, l)| l.keys.contains(&key))
                    .map(|(id, _)| *id)
                    .collect();
                let got: Vec<u64> = {
                    let mut v: Vec<u64> =
                        p.cancel_for_key(&key).into_iter().map(|o| o.id).collect();
                    v.sort();
                    v
                };
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
                    tracked.remove(&id);
                    live.remove(&id);
                }
            }
            _ => {
                let by = Duration::from_millis(rng.below(40));
                tokio::time::advance(by).await;
                settle().await;
                let now = Instant::now();
                let due: Vec<u64> = live
                    .iter()
                    .filter(|(_, l)| l.deadline <= now)
                    .map(|(id, _)| *id)
                    .collect();
                for id in due {
                    finish(&mut live, &mut expect, id, Expect::Expired);
                }
            }
        }
        if p.delayed() != live.len() {
            return Err(format!(
                "step {step}: delayed {} but {} live",
                p.delayed(),
                live.len()
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
                    | (Expect::Expired, Ok(Completion::Expired(x))) if *x == id
            ) || matches!(
                (e, &got),
                (Expect::Cancelled, Err(OperationError::Cancelled))
            );
            if !ok {
                return Err(format!("step {step}: op {id} expected {e:?}, got {got:?}"));
            }
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
    for (id, mut t) in tracked.drain() {
        if live.contains_key(&id) {
            let got = (&mut t.handle).now_or_never();
            if got != Some(Err(OperationError::Shutdown)) {
                return Err(format!("op {id} after shutdown: {got:?}"));
            }
        }
    }
    let m = p.metrics();
    if m.registered != m.completed + m.expired + m.cancelled + m.handed_back || m.delayed != 0 {
        return Err(format!("counts do not balance: {m:?}"));
    }
    if m.watched != 0 || m.keys != 0 {
        return Err(format!("lists not empty after shutdown: {m:?}"));
    }
    Ok(())
}

#[test]
fn purgatory_matches_the_reference_model() {
    let base: u64 = std::env::var("PURGATORY_MODEL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0xC0FFEE);
    let rounds = if std::env::var("PURGATORY_MODEL_SEED").is_ok() {
        1
    } else {
        40
    };
    for round in 0..rounds {
        let seed = base.wrapping_add(round);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap();
        if let Err(e) = rt.block_on(run(seed, 1500)) {
            panic!("purgatory model failed: {e}; rerun with PURGATORY_MODEL_SEED={seed}");
        }
    }
}
