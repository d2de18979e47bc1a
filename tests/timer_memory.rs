//! README, Guarantees, "Memory is freed at completion": "... a drained wheel
//! gives its slab back." Pinned only by the wheel's unit tests; here through
//! the public `Timer`, bursts drained every way (expired, cancelled, sleeps
//! and timeouts dropped, reset then expired), the live heap counted
//! process-wide (one test function, its cases in turn).

mod support;

use std::time::Duration;

use tokio::time::advance;
use tokio_purgatory::Timer;

use support::{alloc, ms, settle};

#[global_allocator]
static GLOBAL: alloc::Counting = alloc::Counting;

const BURST: usize = 100_000;

async fn drain_case(name: &str, t: &Timer, f: impl AsyncFnOnce(&Timer)) -> Result<(), String> {
    // Warm: one round first (buffers that are kept by design), then measure.
    let before = alloc::live_bytes();
    f(t).await;
    settle().await;
    advance(ms(1)).await;
    settle().await;
    let kept = alloc::live_bytes() - before;
    assert_eq!(t.len(), 0, "{name}");
    if kept < 64 * 1024 {
        Ok(())
    } else {
        Err(format!(
            "{name}: a drained timer keeps {kept} B after a burst of {BURST}"
        ))
    }
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_drained_timer_gives_its_room_back() {
    let t = Timer::new();
    // One small task first, so that the reaper and its fixed buffers exist.
    t.schedule(ms(1), || {}).unwrap();
    advance(ms(2)).await;
    settle().await;
    let mut failures = Vec::new();
    let cases: Vec<(&str, u8)> = vec![
        ("expired", 0),
        ("cancelled", 1),
        ("sleeps dropped", 2),
        ("reset later then expired", 3),
        ("expired spread over many ticks", 4),
    ];
    for (name, which) in cases {
        let r = drain_case(name, &t, async |t: &Timer| match which {
            0 => {
                let hs: Vec<_> = (0..BURST)
                    .map(|_| t.schedule(ms(10), || {}).unwrap())
                    .collect();
                drop(hs);
                advance(ms(11)).await;
                settle().await;
            }
            1 => {
                let hs: Vec<_> = (0..BURST)
                    .map(|_| t.schedule(ms(10_000), || {}).unwrap())
                    .collect();
                for h in &hs {
                    assert!(h.cancel());
                }
                drop(hs);
            }
            2 => {
                let sleeps: Vec<_> = (0..BURST).map(|_| t.sleep(ms(10_000))).collect();
                settle().await;
                drop(sleeps);
            }
            3 => {
                let hs: Vec<_> = (0..BURST)
                    .map(|_| t.schedule(ms(10), || {}).unwrap())
                    .collect();
                for h in &hs {
                    assert!(h.reset(ms(20)));
                }
                drop(hs);
                advance(ms(25)).await;
                settle().await;
            }
            _ => {
                let hs: Vec<_> = (0..BURST)
                    .map(|i| {
                        t.schedule(Duration::from_micros(100 * (i as u64 % 5000) + 100), || {})
                            .unwrap()
                    })
                    .collect();
                drop(hs);
                for _ in 0..60 {
                    advance(ms(10)).await;
                    settle().await;
                }
            }
        })
        .await;
        if let Err(e) = r {
            failures.push(e);
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
