#!/usr/bin/env bash
# Runs Zebu's whole test suite on a Debian machine: installs the real clients the tests drive
# (when missing and running as root), builds every binary, then runs every test with nextest.
# Safe to run again: an installed package or tool is not installed twice.
set -euo pipefail
cd "$(dirname "$0")/.."

# Every program a test starts, by the Debian package that ships it:
#   fio                      fio (engine NBD tests, benches)
#   iscsi-inq, iscsi-ls, ... libiscsi-bin (iSCSI tests)
#   nbdkit                   nbdkit (reference NBD server in the workload tests)
#   nbdinfo, nbdcopy,        libnbd-bin (NBD clients; nbdfuse mounts a volume over FUSE,
#     nbdfuse                  which needs fuse3 and its library libfuse3-3)
#   qemu-io, qemu-img        qemu-utils (the manager tests write and read volumes with qemu-io)
#   tgtd, tgtadm             tgt (reference iSCSI target)
#   mkfs.ext4                e2fsprogs
#   iptables                 iptables (network faults between loopback addresses)
#   fuser                    psmisc
#   losetup, mount, umount   util-linux, mount
#   jq, openssl, curl, ip    jq, openssl, curl, iproute2 (tests/k8s: certificates, readiness)
#   python3 -m venv          python3-venv (tests/k8s: kubernetes-validate)
packages=(fio libiscsi-bin nbdkit libnbd-bin fuse3 libfuse3-3 qemu-utils tgt e2fsprogs iptables
  psmisc util-linux mount jq openssl curl iproute2 python3-venv)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "missing packages: ${missing[*]} (run as root, or install them first)" >&2
    exit 1
  fi
  echo "installing ${missing[*]}" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
if ! cargo nextest --version >/dev/null 2>&1; then
  echo "installing cargo-nextest" >&2
  cargo install --quiet --locked cargo-nextest
fi

# A real Kubernetes control plane, the CSI sidecars, csi-sanity, helm and kubernetes-validate,
# built from Go modules and PyPI into a cache outside the checkout keyed by version
# ($ZEBU_TOOLS_CACHE, default /var/cache/zebu-tools): about 1,600 CPU seconds cold, under a
# second warm. Then a check that the control plane really serves (tests/k8s/README.md).
tests/k8s/tools.sh all
# The Go module and build caches (several GB after a cold build) are only needed to rebuild a
# tool at a new version; the disk they hold is the build's.
tests/k8s/tools.sh prune
tests/k8s/smoke.sh all
# schemathesis (PyPI) for manager/tests/openapi.rs, in a venv cached the same way.
tests/scripts/schemathesis.sh venv

# The end-to-end tests start the real binaries from this build.
cargo build --workspace --bins --examples
export ZEBU_BIN_DIR="$PWD/target/debug"
cargo nextest run --workspace --no-fail-fast "$@"
