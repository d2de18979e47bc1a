//! Watches at a level used hostilely, in combination: the last purgatory
//! dropped from a check at a level, key `Clone`s that shut down or cancel
//! mid-registration, outputs dropped inside an advance that advance the same
//! key, handles dropped from their own level check, shutdown, drain and
//! cancellation by key from inside an advance, panics mixed in one advance,
//! resets to the past from a level check, keys re-registering from their
//! `Drop`, `Eq` panicking mid-registration, one key watched plainly and at
//! several levels, checks and drops that call back into the key being
//! advanced, entries of completed operations on a key never advanced; and
//! real-thread races of advances against registrations, cancels, expiries,
//! shutdowns and the last purgatory dropped, and of events against a check
//! held inside on another thread (which of them ask for a re-run).

mod support;

use std::hash::{Hash, Hasher};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio_purgatory::{
    Completion, OpRef, Operation, OperationError, OperationHandle, OperationStatus, Purgatory,
    Watch, WatchError,
};

use support::{balanced, ms, paused_within, settle, within};

type Hook = Arc<dyn Fn() + Send + Sync>;
type CheckFn = Box<dyn FnMut(Option<u64>) -> Option<u64> + Send>;

/// An output whose drop may run a hook.
struct Out(u64, Option<Hook>, Arc<AtomicUsize>);

impl Drop for Out {
    fn drop(&mut self) {
        self.2.fetch_add(1, Ordering::SeqCst);
        if let Some(h) = self.1.take() {
            h();
        }
    }
}

impl std::fmt::Debug for Out {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Out({})", self.0)
    }
}

impl PartialEq for Out {
    fn eq(&self, o: &Self) -> bool {
        self.0 == o.0
    }
}

/// An operation built from closures.
struct L {
    check: CheckFn,
    expire: Option<Box<dyn FnOnce() -> u64 + Send>>,
    on_drop: Option<Box<dyn FnOnce() + Send>>,
    out_drop: Option<Hook>,
    out_drops: Arc<AtomicUsize>,
    drops: Arc<AtomicUsize>,
    in_check: Arc<AtomicBool>,
    overlaps: Arc<AtomicUsize>,
}

impl L {
    fn new(check: impl FnMut(Option<u64>) -> Option<u64> + Send + 'static) -> L {
        L {
            check: Box::new(check),
            expire: None,
            on_drop: None,
            out_drop: None,
            out_drops: Arc::default(),
            drops: Arc::default(),
            in_check: Arc::default(),
            overlaps: Arc::default(),
        }
    }
    fn never() -> L {
        L::new(|_| None)
    }
    fn on_drop(mut self, f: impl FnOnce() + Send + 'static) -> L {
        self.on_drop = Some(Box::new(f));
        self
    }
    fn out_drop(mut self, f: Hook) -> L {
        self.out_drop = Some(f);
        self
    }
    fn drops(mut self, c: &Arc<AtomicUsize>) -> L {
        self.drops = c.clone();
        self
    }
    fn run(&mut self, l: Option<u64>) -> Option<Out> {
        if self.in_check.swap(true, Ordering::SeqCst) {
            self.overlaps.fetch_add(1, Ordering::SeqCst);
        }
        let r = catch_unwind(AssertUnwindSafe(|| (self.check)(l)));
        self.in_check.store(false, Ordering::SeqCst);
        match r {
            Ok(v) => v.map(|v| Out(v, self.out_drop.clone(), self.out_drops.clone())),
            Err(p) => std::panic::resume_unwind(p),
        }
    }
}

impl Operation for L {
    type Output = Out;
    fn try_complete(&mut self) -> Option<Out> {
        self.run(None)
    }
    fn try_complete_reached(&mut self, reached: u64) -> Option<Out> {
        self.run(Some(reached))
    }
    fn on_expiration(mut self) -> Out {
        let v = match self.expire.take() {
            Some(f) => f(),
            None => 0,
        };
        Out(v, self.out_drop.clone(), self.out_drops.clone())
    }
}

impl Drop for L {
    fn drop(&mut self) {
        self.drops.fetch_add(1, Ordering::SeqCst);
        if let Some(f) = self.on_drop.take() {
            f();
        }
    }
}

type P = Purgatory<u32, L>;

/// Waits, yielding, until `done` reaches `at_least`: a race runs for an
/// amount of work, not of wall-clock time (the test's own bound catches a
/// hang).
fn wait_for(done: &AtomicUsize, at_least: usize) {
    while done.load(Ordering::SeqCst) < at_least {
        std::thread::yield_now();
    }
}
type Slot<T> = Arc<OnceLock<T>>;
/// A registration of the races: its index, key and handle.
type Registered = (u64, u32, OperationHandle<u32, L>);

fn quiet(p: &P) {
    let m = p.metrics();
    assert_eq!(m.delayed, 0, "{m:?}");
    assert!(balanced(&m), "unbalanced {m:?}");
    assert_eq!(m.watched, m.tombstones, "{m:?}");
}

fn val(c: Result<Completion<Out>, OperationError>) -> Result<Completion<u64>, OperationError> {
    c.map(|c| c.map(|o| o.0))
}

// ---------------------------------------------------------------------------
// 1. A check run by an advance drops the last Purgatory clone (via OpRef).

#[test]
fn last_purgatory_dropped_inside_an_opref_check_at_level() {
    paused_within(10, || async {
        let p: P = Purgatory::new();
        let holder: Arc<Mutex<Option<P>>> = Arc::new(Mutex::new(Some(p.clone())));
        let h2 = holder.clone();
        let a = p
            .try_complete_else_watch_levels(
                L::new(move |l| {
                    if l.is_none() {
                        // Only the check by reference drops it.
                        let taken = h2.lock().unwrap().take();
                        drop(taken);
                    }
                    None
                }),
                ms(1000),
                [Watch::level(1, 5)],
            )
            .unwrap();
        let others: Vec<_> = (0..3)
            .map(|i| {
                p.try_complete_else_watch_levels(L::never(), ms(1000), [Watch::level(1, 6 + i)])
                    .unwrap()
            })
            .collect();
        // The registration ran the check twice already: the holder is empty.
        // Put it back.
        *holder.lock().unwrap() = Some(p.clone());
        let r = a.op_ref().unwrap();
        drop(p);
        assert!(!r.try_complete());
        assert_eq!(
            val(a.await),
            Err(OperationError::Shutdown),
            "the op under check, after its check, as the others"
        );
        for h in others {
            assert_eq!(val(h.await), Err(OperationError::Shutdown));
        }
    })
}

// ---------------------------------------------------------------------------
// 2. A key whose Clone shuts the purgatory down mid level registration.

struct CKey {
    id: u32,
    on_clone: Option<Hook>,
    on_drop: Option<Hook>,
}

