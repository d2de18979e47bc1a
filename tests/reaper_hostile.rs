//! Hostile use of the shared `Reaper`, weak handles and the metrics: the last
//! `Reaper` or purgatory dropped from an expiry, building on the reaper from
//! its own task, dead runtimes, a lost reaper with an operation holding the
//! last clone, recorders that panic on drop or call back in, lateness and
//! batches counted once per expiry, and turns on a shared reaper.

mod support;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio::time::advance;
use tokio_purgatory::{
    Completion, Operation, OperationError, Purgatory, Reaper, Timer, WatchErrorKind, WeakPurgatory,
};

use support::{balanced, ms, paused, settle, within};

fn alive_tasks() -> usize {
    tokio::runtime::Handle::current()
        .metrics()
        .num_alive_tasks()
}

struct Never;
impl Operation for Never {
    type Output = ();
    fn try_complete(&mut self) -> Option<()> {
        None
    }
    fn on_expiration(self) {}
}

// ---------------------------------------------------------------------------
// 1. Two operations due in the same tick; whichever expires first completes
// the other by a walk. Only one expires, but does the lateness histogram (and
// the reaper's batch) count one sample per expiry?

struct Pair {
    ready: Arc<AtomicBool>,
    me: u32,
    other: u32,
    weak: Arc<OnceLock<WeakPurgatory<u32, Pair>>>,
}
impl Operation for Pair {
    type Output = &'static str;
    fn try_complete(&mut self) -> Option<&'static str> {
        self.ready.load(Ordering::SeqCst).then_some("completed")
    }
    fn on_expiration(self) -> &'static str {
        self.ready.store(true, Ordering::SeqCst);
        if let Some(p) = self.weak.get().and_then(|w| w.upgrade()) {
            p.try_complete_watched(&self.other);
        }
        let _ = self.me;
        "expired"
    }
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn lateness_counts_one_sample_per_expiry() {
    let p: Purgatory<u32, Pair> = Purgatory::builder().timer_shards(1).build().unwrap();
    let weak = Arc::new(OnceLock::new());
    weak.set(p.downgrade()).unwrap();
    let ready = Arc::new(AtomicBool::new(false));
    let a = p
        .try_complete_else_watch(
            Pair {
                ready: ready.clone(),
                me: 1,
                other: 2,
                weak: weak.clone(),
            },
            ms(10),
            [1],
        )
        .unwrap();
    let b = p
        .try_complete_else_watch(
            Pair {
                ready: ready.clone(),
                me: 2,
                other: 1,
                weak: weak.clone(),
            },
            ms(10),
            [2],
        )
        .unwrap();
    advance(ms(12)).await;
    settle().await;
    let (a, b) = (a.await.unwrap(), b.await.unwrap());
    let expired = [&a, &b].iter().filter(|c| c.is_expired()).count();
    assert_eq!(expired, 1, "{a:?} {b:?}");
    let m = p.metrics();
    assert_eq!((m.expired, m.completed), (1, 1), "{m:?}");
    let late = p.lateness();
    // `lateness()`: "for each expiry, the time from its deadline ... Recorded
    // once per expiry by the reaper".
    assert_eq!(
        late.count(),
        m.expired,
        "lateness samples vs expiries; reaper {:?}",
        m.reaper
    );
    // ReaperMetrics::largest_batch: "The most entries one turn expired."
    assert_eq!(m.reaper.largest_batch, 1, "{:?}", m.reaper);
}

// ---------------------------------------------------------------------------
// 2. The reaper's runtime dies while operations are pending whose Drop holds
// the last Purgatory clone: handles should resolve ReaperGone.

