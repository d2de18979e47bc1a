#!/usr/bin/env bash
# Counts the atomic read-modify-writes (x86-64 `lock`-prefixed instructions
# and `xchg` with memory) that one request of the churn bench executes, per
# function, with callgrind: the difference between a run of 120,000 steps and
# one of 60,000 (the window of 20,000 pending requests and the set-up cancel
# out), divided by 60,000.
#
#   cargo bench --bench churn --no-run
#   docs/perf/count-atomics.sh purgatory     # or: fair
set -euo pipefail
impl=${1:-purgatory}
bin=$(realpath "$(ls -t target/release/deps/churn-* | grep -v '\.d$' | head -1)")
work=$(mktemp -d)
objdump -d --no-show-raw-insn "$bin" \
    | grep -E '^\s+[0-9a-f]+:\s+(lock |xchg\s+[^,]+,.*\()' \
    | awk '{sub(":", "", $1); print $1}' > "$work/addrs"
for steps in 60000 120000; do
    valgrind --tool=callgrind --dump-instr=yes --compress-pos=no --compress-strings=no \
        --callgrind-out-file="$work/$steps.out" \
        "$bin" --impl "$impl" --rounds 1 --window 20000 --steps "$steps" > /dev/null 2>&1
done
python3 - "$work" "$bin" <<'PY'
import collections, sys
work, binary = sys.argv[1], sys.argv[2]
addrs = {int(a, 16) for a in open(f"{work}/addrs")}
def count(path):
    per_fn, ob, fn, skip = collections.Counter(), None, None, False
    for line in open(path):
        if line.startswith("ob="):
            ob = line[3:].strip()
        elif line.startswith("fn="):
            fn = line[3:].strip()
        elif line.startswith("calls="):
            skip = True  # the next cost line is the callee's, inclusive
        elif line.startswith("0x"):
            if skip:
                skip = False
                continue
            addr, _line, n = line.split()[:3]
            if ob == binary and int(addr, 16) in addrs:
                per_fn[fn] += int(n)
    return per_fn
short, long_ = count(f"{work}/60000.out"), count(f"{work}/120000.out")
per = {f: (long_[f] - short.get(f, 0)) / 60000 for f in long_}
print(f"atomic read-modify-writes per request: {sum(per.values()):.2f}")
for f, n in sorted(per.items(), key=lambda kv: -kv[1]):
    if n >= 0.01:
        print(f"{n:6.2f}  {f[:120]}")
PY
rm -rf "$work"
