//! The purgatory's books: how many operations were admitted, turned back and
//! finished with each fate, the tombstones their finishes left in watch lists,
//! the limit on pending operations, and the drain flag.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll, Waker};

use super::WatchErrorKind;
use crate::contain::Panics;
use crate::core::RefusedMetrics;
use crate::sync::{lock, Mutex, Padded, Striped};

/// How a finished operation is counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fate {
    Completed,
    Expired,
    /// Cancelled by key or by dropping its handle, or dropped unrun because the
    /// purgatory was dropped or lost its reaper.
    Cancelled,
    HandedBack,
}

impl Fate {
    /// Its code in the operation's state (never 0).
    pub(crate) fn code(self) -> u8 {
        self as u8 + 1
    }

    /// The fate of a code recorded by [`code`](Fate::code).
    pub(crate) fn from_code(code: u8) -> Option<Fate> {
        [
            Fate::Completed,
            Fate::Expired,
            Fate::Cancelled,
            Fate::HandedBack,
        ]
        .get(usize::from(code).checked_sub(1)?)
        .copied()
    }
}

/// Where a refusal for `kind` is counted in a stripe.
fn refusal_index(kind: WatchErrorKind) -> usize {
    match kind {
        WatchErrorKind::AtCapacity => 0,
        WatchErrorKind::Shutdown => 1,
        WatchErrorKind::ReaperGone => 2,
        WatchErrorKind::Draining => 3,
        WatchErrorKind::NoKeys => 4,
    }
}

/// One thread stripe's share of the per-operation counts.
///
/// Each fact is counted once: an admission, a turning back, and each fate. What
/// follows from them is derived when read: registered operations are those
/// admitted and not turned back, and those that left are the ones turned back
/// plus every fate. So a registration changes one count, and a finish one.
#[derive(Debug, Default)]
struct Stripe {
    /// Operations admitted. With the counts of those that left (`turned_back`
    /// and the fates), all only grow, so a sum read in the right order never
    /// misses an operation pending throughout the read (see `delayed_now`).
    admitted: AtomicU64,
    /// Admitted, then turned back before registering (refused while draining,
    /// or a key's code panicked).
    turned_back: AtomicU64,
    completed: AtomicU64,
    expired: AtomicU64,
    cancelled: AtomicU64,
    handed_back: AtomicU64,
    /// Watch-list entries of finished operations (tombstones) made and
    /// removed: a finish adds its keys, a removal takes off what it removed.
    /// Wrapping, so a stripe may go below zero; the sum is exact.
    tombstones: AtomicU64,
    /// Registrations refused, by [`WatchErrorKind`] (in its order): those
    /// turned back after admission, and those refused before.
    refused: [AtomicU64; 5],
}

impl Stripe {
    /// Operations that left: turned back, or finished with any fate.
    fn left(&self) -> u64 {
        self.turned_back.load(Ordering::SeqCst)
            + self.completed.load(Ordering::SeqCst)
            + self.expired.load(Ordering::SeqCst)
            + self.cancelled.load(Ordering::SeqCst)
            + self.handed_back.load(Ordering::SeqCst)
    }
}

/// The per-operation counts, striped by thread. Every registration and every
/// outcome changes them; one shared word per count would bounce its cache line
/// between the registering, completing and expiring threads on every operation.
/// A thread writes its own stripe; readers sum all of them, which is exact when
/// no call races the read. Watch-list entries are counted by the watcher map
/// (all of them) and here (tombstones); live entries are the difference.
#[derive(Debug)]
pub(crate) struct Books {
    stripes: Striped<Stripe>,
    /// Admitted and not yet decided (completed, expired, cancelled or handed
    /// back: see [`free_room`](Self::free_room)), kept only under a limit (it
    /// is the one count every registration must agree on). The stripes count
    /// operations out later, once their finish is done (`delayed`).
    admitted: Padded<AtomicUsize>,
    max_pending: Option<usize>,
    /// Set by `drain`: registrations are refused, and each finish wakes the
    /// drainers. Read by every registration and finish, written once.
    draining: AtomicBool,
    drainers: Mutex<Drainers>,
}

