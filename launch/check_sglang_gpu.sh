#!/usr/bin/env bash
# Operator check on a GPU node (not run by CI: it needs a full sglang==0.5.23 install and >= 2 GPUs).
# Starts a PD pair with our plugin (prefill on GPU 0, decode on GPU 1, router), sends a short burst
# of requests, then prints the plugin's self-test, K and predicted-vs-measured step time from the
# decode server's /server_info, and stops everything.
#
#   MODEL=/models/Qwen3-8B DRAFT=/models/Qwen3-8B-DSpark PROFILE=engine_profiles/x.yaml \
#     [BACKEND=mooncake|nixl IB_DEVICE=mlx5_0 PORT=8000 NUM_REQUESTS=64] launch/check_sglang_gpu.sh
#
# PROFILE is optional (without it the plugin plans with SGLang's flat default table, i.e. K = all);
# measured step times then refit the model live, which is what the printout shows.
set -euo pipefail
PY=${PYTHON:-python3}
MODEL=${MODEL:?set MODEL to a HF checkpoint SGLang can serve with DSPARK}
PORT=${PORT:-8000}
N=${NUM_REQUESTS:-64}
WORK=$(mktemp -d)
cat >"$WORK/check.yaml" <<YAML
name: check-sglang-gpu
model_path: $MODEL
draft_model_path: ${DRAFT:-null}
profile: ${PROFILE:-null}
schedule_mode: lagged
transfer_backend: ${BACKEND:-mooncake}
ib_device: ${IB_DEVICE:-null}
output_dir: $WORK/tables
python: $PY
router: {host: 127.0.0.1, port: $PORT}
prefill: [{host: 127.0.0.1, port: $((PORT + 1)), bootstrap_port: 8998, base_gpu_id: 0}]
decode: [{host: 127.0.0.1, port: $((PORT + 2)), base_gpu_id: 1}]
YAML
FLAGS=(--engine sglang --sglang-config "$WORK/check.yaml")

echo "== plugin self-test (sglang $("$PY" -c 'import importlib.metadata as m; print(m.version("sglang"))'))"
"$PY" -c 'from dspark_sglang.sglang_plugin import hooks; hooks.self_test(); print("ok")'
"$PY" -c 'from importlib.metadata import entry_points as e
eps = [p.value for p in e(group="sglang.srt.plugins") if p.name == "dspark"]
print("entry point:", eps or "MISSING (reinstall dspark-sglang)")'

echo "== commands"
"$PY" -m dspark_sglang.launch_server "${FLAGS[@]}" --dry-run | tee "$WORK/commands.sh"

"$PY" -m dspark_sglang.launch_server "${FLAGS[@]}" >"$WORK/servers.log" 2>&1 &
LAUNCHER=$!
trap 'kill $LAUNCHER 2>/dev/null; wait $LAUNCHER 2>/dev/null; echo "logs: $WORK"' EXIT
echo "== waiting for the router on :$PORT (log: $WORK/servers.log)"
for _ in $(seq 600); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
  kill -0 $LAUNCHER 2>/dev/null || { tail -50 "$WORK/servers.log"; exit 1; }
  sleep 1
done

echo "== $N requests, 8 at a time"
seq "$N" | xargs -P 8 -I{} curl -sf "http://127.0.0.1:$PORT/generate" \
  -H 'Content-Type: application/json' \
  -d '{"text": "Write a short story about the number {}.", "sampling_params": {"max_new_tokens": 128, "temperature": 0}}' \
  -o /dev/null

DECODE_PORT=$((PORT + 2))
echo "== plugin state on the decode server (:$DECODE_PORT/server_info)"
curl -sf "http://127.0.0.1:$DECODE_PORT/server_info" | "$PY" -c '
import json, sys
info = json.load(sys.stdin)
for i, s in enumerate(info.get("internal_states", [info])):
    p = s.get("dspark_plugin")
    if p is None:
        sys.exit("no dspark_plugin block: is SGLANG_PLUGINS=dspark set and the plugin installed?")
    print(f"rank {i}: self_test={p.get(\"self_test\")} active={p.get(\"active\")}")
    for k in ("k_last", "k_mean", "predicted_step_ms", "measured_step_ms", "mape",
              "capacity_version", "tiers", "fallbacks", "prior_rates"):
        print(f"  {k}: {p.get(k)}")
'
