//! The watcher map on `DashMap`, with the same interface and rules as
//! `watchers.rs` (built instead of it under `--cfg purgatory_dashmap`, to measure
//! the two side by side). It avoids the DashMap calls that would drop a user key
//! under a shard lock (`retain`, `clear`, `VacantEntry::insert`).

use std::borrow::Borrow;
use std::collections::hash_map::RandomState;
use std::hash::Hash;
use std::sync::atomic::{AtomicIsize, AtomicUsize, Ordering};

use dashmap::mapref::entry::Entry;
use dashmap::DashMap;

use crate::loom::thread_index;

pub(crate) use crate::watchers_common::Removed;

#[derive(Debug)]
#[repr(align(128))]
struct Stripe(AtomicIsize);

#[derive(Debug)]
pub(crate) struct Watchers<K: Hash + Eq, V> {
    map: DashMap<K, Vec<V>, RandomState>,
    /// Entries held, striped by thread and summed on read.
    entries: Box<[Stripe]>,
    /// Keys removed since the last look at the table's size.
    removals: AtomicUsize,
}

impl<K: Hash + Eq + Clone, V: Clone> Watchers<K, V> {
    pub(crate) fn new(shards: usize) -> Self {
        Watchers {
            map: DashMap::with_hasher_and_shard_amount(
                RandomState::new(),
                shards.max(2).next_power_of_two(),
            ),
            entries: (0..16).map(|_| Stripe(AtomicIsize::new(0))).collect(),
            removals: AtomicUsize::new(0),
        }
    }

    fn count(&self, n: isize) {
        let i = (thread_index() % self.entries.len() as u64) as usize;
        self.entries[i].0.fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn len(&self) -> usize {
        self.entries
            .iter()
            .map(|s| s.0.load(Ordering::Relaxed))
            .sum::<isize>()
            .max(0) as usize
    }

    pub(crate) fn watch<'k>(&self, keys: impl IntoIterator<Item = &'k K>, v: &V, added: &mut usize)
    where
        K: 'k,
    {
        for key in keys {
            let hit = match self.map.get_mut(key) {
                Some(mut list) => {
                    list.push(v.clone());
                    true
                }
                None => false,
            };
            if !hit {
                let own = key.clone();
                let spare = match self.map.entry(own) {
                    Entry::Occupied(mut o) => {
                        o.get_mut().push(v.clone());
                        Some(o.into_key())
                    }
                    Entry::Vacant(vac) => Some(vac.insert_entry(vec![v.clone()]).into_key()),
                };
                drop(spare); // the lock is released by now
            }
            self.count(1);
            *added += 1;
        }
    }

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

    fn retain<Q: Hash + Eq + ?Sized>(
        &self,
        key: &Q,
        finished: impl Fn(&V) -> bool,
        mut kept: impl FnMut(&V),
        removed: &mut Removed<K, V>,
    ) where
        K: Borrow<Q>,
    {
        let before = removed.entries.len();
        let entries = &mut removed.entries;
        let emptied = self.map.remove_if_mut(key, |_, list| {
            entries.extend(list.extract_if(.., |v| {
                let gone = finished(v);
                if !gone {
                    kept(v);
                }
                gone
            }));
            list.is_empty()
        });
        self.count(-((removed.entries.len() - before) as isize));
        if let Some((k, _)) = emptied {
            removed.keys.push(k);
            self.key_removed();
        }
    }

    pub(crate) fn take<Q: Hash + Eq + ?Sized>(&self, key: &Q, removed: &mut Removed<K, V>)
    where
        K: Borrow<Q>,
    {
        if let Some((k, list)) = self.map.remove(key) {
            self.count(-(list.len() as isize));
            removed.keys.push(k);
            removed.entries.extend(list);
            self.key_removed();
        }
    }

    /// Amortised: looks at the table's size once per 64 keys removed, and shrinks
    /// every shard at once when it has 8x more room than keys (DashMap's safe API
    /// has no per-shard shrink).
    fn key_removed(&self) {
        if self.removals.fetch_add(1, Ordering::Relaxed) % 64 == 63 {
            let cap = self.map.capacity();
            if cap > 64 && self.map.len() * 8 < cap {
                self.map.shrink_to_fit();
            }
        }
    }

    pub(crate) fn purge(
        &self,
        finished: impl Fn(&V) -> bool,
        mut drop_batch: impl FnMut(Removed<K, V>),
    ) {
        let mut removed = Removed::default();
        let mut emptied = Vec::new();
        for mut item in self.map.iter_mut() {
            let list = item.value_mut();
            removed.entries.extend(list.extract_if(.., |v| finished(v)));
            if list.is_empty() {
                emptied.push(item.key().clone());
            }
        }
        self.count(-(removed.entries.len() as isize));
        for k in &emptied {
            if let Some((k, _)) = self.map.remove_if(k, |_, l| l.is_empty()) {
                removed.keys.push(k);
                self.key_removed();
            }
        }
        removed.keys.extend(emptied);
        drop_batch(removed);
    }

    pub(crate) fn drain(&self, removed: &mut Removed<K, V>) {
        let keys: Vec<K> = self.map.iter().map(|r| r.key().clone()).collect();
        for k in &keys {
            self.take(k, removed);
        }
        removed.keys.extend(keys);
    }

    pub(crate) fn keys(&self) -> usize {
        self.map.len()
    }
}
