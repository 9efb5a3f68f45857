"""`kvtier demo`: the daemon story on the embedded default, end to end, with a bitwise check.

A real `kvtier serve` subprocess (its own generated config in a scratch folder, cpu, no root or
GPU needed) serves the reference model. Engine A prefills a long prompt and offloads every object
durably. The daemon is killed with SIGKILL and started again: the pool is cold, the disk store
kept everything. Engine B, whose prompt shares most of A's and then diverges, restores at the
usable hit from that cold pool (lookup + load from disk + rebuild of the model state) and
continues: that whole cost against recomputing the prefix is the headline. Then the daemon is
restarted once more, an operator prewarms A's prompt (loaded from disk into the pool and pinned,
off the request's path) and B restores again: the restore after prewarm, reported on its own.
Both continuations are compared bitwise with an uninterrupted run that recomputes the prefix.
Last, `kvtier audit --deep` checks the store.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import tomli_w
import torch

from kvtier.client import Client
from kvtier.core.errors import KvtierError
from kvtier.core.forms import GroupKind
from kvtier.core.hashing import block_hashes
from kvtier.core.layout import align_up, slot_stride
from kvtier.core.parent import tied_env
from kvtier.core.profile import ModelProfile, bundled_profile_names, load_profile
from kvtier.refmodel.engine import RefEngine, checkpoint_policy
from kvtier.refmodel.model import RefModel
from kvtier.verifier import VerifierSettings, audit_store, open_store

log = logging.getLogger(__name__)

SHARED_FRACTION = 0.7  # request B shares this much of request A's prompt, then diverges
DAEMON_START_S = 60.0


class DemoError(KvtierError):
    """The demo could not run its daemon or its requests; the message names the log to read."""

    code = "demo_failed"


@dataclasses.dataclass(frozen=True, slots=True)
class DemoParams:
    tokens: int = 32768
    decode: int = 16
    checkpoint_every: int = 16  # hash blocks between state checkpoints (the retention interval)
    seed: int = 0
    profile: str = "ref-tiny"
    workdir: Path | None = None  # None: a temporary folder, removed afterwards


@dataclasses.dataclass(frozen=True, slots=True)
class DemoReport:
    profile: str
    namespace: str
    hash_block_tokens: int
    workdir: str
    prompt_tokens: int
    checkpoints: int
    offloaded: dict[str, dict[str, int]]  # per form: objects, bytes
    prefill_s: float
    offload_s: float
    restart_s: float
    records_after_restart: int
    prewarm: dict[str, Any]
    shared_tokens: int
    hash_hit_tokens: int
    request: dict[str, Any]  # RestoreResult.to_dict() of B's cold restore (nothing resident): the headline
    prewarmed_request: dict[str, Any]  # the same request after a restart and a prewarm of A's prompt
    recompute_s: float
    bitwise_match: bool  # both continuations equal the uninterrupted run
    compared_tokens: int
    audit: dict[str, Any]
    total_s: float

    @property
    def hit_tokens(self) -> int:
        return int(self.request["hit_tokens"])

    @property
    def restore_s(self) -> float:
        """Cold: lookup + load from disk + rebuild, all on the request's path."""
        return float(self.request["restore_s"])

    @property
    def prewarmed_restore_s(self) -> float:
        """After the prewarm: most objects already resident (the prewarm's own load is not counted here)."""
        return float(self.prewarmed_request["restore_s"])

    @property
    def bytes_from_disk(self) -> int:
        """What the prewarmed path read: the prewarm's load, and what the request still loaded."""
        return int(self.prewarm["bytes_loaded"]) + int(self.prewarmed_request["bytes_from_disk"])

    @property
    def restore_faster(self) -> bool:
        return self.restore_s < self.recompute_s

    @property
    def ok(self) -> bool:
        return self.bitwise_match and self.restore_faster and self.hit_tokens > 0 and not self.audit["problems"]

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.update(
            hit_tokens=self.hit_tokens,
            restore_s=self.restore_s,
            bytes_from_disk=self.bytes_from_disk,
            speedup=self.recompute_s / max(self.restore_s, 1e-9),
            prewarmed_restore_s=self.prewarmed_restore_s,
            prewarmed_speedup=self.recompute_s / max(self.prewarmed_restore_s, 1e-9),
            restore_faster=self.restore_faster,
            ok=self.ok,
        )
        return out


