//! A purgatory with a hasher of the user's choice: lookups by borrowed keys,
//! every key colliding, one hash per key per call, and a hasher that panics.

mod support;

use std::hash::{BuildHasher, Hasher};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::time::advance;
use tokio_purgatory::{Completion, Operation, OperationError, Purgatory};

use support::{balanced, ms, settle};

/// Completes once its flag is set.
struct Ready(Arc<AtomicBool>);

impl Operation for Ready {
    type Output = &'static str;
    fn try_complete(&mut self) -> Option<&'static str> {
        self.0.load(Ordering::SeqCst).then_some("done")
    }
    fn on_expiration(self) -> &'static str {
        "expired"
    }
}

/// FNV-1a that counts the hashers it builds, can make every key collide, and
/// panics on a poisoned byte sequence.
#[derive(Clone, Default)]
struct Counting {
    built: Arc<AtomicUsize>,
    collide: bool,
}

struct Fnv {
    state: u64,
    collide: bool,
}

impl BuildHasher for Counting {
    type Hasher = Fnv;
    fn build_hasher(&self) -> Fnv {
        self.built.fetch_add(1, Ordering::SeqCst);
        Fnv {
            state: 0xcbf2_9ce4_8422_2325,
            collide: self.collide,
        }
    }
}

impl Hasher for Fnv {
    fn write(&mut self, bytes: &[u8]) {
        if bytes == b"poison" {
            panic!("hostile hasher");
        }
        for b in bytes {
            self.state = (self.state ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    fn finish(&self) -> u64 {
        if self.collide {
            7
        } else {
            self.state
        }
    }
}

#[tokio::test(start_paused = true)]
async fn string_keys_are_found_by_str_with_the_chosen_hasher() {
    let hasher = Counting::default();
    let built = hasher.built.clone();
    let p: Purgatory<String, Ready, Counting> = Purgatory::builder()
        .name("join")
        .hasher(hasher)
        .build()
        .unwrap();
    let flag = Arc::new(AtomicBool::new(false));
    let keys = ["group-a", "group-b", "group-c"].map(String::from);
    let h = p
        .try_complete_else_watch(Ready(flag.clone()), ms(100), keys)
        .unwrap();
    assert_eq!(built.swap(0, Ordering::SeqCst), 3, "one hash per key");
    assert_eq!(p.watched(), 3);
    assert_eq!(p.try_complete_watched("group-b"), 0, "not ready yet");
    assert_eq!(built.swap(0, Ordering::SeqCst), 1, "one hash per walk");
    flag.store(true, Ordering::SeqCst);
    assert_eq!(p.try_complete_watched("group-c"), 1);
    assert_eq!(h.await, Ok(Completion::Completed("done")));
    assert_eq!(p.try_complete_watched("nobody"), 0);
    assert!(balanced(&p.metrics()));
}

#[tokio::test(start_paused = true)]
async fn keys_that_all_collide_stay_apart() {
    let p: Purgatory<u64, Ready, Counting> = Purgatory::with_hasher(Counting {
        collide: true,
        ..Counting::default()
    });
    let flags: Vec<_> = (0..50).map(|_| Arc::new(AtomicBool::new(false))).collect();
    let handles: Vec<_> = (0..50u64)
        .map(|k| {
            p.try_complete_else_watch(Ready(flags[k as usize].clone()), ms(100), [k, k + 1000])
                .unwrap()
        })
        .collect();
    assert_eq!(p.watched(), 100);
    for k in (0..50u64).step_by(2) {
        flags[k as usize].store(true, Ordering::SeqCst);
        // Walking a neighbour's key (same hash, other key) completes nothing.
        assert_eq!(p.try_complete_watched(&(k + 1)), 0);
        assert_eq!(p.try_complete_watched(&(k + 1000)), 1);
    }
    assert_eq!(p.cancel_for_key(&1001).len(), 1, "the one watching 1001");
    advance(ms(101)).await;
    settle().await;
    for (k, h) in handles.into_iter().enumerate() {
        let got = h.await;
        match k {
            1 => assert_eq!(got, Err(OperationError::Cancelled)),
            k if k % 2 == 0 => assert_eq!(got, Ok(Completion::Completed("done"))),
            _ => assert_eq!(got, Ok(Completion::Expired("expired"))),
        }
    }
    assert!(balanced(&p.metrics()));
}

/// The hasher panics on one key: the panic reaches the caller of that call,
/// and the purgatory is as it was (the operation is dropped, not half
/// registered), as when a key's own `Hash` panics.
#[tokio::test(start_paused = true)]
async fn a_panicking_hasher_leaves_the_purgatory_as_it_was() {
    let p: Purgatory<&'static str, Ready, Counting> = Purgatory::with_hasher(Counting::default());
    let flag = Arc::new(AtomicBool::new(true));
    let not_yet = Arc::new(AtomicBool::new(false));
    let r = catch_unwind(AssertUnwindSafe(|| {
        let _ = p.try_complete_else_watch(Ready(not_yet.clone()), ms(10), ["fine", "poison"]);
    }));
    assert!(r.is_err(), "the hasher's panic reaches the caller");
    let m = p.metrics();
    // Every key is hashed before anything is watched: nothing was made under
    // "fine" either.
    assert_eq!((m.delayed, m.watched, m.tombstones), (0, 0, 0), "{m:?}");
    assert!(balanced(&m), "{m:?}");
    assert_eq!(p.try_complete_watched("fine"), 0);
    assert_eq!(p.metrics().watched, 0);
    let r = catch_unwind(AssertUnwindSafe(|| p.try_complete_watched("poison")));
    assert!(r.is_err());
    // Still works.
    let h = p
        .try_complete_else_watch(Ready(not_yet.clone()), ms(10), ["fine"])
        .unwrap();
    not_yet.store(true, Ordering::SeqCst);
    assert_eq!(p.try_complete_watched("fine"), 1);
    assert_eq!(h.await, Ok(Completion::Completed("done")));
    let ready = p
        .try_complete_else_watch(Ready(flag), ms(10), ["fine"])
        .unwrap();
    assert_eq!(ready.await, Ok(Completion::Completed("done")));
    advance(ms(20)).await;
    settle().await;
    assert!(balanced(&p.metrics()));
}

/// A walk that completes enough of a key's watchers to prune its list at once
/// looks the list up twice (the checks run with no lock held between), and
/// hashes the key once: the prune finds the list by the walk's hash. So do
/// level advances, cancellations by key and walks that complete nothing.
#[tokio::test(start_paused = true)]
async fn a_walk_that_prunes_its_list_hashes_the_key_once() {
    let hasher = Counting::default();
    let built = hasher.built.clone();
    let p: Purgatory<&'static str, Ready, Counting> = Purgatory::with_hasher(hasher);
    let flag = Arc::new(AtomicBool::new(false));
    let handles: Vec<_> = (0..4)
        .map(|_| {
            p.try_complete_else_watch(Ready(flag.clone()), ms(100), ["hot"])
                .unwrap()
        })
        .collect();
    assert_eq!(
        built.swap(0, Ordering::SeqCst),
        4,
        "one hash per registration"
    );
    assert_eq!(p.try_complete_watched("hot"), 0);
    assert_eq!(
        built.swap(0, Ordering::SeqCst),
        1,
        "a walk completing nothing"
    );
    flag.store(true, Ordering::SeqCst);
    assert_eq!(p.try_complete_watched("hot"), 4);
    assert_eq!(built.swap(0, Ordering::SeqCst), 1, "a walk that prunes");
    assert_eq!(
        p.watched(),
        0,
        "the prune did run: the list and key are gone"
    );
    for h in handles {
        assert_eq!(h.await, Ok(Completion::Completed("done")));
    }
    p.try_complete_else_watch(Ready(Arc::new(AtomicBool::new(false))), ms(100), ["cold"])
        .unwrap()
        .detach();
    built.swap(0, Ordering::SeqCst);
    assert_eq!(p.try_complete_reached("cold", 5), 0);
    assert_eq!(built.swap(0, Ordering::SeqCst), 1, "a level advance");
    assert_eq!(p.cancel_for_key("cold").len(), 1);
    assert_eq!(built.swap(0, Ordering::SeqCst), 1, "a cancellation by key");
    assert!(balanced(&p.metrics()));
}

/// A key that counts the times its `Hash` runs.
#[derive(Clone)]
struct Counted(u32, Arc<AtomicUsize>);

impl PartialEq for Counted {
    fn eq(&self, o: &Self) -> bool {
        self.0 == o.0
    }
}

impl Eq for Counted {}

impl std::hash::Hash for Counted {
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.1.fetch_add(1, Ordering::SeqCst);
        self.0.hash(h);
    }
}

/// Past 16 keys, a registration finds duplicates by the hashes it computes for
/// the watcher map: no key's `Hash` runs twice (it used to run once more, for
/// a separate de-duplication set). A few keys: duplicates are found with `Eq`
/// and never hashed.
#[tokio::test(start_paused = true)]
async fn a_registration_hashes_each_key_it_is_given_once() {
    let hashes = Arc::new(AtomicUsize::new(0));
    let key = |k: u32| Counted(k, hashes.clone());
    let p: Purgatory<Counted, Ready> = Purgatory::new();
    let never = Arc::new(AtomicBool::new(false));
    for n in [3u32, 16, 17, 40, 300] {
        hashes.store(0, Ordering::SeqCst);
        let h = p
            .try_complete_else_watch(Ready(never.clone()), ms(10), (0..n).map(key))
            .unwrap();
        assert_eq!(
            hashes.load(Ordering::SeqCst),
            n as usize,
            "{n} distinct keys"
        );
        assert_eq!(p.cancel_for_key(&key(0)).len(), 1);
        drop(h);
    }
    // Duplicates among a few keys are found with `Eq`, unhashed.
    hashes.store(0, Ordering::SeqCst);
    p.try_complete_else_watch(Ready(never.clone()), ms(10), [1, 2, 1, 2, 3].map(key))
        .unwrap()
        .detach();
    assert_eq!(hashes.load(Ordering::SeqCst), 3);
    // Past 16, each key given is hashed once, duplicates included, and the
    // duplicates are still dropped: 40 distinct keys watched.
    hashes.store(0, Ordering::SeqCst);
    let before = p.watched();
    p.try_complete_else_watch(Ready(never.clone()), ms(10), (0..40).chain(0..10).map(key))
        .unwrap()
        .detach();
    assert_eq!(hashes.load(Ordering::SeqCst), 50);
    assert_eq!(p.watched() - before, 40);
    advance(ms(11)).await;
    settle().await;
    assert!(balanced(&p.metrics()));
}
