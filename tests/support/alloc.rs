//! A global allocator that counts live heap bytes, for the benches, tests and
//! examples that measure memory. Each includes this file with `#[path]` and
//! installs `Counting` as its `#[global_allocator]`. The crate itself forbids
//! unsafe code; only this measuring aid needs it.
#![allow(dead_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicIsize, Ordering};

/// Forwards to the system allocator, counting bytes in use.
pub struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);
static PAUSED: AtomicBool = AtomicBool::new(false);

/// Stops (or resumes) counting. The count is one atomic shared by every
/// thread, so counting taxes each allocation; a program that measures speed
/// in a process of its own turns it off there. Counts are meaningless once
/// paused and resumed.
pub fn pause_counting(paused: bool) {
    PAUSED.store(paused, Ordering::SeqCst);
}

fn counting() -> bool {
    !PAUSED.load(Ordering::Relaxed)
}

thread_local! {
    /// Allocations (and reallocations) made by this thread.
    static MINE: Cell<u64> = const { Cell::new(0) };
}

thread_local! {
    /// Bytes this thread allocated less those it freed, and the most that
    /// has been since `reset_peak_here`.
    static MINE_LIVE: Cell<isize> = const { Cell::new(0) };
    static MINE_PEAK: Cell<isize> = const { Cell::new(0) };
}

fn count_mine() {
    // No destructor and a constant initialiser: never allocates, and still
    // usable while the thread is being torn down.
    let _ = MINE.try_with(|n| n.set(n.get() + 1));
}

fn grow_mine(bytes: isize) {
    let _ = MINE_LIVE.try_with(|live| {
        let now = live.get() + bytes;
        live.set(now);
        let _ = MINE_PEAK.try_with(|peak| peak.set(peak.get().max(now)));
    });
}

/// Starts measuring the calling thread's peak heap use from now; returns
/// what it holds now (by its own allocations and frees).
pub fn reset_peak_here() -> isize {
    let live = MINE_LIVE.try_with(Cell::get).unwrap_or(0);
    let _ = MINE_PEAK.try_with(|peak| peak.set(live));
    live
}

/// The most heap bytes the calling thread has held since `reset_peak_here`
/// (subtract what that returned for the growth).
pub fn peak_here() -> isize {
    MINE_PEAK.try_with(Cell::get).unwrap_or(0)
}

/// Allocations and reallocations made so far by the calling thread, while
/// counting is on (not while paused, so the speed runs pay nothing for it).
/// Per thread, so tests running at once on other threads do not disturb it.
pub fn allocations_here() -> u64 {
    MINE.try_with(Cell::get).unwrap_or(0)
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        if counting() {
            count_mine();
            grow_mine(l.size() as isize);
            LIVE.fetch_add(l.size() as isize, Ordering::Relaxed);
        }
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        if counting() {
            grow_mine(-(l.size() as isize));
            LIVE.fetch_sub(l.size() as isize, Ordering::Relaxed);
        }
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        if counting() {
            count_mine();
            grow_mine(new as isize - l.size() as isize);
            LIVE.fetch_add(new as isize - l.size() as isize, Ordering::Relaxed);
        }
        unsafe { System.realloc(p, l, new) }
    }
}

/// Heap bytes in use now.
pub fn live_bytes() -> isize {
    LIVE.load(Ordering::SeqCst)
}

/// Asks the C allocator to give freed memory back to the system, so that RSS
/// shows what the process holds rather than what the allocator keeps cached.
///
/// By itself glibc gives memory back only from the top of an arena, and only
/// when a free leaves a free block of 64 KiB or more; small freed chunks below
/// the top stay resident. A program whose allocations are all small, like a
/// purgatory's, can free everything and still show its peak RSS. `malloc_trim(0)`
/// consolidates every arena and releases the free pages anywhere in it; live
/// memory cannot be released, so a leak still shows. Does nothing off glibc.
pub fn trim() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        extern "C" {
            fn malloc_trim(pad: usize) -> std::ffi::c_int;
        }
        // SAFETY: malloc_trim takes no pointers and is thread-safe; it only
        // releases pages the allocator owns and no live allocation uses.
        unsafe { malloc_trim(0) };
    }
}
