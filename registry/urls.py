from django.urls import path

from . import api, canary_api

# Model names may hold ':' and '.', so they are matched as a path segment.
urlpatterns = [
    path("models/<str:name>/update", api.UpdateAPI.as_view(), name="api-model-update"),
    path("models/<str:name>/rollback", api.RollbackAPI.as_view(), name="api-model-rollback"),
    path("models/<str:name>/rollout", api.RolloutAPI.as_view(), name="api-model-rollout"),
    path("serve", api.ServeAPI.as_view(), name="api-serve"),
    path("fetches/<int:pk>", api.FetchAPI.as_view(), name="api-fetch"),
    path("updates", api.UpdatesAPI.as_view(), name="api-updates"),
    path("updates/check", api.UpdatesCheckAPI.as_view(), name="api-updates-check"),
    path("canaries", canary_api.CanariesAPI.as_view(), name="api-canaries"),
    path("models/<str:name>/canary", canary_api.CanaryAPI.as_view(), name="api-model-canary"),
    path(
        "models/<str:name>/canary/promote",
        canary_api.CanaryPromoteAPI.as_view(),
        name="api-model-canary-promote",
    ),
    path(
        "models/<str:name>/canary/abort",
        canary_api.CanaryAbortAPI.as_view(),
        name="api-model-canary-abort",
    ),
]
