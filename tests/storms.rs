//! Event storms (lib.rs "No missed events": re-runs go on "until
//! it completes, is cancelled or expires (a registration, whose timeout is
//! not armed yet, until such a storm pauses)"). Walker threads hammer one key
//! whose operation's check spins a few microseconds; a cancel, a dropped
//! handle, a shutdown or the timeout during the storm must end the
//! operation promptly, and a registration caught in a storm must return
//! once it pauses. Real threads, every wait bounded.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use tokio_purgatory::{
    Completion, OperationError, OperationStatus, Purgatory, PurgatoryMetrics, WatchError,
};

mod support;

#[derive(Clone, Default)]
struct Counters {
    checks: Arc<AtomicU64>,
    drops: Arc<AtomicUsize>,
    ready: Arc<AtomicBool>,
    busy: Arc<AtomicBool>,
    overlaps: Arc<AtomicUsize>,
    /// Extra microseconds each check spins.
    spin: u64,
    /// Checks run on the thread named here (the registering one).
    on: Arc<std::sync::Mutex<Option<thread::ThreadId>>>,
    on_checks: Arc<AtomicU64>,
    /// When set, a check on the `on` thread lasts until the walkers have
    /// walked 4 more times (at most 2 ms): every such check sees an event.
    pace: Option<Arc<AtomicU64>>,
    pace_timeouts: Arc<AtomicU64>,
}

struct Slow(Counters);

impl tokio_purgatory::Operation for Slow {
    type Output = u8;
    fn try_complete(&mut self) -> Option<u8> {
        let c = &self.0;
        if c.busy.swap(true, Ordering::SeqCst) {
            c.overlaps.fetch_add(1, Ordering::SeqCst);
        }
        c.checks.fetch_add(1, Ordering::SeqCst);
        if *c.on.lock().unwrap() == Some(thread::current().id()) {
            c.on_checks.fetch_add(1, Ordering::SeqCst);
            if let Some(walks) = &c.pace {
                let w0 = walks.load(Ordering::SeqCst);
                let t = Instant::now();
                while walks.load(Ordering::SeqCst) < w0 + 4
                    && t.elapsed() < Duration::from_millis(2)
                {
                    std::hint::spin_loop();
                }
                if walks.load(Ordering::SeqCst) < w0 + 4 {
                    c.pace_timeouts.fetch_add(1, Ordering::SeqCst);
                }
            }
        }
        let t = Instant::now();
        while t.elapsed() < Duration::from_micros(4 + c.spin) {
            std::hint::spin_loop();
        }
        let r = c.ready.load(Ordering::SeqCst).then_some(1);
        c.busy.store(false, Ordering::SeqCst);
        r
    }
    fn on_expiration(self) -> u8 {
        2
    }
}

impl Drop for Slow {
    fn drop(&mut self) {
        self.0.drops.fetch_add(1, Ordering::SeqCst);
    }
}

fn balanced(m: &PurgatoryMetrics) -> bool {
    m.registered == m.completed + m.expired + m.cancelled + m.handed_back + m.delayed as u64
}

/// Walker threads hammering `key` until `stop` (or 20 s, a bound).
struct Storm {
    stop: Arc<AtomicBool>,
    walks: Arc<AtomicU64>,
    threads: Vec<JoinHandle<()>>,
}

