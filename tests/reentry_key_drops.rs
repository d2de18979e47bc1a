//! Events raised on the checking thread by user values the purgatory drops
//! or wakes on behalf of what a check did (the map's copy of a key its walk,
//! advance, cancellation by key or registration let go, an operation it
//! cancelled by dropping its handle, an output, a waker) or by key code
//! (`Hash`, `Eq`) a check's own call runs: the check runs once more within
//! the outside event, as "No missed events" promises, instead of waiting for
//! its timeout; a walk from the check's own key iterator is its own doing and
//! runs it no more than a direct walk. Paused time, one thread.
//!
//! Every scenario shares one set of types: a key [`K`], an operation [`Op`]
//! and an output [`Out`] that carry optional hooks, and a [`Scene`] holding
//! the purgatory, a weak reference hooks reach it by, and A's `ready` flag.

mod support;

use std::future::Future;
use std::hash::{Hash, Hasher};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Wake, Waker};
use std::time::Duration;

use tokio_purgatory::{
    Completion, Operation, OperationError, OperationHandle, Purgatory, Watch, WeakPurgatory,
};

use support::{balanced, ms, paused_within};

type Hook = Arc<dyn Fn() + Send + Sync>;
type Flag = Arc<AtomicBool>;
type Count = Arc<AtomicUsize>;

fn flag() -> Flag {
    Flag::default()
}

/// Runs (once) the hook `slot` holds, if any.
fn fire(slot: &mut Option<Hook>) {
    if let Some(h) = slot.take() {
        h();
    }
}

/// A key equal and hashed by `id`. Optional hooks run in its `Hash`, in its
/// `Eq` (either side's) and in its `Drop`; clones carry them.
#[derive(Clone)]
struct K {
    id: u32,
    on_hash: Option<Hook>,
    on_eq: Option<Hook>,
    on_drop: Option<Hook>,
}
impl K {
    fn hashing(mut self, h: Hook) -> K {
        self.on_hash = Some(h);
        self
    }
    fn comparing(mut self, h: Hook) -> K {
        self.on_eq = Some(h);
        self
    }
    fn dropping(mut self, h: Hook) -> K {
        self.on_drop = Some(h);
        self
    }
}
impl PartialEq for K {
    fn eq(&self, o: &K) -> bool {
        if let Some(h) = o.on_eq.as_ref().or(self.on_eq.as_ref()) {
            h();
        }
        self.id == o.id
    }
}
impl Eq for K {}
impl Hash for K {
    fn hash<H: Hasher>(&self, h: &mut H) {
        if let Some(hook) = &self.on_hash {
            hook();
        }
        self.id.hash(h)
    }
}
impl Drop for K {
    fn drop(&mut self) {
        fire(&mut self.on_drop);
    }
}
fn k(id: u32) -> K {
    K {
        id,
        on_hash: None,
        on_eq: None,
        on_drop: None,
    }
}

/// An output whose optional hook runs in its `Drop`.
struct Out(Option<Hook>);
impl Drop for Out {
    fn drop(&mut self) {
        fire(&mut self.0);
    }
}
impl std::fmt::Debug for Out {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Out")
    }
}

type Body = Box<dyn FnMut() -> Option<Out> + Send>;

/// An operation: each check counts itself in `checks` and runs `body`; an
/// optional hook runs in its `Drop` (not when it expires).
struct Op {
    body: Body,
    on_drop: Option<Hook>,
    checks: Count,
}
impl Op {
    fn dropping(mut self, h: Hook) -> Op {
        self.on_drop = Some(h);
        self
    }
}
impl Drop for Op {
    fn drop(&mut self) {
        fire(&mut self.on_drop);
    }
}
impl Operation for Op {
    type Output = Out;
    fn try_complete(&mut self) -> Option<Out> {
        self.checks.fetch_add(1, SeqCst);
        (self.body)()
    }
    fn on_expiration(mut self) -> Out {
        self.on_drop = None;
        Out(None)
    }
}
fn op(body: impl FnMut() -> Option<Out> + Send + 'static) -> Op {
    Op {
        body: Box::new(body),
        on_drop: None,
        checks: Count::default(),
    }
}
/// An operation no check completes.
fn never() -> Op {
    op(|| None)
}
/// An operation its checks complete once `go` is set.
fn once_set(go: &Flag) -> Op {
    let g = go.clone();
    op(move || g.load(SeqCst).then(|| Out(None)))
}

