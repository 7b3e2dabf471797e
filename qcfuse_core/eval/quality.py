"""`qcfuse bench quality`: every method on the same prompts, scored against full prefill and gold.

Per example (one process, chunk caches built once and shared by every method):

    1. build     the engine's RAG prompt; chunk caches computed alone (MemoryStore per example)
    2. full      HF prefill of [prompt ; gold] -> first-token logits, gold NLL, greedy answer
    3. methods   for each method x ratio: select on the prompt, fused prefill of
                 [prompt ; gold] with the gold rows recomputed -> first-token logits, gold
                 NLL (teacher-forced), then greedy decoding from the prompt's fused cache
    4. score     F1 / EM / contains / ROUGE-L vs gold, agreement with full's answer,
                 KL(full || method) on the first token, recompute share, TTFT

Appending the gold answer after the suffix changes nothing before it (causal attention), so
one prefill gives both the first-token distribution and the teacher-forced gold NLL; the
query-aware selectors see the prompt without the gold tokens (no leak). TTFT here is
select + prefill of the gold-extended prompt (a few tokens longer than the real one).

Per-example records stream to a JSONL file (nothing is lost if the run stops); `aggregate`
turns them into the table rows: one per dataset, method and ratio.

Full prefill is the costliest step (about half of a long question on a CPU) and does not
depend on the method, so `run(reference=DIR)` keeps what the scores need of it - first-token
logits, gold NLL, greedy answer - in one file per question, keyed by the model fingerprint
and the exact token ids; a rerun of other methods (a changed selector) reads it instead of
prefilling again. A run of `full` alone needs no chunk caches and skips building them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from collections import defaultdict
from pathlib import Path

import torch

from qcfuse_core.engine.api import QCFuseEngine
from qcfuse_core.engine.frame import eos_ids
from qcfuse_core.engine.guard import GUARDED_LABEL as GUARDED_LABEL
from qcfuse_core.engine.guard import escalate, first_token_margin
from qcfuse_core.engine.request import Loading, Planned, Selected
from qcfuse_core.eval import fidelity as F
from qcfuse_core.eval import metrics as M
from qcfuse_core.eval import oracle as _oracle  # noqa: F401  (registers the `oracle` bound for --methods)
from qcfuse_core.eval.datasets import Example, dataset_name, load_dataset
from qcfuse_core.eval.hooks import internals
from qcfuse_core.model import batched as lockstep
from qcfuse_core.model.fusion import FusedPrompt, KVCache, Segment, decode_step, fill_from_hf, fused_prefill
from qcfuse_core.selection.base import SELECTORS, get_selector
from qcfuse_core.store import MemoryStore

log = logging.getLogger(__name__)

ROW_KEYS = (
    "dataset",
    "method",
    "ratio",
    "n",
    "f1",
    "em",
    "contains",
    "rouge_l",
    "agree_exact",
    "agree_rouge_l",
    "kl_first_token",
    "answer_kl",
    "gold_nll",
    "recompute_share",
    "ttft_ms",
    "first_agree",
    "answer_agree",
    "answer_prefix",
)
DEFAULT_METHODS = ("full", "naive", "qcfuse", "cacheblend", "epic", "qcall", "qclast", "random")
# fused-prompt caches kept at once per question to decode their answers together (they are
# fused first, then decoded as a group): the variants are split into groups that fit
DECODE_BYTES = 4 << 30


def _greedy_seq(
    engine: QCFuseEngine, cache: KVCache, first_logits: torch.Tensor, max_new: int, keep_logits: bool = False
) -> tuple[list[int], list[int], list[torch.Tensor]]:
    """Greedy decoding from `cache` -> (answer ids, scored sequence, logits).

    The scored sequence is every token the decoding chose: the answer ids, plus the
    end-of-answer token when it stopped on one; with keep_logits, logits[i] (vocab,) is the
    distribution that chose seq[i] (full prefill's distribution along its own answer, which
    the answer-level KL compares a method's with)."""
    eos = eos_ids(engine.adapter)
    ids: list[int] = []
    logits = [first_logits] if keep_logits else []
    token = int(torch.argmax(first_logits))
    while token not in eos and len(ids) < max_new:
        ids.append(token)
        if len(ids) == max_new:
            break
        step = decode_step(engine.adapter, cache, token)
        if keep_logits:
            logits.append(step)
        token = int(torch.argmax(step))
    seq = ids + ([token] if token in eos else [])
    return ids, seq, logits


def _greedy(engine: QCFuseEngine, cache: KVCache, first_logits: torch.Tensor, max_new: int) -> str:
    ids, _, _ = _greedy_seq(engine, cache, first_logits, max_new)
    return engine.tokenizer.decode(ids, skip_special_tokens=True).strip()


def teacher_fused(
    engine: QCFuseEngine, loading: Loading, selected: Selected, method: str, teacher: torch.Tensor, capacity: int = 0
) -> tuple[torch.Tensor, KVCache, int]:
    """Step 5 with `teacher` token ids forced after the prompt (in-memory caches only) ->
    (logits of the last len(teacher) + 1 rows, the prompt's fused cache at the prompt's
    length with room for `capacity` more tokens, recomputed context tokens).

    The teacher rows are recomputed and never seen by the selection; causal attention keeps
    everything before them as in `Steps.fuse`, so the first row is the prompt's
    first-token distribution (tests/test_quality_bench.py checks both)."""
    if loading.session is not None:
        raise ValueError("teacher forcing needs the prompt's caches in memory (lookup with streaming=False)")
    prompt, sel = loading.prompt, selected.selection
    T, G = prompt.num_tokens, int(teacher.numel())
    full_prompt = FusedPrompt(prompt.segments + [Segment("suffix", teacher)])
    cache = KVCache(engine.adapter, T + G + capacity)
    if not get_selector(method).fused:
        logits, kv = engine.adapter.hf_forward(full_prompt.token_ids, keep=G + 1)
        fill_from_hf(cache, kv)
        recomputed = prompt.context_tokens
    else:
        extra = torch.arange(T, T + G)
        hook = sel.on_layer_end
        if hook is not None:  # rows it narrows to are the prompt's: keep the teacher's

            def hook(state, _inner=sel.on_layer_end):
                nxt = _inner(state)
                return None if nxt is None else torch.cat([nxt.cpu(), extra])

        out = fused_prefill(
            engine.adapter,
            full_prompt,
            torch.cat([sel.rows, extra]),
            full_layers=sel.full_layers,
            on_layer_end=hook,
            kv_out=cache,
            logits_last=G + 1,
        )
        logits, rows = out.logits, out.rows
        recomputed = int(prompt.mask("chunk", "text")[rows[rows < T]].sum())
    cache.length = T
    return logits, cache, recomputed


def forced_logits(engine: QCFuseEngine, cache: KVCache, first_logits: torch.Tensor, seq: list[int]) -> torch.Tensor:
    """Teacher forcing of `seq` on a prompt cache -> (len(seq), vocab): row i is the
    distribution over seq[i] given the prompt and seq[:i]. The cache is left at the prompt's
    length (decoding can start from it again). Equals a fused prefill of [prompt ; seq] with
    the seq rows recomputed (`teacher_fused`): those rows attend to the same
    per-layer cache (tests/test_quality_bench.py)."""
    start = cache.length
    rows = [first_logits.float()]
    for t in seq[:-1]:
        rows.append(decode_step(engine.adapter, cache, int(t)).float())
    cache.length = start
    return torch.stack(rows)


def answer_kl(full_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """(n, vocab) x 2 -> (n,) KL(full || method) per answer position, in nats."""
    p = torch.log_softmax(full_logits.float(), -1)
    q = torch.log_softmax(logits.float(), -1)
    return (p.exp() * (p - q)).sum(-1)


def round_trip(prompt: FusedPrompt, storage: str) -> FusedPrompt:
    """The prompt with every cached segment's K/V encoded in storage dtype `storage` and
    decoded back (what a store in that dtype hands the fused prefill). Anchors are not
    copied: selection runs on the exact prompt, as a tiered store's probe reads its sidecar
    (anchors and critical-layer K kept in the chunk's own dtype)."""
    from dataclasses import replace

    from qcfuse_core.store.codec import STORAGE_NAMES, check_storage_name, decode_layer, encode_layer
    from qcfuse_core.types import KVChunk

    dtype = STORAGE_NAMES[check_storage_name(storage)]
    if dtype is None:
        return prompt
    segs = []
    for seg in prompt.segments:
        c = seg.chunk
        if isinstance(c, KVChunk):
            k, v = torch.empty_like(c.k), torch.empty_like(c.v)
            for layer in range(c.num_layers):
                kv, scale = encode_layer(c.k[layer], c.v[layer], dtype)
                k[layer], v[layer] = decode_layer(kv, scale, c.k.dtype)
            seg = replace(seg, chunk=KVChunk(c.key, c.token_ids, k, v))
        segs.append(seg)
    return FusedPrompt(segs)


def _text_scores(answer: str, ex: Example, full_answer: str | None) -> dict:
    golds = ex.answers
    d = dict(
        answer=answer,
        f1=M.best(M.token_f1, answer, golds),
        em=M.best(M.exact_match, answer, golds),
        contains=M.best(M.contains, answer, golds),
        rouge_l=M.best(M.rouge_l, answer, golds),
    )
    if full_answer is not None:
        d.update(
            agree_exact=float(M.normalize(answer) == M.normalize(full_answer)),
            agree_rouge_l=M.rouge_l(answer, full_answer),
        )
    return d


def run_example(
    engine: QCFuseEngine,
    ex: Example,
    methods,
    ratios,
    options: dict,
    max_new: int,
    gold_tokens: int = 64,
    *,
    variants: list[tuple[str, str, float | None, dict]] | None = None,
    target: str = "gold",
    reference: Path | None = None,
    storage: str = "auto",
    decode_bytes: int = DECODE_BYTES,
) -> list[dict]:
    """All methods on one example -> per (method, ratio) records.

    variants: explicit (label, method, ratio, options) runs instead of methods x ratios
    (records carry the label as `variant`). target: what `gold_nll` teacher-forces after the
    prompt - the first gold alias ("gold") or full prefill's own greedy answer ("full": a
    fidelity score for the whole answer, not just its first token; costs one more forward).
    reference: a file holding full prefill's outputs for this question (read when its key -
    model fingerprint, prompt + gold token ids, max_new - matches, else computed and written).
    storage: the chunk caches go through that storage dtype's codec before the fused prefill
    ("fp8", "bf16"; "auto" = exact); the records' method names get ":" + storage.

    Every method's record has `answer_kl`: the mean over full prefill's greedy answer (its
    tokens and the end-of-answer token) of KL(full || method) per token, each method's
    cache teacher-forced along full's answer; `answer_kl_tokens` lists the per-token values.
    """
    if target not in ("gold", "full"):
        raise ValueError(f"target must be 'gold' or 'full', got {target!r}")
    if reference is not None and target != "gold":
        raise ValueError("a stored full-prefill reference holds the gold target only (target='gold')")
    engine = internals(engine).replace(
        store=MemoryStore()
    )  # chunk caches of this example only (fp32 6K tokens: ~300 MB)
    steps = internals(engine).steps
    if variants is None:
        variants = [
            (m, m, r, options)
            for m in methods
            if m != "full"
            for r in (ratios if get_selector(m).uses_ratio else [None])
        ]
    t0 = time.perf_counter()  # full prefill alone needs no chunk caches
    pieces = engine.frame.rag_pieces(ex.question, list(ex.passages))
    looked = steps.lookup(pieces, "naive" if variants else "full", streaming=False)
    loading = steps.start_loading(looked, Planned("naive", frozenset()))
    prompt = loading.prompt
    build_ms = (time.perf_counter() - t0) * 1e3
    T = prompt.num_tokens
    full_sel = steps.select(prompt, "full", 1.0)
    full_answer = None
    full_seq = full_seq_logits = None
    if target == "full":  # full prefill's greedy answer first: it is the teacher-forced target
        pre = steps.fuse(loading, full_sel, "full", capacity=max_new)
        ids, full_seq, lg = _greedy_seq(engine, pre.cache, pre.logits[-1], max_new, keep_logits=True)
        full_answer, full_seq_logits = engine.tokenizer.decode(ids, skip_special_tokens=True).strip(), torch.stack(lg)
        del pre
        tokenize = engine.caches.tokenize
        gold = tokenize(full_answer)[:gold_tokens] if full_answer else tokenize(ex.answers[0])[:1]
    else:
        gold = engine.caches.tokenize(ex.answers[0])[:gold_tokens]
    G = int(gold.numel())
    prompt_g = FusedPrompt(prompt.segments + [Segment("suffix", gold)])
    common = dict(
        id=ex.id,
        prompt_tokens=T,
        context_tokens=prompt.context_tokens,
        chunks=len(prompt.chunk_spans()),
        gold_tokens=G,
        build_ms=build_ms,
        target=target,
    )
    if engine.config.cache.chunk_sink:
        common["chunk_sink"] = True  # the chunk caches' format (CacheConfig.chunk_sink)
    # 2. full prefill: the reference (read from `reference` when an earlier run stored it)
    key = _reference_key(engine, prompt_g, max_new) if reference is not None else None
    ref = _load_reference(reference, key) if reference is not None and key is not None else None
    if ref is None:
        t1 = time.perf_counter()
        logits, full_cache, _ = teacher_fused(engine, loading, full_sel, "full", gold, capacity=max_new)
        # logits (G+1, vocab): positions T-1 .. T+G-1
        full_ms = (time.perf_counter() - t1) * 1e3
        if full_answer is None:
            ids, full_seq, lg = _greedy_seq(engine, full_cache, logits[0], max_new, keep_logits=True)
            full_answer, full_seq_logits = (
                engine.tokenizer.decode(ids, skip_special_tokens=True).strip(),
                torch.stack(lg),
            )
        ref = dict(
            key=key,
            first_logits=logits[0].clone(),
            gold_nll=M.nll(logits[:G], gold),
            answer=full_answer,
            ms=full_ms,
            answer_seq=torch.tensor(full_seq, dtype=torch.int64),
            answer_logits=full_seq_logits,
        )
        del logits, full_cache
        if reference is not None:
            _save_reference(reference, ref)
    else:
        common["full_from_reference"] = True
    full_first, full_answer = ref["first_logits"], ref["answer"]
    full_seq, full_seq_logits = ref["answer_seq"].tolist(), ref["answer_logits"]
    records = [
        dict(
            common,
            method="full",
            ratio=None,
            first_margin=first_token_margin(ref["first_logits"]),
            first_agree=1.0,
            answer_agree=1.0,
            answer_prefix=len(full_seq) - int(len(full_seq) > 0 and full_seq[-1] in eos_ids(engine.adapter)),
            kl_first_token=0.0,
            answer_kl=0.0,
            answer_tokens=len(full_seq),
            gold_nll=ref["gold_nll"],
            recompute_share=1.0,
            ttft_ms=ref["ms"],
            **_text_scores(full_answer, ex, full_answer),
        )
    ]
    fuse_loading = loading if storage == "auto" else Loading(round_trip(prompt, storage))
    suffix = "" if storage == "auto" else ":" + storage
    # 3. every other method (or variant): select and fuse, then decode in groups (lockstep)
    group = max(1, decode_bytes // max(1, _cache_bytes(engine, T + G + max_new)))
    pending: list[tuple] = []
    for label, method, ratio, opts in variants:
        t2 = time.perf_counter()
        # the engine's own steps; the selection never sees the gold tokens (teacher-forced after it)
        selected = steps.select(prompt, method, ratio or 0.0, options=opts)
        select_ms = (time.perf_counter() - t2) * 1e3
        tail, cache, recomputed = teacher_fused(engine, fuse_loading, selected, method, gold, capacity=max_new)
        ttft = (time.perf_counter() - t2) * 1e3
        # tail: positions T-1 .. T+G-1
        scores = dict(
            first_margin=first_token_margin(tail[0]),
            first_agree=float(int(torch.argmax(tail[0])) == int(torch.argmax(full_first))),
            kl_first_token=M.kl_divergence(full_first, tail[0]),
            gold_nll=M.nll(tail[:G], gold),
            recompute_share=recomputed / max(1, prompt.context_tokens),
            ttft_ms=ttft,
            select_ms=select_ms,
        )
        pending.append((label, method, ratio, opts, selected.selection, scores, cache, tail[0].clone()))
        del tail, cache
        if len(pending) == group:
            records += _finish(
                engine, pending, ex, full_answer, full_seq, full_seq_logits, common, suffix, storage, max_new, prompt
            )
            pending = []
    if pending:
        records += _finish(
            engine, pending, ex, full_answer, full_seq, full_seq_logits, common, suffix, storage, max_new, prompt
        )
    return records


def _cache_bytes(engine: QCFuseEngine, tokens: int) -> int:
    return engine.adapter.shape.kv_bytes(tokens, engine.adapter.dtype)


def _finish(
    engine: QCFuseEngine,
    group: list[tuple],
    ex: Example,
    full_answer: str,
    full_seq: list[int],
    full_seq_logits: torch.Tensor,
    common: dict,
    suffix: str,
    storage: str,
    max_new: int,
    prompt: FusedPrompt,
) -> list[dict]:
    """The records of fused variants: each one's greedy answer and answer-level KL, all decoded
    at once (`decode_answers`), and its answer-level fidelity to full prefill (eval/fidelity.py:
    one teacher-forced full-prefill forward over the prompt and the variant's answer)."""
    own: list[list[float]] = []
    answers, forced = decode_answers(engine, [g[6] for g in group], [g[7] for g in group], full_seq, max_new, own)
    question = set(prompt.segments[-1].token_ids.tolist())  # the suffix: the question and the answer cue
    records = []
    for (label, method, ratio, opts, sel, sc, _, _), ids, rows, mine in zip(group, answers, forced, own):
        per_token = answer_kl(full_seq_logits, rows)
        answer = engine.tokenizer.decode(ids, skip_special_tokens=True).strip()
        fid = F.measure(engine.adapter, prompt.token_ids, ids)
        rec = dict(
            common,
            method=method + suffix,
            ratio=ratio,
            first_margin=sc["first_margin"],
            first_agree=sc["first_agree"],
            answer_agree=fid.agree,
            answer_prefix=fid.prefix,
            split_margin=fid.split_margin,
            # the answer's own greedy margins, and which of its tokens are not in the question
            # (the content tokens: an answer that restates the question first has few early on)
            answer_margins=[round(m, 5) for m in mine],
            content_mask=[int(t not in question) for t in ids],
            kl_first_token=sc["kl_first_token"],
            answer_kl=float(per_token.mean()),
            answer_tokens=len(full_seq),
            answer_kl_tokens=[round(float(x), 6) for x in per_token],
            gold_nll=sc["gold_nll"],
            recompute_share=sc["recompute_share"],
            ttft_ms=sc["ttft_ms"],
            select_ms=sc["select_ms"],
            **_text_scores(answer, ex, full_answer),
        )
        if storage != "auto":
            rec["storage"] = storage
        if label != method:
            rec["variant"] = label
        if getattr(get_selector(method), "query_aware", False) and opts:
            rec["options"] = dict(opts)
        if "mass_covered" in sel.details:
            rec["mass_covered"] = sel.details["mass_covered"]
        if "target_mass" in sel.details:
            rec["target_mass"] = sel.details["target_mass"]
        records.append(rec)
    return records


def decode_answers(
    engine: QCFuseEngine,
    caches: list[KVCache],
    firsts: list[torch.Tensor],
    seq: list[int],
    max_new: int,
    margins: list[list[float]] | None = None,
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Per prompt cache (its first-token logits beside it): the greedy answer ids as `_greedy`
    decodes them, and the teacher forcing of `seq` as `forced_logits` computes it - the same
    numbers, with fewer decode steps:

    - a forced row is the distribution after the prompt and seq[:i]; while the greedy answer
      so far equals seq's start, that is the greedy step's own logits (the same decode steps
      on the same cache), so the forced pass only decodes from where the answers part;
    - the caches advance together, one token each per `lockstep.decode_steps` call (each
      sequence's arithmetic unchanged, the weights read once for all of them).

    -> (answer ids per cache, forced logits (len(seq) or 1, vocab) per cache). Each cache is
    left at a length past its prompt (decode from it again only after resetting length).
    margins: a list that gets, per cache, the p1 - p2 margin of every greedy choice (the
    answer's own confidence, token by token: the guard's candidate signals)."""
    eos = eos_ids(engine.adapter)
    B, n = len(caches), len(seq)
    need = 1 + max(0, n - 1)  # forced rows: the first token's, then one per seq token but the last
    start = [c.length for c in caches]
    ids: list[list[int]] = [[] for _ in range(B)]
    rows: list[list[torch.Tensor]] = [[f.float()] for f in firsts]
    match = [True] * B  # ids[b] == seq[:len(ids[b])] so far
    token = [int(torch.argmax(f)) for f in firsts]
    own = [[first_token_margin(f)] for f in firsts]
    active = [b for b in range(B) if token[b] not in eos and max_new > 0]
    while active:  # greedy, as _greedy_seq
        stepping = []
        for b in active:
            i = len(ids[b])
            match[b] = match[b] and i < n and seq[i] == token[b]
            ids[b].append(token[b])
            if len(ids[b]) < max_new:
                stepping.append(b)
        if not stepping:
            break
        for b, logits in zip(
            stepping, lockstep.decode_steps(engine.adapter, [caches[b] for b in stepping], [token[b] for b in stepping])
        ):
            if match[b] and len(rows[b]) == len(ids[b]) and len(rows[b]) < need:  # prefix seq[:len(ids)]
                rows[b].append(logits.float())
            token[b] = int(torch.argmax(logits))
            own[b].append(first_token_margin(logits))
        active = [b for b in stepping if token[b] not in eos]
    # the forced pass from where each answer left seq: row i decodes seq[i - 1] after seq[:i - 1]
    for b in range(B):
        caches[b].length = start[b] + len(rows[b]) - 1
    todo = [b for b in range(B) if len(rows[b]) < need]
    while todo:
        outs = lockstep.decode_steps(engine.adapter, [caches[b] for b in todo], [seq[len(rows[b]) - 1] for b in todo])
        for b, logits in zip(todo, outs):
            rows[b].append(logits.float())
        todo = [b for b in todo if len(rows[b]) < need]
    for c, s in zip(caches, start):
        c.length = s
    if margins is not None:
        margins.extend(m[: max(1, len(i))] for m, i in zip(own, ids))
    return ids, [torch.stack(r) for r in rows]


def _reference_key(engine: QCFuseEngine, prompt: FusedPrompt, max_new: int) -> str:
    h = hashlib.sha256(f"{engine.adapter.fingerprint()}|{max_new}|".encode())
    h.update(prompt.token_ids.to(torch.int64).numpy().tobytes())
    return h.hexdigest()


def _load_reference(path: Path, key: str) -> dict | None:
    if not path.is_file():
        return None
    try:
        ref = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a damaged file is recomputed, not trusted
        log.warning("unreadable full-prefill reference %s (%s); recomputing", path, e)
        return None
    if "answer_logits" not in ref:
        log.info("full-prefill reference %s predates the answer-level metric; recomputing", path)
        return None
    if ref.get("key") != key:
        log.info("full-prefill reference %s is for another prompt or model; recomputing", path)
        return None
    return ref


def _save_reference(path: Path, ref: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    torch.save(ref, tmp)
    os.replace(tmp, path)  # never a half-written file under the real name


def reference_path(root: Path, dataset: str, ex_id: str) -> Path:
    """Where run() keeps one question's full-prefill reference under `root`."""
    return Path(root) / dataset / (re.sub(r"[^A-Za-z0-9_.-]", "_", str(ex_id)) + ".pt")


def run(
    engine: QCFuseEngine,
    dataset: str,
    methods,
    ratios,
    *,
    limit: int | None,
    offset: int = 0,
    options: dict | None = None,
    max_new: int = 32,
    jsonl: Path | None = None,
    reference: Path | None = None,
    storage: str = "auto",
) -> list[dict]:
    """Run the benchmark on one dataset file; records stream to `jsonl` (appended; done ids
    skipped). reference: a folder of full-prefill references (see the module doc)."""
    unknown = [m for m in methods if m not in SELECTORS]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; valid: {', '.join(sorted(SELECTORS))}")
    name = dataset_name(dataset)
    done = set()
    if jsonl is not None and jsonl.is_file():
        done = {(r["dataset"], r["id"]) for r in map(json.loads, jsonl.read_text().splitlines()) if r}
    out = []
    picked = load_dataset(dataset, limit=limit, offset=offset)
    todo = [ex for ex in picked if (name, ex.id) not in done]
    if len(todo) < len(picked):
        log.info(
            "%s: %d of %d questions already in %s; %d to run",
            name,
            len(picked) - len(todo),
            len(picked),
            jsonl,
            len(todo),
        )
    from tqdm import tqdm

    for ex in tqdm(todo, desc=name, unit="question", disable=None):  # a bar on a terminal, quiet in logs
        t0 = time.perf_counter()
        ref = reference_path(reference, name, ex.id) if reference is not None else None
        recs = [
            dict(r, dataset=name)
            for r in run_example(engine, ex, methods, ratios, options or {}, max_new, reference=ref, storage=storage)
        ]

        log.info("%s %s: %d records in %.1f s", name, ex.id, len(recs), time.perf_counter() - t0)
        if jsonl is not None:
            with jsonl.open("a") as f:
                for r in recs:
                    f.write(json.dumps(r) + "\n")
        out.extend(recs)
    return out


def guard_settings(engine: QCFuseEngine) -> tuple[float, float, tuple[float, ...]]:
    """The engine's quality guard as `with_guard` takes it: (its threshold for this model,
    the engine's ratio, its ladder). Raises ValueError for a model without a calibration."""
    threshold, _ = internals(engine).steps.guard.threshold()
    if threshold is None:
        raise ValueError(f"no quality-guard calibration for {engine.adapter.name}: run `qcfuse calibrate-guard` first")
    return threshold, engine.config.ratio, engine.config.guard.ladder


def guard_methods(methods, ratios, guard: tuple[float, float, tuple[float, ...]]) -> tuple[list[str], list[float]]:
    """The methods and ratios a run needs for the guard's records: qcfuse at the base ratio
    and at every ladder ratio below 1, and full prefill (the ladder's last rung)."""
    _, base, ladder = guard
    methods = list(dict.fromkeys([*methods, "full", "qcfuse"]))
    ratios = sorted({*ratios, base, *(r for r in ladder if r < 1.0)})
    return methods, ratios


def guard_records(records: list[dict], threshold: float, base: float, ladder: tuple[float, ...]) -> list[dict]:
    """One question's records -> the quality guard's record (method `qcfuse+guard`, at the
    base ratio), as the engine's guard would answer: qcfuse at `base`; where its first-token
    margin is below `threshold`, each ladder rung's record in turn (1.0: full prefill's) until
    one's margin clears it (`engine/guard.py`, the same decision). Its recompute_share is
    the share spent over every pass run and its ttft_ms the time of every pass (each pass's
    select + fused prefill as the bench times them); `escalated`, `guard_action` and
    `guard_margin` say what the guard did. [] when a record it needs is missing (the run lacks a ratio)."""
    by = {(r["method"], r["ratio"]): r for r in records if r.get("variant") is None and "first_margin" in r}
    first = by.get(("qcfuse", base))
    if first is None:
        return []
    chosen, spent, action, ttft = first, first["recompute_share"], "kept", first["ttft_ms"]
    if escalate(first["first_margin"], threshold):
        for ratio in ladder:
            if ratio < 1.0 and ratio <= base:
                continue
            rung = by.get(("full", None)) if ratio >= 1.0 else by.get(("qcfuse", ratio))
            if rung is None:
                return []
            chosen, action = rung, "full" if ratio >= 1.0 else f"ratio {ratio:g}"
            spent += rung["recompute_share"]
            ttft += rung["ttft_ms"]
            if ratio >= 1.0 or not escalate(rung["first_margin"], threshold):
                break
    keep = {k: v for k, v in chosen.items() if k not in ("method", "ratio", "answer_kl_tokens", "options")}
    return [
        dict(
            keep,
            method=GUARDED_LABEL,
            ratio=base,
            recompute_share=spent,
            ttft_ms=ttft,
            escalated=float(action != "kept"),
            guard_action=action,
            guard_margin=first["first_margin"],
            guard_threshold=threshold,
            base_first_agree=first["first_agree"],
        )
    ]


def with_guard(records: list[dict], guard: tuple[float, float, tuple[float, ...]]) -> list[dict]:
    """The records with the quality guard's record of every question (`guard_records`) in
    place of any stored ones: derived from the per-ratio records at aggregation, so they
    always follow the threshold in use."""
    out = [r for r in records if r["method"] != GUARDED_LABEL]
    by_q: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in out:
        by_q[(r["dataset"], r["id"])].append(r)
    for recs in by_q.values():
        out += guard_records(recs, *guard)
    return out


GUARD_RECORD_KEYS = (
    "dataset",
    "id",
    "base_first_agree",
    "first_agree",
    "agree_exact",
    "agree_rouge_l",
    "escalated",
    "guard_action",
    "guard_margin",
    "guard_threshold",
    "recompute_share",
    "ttft_ms",
)
"""What `bench quality --guard` keeps of each question's guard record (OUT.guard.jsonl)."""


def guard_summary(records: list[dict], base: float) -> dict:
    """Per dataset and over all: how the guard did - catch rate (of the questions where qcfuse
    at `base` gives another greedy first token than full prefill, the share escalated),
    escalation rate (of all), first-token agreement before and after, the mean recompute
    share spent."""
    out: dict[str, dict] = {}
    rows = [r for r in records if r["method"] == GUARDED_LABEL and r["ratio"] == base]
    for ds in sorted({r["dataset"] for r in rows}) + ["all"]:
        g = [r for r in rows if ds == "all" or r["dataset"] == ds]
        bad = [r for r in g if not r["base_first_agree"]]
        out[ds] = {
            "n": len(g),
            "disagree_before": len(bad),
            "catch_rate": round(sum(r["escalated"] for r in bad) / len(bad), 4) if bad else None,
            "escalation_rate": round(sum(r["escalated"] for r in g) / len(g), 4) if g else None,
            "first_agree_before": round(sum(r["base_first_agree"] for r in g) / len(g), 4) if g else None,
            "first_agree_after": round(sum(r["first_agree"] for r in g) / len(g), 4) if g else None,
            "recompute_share": round(sum(r["recompute_share"] for r in g) / len(g), 4) if g else None,
        }
    return out


def format_guard(summary: dict) -> str:
    """`guard_summary` as a markdown table."""
    head: tuple[str, ...] = ("dataset", "n", "disagree_before", "catch_rate", "escalation_rate")
    head += ("first_agree_before", "first_agree_after", "recompute_share")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for ds, d in summary.items():
        cells = [ds] + [
            "-" if d[k] is None else f"{d[k]:.4f}" if isinstance(d[k], float) else str(d[k]) for k in head[1:]
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def aggregate(records: list[dict]) -> list[dict]:
    """Per-example records -> one row per (dataset, method, ratio), means over the examples
    that every method finished (so methods are compared on the same questions)."""
    by_ds: dict[str, dict] = defaultdict(lambda: defaultdict(dict))
    for r in records:
        by_ds[r["dataset"]][(r["method"], r["ratio"])][r["id"]] = r
    rows = []
    for ds, groups in by_ds.items():
        common_ids = set.intersection(*(set(g) for g in groups.values()))
        for (method, ratio), g in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] or -1)):
            sel = [g[i] for i in sorted(common_ids)]
            if not sel:
                continue
            row = {"dataset": ds, "method": method, "ratio": ratio, "n": len(sel)}
            for k in ROW_KEYS[4:]:
                vals = [s[k] for s in sel if s.get(k) is not None]
                row[k] = round(sum(vals) / len(vals), 5) if vals else None
            rows.append(row)
    return rows


def merge_rerun(
    old: list[dict], new: list[dict], methods: set[str], rename: dict[str, str], new_as: dict[str, str] | None = None
) -> tuple[list[dict], list[str]]:
    """Records of a partial rerun merged into earlier ones -> (merged, problems).

    Old records of `methods` are replaced by the new ones (kept under `rename[method]` when
    given); other old records stay. The rerun's `full` records must reproduce the old ones
    (same greedy answer, gold NLL within 1e-4): each mismatch is a problem, since the kept
    methods were scored against the old full prefill. new_as[method] files the new records
    under another name instead (an ablation beside the method, whose old rows then stay).
    """
    old_full = {(r["dataset"], r["id"]): r for r in old if r["method"] == "full"}
    problems = []
    for r in new:
        if r["method"] != "full":
            continue
        o = old_full.get((r["dataset"], r["id"]))
        if o is None:
            problems.append(f"{r['dataset']} {r['id']}: no old full-prefill record")
        elif o["answer"] != r["answer"] or abs(o["gold_nll"] - r["gold_nll"]) > 1e-4:
            problems.append(
                f"{r['dataset']} {r['id']}: full prefill differs "
                f"({o['answer']!r} vs {r['answer']!r}, gold NLL {o['gold_nll']:.5f} vs {r['gold_nll']:.5f})"
            )
    new_as = new_as or {}
    merged = []
    for r in old:
        if r["method"] in methods and r["method"] not in new_as:
            if r["method"] in rename:
                merged.append(dict(r, method=rename[r["method"]]))
        else:
            merged.append(r)
    merged += [dict(r, method=new_as.get(r["method"], r["method"])) for r in new if r["method"] in methods]
    return merged, problems


def format_table(rows: list[dict]) -> str:
    head = [
        "dataset",
        "method",
        "ratio",
        "n",
        "kl_first_token",
        "answer_kl",
        "gold_nll",
        "answer_agree",
        "agree_exact",
        "agree_rouge_l",
        "contains",
        "f1",
        "em",
        "rouge_l",
        "recompute_share",
        "ttft_ms",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = []
        for k in head:
            v = r.get(k)
            cells.append(
                "-"
                if v is None
                else (
                    f"{v:.4f}" if isinstance(v, float) and k != "ttft_ms" else f"{v:.0f}" if k == "ttft_ms" else str(v)
                )
            )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


SUMMARY_KEYS = ("kl_first_token", "answer_kl", "gold_nll", "answer_agree", "agree_exact", "agree_rouge_l", "contains")


def summarize(rows: list[dict], records: list[dict] | None = None, n_boot: int = 2000, seed: int = 0) -> dict:
    """The table rows -> what the quality targets read (a dict, JSON-ready):

    per_set[dataset][method@ratio]: kl_gap_closed = 1 - KL(method) / KL(naive) (the share of
        the naive-to-full first-token KL gap closed; full's own KL is 0) and contains_vs_full
        (method's contains minus full's); with the per-question `records`, also a 95% paired
        bootstrap interval of each ([low, high]; questions resampled with replacement,
        `n_boot` times, seeded) - how far the point estimate could move with other questions;
    averaged[method@ratio]: SUMMARY_KEYS averaged over the datasets that have the row (each
        dataset weighs the same, whatever its n), with the dataset count.
    """
    by_ds: dict[str, dict[str, dict]] = defaultdict(dict)
    for r in rows:
        by_ds[r["dataset"]][_label(r)] = r
    per_set: dict[str, dict] = {}
    for ds, rs in by_ds.items():
        naive, full = rs.get("naive"), rs.get("full")
        out = {}
        for label, r in rs.items():
            if label in ("full", "naive"):
                continue
            d = {}
            if naive and naive.get("kl_first_token") and r.get("kl_first_token") is not None:
                d["kl_gap_closed"] = round(1.0 - r["kl_first_token"] / naive["kl_first_token"], 4)
            if full and full.get("contains") is not None and r.get("contains") is not None:
                d["contains_vs_full"] = round(r["contains"] - full["contains"], 4)
            out[label] = d
        per_set[ds] = out
    if records is not None:
        for ds, out in per_set.items():
            for label, d in out.items():
                d.update(_bootstrap(records, ds, label, n_boot, seed))
    averaged: dict[str, dict] = {}
    labels = sorted({lab for rs in by_ds.values() for lab in rs})
    for label in labels:
        have = [rs[label] for rs in by_ds.values() if label in rs]
        avg: dict = {"datasets": len(have)}
        for k in SUMMARY_KEYS:
            vals = [r[k] for r in have if r.get(k) is not None]
            avg[k] = round(sum(vals) / len(vals), 4) if vals else None
        averaged[label] = avg
    return {"per_set": per_set, "averaged": averaged}


def _bootstrap(records: list[dict], dataset: str, label: str, n_boot: int, seed: int) -> dict:
    """95% paired bootstrap intervals of kl_gap_closed and contains_vs_full for one row, over
    the questions every method of the dataset finished (as `aggregate` compares them)."""
    by_id: dict[str, dict[str, dict]] = defaultdict(dict)
    labels = set()
    for r in records:
        if r["dataset"] == dataset:
            by_id[r["id"]][_label(r)] = r
            labels.add(_label(r))
    ids = sorted(i for i, d in by_id.items() if labels <= set(d))
    if not ids or label not in labels:
        return {}
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(len(ids), (n_boot, len(ids)), generator=gen)

    def col(lab: str, key: str) -> torch.Tensor | None:
        vals = [by_id[i][lab].get(key) for i in ids]
        return None if any(v is None for v in vals) else torch.tensor(vals, dtype=torch.float64)

    def interval(x: torch.Tensor) -> list[float]:
        lo, hi = torch.quantile(x, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
        return [round(lo, 4), round(hi, 4)]

    out = {}
    kl, kl_naive = col(label, "kl_first_token"), col("naive", "kl_first_token") if "naive" in labels else None
    if kl is not None and kl_naive is not None:
        den = kl_naive[idx].mean(1)
        if bool((den > 0).all()):
            out["kl_gap_closed_ci"] = interval(1.0 - kl[idx].mean(1) / den)
    c, c_full = col(label, "contains"), col("full", "contains") if "full" in labels else None
    if c is not None and c_full is not None:
        out["contains_vs_full_ci"] = interval((c - c_full)[idx].mean(1))
    return out


def _label(row: dict) -> str:
    return row["method"] if row.get("ratio") is None else f"{row['method']}@{row['ratio']:g}"


def format_summary(summary: dict) -> str:
    lines = ["| dataset | method | KL gap closed (95% CI) | contains vs full (95% CI) |", "|---|---|---|---|"]
    for ds, out in summary["per_set"].items():
        for label, d in out.items():
            gap, dc = d.get("kl_gap_closed"), d.get("contains_vs_full")
            gci, cci = d.get("kl_gap_closed_ci"), d.get("contains_vs_full_ci")
            g = (
                "-"
                if gap is None
                else f"{100 * gap:.1f}%" + (f" ({100 * gci[0]:.1f} to {100 * gci[1]:.1f})" if gci else "")
            )
            c = "-" if dc is None else f"{dc:+.3f}" + (f" ({cci[0]:+.3f} to {cci[1]:+.3f})" if cci else "")
            lines.append(f"| {ds} | {label} | {g} | {c} |")
    lines += [
        "",
        "| averaged over datasets | n sets | " + " | ".join(SUMMARY_KEYS) + " |",
        "|---|---|" + "---|" * len(SUMMARY_KEYS),
    ]
    for label, avg in summary["averaged"].items():
        cells = ["-" if avg[k] is None else f"{avg[k]:.4f}" for k in SUMMARY_KEYS]
        lines.append(f"| {label} | {avg['datasets']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
