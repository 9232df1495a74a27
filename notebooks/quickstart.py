# Databricks notebook source
# MAGIC %md
# MAGIC # sparkdl-avg quickstart: MNIST-1D by parameter averaging
# MAGIC
# MAGIC Train an MLP on MNIST-1D across this cluster's executors: each executor trains a full
# MAGIC replica on its partition (on its GPU when it has one), and every few minibatches the
# MAGIC driver averages the replicas. The run lands in this notebook's MLflow experiment.
# MAGIC
# MAGIC Needs a cluster with Spark 4.3+ (Databricks Runtime with it), with autoscaling off:
# MAGIC training runs as one barrier stage. Either access mode works: dedicated (a classic
# MAGIC session) or standard (a Spark Connect session); this notebook runs unchanged in our CI on
# MAGIC both kinds of session (a local Spark and a Spark Connect server), not on Databricks
# MAGIC itself. The driver node hosts the averaging, so the executors must reach it: they do on
# MAGIC a Databricks cluster. The next cell
# MAGIC installs the wheel you built (`pip wheel --no-deps . -w dist`) and uploaded to a
# MAGIC Volume; change the path to yours.

# COMMAND ----------

# MAGIC %pip install "/Volumes/main/default/libs/sparkdl_avg-0.1.0-py3-none-any.whl[examples]"

# COMMAND ----------

dbutils.library.restartPython()

# COMMAND ----------

# MAGIC %md
# MAGIC ## Data
# MAGIC MNIST-1D is generated on the driver (a few seconds) and handed to Spark through Arrow.
# MAGIC Any DataFrame with an array (or vector) features column and a numeric label works the same.

# COMMAND ----------

from sparkdl_avg import TrainConfig, fit
from sparkdl_avg.examples import mnist1d

train_df, test_df = mnist1d.generate(spark, num_samples=5_000)
display(train_df.limit(5))

# COMMAND ----------

# MAGIC %md
# MAGIC ## Train
# MAGIC `num_workers` replicas run at once, one Spark task each: keep it at most the cluster's
# MAGIC task slots (GPUs on a GPU cluster), or `fit` says how many there are.

# COMMAND ----------

config = TrainConfig(num_workers=2, epochs=5, batch_size=50, averaging_frequency=8,
                     optimizer="adam", lr=1e-3, eval_every=5, run_name="quickstart")
result = fit(train_df, mnist1d.mlp((256, 256)), config, eval_df=test_df)
final = result.history[-1]
print(f"test accuracy {final['eval_accuracy']:.3f} after {final['round']} rounds, "
      f"MLflow run {result.run_id}")

# COMMAND ----------

# MAGIC %md
# MAGIC ## Look at the run
# MAGIC Open the run from the Experiment panel on the right: per-round `train_loss`,
# MAGIC `eval_accuracy` and the time split of each round, and under Artifacts the pictures
# MAGIC `plots/learning_curves.png` and `plots/worker_timeline.png` and the logged model.

# COMMAND ----------

display(spark.createDataFrame(result.history).select(
    "round", "train_loss", "eval_accuracy", "time_compute_s", "time_communication_s"))

# COMMAND ----------

# MAGIC %md
# MAGIC ## Score a DataFrame on the executors

# COMMAND ----------

scored = result.transform(test_df, output_col="prediction")
accuracy = scored.selectExpr("avg(CAST(prediction = label AS DOUBLE)) AS accuracy").first()[0]
print(f"accuracy of the scored DataFrame: {accuracy:.3f}")
display(scored.limit(10))
