//! The watcher map: watch key -> operations watching it (many to many).
//!
//! Sharded by key hash; each shard is a `Mutex<HashMap<K, Vec<V>>>` and the
//! number of entries its lists hold. The map keeps that count itself, changed
//! under the shard's lock by the call that adds or removes entries, so callers
//! never pair their changes with a count of their own; [`Watchers::len`] sums
//! the shards.
//!
//! # Ground rules
//!
//! - **What runs under a shard lock.** Our own bookkeeping, plus the key's `Eq`
//!   (to find its list) and, when a key is first watched, its `Clone` (the map
//!   keeps its own copy). Those two are user code and must not call back into the
//!   purgatory. A key's `Hash` runs once per call, before any lock is taken: the
//!   map stores each key with its hash and never hashes a stored key again (not
//!   even to grow or shrink its table). Nothing else of the user's runs here: no
//!   operation code and **no drop of a user value**. Every method that removes
//!   entries or keys moves them out into a [`Removed`] that the caller drops after
//!   the lock is released, because the last reference to an operation's cell, or
//!   the map's copy of a key, may own user data whose `Drop` calls back in.
//! - **Panics.** A panic in key code under a lock leaves the map as it was before
//!   the call that panicked (each method changes the map only after the key code it
//!   needs has returned), and the lock is recovered from poisoning.
//! - **Empty keys.** A key whose list becomes empty is removed in the same critical
//!   section that emptied it, so it cannot race a concurrent watch of the same key.

use std::borrow::Borrow;
use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::{BuildHasher, BuildHasherDefault, Hash, Hasher};
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::loom::{lock, Mutex, MutexGuard};

/// A shard's map: each key's list.
type Lists<K, V> = HashMap<Hashed<K>, Vec<V>, BuildHasherDefault<PassThrough>>;

/// A stored key with its hash, computed once by the map's hasher.
#[derive(Debug)]
struct Hashed<K> {
    hash: u64,
    key: K,
}

/// Hands the stored hash to the table unchanged.
#[derive(Debug, Default)]
struct PassThrough(u64);

impl Hasher for PassThrough {
    fn write(&mut self, _: &[u8]) {
        unreachable!("only precomputed hashes are written");
    }

    fn write_u64(&mut self, hash: u64) {
        self.0 = hash;
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

impl<K> Hash for Hashed<K> {
    fn hash<H: Hasher>(&self, h: &mut H) {
        h.write_u64(self.hash);
    }
}

impl<K: Eq> PartialEq for Hashed<K> {
    fn eq(&self, other: &Self) -> bool {
        self.hash == other.hash && self.key == other.key
    }
}

impl<K: Eq> Eq for Hashed<K> {}

/// What a lookup compares: a hash and a key, stored (`Hashed`) or borrowed
/// (`Probe`). The table finds lists through `dyn Lookup`, which a stored key
/// lends itself as, so a lookup needs neither an owned key nor a second hash.
trait Lookup<Q: ?Sized> {
    fn hash(&self) -> u64;
    fn key(&self) -> &Q;
}

impl<K: Borrow<Q>, Q: ?Sized> Lookup<Q> for Hashed<K> {
    fn hash(&self) -> u64 {
        self.hash
    }
    fn key(&self) -> &Q {
        self.key.borrow()
    }
}

/// A key looked up by reference, with its hash.
struct Probe<'a, Q: ?Sized> {
    hash: u64,
    key: &'a Q,
}

impl<Q: ?Sized> Lookup<Q> for Probe<'_, Q> {
    fn hash(&self) -> u64 {
        self.hash
    }
    fn key(&self) -> &Q {
        self.key
    }
}

impl<'a, K: Borrow<Q> + 'a, Q: ?Sized + 'a> Borrow<dyn Lookup<Q> + 'a> for Hashed<K> {
    fn borrow(&self) -> &(dyn Lookup<Q> + 'a) {
        self
    }
}

impl<Q: ?Sized> Hash for dyn Lookup<Q> + '_ {
    fn hash<H: Hasher>(&self, h: &mut H) {
        h.write_u64(Lookup::hash(self));
    }
}

impl<Q: ?Sized + Eq> PartialEq for dyn Lookup<Q> + '_ {
    fn eq(&self, other: &Self) -> bool {
        Lookup::hash(self) == Lookup::hash(other) && self.key() == other.key()
    }
}

impl<Q: ?Sized + Eq> Eq for dyn Lookup<Q> + '_ {}

