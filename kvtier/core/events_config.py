"""The `[events]` settings: where the daemon publishes the blocks it holds, in vLLM's KV-events wire format.

In `core` because the daemon's config (`kvtier.core.config`) holds them (keys: `kvtier.core.config_schema`);
`kvtier.daemon.events` runs on them.
Off by default: an empty `endpoint` publishes nothing and opens no socket (docs/events.md).
"""

from __future__ import annotations

import dataclasses
import re

from kvtier.core.config_schema import default
from kvtier.core.errors import ConfigError

# tcp://HOST:PORT (HOST may be * to bind every address), ipc://PATH or inproc://NAME: what ZeroMQ binds
_ENDPOINT = re.compile(r"(tcp://(\*|[\w.\-]+|\[[0-9a-fA-F:.]+\]):\d{1,5}|ipc://.+|inproc://.+)")


@dataclasses.dataclass(frozen=True, slots=True)
class EventsConfig:
    """The KV-events publisher: a ZeroMQ PUB socket and, optionally, a ROUTER socket for replays."""

    endpoint: str = default("events.endpoint")  # "" publishes nothing (vLLM's own default is tcp://*:5557)
    topic: str = default("events.topic")
    replay_endpoint: str = default("events.replay_endpoint")  # "" serves no replays
    buffer_steps: int = default("events.buffer_steps")
    hwm: int = default("events.hwm")
    max_queue: int = default("events.max_queue")

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
