"""The client's own errors for what a reply (not an error frame) reports; the wire's errors are re-exported as is."""

from __future__ import annotations

from kvtier.core.errors import OutOfRoom


class TierFull(OutOfRoom):
    """The daemon's store refused a `tier_store` batch (budget, a quota, or the disk); nothing of it is visible.

    `limit` names the limit hit, as the store reports it (`budget`, `quota:<form>`, `disk`); the reply does not
    carry the room left.
    """
