"""The config schema is the one list of keys: the records, the parser, SIGHUP's reload, `config init` and
docs/config.md all follow it, and each is checked against it here."""

from __future__ import annotations

import dataclasses
import logging
import string
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvtier.cli.config_cmd import _commented, _toml
from kvtier.core import config_doc
from kvtier.core.config import (
    RECORDS,
    DaemonConfig,
    apply_reloadable,
    build_config,
    config_text,
    load_config,
    mode_values,
    plain,
)
from kvtier.core.config_parse import parse_value
from kvtier.core.config_schema import FORMS, KEYS, MODES, Key, Kind, section
from kvtier.core.errors import ConfigError

DOCS = Path(__file__).resolve().parents[2] / "docs" / "config.md"
NOT_KEYS = {"mode", "source", "mode_why", *RECORDS}  # DaemonConfig's fields that are not top-level keys


def test_the_docs_key_table_is_the_schemas() -> None:
    page = DOCS.read_text()
    assert config_doc.BEGIN in page and config_doc.END in page
    assert config_doc.rewrite(page) == page, "docs/config.md is stale: python -m kvtier.core.config_doc docs/config.md"
    for k in KEYS:
        assert f"| `{k.name.rpartition('.')[2]}`" in page


def test_every_record_field_is_a_key_and_every_key_a_field() -> None:
    for table, record in RECORDS.items():
        fields = {f.name for f in dataclasses.fields(record)}
        assert fields == {k.attr for k in section(table)}, table
    top = {f.name for f in dataclasses.fields(DaemonConfig)} - NOT_KEYS
    assert top == {k.attr for k in section("") if k.name != "mode"}


def test_record_defaults_are_the_schemas() -> None:
    """A record built in code starts from the schema's `code` defaults: no second list of them."""
    # the fields a daemon's record has no default for: a socket, and a store root (both modes name one)
    required: dict[str, dict[str, Path]] = {"server": {"socket": Path("/s")}, "store": {"root": Path("/r")}}
    for table, record in RECORDS.items():
        for f in dataclasses.fields(record):
            if f.default is dataclasses.MISSING:
                continue
            k = next(k for k in section(table) if k.attr == f.name)
            want = k.default("code")
            got = getattr(record(**required.get(table, {})), f.name)
            assert plain(k, got) == plain(k, want) or (k.kind is Kind.FORM_SIZES and not want), k.name


@pytest.mark.parametrize("mode", MODES)
def test_each_modes_defaults_pass_their_own_checks(mode: str, tmp_path: Path) -> None:
    values = mode_values(mode, env={}, cwd=tmp_path)
    for k in KEYS:
        if k.kind is not Kind.VERSIONS:
            raw = plain(k, values[k.name])
            assert parse_value(k, raw, k.name, None, values[k.name]) == values[k.name], k.name


def _other(k: Key, value: Any) -> Any:
    """A valid value of `k` other than `value`."""
    match k.kind:
        case Kind.BOOL:
            return not value
        case Kind.INTEGER | Kind.SIZE:
            return value + (k.multiple_of or 1)
        case Kind.NUMBER:
            return value / 2 if value else 0.5
        case Kind.CHOICE:
            return next((c for c in k.choices if c != value), value)
        case Kind.STRING if k.name.endswith("endpoint"):
            return f"inproc://{k.name}"  # ZeroMQ endpoints, each key its own (a replay endpoint must differ)
        case Kind.STRING:
            return value + "x"
        case Kind.PATH:
            return value / "x"
        case Kind.OCTAL:
            return 0o600
        case Kind.IDS:
            return (7,)
        case Kind.NAMES:
            return ("ref-tiny", "other")
        case Kind.ADDRESS:
            return "127.0.0.1:1"
        case Kind.FORM_SIZES:
            return {**value, "swa": 12345}
        case Kind.VERSIONS:
            return {"ref-tiny": {"kernel_abi": "next"}}
    raise AssertionError(k.kind)


def test_sighup_applies_exactly_the_keys_the_schema_marks_reloadable(tmp_path: Path) -> None:
    base = mode_values("user", cwd=tmp_path)
    changed = {name: _other(k, base[name]) for k in KEYS if (name := k.name) != "mode"} | {"mode": "user"}
    kw = {"mode": "user", "source": "x", "mode_why": "x"}
    current, new = build_config(base, **kw), build_config(changed, **kw)
    after = apply_reloadable(current, new)
    reloaded = {k.name for k in KEYS if k.reloadable}
    assert reloaded >= {"store.budget_bytes", "store.quota_bytes", "verifier.rate_bytes_per_s", "versions"}
    for k in KEYS:
        if k.name == "mode" or (k.kind is Kind.CHOICE and len(k.choices) == 1):
            continue
        source = new if k.name in reloaded else current
        assert plain(k, after.value(k)) == plain(k, source.value(k)), k.name
        assert plain(k, current.value(k)) != plain(k, new.value(k)), k.name  # the test changed every key


