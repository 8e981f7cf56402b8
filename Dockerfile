# aclnn-serve: build wheels in one stage, run them as a non-root user in a slim one.
# Build: docker build -t aclnn-serve:0.1.0 .
# On Ascend hosts, build both stages on a CANN image (Debian/Ubuntu with Python >= 3.11, CANN's set_env.sh
# variables in its ENV), e.g. docker build --build-arg BASE_IMAGE=quay.io/ascend/cann:<version>-910b-ubuntu22.04-py3.11
# -t aclnn-serve:0.1.0-npu . (see deploy/README.md).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY proto ./proto
COPY common ./common
COPY client ./client
COPY server ./server
RUN pip wheel --no-cache-dir --wheel-dir /wheels ".[server]"

FROM ${BASE_IMAGE}
# OpenMP's runtime: a thread-safe Numba threading layer where the server extra brings no TBB wheel
# (not x86_64); the cpu backend logs the layer it runs on. The base image's release fixes the version.
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends libgomp1 && rm -rf /var/lib/apt/lists/*
RUN useradd --system --uid 10001 --create-home --home-dir /home/aclnn aclnn
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links /wheels "aclnn-serve[server]==0.1.0" && rm -rf /wheels
USER 10001
WORKDIR /home/aclnn
# Listening beyond loopback needs TLS and tokens (ACLNN_TLS_CERT, ACLNN_TLS_KEY, ACLNN_AUTH_TOKEN_FILE)
# or ACLNN_INSECURE=true.
ENV ACLNN_HOST=0.0.0.0 \
    ACLNN_PORT=50051 \
    ACLNN_DATA_PORT=50052 \
    ACLNN_METRICS_PORT=9090 \
    NUMBA_CACHE_DIR=/home/aclnn/.cache/numba \
    PYTHONUNBUFFERED=1
# The cpu backend's kernels, compiled now so that a new container loads them instead (about a
# second, not a minute). Numba keys them by CPU model too: on another one the server compiles
# them at start and says so.
RUN python -c "from aclnn_server.backends.cpu import warm_up; warm_up()"
EXPOSE 50051 50052 9090
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s CMD ["python", "-m", "aclnn_server.healthcheck"]
ENTRYPOINT ["aclnn-serve"]
