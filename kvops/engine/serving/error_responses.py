"""OpenAI's error body, as every route and exception handler of the engine's HTTP service answers errors."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from kvops.engine.serving.protocol import ErrorBody, ErrorResponse


def error_response(status: int, message: str, param: str | None = None,
                   kind: str = "invalid_request_error") -> JSONResponse:
    body = ErrorResponse(error=ErrorBody(message=message, type=kind, param=param, code=status))
    return JSONResponse(body.model_dump(), status_code=status)
