"""Run the whole product on one machine: gateway, web, Celery worker, beat, and a local node
serving a demo model, each a child process started again when it dies and stopped by its pid
when the command is interrupted. Each process logs to var/log/NAME.log; the terminal shows
start-up, warnings, errors and llmgw's own news.
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
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

import requests
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from core.actor import Actor
from core.diskspace import var_space
from core.logfiles import SharedLogFile
from gateway.conf import trusted_proxies
from llmgw import demo, localhub
from llmgw_site.private_files import kept_secret


def worker_command(bin_dir: Path) -> list[str]:
    """A Celery worker (beat runs beside it, beat_command)."""
    return [
        str(bin_dir / "celery"),
        "-A",
        "llmgw_site",
        "worker",
        "--loglevel",
        "INFO",
        "--concurrency",
        "2",
    ]


def beat_command(bin_dir: Path, schedule: Path) -> list[str]:
    """Celery beat as a process of its own, keeping its schedule in `schedule`.

    Not inside the worker (`worker -B`): a worker does not start its embedded beat again when
    that process dies, and stays up itself, so the schedule would stop with nothing noticing.
    As a process of its own, the run command (or systemd) sees it die and starts it again. It
    sends only while it holds the beat lease when the database is shared (llmgw_site.beat), so
    the run command may run on several machines at once."""
    return [
        str(bin_dir / "celery"),
        "-A",
        "llmgw_site",
        "beat",
        "--loglevel",
        "INFO",
        "--schedule",
        str(schedule),
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
        # No "server: uvicorn" in every answer: it names the software (and so what to try
        # against it) to anyone, and costs a header's writing on every request.
        "--no-server-header",
        # Longer than clients keep idle connections (httpx: 5 s), so that a client never
        # reuses a connection the server is closing at that moment.
        "--timeout-keep-alive",
        "75",
        "--backlog",
        "4096",
        "--timeout-graceful-shutdown",
        "30",
    ]


# The processes the run command starts: gunicorn's workers and threads, uvicorn's workers for the
# gateway (whose node gate, fleet.renewals.NODE_REQUESTS a process, stays below the web's
# threads: tests/fleet/test_renewals.py).
WEB_WORKERS = 2
WEB_THREADS = 16
GATEWAY_WORKERS = 2


def web_command(bin_dir: Path, bind: str, *, timeout: int) -> list[str]:
    """gunicorn serving the web process on `bind` (127.0.0.1 only: the gateway is its front).

    It takes no SCRIPT_NAME or PATH_INFO from any header (the gateway drops them anyway)."""
    return [
        str(bin_dir / "gunicorn"),
        "llmgw_site.wsgi",
        "--bind",
        bind,
        "--workers",
        str(WEB_WORKERS),
        "--threads",
        str(WEB_THREADS),
        "--timeout",
        str(timeout),
        # Longer than clients keep idle connections (httpx: 5 s), so that a client never
        # reuses a connection the server is closing at that moment.
        "--keep-alive",
        "75",
        "--forwarder-headers",
        "",
        # An access log given as a file is rotated by size, one worker at a time.
        "--logger-class",
        "llmgw_site.gunicornlog.Logger",
    ]


# gunicorn's default access line, and the request's ID (core.requestid): the same ID is in the
# gateway's and the web's log lines about the request.
ACCESS_LOG_FORMAT = (
    '%(h)s %(l)s %(u)s %(t)s "%(r)s" %(s)s %(b)s "%(f)s" "%(a)s" %({x-request-id}o)s'
)


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


# The start-up banner waits this long for the public port to answer.
UP_WITHIN_SECONDS = 120


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
        # Here, not at the top: the benches import this module's process commands (gateway_command)
        # without Django set up, and these reach the models.
        from llmgw_site.firststart import first_start
        from llmgw_site.startlock import startup_lock

        supervisor = Supervisor(self.stdout, self.stderr)
        # Held until the demo model is made too: several control planes may start together on
        # one new database (llmgw_site.startlock).
        with startup_lock(say=self.stdout.write):
            node_token_file = first_start(stdout=self.stdout, node=not options["no_node"])
            if not options["no_demo"]:
                registry = self._demo_registry()
                if registry is not None:
                    supervisor.adopt(registry)
                    self._demo_model()
        host, port = gateway_bind(options["bind"], settings.LLMGW_PUBLIC_URL)
        web_bind = f"127.0.0.1:{_free_port()}"
        bin_dir = Path(sys.executable).parent
        logs = settings.VAR_DIR / "log"
        logs.mkdir(exist_ok=True)
        access_log = ["--access-logfile", str(logs / "web-access.log")]
        commands = {
            "gateway": gateway_command(bin_dir, host, port, workers=GATEWAY_WORKERS),
            "web": [
                *web_command(bin_dir, web_bind, timeout=300),
                *access_log,
                "--access-logformat",
                ACCESS_LOG_FORMAT,
            ],
            "worker": worker_command(bin_dir),
            "beat": beat_command(bin_dir, settings.VAR_DIR / "celerybeat-schedule"),
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
        self.stdout.write(
            f"  Logs:              {logs}: web-access.log (every request to the web), and "
            f"{', '.join(f'{n}.log' for n in LOGGED)} (every line; the terminal shows start-up, "
            "warnings, errors and llmgw's own news)"
        )
        supervisor.listen()
        up = threading.Event()
        for name, command in commands.items():
            environment = {"LLMGW_LOG_FILE": str(logs / f"{name}.log")} if name in LOGGED else {}
            child = Child(name, command, env=environment)
            if name == "node":
                # Once the gateway answers: started with it, the agent's first heartbeats find
                # nothing listening, and its first line would read as a failure.
                supervisor.start_when(child, up)
            else:
                supervisor.start(child)
        threading.Thread(
            target=self._say_when_up, args=(settings.LLMGW_PUBLIC_URL, up), daemon=True
        ).start()
        supervisor.run()

    def _say_when_up(self, url: str, up: threading.Event) -> None:
        """Says that llmgw is running once its public port answers through to the web (the
        login page): a first `llmgw ctl` call made on reading it must find someone there. Sets
        `up` then, or when it gives up waiting (what waited for it then says what is wrong)."""
        try:
            self._wait_until_up(url)
        finally:
            up.set()

    def _wait_until_up(self, url: str) -> None:
        session = requests.Session()
        session.trust_env = False  # no proxy from the environment between us and 127.0.0.1
        deadline = time.monotonic() + UP_WITHIN_SECONDS
        while time.monotonic() < deadline:
            with contextlib.suppress(requests.RequestException):
                if session.get(f"{url}/login/", timeout=2, allow_redirects=False).ok:
                    self.stdout.write(f"llmgw is running at {url}/ — Ctrl-C stops it.")
                    return
            time.sleep(0.2)
        self.stderr.write(
            f"llmgw started, but {url}/login/ has not answered within {UP_WITHIN_SECONDS} s: "
            f"see the logs in {settings.VAR_DIR / 'log'} (gateway.log, web.log)."
        )

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
        """llmgw_site.firststart.local_node."""
        from llmgw_site.firststart import local_node

        return local_node()

    def _demo_registry(self) -> Child | None:
        """olah serving the demo repository, so updates can be tried; None when left out.

        It stands in for the registry only when nobody named one: a registry named in
        server.yaml or LLMGW_REGISTRY_ENDPOINT is used as named, Hugging Face itself included.
        Without git-lfs (`make run` without root cannot install it) the run goes on without the
        demo, saying so in one line, rather than stopping."""
        # Here, not at the top: the benches import this module's process commands (gateway_command)
        # without Django set up, and these reach the models.
        from catalog.config import current_config

        config = current_config()
        if config.registry_named_by:
            self.stdout.write(
                f"  Registry:          {config.registry_endpoint} ({config.registry_named_by}); "
                "no demo registry or demo model"
            )
            return None
        why = localhub.unavailable()
        if why is not None:
            self.stderr.write(
                f"  Demo registry:     left out, and the demo model with it: {why}. Install it "
                "and run again, or serve a model of your own: llmgw ctl model serve ORG/NAME "
                "--file '*Q4_K_M.gguf'"
            )
            return None
        hub = demo.hub(settings.VAR_DIR / "demo-registry", port=settings.LLMGW_DEMO_REGISTRY_PORT)
        if hub.answers():
            raise CommandError(
                f"Port {settings.LLMGW_DEMO_REGISTRY_PORT} is taken, so the demo registry cannot start there. "
                "Stop what listens on it, or run with --no-demo."
            )
        demo.ensure_repo(hub)
        registry = Child("registry", hub.command(), cwd=hub.folder, log=hub.folder / "olah.log")
        process = registry.start()
        try:
            hub.wait_until_up(process)
        except localhub.HubError as exc:
            stop_child(process, grace=5)
            raise CommandError(f"{exc}. Or run with --no-demo.") from None
        # This process and every child it starts ask the demo registry.
        os.environ["LLMGW_REGISTRY_ENDPOINT"] = hub.endpoint
        settings.LLMGW_REGISTRY_ENDPOINT = hub.endpoint
        current_config.cache_clear()
        self.stdout.write(
            f"  Demo registry:     {hub.endpoint} ({demo.DEMO_REPO}, kept in {hub.folder})"
        )
        return registry

    def _demo_model(self) -> None:
        """Serve the demo repository's model, following main, so there is something to update."""
        # Here, not at the top: the benches import this module's process commands (gateway_command)
        # without Django set up, and these reach the models.
        from catalog.models import Model
        from registry.updates import serve_start

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


