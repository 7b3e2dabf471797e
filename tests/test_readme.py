"""The README's commands and code work when pasted as written (issue 40, item 6).

Every fenced block of README.md tagged ```bash or ```python is run, in order, as the README
shows it: bash blocks with `bash -e` from a folder that looks like the checkout (its
top-level files and folders linked, `.venv` the environment running these tests), python
blocks with that environment's Python (`.venv/bin/` holds it and this checkout's console
scripts, written as an install of the checkout writes them). Blocks tagged otherwise (```text: sample output,
synopses, diagrams) are prose.

A block may be left out by an HTML comment on the line just before its fence:

    <!-- readme-test: skip (REASON) -->

for setup that installs packages from the package index, a server that runs until stopped,
or a browser. The reason is required and printed; `test_skip_markers_are_well_formed`
fails on a marker without one or not followed by a block.

Isolation: the commands run with QCFUSE_CACHE_DIR set to a fresh folder (so the default
store starts empty, whatever an earlier run left), whose `models/` links to the real cache
dir's converted models (deriving them again would only repeat the first-use conversion) -
and with this checkout first on PYTHONPATH, so its code is what runs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RUN = ("bash", "python")
FENCE = re.compile(r"^```(\S*)\s*$")
MARKER = re.compile(r"<!--\s*readme-test:\s*skip\b(.*?)-->")
REASON = re.compile(r"^\s*\((.+)\)\s*$")
TIMEOUT_S = 1200  # one block at most (the demo and each example load the model and ingest the corpus)


@dataclass(frozen=True)
class Block:
    lang: str
    code: str
    line: int  # of the opening fence, 1-based
    skip: str | None  # the marker's reason, None: run it


def blocks(text: str) -> list[Block]:
    """The fenced blocks of a Markdown text, with the skip marker just before each."""
    out: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        marker = MARKER.search(lines[start - 1]) if start else None
        skip = None
        if marker:
            reason = REASON.match(marker.group(1))
            skip = reason.group(1).strip() if reason else ""
        out.append(Block(lang, "\n".join(lines[start + 1:j]) + "\n", start + 1, skip))
        i = j + 1
    return out


def runnable() -> list[Block]:
    return [b for b in blocks(README.read_text()) if b.lang in RUN]


def test_skip_markers_are_well_formed():
    text = README.read_text()
    lines = text.splitlines()
    fences = {b.line - 1 for b in blocks(text)}  # 1-based line of the marker = fence line - 1
    for n, line in enumerate(lines, 1):
        if MARKER.search(line):
            assert n in fences, f"README.md:{n}: a readme-test marker must be the line just before a fence"
    found = runnable()
    assert any(b.lang == "bash" and b.skip is None for b in found), "no bash block is run"
    assert any(b.lang == "python" and b.skip is None for b in found), "no python block is run"
    for b in found:
        assert b.skip is None or b.skip, f"README.md:{b.line}: a skipped block needs a reason: skip (REASON)"


def _venv(target: Path) -> None:
    """`.venv/bin/python` (the interpreter running these tests) and `.venv/bin/<script>` for
    each of this checkout's `[project.scripts]`, as installing the checkout writes them (an
    environment shared with another checkout may hold scripts of another layout)."""
    import tomllib

    bin_dir = target / "bin"
    bin_dir.mkdir(parents=True)
    python = bin_dir / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"].get("scripts", {})
    for name, entry in scripts.items():
        module, func = entry.split(":")
        script = bin_dir / name
        script.write_text(f"#!{sys.executable}\nimport sys\nfrom {module} import {func}\nsys.exit({func}())\n")
        script.chmod(0o755)


def _real_models_dir() -> Path:
    from qcfuse_core.model.adapter import cache_dir

    return cache_dir() / "models"


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> tuple[Path, dict]:
    """(a folder that looks like the checkout, the environment for the commands)."""
    work = tmp_path_factory.mktemp("readme")
    for entry in ROOT.iterdir():
        if entry.name not in (".git", ".venv"):
            (work / entry.name).symlink_to(entry)
    _venv(work / ".venv")
    cache = work / "cache"
    cache.mkdir()
    models = _real_models_dir()
    models.mkdir(parents=True, exist_ok=True)
    (cache / "models").symlink_to(models)
    env = dict(os.environ, QCFUSE_CACHE_DIR=str(cache), PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    # a user's shell does not run Triton's CPU interpreter (tests/conftest.py sets it for the
    # kernel tests): the commands get the backend a user gets (plain PyTorch on a CPU)
    env.pop("TRITON_INTERPRET", None)
    return work, env


@pytest.mark.slow
@pytest.mark.parametrize("block", runnable(), ids=lambda b: f"{b.lang}-line{b.line}")
def test_readme_block_runs_as_written(block: Block, checkout):
    if block.skip:
        pytest.skip(f"README.md:{block.line}: {block.skip}")  # the marker's reason (checked non-empty above)
    work, env = checkout
    if block.lang == "bash":
        cmd = ["bash", "-e", "-o", "pipefail", "-c", block.code]
    else:
        script = work / f"readme_block_{block.line}.py"
        script.write_text(block.code)
        cmd = [str(work / ".venv" / "bin" / "python"), script.name]
    done = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    tail = f"\n--- stdout ---\n{done.stdout[-4000:]}\n--- stderr ---\n{done.stderr[-4000:]}"
    assert done.returncode == 0, f"README.md:{block.line} ({block.lang}) failed with {done.returncode}{tail}"
    assert done.stdout.strip(), f"README.md:{block.line} printed nothing{tail}"


# ---------------------------------------------------------------------------- install lines


def _pip_installs(text: str) -> list[tuple[int, str]]:
    """(line, requirement) of every `pip install` in the README's bash blocks."""
    import shlex

    out = []
    for b in blocks(text):
        if b.lang != "bash":
            continue
        for i, line in enumerate(b.code.splitlines()):
            words = shlex.split(line.split(" #")[0]) if "pip install" in line else []
            if "install" in words:
                out += [(b.line + 1 + i, w) for w in words[words.index("install") + 1:] if not w.startswith("-")]
    return out


