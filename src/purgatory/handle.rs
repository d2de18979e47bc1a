//! The handles of registered operations.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::Instant;

use super::books::Fate;
use super::cell::{Op, Outcome};
use super::error::OperationError;
use super::operation::{Completion, Operation};
use super::shared::Shared;
use super::shared::WalkKind;
use super::slab::Id;
use super::WatchKey;
use crate::clock::deadline_after;

/// How an operation stands ([`OpRef::status`]).
///
/// ```
/// use tokio_purgatory::OperationStatus;
/// assert_ne!(OperationStatus::Pending, OperationStatus::Expired);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum OperationStatus {
    /// Registered, not finished.
    Pending,
    /// A check completed it.
    Completed,
    /// Its timeout fired.
    Expired,
    /// Cancelled: by key, by reference, by dropping its handle, or dropped
    /// with its purgatory or reaper.
    Cancelled,
    /// Handed back by `shutdown()`, or by a registration refused part-way.
    HandedBack,
}

/// The future of a registered operation: resolves to how it finished.
///
/// Returned by [`Purgatory::try_complete_else_watch`](crate::Purgatory::try_complete_else_watch).
/// Resolves to `Ok(Completion::Completed(output))` when a check completed the
/// operation, `Ok(Completion::Expired(output))` when its timeout fired first, or an
/// [`OperationError`] when it was cancelled, shut down, its reaper task was
/// lost, or its expiry panicked. Exactly one of these, however completion,
/// expiry, cancellation and shutdown race.
///
/// # Cancel safety
///
/// **Dropping the handle cancels the operation** if it has not finished: it is
/// removed from the timer at once, dropped on the dropping thread (or, when a
/// check of it runs on another thread at that moment, by that check as soon as
/// it returns "not yet"; a check that completes it wins), with a panic in its
/// `Drop` contained, and counted as cancelled; its watch-list entries become
/// tombstones that the next walk of those keys (or the amortised purge) removes.
/// This is what a request handler wants when its client goes away. If the
/// operation had finished and its output was never read, the output is dropped
/// at once. To let the operation run on with nobody awaiting it (its own
/// `try_complete`/`on_expiration` deliver the response, as Kafka's `onComplete`
/// does), call [`detach`](OperationHandle::detach).
///
/// Because dropping cancels, the handle is `#[must_use]`: an unused handle is a
/// compile-time warning.
///
/// # Shutdown
///
/// Holding a handle does not keep the purgatory open. When it shuts down
/// ([`Purgatory::shutdown`](crate::Purgatory::shutdown), or its last clone
/// dropped), a pending operation's handle resolves to
/// [`OperationError::Shutdown`]; when its reaper task is lost (its runtime
/// shut down), to [`OperationError::ReaperGone`]. An operation being checked
/// on another thread at that moment resolves so once that check says "not
/// yet" (a check that completes it wins).
///
/// ```compile_fail
/// #![deny(unused_must_use)]
/// # struct Op;
/// # impl tokio_purgatory::Operation for Op {
/// #     type Output = ();
/// #     fn try_complete(&mut self) -> Option<()> { None }
/// #     fn on_expiration(self) {}
/// # }
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// # let p: tokio_purgatory::Purgatory<u32, Op> =
/// #     tokio_purgatory::Purgatory::builder().name("demo").build().unwrap();
/// // Registers and cancels at once: refused under `deny(unused_must_use)`.
/// p.try_complete_else_watch(Op, std::time::Duration::from_secs(1), [1]).unwrap();
/// # }
/// ```
///
/// ```
/// #![deny(unused_must_use)]
/// # struct Op;
/// # impl tokio_purgatory::Operation for Op {
/// #     type Output = ();
/// #     fn try_complete(&mut self) -> Option<()> { None }
/// #     fn on_expiration(self) {}
/// # }
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// # let p: tokio_purgatory::Purgatory<u32, Op> =
/// #     tokio_purgatory::Purgatory::builder().name("demo").build().unwrap();
/// // What was meant: let it run on, answered by its own code.
/// p.try_complete_else_watch(Op, std::time::Duration::from_secs(1), [1]).unwrap().detach();
/// # }
/// ```
///
/// Polling from different tasks is allowed; the latest task to poll is woken.
/// After it has returned `Ready`, polling again panics (as for any future).
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
/// use std::time::Duration;
/// use tokio_purgatory::{Completion, Operation, Purgatory};
///
/// struct Answer;
/// impl Operation for Answer {
///     type Output = u32;
///     fn try_complete(&mut self) -> Option<u32> { None }
///     fn on_expiration(self) -> u32 { 42 }
/// }
///
/// let p: Purgatory<u32, Answer> = Purgatory::builder().name("demo").build().unwrap();
/// let handle = p.try_complete_else_watch(Answer, Duration::from_millis(10), [1]).unwrap();
/// assert!(!handle.is_finished());
/// assert_eq!(handle.await, Ok(Completion::Expired(42)));
/// # }
/// ```
#[must_use = "dropping an OperationHandle cancels its operation; await it, or call detach()"]
pub struct OperationHandle<K: WatchKey, O: Operation> {
    inner: Inner<K, O>,
}

