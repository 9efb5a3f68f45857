"""Lookups of keys this node's store lacks, asked of the daemon off the scheduler thread (a node with a cluster tier).

The tier answers lookups from its key set: the live keys of the node's own store. On a node whose daemon has a
cluster below its disk, another node's objects are in the cluster and in no local index, so the key set never
holds them and every such lookup would be a miss. For the keys the set lacks, this asks the daemon's `has`
(its chain: the local index, then one batched existence call to the cluster) on vLLM's async-lookup worker:
the first lookup of a key answers RETRY, the worker asks during the step, and the next lookup has the verdict.
A request's keys are asked together, on its first such miss, so a prefix resolves in one round trip.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager

from kvtier.core.forms import Reason
from kvtier.core.tier import ObjectKey


class _Asked:
    """Per request: its keys were handed to the worker (once per request)."""


class RemoteLookups(AsyncLookupManager):
    """`lookup(key, ctx)`: True / False, or None while the daemon has not answered yet (the tier says RETRY)."""

    def __init__(
        self,
        to_object: Callable[[OffloadKey], tuple[ObjectKey, bytes] | None],
        has: Callable[[Sequence[ObjectKey], Sequence[bytes]], list[Reason]],
        present: Callable[[OffloadKey], bool],
    ) -> None:
        self._to_object = to_object
        self._has = has
        self._present = present
        super().__init__("kvtier-cluster")  # starts the worker: the callables above are set first

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        mapped = [self._to_object(k) for k in keys]
        asked = [m for m in mapped if m is not None]
        answers = iter(self._has([k for k, _ in asked], [d for _, d in asked]) if asked else [])
        return [m is not None and next(answers) is Reason.OK for m in mapped]

    def ask(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        """The verdict on `key`; on the request's first call, every key of the request the store lacks is queued."""
        if req_context.get_state(_Asked) is None:
            req_context.set_state(_Asked())
            for other in getattr(req_context, "_offload_key_positions", {}):
                if other != key and not self._present(other):
                    self.lookup(other, req_context)
        return self.lookup(key, req_context)

    def found(self, key: OffloadKey) -> bool:
        """Known to be servable (asked and answered yes), without asking."""
        state = self._lookup_state.get(key)
        return state is not None and state.result is True
