#!/usr/bin/env bash
# Cluster-tier tests against a real loopback Mooncake Store (master + holder processes, etcd for HA).
# Installs what they need: kvtier's `cluster` extra into the project's venv, then Debian libibverbs1 (Mooncake
# loads it) and etcd-server (the HA failover test). Where one cannot be installed: a SKIP line and exit 0 (without
# etcd only the HA test skips), or with CI=true a FAIL line naming the step and exit 1 (tests/support/require.sh);
# with CI=true a skipped test fails too.
#   KVTIER_CLUSTER_PYTHON   the Python to use (default .venv/bin/python, the venv CI builds)
#   KVTIER_CLUSTER_PIP      what pip installs for Mooncake (default: -e .[cluster])
#   KVTIER_VLLM_VENV        the vLLM venv the two-node vLLM test runs its engines in (default bench/.venv-vllm;
#                           built by tests/vllm/run.sh --prepare where incomplete)
#   KVTIER_VLLM_PREPARE_PID a background `tests/vllm/run.sh --prepare` (.ci/run starts one): waited for, not raced
#   extra arguments         passed to pytest
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${KVTIER_CLUSTER_PYTHON:-.venv/bin/python}
REQUIRE_LABEL=tests/cluster
# shellcheck source=tests/support/require.sh
. tests/support/require.sh
[[ -x $PY ]] || { echo "tests/cluster: $PY not found: build the project venv first (python3 -m venv .venv; pip install -e '.[test]')"; exit 1; }

# Installed, not imported: `import mooncake.store` also needs libibverbs1, which comes next.
if ! "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('mooncake') is None)" 2>/dev/null; then
    log=$(mktemp)
    # shellcheck disable=SC2086  # KVTIER_CLUSTER_PIP is pip's argument list
    if ! "$PY" -m pip install -q ${KVTIER_CLUSTER_PIP:--e .[cluster]} >"$log" 2>&1; then
        said=$(pip_said "$log")
        rm -f "$log"
        unavailable "pip install ${KVTIER_CLUSTER_PIP:--e .[cluster]} (Mooncake)" "pip said: $said"
    fi
    rm -f "$log"
fi

apt_log=$(mktemp)
if ! dpkg -s libibverbs1 >/dev/null 2>&1; then
    { apt-get update -q && apt-get install -y -q --no-install-recommends libibverbs1; } >"$apt_log" 2>&1 \
        || unavailable "apt-get install libibverbs1" "$(tail -n 1 "$apt_log")"
fi
command -v etcd >/dev/null || apt-get install -y -q --no-install-recommends etcd-server >"$apt_log" 2>&1 \
    || lacking "apt-get install etcd-server (the HA failover test)" "$(tail -n 1 "$apt_log")"
rm -f "$apt_log"

export KVTIER_CLUSTER_REQUIRED=1 MC_TCP_BIND_ADDRESS=127.0.0.1
# One process: each test starts its own loopback cluster on free ports. The vLLM test comes last, once the vLLM
# venv is ready (CI builds it in the background meanwhile).
VLLM_TEST=tests/cluster/test_vllm_two_nodes.py
noskip=()
[[ ${CI:-} == true ]] && noskip=(-p support.noskip)
rc=0
PYTHONPATH="$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m pytest "${noskip[@]}" -q -n 0 -p no:cacheprovider \
    tests/cluster --ignore="$VLLM_TEST" "$@" || rc=$?

# Two nodes under real vLLM engines: the daemons and Mooncake run from $PY, the engines from the vLLM venv (no
# Mooncake there: an engine only talks to its daemon's socket).
VLLM_VENV=${KVTIER_VLLM_VENV:-$PWD/bench/.venv-vllm}
if [[ -n ${KVTIER_VLLM_PREPARE_PID:-} ]]; then
    tail --pid="$KVTIER_VLLM_PREPARE_PID" -f /dev/null # its build, not a second one racing it
fi
prep_log=$(mktemp)
if KVTIER_VLLM_VENV=$VLLM_VENV bash tests/vllm/run.sh --prepare >"$prep_log" 2>&1 \
    && "$VLLM_VENV/bin/python" -c "import vllm" >/dev/null 2>&1 \
    && tests/support/kvtier_into_venv.sh "$VLLM_VENV/bin/python" tests/cluster/run.sh >>"$prep_log" 2>&1; then
    export KVTIER_VLLM_PYTHON=$VLLM_VENV/bin/python KVTIER_CLUSTER_VLLM_REQUIRED=1
else
    # lacking exits 1 with CI=true; elsewhere the test skips with one line
    (lacking "the vLLM venv for $VLLM_TEST (tests/vllm/run.sh --prepare)" "$(tail -n 1 "$prep_log")") || {
        rm -f "$prep_log"
        exit 1
    }
fi
rm -f "$prep_log"
PYTHONPATH="$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m pytest "${noskip[@]}" -q -n 0 -p no:cacheprovider \
    "$VLLM_TEST" "$@" || { r=$?; ((r == 5)) || rc=$r; } # 5: extra arguments deselected it
exit "$rc"
