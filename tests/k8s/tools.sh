#!/usr/bin/env bash
# Builds the Kubernetes tools the tests drive, from the Go module proxy only, into a cache
# outside the checkout keyed by version. A tool whose cache entry is complete is not
# rebuilt, so a warm run costs a few file checks.
#
#   tests/k8s/tools.sh [GROUP|TOOL]...    build (default: all)
#   tests/k8s/tools.sh which BINARY       absolute path of a built binary (builds nothing)
#   tests/k8s/tools.sh env                shell lines `export ZEBU_...=...` for every built tool
#   tests/k8s/tools.sh list               the tools, their modules and versions
#   tests/k8s/tools.sh prune              delete the Go module and build caches (GBs); the
#                                         built tools stay, a version change rebuilds cold
#
# Groups: k8s (kube-apiserver, kube-controller-manager, kubectl, etcd), csi (the CSI
# sidecars, snapshot-controller, the snapshot CRDs, csi-sanity), helm, validate (a Python
# venv with kubernetes-validate), all. The sidecars and helm are one build, the bundle
# csi-helm (below): asking for any of them builds all five.
#
# Settings: ZEBU_TOOLS_CACHE (default /var/cache/zebu-tools), ZEBU_TOOLS_NICE (default 10),
# ZEBU_TOOLS_GO_P (go build -p; default: go's own, the number of cores), ZEBU_TOOLS_VERBOSE=1
# (the go commands' output on the console too; it is always in <tool>-<version>/build.log).
#
# Why a wrapper module per tool: `go install k8s.io/kubernetes/cmd/...@v` refuses, because
# that module's go.mod points every staging module (k8s.io/api, k8s.io/client-go, ...) at
# ./staging with a replace line, and replace lines of a dependency are ignored. The same
# holds for etcd's server module and the CSI sidecars. So each tool is built from a small
# module of our own that requires the tool's module and restates the tool's replace lines,
# derived from its published go.mod at build time (never a hand-kept list):
#   - a replace to another module version is copied as it is;
#   - a replace to a directory inside the tool's repository (./staging/src/k8s.io/api,
#     ../api, ./client) becomes that module at the tag the tool was released with: the
#     tool's own version, or for k8s.io/kubernetes v1.X.Y its staging tag v0.X.Y;
#   - a replace to a directory for a module the tool does not require is dropped (etcd
#     replaces forbidden modules with ./FORBIDDEN_DEPENDENCY to keep them out).
# The result is the same build list the tool's own repository builds with; for the bundle
# (the sidecars and helm in one wrapper module) it is the union of their build lists, and
# tools.sh refuses versions whose replace lines disagree.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache="${ZEBU_TOOLS_CACHE:-/var/cache/zebu-tools}"
nice_level="${ZEBU_TOOLS_NICE:-10}"

# --- the tools -------------------------------------------------------------------------------
# Versions. Kubernetes 1.34: the oldest release every sidecar below supports fully
# (VolumeAttributesClass is v1 from 1.34 on; external-provisioner v6 drops the beta API),
# within kube-rs 5's tested range (1.33 and later) and k8s-openapi 0.29's (1.33-1.37), and the
# release the project's `v1_34` feature describes; 1.34.4 is its newest patch on the proxy.
# etcd 3.6 is the series Kubernetes 1.34 is released with.
K8S_VERSION=v1.34.4
ETCD_VERSION=v3.6.16
# The four sidecars and helm are built together, from one wrapper module (see "The bundle"
# below), so their versions must agree on one build list: the k8s.io libraries of one
# release, because each tool's go.mod pins them with replace lines and two tools pinning
# k8s.io/api at different versions cannot share a module. The external-provisioner decides
# the train: v6.4.0, its newest release, pins every k8s.io library at v0.36.1 (it imports
# k8s.io/kubernetes v1.36.3 and pins the staging modules to match). The others are then
# each project's newest release on v0.36.1 (their next releases move to v0.37.x):
PROVISIONER_VERSION=v6.4.0   # newest; pins k8s.io/* at v0.36.1
ATTACHER_VERSION=v4.12.0     # pins k8s.io/* at v0.36.1 (v4.13.0 pins v0.37.0)
RESIZER_VERSION=v2.2.0       # requires k8s.io/* v0.36.1 (v2.3.0: v0.37.1)
SNAPSHOTTER_VERSION=v8.6.0   # pins k8s.io/* at v0.36.1 (v8.7.0: v0.37.0); the provisioner
                             # requires its client module at v8.6.0 too
