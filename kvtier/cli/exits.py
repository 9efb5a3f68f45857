"""The one table of exit codes every `kvtier` command uses, and which exit each wire error code leads to.

The wire layer (`kvtier.wire.errors`) carries error codes only; what a command exits with is CLI policy and
lives here. docs/cli.md's exit-code table is `markdown_table()` of this module (a test holds them equal).
"""

from __future__ import annotations

import dataclasses
import signal

from kvtier.core.errors import KvtierError

OK = 0
PROBLEMS = 1  # the command ran and found problems: audit, a degraded status, a failed demo
USAGE = 2  # a bad option, file, value or path
NO_DAEMON = 3
NOT_ANSWERING = 4  # a daemon is there but did not answer us: permission denied, busy, timed out
STARTING = 5  # a daemon is starting on that socket (its store, or its pools behind serving): `status` again shortly
INTERNAL = 70  # a bug: rerun with -v for the traceback


def signalled(signum: int) -> int:
    """The shell's convention for a command that stopped on a signal: 128 + its number."""
    return 128 + signum


INTERRUPTED = signalled(signal.SIGINT)

# Every error code of kvtier.wire.errors -> the exit a command takes when that error reaches it. A code the
# table does not name (another component's typed error, or a daemon's error frame the client has no class
# for) is a usage or config error: the message of a typed error says what to change.
WIRE_EXITS: dict[str, int] = {
    "bad_frame": USAGE,
    "frame_too_large": USAGE,
    "unknown_op": USAGE,
    "wrong_type": USAGE,
    "unsupported_version": USAGE,
    "bad_range": USAGE,
    "out_of_order": USAGE,
    "no_pools": USAGE,
    "daemon_unavailable": NO_DAEMON,
    "permission_denied": NOT_ANSWERING,
    "daemon_timeout": NOT_ANSWERING,
    "busy": NOT_ANSWERING,
}


def for_error(exc: KvtierError) -> int:
    """The exit code for a typed error that ends a command (its `code` looked up in WIRE_EXITS)."""
    return WIRE_EXITS.get(exc.code, USAGE)


@dataclasses.dataclass(frozen=True, slots=True)
class ExitRow:
    """One row of the documented table: the codes and what they mean to the user."""

    codes: tuple[int, ...]
    meaning: str

    def wire_codes(self) -> list[str]:
        return sorted(c for c, e in WIRE_EXITS.items() if e in self.codes)


TABLE: tuple[ExitRow, ...] = (
    ExitRow((OK,), "done"),
    ExitRow(
        (PROBLEMS,),
        "the command ran and found problems: `audit` found corruption or orphaned bytes, `status` is degraded, "
        "`demo` failed its checks, `verifier status` finds no verifier running, `doctor` has a failed check",
    ),
    ExitRow(
        (USAGE,),
        "a usage or config error: a bad option, file, value or path (a missing store included), or a request "
        "the daemon refused (a malformed frame, an operation it does not allow)",
    ),
    ExitRow((NO_DAEMON,), "no daemon answers on the socket (`status`, `prewarm`, `explain`, `namespace`)"),
    ExitRow((NOT_ANSWERING,), "a daemon is there but did not answer us: permission denied, busy, or timed out"),
    ExitRow(
        (STARTING,),
        (
            "`status`: a daemon is starting on that socket (opening its store, or serving it while its pools "
            "allocate); ask again shortly"
        ),
    ),
    ExitRow((INTERNAL,), "an internal error: a bug; rerun with `-v` and report the traceback"),
    ExitRow(
        (INTERRUPTED,),
        "interrupted (`prewarm` first reports the prefixes it finished and how many objects stay pinned)",
    ),
    ExitRow(
        (signalled(signal.SIGHUP), signalled(signal.SIGTERM)),
        "`demo` stopped by SIGHUP or SIGTERM: like Ctrl-C (130), it first stops the daemon it started and "
        "removes its temporary folder",
    ),
)


def markdown_table() -> str:
    """TABLE as docs/cli.md shows it: exit, meaning, and the wire error codes that lead to it."""
    lines = ["| exit | meaning | wire error codes |", "| --- | --- | --- |"]
    for row in TABLE:
        wire = ", ".join(f"`{c}`" for c in row.wire_codes())
        lines.append(f"| {', '.join(map(str, row.codes))} | {row.meaning} | {wire} |")
    return "\n".join(lines)
