//! One key's watch list: plain entries in the order they watched (with the hole
//! a purge in progress leaves), entries at levels in a heap, and the walks,
//! prunes and purge slices over them.

use std::collections::BinaryHeap;

/// A key's watch list: entries in the order they watched, and the hole a purge
/// in progress leaves behind it.
///
/// A purge done in slices compacts a long list as it goes: it moves each live
/// entry it visits down to the end of the kept part and takes finished ones out,
/// leaving `None` in `items[hole.0..hole.1]`, and goes on from `hole.1` at its
/// next slice. A slice so costs its budget, however long the list: closing the
/// hole after each slice would move the whole rest of the list each time (with
/// Kafka's semantics every pending operation is on the same few lists, and
/// those moves came to most of a purge's cost). Every other visit skips the
/// hole; one that rewrites the list closes it.
#[derive(Debug)]
pub(super) struct List<V> {
    pub(super) items: Vec<Option<V>>,
    /// `items[hole.0..hole.1]` are `None`, all others `Some`. `hole.1` is how
    /// far the purge in progress has gone; `(0, 0)` when none has begun.
    pub(super) hole: (usize, usize),
    /// The entries watching the key at a level, lowest level first.
    levels: BinaryHeap<Leveled<V>>,
    /// Orders entries of equal level by arrival.
    next_seq: u64,
}

/// An entry watching its key at `level`.
#[derive(Debug)]
struct Leveled<V> {
    level: u64,
    seq: u64,
    v: V,
}

impl<V> PartialEq for Leveled<V> {
    fn eq(&self, o: &Self) -> bool {
        (self.level, self.seq) == (o.level, o.seq)
    }
}

impl<V> Eq for Leveled<V> {}

impl<V> PartialOrd for Leveled<V> {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}

impl<V> Ord for Leveled<V> {
    /// Reversed: `BinaryHeap` is a max-heap, and the lowest level comes first.
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (o.level, o.seq).cmp(&(self.level, self.seq))
    }
}

impl<V> List<V> {
    /// A list holding its first entry, plain or at a level, in a buffer of
    /// one (most keys have few watchers).
    pub(super) fn first(level: Option<u64>, v: V) -> Self {
        let mut list = List {
            items: Vec::new(),
            hole: (0, 0),
            levels: BinaryHeap::new(),
            next_seq: 0,
        };
        match level {
            None => list.items = vec![Some(v)],
            Some(level) => list.push_level(level, v),
        }
        list
    }

    /// Entries held (the hole is not counted).
    pub(super) fn len(&self) -> usize {
        self.items.len() - (self.hole.1 - self.hole.0) + self.levels.len()
    }

    /// Adds an entry watching the key at `level`.
    pub(super) fn push_level(&mut self, level: u64, v: V) {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.levels.push(Leveled { level, seq, v });
    }

    /// The key reached `level`: takes out every level entry at or below it.
    /// Finished ones go to `out`; each live one is shown to `reached` and put
    /// back one level above `level`, so that it is still watched while it is
    /// checked and a later advance asks for it again (a check that said "not
    /// yet" is so repeated on the next advance, and on no other).
    pub(super) fn reach(
        &mut self,
        level: u64,
        finished: impl Fn(&V) -> bool,
        mut reached: impl FnMut(&V),
        out: &mut Vec<V>,
    ) {
        // An entry put back has a sequence number from `start` on: at `level`
        // below `u64::MAX` it is above `level` anyway; at `u64::MAX`, where one
        // above saturates, this is what stops the loop at it.
        let start = self.next_seq;
        while self
            .levels
            .peek()
            .is_some_and(|top| top.level <= level && top.seq < start)
        {
            let Some(e) = self.levels.pop() else { break };
            if finished(&e.v) {
                out.push(e.v);
            } else {
                reached(&e.v);
                self.push_level(level.saturating_add(1), e.v);
            }
        }
        self.fit();
    }

