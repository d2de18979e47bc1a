//! The application's `tracing` subscriber is code of its own, called on the
//! thread that emits, at every level down to TRACE. A subscriber whose
//! callbacks call back into the crate (reading the figures, registering,
//! walking, cancelling, shutting down, draining, dropping the last clone,
//! building on a lost reaper) from the `register` and `operation finished`
//! events, the reaper turn's span and the lost-reaper warning, or that
//! blocks in every callback on several threads, deadlocks nothing: every
//! handle resolves and the counts balance.
//!
//! The file also pins what the docs say of the crate's `tracing` output:
//! each reaper turn is a debug span, `reaper turn`, that records its
//! expiries as `expired` on itself, never on the application's span when it
//! is disabled; every span and event carries `kind` (`"purgatory"` or
//! `"timer"`) and `name` (the builder's).
//!
//! Each test installs its subscriber for its own thread only (no global
//! default), on paused time but for the slow subscriber, on real threads;
//! every test is bounded.

mod support;

use std::cell::Cell;
use std::fmt::Write as _;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::advance;
use tokio_purgatory::{
    Completion, Operation, OperationError, Purgatory, Reaper, Timer, WatchError,
};
use tracing::level_filters::LevelFilter;

use support::{balanced, get, ms, paused_within, resolve, settle, within, Slot};

/// The message of the warning a reaper stopped without a shutdown gives.
const LOST: &str = "reaper stopped without a shutdown";

// ---------------------------------------------------------------- subscriber

/// What the crate asked the subscriber to do.
#[derive(Debug, Clone)]
pub struct Call {
    /// "event", "new_span", "enter", "exit", "record", "close".
    pub kind: &'static str,
    /// An event's message, or the span's name.
    pub name: String,
    /// The target of an event or of a new span (empty for the others).
    pub target: String,
    /// The fields, `k=v ` each (values as `Debug` prints them).
    pub fields: String,
    /// The fields one by one, a string value as it was given.
    pub values: Vec<(&'static str, String)>,
    /// The level of an event or of a new span (none for the others).
    pub level: Option<tracing::Level>,
}

impl Call {
    /// The value of the field `name`, if the call carries it.
    fn field(&self, name: &str) -> Option<&str> {
        self.values
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.as_str())
    }
}

type Hook = Arc<dyn Fn(&Call) + Send + Sync>;

struct Hooked {
    hook: Hook,
    calls: Arc<Mutex<Vec<Call>>>,
}

thread_local! {
    static DEPTH: Cell<usize> = const { Cell::new(0) };
}

/// An event's message, the other fields as text, and one by one.
#[derive(Default)]
struct Fields {
    message: String,
    text: String,
    values: Vec<(&'static str, String)>,
}

impl tracing::field::Visit for Fields {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        self.record_debug(field, &value);
        if field.name() != "message" {
            if let Some(last) = self.values.last_mut() {
                last.1 = value.to_owned();
            }
        }
    }
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.message = format!("{value:?}");
        } else {
            let _ = write!(self.text, "{}={:?} ", field.name(), value);
            self.values.push((field.name(), format!("{value:?}")));
        }
    }
}

impl Hooked {
    fn new(hook: impl Fn(&Call) + Send + Sync + 'static) -> (Hooked, Arc<Mutex<Vec<Call>>>) {
        let calls = Arc::new(Mutex::new(Vec::new()));
        (
            Hooked {
                hook: Arc::new(hook),
                calls: calls.clone(),
            },
            calls,
        )
    }

    fn fire(&self, call: Call) {
        self.calls
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(call.clone());
        // Calls made by the hook's own calls back in are recorded, not hooked.
        if DEPTH.with(|d| d.get()) > 0 {
            return;
        }
        DEPTH.with(|d| d.set(1));
        struct Reset;
        impl Drop for Reset {
            fn drop(&mut self) {
                DEPTH.with(|d| d.set(0));
            }
        }
        let _reset = Reset;
        (self.hook)(&call);
    }

    /// A call on the span `id`, which carries no fields of its own.
    fn on_span<S>(&self, kind: &'static str, id: &tracing::span::Id, ctx: &Ctx<'_, S>)
    where
        S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    {
        self.fire(Call {
            kind,
            name: name_of(ctx, id),
            target: String::new(),
            fields: String::new(),
            values: Vec::new(),
            level: None,
        });
    }
}

type Ctx<'a, S> = tracing_subscriber::layer::Context<'a, S>;

