"""The benchmarks' smoke runs: their JSON and the relations their tables print."""
