"""What `qcfuse bench trace` sends: a corpus, the requests of each batch, and the prompts the
frameworks' default RAG templates render from them (eval/trace.py runs them).

The templates, as text (the frameworks need not be installed; tests/test_bench_trace.py
checks them against LlamaIndex's and LangChain's own where those are):

    llamaindex   the query engine's text-QA template: for a chat model its system message
                 (TEXT_QA_SYSTEM_PROMPT) and user message (TEXT_QA_PROMPT_TMPL_MSGS), for a
                 completion model DEFAULT_TEXT_QA_PROMPT_TMPL; the nodes' texts joined by a
                 blank line (`context_str`)
    langchain    the RAG tutorial's prompt (hub `rlm/rag-prompt`), one human message; the
                 documents joined by a blank line (`format_docs`); to a completion model
                 LangChain sends the chat prompt as a string, "Human: <message>"

The corpus: `--pool-docs` documents of about `--doc-tokens` tokens each. A byte-level
tokenizer (a model of a named shape) gets generated text of that length (workload.make_text);
any other the paragraphs of a QA set (`--dataset`, any format eval/datasets.py reads) or of
the packaged sample corpus, one after another in a seeded order (shuffled again each time
they run out), cut into documents of that length.

The requests: batch b of B has C x R requests (C clients, R each); request i draws
`--docs-per-request` distinct documents by Zipf(s) over the pool (document j with weight
1/(j+1)^s among those not drawn yet: load.make_requests), in a random order, and asks a new
question - the next record's question of `--dataset`, else generated text - rendered with
template i mod the templates.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

from qcfuse_core.eval.load import LoadRequest, make_requests
from qcfuse_core.eval.workload import Workload, make_text, text_words

LLAMAINDEX_SYSTEM = (
    "You are an expert Q&A system that is trusted around the world.\n"
    "Always answer the query using the provided context information, and not prior knowledge.\n"
    "Some rules to follow:\n"
    "1. Never directly reference the given context in your answer.\n"
    "2. Avoid statements like 'Based on the context, ...' or 'The context information ...' or anything along "
    "those lines."
)
LLAMAINDEX_QA = (
    "Context information is below.\n"
    "---------------------\n"
    "{context_str}\n"
    "---------------------\n"
    "Given the context information and not prior knowledge, answer the query.\n"
    "Query: {query_str}\n"
    "Answer: "
)
LANGCHAIN_RAG = (
    "You are an assistant for question-answering tasks. Use the following pieces of retrieved context to answer "
    "the question. If you don't know the answer, just say that you don't know. Use three sentences maximum and "
    "keep the answer concise.\n"
    "Question: {question} \n"
    "Context: {context} \n"
    "Answer:"
)
TEMPLATES = ("llamaindex", "langchain")
DOC_JOIN = "\n\n"  # both frameworks join retrieved texts with a blank line


@dataclass(frozen=True)
class Prompt:
    """One request's prompt: chat messages, or a completion prompt."""

    messages: list[dict] | None = None
    text: str | None = None


def render(template: str, docs: list[str] | tuple[str, ...], question: str, chat: bool) -> Prompt:
    """The prompt `template` renders for `docs` and `question`, as a chat or a completion."""
    context = DOC_JOIN.join(docs)
    if template == "llamaindex":
        user = LLAMAINDEX_QA.format(context_str=context, query_str=question)
        if chat:
            return Prompt(
                messages=[{"role": "system", "content": LLAMAINDEX_SYSTEM}, {"role": "user", "content": user}]
            )
        return Prompt(text=user)
    if template == "langchain":
        human = LANGCHAIN_RAG.format(question=question, context=context)
        return Prompt(messages=[{"role": "user", "content": human}]) if chat else Prompt(text="Human: " + human)
    raise ValueError(f"unknown template {template!r}; valid: {', '.join(TEMPLATES)}")


# ----------------------------------------------------------------------------- the corpus


