//! The application's `metrics` recorder is code of its own: one whose
//! callbacks (`register_counter`, `register_gauge`, `register_histogram`, a
//! counter's `increment` and `absolute`, a gauge's `increment`, `decrement`
//! and `set`, a histogram's `record`, and the `Drop` of the handles it gave)
//! call back into the crate, panic or block briefly. Where the reaper or a
//! check records a lateness sample, on the reaper or on the checking thread,
//! a recorder that calls back in (reading the figures, registering, walking,
//! cancelling, shutting down, dropping the last clone) deadlocks nothing,
//! and one that panics is caught and counted in `panicked`; the reaper goes
//! on serving its neighbours, even when the lateness handle's `Drop` calls
//! back in and panics there. In `record_metrics()` and `build()`, calls the
//! application makes itself, the recorder may call back in too, and its
//! panic reaches that caller, leaving the purgatory, the timer and a shared
//! reaper as they were. Every handle resolves and the counts balance.
//!
//! Built with the `metrics` feature only (`--all-features`). Each test gives
//! its recorder to its own thread (`with_local_recorder`, no global one), on
//! paused time but for the two on multi-thread runtimes, real time, bounded.
#![cfg(feature = "metrics")]

mod support;

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::advance;
use tokio_purgatory::{Completion, Operation, OperationError, Purgatory, Reaper, Timer};

use support::{balanced, get, ms, paused_within, resolve, settle, within, Slot};

// ---------------------------------------------------------------- recorder

/// The recorder's code, told what the crate asked of it: `register_counter`,
/// `register_gauge`, `register_histogram`, `counter`, `gauge`, `record`,
/// `drop` (a handle dropped), with the metric's name.
type Hook = Arc<dyn Fn(&'static str, &str) + Send + Sync>;

thread_local! {
    static DEPTH: Cell<usize> = const { Cell::new(0) };
}

fn fire(hook: &Hook, what: &'static str, name: &str) {
    if DEPTH.with(|d| d.get()) > 0 {
        return;
    }
    struct Reset;
    impl Drop for Reset {
        fn drop(&mut self) {
            DEPTH.with(|d| d.set(0));
        }
    }
    DEPTH.with(|d| d.set(1));
    let _reset = Reset;
    hook(what, name);
}

struct Handle {
    hook: Hook,
    name: String,
}

impl metrics::CounterFn for Handle {
    fn increment(&self, _: u64) {
        fire(&self.hook, "counter", &self.name);
    }
    fn absolute(&self, _: u64) {
        fire(&self.hook, "counter", &self.name);
    }
}

impl metrics::GaugeFn for Handle {
    fn increment(&self, _: f64) {
        fire(&self.hook, "gauge", &self.name);
    }
    fn decrement(&self, _: f64) {
        fire(&self.hook, "gauge", &self.name);
    }
    fn set(&self, _: f64) {
        fire(&self.hook, "gauge", &self.name);
    }
}

impl metrics::HistogramFn for Handle {
    fn record(&self, _: f64) {
        fire(&self.hook, "record", &self.name);
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        fire(&self.hook, "drop", &self.name);
    }
}

struct Hooked(Hook);

impl Hooked {
    fn new(hook: impl Fn(&'static str, &str) + Send + Sync + 'static) -> Hooked {
        Hooked(Arc::new(hook))
    }
    fn handle(&self, key: &metrics::Key) -> Arc<Handle> {
        Arc::new(Handle {
            hook: self.0.clone(),
            name: key.name().to_owned(),
        })
    }
}

impl metrics::Recorder for Hooked {
    support::recorded::no_descriptions!();
    fn register_counter(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        fire(&self.0, "register_counter", key.name());
        metrics::Counter::from_arc(self.handle(key))
    }
    fn register_gauge(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        fire(&self.0, "register_gauge", key.name());
        metrics::Gauge::from_arc(self.handle(key))
    }
    fn register_histogram(
        &self,
        key: &metrics::Key,
        _: &metrics::Metadata<'_>,
    ) -> metrics::Histogram {
        fire(&self.0, "register_histogram", key.name());
        metrics::Histogram::from_arc(self.handle(key))
    }
}

// ---------------------------------------------------------------- operations

struct Op {
    ready: Arc<AtomicBool>,
}

impl Operation for Op {
    type Output = &'static str;
    fn try_complete(&mut self) -> Option<&'static str> {
        self.ready.load(Ordering::SeqCst).then_some("done")
    }
    fn on_expiration(self) -> &'static str {
        "expired"
    }
}

