"""The daemon's TOML config: its typed records, the two modes' defaults, and reading a file over them.

Two modes, always chosen explicitly, never by the uid that runs us: `user` (everything under ./.kvtier/, cpu,
ref-tiny, small pools, a supervised verifier) and `system` (the systemd unit's /run/kvtier and /var/lib/kvtier,
the bundled DSV4 profile, large pools, an external verifier, metrics on 127.0.0.1:9641). The mode comes from,
in order: `--user` / `--system`, the file's top-level `mode` key, `$KVTIER_MODE`, the directories systemd
sets for the unit (RUNTIME_DIRECTORY / STATE_DIRECTORY); else `user`. A partial file fills from that mode.

Every key, its default in each mode, its limits and whether SIGHUP reloads it are declared once, in
`kvtier.core.config_schema`; the records here carry one field per key of their table, and take their
defaults from there. In `core` because two processes read the one file: the daemon (everything) and the
verifier (rates, store limits, profiles).
"""

from __future__ import annotations

import dataclasses
import enum
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tomli_w

from kvtier.core.cluster_config import ClusterConfig
from kvtier.core.config_parse import parse_document, parse_size, parse_value
from kvtier.core.config_schema import (
    BY_NAME,
    DEPRECATED,
    KEYS,
    MODES,
    Key,
    Kind,
    default,
    fill_dirs,
    section,
)
from kvtier.core.errors import ConfigError
from kvtier.core.events_config import EventsConfig
from kvtier.core.store_config import DaemonStoreConfig, StoreConfig

__all__ = [
    "MODES",
    "AdmissionConfig",
    "DaemonConfig",
    "DaemonStoreConfig",
    "EventsConfig",
    "MetricsConfig",
    "PoolConfig",
    "ServerConfig",
    "StoreConfig",
    "VerifierConfig",
    "apply_reloadable",
    "choose_mode",
    "config_text",
    "load_config",
    "mode_defaults",
    "parse_size",
]

SYSTEM_CONFIG = Path("/etc/kvtier/kvtier.toml")
SYSTEMD_RUNTIME_DIR = Path("/run/kvtier")
SYSTEMD_STATE_DIR = Path("/var/lib/kvtier")
SOCKET_NAME = "kvtier.sock"
MODE_ENV = "KVTIER_MODE"


@dataclasses.dataclass(frozen=True, slots=True)
class ServerConfig:
    """`[server]`: the unix socket, who may connect, and the limits every connection lives under."""

    socket: Path
    socket_mode: int = default("server.socket_mode")
    allowed_uids: tuple[int, ...] = default("server.allowed_uids")
    allowed_gids: tuple[int, ...] = default("server.allowed_gids")
    max_frame_bytes: int = default("server.max_frame_bytes")
    max_connections: int = default("server.max_connections")
    frame_timeout_s: float = default("server.frame_timeout_s")
    hello_timeout_s: float = default("server.hello_timeout_s")
    idle_timeout_s: float = default("server.idle_timeout_s")
    max_buffered_bytes: int = default("server.max_buffered_bytes")


@dataclasses.dataclass(frozen=True, slots=True)
class PoolConfig:
    """`[pool]`: bytes of pool memory per form, per attached profile; allocated once at start."""

    budget_bytes: Mapping[str, int]


@dataclasses.dataclass(frozen=True, slots=True)
class VerifierConfig:
    """`[verifier]`: the verifier process supervised by the daemon, run by its own unit (external), or off;
    and its rates. The verifier's own record (`kvtier.verifier.VerifierSettings`) extends this one."""

    mode: str = default("verifier.mode")
    rate_bytes_per_s: int = default("verifier.rate_bytes_per_s")  # 0: unlimited
    busy_rate_bytes_per_s: int = default("verifier.busy_rate_bytes_per_s")  # while others use the disk
    sweep_interval_s: float = default("verifier.sweep_interval_s")
    restart_backoff_s: float = default("verifier.restart_backoff_s")
    max_backoff_s: float = default("verifier.max_backoff_s")
    hung_after_s: float = default("verifier.hung_after_s")


