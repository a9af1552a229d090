#!/usr/bin/env bash
# Restore speed of two builds, A and B, alternated in one cluster against one S3 server, with
# the `nbdcopy` write reference measured between them: on a shared machine whose load moves
# within minutes, two builds compared across separate runs of backup-bench.sh differ by the
# load as much as by the code.
#
# Setup (once): issue 16's 4 GiB case of backup-bench.sh (2 GiB random data, 2 GiB holes; a
# full backup; 256 MiB rewritten and 2,000 random 4 KiB writes; an incremental backup); the
# source volume is then deleted. Then ROUNDS rounds of: for each build in turn (A, B, or B,
# A on even rounds), a restore of each backup into a new volume; and one `nbdcopy` of the
# image into a new volume. A build is a directory holding `zebu-replica` and
# `zebu-backup-run`: the manager starts both from ZEBU_BIN_DIR, here a directory of symbolic
# links that are switched before each restore (every restore starts new replica processes
# and a new job process). Each restore of the first round is compared whole with its image.
#
#   benches/restore-ab.sh A_DIR B_DIR [OUT.txt]
#   env: SERVER=gofakes3|moto ROUNDS=3 SIZE=4G REPLICAS=3 WORKDIR=/var/tmp/restore-ab
#        BASE_DIR (zebu and zebu-engine; default A_DIR)
#
# Prints one line per measurement and, per build, each restore's ratio to the reference of
# its round (time of nbdcopy / time of the restore: >= 0.7 is issue 16's goal); then each
# job's own accounts, and each restore's time outside its job (the manager's, from its log).
set -euo pipefail
cd "$(dirname "$0")/.."
a_dir=$(realpath "$1")
b_dir=$(realpath "$2")
out="${3:-}"
SIZE="${SIZE:-4G}"
REPLICAS="${REPLICAS:-3}"
SERVER="${SERVER:-gofakes3}"
ROUNDS="${ROUNDS:-3}"
WORKDIR="${WORKDIR:-/var/tmp/restore-ab}"
BASE_DIR=$(realpath "${BASE_DIR:-$a_dir}")
for d in "$a_dir" "$b_dir"; do
  for t in zebu-replica zebu-backup-run; do
    [ -x "$d/$t" ] || { echo "restore-ab: $d/$t is missing" >&2; exit 2; }
  done
done

bytes=$(python3 -c "import sys;s=sys.argv[1];u={'K':1<<10,'M':1<<20,'G':1<<30}.get(s[-1].upper());print(int(s[:-1])*u if u else int(s))" "$SIZE")
data=$((bytes / 2))
mib=$((1 << 20))
rm -rf "$WORKDIR"
mkdir -p "$WORKDIR/bin"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  sleep 1
  for p in $(pgrep -f "$WORKDIR/cluster" || true); do kill -9 "$p" 2>/dev/null || true; done
  [ -n "${KEEP:-}" ] || rm -rf "$WORKDIR"
}
trap cleanup EXIT
now() { date +%s.%N; }
since() { python3 -c "import sys;print(f'{float(sys.argv[2])-float(sys.argv[1]):.2f}')" "$1" "$(now)"; }
free_port() { python3 -c "import socket;s=socket.socket();s.bind(('127.0.0.1',0));print(s.getsockname()[1])"; }
use_build() { # DIR: the replica and job binaries the next restore starts
  ln -sfn "$1/zebu-replica" "$WORKDIR/bin/zebu-replica"
  ln -sfn "$1/zebu-backup-run" "$WORKDIR/bin/zebu-backup-run"
}
ln -sfn "$BASE_DIR/zebu" "$WORKDIR/bin/zebu"
ln -sfn "$BASE_DIR/zebu-engine" "$WORKDIR/bin/zebu-engine"
use_build "$a_dir"
export ZEBU_BIN_DIR="$WORKDIR/bin"
zebu="$ZEBU_BIN_DIR/zebu"
log() { echo "$*" | tee -a "$WORKDIR/results.txt" >&2; }
log "restore-ab: $SIZE volume, $REPLICAS replicas, server $SERVER, $(date -u +%FT%TZ), A=$a_dir B=$b_dir"
log "uptime at the start: $(uptime)"

