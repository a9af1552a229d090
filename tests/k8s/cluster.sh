#!/usr/bin/env bash
# A throw-away Kubernetes control plane on 127.0.0.1 for tests: etcd, kube-apiserver (RBAC,
# static tokens, service accounts) and kube-controller-manager, built by tools.sh.
#
#   tests/k8s/cluster.sh up   [--state DIR] [--etcd-port P] [--etcd-peer-port P]
#                             [--apiserver-port P] [--kcm-port P] [--watch-pid PID]
#   tests/k8s/cluster.sh ensure --state DIR [up's options]   `up`, or reuse the cluster that
#                                             DIR holds (locked: safe from many processes)
#   tests/k8s/cluster.sh env  --state DIR     the cluster's settings as KEY=VALUE lines
#   tests/k8s/cluster.sh down --state DIR     stop what `up` started (by PID), remove DIR
#
# `up` prints the settings (the same lines as DIR/cluster.env, see README.md) on stdout and
# everything else on stderr. Ports left out are picked at random among free ones, so several
# clusters run side by side. --state defaults to a new directory under /dev/shm (etcd's data
# is on tmpfs and fsync is off: nothing here must survive the machine). With --watch-pid, a
# small watcher stops the cluster when that process exits (a test binary killed by -9 leaves
# nothing behind). If `up` fails, it stops what it started, prints the end of the failing
# log and exits non-zero.
#
# Extra flags (split on spaces): ZEBU_K8S_APISERVER_ARGS, ZEBU_K8S_KCM_ARGS, e.g.
# ZEBU_K8S_APISERVER_ARGS="--feature-gates=SomeGate=true".
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
tools="$here/tools.sh"

# The controllers the tests rely on: PV/PVC binding (it writes the
# volume.kubernetes.io/storage-provisioner annotation external-provisioner waits for),
# attach-detach (VolumeAttachments from pods with spec.nodeName), expansion, the protection
# finalizers (without them PVC/PV deletes hang), namespace deletion, garbage collection of
# owned objects, service accounts (the ServiceAccount admission plugin refuses pods in a
# namespace without `default`), and the aggregation of the built-in admin/edit/view roles.
# Left out on purpose: node-lifecycle and taint-eviction (with no kubelet every Node is
# unreachable, and they would taint it and evict its pods), daemonset and the workload
# controllers (no kubelet runs their pods), and the legacy secret-based service-account tokens
# (the TokenRequest API, served by the API server itself, is what pods and managers use).
controllers=(
  persistentvolume-binder-controller
  persistentvolume-attach-detach-controller
  persistentvolume-expander-controller
  persistentvolumeclaim-protection-controller
  persistentvolume-protection-controller
  volumeattributesclass-protection-controller
  namespace-controller
  garbage-collector-controller
  serviceaccount-controller
  root-ca-certificate-publisher-controller
  clusterrole-aggregation-controller
)

log() { echo "cluster.sh: $*" >&2; }
die() { log "$*"; exit 1; }
now_ms() { date +%s%3N; }

# --- processes, recorded as "name pid starttime" so that `down` never signals a recycled PID --
proc_starttime() { awk '{print $22}' "/proc/$1/stat" 2>/dev/null || true; }

record_pid() { # name pid
  local st
  st="$(proc_starttime "$2")"
  echo "$1 $2 $st" >>"$state/pids"
}

# Is the recorded process still the one we started, and not a zombie waiting for a reaper
# (a caller that is a subreaper may reap late)?
pid_alive() { # pid starttime
  local stat
  [ -n "$2" ] || return 1
  stat="$(awk '{print $3, $22}' "/proc/$1/stat" 2>/dev/null)" || return 1
  [ "${stat#* }" = "$2" ] && [ "${stat%% *}" != Z ]
}