fn never() -> Op {
    Op {
        ready: Arc::default(),
    }
}

type P = Purgatory<u32, Op>;

// ---------------------------------------------------------------- tests

/// The lateness histogram, recorded on the reaper between the expiries of
/// one batch: the recorder reads the figures, registers (refused once shut
/// down: the operation comes back), cancels by key, and shuts the purgatory
/// down at its third sample. Every handle resolves; the counts balance.
#[test]
fn lateness_record_reenters_on_the_reaper() {
    paused_within(60, || async {
        let slot: Slot<P> = Arc::default();
        let tslot: Slot<Timer> = Arc::default();
        let samples = Arc::new(AtomicUsize::new(0));
        let handed = Arc::new(AtomicUsize::new(0));
        let refused = Arc::new(AtomicUsize::new(0));
        let extra = Arc::new(Mutex::new(Vec::new()));
        let (s, t, n, hb, rf, x) = (
            slot.clone(),
            tslot.clone(),
            samples.clone(),
            handed.clone(),
            refused.clone(),
            extra.clone(),
        );
        let rec = Hooked::new(move |what, _| {
            if what != "record" {
                return;
            }
            let i = n.fetch_add(1, Ordering::SeqCst);
            if let Some(p) = get(&s) {
                let _ = (p.metrics(), p.watched(), p.delayed());
                match p.try_complete_else_watch(never(), ms(5), [1000 + i as u32]) {
                    Ok(h) => x.lock().unwrap().push(h),
                    Err(e) => {
                        rf.fetch_add(1, Ordering::SeqCst);
                        drop(e.into_inner());
                    }
                }
                drop(p.cancel_for_key(&(500 + i as u32)));
                if i == 2 {
                    hb.fetch_add(p.shutdown().len(), Ordering::SeqCst);
                }
            }
            if let Some(t) = get(&t) {
                let _ = (t.len(), t.metrics());
                let _ = t.schedule(ms(1), || {});
            }
        });
        let (p, timer) = metrics::with_local_recorder(&rec, || {
            let p: P = Purgatory::builder()
                .name("late")
                .timer_shards(1)
                .build()
                .unwrap();
            (p, Timer::builder().name("late-timer").build().unwrap())
        });
        *slot.lock().unwrap() = Some(p.clone());
        *tslot.lock().unwrap() = Some(timer.clone());
        let hs: Vec<_> = (0..20u32)
            .map(|i| {
                p.try_complete_else_watch(never(), ms(10), [i, 500 + i])
                    .unwrap()
            })
            .collect();
        let far: Vec<_> = (0..5u32)
            .map(|i| p.try_complete_else_watch(never(), ms(10_000), [i]).unwrap())
            .collect();
        advance(ms(11)).await;
        let (mut expired, mut cancelled, mut shut) = (0, 0, 0);
        for h in hs.into_iter().chain(far) {
            match resolve(h).await {
                Ok(Completion::Expired(_)) => expired += 1,
                Err(OperationError::Cancelled) => cancelled += 1,
                Err(OperationError::Shutdown) => shut += 1,
                other => panic!("{other:?}"),
            }
        }
        // Taken out first: the lock is not held while they resolve.
        let from_the_recorder = std::mem::take(&mut *extra.lock().unwrap());
        for h in from_the_recorder {
            let out = resolve(h).await;
            assert!(
                matches!(
                    out,
                    Ok(Completion::Expired(_)) | Err(OperationError::Shutdown)
                ),
                "{out:?}"
            );
        }
        advance(ms(20)).await;
        settle().await;
        let m = p.metrics();
        assert!(balanced(&m), "{m:?}");
        assert_eq!(m.delayed, 0, "{m:?}");
        // Handed back: those of the test, and those the recorder registered.
        assert_eq!(m.handed_back, handed.load(Ordering::SeqCst) as u64, "{m:?}");
        assert!(shut as u64 <= m.handed_back);
        assert_eq!(expired + cancelled + shut, 25);
        assert!(refused.load(Ordering::SeqCst) > 0);
        assert_eq!(m.panicked, 0, "{m:?}");
        *slot.lock().unwrap() = None;
        *tslot.lock().unwrap() = None;
    });
}

