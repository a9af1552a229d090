#!/usr/bin/env bash
# What block checksums cost: Zebu over NBD on three replicas with checksums on against the
# same build with them off, in one run.
#
# Method
# ------
# Two variants of one build, measured alternately in ROUNDS rounds (order on, off, off, on,
# on, off, ...: each variant goes first as often as second, so drift over the run does not
# favour one):
#   on    zebu-replica serve (default: --checksums on) x 3, zebu-engine serve (default)
#   off   the same with --checksums off on every replica and on the engine: the engine sends
#         no block sums, replicas store none and verify no read
# Each variant gets three fresh replicas on 127.0.0.11-13 (127.0.0.11 local to the engine,
# --local-host, as the manager starts engines) and its volume is filled with the same random
# file by nbdcopy --flush before its rows (not timed), so reads return real data. Replica
# directories live in WORKDIR.
#
# Rows (RUNTIME seconds each, time based, one job, after a 1 s ramp), fio's nbd engine:
#   rw4k-qd32   4 KiB random write, iodepth 32   -> IOPS
#   rr4k-qd32   4 KiB random read,  iodepth 32   -> IOPS
#   sw1m-qd8    1 MiB sequential write, iodepth 8 -> MiB/s
# For each row: the median over the rounds per variant, on/off, the ratio of each round's
# pair (its on and off were measured back to back, so the pair shares the machine's load of
# that minute) with their spread (min-max), and the CPU seconds the engine and replicas used
# per GiB moved (utime+stime from /proc). Goal (issue 17): on is at
# most 10 % lower than off on every row, printed PASS or FAIL. The engine, replicas and fio
# share this machine's CPUs, as in benches/nbd-bench.sh: compare the two variants of one run,
# not runs of different days.
#
# Usage: benches/integrity-bench.sh [OUT_JSON]     (default ./integrity-bench.json)
# Environment: SIZE (default 1G), RUNTIME (default 5), ROUNDS (default 3), WORKDIR,
# ZEBU_BIN_DIR (zebu-engine and zebu-replica; default target/release, built when not given).
set -euo pipefail

out_json=${1:-integrity-bench.json}
size=${SIZE:-1G}
runtime=${RUNTIME:-5}
rounds=${ROUNDS:-3}
repo=$(cd "$(dirname "$0")/.." && pwd)
work=${WORKDIR:-$(mktemp -d /var/tmp/integrity-bench.XXXXXX)}
clk_tck=$(getconf CLK_TCK)
results=$work/results.jsonl
pids=()

log() { echo "integrity-bench: $*" >&2; }

stop_all() {
    local pid
    for pid in "${pids[@]}"; do
        kill "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    pids=()
}

