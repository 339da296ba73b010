"""Checks of a client's JSON, each failure a 400 naming the path of what is wrong
(``input[2].content[0].type``), as OpenAI's and Anthropic's APIs name it."""

from __future__ import annotations

from typing import Any

from pdgate.gateway.errors import BadRequest

__all__ = [
    "count_of",
    "flag_of",
    "invalid",
    "list_of",
    "number_of",
    "object_of",
    "text_of",
]


def invalid(param: str, message: str) -> BadRequest:
    """A 400 naming the field (``input[2].content[0].type``) and what is wrong with it."""
    return BadRequest(f"invalid request: {param}: {message}", param=param)


def text_of(value: object, param: str, *, required: bool = True) -> str | None:
    if value is None and not required:
        return None
    if not isinstance(value, str):
        raise invalid(param, "must be a string")
    return value


def flag_of(value: object, param: str, default: bool) -> bool:
    if value is None:
        return default
    if type(value) is not bool:
        raise invalid(param, "must be a boolean")
    return value


def number_of(
    value: object, param: str, low: float, high: float, *, open_low: bool = False
) -> float | int | None:
    if value is None:
        return None
    if type(value) not in (int, float):
        raise invalid(param, "must be a number")
    assert isinstance(value, int | float)
    if value < low or value > high or (open_low and value == low):
        bound = f"({low}, {high}]" if open_low else f"[{low}, {high}]"
        raise invalid(param, f"must be in {bound}")
    return value


def count_of(value: object, param: str, low: int, high: int) -> int | None:
    if value is None:
        return None
    if type(value) is not int:
        raise invalid(param, "must be an integer")
    assert isinstance(value, int)
    if not low <= value <= high:
        raise invalid(param, f"must be between {low} and {high}")
    return value


def object_of(value: object, param: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise invalid(param, "must be an object")
    return value


def list_of(value: object, param: str, most: int) -> list[Any]:
    if not isinstance(value, list):
        raise invalid(param, "must be an array")
    if len(value) > most:
        raise invalid(param, f"has more than {most} entries")
    return value
