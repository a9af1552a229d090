#!/usr/bin/env bash
# NBD frontend benchmark: Zebu over NBD against references, in one run.
#
# Method
# ------
# Targets (TARGETS, space separated, run in order on the same machine in one invocation):
#   plain        the data file itself, fio ioengine=io_uring, direct=1 (the reference; ratios
#                are relative to it)
#   nbdkit       nbdkit's `file` plugin serving a copy of the data file over NBD on loopback
#   engine-file  the engine's NBD frontend over a FileDevice (engine/examples/nbd_file.rs):
#                the NBD server alone, without replication
#   zebu-1r      `zebu-engine serve --frontend nbd` over one `zebu-replica serve` on
#                127.0.0.11 (release binaries)
#   zebu-3r      the same over three replicas on 127.0.0.11, .12 and .13
#                In both, 127.0.0.11 is the engine's own node (`--local-host`, as the manager
#                starts engines): replica 1 moves its data over its local Unix socket, as a
#                replica placed by data locality does; .12 and .13 stand for other nodes
#                and use TCP. ZEBU_LOCAL_HOST changes that host; empty: every replica on TCP.
#   cmd:NAME     any other NBD server: the command in $TARGET_CMD_NAME, with {PORT}, {FILE}
#                and {SIZE} substituted, must serve export "bench" on 127.0.0.1:{PORT} and stay
#                in the foreground.
# Every NBD target is driven by fio's `nbd` engine (libnbd, one connection, async queue).
# Each target gets its own copy of one random-filled file of SIZE bytes, so reads return
# real data rather than holes; the Zebu volumes are filled with that file by `nbdcopy
# --flush` before their rows (not timed). Replica directories live in WORKDIR, on the same
# filesystem as the plain file.
#
# Rows (RUNTIME seconds each, time based, one job, after a 1 s ramp):
#   rr4k-qd32   4 KiB random read,   iodepth 32       -> IOPS
#   rw4k-qd32   4 KiB random write,  iodepth 32       -> IOPS
#   sr1m-qd8    1 MiB sequential read, iodepth 8      -> MiB/s
#   sw1m-qd8    1 MiB sequential write, iodepth 8     -> MiB/s
#   rw4k-qd1    4 KiB random write,  iodepth 1        -> IOPS, p50 and p99 total latency
#               (fio's lat: submission and completion; clat alone misses the part of a request
#               that libnbd finishes while submitting the next)
# For each NBD row, the server's CPU time (utime+stime from /proc/PID/stat, all threads,
# read before and after the row, scaled by RUNTIME/(RUNTIME+1) to leave out the ramp second
# whose bytes fio does not count; for Zebu the engine and every replica, summed, and also
# per process) divided by the GiB fio moved gives "server CPU s/GiB". The
# plain target has no server, so that column is empty there.
#
# Goals checked at the end (from the issue), each printed PASS or FAIL:
#   zebu-3r rw4k-qd32 IOPS >= 0.8 x (plain / 3)
#   zebu-3r and zebu-1r rr4k-qd32 IOPS >= 0.7 x plain
#   zebu-3r and zebu-1r rw4k-qd1 p50 <= plain p50 + 100 us
#   zebu-1r >= nbdkit on every row (IOPS or MiB/s)
#
# Caveats to keep in mind when reading the table: the plain reference uses O_DIRECT, while
# nbdkit's file plugin, FileDevice and the replicas (by default, `--cache page`) do buffered
# I/O, so their reads can come from the page cache and their writes are not durable until a
# flush (fio sends none here); ZEBU_REPLICA_ARGS="--cache direct" measures replicas with
# O_DIRECT instead. The engine, the replicas and fio share the machine's CPUs, which a real
# deployment (replicas on other hosts) does not. The machine is shared, so compare rows of
# one run, not runs of different days; the load average is recorded at start and end.
#
# Usage: benches/nbd-bench.sh [OUT_JSON]      (default ./nbd-bench.json)
# Environment: TARGETS, SIZE (default 1G), RUNTIME (default 5), WORKDIR, ENGINE_BIN (the
# nbd_file example), ZEBU_BIN_DIR (zebu-engine and zebu-replica; default target/release,
# built when not given), ZEBU_ENGINE_ARGS (extra arguments appended to the `zebu-engine
# serve` line, split on spaces, e.g. "--data-transport grpc"), ZEBU_REPLICA_ARGS (the same for
# every `zebu-replica serve` line, e.g. "--cache direct"), ZEBU_LOCAL_HOST (default 127.0.0.11).
set -euo pipefail

