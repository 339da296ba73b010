"""Function tools on the shims' chat layer: the request's tools checked as vLLM checks them,
and a streaming parser of pdgate's tool-call syntax into OpenAI ``tool_calls``.

An engine whose model calls tools (`ToolCalling`, the sim) generates each call as text,
``<tool_call>NAME\\n{"arg": "value"}</tool_call>`` (`tool_call_text`), and the chat layer
turns that text into the chat API's shape, as vLLM's ``--tool-call-parser`` does on its
chat layer (vllm/tool_parsers/, vllm/entrypoints/openai/chat_completion/serving.py):

* text before the first call goes out as ``content``; text after a call is dropped;
* a call's first delta carries ``index``, ``id``, ``type: "function"``, ``function.name``
  and ``arguments: ""`` once the name's line is complete; later deltas carry ``index`` and
  fragments of ``function.arguments`` as they are generated;
* text that may be the beginning of a marker is held back until the next token shows what
  it is, so no marker ever goes out as content or arguments;
* a sequence that ended (``stop``) after a call finishes with ``tool_calls`` (``stop`` when
  ``tool_choice`` named the function, as OpenAI and vLLM do); ``max_tokens`` reached inside a
  call finishes with ``length``, with what was parsed so far (the arguments may be cut);
* a whole answer has ``message.tool_calls`` and ``content: null`` when no text came before
  the call.

Call ids are ``call_`` and 24 hex digits, a hash of the prompt's token ids and the call's
index: the same prompt gets the same ids on every run and every decode.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from hashlib import blake2b
from typing import Any

from pdgate.config.openai_api import ChatCompletionRequest
from pdgate.engine_shim._http import bad_request
from pdgate.engine_shim._sim_text import pack_tokens
from pdgate.engine_shim.backend import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, ToolUse

__all__ = ["NO_TOOL_PARSER", "ToolCallParser", "tool_use"]

NO_TOOL_PARSER = (
    "this engine cannot force a tool call (tool_choice must be auto or none): pdgate's vLLM "
    "shim runs vLLM's engine without its chat layer, so it has no tool-call parser; serve "
    "tools with stock `vllm serve --enable-auto-tool-choice --tool-call-parser ...` behind "
    "the gateway"
)
_NAMED_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'

# Parser states: text before any call, a call's name line, its arguments, after a call.
_TEXT, _NAME, _ARGS, _AFTER = range(4)


def tool_use(req: ChatCompletionRequest, *, can_call: bool) -> ToolUse | None:
    """The request's tools and choice for an engine that calls tools (`can_call`), checked
    as vLLM checks them (each refusal a 400 naming the field, never echoing the request);
    None when the model answers with text only (no tools, or ``tool_choice: "none"``).

    An engine that cannot call tools gets None, and a ``tool_choice`` that forces a call is
    refused for it rather than answered with text."""
    choice = req.tool_choice
    if not can_call:
        if choice not in (None, "auto", "none"):
            raise bad_request(NO_TOOL_PARSER, "tool_choice")
        return None
    tools = req.tools
    if tools is not None and not tools:
        raise bad_request(
            "`tools` must not be an empty array; give at least one tool or omit the field",
            "tools",
        )
    if choice == "none" or (choice is None and not tools):
        return None
    if not tools:
        raise bad_request("When using `tool_choice`, `tools` must be set.", "tool_choice")
    names = _function_names(tools)
    if choice is None or choice == "auto":
        return ToolUse(tools, last_role=req.messages[-1].role)
    if choice == "required":
        return ToolUse(tools, required=True, last_role=req.messages[-1].role)
    if not isinstance(choice, dict):
        raise bad_request(
            'tool_choice must be "none", "auto", "required" or a named function', "tool_choice"
        )
    function = choice.get("function")
    if choice.get("type", "function") != "function" or not isinstance(function, dict):
        raise bad_request(f"Invalid `tool_choice`. {_NAMED_USAGE}", "tool_choice.function")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(
            f"Invalid `name` in `function` in `tool_choice`. {_NAMED_USAGE}",
            "tool_choice.function.name",
        )
    if name not in names:
        raise bad_request(
            "The tool specified in `tool_choice` does not match any of the specified `tools`",
            "tool_choice",
        )
    return ToolUse(tools, name=name, required=True, last_role=req.messages[-1].role)


def _function_names(tools: Sequence[Mapping[str, Any]]) -> set[str]:
    """The functions' names; each tool must be an OpenAI function tool."""
    names = set()
    for tool in tools:
        function = tool.get("function")
        if (
            tool.get("type") != "function"
            or not isinstance(function, dict)
            or not isinstance(name := function.get("name"), str)
            or not name
            or "\n" in name
            or not isinstance(function.get("parameters", {}), dict)
        ):
            raise bad_request(
                'each tool must be {"type": "function", "function": {"name": ..., '
                '"description": ..., "parameters": {...}}}',
                "tools",
            )
        names.add(name)
    return names


