"""Decode-attention policies by name (`--attention NAME --attention-opt key=value ...`)."""

from __future__ import annotations

from typing import Any

from ..errors import SparseSpecError
from .binarypc import BinaryPC
from .dense import Dense
from .doublep import DoubleP
from .doublesparse import DoubleSparse
from .magicpig import MagicPIG
from .policy import Policy, parse_options
from .quest import Quest
from .streaming import StreamingLLM
from .topk import OracleTopK
from .topp import OracleTopP, Twilight

POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in (
    Dense, OracleTopK, StreamingLLM, Quest, DoubleSparse, MagicPIG, BinaryPC, OracleTopP, Twilight, DoubleP,
)}


def parse_spec(spec: str) -> tuple[str, list[str]]:
    """"binarypc:sinks=4,bits=32" -> ("binarypc", ["sinks=4", "bits=32"]): a policy variant in one word."""
    name, _, inline = spec.partition(":")
    return name, [pair for pair in inline.split(",") if pair]


def make_policy(name: str, options: list[str] | dict[str, Any] = ()) -> Policy:
    """A policy by name with `key=value` options validated against its options dataclass."""
    cls = POLICIES.get(name)
    if cls is None:
        raise SparseSpecError(f"unknown attention policy {name!r} (choose from {', '.join(POLICIES)})")
    return cls(parse_options(cls.Options, options or []))
