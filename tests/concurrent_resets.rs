//! Concurrent resets of one operation (handle.rs, `OpRef::reset`:
//! "Concurrent resets each move it; the last one to take effect sets the
//! deadline") and of one timer task (`TaskHandle::reset`). Real threads
//! reset one operation in a loop, each to deadlines of its own (all distinct,
//! 10 ms apart); after they stop, the operation must expire exactly once, at
//! the deadline of some thread's last reset (the last to take effect is one
//! of those), or at that of a final reset from the main thread, never at a
//! stale deadline; the timer must hold exactly one entry.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use tokio::time::Instant;
use tokio_purgatory::{Completion, OperationStatus, Purgatory, Timer};

mod support;
use support::{ms, settle};

#[derive(Clone, Default)]
struct Seen {
    expired_at: Arc<Mutex<Vec<Instant>>>,
    drops: Arc<AtomicUsize>,
}

struct Never(Seen);

impl tokio_purgatory::Operation for Never {
    type Output = Instant;
    fn try_complete(&mut self) -> Option<Instant> {
        None
    }
    fn on_expiration(self) -> Instant {
        let now = Instant::now();
        self.0.expired_at.lock().unwrap().push(now);
        now
    }
}

impl Drop for Never {
    fn drop(&mut self) {
        self.0.drops.fetch_add(1, Ordering::SeqCst);
    }
}

/// One reset as recorded by its thread: the order it returned in, the
/// deadline, and what it returned.
#[derive(Clone, Copy, Debug)]
struct Rec {
    seq: u64,
    thread: usize,
    deadline: Instant,
    ok: bool,
}

const THREADS: usize = 3;
/// The most resets one thread makes (it stops earlier, after `RACE`).
const PER: usize = 100_000;
/// How long the threads race.
const RACE: Duration = Duration::from_millis(30);
const STEP: Duration = Duration::from_millis(10);

/// The deadline of reset `i` of thread `t`: all distinct, `STEP` apart, 10 s
/// to 10 s + 3,000 s past `base`, in orders that cross the threads'.
fn deadline(base: Instant, t: usize, i: usize) -> Instant {
    // Thread 0 goes up, thread 1 down, thread 2 zig-zags.
    let k = match t {
        0 => i,
        1 => PER - 1 - i,
        _ => {
            if i.is_multiple_of(2) {
                i / 2
            } else {
                PER - 1 - i / 2
            }
        }
    };
    base + Duration::from_secs(10) + STEP * (k * THREADS + t) as u32
}

/// `THREADS` threads, entered into `h`'s runtime, reset through `reset`
/// (an `OpRef::reset_at` or `TaskHandle::reset_at`) at once; each record.
fn race(
    h: &tokio::runtime::Handle,
    base: Instant,
    reset: Arc<dyn Fn(Instant) -> bool + Send + Sync>,
) -> Vec<Rec> {
    let seq = Arc::new(AtomicU64::new(0));
    let go = Arc::new(std::sync::Barrier::new(THREADS + 1));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let (h, seq, go, reset) = (h.clone(), seq.clone(), go.clone(), reset.clone());
            let stop = stop.clone();
            thread::spawn(move || {
                let _g = h.enter();
                go.wait();
                let mut recs = Vec::with_capacity(PER);
                for i in 0..PER {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let d = deadline(base, t, i);
                    let ok = reset(d);
                    let s = seq.fetch_add(1, Ordering::SeqCst);
                    // Until another thread's reset has returned (at most
                    // 20 µs): the threads' resets interleave instead of one
                    // barging through the lock for a whole time slice.
                    let t0 = std::time::Instant::now();
                    while seq.load(Ordering::SeqCst) <= s + 1
                        && t0.elapsed() < Duration::from_micros(20)
                    {
                        std::hint::spin_loop();
                    }
                    recs.push(Rec {
                        seq: s,
                        thread: t,
                        deadline: d,
                        ok,
                    });
                }
                recs
            })
        })
        .collect();
    go.wait();
    thread::sleep(RACE);
    stop.store(true, Ordering::SeqCst);
    let t0 = std::time::Instant::now();
    let mut all = Vec::new();
    for th in threads {
        while !th.is_finished() {
            assert!(t0.elapsed() < Duration::from_secs(20), "resets stuck");
            thread::sleep(Duration::from_micros(500));
        }
        all.extend(th.join().unwrap());
    }
    all
}

