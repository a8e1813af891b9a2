"""Django forms' share of the limits table: one form field per limit (llmgw.limitdefs.LIMITS),
for the admin's forms and the console's."""

from __future__ import annotations

from collections.abc import Callable

from django import forms

from llmgw.limitdefs import LIMITS, Limit


def with_limit_fields(
    make: Callable[[Limit], dict[str, forms.Field]], *, first: bool = True
) -> Callable[[type[forms.BaseForm]], type[forms.BaseForm]]:
    """A form class with the fields `make` gives for each limit, before its own fields (after
    them where not `first`)."""

    def decorate(cls: type[forms.BaseForm]) -> type[forms.BaseForm]:
        made = {name: field for limit in LIMITS for name, field in make(limit).items()}
        own = cls.declared_fields  # type: ignore[attr-defined]
        cls.declared_fields = {**made, **own} if first else {**own, **made}  # type: ignore[attr-defined]
        cls.base_fields = {**made, **cls.base_fields} if first else {**cls.base_fields, **made}  # type: ignore[attr-defined]
        return cls

    return decorate