@pytest.mark.parametrize("k", [k for k in KEYS if k.minimum is not None or k.above is not None], ids=lambda k: k.name)
def test_a_value_below_a_keys_limit_is_one_line_naming_it(k: Key, tmp_path: Path) -> None:
    low = (k.minimum if k.minimum is not None else k.above) - 1 + (0 if k.minimum is not None else 1)
    if k.kind is Kind.SIZE and low < 0:
        low = -1  # not a size at all: refused too
    f = tmp_path / "k.toml"
    f.write_text(config_text({k.name: int(low) if k.kind in (Kind.INTEGER, Kind.SIZE) else low}, check=False))
    with pytest.raises(ConfigError) as info:
        load_config(f, env={}, cwd=tmp_path)
    assert info.value.key == k.name and "\n" not in str(info.value) and str(f) in str(info.value)


@pytest.mark.parametrize("k", [k for k in KEYS if k.multiple_of], ids=lambda k: k.name)
def test_a_value_off_a_keys_multiple_is_one_line_naming_it(k: Key, tmp_path: Path) -> None:
    f = tmp_path / "k.toml"
    f.write_text(config_text({k.name: k.multiple_of * 3}))
    assert load_config(f, env={}, cwd=tmp_path).value(k) == k.multiple_of * 3
    f.write_text(config_text({k.name: k.multiple_of * 3 + 1}, check=False))
    with pytest.raises(ConfigError, match=f"multiple of {k.multiple_of}") as info:
        load_config(f, env={}, cwd=tmp_path)
    assert info.value.key == k.name and "\n" not in str(info.value) and str(f) in str(info.value)


def test_old_names_are_read_with_a_warning_naming_the_new_key(tmp_path: Path, caplog: Any) -> None:
    f = tmp_path / "k.toml"
    f.write_text("recovering_cap = 8\nrecover_queue = 9\n")
    with caplog.at_level(logging.WARNING, logger="kvtier.config"):
        cfg = load_config(f, env={}, cwd=tmp_path)
    assert cfg.admission.max_recovering == 8 and cfg.admission.max_recover_queue == 9
    assert "write max_recovering in [admission]" in caplog.text and "'recover_queue' is deprecated" in caplog.text
    f.write_text("recovering_cap = 8\n[admission]\nmax_recovering = 9\n")
    with pytest.raises(ConfigError) as info:
        load_config(f, env={}, cwd=tmp_path)
    assert info.value.key in ("recovering_cap", "admission.max_recovering") and "keep only" in str(info.value)


def test_no_cap_is_zero_in_the_file_and_the_record(tmp_path: Path) -> None:
    f = tmp_path / "k.toml"
    f.write_text("[admission]\nmax_entries = 0\n")
    assert load_config(f, env={}, cwd=tmp_path).admission.max_entries == 0
    f.write_text("[admission]\nmax_entries = -1\n")
    with pytest.raises(ConfigError, match=r"admission\.max_entries"):
        load_config(f, env={}, cwd=tmp_path)


def test_the_store_runs_on_the_configs_record(tmp_path: Path) -> None:
    """No second store record: the daemon hands `[store]` as it is to DiskStore."""
    f = tmp_path / "k.toml"
    f.write_text('[store]\nio_backend = "buffered"\nsegment_bytes = "8MiB"\n[store.quota_bytes]\nswa = "1MiB"\n')
    store = load_config(f, env={}, cwd=tmp_path).store
    from kvtier.store import StoreConfig  # the store's export is the same class

    assert isinstance(store, StoreConfig) and store.io_backend == "buffered" and store.segment_bytes == 8 << 20
    assert store.quota_bytes == {"swa": 1 << 20} and store.budget_bytes == 1 << 30  # user mode's budget
    assert StoreConfig().budget_bytes == 0  # in code: no budget unless asked


