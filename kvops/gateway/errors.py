"""OpenAI-shaped error answers: every error the gateway gives, whatever went wrong, never a traceback."""

from __future__ import annotations

from fastapi.responses import JSONResponse


class GatewayError(Exception):
    """A request the gateway answers with an error: HTTP status, a message meant for the client, OpenAI's error type,
    and the `reason` label it is counted under in `kvops_gateway_errors_total`."""

    def __init__(self, status: int, message: str, kind: str, reason: str, headers: dict[str, str] | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.reason = reason
        self.headers = headers or {}
        self.param = param

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.kind, self.headers, self.param)


def error_response(status: int, message: str, kind: str = "invalid_request_error",
                   headers: dict[str, str] | None = None, param: str | None = None) -> JSONResponse:
    """`{"error": {"message", "type", "param", "code"}}`, as OpenAI (and vLLM, and the kvops engine) answer."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


def bad_request(message: str, reason: str = "bad_request", param: str | None = None) -> GatewayError:
    return GatewayError(400, message, "invalid_request_error", reason, param=param)
