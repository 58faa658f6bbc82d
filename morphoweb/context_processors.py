"""Template context of every page: which party this is (MORPHO_PARTY_NAME)."""
from django.conf import settings


def party(request) -> dict:
    """`party_name` ("" when unnamed), for the landing page's and the dashboard's headers."""
    return {"party_name": settings.MORPHO_PARTY_NAME}
