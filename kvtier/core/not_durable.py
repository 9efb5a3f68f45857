"""Why an acknowledgement does not cover an object: the typed causes a `durable=True` offload or a `flush`
reports for objects that are not committed in the store.

The cause is what a client acts on (re-offload, wait, give up); the detail is for humans and may change.
Both travel on the wire (msgspec encodes the dataclass and the enum by value).
"""

from __future__ import annotations

import dataclasses
import enum


class NotDurableCause(enum.StrEnum):
    RESERVED_ELSEWHERE = "reserved_elsewhere"  # another connection reserved it and did not seal it in time
    ABANDONED = "abandoned"  # not cached and not stored: nobody will write it unless the caller offloads it again
    STORE_REFUSED = "store_refused"  # the store refuses its form (quota, budget, disk error)
    WRITE_BACK_PENDING = "write_back_pending"  # sealed, waiting for a write-back pass when the deadline came
    ADMISSION = "admission"  # refused a pool slot and not in the store
    TIMED_OUT = "timed_out"  # the write-back pass itself did not finish in time


@dataclasses.dataclass(frozen=True, slots=True)
class NotDurableCount:
    """`objects` objects are not in the store because of `cause`; `detail` says it for humans."""

    cause: NotDurableCause
    objects: int
    detail: str

    def __str__(self) -> str:
        return f"{self.objects} objects: {self.detail}"
