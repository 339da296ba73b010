"""``POST /v1/messages/count_tokens``: a Messages request's input tokens, as the engine
serving its model counts them.

The request is translated as ``POST /v1/messages`` translates it (gateway/translate/
messages.py, without ``max_tokens``) and counted by the gateway's `TokenCounter`
(gateway/admission/context.py): the engine's own ``/tokenize`` renders the conversation with
its chat template, tools included, so the count is the prompt the engine would compute, as
vLLM's own ``count_tokens`` does. No queue, no slot: the engine's API server answers it.
Errors are Anthropic's.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pdgate.config.openai_api import ClientGone, OpenAIError, load_object
from pdgate.config.settings import GatewaySettings
from pdgate.gateway.admission.auth import KeyRing
from pdgate.gateway.admission.context import TokenCounter
from pdgate.gateway.api.admin import ORJSONResponse
from pdgate.gateway.api.completions import CompletionsEndpoint
from pdgate.gateway.errors import (
    GatewayError,
    ModelNotFound,
    ServiceUnavailable,
    from_openai_error,
)
from pdgate.gateway.instances.tracker import InstanceTracker
from pdgate.gateway.translate.messages import MessagesFront

__all__ = ["messages_routes"]


async def count_tokens(request: Request) -> Response:
    settings: GatewaySettings = request.state.settings
    front = MessagesFront(max_tokens_limit=settings.max_tokens_limit)
    try:
        return await _count(request, front)
    except GatewayError as exc:
        response = front.error(exc)
        assert isinstance(response, Response)
        return response
    except ClientGone:
        return Response(status_code=499)  # nobody reads it


async def _count(request: Request, front: MessagesFront) -> Response:
    keys: KeyRing = request.state.keys
    key = keys.client(front.credentials(request.headers))
    endpoint: CompletionsEndpoint = request.state.endpoint
    keys.admit(key, endpoint.retry_after)
    body = await endpoint.read(request)
    try:
        raw = load_object(body)
    except OpenAIError as exc:
        raise from_openai_error(exc) from exc
    chat = front.chat_body(raw, counting=True)
    model = str(chat["model"])
    tracker: InstanceTracker = request.state.tracker
    models = tracker.models()
    if model not in models:
        if not models:
            raise ServiceUnavailable(
                "no instances are registered", retry_after=endpoint.retry_after.membership()
            )
        raise ModelNotFound(f"the model {model!r} does not exist", param="model")
    counter: TokenCounter = request.state.tokens
    tokens = await counter.count(model, chat)
    if tokens is None:
        raise ServiceUnavailable(
            f"no instance of {model!r} could count the tokens",
            retry_after=endpoint.retry_after.membership(),  # all failed: others may join
        )
    return ORJSONResponse({"input_tokens": tokens})


def messages_routes() -> list[Route]:
    return [Route("/v1/messages/count_tokens", count_tokens, methods=["POST"])]
