//! Containing panics in user code: run it, or drop a user value, inside
//! `catch_unwind`; count the panic and report it through `tracing`; go on.
//!
//! Every purgatory and timer keeps one [`Panics`], the count its metrics show.
//! A caught panic's payload is dropped contained too ([`drop_payload`]): a
//! payload from `std::panic::panic_any` may be any type, with a `Drop` that
//! panics again.

use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The panics caught in one purgatory's or timer's user code: counted, and
/// reported with the owner's kind and name.
#[derive(Debug)]
pub(crate) struct Panics {
    /// `"purgatory"` or `"timer"`, for the reports.
    kind: &'static str,
    name: Arc<str>,
    count: AtomicU64,
}

impl Panics {
    pub(crate) fn new(kind: &'static str, name: Arc<str>) -> Panics {
        Panics {
            kind,
            name,
            count: AtomicU64::new(0),
        }
    }

    /// Panics caught so far.
    pub(crate) fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    /// Counts and reports a panic caught in `what`. The report goes through
    /// the application's `tracing` subscriber, code of its own: a panic there
    /// is swallowed (the panic is counted already), so that it cannot unwind
    /// out of the code that caught the first one.
    pub(crate) fn note(&self, what: &str, panic: &(dyn Any + Send)) {
        self.count.fetch_add(1, Ordering::Relaxed);
        quietly(|| {
            tracing::error!(
                kind = self.kind,
                name = &*self.name,
                callback = what,
                panic = panic_message(panic),
                "user code panicked; carrying on"
            );
        });
    }

    /// Counts and reports a panic caught in `what`, then drops its payload
    /// contained.
    pub(crate) fn caught(&self, what: &str, panic: Box<dyn Any + Send>) {
        self.note(what, &*panic);
        drop_payload(panic);
    }

    /// Runs `f` (user code), containing a panic in it: `None` when it
    /// panicked.
    pub(crate) fn run<R>(&self, what: &str, f: impl FnOnce() -> R) -> Option<R> {
        match catch_unwind(AssertUnwindSafe(f)) {
            Ok(r) => Some(r),
            Err(panic) => {
                self.caught(what, panic);
                None
            }
        }
    }

    /// Drops a user value, containing a panic in its `Drop`.
    pub(crate) fn drop_value<T>(&self, what: &str, value: T) {
        if std::mem::needs_drop::<T>() {
            if let Err(panic) = catch_unwind(AssertUnwindSafe(move || drop(value))) {
                self.caught(what, panic);
            }
        }
    }

    /// Drops each of `values` on its own, as [`drop_value`](Self::drop_value)
    /// does: a panic in one drop does not skip the rest.
    pub(crate) fn drop_each<T>(&self, what: &str, values: impl IntoIterator<Item = T>) {
        if std::mem::needs_drop::<T>() {
            for v in values {
                self.drop_value(what, v);
            }
        }
    }
}

/// Runs `f`, a call into the application's `tracing` subscriber (an event, a
/// span made, entered, left, recorded or closed): code of the application's
/// own, which may panic. Such a panic is swallowed, not counted as a panic of
/// a purgatory's or timer's user code, so that a subscriber that panics on
/// some events cannot unwind out of a walk, an expiry or the reaper and leave
/// an operation half finished. `None` when it panicked.
pub(crate) fn quietly<R>(f: impl FnOnce() -> R) -> Option<R> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => Some(r),
        Err(panic) => {
            drop_payload(panic);
            None
        }
    }
}

/// Drops a caught panic's payload. A payload from `std::panic::panic_any` may
/// be any type, and its own `Drop` may panic: that second panic is caught here
/// and its payload forgotten, so no unwinding leaves the code that caught the
/// first one (and skips the bookkeeping after it).
pub(crate) fn drop_payload(payload: Box<dyn Any + Send>) {
    if let Err(again) = catch_unwind(AssertUnwindSafe(move || drop(payload))) {
        std::mem::forget(again);
    }
}

/// The text of a panic payload, when it has one.
pub(crate) fn panic_message(panic: &(dyn Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("<non-string panic payload>")
}

#[cfg(all(test, not(purgatory_loom)))]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn panic_messages_are_read_from_either_payload() {
        let text: Box<dyn Any + Send> = Box::new("boom");
        assert_eq!(panic_message(&*text), "boom");
        let owned: Box<dyn Any + Send> = Box::new(String::from("owned boom"));
        assert_eq!(panic_message(&*owned), "owned boom");
        let other: Box<dyn Any + Send> = Box::new(7u32);
        assert_eq!(panic_message(&*other), "<non-string panic payload>");
    }

    #[test]
    fn each_drop_is_contained_on_its_own() {
        struct Loud(bool, Arc<AtomicUsize>);
        impl Drop for Loud {
            fn drop(&mut self) {
                self.1.fetch_add(1, Ordering::SeqCst);
                if self.0 {
                    panic!("loud drop");
                }
            }
        }
        let panics = Panics::new("timer", "test".into());
        let dropped = Arc::new(AtomicUsize::new(0));
        let values = [true, false, true, false].map(|p| Loud(p, dropped.clone()));
        panics.drop_each("drop of a value", values);
        assert_eq!(dropped.load(Ordering::SeqCst), 4, "every value dropped");
        assert_eq!(panics.count(), 2);
        panics.drop_value("drop of a value", Loud(true, dropped.clone()));
        assert_eq!(panics.count(), 3);
        panics.run("a task", || panic!("in a task"));
        assert_eq!(panics.count(), 4);
        // Values without drop glue are not even looked at.
        panics.drop_value("a number", 5u32);
        assert_eq!(panics.count(), 4);
    }

    /// A payload whose own drop panics is dropped contained, and forgotten.
    #[test]
    fn a_payload_that_panics_on_drop_stays_contained() {
        struct Bomb;
        impl Drop for Bomb {
            fn drop(&mut self) {
                panic!("the payload's drop");
            }
        }
        let panics = Panics::new("purgatory", "test".into());
        panics.run("a check", || std::panic::panic_any(Bomb));
        assert_eq!(panics.count(), 1);
    }
}
