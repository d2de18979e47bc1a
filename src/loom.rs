//! The synchronisation primitives of the code that loom checks, in one place (as
//! tokio's `src/loom/` does): std's in a normal build, loom's under
//! `--cfg purgatory_loom`, so one body of code runs both ways.
//!
//! Only the small concurrent protocols use it: the per-operation state machine
//! (`purgatory/state.rs`), the handle's delivery slot (`purgatory/cell.rs`) and the
//! reaper's wake target (`reaper.rs`). Under loom those types work only inside
//! `loom::model`, so that build runs the loom tests alone
//! (`cargo test --release --lib loom`).

#[cfg(purgatory_loom)]
pub(crate) use loom::sync::{
    atomic::{AtomicU64, AtomicU8},
    Mutex, MutexGuard,
};
#[cfg(not(purgatory_loom))]
pub(crate) use std::sync::{
    atomic::{AtomicU64, AtomicU8},
    Mutex, MutexGuard,
};

/// Locks `m`. Every lock of the crate recovers from poisoning: the data behind
/// them is changed only by code of ours that does not panic part-way (user code
/// that runs under a lock runs before the change it guards, or inside
/// `catch_unwind`), so a poisoned lock still guards consistent data.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A number naming the current thread, never 0 and never shared by two threads:
/// the key of the thread's timer shard, and who owns an operation's check.
pub(crate) fn thread_index() -> u64 {
    use std::sync::atomic::{AtomicU64 as Counter, Ordering};
    static NEXT: Counter = Counter::new(1);
    thread_local! {
        static INDEX: u64 = NEXT.fetch_add(1, Ordering::Relaxed);
    }
    INDEX.with(|i| *i)
}
