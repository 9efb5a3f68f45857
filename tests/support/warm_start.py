"""`kvtier` commands and the tests' engine processes run as forks of a per-worker server that has already imported
torch and kvtier.

Why: `import torch` is most of what a `kvtier serve` start costs (several CPU-seconds on a slow core, against well
under one for everything else), and the main suite starts about a hundred daemons and a few dozen engine processes
(`support.engine_proc`, `support.workload`). Paid once per xdist worker instead, it stops being what the suite's wall
time is made of.

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
import importlib
import multiprocessing
import multiprocessing.context
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from multiprocessing import reduction
from pathlib import Path
from typing import Any, TextIO

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


class _ChildFd:
    """One end of a pipe for the fork: pickled as multiprocessing's DupFd, so the forkserver hands the fork a copy."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[object, tuple[object]]:
        return (_detach, (reduction.DupFd(self.fd),))


def _detach(dup: Any) -> int:
    return int(dup.detach())


def _run(entry: str, argv: list[str], env: dict[str, str], cwd: str, stdio: list[int] | str) -> None:
    """In the fork: become `ENTRY ARGV` (module:function; the function reads sys.argv) started in `cwd` with `env`;
    `stdio` the fds for stdin, stdout and stderr, or a file that stdout and stderr append to."""
    if isinstance(stdio, str):
        fd = os.open(stdio, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        stdio = [-1, fd, fd]
    for target, fd in enumerate(stdio):
        if fd >= 0:
            os.dup2(fd, target)
    for fd in set(stdio) - {-1, 0, 1, 2}:
        os.close(fd)
    if stdio[0] >= 0:
        sys.stdin = open(0, closefd=False)  # noqa: SIM115  (fd 0 for the process's lifetime)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115  (as stdin)
    sys.stderr = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")  # noqa: SIM115
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    for sig, disposition in _FRESH_DISPOSITIONS.items():
        signal.signal(sig, disposition)
    module, _, function = entry.partition(":")
    sys.argv = [module, *argv]
    try:
        getattr(importlib.import_module(module), function)()
    finally:
        atexit._run_exitfuncs()  # what a fresh interpreter runs at exit; multiprocessing's child ends in os._exit


class WarmProc:
    """`ENTRY ARGV` forked from the worker's warm server; Popen's interface as far as the tests use it. Its output
    goes to the file `out` (stdout and stderr, appended), or with `out=None` to text pipes (stdin, stdout, stderr)."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: Path,
        out: Path | None,
        entry: str = "kvtier.cli.main:main",
    ) -> None:
        self.args = [entry, *argv]
        self.stdin: TextIO | None = None
        self.stdout: TextIO | None = None
        self.stderr: TextIO | None = None
        stdio: list[_ChildFd] | str
        if out is None:
            pipes = [os.pipe() for _ in range(3)]
            stdio = [_ChildFd(pipes[0][0]), _ChildFd(pipes[1][1]), _ChildFd(pipes[2][1])]
        else:
            stdio = str(out)
        # daemon=True: a test that never stops it does not hold its worker's exit (multiprocessing joins the others)
        self._proc = forkserver().Process(
            target=_run, args=(entry, list(argv), dict(env), str(cwd), stdio), daemon=True
        )
        try:
            self._proc.start()
        finally:
            if out is None:  # the fork has its copies now (the server closes the ones it passed on)
                for fd in (pipes[0][0], pipes[1][1], pipes[2][1]):
                    os.close(fd)
        if out is None:
            self.stdin = open(pipes[0][1], "w", buffering=1)  # noqa: SIM115  (closed by communicate or the GC)
            self.stdout = open(pipes[1][0])  # noqa: SIM115
            self.stderr = open(pipes[2][0])  # noqa: SIM115
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

    def communicate(self, input: str | None = None, timeout: float | None = None) -> tuple[str, str]:
        """Popen.communicate for the pipes: write `input`, close stdin, read stdout and stderr to their ends (each on
        its own thread, so a full pipe never blocks the other) while waiting for the exit."""
        assert self.stdin is not None and self.stdout is not None and self.stderr is not None
        if input:
            self.stdin.write(input)
        self.stdin.close()
        got: dict[str, str] = {}
        readers = [
            threading.Thread(target=lambda k=k, f=f: got.__setitem__(k, f.read()), daemon=True)
            for k, f in (("out", self.stdout), ("err", self.stderr))
        ]
        for r in readers:
            r.start()
        self.wait(timeout)
        for r in readers:
            r.join()
        return got["out"], got["err"]

    def send_signal(self, sig: int) -> None:
        if self._proc.exitcode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