/// How often consecutive returns (by sequence number) came from different
/// threads: how much the resets interleaved.
fn switches(recs: &[Rec]) -> usize {
    let mut by = recs.to_vec();
    by.sort_by_key(|r| r.seq);
    by.windows(2).filter(|w| w[0].thread != w[1].thread).count()
}

/// The candidates for "last to take effect": each thread's last reset that
/// returned true.
fn candidates(recs: &[Rec]) -> Vec<Rec> {
    (0..THREADS)
        .filter_map(|t| {
            recs.iter()
                .filter(|r| r.thread == t && r.ok)
                .max_by_key(|r| r.seq)
                .copied()
        })
        .collect()
}

/// Within a tick (100 µs) plus Tokio's 2 ms after `d`.
fn at(d: Instant, fired: Instant) -> bool {
    fired >= d && fired <= d + Duration::from_micros(2_100)
}

#[derive(Clone, Copy, Debug)]
enum Final {
    /// No final reset: the last raced one holds.
    None,
    /// A final reset before every raced deadline.
    Earlier,
    /// A final reset after every raced deadline.
    Later,
}

fn purgatory_race(fin: Final, run: usize) {
    let rt = support::paused();
    let _g = rt.enter();
    let p: Purgatory<u32, Never> = Purgatory::builder().name("resets").build().unwrap();
    let seen = Seen::default();
    let base = Instant::now();
    let h = p
        .try_complete_else_watch(Never(seen.clone()), Duration::from_secs(3600), [1])
        .unwrap();
    let r = h.op_ref().unwrap();
    let rr = r.clone();
    let recs = race(
        rt.handle(),
        base,
        Arc::new(move |d: Instant| rr.reset_at(d)),
    );
    assert!(
        recs.iter().all(|r| r.ok),
        "run {run}: a reset of a pending operation returned false"
    );
    let cands = candidates(&recs);
    let last_seq = cands.iter().max_by_key(|r| r.seq).unwrap();
    let expected: Option<Instant> = match fin {
        Final::None => None,
        Final::Earlier => Some(base + Duration::from_secs(5)),
        Final::Later => Some(base + Duration::from_secs(4_000)),
    };
    if let Some(d) = expected {
        assert!(r.reset_at(d), "run {run}: the final reset");
    }
    let end = base + Duration::from_secs(5_000);
    let out = rt.block_on(async {
        let out = tokio::time::timeout_at(end, h).await.expect("expired");
        // On past every raced deadline: nothing fires again.
        tokio::time::sleep_until(end).await;
        settle().await;
        out
    });
    let fired = match out {
        Ok(Completion::Expired(at)) => at,
        other => panic!("run {run}: {other:?}"),
    };
    let times = seen.expired_at.lock().unwrap().clone();
    assert_eq!(times.len(), 1, "run {run}: expired {times:?}");
    assert_eq!(seen.drops.load(Ordering::SeqCst), 1);
    assert_eq!(r.status(), OperationStatus::Expired);
    match expected {
        Some(d) => assert!(
            at(d, fired),
            "{fin:?} run {run}: expired {:?} after base, the final reset said {:?}",
            fired - base,
            d - base
        ),
        None => {
            let which = cands.iter().find(|c| at(c.deadline, fired));
            assert!(
                which.is_some(),
                "run {run}: expired {:?} after base, not at any thread's last reset {:?}",
                fired - base,
                cands
                    .iter()
                    .map(|c| (c.thread, c.deadline - base))
                    .collect::<Vec<_>>()
            );
            if run < 2 {
                eprintln!(
                    "expired at thread {}'s last reset; the last to return was thread {}'s; \
                     {} thread switches in {} resets",
                    which.unwrap().thread,
                    last_seq.thread,
                    switches(&recs),
                    recs.len()
                );
            }
        }
    }
    let m = p.metrics();
    assert_eq!((m.registered, m.expired, m.delayed), (1, 1, 0), "{m:?}");
    assert_eq!(p.lateness().count(), 1, "run {run}: one expiry sample");
    drop(r);
    drop(p);
}

#[test]
fn purgatory_concurrent_resets_last_holds() {
    for run in 0..4 {
        support::within(60, move || purgatory_race(Final::None, run));
    }
}

#[test]
fn purgatory_concurrent_resets_then_final_earlier() {
    for run in 0..4 {
        support::within(60, move || purgatory_race(Final::Earlier, run));
    }
}

