"""`task.warm_daemon` as it was before it imported the installed pyspark's compiled modules:
pyspark from Spark's pyspark.zip, compiled afresh in the daemon and in every worker
(`cold_start.py --zipped-pyspark`). pyspark is imported here first, from the zip at the head
of the path, so every later pyspark import comes from the zip too."""

import runpy

import pyspark  # noqa: F401

runpy.run_module("sparkdl_avg.task.warm_daemon", run_name="__main__", alter_sys=True)
