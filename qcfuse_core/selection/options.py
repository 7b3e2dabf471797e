"""Options of the query-aware selectors: one frozen, validated config (`QCFuseOptions`)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields

from qcfuse_core.selection.anchors import AnchorConfig
from qcfuse_core.selection.scoring import ALLOCATIONS, BUDGET_MODES, AdaptiveBudget

OTHER_OPTIONS = frozenset({"epic_k"})  # selection options of other selectors

DEVIATION_LAYER = 1  # the layer whose fresh-vs-cached V deviation `deviation_pool` reads (as CacheBlend)
QUERY_ROWS = 0
"""Default suffix rows scored: 0 = every suffix row, as the paper averages. The last 8 rows
(for the engine's prompt: the answer cue "short sentence." and the chat markers, whose last
row yields the first token) were tried on the calibration split musique_train: first-token KL
at 0.3 fell 20% on 24 questions but rose 6% on 24 others, and agreement with full's answer
fell (docs/benchmarks.md, "Ranking options in the shipped profiles") - so the option stays an off-by-default ablation."""
FIXED_BUDGET_OPTIONS = ("chunk_sinks", "deviation_pool")
"""Options only a fixed budget takes (QCFuseOptions refuses them with the adaptive one): a
model profile's are left out where the budget is adaptive."""


