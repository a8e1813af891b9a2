"""A periodic task that writes down each of its runs: which send it was, when and by which beat it
was sent, which worker ran it and when (the database's clock), in a table the test made
(`probe_run`)."""

from __future__ import annotations

import os
import socket

from celery import shared_task
from django.db import connection

from llmgw_site.beat import BEAT_HEADER, SEND_HEADER, SENT_AT_HEADER


@shared_task(bind=True, ignore_result=True)
def record(self) -> None:  # type: ignore[no-untyped-def]
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO probe_run (send, sent_at, beat, worker, ran_at) "
            "VALUES (%s, %s, %s, %s, now())",
            [
                self.request.get(SEND_HEADER),
                self.request.get(SENT_AT_HEADER),
                self.request.get(BEAT_HEADER),
                f"{socket.gethostname()}:{os.getpid()}",
            ],
        )
