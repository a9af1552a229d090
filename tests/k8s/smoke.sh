#!/usr/bin/env bash
# shellcheck disable=SC2154 # the a_* and b_* variables are set by up_cluster (printf -v)
# Smoke check of the test control plane (no Rust): brings a cluster up, applies a ConfigMap
# and a small CRD with printer columns server-side, reads them back, checks that a user
# without rights is refused with a message naming the verb and the resource, runs a second
# cluster beside the first, checks the --watch-pid watcher, and brings everything down,
# asserting that no process it started is left. Ends with `N passed, N failed`; exit 0 only
# when nothing failed.
#
#   tests/k8s/smoke.sh [GROUP]...   groups besides k8s whose tools to check too: csi, helm,
#                                   validate, all (each is built first if the cache lacks it)
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
passed=0 failed=0
pass() { passed=$((passed + 1)); echo "ok   $*"; }
fail() { failed=$((failed + 1)); echo "FAIL $*"; }
check() { # description command... : passes when the command succeeds
  local what="$1"; shift
  if "$@"; then pass "$what"; else fail "$what"; return 1; fi
}
contains() { # haystack needle
  case "$1" in *"$2"*) return 0 ;; *) echo "  expected to find: $2" >&2; echo "  in: $1" >&2; return 1 ;; esac
}

groups=(k8s)
for g in "$@"; do
  case "$g" in
    all) groups=(k8s csi helm validate) ;;
    k8s|csi|helm|validate) groups+=("$g") ;;
    *) echo "smoke.sh: unknown group '$g' (k8s, csi, helm, validate, all)" >&2; exit 2 ;;
  esac
