//! The timer's API used hostilely, state by state: the builder's refusals,
//! `TaskHandle` in every state (pending, cancelled, taken, run, shut down,
//! reaper lost, from inside its own run), repeating tasks resetting and
//! cancelling themselves, the room under `max_pending` given back every
//! way, deadlines never early at odd ticks, far and zero deadlines, tasks of
//! one turn cancelling each other exactly once, async tasks whose futures
//! panic on drop or are handed back, tasks whose `Drop` calls back in,
//! timeout futures at their edges, and refusals handing back what was given.
#![allow(deprecated)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::{advance, Instant};
use tokio_purgatory::timer::{ScheduleError, TaskStatus, TimeoutError, TimerError};
use tokio_purgatory::Timer;

mod support;
use support::{ms, settle};

async fn step(total: Duration) {
    let mut left = total;
    while !left.is_zero() {
        let d = left.min(ms(1));
        advance(d).await;
        settle().await;
        left -= d;
    }
}

#[tokio::test(start_paused = true)]
async fn builder_rejections_name_the_setting() {
    let cases: Vec<(tokio_purgatory::timer::TimerBuilder, &str)> = vec![
        (Timer::builder().tick(Duration::ZERO), "tick"),
        (Timer::builder().slots_per_level(1), "slots_per_level"),
        (Timer::builder().slots_per_level(65), "slots_per_level"),
        (Timer::builder().slots_per_level(0), "slots_per_level"),
        (Timer::builder().levels(0), "levels"),
        (Timer::builder().slots_per_level(64).levels(11), "levels"),
        (Timer::builder().slots_per_level(2).levels(62), "levels"),
        (Timer::builder().levels(usize::MAX), "levels"),
        (Timer::builder().shards(0), "shards"),
        (Timer::builder().shards(1025), "shards"),
        (Timer::builder().batch_size(0), "batch_size"),
        (Timer::builder().max_pending(0), "max_pending"),
    ];
    for (b, name) in cases {
        let dbg = format!("{b:?}");
        let e = b.build().unwrap_err();
        assert!(!e.is_no_runtime() && !e.is_reaper_stopped());
        assert!(e.to_string().contains(name), "{e} for {dbg}");
    }
    // Accepted edges.
    for b in [
        Timer::builder().slots_per_level(2).levels(61),
        Timer::builder().slots_per_level(64).levels(10),
        Timer::builder().slots_per_level(3),
        Timer::builder().shards(1024),
        Timer::builder().shards(3),
        Timer::builder().batch_size(1),
        Timer::builder().max_pending(1),
        Timer::builder().max_pending(usize::MAX),
        Timer::builder().tick(Duration::from_nanos(1)),
        Timer::builder().tick(Duration::MAX),
    ] {
        let t = b.build().unwrap();
        t.schedule(ms(1), || {}).unwrap();
        drop(t.sleep(Duration::MAX));
    }
}

