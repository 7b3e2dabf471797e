"""Critical layers per model: shipped presets, saved profiles, and the lookup.

QCFuse scores context tokens at a few "critical" layers (docs/design.md, the method). Where
they come from, first match wins:

    1. an explicit list (engine / selector option)
    2. a user profile written by `qcfuse profile-layers`: <cache_dir>/critical_layers/<fingerprint>.json
    3. the packaged table `qcfuse_core/data/critical_layers.json`, by fingerprint, then by
       name (case-insensitive substring of the model's folder / repo name)
    4. a depth heuristic: three layers at 45%, 55% and 65% of depth (logged as a warning)

Profile file format (both the packaged table's entries and user profiles):

    {"model": "gemma-3-270m", "match": ["gemma3-270m"], "fingerprints": ["..."],
     "layers": [17, 11, 5], "source": "qcfuse profile-layers ...", "ranking": [...],
     "options": {"position_prior": 2, "prior_depth": 64}}

"options" (optional) are selection options calibrated together with the layers: the ranking
modifiers in `PROFILE_OPTIONS`. The engine applies them to `qcfuse` and `adaptive` where the
layers come from the profile and the caller did not set the option; an adaptive budget takes
only those it accepts (not chunk_sinks: selectors.FIXED_BUDGET_OPTIONS).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from qcfuse_core.model.adapter import ModelAdapter
from qcfuse_core.paths import cache_dir

log = logging.getLogger(__name__)

PACKAGED = "critical_layers.json"


def profile_dir() -> Path:
    return cache_dir() / "critical_layers"


def packaged_profiles() -> list[dict]:
    text = resources.files("qcfuse_core.data").joinpath(PACKAGED).read_text()
    return json.loads(text)["profiles"]


def heuristic_layers(num_layers: int) -> list[int]:
    """Three layers at 45/55/65% depth (the authors' lists sit at 40-75%)."""
    return sorted({min(num_layers - 1, max(0, round(f * (num_layers - 1)))) for f in (0.45, 0.55, 0.65)})


# selection options a profile may carry: how a fixed budget ranks the probed mass
PROFILE_OPTIONS = ("position_prior", "prior_depth", "chunk_sinks")


@dataclass(frozen=True)
class Profile:
    layers: list[int]
    source: str  # where it came from (logged, and in a selection's details)
    options: dict = field(default_factory=dict)  # PROFILE_OPTIONS calibrated with the layers


def resolve(adapter: ModelAdapter) -> Profile:
    """This model's profile: a user profile, else the packaged table, else the depth heuristic."""
    fp = adapter.fingerprint()
    user = profile_dir() / f"{fp}.json"
    if user.is_file():
        return _profile(json.loads(user.read_text()), adapter, f"profile {user}")
    name = adapter.name.lower()
    profiles = packaged_profiles()
    for p in profiles:
        if fp in p.get("fingerprints", []):
            return _profile(p, adapter, f"packaged profile {p['model']} (fingerprint)")
    for p in profiles:
        if any(m.lower() in name for m in p.get("match", [])):
            return _profile(p, adapter, f"packaged profile {p['model']} (name)")
    layers = heuristic_layers(adapter.num_layers)
    log.warning(
        "no critical-layer profile for %s (%s); using depth heuristic %s - run `qcfuse profile-layers`",
        adapter.name,
        fp,
        layers,
    )
    return Profile(layers, "depth heuristic")


def lookup(adapter: ModelAdapter) -> tuple[list[int], str]:
    """-> (critical layers, where they came from) for this model."""
    p = resolve(adapter)
    return p.layers, p.source


def _profile(entry: dict, adapter: ModelAdapter, source: str) -> Profile:
    return Profile(_checked(entry["layers"], adapter), source, checked_options(entry.get("options") or {}, source))


def checked_options(options: dict, where: str = "profile") -> dict:
    """A profile's options, validated as qcfuse selection options with a fixed budget."""
    from qcfuse_core.selection.options import QCFuseOptions

    if not isinstance(options, dict):
        raise ValueError(f"{where}: options must be an object, got {options!r}")
    unknown = sorted(set(options) - set(PROFILE_OPTIONS))
    if unknown:
        raise ValueError(f"{where}: options {unknown} cannot come from a profile; valid: {', '.join(PROFILE_OPTIONS)}")
    try:
        QCFuseOptions(**options)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from e
    return dict(options)


def save_profile(profile: dict, path: Path | None, adapter: ModelAdapter) -> Path:
    """Write a profile (to `path`, or the user profile dir keyed by fingerprint)."""
    _checked(profile["layers"], adapter)
    checked_options(profile.get("options") or {})
    target = path or profile_dir() / f"{adapter.fingerprint()}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(profile, indent=1) + "\n")
    return target


def _checked(layers, adapter: ModelAdapter) -> list[int]:
    layers = [int(x) for x in layers]
    if not layers or any(not 0 <= x < adapter.num_layers for x in layers):
        raise ValueError(f"critical layers {layers} do not fit a {adapter.num_layers}-layer model")
    return layers
