//! The purgatory, on paused Tokio time. The `kafka_*` tests port Kafka's
//! `DelayedOperationTest` case by case.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::{advance, Instant};
use tokio_purgatory::{Completion, Operation, OperationError, Purgatory, WatchError};

mod support;
use support::{balanced, ms, settle};

/// Kafka's `MockDelayedOperation`: completes once `completable` is set.
#[derive(Debug, Clone, Default)]
struct Mock {
    completable: Arc<AtomicBool>,
    checks: Arc<AtomicUsize>,
}

impl Mock {
    fn set(&self) {
        self.completable.store(true, Ordering::SeqCst);
    }
}

impl Operation for Mock {
    type Output = &'static str;
    fn try_complete(&mut self) -> Option<&'static str> {
        self.checks.fetch_add(1, Ordering::SeqCst);
        self.completable
            .load(Ordering::SeqCst)
            .then_some("completed")
    }
    fn on_expiration(self) -> &'static str {
        "expired"
    }
}

fn purgatory() -> Purgatory<&'static str, Mock> {
    Purgatory::builder()
        .name("test")
        .purge_interval(100_000)
        .build()
        .unwrap()
}

/// `testRequestSatisfaction`
#[tokio::test(start_paused = true)]
async fn kafka_request_satisfaction() {
    let p = purgatory();
    let (r1, r2) = (Mock::default(), Mock::default());
    let h1 = p
        .try_complete_else_watch(r1.clone(), ms(100_000), ["test1"])
        .unwrap();
    let h2 = p
        .try_complete_else_watch(r2.clone(), ms(100_000), ["test2"])
        .unwrap();
    assert_eq!(
        p.try_complete_watched(&"test1"),
        0,
        "nothing satisfiable yet"
    );
    assert_eq!(p.try_complete_watched(&"test2"), 0);
    r1.set();
    assert_eq!(p.try_complete_watched(&"test1"), 1, "r1 satisfied");
    assert_eq!(p.try_complete_watched(&"test2"), 0);
    r2.set();
    assert_eq!(p.try_complete_watched(&"test2"), 1, "r2 satisfied");
    assert_eq!(p.try_complete_watched(&"test1"), 0, "already done");
    assert_eq!(h1.await, Ok(Completion::Completed("completed")));
    assert_eq!(h2.await, Ok(Completion::Completed("completed")));
}

/// `testRequestExpiry`: expiry is no earlier than the timeout.
#[tokio::test(start_paused = true)]
async fn kafka_request_expiry() {
    let p = purgatory();
    let start = Instant::now();
    let h1 = p
        .try_complete_else_watch(Mock::default(), ms(20), ["test1"])
        .unwrap();
    let h2 = p
        .try_complete_else_watch(Mock::default(), ms(200), ["test1", "test2"])
        .unwrap();
    let out1 = h1.await;
    let t1 = Instant::now() - start;
    assert_eq!(out1, Ok(Completion::Expired("expired")));
    assert!(t1 >= ms(20) && t1 <= ms(21), "{t1:?}");
    assert_eq!(h2.await, Ok(Completion::Expired("expired")));
    let t2 = Instant::now() - start;
    assert!(t2 >= ms(200) && t2 <= ms(201), "{t2:?}");
    assert_eq!(p.delayed(), 0);
}

/// `testRequestPurge`: watched counts 6 -> 4 -> 2 -> 1 as keys are walked.
#[tokio::test(start_paused = true)]
async fn kafka_request_purge() {
    let p = purgatory();
    let (r1, r2, r3) = (Mock::default(), Mock::default(), Mock::default());
    let _h1 = p
        .try_complete_else_watch(r1, ms(100_000), ["test1"])
        .unwrap();
    let h2 = p
        .try_complete_else_watch(r2.clone(), ms(100_000), ["test1", "test2"])
        .unwrap();
    let h3 = p
        .try_complete_else_watch(r3.clone(), ms(100_000), ["test1", "test2", "test3"])
        .unwrap();
    assert_eq!(p.delayed(), 3);
    assert_eq!(p.watched(), 6);

    r2.set();
    assert!(h2.op_ref().unwrap().try_complete());
    assert_eq!(p.delayed(), 2);
    r3.set();
    assert!(h3.op_ref().unwrap().try_complete());
    assert_eq!(p.delayed(), 1);

    p.try_complete_watched(&"test1");
    assert_eq!(p.watched(), 4);
    p.try_complete_watched(&"test2");
    assert_eq!(p.watched(), 2);
    p.try_complete_watched(&"test3");
    assert_eq!(p.watched(), 1);
    assert_eq!(p.metrics().keys, 1, "emptied keys are removed");
}

/// `testShouldCancelForKeyReturningCancelledOperations`
#[tokio::test(start_paused = true)]
async fn kafka_cancel_for_key_returns_the_operations() {
    let p = purgatory();
    let h1 = p
        .try_complete_else_watch(Mock::default(), ms(10_000), ["key"])
        .unwrap();
    let _h2 = p
        .try_complete_else_watch(Mock::default(), ms(10_000), ["key"])
        .unwrap();
    let _h3 = p
        .try_complete_else_watch(Mock::default(), ms(10_000), ["key2"])
        .unwrap();
    let cancelled = p.cancel_for_key(&"key");
    assert_eq!(cancelled.len(), 2);
    assert_eq!(p.delayed(), 1);
    assert_eq!(p.watched(), 1);
    assert_eq!(h1.await, Err(OperationError::Cancelled));
    // Their timeouts were cancelled too: nothing expires later.
    advance(ms(20_000)).await;
    settle().await;
    assert_eq!(p.metrics().expired, 1, "only key2's operation expired");
}

