#!/usr/bin/env bash
# Measures what a cold CI run (`.ci/run` on an empty machine) costs, phase by phase, in CPU
# seconds (user + system of the phase and every process it waited for, from /usr/bin/time).
# Wall time is printed too, but it depends on whatever else the machine runs; CPU time does
# not, and on a quiet 2-core machine a phase that keeps both cores busy needs about half
# of it in wall time.
#
#   benches/ci-cost.sh [rust] [go] [nextest] [registry]    default: rust go
#
#   rust      cargo clippy --workspace --all-targets -- -D warnings, then
#             cargo build --workspace --bins --examples, then
#             cargo nextest run --workspace --no-run, in that order (.ci/run's), into one
#             empty CARGO_TARGET_DIR; the cargo registry stays as it is (warm).
#   go        tests/k8s/tools.sh k8s, csi-helm (the sidecars and helm: one build), csi-sanity,
#             validate, in that order (ZEBU_CI_COST_GO_GROUPS="..." picks others), into an
#             empty ZEBU_TOOLS_CACHE (which holds tools.sh's GOMODCACHE and GOCACHE: both
#             start empty).
#   nextest   cargo install --locked cargo-nextest, as tests/run.sh does on a machine without
#             it, into an empty root and target dir (its crates come from the registry).
#   registry  cargo fetch into an empty CARGO_HOME: what a cold crates.io download adds
#             (network-bound: its wall time is the figure, not its CPU time).
#
# Everything goes under ZEBU_CI_COST_DIR (default /var/tmp) in a fresh directory that is
# deleted at the end (ZEBU_CI_COST_KEEP=1 keeps it): a cold Rust target is 5-10 GB and cold
# Go caches about 10 GB, so the script refuses to start with less than ZEBU_CI_COST_MIN_GB
# (default 15) free there. The estimate at the end adds ZEBU_CI_TEST_SECONDS (default 1500,
# the test suite's wall time in CI) to half the CPU seconds of the build phases.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"

phases=("$@")
[ ${#phases[@]} -gt 0 ] || phases=(rust go)
for p in "${phases[@]}"; do
  case "$p" in rust|go|nextest|registry) ;; *) echo "ci-cost.sh: unknown phase '$p' (rust, go, nextest, registry)" >&2; exit 2 ;; esac
done

base="${ZEBU_CI_COST_DIR:-/var/tmp}"
min_gb="${ZEBU_CI_COST_MIN_GB:-15}"
free_gb=$(df -P -BG "$base" | awk 'NR == 2 { sub(/G$/, "", $4); print $4 }')
if [ "$free_gb" -lt "$min_gb" ]; then
  echo "ci-cost.sh: only ${free_gb} GB free under $base, need $min_gb (ZEBU_CI_COST_MIN_GB)" >&2
  exit 1
fi
work="$(mktemp -d "$base/zebu-ci-cost.XXXXXX")"
cleanup() {
  if [ "${ZEBU_CI_COST_KEEP:-0}" = 1 ]; then echo "ci-cost.sh: kept $work"; return; fi
  chmod -R u+w "$work" 2>/dev/null || true   # Go's module cache is read-only
  rm -rf "$work"
}
trap cleanup EXIT

results="$work/results"
: >"$results"
build_cpu=0

# measure NAME CMD...: runs CMD with its output in $work/NAME.log, records CPU and wall s.
measure() {
  local name="$1"; shift
  echo "ci-cost.sh: $name: $*"
  local t="$work/$name.time" rc=0
  /usr/bin/time -f '%U %S %e' -o "$t" "$@" >"$work/$name.log" 2>&1 || rc=$?
  if [ "$rc" -ne 0 ]; then
    tail -n 30 "$work/$name.log" >&2
    echo "ci-cost.sh: $name failed (exit $rc)" >&2
    ZEBU_CI_COST_KEEP=1
    exit 1
  fi
  local user sys wall cpu
  read -r user sys wall < <(tail -n 1 "$t")
  cpu=$(awk -v u="$user" -v s="$sys" 'BEGIN { printf "%d", u + s + 0.5 }')
  printf '%-28s %8d %8.0f\n' "$name" "$cpu" "$wall" | tee -a "$results"
  build_cpu=$((build_cpu + cpu))
}

for p in "${phases[@]}"; do
  case "$p" in
    rust)
      export CARGO_TARGET_DIR="$work/target"
      measure rust-clippy cargo clippy --workspace --all-targets -- -D warnings
      measure rust-build cargo build --workspace --bins --examples
      measure rust-nextest-no-run cargo nextest run --workspace --no-run
      du -sh "$CARGO_TARGET_DIR" | sed 's/^/ci-cost.sh: target dir /'
      [ "${ZEBU_CI_COST_KEEP:-0}" = 1 ] || rm -rf "$CARGO_TARGET_DIR"
      unset CARGO_TARGET_DIR
      ;;
    go)
      export ZEBU_TOOLS_CACHE="$work/tools"
      for g in ${ZEBU_CI_COST_GO_GROUPS:-k8s csi-helm csi-sanity validate}; do
        measure "go-$g" "$root/tests/k8s/tools.sh" "$g"
      done
      du -sh "$ZEBU_TOOLS_CACHE/go" | sed 's/^/ci-cost.sh: Go caches /'
      "$root/tests/k8s/tools.sh" prune >/dev/null
      unset ZEBU_TOOLS_CACHE
      ;;
    nextest)
      CARGO_TARGET_DIR="$work/nextest-target" measure nextest-install \
        cargo install --locked --root "$work/nextest-root" cargo-nextest
      "$work/nextest-root/bin/cargo-nextest" nextest --version | head -n 1 | sed 's/^/ci-cost.sh: built /'
      rm -rf "$work/nextest-target"
      ;;
    registry)
      # Not a build phase: excluded from the CPU sum, reported by wall time.
      before=$build_cpu
      CARGO_HOME="$work/cargo-home" measure registry-cargo-fetch cargo fetch --locked
      build_cpu=$before
      du -sh "$work/cargo-home" | sed 's/^/ci-cost.sh: registry /'
      ;;
  esac
done

tests="${ZEBU_CI_TEST_SECONDS:-1500}"
echo
printf '%-28s %8s %8s\n' phase "CPU s" "wall s"
cat "$results"
est=$(( build_cpu / 2 + tests ))
echo "build phases: $build_cpu CPU s; estimate on a quiet 2-core machine: $build_cpu / 2 + $tests s of tests = $est s ($(( (est + 59) / 60 )) min)"
