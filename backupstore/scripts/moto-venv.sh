#!/usr/bin/env bash
# Makes sure a Python venv with the moto S3 server exists outside the checkout and prints the
# path of its `moto_server` program. The venv is keyed by the pinned version, so a version
# change makes a new one and never half-upgrades an old one; concurrent callers (nextest runs
# each test in its own process) wait on one lock instead of racing to build it.
set -euo pipefail

MOTO_VERSION="${ZEBU_MOTO_VERSION:-5.2.5}"
cache="${ZEBU_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/zebu}"
venv="$cache/moto-venv-$MOTO_VERSION"
mkdir -p "$cache"

exec 9>"$cache/moto-venv.lock"
flock 9
if [ ! -x "$venv/bin/moto_server" ] || [ ! -f "$venv/.complete" ]; then
  rm -rf "$venv"
  python3 -m venv "$venv" >&2
  "$venv/bin/pip" install --quiet --disable-pip-version-check \
    "moto[s3]==$MOTO_VERSION" flask flask-cors >&2
  touch "$venv/.complete"
fi
echo "$venv/bin/moto_server"
