#!/usr/bin/env bash
# Render the Helm chart into the plain manifests deploy/zebu.yaml (for `kubectl apply`
# without Helm), or into OUT when given: `deploy/render.sh [OUT]`. The kube_deploy test
# renders into a temporary file and fails when deploy/zebu.yaml differs: run this after
# any change to deploy/chart or deploy/crds, and commit both.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
helm="${HELM:-$("$here/../tests/k8s/tools.sh" which helm)}"
out="${1:-$here/zebu.yaml}"
{
  echo "# Rendered from deploy/chart by deploy/render.sh (helm template); do not edit."
  "$helm" template zebu "$here/chart" --namespace zebu-system --include-crds
} > "$out.new"
mv "$out.new" "$out"
