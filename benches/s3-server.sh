#!/usr/bin/env bash
# S3-compatible servers for the backup benches, built from the registries into a cache outside
# the checkout keyed by version (as tests/k8s/tools.sh does for the Kubernetes tools), and run
# on 127.0.0.1 in the foreground.
#
#   benches/s3-server.sh path KIND            build KIND if needed; print its program
#   benches/s3-server.sh run KIND PORT DIR    run KIND on 127.0.0.1:PORT (exec), state under DIR
#   benches/s3-server.sh describe KIND        one line: name, version, what it is
#
# KIND:
#   moto       moto_server (Python, PyPI; the server the tests use), objects in memory and
#              spooled temporary files; about 60-90 MiB/s of PUT on this machine kind.
#   gofakes3   github.com/johannesboyne/gofakes3 v1.2.0 (Go module proxy), objects in memory.
#   seaweedfs  github.com/seaweedfs/seaweedfs (Go module proxy, one pinned pseudo-version): the
#              `weed server -s3` all-in-one (master, volume server, filer, S3 gateway), objects
#              on disk under DIR, no authentication (any credentials are accepted).
#   versitygw  github.com/versity/versitygw (Go module proxy, Apache-2.0): the posix back end,
#              each object a file under DIR (metadata in extended attributes); checks SigV4
#              against AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (default testing/testing).
#              Run with --data-integrity-etag: ETags from a CRC instead of an MD5 of every
#              byte, which doubles what it takes in here (object_store PUT 444-473 MiB/s with
#              MD5, 838-918 without, 4 x 64 MiB in parallel; Zebu does not read ETags).
# MinIO is not offered: its server is AGPL-3.0, which this project does not take in.
#
# Settings: ZEBU_TOOLS_CACHE (default /var/cache/zebu-tools). Builds run under nice and
# ionice, with the Go module and build caches of tests/k8s/tools.sh.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
cache="${ZEBU_TOOLS_CACHE:-/var/cache/zebu-tools}"

GOFAKES3_VERSION=v1.2.0
SEAWEEDFS_VERSION=v0.0.0-20261109003541-7506e5f91cd6
VERSITYGW_VERSION=v1.8.0

go_env() {
  export GOMODCACHE="$cache/go/mod" GOCACHE="$cache/go/build"
  export GOFLAGS="-mod=mod" GOTOOLCHAIN=local CGO_ENABLED=0
}

# build NAME VERSION MODULE PACKAGE [REPLACE...]: a wrapper module that requires MODULE at
# VERSION (restating the module's own replace lines, which `go install` refuses), built into
# $cache/s3-servers/NAME-VERSION/NAME. A finished entry is never rebuilt.
build() {
  local name=$1 version=$2 module=$3 package=$4
  shift 4
  local dir="$cache/s3-servers/$name-$version"
  if [ -x "$dir/$name" ]; then
    echo "$dir/$name"
    return
  fi
  go_env
  local work="$dir.partial.$$"
  rm -rf "$work"
  mkdir -p "$work/src"
  {
    echo "module zebu.local/$name-wrapper"
    echo
    echo "go $(go env GOVERSION | sed 's/^go//')"
    echo
    echo "require $module $version"
    for r in "$@"; do echo "replace $r"; done
  } >"$work/src/go.mod"
  printf '//go:build tools\n\npackage tools\n\nimport _ "%s"\n' "$package" >"$work/src/tools.go"
  echo "s3-server: building $name $version (log: $work/build.log)" >&2
  if ! (cd "$work/src" && nice -n 19 ionice -c3 go mod tidy >"$work/build.log" 2>&1 &&
    nice -n 19 ionice -c3 go build -trimpath -ldflags='-s -w' -o "../$name" "$package" >>"$work/build.log" 2>&1); then
    tail -20 "$work/build.log" >&2
    echo "s3-server: building $name failed" >&2
    exit 1
  fi
  rm -rf "$dir"
  mv "$work" "$dir"
  echo "$dir/$name"
}

path() {
  case "$1" in
    moto) bash "$root/backupstore/scripts/moto-venv.sh" ;;
    gofakes3) build gofakes3 "$GOFAKES3_VERSION" github.com/johannesboyne/gofakes3 github.com/johannesboyne/gofakes3/cmd/gofakes3 ;;
    # The one replace line of seaweedfs's own go.mod at this version.
    seaweedfs) build weed "$SEAWEEDFS_VERSION" github.com/seaweedfs/seaweedfs github.com/seaweedfs/seaweedfs/weed \
      "github.com/tyler-smith/go-bip39 => github.com/cosmos/go-bip39 v1.0.0" ;;
    versitygw) build versitygw "$VERSITYGW_VERSION" github.com/versity/versitygw github.com/versity/versitygw/cmd/versitygw ;;
    *) echo "s3-server: KIND is moto, gofakes3, seaweedfs or versitygw" >&2; exit 2 ;;
  esac
}

# N free TCP ports on 127.0.0.1.
free_ports() {
  python3 - "$1" <<'PY'
import socket, sys
socks = []
for _ in range(int(sys.argv[1])):
    s = socket.socket(); s.bind(("127.0.0.1", 0)); socks.append(s)
print(" ".join(str(s.getsockname()[1]) for s in socks))
PY
}

case "${1:-}" in
  path) path "$2" ;;
  describe)
    case "$2" in
      moto) echo "moto $("$(dirname "$(path moto)")/pip" show moto 2>/dev/null | sed -n 's/^Version: //p') (Python, in memory)" ;;
      gofakes3) echo "gofakes3 $GOFAKES3_VERSION (Go, in memory)" ;;
      seaweedfs) echo "seaweedfs $SEAWEEDFS_VERSION (Go, weed server -s3, on disk)" ;;
      versitygw) echo "versitygw $VERSITYGW_VERSION (Go, posix back end, on disk)" ;;
      *) path "$2" ;;
    esac
    ;;
  run)
    kind=$2 port=$3 dir=$4
    program=$(path "$kind")
    mkdir -p "$dir"
    case "$kind" in
      moto) exec "$program" -H 127.0.0.1 -p "$port" ;;
      gofakes3) exec "$program" -backend memory -host "127.0.0.1:$port" ;;
      seaweedfs)
        read -r m mg v vg f fg sg < <(free_ports 7)
        exec "$program" server -dir="$dir" -ip=127.0.0.1 -ip.bind=127.0.0.1 \
          -master.port="$m" -master.port.grpc="$mg" -master.volumeSizeLimitMB=1024 \
          -volume.port="$v" -volume.port.grpc="$vg" -volume.max=0 \
          -filer.port="$f" -filer.port.grpc="$fg" \
          -s3 -s3.port="$port" -s3.port.grpc="$sg" -master.telemetry=false
        ;;
      versitygw)
        exec "$program" --access "${AWS_ACCESS_KEY_ID:-testing}" --secret "${AWS_SECRET_ACCESS_KEY:-testing}" \
          --port "127.0.0.1:$port" posix --data-integrity-etag "$dir"
        ;;
      *) path "$kind" ;;
    esac
    ;;
  *) sed -n '2,22p' "$0" >&2; exit 2 ;;
esac
