"""The embedded broker: kombu's filesystem transport, with every message written whole.

kombu's filesystem channel writes a message straight into the folder the worker reads, and the
worker takes and reads any file it finds there without waiting for the writer: a message caught
half-written was read as broken JSON, and the worker stopped ("Unrecoverable error:
JSONDecodeError"). Here a message is written under a name the worker does not read (it starts
with a dot) and renamed into place once complete; a rename within a folder is atomic. The
exchange's table of queues is written the same way.

Settings use it as `llmgwfs://` (registered below, as kombu finds transports by alias).
"""

from __future__ import annotations

import os
import uuid
from time import monotonic
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import TRANSPORT_ALIASES, filesystem
from kombu.transport.filesystem import LOCK_EX, exchange_queue_t, lock, unlock
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps

ALIAS = "llmgwfs"


class Channel(filesystem.Channel):
    def _put(self, queue: Any, payload: Any, **kwargs: Any) -> None:  # type: ignore[override]
        name = f"{round(monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        final = os.path.join(self.data_folder_out, name)
        partial = os.path.join(self.data_folder_out, f".{name}.partial")
        try:
            with open(partial, "wb") as out:
                out.write(str_to_bytes(dumps(payload)))
            os.replace(partial, final)
        except OSError as exc:
            raise ChannelError(f"Cannot add file {final!r} to directory") from exc

    def _queue_bind(self, exchange: Any, routing_key: Any, pattern: Any, queue: Any) -> None:
        # The same race for the exchange's table of queues: kombu creates the file empty, then
        # locks it, and a process reading it in between fails on empty JSON. Writers take
        # turns on a lock file of their own, and the table is replaced whole.
        file = self._exchange_file(exchange)
        self.control_folder.mkdir(exist_ok=True)
        entry = exchange_queue_t(routing_key or "", pattern or "", queue or "")
        with open(file.parent / f".{file.name}.lock", "ab") as guard:
            lock(guard, LOCK_EX)
            try:
                queues = self.get_table(exchange)
                if entry in queues:
                    return
                queues.insert(0, entry)
                partial = file.parent / f".{file.name}.{uuid.uuid4()}.partial"
                partial.write_bytes(str_to_bytes(dumps(queues)))
                os.replace(partial, file)
            except OSError as exc:
                raise ChannelError(f"Cannot write {file}") from exc
            finally:
                unlock(guard)


class Transport(filesystem.Transport):
    Channel = Channel

    @property
    def default_connection_params(self) -> dict[str, Any]:
        # Folders on this machine: no host. kombu's virtual transports default the host to
        # "localhost", and say "No hostname was supplied" in every process's terminal at every
        # connection when the URL (ours, llmgwfs://) names none, as it has none to name.
        return {"port": self.default_port}


TRANSPORT_ALIASES.setdefault(ALIAS, f"{__name__}:Transport")