# The processes that log through Django's logging (llmgw_site.settings): each to var/log/NAME.log.
LOGGED = ("gateway", "web", "worker", "beat")


@dataclass
class Child:
    """One process of the run command: how to start it, and its exits."""

    name: str
    argv: list[str]
    cwd: Path | None = None
    log: Path | None = None  # its output goes to this file, else to the terminal
    env: dict[str, str] = field(default_factory=dict)  # added to this process's environment
    process: subprocess.Popen[bytes] | None = None
    exits: deque[float] = field(default_factory=lambda: deque(maxlen=RESTART_LIMIT))
    start_at: float | None = None  # when it is to be started again after an exit

    def start(self) -> subprocess.Popen[bytes]:
        self.process = subprocess.Popen(
            self.argv,
            cwd=self.cwd,
            stdout=subprocess.PIPE if self.log else None,
            stderr=subprocess.STDOUT if self.log else None,
            # This process's environment as it is now (the gateway's secret is set late).
            env={**os.environ, **self.env} if self.env else None,
            start_new_session=True,  # its own process group: see stop_child
        )
        if self.log is not None:
            assert self.process.stdout is not None
            threading.Thread(
                target=copy_output,
                args=(self.process.stdout, self.log),
                name=f"llmgw-run-{self.name}-output",
                daemon=True,
            ).start()
        self.start_at = None
        return self.process


