"""Stored responses of the Responses API: ``GET`` and ``DELETE /v1/responses/{id}``, ``GET
/v1/responses/{id}/input_items``.

``POST /v1/responses`` itself is the completions endpoint's (gateway/api/completions.py, with
gateway/translate/responses.py). These read the store it writes (registry/responses.py) in
the client key's scope: another key's response is not found, as one never stored.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pdgate.gateway.admission.auth import KeyRing
from pdgate.gateway.api.admin import ORJSONResponse
from pdgate.gateway.errors import BadRequest, NotFound
from pdgate.gateway.translate.base import scope_of
from pdgate.gateway.translate.responses import stored_response
from pdgate.registry.responses import ResponseStore

__all__ = ["responses_routes"]

_MAX_LIMIT = 100


def _not_found(response_id: str) -> NotFound:
    return NotFound(f"No response found with id '{response_id[:128]}'.", param="response_id")


async def _record(request: Request) -> dict[str, Any]:
    keys: KeyRing = request.state.keys
    key = keys.client(request.headers.get("authorization"))
    store: ResponseStore = request.state.responses
    response_id = request.path_params["response_id"]
    record = await stored_response(store, key, response_id)
    if record is None:
        raise _not_found(response_id)
    return record


async def get_response(request: Request) -> Response:
    record = await _record(request)
    return ORJSONResponse(record["response"])


async def delete_response(request: Request) -> Response:
    keys: KeyRing = request.state.keys
    key = keys.client(request.headers.get("authorization"))
    store: ResponseStore = request.state.responses
    response_id = request.path_params["response_id"]
    if not await store.delete(scope_of(key), response_id):
        raise _not_found(response_id)
    return ORJSONResponse({"id": response_id, "object": "response", "deleted": True})


async def input_items(request: Request) -> Response:
    """The response's input items, a page at a time (``limit`` 1-100, default 20; ``order``
    ``desc``, the default, or ``asc``; ``after`` an item id), as OpenAI lists them."""
    record = await _record(request)
    query = request.query_params
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        raise BadRequest("limit must be an integer", param="limit") from None
    if not 1 <= limit <= _MAX_LIMIT:
        raise BadRequest(f"limit must be between 1 and {_MAX_LIMIT}", param="limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise BadRequest("order must be asc or desc", param="order")
    items = list(record.get("input") or ())
    if order == "desc":
        items.reverse()
    if (after := query.get("after")) is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise BadRequest(f"no input item with id '{after[:128]}'", param="after")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return ORJSONResponse(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }
    )


def responses_routes() -> list[Route]:
    return [
        Route("/v1/responses/{response_id}", get_response, methods=["GET"]),
        Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
        Route("/v1/responses/{response_id}/input_items", input_items, methods=["GET"]),
    ]
