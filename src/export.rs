//! Reporting through the `metrics` facade (the `metrics` feature): every
//! metric carries the labels `kind` (`"purgatory"` or `"timer"`) and `name`
//! (the name given to the builder).

use std::time::Duration;

/// The lateness histogram's name.
pub(crate) const LATENESS: &str = "tokio_purgatory_lateness_seconds";

/// One purgatory's or timer's labels.
pub(crate) struct Labels<'a> {
    pub(crate) kind: &'static str,
    pub(crate) name: &'a str,
}

impl Labels<'_> {
    fn pairs(&self) -> [(&'static str, String); 2] {
        [
            ("kind", self.kind.to_owned()),
            ("name", self.name.to_owned()),
        ]
    }

    /// Sets counter `metric` to `value` (counts only grow).
    pub(crate) fn counter(&self, metric: &'static str, value: u64) {
        metrics::counter!(metric, &self.pairs()).absolute(value);
    }

    /// Sets counter `metric` of walks of kind `walk` to `value`.
    pub(crate) fn walk_counter(&self, metric: &'static str, walk: &'static str, value: u64) {
        let [kind, name] = self.pairs();
        metrics::counter!(metric, &[kind, name, ("walk", walk.to_owned())]).absolute(value);
    }

    /// Sets `tokio_purgatory_refused_total` of each reason given (label
    /// `reason`) to its count.
    pub(crate) fn refused(&self, reasons: &[(&'static str, u64)]) {
        for &(reason, value) in reasons {
            let [kind, name] = self.pairs();
            metrics::counter!(
                "tokio_purgatory_refused_total",
                &[kind, name, ("reason", reason.to_owned())]
            )
            .absolute(value);
        }
    }

    /// Sets gauge `metric` to `value`.
    pub(crate) fn gauge(&self, metric: &'static str, value: f64) {
        metrics::gauge!(metric, &self.pairs()).set(value);
    }

    /// The lateness histogram's handle, bound to the recorder installed now.
    pub(crate) fn lateness(&self) -> metrics::Histogram {
        metrics::histogram!(LATENESS, &self.pairs())
    }

    /// The reaper's figures, common to purgatories and timers.
    pub(crate) fn reaper(&self, r: &crate::ReaperMetrics, wakeups: u64) {
        self.counter("tokio_purgatory_reaper_wakeups_total", wakeups);
        self.counter("tokio_purgatory_reaper_turns_total", r.turns);
        self.gauge("tokio_purgatory_reaper_busy_seconds", secs(r.busy));
        self.gauge(
            "tokio_purgatory_reaper_longest_turn_seconds",
            secs(r.longest_turn),
        );
        self.gauge(
            "tokio_purgatory_reaper_largest_batch",
            r.largest_batch as f64,
        );
    }
}

pub(crate) fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}