/// The tasks waiting in `drain`, each under its own id. Ours rather than
/// tokio's `Notify`, because a waker is user code: `Notify` clones a waker
/// under its own lock (a clone that calls back in and finishes an operation
/// would wait for that lock forever), and when one waker panics in `wake` it
/// drops the others it had taken without waking them. Here wakers are cloned,
/// woken and dropped with no lock held, each on its own.
#[derive(Debug, Default)]
struct Drainers {
    /// The id the next drain takes.
    next: u64,
    waiting: Vec<(u64, Waker)>,
}

/// The future of [`Books::drain`].
#[derive(Debug)]
pub(crate) struct Drain<'a> {
    books: &'a Books,
    panics: &'a Panics,
    /// Its id among the drainers, from its first wait on.
    id: Option<u64>,
}

impl Drain<'_> {
    /// Takes this drain's waker out of the list, and drops it contained.
    fn leave(&mut self) {
        let Some(id) = self.id.take() else { return };
        let left = {
            let mut d = lock(&self.books.drainers);
            let at = d.waiting.iter().position(|(i, _)| *i == id);
            at.map(|at| d.waiting.swap_remove(at).1)
        };
        self.panics.drop_value("drop of a waker", left);
    }
}

impl Future for Drain<'_> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        if this.books.delayed_now() == 0 {
            this.leave();
            return Poll::Ready(());
        }
        // Waiting, then looking again: a finish counted after the look below
        // takes the waker left here (the list's lock orders the two), and one
        // counted before it is seen.
        let fresh = cx.waker().clone();
        let replaced = {
            let mut d = lock(&this.books.drainers);
            let id = match this.id {
                Some(id) => id,
                None => {
                    d.next += 1;
                    this.id = Some(d.next);
                    d.next
                }
            };
            match d.waiting.iter_mut().find(|(i, _)| *i == id) {
                Some((_, w)) => Some(std::mem::replace(w, fresh)),
                None => {
                    d.waiting.push((id, fresh));
                    None
                }
            }
        };
        this.panics.drop_value("drop of a waker", replaced);
        if this.books.delayed_now() == 0 {
            this.leave();
            return Poll::Ready(());
        }
        Poll::Pending
    }
}

impl Drop for Drain<'_> {
    fn drop(&mut self) {
        self.leave();
    }
}

/// A sum of the per-operation counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Totals {
    pub(crate) delayed: usize,
    pub(crate) registered: u64,
    pub(crate) completed: u64,
    pub(crate) expired: u64,
    pub(crate) cancelled: u64,
    pub(crate) handed_back: u64,
}

impl Books {
    pub(crate) fn new(max_pending: Option<usize>) -> Books {
        Books {
            stripes: Striped::default(),
            admitted: Padded(AtomicUsize::new(0)),
            max_pending,
            draining: AtomicBool::new(false),
            drainers: Mutex::new(Drainers::default()),
        }
    }

    #[inline]
    fn mine(&self) -> &Stripe {
        self.stripes.mine()
    }

    /// Counts an operation in, unless the purgatory holds `max_pending`
    /// already. The count is sequentially consistent, as the other changes and
    /// the sum are: they pair with the draining flag (see
    /// [`turn_back_if_draining`](Self::turn_back_if_draining)); on x86 a
    /// read-modify-write costs the same with any ordering.
    #[inline]
    pub(crate) fn admit(&self) -> bool {
        if let Some(max) = self.max_pending {
            // Taken only while there is room: a refused registration never
            // counts, not even for a moment (an add taken back after would
            // turn away another registration racing it while there was room).
            if !crate::sync::take_room(&self.admitted.0, max) {
                return false;
            }
        }
        self.mine().admitted.fetch_add(1, Ordering::SeqCst);
        true
    }

