from django.urls import path

from . import api

urlpatterns = [
    path("api/v1/tokens", api.TokensAPI.as_view(), name="api-tokens"),
    path("api/v1/tokens/<str:token_id>", api.TokenAPI.as_view(), name="api-token"),
]
