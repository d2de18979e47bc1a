//! Driving runs in processes of their own, their result rows, the summary
//! tables and the sweep charts.

use super::*;

// ---------------------------------------------------------------- driving runs

pub(crate) fn single(o: &Opts) -> RunResult {
    let rt = if o.runtime == Runtime::Current {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
    }
    .unwrap();
    rt.block_on(run(o.clone()))
}

pub(crate) const COLUMNS: &str = "impl\tmode\truntime\tgenerators\telapsed_ms\ttarget_rate\tactual_rate\tcpu_ms\tpeak_rss_mb\tcompleted\texpired\tlate_p50_ms\tlate_p99_ms\tlate_max_ms\tlag_p99_ms\tdriver_lag_p99_ms";

pub(crate) fn row(o: &Opts, r: &RunResult) -> String {
    format!(
        "{}\t{}\t{}\t{}\t{}\t{:.0}\t{:.0}\t{}\t{:.1}\t{}\t{}\t{:.2}\t{:.2}\t{:.2}\t{:.2}\t{:.2}",
        name(&o.imp),
        name(&o.mode),
        name(&o.runtime),
        o.generators,
        r.elapsed_ms,
        r.target_rate,
        r.actual_rate,
        r.cpu_ms,
        r.rss_mb,
        r.completed,
        r.expired,
        r.p50,
        r.p99,
        r.max,
        r.lag_p99,
        r.driver_lag_p99
    )
}

/// A result row read back from a child's output.
#[derive(Debug, Clone)]
pub(crate) struct Row {
    pub(crate) imp: String,
    pub(crate) target_rate: f64,
    pub(crate) actual_rate: f64,
    pub(crate) cpu_ms: f64,
    pub(crate) rss_mb: f64,
    pub(crate) completed: f64,
    pub(crate) expired: f64,
    pub(crate) p99: f64,
    pub(crate) lag_p99: f64,
    pub(crate) driver_lag_p99: f64,
}

pub(crate) fn parse_row(line: &str) -> Option<Row> {
    let f: Vec<&str> = line.split('\t').collect();
    let n = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok());
    Some(Row {
        imp: f.first()?.to_string(),
        target_rate: n(5)?,
        actual_rate: n(6)?,
        cpu_ms: n(7)?,
        rss_mb: n(8)?,
        completed: n(9)?,
        expired: n(10)?,
        p99: n(12)?,
        lag_p99: n(14)?,
        driver_lag_p99: n(15).unwrap_or(f64::NAN),
    })
}

/// Runs one configuration in a child process and returns its result row.
pub(crate) fn child(o: &Opts, imp: Imp, rate: f64) -> Option<String> {
    let mut args: Vec<String> = [
        "--num",
        &o.num.to_string(),
        "--rate",
        &rate.to_string(),
        "--keys",
        &o.keys.to_string(),
        "--key-space-size",
        &o.key_space.to_string(),
        "--timeout",
        &o.timeout_ms.to_string(),
        "--pct50",
        &o.pct50.to_string(),
        "--pct75",
        &o.pct75.to_string(),
        "--size",
        &o.size.to_string(),
        "--mode",
        &name(&o.mode),
        "--impl",
        &name(&imp),
        "--runtime",
        &name(&o.runtime),
        "--generators",
        &o.generators.to_string(),
        "--shards",
        &o.shards.to_string(),
        "--quiet",
    ]
    .iter()
    .map(|a| a.to_string())
    .collect();
    args.extend(o.tick_us.map(|us| format!("--tick-us={us}")));
    if o.shared_keys {
        args.push("--shared-keys".into());
    }
    let text = runs::child(args)?;
    text.lines()
        .find_map(|l| l.strip_prefix("ROW\t").map(str::to_string))
}

#[path = "../../tests/support/runs.rs"]
mod runs;

/// Every implementation, in the order runs take them; the harness alone
/// (`Floor`) last: `--compare` runs it to show the floor under every run,
/// `--sweep` leaves it out ([`imps`]).
pub(crate) const WITH_FLOOR: [Imp; 8] = [
    Imp::Purgatory,
    Imp::Task,
    Imp::Fair,
    Imp::Lean,
    Imp::LeanWheel,
    Imp::Sharded,
    Imp::KeySharded,
    Imp::Floor,
];

