//! Refusals, used hostilely. Every registration form of the purgatory (plain,
//! at an instant, at levels, at levels and an instant) and every scheduling
//! form of the timer (tasks, repeating tasks, async tasks, sleeps, timeouts),
//! turned away for every reason it can be (no keys, at the pending limit,
//! draining, shut down, reaper lost), hands back what it was given intact:
//! the operation unchecked, never cloned or dropped by the crate, the task or
//! future still runnable; the error names its reason (kind, `Display` and
//! `Debug`) and every key given is dropped exactly once. Which reason wins
//! when several hold, and a timer shut down from inside one of its repeating
//! tasks refusing with `Shutdown` though that task still holds its room.
//! The pending limit under threads racing registrations (exactly the limit
//! accepted, every other operation handed back) and racing a shutdown. How
//! drains end: when the reaper is lost, when a shutdown races them, when
//! another drain is dropped midway, and when an operation's own check starts
//! one. Hostile code during refusals: first and later checks that shut the
//! purgatory down or panic, keys whose `Drop` panics or calls back in,
//! operations whose `Drop` panics. Paused Tokio time, except the races on real
//! threads, each bounded.

mod support;

use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::time::Instant;
use tokio_purgatory::timer::{TimeoutError, TimerError};
use tokio_purgatory::{
    Completion, Operation, OperationError, Purgatory, RefusedMetrics, Timer, Watch, WatchError,
    WatchErrorKind, WeakPurgatory,
};
use tokio_test::{assert_pending, assert_ready, task};

use support::{balanced, ms, paused_within, settle, within};

#[derive(Default)]
struct Counts {
    checks: AtomicUsize,
    drops: AtomicUsize,
    clones: AtomicUsize,
}

type Hook = Arc<dyn Fn(&mut Op) -> Option<u32> + Send + Sync>;

struct Op {
    id: u32,
    c: Arc<Counts>,
    complete: bool,
    hook: Option<Hook>,
    drop_panics: bool,
}

impl Op {
    fn new(id: u32, c: &Arc<Counts>) -> Op {
        Op {
            id,
            c: c.clone(),
            complete: false,
            hook: None,
            drop_panics: false,
        }
    }
}

impl Clone for Op {
    fn clone(&self) -> Self {
        self.c.clones.fetch_add(1, Ordering::SeqCst);
        Op {
            id: self.id,
            c: self.c.clone(),
            complete: self.complete,
            hook: self.hook.clone(),
            drop_panics: self.drop_panics,
        }
    }
}

impl Drop for Op {
    fn drop(&mut self) {
        self.c.drops.fetch_add(1, Ordering::SeqCst);
        if self.drop_panics && !std::thread::panicking() {
            panic!("op drop panics");
        }
    }
}

impl Operation for Op {
    type Output = u32;
    fn try_complete(&mut self) -> Option<u32> {
        self.c.checks.fetch_add(1, Ordering::SeqCst);
        if let Some(h) = self.hook.clone() {
            return h(self);
        }
        self.complete.then_some(self.id)
    }
    fn on_expiration(self) -> u32 {
        1000 + self.id
    }
}

/// A key counting its drops net of its clones (so each key the test made
/// reads as one drop once every copy is gone), equal and hashed by value; its
/// `Drop` may panic or call back in.
struct Key {
    v: u32,
    drops: Arc<AtomicUsize>,
    drop_panics: bool,
    on_drop: Option<Arc<dyn Fn() + Send + Sync>>,
}
impl Key {
    fn new(v: u32, drops: &Arc<AtomicUsize>) -> Key {
        Key {
            v,
            drops: drops.clone(),
            drop_panics: false,
            on_drop: None,
        }
    }
}
impl Clone for Key {
    fn clone(&self) -> Self {
        self.drops.fetch_sub(1, Ordering::SeqCst);
        Key {
            v: self.v,
            drops: self.drops.clone(),
            drop_panics: self.drop_panics,
            on_drop: self.on_drop.clone(),
        }
    }
}
impl PartialEq for Key {
    fn eq(&self, o: &Key) -> bool {
        self.v == o.v
    }
}
impl Eq for Key {}
impl Hash for Key {
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.v.hash(h)
    }
}
impl Drop for Key {
    fn drop(&mut self) {
        self.drops.fetch_add(1, Ordering::SeqCst);
        if let Some(f) = self.on_drop.take() {
            f();
        }
        if self.drop_panics && !std::thread::panicking() {
            panic!("key drop panics");
        }
    }
}

type P = Purgatory<Key, Op>;

#[derive(Clone, Copy, Debug)]
enum Form {
    Plain,
    At,
    Levels,
    LevelsAt,
}
const FORMS: [Form; 4] = [Form::Plain, Form::At, Form::Levels, Form::LevelsAt];

fn reg(
    p: &P,
    form: Form,
    op: Op,
    keys: Vec<Key>,
) -> Result<tokio_purgatory::OperationHandle<Key, Op>, WatchError<Op>> {
    let t = ms(1000);
    match form {
        Form::Plain => p.try_complete_else_watch(op, t, keys),
        Form::At => p.try_complete_else_watch_at(op, Instant::now() + t, keys),
        Form::Levels => p.try_complete_else_watch_levels(
            op,
            t,
            keys.into_iter()
                .enumerate()
                .map(|(i, k)| {
                    if i % 2 == 0 {
                        Watch::level(k, 5)
                    } else {
                        Watch::key(k)
                    }
                })
                .collect::<Vec<_>>(),
        ),
        Form::LevelsAt => p.try_complete_else_watch_levels_at(
            op,
            Instant::now() + t,
            keys.into_iter()
                .map(|k| Watch::level(k, 7))
                .collect::<Vec<_>>(),
        ),
    }
}

