"""README.md is for users and holds only what is true of the code: at most 200 lines; its two set-up commands are
the ones that work (the main job runs exactly as written, the test command is the one CI runs); every link in it
and in docs/ leads to a file and heading that exist; every path, command and class it names exists.

The client snippet has its own test (test_readme_client.py); the key results are generated (test_benchmarks_page.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import click
import pytest

from kvtier.cli.main import cli

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DEMO = "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e . && kvtier demo"
TESTS = "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e '.[test]' && python -m pytest -q"


def text() -> str:
    return README.read_text()


def setup_commands() -> list[str]:
    section = text().split("## Set-up", 1)[1].split("\n## ", 1)[0]
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", section, re.S)]


def test_the_readme_is_at_most_200_lines() -> None:
    assert len(text().splitlines()) <= 200


def test_the_two_setup_commands_are_the_ones_tested() -> None:
    assert setup_commands() == [DEMO, TESTS]
    # the test command is the one CI runs, with the extra the package declares
    ci = (REPO / ".ci/run").read_text()
    assert re.search(r'^step "main suite \(python -m pytest\)" python -m pytest -q$', ci, re.M)
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert "test" in project["optional-dependencies"]
    assert project["scripts"]["kvtier"] == "kvtier.cli.main:main"


def kvtier_command() -> list[str]:
    """`kvtier` as the set-up installs it: the console script beside this interpreter, else the module."""
    script = Path(sys.executable).parent / "kvtier"
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvtier.cli"]


def test_the_main_job_runs_as_written(tmp_path: Path) -> None:
    # `kvtier demo` with no argument, no config and no GPU, in an empty folder: the set-up's last step
    assert DEMO.endswith("&& kvtier demo")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_") and k != "NOTIFY_SOCKET"}
    for k in ("RUNTIME_DIRECTORY", "STATE_DIRECTORY"):  # these select the system mode
        env.pop(k, None)
    env.update(HOME=str(tmp_path), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [*kvtier_command(), "demo"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert re.search(r"^bitwise\s+yes", proc.stdout, re.M), proc.stdout
    assert re.search(r"^audit\s+.*clean", proc.stdout, re.M), proc.stdout


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(h) for h in re.findall(r"^#+ (.*)$", path.read_text(), re.M)}


def markdown_files() -> list[Path]:
    return [README, *sorted((REPO / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_leads_somewhere(page: Path) -> None:
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # a web address: not checked offline
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


def test_every_path_the_readme_names_exists() -> None:
    named = set(re.findall(r"`((?:kvtier|bench|docs|systemd|tests|\.ci)/[\w./-]*)`", text()))
    assert named, "the README names no path: the pattern is wrong"
    missing = sorted(p for p in named if not (REPO / p).exists())
    assert not missing, missing


def test_every_command_the_readme_names_exists() -> None:
    named = set(re.findall(r"`kvtier ((?:[a-z][a-z-]*)(?: [a-z][a-z-]*)*)", text()))
    assert {"demo", "serve", "status", "doctor"} <= {c.split()[0] for c in named}
    unknown = []
    for words in sorted(named):
        group: click.Command = cli
        for word in words.split():
            if not isinstance(group, click.Group):
                break  # an argument after the command, e.g. `kvtier prewarm MANIFEST` (upper case is not matched)
            sub = group.commands.get(word)
            if sub is None:
                unknown.append(words)
                break
            group = sub
    assert not unknown, f"the README names commands kvtier does not have: {unknown}"


def test_the_engine_classes_the_readme_names_are_exported() -> None:
    # The classes import their engine, which this venv lacks: the package's lazy attribute must name them.
    for module, name in re.findall(r"`(kvtier\.integrations\.(?:vllm|sglang))\.(\w+)`", text()):
        init = REPO / module.replace(".", "/") / "__init__.py"
        assert f'"{name}"' in init.read_text(), f"{module} does not export {name}"
    assert "`kvtier.integrations.vllm.KvtierSecondaryTier`" in text()
    assert "`kvtier.integrations.sglang.KvtierHiCacheStorage`" in text()


def test_no_diary_in_the_readme_prose() -> None:
    # Figures belong to the generated key-results block; the prose around it carries no run ids, dates, machine
    # names, commit ids or issue numbers.
    begin, end = "<!-- key results:", "<!-- end of key results -->"
    whole = text()
    assert whole.count(begin) == 1 and whole.count(end) == 1
    prose = whole[: whole.index(begin)] + whole[whole.index(end) :]
    diary = {
        "date": r"\b20\d\d-[01]\d-[0-3]\d\b",
        "run id": r"\br\d{2,3}\b",
        "machine name": r"\bVMs?\b",
        "issue number": r"\bissues? \d+",
        "commit id": r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,12}\b",
    }
    found = [f"{kind}: {m.group(0)}" for kind, pat in diary.items() for m in re.finditer(pat, prose)]
    assert not found, found
