"""The sim model's function calls: whether it calls a tool, which one, and with what.

Like a real model in an agent loop, it calls a tool when the user has just asked something
and answers with text once a tool's result (or its own message) is the last thing in the
conversation. The rule, for a chat with ``tools`` (`ToolUse`):

* ``tool_choice`` names a function: a call to it;
* ``"required"``: a call to the first tool;
* ``"auto"`` (the default with tools): a call to the first tool when the conversation's last
  message is the user's; text when it is a tool result, an assistant message (or a system
  or developer one);
* ``"none"``, or no tools: text (the shims send no `ToolUse` then).

One call per answer (``parallel_tool_calls`` is accepted and never gives more than one).

The arguments are a JSON object built from the function's ``parameters`` schema: each
required property, or every property when none is required; strings get one or two words of
the sim's vocabulary, integers and numbers a small number (within ``minimum``/``maximum``),
booleans true, an ``enum`` or ``const`` its (first) value, arrays ``[]``, objects their own
properties by the same rule (``{}`` past `MAX_DEPTH` levels), a union its first non-null
member. Which words and numbers: a hash of the prompt's token ids and the property's path,
so the call is a function of the prompt alone and the same on every engine that computes it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from hashlib import blake2b
from typing import Any

import orjson

from pdgate.engine_shim._sim_text import WORDS, Context
from pdgate.engine_shim.backend import ToolUse, tool_call_text

__all__ = ["MAX_DEPTH", "arguments", "tool_call"]

# Nesting of objects the arguments follow; deeper ones are {} (a schema may recurse).
MAX_DEPTH = 4
# The vocabulary's words (no punctuation), without their leading space.
_STRING_WORDS = tuple(w.strip() for w in WORDS if w.strip().isalpha())
_JSON_TYPES = ("object", "string", "integer", "number", "boolean", "array")


def tool_call(tokens: Sequence[int], use: ToolUse) -> str | None:
    """The call the sim model makes after the prompt `tokens` (see the module docstring),
    in pdgate's syntax; None: it answers with text."""
    if use.name is not None:
        function = next((f for f in _functions(use.tools) if f.get("name") == use.name), None)
    elif use.required or use.last_role == "user":
        function = next(iter(_functions(use.tools)), None)
    else:
        return None
    if function is None:  # the shims check tools and choice first
        return None
    args = arguments(function.get("parameters"), Context(tokens).key)
    return tool_call_text(str(function["name"]), orjson.dumps(args).decode())


def _functions(tools: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [t["function"] for t in tools if isinstance(t.get("function"), Mapping)]


def arguments(schema: Any, seed: bytes) -> dict[str, Any]:
    """A JSON object for the ``parameters`` `schema` (anything but an object schema: {})."""
    value = _value(schema, seed, "", 0) if isinstance(schema, Mapping) else {}
    return value if isinstance(value, dict) else {}


def _draw(seed: bytes, path: str) -> bytes:
    return blake2b(seed + path.encode(), digest_size=8, person=b"pdgate-tool-arg").digest()


def _kind(schema: Mapping[str, Any]) -> str:
    kind = schema.get("type")
    if isinstance(kind, list):  # ["string", "null"]: the first that is not null
        kind = next((k for k in kind if k in _JSON_TYPES), None)
    if kind in _JSON_TYPES:
        return str(kind)
    if "properties" in schema:
        return "object"
    if "items" in schema:
        return "array"
    return "string"


def _value(schema: Mapping[str, Any], seed: bytes, path: str, depth: int) -> Any:
    for key in ("anyOf", "oneOf", "allOf"):
        options = schema.get(key)
        if isinstance(options, list):
            first = next(
                (o for o in options if isinstance(o, Mapping) and o.get("type") != "null"), None
            )
            if first is not None:
                return _value(first, seed, path, depth + 1)
    if "const" in schema:
        return schema["const"]
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return enum[0]
    if schema.get("type") == "null":
        return None
    kind = _kind(schema)
    if kind == "object":
        return _object(schema, seed, path, depth)
    if kind == "array":
        return []
    if kind == "boolean":
        return True
    h = _draw(seed, path)
    if kind in ("integer", "number"):
        n: float = 1 + h[0] % 9
        if kind == "number":
            n += 0.5
        low, high = _bound(schema, "minimum"), _bound(schema, "maximum")
        if low is not None and n < low:
            n = math.ceil(low) if kind == "integer" else low
        if high is not None and n > high:
            n = math.floor(high) if kind == "integer" else high
        return int(n) if kind == "integer" else n
    words = [_STRING_WORDS[b % len(_STRING_WORDS)] for b in h[1 : 2 + h[0] % 2]]
    return " ".join(words)


def _object(schema: Mapping[str, Any], seed: bytes, path: str, depth: int) -> dict[str, Any]:
    properties = schema.get("properties")
    if depth >= MAX_DEPTH or not isinstance(properties, Mapping):
        return {}
    required = schema.get("required")
    names = (
        [n for n in required if isinstance(n, str) and n in properties]
        if isinstance(required, list)
        else []
    )
    out: dict[str, Any] = {}
    for name in names or list(properties):
        prop = properties[name]
        sub = f"{path}/{name}"
        out[str(name)] = _value(prop, seed, sub, depth + 1) if isinstance(prop, Mapping) else ""
    return out


def _bound(schema: Mapping[str, Any], key: str) -> float | None:
    value = schema.get(key)
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None