/// `testCancelForKeyReturningEmptyListIfKeyDoesNotExist`
#[tokio::test(start_paused = true)]
async fn kafka_cancel_for_unknown_key_is_empty() {
    let p = purgatory();
    assert!(p.cancel_for_key(&"key").is_empty());
}

/// `testTryCompleteWithMultipleThreads`: 100 operations, 20 completion attempts
/// each from many threads; every operation completes exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_try_complete_with_multiple_threads() {
    let p: Purgatory<usize, Counted> = Purgatory::builder().name("mt").build().unwrap();
    let completions = Arc::new(AtomicUsize::new(0));
    let mut handles = Vec::new();
    let mut ops = Vec::new();
    for i in 0..100 {
        let op = Counted {
            attempts: Arc::new(AtomicUsize::new(0)),
            need: 20,
            completions: completions.clone(),
        };
        ops.push(op.attempts.clone());
        handles.push(
            p.try_complete_else_watch(op, Duration::from_secs(3600), [i])
                .unwrap(),
        );
    }
    let mut tasks = Vec::new();
    for round in 0..20 {
        for (i, attempts) in ops.iter().enumerate() {
            let p = p.clone();
            let attempts = attempts.clone();
            tasks.push(tokio::spawn(async move {
                attempts.fetch_add(1, Ordering::SeqCst);
                if (i + round) % 2 == 0 {
                    p.try_complete_watched(&i);
                } else {
                    tokio::task::yield_now().await;
                    p.try_complete_watched(&i);
                }
            }));
        }
    }
    for t in tasks {
        t.await.unwrap();
    }
    for h in handles {
        assert!(matches!(h.await, Ok(Completion::Completed(_))));
    }
    assert_eq!(completions.load(Ordering::SeqCst), 100, "each exactly once");
    assert_eq!(p.delayed(), 0);
}

/// Completes once `attempts` reaches `need`; counts completions.
struct Counted {
    attempts: Arc<AtomicUsize>,
    need: usize,
    completions: Arc<AtomicUsize>,
}

impl Operation for Counted {
    type Output = ();
    fn try_complete(&mut self) -> Option<()> {
        (self.attempts.load(Ordering::SeqCst) >= self.need).then(|| {
            self.completions.fetch_add(1, Ordering::SeqCst);
        })
    }
    fn on_expiration(self) {}
}

#[tokio::test(start_paused = true)]
async fn completable_at_registration_never_watches() {
    let p = purgatory();
    let op = Mock::default();
    op.set();
    let h = p.try_complete_else_watch(op, ms(10), ["k"]).unwrap();
    assert!(h.is_finished());
    assert!(h.op_ref().is_none());
    assert_eq!(p.watched(), 0);
    assert_eq!(p.delayed(), 0);
    assert_eq!(h.await, Ok(Completion::Completed("completed")));
}

/// An operation that becomes completable during registration, between the first
/// check and the watch: the second check catches it.
#[tokio::test(start_paused = true)]
async fn becomes_completable_during_registration() {
    struct Flaky(usize);
    impl Operation for Flaky {
        type Output = usize;
        fn try_complete(&mut self) -> Option<usize> {
            self.0 += 1;
            // Not completable on the first check; the event lands just after.
            (self.0 >= 2).then_some(self.0)
        }
        fn on_expiration(self) -> usize {
            0
        }
    }
    let p: Purgatory<u8, Flaky> = Purgatory::builder().name("flaky").build().unwrap();
    let h = p.try_complete_else_watch(Flaky(0), ms(100), [1]).unwrap();
    assert!(h.is_finished(), "the check after watching completed it");
    assert_eq!(h.await, Ok(Completion::Completed(2)));
    assert_eq!(p.metrics().completed, 1);
    assert_eq!(p.delayed(), 0);
}

#[tokio::test(start_paused = true)]
async fn registration_errors_hand_the_operation_back() {
    let p: Purgatory<&str, Mock> = Purgatory::builder()
        .name("t")
        .max_pending(1)
        .build()
        .unwrap();
    let op = Mock::default();
    let err = p
        .try_complete_else_watch(op.clone(), ms(10), Vec::<&str>::new())
        .unwrap_err();
    assert!(matches!(err, WatchError::NoKeys(_)));
    assert!(Arc::ptr_eq(&err.into_inner().completable, &op.completable));

    let _h = p
        .try_complete_else_watch(Mock::default(), ms(10), ["a"])
        .unwrap();
    let err = p
        .try_complete_else_watch(op.clone(), ms(10), ["a"])
        .unwrap_err();
    assert!(matches!(err, WatchError::AtCapacity(_)));
    assert_eq!(
        op.checks.load(Ordering::SeqCst),
        0,
        "refused before any check"
    );

    let taken = p.shutdown();
    assert_eq!(taken.len(), 1);
    let err = p.try_complete_else_watch(op, ms(10), ["a"]).unwrap_err();
    assert!(matches!(err, WatchError::Shutdown(_)));
}