impl<S> tracing_subscriber::Layer<S> for Hooked
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    fn on_new_span(
        &self,
        attrs: &tracing::span::Attributes<'_>,
        _: &tracing::span::Id,
        _: Ctx<'_, S>,
    ) {
        let mut f = Fields::default();
        attrs.record(&mut f);
        self.fire(Call {
            kind: "new_span",
            name: attrs.metadata().name().to_owned(),
            target: attrs.metadata().target().to_owned(),
            fields: f.text,
            values: f.values,
            level: Some(*attrs.metadata().level()),
        });
    }
    fn on_record(
        &self,
        id: &tracing::span::Id,
        values: &tracing::span::Record<'_>,
        ctx: Ctx<'_, S>,
    ) {
        let mut f = Fields::default();
        values.record(&mut f);
        self.fire(Call {
            kind: "record",
            name: name_of(&ctx, id),
            target: String::new(),
            fields: f.text,
            values: f.values,
            level: None,
        });
    }
    fn on_event(&self, event: &tracing::Event<'_>, _: Ctx<'_, S>) {
        let mut f = Fields::default();
        event.record(&mut f);
        self.fire(Call {
            kind: "event",
            name: f.message,
            target: event.metadata().target().to_owned(),
            fields: f.text,
            values: f.values,
            level: Some(*event.metadata().level()),
        });
    }
    fn on_enter(&self, id: &tracing::span::Id, ctx: Ctx<'_, S>) {
        self.on_span("enter", id, &ctx);
    }
    fn on_exit(&self, id: &tracing::span::Id, ctx: Ctx<'_, S>) {
        self.on_span("exit", id, &ctx);
    }
    fn on_close(&self, id: tracing::span::Id, ctx: Ctx<'_, S>) {
        self.on_span("close", &id, &ctx);
    }
}

fn name_of<S>(ctx: &Ctx<'_, S>, id: &tracing::span::Id) -> String
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    ctx.span(id)
        .map(|s| s.name().to_owned())
        .unwrap_or_default()
}

/// What the hooked layer was asked, in order.
type Calls = Arc<Mutex<Vec<Call>>>;

/// The hooked layer on a registry (which tracks the current span), every
/// level enabled.
fn subscriber(
    hook: impl Fn(&Call) + Send + Sync + 'static,
) -> (impl tracing::Subscriber + Send + Sync, Calls) {
    use tracing_subscriber::layer::SubscriberExt as _;
    let (h, calls) = Hooked::new(hook);
    (tracing_subscriber::registry().with(h), calls)
}

/// The hooked layer on a registry behind a level filter, hooking nothing.
fn filtered(level: LevelFilter) -> (impl tracing::Subscriber + Send + Sync, Calls) {
    use tracing_subscriber::layer::SubscriberExt as _;
    let (h, calls) = Hooked::new(|_| {});
    (tracing_subscriber::registry().with(level).with(h), calls)
}

// ---------------------------------------------------------------- operations

/// Completes with "done" once its flag is set; expires to "expired".
struct Op {
    ready: Arc<AtomicBool>,
}

impl Operation for Op {
    type Output = &'static str;
    fn try_complete(&mut self) -> Option<&'static str> {
        self.ready.load(Ordering::SeqCst).then_some("done")
    }
    fn on_expiration(self) -> &'static str {
        "expired"
    }
}

fn op(ready: &Arc<AtomicBool>) -> Op {
    Op {
        ready: ready.clone(),
    }
}

/// An operation that only expires.
fn never() -> Op {
    Op {
        ready: Arc::default(),
    }
}

type P = Purgatory<u32, Op>;

// ---------------------------------------------------------------- tests

