"""The models the studio can switch between: the packaged models that are installed
(`qcfuse_core.model.adapter.MODELS`: smollm2-135m, the default, and gemma3-270m), folders named on
the command line, and supported model folders under the cache dir (`<cache dir>/models`).

An entry is listed, not loaded; `StudioService.select_model` loads one (once per process).
A packaged model's id is its registry name, so `--model gemma3-270m` and the page's menu
name the same model. Every model keeps its own chunk caches in the one store: cache keys
start with the model's fingerprint (weights, config, dtype, tokenizer).
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelEntry:
    id: str  # a packaged model's name (smollm2-135m, gemma3-270m) or a slug of the folder name
    name: str
    path: str | None  # None: a packaged model (`packaged` names it), loaded by name
    source: str  # packaged | option | cache
    architecture: str = ""
    packaged: str | None = None  # key in qcfuse_core.model.adapter.MODELS
    default: bool = False  # the embedded default (loaded when no --model is given)
    instruct: bool | None = None  # has a chat template (None: unknown until loaded)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def load_arg(self) -> str | None:
        """What `open_engine(model=...)` takes: None for the default (the same adapter the
        CLI and the integrations share in-process), a packaged name, or the folder."""
        if self.default:
            return None
        return self.packaged if self.packaged is not None else self.path


# architecture of each packaged model (known without converting it)
PACKAGED_ARCHITECTURES = {"smollm2-135m": "LlamaForCausalLM", "gemma3-270m": "Gemma3ForCausalLM"}


def conversion_state(entry: ModelEntry) -> tuple[Path, bool] | None:
    """(converted folder, converted already) for a packaged model; None otherwise. A model
    not converted yet is dequantised from its GGUF into the cache dir on its first load."""
    if entry.packaged is None:
        return None
    from qcfuse_core.model.adapter import packaged_model_target

    return packaged_model_target(entry.packaged)


def _architecture(folder: Path) -> str | None:
    """The folder's model class when it is a local HF folder of a supported architecture."""
    from qcfuse_core.model.adapter import SUPPORTED_ARCHITECTURES

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


def _is_packaged_copy(folder: Path) -> bool:
    """A packaged model's converted folder (<name>-<10 hex tag>): listed as that model."""
    from qcfuse_core.model.adapter import MODELS

    return any(re.fullmatch(re.escape(spec.name) + r"-[0-9a-f]{10}", folder.name) for spec in MODELS.values())


def _installed(key: str) -> bool:
    from qcfuse_core.model.adapter import MODELS

    return importlib.util.find_spec(MODELS[key].package) is not None


def initial_model(models: Sequence[ModelEntry], options: Sequence[str | Path] = ()) -> ModelEntry:
    """The model loaded at start: the first --model option's entry, else the first listed."""
    from qcfuse_core.model.adapter import MODELS

    if not options:
        return models[0]
    first = options[0]
    if str(first) in MODELS and not Path(first).exists():
        return next(m for m in models if m.packaged == str(first))
    return next(m for m in models if m.path is not None and Path(m.path).resolve() == Path(first).resolve())


def installed_models(options: Sequence[str | Path] = ()) -> list[ModelEntry]:
    """Every model the page may offer: the installed packaged models (the default first),
    then `options` (the command line's --model: packaged names or supported model folders;
    ValueError otherwise), then supported folders under the cache dir that are not a
    packaged model's converted copy."""
    from qcfuse_core.model.adapter import DEFAULT_MODEL, MODELS
    from qcfuse_core.paths import cache_dir

    out: list[ModelEntry] = []
    seen_ids: set[str] = set()
    seen_paths: set[Path] = set()

    def add(name: str, path: Path | None, source: str, arch: str, key: str | None = None) -> None:
        base = key if key is not None else _slug(name)
        mid, n = base, 2
        while mid in seen_ids:
            mid, n = f"{base}-{n}", n + 1
        seen_ids.add(mid)
        if path is not None:
            seen_paths.add(path.resolve())
        spec = MODELS.get(key) if key is not None else None
        out.append(
            ModelEntry(
                mid,
                name,
                None if path is None else str(path),
                source,
                arch,
                key,
                key == DEFAULT_MODEL,
                None if spec is None else spec.instruct,
            )
        )

    keys = [DEFAULT_MODEL, *(k for k in MODELS if k != DEFAULT_MODEL)]
    for key in keys:
        if _installed(key):
            add(MODELS[key].name, None, "packaged", PACKAGED_ARCHITECTURES.get(key, ""), key)
    for opt in options:
        if str(opt) in MODELS and not Path(opt).exists():
            if str(opt) not in seen_ids:
                raise ValueError(
                    f"the packaged model {opt} is not installed; install it with:\n    {MODELS[str(opt)].pip}"
                )
            continue
        f = Path(opt)
        arch = _architecture(f)
        if arch is None:
            raise ValueError(
                f"{f} is neither a packaged model ({', '.join(MODELS)}) nor a local model folder of a "
                "supported architecture (config.json with a Llama, Mistral, Qwen2, Qwen3 or Gemma 3 model)"
            )
        if f.resolve() not in seen_paths:
            add(f.name, f, "option", arch)
    root = cache_dir() / "models"
    if root.is_dir():
        for f in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
            if _is_packaged_copy(f) or f.resolve() in seen_paths:
                continue
            arch = _architecture(f)
            if arch is not None:
                add(f.name, f, "cache", arch)
    return out
