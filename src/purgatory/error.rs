//! Errors of the purgatory.

use std::fmt;

/// [`Purgatory::try_complete_else_watch`](crate::Purgatory::try_complete_else_watch)
/// (or its `_at`, `_levels` and `_levels_at` forms) refused an operation; the
/// operation is handed back, unchecked (no keys, the pending limit, a drain,
/// a shutdown or a lost reaper found on arrival), or checked and not
/// completed (a shutdown or a lost reaper racing the registration, or the
/// purgatory's room for cells used up).
///
/// It is an error type (`Display`, `std::error::Error`) that carries the
/// operation, so it is `Send + Sync` only when the operation is. To pass the
/// failure on with `?` (into `anyhow`, a `Box<dyn Error + Send + Sync>`), take the
/// operation back or drop it and keep the [`kind`](WatchError::kind):
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use std::time::Duration;
/// use tokio_purgatory::{Operation, Purgatory, WatchErrorKind};
///
/// // An operation holding a callback that is `Send` but not `Sync`.
/// struct Callback(Box<dyn FnOnce() + Send>);
/// impl Operation for Callback {
///     type Output = ();
///     fn try_complete(&mut self) -> Option<()> { None }
///     fn on_expiration(self) { (self.0)() }
/// }
///
/// fn register(p: &Purgatory<u32, Callback>) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
///     let op = Callback(Box::new(|| {}));
///     p.try_complete_else_watch(op, Duration::from_secs(1), []).map_err(|e| e.kind())?.detach();
///     Ok(())
/// }
///
/// let p = Purgatory::builder().name("callbacks").build().unwrap();
/// let err = register(&p).unwrap_err();
/// assert_eq!(err.downcast_ref(), Some(&WatchErrorKind::NoKeys));
/// # }
/// ```
#[derive(PartialEq, Eq)]
#[non_exhaustive]
pub enum WatchError<Op> {
    /// The key list was empty: nothing could ever complete the operation early.
    NoKeys(Op),
    /// The purgatory holds its configured maximum of pending operations
    /// ([`PurgatoryBuilder::max_pending`](crate::PurgatoryBuilder::max_pending)),
    /// or, without one, as many operations as it can name (about 67 million
    /// in cells at once).
    AtCapacity(Op),
    /// The purgatory was shut down (or its last handle dropped).
    Shutdown(Op),
    /// The reaper task is gone (aborted, or its runtime shut down): the operation
    /// could never expire.
    ReaperGone(Op),
    /// The purgatory is draining ([`Purgatory::drain`](crate::Purgatory::drain)):
    /// it lets what is pending finish and takes nothing new.
    Draining(Op),
}

impl<Op> WatchError<Op> {
    /// The operation that was refused.
    ///
    /// ```
    /// use tokio_purgatory::WatchError;
    /// assert_eq!(WatchError::AtCapacity("op").into_inner(), "op");
    /// ```
    pub fn into_inner(self) -> Op {
        match self {
            WatchError::NoKeys(op)
            | WatchError::AtCapacity(op)
            | WatchError::Shutdown(op)
            | WatchError::ReaperGone(op)
            | WatchError::Draining(op) => op,
        }
    }

    /// Why it was refused, without the operation: `Copy`, `Send + Sync`, an error
    /// of its own.
    ///
    /// ```
    /// use tokio_purgatory::{WatchError, WatchErrorKind};
    /// assert_eq!(WatchError::Shutdown(()).kind(), WatchErrorKind::Shutdown);
    /// ```
    pub fn kind(&self) -> WatchErrorKind {
        match self {
            WatchError::NoKeys(_) => WatchErrorKind::NoKeys,
            WatchError::AtCapacity(_) => WatchErrorKind::AtCapacity,
            WatchError::Shutdown(_) => WatchErrorKind::Shutdown,
            WatchError::ReaperGone(_) => WatchErrorKind::ReaperGone,
            WatchError::Draining(_) => WatchErrorKind::Draining,
        }
    }
}

impl<Op> From<WatchError<Op>> for WatchErrorKind {
    fn from(e: WatchError<Op>) -> Self {
        e.kind()
    }
}