/// Holds a purgatory clone (the last, in one test) until it is dropped.
struct HoldsPurgatory(#[allow(dead_code)] Mutex<Option<Purgatory<u32, HoldsPurgatory>>>);
impl Operation for HoldsPurgatory {
    type Output = ();
    fn try_complete(&mut self) -> Option<()> {
        None
    }
    fn on_expiration(self) {}
}

#[test]
fn reaper_gone_with_an_operation_holding_the_last_clone() {
    within(20, || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let reaper = Reaper::start_on(rt.handle());
        let p: Purgatory<u32, HoldsPurgatory> =
            Purgatory::builder().reaper(&reaper).build().unwrap();
        let mut handles = Vec::new();
        {
            let _in = rt.enter();
            // Several plain ones first, then the one holding the last clone,
            // then more.
            for i in 0..5 {
                handles.push(
                    p.try_complete_else_watch(HoldsPurgatory(Mutex::new(None)), ms(60_000), [i])
                        .unwrap(),
                );
            }
            handles.push(
                p.try_complete_else_watch(
                    HoldsPurgatory(Mutex::new(Some(p.clone()))),
                    ms(60_000),
                    [99],
                )
                .unwrap(),
            );
            for i in 5..10 {
                handles.push(
                    p.try_complete_else_watch(HoldsPurgatory(Mutex::new(None)), ms(60_000), [i])
                        .unwrap(),
                );
            }
        }
        let weak = p.downgrade();
        drop(p);
        rt.block_on(tokio::task::yield_now());
        drop(rt);
        assert!(reaper.is_stopped());
        assert!(weak.upgrade().is_none(), "the last clone went with its op");
        let other = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let outs: Vec<_> = other.block_on(async {
            let mut outs = Vec::new();
            for h in handles {
                outs.push(h.await);
            }
            outs
        });
        // Purgatory docs: "If the reaper's runtime shuts down first, pending
        // operations are dropped, handles resolve to ReaperGone".
        let gone = outs
            .iter()
            .filter(|o| **o == Err(OperationError::ReaperGone))
            .count();
        assert_eq!(gone, outs.len(), "{outs:?}");
    });
}

// ---------------------------------------------------------------------------
// 3. Reaper gone: metrics balance, drain returns, sleeps/timeouts resolve,
// weak upgrades from drops during the abandonment can call back in.

struct CallsBack {
    weak: WeakPurgatory<u32, CallsBack>,
    log: Arc<Mutex<Vec<String>>>,
    armed: bool,
}
impl Operation for CallsBack {
    type Output = ();
    fn try_complete(&mut self) -> Option<()> {
        None
    }
    fn on_expiration(self) {}
}
impl Drop for CallsBack {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        match self.weak.upgrade() {
            Some(p) => {
                let m = p.metrics();
                let again = p.try_complete_else_watch(
                    CallsBack {
                        weak: self.weak.clone(),
                        log: self.log.clone(),
                        armed: false,
                    },
                    ms(5),
                    [1000],
                );
                let kind = again.as_ref().err().map(|e| e.kind());
                let back = p.shutdown().len();
                self.log.lock().unwrap().push(format!(
                    "upgraded: delayed {} refusal {kind:?} shutdown gave {back}",
                    m.delayed
                ));
            }
            None => self.log.lock().unwrap().push("gone".into()),
        }
    }
}

