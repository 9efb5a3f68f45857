"""The fault matrix's shared mechanics: engine A's prompts and B's (A's and 40 tokens more), A's durable
offload and B's restore through real RefEngines, the bitwise check against a recompute, and the row
each case files (tests/e2e/test_fault_matrix*.py)."""

from __future__ import annotations

import numpy as np

from kvtier.client import Client
from kvtier.core.profile import ModelProfile
from kvtier.refmodel import RefModel
from kvtier.refmodel.engine import RefEngine, RestoreResult
from support.daemon import DaemonProc
from support.e2e_harness import PROFILE, H, Oracle, prompt
from support.engine_proc import CHECKPOINT_EVERY
from support.fault_table import FaultRows

BLOCKS = 12  # A's prompts: 384 tokens, checkpoints after blocks 4, 8 and 12
EXTRA = 40  # B asks for A's prompt and 40 tokens more
CP = CHECKPOINT_EVERY


def a_prompt(seed: int) -> np.ndarray:
    return prompt(seed, BLOCKS * H)


def b_prompt(seed: int) -> np.ndarray:
    return np.concatenate((a_prompt(seed), prompt(seed + 1000, EXTRA)))


def serve(d: DaemonProc, tokens: np.ndarray, profile: ModelProfile = PROFILE) -> RestoreResult:
    with Client(d.socket, name="engine B") as client:
        client.attach(profile.name)
        return RefEngine(client, RefModel(profile), checkpoint_every=CP).restore_and_continue(tokens)


def offload(d: DaemonProc, *seeds: int) -> None:
    with Client(d.socket, name="engine A") as client:
        client.attach(PROFILE.name)
        engine = RefEngine(client, RefModel(PROFILE), checkpoint_every=CP)
        for seed in seeds:
            assert engine.prefill_and_offload(a_prompt(seed), durable=True).persisted


def bitwise(res: RestoreResult, tokens: np.ndarray, oracle: Oracle) -> str:
    assert oracle.matches(res.logits, tokens, res.hit_tokens), (
        "the continuation differs from recomputing: a wrong logit"
    )
    again = " (found by a 2nd lookup)" if res.lookups > 1 else ""
    if res.hit_tokens:
        return f"bitwise reuse of {res.hit_tokens} tokens{again}"
    return "full recompute, bitwise"


def file_row(table: FaultRows, case: str, res: RestoreResult, group: str, block: int, outcome: str) -> None:
    """The row: what (group, block) ended as in B's final check vector, and how B was served."""
    cv = res.final_cv
    table.append((case, cv.route(group, block).name, cv.reason(group, block).label, outcome))
