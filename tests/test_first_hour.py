"""The first hour with the `qcfuse` command: help texts, version, shared store, Ctrl-C."""

from __future__ import annotations

import argparse
import re

import pytest

from qcfuse_core.cli import commands as cli


def _parsers(parser: argparse.ArgumentParser, name: str = "qcfuse"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


def test_every_option_has_help_and_shows_its_default():
    parser = cli.build_parser()
    cli._set_formatter(parser)
    missing, no_default = [], []
    for name, p in _parsers(parser):
        text = p.format_help()
        for a in p._actions:
            if isinstance(a, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)):
                continue
            if not a.help or a.help == argparse.SUPPRESS:
                missing.append(f"{name} {'/'.join(a.option_strings) or a.dest}")
            elif a.option_strings and a.default is not argparse.SUPPRESS and not a.required \
                    and "%(default)" not in a.help and not re.search(r"[(;]\s*default\b", a.help) \
                    and not isinstance(a, argparse._StoreTrueAction):  # a help that says its default in words: once
                if f"(default: {a.default})".replace("\n", " ") not in " ".join(text.split()):
                    no_default.append(f"{name} {a.option_strings[0]}")
    assert not missing, f"options without help: {missing}"
    assert not no_default, f"options whose --help does not show the default: {no_default}"


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    from importlib.metadata import version

    assert capsys.readouterr().out.strip() == f"qcfuse {version('qcfuse')}"


def test_demo_and_ask_share_the_default_store(monkeypatch, tmp_path):
    monkeypatch.setenv("QCFUSE_CACHE_DIR", str(tmp_path))
    parser = cli.build_parser()
    demo = parser.parse_args(["demo"])
    ask = parser.parse_args(["ask", "q"])
    ingest = parser.parse_args(["ingest", "x"])
    assert demo.store == ask.store == ingest.store == tmp_path / "store"
    for command in (["stats"], ["verify"], ["gc", "--max-bytes", "1G"], ["clear"]):  # no --store needed
        assert parser.parse_args(["store", *command]).store == tmp_path / "store", command


def test_ctrl_c_ends_with_a_message(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_ingest", interrupted)
    assert cli.main(["ingest", "anything"]) == 130
    err = capsys.readouterr().err
    assert "qcfuse: interrupted" in err and "Traceback" not in err


def test_store_stats_explains_its_lines(tmp_path, capsys):
    from store_fixtures import make_chunk, store_at

    from qcfuse_core.store import kv_dir

    with store_at(kv_dir(tmp_path)) as s:
        s.put(make_chunk(1))
    assert cli.main(["store", "stats", "--store", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for word in ("entries", "sidecars", "nodes"):
        assert any(line.strip().startswith(word) and len(line.split()) > 3 for line in out.splitlines()), word


def test_assembling_a_packaged_model_shows_progress_and_checks_its_sha256(tmp_path, monkeypatch, caplog):
    import hashlib
    import logging

    from qcfuse_core.model import adapter as model

    parts = []
    for i in range(3):
        p = tmp_path / f"m.gguf.part{i}"
        p.write_bytes(bytes([i]) * 1000)
        parts.append(p)
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in parts)).hexdigest()
    monkeypatch.setattr(model, "PROGRESS_S", 0.0)  # a line per block
    with caplog.at_level(logging.WARNING, logger="qcfuse_core.model.adapter"):
        out = model.assemble_chunks(parts, tmp_path / "m.gguf", digest, block=500)
    assert out.read_bytes() == b"".join(p.read_bytes() for p in parts)
    lines = [r.getMessage() for r in caplog.records]
    assert any("3 chunk packages" in m and "checking its sha256" in m for m in lines)
    assert any("assembling m.gguf: 50%" in m for m in lines) and any("assembled and checked" in m for m in lines)
    with pytest.raises(ValueError, match="expected 0+: reinstall its packages"):
        model.assemble_chunks(parts, tmp_path / "bad.gguf", "0" * 64)
    assert not (tmp_path / "bad.gguf").exists()
