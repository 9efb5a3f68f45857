#!/usr/bin/env bash
# The package as an operator installs it (issue 41): `python -m build` makes an sdist and, from it, a wheel; the
# wheel (not editable) goes into a fresh venv, used from a folder outside the checkout. There: the package data is
# found (bundled profiles, the store's FORMAT.md), `kvtier demo` runs, and README.md's client snippet runs against
# `kvtier serve` started in an empty folder. .ci/run runs this; it takes a few minutes (torch into two venvs).
#   KVTIER_WHEEL_DIR   where to build and install (default: a temporary folder, removed at the end)
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
if [[ -n ${KVTIER_WHEEL_DIR:-} ]]; then
    WORK=$KVTIER_WHEEL_DIR
    mkdir -p "$WORK"
else
    WORK=$(mktemp -d /tmp/kvtier-wheel-XXXXXX) # short: the daemon's socket path must fit AF_UNIX
fi
serve_pid=
cleanup() {
    [[ -n $serve_pid ]] && kill "$serve_pid" 2>/dev/null && wait "$serve_pid" 2>/dev/null
    [[ -n ${KVTIER_WHEEL_DIR:-} ]] || rm -rf "$WORK"
}
trap cleanup EXIT

echo "wheel: python -m build (sdist, then the wheel from it)"
python3 -m venv "$WORK/build-venv"
"$WORK/build-venv/bin/pip" install -q build
if ! "$WORK/build-venv/bin/python" -m build --outdir "$WORK/dist" . >"$WORK/build.log" 2>&1; then
    tail -n 20 "$WORK/build.log"
    echo "wheel: python -m build failed" >&2
    exit 1
fi
wheel=$(echo "$WORK"/dist/kvtier-*.whl)
sdist=$(echo "$WORK"/dist/kvtier-*.tar.gz)
[[ -f $wheel && -f $sdist ]] || { echo "wheel: no wheel or sdist in $WORK/dist" >&2; exit 1; }

echo "wheel: pip install $(basename "$wheel") into a fresh venv (not editable)"
python3 -m venv "$WORK/venv"
"$WORK/venv/bin/pip" install -q torch==2.13.0 "$wheel"
PY=$WORK/venv/bin/python
mkdir -p "$WORK/run"
cd "$WORK/run" # nothing of the checkout on sys.path from here on
env -u PYTHONPATH "$PY" - <<'PY'
import importlib.resources as res
import kvtier
from kvtier.core.profile import bundled_profile_names, load_profile

assert "site-packages" in kvtier.__file__, f"not the wheel's copy: {kvtier.__file__}"
names = bundled_profile_names()
assert {"ref-tiny", "deepseek-v4-flash"} <= set(names), names
for name in names:
    load_profile(name)
assert (res.files("kvtier.store") / "FORMAT.md").read_text().startswith("#")
print(f"wheel: package data present: profiles {', '.join(sorted(names))}; kvtier/store/FORMAT.md")
PY

echo "wheel: kvtier demo"
env -u PYTHONPATH "$WORK/venv/bin/kvtier" demo --tokens 4096 --checkpoint-every 4 --decode 2

echo "wheel: README.md's client snippet against kvtier serve (user mode, an empty folder)"
"$PY" - "$ROOT/README.md" >"$WORK/run/snippet.py" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
section = text[text.index("An engine links `kvtier.client`"):]
print(re.search(r"```python\n(.*?)```", section, re.S).group(1))
PY
env -u PYTHONPATH -u KVTIER_CONFIG -u KVTIER_SOCKET -u KVTIER_MODE "$WORK/venv/bin/kvtier" serve >"$WORK/run/serve.log" 2>&1 &
serve_pid=$!
for _ in $(seq 1200); do # up to 120 s: the socket appears once the daemon listens
    [[ -S .kvtier/kvtier.sock ]] && break
    kill -0 "$serve_pid" 2>/dev/null || { cat "$WORK/run/serve.log"; echo "wheel: kvtier serve exited" >&2; exit 1; }
    sleep 0.1
done
[[ -S .kvtier/kvtier.sock ]] || { cat "$WORK/run/serve.log"; echo "wheel: no socket after 120 s" >&2; exit 1; }
env -u PYTHONPATH -u KVTIER_SOCKET -u KVTIER_MODE "$PY" snippet.py
kill -TERM "$serve_pid"
wait "$serve_pid"
serve_pid=
echo "wheel: ok ($(basename "$wheel"), $(basename "$sdist"))"
