"""The exit codes every `kvtier` command uses (the entry point's docstring says when)."""

OK = 0
PROBLEMS = 1  # the command ran and found problems: audit, a degraded status, a failed demo
USAGE = 2  # a bad option, file, value or path
NO_DAEMON = 3
NOT_ANSWERING = 4  # a daemon is there but did not answer us: permission denied, busy, timed out
STARTING = 5  # a daemon is starting on that socket (allocating its pools): `status` again shortly
INTERNAL = 70  # a bug: rerun with -v for the traceback
INTERRUPTED = 130