enum Inner<K: WatchKey, O: Operation> {
    /// Completed during registration (by its first check, before anything
    /// was watched, or by its second). The purgatory is kept to drop an
    /// unread output contained.
    Ready(Completion<O::Output>, Arc<Shared<K, O>>),
    Waiting(CellRef<K, O>),
    Taken,
}

impl<K: WatchKey, O: Operation> fmt::Debug for OperationHandle<K, O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.inner {
            Inner::Ready(..) => "ready",
            Inner::Waiting(_) => "waiting",
            Inner::Taken => "taken",
        };
        f.debug_struct("OperationHandle")
            .field("state", &state)
            .finish()
    }
}

impl<K, O> OperationHandle<K, O>
where
    K: WatchKey,
    O: Operation,
{
    pub(crate) fn ready(c: Completion<O::Output>, shared: Arc<Shared<K, O>>) -> Self {
        OperationHandle {
            inner: Inner::Ready(c, shared),
        }
    }

    pub(crate) fn waiting(cell: CellRef<K, O>) -> Self {
        OperationHandle {
            inner: Inner::Waiting(cell),
        }
    }

    /// Whether the operation has finished and its outcome is there, so that
    /// awaiting the handle would not wait. (Its state reads finished a moment
    /// before, while the thread that finished it drops the operation or runs
    /// its expiry: [`OpRef::is_finished`] and [`OpRef::status`] say so from
    /// then.)
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// # struct Op;
    /// # impl tokio_purgatory::Operation for Op {
    /// #     type Output = ();
    /// #     fn try_complete(&mut self) -> Option<()> { None }
    /// #     fn on_expiration(self) {}
    /// # }
    /// use std::time::Duration;
    /// let p: tokio_purgatory::Purgatory<u32, Op> = tokio_purgatory::Purgatory::new();
    /// let h = p.try_complete_else_watch(Op, Duration::from_millis(10), [1]).unwrap();
    /// assert!(!h.is_finished());
    /// tokio::time::sleep(Duration::from_millis(20)).await;
    /// assert!(h.is_finished());
    /// # }
    /// ```
    pub fn is_finished(&self) -> bool {
        match &self.inner {
            Inner::Waiting(cell) => cell.op().is_delivered(),
            Inner::Ready(..) | Inner::Taken => true,
        }
    }

    /// A reference through which any task can run this operation's check (Kafka's
    /// `tryComplete` on the operation object), for callers that know which
    /// operation an event concerns. `None` when the operation completed during
    /// registration (there is nothing left to check), and once the handle has
    /// yielded its outcome (awaited through `&mut`).
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// use std::sync::atomic::{AtomicBool, Ordering};
    /// use std::sync::Arc;
    /// use std::time::Duration;
    /// use tokio_purgatory::{Completion, Operation, Purgatory};
    ///
    /// struct Produce(Arc<AtomicBool>);
    /// impl Operation for Produce {
    ///     type Output = &'static str;
    ///     fn try_complete(&mut self) -> Option<&'static str> {
    ///         self.0.load(Ordering::SeqCst).then_some("acked")
    ///     }
    ///     fn on_expiration(self) -> &'static str { "timed out" }
    /// }
    ///
    /// let p: Purgatory<u32, Produce> = Purgatory::new();
    /// let acked = Arc::new(AtomicBool::new(false));
    /// let h = p.try_complete_else_watch(Produce(acked.clone()), Duration::from_secs(1), [0]).unwrap();
    /// let op = h.op_ref().unwrap();
    /// acked.store(true, Ordering::SeqCst);
    /// assert!(op.try_complete(), "checked through its reference, no key walk");
    /// assert_eq!(h.await, Ok(Completion::Completed("acked")));
    /// # }
    /// ```
    pub fn op_ref(&self) -> Option<OpRef<K, O>> {
        match &self.inner {
            Inner::Waiting(cell) => Some(OpRef { cell: cell.clone() }),
            Inner::Ready(..) | Inner::Taken => None,
        }
    }

    /// Moves the operation's timeout to `timeout` from now, in O(1), as
    /// `DelayQueue::reset` does for an entry; see [`OpRef::reset`].
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// use std::time::Duration;
    /// use tokio::time::{advance, Instant};
    /// use tokio_purgatory::{Completion, Operation, Purgatory};
    ///
    /// struct Session;
    /// impl Operation for Session {
    ///     type Output = Instant;
    ///     fn try_complete(&mut self) -> Option<Instant> { None }
    ///     fn on_expiration(self) -> Instant { Instant::now() }
    /// }
    ///
    /// let sessions: Purgatory<u64, Session> = Purgatory::builder().name("sessions").build().unwrap();
    /// let start = Instant::now();
    /// let session = sessions.try_complete_else_watch(Session, Duration::from_secs(10), [7]).unwrap();
    /// // A heartbeat at 6 s keeps the session for 10 s more.
    /// advance(Duration::from_secs(6)).await;
    /// assert!(session.reset(Duration::from_secs(10)));
    /// let Ok(Completion::Expired(at)) = session.await else { panic!() };
    /// assert!(at >= start + Duration::from_secs(16));
    /// # }
    /// ```
    pub fn reset(&self, timeout: Duration) -> bool {
        let now = Instant::now();
        self.reset_from(now, deadline_after(now, timeout))
    }

    /// Moves the operation's timeout to `deadline`, in O(1); see
    /// [`OpRef::reset_at`].
    ///
    /// `deadline` may be a `tokio::time::Instant` or a `std::time::Instant`
    /// (converted with `From`). Under Tokio's paused time only Tokio's clock
    /// is paused: take deadlines from `tokio::time::Instant::now()` there.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// use std::time::Duration;
    /// use tokio::time::Instant;
    /// use tokio_purgatory::{Completion, Operation, Purgatory};
    ///
    /// struct Join;
    /// impl Operation for Join {
    ///     type Output = ();
    ///     fn try_complete(&mut self) -> Option<()> { None }
    ///     fn on_expiration(self) {}
    /// }
    ///
    /// let joins: Purgatory<&str, Join> = Purgatory::builder().name("join").build().unwrap();
    /// let join = joins.try_complete_else_watch(Join, Duration::from_secs(300), ["group"]).unwrap();
    /// // The group's rebalance deadline was brought forward.
    /// assert!(join.reset_at(Instant::now() + Duration::from_secs(3)));
    /// assert_eq!(join.await, Ok(Completion::Expired(())));
    /// # }
    /// ```
    pub fn reset_at(&self, deadline: impl Into<Instant>) -> bool {
        self.reset_from(Instant::now(), deadline.into())
    }

    fn reset_from(&self, now: Instant, deadline: Instant) -> bool {
        match &self.inner {
            Inner::Waiting(cell) => cell.op().reset(now, deadline),
            Inner::Ready(..) | Inner::Taken => false,
        }
    }

    /// Cancels the operation and hands it back, as
    /// [`cancel_for_key`](crate::Purgatory::cancel_for_key) does for a key and
    /// `DelayQueue::remove` for an entry: `Some(op)` when this call took it (its
    /// timeout is cancelled, its entries become tombstones), `None` when it had
    /// finished or a running check will finish it (then it completes, or is
    /// cancelled and dropped by that check).
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// use std::time::Duration;
    /// use tokio_purgatory::{Operation, Purgatory};
    ///
    /// struct Fetch(u32);
    /// impl Operation for Fetch {
    ///     type Output = ();
    ///     fn try_complete(&mut self) -> Option<()> { None }
    ///     fn on_expiration(self) {}
    /// }
    ///
    /// let p: Purgatory<u32, Fetch> = Purgatory::builder().name("fetch").build().unwrap();
    /// let handle = p.try_complete_else_watch(Fetch(7), Duration::from_secs(1), [1]).unwrap();
    /// let back = handle.cancel().expect("still pending");
    /// assert_eq!(back.0, 7);
    /// assert_eq!(p.delayed(), 0);
    /// # }
    /// ```
    pub fn cancel(mut self) -> Option<O> {
        match std::mem::replace(&mut self.inner, Inner::Taken) {
            Inner::Waiting(cell) => {
                let op = cell.op();
                op.detach();
                let taken = op.cancel(OperationError::Cancelled, Fate::Cancelled);
                cell.shared.tidy();
                taken
            }
            Inner::Ready(c, shared) => {
                shared.drop_contained("drop of an output", c);
                None
            }
            Inner::Taken => None,
        }
    }

    /// Lets the operation go on without anyone awaiting it: it still completes or
    /// expires, and its output is dropped. Its own `try_complete` and
    /// `on_expiration` are then where the response is sent.
    ///
    /// # Shutdown
    ///
    /// A detached operation still pending at [`shutdown`](crate::Purgatory::shutdown)
    /// is handed back in the list that call returns, and one still pending
    /// when the purgatory's last clone is dropped, or its reaper task is lost,
    /// is dropped: in both cases neither `try_complete` nor `on_expiration`
    /// runs, so an operation that answers for itself must be answered by the
    /// code that shuts down (from the list), or answer from its own `Drop`.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// use std::time::Duration;
    /// use tokio_purgatory::{Operation, Purgatory};
    ///
    /// // Answers for itself: the response goes out from the operation's own code.
    /// struct Fetch(tokio::sync::oneshot::Sender<&'static str>);
    /// impl Operation for Fetch {
    ///     type Output = ();
    ///     fn try_complete(&mut self) -> Option<()> { None }
    ///     fn on_expiration(self) { let _ = self.0.send("empty"); }
    /// }
    ///
    /// let p: Purgatory<u32, Fetch> = Purgatory::new();
    /// let (tx, rx) = tokio::sync::oneshot::channel();
    /// p.try_complete_else_watch(Fetch(tx), Duration::from_millis(100), [1]).unwrap().detach();
    /// assert_eq!(p.delayed(), 1, "still pending with nobody awaiting it");
    /// assert_eq!(rx.await, Ok("empty"));
    /// # }
    /// ```
    pub fn detach(mut self) {
        match std::mem::replace(&mut self.inner, Inner::Taken) {
            Inner::Waiting(cell) => cell.op().detach(),
            Inner::Ready(c, shared) => shared.drop_contained("drop of an output", c),
            Inner::Taken => {}
        }
    }

    /// [`detach`](Self::detach)es the handle and keeps a reference to the
    /// operation instead: what `let r = handle.op_ref(); handle.detach();`
    /// does, for code that completes or updates operations by reference and
    /// never awaits them (Kafka keeps the operation object itself). The
    /// operation still completes or expires, and its output is dropped.
    /// `None` when the operation completed during registration (its output
    /// is dropped here, and there is nothing left to reference).
    ///
    /// Cheaper than the two calls: the handle's own reference to the
    /// operation's cell becomes the [`OpRef`]'s, so no count changes.
    ///
    /// At shutdown, and when the purgatory or its reaper is gone, the
    /// operation is handed back or dropped as a [`detach`](Self::detach)ed
    /// one is; the [`OpRef`] then reads it finished.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// use std::sync::atomic::{AtomicBool, Ordering};
    /// use std::sync::Arc;
    /// use std::time::Duration;
    /// use tokio_purgatory::{Operation, OperationStatus, Purgatory};
    ///
    /// /// A produce answered from its own code once its replicas have it.
    /// struct Produce { acked: Arc<AtomicBool> }
    /// impl Operation for Produce {
    ///     type Output = ();
    ///     fn try_complete(&mut self) -> Option<()> {
    ///         self.acked.load(Ordering::Acquire).then_some(()) // and send the response
    ///     }
    ///     fn on_expiration(self) {} // send REQUEST_TIMED_OUT
    /// }
    ///
    /// let p: Purgatory<u32, Produce> = Purgatory::new();
    /// let acked = Arc::new(AtomicBool::new(false));
    /// let op = Produce { acked: acked.clone() };
    /// let produce = p
    ///     .try_complete_else_watch(op, Duration::from_secs(30), [7])
    ///     .unwrap()
    ///     .into_op_ref()
    ///     .expect("not done at registration");
    /// acked.store(true, Ordering::Release);
    /// assert!(produce.try_complete());
    /// assert_eq!(produce.status(), OperationStatus::Completed);
    /// # }
    /// ```
    pub fn into_op_ref(mut self) -> Option<OpRef<K, O>> {
        match std::mem::replace(&mut self.inner, Inner::Taken) {
            Inner::Waiting(cell) => {
                cell.op().detach();
                Some(OpRef { cell })
            }
            Inner::Ready(c, shared) => {
                shared.drop_contained("drop of an output", c);
                None
            }
            Inner::Taken => None,
        }
    }
}

