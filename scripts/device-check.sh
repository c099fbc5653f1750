#!/usr/bin/env bash
# The checks that need the lent GPU machine, in one call: the transport benchmark on a machine with 16 cores
# (benchmarks/transport.py, whose KV row misses its 0.8x target on 2-core machines), then the triton backend
# checked and timed (benchmarks/gpu.py). Prepare the wheels here first (scripts/device-wheels.sh), then:
#
#     run(command="bash scripts/device-check.sh", carry=[".whl"], timeout_s=420)
#
# transport.py takes under a minute, gpu.py under 5 on an H200; name steps to run only those
# (`bash scripts/device-check.sh gpu`). Results (JSON and logs) land in $OUT (build/device where OUT is
# unset). Each step runs even if one before it failed; the exit status is the worst of them.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-build/device}
site=/tmp/chunkattn-site
mkdir -p "$out"
modules=(grpc grpc_health grpc_reflection google.protobuf prometheus_client xxhash)  # one per carried wheel
wheels=(.whl/*.whl)
if [ "${#wheels[@]}" -ne "${#modules[@]}" ] || [ ! -e "${wheels[0]}" ]; then
    echo "expected ${#modules[@]} wheels in .whl/, found: ${wheels[*]} (run scripts/device-wheels.sh here first," \
        "and carry .whl)" >&2
    exit 1
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "${wheels[@]}" ||
    { echo "cannot install the carried wheels with $(python3 -V 2>&1) (they are built for CPython 3.12)" >&2; exit 1; }
# Ours first, and an image's own 'google' package (a regular one would hide our google.protobuf) still reachable.
echo "__path__ = __import__('pkgutil').extend_path(__path__, __name__)" >"$site/google/__init__.py"
export PYTHONPATH=$site:$PWD/client:$PWD/server PYTHONUNBUFFERED=1
python3 - "$site" "${modules[@]}" <<'PY' || exit 1
import importlib, sys
site, names = sys.argv[1], sys.argv[2:]
bad = [f"{n} from {m.__file__}" for n in names if not (m := importlib.import_module(n)).__file__.startswith(site)]
if bad:
    sys.exit(f"not the carried packages: {', '.join(bad)}")
PY
steps=${*:-transport gpu}
status=0
{ nproc; grep -m1 "model name" /proc/cpuinfo; nvidia-smi -L; python3 -c "import torch, grpc, google.protobuf as p; \
print('torch', torch.__version__, 'grpcio', grpc.__version__, 'protobuf', p.__version__)"; } 2>&1 | tee "$out/machine.txt"
for step in $steps; do
    case $step in
        gpu | transport) python3 "benchmarks/$step.py" --json "$out/$step.json" 2>&1 | tee "$out/$step.log" || status=1 ;;
        *) echo "unknown step $step (gpu, transport)" >&2; status=2 ;;
    esac
done
exit $status
