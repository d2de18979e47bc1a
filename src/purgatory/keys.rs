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

    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
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
