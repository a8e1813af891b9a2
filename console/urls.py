from django.contrib.auth import views as auth_views
from django.urls import path

from . import views

# Model names may hold ':' and '.', so they are matched as one path segment; "add"
# sits outside /models/ so that no model name can shadow it.
urlpatterns = [
    path("login/", auth_views.LoginView.as_view(template_name="console/login.html"), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("", views.models_page, name="console-models"),
    path("add/", views.add_page, name="console-add"),
    path("add/model", views.add_model, name="console-add-model"),
    path("add/serve", views.serve_model, name="console-serve"),
    path("fetches/<int:pk>/", views.fetch_page, name="console-fetch"),
    path("models/<str:name>/", views.model_page, name="console-model"),
    path("models/<str:name>/scale", views.model_scale, name="console-model-scale"),
    path("models/<str:name>/resources", views.model_resources, name="console-model-resources"),
    path("models/<str:name>/class", views.model_class, name="console-model-class"),
    path("models/<str:name>/owner", views.model_owner, name="console-model-owner"),
    path("models/<str:name>/adapters", views.model_adapters, name="console-model-adapters"),
    path("models/<str:name>/restart", views.model_restart, name="console-model-restart"),
    path("models/<str:name>/remove", views.model_remove, name="console-model-remove"),
    path("models/<str:name>/update", views.model_update, name="console-model-update"),
    path("models/<str:name>/rollback", views.model_rollback, name="console-model-rollback"),
    path("models/<str:name>/registry", views.model_registry, name="console-model-registry"),
    path("models/<str:name>/check", views.model_check, name="console-model-check"),
    path("models/<str:name>/traffic", views.model_traffic, name="console-model-traffic"),
    path("nodes/", views.nodes_page, name="console-nodes"),
    path("nodes/<str:name>/cordon", views.node_cordon, name="console-node-cordon"),
    path("nodes/<str:name>/uncordon", views.node_uncordon, name="console-node-uncordon"),
    path("audit/", views.audit_page, name="console-audit"),
    path("usage/", views.usage_page, name="console-usage"),
]
