from collections.abc import Callable
from typing import Any

from django.urls import URLPattern, path

from . import api
from .models import Model


def model_urlpatterns(
    describe: Callable[[list[Model]], list[dict[str, Any]]],
) -> list[URLPattern]:
    """The model endpoints, answering with `describe` (see catalog.api.ModelAnswerAPI).

    Model names may hold ':' and '.', so they are matched as a path segment.
    """
    answers = {"describe": describe}
    return [
        path("models", api.ModelsAPI.as_view(**answers), name="api-models"),
        path("models/<str:name>", api.ModelAPI.as_view(**answers), name="api-model"),
        path("models/<str:name>/scale", api.ScaleAPI.as_view(**answers), name="api-model-scale"),
        path(
            "models/<str:name>/resources",
            api.ResourcesAPI.as_view(**answers),
            name="api-model-resources",
        ),
        path("models/<str:name>/class", api.ClassAPI.as_view(**answers), name="api-model-class"),
        path(
            "models/<str:name>/autoscale",
            api.AutoscaleAPI.as_view(**answers),
            name="api-model-autoscale",
        ),
        path("models/<str:name>/owner", api.OwnerAPI.as_view(**answers), name="api-model-owner"),
        path("models/<str:name>/adapters", api.AdaptersAPI.as_view(), name="api-model-adapters"),
    ]


urlpatterns = [
    path("audit", api.AuditAPI.as_view(), name="api-audit"),
    path("cluster", api.ClusterAPI.as_view(), name="api-cluster"),
]
