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

/// User plus system CPU time, in ms, of process `pid` ("self" for this one);
/// 0 if it cannot be read.
pub fn cpu_ms(pid: &str) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name (which may hold spaces) start after ')'.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    // `rest` starts at field 3 (state); utime and stime are fields 14 and 15.
    let f: Vec<&str> = rest.split_whitespace().collect();
    let field = |i: usize| f.get(i).and_then(|x| x.parse::<u64>().ok()).unwrap_or(0);
    let ticks = field(11) + field(12);
    ticks * 1000 / 100 // USER_HZ is 100 on Linux
}
