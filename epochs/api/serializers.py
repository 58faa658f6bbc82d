"""Serializers of epoch records and row updates: the model's clean() decides what is valid."""
from __future__ import annotations

from django.core.exceptions import ValidationError as DjangoValidationError
from django.core.validators import MaxLengthValidator, MaxValueValidator, MinValueValidator
from drf_spectacular.extensions import OpenApiSerializerFieldExtension
from drf_spectacular.utils import extend_schema_field, extend_schema_serializer
from rest_framework import serializers

from epochs.models import Epoch, RecordChange, RowUpdate
from morpho_pir.dpf import MAX_DOMAIN_BITS
from gpu_engine.engine import SwitchMode
from gpu_engine.placement import Placement
from gpu_engine.matrix import ROW_BYTES


def _expected(field: serializers.Field, plural: bool = False) -> str:
    """What a field takes, in the words of the API's other errors ("an integer in 0..7")."""
    if isinstance(field, serializers.ListField):
        size = field.min_length if field.min_length == field.max_length else None
        count = f"{size} " if size else ""
        return f"an array of {count}{_expected(field.child, plural=True)}"
    if isinstance(field, serializers.ChoiceField):
        return "one of " + ", ".join(str(choice) for choice in field.choices)
    if isinstance(field, serializers.IntegerField):
        noun = "integers" if plural else "an integer"
        if field.min_value is not None and field.max_value is not None:
            return f"{noun} in {field.min_value}..{field.max_value}"
        return noun
    if isinstance(field, serializers.CharField):
        return "strings" if plural else "a string"
    return "values" if plural else "a value"


def in_our_words(field: serializers.Field) -> serializers.Field:
    """Replace DRF's stock messages ("This field may not be null.") with expected/got ones."""
    expected = _expected(field)
    field.error_messages.update({
        "required": f"expected {expected}, got nothing",
        "null": f"expected {expected}, got null",
        "invalid": f"expected {expected}",
        "blank": f"expected {expected}, got an empty string",
        "max_length": f"expected {expected} of at most {{max_length}} characters",
        "invalid_choice": f'expected {expected}, got "{{input}}"',
        "not_a_list": f"expected {expected}, got {{input_type}}",
        "max_string_length": f"expected {expected}, got too many digits",
    })
    for validator in field.validators:
        # Django's range validators fill these in with the bound and the value sent.
        if isinstance(validator, MinValueValidator):
            validator.message = f"expected {expected}, got %(show_value)s"
        elif isinstance(validator, MaxValueValidator):
            validator.message = f"expected {expected}, got %(show_value)s"
        elif isinstance(validator, MaxLengthValidator):
            validator.message = (f"expected {expected} of at most %(limit_value)d characters, "
                                 f"got %(show_value)d")
    if isinstance(field, serializers.ListField):
        in_our_words(field.child)
    return field


class ValidatedModelSerializer(serializers.ModelSerializer):
    """Runs Model.clean() on the would-be instance, so the API rejects input in the admin's words."""

    clean_exclude: tuple = ()

    def get_fields(self):
        return {name: in_our_words(field) for name, field in super().get_fields().items()}

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


class HexField(serializers.CharField):
    """`num_bytes` bytes as hex digits, 0x optional; Model.clean() checks it (in the admin's
    words), this field only tells the schema what clean() accepts."""

    def __init__(self, *, num_bytes: int, **kwargs) -> None:
        self.num_bytes = num_bytes
        super().__init__(**kwargs)


class HexFieldSchema(OpenApiSerializerFieldExtension):
    """The pattern and lengths of a HexField, for clients and schema-driven tests."""

    target_class = HexField

    def map_serializer_field(self, auto_schema, direction):
        digits = 2 * self.target.num_bytes
        return {"type": "string", "pattern": f"^(0[xX])?[0-9a-fA-F]{{{digits}}}$",
                "minLength": digits, "maxLength": digits + 2}


@extend_schema_field({"type": "integer", "minimum": 1, "maximum": MAX_DOMAIN_BITS})
class DomainBitsField(serializers.IntegerField):
    """A DPF depth: documented as 1..MAX_DOMAIN_BITS; Model.clean() checks it against the matrix."""


@extend_schema_serializer(component_name="EpochRecord")  # "Epoch" is the protocol's /epoch body
class EpochSerializer(ValidatedModelSerializer):
    """An epoch record: a matrix file on this server plus the metadata clients see in /epoch."""

    seeds = serializers.ListField(
        child=serializers.IntegerField(min_value=0, max_value=(1 << 64) - 1),
        min_length=3, max_length=3, required=False,
        help_text="The three cuckoo seeds (u64 each).",
    )
    state_root = HexField(num_bytes=32, required=False,
                          help_text="32 bytes as hex (0x optional); default all zero.")
    domain_bits = DomainBitsField(
        required=False, allow_null=True,
        help_text="DPF tree depth; empty = the smallest that covers the matrix's pages.",
    )

    class Meta:
        model = Epoch
        fields = ["id", "epoch_id", "matrix_path", "block_number", "state_root", "seeds",
                  "domain_bits", "pending_updates", "switch_mode", "placement", "records", "state",
                  "num_pages", "size_bytes", "sha256", "message", "created", "activated"]
        # records: from the matrix file's sidecar (build_records writes it), never typed in
        read_only_fields = ["state", "num_pages", "size_bytes", "sha256", "message", "created",
                            "activated", "records"]
        extra_kwargs = {"matrix_path": {"min_length": 1}}
        clean_sets = ["num_pages", "size_bytes", "sha256", "records"]


class ActivateSerializer(serializers.Serializer):
    """Optional body of the activate action: how to switch."""

    def get_fields(self):
        return {name: in_our_words(field) for name, field in super().get_fields().items()}

    switch_mode = serializers.ChoiceField(
        choices=SwitchMode.choices(), required=False,
        help_text="beside (default: the record's own) or stop_the_world.",
    )
    placement = serializers.ChoiceField(
        choices=Placement.choices(), required=False,
        help_text="auto, shard or replicate over the engine's devices (default: the record's own).",
    )


class RowUpdateSerializer(ValidatedModelSerializer):
    """A row update: row `row` of the served epoch reads as `data` once this returns 201."""

    clean_exclude = ("epoch_id", "first_epoch_id")
    data = HexField(num_bytes=ROW_BYTES, help_text=f"The row's new {ROW_BYTES} bytes as hex "
                    "(0x optional).")

    class Meta:
        model = RowUpdate
        fields = ["id", "epoch_id", "first_epoch_id", "row", "data", "state", "created"]
        read_only_fields = ["epoch_id", "first_epoch_id", "state", "created"]
        clean_sets = ["epoch_id", "first_epoch_id"]


class RecordChangeSerializer(ValidatedModelSerializer):
    """A key set or deleted in the active records epoch; `rows` says which rows it wrote."""

    class Meta:
        model = RecordChange
        fields = ["id", "epoch_id", "op", "key", "value", "record_type", "rows", "created"]
        read_only_fields = ["epoch_id", "rows", "created"]
        clean_sets = ["epoch_id"]
