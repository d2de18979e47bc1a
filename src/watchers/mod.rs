//! The watcher map: watch key -> operations watching it (many to many).
//!
//! Shards of hash tables (`map.rs`: `hashbrown`'s `HashTable`, each behind a
//! mutex of its own) from each key to its list, with the key stored beside its
//! hash.
//! The map keeps its own entry count (striped by thread, summed on read), changed
//! by the call that adds or removes entries, so callers never pair their changes
//! with a count of their own.
//!
//! # Ground rules
//!
//! - **What runs under a shard lock.** Our own bookkeeping, plus the key's `Eq`
//!   (to find its list), which is user code and must not call back into the
//!   purgatory. When a key is first watched, the copy the map keeps is cloned
//!   before the lock is taken. A key's `Hash` runs once per call, before any
//!   lock is taken: the map stores each key with its hash and never hashes a
//!   stored key again (not even when a shard grows or shrinks).
//! - **No drop of a user value under a lock.** Every method that removes entries
//!   or keys moves them out into a [`Removed`] that the caller drops after the lock
//!   is released, because the last reference to an operation's cell, or the map's
//!   copy of a key, may own user data whose `Drop` calls back in: a slot taken
//!   out of a table is held until the guard is gone, and a copy made for a key
//!   another caller added meanwhile goes back to the caller.
//! - **Lock order.** A registration of up to four keys in distinct shards holds
//!   their shards' locks together ([`Watchers::add_held`]), taken in ascending
//!   shard order; every other call holds one shard lock at a time. So waits
//!   for shard locks never form a cycle. A key's `Eq` may so run while the
//!   shards of the registration's other keys are held.
//! - **Panics.** A panic in a key's `Eq` under a lock leaves that key's list as
//!   it was (a table changes only after the key code it needs has returned). A
//!   registration that panics part-way has joined some of its keys' lists: it
//!   counts each list the moment it joins it, so the caller knows how many
//!   entries to turn into tombstones.
//! - **Empty keys.** A key whose list becomes empty is removed in the same critical
//!   section that emptied it, so it cannot race a concurrent watch of the same key.
//! - **Shrinking.** The map shrinks all its shards at once. The map looks at its
//!   size once per 64 keys removed and shrinks when it has 8x more room than keys,
//!   so each rehash is paid for by the removals before it (amortised O(1)), and its
//!   memory follows the live key count rather than its peak.

mod hashed;
mod list;
mod map;

use std::borrow::Borrow;
use std::hash::Hash;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicIsize, AtomicUsize, Ordering};

use hashbrown::hash_table::Entry;

pub(crate) use self::hashed::{KeyHasher, Probe};
use self::list::List;
use self::map::{stored, Shards, Slot};
use crate::sync::Striped;

type Lists<K, V> = Shards<K, V>;

/// Keys whose lists a registration appends to with their locks held together
/// (see [`Watchers::add_held`]); past this many, one at a time.
const HELD: usize = 4;

/// Adds `n` to the calling thread's stripe of the entry count.
#[inline]
fn count_in(stripes: &Striped<AtomicIsize>, n: isize) {
    if n != 0 {
        stripes.mine().fetch_add(n, Ordering::Relaxed);
    }
}

/// Counts the entries a registration added once, when it is done or unwinds
/// from key code that panicked part-way: one read-modify-write per
/// registration rather than one per key.
struct Tally<'a> {
    stripes: &'a Striped<AtomicIsize>,
    added: &'a mut usize,
    before: usize,
}

impl<'a> Tally<'a> {
    fn new(stripes: &'a Striped<AtomicIsize>, added: &'a mut usize) -> Self {
        let before = *added;
        Tally {
            stripes,
            added,
            before,
        }
    }
}

impl Drop for Tally<'_> {
    fn drop(&mut self) {
        count_in(self.stripes, (*self.added - self.before) as isize);
    }
}

pub(crate) struct Watchers<K, V> {
    lists: Lists<K, V>,
    hasher: KeyHasher,
    /// Entries held, tombstones included (a thread adds to its own stripe).
    entries: Striped<AtomicIsize>,
    /// Keys removed, to look at the table's size once per 64.
    removals: AtomicUsize,
}

/// What a call took out of the map, to be dropped by the caller once no lock is
/// held: list entries and the map's own copies of keys that left it.
#[derive(Debug)]
pub(crate) struct Removed<K, V> {
    pub(crate) entries: Vec<V>,
    pub(crate) keys: Vec<K>,
}

/// Where a purge done in slices stands (see [`Watchers::sweep`]); how far it
/// has gone into a key's list is kept in the list (`List::hole`).
#[derive(Debug)]
pub(crate) struct Sweep {
    /// The keys of the shard being swept, by stored hash, noted when the
    /// sweep reached that shard: in order of their low bits (about the order
    /// of their buckets), so that keys of one hash lie side by side. One
    /// shard at a time, so that no slice notes (and sorts) more than one
    /// shard's keys, however large the map.
    hashes: Vec<u64>,
    /// The shard `hashes` came from.
    shard: usize,
    /// The shards to sweep (0 for a sweep with nothing to visit).
    shards: usize,
    /// The next key to visit.
    next: usize,
    /// Which of the keys of the next one's hash it is, in the table's probe
    /// order, counting only those the sweep kept: keys whose hashes are
    /// equal in all 64 bits (a `Hash` that says little, a weak hasher) are
    /// told apart this way, so each is visited, not the first one each time.
    /// A key of that hash added or removed by others meanwhile (or a table
    /// resized) can shift the count: a key is then visited twice, or left
    /// for the next purge, as keys added meanwhile are.
    nth: usize,
    /// Whether a slice has visited that key's list already: a list found with
    /// no progress then was rewritten (or replaced) since, and is clean.
    begun: bool,
}

