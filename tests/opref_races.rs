//! `OpRef` used from real threads at once, each race bounded: over 300
//! operations of short and long timeouts on shared keys, one thread walks
//! keys (making operations ready), one checks by reference, one resets
//! (into the past, up to 3 ms ahead, up to about a tick ahead), one cancels, the
//! reaper expires, and a shutdown ends it all, while a reader watches every
//! operation's status. Each operation finishes once, its status never
//! changes once finished (save `Cancelled` to `HandedBack`, a cancel left to
//! a check by the shutdown), its handle's outcome agrees with its status,
//! every operation is dropped exactly once, and the counts balance and match
//! the statuses. A reset that returned `false` while the operation still read
//! `Pending` sees it finish within a bounded wait.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_purgatory::{Completion, OpRef, Operation, OperationError, OperationStatus, Purgatory};

mod support;
use support::balanced;
use support::rng::Rng;

/// An operation that completes to 1 once its flag is set and expires to 2,
/// failing if two of its checks overlap and counting its drops.
struct Op {
    ready: Arc<AtomicBool>,
    drops: Arc<AtomicUsize>,
    busy: Arc<AtomicBool>,
}
impl Operation for Op {
    type Output = u8;
    fn try_complete(&mut self) -> Option<u8> {
        assert!(!self.busy.swap(true, Ordering::SeqCst), "checks overlap");
        for _ in 0..50 {
            std::hint::spin_loop();
        }
        let r = self.ready.load(Ordering::SeqCst).then_some(1);
        self.busy.store(false, Ordering::SeqCst);
        r
    }
    fn on_expiration(self) -> u8 {
        2
    }
}
impl Drop for Op {
    fn drop(&mut self) {
        self.drops.fetch_add(1, Ordering::SeqCst);
    }
}

/// A status as a number: 0 pending, 1 completed, 2 expired, 3 cancelled,
/// 4 handed back.
fn code(s: OperationStatus) -> u8 {
    match s {
        OperationStatus::Pending => 0,
        OperationStatus::Completed => 1,
        OperationStatus::Expired => 2,
        OperationStatus::Cancelled => 3,
        OperationStatus::HandedBack => 4,
        _ => 9,
    }
}

/// Statuses, outcomes, drops and counts agree under racing walks, checks
/// by reference, resets, cancels, expiries and a shutdown; and a reset
/// that returned `false` while the operation still read `Pending` (its
/// expiry under way: `OpRef::reset`'s docs) sees it finish, bounded.
#[test]
fn statuses_outcomes_and_drops_agree_under_races() {
    for run in 0..6u64 {
        support::within(60, move || race(run));
    }
}

