"""The limits a key or a team may have, one row each: every door (the model's fields, the API's
serializers, the CLI's flags, the console's rows, the gateway's refusals, the database triggers)
derives its part from LIMITS, so a new limit of a known unit and window is a row here plus its
migration. tests/access/test_limit_table.py holds the model fields and this table together.
"""

from __future__ import annotations

from dataclasses import dataclass

UNITS = ("requests", "tokens")
WINDOWS = ("minute", "in flight", "day", "month")


@dataclass(frozen=True)
class Limit:
    name: str  # the model field, the API's key, the CLI flag (--max-parallel)
    unit: str  # one of UNITS
    window: str  # one of WINDOWS: a rate over the last minute, a count now, a UTC budget
    meaning: str  # what it counts, for help texts
    short: str  # its figure's unit when printed beside what was used
    used: str  # the API's usage field counted against it
    label: str  # its name on a form: "Requests per minute"
    used_label: str  # the use counted against it, on a page: "Requests in the last minute"

    @property
    def budget(self) -> bool:
        """A day's or a month's budget (spent until it resets), not a rate."""
        return self.window in ("day", "month")

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def used_when(self) -> str:
        """When the usage figure beside it was counted, as printed after it."""
        return {"minute": " in the last minute", "in flight": " now"}.get(self.window, "")

    def used_words(self, used: int = 2) -> str:
        """What was used against it, in a refusal: "tokens in the last minute" ("request in the
        last minute" for one)."""
        if self.window == "minute":
            unit = self.unit[:-1] if used == 1 else self.unit
            return f"{unit} in the last minute"
        return {"day": "used today", "month": "used this month"}.get(self.window, "in flight")

    def figure(self, figure: int) -> str:
        """The limit as a refusal names it: "1 request per minute", "2,000 tokens per day (UTC)"."""
        unit = self.unit[:-1] if figure == 1 else self.unit
        return (
            f"{figure:,} {unit} "
            + {
                "minute": "per minute",
                "in flight": "in flight at once",
                "day": "per day (UTC)",
                "month": "per month (UTC)",
            }[self.window]
        )


LIMITS = (
    Limit("rpm", "requests", "minute", "requests per minute", "requests/min",
          "requests_last_minute", "Requests per minute", "Requests in the last minute"),
    Limit("tpm", "tokens", "minute",
          "prompt + completion tokens per minute (a stream counts when it ends)", "tokens/min",
          "tokens_last_minute", "Tokens per minute", "Tokens in the last minute"),
    Limit("max_parallel", "requests", "in flight", "requests in flight at once", "in flight",
          "in_flight", "Requests in flight", "In flight now"),
    Limit("tokens_per_day", "tokens", "day", "prompt + completion tokens per day (UTC)",
          "tokens/day", "tokens_today", "Tokens per day", "Tokens today"),
    Limit("tokens_per_month", "tokens", "month",
          "prompt + completion tokens per calendar month (UTC)", "tokens/month",
          "tokens_this_month", "Tokens per month", "Tokens this month"),
)  # fmt: skip
COUNTERS = tuple(limit.name for limit in LIMITS)
RATES = tuple(limit.name for limit in LIMITS if not limit.budget)  # counted by the gateway now
BY_NAME = {limit.name: limit for limit in LIMITS}
