"""The embedded broker: kombu's filesystem transport, with every message written whole.

kombu's filesystem channel writes a message straight into the folder the worker reads, and the
worker takes and reads any file it finds there without waiting for the writer: a message caught
half-written was read as broken JSON, and the worker stopped ("Unrecoverable error:
JSONDecodeError"). Here a message is written under a name the worker does not read (it starts
with a dot) and renamed into place once complete; a rename within a folder is atomic.

Settings use it as `llmgwfs://` (registered below, as kombu finds transports by alias).
"""

from __future__ import annotations

import os
import uuid
from time import monotonic
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import TRANSPORT_ALIASES, filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps

ALIAS = "llmgwfs"


class Channel(filesystem.Channel):
    def _put(self, queue: str, payload: Any, **kwargs: Any) -> None:
        name = f"{round(monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        final = os.path.join(self.data_folder_out, name)
        partial = os.path.join(self.data_folder_out, f".{name}.partial")
        try:
            with open(partial, "wb") as out:
                out.write(str_to_bytes(dumps(payload)))
            os.replace(partial, final)
        except OSError as exc:
            raise ChannelError(f"Cannot add file {final!r} to directory") from exc


class Transport(filesystem.Transport):
    Channel = Channel


TRANSPORT_ALIASES.setdefault(ALIAS, f"{__name__}:Transport")
