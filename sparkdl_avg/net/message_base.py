"""The base of every message on the wire: a frozen dataclass whose fields are checked against
their annotations when built (`fields`), then by the kind's own `check`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from sparkdl_avg._errors import ProtocolError
from sparkdl_avg.net import fields
from sparkdl_avg.net.frames import Kind

M = TypeVar("M", bound="Message")
MAX_WORKERS = 4096
MAX_FINISHED_WAIT_S = 60.0
MAX_ERROR_CHARS = 2000
"""The longest error text a message carries (a server's checkpoint error, a task's CPU
fallback); the sender cuts a longer one, the receiver refuses it."""


@dataclass(frozen=True, slots=True)
class Message:
    """Fields are checked against their annotations (int, float, bool, str, dict, list and
    `| None`; floats finite, integers within `MAX_NUMBER`), then by the kind's own
    `check`."""

    KIND: ClassVar[Kind | None] = None
    PAYLOAD: ClassVar[bool | None] = False
    """True: must carry a payload; False: must not; None: may."""

    def __post_init__(self) -> None:
        for name, expected in fields.hints(type(self)).items():
            value = getattr(self, name)
            if not fields.matches(value, expected):
                raise ProtocolError(f"{type(self).__name__}.{name} must be "
                                    f"{fields.type_name(expected)}, got {value!r}"[:500])
        self.check()

    def check(self) -> None:
        """Checks beyond the types (ranges, codes); raise `invalid(...)`."""

    def invalid(self, why: str) -> ProtocolError:
        return ProtocolError(f"malformed {type(self).__name__}: {why}"[:500])

    def to_meta(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_meta(cls: type[M], meta: dict[str, Any]) -> M:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(meta) - names)
        if unknown:
            raise ProtocolError(f"{cls.__name__} has no fields {unknown}"[:500])
        try:
            return cls(**meta)
        except TypeError as exc:  # a required field is missing
            raise ProtocolError(f"malformed {cls.__name__}: {exc}"[:500]) from None