HELM_VERSION=v4.2.4          # requires k8s.io/* v0.36.1 (v4.3.x: v0.37.x)
# csi-sanity stays on its own build list: v5.4.0 is the version issue 15 names, and the
# provisioner's go.mod requires csi-test v5.6.0, which in a shared module would replace it.
CSI_TEST_VERSION=v5.4.0
KUBERNETES_VALIDATE_VERSION=1.37.0

all_tools=(kubernetes etcd csi-provisioner csi-attacher csi-resizer csi-snapshotter csi-sanity helm kubernetes-validate)

# The bundle: tools built from ONE wrapper module, with one build list, so that every package
# they share (client-go, apimachinery, gRPC, the CSI libraries: most of their code) compiles
# once instead of once per tool: 619 CPU s cold for these five against about 2,100 built apart.
# The price: each tool is built with the newest version of a shared dependency that any of
# them requires (gRPC 1.84.0 from the provisioner, say), not with exactly its own; the k8s.io
# libraries, which matter most, are pinned by the tools' own replace lines and agree.
bundle_tools=(csi-provisioner csi-attacher csi-resizer csi-snapshotter helm)
# Its cache entry's name holds every version in it: a version change is a new entry.
bundle_key() {
  echo "csi-helm-$PROVISIONER_VERSION-$ATTACHER_VERSION-$RESIZER_VERSION-$SNAPSHOTTER_VERSION-$HELM_VERSION"
}
in_bundle() {
  local b
  for b in "${bundle_tools[@]}"; do [ "$b" = "$1" ] && return 0; done
  return 1
}

# tool_spec TOOL: sets MOD (module), VER (its version), SIBLING (the tag of modules its
# go.mod replaces with a directory), PKGS (package=binary pairs) and XFLAGS (-X flags).
tool_spec() {
  XFLAGS=()
  case "$1" in
    kubernetes)
      MOD=k8s.io/kubernetes VER=$K8S_VERSION SIBLING="v0.${K8S_VERSION#v1.}"
      PKGS=("$MOD/cmd/kube-apiserver=kube-apiserver"
            "$MOD/cmd/kube-controller-manager=kube-controller-manager"
            "$MOD/cmd/kubectl=kubectl")
      # What hack/lib/version.sh stamps into a release build: /version and kubectl's
      # version skew checks then see a real version instead of v0.0.0-master.
      local minor="${K8S_VERSION#v1.}"; minor="${minor%%.*}"
      local p
      for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
        XFLAGS+=("-X $p.gitVersion=$K8S_VERSION" "-X $p.gitMajor=1" "-X $p.gitMinor=$minor"
                 "-X $p.gitTreeState=clean")
      done
      ;;
    etcd)
      MOD=go.etcd.io/etcd/server/v3 VER=$ETCD_VERSION SIBLING=$ETCD_VERSION
      PKGS=("$MOD=etcd")
      ;;
    csi-provisioner)
      MOD=github.com/kubernetes-csi/external-provisioner/v6 VER=$PROVISIONER_VERSION SIBLING=$VER
      PKGS=("$MOD/cmd/csi-provisioner=csi-provisioner")
      XFLAGS=("-X main.version=$VER")
      ;;
    csi-attacher)
      MOD=github.com/kubernetes-csi/external-attacher/v4 VER=$ATTACHER_VERSION SIBLING=$VER
      PKGS=("$MOD/cmd/csi-attacher=csi-attacher")
      XFLAGS=("-X main.version=$VER")
      ;;
    csi-resizer)
      MOD=github.com/kubernetes-csi/external-resizer/v2 VER=$RESIZER_VERSION SIBLING=$VER
      PKGS=("$MOD/cmd/csi-resizer=csi-resizer")
      XFLAGS=("-X main.version=$VER")
      ;;
    csi-snapshotter)
      MOD=github.com/kubernetes-csi/external-snapshotter/v8 VER=$SNAPSHOTTER_VERSION SIBLING=$VER
      PKGS=("$MOD/cmd/csi-snapshotter=csi-snapshotter"
            "$MOD/cmd/snapshot-controller=snapshot-controller")
      XFLAGS=("-X main.version=$VER")
      ;;
    csi-sanity)
      MOD=github.com/kubernetes-csi/csi-test/v5 VER=$CSI_TEST_VERSION SIBLING=$VER
      PKGS=("$MOD/cmd/csi-sanity=csi-sanity")
      XFLAGS=("-X main.VERSION=$VER")
      ;;
    helm)
      MOD=helm.sh/helm/v4 VER=$HELM_VERSION SIBLING=$VER
      PKGS=("$MOD/cmd/helm=helm")
      XFLAGS=("-X helm.sh/helm/v4/internal/version.version=$VER"
              "-X helm.sh/helm/v4/internal/version.gitTreeState=clean")
      ;;
    kubernetes-validate)
      MOD=pypi:kubernetes-validate VER=$KUBERNETES_VALIDATE_VERSION SIBLING=
      PKGS=()
      ;;
    *) echo "tools.sh: unknown tool '$1' (known: ${all_tools[*]})" >&2; return 2 ;;
  esac
}