#[test]
fn reaper_gone_callbacks_metrics_and_drain() {
    within(20, || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let reaper = Reaper::start_on(rt.handle());
        let p: Purgatory<u32, CallsBack> = Purgatory::builder().reaper(&reaper).build().unwrap();
        let timer = Timer::builder().reaper(&reaper).build().unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        let (handles, nap, to) = {
            let _in = rt.enter();
            let hs: Vec<_> = (0..6)
                .map(|i| {
                    p.try_complete_else_watch(
                        CallsBack {
                            weak: p.downgrade(),
                            log: log.clone(),
                            armed: i == 3,
                        },
                        ms(60_000),
                        [i, 100],
                    )
                    .unwrap()
                })
                .collect();
            let nap = timer.sleep(ms(60_000));
            let to = timer.timeout(ms(60_000), std::future::pending::<()>());
            (hs, nap, to)
        };
        rt.block_on(tokio::task::yield_now());
        drop(rt);
        assert!(reaper.is_stopped());
        assert_eq!(reaper.serving(), 0);
        let other = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        other.block_on(async {
            for h in handles {
                let out = tokio::time::timeout(Duration::from_secs(5), h).await;
                assert_eq!(out.expect("resolved"), Err(OperationError::ReaperGone));
            }
            assert_eq!(nap.await, Err(tokio_purgatory::TimerError::ReaperGone));
            let out = to.await;
            assert!(out.is_err(), "{out:?}");
            tokio::time::timeout(Duration::from_secs(5), p.drain())
                .await
                .expect("drain returns once everything was abandoned");
        });
        let m = p.metrics();
        assert_eq!(m.delayed, 0, "{m:?}");
        assert!(balanced(&m), "{m:?}");
        let log = log.lock().unwrap().clone();
        assert_eq!(log.len(), 1, "{log:?}");
        assert!(log[0].contains("ReaperGone"), "{log:?}");
        let refused = timer.schedule(ms(1), || {}).unwrap_err();
        assert!(matches!(
            refused,
            tokio_purgatory::ScheduleError::ReaperGone(_)
        ));
        let tm = timer.metrics();
        assert_eq!(tm.pending, 0);
    });
}

// ---------------------------------------------------------------------------
// 4. Dropping the last Reaper handle, and the last purgatory, from inside an
// expiry: the task ends; building from inside an expiry works.

