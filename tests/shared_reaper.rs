//! One reaper task serving several purgatories and timers: each fires on time,
//! one shutting down leaves the others served, the task is gone once the last
//! owner goes, and a reaper whose runtime stopped closes what it served.

mod support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::{advance, Instant};
use tokio_purgatory::{
    Completion, Operation, OperationError, Purgatory, Reaper, Timer, WatchErrorKind,
};

use support::{ms, settle};

/// Records when it expired.
struct Stamp(
    Arc<Mutex<Vec<(&'static str, Duration)>>>,
    &'static str,
    Instant,
);

impl Operation for Stamp {
    type Output = ();
    fn try_complete(&mut self) -> Option<()> {
        None
    }
    fn on_expiration(self) {
        self.0.lock().unwrap().push((self.1, self.2.elapsed()));
    }
}

fn alive_tasks() -> usize {
    tokio::runtime::Handle::current()
        .metrics()
        .num_alive_tasks()
}

/// Advances 1 ms at a time, letting the reaper run after each.
async fn step(total: Duration) {
    for _ in 0..total.as_millis() {
        advance(ms(1)).await;
        settle().await;
    }
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn one_task_serves_them_all_and_ends_after_the_last_owner() {
    let base = alive_tasks();
    let reaper = Reaper::start().unwrap();
    let a: Purgatory<u32, Stamp> = Purgatory::builder()
        .name("a")
        .reaper(&reaper)
        .build()
        .unwrap();
    let b: Purgatory<u32, Stamp> = Purgatory::builder()
        .name("b")
        .reaper(&reaper)
        .build()
        .unwrap();
    let timer = Timer::builder().reaper(&reaper).build().unwrap();
    settle().await;
    assert_eq!(alive_tasks(), base + 1, "one task for all three");
    assert_eq!(reaper.serving(), 3);

    // Owned purgatories, for contrast, spawn one each.
    let own: Purgatory<u32, Stamp> = Purgatory::new();
    settle().await;
    assert_eq!(alive_tasks(), base + 2);
    drop(own);
    settle().await;
    assert_eq!(
        alive_tasks(),
        base + 1,
        "an owned reaper ends with its purgatory"
    );

    // The handle goes first: what it serves keeps it running.
    drop(reaper);
    settle().await;
    assert_eq!(alive_tasks(), base + 1);
    let log = Arc::new(Mutex::new(Vec::new()));
    let t0 = Instant::now();
    let h = b
        .try_complete_else_watch(Stamp(log.clone(), "b", t0), ms(5), [1])
        .unwrap();
    step(ms(5)).await;
    assert_eq!(h.await, Ok(Completion::Expired(())));

    drop(a);
    settle().await;
    assert_eq!(alive_tasks(), base + 1, "b and the timer are still open");
    drop(timer);
    settle().await;
    assert_eq!(alive_tasks(), base + 1, "b is still open");
    // The last owner: a pending operation is handed back by the shutdown.
    let pending = b
        .try_complete_else_watch(Stamp(log.clone(), "late", t0), ms(50), [1])
        .unwrap();
    assert_eq!(b.shutdown().len(), 1);
    assert_eq!(pending.await, Err(OperationError::Shutdown));
    drop(b);
    settle().await;
    assert_eq!(alive_tasks(), base, "the reaper task is gone");
    assert_eq!(
        log.lock().unwrap().len(),
        1,
        "only b's first operation expired"
    );
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn each_fires_on_time_whatever_its_tick() {
    let reaper = Reaper::start().unwrap();
    let fine: Purgatory<u32, Stamp> = Purgatory::builder()
        .tick(Duration::from_micros(100))
        .reaper(&reaper)
        .build()
        .unwrap();
    let coarse: Purgatory<u32, Stamp> = Purgatory::builder()
        .tick(ms(10))
        .reaper(&reaper)
        .build()
        .unwrap();
    let timer = Timer::builder()
        .tick(ms(1))
        .reaper(&reaper)
        .build()
        .unwrap();
    let log = Arc::new(Mutex::new(Vec::new()));
    let t0 = Instant::now();
    let _c = coarse
        .try_complete_else_watch(Stamp(log.clone(), "coarse", t0), ms(40), [1])
        .unwrap();
    let _f = fine
        .try_complete_else_watch(Stamp(log.clone(), "fine", t0), ms(7), [1])
        .unwrap();
    let fired = log.clone();
    timer
        .schedule(ms(23), move || {
            fired.lock().unwrap().push(("timer", t0.elapsed()))
        })
        .unwrap();
    step(ms(45)).await;
    assert_eq!(
        *log.lock().unwrap(),
        [("fine", ms(7)), ("timer", ms(23)), ("coarse", ms(40))],
        "each at its own deadline, in deadline order"
    );
    let wakeups = fine.metrics().reaper_wakeups;
    assert!(wakeups >= 3, "the shared reaper woke for each ({wakeups})");
}

/// A purgatory attached while the reaper sleeps on a later deadline of another
/// one: its earlier deadline wakes the reaper.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_later_attached_purgatory_wakes_the_sleeping_reaper() {
    let reaper = Reaper::start().unwrap();
    let first: Purgatory<u32, Stamp> = Purgatory::builder().reaper(&reaper).build().unwrap();
    let log = Arc::new(Mutex::new(Vec::new()));
    let t0 = Instant::now();
    let _late = first
        .try_complete_else_watch(Stamp(log.clone(), "late", t0), ms(100), [1])
        .unwrap();
    step(ms(2)).await;
    let second: Purgatory<u32, Stamp> = Purgatory::builder().reaper(&reaper).build().unwrap();
    let soon = second
        .try_complete_else_watch(Stamp(log.clone(), "soon", t0), ms(8), [1])
        .unwrap();
    step(ms(10)).await;
    assert_eq!(soon.await, Ok(Completion::Expired(())));
    assert_eq!(*log.lock().unwrap(), [("soon", ms(10))]);
}

/// Shutting one down hands its operations back and leaves the others served,
/// and a panicking timer task does not stop a purgatory's expiries beside it.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn one_shutting_down_or_panicking_leaves_the_others_served() {
    let reaper = Reaper::start().unwrap();
    let kept: Purgatory<u32, Stamp> = Purgatory::builder().reaper(&reaper).build().unwrap();
    let stopped: Purgatory<u32, Stamp> = Purgatory::builder().reaper(&reaper).build().unwrap();
    let timer = Timer::builder().reaper(&reaper).build().unwrap();
    let log = Arc::new(Mutex::new(Vec::new()));
    let t0 = Instant::now();
    let ran = Arc::new(AtomicUsize::new(0));
    for d in [3, 6] {
        timer
            .schedule(ms(d), || panic!("a timer task panics"))
            .unwrap();
    }
    let counted = ran.clone();
    timer
        .schedule(ms(6), move || {
            counted.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
    let kept_op = kept
        .try_complete_else_watch(Stamp(log.clone(), "kept", t0), ms(9), [1])
        .unwrap();
    let stopped_op = stopped
        .try_complete_else_watch(Stamp(log.clone(), "stopped", t0), ms(9), [1])
        .unwrap();
    step(ms(4)).await;
    let back = stopped.shutdown();
    assert_eq!(back.len(), 1, "handed back");
    assert_eq!(stopped_op.await, Err(OperationError::Shutdown));
    settle().await;
    assert_eq!(reaper.serving(), 2);
    step(ms(6)).await;
    assert_eq!(kept_op.await, Ok(Completion::Expired(())));
    assert_eq!(*log.lock().unwrap(), [("kept", ms(9))]);
    assert_eq!(ran.load(Ordering::SeqCst), 1);
    assert_eq!(timer.metrics().panicked, 2);
    // A new purgatory can still be built on it.
    let later: Purgatory<u32, Stamp> = Purgatory::builder().reaper(&reaper).build().unwrap();
    assert!(!later.is_shutdown());
}

/// The reaper's runtime stops: what it served is closed as with its own reaper
/// gone, and nothing more can be built on it.
#[test]
fn a_stopped_reaper_closes_what_it_served() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let reaper = Reaper::start_on(rt.handle());
    let p: Purgatory<u32, Stamp> = Purgatory::builder().reaper(&reaper).build().unwrap();
    let timer = Timer::builder().reaper(&reaper).build().unwrap();
    let log = Arc::new(Mutex::new(Vec::new()));
    let handle = {
        let _in = rt.enter();
        p.try_complete_else_watch(Stamp(log.clone(), "op", Instant::now()), ms(60_000), [1])
            .unwrap()
    };
    rt.block_on(tokio::task::yield_now());
    drop(rt);
    assert!(reaper.is_stopped());
    assert!(p.is_shutdown());
    assert!(timer.is_shutdown());
    let other = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    other.block_on(async {
        assert_eq!(handle.await, Err(OperationError::ReaperGone));
        let refused = p
            .try_complete_else_watch(Stamp(log.clone(), "refused", Instant::now()), ms(5), [1])
            .unwrap_err();
        assert_eq!(refused.kind(), WatchErrorKind::ReaperGone);
        let err = Purgatory::<u32, Stamp>::builder()
            .reaper(&reaper)
            .build()
            .unwrap_err();
        assert!(err.is_reaper_stopped());
        assert_eq!(reaper.serving(), 0);
    });
    assert!(log.lock().unwrap().is_empty(), "nothing expired");
}

/// The multi-thread runtime: producers on both workers register into two
/// purgatories on one reaper; every operation expires exactly once. The
/// deadlines are already due at registration, so nothing waits on the wall
/// clock (the timeout bounds a failure only).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_purgatories_under_two_workers_expire_everything_once() {
    let reaper = Reaper::start().unwrap();
    let ps: Vec<Purgatory<u32, Stamp>> = (0..2)
        .map(|_| Purgatory::builder().reaper(&reaper).build().unwrap())
        .collect();
    let log = Arc::new(Mutex::new(Vec::new()));
    let t0 = Instant::now();
    let mut joins = Vec::new();
    for p in &ps {
        let p = p.clone();
        let log = log.clone();
        joins.push(tokio::spawn(async move {
            let mut hs = Vec::new();
            for n in 0..200u64 {
                hs.push(
                    p.try_complete_else_watch(
                        Stamp(log.clone(), "op", t0),
                        Duration::ZERO,
                        [n as u32 % 5],
                    )
                    .unwrap(),
                );
            }
            hs
        }));
    }
    let mut handles = Vec::new();
    for j in joins {
        handles.extend(j.await.unwrap());
    }
    let all = async {
        for h in handles {
            assert_eq!(h.await, Ok(Completion::Expired(())));
        }
    };
    tokio::time::timeout(Duration::from_secs(10), all)
        .await
        .expect("every operation expires");
    assert_eq!(log.lock().unwrap().len(), 400);
    for p in &ps {
        let m = p.metrics();
        assert_eq!(m.expired, 200);
        assert!(support::balanced(&m));
    }
}

/// User code run by the reaper calls back into it: a timer task builds another
/// timer on the same reaper, schedules on it, and drops the last `Reaper`
/// handle. Nothing deadlocks, the new timer is served, and the task ends once
/// both timers are gone.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_task_run_by_the_reaper_can_build_on_it_and_drop_its_handle() {
    let base = alive_tasks();
    let reaper = Reaper::start().unwrap();
    let timer = Timer::builder().reaper(&reaper).build().unwrap();
    let built: Arc<Mutex<Option<Timer>>> = Arc::default();
    let fired = Arc::new(AtomicUsize::new(0));
    let (slot, count) = (built.clone(), fired.clone());
    let mut handle = Some(reaper);
    timer
        .schedule(ms(2), move || {
            let reaper = handle.take().unwrap();
            let inner = Timer::builder().reaper(&reaper).build().unwrap();
            let count = count.clone();
            inner
                .schedule(ms(3), move || {
                    count.fetch_add(1, Ordering::SeqCst);
                })
                .unwrap();
            drop(reaper);
            *slot.lock().unwrap() = Some(inner);
        })
        .unwrap();
    step(ms(6)).await;
    assert_eq!(
        fired.load(Ordering::SeqCst),
        1,
        "the timer built in a task fired"
    );
    assert_eq!(alive_tasks(), base + 1);
    drop(timer);
    drop(built.lock().unwrap().take());
    settle().await;
    assert_eq!(alive_tasks(), base, "gone with the last timer");
}

