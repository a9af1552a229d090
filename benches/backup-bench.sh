#!/usr/bin/env bash
# Issue 16's backup case, through the manager, to a real S3 server on 127.0.0.1, against
# references measured in the same run on the same machine:
#
#   1. a SIZE volume (default 4G) holding random data in its first half and holes in the
#      second; a full backup;
#   2. 256 MiB rewritten in one region and 2,000 random 4 KiB writes; an incremental backup;
#   3. a restore of each backup into a new REPLICAS-replica volume, compared byte for byte
#      with the volume at that backup's snapshot (whole devices);
#   references: `nbdcopy` of the volume to null: (reading it through the data path),
#   `nbdcopy` of the image into a new volume (writing it), `restic` (Debian) backing up and
#   restoring the same image to the same server, and the server's own ceiling (parallel
#   PUT/GET of 64 MiB objects, benches/s3-ceiling.sh).
#
# For each backup: bytes read from the replica, bytes and objects uploaded, time, and the
# peak RSS of the `zebu-backup-run` process; for each restore: time, bytes downloaded, peak
# RSS. The goals of the issue are checked and printed PASS or FAIL.
#
#   benches/backup-bench.sh [OUT.txt]
#   env: SIZE=4G REPLICAS=3 SERVER=moto|gofakes3|seaweedfs|versitygw WORKDIR=/var/tmp/backup-bench
#        ZEBU_BIN_DIR=target/release
#
# SERVER=moto (default) is the Python server the tests use; gofakes3 (Go, in memory) and
# seaweedfs and versitygw (Go, on disk) are faster servers, built once by benches/s3-server.sh into
# /var/cache/zebu-tools, to see Zebu's own limits. Needs: zebu, zebu-engine,
# zebu-replica, zebu-backup-run in ZEBU_BIN_DIR (`cargo build --release --workspace --bins`),
# nbdcopy, qemu-io, restic, curl, jq, python3 (and the moto venv of
# backupstore/scripts/moto-venv.sh, also used for boto3). Disk: at most about
# (1.5 × REPLICAS + 2) × the data size under WORKDIR at once (the source volume is deleted
# after its backups, each restored volume after its comparison); the server keeps objects in
# memory (about 2.5 × the data).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
out="${1:-}"
SIZE="${SIZE:-4G}"
REPLICAS="${REPLICAS:-3}"
SERVER="${SERVER:-moto}"
WORKDIR="${WORKDIR:-/var/tmp/backup-bench}"
if [ -z "${ZEBU_BIN_DIR:-}" ]; then
  if [ -x target/release/zebu ]; then ZEBU_BIN_DIR=$root/target/release; else ZEBU_BIN_DIR=$root/target/debug; fi
fi
export ZEBU_BIN_DIR
zebu="$ZEBU_BIN_DIR/zebu"
for t in "$zebu" "$ZEBU_BIN_DIR/zebu-engine" "$ZEBU_BIN_DIR/zebu-replica" "$ZEBU_BIN_DIR/zebu-backup-run"; do
  [ -x "$t" ] || { echo "backup-bench: $t is missing (cargo build --workspace --bins)" >&2; exit 2; }
done
for t in nbdcopy qemu-io restic curl jq python3; do
  command -v "$t" >/dev/null || { echo "backup-bench: $t is missing" >&2; exit 2; }
done

bytes=$(python3 -c "import sys;s=sys.argv[1];u={'K':1<<10,'M':1<<20,'G':1<<30}.get(s[-1].upper());print(int(s[:-1])*u if u else int(s))" "$SIZE")
data=$((bytes / 2))
mib=$((1 << 20))

rm -rf "$WORKDIR"
mkdir -p "$WORKDIR"
uptime_start=$(uptime)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  sleep 1
  # The cluster's engines, replicas and upload processes run in their own process groups.
  for p in $(pgrep -f "$WORKDIR/cluster" || true); do kill -9 "$p" 2>/dev/null || true; done
  [ -n "${KEEP:-}" ] || rm -rf "$WORKDIR" # KEEP=1 keeps the logs
}
trap cleanup EXIT

