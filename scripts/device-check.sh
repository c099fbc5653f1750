#!/usr/bin/env bash
# The checks that need the lent GPU machine, in one call: the triton backend checked then timed
# (benchmarks/gpu.py), and the transport benchmark on a machine with 16 cores (benchmarks/transport.py, whose KV
# row misses its 0.8x target on 2-core machines). Prepare the wheels here first (scripts/device-wheels.sh), then:
#
#     run(command="bash scripts/device-check.sh", carry=[".whl"], timeout_s=420)
#
# gpu.py takes under 5 minutes on an H200, transport.py under one; name steps to run only those
# (`bash scripts/device-check.sh transport`). Results (JSON and logs) land in $OUT (build/device where OUT is
# unset). Each step runs even if one before it failed; the exit status is the worst of them.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-build/device}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/chunkattn-site \
    .whl/*.whl || { echo "cannot install the carried wheels (run scripts/device-wheels.sh here first)" >&2; exit 1; }
export PYTHONPATH=/tmp/chunkattn-site:$PWD/client:$PWD/server PYTHONUNBUFFERED=1
steps=${*:-gpu transport}
status=0
{ nproc; grep -m1 "model name" /proc/cpuinfo; nvidia-smi -L; python3 -c "import torch, grpc; print(torch.__version__, grpc.__version__)"; } \
    2>&1 | tee "$out/machine.txt"
for step in $steps; do
    case $step in
        gpu | transport) python3 "benchmarks/$step.py" --json "$out/$step.json" 2>&1 | tee "$out/$step.log" || status=1 ;;
        *) echo "unknown step $step (gpu, transport)" >&2; status=2 ;;
    esac
done
exit $status