@dataclass(frozen=True)
class QCFuseOptions:
    critical_layers: tuple[int, ...] | None = None  # None: critical_layers.lookup(model)
    anchor_method: str = "keynorm"
    anchor_share: float = 0.125
    sinks: int = 4
    budget: str = "fixed"  # fixed (ratio x context) | adaptive (cover target mass)
    target_mass: float = 0.8
    floor: float = 0.05
    ceiling: float = 0.5
    spread: int = 0  # rank by 0.5 x mass + 0.5 x the max mass within +-spread positions (0: off)
    allocation: str = "global"  # global top-k (the paper) | chunk: budget split by chunk mass, top-k inside
    # score with the attention of the suffix's last N rows only (an ablation: the answer cue,
    # whose final row yields the first token); 0: every suffix row, as the paper averages
    query_rows: int = QUERY_ROWS
    # 0: off (the paper). k > 0: layers 0-1 run for the top k x budget chunk tokens by mass;
    # after layer 1 the budget keeps those with the largest mass x V deviation (fresh layer-1 V
    # vs cached: CacheBlend's staleness signal) - attended and stale
    deviation_pool: float = 0.0
    # 0: off (the paper). a > 0: rank chunk tokens by mass x (1 + position inside the chunk)^-a.
    # A chunk cached alone is stalest at its start (its first tokens never saw what precedes
    # them in the prompt; measured staleness falls ~ (1 + position)^-0.8): a prior for how
    # much recomputing an attended token changes, known without computing anything. With the
    # adaptive budget the target is a share of these weighted scores (what calibrate-budget
    # measures with the same option)
    position_prior: float = 0.0
    # 0: off. d > 0: the position prior stops falling at position d inside a chunk (every
    # deeper token weighs (1 + d)^-a). Measured staleness flattens after a chunk's first
    # ~128 tokens (Gemma-3-270M, docs/benchmarks.md "Long chunks"), while (1 + position)^-a
    # keeps falling: on long chunks a steep prior would leave the deep attended tokens stale
    prior_depth: int = 0
    # 0: off. k > 0: the first k tokens of every chunk are recomputed before any ranked token
    # (within the same budget). A chunk cached alone began at position 0, where a model puts
    # its attention sink; in the fused prompt those cached entries are the stalest of all, and
    # the query's attention does not point at them (Gemma-3-270M, hotpotqa q0, 0.3: adding
    # each chunk's first 4 tokens to qcfuse's rows took the first-token KL from 0.065 to 0.020)
    chunk_sinks: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.spread, int) or self.spread < 0:
            raise ValueError(f"spread must be a non-negative int, got {self.spread!r}")
        if isinstance(self.query_rows, bool) or not isinstance(self.query_rows, int) or self.query_rows < 0:
            raise ValueError(f"query_rows must be a non-negative int (0: every suffix row), got {self.query_rows!r}")
        if self.allocation not in ALLOCATIONS:
            raise ValueError(f"unknown allocation {self.allocation!r}; valid: {', '.join(ALLOCATIONS)}")
        if (
            not isinstance(self.deviation_pool, (int, float))
            or isinstance(self.deviation_pool, bool)
            or not (self.deviation_pool == 0 or self.deviation_pool >= 1)
        ):
            raise ValueError(f"deviation_pool must be 0 (off) or >= 1, got {self.deviation_pool!r}")
        if self.deviation_pool and (self.budget != "fixed" or self.allocation != "global"):
            raise ValueError("deviation_pool re-ranks a fixed global budget; use budget='fixed', allocation='global'")
        if (
            not isinstance(self.position_prior, (int, float))
            or isinstance(self.position_prior, bool)
            or not (0 <= self.position_prior <= 4)
        ):
            raise ValueError(f"position_prior must be a number in [0, 4] (0: off), got {self.position_prior!r}")
        if isinstance(self.prior_depth, bool) or not isinstance(self.prior_depth, int) or self.prior_depth < 0:
            raise ValueError(f"prior_depth must be a non-negative int (0: off), got {self.prior_depth!r}")
        if self.prior_depth and not self.position_prior:
            raise ValueError("prior_depth bounds the position prior; set position_prior too")
        if isinstance(self.chunk_sinks, bool) or not isinstance(self.chunk_sinks, int) or self.chunk_sinks < 0:
            raise ValueError(f"chunk_sinks must be a non-negative int (0: off), got {self.chunk_sinks!r}")
        if self.chunk_sinks and self.budget != "fixed":
            raise ValueError("chunk_sinks comes out of a fixed budget; use budget='fixed'")
        if self.allocation != "global" and self.budget != "fixed":
            raise ValueError("allocation 'chunk' splits a fixed budget; use it with budget='fixed'")
        if self.budget not in BUDGET_MODES:
            raise ValueError(f"unknown budget mode {self.budget!r}; valid: {', '.join(BUDGET_MODES)}")
        AnchorConfig(self.anchor_method, self.anchor_share, self.sinks)  # validates
        AdaptiveBudget(self.target_mass, self.floor, self.ceiling)
        if self.critical_layers is not None and not self.critical_layers:
            raise ValueError("critical_layers must be non-empty (or None to look them up)")

    @classmethod
    def from_options(cls, options: dict, *, strict: bool = False) -> "QCFuseOptions":
        """Parse a keyword dict. strict: an unknown key raises ValueError naming the valid
        ones (besides the fields, `epic_k`, which the EPIC baseline reads)."""
        known = {f.name for f in fields(cls)}
        if strict:
            unknown = sorted(set(options) - known - OTHER_OPTIONS)
            if unknown:
                raise ValueError(
                    f"unknown selection options {unknown}; valid: {', '.join(sorted(known | OTHER_OPTIONS))}"
                )
        kw = {k: v for k, v in options.items() if k in known}
        if kw.get("critical_layers") is not None:
            kw["critical_layers"] = tuple(int(x) for x in kw["critical_layers"])
        return cls(**kw)

    def to_options(self) -> dict:
        """The keyword dict of the options that differ from the defaults."""
        default = QCFuseOptions()
        return {
            f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != getattr(default, f.name)
        }

    @property
    def anchors(self) -> AnchorConfig:
        return AnchorConfig(self.anchor_method, self.anchor_share, self.sinks)


def parse_selection_options(text: str) -> dict:
    """'KEY=VALUE[,KEY=VALUE]' -> QCFuseOptions keywords (validated). Values are JSON when they
    parse (2, 0.5, true, [1, 2]), strings otherwise. Raises ValueError naming what is wrong."""
    opts: dict = {}
    for item in re.split(r",(?=\s*[A-Za-z_]\w*=)", text):  # a comma inside a JSON value ([3,5]) stays
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"{item!r} is not KEY=VALUE")
        try:
            opts[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            opts[key.strip()] = value
    unknown = set(opts) - {f.name for f in fields(QCFuseOptions)}
    if unknown:
        raise ValueError(
            f"unknown selection options {sorted(unknown)}; valid: {', '.join(f.name for f in fields(QCFuseOptions))}"
        )
    try:
        QCFuseOptions.from_options(opts)
    except TypeError as e:
        raise ValueError(str(e)) from e
    return opts
