"""Token sampling and stop handling for decoding from a fused cache.

`Sampler` turns logits into a token id (greedy, or temperature / top-k / top-p with a seeded
generator), after the repetition penalty and an optional token mask (`Constraint`: a grammar
matcher that allows only tokens keeping the output valid, e.g. JSON for a schema). `TextAssembler` turns a growing list of token ids into safe text deltas: it holds
back text that could still become a stop string and incomplete UTF-8, and reports a hit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


class Constraint(Protocol):
    """Per-request token mask (grammar.py): which tokens may come next, fed every accepted token."""

    def allowed(self, vocab_size: int) -> torch.Tensor:
        """(vocab_size,) bool: the tokens that keep the output valid now."""

    def accept(self, token_id: int) -> None: ...

    def is_finished(self) -> bool:
        """The output is complete: only end-of-sequence may follow."""

    # optional: `rejects(token_id) -> bool`, a token the mask allows but the constraint would
    # rather not take (grammar.py's repetition guard); the sampler takes the next best one


# below it sampling is greedy: logits / 1e-45 overflow to inf and the softmax to NaN, and
# long before that the distribution is one-hot in fp32 (vLLM's _SAMPLING_EPS)
TEMPERATURE_FLOOR = 1e-5


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 (or below TEMPERATURE_FLOOR) -> greedy
    top_k: int = 0  # 0 -> off
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    repetition_penalty: float = 1.0  # 1 -> off; >1 divides positive logits of seen tokens (HF's rule)
    # decode max_new_tokens whatever the model says: end-of-sequence is a token like any other
    # (benchmarks: every answer the same length, as vLLM's ignore_eos); stop strings still stop
    ignore_eos: bool = False
    # a new Constraint per request (the grammar's state is the request's), None -> unconstrained
    constraint: Callable[[], Constraint] | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.temperature < float("inf"):  # NaN too
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if isinstance(self.stop, str) or any(not s for s in self.stop):
            raise ValueError("stop must be a tuple of non-empty strings")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        """The choice is the best token: temperature 0, or below TEMPERATURE_FLOOR."""
        return self.temperature < TEMPERATURE_FLOOR


REJECT_TRIES = 64  # re-choices per step when a constraint rejects the chosen token


class Sampler:
    """One request's sampling state: its generator, the tokens seen, its constraint.

    prompt: the prompt's token ids (the repetition penalty counts them as seen, as HF does).
    eos: end-of-sequence ids, allowed by a constraint only once its output is complete.
    """

    def __init__(
        self, cfg: GenerationConfig, prompt: Sequence[int] | torch.Tensor = (), eos: Sequence[int] = ()
    ) -> None:
        self.cfg = cfg
        self.gen = torch.Generator().manual_seed(cfg.seed if cfg.seed is not None else 0)
        self.seen: set[int] = set()
        if cfg.repetition_penalty != 1.0:
            ids = prompt.tolist() if isinstance(prompt, torch.Tensor) else list(prompt)
            self.seen.update(int(i) for i in ids)
        self.constraint = cfg.constraint() if cfg.constraint is not None else None
        self.eos = list(eos)

    @property
    def plain_greedy(self) -> bool:
        """The choice is the logits' argmax and nothing else (no penalty, no constraint): a
        batch's rows can then be chosen together, on their device."""
        c = self.cfg
        return c.greedy and c.repetition_penalty == 1.0 and self.constraint is None

    def __call__(self, logits: torch.Tensor) -> int:
        """logits (vocab,) fp32 -> token id."""
        token = self._pick(logits)
        if self.cfg.repetition_penalty != 1.0:
            self.seen.add(token)
        if self.constraint is not None and token not in self.eos:
            self.constraint.accept(token)
        return token

    def _pick(self, logits: torch.Tensor) -> int:
        cfg = self.cfg
        if cfg.repetition_penalty != 1.0 and self.seen:
            logits = logits.float().clone()
            idx = torch.tensor(sorted(self.seen), dtype=torch.int64, device=logits.device)
            idx = idx[idx < logits.numel()]
            vals = logits[idx]
            logits[idx] = torch.where(vals > 0, vals / cfg.repetition_penalty, vals * cfg.repetition_penalty)
        if self.constraint is not None:
            logits = self._masked(logits)
            rejects = getattr(self.constraint, "rejects", None)
            if rejects is not None:
                return self._choose_unrejected(logits, rejects)
        return self._choose(logits)

    def _choose_unrejected(self, logits: torch.Tensor, rejects) -> int:
        """The choice among allowed tokens that the constraint does not reject: a rejected
        token is masked and the choice made again (at most REJECT_TRIES times; then, or when
        nothing else is allowed, the last choice stands)."""
        logits = logits.float().clone()
        for _ in range(REJECT_TRIES):
            token = self._choose(logits)
            if not rejects(token):
                return token
            logits[token] = float("-inf")
            if not torch.isfinite(logits).any():
                return token
        return self._choose(logits)

    def _choose(self, logits: torch.Tensor) -> int:
        cfg = self.cfg
        if cfg.greedy:
            return int(torch.argmax(logits))
        logits = logits.float().cpu() / cfg.temperature
        if cfg.top_k:
            kth = torch.topk(logits, min(cfg.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if cfg.top_p < 1.0:
            sorted_p, idx = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_p, 0) - sorted_p < cfg.top_p  # always keeps the first
            probs = torch.zeros_like(probs).scatter(0, idx[keep], sorted_p[keep])
            probs = probs / probs.sum()
        return int(torch.multinomial(probs, 1, generator=self.gen))

    def _masked(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits with every token the constraint forbids at -inf (EOS only once it is complete)."""
        assert self.constraint is not None  # only called when there is one
        V = logits.numel()
        if self.constraint.is_finished():
            allowed = torch.zeros(V, dtype=torch.bool)
            allowed[[e for e in self.eos if e < V]] = True
        else:
            allowed = self.constraint.allowed(V).cpu()
        if not allowed.any():
            raise RuntimeError("the output constraint allows no token (grammar and tokenizer disagree)")
        return logits.float().masked_fill(~allowed.to(logits.device), float("-inf"))


INCOMPLETE_UTF8_TOKENS = 3  # the most bytes an unfinished UTF-8 character has, so the most tokens it spans


class TextAssembler:
    """Incremental detokenisation with stop strings.

    push(id) returns the text that is now safe to emit; `stopped` is set when a stop string
    appeared (the text is cut before it). `text` is everything emitted so far.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.text = ""
        self.stopped = False

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        for s in self.stop:
            cut = full.find(s)
            if cut != -1:
                self.stopped = True
                full = full[:cut]
        if self.stopped:
            return self._emit(full)
        if full.endswith("\ufffd"):
            full = self._settled()
        hold = max((_overlap(full, s) for s in self.stop), default=0)
        return self._emit(full[: len(full) - hold])

    def _settled(self) -> str:
        """The text that no later token can change while the last ones end in a replacement
        character: an incomplete UTF-8 sequence is at most 3 bytes, so it lies in the last 3
        tokens, and what the tokens before them decode to is final - but for its last
        replacement character, which may be a sequence the last tokens complete. An invalid
        byte (a model that writes arbitrary bytes) so holds the text back 3 tokens at most,
        not until the next valid character."""
        return self.tokenizer.decode(self.ids[:-INCOMPLETE_UTF8_TOKENS], skip_special_tokens=True).removesuffix(
            "\ufffd"
        )

    def finish(self) -> str:
        """Flush what was held back (generation ended without a stop string)."""
        if self.stopped:
            return ""
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        return self._emit(full)

    def _emit(self, safe: str) -> str:
        if len(safe) <= len(self.text) or not safe.startswith(self.text):
            return ""
        delta = safe[len(self.text) :]
        self.text = safe
        return delta


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `stop`."""
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