impl Clone for CKey {
    fn clone(&self) -> Self {
        if let Some(h) = &self.on_clone {
            h();
        }
        CKey {
            id: self.id,
            on_clone: None,
            on_drop: self.on_drop.clone(),
        }
    }
}
impl PartialEq for CKey {
    fn eq(&self, o: &Self) -> bool {
        self.id == o.id
    }
}
impl Eq for CKey {}
impl Hash for CKey {
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.id.hash(h);
    }
}
impl Drop for CKey {
    fn drop(&mut self) {
        if let Some(h) = &self.on_drop {
            h();
        }
    }
}
impl std::borrow::Borrow<u32> for CKey {
    fn borrow(&self) -> &u32 {
        &self.id
    }
}

fn ck(id: u32) -> CKey {
    CKey {
        id,
        on_clone: None,
        on_drop: None,
    }
}

type CP = Purgatory<CKey, L>;

fn cquiet(p: &CP) {
    let m = p.metrics();
    assert_eq!(m.delayed, 0, "{m:?}");
    assert!(balanced(&m), "unbalanced {m:?}");
    assert_eq!(m.watched, m.tombstones, "{m:?}");
}

#[test]
fn a_key_clone_that_shuts_down_mid_level_registration_hands_back() {
    paused_within(10, || async {
        let p: CP = Purgatory::new();
        let slot: Slot<CP> = Arc::default();
        slot.set(p.clone()).ok().unwrap();
        let s = slot.clone();
        let got = Arc::new(AtomicUsize::new(usize::MAX));
        let g = got.clone();
        let pending = p
            .try_complete_else_watch_levels(L::never(), ms(1000), [Watch::level(ck(1), 3)])
            .unwrap();
        let bad = CKey {
            id: 2,
            on_clone: Some(Arc::new(move || {
                g.store(s.get().unwrap().shutdown().len(), Ordering::SeqCst);
            })),
            on_drop: None,
        };
        let drops = Arc::new(AtomicUsize::new(0));
        let r = p.try_complete_else_watch_levels(
            L::never().drops(&drops),
            ms(1000),
            [Watch::level(ck(1), 5), Watch::level(bad, 7)],
        );
        assert_eq!(got.load(Ordering::SeqCst), 1, "the earlier one handed back");
        match r {
            Err(WatchError::Shutdown(op)) => drop(op),
            Err(e) => panic!("wrong refusal {:?}", e.kind()),
            Ok(_) => panic!("registered after shutdown"),
        }
        assert_eq!(drops.load(Ordering::SeqCst), 1);
        assert_eq!(val(pending.await), Err(OperationError::Shutdown));
        cquiet(&p);
        assert_eq!(p.metrics().watched, 0);
    })
}

#[test]
fn a_key_clone_that_cancels_an_earlier_key_mid_level_registration() {
    paused_within(10, || async {
        let p: CP = Purgatory::new();
        let slot: Slot<CP> = Arc::default();
        slot.set(p.clone()).ok().unwrap();
        let s = slot.clone();
        let got = Arc::new(AtomicUsize::new(usize::MAX));
        let g = got.clone();
        let other = p
            .try_complete_else_watch_levels(L::never(), ms(1000), [Watch::level(ck(1), 3)])
            .unwrap();
        let bad = CKey {
            id: 2,
            on_clone: Some(Arc::new(move || {
                g.store(
                    s.get().unwrap().cancel_for_key(&1u32).len(),
                    Ordering::SeqCst,
                );
            })),
            on_drop: None,
        };
        let drops = Arc::new(AtomicUsize::new(0));
        let h = p
            .try_complete_else_watch_levels(
                L::never().drops(&drops),
                ms(1000),
                [Watch::level(ck(1), 5), Watch::level(bad, 7)],
            )
            .unwrap();
        assert_eq!(got.load(Ordering::SeqCst), 1, "only the other came back");
        assert_eq!(val(other.await), Err(OperationError::Cancelled));
        assert_eq!(val(h.await), Err(OperationError::Cancelled));
        assert_eq!(drops.load(Ordering::SeqCst), 1);
        cquiet(&p);
        assert_eq!(p.try_complete_reached(&2u32, 100), 0);
        let m = p.metrics();
        assert_eq!((m.watched, m.tombstones), (0, 0), "{m:?}");
    })
}

/// A key whose `Clone` (run when the key is first watched) cancels by that
/// same key: the cancel comes before the operation watches the key, so it
/// finds nothing of the registering operation. The registration succeeds,
/// the cancel returns nothing, and the operation later finishes by its
/// timeout.
#[tokio::test(start_paused = true)]
async fn a_key_clone_cancelling_its_own_key_cancels_nothing_of_the_registration() {
    let p: CP = Purgatory::new();
    let slot: Slot<CP> = Arc::default();
    slot.set(p.clone()).ok().unwrap();
    let s = slot.clone();
    let got: Arc<Mutex<Vec<usize>>> = Arc::default();
    let g = got.clone();
    let key = CKey {
        id: 1,
        on_clone: Some(Arc::new(move || {
            let back = s.get().unwrap().cancel_for_key(&1u32);
            g.lock().unwrap().push(back.len());
        })),
        on_drop: None,
    };
    let h = p
        .try_complete_else_watch_levels(L::never(), Duration::from_secs(1), [Watch::level(key, 10)])
        .unwrap();
    assert_eq!(
        *got.lock().unwrap(),
        [0],
        "the clone ran once and its cancel found nothing"
    );
    assert!(!h.is_finished(), "the registration left it pending");
    assert_eq!(val(h.await), Ok(Completion::Expired(0)));
    cquiet(&p);
}

// ---------------------------------------------------------------------------
// 3. Output drops that re-enter an advance of the same key.

#[test]
fn an_output_dropped_inside_an_advance_advances_the_same_key() {
    paused_within(10, || async {
        let p: P = Purgatory::new();
        let slot: Slot<P> = Arc::default();
        slot.set(p.clone()).ok().unwrap();
        let later: Arc<Mutex<Vec<OperationHandle<u32, L>>>> = Arc::default();
        let (s, l2) = (slot.clone(), later.clone());
        let hook: Hook = Arc::new(move || {
            let p = s.get().unwrap();
            // Advance further, and register at a level the outer advance
            // already passed.
            p.try_complete_reached(&1, 50);
            let h = p
                .try_complete_else_watch_levels(
                    L::new(|l| l.filter(|l| *l >= 60)),
                    ms(1000),
                    [Watch::level(1, 2)],
                )
                .unwrap();
            l2.lock().unwrap().push(h);
        });
        let first = p
            .try_complete_else_watch_levels(
                L::new(|l| l.filter(|l| *l >= 10)).out_drop(hook),
                ms(1000),
                [Watch::level(1, 10)],
            )
            .unwrap();
        first.detach();
        let mid: Vec<_> = (0..5)
            .map(|i| {
                p.try_complete_else_watch_levels(
                    L::new(move |l| l.filter(|l| *l >= 40 + i)),
                    ms(1000),
                    [Watch::level(1, 11 + i)],
                )
                .unwrap()
            })
            .collect();
        // The outer advance completes `first` (its output dropped here, which
        // advances to 50) and then goes on with the mid ones at 30.
        let n = p.try_complete_reached(&1, 30);
        assert_eq!(n, 1, "the outer advance completed first only");
        for h in mid {
            assert!(matches!(val(h.await), Ok(Completion::Completed(50))));
        }
        let h = later.lock().unwrap().pop().unwrap();
        assert_eq!(p.try_complete_reached(&1, 60), 1);
        assert_eq!(val(h.await), Ok(Completion::Completed(60)));
        quiet(&p);
    })
}

