"""Schemathesis over every operation of the project's OpenAPI schema (drf-spectacular): no 500,
no status or body the schema does not allow. Bounded examples, so it stays a unit-test's cost."""
from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from django.core import signals
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections
from hypothesis import HealthCheck, settings

schemathesis = pytest.importorskip("schemathesis")
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from engine.holder import get_engine

EXAMPLES = 25  # per operation
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]


@pytest.fixture(autouse=True)
def serving(db, serve_matrix, vector_matrix_path, settings):
    # Throttling is tested elsewhere; here every example must reach the view.
    from rest_framework.throttling import AnonRateThrottle

    settings.MORPHO_QUERY_TIMEOUT = 30
    settings.MORPHO_BULK_SUBMIT_THROTTLE = "off"
    settings.MORPHO_BULK_MAX_ACTIVE_JOBS = 1_000_000
    rates = AnonRateThrottle.THROTTLE_RATES
    AnonRateThrottle.THROTTLE_RATES = {"anon": None}
    serve_matrix(vector_matrix_path)
    get_engine()
    # Requests go through the real WSGI handler, which closes the database connection after
    # each one; inside the test's transaction that would close it under the test (as Django's
    # own test client prevents the same way).
    signals.request_started.disconnect(close_old_connections)
    signals.request_finished.disconnect(close_old_connections)
    yield
    signals.request_started.connect(close_old_connections)
    signals.request_finished.connect(close_old_connections)
    AnonRateThrottle.THROTTLE_RATES = rates


@pytest.fixture
def operator_token(db):
    from rest_framework.authtoken.models import Token

    user = User.objects.create_superuser("fuzz", password="pw-fuzz")
    return Token.objects.create(user=user).key


# Generated from the URLconf at collection time; no engine or database is needed for that.
schema = schemathesis.openapi.from_wsgi("/api/schema?format=json", get_wsgi_application())


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_no_server_error_and_no_response_outside_the_schema(case, operator_token):
    # Signed in as an operator, so the operations API is fuzzed past its permission check.
    case.headers = {**(case.headers or {}), "Authorization": f"Token {operator_token}"}
    response = case.call()
    case.validate_response(response, checks=CHECKS)
