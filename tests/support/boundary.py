"""Mechanics of the process-boundary faults (issue 18), shared by tests/daemon/test_boundary.py,
tests/daemon/test_reply_ids.py and the fault matrix: a client process that writes into a sealed slot
through its mapping, a client process that reserves a prefix's slots and never seals them, a pool
filled until a reader's expired lease loses its slot, and a daemon frozen with SIGSTOP.

Run as a script it is one of those client processes:
`boundary.py write SOCKET TOKENS.npy GROUP BLOCK` maps the pool and writes into the sealed slot of
(GROUP, BLOCK) of the prefix (a fault: prints "mapped" and never "wrote");
`boundary.py reserve SOCKET TOKENS.npy GROUP[,GROUP...]` reserves every block of those groups,
prints how many slots it got and waits on stdin ("mid-copy") until stopped or killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from kvtier.client import Client, LookupResult
from support.daemon import DaemonProc, child_env
from support.procs import process_state

SCRIPT = str(Path(__file__).resolve())
TESTS = str(Path(__file__).resolve().parents[1])


def write_into_sealed_slot(socket: Path, tokens: np.ndarray, group: str, block: int, work: Path) -> None:
    """A client process writes into a sealed slot through its mapping: the write must fault (SIGSEGV)."""
    path = work / f"written-{os.getpid()}-{time.monotonic_ns()}.npy"
    np.save(path, tokens)
    proc = subprocess.run(
        [sys.executable, SCRIPT, "write", str(socket), str(path), group, str(block)],
        env=child_env(PYTHONPATH=TESTS),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "mapped" in proc.stdout and "wrote" not in proc.stdout, proc.stderr
    assert proc.returncode == -signal.SIGSEGV, (proc.returncode, proc.stderr)


def start_reserver(socket: Path, tokens: np.ndarray, groups: list[str], work: Path) -> tuple[subprocess.Popen, int]:
    """A client process that reserved every block of `groups` of the prefix and is "mid-copy"; with the
    number of slots it got."""
    path = work / f"reserved-{time.monotonic_ns()}.npy"
    np.save(path, tokens)
    proc = subprocess.Popen(
        [sys.executable, SCRIPT, "reserve", str(socket), str(path), ",".join(groups)],
        env=child_env(PYTHONPATH=TESTS),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def fill_until_stale(
    fill: Callable[[int], object], reader: Client, result: LookupResult, group: str, block: int, timeout_s: float = 30
) -> int:
    """Call `fill(seed)` (another engine offloading other prefixes) until the reader's lease on (group,
    block) no longer holds: it stopped renewing, the lease expired and the slot was reused. Returns the
    number of fills."""
    deadline = time.monotonic() + timeout_s
    n = 0
    while reader.valid(result, group, block):
        assert time.monotonic() < deadline, "an expired lease kept its slot while another engine filled the pool"
        fill(1000 + n)
        n += 1
    return n


@contextmanager
def frozen(d: DaemonProc) -> Iterator[None]:
    """The daemon stopped (SIGSTOP is delivered asynchronously: wait until the kernel says it is stopped)."""
    os.kill(d.proc.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while process_state(d.proc.pid) != "T":
        assert time.monotonic() < deadline, "the daemon did not stop"
        time.sleep(0.005)  # polling a condition with a deadline
    try:
        yield
    finally:
        os.kill(d.proc.pid, signal.SIGCONT)


def _write(socket: str, tokens: np.ndarray, group: str, block: int) -> None:
    with Client(socket) as c:
        c.attach("ref-tiny")
        view = c.read(c.lookup(tokens), group, block)
        print("mapped", flush=True)
        view.view(-1)[:8].fill_(0)  # a buggy engine writes into a sealed slot through its mapping
        print("wrote", flush=True)


def _reserve(socket: str, tokens: np.ndarray, groups: list[str]) -> None:
    from kvtier.wire import messages as P

    c = Client(socket)
    c.attach("ref-tiny")
    hashes = c.hashes(tokens)
    n_blocks = len(tokens) // c.attachment.hash_block_tokens
    reply = c._call(P.Offload(hashes, groups, [list(range(n_blocks))] * len(groups)))
    print(sum(s >= 0 for row in reply.slots for s in row), flush=True)
    sys.stdin.read()  # "mid-copy" until stopped or killed


if __name__ == "__main__":
    role, sock, tokens_path, *rest = sys.argv[1:]
    ids = np.load(tokens_path)
    if role == "write":
        _write(sock, ids, rest[0], int(rest[1]))
    else:
        _reserve(sock, ids, rest[0].split(","))