/// The count of refusals for `kind` in `r`.
fn refused_for(r: &RefusedMetrics, kind: WatchErrorKind) -> u64 {
    match kind {
        WatchErrorKind::NoKeys => r.no_keys,
        WatchErrorKind::AtCapacity => r.at_capacity,
        WatchErrorKind::Shutdown => r.shutdown,
        WatchErrorKind::ReaperGone => r.reaper_gone,
        WatchErrorKind::Draining => r.draining,
        _ => unreachable!(),
    }
}

/// `reg` refused: the refusal counted once, under its reason only, and not
/// as a registration.
fn refuse(p: &P, form: Form, op: Op, keys: Vec<Key>) -> WatchError<Op> {
    let before = p.metrics();
    let e = reg(p, form, op, keys).unwrap_err();
    let after = p.metrics();
    for kind in [
        WatchErrorKind::NoKeys,
        WatchErrorKind::AtCapacity,
        WatchErrorKind::Shutdown,
        WatchErrorKind::ReaperGone,
        WatchErrorKind::Draining,
    ] {
        let grew = refused_for(&after.refused, kind) - refused_for(&before.refused, kind);
        assert_eq!(
            grew,
            u64::from(kind == e.kind()),
            "{form:?} {kind:?}: {:?} -> {:?}",
            before.refused,
            after.refused
        );
    }
    assert_eq!(after.refused.total(), before.refused.total() + 1);
    assert_eq!(after.registered, before.registered, "{form:?}");
    e
}

fn display(k: WatchErrorKind) -> &'static str {
    match k {
        WatchErrorKind::NoKeys => "operation has no watch keys",
        WatchErrorKind::AtCapacity => "purgatory is at its limit of pending operations",
        WatchErrorKind::Shutdown => "purgatory is shut down",
        WatchErrorKind::ReaperGone => "purgatory's reaper task is gone",
        WatchErrorKind::Draining => "purgatory is draining and takes no new operations",
        _ => unreachable!(),
    }
}

/// Checks one refusal: its kind, `Display` and `Debug` name the reason; the
/// operation comes back intact and unchecked, never cloned nor dropped by the
/// crate; each of the `keys_made` keys given was dropped exactly once.
fn check_refusal(
    form: Form,
    e: WatchError<Op>,
    want: WatchErrorKind,
    id: u32,
    c: &Arc<Counts>,
    key_drops: &Arc<AtomicUsize>,
    keys_made: usize,
) {
    assert_eq!(e.kind(), want, "{form:?}");
    assert_eq!(e.to_string(), display(want), "{form:?}");
    assert!(
        format!("{e:?}").starts_with(&format!("{want:?}")),
        "{form:?} {e:?}"
    );
    assert_eq!(
        c.drops.load(Ordering::SeqCst),
        0,
        "{form:?} {want:?}: op dropped by the crate"
    );
    assert_eq!(
        c.clones.load(Ordering::SeqCst),
        0,
        "{form:?} {want:?}: op cloned"
    );
    assert_eq!(
        c.checks.load(Ordering::SeqCst),
        0,
        "{form:?} {want:?}: a refused op was checked"
    );
    assert_eq!(
        key_drops.load(Ordering::SeqCst),
        keys_made,
        "{form:?} {want:?}: every key dropped once"
    );
    let op = e.into_inner();
    assert_eq!(op.id, id);
    drop(op);
    assert_eq!(c.drops.load(Ordering::SeqCst), 1);
}

