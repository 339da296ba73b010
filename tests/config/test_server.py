"""The HTTP server every pdgate process runs (config/server.py): a connection that does not
send a request's headers in time is closed, whether it sent nothing, half a request line,
or the start of its next request on a kept-alive connection; requests that do arrive are
served as before, pipelined ones included; one it cannot parse gets an OpenAI error body."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import orjson
import pytest
from starlette.types import Receive, Scope, Send

from pdgate.config.server import bind_socket, bound_port, serving

TIMEOUT_S = 0.3


async def _app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["path"] == "/slow":
        await asyncio.sleep(2 * TIMEOUT_S)  # a response longer than the deadline
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
async def port() -> AsyncIterator[int]:
    sock = bind_socket("127.0.0.1", 0)
    async with serving(_app, sock, header_timeout_s=TIMEOUT_S):
        yield bound_port(sock)


async def _closed_by_server(reader: asyncio.StreamReader, within_s: float) -> bytes:
    """What the server sent before closing the connection; fails if it stays open."""
    return await asyncio.wait_for(reader.read(), within_s)


REQUEST = b"GET /fast HTTP/1.1\r\nhost: x\r\n\r\n"


async def _response(reader: asyncio.StreamReader) -> bytes:
    """One whole response (the app's are chunked: "ok", then the last chunk)."""
    return await asyncio.wait_for(reader.readuntil(b"ok\r\n0\r\n\r\n"), 10 * TIMEOUT_S)


@pytest.mark.parametrize("sent", [b"", b"GET /fast HT", b"GET /fast HTTP/1.1\r\nhost: x\r\n"])
async def test_a_connection_without_whole_headers_is_closed_at_the_deadline(
    port: int, sent: bytes
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(sent)
    assert await _closed_by_server(reader, 10 * TIMEOUT_S) == b""
    writer.close()


async def test_a_kept_alive_connection_gets_the_deadline_again_after_each_response(
    port: int,
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for _ in range(3):  # each within the deadline, together longer than it
        writer.write(REQUEST)
        assert (await _response(reader)).startswith(b"HTTP/1.1 200")
        await asyncio.sleep(TIMEOUT_S / 2)
    writer.write(b"GET /fast HTTP/1.1\r\n")  # the next request stalls in its headers
    assert await _closed_by_server(reader, 10 * TIMEOUT_S) == b""
    writer.close()


async def test_a_response_longer_than_the_deadline_and_a_pipelined_one_are_served(
    port: int,
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(2 * b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n")
    for _ in range(2):
        assert (await _response(reader)).startswith(b"HTTP/1.1 200")
    writer.close()


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: abc\r\n\r\n",
        b"GET /fast HTTP/1.1\r\nhost: x\r\nx-request-id: \x01\r\n\r\n",
        b"NOT HTTP AT ALL\r\n\r\n",
    ],
    ids=["bad-length", "control-byte", "garbage"],
)
async def test_a_request_the_server_cannot_parse_gets_an_openai_error_body(
    port: int, request_bytes: bytes
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request_bytes)
    answer = await _closed_by_server(reader, 10 * TIMEOUT_S)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ") and b"content-type: application/json" in head
    error = orjson.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    writer.close()
