"""One exit-code table: kvtier.cli.exits. Every wire error code maps to exactly one documented exit, the wire
layer names no exit code, and docs/cli.md shows the table as the module has it."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from kvtier.cli import exits
from kvtier.core.errors import KvtierError
from kvtier.wire import errors as wire_errors

ROOT = Path(__file__).resolve().parents[2]


def _wire_classes() -> list[type[KvtierError]]:
    """The typed errors kvtier.wire.errors defines with a code of their own (RemoteError keeps the daemon's)."""
    return [
        cls
        for _, cls in inspect.getmembers(wire_errors, inspect.isclass)
        if issubclass(cls, KvtierError) and cls.__module__ == wire_errors.__name__ and "code" in vars(cls)
    ]


def test_every_wire_error_code_has_exactly_one_exit() -> None:
    codes = [cls.code for cls in _wire_classes()]
    assert len(codes) == len(set(codes)), "two wire errors share a code"
    assert set(codes) == set(exits.WIRE_EXITS), "WIRE_EXITS and kvtier.wire.errors name different codes"
    documented = [c for row in exits.TABLE for c in row.codes]
    assert len(documented) == len(set(documented)), "an exit code in two rows of the table"
    for code, exit_code in exits.WIRE_EXITS.items():
        assert documented.count(exit_code) == 1, f"{code} -> {exit_code}, which the table does not document"


def test_every_exit_constant_is_in_the_table() -> None:
    constants = {v for k, v in vars(exits).items() if k.isupper() and isinstance(v, int)}
    assert constants <= {c for row in exits.TABLE for c in row.codes}


@pytest.mark.parametrize("cls", _wire_classes(), ids=lambda c: c.__name__)
def test_the_exit_follows_the_code_not_the_class(cls: type[KvtierError]) -> None:
    # DaemonTimeout is a DaemonUnavailable (3) but exits 4: the code decides, and so does a daemon's error
    # frame that arrives as a RemoteError carrying only the code
    assert exits.for_error(cls("x")) == exits.WIRE_EXITS[cls.code]
    assert exits.for_error(wire_errors.RemoteError(cls.code, "x")) == exits.WIRE_EXITS[cls.code]


def test_a_code_outside_the_table_is_a_usage_error() -> None:
    assert exits.for_error(wire_errors.RemoteError("namespace_refused", "x")) == exits.USAGE == 2
    assert exits.for_error(wire_errors.DaemonTimeout("x")) == exits.NOT_ANSWERING == 4
    assert exits.for_error(wire_errors.DaemonUnavailable("x")) == exits.NO_DAEMON == 3


def test_the_wire_layer_names_no_exit_code() -> None:
    tree = ast.parse((ROOT / "kvtier" / "wire" / "errors.py").read_text())
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    assert not any("exit" in n for n in names)
    assert not [cls.__name__ for cls in _wire_classes() if hasattr(cls, "exit_code")]


def test_docs_show_the_table() -> None:
    doc = (ROOT / "docs" / "cli.md").read_text()
    fix = "paste the output of: python -c 'from kvtier.cli import exits; print(exits.markdown_table())'"
    assert exits.markdown_table() in doc, f"docs/cli.md's exit-code table differs from kvtier.cli.exits: {fix}"