/// Every registration form refused for every reason a paused runtime can
/// give (no keys, at the limit, draining, shut down), and which reason wins
/// when several hold: at the limit over draining, shut down over draining, no
/// keys over all.
#[tokio::test(start_paused = true)]
async fn every_form_refused_for_each_reason_hands_back_intact() {
    for form in FORMS {
        // NoKeys
        let p: P = Purgatory::builder().max_pending(1).build().unwrap();
        let c = Arc::new(Counts::default());
        let kd = Arc::new(AtomicUsize::new(0));
        let e = refuse(&p, form, Op::new(1, &c), vec![]);
        check_refusal(form, e, WatchErrorKind::NoKeys, 1, &c, &kd, 0);

        // AtCapacity (an op whose check would complete it: still refused unchecked)
        let kd0 = Arc::new(AtomicUsize::new(0));
        let c0 = Arc::new(Counts::default());
        let h = reg(&p, form, Op::new(0, &c0), vec![Key::new(9, &kd0)]).unwrap();
        let c = Arc::new(Counts::default());
        let kd = Arc::new(AtomicUsize::new(0));
        let mut op = Op::new(2, &c);
        op.complete = true;
        let keys = vec![Key::new(1, &kd), Key::new(2, &kd), Key::new(1, &kd)];
        let e = refuse(&p, form, op, keys);
        check_refusal(form, e, WatchErrorKind::AtCapacity, 2, &c, &kd, 3);
        let m = p.metrics();
        assert_eq!(m.registered, 1, "{form:?} {m:?}");

        // Draining, with a pending op holding the limit: AtCapacity wins.
        let mut d = task::spawn(p.drain());
        assert_pending!(d.poll());
        let c = Arc::new(Counts::default());
        let kd = Arc::new(AtomicUsize::new(0));
        let e = refuse(&p, form, Op::new(3, &c), vec![Key::new(3, &kd)]);
        check_refusal(form, e, WatchErrorKind::AtCapacity, 3, &c, &kd, 1);
        drop(h); // cancel: room back, drain ends
        assert!(d.is_woken());
        assert_ready!(d.poll());
        drop(d);
        let c = Arc::new(Counts::default());
        let kd = Arc::new(AtomicUsize::new(0));
        let e = refuse(
            &p,
            form,
            Op::new(4, &c),
            vec![Key::new(3, &kd), Key::new(4, &kd)],
        );
        check_refusal(form, e, WatchErrorKind::Draining, 4, &c, &kd, 2);

        // Shutdown (while draining: Shutdown wins)
        drop(p.shutdown());
        let c = Arc::new(Counts::default());
        let kd = Arc::new(AtomicUsize::new(0));
        let e = refuse(&p, form, Op::new(5, &c), vec![Key::new(5, &kd)]);
        check_refusal(form, e, WatchErrorKind::Shutdown, 5, &c, &kd, 1);
        // NoKeys still wins over Shutdown
        let c = Arc::new(Counts::default());
        let e = refuse(&p, form, Op::new(6, &c), vec![]);
        check_refusal(form, e, WatchErrorKind::NoKeys, 6, &c, &kd, 1);

        let m = p.metrics();
        assert_eq!(
            (m.registered, m.cancelled, m.handed_back, m.panicked),
            (1, 1, 0, 0),
            "{form:?} {m:?}"
        );
        let r = m.refused;
        assert_eq!(
            (
                r.no_keys,
                r.at_capacity,
                r.draining,
                r.shutdown,
                r.reaper_gone
            ),
            (2, 2, 1, 1, 0),
            "{form:?} {r:?}"
        );
        assert!(balanced(&m));
        assert_eq!(m.watched, 0, "{m:?}");
        drop(p);
        assert_eq!(
            kd0.load(Ordering::SeqCst),
            1,
            "the accepted op's key dropped once"
        );
        assert_eq!(c0.drops.load(Ordering::SeqCst), 1);
    }
}

/// Every form refused once the reaper's runtime is gone, with the limit held
/// when it went; a drain then ends at once.
#[test]
fn every_form_refused_with_the_reaper_gone_hands_back_intact() {
    for form in FORMS {
        let rt = support::paused();
        let p: P = rt.block_on(async { Purgatory::builder().max_pending(1).build().unwrap() });
        let c0 = Arc::new(Counts::default());
        let kd0 = Arc::new(AtomicUsize::new(0));
        // The limit is held by a pending op when the reaper dies.
        let h = {
            let _g = rt.enter();
            reg(&p, form, Op::new(0, &c0), vec![Key::new(0, &kd0)]).unwrap()
        };
        drop(rt);
        assert!(p.is_shutdown());
        let rt2 = support::paused();
        rt2.block_on(async {
            assert_eq!(h.await, Err(OperationError::ReaperGone));
            let c = Arc::new(Counts::default());
            let kd = Arc::new(AtomicUsize::new(0));
            let e = refuse(&p, form, Op::new(1, &c), vec![Key::new(1, &kd)]);
            check_refusal(form, e, WatchErrorKind::ReaperGone, 1, &c, &kd, 1);
            // drain after the reaper is gone returns (nothing pending).
            tokio::time::timeout(ms(10), p.drain())
                .await
                .expect("drain returns");
            let c = Arc::new(Counts::default());
            let kd = Arc::new(AtomicUsize::new(0));
            let e = refuse(&p, form, Op::new(2, &c), vec![Key::new(1, &kd)]);
            check_refusal(form, e, WatchErrorKind::ReaperGone, 2, &c, &kd, 1);
            let m = p.metrics();
            assert!(balanced(&m), "{m:?}");
            assert_eq!(m.delayed, 0);
        });
        assert_eq!(c0.drops.load(Ordering::SeqCst), 1);
    }
}

/// A drain waiting when the reaper's runtime is dropped: the pending
/// operations resolve ReaperGone, and the drain must end.
#[test]
fn a_drain_waiting_ends_when_the_reaper_is_lost() {
    let rt = support::paused();
    let p: P = rt.block_on(async { Purgatory::builder().build().unwrap() });
    let c = Arc::new(Counts::default());
    let kd = Arc::new(AtomicUsize::new(0));
    let h = {
        let _g = rt.enter();
        p.try_complete_else_watch(Op::new(1, &c), ms(100_000), [Key::new(1, &kd)])
            .unwrap()
    };
    let mut d = task::spawn(p.drain());
    assert_pending!(d.poll());
    drop(rt);
    assert!(d.is_woken(), "drain woken by the reaper's loss");
    assert_ready!(d.poll());
    let rt2 = support::paused();
    assert_eq!(rt2.block_on(h), Err(OperationError::ReaperGone));
    assert_eq!(c.drops.load(Ordering::SeqCst), 1);
}

