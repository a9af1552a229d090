#!/usr/bin/env bash
# The durable write path (issue 19): what a database's commit waits for (a write, then a
# flush), Zebu against the disk's own limits, against a previous build, and under PostgreSQL,
# in one run.
#
# Targets (all on the same filesystem, WORKDIR, each measured ROUNDS times, the order of the
# targets rotated every round so that no target always runs on a warmer or quieter machine):
#   file        one plain file, fio psync, 4 KiB random writes at QD 1 with an fsync after
#               every write (fio --fsync=1): what one copy costs
#   file-x3     three plain files written and fsynced in parallel (three fio jobs, IOPS summed
#               and divided by 3, so per stream): the most this one disk gives three copies
#   zebu-3r     `zebu-engine serve` over three `zebu-replica serve` on 127.0.0.11, .12, .13
#               (.11 is the engine's node: replica 1 uses its local socket, the others TCP),
#               fio's nbd engine (libnbd), the same 4 KiB random writes, NBD_CMD_FLUSH after
#               every write
#   prev-3r     the same with the binaries in PREV_BIN_DIR (only when it is set)
#   zebu-iscsi  the same volume over the engine's iSCSI target: `qemu-img bench` (qemu's
#               libiscsi driver; fio here has no iSCSI engine) writing 4 KiB at QD 1 with a
#               SYNCHRONIZE CACHE after every write (--flush-interval=1). qemu-img bench
#               writes sequentially (it has no random mode) and reports IOPS only.
#   prev-iscsi  the same with PREV_BIN_DIR
#   zebu-iscsi-fua  the same writes sent with FUA instead of a SYNCHRONIZE CACHE after each
#               (`qemu-img bench -t directsync`: qemu's write-through mode sets FUA on every
#               write when the target reports DPOFUA, as the engine's does): what a journal
#               commit block or an O_DSYNC write costs a Linux initiator
#   prev-iscsi-fua  the same with PREV_BIN_DIR
#   pg-plain    PostgreSQL 15 (Debian's, /usr/lib/postgresql/15/bin) on ext4 on a file served
#               by nbdkit's file plugin, attached through nbdfuse and a loop device with
#               direct I/O (as tests/scripts/fs-on-nbd.sh does); pgbench scale PG_SCALE,
#               synchronous_commit=on, PG_RUNTIME s with 1 client, then with 8
#   pg-zebu     the same on a 3-replica Zebu volume through the same nbdfuse + loop path
#   pg-prev     the same with PREV_BIN_DIR
# The plain files and the Zebu volumes of the fio and qemu-img rows are filled with random data
# first (not timed; the volumes by `nbdcopy --flush`), so writes overwrite allocated blocks
# everywhere. The pgbench targets start from an empty (sparse) file or volume of PG_SIZE,
# made, formatted and initialised (`pgbench -i`) anew in every round.
#
# Reported: per target IOPS per round and their median; for fio rows the p50 of the write's
# own latency and of the flush's (fio `lat`); for pgbench TPS per run; where the build has
# them, the engine's time counters (`engine/src/pathtime.rs`, from `zebu-engine info`) and
# every replica's (`replica/src/pathtime.rs`, logged on SIGUSR1), as mean µs per write and per
# flush over the fio run; and the goals of issue 19:
#   zebu-3r IOPS >= 2 x prev-3r IOPS (when PREV_BIN_DIR is given)
#   zebu-3r IOPS >= 0.4 x file-x3 IOPS (per stream)
#   pg-zebu TPS >= 0.9 x pg-plain TPS with 1 client, >= 0.8 x with 8 (medians)
#
# A previous build: a directory holding release `zebu-engine` and `zebu-replica`, e.g. from a
# worktree at the commit to compare with:
#   git worktree add /tmp/prev COMMIT && cd /tmp/prev &&
#   cargo build --release -p zebu-engine -p zebu-replica --bin zebu-engine --bin zebu-replica
#   mkdir -p /var/tmp/prev && cp target/release/zebu-{engine,replica} /var/tmp/prev/
#
# Usage: benches/durable-bench.sh [OUT_JSON]       (default ./durable-bench.json)
# Environment: ZEBU_BIN_DIR (default target/release, built when not given), PREV_BIN_DIR,
# ROUNDS (3), RUNTIME (10 s per fio row, after a 1 s ramp), SIZE (1G), ISCSI_COUNT (4000
# writes per qemu-img row), PG_SIZE (2G), PG_SCALE (20), PG_RUNTIME (20 s per pgbench run),
# WORKDIR (a new directory under /var/tmp), TARGETS (default "file file-x3 zebu-3r prev-3r
# zebu-iscsi prev-iscsi zebu-iscsi-fua prev-iscsi-fua pg-plain pg-zebu"), ZEBU_REPLICA_ARGS, ZEBU_ENGINE_ARGS (extra words
# for every `serve` line), ZEBU_LOCAL_HOST (127.0.0.11).
# Needs root for the pgbench targets (FUSE, loop devices, mount; PostgreSQL runs as the
# `postgres` user). The machine is shared: compare rows of one run only.
set -euo pipefail

