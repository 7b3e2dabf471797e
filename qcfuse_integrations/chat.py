"""Chat turns, tools and structured output: the framework-neutral helpers now live in the core
(qcfuse_core/engine/chat.py) so `qcfuse serve` renders chats exactly as the integrations do;
this module keeps the integrations' import path."""

from qcfuse_core import (
    TOOL_SYSTEM,
    ToolCall,
    forced_tools,
    parse_tool_calls,
    renders_tool_role,
    template_knows_tools,
    tool_call_schema,
)
from qcfuse_core import render_chat as render

__all__ = [
    "TOOL_SYSTEM",
    "ToolCall",
    "forced_tools",
    "parse_tool_calls",
    "render",
    "renders_tool_role",
    "template_knows_tools",
    "tool_call_schema",
]