/// Every callback (event, span made, entered, left, recorded, closed) reads
/// the purgatory's and the timer's figures: nothing deadlocks, and the work
/// goes on; the counts balance once nothing is pending.
#[test]
fn every_callback_reads_the_figures() {
    paused_within(60, || async {
        let slot: Slot<P> = Arc::default();
        let tslot: Slot<Timer> = Arc::default();
        let reads = Arc::new(AtomicUsize::new(0));
        let (s, r, t) = (slot.clone(), reads.clone(), tslot.clone());
        let (sub, calls) = subscriber(move |_| {
            if let Some(p) = get(&s) {
                let m = p.metrics();
                let _ = (p.watched(), p.delayed(), m.delayed, p.is_shutdown());
                r.fetch_add(1, Ordering::SeqCst);
            }
            if let Some(t) = get(&t) {
                let _ = (t.len(), t.metrics(), t.is_shutdown());
            }
        });
        let _guard = tracing::subscriber::set_default(sub);

        let p: P = Purgatory::builder()
            .name("reads")
            .purge_interval(0)
            .build()
            .unwrap();
        let timer = Timer::builder().name("reads-timer").build().unwrap();
        *slot.lock().unwrap() = Some(p.clone());
        *tslot.lock().unwrap() = Some(timer.clone());

        let ready = Arc::new(AtomicBool::new(false));
        let by_event: Vec<_> = (0..20)
            .map(|i| {
                p.try_complete_else_watch(op(&ready), ms(100), [i % 4, 10 + i % 3])
                    .unwrap()
            })
            .collect();
        let by_ref = p
            .try_complete_else_watch(op(&ready), ms(100), [50])
            .unwrap();
        let expiring: Vec<_> = (0..20u32)
            .map(|i| {
                p.try_complete_else_watch(never(), ms(10 + u64::from(i % 3)), [100 + i])
                    .unwrap()
            })
            .collect();
        let cancelled = p.try_complete_else_watch(never(), ms(500), [200]).unwrap();
        let by_key = p.try_complete_else_watch(never(), ms(500), [201]).unwrap();
        let to_hand_back = p.try_complete_else_watch(never(), ms(5000), [300]).unwrap();
        let ran = Arc::new(AtomicUsize::new(0));
        for d in [5, 15, 25] {
            let r = ran.clone();
            timer
                .schedule(ms(d), move || {
                    r.fetch_add(1, Ordering::SeqCst);
                })
                .unwrap();
        }
        let r = ran.clone();
        timer
            .schedule(ms(1), move || {
                r.fetch_add(1, Ordering::SeqCst);
                panic!("a task that panics");
            })
            .unwrap();

        ready.store(true, Ordering::SeqCst);
        assert!(by_ref.op_ref().unwrap().try_complete());
        let completed: usize = (0..4).map(|k| p.try_complete_watched(&k)).sum();
        assert_eq!(completed, 20);
        assert!(cancelled.cancel().is_some());
        assert_eq!(p.cancel_for_key(&201).len(), 1);
        for h in by_event {
            assert_eq!(resolve(h).await, Ok(Completion::Completed("done")));
        }
        assert_eq!(resolve(by_ref).await, Ok(Completion::Completed("done")));
        assert_eq!(resolve(by_key).await, Err(OperationError::Cancelled));
        for h in expiring {
            assert_eq!(resolve(h).await, Ok(Completion::Expired("expired")));
        }
        advance(ms(30)).await;
        settle().await;
        assert_eq!(ran.load(Ordering::SeqCst), 4);
        assert_eq!(p.shutdown().len(), 1);
        assert_eq!(resolve(to_hand_back).await, Err(OperationError::Shutdown));
        resolve(p.drain()).await;
        let m = p.metrics();
        assert!(balanced(&m), "{m:?}");
        assert_eq!(
            (
                m.registered,
                m.completed,
                m.expired,
                m.cancelled,
                m.handed_back
            ),
            (44, 21, 20, 2, 1)
        );
        assert_eq!(m.panicked, 0);
        assert_eq!(timer.metrics().panicked, 1);
        assert!(reads.load(Ordering::SeqCst) > 0);
        let calls = calls.lock().unwrap();
        for needed in [
            "register",
            "operation finished",
            "user code panicked; carrying on",
        ] {
            assert!(
                calls.iter().any(|c| c.kind == "event" && c.name == needed),
                "no {needed:?} event"
            );
        }
        assert!(calls
            .iter()
            .any(|c| c.kind == "enter" && c.name == "reaper turn"));
        *slot.lock().unwrap() = None;
        *tslot.lock().unwrap() = None;
    });
}

/// The `register` event (after admission, before the watch): the hook
/// walks the key being registered, cancels by it, registers another
/// operation on it, and asks for a drain. Every handle resolves, and the
/// counts balance.
#[test]
fn register_event_walks_cancels_and_registers() {
    paused_within(60, || async {
        let slot: Slot<P> = Arc::default();
        let extra: Arc<Mutex<Vec<tokio_purgatory::OperationHandle<u32, Op>>>> = Arc::default();
        let ready = Arc::new(AtomicBool::new(false));
        let mode = Arc::new(AtomicUsize::new(0));
        let (s, x, rd, md) = (slot.clone(), extra.clone(), ready.clone(), mode.clone());
        let (sub, _calls) = subscriber(move |c| {
            if c.kind != "event" || c.name != "register" {
                return;
            }
            let Some(p) = get(&s) else { return };
            match md.load(Ordering::SeqCst) {
                1 => {
                    p.try_complete_watched(&1);
                }
                2 => {
                    for op in p.cancel_for_key(&1) {
                        drop(op);
                    }
                }
                3 => {
                    let h = p
                        .try_complete_else_watch(op(&rd), ms(50), [1, 2])
                        .expect("registered from the hook");
                    x.lock().unwrap().push(h);
                }
                _ => {}
            }
        });
        let _guard = tracing::subscriber::set_default(sub);
        let p: P = Purgatory::builder().name("reg").build().unwrap();
        *slot.lock().unwrap() = Some(p.clone());

        let mut handles = Vec::new();
        for m in [1, 2, 3, 0] {
            mode.store(m, Ordering::SeqCst);
            for _ in 0..5 {
                handles.push(p.try_complete_else_watch(op(&ready), ms(100), [1]).unwrap());
            }
        }
        mode.store(0, Ordering::SeqCst);
        let before_event = p.metrics();
        ready.store(true, Ordering::SeqCst);
        p.try_complete_watched(&1);
        let mut completed = 0;
        let mut cancelled = 0;
        for h in handles {
            match resolve(h).await {
                Ok(Completion::Completed(_)) => completed += 1,
                Err(OperationError::Cancelled) => cancelled += 1,
                other => panic!("{other:?}"),
            }
        }
        // Taken out first: the lock is not held while they resolve.
        let from_the_hook = std::mem::take(&mut *extra.lock().unwrap());
        for h in from_the_hook {
            assert_eq!(resolve(h).await, Ok(Completion::Completed("done")));
        }
        let m = p.metrics();
        assert!(balanced(&m), "{m:?}");
        assert_eq!(m.delayed, 0, "{m:?} (before the event: {before_event:?})");
        assert_eq!(completed + cancelled, 20);
        *slot.lock().unwrap() = None;
    });
}