/// The timer's lateness histogram: the recorder shuts the timer down, then
/// drops the last clone, from the reaper, between the tasks of one batch.
/// Tasks taken out already run (documented); the others come back; the
/// reaper, shared, goes on serving a neighbour.
#[test]
fn timer_lateness_record_shuts_down_and_drops_the_last_clone() {
    paused_within(60, || async {
        let tslot: Slot<Timer> = Arc::default();
        let handed = Arc::new(AtomicUsize::new(0));
        let (t, hb) = (tslot.clone(), handed.clone());
        let rec = Hooked::new(move |what, _| {
            if what == "record" {
                let taken = t.lock().unwrap().take();
                if let Some(timer) = taken {
                    hb.fetch_add(timer.shutdown().len(), Ordering::SeqCst);
                    drop(timer);
                }
            }
        });
        let reaper = Reaper::start().unwrap();
        let timer = metrics::with_local_recorder(&rec, || {
            Timer::builder()
                .name("t")
                .reaper(&reaper)
                .shards(1)
                .build()
                .unwrap()
        });
        let neighbour = Timer::builder().name("n").reaper(&reaper).build().unwrap();
        let ran = Arc::new(AtomicUsize::new(0));
        for d in [10, 10, 10, 10, 50, 50] {
            let r = ran.clone();
            timer
                .schedule(ms(d), move || {
                    r.fetch_add(1, Ordering::SeqCst);
                })
                .unwrap();
        }
        let weak = timer.downgrade();
        *tslot.lock().unwrap() = Some(timer);
        advance(ms(11)).await;
        settle().await;
        assert!(weak.upgrade().is_none());
        let ran_n = ran.load(Ordering::SeqCst);
        assert_eq!(ran_n + handed.load(Ordering::SeqCst), 6, "ran {ran_n}");
        let r = Arc::new(AtomicBool::new(false));
        let r2 = r.clone();
        neighbour
            .schedule(ms(5), move || r2.store(true, Ordering::SeqCst))
            .unwrap();
        advance(ms(6)).await;
        settle().await;
        assert!(r.load(Ordering::SeqCst));
        assert!(!reaper.is_stopped());
    });
}

/// An expiry left to a running check (the reaper found the operation being
/// checked): the check's thread records the lateness sample, and the
/// recorder there walks the same key, cancels by it, and shuts the
/// purgatory down. No deadlock, no panic out of the walk, the handle
/// resolves expired, the counts balance. The check is held on a channel
/// while the paused clock passes the deadline and the reaper's turn runs.
#[test]
fn lateness_recorded_by_a_check_reenters() {
    within(60, || {
        struct Slow {
            entered: Arc<AtomicBool>,
            gate: Arc<AtomicBool>,
            held: Option<(std::sync::mpsc::Sender<()>, std::sync::mpsc::Receiver<()>)>,
        }
        impl Operation for Slow {
            type Output = &'static str;
            fn try_complete(&mut self) -> Option<&'static str> {
                if self.gate.load(Ordering::SeqCst) {
                    self.entered.store(true, Ordering::SeqCst);
                    // Held until the reaper has found it being checked.
                    if let Some((inside, go)) = self.held.take() {
                        inside.send(()).unwrap();
                        go.recv_timeout(Duration::from_secs(10)).unwrap();
                    }
                }
                None
            }
            fn on_expiration(self) -> &'static str {
                "expired"
            }
        }
        type PS = Purgatory<u32, Slow>;
        let slot: Slot<PS> = Arc::default();
        let where_recorded = Arc::new(Mutex::new(Vec::new()));
        let (s, w) = (slot.clone(), where_recorded.clone());
        let rec = Hooked::new(move |what, _| {
            if what != "record" {
                return;
            }
            w.lock()
                .unwrap()
                .push(std::thread::current().name().map(str::to_owned));
            if let Some(p) = get(&s) {
                p.try_complete_watched(&1);
                drop(p.cancel_for_key(&1));
                drop(p.shutdown());
            }
        });
        let rt = support::paused();
        let _g = rt.enter();
        let p: PS = metrics::with_local_recorder(&rec, || {
            Purgatory::builder().name("deferred").build().unwrap()
        });
        let gate = Arc::new(AtomicBool::new(false));
        let entered = Arc::new(AtomicBool::new(false));
        let (inside_tx, inside) = std::sync::mpsc::channel();
        let (go, go_rx) = std::sync::mpsc::channel();
        let h = p
            .try_complete_else_watch(
                Slow {
                    entered: entered.clone(),
                    gate: gate.clone(),
                    held: Some((inside_tx, go_rx)),
                },
                ms(100),
                [1, 2],
            )
            .unwrap();
        *slot.lock().unwrap() = Some(p.clone());
        gate.store(true, Ordering::SeqCst);
        // The check runs on a thread of our own and is held there while the
        // deadline passes and the reaper finds it being checked.
        let p2 = p.clone();
        let walker = std::thread::Builder::new()
            .name("walker".into())
            .spawn(move || p2.try_complete_watched(&2))
            .unwrap();
        inside.recv_timeout(Duration::from_secs(10)).unwrap();
        rt.block_on(async {
            tokio::time::advance(ms(101)).await;
            support::settle().await;
        });
        go.send(()).unwrap();
        let walked = walker.join();
        assert!(walked.is_ok(), "a panic out of the walk");
        assert!(entered.load(Ordering::SeqCst));
        let out = rt.block_on(async { tokio::time::timeout(Duration::from_secs(10), h).await });
        assert_eq!(out.expect("resolves"), Ok(Completion::Expired("expired")));
        let m = p.metrics();
        assert!(balanced(&m), "{m:?}");
        assert_eq!((m.expired, m.delayed), (1, 0), "{m:?}");
        let recorded = where_recorded.lock().unwrap().clone();
        eprintln!("lateness recorded on {recorded:?}");
        assert_eq!(recorded, [Some("walker".to_owned())], "by the check");
        *slot.lock().unwrap() = None;
    });
}

