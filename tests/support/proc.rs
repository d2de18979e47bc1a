//! Process figures from `/proc/self` (Linux), for the programs that report them.
//! Included with `#[path]`.
#![allow(dead_code)]

/// A `kB` field of `/proc/self/status` (`VmRSS`, `VmHWM`, ...) in MB; 0 if absent.
pub fn status_mb(field: &str) -> f64 {
    let prefix = format!("{field}:");
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()).map(str::to_string))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}
