#!/usr/bin/env bash
# N deltaserve replicas behind vllm-router (--policy kv_aware, fed by each replica's KV events), on one
# machine, loopback only. Everything after -- goes to every replica's `deltaserve serve`.
#
#   scripts/serve_cluster.sh [N=2] [-- serve flags ...]
#   ROUTER_PORT=8000 BASE_PORT=8100 scripts/serve_cluster.sh 2 -- --kv-cache-memory 1G
#
# The router listens on 127.0.0.1:$ROUTER_PORT; replica i on 127.0.0.1:$((BASE_PORT + i)), its KV events on
# tcp://127.0.0.1:$((BASE_PORT + 100 + i)). Ctrl-C stops them all. Needs vllm-router (pip install vllm-router).
set -euo pipefail
N=2
if [[ $# -gt 0 && $1 != "--" ]]; then N=$1; shift; fi
exec python -m deltaserve.tools.cluster --replicas "$N" --port "${ROUTER_PORT:-8000}" --base-port "${BASE_PORT:-8100}" \
  --prometheus-port "${ROUTER_METRICS_PORT:-29000}" --log-dir "${LOG_DIR:-.}" "$@"
