"""The sidecar of a chunk: what selection needs before the bulk of the chunk arrives.

A small safetensors file beside the entry, read first and kept in host memory:

    anchors.<name>   what `KVChunk.anchors` holds (anchor indices per layer, and whatever the
                     selector keeps beside them, e.g. the anchors' K/V)
    layer_k.<lll>    (T, Hkv, D) pre-RoPE K of one critical layer

Its validity rules are the entry's: a manifest row with a checksum, a header naming the
chunk key and the format version; anything else is a counted miss.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from qcfuse_core.store.entry import FORMAT_NAME, FORMAT_VERSION, EntryFormatError, header_length
from qcfuse_core.types import ChunkKey

SIDECAR_FORMAT = FORMAT_NAME + "-sidecar"


@dataclass
class Sidecar:
    """anchors: name -> tensor (as `KVChunk.anchors`); layer_keys: layer -> K (T, Hkv, D)."""

    anchors: dict[str, torch.Tensor] = field(default_factory=dict)
    layer_keys: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        ts = [*self.anchors.values(), *self.layer_keys.values()]
        return sum(t.numel() * t.element_size() for t in ts)


def encode_sidecar(key: ChunkKey, side: Sidecar) -> bytes:
    tensors = {f"anchors.{m}": t.detach().cpu().contiguous() for m, t in side.anchors.items()}
    tensors.update({f"layer_k.{l:03d}": t.detach().cpu().contiguous() for l, t in side.layer_keys.items()})
    meta = {"format": SIDECAR_FORMAT, "format_version": str(FORMAT_VERSION), "key": key.to_string()}
    return st_save(tensors, metadata=meta)


def decode_sidecar(blob: bytes, key: ChunkKey) -> Sidecar:
    """The sidecar in `blob`; raises EntryFormatError unless it is this key's, in this format."""
    try:
        S = header_length(blob[:8])
        meta = json.loads(blob[8:S]).get("__metadata__", {})
        tensors = st_load(blob)
    except (ValueError, SafetensorError) as e:
        raise EntryFormatError(f"unreadable sidecar: {e}") from e
    if meta.get("format") != SIDECAR_FORMAT or meta.get("format_version") != str(FORMAT_VERSION):
        raise EntryFormatError("sidecar of another format version")
    if meta.get("key") != key.to_string():
        raise EntryFormatError("sidecar names another key")
    side = Sidecar()
    for name, t in tensors.items():
        kind, _, rest = name.partition(".")
        if kind == "anchors":
            side.anchors[rest] = t
        elif kind == "layer_k":
            side.layer_keys[int(rest)] = t
    return side
