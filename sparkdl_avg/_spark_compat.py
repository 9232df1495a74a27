"""What differs between the pyspark lines this library supports (4.0 and newer), decided once
here, by what the installed pyspark (and a Connect session's server) has, so that no other
module checks a version.

- Scoring's column function (`batch_udf`): on 4.1 and newer an iterator Arrow UDF
  (`pyspark.sql.functions.arrow_udf`), which hands the scorer Arrow arrays as they are; on
  4.0, which lacks it, an iterator `pandas_udf` around the same scorer: Spark turns each
  Arrow batch into pandas and back, and this module turns pandas into Arrow and back around
  it, so the scorer sees the same arrays and writes the same values. That costs Spark's
  pandas conversions: an object per cell for array columns, both ways.
- Below 4.0 nothing works: the fit's sample reads `DataFrame.toArrow` (4.0) and the
  training stage passes `mapInArrow(profile=)` (4.0). `check_pyspark` says so before work
  starts (pip's floor, pyspark>=4.0, stops it at install unless a platform's own pyspark
  was kept, as on Databricks).

The installed pyspark is the client; on Spark Connect the server's Spark can be another line,
so where the two differ in what they run (`arrow_udf`, the floor) the session's line, its
`spark.version`, decides too: the older of the two wins.

Everything else the library uses (barrier `mapInArrow`, job tags, `spark.conf`, Spark ML)
is the same on every 4.x line, on classic and Spark Connect sessions alike.
"""

# No `from __future__ import annotations`: pyspark reads the pandas UDF's annotations as
# objects to choose its kind.
from collections.abc import Callable

import pyarrow as pa

from sparkdl_avg._errors import ConfigError

LOWEST = (4, 0)
"""The lowest pyspark line CI tests (`.ci/run`'s second environment)."""


def scoring_udf_kind() -> str:
    """"arrow" where pyspark has `arrow_udf` (4.1 and newer) and the active session's Spark
    runs it (a Connect server may be 4.0 under a newer client), else "pandas"."""
    from pyspark.sql import functions

    if not hasattr(functions, "arrow_udf"):
        return "pandas"
    session = _active_session()
    return "arrow" if session is None or line(session.version) >= (4, 1) else "pandas"


def line(version: str) -> tuple[int, ...]:
    """"4.0.5" -> (4, 0)."""
    return tuple(int(p) for p in version.split(".")[:2] if p.isdigit())


def _active_session():
    """The session UDFs are made for (a Connect one where this process made one), or None."""
    from pyspark.sql import SparkSession

    return SparkSession.getActiveSession()


def batch_udf(fn: Callable, return_type):
    """A column function of Spark's batches: `fn` maps an iterator of batches (an Arrow array
    for one argument, a tuple of them for several) to an iterator of Arrow arrays of
    `return_type` (a pyspark type object), one per batch with the batch's rows."""
    if scoring_udf_kind() == "arrow":
        from pyspark.sql.functions import arrow_udf

        return arrow_udf(fn, return_type)
    from pyspark.sql.functions import pandas_udf

    return pandas_udf(_through_pandas(fn), return_type)


def _through_pandas(fn: Callable) -> Callable:
    """`fn` as an iterator pandas UDF: Spark's pandas in, Arrow to `fn`, its Arrow out as the
    pandas Spark expects (a DataFrame for a struct). pyspark picks the UDF's kind from the
    annotations, so they are real objects here, not strings."""
    from collections.abc import Iterator

    import pandas as pd

    def scored(batches: Iterator[tuple[pd.Series, ...]]) -> Iterator[pd.Series]:
        def arrow(batch):  # one argument arrives as a Series, several as a tuple
            if isinstance(batch, tuple):
                return tuple(to_arrow(b) for b in batch)
            return to_arrow(batch)

        for out in fn(arrow(b) for b in batches):
            yield to_pandas(out)

    return scored


def to_arrow(data) -> pa.Array:
    """A pandas UDF's argument as the Arrow array an Arrow UDF gets: a struct column arrives
    as a DataFrame, any other as a Series (a numpy array per cell for arrays). NaN stays
    NaN (`from_pandas=False`), so scoring refuses it as it does on the Arrow path."""
    import pandas as pd

    if isinstance(data, pd.DataFrame):
        return pa.StructArray.from_arrays([to_arrow(data[c]) for c in data.columns],
                                          names=[str(c) for c in data.columns])
    return pa.array(data.to_numpy(), from_pandas=False)


def to_pandas(array: pa.Array):
    """An Arrow result as a pandas UDF returns it: a DataFrame of its fields for a struct
    (a struct inside becomes a dict per row, as pyspark reads it), else a Series."""
    import pandas as pd

    if pa.types.is_struct(array.type):
        return pd.DataFrame({array.type.field(i).name: f.to_pandas()
                             for i, f in enumerate(array.flatten())})
    return array.to_pandas()


def check_pyspark(spark=None) -> None:
    """A ConfigError, before any work, when the installed pyspark, or `spark`'s own Spark (a
    Connect server's can be older than its client), is below `LOWEST`."""
    import pyspark

    need = (f"sparkdl-avg needs pyspark {LOWEST[0]}.{LOWEST[1]} or newer (DataFrame.toArrow "
            f"and mapInArrow(profile=) arrived in 4.0)")
    if line(pyspark.__version__) < LOWEST:
        raise ConfigError(f"{need}; this is pyspark {pyspark.__version__}")
    if spark is not None and line(spark.version) < LOWEST:
        raise ConfigError(f"{need}; this session's Spark is {spark.version} (a Spark Connect "
                          f"server older than its pyspark {pyspark.__version__} client)")
