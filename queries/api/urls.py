"""Routes of the PIR API (docs/PROTOCOL.md section 5); no logic here."""
from django.urls import path
from rest_framework.routers import SimpleRouter

from queries.api import bulk_views, views

urlpatterns = [
    path("epoch", views.EpochView.as_view(), name="epoch"),
    path("query/page/gpu", views.PageQueryView.as_view(), name="query-page"),
    path("query/page/gpu/batch", views.BatchPageQueryView.as_view(), name="query-page-batch"),
]

# Bulk jobs: /bulk/jobs, /bulk/jobs/<id>, /bulk/jobs/<id>/results (no trailing slashes, like the above).
router = SimpleRouter(trailing_slash=False)
router.register("bulk/jobs", bulk_views.BulkJobViewSet, basename="bulk-job")
urlpatterns += router.urls
