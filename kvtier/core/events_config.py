"""The `[events]` settings: where the daemon publishes the blocks it holds, in vLLM's KV-events wire format.

In `core` because the daemon's config (`kvtier.core.config`) parses them; `kvtier.daemon.events` runs on them.
Off by default: an empty `endpoint` publishes nothing and opens no socket (docs/events.md).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from kvtier.core.errors import ConfigError

# tcp://HOST:PORT (HOST may be * to bind every address), ipc://PATH or inproc://NAME: what ZeroMQ binds
_ENDPOINT = re.compile(r"(tcp://(\*|[\w.\-]+|\[[0-9a-fA-F:.]+\]):\d{1,5}|ipc://.+|inproc://.+)")


@dataclasses.dataclass(frozen=True, slots=True)
class EventsConfig:
    """The KV-events publisher: a ZeroMQ PUB socket and, optionally, a ROUTER socket for replays."""

    endpoint: str = ""  # "" publishes nothing; the publisher binds it (vLLM's default is tcp://*:5557)
    topic: str = ""  # the first frame of every message; subscribers filter on its prefix
    replay_endpoint: str = ""  # "" serves no replays; else a ROUTER bound here answers "from sequence N"
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # ZeroMQ high-water mark of the PUB socket (messages queued per slow subscriber)
    max_queue: int = 100_000  # batches waiting for the publisher thread; beyond it a batch is dropped (counted)

    def __post_init__(self) -> None:
        for key in ("endpoint", "replay_endpoint"):
            value = getattr(self, key)
            if value and not _ENDPOINT.fullmatch(value):
                raise ConfigError(
                    f"must be tcp://HOST:PORT (HOST * binds every address), ipc://PATH or inproc://NAME, got {value!r}",
                    key=f"events.{key}",
                )
        if self.replay_endpoint and not self.endpoint:
            raise ConfigError(
                "needs events.endpoint set too (replays repeat what was published)", key="events.replay_endpoint"
            )
        if self.replay_endpoint and self.replay_endpoint == self.endpoint:
            raise ConfigError("must differ from events.endpoint", key="events.replay_endpoint")
        for key in ("buffer_steps", "hwm", "max_queue"):
            if getattr(self, key) < 1:
                raise ConfigError(f"must be >= 1, got {getattr(self, key)}", key=f"events.{key}")

    @property
    def enabled(self) -> bool:
        return bool(self.endpoint)


def parse_events(table: Any, base: EventsConfig, source: str) -> EventsConfig:
    """The `[events]` table laid over `base`; unknown keys and bad values are ConfigErrors naming the key."""
    if not isinstance(table, Mapping):
        raise ConfigError("must be a table", key="events", source=source)
    values: dict[str, Any] = {}
    for field in dataclasses.fields(EventsConfig):
        value = table.get(field.name, getattr(base, field.name))
        want = type(getattr(base, field.name))
        if isinstance(value, bool) or not isinstance(value, want):
            raise ConfigError(
                f"must be {'a string' if want is str else 'an integer'}, got {value!r}",
                key=f"events.{field.name}",
                source=source,
            )
        values[field.name] = value
    unknown = sorted(set(table) - set(values))
    if unknown:
        raise ConfigError(
            "unknown key (misspelt? see `kvtier config show` for the known ones)",
            key=f"events.{unknown[0]}",
            source=source,
        )
    try:
        return EventsConfig(**values)
    except ConfigError as exc:  # EventsConfig names the key; say which file too
        raise ConfigError(str(exc).removeprefix(f"key '{exc.key}': "), key=exc.key, source=source) from None