/// The implementations a sweep runs and draws: all but the harness alone.
pub(crate) fn imps() -> impl Iterator<Item = Imp> {
    WITH_FLOOR.into_iter().filter(|&i| i != Imp::Floor)
}

/// Runs every implementation `o.repeat` times at `rate`, interleaved, and returns
/// the rows, raw and parsed (printed as they come).
pub(crate) fn interleaved(o: &Opts, rate: f64, floor: bool) -> Vec<(String, Row)> {
    let imps: Vec<Imp> = WITH_FLOOR
        .into_iter()
        .filter(|&i| floor || i != Imp::Floor)
        .filter(|i| o.impls.as_ref().is_none_or(|only| only.contains(i)))
        .collect();
    runs::interleave(
        o.repeat as usize,
        &imps,
        |imp| format!("{} at {rate:.0}/s", name(imp)),
        |&imp| match child(o, imp, rate) {
            Some(r) => {
                println!("{rate:.0}\t{r}");
                let parsed = parse_row(&r)?;
                Some((format!("{rate:.0}\t{r}"), parsed))
            }
            None => {
                println!("{rate:.0}\t{}\t(failed)", name(&imp));
                None
            }
        },
    )
    .into_iter()
    .map(|(_, row)| row)
    .collect()
}

pub(crate) fn summary(o: &Opts, rows: &[Row]) {
    let col = |imp: &str, f: fn(&Row) -> f64| -> (f64, f64, f64) {
        runs::spread(rows.iter().filter(|r| r.imp == imp).map(f))
    };
    let cell = runs::cell;
    println!();
    println!(
        "mode {}, {} runtime, {} generator(s), {} requests at {:.0}/s, {} keys of {}, timeout {} ms; medians of {} runs [min..max]",
        name(&o.mode), name(&o.runtime), o.generators, o.num, o.rate, o.keys, o.key_space, o.timeout_ms, o.repeat
    );
    println!();
    println!("| implementation | CPU s | peak RSS MB | achieved /s | expiry lateness p99 ms | registration lag p99 ms | driver lag p99 ms | completed | expired |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for imp in WITH_FLOOR {
        let i = name(&imp);
        if !rows.iter().any(|r| r.imp == i) {
            continue;
        }
        println!(
            "| {i} | {} | {} | {} | {} | {} | {} | {} | {} |",
            cell(col(&i, |r| r.cpu_ms / 1000.0), 2),
            cell(col(&i, |r| r.rss_mb), 0),
            cell(col(&i, |r| r.actual_rate), 0),
            cell(col(&i, |r| r.p99), 1),
            cell(col(&i, |r| r.lag_p99), 1),
            cell(col(&i, |r| r.driver_lag_p99), 1),
            col(&i, |r| r.completed).0,
            col(&i, |r| r.expired).0,
        );
    }
    // Ratios of the medians: this crate against the best peer on each measure.
    let med = |imp: Imp, f: fn(&Row) -> f64| col(&name(&imp), f).0;
    let best_low = |f: fn(&Row) -> f64| med(Imp::Task, f).min(med(Imp::Fair, f));
    println!();
    if med(Imp::Purgatory, |r| r.cpu_ms).is_finite() {
        println!(
            "ratios, tokio-purgatory / best peer: CPU {:.2} (one-lock peer {:.2}), peak RSS {:.2}, lateness p99 {:.2}",
            med(Imp::Purgatory, |r| r.cpu_ms) / best_low(|r| r.cpu_ms),
            med(Imp::Purgatory, |r| r.cpu_ms) / med(Imp::Fair, |r| r.cpu_ms),
            med(Imp::Purgatory, |r| r.rss_mb) / best_low(|r| r.rss_mb),
            med(Imp::Purgatory, |r| r.p99) / best_low(|r| r.p99),
        );
    }
    // What this crate's rules cost a one-lock design, and this crate against
    // that design.
    for (imp, what) in [
        (
            Imp::Lean,
            "one-lock peer under this crate's rules".to_string(),
        ),
        (
            Imp::LeanWheel,
            "the same with this crate's wheel".to_string(),
        ),
        (Imp::Sharded, format!("that one in {} shards", o.shards)),
        (
            Imp::KeySharded,
            format!("in {} shards, lists by key", o.shards),
        ),
    ] {
        if med(imp, |r| r.cpu_ms).is_finite() {
            println!(
                "{what} / one-lock peer: CPU {:.2}, peak RSS {:.2}, lateness p99 {:.2}; tokio-purgatory / it: CPU {:.2}, peak RSS {:.2}",
                med(imp, |r| r.cpu_ms) / med(Imp::Fair, |r| r.cpu_ms),
                med(imp, |r| r.rss_mb) / med(Imp::Fair, |r| r.rss_mb),
                med(imp, |r| r.p99) / med(Imp::Fair, |r| r.p99),
                med(Imp::Purgatory, |r| r.cpu_ms) / med(imp, |r| r.cpu_ms),
                med(Imp::Purgatory, |r| r.rss_mb) / med(imp, |r| r.rss_mb),
            );
        }
    }
    // Each repetition runs every implementation in turn, so the runs of one
    // repetition met the same machine: on a noisy one, the median of their
    // ratios is steadier than the ratio of the medians.
    let of = |imp: Imp, f: fn(&Row) -> f64| -> Vec<f64> {
        rows.iter().filter(|r| r.imp == name(&imp)).map(f).collect()
    };
    let present: Vec<Imp> = WITH_FLOOR
        .into_iter()
        .filter(|&i| i != Imp::Floor && !of(i, |r| r.cpu_ms).is_empty())
        .collect();
    for base in [Imp::Fair, Imp::LeanWheel] {
        if !present.contains(&base) {
            continue;
        }
        let mut paired = Vec::new();
        for &imp in present.iter().filter(|&&i| i != base) {
            let (cpu, base_cpu) = (of(imp, |r| r.cpu_ms), of(base, |r| r.cpu_ms));
            let (rss, base_rss) = (of(imp, |r| r.rss_mb), of(base, |r| r.rss_mb));
            // Only when every run of both succeeded, so that the i-th runs
            // of both are of the same repetition.
            let n = o.repeat as usize;
            if cpu.len() != n || base_cpu.len() != n {
                paired.push(format!("{} (a run failed: not paired)", name(&imp)));
                continue;
            }
            let ratio =
                |a: &[f64], b: &[f64]| cell(runs::spread(a.iter().zip(b).map(|(a, b)| a / b)), 2);
            paired.push(format!(
                "{} CPU {}, peak RSS {}",
                name(&imp),
                ratio(&cpu, &base_cpu),
                ratio(&rss, &base_rss)
            ));
        }
        println!(
            "paired by repetition, median [min..max] of each repetition's ratio to {}: {}",
            name(&base),
            paired.join("; ")
        );
    }
    // The harness's own CPU is in every run; what each implementation adds is
    // its CPU above the floor's.
    let floor = med(Imp::Floor, |r| r.cpu_ms);
    if floor.is_finite() {
        println!(
            "harness floor CPU {:.2} s; CPU above the floor, tokio-purgatory / one-lock peer: {:.2}",
            floor / 1000.0,
            (med(Imp::Purgatory, |r| r.cpu_ms) - floor) / (med(Imp::Fair, |r| r.cpu_ms) - floor),
        );
    }
}

