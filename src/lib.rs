//! An async, Tokio-native delayed-operation purgatory (Kafka's
//! `DelayedOperationPurgatory`) on a hierarchical timing wheel, plus the wheel as
//! a standalone timer.
//!
//! # When to use it
//!
//! A [`Purgatory<K, Op>`](Purgatory) holds requests that must wait for an event or
//! a timeout, whichever comes first: a produce with `acks=all` waiting for
//! replicas, a fetch waiting for `min.bytes`, a join waiting for its group. Each
//! [`Operation`] is watched under one or more **watch keys** and has a
//! **timeout**; it finishes **exactly once**, when an event on one of its keys
//! lets its check complete it
//! ([`try_complete_watched`](Purgatory::try_complete_watched)) or when its timeout
//! fires. Request handlers `.await` the [`OperationHandle`]; operations that answer
//! for themselves can be [detached](OperationHandle::detach) and need no task.
//!
//! It pays off when operations watch several keys, when many operations wait on
//! one key (every produce on a hot partition), when operations are detached
//! callbacks with no task of their own, when millions are pending at once, or
//! when you need exactly-once completion, hand-back on shutdown and a pending
//! limit. A request that is already a task and waits on one thing gains little:
//! `tokio::time::timeout` around a `tokio::sync::watch` or `Notify` wait is
//! enough there.
//!
//! Timeouts live in a hierarchical timing wheel (O(1) insert and cancel) driven
//! by one **reaper task** on your runtime, which sleeps until the earliest deadline:
//! no fixed polling period, nothing to do while idle. The same wheel is available
//! as a standalone [`Timer`] (Netty's `HashedWheelTimer` role: retries, heartbeats,
//! one-shot timeouts). Each purgatory or timer spawns its own reaper, or several
//! share one [`Reaper`] (a broker's produce, fetch and join purgatories and its
//! heartbeat timer on one task).
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
//!     Purgatory::builder().name("produce").build().unwrap();
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
//! # Recipes
//!
//! **Wait for the outcome or something else**, whichever comes first, with
//! `tokio::select!`. The branch not taken is dropped: a dropped handle cancels
//! its operation (call [`OperationHandle::detach`] first to let it run on).
//!
//! ```
//! # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
//! # struct Fetch;
//! # impl tokio_purgatory::Operation for Fetch {
//! #     type Output = &'static str;
//! #     fn try_complete(&mut self) -> Option<&'static str> { None }
//! #     fn on_expiration(self) -> &'static str { "empty" }
//! # }
//! use std::time::Duration;
//! use tokio_purgatory::Purgatory;
//!
//! let fetches: Purgatory<u32, Fetch> = Purgatory::new();
//! let (_client_gone_tx, client_gone) = tokio::sync::oneshot::channel::<()>();
//! let fetch = fetches.try_complete_else_watch(Fetch, Duration::from_millis(500), [1]).unwrap();
//! tokio::select! {
//!     answer = fetch => assert!(answer.is_ok()),
//!     _ = client_gone => { /* the fetch was cancelled when its handle dropped */ }
//! }
//! # }
//! ```
//!
//! **A deadline of the caller's own over a handle**: `tokio::time::timeout`
//! around the handle. If it elapses, the handle is dropped and the operation
//! cancelled; keep the handle (`&mut handle`) to decide instead.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
//! # struct Join;
//! # impl tokio_purgatory::Operation for Join {
//! #     type Output = ();
//! #     fn try_complete(&mut self) -> Option<()> { None }
//! #     fn on_expiration(self) {}
//! # }
//! use std::time::Duration;
//! use tokio_purgatory::Purgatory;
//!
//! let joins: Purgatory<&str, Join> = Purgatory::new();
//! let mut join = joins.try_complete_else_watch(Join, Duration::from_secs(300), ["g"]).unwrap();
//! if tokio::time::timeout(Duration::from_secs(1), &mut join).await.is_err() {
//!     // Give up on this one and get the operation back.
//!     let _join_request: Join = join.cancel().expect("still pending");
//! }
//! # }
//! ```
//!
//! **A detached callback operation** answers for itself from its own code, with
//! no task waiting on it (Kafka's `onComplete`); its output type is `()`. At
//! shutdown neither of its methods runs: `shutdown()` hands it back, for the
//! code that shuts down to answer (see the recipe after this one).
//!
//! ```
//! # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
//! use std::time::Duration;
//! use tokio::sync::mpsc;
//! use tokio_purgatory::{Operation, Purgatory};
//!
//! struct Heartbeat { member: u32, replies: mpsc::UnboundedSender<(u32, &'static str)> }
//! impl Operation for Heartbeat {
//!     type Output = ();
//!     fn try_complete(&mut self) -> Option<()> { None }
//!     fn on_expiration(self) {
//!         let _ = self.replies.send((self.member, "session expired"));
//!     }
//! }
//!
//! let sessions: Purgatory<u32, Heartbeat> = Purgatory::new();
//! let (replies, mut out) = mpsc::unbounded_channel();
//! sessions
//!     .try_complete_else_watch(Heartbeat { member: 7, replies }, Duration::from_secs(10), [7])
//!     .unwrap()
//!     .detach();
//! assert_eq!(out.recv().await, Some((7, "session expired")));
//! # }
//! ```
//!
//! **Graceful shutdown**: stop taking work, give what is pending a bounded time
//! to finish on its own, then hand the rest back and answer it yourself.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
//! # struct Produce(u64);
//! # impl tokio_purgatory::Operation for Produce {
//! #     type Output = ();
//! #     fn try_complete(&mut self) -> Option<()> { None }
//! #     fn on_expiration(self) {}
//! # }
//! use std::time::Duration;
//! use tokio_purgatory::Purgatory;
//!
//! let produce: Purgatory<u32, Produce> = Purgatory::new();
//! let pending = produce.try_complete_else_watch(Produce(1), Duration::from_secs(30), [0]).unwrap();
//! let waiter = tokio::spawn(pending);
//!
//! if tokio::time::timeout(Duration::from_secs(5), produce.drain()).await.is_err() {
//!     for Produce(offset) in produce.shutdown() {
//!         println!("answering produce at offset {offset}: the broker is stopping");
//!     }
//! }
//! assert!(waiter.await.unwrap().is_err(), "handed back by shutdown");
//! # }
//! ```
//!
//! **An axum long-poll handler**: a request that waits until the log has
//! records past the client's position, or answers empty after `max_wait`. The
//! handler is a task already, so it awaits its handle; what the purgatory adds
//! is the check at registration and on every append, with no wake-up lost
//! between them. If the client disconnects, axum drops the handler's future,
//! and with it the handle: the operation is cancelled and leaves the watch
//! lists. Serve `app` with `axum::serve(listener, app)` as usual (`serve`
//! below, with a graceful shutdown that does not wait out parked polls); here
//! it is driven without a socket.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
//! use std::collections::HashMap;
//! use std::sync::{Arc, Mutex};
//! use std::time::Duration;
//!
//! use axum::{body::Body, extract::{Query, State}, http::{Request, StatusCode}};
//! use axum::{routing::{get, post}, Router};
//! use tokio_purgatory::{Operation, Purgatory};
//! use tower::ServiceExt as _;
//!
//! type Log = Arc<Mutex<HashMap<String, Vec<String>>>>;
//!
//! /// Waits for records of `topic` past `from`.
//! struct LongPoll { log: Log, topic: String, from: usize }
//! impl Operation for LongPoll {
//!     type Output = Vec<String>;
//!     fn try_complete(&mut self) -> Option<Vec<String>> {
//!         let log = self.log.lock().unwrap();
//!         let records = log.get(&self.topic)?;
//!         (records.len() > self.from).then(|| records[self.from..].to_vec())
//!     }
//!     fn on_expiration(self) -> Vec<String> { Vec::new() }
//! }
//!
//! #[derive(Clone)]
//! struct App { log: Log, polls: Purgatory<String, LongPoll> }
//!
//! async fn fetch(
//!     State(app): State<App>,
//!     Query(q): Query<HashMap<String, String>>,
//! ) -> Result<String, StatusCode> {
//!     let topic = q.get("topic").cloned().ok_or(StatusCode::BAD_REQUEST)?;
//!     let from = q.get("from").and_then(|f| f.parse().ok()).unwrap_or(0);
//!     let op = LongPoll { log: app.log.clone(), topic: topic.clone(), from };
//!     let handle = app
//!         .polls
//!         .try_complete_else_watch(op, Duration::from_millis(500), [topic])
//!         .map_err(|_| StatusCode::SERVICE_UNAVAILABLE)?;
//!     match handle.await {
//!         Ok(records) => Ok(records.into_inner().join("\n")),
//!         Err(_) => Err(StatusCode::SERVICE_UNAVAILABLE), // shut down
//!     }
//! }
//!
//! async fn produce(
//!     State(app): State<App>,
//!     Query(q): Query<HashMap<String, String>>,
//!     record: String,
//! ) -> StatusCode {
//!     let Some(topic) = q.get("topic") else { return StatusCode::BAD_REQUEST };
//!     app.log.lock().unwrap().entry(topic.clone()).or_default().push(record);
//!     app.polls.try_complete_watched(topic); // after the append, not before
//!     StatusCode::NO_CONTENT
//! }
//!
//! let state = App { log: Log::default(), polls: Purgatory::new() };
//! let app = Router::new()
//!     .route("/fetch", get(fetch))
//!     .route("/produce", post(produce))
//!     .with_state(state.clone());
//!
//! let get_req = |uri: &str| Request::get(uri).body(Body::empty()).unwrap();
//! let waiting = tokio::spawn(app.clone().oneshot(get_req("/fetch?topic=t&from=0")));
//! tokio::task::yield_now().await; // the fetch is parked
//! assert_eq!(state.polls.delayed(), 1);
//!
//! let append = Request::post("/produce?topic=t").body(Body::from("hello")).unwrap();
//! assert_eq!(app.clone().oneshot(append).await.unwrap().status(), StatusCode::NO_CONTENT);
//! let answer = waiting.await.unwrap().unwrap();
//! let body = axum::body::to_bytes(answer.into_body(), 1 << 20).await.unwrap();
//! assert_eq!(&body[..], b"hello");
//!
//! // Nothing past position 1 arrives: the answer is empty, after 500 ms.
//! let start = tokio::time::Instant::now();
//! let empty = app.clone().oneshot(get_req("/fetch?topic=t&from=1")).await.unwrap();
//! assert_eq!(start.elapsed(), Duration::from_millis(500));
//! assert!(axum::body::to_bytes(empty.into_body(), 1 << 20).await.unwrap().is_empty());
//!
//! /// Serves until Ctrl-C. A graceful shutdown waits for requests in
//! /// flight, parked long-polls included: shutting the purgatory down first
//! /// answers them at once (503 here) instead of after their max_wait.
//! async fn serve(
//!     listener: tokio::net::TcpListener,
//!     app: Router,
//!     polls: Purgatory<String, LongPoll>,
//! ) -> std::io::Result<()> {
//!     axum::serve(listener, app)
//!         .with_graceful_shutdown(async move {
//!             let _ = tokio::signal::ctrl_c().await;
//!             drop(polls.shutdown()); // parked polls answer now
//!         })
//!         .await
//! }
//! # let _ = serve;
//!
//! // What that shutdown does to a parked poll: it answers at once.
//! let parked = tokio::spawn(app.oneshot(get_req("/fetch?topic=t&from=1")));
//! tokio::task::yield_now().await;
//! let start = tokio::time::Instant::now();
//! drop(state.polls.shutdown());
//! let answer = parked.await.unwrap().unwrap();
//! assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE);
//! assert_eq!(start.elapsed(), Duration::ZERO);
//! # }
//! ```
//!
//! # Guarantees
//!
//! - **Exactly once.** An operation finishes once, by completion, expiry,
//!   cancellation or shutdown, however these race; its handle yields that one
//!   outcome. Checks of one operation never overlap and never run after it
//!   finished.
//! - **No missed events.** An event that arrives while an operation registers,
//!   or while another thread checks it, makes it check again (for a watch at
//!   a level, an event is a call that reaches the level the watch stands at,
//!   see [`Purgatory::try_complete_reached`]), unless it is
//!   cancelled or its timeout fires during that check (it then finishes so,
//!   once the check under way says "not yet"). Events that keep asking for a
//!   re-run faster than the check runs keep the thread checking it re-running
//!   it until it completes, is cancelled or expires (a registration, whose
//!   timeout is not armed yet, until such a storm pauses). On the thread that
//!   checks it: the check's own walk of its own keys is not an event to it
//!   (it knows what it did); a walk from code the check caused through a
//!   call of its own (another operation's check, expiry or drop, the code
//!   of a key that call hashes, compares, clones or drops, or the drop of an
//!   output or the wake of a waker it caused) makes it check once more when
//!   it ends. While such a re-run runs, events raised
//!   on that thread, by it or by what it runs, ask for no re-run of checks
//!   under way there (checks that walk each other's keys each time they run
//!   would otherwise re-run each other for ever on one thread).
//! - **Never early.** Nothing expires before its deadline. Deadlines are rounded
//!   up to the tick (default 100 µs), so expiry is late by less than one tick
//!   plus the time the reaper waits to be scheduled (Tokio's own timer rounds its
//!   sleep up to its millisecond grid and then parks for whole milliseconds
//!   from wherever its clock stands, which adds up to 2 ms more). A deadline already
//!   reached (a zero timeout, a past instant) runs on the reaper, never inline:
//!   at its next turn, or later in the turn under way when that turn still has
//!   due entries to take.
//! - **No FIFO among equal deadlines.** Entries due in the same tick run in no
//!   promised order.
//! - **Far deadlines saturate.** `Duration::MAX` and deadlines past the wheel's top
//!   level never panic or overflow, and never fire early; a deadline past what
//!   `Instant` can hold becomes about 30 years. The wheel counts up to about
//!   2^63 ticks from its start (292 years at a 1 ns tick, 29 million years at
//!   the default): a deadline past that never fires.
//! - **Idle costs nothing.** The reaper wakes once per distinct due time, and not
//!   at all while nothing is scheduled; an entry due before everything else
//!   pending wakes a sleeping reaper once more, to set its alarm earlier; a task
//!   rescheduling itself from inside its own run costs one wake-up per run (on
//!   a shared [`Reaper`], also when it schedules on another timer or
//!   purgatory the reaper serves). An entry that leaves before it is due
//!   (cancelled, completed, moved later, a timeout whose future won) does not
//!   move the alarm set for it: if it was the earliest, the reaper wakes once
//!   at that instant, finds nothing due, and sleeps until what is next. A
//!   purgatory left with nothing pending and more than about 2,000 watch
//!   entries to purge has the reaper take the rest in turns of its own (woken
//!   once for them when a thread other than the reaper's left it idle), as
//!   does one whose expiry or cancellation leaves as many tombstones as live
//!   entries in a map of more than about 1,000 (woken once for it when
//!   that cancellation was not on the reaper). The
//!   call that leaves it idle starts that purge when it is an expiry or a
//!   cancellation, and when it is a completion made while the reaper sleeps
//!   with nothing scheduled; otherwise (completions while the finished
//!   operations' timeouts still hold the reaper's alarm) the reaper's turn
//!   that alarm brings starts it, with no wake-up added. Operations with far
//!   timeouts (hours, `Duration::MAX`) completed with no registration or key
//!   walk after them so keep their tombstones until then.
//! - **Nothing is lost on rejection.** A refused operation or task is handed back
//!   in the error ([`WatchError`], [`timer::ScheduleError`]).
//! - **Shutdown loses nothing.** `shutdown()` hands back every pending operation or
//!   task; handles resolve with [`OperationError::Shutdown`]; once nothing is
//!   pending, `registered = completed + expired + cancelled + handed_back`.
//! - **A lost reaper is detected.** If the reaper's runtime shuts down or the task
//!   is aborted, pending handles resolve with [`OperationError::ReaperGone`] and
//!   registration fails with the operation handed back; an operation whose
//!   check was running at that moment resolves so too, after its check, if
//!   the check does not complete it. The reaper's runtime needs Tokio's time
//!   driver (`enable_time`, or `enable_all`): on a runtime built without it,
//!   Tokio panics in the reaper task at its first sleep (its panic, printed
//!   by the panic hook), and the purgatory or timer then reads as having lost
//!   its reaper.
//! - **One clock.** A purgatory or timer keeps time by the clock of the
//!   runtime its reaper runs on, read there when it is built, whichever
//!   runtime (or none) builds it. Each call that schedules reads Tokio's
//!   clock where it is made (a timeout given as a `Duration` counts from
//!   that reading, and an entry is filed by it): with a reaper on a paused
//!   runtime, schedule from inside that runtime (on another thread, enter it
//!   first with `Handle::enter`).
//! - **User panics are contained.** A panicking check, expiry or timer task, a
//!   panicking `Drop` of any operation, output, key or task the crate drops, and
//!   a waker (one built from a raw vtable) whose `wake` or `Drop` panics when the
//!   crate wakes or drops it, is caught, counted and reported through `tracing`;
//!   the call that ran it finishes its work, every handle resolves, other
//!   operations still complete and expire. The one case Rust leaves no way to
//!   contain: a one-shot timer task that panics while a value it captured
//!   panics in its `Drop` (the captures drop while the first panic unwinds,
//!   and that double panic aborts, as anywhere); see [`Timer`].
//!   A panic in a key's `Hash`, `Eq` or `Clone` propagates to the caller, with the
//!   purgatory left as it was before the call. A panic in the application's
//!   `tracing` subscriber, on any span or event the crate emits, is swallowed
//!   (not counted: a subscriber that panics would otherwise count its own
//!   reports of the panics it caused), and the crate goes on. A panic in the
//!   `metrics` recorder (with that feature) where the reaper or a check
//!   records a lateness sample is caught and counted in `panicked`; one in a
//!   call the application makes itself reaches that caller: in
//!   `record_metrics()`, the purgatory or timer is unchanged; in `build()`
//!   (which registers the lateness histogram), nothing is built and a shared
//!   reaper is left as it was.
//! - **No lock of ours is held while operation code runs**, nor while the crate
//!   drops a user value, so operations, outputs, keys and tasks may call back in
//!   (including `shutdown()`) from their code and their `Drop`. Two locks do
//!   surround user code, by design: an operation's own lock around its
//!   `try_complete` (checks of one operation never overlap), and a watcher-map
//!   shard lock around a key's `Eq` (and its `Borrow`, when a method looks it
//!   up by a borrowed form), which must not call back in (its `Hash` and
//!   `Clone` run before any lock).
//! - **Finished operations free their memory at once**: the operation at once, an
//!   output as soon as its handle reads it or is dropped. Its cell
//!   ([`Purgatory::cell_bytes`]) is reused by the next registration once the
//!   operation's handle and every `OpRef` to it are gone; the purgatory keeps
//!   cells for the most operations it has held in cells at once (pending, or
//!   finished with a handle still held), so registering allocates nothing in
//!   the steady state. What stays in other
//!   keys' lists is a tombstone of 8 bytes (24 at a level), removed by the next walk of that key,
//!   an amortised purge, or the purge an expiry or cancellation starts once
//!   tombstones are as many as live entries (and at least 16), and counted in
//!   [`PurgatoryMetrics::tombstones`].
//! - **Handles are safe to share and to keep.** Polling from several tasks wakes
//!   the latest; a timer handle whose slot was reused can never touch the newer
//!   entry.
//! - **Misbehaving keys cannot corrupt.** Duplicate keys are watched once; keys
//!   whose `Hash` and `Eq` disagree at worst leave an operation to its timeout.
//! - **Overload is refused, not queued.** At the pending limit, registrations come
//!   back with their operation; without a limit, memory is linear in pending
//!   operations: what they own returns once they finish, and their cells are
//!   kept for the operations that follow (the peak held in cells, pending or
//!   finished with a handle still held, in whole pages, each
//!   [`Purgatory::cell_bytes`]; [`PurgatoryMetrics::cells`] counts them).
//!
//! In the source repository, `docs/design.md` (reliability) and
//! `tests/README.md` say which test checks each of these.
//!
//! # Feature flags
//!
//! - `metrics` (off by default): reports every purgatory's and timer's figures
//!   through the [`metrics`](https://docs.rs/metrics) facade, to whichever
//!   exporter the service installs (Prometheus, StatsD, ...): expiry lateness
//!   as a histogram recorded live, and the counters and gauges of
//!   `Purgatory::record_metrics` and `Timer::record_metrics`, which list the
//!   names.
//!
//! Without it the crate uses `tokio` (`rt`, `time`, `sync`), `hashbrown` (the
//! watcher map's tables), `pin-project-lite` and `tracing`, each with no more
//! features than it needs.

