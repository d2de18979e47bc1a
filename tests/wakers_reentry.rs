//! Wakers and callers that call back in, on paused time. A handle's waker
//! that drops that very handle as it is woken, for each of the eight ways its
//! operation can finish (completion by a walk or by reference, expiry, a
//! cancel by reference or by key, shutdown, a reset into the past, the last
//! purgatory clone dropped); one that shuts the purgatory down in the middle
//! of a walk or of a reaper batch; one that calls every `OpRef` method on
//! its own expired operation, registers, walks and polls its own handle; ones
//! that drop their handle and then panic. The latest task to poll a handle
//! is the one woken. A waker run inside another operation's check, on the
//! checking thread, that makes that operation ready (it completes without a
//! further event) or updates it and resets its timeout into the past (no
//! deadlock; it expires with no time passing). `OpRef::update` with an `f`
//! that panics, resets that move what a drain waits for, and random resets
//! over odd ticks and small wheels, never early and late by less than a tick
//! plus 2 ms. Every output made is dropped once and the counts balance.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use tokio::time::Instant;
use tokio_purgatory::{
    Completion, OpRef, Operation, OperationError, OperationHandle, OperationStatus, Purgatory,
};

mod support;
use support::rng::Rng;
use support::{balanced, get, ms, settle, Slot};

/// An output that counts its drops.
struct Out {
    tag: u32,
    drops: Arc<AtomicUsize>,
}
impl Drop for Out {
    fn drop(&mut self) {
        self.drops.fetch_add(1, Ordering::SeqCst);
    }
}
impl std::fmt::Debug for Out {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Out({})", self.tag)
    }
}

/// An operation that completes once its context's flag is set, counting the
/// outputs it makes (on completion or expiry).
struct Counted {
    tag: u32,
    ready: Arc<AtomicBool>,
    made: Arc<AtomicUsize>,
    drops: Arc<AtomicUsize>,
}
impl Counted {
    fn out(&self) -> Out {
        self.made.fetch_add(1, Ordering::SeqCst);
        Out {
            tag: self.tag,
            drops: self.drops.clone(),
        }
    }
}
impl Operation for Counted {
    type Output = Out;
    fn try_complete(&mut self) -> Option<Out> {
        self.ready.load(Ordering::SeqCst).then(|| self.out())
    }
    fn on_expiration(self) -> Out {
        self.out()
    }
}

/// What the operations of one test share: the flag that makes them ready,
/// and the outputs made and dropped.
#[derive(Clone)]
struct Ctx {
    ready: Arc<AtomicBool>,
    made: Arc<AtomicUsize>,
    drops: Arc<AtomicUsize>,
}
impl Ctx {
    fn new() -> Ctx {
        Ctx {
            ready: Arc::default(),
            made: Arc::default(),
            drops: Arc::default(),
        }
    }
    fn op(&self, tag: u32) -> Counted {
        Counted {
            tag,
            ready: self.ready.clone(),
            made: self.made.clone(),
            drops: self.drops.clone(),
        }
    }
}

type P = Purgatory<u32, Counted>;
type H = OperationHandle<u32, Counted>;

/// A check given the counter its operation holds.
type Check = Box<dyn FnMut(&mut u64) -> Option<u64> + Send>;

/// An operation whose check is a closure over a counter it holds; it
/// expires to 1000 plus that counter.
struct Scripted {
    n: u64,
    check: Check,
}
impl Scripted {
    fn new(check: impl FnMut(&mut u64) -> Option<u64> + Send + 'static) -> Scripted {
        Scripted {
            n: 0,
            check: Box::new(check),
        }
    }
}
impl Operation for Scripted {
    type Output = u64;
    fn try_complete(&mut self) -> Option<u64> {
        (self.check)(&mut self.n)
    }
    fn on_expiration(self) -> u64 {
        1000 + self.n
    }
}

type ScriptedP = Purgatory<&'static str, Scripted>;

/// A waker that counts its wakes and runs its hook (if any) at the first,
/// with no lock of its own held.
struct Hook {
    wakes: AtomicUsize,
    f: Mutex<Option<Box<dyn FnOnce() + Send>>>,
}
impl Wake for Hook {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref()
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.wakes.fetch_add(1, Ordering::SeqCst);
        let f = self.f.lock().unwrap().take();
        if let Some(f) = f {
            f();
        }
    }
}

