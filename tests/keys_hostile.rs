//! Watch keys, the key map and walks used hostilely. An event that another
//! operation's check raises on the checking thread, during a check or a
//! registration, still makes the operation check again (it completes at
//! once instead of waiting for its timeout), and checks that walk each
//! other's keys every time they run still end. Walks re-entered from checks
//! on the key being walked, registering on it and cancelling it. Keys and
//! hashers whose `Hash` calls back in, a hasher whose `Drop` panics, a
//! `Borrow` or borrowed `Eq` that panics (nothing changes, the purgatory
//! goes on), keys found by their borrowed forms, keys equal to nothing or
//! whose hash moves (their operations finish by their timeout and the map
//! still empties). The map holds no keys once nothing is pending, however
//! wide the operations were; on a shared reaper, a large map left with
//! nothing pending is purged over several of its turns, a timer sharing it
//! served meanwhile. Threads racing registrations (duplicate keys, levels),
//! walks, advances and cancellations by key over a tiny key space finish
//! each operation once and leave the map empty.

mod support;

use std::borrow::Borrow;
use std::hash::{BuildHasher, Hash, Hasher};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio::time::advance;
use tokio_purgatory::{
    Completion, Operation, OperationError, Purgatory, Reaper, Timer, Watch, WatchKey, WeakPurgatory,
};

use support::rng::Rng;
use support::{balanced, ms, paused_within, settle, within};

/// Completes once its flag is set; may run a hook from inside its check.
struct Op {
    ready: Arc<AtomicBool>,
    hook: Option<Arc<dyn Fn() + Send + Sync>>,
    checks: Arc<AtomicUsize>,
}

impl Op {
    fn new(ready: &Arc<AtomicBool>) -> Op {
        Op {
            ready: ready.clone(),
            hook: None,
            checks: Arc::default(),
        }
    }
}

impl Operation for Op {
    type Output = u32;
    fn try_complete(&mut self) -> Option<u32> {
        self.checks.fetch_add(1, Ordering::SeqCst);
        // Decide first (as Kafka's checks do: read the state, then act)...
        let ready = self.ready.load(Ordering::SeqCst);
        // ... then act, which here may raise events on other keys.
        if let Some(h) = &self.hook {
            h();
        }
        ready.then_some(1)
    }
    fn on_expiration(self) -> u32 {
        0
    }
}

/// Pending, watched entries, tombstones and keys.
fn shape<K: WatchKey, O: Operation, S>(p: &Purgatory<K, O, S>) -> (usize, usize, usize, usize) {
    let m = p.metrics();
    (m.delayed, m.watched, m.tombstones, m.keys)
}

/// A purgatory its operations' hooks can reach.
type Slot<K> = Arc<OnceLock<Purgatory<K, Op>>>;

fn slot_of<K: WatchKey>(p: &Purgatory<K, Op>) -> Slot<K> {
    let slot = Arc::new(OnceLock::new());
    slot.set(p.clone()).ok();
    slot
}

// ---------------------------------------------------------------------------
// An event raised, on the same thread, from inside a check of another
// operation, while the first operation's own check is still on the stack.

/// A's check reads its flag (not yet), then raises an event on key "j". B,
/// watching "j", is checked by that walk: B's check makes A completable and
/// walks A's key "k", as the protocol asks (change the state, then
/// `try_complete_watched`). A's check is still under way further up the
/// stack and returns the "not yet" it decided before; A checks once more
/// when it ends and completes there, within the outside walk, rather than
/// waiting for its timeout.
#[test]
fn an_event_raised_by_another_operations_check_is_not_lost() {
    paused_within(20, || async {
        let p: Purgatory<&'static str, Op> = Purgatory::new();
        let slot = slot_of(&p);
        let a_ready = Arc::new(AtomicBool::new(false));
        let b_ready = Arc::new(AtomicBool::new(false));
        let fire = Arc::new(AtomicBool::new(false));

        // B: on "j"; its check, once armed, makes A ready and walks "k".
        let b_hook: Arc<dyn Fn() + Send + Sync> = {
            let slot = slot.clone();
            let a_ready = a_ready.clone();
            let fire = fire.clone();
            Arc::new(move || {
                if fire.load(Ordering::SeqCst) {
                    a_ready.store(true, Ordering::SeqCst);
                    slot.get().unwrap().try_complete_watched(&"k");
                }
            })
        };
        let b = Op {
            hook: Some(b_hook),
            ..Op::new(&b_ready)
        };
        let hb = p.try_complete_else_watch(b, ms(1000), ["j"]).unwrap();

        // A: on "k"; its check, once armed, raises an event on "j".
        let a_hook: Arc<dyn Fn() + Send + Sync> = {
            let slot = slot.clone();
            let fire = fire.clone();
            Arc::new(move || {
                if fire.load(Ordering::SeqCst) {
                    slot.get().unwrap().try_complete_watched(&"j");
                }
            })
        };
        let a_checks = Arc::new(AtomicUsize::new(0));
        let a = Op {
            hook: Some(a_hook),
            checks: a_checks.clone(),
            ..Op::new(&a_ready)
        };
        let ha = p.try_complete_else_watch(a, ms(1000), ["k"]).unwrap();

        fire.store(true, Ordering::SeqCst);
        // An outside event on "k": A checks (not yet), raises "j"; B's check
        // makes A ready and walks "k".
        let completed = p.try_complete_watched(&"k");
        fire.store(false, Ordering::SeqCst);
        let checks = a_checks.load(Ordering::SeqCst);
        assert!(
            ha.is_finished(),
            "A was made ready by a check its own check caused, yet is left to its \
             timeout: checked {checks} times, {} pending",
            p.delayed()
        );
        assert_eq!(completed, 1, "the outside walk completed A");
        assert_eq!(p.delayed(), 1, "B alone is pending");
        assert_eq!(ha.await, Ok(Completion::Completed(1)));
        advance(ms(1001)).await;
        settle().await;
        assert_eq!(hb.await, Ok(Completion::Expired(0)));
        assert!(balanced(&p.metrics()));
    });
}