now() { date +%s.%N; }
# The whole machine's CPU: "busy idle" jiffies so far, and the busy share between two of those.
cpu_snap() { awk '/^cpu /{print $2+$3+$4+$7+$8+$9, $5+$6}' /proc/stat; }
# CPU seconds of every process, by pid (command name, utime + stime), and the difference of two
# such snapshots grouped by command name: where a step's CPU went. A process that ends inside
# the step (the backup job) is missing; the job reports its own CPU time in its log.
proc_cpu() { python3 - <<'PY'
import os
hz = os.sysconf("SC_CLK_TCK")
for pid in os.listdir("/proc"):
    if not pid.isdigit():
        continue
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        continue
    comm = stat[stat.index("(") + 1:stat.rindex(")")].replace(" ", "_")
    f = stat[stat.rindex(")") + 2:].split()
    print(pid, comm, (int(f[11]) + int(f[12])) / hz)
PY
}
proc_cpu_diff() { python3 - "$1" "$2" <<'PY'
import sys
def load(path):
    return {l.split()[0]: (l.split()[1], float(l.split()[2])) for l in open(path)}
a, b = load(sys.argv[1]), load(sys.argv[2])
by = {}
for pid, (comm, t) in b.items():
    d = t - a.get(pid, (comm, 0.0))[1]
    if d > 0:
        by[comm] = by.get(comm, 0.0) + d
top = sorted(by.items(), key=lambda kv: -kv[1])
print(", ".join(f"{c} {t:.1f}" for c, t in top if t >= 0.1) or "-")
PY
}
busy_pct() { python3 -c "import sys;a=sys.argv[1].split();b=sys.argv[2].split();db=int(b[0])-int(a[0]);di=int(b[1])-int(a[1]);print(f'{100*db/max(1,db+di):.0f}')" "$1" "$2"; }
since() { python3 -c "import sys;print(f'{float(sys.argv[2])-float(sys.argv[1]):.2f}')" "$1" "$(now)"; }
rate() { python3 -c "import sys;print(f'{int(sys.argv[1])/float(sys.argv[2])/1048576:.1f}')" "$1" "$2"; }
ratio() { python3 -c "import sys;print(f'{float(sys.argv[1])/float(sys.argv[2]):.3f}')" "$1" "$2"; }
verdict() { python3 -c "import sys;print('PASS' if eval(sys.argv[1]) else 'FAIL')" "$1"; }
free_port() { python3 -c "import socket;s=socket.socket();s.bind(('127.0.0.1',0));print(s.getsockname()[1])"; }

# --- the S3 server
export AWS_ACCESS_KEY_ID=testing AWS_SECRET_ACCESS_KEY=testing AWS_REGION=us-east-1
port=$(free_port)
case "$SERVER" in
  moto | gofakes3 | seaweedfs | versitygw) ;;
  *) echo "backup-bench: SERVER is moto, gofakes3, seaweedfs or versitygw" >&2; exit 2 ;;
esac
bash backupstore/scripts/moto-venv.sh >/dev/null # boto3 for the ceiling
bash benches/s3-server.sh path "$SERVER" >/dev/null # builds it once, outside the run
server_desc=$(bash benches/s3-server.sh describe "$SERVER")
bash benches/s3-server.sh run "$SERVER" "$port" "$WORKDIR/s3" >"$WORKDIR/s3.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 300); do curl -s -o /dev/null "http://127.0.0.1:$port/" && break; sleep 0.2; done
export AWS_ENDPOINT_URL="http://127.0.0.1:$port"
# Signed requests through boto3 (seaweedfs refuses anonymous ones).
py="$(dirname "$(bash backupstore/scripts/moto-venv.sh)")/python3"
s3py() { "$py" - "$@" <<'PY'
import os, sys, time
import boto3
s3 = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], region_name="us-east-1")
cmd = sys.argv[1]
if cmd == "mkbucket":
    # (seaweedfs answers before its volume server has joined: retry until the bucket is there)
    for _ in range(100):
        try:
            s3.create_bucket(Bucket="bench")
        except Exception:
            pass
        try:
            s3.list_objects_v2(Bucket="bench")
            break
        except Exception:
            time.sleep(0.3)
