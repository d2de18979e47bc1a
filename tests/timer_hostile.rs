//! A hostile user of the standalone `Timer`: wakers, tasks and futures whose
//! `clone`, `wake`, `poll` or `Drop` panic or call back into the timer (from
//! the reaper, from a cancel, from a shutdown, from the last clone dropped),
//! async tasks cancelling themselves or handed back and run on another
//! runtime, runtimes dropped under the timer, and cancel, reset and shutdown
//! racing the reaper on real threads, each race bounded so that a deadlock
//! fails instead of hanging.

use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use tokio::time::advance;
use tokio_purgatory::timer::{TaskStatus, TimeoutError, TimerError};
use tokio_purgatory::{AsyncTaskHandle, Reaper, ScheduleError, TaskHandle, Timer};

mod support;
use support::{ms, multi, paused_within, settle, within};

/// A waker whose wake runs a hook (given once).
struct HookWaker {
    on_wake: Mutex<Option<Box<dyn FnOnce() + Send>>>,
    woken: AtomicUsize,
}
impl Wake for HookWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref()
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.fetch_add(1, Ordering::SeqCst);
        let hook = self.on_wake.lock().unwrap().take();
        if let Some(h) = hook {
            h();
        }
    }
}
fn hook_waker(h: impl FnOnce() + Send + 'static) -> (Arc<HookWaker>, Waker) {
    let w = Arc::new(HookWaker {
        on_wake: Mutex::new(Some(Box::new(h))),
        woken: AtomicUsize::new(0),
    });
    (w.clone(), Waker::from(w))
}

struct OnDrop(Option<Box<dyn FnOnce() + Send>>);
impl Drop for OnDrop {
    fn drop(&mut self) {
        if let Some(f) = self.0.take() {
            f()
        }
    }
}
fn on_drop(f: impl FnOnce() + Send + 'static) -> OnDrop {
    OnDrop(Some(Box::new(f)))
}

// ---------------------------------------------------------------------------
// 2. Wakers that call back in from the reaper's fire.

/// A sleep's waker drops the last Timer clone when the reaper wakes it: the
/// other pending tasks are dropped (contained), nothing deadlocks.
#[test]
fn a_sleep_waker_dropping_the_last_timer_from_the_reaper() {
    paused_within(10, || async {
        let timer = Timer::new();
        let weak = timer.downgrade();
        let dropped = Arc::new(AtomicUsize::new(0));
        // A pending task whose drop upgrades the weak timer (gone by then).
        let d = dropped.clone();
        let w2 = weak.clone();
        let guard = on_drop(move || {
            assert!(w2.upgrade().is_none());
            d.fetch_add(1, Ordering::SeqCst);
        });
        timer
            .schedule(ms(1000), move || {
                let _g = &guard;
            })
            .unwrap();
        let slot = Arc::new(Mutex::new(Some(timer)));
        let s = slot.clone();
        let sleep = slot.lock().unwrap().as_ref().unwrap().sleep(ms(10));
        let mut sleep = Box::pin(sleep);
        let (hw, waker) = hook_waker(move || {
            let t = s.lock().unwrap().take();
            drop(t); // the last Timer clone, dropped on the reaper
        });
        let mut cx = Context::from_waker(&waker);
        assert!(sleep.as_mut().poll(&mut cx).is_pending());
        advance(ms(20)).await;
        settle().await;
        assert_eq!(hw.woken.load(Ordering::SeqCst), 1);
        assert!(weak.upgrade().is_none());
        assert_eq!(
            dropped.load(Ordering::SeqCst),
            1,
            "the other task was dropped"
        );
        assert_eq!(sleep.as_mut().poll(&mut cx), Poll::Ready(Ok(())));
    });
}

