# Sourced by the suites CI requires (tests/{vllm,sglang,cluster,systemd}/run.sh); the caller sets REQUIRE_LABEL
# (e.g. tests/vllm) to name itself. A developer's machine may lack an engine or a service, and there the suite
# skips with one line; in CI (CI=true) a missing engine is an install that failed, so it fails, naming the step.

# unavailable STEP WHY: the suite cannot run here. CI=true: exit 1 naming the step; otherwise one SKIP line, exit 0.
unavailable() {
    if [[ ${CI:-} == true ]]; then
        echo "FAIL ${REQUIRE_LABEL:-suite}: $1 failed: $2 (CI=true: a required suite may not skip)" >&2
        exit 1
    fi
    echo "SKIP ${REQUIRE_LABEL:-suite}: $1 failed: $2"
    exit 0
}

# lacking STEP WHY: part of the suite cannot run here (its tests would skip). CI=true: exit 1 naming the step;
# otherwise a note, and the suite goes on.
lacking() {
    if [[ ${CI:-} == true ]]; then
        echo "FAIL ${REQUIRE_LABEL:-suite}: $1 failed: $2 (CI=true: a required suite may not skip)" >&2
        exit 1
    fi
    echo "${REQUIRE_LABEL:-suite}: $1 failed: $2 (the tests that need it will skip)"
}

# required_pytest PYTHON ARGS...: exec pytest; with CI=true every skip is a failure (tests/support/noskip.py).
required_pytest() {
    local py=$1
    shift
    if [[ ${CI:-} == true ]]; then
        PYTHONPATH="$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" exec "$py" -m pytest -p support.noskip "$@"
    fi
    exec "$py" -m pytest "$@"
}

# pip_said LOG: the line of pip's output that says why it failed (its last ERROR line, else its last line).
pip_said() {
    grep '^ERROR' "$1" | tail -n 1 | grep . || tail -n 1 "$1"
}
