"""Read a TOML document by the schema (`kvtier.core.config_schema`): every value checked by its key's kind and
limits, every problem a one-line ConfigError naming the dotted key, unknown keys refused, old names read
with a warning that says the new one."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvtier.core.config_schema import BY_NAME, DEPRECATED, FORMS, KEYS, TABLES, VERSION_FIELDS, Key, Kind
from kvtier.core.errors import ConfigError

log = logging.getLogger("kvtier.config")

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_UNKNOWN = "unknown key (misspelt? see `kvtier config show` for the known ones)"


def parse_size(value: Any, key: str, source: str | None = None) -> int:
    """Bytes from an integer or a string like '64MiB' / '1.5 GB'."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and (m := _SIZE.match(value)):
        return int(float(m.group(1)) * _UNITS[(m.group(2) or "B").lower()])
    raise ConfigError(
        f"must be a byte size (an integer or a string like '64MiB'), got {value!r}", key=key, source=source
    )


def parse_document(data: Mapping[str, Any], base: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The values of every key (dotted name -> typed value): `data`'s laid over `base` (the mode's defaults)."""
    given: dict[str, tuple[str, Any]] = {}  # key -> (the name it was written under, its raw value)
    for name, raw in data.items():
        if name in TABLES:
            if not isinstance(raw, dict):
                raise ConfigError("must be a table", key=name, source=source)
            for sub, value in raw.items():
                _place(given, f"{name}.{sub}", value, source)
        else:
            _place(given, name, raw, source)
    values = dict(base)
    for k in KEYS:  # the schema's order, so the first of several problems is always the same one
        if k.name in given and k.kind is not Kind.VERSIONS:
            written, raw = given[k.name]
            values[k.name] = parse_value(k, raw, written, source, values[k.name])
    for k in KEYS:  # after `profiles`, which they name
        if k.name in given and k.kind is Kind.VERSIONS:
            values[k.name] = _versions(given[k.name][1], k.name, values["profiles"], source)
    _cross_checks(values, source)
    return values


def _place(given: dict[str, tuple[str, Any]], name: str, raw: Any, source: str) -> None:
    key = BY_NAME.get(name) or DEPRECATED.get(name)
    if key is None:
        raise ConfigError(_UNKNOWN, key=name, source=source)
    if key.name in given:
        raise ConfigError(
            f"is another name of {given[key.name][0]}, which is set too: keep only {key.name}", key=name, source=source
        )
    if name != key.name:
        log.warning("%s: %r is deprecated: write %s instead (it means the same)", source, name, _written(key))
    given[key.name] = (name, raw)


def _written(key: Key) -> str:
    table, _, leaf = key.name.rpartition(".")
    return f"{leaf} in [{table}]" if table else leaf


def parse_value(k: Key, raw: Any, name: str, source: str | None, previous: Any = None) -> Any:
    """One key's value from TOML, checked; `name` is the key as written (an old name included)."""

    def bad(message: str) -> ConfigError:
        return ConfigError(message, key=name, source=source)

    kind = k.kind
    if kind in (Kind.STRING, Kind.CHOICE, Kind.ADDRESS):
        if not isinstance(raw, str):
            raise bad(f"must be a string, got {raw!r}")
        if k.choices and raw not in k.choices:
            raise bad(f"must be one of {', '.join(k.choices)}; got {raw!r}")
        if k.pattern and not re.fullmatch(k.pattern, raw):
            raise bad(f"invalid value {raw!r}")
        if kind is Kind.ADDRESS:
            _address(raw, bad)
        return raw
    if kind is Kind.BOOL:
        if not isinstance(raw, bool):
            raise bad(f"must be true or false, got {raw!r}")
        return raw
    if kind in (Kind.INTEGER, Kind.NUMBER):
        types = (int,) if kind is Kind.INTEGER else (int, float)
        if isinstance(raw, bool) or not isinstance(raw, types):
            raise bad(f"must be {'an integer' if kind is Kind.INTEGER else 'a number'}, got {raw!r}")
        _bounds(k, raw, bad)
        return raw if kind is Kind.INTEGER else float(raw)
    if kind is Kind.SIZE:
        value = parse_size(raw, name, source)
        _bounds(k, value, bad)
        return value
    if kind is Kind.PATH:
        if not isinstance(raw, str) or not raw:
            raise bad(f"must be a non-empty path string, got {raw!r}")
        return Path(raw)
    if kind is Kind.OCTAL:
        if isinstance(raw, str) and re.fullmatch(r"0?[0-7]{3}", raw):
            return int(raw, 8)
        raise bad(f"must be an octal string like '0660', got {raw!r}")
    if kind is Kind.IDS:
        if not isinstance(raw, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in raw):
            raise bad(f"must be a list of non-negative integers, got {raw!r}")
        return tuple(raw)
    if kind is Kind.NAMES:  # `minimum`: how many names at least
        fewest = int(k.minimum or 0)
        if not isinstance(raw, list) or len(raw) < fewest or not all(isinstance(p, str) and p for p in raw):
            some = f"at least {fewest} " if fewest > 1 else "a non-empty " if fewest else "a "
            raise bad(f"must be {some}list of profile names or paths, got {raw!r}")
        return tuple(raw)
    if kind is Kind.FORM_SIZES:
        if not isinstance(raw, dict):
            raise bad("must be a table")
        out = dict(previous or {})
        for form, size in raw.items():
            if form not in FORMS:
                raise ConfigError(_UNKNOWN, key=f"{name}.{form}", source=source)
            out[form] = parse_size(size, f"{name}.{form}", source)
        return out
    raise AssertionError(f"no parser for {kind}")  # VERSIONS is read by _versions