/// A sleep's waker calls `shutdown()` (and schedules, refused) when the reaper
/// wakes it; a task due in the same turn still runs; the pending one is handed back.
#[test]
fn a_sleep_waker_shutting_the_timer_down_from_the_reaper() {
    paused_within(10, || async {
        let timer = Timer::new();
        let handed = Arc::new(Mutex::new(Vec::new()));
        let refused = Arc::new(AtomicBool::new(false));
        let t2 = timer.clone();
        let h2 = handed.clone();
        let r2 = refused.clone();
        let mut sleep = Box::pin(timer.sleep(ms(10)));
        let (_hw, waker) = hook_waker(move || {
            let unrun = t2.shutdown();
            h2.lock().unwrap().extend(unrun);
            let e = t2.schedule(ms(1), || {}).unwrap_err();
            r2.store(matches!(e.kind(), TimerError::Shutdown), Ordering::SeqCst);
            // The task comes back in the error.
            let _task: fn() = e.into_inner();
        });
        let mut cx = Context::from_waker(&waker);
        assert!(sleep.as_mut().poll(&mut cx).is_pending());
        let ran = Arc::new(AtomicUsize::new(0));
        let r = ran.clone();
        timer
            .schedule(ms(1000), move || {
                r.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap();
        advance(ms(20)).await;
        settle().await;
        assert!(timer.is_shutdown());
        assert!(refused.load(Ordering::SeqCst));
        let unrun: Vec<_> = std::mem::take(&mut *handed.lock().unwrap());
        assert_eq!(unrun.len(), 1);
        for t in unrun {
            t.run();
        }
        assert_eq!(ran.load(Ordering::SeqCst), 1);
        assert_eq!(timer.metrics().panicked, 0);
    });
}

// ---------------------------------------------------------------------------
// 3. Task drops that call back into the timer, from every place a task is dropped.

/// A task's Drop cancels its own handle, resets it, schedules, and reads metrics,
/// when it is dropped by `cancel` on the caller's thread.
#[tokio::test(start_paused = true)]
async fn a_task_drop_reentering_from_cancel() {
    let timer = Timer::new();
    let me: Arc<OnceLock<tokio_purgatory::TaskHandle>> = Arc::new(OnceLock::new());
    let m = me.clone();
    let t = timer.clone();
    let scheduled = Arc::new(AtomicBool::new(false));
    let s = scheduled.clone();
    let g = on_drop(move || {
        let h = m.get().unwrap();
        assert!(!h.cancel(), "already cancelled");
        assert!(!h.reset(ms(5)));
        assert!(h.cancel_and_take().is_none());
        let _ = t.metrics();
        t.schedule(ms(5), move || s.store(true, Ordering::SeqCst))
            .unwrap();
    });
    let h = timer
        .schedule(ms(100), move || {
            let _g = &g;
            unreachable!()
        })
        .unwrap();
    let _ = me.set(h);
    let ok = within(5, {
        let me = me.clone();
        move || me.get().unwrap().cancel()
    });
    assert!(ok);
    advance(ms(10)).await;
    settle().await;
    assert!(scheduled.load(Ordering::SeqCst));
    assert_eq!(me.get().unwrap().status(), TaskStatus::Cancelled);
}

/// A repeating task's run drops the last Timer clone (it held it in an
/// Option), then asks for another run: no deadlock, no panic; the chain ends.
#[test]
fn a_repeating_task_dropping_the_last_timer_during_its_run() {
    paused_within(10, || async {
        let timer = Timer::new();
        let weak = timer.downgrade();
        let slot = Arc::new(Mutex::new(Some(timer.clone())));
        let s = slot.clone();
        let runs = Arc::new(AtomicUsize::new(0));
        let r = runs.clone();
        let other_dropped = Arc::new(AtomicBool::new(false));
        let od = other_dropped.clone();
        let g = on_drop(move || od.store(true, Ordering::SeqCst));
        timer
            .schedule(ms(1000), move || {
                let _g = &g;
            })
            .unwrap();
        let h = timer
            .schedule_repeating(ms(10), move || {
                r.fetch_add(1, Ordering::SeqCst);
                drop(s.lock().unwrap().take());
                Some(ms(10))
            })
            .unwrap();
        drop(timer);
        advance(ms(15)).await;
        settle().await;
        advance(ms(100)).await;
        settle().await;
        assert!(weak.upgrade().is_none());
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        assert!(other_dropped.load(Ordering::SeqCst));
        assert!(!h.cancel());
        assert_eq!(h.status(), TaskStatus::Done);
    });
}

/// A task that drops the last `Timer` clone while other tasks, a repeating
/// task, async tasks and a sleep are due in the same turn: every task's
/// captures are dropped, no handle is left pending, the async tasks finish,
/// the sleep resolves and the repeating task runs no more.
#[tokio::test(start_paused = true)]
async fn the_last_clone_dropped_by_a_task_with_more_due_in_its_turn() {
    let timer = Timer::new();
    let weak = timer.downgrade();
    let slot: Arc<Mutex<Option<Timer>>> = Arc::new(Mutex::new(Some(timer.clone())));
    let ran = Arc::new(AtomicUsize::new(0));
    let dropped = Arc::new(AtomicUsize::new(0));
    let mut handles = Vec::new();
    let s = slot.clone();
    handles.push(
        timer
            .schedule(ms(10), move || {
                s.lock().unwrap().take();
            })
            .unwrap(),
    );
    for _ in 0..50 {
        let (r, d) = (ran.clone(), dropped.clone());
        let guard = on_drop(move || {
            d.fetch_add(1, Ordering::SeqCst);
        });
        handles.push(
            timer
                .schedule(ms(10), move || {
                    let _g = &guard;
                    r.fetch_add(1, Ordering::SeqCst);
                })
                .unwrap(),
        );
    }
    let r = ran.clone();
    let repeating = timer
        .schedule_repeating(ms(10), move || {
            r.fetch_add(1000, Ordering::SeqCst);
            Some(ms(1))
        })
        .unwrap();
    let asyncs: Vec<_> = (0..5)
        .map(|_| timer.schedule_async(ms(10), async {}).unwrap())
        .collect();
    let sleep = timer.sleep(ms(10));
    drop(timer);
    advance(ms(20)).await;
    settle().await;
    assert!(weak.upgrade().is_none());
    let r = ran.load(Ordering::SeqCst);
    let d = dropped.load(Ordering::SeqCst);
    assert_eq!(d, 50, "every task's captures dropped ({r} ran)");
    for h in &handles {
        assert_ne!(h.status(), TaskStatus::Pending);
    }
    assert_ne!(repeating.status(), TaskStatus::Pending);
    for a in &asyncs {
        assert!(!a.is_pending(), "{a:?}");
    }
    settle().await;
    for a in &asyncs {
        assert!(a.is_finished(), "{a:?}");
    }
    // It resolves, whichever way.
    let _ = tokio::time::timeout(ms(100), sleep)
        .await
        .expect("the sleep resolves");
    advance(ms(100)).await;
    settle().await;
    let after = ran.load(Ordering::SeqCst);
    assert!(after - r < 1000, "the repeating task ran no more");
}

/// Tasks whose captures' `Drop` calls back in (upgrading the closing timer,
/// scheduling on another timer, some panicking) when the last clone goes and
/// they are dropped unrun: each schedules on the other timer, whose tasks
/// then run.
#[tokio::test(start_paused = true)]
async fn tasks_dropped_unrun_with_the_last_clone_call_back_in_from_drop() {
    let timer = Timer::new();
    let weak = timer.downgrade();
    let other = Timer::new();
    let refused = Arc::new(AtomicUsize::new(0));
    let other_handles: Arc<Mutex<Vec<TaskHandle>>> = Arc::default();
    for i in 0..20 {
        let (w, o, rf, oh) = (
            weak.clone(),
            other.clone(),
            refused.clone(),
            other_handles.clone(),
        );
        let g = on_drop(move || {
            // The timer is closing: the upgrade fails or the schedule is
            // refused.
            if let Some(t) = w.upgrade() {
                if t.schedule(ms(1), || {}).is_err() {
                    rf.fetch_add(1, Ordering::SeqCst);
                }
                let _ = t.shutdown();
            }
            oh.lock().unwrap().push(o.schedule(ms(5), || {}).unwrap());
            if i % 3 == 0 {
                panic!("hostile drop");
            }
        });
        timer
            .schedule(ms(100), move || {
                let _g = &g;
            })
            .unwrap();
    }
    drop(timer);
    assert!(weak.upgrade().is_none());
    assert_eq!(other_handles.lock().unwrap().len(), 20);
    advance(ms(10)).await;
    settle().await;
    assert_eq!(other.metrics().expired, 20);
}

/// A repeating task whose captures' `Drop`, run when its chain ends by
/// returning `None`, schedules (accepted) and shuts the timer down, handing
/// back itself and the other pending task.
#[tokio::test(start_paused = true)]
async fn a_repeating_chain_ended_by_none_whose_drop_schedules_and_shuts_down() {
    let timer = Timer::new();
    let weak = timer.downgrade();
    let got = Arc::new(Mutex::new(None));
    let (g, w) = (got.clone(), weak.clone());
    let guard = on_drop(move || {
        let t = w.upgrade().unwrap();
        let r = t.schedule(ms(1), || {});
        let back = t.shutdown();
        *g.lock().unwrap() = Some((r.is_ok(), back.len()));
    });
    let mut n = 0;
    let h = timer
        .schedule_repeating(ms(5), move || {
            let _g = &guard;
            n += 1;
            (n < 3).then_some(ms(5))
        })
        .unwrap();
    let other = timer.schedule(Duration::from_secs(60), || {}).unwrap();
    for _ in 0..30 {
        advance(ms(1)).await;
        settle().await;
    }
    assert_eq!(*got.lock().unwrap(), Some((true, 2)));
    assert_eq!(h.status(), TaskStatus::Done);
    assert_eq!(other.status(), TaskStatus::Done);
    assert!(timer.is_shutdown());
}

// ---------------------------------------------------------------------------
// 4. Timeouts wrapping hostile futures.

struct PanicInPoll;
impl std::future::Future for PanicInPoll {
    type Output = ();
    fn poll(self: std::pin::Pin<&mut Self>, _: &mut Context<'_>) -> Poll<()> {
        panic!("poll")
    }
}

struct PanicOnDropPending(bool);
impl std::future::Future for PanicOnDropPending {
    type Output = ();
    fn poll(self: std::pin::Pin<&mut Self>, _: &mut Context<'_>) -> Poll<()> {
        Poll::Pending
    }
}
impl Drop for PanicOnDropPending {
    fn drop(&mut self) {
        if self.0 {
            panic!("inner drop")
        }
    }
}

#[tokio::test(start_paused = true)]
async fn timeouts_around_panicking_futures_leave_no_entry() {
    let timer = Timer::new();
    let t = timer.clone();
    let r = catch_unwind(AssertUnwindSafe(move || {
        let mut f = Box::pin(t.timeout(ms(100), PanicInPoll));
        let w = futures::task::noop_waker();
        let _ = f.as_mut().poll(&mut Context::from_waker(&w));
    }));
    assert!(r.is_err(), "the user's own poll panics to the user");
    assert_eq!(timer.len(), 0, "the deadline left the wheel");

    let t = timer.clone();
    let r = catch_unwind(AssertUnwindSafe(move || {
        let mut f = Box::pin(t.timeout(ms(100), PanicOnDropPending(true)));
        let w = futures::task::noop_waker();
        assert!(f.as_mut().poll(&mut Context::from_waker(&w)).is_pending());
        drop(f);
    }));
    assert!(r.is_err(), "the user's own drop panics to the user");
    assert_eq!(timer.len(), 0, "the deadline left the wheel");

    // Elapsed, then shutdown: errors as documented.
    let f = timer.timeout(ms(10), PanicOnDropPending(false));
    assert_eq!(f.await, Err(TimeoutError::Elapsed));
    let f = timer.timeout(ms(10), PanicOnDropPending(false));
    drop(timer.shutdown());
    assert_eq!(f.await, Err(TimeoutError::Timer(TimerError::Shutdown)));
}

// ---------------------------------------------------------------------------
// 5. schedule_async futures whose Drop re-enters their own handle.

#[tokio::test(start_paused = true)]
async fn async_future_drop_reentering_its_handle_everywhere() {
    // (a) dropped by cancel
    let timer = Timer::new();
    let me: Arc<OnceLock<tokio_purgatory::AsyncTaskHandle>> = Arc::new(OnceLock::new());
    let m = me.clone();
    let g = on_drop(move || {
        let h = m.get().unwrap();
        assert!(!h.cancel());
        assert!(h.is_finished());
        assert!(!h.reset(ms(1)));
        assert!(!h.is_pending());
    });
    let h = timer
        .schedule_async(ms(100), async move {
            let _g = &g;
        })
        .unwrap();
    let _ = me.set(h);
    let ok = within(5, {
        let me = me.clone();
        move || me.get().unwrap().cancel()
    });
    assert!(ok);

    // (b) dropped by Owner::drop (last Timer dropped)
    let timer = Timer::new();
    let me: Arc<OnceLock<tokio_purgatory::AsyncTaskHandle>> = Arc::new(OnceLock::new());
    let m = me.clone();
    let seen = Arc::new(AtomicBool::new(false));
    let s2 = seen.clone();
    let g = on_drop(move || {
        let h = m.get().unwrap();
        let _ = h.is_finished();
        let _ = h.is_pending();
        let _ = h.cancel();
        s2.store(true, Ordering::SeqCst);
    });
    let h = timer
        .schedule_async(ms(100), async move {
            let _g = &g;
        })
        .unwrap();
    let _ = me.set(h);
    within(5, move || drop(timer));
    assert!(seen.load(Ordering::SeqCst));
    assert!(me.get().unwrap().is_finished());

    // (c) handed back by shutdown and dropped
    let timer = Timer::new();
    let me: Arc<OnceLock<tokio_purgatory::AsyncTaskHandle>> = Arc::new(OnceLock::new());
    let m = me.clone();
    let g = on_drop(move || {
        let h = m.get().unwrap();
        let _ = h.is_finished();
        let _ = h.cancel();
    });
    let h = timer
        .schedule_async(ms(100), async move {
            let _g = &g;
        })
        .unwrap();
    let _ = me.set(h);
    let unrun = timer.shutdown();
    assert_eq!(unrun.len(), 1);
    within(5, move || drop(unrun));
    assert!(me.get().unwrap().is_finished());

    // (d) cancelled, then its handed-back task run: the future is dropped in
    // `start`, whose Drop re-enters.
    let timer = Timer::new();
    let me: Arc<OnceLock<tokio_purgatory::AsyncTaskHandle>> = Arc::new(OnceLock::new());
    let m = me.clone();
    let polled = Arc::new(AtomicBool::new(false));
    let p2 = polled.clone();
    let g = on_drop(move || {
        let h = m.get().unwrap();
        let _ = h.is_finished();
        let _ = h.cancel();
    });
    let h = timer
        .schedule_async(ms(100), async move {
            let _g = &g;
            p2.store(true, Ordering::SeqCst);
        })
        .unwrap();
    let _ = me.set(h);
    let unrun = timer.shutdown();
    assert!(me.get().unwrap().cancel(), "cancelled before it starts");
    within(5, move || {
        for t in unrun {
            t.run()
        }
    });
    settle().await;
    assert!(
        !polled.load(Ordering::SeqCst),
        "a cancelled future never starts"
    );
}

/// An async task that cancels itself while it runs stops at its next await;
/// one whose future panics finishes. Neither can be cancelled after.
#[tokio::test(start_paused = true)]
async fn an_async_task_cancelling_itself_and_one_panicking_both_finish() {
    let timer = Timer::new();
    let me: Arc<OnceLock<AsyncTaskHandle>> = Arc::default();
    let m = me.clone();
    let reached = Arc::new(AtomicBool::new(false));
    let r = reached.clone();
    let h = timer
        .schedule_async(ms(5), async move {
            assert!(m.get().unwrap().cancel());
            tokio::task::yield_now().await;
            r.store(true, Ordering::SeqCst);
        })
        .unwrap();
    me.set(h).ok().unwrap();
    let p = timer
        .schedule_async(ms(5), async { panic!("async task panics") })
        .unwrap();
    advance(ms(10)).await;
    settle().await;
    assert!(!reached.load(Ordering::SeqCst));
    let h = me.get().unwrap();
    assert!(h.is_finished());
    assert!(!h.cancel());
    assert!(p.is_finished());
    assert!(!p.cancel());
    assert!(!p.is_pending());
}

// ---------------------------------------------------------------------------
// 6. Async task handed back, its runtime gone, run elsewhere.

#[test]
fn async_task_handed_back_run_after_its_runtime_died() {
    within(10, || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let timer = rt.block_on(async { Timer::new() });
        let polled = Arc::new(AtomicBool::new(false));
        let p = polled.clone();
        let dropped = Arc::new(AtomicBool::new(false));
        let d = dropped.clone();
        let g = on_drop(move || d.store(true, Ordering::SeqCst));
        let h = rt
            .block_on(async {
                timer.schedule_async(Duration::from_secs(60), async move {
                    let _g = &g;
                    p.store(true, Ordering::SeqCst);
                })
            })
            .unwrap();
        let unrun = timer.shutdown();
        drop(rt);
        for t in unrun {
            t.run(); // outside any runtime; its runtime is gone
        }
        assert!(!polled.load(Ordering::SeqCst));
        assert!(dropped.load(Ordering::SeqCst), "dropped unrun");
        assert!(h.is_finished(), "its handle reads finished");
    });
}

/// Async tasks handed back by a shutdown, their runtime then dropped: one
/// cancelled reads finished; the first two handed back run on another
/// runtime and the last is dropped, after which every handle reads finished
/// and none can be reset.
#[test]
fn handed_back_async_tasks_run_on_another_runtime_after_theirs_is_gone() {
    within(30, || {
        let rt = support::paused();
        let (timer, a, b, c) = rt.block_on(async {
            let timer = Timer::new();
            let a = timer.schedule_async(ms(100), async {}).unwrap();
            let b = timer.schedule_async(ms(100), async {}).unwrap();
            let c = timer.schedule_async(ms(100), async {}).unwrap();
            (timer, a, b, c)
        });
        let mut back = timer.shutdown();
        assert_eq!(back.len(), 3);
        drop(rt);
        assert!(!a.is_pending() && !a.is_finished());
        assert!(c.cancel());
        assert!(c.is_finished());
        let other = multi();
        let handles = [&a, &b, &c];
        other.block_on(async move {
            for t in back.drain(..2) {
                t.run();
            }
            drop(back);
            tokio::time::timeout(Duration::from_secs(5), async {
                while !handles.iter().all(|h| h.is_finished()) {
                    tokio::task::yield_now().await;
                }
            })
            .await
            .expect("every handle finishes");
        });
        assert!(a.is_finished() || b.is_finished());
        assert!(a.is_finished() && b.is_finished() && c.is_finished());
        assert!(!a.reset(ms(1)));
    });
}

// ---------------------------------------------------------------------------
// 7. Races on a multi-thread runtime (real time, bounded).

/// Cancels racing the deadline, from other threads: each task either runs
/// (cancel false) or is cancelled (cancel true), never both, never neither.
#[test]
fn cancel_racing_the_deadline_is_exactly_once() {
    within(60, || {
        let rt = multi();
        rt.block_on(async {
            let timer = Timer::new();
            for round in 0..200 {
                let n = 64;
                let runs: Arc<Vec<AtomicUsize>> =
                    Arc::new((0..n).map(|_| AtomicUsize::new(0)).collect());
                let drops: Arc<Vec<AtomicUsize>> =
                    Arc::new((0..n).map(|_| AtomicUsize::new(0)).collect());
                let mut handles = Vec::new();
                for i in 0..n {
                    let r = runs.clone();
                    let d = drops.clone();
                    let g = on_drop(move || {
                        d[i].fetch_add(1, Ordering::SeqCst);
                    });
                    handles.push(
                        timer
                            .schedule(Duration::ZERO, move || {
                                let _g = &g;
                                r[i].fetch_add(1, Ordering::SeqCst);
                            })
                            .unwrap(),
                    );
                }
                let handles = Arc::new(handles);
                let h2 = handles.clone();
                let cancels = tokio::task::spawn_blocking(move || {
                    h2.iter().map(|h| h.cancel()).collect::<Vec<_>>()
                })
                .await
                .unwrap();
                tokio::time::timeout(Duration::from_secs(5), timer.sleep(ms(2)))
                    .await
                    .expect("the reaper goes on")
                    .unwrap();
                for i in 0..n {
                    let ran = runs[i].load(Ordering::SeqCst);
                    let dropped = drops[i].load(Ordering::SeqCst);
                    assert_eq!(dropped, 1, "round {round} task {i}: dropped once");
                    assert!(
                        (ran == 1) != cancels[i],
                        "round {round} task {i}: ran {ran} times, cancel said {}",
                        cancels[i]
                    );
                    let st = handles[i].status();
                    assert_eq!(
                        st == TaskStatus::Cancelled,
                        cancels[i],
                        "round {round} task {i}: {st:?}"
                    );
                }
                assert_eq!(timer.len(), 0);
            }
            assert_eq!(timer.metrics().panicked, 0);
        });
    });
}

/// Resets racing the deadline: every task runs exactly once, at the old
/// deadline (reset false) or the new one (reset true).
#[test]
fn reset_racing_the_deadline_runs_exactly_once() {
    within(60, || {
        let rt = multi();
        rt.block_on(async {
            let timer = Timer::new();
            for round in 0..200 {
                let n = 64;
                let runs: Arc<Vec<AtomicUsize>> =
                    Arc::new((0..n).map(|_| AtomicUsize::new(0)).collect());
                let mut handles = Vec::new();
                for i in 0..n {
                    let r = runs.clone();
                    handles.push(
                        timer
                            .schedule(Duration::ZERO, move || {
                                r[i].fetch_add(1, Ordering::SeqCst);
                            })
                            .unwrap(),
                    );
                }
                let handles = Arc::new(handles);
                let h2 = handles.clone();
                let _resets = tokio::task::spawn_blocking(move || {
                    h2.iter().map(|h| h.reset(ms(1))).collect::<Vec<_>>()
                })
                .await
                .unwrap();
                tokio::time::timeout(Duration::from_secs(5), timer.sleep(ms(5)))
                    .await
                    .expect("the reaper goes on")
                    .unwrap();
                for i in 0..n {
                    assert_eq!(runs[i].load(Ordering::SeqCst), 1, "round {round} task {i}");
                }
            }
        });
    });
}

/// A repeating task re-armed at zero delay, cancelled from another thread:
/// at most the run under way finishes after `cancel` returns true; the chain
/// is dropped once; cancel from two threads: one true.
#[test]
fn repeating_cancel_racing_runs() {
    within(60, || {
        let rt = multi();
        rt.block_on(async {
            let timer = Timer::new();
            for round in 0..300 {
                let runs = Arc::new(AtomicUsize::new(0));
                let drops = Arc::new(AtomicUsize::new(0));
                let r = runs.clone();
                let d = drops.clone();
                let g = on_drop(move || {
                    d.fetch_add(1, Ordering::SeqCst);
                });
                let h = Arc::new(
                    timer
                        .schedule_repeating(Duration::ZERO, move || {
                            let _g = &g;
                            r.fetch_add(1, Ordering::SeqCst);
                            Some(Duration::ZERO)
                        })
                        .unwrap(),
                );
                // Let it spin a bit.
                while runs.load(Ordering::SeqCst) < (round % 5) {
                    tokio::task::yield_now().await;
                }
                let barrier = Arc::new(std::sync::Barrier::new(2));
                let (h1, h2) = (h.clone(), h.clone());
                let (b1, b2) = (barrier.clone(), barrier.clone());
                let r1 = runs.clone();
                let t1 = std::thread::spawn(move || {
                    b1.wait();
                    let ok = h1.cancel();
                    (ok, r1.load(Ordering::SeqCst))
                });
                let r2 = runs.clone();
                let t2 = std::thread::spawn(move || {
                    b2.wait();
                    let ok = h2.cancel();
                    (ok, r2.load(Ordering::SeqCst))
                });
                let (a, b) = (t1.join().unwrap(), t2.join().unwrap());
                assert!(
                    a.0 ^ b.0,
                    "round {round}: exactly one cancel wins: {a:?} {b:?}"
                );
                let at_cancel = if a.0 { a.1 } else { b.1 };
                tokio::time::timeout(Duration::from_secs(5), timer.sleep(ms(3)))
                    .await
                    .expect("the reaper goes on")
                    .unwrap();
                let after = runs.load(Ordering::SeqCst);
                assert!(
                    after <= at_cancel + 1,
                    "round {round}: {at_cancel} runs at cancel, {after} after"
                );
                assert_eq!(
                    drops.load(Ordering::SeqCst),
                    1,
                    "round {round}: dropped once"
                );
                assert_eq!(h.status(), TaskStatus::Cancelled);
                assert_eq!(timer.len(), 0);
            }
        });
    });
}

/// Shutdown racing schedules from several threads: each task is run by the
/// reaper, handed back, or refused with the task returned. Nothing is
/// dropped unrun silently, nothing runs twice.
#[test]
fn shutdown_racing_schedules_loses_nothing() {
    within(60, || {
        let rt = multi();
        for round in 0..100 {
            let timer = rt.block_on(async { Timer::new() });
            let runs = Arc::new(AtomicUsize::new(0));
            let silent_drops = Arc::new(AtomicUsize::new(0));
            let barrier = Arc::new(std::sync::Barrier::new(4));
            let mut threads = Vec::new();
            for th in 0..3 {
                let timer = timer.clone();
                let runs = runs.clone();
                let silent = silent_drops.clone();
                let b = barrier.clone();
                let rt_h = rt.handle().clone();
                threads.push(std::thread::spawn(move || {
                    let _e = rt_h.enter();
                    b.wait();
                    let mut refused = Vec::new();
                    for i in 0..200 {
                        struct Tracked(Arc<AtomicUsize>, bool);
                        impl Drop for Tracked {
                            fn drop(&mut self) {
                                if !self.1 {
                                    self.0.fetch_add(1, Ordering::SeqCst);
                                }
                            }
                        }
                        let t = Tracked(silent.clone(), false);
                        let r = runs.clone();
                        let d = if (i + th) % 2 == 0 {
                            Duration::ZERO
                        } else {
                            ms(50)
                        };
                        match timer.schedule(d, move || {
                            let mut t = t;
                            t.1 = true;
                            r.fetch_add(1, Ordering::SeqCst);
                        }) {
                            Ok(_) => {}
                            Err(e) => refused.push(e.into_inner()),
                        }
                    }
                    refused
                }));
            }
            barrier.wait();
            let unrun = timer.shutdown();
            let mut total_refused = 0;
            for t in threads {
                for f in t.join().unwrap() {
                    total_refused += 1;
                    f();
                }
            }
            for t in unrun {
                t.run();
            }
            // The reaper may still be running what it took out: spin (bounded).
            let until = std::time::Instant::now() + Duration::from_secs(5);
            while runs.load(Ordering::SeqCst) + silent_drops.load(Ordering::SeqCst) < 600
                && std::time::Instant::now() < until
            {
                std::thread::yield_now();
            }
            let left = timer.len();
            assert_eq!(left, 0, "round {round}: entries left after shutdown");
            let _ = total_refused;
            assert_eq!(
                silent_drops.load(Ordering::SeqCst),
                0,
                "round {round}: dropped unrun"
            );
            assert_eq!(
                runs.load(Ordering::SeqCst),
                600,
                "round {round}: every task ran once"
            );
        }
    });
}

/// Shutdown racing resets on real threads while the reaper runs what is
/// due: each task either ran or came back from the shutdown, exactly once,
/// every handle then reads finished and cannot be reset, and once every
/// task is accounted for the reaper runs none again.
#[test]
fn shutdown_racing_resets_loses_nothing() {
    for round in 0..30 {
        within(60, move || {
            let rt = multi();
            let timer = Timer::builder().shards(4).build_on(rt.handle()).unwrap();
            let n: usize = 400;
            let ran = Arc::new(AtomicUsize::new(0));
            let after = Arc::new(AtomicBool::new(false));
            let late = Arc::new(AtomicUsize::new(0));
            let resets = Arc::new(AtomicUsize::new(0));
            let handles: Arc<Vec<TaskHandle>> = Arc::new(
                (0..n)
                    .map(|i| {
                        let (r, a, l) = (ran.clone(), after.clone(), late.clone());
                        let _e = rt.enter();
                        timer
                            .schedule(Duration::from_micros(50 * (i as u64 % 7)), move || {
                                r.fetch_add(1, Ordering::SeqCst);
                                if a.load(Ordering::SeqCst) {
                                    l.fetch_add(1, Ordering::SeqCst);
                                }
                            })
                            .unwrap()
                    })
                    .collect(),
            );
            let resetters: Vec<_> = (0..2)
                .map(|t| {
                    let (hs, h, done) = (handles.clone(), rt.handle().clone(), resets.clone());
                    std::thread::spawn(move || {
                        let _e = h.enter();
                        for k in 0..3 {
                            for (i, th) in hs.iter().enumerate() {
                                if (i + t + k) % 2 == 0 {
                                    th.reset(Duration::from_micros(
                                        (i as u64 * 13 + k as u64) % 300,
                                    ));
                                } else {
                                    th.reset(Duration::ZERO);
                                }
                                done.fetch_add(1, Ordering::SeqCst);
                            }
                        }
                    })
                })
                .collect();
            // Shut down part-way through the resets, at a point that moves
            // from round to round.
            while resets.load(Ordering::SeqCst) < (round * 79) % (2 * 3 * n) {
                std::thread::yield_now();
            }
            let back = timer.shutdown();
            // Whatever the reaper had taken out may still be running: wait
            // (bounded) until every task is accounted for.
            let until = std::time::Instant::now() + Duration::from_secs(5);
            while ran.load(Ordering::SeqCst) + back.len() < n && std::time::Instant::now() < until {
                std::thread::yield_now();
            }
            after.store(true, Ordering::SeqCst);
            for r in resetters {
                r.join().unwrap();
            }
            let ran_n = ran.load(Ordering::SeqCst);
            assert_eq!(
                ran_n + back.len(),
                n,
                "round {round}: ran {ran_n} back {}",
                back.len()
            );
            for h in handles.iter() {
                assert_ne!(h.status(), TaskStatus::Pending);
                assert!(!h.reset(ms(1)));
            }
            for t in back {
                t.run();
            }
            assert_eq!(ran.load(Ordering::SeqCst), n);
            assert_eq!(
                late.load(Ordering::SeqCst),
                n - ran_n,
                "round {round}: only the handed-back tasks ran after"
            );
            drop(rt);
        });
    }
}

// ---------------------------------------------------------------------------
// 8. A repeating task running while the timer is shut down.

/// The repeating task is mid-run (taken out of the wheel) when `shutdown()` is
/// called from another thread: the run finishes, the chain ends there, and
/// nothing is handed back for it (as `schedule_repeating`'s docs say).
#[test]
fn shutdown_during_a_repeating_run_hands_nothing_back() {
    within(30, || {
        let rt = multi();
        let timer = rt.block_on(async { Timer::new() });
        let in_run = Arc::new(std::sync::Barrier::new(2));
        let shut = Arc::new(std::sync::Barrier::new(2));
        let runs = Arc::new(AtomicUsize::new(0));
        let dropped = Arc::new(AtomicBool::new(false));
        let (a, b, r) = (in_run.clone(), shut.clone(), runs.clone());
        let d = dropped.clone();
        let g = on_drop(move || d.store(true, Ordering::SeqCst));
        let h = rt
            .block_on(async {
                timer.schedule_repeating(ms(1), move || {
                    let _g = &g;
                    let n = r.fetch_add(1, Ordering::SeqCst);
                    if n == 0 {
                        a.wait();
                        b.wait();
                    }
                    Some(ms(1))
                })
            })
            .unwrap();
        in_run.wait();
        let unrun = timer.shutdown();
        shut.wait();
        // The run finishes on its worker and the chain ends there (the bound
        // on the whole test is `within`'s).
        while !dropped.load(Ordering::SeqCst) {
            std::thread::yield_now();
        }
        assert!(unrun.is_empty(), "the running chain is not handed back");
        assert_eq!(runs.load(Ordering::SeqCst), 1, "no run after the shutdown");
        assert_eq!(h.status(), TaskStatus::Done);
        assert!(!h.cancel(), "nothing left to cancel");
    });
}

// ---------------------------------------------------------------------------
// 9. Sleep wakers that panic on the reaper, beside tasks of the same turn.

#[tokio::test(start_paused = true)]
async fn a_sleep_waker_panicking_on_the_reapers_wake_is_counted() {
    struct Bomb;
    impl Drop for Bomb {
        fn drop(&mut self) {
            panic!("payload drop");
        }
    }
    struct Hostile;
    impl Wake for Hostile {
        fn wake(self: Arc<Self>) {
            std::panic::panic_any(Bomb);
        }
    }
    let timer = Timer::new();
    let ran = Arc::new(AtomicUsize::new(0));
    let mut sleeps = Vec::new();
    for _ in 0..3 {
        let r = ran.clone();
        timer
            .schedule(ms(10), move || {
                r.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap();
        let mut s = Box::pin(timer.sleep(ms(10)));
        let w = Waker::from(Arc::new(Hostile));
        assert!(s.as_mut().poll(&mut Context::from_waker(&w)).is_pending());
        sleeps.push(s);
    }
    let ok = timer.sleep(ms(10));
    advance(ms(11)).await;
    assert_eq!(ok.await, Ok(()));
    settle().await;
    assert_eq!(ran.load(Ordering::SeqCst), 3);
    assert_eq!(timer.metrics().panicked, 3);
    assert_eq!(timer.metrics().expired, 7);
    for s in &mut sleeps {
        let w = futures::task::noop_waker();
        assert_eq!(
            s.as_mut().poll(&mut Context::from_waker(&w)),
            Poll::Ready(Ok(()))
        );
    }
    assert!(!timer.is_shutdown());
}

// ---------------------------------------------------------------------------
// 10. A shared reaper: one timer's task tears down its neighbours.

#[test]
fn a_shared_reaper_task_tearing_down_its_neighbours() {
    paused_within(10, || async {
        let reaper = Reaper::start().unwrap();
        let a = Timer::builder().name("a").reaper(&reaper).build().unwrap();
        let b = Timer::builder().name("b").reaper(&reaper).build().unwrap();
        let c = Timer::builder().name("c").reaper(&reaper).build().unwrap();
        let b_drops = Arc::new(AtomicUsize::new(0));
        for _ in 0..3 {
            let d = b_drops.clone();
            let cc = c.clone();
            let g = on_drop(move || {
                d.fetch_add(1, Ordering::SeqCst);
                // Schedules on a neighbour from a drop run on the reaper.
                let _ = cc.schedule(ms(1), || {});
                panic!("b's task drop");
            });
            b.schedule(ms(500), move || {
                let _g = &g;
            })
            .unwrap();
        }
        let slot = Arc::new(Mutex::new(Some((b, reaper))));
        let s = slot.clone();
        let aa = a.clone();
        a.schedule(ms(10), move || {
            // Drop the last clone of b and the last Reaper handle, shut
            // ourselves down, then panic.
            drop(s.lock().unwrap().take());
            let back = aa.shutdown();
            for t in back {
                t.run();
            }
            panic!("a's task");
        })
        .unwrap();
        a.schedule(ms(400), || panic!("handed back and run inline"))
            .unwrap();
        let c_ran = Arc::new(AtomicUsize::new(0));
        for d in [10, 20, 30] {
            let r = c_ran.clone();
            c.schedule(ms(d), move || {
                r.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap();
        }
        for _ in 0..5 {
            advance(ms(10)).await;
            settle().await;
        }
        assert_eq!(b_drops.load(Ordering::SeqCst), 3);
        assert_eq!(c_ran.load(Ordering::SeqCst), 3);
        assert!(a.is_shutdown());
        assert!(!c.is_shutdown());
        assert_eq!(
            a.metrics().panicked,
            1,
            "a's task panicked once (the inline one unwound through it)"
        );
        assert_eq!(c.sleep(ms(5)).await, Ok(()));
        // The three drops' schedules on c have run too.
        assert_eq!(c.len(), 0);
    });
}

// ---------------------------------------------------------------------------
// 11. schedule_async cancel racing the deadline on a multi-thread runtime.

#[test]
fn async_cancel_racing_the_deadline() {
    within(60, || {
        let rt = multi();
        rt.block_on(async {
            let timer = Timer::new();
            for round in 0..200 {
                let n = 32;
                let polled: Arc<Vec<AtomicUsize>> =
                    Arc::new((0..n).map(|_| AtomicUsize::new(0)).collect());
                let done: Arc<Vec<AtomicUsize>> =
                    Arc::new((0..n).map(|_| AtomicUsize::new(0)).collect());
                let drops: Arc<Vec<AtomicUsize>> =
                    Arc::new((0..n).map(|_| AtomicUsize::new(0)).collect());
                let mut handles = Vec::new();
                for i in 0..n {
                    let (p, d, dr) = (polled.clone(), done.clone(), drops.clone());
                    let g = on_drop(move || {
                        dr[i].fetch_add(1, Ordering::SeqCst);
                    });
                    handles.push(
                        timer
                            .schedule_async(Duration::ZERO, async move {
                                let _g = &g;
                                p[i].fetch_add(1, Ordering::SeqCst);
                                tokio::task::yield_now().await;
                                d[i].fetch_add(1, Ordering::SeqCst);
                            })
                            .unwrap(),
                    );
                }
                let handles = Arc::new(handles);
                let h2 = handles.clone();
                let cancels = tokio::task::spawn_blocking(move || {
                    h2.iter().map(|h| h.cancel()).collect::<Vec<_>>()
                })
                .await
                .unwrap();
                // Bounded wait for every future to be dropped (run out or aborted).
                let all_dropped = tokio::time::timeout(Duration::from_secs(5), async {
                    while drops.iter().any(|d| d.load(Ordering::SeqCst) == 0) {
                        tokio::task::yield_now().await;
                    }
                })
                .await;
                assert!(
                    all_dropped.is_ok(),
                    "round {round}: a future was never dropped"
                );
                for i in 0..n {
                    assert_eq!(drops[i].load(Ordering::SeqCst), 1, "round {round} {i}");
                    assert!(polled[i].load(Ordering::SeqCst) <= 1);
                    if !cancels[i] {
                        assert_eq!(
                            done[i].load(Ordering::SeqCst),
                            1,
                            "round {round} {i}: cancel false but it never finished"
                        );
                    }
                    assert!(handles[i].is_finished(), "round {round} {i}");
                    assert!(!handles[i].is_pending());
                }
            }
        });
    });
}

// ---------------------------------------------------------------------------
// 13. A sleep polled from several threads while the reaper fires; a waker
// whose clone cancels/resets other tasks and shuts the timer down.

#[test]
fn a_sleep_polled_from_two_threads_wakes_the_latest() {
    within(60, || {
        let rt = multi();
        rt.block_on(async {
            let timer = Timer::new();
            for _ in 0..200 {
                let sleep = Arc::new(Mutex::new(Box::pin(timer.sleep(ms(1)))));
                let mut tasks = Vec::new();
                for _ in 0..2 {
                    let s = sleep.clone();
                    tasks.push(tokio::spawn(async move {
                        std::future::poll_fn(|cx| s.lock().unwrap().as_mut().poll(cx)).await
                    }));
                }
                // Whichever polled last is woken; the other may wait forever, so
                // bound only the union: at least one finishes.
                let first = tokio::time::timeout(
                    Duration::from_secs(5),
                    futures::future::select_all(tasks),
                )
                .await;
                let (out, _, rest) = first.expect("the latest poller is woken");
                assert_eq!(out.unwrap(), Ok(()));
                for t in rest {
                    t.abort();
                }
            }
        });
    });
}

#[test]
fn a_waker_clone_calling_back_into_the_timer() {
    use std::task::{RawWaker, RawWakerVTable};
    thread_local! {
        static HOOK: std::cell::RefCell<Option<Box<dyn Fn()>>> = const { std::cell::RefCell::new(None) };
    }
    fn clone(_: *const ()) -> RawWaker {
        HOOK.with(|h| {
            if let Some(h) = h.borrow().as_ref() {
                h()
            }
        });
        RawWaker::new(std::ptr::null(), &VT)
    }
    fn noop(_: *const ()) {}
    static VT: RawWakerVTable = RawWakerVTable::new(clone, noop, noop, noop);
    paused_within(10, || async {
        let timer = Timer::new();
        let other = timer.schedule(ms(50), || {}).unwrap();
        let handed = Arc::new(Mutex::new(Vec::new()));
        let (t, hd) = (timer.clone(), handed.clone());
        let other = Arc::new(other);
        let o = other.clone();
        HOOK.with(|h| {
            *h.borrow_mut() = Some(Box::new(move || {
                assert!(o.reset(ms(60)));
                let _ = t.len();
                hd.lock().unwrap().extend(t.shutdown());
            }))
        });
        // SAFETY: the vtable ignores the data pointer.
        let w = unsafe { Waker::from_raw(RawWaker::new(std::ptr::null(), &VT)) };
        let mut s = Box::pin(timer.sleep(ms(10)));
        let out = s.as_mut().poll(&mut Context::from_waker(&w));
        HOOK.with(|h| *h.borrow_mut() = None);
        assert_eq!(out, Poll::Ready(Err(TimerError::Shutdown)));
        assert_eq!(handed.lock().unwrap().len(), 1);
        assert_eq!(other.status(), TaskStatus::Done);
        drop(s);
        assert_eq!(timer.metrics().panicked, 0);
    });
}

// ---------------------------------------------------------------------------
// 14. A runtime dropped under the timer.

/// A multi-thread runtime dropped while async tasks wait in the wheel and
/// others run: every handle then reads finished and not pending, and cancel
/// says `false`; the timer refuses new work with `ReaperGone` and a shutdown
/// hands nothing back.
#[test]
fn a_runtime_dropped_with_async_tasks_waiting_and_running_finishes_every_handle() {
    within(30, || {
        let rt = multi();
        let (timer, waiting, running) = rt.block_on(async {
            let timer = Timer::new();
            let waiting: Vec<_> = (0..20)
                .map(|i| {
                    timer
                        .schedule_async(Duration::from_secs(100 + i), async {})
                        .unwrap()
                })
                .collect();
            let running: Vec<_> = (0..20)
                .map(|_| timer.schedule_async(ms(1), std::future::pending()).unwrap())
                .collect();
            tokio::time::timeout(Duration::from_secs(5), async {
                while running.iter().any(|h| h.is_pending()) {
                    tokio::task::yield_now().await;
                }
            })
            .await
            .expect("the running ones start");
            (timer, waiting, running)
        });
        for h in &running {
            assert!(!h.is_pending());
            assert!(!h.is_finished());
        }
        drop(rt);
        for h in waiting.iter().chain(&running) {
            assert!(!h.is_pending(), "{h:?}");
            assert!(h.is_finished(), "{h:?}");
            assert!(!h.cancel(), "{h:?}");
        }
        assert!(matches!(
            timer.schedule(ms(1), || {}),
            Err(ScheduleError::ReaperGone(_))
        ));
        assert!(timer.shutdown().is_empty());
    });
}

/// A timer built on a runtime from outside it, with a task and an async task
/// scheduled from outside any runtime, whose runtime is dropped before their
/// deadline: neither runs, both handles read finished, cancel says `false`,
/// and a sleep fails with `ReaperGone`.
#[test]
fn a_runtime_dropped_before_the_deadline_of_tasks_scheduled_from_outside_it() {
    within(30, || {
        let rt = multi();
        let timer = Timer::builder().build_on(rt.handle()).unwrap();
        let ran = Arc::new(AtomicBool::new(false));
        let r = ran.clone();
        let h = timer
            .schedule_async(Duration::from_secs(3600), async move {
                r.store(true, Ordering::SeqCst)
            })
            .unwrap();
        let t = timer
            .schedule(Duration::from_secs(3600), || panic!("never"))
            .unwrap();
        assert!(h.is_pending());
        drop(rt);
        assert!(!ran.load(Ordering::SeqCst));
        assert!(h.is_finished());
        assert!(!h.is_pending());
        assert_eq!(t.status(), TaskStatus::Done);
        assert!(!t.cancel());
        let s = timer.sleep(ms(1));
        assert_eq!(
            futures::FutureExt::now_or_never(s),
            Some(Err(TimerError::ReaperGone))
        );
    });
}

/// A repeating task cancelled while a shutdown is under way
/// (`TaskHandle::cancel`: "`true` when this call stopped it, and no run starts
/// afterwards"; `Timer::shutdown`: the handles of the tasks handed back read
/// `Done`): the cancel and the shutdown's hand-back never both win.
mod cancelled_during_shutdown {
    use std::future::Future;
    use std::pin::Pin;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};
    use std::task::{Context, Wake, Waker};
    use std::time::Duration;

    use tokio_purgatory::timer::{TaskHandle, TaskStatus};
    use tokio_purgatory::Timer;

    /// A waker whose `wake` runs a callback (user code the timer calls back).
    struct OnWake(Mutex<Option<Box<dyn FnOnce() + Send>>>);
    impl Wake for OnWake {
        fn wake(self: Arc<Self>) {
            self.wake_by_ref()
        }
        fn wake_by_ref(self: &Arc<Self>) {
            if let Some(f) = self.0.lock().unwrap().take() {
                f()
            }
        }
    }

    /// A sleep's waker, woken by `shutdown` (after the wheels were drained,
    /// before or after the repeating task is handed back, by the order of their
    /// entries), cancels a repeating task: either the cancel wins (`true`, and
    /// the task is not handed back, nor does it run) or the shutdown does.
    #[tokio::test(start_paused = true)]
    async fn a_cancel_from_code_the_shutdown_runs_loses_to_the_hand_back() {
        let mut report = Vec::new();
        for sleep_first in [true, false] {
            let timer = Timer::builder().shards(1).build().unwrap();
            let runs = Arc::new(AtomicUsize::new(0));
            let r = runs.clone();
            let mut sleep = None;
            if sleep_first {
                sleep = Some(timer.sleep(Duration::from_secs(60)));
            }
            let handle: Arc<TaskHandle> = Arc::new(
                timer
                    .schedule_repeating(Duration::from_secs(30), move || {
                        r.fetch_add(1, Ordering::SeqCst);
                        Some(Duration::from_secs(30))
                    })
                    .unwrap(),
            );
            if !sleep_first {
                sleep = Some(timer.sleep(Duration::from_secs(60)));
            }
            let mut sleep = sleep.unwrap();
            let cancelled: Arc<Mutex<Option<bool>>> = Arc::new(Mutex::new(None));
            let (h, c) = (handle.clone(), cancelled.clone());
            let waker = Waker::from(Arc::new(OnWake(Mutex::new(Some(Box::new(move || {
                *c.lock().unwrap() = Some(h.cancel());
            }))))));
            assert!(Pin::new(&mut sleep)
                .poll(&mut Context::from_waker(&waker))
                .is_pending());

            let unrun = timer.shutdown();
            let said = cancelled
                .lock()
                .unwrap()
                .expect("the waker ran inside shutdown");
            let status = handle.status();
            let handed_back = unrun.len();
            for task in unrun {
                task.run();
            }
            let ran = runs.load(Ordering::SeqCst);
            report.push((sleep_first, said, status, handed_back, ran));
        }
        // The timer reads shut down before any waker runs: the cancel returns
        // `false`, the task is handed back (once) and runs once, and its
        // handle reads `Done`, whichever entry the shutdown reached first.
        for &(sleep_first, said, status, handed_back, ran) in &report {
            assert!(
                !said && handed_back == 1 && ran == 1 && status == TaskStatus::Done,
                "sleep first: {sleep_first}: cancel() returned {said}, status {status:?}, \
                 {handed_back} task(s) handed back, the closure ran {ran} time(s). \
                 All: {report:?}"
            );
        }
    }

    /// The same on real threads, with no re-entry: a thread cancels the
    /// repeating task as soon as `is_shutdown()` reads `true`, while another
    /// thread's `shutdown` is still handing back the 50,000 tasks before it.
    #[test]
    fn a_cancel_once_is_shutdown_reads_true_loses_to_the_hand_back() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let mut outcomes = Vec::new();
        for _ in 0..3 {
            let (timer, handle, runs) = {
                let _g = rt.enter();
                let timer = Timer::builder().shards(1).build().unwrap();
                for _ in 0..50_000 {
                    let _ = timer.schedule(Duration::from_secs(60), || {}).unwrap();
                }
                let runs = Arc::new(AtomicUsize::new(0));
                let r = runs.clone();
                let handle = Arc::new(
                    timer
                        .schedule_repeating(Duration::from_secs(30), move || {
                            r.fetch_add(1, Ordering::SeqCst);
                            Some(Duration::from_secs(30))
                        })
                        .unwrap(),
                );
                (timer, handle, runs)
            };
            let canceller = {
                let (timer, handle) = (timer.clone(), handle.clone());
                std::thread::spawn(move || {
                    let wall = std::time::Instant::now();
                    while !timer.is_shutdown() {
                        assert!(wall.elapsed() < Duration::from_secs(10), "bounded");
                        std::hint::spin_loop();
                    }
                    handle.cancel()
                })
            };
            let unrun = timer.shutdown();
            let said = canceller.join().unwrap();
            let n = unrun.len();
            for t in unrun {
                t.run();
            }
            outcomes.push((said, n, runs.load(Ordering::SeqCst), handle.status()));
        }
        assert!(
            outcomes
                .iter()
                .all(|&(said, n, ran, status)| !said
                    && n == 50_001
                    && ran == 1
                    && status == TaskStatus::Done),
            "(cancel() said, tasks handed back, repeating closure runs, status) per try: {outcomes:?}"
        );
    }
}

/// `TaskStatus` read while a cancel runs ("`Cancelled` is final, and so is
/// `Done` for a one-shot task").
mod status_racing_cancel {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::{Arc, Barrier};
    use std::time::Duration;

    use tokio_purgatory::timer::TaskStatus;
    use tokio_purgatory::Timer;

    /// A reader racing `cancel` never sees a one-shot task that never ran read
    /// `Done` and then `Cancelled`. Up to 3,000 tries of a cancel at a varying
    /// moment against a thread reading `status` in a loop, bounded to 3 s.
    #[test]
    fn a_one_shot_never_reads_done_then_cancelled() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let timer = {
            let _g = rt.enter();
            Timer::new()
        };
        let wall = std::time::Instant::now();
        let mut seen = 0u64;
        let mut tries = 0u64;
        while tries < 3_000 && wall.elapsed() < Duration::from_secs(3) && seen == 0 {
            tries += 1;
            let h = {
                let _g = rt.enter();
                Arc::new(timer.schedule(Duration::from_secs(600), || {}).unwrap())
            };
            let go = Arc::new(Barrier::new(2));
            let stop = Arc::new(AtomicBool::new(false));
            let bad = Arc::new(AtomicU64::new(0));
            let reader = {
                let (h, go, stop, bad) = (h.clone(), go.clone(), stop.clone(), bad.clone());
                std::thread::spawn(move || {
                    go.wait();
                    let mut saw_done = false;
                    loop {
                        match h.status() {
                            TaskStatus::Done => saw_done = true,
                            TaskStatus::Cancelled => {
                                if saw_done {
                                    bad.fetch_add(1, Ordering::SeqCst);
                                }
                                break;
                            }
                            TaskStatus::Pending => {}
                        }
                        if stop.load(Ordering::Relaxed) {
                            break;
                        }
                    }
                })
            };
            go.wait();
            for _ in 0..(tries % 50) {
                std::hint::spin_loop();
            }
            assert!(h.cancel());
            stop.store(true, Ordering::Relaxed);
            reader.join().unwrap();
            seen += bad.load(Ordering::SeqCst);
        }
        assert_eq!(
            seen, 0,
            "after {tries} tries: a one-shot task that never ran read Done, then Cancelled"
        );
    }
}
