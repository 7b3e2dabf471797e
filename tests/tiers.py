"""The two test tiers, enforced when the tests are collected.

`make test` runs the fast tier (`-m "not slow"`): unit and integration tests on tiny random
models and the PyTorch reference kernels, the Triton kernels through the interpreter on tiny
shapes, and one end-to-end test per public path on the embedded SmolLM2-135M, which the
fast tier reaches only through the shared session fixtures (`smol`, `smol_engine` in
conftest.py, or `open_engine`'s per-process model cache behind the integrations).
`make test-all` adds the slow tier (`@pytest.mark.slow`, on the test or the module):

- a real model other than the embedded one (Gemma-3-270M, a converted or HF checkpoint),
  and quality checks that run the embedded model over many questions;
- Ray (a local cluster), a browser (Playwright + Chromium), a fresh virtualenv;
- the README's blocks, the store's fault matrices.

`check_tiers` (called from conftest's collection hook) reads the source a test runs - the
test function, the fixtures it requests (conftest's shared fixtures excepted) and, within its
module, the module-level functions and classes those name, transitively - and fails the
collection when a test that is not marked slow starts one of the slow-tier resources below.
It reads source, so it cannot see a resource reached through another module; the patterns
name what the library's slow paths are started with, and tests/test_tiers.py shows each one
caught. Helpers a test imports from the shared helper module (tests/qc_fixtures.py) are
followed too.
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
import sys
import textwrap
from collections.abc import Callable, Iterable
from types import ModuleType

import pytest

# what a fast test must not start: (why, pattern over the source it runs)
SLOW_ONLY: list[tuple[str, re.Pattern[str]]] = [
    ("starts Ray", re.compile(r"\bray\.init\(|\bserve\.run\(|--replicas")),
    ("drives a browser", re.compile(r"playwright|\bchromium\b", re.IGNORECASE)),
    ("creates a fresh virtualenv", re.compile(r"\bvenv\.(create|EnvBuilder)\b|\bvirtualenv\b|-m\s+venv\b")),
    (
        "loads a real model other than the embedded one",
        re.compile(
            r"\bfrom_pretrained\(|\bload_model\(\s*(model\s*=\s*)?[\"'](?!smollm2-135m[\"'])"
            r"|\bmodel\s*=\s*[\"']gemma3-270m|[\"']--model[\"'],\s*[\"']gemma3-270m"
        ),
    ),
    (
        "loads the embedded model again (use the shared `smol` / `smol_engine` fixtures)",
        re.compile(r"\bload_model\(\s*(\)|dtype\s*=|model\s*=\s*None|[\"']smollm2-135m[\"'])"),
    ),
    ("runs the README's blocks", re.compile(r"(?s)(?=.*README\.md)(?=.*\bsubprocess\.)")),
]

# session fixtures the fast tier shares (conftest.py): their own source is not scanned
SHARED_FIXTURES = frozenset({"smol", "smol_engine"})


def _source(obj: object) -> str:
    try:
        return textwrap.dedent(inspect.getsource(obj))  # type: ignore[arg-type]
    except (OSError, TypeError):
        return ""


def _names(src: str) -> set[str]:
    try:
        tree = ast.parse(src)
    except SyntaxError:
        return set()
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}


# modules of helpers that test modules import (their source is followed like the test's own)
HELPER_MODULES = frozenset({"tests.qc_fixtures", "qc_fixtures"})


def _closure(roots: Iterable[object], module: ModuleType | None) -> str:
    """The source of `roots` and of the module-level functions and classes they name -
    of `module`, and of the shared helper modules (`HELPER_MODULES`) - transitively."""
    seen: set[int] = set()
    todo = [(root, module) for root in roots]
    parts: list[str] = []
    while todo:
        obj, mod = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        src = _source(obj)
        parts.append(src)
        if mod is None:
            continue
        for name in _names(src):
            ref = getattr(mod, name, None)
            if not (inspect.isfunction(ref) or inspect.isclass(ref)):
                continue
            home = getattr(ref, "__module__", None)
            if home == mod.__name__:
                todo.append((ref, mod))
            elif home in HELPER_MODULES and home in sys.modules:
                todo.append((ref, sys.modules[home]))
    return "\n".join(parts)


def reasons(func: Callable, fixtures: Iterable[Callable], module: ModuleType | None) -> list[str]:
    """Why a test running `func` (with these fixture functions) belongs to the slow tier."""
    return list(_reasons((func, *fixtures), module))


@functools.cache
def _reasons(roots: tuple[Callable, ...], module: ModuleType | None) -> tuple[str, ...]:
    """`reasons`, read once per function and fixtures (the items of a parametrized test share it)."""
    src = _closure(roots, module)
    return tuple(why for why, pattern in SLOW_ONLY if pattern.search(src))


def _fixture_funcs(item: pytest.Item) -> list[Callable]:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return []
    out = []
    for name, defs in info.name2fixturedefs.items():
        if name in SHARED_FIXTURES:
            continue
        for d in defs:
            func = getattr(d, "func", None)
            if func is not None and not getattr(func, "__module__", "").startswith(("_pytest", "pytest_")):
                out.append(func)
    return out


def check_tiers(items: list[pytest.Item]) -> None:
    """Fail the collection (pytest.UsageError) if a test outside the slow tier starts a
    slow-tier resource."""
    bad = []
    for item in items:
        if item.get_closest_marker("slow") is not None:
            continue
        func = getattr(item, "function", None)
        if func is None:
            continue
        why = reasons(func, _fixture_funcs(item), getattr(item, "module", None))
        if why:
            bad.append(f"  {item.nodeid}: {', '.join(why)}")
    if bad:
        raise pytest.UsageError(
            "these tests belong to the slow tier: mark them (or their module) with pytest.mark.slow "
            "(tests/tiers.py, tests/README.md)\n" + "\n".join(bad)
        )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The check as a plugin of its own (`pytest -p tests.tiers`, used by tests/test_tiers.py);
    the suite calls `check_tiers` from conftest.py."""
    check_tiers(items)
