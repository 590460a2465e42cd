#!/usr/bin/env bash
# Roles on different hosts. Every host runs this script with the same address list and the same
# secret; only ROLE (and INDEX for workers) differ. Off-host ZMQ needs CurveZMQ or an HMAC secret.
#
#   # once, on any host; then copy the folder (or the key file) to every host, mode 0700/0600
#   .venv/bin/python -m dspark_sglang.launch_server --gen-curve-keys /etc/dspark/curve
#   # or: head -c 32 /dev/urandom | base64 > /etc/dspark/hmac.key
#
#   ROLE=router  launch/multi_host_pd.sh          # on $ROUTER_HOST (serves HTTP on :$PORT)
#   ROLE=prefill INDEX=0 launch/multi_host_pd.sh  # on the host of prefill address 0
#   ROLE=decode  INDEX=1 launch/multi_host_pd.sh  # on the host of decode address 1
#
# Each worker binds its own address (so it must be an address of that host) and connects to the
# router's; restart a worker with the same command and it rejoins the running router.
set -euo pipefail
PY=${PYTHON:-.venv/bin/python}
ROUTER_HOST=${ROUTER_HOST:-10.0.0.1}
PREFILL_ADDRS=${PREFILL_ADDRS:-tcp://10.0.0.2:30101,tcp://10.0.0.3:30101}
DECODE_ADDRS=${DECODE_ADDRS:-tcp://10.0.0.4:30102,tcp://10.0.0.5:30102}
if [[ -n "${HMAC_KEY_FILE:-}" ]]; then
  SECRET=(--zmq-hmac-key-file "$HMAC_KEY_FILE")
else
  SECRET=(--zmq-curve-dir "${CURVE_DIR:-/etc/dspark/curve}")
fi
API_KEY_ARGS=()
if [[ -n "${API_KEY:-}" ]]; then API_KEY_ARGS=(--api-key "$API_KEY"); fi
exec "$PY" -m dspark_sglang.launch_server --role "${ROLE:?set ROLE=router|prefill|decode}" \
  --worker-index "${INDEX:-0}" --host 0.0.0.0 --port "${PORT:-30000}" "${API_KEY_ARGS[@]}" \
  --zmq-api-addr "tcp://$ROUTER_HOST:${ZMQ_API_PORT:-30100}" \
  --zmq-prefill-addrs "$PREFILL_ADDRS" --zmq-decode-addrs "$DECODE_ADDRS" \
  "${SECRET[@]}" "$@"
