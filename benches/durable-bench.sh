#!/usr/bin/env bash
# The durable write path (issue 19): 4 KiB random writes at queue depth 1 with a flush after
# every write (fio --fsync=1, what a database's commit waits for), Zebu against the disk's
# own limits and against a previous build, in one run.
#
# Targets (all on the same filesystem, WORKDIR, each measured ROUNDS times, the order of the
# targets rotated every round so that no target always runs on a warmer or quieter machine):
#   file       one plain file, fio psync, fsync after every write: what one copy costs
#   file-x3    three plain files written and fsynced in parallel (three fio jobs, IOPS summed
#              and divided by 3, so per-stream): the most this one disk gives three copies
#   zebu-3r    `zebu-engine serve --frontend nbd` over three `zebu-replica serve` on
#              127.0.0.11, .12, .13 (.11 is the engine's node: replica 1 uses its local
#              socket, the others TCP), driven by fio's nbd engine (libnbd), fsync=1 sends
#              NBD_CMD_FLUSH after every write
#   prev-3r    the same with the binaries in PREV_BIN_DIR (only when it is set)
# The plain files and the Zebu volumes are filled with random data before the rows (not timed;
# the volumes by `nbdcopy --flush`), so writes overwrite allocated blocks everywhere.
#
# Reported per target: IOPS per round and their median, p50 of the write's own latency and
# p50 of the flush's (fio `lat` of write and of sync), and the goals of issue 19:
#   zebu-3r IOPS >= 2 x prev-3r IOPS (when PREV_BIN_DIR is given)
#   zebu-3r IOPS >= 0.4 x file-x3 IOPS (per stream)
#
# A previous build: a directory holding release `zebu-engine` and `zebu-replica`, e.g. before
# changing anything:
#   cargo build --release -p zebu-engine -p zebu-replica --bin zebu-engine --bin zebu-replica
#   mkdir -p /var/tmp/$USER/prev && cp target/release/zebu-{engine,replica} /var/tmp/$USER/prev/
# or from a main checkout at the commit to compare with (the same two commands there).
#
# Usage: benches/durable-bench.sh [OUT_JSON]       (default ./durable-bench.json)
# Environment: ZEBU_BIN_DIR (default target/release, built when not given), PREV_BIN_DIR,
# ROUNDS (3), RUNTIME (10 s per row, after a 1 s ramp), SIZE (1G), WORKDIR (a new directory
# under /var/tmp), TARGETS (default "file file-x3 zebu-3r prev-3r"), ZEBU_REPLICA_ARGS,
# ZEBU_ENGINE_ARGS (extra words for every `serve` line), ZEBU_LOCAL_HOST (127.0.0.11).
# The machine is shared: compare rows of one run only.
set -euo pipefail

out_json=${1:-durable-bench.json}
rounds=${ROUNDS:-3}
runtime=${RUNTIME:-10}
size=${SIZE:-1G}
repo=$(cd "$(dirname "$0")/.." && pwd)
work=${WORKDIR:-$(mktemp -d /var/tmp/durable-bench.XXXXXX)}
targets=${TARGETS:-file file-x3 zebu-3r prev-3r}
server_pids=()
results=$work/results.jsonl

log() { echo "durable-bench: $*" >&2; }

