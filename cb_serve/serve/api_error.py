"""The typed HTTP error every endpoint raises: OpenAI's error JSON, counted by status and type."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from cb_serve.serve.metrics import router_metrics
from cb_serve.serve.protocol import error_body


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
