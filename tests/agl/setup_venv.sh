#!/usr/bin/env bash
# Creates .venv-agl/ with the real agentlightning==0.3.0 for the compatibility tests (about
# 800 MB; kept out of the project's dependencies). Idempotent: a stamp marks a finished install.
# OpenTelemetry is pinned to the 1.44.0 family: with 1.45 agentlightning 0.3.0's exporter loses
# every span (see shared/reference/AGL-V0.3-SEMANTICS.md, "Pitfalls").
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${AGL_VENV:-.venv-agl}
STAMP="$VENV/.agl-0.3.0-otel-1.44.0"
if [ -f "$STAMP" ]; then exit 0; fi
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
echo "agl-venv: installing agentlightning==0.3.0 into $VENV (first run only)..." >&2
"$VENV/bin/pip" install --quiet --disable-pip-version-check \
  "agentlightning==0.3.0" \
  "opentelemetry-api==1.44.0" "opentelemetry-sdk==1.44.0" "opentelemetry-proto==1.44.0" \
  "opentelemetry-exporter-otlp==1.44.0" "opentelemetry-exporter-otlp-proto-http==1.44.0" \
  "opentelemetry-exporter-otlp-proto-grpc==1.44.0" "opentelemetry-exporter-otlp-proto-common==1.44.0" \
  "opentelemetry-semantic-conventions==0.65b0" "opentelemetry-instrumentation==0.65b0" >&2
touch "$STAMP"
