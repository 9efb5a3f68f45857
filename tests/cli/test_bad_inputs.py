"""Bad input, as an operator types it: every command answers with a short message naming what is wrong, a
documented exit code (2 usage / config, 3 no daemon), and never a traceback.

Each row runs `kvtier`'s real entry point (`kvtier.cli.main.main`, what the console script calls) in
this process, for speed, in a folder of prepared bad files; `{d}` in an argument is that folder. The
-v row runs a separate process, as a user would.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtier.cli.main import main
from kvtier.client import Client, LookupResult
from kvtier.core.errors import KvtierError
from kvtier.wire import errors as E
from support.daemon import DaemonProc

USAGE, NO_DAEMON = 2, 3

FILES = {
    "bad-device.toml": 'device = "tpu"\n',
    "bad-key.toml": "bogus = 1\n",
    "bad-syntax.toml": "[store\n",
    "bad-size.toml": '[store]\nbudget_bytes = "lots"\n',
    "bad-mode.toml": '[server]\nsocket_mode = "rw"\n',
    "socket-under-file.toml": 'profiles = ["ref-tiny"]\n[server]\nsocket = "{d}/a-file/kvtier.sock"\n',
    "store-under-file.toml": 'device = "cpu"\n[server]\nsocket = "{d}/k.sock"\n[store]\nroot = "{d}/a-file/store"\n',
    "a-file": "not a directory\n",
    "unknown-profile.toml": 'profiles = ["nope-profile"]\n[server]\nsocket = "{d}/u.sock"\n[store]\nroot = "{d}/u"\n',
    "broken-profile.toml": 'profiles = ["{d}/bad-profile.toml"]\n[server]\nsocket = "{d}/b.sock"\n',
    "not-json.jsonl": "not json\n",
    "no-profile.jsonl": '{"tokens": [1, 2, 3]}\n',
    "bad-ttl.jsonl": '{"profile": "ref-tiny", "tokens": [1, 2, 3], "ttl_s": -1}\n',
    "unknown-key.jsonl": '{"profile": "ref-tiny", "tokens": [1, 2, 3], "pin": true}\n',
    "bad-tokens.jsonl": '{"profile": "ref-tiny", "tokens": [1, -2, 3]}\n',
    "no-tokens.jsonl": '{"profile": "ref-tiny"}\n',
    "missing-token-file.jsonl": '{"profile": "ref-tiny", "token_file": "nope.txt"}\n',
    "bad-profile.toml": "[[group]]\nname = 1\n",
    "both-token-keys.jsonl": '{"profile": "ref-tiny", "tokens": [1], "token_file": "t.txt"}\n',
    "empty.jsonl": "# nothing here\n\n",
    "huge-token.jsonl": '{"profile": "ref-tiny", "tokens": [99999999999999999999999]}\n',
    "good.jsonl": '{"profile": "ref-tiny", "tokens": [1, 2, 3]}\n',
}

# (id, argv, exit code, regex the stderr must match)
CASES = [
    # serve
    ("serve-unknown-key", ["serve", "--config", "{d}/bad-key.toml"], USAGE, r"key 'bogus': unknown key"),
    ("serve-bad-device", ["serve", "--config", "{d}/bad-device.toml"], USAGE, r"key 'device': .*'tpu'"),
    ("serve-bad-toml", ["serve", "--config", "{d}/bad-syntax.toml"], USAGE, r"not valid TOML"),
    ("serve-missing-config", ["serve", "--config", "{d}/nope.toml"], USAGE, r"no such config file"),
    ("serve-bad-size", ["serve", "--config", "{d}/bad-size.toml"], USAGE, r"store.budget_bytes.*byte size"),
    ("serve-bad-socket-mode", ["serve", "--config", "{d}/bad-mode.toml"], USAGE, r"server.socket_mode.*octal"),
    (
        "serve-socket-under-a-file",
        ["serve", "--config", "{d}/socket-under-file.toml"],
        USAGE,
        r"key 'server.socket': cannot use .*a-file: a file, not a folder",
    ),
    (
        "serve-store-under-a-file",
        ["serve", "--config", "{d}/store-under-file.toml"],
        USAGE,
        r"key 'store.root': cannot use .*a-file/store: Not a directory",
    ),
    (
        "serve-unknown-profile",
        ["serve", "--config", "{d}/unknown-profile.toml"],
        USAGE,
        r"key 'profiles': no bundled profile 'nope-profile' \(bundled: ",
    ),
    (
        "serve-broken-profile-toml",
        ["serve", "--config", "{d}/broken-profile.toml"],
        USAGE,
        r"key 'profiles': .*bad-profile.toml: field 'name'",
    ),
    (
        "config-show-unknown-profile",
        ["config", "show", "--config", "{d}/unknown-profile.toml"],
        USAGE,
        r"key 'profiles': no bundled profile",
    ),
    # status
    ("status-no-daemon", ["status", "--socket", "{d}/none.sock"], NO_DAEMON, r"no kvtier daemon on .*none.sock"),
    ("status-socket-is-a-file", ["status", "--socket", "{d}/a-file"], NO_DAEMON, r"no kvtier daemon on .*a-file"),
    ("status-bad-config", ["status", "--config", "{d}/bad-key.toml"], USAGE, r"key 'bogus'"),
    # prewarm: the manifest is checked before any daemon is asked
    ("prewarm-missing-manifest", ["prewarm", "{d}/nope.jsonl"], USAGE, r"cannot read the manifest"),
    ("prewarm-not-json", ["prewarm", "{d}/not-json.jsonl"], USAGE, r"not-json.jsonl:1: not a JSON object"),
    ("prewarm-no-profile", ["prewarm", "{d}/no-profile.jsonl"], USAGE, r"no-profile.jsonl:1: .*'profile'"),
    ("prewarm-bad-ttl", ["prewarm", "{d}/bad-ttl.jsonl"], USAGE, r"bad-ttl.jsonl:1: .*ttl_s.*positive"),
    ("prewarm-unknown-key", ["prewarm", "{d}/unknown-key.jsonl"], USAGE, r"unknown-key.jsonl:1: .*'pin'"),
    ("prewarm-negative-token", ["prewarm", "{d}/bad-tokens.jsonl"], USAGE, r"bad-tokens.jsonl:1: .*got -2"),
    (
        "prewarm-no-tokens",
        ["prewarm", "{d}/no-tokens.jsonl"],
        USAGE,
        r"no-tokens.jsonl:1: give exactly one of 'tokens' and 'token_file'",
    ),
    (
        "prewarm-missing-token-file",
        ["prewarm", "{d}/missing-token-file.jsonl"],
        USAGE,
        r"missing-token-file.jsonl:1: .*cannot read token file",
    ),
    (
        "prewarm-both-token-keys",
        ["prewarm", "{d}/both-token-keys.jsonl"],
        USAGE,
        r"both-token-keys.jsonl:1: give exactly one of 'tokens' and 'token_file'",
    ),
    ("prewarm-empty-manifest", ["prewarm", "{d}/empty.jsonl"], USAGE, r"empty.jsonl: no prompts"),
    ("prewarm-token-too-large", ["prewarm", "{d}/huge-token.jsonl"], USAGE, r"huge-token.jsonl:1: .*0..2\*\*63-1"),
    ("prewarm-no-daemon", ["prewarm", "{d}/good.jsonl", "--socket", "{d}/none.sock"], NO_DAEMON, r"no kvtier daemon"),
    # audit
    ("audit-no-store", ["audit", "--store", "{d}/nostore"], USAGE, r"no kvtier store at .*nostore"),
    ("audit-not-a-store", ["audit", "--store", "{d}"], USAGE, r"no kvtier store at .*index.lmdb"),
    ("audit-store-is-a-file", ["audit", "--store", "{d}/a-file"], USAGE, r"'--store'.*is a file"),
    # no --store: the config's (here the user mode's ./.kvtier/store), which does not exist
    ("audit-default-store-missing", ["audit"], USAGE, r"no kvtier store at .*\.kvtier/store"),
    # verifier
    (
        "verifier-store-never-appears",
        ["verifier", "run", "--store", "{d}/nostore", "--wait-for-store", "0.5"],
        USAGE,
        r"no kvtier store at .*nostore after waiting 0.5s: start the daemon",
    ),
    (
        "verifier-missing-config",
        ["verifier", "run", "--store", "{d}/nostore", "--config", "{d}/nope.toml"],
        USAGE,
        r"nope.toml: no such config file",
    ),
    ("verifier-bad-rate", ["verifier", "run", "--store", "{d}", "--rate", "fast"], USAGE, r"'--rate'.*not a valid"),
    ("verifier-status-no-store", ["verifier", "status", "--store", "{d}/nostore"], USAGE, r"no kvtier store at"),
    # store
    ("store-stats-not-a-store", ["store", "stats", "--store", "{d}"], USAGE, r"no index at"),
    ("store-stats-no-store", ["store", "stats", "--store", "{d}/nostore"], USAGE, r"no index at .*nostore"),
    ("store-rebuild-not-a-store", ["store", "rebuild-index", "--store", "{d}"], USAGE, r"no segments/ directory"),
    ("store-unknown-command", ["store", "compact"], USAGE, r"No such command 'compact'"),
    # profile
    ("profile-unknown-name", ["profile", "show", "nope"], USAGE, r"no bundled profile 'nope' \(bundled: "),
    ("profile-bad-toml", ["profile", "show", "{d}/bad-profile.toml"], USAGE, r"bad-profile.toml: field 'name'"),
    ("profile-missing-file", ["profile", "show", "{d}/nope.toml"], USAGE, r"nope.toml: no such profile file"),
    # config
    ("config-unknown-key", ["config", "show", "--config", "{d}/bad-key.toml"], USAGE, r"key 'bogus': unknown key"),
    ("config-bad-toml", ["config", "show", "--config", "{d}/bad-syntax.toml"], USAGE, r"not valid TOML"),
    ("config-missing-file", ["config", "show", "--config", "{d}/nope.toml"], USAGE, r"no such config file"),
    # explain
    ("explain-no-prompt", ["explain"], USAGE, r"--tokens FILE or as --manifest-line N MANIFEST"),
    ("explain-missing-token-file", ["explain", "--tokens", "{d}/nope.txt"], USAGE, r"cannot read token file"),
    (
        "explain-manifest-line-blank",
        ["explain", "--manifest-line", "5", "{d}/good.jsonl"],
        USAGE,
        r"no prompt on line 5",
    ),
    (
        "explain-no-daemon",
        ["explain", "--manifest-line", "1", "{d}/good.jsonl", "--socket", "{d}/none.sock"],
        NO_DAEMON,
        r"no kvtier daemon on",
    ),
    # the demo and the command line itself
    ("demo-too-few-tokens", ["demo", "--tokens", "10"], USAGE, r"'--tokens'.*range"),
    ("unknown-command", ["frobnicate"], USAGE, r"No such command 'frobnicate'"),
]


@pytest.fixture(scope="module")
def bad_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("bad")
    for name, text in FILES.items():
        (d / name).write_text(text.replace("{d}", str(d)))
    return d


def main_in_process(
    args: list[str], cwd: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> subprocess.CompletedProcess[str]:
    """The console script's entry point with `args`: its exit code and what it wrote."""
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", ["kvtier", *args])
    for name in ("KVTIER_CONFIG", "KVTIER_SOCKET"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as exited:
        main()
    out = capsys.readouterr()
    code = exited.value.code
    return subprocess.CompletedProcess(args, code if isinstance(code, int) else 1, out.out, out.err)


def run_kvtier(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("KVTIER_CONFIG", "KVTIER_SOCKET")}
    return subprocess.run(
        [sys.executable, "-m", "kvtier.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        timeout=120,
    )


def assert_short_error(proc: subprocess.CompletedProcess[str], code: int, pattern: str) -> None:
    err = proc.stderr
    assert proc.returncode == code, f"exit {proc.returncode}, wanted {code}:\n{err}"
    assert "Traceback" not in err, err
    assert len(err.strip().splitlines()) <= 5, err
    assert re.search(pattern, err), f"{pattern!r} not in:\n{err}"


@pytest.mark.parametrize(("args", "code", "pattern"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_gets_a_short_error(
    bad_dir: Path,
    args: list[str],
    code: int,
    pattern: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    proc = main_in_process([a.replace("{d}", str(bad_dir)) for a in args], bad_dir, monkeypatch, capsys)
    assert_short_error(proc, code, pattern)


def test_the_table_covers_every_operator_command() -> None:
    covered = {c[1][0] for c in CASES}
    assert covered >= {"serve", "status", "prewarm", "audit", "verifier", "store", "profile", "config"}
    assert len(CASES) >= 30


def test_verbose_adds_the_traceback(bad_dir: Path) -> None:
    """-v is the way to get the traceback (for a bug report); the one-line message still ends the output."""
    proc = run_kvtier(["-v", "verifier", "run", "--store", str(bad_dir / "nostore"), "--wait-for-store", "0"], bad_dir)
    assert proc.returncode == USAGE and "Traceback" in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("kvtier: no kvtier store at")


# -- the client API: kvtier's typed errors with a one-line message, never Python internals ----------------------

H = 32  # ref-tiny's hash block
PROMPT = np.arange(4 * H, dtype=np.int64)

CLIENT_CASES = [
    ("lookup-a-string", lambda c, r: c.lookup("hello"), E.WrongType, r"tokens must be token ids .* got str"),
    ("lookup-none", lambda c, r: c.lookup(None), E.WrongType, r"tokens must be token ids .* got NoneType"),
    ("lookup-2d", lambda c, r: c.lookup(np.zeros((2, 64), dtype=np.int64)), E.WrongType, r"one-dimensional"),
    ("lookup-floats", lambda c, r: c.lookup([0.5, 1.5]), E.WrongType, r"integer token ids, got float64"),
    ("read-unknown-group", lambda c, r: c.read(r, "no_such_group", 0), E.WrongType, r"no cache group 'no_such_group'"),
    ("read-block-out-of-range", lambda c, r: c.read(r, "c4", 99), E.BadRange, r"block 99 is outside .* 4 blocks"),
    ("read-not-a-lookup", lambda c, r: c.read("r", "c4", 0), E.WrongType, r"LookupResult of lookup\(\), got str"),
    ("offload-a-list", lambda c, r: c.offload(PROMPT, [1, 2]), E.WrongType, r"caches must map group name"),
    (
        "offload-not-a-tensor",
        lambda c, r: c.offload(PROMPT, {"c4": {0: [1, 2]}}),
        E.WrongType,
        r"c4: each block's object must be a torch.Tensor, got list",
    ),
    (
        "offload-block-out-of-range",
        lambda c, r: c.offload(PROMPT, {"c4": {9: torch.zeros(8)}}),
        E.BadRange,
        r"c4: block indices must be within the 4 whole blocks",
    ),
    ("attach-unknown-profile", lambda c, r: _attach_anew(c, "nope"), KvtierError, r"not 'nope'.*`profiles`"),
    ("attach-twice", lambda c, r: c.attach("ref-tiny"), E.OutOfOrder, r"already attached to 'ref-tiny'"),
]


def _attach_anew(client: Client, profile: str) -> None:
    with Client(client.socket_path) as other:
        other.attach(profile)


@pytest.fixture(scope="module")
def attached(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Client, LookupResult]]:
    d = DaemonProc(tmp_path_factory.mktemp("daemon"))
    try:
        with Client(d.socket, name="bad inputs") as c:
            c.attach("ref-tiny")
            result = c.lookup(PROMPT)
            yield c, result
    finally:
        d.close()


@pytest.mark.parametrize(("call", "error", "pattern"), [c[1:] for c in CLIENT_CASES], ids=[c[0] for c in CLIENT_CASES])
def test_client_api_mistakes_raise_typed_errors(attached, call, error: type[Exception], pattern: str) -> None:
    client, result = attached
    with pytest.raises(error) as raised:
        call(client, result)
    message = str(raised.value)
    assert isinstance(raised.value, KvtierError) and "\n" not in message and re.search(pattern, message), message


def test_client_use_after_close(attached) -> None:
    client, _ = attached
    with Client(client.socket_path) as other:
        other.attach("ref-tiny")
    with pytest.raises(E.OutOfOrder, match="is closed; open a new one"):
        other.lookup(PROMPT)
    with pytest.raises(E.OutOfOrder, match="attach\\(profile\\) first"):
        Client(client.socket_path).lookup(PROMPT)


def test_the_tables_hold_at_least_thirty_bad_inputs() -> None:
    assert len(CASES) + len(CLIENT_CASES) >= 30
