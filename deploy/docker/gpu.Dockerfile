# syntax=docker/dockerfile:1
# GPU image: SGLang 0.5.23 (the version the DSPARK plugin pins and self-tests) + dspark_sglang
# with its SGLang plugin (entry-point group `sglang.srt.plugins`, enabled by SGLANG_PLUGINS=dspark).
#
#   docker build -f deploy/docker/gpu.Dockerfile -t dspark-sglang-gpu:0.1.0-sglang0.5.23 .
#
# The same image runs the SGLang prefill/decode servers (python3 -m sglang.launch_server) and the
# PD router (python3 -m sglang_router.launch_router) in deploy/k8s/overlays/sglang-pd.

FROM lmsysorg/sglang:v0.5.23
WORKDIR /opt/dspark-sglang
COPY pyproject.toml README.md ./
COPY dspark_sglang ./dspark_sglang
# --no-deps keeps the image's torch/CUDA/SGLang stack exactly as shipped: what dspark_sglang imports
# at run time is already in sglang's dependency tree (only `calibrate --plot` needs matplotlib,
# which is left out). The check fails the build when the base is not sglang 0.5.23 or the plugin's
# entry point is missing or does not import.
COPY deploy/docker/check_sglang_plugin.py /usr/local/bin/check_sglang_plugin.py
RUN pip install --no-cache-dir --no-deps . \
    && python3 /usr/local/bin/check_sglang_plugin.py
ENV SGLANG_PLUGINS=dspark
EXPOSE 30000
ENTRYPOINT []
CMD ["python3", "-m", "sglang.launch_server", "--help"]
