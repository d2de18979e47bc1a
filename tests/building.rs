//! Building a purgatory at and past every setting's limit: each refusal is
//! a clear error naming its setting (checked before the runtime and the
//! shared reaper), every accepted edge value works, a live shared reaper
//! needs no runtime, and a dead runtime's handle gives a purgatory that
//! refuses work with the operation handed back.

mod support;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio_purgatory::{BuildError, Operation, Purgatory, Reaper, WatchError};

use support::{ms, settle};

/// An operation that counts its drops, completes once its flag is set.
#[derive(Clone)]
struct Op {
    ready: Arc<AtomicBool>,
    drops: Arc<AtomicUsize>,
    id: u32,
}

impl Op {
    fn new(id: u32) -> Op {
        Op {
            ready: Arc::new(AtomicBool::new(false)),
            drops: Arc::new(AtomicUsize::new(0)),
            id,
        }
    }
}

impl Drop for Op {
    fn drop(&mut self) {
        self.drops.fetch_add(1, Ordering::SeqCst);
    }
}

impl Operation for Op {
    type Output = u32;
    fn try_complete(&mut self) -> Option<u32> {
        self.ready.load(Ordering::SeqCst).then_some(self.id)
    }
    fn on_expiration(self) -> u32 {
        1000 + self.id
    }
}

// ---------------------------------------------------------------- builder

fn b() -> tokio_purgatory::PurgatoryBuilder<u32, Op> {
    Purgatory::builder()
}

fn invalid(e: &BuildError, name: &str) {
    assert!(!e.is_no_runtime(), "{e}");
    assert!(!e.is_reaper_stopped(), "{e}");
    let s = e.to_string();
    assert!(s.contains(name), "message {s:?} names {name}");
}

#[tokio::test(start_paused = true)]
async fn limits_at_and_beyond() {
    // tick
    invalid(&b().tick(Duration::ZERO).build().unwrap_err(), "tick");
    b().tick(Duration::from_nanos(1)).build().unwrap();
    b().tick(Duration::MAX).build().unwrap();
    // slots
    for s in [0usize, 1, 65, usize::MAX] {
        invalid(
            &b().slots_per_level(s).build().unwrap_err(),
            "slots_per_level",
        );
    }
    for s in [2usize, 3, 63, 64] {
        b().slots_per_level(s).levels(1).build().unwrap();
    }
    // levels
    invalid(&b().levels(0).build().unwrap_err(), "levels");
    b().levels(10).build().unwrap();
    invalid(&b().levels(11).build().unwrap_err(), "levels");
    invalid(&b().levels(usize::MAX).build().unwrap_err(), "levels");
    b().slots_per_level(2).levels(61).build().unwrap();
    invalid(
        &b().slots_per_level(2).levels(62).build().unwrap_err(),
        "levels",
    );
    b().slots_per_level(3).levels(39).build().unwrap();
    invalid(
        &b().slots_per_level(3).levels(40).build().unwrap_err(),
        "levels",
    );
    // shards
    b().timer_shards(1).build().unwrap();
    b().timer_shards(1024).build().unwrap();
    let e = b().timer_shards(0).build().unwrap_err();
    invalid(&e, "timer_shards");
    let e = b().timer_shards(1025).build().unwrap_err();
    invalid(&e, "timer_shards");
    // batch
    invalid(&b().batch_size(0).build().unwrap_err(), "batch_size");
    b().batch_size(1).build().unwrap();
    b().batch_size(usize::MAX).build().unwrap();
    // watcher shards
    invalid(
        &b().watcher_shards(0).build().unwrap_err(),
        "watcher_shards",
    );
    invalid(
        &b().watcher_shards(65_537).build().unwrap_err(),
        "watcher_shards",
    );
    invalid(
        &b().watcher_shards(usize::MAX).build().unwrap_err(),
        "watcher_shards",
    );
    for n in [1usize, 3, 65_535, 65_536] {
        let p = b().watcher_shards(n).build().unwrap();
        let h = p
            .try_complete_else_watch(Op::new(1), ms(5), 0..100)
            .unwrap();
        assert_eq!(p.watched(), 100);
        assert_eq!(p.metrics().keys, 100);
        h.await.unwrap();
    }
    // max_pending
    invalid(&b().max_pending(0).build().unwrap_err(), "max_pending");
    b().max_pending(1).build().unwrap();
    b().max_pending(usize::MAX).build().unwrap();
    // purge interval
    b().purge_interval(0).build().unwrap();
    b().purge_interval(usize::MAX).build().unwrap();
    // name
    b().name("").build().unwrap();
    b().name(&"x".repeat(100_000)).build().unwrap();
}