/// Why [`Purgatory::try_complete_else_watch`](crate::Purgatory::try_complete_else_watch)
/// refused an operation, without the operation: see [`WatchError::kind`].
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use std::time::Duration;
/// use tokio_purgatory::{Operation, Purgatory, WatchErrorKind};
///
/// struct Op;
/// impl Operation for Op {
///     type Output = ();
///     fn try_complete(&mut self) -> Option<()> { None }
///     fn on_expiration(self) {}
/// }
///
/// let p: Purgatory<u32, Op> = Purgatory::builder().max_pending(1).build().unwrap();
/// let _first = p.try_complete_else_watch(Op, Duration::from_secs(1), [1]).unwrap();
/// let refused = p.try_complete_else_watch(Op, Duration::from_secs(1), [1]).unwrap_err();
/// let kind: WatchErrorKind = refused.kind();
/// assert_eq!(kind, WatchErrorKind::AtCapacity);
/// assert_eq!(kind.to_string(), "purgatory is at its limit of pending operations");
/// # }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum WatchErrorKind {
    /// The key list was empty.
    NoKeys,
    /// The purgatory holds its configured maximum of pending operations, or
    /// as many as it can name.
    AtCapacity,
    /// The purgatory was shut down.
    Shutdown,
    /// The reaper task is gone.
    ReaperGone,
    /// The purgatory is draining.
    Draining,
}

impl fmt::Display for WatchErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            WatchErrorKind::NoKeys => "operation has no watch keys",
            WatchErrorKind::AtCapacity => "purgatory is at its limit of pending operations",
            WatchErrorKind::Shutdown => "purgatory is shut down",
            WatchErrorKind::ReaperGone => "purgatory's reaper task is gone",
            WatchErrorKind::Draining => "purgatory is draining and takes no new operations",
        })
    }
}

impl std::error::Error for WatchErrorKind {}

impl<Op> fmt::Debug for WatchError<Op> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WatchError::NoKeys(_) => f.write_str("NoKeys(..)"),
            WatchError::AtCapacity(_) => f.write_str("AtCapacity(..)"),
            WatchError::Shutdown(_) => f.write_str("Shutdown(..)"),
            WatchError::ReaperGone(_) => f.write_str("ReaperGone(..)"),
            WatchError::Draining(_) => f.write_str("Draining(..)"),
        }
    }
}

impl<Op> fmt::Display for WatchError<Op> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.kind(), f)
    }
}

impl<Op> std::error::Error for WatchError<Op> {}

/// Why an [`OperationHandle`](crate::OperationHandle) resolved without an output.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
/// use std::time::Duration;
/// use tokio_purgatory::{Operation, OperationError, Purgatory};
///
/// struct Fetch;
/// impl Operation for Fetch {
///     type Output = ();
///     fn try_complete(&mut self) -> Option<()> { None }
///     fn on_expiration(self) {}
/// }
///
/// let fetches: Purgatory<&str, Fetch> = Purgatory::new();
/// let parked = fetches.try_complete_else_watch(Fetch, Duration::from_secs(1), ["orders-0"]).unwrap();
/// // The partition moved to another broker: its fetches are taken back.
/// assert_eq!(fetches.cancel_for_key("orders-0").len(), 1);
/// assert_eq!(parked.await, Err(OperationError::Cancelled));
/// # }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum OperationError {
    /// Cancelled by [`cancel_for_key`](crate::Purgatory::cancel_for_key) or
    /// [`OpRef::cancel`](crate::OpRef::cancel): the operation was handed to
    /// that caller, or dropped if it was being checked at that moment and the
    /// check did not complete it.
    Cancelled,
    /// The purgatory was shut down; the operation was handed back by `shutdown()`
    /// (or dropped, when the last purgatory handle was dropped, or when it was
    /// being checked on another thread at that moment and the check did not
    /// complete it).
    Shutdown,
    /// The reaper task is gone (aborted, or its runtime shut down); the operation
    /// was dropped.
    ReaperGone,
    /// The operation's expiry code panicked (the panic was caught and reported
    /// through `tracing`).
    Panicked,
}

impl fmt::Display for OperationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            OperationError::Cancelled => "operation was cancelled",
            OperationError::Shutdown => "purgatory was shut down",
            OperationError::ReaperGone => "purgatory's reaper task is gone",
            OperationError::Panicked => "operation's expiry code panicked",
        })
    }
}

impl std::error::Error for OperationError {}
