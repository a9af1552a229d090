#!/usr/bin/env bash
# The main job: builds Zebu and runs `zebu up` in the foreground, a self-healing cluster of
# three nodes on this machine (node agents on 127.0.0.11-13, the embedded store and every
# replica under ./zebu-data), with a 3-replica volume `vol` attached over NBD. It prints the
# API address and the volume's NBD endpoint; Ctrl-C stops everything. Run it again and the
# same cluster and volume come back with their data.
#
#   scripts/zebu-up.sh [more `zebu up` options, e.g. --volume-size 2G]
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --bin zebu --bin zebu-engine --bin zebu-replica --bin zebu-verify
exec target/release/zebu up --nodes 3 --data-dir ./zebu-data --volume vol "$@"
