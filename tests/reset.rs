//! Moving a pending timeout (`OpRef::reset`, `OperationHandle::reset`,
//! `TaskHandle::reset`), on paused Tokio time.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::{advance, Instant};
use tokio_purgatory::{Completion, OpRef, Operation, Purgatory, Timer, WatchError};

mod support;
use support::{balanced, ms, settle};

/// Expires with the instant it expired at; completes once `ready` is set.
#[derive(Debug, Clone, Default)]
struct Session {
    ready: Arc<AtomicBool>,
}

impl Operation for Session {
    type Output = Instant;
    fn try_complete(&mut self) -> Option<Instant> {
        self.ready.load(Ordering::SeqCst).then(Instant::now)
    }
    fn on_expiration(self) -> Instant {
        Instant::now()
    }
}

fn sessions() -> Purgatory<u32, Session> {
    Purgatory::builder().name("sessions").build().unwrap()
}

/// The expiry instant of a handle that must expire.
async fn expired_at(h: tokio_purgatory::OperationHandle<u32, Session>) -> Instant {
    match h.await {
        Ok(Completion::Expired(at)) => at,
        other => panic!("expected an expiry, got {other:?}"),
    }
}

#[tokio::test(start_paused = true)]
async fn a_reset_pushes_the_expiry_back_and_only_the_new_deadline_fires() {
    let p = sessions();
    let start = Instant::now();
    let h = p
        .try_complete_else_watch(Session::default(), ms(100), [1])
        .unwrap();
    advance(ms(80)).await;
    assert!(h.reset(ms(100)));
    // The old deadline (100 ms) passes: nothing.
    advance(ms(90)).await;
    settle().await;
    assert!(!h.is_finished(), "expired at the old deadline");
    assert_eq!(p.delayed(), 1);
    let at = expired_at(h).await;
    assert!(at >= start + ms(180), "expired at {:?}", at - start);
    assert!(at <= start + ms(182), "expired at {:?}", at - start);
    let m = p.metrics();
    assert_eq!((m.expired, m.delayed), (1, 0));
    assert!(balanced(&m));
}

#[tokio::test(start_paused = true)]
async fn a_reset_can_bring_the_expiry_forward_or_make_it_due_now() {
    let p = sessions();
    let start = Instant::now();
    let early = p
        .try_complete_else_watch(Session::default(), ms(10_000), [1])
        .unwrap();
    let now = p
        .try_complete_else_watch(Session::default(), ms(10_000), [2])
        .unwrap();
    assert!(early.reset(ms(50)));
    assert!(now.reset_at(start - ms(5)), "a deadline already past");
    settle().await;
    assert!(now.is_finished(), "a past deadline is due at once");
    let at = expired_at(early).await;
    assert!(
        at >= start + ms(50) && at <= start + ms(52),
        "{:?}",
        at - start
    );
    assert_eq!(expired_at(now).await, start);
}

#[tokio::test(start_paused = true)]
async fn many_heartbeats_keep_an_operation_alive_and_cost_one_entry() {
    let p = sessions();
    let h = p
        .try_complete_else_watch(Session::default(), ms(30), [1])
        .unwrap();
    let r = h.op_ref().unwrap();
    for _ in 0..1_000 {
        advance(ms(20)).await;
        assert!(r.reset(ms(30)));
    }
    settle().await;
    assert!(!r.is_finished());
    assert_eq!(p.delayed(), 1);
    let start = Instant::now();
    let at = expired_at(h).await;
    assert!(at - start >= ms(30) && at - start <= ms(32));
    assert_eq!(p.metrics().expired, 1);
}

