"""The house rules of the tree, checked on its source (no imports executed).

- the core (`qcfuse_core`) imports no `qcfuse_integrations` module;
- the cache layer (`qcfuse_core.cache`) imports nothing of the engine (`qcfuse_core.engine`):
  the request path runs down through it, never back up;
- floors point down: the store (`qcfuse_core.store`) imports no layer above it - not
  ingestion, retrieval, the model, the cache manager, selection, the engine, nor the CLI, the
  server, the studio or the evaluation;
- the server (`qcfuse_core.serve`) imports nothing of the studio: what they share (the body
  limit, the API key check) is in `qcfuse_core.asgi`;
- the integrations (`qcfuse_integrations`) use the core through its public face only: names
  imported from `qcfuse_core` itself, never from a module under it (nor `qcfuse_kernels`);
- the engine's callers (eval, the CLI, the server, the studio, the integrations) touch no
  private member of QCFuseEngine; eval reaches inside it through one declared hook,
  `qcfuse_core.eval.hooks`;
- the library's import graph between modules has no cycle (imports inside functions
  included: they would only hide one);
- imports inside functions are kept for optional extras (and the lazy CLI commands).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"qcfuse_core": ROOT / "qcfuse_core", "qcfuse_integrations": ROOT / "qcfuse_integrations",
            "qcfuse_kernels": ROOT / "kernels"}


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [pkg, *rel.parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = path
    return mods


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """Library modules `name` imports (a `from pkg import sub` counts as the sub-module)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(p, m, mods) for m, p in mods.items()}


def test_the_core_imports_no_integration_module():
    graph = _graph()
    bad = sorted(f"{m} -> {t}" for m, ts in graph.items() if m.startswith("qcfuse_core")
                 for t in ts if t.startswith("qcfuse_integrations"))
    assert not bad, "the core imports integration modules:\n" + "\n".join(bad)


def _under(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def _arrows(graph: dict[str, set[str]], src: tuple[str, ...], dst: tuple[str, ...]) -> list[str]:
    """Every import from a module under `src` to one under `dst` (imports in functions included)."""
    return sorted(f"{m} -> {t}" for m, ts in graph.items() if _under(m, src) for t in ts if _under(t, dst))


ABOVE_THE_STORE = tuple(
    f"qcfuse_core.{p}"
    for p in ("ingest", "retrieval", "model", "cache", "selection", "engine", "cli", "serve", "studio", "eval")
)


def test_the_store_imports_no_layer_above_it():
    bad = _arrows(_graph(), ("qcfuse_core.store",), ABOVE_THE_STORE)
    assert not bad, "the store imports layers above it:\n" + "\n".join(bad)


def test_the_cache_layer_imports_nothing_of_the_engine():
    graph = _graph()
    bad = sorted(f"{m} -> {t}" for m, ts in graph.items() if m.startswith("qcfuse_core.cache")
                 for t in ts if t == "qcfuse_core.engine" or t.startswith("qcfuse_core.engine."))
    assert not bad, "the cache layer imports engine modules:\n" + "\n".join(bad)


def test_the_server_imports_nothing_of_the_studio():
    bad = _arrows(_graph(), ("qcfuse_core.serve",), ("qcfuse_core.studio",))
    assert not bad, "the server imports the studio:\n" + "\n".join(bad)


def test_the_integrations_use_only_the_public_face():
    graph = _graph()
    bad = [a for a in _arrows(graph, ("qcfuse_integrations",), ("qcfuse_core", "qcfuse_kernels"))
           if not a.endswith(" -> qcfuse_core")]
    assert not bad, "the integrations reach past `qcfuse_core`'s public names:\n" + "\n".join(bad)
    assert "qcfuse_core" in graph["qcfuse_integrations.base"]  # the checker sees `from qcfuse_core import ...`


def _parents(name: str) -> set[str]:
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def test_no_import_cycle():
    graph = _graph()
    # a package's __init__ importing its own sub-modules is how a package names its public
    # API; the arrow from a sub-module up to its own package __init__ is implied by Python
    edges = {m: {t for t in ts if t not in _parents(m)} for m, ts in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(edges.get(m, ())):
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles[:20])


def test_the_graph_sees_real_imports():
    """The checker itself: it sees module-level imports and those inside functions."""
    graph = _graph()
    assert "qcfuse_core.model.fusion" in graph["qcfuse_core.engine.pipeline"]
    assert "qcfuse_core.store" in graph["qcfuse_core.engine.api"]
    assert "qcfuse_core.studio.cli" in graph["qcfuse_core.cli.commands"]  # imported inside a function


def _engine_private_names() -> set[str]:
    """QCFuseEngine's private members: its `_` methods and properties, and `self._x` it sets."""
    tree = ast.parse((PACKAGES["qcfuse_core"] / "engine" / "api.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "QCFuseEngine")
    names = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    names |= {
        n.attr for n in ast.walk(cls)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"
    }
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_eval_reaches_engine_internals_through_its_one_hook():
    """Of the engine's callers - eval, the CLI, the server, the studio, the integrations -
    only `qcfuse_core.eval.hooks` touches a private member of QCFuseEngine (on anything but
    `self`): the rest drive the engine through its public face."""
    private = _engine_private_names()
    assert {"_steps", "_config", "_submit"} <= private
    callers = ("qcfuse_core.eval", "qcfuse_core.cli", "qcfuse_core.serve", "qcfuse_core.studio", "qcfuse_integrations")
    bad = []
    for name, path in _modules().items():
        if name == "qcfuse_core.eval.hooks" or not name.startswith(callers):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in private
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
            ):
                bad.append(f"{name}:{node.lineno} .{node.attr}")
    assert not bad, "private engine members used outside eval/hooks.py:\n" + "\n".join(bad)
