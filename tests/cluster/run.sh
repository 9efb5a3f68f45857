#!/usr/bin/env bash
# Cluster-tier tests against a real loopback Mooncake Store (master + holder processes, etcd for HA).
# Installs what they need: Debian libibverbs1 (and etcd-server, optional: without it the HA test skips),
# then kvtier's `cluster` extra into the project's venv. Exits 0 with one SKIP line only where those
# cannot be installed.
#   KVTIER_CLUSTER_PYTHON   the Python to use (default .venv/bin/python, the venv CI builds)
#   extra arguments         passed to pytest
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${KVTIER_CLUSTER_PYTHON:-.venv/bin/python}
[[ -x $PY ]] || { echo "tests/cluster: $PY not found: build the project venv first (python3 -m venv .venv; pip install -e '.[test]')"; exit 1; }

if ! dpkg -s libibverbs1 >/dev/null 2>&1; then
    if ! { apt-get update -q && apt-get install -y -q --no-install-recommends libibverbs1; } >/tmp/kvtier-cluster-apt.log 2>&1; then
        echo "SKIP tests/cluster: Debian libibverbs1 cannot be installed here: $(tail -n 1 /tmp/kvtier-cluster-apt.log)"
        exit 0
    fi
fi
command -v etcd >/dev/null || apt-get install -y -q --no-install-recommends etcd-server >/dev/null 2>&1 \
    || echo "tests/cluster: etcd-server not installable: the HA failover test will skip"

if ! "$PY" -c "import mooncake.store" >/dev/null 2>&1; then
    log=$(mktemp)
    if ! "$PY" -m pip install -q -e ".[cluster]" >"$log" 2>&1; then
        echo "SKIP tests/cluster: kvtier[cluster] (Mooncake) cannot be installed here; pip said: $(tail -n 1 "$log")"
        rm -f "$log"
        exit 0
    fi
    rm -f "$log"
fi

export KVTIER_CLUSTER_REQUIRED=1 MC_TCP_BIND_ADDRESS=127.0.0.1
# One process: each test starts its own loopback cluster on free ports.
exec "$PY" -m pytest -q -n 0 -p no:cacheprovider tests/cluster "$@"
