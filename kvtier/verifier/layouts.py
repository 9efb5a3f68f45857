"""What layout digest a namespace's version key implies for a group, where a known profile describes its model."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable

from kvtier.core.errors import KvtierError
from kvtier.core.profile import ModelProfile, bundled_profile_names, load_profile
from kvtier.core.versions import VersionKey

log = logging.getLogger(__name__)


class LayoutOracle:
    """Expected digests from profiles: configured ones first, bundled ones for models no configured profile names.

    A record is checkable only when every candidate profile (same model id and dtype/layout, owning the group)
    agrees on the digest; otherwise the check is skipped rather than guessed.
    """

    def __init__(self, configured: Iterable[ModelProfile] = (), bundled: Iterable[ModelProfile] = ()) -> None:
        self._configured = tuple(configured)
        self._bundled = tuple(bundled)
        # keyed by the version key itself: its namespace is a JSON encoding and a hash, and the inventory asks
        # for every record of every maintenance pass
        self._cache: dict[tuple[VersionKey, str], bytes | None] = {}

    @classmethod
    def load(cls, names: Iterable[str] = ()) -> LayoutOracle:
        configured = []
        for name in names:
            try:
                configured.append(load_profile(name))
            except KvtierError as exc:
                log.warning("layout check cannot use profile %s: %s", name, exc)
        return cls(configured, [load_profile(n) for n in bundled_profile_names()])

    def expected(self, version: VersionKey, group: str) -> bytes | None:
        """The digest a record of `group` written under `version` must carry; None where that is not known."""
        key = (version, group)
        if key not in self._cache:
            self._cache[key] = self._compute(version, group)
        return self._cache[key]

    def _compute(self, version: VersionKey, group: str) -> bytes | None:
        for profiles in (self._configured, self._bundled):
            same_model = [
                p
                for p in profiles
                if (p.version.model_id, p.version.dtype_layout) == (version.model_id, version.dtype_layout)
            ]
            if not same_model:
                continue
            digests = set()
            for p in same_model:
                try:
                    g = p.group(group)
                except KeyError:
                    continue
                digests.add(dataclasses.replace(p, version=version).layout(g).digest)
            return digests.pop() if len(digests) == 1 else None
        return None
