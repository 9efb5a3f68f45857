"""The wire protocol's messages: one tagged msgpack struct per request and reply (frames: `kvtier.wire.framing`).

Requests and replies are tagged unions keyed by `op`. Per connection the order is: optional `hello`
(first only), `attach` (once), then any of the rest; `stats`, `flush` and the namespace ops need no attach.
Payload bytes never travel here: pools are mapped by the client at attach (file descriptors ride along as SCM_RIGHTS
with the attach reply on cpu; CUDA IPC handles on cuda), and requests only name slots.

The raw tier ops serve the daemon's store to a client that brings its own keys and namespace (an
engine's own offloading, e.g. vLLM): `tier_open` (once per connection, no attach needed) registers the
namespace and maps the client's staging memfd, which rides along with the request as SCM_RIGHTS; then
`tier_has`, `tier_store` and `tier_load` name objects by (block hash, group index) and bytes by offset
in that staging region.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvtier.core.not_durable import NotDurableCount
from kvtier.wire.errors import ProtocolError, UnknownOp, WrongType
from kvtier.wire.stats import NamespaceStats, StatsDoc


class Msg(msgspec.Struct, tag_field="op", forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    """Base of every frame body. `id` names the request; its reply echoes it (0: a connection-level error frame,
    after which the daemon closes), so a client never takes one request's answer for another's."""

    id: int = 0


# -- requests ------------------------------------------------------------------------------------


class Hello(Msg, tag="hello"):
    versions: list[int]
    client: str = ""


class Attach(Msg, tag="attach"):
    profile: str


class Lookup(Msg, tag="lookup"):
    hashes: bytes  # concatenated 16-byte chained block hashes, block 0 first


class Release(Msg, tag="release"):
    """Give back a lookup's leases, or abandon an offload's reserved (unsealed) slots."""

    handle: int


class Load(Msg, tag="load"):
    lookup_id: int


class Offload(Msg, tag="offload"):
    """Reserve pool slots for new objects: `blocks[g]` lists the block indices written for group `groups[g]`."""

    hashes: bytes
    groups: list[str]
    blocks: list[list[int]]


class Seal(Msg, tag="seal"):
    """The client wrote the reserved objects: seal them (and persist; `durable` waits for the store commit).

    `written[i]` is how many bytes the client wrote of the i-th reserved object (slots >= 0 of the offload
    reply, in order). On cpu the bytes ride along in a staging memfd (SCM_RIGHTS, objects back to back)
    that the client has unmapped: the daemon seals it against writes and copies each whole object into
    its slot; an object short in `written` or in the staging region is dropped (partial_block).
    """

    offload_id: int
    durable: bool = False
    written: list[int] = []


class Renew(Msg, tag="renew"):
    """Heartbeat: push back the expiry of every lease and reserved write of this connection."""


class Flush(Msg, tag="flush"):
    timeout_s: float = 60.0


class Prewarm(Msg, tag="prewarm"):
    hashes: bytes
    ttl_s: float = 600.0


class Stats(Msg, tag="stats"):
    pass


class Namespaces(Msg, tag="namespaces"):
    """List every namespace of the store with its state (live / canary / retired / store) and bytes."""


class NamespaceRetire(Msg, tag="namespace_retire"):
    """Retire a namespace (hex, or a unique prefix of it): a profile's canary, or one no profile serves."""

    namespace: str


class NamespacePromote(Msg, tag="namespace_promote"):
    """Make a profile's canary its live version; the live one is retired."""

    profile: str


class Explain(Msg, tag="explain"):
    """What each group of the attached profile has of these blocks, and why the hit stops (no leases taken)."""

    hashes: bytes


class EngineNamespaces(Msg, tag="engine_namespaces"):
    """The engine namespaces the store holds (vLLM tiers', SGLang backends'), for prewarm and explain to pick one."""


class EngineKeys(Msg, tag="engine_keys"):
    """Objects of an engine namespace: key i is (hashes[16i:16i+16], groups[group_of[i]]). With `prewarm`,
    load what only the cluster holds to local disk, pin every stored one for `ttl_s`, and warm their extents."""

    namespace: bytes
    groups: list[tuple[str, str, bytes, int]]  # (group name, form, layout digest, payload bytes of a record)
    hashes: bytes
    group_of: bytes
    prewarm: bool = False
    ttl_s: float = 600.0


