#!/usr/bin/env bash
# SGLang PD on this node: prefill + decode servers (DSPARK, compact verify, our plugin) + router.
#   CONFIG=launch/sglang_single_node_pd.yaml launch/sglang_single_node_pd.sh [--dry-run]
# Needs a full GPU install: pip install sglang==0.5.23 sglang-router==0.3.2 and this package
# (its entry point `dspark` under sglang.srt.plugins is what SGLANG_PLUGINS=dspark selects).
set -euo pipefail
PY=${PYTHON:-.venv/bin/python}
exec "$PY" -m dspark_sglang.launch_server --engine sglang --role all \
  --sglang-config "${CONFIG:-launch/sglang_single_node_pd.yaml}" "$@"