/// A first check that shuts the purgatory down (and then panics, or not): the
/// registration is refused with `Shutdown`, the op handed back intact, each
/// key dropped once, every panic counted.
#[tokio::test(start_paused = true)]
async fn a_first_check_that_shuts_down_is_refused_with_shutdown() {
    for form in FORMS {
        for panics in [false, true] {
            let p: P = Purgatory::builder().max_pending(2).build().unwrap();
            let weak: WeakPurgatory<Key, Op> = p.downgrade();
            let c = Arc::new(Counts::default());
            let kd = Arc::new(AtomicUsize::new(0));
            let mut op = Op::new(7, &c);
            op.hook = Some(Arc::new(move |_op: &mut Op| {
                if let Some(p) = weak.upgrade() {
                    assert!(p.shutdown().is_empty());
                }
                if panics {
                    panic!("first check panics");
                }
                None
            }));
            let e = reg(&p, form, op, vec![Key::new(1, &kd), Key::new(2, &kd)]).unwrap_err();
            assert_eq!(e.kind(), WatchErrorKind::Shutdown, "{form:?}");
            // Taken, then handed back by the shutdown: not a refusal.
            let m = p.metrics();
            assert_eq!((m.registered, m.handed_back), (1, 1), "{m:?}");
            assert_eq!(m.refused.total(), 0, "{m:?}");
            assert_eq!(c.drops.load(Ordering::SeqCst), 0, "{form:?}");
            assert_eq!(c.clones.load(Ordering::SeqCst), 0);
            let checks = c.checks.load(Ordering::SeqCst);
            let op = e.into_inner();
            assert_eq!(op.id, 7);
            drop(op);
            assert_eq!(
                kd.load(Ordering::SeqCst),
                2,
                "{form:?} keys dropped once each"
            );
            let m = p.metrics();
            assert!(balanced(&m), "{form:?} {m:?}");
            assert_eq!(m.delayed, 0);
            assert_eq!(m.watched, 0, "{form:?} {m:?}");
            assert_eq!(
                m.panicked,
                if panics { checks as u64 } else { 0 },
                "{form:?} {m:?}"
            );
        }
    }
}

/// The check after the watch is in place shuts the purgatory down: the
/// registration is refused with `Shutdown` and counted as handed back.
#[tokio::test(start_paused = true)]
async fn a_second_check_that_shuts_down_is_refused_with_shutdown() {
    for form in FORMS {
        let p: P = Purgatory::builder().build().unwrap();
        let weak = p.downgrade();
        let c = Arc::new(Counts::default());
        let kd = Arc::new(AtomicUsize::new(0));
        let mut op = Op::new(8, &c);
        op.hook = Some(Arc::new(move |op: &mut Op| {
            if op.c.checks.load(Ordering::SeqCst) == 2 {
                if let Some(p) = weak.upgrade() {
                    assert!(p.shutdown().is_empty());
                }
            }
            None
        }));
        let e = reg(&p, form, op, vec![Key::new(1, &kd)]).unwrap_err();
        assert_eq!(e.kind(), WatchErrorKind::Shutdown, "{form:?}");
        assert_eq!(c.drops.load(Ordering::SeqCst), 0);
        drop(e);
        let m = p.metrics();
        assert!(balanced(&m), "{m:?}");
        assert_eq!((m.registered, m.handed_back), (1, 1), "{m:?}");
        assert_eq!(m.refused.total(), 0, "not a refusal: {m:?}");
        assert_eq!(m.watched, 0, "{m:?}");
    }
}

/// A first check that starts a drain (dropping its future): the registration
/// was admitted before, so it goes on and the drain waits for it.
#[tokio::test(start_paused = true)]
async fn a_drain_started_by_a_first_check_waits_for_that_operation() {
    let p: P = Purgatory::builder().build().unwrap();
    let weak = p.downgrade();
    let c = Arc::new(Counts::default());
    let kd = Arc::new(AtomicUsize::new(0));
    let mut op = Op::new(8, &c);
    op.hook = Some(Arc::new(move |_op: &mut Op| {
        if let Some(p) = weak.upgrade() {
            drop(p.drain());
        }
        None
    }));
    let h = p
        .try_complete_else_watch(op, ms(50), [Key::new(1, &kd)])
        .unwrap();
    assert!(p.is_draining());
    let mut d = task::spawn(p.drain());
    assert_pending!(d.poll());
    assert_eq!(h.await, Ok(Completion::Expired(1008)));
    assert!(d.is_woken());
    assert_ready!(d.poll());
}

