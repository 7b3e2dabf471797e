"""Same input, same answer (docs/determinism.md).

- a chunk's cache is a pure function of its tokens: built alone, or in ingestion batches of
  2, 5 and 16 chunks of mixed lengths, the stored K/V are bitwise equal (bf16 and fp32);
- damaged caches rebuilt during a request give the answer (and the first token's logits)
  of the intact store, bit for bit;
- the same request five times gives identical logits and tokens;
- the deterministic mode: a decode step's logits for a sequence are the same bits whether
  it runs alone or batched with any others; without it, fp32 batched greedy answers still
  match alone;
- `store verify --deep` recomputes stored caches and reports drift.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from qcfuse_core import EngineConfig, QCFuseEngine, open_engine
from qcfuse_core.cli.commands import main
from qcfuse_core.ingest.prefill import prefill_alone, prefill_alone_batch
from qcfuse_core.model.adapter import load_model
from qcfuse_core.model.batched import decode_batch, deterministic_tile
from qcfuse_core.model.fusion import KVCache, decode_step, fill_from_hf
from qcfuse_core.eval.hooks import internals
from qcfuse_core.store import MemoryStore
from qcfuse_core.types import KVChunk

DOCS = [
    "The Orvell Lighthouse stands on Kettle Point. It was built in 1871 by the harbour board of Marrowby.",
    "Marrowby is a fishing town twenty miles north of Kettle Point.",
    "The first keeper of the Orvell Lighthouse, Ada Brisk, was born in Kettle Point and kept the light for "
    "forty years; her son Tam took over in 1912.",
    "Kettle Point has a population of 310 and one school.",
    "The harbour board of Marrowby also built the breakwater in 1880, after a storm destroyed the old pier.",
    "Fog horns were added to the lighthouse in 1903.",
]
QUESTION = "Where was the first keeper of the Orvell Lighthouse born?"

# the embedded model in bf16 and fp32, its own loads: the slow tier (tests/tiers.py); the fast
# tier's bitwise checks run on tiny models (test_scheduler.py, test_chunked_prefill.py)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["bf16", "fp32"])
def model(request):
    return load_model(dtype=request.param)


def _mixed_chunks(tokenizer, n: int) -> list[torch.Tensor]:
    """n chunks of 3 to ~90 tokens, cut from the documents at varying lengths."""
    words = " ".join(DOCS).split()
    out = []
    for i in range(n):
        a, m = (7 * i) % len(words), 2 + (13 * i) % 60
        out.append(torch.tensor(tokenizer(" ".join(words[a : a + m]), add_special_tokens=False).input_ids))
    return out


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# ----------------------------------------------------------------------------- chunk caches


def test_a_chunk_cache_is_the_same_bits_in_any_batch(model):
    chunks = _mixed_chunks(model.tokenizer, 16)
    assert len({len(c) for c in chunks}) > 8  # mixed lengths: a packed batch would pad
    alone = [prefill_alone(model, c) for c in chunks]
    for size in (2, 5, 16):
        for a in range(0, len(chunks), size):
            got = prefill_alone_batch(model, chunks[a : a + size])
            for i, (k, v) in enumerate(got, start=a):
                assert _bitwise(k, alone[i][0]) and _bitwise(v, alone[i][1]), f"chunk {i} in a batch of {size}"


def test_ingestion_and_a_request_miss_store_the_same_bits(model):
    """Through the engine: chunks ingested 5 at a time, and the same chunks built one by one
    as misses of requests, are stored with the same bytes."""
    texts = [model.tokenizer.decode(c) for c in _mixed_chunks(model.tokenizer, 10)]
    batched = QCFuseEngine(model, store=MemoryStore())
    batched.build_chunks(texts)
    single = QCFuseEngine(model, store=MemoryStore())
    for t in texts:
        single.build_chunks([t])
    for t in texts:
        _, key = batched.caches.chunk_tokens(t)
        assert key is not None
        x, y = batched.caches.store.get(key), single.caches.store.get(key)
        assert isinstance(x, KVChunk) and isinstance(y, KVChunk)
        assert _bitwise(x.k, y.k) and _bitwise(x.v, y.v)


def _flip_bytes(path: Path) -> None:
    b = bytearray(path.read_bytes())
    for f in (1 / 3, 1 / 2, 2 / 3):
        b[int(len(b) * f)] ^= 0xFF
    path.write_bytes(bytes(b))


def test_caches_rebuilt_after_damage_answer_the_same(tmp_path):
    """Six chunks ingested together; a request over three of them. Every KV file flipped: the
    request rebuilds its three (a batch of other company) and answers bit for bit as before."""
    store = tmp_path / "store"
    engine = open_engine(store)
    engine.build_chunks(DOCS)
    docs = [DOCS[2], DOCS[0], DOCS[4]]
    before = engine.answer(QUESTION, docs, max_new_tokens=24)
    assert (before.cache_hits, before.cache_misses) == (3, 0)
    engine.caches.store.close()
    files = list((store / "kv").rglob("*.safetensors"))
    assert files
    for f in files:
        _flip_bytes(f)
    after = open_engine(store).answer(QUESTION, docs, max_new_tokens=24)
    assert after.cache_misses == 3  # detected, rebuilt
    assert after.token_ids == before.token_ids and after.text == before.text
    assert _bitwise(after.first_logits, before.first_logits)


# ----------------------------------------------------------------------------- requests


@pytest.mark.parametrize("method", ["qcfuse", "full", "cacheblend"])
def test_the_same_request_five_times_is_identical(model, method):
    engine = QCFuseEngine(model)
    runs = [engine.answer(QUESTION, DOCS[:4], method=method, max_new_tokens=12) for _ in range(5)]
    for r in runs[1:]:
        assert r.token_ids == runs[0].token_ids
        assert _bitwise(r.first_logits, runs[0].first_logits)


def test_deterministic_is_a_bool():
    with pytest.raises(ValueError, match="deterministic"):
        EngineConfig(deterministic="yes")  # type: ignore[arg-type]


def _prefilled(model, prompts: list[str], room: int) -> list[tuple[KVCache, int]]:
    out = []
    for p in prompts:
        ids = torch.tensor(model.tokenizer(p).input_ids)
        logits, kv = model.hf_forward(ids, keep=1)
        cache = KVCache(model, len(ids) + room)
        fill_from_hf(cache, kv)
        out.append((cache, int(logits[-1].argmax())))
    return out


PROMPTS = [f"Question: {d[:40 + 9 * i]} What is it about?\nAnswer:" for i, d in enumerate(DOCS + DOCS[:2])]  # 8


def _greedy(model, caches, tokens, steps, step_fn) -> tuple[list[list[int]], list[torch.Tensor]]:
    seqs, logits_seen = [[t] for t in tokens], []
    for _ in range(steps):
        logits = step_fn(caches, [s[-1] for s in seqs])
        logits_seen.append(logits)
        for s, row in zip(seqs, logits):
            s.append(int(row.argmax()))
    return seqs, logits_seen


@pytest.mark.parametrize("tile", [None, 4, 8])
def test_deterministic_batched_decode_is_alone_bit_for_bit(model, tile):
    """8 sequences decoded together in blocks of `tile` rows give each sequence's alone logits
    bitwise (tile=None: the engine's deterministic tile on this device)."""
    tile = tile or deterministic_tile(model.device)
    steps = 6
    batch = _prefilled(model, PROMPTS, steps)
    seqs, logits_b = _greedy(
        model, [c for c, _ in batch], [t for _, t in batch], steps,
        lambda cs, ts: decode_batch(model, cs, ts, tile=tile),
    )
    for i, (cache, tok) in enumerate(_prefilled(model, PROMPTS, steps)):
        alone, logits_a = _greedy(model, [cache], [tok], steps, lambda cs, ts: decode_batch(model, cs, ts, tile=tile))
        assert alone[0] == seqs[i]
        for step, (a, b) in enumerate(zip(logits_a, logits_b)):
            assert _bitwise(a[0], b[i]), f"sequence {i}, step {step}"


def test_batched_decode_without_the_mode_matches_alone_in_fp32():
    """One product over all rows (no tile): fp32 greedy answers equal decode_step's alone."""
    model = load_model(dtype="fp32")
    steps = 8
    batch = _prefilled(model, PROMPTS, steps)
    seqs, _ = _greedy(model, [c for c, _ in batch], [t for _, t in batch], steps,
                      lambda cs, ts: decode_batch(model, cs, ts))
    for i, (cache, tok) in enumerate(_prefilled(model, PROMPTS, steps)):
        alone, _ = _greedy(model, [cache], [tok], steps, lambda cs, ts: decode_step(model, cs[0], ts[0])[None])
        assert alone[0] == seqs[i], f"sequence {i}"


def test_the_deterministic_engine_answers_as_its_batched_decode(model):
    """An engine in the deterministic mode decodes alone through the batched step's blocks:
    its answer equals the plain engine's prefill followed by decode_batch in a block."""
    det = QCFuseEngine(model, config=EngineConfig(deterministic=True))
    plain = internals(det).replace(config=EngineConfig())
    assert det._steps.request_threads is not None or model.device.type != "cpu"
    r = det.answer(QUESTION, DOCS[:3], method="full", max_new_tokens=10)
    again = det.answer(QUESTION, DOCS[:3], method="full", max_new_tokens=10)
    assert r.token_ids == again.token_ids and _bitwise(r.first_logits, again.first_logits)
    p = plain.answer(QUESTION, DOCS[:3], method="full", max_new_tokens=10)
    assert _bitwise(p.first_logits, r.first_logits)  # the mode changes decoding only
    ids = torch.as_tensor(r.prompt_ids)
    _, kv = model.hf_forward(ids, keep=1)
    cache = KVCache(model, len(ids) + 10)
    fill_from_hf(cache, kv)
    tile = deterministic_tile(model.device)
    toks = [r.token_ids[0]]
    for _ in range(len(r.token_ids) - 1):
        toks.append(int(decode_batch(model, [cache], [toks[-1]], tile=tile)[0].argmax()))
    assert toks == r.token_ids


# ----------------------------------------------------------------------------- store verify --deep


def _verify(capsys, store: Path, *extra: str) -> tuple[int, dict]:
    code = main(["store", "verify", "--store", str(store), "--json", "--deep", *extra])
    return code, json.loads(capsys.readouterr().out)


def test_store_verify_deep_reports_drift(tmp_path, capsys):
    store = tmp_path / "store"
    engine = open_engine(store)
    keys = engine.build_chunks(DOCS[:4], register=False)  # no text index: no vector index expected
    code, rep = _verify(capsys, store)
    assert code == 0, rep
    assert rep["drift"]["checked"] == 4 and rep["drift"]["identical"] == 4 and not rep["drift"]["drifted"]
    code, rep = _verify(capsys, store, "--sample", "2")
    assert code == 0 and rep["drift"]["checked"] == 2 and rep["drift"]["entries"] == 4
    # a cache computed elsewhere (another build, device or library): valid entry, other bits
    chunk = engine.caches.store.get(keys[1])
    assert isinstance(chunk, KVChunk)
    engine.caches.store.delete(keys[1])
    engine.caches.store.put(KVChunk(chunk.key, chunk.token_ids, chunk.k * 1.01, chunk.v))
    engine.caches.store.close()
    code, rep = _verify(capsys, store)
    assert code == 1
    assert [d["key"] for d in rep["drift"]["drifted"]] == [keys[1].to_string()]
    assert rep["drift"]["drifted"][0]["max_abs_diff"] > 0 and rep["drift"]["identical"] == 3
    code, rep = _verify(capsys, store, "--remove")
    assert code == 0
    code, rep = _verify(capsys, store)
    assert code == 0 and rep["drift"]["checked"] == 3 and rep["drift"]["identical"] == 3
    with pytest.raises(SystemExit) as exc:  # argparse: usage and the reason, exit status 2
        main(["store", "verify", "--store", str(store), "--deep", "--sample", "0"])
    assert exc.value.code == 2
    assert "--sample: must be a whole number >= 1, got '0'" in capsys.readouterr().err
