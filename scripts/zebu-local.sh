#!/usr/bin/env bash
# Runs a 3-replica Zebu volume on this machine until Ctrl-C: three zebu-replica processes on
# 127.0.0.11-13 and one zebu-engine serving the volume over NBD (and iSCSI), all in the
# foreground. Data lives in $ZEBU_DATA (default ./zebu-data) and survives restarts.
#
#   scripts/zebu-local.sh [SIZE]          # default 10G
#
# Then, in another shell (as root), to put a filesystem on it:
#   mkdir -p /mnt/zebu-nbd && nbdfuse /mnt/zebu-nbd/vol nbd://127.0.0.1:10809/vol &
#   losetup --direct-io=on -f --show /mnt/zebu-nbd/vol     # prints /dev/loopN
#   mkfs.ext4 /dev/loopN && mount /dev/loopN /mnt
set -euo pipefail
cd "$(dirname "$0")/.."
size=${1:-10G}
data=${ZEBU_DATA:-./zebu-data}
cargo build --release --bin zebu-replica --bin zebu-engine
bin=target/release
mkdir -p "$data"
pids=()
cleanup() {
  trap - EXIT INT TERM
  [ ${#pids[@]} -gt 0 ] && kill -TERM "${pids[@]}" 2>/dev/null || true
  wait 2>/dev/null || true
}
trap cleanup EXIT INT TERM
replicas=()
for i in 1 2 3; do
  addr=127.0.0.1$i:9501
  "$bin/zebu-replica" serve --dir "$data/replica-$i" --listen "$addr" --size "$size" \
    >"$data/replica-$i.out" 2>"$data/replica-$i.log" &
  pids+=($!)
  replicas+=(--replica "$addr")
done
for i in 1 2 3; do
  for _ in $(seq 100); do grep -q "listening on" "$data/replica-$i.out" 2>/dev/null && break; sleep 0.1; done
done
"$bin/zebu-engine" serve --volume vol --size "$size" "${replicas[@]}" --control 127.0.0.1:9600 \
  --frontend nbd --nbd-listen 127.0.0.1:10809 --frontend iscsi --iscsi-listen 127.0.0.1:3260 \
  2>"$data/engine.log" &
pids+=($!)
echo "replica and engine logs: $data/*.log; state: $bin/zebu-engine --control 127.0.0.1:9600 info"
wait -n "${pids[@]}"
