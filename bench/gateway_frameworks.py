"""Why the gateway is a lean ASGI application and not Django async views: the cost of each per request.

Both are served by uvicorn (1 worker, uvloop, httptools) and answer the same small JSON:
- "django": an async Django view behind this project's settings (its middleware: sessions, CSRF,
  auth, login throttling, htmx, ...), through Django's ASGI handler;
- "lean": the gateway's own application (gateway.asgi), GET /v1/models with a gateway key, which
  also checks the key and reads the catalog from memory.
It prints the server's CPU time per request and the median latency at 1 and 8 clients.

Run: .venv/bin/python bench/gateway_frameworks.py
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.gateway import Processes, free_port, prepare_gateway, tree_cpu_seconds, wait_http  # noqa: E402

DJANGO_APP = """
import os
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")
import django
django.setup()
from django.conf import settings
from django.http import JsonResponse
from django.urls import path

async def models(request):
    return JsonResponse({"object": "list", "data": [{"id": "bench-fast", "object": "model"}]})

urlpatterns = [path("v1/models", models)]
settings.ROOT_URLCONF = __name__
from django.core.asgi import get_asgi_application
application = get_asgi_application()
"""


async def load(url: str, headers: dict[str, str], clients: int, count: int) -> list[float]:
    import aiohttp

    latencies: list[float] = []
    left = count
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def client() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                started = time.perf_counter()
                async with session.get(url, headers=headers) as response:
                    await response.read()
                    assert response.status == 200, response.status
                latencies.append(time.perf_counter() - started)

        await asyncio.gather(*(client() for _ in range(clients)))
    return latencies


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-fw-") as tmp:
        folder = Path(tmp)
        processes = Processes(folder)
        try:
            env, key = prepare_gateway(folder, free_port(), free_port())
            (folder / "django_bench_app.py").write_text(DJANGO_APP)
            servers = {}
            for name, target in (
                ("django", "django_bench_app:application"),
                ("lean", "gateway.asgi:application"),
            ):
                port = free_port()
                argv = [
                    str(Path(sys.executable).parent / "uvicorn"),
                    target,
                    "--port",
                    str(port),
                    "--loop",
                    "uvloop",
                    "--http",
                    "httptools",
                    "--no-access-log",
                    "--log-level",
                    "warning",
                ]
                processes.start(name, argv, {**env, "PYTHONPATH": f"{folder}:{ROOT}"})
                servers[name] = f"http://127.0.0.1:{port}/v1/models"
            headers = {"Authorization": f"Bearer {key}"}
            for name, url in servers.items():
                wait_http(url, name, headers=headers)
            print("per request, served by uvicorn (1 worker): CPU of the server, median latency")
            for clients in (1, 8):
                for name, url in servers.items():
                    asyncio.run(load(url, headers, clients, 200))  # warm
                    pid = processes.pid(name)
                    before = tree_cpu_seconds(pid)
                    latencies = asyncio.run(load(url, headers, clients, 3000))
                    cpu = (tree_cpu_seconds(pid) - before) / len(latencies) * 1000
                    print(
                        f"  {name:<7} {clients} client(s): {cpu:.3f} ms CPU, "
                        f"p50 {statistics.median(latencies) * 1000:.2f} ms"
                    )
        finally:
            processes.stop_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
