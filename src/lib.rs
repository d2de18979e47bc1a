//! placeholder
#![forbid(unsafe_code)]
#![warn(
    missing_docs,
    missing_debug_implementations,
    rust_2018_idioms,
    unreachable_pub
)]

pub mod purgatory;
mod reaper;
pub mod timer;
mod watchers;
mod wheel;

pub use purgatory::{
    Completion, OpRef, Operation, OperationError, OperationHandle, Purgatory, PurgatoryBuilder,
    PurgatoryMetrics, WatchError, WatchKey,
};
pub use timer::{Timer, TimerBuilder};
