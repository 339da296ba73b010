"""Continuing a client's stream from token ids: decode migration and the first token early.

A stream is continued by a new P/D request whose prompt is the original prompt's token ids
plus the ids of every token the client was sent, to ``/v1/completions`` (the API that takes a
token prompt, for a chat too), with ``max_tokens`` reduced by what was generated. An engine's
next token is a function of that whole context (vLLM's as the sim's), so greedy output goes on
exactly as it would have; with sampling it goes on from the tokens the client saw, so the text
stays consistent. The decode leg asks for vLLM's ``return_token_ids`` to learn the ids; they
are stripped from what the client gets unless it asked for them itself.

* `Progress` records what the client was sent (prompt ids, generated ids, the text's tail,
  the stream's id/created/model) and builds the continuation's body.
  `Progress.passthrough` takes an event of the client's own leg (ids recorded, then stripped
  unless asked for); `Progress.continued` turns an event of a continuation leg (a
  ``text_completion`` chunk) into the client's stream: its id and object, chat deltas for a
  chat, ``text_offset`` and ``usage`` counted over every leg.
* `JoinedStop`: a stop string that starts in text sent before the boundary and ends in the
  new leg's text, which that leg's decode cannot see (it sees only its own text).
"""

from __future__ import annotations

import time
from typing import Any, TypeGuard

import orjson

from pdgate.config.openai_api import Api
from pdgate.config.wire import EXT_CONTINUATION

__all__ = ["JoinedStop", "Progress", "not_continuable", "open_stop"]

# A chat's fields that /v1/completions does not take (the prompt's ids already hold what they
# shaped); ``logprobs``/``top_logprobs`` become the completions ``logprobs`` count.
_CHAT_ONLY = frozenset(
    {
        "messages",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template_kwargs",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "response_format",
        "logprobs",
        "top_logprobs",
        "max_completion_tokens",
    }
)
# Set anew for every continuation.
_REPLACED = frozenset({"prompt", "max_tokens", "kv_transfer_params", "return_token_ids"})
# The usual event of a stream (`Progress.passthrough_bytes`): what its choice may hold just
# before its token ids (vLLM's completions, vLLM's chat and pdgate's shims, and with the
# stop reason but no prompt ids), and all that may follow them.
_NULL_PROMPT_IDS = b',"prompt_token_ids":null'
_NULLS = b',"logprobs":null,"finish_reason":null'
_BEFORE_IDS = (
    _NULLS + b',"stop_reason":null' + _NULL_PROMPT_IDS,
    _NULLS,
    _NULLS + b',"stop_reason":null',
    _NULLS + _NULL_PROMPT_IDS,
)
_AFTER_IDS = frozenset({b"]}]}", b']}],"usage":null}'})
# The usual event of an engine that sends no token ids: the choice's end, then all that may
# follow it.
_NO_IDS_ENDS = tuple(
    nulls + after
    for nulls in (_NULLS, _NULLS + b',"stop_reason":null')
    for after in (b"}]}", b'}],"usage":null}')
)
# What shapes output in a way a plain completion cannot pick up from the middle: a tool-call
# parser (chat) or a grammar that would restart at the continuation's first token.
_NOT_CONTINUABLE = (
    "tools",
    "tool_choice",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
)


def open_stop(stops: tuple[str, ...], text: str) -> bool:
    """Whether `text` ends with the beginning of one of `stops` (a decode would hold it back
    until the next token shows whether the stop string completes)."""
    return any(text.endswith(s[:k]) for s in stops for k in range(1, min(len(s), len(text) + 1)))


def _int_list(value: Any) -> TypeGuard[list[int]]:
    return isinstance(value, list) and all(type(v) is int for v in value)


