//! Graceful drain (`Purgatory::drain`), on paused Tokio time.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::{advance, Instant};
use tokio_purgatory::{
    Completion, Operation, OperationError, Purgatory, WatchError, WatchErrorKind,
};
use tokio_test::{assert_pending, assert_ready, task};

mod support;
use support::{balanced, ms, settle};

#[derive(Debug, Clone, Default)]
struct Fetch {
    ready: Arc<AtomicBool>,
}

impl Operation for Fetch {
    type Output = &'static str;
    fn try_complete(&mut self) -> Option<&'static str> {
        self.ready.load(Ordering::SeqCst).then_some("data")
    }
    fn on_expiration(self) -> &'static str {
        "empty"
    }
}

fn fetches() -> Purgatory<u32, Fetch> {
    Purgatory::builder().name("fetch").build().unwrap()
}

#[tokio::test(start_paused = true)]
async fn a_drain_waits_for_events_and_expiries_and_takes_nothing_new() {
    let p = fetches();
    let start = Instant::now();
    let by_event = Fetch::default();
    let h1 = p
        .try_complete_else_watch(by_event.clone(), ms(10_000), [1])
        .unwrap();
    let h2 = p
        .try_complete_else_watch(Fetch::default(), ms(300), [2])
        .unwrap();
    let mut drain = task::spawn(p.drain());
    assert_pending!(drain.poll());
    assert!(p.is_draining());
    // New work is handed back.
    let refused = Fetch::default();
    match p.try_complete_else_watch(refused, ms(100), [3]) {
        Err(e) => {
            assert_eq!(e.kind(), WatchErrorKind::Draining);
            assert!(matches!(e, WatchError::Draining(_)));
        }
        Ok(_) => panic!("a draining purgatory took an operation"),
    }
    // Events still complete what is pending.
    by_event.ready.store(true, Ordering::SeqCst);
    assert_eq!(p.try_complete_watched(&1), 1);
    assert!(drain.is_woken());
    assert_pending!(drain.poll(), "one still pending");
    assert_eq!(h1.await, Ok(Completion::Completed("data")));
    // Expiry finishes the other.
    assert_eq!(h2.await, Ok(Completion::Expired("empty")));
    assert!(Instant::now() - start >= ms(300));
    assert!(drain.is_woken());
    assert_ready!(drain.poll());
    let m = p.metrics();
    assert_eq!(
        (m.registered, m.completed, m.expired, m.delayed),
        (2, 1, 1, 0)
    );
    assert!(balanced(&m));
}

#[tokio::test(start_paused = true)]
async fn a_drain_with_nothing_pending_returns_at_once() {
    let p = fetches();
    assert_ready!(task::spawn(p.drain()).poll());
    assert!(p.is_draining());
    assert!(!p.is_shutdown(), "draining is not shut down");
}

/// Cancelling (dropping a handle) and shutting down finish operations too.
#[tokio::test(start_paused = true)]
async fn cancels_and_shutdown_end_a_drain() {
    let p = fetches();
    let h1 = p
        .try_complete_else_watch(Fetch::default(), ms(10_000), [1])
        .unwrap();
    let h2 = p
        .try_complete_else_watch(Fetch::default(), ms(10_000), [2])
        .unwrap();
    let mut first = task::spawn(p.drain());
    let mut second = task::spawn(p.drain());
    assert_pending!(first.poll());
    assert_pending!(second.poll());
    drop(h1);
    assert!(first.is_woken() && second.is_woken());
    assert_pending!(first.poll());
    assert_pending!(second.poll());
    assert_eq!(p.shutdown().len(), 1);
    assert_ready!(first.poll());
    assert_ready!(second.poll());
    assert_eq!(h2.await, Err(OperationError::Shutdown));
    assert!(balanced(&p.metrics()));
}

/// Dropping the drain future stops the wait, not the drain.
#[tokio::test(start_paused = true)]
async fn a_dropped_drain_leaves_the_purgatory_draining() {
    let p = fetches();
    let h = p
        .try_complete_else_watch(Fetch::default(), ms(100), [1])
        .unwrap();
    let gave_up = tokio::time::timeout(ms(10), p.drain()).await;
    assert!(gave_up.is_err());
    assert!(p.is_draining());
    assert!(matches!(
        p.try_complete_else_watch(Fetch::default(), ms(100), [1]),
        Err(WatchError::Draining(_))
    ));
    assert_eq!(h.await, Ok(Completion::Expired("empty")));
    p.drain().await;
    advance(ms(1)).await;
    settle().await;
}

