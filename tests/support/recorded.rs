//! What a `metrics_util` debugging recorder holds, read by the tests of the
//! `metrics` feature.

use std::collections::BTreeMap;

use metrics_util::debugging::{DebugValue, DebuggingRecorder};

/// Each metric as `name{label=value,...}` (labels sorted) with its value.
pub fn collect(recorder: &DebuggingRecorder) -> BTreeMap<String, DebugValue> {
    recorder
        .snapshotter()
        .snapshot()
        .into_vec()
        .into_iter()
        .map(|(key, _, _, value)| {
            let key = key.key();
            let mut labels: Vec<String> = key
                .labels()
                .map(|l| format!("{}={}", l.key(), l.value()))
                .collect();
            labels.sort();
            (format!("{}{{{}}}", key.name(), labels.join(",")), value)
        })
        .collect()
}

/// The `describe_*` methods of a `metrics::Recorder` that keeps no
/// descriptions (the trait has no defaults for them), written inside the
/// `impl`.
#[cfg(feature = "metrics")]
macro_rules! no_descriptions {
    () => {
        fn describe_counter(
            &self,
            _: metrics::KeyName,
            _: Option<metrics::Unit>,
            _: metrics::SharedString,
        ) {
        }
        fn describe_gauge(
            &self,
            _: metrics::KeyName,
            _: Option<metrics::Unit>,
            _: metrics::SharedString,
        ) {
        }
        fn describe_histogram(
            &self,
            _: metrics::KeyName,
            _: Option<metrics::Unit>,
            _: metrics::SharedString,
        ) {
        }
    };
}
#[cfg(feature = "metrics")]
#[allow(unused_imports)] // used by some of the test binaries only
pub(crate) use no_descriptions;

/// A recorder of the `metrics` facade whose counters and gauges record
/// nothing and whose histograms `make` makes: the application's own code,
/// hostile as a test wants it.
#[cfg(feature = "metrics")]
pub struct Histograms<F>(pub F);

#[cfg(feature = "metrics")]
impl<F: Fn() -> metrics::Histogram + Send + Sync + 'static> metrics::Recorder for Histograms<F> {
    no_descriptions!();
    fn register_counter(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        metrics::Counter::noop()
    }
    fn register_gauge(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        metrics::Gauge::noop()
    }
    fn register_histogram(
        &self,
        _: &metrics::Key,
        _: &metrics::Metadata<'_>,
    ) -> metrics::Histogram {
        (self.0)()
    }
}
