//! Synchronisation helpers every room uses: the primitives of the code that loom
//! checks (std's in a normal build, loom's under `--cfg purgatory_loom`, so one
//! body of code runs both ways, as tokio's `src/loom/` does), the lock helper,
//! thread indices, [`Padded`], and [`Striped`], the one way a count every
//! operation changes is spread over threads.
//!
//! The loom-checked protocols: each cell's life word, its operation's state
//! machine and reference count together (`purgatory/state.rs`), the handle's
//! delivery slot and the timer key's slot (`purgatory/cell.rs`), the slab's
//! free lists (`purgatory/slab.rs`), the drain's waiting tasks against the
//! last finish (`purgatory/books.rs`), and the reaper's wake target
//! (`wake.rs`). Under loom
//! those types work only inside `loom::model`, so that build runs the loom tests
//! alone (`cargo test --release --lib loom`).

#[cfg(purgatory_loom)]
pub(crate) use loom::sync::{
    atomic::{AtomicU16, AtomicU32, AtomicU64, AtomicU8},
    Mutex, MutexGuard,
};
#[cfg(not(purgatory_loom))]
pub(crate) use std::sync::{
    atomic::{AtomicU16, AtomicU32, AtomicU64, AtomicU8},
    Mutex, MutexGuard,
};

/// Locks `m`. Every lock of the crate recovers from poisoning: the data behind
/// them is changed only by code of ours that does not panic part-way (user code
/// that runs under a lock runs before the change it guards, or inside
/// `catch_unwind`), so a poisoned lock still guards consistent data.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Reads `m`'s poison flag, a plain load, without taking the lock: brings
/// the mutex's cache line in ahead of a lock that will follow. Nothing under
/// loom, whose mutex has no such flag.
pub(crate) fn touch<T>(m: &Mutex<T>) {
    #[cfg(not(purgatory_loom))]
    std::hint::black_box(m.is_poisoned());
    #[cfg(purgatory_loom)]
    let _ = m;
}

/// Adds one to `count` if it is below `max`; returns whether it did.
#[inline]
pub(crate) fn take_room(count: &std::sync::atomic::AtomicUsize, max: usize) -> bool {
    let mut n = count.load(std::sync::atomic::Ordering::Acquire);
    loop {
        if n >= max {
            return false;
        }
        match count.compare_exchange_weak(
            n,
            n + 1,
            std::sync::atomic::Ordering::AcqRel,
            std::sync::atomic::Ordering::Acquire,
        ) {
            Ok(_) => return true,
            Err(now) => n = now,
        }
    }
}

/// A number naming the current thread, never 0 and never shared by two threads:
/// the key of the thread's timer shard, and who owns an operation's check.
#[inline]
pub(crate) fn thread_index() -> u64 {
    use std::cell::Cell;
    use std::sync::atomic::{AtomicU64 as Counter, Ordering};
    static NEXT: Counter = Counter::new(1);
    thread_local! {
        // 0 until the thread first asks: a constant initialiser makes each
        // later call one load, with no lazy-initialisation state to test.
        static INDEX: Cell<u64> = const { Cell::new(0) };
    }
    INDEX.with(|i| match i.get() {
        0 => {
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            i.set(n);
            n
        }
        n => n,
    })
}

/// Keeps a value on cache lines of its own (each timer shard's lock, the
/// purgatory's hot counters, each stripe of a [`Striped`]).
#[derive(Debug, Default)]
#[repr(align(128))]
pub(crate) struct Padded<T>(pub(crate) T);

/// How many stripes a [`Striped`] value has.
pub(crate) const STRIPES: usize = 8;

/// One value per thread stripe, each on cache lines of its own: what every
/// operation changes (counts, kept buffers) without one shared word bouncing
/// between the threads that register, complete and expire. A thread uses the
/// stripe its index picks ([`Striped::mine`]); readers go through all of them.
/// Threads whose indices collide share a stripe, so its contents must still be
/// safe to share (atomics, or a lock).
#[derive(Debug)]
pub(crate) struct Striped<T>(Box<[Padded<T>]>);

impl<T: Default> Default for Striped<T> {
    fn default() -> Self {
        Striped((0..STRIPES).map(|_| Padded(T::default())).collect())
    }
}

impl<T> Striped<T> {
    /// The calling thread's stripe.
    pub(crate) fn mine(&self) -> &T {
        &self.0[(thread_index() % STRIPES as u64) as usize].0
    }

    /// The calling thread's stripe number.
    pub(crate) fn my_index() -> usize {
        (thread_index() % STRIPES as u64) as usize
    }

    /// Stripe `i` (below [`STRIPES`]).
    pub(crate) fn nth(&self, i: usize) -> &T {
        &self.0[i].0
    }

    /// Every stripe.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &T> {
        self.0.iter().map(|p| &p.0)
    }
}
