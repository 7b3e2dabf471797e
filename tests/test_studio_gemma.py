"""The studio's model switch with both packaged models: SmolLM2-135M-Instruct (the default,
chat template) and Gemma-3-270M (base model, the engine's plain prompt frame), through the
JSON API (FastAPI's test client). Each model answers the same comparison (qcfuse vs full)
from its own chunk caches in the one store; switching is a job whose stages the page shows
(converting - only the first time -, loading, warming up).

Slow: loads Gemma-3-270M (and converts it from its GGUF into the cache dir the first time on
a machine). Prompts are two one-line documents and a few new tokens.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("fastapi", reason="the studio extra is not installed: pip install 'qcfuse[studio]'")
from fastapi.testclient import TestClient  # noqa: E402

from qcfuse_core.selection import profiles as critical_layers  # noqa: E402
from qcfuse_core.model.adapter import packaged_model_target  # noqa: E402
from qcfuse_core.store import kv_dir  # noqa: E402
from qcfuse_core.studio.app import create_app  # noqa: E402
from qcfuse_core.studio.service import StudioConfig, StudioService  # noqa: E402

pytestmark = pytest.mark.slow

Q = "When does the ferry leave?"
DOCS = [("ferry.md", "The Oskarvik ferry leaves the harbour at six o'clock every morning."),
        ("bell.md", "The harbour bell in Oskarvik rings once at noon.")]
NEW_TOKENS = 4
STAGES = ("queued", "converting", "loading", "warming up", "loaded")


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    svc = StudioService(StudioConfig(store=tmp_path_factory.mktemp("studio-two-models"), max_new_tokens=NEW_TOKENS))
    svc.ingest_files(DOCS)
    yield svc
    svc.engine.caches.store.close()


@pytest.fixture(scope="module")
def client(service):
    with TestClient(create_app(service)) as c:
        assert c.get("/").status_code == 200  # the page hands out the token its writes need (a cookie)
        yield c


def _switch(client, model_id: str) -> tuple[dict, list[dict]]:
    """POST the switch and follow its job's events to the end -> (final job, progress events)."""
    res = client.post("/api/models/select", json={"id": model_id})
    assert res.status_code == 202, res.text
    job = res.json()
    assert job["kind"] == "model"
    with client.stream("GET", f"/api/jobs/{job['id']}/events") as stream:
        text = "".join(stream.iter_text())
    events = [json.loads(b.split("data: ", 1)[1]) for b in text.split("\n\n") if "data: " in b]
    final = events[-1]
    assert final["state"] == "done", final
    return final, events


def _run(client, ids: list[str]) -> dict:
    body = {"question": Q, "chunk_ids": ids, "max_new_tokens": NEW_TOKENS,
            "modes": [{"method": "qcfuse", "ratio": 0.3}, {"method": "full"}]}
    res = client.post("/api/run", json=body)
    assert res.status_code == 200, res.text
    return res.json()


def _search_ids(client) -> list[str]:
    res = client.post("/api/search", json={"question": Q, "top_k": 2})
    assert res.status_code == 200, res.text
    hits = res.json()["chunks"]
    assert hits[0]["source"] == "ferry.md"
    return [h["id"] for h in hits]


def _check_comparison(service, run: dict, ids: list[str]) -> None:
    """qcfuse and full on the current model: full's answer is the engine's own full prefill
    answer, qcfuse is compared with it (speedup, agreement), details use this model's layers."""
    eng = service.engine
    qc, full = run["results"]
    assert [qc["method"], full["method"]] == ["qcfuse", "full"]
    docs = [t for _, t in DOCS]
    stop = tuple(service.status()["model"]["prompt_frame"]["stop"])
    want = eng.answer(Q, docs, node_ids=ids, method="full", max_new_tokens=NEW_TOKENS, stop=stop)
    assert full["answer"] == want.text and full["new_tokens"] == len(want.token_ids)
    assert full["recomputed_tokens"] == full["context_tokens"]
    assert 0 < qc["recomputed_tokens"] < qc["context_tokens"]
    assert qc["speedup_vs_full"] == pytest.approx(full["ttft_ms"] / qc["ttft_ms"], abs=1e-3)  # rounded to 3 places
    assert set(qc["agreement"]) >= {"same_text", "first_token_same", "common_prefix_tokens"}
    d = service.details(run["run_id"], 0)
    L = eng.adapter.num_layers
    assert d["num_layers"] == L and len(d["recomputed_positions"]) == qc["recomputed_tokens"]
    assert d["critical_layers"] == list(critical_layers.lookup(eng.adapter)[0])
    assert "".join(t["text"] for t in d["tokens"] if d["segments"][t["seg"]]["kind"] == "chunk") == "".join(docs)