// The handle never pins its contents (the output is moved out whole).
impl<K: WatchKey, O: Operation> Unpin for OperationHandle<K, O> {}

impl<K, O> Future for OperationHandle<K, O>
where
    K: WatchKey,
    O: Operation,
{
    type Output = Outcome<O::Output>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        let out = match &this.inner {
            Inner::Waiting(cell) => match cell.op().poll_outcome(cx.waker()) {
                Some(out) => out,
                None => return Poll::Pending,
            },
            Inner::Ready(..) => match std::mem::replace(&mut this.inner, Inner::Taken) {
                Inner::Ready(c, _) => return Poll::Ready(Ok(c)),
                _ => unreachable!(),
            },
            Inner::Taken => panic!("OperationHandle polled after it returned Ready"),
        };
        this.inner = Inner::Taken;
        Poll::Ready(out)
    }
}

impl<K: WatchKey, O: Operation> Drop for OperationHandle<K, O> {
    fn drop(&mut self) {
        if let Inner::Ready(..) = &self.inner {
            if let Inner::Ready(c, shared) = std::mem::replace(&mut self.inner, Inner::Taken) {
                shared.drop_contained("drop of an output", c);
            }
            return;
        }
        if let Inner::Waiting(cell) = &self.inner {
            // Nobody awaits it any more. Detach first, so an outcome delivered by a
            // check that races this cancel is dropped at once rather than kept.
            let op = cell.op();
            op.detach();
            if let Some(taken) = op.cancel(OperationError::Cancelled, Fate::Cancelled) {
                cell.shared.drop_contained("drop of an operation", taken);
            }
            cell.shared.tidy();
        }
    }
}

