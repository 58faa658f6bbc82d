"""Choices an operator makes (switch mode, placement): one spelling everywhere, words to read."""
from __future__ import annotations

import enum
from typing import List, Self, Tuple


class LabelledChoice(enum.StrEnum):
    """A choice whose members are the one spelling the database, the API, the admin and the
    engine server's control messages use (each member's value), with the words operators read
    (its label). Subclasses list members as NAME = "value", "label"."""

    label: str

    def __new__(cls, value: str, label: str) -> Self:
        member = str.__new__(cls, value)
        member._value_ = value
        member.label = label
        return member

    @classmethod
    def choices(cls) -> List[Tuple[str, str]]:
        """(value, label) pairs, as Django fields and DRF choice fields take them."""
        return [(member.value, member.label) for member in cls]


BACKEND_NAMES = ("auto", "cpu", "cuda")  # MORPHO_ENGINE_BACKEND: auto = CUDA where present, else CPU
