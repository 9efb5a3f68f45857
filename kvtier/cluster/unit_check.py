"""Would the installed systemd unit let this node reach its cluster? `IPAddressAllow=` / `IPAddressDeny=` of
kvtier.service (and its drop-ins) against the endpoints `[cluster]` names.

systemd filters a unit's sockets by address: a packet whose peer matches an allow entry passes, else one that
matches a deny entry is dropped (connect() fails with EPERM), else it passes. The shipped unit denies `any`
and allows `localhost`, so a node installed from it never reaches a remote master; the daemon would keep
"connecting in the background". `kvtier config show` (and `kvtier doctor`) call `unit_blocks` to say so.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import socket
import urllib.parse
from collections.abc import Callable, Sequence
from pathlib import Path

from kvtier.core.cluster_config import ClusterConfig

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address

UNIT = "kvtier.service"
# Where systemd looks for a system unit, most specific first (the first that has the unit file wins; drop-ins
# from every one of them apply, ordered by file name).
UNIT_DIRS = (
    "etc/systemd/system",
    "run/systemd/system",
    "usr/local/lib/systemd/system",
    "usr/lib/systemd/system",
    "lib/systemd/system",
)

_SPECIAL: dict[str, tuple[str, ...]] = {
    "any": ("0.0.0.0/0", "::/0"),
    "localhost": ("127.0.0.0/8", "::1/128"),
    "link-local": ("169.254.0.0/16", "fe80::/64"),
    "multicast": ("224.0.0.0/4", "ff00::/8"),
}


@dataclasses.dataclass(frozen=True, slots=True)
class AddressPolicy:
    """A unit's effective IPAddressAllow= / IPAddressDeny= lists, and the files they came from."""

    allow: tuple[Network, ...]
    deny: tuple[Network, ...]
    files: tuple[Path, ...]

    def permits(self, address: Address) -> bool:
        if any(address in net for net in self.allow if net.version == address.version):
            return True
        return not any(address in net for net in self.deny if net.version == address.version)


@dataclasses.dataclass(frozen=True, slots=True)
class BlockedEndpoint:
    """One `[cluster]` endpoint the unit would not let the daemon reach (or could not be checked)."""

    role: str  # "master", "etcd", "metadata", "admin"
    endpoint: str  # host:port as configured
    address: str  # the address checked ("" when the host did not resolve)
    why: str

    def line(self) -> str:
        return f"{self.role} {self.endpoint}: {self.why}"


def _networks(value: str) -> list[Network]:
    out: list[Network] = []
    for word in value.split():
        for entry in _SPECIAL.get(word, (word,)):
            try:
                out.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                continue  # systemd ignores (and logs) an entry it cannot parse
    return out


def parse_policy(texts: Sequence[tuple[Path, str]]) -> AddressPolicy:
    """The effective lists of a unit file followed by its drop-ins, in order: an empty assignment resets a list."""
    lists: dict[str, list[Network]] = {"IPAddressAllow": [], "IPAddressDeny": []}
    section = ""
    for _path, text in texts:
        for raw in text.splitlines():
            line = raw.strip()
            if not line or line[0] in "#;":
                continue
            if line.startswith("["):
                section = line
                continue
            key, sep, value = line.partition("=")
            key = key.strip()
            if section != "[Service]" or not sep or key not in lists:
                continue
            if not value.strip():
                lists[key] = []
            else:
                lists[key].extend(_networks(value))
    return AddressPolicy(tuple(lists["IPAddressAllow"]), tuple(lists["IPAddressDeny"]), tuple(p for p, _ in texts))


def installed_unit(root: Path = Path("/"), unit: str = UNIT) -> list[tuple[Path, str]]:
    """The installed unit file and its drop-ins (path, text), in the order systemd applies them; [] if none."""
    main: Path | None = None
    dropins: dict[str, Path] = {}
    for d in UNIT_DIRS:
        base = root / d
        if main is None and (base / unit).is_file():
            main = base / unit
        for conf in sorted((base / f"{unit}.d").glob("*.conf")) if (base / f"{unit}.d").is_dir() else ():
            dropins.setdefault(conf.name, conf)  # the same name in a more specific folder wins
    if main is None:
        return []
    return [(p, p.read_text(errors="replace")) for p in [main, *(dropins[n] for n in sorted(dropins))]]


def cluster_endpoints(cfg: ClusterConfig) -> list[tuple[str, str]]:
    """(role, host:port) of every endpoint this node connects to that `[cluster]` names. The holders' addresses
    are not in the config (the master hands them out): a unit must allow them too (docs/systemd.md)."""
    out = [("etcd", e.strip()) for e in cfg.etcd.split(";") if e.strip()] if cfg.etcd else [("master", cfg.master)]
    url = urllib.parse.urlsplit(cfg.metadata)
    if url.scheme in ("http", "etcd") and url.netloc:
        out.append(("metadata", url.netloc))
    out += [("admin", urllib.parse.urlsplit(a.strip()).netloc) for a in cfg.admin.split(";") if a.strip()]
    return [(r, e) for r, e in out if e]


def _resolve(host: str) -> list[str]:
    try:
        return sorted({str(info[4][0]) for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)})
    except OSError:
        return []


def unit_blocks(
    cfg: ClusterConfig,
    unit: Sequence[tuple[Path, str]] | None = None,
    resolve: Callable[[str], list[str]] = _resolve,
) -> list[BlockedEndpoint]:
    """The `[cluster]` endpoints the unit's address policy would block; [] when the cluster is off, when no
    unit is installed (`unit` None: the installed kvtier.service and drop-ins are read), or when all pass."""
    if not cfg.enabled:
        return []
    texts = installed_unit() if unit is None else list(unit)
    if not texts:
        return []
    policy = parse_policy(texts)
    out: list[BlockedEndpoint] = []
    for role, endpoint in cluster_endpoints(cfg):
        host = endpoint.rpartition(":")[0].strip("[]") or endpoint
        try:
            addresses = [ipaddress.ip_address(host)]
        except ValueError:
            addresses = [ipaddress.ip_address(a.split("%")[0]) for a in resolve(host)]
            if not addresses:
                out.append(BlockedEndpoint(role, endpoint, "", f"{host} does not resolve here: cannot check the unit"))
                continue
        for address in addresses:
            if not policy.permits(address):
                files = ", ".join(str(p) for p in policy.files)
                out.append(
                    BlockedEndpoint(
                        role,
                        endpoint,
                        str(address),
                        f"{address} is denied by IPAddressDeny= in {files}: add it (or the cluster's network) to "
                        "IPAddressAllow= in a drop-in (docs/systemd.md, 'A cluster node')",
                    )
                )
    return out