stop_recorded() {
  [ -f "$state/pids" ] || return 0
  local name pid st alive=()
  # SIGKILL, all at once: nothing in a test cluster is meant to outlive it (its state is
  # removed next), and a graceful stop costs seconds per test binary (kube-apiserver drains
  # for about 3 s, etcd 2 s, the controller manager 1 s).
  while read -r name pid st; do
    [ -n "$pid" ] || continue
    [ "$pid" = "${BASHPID:-$$}" ] && continue
    if pid_alive "$pid" "$st"; then
      kill -KILL "$pid" 2>/dev/null || true
      alive+=("$name:$pid:$st")
    fi
  done <"$state/pids"
  local entry waited=0 left
  while :; do
    left=()
    for entry in "${alive[@]}"; do
      IFS=: read -r name pid st <<<"$entry"
      pid_alive "$pid" "$st" && left+=("$entry")
    done
    [ ${#left[@]} -gt 0 ] || break
    if [ "$waited" -ge 200 ]; then
      for entry in "${left[@]}"; do log "${entry%%:*} (pid $(cut -d: -f2 <<<"$entry")) survived SIGKILL for 10 s"; done
      break
    fi
    alive=("${left[@]}")
    sleep 0.05; waited=$((waited + 1))
  done
  return 0
}

# --- ports -----------------------------------------------------------------------------------
used_ports() { ss -Htan 2>/dev/null | awk '{n=split($4,a,":"); print a[n]}' | sort -u; }

pick_port() { # excluded...
  local used p tries=0
  used=" $(used_ports | tr '\n' ' ') $* "
  while [ "$tries" -lt 200 ]; do
    p=$((20000 + RANDOM % 12000))
    case "$used" in *" $p "*) ;; *) echo "$p"; return 0 ;; esac
    tries=$((tries + 1))
  done
  die "no free port found"
}

