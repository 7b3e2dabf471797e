"""Load or recompute: decide per request, per chunk, from measured rates.

A chunk's cache helps only if loading it is cheaper than recomputing it. With layer-wise
pipelining the fused prefill takes about

    fused = max(load, compute) + overhead
    load    = sum over loaded chunks of  tokens x kv_bytes_per_token / bandwidth(tier)
    compute = ms_per_token x (f x T + (1 - f) x rows)          f = full_layers / L
    rows    = always-fresh rows (glue, suffix) + ratio x loaded tokens + recomputed tokens
    full    = ms_per_token x T

(cacheblend's first layers recompute every row: f > 0). Starting from "load everything",
chunks move to "recompute" slowest tier first while that lowers the estimate; if fused still
is not below `margin` x full, everything is recomputed (the caller runs an ordinary
prefill). So with rates that hold, a fused answer is never slower than full prefill from any tier.

    chunks:    c0 (host)  c1 (disk)  c2 (disk)  c3 (host)
    order:                c1         c2                      <- slowest per token first
    result:    load       recompute  load       load         (e.g. load time = compute time)

Rates are measured once per machine and model (`qcfuse bench ttft` does it) and saved as
JSON next to the store: `rates_path(store_dir, fingerprint, device)`. Math only here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ACTIONS = ("load", "recompute")


@dataclass(frozen=True)
class Rates:
    """Measured on one machine for one model (fingerprint) and dtype."""

    prefill_ms_per_token: float  # full prefill time / tokens at `calib_tokens`
    tier_gbps: dict[str, float]  # tier -> GB/s of layer loads into the compute device
    kv_bytes_per_token: int  # K + V over all layers
    overhead_ms: float = 0.0  # fixed per fused request (probe + select) when a method has no own figure
    select_ms: dict[str, float] = field(default_factory=dict)  # method -> measured lookup + select ms
    calib_tokens: int = 0
    device: str = ""
    model: str = ""
    measured: str = ""  # ISO date

    def __post_init__(self) -> None:
        if self.prefill_ms_per_token <= 0:
            raise ValueError(f"prefill_ms_per_token must be > 0, got {self.prefill_ms_per_token}")
        if self.kv_bytes_per_token <= 0:
            raise ValueError(f"kv_bytes_per_token must be > 0, got {self.kv_bytes_per_token}")
        for tier, bw in self.tier_gbps.items():
            if bw <= 0:
                raise ValueError(f"bandwidth of tier {tier!r} must be > 0, got {bw}")

    def load_ms(self, tokens: int, tier: str) -> float:
        if tier not in self.tier_gbps:
            raise ValueError(f"no measured bandwidth for tier {tier!r}; have: {', '.join(sorted(self.tier_gbps))}")
        return tokens * self.kv_bytes_per_token / (self.tier_gbps[tier] * 1e6)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Rates":
        return cls(**json.loads(text))


def device_name(device) -> str:
    """The name rates are filed under: the GPU's name, or cpu-<arch>-<cores>."""
    import os
    import platform

    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu-{platform.machine()}-{os.cpu_count()}"


def rates_path(store_dir: Path | str, fingerprint: str, device: str) -> Path:
    """Where the rates of (model, device) live: next to the store's data."""
    dev = re.sub(r"[^A-Za-z0-9_.-]+", "_", device)
    return Path(store_dir) / f"rates-{fingerprint}-{dev}.json"


