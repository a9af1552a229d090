#!/usr/bin/env bash
# Backup and restore of a volume through the manager to a real S3 server (moto), against
# references measured in the same run on the same machine (issue 16):
#
#   - backup  vs `nbdcopy` of the same volume (its NBD endpoint) to a file: reading the
#     volume's data at the speed the data path allows;
#   - restore vs `nbdcopy` of the same image into a new volume of the same replica count:
#     writing the same bytes into a new volume;
#   - both    vs `restic` (Debian) backing up the same image file to the same moto server
#     and restoring it, with its object count.
#
# The volume (SIZE, default 4G) holds random data in its first half and holes in the
# second (2 GiB of each at 4G). Rates are of the data bytes. The restore (and restic's) is
# compared byte for byte with the source image.
#
#   benches/backup-bench.sh [OUT.txt]
#   env: SIZE=4G REPLICAS=2 WORKDIR=/var/tmp/backup-bench ZEBU_BIN_DIR=target/release
#
# Needs: zebu, zebu-engine, zebu-replica, zebu-backup-run in ZEBU_BIN_DIR (build with
# `cargo build --release --workspace --bins`, or debug), nbdcopy, qemu-img, restic, curl,
# jq, python3 (the moto venv of backupstore/scripts/moto-venv.sh). Disk: about
# (2 × REPLICAS + 3) × the data size under WORKDIR; moto keeps objects in memory (about
# twice the data: Zebu's and restic's copies).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
out="${1:-}"
SIZE="${SIZE:-4G}"
REPLICAS="${REPLICAS:-2}"
WORKDIR="${WORKDIR:-/var/tmp/backup-bench}"
if [ -z "${ZEBU_BIN_DIR:-}" ]; then
  if [ -x target/release/zebu ]; then ZEBU_BIN_DIR=$root/target/release; else ZEBU_BIN_DIR=$root/target/debug; fi
fi
export ZEBU_BIN_DIR
zebu="$ZEBU_BIN_DIR/zebu"
for t in "$zebu" "$ZEBU_BIN_DIR/zebu-engine" "$ZEBU_BIN_DIR/zebu-replica" "$ZEBU_BIN_DIR/zebu-backup-run"; do
  [ -x "$t" ] || { echo "backup-bench: $t is missing (cargo build --workspace --bins)" >&2; exit 2; }
done
for t in nbdcopy qemu-img restic curl jq python3; do
  command -v "$t" >/dev/null || { echo "backup-bench: $t is missing" >&2; exit 2; }
done

bytes=$(python3 -c "import sys;s=sys.argv[1];u={'K':1<<10,'M':1<<20,'G':1<<30}.get(s[-1].upper());print(int(s[:-1])*u if u else int(s))" "$SIZE")
data=$((bytes / 2))
mib=$((1 << 20))

rm -rf "$WORKDIR"
mkdir -p "$WORKDIR"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  sleep 1
  # The cluster's engines, replicas and upload processes run in their own process groups.
  for p in $(pgrep -f "$WORKDIR/cluster" || true); do kill -9 "$p" 2>/dev/null || true; done
  rm -rf "$WORKDIR"
}
trap cleanup EXIT

now() { date +%s.%N; }
since() { python3 -c "import sys;print(f'{float(sys.argv[2])-float(sys.argv[1]):.2f}')" "$1" "$(now)"; }
rate() { python3 -c "import sys;print(f'{int(sys.argv[1])/float(sys.argv[2])/1048576:.1f}')" "$1" "$2"; }
ratio() { python3 -c "import sys;print(f'{float(sys.argv[1])/float(sys.argv[2]):.3f}')" "$1" "$2"; }
free_port() { python3 -c "import socket;s=socket.socket();s.bind(('127.0.0.1',0));print(s.getsockname()[1])"; }

