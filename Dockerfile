# chunkattn server image (CPU). The GPU image and the compose/Envoy deployment come with their own issue.
# Not built in CI (CI machines have no Docker engine); build with: docker build -t chunkattn .
FROM python:3.11-slim

WORKDIR /app
COPY requirements/ requirements/
COPY client/ client/
COPY server/ server/
COPY README.md README.md

# torch's CPU wheels live on PyTorch's own index; `torch==2.13.0` in the constraints matches 2.13.0+cpu.
RUN pip install --no-cache-dir --extra-index-url https://download.pytorch.org/whl/cpu \
        -c requirements/constraints.txt ./client ./server \
    && useradd --create-home chunkattn
USER chunkattn

EXPOSE 50051 9400
ENTRYPOINT ["chunkattn-server"]
CMD ["--host", "0.0.0.0"]
