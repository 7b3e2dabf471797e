"""The tier check (tests/tiers.py): each rule catches a test that starts a slow-tier resource
without the `slow` marker, a marked one passes, and fixtures are read as well as tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests import tiers

ROOT = Path(__file__).resolve().parents[1]

CASES = {
    "starts Ray": "import ray\n    ray.init(num_cpus=1)",
    "drives a browser": "from playwright.sync_api import sync_playwright\n    sync_playwright().start()",
    "creates a fresh virtualenv": "import venv\n    venv.create('env', with_pip=True)",
    "loads a real model other than the embedded one": "load_model('gemma3-270m', dtype='fp32')",
    "loads the embedded model again (use the shared `smol` / `smol_engine` fixtures)": "load_model(dtype='bf16')",
    "runs the README's blocks": "import subprocess\n    subprocess.run(['bash', '-c', open('README.md').read()])",
}


def _collect(tmp_path: Path, body: str, marker: str = "") -> subprocess.CompletedProcess:
    test = tmp_path / "test_case.py"
    test.write_text(
        "import pytest\n\n\ndef load_model(*a, **k):\n    pass\n\n\ndef helper():\n    "
        + body
        + f"\n\n\n{marker}\ndef test_it():\n    helper()\n"
    )
    return subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "tests.tiers", "-p", "no:cacheprovider",
         "--rootdir", str(tmp_path), "-c", "/dev/null", str(test)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )


# a module whose fixture starts Ray (module-level text: the check reads functions, not strings)
FIXTURE_CASE = """\
import pytest

@pytest.fixture(scope="module")
def cluster():
    import ray
    ray.init(num_cpus=1)
    yield

def test_uses_it(cluster):
    pass
"""

# a shared helper module whose helper starts Ray two calls down
HELPER_CASE = "def start():\n    " + CASES["starts Ray"] + "\n\n\ndef cluster():\n    start()\n"


@pytest.mark.parametrize("why", list(CASES))
def test_each_rule_catches_its_resource(why):
    assert [w for w, pattern in tiers.SLOW_ONLY if pattern.search(CASES[why])][-1] == why


def test_fast_tests_on_tiny_models_and_shared_fixtures_pass():
    for src in ("tiny_model('llama', tokenizer=True)", "QCFuseEngine(smol)", "load_model(tmp_path / 'missing')",
                "README.read_text()", "installed_models(['gemma3-270m'])", "array = x"):
        assert not [w for w, pattern in tiers.SLOW_ONLY if pattern.search(src)], src


def test_the_collection_fails_for_an_unmarked_test_and_passes_once_marked(tmp_path):
    """The resource is reached through a module-level helper the test calls, as most are."""
    bad = _collect(tmp_path, CASES["starts Ray"])
    assert bad.returncode != 0
    out = bad.stdout + bad.stderr
    assert "these tests belong to the slow tier" in out and "test_case.py::test_it: starts Ray" in out
    good = _collect(tmp_path, CASES["starts Ray"], marker="@pytest.mark.slow")
    assert good.returncode == 0, good.stdout + good.stderr
    assert "1 test collected" in good.stdout


def test_fixtures_are_read_too(tmp_path):
    """A resource started by a fixture of the test's module counts against the test."""
    test = tmp_path / "test_fixture.py"
    test.write_text(FIXTURE_CASE)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "tests.tiers", "-p", "no:cacheprovider",
         "--rootdir", str(tmp_path), "-c", "/dev/null", str(test)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode != 0 and "test_fixture.py::test_uses_it: starts Ray" in done.stdout + done.stderr


def test_helpers_of_the_shared_module_are_read_too(tmp_path, monkeypatch):
    """A resource started by a helper the test imports from the shared helper module (as
    tests/qc_fixtures.py's) counts against the test, however deep the helper's own calls go."""
    import importlib

    (tmp_path / "shared_helpers.py").write_text(HELPER_CASE)
    (tmp_path / "test_user.py").write_text("from shared_helpers import cluster\n\n\ndef test_it():\n    cluster()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    user = importlib.import_module("test_user")
    assert tiers.reasons(user.test_it, [], user) == []  # not a helper module: not followed
    monkeypatch.setattr(tiers, "HELPER_MODULES", frozenset({"shared_helpers"}))
    tiers._reasons.cache_clear()
    assert tiers.reasons(user.test_it, [], user) == ["starts Ray"]