/// A shareable reference to one registered operation: complete it by
/// reference (running its check, as Kafka completes a delayed operation it
/// holds), update it, move its timeout, read its status or cancel it, from
/// any thread, without awaiting it. Made by
/// [`OperationHandle::op_ref`] or [`OperationHandle::into_op_ref`].
///
/// Cheap to clone and `Send + Sync`. Holding it keeps the operation's small
/// bookkeeping cell alive, not the operation itself: that is dropped as soon as it
/// finishes. Dropping an `OpRef` does nothing to the operation. Once the
/// operation has finished (completed, expired, cancelled, or handed back by a
/// shutdown), its methods do nothing and say so: `try_complete` returns
/// `false`, `update` and `cancel` return `None`, `reset` returns `false`.
/// Holding one does not keep the purgatory open: after a shutdown its
/// operation reads [`OperationStatus::HandedBack`] (handed back by
/// `shutdown()`) or [`OperationStatus::Cancelled`] (dropped with the
/// purgatory's last clone, or with a lost reaper). It does keep the memory
/// the purgatory's operations share: the cells (as many as were ever in use
/// at once) and the watcher map's own storage stay allocated until the last
/// `OpRef` and [`OperationHandle`] of the purgatory are dropped, after its
/// last clone; so keep an `OpRef` no longer than its operation matters.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
/// use std::time::Duration;
/// use tokio_purgatory::{Completion, Operation, OperationStatus, Purgatory};
///
/// /// A join that completes once the group has `want` members.
/// struct Join { members: usize, want: usize }
/// impl Operation for Join {
///     type Output = usize;
///     fn try_complete(&mut self) -> Option<usize> {
///         (self.members >= self.want).then_some(self.members)
///     }
///     fn on_expiration(self) -> usize { self.members }
/// }
///
/// let joins: Purgatory<&str, Join> = Purgatory::new();
/// let handle = joins
///     .try_complete_else_watch(Join { members: 1, want: 2 }, Duration::from_secs(5), ["g"])
///     .unwrap();
/// let join = handle.op_ref().expect("pending");
/// let other = join.clone(); // for another task or thread
/// assert_eq!(other.update(|j| j.members += 1), Some(()));
/// assert!(join.try_complete(), "its check ran and completed it");
/// assert_eq!(other.status(), OperationStatus::Completed);
/// assert!(!other.try_complete(), "finished: nothing to do");
/// assert_eq!(handle.await, Ok(Completion::Completed(2)));
/// # }
/// ```
pub struct OpRef<K: WatchKey, O: Operation> {
    cell: CellRef<K, O>,
}

