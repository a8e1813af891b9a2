"""An engine that breaks under real requests, for canary tests: the node agent runs this in place
of llama-server (LLMGW_LLAMA_SERVER names a script that runs it) with llama-server's arguments.

For every weights file but one it *is* llama-server (exec). For the weights whose sha256 is in
$LLMGW_FAULTY_SHA256 it starts the real llama-server on those weights on a port of its own and
stands in front of it on the port it was given: /health, /metrics and requests for at most one
token (the agent's readiness probe) are passed through, so the replica becomes ready as any
other; every longer request is answered 500, as an engine that loads but fails on real work
would. So what is real: the weights, the engine loading them, the agent, its readiness check.
What is not: the failure itself, injected here.

    python tests/support/faulty_engine.py --model PATH --host H --port P ...
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def _argument(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as weights:
        for block in iter(lambda: weights.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def main(argv: list[str]) -> None:
    real = os.environ["LLMGW_REAL_LLAMA_SERVER"]
    if _sha256(_argument(argv, "--model")) != os.environ.get("LLMGW_FAULTY_SHA256", ""):
        os.execv(real, [real, *argv])
    host, port = _argument(argv, "--host"), int(_argument(argv, "--port"))
    inner_port = _free_port()
    inner_argv = list(argv)
    inner_argv[inner_argv.index("--port") + 1] = str(inner_port)
    inner_argv[inner_argv.index("--host") + 1] = "127.0.0.1"
    engine = subprocess.Popen([real, *inner_argv])
    inner = f"http://127.0.0.1:{inner_port}"

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            sys.stderr.write("faulty engine: " + format % args + "\n")

        def _pass(self, method: str, body: bytes | None) -> None:
            # The engine's key, when the agent started it with one (--api-key-file), goes on
            # as the caller sent it: the real engine behind checks it.
            headers = {"Content-Type": "application/json"}
            if self.headers.get("Authorization"):
                headers["Authorization"] = self.headers["Authorization"]
            request = urllib.request.Request(
                inner + self.path, data=body, method=method, headers=headers
            )
            try:
                with urllib.request.urlopen(request, timeout=120) as answer:
                    self._send(answer.status, answer.read(), answer.headers.get_content_type())
            except urllib.error.HTTPError as refused:
                self._send(refused.code, refused.read(), "application/json")
            except OSError:
                self._send(503, b'{"error":{"message":"loading"}}', "application/json")

        def _send(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            self._pass("GET", None)

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            try:
                asked = json.loads(body).get("max_tokens")
            except (ValueError, AttributeError):
                asked = None
            if isinstance(asked, int) and asked <= 1:
                self._pass("POST", body)
                return
            error = {
                "error": {
                    "code": 500,
                    "message": "the engine failed on this request",
                    "type": "server_error",
                }
            }
            self._send(500, json.dumps(error).encode(), "application/json")

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True

    def stop(*_: object) -> None:
        engine.terminate()
        try:
            engine.wait(timeout=5)
        except subprocess.TimeoutExpired:
            engine.kill()
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        engine.wait()  # the engine stopping (or being stopped) stops this one too
    finally:
        stop()


if __name__ == "__main__":
    main(sys.argv[1:])