def _bounds(k: Key, value: float, bad: Any) -> None:
    if k.minimum is not None and value < k.minimum:
        raise bad(f"must be >= {number(k.minimum)}, got {value}")
    if k.above is not None and value <= k.above:
        raise bad(f"must be > {number(k.above)}, got {value}")
    if k.maximum is not None and value > k.maximum:
        raise bad(f"must be at most {number(k.maximum)}, got {value}")
    if k.multiple_of and value % k.multiple_of:
        raise bad(f"must be a multiple of {number(k.multiple_of)}, got {value}")


def number(x: float) -> str:
    """A limit as a person writes it: 1048576, not 1.04858e+06; 0.05 as it is."""
    return str(int(x)) if float(x).is_integer() else repr(x)


def _address(value: str, bad: Any) -> None:
    if value and not re.fullmatch(r"[\w.\-\[\]:]*:\d{1,5}", value):
        raise bad(f"must be HOST:PORT or empty to disable, got {value!r}")
    if value and int(value.rpartition(":")[2]) > 65535:
        raise bad(f"port {value.rpartition(':')[2]} is out of range (0-65535), got {value!r}")


def _versions(raw: Any, name: str, profiles: tuple[str, ...], source: str) -> dict[str, dict[str, str]]:
    """`[versions.<profile>]` / `[canary.<profile>]`: version-key fields that override the profile's own."""
    if not isinstance(raw, dict):
        raise ConfigError("must be a table", key=name, source=source)
    out: dict[str, dict[str, str]] = {}
    for profile, fields in raw.items():
        where = f"{name}.{profile}"
        if profile not in profiles:
            raise ConfigError(f"not a served profile (profiles: {', '.join(profiles)})", key=where, source=source)
        if not isinstance(fields, dict):
            raise ConfigError("must be a table", key=where, source=source)
        for field, value in fields.items():
            if field not in VERSION_FIELDS:
                raise ConfigError(_UNKNOWN, key=f"{where}.{field}", source=source)
            if not isinstance(value, str) or not value:
                raise ConfigError("must be a non-empty string", key=f"{where}.{field}", source=source)
        out[profile] = dict(fields)
    return out


def _cross_checks(values: Mapping[str, Any], source: str) -> None:
    """Limits between keys, which no single key's entry can say."""
    frame, buffered = values["server.max_frame_bytes"], values["server.max_buffered_bytes"]
    if buffered < frame:
        raise ConfigError(
            f"must be at least max_frame_bytes ({frame}), got {buffered}",
            key="server.max_buffered_bytes",
            source=source,
        )