/// A counted reference to an operation's cell: its cell is not reused while
/// one exists (the handle holds one, each [`OpRef`] another).
pub(crate) struct CellRef<K: WatchKey, O: Operation> {
    shared: Arc<Shared<K, O>>,
    id: Id,
}

impl<K: WatchKey, O: Operation> CellRef<K, O> {
    /// Takes over the reference a registration holds to `id`'s cell.
    pub(crate) fn new(shared: Arc<Shared<K, O>>, id: Id) -> Self {
        CellRef { shared, id }
    }

    pub(crate) fn op(&self) -> Op<'_, K, O> {
        self.shared.op(self.id)
    }
}

impl<K: WatchKey, O: Operation> Clone for CellRef<K, O> {
    fn clone(&self) -> Self {
        self.shared.cells().add_ref(self.id);
        CellRef {
            shared: self.shared.clone(),
            id: self.id,
        }
    }
}

impl<K: WatchKey, O: Operation> Drop for CellRef<K, O> {
    fn drop(&mut self) {
        self.shared.release(self.id);
    }
}

impl<K: WatchKey, O: Operation> Clone for OpRef<K, O> {
    fn clone(&self) -> Self {
        OpRef {
            cell: self.cell.clone(),
        }
    }
}

impl<K: WatchKey, O: Operation> fmt::Debug for OpRef<K, O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OpRef").finish_non_exhaustive()
    }
}

