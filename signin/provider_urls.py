from django.urls import path

from . import backchannel, device

# The device API is under /api/v1/, so this comes before the API's catch-all (llmgw_site.urls).
urlpatterns = [
    path("api/v1/login/device", device.DeviceLoginStartAPI.as_view(), name="api-login-device"),
    path(
        "api/v1/login/device/poll",
        device.DeviceLoginPollAPI.as_view(),
        name="api-login-device-poll",
    ),
    path(
        "signin/backchannel-logout",
        backchannel.backchannel_logout,
        name="signin-backchannel-logout",
    ),
]