struct DropsThings(Arc<Mutex<Vec<Box<dyn std::any::Any + Send>>>>);
impl Operation for DropsThings {
    type Output = ();
    fn try_complete(&mut self) -> Option<()> {
        None
    }
    fn on_expiration(self) {
        let things = std::mem::take(&mut *self.0.lock().unwrap());
        drop(things);
    }
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn last_reaper_and_purgatory_dropped_from_an_expiry() {
    settle().await;
    let base = alive_tasks();
    let reaper = Reaper::start().unwrap();
    let p: Purgatory<u32, DropsThings> = Purgatory::builder().reaper(&reaper).build().unwrap();
    let bag: Arc<Mutex<Vec<Box<dyn std::any::Any + Send>>>> = Arc::default();
    // Another pending op that must be dropped cleanly with the purgatory.
    let other = p
        .try_complete_else_watch(DropsThings(Arc::default()), ms(60_000), [2])
        .unwrap();
    let h = p
        .try_complete_else_watch(DropsThings(bag.clone()), ms(5), [1])
        .unwrap();
    bag.lock().unwrap().push(Box::new(reaper));
    bag.lock().unwrap().push(Box::new(p));
    settle().await;
    assert_eq!(alive_tasks(), base + 1);
    advance(ms(6)).await;
    settle().await;
    assert_eq!(h.await, Ok(Completion::Expired(())));
    assert_eq!(other.await, Err(OperationError::Shutdown));
    settle().await;
    assert_eq!(alive_tasks(), base, "the reaper task ended");
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn building_on_the_reaper_from_an_expiry() {
    let reaper = Reaper::start().unwrap();
    let p: Purgatory<u32, DropsThings> = Purgatory::builder().reaper(&reaper).build().unwrap();
    let built: Arc<Mutex<Option<(Timer, tokio_purgatory::TaskHandle)>>> = Arc::default();
    let fired = Arc::new(AtomicUsize::new(0));
    struct Builds(
        Reaper,
        Arc<Mutex<Option<(Timer, tokio_purgatory::TaskHandle)>>>,
        Arc<AtomicUsize>,
    );
    impl Operation for Builds {
        type Output = ();
        fn try_complete(&mut self) -> Option<()> {
            None
        }
        fn on_expiration(self) {
            let t = Timer::builder().reaper(&self.0).build().unwrap();
            let f = self.2.clone();
            let h = t
                .schedule(Duration::from_millis(3), move || {
                    f.fetch_add(1, Ordering::SeqCst);
                })
                .unwrap();
            *self.1.lock().unwrap() = Some((t, h));
        }
    }
    let q: Purgatory<u32, Builds> = Purgatory::builder().reaper(&reaper).build().unwrap();
    drop(p);
    let h = q
        .try_complete_else_watch(
            Builds(reaper.clone(), built.clone(), fired.clone()),
            ms(5),
            [1],
        )
        .unwrap();
    drop(reaper);
    advance(ms(5)).await;
    settle().await;
    h.await.unwrap();
    assert_eq!(fired.load(Ordering::SeqCst), 0);
    for _ in 0..4 {
        advance(ms(1)).await;
        settle().await;
    }
    assert_eq!(
        fired.load(Ordering::SeqCst),
        1,
        "timer built in an expiry fired"
    );
}

// ---------------------------------------------------------------------------
// 5. Building on a reaper whose runtime is gone; an owned reaper built on a
// dead runtime.

#[test]
fn start_and_build_on_a_dead_runtime() {
    within(20, || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let handle = rt.handle().clone();
        drop(rt);
        let reaper = Reaper::start_on(&handle);
        assert!(reaper.is_stopped());
        let err = Timer::builder().reaper(&reaper).build().unwrap_err();
        assert!(err.is_reaper_stopped(), "{err:?}");
        let err = Purgatory::<u32, Never>::builder()
            .reaper(&reaper)
            .build()
            .unwrap_err();
        assert!(err.is_reaper_stopped(), "{err:?}");
        // An owned reaper on the dead runtime.
        match Timer::builder().build_on(&handle) {
            Ok(t) => {
                let r = t.schedule(ms(1), || {});
                assert!(
                    matches!(r, Err(tokio_purgatory::ScheduleError::ReaperGone(_))),
                    "{r:?}"
                );
            }
            Err(e) => panic!("owned build failed: {e:?}"),
        }
        match Purgatory::<u32, Never>::builder().build_on(&handle) {
            Ok(p) => {
                let rt2 = paused();
                let _in = rt2.enter();
                let r = p.try_complete_else_watch(Never, ms(1), [1]);
                match r {
                    Err(e) => assert_eq!(e.kind(), WatchErrorKind::ReaperGone),
                    Ok(h) => {
                        drop(h);
                        panic!("accepted on a dead runtime")
                    }
                }
            }
            Err(e) => panic!("owned build failed: {e:?}"),
        }
    });
}

// ---------------------------------------------------------------------------
// 6. A multi-thread runtime shut down while the reaper runs a long timer task;
// handles awaited on another runtime resolve.

#[test]
fn runtime_shut_down_while_the_reaper_runs_a_task() {
    within(30, || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let reaper = Reaper::start_on(rt.handle());
        let timer = Timer::builder().reaper(&reaper).build().unwrap();
        let p: Purgatory<u32, Never> = Purgatory::builder().reaper(&reaper).build().unwrap();
        let entered = Arc::new(std::sync::Barrier::new(2));
        let release = Arc::new(std::sync::Barrier::new(2));
        let (e, r) = (entered.clone(), release.clone());
        let (hs, nap) = {
            let _in = rt.enter();
            timer
                .schedule(Duration::ZERO, move || {
                    e.wait();
                    r.wait();
                })
                .unwrap();
            let hs: Vec<_> = (0..10)
                .map(|i| p.try_complete_else_watch(Never, ms(600_000), [i]).unwrap())
                .collect();
            (hs, timer.sleep(ms(600_000)))
        };
        entered.wait();
        // The reaper is inside the task: shut the runtime down in the
        // background, then let the task go.
        rt.shutdown_background();
        release.wait();
        let other = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        other.block_on(async {
            for h in hs {
                let out = tokio::time::timeout(Duration::from_secs(10), h).await;
                assert_eq!(out.expect("resolved"), Err(OperationError::ReaperGone));
            }
            let out = tokio::time::timeout(Duration::from_secs(10), nap).await;
            assert_eq!(
                out.expect("resolved"),
                Err(tokio_purgatory::TimerError::ReaperGone)
            );
        });
        assert!(reaper.is_stopped());
        assert!(balanced(&p.metrics()));
    });
}