def _caches(service, ids: list[str]) -> dict[str, tuple]:
    """Every stored cache of the run's chunks for the current model: key -> (L, Hkv, D, k sum)."""
    out = {}
    for text in (t for _, t in DOCS):
        _, key = service.engine.caches.chunk_tokens(text)
        chunk = service.engine.caches.store.get(key)
        assert chunk is not None, f"no cache of {text!r} for {service.model.id}"
        out[str(key)] = (*chunk.k.shape[:1], *chunk.k.shape[2:], chunk.k.float().sum().item(), chunk.v.clone())
    return out


def test_both_packaged_models_are_listed_by_name(client):
    got = client.get("/api/models").json()
    assert got["current"] == "smollm2-135m"
    by_id = {m["id"]: m for m in got["models"]}
    assert {"smollm2-135m", "gemma3-270m"} <= set(by_id)
    assert by_id["smollm2-135m"]["default"] and by_id["smollm2-135m"]["instruct"] is True
    g = by_id["gemma3-270m"]
    assert g["instruct"] is False and g["architecture"] == "Gemma3ForCausalLM" and g["path"] is None
    assert g["converted"] == packaged_model_target("gemma3-270m")[1]
    assert not [m for m in got["models"] if m["source"] == "cache" and m["name"].startswith("gemma-3-270m-")], \
        "the converted copy is the packaged entry, not a second one"


def test_switch_answers_on_each_model_from_its_own_caches(client, service):
    st = client.get("/api/status").json()
    smol_fp = st["model"]["fingerprint"]
    assert st["model"]["id"] == "smollm2-135m" and st["model"]["prompt_frame"]["kind"] == "chat"
    assert "<|im_start|>" in st["model"]["prompt_frame"]["text"] and st["loading"] is None
    ids = _search_ids(client)
    smol_run = _run(client, ids)
    _check_comparison(service, smol_run, ids)
    smol_caches = _caches(service, ids)

    # -> Gemma-3-270M: a job with its stages (converting only when the cache dir lacks it)
    converted_before = packaged_model_target("gemma3-270m")[1]
    final, events = _switch(client, "gemma3-270m")
    assert events[-1]["stage"] == "loaded" and all(e["stage"] in STAGES for e in events)
    stages = [s["stage"] for s in final["result"]["stages"]]  # every stage, also those too short to be polled
    assert stages == (["loading", "warming up"] if converted_before else ["converting", "loading", "warming up"])
    loading = next(s for s in final["result"]["stages"] if s["stage"] == "loading")
    assert loading["message"].startswith("Loading gemma-3-270m")
    model = final["result"]["model"]
    assert model["id"] == "gemma3-270m" and model["layers"] == 18 and model["fingerprint"] != smol_fp
    frame = model["prompt_frame"]
    cfg = service.engine.config.frame
    assert frame["kind"] == "plain" and "no chat template" in frame["label"] and frame["stop"] == ["\nQuestion:", "\nAnswer:"]
    assert frame["text"] == ("<bos>" + cfg.system_prompt + "\n\n" + cfg.context_header + "{document 1}" + cfg.glue
                             + "{document 2}" + cfg.question_template.format(question="{question}") + "\nAnswer:")
    st = client.get("/api/status").json()
    assert st["model"]["id"] == "gemma3-270m" and st["loading"] is None and st["chunks"] == 2

    ids_g = _search_ids(client)
    assert ids_g == ids  # Chroma is shared: the same chunks, tokenized by Gemma's tokenizer now
    gemma_run = _run(client, ids)
    assert gemma_run["model"] == "gemma3-270m"
    _check_comparison(service, gemma_run, ids)
    gemma_caches = _caches(service, ids)
    assert not set(gemma_caches) & set(smol_caches), "a chunk's cache key names its model"
    assert all(k.startswith(model["fingerprint"]) for k in gemma_caches)
    assert {v[:3] for v in gemma_caches.values()} == {(18, 1, 256)}  # Gemma-3-270M's L, Hkv, D
    assert {v[:3] for v in smol_caches.values()} == {(30, 3, 64)}  # SmolLM2-135M's
    fps = {p.name for p in (kv_dir(service.config.store) / "data").iterdir() if p.is_dir()}
    assert fps == {smol_fp, model["fingerprint"]}

    # -> back to SmolLM2: its caches are where they were, untouched; its answers are the same
    final, events = _switch(client, "smollm2-135m")
    assert [s["stage"] for s in final["result"]["stages"]] == ["loading", "warming up"]
    assert final["result"]["model"]["fingerprint"] == smol_fp
    again = _run(client, ids)
    assert again["results"][0]["cache_hits"] == len(ids) and again["results"][0]["cache_misses"] == 0
    assert [r["answer"] for r in again["results"]] == [r["answer"] for r in smol_run["results"]]
    for key, (L, hkv, d, ksum, v) in _caches(service, ids).items():
        L0, hkv0, d0, ksum0, v0 = smol_caches[key]
        assert (L, hkv, d, ksum) == (L0, hkv0, d0, ksum0) and torch.equal(v, v0)