/// Keys whose `Drop` panics, dropped by a refusal at the limit, while
/// draining and after shutdown: each panic contained and counted, and the op
/// still comes back.
#[tokio::test(start_paused = true)]
async fn keys_whose_drop_panics_during_refusals_are_contained() {
    for form in FORMS {
        let p: P = Purgatory::builder().max_pending(1).build().unwrap();
        let kd = Arc::new(AtomicUsize::new(0));
        let c0 = Arc::new(Counts::default());
        let _h = reg(&p, form, Op::new(0, &c0), vec![Key::new(100, &kd)]).unwrap();
        let bad = |v| {
            let mut k = Key::new(v, &kd);
            k.drop_panics = true;
            k
        };
        let mut expected_panics = 0;
        for want in [
            WatchErrorKind::AtCapacity,
            WatchErrorKind::Draining,
            WatchErrorKind::Shutdown,
        ] {
            match want {
                WatchErrorKind::Draining => {
                    // Room back, so the drain is what refuses.
                    let back = p.cancel_for_key(&Key::new(100, &Arc::new(AtomicUsize::new(0))));
                    assert_eq!(back.len(), 1);
                    drop(p.drain());
                }
                WatchErrorKind::Shutdown => drop(p.shutdown()),
                _ => {}
            }
            let c = Arc::new(Counts::default());
            let before = kd.load(Ordering::SeqCst);
            // a duplicate key too
            let e = refuse(&p, form, Op::new(1, &c), vec![bad(1), bad(2), bad(1)]);
            expected_panics += 3;
            assert_eq!(e.kind(), want, "{form:?}");
            assert_eq!(kd.load(Ordering::SeqCst) - before, 3);
            assert_eq!(c.drops.load(Ordering::SeqCst), 0);
            assert_eq!(e.into_inner().id, 1);
            let m = p.metrics();
            assert_eq!(m.panicked, expected_panics, "{form:?} {want:?} {m:?}");
        }
    }
}

/// A key whose `Drop` calls back in (registers, reads the counts, cancels by
/// key, starts a drain, walks a key) during a refusal: no lock is held, so no
/// deadlock, and the nested registration is refused too.
#[test]
fn a_key_dropped_by_a_refusal_may_call_back_in() {
    paused_within(10, || async {
        let p: P = Purgatory::builder().max_pending(1).build().unwrap();
        let kd = Arc::new(AtomicUsize::new(0));
        let c = Arc::new(Counts::default());
        let _h = p
            .try_complete_else_watch(Op::new(0, &c), ms(100), [Key::new(0, &kd)])
            .unwrap();
        let weak = p.downgrade();
        let inner_kinds = Arc::new(Mutex::new(Vec::new()));
        let ik = inner_kinds.clone();
        let kd2 = kd.clone();
        let c2 = c.clone();
        let mut k = Key::new(5, &kd);
        k.on_drop = Some(Arc::new(move || {
            if let Some(p) = weak.upgrade() {
                let e = p
                    .try_complete_else_watch(Op::new(9, &c2), ms(1), [Key::new(6, &kd2)])
                    .unwrap_err();
                ik.lock().unwrap().push(e.kind());
                let _ = p.metrics();
                let _ = p.cancel_for_key(&Key::new(77, &kd2));
                drop(p.drain());
                let _ = p.try_complete_watched(&Key::new(0, &kd2));
            }
        }));
        let e = p
            .try_complete_else_watch(Op::new(1, &c), ms(100), [k])
            .unwrap_err();
        assert_eq!(e.kind(), WatchErrorKind::AtCapacity);
        assert_eq!(
            *inner_kinds.lock().unwrap(),
            vec![WatchErrorKind::AtCapacity]
        );
    });
}

/// An op whose `Drop` panics is handed back, not dropped by the crate.
#[tokio::test(start_paused = true)]
async fn op_whose_drop_panics_is_handed_back_not_dropped() {
    let p: P = Purgatory::builder().build().unwrap();
    let c = Arc::new(Counts::default());
    let mut op = Op::new(1, &c);
    op.drop_panics = true;
    let e = p
        .try_complete_else_watch(op, ms(1), Vec::<Key>::new())
        .unwrap_err();
    assert_eq!(e.kind(), WatchErrorKind::NoKeys);
    assert_eq!(c.drops.load(Ordering::SeqCst), 0);
    assert_eq!(p.metrics().panicked, 0);
    let mut op = e.into_inner();
    op.drop_panics = false;
}

/// Four threads racing 200 registrations at a limit of 37, round after round
/// (real threads, bounded): exactly 37 accepted, every other refused with
/// `AtCapacity` and its own op, which only the test drops.
#[test]
fn threads_racing_at_the_limit_get_exactly_the_limit() {
    within(10, racing_at_the_limit);
}

fn racing_at_the_limit() {
    let rt = support::multi();
    let _g = rt.enter();
    let p: P = Purgatory::builder().max_pending(37).build().unwrap();
    for round in 0..5 {
        let c = Arc::new(Counts::default());
        let kd = Arc::new(AtomicUsize::new(0));
        let barrier = Arc::new(std::sync::Barrier::new(4));
        let mut joins = Vec::new();
        for t in 0..4u32 {
            let (p, c, kd, b) = (p.clone(), c.clone(), kd.clone(), barrier.clone());
            joins.push(std::thread::spawn(move || {
                b.wait();
                let mut ok = Vec::new();
                let mut back = 0;
                for i in 0..50u32 {
                    match p.try_complete_else_watch(
                        Op::new(t * 100 + i, &c),
                        ms(100_000),
                        [Key::new(i % 3, &kd)],
                    ) {
                        Ok(h) => ok.push(h),
                        Err(WatchError::AtCapacity(op)) => {
                            assert_eq!(op.id, t * 100 + i);
                            back += 1;
                        }
                        Err(e) => panic!("{e}"),
                    }
                }
                (ok, back)
            }));
        }
        let mut ok = Vec::new();
        let mut back = 0;
        for j in joins {
            let (o, b) = j.join().unwrap();
            ok.extend(o);
            back += b;
        }
        assert_eq!(ok.len(), 37, "round {round}");
        assert_eq!(back, 200 - 37);
        assert_eq!(
            c.drops.load(Ordering::SeqCst),
            163,
            "refused ops dropped by the test only"
        );
        drop(ok); // cancels: room back
        assert_eq!(p.delayed(), 0);
    }
    let m = p.metrics();
    assert_eq!(m.registered, 37 * 5);
    assert_eq!(m.refused.at_capacity, 163 * 5, "each refusal counted once");
    assert_eq!(m.refused.total(), 163 * 5);
    assert!(balanced(&m));
    drop(p.shutdown());
}