@dataclasses.dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """`[admission]`: caps on what the pools admit (`kvtier.gpu` runs on this record).

    `max_entries`: occupied slots across all pools of a profile (0: their capacity). Per-form quotas split it
    into reservations, starting in proportion to capacity and rebalanced toward demand every
    `rebalance_every` allocations, never below `min_form_share`: when the cap is reached, the victim
    comes from a form above its reservation (state forms first, LRU), so no form starves another.
    `max_recovering`: slots RECOVERING at once (a recovery beyond it waits, up to `recover_wait_s`);
    one recovery loads what the cap lets it claim as one batch, so the default takes a whole
    lookup's queue (`max_recover_queue`): the store then reads it in as few large runs as it lies in.
    `max_recover_queue`: RECOVER objects a lookup may hand out while others are pending; the excess
    is routed RECOMPUTE `admission`.
    `state_probe_boundaries`: boundaries below the history hit at which the lower tier is asked
    for missing state objects before settling for a resident checkpoint.
    """

    max_entries: int = default("admission.max_entries")
    min_form_share: float = default("admission.min_form_share")
    rebalance_every: int = default("admission.rebalance_every")
    max_recovering: int = default("admission.max_recovering")
    max_recover_queue: int = default("admission.max_recover_queue")
    recover_wait_s: float = default("admission.recover_wait_s")
    state_probe_boundaries: int = default("admission.state_probe_boundaries")

    def __post_init__(self) -> None:
        if self.max_entries < 0:
            raise ValueError("max_entries must be >= 0 (0: the pools' capacity)")
        if not 0.0 <= self.min_form_share <= 1.0:
            raise ValueError("min_form_share must be in [0, 1]")
        if self.rebalance_every < 1 or self.max_recovering < 1 or self.max_recover_queue < 0:
            raise ValueError("rebalance_every and max_recovering must be >= 1, max_recover_queue >= 0")


@dataclasses.dataclass(frozen=True, slots=True)
class MetricsConfig:
    """`[metrics]`: the Prometheus endpoint; an empty address turns it off."""

    address: str = default("metrics.address")


# The record of each table; the top-level keys are DaemonConfig's own fields.
RECORDS: dict[str, type] = {
    "server": ServerConfig,
    "pool": PoolConfig,
    "store": DaemonStoreConfig,
    "verifier": VerifierConfig,
    "metrics": MetricsConfig,
    "admission": AdmissionConfig,
    "cluster": ClusterConfig,
    "events": EventsConfig,
}


@dataclasses.dataclass(frozen=True, slots=True)
class DaemonConfig:
    """Everything `kvtier serve` runs on; `source` says where it came from."""

    device: str
    profiles: tuple[str, ...]
    server: ServerConfig
    pool: PoolConfig
    store: DaemonStoreConfig
    verifier: VerifierConfig
    metrics: MetricsConfig
    admission: AdmissionConfig
    cluster: ClusterConfig
    events: EventsConfig
    lease_ttl_s: float = default("lease_ttl_s")
    persist_queue_depth: int = default("persist_queue_depth")
    shutdown_timeout_s: float = default("shutdown_timeout_s")
    durable_wait_s: float = default("durable_wait_s")
    # per profile, version-key fields laid over the profile's own (weights_digest, kernel_abi, ...): a rollout
    versions: Mapping[str, Mapping[str, str]] = dataclasses.field(default_factory=dict)
    # per profile, the version-key fields of a canary served beside the live version (`<profile>@canary`)
    canary: Mapping[str, Mapping[str, str]] = dataclasses.field(default_factory=dict)
    mode: str = "user"  # whose defaults the file was laid over (MODES)
    source: str = "embedded default"
    mode_why: str = "the default"  # what chose the mode, for `config show` and `doctor`

    @property
    def file(self) -> str:
        """The config file read, or 'none' (only the mode's defaults)."""
        return "none" if self.source in ("embedded default", "systemd default") else self.source

    def value(self, key: Key) -> Any:
        """The value of one schema key."""
        if key.name == "mode":
            return self.mode
        holder = getattr(self, key.section) if key.section else self
        return getattr(holder, key.attr)

    def values(self) -> dict[str, Any]:
        """Every key's value (dotted name -> typed value), in the schema's order."""
        return {k.name: self.value(k) for k in KEYS}

    def to_dict(self) -> dict[str, Any]:
        """The effective config as TOML-able plain data, one entry per schema key (sizes in bytes, the socket
        mode as an octal string), then `source`; `mode_why` is not a key."""
        out: dict[str, Any] = {}
        for k in KEYS:
            table = out.setdefault(k.section, {}) if k.section else out
            table[k.name.rpartition(".")[2]] = plain(k, self.value(k))
        out["source"] = self.source
        return out