def _paragraphs(dataset: Path | None) -> tuple[list[str], list[str]]:
    """(paragraphs, questions) of a QA set, or of the packaged sample corpus (no questions)."""
    if dataset is not None:
        from qcfuse_core.eval.datasets import load_dataset

        examples = load_dataset(dataset)
        paras = list(dict.fromkeys(p.strip() for e in examples for p in e.passages if p.strip()))
        return paras, [e.question for e in examples if e.question]
    folder = resources.files("qcfuse_core.data").joinpath("sample_corpus")
    paras = []
    for f in sorted(folder.iterdir(), key=lambda f: f.name):
        if f.name.endswith(".md"):
            paras += [p.strip() for p in f.read_text().split("\n\n") if p.strip() and not p.startswith("#")]
    return paras, []


def corpus(tokenizer, n: int, doc_tokens: int, seed: int, dataset: Path | None = None) -> tuple[Workload, list[str]]:
    """`n` distinct documents of about `doc_tokens` tokens (module docstring) and the
    questions of `dataset` (none without one) -> (the pool, the questions)."""
    rng = random.Random(f"trace-corpus-{seed}")
    words = text_words(tokenizer)
    if not words:  # a byte-level tokenizer: generated text of the same shape
        made = [make_text(tokenizer, doc_tokens, rng, words) for _ in range(n)]
        return Workload(made, [f"trace-{i}" for i in range(n)], "", ""), []
    paras, questions = _paragraphs(dataset)
    if not paras:
        raise ValueError(f"no paragraphs in {dataset}")
    texts: list[str] = []
    seen: set[str] = set()
    stream: list[str] = []
    ids: list[int] = []  # the paragraphs' tokens, one after another, cut into documents
    for _ in range(50 * n):  # a document repeating another (a small source, cycled) is made again
        if len(texts) == n:
            break
        while len(ids) < doc_tokens:
            if not stream:
                stream = rng.sample(paras, len(paras))
            ids += tokenizer(stream.pop() + " ", add_special_tokens=False).input_ids
        doc, ids = ids[:doc_tokens], ids[doc_tokens:]
        text = tokenizer.decode(doc).strip().replace("\n\n", "\n")
        if text not in seen:
            seen.add(text)
            texts.append(text)
    if len(texts) < n:
        raise ValueError(f"could only make {len(texts)} distinct documents of {doc_tokens} tokens, not {n}")
    return Workload(texts, [f"trace-{i}" for i in range(n)], "", ""), questions


def batches(
    tokenizer,
    pool: Workload,
    questions: list[str],
    n_batches: int,
    per_batch: int,
    docs_per_request: int,
    query_tokens: int,
    zipf_s: float,
    seed: int,
) -> list[list[LoadRequest]]:
    """The trace: `n_batches` lists of `per_batch` requests (module docstring); every
    question asked once (a QA set's questions in order, from a seeded start)."""
    n = n_batches * per_batch
    reqs = make_requests(
        tokenizer,
        pool,
        n,
        docs_per_request,
        query_tokens,
        seed,
        popularity="zipf" if zipf_s > 0 else "uniform",
        zipf_s=zipf_s,
    )
    if questions:
        if len(set(questions)) < n:
            raise ValueError(f"the dataset asks {len(set(questions))} distinct questions; the trace needs {n}")
        start = random.Random(f"trace-questions-{seed}").randrange(len(questions))
        unique = list(dict.fromkeys(questions[start:] + questions[:start]))
        reqs = [replace(r, question=q) for r, q in zip(reqs, unique)]
    return [reqs[b * per_batch : (b + 1) * per_batch] for b in range(n_batches)]


def warmup_docs(tokenizer, k: int, doc_tokens: int, seed: int) -> list[str]:
    """Documents outside the corpus, as long as its own, for the warm-up requests: the first
    timed requests are not the first prompts of their length (their caches never count)."""
    rng = random.Random(f"trace-warmup-{seed}")
    return [make_text(tokenizer, doc_tokens, rng, text_words(tokenizer)) for _ in range(k)]
