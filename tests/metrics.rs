//! The metrics against the truth of scripted runs on paused time: checks per
//! kind of walk, reaper turns and batches, and expiry lateness.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio_purgatory::{Purgatory, Timer, Watch};

mod support;
use support::{ms, settle, FlagOp as Op};

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn checks_are_counted_per_kind_of_walk() {
    let p: Purgatory<u32, Op> = Purgatory::new();
    let ready = Arc::new(AtomicBool::new(false));
    let mut handles = Vec::new();
    // Four plain watchers of key 1, three level watchers of key 2 (levels 1,
    // 2 and 3), and one more of key 3 checked by reference.
    for _ in 0..4 {
        handles.push(
            p.try_complete_else_watch(Op(ready.clone()), ms(1000), [1])
                .unwrap(),
        );
    }
    for level in 1..=3 {
        handles.push(
            p.try_complete_else_watch_levels(Op(ready.clone()), ms(1000), [Watch::level(2, level)])
                .unwrap(),
        );
    }
    let by_ref = p
        .try_complete_else_watch(Op(ready.clone()), ms(1000), [3])
        .unwrap();
    let op = by_ref.op_ref().unwrap();
    assert_eq!(
        p.metrics().checks,
        Default::default(),
        "registrations are not counted"
    );

    // A walk that completes nothing, then one that completes all four.
    assert_eq!(p.try_complete_watched(&1), 0);
    // An advance to level 2 checks the two watches it reaches.
    assert_eq!(p.try_complete_reached(&2, 2), 0);
    assert!(!op.try_complete());
    ready.store(true, Ordering::SeqCst);
    assert_eq!(p.try_complete_watched(&1), 4);
    assert_eq!(p.try_complete_watched(&1), 0, "nothing left to check");
    assert_eq!(p.try_complete_reached(&2, 3), 3);
    assert!(op.try_complete());

    let c = p.metrics().checks;
    assert_eq!(
        (
            c.key_walks.walks,
            c.key_walks.checked,
            c.key_walks.completed
        ),
        (3, 8, 4)
    );
    assert_eq!(
        (
            c.level_advances.walks,
            c.level_advances.checked,
            c.level_advances.completed
        ),
        (2, 5, 3)
    );
    assert_eq!(
        (
            c.by_reference.walks,
            c.by_reference.checked,
            c.by_reference.completed
        ),
        (2, 2, 1)
    );
    drop(handles);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn lateness_turns_and_batches_match_a_scripted_run() {
    let p: Purgatory<u32, Op> = Purgatory::new();
    let never = Arc::new(AtomicBool::new(false));
    let handles: Vec<_> = (0..5)
        .map(|i| {
            p.try_complete_else_watch(Op(never.clone()), ms(10), [i])
                .unwrap()
        })
        .collect();
    assert!(p.lateness().is_empty());
    // The clock jumps 17 ms: all five are taken out at once, 7 ms late.
    tokio::time::advance(ms(17)).await;
    settle().await;
    for h in handles {
        assert!(h.await.unwrap().is_expired());
    }
    let late = p.lateness();
    assert_eq!(late.count(), 5);
    assert_eq!(late.max(), ms(7));
    assert_eq!(late.quantile(0.5), ms(7));
    assert_eq!(late.mean(), ms(7));
    let m = p.metrics();
    assert_eq!(m.reaper.largest_batch, 5);
    assert!(m.reaper.turns >= 1);
    assert!(m.reaper.longest_turn <= m.reaper.busy);

    // One more, fired on time (the reaper sleeps until its deadline).
    let h = p
        .try_complete_else_watch(Op(never.clone()), ms(30), [9])
        .unwrap();
    assert!(h.await.unwrap().is_expired());
    let late = p.lateness();
    assert_eq!(late.count(), 6);
    assert_eq!(late.quantile(0.1), Duration::ZERO);
    assert_eq!(p.metrics().reaper.largest_batch, 5);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn the_timer_records_lateness_and_turns_too() {
    let timer = Timer::new();
    let ran = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    for _ in 0..3 {
        let ran = ran.clone();
        timer
            .schedule(ms(4), move || {
                ran.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap();
    }
    tokio::time::advance(ms(9)).await;
    settle().await;
    assert_eq!(ran.load(Ordering::SeqCst), 3);
    let late = timer.lateness();
    assert_eq!(late.count(), 3);
    assert_eq!(late.max(), ms(5));
    let m = timer.metrics();
    assert_eq!(m.reaper.largest_batch, 3);
    assert!(m.reaper.turns >= 1);
    assert!(m.reaper_wakeups >= 1);
}

/// `cells` is the most operations ever held at once, in whole pages of the
/// slab: cells freed are kept for the operations that follow, and it never
/// goes down.
#[tokio::test(start_paused = true)]
async fn cells_follow_the_peak_and_stay() {
    let p: Purgatory<u32, Op> = Purgatory::new();
    assert_eq!(p.metrics().cells, 0);
    let ready = Arc::new(AtomicBool::new(false));
    let register = |n: u32| -> Vec<_> {
        (0..n)
            .map(|i| {
                p.try_complete_else_watch(Op(ready.clone()), Duration::from_secs(60), [i % 10])
                    .unwrap()
            })
            .collect()
    };
    let first = register(100);
    // 32 + 32 + 64 cells: the pages that hold 100.
    assert_eq!(p.metrics().cells, 128);
    ready.store(true, Ordering::SeqCst);
    for k in 0..10 {
        p.try_complete_watched(&k);
    }
    drop(first);
    ready.store(false, Ordering::SeqCst);
    assert_eq!(p.metrics().delayed, 0);
    assert_eq!(p.metrics().cells, 128, "freed cells are kept");
    let again = register(100);
    assert_eq!(p.metrics().cells, 128, "and reused");
    let more = register(200);
    assert_eq!(
        p.metrics().cells,
        512,
        "300 at once: up to the page of 256..512"
    );
    drop((again, more));
    settle().await;
    assert_eq!(p.metrics().delayed, 0);
    assert_eq!(p.metrics().cells, 512, "never goes down");
}

/// Says "not yet" (or, with `then_done`, completes) on its third check (the
/// first after registration's two), which waits at `entered` until
/// `release`.
struct Held {
    checks: usize,
    then_done: bool,
    entered: Arc<std::sync::Barrier>,
    release: Arc<std::sync::Barrier>,
}

impl tokio_purgatory::Operation for Held {
    type Output = &'static str;
    fn try_complete(&mut self) -> Option<&'static str> {
        self.checks += 1;
        if self.checks == 3 {
            self.entered.wait();
            self.release.wait();
            return self.then_done.then_some("done");
        }
        None
    }
    fn on_expiration(self) -> &'static str {
        "expired"
    }
}

/// An expiry the reaper leaves to a check running on another thread at that
/// moment is one lateness sample, as the reaper measured it, when that check
/// expires it (it says "not yet"), and none when the check completes it:
/// `lateness().count()` stays equal to `expired`. It is in no turn's batch.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn an_expiry_left_to_a_running_check_is_sampled_once_if_it_expires() {
    for then_done in [false, true] {
        let p: Purgatory<u32, Held> = Purgatory::new();
        let entered = Arc::new(std::sync::Barrier::new(2));
        let release = Arc::new(std::sync::Barrier::new(2));
        let op = Held {
            checks: 0,
            then_done,
            entered: entered.clone(),
            release: release.clone(),
        };
        let h = p.try_complete_else_watch(op, ms(10), [1]).unwrap();
        let op_ref = h.op_ref().unwrap();
        let checker = std::thread::spawn(move || op_ref.try_complete());
        entered.wait();
        // The deadline passes, 5 ms late, while the check runs: the
        // reaper's turn leaves the expiry to it.
        tokio::time::advance(ms(15)).await;
        settle().await;
        assert_eq!(p.metrics().expired, 0);
        release.wait();
        assert_eq!(checker.join().unwrap(), then_done);
        let out = h.await.unwrap();
        let m = p.metrics();
        let late = p.lateness();
        assert_eq!(late.count(), m.expired, "then done: {then_done}");
        if then_done {
            assert_eq!(out, tokio_purgatory::Completion::Completed("done"));
            assert_eq!((m.completed, m.expired), (1, 0));
        } else {
            assert_eq!(out, tokio_purgatory::Completion::Expired("expired"));
            assert_eq!((m.completed, m.expired), (0, 1));
            let max = late.max();
            assert!(max >= ms(5) && max < ms(6), "{max:?}");
        }
        assert_eq!(m.reaper.largest_batch, 0, "no turn expired it");
    }
}

/// A timer's counters keep the values they had at its shutdown, as its
/// metrics say: the wake-up its shutdown gives the reaper (to let go of it)
/// is not counted in it.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_timers_counters_stay_put_after_its_shutdown() {
    let timer = Timer::new();
    timer.sleep(ms(5)).await.unwrap();
    let _later = timer.schedule(ms(1000), || {}).unwrap();
    settle().await;
    drop(timer.shutdown());
    let at_shutdown = timer.metrics();
    settle().await;
    tokio::time::advance(ms(2000)).await;
    settle().await;
    assert_eq!(timer.metrics(), at_shutdown);
}