// ---------------------------------------------------------------------------
// 4. A handle dropped from inside its own check during an advance.

#[test]
fn a_handle_dropped_inside_its_own_level_check() {
    paused_within(10, || async {
        let p: P = Purgatory::builder().max_pending(2).build().unwrap();
        for completes in [false, true] {
            let slot: Arc<Mutex<Option<OperationHandle<u32, L>>>> = Arc::default();
            let s = slot.clone();
            let out_drops = Arc::new(AtomicUsize::new(0));
            let mut op = L::new(move |l| {
                if l.is_some() {
                    drop(s.lock().unwrap().take());
                    return completes.then_some(9);
                }
                None
            });
            op.out_drops = out_drops.clone();
            let h = p
                .try_complete_else_watch_levels(op, ms(1000), [Watch::level(1, 1)])
                .unwrap();
            let r = h.op_ref().unwrap();
            *slot.lock().unwrap() = Some(h);
            assert_eq!(p.try_complete_reached(&1, 1), usize::from(completes));
            let want = if completes {
                OperationStatus::Completed
            } else {
                OperationStatus::Cancelled
            };
            assert_eq!(r.status(), want);
            assert_eq!(out_drops.load(Ordering::SeqCst), usize::from(completes));
            drop(r);
            quiet(&p);
        }
        // Room came back both times.
        let a = p.try_complete_else_watch(L::never(), ms(5), [3]).unwrap();
        let b = p.try_complete_else_watch(L::never(), ms(5), [3]).unwrap();
        assert!(a.await.is_ok() && b.await.is_ok());
        quiet(&p);
    })
}

// ---------------------------------------------------------------------------
// 5. Shutdown from inside a check of an advance: the rest of the batch.

#[test]
fn shutdown_inside_an_advance_hands_back_the_rest_of_the_batch() {
    paused_within(10, || async {
        let p: P = Purgatory::new();
        let slot: Slot<P> = Arc::default();
        slot.set(p.clone()).ok().unwrap();
        let back = Arc::new(AtomicUsize::new(usize::MAX));
        let (s, b) = (slot.clone(), back.clone());
        let before: Vec<_> = (0..3)
            .map(|i| {
                p.try_complete_else_watch_levels(
                    L::new(|l| l.filter(|l| *l >= 100)),
                    ms(1000),
                    [Watch::level(1, i)],
                )
                .unwrap()
            })
            .collect();
        let killer = p
            .try_complete_else_watch_levels(
                L::new(move |l| {
                    if l.is_some() {
                        b.store(s.get().unwrap().shutdown().len(), Ordering::SeqCst);
                    }
                    None
                }),
                ms(1000),
                [Watch::level(1, 5)],
            )
            .unwrap();
        let after: Vec<_> = (0..3)
            .map(|i| {
                p.try_complete_else_watch_levels(
                    L::new(|l| l.filter(|l| *l >= 10)),
                    ms(1000),
                    [Watch::level(1, 6 + i), Watch::key(2)],
                )
                .unwrap()
            })
            .collect();
        assert_eq!(p.try_complete_reached(&1, 10), 0);
        assert_eq!(back.load(Ordering::SeqCst), 6);
        // Its own cancel, left to its own check, tells the shutdown too.
        assert_eq!(val(killer.await), Err(OperationError::Shutdown));
        for h in before.into_iter().chain(after) {
            assert_eq!(val(h.await), Err(OperationError::Shutdown));
        }
        quiet(&p);
        assert_eq!(p.metrics().watched, 0);
    })
}

// ---------------------------------------------------------------------------
// 6. Panicking check and drop at levels in one advance: the rest complete.

#[test]
fn panics_in_an_advance_stop_nothing_else() {
    paused_within(10, || async {
        let p: P = Purgatory::new();
        let drops = Arc::new(AtomicUsize::new(0));
        let mut hs = Vec::new();
        for i in 0..10u64 {
            let op = if i.is_multiple_of(3) {
                L::new(|l| {
                    if l.is_some() {
                        panic!("hostile check")
                    } else {
                        None
                    }
                })
            } else if i % 3 == 1 {
                L::new(|l| l).on_drop(|| panic!("hostile drop"))
            } else {
                L::new(|l| l)
            };
            hs.push(
                p.try_complete_else_watch_levels(op.drops(&drops), ms(100), [Watch::level(1, i)])
                    .unwrap(),
            );
        }
        assert_eq!(p.try_complete_reached(&1, 100), 6);
        let m = p.metrics();
        assert_eq!(m.panicked, 4 + 3, "{m:?}");
        let mut done = 0;
        for (i, h) in hs.into_iter().enumerate() {
            let r = val(h.await);
            if i.is_multiple_of(3) {
                assert_eq!(r, Ok(Completion::Expired(0)), "{i}");
            } else {
                assert_eq!(r, Ok(Completion::Completed(100)), "{i}");
                done += 1;
            }
        }
        assert_eq!(done, 6);
        assert_eq!(drops.load(Ordering::SeqCst), 10);
        quiet(&p);
    })
}

// ---------------------------------------------------------------------------
// 7. A check of an advance that drains and then cancels the key; the drain ends.

#[test]
fn drain_started_and_ended_from_inside_an_advance() {
    paused_within(10, || async {
        let p: P = Purgatory::new();
        let slot: Slot<P> = Arc::default();
        slot.set(p.clone()).ok().unwrap();
        let s = slot.clone();
        let cancelled = Arc::new(AtomicUsize::new(0));
        let c = cancelled.clone();
        let a = p
            .try_complete_else_watch_levels(
                L::new(move |l| {
                    if l.is_some() {
                        let p = s.get().unwrap();
                        drop(p.drain());
                        c.store(p.cancel_for_key(&1).len(), Ordering::SeqCst);
                        assert!(matches!(
                            p.try_complete_else_watch(L::never(), ms(10), [1]),
                            Err(WatchError::Draining(_))
                        ));
                    }
                    None
                }),
                ms(1000),
                [Watch::level(1, 1)],
            )
            .unwrap();
        let b = p
            .try_complete_else_watch_levels(L::never(), ms(1000), [Watch::level(1, 2)])
            .unwrap();
        assert_eq!(p.try_complete_reached(&1, 5), 0);
        assert_eq!(cancelled.load(Ordering::SeqCst), 1);
        assert_eq!(val(a.await), Err(OperationError::Cancelled));
        assert_eq!(val(b.await), Err(OperationError::Cancelled));
        tokio::time::timeout(ms(10), p.drain())
            .await
            .expect("drain ends");
        quiet(&p);
    })
}

// ---------------------------------------------------------------------------
// 8. A check that resets its own timeout to the past and says not yet: it
//    expires after, once; the level watch stays one above.

