"""Run the whole product on one machine: web, worker with beat, and a local node serving a demo model.

Each process is started as a child and stopped by its pid when this command
is interrupted, so nothing is left running behind it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand

DEMO_MODEL = "demo-tiny-chat"
DEMO_FILE = Path("demo") / "tiny-chat" / "local" / "tiny-chat.gguf"


class Command(BaseCommand):
    help = "Run web, worker+beat and a local node (with a demo model) until interrupted."

    def add_arguments(self, parser):
        parser.add_argument("--no-node", action="store_true", help="run no local node")
        parser.add_argument("--no-demo", action="store_true", help="add no demo model")

    def handle(self, *args, **options):
        call_command("migrate", verbosity=0)
        call_command("llmgw_admin")
        node_token = None if options["no_node"] else self._local_node()
        if not options["no_demo"]:
            self._demo_model()
        parts = urlsplit(settings.LLMGW_PUBLIC_URL)
        bind = f"{parts.hostname or '127.0.0.1'}:{parts.port or 8000}"
        bin_dir = Path(sys.executable).parent
        commands = {
            "web": [
                str(bin_dir / "gunicorn"),
                "llmgw_site.wsgi",
                "--bind",
                bind,
                "--workers",
                "2",
                "--threads",
                "8",
                "--timeout",
                "300",
                # Longer than clients keep idle connections (httpx: 5 s), so that a client
                # never reuses a connection the server is closing at that moment.
                "--keep-alive",
                "75",
                "--access-logfile",
                "-",
            ],
            "worker": [
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
                str(settings.VAR_DIR / "celerybeat-schedule"),
            ],
        }
        if node_token:
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
                "--token",
                node_token,
                "--memory",
                str(memory_gb),
                "--cores",
                str(os.cpu_count() or 1),
                "--cache",
                str(settings.VAR_DIR / "node"),
                "--stop-engines-on-exit",
            ]
        # Prometheus numbers of all web workers; a fresh folder each start.
        metrics = settings.VAR_DIR / "metrics"
        shutil.rmtree(metrics, ignore_errors=True)
        metrics.mkdir()
        os.environ["LLMGW_METRICS_DIR"] = str(metrics)
        self._supervise(commands)

    def _local_node(self) -> str:
        """The local node's token, kept in var/ (the control plane itself only keeps its hash)."""
        from catalog.services import Actor
        from fleet.models import Node
        from fleet.services import node_add

        token_file = settings.VAR_DIR / "local-node-token"
        if token_file.exists() and Node.objects.filter(name="local").exists():
            return token_file.read_text().strip()
        Node.objects.filter(name="local").delete()
        from django.contrib.auth import get_user_model

        admin = get_user_model().objects.filter(is_superuser=True).order_by("pk").first()
        _, token = node_add(actor=Actor.for_user(admin, "system"), name="local")
        token_file.write_text(token + "\n")
        token_file.chmod(0o600)
        return token

    def _demo_model(self) -> None:
        """A tiny generated model in the mirror, served by the local node, so there is something to see."""
        from django.contrib.auth import get_user_model

        from catalog.config import current_config
        from catalog.definitions import clean_definition
        from catalog.mirror_files import mirror_url
        from catalog.models import Model
        from catalog.services import Actor, model_add
        from llmgw.tinygguf import write_tiny_model

        path = Path(current_config().mirror_root) / DEMO_FILE
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            write_tiny_model(path, seed=1)
        if Model.objects.filter(name=DEMO_MODEL).exists():
            return
        admin = get_user_model().objects.filter(is_superuser=True).order_by("pk").first()
        definition = clean_definition(
            {
                "name": DEMO_MODEL,
                "source": mirror_url(str(DEMO_FILE)),
                "description": "a tiny generated model (random weights) to try llmgw with",
                "context_length": 512,
                "profiles": [{"name": "cpu", "memory_gb": 1, "cores": 1}],
            }
        )
        model_add(actor=Actor.for_user(admin, "system"), definition=definition, source_check=False)
        self.stdout.write(
            f"  Demo model:        {DEMO_MODEL} (llmgw ctl model target {DEMO_MODEL})"
        )

    def _supervise(self, commands: dict[str, list[str]]) -> None:
        children: dict[str, subprocess.Popen[bytes]] = {}
        stopping = False

        def stop(*_: object) -> None:
            nonlocal stopping
            stopping = True

        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGTERM, stop)
        for name, command in commands.items():
            children[name] = subprocess.Popen(command)
            self.stdout.write(f"started {name} (pid {children[name].pid})")
        self.stdout.write(f"llmgw is running at {settings.LLMGW_PUBLIC_URL}/ — Ctrl-C stops it.")
        try:
            while not stopping:
                for name, child in children.items():
                    if child.poll() is not None:
                        self.stderr.write(
                            f"{name} exited with code {child.returncode}; stopping the rest."
                        )
                        stopping = True
                        break
                time.sleep(0.5)
        finally:
            # The node first, so that it stops its engines while the web still answers.
            for name in sorted(children, key=lambda n: n != "node"):
                child = children[name]
                if child.poll() is None:
                    child.send_signal(signal.SIGTERM)
                    try:
                        child.wait(timeout=20)
                    except subprocess.TimeoutExpired:
                        child.kill()
