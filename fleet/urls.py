from django.urls import path

from . import api

urlpatterns = [
    path("node/heartbeat", api.HeartbeatAPI.as_view(), name="api-node-heartbeat"),
    path("node/renew", api.RenewAPI.as_view(), name="api-node-renew"),
    path("nodes", api.NodesAPI.as_view(), name="api-nodes"),
    path("nodes/<str:name>", api.NodeAPI.as_view(), name="api-node"),
    path("nodes/<str:name>/cordon", api.NodeCordonAPI.as_view(), name="api-node-cordon"),
    path("nodes/<str:name>/uncordon", api.NodeUncordonAPI.as_view(), name="api-node-uncordon"),
    path(
        "nodes/<str:name>/accept-capacity",
        api.NodeAcceptCapacityAPI.as_view(),
        name="api-node-accept-capacity",
    ),
    path("models/<str:name>/restart", api.RestartAPI.as_view(), name="api-model-restart"),
    path("models/<str:name>/demand", api.DemandAPI.as_view(), name="api-model-demand"),
    path("models/<str:name>/target", api.TargetAPI.as_view(), name="api-model-target"),
    path("models/<str:name>/plan", api.PlanModelAPI.as_view(), name="api-model-plan"),
    path("plan", api.PlanFileAPI.as_view(), name="api-plan"),
]
