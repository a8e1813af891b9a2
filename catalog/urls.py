from django.urls import path

from . import api, updates_api

# Model names may hold ':' and '.', so they are matched as a path segment.
urlpatterns = [
    path("models", api.ModelsAPI.as_view(), name="api-models"),
    path("models/<str:name>", api.ModelAPI.as_view(), name="api-model"),
    path("models/<str:name>/scale", api.ScaleAPI.as_view(), name="api-model-scale"),
    path("models/<str:name>/resources", api.ResourcesAPI.as_view(), name="api-model-resources"),
    path("models/<str:name>/class", api.ClassAPI.as_view(), name="api-model-class"),
    path("models/<str:name>/owner", api.OwnerAPI.as_view(), name="api-model-owner"),
    path("models/<str:name>/adapters", api.AdaptersAPI.as_view(), name="api-model-adapters"),
    path("models/<str:name>/update", updates_api.UpdateAPI.as_view(), name="api-model-update"),
    path(
        "models/<str:name>/rollback", updates_api.RollbackAPI.as_view(), name="api-model-rollback"
    ),
    path("models/<str:name>/rollout", updates_api.RolloutAPI.as_view(), name="api-model-rollout"),
    path("serve", updates_api.ServeAPI.as_view(), name="api-serve"),
    path("fetches/<int:pk>", updates_api.FetchAPI.as_view(), name="api-fetch"),
    path("updates", updates_api.UpdatesAPI.as_view(), name="api-updates"),
    path("updates/check", updates_api.UpdatesCheckAPI.as_view(), name="api-updates-check"),
    path("audit", api.AuditAPI.as_view(), name="api-audit"),
    path("cluster", api.ClusterAPI.as_view(), name="api-cluster"),
]
