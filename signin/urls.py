from django.urls import path

from . import views

urlpatterns = [
    path("signin/start", views.start, name="signin-start"),
    path("signin/callback", views.callback, name="signin-callback"),
]
