//! The counts and gauges as a hostile user reads them: every way an
//! operation finishes (and every refusal) counted once, the gauges back to
//! zero once nothing is pending, a random stream of registrations, walks,
//! advances, checks by reference, cancels and time jumps against a reference
//! model after every step, panics counted, the timer's counts under cancel,
//! reset and shutdown, every exported value equal to the snapshot, a shared
//! reaper's counts in each it serves, and metrics read from operation code.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio::time::advance;
use tokio_purgatory::{
    Operation, OperationError, Purgatory, PurgatoryMetrics, Timer, Watch, WatchError, WeakPurgatory,
};

mod support;
use support::{balanced, ms, settle, FlagOp};

fn counts(m: &PurgatoryMetrics) -> (u64, u64, u64, u64, u64) {
    (
        m.registered,
        m.completed,
        m.expired,
        m.cancelled,
        m.handed_back,
    )
}

// ---------------------------------------------------------------------------
// Every way of finishing, counted exactly; gauges back to zero.

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn every_fate_is_counted_once_and_the_gauges_return_to_zero() {
    let p: Purgatory<u32, FlagOp> = Purgatory::new();
    let long = Duration::from_secs(3600);
    let flag = || Arc::new(AtomicBool::new(false));

    // 1. Completed at registration: registered and completed, no checks counted.
    let h = p
        .try_complete_else_watch(FlagOp(Arc::new(AtomicBool::new(true))), long, [1, 2])
        .unwrap();
    assert!(h.await.unwrap().is_completed());
    let m = p.metrics();
    assert_eq!(counts(&m), (1, 1, 0, 0, 0), "{m:?}");
    assert_eq!(m.checks, Default::default(), "{m:?}");
    assert_eq!(
        (m.delayed, m.watched, m.tombstones, m.keys),
        (0, 0, 0, 0),
        "{m:?}"
    );

    // 2. Completed by a walk of one of two keys.
    let f = flag();
    let h = p
        .try_complete_else_watch(FlagOp(f.clone()), long, [1, 2])
        .unwrap();
    assert_eq!((p.metrics().delayed, p.metrics().watched), (1, 2));
    f.store(true, Ordering::SeqCst);
    assert_eq!(p.try_complete_watched(&1), 1);
    assert!(h.await.unwrap().is_completed());
    let m = p.metrics();
    assert_eq!(counts(&m), (2, 2, 0, 0, 0), "{m:?}");
    assert_eq!(m.delayed, 0);
    assert_eq!(m.watched - m.tombstones, 0, "no live entries: {m:?}");
    let (k1, k2) = (m.checks.key_walks, m.checks.by_reference);
    assert_eq!((k1.walks, k1.checked, k1.completed), (1, 1, 1));
    assert_eq!(k2, Default::default());

    // 3. Completed by reference.
    let f = flag();
    let h = p
        .try_complete_else_watch(FlagOp(f.clone()), long, [3])
        .unwrap();
    let r = h.op_ref().unwrap();
    assert!(!r.try_complete());
    f.store(true, Ordering::SeqCst);
    assert!(r.try_complete());
    assert!(!r.try_complete(), "finished: runs nothing");
    assert!(h.await.unwrap().is_completed());
    drop(r);
    let m = p.metrics();
    assert_eq!(counts(&m), (3, 3, 0, 0, 0), "{m:?}");
    let b = m.checks.by_reference;
    assert_eq!((b.walks, b.checked, b.completed), (3, 3, 1), "{m:?}");
    assert_eq!(m.watched - m.tombstones, 0, "{m:?}");

    // 4. Expired.
    let h = p
        .try_complete_else_watch(FlagOp(flag()), ms(10), [4, 5])
        .unwrap();
    assert!(h.await.unwrap().is_expired());
    let m = p.metrics();
    assert_eq!(counts(&m), (4, 3, 1, 0, 0), "{m:?}");
    assert_eq!(p.lateness().count(), 1);
    // Nothing pending after an expiry: "starts a purge at once".
    assert_eq!(
        (m.delayed, m.watched, m.tombstones, m.keys),
        (0, 0, 0, 0),
        "{m:?}"
    );

    // 5. Cancelled by its handle, by dropping it, by an OpRef, by key.
    let h = p
        .try_complete_else_watch(FlagOp(flag()), long, [6, 7])
        .unwrap();
    assert!(h.cancel().is_some());
    let m = p.metrics();
    assert_eq!(counts(&m), (5, 3, 1, 1, 0), "{m:?}");
    assert_eq!(
        (m.delayed, m.watched, m.tombstones, m.keys),
        (0, 0, 0, 0),
        "{m:?}"
    );
    drop(
        p.try_complete_else_watch(FlagOp(flag()), long, [6, 7])
            .unwrap(),
    );
    let m = p.metrics();
    assert_eq!(counts(&m), (6, 3, 1, 2, 0), "{m:?}");
    assert_eq!(
        (m.delayed, m.watched, m.tombstones, m.keys),
        (0, 0, 0, 0),
        "{m:?}"
    );
    let h = p
        .try_complete_else_watch(FlagOp(flag()), long, [6, 7])
        .unwrap();
    let r = h.op_ref().unwrap();
    assert!(r.cancel().is_some());
    assert!(r.cancel().is_none());
    assert_eq!(h.await, Err(OperationError::Cancelled));
    drop(r);
    let m = p.metrics();
    assert_eq!(counts(&m), (7, 3, 1, 3, 0), "{m:?}");
    assert_eq!(
        (m.delayed, m.watched, m.tombstones, m.keys),
        (0, 0, 0, 0),
        "{m:?}"
    );
    let h = p
        .try_complete_else_watch(FlagOp(flag()), long, [6, 7])
        .unwrap();
    assert_eq!(p.cancel_for_key(&7).len(), 1);
    assert_eq!(h.await, Err(OperationError::Cancelled));
    let m = p.metrics();
    assert_eq!(counts(&m), (8, 3, 1, 4, 0), "{m:?}");
    assert_eq!(
        (m.delayed, m.watched, m.tombstones, m.keys),
        (0, 0, 0, 0),
        "{m:?}"
    );

    // 6. Detached, then completed; detached, then expired.
    let f = flag();
    p.try_complete_else_watch(FlagOp(f.clone()), long, [8])
        .unwrap()
        .detach();
    f.store(true, Ordering::SeqCst);
    assert_eq!(p.try_complete_watched(&8), 1);
    p.try_complete_else_watch(FlagOp(flag()), ms(5), [9])
        .unwrap()
        .detach();
    advance(ms(6)).await;
    settle().await;
    let m = p.metrics();
    assert_eq!(counts(&m), (10, 4, 2, 4, 0), "{m:?}");

    // 7. Handed back at shutdown (and a handle dropped before it read it).
    let h1 = p
        .try_complete_else_watch(FlagOp(flag()), long, [10, 11])
        .unwrap();
    let h2 = p
        .try_complete_else_watch(FlagOp(flag()), long, [11])
        .unwrap();
    drop(h2);
    let h3 = p
        .try_complete_else_watch(FlagOp(flag()), long, [12])
        .unwrap();
    assert_eq!(p.shutdown().len(), 2);
    assert!(p.shutdown().is_empty());
    assert_eq!(h1.await, Err(OperationError::Shutdown));
    drop(h3);
    let m = p.metrics();
    assert_eq!(counts(&m), (13, 4, 2, 5, 2), "{m:?}");
    assert!(balanced(&m));
    assert_eq!(
        (m.delayed, m.watched, m.tombstones, m.keys),
        (0, 0, 0, 0),
        "{m:?}"
    );
    // Refused after shutdown: not counted.
    assert!(matches!(
        p.try_complete_else_watch(FlagOp(flag()), long, [1]),
        Err(WatchError::Shutdown(_))
    ));
    assert_eq!(p.try_complete_watched(&1), 0);
    assert!(p.cancel_for_key(&1).is_empty());
    let m2 = p.metrics();
    assert_eq!(counts(&m2), counts(&m), "{m2:?}");
    assert_eq!(m2.delayed, 0);
}

