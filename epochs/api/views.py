"""Views of epoch records and row updates: querysets plus serializers, behind model permissions."""
from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.authentication import SessionAuthentication, TokenAuthentication
from rest_framework.decorators import action
from rest_framework.exceptions import APIException
from rest_framework.permissions import DjangoModelPermissions
from rest_framework.response import Response

from epochs import record_changes, sync
from epochs.api.serializers import (
    ActivateSerializer, EpochSerializer, RecordChangeSerializer, RowUpdateSerializer,
)
from epochs.models import Epoch, EpochState, RecordChange, RowUpdate
from gpu_engine.engine import SwitchMode
from gpu_engine.placement import Placement


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


class NoRoomConflict(APIException):
    status_code = status.HTTP_409_CONFLICT
    default_code = "no_room"


class OperatorViewSet(viewsets.GenericViewSet):
    """Operators sign in with a DRF token (`manage.py drf_create_token USER`) or an admin session."""

    authentication_classes = [TokenAuthentication, SessionAuthentication]
    permission_classes = [OperatorPermissions]


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
        placement = body.validated_data.get("placement")
        try:
            sync.activate(record, None if mode is None else SwitchMode(mode),
                          None if placement is None else Placement(placement))
        except sync.EpochSwitchError as exc:
            raise SwitchConflict(str(exc)) from None
        return Response(self.get_serializer(record).data)


class RowUpdateViewSet(mixins.CreateModelMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin,
                       OperatorViewSet):
    """Row updates: a 201 means every answer this party starts from now on includes the row."""

    queryset = RowUpdate.objects.all()
    serializer_class = RowUpdateSerializer

    def perform_create(self, serializer):
        update = RowUpdate(**serializer.validated_data, created_by=self.request.user)
        sync.save_updates([update])
        serializer.instance = update


class RecordChangeViewSet(mixins.CreateModelMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin,
                          OperatorViewSet):
    """Record changes: a 201 means every answer this party starts from now on includes the
    change; 409 where a set finds no room within its eviction walk (nothing was written)."""

    queryset = RecordChange.objects.all()
    serializer_class = RecordChangeSerializer

    @extend_schema(responses={201: RecordChangeSerializer, 409: None})
    def create(self, request, *args, **kwargs):
        return super().create(request, *args, **kwargs)

    def perform_create(self, serializer):
        change = RecordChange(**serializer.validated_data, created_by=self.request.user)
        try:
            record_changes.apply_change(change)
        except record_changes.NoRoom as exc:
            raise NoRoomConflict(str(exc)) from None
        serializer.instance = change
