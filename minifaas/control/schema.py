"""What a control message may hold: one table of fields per op, checked before anything uses the message.

    PREFILL = {"req": Text(), "tokens": IntList(0, 2**31), "rate": Optional(Number(0.0, 1.0))}
    check_fields(raw, PREFILL)      # or BadMessage, naming the first thing wrong

Every field is required unless ``Optional``, and an unknown field is refused. Values are bounded and finite, so
no value in a validated message can make a handler raise.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass


class BadMessage(ValueError):
    """A control message that its op's schema does not allow."""


class Kind:
    def check(self, value: object) -> str | None:
        """Why ``value`` is not of this kind, or None."""
        raise NotImplementedError


@dataclass(frozen=True)
class Int(Kind):
    lo: int = 0
    hi: int = 2**63 - 1

    def check(self, value: object) -> str | None:
        if not isinstance(value, int) or isinstance(value, bool):
            return f"an integer, not {type(value).__name__}"
        return None if self.lo <= value <= self.hi else f"{value} is outside [{self.lo}, {self.hi}]"


@dataclass(frozen=True)
class Number(Kind):
    lo: float = 0.0
    hi: float = math.inf

    def check(self, value: object) -> str | None:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            return f"a finite number, not {value!r}"[:80]
        return None if self.lo <= value <= self.hi else f"{value} is outside [{self.lo}, {self.hi}]"


@dataclass(frozen=True)
class Bool(Kind):
    def check(self, value: object) -> str | None:
        return None if isinstance(value, bool) else f"true or false, not {type(value).__name__}"


@dataclass(frozen=True)
class Text(Kind):
    max_len: int = 256

    def check(self, value: object) -> str | None:
        if not isinstance(value, str):
            return f"a string, not {type(value).__name__}"
        return None if len(value) <= self.max_len else f"a string of {len(value)} characters (at most {self.max_len})"


@dataclass(frozen=True)
class OneOf(Kind):
    """One of a few names (a codec, a mode): a name the table lacks is refused here, not deep in a handler."""

    names: tuple[str, ...]

    def check(self, value: object) -> str | None:
        return None if value in self.names else f"one of {', '.join(self.names)}, not {value!r}"[:120]


@dataclass(frozen=True)
class IntList(Kind):
    lo: int = 0
    hi: int = 2**31 - 1
    max_len: int = 1 << 24

    def check(self, value: object) -> str | None:
        if not isinstance(value, list) or len(value) > self.max_len:
            return f"a list of at most {self.max_len} integers"
        item = Int(self.lo, self.hi)
        return next((f"item {i}: {why}" for i, v in enumerate(value) if (why := item.check(v))), None)


@dataclass(frozen=True)
class ListOf(Kind):
    """A list of values of one kind."""

    item: Kind
    max_len: int = 1 << 24

    def check(self, value: object) -> str | None:
        if not isinstance(value, list) or len(value) > self.max_len:
            return f"a list of at most {self.max_len} items"
        check = self.item.check  # a plain loop: a decode step's tokens pass here, one item per request
        for i, v in enumerate(value):
            if why := check(v):
                return f"item {i}: {why}"[:200]
        return None


@dataclass(frozen=True)
class MapOf(Kind):
    """An object whose keys are any short strings, each value of one kind."""

    value: Kind
    max_len: int = 1 << 16
    key: Kind = Text(1024)

    def check(self, value: object) -> str | None:
        if not isinstance(value, dict) or len(value) > self.max_len:
            return f"an object of at most {self.max_len} entries"
        bad = ((k, why) for k, v in value.items() if (why := self.key.check(k) or self.value.check(v)))
        return next((f"{k!r}: {why}"[:200] for k, why in bad), None)


@dataclass(frozen=True)
class Address(Kind):
    """[host, port]: where to send something."""

    def check(self, value: object) -> str | None:
        if not isinstance(value, list) or len(value) != 2:
            return "[host, port]"
        return Text(253).check(value[0]) or Int(1, 65535).check(value[1])


@dataclass(frozen=True)
class Optional(Kind):
    kind: Kind

    def check(self, value: object) -> str | None:
        return self.kind.check(value)


@dataclass(frozen=True)
class Nullable(Kind):
    """null, or a value of ``kind`` (the field itself is required unless also Optional)."""

    kind: Kind

    def check(self, value: object) -> str | None:
        return None if value is None else self.kind.check(value)


@dataclass(frozen=True)
class Fields(Kind):
    """A nested object with a schema of its own."""

    schema: Mapping[str, Kind]

    def check(self, value: object) -> str | None:
        if not isinstance(value, dict):
            return f"an object, not {type(value).__name__}"
        try:
            check_fields(value, self.schema)
        except BadMessage as e:
            return str(e)
        return None


@dataclass(frozen=True)
class Converted(Kind):
    """A value of ``kind`` on the wire that is another type in Python: ``load`` makes it, ``dump`` undoes it."""

    kind: Kind
    load: Callable[[object], object]
    dump: Callable[[object], object]

    def check(self, value: object) -> str | None:
        return self.kind.check(value)


def check_fields(message: dict, schema: Mapping[str, Kind]) -> None:
    if not message.keys() <= schema.keys():
        raise BadMessage(f"unknown fields {sorted(message.keys() - schema.keys())}"[:200])
    for name, kind in schema.items():
        if name not in message:
            if isinstance(kind, Optional):
                continue
            raise BadMessage(f"{name!r} is missing")
        why = kind.check(message[name])
        if why is not None:
            raise BadMessage(f"{name!r} must be {why}")
