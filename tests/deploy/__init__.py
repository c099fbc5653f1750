"""Deployment and docs: Envoy, the compose stack, the docs' examples."""
