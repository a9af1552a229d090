#!/usr/bin/env bash
# Attach time of zebu-csi: ControllerPublishVolume → a usable device (nbdfuse + a direct-I/O
# loop device), median and p90 over N attaches (default 20) of a 3-replica volume on
# `zebu up`, against nbdkit's file plugin attached the same way in the same run. See
# csi/examples/csi_attach_bench.rs. Needs root (FUSE, loop devices), nbdkit, nbdfuse.
#   benches/csi-attach-bench.sh [--attaches N]
set -euo pipefail
cd "$(dirname "$0")/.."
# The same build as tests/run.sh (a build of a few packages alone would unify features
# differently and recompile half the dependency tree).
cargo build --quiet --workspace --bins --examples
export ZEBU_BIN_DIR="${ZEBU_BIN_DIR:-$PWD/target/debug}"
exec target/debug/examples/csi_attach_bench "$@"
