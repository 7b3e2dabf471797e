"""One stored chunk cache: its file layout (a layer-major safetensors file) and its image.

An entry image is the exact bytes of the file, held in one uint8 buffer (plain or pinned host
memory, or GPU memory), with typed views into it. The memory tiers hold images, so promoting
a disk hit is one read into one buffer and one host-to-device copy; writing is one write.

File layout (valid safetensors: 8-byte little-endian header length N, JSON header, data):

    0        8                   S = 8 + N (64-aligned)                              file_bytes
    | N(u64) | JSON header, space-padded | token_ids | [scales] | layer.000 | ... | layer.L-1 |
                                         I64 (T,)   F32 (L,2,Hkv)  (2,T,Hkv,D) each, K then V
    segment: | ------- 0: header -------- | ---- 1: preamble ---- | 2 ...          | L+1      |

Every segment has its own xxh3-64 checksum in the manifest, so one layer can be read and
verified alone (`layer_span(l)` gives its absolute byte range). Scales exist only for fp8.
The header's `__metadata__` names the format, format version, storage name, source dtype and
the chunk key; a header that disagrees with what the reader expects is a corrupt entry.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

import torch
import xxhash

from qcfuse_core.store.codec import (
    DTYPE_FROM_NAME,
    DTYPE_FROM_ST,
    DTYPE_NAME,
    ST_DTYPE,
    decode_layer,
    encode_layer,
    is_fp8,
    stored_dtype,
)
from qcfuse_core.types import ChunkKey, KVChunk

FORMAT_NAME = "qcfuse-kv"
FORMAT_VERSION = 1
"""Bump on any change to the bytes of an entry; entries of another version are never used."""

HEADER_ALIGN = 64
MAX_HEADER_BYTES = 1 << 20


class EntryFormatError(ValueError):
    """The bytes are not a valid entry of this format version (treated as corruption)."""


Span = tuple[int, int]  # absolute [start, end) byte offsets in the file


def checksum(buf) -> str:
    return xxhash.xxh3_64_hexdigest(buf)


@dataclass(frozen=True)
class EntryLayout:
    key: ChunkKey
    storage: str  # storage name the entry was written under ("auto", "bf16", "fp8", ...)
    dtype: torch.dtype  # dtype of the stored layer tensors
    src_dtype: torch.dtype  # dtype the chunk had; decode returns this
    num_layers: int
    num_tokens: int
    kv_heads: int
    head_dim: int
    data_start: int
    token_span: Span
    scale_span: Span | None
    layer_spans: tuple[Span, ...]
    file_bytes: int

    @property
    def layer_shape(self) -> tuple[int, int, int, int]:
        return (2, self.num_tokens, self.kv_heads, self.head_dim)

    @property
    def layer_bytes(self) -> int:
        return self.layer_spans[0][1] - self.layer_spans[0][0]

    def segments(self) -> list[Span]:
        """Checksummed ranges: header, preamble (token ids + scales), then each layer."""
        pre_end = self.layer_spans[0][0]
        return [(0, self.data_start), (self.data_start, pre_end), *self.layer_spans]


def plan_layout(
    key: ChunkKey,
    storage: str,
    src_dtype: torch.dtype,
    num_layers: int,
    num_tokens: int,
    kv_heads: int,
    head_dim: int,
) -> tuple[EntryLayout, bytes]:
    """The layout and header bytes (length prefix included) of an entry with these shapes."""
    if min(num_layers, num_tokens, kv_heads, head_dim) <= 0:
        raise ValueError("entry shapes must be positive")
    dtype = stored_dtype(storage, src_dtype)
    L, T, Hkv, D = num_layers, num_tokens, kv_heads, head_dim
    tensors: dict[str, dict] = {}
    offset = 0

    def add(name: str, dt: torch.dtype, shape: list[int]) -> Span:
        nonlocal offset
        n = dt.itemsize
        for s in shape:
            n *= s
        tensors[name] = {"dtype": ST_DTYPE[dt], "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
        return (offset - n, offset)

    tok = add("token_ids", torch.int64, [T])
    sc = add("scales", torch.float32, [L, 2, Hkv]) if is_fp8(dtype) else None
    layers = [add(f"layer.{l:03d}", dtype, [2, T, Hkv, D]) for l in range(L)]
    meta = {
        "format": FORMAT_NAME,
        "format_version": str(FORMAT_VERSION),
        "storage": storage,
        "src_dtype": DTYPE_NAME[src_dtype],
        "key": key.to_string(),
    }
    body = json.dumps({"__metadata__": meta, **tensors}, separators=(",", ":")).encode()
    pad = (-(8 + len(body))) % HEADER_ALIGN
    body += b" " * pad
    header = struct.pack("<Q", len(body)) + body
    S = len(header)
    shift = lambda span: (span[0] + S, span[1] + S)  # noqa: E731
    layout = EntryLayout(
        key=key,
        storage=storage,
        dtype=dtype,
        src_dtype=src_dtype,
        num_layers=L,
        num_tokens=T,
        kv_heads=Hkv,
        head_dim=D,
        data_start=S,
        token_span=shift(tok),
        scale_span=None if sc is None else shift(sc),
        layer_spans=tuple(shift(s) for s in layers),
        file_bytes=S + offset,
    )
    return layout, header


def header_length(prefix: bytes) -> int:
    """Total header bytes (8 + N) from the first 8 bytes of a file."""
    if len(prefix) < 8:
        raise EntryFormatError("file shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n <= 0 or n > MAX_HEADER_BYTES:
        raise EntryFormatError(f"implausible header length {n}")
    return 8 + n


def parse_header(header: bytes, expect_key: ChunkKey, expect_storage: str) -> EntryLayout:
    """Rebuild and check the layout from the header bytes; any disagreement raises."""
    S = header_length(header)
    if len(header) < S:
        raise EntryFormatError("header truncated")
    try:
        obj = json.loads(header[8:S])
        meta = obj["__metadata__"]
        if meta.get("format") != FORMAT_NAME or meta.get("format_version") != str(FORMAT_VERSION):
            raise EntryFormatError(f"format {meta.get('format')} v{meta.get('format_version')}")
        if meta.get("key") != expect_key.to_string() or meta.get("storage") != expect_storage:
            raise EntryFormatError("header names another key or storage dtype")
        src = DTYPE_FROM_NAME[meta["src_dtype"]]
        l0 = obj["layer.000"]
        _, T, Hkv, D = l0["shape"]
        L = sum(1 for name in obj if name.startswith("layer."))
        dtype = DTYPE_FROM_ST[l0["dtype"]]
    except (KeyError, ValueError, TypeError) as e:
        if isinstance(e, EntryFormatError):
            raise
        raise EntryFormatError(f"unreadable header: {e!r}") from e
    layout, expected = plan_layout(expect_key, expect_storage, src, L, T, Hkv, D)
    if layout.dtype != dtype or expected != header[:S]:
        raise EntryFormatError("header does not match the canonical layout")
    return layout


class EntryImage:
    """The bytes of one entry in a uint8 buffer (file_bytes,), with typed views.

    Views alias the buffer: `decode*` methods return new tensors the caller owns.
    """

    def __init__(self, layout: EntryLayout, data: torch.Tensor) -> None:
        if data.dtype != torch.uint8 or data.dim() != 1 or data.numel() != layout.file_bytes:
            raise ValueError(f"image buffer must be uint8 ({layout.file_bytes},)")
        self.layout = layout
        self.data = data

    @property
    def key(self) -> ChunkKey:
        return self.layout.key

    @property
    def nbytes(self) -> int:
        return self.layout.file_bytes

    @property
    def device(self) -> torch.device:
        return self.data.device

    def _view(self, span: Span, dtype: torch.dtype) -> torch.Tensor:
        return self.data[span[0] : span[1]].view(dtype)

    def token_ids(self) -> torch.Tensor:  # (T,) int64
        return self._view(self.layout.token_span, torch.int64)

    def kv(self, layer: int) -> torch.Tensor:  # (2, T, Hkv, D) stored dtype
        lay = self.layout
        return self._view(lay.layer_spans[layer], lay.dtype).view(lay.layer_shape)

    def layers_kv(self) -> torch.Tensor:  # (L, 2, T, Hkv, D) stored dtype, one view of every layer
        lay = self.layout
        first, lb = lay.layer_spans[0][0], lay.layer_bytes
        if any(sp != (first + l * lb, first + (l + 1) * lb) for l, sp in enumerate(lay.layer_spans)):
            raise ValueError("layers are not laid out back to back")  # never, by plan_layout
        return self._view((first, first + lay.num_layers * lb), lay.dtype).view(lay.num_layers, *lay.layer_shape)

    def scale(self, layer: int) -> torch.Tensor | None:  # (2, Hkv) float32
        lay = self.layout
        if lay.scale_span is None:
            return None
        return self._view(lay.scale_span, torch.float32).view(lay.num_layers, 2, lay.kv_heads)[layer]

    def decode_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v), each (T, Hkv, D) in the chunk's dtype."""
        kv = decode_layer(self.kv(layer), self.scale(layer), self.layout.src_dtype)
        return kv[0], kv[1]

    def decode(self) -> KVChunk:
        lay = self.layout
        L, T, Hkv, D = lay.num_layers, lay.num_tokens, lay.kv_heads, lay.head_dim
        k = torch.empty((L, T, Hkv, D), dtype=lay.src_dtype, device=self.device)
        v = torch.empty_like(k)
        for l in range(L):
            kv = self.kv(l)
            if lay.scale_span is None:
                k[l].copy_(kv[0])
                v[l].copy_(kv[1])
            else:
                kv = decode_layer(kv, self.scale(l), lay.src_dtype)
                k[l], v[l] = kv[0], kv[1]
        return KVChunk(key=lay.key, token_ids=self.token_ids().cpu().clone(), k=k, v=v)

    def checksums(self) -> tuple[str, ...]:
        """xxh3-64 of each segment (host images only)."""
        mv = memoryview(self.data.numpy())  # type: ignore[arg-type]  # numpy stubs: __buffer__ only on 3.12+
        return tuple(checksum(mv[a:b]) for a, b in self.layout.segments())

    def to(self, device: torch.device | str, *, pin: bool = False) -> "EntryImage":
        device = torch.device(device)
        if device == self.device and (not pin or self.data.is_pinned()):
            return self
        if device.type == "cpu":
            out = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=pin)
            out.copy_(self.data)
        else:
            out = self.data.to(device, non_blocking=self.data.is_pinned())
        return EntryImage(self.layout, out)


def alloc_host(nbytes: int, pin: bool) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)


def encode_chunk(chunk: KVChunk, storage: str, *, pin: bool = False) -> EntryImage:
    """Serialise a chunk into a host image under storage name `storage`."""
    L, T, Hkv, D = chunk.k.shape
    layout, header = plan_layout(chunk.key, storage, chunk.k.dtype, L, T, Hkv, D)
    data = alloc_host(layout.file_bytes, pin)
    data[: layout.data_start].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
    image = EntryImage(layout, data)
    image.token_ids().copy_(chunk.token_ids.to(torch.int64))
    scales = None
    if layout.scale_span is not None:
        scales = image._view(layout.scale_span, torch.float32).view(L, 2, Hkv)
    for l in range(L):
        kv, sc = encode_layer(chunk.k[l], chunk.v[l], layout.dtype)
        image.kv(l).copy_(kv)
        if scales is not None:
            assert sc is not None  # an fp8 layout has a scale span, and encode_layer gives fp8 a scale
            scales[l].copy_(sc)
    return image
