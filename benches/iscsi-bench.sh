#!/usr/bin/env bash
# iSCSI frontend benchmark: Zebu's target (engine/examples/iscsi_file, serving a plain
# file) against tgt (Longhorn's frontend, serving a plain file), measured in the same run.
#
# Method
# - Both targets serve a fresh sparse 1 GiB file in the same directory (same disk), on
#   loopback portals, with 512-byte blocks. tgt uses its default `rdwr` backing store
#   (pread/pwrite in worker threads), the closest match to the example's FileDevice.
# - Each target is measured by /work/shared/scripts/perf-iscsi.sh (iscsi-perf random 4 KiB
#   reads at QD32 and sequential 1 MiB reads at QD8; qemu-img bench sequential writes at
#   4 KiB QD32, 1 MiB QD8, 4 KiB QD1 and reads 4 KiB QD32), median of REPS runs, together
#   with the target process's CPU use. Zebu runs first, then tgt, back to back, so that both
#   rows come from the same machine state; the ratio column is zebu / tgt IOPS.
# - The write rows need qemu-img with libiscsi support: qemu-utils and qemu-block-extra of
#   the same version (see /work/shared/scripts/README.md).
# - The example is built in release mode. Nothing else heavy should run meanwhile: this
#   machine has 2 shared cores and a shared virtual disk, so compare only rows of one run.
#
# Usage: benches/iscsi-bench.sh            Env: RUNTIME (s per run) [8], REPS [3],
#        EX [freshly built example], PORT_ZEBU [3290], PORT_TGT [3291], WORKDIR [/tmp/iscsi-bench]
set -euo pipefail
cd "$(dirname "$0")/.."
SCRIPTS=/work/shared/scripts
PORT_ZEBU=${PORT_ZEBU:-3290}
PORT_TGT=${PORT_TGT:-3291}
WORKDIR=${WORKDIR:-/tmp/iscsi-bench}
export RUNTIME=${RUNTIME:-8} REPS=${REPS:-3}
mkdir -p "$WORKDIR"

# EX: another build of the example to measure (e.g. a copy of an older one for before/after).
if [[ -z "${EX:-}" ]]; then
  cargo build --release -q -p zebu-engine --example iscsi_file
  EX=target/release/examples/iscsi_file
fi

zebu_pid=""
cleanup() {
  [[ -n "$zebu_pid" ]] && kill "$zebu_pid" 2>/dev/null || true
  WORKDIR="$WORKDIR/tgt" "$SCRIPTS/tgt-down.sh" >/dev/null 2>&1 || true
}
trap cleanup EXIT

# ---- Zebu
rm -f "$WORKDIR/zebu.img"
"$EX" --listen "127.0.0.1:$PORT_ZEBU" --volume bench --size 1G --file "$WORKDIR/zebu.img" \
  >"$WORKDIR/zebu.out" 2>"$WORKDIR/zebu.err" &
zebu_pid=$!
for _ in $(seq 50); do grep -q LISTENING "$WORKDIR/zebu.out" 2>/dev/null && break; sleep 0.1; done
grep -q LISTENING "$WORKDIR/zebu.out" || { echo "zebu example did not start" >&2; exit 1; }
echo "== zebu (pid $zebu_pid)"
"$SCRIPTS/perf-iscsi.sh" "iscsi://127.0.0.1:$PORT_ZEBU/iqn.2025-01.io.zebu:bench/1" "$zebu_pid" \
  | tee "$WORKDIR/zebu.perf"
kill "$zebu_pid"; wait "$zebu_pid" 2>/dev/null || true; zebu_pid=""

# ---- tgt
rm -rf "$WORKDIR/tgt"
eval "$(WORKDIR="$WORKDIR/tgt" PORTAL="127.0.0.1:$PORT_TGT" CTRL_PORT=7 SIZE=1G \
  "$SCRIPTS/tgt-up.sh" | grep -E '^(URL|TGTD_PID)=')"
echo "== tgt (pid $TGTD_PID)"
"$SCRIPTS/perf-iscsi.sh" "$URL" "$TGTD_PID" | tee "$WORKDIR/tgt.perf"
WORKDIR="$WORKDIR/tgt" "$SCRIPTS/tgt-down.sh" >/dev/null

# ---- summary
echo
printf '%-28s %12s %12s %7s %9s %9s\n' workload zebu_iops tgt_iops ratio zebu_cpu tgt_cpu
medians() {  # "workload|iops|cpu" per MEDIAN line, sorted for join
  sed -n 's/^MEDIAN \(.*[^ ]\) *iops=\([^ ]*\) .*target_cpu=\([^ ]*\)$/\1|\2|\3/p' "$1" | sort
}
join -t '|' <(medians "$WORKDIR/zebu.perf") <(medians "$WORKDIR/tgt.perf") |
  awk -F'|' '{r = ($4 > 0) ? $2 / $4 : 0; printf "%-28s %12s %12s %7.2f %9s %9s\n", $1, $2, $4, r, $3, $5}'
