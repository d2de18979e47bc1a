//! Errors of the purgatory.

use std::fmt;

/// [`Purgatory::try_complete_else_watch`](crate::Purgatory::try_complete_else_watch)
/// refused an operation; the operation is handed back untouched.
#[derive(PartialEq, Eq)]
pub enum WatchError<Op> {
    /// The key list was empty: nothing could ever complete the operation early.
    NoKeys(Op),
    /// The purgatory holds its configured maximum of pending operations.
    AtCapacity(Op),
    /// The purgatory was shut down (or its last handle dropped).
    Shutdown(Op),
    /// The reaper task is gone (aborted, or its runtime shut down): the operation
    /// could never expire.
    ReaperGone(Op),
}

impl<Op> WatchError<Op> {
    /// The operation that was refused.
    pub fn into_inner(self) -> Op {
        match self {
            WatchError::NoKeys(op)
            | WatchError::AtCapacity(op)
            | WatchError::Shutdown(op)
            | WatchError::ReaperGone(op) => op,
        }
    }
}

impl<Op> fmt::Debug for WatchError<Op> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WatchError::NoKeys(_) => f.write_str("NoKeys(..)"),
            WatchError::AtCapacity(_) => f.write_str("AtCapacity(..)"),
            WatchError::Shutdown(_) => f.write_str("Shutdown(..)"),
            WatchError::ReaperGone(_) => f.write_str("ReaperGone(..)"),
        }
    }
}

impl<Op> fmt::Display for WatchError<Op> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            WatchError::NoKeys(_) => "operation has no watch keys",
            WatchError::AtCapacity(_) => "purgatory is at its limit of pending operations",
            WatchError::Shutdown(_) => "purgatory is shut down",
            WatchError::ReaperGone(_) => "purgatory's reaper task is gone",
        })
    }
}

impl<Op> std::error::Error for WatchError<Op> {}

/// Why an [`OperationHandle`](crate::OperationHandle) resolved without an output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum OperationError {
    /// Removed by [`cancel_for_key`](crate::Purgatory::cancel_for_key): the
    /// operation was handed to that caller, or dropped if it was being checked at
    /// that moment and the check did not complete it.
    Cancelled,
    /// The purgatory was shut down; the operation was handed back by `shutdown()`
    /// (or dropped, when the last purgatory handle was dropped).
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