    /// Undoes [`admit`](Self::admit) for an operation that never registered.
    /// Returns whether a drainer may be waiting for it (a registration
    /// admitted before `drain` began and turned back after, say by a key that
    /// panicked, is the last thing that drainer waits for): the caller then
    /// wakes the drainers ([`wake_drainers`](Self::wake_drainers)).
    #[must_use]
    pub(crate) fn unadmit(&self) -> bool {
        if self.max_pending.is_some() {
            self.admitted.0.fetch_sub(1, Ordering::AcqRel);
        }
        self.mine().turned_back.fetch_add(1, Ordering::SeqCst);
        self.draining.load(Ordering::SeqCst)
    }

    /// Wakes the tasks waiting in `drain`. Their wakers are user code (a
    /// waker built from a raw vtable may panic in `wake`): a panic is caught
    /// and counted in `panics`, so that the finish or refusal that woke them
    /// goes on.
    pub(crate) fn wake_drainers(&self, panics: &Panics) {
        let waiting = std::mem::take(&mut lock(&self.drainers).waiting);
        for (_, waker) in waiting {
            panics.run("wake of a drain", move || waker.wake());
        }
    }

    /// Whether an admitted registration must turn back because the purgatory is
    /// draining; then it is unadmitted here, and the caller wakes the
    /// drainers ([`wake_drainers`](Self::wake_drainers)). The admission's count and this read
    /// pair with `drain`'s write of the flag and read of the count (all
    /// sequentially consistent): either this sees the flag, or the drainer sees
    /// the operation and waits for it.
    #[inline]
    pub(crate) fn turn_back_if_draining(&self) -> bool {
        if !self.draining.load(Ordering::SeqCst) {
            return false;
        }
        let _draining = self.unadmit();
        true
    }

    /// Stops taking operations (from this call on, whether or not the future
    /// is ever polled) and waits until none is pending. A panic in the
    /// waker's `clone` reaches the poller, with nothing kept; one in its
    /// `Drop` is contained in `panics`.
    pub(crate) fn drain<'a>(&'a self, panics: &'a Panics) -> Drain<'a> {
        self.draining.store(true, Ordering::SeqCst);
        Drain {
            books: self,
            panics,
            id: None,
        }
    }

