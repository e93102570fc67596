"""HTTP delivery of one outbox row to one receiver, and the request signature receivers can verify.

Signature: header `X-Kvops-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, f"{t}.{body}")>`,
computed over the exact body bytes. The timestamp inside the signed text lets a receiver refuse
replays older than a few minutes; `verify_signature` below is the reference check.

What a failure means for the row is kvops.alerting.delivery's call: `DeliveryResult.rejected` (a
4xx that waiting will not cure) gets one retry and then makes the row a dead letter; everything else
is retried with backoff.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from dataclasses import dataclass

import httpx

from kvops.alerting.config import ResolvedReceiver

SIGNATURE_HEADER = "X-Kvops-Signature"
IDEMPOTENCY_HEADER = "Idempotency-Key"
USER_AGENT = "kvops-alerting/1"
_ERROR_BODY_CHARS = 200


def sign(body: bytes, secret: str, timestamp: int) -> str:
    digest = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={digest}"


def verify_signature(
    body: bytes, header: str, secret: str, *, tolerance_s: float = 300.0, now: float | None = None
) -> bool:
    """True when `header` signs `body` with `secret` and its timestamp is within `tolerance_s` of now."""
    try:
        fields = dict(part.split("=", 1) for part in header.split(","))
        timestamp = int(fields["t"])
        claimed = fields["v1"]
    except (KeyError, ValueError):
        return False
    current = time.time() if now is None else now
    if abs(current - timestamp) > tolerance_s:
        return False
    expected = sign(body, secret, timestamp).rsplit("v1=", 1)[1]
    return hmac.compare_digest(expected, claimed)


@dataclass(frozen=True)
class DeliveryResult:
    ok: bool
    status_code: int | None = None
    error: str | None = None  # why it failed, with secrets and the URL blanked out

    @property
    def rejected(self) -> bool:
        """A client error that waiting alone will not cure (not 408 Request Timeout / 429 Too Many Requests)."""
        return self.status_code is not None and 400 <= self.status_code < 500 and self.status_code not in (408, 429)


class ReceiverClient:
    def __init__(self, receiver: ResolvedReceiver, http: httpx.Client) -> None:
        self.receiver = receiver
        self._http = http
        # the URL may itself carry a token (chat webhooks put one in the path): keep it out of errors too
        secrets = (self._bearer(), self._hmac_secret(), receiver.url, receiver.endpoint)
        self._redact = sorted((s for s in secrets if s), key=len, reverse=True)  # longest first: url is in endpoint

    def _bearer(self) -> str | None:
        token = self.receiver.bearer_token
        return token.get_secret_value() if token is not None else None

    def _hmac_secret(self) -> str | None:
        secret = self.receiver.hmac_secret
        return secret.get_secret_value() if secret is not None else None

    def send(self, body: bytes, idempotency_key: str, timeout_s: float | None = None) -> DeliveryResult:
        headers = {"Content-Type": "application/json", "User-Agent": USER_AGENT, IDEMPOTENCY_HEADER: idempotency_key}
        bearer = self._bearer()
        if bearer is not None:
            headers["Authorization"] = f"Bearer {bearer}"
        secret = self._hmac_secret()
        if secret is not None:
            headers[SIGNATURE_HEADER] = sign(body, secret, int(time.time()))
        timeout = self.receiver.timeout_s if timeout_s is None else min(timeout_s, self.receiver.timeout_s)
        try:
            response = self._http.post(self.receiver.endpoint, content=body, headers=headers, timeout=timeout)
        except httpx.HTTPError as exc:
            return DeliveryResult(ok=False, error=self._clean(f"{type(exc).__name__}: {exc}"))
        if 200 <= response.status_code < 300:
            return DeliveryResult(ok=True, status_code=response.status_code)
        # blank secrets before truncating: a cut through a token would leave a prefix no longer matched
        text = self._clean(response.text)[:_ERROR_BODY_CHARS].strip()
        error = f"HTTP {response.status_code}" + (f": {text}" if text else "")
        return DeliveryResult(ok=False, status_code=response.status_code, error=error)

    def _clean(self, message: str) -> str:
        # a receiver may echo the request (headers included) in its error page
        for secret in self._redact:
            message = message.replace(secret, "[redacted]")
        return message