out_json=${1:-nbd-bench.json}
targets=${TARGETS:-plain nbdkit engine-file zebu-1r zebu-3r}
size=${SIZE:-1G}
runtime=${RUNTIME:-5}
repo=$(cd "$(dirname "$0")/.." && pwd)
work=${WORKDIR:-$(mktemp -d /var/tmp/nbd-bench.XXXXXX)}
clk_tck=$(getconf CLK_TCK)
# The processes of the running server: names and pids, in the same order.
server_pids=()
server_names=()
results=$work/results.jsonl

cleanup() {
    set +e
    stop_server
    rm -f "$work"/*.img
    rm -rf "$work"/zebu-*-r?
}
trap cleanup EXIT
trap 'exit 130' INT TERM

log() { echo "nbd-bench: $*" >&2; }

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

# CPU seconds (user+system) the process has used so far, all threads included.
cpu_ticks() {
    awk '{ print $14 + $15 }' "/proc/$1/stat"
}

wait_port() {
    for _ in $(seq 1 100); do
        nbdinfo --size "nbd://127.0.0.1:$1/bench" >/dev/null 2>&1 && return 0
        sleep 0.1
    done
    log "server on port $1 did not come up"
    return 1
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

# start_zebu N FILE PORT: N replicas on 127.0.0.11.. and an engine whose NBD frontend serves
# export "bench" on 127.0.0.1:PORT; then fills the volume with FILE.
start_zebu() {
    local n=$1 file=$2 port=$3 i dir addr pid args=()
    for i in $(seq 1 "$n"); do
        dir=$work/zebu-${n}r-r$i
        rm -rf "$dir"
        # shellcheck disable=SC2086
        "$zebu_bin/zebu-replica" serve --dir "$dir" --listen "127.0.0.1$i:0" \
            --size "$size_bytes" ${ZEBU_REPLICA_ARGS:-} >"$dir.out" 2>"$dir.log" &
        pid=$!
        server_pids+=("$pid")
        server_names+=("replica$i")
        addr=$(wait_line "$dir.out" "listening on " "$pid")
        args+=(--replica "$addr")
    done
    local_host=${ZEBU_LOCAL_HOST-127.0.0.11}
    [[ -n $local_host ]] && args+=(--local-host "$local_host")
    # ZEBU_ENGINE_ARGS is unquoted on purpose: it holds several words.
    # shellcheck disable=SC2086
    "$zebu_bin/zebu-engine" serve --volume bench --size "$size_bytes" "${args[@]}" \
        --control 127.0.0.1:0 --frontend nbd --nbd-listen "127.0.0.1:$port" \
        ${ZEBU_ENGINE_ARGS:-} \
        >"$work/zebu-${n}r-engine.out" 2>"$work/zebu-${n}r-engine.log" &
    pid=$!
    server_pids=("$pid" "${server_pids[@]}")
    server_names=(engine "${server_names[@]}")
    wait_line "$work/zebu-${n}r-engine.out" "ready" "$pid" >/dev/null
    log "filling the volume with nbdcopy"
    nbdcopy --flush "$file" "nbd://127.0.0.1:$port/bench"
}

start_server() {
    local target=$1 file=$2 port
    port=$(free_port)
    case $target in
        nbdkit)
            nbdkit -f -i 127.0.0.1 -p "$port" -e bench file "$file" &
            server_pids=($!) server_names=(nbdkit)
            ;;
        engine-file)
            "$engine_bin" --listen "127.0.0.1:$port" --name bench --size "$size" \
                --file "$file" >/dev/null 2>"$work/engine.log" &
            server_pids=($!) server_names=(engine)
            ;;
        zebu-1r) start_zebu 1 "$file" "$port" ;;
        zebu-3r) start_zebu 3 "$file" "$port" ;;
        cmd:*)
            local var="TARGET_CMD_${target#cmd:}" cmd
            cmd=${!var:?set $var to the server command for target $target}
            cmd=${cmd//\{PORT\}/$port}
            cmd=${cmd//\{FILE\}/$file}
            cmd=${cmd//\{SIZE\}/$size}
            bash -c "exec $cmd" &
            server_pids=($!) server_names=(server)
            ;;
        *) log "unknown target $target"; exit 2 ;;
    esac
    wait_port "$port"
    uri="nbd://127.0.0.1:$port/bench"
}

stop_server() {
    local pid
    for pid in "${server_pids[@]}"; do
        # SIGTERM: the engine flushes its replicas and exits, then the replicas go.
        kill "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    server_pids=()
    server_names=()
}

# "name=ticks name=ticks ..." for the running server's processes.
cpu_snapshot() {
    local i out=()
    for i in "${!server_pids[@]}"; do
        out+=("${server_names[$i]}=$(cpu_ticks "${server_pids[$i]}")")
    done
    echo "${out[*]}"
}

# run_row TARGET ROW RW BS QD
run_row() {
    local target=$1 row=$2 rw=$3 bs=$4 qd=$5 engine_args c0= c1= json
    if [[ $target == plain ]]; then
        engine_args=(--ioengine=io_uring --direct=1 "--filename=$target_file")
    else
        engine_args=(--ioengine=nbd "--uri=$uri")
    fi
    [[ ${#server_pids[@]} -gt 0 ]] && c0=$(cpu_snapshot)
    json=$work/$target-$row.json
    fio --name="$row" "${engine_args[@]}" --rw="$rw" --bs="$bs" --iodepth="$qd" \
        --size="$size" --time_based --runtime="$runtime" --ramp_time=1 --numjobs=1 \
        --randrepeat=0 --norandommap --lat_percentiles=1 --output-format=json --output="$json" >/dev/null
    [[ ${#server_pids[@]} -gt 0 ]] && c1=$(cpu_snapshot)
    python3 - "$json" "$target" "$row" "$clk_tck" "$c0" "$c1" "$runtime" >>"$results" <<'PY'
import json, sys
path, target, row, tck, c0, c1, runtime = sys.argv[1:8]
ramp = 1.0
text = open(path).read()
job = json.loads(text[text.index("{"):])["jobs"][0]
r, w = job["read"], job["write"]
side = r if r["io_bytes"] > 0 else w
moved = r["io_bytes"] + w["io_bytes"]
# Total latency (submission + completion): libnbd may read an answer that is already there
# while fio submits the next request, which moves time from clat into slat.
pct = side.get("lat_ns", {}).get("percentile", {})
def parse(snap):
    return {k: float(v) for k, v in (p.split("=") for p in snap.split())}
by_proc = None
if c0 and c1:
    a, b = parse(c0), parse(c1)
    # The CPU window includes fio's ramp, whose bytes fio does not count: scale it out.
    scale = float(runtime) / (float(runtime) + ramp)
    by_proc = {k: (b[k] - a[k]) / float(tck) * scale for k in a if k in b}
out = {
    "target": target, "row": row,
    "iops": side["iops"], "mib_s": side["bw_bytes"] / 2**20,
    "p50_us": pct.get("50.000000", 0) / 1000, "p99_us": pct.get("99.000000", 0) / 1000,
    "gib_moved": moved / 2**30,
    "fio_cpu_s": (job["usr_cpu"] + job["sys_cpu"]) / 100 * job["elapsed"],
    "server_cpu_by_proc_s": by_proc,
    "server_cpu_s": None if by_proc is None else sum(by_proc.values()),
}
out["server_cpu_s_per_gib"] = (
    None if out["server_cpu_s"] is None or moved == 0 else out["server_cpu_s"] / out["gib_moved"])
print(json.dumps(out))
PY
}

mkdir -p "$work"
: >"$results"
if [[ " $targets " == *" engine-file "* ]]; then
    engine_bin=${ENGINE_BIN:-$repo/target/release/examples/nbd_file}
    if [[ -z ${ENGINE_BIN:-} ]]; then
        log "building the engine example (release)"
        (cd "$repo" && cargo build -q --release -p zebu-engine --example nbd_file)
    fi
fi
if [[ " $targets " == *" zebu-"* ]]; then
    zebu_bin=${ZEBU_BIN_DIR:-$repo/target/release}
    if [[ -z ${ZEBU_BIN_DIR:-} ]]; then
        log "building zebu-engine and zebu-replica (release)"
        (cd "$repo" && cargo build -q --release -p zebu-engine -p zebu-replica \
            --bin zebu-engine --bin zebu-replica)
    fi
fi
size_bytes=$(numfmt --from=iec "$size")
load_start=$(cut -d' ' -f1-3 /proc/loadavg)

log "preparing $size of random data in $work"
head -c "$(numfmt --from=iec "$size")" /dev/urandom >"$work/seed.img"

for target in $targets; do
    target_file=$work/$target.img
    target_file=${target_file//:/_}
    cp --sparse=never "$work/seed.img" "$target_file"
    sync "$target_file"
    [[ $target == plain ]] || start_server "$target" "$target_file"
    log "target $target"
    run_row "$target" rr4k-qd32 randread 4k 32
    run_row "$target" rw4k-qd32 randwrite 4k 32
    run_row "$target" sr1m-qd8 read 1M 8
    run_row "$target" sw1m-qd8 write 1M 8
    run_row "$target" rw4k-qd1 randwrite 4k 1
    [[ ${#server_pids[@]} -gt 0 ]] && stop_server
    rm -f "$target_file"
done

load_end=$(cut -d' ' -f1-3 /proc/loadavg)
python3 - "$results" "$out_json" "$load_start" "$load_end" "$size" "$runtime" <<'PY'
import json, os, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
load_start, load_end, size, runtime = sys.argv[3:7]
def metric(r):
    return r["mib_s"] if r["row"].startswith("s") else r["iops"]
def find(target, row):
    return next((r for r in rows if r["target"] == target and r["row"] == row), None)
for r in rows:
    base = find("plain", r["row"])
    r["ratio_vs_plain"] = metric(r) / metric(base) if base and metric(base) else None
fmt = "{:<12} {:<10} {:>9} {:>9} {:>9} {:>9} {:>8} {:>9}  {}"
print(fmt.format("target", "row", "IOPS", "MiB/s", "p50 us", "p99 us", "x plain",
                 "CPU s/GiB", "CPU s by process"))
for r in rows:
    cpu = r["server_cpu_s_per_gib"]
    procs = r["server_cpu_by_proc_s"] or {}
    print(fmt.format(r["target"], r["row"], f'{r["iops"]:.0f}', f'{r["mib_s"]:.1f}',
                     f'{r["p50_us"]:.0f}' if r["row"] == "rw4k-qd1" else "",
                     f'{r["p99_us"]:.0f}' if r["row"] == "rw4k-qd1" else "",
                     "" if r["ratio_vs_plain"] is None else f'{r["ratio_vs_plain"]:.2f}',
                     "" if cpu is None else f"{cpu:.2f}",
                     " ".join(f"{k}={v:.1f}" for k, v in procs.items())))

goals = []
def goal(name, value, limit, ok):
    goals.append({"goal": name, "value": value, "limit": limit, "pass": ok})
def have(*keys):
    return all(find(t, row) for t, row in keys)
if have(("zebu-3r", "rw4k-qd32"), ("plain", "rw4k-qd32")):
    v, p = find("zebu-3r", "rw4k-qd32")["iops"], find("plain", "rw4k-qd32")["iops"]
    goal("zebu-3r rw4k-qd32 IOPS >= 0.8 x plain/3", v, 0.8 * p / 3, v >= 0.8 * p / 3)
for t in ("zebu-3r", "zebu-1r"):
    if have((t, "rr4k-qd32"), ("plain", "rr4k-qd32")):
        v, p = find(t, "rr4k-qd32")["iops"], find("plain", "rr4k-qd32")["iops"]
        goal(f"{t} rr4k-qd32 IOPS >= 0.7 x plain", v, 0.7 * p, v >= 0.7 * p)
    if have((t, "rw4k-qd1"), ("plain", "rw4k-qd1")):
        v, p = find(t, "rw4k-qd1")["p50_us"], find("plain", "rw4k-qd1")["p50_us"]
        goal(f"{t} rw4k-qd1 p50 us <= plain p50 + 100", v, p + 100, v <= p + 100)
for r in rows:
    if r["target"] == "zebu-1r" and find("nbdkit", r["row"]):
        k = find("nbdkit", r["row"])
        goal(f'zebu-1r {r["row"]} >= nbdkit', metric(r), metric(k), metric(r) >= metric(k))
print()
for g in goals:
    print(f'{"PASS" if g["pass"] else "FAIL"}  {g["goal"]}: {g["value"]:.0f} vs {g["limit"]:.0f}')
print(f"load average {load_start} -> {load_end}, {os.cpu_count()} CPUs")
json.dump({"method": "benches/nbd-bench.sh header", "size": size, "runtime_s": int(runtime),
           "cpus": os.cpu_count(), "kernel": os.uname().release,
           "load_start": load_start, "load_end": load_end,
           "rows": rows, "goals": goals}, open(sys.argv[2], "w"), indent=1)
PY
log "wrote $out_json"
rm -f "$work/seed.img"