#[test]
fn reset_to_the_past_inside_a_level_check_expires_once() {
    paused_within(10, || async {
        let p: P = Purgatory::new();
        let me: Slot<OpRef<u32, L>> = Arc::default();
        let m2 = me.clone();
        let drops = Arc::new(AtomicUsize::new(0));
        let h = p
            .try_complete_else_watch_levels(
                L::new(move |l| {
                    if l.is_some() {
                        let r = m2.get().unwrap();
                        assert!(r.reset_at(tokio::time::Instant::now() - ms(5)));
                    }
                    None
                })
                .drops(&drops),
                ms(100_000),
                [Watch::level(1, 1)],
            )
            .unwrap();
        me.set(h.op_ref().unwrap()).ok().unwrap();
        assert_eq!(p.try_complete_reached(&1, 3), 0);
        assert_eq!(val(h.await), Ok(Completion::Expired(0)));
        assert_eq!(drops.load(Ordering::SeqCst), 1);
        assert_eq!(p.try_complete_reached(&1, 10), 0);
        quiet(&p);
    })
}

// ---------------------------------------------------------------------------
// 9. A key whose Drop re-enters from an advance that empties its list.

#[test]
fn a_key_dropped_by_an_advance_registers_on_it_again() {
    paused_within(10, || async {
        let p: CP = Purgatory::new();
        let slot: Slot<CP> = Arc::default();
        slot.set(p.clone()).ok().unwrap();
        let later: Arc<Mutex<Vec<OperationHandle<CKey, L>>>> = Arc::default();
        let fired = Arc::new(AtomicBool::new(false));
        let armed = Arc::new(AtomicBool::new(false));
        let (s, l2, f2, a2) = (slot.clone(), later.clone(), fired.clone(), armed.clone());
        let hook: Hook = Arc::new(move || {
            if !a2.load(Ordering::SeqCst) || f2.swap(true, Ordering::SeqCst) {
                return;
            }
            let p = s.get().unwrap();
            let h = p
                .try_complete_else_watch_levels(
                    L::new(|l| l.filter(|l| *l >= 20)),
                    ms(1000),
                    [Watch::level(ck(1), 15)],
                )
                .unwrap();
            l2.lock().unwrap().push(h);
            p.try_complete_reached(&1u32, 16);
        });
        let key = CKey {
            id: 1,
            on_clone: None,
            on_drop: Some(hook),
        };
        let hs: Vec<_> = (0..3)
            .map(|i| {
                p.try_complete_else_watch_levels(
                    L::new(|l| l.filter(|l| *l >= 5)),
                    ms(1000),
                    [Watch::level(
                        CKey {
                            id: 1,
                            on_clone: None,
                            on_drop: key.on_drop.clone(),
                        },
                        i,
                    )],
                )
                .unwrap()
            })
            .collect();
        drop(key);
        armed.store(true, Ordering::SeqCst);
        // Only the map's copy remains with the hook.
        assert_eq!(p.try_complete_reached(&1u32, 5), 3);
        for h in hs {
            assert_eq!(val(h.await), Ok(Completion::Completed(5)));
        }
        assert!(fired.load(Ordering::SeqCst), "the map's key was dropped");
        let h = later.lock().unwrap().pop().unwrap();
        assert_eq!(p.try_complete_reached(&1u32, 20), 1);
        assert_eq!(val(h.await), Ok(Completion::Completed(20)));
        cquiet(&p);
    })
}

// ---------------------------------------------------------------------------
// 10. Races on real threads: advances vs registrations at levels, cancels by
//     key and by reference, expiries. Exactly once, no overlap, no lost
//     advance, balanced.

#[test]
fn advances_race_registrations_cancels_and_expiries() {
    within(60, || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let _g = rt.enter();
        let p: P = Purgatory::new();
        let hw: Arc<Vec<AtomicU64>> = Arc::new((0..4).map(|_| AtomicU64::new(0)).collect());
        let overlaps = Arc::new(AtomicUsize::new(0));
        let created = Arc::new(AtomicUsize::new(0));
        let drops = Arc::new(AtomicUsize::new(0));
        let cancelled_back = Arc::new(AtomicUsize::new(0));
        let refs: Arc<Mutex<Vec<OpRef<u32, L>>>> = Arc::default();
        let handles: Arc<Mutex<Vec<Registered>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::new();
        // Advancers.
        for t in 0..2u32 {
            let (p, hw, stop) = (p.clone(), hw.clone(), stop.clone());
            threads.push(std::thread::spawn(move || {
                let mut i = 0u64;
                while !stop.load(Ordering::SeqCst) {
                    i += 1;
                    let k = ((i + u64::from(t)) % 4) as u32;
                    let lvl = hw[k as usize].fetch_add(1, Ordering::SeqCst) + 1;
                    p.try_complete_reached(&k, lvl);
                    if i.is_multiple_of(97) {
                        p.try_complete_watched(&k);
                    }
                }
            }));
        }
        // Registrars.
        for t in 0..2u64 {
            let (p, hw, stop) = (p.clone(), hw.clone(), stop.clone());
            let (ov, cr, dr, refs, handles) = (
                overlaps.clone(),
                created.clone(),
                drops.clone(),
                refs.clone(),
                handles.clone(),
            );
            let rt = rt.handle().clone();
            threads.push(std::thread::spawn(move || {
                let _g = rt.enter();
                let mut i = 0u64;
                while !stop.load(Ordering::SeqCst) {
                    i += 1;
                    let k = ((i * 7 + t) % 4) as u32;
                    let need = hw[k as usize].load(Ordering::SeqCst) + 1 + i % 50;
                    let hw2 = hw.clone();
                    let mut op = L::new(move |l| {
                        let now = hw2[k as usize].load(Ordering::SeqCst).max(l.unwrap_or(0));
                        (now >= need).then_some(need)
                    })
                    .drops(&dr);
                    op.overlaps = ov.clone();
                    cr.fetch_add(1, Ordering::SeqCst);
                    let timeout = if i.is_multiple_of(5) {
                        Duration::from_millis(1 + i % 3)
                    } else {
                        Duration::from_secs(30)
                    };
                    let watches = if i.is_multiple_of(2) {
                        vec![Watch::level(k, need)]
                    } else {
                        vec![Watch::level(k, need), Watch::level(k, need + 3)]
                    };
                    match p.try_complete_else_watch_levels(op, timeout, watches) {
                        Ok(h) => {
                            if let Some(r) = h.op_ref() {
                                refs.lock().unwrap().push(r);
                            }
                            handles.lock().unwrap().push((need, k, h));
                        }
                        Err(e) => drop(e.into_inner()),
                    }
                }
            }));
        }
        // Cancellers.
        {
            let (p, stop, back, refs) = (
                p.clone(),
                stop.clone(),
                cancelled_back.clone(),
                refs.clone(),
            );
            threads.push(std::thread::spawn(move || {
                let mut i = 0u64;
                while !stop.load(Ordering::SeqCst) {
                    i += 1;
                    if i.is_multiple_of(50) {
                        let n = p.cancel_for_key(&((i % 4) as u32)).len();
                        back.fetch_add(n, Ordering::SeqCst);
                    }
                    let r = refs.lock().unwrap().pop();
                    if let Some(r) = r {
                        if i.is_multiple_of(3) {
                            if r.cancel().is_some() {
                                back.fetch_add(1, Ordering::SeqCst);
                            }
                        } else if i % 3 == 1 {
                            r.reset(Duration::from_millis(i % 4));
                        }
                    }
                    std::thread::yield_now();
                }
            }));
        }
        // Run the race for 30,000 registrations.
        wait_for(&created, 30_000);
        stop.store(true, Ordering::SeqCst);
        for t in threads {
            t.join().unwrap();
        }
        // Final advance past everything: whatever is still pending completes.
        for k in 0..4u32 {
            let lvl = hw[k as usize].fetch_add(1000, Ordering::SeqCst) + 1000;
            p.try_complete_reached(&k, lvl);
        }
        let hs = std::mem::take(&mut *handles.lock().unwrap());
        refs.lock().unwrap().clear();
        let mut counts = [0usize; 4];
        rt.block_on(async {
            for (need, k, h) in hs {
                let r = tokio::time::timeout(Duration::from_secs(5), h)
                    .await
                    .unwrap_or_else(|_| panic!("lost: need {need} on {k}"));
                match val(r) {
                    Ok(Completion::Completed(v)) => {
                        assert_eq!(v, need);
                        counts[0] += 1
                    }
                    Ok(Completion::Expired(_)) => counts[1] += 1,
                    Err(OperationError::Cancelled) => counts[2] += 1,
                    Err(e) => panic!("{e:?}"),
                }
            }
        });
        let m = p.metrics();
        assert_eq!(overlaps.load(Ordering::SeqCst), 0, "checks overlapped");
        assert_eq!(m.delayed, 0, "{m:?}");
        assert!(balanced(&m), "{m:?}");
        assert_eq!(m.watched, m.tombstones, "{m:?}");
        assert!(
            m.cancelled as usize >= cancelled_back.load(Ordering::SeqCst),
            "{m:?}"
        );
        assert_eq!(
            drops.load(Ordering::SeqCst),
            created.load(Ordering::SeqCst),
            "every op dropped once (cancelled ones by us)"
        );
        drop(p.shutdown());
        let _ = settle;
    })
}

