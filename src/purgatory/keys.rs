//! The distinct keys of one registration, without an allocation for the common
//! case of a few keys.

use std::collections::HashSet;

use super::WatchKey;

/// Keys held inline before the list moves to the heap.
const INLINE: usize = 4;

/// Distinct keys, in the order given: up to [`INLINE`] in place, more on the heap.
#[derive(Debug)]
pub(crate) enum KeyList<K> {
    Inline([Option<K>; INLINE], usize),
    Heap(Vec<K>),
}

impl<K: WatchKey> KeyList<K> {
    /// The distinct keys of `keys`, in order, and the duplicates (for the caller to
    /// drop with its drops contained). Uses the keys' `Eq` (and, past 16 keys, their
    /// `Hash` too), which may panic: then nothing was kept.
    pub(crate) fn distinct(keys: impl IntoIterator<Item = K>) -> (KeyList<K>, Vec<K>) {
        let mut list = KeyList::Inline([const { None }; INLINE], 0);
        let mut dups = Vec::new();
        for k in keys {
            match &mut list {
                KeyList::Inline(slots, len) => {
                    if slots[..*len].iter().flatten().any(|s| *s == k) {
                        dups.push(k);
                    } else if *len < INLINE {
                        slots[*len] = Some(k);
                        *len += 1;
                    } else {
                        let mut v: Vec<K> = slots.iter_mut().filter_map(Option::take).collect();
                        v.push(k);
                        list = KeyList::Heap(v);
                    }
                }
                KeyList::Heap(v) => {
                    // A scan while short; past 16, one pass with a set at the end.
                    if v.len() < 16 && v.contains(&k) {
                        dups.push(k);
                    } else {
                        v.push(k);
                    }
                }
            }
        }
        if let KeyList::Heap(v) = &mut list {
            if v.len() > 16 {
                let keep: Vec<bool> = {
                    let mut seen = HashSet::with_capacity(v.len());
                    v.iter().map(|k| seen.insert(k)).collect()
                };
                let (kept, more): (Vec<_>, Vec<_>) = std::mem::take(v)
                    .into_iter()
                    .zip(keep)
                    .partition(|(_, keep)| *keep);
                *v = kept.into_iter().map(|(k, _)| k).collect();
                dups.extend(more.into_iter().map(|(k, _)| k));
            }
        }
        (list, dups)
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            KeyList::Inline(_, len) => *len,
            KeyList::Heap(v) => v.len(),
        }
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = &K> {
        let (inline, heap): (&[Option<K>], &[K]) = match self {
            KeyList::Inline(slots, len) => (&slots[..*len], &[]),
            KeyList::Heap(v) => (&[], v),
        };
        inline.iter().flatten().chain(heap)
    }
}

impl<K> IntoIterator for KeyList<K> {
    type Item = K;
    type IntoIter = std::iter::Chain<
        std::iter::Flatten<std::array::IntoIter<Option<K>, INLINE>>,
        std::vec::IntoIter<K>,
    >;

    fn into_iter(self) -> Self::IntoIter {
        let (inline, heap) = match self {
            KeyList::Inline(slots, _) => (slots, Vec::new()),
            KeyList::Heap(v) => ([const { None }; INLINE], v),
        };
        inline.into_iter().flatten().chain(heap)
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
/// (a key may be watched both ways, and at several levels).
#[derive(Debug)]
pub(crate) struct Watches<K> {
    pub(crate) keys: KeyList<K>,
    pub(crate) levels: Vec<(K, u64)>,
}

impl<K: WatchKey> Watches<K> {
    /// Plain keys only (de-duplicated as [`KeyList::distinct`] does).
    pub(crate) fn plain(keys: impl IntoIterator<Item = K>) -> (Watches<K>, Vec<K>) {
        let (keys, dups) = KeyList::distinct(keys);
        (
            Watches {
                keys,
                levels: Vec::new(),
            },
            dups,
        )
    }

    /// Plain keys and keys at levels.
    pub(crate) fn mixed(watches: impl IntoIterator<Item = Watch<K>>) -> (Watches<K>, Vec<K>) {
        let mut levels = Vec::new();
        let plain = watches.into_iter().filter_map(|w| match w.level {
            Some(l) => {
                levels.push((w.key, l));
                None
            }
            None => Some(w.key),
        });
        let (keys, dups) = KeyList::distinct(plain);
        (Watches { keys, levels }, dups)
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
        std::iter::Map<std::vec::IntoIter<(K, u64)>, fn((K, u64)) -> K>,
    >;

    fn into_iter(self) -> Self::IntoIter {
        let first: fn((K, u64)) -> K = |(k, _)| k;
        self.keys
            .into_iter()
            .chain(self.levels.into_iter().map(first))
    }
}

#[cfg(all(test, not(purgatory_loom)))]
mod tests {
    use super::*;

    fn distinct(keys: Vec<u32>) -> (Vec<u32>, Vec<u32>, bool) {
        let (list, dups) = KeyList::distinct(keys);
        let inline = matches!(list, KeyList::Inline(..));
        let seen: Vec<u32> = list.iter().copied().collect();
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