/// A waker that runs `f` when first woken.
fn hook(f: impl FnOnce() + Send + 'static) -> Arc<Hook> {
    Arc::new(Hook {
        wakes: AtomicUsize::new(0),
        f: Mutex::new(Some(Box::new(f))),
    })
}

/// A waker that only counts its wakes.
fn counting() -> Arc<Hook> {
    Arc::new(Hook {
        wakes: AtomicUsize::new(0),
        f: Mutex::new(None),
    })
}

fn poll_with<F: Future + Unpin>(f: &mut F, w: &Waker) -> Poll<F::Output> {
    Pin::new(f).poll(&mut Context::from_waker(w))
}

/// Polls the handle in `slot` once with `w` (taking it out of the slot while
/// polling, so the slot's lock is not held by the caller during any finish);
/// whether it is still pending.
fn poll_slot(slot: &Slot<H>, w: &Waker) -> bool {
    let mut h = slot.lock().unwrap().take().expect("handle in slot");
    let pending = poll_with(&mut h, w).is_pending();
    *slot.lock().unwrap() = Some(h);
    pending
}

/// The handle is dropped by its own waker's `wake`, for every way its
/// operation can finish. The crate holds no lock while waking, so this must
/// not deadlock; the outcome (if any) is dropped exactly once; the counts
/// balance.
#[test]
fn handle_dropped_inside_its_own_wake_every_finish() {
    for way in 0..8 {
        support::paused_within(20, move || async move {
            let c = Ctx::new();
            let mut p_opt: Option<P> =
                Some(Purgatory::builder().name("wake-drop").build().unwrap());
            let p = p_opt.clone().unwrap();
            let h = p
                .try_complete_else_watch(c.op(way), ms(50), [1, 2])
                .unwrap();
            let r: OpRef<u32, Counted> = h.op_ref().unwrap();
            let slot: Slot<H> = Arc::new(Mutex::new(Some(h)));
            let s2 = slot.clone();
            let w = hook(move || drop(s2.lock().unwrap().take()));
            let waker = Waker::from(w.clone());
            assert!(poll_slot(&slot, &waker), "way {way}");
            drop(waker);
            let mut handed = Vec::new();
            let weak = p.downgrade();
            drop(p);
            let p = p_opt.as_ref().unwrap().clone();
            let expect = match way {
                0 => {
                    c.ready.store(true, Ordering::SeqCst);
                    assert_eq!(p.try_complete_watched(&2), 1);
                    OperationStatus::Completed
                }
                1 => {
                    tokio::time::sleep(ms(60)).await;
                    OperationStatus::Expired
                }
                2 => {
                    assert!(r.cancel().is_some());
                    OperationStatus::Cancelled
                }
                3 => {
                    assert_eq!(p.cancel_for_key(&1).len(), 1);
                    OperationStatus::Cancelled
                }
                4 => {
                    handed = p.shutdown();
                    assert_eq!(handed.len(), 1);
                    OperationStatus::HandedBack
                }
                5 => {
                    c.ready.store(true, Ordering::SeqCst);
                    assert!(r.try_complete());
                    OperationStatus::Completed
                }
                6 => {
                    assert!(r.reset_at(Instant::now() - ms(1)));
                    settle().await;
                    OperationStatus::Expired
                }
                _ => {
                    // The last clone goes: the operation is dropped, the
                    // handle sees Shutdown.
                    drop(p_opt.take());
                    drop(p);
                    assert!(weak.upgrade().is_none(), "the last clone went");
                    OperationStatus::Cancelled
                }
            };
            settle().await;
            assert_eq!(w.wakes.load(Ordering::SeqCst), 1, "way {way}: woken once");
            assert!(slot.lock().unwrap().is_none(), "way {way}: dropped in wake");
            assert_eq!(r.status(), expect, "way {way}");
            assert_eq!(
                c.made.load(Ordering::SeqCst),
                c.drops.load(Ordering::SeqCst),
                "way {way}: every output made was dropped once"
            );
            drop(handed);
            if let Some(p) = weak.upgrade() {
                let m = p.metrics();
                assert!(balanced(&m), "way {way}: {m:?}");
                assert_eq!((m.delayed, m.panicked), (0, 0), "way {way}: {m:?}");
            }
            drop(r);
            drop(p_opt);
        });
    }
}

