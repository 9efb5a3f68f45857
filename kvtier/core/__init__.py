"""The shared vocabulary: forms, routes, versions, layouts, profiles, block hashes, check vectors. No I/O."""

from kvtier.core.checkvector import CheckVector, HitGeometry, usable_hit, window_blocks
from kvtier.core.errors import KvtierError, LayoutError, ProfileError, VersionError
from kvtier.core.forms import CacheForm, GroupKind, Reason, Route
from kvtier.core.hashing import HASH_BYTES, BlockHasher, block_hashes, root_hash
from kvtier.core.layout import DISK_ALIGNMENT, POOL_ALIGNMENT, LayoutSpec, RowLayout, align_up
from kvtier.core.profile import (
    CacheGroup,
    ModelProfile,
    bundled_profile_names,
    load_profile,
    load_profile_file,
    profile_from_dict,
)
from kvtier.core.versions import VersionKey

__all__ = [
    "DISK_ALIGNMENT",
    "HASH_BYTES",
    "POOL_ALIGNMENT",
    "BlockHasher",
    "CacheForm",
    "CacheGroup",
    "CheckVector",
    "GroupKind",
    "HitGeometry",
    "KvtierError",
    "LayoutError",
    "LayoutSpec",
    "ModelProfile",
    "ProfileError",
    "Reason",
    "Route",
    "RowLayout",
    "VersionError",
    "VersionKey",
    "align_up",
    "block_hashes",
    "bundled_profile_names",
    "load_profile",
    "load_profile_file",
    "profile_from_dict",
    "root_hash",
    "usable_hit",
    "window_blocks",
]