#[tokio::test(start_paused = true)]
async fn capacity_is_freed_by_completion_expiry_and_cancellation() {
    let p: Purgatory<&str, Mock> = Purgatory::builder()
        .name("t")
        .max_pending(1)
        .build()
        .unwrap();
    // completion
    let op = Mock::default();
    let h = p
        .try_complete_else_watch(op.clone(), ms(10), ["a"])
        .unwrap();
    op.set();
    assert_eq!(p.try_complete_watched(&"a"), 1);
    h.await.unwrap();
    // expiry
    let h = p
        .try_complete_else_watch(Mock::default(), ms(10), ["a"])
        .unwrap();
    assert_eq!(h.await, Ok(Completion::Expired("expired")));
    // cancellation by key
    let _h = p
        .try_complete_else_watch(Mock::default(), ms(10), ["a"])
        .unwrap();
    assert_eq!(p.cancel_for_key(&"a").len(), 1);
    // cancellation by dropping the handle
    let h = p
        .try_complete_else_watch(Mock::default(), ms(10), ["a"])
        .unwrap();
    drop(h);
    let _h = p
        .try_complete_else_watch(Mock::default(), ms(10), ["a"])
        .unwrap();
    assert_eq!(p.delayed(), 1);
}

#[tokio::test(start_paused = true)]
async fn dropping_the_handle_cancels_and_frees_the_operation() {
    let p = purgatory();
    let op = Mock::default();
    let payload = op.completable.clone();
    let h = p.try_complete_else_watch(op, ms(100), ["a", "b"]).unwrap();
    assert_eq!(Arc::strong_count(&payload), 2);
    drop(h);
    assert_eq!(Arc::strong_count(&payload), 1, "operation dropped at once");
    assert_eq!(p.delayed(), 0);
    assert_eq!(p.metrics().cancelled, 1);
    advance(ms(200)).await;
    settle().await;
    assert_eq!(p.metrics().expired, 0, "its timeout was cancelled");
    p.try_complete_watched(&"a");
    p.try_complete_watched(&"b");
    assert_eq!(p.watched(), 0);
    assert_eq!(p.metrics().keys, 0);
}

#[tokio::test(start_paused = true)]
async fn detached_operations_run_their_own_completion_and_expiry() {
    struct Responds(Arc<AtomicUsize>, bool);
    impl Operation for Responds {
        type Output = ();
        fn try_complete(&mut self) -> Option<()> {
            self.1.then(|| {
                self.0.fetch_add(1, Ordering::SeqCst);
            })
        }
        fn on_expiration(self) {
            self.0.fetch_add(100, Ordering::SeqCst);
        }
    }
    let p: Purgatory<u32, Responds> = Purgatory::builder().name("d").build().unwrap();
    let sent = Arc::new(AtomicUsize::new(0));
    p.try_complete_else_watch(Responds(sent.clone(), false), ms(50), [1])
        .unwrap()
        .detach();
    advance(ms(50)).await;
    settle().await;
    assert_eq!(
        sent.load(Ordering::SeqCst),
        100,
        "expired with nobody awaiting"
    );
    assert_eq!(p.metrics().expired, 1);
}