    #[inline]
    pub(crate) fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// An operation's fate is decided (whatever user code its finish runs,
    /// its `on_expiration` or the drop of the operation, has not run yet):
    /// its room under the limit is free, so that code may register another
    /// in its place. Called once per registered operation, by whoever
    /// decides its fate ([`Op::decide`](super::cell::Op::decide), or a
    /// registration completed by its first check).
    #[inline]
    pub(crate) fn free_room(&self) {
        if self.max_pending.is_some() {
            self.admitted.0.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// An operation finished with `fate` (its room under the limit was given
    /// back when its fate was decided, [`free_room`](Self::free_room)),
    /// and its `keys` list entries are tombstones now. Returns whether a
    /// drainer may be waiting for it: the caller then wakes the drainers
    /// ([`wake_drainers`](Self::wake_drainers)).
    #[inline]
    #[must_use]
    pub(crate) fn finished(&self, fate: Fate, keys: u32) -> bool {
        let s = self.mine();
        let counter = match fate {
            Fate::Completed => &s.completed,
            Fate::Expired => &s.expired,
            Fate::Cancelled => &s.cancelled,
            Fate::HandedBack => &s.handed_back,
        };
        counter.fetch_add(1, Ordering::SeqCst);
        if keys > 0 {
            self.tombstones_changed(i64::from(keys));
        }
        self.draining.load(Ordering::SeqCst)
    }

    /// `n` watch-list entries became tombstones (negative: were removed).
    #[inline]
    pub(crate) fn tombstones_changed(&self, n: i64) {
        // `SeqCst`, as the reads in `tombstones`: a completion that counts
        // its tombstones and then finds the reaper asleep with nothing
        // scheduled, and the reaper that ends its turn so and then reads the
        // count, cannot miss each other (see `WakeTarget::sleeps_with_nothing`).
        self.mine().tombstones.fetch_add(n as u64, Ordering::SeqCst);
    }

    /// Tombstones (sums the stripes: exact when no call races the read; a
    /// removal counted just before the finish that made its entries
    /// tombstones reads as none rather than below zero).
    #[inline]
    pub(crate) fn tombstones(&self) -> usize {
        let sum = self.stripes.iter().fold(0u64, |sum, s| {
            sum.wrapping_add(s.tombstones.load(Ordering::SeqCst))
        });
        (sum as i64).max(0) as usize
    }

    /// Operations admitted and not finished. Reads every stripe's `left` before
    /// any `admitted`: an operation counted as left was admitted before, so its
    /// admission is counted too, and an operation pending throughout the read is
    /// counted in `admitted` only. Zero so means that no operation was pending
    /// throughout (what `drain` needs); racing calls may make it a little high.
    pub(crate) fn delayed_now(&self) -> usize {
        let left: u64 = self.stripes.iter().map(Stripe::left).sum();
        let admitted: u64 = self
            .stripes
            .iter()
            .map(|s| s.admitted.load(Ordering::SeqCst))
            .sum();
        admitted.saturating_sub(left) as usize
    }

    /// Counts a registration refused for `why` (and handed back).
    pub(crate) fn refused(&self, why: WatchErrorKind) {
        self.mine().refused[refusal_index(why)].fetch_add(1, Ordering::Relaxed);
    }

    /// The refusals so far, by reason.
    pub(crate) fn refusals(&self) -> RefusedMetrics {
        let mut n = [0u64; 5];
        for s in self.stripes.iter() {
            for (sum, count) in n.iter_mut().zip(&s.refused) {
                *sum = sum.wrapping_add(count.load(Ordering::Relaxed));
            }
        }
        let at = |kind| n[refusal_index(kind)];
        RefusedMetrics {
            at_capacity: at(WatchErrorKind::AtCapacity),
            shutdown: at(WatchErrorKind::Shutdown),
            reaper_gone: at(WatchErrorKind::ReaperGone),
            draining: at(WatchErrorKind::Draining),
            no_keys: at(WatchErrorKind::NoKeys),
        }
    }

    pub(crate) fn totals(&self) -> Totals {
        let mut t = Totals {
            delayed: self.delayed_now(),
            ..Totals::default()
        };
        let mut turned_back = 0;
        for s in self.stripes.iter() {
            t.registered += s.admitted.load(Ordering::Relaxed);
            turned_back += s.turned_back.load(Ordering::Relaxed);
            t.completed += s.completed.load(Ordering::Relaxed);
            t.expired += s.expired.load(Ordering::Relaxed);
            t.cancelled += s.cancelled.load(Ordering::Relaxed);
            t.handed_back += s.handed_back.load(Ordering::Relaxed);
        }
        t.registered = t.registered.saturating_sub(turned_back);
        t
    }
}

#[cfg(all(test, not(purgatory_loom)))]
mod tests {
    use super::{Books, Fate};

    #[test]
    fn tombstones_are_counted_once_and_a_dip_reads_as_none() {
        let b = Books::new(None);
        assert!(!b.finished(Fate::Completed, 3), "not draining"); // a three-key operation finished
        assert_eq!(b.tombstones(), 3);
        b.tombstones_changed(-2); // two removed by walks
        assert_eq!(b.tombstones(), 1);
        b.tombstones_changed(-2); // removed by a cancel just before its finish is counted
        assert_eq!(b.tombstones(), 0, "a dip reads as none");
        b.tombstones_changed(2); // the finish of that two-key operation
        assert_eq!(b.tombstones(), 1);
    }

    #[test]
    fn registered_and_pending_follow_from_admissions_and_fates() {
        let b = Books::new(None);
        for _ in 0..5 {
            assert!(b.admit());
        }
        assert!(!b.unadmit(), "not draining");
        assert!(!b.finished(Fate::Completed, 0), "not draining");
        assert!(!b.finished(Fate::Expired, 0), "not draining");
        let t = b.totals();
        assert_eq!((t.registered, t.delayed), (4, 2));
        assert_eq!(
            (t.completed, t.expired, t.cancelled, t.handed_back),
            (1, 1, 0, 0)
        );
    }
}

#[cfg(all(test, not(purgatory_loom)))]
mod limit_tests {
    use super::{Books, Fate};

    #[test]
    fn the_limit_admits_up_to_max_pending_and_frees_room_once_a_fate_is_decided() {
        let b = Books::new(Some(2));
        assert!(b.admit());
        assert!(b.admit());
        assert!(!b.admit(), "at the limit");
        b.free_room();
        assert!(b.admit(), "a decided fate freed room");
        assert!(!b.admit(), "at the limit");
        assert!(!b.finished(Fate::Completed, 1), "not draining");
        assert!(!b.admit(), "the finish itself frees nothing more");
        assert!(!b.unadmit(), "not draining");
        assert!(b.admit(), "turning back freed room");
        assert_eq!(b.totals().delayed, 2);
    }
}

#[cfg(all(test, purgatory_loom))]
mod loom_drain {
    //! A drain racing the last finish: it either sees nothing pending or is
    //! woken, and a drain dropped while waiting leaves no waker behind.

    use super::*;
    use loom::thread;
    use std::sync::Arc;
    use std::task::Wake;

    struct Counter(loom::sync::atomic::AtomicUsize);

    impl Wake for Counter {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, loom::sync::atomic::Ordering::SeqCst);
        }
    }

