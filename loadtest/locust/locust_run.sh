#!/usr/bin/env bash
# `make loadtest`: start `pdgate up` on a free port, run Locust headless against it, stop the
# cluster (also when Locust fails or the run is interrupted). Outputs: OUT/SHAPE_*.csv and
# OUT/SHAPE.html. Settings by environment (defaults in brackets): LOADTEST_OUT [docs/results/loadtest],
# PDGATE_LOCUST_SHAPE [step], PDGATE_LOCUST_DURATION_S [45], PDGATE_LOCUST_MAX_USERS [16],
# plus those of loadtest/locust/shape_classes.py.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)

BIN=${BIN:-.venv/bin}
OUT=${LOADTEST_OUT:-docs/results/loadtest}
export PDGATE_LOCUST_SHAPE=${PDGATE_LOCUST_SHAPE:-step}
export PDGATE_LOCUST_DURATION_S=${PDGATE_LOCUST_DURATION_S:-45}
export PDGATE_LOCUST_MAX_USERS=${PDGATE_LOCUST_MAX_USERS:-16}
mkdir -p "$OUT"

log=$(mktemp)
"$BIN/pdgate" up --port 0 >"$log" 2>&1 &
up_pid=$!
stop_cluster() {
    # SIGTERM lets `pdgate up` drain and close its servers; only this script's child is hit.
    if kill -0 "$up_pid" 2>/dev/null; then
        kill -TERM "$up_pid" 2>/dev/null || true
        for _ in $(seq 50); do kill -0 "$up_pid" 2>/dev/null || break; sleep 0.2; done
        kill -KILL "$up_pid" 2>/dev/null || true
    fi
    wait "$up_pid" 2>/dev/null || true
    rm -f "$log"
}
trap stop_cluster EXIT INT TERM

url=""
for _ in $(seq 100); do
    url=$(grep -o 'pdgate up: send OpenAI requests to http://[0-9.:]*' "$log" | grep -o 'http://.*' || true)
    [ -n "$url" ] && break
    kill -0 "$up_pid" 2>/dev/null || { cat "$log" >&2; exit 1; }
    sleep 0.1
done
[ -n "$url" ] || { echo "pdgate up did not start:" >&2; tail -20 "$log" >&2; exit 1; }
echo "loadtest: pdgate up at $url; locust $PDGATE_LOCUST_SHAPE shape for ${PDGATE_LOCUST_DURATION_S}s; load: $(uptime)"

# --stop-timeout: let streams in flight at the end finish instead of cutting them (counted
# as failures); longer than any stream of the workload.
"$BIN/locust" -f "$here/locustfile.py" --host "$url" --headless --only-summary \
    --stop-timeout 30 --csv "$OUT/$PDGATE_LOCUST_SHAPE" --html "$OUT/$PDGATE_LOCUST_SHAPE.html"
