#!/usr/bin/env bash
# iSCSI frontend benchmark, three targets measured in the same run:
#   example : Zebu's iSCSI target alone (engine/examples/iscsi_file, serving a plain file)
#   engine  : the real replicated engine (`zebu-engine serve --frontend iscsi`) with ONE
#             `zebu-replica` process behind it, so every I/O also crosses the replica
#             protocol (over the replica's local socket: it is on the engine's node) and
#             lands in the replica's layer files
#   tgt     : Longhorn's frontend, serving a plain file
# and two ceilings, which say what the client and this machine allow any target (BOUNDS=0
# skips them):
#   mem     : the same example serving memory (no file, no replica): Zebu's iSCSI code alone
#   tgt-null: tgt with its `null` backing store, which discards writes and reads zeros
# A row where even a ceiling stays under 2x tgt is bounded by the initiator (qemu-img and
# iscsi-perf, one thread each) and the two shared vCPUs, not by the target behind it.
#
# Method
# - The example and tgt serve a fresh sparse 1 GiB file, the engine a fresh 1 GiB replica
#   directory, all in WORKDIR (same disk), on loopback portals, with 512-byte blocks. tgt
#   uses its default `rdwr` backing store (pread/pwrite in worker threads), the closest
#   match to the example's FileDevice.
# - Each target is measured by the shared perf-iscsi.sh (iscsi-perf random 4 KiB
#   reads at QD32 and sequential 1 MiB reads at QD8; qemu-img bench sequential writes at
#   4 KiB QD32, 1 MiB QD8, 4 KiB QD1 and reads 4 KiB QD32), median of REPS runs, together
#   with the target process's CPU use (for the engine: the engine process; the replica's
#   CPU over its whole run is printed separately). The example runs first (on a file, then
#   in memory), then the engine, then tgt (rdwr, then null), back to back, so that all rows
#   come from the same machine state; the ratio columns are IOPS / tgt (rdwr) IOPS.
# - The write rows need qemu-img with libiscsi support: qemu-utils and qemu-block-extra of
#   the same version (see the shared scripts' README.md).
# - The shared test scripts are found relative to this script's repository, wherever the
#   script is started from: in ZEBU_SHARED_SCRIPTS if set, else in `shared/scripts` beside
#   the checkout (`<repo>/../shared/scripts`, where CI keeps them), else, for a git worktree
#   checked out elsewhere, beside the main checkout it belongs to; as the tests find them.
# - The example, zebu-engine and zebu-replica are built in release mode (logging at warn). Nothing else heavy should run meanwhile: this
#   machine has 2 shared cores and a shared virtual disk, so compare only rows of one run.
#
# Usage: benches/iscsi-bench.sh            Env: RUNTIME (s per run) [8], REPS [3],
#        EX [freshly built example], BIN [dir with release zebu-engine and zebu-replica],
#        PORT_ZEBU [3290], PORT_TGT [3291], PORT_ENGINE [3292], WORKDIR [/tmp/iscsi-bench],
#        ZEBU_ENGINE_ARGS [extra `zebu-engine serve` arguments, e.g. "--busy-poll-us 200"],
#        ZEBU_LOCAL_HOST [127.0.0.11: the replica is on the engine's node and its data moves
#        over its local Unix socket, as with data locality; empty: over TCP]
#        BOUNDS [1: also measure the two ceilings; 0: skip them],
#        ZEBU_SHARED_SCRIPTS [the shared test scripts; default <repo>/../shared/scripts, or
#        beside the main checkout of a worktree]
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
shared_scripts() {
  if [[ -n ${ZEBU_SHARED_SCRIPTS:-} ]]; then
    echo "$ZEBU_SHARED_SCRIPTS"
    return
  fi
  local main
  main=$(git -C "$repo" rev-parse --path-format=absolute --git-common-dir 2>/dev/null || true)
  if [[ ! -d $repo/../shared/scripts && -n $main ]]; then
    echo "$(dirname "$main")/../shared/scripts"
  else
    echo "$repo/../shared/scripts"
  fi
}
SCRIPTS=$(shared_scripts)
if [[ ! -x $SCRIPTS/perf-iscsi.sh ]]; then
  echo "iscsi-bench: no shared test scripts in $SCRIPTS (set ZEBU_SHARED_SCRIPTS)" >&2
  exit 2