/// A waker whose `wake` calls `shutdown()` while a walk is completing the
/// operations of a key: every operation still finishes exactly once, each
/// handle resolves, what shutdown hands back is what reads `Shutdown`, and the
/// counts balance.
#[test]
fn wake_that_shuts_down_during_a_walk() {
    support::paused_within(20, || async {
        let c = Ctx::new();
        let p: P = Purgatory::builder().name("wake-shutdown").build().unwrap();
        let n = 8u32;
        let handed: Arc<Mutex<Vec<Counted>>> = Arc::default();
        let once = Arc::new(AtomicBool::new(false));
        let mut hs = Vec::new();
        let mut hooks = Vec::new();
        for i in 0..n {
            let mut h = p.try_complete_else_watch(c.op(i), ms(1000), [1]).unwrap();
            let (pp, hd, o) = (p.clone(), handed.clone(), once.clone());
            let w = hook(move || {
                if !o.swap(true, Ordering::SeqCst) {
                    hd.lock().unwrap().extend(pp.shutdown());
                }
            });
            assert!(poll_with(&mut h, &Waker::from(w.clone())).is_pending());
            hs.push(h);
            hooks.push(w);
        }
        c.ready.store(true, Ordering::SeqCst);
        let completed = p.try_complete_watched(&1);
        settle().await;
        let back = std::mem::take(&mut *handed.lock().unwrap());
        let mut done = 0;
        let mut shut = 0;
        for h in hs {
            match h.await {
                Ok(Completion::Completed(_)) => done += 1,
                Err(OperationError::Shutdown) => shut += 1,
                other => panic!("unexpected {other:?}"),
            }
        }
        assert!(completed >= 1);
        assert_eq!(done, completed, "walk count = completed handles");
        assert_eq!(shut, back.len(), "handed back = Shutdown handles");
        assert_eq!(done + shut, n as usize);
        drop(back);
        let m = p.metrics();
        assert!(balanced(&m), "{m:?}");
        assert_eq!(m.completed as usize, done, "{m:?}");
        assert_eq!(m.handed_back as usize, shut, "{m:?}");
        assert_eq!((m.delayed, m.panicked), (0, 0), "{m:?}");
        assert_eq!(
            c.made.load(Ordering::SeqCst),
            c.drops.load(Ordering::SeqCst)
        );
    })
}

/// The same on the reaper: a batch of expiries at one deadline, the first
/// handle's waker shutting the purgatory down mid-batch.
#[test]
fn wake_that_shuts_down_during_a_reaper_batch() {
    support::paused_within(20, || async {
        let c = Ctx::new();
        let p: P = Purgatory::builder()
            .name("wake-shutdown-reaper")
            .build()
            .unwrap();
        let n = 8u32;
        let handed: Arc<Mutex<Vec<Counted>>> = Arc::default();
        let once = Arc::new(AtomicBool::new(false));
        let mut hs = Vec::new();
        let at = Instant::now() + ms(10) + Duration::from_nanos(37);
        for i in 0..n {
            let mut h = p.try_complete_else_watch_at(c.op(i), at, [i]).unwrap();
            let (pp, hd, o) = (p.clone(), handed.clone(), once.clone());
            let w = hook(move || {
                if !o.swap(true, Ordering::SeqCst) {
                    hd.lock().unwrap().extend(pp.shutdown());
                }
            });
            assert!(poll_with(&mut h, &Waker::from(w)).is_pending());
            hs.push(h);
        }
        tokio::time::sleep(ms(20)).await;
        settle().await;
        let back = std::mem::take(&mut *handed.lock().unwrap());
        let (mut exp, mut shut) = (0, 0);
        for h in hs {
            match support::resolve(h).await {
                Ok(Completion::Expired(_)) => exp += 1,
                Err(OperationError::Shutdown) => shut += 1,
                other => panic!("unexpected {other:?}"),
            }
        }
        assert!(exp >= 1);
        assert_eq!(shut, back.len());
        assert_eq!(exp + shut, n as usize);
        drop(back);
        let m = p.metrics();
        assert!(balanced(&m), "{m:?}");
        assert_eq!(m.expired as usize, exp, "{m:?}");
        assert_eq!((m.delayed, m.panicked), (0, 0), "{m:?}");
        assert_eq!(
            c.made.load(Ordering::SeqCst),
            c.drops.load(Ordering::SeqCst)
        );
    })
}