// ---------------------------------------------------------------------------
// 11. Shutdown racing advances and level registrations on real threads:
//     nothing lost, each op dropped once, handles agree with the lists.

#[test]
fn shutdown_races_advances_and_level_registrations() {
    within(120, || {
        for round in 0..40u64 {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            let _g = rt.enter();
            let p: P = Purgatory::new();
            let hw = Arc::new(AtomicU64::new(0));
            let created = Arc::new(AtomicUsize::new(0));
            let drops = Arc::new(AtomicUsize::new(0));
            let refused = Arc::new(AtomicUsize::new(0));
            let overlaps = Arc::new(AtomicUsize::new(0));
            let handles: Arc<Mutex<Vec<OperationHandle<u32, L>>>> = Arc::default();
            let go = Arc::new(std::sync::Barrier::new(4));
            let mut threads = Vec::new();
            {
                let (p, hw, go) = (p.clone(), hw.clone(), go.clone());
                threads.push(std::thread::spawn(move || {
                    go.wait();
                    for _ in 0..3000 {
                        let l = hw.fetch_add(1, Ordering::SeqCst) + 1;
                        p.try_complete_reached(&((l % 2) as u32), l);
                    }
                }));
            }
            for t in 0..2u64 {
                let (p, hw, go) = (p.clone(), hw.clone(), go.clone());
                let (cr, dr, rf, ov, hs) = (
                    created.clone(),
                    drops.clone(),
                    refused.clone(),
                    overlaps.clone(),
                    handles.clone(),
                );
                let rt = rt.handle().clone();
                threads.push(std::thread::spawn(move || {
                    let _g = rt.enter();
                    go.wait();
                    for i in 0..1500u64 {
                        let need = hw.load(Ordering::SeqCst) + 2 + (i + t) % 20;
                        let hw2 = hw.clone();
                        let mut op =
                            L::new(move |_| (hw2.load(Ordering::SeqCst) >= need).then_some(need))
                                .drops(&dr);
                        op.overlaps = ov.clone();
                        cr.fetch_add(1, Ordering::SeqCst);
                        let k = ((i + t) % 2) as u32;
                        match p.try_complete_else_watch_levels(
                            op,
                            Duration::from_secs(60),
                            [
                                Watch::level(k, need),
                                Watch::level(1 - k, need + 1),
                                Watch::key(7),
                            ],
                        ) {
                            Ok(h) => hs.lock().unwrap().push(h),
                            Err(e) => {
                                assert!(matches!(e, WatchError::Shutdown(_)), "{:?}", e.kind());
                                rf.fetch_add(1, Ordering::SeqCst);
                                drop(e.into_inner());
                            }
                        }
                    }
                }));
            }
            go.wait();
            // Shut down part-way, at a point that moves from round to round.
            wait_for(&created, 20 + (round as usize) * 37 % 800);
            let back = p.shutdown();
            let n_back = back.len();
            drop(back);
            for t in threads {
                t.join().unwrap();
            }
            let hs = std::mem::take(&mut *handles.lock().unwrap());
            let (mut comp, mut shut, mut canc) = (0, 0, 0);
            rt.block_on(async {
                for h in hs {
                    match val(tokio::time::timeout(Duration::from_secs(5), h)
                        .await
                        .expect("resolves"))
                    {
                        Ok(Completion::Completed(_)) => comp += 1,
                        Err(OperationError::Shutdown) => shut += 1,
                        Err(OperationError::Cancelled) => canc += 1,
                        other => panic!("{other:?}"),
                    }
                }
            });
            let m = p.metrics();
            assert_eq!(overlaps.load(Ordering::SeqCst), 0);
            assert_eq!(
                shut, n_back,
                "round {round}: handles that read Shutdown vs handed back {m:?}"
            );
            assert_eq!(m.delayed, 0, "round {round} {m:?}");
            assert!(balanced(&m), "round {round} {m:?}");
            // (Entries of registrations whose second check completed after
            // the shutdown stay: see the minimal test below.)
            assert_eq!(m.watched, m.tombstones, "round {round} {m:?}");
            assert_eq!(
                drops.load(Ordering::SeqCst),
                created.load(Ordering::SeqCst),
                "round {round}: each op dropped once"
            );
            let _ = (comp, canc);
            drop(p);
            rt.shutdown_timeout(Duration::from_secs(1));
        }
    })
}

// ---------------------------------------------------------------------------
// 12. The last Purgatory dropped while other threads check by reference and
//     the reaper expires.

