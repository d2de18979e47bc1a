//! What users implement and match on: the [`Operation`] trait, the
//! [`Completion`] it ends in, and what a [`WatchKey`] must be.

use std::hash::Hash;

/// A request that waits in a [`Purgatory`](crate::Purgatory) until it can complete
/// or its timeout fires (Kafka's `DelayedOperation`: a produce waiting for
/// replicas, a fetch waiting for bytes, a join waiting for members).
///
/// The purgatory calls [`try_complete`](Operation::try_complete) when an event on
/// one of the operation's keys may have made it completable (or
/// [`try_complete_reached`](Operation::try_complete_reached), telling it the
/// level a key reached), and
/// [`on_expiration`](Operation::on_expiration) if the timeout fires first.
/// At most one of the two finishes the operation, once: a check that returns
/// the output, or the expiry. An operation cancelled (by its handle, an
/// [`OpRef`](crate::OpRef) or [`cancel_for_key`](crate::Purgatory::cancel_for_key))
/// or taken back by [`shutdown`](crate::Purgatory::shutdown) finishes with
/// neither: it is handed back to the caller of that method, or dropped.
///
/// # Concurrency
///
/// Calls of `try_complete` on one operation never overlap, even when events on
/// several keys arrive on several threads at once, and none happens after the
/// operation has finished. That is done with a lock of the operation's own, held
/// while `try_complete` runs; no lock of the purgatory's is held, so both methods
/// may call back into the purgatory (walk keys, their own included, register
/// operations, shut it down). They run on whatever thread caused them: the caller
/// of a walk (`try_complete_watched`, `try_complete_reached`), of registration
/// or of [`OpRef::try_complete`](crate::OpRef::try_complete), or the reaper
/// task for expiry (or the thread whose check was running when the timeout
/// fired, once that check says "not yet"). Keep them short and non-blocking.
///
/// A walk from inside `try_complete` does not check this operation again
/// while its check runs (that would overlap it): a walk of its own keys is
/// taken as known to it; when the walk (or a registration or cancellation
/// by key it makes) runs another operation's check, expiry or drop, or the
/// drop of a key the purgatory let go, that walks this operation's key (it
/// made this one ready, say), this check runs once more after it returns
/// "not yet" (see the
/// crate's guarantees, "No missed events", for the bound on such re-runs).
///
/// # Panics and drops
///
/// A panic in either method is caught, counted in
/// [`PurgatoryMetrics::panicked`](crate::PurgatoryMetrics::panicked) and reported
/// through `tracing`. A panicking check counts as "not yet"; a panicking expiry
/// resolves the handle with
/// [`OperationError::Panicked`](crate::OperationError::Panicked).
///
/// The purgatory drops a finished operation at once, on the thread that finished
/// it, with no lock held; so may it drop an output nobody will read. Their `Drop`
/// may call back into the purgatory, and a panic in it is caught and counted the
/// same way: the operation's handle still resolves.
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
    ///
    /// Calls never overlap and never come after the operation finished; an
    /// event from another thread during one makes it run again. See the
    /// trait's "Concurrency" section for the threads it runs on, what it may
    /// call, and events its own walks raise.
    ///
    /// # Examples
    ///
    /// ```
    /// use tokio_purgatory::Operation;
    ///
    /// /// Done once enough bytes are readable.
    /// struct MinBytes { readable: std::sync::Arc<std::sync::atomic::AtomicUsize>, min: usize }
    ///
    /// impl Operation for MinBytes {
    ///     type Output = usize;
    ///     fn try_complete(&mut self) -> Option<usize> {
    ///         let n = self.readable.load(std::sync::atomic::Ordering::Acquire);
    ///         (n >= self.min).then_some(n)
    ///     }
    ///     fn on_expiration(self) -> usize {
    ///         self.readable.load(std::sync::atomic::Ordering::Acquire)
    ///     }
    /// }
    ///
    /// let readable = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(10));
    /// let mut op = MinBytes { readable: readable.clone(), min: 100 };
    /// assert_eq!(op.try_complete(), None);
    /// readable.store(150, std::sync::atomic::Ordering::Release);
    /// assert_eq!(op.try_complete(), Some(150));
    /// ```
    fn try_complete(&mut self) -> Option<Self::Output>;

    /// The check as run by
    /// [`try_complete_reached(&key, level)`](crate::Purgatory::try_complete_reached):
    /// `reached` is the level that call says the key has reached, so a check
    /// woken by a high watermark need not load it from where it is stored.
    /// The default ignores it and calls [`try_complete`](Operation::try_complete).
    ///
    /// Every check that call runs is told a level: those of operations
    /// watching the key at a level at most `level`, and those watching it
    /// without a level. Checks at registration, by `try_complete_watched` and
    /// by [`OpRef::try_complete`](crate::OpRef::try_complete) call
    /// `try_complete`. Registration's checks cannot be told a level (a key's
    /// level may have moved before the watch was in place, and the purgatory
    /// keeps no level per key), so `try_complete` must still read the stored
    /// level; the usual shape is a `try_complete` that loads it and calls
    /// `try_complete_reached` with it.
    ///
    /// # Concurrency
    ///
    /// When the operation is being checked on another thread at that moment,
    /// the call asks that check to run again and hands it the level. The
    /// re-run is told the highest level handed over by the calls that asked
    /// for it (several advances may fold into one re-run, and a call that
    /// ends up running the check itself is told the highest left so far);
    /// when only calls without a level asked, the re-run is told the level
    /// the check before it was told, if any. An operation watching the
    /// levels of more than one key may so be told any of their levels: such
    /// an operation should keep what it needs per key, and use `reached` only
    /// as a hint.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// use std::sync::atomic::{AtomicU64, Ordering};
    /// use std::sync::Arc;
    /// use std::time::Duration;
    /// use tokio_purgatory::{Completion, Operation, Purgatory, Watch};
    ///
    /// /// A produce with `acks=all`: done once the high watermark passes `last`.
    /// struct Produce { hw: Arc<AtomicU64>, last: u64 }
    /// impl Operation for Produce {
    ///     type Output = Result<u64, &'static str>;
    ///     // At registration: the stored high watermark.
    ///     fn try_complete(&mut self) -> Option<Self::Output> {
    ///         self.try_complete_reached(self.hw.load(Ordering::Acquire))
    ///     }
    ///     // On an advance: the high watermark it names.
    ///     fn try_complete_reached(&mut self, hw: u64) -> Option<Self::Output> {
    ///         (hw > self.last).then_some(Ok(hw))
    ///     }
    ///     fn on_expiration(self) -> Self::Output { Err("REQUEST_TIMED_OUT") }
    /// }
    ///
    /// let produces: Purgatory<&str, Produce> = Purgatory::new();
    /// let hw = Arc::new(AtomicU64::new(0));
    /// let handle = produces
    ///     .try_complete_else_watch_levels(
    ///         Produce { hw: hw.clone(), last: 41 },
    ///         Duration::from_secs(30),
    ///         [Watch::above("orders-0", 41)],
    ///     )
    ///     .unwrap();
    /// hw.store(41, Ordering::Release);
    /// assert_eq!(produces.try_complete_reached("orders-0", 41), 0, "not past 41: not checked");
    /// hw.store(50, Ordering::Release);
    /// assert_eq!(produces.try_complete_reached("orders-0", 50), 1);
    /// assert_eq!(handle.await, Ok(Completion::Completed(Ok(50))));
    /// # }
    /// ```
    fn try_complete_reached(&mut self, reached: u64) -> Option<Self::Output> {
        let _ = reached;
        self.try_complete()
    }

    /// The timeout fired before any check completed the operation: returns
    /// the output its handle receives as [`Completion::Expired`].
    ///
    /// It runs on the reaper task (or, when the timeout fires while a check
    /// of the operation runs on another thread and that check says "not yet",
    /// on that thread, right after it), with no lock of the purgatory held. It
    /// is not called for an operation that is cancelled, handed back by
    /// [`shutdown`](crate::Purgatory::shutdown), or dropped because its
    /// purgatory or reaper is gone.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// use std::time::Duration;
    /// use tokio_purgatory::{Completion, Operation, Purgatory};
    ///
    /// struct Fetch { bytes: usize }
    /// impl Operation for Fetch {
    ///     type Output = usize;
    ///     fn try_complete(&mut self) -> Option<usize> { None }
    ///     // `fetch.max.wait.ms` passed: answer with what there is.
    ///     fn on_expiration(self) -> usize { self.bytes }
    /// }
    ///
    /// let fetches: Purgatory<u32, Fetch> = Purgatory::new();
    /// let h = fetches
    ///     .try_complete_else_watch(Fetch { bytes: 12 }, Duration::from_millis(500), [7])
    ///     .unwrap();
    /// assert_eq!(h.await, Ok(Completion::Expired(12)));
    /// # }
    /// ```
    fn on_expiration(self) -> Self::Output
    where
        Self: Sized;
}