// ---------------------------------------------------------------------------
// Refusals change no count.

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn refusals_are_not_registered() {
    let p: Purgatory<u32, FlagOp> = Purgatory::builder().max_pending(2).build().unwrap();
    let long = Duration::from_secs(3600);
    let flag = || Arc::new(AtomicBool::new(false));
    assert!(matches!(
        p.try_complete_else_watch(FlagOp(flag()), long, []),
        Err(WatchError::NoKeys(_))
    ));
    let a = p
        .try_complete_else_watch(FlagOp(flag()), long, [1])
        .unwrap();
    let b = p
        .try_complete_else_watch(FlagOp(flag()), long, [1])
        .unwrap();
    for _ in 0..3 {
        assert!(matches!(
            p.try_complete_else_watch(FlagOp(flag()), long, [1]),
            Err(WatchError::AtCapacity(_))
        ));
        // Even one that would complete at once.
        assert!(matches!(
            p.try_complete_else_watch(FlagOp(Arc::new(AtomicBool::new(true))), long, [1]),
            Err(WatchError::AtCapacity(_))
        ));
    }
    let m = p.metrics();
    assert_eq!(counts(&m), (2, 0, 0, 0, 0), "{m:?}");
    assert_eq!(m.delayed, 2);
    drop(a);
    let drain = p.drain();
    let mut drain = Box::pin(drain);
    assert!(futures::poll!(drain.as_mut()).is_pending());
    for _ in 0..3 {
        assert!(matches!(
            p.try_complete_else_watch(FlagOp(Arc::new(AtomicBool::new(true))), long, [1]),
            Err(WatchError::Draining(_))
        ));
    }
    let m = p.metrics();
    assert_eq!(counts(&m), (2, 0, 0, 1, 0), "{m:?}");
    assert_eq!(m.delayed, 1);
    drop(b);
    assert!(futures::poll!(drain.as_mut()).is_ready());
    let m = p.metrics();
    assert_eq!(counts(&m), (2, 0, 0, 2, 0), "{m:?}");
    assert_eq!(
        (m.delayed, m.watched, m.tombstones, m.keys),
        (0, 0, 0, 0),
        "{m:?}"
    );
}

// ---------------------------------------------------------------------------
// Panicking checks and expiries.

struct Hostile {
    check_panics: Arc<AtomicBool>,
    ready: Arc<AtomicBool>,
    expiry_panics: bool,
}

