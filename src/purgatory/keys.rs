//! The distinct keys of one registration, each with its hash, without an
//! allocation for the common case of a few keys.

use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::contain::drop_payload;

use super::WatchKey;

/// A key with its hash by the watcher map's hasher.
type Hashed<K> = (u64, K);

/// Key code (`Hash`, `Eq`) panicked while a registration took its keys in:
/// the panic, and every key given, for the caller to drop (each drop
/// contained) before the panic goes on.
pub(crate) struct KeyPanic<K> {
    pub(crate) panic: Box<dyn Any + Send>,
    pub(crate) keys: Vec<K>,
}

impl<K> KeyPanic<K> {
    /// The panic, with every key: those taken in so far (`list`, `dups`) and
    /// the `rest` not yet looked at.
    fn new(
        panic: Box<dyn Any + Send>,
        list: KeyList<K>,
        dups: Vec<K>,
        rest: impl IntoIterator<Item = K>,
    ) -> KeyPanic<K> {
        let mut keys: Vec<K> = list.into_iter().chain(dups).collect();
        // The rest comes from the caller's iterator, which may panic again:
        // that stops the collecting (the first panic is the one that goes
        // on), and nothing taken is dropped while a panic unwinds.
        let mut rest = rest.into_iter();
        loop {
            match catch_unwind(AssertUnwindSafe(|| rest.next())) {
                Ok(Some(k)) => keys.push(k),
                Ok(None) => break,
                Err(again) => {
                    drop_payload(again);
                    break;
                }
            }
        }
        if let Err(again) = catch_unwind(AssertUnwindSafe(move || drop(rest))) {
            drop_payload(again);
        }
        KeyPanic { panic, keys }
    }
}

/// What a registration takes its watches in as: the watches and the
/// duplicates left out, or the panic of key code with every key.
pub(crate) type Taken<K> = Result<(Watches<K>, Vec<K>), KeyPanic<K>>;

/// Keys held inline before the list moves to the heap.
const INLINE: usize = 4;

/// Distinct keys with their hashes, in the order given: up to [`INLINE`] in
/// place, more on the heap. Each key is hashed once, by the watcher map's
/// hasher, when it is taken in; the map finds its list by that hash.
#[derive(Debug)]
pub(crate) enum KeyList<K> {
    Inline([Option<(u64, K)>; INLINE], usize),
    Heap(Vec<(u64, K)>),
}

