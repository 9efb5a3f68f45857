"""`kvtier` commands run as forks of a per-worker server that has already imported torch and kvtier.

Why: `import torch` is most of what a `kvtier serve` start costs (several CPU-seconds on a slow core, against well
under one for everything else), and the main suite starts about a hundred daemons. Paid once per xdist worker
instead, it stops being what the suite's wall time is made of.

What such a process runs is the command itself, `kvtier.cli.main.main()`, with the argv, environment, working
directory, signal dispositions and stdout/stderr that a fresh `python -m kvtier.cli ...` gets, in a process of its
own: its own pid, signals, exit status, sockets and memory. What it skips is the interpreter's start and the imports.
The tests about those start fresh interpreters (`DaemonProc(fresh=True)`): the daemon's start-up order (it listens
before torch has loaded; SIGTERM during torch's warm-up; serving the store while pools allocate). So do the README's
commands and `kvtier demo`, which starts its own daemons, and the systemd recipe.

`WarmProc` answers the part of `subprocess.Popen` the tests use (pid, poll, wait, send_signal, terminate, kill,
returncode), with Popen's exit statuses: the command's exit code, or -N after a death by signal N. The server is
multiprocessing's forkserver: single-threaded when it forks, so no lock another thread held is copied locked.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

_CTX = multiprocessing.get_context("forkserver")
# What `kvtier serve` imports before it serves (a module missing here is imported by each fork, as before).
_PRELOAD = ["torch", "kvtier.cli.main", "kvtier.daemon.service", "kvtier.daemon.backend", __name__]


def forkserver(*modules: str) -> multiprocessing.context.ForkServerContext:
    """The worker's forkserver (multiprocessing keeps one a process, shared by every user of it), its preload grown by
    `modules`. What is asked for before the server's first fork is imported once, in the server; a module asked for
    later is imported by each fork itself. Harnesses that fork other processes from it (the vLLM engines) ask for
    theirs at import, before any test starts one."""
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)
    _CTX.set_forkserver_preload(list(_PRELOAD))
    return _CTX


forkserver()

# A fresh interpreter's dispositions (Python sets SIGINT's handler, ignores SIGPIPE and SIGXFSZ); the forkserver
# leaves its own (SIGINT ignored, a SIGCHLD handler) in its children.
_FRESH_DISPOSITIONS = {
    signal.SIGINT: signal.default_int_handler,
    signal.SIGPIPE: signal.SIG_IGN,
    signal.SIGXFSZ: signal.SIG_IGN,
    signal.SIGCHLD: signal.SIG_DFL,
    signal.SIGTERM: signal.SIG_DFL,
    signal.SIGHUP: signal.SIG_DFL,
}


def _run(argv: list[str], env: dict[str, str], cwd: str, out: str) -> None:
    """In the fork: become `kvtier ARGV` started in `cwd` with `env`, stdout and stderr appended to `out`."""
    fd = os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115  (fd 1 for the process's lifetime)
    sys.stderr = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")  # noqa: SIM115
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    for sig, disposition in _FRESH_DISPOSITIONS.items():
        signal.signal(sig, disposition)
    sys.argv = ["kvtier", *argv]
    from kvtier.cli.main import main

    try:
        main()
    finally:
        atexit._run_exitfuncs()  # what a fresh interpreter runs at exit; multiprocessing's child ends in os._exit


class WarmProc:
    """`kvtier ARGV` forked from the worker's warm server; Popen's interface as far as the tests use it."""

    def __init__(self, argv: Sequence[str], *, env: Mapping[str, str], cwd: Path, out: Path) -> None:
        self.args = ["kvtier", *argv]
        # daemon=True: a test that never stops it does not hold its worker's exit (multiprocessing joins the others)
        self._proc = forkserver().Process(target=_run, args=(list(argv), dict(env), str(cwd), str(out)), daemon=True)
        self._proc.start()
        assert self._proc.pid is not None
        self.pid: int = self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        code = self._proc.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self._proc.exitcode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
