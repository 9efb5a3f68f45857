#!/usr/bin/env bash
# Every GPU check of kvtier in one command, for a CUDA host where kvtier's dependencies and KvikIO import
# (`pip install -e '.[gpu]'`, or the same wheels put on PYTHONPATH): what the host has, the CUDA-graph-over-pools
# check (bench/gpu_checks.py) and the GDS restore benchmark (bench/gds_restore.py). Each writes its JSON and its
# stderr into the folder given (default ./gpu-results); the exit status is the number of checks that failed.
#
#     bash bench/gpu_run.sh [RESULTS_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-results}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
failed=0

python3 - >"$out/host.json" 2>"$out/host.err" <<'EOF' || failed=$((failed + 1))
import json
import torch
from kvtier.store.io import cuda_driver_present
info = {"torch": torch.__version__, "cuda": torch.cuda.is_available(), "cuda_driver": cuda_driver_present()}
if info["cuda"]:
    info["gpu"] = torch.cuda.get_device_name()
try:
    import kvikio, kvikio.defaults
    info["kvikio"] = kvikio.__version__
    info["kvikio_compat_mode"] = str(kvikio.defaults.compat_mode())
except Exception as exc:  # reported, not fatal: the store then takes the O_DIRECT path
    info["kvikio"] = f"not importable: {exc!r}"
print(json.dumps(info))
EOF

for check in gpu_checks gds_restore; do
    python3 "bench/$check.py" >"$out/$check.json" 2>"$out/$check.err" || failed=$((failed + 1))
done
cat "$out"/*.json
exit "$failed"
