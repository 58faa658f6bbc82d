"""The one paging of every API listing (/api/*, /bulk/jobs): ?limit= and ?offset=, checked."""
from rest_framework.exceptions import ValidationError
from rest_framework.pagination import LimitOffsetPagination


class ListPagination(LimitOffsetPagination):
    """Row updates pile up between epochs and jobs accumulate: a listing is paged, newest first.

    `limit` and `offset` are checked, not guessed: DRF would answer `limit=abc` or `offset=-5`
    with its defaults, which a client takes for the page it asked for."""

    default_limit = 100
    max_limit = 1000

    def _number(self, request, name: str, lowest: int, highest: int | None, default: int) -> int:
        values = request.query_params.getlist(name)
        if not values:
            return default
        span = f"{lowest}..{highest}" if highest is not None else f"{lowest} or more"
        text = values[0]
        digits = text[1:] if text[:1] == "-" else text
        if len(values) > 1 or not (digits.isascii() and digits.isdigit()):
            got = repr(values) if len(values) > 1 else repr(text)
            raise ValidationError({name: [f"expected one integer, {span}, got {got}"]})
        value = int(text)
        if value < lowest or (highest is not None and value > highest):
            raise ValidationError({name: [f"expected an integer {span}, got {value}"]})
        return value

    def get_limit(self, request) -> int:
        return self._number(request, self.limit_query_param, 1, self.max_limit, self.default_limit)

    def get_offset(self, request) -> int:
        return self._number(request, self.offset_query_param, 0, None, 0)

    def get_schema_operation_parameters(self, view):
        parameters = super().get_schema_operation_parameters(view)
        bounds = {self.limit_query_param: {"minimum": 1, "maximum": self.max_limit,
                                           "default": self.default_limit},
                  self.offset_query_param: {"minimum": 0, "default": 0}}
        for parameter in parameters:
            parameter["schema"].update(bounds[parameter["name"]])
        return parameters
