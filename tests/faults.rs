//! Faults and hostile use: re-entrancy, dropped runtimes,
//! handles shared between tasks, misbehaving keys, and a cross-thread stress whose
//! counters must balance. Tests that could deadlock run under a timeout.

use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio::time::{advance, timeout};
use tokio_purgatory::{Completion, Operation, OperationError, Purgatory, Timer};

mod support;
use support::{ms, settle, FlagOp as Flag};

/// A timer task that schedules, cancels and shuts down its own timer.
#[tokio::test(start_paused = true)]
async fn timer_tasks_reenter_the_timer() {
    let timer = Timer::new();
    let ran = Arc::new(AtomicUsize::new(0));
    let (t, r) = (timer.clone(), ran.clone());
    let victim = Arc::new(Mutex::new(None));
    let v = victim.clone();
    *victim.lock().unwrap() = Some(
        timer
            .schedule(ms(50), || panic!("must be cancelled"))
            .unwrap(),
    );
    timer
        .schedule(ms(10), move || {
            // Reschedule (Dubbo-style periodic task), cancel another, then stop.
            let r2 = r.clone();
            t.schedule(ms(10), move || {
                r2.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap();
            assert!(v.lock().unwrap().take().unwrap().cancel());
            r.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
    timeout(ms(1000), async {
        advance(ms(10)).await; // the task runs at 10 ms and reschedules for 20 ms
        settle().await;
        advance(ms(10)).await;
        settle().await;
    })
    .await
    .expect("no deadlock");
    assert_eq!(ran.load(Ordering::SeqCst), 2);
    assert_eq!(timer.metrics().panicked, 0);
}

/// A check that shuts the purgatory down from inside.
#[tokio::test(start_paused = true)]
async fn shutdown_from_inside_a_check() {
    struct Stopper(Arc<OnceLock<Purgatory<u8, Stopper>>>, Arc<AtomicBool>);
    impl Operation for Stopper {
        type Output = usize;
        fn try_complete(&mut self) -> Option<usize> {
            if !self.1.load(Ordering::SeqCst) {
                return None;
            }
            Some(self.0.get().map_or(0, |p| p.shutdown().len()))
        }
        fn on_expiration(self) -> usize {
            0
        }
    }
    let cell = Arc::new(OnceLock::new());
    let p: Purgatory<u8, Stopper> = Purgatory::builder().name("stop").build().unwrap();
    cell.set(p.clone()).unwrap();
    let go = Arc::new(AtomicBool::new(false));
    let first = p
        .try_complete_else_watch(Stopper(cell.clone(), go.clone()), ms(100), [1])
        .unwrap();
    let second = p
        .try_complete_else_watch(
            Stopper(cell.clone(), Arc::new(AtomicBool::new(false))),
            ms(100),
            [2],
        )
        .unwrap();
    go.store(true, Ordering::SeqCst);
    let n = timeout(ms(1000), async { p.try_complete_watched(&1) })
        .await
        .expect("no deadlock");
    assert_eq!(n, 1);
    // The check itself was mid-run, so shutdown handed back only the other one.
    assert_eq!(first.await, Ok(Completion::Completed(1)));
    assert_eq!(second.await, Err(OperationError::Shutdown));
    let m = p.metrics();
    assert_eq!(
        m.registered,
        m.completed + m.expired + m.cancelled + m.handed_back
    );
}

/// A registration's second check (the operation is watched, not yet in its
/// cell) shuts the purgatory down: the shutdown leaves the operation to the
/// registration, which hands it back with the refusal; nothing is lost or
/// counted twice.
#[tokio::test(start_paused = true)]
async fn shutdown_from_inside_the_registrations_second_check() {
    struct Stopper {
        p: Arc<OnceLock<Purgatory<u8, Stopper>>>,
        checks: Arc<AtomicUsize>,
        id: u32,
    }
    impl Operation for Stopper {
        type Output = ();
        fn try_complete(&mut self) -> Option<()> {
            if self.checks.fetch_add(1, Ordering::SeqCst) == 1 {
                let taken = self.p.get().map_or(0, |p| p.shutdown().len());
                assert_eq!(taken, 0, "the registering operation is not taken");
            }
            None
        }
        fn on_expiration(self) {}
    }
    let cell = Arc::new(OnceLock::new());
    let p: Purgatory<u8, Stopper> = Purgatory::builder().name("stop2").build().unwrap();
    cell.set(p.clone()).unwrap();
    let checks = Arc::new(AtomicUsize::new(0));
    let op = Stopper {
        p: cell.clone(),
        checks: checks.clone(),
        id: 7,
    };
    let err = p.try_complete_else_watch(op, ms(100), [1, 2]).unwrap_err();
    assert!(
        matches!(err, tokio_purgatory::WatchError::Shutdown(_)),
        "{err:?}"
    );
    assert_eq!(err.into_inner().id, 7, "the operation comes back");
    assert_eq!(
        checks.load(Ordering::SeqCst),
        2,
        "checked before and after watching"
    );
    let m = p.metrics();
    assert_eq!(m.delayed, 0);
    assert_eq!(
        m.registered,
        m.completed + m.expired + m.cancelled + m.handed_back
    );
}

/// The runtime that runs the reaper goes away while tasks on another runtime await
/// handles, some of them never polled: every handle resolves, nothing hangs.
#[test]
fn runtime_dropped_while_handles_are_awaited() {
    let reaper_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_time()
        .build()
        .unwrap();
    let p: Purgatory<u32, Flag> = Purgatory::builder()
        .name("dies")
        .build_on(reaper_rt.handle())
        .unwrap();
    let waiting: Vec<_> = (0..100)
        .map(|i| {
            p.try_complete_else_watch(
                Flag(Arc::new(AtomicBool::new(false))),
                Duration::from_secs(60),
                [i % 7],
            )
            .unwrap()
        })
        .collect();
    let other = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let (polled, never_polled): (Vec<_>, Vec<_>) = waiting
        .into_iter()
        .enumerate()
        .partition(|(i, _)| i % 2 == 0);
    let joins: Vec<_> = polled.into_iter().map(|(_, h)| other.spawn(h)).collect();
    other.block_on(async { settle().await });
    drop(reaper_rt);
    other.block_on(async {
        for j in joins {
            let out = timeout(Duration::from_secs(5), j)
                .await
                .expect("resolved")
                .unwrap();
            assert_eq!(out, Err(OperationError::ReaperGone));
        }
        for (_, h) in never_polled {
            assert_eq!(h.await, Err(OperationError::ReaperGone));
        }
    });
    assert!(p
        .try_complete_else_watch(Flag(Arc::new(AtomicBool::new(true))), ms(1), [1])
        .is_err());
}

/// Polling one handle from different tasks wakes the latest waker.
#[tokio::test(start_paused = true)]
async fn latest_poller_is_woken() {
    let p: Purgatory<u8, Flag> = Purgatory::builder().name("wake").build().unwrap();
    let flag = Arc::new(AtomicBool::new(false));
    let handle = p
        .try_complete_else_watch(Flag(flag.clone()), ms(1000), [1])
        .unwrap();
    let mut first = tokio_test::task::spawn(());
    let mut second = tokio_test::task::spawn(());
    let mut handle = Box::pin(handle);
    assert!(first.enter(|cx, _| handle.as_mut().poll(cx)).is_pending());
    assert!(second.enter(|cx, _| handle.as_mut().poll(cx)).is_pending());
    flag.store(true, Ordering::SeqCst);
    p.try_complete_watched(&1);
    assert!(second.is_woken(), "the latest poller is woken");
    assert!(second.enter(|cx, _| handle.as_mut().poll(cx)).is_ready());
}

use std::future::Future;

/// A key type whose `Hash` disagrees with its `Eq`: no panic, no corruption; the
/// operation is still finished by its timeout.
#[tokio::test(start_paused = true)]
async fn hash_and_eq_disagreeing_keys_fall_back_to_the_timeout() {
    #[derive(Clone, Debug)]
    struct Liar(u32);
    impl PartialEq for Liar {
        fn eq(&self, _: &Self) -> bool {
            true // everything is equal...
        }
    }
    impl Eq for Liar {}
    impl Hash for Liar {
        fn hash<H: Hasher>(&self, h: &mut H) {
            self.0.hash(h); // ...but hashes differ
        }
    }
    let p: Purgatory<Liar, Flag> = Purgatory::builder().name("liar").build().unwrap();
    let flag = Arc::new(AtomicBool::new(false));
    let h = p
        .try_complete_else_watch(Flag(flag.clone()), ms(50), [Liar(1), Liar(2), Liar(3)])
        .unwrap();
    flag.store(true, Ordering::SeqCst);
    p.try_complete_watched(&Liar(99)); // may or may not find it
    let out = h.await;
    assert!(matches!(
        out,
        Ok(Completion::Completed(())) | Ok(Completion::Expired(()))
    ));
    for k in 0..100 {
        p.try_complete_watched(&Liar(k));
    }
    let m = p.metrics();
    assert_eq!(m.delayed, 0);
    assert_eq!(m.registered, m.completed + m.expired);
}

/// A very large key space with churn: the watcher map shrinks back to empty.
#[tokio::test(start_paused = true)]
async fn key_churn_leaves_an_empty_map() {
    let p: Purgatory<u64, Flag> = Purgatory::builder().name("churn").build().unwrap();
    for round in 0..5u64 {
        let flag = Arc::new(AtomicBool::new(false));
        let mut handles = Vec::new();
        for i in 0..20_000u64 {
            let base = round * 1_000_000 + i * 3;
            handles.push(
                p.try_complete_else_watch(Flag(flag.clone()), ms(100), [base, base + 1, base + 2])
                    .unwrap(),
            );
        }
        assert_eq!(p.metrics().keys, 60_000);
        flag.store(true, Ordering::SeqCst);
        // Complete half by key, let the other half expire.
        for i in (0..20_000u64).step_by(2) {
            p.try_complete_watched(&(round * 1_000_000 + i * 3));
        }
        advance(ms(100)).await;
        settle().await;
        for h in handles {
            h.detach();
        }
    }
    // Registration triggers the amortised purge; walk what is left.
    let _ = p.try_complete_else_watch(Flag(Arc::new(AtomicBool::new(true))), ms(1), [0]);
    let m = p.metrics();
    assert_eq!(m.delayed, 0);
    assert!(m.keys < 60_000, "tombstoned keys were purged: {m:?}");
    let rest: Vec<u64> = (0..5u64)
        .flat_map(|r| (0..60_000u64).map(move |i| r * 1_000_000 + i))
        .collect();
    for k in rest {
        p.try_complete_watched(&k);
    }
    let m = p.metrics();
    assert_eq!((m.keys, m.watched), (0, 0), "{m:?}");
}

/// Many tasks on the multi-thread runtime register, complete by key and by
/// reference, cancel by key, and drop handles while timeouts fire. Every operation
/// has exactly one outcome and the counters balance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stress_across_threads_balances() {
    let p: Purgatory<u32, Counted> = Purgatory::builder()
        .name("stress")
        .purge_interval(64)
        .build()
        .unwrap();
    let outcomes = Arc::new(AtomicUsize::new(0));
    let finished = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for t in 0..8u64 {
        let p = p.clone();
        let outcomes = outcomes.clone();
        let finished = finished.clone();
        tasks.push(tokio::spawn(async move {
            let mut seed = 0x9E37_79B9u64.wrapping_mul(t + 1);
            let mut next = || {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                seed
            };
            for _ in 0..2_000 {
                let flag = Arc::new(AtomicBool::new(false));
                let keys = [(next() % 16) as u32, (next() % 16) as u32];
                let op = Counted {
                    ready: flag.clone(),
                    finished: finished.clone(),
                };
                let h = p
                    .try_complete_else_watch(op, Duration::from_micros(next() % 3000), keys)
                    .unwrap();
                match next() % 6 {
                    0 => {
                        flag.store(true, Ordering::SeqCst);
                        p.try_complete_watched(&keys[0]);
                    }
                    1 => {
                        flag.store(true, Ordering::SeqCst);
                        if let Some(r) = h.op_ref() {
                            r.try_complete();
                        }
                    }
                    2 => {
                        drop(p.cancel_for_key(&keys[1]));
                    }
                    3 => {
                        drop(h);
                        continue;
                    }
                    _ => {}
                }
                let outcomes = outcomes.clone();
                tokio::spawn(async move {
                    let _ = h.await;
                    outcomes.fetch_add(1, Ordering::SeqCst);
                });
                if next() % 8 == 0 {
                    tokio::task::yield_now().await;
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    timeout(Duration::from_secs(30), async {
        while p.delayed() > 0 {
            tokio::time::sleep(ms(5)).await;
        }
    })
    .await
    .expect("every operation finished");
    let m = p.metrics();
    assert_eq!(m.registered, 16_000);
    assert_eq!(
        m.registered,
        m.completed + m.expired + m.cancelled + m.handed_back,
        "{m:?}"
    );
    // Completions and expiries each ran the operation's own code exactly once.
    assert_eq!(
        finished.load(Ordering::SeqCst) as u64,
        m.completed + m.expired
    );
}

struct Counted {
    ready: Arc<AtomicBool>,
    finished: Arc<AtomicUsize>,
}

impl Operation for Counted {
    type Output = ();
    fn try_complete(&mut self) -> Option<()> {
        self.ready.load(Ordering::SeqCst).then(|| {
            self.finished.fetch_add(1, Ordering::SeqCst);
        })
    }
    fn on_expiration(self) {
        self.finished.fetch_add(1, Ordering::SeqCst);
    }
}

/// An operation whose check can be held at a barrier, to race a check against an
/// event from another thread deterministically. Clones share everything.
#[derive(Clone)]
struct Gated {
    ready: Arc<AtomicBool>,
    /// The next check blocks: it reads `ready`, then waits at `entered` and `release`.
    hold_next: Arc<AtomicBool>,
    entered: Arc<std::sync::Barrier>,
    release: Arc<std::sync::Barrier>,
    checks: Arc<AtomicUsize>,
    /// On the check after a held one, walk this purgatory's key 1 from inside.
    reenter: Option<Arc<OnceLock<Purgatory<u8, Gated>>>>,
}

impl Operation for Gated {
    type Output = usize;
    fn try_complete(&mut self) -> Option<usize> {
        let n = self.checks.fetch_add(1, Ordering::SeqCst);
        let ready = self.ready.load(Ordering::SeqCst);
        if self.hold_next.swap(false, Ordering::SeqCst) {
            self.entered.wait();
            self.release.wait();
        } else if let Some(p) = self.reenter.as_ref().and_then(|p| p.get()) {
            // Re-entrant: the checker walks its own key. Not an outside event.
            assert_eq!(p.try_complete_watched(&1), 0);
        }
        ready.then_some(n)
    }
    fn on_expiration(self) -> usize {
        usize::MAX
    }
}

/// Runs a walk of key 1 on another thread, holds its check at the barrier, runs
/// `during` on this thread meanwhile, then lets the check go on. Returns what the
/// held walk returned; fails if it has not returned within 10 s (a check that
/// loops).
fn with_a_check_held(p: &Purgatory<u8, Gated>, op: &Gated, during: impl FnOnce()) -> usize {
    op.hold_next.store(true, Ordering::SeqCst);
    let (tx, rx) = std::sync::mpsc::channel();
    {
        let p = p.clone();
        std::thread::spawn(move || {
            let _ = tx.send(p.try_complete_watched(&1));
        });
    }
    op.entered.wait(); // the other thread is inside the check now
    during();
    op.release.wait();
    rx.recv_timeout(Duration::from_secs(10))
        .expect("the held check never ended")
}

/// Races an event (a walk of key 1 from this thread; `ready_first` sets the
/// operation completable first) against a held check. Returns what the held walk
/// returned and what the event's walk returned.
fn race_an_event_against_a_held_check(
    p: &Purgatory<u8, Gated>,
    op: &Gated,
    ready_first: bool,
) -> (usize, usize) {
    let mut event = 0;
    let held = with_a_check_held(p, op, || {
        if ready_first {
            op.ready.store(true, Ordering::SeqCst);
        }
        event = p.try_complete_watched(&1);
    });
    (held, event)
}

/// A purgatory with one gated operation registered on key 1, and its handle.
fn gated_on_key_1(
    reenter: Option<Arc<OnceLock<Purgatory<u8, Gated>>>>,
    timeout: Duration,
) -> (
    Purgatory<u8, Gated>,
    Gated,
    tokio_purgatory::OperationHandle<u8, Gated>,
) {
    let p: Purgatory<u8, Gated> = Purgatory::builder().name("race").build().unwrap();
    if let Some(slot) = &reenter {
        slot.set(p.clone()).ok();
    }
    let op = Gated {
        ready: Arc::default(),
        hold_next: Arc::default(),
        entered: Arc::new(std::sync::Barrier::new(2)),
        release: Arc::new(std::sync::Barrier::new(2)),
        checks: Arc::default(),
        reenter,
    };
    let handle = p.try_complete_else_watch(op.clone(), timeout, [1]).unwrap();
    (p, op, handle)
}

/// An event from another thread while a check runs is not lost: the checker
/// checks again and completes it (KAFKA-6653). With thread ids that collapsed to
/// one value, the event would pass for the checker re-entering, and be dropped.
#[tokio::test]
async fn an_event_during_another_threads_check_makes_it_check_again() {
    let (p, op, handle) = gated_on_key_1(None, ms(60_000));
    assert_eq!(
        op.checks.load(Ordering::SeqCst),
        2,
        "two checks at registration"
    );
    let (held, event) = race_an_event_against_a_held_check(&p, &op, true);
    assert_eq!(
        event, 0,
        "the event only asked the running check to run again"
    );
    assert_eq!(held, 1, "the held walk completed it on its re-check");
    assert_eq!(handle.await.unwrap(), Completion::Completed(3));
    assert_eq!(op.checks.load(Ordering::SeqCst), 4);
}

/// The same event when the re-check still says "not yet": the operation is
/// released, still pending and checkable, and a later event completes it.
#[tokio::test]
async fn a_recheck_that_still_fails_leaves_the_operation_pending() {
    let (p, op, handle) = gated_on_key_1(None, ms(60_000));
    let (held, event) = race_an_event_against_a_held_check(&p, &op, false);
    assert_eq!((held, event), (0, 0));
    assert_eq!(
        op.checks.load(Ordering::SeqCst),
        4,
        "the event caused a re-check"
    );
    assert!(!handle.is_finished());
    assert_eq!(p.delayed(), 1);
    op.ready.store(true, Ordering::SeqCst);
    assert_eq!(p.try_complete_watched(&1), 1);
    assert!(handle.await.unwrap().is_completed());
}

/// The re-check the event asked for walks its own key from inside: that nested
/// walk is the checker itself (ignored, no loop), and the re-check completes.
#[tokio::test]
async fn a_recheck_may_reenter_its_own_key() {
    let slot = Arc::new(OnceLock::new());
    let (p, op, handle) = gated_on_key_1(Some(slot.clone()), ms(60_000));
    let (held, event) = race_an_event_against_a_held_check(&p, &op, true);
    assert_eq!((held, event), (1, 0));
    assert!(handle.await.unwrap().is_completed());
    drop(slot);
}

/// Two events from other threads during one check: the second must not cancel
/// the first's request (a toggled bit would), so the checker checks again.
#[tokio::test]
async fn two_events_during_one_check_still_make_it_check_again() {
    let (p, op, handle) = gated_on_key_1(None, ms(60_000));
    let held = with_a_check_held(&p, &op, || {
        op.ready.store(true, Ordering::SeqCst);
        assert_eq!(p.try_complete_watched(&1), 0);
        assert_eq!(p.try_complete_watched(&1), 0);
    });
    assert_eq!(held, 1, "the re-check completed it");
    assert!(handle.await.unwrap().is_completed());
}

/// Two cancels during one check: the second must not withdraw the first, so
/// the checker cancels the operation once its check says "not yet".
#[tokio::test]
async fn two_cancels_during_one_check_cancel_it_after() {
    let (p, op, handle) = gated_on_key_1(None, ms(5_000));
    let op_ref = handle.op_ref().unwrap();
    let held = with_a_check_held(&p, &op, || {
        assert!(op_ref.cancel().is_none(), "left for the checker");
        assert!(op_ref.cancel().is_none(), "left for the checker");
    });
    assert_eq!(held, 0);
    assert_eq!(handle.await, Err(OperationError::Cancelled));
    assert_eq!(p.delayed(), 0);
}

/// A re-check that walks its own key and still says "not yet" ends: the nested
/// walk is the checker itself, not an event asking for yet another check.
#[tokio::test]
async fn a_recheck_that_reenters_and_still_fails_ends() {
    let slot = Arc::new(OnceLock::new());
    let (p, op, handle) = gated_on_key_1(Some(slot.clone()), ms(60_000));
    let (held, event) = race_an_event_against_a_held_check(&p, &op, false);
    assert_eq!(event, 0, "asks for a re-check");
    assert_eq!(held, 0, "the re-check ended without completing it");
    assert!(!handle.is_finished());
    assert!(
        op.checks.load(Ordering::SeqCst) <= 4,
        "{} checks",
        op.checks.load(Ordering::SeqCst)
    );
    drop(slot);
}

/// A storm of walks asking for re-runs faster than the operation's check
/// runs: the thread that owns the check re-runs it for each, and used to do
/// so for ever, the timeout's expiry waiting behind the re-runs. Now the
/// expiry wins over a re-run asked meanwhile: the operation expires, its
/// handle resolves, and the walkers (the owner among them) get free.
#[test]
fn a_storm_of_walks_cannot_hold_an_operation_past_its_timeout() {
    /// What the walkers share with the check: armed once they run, the
    /// walks they have finished, and their stop.
    #[derive(Default)]
    struct Storm {
        armed: AtomicBool,
        walks: AtomicUsize,
        stop: AtomicBool,
    }
    /// Never completes; each check, once the walkers run, takes a while (as
    /// a check reading a slow store would): it holds until the other
    /// threads' walks have asked again twice while it runs (a walk finding
    /// the check under way asks for a re-run and returns), at most 5 ms.
    struct Slow(Arc<AtomicUsize>, Arc<Storm>);
    impl Operation for Slow {
        type Output = ();
        fn try_complete(&mut self) -> Option<()> {
            self.0.fetch_add(1, Ordering::Relaxed);
            let storm = &self.1;
            if storm.armed.load(Ordering::SeqCst) {
                let asked = storm.walks.load(Ordering::SeqCst) + 2;
                let give_up = std::time::Instant::now() + Duration::from_millis(5);
                while storm.walks.load(Ordering::SeqCst) < asked
                    && !storm.stop.load(Ordering::SeqCst)
                    && std::time::Instant::now() < give_up
                {
                    std::thread::yield_now();
                }
            }
            None
        }
        fn on_expiration(self) {}
    }
    support::within(30, || {
        let rt = support::multi();
        let p: Purgatory<u32, Slow> = Purgatory::builder().build_on(rt.handle()).unwrap();
        let checks = Arc::new(AtomicUsize::new(0));
        let storm = Arc::new(Storm::default());
        let h = {
            let _in = rt.enter();
            p.try_complete_else_watch(Slow(checks.clone(), storm.clone()), ms(50), [1])
                .unwrap()
        };
        storm.armed.store(true, Ordering::SeqCst);
        let walkers: Vec<_> = (0..4)
            .map(|_| {
                let (p, storm) = (p.clone(), storm.clone());
                std::thread::spawn(move || {
                    while !storm.stop.load(Ordering::Relaxed) {
                        p.try_complete_watched(&1);
                        storm.walks.fetch_add(1, Ordering::SeqCst);
                    }
                })
            })
            .collect();
        let due = std::time::Instant::now() + Duration::from_millis(50);
        let out = rt.block_on(h);
        // Late by a check or so, and the runtime's wake-up; a storm that
        // held the expiry behind its re-runs made it late by seconds.
        let late = std::time::Instant::now().saturating_duration_since(due);
        storm.stop.store(true, Ordering::SeqCst);
        for w in walkers {
            w.join().unwrap();
        }
        assert_eq!(out, Ok(Completion::Expired(())));
        assert!(checks.load(Ordering::Relaxed) > 2, "the storm ran");
        assert!(late < Duration::from_millis(500), "expired {late:?} late");
        let m = p.metrics();
        assert_eq!((m.expired, m.delayed), (1, 0), "{m:?}");
    });
}