/// The same during a registration: "An event that arrives while an
/// operation registers ... makes it check again" (crate docs, Guarantees).
/// A's second check at registration (the one after its watch is in place)
/// reads "not yet", then raises an event on "j"; B's check makes A ready and
/// walks "k", A's key, while A is still registering. A completes before the
/// registration returns.
#[test]
fn an_event_during_a_registration_raised_by_another_check_is_not_lost() {
    paused_within(20, || async {
        let p: Purgatory<&'static str, Op> = Purgatory::new();
        let slot = slot_of(&p);
        let a_ready = Arc::new(AtomicBool::new(false));
        let b_ready = Arc::new(AtomicBool::new(false));
        let armed = Arc::new(AtomicBool::new(false));
        // B: on "j"; its check, once armed, makes A ready and walks "k", once.
        let b_hook: Arc<dyn Fn() + Send + Sync> = {
            let slot = slot.clone();
            let a_ready = a_ready.clone();
            let armed = armed.clone();
            Arc::new(move || {
                if armed.swap(false, Ordering::SeqCst) {
                    a_ready.store(true, Ordering::SeqCst);
                    slot.get().unwrap().try_complete_watched(&"k");
                }
            })
        };
        let b = Op {
            hook: Some(b_hook),
            ..Op::new(&b_ready)
        };
        let hb = p.try_complete_else_watch(b, ms(1000), ["j"]).unwrap();
        armed.store(true, Ordering::SeqCst);
        let a_checks = Arc::new(AtomicUsize::new(0));
        let a_hook: Arc<dyn Fn() + Send + Sync> = {
            let slot = slot.clone();
            let a_checks = a_checks.clone();
            Arc::new(move || {
                // Its second check at registration: the watch is in place.
                if a_checks.load(Ordering::SeqCst) == 2 {
                    slot.get().unwrap().try_complete_watched(&"j");
                }
            })
        };
        let a = Op {
            hook: Some(a_hook),
            checks: a_checks.clone(),
            ..Op::new(&a_ready)
        };
        let ha = p.try_complete_else_watch(a, ms(1000), ["k"]).unwrap();
        let checks = a_checks.load(Ordering::SeqCst);
        assert!(!armed.load(Ordering::SeqCst), "B's check walked \"k\"");
        assert!(
            ha.is_finished(),
            "A made ready and its key walked during its registration, yet left to \
             its timeout: checked {checks} times"
        );
        assert_eq!(ha.await, Ok(Completion::Completed(1)));
        advance(ms(1001)).await;
        settle().await;
        assert_eq!(hb.await, Ok(Completion::Expired(0)));
        assert!(balanced(&p.metrics()));
    });
}

/// Checks that walk each other's keys every time they run, on one thread:
/// each outside event ends (no loop), and checks each operation at most
/// twice (its check, and the one re-run a check it caused asked for).
#[test]
fn checks_walking_each_others_keys_every_time_end() {
    paused_within(20, || async {
        let p: Purgatory<&'static str, Op> = Purgatory::new();
        let slot = slot_of(&p);
        let never = Arc::new(AtomicBool::new(false));
        let walker = |key: &'static str| -> Arc<dyn Fn() + Send + Sync> {
            let slot = slot.clone();
            Arc::new(move || {
                slot.get().unwrap().try_complete_watched(&key);
            })
        };
        let (ca, cb) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let a = Op {
            hook: Some(walker("j")),
            checks: ca.clone(),
            ..Op::new(&never)
        };
        let b = Op {
            hook: Some(walker("k")),
            checks: cb.clone(),
            ..Op::new(&never)
        };
        let ha = p.try_complete_else_watch(a, ms(1000), ["k"]).unwrap();
        let hb = p.try_complete_else_watch(b, ms(1000), ["j"]).unwrap();
        let before = (ca.load(Ordering::SeqCst), cb.load(Ordering::SeqCst));
        let events = 20;
        for _ in 0..events / 2 {
            p.try_complete_watched(&"k");
            p.try_complete_watched(&"j");
        }
        let after = (ca.load(Ordering::SeqCst), cb.load(Ordering::SeqCst));
        let checked = (after.0 - before.0, after.1 - before.1);
        for n in [checked.0, checked.1] {
            assert!(
                (events..=2 * events).contains(&n),
                "{events} events checked A and B {checked:?} times"
            );
        }
        advance(ms(1001)).await;
        settle().await;
        assert_eq!(ha.await, Ok(Completion::Expired(0)));
        assert_eq!(hb.await, Ok(Completion::Expired(0)));
    });
}

// ---------------------------------------------------------------------------
// Walks re-entered from checks on the same key.

/// The first check of a walk of key 7 walks 7 again from inside (an event it
/// raised): the nested walk completes the others. Every operation completes
/// once, and the two walks' returns add up to the completions.
#[test]
fn a_nested_walk_of_the_same_key_completes_each_once_and_counts_add_up() {
    paused_within(20, || async {
        let p: Purgatory<u32, Op> = Purgatory::new();
        let slot = slot_of(&p);
        let ready = Arc::new(AtomicBool::new(false));
        let inner = Arc::new(AtomicUsize::new(0));
        let first_hook: Arc<dyn Fn() + Send + Sync> = {
            let slot = slot.clone();
            let inner = inner.clone();
            let ready = ready.clone();
            Arc::new(move || {
                if ready.load(Ordering::SeqCst) {
                    let n = slot.get().unwrap().try_complete_watched(&7);
                    inner.fetch_add(n, Ordering::SeqCst);
                }
            })
        };
        let mut handles = Vec::new();
        let first = Op {
            hook: Some(first_hook),
            ..Op::new(&ready)
        };
        handles.push(p.try_complete_else_watch(first, ms(1000), [7, 8]).unwrap());
        let checks: Vec<Arc<AtomicUsize>> = (0..200).map(|_| Arc::default()).collect();
        for (i, c) in checks.iter().enumerate() {
            let op = Op {
                checks: c.clone(),
                ..Op::new(&ready)
            };
            handles.push(
                p.try_complete_else_watch(op, ms(1000), [7, 1000 + i as u32])
                    .unwrap(),
            );
        }
        ready.store(true, Ordering::SeqCst);
        let outer = p.try_complete_watched(&7);
        let inner = inner.load(Ordering::SeqCst);
        assert_eq!(outer + inner, 201, "outer {outer} + inner {inner}");
        for h in handles {
            assert_eq!(h.await, Ok(Completion::Completed(1)));
        }
        let m = p.metrics();
        assert_eq!(m.completed, 201, "{m:?}");
        assert!(balanced(&m));
        // Each of the 200 checked: twice at registration, once by a walk.
        for c in &checks {
            assert_eq!(c.load(Ordering::SeqCst), 3);
        }
        // The hot key's list is gone; the other keys hold tombstones.
        assert_eq!(m.delayed, 0);
        assert_eq!(m.watched, m.tombstones, "{m:?}");
    });
}

