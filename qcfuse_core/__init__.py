"""QCFuse: query-aware KV-cache fusion for fast RAG.

    from qcfuse_core import open_engine
    with open_engine("./store") as engine:         # the embedded model over a chunk store
        engine.build_chunks(texts)                 # each chunk's KV cache, computed once
        print(engine.answer(question, texts).text) # fused caches, the query's tokens recomputed

The public API is the names below; they are imported on first use, so that importing a
sub-package (the store tools, say) does not load the model stack. The framework
integrations (`qcfuse_integrations`) use these names only.

    the engine         open_engine, QCFuseEngine (answer, stream, aanswer, astream, complete,
                       acomplete, build_chunks, stats, close), EngineStats, TokenStream,
                       AsyncTokenStream; EngineBusy, KVBudgetError
    configuration      EngineConfig and its parts: FrameConfig (the prompt frame),
                       SchedulerConfig (queue and batch bounds), CacheConfig (KV budget,
                       tiers, chunk sink), QCFuseOptions (selection), GuardConfig (the
                       quality guard), AuditConfig (the audit of live traffic; the fidelity
                       target is EngineConfig.fidelity); GenerationConfig (a request's decoding)
    results and ids    FusionResult (its quality guard's GuardReport), ChunkKey, NodeId, Piece
    methods            SELECTORS: the recompute methods by name (`method=`), "qcfuse" and the
                       baselines
    models and files   DEFAULT_MODEL_NAME (the embedded model); cache_dir() (converted models
                       and the default store: $QCFUSE_CACHE_DIR, else ~/.cache/qcfuse);
                       MemoryStore (a chunk store in memory: `QCFuseEngine`'s default,
                       where a store is not given)
    prompts            split_prompt(prompt, chunks): a rendered prompt cut into Pieces around
                       the chunk texts it holds; MIN_CHUNK_CHARS: the shortest chunk text the
                       content index registers (a shorter one is never found in a prompt);
                       require_sequence: a list of texts checked, a lone string refused
    chats and tools    render_chat (a chat in the model's template, tools included),
                       forced_tools, parse_tool_calls, tool_call_schema, renders_tool_role,
                       template_knows_tools, ToolCall, TOOL_SYSTEM; json_schema_constraint
                       (decoding held to a JSON schema)
    learning           BackgroundBuilds (a learner's one background build thread),
                       chunk_positions(prompt, chunks), overlaps: the span helpers of the
                       learner (qcfuse_core/learn.py) that `qcfuse serve` also uses
    retrieval          get_embedder() (the offline MiniLM embedder), EMBEDDING_DIMENSIONS,
                       open_chroma_collection(path) (a checked, offline Chroma collection;
                       the `chroma` extra)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers; at run time `__getattr__` imports each name on first use
    from qcfuse_core.cache.budget import KVBudgetError as KVBudgetError
    from qcfuse_core.engine.api import EngineStats as EngineStats
    from qcfuse_core.engine.api import QCFuseEngine as QCFuseEngine
    from qcfuse_core.engine.api import open_engine as open_engine
    from qcfuse_core.engine.audit import AuditConfig as AuditConfig
    from qcfuse_core.engine.chat import TOOL_SYSTEM as TOOL_SYSTEM
    from qcfuse_core.engine.chat import ToolCall as ToolCall
    from qcfuse_core.engine.chat import forced_tools as forced_tools
    from qcfuse_core.engine.chat import parse_tool_calls as parse_tool_calls
    from qcfuse_core.engine.chat import render as render_chat  # noqa: F401
    from qcfuse_core.engine.chat import renders_tool_role as renders_tool_role
    from qcfuse_core.engine.chat import template_knows_tools as template_knows_tools
    from qcfuse_core.engine.chat import tool_call_schema as tool_call_schema
    from qcfuse_core.engine.config import CacheConfig as CacheConfig
    from qcfuse_core.engine.config import EngineConfig as EngineConfig
    from qcfuse_core.engine.config import FrameConfig as FrameConfig
    from qcfuse_core.engine.config import SchedulerConfig as SchedulerConfig
    from qcfuse_core.engine.generation import GenerationConfig as GenerationConfig
    from qcfuse_core.engine.grammar import json_schema_constraint as json_schema_constraint
    from qcfuse_core.engine.guard import GuardConfig as GuardConfig
    from qcfuse_core.engine.scheduler import EngineBusy as EngineBusy
    from qcfuse_core.engine.streams import AsyncTokenStream as AsyncTokenStream
    from qcfuse_core.engine.streams import TokenStream as TokenStream
    from qcfuse_core.inputs import require_sequence as require_sequence
    from qcfuse_core.learn import BackgroundBuilds as BackgroundBuilds
    from qcfuse_core.learn import chunk_positions as chunk_positions
    from qcfuse_core.learn import overlaps as overlaps
    from qcfuse_core.model.adapter import DEFAULT_MODEL_NAME as DEFAULT_MODEL_NAME
    from qcfuse_core.paths import cache_dir as cache_dir
    from qcfuse_core.retrieval.chroma import open_collection as open_chroma_collection  # noqa: F401
    from qcfuse_core.retrieval.embedder import DIMENSIONS as EMBEDDING_DIMENSIONS  # noqa: F401
    from qcfuse_core.retrieval.embedder import get_embedder as get_embedder
    from qcfuse_core.retrieval.texts import ANCHOR as MIN_CHUNK_CHARS  # noqa: F401
    from qcfuse_core.retrieval.texts import split_prompt as split_prompt
    from qcfuse_core.selection import SELECTORS as SELECTORS
    from qcfuse_core.selection.options import QCFuseOptions as QCFuseOptions
    from qcfuse_core.store import MemoryStore as MemoryStore
    from qcfuse_core.types import ChunkKey as ChunkKey
    from qcfuse_core.types import FusionResult as FusionResult
    from qcfuse_core.types import GuardReport as GuardReport
    from qcfuse_core.types import NodeId as NodeId
    from qcfuse_core.types import Piece as Piece

# public name -> (module, the name there; a few are public under a clearer name)
_PUBLIC: dict[str, tuple[str, str]] = {
    # the engine
    "open_engine": ("qcfuse_core.engine.api", "open_engine"),
    "QCFuseEngine": ("qcfuse_core.engine.api", "QCFuseEngine"),
    "EngineStats": ("qcfuse_core.engine.api", "EngineStats"),
    "TokenStream": ("qcfuse_core.engine.streams", "TokenStream"),
    "AsyncTokenStream": ("qcfuse_core.engine.streams", "AsyncTokenStream"),
    "EngineBusy": ("qcfuse_core.engine.scheduler", "EngineBusy"),
    "KVBudgetError": ("qcfuse_core.cache.budget", "KVBudgetError"),
    # configuration
    "EngineConfig": ("qcfuse_core.engine.config", "EngineConfig"),
    "FrameConfig": ("qcfuse_core.engine.config", "FrameConfig"),
    "SchedulerConfig": ("qcfuse_core.engine.config", "SchedulerConfig"),
    "CacheConfig": ("qcfuse_core.engine.config", "CacheConfig"),
    "QCFuseOptions": ("qcfuse_core.selection.options", "QCFuseOptions"),
    "GuardConfig": ("qcfuse_core.engine.guard", "GuardConfig"),
    "AuditConfig": ("qcfuse_core.engine.audit", "AuditConfig"),
    "GenerationConfig": ("qcfuse_core.engine.generation", "GenerationConfig"),
    # results and ids
    "FusionResult": ("qcfuse_core.types", "FusionResult"),
    "GuardReport": ("qcfuse_core.types", "GuardReport"),
    "ChunkKey": ("qcfuse_core.types", "ChunkKey"),
    "NodeId": ("qcfuse_core.types", "NodeId"),
    "Piece": ("qcfuse_core.types", "Piece"),
    # methods
    "SELECTORS": ("qcfuse_core.selection", "SELECTORS"),
    # models and files
    "DEFAULT_MODEL_NAME": ("qcfuse_core.model.adapter", "DEFAULT_MODEL_NAME"),
    "cache_dir": ("qcfuse_core.paths", "cache_dir"),
    "MemoryStore": ("qcfuse_core.store", "MemoryStore"),
    # prompts
    "split_prompt": ("qcfuse_core.retrieval.texts", "split_prompt"),
    "MIN_CHUNK_CHARS": ("qcfuse_core.retrieval.texts", "ANCHOR"),
    "require_sequence": ("qcfuse_core.inputs", "require_sequence"),
    # chats and tools
    "render_chat": ("qcfuse_core.engine.chat", "render"),
    "forced_tools": ("qcfuse_core.engine.chat", "forced_tools"),
    "parse_tool_calls": ("qcfuse_core.engine.chat", "parse_tool_calls"),
    "tool_call_schema": ("qcfuse_core.engine.chat", "tool_call_schema"),
    "renders_tool_role": ("qcfuse_core.engine.chat", "renders_tool_role"),
    "template_knows_tools": ("qcfuse_core.engine.chat", "template_knows_tools"),
    "ToolCall": ("qcfuse_core.engine.chat", "ToolCall"),
    "TOOL_SYSTEM": ("qcfuse_core.engine.chat", "TOOL_SYSTEM"),
    "json_schema_constraint": ("qcfuse_core.engine.grammar", "json_schema_constraint"),
    # learning
    "BackgroundBuilds": ("qcfuse_core.learn", "BackgroundBuilds"),
    "chunk_positions": ("qcfuse_core.learn", "chunk_positions"),
    "overlaps": ("qcfuse_core.learn", "overlaps"),
    # retrieval
    "get_embedder": ("qcfuse_core.retrieval.embedder", "get_embedder"),
    "EMBEDDING_DIMENSIONS": ("qcfuse_core.retrieval.embedder", "DIMENSIONS"),
    "open_chroma_collection": ("qcfuse_core.retrieval.chroma", "open_collection"),
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'qcfuse_core' has no attribute {name!r}")
    module, attr = _PUBLIC[name]
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
