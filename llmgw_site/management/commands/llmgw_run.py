"""Run the whole product on one machine: gateway, web, worker with beat, and a local node serving a
demo model.

The public address (LLMGW_PUBLIC_URL) is the gateway's (uvicorn's workers): it serves /v1/ and
/metrics itself and passes everything else to the web process (gunicorn), which listens on a
free port of 127.0.0.1 only.

Each process is started as a child and stopped by its pid when this command
is interrupted, so nothing is left running behind it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError

from catalog.config import DEFAULT_REGISTRY, current_config
from catalog.models import Model
from core.actor import Actor
from fleet.models import Node
from fleet.services import node_add
from gateway.conf import trusted_proxies
from llmgw import demo, localhub
from llmgw_site.private_files import FILE_MODE, kept_secret, restrict, write_secret
from llmgw_site.startup import apply_config_on_start
from registry.updates import serve_start


def worker_command(bin_dir: Path, schedule: Path) -> list[str]:
    """A Celery worker that also runs beat (-B), keeping beat's schedule in `schedule`.

    Its beat sends only while it holds the beat lease when the database is shared
    (llmgw_site.beat), so the run command may run on several machines at once."""
    return [
        str(bin_dir / "celery"),
        "-A",
        "llmgw_site",
        "worker",
        "-B",
        "--loglevel",
        "INFO",
        "--concurrency",
        "2",
        "--schedule",
        str(schedule),
        # The embedded beat does not read CELERY_BEAT_SCHEDULER.
        "--scheduler",
        "llmgw_site.beat:LeaderScheduler",
    ]


def gateway_command(bin_dir: Path, host: str, port: int, *, workers: int) -> list[str]:
    """uvicorn serving the gateway's ASGI application (see gateway.asgi) with `workers` processes,
    on the protocol that bounds what a client may cost before it is known (gateway.protocol).

    uvicorn believes X-Forwarded-For and X-Forwarded-Proto only from LLMGW_TRUSTED_PROXIES
    (none by default): otherwise any client could name its own address."""
    proxies = trusted_proxies()
    return [
        str(bin_dir / "uvicorn"),
        "gateway.asgi:application",
        "--host",
        host,
        "--port",
        str(port),
        "--workers",
        str(workers),
        "--loop",
        "uvloop",
        "--http",
        "gateway.protocol:GatewayProtocol",
        "--ws",
        "none",
        *(["--forwarded-allow-ips", ",".join(proxies)] if proxies else ["--no-proxy-headers"]),
        "--no-access-log",
        # Longer than clients keep idle connections (httpx: 5 s), so that a client never
        # reuses a connection the server is closing at that moment.
        "--timeout-keep-alive",
        "75",
        "--backlog",
        "4096",
        "--timeout-graceful-shutdown",
        "30",
    ]


def web_command(bin_dir: Path, bind: str, *, timeout: int) -> list[str]:
    """gunicorn serving the web process on `bind` (127.0.0.1 only: the gateway is its front).

    It takes no SCRIPT_NAME or PATH_INFO from any header (the gateway drops them anyway)."""
    return [
        str(bin_dir / "gunicorn"),
        "llmgw_site.wsgi",
        "--bind",
        bind,
        "--workers",
        "2",
        "--threads",
        "8",
        "--timeout",
        str(timeout),
        # Longer than clients keep idle connections (httpx: 5 s), so that a client never
        # reuses a connection the server is closing at that moment.
        "--keep-alive",
        "75",
        "--forwarder-headers",
        "",
    ]


def behind_gateway_environment(web_bind: str) -> dict[str, str]:
    """What the gateway and the web process need in their environment to work as one address:
    where the web is, and the secret by which the web knows the gateway's word on who the
    client is (gateway.forwarded), new at each start."""
    return {
        "LLMGW_GATEWAY_FORWARD_TO": f"http://{web_bind}",
        "LLMGW_WEB_BEHIND_GATEWAY": "true",
        "LLMGW_GATEWAY_SECRET": secrets.token_urlsafe(32),
    }


def gateway_bind(bind: str | None, public_url: str) -> tuple[str, int]:
    """Where the gateway listens: --bind HOST:PORT, else the public URL's host and port."""
    if not bind:
        parts = urlsplit(public_url)
        return parts.hostname or "127.0.0.1", parts.port or 8000
    host, _, port = bind.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise CommandError(f"--bind {bind}: give a host and a port, like 0.0.0.0:8000.")
    return host.strip("[]"), int(port)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Command(BaseCommand):
    help = "Run web, worker+beat and a local node (with a demo model) until interrupted."

    def add_arguments(self, parser):
        parser.add_argument("--no-node", action="store_true", help="run no local node")
        parser.add_argument(
            "--bind",
            metavar="HOST:PORT",
            help=(
                "where the gateway listens (default: LLMGW_PUBLIC_URL's host and port). Give it "
                "when LLMGW_PUBLIC_URL is a load balancer in front of several machines"
            ),
        )
        parser.add_argument(
            "--no-demo",
            action="store_true",
            help="start no demo registry and serve no demo model",
        )

    def handle(self, *args, **options):
        call_command("migrate", verbosity=0)
        # Before anything reads the configuration (the demo model does) or starts: a bad
        # server.yaml stops here with its message and exit code 2, as each process would.
        apply_config_on_start("run")
        call_command("llmgw_admin")
        node_token_file = None if options["no_node"] else self._local_node()
        started: dict[str, subprocess.Popen[bytes]] = {}
        if not options["no_demo"]:
            registry = self._demo_registry()
            if registry is not None:
                started["registry"] = registry
                self._demo_model()
        host, port = gateway_bind(options["bind"], settings.LLMGW_PUBLIC_URL)
        web_bind = f"127.0.0.1:{_free_port()}"
        bin_dir = Path(sys.executable).parent
        commands = {
            "gateway": gateway_command(bin_dir, host, port, workers=2),
            "web": [*web_command(bin_dir, web_bind, timeout=300), "--access-logfile", "-"],
            "worker": worker_command(bin_dir, settings.VAR_DIR / "celerybeat-schedule"),
        }
        if node_token_file:
            memory_gb = max(
                1, int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 / 2)
            )
            commands["node"] = [
                sys.executable,
                "-m",
                "llmgw",
                "node",
                "--server",
                settings.LLMGW_PUBLIC_URL,
                # A file, not the token: a command line is visible to everyone in `ps`.
                "--token-file",
                str(node_token_file),
                "--memory",
                str(memory_gb),
                "--cores",
                str(os.cpu_count() or 1),
                "--cache",
                str(settings.VAR_DIR / "node"),
                "--stop-engines-on-exit",
            ]
        # Prometheus numbers of all gateway workers, and their requests in flight per replica
        # (gateway.load): fresh folders each start.
        metrics = settings.VAR_DIR / "metrics"
        shutil.rmtree(metrics, ignore_errors=True)
        metrics.mkdir()
        shutil.rmtree(settings.VAR_DIR / "gateway-load", ignore_errors=True)
        os.environ["LLMGW_METRICS_DIR"] = str(metrics)
        os.environ.update(behind_gateway_environment(web_bind))
        self._metrics_token()
        self._supervise(commands, started)

    def _metrics_token(self) -> None:
        """/metrics needs a scrape token unless one is set or it is left open deliberately:
        one is made the first time and kept in var/ for a local Prometheus to read."""
        if os.environ.get("LLMGW_METRICS_TOKEN") or os.environ.get("LLMGW_METRICS_OPEN"):
            return

        token_file = settings.VAR_DIR / "metrics-token"
        os.environ["LLMGW_METRICS_TOKEN"] = kept_secret(
            token_file, lambda: secrets.token_urlsafe(32)
        )
        self.stdout.write(
            f"  Prometheus:        {settings.LLMGW_PUBLIC_URL}/metrics with the bearer token in "
            f"{token_file} (authorization: credentials_file in a scrape config)"
        )

    def _local_node(self) -> Path:
        """The file holding the local node's token, kept in var/ (the control plane itself only
        keeps its hash)."""
        token_file = settings.VAR_DIR / "local-node-token"
        if token_file.exists() and Node.objects.filter(name="local").exists():
            restrict(token_file, FILE_MODE)  # left readable by others by an earlier version
            return token_file
        Node.objects.filter(name="local").delete()

        admin = get_user_model().objects.filter(is_superuser=True).order_by("pk").first()
        _, token = node_add(actor=Actor.for_user(admin, "system"), name="local")
        write_secret(token_file, token + "\n")
        return token_file

    def _demo_registry(self) -> subprocess.Popen[bytes] | None:
        """olah serving the demo repository, so updates can be tried; None when left out."""
        named = settings.LLMGW_REGISTRY_ENDPOINT or current_config().registry_endpoint
        if named != DEFAULT_REGISTRY:
            self.stdout.write(f"  Demo registry:     left out (the registry is {named})")
            return None
        why = localhub.unavailable()
        if why is not None:
            self.stderr.write(f"  Demo registry:     left out: {why}")
            return None
        hub = demo.hub(settings.VAR_DIR / "demo-registry", port=settings.LLMGW_DEMO_REGISTRY_PORT)
        if hub.answers():
            raise CommandError(
                f"Port {settings.LLMGW_DEMO_REGISTRY_PORT} is taken, so the demo registry cannot start there. "
                "Stop what listens on it, or run with --no-demo."
            )
        demo.ensure_repo(hub)
        log = (hub.folder / "olah.log").open("ab")
        process = subprocess.Popen(
            hub.command(),
            cwd=hub.folder,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: see stop_child
        )
        try:
            hub.wait_until_up(process)
        except localhub.HubError as exc:
            process.kill()
            raise CommandError(f"{exc}. Or run with --no-demo.") from None
        # This process and every child it starts ask the demo registry.
        os.environ["LLMGW_REGISTRY_ENDPOINT"] = hub.endpoint
        settings.LLMGW_REGISTRY_ENDPOINT = hub.endpoint
        current_config.cache_clear()
        self.stdout.write(
            f"  Demo registry:     {hub.endpoint} ({demo.DEMO_REPO}, kept in {hub.folder})"
        )
        return process

    def _demo_model(self) -> None:
        """Serve the demo repository's model, following main, so there is something to update."""

        existing = Model.objects.filter(name=demo.DEMO_MODEL).first()
        if existing is None:
            admin = get_user_model().objects.filter(is_superuser=True).order_by("pk").first()
            serve_start(
                actor=Actor.for_user(admin, "system"),
                repo=demo.DEMO_REPO,
                pattern=demo.DEMO_FILE,
                name=demo.DEMO_MODEL,
                memory_gb=1,
                cores=1,
            )
            note = "being fetched into the mirror, then served"
        else:
            note = "served"
        self.stdout.write(
            f"  Demo model:        {demo.DEMO_MODEL}, {note} (llmgw ctl model target "
            f"{demo.DEMO_MODEL})\n"
            f"  Try an update:     .venv/bin/llmgw demo publish, then "
            f".venv/bin/llmgw ctl model updates --check"
        )

    def _supervise(
        self, commands: dict[str, list[str]], started: dict[str, subprocess.Popen[bytes]]
    ) -> None:
        children = dict(started)
        stopping = False

        def stop(*_: object) -> None:
            nonlocal stopping
            stopping = True

        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGTERM, stop)
        failed: tuple[str, int] | None = None
        for name, command in commands.items():
            children[name] = subprocess.Popen(command, start_new_session=True)
            self.stdout.write(f"started {name} (pid {children[name].pid})")
        self.stdout.write(f"llmgw is running at {settings.LLMGW_PUBLIC_URL}/ — Ctrl-C stops it.")
        try:
            while not stopping:
                for name, child in children.items():
                    if child.poll() is not None:
                        self.stderr.write(
                            f"{name} exited with code {child.returncode}; stopping the rest."
                        )
                        failed = (name, child.returncode)
                        stopping = True
                        break
                time.sleep(0.5)
        finally:
            # The node first, so that it stops its engines while the web still answers.
            for name in sorted(children, key=lambda n: n != "node"):
                stop_child(children[name])
        if failed is not None:
            # A process that stopped on its own is a failure, whatever its exit code said.
            raise SystemExit(failed[1] or 1)


def stop_child(child: subprocess.Popen[bytes], grace: float = 20) -> None:
    """SIGTERM, `grace` seconds to finish, then SIGKILL to whatever is left of its process group.

    Each child leads a process group of its own (so Ctrl-C reaches only this command, which
    stops them in order). A worker killed while it stops would leave its pool processes behind,
    holding the terminal and the broker; the group goes with it."""
    if child.poll() is None:
        child.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=grace)
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is gone already
        os.killpg(child.pid, signal.SIGKILL)
    child.wait()