#[test]
fn purgatory_concurrent_resets_then_final_later() {
    for run in 0..4 {
        support::within(60, move || purgatory_race(Final::Later, run));
    }
}

fn timer_race(fin: Final, repeating: bool, run: usize) {
    let rt = support::paused();
    let _g = rt.enter();
    let timer = Timer::builder().name("resets").build().unwrap();
    let ran: Arc<Mutex<Vec<Instant>>> = Arc::default();
    let base = Instant::now();
    let r2 = ran.clone();
    let t = Arc::new(if repeating {
        timer
            .schedule_repeating(Duration::from_secs(3600), move || {
                r2.lock().unwrap().push(Instant::now());
                None
            })
            .unwrap()
    } else {
        timer
            .schedule(Duration::from_secs(3600), move || {
                r2.lock().unwrap().push(Instant::now());
            })
            .unwrap()
    });
    let tt = t.clone();
    let recs = race(
        rt.handle(),
        base,
        Arc::new(move |d: Instant| tt.reset_at(d)),
    );
    assert!(recs.iter().all(|r| r.ok), "run {run}");
    assert_eq!(timer.len(), 1, "run {run}: entries after the race");
    if run == 0 {
        eprintln!(
            "timer {fin:?} repeating {repeating}: {} thread switches in {} resets",
            switches(&recs),
            recs.len()
        );
    }
    let cands = candidates(&recs);
    let expected: Option<Instant> = match fin {
        Final::None => None,
        Final::Earlier => Some(base + Duration::from_secs(5)),
        Final::Later => Some(base + Duration::from_secs(4_000)),
    };
    if let Some(d) = expected {
        assert!(t.reset_at(d));
        assert_eq!(timer.len(), 1);
    }
    rt.block_on(async {
        tokio::time::sleep_until(base + Duration::from_secs(5_000)).await;
        settle().await;
    });
    let ran = ran.lock().unwrap().clone();
    assert_eq!(ran.len(), 1, "{fin:?} run {run}: ran {ran:?}");
    let fired = ran[0];
    match expected {
        Some(d) => assert!(
            at(d, fired),
            "{fin:?} run {run}: ran {:?} after base, final reset {:?}",
            fired - base,
            d - base
        ),
        None => assert!(
            cands.iter().any(|c| at(c.deadline, fired)),
            "run {run}: ran {:?} after base, not at a thread's last reset",
            fired - base
        ),
    }
    assert_eq!(timer.len(), 0);
    let m = timer.metrics();
    assert_eq!(m.expired, 1, "{m:?}");
}

#[test]
fn timer_concurrent_resets() {
    for run in 0..3 {
        for fin in [Final::None, Final::Earlier, Final::Later] {
            for rep in [false, true] {
                support::within(60, move || timer_race(fin, rep, run));
            }
        }
    }
}

/// On real time, with the reaper awake: threads reset for a while to
/// deadlines 40-200 ms out, then the main thread resets to 300 ms out. The
/// operation expires once, not before that, and not long after.
#[test]
fn purgatory_concurrent_resets_real_time() {
    for run in 0..5 {
        support::within(60, move || {
            let rt = support::multi();
            let _g = rt.enter();
            let p: Purgatory<u32, Never> = Purgatory::builder().name("rt").build().unwrap();
            let seen = Seen::default();
            let h = p
                .try_complete_else_watch(Never(seen.clone()), Duration::from_secs(3600), [1])
                .unwrap();
            let r = Arc::new(h.op_ref().unwrap());
            let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let threads: Vec<_> = (0..THREADS)
                .map(|t| {
                    let (r, stop) = (r.clone(), stop.clone());
                    let hh = rt.handle().clone();
                    thread::spawn(move || {
                        let _g = hh.enter();
                        let mut rng = support::rng::Rng(run as u64 * 31 + t as u64 + 1);
                        let mut n = 0;
                        while !stop.load(Ordering::Relaxed) && n < 200_000 {
                            assert!(r.reset(ms(40 + rng.below(160))), "pending: moved");
                            n += 1;
                        }
                        n
                    })
                })
                .collect();
            thread::sleep(Duration::from_millis(15));
            stop.store(true, Ordering::SeqCst);
            let mut total = 0;
            for th in threads {
                total += th.join().unwrap();
            }
            let set = Instant::now();
            let d = set + ms(300);
            assert!(
                r.reset_at(d),
                "run {run}: final reset (after {total} raced)"
            );
            let out = rt
                .block_on(tokio::time::timeout(Duration::from_secs(5), h))
                .expect("expires");
            let fired = match out {
                Ok(Completion::Expired(at)) => at,
                other => panic!("{other:?}"),
            };
            assert!(
                fired >= d,
                "run {run}: expired {:?} before the final reset's deadline (a stale entry)",
                d - fired
            );
            thread::sleep(Duration::from_millis(50));
            assert_eq!(seen.expired_at.lock().unwrap().len(), 1);
            assert_eq!(seen.drops.load(Ordering::SeqCst), 1);
            let m = p.metrics();
            assert_eq!((m.registered, m.expired, m.delayed), (1, 1, 0), "{m:?}");
            drop(p);
            rt.shutdown_timeout(Duration::from_secs(5));
        });
    }
}