out_json=${1:-durable-bench.json}
rounds=${ROUNDS:-3}
runtime=${RUNTIME:-10}
size=${SIZE:-1G}
iscsi_count=${ISCSI_COUNT:-4000}
pg_size=${PG_SIZE:-2G}
pg_scale=${PG_SCALE:-20}
pg_runtime=${PG_RUNTIME:-20}
pg_bin=${PG_BIN:-/usr/lib/postgresql/15/bin}
repo=$(cd "$(dirname "$0")/.." && pwd)
work=${WORKDIR:-$(mktemp -d /var/tmp/durable-bench.XXXXXX)}
targets=${TARGETS:-file file-x3 zebu-3r prev-3r zebu-iscsi prev-iscsi zebu-iscsi-fua prev-iscsi-fua pg-plain pg-zebu}
server_pids=()
replica_pids=()
results=$work/results.jsonl
fuse_dir=$work/fuse
mnt=$work/mnt
loopdev=
fuse_pid=

log() { echo "durable-bench: $*" >&2; }

cleanup() {
    set +e
    pg_down
    detach
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

# start_zebu BIN_DIR BYTES [FILL]: three replicas and an engine serving export "bench" over
# NBD (nbd_url) and iSCSI (iscsi_url); with FILL=fill the volume is filled with the seed file.
start_zebu() {
    local bin=$1 bytes=$2 fill=${3:-} i dir addr pid args=()
    replica_pids=()
    for i in 1 2 3; do
        dir=$work/zebu-r$i
        rm -rf "$dir"
        # shellcheck disable=SC2086
        "$bin/zebu-replica" serve --dir "$dir" --listen "127.0.0.1$i:0" \
            --size "$bytes" ${ZEBU_REPLICA_ARGS:-} >"$dir.out" 2>"$dir.log" &
        pid=$!
        server_pids+=("$pid")
        replica_pids+=("$pid")
        addr=$(wait_line "$dir.out" "listening on " "$pid")
        args+=(--replica "$addr")
    done
    local local_host=${ZEBU_LOCAL_HOST-127.0.0.11}
    [[ -n $local_host ]] && args+=(--local-host "$local_host")
    local nbd_port iscsi_port
    nbd_port=$(free_port)
    iscsi_port=$(free_port)
    # shellcheck disable=SC2086
    "$bin/zebu-engine" serve --volume bench --size "$bytes" "${args[@]}" \
        --control 127.0.0.1:0 --frontend nbd --nbd-listen "127.0.0.1:$nbd_port" \
        --frontend iscsi --iscsi-listen "127.0.0.1:$iscsi_port" \
        ${ZEBU_ENGINE_ARGS:-} >"$work/engine.out" 2>"$work/engine.log" &
    pid=$!
    server_pids=("$pid" "${server_pids[@]}")
    wait_line "$work/engine.out" "ready" "$pid" >/dev/null
    engine_control=$(wait_line "$work/engine.out" "control " "$pid")
    nbd_url="nbd://127.0.0.1:$nbd_port/bench"
    iscsi_url=$(wait_line "$work/engine.out" "iscsi " "$pid")
    if [[ $fill == fill ]]; then
        nbdcopy --flush "$work/seed.img" "$nbd_url"
    fi
}

# engine_counters BIN_DIR: the engine's write and flush time counters (`pathtime.rs`; absent
# in builds before them), as one JSON object.
engine_counters() {
    "$1/zebu-engine" --control "$engine_control" --json info 2>/dev/null |
        python3 -c 'import json,sys; print(json.dumps(json.load(sys.stdin).get("dataPath")))' ||
        echo null
}

# replica_counters BIN_DIR: every replica's step counters (`replica/src/pathtime.rs`), logged
# on SIGUSR1 by builds that have them (older builds would die of the signal: not sent), as a
# JSON list.
replica_counters() {
    local bin=$1 i n
    if ! grep -q "path times" "$bin/zebu-replica"; then
        echo null
        return
    fi
    local before=()
    for i in 1 2 3; do
        before+=("$(grep -c 'path times' "$work/zebu-r$i.log" || true)")
        kill -USR1 "${replica_pids[$((i - 1))]}"
    done
    for i in 1 2 3; do
        for _ in $(seq 1 50); do
            n=$(grep -c 'path times' "$work/zebu-r$i.log" || true)
            ((n > before[i - 1])) && break
            sleep 0.05
        done
    done
    python3 - "$work"/zebu-r{1,2,3}.log <<'PY'
import json, sys
out = []
for path in sys.argv[1:]:
    lines = [l for l in open(path, errors="replace") if "path times " in l]
    out.append(json.loads(lines[-1].split("path times ", 1)[1]) if lines else None)
print(json.dumps(out))
PY
}

stop_server() {
    local pid
    for pid in "${server_pids[@]}"; do
        kill "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    server_pids=()
    replica_pids=()
}

# record TARGET ROUND JSON STREAMS [ENGINE_BEFORE ENGINE_AFTER REPLICAS_BEFORE REPLICAS_AFTER]:
# one result line from fio's JSON (jobs summed).
record() {
    python3 - "$@" >>"$results" <<'PY'
import json, sys
target, rnd, path, streams = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
extra = (sys.argv[5:9] + [""] * 4)[:4]
eb, ea, rb, ra = (json.loads(a) if a else None for a in extra)
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
def replica_means(before, after):
    # Per replica: mean µs of each step per write (steps named write*) or per flush (flush*,
    # markCommit per write), over the fio run.
    if not before or not after:
        return None
    out = []
    for b, a in zip(before, after):
        if not b or not a:
            out.append(None)
            continue
        d = {k: (a[k]["count"] - b[k]["count"], a[k]["ns"] - b[k]["ns"]) for k in a if k in b}
        writes = d.get("writeStore", (0, 0))[0]
        flushes = d.get("flushStore", (0, 0))[0]
        m = {"writes": writes, "flushes": flushes, "markCommits": d.get("markCommit", (0, 0))[0]}
        for k, (n, ns) in d.items():
            per = flushes if k.startswith("flush") else writes
            if per > 0:
                m[k + "_us"] = ns / per / 1000
        out.append(m)
    return out
def p50(side):
    ns = side.get("lat_ns", {}).get("percentile", {}).get("50.000000")
    return None if ns is None else ns / 1000
print(json.dumps({
    "target": target, "round": rnd, "iops": iops, "iops_per_stream": iops / streams,
    "write_p50_us": p50(jobs[0]["write"]), "sync_p50_us": p50(jobs[0].get("sync", {})),
    "engine": engine_means(eb, ea), "replicas": replica_means(rb, ra),
}))
PY
}

# record_simple TARGET ROUND KEY VALUE [CLIENTS]: a result line with one figure.
record_simple() {
    python3 - "$@" >>"$results" <<'PY'
import json, sys
target, rnd, key, value = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
row = {"target": target, "round": rnd, key: value}
if len(sys.argv) > 5:
    row["clients"] = int(sys.argv[5])
print(json.dumps(row))
PY
}

fio_common=(--rw=randwrite --bs=4k --iodepth=1 --fsync=1 --time_based "--runtime=$runtime"
    --ramp_time=1 --randrepeat=0 --norandommap --lat_percentiles=1 --output-format=json)

# --- pgbench on ext4 over nbdfuse + a direct-I/O loop device --------------------------------

# attach URL: the export as a file through nbdfuse, a loop device with direct I/O on it, ext4
# on that, mounted at $mnt.
attach() {
    mkdir -p "$fuse_dir" "$mnt"
    nbdfuse "$fuse_dir/disk" "$1" &
    fuse_pid=$!
    for _ in $(seq 1 100); do
        [[ -e $fuse_dir/disk ]] && break
        kill -0 "$fuse_pid" 2>/dev/null || { log "nbdfuse exited"; return 1; }
        sleep 0.1
    done
    loopdev=$(losetup --find --show --direct-io=on "$fuse_dir/disk")
    mkfs.ext4 -q -F "$loopdev"
    mount "$loopdev" "$mnt"
}

detach() {
    if mountpoint -q "$mnt" 2>/dev/null; then umount "$mnt" || umount -l "$mnt"; fi
    [[ -n $loopdev ]] && losetup -d "$loopdev"
    loopdev=
    if mountpoint -q "$fuse_dir" 2>/dev/null; then fusermount3 -u "$fuse_dir" || umount -l "$fuse_dir"; fi
    [[ -n $fuse_pid ]] && wait "$fuse_pid" 2>/dev/null
    fuse_pid=
    return 0
}

pg() { runuser -u postgres -- "$@"; }

pg_down() {
    if [[ -f $mnt/pg/data/postmaster.pid ]]; then
        pg "$pg_bin/pg_ctl" -D "$mnt/pg/data" -m fast -w stop >/dev/null 2>&1 || true
    fi
}

# pgbench_on URL TARGET ROUND: PostgreSQL on a fresh filesystem on URL, initialised at scale
# PG_SCALE, then pgbench with 1 and 8 clients; one result line per run.
pgbench_on() {
    local url=$1 target=$2 rnd=$3 sock=$work/pgsock c tps
    attach "$url"
    mkdir -p "$mnt/pg" "$sock"
    chown postgres: "$mnt/pg" "$sock"
    pg "$pg_bin/initdb" -D "$mnt/pg/data" -N -A trust -U postgres >/dev/null
    cat >>"$mnt/pg/data/postgresql.conf" <<EOF
listen_addresses = ''
unix_socket_directories = '$sock'
fsync = on
synchronous_commit = on
full_page_writes = on
EOF
    local pglog=$work/pg-$target-$rnd.log
    : >"$pglog"
    chown postgres: "$pglog"
    pg "$pg_bin/pg_ctl" -D "$mnt/pg/data" -l "$pglog" -w start >/dev/null
    pg "$pg_bin/pgbench" -h "$sock" -i -q -s "$pg_scale" postgres >/dev/null 2>&1
    pg "$pg_bin/psql" -h "$sock" -q -c checkpoint postgres
    for c in 1 8; do
        tps=$(pg "$pg_bin/pgbench" -h "$sock" -c "$c" -j "$c" -T "$pg_runtime" postgres 2>&1 |
            awk '/^tps = /{print $3; exit}')
        log "$target round $rnd, $c client(s): $tps TPS"
        record_simple "$target" "$rnd" tps "${tps:-0}" "$c"
    done
    pg_down
    detach
}

run_target() {
    local target=$1 rnd=$2 json=$work/$1-$2.json bin
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
            bin=$zebu_bin
            [[ $target == prev-* ]] && bin=$PREV_BIN_DIR
            local eb ea rb ra
            start_zebu "$bin" "$size_bytes" fill
            eb=$(engine_counters "$bin")
            rb=$(replica_counters "$bin")
            fio --name="$target" --ioengine=nbd "--uri=$nbd_url" \
                "--size=$size" "${fio_common[@]}" --output="$json" >/dev/null
            ea=$(engine_counters "$bin")
            ra=$(replica_counters "$bin")
            stop_server
            record "$target" "$rnd" "$json" 1 "$eb" "$ea" "$rb" "$ra"
            ;;
        zebu-iscsi | prev-iscsi | zebu-iscsi-fua | prev-iscsi-fua)
            bin=$zebu_bin
            [[ $target == prev-* ]] && bin=$PREV_BIN_DIR
            start_zebu "$bin" "$size_bytes" fill
            local secs durable=(-t none --flush-interval=1)
            [[ $target == *-fua ]] && durable=(-t directsync)
            qemu-img bench -f raw "${durable[@]}" -w -d 1 -c "$iscsi_count" -s 4k -S 4k \
                "$iscsi_url" >"$work/$target-$rnd.txt" 2>&1 || true
            secs=$(awk '/Run completed in/{print $4}' "$work/$target-$rnd.txt")
            stop_server
            if [[ -z $secs ]]; then
                log "$target: qemu-img bench failed (needs qemu-block-extra for iscsi://):"
                cat "$work/$target-$rnd.txt" >&2
                exit 1
            fi
            record_simple "$target" "$rnd" iops "$(python3 -c "print($iscsi_count / $secs)")"
            ;;
        pg-plain)
            local port pid
            port=$(free_port)
            truncate -s "$pg_size" "$work/pg.img"
            nbdkit -f -p "$port" -i 127.0.0.1 file "$work/pg.img" 2>"$work/nbdkit.log" &
            pid=$!
            server_pids+=("$pid")
            for _ in $(seq 1 100); do
                nbdinfo --size "nbd://127.0.0.1:$port" >/dev/null 2>&1 && break
                sleep 0.1
            done
            pgbench_on "nbd://127.0.0.1:$port" "$target" "$rnd"
            stop_server
            rm -f "$work/pg.img"
            ;;
        pg-zebu | pg-prev)
            bin=$zebu_bin
            [[ $target == pg-prev ]] && bin=$PREV_BIN_DIR
            start_zebu "$bin" "$(numfmt --from=iec "$pg_size")"
            pgbench_on "$nbd_url" "$target" "$rnd"
            stop_server
            ;;
        *) log "unknown target $target"; exit 2 ;;
    esac
}

