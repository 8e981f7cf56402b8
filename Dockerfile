# aclnn-serve: build wheels in one stage, run them as a non-root user in a slim one.
# Build: docker build -t aclnn-serve:0.1.0 .
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY proto ./proto
COPY client ./client
COPY server ./server
RUN pip wheel --no-cache-dir --wheel-dir /wheels ".[server]"

FROM python:3.11-slim
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
EXPOSE 50051 50052 9090
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s CMD ["python", "-m", "aclnn_server.healthcheck"]
ENTRYPOINT ["aclnn-serve"]
