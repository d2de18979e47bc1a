//! The application's `tracing` subscriber is code of its own: one that panics
//! on every span and event the crate emits (registration, completion, purge,
//! the reaper's turns, a lost reaper's warning) must not stop operations from
//! registering, completing or expiring, nor tasks from running, nor leave a
//! handle unresolved when the reaper is lost. One test: the subscriber is
//! global to the process.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio_purgatory::{Completion, Operation, OperationError, Purgatory, Reaper, Timer};

mod support;
use support::{ms, settle};

/// Panics on everything it is asked to do, once the test arms it.
struct Hostile;

static ARMED: AtomicBool = AtomicBool::new(false);
static CALLS: AtomicUsize = AtomicUsize::new(0);

fn boom(what: &str) {
    if ARMED.load(Ordering::SeqCst) {
        CALLS.fetch_add(1, Ordering::SeqCst);
        panic!("hostile subscriber: {what}");
    }
}

impl tracing::Subscriber for Hostile {
    fn register_callsite(
        &self,
        _: &'static tracing::Metadata<'static>,
    ) -> tracing::subscriber::Interest {
        tracing::subscriber::Interest::always()
    }
    fn max_level_hint(&self) -> Option<tracing::level_filters::LevelFilter> {
        Some(tracing::level_filters::LevelFilter::TRACE)
    }
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        boom("new_span");
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {
        boom("record");
    }
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, _: &tracing::Event<'_>) {
        boom("event");
    }
    fn enter(&self, _: &tracing::span::Id) {
        boom("enter");
    }
    fn exit(&self, _: &tracing::span::Id) {
        boom("exit");
    }
    fn try_close(&self, _: tracing::span::Id) -> bool {
        boom("try_close");
        true
    }
}

struct Op(Arc<AtomicBool>);

impl Operation for Op {
    type Output = &'static str;
    fn try_complete(&mut self) -> Option<&'static str> {
        self.0.load(Ordering::SeqCst).then_some("done")
    }
    fn on_expiration(self) -> &'static str {
        "expired"
    }
}

#[test]
fn a_subscriber_that_panics_on_everything_changes_nothing() {
    tracing::subscriber::set_global_default(Hostile).expect("the only subscriber");
    ARMED.store(true, Ordering::SeqCst);

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    let reaper_lost = rt.block_on(async {
        let ready = Arc::new(AtomicBool::new(false));
        let p: Purgatory<u32, Op> = Purgatory::builder().purge_interval(0).build().unwrap();
        let by_event: Vec<_> = (0..50)
            .map(|i| {
                p.try_complete_else_watch(Op(ready.clone()), ms(100), [i % 5, 5 + i % 3])
                    .unwrap()
            })
            .collect();
        let expiring: Vec<_> = (0..50u32)
            .map(|i| {
                p.try_complete_else_watch(Op(Arc::default()), ms(10 + u64::from(i)), [100 + i])
                    .unwrap()
            })
            .collect();
        ready.store(true, Ordering::SeqCst);
        let completed: usize = (0..5).map(|k| p.try_complete_watched(&k)).sum();
        assert_eq!(completed, 50);
        for h in by_event {
            assert_eq!(h.await, Ok(Completion::Completed("done")));
        }
        for h in expiring {
            assert_eq!(h.await, Ok(Completion::Expired("expired")));
        }
        let m = p.metrics();
        assert_eq!(
            (m.registered, m.completed, m.expired, m.delayed),
            (100, 50, 50, 0)
        );
        assert_eq!(
            m.panicked, 0,
            "the subscriber's panics are not the operations'"
        );

        // A timer and a neighbour on a shared reaper: every task runs.
        let reaper = Reaper::start().unwrap();
        let timer = Timer::new();
        let neighbour = Timer::builder().reaper(&reaper).build().unwrap();
        let ran = Arc::new(AtomicUsize::new(0));
        for d in [10, 20, 30] {
            for t in [&timer, &neighbour] {
                let r = ran.clone();
                t.schedule(ms(d), move || {
                    r.fetch_add(1, Ordering::SeqCst);
                })
                .unwrap();
            }
        }
        tokio::time::sleep(ms(40)).await;
        settle().await;
        assert_eq!(ran.load(Ordering::SeqCst), 6);
        assert!(!timer.is_shutdown() && !neighbour.is_shutdown() && !reaper.is_stopped());

        // Left pending for the runtime's end: the reaper is lost.
        let pending = p
            .try_complete_else_watch(Op(Arc::default()), Duration::from_secs(60), [1])
            .unwrap();
        let sleeping = neighbour.sleep(Duration::from_secs(60));
        (p, pending, sleeping, timer, neighbour)
    });
    // The runtime goes, and its reaper tasks with it: the warning each core
    // gives panics, and every handle still resolves.
    drop(rt);
    let (p, pending, sleeping, timer, neighbour) = reaper_lost;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let bound = Duration::from_secs(10);
        assert_eq!(
            tokio::time::timeout(bound, pending)
                .await
                .expect("resolves"),
            Err(OperationError::ReaperGone)
        );
        assert!(tokio::time::timeout(bound, sleeping)
            .await
            .expect("resolves")
            .is_err());
        assert!(p.is_shutdown() && timer.is_shutdown() && neighbour.is_shutdown());
    });
    assert!(
        CALLS.load(Ordering::SeqCst) > 0,
        "the subscriber was called"
    );
}