/// A reset into the past racing the expiry it causes (`OpRef::reset`:
/// "either the reset wins and the operation expires at the new deadline
/// only, or the expiry wins and the reset returns `false`"): every operation
/// has an hour left and nothing else finishes it, so one that expires did so
/// at the deadline a reset set, and that reset must have returned `true`.
/// Two real threads reset 30,000 operations each round, into the past, with
/// a 10 µs tick and one timer shard so that the reaper fires them while the
/// resets still run.
mod reset_into_the_past {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    use tokio::time::Instant;
    use tokio_purgatory::{Operation, OperationStatus, Purgatory};

    use super::support::within;

    struct Never;
    impl Operation for Never {
        type Output = ();
        fn try_complete(&mut self) -> Option<()> {
            None
        }
        fn on_expiration(self) {}
    }

    fn round(n: usize) -> (usize, usize) {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let _g = rt.enter();
        let p: Purgatory<u32, Never> = Purgatory::builder()
            .name("reset")
            .tick(Duration::from_micros(10))
            .timer_shards(1)
            .build()
            .unwrap();
        let mut refs = Vec::with_capacity(n);
        for i in 0..n {
            let h = p
                .try_complete_else_watch(Never, Duration::from_secs(3600), [i as u32])
                .unwrap();
            refs.push(h.into_op_ref().unwrap());
        }
        let refs = Arc::new(refs);
        let false_then_expired = Arc::new(AtomicUsize::new(0));
        let trues = Arc::new(AtomicUsize::new(0));
        let threads: Vec<_> = (0..2)
            .map(|t| {
                let (refs, fte, trues) = (refs.clone(), false_then_expired.clone(), trues.clone());
                let h = rt.handle().clone();
                std::thread::spawn(move || {
                    let _g = h.enter();
                    for (i, r) in refs.iter().enumerate() {
                        if i % 2 != t {
                            continue;
                        }
                        assert_eq!(r.status(), OperationStatus::Pending);
                        let moved = r.reset_at(Instant::now() - Duration::from_millis(1));
                        if moved {
                            trues.fetch_add(1, Ordering::SeqCst);
                        } else {
                            // Bounded wait for the finish.
                            let t0 = std::time::Instant::now();
                            while r.status() == OperationStatus::Pending {
                                assert!(t0.elapsed() < Duration::from_secs(5));
                                std::thread::yield_now();
                            }
                            if r.status() == OperationStatus::Expired {
                                fte.fetch_add(1, Ordering::SeqCst);
                            }
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        // Everything was reset into the past: all expire, bounded.
        let t0 = std::time::Instant::now();
        while p.delayed() > 0 {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "stuck: {:?}",
                p.metrics()
            );
            std::thread::yield_now();
        }
        let m = p.metrics();
        assert_eq!(m.expired as usize, n);
        drop(p);
        rt.shutdown_timeout(Duration::from_secs(5));
        (
            false_then_expired.load(Ordering::SeqCst),
            trues.load(Ordering::SeqCst),
        )
    }

    #[test]
    fn a_reset_into_the_past_whose_operation_expired_returned_true() {
        let rounds = within(240, || (0..6).map(|_| round(30_000)).collect::<Vec<_>>());
        let bad = rounds.iter().filter(|r| r.0 > 0).count();
        assert_eq!(
            bad,
            0,
            "{bad} of {} rounds: resets returned false though nothing but the reset could \
             expire the operation: {rounds:?}",
            rounds.len()
        );
    }
}
