"""Decoding one step ahead: the scheduler's decode steps with device-side sampling.

A decode step's greedy tokens are chosen on the device, in the captured graph
(`model.graphs.GraphDecoder`), and the next step takes them as its input there
(`ModelRunner.launch(..., feed)`); their copy to the host runs behind the step. The
scheduler (engine/scheduler.py, `_decode`) launches step n, then reads step n - 1's tokens
while step n runs on the GPU, and gives each job its token:

    host:  launch n | read n-1, take tokens, emit | launch n+1 | read n, ...
    GPU:   ... n-1  ][ n                          ][ n+1 ...

so the host never waits between steps (on an H100 a step's launch and read-back took 0.4 ms
of 7.2, docs/benchmarks.md).

Exact stops: a job's answer is token for token the host path's - the same logits, the same
argmax. A job whose token of step n - 1 ends it (end of sequence, a stop string) had one more
row computed in step n, dropped unread; a job whose step-ahead token is its last
(max_new_tokens) sits step n out. Only plain greedy jobs go ahead (`Sampler.plain_greedy`):
a step with a job that samples, penalises repetition or follows a grammar reads the step
before first and runs plainly (its row is chosen on the host).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from qcfuse_core.engine.request import Status
from qcfuse_core.model.runner import Launched


@dataclass
class Ahead:
    """A decode step launched and not yet read: its jobs in row order and the step."""

    jobs: list[Any]  # scheduler Jobs
    launched: Launched


def decoding_now(job: Any) -> bool:
    """The job still decodes: not finished, failed or aborted since its step was launched."""
    dec = job.decoding
    return job.request.status is Status.DECODING and dec is not None and dec.finish is None and not job.abort.is_set()


def ahead_ready(batch: Sequence[Any]) -> bool:
    """Every job of the step chooses its token by the argmax alone (it can be chosen on the device)."""
    return all(j.decoding is not None and j.decoding.sampler.plain_greedy for j in batch)


def plan_ahead(batch: Sequence[Any], prev: Ahead | None) -> tuple[list[Any], list[int], list[int] | None]:
    """The jobs of the next step and their inputs -> (jobs, tokens, feed): a job of the step
    before is fed its row's token on the device (feed = the row, its host token a
    placeholder), any other gives its host token (feed -1). A job whose pending token is its
    last (`max_new_tokens`) sits out; feed is None when no row is fed (no step ahead, or
    none of its jobs in this one: a step ahead whose jobs all left)."""
    rows = {id(j): r for r, j in enumerate(prev.jobs)} if prev is not None else {}
    go, tokens, feed = [], [], []
    for job in batch:
        dec = job.decoding
        r = rows.get(id(job), -1)
        if r >= 0 and len(dec.ids) + 1 >= dec.max_new:
            continue  # the token ahead ends it by length whatever it is
        go.append(job)
        tokens.append(0 if r >= 0 else dec.token)
        feed.append(r)
    return go, tokens, (feed if any(f >= 0 for f in feed) else None)