class TierItem(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """One object of a raw tier request: key (block hash, index into the opened groups), layout digest, staged bytes."""

    block_hash: bytes
    group: int
    layout_digest: bytes
    offset: int = 0  # in the staging region (tier_store / tier_load only)
    nbytes: int = 0


class TierOpen(Msg, tag="tier_open"):
    """Register `version_key`'s namespace and groups [(name, form)]; a staging memfd of `staging_bytes` rides along."""

    version_key: dict[str, str]
    groups: list[tuple[str, str]]
    staging_bytes: int = 0
    identity: dict[str, Any] | None = None  # the engine's resolved configuration behind version_key (for audits)


class TierHas(Msg, tag="tier_has"):
    items: list[TierItem]


class TierKeys(Msg, tag="tier_keys"):
    """A page of the namespace's live keys after `after` (a cursor from the previous page; b"": from the first)."""

    after: bytes = b""
    limit: int = 4096


class TierStore(Msg, tag="tier_store"):
    """Persist the staged bytes of each item; answered after the store commit (fdatasync + index commit)."""

    items: list[TierItem]


class TierLoad(Msg, tag="tier_load"):
    """Read and verify each record into its staged range; the range holds the payload only where the reason is OK."""

    items: list[TierItem]


Request = (
    Hello
    | Attach
    | Lookup
    | Release
    | Load
    | Offload
    | Seal
    | Renew
    | Flush
    | Prewarm
    | Stats
    | Namespaces
    | NamespaceRetire
    | NamespacePromote
    | Explain
    | EngineNamespaces
    | EngineKeys
    | TierOpen
    | TierHas
    | TierKeys
    | TierStore
    | TierLoad
)
REQUEST_OPS = frozenset(t.__struct_config__.tag for t in Request.__args__)


# -- replies -------------------------------------------------------------------------------------


class CheckVectorWire(msgspec.Struct, forbid_unknown_fields=True):
    """`CheckVector.to_wire()` as a struct."""

    hash_block_tokens: int
    groups: list[str]
    forms: list[str]
    shape: list[int]
    routes: bytes
    reasons: bytes
    hit_blocks: int


class PoolInfo(msgspec.Struct, forbid_unknown_fields=True):
    """One group's pool as the client maps it: `fd_index` into the attach reply's fds (cpu) or `ipc` (cuda)."""

    group: str
    form: str
    slots: int
    slot_bytes: int
    object_bytes: int
    dtype: str
    shape: list[int]
    fd_index: int = -1
    pool_bytes: int = 0
    offset: int = 0  # byte offset of slot 0 in the shared memory / IPC allocation
    ipc: bytes = b""
    gen_fd_index: int = -1  # the slot generation table (int64 per slot, host shared memory, read-only)
    gen_offset: int = 0  # index of this pool's slot 0 in that table
    gen_bytes: int = 0


class HelloOk(Msg, tag="hello_ok"):
    version: int
    daemon: str
    pid: int


class AttachOk(Msg, tag="attach_ok"):
    profile: str
    namespace: bytes
    hash_block_tokens: int
    device: str
    lease_ttl_s: float
    pools: list[PoolInfo]


class LookupOk(Msg, tag="lookup_ok"):
    """Slots and generations are int64 arrays (groups x blocks), -1 where nothing is leased."""

    lookup_id: int
    check_vector: CheckVectorWire
    slots: bytes
    generations: bytes


class LoadOk(Msg, tag="load_ok"):
    check_vector: CheckVectorWire
    slots: bytes
    generations: bytes
    loaded_objects: int
    loaded_bytes: int
    seconds: float


class OffloadOk(Msg, tag="offload_ok"):
    """`slots[g][i]` is the slot to write for `blocks[g][i]`, or -1 where the object is already cached or refused."""

    offload_id: int
    slots: list[list[int]]
    refused: int


class SealOk(Msg, tag="seal_ok"):
    """`durable` / `not_durable` (with `durable=True` only): objects the offload named (written, skipped as
    reserved or cached elsewhere, or refused) that are / are not committed in the store; `why`: how many for
    each typed cause (a client acts on the cause, the detail is for humans)."""

    sealed: int
    persisted: bool
    durable: int = 0
    not_durable: int = 0
    why: list[NotDurableCount] = []


class Renewed(Msg, tag="renewed"):
    held: int


class FlushOk(Msg, tag="flush_ok"):
    """`pending`: sealed objects still not in the store when the flush ended; `why`: per typed cause (blocked
    forms, a pass that did not finish)."""

    persisted: int
    pending: int
    why: list[NotDurableCount] = []


class PrewarmOk(Msg, tag="prewarm_ok"):
    check_vector: CheckVectorWire
    loaded_objects: int
    loaded_bytes: int
    pinned: int
    seconds: float


class ExplainOk(Msg, tag="explain_ok"):
    """`raw`: every object routed on its own; `final`: the intersection (what a lookup reports); `windows`: per
    group 0 for history, else the trailing blocks a state group needs at a boundary."""

    raw: CheckVectorWire
    final: CheckVectorWire
    windows: list[int]


class EngineNamespace(msgspec.Struct, forbid_unknown_fields=True):
    """One engine namespace: its version key, whether it is live, and the host pools its identity lists (SGLang)."""

    namespace: bytes
    live: bool
    version_key: dict[str, str]
    pools: dict[str, dict[str, Any]] = {}


class EngineNamespacesOk(Msg, tag="engine_namespaces_ok"):
    namespaces: list[EngineNamespace]


class EngineKeysOk(Msg, tag="engine_keys_ok"):
    """Per key a `Reason` code (OK = 0: stored, loadable); for a prewarm what it loaded from the cluster, pinned
    and warmed (bytes of local extents advised into the page cache), and how long it took."""

    reasons: bytes
    loaded: int = 0
    loaded_bytes: int = 0
    pinned: int = 0
    warmed_bytes: int = 0
    seconds: float = 0.0


class Released(Msg, tag="released"):
    released: int


class StatsOk(Msg, tag="stats_ok"):
    stats: StatsDoc


class NamespacesOk(Msg, tag="namespaces_ok"):
    """The namespaces after the request; `done` says what a retire / promote changed ("" for a list)."""

    namespaces: list[NamespaceStats]
    done: str = ""


class TierOpenOk(Msg, tag="tier_open_ok"):
    namespace: bytes
    store: str
    io_backend: str


class TierReasons(Msg, tag="tier_reasons"):
    """One `kvtier.core.forms.Reason` code per item, in order (OK = 0)."""

    reasons: bytes


class TierKeyPage(Msg, tag="tier_key_page"):
    """Live keys: 16-byte block hashes concatenated, one group index byte each; `cursor` b"" when done; `txn` the
    index snapshot read (the same again: nothing changed)."""

    hashes: bytes
    groups: bytes
    cursor: bytes
    txn: int


class TierStored(Msg, tag="tier_stored"):
    """`stored` items committed (live ones skipped); `full_limit`: the limit a refused batch hit (nothing visible)."""

    stored: int
    full_limit: str = ""
    full_message: str = ""


class Error(Msg, tag="error"):
    code: str
    message: str


Reply = (
    HelloOk
    | AttachOk
    | LookupOk
    | LoadOk
    | OffloadOk
    | SealOk
    | Renewed
    | FlushOk
    | PrewarmOk
    | ExplainOk
    | EngineNamespacesOk
    | EngineKeysOk
    | Released
    | StatsOk
    | NamespacesOk
    | TierOpenOk
    | TierReasons
    | TierKeyPage
    | TierStored
    | Error
)

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


def encode_body(msg: Msg) -> bytes:
    return _encoder.encode(msg)


def decode_request(body: bytes | bytearray) -> Request:
    """A request struct; a typed ProtocolError (unknown op, wrong type, undecodable) otherwise."""
    try:
        return _request_decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise _classify(body, exc) from None
    except (msgspec.DecodeError, RecursionError) as exc:
        raise ProtocolError(f"undecodable request body ({_why(exc)}); send a msgpack map with an 'op'") from None


def _why(exc: BaseException) -> str:
    return "nested too deeply" if isinstance(exc, RecursionError) else str(exc)


def _classify(body: bytes | bytearray, exc: msgspec.ValidationError) -> ProtocolError:
    try:
        raw = msgspec.msgpack.decode(body)
    except (msgspec.DecodeError, RecursionError) as inner:
        return ProtocolError(f"undecodable request body ({exc}; {_why(inner)})")
    if not isinstance(raw, dict) or "op" not in raw:
        return WrongType("a request must be a msgpack map with an 'op' key")
    op = raw["op"]
    if op not in REQUEST_OPS:
        return UnknownOp(f"unknown op {op!r} (known: {', '.join(sorted(REQUEST_OPS))})")
    return WrongType(f"bad {op} request: {exc}")


def decode_reply(body: bytes | bytearray) -> Reply:
    try:
        return _reply_decoder.decode(body)
    except (msgspec.MsgspecError, RecursionError) as exc:
        raise ProtocolError(f"undecodable reply from the daemon ({exc}); client and daemon versions differ?") from None
