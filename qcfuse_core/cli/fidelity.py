"""`qcfuse fidelity`: what the engine's audit measured of its fused answers (engine/audit.py).

    qcfuse fidelity [--dir DIR] [--json]

One report per model (fingerprint) the audit has seen: per configuration (method @ ratio, as
asked; the guard's escalations count in it) the answers checked, their mean answer-token
agreement with full prefill and its 95% bootstrap interval, first-token agreement and the
share of answers identical to full prefill's (Wilson intervals), then the same by chunk-length
band (the prompt's shortest chunk).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

HEAD = ("config", "n", "agreement", "95% interval", "first token", "identical answers")


def _ci(ci: Any) -> str:
    return "-" if not ci else f"{ci[0]:.3f}-{ci[1]:.3f}"


def _row(label: str, s: dict[str, Any]) -> str:
    agree = "-" if s["agree"] is None else f"{s['agree']:.3f}"
    first = "-" if s["first_agree"] is None else f"{s['first_agree']:.3f} ({_ci(s['first_agree_ci'])})"
    exact = "-" if s["exact"] is None else f"{s['exact']:.3f} ({_ci(s['exact_ci'])})"
    return f"| {label} | {s['n']} | {agree} | {_ci(s['agree_ci'])} | {first} | {exact} |"


def format_report(ledgers: list[dict[str, Any]]) -> str:
    """The ledgers (`read_ledgers`) as Markdown tables, one section per model."""
    if not ledgers:
        return "no audited answers yet (the engine audits fused greedy answers in idle time)"
    out = []
    for led in ledgers:
        out.append(f"## {led['model'] or 'model'} ({led['fingerprint']}): {led['samples']} live answers audited\n")
        out += ["| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
        out += [_row(label, c) for label, c in led["configs"].items()]
        out += ["", "by chunk-length band (the prompt's shortest chunk, tokens):", ""]
        out += ["| " + " | ".join(("config / band",) + HEAD[1:]) + " |", "|" + "---|" * len(HEAD)]
        for label, c in led["configs"].items():
            out += [_row(f"{label} / {band}", b) for band, b in c["bands"].items()]
        out.append("")
    return "\n".join(out)


def cmd_fidelity(args) -> int:
    from qcfuse_core.engine.audit import ledger_dir, read_ledgers

    directory = Path(args.dir) if args.dir is not None else ledger_dir()
    ledgers = read_ledgers(directory) if directory.is_dir() else []
    print(json.dumps(ledgers, indent=1) if args.json else format_report(ledgers))
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fidelity", help="the audit's measured fidelity of fused answers to full prefill")
    p.add_argument(
        "--dir",
        default=None,
        help="the audit's ledgers (default: $QCFUSE_FIDELITY_DIR, else <cache dir>/fidelity)",
    )
    p.add_argument("--json", action="store_true", help="the ledgers as JSON instead of tables")
    p.set_defaults(func=cmd_fidelity)