/// How an operation finished: what its handle resolves to when it was not
/// cancelled, handed back or dropped (those are
/// [`OperationError`](crate::OperationError)s).
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
/// use std::time::Duration;
/// use tokio_purgatory::{Completion, Operation, Purgatory};
///
/// struct Join { ready: bool }
/// impl Operation for Join {
///     type Output = &'static str;
///     fn try_complete(&mut self) -> Option<&'static str> { self.ready.then_some("joined") }
///     fn on_expiration(self) -> &'static str { "rebalance timed out" }
/// }
///
/// let joins: Purgatory<&str, Join> = Purgatory::new();
/// let at_once = joins.try_complete_else_watch(Join { ready: true }, Duration::from_secs(1), ["g"]);
/// let later = joins.try_complete_else_watch(Join { ready: false }, Duration::from_secs(1), ["g"]);
/// match later.unwrap().await {
///     Ok(Completion::Expired(why)) => assert_eq!(why, "rebalance timed out"),
///     other => panic!("{other:?}"),
/// }
/// assert_eq!(at_once.unwrap().await, Ok(Completion::Completed("joined")));
/// # }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Completion<T> {
    /// A check found it completable.
    Completed(T),
    /// Its timeout fired first.
    Expired(T),
}

impl<T> Completion<T> {
    /// The output, however it came.
    ///
    /// # Examples
    ///
    /// ```
    /// use tokio_purgatory::Completion;
    /// assert_eq!(Completion::Expired("partial").into_inner(), "partial");
    /// ```
    pub fn into_inner(self) -> T {
        match self {
            Completion::Completed(t) | Completion::Expired(t) => t,
        }
    }