cleanup() {
    set +e
    stop_all
    rm -rf "$work"/r? "$work"/seed.img
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# The first line of FILE that starts with PREFIX, without the prefix, once it is there.
line_of() {
    local file=$1 prefix=$2 pid=$3 line
    for _ in $(seq 1 600); do
        line=$(grep -m1 "^$prefix" "$file" 2>/dev/null || true)
        [[ -n $line ]] && { echo "${line#"$prefix"}"; return 0; }
        kill -0 "$pid" 2>/dev/null || { log "process $pid exited; see $file"; return 1; }
        sleep 0.1
    done
    log "no '$prefix' line in $file"
    return 1
}

cpu_total() {
    local pid sum=0
    for pid in "${pids[@]}"; do
        sum=$((sum + $(awk '{ print $14 + $15 }' "/proc/$pid/stat")))
    done
    echo "$sum"
}

# start VARIANT: three replicas and an engine; sets $uri.
start() {
    local variant=$1 sums=on i dir addr pid port args=()
    [[ $variant == off ]] && sums=off
    for i in 1 2 3; do
        dir=$work/r$i
        rm -rf "$dir"
        "$bin/zebu-replica" serve --dir "$dir" --listen "127.0.0.1$i:0" --size "$size" \
            --checksums "$sums" >"$dir.out" 2>"$dir.log" &
        pid=$!
        pids+=("$pid")
        addr=$(line_of "$dir.out" "listening on " "$pid")
        args+=(--replica "$addr")
    done
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
    "$bin/zebu-engine" serve --volume bench --size "$size" "${args[@]}" --local-host 127.0.0.11 \
        --control 127.0.0.1:0 --frontend nbd --nbd-listen "127.0.0.1:$port" --checksums "$sums" \
        >"$work/engine.out" 2>"$work/engine-$variant.log" &
    pid=$!
    pids=("$pid" "${pids[@]}")
    line_of "$work/engine.out" "ready" "$pid" >/dev/null
    uri="nbd://127.0.0.1:$port/bench"
    nbdcopy --flush "$work/seed.img" "$uri"
}

# row VARIANT ROUND NAME RW BS QD
row() {
    local variant=$1 round=$2 name=$3 rw=$4 bs=$5 qd=$6 c0 c1 json=$work/fio.json
    c0=$(cpu_total)
    fio --name="$name" --ioengine=nbd "--uri=$uri" --rw="$rw" --bs="$bs" --iodepth="$qd" \
        --size="$size" --time_based --runtime="$runtime" --ramp_time=1 --numjobs=1 \
        --randrepeat=0 --norandommap --output-format=json --output="$json" >/dev/null
    c1=$(cpu_total)
    python3 - "$json" "$variant" "$round" "$name" "$c0" "$c1" "$clk_tck" "$runtime" >>"$results" <<'PY'
import json, sys
path, variant, rnd, name, c0, c1, tck, runtime = sys.argv[1:9]
text = open(path).read()
job = json.loads(text[text.index("{"):])["jobs"][0]
side = job["read"] if job["read"]["io_bytes"] > 0 else job["write"]
moved = (job["read"]["io_bytes"] + job["write"]["io_bytes"]) / 2**30
# The CPU window includes the ramp second, whose bytes fio does not count: scale it out.
cpu = (float(c1) - float(c0)) / float(tck) * float(runtime) / (float(runtime) + 1)
print(json.dumps({"variant": variant, "round": int(rnd), "row": name, "iops": side["iops"],
                  "mib_s": side["bw_bytes"] / 2**20,
                  "cpu_s_per_gib": cpu / moved if moved else None}))
PY
}

if [[ -z ${ZEBU_BIN_DIR:-} ]]; then
    log "building zebu-engine and zebu-replica (release)"
    (cd "$repo" && cargo build -q --release -p zebu-engine -p zebu-replica \
        --bin zebu-engine --bin zebu-replica)
fi
bin=${ZEBU_BIN_DIR:-$repo/target/release}
mkdir -p "$work"
: >"$results"
load_start=$(cut -d' ' -f1-3 /proc/loadavg)
head -c "$(numfmt --from=iec "$size")" /dev/urandom >"$work/seed.img"
for round in $(seq 1 "$rounds"); do
    if ((round % 2)); then order="on off"; else order="off on"; fi
    for variant in $order; do
        log "round $round: checksums $variant"
        start "$variant"
        row "$variant" "$round" rw4k-qd32 randwrite 4k 32
        row "$variant" "$round" rr4k-qd32 randread 4k 32
        row "$variant" "$round" sw1m-qd8 write 1M 8
        stop_all
    done
done
load_end=$(cut -d' ' -f1-3 /proc/loadavg)

python3 - "$results" "$out_json" "$load_start" "$load_end" "$size" "$runtime" "$rounds" <<'PY'
import json, os, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
out, load_start, load_end, size, runtime, rounds = sys.argv[2:8]
def metric(r):
    return r["mib_s"] if r["row"].startswith("s") else r["iops"]
summary, goals = [], []
print(f'{"row":<10} {"unit":<6} {"on":>9} {"off":>9} {"on/off":>7} {"CPU s/GiB on":>13} {"off":>6}   every round (on | off)   pair ratios (min-max)')
for name in ("rw4k-qd32", "rr4k-qd32", "sw1m-qd8"):
    by = {v: [r for r in rows if r["row"] == name and r["variant"] == v] for v in ("on", "off")}
    if not by["on"] or not by["off"]:
        continue
    med = {v: statistics.median(metric(r) for r in by[v]) for v in by}
    cpu = {v: statistics.median(r["cpu_s_per_gib"] or 0 for r in by[v]) for v in by}
    ratio = med["on"] / med["off"] if med["off"] else 0
    unit = "MiB/s" if name.startswith("s") else "IOPS"
    every = " ".join(f'{metric(r):.0f}' for r in by["on"]) + " | " + \
        " ".join(f'{metric(r):.0f}' for r in by["off"])
    off_of = {r["round"]: metric(r) for r in by["off"]}
    pairs = [metric(r) / off_of[r["round"]] for r in sorted(by["on"], key=lambda r: r["round"])
             if off_of.get(r["round"])]
    spread = f'{min(pairs):.3f}-{max(pairs):.3f}' if pairs else "-"
    print(f'{name:<10} {unit:<6} {med["on"]:>9.0f} {med["off"]:>9.0f} {ratio:>7.3f} '
          f'{cpu["on"]:>13.2f} {cpu["off"]:>6.2f}   {every}   '
          + " ".join(f'{p:.3f}' for p in pairs) + f' ({spread})')
    summary.append({"row": name, "unit": unit, "on": med["on"], "off": med["off"],
                    "ratio": ratio, "pair_ratios": pairs,
                    "cpu_s_per_gib_on": cpu["on"], "cpu_s_per_gib_off": cpu["off"]})
    goals.append({"goal": f"{name}: checksums on >= 0.90 x off", "ratio": ratio,
                  "pass": ratio >= 0.90})
print()
for g in goals:
    print(f'{"PASS" if g["pass"] else "FAIL"}  {g["goal"]}: {g["ratio"]:.3f}')
print(f"load average {load_start} -> {load_end}, {os.cpu_count()} CPUs, {rounds} rounds")
json.dump({"method": "benches/integrity-bench.sh header", "size": size,
           "runtime_s": int(runtime), "rounds": int(rounds), "cpus": os.cpu_count(),
           "kernel": os.uname().release, "load_start": load_start, "load_end": load_end,
           "summary": summary, "goals": goals, "rows": rows}, open(out, "w"), indent=1)
PY
log "wrote $out_json"
