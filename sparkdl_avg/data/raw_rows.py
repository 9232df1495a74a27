"""What `fit(preprocess=fn)` gets, and which row it failed on.

`raw_batch` turns a batch's raw rows (per field an array, or a ragged field's (values,
lengths), as the caches hand them out; `join_parts` puts pieces one after another) into the
dict `fn` takes: a binary column as a list of `bytes`, a string column as a list of `str`,
Spark's image struct as a dict, numbers as arrays. `call` runs `fn` on it. When `fn` raises,
it looks for the row that fails alone, halving the batch (a few more calls of `fn`, on the
error's way only: a corrupt record fails the same way every time), and raises a
`PreprocessError` naming that row by the frame's identifying column (`DataSchema.idents`:
`path`, `id`...), else by its position.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from sparkdl_avg._errors import PreprocessError
from sparkdl_avg.data.schema import IMAGE_FIELDS, DataSchema

Where = Callable[[int | None, int], str]
"""`where(k, rows)`: where row k of a batch of `rows` lies, in words; k None: the batch."""


def join_parts(schema: DataSchema, parts: list[list]) -> list:
    """Pieces of rows (each `Window.part`'s or `MemoryColumns.part`'s form: per field an
    array, or a ragged field's (values, lengths)) one after another, per carried field."""
    if len(parts) == 1:
        return parts[0]
    out = []
    for i, field in enumerate(schema.carried):
        pieces = [p[i] for p in parts]
        out.append(tuple(np.concatenate(c) for c in zip(*pieces, strict=True))
                   if field.ragged else np.concatenate(pieces))
    return out


def rows_of(value) -> int:
    """Rows in one field's joined value (an array, or a ragged field's (values, lengths))."""
    return len(value[1]) if isinstance(value, tuple) else len(value)


def _records(values: np.ndarray, lengths: np.ndarray, skip: int = 0) -> list[bytes]:
    """Each row's bytes (after its first `skip`), from the flat values and the lengths."""
    buffer, ends = values.tobytes(), np.cumsum(lengths)
    return [buffer[a:b] for a, b in zip((ends - lengths + skip).tolist(), ends.tolist(),
                                        strict=True)]


def _texts(values: np.ndarray, lengths: np.ndarray) -> list[str]:
    """Each row's UTF-8 bytes as a `str`: the flat values and their offsets made one Arrow
    string array, which makes the Python strings in C (no Python loop over rows)."""
    import pyarrow as pa

    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    strings = pa.LargeStringArray.from_buffers(
        len(lengths), pa.py_buffer(offsets), pa.py_buffer(np.ascontiguousarray(values)))
    return strings.to_pylist()


def _image(values: np.ndarray, lengths: np.ndarray) -> dict:
    """A packed image struct's rows (`describe.pack_image`) as {"data": list of bytes, and
    per int field an int32 array}: the headers are gathered at once, not row by row."""
    starts = np.cumsum(lengths) - lengths
    width = 4 * len(IMAGE_FIELDS)
    header = values[starts[:, None] + np.arange(width)].reshape(len(lengths), width)
    ints = header.view(">i4").astype(np.int32)
    out = {"data": _records(values, lengths, skip=width)}
    out.update({name: ints[:, i] for i, name in enumerate(IMAGE_FIELDS)})
    return out


def raw_batch(schema: DataSchema, joined: list) -> dict:
    """What `preprocess` gets, by column: a binary field as a list of `bytes`, a string one as
    a list of `str` (Spark's image struct as a dict: "data" a list of `bytes`, "height",
    "width", "nChannels", "mode" int32 arrays), a ragged numeric one as a list of arrays, a
    fixed-shape one as an array `[rows, *shape]`."""
    out = {}
    for field, value in zip(schema.carried_data, joined, strict=False):  # idents stay out
        if field.image:
            out[field.key] = _image(*value)
        elif field.text:
            out[field.key] = _texts(*value)
        elif field.encoded:
            out[field.key] = _records(*value)
        elif field.ragged:
            values, lengths = value
            out[field.key] = np.split(values, np.cumsum(lengths)[:-1]) if len(lengths) else []
        else:
            out[field.key] = value
    return out


def call(fn, schema: DataSchema, joined: list, *, training: bool, rng, where: Where):
    """`fn` on the batch of rows `joined` (`schema`'s fields, idents last); a
    `PreprocessError` naming the row it fails on (`failure`) when it raises."""
    state = None if rng is None else rng.bit_generator.state  # to replay the same draws
    try:
        return fn(raw_batch(schema, joined), training=training, rng=rng)
    except Exception as exc:
        raise failure(fn, schema, joined, exc, training=training,
                      rng=lambda: _replayed(rng, state), where=where) from exc


def failure(fn, schema: DataSchema, joined: list, exc: Exception, *, training: bool,
            rng: Callable, where: Where) -> PreprocessError:
    """The error of `fn` failing with `exc` on the rows `joined`: it names the row that
    fails alone (found by halving: `fn` on fresh copies of the parts, each with the batch's
    `rng()`), by its ident or its position, and says when the other rows fail without it
    too; or says that no row fails alone (the batch as a whole fails)."""
    rows = rows_of(joined[0])
    found, rest = (0, exc), None
    if rows > 1:
        batch = raw_batch(schema, joined)  # fn may have changed the one it got
        found = _failing_row(fn, batch, rows, training, rng)
        if found is not None:
            rest = _raises(fn, _without(batch, found[0]), training, rng())
    if found is None:
        return PreprocessError(f"preprocess failed on {where(None, rows)} and on none of its "
                               f"rows alone: {exc!r}")
    k, error = found
    named = ident_of(schema, joined, k)
    who = f"the row whose {named[0]} is {named[1]!r} ({where(k, rows)})" if named else \
        f"{where(k, rows)} ({_unnamed()})"
    more = "; the batch's other rows fail without it too: more rows fail, or fn on any" \
        if rest is not None else ""
    return PreprocessError(f"preprocess failed on {who}: {error!r}{more}")


def ident_of(schema: DataSchema, joined: list, k: int) -> tuple[str, str] | None:
    """(column, value) naming row k by the batch's ident (`DataSchema.idents`, carried
    after the data's fields as UTF-8), or None: none, or empty (an eval_df without it)."""
    if not schema.idents or len(joined) <= len(schema.carried_data):
        return None
    values, lengths = joined[len(schema.carried_data)]
    if k >= len(lengths):
        return None
    start = int(lengths[:k].sum())
    text = values[start:start + int(lengths[k])].tobytes().decode("utf-8", "replace")
    return (schema.idents[0].name, text) if text else None


def _unnamed() -> str:
    from sparkdl_avg.data.describe import IDENT_COLUMNS

    return f"no {', '.join(IDENT_COLUMNS[:-1])} or {IDENT_COLUMNS[-1]} column names it"


def _failing_row(fn, batch: dict, rows: int, training: bool, rng: Callable):
    """(k, its error) for a row `fn` fails on alone, the first half tried first; None when
    neither half of the rows left fails."""
    low, high, error = 0, rows, None
    while high - low > 1:
        mid = (low + high) // 2
        for a, b in ((low, mid), (mid, high)):
            error = _raises(fn, _take(batch, slice(a, b)), training, rng())
            if error is not None:
                low, high = a, b
                break
        else:
            return None
    return low, error


def _raises(fn, batch: dict, training: bool, rng) -> Exception | None:
    try:
        fn(batch, training=training, rng=rng)
    except Exception as exc:  # noqa: BLE001 - any failure counts: it is the user's fn
        return exc
    return None


def _take(value, rows):
    """Rows `rows` (a slice or an index array) of a raw batch's value, copied: fn may write
    to what it gets."""
    if isinstance(value, dict):
        return {k: _take(v, rows) for k, v in value.items()}
    if isinstance(value, np.ndarray):
        return value[rows].copy()
    if isinstance(rows, slice):
        return value[rows]
    return [value[i] for i in rows.tolist()]


def _without(batch: dict, k: int) -> dict:
    some = next(iter(batch.values()), [])
    some = some["data"] if isinstance(some, dict) else some
    keep = np.delete(np.arange(len(some)), k)
    return _take(batch, keep)


def _replayed(rng, state):
    """A generator at `state` (`rng`'s before the failed call), or None."""
    if rng is None:
        return None
    again = np.random.Generator(type(rng.bit_generator)())
    again.bit_generator.state = state
    return again