# --- the S3 server and the cluster (as backup-bench.sh)
export AWS_ACCESS_KEY_ID=testing AWS_SECRET_ACCESS_KEY=testing AWS_REGION=us-east-1
port=$(free_port)
bash backupstore/scripts/moto-venv.sh >/dev/null
bash benches/s3-server.sh path "$SERVER" >/dev/null
bash benches/s3-server.sh run "$SERVER" "$port" "$WORKDIR/s3" >"$WORKDIR/s3.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 300); do curl -s -o /dev/null "http://127.0.0.1:$port/" && break; sleep 0.2; done
export AWS_ENDPOINT_URL="http://127.0.0.1:$port"
py="$(dirname "$(bash backupstore/scripts/moto-venv.sh)")/python3"
"$py" -c "
import boto3, os
boto3.client('s3', endpoint_url=os.environ['AWS_ENDPOINT_URL'], region_name='us-east-1').create_bucket(Bucket='bench')"
api_port=$(free_port)
export ZEBU_API="http://127.0.0.1:$api_port"
ZEBU_LOG="${ZEBU_LOG:-info}" "$zebu" up --nodes "$REPLICAS" --listen "127.0.0.1:$api_port" --first-node-address 127.0.0.81 \
  --setting storage-minimal-available-percentage=0 --data-dir "$WORKDIR/cluster" \
  >"$WORKDIR/up.out" 2>"$WORKDIR/up.log" &
pids+=($!)
for _ in $(seq 1 300); do "$zebu" node ls >/dev/null 2>&1 && break; sleep 0.2; done
"$zebu" backup target set "s3://bench@us-east-1/zebu" >/dev/null
make_volume() { "$zebu" volume create "$1" --size "$SIZE" --replicas "$REPLICAS" --frontend nbd >/dev/null; }

img="$WORKDIR/source.img"
head -c "$data" < <(openssl enc -aes-128-ctr -nosalt -pass pass:zebu-backup-bench -in /dev/zero 2>/dev/null) >"$img"
truncate -s "$bytes" "$img"
make_volume src
ep=$("$zebu" volume attach src)
nbdcopy "$img" "$ep"
"$zebu" backup create src --name full --wait >/dev/null
img2="$WORKDIR/changed.img"
cp --sparse=always "$img" "$img2"
region=$((256 * mib))
[ "$region" -le $((data / 2)) ] || region=$((data / 2 / mib * mib))
region_off=$((data / 4 / mib * mib))
head -c "$region" < <(openssl enc -aes-128-ctr -nosalt -pass pass:zebu-backup-bench-2 -in /dev/zero 2>/dev/null) >"$WORKDIR/region.bin"
python3 benches/backup-case-changes.py "$img2" "$WORKDIR/region.bin" "$region_off" "$bytes" "$WORKDIR/qemu-io.cmds" "$region" >/dev/null
qemu_args=()
while IFS= read -r line; do qemu_args+=(-c "$line"); done <"$WORKDIR/qemu-io.cmds"
qemu-io -f raw "${qemu_args[@]}" "$ep" >"$WORKDIR/qemu-io.out" 2>&1
rm -f "$WORKDIR/region.bin"
"$zebu" backup create src --name incr --wait >/dev/null
"$zebu" volume detach src >/dev/null
"$zebu" volume delete src >/dev/null 2>&1 || true