def _partial(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (to hold back)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ToolCallParser:
    """One answer's generated text, piece by piece, as chat deltas (see the module
    docstring). `calls` holds the calls parsed so far, whole."""

    __slots__ = ("_held", "_named", "_seed", "_state", "calls", "content")

    def __init__(self, prompt_tokens: Sequence[int], *, named: bool) -> None:
        self._seed = blake2b(pack_tokens(prompt_tokens), digest_size=16).digest()
        self._named = named
        self._held = ""
        self._state = _TEXT
        self.calls: list[dict[str, Any]] = []
        self.content: list[str] = []  # every content delta so far

    def finish_reason(self, finish: str) -> str:
        """The answer's finish reason for the engine's `finish` (``stop`` or ``length``)."""
        return "tool_calls" if self.calls and finish == "stop" and not self._named else finish

    def feed(self, text: str, finish: str | None = None) -> dict[str, Any] | None:
        """The delta for the next piece of generated text (``content`` and/or
        ``tool_calls``), or None when it has nothing new to say yet. `finish`: the sequence
        ended with this piece (held-back text is then let go: text that began a marker
        after ``stop``, since the marker never came; dropped after ``length``)."""
        buf = self._held + text
        self._held = ""
        content = ""
        deltas: list[dict[str, Any]] = []
        while buf:
            state = self._state
            if state in (_TEXT, _AFTER):
                at = buf.find(TOOL_CALL_OPEN)
                cut = at if at >= 0 else len(buf) - _partial(buf, TOOL_CALL_OPEN)
                if state == _TEXT:
                    content += buf[:cut]
                if at < 0:
                    self._held = buf[cut:]
                    break
                buf = buf[at + len(TOOL_CALL_OPEN) :]
                self._state = _NAME
            elif state == _NAME:
                end = buf.find("\n")
                if end < 0:
                    self._held = buf
                    break
                self._open(buf[:end].strip(), deltas)
                buf = buf[end + 1 :]
                self._state = _ARGS
            else:
                at = buf.find(TOOL_CALL_CLOSE)
                cut = at if at >= 0 else len(buf) - _partial(buf, TOOL_CALL_CLOSE)
                self._arguments(buf[:cut], deltas)
                if at < 0:
                    self._held = buf[cut:]
                    break
                buf = buf[at + len(TOOL_CALL_CLOSE) :]
                self._state = _AFTER
        if finish is not None:
            if finish == "stop" and self._state == _TEXT:
                content += self._held
            self._held = ""
        delta: dict[str, Any] = {}
        if content:
            self.content.append(content)
            delta["content"] = content
        if deltas:
            delta["tool_calls"] = deltas
        return delta or None

    def _open(self, name: str, deltas: list[dict[str, Any]]) -> None:
        index = len(self.calls)
        call_id = (
            "call_" + blake2b(self._seed + index.to_bytes(4, "little"), digest_size=12).hexdigest()
        )
        self.calls.append(
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}
        )
        deltas.append(
            {
                "index": index,
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": ""},
            }
        )

    def _arguments(self, fragment: str, deltas: list[dict[str, Any]]) -> None:
        if not fragment:
            return
        index = len(self.calls) - 1
        self.calls[index]["function"]["arguments"] += fragment
        last = deltas[-1] if deltas else None
        if last is not None and last["index"] == index and "id" not in last:
            last["function"]["arguments"] += fragment
        else:
            deltas.append({"index": index, "function": {"arguments": fragment}})

    def message(self, text: str, finish: str) -> dict[str, Any]:
        """A whole answer's message for its generated `text` (a fresh parser's only call)."""
        self.feed(text, finish)
        message: dict[str, Any] = {
            "role": "assistant",
            "content": "".join(self.content) or (None if self.calls else ""),
        }
        if self.calls:
            message["tool_calls"] = self.calls
        return message
