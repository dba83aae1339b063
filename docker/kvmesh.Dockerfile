# One image for every kvmesh process: the five services, the registration sidecar and the engine
# simulator (`python -m services.<svc>` / `python -m engine_simulator`). Build context: the repo root.
#   docker build -f docker/kvmesh.Dockerfile -t kvmesh/kvmesh:0.1.0 .
# Offline builds (tests/compose): a wheelhouse/ next to the context root is used when present.
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}
COPY docker/requirements.txt wheelhouse* /tmp/deps/
RUN python3 -m venv /opt/venv && if ls /tmp/deps/*.whl >/dev/null 2>&1; then \
      /opt/venv/bin/pip install --no-cache-dir --no-index --find-links /tmp/deps -r /tmp/deps/requirements.txt; \
    else /opt/venv/bin/pip install --no-cache-dir -r /tmp/deps/requirements.txt; fi \
    && OTEL_PROTO=$(/opt/venv/bin/python -c 'import importlib.metadata as m; print(m.version("opentelemetry-proto"))') \
    && if ls /tmp/deps/*.whl >/dev/null 2>&1; then FIND="--no-index --find-links /tmp/deps"; else FIND=""; fi \
    && /opt/venv/bin/pip install --no-cache-dir $FIND --force-reinstall --no-deps "opentelemetry-proto==$OTEL_PROTO" \
    && rm -rf /tmp/deps
# (xds-protos, Envoy's ext_proc protos, ships an old copy of opentelemetry-proto's modules: OTel's own go back.)
ENV PATH=/opt/venv/bin:$PATH PYTHONPATH=/app PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /app
COPY kvmesh /app/kvmesh
COPY services /app/services
COPY engine_simulator /app/engine_simulator
# Readable by the unprivileged user whatever the checkout's modes (generated dirs can be 0700); the
# simulator's tokenizer is built here, once, offline (engines get --tokenizer-path).
RUN chmod -R a+rX /app && python -c "from engine_simulator.tokenizer import ensure_tokenizer; ensure_tokenizer('/opt/kvmesh/tokenizer')" \
    && useradd --system --no-create-home --uid 10001 kvmesh
USER 10001
CMD ["python", "-m", "services.router", "--help"]
