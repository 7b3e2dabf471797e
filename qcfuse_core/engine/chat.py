"""Chat turns, tools and structured output, framework-neutral (plain dicts in, plain dicts out).

Shared by the LlamaIndex and LangChain integrations and by `qcfuse serve` (its OpenAI chat route).

Both integrations turn their message types into OpenAI-style dicts
({"role", "content", "tool_calls"?, "tool_call_id"?}) and call:

    render(tokenizer, messages, tools)   the model's chat template with the assistant turn
                                         opened; tools go to the template when it knows them
                                         (`{% if tools %}`), else into a system message in the
                                         Hermes format most tool-tuned models were trained on,
                                         tool results into the template's `tool` role (or a user
                                         turn), and the follow-up to a result is asked in text
    parse_tool_calls(text)               `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
                                         blocks (or a bare JSON call) -> (content, calls)
    tool_call_schema(tools, choice)      the JSON schema a forced tool call must match (an
                                         object naming one of the tools with its arguments),
                                         for constrained decoding (qcfuse_core/engine/grammar.py)

Tools are OpenAI function specs: {"type": "function", "function": {"name", "description",
"parameters"}}.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

TOOL_SYSTEM = (
    "You may call one or more functions to assist with the user query. The functions are listed "
    "in <tools></tools>:\n<tools>\n{tools}\n</tools>\nTo call a function, answer with a JSON object "
    'inside <tool_call></tool_call> tags: <tool_call>{{"name": <function-name>, "arguments": '
    "<args-json-object>}}</tool_call>"
)


@dataclass(frozen=True)
class ToolCall:
    name: str
    args: dict
    id: str


def template_knows_tools(tokenizer) -> bool:
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def render(
    tokenizer, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping] | None = None, *, forced: bool = False
) -> str:
    """The conversation in the model's chat template, ending with the assistant turn opened.

    A template that knows tools gets them and the tool turns as they are. Otherwise (the
    plain frame: a model not trained for tools, e.g. SmolLM2-135M-Instruct):

        tools               a system message in the Hermes format (TOOL_SYSTEM) - while a call
                            is wanted: not after the last turn is a tool result, unless a call
                            is forced (`forced`), so the model answers from the result in text
                            instead of calling again (a multi-step plan needs a tool-trained
                            model)
        assistant calls     `<tool_call>{...}</tool_call>` text in the assistant turn
        tool results        the template's own `tool` role where it renders one, else a user
                            turn "Result of <tool>: <content>"
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template; use the text-completion interface")
    if not messages:
        raise ValueError("a chat needs at least one message")
    if messages[-1].get("role") == "assistant":
        raise ValueError("the last message must not be the assistant's (there is nothing to answer)")
    msgs = [dict(m) for m in messages]
    if tools and template_knows_tools(tokenizer):
        return tokenizer.apply_chat_template(msgs, tools=list(tools), tokenize=False, add_generation_prompt=True)
    names = {}  # tool call id -> tool name, for results that name no tool
    tool_role = renders_tool_role(tokenizer)
    plain = []
    for m in msgs:  # a template without tools: calls and results become text it can render
        calls = m.pop("tool_calls", None)
        if calls:
            for c in calls:
                names[c.get("id")] = _call_body(c)["name"]
            text = "".join(f"<tool_call>{json.dumps(_call_body(c))}</tool_call>" for c in calls)
            m["content"] = (m.get("content") or "") + text
        if m.get("role") == "tool" and not tool_role:
            name = m.get("name") or names.get(m.get("tool_call_id")) or "the tool"
            m = {"role": "user", "content": f"Result of {name}: {m.get('content') or ''}"}
        m.pop("tool_call_id", None)
        m.pop("name", None)
        plain.append(m)
    answered = msgs[-1].get("role") == "tool"
    if tools and (forced or not answered):
        spec = "\n".join(json.dumps(t) for t in tools)
        system = TOOL_SYSTEM.format(tools=spec)
        if plain[0].get("role") == "system":
            plain[0] = {**plain[0], "content": (plain[0].get("content") or "") + "\n\n" + system}
        else:
            plain.insert(0, {"role": "system", "content": system})
    return tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)


_SENTINEL, _USER = "\x00QCFUSE-TOOL-RESULT\x00", "\x00QCFUSE-USER\x00"


def renders_tool_role(tokenizer) -> bool:
    """Whether the chat template renders a message of role `tool` (many render any role as
    `<|im_start|>{role}`; others raise or drop it): probed once per template."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return False
    got = _TOOL_ROLE.get(template)
    if got is None:
        try:
            out = tokenizer.apply_chat_template(
                [{"role": "user", "content": _USER}, {"role": "tool", "content": _SENTINEL}], tokenize=False
            )
            got = _USER in out and _SENTINEL in out and "tool" in out.split(_USER)[-1].split(_SENTINEL)[0]
        except Exception:  # noqa: BLE001 - a template that refuses the role (jinja raise_exception)
            got = False
        _TOOL_ROLE[template] = got
    return got


_TOOL_ROLE: dict[str, bool] = {}


def _call_body(call: Mapping[str, Any]) -> dict:
    fn = call.get("function", call)
    args = fn.get("arguments", fn.get("args", {}))
    if isinstance(args, str):
        args = json.loads(args or "{}")
    return {"name": fn["name"], "arguments": args}


def parse_tool_calls(text: str, tools: Sequence[Mapping] | None = None) -> tuple[str, list[ToolCall]]:
    """(content without the calls, the calls). A bare JSON object naming a known tool counts as
    a call (a forced call is decoded that way). Malformed blocks stay in the content."""
    names = {t["function"]["name"] for t in tools or ()}
    calls: list[ToolCall] = []
    stripped = text.strip()
    if stripped.startswith("{") and "<tool_call>" not in text:
        call = _as_call(stripped, names)
        if call is not None:
            return "", [call]
    kept, pos = [], 0
    for m in _CALL.finditer(text):
        call = _as_call(m.group(1), names)
        if call is None:
            continue
        kept.append(text[pos : m.start()])
        pos = m.end()
        calls.append(call)
    kept.append(text[pos:])
    return "".join(kept).strip(), calls


def _as_call(body: str, names: set[str]) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if names and obj["name"] not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], args, f"call_{uuid.uuid4().hex[:24]}")


def forced_tools(tools: Sequence[Mapping], choice: Any) -> list[Mapping] | None:
    """The tools a tool_choice forces one of (None: the model may answer in text).

    choice: None / "auto" / "none" (not forced), "any" / "required" / True (one of all),
    a tool name, or {"type": "function", "function": {"name": ...}}."""
    if choice in (None, "auto", "none", False):
        return None
    if choice in ("any", "required", True):
        return list(tools)
    name = (
        choice
        if isinstance(choice, str)
        else (choice.get("function") or {}).get("name")
        if isinstance(choice, Mapping)
        else None
    )
    picked = [t for t in tools if t["function"]["name"] == name]
    if not picked:
        valid = ", ".join(t["function"]["name"] for t in tools)
        raise ValueError(f"tool_choice {choice!r} names no bound tool; valid: auto, none, any, required, {valid}")
    return picked


def tool_call_schema(tools: Sequence[Mapping]) -> dict:
    """JSON schema of one call of one of `tools`: {"name": <its name>, "arguments": <its parameters>}."""
    options = []
    for t in tools:
        fn = t["function"]
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    return options[0] if len(options) == 1 else {"anyOf": options}
