"""A small REST client for the control plane, with errors a person can act on."""

from __future__ import annotations

import os
from typing import Any

import requests

from llmgw import credentials


class CtlError(Exception):
    """A refusal or failure, already worded for the terminal."""


DEFAULT_URL = "http://127.0.0.1:8000"


class Client:
    def __init__(
        self, url: str | None = None, token: str | None = None, timeout: float = 60
    ) -> None:
        self.url = (url or os.environ.get("LLMGW_URL") or DEFAULT_URL).rstrip("/")
        if token is None:
            # LLMGW_TOKEN, else the token `llmgw ctl login` kept for this control plane ("" is
            # none: a request made without one).
            token = os.environ.get("LLMGW_TOKEN", "")
            try:
                token = token or credentials.token_for(self.url) or ""
            except credentials.CredentialsError as exc:
                raise CtlError(str(exc)) from None
        self.token = token
        self.timeout = timeout
        self.session = requests.Session()
        self.session.headers["X-LLMGW-Client"] = "ctl"
        if self.token:
            self.session.headers["Authorization"] = f"Token {self.token}"

    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        data: bytes | str | None = None,
        content_type: str | None = None,
        params: dict[str, Any] | None = None,
    ) -> Any:
        url = f"{self.url}/api/v1/{path.lstrip('/')}"
        headers = {"Content-Type": content_type} if content_type else None
        try:
            response = self.session.request(
                method,
                url,
                json=json,
                data=data,
                params=params,
                headers=headers,
                timeout=self.timeout,
            )
        except requests.ConnectionError:
            raise CtlError(
                f"cannot reach the control plane at {self.url}: nothing answered there. "
                "Is it running? Set LLMGW_URL to its address."
            ) from None
        except requests.Timeout:
            raise CtlError(
                f"the control plane at {self.url} did not answer within {self.timeout:.0f}s"
            ) from None
        if response.status_code == 204:
            return None
        try:
            body = response.json()
        except ValueError:
            body = None
        if response.ok:
            return body
        raise CtlError(_refusal(response, body))

    def get(self, path: str, **params: Any) -> Any:
        return self.request("GET", path, params={k: v for k, v in params.items() if v is not None})

    def post(self, path: str, body: Any, **params: Any) -> Any:
        return self.request("POST", path, json=body, params=params or None)

    def delete(self, path: str) -> Any:
        return self.request("DELETE", path)


def _refusal(response: requests.Response, body: Any) -> str:
    if isinstance(body, dict) and body.get("detail"):
        message = str(body["detail"])
        problems = body.get("problems") or []
        if len(problems) > 1:
            lines = [message, *(f"  - {_problem(p)}" for p in problems)]
            return "\n".join(lines)
        return message
    if response.status_code == 401:
        return "the control plane refused the token: set LLMGW_TOKEN to a valid API token"
    return f"the control plane answered {response.status_code} {response.reason} for {response.request.method} {response.url}"


def _problem(problem: dict[str, Any]) -> str:
    where = f"line {problem['line']}: " if problem.get("line") else ""
    field = f"{problem['field']}: " if problem.get("field") else ""
    return f"{where}{field}{problem.get('message', '')}"