fi
PORT_ZEBU=${PORT_ZEBU:-3290}
PORT_TGT=${PORT_TGT:-3291}
PORT_ENGINE=${PORT_ENGINE:-3292}
WORKDIR=${WORKDIR:-/tmp/iscsi-bench}
export RUNTIME=${RUNTIME:-8} REPS=${REPS:-3}
BOUNDS=${BOUNDS:-1}
mkdir -p "$WORKDIR"

# EX: another build of the example to measure (e.g. a copy of an older one for before/after).
if [[ -z "${EX:-}" ]]; then
  cargo build --release -q -p zebu-engine --example iscsi_file
  EX=target/release/examples/iscsi_file
fi
# BIN: where the release zebu-engine and zebu-replica are (built unless given).
if [[ -z "${BIN:-}" ]]; then
  cargo build --release -q -p zebu-engine -p zebu-replica
  BIN=target/release
fi
export RUST_LOG=${RUST_LOG:-warn}

zebu_pid="" engine_pid="" replica_pid=""
cleanup() {
  [[ -n "$zebu_pid" ]] && kill "$zebu_pid" 2>/dev/null || true
  WORKDIR="$WORKDIR/tgt-null" "$SCRIPTS/tgt-down.sh" >/dev/null 2>&1 || true
  [[ -n "$engine_pid" ]] && kill "$engine_pid" 2>/dev/null || true
  [[ -n "$replica_pid" ]] && kill "$replica_pid" 2>/dev/null || true
  WORKDIR="$WORKDIR/tgt" "$SCRIPTS/tgt-down.sh" >/dev/null 2>&1 || true
}
trap cleanup EXIT

# ---- Zebu's target alone: NAME over a file, or over memory with no file argument
example() {
  local name=$1; shift
  "$EX" --listen "127.0.0.1:$PORT_ZEBU" --volume bench --size 1G "$@" \
    >"$WORKDIR/$name.out" 2>"$WORKDIR/$name.err" &
  zebu_pid=$!
  for _ in $(seq 50); do grep -q LISTENING "$WORKDIR/$name.out" 2>/dev/null && break; sleep 0.1; done
  grep -q LISTENING "$WORKDIR/$name.out" || { echo "zebu example ($name) did not start" >&2; exit 1; }
  echo "== $name (pid $zebu_pid)"
  "$SCRIPTS/perf-iscsi.sh" "iscsi://127.0.0.1:$PORT_ZEBU/iqn.2025-01.io.zebu:bench/1" "$zebu_pid" \
    | tee "$WORKDIR/$name.perf"
  kill "$zebu_pid"; wait "$zebu_pid" 2>/dev/null || true; zebu_pid=""
}
rm -f "$WORKDIR/zebu.img"
example zebu --file "$WORKDIR/zebu.img"
rm -f "$WORKDIR/zebu.img"
[[ "$BOUNDS" == 1 ]] && example mem

# ---- engine + one replica
rm -rf "$WORKDIR/replica"; mkdir -p "$WORKDIR/replica"
"$BIN/zebu-replica" serve --dir "$WORKDIR/replica" --listen 127.0.0.11:0 --size 1G \
  >"$WORKDIR/replica.out" 2>"$WORKDIR/replica.err" &
replica_pid=$!
for _ in $(seq 100); do grep -q '^listening on' "$WORKDIR/replica.out" 2>/dev/null && break; sleep 0.1; done
replica_addr=$(sed -n 's/^listening on //p' "$WORKDIR/replica.out")
[[ -n "$replica_addr" ]] || { echo "zebu-replica did not start" >&2; cat "$WORKDIR/replica.err" >&2; exit 1; }
local_args=()
[[ -n ${ZEBU_LOCAL_HOST-127.0.0.11} ]] && local_args=(--local-host "${ZEBU_LOCAL_HOST-127.0.0.11}")
# ZEBU_ENGINE_ARGS is unquoted on purpose: it holds several words.
# shellcheck disable=SC2086
"$BIN/zebu-engine" serve --volume bench --size 1G --replica "$replica_addr" "${local_args[@]}" \
  --control 127.0.0.1:0 --frontend iscsi --iscsi-listen "127.0.0.1:$PORT_ENGINE" ${ZEBU_ENGINE_ARGS:-} \
  >"$WORKDIR/engine.out" 2>"$WORKDIR/engine.err" &
