//! The operation trait and the per-operation completion state machine.
//!
//! Each registered operation lives in an [`OpCell`]: the state machine (see
//! `state.rs`, checked by loom), the operation behind a lock only its checker
//! takes, and where its outcome goes.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::Waker;

use super::error::OperationError;
use super::state::{After, Claim, State, CANCEL, EXPIRE};
use super::{Shared, WatchKey};
use crate::reaper::TimerKey;

/// A request that waits in a [`Purgatory`](crate::Purgatory) until it can complete
/// or its timeout fires (Kafka's `DelayedOperation`: a produce waiting for
/// replicas, a fetch waiting for bytes, a join waiting for members).
///
/// The purgatory calls [`try_complete`](Operation::try_complete) when an event on
/// one of the operation's keys may have made it completable, and
/// [`on_expiration`](Operation::on_expiration) if the timeout fires first.
/// Exactly one of the two finishes the operation.
///
/// # Concurrency
///
/// Calls of `try_complete` on one operation never overlap, even when events on
/// several keys arrive on several threads at once, and none happens after the
/// operation has finished. Both methods run with no purgatory lock held, so they
/// may call back into the purgatory. They run on whatever thread caused them: the
/// caller of `try_complete_watched`, or the reaper task for expiry. Keep them short
/// and non-blocking.
///
/// A panic in either is caught and reported through `tracing`. A panicking check
/// counts as "not yet"; a panicking expiry resolves the handle with
/// [`OperationError::Panicked`].
///
/// # Examples
///
/// ```
/// use tokio_purgatory::Operation;
///
/// /// Waits until `acks` replicas have acknowledged an offset.
/// struct DelayedProduce {
///     acked: std::sync::Arc<std::sync::atomic::AtomicUsize>,
///     required: usize,
/// }
///
/// impl Operation for DelayedProduce {
///     type Output = Result<(), &'static str>;
///
///     fn try_complete(&mut self) -> Option<Self::Output> {
///         let acked = self.acked.load(std::sync::atomic::Ordering::Acquire);
///         (acked >= self.required).then_some(Ok(()))
///     }
///
///     fn on_expiration(self) -> Self::Output {
///         Err("request timed out")
///     }
/// }
///
/// let acked = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(1));
/// let mut produce = DelayedProduce { acked: acked.clone(), required: 2 };
/// assert_eq!(produce.try_complete(), None);
/// acked.store(2, std::sync::atomic::Ordering::Release);
/// assert_eq!(produce.try_complete(), Some(Ok(())));
/// ```
pub trait Operation: Send + 'static {
    /// What the operation produces, by completion or by expiry. Use `()` when the
    /// operation delivers its response itself (Kafka's `onComplete` sending it).
    type Output: Send + 'static;

    /// Returns the output if the operation can complete now, `None` if it must go
    /// on waiting.
    fn try_complete(&mut self) -> Option<Self::Output>;

    /// The timeout fired before any check completed the operation.
    fn on_expiration(self) -> Self::Output
    where
        Self: Sized;
}

/// How an operation finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Completion<T> {
    /// A check found it completable.
    Completed(T),
    /// Its timeout fired first.
    Expired(T),
}

impl<T> Completion<T> {
    /// The output, however it came.
    pub fn into_inner(self) -> T {
        match self {
            Completion::Completed(t) | Completion::Expired(t) => t,
        }
    }

    /// Whether a check completed it.
    pub fn is_completed(&self) -> bool {
        matches!(self, Completion::Completed(_))
    }

    /// Whether its timeout fired first.
    pub fn is_expired(&self) -> bool {
        matches!(self, Completion::Expired(_))
    }
}

/// What an operation handle resolves to.
pub(crate) type Outcome<T> = Result<Completion<T>, OperationError>;

/// How a finished operation is counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fate {
    Completed,
    Expired,
    /// Cancelled by key or by dropping its handle, or dropped unrun because the
    /// purgatory was dropped or lost its reaper.
    Cancelled,
    HandedBack,
}

#[derive(Debug)]
pub(crate) struct Delivery<T> {
    timer: Option<TimerKey>,
    result: Option<Outcome<T>>,
    waker: Option<Waker>,
    /// Nobody will ever read `result`: don't keep it.
    detached: bool,
}

/// One registered operation: state byte, the operation, and where its outcome
/// goes.
pub(crate) struct OpCell<K: WatchKey, O: Operation> {
    state: State,
    op: Mutex<Option<O>>,
    delivery: Mutex<Delivery<O::Output>>,
    /// Number of watch lists holding this cell (tombstone accounting).
    keys: u32,
    shared: Arc<Shared<K, O>>,
}

impl<K: WatchKey, O: Operation> std::fmt::Debug for OpCell<K, O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpCell")
            .field("done", &self.state.is_done())
            .field("keys", &self.keys)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // User code runs under `op` only inside `catch_unwind`, so a poisoned lock
    // would mean a bug of ours; the data is still usable.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl<K, O> OpCell<K, O>