restore() { # backup image compare volume -> seconds
  local v=$4 t0 s
  t0=$(now)
  "$zebu" volume create "$v" --from-backup "$1" --replicas "$REPLICAS" --frontend nbd >/dev/null
  for _ in $(seq 1 14400); do
    s=$("$zebu" volume get "$v" -o json | jq -r '.status.restore.state // ""')
    [ "$s" = completed ] && break
    [ "$s" = error ] && { "$zebu" volume get "$v" -o json | jq .status.restore >&2; exit 1; }
    sleep 0.25
  done
  since "$t0"
  if [ "$3" = 1 ]; then
    local dep; dep=$("$zebu" volume attach "$v")
    nbdcopy "$dep" - | cmp - "$2" >&2 || { echo "restore-ab: restore of $1 differs" >&2; exit 1; }
    "$zebu" volume detach "$v" >/dev/null
  fi
  "$zebu" volume delete "$v" >/dev/null 2>&1 || true
}
reference() { # volume -> seconds
  local t0 t rep
  make_volume "$1"
  rep=$("$zebu" volume attach "$1")
  t0=$(now); nbdcopy "$img" "$rep"; t=$(since "$t0")
  "$zebu" volume detach "$1" >/dev/null
  "$zebu" volume delete "$1" >/dev/null 2>&1 || true
  echo "$t"
}
ratio() { python3 -c "import sys;print(f'{float(sys.argv[1])/float(sys.argv[2]):.3f}')" "$1" "$2"; }
for round in $(seq 1 "$ROUNDS"); do
  order="A B"
  [ $((round % 2)) = 0 ] && order="B A"
  cmp_now=0
  [ "$round" = 1 ] && cmp_now=1
  declare -A full incr
  for b in $order; do
    if [ "$b" = A ]; then use_build "$a_dir"; else use_build "$b_dir"; fi
    full[$b]=$(restore full "$img" "$cmp_now" "r$round-${b,,}-full")
    incr[$b]=$(restore incr "$img2" "$cmp_now" "r$round-${b,,}-incr")
  done
  ref=$(reference "r$round-ref")
  log "round $round ($order) load $(cut -d' ' -f1-3 /proc/loadavg): nbdcopy write ${ref} s;" \
    "A full ${full[A]} s ($(ratio "$ref" "${full[A]}")) incr ${incr[A]} s ($(ratio "$ref" "${incr[A]}"));" \
    "B full ${full[B]} s ($(ratio "$ref" "${full[B]}")) incr ${incr[B]} s ($(ratio "$ref" "${incr[B]}"))"
done
log "uptime at the end: $(uptime)"
grep -rhoE "restore done.*" "$WORKDIR/cluster" 2>/dev/null | sed -E 's/\x1b\[[0-9;]*m//g' | sed 's/^/    /' >>"$WORKDIR/results.txt" || true
# Where each restore's time went outside its job: from the volume's creation to the job's
# start (replicas scheduled, started, seen running), and from the job's end to the restore's
# `completed` (from the manager's log at ZEBU_LOG=info, and each job's log).
python3 - "$WORKDIR" >>"$WORKDIR/results.txt" <<'PY' || true
import datetime, glob, os, re, sys
w = sys.argv[1]
def ts(line):
    m = re.match(r'(?:\x1b\[[0-9;]*m)*(\d{4}-\d\d-\d\dT[\d:.]+)Z', line)
    return datetime.datetime.fromisoformat(m.group(1)).timestamp() if m else None
ev = {}
marks = [(r'volume created to restore a backup volume=(\S+)', 'create'),
         (r'backup job process started job="restore-([^"]+)"', 'job'),
         (r'restore Some\("in-progress"\) -> completed volume=(\S+)', 'completed')]
for line in open(os.path.join(w, 'up.log'), errors='replace'):
    line = re.sub(r'\x1b\[[0-9;]*m', '', line)
    for pat, key in marks:
        m = re.search(pat, line)
        if m and ts(line):
            ev.setdefault(m.group(1), {})[key] = ts(line)
for f in glob.glob(os.path.join(w, 'cluster/backups/jobs/restore-*.log')):
    v = os.path.basename(f)[len('restore-'):-len('.log')]
    for line in open(f, errors='replace'):
        line = re.sub(r'\x1b\[[0-9;]*m', '', line)
        if 'restore done' in line and ts(line):
            ev.setdefault(v, {})['done'] = ts(line)
for v, e in sorted(ev.items()):
    if all(k in e for k in ('create', 'job', 'done', 'completed')):
        print(f"    {v}: volume created -> job started {e['job'] - e['create']:.2f} s, job"
              f" {e['done'] - e['job']:.2f} s, job done -> completed {e['completed'] - e['done']:.2f} s")
PY
[ -n "$out" ] && cp "$WORKDIR/results.txt" "$out"
exit 0