mkdir -p "$work"
chmod 755 "$work"
: >"$results"
zebu_bin=${ZEBU_BIN_DIR:-$repo/target/release}
if [[ -z ${ZEBU_BIN_DIR:-} ]]; then
    log "building zebu-engine and zebu-replica (release)"
    (cd "$repo" && cargo build -q --release -p zebu-engine -p zebu-replica \
        --bin zebu-engine --bin zebu-replica)
fi
list=()
for t in $targets; do
    [[ $t == *prev* && -z ${PREV_BIN_DIR:-} ]] && continue
    list+=("$t")
done
size_bytes=$(numfmt --from=iec "$size")
load_start=$(cut -d' ' -f1-3 /proc/loadavg)
log "uptime at the start: $(uptime)"
if [[ " ${list[*]} " =~ \ (file|file-x3|zebu-3r|prev-3r|zebu-iscsi|prev-iscsi|zebu-iscsi-fua|prev-iscsi-fua)\  ]]; then
    log "preparing $size of random data and three plain files in $work"
    head -c "$size_bytes" /dev/urandom >"$work/seed.img"
    for f in f1 f2 f3; do cp --sparse=never "$work/seed.img" "$work/$f.img"; done
    sync
fi

for rnd in $(seq 1 "$rounds"); do
    n=${#list[@]}
    for k in $(seq 0 $((n - 1))); do
        t=${list[$(((k + rnd - 1) % n))]}
        log "round $rnd: $t"
        run_target "$t" "$rnd"
    done
done

load_end=$(cut -d' ' -f1-3 /proc/loadavg)
log "uptime at the end: $(uptime)"
python3 - "$results" "$out_json" "$load_start" "$load_end" "$runtime" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
load_start, load_end, runtime = sys.argv[3:6]
def key(r):
    return r["target"] + (f" c{r['clients']}" if "clients" in r else "")
keys = list(dict.fromkeys(key(r) for r in rows))
summary = {}
def med(rs, k):
    vals = [r[k] for r in rs if r.get(k) is not None]
    return statistics.median(vals) if vals else None
for t in keys:
    rs = [r for r in rows if key(r) == t]
    if "tps" in rs[0]:
        summary[t] = {"tps": med(rs, "tps"), "rounds": [round(r["tps"]) for r in rs]}
    else:
        figure = "iops_per_stream" if "iops_per_stream" in rs[0] else "iops"
        summary[t] = {"iops": med(rs, figure), "write_p50_us": med(rs, "write_p50_us"),
                      "sync_p50_us": med(rs, "sync_p50_us"),
                      "rounds": [round(r[figure]) for r in rs]}
fmt = "{:<13} {:>9} {:>11} {:>11}  {}"
print(fmt.format("target", "median", "write p50", "flush p50", "per round"))
for t, s in summary.items():
    f = lambda v: "" if v is None else f"{v:.0f}"
    fig = s.get("iops", s.get("tps"))
    unit = "TPS" if "tps" in s else "IOPS"
    print(fmt.format(t, f(fig), f(s.get("write_p50_us")), f(s.get("sync_p50_us")),
                     " ".join(map(str, s["rounds"]))) + f"  ({unit})")
goals = []
def goal(name, value, limit):
    if value is not None and limit is not None:
        goals.append({"goal": name, "value": value, "limit": limit, "pass": value >= limit})
fig = lambda t, k="iops": summary.get(t, {}).get(k)
z = fig("zebu-3r")
if z is not None and fig("prev-3r") is not None:
    goal("zebu-3r IOPS >= 2 x prev-3r", z, 2 * fig("prev-3r"))
if z is not None and fig("file-x3") is not None:
    goal("zebu-3r IOPS >= 0.4 x file-x3 per stream", z, 0.4 * fig("file-x3"))
for c, share in ((1, 0.9), (8, 0.8)):
    pz, pp = fig(f"pg-zebu c{c}", "tps"), fig(f"pg-plain c{c}", "tps")
    if pz is not None and pp is not None:
        goal(f"pg-zebu TPS >= {share} x pg-plain, {c} client(s)", pz, share * pp)
for t in keys:
    eng = [r["engine"] for r in rows if key(r) == t and r.get("engine")]
    for kind in ("writes", "flushes"):
        es = [e[kind] for e in eng if kind in e]
        if es:
            m = lambda k: statistics.median(e[k] for e in es)
            print(f"{t} engine {kind}: mean µs frontend {m('frontend_us'):.0f}, replicator "
                  f"{m('replicator_us'):.0f} (of it waiting for the replicas {m('transport_us'):.0f})")
    reps = [r["replicas"] for r in rows if key(r) == t and r.get("replicas")]
    for i in range(3):
        per = [rep[i] for rep in reps if len(rep) > i and rep[i]]
        if not per:
            continue
        steps = sorted({k for p in per for k in p if k.endswith("_us")})
        m = {k: statistics.median(p.get(k, 0) for p in per) for k in steps}
        print(f"{t} replica {i + 1} mean µs: " + ", ".join(f"{k[:-3]} {v:.0f}" for k, v in m.items())
              + f"; mark commits per round {statistics.median(p['markCommits'] for p in per):.0f}")
for g in goals:
    print(f'{"PASS" if g["pass"] else "FAIL"}  {g["goal"]}: {g["value"]:.0f} (limit {g["limit"]:.0f})')
print(f"load average: start {load_start}, end {load_end}; {runtime} s per fio row")
json.dump({"rows": rows, "summary": summary, "goals": goals, "load_start": load_start,
           "load_end": load_end}, open(sys.argv[2], "w"), indent=1)
PY
