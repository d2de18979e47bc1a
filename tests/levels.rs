//! Watches at a level (`Watch::level`, `try_complete_reached`): only what a
//! level reaches is checked, a "not yet" is asked again on the next advance
//! only, regressions, the lost-event window at registration, cancel, expiry,
//! shutdown, tombstones, and user code that fights back.

mod support;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::time::advance;
use tokio_purgatory::{Completion, Operation, OperationError, Purgatory, Watch};

use support::{balanced, ms, settle};

/// Completes once the high watermark reaches `need` (and `gate` is open);
/// counts its checks.
struct Produce {
    hw: Arc<AtomicU64>,
    need: u64,
    gate: Arc<AtomicBool>,
    checks: Arc<AtomicUsize>,
}

impl Operation for Produce {
    type Output = u64;
    fn try_complete(&mut self) -> Option<u64> {
        self.checks.fetch_add(1, Ordering::SeqCst);
        let hw = self.hw.load(Ordering::SeqCst);
        (hw >= self.need && self.gate.load(Ordering::SeqCst)).then_some(self.need)
    }
    fn on_expiration(self) -> u64 {
        0
    }
}

struct Partition {
    hw: Arc<AtomicU64>,
    gate: Arc<AtomicBool>,
    checks: Arc<AtomicUsize>,
}

impl Partition {
    fn new() -> Partition {
        Partition {
            hw: Arc::default(),
            gate: Arc::new(AtomicBool::new(true)),
            checks: Arc::default(),
        }
    }
    fn op(&self, need: u64) -> Produce {
        Produce {
            hw: self.hw.clone(),
            need,
            gate: self.gate.clone(),
            checks: self.checks.clone(),
        }
    }
    fn checks(&self) -> usize {
        self.checks.swap(0, Ordering::SeqCst)
    }
}

#[tokio::test(start_paused = true)]
async fn an_advance_checks_exactly_what_it_reaches() {
    let p: Purgatory<u32, Produce> = Purgatory::new();
    let part = Partition::new();
    let mut handles = Vec::new();
    for need in (10..=1000).step_by(10) {
        let h = p
            .try_complete_else_watch_levels(part.op(need), ms(1000), [Watch::level(0, need)])
            .unwrap();
        handles.push(h);
    }
    assert_eq!(part.checks(), 200, "two checks at each registration");
    part.hw.store(35, Ordering::SeqCst);
    assert_eq!(p.try_complete_reached(&0, 35), 3);
    assert_eq!(part.checks(), 3, "10, 20, 30: nothing above 35 looked at");
    assert_eq!(p.try_complete_reached(&0, 35), 0, "the same level again");
    assert_eq!(part.checks(), 0);
    assert_eq!(p.try_complete_reached(&1, 5_000), 0, "another key");
    part.hw.store(1000, Ordering::SeqCst);
    assert_eq!(p.try_complete_reached(&0, 1000), 97);
    for (i, h) in handles.into_iter().enumerate() {
        assert_eq!(h.await, Ok(Completion::Completed(10 * (i as u64 + 1))));
    }
    // What the advances left behind are tombstones, gone with the next one.
    p.try_complete_reached(&0, 2000);
    let m = p.metrics();
    assert_eq!((m.delayed, m.watched, m.keys), (0, 0, 0), "{m:?}");
    assert!(balanced(&m));
}

/// A check that says "not yet" after its level was reached is asked again by
/// the next advance past that level, and by no advance that does not move
/// past it.
#[tokio::test(start_paused = true)]
async fn not_yet_is_asked_again_on_the_next_advance_only() {
    let p: Purgatory<u32, Produce> = Purgatory::new();
    let part = Partition::new();
    part.gate.store(false, Ordering::SeqCst); // e.g. another partition not ready
    let h = p
        .try_complete_else_watch_levels(part.op(5), ms(1000), [Watch::level(0, 5)])
        .unwrap();
    part.checks();
    part.hw.store(7, Ordering::SeqCst);
    assert_eq!(p.try_complete_reached(&0, 7), 0);
    assert_eq!(part.checks(), 1, "reached: checked");
    assert_eq!(p.try_complete_reached(&0, 7), 0);
    assert_eq!(p.try_complete_reached(&0, 6), 0);
    assert_eq!(part.checks(), 0, "no advance past 7: not asked again");
    assert_eq!(p.try_complete_reached(&0, 8), 0);
    assert_eq!(part.checks(), 1, "past 7: asked again");
    part.gate.store(true, Ordering::SeqCst);
    part.hw.store(9, Ordering::SeqCst);
    assert_eq!(p.try_complete_reached(&0, 9), 1);
    assert_eq!(h.await, Ok(Completion::Completed(5)));
}