/// `record_metrics` with a recorder whose every registration and update
/// calls back in: figures, a registration, a walk, a cancellation by key,
/// a shutdown (at the first gauge), and the timer's schedule and shutdown.
/// No deadlock, the counts balance.
#[test]
fn record_metrics_reenters() {
    paused_within(60, || async {
        let slot: Slot<P> = Arc::default();
        let tslot: Slot<Timer> = Arc::default();
        let calls = Arc::new(AtomicUsize::new(0));
        let (s, t, c) = (slot.clone(), tslot.clone(), calls.clone());
        let rec = Hooked::new(move |what, name| {
            c.fetch_add(1, Ordering::SeqCst);
            if let Some(p) = get(&s) {
                let _ = (p.metrics(), p.watched(), p.delayed());
                if let Ok(h) = p.try_complete_else_watch(never(), ms(5), [77]) {
                    h.detach();
                }
                p.try_complete_watched(&77);
                if name == "tokio_purgatory_watched" {
                    drop(p.cancel_for_key(&77));
                }
                if what == "gauge" && name == "tokio_purgatory_cells" {
                    drop(p.shutdown());
                }
                p.record_metrics();
            }
            if let Some(t) = get(&t) {
                let _ = (t.len(), t.metrics());
                let _ = t.schedule(ms(1), || {});
                if name == "tokio_purgatory_timer_expired_total" {
                    drop(t.shutdown());
                }
            }
        });
        let p: P = Purgatory::builder().name("rm").build().unwrap();
        let timer = Timer::builder().name("rm-timer").build().unwrap();
        let h = p.try_complete_else_watch(never(), ms(1000), [1]).unwrap();
        *slot.lock().unwrap() = Some(p.clone());
        *tslot.lock().unwrap() = Some(timer.clone());
        metrics::with_local_recorder(&rec, || {
            p.record_metrics();
            timer.record_metrics();
        });
        assert!(p.is_shutdown() && timer.is_shutdown());
        assert_eq!(resolve(h).await, Err(OperationError::Shutdown));
        advance(ms(10)).await;
        settle().await;
        let m = p.metrics();
        assert!(balanced(&m), "{m:?}");
        assert_eq!(m.delayed, 0, "{m:?}");
        assert!(calls.load(Ordering::SeqCst) > 20);
        *slot.lock().unwrap() = None;
        *tslot.lock().unwrap() = None;
    });
}