cleanup() {
    set +e
    stop_server
    rm -f "$work"/*.img
    rm -rf "$work"/zebu-r?
}
trap cleanup EXIT
trap 'exit 130' INT TERM

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

# Waits until FILE has a line starting with PREFIX and prints the rest of that line.
wait_line() {
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

# start_zebu BIN_DIR PORT: three replicas and an engine serving export "bench" on PORT, the
# volume filled with the seed file.
start_zebu() {
    local bin=$1 port=$2 i dir addr pid args=()
    for i in 1 2 3; do
        dir=$work/zebu-r$i
        rm -rf "$dir"
        # shellcheck disable=SC2086
        "$bin/zebu-replica" serve --dir "$dir" --listen "127.0.0.1$i:0" \
            --size "$size_bytes" ${ZEBU_REPLICA_ARGS:-} >"$dir.out" 2>"$dir.log" &
        pid=$!
        server_pids+=("$pid")
        addr=$(wait_line "$dir.out" "listening on " "$pid")
        args+=(--replica "$addr")
    done
    local local_host=${ZEBU_LOCAL_HOST-127.0.0.11}
    [[ -n $local_host ]] && args+=(--local-host "$local_host")
    # shellcheck disable=SC2086
    "$bin/zebu-engine" serve --volume bench --size "$size_bytes" "${args[@]}" \
        --control 127.0.0.1:0 --frontend nbd --nbd-listen "127.0.0.1:$port" \
        ${ZEBU_ENGINE_ARGS:-} >"$work/engine.out" 2>"$work/engine.log" &
    pid=$!
    server_pids=("$pid" "${server_pids[@]}")
    wait_line "$work/engine.out" "ready" "$pid" >/dev/null
    engine_control=$(wait_line "$work/engine.out" "control " "$pid")
    nbdcopy --flush "$work/seed.img" "nbd://127.0.0.1:$port/bench"
}

# engine_counters BIN_DIR: the engine's write and flush time counters (`pathtime.rs`; absent
# in builds before them), as one JSON object.
engine_counters() {
    "$1/zebu-engine" --control "$engine_control" --json info 2>/dev/null |
        python3 -c 'import json,sys; print(json.dumps(json.load(sys.stdin).get("dataPath")))' ||
        echo null
}

stop_server() {
    local pid
    for pid in "${server_pids[@]}"; do
        kill "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    server_pids=()
}

# record TARGET ROUND JSON STREAMS: one result line from fio's JSON (jobs summed).
record() {
    python3 - "$@" >>"$results" <<'PY'
import json, sys
target, rnd, path, streams = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
before, after = (json.loads(a) if a else None for a in (sys.argv[5:7] + ["", ""])[:2])
text = open(path).read()
jobs = json.loads(text[text.index("{"):])["jobs"]
iops = sum(j["write"]["iops"] for j in jobs)
def engine_means(before, after):
    # Mean µs per request of each step over the fio run (the fill's requests taken out).
    if not before or not after:
        return None
    out = {}
    for kind in ("writes", "flushes"):
        b, a = before.get(kind) or {}, after.get(kind) or {}
        n = a.get("count", 0) - b.get("count", 0)
        if n <= 0:
            continue
        d = lambda k: (a.get(k, 0) - b.get(k, 0)) / n / 1000
        out[kind] = {"count": n, "frontend_us": d("frontendNs"), "replicator_us": d("replicatorNs"),
                     "transport_us": d("transportNs")}
    out["flushes_shared"] = after.get("flushesShared", 0) - before.get("flushesShared", 0)
    return out
def p50(side):
    ns = side.get("lat_ns", {}).get("percentile", {}).get("50.000000")
    return None if ns is None else ns / 1000
print(json.dumps({
    "target": target, "round": rnd, "iops": iops, "iops_per_stream": iops / streams,
    "write_p50_us": p50(jobs[0]["write"]), "sync_p50_us": p50(jobs[0].get("sync", {})),
    "engine": engine_means(before, after),
}))
PY
}

fio_common=(--rw=randwrite --bs=4k --iodepth=1 --fsync=1 --time_based "--runtime=$runtime"
    --ramp_time=1 --randrepeat=0 --norandommap --lat_percentiles=1 --output-format=json)

run_target() {
    local target=$1 rnd=$2 json=$work/$1-$2.json port
    case $target in
        file)
            fio --name=file --ioengine=psync "--filename=$work/f1.img" "--size=$size" \
                "${fio_common[@]}" --output="$json" >/dev/null
            record "$target" "$rnd" "$json" 1
            ;;
        file-x3)
            fio --ioengine=psync "--size=$size" "${fio_common[@]}" --output="$json" \
                --name=a "--filename=$work/f1.img" --name=b "--filename=$work/f2.img" \
                --name=c "--filename=$work/f3.img" >/dev/null
            record "$target" "$rnd" "$json" 3
            ;;
        zebu-3r | prev-3r)
            port=$(free_port)
            local bin=$zebu_bin before after
            [[ $target == prev-3r ]] && bin=$PREV_BIN_DIR
            start_zebu "$bin" "$port"
            before=$(engine_counters "$bin")
            fio --name="$target" --ioengine=nbd "--uri=nbd://127.0.0.1:$port/bench" \
                "--size=$size" "${fio_common[@]}" --output="$json" >/dev/null
            after=$(engine_counters "$bin")
            stop_server
            record "$target" "$rnd" "$json" 1 "$before" "$after"
            ;;
        *) log "unknown target $target"; exit 2 ;;
    esac
}

mkdir -p "$work"
: >"$results"
zebu_bin=${ZEBU_BIN_DIR:-$repo/target/release}
if [[ -z ${ZEBU_BIN_DIR:-} ]]; then
    log "building zebu-engine and zebu-replica (release)"
    (cd "$repo" && cargo build -q --release -p zebu-engine -p zebu-replica \
        --bin zebu-engine --bin zebu-replica)
fi
list=()
for t in $targets; do
    [[ $t == prev-3r && -z ${PREV_BIN_DIR:-} ]] && continue
    list+=("$t")
done
size_bytes=$(numfmt --from=iec "$size")
load_start=$(cut -d' ' -f1-3 /proc/loadavg)
log "preparing $size of random data and three plain files in $work"
head -c "$size_bytes" /dev/urandom >"$work/seed.img"
for f in f1 f2 f3; do cp --sparse=never "$work/seed.img" "$work/$f.img"; done
sync

for rnd in $(seq 1 "$rounds"); do
    n=${#list[@]}
    for k in $(seq 0 $((n - 1))); do
        t=${list[$(((k + rnd - 1) % n))]}
        log "round $rnd: $t"
        run_target "$t" "$rnd"
    done
done

load_end=$(cut -d' ' -f1-3 /proc/loadavg)
python3 - "$results" "$out_json" "$load_start" "$load_end" "$runtime" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
load_start, load_end, runtime = sys.argv[3:6]
targets = list(dict.fromkeys(r["target"] for r in rows))
summary = {}
for t in targets:
    rs = [r for r in rows if r["target"] == t]
    med = lambda k: statistics.median(r[k] for r in rs if r[k] is not None) if any(
        r[k] is not None for r in rs) else None
    summary[t] = {"iops_per_stream": med("iops_per_stream"), "iops": med("iops"),
                  "write_p50_us": med("write_p50_us"), "sync_p50_us": med("sync_p50_us"),
                  "rounds": [round(r["iops_per_stream"]) for r in rs]}
fmt = "{:<9} {:>10} {:>10} {:>11} {:>11}  {}"
print(fmt.format("target", "IOPS", "total", "write p50", "flush p50", "per round (per stream)"))
for t, s in summary.items():
    f = lambda v: "" if v is None else f"{v:.0f}"
    print(fmt.format(t, f(s["iops_per_stream"]), f(s["iops"]), f(s["write_p50_us"]),
                     f(s["sync_p50_us"]), " ".join(map(str, s["rounds"]))))
goals = []
def goal(name, value, limit):
    goals.append({"goal": name, "value": value, "limit": limit, "pass": value >= limit})
z = summary.get("zebu-3r", {}).get("iops_per_stream")
if z is not None and "prev-3r" in summary:
    goal("zebu-3r IOPS >= 2 x prev-3r", z, 2 * summary["prev-3r"]["iops_per_stream"])
if z is not None and "file-x3" in summary:
    goal("zebu-3r IOPS >= 0.4 x file-x3 per stream", z, 0.4 * summary["file-x3"]["iops_per_stream"])
for t in targets:
    eng = [r["engine"] for r in rows if r["target"] == t and r.get("engine")]
    for kind in ("writes", "flushes"):
        es = [e[kind] for e in eng if kind in e]
        if es:
            m = lambda k: statistics.median(e[k] for e in es)
            print(f"{t} engine {kind}: mean µs frontend {m('frontend_us'):.0f}, replicator "
                  f"{m('replicator_us'):.0f} (of it waiting for the replicas {m('transport_us'):.0f})")
for g in goals:
    print(f'{"PASS" if g["pass"] else "FAIL"}  {g["goal"]}: {g["value"]:.0f} (limit {g["limit"]:.0f})')
print(f"load average: start {load_start}, end {load_end}; {runtime} s per row")
json.dump({"rows": rows, "summary": summary, "goals": goals, "load_start": load_start,
           "load_end": load_end}, open(sys.argv[2], "w"), indent=1)
PY