/// `reaper_wakeups`: "a `Reaper` shared with others counts its wake-ups in
/// each it serves". A timer attached while the reaper sleeps (for its
/// neighbour's deadline an hour out), whose own insert wakes it, counts that
/// wake-up as its neighbour does: over the same period both count the same.
#[tokio::test(start_paused = true)]
async fn a_timer_attached_while_the_reaper_sleeps_counts_the_wake_up_it_caused() {
    let reaper = Reaper::start().unwrap();
    let a = Timer::builder().name("a").reaper(&reaper).build().unwrap();
    let _far = a.sleep(Duration::from_secs(3600));
    settle().await; // the reaper sleeps until A's deadline
    let b = Timer::builder().name("b").reaper(&reaper).build().unwrap();
    settle().await;
    let (a1, b1) = (a.metrics().reaper_wakeups, b.metrics().reaper_wakeups);
    let nap = b.sleep(ms(10)); // wakes the reaper
    settle().await;
    advance(ms(10)).await;
    nap.await.unwrap();
    settle().await;
    let (a2, b2) = (a.metrics().reaper_wakeups, b.metrics().reaper_wakeups);
    assert!(b2 > b1, "b counted the wake-ups its sleep caused");
    assert_eq!(a2 - a1, b2 - b1, "one reaper, the same wake-ups in each");
}
