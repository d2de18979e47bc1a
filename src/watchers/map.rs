//! The sharded table under the watcher map: shards of `hashbrown`'s
//! `HashTable`, each behind a mutex of its own, holding each key with its hash
//! and its list. Lookups go by the stored hash and the key's `Eq`; no key is
//! ever hashed here. A caller may hold several shards at once, taken in
//! ascending order (see the map's ground rules), which DashMap's API, where
//! one call takes the lock and probes the table, does not allow.

use std::sync::{Mutex, MutexGuard};

use hashbrown::HashTable;

use super::list::List;
use crate::sync::Padded;

/// A key, its hash by the map's hasher, and its list.
#[derive(Debug)]
pub(super) struct Slot<K, V> {
    pub(super) hash: u64,
    pub(super) key: K,
    pub(super) list: List<V>,
}

/// One shard's table.
pub(super) type Table<K, V> = HashTable<Slot<K, V>>;

/// A shard: its table behind its lock, on cache lines of its own.
type Shard<K, V> = Padded<Mutex<Table<K, V>>>;

/// The shards.
pub(super) struct Shards<K, V> {
    shards: Box<[Shard<K, V>]>,
    /// How far to shift a hash (moved left by 7) to get its shard.
    shift: u32,
}

/// The hash a table uses to place a slot when it grows or shrinks: the one
/// stored, so that no key code runs.
pub(super) fn stored<K, V>(slot: &Slot<K, V>) -> u64 {
    slot.hash
}

impl<K, V> Shards<K, V> {
    /// `n` shards, rounded up to a power of two, at least 2.
    pub(super) fn new(n: usize) -> Self {
        let n = n.clamp(2, 1 << 16).next_power_of_two();
        Shards {
            shards: (0..n)
                .map(|_| Padded(Mutex::new(HashTable::new())))
                .collect(),
            shift: usize::BITS - n.trailing_zeros(),
        }
    }

    /// The shard of `hash`: the bits just below the top seven, which the
    /// table keeps for its own tags.
    pub(super) fn index(&self, hash: u64) -> usize {
        ((hash as usize) << 7) >> self.shift
    }

    /// Locks shard `i`. The tables are changed only by code of ours that
    /// does not panic part-way (key code runs before the change it decides),
    /// so a poisoned lock still guards a consistent table.
    pub(super) fn lock(&self, i: usize) -> MutexGuard<'_, Table<K, V>> {
        self.shards[i].0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Locks the shard of `hash`.
    pub(super) fn lock_for(&self, hash: u64) -> MutexGuard<'_, Table<K, V>> {
        self.lock(self.index(hash))
    }

    /// Number of shards.
    pub(super) fn count(&self) -> usize {
        self.shards.len()
    }

    /// Keys held (each shard locked in turn).
    pub(super) fn len(&self) -> usize {
        (0..self.count()).map(|i| self.lock(i).len()).sum()
    }

    /// Room for keys (each shard locked in turn).
    pub(super) fn capacity(&self) -> usize {
        (0..self.count()).map(|i| self.lock(i).capacity()).sum()
    }

    /// Gives back each shard's unused room (each shard locked in turn).
    pub(super) fn shrink_to_fit(&self) {
        for i in 0..self.count() {
            self.lock(i).shrink_to_fit(stored);
        }
    }
}

#[cfg(all(test, not(purgatory_loom)))]
mod tests {
    use super::*;

    /// Every hash lands in a shard, and the shards share the hashes out.
    #[test]
    fn hashes_spread_over_every_shard() {
        let shards: Shards<u32, u32> = Shards::new(8);
        assert_eq!(shards.count(), 8);
        let mut seen = [0usize; 8];
        for h in 0..4096u64 {
            let hash = h.wrapping_mul(0x9E37_79B9_7F4A_7C15);
            seen[shards.index(hash)] += 1;
        }
        assert!(seen.iter().all(|&n| n > 300), "{seen:?}");
        let one: Shards<u32, u32> = Shards::new(1);
        assert_eq!(one.count(), 2, "at least two");
    }
}