#[test]
fn last_purgatory_dropped_while_refs_check_and_reaper_expires() {
    within(120, || {
        for round in 0..30u64 {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            let _g = rt.enter();
            let p: P = Purgatory::new();
            let drops = Arc::new(AtomicUsize::new(0));
            let flip = Arc::new(AtomicU64::new(0));
            let mut hs = Vec::new();
            let mut refs = Vec::new();
            for i in 0..600u64 {
                let f = flip.clone();
                let op = L::new(move |_| {
                    let n = f.load(Ordering::SeqCst);
                    (n > 0 && f.fetch_add(1, Ordering::SeqCst).is_multiple_of(50)).then_some(i)
                })
                .drops(&drops);
                let h = p
                    .try_complete_else_watch_levels(
                        op,
                        Duration::from_micros(100 + (i * 13) % 2000),
                        [Watch::level((i % 3) as u32, i)],
                    )
                    .unwrap();
                if let Some(r) = h.op_ref() {
                    refs.push(r);
                }
                hs.push(h);
            }
            let created = 600;
            assert_eq!(refs.len(), 600);
            flip.store(1, Ordering::SeqCst);
            let refs = Arc::new(refs);
            let stop = Arc::new(AtomicBool::new(false));
            let checks = Arc::new(AtomicUsize::new(0));
            let checkers: Vec<_> = (0..2)
                .map(|t| {
                    let (refs, stop, checks) = (refs.clone(), stop.clone(), checks.clone());
                    std::thread::spawn(move || {
                        let mut i = t;
                        while !stop.load(Ordering::SeqCst) {
                            refs[i % refs.len()].try_complete();
                            checks.fetch_add(1, Ordering::SeqCst);
                            i += 7;
                        }
                    })
                })
                .collect();
            // Drop it part-way, at a point that moves from round to round.
            wait_for(&checks, 50 + (round as usize) * 71 % 1500);
            drop(p);
            stop.store(true, Ordering::SeqCst);
            for c in checkers {
                c.join().unwrap();
            }
            rt.block_on(async {
                for h in hs {
                    let r = tokio::time::timeout(Duration::from_secs(5), h)
                        .await
                        .expect("resolves");
                    match val(r) {
                        Ok(_) | Err(OperationError::Shutdown) | Err(OperationError::Cancelled) => {}
                        other => panic!("{other:?}"),
                    }
                }
            });
            drop(refs);
            assert_eq!(drops.load(Ordering::SeqCst), created, "round {round}");
            rt.shutdown_timeout(Duration::from_secs(1));
        }
    })
}

// ---------------------------------------------------------------------------
// 15. A level key whose Eq panics part-way through a registration: the panic
//     reaches the caller, nothing is counted, entries made are tombstones
//     that later advances remove; a drain is not held.

#[derive(Clone)]
struct EqKey(u32, Arc<AtomicBool>);
impl PartialEq for EqKey {
    fn eq(&self, o: &Self) -> bool {
        if self.1.load(Ordering::SeqCst) || o.1.load(Ordering::SeqCst) {
            panic!("hostile eq");
        }
        self.0 == o.0
    }
}
impl Eq for EqKey {}
impl Hash for EqKey {
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.0.hash(h);
    }
}

#[tokio::test(start_paused = true)]
async fn a_level_keys_eq_panicking_mid_registration_changes_nothing() {
    let p: Purgatory<EqKey, L> = Purgatory::builder().max_pending(2).build().unwrap();
    let calm = Arc::new(AtomicBool::new(false));
    let angry = Arc::new(AtomicBool::new(false));
    // Key 2 is in the map already, so the registration compares with it.
    let there = p
        .try_complete_else_watch_levels(
            L::new(|l| l.filter(|l| *l >= 9)),
            ms(1000),
            [Watch::level(EqKey(2, calm.clone()), 1)],
        )
        .unwrap();
    let before = p.metrics();
    let drops = Arc::new(AtomicUsize::new(0));
    angry.store(true, Ordering::SeqCst);
    let r = catch_unwind(AssertUnwindSafe(|| {
        p.try_complete_else_watch_levels(
            L::never().drops(&drops),
            ms(1000),
            [
                Watch::level(EqKey(1, calm.clone()), 3),
                Watch::level(EqKey(1, calm.clone()), 4),
                Watch::level(EqKey(2, angry.clone()), 5),
            ],
        )
    }));
    assert!(r.is_err(), "the key's panic reaches the caller");
    angry.store(false, Ordering::SeqCst);
    assert_eq!(drops.load(Ordering::SeqCst), 1, "the operation dropped");
    let m = p.metrics();
    assert_eq!(
        (m.registered, m.delayed, m.cancelled, m.handed_back),
        (
            before.registered,
            before.delayed,
            before.cancelled,
            before.handed_back
        ),
        "{m:?}"
    );
    assert_eq!(m.watched - m.tombstones, 1, "{m:?}");
    // Room under the limit: two more fit.
    let a = p
        .try_complete_else_watch_levels(
            L::never(),
            ms(5),
            [Watch::level(EqKey(3, calm.clone()), 1)],
        )
        .unwrap();
    drop(a);
    // An advance of key 1 removes its tombstones, of key 2 completes `there`.
    assert_eq!(p.try_complete_reached(&EqKey(1, calm.clone()), 100), 0);
    assert_eq!(p.try_complete_reached(&EqKey(2, calm.clone()), 100), 1);
    assert_eq!(p.try_complete_reached(&EqKey(3, calm.clone()), 100), 0);
    assert_eq!(val(there.await), Ok(Completion::Completed(100)));
    let m = p.metrics();
    assert!(balanced(&m), "{m:?}");
    assert_eq!((m.delayed, m.watched, m.tombstones), (0, 0, 0), "{m:?}");
    tokio::time::timeout(ms(10), p.drain())
        .await
        .expect("drain ends");
}

// ---------------------------------------------------------------------------
// 16. One key watched plainly and at several levels by one operation.

/// An operation watching one key plainly and at two levels (one of them
/// `u64::MAX`) is handed back once by a cancel of that key, and nothing of it
/// is left behind.
#[tokio::test(start_paused = true)]
async fn cancel_for_key_hands_back_an_operation_watching_plainly_and_at_levels_once() {
    let p: P = Purgatory::new();
    let h = p
        .try_complete_else_watch_levels(
            L::never(),
            ms(1000),
            [
                Watch::key(1),
                Watch::level(1, 5),
                Watch::level(1, u64::MAX),
                Watch::key(1),
            ],
        )
        .unwrap();
    assert_eq!(p.watched(), 3);
    let back = p.cancel_for_key(&1);
    assert_eq!(back.len(), 1);
    drop(back);
    assert_eq!(val(h.await), Err(OperationError::Cancelled));
    let m = p.metrics();
    assert_eq!(
        (m.delayed, m.watched, m.tombstones, m.keys),
        (0, 0, 0, 0),
        "{m:?}"
    );
    assert!(balanced(&m), "{m:?}");
}