impl<K: WatchKey> KeyList<K> {
    /// The distinct keys of `keys`, in order, each hashed once by `hash`, and
    /// the duplicates (for the caller to drop with its drops contained). Up to
    /// 16 keys, duplicates are found with `Eq` and never hashed; past 16, every
    /// key given is hashed once and duplicates are found by hash, then `Eq`.
    ///
    /// A panic in `Hash` or `Eq` is caught, and comes back with every key
    /// given ([`KeyPanic`]): the keys are not dropped while the panic unwinds
    /// (a key whose `Drop` panicked then would abort the process), but by the
    /// caller, each drop contained, before it lets the panic go on.
    pub(crate) fn distinct(
        keys: impl IntoIterator<Item = K>,
        hash: impl Fn(&K) -> u64,
    ) -> Result<(KeyList<K>, Vec<K>), KeyPanic<K>> {
        let mut list = KeyList::Inline([const { None }; INLINE], 0);
        let mut dups = Vec::new();
        let mut keys = keys.into_iter();
        loop {
            // The caller's iterator is user code too: a panic in it comes
            // back with the keys taken so far, as one in `Eq` or `Hash` does.
            let k = match catch_unwind(AssertUnwindSafe(|| keys.next())) {
                Ok(Some(k)) => k,
                Ok(None) => {
                    // Dropped here, where a panic in its `Drop` is caught and
                    // comes back as one in `next` does: left to the end of
                    // this function, it would unwind past the keys taken
                    // (leaking them, or dropping them while it unwinds).
                    if let Err(panic) = catch_unwind(AssertUnwindSafe(move || drop(keys))) {
                        return Err(KeyPanic::new(panic, list, dups, None));
                    }
                    break;
                }
                Err(panic) => {
                    // Not drained further: dropped, a panic in that caught.
                    if let Err(again) = catch_unwind(AssertUnwindSafe(move || drop(keys))) {
                        drop_payload(again);
                    }
                    return Err(KeyPanic::new(panic, list, dups, None));
                }
            };
            // Key code (`Eq`, `Hash`) decides; the list changes after it.
            let decided = catch_unwind(AssertUnwindSafe(|| {
                let same = |(_, sk): &(u64, K)| *sk == k;
                let dup = match &list {
                    KeyList::Inline(slots, len) => slots[..*len].iter().flatten().any(same),
                    // A scan while short; past 16, one pass by hash at the end.
                    KeyList::Heap(v) => v.len() < 16 && v.iter().any(same),
                };
                (!dup).then(|| hash(&k))
            }));
            let h = match decided {
                Ok(None) => {
                    dups.push(k);
                    continue;
                }
                Ok(Some(h)) => h,
                Err(panic) => {
                    let rest = std::iter::once(k).chain(keys);
                    return Err(KeyPanic::new(panic, list, dups, rest));
                }
            };
            match &mut list {
                KeyList::Inline(slots, len) if *len < INLINE => {
                    slots[*len] = Some((h, k));
                    *len += 1;
                }
                KeyList::Inline(slots, _) => {
                    let mut v: Vec<(u64, K)> = slots.iter_mut().filter_map(Option::take).collect();
                    v.push((h, k));
                    list = KeyList::Heap(v);
                }
                KeyList::Heap(v) => v.push((h, k)),
            }
        }
        if let KeyList::Heap(v) = &mut list {
            if v.len() > 16 {
                let keep = match catch_unwind(AssertUnwindSafe(|| first_of_each(v))) {
                    Ok(keep) => keep,
                    Err(panic) => return Err(KeyPanic::new(panic, list, dups, None)),
                };
                let (kept, more): (Vec<_>, Vec<_>) = std::mem::take(v)
                    .into_iter()
                    .zip(keep)
                    .partition(|(_, keep)| *keep);
                *v = kept.into_iter().map(|(k, _)| k).collect();
                dups.extend(more.into_iter().map(|((_, k), _)| k));
            }
        }
        Ok((list, dups))
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            KeyList::Inline(_, len) => *len,
            KeyList::Heap(v) => v.len(),
        }
    }

    /// The keys with their hashes.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, &K)> {
        let (inline, heap): (&[Option<Hashed<K>>], &[Hashed<K>]) = match self {
            KeyList::Inline(slots, len) => (&slots[..*len], &[]),
            KeyList::Heap(v) => (&[], v),
        };
        inline.iter().flatten().chain(heap).map(|(h, k)| (*h, k))
    }
}

/// Which of `v` come first among the keys equal to them: sorted by hash (a
/// stable sort, so equal hashes stay in the order given), each run of one hash
/// compared with `Eq`. No key is hashed again.
fn first_of_each<K: Eq>(v: &[(u64, K)]) -> Vec<bool> {
    let mut order: Vec<usize> = (0..v.len()).collect();
    order.sort_by_key(|&i| v[i].0);
    let mut keep = vec![true; v.len()];
    for run in order.chunk_by(|&a, &b| v[a].0 == v[b].0) {
        for (j, &a) in run.iter().enumerate() {
            if keep[a] {
                for &b in &run[j + 1..] {
                    if keep[b] && v[a].1 == v[b].1 {
                        keep[b] = false;
                    }
                }
            }
        }
    }
    keep
}

impl<K> IntoIterator for KeyList<K> {
    type Item = K;
    type IntoIter = std::iter::Map<
        std::iter::Chain<
            std::iter::Flatten<std::array::IntoIter<Option<(u64, K)>, INLINE>>,
            std::vec::IntoIter<(u64, K)>,
        >,
        fn((u64, K)) -> K,
    >;

    fn into_iter(self) -> Self::IntoIter {
        let (inline, heap) = match self {
            KeyList::Inline(slots, _) => (slots, Vec::new()),
            KeyList::Heap(v) => ([const { None }; INLINE], v),
        };
        let key: fn((u64, K)) -> K = |(_, k)| k;
        inline.into_iter().flatten().chain(heap).map(key)
    }
}