// ---------------------------------------------------------------------------
// 7. ReaperMetrics on a shared reaper: an idle timer's turns.

/// On a shared reaper every turn looks at every timer it serves: an idle
/// timer counts the busy one's turns, as `ReaperMetrics::turns` says, and
/// expires nothing.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_shared_reapers_turns_count_on_every_timer_it_serves() {
    let reaper = Reaper::start().unwrap();
    let idle = Timer::builder()
        .name("idle")
        .reaper(&reaper)
        .build()
        .unwrap();
    let busy = Timer::builder()
        .name("busy")
        .reaper(&reaper)
        .build()
        .unwrap();
    settle().await;
    let (idle_before, busy_before) = (idle.metrics(), busy.metrics());
    for d in 1..=20 {
        busy.schedule(ms(d), || {}).unwrap();
    }
    for _ in 0..25 {
        advance(ms(1)).await;
        settle().await;
    }
    let (idle_after, busy_after) = (idle.metrics(), busy.metrics());
    let idle_turns = idle_after.reaper.turns - idle_before.reaper.turns;
    let busy_turns = busy_after.reaper.turns - busy_before.reaper.turns;
    assert!(busy_turns >= 20, "{busy_turns}");
    assert_eq!(
        idle_turns, busy_turns,
        "one turn of the reaper, one on each"
    );
    assert_eq!(idle_after.expired, 0);
    assert_eq!(idle_after.reaper.largest_batch, 0);
    assert_eq!(busy_after.expired, 20);
}