/// The lateness histogram's handle is dropped with the timer's core: by the
/// reaper when it lets go of it. Its `Drop` calls back in: schedules on a
/// neighbour on the same reaper, builds a new timer on that reaper, reads
/// `serving()`, shuts a purgatory on it down, blocks briefly, then panics.
/// The reaper goes on, and so do its neighbours.
#[test]
fn histogram_handle_drop_reenters_on_the_reaper() {
    paused_within(60, || async {
        let reaper = Reaper::start().unwrap();
        let neighbour = Timer::builder().name("n").reaper(&reaper).build().unwrap();
        let p: P = Purgatory::builder()
            .name("np")
            .reaper(&reaper)
            .build()
            .unwrap();
        let dropped = Arc::new(AtomicUsize::new(0));
        let ran = Arc::new(AtomicUsize::new(0));
        let built = Arc::new(Mutex::new(Vec::new()));
        let (n, pp, rp, d, r, b) = (
            neighbour.clone(),
            p.clone(),
            reaper.clone(),
            dropped.clone(),
            ran.clone(),
            built.clone(),
        );
        let deps = Arc::new(Mutex::new(Some((n, pp, rp))));
        let rec = Hooked::new(move |what, name| {
            if what != "drop" || name != "tokio_purgatory_lateness_seconds" {
                return;
            }
            d.fetch_add(1, Ordering::SeqCst);
            let taken = deps.lock().unwrap().take();
            if let Some((n, pp, rp)) = taken {
                let r = r.clone();
                n.schedule(ms(5), move || {
                    r.fetch_add(1, Ordering::SeqCst);
                })
                .unwrap();
                let _ = rp.serving();
                if let Ok(t) = Timer::builder().name("late-built").reaper(&rp).build() {
                    b.lock().unwrap().push(t);
                }
                drop(pp.shutdown());
                std::thread::sleep(ms(5));
                panic!("the histogram handle's drop");
            }
        });
        let doomed = metrics::with_local_recorder(&rec, || {
            Timer::builder()
                .name("doomed")
                .reaper(&reaper)
                .build()
                .unwrap()
        });
        doomed.schedule(ms(1), || {}).unwrap();
        advance(ms(2)).await;
        settle().await;
        // Closed: the reaper lets go of it on its next turn.
        drop(doomed);
        // Something due for the reaper's next turn.
        let r2 = ran.clone();
        neighbour
            .schedule(ms(1), move || {
                r2.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap();
        advance(ms(2)).await;
        settle().await;
        advance(ms(10)).await;
        settle().await;
        assert_eq!(dropped.load(Ordering::SeqCst), 1, "the handle was dropped");
        assert_eq!(ran.load(Ordering::SeqCst), 2, "both neighbour tasks ran");
        assert!(p.is_shutdown());
        assert!(!reaper.is_stopped());
        assert_eq!(built.lock().unwrap().len(), 1);
        assert_eq!(
            reaper.serving(),
            2,
            "neighbour and the timer built in the drop"
        );
    });
}

/// `register_histogram` runs at build (the lateness handle is bound then):
/// the recorder calls back in there, building on the same shared reaper and
/// reading `serving()`; then one that panics: the build panics to its
/// caller (it is the caller's own call), and the reaper is left as it was.
#[test]
fn register_histogram_at_build_reenters_and_panics() {
    paused_within(60, || async {
        let reaper = Reaper::start().unwrap();
        let extra = Arc::new(Mutex::new(Vec::new()));
        let (rp, x) = (reaper.clone(), extra.clone());
        let rec = Hooked::new(move |what, _| {
            if what == "register_histogram" {
                let _ = rp.serving();
                let t = Timer::builder().name("inner").reaper(&rp).build().unwrap();
                x.lock().unwrap().push(t);
            }
        });
        let t = metrics::with_local_recorder(&rec, || {
            Timer::builder()
                .name("outer")
                .reaper(&reaper)
                .build()
                .unwrap()
        });
        assert_eq!(reaper.serving(), 2);
        let panicking = Hooked::new(|what, _| {
            if what == "register_histogram" {
                panic!("register_histogram");
            }
        });
        let built = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            metrics::with_local_recorder(&panicking, || {
                Purgatory::<u32, Op>::builder()
                    .name("p")
                    .reaper(&reaper)
                    .build()
                    .map(|_| ())
            })
        }));
        assert!(
            built.is_err(),
            "the build with a panicking register_histogram did not panic to its caller: {:?}",
            built.as_ref().map(|_| ())
        );
        assert_eq!(reaper.serving(), 2);
        let ran = Arc::new(AtomicBool::new(false));
        let r = ran.clone();
        t.schedule(ms(1), move || r.store(true, Ordering::SeqCst))
            .unwrap();
        advance(ms(2)).await;
        settle().await;
        assert!(ran.load(Ordering::SeqCst));
    });
}

