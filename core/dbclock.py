"""The database's clock, for the times several processes (and machines) must agree on.

A process's wall clock may step (NTP, `date -s`, a virtual machine resumed): a window, a lease
or an interval measured by it then lasts as much longer or shorter as the step. What many
processes measure together is measured by the one clock they share, the database's: in SQL
(`django.db.models.functions.Now()` in a query) where the comparison is in a query, and by
`database_now()` where the time is wanted in Python.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import connection
from django.db.models import DateTimeField, ExpressionWrapper, Value
from django.db.models.functions import Now


def database_now() -> datetime:
    """The database's current time, aware, in UTC: one round trip."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            # statement_timestamp(), as Django's Now() there: not the transaction's start.
            cursor.execute("SELECT statement_timestamp()")
            (value,) = cursor.fetchone()
            return value.astimezone(UTC)
        # SQLite's clock is this process's own; Now() there is this same expression.
        cursor.execute("SELECT STRFTIME('%Y-%m-%d %H:%M:%f', 'NOW')")
        (value,) = cursor.fetchone()
        return datetime.fromisoformat(value).replace(tzinfo=UTC)


def database_ago(seconds: float) -> Any:
    """`seconds` before the database's now, as an expression for a query's filter or update."""
    return ExpressionWrapper(
        Now() - Value(timedelta(seconds=seconds)), output_field=DateTimeField()
    )
