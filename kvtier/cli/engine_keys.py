"""`kvtier prewarm` / `kvtier explain` for a manifest line naming an engine namespace (vLLM tier, SGLang backend).

The namespace is picked from those the daemon's store holds: the engine kind (its version key's kernel ABI),
the checkpoint's weights digest (of `model_dir`, computed here as the engine tier computes it), live; where
several are left (two engine configurations over one checkpoint), the line's `namespace` (a hex prefix)
picks one, and a ConfigError lists them otherwise. The keys are then the engine's own (integrations
vllm/keys.py, sglang/keys.py), the layout they depend on read from the namespace's version key.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvtier.cli.engine_hit import EngineHit, GroupUnits, analyse
from kvtier.cli.manifest import EngineSpec, Prompt
from kvtier.core.errors import ConfigError, KvtierError
from kvtier.core.forms import CacheForm, GroupKind, Reason
from kvtier.integrations.checkpoint import weights_digest
from kvtier.integrations.sglang import keys as sgl
from kvtier.integrations.vllm import keys as vl
from kvtier.wire import OperatorConnection
from kvtier.wire import messages as P

UNIT = {"vllm": "chunk", "sglang": "page"}
_ABI = {"vllm": vl.KERNEL_ABI_PREFIX, "sglang": sgl.KERNEL_ABI_PREFIX}


@dataclasses.dataclass(frozen=True, slots=True)
class EngineGroupKeys:
    """One group's kvtier block hashes over the prompt's whole units, and its window (0: history)."""

    name: str
    form: CacheForm
    tokens_per_unit: int
    window_units: int
    hashes: list[bytes]
    layout_digest: bytes  # what the engine's tier stores this group's records with
    payload_bytes: int  # one record's payload


def _describe(ns: P.EngineNamespace) -> str:
    vk = ns.version_key
    return f"{ns.namespace.hex()[:12]} ({vk['model_id']}, {vk['kernel_abi']}, weights {vk['weights_digest'][:20]})"


def pick_namespace(conn: OperatorConnection, spec: EngineSpec, where: str) -> P.EngineNamespace:
    """The live namespace of this engine kind and checkpoint (and `spec.namespace` prefix) the daemon holds."""
    try:
        digest = weights_digest(spec.model_dir)
    except (KvtierError, OSError) as exc:
        raise ConfigError(f"cannot digest the checkpoint: {exc}", key="model_dir", source=where) from None
    every = [n for n in conn.engine_namespaces().namespaces if n.version_key["kernel_abi"].startswith(_ABI[spec.kind])]
    found = [n for n in every if n.live and n.version_key["weights_digest"] == digest]
    if spec.namespace is not None:
        found = [n for n in found if n.namespace.hex().startswith(spec.namespace.lower())]
    if len(found) == 1:
        return found[0]
    if not found:
        held = "; ".join(_describe(n) for n in every) or "none"
        raise ConfigError(
            f"no live {spec.kind} namespace of {spec.model_dir} (weights {digest[:20]})"
            f"{f' starting {spec.namespace}' if spec.namespace else ''}: run the engine with the kvtier tier once "
            f"(it registers its namespace); {spec.kind} namespaces held: {held}",
            key="namespace",
            source=where,
        )
    raise ConfigError(
        f"{len(found)} live {spec.kind} namespaces of this checkpoint: set 'namespace' to one of "
        + "; ".join(_describe(n) for n in found),
        key="namespace",
        source=where,
    )


def _check(what: str, given: int | None, recorded: set[int], where: str) -> None:
    if given is not None and given not in recorded:
        raise ConfigError(
            f"the namespace's engine ran with {what} {', '.join(map(str, sorted(recorded)))}, not {given}: "
            "correct the line, or pick the namespace of the engine that runs with it",
            key=what,
            source=where,
        )


def group_keys(ns: P.EngineNamespace, prompt: Prompt) -> list[EngineGroupKeys]:
    """Per group of the namespace, the engine's keys of the prompt as kvtier files them."""
    spec, where = prompt.engine, prompt.where
    assert spec is not None
    tokens = prompt.tokens.tolist()
    layout_text = ns.version_key["dtype_layout"]
    if spec.kind == "vllm":
        layout = vl.parse_layout(layout_text)
        _check(
            "block_size", spec.block_size, {g.tokens_per_chunk // layout.blocks_per_chunk for g in layout.groups}, where
        )
        _check("chunk_tokens", spec.chunk_tokens, {g.tokens_per_chunk for g in layout.groups}, where)
        try:
            hashes = vl.block_hashes(tokens, layout.tokens_per_hash, spec.hash_algo, spec.hash_seed, spec.cache_salt)
        except ConfigError as exc:
            raise ConfigError(exc.args[0], key=exc.key, source=where) from None
        abi = ns.version_key["kernel_abi"]
        return [
            EngineGroupKeys(
                g.name,
                g.form,
                g.tokens_per_chunk,
                -(-g.window_tokens // g.tokens_per_chunk) if g.window_tokens else 0,
                vl.chunk_hashes(hashes, layout, g),
                vl.layout_digest(abi, layout_text, g),
                layout.chunk_bytes,
            )
            for g in layout.groups
        ]
    page = sgl.page_size_of(layout_text)
    _check("page_size", spec.page_size, {page}, where)
    pages = [sgl.object_hash(k) for k in sgl.page_hashes(tokens, page, spec.extra_key, spec.cache_salt)]
    # SGLang asks a state pool for its trailing window at request time; the namespace does not record it, so a
    # state pool is reported for the page at the boundary (window 1)
    return [
        EngineGroupKeys(
            p.group,
            p.form,
            page,
            0 if p.form.kind is GroupKind.HISTORY else 1,
            pages,
            p.layout_digest(ns.namespace.hex()),
            max(p.page_bytes, 1),  # a pool of no bytes (DSV4's KV anchor) stores a 1-byte marker
        )
        for p in sgl.pool_plans(ns.pools)
    ]


def ask(
    conn: OperatorConnection, ns: P.EngineNamespace, groups: list[EngineGroupKeys], *, prewarm: bool, ttl_s: float
) -> tuple[list[list[Reason]], P.EngineKeysOk]:
    """The daemon's reason per group per unit (and, for a prewarm, what it loaded, pinned and warmed)."""
    req = P.EngineKeys(
        ns.namespace,
        [(g.name, g.form.value, g.layout_digest, g.payload_bytes) for g in groups],
        b"".join(h for g in groups for h in g.hashes),
        bytes(i for i, g in enumerate(groups) for _ in g.hashes),
        prewarm,
        ttl_s,
    )
    rep = conn.engine_keys(req)
    out, at = [], 0
    for g in groups:
        out.append([Reason(c) for c in rep.reasons[at : at + len(g.hashes)]])
        at += len(g.hashes)
    return out, rep


def engine_hit(prompt: Prompt, groups: list[EngineGroupKeys], reasons: list[list[Reason]]) -> EngineHit:
    units = [GroupUnits(g.name, g.form.value, g.tokens_per_unit, g.window_units, r) for g, r in zip(groups, reasons)]
    return analyse(int(prompt.tokens.size), units)


def prewarm_report(conn: OperatorConnection, prompt: Prompt) -> dict[str, Any]:
    """Prewarm one engine line: what the engine can restore per group, what was loaded, pinned and warmed."""
    assert prompt.engine is not None
    ns = pick_namespace(conn, prompt.engine, prompt.where)
    groups = group_keys(ns, prompt)
    reasons, rep = ask(conn, ns, groups, prewarm=True, ttl_s=prompt.ttl_s)
    hit = engine_hit(prompt, groups, reasons)
    return {
        "name": prompt.name,
        "engine": prompt.engine.kind,
        "namespace": ns.namespace.hex(),
        "tokens": int(prompt.tokens.size),
        "hit_tokens": hit.hit_tokens,
        "groups": [dataclasses.asdict(g) for g in hit.groups],
        "loaded_objects": rep.loaded,
        "bytes_loaded": rep.loaded_bytes,
        "pinned": rep.pinned,
        "warmed_bytes": rep.warmed_bytes,
        "ttl_s": prompt.ttl_s,
        "seconds": round(rep.seconds, 6),
    }
