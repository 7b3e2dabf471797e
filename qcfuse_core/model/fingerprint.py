"""What identifies a model's weights: a content hash of its files, computed once per file.

A chunk cache is valid only for the exact model that computed it, so the model fingerprint
(`ModelAdapter.fingerprint`) covers the config, dtype, tokenizer and the weights - but not
where the folder lies: the same bytes under another cache dir must find the same caches.

    weights_digest(folder) = sha256 over (file name, xxh3-128 of its bytes), weight files sorted

Hashing reads every byte (about 0.3 s for the embedded model's 517 MB; seconds for an 8B
model), so each file's hash is kept in `<cache dir>/weight-hashes.json` keyed by its
resolved path, size and mtime (ns): a process start re-reads nothing unless a file changed.
The cache is advisory: when it cannot be read or written the hash is simply recomputed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import xxhash

log = logging.getLogger(__name__)

WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth")
HASH_CACHE = "weight-hashes.json"
_BLOCK = 16 << 20


def weight_files(folder: Path) -> list[Path]:
    files = {p for pattern in WEIGHT_PATTERNS for p in Path(folder).glob(pattern) if p.is_file()}
    return sorted(files, key=lambda p: p.name)


def hash_file(path: Path) -> str:
    """xxh3-128 of the file's bytes (hex)."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
    return h.hexdigest()


def _cache_path() -> Path:
    from qcfuse_core.paths import cache_dir

    return cache_dir() / HASH_CACHE


def _load_cache(path: Path) -> dict:
    try:
        obj = json.loads(path.read_text())
        return obj if isinstance(obj, dict) else {}
    except (OSError, ValueError):
        return {}


def _save_cache(path: Path, cache: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".weight-hashes-", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(cache, f)
        os.replace(tmp, path)
    except OSError as e:  # a read-only cache dir: recompute next time
        log.debug("weight hash cache %s not written: %s", path, e)


def weights_digest(folder: Path | str) -> str | None:
    """The content hash of a model folder's weight files; None when it has none."""
    files = weight_files(Path(folder))
    if not files:
        return None
    cache_file = _cache_path()
    cache = _load_cache(cache_file)
    changed = False
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        key = str(f.resolve())
        hit = cache.get(key)
        if isinstance(hit, dict) and hit.get("size") == st.st_size and hit.get("mtime_ns") == st.st_mtime_ns:
            digest = hit["xxh3_128"]
        else:
            digest = hash_file(f)
            cache[key] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "xxh3_128": digest}
            changed = True
        h.update(f"{f.name}:{digest}\n".encode())
    if changed:
        _save_cache(cache_file, cache)
    return h.hexdigest()