/// The `register` event calls `shutdown()`: the registration under way is
/// refused with its operation handed back, nothing is left in the lists,
/// and the counts balance.
#[test]
fn register_event_shuts_down() {
    paused_within(60, || async {
        let slot: Slot<P> = Arc::default();
        let handed = Arc::new(AtomicUsize::new(0));
        let (s, hb) = (slot.clone(), handed.clone());
        let (sub, _calls) = subscriber(move |c| {
            if c.kind == "event" && c.name == "register" {
                if let Some(p) = get(&s) {
                    hb.fetch_add(p.shutdown().len(), Ordering::SeqCst);
                }
            }
        });
        let _guard = tracing::subscriber::set_default(sub);
        let p: P = Purgatory::builder().name("reg-shutdown").build().unwrap();
        // One pending before the hook is armed.
        let pending = p.try_complete_else_watch(never(), ms(100), [7]).unwrap();
        *slot.lock().unwrap() = Some(p.clone());
        let refused = p.try_complete_else_watch(never(), ms(100), [1, 2, 7]);
        assert!(
            matches!(refused, Err(WatchError::Shutdown(_))),
            "{:?}",
            refused.as_ref().map(|_| ()).map_err(|e| e.kind())
        );
        assert_eq!(handed.load(Ordering::SeqCst), 1);
        assert_eq!(resolve(pending).await, Err(OperationError::Shutdown));
        settle().await;
        let m = p.metrics();
        assert!(balanced(&m), "{m:?}");
        assert_eq!(m.delayed, 0);
        assert_eq!(p.watched(), 0, "{m:?}");
        *slot.lock().unwrap() = None;
    });
}

/// The `register` event polls a drain once (the call alone starts it): the
/// registration under way was admitted, and the drain waits for it.
#[test]
fn register_event_starts_a_drain() {
    paused_within(60, || async {
        let slot: Slot<P> = Arc::default();
        let s = slot.clone();
        let (sub, _calls) = subscriber(move |c| {
            if c.kind == "event" && c.name == "register" {
                if let Some(p) = get(&s) {
                    let mut d = std::pin::pin!(p.drain());
                    let mut cx = std::task::Context::from_waker(futures::task::noop_waker_ref());
                    let _ = d.as_mut().poll(&mut cx);
                }
            }
        });
        let _guard = tracing::subscriber::set_default(sub);
        let p: P = Purgatory::builder().name("reg-drain").build().unwrap();
        *slot.lock().unwrap() = Some(p.clone());
        let h = p.try_complete_else_watch(never(), ms(100), [1]).unwrap();
        assert!(p.is_draining());
        assert!(matches!(
            p.try_complete_else_watch(never(), ms(100), [1]),
            Err(WatchError::Draining(_))
        ));
        let drained = tokio::time::timeout(ms(50), p.drain()).await;
        assert!(drained.is_err(), "the drain waits for the admitted one");
        assert_eq!(resolve(h).await, Ok(Completion::Expired("expired")));
        resolve(p.drain()).await;
        let m = p.metrics();
        assert!(balanced(&m), "{m:?}");
        *slot.lock().unwrap() = None;
    });
}

/// `operation finished` on the reaper, amid a batch of expiries due in the
/// same tick: the hook shuts the purgatory down. The operations of the
/// batch taken out already expire or are handed back, each exactly once;
/// every handle resolves; the counts balance.
#[test]
fn finished_event_shuts_down_mid_batch() {
    paused_within(60, || async {
        let slot: Slot<P> = Arc::default();
        let handed = Arc::new(AtomicUsize::new(0));
        let (s, hb) = (slot.clone(), handed.clone());
        let (sub, _calls) = subscriber(move |c| {
            if c.kind == "event" && c.name == "operation finished" && c.fields.contains("Expired") {
                if let Some(p) = get(&s) {
                    hb.fetch_add(p.shutdown().len(), Ordering::SeqCst);
                }
            }
        });
        let _guard = tracing::subscriber::set_default(sub);
        let p: P = Purgatory::builder()
            .name("fin-shutdown")
            .timer_shards(1)
            .build()
            .unwrap();
        *slot.lock().unwrap() = Some(p.clone());
        let same: Vec<_> = (0..30u32)
            .map(|i| p.try_complete_else_watch(never(), ms(10), [i]).unwrap())
            .collect();
        let later: Vec<_> = (0..10u32)
            .map(|i| p.try_complete_else_watch(never(), ms(1000), [i]).unwrap())
            .collect();
        advance(ms(11)).await;
        let (mut expired, mut shut) = (0, 0);
        for h in same.into_iter().chain(later) {
            match resolve(h).await {
                Ok(Completion::Expired(_)) => expired += 1,
                Err(OperationError::Shutdown) => shut += 1,
                other => panic!("{other:?}"),
            }
        }
        let m = p.metrics();
        assert!(balanced(&m), "{m:?}");
        assert_eq!(expired + shut, 40);
        assert_eq!(shut, handed.load(Ordering::SeqCst), "{m:?}");
        assert_eq!((m.expired, m.handed_back), (expired as u64, shut as u64));
        assert!(expired >= 1);
        *slot.lock().unwrap() = None;
    });
}

