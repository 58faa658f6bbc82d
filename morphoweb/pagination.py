"""The one paging of every API listing (/api/*, /bulk/jobs): ?limit= and ?offset=."""
from rest_framework.pagination import LimitOffsetPagination


class ListPagination(LimitOffsetPagination):
    # Row updates pile up between epochs and jobs accumulate: a listing is paged, newest first.
    default_limit = 100
    max_limit = 1000