def pool_budgets(profile: ModelProfile, tokens: int, checkpoint_every: int) -> dict[str, int]:
    """Pool bytes per form for two requests of `tokens` (A's objects and B's resident together), with room to spare."""
    h = profile.hash_block_tokens
    blocks = -(-tokens // h)
    checkpoints = blocks // checkpoint_every + 2
    out: dict[str, int] = {}
    for g in profile.groups:
        slot = slot_stride(g.object_bytes(h))
        slots = blocks if g.kind is GroupKind.HISTORY else g.blocks_needed(h) * checkpoints
        out[g.form.value] = out.get(g.form.value, 0) + 2 * slots * slot
    return {form: align_up(n + (1 << 20), 1 << 20) for form, n in out.items()}


def settle_pages(sock: Path, timeout_s: float = 300.0) -> float:
    """Wait until the daemon on `sock` has tried to move every pool onto huge pages (its stats: no pool still being
    moved), so what a benchmark times next reads into the pools as they will stay; returns the seconds waited.
    DemoError if that takes longer than `timeout_s`."""
    started = time.monotonic()
    with Client(sock) as c:
        while any(p.moving_bytes for prof in c.stats().profiles for p in prof.pools.values()):
            if time.monotonic() - started > timeout_s:
                raise DemoError(f"the daemon's pools were still being moved onto huge pages after {timeout_s} s")
            time.sleep(0.05)  # (polls the daemon's own figure; nothing is assumed done after a delay)
    return time.monotonic() - started


class DemoDaemon:
    """`kvtier serve` as a subprocess on a generated config in `root`; readiness from its sd_notify READY=1."""

    def __init__(self, root: Path, profile: ModelProfile, pools: dict[str, int]) -> None:
        self.root = root
        self.socket = root / "kvtier.sock"
        self.config = root / "kvtier.toml"
        self.log_path = root / "daemon.log"
        self.config.write_text(
            tomli_w.dumps(
                {
                    "device": "cpu",
                    "profiles": [
                        profile.name if profile.name in bundled_profile_names() else str(root / "profile.toml")
                    ],
                    "server": {"socket": str(self.socket), "socket_mode": "0600"},
                    "pool": {
                        "budget_bytes": {
                            form: pools.get(form, 1 << 20) for form in ("compressed", "indexer", "tail", "swa")
                        }
                    },
                    "store": {"root": str(root / "store"), "budget_bytes": "4GiB"},
                    "verifier": {"mode": "supervise"},
                    "metrics": {"address": ""},
                }
            )
        )
        if profile.name not in bundled_profile_names():
            (root / "profile.toml").write_text(profile.to_toml())
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> float:
        """Start the daemon and wait for READY=1; returns the seconds it took."""
        started = time.perf_counter()
        notify_path = self.root / "notify.sock"
        notify_path.unlink(missing_ok=True)
        skip = ("WATCHDOG_USEC", "WATCHDOG_PID", "KVTIER_CONFIG", "KVTIER_SOCKET")
        # a demo killed outright leaves no daemon behind (`kvtier.core.parent`)
        env = tied_env({k: v for k, v in os.environ.items() if k not in skip})
        env["NOTIFY_SOCKET"] = str(notify_path)
        with (
            socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as notify,
            open(self.log_path, "ab") as log_file,
        ):
            notify.bind(str(notify_path))
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvtier.cli", "-v", "serve", "--config", str(self.config)],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                cwd=self.root,
            )
            deadline = time.monotonic() + DAEMON_START_S
            while True:
                remaining = deadline - time.monotonic()
                if self.proc.poll() is not None or remaining <= 0:
                    self.kill()
                    raise DemoError(
                        f"the daemon did not become ready (exit {self.proc.returncode}); "
                        f"see {self.log_path}:\n{self.log_tail()}"
                    )
                notify.settimeout(min(remaining, 0.5))
                try:
                    msg = notify.recv(4096).decode(errors="replace")
                except TimeoutError:
                    continue
                if "READY=1" in msg.split("\n"):
                    return time.perf_counter() - started

    def kill(self) -> None:
        """SIGKILL, as a crash would: nothing is flushed or cleaned up."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM (drain, flush, exit 0); SIGKILL if it does not exit in time."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def run_demo(params: DemoParams, progress: Callable[[str], None] = lambda stage: None) -> DemoReport:
    """The whole story; `progress` hears each stage as it starts. Raises ValueError when the prompt is too
    short for a checkpoint inside the shared part."""
    started = time.perf_counter()
    profile = load_profile(params.profile)
    model = RefModel(profile)
    h = model.hash_block_tokens
    shared = int(params.tokens * SHARED_FRACTION)
    if shared < params.checkpoint_every * h:
        raise ValueError(
            f"request B shares {shared} tokens, less than one checkpoint interval "
            f"({params.checkpoint_every * h} tokens): "
            "use more tokens or a smaller --checkpoint-every"
        )
    rng = np.random.default_rng(params.seed)
    vocab = model.config.vocab_size
    prompt_a = rng.integers(0, vocab, params.tokens)
    prompt_b = np.concatenate((prompt_a[:shared], rng.integers(0, vocab, params.tokens - shared)))

    scratch = params.workdir is None
    root = Path(tempfile.mkdtemp(prefix="kvtier-demo-")) if params.workdir is None else Path(params.workdir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    daemon = DemoDaemon(root, profile, pool_budgets(profile, params.tokens, params.checkpoint_every))
    try:
        progress(f"starting kvtier serve in {root}")
        daemon.start()
        progress(f"engine A: prefilling {params.tokens:,} tokens and offloading every object durably")
        with Client(daemon.socket, name="kvtier demo: engine A") as client:
            client.attach(profile.name)
            engine = RefEngine(client, model, checkpoint_every=params.checkpoint_every)
            offload = engine.prefill_and_offload(prompt_a, durable=True)
        if not offload.persisted or offload.refused:
            raise DemoError(
                f"the daemon refused {offload.refused} objects or did not persist them; see {daemon.log_path}"
            )
        log.info("engine A: %d tokens, %d objects written", offload.tokens, offload.written)

        progress("killing the daemon (SIGKILL) and starting it again: the pool is cold")
        daemon.kill()
        restart_s = daemon.start()
        progress("engine B: cold restore (lookup, load from disk, rebuild) and continue")
        with Client(daemon.socket, name="kvtier demo: engine B") as client:
            client.attach(profile.name)
            records = int(client.stats().store.get("records", 0))
            engine = RefEngine(client, model, checkpoint_every=params.checkpoint_every)
            cold = engine.restore_and_continue(prompt_b, decode=params.decode)
        progress(f"recomputing the {cold.hit_tokens:,}-token prefix without the cache (the oracle and the cost saved)")
        recomputed = engine.recompute(prompt_b, cold.hit_tokens, decode=params.decode)

        progress("restarting the daemon, prewarming A's prompt, then engine B again")
        if daemon.stop() != 0:
            log.warning("the daemon did not exit cleanly; see %s", daemon.log_path)
        daemon.start()
        with Client(daemon.socket, name="kvtier demo: engine B after prewarm") as client:
            client.attach(profile.name)
            pre = client.prewarm(prompt_a, ttl_s=600.0)
            engine = RefEngine(client, model, checkpoint_every=params.checkpoint_every)
            warm = engine.restore_and_continue(prompt_b, decode=params.decode)
        bitwise = all(
            torch.equal(r.logits, recomputed.logits) and r.generated == recomputed.generated for r in (cold, warm)
        )
        log.info(
            "restore cold %.4f s, after prewarm %.4f s, recompute %.4f s; bitwise match: %s",
            cold.restore_s,
            warm.restore_s,
            recomputed.recompute_s,
            bitwise,
        )
        if daemon.stop() != 0:
            log.warning("the daemon did not exit cleanly; see %s", daemon.log_path)
        progress("kvtier audit --deep: re-reading and checksumming every record")
        audit = _audit(root / "store")
    except BaseException:
        daemon.kill()
        raise
    finally:
        if scratch:
            shutil.rmtree(root, ignore_errors=True)

    hashes_a, hashes_b = block_hashes(profile.namespace, prompt_a, h), block_hashes(profile.namespace, prompt_b, h)
    hash_hit = next(
        (i for i, (x, y) in enumerate(zip(hashes_a, hashes_b)) if x != y), min(len(hashes_a), len(hashes_b))
    )
    return DemoReport(
        profile=profile.name,
        namespace=profile.version.namespace_hex,
        hash_block_tokens=h,
        workdir="(temporary, removed)" if scratch else str(root),
        prompt_tokens=params.tokens,
        checkpoints=len(checkpoint_policy(params.tokens, h, params.checkpoint_every)),
        offloaded=offload.objects,
        prefill_s=offload.prefill_s,
        offload_s=offload.offload_s,
        restart_s=restart_s,
        records_after_restart=records,
        prewarm={
            "hit_tokens": pre.hit_tokens,
            "loaded_objects": pre.loaded_objects,
            "bytes_loaded": pre.loaded_bytes,
            "pinned": pre.pinned,
            "seconds": pre.seconds,
        },
        shared_tokens=shared,
        hash_hit_tokens=hash_hit * h,
        request=cold.to_dict(),
        prewarmed_request=warm.to_dict(),
        recompute_s=recomputed.recompute_s,
        bitwise_match=bitwise,
        compared_tokens=int(cold.logits.shape[0]),
        audit=audit,
        total_s=time.perf_counter() - started,
    )


def _audit(store_root: Path) -> dict[str, Any]:
    """`kvtier audit --deep` of the store the run left (every record re-read and checksummed), summed per form."""
    with open_store(store_root, readonly=True) as store:
        report = audit_store(store, VerifierSettings(), deep=True)
    doc = report.to_json()
    forms: dict[str, dict[str, int]] = {}
    for ns in doc["namespaces"]:
        for form, f in ns["forms"].items():
            out = forms.setdefault(form, {"records": 0, "record_bytes": 0, "verified": 0, "corrupt": 0})
            out["records"] += f["entries"]
            out["record_bytes"] += f["bytes"]
            out["verified"] += f["verified"]
            out["corrupt"] += f["corrupt"] + f["quarantined"]
    return {
        "source": "kvtier audit --deep",
        "records": sum(f["records"] for f in forms.values()),
        "record_bytes": doc["used_bytes"],
        "corrupt": doc["corrupt"],
        "quarantined": doc["quarantined"],
        "orphaned_bytes": doc["orphaned_bytes"],
        "reclaimable_bytes": doc["reclaimable_bytes"],
        "problems": report.problems,
        "forms": forms,
    }