/// Draws one chart of the sweep: `y` of each implementation against target rate.
pub(crate) fn draw(
    rows: &[Row],
    path: &str,
    title: &str,
    y_desc: &str,
    y: fn(&Row) -> f64,
    diagonal: bool,
) {
    use plotters::prelude::*;
    let x_max = rows.iter().map(|r| r.target_rate).fold(1.0, f64::max) * 1.05;
    let mut y_max = rows
        .iter()
        .map(y)
        .filter(|v| v.is_finite())
        .fold(1.0, f64::max)
        * 1.1;
    if diagonal {
        y_max = y_max.max(x_max);
    }
    let root = SVGBackend::new(path, (760, 480)).into_drawing_area();
    root.fill(&WHITE).unwrap();
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 15))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..x_max, 0f64..y_max)
        .unwrap();
    chart
        .configure_mesh()
        .x_desc("offered rate (requests/s)")
        .y_desc(y_desc)
        .draw()
        .unwrap();
    if diagonal {
        chart
            .draw_series(LineSeries::new(
                [(0.0, 0.0), (x_max, x_max)],
                RGBColor(190, 190, 190),
            ))
            .unwrap();
    }
    // One colour per implementation drawn (the length is checked at compile
    // time: a zip with fewer would leave the last ones out of the chart).
    let colours: [RGBColor; WITH_FLOOR.len() - 1] = [
        RGBColor(214, 39, 40),
        RGBColor(31, 119, 180),
        RGBColor(44, 160, 44),
        RGBColor(148, 103, 189),
        RGBColor(140, 86, 75),
        RGBColor(227, 119, 194),
        RGBColor(127, 127, 127),
    ];
    for (imp, colour) in imps().zip(colours) {
        if !rows.iter().any(|r| r.imp == name(&imp)) {
            continue; // left out of this sweep (`--impls`)
        }
        let label = match imp {
            Imp::Purgatory => "tokio-purgatory",
            Imp::Task => "task per request + DashMap",
            Imp::Fair => "one-lock purgatory (DelayQueue + slab + lists)",
            Imp::Lean => "one-lock purgatory, no check under its lock",
            Imp::LeanWheel => "the same, with this crate's wheel",
            Imp::Sharded => "that one in shards",
            Imp::KeySharded => "in shards, lists by key",
            Imp::Floor => "the harness alone",
        };
        // The median of each rate's runs.
        let mut rates: Vec<f64> = rows
            .iter()
            .filter(|r| r.imp == name(&imp))
            .map(|r| r.target_rate.round())
            .collect();
        rates.sort_by(f64::total_cmp);
        rates.dedup();
        let pts: Vec<(f64, f64)> = rates
            .iter()
            .map(|&t| {
                let ys = rows
                    .iter()
                    .filter(|r| r.imp == name(&imp) && r.target_rate.round() == t)
                    .map(y);
                (t, runs::spread(ys).0)
            })
            .collect();
        chart
            .draw_series(LineSeries::new(pts.clone(), colour.stroke_width(2)))
            .unwrap()
            .label(label)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], colour.stroke_width(2))
            });
        chart
            .draw_series(pts.iter().map(|&p| Circle::new(p, 3, colour.filled())))
            .unwrap();
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .unwrap();
    root.present().unwrap();
}