class JoinedStop:
    """Stop strings across a leg boundary. `before` is the tail of the text the client was
    sent; a match that begins there ends the stream at once (the part of the stop string
    already sent cannot be taken back, and no more text may follow it). While the new leg's
    text could still complete such a match, it is held back."""

    __slots__ = ("_before", "_held", "_stops", "active", "stopped")

    def __init__(self, stops: tuple[str, ...], before: str) -> None:
        self._stops = stops
        self._before = before
        self._held = ""
        self.active = bool(stops) and open_stop(stops, before)
        self.stopped = False  # a match ended the stream here

    def feed(self, text: str, *, final: bool) -> tuple[str, bool]:
        """Text of the new leg to send now, and whether a stop string matched."""
        if not self.active:
            return text, False
        held = self._held + text
        joined = self._before + held
        n = len(self._before)
        for stop in self._stops:
            at = joined.find(stop, max(0, n - len(stop) + 1))
            if 0 <= at < n:
                self.active = False
                self.stopped = True
                self._held = ""
                return "", True
        if not final and any(
            stop.startswith(joined[j:])
            for stop in self._stops
            for j in range(max(0, len(joined) - len(stop) + 1), n)
        ):
            self._held = held
            return "", False
        self.active = False
        self._held = ""
        return held, False


def not_continuable(forward: dict[str, Any]) -> str | None:
    """Why a request with these fields cannot go on as a plain completion from token ids
    (None: it can, as far as its fields go): its output is shaped by more than its tokens."""
    for key in _NOT_CONTINUABLE:
        if forward.get(key):
            return f"{key} cannot be continued by a plain completion"
    fmt = forward.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        return "response_format cannot be continued by a plain completion"
    return None


