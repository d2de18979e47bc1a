//! A global allocator that counts live heap bytes, for the benches, tests and
//! examples that measure memory. Each includes this file with `#[path]` and
//! installs `Counting` as its `#[global_allocator]`. The crate itself forbids
//! unsafe code; only this measuring aid needs it.
#![allow(dead_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};

/// Forwards to the system allocator, counting bytes in use.
pub struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size() as isize, Ordering::Relaxed);
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size() as isize, Ordering::Relaxed);
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        LIVE.fetch_add(new as isize - l.size() as isize, Ordering::Relaxed);
        unsafe { System.realloc(p, l, new) }
    }
}

/// Heap bytes in use now.
pub fn live_bytes() -> isize {
    LIVE.load(Ordering::SeqCst)
}
