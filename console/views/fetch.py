"""A fetch's page: one fetch into the mirror and its progress."""

from __future__ import annotations

from django.http import Http404, HttpResponse
from django.views.decorators.http import require_GET

from console import selectors as console_selectors
from registry.models import Fetch

from .pages import HtmxHttpRequest, login_required, render_page


@require_GET
@login_required
def fetch_page(request: HtmxHttpRequest, pk: int) -> HttpResponse:
    """A fetch into the mirror and its progress: the whole page, or for htmx's poll the card."""
    fetch = Fetch.objects.filter(pk=pk).first()
    if fetch is None:
        raise Http404(f"There is no fetch {pk}.")
    context = console_selectors.fetch_progress(fetch)
    return render_page(request, "console/fetch.html", "fetch-progress", context)