elif cmd == "count":
    n = size = 0
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket="bench", Prefix=sys.argv[2]):
        for o in page.get("Contents", []):
            n += 1
            size += o["Size"]
    print(n, size)
PY
}
s3py mkbucket
count_objects() { s3py count "$1"; } # prefix -> "objects bytes"

# --- the server's ceiling (before anything else loads it)
res=$(S3_CEILING="$ZEBU_BIN_DIR/examples/s3_ceiling" bash benches/s3-ceiling.sh "$AWS_ENDPOINT_URL" bench 8 4)
read -r ceil_put ceil_get rust_put rust_get <<<"$res"

# --- peak RSS of the backup and restore processes: a sampler of VmHWM (the kernel's peak)
# (and of the restored volumes' replica processes, which start with their volume: their
# VmHWM is what receiving and writing the restore cost them)
rss_log="$WORKDIR/rss.log"
replica_rss_log="$WORKDIR/replica-rss.log"
hwm() { sed -n 's/^VmHWM:[[:space:]]*\([0-9]*\) kB/\1/p' "/proc/$1/status" 2>/dev/null || true; }
(
  while :; do
    t=$(date +%s.%N)
    for p in $(pgrep -x zebu-backup-run || true); do
      h=$(hwm "$p")
      [ -n "$h" ] && echo "$t $p $h"
    done
    for p in $(pgrep -f "$WORKDIR/cluster/.*/replicas/dst-" || true); do
      h=$(hwm "$p")
      [ -n "$h" ] && echo "$t $p $h" >>"$replica_rss_log"
    done
    sleep 0.25
  done >"$rss_log"
) &
pids+=($!)
peak_rss() { # t0 t1 [log] -> MiB (the largest VmHWM seen between them)
  python3 - "${3:-$rss_log}" "$1" "$2" <<'PY'
import sys
log, t0, t1 = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
peak = 0
try:
    for line in open(log):
        p = line.split()
        if len(p) == 3 and t0 <= float(p[0]) <= t1:
            peak = max(peak, int(p[2]))
except FileNotFoundError:
    pass
print(f"{peak / 1024:.0f}")
PY
}

# --- the cluster
api_port=$(free_port)
export ZEBU_API="http://127.0.0.1:$api_port"
"$zebu" up --nodes "$REPLICAS" --listen "127.0.0.1:$api_port" --first-node-address 127.0.0.61 \
  --setting storage-minimal-available-percentage=0 --data-dir "$WORKDIR/cluster" \
  >"$WORKDIR/up.out" 2>"$WORKDIR/up.log" &
pids+=($!)
for _ in $(seq 1 300); do "$zebu" node ls >/dev/null 2>&1 && break; sleep 0.2; done
"$zebu" backup target set "s3://bench@us-east-1/zebu" >/dev/null
make_volume() { "$zebu" volume create "$1" --size "$SIZE" --replicas "$REPLICAS" --frontend nbd >/dev/null; }
wait_restored() {
  for _ in $(seq 1 14400); do
    s=$("$zebu" volume get "$1" -o json | jq -r '.status.restore.state // ""')
    [ "$s" = completed ] && return 0
    [ "$s" = error ] && { "$zebu" volume get "$1" -o json | jq .status.restore >&2; exit 1; }
    sleep 0.25 # (each poll is a zebu and a jq process: 0.1 s cost ~7 % of the CPU)
  done
  exit 1
}

# --- the source image: random data in the first half, holes in the second.
img="$WORKDIR/source.img"
# (openssl dies of SIGPIPE when head has enough: a process substitution keeps that
# out of pipefail.)
head -c "$data" < <(openssl enc -aes-128-ctr -nosalt -pass pass:zebu-backup-bench -in /dev/zero 2>/dev/null) >"$img"
[ "$(stat -c %s "$img")" = "$data" ] || { echo "backup-bench: source image short" >&2; exit 1; }
truncate -s "$bytes" "$img"
make_volume src
ep=$("$zebu" volume attach src)
nbdcopy "$img" "$ep"
sync

