//! Events raised on the checking thread by user values the purgatory drops
//! or wakes on behalf of what a check did (the map's copy of a key its walk,
//! advance, cancellation by key or registration let go, an operation it
//! cancelled by dropping its handle, an output, a waker): the
//! check runs once more within the outside event, as "No missed events"
//! promises, instead of waiting for its timeout. Paused time, one thread.

mod support;

use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Wake, Waker};
use std::time::Duration;

use tokio_purgatory::{Completion, OpRef, Operation, Purgatory, WeakPurgatory};

use support::{balanced, ms};

type Hook = Arc<dyn Fn() + Send + Sync>;

struct K {
    id: u32,
    hook: Option<Hook>,
}
impl Clone for K {
    fn clone(&self) -> K {
        K {
            id: self.id,
            hook: self.hook.clone(),
        }
    }
}
impl PartialEq for K {
    fn eq(&self, o: &K) -> bool {
        self.id == o.id
    }
}
impl Eq for K {}
impl Hash for K {
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.id.hash(h)
    }
}
impl Drop for K {
    fn drop(&mut self) {
        if let Some(h) = self.hook.take() {
            h();
        }
    }
}
fn k(id: u32) -> K {
    K { id, hook: None }
}

struct Out(Option<Hook>);
impl Drop for Out {
    fn drop(&mut self) {
        if let Some(h) = self.0.take() {
            h();
        }
    }
}
impl std::fmt::Debug for Out {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Out")
    }
}

type Body = Box<dyn FnMut() -> Option<Out> + Send>;
struct Op {
    body: Body,
    checks: Arc<AtomicUsize>,
}
impl Operation for Op {
    type Output = Out;
    fn try_complete(&mut self) -> Option<Out> {
        self.checks.fetch_add(1, Ordering::SeqCst);
        (self.body)()
    }
    fn on_expiration(self) -> Out {
        Out(None)
    }
}

type P = Purgatory<K, Op>;

/// A's check reads its flag, then walks key 9 (B's only key). B completes;
/// key 9's list empties and the map drops its copy of the key; that drop
/// sets A's flag and walks key 1 (A's key). The event came from code A's
/// walk caused, after A read its state: A must check once more before the
/// outer walk returns, not sit until its timeout.
#[test]
fn a_key_dropped_by_the_checks_own_walk_raises_an_event() {
    support::paused_within(10, || async {
        let p: P = Purgatory::new();
        let weak: Arc<OnceLock<WeakPurgatory<K, Op>>> = Arc::default();
        weak.set(p.downgrade()).ok().unwrap();
        let ready_a = Arc::new(AtomicBool::new(false));
        let go = Arc::new(AtomicBool::new(false));
        let armed = Arc::new(AtomicBool::new(false));
        let hook: Hook = {
            let (w, r, armed) = (weak.clone(), ready_a.clone(), armed.clone());
            Arc::new(move || {
                if armed.swap(false, Ordering::SeqCst) {
                    r.store(true, Ordering::SeqCst);
                    w.get()
                        .unwrap()
                        .upgrade()
                        .unwrap()
                        .try_complete_watched(&k(1));
                }
            })
        };
        let b = Op {
            body: Box::new(|| Some(Out(None))),
            checks: Arc::default(),
        };
        // B's first check would complete it: make it wait for `go`.
        let go_b = go.clone();
        let b = Op {
            body: Box::new(move || go_b.load(Ordering::SeqCst).then(|| Out(None))),
            checks: b.checks,
        };
        let hb = p
            .try_complete_else_watch(
                b,
                Duration::from_secs(100),
                [K {
                    id: 9,
                    hook: Some(hook.clone()),
                }],
            )
            .unwrap();
        let a_checks = Arc::new(AtomicUsize::new(0));
        let (w2, r2, g2) = (weak.clone(), ready_a.clone(), go.clone());
        let a = Op {
            body: Box::new(move || {
                let ready = r2.load(Ordering::SeqCst);
                if g2.load(Ordering::SeqCst) && !ready {
                    w2.get()
                        .unwrap()
                        .upgrade()
                        .unwrap()
                        .try_complete_watched(&k(9));
                }
                ready.then(|| Out(None))
            }),
            checks: a_checks.clone(),
        };
        let ha = p
            .try_complete_else_watch(a, Duration::from_secs(100), [k(1)])
            .unwrap();
        armed.store(true, Ordering::SeqCst);
        go.store(true, Ordering::SeqCst);
        let done = p.try_complete_watched(&k(1));
        assert!(hb.is_finished(), "B completed");
        assert!(!armed.load(Ordering::SeqCst), "the key's drop ran");
        assert!(ready_a.load(Ordering::SeqCst));
        let finished_at_once = ha.is_finished();
        let checks = a_checks.load(Ordering::SeqCst);
        let start = tokio::time::Instant::now();
        let out = ha.await;
        assert!(
            finished_at_once && matches!(out, Ok(Completion::Completed(_))),
            "A missed the event its own walk's key drop raised: walk returned {done}, \
             A checked {checks} times, finished at once: {finished_at_once}; \
             it ended {out:?} after {:?} more",
            start.elapsed()
        );
        let m = p.metrics();
        assert!(balanced(&m), "{m:?}");
    });
}

