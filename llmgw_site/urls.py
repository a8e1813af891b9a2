from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from catalog import mirror_files

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/v1/schema", SpectacularAPIView.as_view(), name="api-schema"),
    path("api/v1/docs", SpectacularSwaggerView.as_view(url_name="api-schema"), name="api-docs"),
    path("api/v1/", include("fleet.urls")),
    path("api/v1/", include("catalog.urls")),
    path("", include("gateway.urls")),
    path("mirror/<path:path>", mirror_files.serve, name="mirror-file"),
    path("", include("console.urls")),
]
