//! The purge of the watch lists that an expiry or cancellation starts, as
//! the README's Guarantees and the crate docs' "Idle costs nothing" promise
//! it, on maps of more than 1,024 entries (`docs_promises.rs` and
//! `idle_purge.rs` have the small maps and the completions):
//!
//! - "other keys keep a tombstone ... until walked or purged (amortised, and
//!   at once when an expiry or cancellation leaves as many tombstones as
//!   live entries, and at least 16, or leaves nothing pending ...)": 2,000
//!   operations cancelled or expired beside one that stays pending leave no
//!   tombstone and no key of their own, at once and an hour later, though
//!   no registration or walk follows;
//! - the reaper "wakes once per distinct due time, and not at all while
//!   nothing is scheduled", and takes the rest of a wide purge "in turns of
//!   its own (woken once for them when a thread other than the reaper's
//!   left it idle)": wide cancellations by handle and by key (their handles
//!   dropped before the reaper has run, too) and wide expiries, wake-ups
//!   counted.

mod support;

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use tokio::time::advance;
use tokio_purgatory::Purgatory;

use support::{ms, settle, FlagOp as Op};

type P = Purgatory<u64, Op>;

fn never() -> Op {
    Op(Arc::new(AtomicBool::new(false)))
}

async fn run(n: u64, expire: bool) -> (usize, usize, usize) {
    let p: P = Purgatory::new();
    let keeper = p
        .try_complete_else_watch(never(), ms(100_000_000), [0])
        .unwrap();
    let timeout = if expire { ms(10) } else { ms(1_000_000) };
    // Each on a key of its own and on key 0 beside the keeper.
    let hs: Vec<_> = (0..n)
        .map(|i| {
            p.try_complete_else_watch(never(), timeout, [0, 1 + i])
                .unwrap()
        })
        .collect();
    if expire {
        for h in hs {
            h.detach();
        }
        advance(ms(11)).await;
    } else {
        drop(hs); // cancellations
    }
    settle().await;
    let at_once = p.metrics().tombstones;
    // An hour with nothing else happening.
    advance(ms(3_600_000)).await;
    settle().await;
    let m = p.metrics();
    drop(keeper);
    (at_once, m.tombstones, m.keys)
}

#[tokio::test(start_paused = true)]
async fn small_map_cancellation_purges_at_once() {
    // 400 operations, 800 tombstones, 1 live entry: within SMALL_LISTS.
    // The last few cancellations leave fewer than 16: those may stay.
    let (now, hour, keys) = run(400, false).await;
    assert!(
        now < 16 && hour < 16 && keys < 16,
        "{:?}",
        (now, hour, keys)
    );
}

#[tokio::test(start_paused = true)]
async fn large_map_cancellation_purges_at_once() {
    let (now, hour, keys) = run(2_000, false).await;
    assert_eq!(
        (now, hour, keys),
        (0, 0, 1),
        "2,000 cancellations left (tombstones at once, tombstones an hour later, keys) with \
         one live entry"
    );
}

#[tokio::test(start_paused = true)]
async fn large_map_expiry_purges_at_once() {
    let (now, hour, keys) = run(2_000, true).await;
    assert_eq!(
        (now, hour, keys),
        (0, 0, 1),
        "2,000 expiries left (tombstones at once, tombstones an hour later, keys) with one \
         live entry"
    );
}

const N: u64 = 5_000;

fn wakeups(p: &P) -> u64 {
    p.metrics().reaper_wakeups
}

/// Asserts that nothing is pending and the map is empty; the figures.
fn emptied(p: &P) -> tokio_purgatory::PurgatoryMetrics {
    let m = p.metrics();
    assert_eq!(
        (m.delayed, m.watched, m.tombstones, m.keys),
        (0, 0, 0, 0),
        "{m:?}"
    );
    m
}

/// After cancellations that left the reaper's alarm set for their timeouts
/// (1,000 s; `w0` wake-ups before them): at most one wake-up more at it (the
/// purge's turn may have cleared it), then none in an idle hour.
async fn the_alarm_then_an_idle_hour(p: &P, w0: u64) {
    advance(ms(1_000_001)).await;
    settle().await;
    let w1 = wakeups(p);
    assert!(w1 - w0 <= 2, "{:?}", p.metrics());
    advance(ms(3_600_000)).await;
    settle().await;
    assert_eq!(wakeups(p), w1, "an idle hour: {:?}", p.metrics());
}

fn register(p: &P, timeout: u64) -> Vec<tokio_purgatory::OperationHandle<u64, Op>> {
    (0..N)
        .map(|i| {
            p.try_complete_else_watch(never(), ms(timeout), [0, 1 + i])
                .unwrap()
        })
        .collect()
}

#[tokio::test(start_paused = true)]
async fn wide_cancellation_by_handles_costs_one_purge_wakeup_and_the_alarms() {
    let p: P = Purgatory::new();
    let hs = register(&p, 1_000_000);
    settle().await;
    let w0 = wakeups(&p);
    drop(hs);
    settle().await;
    let m = emptied(&p);
    assert_eq!(wakeups(&p) - w0, 1, "woken once for the purge: {m:?}");
    the_alarm_then_an_idle_hour(&p, w0).await;
}

#[tokio::test(start_paused = true)]
async fn wide_cancellation_by_key_costs_one_purge_wakeup_and_the_alarms() {
    let p: P = Purgatory::new();
    let hs = register(&p, 1_000_000);
    settle().await;
    let w0 = wakeups(&p);
    assert_eq!(p.cancel_for_key(&0).len(), N as usize);
    settle().await;
    drop(hs);
    settle().await;
    let m = emptied(&p);
    assert!(
        wakeups(&p) - w0 <= 1,
        "woken at most once for the purge: {} wake-ups from {w0}: {m:?}",
        wakeups(&p) - w0
    );
    the_alarm_then_an_idle_hour(&p, w0).await;
}

#[tokio::test(start_paused = true)]
async fn wide_expiry_is_purged_by_the_reaper_with_no_wakeup_added() {
    let p: P = Purgatory::new();
    for h in register(&p, 10) {
        h.detach();
    }
    settle().await;
    let w0 = wakeups(&p);
    advance(ms(11)).await;
    settle().await;
    let m = emptied(&p);
    assert_eq!(m.expired, N);
    assert_eq!(wakeups(&p) - w0, 1, "one due time, one wake-up: {m:?}");
    advance(ms(3_600_000)).await;
    settle().await;
    assert_eq!(wakeups(&p) - w0, 1, "an idle hour: {:?}", p.metrics());
}

/// As above, but the (already cancelled) handles are dropped right after
/// `cancel_for_key`, before the reaper's purge turn has run.
#[tokio::test(start_paused = true)]
async fn wide_cancellation_by_key_then_handles_dropped_costs_one_purge_wakeup() {
    let p: P = Purgatory::new();
    let hs = register(&p, 1_000_000);
    settle().await;
    let w0 = wakeups(&p);
    assert_eq!(p.cancel_for_key(&0).len(), N as usize);
    drop(hs);
    settle().await;
    let m = emptied(&p);
    assert!(
        wakeups(&p) - w0 <= 1,
        "woken at most once for the purge, no time passing: {} wake-ups: {m:?}",
        wakeups(&p) - w0
    );
}
