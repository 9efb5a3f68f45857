#!/usr/bin/env bash
# Install this checkout's kvtier into an engine's venv: editable and --no-deps (pip never moves the engine's
# pins), then kvtier's own dependencies and test extra read from pyproject.toml, torch left as the engine has it.
# Redone only when pyproject.toml or the calling script changes.
#   kvtier_into_venv.sh PYTHON CALLER_SCRIPT [EXTRA_PACKAGES...]      (run from the repository root)
set -euo pipefail
PY=$1 CALLER=$2
shift 2
STAMP="$(dirname "$(dirname "$PY")")/.kvtier-editable"
want="$PWD $(sha256sum pyproject.toml "$CALLER" | sha256sum | cut -c1-64)"
[[ -f $STAMP && $(cat "$STAMP") == "$want" ]] && exit 0
mapfile -t deps < <("$PY" - <<'PY'
import re, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
deps = project["dependencies"] + project["optional-dependencies"]["test"]
print("\n".join(d for d in deps if re.split(r"[<>=!~ \[]", d, maxsplit=1)[0].lower() != "torch"))
PY
)
"$PY" -m pip install -q --no-deps -e . >/dev/null
"$PY" -m pip install -q "${deps[@]}" "$@" >/dev/null
echo "$want" >"$STAMP"