/// From the waker of its own handle (woken by the expiry): the operation reads
/// expired, every `OpRef` method says "finished", a registration and a walk
/// from inside the wake work, and polling the handle from inside the wake
/// takes the outcome.
#[test]
fn wake_reenters_the_same_operation_and_polls_its_handle() {
    support::paused_within(20, || async {
        let c = Ctx::new();
        let p: P = Purgatory::builder().name("wake-same").build().unwrap();
        let h = p.try_complete_else_watch(c.op(9), ms(10), [1]).unwrap();
        let r = h.op_ref().unwrap();
        let slot: Slot<H> = Arc::new(Mutex::new(Some(h)));
        let log: Arc<Mutex<Vec<String>>> = Arc::default();
        let (s2, l2, r2, pp, c2) = (slot.clone(), log.clone(), r.clone(), p.clone(), c.clone());
        let w = hook(move || {
            let line = format!(
                "{:?} {} {} {} {:?} {}",
                r2.status(),
                r2.is_finished(),
                r2.reset(ms(100)),
                r2.try_complete(),
                r2.update(|o| o.tag),
                r2.cancel().is_none(),
            );
            l2.lock().unwrap().push(line);
            // A new registration and a walk from inside the wake.
            pp.try_complete_else_watch(c2.op(10), ms(5), [1])
                .unwrap()
                .detach();
            pp.try_complete_watched(&1);
            let mut h = s2.lock().unwrap().take().unwrap();
            match poll_with(&mut h, Waker::noop()) {
                Poll::Ready(Ok(Completion::Expired(out))) => {
                    l2.lock().unwrap().push(format!("ready {}", out.tag))
                }
                other => l2.lock().unwrap().push(format!("{other:?}")),
            }
        });
        assert!(poll_slot(&slot, &Waker::from(w.clone())));
        tokio::time::sleep(ms(30)).await;
        settle().await;
        assert_eq!(
            *log.lock().unwrap(),
            ["Expired true false false None true", "ready 9"]
        );
        assert!(slot.lock().unwrap().is_none());
        let m = p.metrics();
        assert!(balanced(&m), "{m:?}");
        assert_eq!((m.registered, m.expired, m.delayed), (2, 2, 0), "{m:?}");
        assert_eq!(
            c.made.load(Ordering::SeqCst),
            c.drops.load(Ordering::SeqCst)
        );
    })
}

/// `OperationHandle`'s docs: "Polling from different tasks is allowed; the
/// latest task to poll is woken."
#[test]
fn the_latest_poller_is_woken() {
    support::paused_within(20, || async {
        let c = Ctx::new();
        let p: P = Purgatory::builder().name("latest").build().unwrap();
        // A then B: B is woken.
        let mut h = p.try_complete_else_watch(c.op(1), ms(1000), [1]).unwrap();
        let (a, b) = (counting(), counting());
        assert!(poll_with(&mut h, &Waker::from(a.clone())).is_pending());
        assert!(poll_with(&mut h, &Waker::from(b.clone())).is_pending());
        c.ready.store(true, Ordering::SeqCst);
        assert_eq!(p.try_complete_watched(&1), 1);
        assert_eq!(b.wakes.load(Ordering::SeqCst), 1, "the latest poller");
        assert_eq!(a.wakes.load(Ordering::SeqCst), 0);
        assert!(h.is_finished());
        assert!(matches!(
            poll_with(&mut h, &Waker::from(a.clone())),
            Poll::Ready(Ok(Completion::Completed(_)))
        ));
        // A, B, then A again (same waker as the first): A is woken.
        c.ready.store(false, Ordering::SeqCst);
        let mut h = p.try_complete_else_watch(c.op(2), ms(10), [1]).unwrap();
        let (a, b) = (counting(), counting());
        let wa = Waker::from(a.clone());
        assert!(poll_with(&mut h, &wa).is_pending());
        assert!(poll_with(&mut h, &Waker::from(b.clone())).is_pending());
        assert!(poll_with(&mut h, &wa).is_pending());
        tokio::time::sleep(ms(20)).await;
        settle().await;
        assert_eq!(a.wakes.load(Ordering::SeqCst), 1, "the latest poller (A)");
        assert_eq!(b.wakes.load(Ordering::SeqCst), 0);
        assert!(h.await.unwrap().is_expired());
        let m = p.metrics();
        assert!(balanced(&m) && m.delayed == 0 && m.panicked == 0, "{m:?}");
    })
}