/// A check registers new operations on the key being walked, and cancels the
/// key's watchers by key, from inside the walk: the new ones stay pending
/// and findable, the cancelled ones come back once, and the map ends empty.
#[test]
fn checks_that_register_on_and_cancel_the_key_being_walked() {
    paused_within(20, || async {
        let p: Purgatory<u32, Op> = Purgatory::new();
        let slot = slot_of(&p);
        let never = Arc::new(AtomicBool::new(false));
        let fire = Arc::new(AtomicBool::new(false));
        let registered = Arc::new(Mutex::new(Vec::new()));
        let cancelled = Arc::new(Mutex::new(Vec::new()));
        let hook: Arc<dyn Fn() + Send + Sync> = {
            let slot = slot.clone();
            let never = never.clone();
            let fire = fire.clone();
            let registered = registered.clone();
            let cancelled = cancelled.clone();
            Arc::new(move || {
                if fire.swap(false, Ordering::SeqCst) {
                    let p = slot.get().unwrap();
                    // Cancel the key's watchers (this one is being checked:
                    // left to its checker), then watch the key anew.
                    let back = p.cancel_for_key(&5);
                    cancelled.lock().unwrap().push(back.len());
                    drop(back);
                    for _ in 0..3 {
                        let h = p
                            .try_complete_else_watch(Op::new(&never), ms(500), [5, 6])
                            .unwrap();
                        registered.lock().unwrap().push(h);
                    }
                }
            })
        };
        let first = Op {
            hook: Some(hook),
            ..Op::new(&never)
        };
        let h0 = p.try_complete_else_watch(first, ms(1000), [5]).unwrap();
        let others: Vec<_> = (0..10u32)
            .map(|i| {
                p.try_complete_else_watch(Op::new(&never), ms(1000), [5, 100 + i])
                    .unwrap()
            })
            .collect();
        fire.store(true, Ordering::SeqCst);
        assert_eq!(p.try_complete_watched(&5), 0);
        assert_eq!(*cancelled.lock().unwrap(), vec![10], "the ten others");
        assert_eq!(h0.await, Err(OperationError::Cancelled));
        for h in others {
            assert_eq!(h.await, Err(OperationError::Cancelled));
        }
        let m = p.metrics();
        assert_eq!(m.delayed, 3, "{m:?}");
        // The three new ones are on key 5, found by it.
        let back = p.cancel_for_key(&5);
        assert_eq!(back.len(), 3);
        drop(back);
        let hs: Vec<_> = std::mem::take(&mut *registered.lock().unwrap());
        for h in hs {
            assert_eq!(h.await, Err(OperationError::Cancelled));
        }
        assert_eq!(shape(&p), (0, 0, 0, 0), "{:?}", p.metrics());
        assert!(balanced(&p.metrics()));
    });
}

// ---------------------------------------------------------------------------
// A key's `Hash` (and the chosen hasher) run before any lock: they may call
// back in.

/// What the keys of one test share: whether their `Hash` calls back in, and
/// the purgatory it calls.
#[derive(Default)]
struct CallHooks {
    on: AtomicBool,
    purgatory: OnceLock<WeakPurgatory<CallKey, Op>>,
}

/// A key whose `Hash` calls back into the purgatory (walks another key,
/// advances it, reads the metrics, registers on it, cancels it).
#[derive(Clone)]
struct CallKey {
    id: u32,
    hooks: Arc<CallHooks>,
}

impl PartialEq for CallKey {
    fn eq(&self, o: &Self) -> bool {
        self.id == o.id
    }
}
impl Eq for CallKey {}

impl Hash for CallKey {
    fn hash<H: Hasher>(&self, h: &mut H) {
        if self.id < 1000 && self.hooks.on.load(Ordering::SeqCst) {
            if let Some(p) = self.hooks.purgatory.get().and_then(WeakPurgatory::upgrade) {
                let other = CallKey {
                    id: 1000 + self.id,
                    hooks: self.hooks.clone(),
                };
                let _ = p.metrics();
                let _ = p.watched();
                p.try_complete_watched(&other);
                p.try_complete_reached(&other, 3);
                drop(p.cancel_for_key(&other));
                let never = Arc::new(AtomicBool::new(false));
                p.try_complete_else_watch(Op::new(&never), ms(50), [other.clone()])
                    .unwrap()
                    .detach();
            }
        }
        self.id.hash(h);
    }
}

