"""Which pyspark the warm daemon imports: an installed pyspark's own zip is dropped from the
path in favour of the same package's compiled modules; every other layout keeps the path."""

from __future__ import annotations

import zipfile
from pathlib import Path

from sparkdl_avg.task.warm_daemon import without_installed_spark_zip


def spark_zip(home: Path, version: str = "4.3.0") -> str:
    """home/python/lib/pyspark.zip, as Spark lays it out under SPARK_HOME; its path."""
    (home / "python" / "lib").mkdir(parents=True)
    zipped = home / "python" / "lib" / "pyspark.zip"
    with zipfile.ZipFile(zipped, "w") as archive:
        archive.writestr("pyspark/__init__.py", "")
        archive.writestr("pyspark/version.py", f'__version__ = "{version}"\n')
    return str(zipped)


def installed_pyspark(root: Path, version: str = "4.3.0", zipped_version: str | None = None):
    """root/pyspark as pip installs it, with its python/lib/pyspark.zip; the zip's path."""
    package = root / "pyspark"
    zipped = spark_zip(package, zipped_version or version)  # SPARK_HOME is the package
    (package / "__init__.py").write_text("")
    (package / "version.py").write_text(f'__version__ = "{version}"\n')
    return zipped


def test_an_installed_pysparks_own_zip_gives_way_to_the_installed_package(tmp_path):
    zipped = installed_pyspark(tmp_path / "site")
    path = [zipped, str(tmp_path / "py4j.zip"), str(tmp_path / "other"), str(tmp_path / "site")]
    assert without_installed_spark_zip(path) == path[1:]


def test_a_zip_of_another_version_stays(tmp_path):
    zipped = installed_pyspark(tmp_path / "site", zipped_version="4.3.1")
    path = [zipped, str(tmp_path / "site")]
    assert without_installed_spark_zip(path) == path


def test_a_zip_stays_when_another_pyspark_would_be_imported_without_it(tmp_path):
    zipped = installed_pyspark(tmp_path / "site")
    installed_pyspark(tmp_path / "earlier")  # same version, another install
    path = [zipped, str(tmp_path / "earlier"), str(tmp_path / "site")]
    assert without_installed_spark_zip(path) == path


def test_a_spark_distributions_zip_stays(tmp_path):
    """SPARK_HOME/python/lib/pyspark.zip of a Spark distribution (Databricks' own build, say)
    is not the pip-installed pyspark the executors' Python may also have."""
    installed_pyspark(tmp_path / "site")
    path = [spark_zip(tmp_path / "spark-home"), str(tmp_path / "site")]
    assert without_installed_spark_zip(path) == path


def test_a_zip_stays_when_nothing_else_provides_pyspark(tmp_path):
    zipped = installed_pyspark(tmp_path / "site")
    assert without_installed_spark_zip([zipped, str(tmp_path / "empty")]) == \
        [zipped, str(tmp_path / "empty")]