/// Wakers that drop their handle and then panic, during one walk over many
/// operations: each panic is contained and counted, the walk completes every
/// operation, outputs are all dropped once.
#[test]
fn wakes_that_drop_the_handle_then_panic_during_a_walk() {
    support::paused_within(20, || async {
        let c = Ctx::new();
        let p: P = Purgatory::builder().name("wake-panic").build().unwrap();
        let n = 6u32;
        let mut slots = Vec::new();
        for i in 0..n {
            let slot: Slot<H> = Arc::new(Mutex::new(Some(
                p.try_complete_else_watch(c.op(i), ms(1000), [1, 100 + i])
                    .unwrap(),
            )));
            let s2 = slot.clone();
            let w = hook(move || {
                drop(s2.lock().unwrap().take());
                panic!("a hostile wake");
            });
            assert!(poll_slot(&slot, &Waker::from(w)));
            slots.push(slot);
        }
        c.ready.store(true, Ordering::SeqCst);
        assert_eq!(p.try_complete_watched(&1), n as usize);
        settle().await;
        for s in &slots {
            assert!(s.lock().unwrap().is_none());
        }
        let m = p.metrics();
        assert!(balanced(&m), "{m:?}");
        assert_eq!((m.completed, m.delayed), (n as u64, 0), "{m:?}");
        assert_eq!(m.panicked, n as u64, "{m:?}");
        assert_eq!(c.made.load(Ordering::SeqCst), n as usize);
        assert_eq!(c.drops.load(Ordering::SeqCst), n as usize);
    })
}

/// `OpRef::update`'s docs: "A panic in `f` reaches the caller; the operation
/// stays registered with whatever `f` changed": and it goes on working
/// (checks, updates, a reset, expiry).
#[tokio::test(start_paused = true)]
async fn a_panicking_update_leaves_the_operation_usable() {
    let p: ScriptedP = Purgatory::builder().name("upd-panic").build().unwrap();
    let h = p
        .try_complete_else_watch(Scripted::new(|n| (*n >= 3).then_some(*n)), ms(100), ["k"])
        .unwrap();
    let r = h.op_ref().unwrap();
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        r.update(|op| {
            op.n = 2;
            panic!("f panics");
        })
    }));
    assert!(caught.is_err(), "the panic reaches the caller");
    assert_eq!(r.status(), OperationStatus::Pending);
    assert_eq!(p.metrics().panicked, 0, "not the crate's to catch");
    assert_eq!(r.update(|op| op.n), Some(2), "what f changed stays");
    assert_eq!(p.try_complete_watched("k"), 0);
    assert_eq!(r.update(|op| op.n += 1), Some(()));
    assert!(r.reset(ms(500)));
    assert_eq!(p.try_complete_watched("k"), 1);
    assert_eq!(h.await, Ok(Completion::Completed(3)));
    // And an expiry after a panicking update.
    let h = p
        .try_complete_else_watch(Scripted::new(|_| None), ms(10), ["k"])
        .unwrap();
    let r = h.op_ref().unwrap();
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        r.update(|op| {
            op.n = 5;
            panic!("again")
        })
    }));
    assert_eq!(h.await, Ok(Completion::Expired(1005)));
    let m = p.metrics();
    assert!(balanced(&m) && m.delayed == 0, "{m:?}");
}

