"""Root URL configuration: a landing page, health, the PIR API at the root, the admin, docs, the
dashboard and metrics."""
from django.conf import settings
from django.contrib import admin
from django.urls import include, path
from django.utils.functional import lazy
from django.views.generic import TemplateView
from drf_spectacular.views import SpectacularSwaggerView

from engine.prometheus import MetricsView
from morphoweb.openapi import SchemaView


def _party_title(suffix: str) -> str:
    name = settings.MORPHO_PARTY_NAME
    return f"morphoweb party {name} {suffix}" if name else f"morphoweb {suffix}"


# Two parties' admins side by side look alike: the header and the tab say which is which (read
# when a page is drawn).
admin.site.site_header = lazy(_party_title, str)("administration")
admin.site.site_title = lazy(_party_title, str)("admin")

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
    path("", include("engine.urls")),  # /health, /dashboard/
    path("admin/", admin.site.urls),
    path("api/", include("epochs.api.urls")),
    path("api/schema", SchemaView.as_view(), name="schema"),
    path("api/docs", SpectacularSwaggerView.as_view(url_name="schema"), name="docs"),
    path("metrics", MetricsView.as_view(), name="prometheus-django-metrics"),
]

# Unknown paths, bad Host headers and crashes answer JSON too: API clients parse every body.
handler400 = "queries.api.errors.bad_request"
handler403 = "queries.api.errors.permission_denied"
handler404 = "queries.api.errors.not_found"
handler500 = "queries.api.errors.server_error"
