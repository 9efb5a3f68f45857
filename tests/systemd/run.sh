#!/usr/bin/env bash
# docs/systemd.md's install block, run as written in a throwaway root (tests/systemd/test_recipe.py).
# Needs root, unshare and systemd-analyze; it installs torch into a venv under a temporary folder (1-2 minutes).
# Where those are missing: a SKIP line and exit 0, or with CI=true a FAIL line naming what is missing and exit 1
# (tests/support/require.sh); with CI=true a skipped test fails too.
#   KVTIER_SYSTEMD_PYTHON   the Python to use (default: python on PATH, CI's .venv)
set -euo pipefail
cd "$(dirname "$0")/../.."
REQUIRE_LABEL=tests/systemd
# shellcheck source=tests/support/require.sh
. tests/support/require.sh
PY=${KVTIER_SYSTEMD_PYTHON:-python}
((EUID == 0)) || unavailable "running as root" "the recipe adds a user and mounts overlays: run as root"
for tool in unshare systemd-analyze; do
    command -v "$tool" >/dev/null || unavailable "finding $tool" "not installed (apt-get install util-linux systemd)"
done
export KVTIER_RECIPE_TEST=1
required_pytest "$PY" -q -p no:cacheprovider -n 0 tests/systemd "$@"
