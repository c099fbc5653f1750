"""Tools around the server that are not the server: `python -m chunkattn_server.tools.cluster` runs
replicas behind Envoy on one machine (make cluster) and generates deploy/envoy/envoy.yaml."""