def copy_output(output: IO[bytes], path: Path) -> None:
    """A child's output, line by line, into its log file, rotated as llmgw's own logs are
    (LLMGW_LOG_MAX_BYTES, LLMGW_LOG_BACKUPS): a program that writes its own output to a file
    (the demo registry's server writes a line a request) would otherwise grow it without
    bound. Ends with the output (the child's exit).

    A line the file does not take (a full disk) is left out and counted, and the reading goes
    on: a reader that stopped would leave the child blocked on its full pipe for good."""
    log = SharedLogFile(
        path, max_bytes=settings.LLMGW_LOG_MAX_BYTES, backups=settings.LLMGW_LOG_BACKUPS
    )
    dropped = 0
    with output:
        # A line is read up to OUTPUT_LINE_BYTES at a time: a longer one goes on in pieces.
        for line in iter(lambda: output.readline(OUTPUT_LINE_BYTES), b""):
            try:
                if dropped:
                    log.append(
                        f"llmgw: {dropped} line(s) left out while the disk was full\n".encode()
                    )
                    dropped = 0
                log.append(line)
            except OSError as exc:
                dropped += 1
                if dropped == 1:
                    sys.stderr.write(
                        f"llmgw: cannot write to {path} ({exc}); lines are left out until it can be written\n"
                    )


OUTPUT_LINE_BYTES = 64 * 1024


# A child that exits is started again after RESTART_DELAY seconds, doubled for each exit in the
# last RESTART_WINDOW seconds; its RESTART_LIMIT-th exit within that window stops everything (it
# will not stay up: a port taken, a bad configuration), with its exit code.
RESTART_DELAY = 1.0
RESTART_LIMIT = 3
RESTART_WINDOW = 60.0