impl Sweep {
    /// Whether every key has been visited.
    pub(crate) fn is_done(&self) -> bool {
        self.next >= self.hashes.len() && self.shard + 1 >= self.shards
    }

    /// A sweep with nothing to visit (done), to be started by
    /// [`Watchers::restart_sweep`].
    pub(crate) fn idle() -> Sweep {
        Sweep {
            hashes: Vec::new(),
            shard: 0,
            shards: 0,
            next: 0,
            nth: 0,
            begun: false,
        }
    }

    /// Lets go of the room for the keys' hashes once it is past 1,024 keys:
    /// a sweep of a small map keeps it from one purge to the next.
    pub(crate) fn trim(&mut self) {
        if self.hashes.capacity() > 1024 {
            self.hashes = Vec::new();
        }
    }
}

impl<K, V> Default for Removed<K, V> {
    fn default() -> Self {
        Removed {
            entries: Vec::new(),
            keys: Vec::new(),
        }
    }
}

impl<K: Hash + Eq + Clone, V: Clone> Watchers<K, V> {
    pub(crate) fn new(shards: usize, hasher: KeyHasher) -> Self {
        Watchers {
            lists: Shards::new(shards),
            hasher,
            entries: Striped::default(),
            removals: AtomicUsize::new(0),
        }
    }

    fn counted(&self, n: isize) {
        count_in(&self.entries, n);
    }

    /// Watch-list entries held, tombstones included. Sums the stripes: exact when
    /// no call races it.
    pub(crate) fn len(&self) -> usize {
        let n: isize = self.entries.iter().map(|s| s.load(Ordering::Relaxed)).sum();
        n.max(0) as usize
    }

    /// Appends `v` to the list of every key, counting in `added` the lists it
    /// joined, so that a panic in key code part-way leaves a known count behind.
    /// Copies of keys made and not kept go to `spare`, for the caller to drop.
    pub(crate) fn watch<'k>(
        &self,
        keys: impl IntoIterator<Item = (u64, &'k K)>,
        v: &V,
        added: &mut usize,
        spare: &mut Vec<K>,
    ) where
        K: 'k,
    {
        let tally = Tally::new(&self.entries, added);
        let mut keys = keys.into_iter();
        // The first few keys, with their shards.
        let mut few: [(usize, u64, Option<&K>); HELD] = [(0, 0, None); HELD];
        let mut n = 0;
        let mut more = None;
        for (hash, key) in keys.by_ref() {
            if n == HELD {
                more = Some((hash, key));
                break;
            }
            few[n] = (self.lists.index(hash), hash, Some(key));
            n += 1;
        }
        let few = &mut few[..n];
        if more.is_none() {
            // Sorted by shard (an insertion sort of at most `HELD`, stable),
            // for `add_held`; more keys than that go in the order given.
            for i in 1..few.len() {
                let mut at = i;
                while at > 0 && few[at - 1].0 > few[at].0 {
                    few.swap(at - 1, at);
                    at -= 1;
                }
            }
            if few.windows(2).all(|w| w[0].0 != w[1].0) {
                return self.add_held(few, v, tally.added, spare);
            }
        }
        for (hash, key) in few
            .iter()
            .filter_map(|(_, h, k)| Some((*h, (*k)?)))
            .chain(more)
            .chain(keys)
        {
            self.add(hash, key, None, v, spare);
            *tally.added += 1;
        }
    }

    /// Appends `v` to the lists of a few keys in distinct shards, sorted by
    /// shard, holding their shards' locks together: every lock first, then
    /// each key's lookup and append, then every release, so that the cache
    /// misses on the tables and the lists overlap instead of each waiting on
    /// the lock or release after it (a locked instruction waits for the
    /// memory accesses before it). Shards are taken in ascending order, as
    /// every caller holding more than one does, so waits for them never form
    /// a cycle. Keys not yet in the map are added one at a time after the
    /// locks are gone.
    fn add_held(
        &self,
        keys: &[(usize, u64, Option<&K>)],
        v: &V,
        added: &mut usize,
        spare: &mut Vec<K>,
    ) {
        const { assert!(HELD == 4, "one arm below per count of keys held") };
        let mut first = [false; HELD];
        {
            // Appends to key `i`'s list in `table` (its shard's), or marks
            // the key as new.
            let mut append = |table: &mut map::Table<K, V>, i: usize| {
                let (_, hash, key) = keys[i];
                let Some(key) = key else { return };
                let probe = Probe { hash, key };
                match table.find_mut(hash, |s| probe.matches(s.hash, &s.key)) {
                    Some(slot) => {
                        slot.list.push(v.clone());
                        *added += 1;
                    }
                    None => first[i] = true,
                }
            };
            let lock = |i: usize| self.lists.lock(keys[i].0);
            // Each arm takes its locks in the keys' (ascending) order; the
            // guards go at the end of the arm.
            match keys.len() {
                0 => {}
                1 => append(&mut lock(0), 0),
                2 => {
                    let (mut a, mut b) = (lock(0), lock(1));
                    append(&mut a, 0);
                    append(&mut b, 1);
                }
                3 => {
                    let (mut a, mut b, mut c) = (lock(0), lock(1), lock(2));
                    append(&mut a, 0);
                    append(&mut b, 1);
                    append(&mut c, 2);
                }
                _ => {
                    let (mut a, mut b, mut c, mut d) = (lock(0), lock(1), lock(2), lock(3));
                    append(&mut a, 0);
                    append(&mut b, 1);
                    append(&mut c, 2);
                    append(&mut d, 3);
                }
            }
        }
        for (i, (_, hash, key)) in keys.iter().enumerate() {
            if let (true, Some(key)) = (first[i], key) {
                self.add_new(*hash, key, None, v, spare);
                *added += 1;
            }
        }
    }

