#!/usr/bin/env bash
# The README's performance figures: this crate against the fair one-lock
# purgatory (and the harness floor), at Kafka's TestPurgatoryPerformance
# workload (3 keys of 1,000 per request, 200 ms timeout, completion latency
# median 50 ms, 75th percentile 150 ms). Each row is one `--compare` run:
# every implementation in its own process, interleaved, 5 repetitions.
# Run it on a quiet machine (nothing else busy: check /proc/loadavg).
#
#   scripts/fair-rows.sh [output prefix]    (default docs/perf/compare/fair)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/perf/compare/fair}
cargo build --release --example purgatory_perf
bin=target/release/examples/purgatory_perf
common=(--key-space-size 1000 --keys 3 --timeout 200 --pct50 50 --pct75 150
        --compare --repeat 5 --quiet)
# Where neither saturates: 200,000 requests/s (key-driven 100,000/s), on one
# worker and on two.
for runtime in current multi; do
    for mode in kafka awaited key; do
        rate=200000
        [ "$mode" = key ] && rate=100000
        echo "== $mode $rate/s $runtime" >&2
        "$bin" "${common[@]}" --num 1000000 --impls purgatory,fair,floor \
            --mode "$mode" --rate "$rate" --runtime "$runtime" \
            > "$out-$mode-$rate-$runtime.txt"
    done
done
# Overloaded, on two workers: 1 M/s offered, and 1.5 M/s from two generators.
for mode in kafka key; do
    echo "== $mode 1000000/s multi" >&2
    "$bin" "${common[@]}" --num 2000000 --impls purgatory,fair \
        --mode "$mode" --rate 1000000 --runtime multi \
        > "$out-$mode-1000000-multi.txt"
    echo "== $mode 1500000/s multi, 2 generators" >&2
    "$bin" "${common[@]}" --num 3000000 --impls purgatory,fair \
        --mode "$mode" --rate 1500000 --generators 2 --runtime multi \
        > "$out-$mode-1500000-multi-2gen.txt"
done
