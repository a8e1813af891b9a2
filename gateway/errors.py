"""Refusals in OpenAI's error shape, so that OpenAI clients show them as they show OpenAI's own:

{"error": {"message": "...", "type": "...", "param": null, "code": "...", "request_id": "..."}}

`request_id` is the request's X-Request-ID (core.requestid), added when the body is written.
The Messages API's endpoints answer the same refusals in Anthropic's shape (`anthropic_body`):

{"type": "error", "error": {"type": "...", "message": "..."}, "request_id": "..."}
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from core import requestid
from llmgw.limitdefs import BY_NAME


@dataclass(frozen=True)
class Refusal:
    status: int
    payload: dict[str, object]
    headers: dict[str, str] = field(default_factory=dict)

    def body(self) -> bytes:
        """The payload as JSON, its error object naming the request being served."""
        payload = self.payload
        error = payload.get("error")
        request_id = requestid.current.get()
        if request_id is not None and isinstance(error, dict):
            payload = {**payload, "error": {**error, "request_id": request_id}}
        return json.dumps(payload).encode()

    def json(self) -> dict[str, object]:
        return self.payload


# Anthropic's error types by status (its clients raise by status, and show the type).
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    502: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def anthropic_body(refusal: Refusal) -> bytes:
    """The refusal in Anthropic's error shape: the same status, message and headers."""
    error = refusal.payload.get("error")
    message = error.get("message", "") if isinstance(error, dict) else ""
    status = refusal.status
    kind = ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    payload: dict[str, object] = {"type": "error", "error": {"type": kind, "message": message}}
    request_id = requestid.current.get()
    if request_id is not None:
        payload["request_id"] = request_id
    return json.dumps(payload).encode()


BROKEN_MESSAGE = "The replica broke off the answer; try again."


def stream_broken(api: str) -> bytes:
    """The event that ends a stream its replica broke off, in the shape the API's clients raise
    as an error rather than take as a complete answer."""
    request_id = requestid.now()
    if api == "anthropic":
        event: dict[str, Any] = {
            "type": "error",
            "error": {"type": "api_error", "message": BROKEN_MESSAGE},
        }
        return b"event: error\ndata: " + json.dumps(event).encode() + b"\n\n"
    if api == "responses":
        event = {"type": "error", "code": "stream_broken", "message": BROKEN_MESSAGE, "param": None}
        return b"event: error\ndata: " + json.dumps(event).encode() + b"\n\n"
    error = {
        "message": BROKEN_MESSAGE,
        "type": "server_error",
        "code": "stream_broken",
        "request_id": request_id,
    }
    return b"data: " + json.dumps({"error": error}).encode() + b"\n\n"