#[test]
fn a_key_hash_that_calls_back_in_does_not_deadlock() {
    paused_within(30, || async {
        let hooks = Arc::new(CallHooks::default());
        let p: Purgatory<CallKey, Op> = Purgatory::new();
        hooks.purgatory.set(p.downgrade()).ok();
        let key = |id| CallKey {
            id,
            hooks: hooks.clone(),
        };
        hooks.on.store(true, Ordering::SeqCst);
        let ready = Arc::new(AtomicBool::new(false));
        let mut handles = Vec::new();
        for n in [1u32, 3, 4, 5, 17, 40] {
            let keys: Vec<CallKey> = (0..n).map(key).chain((0..n).map(key)).collect();
            handles.push(
                p.try_complete_else_watch(Op::new(&ready), ms(100), keys)
                    .unwrap(),
            );
        }
        let watches = [
            Watch::level(key(1), 5),
            Watch::key(key(2)),
            Watch::level(key(1), 9),
        ];
        handles.push(
            p.try_complete_else_watch_levels(Op::new(&ready), ms(100), watches)
                .unwrap(),
        );
        assert_eq!(p.try_complete_watched(&key(0)), 0);
        ready.store(true, Ordering::SeqCst);
        assert_eq!(
            p.try_complete_reached(&key(1), 9),
            6,
            "every registration watches 0.. and 1"
        );
        let back = p.cancel_for_key(&key(0));
        assert_eq!(back.len(), 1, "the registration on key 0 alone");
        hooks.on.store(false, Ordering::SeqCst);
        for (i, h) in handles.into_iter().enumerate() {
            let want = if i == 0 {
                Err(OperationError::Cancelled)
            } else {
                Ok(Completion::Completed(1))
            };
            assert_eq!(h.await, want, "registration {i}");
        }
        advance(ms(100)).await;
        settle().await;
        let m = p.metrics();
        assert!(balanced(&m), "{m:?}");
        assert_eq!(m.delayed, 0, "{m:?}");
    });
}

/// A hasher whose `build_hasher` calls back into the purgatory (through a
/// weak handle): "the chosen hasher [runs] before any lock is taken".
#[derive(Clone)]
struct CallingHasher {
    on: Arc<AtomicBool>,
    purgatory: Arc<OnceLock<WeakPurgatory<u32, Op, CallingHasher>>>,
}

impl BuildHasher for CallingHasher {
    type Hasher = std::collections::hash_map::DefaultHasher;
    fn build_hasher(&self) -> Self::Hasher {
        // Off while it calls back in: the calls hash keys too.
        if self.on.swap(false, Ordering::SeqCst) {
            if let Some(p) = self.purgatory.get().and_then(WeakPurgatory::upgrade) {
                let _ = p.metrics();
                p.try_complete_watched(&77);
                let never = Arc::new(AtomicBool::new(false));
                p.try_complete_else_watch(Op::new(&never), ms(50), [77, 78])
                    .unwrap()
                    .detach();
                drop(p.cancel_for_key(&78));
            }
            self.on.store(true, Ordering::SeqCst);
        }
        std::collections::hash_map::DefaultHasher::new()
    }
}

#[test]
fn a_hasher_that_calls_back_in_does_not_deadlock() {
    paused_within(30, || async {
        let hasher = CallingHasher {
            on: Arc::default(),
            purgatory: Arc::default(),
        };
        let (on, cell) = (hasher.on.clone(), hasher.purgatory.clone());
        let p: Purgatory<u32, Op, CallingHasher> = Purgatory::with_hasher(hasher);
        cell.set(p.downgrade()).ok();
        on.store(true, Ordering::SeqCst);
        let ready = Arc::new(AtomicBool::new(false));
        let h = p
            .try_complete_else_watch(Op::new(&ready), ms(100), [1, 2, 3, 4, 5, 6])
            .unwrap();
        assert_eq!(p.try_complete_watched(&3), 0);
        ready.store(true, Ordering::SeqCst);
        assert_eq!(p.try_complete_reached(&4, 1), 1);
        drop(p.cancel_for_key(&5));
        on.store(false, Ordering::SeqCst);
        assert_eq!(h.await, Ok(Completion::Completed(1)));
        advance(ms(100)).await;
        settle().await;
        assert!(balanced(&p.metrics()));
        assert_eq!(p.delayed(), 0);
    });
}

// ---------------------------------------------------------------------------
// The hasher is a user value the crate drops.

struct BombHasher;

impl BuildHasher for BombHasher {
    type Hasher = std::collections::hash_map::DefaultHasher;
    fn build_hasher(&self) -> Self::Hasher {
        std::collections::hash_map::DefaultHasher::new()
    }
}

impl Drop for BombHasher {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            panic!("hostile hasher drop");
        }
    }
}

/// "a panicking `Drop` of anything the crate drops ... is caught": the
/// purgatory drops its hasher with the last clone (or the last handle), and
/// a build that fails drops it too.
#[tokio::test(start_paused = true)]
async fn a_hasher_whose_drop_panics_is_contained() {
    let p: Purgatory<u32, Op, BombHasher> = Purgatory::with_hasher(BombHasher);
    let never = Arc::new(AtomicBool::new(false));
    let h = p
        .try_complete_else_watch(Op::new(&never), ms(10), [1])
        .unwrap();
    let r = catch_unwind(AssertUnwindSafe(move || drop(p)));
    assert!(
        r.is_ok(),
        "dropping the last purgatory clone let the hasher's panic out"
    );
    // The handle, the last owner of the shared state, drops it.
    let r = catch_unwind(AssertUnwindSafe(move || drop(h)));
    assert!(
        r.is_ok(),
        "dropping the last handle let the hasher's panic out"
    );
    let r = catch_unwind(AssertUnwindSafe(|| {
        Purgatory::<u32, Op>::builder()
            .hasher(BombHasher)
            .watcher_shards(0)
            .build()
            .is_err()
    }));
    assert_eq!(
        r.ok(),
        Some(true),
        "a refused build let the hasher's panic out"
    );
}

// ---------------------------------------------------------------------------
// Borrowed forms.