/// The same with the map's key copy dropped by cancel_for_key called from
/// A's check (not a walk): reported separately.
#[test]
fn a_key_dropped_by_a_cancel_for_key_in_the_check_raises_an_event() {
    support::paused_within(10, || async {
        let p: P = Purgatory::new();
        let weak: Arc<OnceLock<WeakPurgatory<K, Op>>> = Arc::default();
        weak.set(p.downgrade()).ok().unwrap();
        let ready_a = Arc::new(AtomicBool::new(false));
        let go = Arc::new(AtomicBool::new(false));
        let armed = Arc::new(AtomicBool::new(false));
        let hook: Hook = {
            let (w, r, armed) = (weak.clone(), ready_a.clone(), armed.clone());
            Arc::new(move || {
                if armed.swap(false, Ordering::SeqCst) {
                    r.store(true, Ordering::SeqCst);
                    w.get()
                        .unwrap()
                        .upgrade()
                        .unwrap()
                        .try_complete_watched(&k(1));
                }
            })
        };
        let hb = p
            .try_complete_else_watch(
                Op {
                    body: Box::new(|| None),
                    checks: Arc::default(),
                },
                Duration::from_secs(100),
                [K {
                    id: 9,
                    hook: Some(hook.clone()),
                }],
            )
            .unwrap();
        let a_checks = Arc::new(AtomicUsize::new(0));
        let (w2, r2, g2) = (weak.clone(), ready_a.clone(), go.clone());
        let a = Op {
            body: Box::new(move || {
                let ready = r2.load(Ordering::SeqCst);
                if g2.load(Ordering::SeqCst) && !ready {
                    drop(w2.get().unwrap().upgrade().unwrap().cancel_for_key(&k(9)));
                }
                ready.then(|| Out(None))
            }),
            checks: a_checks.clone(),
        };
        let ha = p
            .try_complete_else_watch(a, Duration::from_secs(100), [k(1)])
            .unwrap();
        armed.store(true, Ordering::SeqCst);
        go.store(true, Ordering::SeqCst);
        p.try_complete_watched(&k(1));
        assert!(hb.is_finished());
        assert!(!armed.load(Ordering::SeqCst), "the key's drop ran");
        assert!(
            ha.is_finished(),
            "A missed the event raised by a key drop its cancel_for_key caused; checks {}",
            a_checks.load(Ordering::SeqCst)
        );
    });
}

/// A's check completes B by reference; B's handle is detached, so B's output
/// is dropped at once; that drop sets A's flag and walks A's key. A must run
/// once more.
#[test]
fn an_output_dropped_by_a_check_by_reference_raises_an_event() {
    support::paused_within(10, || async {
        let p: P = Purgatory::new();
        let weak: Arc<OnceLock<WeakPurgatory<K, Op>>> = Arc::default();
        weak.set(p.downgrade()).ok().unwrap();
        let ready_a = Arc::new(AtomicBool::new(false));
        let go = Arc::new(AtomicBool::new(false));
        let (w1, r1, g1) = (weak.clone(), ready_a.clone(), go.clone());
        let b = Op {
            body: Box::new(move || {
                if !g1.load(Ordering::SeqCst) {
                    return None;
                }
                let (w, r) = (w1.clone(), r1.clone());
                Some(Out(Some(Arc::new(move || {
                    r.store(true, Ordering::SeqCst);
                    w.get()
                        .unwrap()
                        .upgrade()
                        .unwrap()
                        .try_complete_watched(&k(1));
                }))))
            }),
            checks: Arc::default(),
        };
        let hb = p
            .try_complete_else_watch(b, Duration::from_secs(100), [k(9)])
            .unwrap();
        let b_ref = hb.op_ref().unwrap();
        hb.detach();
        let a_checks = Arc::new(AtomicUsize::new(0));
        let (r2, g2) = (ready_a.clone(), go.clone());
        let a = Op {
            body: Box::new(move || {
                let ready = r2.load(Ordering::SeqCst);
                if g2.load(Ordering::SeqCst) && !ready {
                    b_ref.try_complete();
                }
                ready.then(|| Out(None))
            }),
            checks: a_checks.clone(),
        };
        let ha = p
            .try_complete_else_watch(a, Duration::from_secs(100), [k(1)])
            .unwrap();
        go.store(true, Ordering::SeqCst);
        p.try_complete_watched(&k(1));
        assert!(ready_a.load(Ordering::SeqCst));
        assert!(
            ha.is_finished(),
            "A missed the event its nested by-reference check's output drop raised; checks {}",
            a_checks.load(Ordering::SeqCst)
        );
    });
}

struct HookWake(Hook);
impl Wake for HookWake {
    fn wake(self: Arc<Self>) {
        (self.0)();
    }
}

/// A's check walks B's key; B completes and its handle's waker (user code)
/// sets A's flag and walks A's key. A must run once more.
#[test]
fn a_handle_waker_woken_by_the_checks_walk_raises_an_event() {
    support::paused_within(10, || async {
        let p: P = Purgatory::new();
        let weak: Arc<OnceLock<WeakPurgatory<K, Op>>> = Arc::default();
        weak.set(p.downgrade()).ok().unwrap();
        let ready_a = Arc::new(AtomicBool::new(false));
        let go = Arc::new(AtomicBool::new(false));
        let g1 = go.clone();
        let b = Op {
            body: Box::new(move || g1.load(Ordering::SeqCst).then(|| Out(None))),
            checks: Arc::default(),
        };
        let mut hb = p
            .try_complete_else_watch(b, Duration::from_secs(100), [k(9)])
            .unwrap();
        let waker = {
            let (w, r) = (weak.clone(), ready_a.clone());
            Waker::from(Arc::new(HookWake(Arc::new(move || {
                r.store(true, Ordering::SeqCst);
                w.get()
                    .unwrap()
                    .upgrade()
                    .unwrap()
                    .try_complete_watched(&k(1));
            }))))
        };
        assert!(std::pin::Pin::new(&mut hb)
            .poll(&mut Context::from_waker(&waker))
            .is_pending());
        let a_checks = Arc::new(AtomicUsize::new(0));
        let (w2, r2, g2) = (weak.clone(), ready_a.clone(), go.clone());
        let a = Op {
            body: Box::new(move || {
                let ready = r2.load(Ordering::SeqCst);
                if g2.load(Ordering::SeqCst) && !ready {
                    w2.get()
                        .unwrap()
                        .upgrade()
                        .unwrap()
                        .try_complete_watched(&k(9));
                }
                ready.then(|| Out(None))
            }),
            checks: a_checks.clone(),
        };
        let ha = p
            .try_complete_else_watch(a, Duration::from_secs(100), [k(1)])
            .unwrap();
        go.store(true, Ordering::SeqCst);
        p.try_complete_watched(&k(1));
        assert!(ready_a.load(Ordering::SeqCst));
        assert!(
            ha.is_finished(),
            "A missed the event raised by a waker its walk woke; checks {}",
            a_checks.load(Ordering::SeqCst)
        );
        assert!(hb.await.is_ok());
        let _ = (ms(1), Completion::<u8>::Expired(0), Mutex::new(()));
        let _: Option<OpRef<K, Op>> = None;
    });
}