/// One watch of an operation: a key, or a key at a level (see
/// [`Purgatory::try_complete_else_watch_levels`](super::Purgatory::try_complete_else_watch_levels)).
///
/// A plain watch is checked on every [`try_complete_watched`](super::Purgatory::try_complete_watched)
/// and [`try_complete_reached`](super::Purgatory::try_complete_reached) of its
/// key. A watch at a level is checked only once the key has reached that
/// level: a `try_complete_reached(&key, at)` with `at >= level`.
///
/// # Examples
///
/// ```
/// use tokio_purgatory::Watch;
///
/// // A produce waiting for partition 3's high watermark to cover offset 120,
/// // and for any event on the transaction coordinator's key.
/// let watches: [Watch<&str>; 2] = [Watch::level("orders-3", 120), "txn-7".into()];
/// assert_eq!(watches[0].level_of(), Some(120));
/// assert_eq!(watches[1].level_of(), None);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Watch<K> {
    pub(crate) key: K,
    pub(crate) level: Option<u64>,
}

impl<K> Watch<K> {
    /// A plain watch of `key`, as `try_complete_else_watch` makes.
    ///
    /// # Examples
    ///
    /// ```
    /// let w = tokio_purgatory::Watch::key(7u32);
    /// assert_eq!(w.key_of(), &7);
    /// ```
    pub fn key(key: K) -> Watch<K> {
        Watch { key, level: None }
    }

    /// A watch of `key` at `level`: checked once the key reaches it.
    ///
    /// # Examples
    ///
    /// ```
    /// let w = tokio_purgatory::Watch::level("orders-0", 5_000);
    /// assert_eq!(w.level_of(), Some(5_000));
    /// ```
    pub fn level(key: K, level: u64) -> Watch<K> {
        Watch {
            key,
            level: Some(level),
        }
    }

    /// A watch of `key` checked once the key passes `level`, that is reaches
    /// `level + 1`: [`level`](Watch::level) with the step done for you. A
    /// produce whose last offset is `last` is covered once the high
    /// watermark (the offset after the last record every in-sync replica
    /// has) passes it: `Watch::above(partition, last)`. Nothing passes `u64::MAX`: such a
    /// watch is checked once the key reaches `u64::MAX` (its check decides,
    /// as always).
    ///
    /// # Examples
    ///
    /// ```
    /// use tokio_purgatory::Watch;
    /// assert_eq!(Watch::above("orders-0", 41), Watch::level("orders-0", 42));
    /// assert_eq!(Watch::above(0u8, u64::MAX).level_of(), Some(u64::MAX));
    /// ```
    pub fn above(key: K, level: u64) -> Watch<K> {
        Watch::level(key, level.saturating_add(1))
    }

    /// The key watched.
    ///
    /// # Examples
    ///
    /// ```
    /// assert_eq!(tokio_purgatory::Watch::level(1u8, 2).key_of(), &1);
    /// ```
    pub fn key_of(&self) -> &K {
        &self.key
    }

    /// The level, for a watch at a level.
    ///
    /// # Examples
    ///
    /// ```
    /// assert_eq!(tokio_purgatory::Watch::key(1u8).level_of(), None);
    /// ```
    pub fn level_of(&self) -> Option<u64> {
        self.level
    }
}

impl<K> From<K> for Watch<K> {
    fn from(key: K) -> Watch<K> {
        Watch::key(key)
    }
}

/// The watches of one registration: distinct plain keys, and keys at levels
/// (a key may be watched both ways, and at several levels), each with its hash.
#[derive(Debug)]
pub(crate) struct Watches<K> {
    pub(crate) keys: KeyList<K>,
    /// Keys at levels, each with its hash (a key named at several levels is
    /// hashed once for each: it is watched at each, see `Watch`).
    pub(crate) levels: Vec<(u64, K, u64)>,
}

