"""Serializers of epoch records and row updates: the model's clean() decides what is valid."""
from __future__ import annotations

from django.core.exceptions import ValidationError as DjangoValidationError
from drf_spectacular.utils import extend_schema_serializer
from rest_framework import serializers

from epochs.models import Epoch, RowUpdate, SwitchMode


class ValidatedModelSerializer(serializers.ModelSerializer):
    """Runs Model.clean() on the would-be instance, so the API rejects input in the admin's words."""

    clean_exclude: tuple = ()

    def validate(self, attrs):
        instance = self.Meta.model(**attrs) if self.instance is None else self.instance
        for name, value in attrs.items():
            setattr(instance, name, value)
        try:
            instance.full_clean(exclude=list(self.clean_exclude), validate_unique=True)
        except DjangoValidationError as exc:
            raise serializers.ValidationError(serializers.as_serializer_error(exc)) from None
        # clean() normalises values (hex case, the file's page count): hand those on.
        for name in self.Meta.fields:
            if name in attrs or name in getattr(self.Meta, "clean_sets", ()):
                attrs[name] = getattr(instance, name)
        return attrs


@extend_schema_serializer(component_name="EpochRecord")  # "Epoch" is the protocol's /epoch body
class EpochSerializer(ValidatedModelSerializer):
    """An epoch record: a matrix file on this server plus the metadata clients see in /epoch."""

    seeds = serializers.ListField(
        child=serializers.IntegerField(min_value=0, max_value=(1 << 64) - 1),
        min_length=3, max_length=3, required=False,
        help_text="The three cuckoo seeds (u64 each).",
    )

    class Meta:
        model = Epoch
        fields = ["id", "epoch_id", "matrix_path", "block_number", "state_root", "seeds",
                  "domain_bits", "pending_updates", "switch_mode", "state", "num_pages",
                  "size_bytes", "sha256", "message", "created", "activated"]
        read_only_fields = ["state", "num_pages", "size_bytes", "sha256", "message", "created",
                            "activated"]
        clean_sets = ["num_pages", "size_bytes", "sha256"]


class ActivateSerializer(serializers.Serializer):
    """Optional body of the activate action: how to switch."""

    switch_mode = serializers.ChoiceField(
        choices=SwitchMode.choices, required=False,
        help_text="beside (default: the record's own) or stop_the_world.",
    )


class RowUpdateSerializer(ValidatedModelSerializer):
    """A row update: row `row` of the served epoch reads as `data` once this returns 201."""

    clean_exclude = ("epoch_id", "first_epoch_id")

    class Meta:
        model = RowUpdate
        fields = ["id", "epoch_id", "first_epoch_id", "row", "data", "state", "created"]
        read_only_fields = ["epoch_id", "first_epoch_id", "state", "created"]
        clean_sets = ["epoch_id", "first_epoch_id"]
