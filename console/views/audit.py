"""The audit page: who changed what, filtered and a page at a time."""

from __future__ import annotations

from django.http import HttpResponse
from django.views.decorators.http import require_GET

from catalog import selectors as catalog_selectors
from console import selectors as console_selectors

from .pages import HtmxHttpRequest, filters_of, login_required, query_without_page, render_page


@require_GET
@login_required
def audit_page(request: HtmxHttpRequest) -> HttpResponse:
    filters = filters_of(request, model="model", actor="actor", action="action")
    entries = catalog_selectors.audit_queryset(**{k: v or None for k, v in filters.items()})
    page = console_selectors.page_of(
        entries, request.GET.get("page"), console_selectors.AUDIT_PER_PAGE
    )
    context = {
        "page": page,
        "entries": console_selectors.audit_rows(list(page.object_list)),
        "filters": filters,
        "filtered": any(filters.values()),
        "actions": console_selectors.audit_actions(),
        "query": query_without_page(request),
    }
    return render_page(request, "console/audit.html", "audit-table", context)
