//! The handles of registered operations.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use super::error::OperationError;
use super::operation::{Completion, Fate, OpCell, Operation, Outcome};
use super::WatchKey;

/// The future of a registered operation: resolves to how it finished.
///
/// Returned by [`Purgatory::try_complete_else_watch`](crate::Purgatory::try_complete_else_watch).
/// Resolves to `Ok(Completion::Completed(output))` when a check completed the
/// operation, `Ok(Completion::Expired(output))` when its timeout fired first, or an
/// [`OperationError`] when it was cancelled, shut down, or its expiry panicked.
/// Exactly one of these, however completion, expiry, cancellation and shutdown
/// race.
///
/// # Cancel safety
///
/// **Dropping the handle cancels the operation** if it has not finished: it is
/// removed from the timer at once, dropped on the dropping thread, and counted as
/// cancelled; its watch-list entries become tombstones that the next walk of
/// those keys (or the amortised purge) removes. This is what a request handler
/// wants when its client goes away. To let the operation run on with nobody
/// awaiting it (its own `try_complete`/`on_expiration` deliver the response, as
/// Kafka's `onComplete` does), call [`detach`](OperationHandle::detach).
///
/// Polling from different tasks is allowed; the latest task to poll is woken.
/// After it has returned `Ready`, polling again panics (as for any future).
pub struct OperationHandle<K: WatchKey, O: Operation> {
    state: State<K, O>,
}

enum State<K: WatchKey, O: Operation> {
    /// Completed by the first check, before anything was registered.
    Ready(Completion<O::Output>),
    Waiting(Arc<OpCell<K, O>>),
    Taken,
}

impl<K: WatchKey, O: Operation> fmt::Debug for OperationHandle<K, O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.state {
            State::Ready(_) => "ready",
            State::Waiting(_) => "waiting",
            State::Taken => "taken",
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
    pub(crate) fn ready(c: Completion<O::Output>) -> Self {
        OperationHandle {
            state: State::Ready(c),
        }
    }

    pub(crate) fn waiting(cell: Arc<OpCell<K, O>>) -> Self {
        OperationHandle {
            state: State::Waiting(cell),
        }
    }

    /// Whether the operation has finished (so awaiting the handle would not wait).
    pub fn is_finished(&self) -> bool {
        match &self.state {
            State::Waiting(cell) => cell.is_done(),
            State::Ready(_) | State::Taken => true,
        }
    }

    /// A reference through which any task can run this operation's check (Kafka's
    /// `tryComplete` on the operation object), for callers that know which
    /// operation an event concerns. `None` when the operation completed during
    /// registration (there is nothing left to check).
    pub fn op_ref(&self) -> Option<OpRef<K, O>> {
        match &self.state {
            State::Waiting(cell) => Some(OpRef { cell: cell.clone() }),
            State::Ready(_) | State::Taken => None,
        }
    }

    /// Lets the operation go on without anyone awaiting it: it still completes or
    /// expires, and its output is dropped. Its own `try_complete` and
    /// `on_expiration` are then where the response is sent.
    pub fn detach(mut self) {
        if let State::Waiting(cell) = std::mem::replace(&mut self.state, State::Taken) {
            cell.detach();
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
        let out = match &this.state {
            State::Waiting(cell) => match cell.poll_outcome(cx.waker()) {
                Some(out) => out,
                None => return Poll::Pending,
            },
            State::Ready(_) => match std::mem::replace(&mut this.state, State::Taken) {
                State::Ready(c) => return Poll::Ready(Ok(c)),
                _ => unreachable!(),
            },
            State::Taken => panic!("OperationHandle polled after it returned Ready"),
        };
        this.state = State::Taken;
        Poll::Ready(out)
    }
}

impl<K: WatchKey, O: Operation> Drop for OperationHandle<K, O> {
    fn drop(&mut self) {
        if let State::Waiting(cell) = &self.state {
            // Nobody awaits it any more: cancel (a no-op once finished).
            drop(cell.cancel_quietly());
        }
    }
}

/// A shareable reference to one registered operation.
///
/// Cheap to clone and `Send + Sync`. Holding it keeps the operation's small
/// bookkeeping cell alive, not the operation itself: that is dropped as soon as it
/// finishes.
pub struct OpRef<K: WatchKey, O: Operation> {
    cell: Arc<OpCell<K, O>>,
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
    /// it to check once more and returns `false` at once: the event is not lost,
    /// and checks never overlap. After the operation has finished, returns `false`
    /// and runs nothing.
    pub fn try_complete(&self) -> bool {
        self.cell.check()
    }

    /// Whether the operation has finished (completed, expired, or cancelled).
    pub fn is_finished(&self) -> bool {
        self.cell.is_done()
    }
}

impl<K, O> OpCell<K, O>
where
    K: WatchKey,
    O: Operation,
{
    /// Cancellation on behalf of a dropped handle.
    fn cancel_quietly(&self) -> Option<O> {
        self.cancel(OperationError::Cancelled, Fate::Cancelled)
    }
}