#[tokio::test(start_paused = true)]
async fn other_borrowed_forms_find_their_keys() {
    let ready = Arc::new(AtomicBool::new(false));
    // Box<str> by &str, Arc<str> by &str, Vec<u8> by &[u8], PathBuf by &Path.
    let p1: Purgatory<Box<str>, Op> = Purgatory::new();
    let h1 = p1
        .try_complete_else_watch(Op::new(&ready), ms(100), ["a".into(), "b".into()])
        .unwrap();
    let p2: Purgatory<Arc<str>, Op> = Purgatory::new();
    let h2 = p2
        .try_complete_else_watch_levels(Op::new(&ready), ms(100), [Watch::level(Arc::from("a"), 3)])
        .unwrap();
    let p3: Purgatory<Vec<u8>, Op> = Purgatory::new();
    let h3 = p3
        .try_complete_else_watch(Op::new(&ready), ms(100), [b"xy".to_vec()])
        .unwrap();
    let p4: Purgatory<std::path::PathBuf, Op> = Purgatory::new();
    let h4 = p4
        .try_complete_else_watch(Op::new(&ready), ms(100), [std::path::PathBuf::from("/t/p")])
        .unwrap();
    ready.store(true, Ordering::SeqCst);
    assert_eq!(p1.try_complete_watched("b"), 1);
    assert_eq!(p2.try_complete_reached("a", 2), 0);
    assert_eq!(p2.try_complete_reached("a", 3), 1);
    assert_eq!(p3.try_complete_watched(&b"xy"[..]), 1);
    assert_eq!(p4.cancel_for_key(std::path::Path::new("/t/p")).len(), 1);
    assert!(h1.await.unwrap().is_completed());
    assert!(h2.await.unwrap().is_completed());
    assert!(h3.await.unwrap().is_completed());
    assert_eq!(h4.await, Err(OperationError::Cancelled));
    assert_eq!(shape(&p1), (0, 1, 1, 1), "a's tombstone, until walked");
    assert_eq!(p1.try_complete_watched("a"), 0);
    assert_eq!(shape(&p1), (0, 0, 0, 0));
    assert_eq!(shape(&p2), (0, 0, 0, 0));
    assert_eq!(shape(&p3), (0, 0, 0, 0));
    assert_eq!(shape(&p4), (0, 0, 0, 0));
}

/// What the keys of one test share: faults armed in their `Borrow` and in
/// the borrowed form's `Eq`.
#[derive(Default)]
struct KeyFaults {
    borrow_panics: AtomicBool,
    eq_panics: AtomicBool,
    /// Counts down on each borrowed `Eq`; panics when it reaches 1.
    eq_fuse: AtomicUsize,
}

/// A key borrowed as its `Name`.
#[derive(Clone)]
struct Owned {
    name: Name,
}

#[derive(Clone)]
struct Name(String, Arc<KeyFaults>);

impl Hash for Name {
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.0.hash(h);
    }
}

impl PartialEq for Name {
    fn eq(&self, o: &Self) -> bool {
        let faults = &self.1;
        if faults.eq_panics.load(Ordering::SeqCst) {
            panic!("hostile borrowed eq");
        }
        match faults.eq_fuse.load(Ordering::SeqCst) {
            0 => {}
            1 => {
                faults.eq_fuse.store(0, Ordering::SeqCst);
                panic!("hostile borrowed eq, later");
            }
            n => faults.eq_fuse.store(n - 1, Ordering::SeqCst),
        }
        self.0 == o.0
    }
}
impl Eq for Name {}

impl PartialEq for Owned {
    fn eq(&self, o: &Self) -> bool {
        self.name.0 == o.name.0
    }
}
impl Eq for Owned {}
impl Hash for Owned {
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.name.hash(h);
    }
}

impl Borrow<Name> for Owned {
    fn borrow(&self) -> &Name {
        if self.name.1.borrow_panics.load(Ordering::SeqCst) {
            panic!("hostile borrow");
        }
        &self.name
    }
}

/// A key whose `Borrow` (or the borrowed form's `Eq`) panics once armed:
/// "If any of the three panics, the panic reaches the caller ... and the
/// purgatory is left as it was before that call": the walk, the advance or
/// the cancellation by key panics, nothing is changed, and the purgatory
/// goes on working through the shard lock the panic crossed. Once the checks
/// have run, a panic in key code while compacting the list is contained.
#[test]
fn a_panicking_borrow_or_borrowed_eq_changes_nothing() {
    paused_within(30, || async {
        let faults = Arc::new(KeyFaults::default());
        let p: Purgatory<Owned, Op> = Purgatory::builder().watcher_shards(2).build().unwrap();
        let ready = Arc::new(AtomicBool::new(false));
        let o = |s: &str| Owned {
            name: Name(s.to_string(), faults.clone()),
        };
        let n = |s: &str| Name(s.to_string(), faults.clone());
        let h = p
            .try_complete_else_watch(Op::new(&ready), ms(100), [o("a"), o("b")])
            .unwrap();
        ready.store(true, Ordering::SeqCst);
        for flag in [&faults.borrow_panics, &faults.eq_panics] {
            flag.store(true, Ordering::SeqCst);
            let r = catch_unwind(AssertUnwindSafe(|| p.try_complete_watched(&n("a"))));
            assert!(r.is_err());
            let r = catch_unwind(AssertUnwindSafe(|| p.try_complete_reached(&n("a"), 4)));
            assert!(r.is_err());
            let r = catch_unwind(AssertUnwindSafe(|| p.cancel_for_key(&n("b"))));
            assert!(r.is_err());
            flag.store(false, Ordering::SeqCst);
            assert_eq!(shape(&p), (1, 2, 0, 2), "unchanged");
            assert!(!h.is_finished());
        }
        // Still works, through the poisoned shard(s).
        assert_eq!(p.try_complete_watched(&n("a")), 1);
        assert_eq!(h.await, Ok(Completion::Completed(1)));
        assert_eq!(p.try_complete_watched(&o("b")), 0);
        assert_eq!(shape(&p), (0, 0, 0, 0));
        // The walk's second look (its prune) panics.
        let ready2 = Arc::new(AtomicBool::new(false));
        let hs: Vec<_> = (0..4)
            .map(|_| {
                p.try_complete_else_watch(Op::new(&ready2), ms(100), [o("c")])
                    .unwrap()
            })
            .collect();
        ready2.store(true, Ordering::SeqCst);
        let before = p.metrics().panicked;
        faults.eq_fuse.store(2, Ordering::SeqCst);
        let r = catch_unwind(AssertUnwindSafe(|| p.try_complete_watched(&n("c"))));
        faults.eq_fuse.store(0, Ordering::SeqCst);
        assert_eq!(r.ok(), Some(4), "the walk returns its count");
        assert_eq!(p.metrics().panicked, before + 1);
        for h in hs {
            assert_eq!(h.await, Ok(Completion::Completed(1)));
        }
        // Its four tombstones stay for the next walk of "c".
        assert_eq!(shape(&p), (0, 4, 4, 1));
        assert_eq!(p.try_complete_watched(&n("c")), 0);
        assert_eq!(shape(&p), (0, 0, 0, 0));
        assert!(balanced(&p.metrics()));
    });
}

