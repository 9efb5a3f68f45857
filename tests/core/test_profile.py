"""Profiles: bundled geometry, TOML round trip, and typed errors for bad files."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from kvtier.core import CacheForm, ProfileError, load_profile, load_profile_file, profile_from_dict


def test_dsv4_geometry_matches_design() -> None:
    p = load_profile("deepseek-v4-flash")
    assert p.hash_block_tokens == 256
    c4 = p.group("c4_main")
    assert c4.rows_per_hash_block(256) == 64 and c4.row.bytes == 584
    assert p.group("c128_main").rows_per_hash_block(256) == 2
    assert p.group("indexer_k").row.bytes == 132
    swa = p.group("swa")
    assert swa.window == 128 and swa.blocks_needed(256) == 1
    per = p.bytes_per_hash_block()
    assert per["compressed"] == 21 * 64 * 584 + 19 * 2 * 584
    assert per["indexer"] == 21 * 64 * 132
    assert per["swa"] == 43 * 128 * 584


def test_cli_show_json_reports_hash_block_and_bytes() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "profile", "show", "deepseek-v4-flash", "--json"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    doc = json.loads(out)
    assert doc["hash_block_tokens"] == 256
    assert {g["form"] for g in doc["groups"]} == {"compressed", "indexer", "swa", "tail"}
    assert doc["bytes_per_hash_block"] == load_profile("deepseek-v4-flash").bytes_per_hash_block()
    assert doc["bytes_per_million_tokens"]["compressed"] == doc["bytes_per_hash_block"]["compressed"] * 3907


@pytest.mark.parametrize("name", ["ref-tiny", "deepseek-v4-flash"])
def test_toml_round_trip(name: str, tmp_path: Path) -> None:
    p = load_profile(name)
    path = tmp_path / "p.toml"
    path.write_text(p.to_toml())
    again = load_profile_file(path)
    assert again == p
    assert again.version.namespace == p.version.namespace
    assert again.summary() == p.summary()


def _mutated(name: str, mutate) -> dict:
    data = tomllib.loads(load_profile(name).to_toml())
    mutate(data)
    return data


BAD = {
    "unknown_form": (lambda d: d["groups"][1].update(form="dense"), "groups[1].form"),
    "zero_ratio": (lambda d: d["groups"][1].update(ratio=0), "groups[1].ratio"),
    "nonpositive_window": (lambda d: d["groups"][0].update(window=-16), "groups[0].window"),
    "no_common_boundary": (
        lambda d: d["groups"][0].update(tokens_per_block=24, rows_per_block=24, window=48),
        "groups.tokens_per_block",
    ),
    "missing_field": (lambda d: d["groups"][2].pop("tokens_per_block"), "groups[2].tokens_per_block"),
    "missing_version": (lambda d: d["version"].pop("kernel_abi"), "version.kernel_abi"),
    "kind_mismatch": (lambda d: d["groups"][0].update(kind="history"), "groups[0].kind"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_profile_names_field_and_file(case: str, tmp_path: Path) -> None:
    import tomli_w

    mutate, field = BAD[case]
    path = tmp_path / f"{case}.toml"
    path.write_text(tomli_w.dumps(_mutated("ref-tiny", mutate)))
    with pytest.raises(ProfileError) as info:
        load_profile_file(path)
    assert info.value.field == field
    assert str(path) in str(info.value)
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "profile", "show", str(path)], capture_output=True, text=True
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and field in lines[0] and "Traceback" not in proc.stderr


def test_invalid_toml_syntax_is_profile_error(tmp_path: Path) -> None:
    path = tmp_path / "broken.toml"
    path.write_text("name = \n")
    with pytest.raises(ProfileError, match="not valid TOML"):
        load_profile_file(path)


def test_forms_have_fixed_kinds() -> None:
    assert CacheForm.COMPRESSED.kind.value == "history"
    assert CacheForm.SWA.kind.value == "state"
    assert "on_disk" not in {f.value for f in CacheForm}  # a residence, not a form
    with pytest.raises(ProfileError):
        profile_from_dict(_mutated("ref-tiny", lambda d: d["groups"][1].update(form="on_disk")))


@pytest.mark.parametrize("name", ["ref-tiny", "deepseek-v4-flash"])
def test_a_bundled_profile_keeps_its_name_and_version_key(name: str) -> None:
    profile = load_profile(name)
    assert profile.name == name
    assert profile.version.engine_config == "" and "engine_config" not in profile.version.to_dict()
