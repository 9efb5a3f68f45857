"""A canary: two live versions of one profile (its own weights digest each) served by one daemon.

Engines attached to `ref-tiny` and to `ref-tiny@canary` run the reference model at their own version; each
gets only its own records (a hit on the other's would give logits that differ from its own model's), bitwise.
`kvtier namespace promote` then makes the canary live: its pools and records stay, the old namespace retires.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from support.daemon import DaemonProc, child_env
from support.e2e_harness import PROFILE, H, Oracle, branch, prompt, run_engine, save_prompts
from support.engine_proc import CHECKPOINT_EVERY

CANARY = "xxh3_128:canary-1"
CP = CHECKPOINT_EVERY * H


def _namespace_cli(d: DaemonProc, *args: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "namespace", *args, "--socket", str(d.socket), "--json"],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _states(doc: dict) -> dict[str, tuple[str, int]]:
    return {n["namespace"]: (n["state"], n["records"]) for n in doc["namespaces"]}


def test_canary_engines_get_only_their_own_records(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    a0, c0 = prompt(1, 12 * H), prompt(2, 12 * H)
    save_prompts(work, {"a0": a0, "c0": c0, "b0": branch(a0, 2 * CP, 3, 50), "d0": branch(c0, 2 * CP, 4, 50)})
    canary_profile = dataclasses.replace(PROFILE, version=PROFILE.version.bumped(weights_digest=CANARY))
    live_ns, canary_ns = PROFILE.version.namespace.hex(), canary_profile.version.namespace.hex()
    d = DaemonProc(tmp_path, extra_toml=f'[canary.ref-tiny]\nweights_digest = "{CANARY}"\n')
    try:
        listed = _states(_namespace_cli(d, "list"))
        assert listed[live_ns][0] == "live" and listed[canary_ns][0] == "canary"

        assert run_engine(d, work, "offload", "a0")["a0"]["persisted"]  # the live version writes a0 only
        wrote = run_engine(d, work, "offload", "a0", "c0", profile="ref-tiny@canary", weights=CANARY)
        assert wrote["a0"]["written"] > 0 and wrote["c0"]["persisted"]  # a0 again: the live one's are not its own

        old_oracle, canary_oracle = Oracle(), Oracle(canary_profile)
        tokens = {n: np.load(work / f"{n}.npy") for n in ("b0", "d0")}
        live = run_engine(d, work, "continue", "b0", "d0")
        assert live["b0"]["hit_tokens"] == 2 * CP and live["d0"]["hit_tokens"] == 0  # c0 is the canary's alone
        for name, rep in live.items():
            old_oracle.check_file(work, name, tokens[name], rep["hit_tokens"])
        canary = run_engine(d, work, "continue", "b0", "d0", profile="ref-tiny@canary", weights=CANARY)
        for name, rep in canary.items():
            assert rep["hit_tokens"] == 2 * CP, name
            canary_oracle.check_file(work, name, tokens[name], rep["hit_tokens"])

        promoted = _namespace_cli(d, "promote", "ref-tiny")
        assert "promoted" in promoted["done"]
        states = _states(promoted)
        assert states[canary_ns][0] == "live" and states[live_ns][0] == "retired"
        # an engine of the promoted version attaching to the plain profile name gets the canary's records
        after = run_engine(d, work, "continue", "d0", weights=CANARY)
        assert after["d0"]["hit_tokens"] == 2 * CP
        canary_oracle.check_file(work, "d0", tokens["d0"], after["d0"]["hit_tokens"])
        refused = subprocess.run(
            [sys.executable, "-m", "kvtier.cli", "namespace", "retire", canary_ns[:12], "--socket", str(d.socket)],
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert refused.returncode == 2 and "live version of ref-tiny" in refused.stderr
        assert "Traceback" not in d.read_log()
    finally:
        d.close()
