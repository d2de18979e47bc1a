//! The one harness of the benchmark programs (`benches/timer.rs`,
//! `examples/purgatory_perf`, `examples/levels_bench.rs`): each configuration
//! runs in a process of its own, the configurations interleaved (A B C A B C
//! ...), the load average printed before each run, and figures summarised as
//! the median with [min..max]. Included with `#[path]`.
#![allow(dead_code)]

/// The 1-minute load average, to show the machine was quiet ("?" off Linux).
pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_string))
        .unwrap_or_else(|| "?".into())
}

/// Median, min and max of `values` (the median of an even count is the mean
/// of the middle two); NaN for none.
pub fn spread(values: impl IntoIterator<Item = f64>) -> (f64, f64, f64) {
    let mut v: Vec<f64> = values.into_iter().collect();
    if v.is_empty() {
        return (f64::NAN, f64::NAN, f64::NAN);
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    let median = if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    };
    (median, v[0], v[n - 1])
}

/// `median [min..max]` with `digits` decimals.
pub fn cell((median, min, max): (f64, f64, f64), digits: usize) -> String {
    format!("{median:.digits$} [{min:.digits$}..{max:.digits$}]")
}

/// Runs this program again, in a process of its own, with `args`, and returns
/// its standard output (its standard error passes through); `None` when it
/// could not be started or failed.
pub fn child<S: AsRef<std::ffi::OsStr>>(args: impl IntoIterator<Item = S>) -> Option<String> {
    let exe = std::env::current_exe().ok()?;
    let out = std::process::Command::new(exe)
        .args(args)
        .stderr(std::process::Stdio::inherit())
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Runs `run` on every configuration, `rounds` times, interleaved (all
/// configurations once, then again), printing `label` and the load average
/// to standard error before each run. Returns each result with the index of
/// its configuration; a run that gives `None` is reported and left out.
pub fn interleave<C, R>(
    rounds: usize,
    configs: &[C],
    label: impl Fn(&C) -> String,
    mut run: impl FnMut(&C) -> Option<R>,
) -> Vec<(usize, R)> {
    let mut results = Vec::new();
    for round in 1..=rounds {
        for (i, config) in configs.iter().enumerate() {
            eprintln!(
                "# run {round}/{rounds} of {} (load average {})",
                label(config),
                loadavg()
            );
            match run(config) {
                Some(r) => results.push((i, r)),
                None => eprintln!("#   {} failed", label(config)),
            }
        }
    }
    results
}