/// The key's level goes down (a truncation): what waits above it keeps
/// waiting, and completes once the level comes back.
#[tokio::test(start_paused = true)]
async fn a_regression_leaves_higher_watches_waiting() {
    let p: Purgatory<u32, Produce> = Purgatory::new();
    let part = Partition::new();
    part.hw.store(50, Ordering::SeqCst);
    assert_eq!(p.try_complete_reached(&0, 50), 0, "no watchers: nothing");
    let low = p
        .try_complete_else_watch_levels(part.op(40), ms(1000), [Watch::level(0, 40)])
        .unwrap();
    assert!(
        low.is_finished(),
        "registered below the level: completed at once"
    );
    let high = p
        .try_complete_else_watch_levels(part.op(60), ms(1000), [Watch::level(0, 60)])
        .unwrap();
    part.checks();
    part.hw.store(30, Ordering::SeqCst);
    assert_eq!(p.try_complete_reached(&0, 30), 0);
    assert_eq!(part.checks(), 0, "60 is above 30: untouched");
    part.hw.store(60, Ordering::SeqCst);
    assert_eq!(p.try_complete_reached(&0, 60), 1);
    assert_eq!(high.await, Ok(Completion::Completed(60)));
    assert_eq!(low.await, Ok(Completion::Completed(40)));
}

/// Plain and level watches on the same key and on others: a walk checks the
/// plain ones only, an advance both.
#[tokio::test(start_paused = true)]
async fn plain_and_level_watches_mix() {
    let p: Purgatory<u32, Produce> = Purgatory::new();
    let part = Partition::new();
    part.gate.store(false, Ordering::SeqCst);
    let mixed = p
        .try_complete_else_watch_levels(part.op(10), ms(1000), [Watch::level(0, 10), 1.into()])
        .unwrap();
    let level_only = p
        .try_complete_else_watch_levels(part.op(10), ms(1000), [Watch::level(0, 10)])
        .unwrap();
    let plain = p
        .try_complete_else_watch(part.op(10), ms(1000), [0])
        .unwrap();
    assert_eq!(p.watched(), 4);
    part.checks();
    part.hw.store(10, Ordering::SeqCst);
    part.gate.store(true, Ordering::SeqCst);
    assert_eq!(
        p.try_complete_watched(&1),
        1,
        "the walk of 1 checks the mixed one"
    );
    assert_eq!(part.checks(), 1);
    assert_eq!(
        p.try_complete_watched(&0),
        1,
        "the plain watcher of 0, not the levels"
    );
    assert_eq!(part.checks(), 1);
    assert_eq!(p.try_complete_reached(&0, 10), 1, "the level-only one");
    assert_eq!(part.checks(), 1, "the finished ones are not checked again");
    for h in [mixed, level_only, plain] {
        assert_eq!(h.await, Ok(Completion::Completed(10)));
    }
}

#[tokio::test(start_paused = true)]
async fn cancel_expiry_and_shutdown_reach_level_watches() {
    let p: Purgatory<u32, Produce> = Purgatory::new();
    let part = Partition::new();
    let cancelled = p
        .try_complete_else_watch_levels(part.op(10), ms(1000), [Watch::level(7, 10)])
        .unwrap();
    let expires = p
        .try_complete_else_watch_levels(part.op(10), ms(50), [Watch::level(8, 10)])
        .unwrap();
    let handed_back = p
        .try_complete_else_watch_levels(part.op(99), ms(1000), [Watch::level(9, 99)])
        .unwrap();
    let back = p.cancel_for_key(&7);
    assert_eq!(back.iter().map(|o| o.need).collect::<Vec<_>>(), [10]);
    assert_eq!(cancelled.await, Err(OperationError::Cancelled));
    advance(ms(51)).await;
    settle().await;
    assert_eq!(expires.await, Ok(Completion::Expired(0)));
    let rest = p.shutdown();
    assert_eq!(rest.iter().map(|o| o.need).collect::<Vec<_>>(), [99]);
    assert_eq!(handed_back.await, Err(OperationError::Shutdown));
    let m = p.metrics();
    assert!(balanced(&m), "{m:?}");
    assert_eq!((m.watched, m.keys), (0, 0), "{m:?}");
}

