"""Version keys and the namespaces derived from them."""

from __future__ import annotations

import dataclasses
import hashlib
import json

NAMESPACE_BYTES = 16


@dataclasses.dataclass(frozen=True, slots=True)
class VersionKey:
    """Everything that must match for cached bytes to mean the same thing to the kernels reading them."""

    model_id: str
    weights_digest: str
    kernel_abi: str
    compression_version: str
    indexer_version: str
    dtype_layout: str

    def canonical(self) -> bytes:
        """Stable byte encoding: sorted-key JSON, no whitespace, UTF-8."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":")).encode()

    @property
    def namespace(self) -> bytes:
        """16-byte digest naming every object written under this key."""
        return hashlib.blake2b(self.canonical(), digest_size=NAMESPACE_BYTES, person=b"kvtier-ns-v1").digest()

    @property
    def namespace_hex(self) -> str:
        return self.namespace.hex()

    def bumped(self, **changes: str) -> VersionKey:
        """A copy with some fields changed: a new model, kernel or compressor version is a new namespace."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, str]) -> VersionKey:
        return cls(**{f.name: str(data[f.name]) for f in dataclasses.fields(cls)})
