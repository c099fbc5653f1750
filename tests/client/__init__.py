"""The thin client, its CLI and bench, the wire codecs, transformers offload."""
