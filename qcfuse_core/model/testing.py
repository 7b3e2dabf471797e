"""Tiny random-weight models of every supported architecture, for tests and benchmarks.

Weights are random (seeded) - exactness tests need the architecture's arithmetic, not its
knowledge. Named real shapes (`SHAPES`) build full-size models with random weights for
timing on a GPU, where the numbers do not depend on weight values. Nothing is downloaded.
"""

from __future__ import annotations

from typing import Any

import torch

from qcfuse_core.model.adapter import ModelAdapter

_TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=4096,
)

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(_TINY, rope_theta=10000.0),
    "llama3-rope": dict(
        _TINY,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "mistral": dict(_TINY, sliding_window=None, rope_theta=10000.0),
    "qwen2": dict(_TINY, rope_theta=10000.0),
    "qwen3": dict(_TINY, head_dim=16, rope_theta=10000.0),
    # Gemma 3: sliding layers with a window shorter than the test prompts (so rows cross its
    # edge), a local and a global RoPE base, a query scaling that differs from head_dim**-0.5,
    # and the final logit soft-capping HF applies when it is set
    "gemma3": dict(
        _TINY,
        head_dim=16,
        sliding_window=12,
        query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        final_logit_softcapping=30.0,
    ),
    # Mistral with its sliding window on every layer
    "mistral-swa": dict(_TINY, sliding_window=10, rope_theta=10000.0),
}

SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-3.1-8b": (
        "llama",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            max_position_embeddings=131072,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ),
    ),
    "qwen3-8b": (
        "qwen3",
        dict(
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            max_position_embeddings=40960,
            rope_theta=1000000.0,
        ),
    ),
    "mistral-7b": (
        "mistral",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=32768,
            max_position_embeddings=32768,
            sliding_window=None,
            rope_theta=1000000.0,
        ),
    ),
}


def _build(family: str, cfg: dict, dtype: torch.dtype, device: str, seed: int) -> torch.nn.Module:
    import transformers as tf

    config_cls, model_cls = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM),
    }[family]
    torch.manual_seed(seed)
    config = config_cls(**cfg, tie_word_embeddings=False, attn_implementation="sdpa")
    with torch.device(device):
        model = model_cls(config)
    if family == "gemma3":  # HF starts Gemma's (1 + w) norm weights at 0: make them matter
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.normal_(0.0, 0.2)
    return model.to(dtype).eval()


def tiny_model(
    arch: str = "llama", *, dtype: torch.dtype = torch.float32, seed: int = 0, tokenizer: bool = False
) -> ModelAdapter:
    """A 3-layer random model of `arch` (one of TINY_CONFIGS); with `tokenizer`, a byte-level
    one over its 256-token vocabulary, so the text-level engine API runs on it."""
    if arch not in TINY_CONFIGS:
        raise ValueError(f"unknown tiny arch {arch!r}; valid: {', '.join(TINY_CONFIGS)}")
    family = arch.split("-")[0].replace("llama3", "llama")
    return ModelAdapter(
        _build(family, TINY_CONFIGS[arch], dtype, "cpu", seed),
        tokenizer=byte_tokenizer() if tokenizer else None,
        name=f"tiny-{arch}",
    )


def _byte_chars() -> dict[int, str]:
    """byte -> a printable character (the usual byte-level BPE alphabet)."""
    keep = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + list(range(ord("\xae"), 256))
    )
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def byte_tokenizer():
    """A fast HF tokenizer whose ids are UTF-8 bytes (0-255); byte 0 is EOS. No chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = _byte_chars()
    tok = Tokenizer(models.BPE(vocab={c: b for b, c in chars.items()}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=chars[0])


def shaped_model(
    shape: str, *, dtype: torch.dtype = torch.bfloat16, device: str = "cuda", seed: int = 0, tokenizer: bool = False
) -> ModelAdapter:
    """A full-size model of a named shape with random weights (for timing only); with
    `tokenizer`, the byte-level one (1 byte = 1 token), so text goes in without downloads."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; valid: {', '.join(SHAPES)}")
    family, cfg = SHAPES[shape]
    model = _build(family, cfg, dtype, device, seed)
    return ModelAdapter(model, tokenizer=byte_tokenizer() if tokenizer else None, name=f"random-{shape}")


def cache_alone(adapter: ModelAdapter, ids: torch.Tensor):
    """A segment alone at positions 0..n-1 -> KVChunk (pre-RoPE K), as ingestion makes it
    (for models without a tokenizer: tests and the low-level fusion API)."""
    from qcfuse_core.ingest.prefill import prefill_alone_batch
    from qcfuse_core.types import ChunkKey, KVChunk

    ((k, v),) = prefill_alone_batch(adapter, [ids])
    return KVChunk(ChunkKey.for_tokens(adapter.fingerprint(), ids), ids.clone(), k, v)