where
    K: WatchKey,
    O: Operation,
{
    pub(crate) fn new(op: O, keys: u32, shared: Arc<Shared<K, O>>) -> Self {
        OpCell {
            state: State::new(),
            op: Mutex::new(Some(op)),
            delivery: Mutex::new(Delivery {
                timer: None,
                result: None,
                waker: None,
                detached: false,
            }),
            keys,
            shared,
        }
    }

    pub(crate) fn is_done(&self) -> bool {
        self.state.is_done()
    }

    /// Runs the operation's check, or asks the running checker to check again.
    /// Returns whether this call completed the operation.
    pub(crate) fn check(&self) -> bool {
        let me = thread_id();
        if !self.state.begin_check(me) {
            return false;
        }
        loop {
            let out = {
                let mut op = lock(&self.op);
                let op = op.as_mut().expect("a checkable operation is present");
                catch_unwind(AssertUnwindSafe(|| op.try_complete()))
            };
            match out {
                Ok(Some(output)) => {
                    self.state.complete();
                    let op = lock(&self.op).take();
                    drop(op);
                    self.finish(Ok(Completion::Completed(output)), Fate::Completed, true);
                    return true;
                }
                Ok(None) => {}
                Err(panic) => self.shared.note_panic("try_complete", &*panic),
            }
            match self.state.end_check(me) {
                After::Recheck => continue,
                After::Release => return false,
                After::Cancel => {
                    let op = lock(&self.op).take();
                    drop(op);
                    self.finish(Err(OperationError::Cancelled), Fate::Cancelled, true);
                    return false;
                }
                After::Expire => {
                    let op = lock(&self.op)
                        .take()
                        .expect("expiring operation is present");
                    self.run_expiry(op);
                    return false;
                }
            }
        }
    }

    /// Claims the operation (expiry or cancellation), taking it out, unless a
    /// check is running: then the request is left for the checker.
    fn claim(&self, request: u8) -> Option<O> {
        match self.state.claim(request) {
            Claim::Won => Some(lock(&self.op).take().expect("claimed operation is present")),
            Claim::Deferred | Claim::Done => None,
        }
    }

    /// The timeout fired (on the reaper task, with no lock held).
    pub(crate) fn expire(&self) {
        if let Some(op) = self.claim(EXPIRE) {
            self.run_expiry(op);
        }
    }

    fn run_expiry(&self, op: O) {
        let out = match catch_unwind(AssertUnwindSafe(|| op.on_expiration())) {
            Ok(output) => Ok(Completion::Expired(output)),
            Err(panic) => {
                self.shared.note_panic("on_expiration", &*panic);
                Err(OperationError::Panicked)
            }
        };
        // The timer entry is already gone: it is what called us, or the checker
        // that ran us was asked by it.
        self.finish(out, Fate::Expired, false);
    }

    /// Cancels the operation: it will neither complete nor expire. Returns it when
    /// this call took it (`why` is then delivered to the handle); `None` when it
    /// had finished, or a running check will finish it.
    pub(crate) fn cancel(&self, why: OperationError, fate: Fate) -> Option<O> {
        let op = self.claim(CANCEL)?;
        self.finish(Err(why), fate, true);
        Some(op)
    }

    /// Delivers the outcome once `DONE` is set, updates the counters, and removes
    /// the timer entry when `cancel_timer`.
    fn finish(&self, result: Outcome<O::Output>, fate: Fate, cancel_timer: bool) {
        self.shared.on_finished(fate, self.keys);
        let (timer, waker, dropped) = {
            let mut d = lock(&self.delivery);
            let dropped = if d.detached {
                Some(result)
            } else {
                d.result = Some(result);
                None
            };
            (d.timer.take(), d.waker.take(), dropped)
        };
        drop(dropped); // user output dropped outside the lock
        if cancel_timer {
            if let Some(key) = timer {
                drop(self.shared.core.remove(key));
            }
        }
        if let Some(w) = waker {
            w.wake();
        }
    }

    /// Records the timer entry, or removes it at once if the operation finished
    /// while it was being inserted.
    pub(crate) fn set_timer(&self, key: TimerKey) {
        let finished = {
            let mut d = lock(&self.delivery);
            if self.is_done() {
                true
            } else {
                d.timer = Some(key);
                false
            }
        };
        if finished {
            drop(self.shared.core.remove(key));
        }
    }

    /// Takes the outcome, or registers `waker` to be woken when there is one.
    pub(crate) fn poll_outcome(&self, waker: &Waker) -> Option<Outcome<O::Output>> {
        let mut d = lock(&self.delivery);
        match d.result.take() {
            Some(r) => Some(r),
            None => {
                if !d.waker.as_ref().is_some_and(|w| w.will_wake(waker)) {
                    d.waker = Some(waker.clone());
                }
                None
            }
        }
    }

    /// Nobody will read the outcome: drop any stored and don't store one later.
    pub(crate) fn detach(&self) {
        let (stale, waker) = {
            let mut d = lock(&self.delivery);
            d.detached = true;
            (d.result.take(), d.waker.take())
        };
        drop((stale, waker));
    }
}

/// A number naming the current thread (never 0).
fn thread_id() -> u64 {
    use std::sync::atomic::AtomicU64 as Counter;
    static NEXT: Counter = Counter::new(1);
    thread_local! {
        static ID: u64 = NEXT.fetch_add(1, Ordering::Relaxed);
    }
    ID.with(|id| *id)
}
