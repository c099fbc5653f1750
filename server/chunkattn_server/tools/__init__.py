"""Tools around the server that are not the server: `python -m chunkattn_server.tools.cluster` runs
replicas behind Envoy on one machine (make cluster, cluster.py) and prints deploy/envoy/envoy.yaml; envoy.py
is Envoy's configuration, probe.py what Envoy and the replicas report, replica_flags.py the replicas' flags
that Envoy's limits follow, blockyaml.py the YAML writer."""
