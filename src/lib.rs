//! An async, Tokio-native delayed-operation purgatory (Kafka's
//! `DelayedOperationPurgatory`) on a hierarchical timing wheel, plus the wheel as
//! a standalone timer.
//!
//! # Overview
//!
//! A [`Purgatory<K, Op>`](Purgatory) holds requests that must wait: a produce with
//! `acks=all` waiting for replicas, a fetch waiting for `min.bytes`, a join waiting
//! for its group. Each [`Operation`] is watched under one or more **watch keys** and
//! has a **timeout**; it finishes **exactly once**, either when an event on one of
//! its keys lets a check complete it
//! ([`try_complete_watched`](Purgatory::try_complete_watched)) or when its timeout
//! fires. Request handlers `.await` the [`OperationHandle`]; operations that answer
//! for themselves can be [detached](OperationHandle::detach) and need no task.
//!
//! Timeouts live in a hierarchical timing wheel (O(1) insert and cancel) driven
//! by one **reaper task** on your runtime, which sleeps until the earliest deadline:
//! no fixed polling period, nothing to do while idle. The same wheel is available
//! as a standalone [`Timer`] (Netty's `HashedWheelTimer` role: retries, heartbeats,
//! one-shot timeouts).
//!
//! # Example
//!
//! ```
//! # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
//! use std::sync::atomic::{AtomicU64, Ordering};
//! use std::sync::Arc;
//! use std::time::Duration;
//! use tokio_purgatory::{Completion, Operation, Purgatory};
//!
//! /// Waits until the replicas of a partition have acknowledged `offset`.
//! struct DelayedProduce { high_watermark: Arc<AtomicU64>, offset: u64 }
//!
//! impl Operation for DelayedProduce {
//!     type Output = &'static str;
//!     fn try_complete(&mut self) -> Option<&'static str> {
//!         (self.high_watermark.load(Ordering::Acquire) >= self.offset).then_some("ok")
//!     }
//!     fn on_expiration(self) -> &'static str {
//!         "request timed out"
//!     }
//! }
//!
//! let purgatory: Purgatory<(&str, u32), DelayedProduce> =
//!     Purgatory::builder("produce").build().unwrap();
//! let hw = Arc::new(AtomicU64::new(0));
//!
//! let waiting = purgatory
//!     .try_complete_else_watch(
//!         DelayedProduce { high_watermark: hw.clone(), offset: 100 },
//!         Duration::from_secs(30),
//!         [("orders", 0)],
//!     )
//!     .unwrap();
//! let doomed = purgatory
//!     .try_complete_else_watch(
//!         DelayedProduce { high_watermark: hw.clone(), offset: 900 },
//!         Duration::from_secs(30),
//!         [("orders", 0)],
//!     )
//!     .unwrap();
//!
//! // A follower acknowledged up to offset 150.
//! hw.store(150, Ordering::Release);
//! assert_eq!(purgatory.try_complete_watched(&("orders", 0)), 1);
//! assert_eq!(waiting.await, Ok(Completion::Completed("ok")));
//! assert_eq!(doomed.await, Ok(Completion::Expired("request timed out")));
//! # }
//! ```
//!
//! # Guarantees
//!
//! Each promise names the test that checks it.
//!
//! - **Exactly once.** An operation finishes once, by completion, expiry,
//!   cancellation or shutdown, however these race; its handle yields that one
//!   outcome. Checks of one operation never overlap and never run after it
//!   finished. (`tests/purgatory.rs`: `kafka_try_complete_with_multiple_threads`;
//!   `tests/purgatory_model.rs`; `tests/faults.rs`: `stress_across_threads_balances`;
//!   and the loom models of the state machine in `src/purgatory/state.rs`.)
//! - **No missed events.** An event that arrives while an operation registers,
//!   or while another thread checks it, makes it check again.
//!   (`becomes_completable_during_registration`.)
//! - **Never early.** Nothing expires before its deadline. Deadlines are rounded
//!   up to the tick (default 1 ms), so expiry is late by less than one tick plus
//!   the time the reaper waits to be scheduled (Tokio's own timer rounds its sleep
//!   up to the millisecond, which adds up to 1 ms more). (`wheel` model test;
//!   `fires_no_earlier_than_its_deadline_and_within_a_tick`; `kafka_request_expiry`.)
//! - **No FIFO among equal deadlines.** Entries due in the same tick run in no
//!   promised order; entries of different ticks on one wheel shard run in deadline
//!   order (`kafka_task_expiration_with_three_slots`).
//! - **Far deadlines saturate.** `Duration::MAX` and deadlines past the wheel's top
//!   level never panic or overflow, and never fire early; a deadline past what
//!   `Instant` can hold becomes about 30 years. (`duration_max_saturates_and_never_fires`,
//!   `long_uptime_then_short_timers`.)
//! - **Idle costs nothing.** The reaper wakes only for the earliest deadline, and
//!   not at all while nothing is scheduled. (`idle_reaper_does_not_wake`,
//!   `one_timer_ten_minutes_out_costs_at_most_two_wakeups`.)
//! - **Nothing is lost on rejection.** A refused operation or task is handed back
//!   in the error ([`WatchError`], [`timer::ScheduleError`]).
//!   (`registration_errors_hand_the_operation_back`,
//!   `capacity_limit_hands_the_task_back_and_is_freed_by_expiry_and_cancel`.)
//! - **Shutdown loses nothing.** `shutdown()` hands back every pending operation or
//!   task; handles resolve with [`OperationError::Shutdown`]; once nothing is
//!   pending, `registered = completed + expired + cancelled + handed_back`.
//!   (`shutdown_hands_back_everything_and_counts_balance`.)
//! - **A lost reaper is detected.** If the reaper's runtime shuts down or the task
//!   is aborted, pending handles resolve with [`OperationError::ReaperGone`] and
//!   registration fails with the operation handed back.
//!   (`reaper_gone_resolves_handles_and_refuses_registration`.)
//! - **User panics are contained.** A panicking check, expiry or timer task, and
//!   a panicking `Drop` of any operation, output, key or task the crate drops, is
//!   caught, counted and reported through `tracing`; the call that ran it finishes
//!   its work, every handle resolves, other operations still complete and expire.
//!   A panic in a key's `Hash`, `Eq` or `Clone` propagates to the caller, with the
//!   purgatory left as it was before the call.
//! - **No lock of ours is held while operation code runs**, nor while the crate
//!   drops a user value, so operations, outputs, keys and tasks may call back in
//!   (including `shutdown()`) from their code and their `Drop`. Two locks do
//!   surround user code, by design: an operation's own lock around its
//!   `try_complete` (checks of one operation never overlap), and a watcher-map
//!   shard lock around a key's `Hash`, `Eq` and `Clone`, which must not call back in.
//! - **Finished operations free their memory at once**: the operation at once, an
//!   output as soon as its handle reads it or is dropped. What stays in other
//!   keys' lists is a tombstone keeping the operation's cell
//!   ([`Purgatory::cell_bytes`]), removed by the next walk of that key or an
//!   amortised purge, and counted in [`PurgatoryMetrics::tombstones`].
//!
//! Under faults and hostile use (`tests/faults.rs`, `tests/overload.rs`):
//!
//! - **Re-entrancy is safe.** Timer tasks and operation code may schedule, cancel,
//!   register, walk keys (their own included) and shut down from inside, without
//!   deadlock. (`timer_tasks_reenter_the_timer`, `shutdown_from_inside_a_check`,
//!   `reentrant_calls_from_operation_code_do_not_deadlock`.)
//! - **A dropped runtime leaves nothing hanging.** Every handle resolves with an
//!   error saying why, including handles never polled; nothing panics in `Drop`.
//!   (`runtime_dropped_while_handles_are_awaited`,
//!   `dropping_the_last_purgatory_resolves_handles`.)
//! - **Handles are safe to share and to keep.** Polling from several tasks wakes
//!   the latest; a timer handle whose slot was reused can never touch the newer
//!   entry (generation-tagged keys); purgatory handles own their operation's cell.
//!   (`latest_poller_is_woken`, `stale_handle_cannot_cancel_the_task_that_reuses_its_slot`.)
//! - **Misbehaving keys cannot corrupt.** Duplicate keys are watched once; keys
//!   whose `Hash` and `Eq` disagree at worst leave an operation to its timeout; a
//!   churning key space shrinks back to an empty map.
//!   (`duplicate_keys_are_watched_once`, `hash_and_eq_disagreeing_keys_fall_back_to_the_timeout`,
//!   `key_churn_leaves_an_empty_map`.)
//! - **Overload is refused, not queued.** At the pending limit, registrations come
//!   back with their operation and counts never drift; without a limit, memory is
//!   linear in pending operations and returns once they finish.
//!   (`overload_is_refused_without_loss_and_memory_is_linear`.)
//! - **Long runs drain.** `examples/soak.rs` runs a mixed load for any number of
//!   minutes and checks that pending counts return to zero, the counters balance,
//!   the live heap returns to its size before the load, and RSS to within 10% of
//!   its level before the load. On glibc, RSS only returns with the per-thread
//!   cache off (see the soak's docs and the README's "Memory and the allocator");
//!   the crate frees everything either way.
//!
//! # Feature flags
//!
//! None. The crate uses `tokio` (`rt`, `time`, `sync`, `macros`), `futures` (for
//! `AtomicWaker`) and `tracing`.
//!
//! # Implementation notes
//!
//! - **The wheel** is a hierarchical timing wheel in the style of Varghese and
//!   Lauck's "Hashed and Hierarchical Timing Wheels" (SOSP 1987) and of Kafka's
//!   `TimingWheel` (KIP/"Purgatory Redesign", 2015): `levels` levels of up to 64
//!   slots, entries in a paged slab threaded into intrusive lists, occupancy
//!   bitmaps to find the next bucket without scanning. Entries cascade down
//!   the levels, so none fires early. Unlike Kafka's it is pure (no clock, no locks)
//!   and needs no `DelayQueue` of buckets: the bitmaps answer "what is next".
//! - **The reaper** is one Tokio task per timer or purgatory. It reads Tokio's
//!   clock once per turn, sleeps until the earliest bucket of any shard, and is
//!   re-armed by inserts of earlier deadlines made while it sleeps (a
//!   compare-and-swap on the wake target plus a [`tokio::sync::Notify`]); inserts
//!   made during its turn lower the target without waking it again. Expired work runs on the reaper in bounded
//!   batches with every lock released; there is no unbounded queue of expired work.
//! - **The watcher map** is a sharded `HashMap<K, Vec<cell>>`. A key's list is
//!   copied under its lock and checked outside it.
//! - **The purgatory** ties them: each operation lives in a small cell with an
//!   atomic state machine (see `purgatory/state.rs`) that serialises checks
//!   and lets expiry or cancellation that arrive mid-check be done by the checker.
//!
//! Kafka's bugs this design avoids by construction: lost completions under lock
//! contention (KAFKA-6653), deadlocks from checking under a watcher-list lock
//! (KAFKA-3994, KAFKA-8334), `onComplete` racing `tryComplete` (KAFKA-19312),
//! completed operations held by other keys' lists until a purge (KAFKA-19389,
//! KAFKA-19763: here the payload is freed at completion), a reaper that wakes every
//! 200 ms, and pending operations abandoned at shutdown.

#![forbid(unsafe_code)]
#![warn(
    missing_docs,
    missing_debug_implementations,
    rust_2018_idioms,
    unreachable_pub
)]
#![doc(test(attr(deny(warnings))))]

mod clock;
mod loom;
pub mod purgatory;
mod reaper;
mod settings;
pub mod timer;
mod watchers;
mod wheel;

pub use purgatory::{
    Completion, OpRef, Operation, OperationError, OperationHandle, Purgatory, PurgatoryBuilder,
    PurgatoryMetrics, WatchError, WatchKey,
};
pub use settings::BuildError;
pub use timer::{Timer, TimerBuilder};