/// Level watches of finished operations are tombstones: the purge takes them
/// out of the heaps, without any advance.
#[tokio::test(start_paused = true)]
async fn the_purge_clears_level_tombstones() {
    let p: Purgatory<u32, Produce> = Purgatory::builder().purge_interval(0).build().unwrap();
    let part = Partition::new();
    for k in 0..10 {
        for n in 0..100 {
            // Dropped handles cancel: each leaves a tombstone in key k's heap.
            drop(
                p.try_complete_else_watch_levels(part.op(u64::MAX), ms(1000), [Watch::level(k, n)])
                    .unwrap(),
            );
        }
    }
    assert_eq!(p.delayed(), 0);
    // Registrations run the purge's slices.
    let mut keep = Vec::new();
    for _ in 0..200 {
        keep.push(
            p.try_complete_else_watch(part.op(u64::MAX), ms(1000), [99])
                .unwrap(),
        );
    }
    let m = p.metrics();
    assert_eq!(m.tombstones, 0, "{m:?}");
    assert_eq!(m.keys, 1, "only key 99 is left: {m:?}");
    assert!(m.purged >= 1000, "{m:?}");
}

/// An advance to `u64::MAX`: a "not yet" stays at `u64::MAX` (one above would
/// overflow), so it is asked on each later advance to `u64::MAX`; none loops.
#[tokio::test(start_paused = true)]
async fn the_top_level_saturates() {
    let p: Purgatory<u32, Produce> = Purgatory::new();
    let part = Partition::new();
    part.gate.store(false, Ordering::SeqCst);
    let h = p
        .try_complete_else_watch_levels(part.op(1), ms(1000), [Watch::level(0, u64::MAX)])
        .unwrap();
    part.checks();
    part.hw.store(u64::MAX, Ordering::SeqCst);
    assert_eq!(p.try_complete_reached(&0, u64::MAX), 0);
    assert_eq!(p.try_complete_reached(&0, u64::MAX), 0);
    assert_eq!(part.checks(), 2);
    part.gate.store(true, Ordering::SeqCst);
    assert_eq!(p.try_complete_reached(&0, u64::MAX), 1);
    assert_eq!(h.await, Ok(Completion::Completed(1)));
}

/// Key code that panics in an advance reaches the caller and changes nothing;
/// an operation's drop that calls back into advances and walks does not
/// deadlock.
#[tokio::test(start_paused = true)]
async fn hostile_keys_and_call_backs_in_advances() {
    #[derive(Clone, Debug, PartialEq, Eq)]
    struct Key(u32, bool);
    impl std::hash::Hash for Key {
        fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
            assert!(!self.1, "hostile key hash");
            self.0.hash(h);
        }
    }
    struct CallsBack {
        hw: Arc<AtomicU64>,
        need: u64,
        p: Arc<OnceLock<Purgatory<Key, CallsBack>>>,
    }
    impl Operation for CallsBack {
        type Output = ();
        fn try_complete(&mut self) -> Option<()> {
            (self.hw.load(Ordering::SeqCst) >= self.need).then_some(())
        }
        fn on_expiration(self) {}
    }
    impl Drop for CallsBack {
        fn drop(&mut self) {
            if let Some(p) = self.p.get() {
                // Re-entrant advance and walk from inside a completion.
                let _ = p.try_complete_reached(&Key(0, false), self.need);
                let _ = p.try_complete_watched(&Key(1, false));
                let _ = p.metrics();
            }
        }
    }
    let slot = Arc::new(OnceLock::new());
    let p: Purgatory<Key, CallsBack> = Purgatory::new();
    slot.set(p.clone()).ok().unwrap();
    let hw = Arc::new(AtomicU64::new(0));
    let handles: Vec<_> = (1..=50)
        .map(|need| {
            let op = CallsBack {
                hw: hw.clone(),
                need,
                p: slot.clone(),
            };
            p.try_complete_else_watch_levels(op, ms(1000), [Watch::level(Key(0, false), need)])
                .unwrap()
        })
        .collect();
    let before = p.metrics();
    let r = catch_unwind(AssertUnwindSafe(|| {
        p.try_complete_reached(&Key(0, true), 10)
    }));
    assert!(r.is_err(), "the key's panic reaches the caller");
    let after = p.metrics();
    assert_eq!(
        (before.delayed, before.watched),
        (after.delayed, after.watched)
    );
    hw.store(50, Ordering::SeqCst);
    assert_eq!(p.try_complete_reached(&Key(0, false), 50), 50);
    for h in handles {
        assert_eq!(h.await, Ok(Completion::Completed(())));
    }
    assert!(balanced(&p.metrics()));
    let _ = slot; // the purgatory and the slot part here
}

