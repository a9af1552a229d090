#!/usr/bin/env bash
# Runs schemathesis (PyPI) against a running Zebu REST API with the API's own OpenAPI
# document (issue 18, item 8): every operation the document names, with generated valid and
# invalid inputs; fails on a 5xx, a response that does not match the schema, or a call that
# does not answer in time.
#
#   tests/scripts/schemathesis.sh venv          build the venv only (cached)
#   tests/scripts/schemathesis.sh run API_URL   run against API_URL (http://127.0.0.1:PORT)
#
# The venv lives outside the checkout, keyed by the pinned version, like tests/k8s/tools.sh's
# kubernetes-validate: $ZEBU_TOOLS_CACHE/schemathesis-VERSION (default /var/cache/zebu-tools).
# Knobs: SCHEMATHESIS_MAX_EXAMPLES (per operation, default 25), SCHEMATHESIS_TIMEOUT
# (seconds per request, default 10).
set -euo pipefail

VERSION=4.32.5
cache=${ZEBU_TOOLS_CACHE:-/var/cache/zebu-tools}
venv="$cache/schemathesis-$VERSION"

build_venv() {
  if [ -x "$venv/bin/st" ]; then
    return
  fi
  mkdir -p "$cache"
  local tmp="$venv.tmp.$$"
  rm -rf "$tmp"
  # The venv's scripts carry their absolute path: build it where it will live, under a
  # temporary name, then move it into place in one rename.
  python3 -m venv "$tmp"
  "$tmp/bin/pip" install -q --disable-pip-version-check "schemathesis==$VERSION"
  rm -rf "$venv.old"
  [ -e "$venv" ] && mv "$venv" "$venv.old"
  mv "$tmp" "$venv"
  # Fix the absolute paths the scripts were made with.
  grep -rl "$tmp" "$venv/bin" | xargs -r sed -i "s#$tmp#$venv#g"
  rm -rf "$venv.old"
}

case "${1:-}" in
  venv)
    build_venv
    ;;
  run)
    api=${2:?give the API URL}
    build_venv
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    curl -fsS "$api/v1/openapi.json" -o "$work/openapi.json"
    cd "$work"
    "$venv/bin/st" run "$work/openapi.json" \
      --url "$api" \
      --checks not_a_server_error,response_schema_conformance,status_code_conformance,content_type_conformance \
      --max-examples "${SCHEMATHESIS_MAX_EXAMPLES:-25}" \
      --request-timeout "${SCHEMATHESIS_TIMEOUT:-10}" \
      --workers 1 \
      --no-color \
      --suppress-health-check all
    ;;
  *)
    echo "usage: $0 venv | run API_URL" >&2
    exit 2
    ;;
esac
