"""The decode-step benchmark (qcfuse_core.eval.decode) end to end on a tiny model, CPU."""

import json

import pytest

from qcfuse_core.eval import decode


def test_decode_bench_writes_every_row(tmp_path, capsys):
    out, md = tmp_path / "d.json", tmp_path / "d.md"
    rc = decode.main(
        [
            "--shape",
            "tiny-llama",
            "--device",
            "cpu",
            "--dtype",
            "fp32",
            "--context",
            "16",
            "--streams",
            "1",
            "3",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--json",
            str(out),
            "--markdown",
            str(md),
        ]
    )
    assert rc == 0
    res = json.loads(out.read_text())
    rows = [(r["streams"], r["deterministic"], r["mode"]) for r in res["rows"]]
    assert rows == [(n, det, mode) for det in (False, True) for mode in ("host", "ahead") for n in (1, 3)]
    for r in res["rows"]:
        assert r["ms_per_step"] > 0 and r["floor_ms"] > 0 and not r["graphs"] and r["kv_dtype"] == "auto"
        assert r["ms_per_token"] == pytest.approx(r["ms_per_step"] / r["streams"], abs=1e-3)
        assert r["roofline_fraction"] == pytest.approx(r["floor_ms"] / r["ms_per_step"], rel=1e-2, abs=1e-4)
    assert res["env"]["context"] == 16
    assert "| 3 | auto | host | yes |" in md.read_text()


def test_decode_bench_times_fp8_caches_against_their_roofline(tmp_path):
    """--kv-dtype auto fp8: rows of both, the fp8 floor reading the codes and their scales
    (less than the model dtype's), the roofline fraction beside each figure."""
    out, md = tmp_path / "d.json", tmp_path / "d.md"
    args = [
        "--shape",
        "tiny-llama",
        "--device",
        "cpu",
        "--dtype",
        "bf16",
        "--context",
        "4000",
        "--streams",
        "2",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--deterministic",
        "off",
        "--modes",
        "ahead",
        "--kv-dtype",
        "auto",
        "fp8",
        "--json",
        str(out),
        "--markdown",
        str(md),
    ]
    assert decode.main(args) == 0
    auto, fp8 = json.loads(out.read_text())["rows"]
    assert (auto["kv_dtype"], fp8["kv_dtype"]) == ("auto", "fp8")
    adapter = decode._model(decode.parse_args(args))
    s = adapter.shape
    kv_auto = 2 * s.num_layers * 4000 * s.num_kv_heads * s.head_dim * 2 * 2  # bf16, 2 sequences
    kv_fp8 = kv_auto / 2 + 2 * s.num_layers * 4000 * s.num_kv_heads * 4 * 2  # codes + fp32 scales
    assert (auto["floor_ms"] - fp8["floor_ms"]) * 1e-3 * 4.8e12 == pytest.approx(kv_auto - kv_fp8, rel=1e-3)
    assert "| 2 | fp8 | ahead | no |" in md.read_text() and "%" in md.read_text()


def test_kernel_names_map_to_what_they_do():
    assert decode.kind_of("decode_partial_kernel") == "decode attention"
    assert decode.kind_of("decode_combine_kernel") == "attention merge"
    assert decode.kind_of("rope_append_kernel") == "rope (+ cache write)"
    assert decode.kind_of("add_rms_norm_kernel") == "norm (+ residual add)"
    assert decode.kind_of("nvjet_tst_128x8_64x12_2x1_v_bz_TNT") == "weight products"
    assert decode.kind_of("void gemv2T_kernel_val<int, int, __nv_bfloat16>") == "weight products"
    assert decode.kind_of("something_new") == "other"


def test_decode_bench_refuses_bad_arguments():
    with pytest.raises(SystemExit):
        decode.parse_args(["--streams", "0"])


def test_attention_tiles_parse_and_show_in_the_table():
    a = decode.parse_args(["--attention-tiles", "64:4:3", "32:8:2"])
    assert a.attention_tiles == [
        {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
        {"BLOCK_N": 32, "num_warps": 8, "num_stages": 2},
    ]
    for bad in ("64:4", "a:b:c", "0:4:2"):
        with pytest.raises(SystemExit):
            decode.parse_args(["--attention-tiles", bad])
    res = {
        "rows": [],
        "attention_tiles": [
            {"kv_dtype": "fp8", "streams": 32, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "ms_per_step": 12.5,
             "roofline_fraction": 0.81},
            {"kv_dtype": "fp8", "streams": 32, "BLOCK_N": 128, "num_warps": 8, "num_stages": 4, "error": "out of resource"},
        ],
    }
    md = decode.markdown(res)
    assert "| 64, 4, 3 | fp8 | 32 | 12.50 | 81% |" in md and "| 128, 8, 4 | fp8 | 32 | failed | - |" in md


def test_a_tile_that_does_not_run_from_graphs_is_reported_not_timed():
    """A tile whose graphs cannot be captured would time the eager step instead: its row says
    so; one that runs from graphs gets its time and roofline fraction."""
    from qcfuse_core.model.runner import ModelRunner

    args = decode.parse_args(["--shape", "tiny-llama", "--device", "cpu", "--dtype", "fp32", "--context", "8",
                              "--steps", "1", "--warmup", "0"])
    adapter = decode._model(args)
    caches = decode._caches(adapter, 2, 8, 0)
    tile = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    row = decode._tile_row(args, adapter, caches, "auto", tile, ModelRunner(adapter))
    assert row["error"].startswith("its graphs could not be captured") and "ms_per_step" not in row

    class Graphed(ModelRunner):
        graphs = True

    row = decode._tile_row(args, adapter, caches, "auto", tile, Graphed(adapter))
    assert row["ms_per_step"] > 0 and row["BLOCK_N"] == 64 and row["streams"] == 2 and "error" not in row
    fl = decode.floor_ms(adapter, 2, 8, args.peak_tbps)
    assert row["roofline_fraction"] == pytest.approx(round(fl / row["ms_per_step"], 4))
