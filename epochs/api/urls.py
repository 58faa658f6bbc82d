"""Routes of the epochs API; no logic here."""
from rest_framework.routers import SimpleRouter

from epochs.api import views

router = SimpleRouter()
router.register("epochs", views.EpochViewSet)
router.register("row-updates", views.RowUpdateViewSet)
router.register("records", views.RecordChangeViewSet)

urlpatterns = router.urls
