#!/usr/bin/env bash
# Run here, where pip reaches a package index, before a session on the lent GPU machine (nvidia-h200): downloads
# into .whl/ (ignored by git) the wheels that machine's image lacks or holds at other versions, for its Python
# 3.12, at the versions pinned in requirements/constraints.txt. scripts/device-check.sh installs them there.
# About 8 MiB; `run` carries at most 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
# The image has none of grpcio-health-checking and grpcio-reflection, and its protobuf may be older than the
# runtime our generated stubs need (7.x); grpcio and the rest are pinned so that numbers compare with ours.
packages=(grpcio grpcio-health-checking grpcio-reflection protobuf prometheus_client xxhash)
pins=()
for p in "${packages[@]}"; do
    pin=$(grep -i "^${p}==" requirements/constraints.txt) || { echo "no pin for $p in requirements/constraints.txt" >&2; exit 1; }
    pins+=("$pin")
done
rm -rf .whl
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${pins[@]}"
ls -1 .whl
du -sh .whl