// ---------------------------------------------------------------------------
// 8. A waker holding the last Timer clone, woken by the reaper, on a shared
// reaper; other timers beside it go on.

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_sleep_waker_drops_the_last_timer_on_a_shared_reaper() {
    use std::task::{Context, Wake, Waker};
    struct W(
        Mutex<Option<Timer>>,
        tokio_purgatory::WeakTimer,
        Arc<AtomicUsize>,
    );
    impl Wake for W {
        fn wake(self: Arc<Self>) {
            self.wake_by_ref()
        }
        fn wake_by_ref(self: &Arc<Self>) {
            assert!(self.1.upgrade().is_some());
            let t = self.0.lock().unwrap().take();
            drop(t);
            if self.1.upgrade().is_none() {
                self.2.fetch_add(1, Ordering::SeqCst);
            }
        }
    }
    let reaper = Reaper::start().unwrap();
    let t = Timer::builder().reaper(&reaper).build().unwrap();
    let neighbour = Timer::builder().reaper(&reaper).build().unwrap();
    let gone = Arc::new(AtomicUsize::new(0));
    let w = Arc::new(W(Mutex::new(Some(t.clone())), t.downgrade(), gone.clone()));
    let waker = Waker::from(w.clone());
    let mut nap = Box::pin(t.sleep(ms(5)));
    let later = t.sleep(ms(50));
    let fired = Arc::new(AtomicUsize::new(0));
    let f = fired.clone();
    neighbour
        .schedule(ms(20), move || {
            f.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
    assert!(nap
        .as_mut()
        .poll(&mut Context::from_waker(&waker))
        .is_pending());
    drop(t);
    advance(ms(6)).await;
    settle().await;
    assert_eq!(
        gone.load(Ordering::SeqCst),
        1,
        "the waker dropped the last clone"
    );
    assert_eq!(later.await, Err(tokio_purgatory::TimerError::Shutdown));
    assert_eq!(reaper.serving(), 1);
    for _ in 0..20 {
        advance(ms(1)).await;
        settle().await;
    }
    assert_eq!(fired.load(Ordering::SeqCst), 1);
    use std::future::Future;
}

// ---------------------------------------------------------------------------
// 9. The `metrics` feature: a recorder whose lateness histogram calls back into
// the purgatory and the timer from the reaper (metrics, record, shutdown).

#[cfg(feature = "metrics")]
mod recorder {
    use super::*;
    use support::recorded::Histograms;

    struct CallbackHistogram(Arc<dyn Fn() + Send + Sync>);
    impl metrics::HistogramFn for CallbackHistogram {
        fn record(&self, _: f64) {
            (self.0)()
        }
    }

    struct DropPanics;
    impl metrics::HistogramFn for DropPanics {
        fn record(&self, _: f64) {}
    }
    impl Drop for DropPanics {
        fn drop(&mut self) {
            if !std::thread::panicking() {
                panic!("the recorder's histogram panics when dropped");
            }
        }
    }

    #[test]
    fn a_recorder_calling_back_in_from_the_reaper() {
        within(20, || {
            paused().block_on(async {
                let reaper = Reaper::start().unwrap();
                let slot_p: Arc<Mutex<Option<WeakPurgatory<u32, Never>>>> = Arc::default();
                let slot_t: Arc<Mutex<Option<tokio_purgatory::WeakTimer>>> = Arc::default();
                let calls = Arc::new(AtomicUsize::new(0));
                let (sp, st, c) = (slot_p.clone(), slot_t.clone(), calls.clone());
                let on_record: Arc<dyn Fn() + Send + Sync> = Arc::new(move || {
                    let n = c.fetch_add(1, Ordering::SeqCst);
                    let p = sp.lock().unwrap().clone().and_then(|w| w.upgrade());
                    if let Some(p) = p {
                        let _ = p.metrics();
                        let _ = p.lateness();
                        p.record_metrics();
                        if n == 1 {
                            drop(p.shutdown());
                        }
                    }
                    let t = st.lock().unwrap().clone().and_then(|w| w.upgrade());
                    if let Some(t) = t {
                        let _ = t.metrics();
                        let _ = t.len();
                        t.record_metrics();
                        if n == 3 {
                            drop(t.shutdown());
                        }
                    }
                });
                let rec = Histograms(move || {
                    metrics::Histogram::from_arc(Arc::new(CallbackHistogram(on_record.clone())))
                });
                let (p, t) = metrics::with_local_recorder(&rec, || {
                    let p: Purgatory<u32, Never> =
                        Purgatory::builder().reaper(&reaper).build().unwrap();
                    let t = Timer::builder().reaper(&reaper).build().unwrap();
                    (p, t)
                });
                *slot_p.lock().unwrap() = Some(p.downgrade());
                *slot_t.lock().unwrap() = Some(t.downgrade());
                let hs: Vec<_> = (0..4)
                    .map(|i| p.try_complete_else_watch(Never, ms(5), [i]).unwrap())
                    .collect();
                let ran = Arc::new(AtomicUsize::new(0));
                for _ in 0..4 {
                    let r = ran.clone();
                    t.schedule(ms(5), move || {
                        r.fetch_add(1, Ordering::SeqCst);
                    })
                    .unwrap();
                }
                advance(ms(6)).await;
                settle().await;
                let mut outs = Vec::new();
                for h in hs {
                    outs.push(
                        tokio::time::timeout(Duration::from_secs(5), h)
                            .await
                            .expect("resolved"),
                    );
                }
                assert!(balanced(&p.metrics()), "{:?}", p.metrics());
                assert_eq!(p.metrics().delayed, 0);
                assert!(p.is_shutdown() && t.is_shutdown());
            })
        });
    }

    /// The recorder's histogram panics in its Drop: the core holding it is last
    /// dropped on the shared reaper's task once its purgatory has gone. Does that
    /// panic take the shared reaper (and every neighbour) down?
    #[test]
    fn a_recorder_handle_panicking_on_drop_does_not_kill_the_shared_reaper() {
        within(20, || {
            paused().block_on(async {
                let reaper = Reaper::start().unwrap();
                // Its histograms panic when dropped.
                let rec = Histograms(|| metrics::Histogram::from_arc(Arc::new(DropPanics)));
                let p: Purgatory<u32, Never> = metrics::with_local_recorder(&rec, || {
                    Purgatory::builder()
                        .name("hostile")
                        .reaper(&reaper)
                        .build()
                        .unwrap()
                });
                let neighbour = Timer::builder()
                    .name("neighbour")
                    .reaper(&reaper)
                    .build()
                    .unwrap();
                let ran = Arc::new(AtomicUsize::new(0));
                let r = ran.clone();
                neighbour
                    .schedule(ms(10), move || {
                        r.fetch_add(1, Ordering::SeqCst);
                    })
                    .unwrap();
                settle().await;
                drop(p); // the last clone and the last handle: only the hub keeps the core
                settle().await;
                advance(ms(11)).await;
                settle().await;
                assert!(!reaper.is_stopped(), "the shared reaper task died");
                assert!(!neighbour.is_shutdown(), "the neighbour was closed");
                assert_eq!(ran.load(Ordering::SeqCst), 1, "the neighbour's task ran");
            })
        });
    }
}

/// Histogram edges: quantile clamping, bucket sums, an empty histogram.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn histogram_edges() {
    let timer = Timer::new();
    for d in [1u64, 3, 7, 20, 100] {
        timer.schedule(ms(d), || {}).unwrap();
        advance(ms(d) + ms(d) / 2).await;
        settle().await;
    }
    let h = timer.lateness();
    assert_eq!(h.count(), 5);
    assert_eq!(h.buckets().map(|(_, c)| c).sum::<u64>(), h.count());
    assert_eq!(h.quantile(-3.0), h.quantile(0.0));
    assert_eq!(h.quantile(7.0), h.max());
    assert_eq!(h.quantile(f64::INFINITY), h.max());
    let nan = h.quantile(f64::NAN);
    assert!(nan <= h.max());
    assert!(h.mean() <= h.max() && h.sum() >= h.max());
    let mut last = Duration::ZERO;
    for (upper, _) in h.buckets() {
        assert!(upper > last);
        last = upper;
    }
    let e = tokio_purgatory::Histogram::default();
    assert!(e.is_empty());
    assert_eq!(
        (e.max(), e.mean(), e.quantile(0.5), e.sum()),
        (
            Duration::ZERO,
            Duration::ZERO,
            Duration::ZERO,
            Duration::ZERO
        )
    );
}

// ---------------------------------------------------------------------------
// 8. The purgatory closes while another thread checks an operation: the close
// cannot take it, so the cancel it asks for is left to that check, and the
// handle learns why the purgatory closed, as the others do.

/// Says "not yet", holding its third check (the first after registration's
/// two) at `entered` until `release`.
struct HeldCheck {
    checks: usize,
    entered: Arc<std::sync::Barrier>,
    release: Arc<std::sync::Barrier>,
}

impl HeldCheck {
    fn new() -> (HeldCheck, Arc<std::sync::Barrier>, Arc<std::sync::Barrier>) {
        let entered = Arc::new(std::sync::Barrier::new(2));
        let release = Arc::new(std::sync::Barrier::new(2));
        let op = HeldCheck {
            checks: 0,
            entered: entered.clone(),
            release: release.clone(),
        };
        (op, entered, release)
    }
}

impl Operation for HeldCheck {
    type Output = ();
    fn try_complete(&mut self) -> Option<()> {
        self.checks += 1;
        if self.checks == 3 {
            self.entered.wait();
            self.release.wait();
        }
        None
    }
    fn on_expiration(self) {}
}

#[test]
fn a_check_running_as_the_reaper_is_lost_resolves_reaper_gone() {
    within(20, || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let p: Purgatory<u32, HeldCheck> = Purgatory::builder().build_on(rt.handle()).unwrap();
        rt.block_on(tokio::task::yield_now());
        let (op, entered, release) = HeldCheck::new();
        let h = p.try_complete_else_watch(op, ms(600_000), [1]).unwrap();
        let walker = {
            let p = p.clone();
            std::thread::spawn(move || p.try_complete_watched(&1))
        };
        entered.wait();
        drop(rt); // the reaper task goes with its runtime
        assert!(p.is_shutdown());
        release.wait();
        assert_eq!(walker.join().unwrap(), 0);
        assert_eq!(
            futures::executor::block_on(h),
            Err(OperationError::ReaperGone)
        );
        let m = p.metrics();
        assert_eq!(m.cancelled, 1, "{m:?}");
        assert!(balanced(&m), "{m:?}");
    });
}