/// Whether `f` is set.
fn is_set(f: &Flag) -> impl Fn() -> bool + Send + 'static {
    let f = f.clone();
    move || f.load(SeqCst)
}
/// Whether `f` was set, clearing it.
fn taken(f: &Flag) -> impl Fn() -> bool + Send + 'static {
    let f = f.clone();
    move || f.swap(false, SeqCst)
}
/// `h`, run only by the first call after `armed` is set (which it clears).
fn once_armed(armed: &Flag, h: Hook) -> Hook {
    let armed = armed.clone();
    Arc::new(move || {
        if armed.swap(false, SeqCst) {
            h();
        }
    })
}

struct HookWake(Hook);
impl Wake for HookWake {
    fn wake(self: Arc<Self>) {
        (self.0)();
    }
}

const LONG: Duration = Duration::from_secs(100);

/// A hasher with fixed keys: where each key lands among the watcher map's
/// shards is the same in every run (see `eq_in_the_walks_prune_raises_an_event`).
type Fixed = std::hash::BuildHasherDefault<std::collections::hash_map::DefaultHasher>;
type P = Purgatory<K, Op, Fixed>;
type Weak = Arc<OnceLock<WeakPurgatory<K, Op, Fixed>>>;

/// The purgatory, as a hook or a check reaches it.
fn strong(w: &Weak) -> P {
    w.get().unwrap().upgrade().unwrap()
}
fn walk_k1(w: &Weak) {
    strong(w).try_complete_watched(&k(1));
}

/// A purgatory, the weak reference hooks and checks reach it by, and A's
/// `ready` flag. A watches key 1 and completes once `ready`.
struct Scene {
    p: P,
    weak: Weak,
    ready: Flag,
}
impl Scene {
    fn new() -> Scene {
        let p: P = Purgatory::with_hasher(Fixed::default());
        let weak: Weak = Arc::default();
        weak.set(p.downgrade()).ok().unwrap();
        Scene {
            p,
            weak,
            ready: flag(),
        }
    }
    /// A hook that readies A and walks key 1.
    fn readies_a(&self) -> Hook {
        let (w, r) = (self.weak.clone(), self.ready.clone());
        Arc::new(move || {
            r.store(true, SeqCst);
            walk_k1(&w);
        })
    }
    /// Registers `op` for `LONG` on `keys`.
    fn watch(&self, op: Op, keys: impl IntoIterator<Item = K>) -> OperationHandle<K, Op> {
        self.p.try_complete_else_watch(op, LONG, keys).unwrap()
    }
    /// Operation A and its check count: each check reads `ready`; while not
    /// ready it runs `act` if `when` says so; it completes once ready.
    fn a(
        &self,
        when: impl Fn() -> bool + Send + 'static,
        mut act: impl FnMut() + Send + 'static,
    ) -> (Op, Count) {
        let r = self.ready.clone();
        let a = op(move || {
            let ready = r.load(SeqCst);
            if !ready && when() {
                act();
            }
            ready.then(|| Out(None))
        });
        let checks = a.checks.clone();
        (a, checks)
    }
    /// A (as [`Scene::a`]) registered on key 1.
    fn watch_a(
        &self,
        when: impl Fn() -> bool + Send + 'static,
        act: impl FnMut() + Send + 'static,
    ) -> (OperationHandle<K, Op>, Count) {
        let (a, checks) = self.a(when, act);
        (self.watch(a, [k(1)]), checks)
    }
}

/// A's check reads its flag, then walks key 9 (B's only key). B completes;
/// key 9's list empties and the map drops its copy of the key; that drop
/// sets A's flag and walks key 1 (A's key). The event came from code A's
/// walk caused, after A read its state: A must check once more before the
/// outer walk returns, not sit until its timeout.
#[test]
fn a_key_dropped_by_the_checks_own_walk_raises_an_event() {
    paused_within(10, || async {
        let s = Scene::new();
        let (go, armed) = (flag(), flag());
        // B's first check would complete it: make it wait for `go`.
        let hb = s.watch(
            once_set(&go),
            [k(9).dropping(once_armed(&armed, s.readies_a()))],
        );
        let w = s.weak.clone();
        let (ha, a_checks) = s.watch_a(is_set(&go), move || {
            strong(&w).try_complete_watched(&k(9));
        });
        armed.store(true, SeqCst);
        go.store(true, SeqCst);
        let done = s.p.try_complete_watched(&k(1));
        assert!(hb.is_finished(), "B completed");
        assert!(!armed.load(SeqCst), "the key's drop ran");
        assert!(s.ready.load(SeqCst));
        let finished_at_once = ha.is_finished();
        let checks = a_checks.load(SeqCst);
        let start = tokio::time::Instant::now();
        let out = ha.await;
        assert!(
            finished_at_once && matches!(out, Ok(Completion::Completed(_))),
            "A missed the event its own walk's key drop raised: walk returned {done}, \
             A checked {checks} times, finished at once: {finished_at_once}; \
             it ended {out:?} after {:?} more",
            start.elapsed()
        );
        let m = s.p.metrics();
        assert!(balanced(&m), "{m:?}");
    });
}

