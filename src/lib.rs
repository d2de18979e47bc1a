//! placeholder (crate docs written below)
#![forbid(unsafe_code)]
#![warn(
    missing_docs,
    missing_debug_implementations,
    rust_2018_idioms,
    unreachable_pub
)]

mod reaper;
pub mod timer;
mod wheel;

pub use timer::{Timer, TimerBuilder};
