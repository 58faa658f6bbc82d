"""Routes of the PIR API (PROTOCOL.md section 5); no logic here."""
from django.urls import path

from queries.api import views

urlpatterns = [
    path("health", views.HealthView.as_view(), name="health"),
    path("epoch", views.EpochView.as_view(), name="epoch"),
    path("query/page/gpu", views.PageQueryView.as_view(), name="query-page"),
    path("query/page/gpu/batch", views.BatchPageQueryView.as_view(), name="query-page-batch"),
]