/// An advance past an operation watching one key plainly and at two levels
/// completes it once, every check it runs told the level reached.
#[tokio::test(start_paused = true)]
async fn an_advance_past_plain_and_level_watches_of_one_key_completes_once() {
    let p: P = Purgatory::new();
    let calls = Arc::new(Mutex::new(Vec::new()));
    let c = calls.clone();
    let h = p
        .try_complete_else_watch_levels(
            L::new(move |l| {
                c.lock().unwrap().push(l);
                (l == Some(10) && c.lock().unwrap().len() >= 4).then_some(1)
            }),
            ms(1000),
            [Watch::key(1), Watch::level(1, 5), Watch::level(1, 3)],
        )
        .unwrap();
    assert_eq!(p.try_complete_reached(&1, 10), 1);
    assert_eq!(val(h.await), Ok(Completion::Completed(1)));
    let got = calls.lock().unwrap().clone();
    assert_eq!(got[..2], [None, None], "the registration's checks");
    assert!(got[2..].iter().all(|l| *l == Some(10)), "{got:?}");
    settle().await;
    let m = p.metrics();
    assert_eq!((m.delayed, m.watched, m.tombstones), (0, 0, 0), "{m:?}");
}

// ---------------------------------------------------------------------------
// 17. Checks and drops run by an advance that call back into the same key.

/// A check that cancels its own key while an advance runs it is cancelled
/// once it says "not yet"; the rest of the advance's batch is handed back by
/// that cancel, and nothing is left behind once their timeouts pass.
#[tokio::test(start_paused = true)]
async fn a_check_cancelling_its_own_level_key_mid_advance() {
    let p: P = Purgatory::new();
    let slot: Slot<P> = Arc::default();
    slot.set(p.clone()).ok().unwrap();
    let handed = Arc::new(AtomicUsize::new(0));
    let (s, hd) = (slot.clone(), handed.clone());
    let first = p
        .try_complete_else_watch_levels(
            L::new(move |l| {
                if l.is_some() {
                    let back = s.get().unwrap().cancel_for_key(&1);
                    hd.fetch_add(back.len(), Ordering::SeqCst);
                }
                None
            }),
            ms(1000),
            [Watch::level(1, 1), Watch::key(2)],
        )
        .unwrap();
    let others: Vec<_> = (0..5)
        .map(|i| {
            p.try_complete_else_watch_levels(
                L::new(|l| l.filter(|_| false)),
                ms(1000),
                [Watch::level(1, 1 + i), Watch::key(3)],
            )
            .unwrap()
        })
        .collect();
    assert_eq!(p.try_complete_reached(&1, 100), 0);
    assert_eq!(handed.load(Ordering::SeqCst), 5);
    assert_eq!(val(first.await), Err(OperationError::Cancelled));
    for h in others {
        assert_eq!(val(h.await), Err(OperationError::Cancelled));
    }
    settle().await;
    let m = p.metrics();
    assert_eq!(m.delayed, 0, "{m:?}");
    assert!(balanced(&m), "{m:?}");
    tokio::time::advance(ms(2000)).await;
    settle().await;
    let m = p.metrics();
    assert_eq!((m.watched, m.tombstones, m.keys), (0, 0, 0), "{m:?}");
}

/// An operation registered from a check run by an advance, on the same key
/// at a level that advance already passed, is found by a later advance to
/// the same level once its check says yes.
#[tokio::test(start_paused = true)]
async fn a_registration_from_inside_an_advance_at_a_passed_level_is_found_later() {
    let p: P = Purgatory::new();
    let slot: Slot<P> = Arc::default();
    slot.set(p.clone()).ok().unwrap();
    let gate = Arc::new(AtomicBool::new(false));
    let inner: Arc<Mutex<Option<OperationHandle<u32, L>>>> = Arc::default();
    let (s, g, i) = (slot.clone(), gate.clone(), inner.clone());
    let mut once = true;
    let outer = p
        .try_complete_else_watch_levels(
            L::new(move |l| {
                if l.is_some() && once {
                    once = false;
                    let g = g.clone();
                    let h = s
                        .get()
                        .unwrap()
                        .try_complete_else_watch_levels(
                            L::new(move |_| g.load(Ordering::SeqCst).then_some(5)),
                            Duration::from_secs(10),
                            [Watch::level(1, 3)],
                        )
                        .unwrap();
                    *i.lock().unwrap() = Some(h);
                    return Some(1);
                }
                None
            }),
            ms(1000),
            [Watch::level(1, 2)],
        )
        .unwrap();
    assert_eq!(p.try_complete_reached(&1, 10), 1);
    assert_eq!(val(outer.await), Ok(Completion::Completed(1)));
    gate.store(true, Ordering::SeqCst);
    assert_eq!(
        p.try_complete_reached(&1, 10),
        1,
        "the inner one at level 3"
    );
    let h = inner.lock().unwrap().take().unwrap();
    assert_eq!(val(h.await), Ok(Completion::Completed(5)));
}

/// A check whose call completes another operation, whose drop advances the
/// first one's key further: the first is re-run once, told the higher level.
#[tokio::test(start_paused = true)]
async fn a_drop_caused_by_a_check_hands_its_level_to_the_rerun() {
    let p: P = Purgatory::new();
    let slot: Slot<P> = Arc::default();
    slot.set(p.clone()).ok().unwrap();
    let told = Arc::new(Mutex::new(Vec::new()));
    let (t, s) = (told.clone(), slot.clone());
    let a = p
        .try_complete_else_watch_levels(
            L::new(move |l| {
                t.lock().unwrap().push(l);
                if l == Some(10) {
                    // Completes `b`, whose drop advances key 1 to 20.
                    s.get().unwrap().try_complete_reached(&2, 1);
                }
                (l == Some(20)).then_some(20)
            }),
            ms(1000),
            [Watch::level(1, 5)],
        )
        .unwrap();
    let s = slot.clone();
    let b = p
        .try_complete_else_watch_levels(
            L::new(|l| l.map(|_| 2)).on_drop(move || {
                s.get().unwrap().try_complete_reached(&1, 20);
            }),
            ms(1000),
            [Watch::level(2, 1)],
        )
        .unwrap();
    assert_eq!(p.try_complete_reached(&1, 10), 1);
    assert_eq!(val(b.await), Ok(Completion::Completed(2)));
    assert_eq!(val(a.await), Ok(Completion::Completed(20)));
    assert_eq!(*told.lock().unwrap(), [None, None, Some(10), Some(20)]);
}

/// Outputs whose drop advances the same key further, cancels by another key
/// and then panics, completed by an advance on detached handles: the panics
/// are contained and counted, and nothing is left pending.
#[tokio::test(start_paused = true)]
async fn panicking_outputs_that_advance_their_key_again_are_contained() {
    let p: P = Purgatory::new();
    let slot: Slot<P> = Arc::default();
    slot.set(p.clone()).ok().unwrap();
    for i in 0..20 {
        let s = slot.clone();
        let hook: Hook = Arc::new(move || {
            let p = s.get().unwrap();
            p.try_complete_reached(&1, i + 100);
            let _ = p.cancel_for_key(&9);
            panic!("output drop");
        });
        p.try_complete_else_watch_levels(
            L::new(move |l| l.filter(|l| *l >= i)).out_drop(hook),
            ms(1000),
            [Watch::level(1, i), Watch::key(9)],
        )
        .unwrap()
        .detach();
    }
    let n = p.try_complete_reached(&1, 5);
    assert!(n >= 1, "{n}");
    settle().await;
    let m = p.metrics();
    assert_eq!(m.delayed, 0, "{m:?}");
    assert_eq!(m.completed + m.cancelled, 20, "{m:?}");
    assert!(m.panicked >= 1, "{m:?}");
    assert!(balanced(&m), "{m:?}");
}