/// `into_op_ref` is `op_ref` then `detach`: the reference completes,
/// updates and reads the operation, every output is dropped once (nobody
/// reads one), an operation done at registration gives `None`, and one left
/// with only the reference still expires.
#[tokio::test(start_paused = true)]
async fn into_op_ref_detaches_and_keeps_a_reference() {
    /// An output that counts its drops.
    struct Out(Arc<AtomicUsize>);
    impl Drop for Out {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
    struct Op {
        ready: bool,
        drops: Arc<AtomicUsize>,
    }
    impl Operation for Op {
        type Output = Out;
        fn try_complete(&mut self) -> Option<Out> {
            self.ready.then(|| Out(self.drops.clone()))
        }
        fn on_expiration(self) -> Out {
            Out(self.drops.clone())
        }
    }
    let p: Purgatory<u32, Op> = Purgatory::builder().name("into").build().unwrap();
    let drops = Arc::new(AtomicUsize::new(0));
    let op = |ready| Op {
        ready,
        drops: drops.clone(),
    };

    // Completed through the reference, after an update through it.
    let r = p
        .try_complete_else_watch(op(false), ms(50), [1])
        .unwrap()
        .into_op_ref()
        .expect("pending");
    assert_eq!(r.status(), tokio_purgatory::OperationStatus::Pending);
    assert_eq!(r.update(|o| o.ready = true), Some(()));
    assert!(r.try_complete());
    assert_eq!(
        drops.load(Ordering::SeqCst),
        1,
        "the output, unread, dropped"
    );
    assert_eq!(r.status(), tokio_purgatory::OperationStatus::Completed);
    drop(r);

    // Done at registration: nothing to reference, the output dropped.
    let none = p
        .try_complete_else_watch(op(true), ms(50), [1])
        .unwrap()
        .into_op_ref();
    assert!(none.is_none());
    assert_eq!(drops.load(Ordering::SeqCst), 2);

    // Only the reference left: it still expires, and says so.
    let r = p
        .try_complete_else_watch(op(false), ms(50), [2])
        .unwrap()
        .into_op_ref()
        .unwrap();
    advance(ms(50)).await;
    settle().await;
    assert_eq!(r.status(), tokio_purgatory::OperationStatus::Expired);
    assert_eq!(drops.load(Ordering::SeqCst), 3);
    drop(r);
    let m = p.metrics();
    assert_eq!((m.completed, m.expired, m.delayed), (2, 1, 0));
    assert!(balanced(&m));
}

#[tokio::test(start_paused = true)]
async fn completed_payload_is_dropped_at_once_leaving_small_tombstones() {
    let p = purgatory();
    let op = Mock::default();
    let payload = op.checks.clone();
    let flag = op.completable.clone();
    let h = p
        .try_complete_else_watch(op, ms(1000), ["a", "b", "c"])
        .unwrap();
    let r = h.op_ref().unwrap();
    assert_eq!(Arc::strong_count(&payload), 2);
    flag.store(true, Ordering::SeqCst);
    assert_eq!(p.try_complete_watched(&"a"), 1);
    assert_eq!(
        Arc::strong_count(&payload),
        1,
        "payload dropped at completion, though b, c, the handle and a ref remain"
    );
    assert!(r.is_finished());
    assert!(!r.try_complete(), "no check after completion");
    assert_eq!(
        p.watched(),
        2,
        "tombstones in b and c until walked or purged"
    );
    p.try_complete_watched(&"b");
    p.try_complete_watched(&"c");
    assert_eq!(p.watched(), 0);
    assert_eq!(h.await, Ok(Completion::Completed("completed")));
}

/// The purge a call starts visits a bounded slice of the lists (128 entries),
/// and later calls go on with it: with every operation on the same three keys
/// (Kafka's layout), no single call walks whole lists, and the tombstones still
/// all go.
#[tokio::test(start_paused = true)]
async fn the_purge_goes_in_slices_over_later_calls() {
    let p: Purgatory<u32, Mock> = Purgatory::builder()
        .name("slices")
        .purge_interval(0)
        .build()
        .unwrap();
    let mut ops = Vec::new();
    for _ in 0..4000 {
        let op = Mock::default();
        let h = p
            .try_complete_else_watch(op.clone(), ms(100_000), [1, 2, 3])
            .unwrap();
        ops.push((op, h.op_ref().unwrap()));
        h.detach();
    }
    // Finishing does not purge: 12,000 tombstones wait for calls that do.
    for (op, r) in &ops {
        op.set();
        assert!(r.try_complete());
    }
    assert_eq!(p.metrics().tombstones, 12_000);
    assert_eq!(p.metrics().purged, 0);
    let mut calls = 0;
    let mut before = 0;
    while p.metrics().tombstones > 0 {
        // A key no operation watches: the call itself removes nothing.
        p.try_complete_watched(&99);
        calls += 1;
        let purged = p.metrics().purged;
        assert!(
            purged - before <= 128,
            "one call purged {}",
            purged - before
        );
        before = purged;
        assert!(calls <= 94, "the purge never finished: {:?}", p.metrics());
    }
    assert_eq!(calls, 94, "12,000 entries in slices of 128");
    let m = p.metrics();
    assert_eq!((m.purged, m.watched, m.keys), (12_000, 0, 0));
}

#[tokio::test(start_paused = true)]
async fn completion_through_one_key_drops_payload_and_purge_clears_tombstones() {
    let p: Purgatory<u32, Mock> = Purgatory::builder()
        .name("purge")
        .purge_interval(10)
        .build()
        .unwrap();
    let mut handles = Vec::new();
    let mut mocks = Vec::new();
    for i in 0..100u32 {
        let op = Mock::default();
        mocks.push(op.clone());
        // Keys: i (own), 1000 + i % 7, 2000 + i % 3.
        handles.push(
            p.try_complete_else_watch(op, ms(100_000), [i, 1000 + i % 7, 2000 + i % 3])
                .unwrap(),
        );
    }
    assert_eq!(p.watched(), 300);
    let payloads: Vec<_> = mocks.iter().map(|m| m.checks.clone()).collect();
    for (i, m) in mocks.iter().enumerate() {
        m.set();
        assert_eq!(p.try_complete_watched(&(i as u32)), 1);
    }
    drop(mocks);
    for pl in &payloads {
        assert_eq!(Arc::strong_count(pl), 1, "payload dropped at completion");
    }
    let m = p.metrics();
    assert!(m.purged > 0, "the amortised purge ran: {m:?}");
    assert!(m.watched < 300 / 2, "tombstones were purged: {m:?}");
    for k in (1000..1007).chain(2000..2003) {
        p.try_complete_watched(&k);
    }
    assert_eq!(p.watched(), 0);
    assert_eq!(p.metrics().keys, 0);
}

#[tokio::test(start_paused = true)]
async fn panicking_check_and_expiry_are_contained() {
    struct Bomb {
        check_panics: bool,
    }
    impl Operation for Bomb {
        type Output = u8;
        fn try_complete(&mut self) -> Option<u8> {
            if self.check_panics {
                panic!("check bug");
            }
            None
        }
        fn on_expiration(self) -> u8 {
            panic!("expiry bug");
        }
    }
    let p: Purgatory<u8, Bomb> = Purgatory::builder().name("bomb").build().unwrap();
    let a = p
        .try_complete_else_watch(Bomb { check_panics: true }, ms(10), [1])
        .unwrap();
    let b = p
        .try_complete_else_watch(
            Bomb {
                check_panics: false,
            },
            ms(20),
            [1],
        )
        .unwrap();
    assert_eq!(p.try_complete_watched(&1), 0);
    assert_eq!(a.await, Err(OperationError::Panicked));
    assert_eq!(b.await, Err(OperationError::Panicked));
    let m = p.metrics();
    assert_eq!(m.expired, 2);
    assert!(m.panicked >= 4, "{m:?}"); // two checks at registration + walk + expiries
                                       // The purgatory still works.
    let p2 = purgatory();
    let h = p2
        .try_complete_else_watch(Mock::default(), ms(5), ["x"])
        .unwrap();
    assert_eq!(h.await, Ok(Completion::Expired("expired")));
}

#[tokio::test(start_paused = true)]
async fn shutdown_hands_back_everything_and_counts_balance() {
    let p = purgatory();
    let mut handles = Vec::new();
    for i in 0..10 {
        let op = Mock::default();
        if i % 3 == 0 {
            op.set();
        }
        handles.push(
            p.try_complete_else_watch(op, ms(50 + i * 10), ["a", "b"])
                .unwrap(),
        );
    }
    advance(ms(75)).await;
    settle().await;
    let back = p.shutdown();
    let m = p.metrics();
    assert_eq!(m.registered, 10);
    assert_eq!(back.len() as u64, m.handed_back);
    assert_eq!(m.completed, 4);
    assert_eq!(m.expired, 2); // the ones due at 60 and 70 ms
    assert!(balanced(&m), "{m:?}");
    assert_eq!(p.delayed(), 0);
    let mut shut = 0;
    for h in handles {
        if h.await == Err(OperationError::Shutdown) {
            shut += 1;
        }
    }
    assert_eq!(shut, back.len());
    assert!(p.shutdown().is_empty());
}

#[tokio::test(start_paused = true)]
async fn dropping_the_last_purgatory_resolves_handles() {
    let p = purgatory();
    let h = p
        .try_complete_else_watch(Mock::default(), ms(50), ["a"])
        .unwrap();
    drop(p);
    assert_eq!(h.await, Err(OperationError::Shutdown));
}

#[test]
fn reaper_gone_resolves_handles_and_refuses_registration() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let p: Purgatory<&str, Mock> = Purgatory::builder()
        .name("gone")
        .build_on(rt.handle())
        .unwrap();
    let h = p
        .try_complete_else_watch(Mock::default(), ms(50), ["a"])
        .unwrap();
    drop(rt);
    let other = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    assert_eq!(other.block_on(h), Err(OperationError::ReaperGone));
    let err = p
        .try_complete_else_watch(Mock::default(), ms(50), ["a"])
        .unwrap_err();
    assert!(matches!(err, WatchError::ReaperGone(_)));
}