# --- reference: nbdcopy of the volume to null (the read side of the data path)
proc_cpu >"$WORKDIR/cpu-read.before"
c0=$(cpu_snap); t0=$(now); nbdcopy "$ep" null:; t_read=$(since "$t0"); busy_read=$(busy_pct "$c0" "$(cpu_snap)")
proc_cpu >"$WORKDIR/cpu-read.after"
proc_cpu_diff "$WORKDIR/cpu-read.before" "$WORKDIR/cpu-read.after" >"$WORKDIR/cpu-read.txt"

# --- backups
backup() { # name -> "time read uploaded objects rss busy%"
  local t0 t b c0
  t0=$(now)
  c0=$(cpu_snap)
  proc_cpu >"$WORKDIR/cpu-$1.before"
  "$zebu" backup create src --name "$1" --wait >"$WORKDIR/backup-$1.out" 2>&1
  t=$(since "$t0")
  local busy; busy=$(busy_pct "$c0" "$(cpu_snap)")
  proc_cpu >"$WORKDIR/cpu-$1.after"
  proc_cpu_diff "$WORKDIR/cpu-$1.before" "$WORKDIR/cpu-$1.after" >"$WORKDIR/cpu-$1.txt"
  b=$("$zebu" backup get "$1" -o json)
  echo "$t $(jq -r .status.read <<<"$b") $(jq -r .status.uploaded <<<"$b") $(jq -r '.status.objects // 0' <<<"$b") $(peak_rss "$t0" "$(now)") $busy"
}
res=$(backup full)
read -r t_full read_full up_full objs_full rss_full busy_full <<<"$res"
read -r objs_after_full stored_after_full < <(count_objects zebu/)

# --- the changes: 256 MiB rewritten in one region (inside the data), 2,000 random 4 KiB
# writes anywhere; the same writes go to a copy of the image, the expected content.
img2="$WORKDIR/changed.img"
cp --sparse=always "$img" "$img2"
region=$((256 * mib))
[ "$region" -le $((data / 2)) ] || region=$((data / 2 / mib * mib)) # a small SIZE's trial run
region_off=$((data / 4 / mib * mib))
head -c "$region" < <(openssl enc -aes-128-ctr -nosalt -pass pass:zebu-backup-bench-2 -in /dev/zero 2>/dev/null) >"$WORKDIR/region.bin"
changed_chunks=$(python3 benches/backup-case-changes.py "$img2" "$WORKDIR/region.bin" "$region_off" "$bytes" "$WORKDIR/qemu-io.cmds" "$region")
changed_bytes=$((changed_chunks * mib))
qemu_args=()
while IFS= read -r line; do qemu_args+=(-c "$line"); done <"$WORKDIR/qemu-io.cmds"
qemu-io -f raw "${qemu_args[@]}" "$ep" >"$WORKDIR/qemu-io.out" 2>&1 || { echo "backup-bench: qemu-io failed:" >&2; tail -5 "$WORKDIR/qemu-io.out" >&2; exit 1; }
rm -f "$WORKDIR/region.bin"
res=$(backup incr)
read -r t_incr read_incr up_incr objs_incr rss_incr busy_incr <<<"$res"
read -r objs_after stored_after < <(count_objects zebu/)
"$zebu" volume detach src >/dev/null
# The restores compare with the images: the source volume's replicas (about 3 x its data
# on disk) go now, which keeps the run's peak disk use near 15 GB for a 4 GiB volume.
"$zebu" volume delete src >/dev/null 2>&1 || true