// ---------------------------------------------------------------------------
// 18. Level watches of completed operations on a key never advanced.

/// Operations that complete through a plain key while their watch at a level
/// of another key is never reached leave a bounded number of entries behind.
#[tokio::test(start_paused = true)]
async fn level_tombstones_of_completed_operations_stay_bounded() {
    let p: P = Purgatory::new();
    let mut max_watched = 0;
    for i in 0..20_000u32 {
        let mut n = 0;
        let h = p
            .try_complete_else_watch_levels(
                L::new(move |_| {
                    n += 1;
                    (n > 2).then_some(0)
                }),
                Duration::from_secs(100),
                [Watch::key(i), Watch::level(1_000_000, 1 << 40)],
            )
            .unwrap();
        assert_eq!(p.try_complete_watched(&i), 1);
        drop(h);
        max_watched = max_watched.max(p.watched());
    }
    let m = p.metrics();
    assert!(max_watched < 5_000, "{max_watched} {m:?}");
}

// ---------------------------------------------------------------------------
// 19. An event raised while another thread's check runs, the check held
//     inside by channels: which events ask for a re-run.

/// An operation that completes once `flag` is set. Its registration's two
/// checks answer at once; the first check after them reads the flag, tells
/// `inside` it is under way and waits for `go` before answering what it read.
fn held_check(flag: Arc<AtomicBool>, inside: mpsc::Sender<()>, go: mpsc::Receiver<()>) -> L {
    let mut registration_checks = 0;
    let mut hold = Some((inside, go));
    L::new(move |l| {
        let ready = flag.load(Ordering::SeqCst);
        if l.is_none() && registration_checks < 2 {
            registration_checks += 1;
            return ready.then_some(1);
        }
        if let Some((inside, go)) = hold.take() {
            inside.send(()).unwrap();
            go.recv_timeout(Duration::from_secs(10)).unwrap();
        }
        ready.then_some(1)
    })
}

/// Runs the race: thread A walks (`walk_a`) and its check reads the flag as
/// unset and is held; meanwhile the flag is set and `event_b` raised; then
/// A's check answers "not yet". Returns whether the operation had finished
/// once A's call returned, after which `then` runs.
fn race_then(
    watch: Watch<u32>,
    walk_a: fn(&P) -> usize,
    event_b: fn(&P) -> usize,
    then: fn(&P, &OperationHandle<u32, L>),
) -> bool {
    within(30, move || {
        let rt = support::multi();
        let _e = rt.enter();
        let p: P = Purgatory::builder().build_on(rt.handle()).unwrap();
        let flag = Arc::new(AtomicBool::new(false));
        let (inside_tx, inside) = mpsc::channel();
        let (go, go_rx) = mpsc::channel();
        let h = p
            .try_complete_else_watch_levels(
                held_check(flag.clone(), inside_tx, go_rx),
                Duration::from_secs(3600),
                [watch],
            )
            .unwrap();
        let pa = p.clone();
        let a = std::thread::spawn(move || walk_a(&pa));
        inside.recv_timeout(Duration::from_secs(10)).unwrap();
        flag.store(true, Ordering::SeqCst);
        event_b(&p);
        go.send(()).unwrap();
        a.join().unwrap();
        let done = h.is_finished();
        then(&p, &h);
        drop(h);
        drop(p);
        drop(rt);
        done
    })
}

/// [`race_then`] with nothing after.
fn race(watch: Watch<u32>, walk_a: fn(&P) -> usize, event_b: fn(&P) -> usize) -> bool {
    race_then(watch, walk_a, event_b, |_, _| {})
}

/// A plain event on a key, raised while another thread's check of an
/// operation watching it plainly runs, makes that check run again.
#[test]
fn a_plain_event_during_a_check_reruns_it() {
    assert!(race(
        Watch::key(1),
        |p| p.try_complete_watched(&1),
        |p| p.try_complete_watched(&1)
    ));
}

/// An advance past the level of an operation's watch, raised while another
/// thread's check of it started by an advance to that level runs, makes that
/// check run again.
#[test]
fn a_higher_advance_during_a_check_reruns_it() {
    assert!(race(
        Watch::level(1, 10),
        |p| p.try_complete_reached(&1, 10),
        |p| p.try_complete_reached(&1, 11)
    ));
}

/// A plain walk of a key does not look at the watches at a level on it: one
/// raised while another thread's check started by an advance runs reaches
/// nothing and asks for no re-run.
#[test]
fn a_plain_walk_of_a_level_key_during_a_check_reaches_nothing() {
    assert!(!race(
        Watch::level(1, 10),
        |p| p.try_complete_reached(&1, 10),
        |p| p.try_complete_watched(&1)
    ));
}

/// An advance to the same level, raised while another thread's check
/// started by an advance to that level runs, does not reach the operation
/// (its watch moved up when the first advance took it out) and asks for no
/// re-run; the operation is not lost, as the next advance past the level
/// completes it.
#[test]
fn a_same_level_advance_during_a_check_asks_for_no_rerun() {
    let done = race_then(
        Watch::level(1, 10),
        |p| p.try_complete_reached(&1, 10),
        |p| p.try_complete_reached(&1, 10),
        |p, h| {
            assert_eq!(p.try_complete_reached(&1, 11), 1, "an advance past it");
            assert!(h.is_finished());
        },
    );
    assert!(!done, "the advance to the same level asked for no re-run");
}

/// An advance past an operation's level, raised while a check of it by
/// reference runs on another thread, makes that check run again.
#[test]
fn an_advance_during_a_check_by_reference_reruns_it() {
    within(30, || {
        let rt = support::multi();
        let _e = rt.enter();
        let p: P = Purgatory::builder().build_on(rt.handle()).unwrap();
        let flag = Arc::new(AtomicBool::new(false));
        let (inside_tx, inside) = mpsc::channel();
        let (go, go_rx) = mpsc::channel();
        let h = p
            .try_complete_else_watch_levels(
                held_check(flag.clone(), inside_tx, go_rx),
                Duration::from_secs(3600),
                [Watch::level(1, 5)],
            )
            .unwrap();
        let r = h.op_ref().unwrap();
        let a = std::thread::spawn(move || r.try_complete());
        inside.recv_timeout(Duration::from_secs(10)).unwrap();
        flag.store(true, Ordering::SeqCst);
        p.try_complete_reached(&1, 10);
        go.send(()).unwrap();
        a.join().unwrap();
        assert!(h.is_finished());
    });
}
