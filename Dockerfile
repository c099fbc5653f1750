# chunkattn server image. One file, two builds:
#   CPU (default):  docker build -t chunkattn .
#   CUDA:           docker build -t chunkattn:cuda --build-arg TORCH_INDEX= .   (PyPI's default torch is the CUDA
#                   build; run with the NVIDIA container toolkit: docker run --gpus all ... --device cuda)
# Two stages: the builder installs the packages and, with Debian's g++ and ninja, builds the native CPU kernels
# once per ISA into /opt/chunkattn-native; the image gets the venv and that folder (CHUNKATTN_NATIVE_DIR), and
# no compiler, ninja or pip. triton comes only with the CUDA build's torch: the CPU image has none.
# BASE: any image with Python 3.11+, its venv module and apt-get (Debian or Ubuntu; CI builds from a local
# debootstrap of Debian bookworm).
# TORCH_INDEX: an extra index for torch (PyTorch's CPU wheels by default; empty: PyPI only).
# TORCH_FIND_LINKS: a folder or URL of wheels to prefer (CI serves the host's CPU torch wheel on loopback).
ARG BASE=python:3.11-slim

FROM ${BASE} AS build
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_FIND_LINKS=
WORKDIR /src
# The kernels' compiler, in this stage only: g++ and ninja, and Python's headers where the base has none
# (Debian's python3 does not; python:3.11-slim has its own). apt-get reaches Debian's mirror from the build.
RUN headers=$(python3 -c 'import os, sysconfig as s; print(os.path.exists(s.get_path("include") + "/Python.h"))') \
    && apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends g++ ninja-build \
        $([ "$headers" = True ] || echo python3-dev) \
    && rm -rf /var/lib/apt/lists/*
RUN test -x /opt/venv/bin/python || python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY requirements/constraints.txt requirements/constraints.txt
COPY client/ client/
COPY server/ server/
# torch is pinned in the constraints (2.13.0 also matches 2.13.0+cpu); the CUDA build's torch requires triton
# and brings it, the CPU build's does not (and the server does not ask for it).
RUN pip install --no-cache-dir --disable-pip-version-check \
        ${TORCH_INDEX:+--extra-index-url $TORCH_INDEX} ${TORCH_FIND_LINKS:+--find-links $TORCH_FIND_LINKS} \
        -c requirements/constraints.txt ./client ./server
# The native kernels for every ISA the builder's CPU runs (AMX too where it has the tiles; AVX512, AVX2, DEFAULT on an AVX512 builder), one
# shared object each: the server loads the widest its CPU runs from CHUNKATTN_NATIVE_DIR and never compiles. pip leaves with the build: the image keeps only what runs.
RUN python -m chunkattn_server.attention.backends.native.build --out /opt/chunkattn-native \
    && pip uninstall -y -q pip \
    && find /opt/venv -name __pycache__ -prune -exec rm -rf {} +

FROM ${BASE}
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/chunkattn-native /opt/chunkattn-native
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 HOME=/home/chunkattn CHUNKATTN_NATIVE_DIR=/opt/chunkattn-native
# A user of its own (written directly: minimal bases have no useradd).
RUN echo 'chunkattn:x:10001:10001::/home/chunkattn:/usr/sbin/nologin' >> /etc/passwd \
    && echo 'chunkattn:x:10001:' >> /etc/group \
    && mkdir -p /home/chunkattn && chown 10001:10001 /home/chunkattn
USER 10001:10001
EXPOSE 50051 9400
# gRPC health on the default port (CHUNKATTN_TARGET overrides it; a TLS server needs its own check).
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 CMD ["chunkattn", "health", "--timeout", "4"]
# Exec form: the server is PID 1 and gets SIGTERM itself (it drains, then exits 0).
ENTRYPOINT ["chunkattn-server"]
CMD ["--host", "0.0.0.0"]