impl Storm {
    fn start(p: &Purgatory<u32, Slow>, key: u32, n: usize) -> Storm {
        let stop = Arc::new(AtomicBool::new(false));
        let walks = Arc::new(AtomicU64::new(0));
        let threads = (0..n)
            .map(|_| {
                let (p, stop, walks) = (p.clone(), stop.clone(), walks.clone());
                thread::spawn(move || {
                    let t = Instant::now();
                    while !stop.load(Ordering::Relaxed) && t.elapsed() < Duration::from_secs(20) {
                        p.try_complete_watched(&key);
                        walks.fetch_add(1, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        Storm {
            stop,
            walks,
            threads,
        }
    }

    /// Stops the walkers; each must return within `secs`.
    fn stop(self, secs: u64) {
        self.stop.store(true, Ordering::SeqCst);
        let t = Instant::now();
        for h in self.threads {
            while !h.is_finished() {
                assert!(
                    t.elapsed() < Duration::from_secs(secs),
                    "a walker did not return within {secs} s of the stop"
                );
                thread::sleep(Duration::from_micros(500));
            }
            h.join().unwrap();
        }
    }
}

/// Waits (bounded) until `f` holds.
fn wait_for(what: &str, secs: u64, f: impl Fn() -> bool) -> Duration {
    let t = Instant::now();
    while !f() {
        assert!(
            t.elapsed() < Duration::from_secs(secs),
            "{what}: not within {secs} s"
        );
        thread::sleep(Duration::from_micros(200));
    }
    t.elapsed()
}

#[derive(Clone, Copy, Debug)]
enum End {
    OpRefCancel,
    HandleCancel,
    DropHandle,
    Shutdown,
    Expire,
    Complete,
}

/// One storm ended one way: the operation finishes within 5 s while the
/// walkers keep going, its handle resolves, and the checks stop.
fn storm_then(end: End, round: usize) {
    let rt = support::multi();
    let _g = rt.enter();
    let p: Purgatory<u32, Slow> = Purgatory::builder().name("storm").build().unwrap();
    let c = Counters::default();
    let timeout = match end {
        End::Expire => Duration::from_millis(150),
        _ => Duration::from_secs(60),
    };
    let h = p
        .try_complete_else_watch(Slow(c.clone()), timeout, [1])
        .unwrap();
    let r = h.op_ref().unwrap();
    let storm = Storm::start(&p, 1, 3);
    wait_for("storm under way", 5, || {
        c.checks.load(Ordering::SeqCst) > 2_000
    });
    let mut h = Some(h);
    let t0 = Instant::now();
    let mut handed = 0;
    match end {
        End::OpRefCancel => handed = r.cancel().map_or(0, |_| 1),
        End::HandleCancel => handed = h.take().unwrap().cancel().map_or(0, |_| 1),
        End::DropHandle => drop(h.take()),
        End::Shutdown => handed = p.shutdown().len(),
        End::Expire => {}
        End::Complete => c.ready.store(true, Ordering::SeqCst),
    }
    let call = t0.elapsed();
    let took = wait_for(&format!("{end:?} round {round}: finished"), 5, || {
        r.status() != OperationStatus::Pending
    });
    wait_for(&format!("{end:?} round {round}: dropped"), 5, || {
        c.drops.load(Ordering::SeqCst) == 1
    });
    if let Some(h) = h.take() {
        let out = rt
            .block_on(tokio::time::timeout(Duration::from_secs(5), h))
            .unwrap_or_else(|_| panic!("{end:?} round {round}: handle did not resolve"));
        match (end, &out) {
            (End::OpRefCancel, Err(OperationError::Cancelled)) => {}
            (End::Shutdown, Err(OperationError::Shutdown)) => {}
            (End::Expire, Ok(Completion::Expired(2))) => {}
            (End::Complete, Ok(Completion::Completed(1))) => {}
            other => panic!("round {round}: {other:?}"),
        }
    }
    // The checks stop although the walkers go on.
    let walks0 = storm.walks.load(Ordering::SeqCst);
    let c1 = c.checks.load(Ordering::SeqCst);
    thread::sleep(Duration::from_millis(20));
    let waited = wait_for("the walkers still walk", 5, || {
        storm.walks.load(Ordering::SeqCst) > walks0 + 1_000
    });
    if waited > Duration::from_millis(5) {
        eprintln!("{end:?} round {round}: 1,000 more walks took 20 ms + {waited:?}");
    }
    let c2 = c.checks.load(Ordering::SeqCst);
    assert_eq!(c1, c2, "{end:?} round {round}: checks after it finished");
    storm.stop(5);
    assert_eq!(c.overlaps.load(Ordering::SeqCst), 0);
    assert_eq!(c.drops.load(Ordering::SeqCst), 1, "dropped once");
    let _ = handed;
    let m = p.metrics();
    assert!(balanced(&m), "{end:?} round {round}: {m:?}");
    assert_eq!(m.delayed, 0);
    if round == 0 {
        eprintln!(
            "{end:?}: call {call:?}, finished after {took:?}, checks {c2}, status {:?}",
            r.status()
        );
    }
    drop(r);
    drop(p);
    rt.shutdown_timeout(Duration::from_secs(5));
}

fn rounds(end: End) {
    for round in 0..5 {
        support::within(60, move || storm_then(end, round));
    }
}

#[test]
fn storm_then_opref_cancel() {
    rounds(End::OpRefCancel);
}
#[test]
fn storm_then_handle_cancel() {
    rounds(End::HandleCancel);
}
#[test]
fn storm_then_drop_handle() {
    rounds(End::DropHandle);
}
#[test]
fn storm_then_shutdown() {
    rounds(End::Shutdown);
}
#[test]
fn storm_then_expire() {
    rounds(End::Expire);
}
#[test]
fn storm_then_complete() {
    rounds(End::Complete);
}

#[derive(Clone, Copy, Debug)]
enum During {
    Nothing,
    Ready,
    Shutdown,
    CancelForKey,
}

/// A registration started while a storm is on (walkers hammering the
/// key it watches, so that its own checks are asked to re-run; another
/// operation pending on another key)
/// returns once the storm stops, the operation pending or completed, never
/// lost; the counts balance.
fn register_in_storm(during: During, paced: bool, round: usize) {
    let rt = support::multi();
    let _g = rt.enter();
    let p: Purgatory<u32, Slow> = Purgatory::builder().name("storm").build().unwrap();
    let c0 = Counters::default();
    let h0 = p
        .try_complete_else_watch(Slow(c0.clone()), Duration::from_secs(60), [3])
        .unwrap();
    let storm = Storm::start(&p, 1, 3);
    wait_for("storm under way", 5, || {
        storm.walks.load(Ordering::SeqCst) > 2_000
    });
    let c = Counters {
        spin: 16,
        pace: paced.then(|| storm.walks.clone()),
        ..Counters::default()
    };
    let returned = Arc::new(AtomicBool::new(false));
    let reg = {
        let (p, c, returned) = (p.clone(), c.clone(), returned.clone());
        let c = c.clone();
        let rh = rt.handle().clone();
        thread::spawn(move || {
            let _g = rh.enter();
            *c.on.lock().unwrap() = Some(thread::current().id());
            let out = p.try_complete_else_watch(Slow(c), Duration::from_secs(60), [1, 2]);
            returned.store(true, Ordering::SeqCst);
            out
        })
    };
    // The newcomer is being checked by the storm.
    wait_for("registration checked", 5, || {
        c.checks.load(Ordering::SeqCst) >= 2 || returned.load(Ordering::SeqCst)
    });
    thread::sleep(Duration::from_millis(100));
    let in_storm = returned.load(Ordering::SeqCst);
    let reg_checks = c.on_checks.load(Ordering::SeqCst);
    let reg_timeouts = c.pace_timeouts.load(Ordering::SeqCst);
    let checks_in_storm = c.checks.load(Ordering::SeqCst);
    match during {
        During::Nothing => {}
        During::Ready => c.ready.store(true, Ordering::SeqCst),
        During::Shutdown => drop(p.shutdown()),
        During::CancelForKey => drop(p.cancel_for_key(&2)),
    }
    let t_action = Instant::now();
    // Give the storm a while longer, then stop it.
    thread::sleep(Duration::from_millis(50));
    let before_stop = returned.load(Ordering::SeqCst);
    let t_stop = Instant::now();
    storm.stop(5);
    wait_for(
        &format!("{during:?} round {round}: registration returned after the storm"),
        5,
        || reg.is_finished(),
    );
    let after_stop = t_stop.elapsed();
    let out = reg.join().unwrap();
    let status = match out {
        Ok(h) => {
            let r = h.op_ref();
            let st = r.as_ref().map(|r| r.status());
            match during {
                During::Nothing => {
                    assert_eq!(st, Some(OperationStatus::Pending), "round {round}");
                    assert!(
                        h.cancel().is_some(),
                        "round {round}: pending, cancel takes it"
                    );
                }
                During::Ready => {
                    let o = rt
                        .block_on(tokio::time::timeout(Duration::from_secs(5), h))
                        .expect("resolves");
                    assert_eq!(o, Ok(Completion::Completed(1)), "round {round}");
                }
                During::Shutdown | During::CancelForKey => {
                    let o = rt
                        .block_on(tokio::time::timeout(Duration::from_secs(5), h))
                        .expect("resolves");
                    assert!(
                        matches!(
                            o,
                            Err(OperationError::Shutdown) | Err(OperationError::Cancelled)
                        ),
                        "{during:?} round {round}: {o:?}"
                    );
                }
            }
            format!("Ok({st:?})")
        }
        Err(WatchError::Shutdown(op)) if matches!(during, During::Shutdown) => {
            drop(op);
            "Err(Shutdown)".to_string()
        }
        Err(e) => panic!("{during:?} round {round}: refused {e:?}"),
    };
    wait_for("the newcomer accounted for", 5, || {
        c.drops.load(Ordering::SeqCst) == 1
    });
    assert_eq!(c.overlaps.load(Ordering::SeqCst), 0);
    h0.detach();
    drop(p.shutdown());
    let m = p.metrics();
    assert!(balanced(&m), "{during:?} round {round}: {m:?}");
    assert_eq!(m.delayed, 0);
    if round < 2 {
        eprintln!(
            "{during:?} paced {paced}: returned during storm: {in_storm} (checks {checks_in_storm}, \
             {reg_checks} on the registering thread, {reg_timeouts} paced checks saw no storm), \
             before stop {before_stop} ({:?} after the action), \
             returned {after_stop:?} after stop, {status}",
            t_stop - t_action
        );
    }
    drop(p);
    rt.shutdown_timeout(Duration::from_secs(5));
}

#[test]
fn registration_in_storm_returns_once_it_pauses() {
    for round in 0..5 {
        support::within(60, move || {
            register_in_storm(During::Nothing, false, round);
            register_in_storm(During::Nothing, true, round)
        });
    }
}

#[test]
fn registration_in_storm_made_ready() {
    for round in 0..5 {
        support::within(60, move || {
            register_in_storm(During::Ready, false, round);
            register_in_storm(During::Ready, true, round)
        });
    }
}

#[test]
fn registration_in_storm_shutdown() {
    for round in 0..5 {
        support::within(60, move || {
            register_in_storm(During::Shutdown, false, round);
            register_in_storm(During::Shutdown, true, round)
        });
    }
}

#[test]
fn registration_in_storm_cancel_for_key() {
    for round in 0..5 {
        support::within(60, move || {
            register_in_storm(During::CancelForKey, false, round);
            register_in_storm(During::CancelForKey, true, round)
        });
    }
}

/// An operation whose `n`-th check reads its flag, then signals and waits to
/// be released (bounded): an event arriving in between must re-run it.
struct Held {
    ready: Arc<AtomicBool>,
    checks: Arc<AtomicU64>,
    hold_at: u64,
    gate: std::sync::Mutex<Option<(std::sync::mpsc::Sender<()>, std::sync::mpsc::Receiver<()>)>>,
}

impl tokio_purgatory::Operation for Held {
    type Output = u64;
    fn try_complete(&mut self) -> Option<u64> {
        let n = self.checks.fetch_add(1, Ordering::SeqCst) + 1;
        let ready = self.ready.load(Ordering::SeqCst);
        if n == self.hold_at {
            if let Some((entered, release)) = self.gate.lock().unwrap().take() {
                let _ = entered.send(());
                let _ = release.recv_timeout(Duration::from_secs(20));
            }
        }
        ready.then_some(n)
    }
    fn on_expiration(self) -> u64 {
        0
    }
}

/// Deterministic: an event (flag set, key walked) from another thread while
/// the registration's second check (the first once watched) is held makes
/// the registration check again and complete, with no further event.
#[test]
fn event_during_registrations_second_check_is_not_lost() {
    support::within(30, || {
        let rt = support::multi();
        let _g = rt.enter();
        let p: Purgatory<u32, Held> = Purgatory::builder().name("held").build().unwrap();
        let ready = Arc::new(AtomicBool::new(false));
        let checks = Arc::new(AtomicU64::new(0));
        let (etx, erx) = std::sync::mpsc::channel();
        let (rtx, rrx) = std::sync::mpsc::channel();
        let op = Held {
            ready: ready.clone(),
            checks: checks.clone(),
            hold_at: 2,
            gate: std::sync::Mutex::new(Some((etx, rrx))),
        };
        let reg = {
            let p = p.clone();
            let rh = rt.handle().clone();
            thread::spawn(move || {
                let _g = rh.enter();
                p.try_complete_else_watch(op, Duration::from_secs(60), [1])
            })
        };
        erx.recv_timeout(Duration::from_secs(10)).unwrap();
        ready.store(true, Ordering::SeqCst);
        let n = p.try_complete_watched(&1);
        assert_eq!(n, 0, "the check is the registration's: a re-run is asked");
        rtx.send(()).unwrap();
        wait_for("registration returned", 5, || reg.is_finished());
        let h = reg.join().unwrap().expect("registered");
        let out = rt
            .block_on(tokio::time::timeout(Duration::from_secs(5), h))
            .expect("resolves with no further event");
        assert_eq!(out, Ok(Completion::Completed(3)));
        drop(p);
        rt.shutdown_timeout(Duration::from_secs(5));
    });
}