/// A's check reads "not yet", then walks "b", completing B; B's handle's
/// waker (run there, on A's thread, inside A's check) makes A ready and
/// walks "a" (or checks A by reference). The crate's "No missed events"
/// guarantee (and the README's "Exactly once") promises a re-check for an
/// event raised on the checking thread by the wake of a waker its own calls
/// caused: A completes without any further event.
#[test]
fn an_event_from_a_waker_run_inside_a_check_is_not_lost() {
    for by_ref in [false, true] {
        support::paused_within(10, move || async move {
            let p: ScriptedP = Purgatory::builder().name("waker-in-check").build().unwrap();
            let a_ready = Arc::new(AtomicBool::new(false));
            let b_ready = Arc::new(AtomicBool::new(false));
            let armed = Arc::new(AtomicBool::new(false));
            let ps: Slot<ScriptedP> = Arc::new(Mutex::new(Some(p.clone())));
            let (ar, br, ar2, ps2) = (a_ready.clone(), b_ready.clone(), armed.clone(), ps.clone());
            let a = p
                .try_complete_else_watch(
                    Scripted::new(move |_| {
                        let ready = ar.load(Ordering::SeqCst);
                        if !ready && ar2.swap(false, Ordering::SeqCst) {
                            br.store(true, Ordering::SeqCst);
                            get(&ps2).unwrap().try_complete_watched("b");
                        }
                        ready.then_some(7)
                    }),
                    ms(1000),
                    ["a"],
                )
                .unwrap();
            let a_ref: OpRef<&'static str, Scripted> = a.op_ref().unwrap();
            let br = b_ready.clone();
            let mut b = p
                .try_complete_else_watch(
                    Scripted::new(move |_| br.load(Ordering::SeqCst).then_some(8)),
                    ms(1000),
                    ["b"],
                )
                .unwrap();
            let (ar, pp) = (a_ready.clone(), p.clone());
            let w = Waker::from(hook(move || {
                ar.store(true, Ordering::SeqCst);
                if by_ref {
                    a_ref.try_complete();
                } else {
                    pp.try_complete_watched("a");
                }
            }));
            assert!(poll_with(&mut b, &w).is_pending());
            armed.store(true, Ordering::SeqCst);
            let done = p.try_complete_watched("a");
            assert_eq!(done, 1, "by_ref {by_ref}: A re-checked in the outer walk");
            assert_eq!(b.await, Ok(Completion::Completed(8)));
            assert_eq!(a.await, Ok(Completion::Completed(7)), "by_ref {by_ref}");
            let m = p.metrics();
            assert!(balanced(&m) && m.delayed == 0 && m.panicked == 0, "{m:?}");
            drop(ps.lock().unwrap().take());
        });
    }
}

/// A waker run inside A's check (B completed by A's walk) updates A and
/// resets A's timeout to the past. No deadlock (A's lock is held by this
/// very thread's check): `update` says `None`; the reset moves the timeout
/// and A, left pending by its check, is due at once: it expires with no time
/// passing.
#[test]
fn update_and_reset_from_a_waker_inside_the_same_operations_check() {
    support::paused_within(10, || async {
        let p: ScriptedP = Purgatory::builder().name("waker-reset").build().unwrap();
        let b_ready = Arc::new(AtomicBool::new(false));
        let armed = Arc::new(AtomicBool::new(false));
        let ps: Slot<ScriptedP> = Arc::new(Mutex::new(Some(p.clone())));
        let (br, ar2, ps2) = (b_ready.clone(), armed.clone(), ps.clone());
        let a = p
            .try_complete_else_watch(
                Scripted::new(move |_| {
                    if ar2.swap(false, Ordering::SeqCst) {
                        br.store(true, Ordering::SeqCst);
                        get(&ps2).unwrap().try_complete_watched("b");
                    }
                    None
                }),
                Duration::from_secs(3600),
                ["a"],
            )
            .unwrap();
        let a_ref = a.op_ref().unwrap();
        let br = b_ready.clone();
        let mut b = p
            .try_complete_else_watch(
                Scripted::new(move |_| br.load(Ordering::SeqCst).then_some(8)),
                ms(1000),
                ["b"],
            )
            .unwrap();
        let seen: Arc<Mutex<Vec<String>>> = Arc::default();
        let s2 = seen.clone();
        let w = Waker::from(hook(move || {
            let u = a_ref.update(|o| o.n = 99);
            let r = a_ref.reset_at(Instant::now() - ms(1));
            s2.lock()
                .unwrap()
                .push(format!("{u:?} {r} {:?}", a_ref.status()));
        }));
        assert!(poll_with(&mut b, &w).is_pending());
        armed.store(true, Ordering::SeqCst);
        let t0 = Instant::now();
        assert_eq!(p.try_complete_watched("a"), 0);
        assert_eq!(*seen.lock().unwrap(), ["None true Pending"]);
        settle().await;
        assert!(a.is_finished(), "a past reset is due at once");
        assert_eq!(a.await, Ok(Completion::Expired(1000)));
        assert_eq!(Instant::now(), t0, "no time passed");
        assert_eq!(b.await, Ok(Completion::Completed(8)));
        let m = p.metrics();
        assert!(balanced(&m) && m.delayed == 0 && m.panicked == 0, "{m:?}");
        drop(ps.lock().unwrap().take());
    })
}

