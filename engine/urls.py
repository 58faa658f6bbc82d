"""Routes of the engine app: health and the operator dashboard; no logic here."""
from django.urls import path

from engine import dashboard, views

urlpatterns = [
    path("health", views.HealthView.as_view(), name="health"),
    path("dashboard/", dashboard.dashboard, name="dashboard"),
    path("dashboard/data", dashboard.dashboard_data, name="dashboard-data"),
]
