//! Where the operations live: a slab of cells, each named by an [`Id`] (its
//! index and the generation of its current use), so that watch lists and the
//! timer name an operation without owning it.
//!
//! # Ground rules
//!
//! - **A cell's life** is one word ([`Life`], loom-checked, in `state.rs`):
//!   its generation, the operation's state (finished, being checked, what
//!   was asked of its checker) and a count of the references that keep the
//!   cell (the handle, each [`OpRef`](super::OpRef), and each call using it
//!   for a moment). An [`Id`] kept in a watch list or a timer entry is not
//!   counted: whoever uses one first acquires it, begins its check or claims
//!   it, each of which fails once the operation has finished or the cell is
//!   reused. So a finished operation's list entries hold no memory, and
//!   recognising one as a tombstone reads one word.
//! - **Freeing.** The last release of a finished cell that nobody checks
//!   frees it: the generation moves on (every [`Id`] of the old use fails
//!   from then on) and its index goes on a free list. Nothing can acquire a
//!   finished cell, so nothing races the free. The cell is re-initialised by
//!   whoever allocates it next, before its new [`Id`] is handed to anyone.
//! - **Memory.** Cells come in pages (32 cells, doubling to [`PAGE`], 1,024) that are
//!   allocated as the slab first grows and then kept for reuse, as a `Vec`
//!   keeps its capacity: a
//!   freed cell is reused by the next registration (on the same thread, most
//!   recently freed first, while its memory is still in cache), and nothing is
//!   allocated per operation once the slab has grown to the most operations
//!   in cells at once. A cell's operation and outcome are dropped at the finish
//!   and when read; only the cell's own bytes stay.
//! - **Free lists** are per thread stripe (the thread that frees pushes to its
//!   own); a thread whose list is empty takes another stripe's whole list.
//!   Each is a lock-free stack linked through the free cells themselves (a
//!   word each cell lends while it is free, [`FreeLink`]), so a list takes
//!   no memory of its own and never allocates. Its head carries a count of
//!   its changes beside the top index, so a pop that read a top which was
//!   popped and pushed back meanwhile (its link may have changed) fails and
//!   tries again. Loom checks it (`loom_free_lists`).

use std::num::NonZeroU32;
use std::sync::atomic::Ordering;
use std::sync::OnceLock;

use super::state::{Life, Released};
use crate::sync::{AtomicU32, AtomicU64, Striped, STRIPES};

/// Cells in the first page; each of the next [`SMALL`]` - 1` pages holds as
/// many as all pages before it, so a slab that stays small stays small.
const FIRST: usize = 32;
/// Pages that grow (32, 32, 64, ... 1,024 cells: 2,048 in all).
const SMALL: usize = 7;
/// Cells in the small pages together.
const SMALL_CELLS: usize = FIRST << (SMALL - 1);
/// Cells in each page past the small ones. A page is written whole when it
/// is made (every cell set up empty), so the last one's unused cells count in
/// the process's memory: with 152-byte cells (an 80-byte operation) a page
/// of 1,024 cells is 152 KiB, where 4,096 cells made 608 KiB.
pub(crate) const PAGE: usize = 1024;
/// Pages per directory past the small pages.
const PAGES: usize = 1024;
/// Directories.
const DIRS: usize = 64;
/// The most cells a slab holds (about 67 million).
pub(crate) const CAPACITY: usize = SMALL_CELLS + DIRS * PAGES * PAGE;

/// Names one use of a cell: its index, and the generation of that use
/// (never 0, so that an `Option<Id>` in a watch list takes 8 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Id {
    index: u32,
    generation: NonZeroU32,
}

/// A page: the cells' lives side by side (eight to a cache line, so that
/// purges and walks telling tombstones from live entries, and references
/// taken and dropped, touch a small dense array), and the cells.
#[derive(Debug)]
struct Page<T> {
    lives: Box<[Life]>,
    cells: Box<[T]>,
}
/// Pages past the small ones, made as the slab grows into them.
/// (An array, not a slice: indexing it by `% PAGES` needs no bounds check.)
type Dir<T> = Box<[OnceLock<Page<T>>; PAGES]>;

