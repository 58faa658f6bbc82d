"""Root URL configuration: a landing page, health, the PIR API at the root, the admin, docs, the
dashboard and metrics."""
from django.contrib import admin
from django.urls import include, path
from django.views.generic import TemplateView
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

urlpatterns = [
    # The PIR API first: Django resolves every request's path once per middleware that asks and
    # once to dispatch, trying the patterns in order, and the query endpoints are nearly all of
    # the traffic.
    path("", include("queries.api.urls")),
    # What a person opening the server (or the admin's "View site") finds: where to go next.
    path("", TemplateView.as_view(template_name="index.html"), name="home"),
    # Browsers ask every site for one; a 404 here would be an error in every page's console.
    path("favicon.ico",
         TemplateView.as_view(template_name="favicon.svg", content_type="image/svg+xml")),
    path("", include("engine.urls")),  # /health, /metrics, /dashboard/
    path("admin/", admin.site.urls),
    path("api/", include("epochs.api.urls")),
    path("api/schema", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs", SpectacularSwaggerView.as_view(url_name="schema"), name="docs"),
]

# Unknown paths, bad Host headers and crashes answer JSON too: API clients parse every body.
handler400 = "queries.api.errors.bad_request"
handler403 = "queries.api.errors.permission_denied"
handler404 = "queries.api.errors.not_found"
handler500 = "queries.api.errors.server_error"