/// `operation finished` during a walk: the hook walks the same key again,
/// cancels by another key, and registers on the walked key. Every handle
/// resolves, the counts balance.
#[test]
fn finished_event_reenters_a_walk() {
    paused_within(60, || async {
        let slot: Slot<P> = Arc::default();
        let extra: Arc<Mutex<Vec<tokio_purgatory::OperationHandle<u32, Op>>>> = Arc::default();
        let ready = Arc::new(AtomicBool::new(false));
        let (s, x, rd) = (slot.clone(), extra.clone(), ready.clone());
        let (sub, _calls) = subscriber(move |c| {
            if c.kind == "event" && c.name == "operation finished" && c.fields.contains("Completed")
            {
                if let Some(p) = get(&s) {
                    p.try_complete_watched(&1);
                    drop(p.cancel_for_key(&2));
                    if let Ok(h) = p.try_complete_else_watch(op(&rd), ms(50), [1]) {
                        x.lock().unwrap().push(h);
                    }
                }
            }
        });
        let _guard = tracing::subscriber::set_default(sub);
        let p: P = Purgatory::builder().name("fin-walk").build().unwrap();
        *slot.lock().unwrap() = Some(p.clone());
        let handles: Vec<_> = (0..10)
            .map(|i| {
                p.try_complete_else_watch(op(&ready), ms(100), [1, 2 + i % 2])
                    .unwrap()
            })
            .collect();
        ready.store(true, Ordering::SeqCst);
        let n = p.try_complete_watched(&1);
        let mut done = 0;
        for h in handles {
            match resolve(h).await {
                Ok(Completion::Completed(_)) | Err(OperationError::Cancelled) => done += 1,
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(done, 10);
        assert!(n >= 1);
        // Those registered from the hook completed at once (ready) or watch 1.
        p.try_complete_watched(&1);
        // Taken out first: the lock is not held while they resolve.
        let from_the_hook = std::mem::take(&mut *extra.lock().unwrap());
        for h in from_the_hook {
            assert_eq!(resolve(h).await, Ok(Completion::Completed("done")));
        }
        let m = p.metrics();
        assert!(balanced(&m), "{m:?}");
        assert_eq!(m.delayed, 0);
        *slot.lock().unwrap() = None;
    });
}

/// The hook holds the last clone and drops it on the reaper, from the
/// `operation finished` event of an expiry. Pending handles resolve with
/// `Shutdown`, the reaper goes on serving its neighbour.
#[test]
fn finished_event_drops_the_last_clone_on_the_reaper() {
    paused_within(60, || async {
        let slot: Slot<P> = Arc::default();
        let s = slot.clone();
        let (sub, _calls) = subscriber(move |c| {
            if c.kind == "event" && c.name == "operation finished" && c.fields.contains("Expired") {
                let taken = s.lock().unwrap().take();
                drop(taken);
            }
        });
        let _guard = tracing::subscriber::set_default(sub);
        let reaper = Reaper::start().unwrap();
        let neighbour = Timer::builder()
            .name("neighbour")
            .reaper(&reaper)
            .build()
            .unwrap();
        let p: P = Purgatory::builder()
            .name("last-clone")
            .reaper(&reaper)
            .build()
            .unwrap();
        let weak = p.downgrade();
        let early: Vec<_> = (0..5u32)
            .map(|i| p.try_complete_else_watch(never(), ms(10), [i]).unwrap())
            .collect();
        let late: Vec<_> = (0..5u32)
            .map(|i| p.try_complete_else_watch(never(), ms(1000), [i]).unwrap())
            .collect();
        *slot.lock().unwrap() = Some(p);
        advance(ms(11)).await;
        let (mut expired, mut shut) = (0, 0);
        for h in early.into_iter().chain(late) {
            match resolve(h).await {
                Ok(Completion::Expired(_)) => expired += 1,
                Err(OperationError::Shutdown) => shut += 1,
                other => panic!("{other:?}"),
            }
        }
        assert!(expired >= 1 && expired + shut == 10, "{expired} {shut}");
        assert!(weak.upgrade().is_none());
        let ran = Arc::new(AtomicBool::new(false));
        let r = ran.clone();
        neighbour
            .schedule(ms(5), move || r.store(true, Ordering::SeqCst))
            .unwrap();
        advance(ms(6)).await;
        settle().await;
        assert!(ran.load(Ordering::SeqCst), "the shared reaper goes on");
        assert!(!reaper.is_stopped());
    });
}

/// The reaper turn's span: entering it shuts the purgatory down, leaving it
/// registers (refused: shut down), recording `expired` schedules on a timer
/// served by the same reaper a task due now. Everything resolves; the task
/// runs without waiting for a later deadline.
#[test]
fn reaper_turn_span_callbacks_reenter() {
    paused_within(60, || async {
        let slot: Slot<P> = Arc::default();
        let tslot: Slot<Timer> = Arc::default();
        let ran = Arc::new(AtomicUsize::new(0));
        let refused = Arc::new(AtomicUsize::new(0));
        let (s, t, r, rf) = (slot.clone(), tslot.clone(), ran.clone(), refused.clone());
        let (sub, _calls) = subscriber(move |c| match (c.kind, c.name.as_str()) {
            ("enter", "reaper turn") => {
                if let Some(p) = get(&s) {
                    if p.delayed() < 5 {
                        drop(p.shutdown());
                    }
                }
            }
            ("exit", "reaper turn") => {
                if let Some(p) = get(&s) {
                    if p.is_shutdown() && p.try_complete_else_watch(never(), ms(5), [9]).is_err() {
                        rf.fetch_add(1, Ordering::SeqCst);
                    }
                }
            }
            ("record", "reaper turn") => {
                if let Some(t) = t.lock().unwrap().take() {
                    let r = r.clone();
                    t.schedule(Duration::ZERO, move || {
                        r.fetch_add(1, Ordering::SeqCst);
                    })
                    .unwrap();
                }
            }
            _ => {}
        });
        let _guard = tracing::subscriber::set_default(sub);
        let reaper = Reaper::start().unwrap();
        let timer = Timer::builder()
            .name("turn-timer")
            .reaper(&reaper)
            .build()
            .unwrap();
        let p: P = Purgatory::builder()
            .name("turn")
            .reaper(&reaper)
            .build()
            .unwrap();
        let hs: Vec<_> = (0..10u32)
            .map(|i| {
                p.try_complete_else_watch(never(), ms(10 + u64::from(i)), [i])
                    .unwrap()
            })
            .collect();
        // A far deadline on the timer: a task scheduled from the span must not
        // wait for it.
        timer.schedule(Duration::from_secs(3600), || {}).unwrap();
        *slot.lock().unwrap() = Some(p.clone());
        *tslot.lock().unwrap() = Some(timer.clone());
        let start = tokio::time::Instant::now();
        for h in hs {
            let out = resolve(h).await;
            assert!(
                matches!(
                    out,
                    Ok(Completion::Expired(_)) | Err(OperationError::Shutdown)
                ),
                "{out:?}"
            );
        }
        let m = p.metrics();
        assert!(balanced(&m), "{m:?}");
        assert!(
            refused.load(Ordering::SeqCst) >= 1,
            "no registration refused on leaving a turn after the shutdown"
        );
        tokio::time::timeout(ms(100), async {
            while ran.load(Ordering::SeqCst) == 0 {
                tokio::time::sleep(ms(1)).await;
            }
        })
        .await
        .expect("the task scheduled from the turn's span ran");
        assert!(start.elapsed() < ms(200));
        *slot.lock().unwrap() = None;
    });
}

/// A subscriber that blocks briefly in every callback, with registrations,
/// walks and cancellations on two threads and the reaper expiring: no
/// deadlock, every handle resolves, the counts balance. Real time.
#[test]
fn a_slow_subscriber_on_every_thread() {
    within(120, || {
        let (sub, calls) = subscriber(|_| std::thread::sleep(Duration::from_micros(200)));
        let dispatch = tracing::Dispatch::new(sub);
        let d = dispatch.clone();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .on_thread_start(move || {
                // The reaper's threads report to the slow subscriber too.
                std::mem::forget(tracing::dispatcher::set_default(&d));
            })
            .build()
            .unwrap();
        let _g = rt.enter();
        let p: P = Purgatory::builder().name("slow").build().unwrap();
        let ready = Arc::new(AtomicBool::new(false));
        let threads: Vec<_> = (0..2)
            .map(|t| {
                let p = p.clone();
                let ready = ready.clone();
                let dispatch = dispatch.clone();
                let handle = rt.handle().clone();
                std::thread::spawn(move || {
                    let _enter = handle.enter();
                    tracing::dispatcher::with_default(&dispatch, || {
                        let mut hs = Vec::new();
                        for i in 0..200u32 {
                            let k = i % 7;
                            match p.try_complete_else_watch(
                                op(&ready),
                                ms(1 + u64::from(i % 20)),
                                [k, 100 + t],
                            ) {
                                Ok(h) => hs.push(h),
                                Err(e) => panic!("{:?}", e.kind()),
                            }
                            if i % 5 == 0 {
                                p.try_complete_watched(&k);
                            }
                            if i % 11 == 0 {
                                drop(p.cancel_for_key(&(100 + t)));
                            }
                            if i % 13 == 0 {
                                drop(hs.pop());
                            }
                        }
                        hs
                    })
                })
            })
            .collect();
        let hs: Vec<_> = threads
            .into_iter()
            .flat_map(|t| t.join().unwrap())
            .collect();
        ready.store(true, Ordering::SeqCst);
        tracing::dispatcher::with_default(&dispatch, || {
            for k in 0..7 {
                p.try_complete_watched(&k);
            }
        });
        rt.block_on(async {
            for h in hs {
                let _ = tokio::time::timeout(Duration::from_secs(30), h)
                    .await
                    .expect("resolves");
            }
        });
        let m = p.metrics();
        assert!(balanced(&m), "{m:?}");
        assert_eq!(m.delayed, 0);
        let calls = calls.lock().unwrap();
        let turns = calls
            .iter()
            .filter(|c| c.kind == "enter" && c.name == "reaper turn")
            .count();
        eprintln!("{} calls, {turns} turns entered, {m:?}", calls.len());
        assert!(turns > 0 && calls.len() > 1000);
    });
}

/// The lost-reaper warning (emitted while the reaper task is dropped with
/// its runtime, for each core in turn): the hook registers (refused), shuts
/// the warned purgatory down (nothing left to hand back), drops the last
/// clone of a neighbour on the same shared reaper not yet told, reads
/// `serving()`, and tries to build on the lost reaper. Every handle still
/// resolves, and nothing panics out of the runtime's drop.
#[test]
fn reaper_lost_warning_reenters() {
    within(60, || {
        let slot: Slot<P> = Arc::default();
        let nslot: Slot<P> = Arc::default();
        let rslot: Slot<Reaper> = Arc::default();
        let refused = Arc::new(AtomicUsize::new(0));
        let built = Arc::new(AtomicUsize::new(0));
        let (s, n, r, rf, b) = (
            slot.clone(),
            nslot.clone(),
            rslot.clone(),
            refused.clone(),
            built.clone(),
        );
        let (sub, calls) = subscriber(move |c| {
            if c.kind != "event" || c.name != LOST {
                return;
            }
            if let Some(p) = get(&s) {
                if p.try_complete_else_watch(never(), ms(5), [1]).is_err() {
                    rf.fetch_add(1, Ordering::SeqCst);
                }
                assert!(p.shutdown().is_empty());
            }
            let last = n.lock().unwrap().take();
            drop(last);
            if let Some(reaper) = get(&r) {
                let _ = reaper.serving();
                if Timer::builder().reaper(&reaper).build().is_ok() {
                    b.fetch_add(1, Ordering::SeqCst);
                }
            }
        });
        let _guard = tracing::subscriber::set_default(sub);
        let rt = support::paused();
        let (p, pending, npending) = rt.block_on(async {
            let reaper = Reaper::start().unwrap();
            let p: P = Purgatory::builder()
                .name("lost")
                .reaper(&reaper)
                .build()
                .unwrap();
            let nb: P = Purgatory::builder()
                .name("lost-nb")
                .reaper(&reaper)
                .build()
                .unwrap();
            let pending = p.try_complete_else_watch(never(), ms(60_000), [1]).unwrap();
            let npending = nb
                .try_complete_else_watch(never(), ms(60_000), [1])
                .unwrap();
            *nslot.lock().unwrap() = Some(nb);
            *rslot.lock().unwrap() = Some(reaper);
            (p, pending, npending)
        });
        *slot.lock().unwrap() = Some(p.clone());
        drop(rt);
        let rt = support::paused();
        rt.block_on(async {
            let a = resolve(pending).await;
            let b = resolve(npending).await;
            assert_eq!(a, Err(OperationError::ReaperGone));
            assert!(
                matches!(
                    b,
                    Err(OperationError::ReaperGone | OperationError::Shutdown)
                ),
                "{b:?}"
            );
        });
        let m = p.metrics();
        assert!(balanced(&m), "{m:?}");
        assert!(refused.load(Ordering::SeqCst) >= 1);
        assert_eq!(built.load(Ordering::SeqCst), 0, "built on a lost reaper");
        assert!(calls
            .lock()
            .unwrap()
            .iter()
            .any(|c| c.kind == "event" && c.name == LOST));
        *slot.lock().unwrap() = None;
        *rslot.lock().unwrap() = None;
    });
}

// ---------------------------------------------------------------- what the docs say

/// Each reaper turn is a span at DEBUG, named "reaper turn", with `kind`
/// and `name`, and the turn's expiries recorded as `expired`.
#[test]
fn the_turn_span_is_debug_and_records_its_expiries() {
    within(30, || {
        let (sub, calls) = filtered(LevelFilter::TRACE);
        let _g = tracing::subscriber::set_default(sub);
        support::paused().block_on(async {
            let p: P = Purgatory::builder().name("spanned").build().unwrap();
            let hs: Vec<_> = (0..3u32)
                .map(|i| p.try_complete_else_watch(never(), ms(10), [i]).unwrap())
                .collect();
            advance(ms(11)).await;
            for h in hs {
                assert_eq!(resolve(h).await, Ok(Completion::Expired("expired")));
            }
        });
        let calls = calls.lock().unwrap();
        let spans: Vec<_> = calls
            .iter()
            .filter(|c| c.kind == "new_span" && c.name == "reaper turn")
            .collect();
        assert!(!spans.is_empty());
        for s in &spans {
            assert_eq!(s.level, Some(tracing::Level::DEBUG));
            assert!(s.fields.contains("kind=\"purgatory\""), "{s:?}");
            assert!(s.fields.contains("name=\"spanned\""), "{s:?}");
        }
        let expired: Vec<_> = calls
            .iter()
            .filter(|c| c.kind == "record" && c.name == "reaper turn")
            .map(|c| c.fields.clone())
            .collect();
        assert!(
            expired.iter().any(|f| f.contains("expired=3")),
            "{expired:?}"
        );
    });
}

/// Every span and event the crate emits carries the same two fields:
/// `kind`, "purgatory" or "timer", and `name`, the one given to the builder.
/// A purgatory and a timer of their own reapers register, expire, purge,
/// run a task that panics, go idle, and lose their reapers with work
/// pending; each of those spans and events is seen, and each names its
/// owner by both fields.
#[test]
fn every_span_and_event_carries_its_kind_and_name() {
    within(30, || {
        let (sub, calls) = filtered(LevelFilter::TRACE);
        let _g = tracing::subscriber::set_default(sub);
        let rt = support::paused();
        let (p, t) = rt.block_on(async {
            let p: P = Purgatory::builder()
                .name("OWNER-P")
                .purge_interval(0)
                .build()
                .unwrap();
            let t = Timer::builder().name("OWNER-T").build().unwrap();
            let hs: Vec<_> = (0..20u32)
                .map(|i| {
                    p.try_complete_else_watch(never(), ms(10), [i, 100])
                        .unwrap()
                })
                .collect();
            t.schedule(ms(5), || panic!("a task")).unwrap();
            advance(ms(11)).await;
            for h in hs {
                let _ = resolve(h).await;
            }
            settle().await;
            let pending = p.try_complete_else_watch(never(), ms(60_000), [1]).unwrap();
            pending.detach();
            t.schedule(ms(60_000), || {}).unwrap();
            (p, t)
        });
        drop(rt); // the reapers are lost: each warns
        drop((p, t));
        // A chosen hasher whose `Drop` panics, dropped with its purgatory:
        // the report names that purgatory too.
        let rt = support::paused();
        rt.block_on(async {
            let with_hasher: Purgatory<u32, Op, DropPanics> = Purgatory::builder()
                .name("OWNER-P")
                .hasher(DropPanics)
                .build()
                .unwrap();
            drop(with_hasher);
            settle().await;
        });
        drop(rt);
        let calls = calls.lock().unwrap();
        let mut seen = std::collections::BTreeSet::new();
        for c in calls.iter().filter(|c| {
            (c.kind == "event" || c.kind == "new_span") && c.target.starts_with("tokio_purgatory")
        }) {
            let owner = (c.field("kind"), c.field("name"));
            assert!(
                matches!(
                    owner,
                    (Some("purgatory"), Some("OWNER-P")) | (Some("timer"), Some("OWNER-T"))
                ),
                "{:?} {:?} does not name its owner by `kind` and `name`: {}",
                c.kind,
                c.name,
                c.fields
            );
            seen.insert((c.name.as_str(), owner.0.unwrap_or_default()));
        }
        for needed in [
            ("register", "purgatory"),
            ("operation finished", "purgatory"),
            ("purged a slice of finished operations", "purgatory"),
            ("user code panicked; carrying on", "timer"),
            ("user code panicked; carrying on", "purgatory"),
            ("reaper turn", "purgatory"),
            ("reaper turn", "timer"),
            ("core idle until its target", "purgatory"),
            ("core idle until its target", "timer"),
            (LOST, "purgatory"),
            (LOST, "timer"),
        ] {
            assert!(seen.contains(&needed), "no {needed:?} in {seen:?}");
        }
    });
}

/// A `BuildHasher` (std's own hashing) whose `Drop` panics.
struct DropPanics;

impl std::hash::BuildHasher for DropPanics {
    type Hasher = std::collections::hash_map::DefaultHasher;
    fn build_hasher(&self) -> Self::Hasher {
        std::collections::hash_map::DefaultHasher::new()
    }
}

impl Drop for DropPanics {
    fn drop(&mut self) {
        panic!("a hasher's drop");
    }
}

/// With the turn's DEBUG span filtered out (an INFO filter, the usual
/// production setting), the reaper's `expired` count is recorded nowhere:
/// not into whatever span is current on the reaper's thread, here the
/// application's own span around `block_on` on a current-thread runtime,
/// which has an `expired` field of its own.
#[test]
fn a_disabled_turn_span_records_nothing_into_the_applications_span() {
    within(30, || {
        let (sub, calls) = filtered(LevelFilter::INFO);
        let _g = tracing::subscriber::set_default(sub);
        let rt = support::paused();
        let request = tracing::info_span!("request", expired = tracing::field::Empty);
        let in_request = request.enter();
        rt.block_on(async {
            let p: P = Purgatory::builder().name("quiet").build().unwrap();
            let hs: Vec<_> = (0..3u32)
                .map(|i| p.try_complete_else_watch(never(), ms(10), [i]).unwrap())
                .collect();
            advance(ms(11)).await;
            for h in hs {
                let _ = resolve(h).await;
            }
        });
        drop(in_request);
        let into_request: Vec<_> = calls
            .lock()
            .unwrap()
            .iter()
            .filter(|c| c.kind == "record" && c.name == "request")
            .map(|c| c.fields.clone())
            .collect();
        assert!(
            into_request.is_empty(),
            "the crate recorded into the application's span: {into_request:?}"
        );
    });
}