    /// Takes the finished level entries out into `out` (a purge's visit).
    /// Returns how many entries it looked at.
    pub(super) fn sweep_levels(
        &mut self,
        finished: impl Fn(&V) -> bool,
        out: &mut Vec<V>,
    ) -> usize {
        let n = self.levels.len();
        if n > 0 {
            let mut kept = Vec::with_capacity(n);
            for e in std::mem::take(&mut self.levels).into_vec() {
                if finished(&e.v) {
                    out.push(e.v);
                } else {
                    kept.push(e);
                }
            }
            self.levels = BinaryHeap::from(kept);
            // Room for the `n` looked at: what a burst's buffer gives back.
            self.fit();
        }
        n
    }

    /// Takes the finished level entries out into `out`, in place, when there
    /// are at most `max` level entries to look at (an advance that completed
    /// a quarter as many pays for the pass).
    pub(super) fn prune_levels(
        &mut self,
        max: usize,
        finished: impl Fn(&V) -> bool,
        out: &mut Vec<V>,
    ) where
        V: Clone,
    {
        if self.levels.is_empty() || self.levels.len() > max {
            return;
        }
        self.levels.retain(|e| {
            let done = finished(&e.v);
            if done {
                out.push(e.v.clone());
            }
            !done
        });
        // The advance's `reach` fitted the heap before its checks finished
        // anything: a burst it completed gives its buffer back here.
        self.fit();
    }

    pub(super) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub(super) fn push(&mut self, v: V) {
        self.items.push(Some(v));
    }

    /// Adds an entry, plain or watching the key at `level`.
    pub(super) fn add(&mut self, level: Option<u64>, v: V) {
        match level {
            None => self.push(v),
            Some(level) => self.push_level(level, v),
        }
    }

    /// Takes out the entries `finished` picks into `out`, in order, showing each
    /// kept one to `kept`; the hole closes.
    pub(super) fn retain(
        &mut self,
        finished: impl Fn(&V) -> bool,
        kept: impl FnMut(&V),
        out: &mut Vec<V>,
    ) {
        let kept_end = self.compact(0, 0..self.items.len(), finished, kept, out);
        self.items.truncate(kept_end);
        self.hole = (0, 0);
        self.fit();
    }

    /// Gives back most of a buffer a burst grew past [`KEPT`] entries and the
    /// list no longer needs (at most a quarter of it in use): a key that
    /// always has watchers would otherwise keep its peak for good. It keeps
    /// room for twice what it holds, and at least [`KEPT_AFTER`] entries, so
    /// that a list that grows and shrinks around one size does not
    /// reallocate each time, and one of a few thousand entries never does.
    fn fit(&mut self) {
        let (len, cap) = (self.items.len(), self.items.capacity());
        if cap > KEPT && len < cap / 4 {
            self.items.shrink_to((len * 2).max(KEPT_AFTER));
        }
        let (len, cap) = (self.levels.len(), self.levels.capacity());
        if cap > KEPT && len < cap / 4 {
            self.levels.shrink_to((len * 2).max(KEPT_AFTER));
        }
    }

    /// Visits `items[range]`, every entry before `range` from `kept_end` on
    /// being `None`: takes the finished entries out into `out`, shows each
    /// kept one to `kept` and moves it down to `kept_end`. Returns the end of
    /// the kept part; from there to `range.end` all are `None`.
    pub(super) fn compact(
        &mut self,
        mut kept_end: usize,
        range: std::ops::Range<usize>,
        finished: impl Fn(&V) -> bool,
        mut kept: impl FnMut(&V),
        out: &mut Vec<V>,
    ) -> usize {
        let mut at = range.start;
        while at < range.end {
            let chunk = (range.end - at).min(CHUNK);
            let gone = finished_flags(&self.items[at..at + chunk], &finished);
            for (i, &gone) in gone[..chunk].iter().enumerate() {
                let Some(v) = self.items[at + i].take() else {
                    continue;
                };
                if gone {
                    out.push(v);
                } else {
                    kept(&v);
                    // At or before `at + i`, and `None` (taken, or in the hole).
                    self.items[kept_end] = Some(v);
                    kept_end += 1;
                }
            }
            at += chunk;
        }
        kept_end
    }

