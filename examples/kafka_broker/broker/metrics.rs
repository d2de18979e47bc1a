//! The broker's metrics in Prometheus' text format, served over HTTP on
//! `--metrics-addr`: the produce, fetch, join and sync purgatories' snapshots (gauges, counters, checks per
//! kind of walk, the reaper's turns) and their expiry lateness as Prometheus
//! histograms, with the broker's own counts. Built from the crate's snapshots,
//! so it needs no exporter crate.

use std::fmt::Write;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_purgatory::{Histogram, PurgatoryMetrics};
use tokio_util::sync::CancellationToken;

use super::Broker;

/// A metric read off a snapshot: its name, its help text, and the reading.
type Field<T> = (&'static str, &'static str, fn(&PurgatoryMetrics) -> T);

/// The metrics page.
pub fn render(broker: &Broker) -> String {
    let mut out = String::new();
    let purgatories = [
        (
            "produce",
            broker.produces.metrics(),
            broker.produces.lateness(),
        ),
        ("fetch", broker.fetches.metrics(), broker.fetches.lateness()),
        (
            "join",
            broker.groups.joins.metrics(),
            broker.groups.joins.lateness(),
        ),
        (
            "sync",
            broker.groups.syncs.metrics(),
            broker.groups.syncs.lateness(),
        ),
    ];
    let gauges: [Field<f64>; 4] = [
        (
            "delayed",
            "Operations pending (Kafka's NumDelayedOperations).",
            |m| m.delayed as f64,
        ),
        (
            "watched",
            "Watch-list entries, tombstones included (Kafka's PurgatorySize).",
            |m| m.watched as f64,
        ),
        (
            "tombstones",
            "Entries of finished operations not yet removed.",
            |m| m.tombstones as f64,
        ),
        ("keys", "Keys with a watch list.", |m| m.keys as f64),
    ];
    for (name, help, get) in gauges {
        family(&mut out, &format!("tokio_purgatory_{name}"), "gauge", help);
        for (p, m, _) in &purgatories {
            let _ = writeln!(out, "tokio_purgatory_{name}{{name=\"{p}\"}} {}", get(m));
        }
    }
    let counters: [Field<u64>; 9] = [
        ("registered", "Operations registered.", |m| m.registered),
        ("completed", "Operations completed by a check.", |m| {
            m.completed
        }),
        ("expired", "Operations finished by their timeout.", |m| {
            m.expired
        }),
        ("cancelled", "Operations cancelled.", |m| m.cancelled),
        ("handed_back", "Operations handed back at shutdown.", |m| {
            m.handed_back
        }),
        ("purged", "Tombstones removed by the purge.", |m| m.purged),
        ("panicked", "Panics caught in user code.", |m| m.panicked),
        ("reaper_wakeups", "Reaper wake-ups.", |m| m.reaper_wakeups),
        ("reaper_turns", "Reaper turns.", |m| m.reaper.turns),
    ];
    for (name, help, get) in counters {
        family(
            &mut out,
            &format!("tokio_purgatory_{name}_total"),
            "counter",
            help,
        );
        for (p, m, _) in &purgatories {
            let _ = writeln!(
                out,
                "tokio_purgatory_{name}_total{{name=\"{p}\"}} {}",
                get(m)
            );
        }
    }
    for (metric, help) in [
        ("walks", "Walks, per kind."),
        ("checks", "Checks asked for by walks, per kind."),
        (
            "checks_completed",
            "Checks that completed their operation, per kind.",
        ),
    ] {
        family(
            &mut out,
            &format!("tokio_purgatory_{metric}_total"),
            "counter",
            help,
        );
        for (p, m, _) in &purgatories {
            let c = &m.checks;
            for (walk, w) in [
                ("key", c.key_walks),
                ("level", c.level_advances),
                ("reference", c.by_reference),
            ] {
                let v = match metric {
                    "walks" => w.walks,
                    "checks" => w.checked,
                    _ => w.completed,
                };
                let _ = writeln!(
                    out,
                    "tokio_purgatory_{metric}_total{{name=\"{p}\",walk=\"{walk}\"}} {v}"
                );
            }
        }
    }
    family(
        &mut out,
        "tokio_purgatory_refused_total",
        "counter",
        "Registrations refused and handed back, per reason.",
    );
    for (p, m, _) in &purgatories {
        let r = &m.refused;
        for (reason, v) in [
            ("at_capacity", r.at_capacity),
            ("shutdown", r.shutdown),
            ("reaper_gone", r.reaper_gone),
            ("draining", r.draining),
            ("no_keys", r.no_keys),
        ] {
            let _ = writeln!(
                out,
                "tokio_purgatory_refused_total{{name=\"{p}\",reason=\"{reason}\"}} {v}"
            );
        }
    }
    family(
        &mut out,
        "tokio_purgatory_reaper_busy_seconds_total",
        "counter",
        "Time the reaper's turns took, summed.",
    );
    for (p, m, _) in &purgatories {
        let _ = writeln!(
            out,
            "tokio_purgatory_reaper_busy_seconds_total{{name=\"{p}\"}} {}",
            m.reaper.busy.as_secs_f64()
        );
    }
    family(
        &mut out,
        "tokio_purgatory_lateness_seconds",
        "histogram",
        "How late each expiry fired, from its deadline.",
    );
    for (p, _, lateness) in &purgatories {
        histogram(&mut out, "tokio_purgatory_lateness_seconds", p, lateness);
    }
    let sessions = broker.groups.sessions.metrics();
    family(
        &mut out,
        "broker_group_sessions_expired_total",
        "counter",
        "Group members whose session timed out.",
    );
    let _ = writeln!(
        out,
        "broker_group_sessions_expired_total {}",
        sessions.expired
    );
    let s = &broker.stats;
    for (name, help, v) in [
        ("requests", "Requests decoded.", &s.requests),
        (
            "connections_refused",
            "Connections closed for a bad or slow frame, or idleness.",
            &s.connections_refused,
        ),
        (
            "batches_refused",
            "Partitions of produces refused for a corrupt, invalid or oversized batch.",
            &s.batches_refused,
        ),
        (
            "produces_timed_out",
            "acks=all produces that timed out.",
            &s.produces_timed_out,
        ),
    ] {
        family(&mut out, &format!("broker_{name}_total"), "counter", help);
        let _ = writeln!(out, "broker_{name}_total {}", v.load(Ordering::Relaxed));
    }
    family(
        &mut out,
        "broker_request_memory_bytes",
        "gauge",
        "Request memory held now.",
    );
    let _ = writeln!(
        out,
        "broker_request_memory_bytes {}",
        broker.budget.in_use()
    );
    family(
        &mut out,
        "broker_log_bytes",
        "gauge",
        "What the logs hold now (at most --max-log-bytes), each batch with what keeping it costs.",
    );
    let _ = writeln!(out, "broker_log_bytes {}", broker.topics.log_bytes());
    family(
        &mut out,
        "broker_connections",
        "gauge",
        "Connections open now (at most --max-connections).",
    );
    let _ = writeln!(out, "broker_connections {}", broker.open_connections());
    out
}

fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

/// A Prometheus histogram: cumulative buckets at the snapshot's bucket
/// bounds, `+Inf`, the sum and the count.
fn histogram(out: &mut String, name: &str, label: &str, h: &Histogram) {
    let mut seen = 0;
    for (upper, count) in h.buckets() {
        seen += count;
        // A bucket's bound is inclusive to the microsecond: `le` is its end.
        let le = (upper + Duration::from_micros(1)).as_secs_f64();
        let _ = writeln!(out, "{name}_bucket{{name=\"{label}\",le=\"{le}\"}} {seen}");
    }
    let _ = writeln!(
        out,
        "{name}_bucket{{name=\"{label}\",le=\"+Inf\"}} {}",
        h.count()
    );
    let _ = writeln!(
        out,
        "{name}_sum{{name=\"{label}\"}} {}",
        h.sum().as_secs_f64()
    );
    let _ = writeln!(out, "{name}_count{{name=\"{label}\"}} {}", h.count());
}

/// The most metrics connections open at once: each is answered within
/// seconds, so a scraper never waits long for a place.
pub const METRICS_CONNECTIONS: usize = 16;

/// Serves the metrics page to any HTTP request until `stop`, at most
/// [`METRICS_CONNECTIONS`] at once (more wait in the listen backlog), and
/// pausing after an accept that fails as the broker's listener does
/// ([`super::server::accept_loop`]).
pub async fn serve(listener: TcpListener, broker: Arc<Broker>, stop: CancellationToken) {
    let places = Arc::new(tokio::sync::Semaphore::new(METRICS_CONNECTIONS));
    super::server::accept_loop(listener, places, stop, move |conn, place| {
        let broker = broker.clone();
        async move {
            answer(conn, broker).await;
            drop(place);
        }
    })
    .await
}

/// Reads a request's head (at most 8 KiB, within 5 s) and answers with the
/// page, whatever the path.
async fn answer(mut conn: TcpStream, broker: Arc<Broker>) {
    let mut head = Vec::with_capacity(1024);
    let read = async {
        let mut buf = [0u8; 1024];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 8192 {
            match conn.read(&mut buf).await {
                Ok(0) | Err(_) => return false,
                Ok(n) => head.extend_from_slice(&buf[..n]),
            }
        }
        true
    };
    if !matches!(
        tokio::time::timeout(Duration::from_secs(5), read).await,
        Ok(true)
    ) {
        return;
    }
    let body = render(&broker);
    let reply = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = tokio::time::timeout(Duration::from_secs(5), conn.write_all(reply.as_bytes())).await;
}