impl<K, O> OpRef<K, O>
where
    K: WatchKey,
    O: Operation,
{
    /// Runs the operation's check now. Returns whether this call completed it.
    ///
    /// # Concurrent calls
    ///
    /// If another caller is checking the operation at this moment, this call asks
    /// it to check once more and returns `false` at once: the event is not lost
    /// (unless a cancel or the timeout arrives during that check too: they
    /// win over the re-run), and checks never overlap. After the operation has finished, returns `false`
    /// and runs nothing; so it does once a [`shutdown`](crate::Purgatory::shutdown)
    /// of its purgatory has begun (the shutdown finishes what is still
    /// pending: hands it back, or cancels it when the reaper was lost).
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// # struct Op;
    /// # impl tokio_purgatory::Operation for Op {
    /// #     type Output = ();
    /// #     fn try_complete(&mut self) -> Option<()> { None }
    /// #     fn on_expiration(self) {}
    /// # }
    /// use std::time::Duration;
    /// let p: tokio_purgatory::Purgatory<u32, Op> = tokio_purgatory::Purgatory::new();
    /// let h = p.try_complete_else_watch(Op, Duration::from_secs(1), [1]).unwrap();
    /// let op = h.op_ref().unwrap();
    /// assert!(!op.try_complete(), "its check says not yet");
    /// assert!(!op.is_finished());
    /// # drop(h);
    /// # }
    /// ```
    pub fn try_complete(&self) -> bool {
        if self.cell.shared.is_closed() {
            // The shutdown finishes whatever is still pending. Counted as a
            // check by reference that completed nothing, as one of a
            // finished operation is.
            self.cell.shared.count_walk(WalkKind::Reference, 1, 0);
            return false;
        }
        let completed = self.cell.op().check();
        self.cell
            .shared
            .count_walk(WalkKind::Reference, 1, completed as usize);
        completed
    }

    /// How the operation stands: pending, or how it finished. What a
    /// `reset` or `try_complete` that returned `false` leaves to ask.
    ///
    /// # Concurrent calls
    ///
    /// A snapshot: a pending operation may finish right after. Once it says
    /// finished, the answer never changes, except that a cancel handed back
    /// by a shutdown racing a check may first read `Cancelled`, then
    /// `HandedBack`.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// # struct Op;
    /// # impl tokio_purgatory::Operation for Op {
    /// #     type Output = ();
    /// #     fn try_complete(&mut self) -> Option<()> { None }
    /// #     fn on_expiration(self) {}
    /// # }
    /// use std::time::Duration;
    /// use tokio_purgatory::{OperationStatus, Purgatory};
    ///
    /// let p: Purgatory<u32, Op> = Purgatory::new();
    /// let h = p.try_complete_else_watch(Op, Duration::from_millis(10), [1]).unwrap();
    /// let op = h.op_ref().unwrap();
    /// assert_eq!(op.status(), OperationStatus::Pending);
    /// tokio::time::sleep(Duration::from_millis(20)).await;
    /// assert!(!op.reset(Duration::from_secs(1)));
    /// assert_eq!(op.status(), OperationStatus::Expired, "why the reset failed");
    /// # }
    /// ```
    pub fn status(&self) -> OperationStatus {
        match self.cell.op().fate() {
            None => OperationStatus::Pending,
            Some(Fate::Completed) => OperationStatus::Completed,
            Some(Fate::Expired) => OperationStatus::Expired,
            Some(Fate::Cancelled) => OperationStatus::Cancelled,
            Some(Fate::HandedBack) => OperationStatus::HandedBack,
        }
    }

    /// Changes the pending operation: `f` gets it by `&mut` and its result is
    /// returned, or `None` (and `f` does not run) once the operation has
    /// finished, or when called from the operation's own `try_complete` (which
    /// has it by `&mut` already). What the check reads can so live in the
    /// operation itself, with no side table: a payment that waits until
    /// enough has been paid adds each part, then asks for a check with
    /// [`try_complete`](OpRef::try_complete).
    ///
    /// `f` runs on the calling thread under the operation's own lock, the
    /// one its checks hold, so it never overlaps a check, the expiry, or
    /// the moment the operation is taken out to finish. So `f` must not call
    /// back into this same operation: not its `try_complete`, `update` or
    /// `cancel`, nor a walk of one of its keys (`try_complete_watched`,
    /// `try_complete_reached`) or `cancel_for_key` on one, nor `shutdown` of
    /// its purgatory: each would check it or take it out, and wait on the
    /// lock `f` holds. Call those after `update` returns. Other operations and
    /// purgatories are fine, as long as the calls never wait for each other
    /// in a cycle: an `f` that updates (or checks) operation B while B's own
    /// update or check updates this one waits forever, as two locks taken in
    /// opposite orders do. A panic in `f` reaches the caller; the
    /// operation stays registered with whatever `f` changed.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// use std::time::Duration;
    /// use tokio_purgatory::{Completion, Operation, Purgatory};
    ///
    /// struct Payment { paid: u64, due: u64 }
    /// impl Operation for Payment {
    ///     type Output = u64;
    ///     fn try_complete(&mut self) -> Option<u64> { (self.paid >= self.due).then_some(self.paid) }
    ///     fn on_expiration(self) -> u64 { self.paid }
    /// }
    ///
    /// let orders: Purgatory<u64, Payment> = Purgatory::new();
    /// let h = orders
    ///     .try_complete_else_watch(Payment { paid: 0, due: 100 }, Duration::from_secs(1800), [7])
    ///     .unwrap();
    /// let order = h.op_ref().unwrap();
    /// for part in [30, 30, 40] {
    ///     order.update(|p| p.paid += part);
    ///     order.try_complete();
    /// }
    /// assert_eq!(h.await, Ok(Completion::Completed(100)));
    /// assert_eq!(order.update(|p| p.paid), None, "finished");
    /// # }
    /// ```
    pub fn update<R>(&self, f: impl FnOnce(&mut O) -> R) -> Option<R> {
        self.cell.op().update(f)
    }

    /// Whether the operation has finished (completed, expired, cancelled, or
    /// handed back by a shutdown).
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// # struct Op;
    /// # impl tokio_purgatory::Operation for Op {
    /// #     type Output = ();
    /// #     fn try_complete(&mut self) -> Option<()> { None }
    /// #     fn on_expiration(self) {}
    /// # }
    /// use std::time::Duration;
    /// let p: tokio_purgatory::Purgatory<u32, Op> = tokio_purgatory::Purgatory::new();
    /// let h = p.try_complete_else_watch(Op, Duration::from_secs(1), [1]).unwrap();
    /// let op = h.op_ref().unwrap();
    /// drop(h); // cancels
    /// assert!(op.is_finished());
    /// # }
    /// ```
    pub fn is_finished(&self) -> bool {
        self.cell.op().is_finished()
    }

    /// Moves the operation's timeout to `timeout` from now, in O(1) (the entry
    /// moves from one bucket of the timing wheel to another): a session kept
    /// alive by heartbeats, a long-poll extended. The new deadline may be
    /// earlier or later than the old one; one already past makes the operation
    /// due at once. Returns whether the timeout was moved; after a `false`,
    /// [`status`](OpRef::status) says whether the operation completed,
    /// expired or was cancelled, once it has finished: a `false` because the
    /// expiry is under way may come a moment before the operation reads as
    /// expired (the reaper has taken its timeout out of the wheel and not
    /// yet taken the operation; or left the expiry to a check running then,
    /// until that check ends). It then finishes, as expired unless that check
    /// completes it or a cancellation reached it first, and its handle
    /// resolves.
    ///
    /// # Concurrent calls
    ///
    /// Returns `false`, and changes nothing, once the operation has finished or
    /// its expiry is under way: racing the reaper, either the reset wins and the
    /// operation expires at the new deadline only, or the expiry wins and the
    /// reset returns `false`. A completion or cancellation racing a reset that
    /// returned `true` still finishes the operation (and removes the moved
    /// timeout). Concurrent resets each move it; the last one to take effect
    /// sets the deadline. Once a [`shutdown`](crate::Purgatory::shutdown) has
    /// begun, `false` (a reset already under way then may still take effect:
    /// see the shutdown's docs).
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// use std::time::Duration;
    /// use tokio::time::advance;
    /// use tokio_purgatory::{Operation, Purgatory};
    ///
    /// struct Session;
    /// impl Operation for Session {
    ///     type Output = ();
    ///     fn try_complete(&mut self) -> Option<()> { None }
    ///     fn on_expiration(self) {}
    /// }
    ///
    /// let sessions: Purgatory<u64, Session> = Purgatory::builder().name("sessions").build().unwrap();
    /// let handle = sessions.try_complete_else_watch(Session, Duration::from_secs(10), [7]).unwrap();
    /// let session = handle.op_ref().unwrap();
    /// handle.detach();
    /// for _ in 0..5 {
    ///     // A heartbeat every 8 s: the 10-s timeout never comes.
    ///     advance(Duration::from_secs(8)).await;
    ///     assert!(session.reset(Duration::from_secs(10)));
    /// }
    /// assert!(!session.is_finished());
    /// advance(Duration::from_secs(11)).await;
    /// tokio::task::yield_now().await;
    /// assert!(session.is_finished(), "no heartbeat: expired");
    /// assert!(!session.reset(Duration::from_secs(10)), "too late");
    /// # }
    /// ```
    pub fn reset(&self, timeout: Duration) -> bool {
        let now = Instant::now();
        self.cell.op().reset(now, deadline_after(now, timeout))
    }

    /// Moves the operation's timeout to `deadline`, in O(1); as
    /// [`reset`](Self::reset), with an instant instead of a duration from now.
    ///
    /// `deadline` may be a `tokio::time::Instant` or a `std::time::Instant`
    /// (converted with `From`). Under Tokio's paused time only Tokio's clock
    /// is paused: take deadlines from `tokio::time::Instant::now()` there.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// use std::time::Duration;
    /// use tokio::time::Instant;
    /// use tokio_purgatory::{Operation, Purgatory};
    ///
    /// struct Fetch;
    /// impl Operation for Fetch {
    ///     type Output = ();
    ///     fn try_complete(&mut self) -> Option<()> { None }
    ///     fn on_expiration(self) {}
    /// }
    ///
    /// let p: Purgatory<u32, Fetch> = Purgatory::builder().name("fetch").build().unwrap();
    /// let handle = p.try_complete_else_watch(Fetch, Duration::from_secs(30), [1]).unwrap();
    /// let op = handle.op_ref().unwrap();
    /// // Answer now with what there is: a deadline in the past is due at once.
    /// assert!(op.reset_at(Instant::now() - Duration::from_secs(1)));
    /// handle.await.unwrap();
    /// # }
    /// ```
    pub fn reset_at(&self, deadline: impl Into<Instant>) -> bool {
        self.cell.op().reset(Instant::now(), deadline.into())
    }

    /// Cancels the operation and hands it back; its handle resolves to
    /// [`OperationError::Cancelled`]. `None` when it had finished, or a check
    /// running at this moment will finish it.
    ///
    /// # Concurrency
    ///
    /// However it races a completion, the expiry, another cancel (this one,
    /// a dropped handle, [`Purgatory::cancel_for_key`](crate::Purgatory::cancel_for_key))
    /// or a shutdown, the operation finishes once: the call that finishes it
    /// first wins, and only a cancel that wins hands the operation back here
    /// (a shutdown that wins hands it back to its caller instead). When a
    /// check runs at that moment (on another thread, or further up this
    /// one's stack), the cancel is left to it: `None` here, and that check
    /// cancels it (dropping it, contained) once it says "not yet", unless it
    /// completes it. A cancel left so also wins over the timeout if that
    /// fired during the same check (neither finished it first: the check's
    /// end does, and a cancel is what the application asked for last).
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// use std::time::Duration;
    /// use tokio_purgatory::{Operation, OperationError, Purgatory};
    ///
    /// struct Join(&'static str);
    /// impl Operation for Join {
    ///     type Output = ();
    ///     fn try_complete(&mut self) -> Option<()> { None }
    ///     fn on_expiration(self) {}
    /// }
    ///
    /// let p: Purgatory<&str, Join> = Purgatory::builder().name("join").build().unwrap();
    /// let handle = p.try_complete_else_watch(Join("member-1"), Duration::from_secs(1), ["g"]).unwrap();
    /// let op_ref = handle.op_ref().unwrap();
    /// assert_eq!(op_ref.cancel().map(|j| j.0), Some("member-1"));
    /// assert!(op_ref.cancel().is_none(), "once");
    /// assert_eq!(handle.await, Err(OperationError::Cancelled));
    /// # }
    /// ```
    pub fn cancel(&self) -> Option<O> {
        let taken = self
            .cell
            .op()
            .cancel(OperationError::Cancelled, Fate::Cancelled);
        self.cell.shared.tidy();
        taken
    }
}