/// A drain waits for a pending operation's (moved) timeout: pushed back by
/// a reset, it waits longer, returning no earlier than the new deadline and
/// less than a tick plus 2 ms after; brought into the past, the drain
/// returns with no time passing.
#[tokio::test(start_paused = true)]
async fn resets_move_what_a_drain_waits_for() {
    let tick = Duration::from_nanos(333_333);
    let p: ScriptedP = Purgatory::builder()
        .name("drain-reset")
        .tick(tick)
        .build()
        .unwrap();
    tokio::time::advance(Duration::from_nanos(123_457)).await;
    let h = p
        .try_complete_else_watch(Scripted::new(|_| None), ms(10), ["k"])
        .unwrap();
    let r = h.into_op_ref().unwrap();
    let start = Instant::now();
    let target = start + ms(50) + Duration::from_nanos(17);
    assert!(r.reset_at(target));
    p.drain().await;
    let waited = Instant::now() - start;
    assert!(Instant::now() >= target, "drained early: {waited:?}");
    assert!(
        Instant::now() - target < tick + ms(2),
        "drained late: {:?}",
        Instant::now() - target
    );
    assert_eq!(r.status(), OperationStatus::Expired);

    // A second purgatory: a drain pending on a 1 h timeout; a reset to the
    // past makes it return at once.
    let q: ScriptedP = Purgatory::builder().name("drain-reset-2").build().unwrap();
    let r = q
        .try_complete_else_watch(Scripted::new(|_| None), Duration::from_secs(3600), ["k"])
        .unwrap()
        .into_op_ref()
        .unwrap();
    let t0 = Instant::now();
    let q2 = q.clone();
    let drained = tokio::spawn(async move { q2.drain().await });
    settle().await;
    assert!(!drained.is_finished());
    assert!(r.reset_at(t0 - ms(5)));
    support::resolve(drained).await.unwrap();
    assert_eq!(Instant::now(), t0, "the past deadline was due at once");
    let m = q.metrics();
    assert!(balanced(&m) && m.expired == 1, "{m:?}");
}

/// Resets that straddle tick boundaries, with a custom tick and wheel shape
/// from the builder: each reset, made at a random off-grid instant to a
/// random off-grid deadline (earlier, later, or past), makes the operation
/// expire no earlier than its last deadline and, when that deadline was still
/// ahead, less than a tick + 2 ms after.
#[tokio::test(start_paused = true)]
async fn random_resets_over_odd_ticks_and_small_wheels() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for (tick, slots, levels) in [
        (Duration::from_nanos(777_777), 4, 2),
        (Duration::from_nanos(3), 2, 3),
        (Duration::from_millis(7), 8, 1),
        (Duration::from_nanos(1_000_001), 64, 2),
    ] {
        let p: ScriptedP = Purgatory::builder()
            .tick(tick)
            .slots_per_level(slots)
            .levels(levels)
            .build()
            .unwrap();
        for round in 0..40 {
            tokio::time::advance(Duration::from_nanos(rng.below(5_000_000))).await;
            let at = Instant::now() + Duration::from_nanos(rng.below(200_000_000));
            let h = p
                .try_complete_else_watch_at(Scripted::new(|_| None), at, ["k"])
                .unwrap();
            let r = h.op_ref().unwrap();
            let mut last = at;
            for _ in 0..rng.below(4) {
                let step = Duration::from_nanos(rng.below(30_000_000));
                tokio::time::advance(step).await;
                if r.is_finished() {
                    break;
                }
                let now = Instant::now();
                let d = match rng.below(3) {
                    0 => now
                        .checked_sub(Duration::from_nanos(rng.below(10_000_000)))
                        .unwrap(),
                    1 => now + Duration::from_nanos(rng.below(1_000_000)),
                    _ => now + Duration::from_nanos(rng.below(500_000_000)),
                };
                if r.reset_at(d) {
                    last = d.max(now);
                } else {
                    assert!(r.is_finished());
                }
            }
            let future_left = last > Instant::now();
            let out = support::resolve(h).await;
            assert!(matches!(out, Ok(Completion::Expired(_))));
            let now = Instant::now();
            // The handle resolved no earlier than the deadline in force.
            assert!(
                now >= last,
                "tick {tick:?} round {round}: expired {:?} early",
                last - now
            );
            if future_left {
                assert!(
                    now - last < tick + ms(2),
                    "tick {tick:?} round {round}: expired {:?} late",
                    now - last
                );
            }
        }
        let m = p.metrics();
        assert!(balanced(&m) && m.delayed == 0, "{m:?}");
        assert_eq!(m.expired, 40);
    }
}
