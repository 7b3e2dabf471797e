"""The prompt frame: how a question and its documents become the pieces of one prompt.

    [chat head + context header][doc 1][glue][doc 2] ... [doc n][question template + chat tail]
     prefix (cached, exact)      chunk   text  chunk        chunk  suffix (computed fresh)

With a chat template the head and tail are the template's text around one user message;
a base model (no template) gets the plain frame: [BOS] system + blank line ... + "\nAnswer:".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from qcfuse_core.engine.config import FrameConfig
from qcfuse_core.inputs import require_sequence
from qcfuse_core.retrieval.texts import split_prompt
from qcfuse_core.types import Piece


class PromptFrame:
    """The engine's prompt layout for one tokenizer and frame config (immutable after
    construction): `rag_pieces` (a question and its documents), `completion_pieces` (a
    rendered prompt around its chunks), `stops` (the stop strings the frame calls for)."""

    def __init__(self, tokenizer: Any, config: FrameConfig) -> None:
        self.tokenizer, self.config = tokenizer, config
        self.head, self.tail = chat_frame(tokenizer, config.system_prompt)

    def rag_pieces(
        self, question: str, documents: Sequence[str], node_ids: Sequence[str | None] | None = None
    ) -> list[Piece]:
        """The engine's own RAG prompt (see the module docstring). A string where the
        documents belong raises TypeError (it would be one document per character)."""
        if not isinstance(question, str):
            raise TypeError(f"question must be a str, got {type(question).__name__}")
        documents = require_sequence(documents, "documents", one="for one document, pass [text]")
        if node_ids is not None:
            node_ids = require_sequence(node_ids, "node_ids", (str, type(None)))
        if not question.strip():
            raise ValueError("question is empty")
        ids = list(node_ids) if node_ids is not None else [None] * len(documents)
        if len(ids) != len(documents):
            raise ValueError("node_ids and documents differ in length")
        pieces = [Piece("prefix", self.head + self.config.context_header)]
        for i, (doc, nid) in enumerate(zip(documents, ids)):
            if i:
                pieces.append(Piece("text", self.config.glue))
            pieces.append(Piece("chunk", doc, nid))
        pieces.append(Piece("suffix", self.config.question_template.format(question=question) + self.tail))
        return pieces

    def completion_pieces(self, prompt: str, chunks: Sequence[Piece] = ()) -> list[Piece]:
        """A raw completion prompt in the chat frame, split around its known chunk texts
        (`chunks`: Piece("chunk", text, node_id) in order of appearance)."""
        return split_prompt(prompt, chunks, self.head, self.tail)

    @property
    def stops(self) -> tuple[str, ...]:
        """Stop strings the frame calls for: none with a chat template (the model ends its
        turn); with the plain frame of a base model, which has no end of turn and goes on
        writing the frame's next question after its answer, the question line's label
        ("\\nQuestion:" for the default `question_template`) and the answer cue's ("\\nAnswer:":
        a base model also goes on with a second "Answer:" line)."""
        if getattr(self.tokenizer, "chat_template", None):
            return ()
        labels = (self.config.question_template.split("{question}")[0].strip(), self.tail.strip())
        return tuple(dict.fromkeys(f"\n{x}" for x in labels if x))


def chat_frame(tokenizer: Any, system: str) -> tuple[str, str]:
    """(head, tail) of the model's chat template around one user message. Without one (a base
    model, e.g. Gemma-3-270M) the plain frame: [BOS where the tokenizer starts every text
    with it] + system + blank line ... question + a new line "Answer:", the cue a base model
    completes (without it Gemma-3-270M repeats the instruction line). The engine tokenizes
    pieces without special tokens, so a base model's BOS is written here."""
    if tokenizer is None:
        return "", ""
    if not getattr(tokenizer, "chat_template", None):
        bos = getattr(tokenizer, "bos_token", None)
        starts = bos is not None and tokenizer("a").input_ids[:1] == [tokenizer.bos_token_id]
        return (bos if starts and bos is not None else "") + (system + "\n\n" if system else ""), "\nAnswer:"
    sentinel = "\x00QCFUSE-USER\x00"
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": sentinel}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    head, _, tail = rendered.partition(sentinel)
    return head, tail


def eos_ids(adapter: Any) -> set[int]:
    """Token ids that end an answer: the tokenizer's and the model's generation config's EOS."""
    ids: set[int] = set()
    gen = getattr(adapter.model, "generation_config", None)
    for src in (getattr(adapter.tokenizer, "eos_token_id", None), getattr(gen, "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif src:
            ids.update(int(i) for i in src)
    return ids
