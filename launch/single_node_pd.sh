#!/usr/bin/env bash
# One host, several workers: router + N prefill + M decode processes, wired over loopback ZMQ.
#   NUM_PREFILL=2 NUM_DECODE=2 PORT=30000 launch/single_node_pd.sh [--model-path M --draft-model-path D ...]
# ZMQ ports: ZMQ_PORT (router), then one per prefill worker, then one per decode worker.
set -euo pipefail
PY=${PYTHON:-.venv/bin/python}
exec "$PY" -m dspark_sglang.launch_server --role all \
  --host "${HOST:-127.0.0.1}" --port "${PORT:-30000}" \
  --num-prefill-workers "${NUM_PREFILL:-2}" --num-decode-workers "${NUM_DECODE:-2}" \
  --zmq-port "${ZMQ_PORT:-30100}" "$@"