    /// As [`watch`](Self::watch), each key at a level (see [`List::reach`]).
    pub(crate) fn watch_levels<'k>(
        &self,
        keys: impl IntoIterator<Item = (u64, &'k K, u64)>,
        v: &V,
        added: &mut usize,
        spare: &mut Vec<K>,
    ) where
        K: 'k,
    {
        let tally = Tally::new(&self.entries, added);
        for (hash, key, level) in keys {
            self.add(hash, key, Some(level), v, spare);
            *tally.added += 1;
        }
    }

    /// `key`'s hash by the map's hasher (the key's `Hash` and the hasher run
    /// here, with no lock held): what [`watch`](Self::watch) and
    /// [`watch_levels`](Self::watch_levels) take beside each key.
    pub(crate) fn hash<Q: Hash + ?Sized>(&self, key: &Q) -> u64 {
        self.hasher.hash_one(key)
    }

    /// Adds `v` to `key`'s list; `hash` is `key`'s hash by [`hash`](Self::hash).
    fn add(&self, hash: u64, key: &K, level: Option<u64>, v: &V, spare: &mut Vec<K>) {
        let probe = Probe { hash, key };
        let mut table = self.lists.lock_for(hash);
        match table.find_mut(hash, |s| probe.matches(s.hash, &s.key)) {
            Some(slot) => slot.list.add(level, v.clone()),
            None => {
                drop(table);
                self.add_new(hash, key, level, v, spare);
            }
        }
    }

    /// [`add`](Self::add) for a key a lookup just did not find: a first
    /// watch, unless another caller added the key meanwhile (then the copy
    /// made goes to `spare`).
    fn add_new(&self, hash: u64, key: &K, level: Option<u64>, v: &V, spare: &mut Vec<K>) {
        // Clone before taking the lock: a panicking clone leaves the map as
        // it was, and no `Clone` runs under a lock of ours. The new list too,
        // to keep the lock short.
        let own = key.clone();
        let first = List::first(level, v.clone());
        let probe = Probe { hash, key };
        let mut table = self.lists.lock_for(hash);
        // The lookup runs the key's `Eq` (when a key of the same hash is
        // there, say one another caller added meanwhile). If it panics, the
        // copy goes to `spare`, dropped contained by the caller, rather than
        // while the panic unwinds (a `Drop` that panicked then would abort).
        let held: &mut map::Table<K, V> = &mut table;
        let entry = catch_unwind(AssertUnwindSafe(move || {
            let held = held; // moved in, so the entry may borrow it
            held.entry(hash, |s| probe.matches(s.hash, &s.key), stored)
        }));
        let entry = match entry {
            Ok(entry) => entry,
            Err(panic) => {
                drop(table);
                spare.push(own);
                resume_unwind(panic);
            }
        };
        match entry {
            Entry::Occupied(mut slot) => {
                slot.get_mut().list.add(level, v.clone());
                drop(table);
                spare.push(own);
            }
            Entry::Vacant(slot) => {
                slot.insert(Slot {
                    hash,
                    key: own,
                    list: first,
                });
            }
        }
    }