use std::future::Future;

struct DropHook(Option<Hook>);
impl Drop for DropHook {
    fn drop(&mut self) {
        if let Some(h) = self.0.take() {
            h();
        }
    }
}

/// Control for the first test: the same event raised by B's operation
/// Drop (which the crate runs when A's walk completes B) is seen: A runs
/// once more and completes within the outer walk.
#[test]
fn control_an_operation_dropped_by_the_checks_own_walk_raises_an_event() {
    support::paused_within(10, || async {
        let p: P = Purgatory::new();
        let weak: Arc<OnceLock<WeakPurgatory<K, Op>>> = Arc::default();
        weak.set(p.downgrade()).ok().unwrap();
        let ready_a = Arc::new(AtomicBool::new(false));
        let go = Arc::new(AtomicBool::new(false));
        let g1 = go.clone();
        let guard = {
            let (w, r) = (weak.clone(), ready_a.clone());
            DropHook(Some(Arc::new(move || {
                r.store(true, Ordering::SeqCst);
                w.get()
                    .unwrap()
                    .upgrade()
                    .unwrap()
                    .try_complete_watched(&k(1));
            })))
        };
        let b = Op {
            body: Box::new(move || {
                let _ = &guard;
                g1.load(Ordering::SeqCst).then(|| Out(None))
            }),
            checks: Arc::default(),
        };
        let hb = p
            .try_complete_else_watch(b, Duration::from_secs(100), [k(9)])
            .unwrap();
        let (w2, r2, g2) = (weak.clone(), ready_a.clone(), go.clone());
        let a = Op {
            body: Box::new(move || {
                let ready = r2.load(Ordering::SeqCst);
                if g2.load(Ordering::SeqCst) && !ready {
                    w2.get()
                        .unwrap()
                        .upgrade()
                        .unwrap()
                        .try_complete_watched(&k(9));
                }
                ready.then(|| Out(None))
            }),
            checks: Arc::default(),
        };
        let ha = p
            .try_complete_else_watch(a, Duration::from_secs(100), [k(1)])
            .unwrap();
        go.store(true, Ordering::SeqCst);
        p.try_complete_watched(&k(1));
        assert!(hb.is_finished());
        assert!(ready_a.load(Ordering::SeqCst));
        assert!(
            ha.is_finished(),
            "A re-runs after an operation drop's event"
        );
    });
}

/// A's check registers C; the key A handed to that registration is dropped
/// by it (the map keeps its own clone), and that drop sets A's flag and
/// walks A's key.
#[test]
fn a_key_dropped_by_a_registration_in_the_check_raises_an_event() {
    support::paused_within(10, || async {
        let p: P = Purgatory::new();
        let weak: Arc<OnceLock<WeakPurgatory<K, Op>>> = Arc::default();
        weak.set(p.downgrade()).ok().unwrap();
        let ready_a = Arc::new(AtomicBool::new(false));
        let go = Arc::new(AtomicBool::new(false));
        let hook: Hook = {
            let (w, r) = (weak.clone(), ready_a.clone());
            Arc::new(move || {
                r.store(true, Ordering::SeqCst);
                w.get()
                    .unwrap()
                    .upgrade()
                    .unwrap()
                    .try_complete_watched(&k(1));
            })
        };
        let kept: Arc<Mutex<Vec<tokio_purgatory::OperationHandle<K, Op>>>> = Arc::default();
        let (w2, r2, g2, kp) = (weak.clone(), ready_a.clone(), go.clone(), kept.clone());
        let a = Op {
            body: Box::new(move || {
                let ready = r2.load(Ordering::SeqCst);
                if g2.swap(false, Ordering::SeqCst) && !ready {
                    // The map keeps a clone without the hook? No: clones carry
                    // it too; only the one dropped first matters here.
                    let key = K {
                        id: 9,
                        hook: Some(hook.clone()),
                    };
                    let c = Op {
                        body: Box::new(|| None),
                        checks: Arc::default(),
                    };
                    let h = w2
                        .get()
                        .unwrap()
                        .upgrade()
                        .unwrap()
                        .try_complete_else_watch(c, Duration::from_secs(100), [key])
                        .map_err(|_| ())
                        .unwrap();
                    kp.lock().unwrap().push(h);
                }
                ready.then(|| Out(None))
            }),
            checks: Arc::default(),
        };
        let ha = p
            .try_complete_else_watch(a, Duration::from_secs(100), [k(1)])
            .unwrap();
        go.store(true, Ordering::SeqCst);
        p.try_complete_watched(&k(1));
        assert!(ready_a.load(Ordering::SeqCst), "the key was dropped");
        assert!(
            ha.is_finished(),
            "A missed the event raised by the drop of a key its registration dropped"
        );
        drop(p.shutdown());
    });
}