#[tokio::test(start_paused = true)]
async fn a_reset_after_the_end_changes_nothing() {
    let p = sessions();
    // Expired.
    let h = p
        .try_complete_else_watch(Session::default(), ms(10), [1])
        .unwrap();
    let r = h.op_ref().unwrap();
    expired_at(h).await;
    assert!(!r.reset(ms(100)));
    // Completed by a key walk.
    let op = Session::default();
    let h = p.try_complete_else_watch(op.clone(), ms(100), [2]).unwrap();
    let r = h.op_ref().unwrap();
    op.ready.store(true, Ordering::SeqCst);
    assert_eq!(p.try_complete_watched(&2), 1);
    assert!(!r.reset(ms(100)));
    assert!(!h.reset(ms(100)));
    assert!(matches!(h.await, Ok(Completion::Completed(_))));
    // Cancelled.
    let h = p
        .try_complete_else_watch(Session::default(), ms(100), [3])
        .unwrap();
    let r = h.op_ref().unwrap();
    assert!(r.cancel().is_some());
    assert!(!r.reset(ms(100)));
    // Completed at registration: nothing to move.
    let op = Session::default();
    op.ready.store(true, Ordering::SeqCst);
    let h = p.try_complete_else_watch(op, ms(100), [4]).unwrap();
    assert!(h.is_finished());
    assert!(!h.reset(ms(100)));
    // Shut down.
    let h = p
        .try_complete_else_watch(Session::default(), ms(100), [5])
        .unwrap();
    let r = h.op_ref().unwrap();
    assert_eq!(p.shutdown().len(), 1);
    assert!(!r.reset(ms(100)));
    assert!(!h.reset(ms(100)));
    assert!(balanced(&p.metrics()));
}

/// A completion after a reset removes the moved timeout: nothing expires later
/// and the timer holds nothing.
#[tokio::test(start_paused = true)]
async fn a_completion_after_a_reset_removes_the_moved_timeout() {
    let p = sessions();
    let op = Session::default();
    let h = p.try_complete_else_watch(op.clone(), ms(100), [1]).unwrap();
    assert!(h.reset(ms(500)));
    assert!(h.reset(ms(300)));
    op.ready.store(true, Ordering::SeqCst);
    assert!(h.op_ref().unwrap().try_complete());
    assert!(matches!(h.await, Ok(Completion::Completed(_))));
    advance(ms(1_000)).await;
    settle().await;
    let m = p.metrics();
    assert_eq!((m.completed, m.expired, m.delayed), (1, 0, 0));
    assert_eq!(p.metrics().cancelled, 0);
}

/// A reset keeps the operation's room under `max_pending`: it neither frees it
/// for another registration nor needs a second one.
#[tokio::test(start_paused = true)]
async fn a_reset_at_capacity_keeps_its_room() {
    let p: Purgatory<u32, Session> = Purgatory::builder()
        .name("full")
        .max_pending(1)
        .build()
        .unwrap();
    let h = p
        .try_complete_else_watch(Session::default(), ms(100), [1])
        .unwrap();
    assert!(h.reset(ms(200)));
    match p.try_complete_else_watch(Session::default(), ms(100), [2]) {
        Err(WatchError::AtCapacity(_)) => {}
        other => panic!("expected AtCapacity, got {other:?}"),
    }
    assert!(h.reset(ms(50)));
    expired_at(h).await;
    assert!(p
        .try_complete_else_watch(Session::default(), ms(100), [2])
        .is_ok());
}

/// An operation that resets its own timeout from its check (a fetch that saw
/// some data and waits a little longer for more): no deadlock, and the new
/// deadline holds.
#[tokio::test(start_paused = true)]
async fn a_check_may_reset_its_own_timeout() {
    #[derive(Clone, Default)]
    struct Patient {
        me: Arc<Mutex<Option<OpRef<u32, Patient>>>>,
        resets: Arc<AtomicUsize>,
    }
    impl Operation for Patient {
        type Output = Instant;
        fn try_complete(&mut self) -> Option<Instant> {
            if let Some(me) = self.me.lock().unwrap().as_ref() {
                if me.reset(ms(100)) {
                    self.resets.fetch_add(1, Ordering::SeqCst);
                }
            }
            None
        }
        fn on_expiration(self) -> Instant {
            Instant::now()
        }
    }
    let p: Purgatory<u32, Patient> = Purgatory::builder().name("patient").build().unwrap();
    let op = Patient::default();
    let start = Instant::now();
    let h = p.try_complete_else_watch(op.clone(), ms(100), [1]).unwrap();
    *op.me.lock().unwrap() = h.op_ref();
    advance(ms(60)).await;
    assert_eq!(p.try_complete_watched(&1), 0);
    assert_eq!(op.resets.load(Ordering::SeqCst), 1);
    let Ok(Completion::Expired(at)) = h.await else {
        panic!("expected an expiry")
    };
    assert!(
        at >= start + ms(160) && at <= start + ms(162),
        "{:?}",
        at - start
    );
    // Break the cycle the operation holds to itself.
    op.me.lock().unwrap().take();
}