// ---------------------------------------------------------------------------
// Keys that lie.

/// Equal to nothing, itself included: each watch of it makes a key of its
/// own in the map (the map cannot find it again), and walks never find it.
#[derive(Clone, Debug)]
struct Nan(u32);
impl PartialEq for Nan {
    fn eq(&self, _: &Self) -> bool {
        false
    }
}
impl Eq for Nan {}
impl Hash for Nan {
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.0.hash(h);
    }
}

/// "At worst the operations watching it are not found ... and finish by
/// their timeout", and the map still empties when they do.
#[tokio::test(start_paused = true)]
async fn keys_equal_to_nothing_leave_the_map_when_their_operations_go() {
    let p: Purgatory<Nan, Op> = Purgatory::new();
    let never = Arc::new(AtomicBool::new(false));
    let mut handles = Vec::new();
    // The same "key" many times in one registration (few and many), and
    // across registrations.
    let counts = [2usize, 10, 16, 17, 40];
    for n in counts {
        handles.push(
            p.try_complete_else_watch(Op::new(&never), ms(100), (0..n).map(|_| Nan(3)))
                .unwrap(),
        );
    }
    let m = p.metrics();
    let expected: usize = counts.iter().sum();
    assert_eq!(m.watched, expected, "{m:?}");
    assert_eq!(m.keys, expected, "{m:?}");
    assert_eq!(p.try_complete_watched(&Nan(3)), 0);
    assert!(p.cancel_for_key(&Nan(3)).is_empty());
    // Half the registrations cancelled by their handle, the rest expire.
    let (cancel, expire): (Vec<_>, Vec<_>) = handles
        .into_iter()
        .enumerate()
        .partition(|(i, _)| i % 2 == 0);
    drop(cancel);
    advance(ms(101)).await;
    settle().await;
    for (_, h) in expire {
        assert_eq!(h.await, Ok(Completion::Expired(0)));
    }
    assert_eq!(shape(&p), (0, 0, 0, 0), "{:?}", p.metrics());
    assert!(balanced(&p.metrics()));
}

/// A key whose hash changes between calls (it hashes a shared counter).
#[derive(Clone)]
struct Moving(u32, Arc<AtomicU64>);
impl PartialEq for Moving {
    fn eq(&self, o: &Self) -> bool {
        self.0 == o.0
    }
}
impl Eq for Moving {}
impl Hash for Moving {
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.0.hash(h);
        self.1.load(Ordering::SeqCst).hash(h);
    }
}

/// Watchers of a key whose hash moved are not found, finish by their
/// timeout, and the map still empties; a key that moved between two
/// registrations holds two lists of one key, both emptied.
#[tokio::test(start_paused = true)]
async fn keys_whose_hash_moves_leave_the_map_when_their_operations_go() {
    let p: Purgatory<Moving, Op> = Purgatory::new();
    let salt = Arc::new(AtomicU64::new(0));
    let k = |id| Moving(id, salt.clone());
    let never = Arc::new(AtomicBool::new(false));
    let a = p
        .try_complete_else_watch(Op::new(&never), ms(100), [k(1), k(2)])
        .unwrap();
    salt.store(1, Ordering::SeqCst);
    let b = p
        .try_complete_else_watch(Op::new(&never), ms(200), [k(1), k(2)])
        .unwrap();
    assert_eq!(p.metrics().keys, 4, "one key, two lists each");
    // Found under its current hash only.
    assert_eq!(p.cancel_for_key(&k(1)).len(), 1);
    salt.store(7, Ordering::SeqCst);
    assert!(p.cancel_for_key(&k(2)).is_empty());
    advance(ms(201)).await;
    settle().await;
    assert_eq!(a.await, Ok(Completion::Expired(0)));
    assert_eq!(b.await, Err(OperationError::Cancelled));
    assert_eq!(shape(&p), (0, 0, 0, 0), "{:?}", p.metrics());
    assert!(balanced(&p.metrics()));
}

// ---------------------------------------------------------------------------
// Many keys per operation, and the idle map. Tombstones stay "until walked
// or purged (amortised, and at once when an expiry or cancellation ...
// leaves nothing pending)" (README).

/// One operation watching 5,000 keys expires: once nothing is pending the
/// map holds no keys.
#[tokio::test(start_paused = true)]
async fn an_idle_purgatory_after_one_wide_operation_expires_holds_no_keys() {
    let p: Purgatory<u32, Op> = Purgatory::new();
    let never = Arc::new(AtomicBool::new(false));
    let h = p
        .try_complete_else_watch(Op::new(&never), ms(10), 0..5_000)
        .unwrap();
    assert_eq!(shape(&p), (1, 5_000, 0, 5_000));
    assert_eq!(h.await, Ok(Completion::Expired(0)));
    settle().await;
    advance(ms(1000)).await;
    settle().await;
    assert_eq!(
        shape(&p),
        (0, 0, 0, 0),
        "nothing pending, idle: {:?}",
        p.metrics()
    );
}