/// The level form of the first test: A's check advances key 9 (B waits on
/// it at a level); B completes, key 9's list empties and the map drops its
/// key, whose Drop readies A and advances A's key past the level A is being
/// checked for (an advance to that same level again reaches nothing new:
/// A's watch already waits for the next one).
#[test]
fn a_key_dropped_by_the_checks_own_advance_raises_an_event() {
    support::paused_within(10, || async {
        let p: P = Purgatory::new();
        let weak: Arc<OnceLock<WeakPurgatory<K, Op>>> = Arc::default();
        weak.set(p.downgrade()).ok().unwrap();
        let ready_a = Arc::new(AtomicBool::new(false));
        let go = Arc::new(AtomicBool::new(false));
        let armed = Arc::new(AtomicBool::new(false));
        let hook: Hook = {
            let (w, r, armed) = (weak.clone(), ready_a.clone(), armed.clone());
            Arc::new(move || {
                if armed.swap(false, Ordering::SeqCst) {
                    r.store(true, Ordering::SeqCst);
                    w.get()
                        .unwrap()
                        .upgrade()
                        .unwrap()
                        .try_complete_reached(&k(1), 6);
                }
            })
        };
        let b = Op {
            body: Box::new(|| Some(Out(None))),
            checks: Arc::default(),
        };
        let g1 = go.clone();
        let b = Op {
            body: Box::new(move || g1.load(Ordering::SeqCst).then(|| Out(None))),
            checks: b.checks,
        };
        let hb = p
            .try_complete_else_watch_levels(
                b,
                Duration::from_secs(100),
                [tokio_purgatory::Watch::level(
                    K {
                        id: 9,
                        hook: Some(hook.clone()),
                    },
                    3,
                )],
            )
            .unwrap();
        let (w2, r2, g2) = (weak.clone(), ready_a.clone(), go.clone());
        let a = Op {
            body: Box::new(move || {
                let ready = r2.load(Ordering::SeqCst);
                if g2.load(Ordering::SeqCst) && !ready {
                    w2.get()
                        .unwrap()
                        .upgrade()
                        .unwrap()
                        .try_complete_reached(&k(9), 3);
                }
                ready.then(|| Out(None))
            }),
            checks: Arc::default(),
        };
        let ha = p
            .try_complete_else_watch_levels(
                a,
                Duration::from_secs(100),
                [tokio_purgatory::Watch::level(k(1), 5)],
            )
            .unwrap();
        armed.store(true, Ordering::SeqCst);
        go.store(true, Ordering::SeqCst);
        p.try_complete_reached(&k(1), 5);
        assert!(hb.is_finished(), "B completed");
        assert!(ready_a.load(Ordering::SeqCst), "the key's drop ran");
        assert!(
            ha.is_finished(),
            "A missed the event raised by the key drop of its own advance"
        );
    });
}

