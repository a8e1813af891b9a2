"""What the gateway processes of this machine are doing now: each key's and team's use, and the
requests waiting per model. Those figures live in the data plane's own files, which only the data
plane can read; it hands its readers over when Django starts (gateway.apps.GatewayConfig.ready).
Where no gateway app is installed, nothing runs and nothing is counted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LiveUse:
    """A key's or team's use now."""

    in_flight: int = 0
    requests_last_minute: int = 0
    tokens_last_minute: int = 0


UseReader = Callable[[list[Any], list[Any]], dict[tuple[str, int], LiveUse]]
WaitReader = Callable[[Sequence[str]], dict[str, int]]


class Readers:
    """The data plane's readers, set once at start (register); zeros until then."""

    def __init__(self) -> None:
        self.use: UseReader | None = None
        self.waiting: WaitReader | None = None

    def register(self, *, use: UseReader, waiting: WaitReader) -> None:
        self.use, self.waiting = use, waiting


readers = Readers()


def use_now(keys: Iterable[Any] = (), teams: Iterable[Any] = ()) -> dict[tuple[str, int], LiveUse]:
    """The use now of each key and team, by ("key", id) and ("team", id)."""
    keys, teams = list(keys), list(teams)
    if readers.use is None:
        return {
            (kind, h.pk): LiveUse() for kind, hs in (("key", keys), ("team", teams)) for h in hs
        }
    return readers.use(keys, teams)


def waiting_now(models: Sequence[str]) -> dict[str, int]:
    """Requests waiting in the fair queue for each model now, over this machine's gateways."""
    if readers.waiting is None:
        return dict.fromkeys(models, 0)
    return readers.waiting(models)