group_tools() {
  case "$1" in
    k8s) echo kubernetes etcd ;;
    csi) echo csi-provisioner csi-attacher csi-resizer csi-snapshotter csi-sanity ;;
    helm) echo helm ;;
    csi-helm) echo "${bundle_tools[*]}" ;;
    validate) echo kubernetes-validate ;;
    all) echo "${all_tools[*]}" ;;
    *) tool_spec "$1" >/dev/null && echo "$1" ;;
  esac
}

# The cache entry of a tool: <cache>/<tool>-<version>/, or for a tool of the bundle
# <cache>/<bundle key>/<tool>/; complete once its `stamp` exists.
tool_dir() {
  tool_spec "$1"
  if in_bundle "$1"; then echo "$cache/$(bundle_key)/$1"; else echo "$cache/$1-$VER"; fi
}

# binary name -> tool that builds it
binary_tool() {
  case "$1" in
    kube-apiserver|kube-controller-manager|kubectl) echo kubernetes ;;
    etcd) echo etcd ;;
    csi-provisioner|csi-attacher|csi-resizer|csi-sanity) echo "$1" ;;
    csi-snapshotter|snapshot-controller) echo csi-snapshotter ;;
    helm) echo helm ;;
    kubernetes-validate) echo kubernetes-validate ;;
    *) return 1 ;;
  esac
}

go_env() {
  # One module cache and one build cache for every tool: the k8s.io libraries that two
  # tools share at the same version compile once.
  export GOMODCACHE="$cache/go/mod" GOCACHE="$cache/go/build"
  export GOFLAGS="-mod=mod" GOTOOLCHAIN=local CGO_ENABLED=0
  # Only the module proxy (the one go is set up with): a module it lacks is an error, never a
  # fetch from the module's VCS host.
  local proxy
  proxy="${ZEBU_GOPROXY:-$(go env GOPROXY)}"
  proxy="${proxy//,direct/}"; proxy="${proxy//|direct/}"
  case "$proxy" in ""|direct|off) proxy=https://proxy.golang.org ;; esac
  export GOPROXY="$proxy" GOPRIVATE="" GONOPROXY=""
  export GOWORK=off
}