/// A shutdown racing two threads' registrations under a limit (real threads,
/// bounded): every op is either refused with it or accepted and then handed
/// back by the shutdown, each dropped once, the counts balanced.
#[test]
fn a_shutdown_racing_registrations_at_the_limit_loses_nothing() {
    within(10, shutdown_racing_registrations);
}

fn shutdown_racing_registrations() {
    let rt = support::multi();
    let _g = rt.enter();
    for _round in 0..20 {
        let p: P = Purgatory::builder().max_pending(8).build().unwrap();
        let c = Arc::new(Counts::default());
        let kd = Arc::new(AtomicUsize::new(0));
        let barrier = Arc::new(std::sync::Barrier::new(3));
        let mut joins = Vec::new();
        for t in 0..2u32 {
            let (p, c, kd, b) = (p.clone(), c.clone(), kd.clone(), barrier.clone());
            joins.push(std::thread::spawn(move || {
                b.wait();
                let mut ok = Vec::new();
                let mut refused = Vec::new();
                for i in 0..40u32 {
                    match p.try_complete_else_watch(
                        Op::new(t * 100 + i, &c),
                        ms(100_000),
                        [Key::new(i % 3, &kd)],
                    ) {
                        Ok(h) => ok.push(h),
                        Err(e) => refused.push(e.into_inner().id),
                    }
                }
                (ok, refused)
            }));
        }
        barrier.wait();
        let back = p.shutdown();
        let mut handles = Vec::new();
        let mut refused = 0;
        for j in joins {
            let (o, r) = j.join().unwrap();
            handles.extend(o);
            refused += r.len();
        }
        let n_back = back.len();
        drop(back);
        // Every accepted op is handed back by the shutdown (none checked elsewhere).
        assert_eq!(n_back, handles.len());
        assert!(n_back <= 8);
        assert_eq!(refused + handles.len(), 80);
        drop(handles);
        assert_eq!(c.drops.load(Ordering::SeqCst), 80);
        let m = p.metrics();
        assert!(balanced(&m), "{m:?}");
        // Each attempt is either refused (counted once, at the limit or shut
        // down) or taken (a registration the shutdown raced is taken, then
        // handed back).
        let r = m.refused;
        assert_eq!(m.registered + r.total(), 80, "{m:?}");
        assert_eq!(r.at_capacity + r.shutdown, r.total(), "{r:?}");
        assert!(m.registered >= n_back as u64, "{m:?}");
    }
}

// ------------------------------------------------------------------ timer

#[derive(Default)]
struct TCounts {
    drops: AtomicUsize,
    runs: AtomicUsize,
}
/// Held by a task or future: counts its drop.
struct Probe(Arc<TCounts>);
impl Drop for Probe {
    fn drop(&mut self) {
        self.0.drops.fetch_add(1, Ordering::SeqCst);
    }
}

fn tdisplay(k: TimerError) -> &'static str {
    match k {
        TimerError::AtCapacity => "timer is at its limit of pending entries",
        TimerError::Shutdown => "timer is shut down",
        TimerError::ReaperGone => "timer's reaper task is gone",
        _ => unreachable!(),
    }
}

/// Every scheduling form refused with `want`: each task or future handed back
/// undropped and still runnable, sleeps and timeouts failing with it, a
/// refused timeout's future handed back unpolled, a ready one still winning.
fn every_schedule_form(timer: &Timer, want: TimerError) {
    let before = timer.metrics().refused;
    every_schedule_form_refused(timer, want);
    // Four schedules, two sleeps and three timeouts: each refusal counted
    // once, under its reason only.
    let after = timer.metrics().refused;
    let grew = |f: fn(&RefusedMetrics) -> u64| f(&after) - f(&before);
    let n = |w| if w == want { 9 } else { 0 };
    assert_eq!(
        grew(|r| r.at_capacity),
        n(TimerError::AtCapacity),
        "{after:?}"
    );
    assert_eq!(grew(|r| r.shutdown), n(TimerError::Shutdown), "{after:?}");
    assert_eq!(
        grew(|r| r.reaper_gone),
        n(TimerError::ReaperGone),
        "{after:?}"
    );
    assert_eq!((after.draining, after.no_keys), (0, 0), "never for a timer");
    assert_eq!(after.total() - before.total(), 9);
}

