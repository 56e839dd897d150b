"""Tool calls: the model's `<tool_call>{json}</tool_call>` text -> OpenAI `tool_calls`.

The parser itself lives in the data layer (`astrai.data.tool_calls`), shared with online RL's
multi-turn rollouts, which may not import the server; this module is the server's name for it.
`ToolCall.to_openai` gives the OpenAI `tool_calls` entry; a block whose JSON does not parse, or
that names a function the request did not offer, stays in the content verbatim.
"""

from __future__ import annotations

from astrai.data.tool_calls import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ToolCall,
    ToolCallStream,
    parse_tool_calls,
    read_call,
)

__all__ = ["TOOL_CALL_CLOSE", "TOOL_CALL_OPEN", "ToolCall", "ToolCallStream", "parse_tool_calls", "read_call"]