    fn finish(books: &Books, panics: &Panics) {
        if books.finished(Fate::Completed, 0) {
            books.wake_drainers(panics);
        }
    }

    #[test]
    fn loom_a_drain_racing_the_last_finish_returns_or_is_woken() {
        loom::model(|| {
            let books = Arc::new(Books::new(None));
            let panics = Arc::new(Panics::new("purgatory", "loom".into()));
            assert!(books.admit());
            let t = {
                let (books, panics) = (books.clone(), panics.clone());
                thread::spawn(move || finish(&books, &panics))
            };
            let woken = Arc::new(Counter(loom::sync::atomic::AtomicUsize::new(0)));
            let waker = Waker::from(woken.clone());
            let mut cx = Context::from_waker(&waker);
            let mut drain = std::pin::pin!(books.drain(&panics));
            let first = drain.as_mut().poll(&mut cx);
            t.join().unwrap();
            if first.is_pending() {
                // Waiting when the finish came: it took the waker and woke it.
                assert_eq!(
                    woken.0.load(loom::sync::atomic::Ordering::SeqCst),
                    1,
                    "lost wake-up"
                );
                assert!(drain.as_mut().poll(&mut cx).is_ready());
            }
            assert!(lock(&books.drainers).waiting.is_empty(), "no waker left");
        });
    }

    #[test]
    fn loom_a_drain_dropped_while_a_finish_wakes_leaves_nothing() {
        loom::model(|| {
            let books = Arc::new(Books::new(None));
            let panics = Arc::new(Panics::new("purgatory", "loom".into()));
            assert!(books.admit());
            assert!(books.admit());
            let waker = Waker::from(Arc::new(Counter(loom::sync::atomic::AtomicUsize::new(0))));
            let mut cx = Context::from_waker(&waker);
            let mut drain = Box::pin(books.drain(&panics));
            assert!(drain.as_mut().poll(&mut cx).is_pending());
            let t = {
                let (books, panics) = (books.clone(), panics.clone());
                thread::spawn(move || finish(&books, &panics))
            };
            drop(drain);
            t.join().unwrap();
            assert!(lock(&books.drainers).waiting.is_empty(), "no waker left");
            assert_eq!(books.delayed_now(), 1);
        });
    }
}
