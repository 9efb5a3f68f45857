"""Model profiles: the cache groups of a hybrid-attention model and their geometry, to and from TOML."""

from __future__ import annotations

import dataclasses
import enum
import importlib.resources
import math
import tomllib
from pathlib import Path
from typing import Any

import tomli_w

from kvtier.core.errors import ProfileError
from kvtier.core.forms import CacheForm, GroupKind
from kvtier.core.layout import DTYPE_BYTES, LayoutSpec, RowLayout
from kvtier.core.versions import REQUIRED_FIELDS, VersionKey

_GROUP_FIELDS = ("name", "form", "kind", "layers", "tokens_per_block", "rows_per_block", "row")


@dataclasses.dataclass(frozen=True, slots=True)
class CacheGroup:
    """One cache group: layers that share a form and a block geometry.

    History groups store one object per hash block (all its rows); state groups store, per
    checkpointed hash block, the state that block leaves at its end: the last min(window, H)
    tokens' rows.
    """

    name: str
    form: CacheForm
    kind: GroupKind
    layer_ids: tuple[int, ...]
    tokens_per_block: int
    rows_per_block: int
    row: RowLayout
    ratio: int = 1
    window: int = 0

    def rows_per_hash_block(self, hash_block_tokens: int) -> int:
        """Rows one object of this group holds per layer."""
        covered = hash_block_tokens if self.kind is GroupKind.HISTORY else min(self.window, hash_block_tokens)
        return covered * self.rows_per_block // self.tokens_per_block

    def object_bytes(self, hash_block_tokens: int) -> int:
        """Payload bytes of one object (all layers of the group, one hash block)."""
        return len(self.layer_ids) * self.rows_per_hash_block(hash_block_tokens) * self.row.bytes

    def blocks_needed(self, hash_block_tokens: int) -> int:
        """Trailing hash blocks a state group needs at a boundary (n_s = ceil(window / H))."""
        if self.kind is GroupKind.HISTORY:
            raise ValueError(f"group {self.name} is a history group: it needs every block")
        return -(-self.window // hash_block_tokens)

    def layout(self, hash_block_tokens: int, kernel_abi: str) -> LayoutSpec:
        return LayoutSpec.packed(
            self.row.dtype,
            len(self.layer_ids),
            self.rows_per_hash_block(hash_block_tokens),
            self.row.shape,
            self.row.bytes,
            f"{kernel_abi}/{self.name}",
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "form": self.form.value,
            "kind": self.kind.value,
            "layers": list(self.layer_ids),
            "tokens_per_block": self.tokens_per_block,
            "rows_per_block": self.rows_per_block,
            "ratio": self.ratio,
            "window": self.window,
            "row": {"dtype": self.row.dtype, "shape": list(self.row.shape), "bytes": self.row.bytes},
        }


@dataclasses.dataclass(frozen=True, slots=True)
class ModelProfile:
    """A model's cache groups, its version key and free-form model parameters (for the reference model)."""

    name: str
    version: VersionKey
    groups: tuple[CacheGroup, ...]
    description: str = ""
    model: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def hash_block_tokens(self) -> int:
        """H: the least common multiple of every group's tokens per block."""
        return math.lcm(*(g.tokens_per_block for g in self.groups))

    @property
    def namespace(self) -> bytes:
        return self.version.namespace

    def group(self, name: str) -> CacheGroup:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(f"profile {self.name} has no cache group {name!r}")

    def groups_of(self, form: CacheForm) -> tuple[CacheGroup, ...]:
        return tuple(g for g in self.groups if g.form is form)

    def layout(self, group: CacheGroup) -> LayoutSpec:
        return group.layout(self.hash_block_tokens, self.version.kernel_abi)

    def bytes_per_hash_block(self) -> dict[str, int]:
        """Bytes of every form's objects for one hash block (state forms: one checkpoint)."""
        out: dict[str, int] = {}
        for g in self.groups:
            out[g.form.value] = out.get(g.form.value, 0) + g.object_bytes(self.hash_block_tokens)
        return out

    def bytes_per_million_tokens(self) -> dict[str, int]:
        """History forms scale with length; state forms are one checkpoint's worth regardless of length."""
        h = self.hash_block_tokens
        blocks = -(-1_000_000 // h)
        out: dict[str, int] = {}
        for g in self.groups:
            per = g.object_bytes(h) * (blocks if g.kind is GroupKind.HISTORY else g.blocks_needed(h))
            out[g.form.value] = out.get(g.form.value, 0) + per
        return out

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name}
        if self.description:
            out["description"] = self.description
        out["version"] = self.version.to_dict()
        if self.model:
            out["model"] = dict(self.model)
        out["groups"] = [g.to_dict() for g in self.groups]
        return out

    def to_toml(self) -> str:
        return tomli_w.dumps(self.to_dict())

    def summary(self) -> dict[str, Any]:
        """The `profile show --json` document."""
        h = self.hash_block_tokens
        return {
            "name": self.name,
            "hash_block_tokens": h,
            "namespace": self.version.namespace_hex,
            "version": self.version.to_dict(),
            "groups": [
                {
                    "name": g.name,
                    "form": g.form.value,
                    "kind": g.kind.value,
                    "layers": len(g.layer_ids),
                    "tokens_per_block": g.tokens_per_block,
                    "bytes_per_block": g.object_bytes(h),
                    "ratio": g.ratio,
                    "window": g.window,
                }
                for g in self.groups
            ],
            "bytes_per_hash_block": self.bytes_per_hash_block(),
            "bytes_per_million_tokens": self.bytes_per_million_tokens(),
        }


# ---------------------------------------------------------------------------------------------
# Parsing and validation


def _require(table: dict[str, Any], key: str, where: str, source: str | None) -> Any:
    if key not in table:
        raise ProfileError("missing", field=f"{where}{key}", source=source)
    return table[key]


def _positive_int(value: Any, field: str, source: str | None, *, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProfileError(f"must be an integer, got {value!r}", field=field, source=source)
    if value < 0 or (value == 0 and not allow_zero):
        raise ProfileError(f"must be {'>= 0' if allow_zero else '> 0'}, got {value}", field=field, source=source)
    return value


def _parse_enum(enum_cls: type[enum.Enum], value: Any, field: str, source: str | None):
    try:
        return enum_cls(value)
    except ValueError:
        allowed = ", ".join(m.value for m in enum_cls)
        raise ProfileError(f"unknown value {value!r} (one of: {allowed})", field=field, source=source) from None


def _parse_group(raw: Any, index: int, source: str | None) -> CacheGroup:
    where = f"groups[{index}]."
    if not isinstance(raw, dict):
        raise ProfileError("must be a table", field=f"groups[{index}]", source=source)
    for key in _GROUP_FIELDS:
        _require(raw, key, where, source)
    name = raw["name"]
    if not isinstance(name, str) or not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ProfileError(f"must be a short identifier, got {name!r}", field=f"{where}name", source=source)
    form = _parse_enum(CacheForm, raw["form"], f"{where}form", source)
    kind = _parse_enum(GroupKind, raw["kind"], f"{where}kind", source)
    if kind is not form.kind:
        raise ProfileError(
            f"form {form.value} is a {form.kind.value} form, not {kind.value}", field=f"{where}kind", source=source
        )
    layers = raw["layers"]
    if not isinstance(layers, list) or not layers or not all(isinstance(x, int) and x >= 0 for x in layers):
        raise ProfileError("must be a non-empty list of layer indices", field=f"{where}layers", source=source)
    tpb = _positive_int(raw["tokens_per_block"], f"{where}tokens_per_block", source)
    rpb = _positive_int(raw["rows_per_block"], f"{where}rows_per_block", source)
    ratio = _positive_int(raw.get("ratio", 1), f"{where}ratio", source)
    if form in (CacheForm.COMPRESSED, CacheForm.INDEXER) and rpb * ratio != tpb:
        raise ProfileError(
            f"rows_per_block x ratio must equal tokens_per_block ({rpb} x {ratio} != {tpb})",
            field=f"{where}ratio",
            source=source,
        )
    if kind is GroupKind.STATE:
        if "window" not in raw:
            raise ProfileError("missing (state groups need a window)", field=f"{where}window", source=source)
        window = _positive_int(raw["window"], f"{where}window", source)
        if (window * rpb) % tpb:
            raise ProfileError(f"window {window} does not cover whole rows", field=f"{where}window", source=source)
    else:
        window = _positive_int(raw.get("window", 0), f"{where}window", source, allow_zero=True)
    row_raw = raw["row"]
    if not isinstance(row_raw, dict):
        raise ProfileError("must be a table with dtype, shape and bytes", field=f"{where}row", source=source)
    dtype = _require(row_raw, "dtype", f"{where}row.", source)
    if dtype not in DTYPE_BYTES and dtype != "packed":
        raise ProfileError(f"unknown dtype {dtype!r}", field=f"{where}row.dtype", source=source)
    shape = _require(row_raw, "shape", f"{where}row.", source)
    if not isinstance(shape, list) or not shape or not all(isinstance(x, int) and x > 0 for x in shape):
        raise ProfileError("must be a non-empty list of positive integers", field=f"{where}row.shape", source=source)
    row = RowLayout(
        dtype,
        tuple(shape),
        _positive_int(_require(row_raw, "bytes", f"{where}row.", source), f"{where}row.bytes", source),
    )
    if dtype != "packed" and row.natural_bytes != row.bytes:
        raise ProfileError(
            f"{dtype} x {shape} is {row.natural_bytes} bytes, not {row.bytes}", field=f"{where}row.bytes", source=source
        )
    return CacheGroup(name, form, kind, tuple(layers), tpb, rpb, row, ratio, window)


def profile_from_dict(data: dict[str, Any], source: str | None = None) -> ModelProfile:
    """Build and validate a profile; every problem is a ProfileError naming the field and the source."""
    name = _require(data, "name", "", source)
    if not isinstance(name, str) or not name:
        raise ProfileError("must be a non-empty string", field="name", source=source)
    version_raw = _require(data, "version", "", source)
    if not isinstance(version_raw, dict):
        raise ProfileError("must be a table", field="version", source=source)
    for field in REQUIRED_FIELDS:
        value = _require(version_raw, field, "version.", source)
        if not isinstance(value, str) or not value:
            raise ProfileError("must be a non-empty string", field=f"version.{field}", source=source)
    version = VersionKey.from_dict(version_raw)
    groups_raw = _require(data, "groups", "", source)
    if not isinstance(groups_raw, list) or not groups_raw:
        raise ProfileError("must be a non-empty array of tables", field="groups", source=source)
    groups = tuple(_parse_group(g, i, source) for i, g in enumerate(groups_raw))
    names = [g.name for g in groups]
    if len(set(names)) != len(names):
        raise ProfileError(f"group names must be unique, got {names}", field="groups", source=source)
    sizes = sorted({g.tokens_per_block for g in groups})
    lcm = math.lcm(*sizes)
    if lcm != sizes[-1]:
        raise ProfileError(
            f"block sizes {sizes} have no common boundary within the largest block (lcm {lcm}); "
            "every group's tokens_per_block must divide the largest",
            field="groups.tokens_per_block",
            source=source,
        )
    model = data.get("model", {})
    if not isinstance(model, dict):
        raise ProfileError("must be a table", field="model", source=source)
    return ModelProfile(name, version, groups, str(data.get("description", "")), dict(model))


def load_profile_file(path: str | Path) -> ModelProfile:
    """Read a profile TOML file; a syntax error is a ProfileError too."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ProfileError("no such profile file", source=str(path)) from None
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"not valid TOML: {exc}", source=str(path)) from None
    return profile_from_dict(data, str(path))


def bundled_profile_names() -> list[str]:
    root = importlib.resources.files("kvtier.profiles")
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".toml"))


def load_profile(name_or_path: str | Path) -> ModelProfile:
    """A bundled profile by name, or a TOML file by path."""
    if str(name_or_path) in bundled_profile_names():
        res = importlib.resources.files("kvtier.profiles") / f"{name_or_path}.toml"
        return profile_from_dict(tomllib.loads(res.read_text()), f"<bundled {name_or_path}>")
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.exists():
        return load_profile_file(path)
    raise ProfileError(f"no bundled profile {str(name_or_path)!r} (bundled: {', '.join(bundled_profile_names())})")