# --- credentials -----------------------------------------------------------------------------
make_credentials() {
  local d="$state/pki"
  mkdir -p "$d"
  # A CA of our own and a serving certificate for 127.0.0.1/localhost: the kubeconfigs can
  # carry the CA before the server starts, and every client (curl, kubectl, kube-rs) verifies
  # the server instead of skipping verification.
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 7 \
    -subj "/CN=zebu-test-ca" -keyout "$d/ca.key" -out "$d/ca.crt" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    2>/dev/null
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
    -subj "/CN=kube-apiserver" -keyout "$d/apiserver.key" -out "$d/apiserver.csr" 2>/dev/null
  openssl x509 -req -in "$d/apiserver.csr" -CA "$d/ca.crt" -CAkey "$d/ca.key" -days 7 \
    -set_serial "0x$(openssl rand -hex 8)" -out "$d/apiserver.crt" -extfile <(printf '%s\n' \
      "basicConstraints=critical,CA:FALSE" \
      "keyUsage=critical,digitalSignature" \
      "extendedKeyUsage=serverAuth" \
      "subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc") \
    2>/dev/null
  # The key that signs service-account tokens (the API server verifies with its public half).
  openssl ecparam -name prime256v1 -genkey -noout -out "$d/sa.key" 2>/dev/null
  openssl ec -in "$d/sa.key" -pubout -out "$d/sa.pub" 2>/dev/null
  chmod 600 "$d"/*.key

  tok() { openssl rand -hex 16; }
  admin_token="$(tok)" manager_token="$(tok)" norights_token="$(tok)" kcm_token="$(tok)"
  # token,user,uid,"groups". zebu-manager starts with no rights: only the RBAC objects from
  # deploy/ give them (the manager's tests apply those). zebu-norights never gets any.
  {
    echo "$admin_token,zebu-admin,uid-zebu-admin,\"system:masters\""
    echo "$kcm_token,system:kube-controller-manager,uid-kcm,\"system:masters\""
    echo "$manager_token,zebu-manager,uid-zebu-manager"
    echo "$norights_token,zebu-norights,uid-zebu-norights"
  } >"$d/tokens.csv"
  chmod 600 "$d/tokens.csv"
}

write_kubeconfig() { # file user token
  local ca
  ca="$(base64 -w0 <"$state/pki/ca.crt")"
  cat >"$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: zebu-test
  cluster:
    server: $server
    certificate-authority-data: $ca
users:
- name: $2
  user:
    token: $3
contexts:
- name: $2@zebu-test
  context:
    cluster: zebu-test
    user: $2
    namespace: default
current-context: $2@zebu-test
preferences: {}
EOF
  chmod 600 "$1"
}

# --- waiting ---------------------------------------------------------------------------------
fail_with_log() { # name logfile message
  log "$3"
  if [ -f "$2" ]; then
    log "last lines of $2:"
    tail -n 25 "$2" >&2
  fi
  exit 1
}

wait_for() { # name pid logfile timeout_s check-command...
  local name="$1" pid="$2" logf="$3" timeout="$4"; shift 4
  local deadline=$(( $(now_ms) + timeout * 1000 ))
  while ! "$@" >/dev/null 2>&1; do
    kill -0 "$pid" 2>/dev/null || fail_with_log "$name" "$logf" "$name exited while starting"
    [ "$(now_ms)" -lt "$deadline" ] || fail_with_log "$name" "$logf" "$name not ready after ${timeout} s"
    sleep 0.1
  done
}

etcd_healthy() { curl -fsS --max-time 2 "http://127.0.0.1:$etcd_port/health" | grep -q '"health":"true"'; }
apiserver_ready() {
  [ "$(curl -fsS --max-time 2 --cacert "$state/pki/ca.crt" -H "Authorization: Bearer $admin_token" \
    "$server/readyz")" = ok ]
}
# The service-account controller has created `default` in the default namespace: the
# controller manager is up, talks to the API server and runs its controllers.
kcm_ready() {
  curl -fsS --max-time 2 --cacert "$state/pki/ca.crt" -H "Authorization: Bearer $admin_token" \
    "$server/api/v1/namespaces/default/serviceaccounts/default" >/dev/null
}

# --- up --------------------------------------------------------------------------------------
cmd_up() {
  local etcd_port="" etcd_peer_port="" apiserver_port="" kcm_port=0 watch_pid=""
  state=""
  while [ $# -gt 0 ]; do
    case "$1" in
      --state) state="$2"; shift 2 ;;
      --etcd-port) etcd_port="$2"; shift 2 ;;
      --etcd-peer-port) etcd_peer_port="$2"; shift 2 ;;
      --apiserver-port) apiserver_port="$2"; shift 2 ;;
      --kcm-port) kcm_port="$2"; shift 2 ;;
      --watch-pid) watch_pid="$2"; shift 2 ;;
      *) die "up: unknown argument '$1'" ;;
    esac
  done
  local t0 etcd apiserver kcm
  t0=$(now_ms)
  etcd="$("$tools" which etcd)" || exit 1
  apiserver="$("$tools" which kube-apiserver)" || exit 1
  kcm="$("$tools" which kube-controller-manager)" || exit 1
  local c
  for c in openssl curl ss base64; do command -v "$c" >/dev/null || die "$c is not installed"; done

  if [ -z "$state" ]; then
    local base=/dev/shm
    [ -w "$base" ] || base="${TMPDIR:-/tmp}"
    state="$(mktemp -d "$base/zebu-k8s.XXXXXX")"
  else
    [ -e "$state/pids" ] && die "$state already holds a cluster (run down first)"
    # A failed `up` removes the directory: never one that holds something else.
    if [ -d "$state" ] && [ -n "$(ls -A "$state")" ]; then die "$state is not empty"; fi
    mkdir -p "$state"
    state="$(cd "$state" && pwd)"
  fi
  case "$state" in *[[:space:]]*) die "state directory must not contain spaces: $state" ;; esac
  # From here on, a failure stops what was started and removes the state directory.
  # shellcheck disable=SC2154 # rc is assigned inside the trap
  trap 'rc=$?; if [ "$rc" -ne 0 ]; then stop_recorded; rm -rf "$state"; fi' EXIT

  [ -n "$etcd_port" ] || etcd_port="$(pick_port)"
  [ -n "$etcd_peer_port" ] || etcd_peer_port="$(pick_port "$etcd_port")"
  [ -n "$apiserver_port" ] || apiserver_port="$(pick_port "$etcd_port" "$etcd_peer_port")"
  server="https://127.0.0.1:$apiserver_port"

  : >"$state/pids"

  # etcd. One member, data on tmpfs (or wherever --state is), no fsync: tests only. A lone
  # member has nobody to disagree with, so short raft timers only make it elect itself
  # sooner (ready in about 0.25 s instead of 0.75 s).
  "$etcd" --name zebu-test --data-dir "$state/etcd" \
    --listen-client-urls "http://127.0.0.1:$etcd_port" \
    --advertise-client-urls "http://127.0.0.1:$etcd_port" \
    --listen-peer-urls "http://127.0.0.1:$etcd_peer_port" \
    --initial-advertise-peer-urls "http://127.0.0.1:$etcd_peer_port" \
    --initial-cluster "zebu-test=http://127.0.0.1:$etcd_peer_port" \
    --unsafe-no-fsync --log-level warn \
    --heartbeat-interval 10 --election-timeout 100 \
    </dev/null >"$state/etcd.log" 2>&1 &
  local etcd_pid=$!
  record_pid etcd "$etcd_pid"
  # Made while etcd starts: neither waits for the other.
  make_credentials
  wait_for etcd "$etcd_pid" "$state/etcd.log" 30 etcd_healthy
  local t_etcd
  t_etcd=$(now_ms)

  "$apiserver" \
    --etcd-servers "http://127.0.0.1:$etcd_port" \
    --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$apiserver_port" \
    --tls-cert-file "$state/pki/apiserver.crt" --tls-private-key-file "$state/pki/apiserver.key" \
    --token-auth-file "$state/pki/tokens.csv" \
    --authorization-mode RBAC \
    --service-account-issuer https://kubernetes.default.svc \
    --service-account-key-file "$state/pki/sa.pub" \
    --service-account-signing-key-file "$state/pki/sa.key" \
    --service-cluster-ip-range 10.96.0.0/24 \
    --endpoint-reconciler-type none \
    --allow-privileged=true \
    --profiling=false \
    ${ZEBU_K8S_APISERVER_ARGS:-} \
    </dev/null >"$state/kube-apiserver.log" 2>&1 &
  local apiserver_pid=$!
  record_pid kube-apiserver "$apiserver_pid"
  wait_for kube-apiserver "$apiserver_pid" "$state/kube-apiserver.log" 90 apiserver_ready
  local t_api
  t_api=$(now_ms)

  write_kubeconfig "$state/admin.kubeconfig" zebu-admin "$admin_token"
  write_kubeconfig "$state/zebu-manager.kubeconfig" zebu-manager "$manager_token"
  write_kubeconfig "$state/norights.kubeconfig" zebu-norights "$norights_token"
  write_kubeconfig "$state/kcm.kubeconfig" system:kube-controller-manager "$kcm_token"

  local ctl
  ctl="$(IFS=,; echo "${controllers[*]}")"
  "$kcm" \
    --kubeconfig "$state/kcm.kubeconfig" \
    --leader-elect=false \
    --secure-port "$kcm_port" --bind-address 127.0.0.1 --cert-dir "$state/kcm-certs" \
    --controllers "$ctl" \
    --root-ca-file "$state/pki/ca.crt" \
    --use-service-account-credentials=false \
    --profiling=false \
    ${ZEBU_K8S_KCM_ARGS:-} \
    </dev/null >"$state/kube-controller-manager.log" 2>&1 &
  local kcm_pid=$!
  record_pid kube-controller-manager "$kcm_pid"
  wait_for kube-controller-manager "$kcm_pid" "$state/kube-controller-manager.log" 60 kcm_ready
  local t_kcm
  t_kcm=$(now_ms)

  if [ -n "$watch_pid" ]; then
    # Detached from our stdout so a caller reading our output to EOF is not held open.
    setsid bash -c 'while kill -0 "$1" 2>/dev/null && [ -f "$2/pids" ]; do sleep 1; done
                    [ -f "$2/pids" ] && exec "$3" down --state "$2" --from-watcher' \
      cluster-watch "$watch_pid" "$state" "$here/cluster.sh" </dev/null >>"$state/watch.log" 2>&1 &
    echo "$!" >"$state/watch.pid"
  fi

  {
    echo "ZEBU_K8S_STATE=$state"
    echo "ZEBU_K8S_SERVER=$server"
    echo "ZEBU_K8S_CA=$state/pki/ca.crt"
    echo "ZEBU_K8S_KUBECONFIG_ADMIN=$state/admin.kubeconfig"
    echo "ZEBU_K8S_KUBECONFIG_MANAGER=$state/zebu-manager.kubeconfig"
    echo "ZEBU_K8S_KUBECONFIG_NORIGHTS=$state/norights.kubeconfig"
    echo "ZEBU_K8S_ADMIN_USER=zebu-admin"
    echo "ZEBU_K8S_MANAGER_USER=zebu-manager"
    echo "ZEBU_K8S_NORIGHTS_USER=zebu-norights"
    echo "ZEBU_K8S_ETCD=http://127.0.0.1:$etcd_port"
    echo "ZEBU_K8S_VERSION=$("$tools" env | sed -n 's/^export ZEBU_K8S_VERSION=//p')"
    echo "ZEBU_KUBECTL=$("$tools" which kubectl)"
    echo "ZEBU_K8S_PIDS=$(awk '{print $2}' "$state/pids" | tr '\n' ' ' | sed 's/ $//')"
  } >"$state/cluster.env.tmp"
  mv "$state/cluster.env.tmp" "$state/cluster.env"
  trap - EXIT
  log "up in $(( $(now_ms) - t0 )) ms (etcd $((t_etcd - t0)) ms, kube-apiserver +$((t_api - t_etcd)) ms, kube-controller-manager +$((t_kcm - t_api)) ms): $server, state $state"
  cat "$state/cluster.env"
}

state_arg() {
  state=""
  local from_watcher=0
  while [ $# -gt 0 ]; do
    case "$1" in
      --state) state="$2"; shift 2 ;;
      --from-watcher) from_watcher=1; shift ;;
      *) die "unknown argument '$1'" ;;
    esac
  done
  [ -n "$state" ] || die "--state DIR is required"
  [ -d "$state" ] || die "no cluster state at $state"
  state="$(cd "$state" && pwd)"
  FROM_WATCHER=$from_watcher
}

# ensure: `up` unless DIR already holds a running cluster, under a lock, so that many
# processes (nextest runs every test in its own) can share one cluster: the first starts it,
# the others read its settings.
cmd_ensure() {
  local dir="" a=("$@") i
  for ((i = 0; i < ${#a[@]}; i++)); do [ "${a[i]}" = --state ] && dir="${a[i + 1]:-}"; done
  [ -n "$dir" ] || die "ensure: --state DIR is required"
  command -v flock >/dev/null || die "flock is not installed"
  mkdir -p "$(dirname "$dir")"
  # -o: the lock stays with flock itself, not with the cluster's processes started under it.
  exec flock -o "$dir.lock" "$here/cluster.sh" _ensure_locked "$@"
}

cmd_ensure_locked() {
  local dir="" a=("$@") i
  for ((i = 0; i < ${#a[@]}; i++)); do [ "${a[i]}" = --state ] && dir="${a[i + 1]:-}"; done
  if [ -f "$dir/cluster.env" ] && [ -f "$dir/pids" ]; then
    local name pid st ok=1
    while read -r name pid st; do pid_alive "$pid" "$st" || ok=0; done <"$dir/pids"
    if [ "$ok" = 1 ]; then
      log "reusing the cluster in $dir"
      cat "$dir/cluster.env"
      return 0
    fi
    log "the cluster in $dir is partly gone; replacing it"
    state="$dir"
    stop_recorded
    rm -rf "$dir"
  elif [ -e "$dir/pids" ]; then
    # An `up` that never finished (killed mid-way): what it started goes.
    state="$dir"
    stop_recorded
    rm -rf "$dir"
  fi
  cmd_up "$@"
}

cmd_env() {
  state_arg "$@"
  [ -f "$state/cluster.env" ] || die "$state has no cluster.env (is it up?)"
  cat "$state/cluster.env"
}

cmd_down() {
  state_arg "$@"
  [ -f "$state/pids" ] || die "$state holds no cluster started by cluster.sh (no pids file)"
  if [ "$FROM_WATCHER" = 0 ] && [ -f "$state/watch.pid" ]; then
    kill "$(cat "$state/watch.pid")" 2>/dev/null || true
  fi
  stop_recorded
  local name pid st running=0
  while read -r name pid st; do
    if pid_alive "$pid" "$st"; then log "$name (pid $pid) is still running"; running=1; fi
  done <"$state/pids"
  [ "$running" -eq 0 ] || die "not everything stopped; state kept in $state"
  rm -rf "$state"
  rm -f "$state.lock"
  log "down: stopped and removed $state"
}

case "${1:-}" in
  up) shift; cmd_up "$@" ;;
  ensure) shift; cmd_ensure "$@" ;;
  _ensure_locked) shift; cmd_ensure_locked "$@" ;;
  env) shift; cmd_env "$@" ;;
  down) shift; cmd_down "$@" ;;
  *) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}" >&2; exit 2 ;;
esac
