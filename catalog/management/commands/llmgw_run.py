"""Run the whole product on one machine: web, worker with beat, and a local node.

Each process is started as a child and stopped by its pid when this command
is interrupted, so nothing is left running behind it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from urllib.parse import urlsplit

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = "Run web, worker+beat and a local node until interrupted."

    def handle(self, *args, **options):
        call_command("migrate", verbosity=0)
        call_command("llmgw_admin")
        parts = urlsplit(settings.LLMGW_PUBLIC_URL)
        bind = f"{parts.hostname or '127.0.0.1'}:{parts.port or 8000}"
        python = sys.executable
        bin_dir = os.path.dirname(python)
        commands = {
            "web": [
                os.path.join(bin_dir, "gunicorn"),
                "llmgw_site.wsgi",
                "--bind",
                bind,
                "--workers",
                "2",
                "--threads",
                "8",
                "--timeout",
                "300",
                "--access-logfile",
                "-",
            ],
            "worker": [
                os.path.join(bin_dir, "celery"),
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
            for child in children.values():
                if child.poll() is None:
                    child.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 20
            for child in children.values():
                try:
                    child.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    child.kill()