/// A cell the slab can link its free lists through: a word that nothing
/// else reads or writes while the cell is free (a new use sets it up again).
pub(crate) trait FreeLink {
    /// The word.
    fn free_link(&self) -> &AtomicU32;
}

/// No index: the end of a free list.
const NIL: u32 = u32::MAX;

/// A free list's head: the top index (low half) and a count of the list's
/// changes (high half).
#[derive(Debug)]
struct FreeList(AtomicU64);

impl Default for FreeList {
    fn default() -> Self {
        FreeList(AtomicU64::new(u64::from(NIL)))
    }
}

/// A head word after `head` with `top` on top.
fn head_after(head: u64, top: u32) -> u64 {
    ((head >> 32).wrapping_add(1) << 32) | u64::from(top)
}

/// The slab (see the module's ground rules).
pub(crate) struct Slab<T> {
    small: [OnceLock<Page<T>>; SMALL],
    dirs: [OnceLock<Dir<T>>; DIRS],
    /// Indices never used yet start here.
    next: AtomicU32,
    free: Striped<FreeList>,
}

impl<T> std::fmt::Debug for Slab<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slab")
            .field("grown_to", &self.next.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl<T: Default + FreeLink> Slab<T> {
    pub(crate) fn new() -> Self {
        Slab {
            small: std::array::from_fn(|_| OnceLock::new()),
            dirs: std::array::from_fn(|_| OnceLock::new()),
            next: AtomicU32::new(0),
            free: Striped::default(),
        }
    }

    /// Where `index` lives: its page's cell, the number of cells that page
    /// holds, and its offset in it.
    fn locate(&self, index: u32) -> (&OnceLock<Page<T>>, usize, usize) {
        let i = index as usize;
        if i < FIRST {
            (&self.small[0], FIRST, i)
        } else if i < SMALL_CELLS {
            // Page p >= 1 holds [FIRST << (p - 1), FIRST << p).
            let p = (usize::BITS - (i / FIRST).leading_zeros()) as usize;
            let start = FIRST << (p - 1);
            (&self.small[p], start, i - start)
        } else {
            let j = i - SMALL_CELLS;
            let dir = self.dirs[j / (PAGES * PAGE)].get_or_init(|| {
                let pages: Box<[_]> = (0..PAGES).map(|_| OnceLock::new()).collect();
                pages
                    .try_into()
                    .unwrap_or_else(|_| unreachable!("PAGES pages"))
            });
            (&dir[(j / PAGE) % PAGES], PAGE, j % PAGE)
        }
    }

    /// The page of an index handed out, and the offset in it: as
    /// [`locate`](Self::locate), reading only (the page and its directory
    /// were made before the index was handed out).
    #[inline]
    fn page(&self, index: u32) -> (&Page<T>, usize) {
        let i = index as usize;
        let (page, offset) = if i >= SMALL_CELLS {
            let j = i - SMALL_CELLS;
            let dir = self.dirs[j / (PAGES * PAGE)].get();
            let dir = dir.expect("an index handed out has its directory");
            (&dir[(j / PAGE) % PAGES], j % PAGE)
        } else {
            let (page, _, offset) = self.locate(index);
            (page, offset)
        };
        (
            page.get().expect("an index handed out has its page"),
            offset,
        )
    }

    #[inline]
    fn life_at(&self, index: u32) -> &Life {
        let (page, offset) = self.page(index);
        &page.lives[offset]
    }

    /// The life word at `id`'s index (whatever use it is in now: its
    /// methods that take a generation tell the use apart).
    #[cfg(all(test, not(purgatory_loom)))]
    pub(crate) fn life(&self, id: Id) -> &Life {
        self.life_at(id.index)
    }

    /// The life word and the cell at `id`'s index, found once.
    #[inline]
    pub(crate) fn entry(&self, id: Id) -> (&Life, &T) {
        let (page, offset) = self.page(id.index);
        (&page.lives[offset], &page.cells[offset])
    }

    /// The generation of `id`'s use.
    #[inline]
    pub(crate) fn generation(id: Id) -> NonZeroU32 {
        id.generation
    }

    #[inline]
    fn cell(&self, index: u32) -> &T {
        let (page, offset) = self.page(index);
        &page.cells[offset]
    }

    /// Makes sure the page of a fresh `index` exists.
    fn grow_to(&self, index: u32) {
        let (page, cells, _) = self.locate(index);
        page.get_or_init(|| Page {
            lives: (0..cells).map(|_| Life::new()).collect(),
            cells: (0..cells).map(|_| T::default()).collect(),
        });
    }

    /// A free index: this stripe's most recently freed, else the top of
    /// another stripe's list (taking that whole list, whose rest becomes this
    /// stripe's: a thread that frees and never registers has no use for its
    /// list), else a fresh one; with its page and offset. `None` at
    /// [`CAPACITY`].
    fn take_index(&self) -> Option<(u32, &Page<T>, usize)> {
        let mine = &self.free.mine().0;
        if let Some(taken) = self.pop(mine) {
            return Some(taken);
        }
        let start = Striped::<()>::my_index();
        for k in 1..STRIPES {
            let theirs = &self.free.nth((start + k) % STRIPES).0;
            if let Some(top) = Self::take_all(theirs) {
                let (page, offset) = self.page(top);
                let rest = page.cells[offset].free_link().load(Ordering::Relaxed);
                if rest != NIL {
                    self.push_list(mine, rest);
                }
                return Some((top, page, offset));
            }
        }
        let fresh = self.next.fetch_add(1, Ordering::Relaxed);
        if fresh as usize >= CAPACITY {
            self.next.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        self.grow_to(fresh);
        let (page, offset) = self.page(fresh);
        Some((fresh, page, offset))
    }

    /// The free-list link of a free cell.
    fn link(&self, index: u32) -> &AtomicU32 {
        self.cell(index).free_link()
    }

    /// Pops the top of `list`: its index, page and offset.
    fn pop(&self, list: &AtomicU64) -> Option<(u32, &Page<T>, usize)> {
        let mut head = list.load(Ordering::Acquire);
        loop {
            let top = head as u32;
            if top == NIL {
                return None;
            }
            // Stale if `top` was popped meanwhile; then the head has changed
            // and the exchange fails.
            let (page, offset) = self.page(top);
            let below = page.cells[offset].free_link().load(Ordering::Relaxed);
            match list.compare_exchange_weak(
                head,
                head_after(head, below),
                Ordering::Acquire,
                Ordering::Acquire,
            ) {
                Ok(_) => return Some((top, page, offset)),
                Err(now) => head = now,
            }
        }
    }

    /// Empties `list`; its top, whose links lead through the rest.
    fn take_all(list: &AtomicU64) -> Option<u32> {
        let mut head = list.load(Ordering::Acquire);
        loop {
            let top = head as u32;
            if top == NIL {
                return None;
            }
            match list.compare_exchange_weak(
                head,
                head_after(head, NIL),
                Ordering::Acquire,
                Ordering::Acquire,
            ) {
                Ok(_) => return Some(top),
                Err(now) => head = now,
            }
        }
    }

    /// Pushes the list of free cells that starts at `first` (linked through to
    /// [`NIL`], held by the caller alone) onto `list`.
    fn push_list(&self, list: &AtomicU64, first: u32) {
        let mut head = list.load(Ordering::Relaxed);
        // The last cell, found once the list turns out not to be empty.
        let mut last = None;
        loop {
            if head as u32 != NIL {
                let last = *last.get_or_insert_with(|| {
                    let mut at = first;
                    loop {
                        let below = self.link(at).load(Ordering::Relaxed);
                        if below == NIL {
                            break at;
                        }
                        at = below;
                    }
                });
                self.link(last).store(head as u32, Ordering::Relaxed);
            } else if let Some(last) = last {
                self.link(last).store(NIL, Ordering::Relaxed);
            }
            match list.compare_exchange_weak(
                head,
                head_after(head, first),
                Ordering::Release,
                Ordering::Relaxed,
            ) {
                Ok(_) => return,
                Err(now) => head = now,
            }
        }
    }

    /// Takes a free cell into use and lets `init` set it up with `value`
    /// (nothing else can reach it yet); the caller holds one reference to it
    /// and owns its check (see [`Life::start`]).
    /// `value` comes back when the slab is full.
    pub(crate) fn insert<V, R>(
        &self,
        value: V,
        init: impl FnOnce(&T, V) -> R,
    ) -> Result<(Id, R), V> {
        let Some((index, page, offset)) = self.take_index() else {
            return Err(value);
        };
        let out = init(&page.cells[offset], value);
        let generation = page.lives[offset].start();
        Ok((Id { index, generation }, out))
    }

    /// The cell at `id`'s index without a reference: whatever use it is in
    /// now, for reads that only hint (pages are never freed while the slab
    /// lives, so the read is always of a cell).
    #[cfg(all(test, not(purgatory_loom)))]
    pub(crate) fn peek(&self, id: Id) -> &T {
        self.cell(id.index)
    }

    /// Another reference to `id`'s cell, from a caller holding one.
    #[inline]
    pub(crate) fn add_ref(&self, id: Id) {
        self.life_at(id.index).add_ref();
    }

    /// Whether `id`'s operation has finished (its list entries are tombstones).
    #[inline]
    pub(crate) fn is_over(&self, id: Id) -> bool {
        self.life_at(id.index).is_over(id.generation)
    }

    /// Drops a reference to `id`'s cell. The last one to a finished cell frees
    /// it, after `clear` has taken out whatever it still held.
    #[inline]
    pub(crate) fn release(&self, id: Id, clear: impl FnOnce(&T)) {
        let (page, offset) = self.page(id.index);
        if page.lives[offset].release() == Released::Last {
            self.free(id.index, page, offset, clear);
        }
    }

    /// Frees the cell at `index` (in `page`, at `offset`) after its last
    /// release. Apart from [`release`](Self::release), which is inlined where
    /// it is called (most releases free nothing).
    #[inline(never)]
    fn free(&self, index: u32, page: &Page<T>, offset: usize, clear: impl FnOnce(&T)) {
        let cell = &page.cells[offset];
        clear(cell);
        if page.lives[offset].free() {
            self.push_free(index, cell);
        }
    }

    /// Puts `index` (a cell just freed, `cell`) on this thread stripe's free
    /// list.
    fn push_free(&self, index: u32, cell: &T) {
        let (list, link) = (&self.free.mine().0, cell.free_link());
        let mut head = list.load(Ordering::Relaxed);
        loop {
            link.store(head as u32, Ordering::Relaxed);
            match list.compare_exchange_weak(
                head,
                head_after(head, index),
                Ordering::Release,
                Ordering::Relaxed,
            ) {
                Ok(_) => return,
                Err(now) => head = now,
            }
        }
    }

    /// The bytes one cell takes (its life word and the value).
    pub(crate) fn slot_bytes() -> usize {
        std::mem::size_of::<Life>() + std::mem::size_of::<T>()
    }

    /// Cells in use (not free), by a walk over every cell.
    #[cfg(all(test, not(purgatory_loom)))]
    pub(crate) fn in_use(&self) -> usize {
        (0..self.grown() as u32)
            .filter(|i| !self.life_at(*i).is_free())
            .count()
    }

    /// Cells the slab holds memory for: every page made, whole (a page is
    /// written whole when it is made), in use or free.
    pub(crate) fn capacity(&self) -> usize {
        let handed_out = (self.next.load(Ordering::Relaxed) as usize).min(CAPACITY);
        let Some(last) = handed_out.checked_sub(1) else {
            return 0;
        };
        if last < FIRST {
            FIRST
        } else if last < SMALL_CELLS {
            // Small page p holds [FIRST << (p - 1), FIRST << p).
            let p = (usize::BITS - (last / FIRST).leading_zeros()) as usize;
            FIRST << p
        } else {
            SMALL_CELLS + ((last - SMALL_CELLS) / PAGE + 1) * PAGE
        }
    }

    /// Cells the slab has grown to (in use or free).
    #[cfg(all(test, not(purgatory_loom)))]
    pub(crate) fn grown(&self) -> usize {
        self.next.load(Ordering::Relaxed) as usize
    }
}

#[cfg(all(test, not(purgatory_loom)))]
mod tests {
    use super::*;
    use crate::purgatory::state::{AfterNotYet, Begin, Claim, Owner, CANCEL};
    use std::sync::atomic::AtomicUsize;

    #[derive(Default)]
    struct Cell(AtomicUsize, AtomicU32);

    impl FreeLink for Cell {
        fn free_link(&self) -> &AtomicU32 {
            &self.1
        }
    }

    /// The indices on `list`, top first.
    fn free_list(s: &Slab<Cell>, list: &FreeList) -> Vec<u32> {
        let mut out = Vec::new();
        let mut at = list.0.load(Ordering::Relaxed) as u32;
        while at != NIL {
            out.push(at);
            at = s.link(at).load(Ordering::Relaxed);
        }
        out
    }

    /// A cell taken into use with nothing set up.
    fn fresh(s: &Slab<Cell>) -> Id {
        s.insert((), |_, ()| ()).unwrap().0
    }

    /// Finishes `id`'s use as a cancel would: its registration's check ends,
    /// a claim wins, and the finisher lets go of its reference. The caller's
    /// reference is left.
    /// The capacity counts whole pages: 32 cells for the first, doubling to
    /// 2,048 across the small pages, then 1,024 more per page.
    #[test]
    fn capacity_counts_whole_pages() {
        let s: Slab<Cell> = Slab::new();
        assert_eq!(s.capacity(), 0);
        let mut made = 0;
        for (cells, capacity) in [
            (1, 32),
            (32, 32),
            (33, 64),
            (65, 128),
            (2048, 2048),
            (2049, 3072),
            (3072, 3072),
            (3073, 4096),
        ] {
            while made < cells {
                fresh(&s);
                made += 1;
            }
            assert_eq!(s.capacity(), capacity, "{cells} cells made");
        }
    }

    fn finish(s: &Slab<Cell>, id: Id) {
        let (life, owner) = (s.life(id), Owner::default());
        assert_eq!(life.end_check(1, &owner), AfterNotYet::Release);
        assert_eq!(life.claim(Slab::<Cell>::generation(id), CANCEL), Claim::Won);
        assert_eq!(life.release(), Released::Kept);
    }

    /// Code a check runs asks for a re-run from the checking thread: the
    /// re-run it causes is marked (the check loop runs it quiet), the next
    /// one is not unless asked so again; other threads ask as ever. The
    /// flags never hide the checking thread's id, and leave nothing behind.
    #[test]
    fn asks_from_inside_a_check_mark_the_rerun() {
        let s: Slab<Cell> = Slab::new();
        let id = fresh(&s);
        let (life, owner) = (s.life(id), Owner::default());
        let generation = Slab::<Cell>::generation(id);
        // The registration owns the check from the start, as thread 1.
        owner.restart(1, 1);
        assert!(
            !life.ask_from_inside(generation, 2, &owner),
            "not the checker"
        );
        assert!(life.ask_from_inside(generation, 1, &owner));
        assert!(life.is_checked_by(1, &owner));
        assert!(!owner.is_rerun_here());
        assert_eq!(life.end_check(1, &owner), AfterNotYet::Recheck);
        assert!(life.is_checked_by(1, &owner));
        assert!(owner.is_rerun_here());
        // Another thread asks during that re-run: the next one is not marked.
        assert_eq!(
            life.begin_check_or_ask(generation, 2, &owner, || {}),
            Begin::Asked
        );
        assert_eq!(
            life.begin_check_or_ask(generation, 1, &owner, || {}),
            Begin::Mine
        );
        assert_eq!(life.end_check(1, &owner), AfterNotYet::Recheck);
        assert!(!owner.is_rerun_here());
        assert!(life.ask_from_inside(generation, 1, &owner));
        assert_eq!(life.end_check(1, &owner), AfterNotYet::Recheck);
        assert!(owner.is_rerun_here());
        assert_eq!(life.end_check(1, &owner), AfterNotYet::Release);
        assert!(!life.is_checked_by(1, &owner));
        assert!(
            !life.ask_from_inside(generation, 1, &owner),
            "no check runs"
        );
        assert_eq!(
            life.begin_check_or_ask(generation, 1, &owner, || {}),
            Begin::Checking
        );
        assert!(!owner.is_rerun_here());
        assert_eq!(life.end_check(1, &owner), AfterNotYet::Release);
        assert_eq!(life.claim(generation, CANCEL), Claim::Won);
    }

    #[test]
    fn an_id_stops_working_once_its_use_is_over() {
        let s: Slab<Cell> = Slab::new();
        let id = s
            .insert(7, |c, v| c.0.store(v, Ordering::Relaxed))
            .unwrap()
            .0;
        assert!(!s.is_over(id));
        assert!(
            s.life(id).acquire(id.generation),
            "a reference to a live use"
        );
        assert_eq!(s.peek(id).0.load(Ordering::Relaxed), 7);
        s.release(id, |_| panic!("not finished"));
        finish(&s, id);
        assert!(s.is_over(id), "finished");
        assert!(
            !s.life(id).acquire(id.generation),
            "nothing acquires a finished cell"
        );
        let mut cleared = 0;
        s.release(id, |_| cleared += 1);
        assert_eq!(cleared, 1, "the last release frees it");
        // The index is reused at once, under a new generation.
        let again = fresh(&s);
        assert_eq!(again.index, id.index);
        assert_ne!(again.generation, id.generation);
        assert!(s.is_over(id) && !s.is_over(again));
        assert!(!s.life(id).acquire(id.generation));
        assert_eq!(s.grown(), 1);
    }

    #[test]
    fn a_cell_that_had_its_last_generation_is_never_used_again() {
        let mut s: Slab<Cell> = Slab::new();
        let id = fresh(&s);
        finish(&s, id);
        s.release(id, |_| {});
        // The freed cell comes back at its last generation.
        s.small[0].get_mut().unwrap().lives[0] = Life::at_generation(u32::MAX);
        let last = fresh(&s);
        assert_eq!((last.index, last.generation.get()), (0, u32::MAX));
        finish(&s, last);
        s.release(last, |_| {});
        assert!(s.is_over(last));
        assert!(!s.life(last).acquire(last.generation));
        assert!(s.life(last).is_free(), "left free");
        let next = fresh(&s);
        assert_ne!(next.index, 0, "a fresh cell, not the worn-out one");
    }

    #[test]
    fn free_lists_grow_and_are_taken_whole() {
        let s: Slab<Cell> = Slab::new();
        let ids: Vec<Id> = (0..1000).map(|_| fresh(&s)).collect();
        for id in &ids {
            finish(&s, *id);
            s.release(*id, |_| {});
        }
        let mine = free_list(&s, s.free.mine());
        assert_eq!(mine.len(), 1000);
        assert_eq!(mine[0], ids[999].index, "the most recently freed on top");
        let mut again: Vec<u32> = (0..1000).map(|_| fresh(&s).index).collect();
        again.sort();
        assert_eq!(
            again,
            (0..1000).collect::<Vec<u32>>(),
            "each freed cell once"
        );
        assert_eq!(s.grown(), 1000);
    }

    #[test]
    fn a_finished_cell_is_freed_by_whichever_reference_goes_last() {
        let s: Slab<Cell> = Slab::new();
        let id = fresh(&s);
        s.add_ref(id); // an OpRef
        finish(&s, id);
        s.release(id, |_| panic!("a reference remains"));
        let mut cleared = false;
        s.release(id, |_| cleared = true);
        assert!(cleared);
    }

    #[test]
    fn pages_are_added_as_it_grows_and_freed_cells_come_back_first() {
        let s: Slab<Cell> = Slab::new();
        let n = SMALL_CELLS + PAGE + 5;
        let ids: Vec<Id> = (0..n).map(|_| fresh(&s)).collect();
        assert_eq!(s.grown(), n);
        let mut seen = std::collections::HashSet::new();
        for id in &ids {
            // Each index has a cell of its own.
            assert!(seen.insert(s.cell(id.index) as *const Cell));
        }
        for id in &ids {
            finish(&s, *id);
            s.release(*id, |_| {});
        }
        for _ in 0..ids.len() {
            fresh(&s);
        }
        assert_eq!(s.grown(), n, "no growth while cells are free");
    }

    #[test]
    fn a_thread_with_no_free_cells_takes_them_from_another() {
        let s = std::sync::Arc::new(Slab::<Cell>::new());
        let ids: Vec<Id> = (0..100).map(|_| fresh(&s)).collect();
        let t = {
            let s = s.clone();
            std::thread::spawn(move || {
                for id in ids {
                    finish(&s, id);
                    s.release(id, |_| {});
                }
            })
        };
        t.join().unwrap();
        fresh(&s);
        assert_eq!(
            free_list(&s, s.free.mine()).len(),
            99,
            "the rest of the list taken is this thread's now"
        );
        for _ in 0..99 {
            fresh(&s);
        }
        assert_eq!(s.grown(), 100, "freed on another thread, reused here");
        // Freed here while the list holds some: pushed onto it.
        let kept: Vec<Id> = (0..3).map(|_| fresh(&s)).collect();
        for id in kept {
            finish(&s, id);
            s.release(id, |_| {});
        }
        assert_eq!(free_list(&s, s.free.mine()).len(), 3);
        assert_eq!(s.grown(), 103);
    }

    #[test]
    fn an_index_maps_to_its_page_across_every_boundary() {
        // The small pages' sizes, and a directory boundary without filling one.
        let s: Slab<Cell> = Slab::new();
        let mut at = 0;
        for p in 0..SMALL {
            let (page, cells, offset) = s.locate(at as u32);
            assert!(std::ptr::eq(page, &s.small[p]), "page {p}");
            assert_eq!(
                (cells, offset),
                (if p == 0 { FIRST } else { FIRST << (p - 1) }, 0)
            );
            let (last, _, end) = s.locate((at + cells - 1) as u32);
            assert!(
                std::ptr::eq(last, page) && end == cells - 1,
                "page {p} ends"
            );
            at += cells;
        }
        assert_eq!(at, SMALL_CELLS);
        let first_big = s.locate(SMALL_CELLS as u32);
        assert_eq!((first_big.1, first_big.2), (PAGE, 0));
        let boundary = (SMALL_CELLS + PAGES * PAGE) as u32;
        s.grow_to(boundary - 1);
        s.grow_to(boundary);
        assert!(!std::ptr::eq(s.cell(boundary - 1), s.cell(boundary)));
        assert!(s.dirs[1].get().is_some() && s.dirs[2].get().is_none());
        assert_eq!(s.locate((CAPACITY - 1) as u32).2, PAGE - 1);
    }
}

#[cfg(all(test, purgatory_loom))]
mod loom_free_lists {
    //! The free lists under loom: pops, pushes and a whole list taken by
    //! another thread, racing, hand out each free index once and lose none,
    //! including when an index is popped and pushed back while another pop
    //! holds a stale view of the list's top.

    use super::*;
    use loom::sync::atomic::AtomicBool;
    use loom::thread;
    use std::sync::Arc;

    #[derive(Default)]
    struct Cell {
        link: AtomicU32,
        /// Set while a holder has the index (it was popped and not pushed).
        held: AtomicBool,
    }

    impl FreeLink for Cell {
        fn free_link(&self) -> &AtomicU32 {
            &self.link
        }
    }

    /// A slab grown to `n` cells, all free on this thread's list.
    fn slab(n: u32) -> Arc<Slab<Cell>> {
        let s = Slab::<Cell>::new();
        for i in 0..n {
            assert_eq!(s.next.fetch_add(1, Ordering::Relaxed), i);
            s.grow_to(i);
        }
        for i in 0..n {
            free(&s, i);
        }
        Arc::new(s)
    }

    fn pop(s: &Slab<Cell>, list: &FreeList) -> Option<u32> {
        let (i, ..) = s.pop(&list.0)?;
        assert!(
            !s.cell(i).held.swap(true, Ordering::Relaxed),
            "handed out twice"
        );
        Some(i)
    }

    /// Frees `i` onto this thread's list (loom runs its threads on one, so
    /// they share a stripe: the races below are on one list).
    fn free(s: &Slab<Cell>, i: u32) {
        s.cell(i).held.store(false, Ordering::Relaxed);
        s.push_free(i, s.cell(i));
    }

    /// Every index on every list, checked free.
    fn drain(s: &Slab<Cell>, into: &mut Vec<u32>) {
        for list in s.free.iter() {
            while let Some(i) = pop(s, list) {
                into.push(i);
            }
        }
    }

    #[test]
    fn loom_free_list_pops_racing_a_pop_and_push_back() {
        loom::model(|| {
            let s = slab(2);
            let t = {
                let s = s.clone();
                thread::spawn(move || {
                    // Both popped and the first pushed back: the top is the
                    // same index as before, with a new link below it.
                    let first = pop(&s, s.free.mine());
                    let second = pop(&s, s.free.mine());
                    if let Some(i) = first {
                        free(&s, i);
                    }
                    second
                })
            };
            let mine = pop(&s, s.free.mine());
            let theirs = t.join().unwrap();
            let mut all: Vec<u32> = mine.into_iter().chain(theirs).collect();
            drain(&s, &mut all);
            all.sort_unstable();
            assert_eq!(all, [0, 1], "each index once, none lost");
        });
    }

    /// Puts `i` on `list` (a free cell of another stripe's).
    fn push_onto(s: &Slab<Cell>, list: &FreeList, i: u32) {
        s.cell(i).held.store(false, Ordering::Relaxed);
        s.link(i).store(NIL, Ordering::Relaxed);
        s.push_list(&list.0, i);
    }

    #[test]
    fn loom_free_list_rest_pushed_onto_a_list_being_popped() {
        loom::model(|| {
            let s = Arc::new(Slab::<Cell>::new());
            for i in 0..4 {
                s.next.fetch_add(1, Ordering::Relaxed);
                s.grow_to(i);
            }
            let other = (Striped::<()>::my_index() + 1) % STRIPES;
            // This stripe holds 2 and 3; another holds 0 and 1.
            push_onto(&s, s.free.mine(), 2);
            push_onto(&s, s.free.mine(), 3);
            push_onto(&s, s.free.nth(other), 0);
            push_onto(&s, s.free.nth(other), 1);
            let t = {
                let s = s.clone();
                thread::spawn(move || pop(&s, s.free.mine()))
            };
            // Takes the other stripe's list and puts its rest onto this
            // stripe's, which is not empty and is being popped meanwhile.
            let top = Slab::<Cell>::take_all(&s.free.nth(other).0).expect("two were free");
            assert!(!s.cell(top).held.swap(true, Ordering::Relaxed));
            let rest = s.link(top).load(Ordering::Relaxed);
            s.push_list(&s.free.mine().0, rest);
            let mut all: Vec<u32> = std::iter::once(top).chain(t.join().unwrap()).collect();
            drain(&s, &mut all);
            all.sort_unstable();
            assert_eq!(all, [0, 1, 2, 3], "each index once, none lost");
        });
    }

    #[test]
    fn loom_free_list_taken_whole_racing_a_push() {
        loom::model(|| {
            let s = slab(3);
            // Index 2 is in use; its owner frees it onto stripe 0 meanwhile.
            let two = pop(&s, s.free.mine()).expect("three were free");
            assert_eq!(two, 2);
            let t = {
                let s = s.clone();
                thread::spawn(move || free(&s, two))
            };
            // Another stripe takes this one's whole list, keeps its top and
            // puts the rest on its own list.
            let other = s.free.nth((Striped::<()>::my_index() + 1) % STRIPES);
            let mut all = Vec::new();
            if let Some(top) = Slab::<Cell>::take_all(&s.free.mine().0) {
                assert!(!s.cell(top).held.swap(true, Ordering::Relaxed));
                all.push(top);
                let rest = s.link(top).load(Ordering::Relaxed);
                if rest != NIL {
                    s.push_list(&other.0, rest);
                }
            }
            t.join().unwrap();
            drain(&s, &mut all);
            all.sort_unstable();
            assert_eq!(all, [0, 1, 2], "each index once, none lost");
        });
    }
}
