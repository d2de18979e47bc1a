//! The `metrics` feature: every metric reaches an installed recorder with its
//! labels, counters and gauges with the snapshot's values, and one lateness
//! sample per expiry. Run by `cargo test --all-features`.

use std::time::Duration;

use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use tokio_purgatory::{Operation, Purgatory, Timer};

mod support;
use support::recorded::{collect, Histograms};

struct Op;

impl Operation for Op {
    type Output = ();
    fn try_complete(&mut self) -> Option<()> {
        None
    }
    fn on_expiration(self) {}
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn every_metric_reaches_the_recorder_with_its_labels() {
    let recorder = DebuggingRecorder::new();
    let (p, timer) = metrics::with_local_recorder(&recorder, || {
        let p: Purgatory<u32, Op> = Purgatory::builder().name("produce").build().unwrap();
        let timer = Timer::builder().name("retries").build().unwrap();
        (p, timer)
    });
    let handles: Vec<_> = (0..3)
        .map(|i| {
            p.try_complete_else_watch(Op, Duration::from_millis(10), [i])
                .unwrap()
        })
        .collect();
    let _pending = p
        .try_complete_else_watch(Op, Duration::from_secs(60), [7])
        .unwrap();
    assert_eq!(p.try_complete_watched(&7), 0);
    // A refusal: handed back, counted under its reason.
    assert!(p
        .try_complete_else_watch(Op, Duration::from_secs(1), Vec::<u32>::new())
        .is_err());
    timer.schedule(Duration::from_millis(5), || {}).unwrap();
    tokio::time::advance(Duration::from_millis(14)).await;
    for h in handles {
        assert!(h.await.unwrap().is_expired());
    }
    tokio::task::yield_now().await;
    metrics::with_local_recorder(&recorder, || {
        p.record_metrics();
        timer.record_metrics();
    });
    let got = collect(&recorder);
    let pl = "kind=purgatory,name=produce";
    let tl = "kind=timer,name=retries";
    let counter = |k: &str| match got.get(k) {
        Some(DebugValue::Counter(v)) => *v,
        other => panic!("{k}: {other:?} in {:?}", got.keys()),
    };
    let gauge = |k: &str| match got.get(k) {
        Some(DebugValue::Gauge(v)) => v.into_inner(),
        other => panic!("{k}: {other:?} in {:?}", got.keys()),
    };
    assert_eq!(gauge(&format!("tokio_purgatory_delayed{{{pl}}}")), 1.0);
    assert!(gauge(&format!("tokio_purgatory_keys{{{pl}}}")) >= 1.0);
    assert_eq!(
        counter(&format!("tokio_purgatory_registered_total{{{pl}}}")),
        4
    );
    assert_eq!(
        counter(&format!("tokio_purgatory_expired_total{{{pl}}}")),
        3
    );
    assert_eq!(
        counter(&format!("tokio_purgatory_completed_total{{{pl}}}")),
        0
    );
    assert_eq!(
        counter(&format!("tokio_purgatory_walks_total{{{pl},walk=key}}")),
        1
    );
    assert_eq!(
        counter(&format!("tokio_purgatory_checks_total{{{pl},walk=key}}")),
        1
    );
    assert_eq!(
        gauge(&format!("tokio_purgatory_reaper_largest_batch{{{pl}}}")),
        3.0
    );
    assert_eq!(
        gauge(&format!("tokio_purgatory_timer_pending{{{tl}}}")),
        0.0
    );
    assert_eq!(
        counter(&format!("tokio_purgatory_timer_expired_total{{{tl}}}")),
        1
    );
    for name in [
        "tokio_purgatory_watched",
        "tokio_purgatory_tombstones",
        "tokio_purgatory_cells",
        "tokio_purgatory_reaper_busy_seconds",
        "tokio_purgatory_reaper_longest_turn_seconds",
    ] {
        gauge(&format!("{name}{{{pl}}}"));
    }
    for name in [
        "tokio_purgatory_cancelled_total",
        "tokio_purgatory_handed_back_total",
        "tokio_purgatory_purged_total",
        "tokio_purgatory_panicked_total",
        "tokio_purgatory_reaper_wakeups_total",
        "tokio_purgatory_reaper_turns_total",
    ] {
        counter(&format!("{name}{{{pl}}}"));
    }
    for walk in ["key", "level", "reference"] {
        counter(&format!(
            "tokio_purgatory_checks_completed_total{{{pl},walk={walk}}}"
        ));
    }
    for (reason, n) in [
        ("at_capacity", 0),
        ("shutdown", 0),
        ("reaper_gone", 0),
        ("draining", 0),
        ("no_keys", 1),
    ] {
        let k = format!("tokio_purgatory_refused_total{{{pl},reason={reason}}}");
        assert_eq!(counter(&k), n, "{k}");
        // A timer refuses only at the limit, shut down or with its reaper gone.
        let k = format!("tokio_purgatory_refused_total{{{tl},reason={reason}}}");
        match reason {
            "draining" | "no_keys" => assert!(!got.contains_key(&k), "{k}"),
            _ => assert_eq!(counter(&k), 0, "{k}"),
        }
    }
    // Lateness: one sample per expiry, recorded live, 4 ms each for the
    // purgatory's three (deadline 10 ms, taken out at 14 ms) and 9 ms for
    // the timer's task.
    let samples = |k: String| match got.get(&k) {
        Some(DebugValue::Histogram(samples)) => {
            samples.iter().map(|x| x.into_inner()).collect::<Vec<f64>>()
        }
        other => panic!("{k}: {other:?}"),
    };
    assert_eq!(
        samples(format!("tokio_purgatory_lateness_seconds{{{pl}}}")),
        [0.004; 3]
    );
    assert_eq!(
        samples(format!("tokio_purgatory_lateness_seconds{{{tl}}}")),
        [0.009]
    );
}

/// Histograms that panic when they record: the application's code, which
/// the reaper runs at each expiry.
struct PanickingHistogram;

impl metrics::HistogramFn for PanickingHistogram {
    fn record(&self, _: f64) {
        panic!("hostile recorder");
    }
}

/// The lateness histogram is recorded on the reaper at each expiry: a
/// recorder that panics there stops no expiry (each is counted as a caught
/// panic) and does not end the reaper.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_recorder_that_panics_stops_no_expiry() {
    let panicking =
        Histograms(|| metrics::Histogram::from_arc(std::sync::Arc::new(PanickingHistogram)));
    let p = metrics::with_local_recorder(&panicking, || {
        Purgatory::<u32, Op>::builder()
            .name("hostile")
            .build()
            .unwrap()
    });
    let handles: Vec<_> = (0..3)
        .map(|i| {
            p.try_complete_else_watch(Op, Duration::from_millis(10), [i])
                .unwrap()
        })
        .collect();
    tokio::time::advance(Duration::from_millis(11)).await;
    for h in handles {
        let out = tokio::time::timeout(Duration::from_secs(60), h).await;
        assert!(out.expect("resolved").unwrap().is_expired());
    }
    let m = p.metrics();
    assert_eq!((m.expired, m.panicked), (3, 3), "{m:?}");
    // The reaper goes on.
    let later = p
        .try_complete_else_watch(Op, Duration::from_millis(10), [9])
        .unwrap();
    tokio::time::advance(Duration::from_millis(11)).await;
    let out = tokio::time::timeout(Duration::from_secs(60), later).await;
    assert!(out.expect("resolved").unwrap().is_expired());
}