class Supervisor:
    """Runs the children until SIGINT or SIGTERM, starting again any that dies, then stops them
    all (the node first, so that it stops its engines while the web still answers)."""

    def __init__(self, stdout: Any, stderr: Any) -> None:
        self.stdout = stdout
        self.stderr = stderr
        self.children: dict[str, Child] = {}
        self.waiting: list[tuple[Child, threading.Event]] = []  # started once their event is set
        self.stopping = False
        self.space = SpaceWatch(stdout, stderr)

    def adopt(self, child: Child) -> None:
        """A child already started (and waited for) by the caller."""
        self.children[child.name] = child

    def start(self, child: Child) -> None:
        self.children[child.name] = child
        process = child.start()
        self.stdout.write(f"started {child.name} (pid {process.pid})")

    def start_when(self, child: Child, ready: threading.Event) -> None:
        """Start `child` (from run()) once `ready` is set."""
        self.waiting.append((child, ready))

    def listen(self) -> None:
        """From now on SIGINT and SIGTERM stop the children (run() returns having stopped them)."""

        def stop(*_: object) -> None:
            self.stopping = True

        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGTERM, stop)

    def run(self) -> None:
        failed: int | None = None
        try:
            while not self.stopping:
                failed = self._tend(time.monotonic())
                if failed is not None:
                    break
                self.space.look(time.monotonic())
                time.sleep(0.5)
        finally:
            self.stop_all()
        if failed is not None:
            # A process that stopped on its own is a failure, whatever its exit code said.
            raise SystemExit(failed or 1)

    def stop_all(self) -> None:
        """The node first, waited for (its engines stop while the web still answers); then beat,
        waited for (it hands its lease to another machine's beat at once, rather than leaving it
        to run out); then the rest together, within one grace period."""
        running = {name: c.process for name, c in self.children.items() if c.process is not None}
        for first in STOP_FIRST:
            if first in running:
                stop_child(running.pop(first))
        stop_children(list(running.values()))

    def _tend(self, now: float) -> int | None:
        """Start again what is due; note what exited. The exit code that stops everything, if
        a child exited too often."""
        for waiting in [w for w in self.waiting if w[1].is_set()]:
            self.waiting.remove(waiting)
            self.start(waiting[0])
        for child in self.children.values():
            if child.start_at is not None:
                if now >= child.start_at:
                    self.start(child)
                continue
            assert child.process is not None
            code = child.process.poll()
            if code is None:
                continue
            child.exits.append(now)
            recent = [t for t in child.exits if now - t <= RESTART_WINDOW]
            if len(recent) >= RESTART_LIMIT:
                self.stderr.write(
                    f"{child.name} exited with code {code}, {len(recent)} times in "
                    f"{RESTART_WINDOW:.0f} s; stopping the rest."
                )
                return code
            delay = RESTART_DELAY * 2 ** (len(recent) - 1)
            self.stderr.write(
                f"{child.name} exited with code {code}; starting it again in {delay:.0f} s."
            )
            child.start_at = now + delay
        return None


# How often the run command looks at the room left on the disk holding LLMGW_VAR_DIR, and below
# what it calls that disk full (where writes start failing; tmpfs and quotas show 0 then, a
# filesystem's reserve for root a few blocks).
SPACE_LOOK_SECONDS = 5.0
FULL_BELOW_BYTES = 1024 * 1024


class SpaceWatch:
    """Says on the terminal when the disk holding LLMGW_VAR_DIR falls below LLMGW_VAR_LOW_FREE_MB,
    when it is full, and when it has room again: a line at each change, not one a look."""

    def __init__(self, stdout: Any, stderr: Any) -> None:
        self.stdout = stdout
        self.stderr = stderr
        self.state = "ok"  # ok, low or full: what was last said
        self.next_look = 0.0

    def look(self, now: float) -> None:
        if now < self.next_look:
            return
        self.next_look = now + SPACE_LOOK_SECONDS
        space = var_space()
        if space is None or space.threshold == 0:
            return
        state = "full" if space.room.free < FULL_BELOW_BYTES else "low" if space.low else "ok"
        if state == self.state:
            return
        if state == "full":
            self.stderr.write(
                f"WARNING: the disk holding llmgw's data is full ({space.room.text()}): "
                "changes (keys, models, node reports, fetches) are refused with HTTP 507 until "
                "space is freed; the gateway goes on answering. Free space there (old logs in "
                f"{settings.VAR_DIR / 'log'}, models no longer served); nothing needs a restart."
            )
        elif state == "low":
            self.stderr.write(f"WARNING: {space.warning()}")
        else:
            self.stdout.write(f"The disk holding llmgw's data has room again: {space.room.text()}.")
        self.state = state


# Stopped one at a time, in this order, before the rest (Supervisor.stop_all).
STOP_FIRST = ("node", "beat")


def stop_children(children: list[subprocess.Popen[bytes]], grace: float = 20) -> None:
    """SIGTERM to each, `grace` seconds for all of them together to finish, then SIGKILL to
    whatever is left of each one's process group.

    Each child leads a process group of its own (so Ctrl-C reaches only this command, which
    stops them in order). A worker killed while it stops would leave its pool processes behind,
    holding the terminal and the broker; the group goes with it."""
    for child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for child in children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=max(0.0, deadline - time.monotonic()))
        with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is gone already
            os.killpg(child.pid, signal.SIGKILL)
        child.wait()


def stop_child(child: subprocess.Popen[bytes], grace: float = 20) -> None:
    """stop_children for one."""
    stop_children([child], grace)
