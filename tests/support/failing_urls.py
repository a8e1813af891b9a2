"""The real URLs plus /boom, a view that raises."""

from django.http import HttpRequest, HttpResponse
from django.urls import include, path


def boom(request: HttpRequest) -> HttpResponse:
    raise ZeroDivisionError("the view divided by zero on purpose")


urlpatterns = [path("boom", boom), path("", include("llmgw_site.urls"))]