def plain(key: Key, value: Any) -> Any:
    """A typed value as TOML writes it."""
    if key.kind is Kind.OCTAL:
        return f"{value:04o}"
    if key.kind is Kind.FORM_SIZES:
        items = value.items() if isinstance(value, Mapping) else value
        return {(f.value if isinstance(f, enum.Enum) else f): n for f, n in items}
    if key.kind is Kind.VERSIONS:
        return {p: dict(fields) for p, fields in value.items()}
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, enum.Enum):
        return value.value
    return value


def build_config(values: Mapping[str, Any], *, mode: str, source: str, mode_why: str) -> DaemonConfig:
    """The records from every key's value (as `parse_document` or `mode_values` gives them)."""
    tables = {name: rec(**{k.attr: values[k.name] for k in section(name)}) for name, rec in RECORDS.items()}
    top = {k.attr: values[k.name] for k in section("") if k.name != "mode"}
    return DaemonConfig(**top, **tables, mode=mode, source=source, mode_why=mode_why)


def mode_values(mode: str, env: Mapping[str, str] | None = None, cwd: Path | None = None) -> dict[str, Any]:
    """Every key's default in a mode (MODES), its paths under that mode's folders: user mode's are ./.kvtier/,
    system mode's are the ones systemd sets for the unit (else /run/kvtier and /var/lib/kvtier)."""
    if mode == "system":
        env = os.environ if env is None else env
        runtime = env.get("RUNTIME_DIRECTORY", str(SYSTEMD_RUNTIME_DIR)).split(":")[0]
        state = env.get("STATE_DIRECTORY", str(SYSTEMD_STATE_DIR)).split(":")[0]
    else:
        runtime = state = str((cwd or Path.cwd()) / ".kvtier")
    out: dict[str, Any] = {}
    for k in KEYS:
        value = fill_dirs(k.default(mode), runtime, state)
        out[k.name] = Path(value) if k.kind is Kind.PATH else value
    return out


def embedded_default(cwd: Path | None = None) -> DaemonConfig:
    """The user mode's defaults: everything under ./.kvtier/, cpu, the ref-tiny profile, small budgets."""
    return build_config(mode_values("user", cwd=cwd), mode="user", source="embedded default", mode_why="the default")


def systemd_default(env: Mapping[str, str]) -> DaemonConfig:
    """The system mode's defaults: the socket in the runtime directory, the store in the state directory."""
    values = mode_values("system", env)
    return build_config(values, mode="system", source="systemd default", mode_why="the default")


def mode_defaults(mode: str, env: Mapping[str, str] | None = None, cwd: Path | None = None) -> DaemonConfig:
    """The defaults of a mode (MODES), before any file."""
    return systemd_default(os.environ if env is None else env) if mode == "system" else embedded_default(cwd)


def choose_mode(flag: str | None, file_mode: Any, env: Mapping[str, str], source: str | None = None) -> tuple[str, str]:
    """(mode, why): `--user`/`--system`, else the file's `mode` key, else $KVTIER_MODE, else the directories
    systemd sets for a unit, else user. Never the uid. A flag that contradicts the file is an error: which
    one was meant cannot be guessed."""
    if file_mode is not None and file_mode not in MODES:
        raise ConfigError(f"must be one of {', '.join(MODES)}; got {file_mode!r}", key="mode", source=source)
    if flag is not None:
        if file_mode is not None and file_mode != flag:
            raise ConfigError(
                f"says {file_mode!r} but --{flag} was given; drop the flag or change the key", key="mode", source=source
            )
        return flag, f"--{flag}"
    if file_mode is not None:
        return file_mode, f"the mode key of {source}"
    if value := env.get(MODE_ENV):
        if value not in MODES:
            raise ConfigError(f"${MODE_ENV} must be one of {', '.join(MODES)}; got {value!r}")
        return value, f"${MODE_ENV}={value}"
    for var in ("RUNTIME_DIRECTORY", "STATE_DIRECTORY"):
        if var in env:
            return "system", f"systemd set ${var} for this unit"
    return "user", "the default: no --user/--system, no mode key, no $KVTIER_MODE"