/// Every handle type, every state.
#[tokio::test(start_paused = true)]
async fn task_handle_states_everywhere() {
    let timer = Timer::new();
    let ran = Arc::new(AtomicUsize::new(0));
    let r = ran.clone();
    let t = timer
        .schedule(ms(10), move || {
            r.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
    assert_eq!(t.status(), TaskStatus::Pending);
    assert!(t.is_pending());
    let task = t.cancel_and_take().unwrap();
    assert_eq!(t.status(), TaskStatus::Cancelled);
    assert!(!t.is_pending());
    assert!(!t.reset(ms(5)));
    assert!(!t.reset_at(Instant::now()));
    assert!(!t.cancel());
    assert!(t.cancel_and_take().is_none());
    assert_eq!(t.status(), TaskStatus::Cancelled);
    assert!(timer.is_empty());
    step(ms(20)).await;
    assert_eq!(ran.load(Ordering::SeqCst), 0);
    task.into_inner()();
    assert_eq!(ran.load(Ordering::SeqCst), 1);
    assert_eq!(t.status(), TaskStatus::Cancelled);

    // After it ran.
    let t = timer.schedule(ms(10), || {}).unwrap();
    step(ms(11)).await;
    assert_eq!(t.status(), TaskStatus::Done);
    assert!(!t.reset(ms(1)));
    assert!(!t.cancel());
    assert!(t.cancel_and_take().is_none());
    assert_eq!(t.status(), TaskStatus::Done);
    step(ms(5)).await;
    assert_eq!(timer.metrics().expired, 1);

    // After shutdown.
    let t = timer.schedule(ms(10), || {}).unwrap();
    let r = timer.schedule_repeating(ms(10), || Some(ms(10))).unwrap();
    let a = timer.schedule_async(ms(10), async {}).unwrap();
    let back = timer.shutdown();
    assert_eq!(back.len(), 3);
    assert_eq!(t.status(), TaskStatus::Done);
    assert_eq!(r.status(), TaskStatus::Done);
    assert!(!t.reset(ms(1)) && !r.reset(ms(1)) && !a.reset(ms(1)));
    assert!(!t.cancel() && !r.cancel());
    assert!(t.cancel_and_take().is_none() && r.cancel_and_take().is_none());
    assert_eq!(t.status(), TaskStatus::Done);
    assert_eq!(r.status(), TaskStatus::Done);
    assert!(!a.is_pending() && !a.is_finished());
    assert!(timer.shutdown().is_empty());
    assert!(matches!(
        timer.schedule(ms(1), || {}),
        Err(ScheduleError::Shutdown(_))
    ));
    assert!(matches!(
        timer.schedule_repeating(ms(1), || None),
        Err(ScheduleError::Shutdown(_))
    ));
    assert!(matches!(
        timer.schedule_async(ms(1), async {}),
        Err(ScheduleError::Shutdown(_))
    ));
    assert!(matches!(
        timer.schedule_at(Instant::now(), || {}),
        Err(ScheduleError::Shutdown(_))
    ));
    assert_eq!(timer.sleep(ms(1)).await, Err(TimerError::Shutdown));
    assert_eq!(
        timer.timeout(ms(1), std::future::pending::<()>()).await,
        Err(TimeoutError::Timer(TimerError::Shutdown))
    );
    assert_eq!(timer.timeout(ms(1), async { 3 }).await, Ok(3));
    drop(back);
    assert!(a.is_finished());
    assert!(!a.cancel(), "finished: dropped unrun");
    let m = timer.metrics();
    assert_eq!(m.pending, 0);
}

/// A one-shot task resets, cancels and takes its own handle while it runs.
#[tokio::test(start_paused = true)]
async fn a_task_reaching_its_own_handle_while_it_runs() {
    let timer = Timer::new();
    let slot: Arc<Mutex<Option<tokio_purgatory::timer::TaskHandle>>> = Arc::new(Mutex::new(None));
    let s = slot.clone();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let sn = seen.clone();
    let t = timer
        .schedule(ms(10), move || {
            let g = s.lock().unwrap();
            let h = g.as_ref().unwrap();
            sn.lock().unwrap().push(format!(
                "{:?} {} {} {} {}",
                h.status(),
                h.is_pending(),
                h.reset(ms(5)),
                h.cancel(),
                h.cancel_and_take().is_some()
            ));
        })
        .unwrap();
    *slot.lock().unwrap() = Some(t);
    step(ms(30)).await;
    assert_eq!(*seen.lock().unwrap(), vec!["Done false false false false"]);
    let g = slot.lock().unwrap();
    assert_eq!(g.as_ref().unwrap().status(), TaskStatus::Done);
    assert_eq!(timer.metrics().expired, 1);
    assert!(timer.is_empty());
}

/// A repeating task resets its own handle while it runs: false (it is running).
#[tokio::test(start_paused = true)]
async fn a_repeating_task_resetting_itself_while_it_runs() {
    let timer = Timer::new();
    let slot: Arc<Mutex<Option<tokio_purgatory::timer::TaskHandle>>> = Arc::new(Mutex::new(None));
    let s = slot.clone();
    let runs = Arc::new(Mutex::new(Vec::new()));
    let rn = runs.clone();
    let start = Instant::now();
    let t = timer
        .schedule_repeating(ms(10), move || {
            let g = s.lock().unwrap();
            let h = g.as_ref().unwrap();
            let reset = h.reset(ms(1));
            rn.lock()
                .unwrap()
                .push((start.elapsed(), reset, h.status()));
            Some(ms(10))
        })
        .unwrap();
    *slot.lock().unwrap() = Some(t);
    step(ms(25)).await;
    let runs = runs.lock().unwrap().clone();
    assert_eq!(
        runs,
        vec![
            (ms(10), false, TaskStatus::Done),
            (ms(20), false, TaskStatus::Done)
        ]
    );
    let g = slot.lock().unwrap();
    assert_eq!(g.as_ref().unwrap().status(), TaskStatus::Pending);
    assert!(g.as_ref().unwrap().cancel());
    assert_eq!(g.as_ref().unwrap().status(), TaskStatus::Cancelled);
}

/// Room under the limit given back every way.
#[tokio::test(start_paused = true)]
async fn room_given_back_every_way() {
    let timer = Timer::builder().max_pending(1).build().unwrap();
    let full = |t: &Timer| matches!(t.schedule(ms(1), || {}), Err(ScheduleError::AtCapacity(_)));
    // run
    timer.schedule(ms(1), || {}).unwrap();
    assert!(full(&timer));
    step(ms(2)).await;
    // cancel
    let h = timer.schedule(ms(100), || {}).unwrap();
    assert!(full(&timer));
    assert!(h.cancel());
    // cancel_and_take
    let h = timer.schedule(ms(100), || {}).unwrap();
    let _task = h.cancel_and_take().unwrap();
    // reset keeps room, then run
    let h = timer.schedule(ms(100), || {}).unwrap();
    assert!(h.reset(ms(1)));
    assert!(full(&timer));
    step(ms(2)).await;
    // sleep dropped
    let s = timer.sleep(ms(100));
    assert!(full(&timer));
    drop(s);
    // sleep fired
    timer.sleep(ms(1)).await.unwrap();
    // sleep fired but kept
    let mut s = timer.sleep(ms(1));
    (&mut s).await.unwrap();
    assert!(!full(&timer), "a fired sleep gave back its room");
    step(ms(2)).await;
    drop(s);
    // timeout future dropped
    let f = timer.timeout(ms(100), std::future::pending::<()>());
    assert!(full(&timer));
    drop(f);
    // timeout elapsed
    assert_eq!(
        timer.timeout(ms(1), std::future::pending::<()>()).await,
        Err(TimeoutError::Elapsed)
    );
    // async: cancelled, started
    let a = timer.schedule_async(ms(100), async {}).unwrap();
    assert!(full(&timer));
    assert!(a.cancel());
    let a = timer.schedule_async(ms(1), async {}).unwrap();
    step(ms(2)).await;
    assert!(a.is_finished());
    // repeating cancelled, ended
    let r = timer.schedule_repeating(ms(1), || Some(ms(1))).unwrap();
    step(ms(3)).await;
    assert!(full(&timer));
    assert!(r.cancel());
    let mut n = 0;
    timer
        .schedule_repeating(ms(1), move || {
            n += 1;
            (n < 3).then_some(ms(1))
        })
        .unwrap();
    step(ms(5)).await;
    // panicking repeating
    timer.schedule_repeating(ms(1), || panic!("boom")).unwrap();
    step(ms(2)).await;
    // panicking one-shot
    timer.schedule(ms(1), || panic!("boom")).unwrap();
    step(ms(2)).await;
    assert_eq!(timer.metrics().panicked, 2);
    // shutdown
    timer.schedule(ms(100), || {}).unwrap();
    assert!(full(&timer));
    assert_eq!(timer.len(), 1);
    let back = timer.shutdown();
    assert_eq!(back.len(), 1);
    assert_eq!(timer.metrics().pending, 0);
}

/// Deprecated aliases still name the same types.
#[tokio::test(start_paused = true)]
async fn aliases() {
    use tokio_purgatory::timer::{AsyncTimeout, Timeout, TimeoutStatus};
    let timer = Timer::new();
    let t: Timeout = timer.schedule(ms(1), || {}).unwrap();
    let a: AsyncTimeout = timer.schedule_async(ms(1), async {}).unwrap();
    assert_eq!(t.status(), TimeoutStatus::Pending);
    assert!(a.cancel());
}

/// Deadlines: zero, past, off-grid, far; never early.
#[tokio::test(start_paused = true)]
async fn deadlines_never_early_for_odd_ticks() {
    for tick in [
        Duration::from_nanos(1),
        Duration::from_nanos(7),
        Duration::from_micros(333),
        ms(3),
        ms(7),
        Duration::from_millis(1500),
    ] {
        let timer = Timer::builder()
            .tick(tick)
            .slots_per_level(3)
            .levels(3)
            .build()
            .unwrap();
        advance(Duration::from_nanos(12345)).await;
        let fired = Arc::new(Mutex::new(Vec::new()));
        let start = Instant::now();
        let mut want = Vec::new();
        for (i, d) in [
            0u64,
            1,
            999_999,
            1_000_001,
            2_999_999,
            10_000_007,
            123_456_789,
            4_500_000_001,
        ]
        .into_iter()
        .enumerate()
        {
            let d = Duration::from_nanos(d);
            let f = fired.clone();
            let at = start + d;
            want.push((i, at));
            timer
                .schedule_at(at, move || f.lock().unwrap().push((i, Instant::now())))
                .unwrap();
        }
        step(ms(6_010)).await;
        let fired = fired.lock().unwrap().clone();
        assert_eq!(fired.len(), want.len(), "tick {tick:?}");
        for (i, when) in fired {
            let at = want[i].1;
            assert!(when >= at, "tick {tick:?}: {i} early by {:?}", at - when);
        }
    }
}

/// Sleep deadline saturates; Duration::MAX timeout never fires, deadline reported.
#[tokio::test(start_paused = true)]
async fn far_deadlines() {
    let timer = Timer::new();
    let now = Instant::now();
    let s = timer.sleep(Duration::MAX);
    assert!(s.deadline() > now + Duration::from_secs(20 * 365 * 86400));
    let f = timer.timeout(Duration::MAX, std::future::pending::<()>());
    assert_eq!(f.deadline(), s.deadline());
    let h = timer.schedule(Duration::MAX, || panic!("never")).unwrap();
    step(ms(10)).await;
    assert!(h.is_pending());
    assert!(h.reset(Duration::ZERO));
    assert!(h.reset(Duration::MAX));
    assert!(h.cancel());
    drop((s, f));
    assert!(timer.is_empty());
}

/// "A zero delay runs the task on the reaper's next turn, never inline":
/// scheduled from inside a task, does it run in the same turn?
#[tokio::test(start_paused = true)]
async fn zero_delay_from_inside_a_task_runs_on_the_next_turn() {
    let timer = Timer::builder().shards(1).build().unwrap();
    let weak = timer.downgrade();
    let turns = Arc::new(Mutex::new(Vec::new()));
    let (t1, t2) = (turns.clone(), turns.clone());
    let w = weak.clone();
    timer
        .schedule(ms(10), move || {
            let t = w.upgrade().unwrap();
            t1.lock().unwrap().push(("a", t.metrics().reaper.turns));
            let t2 = t2.clone();
            let t_ = t.clone();
            t.schedule(Duration::ZERO, move || {
                t2.lock().unwrap().push(("b", t_.metrics().reaper.turns));
            })
            .unwrap();
        })
        .unwrap();
    step(ms(15)).await;
    let turns = turns.lock().unwrap().clone();
    assert_eq!(turns.len(), 2);
    assert!(
        turns[1].1 > turns[0].1,
        "zero-delay task ran in the same turn as its scheduler: {turns:?}"
    );
}

/// A self-rescheduling zero-delay repeating task: the reaper still yields.
#[tokio::test(start_paused = true)]
async fn zero_delay_repeating_task_does_not_starve() {
    let timer = Timer::builder().batch_size(8).build().unwrap();
    let n = Arc::new(AtomicUsize::new(0));
    let m = n.clone();
    let h = timer
        .schedule_repeating(Duration::ZERO, move || {
            m.fetch_add(1, Ordering::SeqCst);
            Some(Duration::ZERO)
        })
        .unwrap();
    for _ in 0..20 {
        tokio::task::yield_now().await;
    }
    let runs = n.load(Ordering::SeqCst);
    assert!(runs > 0);
    assert!(h.cancel());
    settle().await;
    let after = n.load(Ordering::SeqCst);
    settle().await;
    assert_eq!(after, n.load(Ordering::SeqCst));
    assert_eq!(timer.len(), 0);
}

/// Exactly once: tasks due in one turn cancel / reset each other.
#[tokio::test(start_paused = true)]
async fn tasks_in_one_turn_cancel_each_other_exactly_once() {
    for shards in [1, 4] {
        let timer = Timer::builder()
            .shards(shards)
            .batch_size(3)
            .build()
            .unwrap();
        const N: usize = 40;
        let handles: Arc<Mutex<Vec<Option<tokio_purgatory::timer::TaskHandle>>>> =
            Arc::new(Mutex::new((0..N).map(|_| None).collect()));
        let ran: Arc<Vec<AtomicUsize>> = Arc::new((0..N).map(|_| AtomicUsize::new(0)).collect());
        let cancelled: Arc<Vec<AtomicUsize>> =
            Arc::new((0..N).map(|_| AtomicUsize::new(0)).collect());
        let at = Instant::now() + ms(10);
        for i in 0..N {
            let (h, r, c) = (handles.clone(), ran.clone(), cancelled.clone());
            // Spread the schedules over threads so they land in various shards.
            let timer2 = timer.clone();
            let rt = tokio::runtime::Handle::current();
            let handle = std::thread::spawn(move || {
                // Inside the runtime, so that the thread reads its (paused)
                // clock.
                let _in = rt.enter();
                timer2
                    .schedule_at(at, move || {
                        r[i].fetch_add(1, Ordering::SeqCst);
                        let target = (i * 7 + 3) % N;
                        let g = h.lock().unwrap();
                        if let Some(t) = &g[target] {
                            if i % 2 == 0 {
                                if t.cancel() {
                                    c[target].fetch_add(1, Ordering::SeqCst);
                                }
                            } else if t.cancel_and_take().is_some() {
                                c[target].fetch_add(1, Ordering::SeqCst);
                            }
                        }
                    })
                    .unwrap()
            })
            .join()
            .unwrap();
            handles.lock().unwrap()[i] = Some(handle);
        }
        step(ms(12)).await;
        for i in 0..N {
            let (r, c) = (
                ran[i].load(Ordering::SeqCst),
                cancelled[i].load(Ordering::SeqCst),
            );
            assert_eq!(r + c, 1, "shards {shards}: task {i} ran {r} cancelled {c}");
            let st = handles.lock().unwrap()[i].as_ref().unwrap().status();
            let want = if c == 1 {
                TaskStatus::Cancelled
            } else {
                TaskStatus::Done
            };
            assert_eq!(st, want);
        }
        let m = timer.metrics();
        let total_ran: usize = ran.iter().map(|a| a.load(Ordering::SeqCst)).sum();
        assert_eq!(m.expired as usize, total_ran);
        assert_eq!(m.pending, 0);
    }
}

struct OnDrop(Option<Box<dyn FnOnce() + Send>>);
impl Drop for OnDrop {
    fn drop(&mut self) {
        if let Some(f) = self.0.take() {
            f()
        }
    }
}

/// An async future whose drop panics, cancelled before its deadline; and one
/// handed back by shutdown then cancelled, then run.
#[tokio::test(start_paused = true)]
async fn async_handle_hostile_drops_and_shutdown_states() {
    let timer = Timer::new();
    let guard = OnDrop(Some(Box::new(|| panic!("drop"))));
    let a = timer
        .schedule_async(ms(10), async move {
            let _g = guard;
        })
        .unwrap();
    assert!(a.cancel());
    assert_eq!(timer.metrics().panicked, 1, "contained and counted");
    assert!(a.is_finished() && !a.is_pending());
    assert!(!a.reset(ms(1)));
    assert!(!a.cancel());

    // Started, then cancelled while it waits inside.
    let started = Arc::new(AtomicUsize::new(0));
    let s = started.clone();
    let a = timer
        .schedule_async(ms(10), async move {
            s.fetch_add(1, Ordering::SeqCst);
            std::future::pending::<()>().await;
        })
        .unwrap();
    step(ms(12)).await;
    assert_eq!(started.load(Ordering::SeqCst), 1);
    assert!(!a.is_pending() && !a.is_finished());
    assert!(!a.reset(ms(10)), "started");
    assert!(a.cancel());
    settle().await;
    assert!(a.is_finished());
    assert!(!a.cancel());

    // Handed back, cancelled, then run: does not start.
    let ran = Arc::new(AtomicUsize::new(0));
    let r = ran.clone();
    let a = timer
        .schedule_async(ms(10), async move {
            r.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
    let back = timer.shutdown();
    assert_eq!(back.len(), 1);
    assert!(!a.is_pending() && !a.is_finished());
    assert!(a.cancel());
    assert!(a.is_finished());
    for t in back {
        t.run();
    }
    settle().await;
    assert_eq!(ran.load(Ordering::SeqCst), 0);
}

/// An async future handed back by shutdown and run starts; its handle says so.
#[tokio::test(start_paused = true)]
async fn async_handed_back_and_run() {
    let timer = Timer::new();
    let (tx, rx) = tokio::sync::oneshot::channel();
    let a = timer
        .schedule_async(ms(10), async move {
            let _ = tx.send(());
            std::future::pending::<()>().await;
        })
        .unwrap();
    for t in timer.shutdown() {
        t.run();
    }
    rx.await.unwrap();
    assert!(!a.is_finished() && !a.is_pending());
    assert!(a.cancel(), "running: aborted");
    settle().await;
    assert!(a.is_finished());
}

/// The reaper lost: every handle and future reads so.
#[test]
fn reaper_gone_everything_reads_it() {
    let rt = support::paused();
    let timer = rt.block_on(async { Timer::new() });
    let (t, r, a, s, f) = rt.block_on(async {
        (
            timer.schedule(ms(10), || {}).unwrap(),
            timer.schedule_repeating(ms(10), || Some(ms(1))).unwrap(),
            timer.schedule_async(ms(10), async {}).unwrap(),
            timer.sleep(ms(10)),
            timer.timeout(ms(10), std::future::pending::<()>()),
        )
    });
    drop(rt);
    assert!(timer.is_shutdown());
    assert_eq!(t.status(), TaskStatus::Done);
    assert_eq!(r.status(), TaskStatus::Done);
    assert!(!t.cancel() && !r.cancel() && !t.reset(ms(1)) && !r.reset(ms(1)));
    assert!(a.is_finished());
    let rt2 = support::paused();
    rt2.block_on(async {
        assert_eq!(s.await, Err(TimerError::ReaperGone));
        assert_eq!(f.await, Err(TimeoutError::Timer(TimerError::ReaperGone)));
        assert!(matches!(
            timer.schedule(ms(1), || {}),
            Err(ScheduleError::ReaperGone(_))
        ));
        assert_eq!(timer.sleep(ms(1)).await, Err(TimerError::ReaperGone));
        assert!(timer.shutdown().is_empty());
    });
    assert_eq!(timer.len(), 0);
}

/// Cancel from a task's Drop re-entering (cancels another, schedules, shuts down).
#[tokio::test(start_paused = true)]
async fn a_cancelled_tasks_drop_reenters_everything() {
    let timer = Timer::builder().max_pending(4).build().unwrap();
    let other = Arc::new(
        timer
            .schedule(ms(50), || panic!("cancelled by a drop"))
            .unwrap(),
    );
    let o = other.clone();
    let w = timer.downgrade();
    let log = Arc::new(Mutex::new(Vec::new()));
    let l = log.clone();
    let g = OnDrop(Some(Box::new(move || {
        let t = w.upgrade().unwrap();
        l.lock()
            .unwrap()
            .push(format!("cancel other {}", o.cancel()));
        l.lock().unwrap().push(format!("len {}", t.len()));
        l.lock()
            .unwrap()
            .push(format!("schedule {}", t.schedule(ms(1), || {}).is_ok()));
        l.lock()
            .unwrap()
            .push(format!("shutdown {}", t.shutdown().len()));
        panic!("and then panics");
    })));
    let h = timer
        .schedule(ms(20), move || {
            let _g = g;
        })
        .unwrap();
    assert!(h.cancel());
    assert_eq!(
        *log.lock().unwrap(),
        vec!["cancel other true", "len 0", "schedule true", "shutdown 1"]
    );
    assert_eq!(timer.metrics().panicked, 1);
    assert_eq!(timer.metrics().pending, 0);
    assert_eq!(h.status(), TaskStatus::Cancelled);
    assert_eq!(other.status(), TaskStatus::Cancelled);
}

/// Timeout futures: inner polled first, errors sticky, deadline accessor.
#[tokio::test(start_paused = true)]
async fn timeout_future_edges() {
    let timer = Timer::builder().max_pending(1).build().unwrap();
    let _held = timer.sleep(ms(100));
    // At capacity: an immediately ready future wins; a pending one fails now.
    assert_eq!(timer.timeout(ms(1), async { 1 }).await, Ok(1));
    let start = Instant::now();
    assert_eq!(
        timer.timeout(ms(1), std::future::pending::<()>()).await,
        Err(TimeoutError::Timer(TimerError::AtCapacity))
    );
    assert_eq!(start.elapsed(), Duration::ZERO);
    drop(_held);
    // Past deadline: still polls inner first.
    let past = Instant::now() - ms(1);
    assert_eq!(timer.timeout_at(past, async { 2 }).await, Ok(2));
    let start = Instant::now();
    let mut f = Box::pin(timer.timeout_at(past, std::future::pending::<()>()));
    assert_eq!(f.as_mut().await, Err(TimeoutError::Elapsed));
    assert!(start.elapsed() < ms(3));
    assert_eq!(f.as_mut().await, Err(TimeoutError::Elapsed), "sticky");
    drop(f);
    assert!(timer.is_empty());
}

/// A sleep polled by a waker that panics on clone: the panic reaches the
/// poller (user code) but the sleep still works afterwards.
#[tokio::test(start_paused = true)]
async fn sleep_deadline_and_is_elapsed_states() {
    let timer = Timer::new();
    let mut s = timer.sleep(ms(10));
    assert!(!s.is_elapsed());
    step(ms(12)).await;
    assert!(s.is_elapsed(), "fired, not yet polled");
    assert_eq!((&mut s).await, Ok(()));
    assert_eq!((&mut s).await, Ok(()), "polled again after Ready");
    let mut s = timer.sleep(ms(10));
    drop(timer.shutdown());
    assert!(s.is_elapsed());
    assert_eq!((&mut s).await, Err(TimerError::Shutdown));
}

/// Built on the handle of a runtime that has already shut down: the reaper
/// can never run; scheduling must say so rather than accept work that never runs.
#[test]
fn built_on_a_dead_runtime() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let h = rt.handle().clone();
    drop(rt);
    match Timer::builder().build_on(&h) {
        Err(e) => panic!("built: {e}"),
        Ok(timer) => {
            let r = timer.schedule(ms(1), || {});
            assert!(
                matches!(r, Err(ScheduleError::ReaperGone(_))),
                "accepted on a timer whose reaper can never run: {r:?}, shut {}",
                timer.is_shutdown()
            );
        }
    }
}

/// schedule_async refused at capacity hands back the very future, not dropped.
#[tokio::test(start_paused = true)]
async fn schedule_async_refusal_hands_back_the_future() {
    let timer = Timer::builder().max_pending(1).build().unwrap();
    let _h = timer.schedule(ms(100), || {}).unwrap();
    let marker = Arc::new(());
    let m = marker.clone();
    let fut = async move {
        let _m = m;
    };
    let e = timer.schedule_async(ms(1), fut).unwrap_err();
    assert!(matches!(e, ScheduleError::AtCapacity(_)));
    assert_eq!(Arc::strong_count(&marker), 2);
    e.into_inner().await;
    assert_eq!(Arc::strong_count(&marker), 1);
    let m = marker.clone();
    let e = timer
        .schedule_repeating(ms(1), move || {
            let _ = &m;
            None
        })
        .unwrap_err();
    assert_eq!(Arc::strong_count(&marker), 2);
    drop(e);
    assert_eq!(Arc::strong_count(&marker), 1);
}

/// A future that is ready at once (counting its polls in the second
/// field), holding `OnDrop` until it is dropped.
struct ReadyHolding(#[allow(dead_code)] OnDrop, Arc<AtomicUsize>);
impl std::future::Future for ReadyHolding {
    type Output = ();
    fn poll(self: std::pin::Pin<&mut Self>, _: &mut std::task::Context<'_>) -> std::task::Poll<()> {
        self.1.fetch_add(1, Ordering::SeqCst);
        std::task::Poll::Ready(())
    }
}

/// An async task has finished once its future returned `Ready`: from then
/// on `cancel` says `false` and `is_finished` says `true`, even while the
/// future is still being dropped (here, read from that drop).
#[tokio::test(start_paused = true)]
async fn an_async_task_that_returned_ready_is_finished_before_its_drop() {
    let timer = Timer::new();
    let handle: Arc<std::sync::OnceLock<tokio_purgatory::AsyncTaskHandle>> = Arc::default();
    let seen: Arc<Mutex<Option<(bool, bool)>>> = Arc::default();
    let (h, s) = (handle.clone(), seen.clone());
    let guard = OnDrop(Some(Box::new(move || {
        let h = h.get().expect("scheduled");
        *s.lock().unwrap() = Some((h.is_finished(), h.cancel()));
    })));
    let ran = Arc::new(AtomicUsize::new(0));
    let r = ran.clone();
    let t = timer.schedule_async(ms(1), ReadyHolding(guard, r)).unwrap();
    assert!(handle.set(t).is_ok());
    advance(ms(2)).await;
    settle().await;
    assert_eq!(ran.load(Ordering::SeqCst), 1);
    assert_eq!(
        *seen.lock().unwrap(),
        Some((true, false)),
        "(is_finished, cancel) read from the future's drop after it returned"
    );
    let h = handle.get().unwrap();
    assert!(h.is_finished() && !h.cancel() && !h.is_pending());
}

/// Cancelled in the reaper's turn that starts it (by another task due at
/// the same time, which may run before or after the start), an async task
/// never starts: `cancel` says `true`, the future is dropped unpolled, and
/// the handle reads finished. A future that panics reads finished too, and
/// cannot be cancelled after.
#[tokio::test(start_paused = true)]
async fn an_async_task_cancelled_in_the_turn_that_starts_it_never_starts() {
    let timer = Timer::new();
    let ran = Arc::new(AtomicUsize::new(0));
    let dropped = Arc::new(AtomicUsize::new(0));
    let (r, d) = (ran.clone(), dropped.clone());
    let guard = OnDrop(Some(Box::new(move || {
        d.fetch_add(1, Ordering::SeqCst);
    })));
    let handle: Arc<std::sync::OnceLock<tokio_purgatory::AsyncTaskHandle>> = Arc::default();
    let said: Arc<Mutex<Option<bool>>> = Arc::default();
    let (h, s) = (handle.clone(), said.clone());
    timer
        .schedule(ms(1), move || {
            *s.lock().unwrap() = Some(h.get().expect("scheduled").cancel());
        })
        .unwrap();
    let t = timer
        .schedule_async(ms(1), async move {
            let _guard = &guard;
            r.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
    assert!(handle.set(t).is_ok());
    advance(ms(2)).await;
    settle().await;
    assert_eq!(
        *said.lock().unwrap(),
        Some(true),
        "cancelled before it started"
    );
    assert_eq!(ran.load(Ordering::SeqCst), 0, "never polled");
    assert_eq!(dropped.load(Ordering::SeqCst), 1, "dropped unpolled, once");
    let t = handle.get().unwrap();
    assert!(t.is_finished() && !t.cancel() && !t.is_pending());

    let p = timer
        .schedule_async(ms(1), async { panic!("an async task panics") })
        .unwrap();
    advance(ms(2)).await;
    settle().await;
    assert!(p.is_finished(), "a panic ends it");
    assert!(!p.cancel());
}

/// `TimeoutFuture::into_inner`: "The inner future, giving up the deadline".
/// The deadline leaves the timer at once (its room under `max_pending` free
/// for the next task), and never fires or counts as an expiry afterwards,
/// though the inner future is still pending.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn into_inner_gives_the_deadline_and_its_room_back() {
    let timer = Timer::builder().max_pending(1).build().unwrap();
    let t = timer.timeout(ms(100), std::future::pending::<()>());
    let inner = t.into_inner();
    assert_eq!(timer.len(), 0, "the deadline left with into_inner");
    let ran = Arc::new(AtomicUsize::new(0));
    let r = ran.clone();
    let task = timer
        .schedule(ms(300), move || {
            r.fetch_add(1, Ordering::SeqCst);
        })
        .map_err(|e| e.to_string())
        .expect("room for one task after the deadline was given up");
    step(ms(200)).await;
    let m = timer.metrics();
    assert_eq!((m.expired, m.pending), (0, 1), "{m:?}");
    assert_eq!(timer.lateness().count(), 0);
    step(ms(150)).await;
    assert_eq!(ran.load(Ordering::SeqCst), 1);
    assert_eq!(timer.metrics().expired, 1);
    drop((inner, task));
}
