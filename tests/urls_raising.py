"""The party's URLs plus /raise, a view with a bug (tests/settings_raising.py)."""
from django.urls import path

from morphoweb.urls import urlpatterns as party_urlpatterns
from morphoweb.urls import handler400, handler403, handler404, handler500  # noqa: F401


def raising_view(request):
    raise RuntimeError("a bug the logs must show")


urlpatterns = [path("raise", raising_view), *party_urlpatterns]