    /// One slice of a purge: visits at most `budget` entries from where the
    /// last slice stopped, takes the finished ones out into `out`, and returns
    /// how many it visited and whether it reached the end of the list.
    pub(super) fn sweep(
        &mut self,
        budget: usize,
        finished: impl Fn(&V) -> bool,
        out: &mut Vec<V>,
    ) -> (usize, bool) {
        let (kept_end, start) = self.hole;
        let end = start.saturating_add(budget).min(self.items.len());
        let kept_end = self.compact(kept_end, start..end, &finished, |_| {}, out);
        if end == self.items.len() {
            // Only `None`s past the kept part: nothing to drop.
            self.items.truncate(kept_end);
            self.hole = (0, 0);
            self.fit();
            // The level entries in one go: a heap has no order to resume in.
            let levels = self.sweep_levels(finished, out);
            (end - start + levels, true)
        } else {
            self.hole = (kept_end, end);
            (end - start, false)
        }
    }

    pub(super) fn into_entries(self) -> impl Iterator<Item = V> {
        self.items
            .into_iter()
            .flatten()
            .chain(self.levels.into_iter().map(|e| e.v))
    }
}

/// Entries a walk or a purge asks `finished` about before acting on the answers.
pub(super) const CHUNK: usize = 64;

/// Room for entries (of each kind) a list keeps whatever its length.
const KEPT: usize = 4096;
/// Room a list that gives back a burst's buffer keeps.
const KEPT_AFTER: usize = 1024;

/// Which of `items` (at most [`CHUNK`]) are finished entries. Asked in a pass of
/// their own, with no branch taken on an answer: each question reads an
/// operation's state, mostly a cache miss (the cells of a long list are spread
/// over the heap and were last touched by other threads), and independent
/// reads let the processor fetch many cells at once instead of one after the
/// other. The pass that acts on the answers then finds the cells in cache.
pub(super) fn finished_flags<V>(
    items: &[Option<V>],
    finished: impl Fn(&V) -> bool,
) -> [bool; CHUNK] {
    let mut gone = [false; CHUNK];
    for (flag, item) in gone.iter_mut().zip(items) {
        *flag = item.as_ref().is_some_and(&finished);
    }
    gone
}

#[cfg(all(test, not(purgatory_loom)))]
mod tests {
    use super::*;

    /// Walks and purge slices ask about entries a chunk at a time: across
    /// chunk boundaries and slices that end mid-chunk, live entries keep their
    /// order and finished ones come out in theirs.
    #[test]
    fn chunked_walks_and_slices_keep_order() {
        let n = 3 * CHUNK as u32 + 5;
        let finished = |v: &u32| v.is_multiple_of(3);
        let live: Vec<u32> = (0..n).filter(|v| !finished(v)).collect();
        let gone: Vec<u32> = (0..n).filter(finished).collect();

        let mut list = List::first(None, 0u32);
        (1..n).for_each(|v| list.push(v));
        let (mut kept, mut out) = (Vec::new(), Vec::new());
        list.retain(finished, |v| kept.push(*v), &mut out);
        assert_eq!((kept, out), (live.clone(), gone.clone()));
        assert_eq!(
            list.items,
            live.iter().map(|v| Some(*v)).collect::<Vec<_>>()
        );

        let mut list = List::first(None, 0u32);
        (1..n).for_each(|v| list.push(v));
        let mut out = Vec::new();
        let mut slices = 0;
        while !list.sweep(CHUNK + 7, finished, &mut out).1 {
            slices += 1;
            // A walk between slices closes the hole and keeps the order.
            if slices == 1 {
                let mut seen = Vec::new();
                list.retain(|_| false, |v| seen.push(*v), &mut Vec::new());
                assert!(seen.windows(2).all(|w| w[0] < w[1]), "{seen:?}");
            }
        }
        assert_eq!(out, gone);
        assert_eq!(
            list.items,
            live.iter().map(|v| Some(*v)).collect::<Vec<_>>()
        );
    }
}
