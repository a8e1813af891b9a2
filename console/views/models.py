"""The models page: every model in the catalog, filtered and a page at a time."""

from __future__ import annotations

from django.http import HttpResponse
from django.views.decorators.http import require_GET

from console import selectors as console_selectors
from console import traffic as console_traffic

from .pages import HtmxHttpRequest, filters_of, login_required, query_without_page, render_page


def with_sparklines(rows: list[console_selectors.ModelRow]) -> list[console_selectors.ModelRow]:
    """The rows with their "Last hour" sparkline, in one query: the page's rows, and a row
    alone where Update, Roll back or the rollout's poll answer with it."""
    lines = console_traffic.sparklines([row.view["name"] for row in rows])
    for row in rows:
        row.traffic = lines[row.view["name"]]
    return rows


@require_GET
@login_required
def models_page(request: HtmxHttpRequest) -> HttpResponse:
    filters = filters_of(request, owner="owner", klass="class", state="state", search="q")
    page = console_selectors.page_of(
        console_selectors.filter_models(**filters),
        request.GET.get("page"),
        console_selectors.MODELS_PER_PAGE,
    )
    rows = with_sparklines(console_selectors.model_rows(list(page.object_list), request.user))
    context = {
        "page": page,
        "rows": rows,
        "filters": filters,
        "filtered": any(filters.values()),
        "owners": console_selectors.owners(),
        "classes": console_selectors.CLASSES,
        "states": console_selectors.STATES,
        "query": query_without_page(request),
    }
    return render_page(request, "console/models.html", "models-table", context)
