#!/usr/bin/env bash
# SGLang HiCache backend tests in their own venv: SGLang 0.5.23 (--no-deps) + the few packages its
# hicache_storage and storage-factory imports need + CPU torch + kvtier (editable, --no-deps). SGLang is
# never a kvtier dependency and never enters the project's .venv.
# Where SGLang cannot be installed: a SKIP line and exit 0, or with CI=true a FAIL line naming the step and exit 1
# (tests/support/require.sh); with CI=true a skipped test fails too.
#   KVTIER_SGLANG_VENV   venv folder (default bench/.venv-sglang; reused when complete)
#   KVTIER_SGLANG_SPEC   the SGLang requirement (default sglang==0.5.23)
#   --prepare            only build the venv (CI may do this in the background)
#   extra arguments      passed to pytest
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
SGLANG_SPEC=${KVTIER_SGLANG_SPEC:-sglang==0.5.23}
TORCH_SPEC="torch==2.13.0"  # the CPU wheel on these hosts; installed first so nothing pulls a CUDA torch
# What `import sglang.srt.mem_cache.hicache_storage` and its storage factory import (found by trying).
SGLANG_IMPORTS=(triton orjson IPython transformers pybase64 requests pillow starlette msgspec pyzmq aiohttp)
VENV=${KVTIER_SGLANG_VENV:-$ROOT/bench/.venv-sglang}
STAMP="$VENV/.kvtier-sglang-ready"
PY="$VENV/bin/python"
WANT="$SGLANG_SPEC $TORCH_SPEC ${SGLANG_IMPORTS[*]}"

QUIET_LABEL=tests/sglang
REQUIRE_LABEL=tests/sglang
# shellcheck source=tests/support/quiet.sh
. tests/support/quiet.sh
# shellcheck source=tests/support/require.sh
. tests/support/require.sh

# install STEP ARGS...: pip install into the venv, or stop the suite naming the step (require.sh's unavailable).
install() {
    local step=$1 log
    shift
    log=$(mktemp)
    if ! "$PY" -m pip install -q "$@" >"$log" 2>&1; then
        local said
        said=$(pip_said "$log")
        rm -f "$log"
        unavailable "$step" "pip said: $said"
    fi
    rm -f "$log"
}

probe() {
    "$PY" -c "import sglang.srt.mem_cache.hicache_storage, sglang.srt.mem_cache.storage.backend_factory"
}

if ! [[ -x $PY && -f $STAMP && $(cat "$STAMP") == "$WANT" ]] || ! probe >/dev/null 2>&1; then
    echo "tests/sglang: building $VENV ($WANT)"
    rm -rf "$VENV"
    python3 -m venv "$VENV"
    # SGLang first: --no-deps, so the order changes nothing, and a spec that cannot be had is found in seconds
    install "pip install $SGLANG_SPEC" --no-deps "$SGLANG_SPEC"
    install "pip install $TORCH_SPEC" "$TORCH_SPEC"
    install "pip install SGLang's imports" "${SGLANG_IMPORTS[@]}"
    probe # a broken install fails here, loudly
    echo "$WANT" >"$STAMP"
fi

# What resolving a launch (ServerArgs -> ModelConfig, the backend's identity) imports beyond the storage
# classes, at SGLang's pins; added to the venv when missing, without rebuilding it.
RESOLUTION_IMPORTS=(dill loguru pydantic apache-tvm-ffi==0.1.11 sentencepiece==0.2.1 compressed-tensors==0.18.0 gguf einops psutil
    setproctitle partial_json_parser interegular easydict regex)
if ! "$PY" -c "import dill, loguru, pydantic, tvm_ffi, sentencepiece, compressed_tensors, gguf, einops, psutil, setproctitle, \
partial_json_parser, interegular, easydict, regex" >/dev/null 2>&1; then
    quiet "$PY" -m pip install -q "${RESOLUTION_IMPORTS[@]}" "$TORCH_SPEC"
fi

[[ ${1:-} == --prepare ]] && { echo "tests/sglang: $VENV has $SGLANG_SPEC"; exit 0; }

# kvtier itself, editable and --no-deps, with its own deps and test extra (torch stays as installed above).
quiet tests/support/kvtier_into_venv.sh "$PY" tests/sglang/run.sh

export KVTIER_SGLANG_REQUIRED=1
required_pytest "$PY" -q -p no:cacheprovider -n 0 tests/sglang "$@"
