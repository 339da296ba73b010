"""Malformed Responses and Messages requests to a deployed gateway: each gets a 4xx in the
error shape of the API it called, and nothing stays held afterwards."""

from __future__ import annotations

from typing import Any

import httpx
import orjson

from tests._cluster import SIM_MODEL as MODEL
from tests.gateway.api._fronts import ALICE, BOB, Stack

USER = [{"role": "user", "content": "hi"}]
DEEP = b'{"model":"m","input":' + b"[" * 200 + b"]" * 200 + b"}"


def _json(body: Any) -> bytes:
    return body if isinstance(body, bytes) else orjson.dumps(body)


RESPONSES: list[tuple[str, Any, int]] = [
    ("not json", b"{nope", 400),
    ("not an object", b"[1, 2]", 400),
    ("empty body", b"", 400),
    ("no input", {"model": MODEL}, 400),
    ("input a number", {"model": MODEL, "input": 7}, 400),
    ("input empty", {"model": MODEL, "input": []}, 400),
    ("item not an object", {"model": MODEL, "input": ["hi"]}, 400),
    ("unknown item type", {"model": MODEL, "input": [{"type": "computer_call_output"}]}, 400),
    ("item role", {"model": MODEL, "input": [{"role": "robot", "content": "x"}]}, 400),
    (
        "image content",
        {"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_image"}]}]},
        400,
    ),
    (
        "function call without call_id",
        {"model": MODEL, "input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
        400,
    ),
    ("max_output_tokens a string", {"model": MODEL, "input": "x", "max_output_tokens": "9"}, 400),
    ("max_output_tokens zero", {"model": MODEL, "input": "x", "max_output_tokens": 0}, 400),
    ("temperature out of range", {"model": MODEL, "input": "x", "temperature": -1}, 400),
    ("stream a string", {"model": MODEL, "input": "x", "stream": "yes"}, 400),
    ("built-in tool", {"model": MODEL, "input": "x", "tools": [{"type": "file_search"}]}, 400),
    (
        "tool without a name",
        {"model": MODEL, "input": "x", "tools": [{"type": "function"}]},
        400,
    ),
    ("background mode", {"model": MODEL, "input": "x", "background": True}, 400),
    ("unknown parameter", {"model": MODEL, "input": "x", "temprature": 1}, 400),
    (
        "metadata too big",
        {"model": MODEL, "input": "x", "metadata": {str(i): "v" for i in range(17)}},
        400,
    ),
    ("text format", {"model": MODEL, "input": "x", "text": {"format": {"type": "yaml"}}}, 400),
    ("gateway-only field", {"model": MODEL, "input": "x", "kv_transfer_params": {}}, 400),
    (
        "unknown previous response",
        {"model": MODEL, "input": "x", "previous_response_id": "resp_x"},
        400,
    ),
    ("unknown model", {"model": "no-such-model", "input": "x"}, 404),
    ("deep nesting", DEEP, 400),
    ("oversized", b'{"model":"m","input":"' + b"x" * (5 << 20) + b'"}', 413),
]

MESSAGES: list[tuple[str, Any, int]] = [
    ("not json", b"{nope", 400),
    ("no max_tokens", {"model": MODEL, "messages": USER}, 400),
    ("max_tokens a string", {"model": MODEL, "messages": USER, "max_tokens": "5"}, 400),
    ("no messages", {"model": MODEL, "max_tokens": 5}, 400),
    ("messages not a list", {"model": MODEL, "max_tokens": 5, "messages": "hi"}, 400),
    (
        "system role in messages",
        {"model": MODEL, "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]},
        400,
    ),
    (
        "unknown block type",
        {
            "model": MODEL,
            "max_tokens": 5,
            "messages": [{"role": "user", "content": [{"type": "video"}]}],
        },
        400,
    ),
    (
        "tool_use in a user turn",
        {
            "model": MODEL,
            "max_tokens": 5,
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
                }
            ],
        },
        400,
    ),
    (
        "tool without schema",
        {"model": MODEL, "max_tokens": 5, "messages": USER, "tools": [{"name": "f"}]},
        400,
    ),
    (
        "stop_sequences not strings",
        {"model": MODEL, "max_tokens": 5, "messages": USER, "stop_sequences": [1]},
        400,
    ),
    (
        "thinking budget too small",
        {
            "model": MODEL,
            "max_tokens": 5000,
            "messages": USER,
            "thinking": {"type": "enabled", "budget_tokens": 10},
        },
        400,
    ),
    ("no model", {"max_tokens": 5, "messages": USER}, 400),
    (
        "deep nesting",
        b'{"model":"m","max_tokens":5,"messages":' + b"[" * 200 + b"]" * 200 + b"}",
        400,
    ),
    ("oversized", b'{"model":"m","max_tokens":5,"system":"' + b"x" * (5 << 20) + b'"}', 413),
]


def test_malformed_requests_get_4xx_in_their_apis_shape_and_nothing_stays_held(
    stack: Stack,
) -> None:
    assert len(RESPONSES) + len(MESSAGES) >= 30
    url = stack.gateways[0]
    # A response of Alice's, for Bob to chain on.
    alices = httpx.post(
        url + "/v1/responses",
        headers={"authorization": f"Bearer {ALICE}"},
        json={"model": MODEL, "input": "mine", "max_output_tokens": 2},
        timeout=30,
    ).json()["id"]
    cases = [
        *[("responses", name, body, status) for name, body, status in RESPONSES],
        (
            "responses",
            "another key's previous response",
            {"model": MODEL, "input": "x", "previous_response_id": alices},
            400,
        ),
        *[("messages", name, body, status) for name, body, status in MESSAGES],
    ]
    failures = []
    with httpx.Client(timeout=30) as http:
        for api, name, body, status in cases:
            resp = http.post(
                f"{url}/v1/{api}",
                content=_json(body),
                headers={"authorization": f"Bearer {BOB}", "content-type": "application/json"},
            )
            error = resp.json()
            if api == "responses":
                shaped = set(error) == {"error"} and {"message", "type", "param", "code"} <= set(
                    error["error"]
                )
            else:
                shaped = error.get("type") == "error" and {"type", "message"} <= set(error["error"])
            if resp.status_code != status or not shaped:
                failures.append((api, name, resp.status_code, error))
    assert not failures, failures
    stack.settled()


def test_wrong_keys_get_401_in_their_apis_shape(stack: Stack) -> None:
    url = stack.gateways[1]
    openai_shaped = httpx.post(
        url + "/v1/responses",
        headers={"authorization": "Bearer sk-wrong"},
        json={"input": "x"},
        timeout=10,
    )
    assert openai_shaped.status_code == 401
    assert openai_shaped.json()["error"]["code"] == "invalid_api_key"
    anthropic_shaped = httpx.post(
        url + "/v1/messages", headers={"x-api-key": "sk-wrong"}, json={"max_tokens": 1}, timeout=10
    )
    assert anthropic_shaped.status_code == 401
    assert anthropic_shaped.json()["error"]["type"] == "authentication_error"
    stack.settled()
