# syntax=docker/dockerfile:1
# CPU image: the reference engine with the bundled tiny model, as `make serve` runs it.
#
#   docker build -f deploy/docker/cpu.Dockerfile -t dspark-sglang-cpu:0.1.0 .   # repository root
#   docker run --rm -p 30000:30000 dspark-sglang-cpu:0.1.0                       # --role all
#
# The entrypoint is `make serve` with HOST=0.0.0.0: HTTP on every interface, while --role all keeps
# the internal ZMQ sockets on 127.0.0.1. Extra arguments are appended like SERVE_ARGS
# (`docker run ... dspark-sglang-cpu:0.1.0 --api-key KEY`; later flags win). Kubernetes manifests
# replace CMD with `args:` to run one role per pod (deploy/k8s/overlays/cpu-demo).

FROM python:3.11.13-slim-bookworm AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# The CPU wheel of the pinned torch: the default index would install the CUDA build (GBs).
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu torch==2.14.1+cpu
WORKDIR /src
COPY pyproject.toml README.md ./
COPY dspark_sglang ./dspark_sglang
# A regular (non-editable) install: the bundled model ships as package data.
RUN pip install --no-cache-dir . \
    && python -m dspark_sglang.assets path \
    && python -m dspark_sglang.launch_server --help > /dev/null

FROM python:3.11.13-slim-bookworm
RUN groupadd --system --gid 10001 dspark \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /tmp \
        --shell /usr/sbin/nologin dspark
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    HOME=/tmp \
    OMP_NUM_THREADS=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
WORKDIR /tmp
USER 10001:10001
# 30000: HTTP (OpenAI API, /health, /ready, /metrics). ZMQ 30100+ is published only when roles run
# in separate containers (then with --zmq-curve-dir or --zmq-hmac-key-file).
EXPOSE 30000
HEALTHCHECK --interval=10s --timeout=3s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import urllib.request as u; u.urlopen('http://127.0.0.1:30000/health', timeout=2)"]
ENTRYPOINT ["python", "-m", "dspark_sglang.launch_server", "--host", "0.0.0.0", "--port", "30000"]
CMD ["--role", "all"]