#[tokio::test(start_paused = true)]
async fn duplicate_keys_are_watched_once() {
    let p = purgatory();
    let _h = p
        .try_complete_else_watch(Mock::default(), ms(50), ["a", "a", "b", "a"])
        .unwrap();
    assert_eq!(p.watched(), 2);
}

#[tokio::test(start_paused = true)]
async fn one_hot_key_with_100_000_operations() {
    let p: Purgatory<u8, Mock> = Purgatory::builder().name("hot").build().unwrap();
    let flag = Arc::new(AtomicBool::new(false));
    let mut handles = Vec::with_capacity(100_000);
    for _ in 0..100_000 {
        let op = Mock {
            completable: flag.clone(),
            checks: Arc::new(AtomicUsize::new(0)),
        };
        let h = p
            .try_complete_else_watch(op, Duration::from_secs(60), [7])
            .unwrap();
        h.op_ref().unwrap();
        handles.push(h);
    }
    assert_eq!(p.watched(), 100_000);
    assert_eq!(p.try_complete_watched(&7), 0);
    flag.store(true, Ordering::SeqCst);
    assert_eq!(p.try_complete_watched(&7), 100_000);
    assert_eq!(p.watched(), 0);
    assert_eq!(p.delayed(), 0);
    for h in handles.drain(..).take(10) {
        assert_eq!(h.await, Ok(Completion::Completed("completed")));
    }
}

#[tokio::test(start_paused = true)]
async fn reentrant_calls_from_operation_code_do_not_deadlock() {
    // The check calls back into the purgatory: walks its own key, registers
    // another operation, and cancels by key.
    struct Reenter {
        p: Arc<std::sync::OnceLock<Purgatory<u32, Reenter>>>,
        depth: u32,
    }
    impl Operation for Reenter {
        type Output = u32;
        fn try_complete(&mut self) -> Option<u32> {
            let p = self.p.get()?;
            p.try_complete_watched(&1); // same key, while being checked
            if self.depth == 0 {
                let child = Reenter {
                    p: self.p.clone(),
                    depth: 1,
                };
                p.try_complete_else_watch(child, ms(10), [2])
                    .unwrap()
                    .detach();
                drop(p.cancel_for_key(&3));
            }
            None
        }
        fn on_expiration(self) -> u32 {
            if let Some(p) = self.p.get() {
                p.try_complete_watched(&1);
                drop(p.shutdown());
            }
            self.depth
        }
    }
    let cell = Arc::new(std::sync::OnceLock::new());
    let p: Purgatory<u32, Reenter> = Purgatory::builder().name("re").build().unwrap();
    cell.set(p.clone()).unwrap();
    let h = p
        .try_complete_else_watch(
            Reenter {
                p: cell.clone(),
                depth: 0,
            },
            ms(20),
            [1, 3],
        )
        .unwrap();
    let out = tokio::time::timeout(ms(1000), h)
        .await
        .expect("no deadlock");
    // The check's own cancel_for_key(&3) cancelled it once the check returned.
    assert_eq!(out, Err(OperationError::Cancelled));
    // The child expires at 10 ms and shuts the purgatory down from expiry code.
    tokio::time::timeout(ms(1000), async {
        while !p.is_shutdown() {
            tokio::time::sleep(ms(1)).await;
        }
    })
    .await
    .expect("shutdown from expiry code worked");
}

