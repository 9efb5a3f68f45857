"""Shared by the vLLM tests: checkpoints, prompts with shared prefixes, and engines run in fresh processes."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.store import DiskStore, RecordState
from support.corrupt import flip_payload_bit
from support.vllm_engine_run import BLOCK_SIZE
from support.vllm_engine_run import main as engine_main
from support.vllm_tiny_model import VOCAB, write_checkpoint
from support.warm_start import forkserver

HERE = Path(__file__).resolve().parent
ENGINE_TIMEOUT_S = 240
REQUIRED_ENV = "KVTIER_VLLM_REQUIRED"  # set by run.sh: there a missing or broken vLLM fails, never skips


def require_vllm() -> None:
    """Skip the calling test module unless a real vLLM (with the tiering API) imports.

    Not `importorskip("vllm")`: with `tests/` on sys.path, this very folder imports as a namespace package
    named `vllm` where vLLM is absent.
    """
    if os.environ.get(REQUIRED_ENV) == "1":
        import vllm.v1.kv_offload.tiering.base  # noqa: F401

        return
    pytest.importorskip(
        "vllm.v1.kv_offload.tiering.base", reason="vLLM is not installed here: run tests/vllm/run.sh (its own venv)"
    )


@dataclasses.dataclass(frozen=True, slots=True)
class EngineRun:
    """What one engine process produced: per prompt the generated tokens and their logprobs; tier counters."""

    results: list[dict]
    metrics: dict[str, float]

    def counter(self, name: str, tier: str) -> float:
        """Sum of `tiering_<name>` over labels naming `tier` (vLLM labels tiers "<index>:<type>")."""
        return sum(v for k, v in self.metrics.items() if k.startswith(f"tiering_{name}{{") and k.endswith(f":{tier}}}"))

    def kvtier(self, name: str, **labels: str) -> float:
        """Sum of the kvtier tier's `kvtier_<name>` over label sets that include all of `labels`."""
        want = {f"{k}={v}" for k, v in labels.items()}
        total = 0.0
        for key, value in self.metrics.items():
            metric, _, rest = key.partition("{")
            if metric == f"kvtier_{name}" and want <= set(filter(None, rest.rstrip("}").split(","))):
                total += value
        return total


def shared_prefix_prompts(seed: int, prefix_blocks: int = 4, n: int = 3, suffix: int = 20) -> list[list[int]]:
    """`n` prompts sharing `prefix_blocks` whole blocks, each with its own partial-block suffix."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, VOCAB) for _ in range(prefix_blocks * BLOCK_SIZE)]
    return [prefix + [rng.randrange(3, VOCAB) for _ in range(suffix)] for _ in range(n)]


def new_checkpoint(path: Path, seed: int, arch: str = "llama") -> str:
    return str(write_checkpoint(path, seed, arch))


# The engines' environment, set before any process forks from the worker's forkserver: the server's env is every
# engine's (as it is each daemon's before that daemon sets its own).
os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_TARGET_DEVICE="cpu")
# Engines start from the worker's fork server (support.warm_start, which the daemons share), which imports vLLM once:
# each engine still runs in a new process of its own (forked from a server that holds imported modules only, never an
# engine or a tier), without paying vLLM's import every time.
_ENGINES = forkserver("support.vllm_engine_run", "vllm", "vllm.inputs", "kvtier.integrations.vllm")


def _engine_process(spec: str, out: str, log: str) -> None:
    """The body of one engine process: everything it prints goes to its log."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    engine_main(spec, out)


