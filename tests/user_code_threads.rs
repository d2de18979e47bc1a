//! Which thread runs or drops user code (operation.rs "Concurrency"
//! and "Panics and drops", handle.rs "Cancel safety", timer cancels).
//! Every check, expiry and drop logs the thread it ran on; each test runs
//! its runtime on a thread of its own, bounded by `support::within`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle, ThreadId};
use std::time::Duration;

use tokio_purgatory::{Completion, OperationError, OperationStatus, Purgatory, Timer};

mod support;
use support::{ms, settle};

/// What ran, on which thread, in order.
#[derive(Clone, Default, Debug)]
struct Log(Arc<Mutex<Vec<(&'static str, ThreadId)>>>);

impl Log {
    fn push(&self, what: &'static str) {
        self.0.lock().unwrap().push((what, thread::current().id()));
    }
    fn all(&self) -> Vec<(&'static str, ThreadId)> {
        self.0.lock().unwrap().clone()
    }
    fn of(&self, what: &str) -> Vec<ThreadId> {
        self.all()
            .into_iter()
            .filter(|(w, _)| *w == what)
            .map(|(_, t)| t)
            .collect()
    }
    fn pos(&self, what: &str) -> Option<usize> {
        self.all().iter().position(|(w, _)| *w == what)
    }
    fn clear(&self) {
        self.0.lock().unwrap().clear();
    }
}

/// An output whose drop is logged.
#[derive(Debug)]
struct Out(Log);
impl Drop for Out {
    fn drop(&mut self) {
        self.0.push("out-drop");
    }
}
impl PartialEq for Out {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

/// Once armed, the next check signals `entered` and waits for `release`.
type Gate = Arc<Mutex<Option<(mpsc::Sender<()>, mpsc::Receiver<()>)>>>;

fn arm(gate: &Gate) -> (mpsc::Receiver<()>, mpsc::Sender<()>) {
    let (etx, erx) = mpsc::channel();
    let (rtx, rrx) = mpsc::channel();
    *gate.lock().unwrap() = Some((etx, rrx));
    (erx, rtx)
}

struct Who {
    log: Log,
    ready: Arc<AtomicBool>,
    gate: Gate,
}

impl tokio_purgatory::Operation for Who {
    type Output = Out;
    fn try_complete(&mut self) -> Option<Out> {
        self.log.push("check");
        let g = self.gate.lock().unwrap().take();
        if let Some((entered, release)) = g {
            let _ = entered.send(());
            if release.recv_timeout(Duration::from_secs(20)).is_err() {
                self.log.push("gate-timeout");
            }
        }
        self.ready
            .load(Ordering::SeqCst)
            .then(|| Out(self.log.clone()))
    }
    fn on_expiration(self) -> Out {
        self.log.push("expire");
        Out(self.log.clone())
    }
}

impl Drop for Who {
    fn drop(&mut self) {
        self.log.push("drop");
    }
}

fn who(ready: bool) -> (Who, Log, Arc<AtomicBool>, Gate) {
    let log = Log::default();
    let r = Arc::new(AtomicBool::new(ready));
    let gate: Gate = Arc::default();
    (
        Who {
            log: log.clone(),
            ready: r.clone(),
            gate: gate.clone(),
        },
        log,
        r,
        gate,
    )
}

/// Joins `h`, failing if it has not ended within `secs` seconds.
fn join_within<T>(h: JoinHandle<T>, secs: u64) -> T {
    let t = std::time::Instant::now();
    while !h.is_finished() {
        assert!(
            t.elapsed() < Duration::from_secs(secs),
            "thread stuck for {secs} s"
        );
        thread::sleep(Duration::from_micros(200));
    }
    h.join().unwrap()
}

/// Spawns `f` on a new thread entered into `rt`'s runtime.
fn on_thread<T: Send + 'static>(
    rt: &tokio::runtime::Runtime,
    f: impl FnOnce() -> T + Send + 'static,
) -> JoinHandle<(ThreadId, T)> {
    let h = rt.handle().clone();
    thread::spawn(move || {
        let _g = h.enter();
        let out = f();
        (thread::current().id(), out)
    })
}

fn build(rt: &tokio::runtime::Runtime) -> Purgatory<u32, Who> {
    let _g = rt.enter();
    Purgatory::builder().name("who").build().unwrap()
}

/// Registration's checks run on the registering thread; an operation
/// completed by them is dropped there, before registration returns.
#[test]
fn registration_checks_and_drop_on_registering_thread() {
    support::within(30, || {
        let rt = support::paused();
        let p = build(&rt);
        // Ready at once.
        let (op, log, _, _) = who(true);
        let pp = p.clone();
        let lg = log.clone();
        let (r_id, h) = join_within(
            on_thread(&rt, move || {
                let h = pp.try_complete_else_watch(op, ms(1000), [1]).unwrap();
                lg.push("reg-returned");
                h
            }),
            10,
        );
        assert_ne!(r_id, thread::current().id());
        assert_eq!(log.of("check"), vec![r_id]);
        assert_eq!(log.of("drop"), vec![r_id], "{:?}", log.all());
        assert!(log.pos("drop") < log.pos("reg-returned"));
        let out = rt.block_on(async { support::resolve(h).await });
        assert!(matches!(out, Ok(Completion::Completed(_))));
        drop(out);
        assert_eq!(log.of("out-drop"), vec![thread::current().id()]);

        // Not ready: both checks on the registering thread, nothing dropped.
        let (op, log, _, _) = who(false);
        let pp = p.clone();
        let (r_id, h) = join_within(
            on_thread(&rt, move || {
                pp.try_complete_else_watch(op, ms(1000), [1]).unwrap()
            }),
            10,
        );
        let checks = log.of("check");
        assert!(!checks.is_empty() && checks.iter().all(|t| *t == r_id));
        assert!(log.of("drop").is_empty());
        h.detach();
        drop(p.shutdown());
    });
}

/// A walk and a check by reference run the check on the caller's thread; the
/// completed operation, and the output of a detached handle nobody reads,
/// are dropped there before the call returns.
#[test]
fn walk_and_reference_check_and_drops_on_caller_thread() {
    support::within(30, || {
        let rt = support::paused();
        let p = build(&rt);
        // Walk.
        let (op, log, ready, _) = who(false);
        let h = {
            let _g = rt.enter();
            p.try_complete_else_watch(op, ms(1000), [1]).unwrap()
        };
        h.detach();
        log.clear();
        ready.store(true, Ordering::SeqCst);
        let pp = p.clone();
        let lg = log.clone();
        let (w_id, n) = join_within(
            on_thread(&rt, move || {
                let n = pp.try_complete_watched(&1);
                lg.push("walk-returned");
                n
            }),
            10,
        );
        assert_eq!(n, 1);
        assert_eq!(log.of("check"), vec![w_id]);
        assert_eq!(log.of("drop"), vec![w_id], "{:?}", log.all());
        assert_eq!(log.of("out-drop"), vec![w_id], "unread output");
        assert!(log.pos("out-drop") < log.pos("walk-returned"));
        assert!(log.pos("drop") < log.pos("walk-returned"));

        // By reference.
        let (op, log, ready, _) = who(false);
        let h = {
            let _g = rt.enter();
            p.try_complete_else_watch(op, ms(1000), [2]).unwrap()
        };
        let r = h.op_ref().unwrap();
        log.clear();
        ready.store(true, Ordering::SeqCst);
        let lg = log.clone();
        let (c_id, done) = join_within(
            on_thread(&rt, move || {
                let d = r.try_complete();
                lg.push("ref-returned");
                d
            }),
            10,
        );
        assert!(done);
        assert_eq!(log.of("check"), vec![c_id]);
        assert_eq!(log.of("drop"), vec![c_id]);
        assert!(log.pos("drop") < log.pos("ref-returned"));
        assert!(log.of("out-drop").is_empty(), "the handle reads it");
        let out = rt.block_on(support::resolve(h));
        assert!(matches!(out, Ok(Completion::Completed(_))));
    });
}

/// Expiry runs on the reaper (the runtime's thread here), not the
/// registering thread.
#[test]
fn expiry_on_reaper_thread() {
    support::within(30, || {
        let rt = support::paused();
        let p = build(&rt);
        let (op, log, _, _) = who(false);
        let pp = p.clone();
        let (r_id, h) = join_within(
            on_thread(&rt, move || {
                pp.try_complete_else_watch(op, ms(10), [1]).unwrap()
            }),
            10,
        );
        let me = thread::current().id();
        let out = rt.block_on(support::resolve(h));
        assert!(matches!(out, Ok(Completion::Expired(_))));
        assert_eq!(log.of("expire"), vec![me]);
        assert_eq!(log.of("drop"), vec![me]);
        assert_ne!(r_id, me);
    });
}

/// The timeout fires while thread B's check is held: the expiry and drop run
/// on B, right after its check says "not yet", before B's call returns.
#[test]
fn expiry_during_check_runs_on_checking_thread() {
    support::within(30, || {
        let rt = support::paused();
        let p = build(&rt);
        let (op, log, _, gate) = who(false);
        let h = {
            let _g = rt.enter();
            p.try_complete_else_watch(op, ms(10), [1]).unwrap()
        };
        let r = h.op_ref().unwrap();
        log.clear();
        let (entered, release) = arm(&gate);
        let lg = log.clone();
        let r2 = r.clone();
        let b = on_thread(&rt, move || {
            let d = r2.try_complete();
            lg.push("b-returned");
            d
        });
        entered.recv_timeout(Duration::from_secs(10)).unwrap();
        rt.block_on(async {
            tokio::time::advance(ms(50)).await;
            settle().await;
        });
        assert!(log.of("expire").is_empty(), "expired under a running check");
        assert_eq!(r.status(), OperationStatus::Pending);
        release.send(()).unwrap();
        let (b_id, done) = join_within(b, 10);
        assert!(!done);
        assert_eq!(log.of("expire"), vec![b_id], "{:?}", log.all());
        assert_eq!(log.of("drop"), vec![b_id]);
        assert!(log.pos("drop") < log.pos("b-returned"));
        let out = rt.block_on(support::resolve(h));
        assert!(matches!(out, Ok(Completion::Expired(_))));
        assert_eq!(r.status(), OperationStatus::Expired);
    });
}

/// A handle dropped on thread C while nothing checks it: the operation is
/// dropped on C before `drop` returns.
#[test]
fn dropped_handle_drops_on_dropping_thread() {
    support::within(30, || {
        let rt = support::paused();
        let p = build(&rt);
        let (op, log, _, _) = who(false);
        let h = {
            let _g = rt.enter();
            p.try_complete_else_watch(op, ms(1000), [1]).unwrap()
        };
        let r = h.op_ref().unwrap();
        log.clear();
        let lg = log.clone();
        let (c_id, ()) = join_within(
            on_thread(&rt, move || {
                drop(h);
                lg.push("c-returned");
            }),
            10,
        );
        assert_eq!(log.of("drop"), vec![c_id]);
        assert!(log.pos("drop") < log.pos("c-returned"));
        assert_eq!(r.status(), OperationStatus::Cancelled);
        // Finished with an unread output: dropped on the dropping thread.
        let (op, log, ready, _) = who(false);
        let h = {
            let _g = rt.enter();
            p.try_complete_else_watch(op, ms(1000), [3]).unwrap()
        };
        ready.store(true, Ordering::SeqCst);
        assert_eq!(p.try_complete_watched(&3), 1);
        let lg = log.clone();
        let (c_id, ()) = join_within(
            on_thread(&rt, move || {
                drop(h);
                lg.push("c-returned");
            }),
            10,
        );
        assert_eq!(log.of("out-drop"), vec![c_id]);
        assert!(log.pos("out-drop") < log.pos("c-returned"));
    });
}

/// How one held check on B meets a walk from A and a finish from C.
#[derive(Clone, Copy, Debug)]
enum Finish {
    DropHandle,
    CancelRef,
    Shutdown,
    Complete,
}

fn held_check(finish: Finish, b_walks: bool) {
    let rt = support::paused();
    let p = build(&rt);
    let (op, log, ready, gate) = who(false);
    let h = {
        let _g = rt.enter();
        p.try_complete_else_watch(op, ms(60_000), [1]).unwrap()
    };
    let r = h.op_ref().unwrap();
    log.clear();
    let (entered, release) = arm(&gate);
    let lg = log.clone();
    let r2 = r.clone();
    let pb = p.clone();
    let b = on_thread(&rt, move || {
        let d = if b_walks {
            pb.try_complete_watched(&1) == 1
        } else {
            r2.try_complete()
        };
        lg.push("b-returned");
        d
    });
    entered.recv_timeout(Duration::from_secs(10)).unwrap();
    // A walks the key: asks B for a re-run, returns at once.
    let pp = p.clone();
    let (a_id, _n) = join_within(on_thread(&rt, move || pp.try_complete_watched(&1)), 10);
    // C finishes it (or not).
    let pp = p.clone();
    let r3 = r.clone();
    let lg = log.clone();
    let hh = h;
    let (c_id, handed) = join_within(
        on_thread(&rt, move || {
            let handed = match finish {
                Finish::DropHandle => {
                    drop(hh);
                    0
                }
                Finish::CancelRef => {
                    hh.detach();
                    r3.cancel().map_or(0, |_| 1)
                }
                Finish::Shutdown => {
                    hh.detach();
                    pp.shutdown().len()
                }
                Finish::Complete => {
                    hh.detach();
                    0
                }
            };
            lg.push("c-returned");
            handed
        }),
        10,
    );
    assert_eq!(handed, 0, "{finish:?}: a held operation is not handed back");
    assert!(
        log.of("drop").is_empty(),
        "{finish:?}: dropped while B's check runs: {:?}",
        log.all()
    );
    if let Finish::Complete = finish {
        ready.store(true, Ordering::SeqCst);
    }
    release.send(()).unwrap();
    let (b_id, done) = join_within(b, 10);
    let all = log.all();
    assert_eq!(done, matches!(finish, Finish::Complete), "{finish:?}");
    assert_eq!(log.of("drop"), vec![b_id], "{finish:?}: {all:?}");
    assert!(
        log.pos("drop") < log.pos("b-returned"),
        "{finish:?}: {all:?}"
    );
    let checks = log.of("check");
    match finish {
        Finish::Complete => {
            assert_eq!(log.of("out-drop"), vec![b_id], "detached output");
            assert_eq!(r.status(), OperationStatus::Completed);
        }
        _ => {
            // The cancel (or shutdown) wins over A's re-run.
            assert_eq!(
                checks,
                vec![b_id],
                "{finish:?}: re-run after cancel: {all:?}"
            );
            assert_eq!(r.status(), OperationStatus::Cancelled, "{finish:?}");
        }
    }
    assert!(log.of("expire").is_empty());
    assert_ne!(a_id, b_id);
    assert_ne!(c_id, b_id);
    let m = p.metrics();
    assert_eq!(
        m.registered,
        m.completed + m.expired + m.cancelled + m.handed_back + m.delayed as u64,
        "{m:?}"
    );
}

#[test]
fn held_check_then_handle_dropped_elsewhere_drops_on_checker() {
    support::within(30, || {
        held_check(Finish::DropHandle, false);
        held_check(Finish::DropHandle, true)
    });
}

#[test]
fn held_check_then_opref_cancel_elsewhere_drops_on_checker() {
    support::within(30, || {
        held_check(Finish::CancelRef, false);
        held_check(Finish::CancelRef, true)
    });
}

#[test]
fn held_check_then_shutdown_elsewhere_drops_on_checker() {
    support::within(30, || {
        held_check(Finish::Shutdown, false);
        held_check(Finish::Shutdown, true)
    });
}

#[test]
fn held_check_that_completes_drops_on_checker() {
    support::within(30, || {
        held_check(Finish::Complete, false);
        held_check(Finish::Complete, true)
    });
}

/// The awaiting handle of a held check resolves Cancelled / Shutdown once
/// it says "not yet".
#[test]
fn held_check_cancel_resolves_handle() {
    support::within(30, || {
        let rt = support::paused();
        let p = build(&rt);
        let (op, log, _, gate) = who(false);
        let h = {
            let _g = rt.enter();
            p.try_complete_else_watch(op, ms(60_000), [1]).unwrap()
        };
        let r = h.op_ref().unwrap();
        let (entered, release) = arm(&gate);
        let r2 = r.clone();
        let b = on_thread(&rt, move || r2.try_complete());
        entered.recv_timeout(Duration::from_secs(10)).unwrap();
        assert!(r.cancel().is_none(), "left to the check");
        release.send(()).unwrap();
        let (b_id, _) = join_within(b, 10);
        assert_eq!(log.of("drop"), vec![b_id]);
        assert_eq!(
            rt.block_on(support::resolve(h)),
            Err(OperationError::Cancelled)
        );
    });
}

/// A guard whose drop is logged, captured by timer tasks.
struct Guard(Log);
impl Drop for Guard {
    fn drop(&mut self) {
        self.0.push("task-drop");
    }
}

/// `TaskHandle::cancel` (one-shot and repeating) and
/// `AsyncTaskHandle::cancel` from another thread drop the task there,
/// before `cancel` returns.
#[test]
fn timer_cancel_drops_on_cancelling_thread() {
    support::within(30, || {
        let rt = support::paused();
        let timer = {
            let _g = rt.enter();
            Timer::builder().name("who").build().unwrap()
        };
        for kind in 0..3 {
            let log = Log::default();
            let g = Guard(log.clone());
            let (once, asy) = {
                let _g = rt.enter();
                match kind {
                    0 => (
                        Some(
                            timer
                                .schedule(ms(1000), move || {
                                    let _ = &g;
                                    panic!("cancelled")
                                })
                                .unwrap(),
                        ),
                        None,
                    ),
                    1 => (
                        Some(
                            timer
                                .schedule_repeating(ms(1000), move || {
                                    let _ = &g;
                                    Some(ms(1000))
                                })
                                .unwrap(),
                        ),
                        None,
                    ),
                    _ => (
                        None,
                        Some(
                            timer
                                .schedule_async(ms(1000), async move {
                                    let _ = &g;
                                    panic!("cancelled")
                                })
                                .unwrap(),
                        ),
                    ),
                }
            };
            let lg = log.clone();
            let (c_id, ok) = join_within(
                on_thread(&rt, move || {
                    let ok = match (once, asy) {
                        (Some(t), _) => t.cancel(),
                        (_, Some(t)) => t.cancel(),
                        _ => unreachable!(),
                    };
                    lg.push("cancel-returned");
                    ok
                }),
                10,
            );
            assert!(ok, "kind {kind}");
            assert_eq!(log.of("task-drop"), vec![c_id], "kind {kind}");
            assert!(
                log.pos("task-drop") < log.pos("cancel-returned"),
                "kind {kind}: {:?}",
                log.all()
            );
            assert_eq!(timer.len(), 0, "kind {kind}");
        }
        rt.block_on(async {
            tokio::time::advance(ms(5000)).await;
            settle().await;
        });
        assert_eq!(timer.metrics().panicked, 0);
    });
}

/// B walks (not by reference) and its check is held while the timeout
/// fires; then the handle is dropped on C. The cancel wins over the timeout
/// (OpRef::cancel's docs), and both the decision and the drop are B's.
#[test]
fn held_walk_timeout_then_drop_elsewhere() {
    support::within(30, || {
        for drop_it in [false, true] {
            let rt = support::paused();
            let p = build(&rt);
            let (op, log, _, gate) = who(false);
            let h = {
                let _g = rt.enter();
                p.try_complete_else_watch(op, ms(10), [1]).unwrap()
            };
            let r = h.op_ref().unwrap();
            log.clear();
            let (entered, release) = arm(&gate);
            let lg = log.clone();
            let pb = p.clone();
            let b = on_thread(&rt, move || {
                let n = pb.try_complete_watched(&1);
                lg.push("b-returned");
                n
            });
            entered.recv_timeout(Duration::from_secs(10)).unwrap();
            rt.block_on(async {
                tokio::time::advance(ms(50)).await;
                settle().await;
            });
            let mut h = Some(h);
            if drop_it {
                let hh = h.take();
                let (c_id, ()) = join_within(on_thread(&rt, move || drop(hh)), 10);
                assert!(!log.of("drop").contains(&c_id));
            }
            assert!(log.of("drop").is_empty() && log.of("expire").is_empty());
            release.send(()).unwrap();
            let (b_id, n) = join_within(b, 10);
            assert_eq!(n, 0);
            assert_eq!(log.of("drop"), vec![b_id], "{:?}", log.all());
            assert!(log.pos("drop") < log.pos("b-returned"));
            if drop_it {
                assert!(log.of("expire").is_empty(), "cancel wins: {:?}", log.all());
                assert_eq!(r.status(), OperationStatus::Cancelled);
            } else {
                assert_eq!(log.of("expire"), vec![b_id]);
                assert_eq!(r.status(), OperationStatus::Expired);
                let out = rt.block_on(support::resolve(h.take().unwrap()));
                assert!(matches!(out, Ok(Completion::Expired(_))));
            }
            assert_eq!(log.of("check"), vec![b_id], "no re-run");
        }
    });
}
