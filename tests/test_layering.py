"""The shape of the code, held by tests (the table is docs/DESIGN.md "Layout").

Walks every import statement of every module under `kvtier/` with `ast` (relative imports resolved, imports
inside functions and `TYPE_CHECKING` blocks included: a lazy import is still a dependency) and fails on any
edge outside the table and on any cycle between modules. Also: no module under `kvtier/` over 600 lines, and
`bench/` imports only kvtier's public interface (what a package's `__init__` exports, or PUBLIC_MODULES).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KVTIER = ROOT / "kvtier"
BENCH = ROOT / "bench"
MAX_LINES = 600

# package -> the kvtier packages its modules may import (besides its own). "store" here means the store
# package's public interface unless the importer is listed in FULL_STORE: `import kvtier.store`, not its modules.
ALLOWED: dict[str, frozenset[str] | None] = {
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
    "cli": None,  # the entry point may import anything
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


# --- module size --------------------------------------------------------------------------------------------------

# Modules over the limit whose split is another change's work, with that work; an entry that no longer applies
# fails test_pending_splits_are_still_pending, so this list only shrinks.
PENDING_SPLITS: dict[str, str] = {}


def lines_over(root: Path, limit: int) -> dict[str, int]:
    """Each module under `root` longer than `limit` lines, as a path relative to root's parent."""
    counts = {p.relative_to(root.parent).as_posix(): len(p.read_text().splitlines()) for p in root.rglob("*.py")}
    return {path: n for path, n in sorted(counts.items()) if n > limit}


def test_no_module_over_the_limit() -> None:
    over = {p: n for p, n in lines_over(KVTIER, MAX_LINES).items() if p not in PENDING_SPLITS}
    assert over == {}, f"split these modules (one job each, at most {MAX_LINES} lines): {over}"


def test_pending_splits_are_still_pending() -> None:
    over = lines_over(KVTIER, MAX_LINES)
    done = sorted(set(PENDING_SPLITS) - set(over))
    assert done == [], f"remove {done} from PENDING_SPLITS: they are within {MAX_LINES} lines now"


def test_a_planted_long_module_is_found(tmp_path: Path) -> None:
    root = _plant(tmp_path, {"__init__.py": "", "core/__init__.py": "", "core/long.py": "x = 1\n" * (MAX_LINES + 1)})
    assert lines_over(root, MAX_LINES) == {"kvtier/core/long.py": MAX_LINES + 1}
    assert lines_over(root, MAX_LINES + 1) == {}


# --- bench/ imports the public interface only -------------------------------------------------------------------

# Modules bench/ may import although their package does not export them, each with why it is public. Every other
# kvtier import in bench/ names a package (`from kvtier.store import DiskStore`) and what its __init__ exports.
PUBLIC_MODULES: dict[str, str] = {
    "kvtier.core.events_config": "core: the KV-events settings the events bench varies",
    "kvtier.core.forms": "core is the shared vocabulary, module by module (docs/DESIGN.md, Layout)",
    "kvtier.core.hashing": "core: block hashing",
    "kvtier.core.config": "core: the daemon's config and config_text (files built from the schema)",
    "kvtier.core.hugepages": "core: huge-page advice",
    "kvtier.core.layout": "core: layouts and slot strides",
    "kvtier.core.parent": "core: a started process ends with its starter (the benches' daemons, verifiers, hogs)",
    "kvtier.core.profile": "core: model profiles",
    "kvtier.core.tier": "core: the LowerTier interface and its requests (a contract module)",
    "kvtier.cluster.header": "the cluster object's header format (docs/cluster.md), which the raw-get baseline reads",
    "kvtier.core.versions": "core: the version key that names a namespace",
    "kvtier.daemon.events": "the KV-events publisher, whose cost on the write path the events bench measures",
    "kvtier.daemon.kv_events": "the KV-events wire structs (vLLM's format) the events bench decodes",
    "kvtier.gpu.pools": "the pools' one-time allocation, which the slot benchmark measures",
    "kvtier.integrations.vllm.tier": "the class vLLM's tier factory loads",
    "kvtier.refmodel.demo": "the demo daemon the benchmarks run against",
    "kvtier.refmodel.engine": "the reference engine: the benchmark workload",
    "kvtier.store.aio": "a load's read geometry (depth, piece, window), which the fio baseline matches",
    "kvtier.store.extent": "an extent's size and background I/O's piece, which bench/background_io.py uses",
    "kvtier.store.record": "the record format that store/FORMAT.md documents",
    "kvtier.testing": "test doubles shared by tests and benchmarks (MemoryTier)",
}
# bench scripts that still reach past the public interface, and the change that fixes each; an entry that no
# longer applies fails test_pending_bench_reaches_are_still_pending.
PENDING_BENCH: dict[str, str] = {}


def exports_of(init: Path) -> set[str]:
    """What a package's __init__ exports: its `__all__` when it has one, else every name it binds at top level."""
    tree = ast.parse(init.read_text(), filename=str(init))
    bound: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return (
                {ast.literal_eval(e) for e in node.value.elts}
                if isinstance(node.value, ast.List | ast.Tuple)
                else set()
            )
        if isinstance(node, ast.Import | ast.ImportFrom):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.Assign):
            bound.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return bound


def bench_reaches(script: Path, kvtier_root: Path, public: set[str]) -> list[str]:
    """Each kvtier import of a bench script past the public interface, as 'line: what'."""
    bad = []
    for node in ast.walk(ast.parse(script.read_text(), filename=str(script))):
        if isinstance(node, ast.Import):
            pairs = [(a.name, None) for a in node.names if a.name.split(".")[0] == "kvtier"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "kvtier" and not node.level:
            pairs = [(node.module or "", a.name) for a in node.names]
        else:
            continue
        for module, name in pairs:
            rel = kvtier_root.parent / module.replace(".", "/")
            if (rel / "__init__.py").exists():  # a package: its exports, or one of its modules that is public
                if name is None or name in exports_of(rel / "__init__.py") or f"{module}.{name}" in public:
                    continue
                what = f"{module}.{name}"
            elif module in public:
                continue
            else:
                what = module
            bad.append(f"{node.lineno}: {what}")
    return bad


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("*.py")))
def test_bench_imports_the_public_interface(script: str) -> None:
    bad = bench_reaches(BENCH / script, KVTIER, set(PUBLIC_MODULES))
    if script in PENDING_BENCH:
        assert bad, f"remove {script} from PENDING_BENCH: it imports only the public interface now"
        return
    assert bad == [], f"bench/{script} reaches past kvtier's public interface: {bad} (export it, or import what is)"


def test_public_modules_exist() -> None:
    missing = [m for m in PUBLIC_MODULES if not (ROOT / (m.replace(".", "/") + ".py")).exists()]
    assert missing == []


def test_a_planted_bench_reach_is_found(tmp_path: Path) -> None:
    root = _plant(
        tmp_path,
        {
            "__init__.py": "",
            "store/__init__.py": "from kvtier.store.store import DiskStore\n__all__ = ['DiskStore']\n",
            "store/store.py": "",
            "store/index.py": "",
        },
    )
    script = tmp_path / "b.py"
    script.write_text("from kvtier.store import DiskStore\nfrom kvtier.store.index import Index\n")
    assert bench_reaches(script, root, set()) == ["2: kvtier.store.index"]
    script.write_text("from kvtier.store import index\n")
    assert bench_reaches(script, root, set()) == ["1: kvtier.store.index"]
    assert bench_reaches(script, root, {"kvtier.store.index"}) == []
