"""SGLang HiCache host pools as kvtier groups, and the hit rule over them. Plain Python: imports no SGLang.

SGLang names each host pool (`PoolName`: `kv`, `swa`, `deepseek_v4_c4`, `deepseek_v4_c4_indexer_state`, ...)
and gives each transfer a hit policy. kvtier files a pool by what it holds: `ALL_PAGES` pools are history
(`compressed` / `indexer`, needed for every page from the span start), `TRAILING_PAGES` pools are state
(`swa` / `tail`, needed only as the whole trailing window at the hit boundary).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Hashable, Mapping, Sequence

from kvtier.core.errors import KvtierError
from kvtier.core.forms import CacheForm, GroupKind

ANCHOR = "kv"  # SGLang's PoolName.KV: the anchor pool every other pool's pages line up with


class SglangStorageError(KvtierError):
    """The SGLang HiCache backend cannot be set up as configured (store, checkpoint, pool or option)."""

    code = "sglang_storage"


def pool_form(name: str) -> CacheForm:
    """The kvtier form of an SGLang host pool, by what its name says it holds.

    `*_state` pools hold a compressor's (or Mamba's) running state at a page boundary: `tail`; `*swa*`
    pools the sliding window's KV: `swa`; `*indexer*` pools (keys and their scales) what sparse layers
    route over: `indexer`; the anchor and compressed KV pools (`kv`, `*_c4`, `*_c128`, `*_rope`):
    `compressed`.
    """
    if name.endswith("_state") or name == "mamba":
        return CacheForm.TAIL
    if "swa" in name:
        return CacheForm.SWA
    if "indexer" in name:
        return CacheForm.INDEXER
    return CacheForm.COMPRESSED


@dataclasses.dataclass(frozen=True, slots=True)
class PoolPlan:
    """How kvtier files one registered SGLang host pool: object group, form and the page's bytes."""

    name: str
    form: CacheForm
    page_tokens: int
    page_bytes: int  # 0: the pool holds no bytes (DSV4's logical KV anchor); a 1-byte marker is stored
    layout: str  # everything else that fixes how the page's bytes are laid out (pool type, layers, order)

    @property
    def group(self) -> str:
        """The object group name: SGLang's pool names fit kvtier's 32-byte limit; longer ones are digested."""
        if len(self.name.encode()) <= 32:
            return self.name
        return "sgl." + hashlib.blake2b(self.name.encode(), digest_size=14).hexdigest()

    def layout_digest(self, identity: str) -> bytes:
        """16 bytes over the engine identity and this pool's page layout: a different layout is never loaded."""
        text = f"{identity}|{self.name}|{self.form.value}|{self.page_tokens}t|{self.page_bytes}B|{self.layout}"
        return hashlib.blake2b(text.encode(), digest_size=16, person=b"kvtier-sgl-lay1").digest()

    def check_policy(self, history: bool) -> None:
        """A transfer's hit policy must match the pool's form: a pool is never read as another kind."""
        if (self.form.kind is GroupKind.HISTORY) != history:
            policy = "ALL_PAGES" if history else "TRAILING_PAGES"
            raise SglangStorageError(
                f"pool '{self.name}' is kvtier form '{self.form.value}' ({self.form.kind.value}) but SGLang asked "
                f"for it with hit policy {policy}: kvtier serves history pools as ALL_PAGES, state as TRAILING_PAGES"
            )


@dataclasses.dataclass(frozen=True, slots=True)
class PoolQuery:
    """One pool of a `batch_exists_v2` call: its trailing window in pages (0 for a history pool) and presence.

    `present[a]` says whether the page at chain position `a` (prefix pages first, then the span's) is
    stored and loadable for this pool; history pools are only asked about span pages.
    """

    name: Hashable  # SGLang's own pool name object: its answers are keyed by it
    trailing: int
    present: Sequence[bool]


@dataclasses.dataclass(frozen=True, slots=True)
class Hit:
    """What `batch_exists_v2` answers: the usable span pages, each pool's own boundary, the restorable lengths."""

    pages: int
    pool_pages: Mapping[Hashable, int]
    restorable: list[int]


def leading(flags: Sequence[bool]) -> int:
    """Length of the leading run of True."""
    for i, ok in enumerate(flags):
        if not ok:
            return i
    return len(flags)


def hit_pages(prefix: int, kv_present: Sequence[bool], pools: Sequence[PoolQuery], anchor: Hashable = ANCHOR) -> Hit:
    """kvtier's intersection rule over a span of pages that starts `prefix` pages into the token chain.

    A length p (span pages) is restorable when the anchor and every history pool hold span pages
    [0, p), and every state pool holds the whole window of its `trailing` pages before the boundary -
    counted over the chain, so window pages that fall before the span (in SGLang's prefix_keys) must
    be stored too; the window stops only at token 0. The hit is the largest p every pool allows.
    """
    kv_pages = leading(kv_present)
    ok = set(range(1, kv_pages + 1))
    pool_pages: dict[Hashable, int] = {anchor: kv_pages} if kv_pages else {}
    for q in pools:
        if q.trailing == 0:
            boundary = leading(q.present[prefix : prefix + kv_pages])
            allowed = set(range(1, boundary + 1))
        else:
            allowed = {
                p
                for p in range(1, kv_pages + 1)
                if all(q.present[a] for a in range(max(0, prefix + p - q.trailing), prefix + p))
            }
            boundary = max(allowed, default=0)
        if boundary:
            pool_pages[q.name] = boundary
        ok &= allowed
    restorable = sorted(ok)
    return Hit(restorable[-1] if restorable else 0, pool_pages, restorable)
