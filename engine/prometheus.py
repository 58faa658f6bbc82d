"""`/metrics`: who may read it (MORPHO_METRICS_ALLOW, or staff), and HTTP metrics whose label
values a client cannot multiply."""
from __future__ import annotations

import ipaddress

from django.conf import settings
from django.http import HttpResponse
from django_prometheus.middleware import PrometheusAfterMiddleware
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from rest_framework import exceptions
from rest_framework.authentication import SessionAuthentication, TokenAuthentication
from rest_framework.permissions import BasePermission
from rest_framework.throttling import BaseThrottle
from rest_framework.views import APIView

from engine.metrics import party_registry

# What django-prometheus labels a method it does not know as (its own words, kept so that one
# name stands for them in every family).
OTHER_METHOD = "<invalid method>"


class BoundedMethodMiddleware(PrometheusAfterMiddleware):
    """django-prometheus's response metrics, with every `method` label from a known set.

    Its latency histogram took the request's method as it came: 3,000 made-up methods grew a
    scrape from 383 KB to 3.9 MB (0.2 s to 5.8 s). Here every family gets the bounded method,
    an unknown one folded into OTHER_METHOD as its counters already do.
    """

    def label_metric(self, metric, request, response=None, **labels):
        if "method" in labels:
            labels["method"] = self._method(request)
        return super().label_metric(metric, request, response, **labels)


def client_address(request) -> str:
    """The client's address as the request rates count it: behind MORPHO_NUM_PROXIES proxies,
    the entry of X-Forwarded-For the nearest one wrote, else the socket's peer."""
    return BaseThrottle().get_ident(request)


def may_read_metrics(request) -> bool:
    """Staff (a session or a DRF token), or a client in MORPHO_METRICS_ALLOW."""
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated and user.is_staff:
        return True
    allowed = settings.MORPHO_METRICS_ALLOW
    if allowed is None:  # "*": anyone
        return True
    try:
        address = ipaddress.ip_address(client_address(request).strip().strip("[]"))
    except ValueError:
        return False  # no address (a Unix socket without a proxy's header): not one we know
    return any(address in network for network in allowed)


class MetricsReaders(BasePermission):
    message = ("reading /metrics needs a client address in MORPHO_METRICS_ALLOW or a staff user "
               "(an admin session or a DRF token)")

    def has_permission(self, request, view) -> bool:
        return may_read_metrics(request)


class MetricsView(APIView):
    """`GET /metrics`: Prometheus text of the party (HTTP, engine, policies, bulk jobs): every web
    process's counters added up (engine.metrics.party_registry), so a scrape answered by any of
    them reads the same, growing figures."""

    authentication_classes = [TokenAuthentication, SessionAuthentication]
    permission_classes = [MetricsReaders]
    # Scrapers poll without end: the anonymous request rate is no limit for them.
    throttle_classes: list = []
    schema = None  # not part of the API's schema (Prometheus text, not JSON)

    def permission_denied(self, request, message=None, code=None):
        # 403 with the reason for everyone refused (DRF would give an anonymous client its
        # generic 401): what to change is an address or a staff user, not credentials alone.
        raise exceptions.PermissionDenied(MetricsReaders.message)

    def get(self, request):
        return HttpResponse(generate_latest(party_registry()), content_type=CONTENT_TYPE_LATEST)
