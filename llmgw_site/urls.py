from django.contrib import admin
from django.urls import include, path, re_path
from django.views.generic import RedirectView

from catalog.urls import model_urlpatterns
from registry import mirror_files
from registry.selectors import model_answers

from . import api_errors
from .access import mirror_access
from .api_docs import DocsView, SchemaView

urlpatterns = [
    # Keys, teams and usage were the gateway app's: its old admin addresses still lead there.
    re_path(r"^admin/gateway/(?P<rest>.*)$", RedirectView.as_view(url="/admin/access/%(rest)s")),
    path("admin/", admin.site.urls),
    # For those logged in unless LLMGW_PUBLIC_API_DOCS=true (llmgw_site.api_docs).
    path("api/v1/schema", SchemaView.as_view(), name="api-schema"),
    path("api/v1/docs", DocsView.as_view(url_name="api-schema"), name="api-docs"),
    path("api/v1/", include("fleet.urls")),
    # A model's answer holds its replicas and its latest rollout as well as its definition.
    path("api/v1/", include(model_urlpatterns(describe=model_answers))),
    path("api/v1/", include("catalog.urls")),
    path("api/v1/", include("registry.urls")),
    path("", include("access.urls")),
    path("", include("accounts.urls")),
    # `llmgw ctl login` (signin.device) and the provider's back-channel logout.
    path("", include("signin.provider_urls")),
    # Everything else under /api/v1/ answers in the API's JSON shape, not an HTML page.
    re_path(r"^api/v1/", api_errors.no_such_endpoint),
    path("mirror/<path:path>", mirror_access(mirror_files.serve), name="mirror-file"),
    # Sign-in through the provider: /signin/start and /signin/callback.
    path("", include("signin.urls")),
    path("", include("console.urls")),
]

handler500 = "llmgw_site.api_errors.server_error"
