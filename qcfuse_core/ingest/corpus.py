"""Turning files into chunks for ingestion, and the sample corpus the project ships.

Chunk ids are deterministic (sha256 of source name and text), so re-ingesting a file is a
no-op in both Chroma and the chunk store.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from qcfuse_core.types import chunk_id

# questions the sample corpus answers (`qcfuse demo`, the studio's examples)
DEMO_QUESTIONS = (
    "Who founded the Zephyr Institute, and in which year?",
    "When did the Northern Railway close, and why?",
    "How tall is the Cape Wrayth lighthouse?",
)
TEXT_SUFFIXES = (".md", ".txt", ".markdown", ".rst")
DATASET_SUFFIXES = (".json", ".jsonl")


@dataclass(frozen=True)
class Chunk:
    id: str
    text: str
    source: str


def sample_corpus_dir() -> Path:
    return Path(str(resources.files("qcfuse_core") / "data" / "sample_corpus"))


# `qcfuse demo`'s chunks: the sample corpus's twelve documents (~1.2K tokens in all) packed in
# order into chunks of ~250 tokens, so a question's context has the size of a real RAG prompt
# (5 chunks, ~1.2K tokens) rather than four ~100-token documents, where the fixed cost of a
# fused request is a large share of the little there is to save.
DEMO_CHUNK_CHARS = 1100


def demo_chunks(max_chars: int = DEMO_CHUNK_CHARS) -> list[Chunk]:
    """The sample corpus's documents, in order, packed into chunks of at most `max_chars`
    (paragraphs kept whole, `split_text`); their source is "sample_corpus"."""
    text = "\n\n".join(f.read_text(encoding="utf-8") for f in iter_text_files([sample_corpus_dir()]))
    return [Chunk(chunk_id("sample_corpus", t), t, "sample_corpus") for t in split_text(text, max_chars)]


def split_text(text: str, max_chars: int = 1200) -> list[str]:
    """Paragraph-aware split: paragraphs (blank-line separated) packed greedily up to max_chars.

    A paragraph longer than max_chars is cut at sentence ends ('. ') where possible.
    """
    if max_chars < 100:
        raise ValueError(f"max_chars must be >= 100, got {max_chars}")
    paras = [p.strip() for p in text.replace("\r\n", "\n").split("\n\n") if p.strip()]
    pieces: list[str] = []
    for p in paras:
        while len(p) > max_chars:
            cut = p.rfind(". ", 0, max_chars)
            cut = cut + 1 if cut > max_chars // 3 else max_chars
            pieces.append(p[:cut].strip())
            p = p[cut:].strip()
        if p:
            pieces.append(p)
    chunks: list[str] = []
    for p in pieces:
        if chunks and len(chunks[-1]) + 2 + len(p) <= max_chars:
            chunks[-1] = chunks[-1] + "\n\n" + p
        else:
            chunks.append(p)
    return chunks


def iter_text_files(paths: list[str | Path]) -> list[Path]:
    """Files to ingest: text/markdown files given directly or found (recursively) in folders."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files.extend(sorted(f for f in p.rglob("*") if f.suffix.lower() in TEXT_SUFFIXES and f.is_file()))
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"no such file or folder: {p}")
    return files


def source_name(path: Path) -> str:
    """The file's name as a chunk source: its bytes decoded as UTF-8, each byte that is not
    UTF-8 replaced by U+FFFD (a name from a Latin-1 file system must not stop an ingest)."""
    return path.name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def chunks_from_file(path: Path, max_chars: int = 1200) -> list[Chunk]:
    text = path.read_text(encoding="utf-8")
    name = source_name(path)
    return [Chunk(chunk_id(name, t), t, name) for t in split_text(text, max_chars)]