engine_pid=$!
for _ in $(seq 300); do grep -qx ready "$WORKDIR/engine.out" 2>/dev/null && break; sleep 0.1; done
grep -qx ready "$WORKDIR/engine.out" || { echo "zebu-engine did not start" >&2; cat "$WORKDIR/engine.err" >&2; exit 1; }
engine_url=$(sed -n 's/^iscsi //p' "$WORKDIR/engine.out")
echo "== engine (pid $engine_pid) + 1 replica (pid $replica_pid at $replica_addr)"
HZ=$(getconf CLK_TCK)
rticks() { awk '{print $14+$15}' "/proc/$replica_pid/stat"; }
r0=$(rticks); t0=$(date +%s.%N)
"$SCRIPTS/perf-iscsi.sh" "$engine_url" "$engine_pid" | tee "$WORKDIR/engine.perf"
r1=$(rticks); t1=$(date +%s.%N)
replica_cpu=$(echo "scale=1; 100*($r1-$r0)/$HZ/($t1-$t0)" | bc)
echo "replica CPU over the engine's whole run: ${replica_cpu}% of one core"
kill "$engine_pid"; wait "$engine_pid" 2>/dev/null || true; engine_pid=""
kill "$replica_pid"; wait "$replica_pid" 2>/dev/null || true; replica_pid=""

# ---- tgt: NAME with backing store BSTYPE
tgt() {
  local name=$1 bstype=$2
  rm -rf "${WORKDIR:?}/$name"
  eval "$(BSTYPE=$bstype WORKDIR="$WORKDIR/$name" PORTAL="127.0.0.1:$PORT_TGT" CTRL_PORT=7 SIZE=1G \
    "$SCRIPTS/tgt-up.sh" | grep -E '^(URL|TGTD_PID)=')"
  echo "== $name (pid $TGTD_PID)"
  "$SCRIPTS/perf-iscsi.sh" "$URL" "$TGTD_PID" | tee "$WORKDIR/$name.perf"
  WORKDIR="$WORKDIR/$name" "$SCRIPTS/tgt-down.sh" >/dev/null
}
tgt tgt rdwr
[[ "$BOUNDS" == 1 ]] && tgt tgt-null null

# ---- summary
medians() {  # "workload|iops|cpu" per MEDIAN line, sorted for join
  sed -n 's/^MEDIAN \(.*[^ ]\) *iops=\([^ ]*\) .*target_cpu=\([^ ]*\)$/\1|\2|\3/p' "$1" | sort
}
echo
printf '%-28s %11s %11s %11s %8s %8s %8s %8s %8s\n' workload example_iops engine_iops \
  tgt_iops ex/tgt eng/tgt ex_cpu eng_cpu tgt_cpu
# fields after the joins: 1 workload, 2-3 example iops/cpu, 4-5 engine, 6-7 tgt
join -t '|' <(medians "$WORKDIR/zebu.perf") <(medians "$WORKDIR/engine.perf") |
  join -t '|' - <(medians "$WORKDIR/tgt.perf") |
  awk -F'|' '{ex = ($6 > 0) ? $2 / $6 : 0; en = ($6 > 0) ? $4 / $6 : 0;
              printf "%-28s %11s %11s %11s %8.2f %8.2f %8s %8s %8s\n", $1, $2, $4, $6, ex, en, $3, $5, $7}'
echo "(cpu columns: % of one core of the target process; engine replica used ${replica_cpu}% over its run)"
if [[ "$BOUNDS" == 1 ]]; then
  echo
  echo "ceilings: what the initiator allows a target that stores nothing (IOPS, and / tgt)"
  printf '%-28s %11s %11s %8s %8s\n' workload mem_iops tgtnull_iops mem/tgt null/tgt
  join -t '|' <(medians "$WORKDIR/mem.perf") <(medians "$WORKDIR/tgt-null.perf") |
    join -t '|' - <(medians "$WORKDIR/tgt.perf") |
    awk -F'|' '{m = ($6 > 0) ? $2 / $6 : 0; n = ($6 > 0) ? $4 / $6 : 0;
                printf "%-28s %11s %11s %8.2f %8.2f\n", $1, $2, $4, m, n}'
fi