/// One shard, on its own cache lines: its map, and the entries its lists hold
/// (changed only with the map's lock held; read without it).
#[derive(Debug)]
#[repr(align(128))]
struct Shard<K, V> {
    map: Mutex<Lists<K, V>>,
    entries: AtomicUsize,
}

impl<K, V> Shard<K, V> {
    fn added(&self, n: usize) {
        self.entries.fetch_add(n, Ordering::Relaxed);
    }

    fn removed(&self, n: usize) {
        self.entries.fetch_sub(n, Ordering::Relaxed);
    }
}

#[derive(Debug)]
pub(crate) struct Watchers<K, V> {
    shards: Box<[Shard<K, V>]>,
    hasher: RandomState,
}

pub(crate) use crate::watchers_common::Removed;

impl<K: Hash + Eq + Clone, V: Clone> Watchers<K, V> {
    pub(crate) fn new(shards: usize) -> Self {
        Watchers {
            shards: (0..shards.max(1))
                .map(|_| Shard {
                    map: Mutex::new(HashMap::default()),
                    entries: AtomicUsize::new(0),
                })
                .collect(),
            hasher: RandomState::new(),
        }
    }

    /// The key's hash (its `Hash`, run here with no lock held), and its shard,
    /// locked. The shard is picked by high bits of the hash; the table uses the
    /// low bits and the top seven.
    fn shard<Q: Hash + ?Sized>(&self, key: &Q) -> (u64, &Shard<K, V>, MutexGuard<'_, Lists<K, V>>) {
        let hash = self.hasher.hash_one(key);
        let shard = &self.shards[((hash >> 32) % self.shards.len() as u64) as usize];
        (hash, shard, lock(&shard.map))
    }

    /// Watch-list entries held, tombstones included. Sums the shards: exact when
    /// no call races it.
    pub(crate) fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.entries.load(Ordering::Relaxed))
            .sum()
    }

    /// Appends `v` to the list of every key, counting in `added` the lists it
    /// joined, so that a panic in key code part-way leaves a known count behind.
    pub(crate) fn watch<'k>(&self, keys: impl IntoIterator<Item = &'k K>, v: &V, added: &mut usize)
    where
        K: 'k,
    {
        for key in keys {
            let (hash, shard, mut map) = self.shard(key);
            match map.get_mut(&Probe { hash, key } as &dyn Lookup<K>) {
                Some(list) => list.push(v.clone()),
                None => {
                    // Clone before inserting: a panicking clone leaves the map as it was.
                    let own = Hashed {
                        hash,
                        key: key.clone(),
                    };
                    map.insert(own, vec![v.clone()]);
                }
            }
            shard.added(1);
            drop(map);
            *added += 1;
        }
    }

    /// Copies `key`'s entries that are not `finished` into `out`, and takes the finished
    /// ones out of the list (and the key, if nothing is left) into `removed`.
    pub(crate) fn collect_live<Q: Hash + Eq + ?Sized>(
        &self,
        key: &Q,
        out: &mut Vec<V>,
        finished: impl Fn(&V) -> bool,
        removed: &mut Removed<K, V>,
    ) where
        K: Borrow<Q>,
    {
        self.retain(key, finished, |v| out.push(v.clone()), removed)
    }

    /// Takes `key`'s finished entries out into `removed`.
    pub(crate) fn prune<Q: Hash + Eq + ?Sized>(
        &self,
        key: &Q,
        finished: impl Fn(&V) -> bool,
        removed: &mut Removed<K, V>,
    ) where
        K: Borrow<Q>,
    {
        self.retain(key, finished, |_| {}, removed)
    }

    /// Takes `key`'s finished entries out, showing each kept one to `kept`, and removes
    /// the key when its list empties (in the same critical section, so a concurrent
    /// watch of the key cannot be lost).
    fn retain<Q: Hash + Eq + ?Sized>(
        &self,
        key: &Q,
        finished: impl Fn(&V) -> bool,
        mut kept: impl FnMut(&V),
        removed: &mut Removed<K, V>,
    ) where
        K: Borrow<Q>,
    {
        let (hash, shard, mut map) = self.shard(key);
        let probe = Probe { hash, key };
        let Some(list) = map.get_mut(&probe as &dyn Lookup<Q>) else {
            return;
        };
        let before = removed.entries.len();
        removed.entries.extend(list.extract_if(.., |v| {
            let gone = finished(v);
            if !gone {
                kept(v);
            }
            gone
        }));
        shard.removed(removed.entries.len() - before);
        if list.is_empty() {
            if let Some((k, _)) = map.remove_entry(&probe as &dyn Lookup<Q>) {
                removed.keys.push(k.key);
            }
            shrink_if_sparse(&mut map);
        }
    }

    /// Removes `key` with its whole list, into `removed`.
    pub(crate) fn take<Q: Hash + Eq + ?Sized>(&self, key: &Q, removed: &mut Removed<K, V>)
    where
        K: Borrow<Q>,
    {
        let (hash, shard, mut map) = self.shard(key);
        if let Some((k, list)) = map.remove_entry(&Probe { hash, key } as &dyn Lookup<Q>) {
            shard.removed(list.len());
            removed.keys.push(k.key);
            removed.entries.extend(list);
            shrink_if_sparse(&mut map);
        }
    }

    /// Takes every finished entry of every key out (and the keys left empty), one
    /// shard at a time; `drop_batch` receives each shard's haul once that shard's
    /// lock is released.
    pub(crate) fn purge(
        &self,
        finished: impl Fn(&V) -> bool,
        mut drop_batch: impl FnMut(Removed<K, V>),
    ) {
        for shard in self.shards.iter() {
            let mut removed = Removed::default();
            {
                let mut map = lock(&shard.map);
                let entries = &mut removed.entries;
                let emptied = map.extract_if(|_, list| {
                    entries.extend(list.extract_if(.., |v| finished(v)));
                    list.is_empty()
                });
                removed.keys.extend(emptied.map(|(k, _)| k.key));
                shard.removed(removed.entries.len());
                shrink_if_sparse(&mut map);
            }
            if !removed.entries.is_empty() || !removed.keys.is_empty() {
                drop_batch(removed);
            }
        }
    }

    /// Removes every list (shutdown), into `removed`.
    pub(crate) fn drain(&self, removed: &mut Removed<K, V>) {
        for shard in self.shards.iter() {
            let map = {
                let mut map = lock(&shard.map);
                shard.entries.store(0, Ordering::Relaxed);
                std::mem::take(&mut *map)
            };
            for (k, list) in map {
                removed.keys.push(k.key);
                removed.entries.extend(list);
            }
        }
    }

    /// Number of keys with a list.
    pub(crate) fn keys(&self) -> usize {
        self.shards.iter().map(|s| lock(&s.map).len()).sum()
    }
}