impl<K: WatchKey> Watches<K> {
    /// Plain keys only (de-duplicated as [`KeyList::distinct`] does), each
    /// hashed once by `hash`.
    pub(crate) fn plain(keys: impl IntoIterator<Item = K>, hash: impl Fn(&K) -> u64) -> Taken<K> {
        let (keys, dups) = KeyList::distinct(keys, hash)?;
        Ok((
            Watches {
                keys,
                levels: Vec::new(),
            },
            dups,
        ))
    }

    /// Plain keys and keys at levels: each watch given is hashed once by
    /// `hash` (a plain duplicate as [`KeyList::distinct`] says). A panic in
    /// key code comes back with every key, as from `distinct`.
    pub(crate) fn mixed(
        watches: impl IntoIterator<Item = Watch<K>>,
        hash: impl Fn(&K) -> u64,
    ) -> Taken<K> {
        let mut at_levels = Vec::new();
        let plain = watches.into_iter().filter_map(|w| match w.level {
            Some(l) => {
                at_levels.push((w.key, l));
                None
            }
            None => Some(w.key),
        });
        let taken = KeyList::distinct(plain, &hash);
        let (keys, dups) = match taken {
            Ok(taken) => taken,
            Err(mut p) => {
                p.keys.extend(at_levels.into_iter().map(|(k, _)| k));
                return Err(p);
            }
        };
        let mut levels = Vec::with_capacity(at_levels.len());
        let mut at_levels = at_levels.into_iter();
        while let Some((k, l)) = at_levels.next() {
            match catch_unwind(AssertUnwindSafe(|| hash(&k))) {
                Ok(h) => levels.push((h, k, l)),
                Err(panic) => {
                    let rest = (levels.into_iter().map(|(_, k, _)| k))
                        .chain(std::iter::once(k))
                        .chain(at_levels.map(|(k, _)| k));
                    return Err(KeyPanic::new(panic, keys, dups, rest));
                }
            }
        }
        Ok((Watches { keys, levels }, dups))
    }

    pub(crate) fn len(&self) -> usize {
        self.keys.len() + self.levels.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<K> IntoIterator for Watches<K> {
    type Item = K;
    type IntoIter = std::iter::Chain<
        <KeyList<K> as IntoIterator>::IntoIter,
        std::iter::Map<std::vec::IntoIter<(u64, K, u64)>, fn((u64, K, u64)) -> K>,
    >;

    fn into_iter(self) -> Self::IntoIter {
        let key: fn((u64, K, u64)) -> K = |(_, k, _)| k;
        self.keys
            .into_iter()
            .chain(self.levels.into_iter().map(key))
    }
}

#[cfg(all(test, not(purgatory_loom)))]
mod tests {
    use super::*;

    fn distinct(keys: Vec<u32>) -> (Vec<u32>, Vec<u32>, bool) {
        let Ok((list, dups)) = KeyList::distinct(keys, |k| u64::from(*k % 8)) else {
            panic!("no key code panics here");
        };
        let inline = matches!(list, KeyList::Inline(..));
        let seen: Vec<u32> = list.iter().map(|(_, k)| *k).collect();
        assert_eq!(seen.len(), list.len());
        assert_eq!(list.into_iter().collect::<Vec<_>>(), seen);
        (seen, dups, inline)
    }

    #[test]
    fn a_few_keys_stay_inline_in_order() {
        assert_eq!(distinct(vec![]), (vec![], vec![], true));
        assert_eq!(distinct(vec![3, 1, 3, 2]), (vec![3, 1, 2], vec![3], true));
        assert_eq!(
            distinct(vec![1, 2, 3, 4, 4]),
            (vec![1, 2, 3, 4], vec![4], true)
        );
    }

    #[test]
    fn more_keys_move_to_the_heap_still_distinct() {
        assert_eq!(
            distinct(vec![1, 2, 3, 4, 5, 1, 5]),
            (vec![1, 2, 3, 4, 5], vec![1, 5], false)
        );
        let many: Vec<u32> = (0..40).chain(0..40).chain([7]).collect();
        let (seen, dups, inline) = distinct(many);
        assert_eq!(seen, (0..40).collect::<Vec<_>>());
        assert_eq!(dups.len(), 41);
        assert!(!inline);
    }
}