/// The same with 3,000 single-key operations expiring in one turn.
#[tokio::test(start_paused = true)]
async fn an_idle_purgatory_after_many_expiries_in_one_turn_holds_no_keys() {
    let p: Purgatory<u32, Op> = Purgatory::new();
    let never = Arc::new(AtomicBool::new(false));
    for k in 0..3_000u32 {
        p.try_complete_else_watch(Op::new(&never), ms(10), [k])
            .unwrap()
            .detach();
    }
    advance(ms(11)).await;
    settle().await;
    advance(ms(1000)).await;
    settle().await;
    let m = p.metrics();
    assert_eq!(m.expired, 3_000);
    assert_eq!(
        (m.delayed, m.watched, m.tombstones, m.keys),
        (0, 0, 0, 0),
        "nothing pending, idle: {m:?}"
    );
}

/// The same with one wide operation cancelled by dropping its handle: the
/// dropping thread purges a bounded part, and the reaper's turns the rest,
/// without waking the reaper more than once.
#[tokio::test(start_paused = true)]
async fn an_idle_purgatory_after_one_wide_operation_is_dropped_holds_no_keys() {
    let p: Purgatory<u32, Op> = Purgatory::new();
    let never = Arc::new(AtomicBool::new(false));
    let h = p
        .try_complete_else_watch(Op::new(&never), ms(10_000), 0..5_000)
        .unwrap();
    settle().await;
    let woken = p.metrics().reaper_wakeups;
    drop(h);
    assert!(
        p.metrics().keys < 5_000,
        "the dropping thread purged a part"
    );
    settle().await;
    assert!(
        p.metrics().reaper_wakeups <= woken + 1,
        "one wake-up for the rest: {:?}",
        p.metrics()
    );
    assert_eq!(
        shape(&p),
        (0, 0, 0, 0),
        "nothing pending, idle: {:?}",
        p.metrics()
    );
}

/// 20,000 operations on keys of their own, on a purgatory sharing its
/// reaper with a timer, expire together. The map is purged a bounded part
/// per reaper turn (as the expiries leave as many tombstones as live
/// entries, and once nothing is pending), not whole in one turn (which would
/// hold up the timer for as long): between the reaper's turns the test sees
/// the map being purged over more than one turn; a timer task asked for
/// then runs on the reaper's next turn, before the purge ends; and the map
/// empties.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn an_idle_purge_of_a_large_map_on_a_shared_reaper_is_spread_over_turns() {
    const N: u32 = 20_000;
    let reaper = Reaper::start().unwrap();
    let p: Purgatory<u32, Op> = Purgatory::builder().reaper(&reaper).build().unwrap();
    let timer = Timer::builder().reaper(&reaper).build().unwrap();
    let never = Arc::new(AtomicBool::new(false));
    for k in 0..N {
        p.try_complete_else_watch(Op::new(&never), ms(300), [k])
            .unwrap()
            .detach();
    }
    advance(ms(299)).await;
    settle().await;
    assert_eq!(shape(&p), (N as usize, N as usize, 0, N as usize));
    advance(ms(2)).await;
    // Between the reaper's turns (it lets other tasks run between turns it
    // takes at once): the turns at which the map was seen being purged, and
    // the keys a timer task found when it ran.
    let mut purging_turns = Vec::new();
    let timer_saw_keys = Arc::new(Mutex::new(None));
    let mut asked = false;
    for _ in 0..100_000 {
        let m = p.metrics();
        if m.keys == 0 {
            break;
        }
        // Keys of expired operations taken out: the purge under way.
        if m.keys < N as usize {
            if purging_turns.last() != Some(&m.reaper.turns) {
                purging_turns.push(m.reaper.turns);
            }
            if !asked {
                asked = true;
                let (saw, p) = (timer_saw_keys.clone(), p.clone());
                timer
                    .schedule(Duration::ZERO, move || {
                        *saw.lock().unwrap() = Some(p.metrics().keys);
                    })
                    .unwrap();
            }
        }
        tokio::task::yield_now().await;
    }
    let m = p.metrics();
    assert_eq!(m.expired, N as u64);
    assert_eq!(
        (m.delayed, m.watched, m.tombstones, m.keys),
        (0, 0, 0, 0),
        "nothing pending, after the reaper's turns: {m:?}"
    );
    assert!(
        purging_turns.len() > 1,
        "the purge was seen between {} turns (turns at {:?}): {m:?}",
        purging_turns.len(),
        purging_turns
    );
    let saw = timer_saw_keys.lock().unwrap().take();
    assert!(
        saw.is_some_and(|keys| keys > 0),
        "the timer's task ran during the purge (keys it saw: {saw:?})"
    );
    assert!(balanced(&m));
}

// ---------------------------------------------------------------------------
// The key map under real threads.

/// Counts how often it finished; notes checks of it that overlap.
struct Tracked {
    ready: Arc<AtomicBool>,
    in_check: Arc<AtomicBool>,
    overlaps: Arc<AtomicUsize>,
    finished: Arc<AtomicUsize>,
}

impl Tracked {
    fn new(ready: &Arc<AtomicBool>, overlaps: &Arc<AtomicUsize>) -> (Tracked, Arc<AtomicUsize>) {
        let finished = Arc::new(AtomicUsize::new(0));
        let op = Tracked {
            ready: ready.clone(),
            in_check: Arc::default(),
            overlaps: overlaps.clone(),
            finished: finished.clone(),
        };
        (op, finished)
    }
}

impl Operation for Tracked {
    type Output = ();
    fn try_complete(&mut self) -> Option<()> {
        if self.in_check.swap(true, Ordering::SeqCst) {
            self.overlaps.fetch_add(1, Ordering::SeqCst);
        }
        std::hint::spin_loop();
        let r = self.ready.load(Ordering::SeqCst).then_some(());
        self.in_check.store(false, Ordering::SeqCst);
        if r.is_some() {
            self.finished.fetch_add(1, Ordering::SeqCst);
        }
        r
    }
    fn on_expiration(self) {
        self.finished.fetch_add(1, Ordering::SeqCst);
    }
}