class Progress:
    """What one client's stream has been sent, across its legs."""

    __slots__ = (
        "_base",
        "_id_prefix",
        "_ids",
        "_old_prefix",
        "_raw_ids",
        "_tail_chars",
        "api",
        "chat",
        "client_ids",
        "events",
        "finish",
        "head",
        "ids_complete",
        "include_usage",
        "max_tokens",
        "prompt_ids",
        "request_id",
        "stops",
        "tail",
        "text_chars",
        "top_logprobs",
        "usage_sent",
    )

    def __init__(
        self,
        api: Api,
        *,
        request_id: str,
        max_tokens: int,
        stops: tuple[str, ...] = (),
        client_ids: bool = False,
        include_usage: bool = False,
        top_logprobs: int = 0,
    ) -> None:
        self.api = api
        self.chat = api is Api.CHAT
        self.request_id = request_id
        self.max_tokens = max_tokens
        self.stops = stops
        self.client_ids = client_ids  # the client asked for token ids itself
        self.include_usage = include_usage
        self.top_logprobs = top_logprobs  # a chat's top_logprobs
        self.prompt_ids: list[int] | None = None
        self._ids: list[int] = []  # of every token the client was sent (see `ids`)
        self._raw_ids: list[bytes] = []  # ids of events taken as bytes, not parsed yet
        self.ids_complete = True  # every chunk with text came with its tokens' ids
        # How the stream's events begin: with the request's id, or the decode's own.
        self._id_prefix = b'{"id":' + orjson.dumps(request_id)
        self._old_prefix: bytes | None = None
        self.text_chars = 0
        self._tail_chars = max((len(s) for s in stops), default=1) - 1
        self.tail = ""  # the sent text's last characters, for stop strings across a boundary
        self.head: dict[str, Any] | None = None  # id, object, created, model of the stream
        self.finish: str | None = None
        self.usage_sent = False
        self.events = 0  # events the client was sent
        self._base = 0  # ids the current continuation leg was given

    @property
    def ids(self) -> list[int]:
        """The ids of every token the client was sent."""
        if self._raw_ids:
            self._parse_raw_ids()
        return self._ids

    @property
    def remaining(self) -> int:
        return self.max_tokens - len(self.ids)

    def _parse_raw_ids(self) -> None:
        raw, self._raw_ids = self._raw_ids, []
        try:
            ids = orjson.loads(b"[" + b",".join(raw) + b"]")
        except orjson.JSONDecodeError:
            ids = None
        if _int_list(ids):
            self._ids.extend(ids)
        else:
            self.ids_complete = False  # not a stream to continue from its ids

    def _record(self, text: str, ids: Any, finish: Any) -> None:
        if isinstance(ids, list):
            if self._raw_ids:  # behind ids not parsed yet: in order, and still unparsed
                if ids:
                    self._raw_ids.append(orjson.dumps(ids)[1:-1])
            else:
                self._ids.extend(ids)
        elif text:
            self.ids_complete = False
        if text:
            self.text_chars += len(text)
            if self._tail_chars:
                self.tail = (self.tail + text)[-self._tail_chars :]
        if isinstance(finish, str):
            self.finish = finish

    # -- the client's own leg ----------------------------------------------------------------

    def passthrough(self, event: dict[str, Any]) -> bool:
        """Record an event of the client's own leg and strip the ids the client did not ask
        for. Whether the event changed (False: its bytes can go out as they came)."""
        changed = False
        if self.head is None:
            self.head = {
                "id": self.request_id,
                "object": event.get("object"),
                "created": event.get("created"),
                "model": event.get("model"),
            }
        if (decode_id := event.get("id")) != self.request_id:
            event["id"] = self.request_id  # one id: a stock decode answers with its own
            changed = True
            if isinstance(decode_id, str):
                self._old_prefix = b'{"id":' + orjson.dumps(decode_id)
        if "prompt_token_ids" in event:  # a chat's first event
            changed |= self._prompt_ids(event)
        strip = not self.client_ids
        for choice in event.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            if "prompt_token_ids" in choice:  # a completion's first event
                changed |= self._prompt_ids(choice)
            if strip and "token_ids" in choice:
                ids = choice.pop("token_ids")
                changed = True
            else:
                ids = choice.get("token_ids")
            if self.chat:
                delta = choice.get("delta")
                text = delta.get("content") if isinstance(delta, dict) else None
            else:
                text = choice.get("text")
            self._record(text if type(text) is str else "", ids, choice.get("finish_reason"))
        if event.get("usage") is not None:
            self.usage_sent = True
        self.events += 1
        return changed

    def passthrough_bytes(self, data: bytes) -> bytes | None:
        """`passthrough` of the usual event without parsing it: what goes to the client, or
        None when only a parse can tell (the caller then parses it and calls `passthrough`).

        The usual event is one token's chunk of one choice as vLLM and pdgate's shims write
        it: compact JSON, the stream's id first, one choice, its text (or delta) then null
        logprobs and finish reason, its ``"token_ids":[...]`` last and nothing after them
        but a null usage. Its ids are recorded as bytes (parsed into `ids` only when they are
        needed) and cut out, with a null ``prompt_token_ids``, unless the client asked for
        them; the decode's id is replaced by the request's. Anything else takes the parse:
        the stream's first event, stop strings (the text's tail), and any event that does not
        match that shape byte for byte (a finish reason, logprobs, usage, several choices,
        other fields or spacing). Substring searches cost more than orjson's parse of the
        whole event, so the shape is checked at its two ends only.

        Once a chunk came without ids (an engine that does not send them), the stream cannot
        be continued elsewhere (`why_not`), and the usual event is the same without its ids:
        only its id is swapped."""
        if self.head is None or self.stops:
            return None
        old = None
        if not data.startswith(self._id_prefix):
            old = self._old_prefix
            if old is None or not data.startswith(old):
                return None
        at = data.rfind(b',"token_ids":[')
        if at < 0 and not self.ids_complete:
            if not data.endswith(_NO_IDS_ENDS) or data.find(b'"choices":[{"index":0,') < 0:
                return None
            self.events += 1
            return data if old is None else self._id_prefix + data[len(old) :]
        if (
            at < 0
            or not data.endswith(_BEFORE_IDS, 0, at)
            or data.rfind(b'"choices":[{"index":0,', 0, at) < 0  # the one choice
        ):
            return None
        end = data.find(b"]", at)
        if data[end:] not in _AFTER_IDS:
            return None
        if end > at + 14:  # an event may carry no token
            self._raw_ids.append(data[at + 14 : end])
        self.events += 1
        out = data
        if not self.client_ids:
            if data.endswith(_NULL_PROMPT_IDS, 0, at):
                at -= len(_NULL_PROMPT_IDS)
            out = data[:at] + data[end + 1 :]
        if old is not None:
            out = self._id_prefix + out[len(old) :]
        return out

    def _prompt_ids(self, holder: dict[str, Any]) -> bool:
        if self.prompt_ids is None and _int_list(holder["prompt_token_ids"]):
            self.prompt_ids = list(holder["prompt_token_ids"])
        if self.client_ids:
            return False
        del holder["prompt_token_ids"]
        return True

    # -- the first token early -----------------------------------------------------------

    def early(self, reply: dict[str, Any]) -> list[dict[str, Any]] | None:
        """The client's first event(s) from the prefill's answer (asked with
        ``return_token_ids``), or None when its first token cannot go out early: no ids, the
        answer already ended (its first token is the last), or the token could begin a stop
        string (a decode would hold it back)."""
        choices = reply.get("choices")
        if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
            return None
        choice = choices[0]
        prompt_ids = reply.get("prompt_token_ids", choice.get("prompt_token_ids"))
        ids = choice.get("token_ids")
        if not _int_list(prompt_ids) or not _int_list(ids) or len(ids) != 1:
            return None
        if choice.get("finish_reason") == "stop":
            return None
        if self.chat:
            message = choice.get("message")
            text = message.get("content") if isinstance(message, dict) else None
        else:
            text = choice.get("text")
        if not isinstance(text, str) or open_stop(self.stops, text):
            return None
        self.head = {
            "id": self.request_id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": reply.get("created") or int(time.time()),
            "model": reply.get("model"),
        }
        self.prompt_ids = list(prompt_ids)
        out = []
        if self.chat:
            role: dict[str, Any] = {
                **self.head,
                "choices": [
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            }
            if self.client_ids:
                role["prompt_token_ids"] = self.prompt_ids
            out.append(role)
        first = self._chunk(text, None, choice.get("logprobs"), ids)
        if self.client_ids and not self.chat:
            first["choices"][0]["prompt_token_ids"] = self.prompt_ids
        out.append(first)
        self._record(text, ids, None)
        self.events += len(out)
        return out

    # -- continuation legs ---------------------------------------------------------------

    def why_not(self, forward: dict[str, Any], extensions: tuple[str, ...] = ()) -> str | None:
        """Why this stream cannot be continued from token ids (None: it can). `extensions`:
        what the decode that served the stream so far declared."""
        if self.prompt_ids is None:
            return "the decode sent no prompt token ids"
        if not self.ids_complete:
            return "a chunk came without its token ids"
        if (why := not_continuable(forward)) is not None:
            return why
        if self.stops and EXT_CONTINUATION not in extensions:
            # A stock server may hold back text for a stop string while sending its tokens'
            # ids: that text would be lost.
            return "stop strings on a decode that does not declare the continuation extension"
        return None

    def body(self, forward: dict[str, Any]) -> dict[str, Any]:
        """The continuation's request: prompt ids + every id the client was sent, to
        ``/v1/completions``, with ``max_tokens`` reduced by them."""
        assert self.prompt_ids is not None
        dropped = _REPLACED | _CHAT_ONLY if self.chat else _REPLACED
        body = {k: v for k, v in forward.items() if k not in dropped}
        if self.chat and forward.get("logprobs"):
            body["logprobs"] = self.top_logprobs
        if isinstance(min_tokens := body.get("min_tokens"), int):
            body["min_tokens"] = max(0, min_tokens - len(self.ids))
        body.update(
            prompt=[*self.prompt_ids, *self.ids],
            max_tokens=self.remaining,
            return_token_ids=True,
        )
        return body

    def begin_leg(self) -> None:
        """A continuation leg starts: it was given every id recorded so far."""
        self._base = len(self.ids)

    def continued(
        self, event: dict[str, Any], stop: JoinedStop | None = None
    ) -> list[dict[str, Any]]:
        """An event of a continuation leg as the client's stream (possibly none)."""
        out = []
        for choice in event.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            text = choice.get("text")
            text = text if isinstance(text, str) else ""
            finish = choice.get("finish_reason")
            if stop is not None and stop.active:
                text, stopped = stop.feed(text, final=finish is not None)
                if stopped:
                    finish = "stop"
            ids = choice.get("token_ids")
            logprobs = choice.get("logprobs")
            logprobs = self._chat_logprobs(logprobs) if self.chat else self._shifted(logprobs)
            out.append(self._chunk(text, finish, logprobs, ids))
            self._record(text, ids, finish)
        usage = event.get("usage")
        if isinstance(usage, dict):
            generated = usage.get("completion_tokens")
            if isinstance(generated, int):
                out.append(self.usage_event(self._base + generated))
        self.events += len(out)
        return out

    def _chunk(self, text: str, finish: Any, logprobs: Any, ids: Any) -> dict[str, Any]:
        assert self.head is not None
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["delta"] = {"content": text}
        else:
            choice["text"] = text
        choice.update(logprobs=logprobs, finish_reason=finish)
        if self.client_ids and ids is not None:
            choice["token_ids"] = ids
        return {**self.head, "choices": [choice]}

    def _shifted(self, logprobs: Any) -> Any:
        """Completions logprobs with ``text_offset`` counted from the start of the client's
        text, not of this leg's."""
        if not isinstance(logprobs, dict) or not self.text_chars:
            return logprobs
        offsets = logprobs.get("text_offset")
        if isinstance(offsets, list):
            base = self.text_chars
            logprobs["text_offset"] = [o + base if type(o) is int else o for o in offsets]
        return logprobs

    def _chat_logprobs(self, logprobs: Any) -> Any:
        """A completion's ``logprobs`` as a chat's ``{"content": [...]}``."""
        if not isinstance(logprobs, dict):
            return None
        tokens = logprobs.get("tokens") or []
        values = logprobs.get("token_logprobs") or []
        tops = logprobs.get("top_logprobs") or []
        content = []
        for i, token in enumerate(tokens):
            top = tops[i] if i < len(tops) and isinstance(tops[i], dict) else {}
            ranked = sorted(top.items(), key=lambda kv: kv[1], reverse=True)[: self.top_logprobs]
            content.append(
                {
                    **_chat_logprob(token, values[i] if i < len(values) else None),
                    "top_logprobs": [_chat_logprob(t, lp) for t, lp in ranked],
                }
            )
        return {"content": content}

    def usage_event(self, completion_tokens: int | None = None) -> dict[str, Any]:
        """The stream's usage: the client's prompt, and every token generated for it."""
        assert self.head is not None
        prompt = len(self.prompt_ids or ())
        completion = len(self.ids) if completion_tokens is None else completion_tokens
        self.usage_sent = True
        return {
            **self.head,
            "choices": [],
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
            },
        }

    def ending(self) -> list[dict[str, Any]]:
        """What a stream whose decode broke after its last token still owes the client: a
        final chunk if no finish reason was sent (max_tokens reached), the usage chunk if
        asked for."""
        out = []
        if self.finish is None:
            out.append(self._chunk("", "length", None, [] if self.client_ids else None))
            self.finish = "length"
        if self.include_usage and not self.usage_sent:
            out.append(self.usage_event())
        self.events += len(out)
        return out


def _chat_logprob(token: Any, logprob: Any) -> dict[str, Any]:
    text = token if isinstance(token, str) else ""
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
