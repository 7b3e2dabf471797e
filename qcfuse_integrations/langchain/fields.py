"""The fields and engine plumbing that LangChain's `QCFuseLLM` and `ChatQCFuse` share."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, Field, PrivateAttr, model_validator

from qcfuse_core import QCFuseEngine
from qcfuse_integrations.base import ENGINE_FIELDS, TOKEN_LIMIT_NAMES, check_method, constructor_keywords


class EngineFields(BaseModel):
    """Engine (store, model, dtype, device), fusion (method, ratio) and sampling fields; the
    token limit differs between the two components and is declared by each."""

    store_dir: str | None = Field(default=None, description=ENGINE_FIELDS["store_dir"])
    model: str | None = Field(default=None, description=ENGINE_FIELDS["model"])
    dtype: str | None = Field(default=None, description=ENGINE_FIELDS["dtype"])
    device: str = Field(default="cpu", description=ENGINE_FIELDS["device"])
    method: str = Field(default="qcfuse", description="Recompute method, a name in qcfuse_core.SELECTORS")
    ratio: float | None = Field(
        default=None,
        ge=0.0,
        le=1.0,
        description="Share of context tokens recomputed; None: the engine's, EngineConfig.ratio (0.15) or what its fidelity target chooses",
    )
    temperature: float = Field(default=0.0, ge=0.0, description="0: greedy")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass")
    top_k: int = Field(default=0, ge=0, description="0: off")
    repetition_penalty: float = Field(default=1.0, gt=0.0, description="1: off")
    seed: int | None = Field(default=None, description="Sampling seed")

    _engine: QCFuseEngine | None = PrivateAttr(default=None)
    _token_limit: ClassVar[str]  # the name of the component's token-limit field

    @model_validator(mode="before")
    @classmethod
    def _keywords(cls, data: Any) -> Any:
        """max_tokens, max_new_tokens and num_predict (ChatOllama's name) all set the token
        limit; model_kwargs (ChatOpenAI's name) holds generation options; an unknown keyword
        raises TypeError listing the valid ones."""
        limit = cls._token_limit
        return constructor_keywords(
            cls,
            data,
            limit=limit,
            synonyms=[n for n in TOKEN_LIMIT_NAMES if n != limit],
            options_dicts=("model_kwargs",),
        )

    @classmethod
    def from_engine(cls, engine: QCFuseEngine, **fields: Any):
        """The component over an engine built by hand (tests, a custom store)."""
        component = cls(**fields)
        component._engine = engine
        return component

    def model_post_init(self, context: Any) -> None:
        super().model_post_init(context)
        check_method(self.method)

    def _engine_params(self, **limit: Any) -> dict[str, Any]:
        """`_identifying_params`: these fields, with the component's token limit after the ratio."""
        return {
            "model": self.model or "embedded",
            "dtype": self.dtype,
            "device": self.device,
            "store_dir": self.store_dir,
            "method": self.method,
            "ratio": self.ratio,
            **limit,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "repetition_penalty": self.repetition_penalty,
            "seed": self.seed,
        }