def test_switching_to_the_loaded_model_is_done_at_once(client, service):
    res = client.post("/api/models/select", json={"id": service.model.id})
    assert res.status_code == 202 and res.json()["state"] == "done"
    assert res.json()["result"]["model"]["id"] == service.model.id
    res = client.post("/api/models/select", json={"id": "gemma-9"})
    assert res.status_code == 404 and "gemma3-270m" in res.json()["error"]["message"]


def test_started_on_gemma_by_name(tmp_path):
    """`qcfuse studio --model gemma3-270m`: the service starts on Gemma, SmolLM2 still offered."""
    svc = StudioService(StudioConfig(store=tmp_path / "store", models=("gemma3-270m",)))
    try:
        st = svc.status()
        assert st["model"]["id"] == "gemma3-270m" and st["model"]["layers"] == 18
        assert st["model"]["prompt_frame"]["kind"] == "plain"
        assert [m["id"] for m in svc.models()["models"]][:2] == ["smollm2-135m", "gemma3-270m"]
    finally:
        svc.engine.caches.store.close()


def test_a_first_use_converts_with_its_message(service, tmp_path, monkeypatch):
    """A cache dir without the converted Gemma: the switch says it converts (first time only,
    where to), converts (here: the converted folder linked in place of the minutes-long
    dequantisation), then loads; afterwards the model is listed as converted."""
    import qcfuse_core.model.adapter as model_mod

    service.select_model("smollm2-135m")
    real, converted = packaged_model_target("gemma3-270m")
    if not converted:
        model_mod.packaged_model_dir("gemma3-270m")  # the earlier tests loaded it: converted
        real = packaged_model_target("gemma3-270m")[0]
    monkeypatch.setenv("QCFUSE_CACHE_DIR", str(tmp_path / "cache"))
    target, done = packaged_model_target("gemma3-270m")
    assert not done and target.parent == tmp_path / "cache" / "models" and target.name == real.name
    assert {m["id"]: m["converted"] for m in service.models()["models"]}["gemma3-270m"] is False
    calls = []

    def convert(key):
        calls.append(key)
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(real, target_is_directory=True)
        return target

    monkeypatch.setattr(model_mod, "packaged_model_dir", convert)
    seen: list[tuple[str, str]] = []
    got = service.select_model("gemma3-270m", lambda stage, message: seen.append((stage, message)))
    assert calls[0] == "gemma3-270m" and got["id"] == "gemma3-270m"
    assert [s for s, _ in seen] == ["converting", "loading", "warming up"]
    msg = seen[0][1]
    assert "first time only" in msg and str(target.parent) in msg and "GGUF" in msg
    assert {m["id"]: m["converted"] for m in service.models()["models"]}["gemma3-270m"] is True
    service.select_model("smollm2-135m")