/// A walk compacts its key's list at once only when at least a quarter of what
/// it checked completed; otherwise the finished entries stay as tombstones until
/// the key's next walk (which drops them before checking).
#[tokio::test(start_paused = true)]
async fn a_walk_compacts_at_once_only_when_a_quarter_completed() {
    let p = purgatory();
    let ops: Vec<Mock> = (0..8).map(|_| Mock::default()).collect();
    let _handles: Vec<_> = ops
        .iter()
        .map(|op| {
            p.try_complete_else_watch(op.clone(), ms(60_000), ["k"])
                .unwrap()
        })
        .collect();
    // 1 of 8: below a quarter, its entry stays as a tombstone.
    ops[0].set();
    assert_eq!(p.try_complete_watched(&"k"), 1);
    let m = p.metrics();
    assert_eq!((m.watched, m.tombstones), (8, 1), "{m:?}");
    // The next walk drops that tombstone, then 2 of the 7 it checks complete:
    // at least a quarter, so it compacts at once.
    ops[1].set();
    ops[2].set();
    assert_eq!(p.try_complete_watched(&"k"), 2);
    let m = p.metrics();
    assert_eq!((m.watched, m.tombstones), (5, 0), "{m:?}");
}

#[tokio::test(start_paused = true)]
async fn debug_output_names_the_purgatory_and_its_counts() {
    let p = purgatory();
    let _h = p
        .try_complete_else_watch(Mock::default(), ms(1000), ["a", "b"])
        .unwrap();
    let text = format!("{p:?}");
    assert!(text.contains("\"test\""), "{text}");
    assert!(text.contains("delayed: 1"), "{text}");
    assert!(text.contains("watched: 2"), "{text}");
}

/// Duplicate keys are watched once, however many keys an operation names (past
/// 16 keys the check switches from a scan to a hash set).
#[tokio::test(start_paused = true)]
async fn duplicate_keys_are_watched_once_even_among_many() {
    let p: Purgatory<u32, Mock> = Purgatory::builder().name("dups").build().unwrap();
    let few = Mock::default();
    let _a = p
        .try_complete_else_watch(few.clone(), ms(1000), [1, 2, 1, 3, 2])
        .unwrap();
    assert_eq!(p.watched(), 3);
    let many = Mock::default();
    let keys = (100..130).chain(100..130).chain([100, 129]);
    let _b = p
        .try_complete_else_watch(many.clone(), ms(1000), keys)
        .unwrap();
    assert_eq!(p.watched(), 3 + 30);
    assert_eq!(p.metrics().keys, 3 + 30);
    many.set();
    assert_eq!(p.try_complete_watched(&129), 1);
}

/// A purgatory is not shut down until it is, and says so after.
#[tokio::test(start_paused = true)]
async fn is_shutdown_tells_before_and_after() {
    let p = purgatory();
    assert!(!p.is_shutdown());
    assert!(p.shutdown().is_empty());
    assert!(p.is_shutdown());
}

