# Databricks notebook source
# MAGIC %md
# MAGIC # A recommender: user and item ids, side features, weighted ratings, served by MLflow
# MAGIC
# MAGIC A model with three inputs of three kinds: a user id and an item id (integers, each into
# MAGIC an `nn.Embedding`) and a dense vector of side features (the context of the rating).
# MAGIC `fit` binds DataFrame columns to `forward`'s parameters by name, weights each row by a
# MAGIC column, and logs a model that MLflow serves from a pandas DataFrame of the same columns.
# MAGIC
# MAGIC The data is synthetic with a known structure, so we can tell whether the model found
# MAGIC it: rating = user factors . item factors + side features . w + noise. A fifth of the
# MAGIC ratings came from an unreliable import and carry large errors: they get weight 0.05.
# MAGIC
# MAGIC Needs a cluster with Spark 4.3+ and autoscaling off (see the quickstart notebook). The
# MAGIC next cell installs the wheel you built and uploaded to a Volume; change the path to yours.

# COMMAND ----------

# MAGIC %pip install "/Volumes/main/default/libs/sparkdl_avg-0.1.0-py3-none-any.whl[examples]"

# COMMAND ----------

dbutils.library.restartPython()

# COMMAND ----------

# MAGIC %md
# MAGIC ## Data, made in Spark
# MAGIC Each user and item has 4 hidden factors; each rating has 3 side features with known
# MAGIC weights. `weight` is 1 for trusted rows and 0.05 for the unreliable ones.

# COMMAND ----------

from pyspark.sql import functions as F

USERS, ITEMS, FACTORS, SIDE_WEIGHTS, NOISE = 300, 100, 4, (0.5, -1.0, 0.25), 0.1


def factors(n: int, name: str, seed: int):
    """n rows of (name_id, name_f): an int id and its hidden factors."""
    return spark.range(n).select(
        F.col("id").cast("int").alias(f"{name}_id"),
        F.array(*[F.randn(seed + j) / FACTORS ** 0.25 for j in range(FACTORS)]).alias(f"{name}_f"))


def dot(a, b):
    return F.aggregate(F.zip_with(a, b, lambda x, y: x * y), F.lit(0.0), lambda s, x: s + x)


ratings = (
    spark.range(12_000).select(
        F.col("id").alias("rating_id"),
        (F.rand(1) * USERS).cast("int").alias("user_id"),
        (F.rand(2) * ITEMS).cast("int").alias("item_id"),
        F.array(*[F.randn(3 + j) for j in range(len(SIDE_WEIGHTS))]).alias("side"),
        (F.rand(7) < 0.2).alias("unreliable"), F.randn(8).alias("e"))
    .join(F.broadcast(factors(USERS, "user", 10)), "user_id")
    .join(F.broadcast(factors(ITEMS, "item", 20)), "item_id")
    .select(
        "rating_id", "user_id", "item_id", F.col("side").cast("array<float>").alias("features"),
        (dot("user_f", "item_f") + dot("side", F.array(*map(F.lit, SIDE_WEIGHTS)))
         + F.col("e") * F.when(F.col("unreliable"), 3.0).otherwise(NOISE)).alias("rating"),
        F.when(F.col("unreliable"), 0.05).otherwise(1.0).alias("weight"),
        "unreliable"))
train_df, test_df = ratings.randomSplit([0.9, 0.1], seed=0)
train_df, test_df = train_df.cache(), test_df.where(~F.col("unreliable")).cache()
display(train_df.limit(5))

# COMMAND ----------

# MAGIC %md
# MAGIC ## The model
# MAGIC `forward`'s parameters are the names `inputs` binds: `user` and `item` arrive as int64
# MAGIC tensors `[B]`, `side` as float32 `[B, 3]`. It returns one rating a row, `[B]`.

# COMMAND ----------

import torch
from torch import nn


class Recommender(nn.Module):
    def __init__(self, users: int, items: int, dim: int, side: int) -> None:
        super().__init__()
        self.user, self.item = nn.Embedding(users, dim), nn.Embedding(items, dim)
        self.side = nn.Linear(side, 1)
        for table in (self.user, self.item):  # small factors: the first dot products near 0
            nn.init.normal_(table.weight, std=0.1)

    def forward(self, user, item, side):
        return (self.user(user) * self.item(item)).sum(-1) + self.side(side).squeeze(-1)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return Recommender(USERS, ITEMS, dim=8, side=len(SIDE_WEIGHTS))

# COMMAND ----------

# MAGIC %md
# MAGIC ## Train: inputs bound by name, rows weighted
# MAGIC The loss is the weighted mean of the rows' squared errors: a row of weight 0.05 counts as
# MAGIC a twentieth of a trusted one.

# COMMAND ----------

from sparkdl_avg import TrainConfig, fit

config = TrainConfig(num_workers=2, epochs=5, batch_size=64, optimizer="adam", lr=0.03,
                     averaging_frequency=8, run_name="recommender")
result = fit(train_df, make_model, config,
             inputs={"user": "user_id", "item": "item_id", "side": "features"},
             label_col="rating", weight_col="weight", loss="mse", eval_df=test_df)
mean = train_df.where(~F.col("unreliable")).agg(F.avg("rating")).first()[0]
baseline = test_df.agg(F.sqrt(F.avg((F.col("rating") - mean) ** 2))).first()[0]
print(f"held-out RMSE {result.history[-1]['eval_loss'] ** 0.5:.3f} (the noise: {NOISE}; "
      f"predicting the mean: {baseline:.3f}), MLflow run {result.run_id}")

# COMMAND ----------

# MAGIC %md
# MAGIC ## The same fit without the weights
# MAGIC Every row counting the same, the unreliable fifth pulls the model off the structure.

# COMMAND ----------

import dataclasses

unweighted = fit(train_df, make_model,
                 dataclasses.replace(config, run_name="recommender-unweighted", log_model=False),
                 inputs={"user": "user_id", "item": "item_id", "side": "features"},
                 label_col="rating", loss="mse", eval_df=test_df)
print(f"held-out RMSE without the weights {unweighted.history[-1]['eval_loss'] ** 0.5:.3f}")

# COMMAND ----------

# MAGIC %md
# MAGIC ## Serve it: the logged model on a pandas DataFrame, and `transform` on Spark
# MAGIC The logged model's signature lists the three inputs by the columns the fit read
# MAGIC (`user_id` int32, `item_id` int32, `features` float32 [3]); MLflow's pyfunc takes a
# MAGIC pandas DataFrame with those columns (the side features an array per cell), as a
# MAGIC serving endpoint would.
# MAGIC `result.transform` scores a Spark DataFrame on the executors, reading the columns the
# MAGIC fit read. Both give the same ratings.

# COMMAND ----------

import mlflow
import numpy as np

served = mlflow.pyfunc.load_model(f"runs:/{result.run_id}/model")
requests = test_df.orderBy("rating_id").limit(200)
# the signature names the inputs by the columns the fit read: user_id, item_id, features
request = requests.select("user_id", "item_id", "features")
from_mlflow = np.asarray(served.predict(request.toPandas()), dtype=np.float64).reshape(-1)
from_spark = (result.transform(requests).orderBy("rating_id").select("prediction")
              .toPandas()["prediction"].to_numpy())
print(f"largest difference between MLflow's and transform's ratings: "
      f"{np.abs(from_mlflow - from_spark).max():.2e} over {len(from_spark)} rows")
display(result.transform(requests).select("user_id", "item_id", "rating", "prediction"))
