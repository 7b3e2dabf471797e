"""The models the studio can switch between: the embedded default, folders named on the
command line, and supported model folders under the cache dir (`<cache dir>/models`).

An entry is listed, not loaded; `StudioService.select_model` loads one (once per process).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

EMBEDDED_ID = "embedded"


@dataclass(frozen=True)
class ModelEntry:
    id: str  # stable within a process: "embedded" or a slug of the folder name
    name: str
    path: str | None  # None: the embedded default (qcfuse_core.model.default_model_dir)
    source: str  # embedded | option | cache
    architecture: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def _architecture(folder: Path) -> str | None:
    """The folder's model class when it is a local HF folder of a supported architecture."""
    from qcfuse_core.model import SUPPORTED_ARCHITECTURES

    cfg = folder / "config.json"
    if not cfg.is_file():
        return None
    try:
        archs = json.loads(cfg.read_text()).get("architectures") or []
    except (OSError, json.JSONDecodeError):
        return None
    return next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "model"


def installed_models(folders: Sequence[str | Path] = ()) -> list[ModelEntry]:
    """Every model the page may offer, the embedded one first (when its package is installed).

    `folders` (the command line's --model) must be supported model folders (ValueError
    otherwise); folders found under the cache dir are listed when they are supported and
    are not the embedded model's converted copy."""
    import importlib.util

    from qcfuse_core.model import DEFAULT_MODEL_NAME, DEFAULT_MODEL_PACKAGE, cache_dir

    out: list[ModelEntry] = []
    seen_ids: set[str] = set()
    seen_paths: set[Path] = set()

    def add(name: str, path: Path | None, source: str, arch: str) -> None:
        base = EMBEDDED_ID if path is None else _slug(name)
        mid, n = base, 2
        while mid in seen_ids:
            mid, n = f"{base}-{n}", n + 1
        seen_ids.add(mid)
        if path is not None:
            seen_paths.add(path.resolve())
        out.append(ModelEntry(mid, name, None if path is None else str(path), source, arch))

    if importlib.util.find_spec(DEFAULT_MODEL_PACKAGE) is not None:
        add(DEFAULT_MODEL_NAME, None, "embedded", "LlamaForCausalLM")
    for f in map(Path, folders):
        arch = _architecture(f)
        if arch is None:
            raise ValueError(f"{f} is not a local model folder of a supported architecture "
                             "(config.json with a Llama, Mistral, Qwen2 or Qwen3 model)")
        if f.resolve() not in seen_paths:
            add(f.name, f, "option", arch)
    root = cache_dir() / "models"
    if root.is_dir():
        for f in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
            if f.name.startswith(DEFAULT_MODEL_NAME) or f.resolve() in seen_paths:
                continue  # the embedded model's converted copy, or listed already
            arch = _architecture(f)
            if arch is not None:
                add(f.name, f, "cache", arch)
    return out