#![forbid(unsafe_code)]
#![warn(
    missing_docs,
    missing_debug_implementations,
    rust_2018_idioms,
    unreachable_pub
)]
#![doc(test(attr(deny(warnings))))]

mod clock;
mod contain;
mod core;
#[cfg(feature = "metrics")]
mod export;
mod histogram;
pub mod purgatory;
mod reaper;
mod settings;
mod sync;
pub mod timer;
mod wake;
mod watchers;
mod wheel;

/// The tests' seeded generator, so failures name a reproducible seed.
#[cfg(test)]
#[path = "../tests/support/rng.rs"]
#[allow(unreachable_pub)]
mod test_rng;

// One rule for both public modules: the crate root re-exports every public
// item of `purgatory` and `timer`, so either path names the same item.
pub use purgatory::{
    ChecksMetrics, Completion, Histogram, OpRef, Operation, OperationError, OperationHandle,
    OperationStatus, Purgatory, PurgatoryBuilder, PurgatoryMetrics, ReaperMetrics, RefusedMetrics,
    WalkMetrics, Watch, WatchError, WatchErrorKind, WatchKey, WeakPurgatory,
};
pub use reaper::Reaper;
pub use settings::BuildError;
pub use timer::{
    AsyncTaskHandle, ScheduleError, Sleep, TaskHandle, TaskStatus, TimeoutError, TimeoutFuture,
    Timer, TimerBuilder, TimerError, TimerMetrics, UnrunTask, WeakTimer,
};
#[allow(deprecated)]
pub use timer::{AsyncTimeout, Timeout, TimeoutStatus};

/// The README's Rust examples, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