/// Four threads register over six keys (up to twenty watches each, keys
/// repeated, a quarter at levels, now and then a key of their own) on two
/// shards, and walk, advance and cancel by key as they go: no checks of one
/// operation overlap, none finishes twice, the counts balance, and once the
/// rest are completed or handed back the map is empty.
#[test]
fn threads_on_a_tiny_key_space_finish_each_once_and_empty_the_map() {
    within(60, || {
        let rt = support::multi();
        let _in = rt.enter();
        let p: Purgatory<u32, Tracked> = Purgatory::builder()
            .watcher_shards(2)
            .purge_interval(10)
            .build()
            .unwrap();
        let overlaps = Arc::new(AtomicUsize::new(0));
        let ready = Arc::new(AtomicBool::new(false));
        let threads: Vec<_> = (0..4u32)
            .map(|t| {
                let p = p.clone();
                let overlaps = overlaps.clone();
                let ready = ready.clone();
                std::thread::spawn(move || {
                    let mut rng = Rng(0x9E37_79B9 ^ u64::from(t));
                    let mut out = Vec::new();
                    for i in 0..3_000u32 {
                        let n = 1 + rng.below(20);
                        let mut watches: Vec<Watch<u32>> = (0..n)
                            .map(|_| {
                                let k = rng.below(6) as u32;
                                if rng.below(4) == 0 {
                                    Watch::level(k, rng.below(8))
                                } else {
                                    Watch::key(k)
                                }
                            })
                            .collect();
                        if i % 7 == 0 {
                            watches.push(Watch::key(1_000 + t * 10_000 + i));
                        }
                        let (op, finished) = Tracked::new(&ready, &overlaps);
                        let h = p
                            .try_complete_else_watch_levels(op, Duration::from_secs(3600), watches)
                            .unwrap();
                        match rng.below(6) {
                            0 => {
                                h.detach();
                                p.try_complete_watched(&(rng.below(6) as u32));
                            }
                            1 => {
                                h.detach();
                                p.try_complete_reached(&(rng.below(6) as u32), rng.below(10));
                            }
                            2 => {
                                h.detach();
                                drop(p.cancel_for_key(&(rng.below(6) as u32)));
                            }
                            3 => drop(h.cancel()),
                            _ => h.detach(),
                        }
                        if i % 500 == 0 {
                            ready.store(i % 1000 == 0, Ordering::SeqCst);
                        }
                        out.push(finished);
                    }
                    out
                })
            })
            .collect();
        let mut all = Vec::new();
        for t in threads {
            all.extend(t.join().unwrap());
        }
        // Finish the rest: everything ready, walk and advance every key.
        ready.store(true, Ordering::SeqCst);
        for k in 0..6u32 {
            p.try_complete_watched(&k);
            p.try_complete_reached(&k, u64::MAX);
        }
        let handed = p.shutdown().len();
        let m = p.metrics();
        assert_eq!(overlaps.load(Ordering::SeqCst), 0, "checks overlapped");
        for f in &all {
            assert!(f.load(Ordering::SeqCst) <= 1, "finished twice");
        }
        assert!(balanced(&m), "{m:?}");
        assert_eq!(m.delayed, 0, "{m:?}");
        assert_eq!(
            (m.watched, m.tombstones, m.keys),
            (0, 0, 0),
            "handed back {handed}: {m:?}"
        );
    });
}

/// One operation watching one key plainly, at two levels, and duplicated:
/// `cancel_for_key` hands it back once, and leaves nothing behind.
#[tokio::test(start_paused = true)]
async fn cancel_for_key_hands_back_an_operation_on_the_key_three_ways_once() {
    let p: Purgatory<u32, Tracked> = Purgatory::new();
    let (op, finished) = Tracked::new(&Arc::default(), &Arc::default());
    let h = p
        .try_complete_else_watch_levels(
            op,
            Duration::from_secs(10),
            [
                Watch::key(1),
                Watch::level(1, 5),
                Watch::key(1),
                Watch::level(1, 9),
                Watch::key(2),
            ],
        )
        .unwrap();
    let m = p.metrics();
    assert_eq!((m.watched, m.keys), (4, 2), "{m:?}");
    let back = p.cancel_for_key(&1);
    assert_eq!(back.len(), 1);
    drop(back);
    assert_eq!(h.await, Err(OperationError::Cancelled));
    assert_eq!(finished.load(Ordering::SeqCst), 0, "handed back, not run");
    let m = p.metrics();
    assert_eq!(
        (m.delayed, m.watched, m.tombstones, m.keys),
        (0, 0, 0, 0),
        "{m:?}"
    );
    assert!(balanced(&m));
}

/// The reaper's runtime goes while the reaper is left the rest of an idle
/// purge: the purgatory is closed (its reaper lost), and a closed purgatory
/// is purged whole at once, with nothing further asked of it.
#[test]
fn a_reaper_lost_during_an_idle_purge_leaves_no_keys() {
    within(60, || {
        let rt = support::paused();
        let p: Purgatory<u32, support::FlagOp> =
            Purgatory::builder().build_on(rt.handle()).unwrap();
        rt.block_on(async {
            let h = p
                .try_complete_else_watch(
                    support::FlagOp(Arc::new(AtomicBool::new(false))),
                    ms(10_000),
                    0..20_000,
                )
                .unwrap();
            settle().await;
            // Cancelled off the reaper: a bounded part here, the rest left.
            drop(h);
            // One reaper turn, then the runtime goes.
            tokio::task::yield_now().await;
            tokio::task::yield_now().await;
        });
        let before = p.metrics();
        assert!(before.keys > 0 && before.keys < 20_000, "{before:?}");
        drop(rt);
        assert!(p.is_shutdown());
        let m = p.metrics();
        assert_eq!(
            (m.delayed, m.watched, m.tombstones, m.keys),
            (0, 0, 0, 0),
            "{m:?}"
        );
    });
}
