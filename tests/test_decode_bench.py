"""The decode-step benchmark (qcfuse_core.eval.decode) end to end on a tiny model, CPU."""

import json

import pytest

from qcfuse_core.eval import decode


def test_decode_bench_writes_every_row(tmp_path, capsys):
    out, md = tmp_path / "d.json", tmp_path / "d.md"
    rc = decode.main(
        ["--shape", "tiny-llama", "--device", "cpu", "--dtype", "fp32", "--context", "16", "--streams", "1", "3",
         "--steps", "2", "--warmup", "1", "--json", str(out), "--markdown", str(md)]
    )
    assert rc == 0
    res = json.loads(out.read_text())
    rows = [(r["streams"], r["deterministic"]) for r in res["rows"]]
    assert rows == [(1, False), (3, False), (1, True), (3, True)]
    for r in res["rows"]:
        assert r["ms_per_step"] > 0 and r["floor_ms"] > 0 and not r["graphs"]
        assert r["ms_per_token"] == pytest.approx(r["ms_per_step"] / r["streams"], abs=1e-3)
    assert res["env"]["context"] == 16
    assert "| 3 | yes |" in md.read_text()


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