/// Registrations racing the drain on other threads: each is either refused
/// (and handed back) or waited for; when the drain returns, nothing it let in
/// is still pending.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registrations_racing_a_drain_are_refused_or_waited_for() {
    for _ in 0..20 {
        let p: Purgatory<u32, Fetch> = Purgatory::builder()
            .name("race")
            .tick(Duration::from_millis(1))
            .build()
            .unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let producers: Vec<_> = (0..2)
            .map(|t| {
                let (p, stop) = (p.clone(), stop.clone());
                std::thread::spawn(move || {
                    let mut taken = Vec::new();
                    let mut refused = 0;
                    while !stop.load(Ordering::SeqCst) {
                        match p.try_complete_else_watch(Fetch::default(), ms(2), [t]) {
                            Ok(h) => {
                                taken.push(h.op_ref().unwrap());
                                h.detach();
                            }
                            Err(WatchError::Draining(_)) => {
                                refused += 1;
                                if refused > 100 {
                                    break;
                                }
                            }
                            Err(e) => panic!("unexpected {e:?}"),
                        }
                    }
                    taken
                })
            })
            .collect();
        // The drain starts once the producers are registering (polled, at
        // most 10 s).
        let give_up = std::time::Instant::now() + Duration::from_secs(10);
        while p.metrics().registered == 0 {
            assert!(
                std::time::Instant::now() < give_up,
                "the producers registered nothing within 10 s"
            );
            tokio::task::yield_now().await;
        }
        tokio::time::timeout(Duration::from_secs(10), p.drain())
            .await
            .expect("the drain ends once the expiries come");
        stop.store(true, Ordering::SeqCst);
        for t in producers {
            for r in t.join().unwrap() {
                assert!(r.is_finished(), "an operation let in was still pending");
            }
        }
        assert_eq!(p.delayed(), 0);
        assert!(balanced(&p.metrics()));
    }
}

/// A key whose `Clone` runs a hook (the first time only) and then panics. The
/// purgatory clones a key when it is first watched, once the registration
/// was admitted, before it takes the watcher map's lock.
struct Tripwire(Arc<std::sync::Mutex<Option<Hook>>>);

/// What a [`Tripwire`] runs before it panics.
type Hook = Box<dyn FnOnce() + Send>;

impl Clone for Tripwire {
    fn clone(&self) -> Self {
        if let Some(hook) = self.0.lock().unwrap().take() {
            hook();
        }
        panic!("hostile clone");
    }
}

impl std::hash::Hash for Tripwire {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        h.write_u8(7);
    }
}

impl PartialEq for Tripwire {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Eq for Tripwire {}

/// A registration admitted before a drain began, whose key then panics, is the
/// last thing that drain waits for: turning it back wakes the drain, which
/// returns at once rather than waiting for some later operation.
#[tokio::test(start_paused = true)]
async fn a_registration_turned_back_by_a_panicking_key_ends_a_drain_it_held() {
    let p: Purgatory<Tripwire, Fetch> = Purgatory::builder().name("drain").build().unwrap();
    let drainer = p.clone();
    let drain = Arc::new(std::sync::Mutex::new(task::spawn(async move {
        drainer.drain().await
    })));
    let d = drain.clone();
    let key = Tripwire(Arc::new(std::sync::Mutex::new(Some(Box::new(move || {
        // Admitted already: the drain sees one operation pending and waits.
        assert_pending!(d.lock().unwrap().poll());
    })))));
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ = p.try_complete_else_watch(Fetch::default(), ms(10), [key]);
    }));
    assert!(r.is_err(), "the key's panic reaches the caller");
    let mut drain = drain.lock().unwrap();
    assert!(
        drain.is_woken(),
        "turning the registration back woke the drain"
    );
    assert_ready!(drain.poll());
    assert_eq!(p.delayed(), 0);
    assert!(balanced(&p.metrics()));
}

/// The call itself drains: before its future is polled, and when the future
/// is dropped unpolled (a `select!` branch never reached), registrations are
/// refused and handed back, and the purgatory reads draining.
#[tokio::test(start_paused = true)]
async fn the_call_drains_before_its_future_is_polled() {
    let p = fetches();
    let pending = p
        .try_complete_else_watch(Fetch::default(), ms(100), [1])
        .unwrap();
    let drain = p.drain();
    assert!(p.is_draining());
    match p.try_complete_else_watch(Fetch::default(), ms(100), [1]) {
        Err(WatchError::Draining(_)) => {}
        _ => panic!("a registration after drain() was called was not refused"),
    }
    drop(drain);
    assert!(p.is_draining(), "dropping the future undoes nothing");
    assert!(matches!(
        p.try_complete_else_watch(Fetch::default(), ms(100), [2]),
        Err(WatchError::Draining(_))
    ));
    // A drain polled later still waits for what was pending.
    let mut later = task::spawn(p.drain());
    assert_pending!(later.poll());
    advance(ms(100)).await;
    settle().await;
    assert!(later.is_woken());
    assert_ready!(later.poll());
    assert!(matches!(pending.await, Ok(Completion::Expired("empty"))));
}
