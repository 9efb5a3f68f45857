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
    # An engine tier's digest of the engine's whole resolved configuration (kvtier.integrations.resolved_config);
    # "" for kvtier's own profiles, and then left out of the encoding, so their namespaces are what they were.
    engine_config: str = ""

    def canonical(self) -> bytes:
        """Stable byte encoding: sorted-key JSON, no whitespace, UTF-8."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()

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
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in OPTIONAL_FIELDS or v}

    @classmethod
    def from_dict(cls, data: dict[str, str]) -> VersionKey:
        return cls(**{f.name: str(data[f.name]) for f in dataclasses.fields(cls) if f.name in data})


REQUIRED_FIELDS = ("model_id", "weights_digest", "kernel_abi", "compression_version", "indexer_version", "dtype_layout")
OPTIONAL_FIELDS = ("engine_config",)