impl Operation for Hostile {
    type Output = ();
    fn try_complete(&mut self) -> Option<()> {
        if self.check_panics.load(Ordering::SeqCst) {
            panic!("hostile check");
        }
        self.ready.load(Ordering::SeqCst).then_some(())
    }
    fn on_expiration(self) {
        if self.expiry_panics {
            panic!("hostile expiry");
        }
    }
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn panicking_checks_and_expiries_are_counted() {
    let p: Purgatory<u32, Hostile> = Purgatory::new();
    let check_panics = Arc::new(AtomicBool::new(true));
    let ready = Arc::new(AtomicBool::new(false));
    let op = |expiry_panics| Hostile {
        check_panics: check_panics.clone(),
        ready: ready.clone(),
        expiry_panics,
    };
    // Both registration checks panic: pending, two panics.
    let h = p.try_complete_else_watch(op(true), ms(10), [1]).unwrap();
    let m = p.metrics();
    assert_eq!((m.registered, m.delayed, m.panicked), (1, 1, 2), "{m:?}");
    // A walk whose check panics: checked, not completed.
    assert_eq!(p.try_complete_watched(&1), 0);
    let m = p.metrics();
    let w = m.checks.key_walks;
    assert_eq!(
        (w.walks, w.checked, w.completed, m.panicked),
        (1, 1, 0, 3),
        "{m:?}"
    );
    // By reference.
    let r = h.op_ref().unwrap();
    assert!(!r.try_complete());
    let m = p.metrics();
    let b = m.checks.by_reference;
    assert_eq!(
        (b.walks, b.checked, b.completed, m.panicked),
        (1, 1, 0, 4),
        "{m:?}"
    );
    drop(r);
    // The expiry panics: expired (including expiries that panicked).
    assert_eq!(h.await, Err(OperationError::Panicked));
    let m = p.metrics();
    assert_eq!(counts(&m), (1, 0, 1, 0, 0), "{m:?}");
    assert_eq!(m.panicked, 5);
    assert_eq!(p.lateness().count(), 1);
    assert_eq!(m.reaper.largest_batch, 1);
    assert_eq!(
        (m.delayed, m.watched, m.tombstones, m.keys),
        (0, 0, 0, 0),
        "{m:?}"
    );

    // Completes on the second registration check after a panicking first.
    struct SecondTime(u32);
    impl Operation for SecondTime {
        type Output = ();
        fn try_complete(&mut self) -> Option<()> {
            self.0 += 1;
            if self.0 == 1 {
                panic!("first");
            }
            Some(())
        }
        fn on_expiration(self) {}
    }
    let q: Purgatory<u32, SecondTime> = Purgatory::new();
    let h = q
        .try_complete_else_watch(SecondTime(0), ms(10), [1, 2])
        .unwrap();
    assert!(h.await.unwrap().is_completed());
    let m = q.metrics();
    assert_eq!(counts(&m), (1, 1, 0, 0, 0), "{m:?}");
    assert_eq!(m.panicked, 1);
    assert_eq!(m.checks, Default::default());
    assert_eq!(m.delayed, 0);
    assert_eq!(m.watched - m.tombstones, 0, "{m:?}");
}

// ---------------------------------------------------------------------------
// A random model: after every step, the counts and the live watch entries
// (`watched - tombstones`) match a reference.

struct ModelOp {
    flag: Arc<AtomicBool>,
    plain: Vec<u32>,
    /// Current level of each level watch.
    levels: Vec<(u32, u64)>,
    deadline: tokio::time::Instant,
    handle: Option<tokio_purgatory::OperationHandle<u32, FlagOp>>,
    opref: Option<tokio_purgatory::OpRef<u32, FlagOp>>,
    pending: bool,
}

impl ModelOp {
    fn entries(&self) -> usize {
        self.plain.len() + self.levels.len()
    }
    fn watches(&self, k: u32) -> bool {
        self.plain.contains(&k) || self.levels.iter().any(|(kk, _)| *kk == k)
    }
}

#[derive(Default, Debug, PartialEq)]
struct Want {
    registered: u64,
    completed: u64,
    expired: u64,
    cancelled: u64,
    handed_back: u64,
    key: (u64, u64, u64),
    level: (u64, u64, u64),
    by_ref: (u64, u64, u64),
}

fn check_model(p: &Purgatory<u32, FlagOp>, ops: &[ModelOp], want: &Want, step: usize, what: &str) {
    let m = p.metrics();
    let pending = ops.iter().filter(|o| o.pending).count();
    let live: usize = ops.iter().filter(|o| o.pending).map(ModelOp::entries).sum();
    let got = Want {
        registered: m.registered,
        completed: m.completed,
        expired: m.expired,
        cancelled: m.cancelled,
        handed_back: m.handed_back,
        key: (
            m.checks.key_walks.walks,
            m.checks.key_walks.checked,
            m.checks.key_walks.completed,
        ),
        level: (
            m.checks.level_advances.walks,
            m.checks.level_advances.checked,
            m.checks.level_advances.completed,
        ),
        by_ref: (
            m.checks.by_reference.walks,
            m.checks.by_reference.checked,
            m.checks.by_reference.completed,
        ),
    };
    assert_eq!(&got, want, "step {step} ({what}): {m:?}");
    assert_eq!(m.delayed, pending, "step {step} ({what}): {m:?}");
    assert!(m.tombstones <= m.watched, "step {step} ({what}): {m:?}");
    assert_eq!(
        m.watched - m.tombstones,
        live,
        "step {step} ({what}): live entries; {m:?}"
    );
}

/// "An expiry or cancellation that leaves ... nothing pending, starts a purge
/// at once": the map is empty then.
fn check_idle(p: &Purgatory<u32, FlagOp>, step: usize, what: &str) {
    let m = p.metrics();
    if m.delayed == 0 {
        assert_eq!(
            (m.watched, m.tombstones, m.keys),
            (0, 0, 0),
            "step {step} ({what}): {m:?}"
        );
    }
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn counts_and_live_entries_follow_a_model() {
    for seed in 0..40u64 {
        let mut rng = support::rng::Rng(seed);
        let p: Purgatory<u32, FlagOp> = Purgatory::builder()
            .purge_interval(1 + rng.below(50) as usize)
            .build()
            .unwrap();
        let mut ops: Vec<ModelOp> = Vec::new();
        let mut want = Want::default();
        for step in 0..300 {
            let what;
            let mut finished_quietly = false;
            match rng.below(14) {
                0..=3 => {
                    what = "register";
                    let flag = Arc::new(AtomicBool::new(rng.below(10) == 0));
                    let mut plain = Vec::new();
                    let mut watches = Vec::new();
                    for _ in 0..rng.below(4) {
                        let k = rng.below(6) as u32;
                        watches.push(Watch::key(k));
                        if !plain.contains(&k) {
                            plain.push(k);
                        }
                    }
                    let mut levels = Vec::new();
                    for _ in 0..rng.below(3) {
                        let k = rng.below(6) as u32;
                        let l = 1 + rng.below(20);
                        watches.push(Watch::level(k, l));
                        levels.push((k, l));
                    }
                    let timeout = ms(10 * (1 + rng.below(10)) + 5);
                    let now = tokio::time::Instant::now();
                    let ready = flag.load(Ordering::SeqCst);
                    match p.try_complete_else_watch_levels(FlagOp(flag.clone()), timeout, watches) {
                        Ok(h) => {
                            want.registered += 1;
                            if ready {
                                want.completed += 1;
                                assert!(h.is_finished());
                            } else {
                                let opref = if rng.below(3) == 0 { h.op_ref() } else { None };
                                ops.push(ModelOp {
                                    flag,
                                    plain,
                                    levels,
                                    deadline: now + timeout,
                                    handle: Some(h),
                                    opref,
                                    pending: true,
                                });
                            }
                        }
                        Err(WatchError::NoKeys(_)) => {
                            assert!(plain.is_empty() && levels.is_empty())
                        }
                        Err(e) => panic!("{e:?}"),
                    }
                }
                4 => {
                    what = "ready";
                    if let Some(o) = ops.iter().filter(|o| o.pending).nth(rng.below(8) as usize) {
                        o.flag.store(true, Ordering::SeqCst);
                    }
                }
                5 | 6 => {
                    what = "walk";
                    let k = rng.below(6) as u32;
                    let mut checked = 0;
                    let mut done = 0;
                    for o in ops.iter_mut().filter(|o| o.pending && o.plain.contains(&k)) {
                        checked += 1;
                        if o.flag.load(Ordering::SeqCst) {
                            o.pending = false;
                            done += 1;
                        }
                    }
                    assert_eq!(p.try_complete_watched(&k), done, "seed {seed} step {step}");
                    want.key.0 += 1;
                    want.key.1 += checked;
                    want.key.2 += done as u64;
                    want.completed += done as u64;
                }
                7 | 8 => {
                    what = "advance";
                    let k = rng.below(6) as u32;
                    let level = rng.below(25);
                    let mut checked = 0;
                    let mut done = 0;
                    for o in ops.iter_mut().filter(|o| o.pending && o.watches(k)) {
                        let ready = o.flag.load(Ordering::SeqCst);
                        let mut n = o.plain.iter().filter(|kk| **kk == k).count() as u64;
                        for (kk, l) in o.levels.iter_mut() {
                            if *kk == k && *l <= level {
                                n += 1;
                                if !ready {
                                    *l = level + 1;
                                }
                            }
                        }
                        checked += n;
                        if n > 0 && ready {
                            o.pending = false;
                            done += 1;
                        }
                    }
                    assert_eq!(
                        p.try_complete_reached(&k, level),
                        done,
                        "seed {seed} step {step}"
                    );
                    want.level.0 += 1;
                    want.level.1 += checked;
                    want.level.2 += done as u64;
                    want.completed += done as u64;
                }
                9 => {
                    what = "ref";
                    if let Some(o) = ops
                        .iter_mut()
                        .filter(|o| o.opref.is_some())
                        .nth(rng.below(4) as usize)
                    {
                        let r = o.opref.as_ref().unwrap();
                        let will = o.pending && o.flag.load(Ordering::SeqCst);
                        assert_eq!(r.try_complete(), will, "seed {seed} step {step}");
                        want.by_ref.0 += 1;
                        want.by_ref.1 += 1;
                        if will {
                            o.pending = false;
                            want.by_ref.2 += 1;
                            want.completed += 1;
                        }
                        if rng.below(2) == 0 {
                            o.opref = None;
                        }
                    }
                }
                10 => {
                    what = "cancel";
                    if let Some(o) = ops
                        .iter_mut()
                        .filter(|o| o.handle.is_some())
                        .nth(rng.below(4) as usize)
                    {
                        let h = o.handle.take().unwrap();
                        let was = o.pending;
                        let cancels = match rng.below(4) {
                            0 => {
                                assert_eq!(h.cancel().is_some(), was);
                                true
                            }
                            1 => {
                                drop(h);
                                true
                            }
                            2 => {
                                h.detach();
                                false
                            }
                            _ => match o.opref.take() {
                                Some(r) => {
                                    assert_eq!(r.cancel().is_some(), was);
                                    drop(h);
                                    true
                                }
                                None => {
                                    o.handle = Some(h);
                                    false
                                }
                            },
                        };
                        if cancels && was {
                            o.pending = false;
                            want.cancelled += 1;
                            finished_quietly = true;
                        }
                    }
                }
                11 => {
                    what = "cancel_for_key";
                    let k = rng.below(6) as u32;
                    let mut n = 0;
                    for o in ops.iter_mut().filter(|o| o.pending && o.watches(k)) {
                        o.pending = false;
                        n += 1;
                    }
                    assert_eq!(p.cancel_for_key(&k).len(), n, "seed {seed} step {step}");
                    want.cancelled += n as u64;
                    finished_quietly = n > 0;
                }
                _ => {
                    what = "time";
                    advance(ms(10 * rng.below(3))).await;
                    settle().await;
                    let now = tokio::time::Instant::now();
                    for o in ops.iter_mut().filter(|o| o.pending && o.deadline <= now) {
                        o.pending = false;
                        want.expired += 1;
                        finished_quietly = true;
                    }
                }
            }
            check_model(&p, &ops, &want, step, what);
            if finished_quietly {
                check_idle(&p, step, what);
            }
        }
        let left = ops.iter().filter(|o| o.pending).count();
        assert_eq!(p.shutdown().len(), left);
        want.handed_back += left as u64;
        for o in ops.iter_mut() {
            o.pending = false;
        }
        check_model(&p, &ops, &want, 9999, "shutdown");
        check_idle(&p, 9999, "shutdown");
    }
}

// ---------------------------------------------------------------------------
// The timer's counts.

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn timer_counts_follow_cancel_reset_and_shutdown() {
    let timer = Timer::new();
    let ran = Arc::new(AtomicUsize::new(0));
    let task = |ran: &Arc<AtomicUsize>| {
        let ran = ran.clone();
        move || {
            ran.fetch_add(1, Ordering::SeqCst);
        }
    };
    let a = timer.schedule(ms(15), task(&ran)).unwrap();
    let b = timer.schedule(ms(15), task(&ran)).unwrap();
    let c = timer.schedule(ms(15), task(&ran)).unwrap();
    let d = timer.schedule(ms(15), task(&ran)).unwrap();
    let m = timer.metrics();
    assert_eq!((m.pending, m.expired), (4, 0));
    assert!(a.cancel());
    assert!(b.cancel_and_take().is_some());
    assert!(c.reset(ms(35)));
    assert_eq!(timer.metrics().pending, 2);
    // A sleep dropped and a timeout whose future is ready at once.
    let s = timer.sleep(ms(15));
    assert_eq!(timer.metrics().pending, 3);
    drop(s);
    assert_eq!(timer.timeout(ms(15), async { 1 }).await, Ok(1));
    let m = timer.metrics();
    assert_eq!((m.pending, m.expired), (2, 0), "{m:?}");
    advance(ms(20)).await;
    settle().await;
    let m = timer.metrics();
    assert_eq!((m.pending, m.expired), (1, 1), "{m:?}");
    assert_eq!(ran.load(Ordering::SeqCst), 1);
    assert_eq!(timer.lateness().count(), 1);
    assert_eq!(timer.lateness().max(), ms(5));
    advance(ms(20)).await;
    settle().await;
    let m = timer.metrics();
    assert_eq!((m.pending, m.expired), (0, 2), "{m:?}");
    assert_eq!(timer.lateness().count(), 2);
    // reset to 35 ms, taken out at 40 ms: 5 ms late.
    assert_eq!(timer.lateness().max(), ms(5));
    drop(d);

    // Repeating: three runs then done.
    let runs = Arc::new(AtomicUsize::new(0));
    let r2 = runs.clone();
    let _rep = timer
        .schedule_repeating(ms(10), move || {
            let n = r2.fetch_add(1, Ordering::SeqCst) + 1;
            (n < 3).then_some(ms(10))
        })
        .unwrap();
    for _ in 0..5 {
        advance(ms(10)).await;
        settle().await;
    }
    let m = timer.metrics();
    assert_eq!(runs.load(Ordering::SeqCst), 3);
    assert_eq!((m.pending, m.expired), (0, 5), "{m:?}");
    assert_eq!(timer.lateness().count(), 5);

    // A panicking task: run (expired) and counted as a panic.
    timer.schedule(ms(5), || panic!("task")).unwrap();
    let rep = timer
        .schedule_repeating(ms(5), || -> Option<Duration> { panic!("repeating") })
        .unwrap();
    advance(ms(6)).await;
    settle().await;
    let m = timer.metrics();
    assert_eq!((m.pending, m.expired, m.panicked), (0, 7, 2), "{m:?}");
    assert!(!rep.cancel(), "ended by its panic");

    // Shutdown: pending to zero, counters kept, hand-backs not expiries.
    timer.schedule(ms(100), task(&ran)).unwrap();
    let _sl = timer.sleep(ms(100));
    let _rp = timer.schedule_repeating(ms(100), || Some(ms(100))).unwrap();
    assert_eq!(timer.metrics().pending, 3);
    let back = timer.shutdown();
    assert_eq!(back.len(), 2);
    for t in back {
        t.run();
    }
    let m = timer.metrics();
    assert_eq!((m.pending, m.expired, m.panicked), (0, 7, 2), "{m:?}");
    advance(ms(200)).await;
    settle().await;
    let m2 = timer.metrics();
    assert_eq!((m2.pending, m2.expired, m2.panicked), (0, 7, 2), "{m2:?}");
    assert_eq!(timer.lateness().count(), 7);
}

// ---------------------------------------------------------------------------
// The `metrics` export: every exported value equals the snapshot, in a state
// with every count non-zero, and after shutdown.
#[cfg(feature = "metrics")]
mod export {
    use super::*;

    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    use std::collections::BTreeMap;
    use support::recorded::collect;

    fn check_export(got: &BTreeMap<String, DebugValue>, m: &PurgatoryMetrics, pl: &str) {
        let counter = |k: &str| match got.get(&format!("{k}{{{pl}}}")) {
            Some(DebugValue::Counter(v)) => *v,
            other => panic!("{k}: {other:?}"),
        };
        let wcounter = |k: &str, w: &str| match got.get(&format!("{k}{{{pl},walk={w}}}")) {
            Some(DebugValue::Counter(v)) => *v,
            other => panic!("{k} {w}: {other:?}"),
        };
        let gauge = |k: &str| match got.get(&format!("{k}{{{pl}}}")) {
            Some(DebugValue::Gauge(v)) => v.into_inner(),
            other => panic!("{k}: {other:?}"),
        };
        assert_eq!(gauge("tokio_purgatory_delayed"), m.delayed as f64);
        assert_eq!(gauge("tokio_purgatory_watched"), m.watched as f64);
        assert_eq!(gauge("tokio_purgatory_tombstones"), m.tombstones as f64);
        assert_eq!(gauge("tokio_purgatory_keys"), m.keys as f64);
        assert_eq!(gauge("tokio_purgatory_cells"), m.cells as f64);
        assert_eq!(counter("tokio_purgatory_registered_total"), m.registered);
        assert_eq!(counter("tokio_purgatory_completed_total"), m.completed);
        assert_eq!(counter("tokio_purgatory_expired_total"), m.expired);
        assert_eq!(counter("tokio_purgatory_cancelled_total"), m.cancelled);
        assert_eq!(counter("tokio_purgatory_handed_back_total"), m.handed_back);
        assert_eq!(counter("tokio_purgatory_purged_total"), m.purged);
        assert_eq!(counter("tokio_purgatory_panicked_total"), m.panicked);
        assert_eq!(
            counter("tokio_purgatory_reaper_wakeups_total"),
            m.reaper_wakeups
        );
        assert_eq!(
            counter("tokio_purgatory_reaper_turns_total"),
            m.reaper.turns
        );
        assert_eq!(
            gauge("tokio_purgatory_reaper_busy_seconds"),
            m.reaper.busy.as_secs_f64()
        );
        assert_eq!(
            gauge("tokio_purgatory_reaper_longest_turn_seconds"),
            m.reaper.longest_turn.as_secs_f64()
        );
        assert_eq!(
            gauge("tokio_purgatory_reaper_largest_batch"),
            m.reaper.largest_batch as f64
        );
        for (w, c) in [
            ("key", m.checks.key_walks),
            ("level", m.checks.level_advances),
            ("reference", m.checks.by_reference),
        ] {
            assert_eq!(wcounter("tokio_purgatory_walks_total", w), c.walks, "{w}");
            assert_eq!(
                wcounter("tokio_purgatory_checks_total", w),
                c.checked,
                "{w}"
            );
            assert_eq!(
                wcounter("tokio_purgatory_checks_completed_total", w),
                c.completed,
                "{w}"
            );
        }
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn every_exported_value_is_the_snapshots() {
        let recorder = DebuggingRecorder::new();
        let p = metrics::with_local_recorder(&recorder, || {
            Purgatory::<u32, Hostile>::builder()
                .name("all")
                .purge_interval(1)
                .build()
                .unwrap()
        });
        let check_panics = Arc::new(AtomicBool::new(false));
        let ready = Arc::new(AtomicBool::new(false));
        let op = |expiry_panics| Hostile {
            check_panics: check_panics.clone(),
            ready: ready.clone(),
            expiry_panics,
        };
        let mut keep = Vec::new();
        for i in 0..20 {
            keep.push(
                p.try_complete_else_watch(op(false), ms(1000), [i, 100])
                    .unwrap(),
            );
        }
        let lv = p
            .try_complete_else_watch_levels(op(false), ms(1000), [Watch::level(200, 5)])
            .unwrap();
        let r = keep[0].op_ref().unwrap();
        assert!(!r.try_complete());
        ready.store(true, Ordering::SeqCst);
        assert!(r.try_complete());
        for i in 1..15 {
            if i != 5 && i != 6 {
                assert_eq!(p.try_complete_watched(&i), 1);
            }
        }
        assert_eq!(p.try_complete_reached(&200, 9), 1);
        ready.store(false, Ordering::SeqCst);
        let _ = p.cancel_for_key(&5);
        drop(keep.remove(6));
        drop(
            p.try_complete_else_watch(op(false), ms(1000), [400])
                .unwrap(),
        );
        let e = p.try_complete_else_watch(op(true), ms(10), [300]).unwrap();
        advance(ms(15)).await;
        settle().await;
        assert_eq!(e.await, Err(OperationError::Panicked));
        drop(lv);
        let m = p.metrics();
        assert!(
            m.purged > 0 && m.panicked > 0 && m.cancelled > 0 && m.expired > 0,
            "{m:?}"
        );
        metrics::with_local_recorder(&recorder, || p.record_metrics());
        check_export(&collect(&recorder), &m, "kind=purgatory,name=all");

        let back = p.shutdown();
        assert!(!back.is_empty());
        drop(keep);
        let m = p.metrics();
        assert!(balanced(&m), "{m:?}");
        assert_eq!(
            (m.delayed, m.watched, m.tombstones, m.keys),
            (0, 0, 0, 0),
            "{m:?}"
        );
        metrics::with_local_recorder(&recorder, || p.record_metrics());
        check_export(&collect(&recorder), &m, "kind=purgatory,name=all");
    }
}
// ---------------------------------------------------------------------------
// A shared reaper: each purgatory and timer counts every wake-up and turn,
// and only its own expiries, batches and lateness.

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_shared_reaper_counts_in_each_it_serves() {
    let reaper = tokio_purgatory::Reaper::start().unwrap();
    let a: Purgatory<u32, FlagOp> = Purgatory::builder()
        .name("a")
        .reaper(&reaper)
        .build()
        .unwrap();
    let b: Purgatory<u32, FlagOp> = Purgatory::builder()
        .name("b")
        .reaper(&reaper)
        .build()
        .unwrap();
    let t = Timer::builder().name("t").reaper(&reaper).build().unwrap();
    let never = Arc::new(AtomicBool::new(false));
    let ha: Vec<_> = (0..3)
        .map(|i| {
            a.try_complete_else_watch(FlagOp(never.clone()), ms(10), [i])
                .unwrap()
        })
        .collect();
    let hb = b
        .try_complete_else_watch(FlagOp(never.clone()), ms(20), [1])
        .unwrap();
    t.schedule(ms(30), || {}).unwrap();
    t.schedule(ms(30), || {}).unwrap();
    for _ in 0..4 {
        advance(ms(10)).await;
        settle().await;
    }
    for h in ha {
        assert!(h.await.unwrap().is_expired());
    }
    assert!(hb.await.unwrap().is_expired());
    let (ma, mb, mt) = (a.metrics(), b.metrics(), t.metrics());
    assert_eq!((ma.expired, mb.expired, mt.expired), (3, 1, 2));
    assert_eq!(
        (
            ma.reaper.largest_batch,
            mb.reaper.largest_batch,
            mt.reaper.largest_batch
        ),
        (3, 1, 2)
    );
    assert_eq!(
        (
            a.lateness().count(),
            b.lateness().count(),
            t.lateness().count()
        ),
        (3, 1, 2)
    );
    assert_eq!(ma.reaper_wakeups, mb.reaper_wakeups);
    assert_eq!(ma.reaper_wakeups, mt.reaper_wakeups);
    assert_eq!(ma.reaper.turns, mb.reaper.turns);
    assert_eq!(ma.reaper.turns, mt.reaper.turns);
    assert!(ma.reaper_wakeups >= 3, "three distinct due times");
    // One shuts down: the others go on counting; it keeps its counts.
    drop(b.shutdown());
    let frozen = b.metrics();
    t.schedule(ms(5), || {}).unwrap();
    advance(ms(6)).await;
    settle().await;
    let (ma2, mb2, mt2) = (a.metrics(), b.metrics(), t.metrics());
    assert_eq!(mb2.reaper, frozen.reaper);
    // (b's own shutdown woke the reaper, which counts that wake-up in b:
    // see `timer_counters_keep_their_values_after_shutdown`.)
    assert!(mb2.reaper_wakeups <= frozen.reaper_wakeups + 1);
    assert_eq!(mt2.expired, 3);
    assert_eq!(ma2.reaper_wakeups, mt2.reaper_wakeups);
    assert_eq!(ma2.reaper.turns, mt2.reaper.turns);
}

// ---------------------------------------------------------------------------
// Metrics read from inside a check, an expiry and a Drop (no deadlock; what
// they say is sane), on both runtimes.

struct Reader {
    p: Arc<OnceLock<WeakPurgatory<u32, Reader>>>,
    ready: Arc<AtomicBool>,
    seen: Arc<Mutex<Vec<(&'static str, PurgatoryMetrics)>>>,
}

impl Reader {
    fn read(&self, at: &'static str) {
        if let Some(p) = self.p.get().and_then(|w| w.upgrade()) {
            let m = p.metrics();
            let _ = p.lateness();
            #[cfg(feature = "metrics")]
            p.record_metrics();
            self.seen.lock().unwrap().push((at, m));
        }
    }
}

impl Operation for Reader {
    type Output = ();
    fn try_complete(&mut self) -> Option<()> {
        self.read("check");
        self.ready.load(Ordering::SeqCst).then_some(())
    }
    fn on_expiration(self) {
        self.read("expiry");
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        self.read("drop");
    }
}

fn reader_round() -> Vec<(&'static str, PurgatoryMetrics)> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    rt.block_on(async {
        let p: Purgatory<u32, Reader> = Purgatory::new();
        let cell = Arc::new(OnceLock::new());
        cell.set(p.downgrade()).ok().unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let ready = Arc::new(AtomicBool::new(false));
        let mk = || Reader {
            p: cell.clone(),
            ready: ready.clone(),
            seen: seen.clone(),
        };
        let a = p.try_complete_else_watch(mk(), ms(10), [1, 2]).unwrap();
        let b = p.try_complete_else_watch(mk(), ms(1000), [2]).unwrap();
        let c = p.try_complete_else_watch(mk(), ms(1000), [3]).unwrap();
        assert!(a.await.unwrap().is_expired());
        ready.store(true, Ordering::SeqCst);
        assert_eq!(p.try_complete_watched(&2), 1);
        assert!(b.await.unwrap().is_completed());
        drop(c);
        let m = p.metrics();
        assert_eq!(counts(&m), (3, 1, 1, 1, 0), "{m:?}");
        assert_eq!(
            (m.delayed, m.watched, m.tombstones, m.keys),
            (0, 0, 0, 0),
            "{m:?}"
        );
        let v = seen.lock().unwrap().clone();
        v
    })
}

#[test]
fn metrics_read_from_operation_code_do_not_deadlock() {
    let seen = support::within(20, reader_round);
    // Every read was sane: never more finished than registered, and the
    // reading operation itself still pending while its own code runs.
    for (at, m) in &seen {
        assert!(
            m.completed + m.expired + m.cancelled + m.handed_back <= m.registered,
            "{at}: {m:?}"
        );
        assert!(m.tombstones <= m.watched, "{at}: {m:?}");
    }
    assert!(seen.iter().any(|(at, _)| *at == "expiry"));
    assert!(seen.iter().any(|(at, _)| *at == "drop"));
}

/// A key whose `Eq` panics against key 0 in the map (all keys hash alike).
#[derive(Clone, Debug)]
struct Bomb(u32, bool);
impl PartialEq for Bomb {
    fn eq(&self, o: &Self) -> bool {
        if (self.1 && o.0 == 0) || (o.1 && self.0 == 0) {
            panic!("bomb");
        }
        self.0 == o.0
    }
}
impl Eq for Bomb {}
impl std::hash::Hash for Bomb {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        h.write_u8(0);
    }
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_key_panicking_mid_registration_leaves_only_tombstones() {
    let p: Purgatory<Bomb, FlagOp> = Purgatory::builder().watcher_shards(1).build().unwrap();
    let never = Arc::new(AtomicBool::new(false));
    let h0 = p
        .try_complete_else_watch(FlagOp(never.clone()), ms(100), [Bomb(0, false)])
        .unwrap();
    let before = p.metrics();
    for round in 0..3 {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            p.try_complete_else_watch(
                FlagOp(never.clone()),
                ms(100),
                [Bomb(1, false), Bomb(2, false), Bomb(3, true)],
            )
            .map(|h| h.detach())
        }));
        assert!(r.is_err(), "round {round}");
        let m = p.metrics();
        assert_eq!(
            counts(&m),
            counts(&before),
            "round {round}: no counter changed: {m:?}"
        );
        assert_eq!(m.delayed, 1);
        assert_eq!(
            m.watched - m.tombstones,
            1,
            "round {round}: one live entry: {m:?}"
        );
    }
    drop(h0);
    let m = p.metrics();
    assert_eq!(counts(&m), (1, 0, 0, 1, 0), "{m:?}");
    assert_eq!(
        (m.delayed, m.watched, m.tombstones, m.keys),
        (0, 0, 0, 0),
        "{m:?}"
    );
}

