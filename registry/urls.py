from django.urls import path

from . import api

# Model names may hold ':' and '.', so they are matched as a path segment.
urlpatterns = [
    path("models/<str:name>/update", api.UpdateAPI.as_view(), name="api-model-update"),
    path("models/<str:name>/rollback", api.RollbackAPI.as_view(), name="api-model-rollback"),
    path("models/<str:name>/rollout", api.RolloutAPI.as_view(), name="api-model-rollout"),
    path("serve", api.ServeAPI.as_view(), name="api-serve"),
    path("fetches/<int:pk>", api.FetchAPI.as_view(), name="api-fetch"),
    path("updates", api.UpdatesAPI.as_view(), name="api-updates"),
    path("updates/check", api.UpdatesCheckAPI.as_view(), name="api-updates-check"),
]