def test_install_lines_never_ask_an_index_for_qcfuse():
    """QCFuse is not on a package index (issue 66): no install line, and no sentence, tells a
    user to `pip install qcfuse` or `qcfuse[extra]` from one; QCFuse itself comes from the
    checkout (`.`) or a wheel built from it (`dist/...whl`)."""
    text = README.read_text()
    reqs = _pip_installs(text)
    assert any(r.startswith(".[") or r == "." for _, r in reqs) and any(r.startswith("dist/") for _, r in reqs)
    for line, req in reqs:
        assert not re.match(r"qcfuse\b", req), f"README.md:{line}: `pip install {req}` asks an index for qcfuse"
    assert not re.search(r"pip install '?qcfuse\b", text), "the README's prose tells a user to pip install qcfuse"


@pytest.mark.slow
def test_the_wheel_the_readme_builds_installs_qcfuse_and_its_extras(tmp_path):
    """The README's `pip wheel` line, run as written in a copy of the checkout, writes the wheel
    its next line installs, holding the package and its extras (no index is asked)."""
    import shutil
    import zipfile

    text = README.read_text()
    line = next(ln for b in blocks(text) if b.lang == "bash" for ln in b.code.splitlines() if "pip wheel" in ln)
    wheel = next(r for _, r in _pip_installs(text) if r.startswith("dist/")).split("[")[0]
    work = tmp_path / "checkout"
    shutil.copytree(ROOT, work, ignore=shutil.ignore_patterns(".git", ".venv", "node_modules", "__pycache__", ".lab"))
    cmd = line.split(" #")[0].replace("pip ", f"{sys.executable} -m pip ", 1)
    done = subprocess.run(["bash", "-e", "-c", cmd], cwd=work, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    with zipfile.ZipFile(work / wheel) as whl:
        names = set(whl.namelist())
        meta = whl.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert {"qcfuse_core/engine/api.py", "qcfuse_integrations/langchain/callbacks.py"} <= names
    assert "qcfuse_core/studio/static/index.html" in names  # the page ships built
    for extra in ("langchain", "llama-index", "serve", "studio", "structured"):
        assert f"Provides-Extra: {extra}" in meta, extra
