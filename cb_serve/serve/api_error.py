"""The typed HTTP error every endpoint raises (OpenAI's error JSON, counted by status and type),
and the mapping from what an engine replica raised to it."""

from __future__ import annotations

import logging

from fastapi.responses import JSONResponse
from ray.exceptions import RayError, RayTaskError
from ray.serve.exceptions import BackPressureError

from cb_serve import (
    EngineDeadError,
    EngineOverloadedError,
    EngineShutdownError,
    EngineUnavailableError,
    InvalidRequestError,
    RequestFailedError,
    RequestIdInUseError,
    StepFailedError,
)
from cb_serve.serve.metrics import router_metrics
from cb_serve.serve.protocol import error_body

logger = logging.getLogger("cb_serve.serve.router")
RETRY_AFTER_S = 1  # Retry-After of overload answers (the openai client honours it when it retries)
MAX_MESSAGE_CHARS = 1000  # an error message longer than this is cut
# The request id: the client's x-request-id, which Ray Serve's proxy passes on (or sets to one it makes)
# and returns in the response's x-request-id header. It is the response's ``id``, the engine's request
# id and what every log line of the request names. Limits: it goes into logs and the inspector.
REQUEST_ID_HEADER = "x-request-id"


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.headers = headers

    def response(self) -> JSONResponse:
        router_metrics().rejected(self.status, self.type)
        body = error_body(self.message, self.type, self.status, self.param)
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def overloaded(message: str) -> APIError:
    """503 Service Unavailable + Retry-After: the server (not this client) is over capacity;
    OpenAI's API answers engine overload with 503 too and keeps 429 for per-key rate limits."""
    return APIError(503, message, "overloaded_error", headers={"Retry-After": str(RETRY_AFTER_S)})


def unavailable(message: str) -> APIError:
    """503 for a request that failed with its replica or its step: retrying it is safe."""
    return APIError(503, message, "service_unavailable", headers={"Retry-After": str(RETRY_AFTER_S)})


def root_cause(e: BaseException) -> BaseException:
    """The exception raised in the engine replica, unwrapped from Ray's task error."""
    while isinstance(e, RayTaskError) and e.cause is not None and e.cause is not e:
        e = e.cause
    return e


def short(message: str) -> str:
    first = message.strip().splitlines()[0] if message.strip() else "invalid request"
    return first[:MAX_MESSAGE_CHARS]


def engine_error(e: BaseException, request_id: str) -> APIError:
    """Maps an exception from the engine replica (or Ray) to what the client sees: a type, a
    short message and the request id; the details are logged here under that id."""
    cause = root_cause(e)
    ref = f" (request id: {request_id})"
    if isinstance(cause, RequestIdInUseError):
        return APIError(409, short(str(cause)), "conflict_error", param=REQUEST_ID_HEADER)
    if isinstance(cause, InvalidRequestError):
        return APIError(400, short(str(cause)), param=cause.param)
    if isinstance(cause, EngineOverloadedError):
        return overloaded(short(str(cause)))
    if isinstance(e, BackPressureError):
        return overloaded("The server is overloaded (all engine replicas and their queues are full); retry later.")
    if isinstance(cause, ValueError) and not isinstance(cause, RayError):
        return APIError(400, short(str(cause)))
    logger.error("request %s failed: %s", request_id, e, exc_info=not isinstance(e, RayError))
    if isinstance(cause, (EngineShutdownError, EngineUnavailableError)):
        return unavailable("The engine replica is shutting down or restarting; retry the request." + ref)
    if isinstance(cause, EngineDeadError):
        return unavailable("The engine replica failed and is being replaced; retry the request." + ref)
    if isinstance(cause, StepFailedError):
        return unavailable("The engine step running this request failed; retry the request." + ref)
    if isinstance(cause, RequestFailedError):
        return APIError(500, "This request failed on the server." + ref, "internal_error")
    if isinstance(e, RayError) and not isinstance(e, RayTaskError):  # the replica died, or its node
        return unavailable("The engine replica serving this request became unavailable; retry the request." + ref)
    return APIError(500, "Internal server error." + ref, "internal_error")