# derive_replaces GOMOD SIBLING: the `old=new@version` arguments for `go mod edit -replace`.
derive_replaces() {
  local gomod="$1" sibling="$2"
  go mod edit -json "$gomod" | jq -r --arg sib "$sibling" '
    ([.Require[]?.Path]) as $required
    | .Replace[]?
    | .Old.Path as $path
    | ($path + (if .Old.Version then "@" + .Old.Version else "" end)) as $old
    | if (.New.Version // "") != "" then "\($old)=\(.New.Path)@\(.New.Version)"
      elif any($required[]; . == $path) then "\($old)=\($path)@\($sib)"
      else empty end'
}

build_go_tool() {
  local tool="$1" dir="$2" work="$3"
  go_env
  mkdir -p "$work/src" "$work/bin"
  cd "$work/src"
  local info gomod gover
  info="$(go mod download -json "$MOD@$VER")" || {
    echo "tools.sh: $MOD@$VER from $GOPROXY: $(jq -r '.Error // .' <<<"$info" 2>/dev/null || echo "$info")"
    return 1; }
  gomod="$(jq -r .GoMod <<<"$info")"
  [ -f "$gomod" ] || { echo "tools.sh: $MOD@$VER: no go.mod from the proxy: $info" >&2; return 1; }
  gover="$(go mod edit -json "$gomod" | jq -r '.Go // "1.22"')"
  go mod init "zebu.test/tools/$tool" >/dev/null 2>&1
  go mod edit -go="$gover" -require="$MOD@$VER"
  local r n=0 args=() replaces
  replaces="$(derive_replaces "$gomod" "$SIBLING")"
  while IFS= read -r r; do
    [ -n "$r" ] || continue
    args+=("-replace=$r"); n=$((n + 1))
  done <<<"$replaces"
  [ "$n" -eq 0 ] || go mod edit "${args[@]}"
  echo "tools.sh: $tool: $MOD@$VER, $n replace lines derived from its go.mod"
  local pkg pkgs=() spec
  for spec in "${PKGS[@]}"; do pkgs+=("${spec%%=*}"); done
  # Resolve the build list and go.sum for exactly the packages built. Each at the tool's
  # version: a bare package path would mean @upgrade.
  go get "${pkgs[@]/%/@$VER}"
  local ldflags="-s -w ${XFLAGS[*]}"
  for spec in "${PKGS[@]}"; do
    pkg="${spec%%=*}"
    nice -n "$nice_level" go build ${ZEBU_TOOLS_GO_P:+-p "$ZEBU_TOOLS_GO_P"} -trimpath \
      -ldflags "$ldflags" -o "$work/bin/${spec#*=}" "$pkg"
  done
  [ "$tool" != csi-snapshotter ] || copy_snapshot_crds "$work/crd"
  # Keep the wrapper module next to the binaries: it is the exact recipe they came from.
  mv "$work/src" "$work/wrapper"
}

# build_go_bundle WORK: every tool of the bundle from one wrapper module in WORK/wrapper, each
# tool's binaries into WORK/<tool>/bin.
build_go_bundle() {
  local work="$1"
  go_env
  mkdir -p "$work/src"
  cd "$work/src"
  go mod init zebu.test/tools/csi-helm >/dev/null 2>&1
  local tool info gomod gover maxgo=1.22 r old new n=0 spec replaces
  local -A replace_of=() replaced_by=()
  local edits=() gets=()
  for tool in "${bundle_tools[@]}"; do
    tool_spec "$tool"
    info="$(go mod download -json "$MOD@$VER")" || {
      echo "tools.sh: $MOD@$VER from $GOPROXY: $(jq -r '.Error // .' <<<"$info" 2>/dev/null || echo "$info")"
      return 1; }
    gomod="$(jq -r .GoMod <<<"$info")"
    [ -f "$gomod" ] || { echo "tools.sh: $MOD@$VER: no go.mod from the proxy: $info" >&2; return 1; }
    gover="$(go mod edit -json "$gomod" | jq -r '.Go // "1.22"')"
    maxgo="$(printf '%s\n%s\n' "$maxgo" "$gover" | sort -V | tail -n 1)"
    edits+=("-require=$MOD@$VER")
    # One module has one replace per path: two tools that pin a module differently do not
    # share a build list, and picking either would build the other against libraries it was
    # never released with.
    replaces="$(derive_replaces "$gomod" "$SIBLING")"
    while IFS= read -r r; do
      [ -n "$r" ] || continue
      old="${r%%=*}" new="${r#*=}"
      if [ -n "${replace_of[$old]+set}" ]; then
        if [ "${replace_of[$old]}" != "$new" ]; then
          echo "tools.sh: $tool $VER replaces $old with $new, ${replaced_by[$old]} with ${replace_of[$old]}: these versions do not share a build list; pick versions of one k8s.io release" >&2
          return 1
        fi
        continue
      fi
      replace_of[$old]="$new" replaced_by[$old]="$tool $VER"
      edits+=("-replace=$r"); n=$((n + 1))
    done <<<"$replaces"
    for spec in "${PKGS[@]}"; do gets+=("${spec%%=*}@$VER"); done
  done
  go mod edit -go="$maxgo" "${edits[@]}"
  echo "tools.sh: csi-helm: ${bundle_tools[*]} in one module, $n replace lines derived from their go.mod files"
  go get "${gets[@]}"
  # A tool's module that another one requires at a newer version would be raised by `go get`:
  # then the entry would not hold the version it is named after.
  local got
  for tool in "${bundle_tools[@]}"; do
    tool_spec "$tool"
    got="$(go list -m -f '{{.Version}}' "$MOD")"
    [ "$got" = "$VER" ] || {
      echo "tools.sh: the shared build list has $MOD at $got, not $VER: pick versions that agree" >&2
      return 1; }
  done
  # One `go build` per tool (each stamps its own version with -X), one build cache: what one
  # compiled, the next finds cached.
  for tool in "${bundle_tools[@]}"; do
    tool_spec "$tool"
    mkdir -p "$work/$tool/bin"
    for spec in "${PKGS[@]}"; do
      nice -n "$nice_level" go build ${ZEBU_TOOLS_GO_P:+-p "$ZEBU_TOOLS_GO_P"} -trimpath \
        -ldflags "-s -w ${XFLAGS[*]}" -o "$work/$tool/bin/${spec#*=}" "${spec%%=*}"
    done
    echo "tools.sh: csi-helm: built $tool $VER"
  done
  copy_snapshot_crds "$work/csi-snapshotter/crd"
  mv "$work/src" "$work/wrapper"
}

# copy_snapshot_crds DIR: the VolumeSnapshot CRDs, which ship in external-snapshotter's client
# module at the same tag.
copy_snapshot_crds() {
  local client
  client="$(go mod download -json "github.com/kubernetes-csi/external-snapshotter/client/v8@$SNAPSHOTTER_VERSION" | jq -r .Dir)"
  mkdir -p "$1"
  cp "$client"/config/crd/*.storage.k8s.io_*.yaml "$1/"
  chmod -R u+w "$1"
}

build_venv_tool() {
  local work="$1"
  local py="${ZEBU_PYTHON:-python3}"
  "$py" -m venv "$work/venv"
  "$work/venv/bin/pip" install -q --disable-pip-version-check "kubernetes-validate==$VER"
  mkdir -p "$work/bin"
  ln -s ../venv/bin/kubernetes-validate "$work/bin/kubernetes-validate"
}

# A build's output goes to its log; on the console only with ZEBU_TOOLS_VERBOSE=1 (a cold
# build prints thousands of "go: downloading" lines), else its own tools.sh lines.
log_to() {
  if [ "${ZEBU_TOOLS_VERBOSE:-0}" = 1 ]; then tee "$1"; else tee "$1" | grep --line-buffered '^tools.sh: ' || true; fi
}

# times_cpu FILE: the CPU seconds in the output of `times` (its second line: the children's
# user and system time), then removes FILE. Unlike wall time, CPU time does not depend on
# what else the machine runs; a quiet 2-core machine needs about half of it in wall time.
times_cpu() {
  awk 'NR == 2 { n = split($0, f, /[ms ]+/); t = 0; for (i = 1; i <= n; i++) if (f[i] != "") t += (i % 2 ? 60 * f[i] : f[i]); print int(t) }' "$1" 2>/dev/null || echo 0
  rm -f "$1"
}

# build_bundle: the bundle's entry, <cache>/<bundle key>/ with one <tool>/ per tool, built
# and locked as one tool is (see build_tool).
build_bundle() {
  local key dir start end
  key="$(bundle_key)"
  dir="$cache/$key"
  if [ -f "$dir/stamp" ]; then
    echo "tools.sh: csi-helm (${bundle_tools[*]}) cached in $dir"
    return 0
  fi
  mkdir -p "$cache"
  exec 9>"$cache/.lock-csi-helm"
  flock 9
  if [ -f "$dir/stamp" ]; then
    exec 9>&-
    echo "tools.sh: csi-helm cached in $dir (built by another run)"
    return 0
  fi
  local work="$dir.partial.$$"
  rm -rf "$dir" "$dir".partial.*
  mkdir -p "$work"
  start=$(date +%s)
  echo "tools.sh: building csi-helm (${bundle_tools[*]}) into $dir"
  local rc=0
  set +e
  (set -e; build_go_bundle "$work"; times >"$work/times") > >(log_to "$work/build.log") 2>&1
  rc=$?
  set -e
  if [ "$rc" -ne 0 ]; then
    sleep 0.2; tail -n 40 "$work/build.log" >&2
    echo "tools.sh: building csi-helm failed; log in $work/build.log" >&2
    exec 9>&-; return 1
  fi
  end=$(date +%s)
  local cpu tool gov built
  cpu="$(times_cpu "$work/times")"
  gov="$(go env GOVERSION 2>/dev/null || echo none)"
  built="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  # Each tool's own stamp, as a tool built alone has one: `version=` is what its binaries
  # report. Written before the entry moves into place, so all appear at once.
  for tool in "${bundle_tools[@]}"; do
    tool_spec "$tool"
    printf 'tool=%s\nmodule=%s\nversion=%s\nbundle=%s\ngo=%s\nbuilt=%s\n' \
      "$tool" "$MOD" "$VER" "$key" "$gov" "$built" >"$work/$tool/stamp"
  done
  {
    echo "bundle=$key"
    echo "tools=${bundle_tools[*]}"
    echo "go=$gov"
    echo "seconds=$((end - start))"
    echo "cpu_seconds=$cpu"
    echo "built=$built"
  } >"$work/stamp.tmp"
  mv "$work/stamp.tmp" "$work/stamp"
  mv "$work" "$dir"
  exec 9>&-
  echo "tools.sh: built csi-helm in $((end - start)) s (CPU $cpu s)"
}

build_tool() {
  local tool="$1" dir start end
  if [ "$tool" = csi-helm ]; then build_bundle; return; fi
  dir="$(tool_dir "$tool")"
  tool_spec "$tool"
  if [ -f "$dir/stamp" ]; then
    echo "tools.sh: $tool $VER cached in $dir"
    return 0
  fi
  mkdir -p "$cache"
  # Two runs at once (parallel test binaries, two CI jobs on one cache) build a tool once.
  exec 9>"$cache/.lock-$tool"
  flock 9
  if [ -f "$dir/stamp" ]; then
    exec 9>&-
    echo "tools.sh: $tool $VER cached in $dir (built by another run)"
    return 0
  fi
  local work="$dir.partial.$$"
  # Under the lock nobody else builds this tool: what an earlier failed or killed build
  # left goes.
  rm -rf "$dir" "$dir".partial.*
  mkdir -p "$work"
  start=$(date +%s)
  echo "tools.sh: building $tool $VER into $dir"
  if [ "$MOD" = pypi:kubernetes-validate ]; then
    # The venv's scripts carry their absolute path: build it where it will live.
    rm -rf "$work"; work="$dir"; mkdir -p "$work"
    # `set -e` is off inside a subshell whose status is tested (`( ) || ...`): test it after.
    local rc=0
    set +e
    (set -e; build_venv_tool "$work"; times >"$work/times") > >(log_to "$work.log") 2>&1
    rc=$?
    set -e
    if [ "$rc" -ne 0 ]; then
      sleep 0.2; tail -n 40 "$work.log" >&2
      echo "tools.sh: building $tool failed; log in $work.log" >&2
      rm -rf "$work"; exec 9>&-; return 1
    fi
    mv "$work.log" "$work/build.log"
  else
    local rc=0
    set +e
    (set -e; build_go_tool "$tool" "$dir" "$work"; times >"$work/times") > >(log_to "$work/build.log") 2>&1
    rc=$?
    set -e
    if [ "$rc" -ne 0 ]; then
      sleep 0.2; tail -n 40 "$work/build.log" >&2
      echo "tools.sh: building $tool failed; log in $work/build.log" >&2
      exec 9>&-; return 1
    fi
    mv "$work" "$dir"
  fi
  end=$(date +%s)
  local cpu
  cpu="$(times_cpu "$dir/times")"
  {
    echo "tool=$tool"
    echo "module=$MOD"
    echo "version=$VER"
    echo "go=$(go env GOVERSION 2>/dev/null || echo none)"
    echo "seconds=$((end - start))"
    echo "cpu_seconds=$cpu"
    echo "built=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  } >"$dir/stamp.tmp"
  mv "$dir/stamp.tmp" "$dir/stamp"
  exec 9>&-
  echo "tools.sh: built $tool $VER in $((end - start)) s (CPU $cpu s)"
}

cmd_which() {
  local tool dir
  tool="$(binary_tool "$1")" || { echo "tools.sh: unknown binary '$1'" >&2; return 2; }
  dir="$(tool_dir "$tool")"
  [ -f "$dir/stamp" ] && [ -x "$dir/bin/$1" ] || {
    echo "tools.sh: $1 is not built; run: $here/tools.sh $tool" >&2; return 1; }
  echo "$dir/bin/$1"
}

cmd_env() {
  local b var path
  for b in kube-apiserver kube-controller-manager kubectl etcd csi-provisioner csi-attacher \
           csi-resizer csi-snapshotter snapshot-controller csi-sanity helm kubernetes-validate; do
    var="ZEBU_$(tr 'a-z-' 'A-Z_' <<<"$b")"
    if path="$(cmd_which "$b" 2>/dev/null)"; then echo "export $var=$path"; fi
  done
  local snap
  snap="$(tool_dir csi-snapshotter)"
  [ -d "$snap/crd" ] && [ -f "$snap/stamp" ] && echo "export ZEBU_SNAPSHOT_CRDS=$snap/crd"
  echo "export ZEBU_K8S_VERSION=$K8S_VERSION"
}

main() {
  local args=("$@")
  [ ${#args[@]} -gt 0 ] || args=(all)
  case "${args[0]}" in
    which) cmd_which "${args[1]:?usage: tools.sh which BINARY}"; return ;;
    env) cmd_env; return ;;
    list)
      local t
      for t in "${all_tools[@]}"; do
        tool_spec "$t"
        if in_bundle "$t"; then echo "$t $MOD $VER (in $(bundle_key))"; else echo "$t $MOD $VER"; fi
      done
      return ;;
    prune)
      # Wait for running builds (each holds its tool's lock) and keep new ones out meanwhile.
      local t fd
      [ -d "$cache" ] || return 0
      for t in "${all_tools[@]}" csi-helm; do
        exec {fd}>"$cache/.lock-$t"
        flock "$fd"
      done
      if [ -d "$cache/go" ]; then
        du -sh "$cache/go" 2>/dev/null | sed 's/^/tools.sh: removing /'
        chmod -R u+w "$cache/go" 2>/dev/null || true   # the module cache is read-only
        rm -rf "$cache/go"
      fi
      return ;;
    -h|--help|help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; return ;;
  esac
  command -v go >/dev/null || { echo "tools.sh: go is not installed" >&2; return 1; }
  command -v jq >/dev/null || { echo "tools.sh: jq is not installed" >&2; return 1; }
  local tools=() g t total_start
  local list
  for g in "${args[@]}"; do
    list="$(group_tools "$g")" || return 2
    read -r -a t <<<"$list"
    tools+=("${t[@]}")
  done
  total_start=$(date +%s)
  local seen=" "
  for t in "${tools[@]}"; do
    ! in_bundle "$t" || t=csi-helm
    case "$seen" in *" $t "*) continue ;; esac
    seen+="$t "
    build_tool "$t"
  done
  echo "tools.sh: done in $(( $(date +%s) - total_start )) s; cache $cache"
}

# One line, read whole before it runs: editing this file during a build cannot derail it.
main "$@"; exit