#[test]
fn settings_checked_before_runtime_and_reaper() {
    // Outside a runtime: invalid settings say so, not "no runtime".
    for e in [
        b().tick(Duration::ZERO).build().unwrap_err(),
        b().watcher_shards(0).build().unwrap_err(),
        b().max_pending(0).build().unwrap_err(),
        b().batch_size(0).build().unwrap_err(),
        b().timer_shards(0).build().unwrap_err(),
    ] {
        assert!(!e.is_no_runtime(), "{e}");
        assert!(e.to_string().starts_with("invalid setting"), "{e}");
    }
    let e = b().build().unwrap_err();
    assert!(e.is_no_runtime() && !e.is_reaper_stopped());
    assert!(e.to_string().contains("runtime"), "{e}");

    // A stopped reaper: settings first, then the reaper.
    let rt = support::paused();
    let reaper = Reaper::start_on(rt.handle());
    drop(rt);
    let e = b().reaper(&reaper).watcher_shards(0).build().unwrap_err();
    assert!(!e.is_reaper_stopped(), "{e}");
    let e = b().reaper(&reaper).build().unwrap_err();
    assert!(e.is_reaper_stopped() && !e.is_no_runtime(), "{e}");
    assert!(e.to_string().contains("reaper"), "{e}");
    let rt2 = support::paused();
    let e = b().reaper(&reaper).build_on(rt2.handle()).unwrap_err();
    assert!(e.is_reaper_stopped(), "{e}");

    // A reaper started on a runtime already shut down: stopped at once.
    let rt3 = support::paused();
    let handle = rt3.handle().clone();
    drop(rt3);
    let reaper = Reaper::start_on(&handle);
    assert!(reaper.is_stopped());
    let e = b().reaper(&reaper).build().unwrap_err();
    assert!(e.is_reaper_stopped(), "{e}");

    // Clone, Eq, Debug of the error
    let e2 = e.clone();
    assert_eq!(e, e2);
    assert!(!format!("{e:?}").is_empty());
    let _: &dyn std::error::Error = &e;
}

#[test]
fn with_live_reaper_needs_no_runtime() {
    let rt = support::paused();
    let reaper = rt.block_on(async { Reaper::start().unwrap() });
    // No runtime current here.
    let p = b().reaper(&reaper).build().unwrap();
    assert!(!p.is_shutdown());
    assert_eq!(reaper.serving(), 1);
    drop(p);
}

/// build_on a handle whose runtime is gone: documented errors are only bad
/// settings and a stopped shared reaper; it must not panic.
#[test]
fn on_a_dead_runtime() {
    let rt = support::paused();
    let handle = rt.handle().clone();
    drop(rt);
    let r = catch_unwind(AssertUnwindSafe(|| b().build_on(&handle)));
    let p = r
        .expect("build_on must not panic")
        .expect("no error documented for it");
    // It cannot ever expire: registration refused, op handed back.
    let rt2 = support::paused();
    rt2.block_on(async {
        settle().await;
        let op = Op::new(9);
        let drops = op.drops.clone();
        match p.try_complete_else_watch(op, ms(5), [1]) {
            Err(WatchError::ReaperGone(op)) => assert_eq!(op.id, 9),
            Err(e) => panic!("unexpected {:?}", e.kind()),
            Ok(_) => panic!("accepted on a purgatory whose reaper can never run"),
        }
        assert_eq!(drops.load(Ordering::SeqCst), 1, "dropped once, by us");
    });
}

/// "# Panics: Outside a Tokio runtime" (`Purgatory::new`, `with_hasher`,
/// `Timer::new`, `Timer::default`), and `Reaper::start`'s error there: each
/// panics (or errs) as documented, with a message that names the runtime.
#[test]
fn the_shortcuts_outside_a_runtime_panic_as_documented() {
    fn message(r: std::thread::Result<()>) -> String {
        let payload = r.expect_err("panics outside a runtime");
        payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default()
    }
    type Make = Box<dyn Fn()>;
    let cases: Vec<(&str, Make)> = vec![
        (
            "Purgatory::new",
            Box::new(|| drop(Purgatory::<u32, Op>::new())),
        ),
        (
            "Purgatory::with_hasher",
            Box::new(|| {
                drop(Purgatory::<u32, Op, _>::with_hasher(
                    std::collections::hash_map::RandomState::new(),
                ))
            }),
        ),
        (
            "Timer::new",
            Box::new(|| drop(tokio_purgatory::Timer::new())),
        ),
        (
            "Timer::default",
            Box::new(|| drop(tokio_purgatory::Timer::default())),
        ),
    ];
    for (name, make) in cases {
        let m = message(catch_unwind(AssertUnwindSafe(make)));
        assert!(m.contains("runtime"), "{name}: {m:?}");
    }
    let e = Reaper::start().unwrap_err();
    assert!(e.is_no_runtime() && !e.is_reaper_stopped(), "{e}");
}