/// The operation holding the last purgatory clone is cancelled by its
/// handle's drop: the purgatory closes inside that drop; the other pending
/// operation resolves Shutdown, each operation is dropped once.
#[test]
fn the_last_clone_goes_with_an_operation_its_handle_drop_cancelled() {
    support::paused_within(10, || async {
        struct Holder {
            _p: Option<P>,
            drops: Arc<AtomicUsize>,
        }
        impl Drop for Holder {
            fn drop(&mut self) {
                self.drops.fetch_add(1, Ordering::SeqCst);
            }
        }
        let p: P = Purgatory::new();
        let weak = p.downgrade();
        let drops = Arc::new(AtomicUsize::new(0));
        let holder = Arc::new(Mutex::new(Some(Holder {
            _p: None,
            drops: drops.clone(),
        })));
        let h2 = holder.clone();
        let a = Op {
            body: Box::new(move || {
                let _ = &h2;
                None
            }),
            checks: Arc::default(),
        };
        let b_drops = Arc::new(AtomicUsize::new(0));
        struct Counted(Arc<AtomicUsize>);
        impl Drop for Counted {
            fn drop(&mut self) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let bc = Counted(b_drops.clone());
        let b = Op {
            body: Box::new(move || {
                let _ = &bc;
                None
            }),
            checks: Arc::default(),
        };
        let ha = p
            .try_complete_else_watch(a, Duration::from_secs(100), [k(1)])
            .unwrap();
        let hb = p
            .try_complete_else_watch(b, Duration::from_secs(100), [k(2)])
            .unwrap();
        holder.lock().unwrap().as_mut().unwrap()._p = Some(p);
        drop(holder); // A's closure now holds the only Arc to the holder
        drop(ha); // cancels A: its drop drops the last clone
        assert!(weak.upgrade().is_none());
        assert_eq!(drops.load(Ordering::SeqCst), 1);
        let r = tokio::time::timeout(ms(1), hb).await.expect("resolved");
        assert_eq!(r.unwrap_err(), tokio_purgatory::OperationError::Shutdown);
        assert_eq!(b_drops.load(Ordering::SeqCst), 1);
        let _ = balanced;
    });
}

/// Operations a check cancels: the operation's own `Drop` and its handle's
/// waker, run for a cancel that check made, raise events on it.
mod cancels {
    use std::future::Future;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex, OnceLock};
    use std::task::{Context, Wake, Waker};
    use std::time::Duration;

    use tokio_purgatory::{Operation, OperationHandle, Purgatory, WeakPurgatory};

    type Hook = Arc<dyn Fn() + Send + Sync>;
    #[derive(Clone, PartialEq, Eq, Hash, Debug)]
    struct K(u32);

    struct Op {
        body: Box<dyn FnMut() -> Option<()> + Send>,
        on_drop: Option<Hook>,
        checks: Arc<AtomicUsize>,
    }
    impl Drop for Op {
        fn drop(&mut self) {
            if let Some(h) = self.on_drop.take() {
                h()
            }
        }
    }
    impl Operation for Op {
        type Output = ();
        fn try_complete(&mut self) -> Option<()> {
            self.checks.fetch_add(1, Ordering::SeqCst);
            (self.body)()
        }
        fn on_expiration(mut self) {
            self.on_drop = None;
        }
    }
    type P = Purgatory<K, Op>;

    fn rt() -> tokio::runtime::Runtime {
        super::support::paused()
    }

    /// A's check drops B's pending handle: the purgatory cancels B and drops
    /// B's operation, whose `Drop` readies A and walks A's key: A checks once
    /// more within the outside walk.
    #[test]
    fn an_operation_whose_handle_the_check_dropped_raises_an_event() {
        rt().block_on(async {
            let p: P = Purgatory::new();
            let weak: Arc<OnceLock<WeakPurgatory<K, Op>>> = Arc::default();
            weak.set(p.downgrade()).ok().unwrap();
            let ready_a = Arc::new(AtomicBool::new(false));
            let hook: Hook = {
                let (w, r) = (weak.clone(), ready_a.clone());
                Arc::new(move || {
                    r.store(true, Ordering::SeqCst);
                    w.get()
                        .unwrap()
                        .upgrade()
                        .unwrap()
                        .try_complete_watched(&K(1));
                })
            };
            let hb = p
                .try_complete_else_watch(
                    Op {
                        body: Box::new(|| None),
                        on_drop: Some(hook),
                        checks: Arc::default(),
                    },
                    Duration::from_secs(100),
                    [K(9)],
                )
                .unwrap();
            let slot: Arc<Mutex<Option<OperationHandle<K, Op>>>> = Arc::new(Mutex::new(Some(hb)));
            let go = Arc::new(AtomicBool::new(false));
            let (s2, r2, g2) = (slot.clone(), ready_a.clone(), go.clone());
            let a_checks = Arc::new(AtomicUsize::new(0));
            let ha = p
                .try_complete_else_watch(
                    Op {
                        body: Box::new(move || {
                            let ready = r2.load(Ordering::SeqCst);
                            if g2.load(Ordering::SeqCst) && !ready {
                                let h = s2.lock().unwrap().take();
                                drop(h);
                            }
                            ready.then_some(())
                        }),
                        on_drop: None,
                        checks: a_checks.clone(),
                    },
                    Duration::from_secs(100),
                    [K(1)],
                )
                .unwrap();
            go.store(true, Ordering::SeqCst);
            p.try_complete_watched(&K(1));
            assert!(ready_a.load(Ordering::SeqCst), "B's drop ran");
            assert!(
                ha.is_finished(),
                "A missed the event raised by B's drop (handle drop in A's check); checks {}",
                a_checks.load(Ordering::SeqCst)
            );
        });
    }

    struct HookWake(Hook);
    impl Wake for HookWake {
        fn wake(self: Arc<Self>) {
            (self.0)();
        }
    }

    /// A's check cancels B by key; B's handle's waker readies A and walks
    /// A's key: A checks once more within the outside walk.
    #[test]
    fn a_waker_woken_by_a_cancel_for_key_in_the_check_raises_an_event() {
        rt().block_on(async {
            let p: P = Purgatory::new();
            let weak: Arc<OnceLock<WeakPurgatory<K, Op>>> = Arc::default();
            weak.set(p.downgrade()).ok().unwrap();
            let ready_a = Arc::new(AtomicBool::new(false));
            let hook: Hook = {
                let (w, r) = (weak.clone(), ready_a.clone());
                Arc::new(move || {
                    r.store(true, Ordering::SeqCst);
                    w.get()
                        .unwrap()
                        .upgrade()
                        .unwrap()
                        .try_complete_watched(&K(1));
                })
            };
            let mut hb = p
                .try_complete_else_watch(
                    Op {
                        body: Box::new(|| None),
                        on_drop: None,
                        checks: Arc::default(),
                    },
                    Duration::from_secs(100),
                    [K(9)],
                )
                .unwrap();
            let waker = Waker::from(Arc::new(HookWake(hook)));
            assert!(std::pin::Pin::new(&mut hb)
                .poll(&mut Context::from_waker(&waker))
                .is_pending());
            let go = Arc::new(AtomicBool::new(false));
            let (w2, r2, g2) = (weak.clone(), ready_a.clone(), go.clone());
            let a_checks = Arc::new(AtomicUsize::new(0));
            let ha = p
                .try_complete_else_watch(
                    Op {
                        body: Box::new(move || {
                            let ready = r2.load(Ordering::SeqCst);
                            if g2.load(Ordering::SeqCst) && !ready {
                                drop(w2.get().unwrap().upgrade().unwrap().cancel_for_key(&K(9)));
                            }
                            ready.then_some(())
                        }),
                        on_drop: None,
                        checks: a_checks.clone(),
                    },
                    Duration::from_secs(100),
                    [K(1)],
                )
                .unwrap();
            go.store(true, Ordering::SeqCst);
            p.try_complete_watched(&K(1));
            assert!(ready_a.load(Ordering::SeqCst), "B's waker ran");
            assert!(
                ha.is_finished(),
                "A missed the event raised by B's waker (cancel_for_key in A's check); checks {}",
                a_checks.load(Ordering::SeqCst)
            );
        });
    }
}

