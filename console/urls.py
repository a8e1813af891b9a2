from django.contrib.auth import views as auth_views
from django.urls import path

from .views import (
    add,
    audit,
    fetch,
    keys,
    model,
    model_canary,
    model_registry,
    models,
    nodes,
    teams,
    tokens,
    usage,
)

# Model names may hold ':' and '.', so they are matched as one path segment; "add"
# sits outside /models/ so that no model name can shadow it.
urlpatterns = [
    path("login/", auth_views.LoginView.as_view(template_name="console/login.html"), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("", models.models_page, name="console-models"),
    path("add/", add.add_page, name="console-add"),
    path("add/model", add.add_model, name="console-add-model"),
    path("add/serve", add.serve_model, name="console-serve"),
    path("fetches/<int:pk>/", fetch.fetch_page, name="console-fetch"),
    path("models/<str:name>/", model.model_page, name="console-model"),
    path("models/<str:name>/scale", model.model_scale, name="console-model-scale"),
    path("models/<str:name>/resources", model.model_resources, name="console-model-resources"),
    path("models/<str:name>/class", model.model_class, name="console-model-class"),
    path("models/<str:name>/autoscale", model.model_autoscale, name="console-model-autoscale"),
    path("models/<str:name>/owner", model.model_owner, name="console-model-owner"),
    path("models/<str:name>/adapters", model.model_adapters, name="console-model-adapters"),
    path("models/<str:name>/restart", model.model_restart, name="console-model-restart"),
    path("models/<str:name>/remove", model.model_remove, name="console-model-remove"),
    path("models/<str:name>/update", model_registry.model_update, name="console-model-update"),
    path(
        "models/<str:name>/rollback", model_registry.model_rollback, name="console-model-rollback"
    ),
    path(
        "models/<str:name>/registry", model_registry.model_registry, name="console-model-registry"
    ),
    path("models/<str:name>/check", model_registry.model_check, name="console-model-check"),
    path(
        "models/<str:name>/canary/promote",
        model_canary.canary_promote,
        name="console-model-canary-promote",
    ),
    path(
        "models/<str:name>/canary/abort",
        model_canary.canary_abort,
        name="console-model-canary-abort",
    ),
    path("models/<str:name>/traffic", model.model_traffic, name="console-model-traffic"),
    path("nodes/", nodes.nodes_page, name="console-nodes"),
    path("nodes/<str:name>/cordon", nodes.node_cordon, name="console-node-cordon"),
    path("nodes/<str:name>/uncordon", nodes.node_uncordon, name="console-node-uncordon"),
    path("audit/", audit.audit_page, name="console-audit"),
    path("usage/", usage.usage_page, name="console-usage"),
    path("keys/", keys.keys_page, name="console-keys"),
    path("keys/create", keys.key_create, name="console-key-create"),
    path("keys/<int:key_id>/limits", keys.key_limits, name="console-key-limits"),
    path("keys/<int:key_id>/revoke", keys.key_revoke, name="console-key-revoke"),
    path("tokens/", tokens.tokens_page, name="console-tokens"),
    path("tokens/<int:token_id>/revoke", tokens.token_revoke, name="console-token-revoke"),
    path("teams/", teams.teams_page, name="console-teams"),
    path("teams/create", teams.team_create, name="console-team-create"),
    path("teams/policy", teams.default_policy, name="console-default-policy"),
    path("teams/<str:name>/limits", teams.team_limits, name="console-team-limits"),
    path("teams/<str:name>/members", teams.team_members, name="console-team-members"),
    path("teams/<str:name>/policy", teams.team_policy, name="console-team-policy"),
    path("teams/<str:name>/remove", teams.team_remove, name="console-team-remove"),
]
