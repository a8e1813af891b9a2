from django.urls import path

from . import api

# Model names may hold ':' and '.', so they are matched as a path segment.
urlpatterns = [
    path("models", api.ModelsAPI.as_view(), name="api-models"),
    path("models/<str:name>", api.ModelAPI.as_view(), name="api-model"),
    path("models/<str:name>/scale", api.ScaleAPI.as_view(), name="api-model-scale"),
    path("models/<str:name>/resources", api.ResourcesAPI.as_view(), name="api-model-resources"),
    path("models/<str:name>/class", api.ClassAPI.as_view(), name="api-model-class"),
    path("models/<str:name>/owner", api.OwnerAPI.as_view(), name="api-model-owner"),
    path("models/<str:name>/adapters", api.AdaptersAPI.as_view(), name="api-model-adapters"),
    path("audit", api.AuditAPI.as_view(), name="api-audit"),
    path("cluster", api.ClusterAPI.as_view(), name="api-cluster"),
]