/// Key code (`Hash`) a check's own walk, registration or cancellation by key
/// runs: an event it raises on the checking operation reaches it.
mod key_code {
    use std::hash::{Hash, Hasher};
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::{Arc, OnceLock};
    use std::time::Duration;

    use tokio_purgatory::{Operation, Purgatory, WeakPurgatory};

    type Hook = Arc<dyn Fn() + Send + Sync>;

    /// Equal by `id`; hashing one with a hook runs the hook.
    #[derive(Clone)]
    struct K {
        id: u32,
        hook: Option<Hook>,
    }
    impl PartialEq for K {
        fn eq(&self, o: &K) -> bool {
            self.id == o.id
        }
    }
    impl Eq for K {}
    impl Hash for K {
        fn hash<H: Hasher>(&self, h: &mut H) {
            if let Some(hook) = &self.hook {
                hook();
            }
            self.id.hash(h)
        }
    }
    fn k(id: u32) -> K {
        K { id, hook: None }
    }

    struct Op {
        body: Box<dyn FnMut() -> Option<()> + Send>,
        checks: Arc<AtomicUsize>,
    }
    impl Operation for Op {
        type Output = ();
        fn try_complete(&mut self) -> Option<()> {
            self.checks.fetch_add(1, Ordering::SeqCst);
            (self.body)()
        }
        fn on_expiration(self) {}
    }
    type P = Purgatory<K, Op>;

    #[derive(Clone, Copy, Debug)]
    enum Call {
        Walk,
        Register,
        CancelForKey,
    }

    /// A watches key 1; its check calls `call` with key 9, whose `Hash`
    /// readies A and walks key 1 (once).
    fn scenario(call: Call) {
        super::support::paused().block_on(async {
            let p: P = Purgatory::new();
            let weak: Arc<OnceLock<WeakPurgatory<K, Op>>> = Arc::default();
            weak.set(p.downgrade()).ok().unwrap();
            let ready = Arc::new(AtomicBool::new(false));
            let armed = Arc::new(AtomicBool::new(false));
            let hook: Hook = {
                let (w, r, armed) = (weak.clone(), ready.clone(), armed.clone());
                Arc::new(move || {
                    if armed.swap(false, Ordering::SeqCst) {
                        r.store(true, Ordering::SeqCst);
                        w.get()
                            .unwrap()
                            .upgrade()
                            .unwrap()
                            .try_complete_watched(&k(1));
                    }
                })
            };
            let checks = Arc::new(AtomicUsize::new(0));
            let (w2, r2, a2) = (weak.clone(), ready.clone(), armed.clone());
            let body = move || {
                let is_ready = r2.load(Ordering::SeqCst);
                if !is_ready && a2.load(Ordering::SeqCst) {
                    let p = w2.get().unwrap().upgrade().unwrap();
                    let nine = K {
                        id: 9,
                        hook: Some(hook.clone()),
                    };
                    match call {
                        Call::Walk => drop(p.try_complete_watched(&nine)),
                        Call::Register => {
                            let inner = Op {
                                body: Box::new(|| None),
                                checks: Arc::default(),
                            };
                            drop(p.try_complete_else_watch(inner, Duration::from_secs(1), [nine]));
                        }
                        Call::CancelForKey => drop(p.cancel_for_key(&nine)),
                    }
                }
                is_ready.then_some(())
            };
            let a = Op {
                body: Box::new(body),
                checks: checks.clone(),
            };
            let ha = p
                .try_complete_else_watch(a, Duration::from_secs(100), [k(1)])
                .unwrap();
            armed.store(true, Ordering::SeqCst);
            p.try_complete_watched(&k(1));
            assert!(ready.load(Ordering::SeqCst), "{call:?}: the hook ran");
            assert!(
                ha.is_finished(),
                "{call:?}: A missed the event its key code raised; checks {}",
                checks.load(Ordering::SeqCst)
            );
        });
    }

    #[test]
    fn key_code_of_a_walk_in_the_check_raises_an_event() {
        scenario(Call::Walk);
    }

    #[test]
    fn key_code_of_a_registration_in_the_check_raises_an_event() {
        scenario(Call::Register);
    }

    #[test]
    fn key_code_of_a_cancel_for_key_in_the_check_raises_an_event() {
        scenario(Call::CancelForKey);
    }
}

