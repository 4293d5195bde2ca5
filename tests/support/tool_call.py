"""The one tool the suites' tool-calling requests offer (`get_weather`) and the choice naming it,
typed as the openai SDK takes them."""

from __future__ import annotations

from openai.types.chat import ChatCompletionNamedToolChoiceParam, ChatCompletionToolParam

TOOLS: list[ChatCompletionToolParam] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
NAMED: ChatCompletionNamedToolChoiceParam = {
    "type": "function",
    "function": {"name": "get_weather"},
}