/// Resets racing the reaper on a multi-thread runtime: each operation expires
/// exactly once, never before a deadline a successful reset set, and a reset
/// that lost returns `false`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resets_racing_expiries_lose_nothing() {
    let p: Purgatory<u32, Session> = Purgatory::builder()
        .name("race")
        .tick(Duration::from_millis(1))
        .build()
        .unwrap();
    let mut handles = Vec::new();
    for i in 0..200 {
        handles.push(
            p.try_complete_else_watch(Session::default(), ms(2 + i % 5), [i as u32])
                .unwrap(),
        );
    }
    let refs: Vec<_> = handles.iter().map(|h| h.op_ref().unwrap()).collect();
    let resetter = tokio::spawn(async move {
        let mut won = Vec::new();
        for r in &refs {
            let at = Instant::now() + ms(3);
            won.push(r.reset_at(at).then_some(at));
        }
        won
    });
    let won = tokio::time::timeout(Duration::from_secs(10), resetter)
        .await
        .expect("resets finish")
        .unwrap();
    for (h, won) in handles.into_iter().zip(won) {
        let at = tokio::time::timeout(Duration::from_secs(10), expired_at(h))
            .await
            .expect("every operation expires");
        if let Some(deadline) = won {
            assert!(at >= deadline, "expired before the deadline its reset set");
        }
    }
    let m = p.metrics();
    assert_eq!((m.expired, m.delayed), (200, 0));
    assert!(balanced(&m));
}

// ---------------------------------------------------------------- the timer

#[tokio::test(start_paused = true)]
async fn a_timer_reset_moves_the_task_both_ways() {
    let timer = Timer::new();
    let start = Instant::now();
    let ran = Arc::new(Mutex::new(Vec::new()));
    let (a, b) = (ran.clone(), ran.clone());
    let later = timer
        .schedule(ms(100), move || {
            a.lock().unwrap().push(("later", Instant::now()))
        })
        .unwrap();
    let sooner = timer
        .schedule(ms(100), move || {
            b.lock().unwrap().push(("sooner", Instant::now()))
        })
        .unwrap();
    assert!(later.reset(ms(300)));
    assert!(sooner.reset(ms(20)));
    advance(ms(20)).await;
    settle().await;
    advance(ms(130)).await;
    settle().await;
    assert_eq!(ran.lock().unwrap().len(), 1, "only the one brought forward");
    assert!(later.is_pending());
    advance(ms(150)).await;
    settle().await;
    advance(ms(50)).await;
    settle().await;
    let ran = ran.lock().unwrap().clone();
    assert_eq!(ran.len(), 2);
    assert_eq!(ran[0].0, "sooner");
    assert!(ran[0].1 - start >= ms(20) && ran[0].1 - start <= ms(22));
    assert_eq!(ran[1].0, "later");
    assert!(ran[1].1 - start >= ms(300) && ran[1].1 - start <= ms(302));
    assert!(!later.reset(ms(10)), "it ran");
}

