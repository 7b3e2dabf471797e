"""A stub embedder for tests that need thousands of chunks in the vector index.

Hashed bag of words (384 dimensions, unit length): texts sharing words are near, so the
harbour question still finds the harbour chunk among thousands of tiny ones. Run as a
script it is the `qcfuse` command line with this embedder installed (for subprocesses).
"""

from __future__ import annotations

import hashlib
import sys

import numpy as np

DIM = 384


class HashEmbedder:
    def embed(self, texts: list[str]) -> list[list[float]]:
        out = []
        for t in texts:
            v = np.zeros(DIM, np.float32)
            for w in t.lower().split():
                h = hashlib.sha256(w.strip(".,;:?!'\"").encode("utf-8", "replace")).digest()
                v[int.from_bytes(h[:8], "little") % DIM] += 1.0
            v /= np.linalg.norm(v) or 1.0
            out.append(v.tolist())
        return out

    def embed_one(self, text: str) -> list[float]:
        return self.embed([text])[0]


def install() -> None:
    import qcfuse_core.retrieval.embedder as embedder

    embedder._SINGLETON = HashEmbedder()


if __name__ == "__main__":
    install()
    from qcfuse_core.cli.commands import main

    sys.exit(main(sys.argv[1:]))