/// What a tombstone keeps: the cell's heap size, which grows with the operation
/// and output types and not otherwise.
#[test]
fn cell_bytes_follows_the_operation_and_output_sizes() {
    struct Small;
    impl Operation for Small {
        type Output = ();
        fn try_complete(&mut self) -> Option<()> {
            None
        }
        fn on_expiration(self) {}
    }
    struct Big(#[allow(dead_code)] [u64; 64]);
    impl Operation for Big {
        type Output = [u64; 32];
        fn try_complete(&mut self) -> Option<[u64; 32]> {
            None
        }
        fn on_expiration(self) -> [u64; 32] {
            [0; 32]
        }
    }
    let small = Purgatory::<u32, Small>::cell_bytes();
    let big = Purgatory::<u32, Big>::cell_bytes();
    // The `Arc` counts, the state, two locks, the timer key, the key count and
    // a pointer, at the least.
    assert!((64..=256).contains(&small), "{small}");
    assert!(big >= small + 512 + 256, "{big} vs {small}");
    assert!(big <= small + 512 + 256 + 64, "{big} vs {small}");
    assert_eq!(
        Purgatory::<String, Small>::cell_bytes(),
        small,
        "keys are not in the cell"
    );
}

/// `try_complete_else_watch_at`: the deadline is the instant given, whenever the
/// call is made; one already past expires on the reaper's next turn.
#[tokio::test(start_paused = true)]
async fn a_deadline_given_as_an_instant_is_kept() {
    let p = purgatory();
    let start = Instant::now();
    let h = p
        .try_complete_else_watch_at(Mock::default(), start + ms(40), ["a"])
        .unwrap();
    advance(ms(39)).await;
    settle().await;
    assert!(!h.is_finished(), "not before the deadline");
    advance(ms(1)).await;
    settle().await;
    assert_eq!(h.await, Ok(Completion::Expired("expired")));

    let now = Instant::now();
    let past = p
        .try_complete_else_watch_at(Mock::default(), now - ms(5), ["a"])
        .unwrap();
    assert_eq!(past.await, Ok(Completion::Expired("expired")));
    assert_eq!(Instant::now(), now, "expired with no time passing");

    let ready = Mock::default();
    ready.set();
    let done = p
        .try_complete_else_watch_at(ready, now - ms(5), ["a"])
        .unwrap();
    assert_eq!(done.await, Ok(Completion::Completed("completed")));
}

/// Keys are looked up by any borrowed form, as `HashMap::get` allows: `&str` for
/// `String` keys, with no allocation to build a key.
#[tokio::test(start_paused = true)]
async fn keys_are_found_by_a_borrowed_form() {
    let p: Purgatory<String, Mock> = Purgatory::builder().name("borrowed").build().unwrap();
    let a = Mock::default();
    let ha = p
        .try_complete_else_watch(a.clone(), ms(1000), ["orders-0".to_string()])
        .unwrap();
    let hb = p
        .try_complete_else_watch(Mock::default(), ms(1000), ["orders-1".to_string()])
        .unwrap();
    a.set();
    assert_eq!(p.try_complete_watched("orders-0"), 1);
    assert_eq!(p.cancel_for_key("orders-1").len(), 1);
    assert!(p.cancel_for_key("unknown").is_empty());
    assert!(ha.await.unwrap().is_completed());
    assert_eq!(hb.await, Err(OperationError::Cancelled));
}

/// Cancelling through a handle or an `OpRef` hands the operation back, once;
/// its timeout and output go with it.
#[tokio::test(start_paused = true)]
async fn cancel_through_a_handle_or_reference_hands_the_operation_back() {
    let p = purgatory();
    let h = p
        .try_complete_else_watch(Mock::default(), ms(100), ["a"])
        .unwrap();
    assert!(h.cancel().is_some());
    let m = p.metrics();
    assert_eq!((m.delayed, m.cancelled), (0, 1));

    let h = p
        .try_complete_else_watch(Mock::default(), ms(100), ["a"])
        .unwrap();
    let r = h.op_ref().unwrap();
    assert!(r.cancel().is_some());
    assert!(r.cancel().is_none(), "only once");
    assert!(!r.try_complete(), "nothing left to check");
    assert_eq!(h.await, Err(OperationError::Cancelled));

    // A finished operation has nothing to hand back.
    let done = Mock::default();
    done.set();
    let h = p.try_complete_else_watch(done, ms(100), ["a"]).unwrap();
    assert!(h.cancel().is_none());
    advance(ms(200)).await;
    settle().await;
    let m = p.metrics();
    assert!(balanced(&m) && m.delayed == 0 && m.expired == 0, "{m:?}");
}

/// The payload-free error kind works with `?` whatever the operation is.
#[tokio::test(start_paused = true)]
async fn refusals_convert_to_a_payload_free_kind() {
    use tokio_purgatory::WatchErrorKind;
    fn register(p: &Purgatory<&'static str, Mock>) -> Result<(), WatchErrorKind> {
        p.try_complete_else_watch(Mock::default(), ms(10), [])?
            .detach();
        Ok(())
    }
    let p = purgatory();
    assert_eq!(register(&p), Err(WatchErrorKind::NoKeys));
    drop(p.shutdown());
    let e = p
        .try_complete_else_watch(Mock::default(), ms(10), ["a"])
        .unwrap_err();
    assert_eq!(e.kind(), WatchErrorKind::Shutdown);
    assert_eq!(e.to_string(), WatchErrorKind::Shutdown.to_string());
    let boxed: Box<dyn std::error::Error + Send + Sync> = e.kind().into();
    assert_eq!(boxed.to_string(), "purgatory is shut down");
}

/// An operation holding a weak handle does not keep its purgatory alive: the
/// last strong handle's drop shuts it down, and the operation is dropped.
#[tokio::test(start_paused = true)]
async fn a_weak_handle_does_not_keep_the_purgatory_alive() {
    use tokio_purgatory::WeakPurgatory;
    struct FollowUp(WeakPurgatory<u8, FollowUp>, Arc<AtomicBool>);
    impl Operation for FollowUp {
        type Output = ();
        fn try_complete(&mut self) -> Option<()> {
            // Would register its follow-up here, through the weak handle.
            let _purgatory = self.0.upgrade()?;
            None
        }
        fn on_expiration(self) {}
    }
    impl Drop for FollowUp {
        fn drop(&mut self) {
            self.1.store(true, Ordering::SeqCst);
        }
    }
    let p: Purgatory<u8, FollowUp> = Purgatory::builder().name("weak").build().unwrap();
    let dropped = Arc::new(AtomicBool::new(false));
    let h = p
        .try_complete_else_watch(FollowUp(p.downgrade(), dropped.clone()), ms(60_000), [1])
        .unwrap();
    let weak = p.downgrade();
    assert!(weak.upgrade().is_some());
    drop(p);
    assert!(weak.upgrade().is_none());
    assert!(dropped.load(Ordering::SeqCst), "the operation went with it");
    assert_eq!(h.await, Err(OperationError::Shutdown));
}

/// Once the last pending operation goes (a hang-up, an expiry, a cancel
/// through an `OpRef`), the keys it watched leave the map then, without
/// waiting for a walk of each key or for tombstones to pass the purge
/// interval.
#[tokio::test(start_paused = true)]
async fn keys_nobody_watches_leave_the_map_when_their_last_operation_goes() {
    let p: Purgatory<u32, Mock> = Purgatory::new();
    let shape = |p: &Purgatory<u32, Mock>| {
        let m = p.metrics();
        (m.keys, m.watched, m.tombstones)
    };
    // A hang-up: the handle dropped.
    let h = p
        .try_complete_else_watch(Mock::default(), ms(100_000), [1, 2])
        .unwrap();
    assert_eq!(shape(&p), (2, 2, 0));
    drop(h);
    assert_eq!(shape(&p), (0, 0, 0), "hang-up");
    // An expiry.
    p.try_complete_else_watch(Mock::default(), ms(10), [3])
        .unwrap()
        .detach();
    advance(ms(11)).await;
    settle().await;
    assert_eq!(p.metrics().expired, 1);
    assert_eq!(shape(&p), (0, 0, 0), "expiry");
    // A cancel through an OpRef, and `cancel()`.
    let h = p
        .try_complete_else_watch(Mock::default(), ms(100_000), [4])
        .unwrap();
    let r = h.op_ref().unwrap();
    h.detach();
    assert!(r.cancel().is_some());
    assert_eq!(shape(&p), (0, 0, 0), "OpRef::cancel");
    let h = p
        .try_complete_else_watch(Mock::default(), ms(100_000), [5])
        .unwrap();
    assert!(h.cancel().is_some());
    assert_eq!(shape(&p), (0, 0, 0), "cancel");
    // A key another operation still watches stays, with that watch only.
    let a = p
        .try_complete_else_watch(Mock::default(), ms(100_000), [6, 7])
        .unwrap();
    let b = p
        .try_complete_else_watch(Mock::default(), ms(100_000), [7])
        .unwrap();
    drop(a);
    // Another operation pending, and too few tombstones to list the keys
    // for (see the next test): they wait for a walk or a later purge.
    assert_eq!(shape(&p), (2, 3, 2));
    drop(b);
    assert_eq!(shape(&p), (0, 0, 0), "the last one went");
    assert!(balanced(&p.metrics()));
}

/// While other operations stay pending, hang-ups and expiries on keys of
/// their own leave no more tombstones than live entries (or 16, the fewest
/// a purge waits for): the keys nobody watches go each time, and the map
/// stays proportional to what is pending, far below the purge interval
/// (1,000). With 20 pending, a map purged whole by the expiry or
/// cancellation; with 600, a map that call only marks, purged by the
/// slices of the registrations that follow (so a little later).
#[tokio::test(start_paused = true)]
async fn keys_nobody_watches_leave_a_busy_map_too() {
    for (pending, slack) in [(20u32, 0usize), (600, 64)] {
        let p: Purgatory<u32, Mock> = Purgatory::new();
        let held: Vec<_> = (0..pending)
            .map(|k| {
                p.try_complete_else_watch(Mock::default(), ms(100_000), [k])
                    .unwrap()
            })
            .collect();
        let (mut purges, mut last) = (0, 0);
        for i in 0..2 * pending + 100 {
            let h = p
                .try_complete_else_watch(Mock::default(), ms(10), [10_000 + i, 50_000 + i])
                .unwrap();
            if i % 2 == 0 {
                drop(h);
            } else {
                h.detach();
                advance(ms(11)).await;
                settle().await;
            }
            let m = p.metrics();
            let live = m.watched - m.tombstones;
            assert_eq!(live, pending as usize, "{pending} pending, round {i}");
            let bound = live.max(16) + slack;
            assert!(
                m.tombstones < bound,
                "{pending} pending, round {i}: {} tombstones",
                m.tombstones
            );
            assert_eq!(
                m.keys,
                live + m.tombstones,
                "{pending}, round {i}: a key per tombstone"
            );
            if m.tombstones < last {
                purges += 1;
            }
            last = m.tombstones;
        }
        assert!(purges >= 4, "{pending} pending: {purges} rounds purged");
        drop(held);
        assert_eq!((p.metrics().keys, p.metrics().watched), (0, 0));
        assert!(balanced(&p.metrics()));
    }
}

/// The finish that leaves nothing pending purges the whole map (up to about
/// 2,000 entries in that call) even when a purge in slices was under way:
/// that purge had passed some keys while their operations were still
/// pending, and going on with it would leave their tombstones (and the
/// keys) in an idle purgatory for good. Plain and level watches; the last
/// finish a cancellation or an expiry; and with no slice between, as control.
#[tokio::test(start_paused = true)]
async fn nothing_pending_purges_afresh_though_a_purge_was_under_way() {
    for level in [false, true] {
        for slice_between in [false, true] {
            let p: Purgatory<u32, Mock> = Purgatory::new();
            let watch = |k: u32, timeout| {
                let w = if level {
                    tokio_purgatory::Watch::level(k, 5)
                } else {
                    tokio_purgatory::Watch::key(k)
                };
                p.try_complete_else_watch_levels(Mock::default(), timeout, [w])
                    .unwrap()
            };
            let mut held: Vec<_> = (0..1100).map(|k| watch(k, ms(100_000))).collect();
            let last = watch(5_000, ms(10));
            // Half cancelled: tombstones as many as live entries in a map
            // over the size purged whole, so the purge is only marked.
            held.drain(..560);
            if slice_between {
                // A walk of a key nobody watches runs one slice of it.
                assert_eq!(p.try_complete_watched(&999_999), 0);
            }
            let case = format!("level {level}, slice between {slice_between}");
            if level {
                drop(last);
                drop(held);
            } else {
                drop(held);
                // The last one expires on the reaper.
                assert!(matches!(last.await, Ok(Completion::Expired(_))), "{case}");
            }
            let m = p.metrics();
            assert_eq!(m.delayed, 0, "{case}");
            assert_eq!(
                (m.watched, m.tombstones, m.keys),
                (0, 0, 0),
                "{case}: {m:?}"
            );
            assert!(balanced(&m), "{case}");
        }
    }
}