done
want() { case " ${groups[*]} " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
"$here/tools.sh" "${groups[@]}" >&2 || { echo "tools.sh ${groups[*]} failed"; echo "0 passed, 1 failed"; exit 1; }
kubectl="$("$here/tools.sh" which kubectl)"
work="$(mktemp -d)"
states=()
cleanup() {
  local s
  for s in "${states[@]}"; do [ -d "$s" ] && "$here/cluster.sh" down --state "$s" >/dev/null 2>&1; done
  rm -rf "$work"
}
trap cleanup EXIT

# up_cluster NAME: starts a cluster with its state in $work/NAME and loads its settings into
# variables NAME_<KEY> (e.g. a_ZEBU_K8S_SERVER).
up_cluster() {
  local name="$1" line
  states+=("$work/$name")
  "$here/cluster.sh" "${verb:-up}" --state "$work/$name" "${@:2}" >"$work/$name.env" 2>"$work/$name.up.log" || {
    cat "$work/$name.up.log" >&2; return 1; }
  while IFS= read -r line; do
    [ -n "$line" ] && printf -v "${name}_${line%%=*}" '%s' "${line#*=}"
  done <"$work/$name.env"
  sed -n 's/^cluster.sh: up in/  up in/p' "$work/$name.up.log"
}

pids_gone() { # "pid pid ..." : none runs (a zombie not yet reaped by a subreaper is dead)
  local p st
  for p in $1; do
    st="$(awk '{print $3}' "/proc/$p/stat" 2>/dev/null)" || continue
    if [ -n "$st" ] && [ "$st" != Z ]; then
      echo "  pid $p still running: $(tr '\0' ' ' <"/proc/$p/cmdline")" >&2; return 1
    fi
  done
}

# --- one cluster, used by most checks ---------------------------------------------------------
if ! up_cluster a; then
  fail "cluster a comes up"
  echo "$passed passed, $failed failed"; exit 1
fi
pass "cluster a comes up"
k() { "$kubectl" --kubeconfig "$a_ZEBU_K8S_KUBECONFIG_ADMIN" "$@"; }

version="$(k version -o json 2>&1)"
check "/version reports the release built ($a_ZEBU_K8S_VERSION)" \
  contains "$version" "\"gitVersion\": \"$a_ZEBU_K8S_VERSION\""

cat >"$work/cm.yaml" <<'EOF'
apiVersion: v1
kind: ConfigMap
metadata:
  name: smoke
  namespace: default
data:
  greeting: hello-from-zebu
EOF
out="$(k apply --server-side --field-manager zebu-smoke -f "$work/cm.yaml" 2>&1)"
check "server-side apply of a ConfigMap" contains "$out" "configmap/smoke serverside-applied"
out="$(k get configmap smoke -o jsonpath='{.data.greeting}' 2>&1)"
check "the ConfigMap reads back" [ "$out" = hello-from-zebu ]
out="$(k get configmap smoke -o jsonpath='{.metadata.managedFields[0].manager}' 2>&1)"
check "the apply is recorded under its field manager" [ "$out" = zebu-smoke ]

cat >"$work/crd.yaml" <<'EOF'
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: gadgets.smoke.zebu.io
spec:
  group: smoke.zebu.io
  names: {kind: Gadget, plural: gadgets, singular: gadget, shortNames: [gd]}
  scope: Namespaced
  versions:
  - name: v1alpha1
    served: true
    storage: true
    subresources: {status: {}}
    additionalPrinterColumns:
    - {name: Size, type: string, jsonPath: .spec.size}
    - {name: Replicas, type: integer, jsonPath: .spec.replicas}
    - {name: State, type: string, jsonPath: .status.state}
    - {name: Age, type: date, jsonPath: .metadata.creationTimestamp}
    schema:
      openAPIV3Schema:
        type: object
        properties:
          spec:
            type: object
            required: [size]
            properties:
              size: {type: string}
              replicas: {type: integer, minimum: 1, maximum: 3}
          status:
            type: object
            properties:
              state: {type: string}
EOF
out="$(k apply --server-side -f "$work/crd.yaml" 2>&1)"
check "server-side apply of a CRD" contains "$out" "gadgets.smoke.zebu.io serverside-applied"
out="$(k wait --for condition=Established --timeout 30s crd/gadgets.smoke.zebu.io 2>&1)"
check "the CRD becomes Established" contains "$out" "condition met"
cat >"$work/gadget.yaml" <<'EOF'
apiVersion: smoke.zebu.io/v1alpha1
kind: Gadget
metadata: {name: g1, namespace: default}
spec: {size: 10Gi, replicas: 3}
EOF
# Discovery of a just-established group can lag by a moment.
for _ in $(seq 1 50); do k apply --server-side -f "$work/gadget.yaml" >/dev/null 2>&1 && break; sleep 0.2; done
out="$(k get gadgets 2>&1)"
check "kubectl get shows the printer columns" \
  contains "$(head -n1 <<<"$out" | tr -s ' ')" "NAME SIZE REPLICAS STATE AGE"
check "kubectl get shows the resource's values" contains "$(sed -n 2p <<<"$out" | tr -s ' ')" "g1 10Gi 3"
out="$(k get gd g1 -o jsonpath='{.spec.size}' 2>&1)"
check "the short name resolves" [ "$out" = 10Gi ]
cat >"$work/bad-gadget.yaml" <<'EOF'
apiVersion: smoke.zebu.io/v1alpha1
kind: Gadget
metadata: {name: g2, namespace: default}
spec: {size: 1Gi, replicas: 7}
EOF
out="$(k apply --server-side -f "$work/bad-gadget.yaml" 2>&1)"
check "the API server validates the CRD's schema (replicas 7 > maximum 3)" \
  contains "$out" "spec.replicas: Invalid value: 7"

nr() { "$kubectl" --kubeconfig "$a_ZEBU_K8S_KUBECONFIG_NORIGHTS" "$@"; }
out="$(nr get configmaps -n default 2>&1)"; rc=$?
check "a user without rights is refused" [ "$rc" -ne 0 ]
check "the refusal names the user, the verb and the resource" contains "$out" \
  'configmaps is forbidden: User "zebu-norights" cannot list resource "configmaps" in API group "" in the namespace "default"'
out="$(nr get gadgets.smoke.zebu.io -n default 2>&1)"
check "the refusal names a custom resource and its group" contains "$out" \
  'cannot list resource "gadgets" in API group "smoke.zebu.io"'
out="$(k auth can-i create leases.coordination.k8s.io -n kube-system 2>/dev/null)"
check "the admin may do anything" [ "$out" = yes ]
out="$("$kubectl" --kubeconfig "$a_ZEBU_K8S_KUBECONFIG_MANAGER" auth can-i create leases.coordination.k8s.io -n kube-system 2>/dev/null)"
check "zebu-manager has no rights until RBAC binds them" [ "$out" = no ]
out="$(k auth can-i list configmaps -n default --as zebu-norights 2>/dev/null)"
check "the admin can impersonate to check a user's rights" [ "$out" = no ]

out="$(k get serviceaccount default -n default -o name 2>&1)"
check "the service-account controller runs" [ "$out" = serviceaccount/default ]
k create namespace smoke-gc >/dev/null 2>&1
k create configmap owned -n smoke-gc >/dev/null 2>&1
k delete namespace smoke-gc --wait=false >/dev/null 2>&1
gone=no
for _ in $(seq 1 100); do
  k get namespace smoke-gc >/dev/null 2>&1 || { gone=yes; break; }
  sleep 0.2
done
check "the namespace controller finishes a namespace delete" [ "$gone" = yes ]

# --- the storage controllers the CSI tests rely on, with no kubelet and no driver -----------
# wait_until SECONDS command...: polls every 0.2 s
wait_until() {
  local n=$(( $1 * 5 )); shift
  while [ "$n" -gt 0 ]; do "$@" >/dev/null 2>&1 && return 0; sleep 0.2; n=$((n - 1)); done
  return 1
}
cat >"$work/storage.yaml" <<'EOF'
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {name: smoke}
provisioner: driver.smoke.zebu.io
volumeBindingMode: Immediate
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: dynamic, namespace: default}
spec:
  storageClassName: smoke
  accessModes: [ReadWriteOnce]
  resources: {requests: {storage: 1Gi}}
