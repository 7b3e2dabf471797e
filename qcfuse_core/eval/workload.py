"""What the speed benchmarks (`bench ttft`, `bench load`) share: the model, the chunk texts, a
store that holds them in one tier, the options choosing these, and the JSON record.

- The store: the engine's default tiers (`open_default_store`, what `open_engine` opens), or
  one tier sized to hold the texts (`open_tier_store`).
- The model: random weights of a named shape with a byte-level tokenizer (`--shape
  llama-3.1-8b`: 1 byte = 1 token, nothing downloaded), a tiny test model (`tiny-llama`),
  or a packaged / local model (`--model`, default the embedded one).
- Texts: random letters for a byte-level tokenizer (exact token counts), random words from
  the sample corpus otherwise (re-tokenising can differ by a token or two).
- The JSON record: `{"env": {...}, "rows": [...]}` with the machine, versions, load and the
  command's arguments (file paths reduced to their names).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import random
from dataclasses import dataclass
from pathlib import Path

import torch

TINY_PREFIX = "tiny-"


# ----------------------------------------------------------------------------- the model


def build_adapter(args):
    """The adapter that args.shape / args.model / args.dtype / args.device name."""
    from qcfuse_core.model.adapter import _dtype, load_model
    from qcfuse_core.model.testing import SHAPES, shaped_model, tiny_model

    dtype = _dtype(args.dtype, args.device)
    if args.shape and args.shape.startswith(TINY_PREFIX):
        return tiny_model(args.shape[len(TINY_PREFIX) :], dtype=dtype, tokenizer=True)
    if args.shape:
        if args.shape not in SHAPES:
            raise ValueError(f"unknown shape {args.shape!r}; valid: {', '.join(SHAPES)} (or tiny-<arch>)")
        return shaped_model(args.shape, dtype=dtype, device=args.device, seed=args.seed, tokenizer=True)
    return load_model(None if args.model in (None, "embedded") else args.model, dtype=dtype, device=args.device)


def kv_bytes_per_token(adapter) -> int:
    return adapter.shape.kv_bytes(1, adapter.dtype)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------- texts


@dataclass(frozen=True)
class Workload:
    """Chunk texts with node ids, a question and a system prompt (the prefix's text)."""

    texts: list[str]
    node_ids: list[str]
    question: str
    system: str


def _byte_level(tokenizer) -> bool:
    return len(tokenizer) <= 256


def make_text(tokenizer, n: int, rng: random.Random, words: list[str]) -> str:
    """About `n` tokens of text: n random letters/spaces for a byte-level tokenizer (exact),
    random words cut to n tokens otherwise (re-tokenising can differ by a token or two)."""
    if _byte_level(tokenizer):
        return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz     ") for _ in range(n)).strip().rjust(n, "x")
    text = " ".join(rng.choice(words) for _ in range(2 * n))
    ids = tokenizer(text, add_special_tokens=False).input_ids[:n]
    return tokenizer.decode(ids).strip()


def _corpus_words() -> list[str]:
    from importlib import resources

    folder = resources.files("qcfuse_core.data").joinpath("sample_corpus")
    text = " ".join(f.read_text() for f in folder.iterdir() if f.name.endswith(".md"))
    return [w for w in text.split() if w.isalpha()]


def text_words(tokenizer) -> list[str]:
    """The words `make_text` draws from for this tokenizer (none for a byte-level one)."""
    return [] if _byte_level(tokenizer) else _corpus_words()


def make_question(tokenizer, n: int, rng: random.Random, words: list[str]) -> str:
    return make_text(tokenizer, n, rng, words) + "?"


def make_workload(
    tokenizer, chunks: int, chunk_tokens: int, query_tokens: int, prefix_tokens: int, seed: int, tag: str = ""
) -> Workload:
    rng = random.Random(seed)
    words = text_words(tokenizer)
    texts = [make_text(tokenizer, chunk_tokens, rng, words) for _ in range(chunks)]
    question = make_question(tokenizer, query_tokens, rng, words)
    system = make_text(tokenizer, prefix_tokens, rng, words) if prefix_tokens else ""
    return Workload(texts, [f"bench{tag}-{i}" for i in range(chunks)], question, system)


# ----------------------------------------------------------------------------- the store


def open_tier_store(root: Path, tier: str, nbytes: int, cuda: bool, storage_dtype: str = "auto"):
    """A tiered store at `root` that keeps entries in `tier` only (plus the disk copy),
    chunks written in `storage_dtype` (fp8: half of bf16's bytes)."""
    from qcfuse_core.store import open_store

    room = 3 * nbytes + (256 << 20)  # pinned blocks round up to powers of two (docs/benchmarks.md)
    gpu = room if tier == "gpu" else 0
    host = room if tier in ("gpu", "host") else 0
    if tier == "gpu" and not cuda:
        raise ValueError("--tier gpu needs a CUDA device")
    return open_store(root, memory_bytes=host, gpu_bytes=gpu, use_cuda=cuda, storage_dtype=storage_dtype)


def open_default_store(
    root: Path, cuda: bool, storage_dtype: str = "auto", host_bytes: int | None = None, gpu_bytes: int | None = None
):
    """The store `open_engine` opens, at `root`: tiers sized from the machine (the host tier
    from available RAM; on CUDA the GPU tier from the engine's GPU budget, store/sizing.py).
    host_bytes sizes the host tier instead; gpu_bytes caps the GPU chunk tier (at most that
    much chunk cache on the GPU, within the budget)."""
    from qcfuse_core.store import open_store

    # None: the defaults open_engine leaves them at
    return open_store(root, use_cuda=cuda, storage_dtype=storage_dtype, memory_bytes=host_bytes, gpu_bytes=gpu_bytes)


# ----------------------------------------------------------------------------- the command line


def bench_subparsers(sub) -> argparse._SubParsersAction:
    """The subcommands of `qcfuse bench`, creating `bench` if no other module has."""
    bench = sub.choices.get("bench")
    if bench is None:
        bench = sub.add_parser("bench", help="benchmarks")
        return bench.add_subparsers(dest="bench_command", required=True)
    return next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction))


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return n


