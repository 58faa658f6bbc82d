"""Root URL configuration: the PIR API at the root, the admin, and Prometheus metrics."""
from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView

from morphoweb import dashboard

urlpatterns = [
    path("", include("queries.api.urls")),
    path("admin/", admin.site.urls),
    path("api/", include("epochs.api.urls")),
    path("api/schema", SpectacularAPIView.as_view(), name="schema"),
    path("dashboard/", dashboard.dashboard, name="dashboard"),
    path("dashboard/data", dashboard.dashboard_data, name="dashboard-data"),
    path("", include("django_prometheus.urls")),
]

# Unknown paths, bad Host headers and crashes answer JSON too: API clients parse every body.
handler400 = "queries.api.errors.bad_request"
handler403 = "queries.api.errors.permission_denied"
handler404 = "queries.api.errors.not_found"
handler500 = "queries.api.errors.server_error"
