from django.urls import path

from . import api, usage_api

# /v1/ and /metrics are served by the gateway's own ASGI application (gateway.asgi),
# not by Django; these are the keys and teams, for people (API tokens and sessions).
urlpatterns = [
    path("api/v1/keys", api.KeysAPI.as_view(), name="api-keys"),
    path("api/v1/keys/<int:key_id>/revoke", api.KeyRevokeAPI.as_view(), name="api-key-revoke"),
    path("api/v1/keys/<int:key_id>/limits", api.KeyLimitsAPI.as_view(), name="api-key-limits"),
    path("api/v1/keys/policies", api.KeyPoliciesAPI.as_view(), name="api-key-policies"),
    path("api/v1/keys/weights", api.UserWeightsAPI.as_view(), name="api-user-weights"),
    path("api/v1/keys/weights/<str:username>", api.UserWeightAPI.as_view(), name="api-user-weight"),
    path("api/v1/keys/policies/<str:scope>", api.KeyPolicyAPI.as_view(), name="api-key-policy"),
    path("api/v1/teams", api.TeamsAPI.as_view(), name="api-teams"),
    path("api/v1/teams/<str:name>", api.TeamAPI.as_view(), name="api-team"),
    path("api/v1/teams/<str:name>/members", api.TeamMembersAPI.as_view(), name="api-team-members"),
    path("api/v1/usage", usage_api.UsageAPI.as_view(), name="api-usage"),
    path(
        "api/v1/models/<str:name>/traffic",
        usage_api.ModelTrafficAPI.as_view(),
        name="api-model-traffic",
    ),
]