/// A recorder whose lateness samples block briefly and panic, with expiries
/// on the reaper and walks on two threads: no deadlock, every handle
/// resolves, every panic is counted in `panicked` (which counts "the
/// recorder's calls it made on the reaper"), the counts balance.
#[test]
fn slow_and_panicking_lateness_on_a_multi_thread_runtime() {
    within(120, || {
        let rec = Hooked::new(|what, _| {
            if what == "record" {
                std::thread::sleep(Duration::from_micros(300));
                panic!("lateness");
            }
        });
        let rt = support::multi();
        let _g = rt.enter();
        let p: P = metrics::with_local_recorder(&rec, || {
            Purgatory::builder().name("slow").build().unwrap()
        });
        let ready = Arc::new(AtomicBool::new(false));
        let hs: Vec<_> = (0..300u32)
            .map(|i| {
                p.try_complete_else_watch(
                    Op {
                        ready: ready.clone(),
                    },
                    ms(1 + u64::from(i % 30)),
                    [i % 5],
                )
                .unwrap()
            })
            .collect();
        let walkers: Vec<_> = (0..2)
            .map(|_| {
                let p = p.clone();
                let ready = ready.clone();
                std::thread::spawn(move || {
                    for i in 0..200 {
                        if i == 100 {
                            // Some expired first (their lateness recorded,
                            // panicking); the rest complete by these walks.
                            let give_up = std::time::Instant::now() + Duration::from_secs(10);
                            while p.metrics().expired == 0 {
                                assert!(std::time::Instant::now() < give_up, "nothing expired");
                                std::thread::yield_now();
                            }
                            ready.store(true, Ordering::SeqCst);
                        }
                        p.try_complete_watched(&(i % 5));
                    }
                })
            })
            .collect();
        for w in walkers {
            w.join().unwrap();
        }
        rt.block_on(async {
            for h in hs {
                let out = tokio::time::timeout(Duration::from_secs(30), h)
                    .await
                    .expect("resolves");
                assert!(out.is_ok(), "{out:?}");
            }
        });
        // The reaper records an expiry's lateness (here: blocks, then
        // panics, counted) after the expiry resolved its handle.
        let give_up = std::time::Instant::now() + Duration::from_secs(10);
        while p.metrics().panicked < p.metrics().expired && std::time::Instant::now() < give_up {
            std::thread::yield_now();
        }
        let m = p.metrics();
        assert!(balanced(&m), "{m:?}");
        assert_eq!(m.delayed, 0);
        assert!(
            m.expired > 0,
            "some expired, so the recorder was called: {m:?}"
        );
        assert_eq!(
            m.panicked, m.expired,
            "one recorder panic per expiry: {m:?}"
        );
    });
}

/// A recorder that panics in `record_metrics` (the caller's own call): the
/// panic reaches that caller, and the purgatory is unaffected (the crate
/// docs: "in `record_metrics()`, the purgatory or timer is unchanged").
#[test]
fn record_metrics_with_a_panicking_recorder_panics_to_its_caller() {
    paused_within(60, || async {
        let rec = Hooked::new(|what, _| {
            if what == "gauge" {
                panic!("gauge");
            }
        });
        let p: P = Purgatory::builder().name("rmp").build().unwrap();
        let h = p.try_complete_else_watch(never(), ms(10), [1]).unwrap();
        let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            metrics::with_local_recorder(&rec, || p.record_metrics())
        }));
        assert!(out.is_err(), "the recorder's panic reaches the caller");
        advance(ms(11)).await;
        assert_eq!(resolve(h).await, Ok(Completion::Expired("expired")));
        let m = p.metrics();
        assert!(balanced(&m) && m.panicked == 0, "{m:?}");
    });
}