/// Shuts its own purgatory down from its n-th check.
struct ShutsDown {
    p: Arc<OnceLock<WeakPurgatory<u32, ShutsDown>>>,
    at: u32,
    n: u32,
}
impl Operation for ShutsDown {
    type Output = ();
    fn try_complete(&mut self) -> Option<()> {
        self.n += 1;
        if self.n == self.at {
            if let Some(p) = self.p.get().and_then(|w| w.upgrade()) {
                drop(p.shutdown());
            }
        }
        None
    }
    fn on_expiration(self) {}
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_shutdown_from_a_registration_check_balances_and_empties() {
    for at in [1, 2] {
        let p: Purgatory<u32, ShutsDown> = Purgatory::new();
        let cell = Arc::new(OnceLock::new());
        cell.set(p.downgrade()).ok().unwrap();
        let other = p
            .try_complete_else_watch(
                ShutsDown {
                    p: cell.clone(),
                    at: 0,
                    n: 0,
                },
                ms(100),
                [1, 2],
            )
            .unwrap();
        let r = p.try_complete_else_watch(
            ShutsDown {
                p: cell.clone(),
                at,
                n: 0,
            },
            ms(100),
            [2, 3],
        );
        assert!(matches!(r, Err(WatchError::Shutdown(_))), "at {at}");
        assert_eq!(other.await, Err(OperationError::Shutdown));
        let m = p.metrics();
        assert!(balanced(&m), "at {at}: {m:?}");
        assert_eq!(m.delayed, 0, "at {at}: {m:?}");
        assert_eq!(
            (m.watched, m.tombstones, m.keys),
            (0, 0, 0),
            "at {at}: {m:?}"
        );
    }
}
