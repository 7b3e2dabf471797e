"""Constructor keywords of the three QCFuse models (issue 40, item 1): a keyword that means
nothing raises at construction as it does per call, the frameworks' customary names for the
token limit and for a dict of generation options take effect, and the one table of accepted
names (docs/integrations/keywords.md) agrees with the classes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("llama_index.core")
pytest.importorskip("langchain_core")

from qcfuse_core.engine.api import QCFuseEngine  # noqa: E402
from qcfuse_core.model.testing import tiny_model  # noqa: E402
from qcfuse_integrations.langchain import ChatQCFuse  # noqa: E402
from qcfuse_integrations.langchain import QCFuseLLM as LCLLM  # noqa: E402
from qcfuse_integrations.llama_index import QCFuseLLM as LILLM  # noqa: E402

TABLE = Path(__file__).resolve().parents[1] / "docs" / "integrations" / "keywords.md"
CLASSES = {"LlamaIndex `QCFuseLLM`": LILLM, "LangChain `QCFuseLLM`": LCLLM, "`ChatQCFuse`": ChatQCFuse}
SAMPLES = {"store_dir": "somewhere", "model": "smollm2-135m", "dtype": "float32", "device": "cpu", "method": "full",
           "ratio": 0.2, "max_new_tokens": 5, "max_tokens": 5, "num_predict": 5, "temperature": 0.5, "top_p": 0.9,
           "top_k": 3, "repetition_penalty": 1.1, "seed": 1, "stop": ["x"], "model_kwargs": {"temperature": 0.5},
           "generate_kwargs": {"temperature": 0.5}, "context_window": 100, "engine": None, "streaming": True,
           "timeout": 1.0, "max_retries": 1, "api_key": "k"}


def limit(component) -> int:
    return component.max_tokens if isinstance(component, ChatQCFuse) else component.max_new_tokens


@pytest.mark.parametrize("make", [
    lambda: ChatQCFuse(temperatur=0.5),
    lambda: LCLLM(temperatur=0.5),
    lambda: LILLM(temperatur=0.5),
], ids=["ChatQCFuse", "langchain-QCFuseLLM", "llama_index-QCFuseLLM"])
def test_a_constructor_typo_raises_listing_the_valid_names(make):
    with pytest.raises(TypeError, match=r"unknown keyword argument\(s\) \['temperatur'\]; valid: .*temperature"):
        make()


def test_token_limit_synonyms_and_option_dicts_take_effect():
    assert limit(ChatQCFuse(max_new_tokens=5)) == limit(ChatQCFuse(num_predict=5)) == 5
    assert limit(LCLLM(max_tokens=5)) == limit(LCLLM(num_predict=5)) == 5
    assert limit(LILLM(max_tokens=6)) == 6
    assert ChatQCFuse(model_kwargs={"temperature": 0.3, "max_tokens": 7}).temperature == 0.3
    assert limit(ChatQCFuse(model_kwargs={"num_predict": 7})) == 7
    assert LILLM(generate_kwargs={"top_k": 4, "max_new_tokens": 9}).top_k == 4
    with pytest.raises(TypeError, match=r"different token limits .*pass one of max_tokens, max_new_tokens, num_predict"):
        ChatQCFuse(max_tokens=3, num_predict=4)
    with pytest.raises(TypeError, match=r"model_kwargs=\.\.\.\) got unknown keyword argument\(s\) \['beams'\]; "
                                        r"valid: .*temperature"):
        ChatQCFuse(model_kwargs={"beams": 2})
    with pytest.raises(TypeError, match="temperature both as a keyword and in model_kwargs"):
        LCLLM(temperature=0.1, model_kwargs={"temperature": 0.2})
    with pytest.raises(TypeError, match="model_kwargs must be a dict"):
        ChatQCFuse(model_kwargs=["temperature"])
    with pytest.raises(TypeError, match=r"unknown keyword argument\(s\) \['model_kwargs'\]; valid: .*generate_kwargs"):
        LILLM(model_kwargs={"temperature": 0.1})  # LlamaIndex's HuggingFaceLLM means loading options by it


@pytest.fixture(scope="module")
def engine():
    adapter = tiny_model("llama", tokenizer=True)
    adapter.tokenizer.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                                       "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    return QCFuseEngine(adapter)


def test_the_constructor_limit_bounds_the_answer(engine):
    """The synonyms reach decoding: the answer stops at the limit given under any name."""
    from llama_index.core.base.llms.types import ChatMessage

    chat = ChatQCFuse.from_engine(engine, num_predict=4, method="full")
    assert chat.invoke("hi").usage_metadata["output_tokens"] == 4
    llm = LCLLM.from_engine(engine, max_tokens=3, method="full")
    assert llm.generate(["hi"]).generations[0][0].generation_info["new_tokens"] == 3
    li = LILLM(engine=engine, max_tokens=2, method="full")
    assert li.complete("hi").raw["qcfuse"]["new_tokens"] == 2
    # the tiny random model never ends early on these prompts, so the limit is what stopped it
    assert chat.invoke("hi").response_metadata["finish_reason"] == "length"
    assert li.chat([ChatMessage(role="user", content="hi")]).raw["qcfuse"]["new_tokens"] == 2


def _table() -> list[tuple[str, dict[str, str]]]:
    rows, header = [], None
    for line in TABLE.read_text().splitlines():
        if not line.startswith("|") or set(line) <= {"|", "-"}:
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if header is None:
            header = cells
            continue
        for name in re.findall(r"`([a-z_]+)`", cells[0]):
            rows.append((name, dict(zip(header[1:4], cells[1:4]))))
    return rows


def test_the_keyword_table_matches_the_classes():
    rows = _table()
    assert {n for n, _ in rows} == set(SAMPLES), "the table and this test's samples list other names"
    for name, cells in rows:
        for column, cls in CLASSES.items():
            accepted = not cells[column].startswith("no")
            kw = {name: SAMPLES[name]}
            if accepted:
                made = cls(**kw)
                if name in ("max_tokens", "max_new_tokens", "num_predict"):
                    assert limit(made) == 5, (name, column)
            else:
                with pytest.raises(TypeError, match=re.escape(f"['{name}']")):
                    cls(**kw)
