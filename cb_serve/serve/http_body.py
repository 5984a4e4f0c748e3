"""The HTTP validation boundary every route shares: the request id, and the body read under a byte
limit (chunked bodies too) as ``application/json``, UTF-8, JSON without NaN/Infinity and at most
``MAX_JSON_DEPTH`` deep. Every failure is an ``APIError`` (a typed 4xx)."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

import numpy as np
from fastapi import Request

from cb_serve.serve.api_error import REQUEST_ID_HEADER, APIError

REQUEST_ID = re.compile(r"[A-Za-z0-9._~:;=/+@-]{1,128}")  # what REQUEST_ID_HEADER may hold
MAX_JSON_DEPTH = 64  # nesting of [ and { in a request body
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')


def request_id_of(request: Request, prefix: str) -> str:
    """The client's x-request-id if it is within limits (400 if not); without one (the app called
    without Ray Serve's proxy, which always sets it), ``prefix``-<random hex>, as OpenAI's ids."""
    given = request.headers.get(REQUEST_ID_HEADER)
    if given is None:
        return f"{prefix}-{uuid.uuid4().hex}"
    if not REQUEST_ID.fullmatch(given):
        raise APIError(
            400, "x-request-id must be 1 to 128 characters of A-Z a-z 0-9 . _ ~ : ; = / + @ -", param=REQUEST_ID_HEADER
        )
    return given


def json_depth(body: bytes) -> int:
    """How deeply ``[`` and ``{`` nest in a JSON text (outside strings); vectorized, so a
    hostile megabyte costs milliseconds and no recursion."""
    brackets = np.frombuffer(_JSON_STRING.sub(b"", body), dtype=np.uint8)
    steps = np.isin(brackets, (0x5B, 0x7B)).astype(np.int32) - np.isin(brackets, (0x5D, 0x7D))
    return int(np.cumsum(steps).max(initial=0))


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object, or an APIError: 415 not JSON, 413 larger than ``limit`` bytes
    (counting the bytes read, chunked bodies included), 400 bad UTF-8 / JSON / nesting."""
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise APIError(415, "The request body must be JSON (Content-Type: application/json).")
    too_large = APIError(413, f"Request body exceeds {limit} bytes.")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large
    if json_depth(bytes(body)) > MAX_JSON_DEPTH:
        raise APIError(400, f"The request body nests deeper than {MAX_JSON_DEPTH} levels.")
    try:
        data = json.loads(bytes(body).decode("utf-8"), parse_constant=_no_constants)
    except UnicodeDecodeError:
        raise APIError(400, "The request body is not valid UTF-8.") from None
    except (ValueError, RecursionError):
        raise APIError(400, "The request body is not valid JSON.") from None
    if not isinstance(data, dict):
        raise APIError(400, "The request body must be a JSON object.")
    return data
