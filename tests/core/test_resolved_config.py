"""The canonical rendering behind engine namespaces: every field but named exclusions, deterministic, typed errors."""

from __future__ import annotations

import dataclasses
import enum
import json
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.integrations.errors import UnrenderableConfig
from kvtier.integrations.resolved_config import canonical, digest


class Mode(enum.Enum):
    FAST = "fast"


@dataclasses.dataclass
class Cache:
    dtype: str = "auto"
    blocks: int = 16


@dataclasses.dataclass
class Engine:
    model: str = "m"
    theta: float = 10000.0
    mode: Mode = Mode.FAST
    cache: Cache = dataclasses.field(default_factory=Cache)
    extra: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class EngineNext(Engine):
    """The same engine after an upgrade added a field kvtier has never heard of."""

    new_knob: int = 0


def test_every_field_is_rendered_and_only_named_paths_are_left_out() -> None:
    doc = canonical(Engine(extra={"b": [1, 2.5], "a": None}), {"cache.blocks": "sizing"})
    assert doc == {
        "__class__": "Engine",
        "model": "m",
        "theta": 10000.0,
        "mode": "fast",
        "cache": {"__class__": "Cache", "dtype": "auto"},
        "extra": {"a": None, "b": [1, 2.5]},
    }
    assert json.loads(json.dumps(doc)) == doc


def test_a_field_an_engine_adds_changes_the_digest_an_excluded_one_does_not() -> None:
    base = digest(canonical(Engine()))
    assert digest(canonical(EngineNext())) != base  # unknown fields are identity, never ignored
    assert digest(canonical(Engine(theta=40000.0))) != base
    assert digest(canonical(Engine(cache=Cache(blocks=99)), {"cache.blocks": "sizing"})) == digest(
        canonical(Engine(), {"cache.blocks": "sizing"})
    )


@pytest.mark.parametrize(
    ("value", "path"),
    [
        (Engine(extra={"hook": print}), "extra.hook"),
        (Engine(extra={"lock": threading.Lock()}), "extra.lock"),
        (Engine(extra={"obj": object()}), "extra.obj"),
    ],
)
def test_what_cannot_be_rendered_deterministically_is_refused_naming_the_field(value: Engine, path: str) -> None:
    with pytest.raises(UnrenderableConfig, match=f"'{path}'") as exc:
        canonical(value)
    assert exc.value.code == "engine_config"


def test_a_cycle_is_refused() -> None:
    loop: dict = {}
    loop["self"] = loop
    with pytest.raises(UnrenderableConfig, match="refers back to itself"):
        canonical(loop)


scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=8)
trees = st.recursive(
    scalars,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4),
    max_leaves=20,
)


@given(trees)
def test_rendering_is_deterministic_and_key_order_free(tree) -> None:
    once = digest(canonical(tree))
    assert digest(canonical(tree)) == once
    if isinstance(tree, dict):
        assert digest(canonical(dict(reversed(list(tree.items()))))) == once


@given(st.dictionaries(st.text(min_size=1, max_size=6), scalars, min_size=1, max_size=6), st.data())
def test_changing_any_leaf_changes_the_digest(tree: dict, data) -> None:
    key = data.draw(st.sampled_from(sorted(tree)))
    changed = {**tree, key: [tree[key]]}  # a different value of another type
    assert digest(canonical(changed)) != digest(canonical(tree))


@dataclasses.dataclass
class Derived:
    """A config whose __post_init__ sets attributes it never declared (as model configs set their own keys)."""

    declared: int = 1

    def __post_init__(self) -> None:
        self.compress_ratios = [0, 4, 128]
        self._cache = object()  # private state: not configuration


def test_attributes_set_beyond_the_declared_fields_are_identity_too() -> None:
    doc = canonical(Derived())
    assert doc == {"__class__": "Derived", "declared": 1, "compress_ratios": [0, 4, 128]}
    other = Derived()
    other.compress_ratios = [0, 2, 1]
    assert digest(canonical(other)) != digest(doc)