# --- restores into new volumes, each compared whole with the volume at its snapshot
restore() { # backup image -> "time downloaded rss busy% replica-rss"
  local t0 t dl v=dst-$1 c0
  t0=$(now)
  c0=$(cpu_snap)
  "$zebu" volume create "$v" --from-backup "$1" --replicas "$REPLICAS" --frontend nbd >/dev/null
  wait_restored "$v"
  t=$(since "$t0")
  local busy; busy=$(busy_pct "$c0" "$(cpu_snap)")
  dl=$("$zebu" volume get "$v" -o json | jq -r '.status.restore.downloaded // 0')
  local rss; rss=$(peak_rss "$t0" "$(now)")
  local rrss; rrss=$(peak_rss "$t0" "$(now)" "$replica_rss_log")
  local dep; dep=$("$zebu" volume attach "$v")
  nbdcopy "$dep" - | cmp - "$2" >&2 || { echo "backup-bench: restore of $1 differs from its source" >&2; exit 1; }
  "$zebu" volume detach "$v" >/dev/null
  "$zebu" volume delete "$v" >/dev/null 2>&1 || true
  echo "$t $dl $rss $busy $rrss"
}
res=$(restore full "$img")
read -r t_rfull dl_rfull rss_rfull busy_rfull rrss_rfull <<<"$res"
res=$(restore incr "$img2")
read -r t_rincr dl_rincr rss_rincr busy_rincr rrss_rincr <<<"$res"

# --- reference: nbdcopy of the image into a new volume (the write side of the data path)
make_volume ref
rep=$("$zebu" volume attach ref)
c0=$(cpu_snap); t0=$(now); nbdcopy "$img" "$rep"; t_write=$(since "$t0"); busy_write=$(busy_pct "$c0" "$(cpu_snap)")
"$zebu" volume detach ref >/dev/null
"$zebu" volume delete ref >/dev/null 2>&1 || true

# --- restic: the same image to the same server
export RESTIC_REPOSITORY="s3:http://127.0.0.1:$port/bench/restic" RESTIC_PASSWORD=zebu-backup-bench
restic init --quiet >/dev/null
t0=$(now); restic backup --quiet --no-cache "$img" >/dev/null; t_restic_b=$(since "$t0")
read -r restic_objects restic_stored < <(count_objects restic/)
mkdir -p "$WORKDIR/restic-out"
t0=$(now); restic restore --quiet --no-cache latest --target "$WORKDIR/restic-out" >/dev/null; t_restic_r=$(since "$t0")
cmp "$img" "$WORKDIR/restic-out$img"
rm -rf "$WORKDIR/restic-out"