/// Writes the two charts of a sweep next to its CSV: achieved rate, and expiry
/// lateness p99, against offered rate.
pub(crate) fn charts(rows: &[Row], prefix: &str, what: &str) {
    draw(
        rows,
        &format!("{prefix}-achieved.svg"),
        &format!("achieved vs offered rate: {what}"),
        "achieved rate (requests/s)",
        |r| r.actual_rate,
        true,
    );
    draw(
        rows,
        &format!("{prefix}-lateness.svg"),
        &format!("expiry lateness p99 vs offered rate: {what}"),
        "expiry lateness p99 (ms)",
        |r| r.p99,
        false,
    );
    println!("wrote {prefix}-achieved.svg and {prefix}-lateness.svg");
}

/// Redraws the charts of a CSV written by `--sweep`.
pub(crate) fn chart(csv_path: &str) {
    let text = std::fs::read_to_string(csv_path).expect("read csv");
    let mut rows = Vec::new();
    let mut what = String::new();
    for line in text.lines().skip(1) {
        // The first column is the rate asked for; the rest is a result row.
        let Some((_, r)) = line.split_once('\t') else {
            continue;
        };
        let f: Vec<&str> = r.split('\t').collect();
        if f.len() > 3 {
            what = format!("mode {}, {} runtime", f[1], f[2]);
        }
        rows.extend(parse_row(r));
    }
    charts(&rows, csv_path.trim_end_matches(".csv"), &what);
}