def openai_error(
    status: int,
    message: str,
    *,
    code: str,
    kind: str = "invalid_request_error",
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> Refusal:
    return Refusal(
        status,
        {"error": {"message": message, "type": kind, "param": param, "code": code}},
        dict(headers or {}),
    )


def missing_key() -> Refusal:
    return openai_error(
        401,
        "No API key was sent. Send a gateway key as 'Authorization: Bearer KEY' (OpenAI clients: "
        "api_key=KEY) or 'x-api-key: KEY' (Anthropic clients: ANTHROPIC_API_KEY); create one "
        "with `llmgw ctl key create NAME`.",
        code="missing_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def invalid_key(revoked: bool) -> Refusal:
    if revoked:
        message = (
            "This API key was revoked, so it opens nothing any more. Ask its owner for a new one, "
            "or create your own with `llmgw ctl key create NAME`."
        )
    else:
        message = (
            "This API key is not one the gateway knows. Check that it was copied whole; "
            "`llmgw ctl keys` lists your keys by their first characters, and "
            "`llmgw ctl key create NAME` makes a new one."
        )
    return openai_error(
        401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}
    )


def expired_key(expired_at: str) -> Refusal:
    return openai_error(
        401,
        f"This API key expired at {expired_at}, so it opens nothing any more. Ask its owner or "
        "staff to extend it (`llmgw ctl key limits ID --expires ...`), or create a new one with "
        "`llmgw ctl key create NAME`.",
        code="expired_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def limited(
    limit: str,
    *,
    team: str | None,
    figure: int,
    used: int,
    retry_after: float,
    resets_at: str,
    headers: dict[str, str],
    reserved: int = 0,
) -> Refusal:
    """429 for a key's or team's limit: which one, its figure, what is used and when it frees;
    `reserved`: the tokens requests in flight hold against it (gateway.limits.reservation)."""
    # OpenAI's codes and types: a rate is `rate_limit_exceeded` of type requests or tokens, a
    # spent budget `insufficient_quota`.
    named = BY_NAME[limit]
    code = "insufficient_quota" if named.budget else "rate_limit_exceeded"
    kind = "insufficient_quota" if named.budget else named.unit
    whose = "This key's" if team is None else f"Its team {team}'s"
    seconds = max(1, int(retry_after + 0.999))
    figure_text = named.figure(figure)
    if reserved and used < figure:
        # Not used up: held by what requests in flight may still use. A rate, not a quota, for
        # OpenAI clients: they retry it.
        limit_or_budget = "budget" if named.budget else "limit"
        return openai_error(
            429,
            f"{whose} {limit_or_budget} of {figure_text} is held by requests in flight ({used:,} "
            f"{named.used_words(used)}, {reserved:,} more reserved by the requests in flight for what "
            "they may still use); send the next one when one of them ends.",
            code="rate_limit_exceeded",
            kind="tokens",
            headers={**headers, "Retry-After": str(seconds)},
        )
    if named.window == "in flight":
        message = (
            f"{whose} limit of {figure_text} is reached ({used:,} in flight); send the next "
            "one when one of them ends."
        )
    elif code == "insufficient_quota":
        message = (
            f"{whose} budget of {figure_text} is spent ({used:,} used); it resets at "
            f"{resets_at}, in {_span(seconds)}. Ask staff to raise it (`llmgw ctl key limits`, "
            "`llmgw ctl team limits`) to go on sooner."
        )
    else:
        message = (
            f"{whose} limit of {figure_text} is reached ({used:,} {named.used_words(used)}); try again in "
            f"{_span(seconds)}."
        )
    return openai_error(
        429,
        message,
        code=code,
        kind=kind,
        headers={**headers, "Retry-After": str(seconds)},
    )


def _span(seconds: int) -> str:
    if seconds < 120:
        return f"{seconds}s"
    minutes = seconds // 60
    if minutes < 120:
        return f"{minutes} minutes"
    return f"{minutes // 60}h{minutes % 60:02d}m"


def limits_full(slots: int) -> Refusal:
    return openai_error(
        503,
        f"This gateway process counts limits for {slots:,} keys and teams at once, and all are "
        "in use; try again in a second (slots free as keys go idle).",
        code="limits_full",
        kind="server_error",
        headers={"Retry-After": "1"},
    )


def limits_unreachable(team: str | None, retry_after: float) -> Refusal:
    """503 for a request whose limits are counted in Redis while it cannot be reached, with
    LLMGW_LIMITS_REDIS_FALLBACK=refuse (gateway.redislimits)."""
    whose = "This key's limits" if team is None else f"Its team {team}'s limits"
    seconds = max(1, int(retry_after + 0.999))
    return openai_error(
        503,
        f"{whose} are counted over every gateway machine, and where they are counted cannot be "
        f"reached just now; try again in {seconds}s.",
        code="limits_unreachable",
        kind="server_error",
        headers={"Retry-After": str(seconds)},
    )


def bad_request(message: str, *, param: str | None = None) -> Refusal:
    return openai_error(400, message, code="invalid_request", param=param)


def too_large(limit: int) -> Refusal:
    return openai_error(
        413,
        f"The request body is larger than this gateway takes ({limit:,} bytes).",
        code="request_too_large",
    )


def too_slow(seconds: float) -> Refusal:
    return openai_error(
        408,
        f"The request body stopped arriving for {seconds:g} seconds; send it whole, then wait.",
        code="request_timeout",
        headers={"Connection": "close"},
    )


def busy(seconds: int) -> Refusal:
    return openai_error(
        503,
        "The gateway holds as many request bodies for the web process as it takes at once; "
        f"try again in {seconds} seconds.",
        code="gateway_busy",
        kind="server_error",
        headers={"Retry-After": str(seconds)},
    )


def client_busy(limit: int, seconds: int) -> Refusal:
    return openai_error(
        503,
        f"Request bodies from your address already hold {limit:,} bytes in this gateway, as much "
        f"as one address may at once; send this one again when those have gone through (try "
        f"again in {seconds} seconds).",
        code="client_busy",
        kind="server_error",
        headers={"Retry-After": str(seconds), "Connection": "close"},
    )


def too_slow_overall(seconds: float) -> Refusal:
    return _too_slow(f"did not arrive whole within {seconds:g} seconds")


def too_slow_rate(rate: float) -> Refusal:
    return _too_slow(f"arrived at under {rate:,.0f} bytes a second")


def _too_slow(what: str) -> Refusal:
    return openai_error(
        408,
        f"The request body {what}; send it at once, over a faster connection if need be, then "
        "wait for the answer.",
        code="request_timeout",
        headers={"Connection": "close", "Retry-After": "1"},
    )


def nodes_busy(seconds: int) -> Refusal:
    return openai_error(
        503,
        "The web process has as many nodes' reports to answer as it takes at once; this node is "
        f"counted alive: send the report again in {seconds} seconds.",
        code="nodes_busy",
        kind="server_error",
        headers={"Retry-After": str(seconds)},
    )


def not_answered(path: str, name: str, engine: str) -> Refusal:
    """400 for an endpoint the model's engine does not serve at all."""
    why = (
        f"{shown_name(name)} runs on {engine}, which does not serve {path}. Use an endpoint "
        f"{engine} serves (chat completions always), or a model of another engine."
    )
    return openai_error(400, why, code="endpoint_not_served", param="model")


def not_served(path: str, name: str, feature: str) -> Refusal:
    """400 for an endpoint the model's engines are not started for: a reranker's rank, or the
    embeddings every other model computes."""
    if feature == "reranking":
        why = (
            f"{shown_name(name)} does not rank documents: its engines compute embeddings. "
            f"{path} takes a reranker, a model defined with reranking: true."
        )
    else:
        why = (
            f"{shown_name(name)} is a reranker (reranking: true): its engines rank documents "
            f"(POST /v1/rerank) and compute no {feature}."
        )
    return openai_error(400, why, code="endpoint_not_served", param="model")


def wrong_method(path: str, method: str) -> Refusal:
    return openai_error(
        405,
        f"{path} takes {method} requests.",
        code="method_not_allowed",
        headers={"Allow": method},
    )


# How much of an unknown name a 404 repeats: a model's name is at most 100 characters, so
# more says nothing, and a client's 1 MB name must not come back as a 2.8 MB answer.
ECHOED_NAME = 120


def shown_name(name: str) -> str:
    """`name` as a message repeats it: quoted, and cut at ECHOED_NAME characters."""
    if len(name) <= ECHOED_NAME:
        return repr(name)
    return f"{name[:ECHOED_NAME]!r}… ({len(name)} characters)"


def unknown_model(name: str, names: list[str], total: int) -> Refusal:
    if names:
        more = (
            f" (and {total - len(names)} more; GET /v1/models lists them all)"
            if total > len(names)
            else ""
        )
        listed = f" Models you can use, closest first: {', '.join(names)}{more}."
    else:
        listed = " The catalog has no models yet."
    return openai_error(
        404,
        f"There is no model named {shown_name(name)}.{listed}",
        code="model_not_found",
        param="model",
    )


def unavailable(message: str, retry_after: int) -> Refusal:
    return openai_error(
        503,
        message,
        code="model_not_ready",
        kind="server_error",
        headers={"Retry-After": str(retry_after)},
    )


def unreachable(name: str) -> Refusal:
    return openai_error(
        502,
        f"The replica chosen for {name} went away before it answered, and no other replica "
        "could take the request. Try again; the fleet replaces replicas that fail.",
        code="replica_unreachable",
        kind="server_error",
    )


def timeout(name: str, seconds: float) -> Refusal:
    return openai_error(
        504,
        f"The replica of {name} did not answer within {seconds:.0f}s.",
        code="replica_timeout",
        kind="server_error",
    )