gib() { python3 -c "import sys;print(f'{int(sys.argv[1])/(1<<30):.2f}')" "$1"; }
m() { echo $(($1 / mib)); }
objs_per_gib=$(python3 -c "print(f'{$objs_after/($stored_after/(1<<30)):.1f}')")
# Where each job's time went: the `backup done` / `restore done` lines of the job processes.
job_lines=$(grep -rhoE "(backup|restore) done.*|INFO.*(backup|restore) done.*" "$WORKDIR/cluster" 2>/dev/null | sed -E 's/\x1b\[[0-9;]*m//g' | grep -E "wait_" | sed 's/^/    /' || true)
report=$(cat <<EOF
backup-bench: $SIZE volume ($(m $data) MiB random data, the rest holes), $REPLICAS replicas, server $server_desc on 127.0.0.1, $(date -u +%FT%TZ), $(nproc) CPUs, binaries $ZEBU_BIN_DIR
uptime at the start: $uptime_start
uptime at the end:   $(uptime)
server ceiling (boto3, 4 parallel requests of 64 MiB objects): PUT $ceil_put MiB/s, GET $ceil_get MiB/s
server ceiling (object_store as the store uses it, 4 parallel, 8 MiB parts): PUT ${rust_put:-?} MiB/s, GET ${rust_get:-?} MiB/s
changes for the incremental: $(m $region) MiB region at $(m $region_off) MiB + 2,000 random 4 KiB writes = $changed_chunks changed 1 MiB chunks ($(m $changed_bytes) MiB)
rates of full rows are of the data bytes ($(m $data) MiB)

| row | time s | MiB/s | read MiB | uploaded / downloaded MiB | objects | peak RSS MiB | machine CPU busy % |
|---|---:|---:|---:|---:|---:|---:|---:|
| zebu full backup | $t_full | $(rate "$data" "$t_full") | $(m $read_full) | $(m $up_full) | $objs_full | $rss_full | $busy_full |
| zebu incremental backup | $t_incr | $(rate "$changed_bytes" "$t_incr") (of changed chunks) | $(m $read_incr) | $(m $up_incr) | $objs_incr | $rss_incr | $busy_incr |
| zebu restore of full (new $REPLICAS-replica volume, byte-identical) | $t_rfull | $(rate "$data" "$t_rfull") | | $(m $dl_rfull) | | $rss_rfull (replicas: $rrss_rfull) | $busy_rfull |
| zebu restore of incremental (new volume, byte-identical) | $t_rincr | $(rate "$data" "$t_rincr") | | $(m $dl_rincr) | | $rss_rincr (replicas: $rrss_rincr) | $busy_rincr |
| nbdcopy volume -> null: | $t_read | $(rate "$data" "$t_read") | | | | | $busy_read |
| nbdcopy image -> new $REPLICAS-replica volume | $t_write | $(rate "$data" "$t_write") | | | | | $busy_write |
| restic backup of the image | $t_restic_b | $(rate "$data" "$t_restic_b") | | $(m $restic_stored) stored | $restic_objects | | |
| restic restore (to a file) | $t_restic_r | $(rate "$data" "$t_restic_r") | | | | | |

zebu store after both backups: $objs_after objects, $(m $stored_after) MiB ($objs_after_full objects, $(m $stored_after_full) MiB after the full one)

| goal (issue 16) | measured | verdict |
|---|---|---|
| incremental reads < 1.2 x changed chunks | $(m $read_incr) MiB / $(m $changed_bytes) MiB = $(ratio "$read_incr" "$changed_bytes") | $(verdict "$read_incr < 1.2 * $changed_bytes") |
| incremental uploads < 1.2 x changed chunks | $(m $up_incr) MiB / $(m $changed_bytes) MiB = $(ratio "$up_incr" "$changed_bytes") | $(verdict "$up_incr < 1.2 * $changed_bytes") |
| store <= 32 objects per GiB of unique data | $objs_after objects / $(gib "$stored_after") GiB stored = $objs_per_gib | $(verdict "$objs_per_gib <= 32") |
| full backup rate >= 0.7 x nbdcopy read | $(rate "$data" "$t_full") / $(rate "$data" "$t_read") MiB/s = $(ratio "$t_read" "$t_full") | $(verdict "$t_read / $t_full >= 0.7") |
| restore rate >= 0.7 x nbdcopy write (full) | $(rate "$data" "$t_rfull") / $(rate "$data" "$t_write") MiB/s = $(ratio "$t_write" "$t_rfull") | $(verdict "$t_write / $t_rfull >= 0.7") |
| restore rate >= 0.7 x nbdcopy write (incremental) | $(rate "$data" "$t_rincr") / $(rate "$data" "$t_write") MiB/s = $(ratio "$t_write" "$t_rincr") | $(verdict "$t_write / $t_rincr >= 0.7") |
| restores byte-identical | both compared whole with cmp | PASS |
| each chunk downloaded once (full restore) | $(m $dl_rfull) MiB downloaded / $(m $up_full) MiB stored by the full backup | $(verdict "$dl_rfull <= 1.02 * $up_full + (1 << 20)") |

the jobs' own accounts (wait_* in ms):
$job_lines

CPU seconds by process during each backup (the job's own is its cpu_ms above), and during
the nbdcopy read of the volume (nbdcopy ends inside it, so it is missing):
    full: $(cat "$WORKDIR/cpu-full.txt")
    incr: $(cat "$WORKDIR/cpu-incr.txt")
    nbdcopy read: $(cat "$WORKDIR/cpu-read.txt")
EOF
)
echo "$report"
[ -n "$out" ] && echo "$report" >"$out"
exit 0