---
apiVersion: v1
kind: Node
metadata:
  name: smoke-node
  annotations: {volumes.kubernetes.io/controller-managed-attach-detach: "true"}
---
apiVersion: v1
kind: PersistentVolume
metadata: {name: smoke-pv}
spec:
  capacity: {storage: 1Gi}
  accessModes: [ReadWriteOnce]
  persistentVolumeReclaimPolicy: Retain
  storageClassName: ""
  claimRef: {namespace: default, name: static}
  csi: {driver: driver.smoke.zebu.io, volumeHandle: smoke-volume}
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: static, namespace: default}
spec:
  storageClassName: ""
  volumeName: smoke-pv
  accessModes: [ReadWriteOnce]
  resources: {requests: {storage: 1Gi}}
---
apiVersion: v1
kind: Pod
metadata: {name: user, namespace: default}
spec:
  nodeName: smoke-node
  containers: [{name: c, image: example.invalid/none:0}]
  volumes: [{name: v, persistentVolumeClaim: {claimName: static}}]
EOF
out="$(k apply --server-side -f "$work/storage.yaml" 2>&1)"
check "PVC, PV, Node and Pod apply" [ "$(grep -c serverside-applied <<<"$out")" -eq 6 ] || echo "$out" >&2
provisioner_of() { [ "$(k get pvc dynamic -o jsonpath='{.metadata.annotations.volume\.kubernetes\.io/storage-provisioner}')" = driver.smoke.zebu.io ]; }
check "the PV binder hands a claim to its CSI provisioner (annotation)" wait_until 30 provisioner_of
bound() { [ "$(k get pvc static -o jsonpath='{.status.phase}')" = Bound ]; }
check "the PV binder binds a pre-bound PV" wait_until 30 bound
attachment() { k get volumeattachments -o jsonpath='{range .items[*]}{.spec.attacher} {.spec.nodeName} {.spec.source.persistentVolumeName}{"\n"}{end}'; }
has_attachment() { [ "$(attachment)" = "driver.smoke.zebu.io smoke-node smoke-pv" ]; }
check "attach-detach makes a VolumeAttachment for a pod with spec.nodeName" wait_until 30 has_attachment
va="$(k get volumeattachments -o name 2>/dev/null | head -n1)"
# What csi-attacher would do once ControllerPublishVolume succeeds.
k patch "$va" --subresource status --type merge -p '{"status":{"attached":true}}' >/dev/null 2>&1
k delete pod user --grace-period 0 --force >/dev/null 2>&1
no_attachment() { [ -z "$(k get volumeattachments -o name)" ]; }
check "attach-detach removes the VolumeAttachment when the pod goes" wait_until 30 no_attachment
k delete pvc static --wait=false >/dev/null 2>&1
claim_gone() { ! k get pvc static >/dev/null 2>&1; }
check "PVC protection lets an unused claim go (its finalizer is removed)" wait_until 30 claim_gone
released() { [ "$(k get pv smoke-pv -o jsonpath='{.status.phase}')" = Released ]; }
check "its Retain PV turns Released" wait_until 30 released
cat >"$work/ds.yaml" <<'EOF'
apiVersion: apps/v1
kind: DaemonSet
metadata: {name: privileged, namespace: default}
spec:
  selector: {matchLabels: {app: privileged}}
  template:
    metadata: {labels: {app: privileged}}
    spec:
      hostNetwork: true
      containers:
      - name: c
        image: example.invalid/none:0
        securityContext: {privileged: true}