def save_rates(rates: Rates, path: Path | str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(rates.to_json() + "\n")
    tmp.replace(path)
    return path


def load_rates(path: Path | str) -> Rates | None:
    path = Path(path)
    return Rates.from_json(path.read_text()) if path.is_file() else None


@dataclass
class ChunkDecision:
    index: int  # chunk number in prompt order
    tokens: int
    tier: str | None  # None: cached nowhere
    load_ms: float
    recompute_ms: float  # the extra compute if recomputed instead of loaded
    action: str = "load"


@dataclass
class Plan:
    decisions: list[ChunkDecision]
    est_full_ms: float
    est_fused_ms: float
    est_load_ms: float
    est_compute_ms: float
    all_recompute: bool = False  # fused would not beat full: run an ordinary prefill
    notes: list[str] = field(default_factory=list)

    @property
    def loaded(self) -> list[int]:
        return [d.index for d in self.decisions if d.action == "load"]

    @property
    def recomputed(self) -> list[int]:
        return [d.index for d in self.decisions if d.action == "recompute"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "loaded": self.loaded,
            "recomputed": self.recomputed,
            "all_recompute": self.all_recompute,
            "est_full_ms": round(self.est_full_ms, 3),
            "est_fused_ms": round(self.est_fused_ms, 3),
            "est_load_ms": round(self.est_load_ms, 3),
            "est_compute_ms": round(self.est_compute_ms, 3),
            "tiers": [d.tier for d in self.decisions],
            "notes": self.notes,
        }


def plan(
    rates: Rates,
    chunks: Sequence[tuple[int, str | None]],
    *,
    ratio: float,
    total_tokens: int,
    fresh_rows: int,
    full_layers: int = 0,
    num_layers: int = 1,
    overhead_ms: float | None = None,
    margin: float = 0.8,
    overlap: float = 0.5,
) -> Plan:
    """Decide load / recompute for each chunk (tokens, tier) of one request.

    total_tokens T of the prompt; fresh_rows: rows recomputed whatever happens (glue,
    suffix); ratio: share of a loaded chunk's tokens the method recomputes anyway.
    margin: fuse only when the estimate promises at most `margin` x full prefill.
    overlap: how much of the shorter of (load, compute) hides under the longer one: the
    estimate is max(load, compute) + (1 - overlap) x min(load, compute). Perfect overlap
    (1.0) was too optimistic on the H200 (2026-11-30): disk-tier plans estimated at 0.88x
    and 0.70x full prefill ran at 1.17x and 1.10x - a layer's load and compute only half
    overlap when both take about as long (the loader thread's reads, the first layer's
    load in the open). Fast tiers barely notice (their loads are a fraction of compute).
    """
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap must be in [0, 1], got {overlap}")
    if not 0.0 < margin <= 1.0:
        raise ValueError(f"margin must be in (0, 1], got {margin}")
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"ratio must be in [0, 1], got {ratio}")
    if not 0 <= full_layers <= num_layers:
        raise ValueError(f"full_layers must be in [0, {num_layers}], got {full_layers}")
    t = rates.prefill_ms_per_token
    f = full_layers / num_layers
    over = rates.overhead_ms if overhead_ms is None else overhead_ms
    ds = [
        ChunkDecision(
            i,
            n,
            tier,
            rates.load_ms(n, tier) if tier else float("inf"),
            t * (1 - f) * (1 - ratio) * n,
            "load" if tier else "recompute",
        )
        for i, (n, tier) in enumerate(chunks)
    ]

    def estimate() -> tuple[float, float, float]:
        rows = fresh_rows + sum(d.tokens * (ratio if d.action == "load" else 1.0) for d in ds)
        load = sum(d.load_ms for d in ds if d.action == "load")
        compute = t * (f * total_tokens + (1 - f) * rows)
        return max(load, compute) + (1.0 - overlap) * min(load, compute) + over, load, compute

    best = estimate()
    # slowest load per token first; ties keep prompt order
    for d in sorted((d for d in ds if d.action == "load"), key=lambda d: (-d.load_ms / max(d.tokens, 1), d.index)):
        d.action = "recompute"
        trial = estimate()
        if trial[0] < best[0]:
            best = trial
        else:
            d.action = "load"
            break
    full = t * total_tokens
    result = Plan(ds, full, best[0], best[1], best[2])
    if best[0] >= margin * full:
        for d in ds:
            d.action = "recompute"
        result.all_recompute = True
        result.est_fused_ms, result.est_load_ms, result.est_compute_ms = full, 0.0, full
        result.notes.append("fused estimate not below full prefill: recompute everything")
    return result