fn every_schedule_form_refused(timer: &Timer, want: TimerError) {
    let c = Arc::new(TCounts::default());
    // schedule
    let p = Probe(c.clone());
    let cc = c.clone();
    let e = timer
        .schedule(ms(1), move || {
            let _p = &p;
            cc.runs.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap_err();
    assert_eq!(e.kind(), want);
    assert_eq!(e.to_string(), tdisplay(want));
    assert_eq!(c.drops.load(Ordering::SeqCst), 0);
    (e.into_inner())();
    assert_eq!(
        (
            c.runs.load(Ordering::SeqCst),
            c.drops.load(Ordering::SeqCst)
        ),
        (1, 1)
    );
    // schedule_at
    let p = Probe(c.clone());
    let cc = c.clone();
    let e = timer
        .schedule_at(Instant::now() + ms(1), move || {
            let _p = &p;
            cc.runs.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap_err();
    assert_eq!(e.kind(), want);
    assert_eq!(c.drops.load(Ordering::SeqCst), 1);
    (e.into_inner())();
    assert_eq!(
        (
            c.runs.load(Ordering::SeqCst),
            c.drops.load(Ordering::SeqCst)
        ),
        (2, 2)
    );
    // schedule_repeating
    let p = Probe(c.clone());
    let cc = c.clone();
    let e = timer
        .schedule_repeating(ms(1), move || {
            let _p = &p;
            cc.runs.fetch_add(1, Ordering::SeqCst);
            Some(ms(1))
        })
        .unwrap_err();
    assert_eq!(e.kind(), want);
    assert_eq!(c.drops.load(Ordering::SeqCst), 2);
    let mut f = e.into_inner();
    assert_eq!(f(), Some(ms(1)));
    drop(f);
    assert_eq!(
        (
            c.runs.load(Ordering::SeqCst),
            c.drops.load(Ordering::SeqCst)
        ),
        (3, 3)
    );
    // schedule_async
    let p = Probe(c.clone());
    let cc = c.clone();
    let e = timer
        .schedule_async(ms(1), async move {
            let _p = p;
            cc.runs.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap_err();
    assert_eq!(e.kind(), want);
    assert_eq!(format!("{e:?}"), format!("{want:?}(..)"));
    assert_eq!(c.drops.load(Ordering::SeqCst), 3);
    let fut = e.into_inner();
    futures::executor::block_on(fut);
    assert_eq!(
        (
            c.runs.load(Ordering::SeqCst),
            c.drops.load(Ordering::SeqCst)
        ),
        (4, 4)
    );
    // sleeps and timeouts
    let s = timer.sleep(ms(1));
    assert!(s.is_elapsed());
    assert_eq!(futures::executor::block_on(s), Err(want));
    let s = timer.sleep_until(Instant::now() + ms(1));
    assert_eq!(futures::executor::block_on(s), Err(want));
    let t = timer.timeout(ms(1), std::future::pending::<()>());
    assert_eq!(
        futures::executor::block_on(t),
        Err(TimeoutError::Timer(want))
    );
    // a refused timeout's inner future comes back through into_inner, unpolled
    let p = Probe(c.clone());
    let t = timer.timeout_at(Instant::now() + ms(1), async move {
        let _p = p;
        7
    });
    assert_eq!(c.drops.load(Ordering::SeqCst), 4);
    assert_eq!(futures::executor::block_on(t.into_inner()), 7);
    assert_eq!(c.drops.load(Ordering::SeqCst), 5);
    // a ready inner future still wins over the refusal
    assert_eq!(
        futures::executor::block_on(timer.timeout(ms(1), async { 3 })),
        Ok(3)
    );
}

/// The timer's every scheduling form at its limit, then shut down.
#[tokio::test(start_paused = true)]
async fn timer_every_form_refused_at_the_limit_and_shut_down() {
    let timer = Timer::builder().max_pending(1).build().unwrap();
    let _held = timer.sleep(ms(1000));
    every_schedule_form(&timer, TimerError::AtCapacity);
    drop(_held);
    drop(timer.shutdown());
    every_schedule_form(&timer, TimerError::Shutdown);
    assert_eq!(timer.metrics().pending, 0);
}

/// The timer's every scheduling form once its reaper is gone, the limit full
/// when it went (the room is given back, the reason is `ReaperGone`).
#[test]
fn timer_every_form_refused_with_the_reaper_gone() {
    let rt = support::paused();
    let timer = rt.block_on(async { Timer::builder().max_pending(2).build().unwrap() });
    let (_s, _h) = rt.block_on(async {
        (
            timer.sleep(ms(1000)),
            timer.schedule_repeating(ms(1000), || Some(ms(1))).unwrap(),
        )
    });
    drop(rt);
    let rt2 = support::paused();
    rt2.block_on(async {
        assert_eq!(
            timer.metrics().pending,
            0,
            "room given back when the reaper went"
        );
        every_schedule_form(&timer, TimerError::ReaperGone);
    });
}

/// A repeating task (which keeps its room while it runs) shuts its timer down
/// from inside its run, then schedules and sleeps at the full limit: both are
/// refused with `Shutdown`, not `AtCapacity`, and so is a schedule after.
#[tokio::test(start_paused = true)]
async fn a_timer_shut_down_by_its_repeating_task_refuses_it_with_shutdown() {
    let timer = Timer::builder().max_pending(1).build().unwrap();
    let weak = timer.downgrade();
    let seen = Arc::new(Mutex::new(None));
    let s2 = seen.clone();
    timer
        .schedule_repeating(ms(1), move || {
            if let Some(t) = weak.upgrade() {
                drop(t.shutdown());
                let e = t.schedule(ms(1), || {}).unwrap_err();
                let sl = t.sleep(ms(1));
                *s2.lock().unwrap() = Some((e.kind(), futures::executor::block_on(sl)));
            }
            Some(ms(1))
        })
        .unwrap();
    tokio::time::sleep(ms(3)).await;
    settle().await;
    let got = seen.lock().unwrap().take().expect("ran");
    let m = timer.metrics();
    assert_eq!(m.pending, 0);
    // and after the run, from outside: Shutdown
    assert_eq!(
        timer.schedule(ms(1), || {}).unwrap_err().kind(),
        TimerError::Shutdown
    );
    assert_eq!(
        got,
        (TimerError::Shutdown, Err(TimerError::Shutdown)),
        "refusal reason while shut down"
    );
}

/// The same from a one-shot task (its room is given back before it runs).
#[tokio::test(start_paused = true)]
async fn a_timer_shut_down_by_its_one_shot_task_refuses_it_with_shutdown() {
    let timer = Timer::builder().max_pending(1).build().unwrap();
    let weak = timer.downgrade();
    let seen = Arc::new(Mutex::new(None));
    let s2 = seen.clone();
    timer
        .schedule(ms(1), move || {
            if let Some(t) = weak.upgrade() {
                drop(t.shutdown());
                *s2.lock().unwrap() = Some(t.schedule(ms(1), || {}).unwrap_err().kind());
            }
        })
        .unwrap();
    tokio::time::sleep(ms(3)).await;
    settle().await;
    assert_eq!(seen.lock().unwrap().take(), Some(TimerError::Shutdown));
}

/// A repeating task keeps its room while it runs, so a schedule from inside
/// its run is refused with `AtCapacity`; a chain that ends gives it back at
/// once.
#[tokio::test(start_paused = true)]
async fn a_repeating_task_keeps_its_room_through_its_runs_then_gives_it_back() {
    let timer = Timer::builder().max_pending(1).build().unwrap();
    let weak = timer.downgrade();
    let inner = Arc::new(Mutex::new(Vec::new()));
    let i2 = inner.clone();
    let mut n = 0;
    timer
        .schedule_repeating(ms(1), move || {
            n += 1;
            let t = weak.upgrade().unwrap();
            i2.lock()
                .unwrap()
                .push(t.schedule(ms(1), || {}).map(|_| ()).map_err(|e| e.kind()));
            (n < 3).then_some(ms(1))
        })
        .unwrap();
    tokio::time::sleep(ms(10)).await;
    settle().await;
    assert_eq!(*inner.lock().unwrap(), vec![Err(TimerError::AtCapacity); 3]);
    timer.schedule(ms(1), || {}).unwrap();
}

/// A drain on another thread racing a shutdown, round after round (real
/// threads, bounded): the shutdown hands back every op, the drain ends
/// whichever came first, and a drain after the shutdown ends at once.
#[test]
fn a_drain_racing_a_shutdown_ends() {
    within(10, drain_racing_shutdown);
}

fn drain_racing_shutdown() {
    let rt = support::multi();
    let _g = rt.enter();
    for _ in 0..30 {
        let p: P = Purgatory::builder().build().unwrap();
        let c = Arc::new(Counts::default());
        let kd = Arc::new(AtomicUsize::new(0));
        let hs: Vec<_> = (0..10)
            .map(|i| {
                p.try_complete_else_watch(Op::new(i, &c), ms(100_000), [Key::new(i, &kd)])
                    .unwrap()
            })
            .collect();
        let (p2, barrier) = (p.clone(), Arc::new(std::sync::Barrier::new(2)));
        let b = barrier.clone();
        let drainer = std::thread::spawn(move || {
            b.wait();
            futures::executor::block_on(p2.drain());
        });
        barrier.wait();
        let back = p.shutdown();
        assert_eq!(back.len(), 10);
        drainer.join().unwrap();
        drop(back);
        drop(hs);
        futures::executor::block_on(p.drain());
        assert_eq!(c.drops.load(Ordering::SeqCst), 10);
        assert!(balanced(&p.metrics()));
    }
}

/// Two drains waiting, one dropped midway: the other is still woken and
/// ends when the last op completes; a drain after that ends at once.
#[tokio::test(start_paused = true)]
async fn a_drain_dropped_midway_leaves_the_other_woken() {
    let p: P = Purgatory::builder().build().unwrap();
    let c = Arc::new(Counts::default());
    let kd = Arc::new(AtomicUsize::new(0));
    let flag = Arc::new(AtomicBool::new(false));
    let f = flag.clone();
    let mut op = Op::new(1, &c);
    op.hook = Some(Arc::new(move |op: &mut Op| {
        f.load(Ordering::SeqCst).then_some(op.id)
    }));
    let h = p
        .try_complete_else_watch(op, ms(100_000), [Key::new(1, &kd)])
        .unwrap();
    let mut a = task::spawn(p.drain());
    let mut b = task::spawn(p.drain());
    assert_pending!(a.poll());
    assert_pending!(b.poll());
    drop(a);
    flag.store(true, Ordering::SeqCst);
    assert_eq!(p.try_complete_watched(&Key::new(1, &kd)), 1);
    assert!(b.is_woken());
    assert_ready!(b.poll());
    assert_eq!(h.await, Ok(Completion::Completed(1)));
    assert_ready!(task::spawn(p.drain()).poll());
}