# --- moto
moto_server=$(bash backupstore/scripts/moto-venv.sh)
port=$(free_port)
"$moto_server" -H 127.0.0.1 -p "$port" >"$WORKDIR/moto.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 300); do curl -s -o /dev/null "http://127.0.0.1:$port/" && break; sleep 0.2; done
curl -s -X PUT "http://127.0.0.1:$port/bench" >/dev/null
export AWS_ACCESS_KEY_ID=testing AWS_SECRET_ACCESS_KEY=testing AWS_REGION=us-east-1
export AWS_ENDPOINT_URL="http://127.0.0.1:$port"
count_objects() { # prefix -> "objects bytes" (pages through the listing)
  python3 - "$port" "$1" <<'PY'
import sys, urllib.request, re
port, prefix = sys.argv[1], sys.argv[2]
n = size = 0
token = None
while True:
    url = f"http://127.0.0.1:{port}/bench?list-type=2&prefix={prefix}"
    if token:
        url += "&continuation-token=" + urllib.parse.quote(token)
    body = urllib.request.urlopen(url).read().decode()
    n += body.count("<Key>")
    size += sum(int(s) for s in re.findall(r"<Size>(\d+)</Size>", body))
    m = re.search(r"<NextContinuationToken>([^<]+)</NextContinuationToken>", body)
    if "<IsTruncated>true</IsTruncated>" not in body or not m:
        break
    token = m.group(1)
print(n, size)
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
  for _ in $(seq 1 36000); do
    s=$("$zebu" volume get "$1" -o json | jq -r '.status.restore.state // ""')
    [ "$s" = completed ] && return 0
    [ "$s" = error ] && { "$zebu" volume get "$1" -o json | jq .status.restore >&2; exit 1; }
    sleep 0.1
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

# --- reference: nbdcopy of the volume to a file
t0=$(now); nbdcopy "$ep" "$WORKDIR/nbdcopy-read.img"; t_read=$(since "$t0")
cmp "$img" "$WORKDIR/nbdcopy-read.img"
rm -f "$WORKDIR/nbdcopy-read.img"

# --- Zebu backup
t0=$(now); "$zebu" backup create src --name full --wait >"$WORKDIR/backup.out" 2>&1; t_backup=$(since "$t0")
b=$("$zebu" backup get full -o json)
read_b=$(jq -r .status.read <<<"$b"); up_b=$(jq -r .status.uploaded <<<"$b"); objs_b=$(jq -r '.status.objects // 0' <<<"$b")
read -r zebu_objects zebu_stored < <(count_objects zebu/)

# --- Zebu restore into a new volume
t0=$(now)
"$zebu" volume create dst --from-backup full --replicas "$REPLICAS" --frontend nbd >/dev/null
wait_restored dst
t_restore=$(since "$t0")
dep=$("$zebu" volume attach dst)
nbdcopy "$dep" "$WORKDIR/restored.img"
cmp "$img" "$WORKDIR/restored.img"
rm -f "$WORKDIR/restored.img"
"$zebu" volume detach dst >/dev/null

# --- reference: nbdcopy of the image into a new volume
make_volume ref
rep=$("$zebu" volume attach ref)
t0=$(now); nbdcopy "$img" "$rep"; t_write=$(since "$t0")
"$zebu" volume detach ref >/dev/null

# --- restic: the same image to the same server
export RESTIC_REPOSITORY="s3:http://127.0.0.1:$port/bench/restic" RESTIC_PASSWORD=zebu-backup-bench
restic init --quiet >/dev/null
t0=$(now); restic backup --quiet --no-cache "$img" >/dev/null; t_restic_b=$(since "$t0")
read -r restic_objects restic_stored < <(count_objects restic/)
mkdir -p "$WORKDIR/restic-out"
t0=$(now); restic restore --quiet --no-cache latest --target "$WORKDIR/restic-out" >/dev/null; t_restic_r=$(since "$t0")
cmp "$img" "$WORKDIR/restic-out$img"
rm -rf "$WORKDIR/restic-out"

report=$(cat <<EOF
backup-bench: $SIZE volume ($((data / mib)) MiB random data, the rest holes), $REPLICAS replicas, moto on 127.0.0.1, $(date -u +%FT%TZ), $(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg), binaries $ZEBU_BIN_DIR
rates are of the data bytes ($((data / mib)) MiB)

| row | time s | MiB/s | reference | ratio |
|---|---:|---:|---|---:|
| zebu backup (read $((read_b / mib)) MiB, uploaded $((up_b / mib)) MiB, $objs_b objects) | $t_backup | $(rate "$data" "$t_backup") | nbdcopy volume -> file $t_read s, $(rate "$data" "$t_read") MiB/s | $(ratio "$t_read" "$t_backup") |
| zebu restore (new $REPLICAS-replica volume, byte-identical) | $t_restore | $(rate "$data" "$t_restore") | nbdcopy file -> new volume $t_write s, $(rate "$data" "$t_write") MiB/s | $(ratio "$t_write" "$t_restore") |
| restic backup ($restic_objects objects, $((restic_stored / mib)) MiB stored) | $t_restic_b | $(rate "$data" "$t_restic_b") | zebu backup / restic time | $(ratio "$t_backup" "$t_restic_b") |
| restic restore (to a file) | $t_restic_r | $(rate "$data" "$t_restic_r") | zebu restore / restic time | $(ratio "$t_restore" "$t_restic_r") |

zebu store after the backup: $zebu_objects objects, $((zebu_stored / mib)) MiB; $(python3 -c "print(f'{$zebu_objects/($data/(1<<30)):.1f}')") objects per GiB of data
EOF
)
echo "$report"
[ -n "$out" ] && echo "$report" >"$out"
exit 0