/// The same with the map's key copy dropped by cancel_for_key called from
/// A's check (not a walk): reported separately.
#[test]
fn a_key_dropped_by_a_cancel_for_key_in_the_check_raises_an_event() {
    paused_within(10, || async {
        let s = Scene::new();
        let (go, armed) = (flag(), flag());
        let hb = s.watch(never(), [k(9).dropping(once_armed(&armed, s.readies_a()))]);
        let w = s.weak.clone();
        let (ha, a_checks) = s.watch_a(is_set(&go), move || {
            drop(strong(&w).cancel_for_key(&k(9)));
        });
        armed.store(true, SeqCst);
        go.store(true, SeqCst);
        s.p.try_complete_watched(&k(1));
        assert!(hb.is_finished());
        assert!(!armed.load(SeqCst), "the key's drop ran");
        assert!(
            ha.is_finished(),
            "A missed the event raised by a key drop its cancel_for_key caused; checks {}",
            a_checks.load(SeqCst)
        );
    });
}

/// A's check completes B by reference; B's handle is detached, so B's output
/// is dropped at once; that drop sets A's flag and walks A's key. A must run
/// once more.
#[test]
fn an_output_dropped_by_a_check_by_reference_raises_an_event() {
    paused_within(10, || async {
        let s = Scene::new();
        let go = flag();
        let (g, hook) = (go.clone(), s.readies_a());
        let hb = s.watch(
            op(move || g.load(SeqCst).then(|| Out(Some(hook.clone())))),
            [k(9)],
        );
        let b_ref = hb.op_ref().unwrap();
        hb.detach();
        let (ha, a_checks) = s.watch_a(is_set(&go), move || {
            b_ref.try_complete();
        });
        go.store(true, SeqCst);
        s.p.try_complete_watched(&k(1));
        assert!(s.ready.load(SeqCst));
        assert!(
            ha.is_finished(),
            "A missed the event its nested by-reference check's output drop raised; checks {}",
            a_checks.load(SeqCst)
        );
    });
}

/// A's check walks B's key; B completes and its handle's waker (user code)
/// sets A's flag and walks A's key. A must run once more.
#[test]
fn a_handle_waker_woken_by_the_checks_walk_raises_an_event() {
    paused_within(10, || async {
        let s = Scene::new();
        let go = flag();
        let mut hb = s.watch(once_set(&go), [k(9)]);
        let waker = Waker::from(Arc::new(HookWake(s.readies_a())));
        assert!(Pin::new(&mut hb)
            .poll(&mut Context::from_waker(&waker))
            .is_pending());
        let w = s.weak.clone();
        let (ha, a_checks) = s.watch_a(is_set(&go), move || {
            strong(&w).try_complete_watched(&k(9));
        });
        go.store(true, SeqCst);
        s.p.try_complete_watched(&k(1));
        assert!(s.ready.load(SeqCst));
        assert!(
            ha.is_finished(),
            "A missed the event raised by a waker its walk woke; checks {}",
            a_checks.load(SeqCst)
        );
        assert!(hb.await.is_ok());
    });
}