def positive_float(text: str) -> float:
    """argparse type: a number > 0."""
    x = float(text)
    if not x > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text}")
    return x


def add_report_options(p: argparse.ArgumentParser, threads: bool = True) -> None:
    """--threads (CPU intra-op threads per request), --json and --markdown."""
    if threads:
        p.add_argument(
            "--threads",
            type=int,
            default=0,
            help="CPU intra-op threads for every request (0: the engine's policy, qcfuse_core/engine/threads.py)",
        )
    p.add_argument("--json", default=None, help="write rows + environment to this file")
    p.add_argument("--markdown", default=None, help="write the table to this file")


def add_model_options(p: argparse.ArgumentParser) -> None:
    """--shape / --model, --device, --dtype (what `build_adapter` reads)."""
    from qcfuse_core.model.testing import SHAPES

    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--shape",
        default=None,
        help=f"random weights of a named shape: {', '.join(SHAPES)} (or tiny-llama etc. for tests)",
    )
    g.add_argument(
        "--model",
        default=None,
        help="packaged model name (smollm2-135m, gemma3-270m), a local HF model folder, or 'embedded' (default)",
    )
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu, cuda")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="model dtype")


def add_storage_dtype_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--storage-dtype",
        default="auto",
        choices=["auto", "bf16", "fp16", "fp8"],
        help="dtype the store writes chunks in (fp8-e4m3 with per-head scales: half of bf16)",
    )


# ----------------------------------------------------------------------------- the record


def portable_args(args) -> dict:
    """The command's arguments with file and folder paths reduced to their names (results are
    committed; where a scratch folder lived on the machine that ran them does not matter)."""
    out = vars(args) | {"func": None}
    for key in ("store", "json", "markdown", "rates", "plot"):
        if out.get(key):
            out[key] = Path(out[key]).name
    return out


def environment(args, timed_call: str, partial: bool = False) -> dict:
    return {
        "timed_call": timed_call,
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "host": platform.node(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "argv": portable_args(args),
        "partial": partial,
    }


def write_json(args, rows: list[dict], timed_call: str, extras: dict | None = None, partial: bool = False) -> None:
    """`{"env": ..., "rows": ..., **extras}` to args.json (nothing when it is unset)."""
    if not args.json:
        return
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    data = {"env": environment(args, timed_call, partial), "rows": rows, **(extras or {})}
    Path(args.json).write_text(json.dumps(data, indent=1, default=str))


def write_reports(args, rows: list[dict], timed_call: str, table: str, plot=None) -> None:
    """A finished run's reports: the markdown table printed and written to --markdown, the JSON
    to --json, and `plot(rows, path)` to --plot where the command has one."""
    print(table)
    write_json(args, rows, timed_call)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    if plot is not None and getattr(args, "plot", None):
        plot(rows, Path(args.plot))
