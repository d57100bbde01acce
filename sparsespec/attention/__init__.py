"""Decode-attention policies by name (`--attention NAME --attention-opt key=value ...`)."""

from __future__ import annotations

import dataclasses
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


def shared_options(spec: str, shared: tuple[str, ...] | list[str] = (), **first: str) -> tuple[str, dict[str, str]]:
    """A run's policy spec "NAME[:key=value,...]" with the options its policies share ("key=value" for every
    policy that has that option, "policy.key=value" for one) -> (its name, its options: `first`, then the shared
    ones it takes, then the spec's own, the later winning)."""
    name, inline = parse_spec(spec)
    takes = _option_names(name)
    opts = dict(first)
    for pair, own in [(p, False) for p in shared] + [(p, True) for p in inline]:
        key, _, value = pair.partition("=")
        owner, _, bare = key.rpartition(".")
        if owner == name or not owner and (own or takes is None or bare in takes):
            opts[bare] = value
    return name, opts


def _option_names(name: str) -> set[str] | None:
    """The options policy `name` takes (None for an unknown name, which `make_policy` refuses)."""
    cls = POLICIES.get(name)
    return None if cls is None else {f.name for f in dataclasses.fields(cls.Options)}


def check_policies(specs: tuple[str, ...] | list[str], shared: tuple[str, ...] | list[str] = ()) -> None:
    """A run's policy specs and shared options: refuse a spec listed twice (it would run, and count, twice), a
    shared "policy.key=value" whose policy the run does not have and a shared "key=value" that none of them takes
    (either would be dropped unseen)."""
    if len(set(specs)) < len(specs):
        raise SparseSpecError(f"a policy is listed twice: {' '.join(specs)}")
    names = {parse_spec(s)[0] for s in specs}
    for pair in shared:
        owner, _, bare = pair.partition("=")[0].rpartition(".")
        if owner and owner not in names:
            raise SparseSpecError(f"option {pair!r} is for policy {owner!r}, which is not among this run's "
                                  f"({', '.join(sorted(names))})")
        if not owner and all(t is not None and bare not in t for t in map(_option_names, names)):
            raise SparseSpecError(f"option {pair!r} is taken by none of this run's policies "
                                  f"({', '.join(sorted(names))}; `sparsespec policies` lists their options)")


def make_policy(name: str, options: list[str] | dict[str, Any] = ()) -> Policy:
    """A policy by name with `key=value` options validated against its options dataclass."""
    cls = POLICIES.get(name)
    if cls is None:
        raise SparseSpecError(f"unknown attention policy {name!r} (choose from {', '.join(POLICIES)})")
    return cls(parse_options(cls.Options, options or []))
