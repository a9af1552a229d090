#!/usr/bin/env bash
# NBD frontend benchmark: the engine's NBD server against references, in one run.
#
# Method
# ------
# Targets (TARGETS, space separated, run in order on the same machine in one invocation):
#   plain        the data file itself, fio ioengine=io_uring, direct=1 (the reference; ratios
#                are relative to it)
#   nbdkit       nbdkit's `file` plugin serving a copy of the data file over NBD on loopback
#   engine-file  the engine's NBD frontend over a FileDevice (engine/examples/nbd_file.rs)
#   cmd:NAME     any other NBD server: the command in $TARGET_CMD_NAME, with {PORT}, {FILE}
#                and {SIZE} substituted, must serve export "bench" on 127.0.0.1:{PORT} and stay
#                in the foreground (for the replicated engine with 1 and 3 replicas later).
# Every NBD target is driven by fio's `nbd` engine (libnbd, one connection, async queue).
# Each target gets its own copy of one random-filled file of SIZE bytes, so reads return
# real data rather than holes.
#
# Rows (RUNTIME seconds each, time based, one job, after a 1 s ramp):
#   rr4k-qd32   4 KiB random read,   iodepth 32       -> IOPS
#   rw4k-qd32   4 KiB random write,  iodepth 32       -> IOPS
#   sr1m-qd8    1 MiB sequential read, iodepth 8      -> MiB/s
#   sw1m-qd8    1 MiB sequential write, iodepth 8     -> MiB/s
#   rw4k-qd1    4 KiB random write,  iodepth 1        -> IOPS, p50 and p99 completion latency
# For each NBD row, the server process's CPU time (utime+stime from /proc/PID/stat, summed
# over its threads, read before and after the row) divided by the GiB fio moved gives
# "server CPU s/GiB". The plain target has no server, so that column is empty there.
#
# Caveats to keep in mind when reading the table: the plain reference uses O_DIRECT, while
# nbdkit's file plugin and FileDevice do buffered I/O, so their reads can come from the page
# cache and their writes are not durable until a flush (fio sends none here); nbdkit
# negotiates structured replies, the engine simple replies. The machine is shared, so
# compare rows of one run, not runs of different days.
#
# Usage: benches/nbd-bench.sh [OUT_JSON]      (default ./nbd-bench.json)
# Environment: TARGETS, SIZE (default 1G), RUNTIME (default 5), WORKDIR, ENGINE_BIN.
set -euo pipefail

out_json=${1:-nbd-bench.json}
targets=${TARGETS:-plain nbdkit engine-file}
size=${SIZE:-1G}
runtime=${RUNTIME:-5}
repo=$(cd "$(dirname "$0")/.." && pwd)
work=${WORKDIR:-$(mktemp -d /var/tmp/nbd-bench.XXXXXX)}
clk_tck=$(getconf CLK_TCK)
server_pid=
results=$work/results.jsonl

cleanup() {
    set +e
    [[ -n $server_pid ]] && kill "$server_pid" 2>/dev/null && wait "$server_pid" 2>/dev/null
    rm -f "$work"/*.img
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

start_server() {
    local target=$1 file=$2 port
    port=$(free_port)
    case $target in
        nbdkit)
            nbdkit -f -i 127.0.0.1 -p "$port" -e bench file "$file" &
            ;;
        engine-file)
            "$engine_bin" --listen "127.0.0.1:$port" --name bench --size "$size" \
                --file "$file" >/dev/null 2>"$work/engine.log" &
            ;;
        cmd:*)
            local var="TARGET_CMD_${target#cmd:}" cmd
            cmd=${!var:?set $var to the server command for target $target}
            cmd=${cmd//\{PORT\}/$port}
            cmd=${cmd//\{FILE\}/$file}
            cmd=${cmd//\{SIZE\}/$size}
            bash -c "exec $cmd" &
            ;;
        *) log "unknown target $target"; exit 2 ;;
    esac
    server_pid=$!
    wait_port "$port"
    uri="nbd://127.0.0.1:$port/bench"
}

stop_server() {
    kill "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
    server_pid=
}

# run_row TARGET ROW RW BS QD
run_row() {
    local target=$1 row=$2 rw=$3 bs=$4 qd=$5 engine_args c0 c1 json
    if [[ $target == plain ]]; then
        engine_args=(--ioengine=io_uring --direct=1 "--filename=$target_file")
    else
        engine_args=(--ioengine=nbd "--uri=$uri")
    fi
    [[ -n $server_pid ]] && c0=$(cpu_ticks "$server_pid")
    json=$work/$target-$row.json
    fio --name="$row" "${engine_args[@]}" --rw="$rw" --bs="$bs" --iodepth="$qd" \
        --size="$size" --time_based --runtime="$runtime" --ramp_time=1 --numjobs=1 \
        --randrepeat=0 --norandommap --output-format=json --output="$json" >/dev/null
    local cpu=null
    if [[ -n $server_pid ]]; then
        c1=$(cpu_ticks "$server_pid")
        cpu=$(python3 -c "print(($c1-$c0)/$clk_tck)")
    fi
    python3 - "$json" "$target" "$row" "$cpu" >>"$results" <<'PY'
import json, sys
path, target, row, cpu = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
text = open(path).read()
job = json.loads(text[text.index("{"):])["jobs"][0]
r, w = job["read"], job["write"]
side = r if r["io_bytes"] > 0 else w
moved = r["io_bytes"] + w["io_bytes"]
pct = side.get("clat_ns", {}).get("percentile", {})
out = {
    "target": target, "row": row,
    "iops": side["iops"], "mib_s": side["bw_bytes"] / 2**20,
    "p50_us": pct.get("50.000000", 0) / 1000, "p99_us": pct.get("99.000000", 0) / 1000,
    "gib_moved": moved / 2**30,
    "server_cpu_s": None if cpu == "null" else float(cpu),
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
    [[ -n $server_pid ]] && stop_server
    rm -f "$target_file"
done

python3 - "$results" "$out_json" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
ref = {r["row"]: r for r in rows if r["target"] == "plain"}
def metric(r):
    return r["mib_s"] if r["row"].startswith("s") else r["iops"]
for r in rows:
    base = ref.get(r["row"])
    r["ratio_vs_plain"] = metric(r) / metric(base) if base and metric(base) else None
fmt = "{:<14} {:<10} {:>10} {:>9} {:>9} {:>9} {:>8} {:>12}"
print(fmt.format("target", "row", "IOPS", "MiB/s", "p50 us", "p99 us", "x plain", "srv CPU s/GiB"))
for r in rows:
    cpu = r["server_cpu_s_per_gib"]
    print(fmt.format(r["target"], r["row"], f'{r["iops"]:.0f}', f'{r["mib_s"]:.1f}',
                     f'{r["p50_us"]:.1f}' if r["row"] == "rw4k-qd1" else "",
                     f'{r["p99_us"]:.1f}' if r["row"] == "rw4k-qd1" else "",
                     "" if r["ratio_vs_plain"] is None else f'{r["ratio_vs_plain"]:.2f}',
                     "" if cpu is None else f"{cpu:.2f}"))
json.dump({"method": "benches/nbd-bench.sh header", "rows": rows}, open(sys.argv[2], "w"), indent=1)
PY
log "wrote $out_json"
rm -f "$work/seed.img"
