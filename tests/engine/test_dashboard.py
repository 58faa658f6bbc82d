"""The operator dashboard: staff only, fed by the same figures /metrics exports."""
from __future__ import annotations

import re

import numpy as np
import pytest
from django.contrib.auth.models import User
from rest_framework.test import APIClient

from epochs import sync
from morpho_pir.dpf import gen_keys
from engine.holder import get_engine


@pytest.fixture
def staff(db, client):
    User.objects.create_superuser("root", password="pw-root")
    client.login(username="root", password="pw-root")
    return client


def metric_line(text, name, **labels):
    """The value of the first /metrics sample `name` whose labels include `labels`."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                return line
    return None


def test_page_and_data_show_what_metrics_exports(staff, serve_matrix, vector_matrix_path):
    serve_matrix(vector_matrix_path)
    get_engine()
    rng = np.random.default_rng(2)
    keys = [gen_keys(p, 8, rng=rng)[0].to_bytes().hex() for p in (1, 2, 3)]
    assert APIClient().post("/query/page/gpu", {"keys": keys}, format="json").status_code == 200
    sync.push_rows([(17, bytes(256))])

    metrics = staff.get("/metrics").content.decode()
    data = staff.get("/dashboard/data").json()
    policy_line = metric_line(metrics, "pir_batching_policy_info", lane="interactive")
    name = re.search(r'name="([^"]+)"', policy_line).group(1)
    assert data["policies"]["interactive"]["name"] == name
    assert data["epoch"]["epoch_id"] == "5" and metric_line(metrics, "pir_epoch_info", epoch_id="5")
    assert data["pending_updates"] == 1 and metric_line(metrics, "pir_row_updates_pending").endswith(" 1.0")
    assert data["recent_updates"][0]["row"] == 17
    assert data["http_queries"] >= 1
    assert data["latency_buckets"][-1][0] == "+Inf" and data["latency_buckets"][-1][1] >= 1
    assert data["batch_size_buckets"][-1][1] >= 1
    assert data["memory"]["resident"] == 200 * 4096
    assert set(data["queue_depth"]) == {"interactive", "bulk"}
    layout = metric_line(metrics, "pir_engine_layout_info")
    assert 'layout="pages"' in layout and 'reason="this backend scans pages, its one layout"' in layout
    assert data["layout"] == {"backend": "cpu", "layout": "pages", "pass_queries": "74",
                              "reason": "this backend scans pages, its one layout"}

    # the digest every answer's `state` carries, the one figure that differs where parties diverge
    state = APIClient().get("/epoch").json()["state"]
    assert data["served_state"] == state and state["updates"] == 1
    page = staff.get("/dashboard/").content.decode()
    assert f'<td class="policy-name">{name}</td>' in page
    assert "epoch 5</span> block 1234" in page
    assert f'<code class="digest" id="state-digest">{state["digest"]}</code>' in page
    assert "https://" not in page and "http://" not in page  # nothing loaded from elsewhere


def test_bulk_jobs_in_flight_are_listed(staff):
    from queries.models import BulkJob

    owner = User.objects.get(username="root")
    job = BulkJob.objects.create(owner=owner, total=1000, answered=250, domain_bits=8, chunk_size=100,
                                 status="running")
    BulkJob.objects.create(owner=owner, total=10, answered=10, domain_bits=8, chunk_size=10, status="done")
    jobs = staff.get("/dashboard/data").json()["bulk_jobs"]
    assert jobs == [{"id": str(job.pk), "status": "running", "answered": 250, "total": 1000}]


def test_without_an_engine_the_page_says_not_available(staff):
    from engine.holder import shutdown_engine

    shutdown_engine()
    page = staff.get("/dashboard/").content.decode()
    assert page.count("not available") >= 2
    data = staff.get("/dashboard/data").json()
    assert data["epoch"] is None and data["memory"] is None


def test_data_endpoint_needs_staff(db, client):
    response = client.get("/dashboard/data")
    assert response.status_code == 302 and "/admin/login/" in response["Location"]


def test_every_page_names_the_party(staff, settings):
    """Two parties' tabs side by side: the landing page, the dashboard and the admin say which."""
    settings.MORPHO_PARTY_NAME = "B"
    assert '<h1 id="party">morphoweb party B: one of two servers' in staff.get("/").content.decode()
    assert '<h1 id="party">morphoweb operator dashboard: party B</h1>' in \
        staff.get("/dashboard/").content.decode()
    admin = staff.get("/admin/").content.decode()
    assert '<a href="/admin/">morphoweb party B administration</a>' in admin
    assert "<title>Site administration | morphoweb party B admin</title>" in admin
    settings.MORPHO_PARTY_NAME = ""
    assert "party B" not in staff.get("/admin/").content.decode()
