#!/usr/bin/env bash
# One process of a multi-node SGLang PD deployment; run it on each node with the same YAML:
#   ROLE=prefill|decode|router INDEX=<server> NODE_RANK=<rank> launch/sglang_multi_node_pd.sh
# ROLE=router takes no INDEX/NODE_RANK. Add --dry-run to see the command without starting it.
set -euo pipefail
PY=${PYTHON:-.venv/bin/python}
exec "$PY" -m dspark_sglang.launch_server --engine sglang \
  --sglang-config "${CONFIG:-launch/sglang_multi_node_pd.yaml}" \
  --role "${ROLE:?set ROLE=prefill|decode|router}" --worker-index "${INDEX:-0}" \
  --node-rank "${NODE_RANK:-0}" "$@"