/// A repeating or async task cancelled, or a sleep dropped, in the reaper's
/// turn that took its entry out, before it ran (by a task that ran first in
/// that turn), never runs (or wakes anyone), and is neither counted as
/// expired nor sampled for lateness.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_task_cancelled_in_its_own_turn_is_no_expiry() {
    use std::sync::atomic::AtomicUsize;
    use std::sync::OnceLock;
    let timer = Timer::builder().shards(1).build().unwrap();
    let ran = Arc::new(AtomicUsize::new(0));
    let repeating: Arc<OnceLock<tokio_purgatory::TaskHandle>> = Arc::default();
    let spawned: Arc<OnceLock<tokio_purgatory::AsyncTaskHandle>> = Arc::default();
    let nap: Arc<std::sync::Mutex<Option<tokio_purgatory::Sleep>>> = Arc::default();
    let cancelled = Arc::new(AtomicUsize::new(0));
    let fired = Arc::new(AtomicBool::new(false));
    let (r, s, c) = (repeating.clone(), spawned.clone(), cancelled.clone());
    let (z, f) = (nap.clone(), fired.clone());
    // Scheduled first, so it runs first among entries due in the same tick
    // of the one shard: the order they went in (the crate promises no order;
    // this test relies on today's, and says so if it changes).
    timer
        .schedule(ms(10), move || {
            let cancels = [r.get().unwrap().cancel(), s.get().unwrap().cancel()];
            c.store(cancels.iter().filter(|c| **c).count(), Ordering::SeqCst);
            let nap = z.lock().unwrap().take().unwrap();
            f.store(nap.is_elapsed(), Ordering::SeqCst);
            drop(nap);
        })
        .unwrap();
    let n = ran.clone();
    let h = timer
        .schedule_repeating(ms(10), move || {
            n.fetch_add(1, Ordering::SeqCst);
            Some(ms(1000))
        })
        .unwrap();
    assert!(repeating.set(h).is_ok());
    let n = ran.clone();
    let h = timer
        .schedule_async(ms(10), async move {
            n.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
    assert!(spawned.set(h).is_ok());
    *nap.lock().unwrap() = Some(timer.sleep(ms(10)));
    tokio::time::advance(ms(11)).await;
    settle().await;
    assert_eq!(
        (
            cancelled.load(Ordering::SeqCst),
            fired.load(Ordering::SeqCst)
        ),
        (2, false),
        "the first task no longer runs first in its turn"
    );
    assert_eq!(ran.load(Ordering::SeqCst), 0);
    let m = timer.metrics();
    assert_eq!(m.expired, 1, "the cancelling task only");
    assert_eq!(timer.lateness().count(), m.expired);
}

/// A slow expiry, on Tokio's paused clock.
struct Slow;
impl tokio_purgatory::Operation for Slow {
    type Output = ();
    fn try_complete(&mut self) -> Option<()> {
        None
    }
    fn on_expiration(self) {
        // The wall clock is the point: the turn's time is measured on it.
        std::thread::sleep(ms(5));
    }
}

/// "A turn's time includes the expiries' own code": a timer task and an
/// `on_expiration` that each take 5 ms of the wall clock count in `busy` and
/// `longest_turn`, though Tokio's clock stands still while they run.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_turns_time_counts_the_expiries_own_code_under_a_paused_clock() {
    let timer = Timer::new();
    let _task = timer.schedule(ms(1), || std::thread::sleep(ms(5))).unwrap();
    tokio::time::advance(ms(2)).await;
    settle().await;
    let r = timer.metrics().reaper;
    assert_eq!(timer.metrics().expired, 1);
    assert!(r.busy >= ms(5), "{r:?}");
    assert!(r.longest_turn >= ms(5) && r.longest_turn <= r.busy, "{r:?}");

    let p: Purgatory<u32, Slow> = Purgatory::new();
    let h = p.try_complete_else_watch(Slow, ms(1), [1]).unwrap();
    assert!(h.await.unwrap().is_expired());
    let r = p.metrics().reaper;
    assert!(r.busy >= ms(5), "{r:?}");
    assert!(r.longest_turn >= ms(5) && r.longest_turn <= r.busy, "{r:?}");
}

/// `TimerMetrics`: a shutdown called from one of the timer's own tasks
/// comes in the middle of a reaper turn, which is counted as it ends (the
/// task and the rest of its batch, which still run); from then on the
/// counters keep their values.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_shutdown_from_a_task_counts_its_turn_then_keeps_the_counters() {
    use std::sync::atomic::AtomicUsize;
    let timer = Timer::builder().shards(1).build().unwrap();
    let t = timer.clone();
    timer.schedule(ms(10), move || drop(t.shutdown())).unwrap();
    let ran = Arc::new(AtomicUsize::new(0));
    for _ in 0..3 {
        let r = ran.clone();
        timer
            .schedule(ms(10), move || {
                r.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap();
    }
    tokio::time::advance(ms(10)).await;
    settle().await;
    assert_eq!(ran.load(Ordering::SeqCst), 3, "the rest of the batch ran");
    let after_turn = timer.metrics();
    assert_eq!(after_turn.expired, 4, "the turn counted as it ended");
    assert_eq!(after_turn.pending, 0);
    tokio::time::advance(ms(100)).await;
    settle().await;
    assert_eq!(timer.metrics(), after_turn, "then kept");
}