#[tokio::test(start_paused = true)]
async fn a_timer_reset_after_cancel_or_shutdown_changes_nothing_and_cancel_follows_it() {
    let timer = Timer::new();
    let runs = Arc::new(AtomicUsize::new(0));
    let r = runs.clone();
    let t = timer
        .schedule(ms(100), move || {
            r.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
    assert!(t.reset(ms(50)));
    assert!(t.cancel(), "cancel finds the moved entry");
    assert!(!t.reset(ms(50)));
    advance(ms(500)).await;
    settle().await;
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    let u = timer.schedule(ms(100), || {}).unwrap();
    drop(timer.shutdown());
    assert!(!u.reset(ms(10)));
}

/// A heartbeat shares its timeout with the task that resets it.
#[tokio::test(start_paused = true)]
async fn a_shared_timeout_is_reset_from_another_task() {
    let timer = Timer::new();
    let dead = Arc::new(AtomicBool::new(false));
    let d = dead.clone();
    let session = Arc::new(
        timer
            .schedule(ms(100), move || d.store(true, Ordering::SeqCst))
            .unwrap(),
    );
    let beats = {
        let session = session.clone();
        tokio::spawn(async move {
            for _ in 0..10 {
                tokio::time::sleep(ms(60)).await;
                assert!(session.reset(ms(100)));
            }
        })
    };
    beats.await.unwrap();
    assert!(!dead.load(Ordering::SeqCst));
    advance(ms(101)).await;
    settle().await;
    assert!(dead.load(Ordering::SeqCst));
}

/// `Duration::MAX` saturates in a reset as in a registration: no panic, and
/// the operation or task is not due for decades.
#[tokio::test(start_paused = true)]
async fn a_reset_to_duration_max_saturates() {
    let p = sessions();
    let h = p
        .try_complete_else_watch(Session::default(), ms(10), [1])
        .unwrap();
    assert!(h.reset(Duration::MAX));
    assert!(h.op_ref().unwrap().reset(Duration::MAX));
    let timer = Timer::new();
    let t = timer.schedule(ms(10), || {}).unwrap();
    assert!(t.reset(Duration::MAX));
    advance(Duration::from_secs(86_400 * 365)).await;
    settle().await;
    assert!(!h.is_finished());
    assert!(t.is_pending());
}

/// Every `_at` method takes a `std::time::Instant` too. On the real clock
/// (a std instant is not paused), with deadlines already past, so nothing
/// waits.
#[tokio::test(flavor = "current_thread")]
async fn deadlines_may_be_std_instants() {
    let past = std::time::Instant::now() - Duration::from_millis(5);
    let p: Purgatory<u32, Session> = Purgatory::new();
    let h = p
        .try_complete_else_watch_at(Session::default(), past, [1])
        .unwrap();
    assert!(h.await.unwrap().is_expired());
    let h = p
        .try_complete_else_watch_levels_at(
            Session::default(),
            past,
            [tokio_purgatory::Watch::level(1, 3)],
        )
        .unwrap();
    assert!(h.await.unwrap().is_expired());
    let h = p
        .try_complete_else_watch(Session::default(), Duration::from_secs(60), [2])
        .unwrap();
    assert!(h.op_ref().unwrap().reset_at(past));
    assert!(h.await.unwrap().is_expired());
    let h = p
        .try_complete_else_watch(Session::default(), Duration::from_secs(60), [2])
        .unwrap();
    assert!(h.reset_at(past));
    assert!(h.await.unwrap().is_expired());

    let timer = Timer::new();
    timer.sleep_until(past).await.unwrap();
    assert_eq!(
        timer
            .timeout_at(past, std::future::pending::<()>())
            .await
            .ok(),
        None
    );
    let (tx, rx) = tokio::sync::oneshot::channel();
    timer
        .schedule_at(past, move || {
            let _ = tx.send(());
        })
        .unwrap();
    rx.await.unwrap();
    let t = timer.schedule(Duration::from_secs(60), || {}).unwrap();
    assert!(t.reset_at(past));
    settle().await;
    assert!(!t.is_pending());
}

/// `OpRef::status` says why a `reset` (or a check) came to nothing.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn status_says_how_an_operation_finished() {
    use tokio_purgatory::OperationStatus as S;
    let p = sessions();
    let register = |t| {
        p.try_complete_else_watch(Session::default(), ms(t), [1])
            .unwrap()
    };
    // Expired.
    let h = register(10);
    let op = h.op_ref().unwrap();
    assert_eq!(op.status(), S::Pending);
    advance(ms(20)).await;
    settle().await;
    assert!(!op.reset(ms(100)));
    assert_eq!(op.status(), S::Expired);
    drop(h);
    // Completed, through a check by reference.
    let ready = Arc::new(AtomicBool::new(false));
    let h = p
        .try_complete_else_watch(
            Session {
                ready: ready.clone(),
            },
            ms(1000),
            [2],
        )
        .unwrap();
    let op = h.op_ref().unwrap();
    ready.store(true, Ordering::SeqCst);
    assert!(op.try_complete());
    assert_eq!(op.status(), S::Completed);
    assert!(!op.reset(ms(5)));
    drop(h);
    // Cancelled by dropping the handle; by key.
    let h = register(1000);
    let op = h.op_ref().unwrap();
    drop(h);
    assert_eq!(op.status(), S::Cancelled);
    let h = register(1000);
    let op = h.op_ref().unwrap();
    assert_eq!(p.cancel_for_key(&1).len(), 1);
    assert_eq!(op.status(), S::Cancelled);
    drop(h);
    // Handed back by shutdown.
    let h = register(1000);
    let op = h.op_ref().unwrap();
    assert_eq!(p.shutdown().len(), 1);
    assert_eq!(op.status(), S::HandedBack);
    drop(h);
}