    /// Copies `key`'s entries that are not `finished` into `out`, and takes the
    /// finished ones out of the list (and the key, if nothing is left) into
    /// `removed`. Plain entries only, unless the key `reached` a level: then
    /// also the level entries at or below it (each live one stays watched one
    /// level above, see [`List::reach`]).
    pub(crate) fn collect_live<Q>(
        &self,
        key: &Probe<'_, Q>,
        reached: Option<u64>,
        out: &mut Vec<V>,
        finished: impl Fn(&V) -> bool,
        removed: &mut Removed<K, V>,
    ) where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.retain(key, reached, finished, |v| out.push(v.clone()), removed)
    }

    /// Takes `key`'s finished entries out into `removed`.
    pub(crate) fn prune<Q>(
        &self,
        key: &Probe<'_, Q>,
        finished: impl Fn(&V) -> bool,
        removed: &mut Removed<K, V>,
    ) where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.retain(key, None, finished, |_| {}, removed)
    }

    /// After an advance of `key` that completed `completed` operations: takes
    /// its finished plain entries out, and its finished level entries when
    /// there are at most four times `completed` of them (so the pass costs no
    /// more than the completions paid for), and the key once its list empties.
    pub(crate) fn prune_reached<Q>(
        &self,
        probe: &Probe<'_, Q>,
        completed: usize,
        finished: impl Fn(&V) -> bool,
        removed: &mut Removed<K, V>,
    ) where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.take_out(probe, removed, |list, entries| {
            list.retain(&finished, |_| {}, entries);
            list.prune_levels(completed.saturating_mul(4), &finished, entries);
        });
    }

    /// Hashes `key` (its `Hash` and the hasher run here, with no lock held), for
    /// [`collect_live`](Self::collect_live) and [`prune`](Self::prune).
    pub(crate) fn probe<'q, Q>(&self, key: &'q Q) -> Probe<'q, Q>
    where
        Q: Hash + ?Sized,
    {
        Probe {
            hash: self.hash(key),
            key,
        }
    }

    /// Takes `key`'s finished entries out, showing each kept one to `kept`, and
    /// removes the key when its list empties (in the same critical section, so a
    /// concurrent watch of the key cannot be lost). With `reached`, does the
    /// same for the entries at a level at most `reached` (see [`List::reach`]);
    /// without, leaves level entries alone.
    fn retain<Q>(
        &self,
        probe: &Probe<'_, Q>,
        reached: Option<u64>,
        finished: impl Fn(&V) -> bool,
        mut kept: impl FnMut(&V),
        removed: &mut Removed<K, V>,
    ) where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.take_out(probe, removed, |list, entries| {
            list.retain(&finished, &mut kept, entries);
            if let Some(level) = reached {
                list.reach(level, &finished, &mut kept, entries);
            }
        });
    }

    /// Runs `edit` on `probe`'s list under its shard lock, taking entries out
    /// into `removed`, and takes the key out too if its list is left empty
    /// (in the same critical section, so a concurrent watch of the key cannot
    /// be lost).
    fn take_out<Q>(
        &self,
        probe: &Probe<'_, Q>,
        removed: &mut Removed<K, V>,
        edit: impl FnOnce(&mut List<V>, &mut Vec<V>),
    ) where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let before = removed.entries.len();
        let mut table = self.lists.lock_for(probe.hash);
        let found = table.find_entry(probe.hash, |s| probe.matches(s.hash, &s.key));
        let emptied = match found {
            Ok(mut slot) => {
                let list = &mut slot.get_mut().list;
                edit(list, &mut removed.entries);
                list.is_empty().then(|| slot.remove().0)
            }
            Err(_) => None,
        };
        drop(table);
        self.counted(-((removed.entries.len() - before) as isize));
        if let Some(slot) = emptied {
            removed.keys.push(slot.key);
            self.key_removed();
        }
    }

    /// Removes `key` with its whole list, into `removed`.
    pub(crate) fn take<Q>(&self, key: &Q, removed: &mut Removed<K, V>)
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let probe = self.probe(key);
        let mut table = self.lists.lock_for(probe.hash);
        let taken = table
            .find_entry(probe.hash, |s| probe.matches(s.hash, &s.key))
            .ok()
            .map(|slot| slot.remove().0);
        drop(table);
        if let Some(slot) = taken {
            self.counted(-(slot.list.len() as isize));
            removed.keys.push(slot.key);
            removed.entries.extend(slot.list.into_entries());
            self.key_removed();
        }
    }

    /// A key left the map: now and then, give back room the map no longer needs.
    fn key_removed(&self) {
        if size_check_due(self.removals.fetch_add(1, Ordering::Relaxed)) {
            self.shrink_if_sparse();
        }
    }

    /// Gives back most of the table once it has far more room than keys (a burst
    /// of keys has passed), so its memory follows the live key count, not its
    /// peak. Each rehash uses the stored hashes: no user code runs.
    fn shrink_if_sparse(&self) {
        if is_sparse(self.lists.len(), self.lists.capacity()) {
            self.lists.shrink_to_fit();
        }
    }

    /// Begins a purge, for [`sweep`](Self::sweep) to visit in slices (see
    /// [`restart_sweep`](Self::restart_sweep)).
    #[cfg(test)]
    pub(crate) fn start_sweep(&self) -> Sweep {
        let mut sweep = Sweep::idle();
        self.restart_sweep(&mut sweep);
        sweep
    }

    /// Starts `sweep` again over every shard, from the first: its keys are
    /// noted now, each later shard's when the sweep reaches it (so a key
    /// added to a shard not reached yet is visited too).
    pub(crate) fn restart_sweep(&self, sweep: &mut Sweep) {
        sweep.shards = self.lists.count();
        self.note_shard(sweep, 0);
    }

    /// Points `sweep` at shard `i`, in the room it kept: the shard locked,
    /// its stored hashes noted (no key code runs, nothing is dropped under
    /// the lock), then sorted with the lock released.
    fn note_shard(&self, sweep: &mut Sweep, i: usize) {
        sweep.hashes.clear();
        {
            let table = self.lists.lock(i);
            sweep.hashes.extend(table.iter().map(|s| s.hash));
        }
        // Equal hashes are in one shard: sorting brings them together.
        sweep.hashes.sort_unstable_by_key(|h| h.reverse_bits());
        sweep.shard = i;
        sweep.next = 0;
        sweep.nth = 0;
        sweep.begun = false;
    }

    /// Goes on with `sweep`: visits at most `budget` entries from where it
    /// stopped, takes the finished ones out into `removed`, and the keys left
    /// empty. A purge done in slices holds each lock for a bounded time and
    /// never stalls its caller for a whole pass over the table.
    ///
    /// Keys are found again by their stored hash alone; a key removed since its
    /// shard was noted is skipped, and one added since is left for the next
    /// sweep (one added to a shard not reached yet is visited in this one).
    pub(crate) fn sweep(
        &self,
        sweep: &mut Sweep,
        budget: usize,
        finished: impl Fn(&V) -> bool,
        removed: &mut Removed<K, V>,
    ) {
        let mut left = budget.max(1);
        let before = removed.entries.len();
        while left > 0 && !sweep.is_done() {
            if sweep.next >= sweep.hashes.len() {
                // This shard is swept: on to the next.
                self.note_shard(sweep, sweep.shard + 1);
                continue;
            }
            let hash = sweep.hashes[sweep.next];
            let mut key_done = true;
            let entries = &mut removed.entries;
            let begun = sweep.begun;
            let mut table = self.lists.lock_for(hash);
            // By hash alone (no key code runs): the `nth` list of that hash.
            let (nth, mut seen) = (sweep.nth, 0);
            let found = table.find_entry(hash, |s| {
                let hit = s.hash == hash && seen == nth;
                seen += usize::from(s.hash == hash);
                hit
            });
            let emptied = match found {
                Ok(mut slot) => {
                    let list = &mut slot.get_mut().list;
                    if !(begun && list.hole.1 == 0) {
                        // (Otherwise rewritten since the last slice: no
                        // finished entry is older than that.)
                        let (visited, end) = list.sweep(left, &finished, entries);
                        left = left.saturating_sub(visited);
                        key_done = end;
                    }
                    list.is_empty().then(|| slot.remove().0)
                }
                Err(_) => None,
            };
            drop(table);
            let kept = emptied.is_none();
            if let Some(slot) = emptied {
                removed.keys.push(slot.key);
                self.key_removed();
            }
            if key_done {
                sweep.next += 1;
                sweep.begun = false;
                // The next key of the same hash is the one after this, or
                // the one that took this one's place once it was removed.
                let same = sweep.hashes.get(sweep.next) == Some(&hash);
                sweep.nth = if same { nth + usize::from(kept) } else { 0 };
            } else {
                sweep.begun = true;
            }
        }
        // Past the last key of its shard: on to the next shard with keys
        // (noting it), so that a sweep with nothing left reads done now
        // rather than after one more, empty, slice.
        while sweep.next >= sweep.hashes.len() && !sweep.is_done() {
            self.note_shard(sweep, sweep.shard + 1);
        }
        self.counted(-((removed.entries.len() - before) as isize));
        if sweep.is_done() {
            self.shrink_if_sparse();
        }
    }

    /// Removes every list (shutdown), into `removed`.
    pub(crate) fn drain(&self, removed: &mut Removed<K, V>) {
        for i in 0..self.lists.count() {
            // The table comes out whole, to be emptied with no lock held.
            let table = std::mem::take(&mut *self.lists.lock(i));
            for slot in table {
                self.counted(-(slot.list.len() as isize));
                removed.keys.push(slot.key);
                removed.entries.extend(slot.list.into_entries());
            }
        }
    }

    /// Number of keys with a list.
    pub(crate) fn keys(&self) -> usize {
        self.lists.len()
    }
}

