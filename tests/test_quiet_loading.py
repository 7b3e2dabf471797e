"""Opening an engine draws no progress bar (issue 66 item 4): transformers' loader draws a
"Loading weights" bar at every load; the library turns transformers' bars off around its
loads (qcfuse_core/model/quiet.py) and leaves the switch as it found it. A tiny random model
saved to a folder, loaded through `open_engine`."""

from __future__ import annotations

import pytest

from qcfuse_core.engine.api import open_engine
from qcfuse_core.model.testing import tiny_model


@pytest.fixture
def bars_on():
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()
    yield hf_logging
    (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()


def test_opening_an_engine_draws_no_loading_bar(tmp_path, monkeypatch, capfd, bars_on):
    monkeypatch.setenv("QCFUSE_CACHE_DIR", str(tmp_path / "cache"))
    from transformers.utils.logging import tqdm

    for _ in tqdm(range(3), desc="Loading weights"):  # what transformers' loader draws, bars on
        pass
    assert "Loading weights" in capfd.readouterr().err  # a bar drawn here would be seen
    folder = tmp_path / "tiny"
    adapter = tiny_model("llama", tokenizer=True, seed=3)
    adapter.model.save_pretrained(folder)
    adapter.tokenizer.save_pretrained(folder)
    capfd.readouterr()
    with open_engine(tmp_path / "store", model=str(folder), dtype="fp32") as engine:
        assert engine.adapter.name == "tiny"
    err = capfd.readouterr().err
    assert "Loading weights" not in err and "it/s" not in err, err
    assert bars_on.is_progress_bar_enabled()  # the switch as it was
