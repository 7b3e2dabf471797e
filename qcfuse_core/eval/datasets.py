"""Evaluation sets as (question, passages, gold answers) records, from every format in ../shared/data.

    CacheBlend json     [{question, answers: [str] | [[str]], ctxs: [{title, text}]}]
    MuSiQue (official)  [{id, question, answer, answer_aliases, paragraphs: [{idx, title, paragraph_text, ...}]}]
    HotpotQA (official) [{_id, question, answer, context: [[title, [sentence]]], supporting_facts}]
    LongBench jsonl     {input, context, answers, dataset, _id} per line (multi_news: passages
                        split at `^Passage \\d+:`)

The format is detected from the first record's keys; an unknown layout raises naming the
known ones. Passages are one cached chunk each.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

FORMATS = ("cacheblend", "musique", "hotpotqa", "longbench")

_PASSAGE = re.compile(r"^Passage \d+:\s*\n?", re.MULTILINE)

MULTI_NEWS_INSTRUCTION = "Write a one-page summary of all news."


@dataclass(frozen=True)
class Example:
    id: str
    question: str  # empty for summarisation
    passages: tuple[str, ...]
    answers: tuple[str, ...]  # gold aliases (or reference summaries)
    task: str = "qa"  # qa | summarization
    gold_passages: tuple[int, ...] = field(default=())  # indices into passages, where labelled


def detect_format(first: dict) -> str:
    if "ctxs" in first and "question" in first:
        return "cacheblend"
    if (
        "paragraphs" in first
        and "question_decomposition" in first
        or "paragraph_text" in str(first.get("paragraphs", ""))[:2000]
    ):
        return "musique"
    if "context" in first and "supporting_facts" in first:
        return "hotpotqa"
    if "context" in first and "answers" in first and "input" in first:
        return "longbench"
    raise ValueError(f"unrecognised dataset layout (keys {sorted(first)}); known formats: {', '.join(FORMATS)}")


def load_dataset(path: str | Path, limit: int | None = None, offset: int = 0) -> list[Example]:
    """Read a dataset file in any known format -> examples [offset : offset + limit]."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no dataset file at {path}")
    text = path.read_text()
    if path.suffix == ".jsonl":
        records = [json.loads(line) for line in text.splitlines() if line.strip()]
    else:
        records = json.loads(text)
    if not isinstance(records, list) or not records:
        raise ValueError(f"{path}: expected a non-empty list of records")
    fmt = detect_format(records[0])
    parse = {"cacheblend": _cacheblend, "musique": _musique, "hotpotqa": _hotpotqa, "longbench": _longbench}[fmt]
    end = None if limit is None else offset + limit
    return [parse(r, i) for i, r in enumerate(records[offset:end], start=offset)]


def dataset_name(path: str | Path) -> str:
    return Path(path).stem


def _cacheblend(r: dict, i: int) -> Example:
    answers = []
    for a in r["answers"]:
        answers.extend(a if isinstance(a, list) else [a])
    passages = tuple((f"{c['title']}\n{c['text']}" if c.get("title") else c["text"]) for c in r["ctxs"])
    return Example(str(i), r["question"], passages, tuple(answers))


def _musique(r: dict, i: int) -> Example:
    paras = sorted(r["paragraphs"], key=lambda p: p["idx"])
    passages = tuple(p["title"] + "\n" + p["paragraph_text"] for p in paras)
    gold = tuple(j for j, p in enumerate(paras) if p.get("is_supporting"))
    return Example(
        str(r.get("id", i)),
        r["question"],
        passages,
        tuple([r["answer"]] + list(r.get("answer_aliases", []))),
        gold_passages=gold,
    )


def _hotpotqa(r: dict, i: int) -> Example:
    titles = {t for t, _ in r.get("supporting_facts", [])}
    passages = tuple(title + "\n" + "".join(sents) for title, sents in r["context"])
    gold = tuple(j for j, (title, _) in enumerate(r["context"]) if title in titles)
    return Example(str(r.get("_id", i)), r["question"], passages, (r["answer"],), gold_passages=gold)


def _longbench(r: dict, i: int) -> Example:
    parts = [p.strip() for p in _PASSAGE.split(r["context"]) if p.strip()]
    task = "summarization" if r.get("dataset") in ("multi_news", "samsum", "gov_report") else "qa"
    question = r.get("input", "") or (MULTI_NEWS_INSTRUCTION if task == "summarization" else "")
    return Example(str(r.get("_id", i)), question, tuple(parts), tuple(r["answers"]), task=task)
