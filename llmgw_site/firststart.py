"""What the run command does to the database before it starts any process: migrate, apply
server.yaml, make the first admin (and its token), and the local node's row and token.

All of it under the database's start-up lock (llmgw_site.startlock), so that any number of
control planes started at the same moment on one new database come up: the first does each step,
the others wait for it and find the steps done. The secrets kept in var/ (the secret key, the
metrics token) are made once however many processes start (private_files.kept_secret).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command

from core.actor import Actor
from fleet.models import Node
from fleet.services import node_add

from .private_files import FILE_MODE, restrict, write_secret
from .startlock import startup_lock
from .startup import apply_config_on_start


def first_start(*, stdout: Any, node: bool) -> Path | None:
    """The run command's steps before its processes start; the local node's token file, when
    `node`. Stops the process (SystemExit 2) on a bad server.yaml, as each process would."""
    with startup_lock(say=stdout.write):
        call_command("migrate", verbosity=0)
        # Before anything reads the configuration (the demo model does) or starts: a bad
        # server.yaml stops here with its message and exit code 2.
        apply_config_on_start("run")
        call_command("llmgw_admin", stdout=stdout)
        return local_node() if node else None


def local_node() -> Path:
    """The file holding the local node's token, kept in var/ (the control plane itself only
    keeps its hash); the node made when it or its file is missing."""
    token_file = settings.VAR_DIR / "local-node-token"
    with startup_lock():
        if token_file.exists() and Node.objects.filter(name="local").exists():
            restrict(token_file, FILE_MODE)  # left readable by others by an earlier version
            return token_file
        Node.objects.filter(name="local").delete()
        admin = get_user_model().objects.filter(is_superuser=True).order_by("pk").first()
        _, token = node_add(actor=Actor.for_user(admin, "system"), name="local")
        write_secret(token_file, token + "\n")
    return token_file
