"""Images reach a model started with a vision projector (its `mmproj`), in each API's shape, and
nothing else: a text model refuses them with a 400, a remote image is fetched by the gateway
only from an allowed host (every redirect hop checked) and sent on inline, and an image that
is not one is a 400 before any engine sees it.

The real llama.cpp server, on the tiny model and the tiny projector (llmgw.tinygguf).
"""

from __future__ import annotations

import base64
import struct
import threading
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from llmgw.engine import find_engine
from llmgw.tinygguf import write_tiny_mmproj, write_tiny_model
from tests.gateway.fake_engine import FakeEngine
from tests.support.engine import running_engine
from tests.support.gateway_state import current_state

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(
        find_engine() is None, reason="llama-server is not built (make setup builds it)"
    ),
]


def png(width: int = 8, height: int = 8) -> bytes:
    """A small RGB PNG, made here."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data))
            + kind
            + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
        )

    rows = b"".join(
        b"\x00" + b"".join(bytes((x * 31 % 256, y * 31 % 256, 99)) for x in range(width))
        for y in range(height)
    )
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )


PNG = png()
DATA_URL = "data:image/png;base64," + base64.b64encode(PNG).decode()


@pytest.fixture(scope="module")
def vision_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    folder = tmp_path_factory.mktemp("vision")
    write_tiny_model(folder / "tiny.gguf", seed=1)
    write_tiny_mmproj(folder / "mmproj.gguf", seed=1)
    with running_engine(
        folder / "tiny.gguf",
        alias="seeing",
        context_length=1024,
        mmproj=folder / "mmproj.gguf",
        log=folder / "engine.log",
    ) as url:
        yield int(url.rsplit(":", 1)[1])


FETCHED: list[str] = []  # the paths images_server was asked for


@pytest.fixture
def images_server() -> Iterator[str]:
    """A web server on 127.0.0.1: /cat.png is an image, /away redirects to another host's."""
    FETCHED.clear()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            FETCHED.append(self.path)
            if self.path == "/cat.png":
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(PNG)))
                self.end_headers()
                self.wfile.write(PNG)
            elif self.path == "/away":
                self.send_response(302)
                self.send_header("Location", "http://localhost:9/cat.png")
                self.send_header("Content-Length", "0")
                self.end_headers()
            else:
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"hi")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.fixture
def served(gw: Any, catalog: Any, vision_engine: int, engine: FakeEngine) -> Any:
    catalog.add("seeing", mmproj="mmproj.gguf")
    catalog.replica("seeing", vision_engine)
    catalog.add("blind")
    catalog.replica("blind", engine)
    current_state().reload()
    return gw


def image_chat(url: str) -> list[dict[str, Any]]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what is this?"},
                {"type": "image_url", "image_url": {"url": url}},
            ],
        }
    ]


def test_an_image_reaches_a_vision_model_in_each_api(served: Any) -> None:
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key=served.key, max_retries=0)
    chat = client.chat.completions.create(
        model="seeing", messages=image_chat(DATA_URL), max_tokens=4
    )
    # The image's patches are in the prompt: far more tokens than the words alone.
    words = client.chat.completions.create(
        model="seeing", messages=[{"role": "user", "content": "what is this?"}], max_tokens=4
    )
    assert chat.usage.prompt_tokens > words.usage.prompt_tokens + 4
    response = client.responses.create(
        model="seeing",
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "what is this?"},
                    {"type": "input_image", "image_url": DATA_URL},
                ],
            }
        ],
        max_output_tokens=4,
    )
    assert response.status == "completed"
    claude = anthropic.Anthropic(base_url=served.url, api_key=served.key, max_retries=0)
    message = claude.messages.create(
        model="seeing",
        max_tokens=4,
        messages=[
            {
                "role": "user",
                "content": [
                    {
                        "type": "image",
                        "source": {
                            "type": "base64",
                            "media_type": "image/png",
                            "data": base64.b64encode(PNG).decode(),
                        },
                    },
                    {"type": "text", "text": "what is this?"},
                ],
            }
        ],
    )
    assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) > 10


def test_a_text_model_and_a_broken_image_are_refused_before_any_engine(
    served: Any, engine: FakeEngine
) -> None:
    refused = served.post(
        "/v1/chat/completions", {"model": "blind", "messages": image_chat(DATA_URL)}
    )
    assert refused.status_code == 400
    assert "takes text only" in refused.json()["error"]["message"]
    assert engine.requests == []
    for url, said in (
        ("data:image/png;base64,not base64!", "not valid base64"),
        ("data:text/plain;base64,aGk=", "not of an image"),
        ("file:///etc/passwd", "http(s) URL"),
    ):
        answer = served.post(
            "/v1/chat/completions", {"model": "seeing", "messages": image_chat(url)}
        )
        assert answer.status_code == 400, url
        assert said in answer.json()["error"]["message"], answer.text


def test_a_remote_image_is_fetched_by_the_gateway_only_from_an_allowed_host(
    served: Any, settings: Any, images_server: str
) -> None:
    body = {"model": "seeing", "messages": image_chat(f"{images_server}/cat.png"), "max_tokens": 2}
    refused = served.post("/v1/chat/completions", body)
    assert refused.status_code == 400
    assert "LLMGW_GATEWAY_IMAGE_HOSTS" in refused.json()["error"]["message"]

    settings.LLMGW_GATEWAY_IMAGE_HOSTS = [images_server.removeprefix("http://")]
    fetched = served.post("/v1/chat/completions", body)
    assert fetched.status_code == 200, fetched.text
    inline = served.post("/v1/chat/completions", {**body, "messages": image_chat(DATA_URL)}).json()
    # The engine saw the same image, inline: the same prompt.
    assert fetched.json()["usage"]["prompt_tokens"] == inline["usage"]["prompt_tokens"]

    # A redirect to a host not on the list is not followed; a page that is no image is refused.
    away = served.post(
        "/v1/chat/completions", {**body, "messages": image_chat(f"{images_server}/away")}
    )
    assert away.status_code == 400 and "localhost" in away.json()["error"]["message"]
    page = served.post(
        "/v1/chat/completions", {**body, "messages": image_chat(f"{images_server}/page")}
    )
    assert page.status_code == 400 and "is not an image" in page.json()["error"]["message"]


def test_a_key_past_its_limit_makes_the_gateway_fetch_nothing(
    served: Any, settings: Any, images_server: str
) -> None:
    from access.models import GatewayKey, hash_key

    settings.LLMGW_GATEWAY_IMAGE_HOSTS = [images_server.removeprefix("http://")]
    GatewayKey.objects.filter(key_hash=hash_key(served.key)).update(rpm=1)
    body = {"model": "seeing", "messages": image_chat(f"{images_server}/cat.png"), "max_tokens": 2}
    assert served.post("/v1/chat/completions", body).status_code == 200
    assert served.post("/v1/chat/completions", body).status_code == 429
    assert FETCHED == ["/cat.png"]  # the refused request's image was never fetched