def run_engine(
    work: Path,
    name: str,
    model: str,
    prompts: list[list[int]],
    tiers: list[dict],
    max_tokens: int = 8,
    engine_args: dict | None = None,
    shutdown: bool = False,
) -> EngineRun:
    """Start a new process with one engine, generate greedily, and return what it wrote; its log is kept in `work`.

    `engine_args`: launch-time settings (LLM keyword arguments, as `vllm serve` flags set them) over the tests' own;
    `shutdown`: shut the engine down at the end, so every chunk it offloaded reaches the secondary tiers."""
    spec, out, log = work / f"{name}.spec.json", work / f"{name}.out.json", work / f"{name}.log"
    doc = {"model": model, "prompts": prompts, "max_tokens": max_tokens, "secondary_tiers": tiers}
    spec.write_text(json.dumps({**doc, "engine_args": engine_args or {}, "shutdown": shutdown}))
    proc = _ENGINES.Process(target=_engine_process, args=(str(spec), str(out), str(log)), name=f"engine-{name}")
    proc.start()
    proc.join(ENGINE_TIMEOUT_S)
    if proc.exitcode is None:
        proc.kill()
        proc.join()
    if proc.exitcode != 0:
        tail = log.read_text(errors="replace")[-4000:] if log.exists() else "(no log)"
        raise AssertionError(
            f"engine {name} exited {proc.exitcode} (None: killed after {ENGINE_TIMEOUT_S} s); log tail:\n{tail}"
        )
    data = json.loads(out.read_text())
    return EngineRun(results=data["results"], metrics=data["metrics"])


def assert_same_output(expected: EngineRun, got: EngineRun) -> None:
    """Identical generated tokens and bit-identical logprobs, prompt by prompt."""
    assert len(expected.results) == len(got.results)
    for i, (a, b) in enumerate(zip(expected.results, got.results)):
        assert a["tokens"] == b["tokens"], f"prompt {i}: tokens differ: {a['tokens']} vs {b['tokens']}"
        assert a["logprobs"] == b["logprobs"], f"prompt {i}: logprobs differ: {a['logprobs']} vs {b['logprobs']}"


KVTIER_TIER = "KvtierSecondaryTier"


def kvtier_tiers(store_dir: Path) -> list[dict]:
    """The secondary-tier config that puts kvtier under vLLM's CPU tier (as docs/vllm.md shows it)."""
    return [{"type": KVTIER_TIER, "module_path": "kvtier.integrations.vllm", "store_dir": str(store_dir)}]


def kvtier_daemon_tiers(socket_path: Path) -> list[dict]:
    """The same tier, through a running kvtier daemon that owns the store (as docs/vllm.md shows it)."""
    return [{"type": KVTIER_TIER, "module_path": "kvtier.integrations.vllm", "daemon_socket": str(socket_path)}]


def kvtier_audit(store_dir: Path) -> tuple[int, dict]:
    """`kvtier audit --store DIR --json --deep` in a process of its own: (exit code, report); 0 means clean."""
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "audit", "--store", str(store_dir), "--json", "--deep"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if proc.returncode not in (0, 1):
        raise AssertionError(f"kvtier audit exited {proc.returncode}: {proc.stderr[-2000:]}")
    return proc.returncode, json.loads(proc.stdout)


@contextlib.contextmanager
def _reading(store_dir: Path, store: DiskStore | None) -> Iterator[DiskStore]:
    """`store` if the caller has it open (LMDB allows one environment per process), else a read-only open."""
    if store is not None:
        yield store
        return
    with DiskStore(str(store_dir), readonly=True) as opened:
        yield opened


def audit_namespaces(store_dir: Path, store: DiskStore | None = None) -> dict[str, dict]:
    """Per namespace (hex): its version key and its records {group, form, state}, from the store's own listing."""
    with _reading(store_dir, store) as s:
        out = {
            ns.hex(): {"version_key": entry.version_key.to_dict(), "live": entry.live, "records": []}
            for ns, entry in s.namespaces().items()
        }
        after = None
        while batch := s.iter_records(after=after):
            for info in batch:
                state = "corrupt_index" if info.entry is None else info.entry.state.name.lower()
                out[info.key.namespace.hex()]["records"].append(
                    {"group": info.key.group, "form": info.key.form.value, "state": state}
                )
            after = batch[-1].key
    return out


def flip_payload_byte(store_dir: Path, group: str, nth: int, store: DiskStore | None = None) -> None:
    """Flip one payload bit of the `nth` live record (in key order) of `group`, in its segment file on disk."""
    with _reading(store_dir, store) as s:
        infos = [i for i in s.iter_records(limit=10_000) if i.key.group == group and i.entry.state is RecordState.LIVE]
    entry = infos[nth].entry
    flip_payload_bit(store_dir, entry, entry.payload_len // 2, 4)
