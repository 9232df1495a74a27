"""How `messages` checks a field: its annotation (int, float, bool, str, dict, list and
`| None`), numbers finite and within `MAX_NUMBER`, and the shared checks of durations,
hex strings, request ids and payload descriptions; and how a tensor payload is described
and checked against its receiver's buffer (`tensor`, `check_tensor`, `into_checked`)."""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from functools import cache
from typing import TYPE_CHECKING, Any, Union

import numpy as np

from sparkdl_avg._errors import ProtocolError
from sparkdl_avg.net.shared_memory import REFERENCE

if TYPE_CHECKING:
    from sparkdl_avg.net.message_base import Message

MAX_NUMBER = 2 ** 53
"""No number on the wire is larger in magnitude (integers stay exact as floats)."""
DTYPES = ("float32", "float64")
"""What tensors travel as (the wire dtype of every model)."""
MAX_METRICS = 16
"""Evaluation metrics an EVAL may carry (`_metrics`)."""
MAX_METRIC_SUMS = 64
"""Numbers one metric's additive statistics may hold."""
MAX_TABLE_ROWS = 1 << 22
"""Score-table rows (an auc's distinct scores, 24 bytes each) an EVAL may carry, and eval_df
rows a fit with auc may have (`_metrics.check_table_rows`): about 100 MB at most."""
TABLE_COLUMNS = 3
"""A score table's row: score, positive weight, negative weight (float64)."""
METRIC_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,39}")
"""A metric's name: logged as eval_<name>."""


@cache
def hints(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def matches(value: object, expected: Any) -> bool:
    origin = typing.get_origin(expected)
    if origin in (Union, types.UnionType):
        return any(matches(value, arg) for arg in typing.get_args(expected))
    if expected is type(None):
        return value is None
    if expected is float:  # finite; a JSON integer in a float field within MAX_NUMBER
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        return abs(value) <= MAX_NUMBER if isinstance(value, int) else math.isfinite(value)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool) \
            and abs(value) <= MAX_NUMBER
    return isinstance(value, origin or expected)


def type_name(expected: Any) -> str:
    args = typing.get_args(expected)
    if args:
        return " or ".join(type_name(a) for a in args)
    return "null" if expected is type(None) else getattr(expected, "__name__", str(expected))


def payload_description(message: Message) -> None:
    if message.dtype not in DTYPES or not 1 <= message.numel <= MAX_NUMBER:
        raise message.invalid(f"a payload of {message.numel} {message.dtype!r} values")
    encoding = getattr(message, "encoding", "none")
    if encoding not in ENCODINGS or (encoding != "none" and message.dtype != "float32"):
        raise message.invalid(f"{message.dtype} values encoded as {encoding!r}")


ENCODINGS = ("none", "bf16", "int8", "int4")
"""How a tensor payload is encoded: as its values, or compressed (`averaging.compression`:
float32 values only)."""


def payload_nbytes(message: Message) -> int:
    """The bytes a described payload holds: its values, or their compressed form."""
    encoding = getattr(message, "encoding", "none")
    if encoding == "none":
        return message.numel * np.dtype(message.dtype).itemsize
    from sparkdl_avg.averaging.compression import encoded_nbytes

    return encoded_nbytes(encoding, message.numel)


def durations(message: Message, *names: str) -> None:
    for name in names:
        value = getattr(message, name)
        if not math.isfinite(value) or value < 0:
            raise message.invalid(f"{name}={value!r} is no duration")


def hex_string(name: str, value: str, message: Message) -> None:
    if len(value) > 256 or len(value) % 2:
        raise message.invalid(f"{name} is not hex")
    try:
        bytes.fromhex(value)
    except ValueError:
        raise message.invalid(f"{name} is not hex") from None


def region_name(message: Message) -> None:
    """`shared`: "" or a shared-memory region's name and token (`net.shared_memory`)."""
    if message.shared and not REFERENCE.fullmatch(message.shared):
        raise message.invalid("shared is not a shared-memory region's name")


def request_id(message: Message, request: int | None) -> None:
    """An evaluation request's id (async), if any: not negative."""
    if request is not None and request < 0:
        raise message.invalid(f"evaluation request {request}")


def metric_fields(message: Message, metrics: dict | None, ranked: dict | None) -> None:
    """An EVAL's metric statistics: at most MAX_METRICS names of METRIC_NAME's form, each with
    a list of at most MAX_METRIC_SUMS finite numbers or None (not finite); `ranked`, the rows of
    the score tables in the payload by metric, whole numbers adding up to at most
    MAX_TABLE_ROWS. The payload itself is checked against `ranked` by its receiver
    (`_eval_sums.split_tables`)."""
    for what, value in (("metrics", metrics), ("ranked", ranked)):
        if value is None:
            continue
        if len(value) > MAX_METRICS:
            raise message.invalid(f"{what} names {len(value)} metrics (at most {MAX_METRICS})")
        for name in value:
            if not METRIC_NAME.fullmatch(name):
                raise message.invalid(f"{what} has a metric named {name[:60]!r}")
    for name, sums in (metrics or {}).items():
        if sums is None:
            continue
        if not isinstance(sums, list) or len(sums) > MAX_METRIC_SUMS or not all(
                matches(v, float) for v in sums):
            raise message.invalid(f"metric {name!r} must be a list of at most "
                                  f"{MAX_METRIC_SUMS} finite numbers or null")
    counts = list((ranked or {}).values())
    if not all(matches(n, int) and n >= 0 for n in counts) or sum(counts) > MAX_TABLE_ROWS:
        raise message.invalid(f"ranked must give 0 to {MAX_TABLE_ROWS} score-table rows in all")


def finite_or_none(value: float) -> float | None:
    """A loss as it travels: None when it is not finite (the replica diverged)."""
    return value if math.isfinite(value) else None


def tensor(array: np.ndarray) -> dict[str, Any]:
    """The `dtype` and `numel` fields describing `array` as a payload."""
    return {"dtype": str(array.dtype), "numel": int(array.size)}


def check_tensor(message: Message, expected: np.ndarray, who: object) -> None:
    """Refuse (reason "shape") a payload that is not what `expected` holds, before reading
    it: the same byte count in another dtype must not pass as parameters."""
    if (message.dtype, message.numel) != (str(expected.dtype), expected.size):
        raise ProtocolError(f"{who} sent {message.numel} {message.dtype} values where "
                            f"{expected.size} {expected.dtype} were expected (a different "
                            "model or dtype on the other side?)", "shape")


def into_checked(array: np.ndarray, who: object):
    """A payload target for `receive`: `array`, once the message says it holds exactly
    that (`check_tensor`)."""
    def into(message: Message) -> np.ndarray:
        check_tensor(message, array, who)
        return array
    return into


def into_encoded(payload: np.ndarray, values: np.ndarray, encoding: str, who: object):
    """A payload target for `receive`: `payload` (uint8), once the message says it holds
    `values`' dtype and size in `encoding`."""
    def into(message: Message) -> np.ndarray:
        check_tensor(message, values, who)
        if getattr(message, "encoding", "none") != encoding:
            raise ProtocolError(f"{who} sent values encoded as "
                                f"{getattr(message, 'encoding', 'none')!r}, expected "
                                f"{encoding!r}", "shape")
        return payload
    return into
