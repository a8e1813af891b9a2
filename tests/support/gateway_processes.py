"""Gateway processes started as the run command starts them, for the tests that need more than
one: a database with the model chat served by a fake engine (and, for the limits, a key with a
requests-per-minute limit), two gateways (one uvicorn worker each, each on a port of its own so
that the test decides which takes each request rather than the kernel), and requests sent to
them in turn.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from tests.support.system import System, free_port, wait_for

ASK = {"model": "chat", "prompt": "hi"}

# A script for `manage.py shell -c`: alice, the model chat and one ready replica of it, of one
# slot, on the fake engine at PORT (filled in by chat_on_engine).
_CHAT = """
from django.contrib.auth import get_user_model
from django.utils import timezone
from catalog.definitions import clean_definition
from catalog.models import Model
from core.actor import Actor
from catalog.services import model_add
from fleet.models import Node, Replica, hash_token
from access.models import GatewayKey
from access.services import key_create
from tests.factories import definition

user = get_user_model().objects.create_user("alice", password="alice-password-1")
actor = Actor.for_user(user, "api")
model_add(actor=actor, definition=clean_definition(definition("chat")), source_check=False)
node = Node.objects.create(name="node-a", token_hash=hash_token("node-a"), address="127.0.0.1",
                           memory_gb=16, cores=8, last_heartbeat=timezone.now())
Replica.objects.create(model=Model.objects.get(name="chat"), model_name="chat", node=node,
                       profile="cpu", spec={"adapters": [], "slots": 1}, spec_key="k",
                       state=Replica.READY, port=PORT)
"""


def chat_on_engine(engine_port: int) -> str:
    """The script that adds alice, chat and its replica on the engine (`actor` is alice's then):
    what a test's own lines follow."""
    return _CHAT.replace("PORT", str(engine_port))


def limited_key(system: System, engine_port: int, rpm: int) -> tuple[str, int]:
    """The system's database migrated, chat served by the engine on `engine_port`, and a key
    allowed `rpm` requests a minute: the key's secret and id."""
    system.manage("migrate", "--verbosity", "0")
    key = (
        "key, secret = key_create(actor=actor, name='app')\n"
        f"GatewayKey.objects.filter(pk=key.pk).update(rpm={rpm})\n"
        "print('KEY=' + secret + '=' + str(key.pk))\n"
    )
    printed = system.manage("shell", "-c", chat_on_engine(engine_port) + key)
    secret, key_id = printed.split("KEY=")[1].strip().rsplit("=", 1)
    return secret, int(key_id)


def start_gateways(
    system: System, secret: str, envs: Sequence[dict[str, str] | None] = (None, None)
) -> list[str]:
    """One gateway process per entry of `envs` (its environment; None: the system's), each on
    a port of its own: their URLs, once each answers the key."""
    from llmgw_site.management.commands.llmgw_run import gateway_command

    bin_dir = Path(sys.executable).parent
    urls = []
    for index, env in enumerate(envs):
        port = free_port()
        command = gateway_command(bin_dir, "127.0.0.1", port, workers=1)
        system._spawn(f"gateway-{index}", command, env)
        urls.append(f"http://127.0.0.1:{port}")
    headers = {"Authorization": f"Bearer {secret}"}
    for url in urls:

        def answers(url: str = url) -> bool:
            return requests.get(f"{url}/v1/models", headers=headers, timeout=2).ok

        wait_for(answers, timeout=60, what=f"the gateway on {url}")
    return urls


def ask_in_turn(urls: Sequence[str], secret: str, count: int = 40) -> list[int]:
    """`count` completions, 8 at a time, sent to each gateway in turn: their statuses."""
    headers = {"Authorization": f"Bearer {secret}"}

    def ask(index: int) -> int:
        return requests.post(
            f"{urls[index % len(urls)]}/v1/completions", json=ASK, headers=headers, timeout=30
        ).status_code

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(ask, range(count)))


def serve_chat_with_keys(
    system: System, engine_port: int, keys: dict[str, dict[str, object]], *, workers: int = 2
) -> dict[str, str]:
    """The system's database migrated, chat served by the engine on `engine_port`, a key per
    entry of `keys` (its name: the fields set on it, e.g. {"rpm": 1}), and the gateway started
    (`workers` processes) and answering the first key (give it no limit): the keys' secrets by
    name."""
    system.manage("migrate", "--verbosity", "0")
    made = "\n".join(
        f"key, secret = key_create(actor=actor, name={name!r})\n"
        f"GatewayKey.objects.filter(pk=key.pk).update(**{fields!r})\n"
        f"secrets[{name!r}] = secret"
        for name, fields in keys.items()
    )
    script = (
        chat_on_engine(engine_port)
        + "import json\nsecrets = {}\n"
        + made
        + "\nprint('KEYS=' + json.dumps(secrets))\n"
    )
    secrets: dict[str, str] = json.loads(system.manage("shell", "-c", script).split("KEYS=")[1])
    system.start_gateway(workers=workers)
    probe = {"Authorization": f"Bearer {next(iter(secrets.values()))}"}
    wait_for(
        lambda: requests.get(f"{system.url}/v1/models", headers=probe, timeout=2).ok,
        what="the gateway",
    )
    return secrets
