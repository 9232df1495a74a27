# Databricks notebook source
# MAGIC %md
# MAGIC # Synchronous vs asynchronous training, compared in MLflow
# MAGIC
# MAGIC The same model and data trained three ways: synchronous parameter averaging, asynchronous
# MAGIC Downpour SGD through a parameter server, and asynchronous with adaptive delay
# MAGIC compensation (DC-ASGD). Every run logs the same parameters and its metrics by round,
# MAGIC so MLflow's run comparison lines them up column by column.
# MAGIC
# MAGIC Cluster and install: as in the quickstart (Spark 4.3+, dedicated or standard access
# MAGIC mode, the wheel from a Volume). CI runs this notebook on a classic session only; the
# MAGIC quickstart also runs on Spark Connect.

# COMMAND ----------

# MAGIC %pip install "/Volumes/main/default/libs/sparkdl_avg-0.1.0-py3-none-any.whl[examples]"

# COMMAND ----------

dbutils.library.restartPython()

# COMMAND ----------

import mlflow

from sparkdl_avg import TrainConfig, fit
from sparkdl_avg.examples import mnist1d

train_df, test_df = mnist1d.generate(spark, num_samples=5_000)
common = dict(num_workers=2, epochs=4, batch_size=50, optimizer="adam", lr=1e-3,
              log_model=False)  # comparing runs, not serving models

# COMMAND ----------

variants = {
    "sync": TrainConfig(mode="sync", averaging_frequency=8, run_name="sync", **common),
    "async downpour": TrainConfig(mode="async", algorithm="downpour", push_every=8,
                                  eval_interval_s=2.0, run_name="async downpour", **common),
    "async dcasgd-adaptive": TrainConfig(mode="async", algorithm="dcasgd-adaptive",
                                         push_every=8, eval_interval_s=2.0,
                                         run_name="async dcasgd-adaptive", **common),
}
results = {name: fit(train_df, mnist1d.mlp((256, 256)), config, eval_df=test_df)
           for name, config in variants.items()}

# COMMAND ----------

# MAGIC %md
# MAGIC ## The comparison
# MAGIC The table below is what MLflow's compare view shows: select the three runs in the
# MAGIC Experiment panel and press Compare to see their curves on one chart (x axis: round).

# COMMAND ----------

run_ids = [r.run_id for r in results.values()]
ids = ", ".join(f"'{i}'" for i in run_ids)
runs = mlflow.search_runs(search_all_experiments=True,
                          filter_string=f"attributes.run_id IN ({ids})")
display(runs[["tags.mlflow.runName", "params.mode", "params.algorithm",
              "metrics.eval_accuracy", "metrics.time_total_s"]])

# COMMAND ----------

for name, result in results.items():
    final = result.history[-1]
    print(f"{name:>22}: accuracy {final['eval_accuracy']:.3f}, "
          f"{result.timings['total_s']:.1f} s, run {result.run_id}")
