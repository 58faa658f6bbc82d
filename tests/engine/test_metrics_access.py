"""`/metrics`: readable by the networks MORPHO_METRICS_ALLOW names and by staff only, and its label
values bounded whatever methods clients send."""
from __future__ import annotations

import ipaddress
import re

import pytest
from django.contrib.auth.models import User
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from engine.prometheus import OTHER_METHOD

KNOWN_METHODS = {"GET", "HEAD", "POST", "PUT", "DELETE", "TRACE", "OPTIONS", "CONNECT", "PATCH",
                 OTHER_METHOD}


def method_labels(text: str) -> set[str]:
    return set(re.findall(r'method="([^"]*)"', text))


@pytest.mark.django_db
def test_made_up_methods_fold_into_one_label_in_every_family(serve_matrix, vector_matrix_path):
    serve_matrix(vector_matrix_path)
    client = APIClient()
    for index in range(40):
        client.generic(f"BREW{index}", "/health")
        client.generic(f"X-{index}", "/no/such/path")
    text = client.get("/metrics").content.decode()
    assert 'method="GET"' in text
    assert f'method="{OTHER_METHOD}"' in text
    assert method_labels(text) <= KNOWN_METHODS, sorted(method_labels(text) - KNOWN_METHODS)[:5]
    assert "BREW" not in text and 'method="X-' not in text


@pytest.mark.django_db
@pytest.mark.parametrize("address, allowed", [
    ("127.0.0.1", True), ("10.1.2.3", True), ("172.20.0.5", True), ("192.168.1.9", True),
    ("::1", True), ("203.0.113.7", False), ("2001:db8::1", False), ("172.32.0.1", False),
])
def test_the_default_lets_loopback_and_private_networks_read(address, allowed):
    response = APIClient(REMOTE_ADDR=address).get("/metrics")
    if allowed:
        assert response.status_code == 200, response.content
        assert b"django_http_requests" in response.content
    else:
        assert response.status_code == 403
        assert "MORPHO_METRICS_ALLOW" in response.json()["detail"]


@pytest.mark.django_db
def test_staff_read_from_anywhere_and_other_users_do_not():
    outside = "203.0.113.7"
    staff = User.objects.create_user("scraper", is_staff=True)
    user = User.objects.create_user("someone")
    client = APIClient(REMOTE_ADDR=outside)
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=staff).key}")
    assert client.get("/metrics").status_code == 200
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    assert client.get("/metrics").status_code == 403


@pytest.mark.django_db
def test_the_setting_names_who_may_read(settings):
    settings.MORPHO_METRICS_ALLOW = [ipaddress.ip_network("203.0.113.0/24")]
    assert APIClient(REMOTE_ADDR="203.0.113.7").get("/metrics").status_code == 200
    assert APIClient(REMOTE_ADDR="127.0.0.1").get("/metrics").status_code == 403
    settings.MORPHO_METRICS_ALLOW = None  # "*"
    assert APIClient(REMOTE_ADDR="198.51.100.1").get("/metrics").status_code == 200


@pytest.mark.django_db
def test_behind_a_proxy_the_address_is_the_one_the_proxy_saw(settings):
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "NUM_PROXIES": 1}
    from rest_framework.settings import api_settings
    api_settings.reload()
    try:
        local = APIClient(REMOTE_ADDR="127.0.0.1", HTTP_X_FORWARDED_FOR="203.0.113.7")
        assert local.get("/metrics").status_code == 403  # the front end on loopback, a remote client
        spoofed = APIClient(REMOTE_ADDR="127.0.0.1", HTTP_X_FORWARDED_FOR="127.0.0.1, 203.0.113.7")
        assert spoofed.get("/metrics").status_code == 403
    finally:
        settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "NUM_PROXIES": 0}
        api_settings.reload()