EOF
out="$(k apply --server-side -f "$work/ds.yaml" 2>&1)"
check "a privileged host-network DaemonSet is accepted (--allow-privileged)" \
  contains "$out" "daemonset.apps/privileged serverside-applied"

# --- the other tools, each used for real where a cluster helps --------------------------------
if want validate; then
  kv="$("$here/tools.sh" which kubernetes-validate)"
  out="$("$kv" --strict -k 1.34.0 "$work/crd.yaml" "$work/cm.yaml" 2>&1)"
  check "kubernetes-validate --strict passes valid manifests" [ $? -eq 0 ]
  printf 'apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\ndata: {a: 1}\n' >"$work/bad-cm.yaml"
  out="$("$kv" --strict -k 1.34.0 "$work/bad-cm.yaml" 2>&1)"; rc=$?
  check "kubernetes-validate refuses an invalid manifest, offline" [ "$rc" -ne 0 ]
  check "its message names the field and the type" contains "$out" "data.a: 1 is not of type 'string'"
fi
if want helm; then
  helm="$("$here/tools.sh" which helm)"
  out="$("$helm" version --short 2>&1)"
  check "helm reports its version" contains "$out" "$(sed -n 's/^version=//p' "$(dirname "$helm")/../stamp")"
  mkdir -p "$work/chart/templates"
  printf 'apiVersion: v2\nname: smoke\nversion: 0.1.0\n' >"$work/chart/Chart.yaml"
  printf 'greeting: hello\n' >"$work/chart/values.yaml"
  cat >"$work/chart/templates/cm.yaml" <<'EOF'
apiVersion: v1
kind: ConfigMap
metadata:
  name: {{ .Release.Name }}-cm
  namespace: {{ .Release.Namespace }}
data:
  greeting: {{ .Values.greeting | quote }}
EOF
  out="$("$helm" template rel "$work/chart" --namespace default --set greeting=templated 2>&1)"
  check "helm template renders a chart" contains "$out" 'greeting: "templated"'
  printf '%s\n' "$out" >"$work/rendered.yaml"
  out="$(k apply --server-side -f "$work/rendered.yaml" 2>&1)"
  check "the rendered manifest applies server-side" contains "$out" "configmap/rel-cm serverside-applied"