/// Whether the key removal numbered `removed` (from 0) looks at the table's size:
/// one in every 64.
fn size_check_due(removed: usize) -> bool {
    removed % 64 == 63
}

/// Whether a table of `capacity` holding `keys` keys is worth shrinking: more than
/// a small table, with over 8x more room than keys. Shrinking to fit then leaves
/// the next shrink until the keys fall 8x again, so each rehash is paid for by the
/// removals before it.
fn is_sparse(keys: usize, capacity: usize) -> bool {
    capacity > 64 && keys * 8 < capacity
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::Hasher;

    /// Watches `key` with `v`, hashing the key as registration does.
    fn watch_one<K: Hash + Eq + Clone, V: Clone>(w: &Watchers<K, V>, key: &K, v: &V) {
        w.watch([(w.hash(key), key)], v, &mut 0, &mut Vec::new());
    }

    fn capacity<K: Hash + Eq + Clone>(w: &Watchers<K, u32>) -> usize {
        w.lists.capacity()
    }

    fn take(w: &Watchers<u32, u32>, k: u32) -> Vec<u32> {
        let mut r = Removed::default();
        w.take(&k, &mut r);
        r.entries
    }

    /// `key`'s entries, in order, as a walk that finds none finished sees them.
    fn live_entries<K: Hash + Eq + Clone, V: Clone>(w: &Watchers<K, V>, key: &K) -> Vec<V> {
        let mut out = Vec::new();
        w.collect_live(
            &w.probe(key),
            None,
            &mut out,
            |_| false,
            &mut Removed::default(),
        );
        out
    }

    #[test]
    fn table_follows_the_live_key_count_not_its_peak() {
        let w: Watchers<u32, u32> = Watchers::new(4, KeyHasher::default());
        for k in 0..100_000 {
            watch_one(&w, &k, &k);
        }
        let peak = capacity(&w);
        assert!(peak >= 100_000);
        // Walk all but 100 keys away, half by pruning and half by taking.
        for k in 100..100_000 {
            if k % 2 == 0 {
                let mut r = Removed::default();
                w.prune(&w.probe(&k), |_| true, &mut r);
                assert_eq!((r.entries, r.keys), (vec![k], vec![k]));
            } else {
                assert_eq!(take(&w, k), vec![k]);
            }
        }
        assert_eq!(w.keys(), 100);
        // The size is looked at once per 64 keys removed, and the table shrinks
        // when it has 8x more room than keys: so at most 8x (keys + 64).
        let left = capacity(&w);
        assert!(
            left <= (100 + 64) * 8,
            "capacity {left} for 100 keys (peak {peak})"
        );
        // The survivors are intact and the map still works.
        for k in 0..100 {
            assert_eq!(take(&w, k), vec![k]);
        }
        assert_eq!(w.keys(), 0);
        watch_one(&w, &7, &7);
        assert_eq!(take(&w, 7), vec![7]);
    }

    /// Shrinking has hysteresis: removing keys one at a time rehashes a handful
    /// of times in all, not on every removal.
    #[test]
    fn the_table_shrinks_in_a_few_steps_not_on_every_removal() {
        let w: Watchers<u32, u32> = Watchers::new(1, KeyHasher::default());
        for k in 0..20_000 {
            watch_one(&w, &k, &k);
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
        // Shrinking to fit whenever there is some room left would rehash a
        // dozen times here; the 8x rule does it at most once per 4x fall in
        // keys (a shrink leaves between 1x and 2x the keys in room).
        assert!(changes <= 7, "{changes} rehashes for 20,000 removals");
        // The last look at the size came with 32 keys left (20,000 % 64): the
        // table then either had room for at most 8x those, or shrank to fit
        // them. Which one depends on the random hasher's spread over shards.
        assert!(cap <= 32 * 8, "capacity {cap} with no keys");
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
        let w: Watchers<K, u32> = Watchers::new(1, KeyHasher::default());
        for k in 0..5_000 {
            watch_one(&w, &K(k), &k);
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
    fn the_size_is_looked_at_once_every_64_removals() {
        let due: Vec<usize> = (0..256).filter(|&n| size_check_due(n)).collect();
        assert_eq!(due, [63, 127, 191, 255]);
    }

    #[test]
    fn sparse_means_over_64_slots_and_8x_the_keys() {
        assert!(!is_sparse(0, 64), "a small table is kept");
        assert!(is_sparse(0, 65));
        assert!(is_sparse(8, 65), "64 < 65");
        assert!(!is_sparse(9, 72), "72 is not below 72");
        assert!(is_sparse(8, 72));
        assert!(!is_sparse(1_000, 7_999));
        assert!(is_sparse(999, 8_000));
    }

    /// Every thread counts on its own stripe, however many threads there are.
    #[test]
    fn the_entry_count_holds_across_many_threads() {
        let w = std::sync::Arc::new(Watchers::<u32, u32>::new(4, KeyHasher::default()));
        for t in 0..300 {
            let w = w.clone();
            std::thread::spawn(move || watch_one(&w, &(t % 7), &t))
                .join()
                .unwrap();
        }
        assert_eq!(w.len(), 300);
        let mut r = Removed::default();
        w.prune(&w.probe(&3), |_| true, &mut r);
        assert_eq!(w.len(), 300 - r.entries.len());
    }

    /// Registrations of several keys on several threads at once, each
    /// holding the locks of its keys' shards together (or taking them one at
    /// a time when two share a shard, or past four keys), over few shards and
    /// few keys so that they meet: none waits forever (the shards are taken
    /// in one order), and every entry lands in its key's list.
    #[test]
    fn registrations_holding_several_shards_never_wait_on_each_other() {
        // On a thread of its own, so that a deadlock fails the test instead
        // of hanging it.
        let (done, finished) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = done.send(std::panic::catch_unwind(registrations_from_four_threads));
        });
        match finished.recv_timeout(std::time::Duration::from_secs(120)) {
            Ok(Ok(())) => {}
            Ok(Err(panic)) => std::panic::resume_unwind(panic),
            Err(_) => panic!("deadlock: the registrations did not finish"),
        }
    }

    fn registrations_from_four_threads() {
        let w = std::sync::Arc::new(Watchers::<u32, u32>::new(4, KeyHasher::default()));
        let threads: Vec<_> = (0..4u32)
            .map(|t| {
                let w = w.clone();
                std::thread::spawn(move || {
                    for i in 0..2_000u32 {
                        let n = 1 + (i % 6);
                        let keys: Vec<u32> = (0..n).map(|j| (i * 7 + j * 3 + t) % 24).collect();
                        let hashed: Vec<_> = keys.iter().map(|k| (w.hash(k), k)).collect();
                        let mut added = 0;
                        w.watch(hashed, &(t * 10_000 + i), &mut added, &mut Vec::new());
                        assert_eq!(added, n as usize);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let expected: usize = (0..2_000u32).map(|i| 1 + (i % 6) as usize).sum::<usize>() * 4;
        assert_eq!(w.len(), expected);
        let mut seen = 0;
        for k in 0..24u32 {
            let out = live_entries(&w, &k);
            seen += out.len();
        }
        assert_eq!(seen, expected, "every entry is in its key's list");
    }

    /// A `Removed` may be reused across calls: each call counts what it took.
    #[test]
    fn a_reused_haul_counts_each_call() {
        let w: Watchers<u32, u32> = Watchers::new(2, KeyHasher::default());
        for v in 0..6 {
            watch_one(&w, &(v % 2), &v);
        }
        let mut r = Removed::default();
        w.prune(&w.probe(&0), |v| *v < 4, &mut r);
        assert_eq!(r.entries.len(), 2);
        assert_eq!(w.len(), 4);
        w.prune(&w.probe(&1), |v| *v < 4, &mut r);
        assert_eq!(r.entries.len(), 4);
        assert_eq!(w.len(), 2);
    }

    /// Runs a whole sweep in slices of `budget`; returns what it removed and how
    /// many slices it took.
    fn sweep_all(
        w: &Watchers<u32, u32>,
        budget: usize,
        finished: impl Fn(&u32) -> bool,
    ) -> (Removed<u32, u32>, usize) {
        let mut sweep = w.start_sweep();
        let mut removed = Removed::default();
        let mut slices = 0;
        while !sweep.is_done() {
            w.sweep(&mut sweep, budget, &finished, &mut removed);
            slices += 1;
        }
        (removed, slices)
    }

    #[test]
    fn purge_shrinks_the_table_too() {
        let w: Watchers<u32, u32> = Watchers::new(2, KeyHasher::default());
        for k in 0..50_000 {
            watch_one(&w, &k, &k);
        }
        let (r, _) = sweep_all(&w, 1024, |v| *v >= 10);
        assert_eq!((r.entries.len(), r.keys.len()), (49_990, 49_990));
        assert_eq!(w.keys(), 10);
        assert_eq!(w.len(), 10);
        assert!(capacity(&w) <= 10 * 8, "capacity {}", capacity(&w));
    }

    /// One slice visits at most its budget of entries, inside one long list too,
    /// and the slices together remove exactly the finished entries, keeping the
    /// others in watch order.
    #[test]
    fn a_sweep_goes_in_slices_of_its_budget() {
        let w: Watchers<u32, u32> = Watchers::new(2, KeyHasher::default());
        for v in 0..10_000 {
            watch_one(&w, &(v % 3), &v);
        }
        let mut sweep = w.start_sweep();
        let mut r = Removed::default();
        w.sweep(&mut sweep, 100, |v| v % 2 == 0, &mut r);
        assert_eq!(r.entries.len(), 50, "100 visited, half of them finished");
        assert!(!sweep.is_done());
        let mut slices = 1;
        while !sweep.is_done() {
            w.sweep(&mut sweep, 100, |v| v % 2 == 0, &mut r);
            slices += 1;
        }
        assert_eq!(slices, 100, "10,000 entries in slices of 100");
        assert_eq!(r.entries.len(), 5_000);
        assert!(r.keys.is_empty());
        assert_eq!(w.len(), 5_000);
        for k in 0..3 {
            let live = live_entries(&w, &k);
            let odd: Vec<u32> = (0..10_000).filter(|v| v % 3 == k && v % 2 == 1).collect();
            assert_eq!(live, odd, "key {k} keeps its live entries in order");
        }
    }

    /// The table may change between slices: keys removed meanwhile are skipped,
    /// keys added meanwhile are visited by this sweep if their shard was not
    /// reached yet and by the next one otherwise, entries appended to a key
    /// being swept are still visited.
    #[test]
    fn a_sweep_survives_changes_between_slices() {
        let w: Watchers<u32, u32> = Watchers::new(2, KeyHasher::default());
        for v in 0..300 {
            watch_one(&w, &(v % 3), &v);
        }
        let mut sweep = w.start_sweep();
        let mut r = Removed::default();
        w.sweep(&mut sweep, 50, |v| *v >= 1000, &mut r);
        assert!(r.entries.is_empty());
        // Between slices: every key gets an entry that is finished, one key
        // goes away, and a new key arrives.
        for k in 0..3 {
            watch_one(&w, &k, &(1000 + k));
        }
        let mut gone = Removed::default();
        w.prune(&w.probe(&2), |_| true, &mut gone);
        assert_eq!(gone.keys, vec![2]);
        watch_one(&w, &7, &2000);
        while !sweep.is_done() {
            w.sweep(&mut sweep, 50, |v| *v >= 1000, &mut r);
        }
        let mut found = r.entries.clone();
        found.sort_unstable();
        let seven_now = found.contains(&2000);
        let appended = if seven_now {
            vec![1000, 1001, 2000]
        } else {
            vec![1000, 1001]
        };
        assert_eq!(found, appended, "appended entries of swept keys");
        assert_eq!(r.keys, if seven_now { vec![7] } else { vec![] });
        let (r, _) = sweep_all(&w, 50, |v| *v >= 1000);
        if seven_now {
            assert!(r.entries.is_empty() && r.keys.is_empty());
        } else {
            assert_eq!((r.entries, r.keys), (vec![2000], vec![7]));
        }
        assert_eq!(w.keys(), 2, "keys 0 and 1");
        assert_eq!(w.len(), 200, "their live entries");
    }

    /// A slice leaves a hole where it took entries out instead of moving the
    /// rest of the list down: its cost is its budget, however long the list.
    /// Walks, takes and watches between slices see the live entries in order,
    /// and a walk that rewrites the list ends the purge's visit of it.
    #[test]
    fn a_slice_leaves_a_hole_that_every_other_visit_skips() {
        let w: Watchers<u32, u32> = Watchers::new(2, KeyHasher::default());
        for v in 0..10_000 {
            watch_one(&w, &1, &v);
            watch_one(&w, &2, &v);
        }
        let list = |k: u32| {
            let p = w.probe(&k);
            let table = w.lists.lock_for(p.hash);
            let l = &table
                .find(p.hash, |s| p.matches(s.hash, &s.key))
                .unwrap()
                .list;
            (l.items.len(), l.hole, l.len())
        };
        let mut sweep = w.start_sweep();
        let mut r = Removed::default();
        w.sweep(&mut sweep, 100, |v| v % 2 == 0, &mut r);
        assert_eq!(r.entries.len(), 50);
        let swept = if list(1).1 == (0, 0) { 2 } else { 1 };
        assert_eq!(
            list(swept),
            (10_000, (50, 100), 9_950),
            "the tail stays put"
        );
        // A watch between slices goes to the end; the hole stays.
        watch_one(&w, &swept, &10_000);
        assert_eq!(list(swept), (10_001, (50, 100), 9_951));
        // The next slice goes on after the hole.
        w.sweep(&mut sweep, 100, |v| v % 2 == 0, &mut r);
        assert_eq!(r.entries.len(), 100);
        assert_eq!(list(swept), (10_001, (100, 200), 9_901));
        // A walk sees live entries in order, no hole, and closes it.
        let live = live_entries(&w, &swept);
        let want: Vec<u32> = (0..200).filter(|v| v % 2 == 1).chain(200..10_001).collect();
        assert_eq!(live, want);
        assert_eq!(list(swept), (9_901, (0, 0), 9_901));
        // The purge then counts that list as done and goes on to the other key.
        w.sweep(&mut sweep, 100, |v| v % 2 == 0, &mut r);
        assert_eq!(r.entries.len(), 150, "50 more, from the other key");
        let other = 3 - swept;
        assert_eq!(list(other), (10_000, (50, 100), 9_950));
        // Taking a list mid-purge hands out its live entries only.
        let mut taken = Removed::default();
        w.take(&other, &mut taken);
        assert_eq!(taken.entries.len(), 9_950);
        assert!(taken.entries.iter().take(50).all(|v| v % 2 == 1));
        assert_eq!(w.len(), 9_901);
        while !sweep.is_done() {
            w.sweep(&mut sweep, 100, |v| v % 2 == 0, &mut r);
        }
        assert_eq!(r.entries.len(), 150, "a key taken mid-purge is skipped");
    }

    /// A slice that reaches the end of a list closes its hole (only `None`s
    /// were past the kept part) and removes the key once nothing is left.
    #[test]
    fn the_last_slice_of_a_list_closes_the_hole() {
        let w: Watchers<u32, u32> = Watchers::new(1, KeyHasher::default());
        for v in 0..300 {
            watch_one(&w, &5, &v);
        }
        let mut sweep = w.start_sweep();
        let mut r = Removed::default();
        w.sweep(&mut sweep, 200, |v| *v < 250, &mut r);
        w.sweep(&mut sweep, 200, |v| *v < 250, &mut r);
        assert!(sweep.is_done());
        assert_eq!(r.entries, (0..250).collect::<Vec<_>>());
        let live = live_entries(&w, &5);
        assert_eq!(live, (250..300).collect::<Vec<_>>());
        let (r, _) = sweep_all(&w, 7, |_| true);
        assert_eq!((r.entries.len(), r.keys), (50, vec![5]));
        assert_eq!((w.len(), w.keys()), (0, 0));
    }

    #[test]
    fn a_walk_keeps_live_entries_and_hands_out_done_ones() {
        let w: Watchers<u32, u32> = Watchers::new(1, KeyHasher::default());
        for v in 0..10 {
            watch_one(&w, &1, &v);
        }
        let mut live = Vec::new();
        let mut r = Removed::default();
        w.collect_live(&w.probe(&1), None, &mut live, |v| v % 2 == 0, &mut r);
        assert_eq!(live, vec![1, 3, 5, 7, 9], "in watch order");
        assert_eq!(r.entries, vec![0, 2, 4, 6, 8]);
        assert!(r.keys.is_empty(), "the key still has live entries");
        let mut r = Removed::default();
        w.prune(&w.probe(&1), |_| true, &mut r);
        assert_eq!((r.entries.len(), r.keys), (5, vec![1]));
        assert_eq!(w.keys(), 0);
    }

    #[test]
    fn watch_counts_the_lists_it_joined_when_a_key_panics() {
        #[derive(PartialEq, Eq, Debug)]
        struct K(u32);
        impl Hash for K {
            fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
                self.0.hash(h);
            }
        }
        impl Clone for K {
            fn clone(&self) -> Self {
                assert_ne!(self.0, 3, "hostile clone");
                K(self.0)
            }
        }
        let w: Watchers<K, u32> = Watchers::new(4, KeyHasher::default());
        let keys = [K(1), K(2), K(3), K(4)];
        let hashed: Vec<(u64, &K)> = keys.iter().map(|k| (w.hash(k), k)).collect();
        let mut added = 0;
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            w.watch(hashed.iter().copied(), &7, &mut added, &mut Vec::new())
        }));
        assert!(r.is_err());
        // Which keys came before key 3 depends on their shards (taken in
        // shard order when distinct): the count is of those joined.
        assert!(added < 4, "key 3 was not joined");
        assert_eq!(w.keys(), added);
        assert_eq!(w.len(), added);
        let live = live_entries(&w, &K(3));
        assert!(
            live.is_empty(),
            "nothing under the key whose clone panicked"
        );
    }
}