/// A registration at the next level races the one advance that reaches it, on
/// two real threads, round after round: when both are done (and before any
/// later advance could cover a miss), the operation has completed, whichever
/// side won. No time passes: a lost advance would leave it pending.
#[test]
fn no_advance_is_lost_between_the_checks_and_the_watch() {
    use std::sync::Barrier;
    const ROUNDS: u64 = 5_000;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let p: Purgatory<u32, Produce> = Purgatory::builder().build_on(rt.handle()).unwrap();
    let part = Arc::new(Partition::new());
    let barrier = Arc::new(Barrier::new(3));
    let producer = {
        let (p, part, barrier) = (p.clone(), part.clone(), barrier.clone());
        std::thread::spawn(move || {
            for level in 1..=ROUNDS {
                barrier.wait();
                part.hw.store(level, Ordering::SeqCst);
                p.try_complete_reached(&0, level);
                barrier.wait();
            }
        })
    };
    let (tx, rx) = std::sync::mpsc::channel();
    let registrar = {
        let (p, part, barrier) = (p.clone(), part.clone(), barrier.clone());
        let _in = rt.enter();
        let handle = rt.handle().clone();
        std::thread::spawn(move || {
            let _rt = handle.enter();
            for level in 1..=ROUNDS {
                barrier.wait();
                let h = p
                    .try_complete_else_watch_levels(
                        part.op(level),
                        Duration::from_secs(600),
                        [Watch::level(0, level)],
                    )
                    .unwrap();
                tx.send(h).unwrap();
                barrier.wait();
            }
        })
    };
    for level in 1..=ROUNDS {
        barrier.wait();
        barrier.wait();
        let h = rx.recv().unwrap();
        assert!(h.is_finished(), "round {level}: the advance was lost");
    }
    producer.join().unwrap();
    registrar.join().unwrap();
    assert_eq!(p.delayed(), 0);
    assert!(balanced(&p.metrics()));
}

/// An operation's own check advances its key again (a check that moves the
/// watermark itself): the nested advance does not re-run the check it comes
/// from (that would loop forever for a check that always advances), and moves
/// the operation's watch past its level as any advance does; nothing
/// deadlocks, and the next advance past that level checks it again.
#[tokio::test(start_paused = true)]
async fn a_check_may_advance_its_own_key() {
    struct Bumps {
        hw: Arc<AtomicU64>,
        p: Arc<OnceLock<Purgatory<u32, Bumps>>>,
        checks: Arc<AtomicUsize>,
    }
    impl Operation for Bumps {
        type Output = u64;
        fn try_complete(&mut self) -> Option<u64> {
            self.checks.fetch_add(1, Ordering::SeqCst);
            let hw = self.hw.load(Ordering::SeqCst);
            if hw == 10 {
                self.hw.store(20, Ordering::SeqCst);
                if let Some(p) = self.p.get() {
                    assert_eq!(
                        p.try_complete_reached(&0, 20),
                        0,
                        "not re-run inside itself"
                    );
                }
                return None;
            }
            (hw >= 21).then_some(hw)
        }
        fn on_expiration(self) -> u64 {
            0
        }
    }
    let slot = Arc::new(OnceLock::new());
    let p: Purgatory<u32, Bumps> = Purgatory::new();
    slot.set(p.clone()).ok().unwrap();
    let (hw, checks) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicUsize::new(0)));
    let op = Bumps {
        hw: hw.clone(),
        p: slot.clone(),
        checks: checks.clone(),
    };
    let h = p
        .try_complete_else_watch_levels(op, ms(1000), [Watch::level(0, 5)])
        .unwrap();
    hw.store(10, Ordering::SeqCst);
    assert_eq!(p.try_complete_reached(&0, 10), 0);
    assert_eq!(
        checks.swap(0, Ordering::SeqCst),
        3,
        "two at registration, one advance"
    );
    assert_eq!(p.try_complete_reached(&0, 20), 0, "its watch moved past 20");
    assert_eq!(checks.swap(0, Ordering::SeqCst), 0);
    hw.store(21, Ordering::SeqCst);
    assert_eq!(p.try_complete_reached(&0, 21), 1);
    assert_eq!(h.await, Ok(Completion::Completed(21)));
    assert!(balanced(&p.metrics()));
}

