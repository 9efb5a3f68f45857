#!/usr/bin/env bash
# docs/systemd.md's install block, run as written in a throwaway root (tests/systemd/test_recipe.py).
# Needs root, unshare and systemd-analyze; it installs torch into a venv under a temporary folder (1-2 minutes).
set -euo pipefail
cd "$(dirname "$0")/../.."
KVTIER_RECIPE_TEST=1 exec python -m pytest -q -p no:cacheprovider -n 0 tests/systemd "$@"