def test_config_init_documents_every_key(tmp_path: Path) -> None:
    text = _commented(
        _toml(build_config(mode_values("system"), mode="system", source="s", mode_why="w")), "system", "w"
    )
    lines = text.splitlines()
    table = ""
    for i, line in enumerate(lines):
        if line.startswith("["):
            table = line.strip("[]")
        elif " = " in line and not line.startswith("#"):
            name = f"{table}.{line.split(' =')[0]}" if table else line.split(" =")[0]
            if name in {k.name for k in KEYS}:
                assert lines[i - 1].startswith("# "), f"{name} has no comment above it"
    assert "Reloaded by SIGHUP." in text


def test_config_text_checks_what_it_writes(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        config_text({"store.rooot": "/x"})
    assert info.value.key == "store.rooot"
    with pytest.raises(ConfigError) as info:
        config_text({"cluster.replicas": 17})
    assert info.value.key == "cluster.replicas"
    f = tmp_path / "k.toml"
    f.write_text(config_text({"store.root": tmp_path / "s", "pool.budget_bytes": {"swa": "64KiB"}, "device": "cpu"}))
    cfg = load_config(f, env={}, cwd=tmp_path)
    assert cfg.store.root == tmp_path / "s" and cfg.pool.budget_bytes["swa"] == 64 << 10


_NAME = st.text(alphabet=string.ascii_letters + string.digits + "-_", min_size=1, max_size=12)


def _values(k: Key) -> st.SearchStrategy[Any]:
    """Valid TOML values of `k`, by its kind and limits."""
    low = k.minimum if k.minimum is not None else (k.above if k.above is not None else 0)
    high = k.maximum if k.maximum is not None else 2**40
    match k.kind:
        case Kind.BOOL:
            return st.booleans()
        case Kind.INTEGER | Kind.SIZE if k.multiple_of:
            return st.integers(int(low) // k.multiple_of, int(high) // k.multiple_of).map(lambda n: n * k.multiple_of)
        case Kind.INTEGER | Kind.SIZE:
            return st.integers(int(low) + (k.above is not None), int(high))
        case Kind.NUMBER:
            return st.floats(low, min(high, 1e9), exclude_min=k.above is not None, allow_nan=False)
        case Kind.CHOICE:
            return st.sampled_from(k.choices)
        case Kind.STRING if k.name == "events.endpoint":
            return st.sampled_from(("", "tcp://*:5557", "ipc:///run/kvtier/events.sock"))
        case Kind.STRING if k.name == "events.replay_endpoint":
            return st.just("")  # a replay endpoint needs events.endpoint set (EventsConfig's own check)
        case Kind.STRING:
            return st.sampled_from(("cpu", "auto", "cuda", "cuda:3")) if k.name == "device" else _NAME
        case Kind.PATH:
            return _NAME.map(lambda n: f"/srv/{n}")
        case Kind.OCTAL:
            return st.integers(0, 0o777).map(lambda m: f"{m:04o}")
        case Kind.IDS:
            return st.lists(st.integers(0, 2**31), max_size=3)
        case Kind.NAMES:
            return st.lists(_NAME, min_size=int(k.minimum or 0), max_size=3)
        case Kind.ADDRESS:
            return st.sampled_from(("", "127.0.0.1:9", "[::1]:65535", "node-1:80"))
        case Kind.FORM_SIZES:
            return st.dictionaries(st.sampled_from(FORMS), st.integers(0, 2**40), max_size=4)
    raise AssertionError(k.kind)


_GENERATED = [k for k in KEYS if k.kind is not Kind.VERSIONS and k.name != "mode"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_any_valid_file_reads_as_written_and_config_show_reads_back_the_same(tmp_path: Path, data: Any) -> None:
    chosen = data.draw(st.lists(st.sampled_from(_GENERATED), unique_by=lambda k: k.name, max_size=12))
    given_ = {k.name: data.draw(_values(k), label=k.name) for k in chosen}
    frame, buffered = "server.max_frame_bytes", "server.max_buffered_bytes"
    assume(given_.get(buffered, 256 << 20) >= given_.get(frame, 16 << 20))
    f = tmp_path / "k.toml"
    f.write_text(config_text(given_))
    cfg = load_config(f, env={}, cwd=tmp_path)
    defaults = mode_values("user", cwd=tmp_path)
    for k in chosen:
        want = given_[k.name]
        if k.kind is Kind.FORM_SIZES:
            want = {**defaults[k.name], **want}
        got = plain(k, cfg.value(k))
        assert got == (float(want) if k.kind is Kind.NUMBER else want), k.name
    shown = tmp_path / "shown.toml"
    shown.write_text(_toml(cfg))
    again = load_config(shown, env={}, cwd=tmp_path)
    assert {**again.to_dict(), "source": ""} == {**cfg.to_dict(), "source": ""}