/// Control for the first test: the same event raised by B's operation
/// Drop (which the crate runs when A's walk completes B) is seen: A runs
/// once more and completes within the outer walk.
#[test]
fn control_an_operation_dropped_by_the_checks_own_walk_raises_an_event() {
    paused_within(10, || async {
        let s = Scene::new();
        let go = flag();
        let hb = s.watch(once_set(&go).dropping(s.readies_a()), [k(9)]);
        let w = s.weak.clone();
        let (ha, _) = s.watch_a(is_set(&go), move || {
            strong(&w).try_complete_watched(&k(9));
        });
        go.store(true, SeqCst);
        s.p.try_complete_watched(&k(1));
        assert!(hb.is_finished());
        assert!(s.ready.load(SeqCst));
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
    paused_within(10, || async {
        let s = Scene::new();
        let go = flag();
        let hook = s.readies_a();
        let kept: Arc<Mutex<Vec<OperationHandle<K, Op>>>> = Arc::default();
        let (w, kp) = (s.weak.clone(), kept.clone());
        let (ha, _) = s.watch_a(taken(&go), move || {
            // Clones carry the hook too; only the one dropped first matters.
            let key = k(9).dropping(hook.clone());
            let h = strong(&w)
                .try_complete_else_watch(never(), LONG, [key])
                .map_err(|_| ())
                .unwrap();
            kp.lock().unwrap().push(h);
        });
        go.store(true, SeqCst);
        s.p.try_complete_watched(&k(1));
        assert!(s.ready.load(SeqCst), "the key was dropped");
        assert!(
            ha.is_finished(),
            "A missed the event raised by the drop of a key its registration dropped"
        );
        drop(s.p.shutdown());
    });
}

/// The level form of the first test: A's check advances key 9 (B waits on
/// it at a level); B completes, key 9's list empties and the map drops its
/// key, whose Drop readies A and advances A's key past the level A is being
/// checked for (an advance to that same level again reaches nothing new:
/// A's watch already waits for the next one).
#[test]
fn a_key_dropped_by_the_checks_own_advance_raises_an_event() {
    paused_within(10, || async {
        let s = Scene::new();
        let (go, armed) = (flag(), flag());
        let hook: Hook = {
            let (w, r) = (s.weak.clone(), s.ready.clone());
            Arc::new(move || {
                r.store(true, SeqCst);
                strong(&w).try_complete_reached(&k(1), 6);
            })
        };
        let key = k(9).dropping(once_armed(&armed, hook));
        let hb =
            s.p.try_complete_else_watch_levels(once_set(&go), LONG, [Watch::level(key, 3)])
                .unwrap();
        let w = s.weak.clone();
        let (a, _) = s.a(is_set(&go), move || {
            strong(&w).try_complete_reached(&k(9), 3);
        });
        let ha =
            s.p.try_complete_else_watch_levels(a, LONG, [Watch::level(k(1), 5)])
                .unwrap();
        armed.store(true, SeqCst);
        go.store(true, SeqCst);
        s.p.try_complete_reached(&k(1), 5);
        assert!(hb.is_finished(), "B completed");
        assert!(s.ready.load(SeqCst), "the key's drop ran");
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
    paused_within(10, || async {
        let counts = |n: &Count| -> Hook {
            let n = n.clone();
            Arc::new(move || {
                n.fetch_add(1, SeqCst);
            })
        };
        let p: P = Purgatory::with_hasher(Fixed::default());
        let weak = p.downgrade();
        let (a_drops, b_drops) = (Count::default(), Count::default());
        let last: Arc<Mutex<Option<P>>> = Arc::default();
        let l2 = last.clone();
        // Each operation's body holds a drop counter (an `Out` as guard), so
        // every drop counts, however the operation goes.
        let (a_guard, b_guard) = (Out(Some(counts(&a_drops))), Out(Some(counts(&b_drops))));
        let a = op(move || {
            let _ = (&l2, &a_guard);
            None
        });
        let b = op(move || {
            let _ = &b_guard;
            None
        });
        let ha = p.try_complete_else_watch(a, LONG, [k(1)]).unwrap();
        let hb = p.try_complete_else_watch(b, LONG, [k(2)]).unwrap();
        *last.lock().unwrap() = Some(p);
        drop(last); // A's closure now holds the only Arc to the last clone
        drop(ha); // cancels A: its drop drops the last clone
        assert!(weak.upgrade().is_none());
        assert_eq!(a_drops.load(SeqCst), 1);
        let r = tokio::time::timeout(ms(1), hb).await.expect("resolved");
        assert_eq!(r.unwrap_err(), OperationError::Shutdown);
        assert_eq!(b_drops.load(SeqCst), 1);
    });
}

// Operations a check cancels: the operation's own `Drop` and its handle's
// waker, run for a cancel that check made, raise events on it.

/// A's check drops B's pending handle: the purgatory cancels B and drops
/// B's operation, whose `Drop` readies A and walks A's key: A checks once
/// more within the outside walk.
#[test]
fn an_operation_whose_handle_the_check_dropped_raises_an_event() {
    paused_within(10, || async {
        let s = Scene::new();
        let hb = s.watch(never().dropping(s.readies_a()), [k(9)]);
        let slot = Mutex::new(Some(hb));
        let go = flag();
        let (ha, a_checks) = s.watch_a(is_set(&go), move || {
            let h = slot.lock().unwrap().take();
            drop(h);
        });
        go.store(true, SeqCst);
        s.p.try_complete_watched(&k(1));
        assert!(s.ready.load(SeqCst), "B's drop ran");
        assert!(
            ha.is_finished(),
            "A missed the event raised by B's drop (handle drop in A's check); checks {}",
            a_checks.load(SeqCst)
        );
    });
}

/// A's check cancels B by key; B's handle's waker readies A and walks
/// A's key: A checks once more within the outside walk.
#[test]
fn a_waker_woken_by_a_cancel_for_key_in_the_check_raises_an_event() {
    paused_within(10, || async {
        let s = Scene::new();
        let mut hb = s.watch(never(), [k(9)]);
        let waker = Waker::from(Arc::new(HookWake(s.readies_a())));
        assert!(Pin::new(&mut hb)
            .poll(&mut Context::from_waker(&waker))
            .is_pending());
        let go = flag();
        let w = s.weak.clone();
        let (ha, a_checks) = s.watch_a(is_set(&go), move || {
            drop(strong(&w).cancel_for_key(&k(9)));
        });
        go.store(true, SeqCst);
        s.p.try_complete_watched(&k(1));
        assert!(s.ready.load(SeqCst), "B's waker ran");
        assert!(
            ha.is_finished(),
            "A missed the event raised by B's waker (cancel_for_key in A's check); checks {}",
            a_checks.load(SeqCst)
        );
    });
}

// Key code (`Hash`) a check's own walk, registration or cancellation by key
// runs: an event it raises on the checking operation reaches it.

#[derive(Clone, Copy, Debug)]
enum Call {
    Walk,
    Register,
    CancelForKey,
}

/// A watches key 1; its check calls `call` with key 9, whose `Hash`
/// readies A and walks key 1 (once).
fn key_code_scenario(call: Call) {
    paused_within(10, move || async move {
        let s = Scene::new();
        let armed = flag();
        let hook = once_armed(&armed, s.readies_a());
        let w = s.weak.clone();
        let (ha, checks) = s.watch_a(is_set(&armed), move || {
            let p = strong(&w);
            let nine = k(9).hashing(hook.clone());
            match call {
                Call::Walk => drop(p.try_complete_watched(&nine)),
                Call::Register => {
                    drop(p.try_complete_else_watch(never(), Duration::from_secs(1), [nine]))
                }
                Call::CancelForKey => drop(p.cancel_for_key(&nine)),
            }
        });
        armed.store(true, SeqCst);
        s.p.try_complete_watched(&k(1));
        assert!(s.ready.load(SeqCst), "{call:?}: the hook ran");
        assert!(
            ha.is_finished(),
            "{call:?}: A missed the event its key code raised; checks {}",
            checks.load(SeqCst)
        );
    });
}

#[test]
fn key_code_of_a_walk_in_the_check_raises_an_event() {
    key_code_scenario(Call::Walk);
}

#[test]
fn key_code_of_a_registration_in_the_check_raises_an_event() {
    key_code_scenario(Call::Register);
}

#[test]
fn key_code_of_a_cancel_for_key_in_the_check_raises_an_event() {
    key_code_scenario(Call::CancelForKey);
}

// Further user code run for a call a check made: a key's `Eq` in the prune
// after its walk, an output stored in a handle the check dropped, an
// operation its registration's first check completed; and the check's own
// walk from its own key iterator, which is the check's doing (no re-run).

/// A's check walks key 9; B (on 9) completes, so the walk prunes key 9's
/// list, running key 9's `Eq` again: that `Eq` readies A and walks key 1.
/// A key's `Eq` runs under its watcher-map shard's lock and must not call
/// back in (documented); this one does, and it can only because keys 1 and
/// 9 lie in different shards under the scene's fixed hasher (with a random
/// one they shared a shard in about one run of 75, and the walk of key 1
/// waited on the lock its own thread held).
#[test]
fn eq_in_the_walks_prune_raises_an_event() {
    paused_within(10, || async {
        let s = Scene::new();
        let (b_go, b_done, fired) = (flag(), flag(), flag());
        let (g, d) = (b_go.clone(), b_done.clone());
        let _hb = s.watch(
            op(move || {
                if g.load(SeqCst) {
                    d.store(true, SeqCst);
                    Some(Out(None))
                } else {
                    None
                }
            }),
            [k(9)],
        );
        let hook: Hook = {
            let (d, f, readies) = (b_done.clone(), fired.clone(), s.readies_a());
            Arc::new(move || {
                if d.load(SeqCst) && !f.swap(true, SeqCst) {
                    readies();
                }
            })
        };
        let armed = flag();
        let w = s.weak.clone();
        let (ha, a_checks) = s.watch_a(taken(&armed), move || {
            b_go.store(true, SeqCst);
            let nine = k(9).comparing(hook.clone());
            strong(&w).try_complete_watched(&nine);
        });
        armed.store(true, SeqCst);
        s.p.try_complete_watched(&k(1));
        assert!(fired.load(SeqCst), "the prune's Eq ran the hook");
        assert!(
            ha.is_finished(),
            "A missed the event raised by the prune's Eq; checks {}",
            a_checks.load(SeqCst)
        );
    });
}

/// A's check drops the handle of B, which completed earlier and whose
/// output is stored unread: the output's drop readies A and walks key 1.
#[test]
fn stored_output_dropped_with_a_handle_the_check_dropped_raises_an_event() {
    paused_within(10, || async {
        let s = Scene::new();
        let b_go = flag();
        let (g, hook) = (b_go.clone(), s.readies_a());
        let hb = s.watch(
            op(move || g.load(SeqCst).then(|| Out(Some(hook.clone())))),
            [k(9)],
        );
        b_go.store(true, SeqCst);
        assert_eq!(s.p.try_complete_watched(&k(9)), 1);
        assert!(hb.is_finished());
        let slot = Mutex::new(Some(hb));
        let armed = flag();
        let (ha, a_checks) = s.watch_a(taken(&armed), move || {
            let h = slot.lock().unwrap().take();
            drop(h);
        });
        armed.store(true, SeqCst);
        s.p.try_complete_watched(&k(1));
        assert!(s.ready.load(SeqCst), "B's output drop ran");
        assert!(
            ha.is_finished(),
            "A missed the event raised by B's stored output (handle dropped in A's check); checks {}",
            a_checks.load(SeqCst)
        );
    });
}

/// A's check registers C with a key iterator of its own that walks A's own
/// key (its own code): counted as an event to A? Returns A's checks for
/// the outside walk.
fn own_walk_checks(in_iterator: bool) -> usize {
    paused_within(10, move || async move {
        let s = Scene::new();
        let armed = flag();
        let w = s.weak.clone();
        // Nothing readies A: it never completes.
        let (_ha, a_checks) = s.watch_a(taken(&armed), move || {
            let p = strong(&w);
            let w3 = w.clone();
            let c = never();
            if in_iterator {
                let keys = std::iter::once(()).map(move |()| {
                    walk_k1(&w3);
                    k(9)
                });
                drop(p.try_complete_else_watch(c, Duration::from_secs(1), keys));
            } else {
                walk_k1(&w3);
                drop(p.try_complete_else_watch(c, Duration::from_secs(1), [k(9)]));
            }
        });
        let before = a_checks.load(SeqCst);
        armed.store(true, SeqCst);
        s.p.try_complete_watched(&k(1));
        a_checks.load(SeqCst) - before
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

/// A's check registers N, which its first check completes at once; N's
/// drop (by the registration) readies A and walks key 1.
#[test]
fn an_operation_completed_by_its_first_check_in_the_check_raises_an_event() {
    paused_within(10, || async {
        let s = Scene::new();
        let hook = s.readies_a();
        let armed = flag();
        let w = s.weak.clone();
        let (ha, a_checks) = s.watch_a(taken(&armed), move || {
            let n = op(|| Some(Out(None))).dropping(hook.clone());
            let h = strong(&w).try_complete_else_watch(n, Duration::from_secs(1), [k(9)]);
            if let Ok(h) = h {
                h.detach();
            }
        });
        armed.store(true, SeqCst);
        s.p.try_complete_watched(&k(1));
        assert!(s.ready.load(SeqCst), "N's drop ran");
        assert!(
            ha.is_finished(),
            "A missed the event raised by the drop of N (completed by its first check); checks {}",
            a_checks.load(SeqCst)
        );
    });
}