def load_config(
    path: str | Path | None = None,
    *,
    mode: str | None = None,
    env: Mapping[str, str] | None = None,
    uid: int | None = None,  # accepted from older callers and ignored: the mode never follows the uid
    cwd: Path | None = None,
) -> DaemonConfig:
    """The effective config: `path` (in system mode, /etc/kvtier/kvtier.toml when no path is given and it
    exists) laid over the chosen mode's defaults. `mode` is the command line's --user/--system."""
    del uid
    env = os.environ if env is None else env
    if mode is not None and mode not in MODES:
        raise ConfigError(f"the mode must be one of {', '.join(MODES)}; got {mode!r}")
    data: dict[str, Any] | None = None
    if path is None:
        chosen, _ = choose_mode(mode, None, env)
        if chosen == "system" and SYSTEM_CONFIG.exists():
            path = SYSTEM_CONFIG
    source = str(path) if path is not None else None
    if path is not None:
        data = _read_toml(Path(path))
    file_mode = data.pop("mode", None) if data is not None else None
    chosen, why = choose_mode(mode, file_mode, env, source)
    base = mode_defaults(chosen, env, cwd)
    base = dataclasses.replace(base, mode_why=why)
    if data is None:
        return base
    return config_from_dict(data, base, str(path))


def config_from_dict(data: Mapping[str, Any], base: DaemonConfig, source: str) -> DaemonConfig:
    """Lay a parsed TOML document (its `mode` key already taken) over `base`; unknown keys and bad values are
    ConfigErrors naming the key."""
    values = parse_document(data, base.values(), source)
    try:
        return build_config(values, mode=base.mode, source=source, mode_why=base.mode_why)
    except ConfigError as exc:  # a record's own check (ClusterConfig's) names the key; say which file too
        raise ConfigError(str(exc).removeprefix(f"key '{exc.key}': "), key=exc.key, source=source) from None


def _read_toml(path: Path) -> dict[str, Any]:
    source = str(path)
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError("no such config file; pass --config with an existing TOML file", source=source) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read: {exc}", source=source) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"not valid TOML: {exc}", source=source) from None


def config_text(keys: Mapping[str, Any], *, check: bool = True) -> str:
    """A config file's text from dotted keys, as a file would write them: `{"server.socket": "/x.sock",
    "pool.budget_bytes": {"swa": "64KiB"}}`. With `check`, each key and value is read as a file's would be (an
    unknown key or bad value is the ConfigError the file would get); without, it is written as given (for
    tests that plant a bad one). For scripts and tests that write configs: the schema knows the file's shape."""
    doc: dict[str, Any] = {}
    for name, value in keys.items():
        if check:
            known = BY_NAME.get(name) or DEPRECATED.get(name)
            if known is None:
                raise ConfigError("unknown key (see `kvtier config show` for the known ones)", key=name)
            if known.kind is not Kind.VERSIONS:
                parse_value(known, _toml_value(value), name, None, known.default("user"))
        table, _, leaf = name.rpartition(".")
        target = doc
        for part in table.split(".") if table else ():
            target = target.setdefault(part, {})
        target[leaf] = _toml_value(value)
    return tomli_w.dumps(doc)


def _toml_value(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return [_toml_value(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _toml_value(v) for k, v in value.items()}
    return value


def apply_reloadable(current: DaemonConfig, new: DaemonConfig) -> DaemonConfig:
    """What SIGHUP changes at run time: `current` with the keys the schema marks reloadable taken from `new`
    (the store's budget and per-form quotas, the verifier's rates and sweep interval, the profiles' version
    keys: `versions`, `canary`). Everything else takes a restart."""
    changes: dict[str, dict[str, Any]] = {}
    for k in KEYS:
        if k.reloadable:
            changes.setdefault(k.section, {})[k.attr] = new.value(k)
    top = changes.pop("", {})
    tables = {name: dataclasses.replace(getattr(current, name), **fields) for name, fields in changes.items()}
    return dataclasses.replace(current, **top, **tables)


def reloadable_keys() -> tuple[str, ...]:
    """The dotted names SIGHUP applies (for logs and docs)."""
    return tuple(k.name for k in KEYS if k.reloadable)
