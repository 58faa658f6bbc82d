"""Views of epoch records and row updates: querysets plus serializers, behind model permissions."""
from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.authentication import SessionAuthentication, TokenAuthentication
from rest_framework.decorators import action
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.exceptions import APIException, ValidationError
from rest_framework.permissions import DjangoModelPermissions
from rest_framework.response import Response

from epochs import runtime
from epochs.api.serializers import ActivateSerializer, EpochSerializer, RowUpdateSerializer
from epochs.models import Epoch, EpochState, RowUpdate


class OperatorPermissions(DjangoModelPermissions):
    """Signed-in users with the model's permissions; reading needs the view permission too."""

    perms_map = {
        **DjangoModelPermissions.perms_map,
        "GET": ["%(app_label)s.view_%(model_name)s"],
        "HEAD": ["%(app_label)s.view_%(model_name)s"],
    }


class SwitchConflict(APIException):
    status_code = status.HTTP_409_CONFLICT
    default_code = "switch_failed"


class OperatorPagination(LimitOffsetPagination):
    """Row updates pile up between epochs: a listing is paged, newest first.

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


class OperatorViewSet(viewsets.GenericViewSet):
    """Operators sign in with a DRF token (`manage.py drf_create_token USER`) or an admin session."""

    authentication_classes = [TokenAuthentication, SessionAuthentication]
    permission_classes = [OperatorPermissions]
    pagination_class = OperatorPagination


class EpochViewSet(mixins.CreateModelMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin,
                   OperatorViewSet):
    """Epoch records: create one for a matrix file on this server, then activate it."""

    queryset = Epoch.objects.all()
    serializer_class = EpochSerializer

    def perform_create(self, serializer):
        serializer.save(created_by=self.request.user)

    @extend_schema(request=ActivateSerializer, responses={200: EpochSerializer, 409: None})
    @action(detail=True, methods=["post"])
    def activate(self, request, pk=None):
        """Switch every engine of this party to this epoch; 409 says why when it cannot."""
        record = self.get_object()
        if not request.user.has_perm("epochs.change_epoch"):
            self.permission_denied(request, message="activating an epoch needs epochs.change_epoch")
        body = ActivateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        if record.state == EpochState.ACTIVE:
            raise SwitchConflict(f"epoch {record.epoch_id} is already active")
        mode = body.validated_data.get("switch_mode")
        try:
            runtime.activate(record, stop_the_world=None if mode is None else mode == "stop_the_world")
        except runtime.EpochSwitchError as exc:
            raise SwitchConflict(str(exc)) from None
        return Response(self.get_serializer(record).data)


class RowUpdateViewSet(mixins.CreateModelMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin,
                       OperatorViewSet):
    """Row updates: a 201 means every answer this party starts from now on includes the row."""

    queryset = RowUpdate.objects.all()
    serializer_class = RowUpdateSerializer

    def perform_create(self, serializer):
        update = RowUpdate(**serializer.validated_data, created_by=self.request.user)
        runtime.save_updates([update])
        serializer.instance = update