/// Further user code run for a call a check made: a key's `Eq` in the
/// prune after its walk, an output stored in a handle the check dropped, an
/// operation its registration's first check completed; and the check's own
/// walk from its own key iterator, which is the check's doing (no re-run).
mod more {
    use std::hash::{Hash, Hasher};
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex, OnceLock};
    use std::time::Duration;

    use tokio_purgatory::{Operation, OperationHandle, Purgatory, WeakPurgatory};

    type Hook = Arc<dyn Fn() + Send + Sync>;

    #[derive(Clone)]
    struct K {
        id: u32,
        eq_hook: Option<Hook>,
    }
    impl PartialEq for K {
        fn eq(&self, o: &K) -> bool {
            if let Some(h) = o.eq_hook.as_ref().or(self.eq_hook.as_ref()) {
                h();
            }
            self.id == o.id
        }
    }
    impl Eq for K {}
    impl Hash for K {
        fn hash<H: Hasher>(&self, h: &mut H) {
            self.id.hash(h)
        }
    }
    fn k(id: u32) -> K {
        K { id, eq_hook: None }
    }

    struct Out(Option<Hook>);
    impl Drop for Out {
        fn drop(&mut self) {
            if let Some(h) = self.0.take() {
                h();
            }
        }
    }
    impl std::fmt::Debug for Out {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("Out")
        }
    }

    struct Op {
        body: Box<dyn FnMut() -> Option<Out> + Send>,
        checks: Arc<AtomicUsize>,
    }
    impl Operation for Op {
        type Output = Out;
        fn try_complete(&mut self) -> Option<Out> {
            self.checks.fetch_add(1, Ordering::SeqCst);
            (self.body)()
        }
        fn on_expiration(self) -> Out {
            Out(None)
        }
    }
    type P = Purgatory<K, Op>;

    fn walk_k1(w: &Arc<OnceLock<WeakPurgatory<K, Op>>>) {
        w.get()
            .unwrap()
            .upgrade()
            .unwrap()
            .try_complete_watched(&k(1));
    }

    /// A's check walks key 9; B (on 9) completes, so the walk prunes key 9's
    /// list, running key 9's `Eq` again: that `Eq` readies A and walks key 1.
    #[test]
    fn eq_in_the_walks_prune_raises_an_event() {
        super::support::paused().block_on(async {
            let p: P = Purgatory::new();
            let weak: Arc<OnceLock<WeakPurgatory<K, Op>>> = Arc::default();
            weak.set(p.downgrade()).ok().unwrap();
            let ready_a = Arc::new(AtomicBool::new(false));
            let b_go = Arc::new(AtomicBool::new(false));
            let b_done = Arc::new(AtomicBool::new(false));
            let fired = Arc::new(AtomicBool::new(false));
            let (g, d) = (b_go.clone(), b_done.clone());
            let _hb = p
                .try_complete_else_watch(
                    Op {
                        body: Box::new(move || {
                            if g.load(Ordering::SeqCst) {
                                d.store(true, Ordering::SeqCst);
                                Some(Out(None))
                            } else {
                                None
                            }
                        }),
                        checks: Arc::default(),
                    },
                    Duration::from_secs(100),
                    [k(9)],
                )
                .unwrap();
            let hook: Hook = {
                let (w, r, d, f) = (weak.clone(), ready_a.clone(), b_done.clone(), fired.clone());
                Arc::new(move || {
                    if d.load(Ordering::SeqCst) && !f.swap(true, Ordering::SeqCst) {
                        r.store(true, Ordering::SeqCst);
                        walk_k1(&w);
                    }
                })
            };
            let armed = Arc::new(AtomicBool::new(false));
            let a_checks = Arc::new(AtomicUsize::new(0));
            let (w2, r2, a2, g2) = (weak.clone(), ready_a.clone(), armed.clone(), b_go.clone());
            let ha = p
                .try_complete_else_watch(
                    Op {
                        body: Box::new(move || {
                            let ready = r2.load(Ordering::SeqCst);
                            if !ready && a2.swap(false, Ordering::SeqCst) {
                                g2.store(true, Ordering::SeqCst);
                                let nine = K {
                                    id: 9,
                                    eq_hook: Some(hook.clone()),
                                };
                                w2.get()
                                    .unwrap()
                                    .upgrade()
                                    .unwrap()
                                    .try_complete_watched(&nine);
                            }
                            ready.then(|| Out(None))
                        }),
                        checks: a_checks.clone(),
                    },
                    Duration::from_secs(100),
                    [k(1)],
                )
                .unwrap();
            armed.store(true, Ordering::SeqCst);
            p.try_complete_watched(&k(1));
            assert!(fired.load(Ordering::SeqCst), "the prune's Eq ran the hook");
            assert!(
                ha.is_finished(),
                "A missed the event raised by the prune's Eq; checks {}",
                a_checks.load(Ordering::SeqCst)
            );
        });
    }

    /// A's check drops the handle of B, which completed earlier and whose
    /// output is stored unread: the output's drop readies A and walks key 1.
    #[test]
    fn stored_output_dropped_with_a_handle_the_check_dropped_raises_an_event() {
        super::support::paused().block_on(async {
            let p: P = Purgatory::new();
            let weak: Arc<OnceLock<WeakPurgatory<K, Op>>> = Arc::default();
            weak.set(p.downgrade()).ok().unwrap();
            let ready_a = Arc::new(AtomicBool::new(false));
            let hook: Hook = {
                let (w, r) = (weak.clone(), ready_a.clone());
                Arc::new(move || {
                    r.store(true, Ordering::SeqCst);
                    walk_k1(&w);
                })
            };
            let b_go = Arc::new(AtomicBool::new(false));
            let g = b_go.clone();
            let hb = p
                .try_complete_else_watch(
                    Op {
                        body: Box::new(move || {
                            g.load(Ordering::SeqCst).then(|| Out(Some(hook.clone())))
                        }),
                        checks: Arc::default(),
                    },
                    Duration::from_secs(100),
                    [k(9)],
                )
                .unwrap();
            b_go.store(true, Ordering::SeqCst);
            assert_eq!(p.try_complete_watched(&k(9)), 1);
            assert!(hb.is_finished());
            let slot: Arc<Mutex<Option<OperationHandle<K, Op>>>> = Arc::new(Mutex::new(Some(hb)));
            let armed = Arc::new(AtomicBool::new(false));
            let a_checks = Arc::new(AtomicUsize::new(0));
            let (s2, r2, a2) = (slot.clone(), ready_a.clone(), armed.clone());
            let ha = p
                .try_complete_else_watch(
                    Op {
                        body: Box::new(move || {
                            let ready = r2.load(Ordering::SeqCst);
                            if !ready && a2.swap(false, Ordering::SeqCst) {
                                let h = s2.lock().unwrap().take();
                                drop(h);
                            }
                            ready.then(|| Out(None))
                        }),
                        checks: a_checks.clone(),
                    },
                    Duration::from_secs(100),
                    [k(1)],
                )
                .unwrap();
            armed.store(true, Ordering::SeqCst);
            p.try_complete_watched(&k(1));
            assert!(ready_a.load(Ordering::SeqCst), "B's output drop ran");
            assert!(
                ha.is_finished(),
                "A missed the event raised by B's stored output (handle dropped in A's check); checks {}",
                a_checks.load(Ordering::SeqCst)
            );
        });
    }

    /// A's check registers C with a key iterator of its own that walks A's own
    /// key (its own code): counted as an event to A?
    fn own_walk_checks(in_iterator: bool) -> usize {
        super::support::paused().block_on(async {
            let p: P = Purgatory::new();
            let weak: Arc<OnceLock<WeakPurgatory<K, Op>>> = Arc::default();
            weak.set(p.downgrade()).ok().unwrap();
            let armed = Arc::new(AtomicBool::new(false));
            let a_checks = Arc::new(AtomicUsize::new(0));
            let (w2, a2) = (weak.clone(), armed.clone());
            let _ha = p
                .try_complete_else_watch(
                    Op {
                        body: Box::new(move || {
                            if a2.swap(false, Ordering::SeqCst) {
                                let p = w2.get().unwrap().upgrade().unwrap();
                                let w3 = w2.clone();
                                let c = Op {
                                    body: Box::new(|| None),
                                    checks: Arc::default(),
                                };
                                if in_iterator {
                                    let keys = std::iter::once(()).map(move |()| {
                                        walk_k1(&w3);
                                        k(9)
                                    });
                                    drop(p.try_complete_else_watch(
                                        c,
                                        Duration::from_secs(1),
                                        keys,
                                    ));
                                } else {
                                    walk_k1(&w3);
                                    drop(p.try_complete_else_watch(
                                        c,
                                        Duration::from_secs(1),
                                        [k(9)],
                                    ));
                                }
                            }
                            None
                        }),
                        checks: a_checks.clone(),
                    },
                    Duration::from_secs(100),
                    [k(1)],
                )
                .unwrap();
            let before = a_checks.load(Ordering::SeqCst);
            armed.store(true, Ordering::SeqCst);
            p.try_complete_watched(&k(1));
            a_checks.load(Ordering::SeqCst) - before
        })
    }

    #[test]
    fn own_walk_from_the_checks_key_iterator_is_not_an_event() {
        let direct = own_walk_checks(false);
        let iter = own_walk_checks(true);
        assert_eq!(
            direct, iter,
            "checks of A: {direct} when it walks its own key directly, {iter} from its key iterator"
        );
    }

    /// An operation whose `Drop` runs a hook.
    struct DropOp {
        ready_at_once: bool,
        body: Box<dyn FnMut() -> Option<Out> + Send>,
        on_drop: Option<Hook>,
        checks: Arc<AtomicUsize>,
    }
    impl Drop for DropOp {
        fn drop(&mut self) {
            if let Some(h) = self.on_drop.take() {
                h();
            }
        }
    }
    impl Operation for DropOp {
        type Output = Out;
        fn try_complete(&mut self) -> Option<Out> {
            self.checks.fetch_add(1, Ordering::SeqCst);
            if self.ready_at_once {
                return Some(Out(None));
            }
            (self.body)()
        }
        fn on_expiration(mut self) -> Out {
            self.on_drop = None;
            Out(None)
        }
    }

    /// A's check registers N, which its first check completes at once; N's
    /// drop (by the registration) readies A and walks key 1.
    #[test]
    fn an_operation_completed_by_its_first_check_in_the_check_raises_an_event() {
        super::support::paused().block_on(async {
            type Q = Purgatory<K, DropOp>;
            let p: Q = Purgatory::new();
            let weak: Arc<OnceLock<WeakPurgatory<K, DropOp>>> = Arc::default();
            weak.set(p.downgrade()).ok().unwrap();
            let ready_a = Arc::new(AtomicBool::new(false));
            let hook: Hook = {
                let (w, r) = (weak.clone(), ready_a.clone());
                Arc::new(move || {
                    r.store(true, Ordering::SeqCst);
                    w.get().unwrap().upgrade().unwrap().try_complete_watched(&k(1));
                })
            };
            let armed = Arc::new(AtomicBool::new(false));
            let a_checks = Arc::new(AtomicUsize::new(0));
            let (w2, r2, a2) = (weak.clone(), ready_a.clone(), armed.clone());
            let ha = p
                .try_complete_else_watch(
                    DropOp {
                        ready_at_once: false,
                        body: Box::new(move || {
                            let ready = r2.load(Ordering::SeqCst);
                            if !ready && a2.swap(false, Ordering::SeqCst) {
                                let p = w2.get().unwrap().upgrade().unwrap();
                                let n = DropOp {
                                    ready_at_once: true,
                                    body: Box::new(|| None),
                                    on_drop: Some(hook.clone()),
                                    checks: Arc::default(),
                                };
                                let h = p.try_complete_else_watch(n, Duration::from_secs(1), [k(9)]);
                                if let Ok(h) = h {
                                    h.detach();
                                }
                            }
                            ready.then(|| Out(None))
                        }),
                        on_drop: None,
                        checks: a_checks.clone(),
                    },
                    Duration::from_secs(100),
                    [k(1)],
                )
                .unwrap();
            armed.store(true, Ordering::SeqCst);
            p.try_complete_watched(&k(1));
            assert!(ready_a.load(Ordering::SeqCst), "N's drop ran");
            assert!(
                ha.is_finished(),
                "A missed the event raised by the drop of N (completed by its first check); checks {}",
                a_checks.load(Ordering::SeqCst)
            );
        });
    }
}
