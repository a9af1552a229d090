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
# venv with kubernetes-validate), all.
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
# The result is the same build list the tool's own repository builds with.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache="${ZEBU_TOOLS_CACHE:-/var/cache/zebu-tools}"
nice_level="${ZEBU_TOOLS_NICE:-10}"

# --- the tools -------------------------------------------------------------------------------
# Versions. Kubernetes 1.34: the oldest release every sidecar below supports fully
# (VolumeAttributesClass is v1 from 1.34 on; external-provisioner v6 drops the beta API),
# within kube-rs 5's tested range (1.33 and later) and k8s-openapi 0.29's (1.33-1.37), and the
# release the project's `v1_34` feature describes; 1.34.4 is its newest patch on the proxy.
# etcd 3.6 is the series Kubernetes 1.34 is released with. The sidecars are their newest
# major releases' newest tags; csi-sanity v5.4.0 is the one issue 15 names.
K8S_VERSION=v1.34.4
ETCD_VERSION=v3.6.16
PROVISIONER_VERSION=v6.4.0
ATTACHER_VERSION=v4.13.0
RESIZER_VERSION=v2.3.0
SNAPSHOTTER_VERSION=v8.7.0
CSI_TEST_VERSION=v5.4.0
HELM_VERSION=v4.3.2
KUBERNETES_VALIDATE_VERSION=1.37.0

all_tools=(kubernetes etcd csi-provisioner csi-attacher csi-resizer csi-snapshotter csi-sanity helm kubernetes-validate)

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
    validate) echo kubernetes-validate ;;
    all) echo "${all_tools[*]}" ;;
    *) tool_spec "$1" >/dev/null && echo "$1" ;;
  esac
}

# The cache entry of a tool: <cache>/<tool>-<version>/, complete once `stamp` exists.
tool_dir() { tool_spec "$1"; echo "$cache/$1-$VER"; }

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
  if [ "$tool" = csi-snapshotter ]; then
    # The VolumeSnapshot CRDs ship in the client module at the same tag.
    local client
    client="$(go mod download -json "github.com/kubernetes-csi/external-snapshotter/client/v8@$VER" | jq -r .Dir)"
    mkdir -p "$work/crd"
    cp "$client"/config/crd/*.storage.k8s.io_*.yaml "$work/crd/"
    chmod -R u+w "$work/crd"
  fi
  # Keep the wrapper module next to the binaries: it is the exact recipe they came from.
  mv "$work/src" "$work/wrapper"
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

build_tool() {
  local tool="$1" dir start end
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
  # CPU time of the build (user + system of every child): unlike wall time, it does not
  # depend on what else the machine runs; a quiet 2-core machine needs about half in wall time.
  local cpu
  cpu="$(awk 'NR == 2 { n = split($0, f, /[ms ]+/); t = 0; for (i = 1; i <= n; i++) if (f[i] != "") t += (i % 2 ? 60 * f[i] : f[i]); print int(t) }' "$dir/times" 2>/dev/null || echo 0)"
  rm -f "$dir/times"
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
      for t in "${all_tools[@]}"; do tool_spec "$t"; echo "$t $MOD $VER"; done
      return ;;
    prune)
      # Wait for running builds (each holds its tool's lock) and keep new ones out meanwhile.
      local t fd
      [ -d "$cache" ] || return 0
      for t in "${all_tools[@]}"; do
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
    case "$seen" in *" $t "*) continue ;; esac
    seen+="$t "
    build_tool "$t"
  done
  echo "tools.sh: done in $(( $(date +%s) - total_start )) s; cache $cache"
}

# One line, read whole before it runs: editing this file during a build cannot derail it.
main "$@"; exit
