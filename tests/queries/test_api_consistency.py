"""One API: every error in the same shape and our words, slashes optional, every listing paged,
and a landing page at /."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
from django.contrib.auth.models import Permission, User
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from morpho_pir.dpf import gen_keys

pytestmark = pytest.mark.django_db

D = 8  # the vector matrix: 200 pages


@pytest.fixture
def keys():
    rng = np.random.default_rng(11)
    return [gen_keys(int(p), D, rng=rng)[0].to_bytes().hex() for p in (3, 50, 199)]


@pytest.fixture
def api(serve_matrix, vector_matrix_path, settings):
    serve_matrix(vector_matrix_path)
    settings.MORPHO_BULK_CHUNK = 4
    user = User.objects.create_user("op", password="pw")
    user.user_permissions.set(Permission.objects.filter(content_type__app_label="epochs"))
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    return client


def post(client, path, body, **extra):
    return client.generic("POST", path, json.dumps(body), content_type="application/json", **extra)


def error_shape(body: dict) -> set:
    return {key for error in body["errors"] for key in error}


# --- 413, 411 and a malformed length: the shape of every other error --------------------------


def test_request_level_refusals_have_the_shape_of_every_other_error(api, keys, settings):
    settings.MORPHO_MAX_BODY_BYTES = 1024
    bad_key = post(api, "/query/page/gpu", {"keys": keys[:2]})
    assert bad_key.status_code == 400
    shape = error_shape(bad_key.json())
    assert shape == {"field", "query", "key", "code", "message"}
    refusals = {
        413: post(api, "/query/page/gpu", {"keys": keys * 4}),
        411: post(api, "/query/page/gpu", {"keys": keys}, CONTENT_LENGTH="",
                  HTTP_TRANSFER_ENCODING="chunked"),
        400: post(api, "/query/page/gpu", {"keys": keys}, CONTENT_LENGTH="-3"),
    }
    codes = {}
    for status, response in refusals.items():
        assert response.status_code == status
        body = response.json()
        assert error_shape(body) == shape and set(body) == {"detail", "errors"}
        codes[status] = body["errors"][0]["code"]
        assert body["detail"] == f"{body['errors'][0]['field']}: {body['errors'][0]['message']}"
    assert codes == {413: "too_large", 411: "length_required", 400: "content_length"}


# --- our words, never DRF's stock sentences ----------------------------------------------------

STOCK = re.compile(r"This field|may not be|No data provided|A valid|is not a valid|Ensure this|"
                   r"Expected a list")


def messages_of(response) -> list[str]:
    assert response.status_code == 400, response.content
    return [error["message"] for error in response.json()["errors"]]


def test_null_and_wrong_values_are_named_in_our_words(api, keys):
    said = []
    said += messages_of(post(api, "/query/page/gpu/batch", {"queries": [None]}))
    said += messages_of(post(api, "/bulk/jobs", {"queries": [{"keys": keys}, None]}))
    said += messages_of(post(api, "/api/row-updates/", {"row": None, "data": None}))
    said += messages_of(post(api, "/api/row-updates/", {"row": "x"}))
    said += messages_of(post(api, "/api/epochs/", {
        "epoch_id": None, "matrix_path": None, "block_number": None, "state_root": None,
        "seeds": None, "pending_updates": None, "switch_mode": None, "placement": None}))
    said += messages_of(post(api, "/api/epochs/", {
        "epoch_id": -1, "matrix_path": "", "seeds": [None, 1, "x"], "pending_updates": "zz"}))
    stock = [message for message in said if STOCK.search(message)]
    assert not stock, stock
    assert all(message.startswith("expected") for message in said), said
    assert "expected a JSON object, got null" in said
    assert "expected an integer in 0..9223372036854775807, got null" in said
    assert "expected an array of 3 integers in 0..18446744073709551615, got null" in said
    assert 'expected one of absorb, discard, got "zz"' in said
    assert "expected an integer in 0..9223372036854775807, got -1" in said


# --- trailing slashes: both forms answer, for every method ---------------------------------------


def test_every_api_path_answers_with_and_without_its_trailing_slash(api, keys):
    for path in ("/health", "/epoch", "/api/schema", "/api/epochs/", "/api/row-updates/",
                 "/bulk/jobs"):
        other = path[:-1] if path.endswith("/") else path + "/"
        first, second = api.get(path), api.get(other)
        assert first.status_code == second.status_code == 200, (path, second.status_code)
    single = post(api, "/query/page/gpu/", {"keys": keys})
    assert single.status_code == 200 and single.json() == post(api, "/query/page/gpu", {"keys": keys}).json()
    batch = post(api, "/query/page/gpu/batch/", {"queries": [{"keys": keys}]})
    assert batch.status_code == 200
    job = post(api, "/bulk/jobs/", {"queries": [{"keys": keys}]})
    assert job.status_code == 201
    assert api.get(f"/bulk/jobs/{job.json()['id']}/").json()["id"] == job.json()["id"]
    assert api.get("/no/such/endpoint/").status_code == 404


def test_a_post_without_the_slash_is_served_not_redirected(api, vector_matrix_path):
    response = post(api, "/api/row-updates", {"row": 3, "data": "ab" * 256})
    assert response.status_code == 201, response.content


def test_admin_pages_keep_their_redirect_to_the_slashed_url(client):
    response = client.get("/admin")
    assert response.status_code == 301 and response["Location"] == "/admin/"


# --- paging ---------------------------------------------------------------------------------


def test_bulk_jobs_are_paged_like_the_operations_api(api, keys):
    for _ in range(3):
        assert post(api, "/bulk/jobs", {"queries": [{"keys": keys}]}).status_code == 201
    page = api.get("/bulk/jobs?limit=2").json()
    assert set(page) == {"count", "next", "previous", "results"}
    assert page["count"] == 3 and len(page["results"]) == 2 and "offset=2" in page["next"]
    updates = api.get("/api/row-updates/").json()
    assert set(updates) == {"count", "next", "previous", "results"}


# --- the landing page ---------------------------------------------------------------------------


def test_the_root_is_a_page_linking_dashboard_admin_schema_and_docs(client):
    response = client.get("/")
    assert response.status_code == 200 and response["Content-Type"].startswith("text/html")
    page = response.content.decode()
    for href in ("/dashboard/", "/admin/", "/api/schema", "/api/docs", "/health", "/epoch"):
        assert f'href="{href}"' in page, href
    docs = client.get("/api/docs")
    assert docs.status_code == 200 and "swagger-ui" in docs.content.decode()
    # The docs page's script and styles come from this server, not from a CDN.
    assets = re.findall(r'(?:src|href)="(/static/[^"]+)"', docs.content.decode())
    assert assets and all(client.get(asset).status_code == 200 for asset in assets), assets
