//! The watcher map: watch key -> operations watching it (many to many).
//!
//! Sharded by key hash; each shard is a `Mutex<HashMap<K, Vec<V>>>`. A list is
//! only ever locked to copy, append or prune entries: no user code runs under a
//! shard lock (the purgatory copies a key's live entries out, then checks them).
//! A key whose list becomes empty is removed in the same critical section that
//! emptied it, so it cannot race a concurrent watch of the same key.

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::{BuildHasher, Hash};
use std::sync::{Mutex, MutexGuard};

#[derive(Debug)]
#[repr(align(128))]
struct Shard<K, V>(Mutex<HashMap<K, Vec<V>>>);

#[derive(Debug)]
pub(crate) struct Watchers<K, V> {
    shards: Box<[Shard<K, V>]>,
    hasher: RandomState,
}

impl<K: Hash + Eq + Clone, V: Clone> Watchers<K, V> {
    pub(crate) fn new(shards: usize) -> Self {
        Watchers {
            shards: (0..shards.max(1))
                .map(|_| Shard(Mutex::new(HashMap::new())))
                .collect(),
            hasher: RandomState::new(),
        }
    }

    fn shard(&self, key: &K) -> MutexGuard<'_, HashMap<K, Vec<V>>> {
        let i = (self.hasher.hash_one(key) % self.shards.len() as u64) as usize;
        lock(&self.shards[i].0)
    }

    /// Appends `v` to the list of every key.
    pub(crate) fn watch(&self, keys: &[K], v: &V) {
        for key in keys {
            self.shard(key)
                .entry(key.clone())
                .or_default()
                .push(v.clone());
        }
    }

    /// Copies `key`'s entries that are not `done` into `out`, and drops the done
    /// ones from the list (removing the key if nothing is left). Returns how many
    /// entries were dropped.
    pub(crate) fn collect_live(
        &self,
        key: &K,
        out: &mut Vec<V>,
        done: impl Fn(&V) -> bool,
    ) -> usize {
        self.retain(key, done, |v| out.push(v.clone()))
    }

    /// Drops `key`'s done entries. Returns how many.
    pub(crate) fn prune(&self, key: &K, done: impl Fn(&V) -> bool) -> usize {
        self.retain(key, done, |_| {})
    }

    /// Drops `key`'s done entries, showing each kept one to `kept`, and removes the
    /// key when its list empties (in the same critical section, so a concurrent
    /// watch of the key cannot be lost). Returns how many were dropped.
    fn retain(&self, key: &K, done: impl Fn(&V) -> bool, mut kept: impl FnMut(&V)) -> usize {
        let mut map = self.shard(key);
        let Some(list) = map.get_mut(key) else {
            return 0;
        };
        let before = list.len();
        list.retain(|v| {
            let keep = !done(v);
            if keep {
                kept(v);
            }
            keep
        });
        let dropped = before - list.len();
        if list.is_empty() {
            map.remove(key);
            shrink_if_sparse(&mut map);
        }
        dropped
    }

    /// Removes `key` and returns its whole list.
    pub(crate) fn take(&self, key: &K) -> Vec<V> {
        let mut map = self.shard(key);
        let list = map.remove(key).unwrap_or_default();
        shrink_if_sparse(&mut map);
        list
    }

    /// Drops every done entry of every key. Returns how many.
    pub(crate) fn purge(&self, done: impl Fn(&V) -> bool) -> usize {
        let mut dropped = 0;
        for shard in self.shards.iter() {
            let mut map = lock(&shard.0);
            map.retain(|_, list| {
                let before = list.len();
                list.retain(|v| !done(v));
                dropped += before - list.len();
                !list.is_empty()
            });
            shrink_if_sparse(&mut map);
        }
        dropped
    }

    /// Removes every list, returning all entries (shutdown).
    pub(crate) fn drain(&self) -> Vec<V> {
        let mut out = Vec::new();
        for shard in self.shards.iter() {
            let map = std::mem::take(&mut *lock(&shard.0));
            for (_, list) in map {
                out.extend(list);
            }
        }
        out
    }

    /// Number of keys with a list.
    pub(crate) fn keys(&self) -> usize {
        self.shards.iter().map(|s| lock(&s.0).len()).sum()
    }
}

/// Gives back most of a shard's table once it has far more room than keys (a
/// burst of keys has passed), so the map's memory follows the live key count, not
/// its peak. It shrinks to twice the length: the map can grow again without a
/// resize, and the next shrink waits until it loses most of its keys again, so
/// each rehash is paid for by the removals before it (amortised O(1)).
fn shrink_if_sparse<K: Hash + Eq, V>(map: &mut HashMap<K, Vec<V>>) {
    if map.capacity() > 64 && map.len() * 8 < map.capacity() {
        map.shrink_to(map.len() * 2);
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // No user code runs under these locks, so poisoning can only come from an
    // allocation failure; the map is still consistent then.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn capacity(w: &Watchers<u32, u32>) -> usize {
        w.shards.iter().map(|s| lock(&s.0).capacity()).sum()
    }

    #[test]
    fn table_follows_the_live_key_count_not_its_peak() {
        let w: Watchers<u32, u32> = Watchers::new(4);
        for k in 0..100_000 {
            w.watch(&[k], &k);
        }
        let peak = capacity(&w);
        assert!(peak >= 100_000);
        // Walk all but 100 keys away, half by pruning and half by taking.
        for k in 100..100_000 {
            if k % 2 == 0 {
                assert_eq!(w.prune(&k, |_| true), 1);
            } else {
                assert_eq!(w.take(&k), vec![k]);
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
            assert_eq!(w.take(&k), vec![k]);
        }
        assert_eq!(w.keys(), 0);
        w.watch(&[7], &7);
        assert_eq!(w.take(&7), vec![7]);
    }

    #[test]
    fn purge_shrinks_the_table_too() {
        let w: Watchers<u32, u32> = Watchers::new(2);
        for k in 0..50_000 {
            w.watch(&[k], &k);
        }
        assert_eq!(w.purge(|v| *v >= 10), 49_990);
        assert_eq!(w.keys(), 10);
        assert!(capacity(&w) <= 10 * 8, "capacity {}", capacity(&w));
    }
}
