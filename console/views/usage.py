"""The usage page: what the gateway served, by key and model, since a day."""

from __future__ import annotations

from django.http import HttpResponse
from django.views.decorators.http import require_GET

from console import traffic as console_traffic

from .pages import HtmxHttpRequest, actor, login_required, render_page


@require_GET
@login_required
def usage_page(request: HtmxHttpRequest) -> HttpResponse:
    context = console_traffic.usage_context(actor(request), request.GET.dict())
    return render_page(request, "console/usage.html", "usage-table", context)
