from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.views.decorators.http import require_GET

from catalog import selectors
from catalog.config import current_config


@require_GET
@login_required
def models_page(request: HttpRequest) -> HttpResponse:
    config = current_config()
    models = [selectors.model_view(m, config) for m in selectors.model_queryset()]
    return render(request, "console/models.html", {"models": models})
