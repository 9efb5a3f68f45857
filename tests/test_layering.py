"""The dependency direction between kvtier's packages, held by a test (the table is docs/DESIGN.md "Layout").

Walks every import statement of every module under `kvtier/` with `ast` (relative imports resolved, imports
inside functions and `TYPE_CHECKING` blocks included: a lazy import is still a dependency) and fails on any
edge outside the table and on any cycle between modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

KVTIER = Path(__file__).resolve().parents[1] / "kvtier"

# package -> the kvtier packages its modules may import (besides its own). "store" here means the store
# package's public interface unless the importer is listed in FULL_STORE: `import kvtier.store`, not its modules.
ALLOWED: dict[str, frozenset[str]] = {
    "core": frozenset(),
    "gpu": frozenset({"core"}),
    "store": frozenset({"core"}),
    "wire": frozenset({"core"}),
    "testing": frozenset({"core"}),
    "profiles": frozenset(),
    "verifier": frozenset({"core", "store"}),
    "cluster": frozenset({"core", "store"}),
    "client": frozenset({"core", "wire"}),
    "daemon": frozenset({"core", "wire", "gpu", "store", "cluster"}),
    "integrations": frozenset({"core", "client", "store"}),
    "refmodel": frozenset({"core", "client", "store"}),
    "cli": None,  # type: ignore[dict-item]  # the entry point may import anything
}
# Single modules allowed one more edge than their package, with the reason.
EXTRA: dict[str, frozenset[str]] = {
    "kvtier.refmodel.demo": frozenset({"verifier"}),  # the demo ends with the verifier's deep audit
}
# Packages that may reach into the store's modules; everyone else imports `kvtier.store` (its exports).
FULL_STORE = frozenset({"store", "cli"})
TOP_LEVEL = "kvtier"  # kvtier/__init__.py: version only


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, name: str, modules: set[str]) -> set[str]:
    """Every kvtier module or package this file imports, as dotted names."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "kvtier")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base if is_pkg else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            if target.split(".")[0] != "kvtier":
                continue
            # `from kvtier.x import y`: an edge to the module x.y where y is one, else to x (its __init__)
            found.update(f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names)
    return found


def module_graph(root: Path) -> dict[str, set[str]]:
    files = {module_name(p, root): p for p in root.rglob("*.py")}
    modules = set(files)
    return {
        name: {t for t in imports_of(path, name, modules) if t in files and t != name} for name, path in files.items()
    }


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else TOP_LEVEL


def edge_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for src, targets in sorted(graph.items()):
        pkg = package_of(src)
        allowed = ALLOWED.get(pkg, frozenset()) if pkg != TOP_LEVEL else frozenset()
        if allowed is None:
            continue
        allowed = allowed | EXTRA.get(src, frozenset())
        for dst in sorted(targets):
            dpkg = package_of(dst)
            if dpkg in (pkg, TOP_LEVEL):  # kvtier/__init__.py holds only the version: anyone may read it
                continue
            if dpkg not in allowed:
                bad.append(f"{src} -> {dst}: {pkg} may not import {dpkg}")
            elif dpkg == "store" and pkg not in FULL_STORE and dst != "kvtier.store":
                bad.append(f"{src} -> {dst}: import the store's public interface (kvtier.store), not its modules")
    return bad


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle between modules (as a path a -> ... -> a), or None. Iterative DFS: no recursion limit."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    for start in sorted(graph):
        if state.get(start):
            continue
        stack = [(start, iter(sorted(graph[start])))]
        path = [start]
        state[start] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                state[node] = 2
                stack.pop()
                path.pop()
            elif state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                stack.append((nxt, iter(sorted(graph.get(nxt, ())))))
                path.append(nxt)
    return None


def test_every_package_is_in_the_table() -> None:
    packages = {p.name for p in KVTIER.iterdir() if (p / "__init__.py").exists()}
    packages |= {p.stem for p in KVTIER.glob("*.py") if p.name != "__init__.py"}
    assert packages <= set(ALLOWED), f"add {sorted(packages - set(ALLOWED))} to the layering table"


def test_imports_follow_the_dependency_direction() -> None:
    assert edge_violations(module_graph(KVTIER)) == []


def test_no_cycle_between_modules() -> None:
    assert find_cycle(module_graph(KVTIER)) is None


def _plant(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "kvtier"
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_a_planted_cycle_is_found(tmp_path: Path) -> None:
    root = _plant(
        tmp_path,
        {
            "__init__.py": "",
            "core/__init__.py": "",
            "core/a.py": "from kvtier.core import b\n",
            "core/b.py": "def f():\n    from .c import x\n",
            "core/c.py": "from kvtier.core.a import y\n",
        },
    )
    cycle = find_cycle(module_graph(root))
    assert cycle is not None and cycle[0] == cycle[-1]
    assert set(cycle) == {"kvtier.core.a", "kvtier.core.b", "kvtier.core.c"}


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from kvtier.daemon import server\n", "core may not import daemon"),
        ("from ..verifier import store_report\n", "core may not import verifier"),
    ],
)
def test_a_planted_upward_edge_is_found(tmp_path: Path, source: str, expected: str) -> None:
    root = _plant(
        tmp_path,
        {
            "__init__.py": "",
            "core/__init__.py": "",
            "core/forms.py": source,
            "daemon/__init__.py": "",
            "daemon/server.py": "",
            "verifier/__init__.py": "",
            "verifier/store_report.py": "",
        },
    )
    assert any(expected in v for v in edge_violations(module_graph(root)))


def test_a_reach_into_store_modules_is_found(tmp_path: Path) -> None:
    root = _plant(
        tmp_path,
        {
            "__init__.py": "",
            "store/__init__.py": "",
            "store/index.py": "",
            "verifier/__init__.py": "",
            "verifier/cleaner.py": "from kvtier.store.index import Index\n",
        },
    )
    assert any("public interface" in v for v in edge_violations(module_graph(root)))