/// Gives back most of a shard's table once it has far more room than keys (a
/// burst of keys has passed), so the map's memory follows the live key count, not
/// its peak. It shrinks to twice the length: the map can grow again without a
/// resize, and the next shrink waits until it loses most of its keys again, so
/// each rehash is paid for by the removals before it (amortised O(1)).
///
/// Rehashing uses the stored hashes: no user code runs.
fn shrink_if_sparse<K: Eq, V>(map: &mut Lists<K, V>) {
    if map.capacity() > 64 && map.len() * 8 < map.capacity() {
        map.shrink_to(map.len() * 2);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn capacity<K: Hash + Eq + Clone>(w: &Watchers<K, u32>) -> usize {
        w.shards.iter().map(|s| lock(&s.map).capacity()).sum()
    }

    fn take(w: &Watchers<u32, u32>, k: u32) -> Vec<u32> {
        let mut r = Removed::default();
        w.take(&k, &mut r);
        r.entries
    }

    #[test]
    fn table_follows_the_live_key_count_not_its_peak() {
        let w: Watchers<u32, u32> = Watchers::new(4);
        for k in 0..100_000 {
            w.watch(&[k], &k, &mut 0);
        }
        let peak = capacity(&w);
        assert!(peak >= 100_000);
        // Walk all but 100 keys away, half by pruning and half by taking.
        for k in 100..100_000 {
            if k % 2 == 0 {
                let mut r = Removed::default();
                w.prune(&k, |_| true, &mut r);
                assert_eq!((r.entries, r.keys), (vec![k], vec![k]));
            } else {
                assert_eq!(take(&w, k), vec![k]);
            }
        }
        assert_eq!(w.keys(), 100);
        let left = capacity(&w);
        assert!(
            left <= 100 * 8,
            "capacity {left} for 100 keys (peak {peak})"
        );
        // The survivors are intact and the map still works.
        for k in 0..100 {
            assert_eq!(take(&w, k), vec![k]);
        }
        assert_eq!(w.keys(), 0);
        w.watch(&[7], &7, &mut 0);
        assert_eq!(take(&w, 7), vec![7]);
    }

    /// Shrinking has hysteresis: removing keys one at a time rehashes a handful
    /// of times in all, not on every removal.
    #[test]
    fn the_table_shrinks_in_a_few_steps_not_on_every_removal() {
        let w: Watchers<u32, u32> = Watchers::new(1);
        for k in 0..20_000 {
            w.watch(&[k], &k, &mut 0);
        }
        let mut changes = 0;
        let mut cap = capacity(&w);
        for k in 0..20_000 {
            take(&w, k);
            // A removal that leaves a deleted-slot marker lowers the capacity by
            // one; a rehash moves it by far more.
            let now = capacity(&w);
            if now.abs_diff(cap) > 1 {
                changes += 1;
            }
            cap = now;
        }
        assert!(changes >= 2, "the table never shrank ({cap})");
        assert!(changes <= 12, "{changes} rehashes for 20,000 removals");
        assert!(cap <= 64, "capacity {cap} with no keys");
    }

    /// A key's `Hash` runs once per call that names it, never for keys already
    /// stored: growing and shrinking the table reuse the stored hashes.
    #[test]
    fn stored_keys_are_never_hashed_again() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static HASHES: AtomicUsize = AtomicUsize::new(0);
        #[derive(Clone, PartialEq, Eq, Debug)]
        struct K(u32);
        impl Hash for K {
            fn hash<H: Hasher>(&self, h: &mut H) {
                HASHES.fetch_add(1, Ordering::SeqCst);
                self.0.hash(h);
            }
        }
        let w: Watchers<K, u32> = Watchers::new(1);
        for k in 0..5_000 {
            w.watch(&[K(k)], &k, &mut 0);
        }
        assert_eq!(HASHES.load(Ordering::SeqCst), 5_000, "growth re-hashed");
        for k in 0..4_990 {
            let mut r = Removed::default();
            w.take(&K(k), &mut r);
        }
        assert_eq!(HASHES.load(Ordering::SeqCst), 9_990, "shrinking re-hashed");
        assert!(capacity(&w) < 5_000 / 8, "the table did shrink");
    }

    #[test]
    fn purge_shrinks_the_table_too() {
        let w: Watchers<u32, u32> = Watchers::new(2);
        for k in 0..50_000 {
            w.watch(&[k], &k, &mut 0);
        }
        let mut removed = 0;
        let mut keys = 0;
        w.purge(
            |v| *v >= 10,
            |r| {
                removed += r.entries.len();
                keys += r.keys.len();
            },
        );
        assert_eq!((removed, keys), (49_990, 49_990));
        assert_eq!(w.keys(), 10);
        assert!(capacity(&w) <= 10 * 8, "capacity {}", capacity(&w));
    }

    #[test]
    fn a_walk_keeps_live_entries_and_hands_out_done_ones() {
        let w: Watchers<u32, u32> = Watchers::new(1);
        for v in 0..10 {
            w.watch(&[1], &v, &mut 0);
        }
        let mut live = Vec::new();
        let mut r = Removed::default();
        w.collect_live(&1, &mut live, |v| v % 2 == 0, &mut r);
        assert_eq!(live, vec![1, 3, 5, 7, 9], "in watch order");
        assert_eq!(r.entries, vec![0, 2, 4, 6, 8]);
        assert!(r.keys.is_empty(), "the key still has live entries");
        let mut r = Removed::default();
        w.prune(&1, |_| true, &mut r);
        assert_eq!((r.entries.len(), r.keys), (5, vec![1]));
        assert_eq!(w.keys(), 0);
    }

    #[test]
    fn watch_counts_the_lists_it_joined_when_a_key_panics() {
        #[derive(PartialEq, Eq, Debug)]
        struct K(u32);
        impl Hash for K {
            fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
                assert_ne!(self.0, 3, "hostile hash");
                self.0.hash(h);
            }
        }
        impl Clone for K {
            fn clone(&self) -> Self {
                K(self.0)
            }
        }
        let w: Watchers<K, u32> = Watchers::new(4);
        let mut added = 0;
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            w.watch(&[K(1), K(2), K(3), K(4)], &7, &mut added)
        }));
        assert!(r.is_err());
        assert_eq!(added, 2);
        assert_eq!(w.keys(), 2);
    }
}
