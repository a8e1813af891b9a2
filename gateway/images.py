"""Remote images a request names, fetched by the gateway and sent on inline.

An engine started with a vision projector (a model's `mmproj`) takes images as data URLs, and
would fetch an http(s) URL itself, from the node, following redirects wherever they lead. So the
gateway never passes one on: a URL whose host is on LLMGW_GATEWAY_IMAGE_HOSTS is fetched here,
every redirect hop checked against the same list (core.outbound, as every fetch the control plane
makes), the image read up to what a request body may hold, and the request sent on with the
image inline; any other is refused with a 400 (gateway.validate notes them, this fetches them).
"""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Any

import requests

from core.outbound import HostPolicy, URLRefused, guarded_session

from . import conf, errors
from .errors import Refusal

SETTING = "LLMGW_GATEWAY_IMAGE_HOSTS"
CHUNK_BYTES = 64 * 1024


def policy() -> HostPolicy:
    return HostPolicy(conf.image_hosts(), setting=SETTING)


async def inline(body: dict[str, Any], urls: list[str], limit: int) -> dict[str, Any] | Refusal:
    """`body` with each of `urls` replaced by its image as a data URL (an Anthropic source
    becomes a base64 one), or the refusal of the first that may not or cannot be fetched.
    Each is read up to `limit` bytes, and all of them together too."""
    checked = policy()
    for url in urls:
        try:
            checked.check(url)
        except URLRefused as exc:
            return errors.bad_request(
                f"The gateway does not fetch images from {url[:200]}: its host is not in "
                f"{SETTING} ({', '.join(checked.allowed) or 'no host'} now). Send the image "
                "inline as a data URL (data:image/png;base64,...), or ask the operator to allow "
                f"the host. ({exc.message})"
            )
    fetched: dict[str, tuple[str, str]] = {}
    left = limit
    for url in dict.fromkeys(urls):
        got = await asyncio.to_thread(_fetch, checked, url, left)
        if isinstance(got, Refusal):
            return got
        media, data = got
        left -= len(data)
        fetched[url] = (media, base64.b64encode(data).decode("ascii"))
    return _replaced(body, fetched)


def _fetch(checked: HostPolicy, url: str, most: int) -> tuple[str, bytes] | Refusal:
    seconds = conf.image_fetch_seconds()
    try:
        with (
            guarded_session(checked) as session,
            session.get(url, stream=True, timeout=seconds) as response,
        ):
            media = response.headers.get("Content-Type", "").split(";")[0].strip().lower()
            if response.status_code != 200:
                return errors.bad_request(
                    f"The image at {url[:200]} could not be fetched: its server answered "
                    f"{response.status_code}. Send it inline as a data URL."
                )
            if not media.startswith("image/"):
                return errors.bad_request(
                    f"{url[:200]} is not an image (its server says {media or 'nothing'}); send "
                    "an image, or it inline as a data URL."
                )
            data = bytearray()
            deadline = time.monotonic() + seconds  # a slow or endless answer is cut off
            for chunk in response.iter_content(CHUNK_BYTES):
                data += chunk
                if len(data) > most:
                    return errors.too_large(conf.max_body_bytes())
                if time.monotonic() > deadline:
                    raise requests.Timeout()
            return media, bytes(data)
    except URLRefused as exc:  # a redirect to a host not allowed
        return errors.bad_request(f"The image at {url[:200]} was not fetched: {exc.message}")
    except requests.RequestException as exc:
        return errors.bad_request(
            f"The image at {url[:200]} could not be fetched within {seconds:g}s "
            f"({type(exc).__name__}); send it inline as a data URL."
        )


def _replaced(value: Any, fetched: dict[str, tuple[str, str]]) -> Any:
    """A copy of `value` with each fetched URL inline, wherever an image part names it: a chat
    part's image_url (a string or {"url": ...}), a Responses input_image's image_url, an
    Anthropic image's {"type": "url"} source."""
    if isinstance(value, list):
        return [_replaced(item, fetched) for item in value]
    if not isinstance(value, dict):
        return value
    out = {key: _replaced(item, fetched) for key, item in value.items()}
    kind = value.get("type")
    if kind == "url" and value.get("url") in fetched:  # an Anthropic image's source
        media, data = fetched[value["url"]]
        return {"type": "base64", "media_type": media, "data": data}
    for key in ("url", "image_url"):
        url = value.get(key)
        if isinstance(url, str) and url in fetched:
            media, data = fetched[url]
            out[key] = f"data:{media};base64,{data}"
    return out
