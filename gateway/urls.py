from django.urls import path

from . import api, views

urlpatterns = [
    # OpenAI-compatible, for applications (gateway keys).
    path("v1/models", views.models, name="gateway-models"),
    path("v1/chat/completions", views.chat_completions, name="gateway-chat-completions"),
    path("v1/completions", views.completions, name="gateway-completions"),
    path("v1/embeddings", views.embeddings, name="gateway-embeddings"),
    path("metrics", views.prometheus_metrics, name="gateway-metrics"),
    # The keys, for people (API tokens and sessions, like the rest of /api/v1/).
    path("api/v1/keys", api.KeysAPI.as_view(), name="api-keys"),
    path("api/v1/keys/<int:key_id>/revoke", api.KeyRevokeAPI.as_view(), name="api-key-revoke"),
]
