"""The command line's first-run papercuts (issue 66 items 3 and 4): a bad flag is refused
when the command line is parsed, before any model loads or any file is written; `--help`
says each default once; `qcfuse ask` on an empty store fails before it creates anything.
No model runs here: the loaders are replaced by ones that fail the test if called."""

from __future__ import annotations

import argparse

import pytest

from qcfuse_core.cli.commands import build_parser, main


@pytest.fixture
def no_model(monkeypatch):
    """Any model load fails the test."""

    def loaded(*args, **kwargs):
        raise AssertionError("a model was loaded before the flags were checked")

    monkeypatch.setattr("qcfuse_core.model.adapter.load_model", loaded)
    monkeypatch.setattr("qcfuse_core.engine.api.open_engine", loaded)
    monkeypatch.setattr("qcfuse_core.engine.api.load_model", loaded)


BAD = [
    (["serve", "--learn-after", "-1"], "--learn-after: must be >= 0 (0: learn nothing), got -1"),
    (["serve", "--port", "70000"], "--port: must be in [0, 65535]"),
    (["serve", "--max-tokens", "0"], "--max-tokens: must be >= 1, got 0"),
    (["serve", "--max-learned", "0"], "--max-learned: must be >= 1"),
    (["serve", "--max-documents", "-3"], "--max-documents: must be >= 1"),
    (["serve", "--shutdown-timeout-s", "-1"], "--shutdown-timeout-s: must be >= 0"),
    (["serve", "--cpus-per-replica", "0"], "--cpus-per-replica: must be > 0"),
    (["serve", "--max-prompt-tokens", "many"], "--max-prompt-tokens: must be an integer, got 'many'"),
    (["ask", "q?", "--ratio", "1.5"], "--ratio: must be in [0, 1], got 1.5"),
    (["ask", "q?", "--ratio", "nan"], "--ratio: must be a number"),
    (["ask", "q?", "--max-new-tokens", "0"], "--max-new-tokens: must be >= 1"),
    (["ask", "q?", "--top-k", "0"], "--top-k: must be >= 1"),
    (["ask", "q?", "--max-context", "0"], "--max-context: must be >= 1"),
    (["demo", "--top-k", "-2"], "--top-k: must be >= 1"),
    (["ingest", "docs", "--chunk-chars", "0"], "--chunk-chars: must be >= 1"),
    (["ingest", "docs", "--limit", "0"], "--limit: must be >= 1"),
    (["studio", "--port", "-1"], "--port: must be in [0, 65535]"),
    (["studio", "--max-upload-mb", "0"], "--max-upload-mb: must be > 0"),
]


@pytest.mark.parametrize("argv, says", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_a_bad_flag_is_refused_before_the_model_loads(argv, says, tmp_path, capsys, no_model):
    store = tmp_path / "store"
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--store", str(store)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert says in err, err
    assert not store.exists()  # nothing written


def test_serve_checks_its_settings_before_the_model_loads(tmp_path, capsys, no_model):
    """What argparse cannot see alone (an empty --api-key) is checked before the model loads too."""
    assert main(["serve", "--api-key", " ", "--port", "0", "--store", str(tmp_path / "s")]) == 2
    assert "api_key must not be empty" in capsys.readouterr().err


def _subparsers(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield name, sub
                for inner, subsub in _subparsers(sub):
                    yield f"{name} {inner}", subsub


def test_help_says_each_default_once(monkeypatch):
    """One option, one line (a wide terminal), at most one "(default" on it: a help text that
    says its default itself gets none added (`serve --help` printed "(default: 1 with
    --device cuda, else 0) (default: None)")."""
    from qcfuse_core.cli.commands import _set_formatter

    monkeypatch.setenv("COLUMNS", "1000")
    parser = build_parser()
    _set_formatter(parser)
    seen = 0
    for name, sub in _subparsers(parser):
        for line in sub.format_help().splitlines():
            assert line.count("(default") <= 1, f"qcfuse {name} --help: {line.strip()}"
            seen += "(default" in line
    assert seen > 40  # the defaults are still shown
    serve = dict(_subparsers(parser))["serve"].format_help()
    assert "(default: 1 with --device cuda, else 0)\n" in serve and "(default: 1)\n" in serve  # --learn-after


def test_ask_on_an_empty_store_creates_nothing(tmp_path, no_model):
    store = tmp_path / "empty"
    with pytest.raises(SystemExit, match="the store is empty: run `qcfuse ingest PATH...`"):
        main(["ask", "anything?", "--store", str(store)])
    assert not store.exists()
    store.mkdir()
    with pytest.raises(SystemExit, match="the store is empty"):
        main(["ask", "anything?", "--store", str(store)])
    assert list(store.iterdir()) == []