#[test]
fn a_check_running_as_the_last_clone_goes_resolves_shutdown() {
    within(20, || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let p: Purgatory<u32, HeldCheck> = Purgatory::builder().build_on(rt.handle()).unwrap();
        let (op, entered, release) = HeldCheck::new();
        let h = p.try_complete_else_watch(op, ms(600_000), [1]).unwrap();
        let op_ref = h.op_ref().unwrap();
        let checker = std::thread::spawn(move || op_ref.try_complete());
        entered.wait();
        drop(p);
        release.wait();
        assert!(!checker.join().unwrap());
        assert_eq!(
            futures::executor::block_on(h),
            Err(OperationError::Shutdown)
        );
    });
}

#[test]
fn a_check_running_through_a_shutdown_resolves_shutdown() {
    within(20, || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let p: Purgatory<u32, HeldCheck> = Purgatory::builder().build_on(rt.handle()).unwrap();
        let (op, entered, release) = HeldCheck::new();
        let h = p.try_complete_else_watch(op, ms(600_000), [1]).unwrap();
        let walker = {
            let p = p.clone();
            std::thread::spawn(move || p.try_complete_watched(&1))
        };
        entered.wait();
        assert!(p.shutdown().is_empty(), "the operation being checked");
        release.wait();
        assert_eq!(walker.join().unwrap(), 0);
        assert_eq!(
            futures::executor::block_on(h),
            Err(OperationError::Shutdown)
        );
        let m = p.metrics();
        assert_eq!((m.cancelled, m.handed_back), (1, 0), "{m:?}");
        assert!(balanced(&m), "{m:?}");
    });
}

/// The operations a lost reaper cancels leave their watch-list entries as
/// any cancellation does: the last one purges them, and the keys go (no
/// later call would: the purgatory is closed).
#[test]
fn a_lost_reapers_cancellations_empty_the_watch_lists() {
    within(20, || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let p: Purgatory<u32, Never> = Purgatory::builder().build_on(rt.handle()).unwrap();
        let hs: Vec<_> = (0..5)
            .map(|i| {
                p.try_complete_else_watch(Never, ms(60_000), [i, 100])
                    .unwrap()
            })
            .collect();
        rt.block_on(tokio::task::yield_now());
        drop(rt);
        assert!(p.is_shutdown());
        for h in hs {
            assert_eq!(
                futures::executor::block_on(h),
                Err(OperationError::ReaperGone)
            );
        }
        let m = p.metrics();
        assert_eq!((m.cancelled, m.delayed), (5, 0), "{m:?}");
        assert_eq!((m.watched, m.tombstones, m.keys), (0, 0, 0), "{m:?}");
        assert!(p.shutdown().is_empty());
        assert!(balanced(&p.metrics()));
    });
}
