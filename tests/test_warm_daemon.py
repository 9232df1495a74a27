"""The warm daemon's path: an installed pyspark's own zip is dropped in favour of the same
package's compiled modules (every other layout keeps it), and so are jars that hold no Python,
with the finders Python's start cached for what was dropped."""

from __future__ import annotations

import importlib.machinery
import sys
import zipfile
import zipimport
from pathlib import Path

from sparkdl_avg.task.warm_daemon import (
    forget_archives_off,
    without_installed_spark_zip,
    without_jars_of_no_python,
)


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


def archive(path: Path, *names: str) -> str:
    with zipfile.ZipFile(path, "w") as out:
        for name in names:
            out.writestr(name, "")
    return str(path)


def test_a_jar_without_python_leaves_the_path_and_every_other_entry_stays(tmp_path):
    core = archive(tmp_path / "spark-core_2.13-4.3.0.jar", "org/apache/spark/SparkContext.class",
                   "META-INF/MANIFEST.MF")
    packed = archive(tmp_path / "with-python.jar", "org/X.class", "pyspark/__init__.py")
    compiled = archive(tmp_path / "compiled.jar", "mod.cpython-311.pyc")
    py4j = archive(tmp_path / "py4j-src.zip", "META-INF/x")  # not a jar: as Spark put it
    missing, broken = str(tmp_path / "gone.jar"), tmp_path / "broken.jar"
    broken.write_bytes(b"not a zip")
    path = [core, packed, compiled, py4j, missing, str(broken), str(tmp_path)]
    assert without_jars_of_no_python(path) == path[1:]


def test_the_cached_finders_of_archives_off_the_path_are_forgotten(tmp_path, monkeypatch):
    dropped = archive(tmp_path / "dropped.zip", "pkg/__init__.py")
    kept = archive(tmp_path / "kept.zip", "other/__init__.py")
    monkeypatch.setattr(sys, "path_importer_cache", dict(sys.path_importer_cache))
    # what an import's search leaves: a finder for each archive, and for a package in one
    importlib.machinery.PathFinder.find_spec("absent", [dropped, kept, str(tmp_path)])
    importlib.machinery.PathFinder.find_spec("absent", [f"{dropped}/pkg", f"{kept}/other"])
    cache = sys.path_importer_cache
    assert isinstance(cache[dropped], zipimport.zipimporter)
    assert isinstance(cache[f"{dropped}/pkg"], zipimport.zipimporter)
    forget_archives_off([kept, str(tmp_path)])
    assert dropped not in cache and f"{dropped}/pkg" not in cache
    assert isinstance(cache[kept], zipimport.zipimporter)
    assert f"{kept}/other" in cache and str(tmp_path) in cache  # a folder's finder stays
