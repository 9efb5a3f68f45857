# quiet CMD...: run a command, showing its output only when it fails (sourced by the engine suites' run.sh).
# The caller sets QUIET_LABEL (e.g. tests/vllm) to name itself in the failure line.
quiet() {
    local log rc=0
    log=$(mktemp)
    "$@" >"$log" 2>&1 || rc=$?
    ((rc == 0)) || { cat "$log"; echo "${QUIET_LABEL:-quiet}: failed ($rc): $*"; }
    rm -f "$log"
    return $rc
}