    /// Whether a check completed it.
    ///
    /// # Examples
    ///
    /// ```
    /// use tokio_purgatory::Completion;
    /// assert!(Completion::Completed(()).is_completed());
    /// assert!(!Completion::Expired(()).is_completed());
    /// ```
    pub fn is_completed(&self) -> bool {
        matches!(self, Completion::Completed(_))
    }

    /// Whether its timeout fired first.
    ///
    /// # Examples
    ///
    /// ```
    /// use tokio_purgatory::Completion;
    /// assert!(Completion::Expired(()).is_expired());
    /// ```
    pub fn is_expired(&self) -> bool {
        matches!(self, Completion::Expired(_))
    }

    /// Applies `f` to the output, keeping how it came.
    ///
    /// ```
    /// use tokio_purgatory::Completion;
    /// assert_eq!(Completion::Expired(2).map(|n| n * 10), Completion::Expired(20));
    /// ```
    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> Completion<U> {
        match self {
            Completion::Completed(t) => Completion::Completed(f(t)),
            Completion::Expired(t) => Completion::Expired(f(t)),
        }
    }

    /// A completion of a reference to the output.
    ///
    /// ```
    /// use tokio_purgatory::Completion;
    /// let c = Completion::Completed(String::from("ok"));
    /// assert_eq!(c.as_ref().map(|s| s.len()), Completion::Completed(2));
    /// ```
    pub fn as_ref(&self) -> Completion<&T> {
        match self {
            Completion::Completed(t) => Completion::Completed(t),
            Completion::Expired(t) => Completion::Expired(t),
        }
    }

    /// A completion of a mutable reference to the output.
    ///
    /// ```
    /// use tokio_purgatory::Completion;
    /// let mut c = Completion::Expired(vec![1]);
    /// if let Completion::Expired(v) = c.as_mut() { v.push(2) }
    /// assert_eq!(c.into_inner(), vec![1, 2]);
    /// ```
    pub fn as_mut(&mut self) -> Completion<&mut T> {
        match self {
            Completion::Completed(t) => Completion::Completed(t),
            Completion::Expired(t) => Completion::Expired(t),
        }
    }
}

/// What a watch key must be: hashable, comparable, cloneable and shareable.
/// Implemented for every such type (strings, integers, `(topic, partition)`
/// tuples, ...).
///
/// A key whose `Hash` and `Eq` disagree does not corrupt anything: at worst the
/// operations watching it are not found by `try_complete_watched` and finish by
/// their timeout.
///
/// # Key code and locks
///
/// A key's `Eq` (to find its watch list) runs under the lock of the
/// watcher-map shard that holds the key (a registration may hold the shards of
/// its other keys too): it must not call back into the purgatory; keep it
/// plain. The same holds for the key's `Borrow::borrow` and the borrowed
/// form's `Eq`, which the methods taking a key as `&Q` run under that lock to
/// compare. Its `Clone` (when a key is first watched, the map keeps a copy) runs
/// before that lock is taken, and its `Hash` once per call, before any lock,
/// and never for a key the map already holds. If any of the three panics, the panic reaches the caller of
/// the method that ran it, and the purgatory is left as it was before that call.
/// A key's `Drop` runs with no lock held and may do anything; a panic in it is
/// contained.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
/// use std::time::Duration;
/// use tokio_purgatory::{Operation, Purgatory, WatchKey};
///
/// /// A partition, as Kafka's purgatories key their produces and fetches.
/// #[derive(Clone, PartialEq, Eq, Hash)]
/// struct TopicPartition { topic: String, partition: i32 }
///
/// fn is_watch_key<K: WatchKey>() {}
/// is_watch_key::<TopicPartition>();
/// is_watch_key::<(String, i32)>();
///
/// struct Produce;
/// impl Operation for Produce {
///     type Output = ();
///     fn try_complete(&mut self) -> Option<()> { None }
///     fn on_expiration(self) {}
/// }
/// let produces: Purgatory<TopicPartition, Produce> = Purgatory::new();
/// let tp = TopicPartition { topic: "orders".into(), partition: 0 };
/// let _h = produces.try_complete_else_watch(Produce, Duration::from_secs(30), [tp.clone()]);
/// assert_eq!(produces.try_complete_watched(&tp), 0, "checked, not completed");
/// # }
/// ```
pub trait WatchKey: Hash + Eq + Clone + Send + Sync + 'static {}

impl<T: Hash + Eq + Clone + Send + Sync + 'static> WatchKey for T {}