/// One race, seeded by `run`.
fn race(run: u64) {
    let rt = support::multi();
    let _g = rt.enter();
    let p: Purgatory<u32, Op> = Purgatory::builder()
        .name("race")
        .tick(Duration::from_nanos(77_777))
        .build()
        .unwrap();
    let n = 300usize;
    let drops = Arc::new(AtomicUsize::new(0));
    let mut readies = Vec::new();
    let mut handles = Vec::new();
    let mut refs: Vec<OpRef<u32, Op>> = Vec::new();
    let mut r0 = Rng(run * 7919 + 1);
    for i in 0..n {
        let ready = Arc::new(AtomicBool::new(false));
        let op = Op {
            ready: ready.clone(),
            drops: drops.clone(),
            busy: Arc::default(),
        };
        let t = if i % 2 == 0 {
            Duration::from_secs(10)
        } else {
            Duration::from_micros(200 + r0.below(4000))
        };
        let h = p
            .try_complete_else_watch(op, t, [(i % 17) as u32, 100 + (i % 5) as u32])
            .unwrap();
        refs.push(h.op_ref().unwrap());
        handles.push(h);
        readies.push(ready);
    }
    let refs = Arc::new(refs);
    let readies = Arc::new(readies);
    let stop = Arc::new(AtomicBool::new(false));
    let cancelled_back = Arc::new(AtomicUsize::new(0));
    let mut threads = Vec::new();
    // Walker.
    {
        let (p, readies, stop) = (p.clone(), readies.clone(), stop.clone());
        threads.push(std::thread::spawn(move || {
            let mut r = Rng(run + 11);
            for _ in 0..4000 {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let i = r.below(n as u64) as usize;
                if r.below(3) == 0 {
                    readies[i].store(true, Ordering::SeqCst);
                }
                p.try_complete_watched(&((r.below(17)) as u32));
                if r.below(4) == 0 {
                    p.try_complete_watched(&(100 + r.below(5) as u32));
                }
            }
        }));
    }
    // Checker by reference.
    {
        let (refs, stop) = (refs.clone(), stop.clone());
        threads.push(std::thread::spawn(move || {
            let mut r = Rng(run + 23);
            for _ in 0..4000 {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                refs[r.below(n as u64) as usize].try_complete();
            }
        }));
    }
    // Resetter.
    let pending_after_false = Arc::new(AtomicUsize::new(0));
    let not_expired_after_false = Arc::new(AtomicUsize::new(0));
    {
        let (refs, stop) = (refs.clone(), stop.clone());
        let (pending_after_false, not_expired_after_false) =
            (pending_after_false.clone(), not_expired_after_false.clone());
        let h = rt.handle().clone();
        threads.push(std::thread::spawn(move || {
            let _g = h.enter();
            let mut r = Rng(run + 37);
            for _ in 0..4000 {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let op = &refs[r.below(n as u64) as usize];
                let now = Instant::now();
                let ok = match r.below(3) {
                    0 => op.reset_at(now - Duration::from_micros(r.below(500))),
                    1 => op.reset(Duration::from_micros(r.below(3000))),
                    _ => op.reset(Duration::from_nanos(r.below(100_000))),
                };
                if !ok && op.status() == OperationStatus::Pending {
                    // The expiry is under way: the operation finishes
                    // (bounded), as expired unless the check it was left
                    // to completes it or a cancel came first.
                    pending_after_false.fetch_add(1, Ordering::SeqCst);
                    let t = std::time::Instant::now();
                    while op.status() == OperationStatus::Pending {
                        assert!(t.elapsed() < Duration::from_secs(5), "stuck pending");
                        std::thread::yield_now();
                    }
                    let st = op.status();
                    assert!(
                        matches!(
                            st,
                            OperationStatus::Expired
                                | OperationStatus::Completed
                                | OperationStatus::HandedBack
                                | OperationStatus::Cancelled
                        ),
                        "a false reset on a pending op ended {st:?}"
                    );
                    if st != OperationStatus::Expired {
                        not_expired_after_false.fetch_add(1, Ordering::SeqCst);
                    }
                }
            }
        }));
    }
    // Canceller.
    {
        let (refs, stop, back) = (refs.clone(), stop.clone(), cancelled_back.clone());
        threads.push(std::thread::spawn(move || {
            let mut r = Rng(run + 41);
            for _ in 0..400 {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                if let Some(op) = refs[r.below(n as u64) as usize].cancel() {
                    back.fetch_add(1, Ordering::SeqCst);
                    drop(op);
                }
                std::thread::yield_now();
            }
        }));
    }
    // Status reader: monotonic once finished.
    let reader = {
        let (refs, stop) = (refs.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut seen = vec![0u8; n];
            let mut rounds = 0;
            while !stop.load(Ordering::SeqCst) && rounds < 20_000 {
                rounds += 1;
                for (i, r) in refs.iter().enumerate() {
                    let c = code(r.status());
                    let was = seen[i];
                    if was != 0 && c != was {
                        assert!(was == 3 && c == 4, "op {i}: status went from {was} to {c}");
                    }
                    if c == 0 {
                        assert_eq!(was, 0, "op {i}: back to Pending from {was}");
                    }
                    seen[i] = c;
                }
            }
            seen
        })
    };
    for t in threads {
        t.join().unwrap();
    }
    let handed = p.shutdown();
    let handed_n = handed.len();
    drop(handed);
    stop.store(true, Ordering::SeqCst);
    reader.join().unwrap();
    // Outcomes agree with statuses.
    let outs: Vec<_> = rt.block_on(async {
        let mut v = Vec::new();
        for h in handles {
            v.push(
                tokio::time::timeout(Duration::from_secs(10), h)
                    .await
                    .expect("every handle resolves"),
            );
        }
        v
    });
    let mut by = [0usize; 5];
    for (i, out) in outs.iter().enumerate() {
        let st = refs[i].status();
        by[code(st) as usize] += 1;
        match (st, out) {
            (OperationStatus::Completed, Ok(Completion::Completed(1))) => {}
            (OperationStatus::Expired, Ok(Completion::Expired(2))) => {}
            (OperationStatus::Cancelled, Err(OperationError::Cancelled)) => {}
            // A cancel left to a check by the shutdown.
            (OperationStatus::Cancelled, Err(OperationError::Shutdown)) => {}
            (OperationStatus::HandedBack, Err(OperationError::Shutdown)) => {}
            other => panic!("run {run} op {i}: status and outcome disagree: {other:?}"),
        }
    }
    assert_eq!(by[0], 0, "run {run}: nothing pending after shutdown");
    assert_eq!(
        by[4], handed_n,
        "run {run}: HandedBack = what shutdown returned"
    );
    assert_eq!(
        drops.load(Ordering::SeqCst),
        n,
        "run {run}: each op dropped once"
    );
    let m = p.metrics();
    assert!(balanced(&m), "run {run}: {m:?}");
    assert_eq!(m.registered as usize, n);
    assert_eq!(m.completed as usize, by[1], "run {run}: {m:?} {by:?}");
    assert_eq!(m.expired as usize, by[2], "run {run}: {m:?} {by:?}");
    assert_eq!(m.cancelled as usize, by[3], "run {run}: {m:?} {by:?}");
    assert_eq!(m.handed_back as usize, by[4], "run {run}: {m:?} {by:?}");
    assert!(cancelled_back.load(Ordering::SeqCst) <= by[3]);
    assert_eq!((m.delayed, m.panicked), (0, 0), "run {run}: {m:?}");
    eprintln!(
        "run {run}: resets that returned false while status read Pending: {} (ended other than Expired: {}); {by:?}",
        pending_after_false.load(Ordering::SeqCst),
        not_expired_after_false.load(Ordering::SeqCst)
    );
    drop(refs);
    drop(p);
    rt.shutdown_timeout(Duration::from_secs(5));
}
