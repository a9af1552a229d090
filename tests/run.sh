#!/usr/bin/env bash
# Runs Zebu's whole test suite on a Debian machine: installs the real clients the tests drive
# (when missing and running as root), builds every binary, then runs every test with nextest.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(fio libiscsi-bin nbdkit libnbd-bin tgt e2fsprogs iptables psmisc fuse3 util-linux)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "missing packages: ${missing[*]} (run as root, or install them first)" >&2
    exit 1
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
if ! cargo nextest --version >/dev/null 2>&1; then
  cargo install --locked cargo-nextest
fi

# The end-to-end tests start the real binaries from this build.
cargo build --workspace --bins --examples
export ZEBU_BIN_DIR="$PWD/target/debug"
cargo nextest run --workspace --no-fail-fast "$@"