/// Records the levels its checks were told (`None` for a check without
/// one) and completes once told a level at or above `need`.
struct Told {
    need: u64,
    told: Arc<std::sync::Mutex<Vec<Option<u64>>>>,
    /// While set, a check without a level waits here for the test to let
    /// it go (on the first message), after saying it is inside (on the
    /// second).
    hold: Option<(
        std::sync::mpsc::Receiver<()>,
        std::sync::mpsc::SyncSender<()>,
    )>,
}

impl Operation for Told {
    type Output = u64;
    fn try_complete(&mut self) -> Option<u64> {
        self.told.lock().unwrap().push(None);
        if let Some((go, inside)) = self.hold.take() {
            inside.send(()).unwrap();
            go.recv().unwrap();
        }
        None
    }
    fn try_complete_reached(&mut self, reached: u64) -> Option<u64> {
        self.told.lock().unwrap().push(Some(reached));
        (reached >= self.need).then_some(reached)
    }
    fn on_expiration(self) -> u64 {
        0
    }
}

type Log = Arc<std::sync::Mutex<Vec<Option<u64>>>>;

#[tokio::test(start_paused = true)]
async fn each_check_of_an_advance_is_told_its_level() {
    let p: Purgatory<u32, Told> = Purgatory::new();
    let (at, plain): (Log, Log) = Default::default();
    let op = |need, told: &Log| Told {
        need,
        told: told.clone(),
        hold: None,
    };
    let at_level = p
        .try_complete_else_watch_levels(op(30, &at), ms(1000), [Watch::above(0, 19)])
        .unwrap();
    let watching = p
        .try_complete_else_watch(op(25, &plain), ms(1000), [0])
        .unwrap();
    // Registration checks (before and after watching) know no level.
    assert_eq!(*at.lock().unwrap(), [None, None]);
    at.lock().unwrap().clear();
    plain.lock().unwrap().clear();

    assert_eq!(p.try_complete_reached(&0, 19), 0, "not past 19");
    assert!(
        at.lock().unwrap().is_empty(),
        "below its level: not checked"
    );
    assert_eq!(
        *plain.lock().unwrap(),
        [Some(19)],
        "a plain watch is told too"
    );

    assert_eq!(p.try_complete_watched(&0), 0);
    assert_eq!(
        *plain.lock().unwrap(),
        [Some(19), None],
        "a walk has no level"
    );

    assert_eq!(p.try_complete_reached(&0, 27), 1);
    assert_eq!(*at.lock().unwrap(), [Some(27)]);
    assert_eq!(watching.await, Ok(Completion::Completed(27)));
    assert_eq!(p.try_complete_reached(&0, 30), 1);
    assert_eq!(*at.lock().unwrap(), [Some(27), Some(30)]);
    assert_eq!(at_level.await, Ok(Completion::Completed(30)));
}

/// An advance that finds the operation being checked on another thread
/// hands its level to that checker's re-run: the highest of those that
/// asked, and none is lost.
#[tokio::test(start_paused = true)]
async fn a_level_is_handed_to_the_check_running_elsewhere() {
    let p: Purgatory<u32, Told> = Purgatory::new();
    let told = Log::default();
    let (go_tx, go_rx) = std::sync::mpsc::sync_channel(1);
    let (inside_tx, inside_rx) = std::sync::mpsc::sync_channel(1);
    let op = Told {
        need: 20,
        told: told.clone(),
        hold: None,
    };
    let handle = p
        .try_complete_else_watch_levels(op, ms(1000), [Watch::level(0, 5), Watch::key(1)])
        .unwrap();
    let op_ref = handle.op_ref().unwrap();
    op_ref.update(|op| op.hold = Some((go_rx, inside_tx)));
    told.lock().unwrap().clear();

    // A plain walk of key 1 checks on another thread, and waits inside.
    let walker = {
        let p = p.clone();
        std::thread::spawn(move || p.try_complete_watched(&1))
    };
    inside_rx.recv().unwrap();
    // Two advances meanwhile: each asks the running check to run again.
    assert_eq!(p.try_complete_reached(&0, 10), 0);
    assert_eq!(p.try_complete_reached(&0, 20), 0);
    go_tx.send(()).unwrap();
    assert_eq!(walker.join().unwrap(), 1, "the re-run completed it");
    assert_eq!(
        *told.lock().unwrap(),
        [None, Some(20)],
        "one re-run, told 20"
    );
    assert_eq!(handle.await, Ok(Completion::Completed(20)));
}