fi
if want csi; then
  for b in csi-provisioner csi-attacher csi-resizer csi-snapshotter snapshot-controller; do
    bin="$("$here/tools.sh" which "$b")"
    ver="$(sed -n 's/^version=//p' "$(dirname "$bin")/../stamp")"
    out="$("$bin" --version 2>&1)"
    check "$b reports version $ver" contains "$out" "$ver"
  done
  out="$("$("$here/tools.sh" which csi-sanity)" -version 2>&1)"
  check "csi-sanity reports its version" contains "$out" "Version = v5.4.0"
  crds="$("$here/tools.sh" env | sed -n 's/^export ZEBU_SNAPSHOT_CRDS=//p')"
  out="$(k apply --server-side -f "$crds" 2>&1)"
  check "the VolumeSnapshot CRDs apply" contains "$out" "volumesnapshots.snapshot.storage.k8s.io serverside-applied"
  out="$(k wait --for condition=Established --timeout 30s crd/volumesnapshots.snapshot.storage.k8s.io \
    crd/volumesnapshotcontents.snapshot.storage.k8s.io crd/volumesnapshotclasses.snapshot.storage.k8s.io 2>&1)"
  check "the VolumeSnapshot CRDs become Established" [ "$(grep -c "condition met" <<<"$out")" -eq 3 ]
fi

# --- a second cluster beside the first, and the watcher -------------------------------------
sleep 600 &
sleeper=$!
if verb=ensure up_cluster b --watch-pid "$sleeper"; then
  pass "cluster b comes up beside cluster a (through ensure)"
  out="$("$here/cluster.sh" ensure --state "$work/b" --watch-pid "$sleeper" 2>&1)"
  check "ensure reuses the running cluster" contains "$out" "reusing the cluster in $work/b"
  check "ensure gives the same settings" contains "$out" "ZEBU_K8S_PIDS=$b_ZEBU_K8S_PIDS"
  check "the two clusters have their own API servers" [ "$a_ZEBU_K8S_SERVER" != "$b_ZEBU_K8S_SERVER" ]
  out="$("$kubectl" --kubeconfig "$b_ZEBU_K8S_KUBECONFIG_ADMIN" get configmap smoke -n default 2>&1)"
  check "cluster b does not see cluster a's objects" contains "$out" 'configmaps "smoke" not found'
  out="$(k get configmap smoke -o jsonpath='{.data.greeting}' 2>&1)"
  check "cluster a still serves while b runs" [ "$out" = hello-from-zebu ]
  kill -9 "$sleeper"; wait "$sleeper" 2>/dev/null
  stopped=no
  for _ in $(seq 1 100); do
    if pids_gone "$b_ZEBU_K8S_PIDS" 2>/dev/null && [ ! -d "$work/b" ]; then stopped=yes; break; fi
    sleep 0.2
  done
  check "the watcher stops cluster b when the watched process dies" [ "$stopped" = yes ]
else
  fail "cluster b comes up beside cluster a"
  kill -9 "$sleeper" 2>/dev/null
fi

# --- down -------------------------------------------------------------------------------------
out="$("$here/cluster.sh" down --state "$work/a" 2>&1)"; rc=$?
check "down succeeds" [ "$rc" -eq 0 ]
check "down leaves no process it started" pids_gone "$a_ZEBU_K8S_PIDS"
check "down removes the state directory" [ ! -e "$work/a" ]
out="$(curl -sk --max-time 2 "$a_ZEBU_K8S_SERVER/readyz" 2>&1)"; rc=$?
check "the API server's port is closed" [ "$rc" -ne 0 ]
out="$("$here/cluster.sh" down --state "$work/a" 2>&1)"; rc=$?
check "down of a cluster that is gone is a clear error" [ "$rc" -ne 0 ]

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
