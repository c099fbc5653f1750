# chunkattn server image. One file, two builds:
#   CPU (default):  docker build -t chunkattn .
#   CUDA:           docker build -t chunkattn:cuda --build-arg TORCH_INDEX= .   (PyPI's default torch is the CUDA
#                   build; run with the NVIDIA container toolkit: docker run --gpus all ... --device cuda)
# BASE: any image with Python 3.11+ and its venv module (CI builds from a local debootstrap of Debian bookworm).
# TORCH_INDEX: an extra index for torch (PyTorch's CPU wheels by default; empty: PyPI only).
# TORCH_FIND_LINKS: a folder or URL of wheels to prefer (CI serves the host's CPU torch wheel on loopback).
ARG BASE=python:3.11-slim

FROM ${BASE} AS build
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_FIND_LINKS=
WORKDIR /src
RUN test -x /opt/venv/bin/python || python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY requirements/constraints.txt requirements/constraints.txt
COPY client/ client/
COPY server/ server/
# torch is pinned in the constraints (2.13.0 also matches 2.13.0+cpu). pip leaves with the build: the image
# keeps only what runs.
RUN pip install --no-cache-dir --disable-pip-version-check \
        ${TORCH_INDEX:+--extra-index-url $TORCH_INDEX} ${TORCH_FIND_LINKS:+--find-links $TORCH_FIND_LINKS} \
        -c requirements/constraints.txt ./client ./server \
    && pip uninstall -y -q pip \
    && find /opt/venv -name __pycache__ -prune -exec rm -rf {} +

FROM ${BASE}
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 HOME=/home/chunkattn
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
