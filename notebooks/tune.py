# Databricks notebook source
# MAGIC %md
# MAGIC # Tuning with Optuna: nested runs, pruning, the best model registered
# MAGIC
# MAGIC Optuna searches the learning rate and how often the replicas average. Every trial is a
# MAGIC fit, logged as a child of this notebook's tuning run; a trial whose evaluation loss
# MAGIC falls behind the others' at the same round is pruned through `fit(on_round=...)`, and
# MAGIC the best trial's model is registered in the MLflow Model Registry.
# MAGIC
# MAGIC Cluster and install: as in the quickstart (Spark 4.3+, dedicated or standard access
# MAGIC mode), with the `tune` extra for Optuna. CI runs this notebook on a classic session.

# COMMAND ----------

# MAGIC %pip install "/Volumes/main/default/libs/sparkdl_avg-0.1.0-py3-none-any.whl[examples,tune]"

# COMMAND ----------

dbutils.library.restartPython()

# COMMAND ----------

# MAGIC %md
# MAGIC ## Data
# MAGIC A small MNIST-1D, generated on the driver, so each trial takes seconds.

# COMMAND ----------

import mlflow
import optuna

from sparkdl_avg import TrainConfig, fit
from sparkdl_avg.examples import mnist1d

train_df, test_df = mnist1d.generate(spark, num_samples=2_000)
train_df, test_df = train_df.cache(), test_df.cache()

# COMMAND ----------

# MAGIC %md
# MAGIC ## The objective
# MAGIC Each trial trains with its own `lr` and `averaging_frequency`, evaluating every round.
# MAGIC `on_round` reports each round's `eval_loss` to Optuna and stops the fit once the
# MAGIC pruner says the trial is behind: the fit ends FINISHED with the history so far, tagged
# MAGIC `sparkdl_avg.stopped_by = on_round`.

# COMMAND ----------

EPOCHS = 2


def objective(trial: optuna.Trial) -> float:
    config = TrainConfig(
        num_workers=2, epochs=EPOCHS, batch_size=50, optimizer="adam",
        lr=trial.suggest_float("lr", 1e-4, 3e-2, log=True),
        averaging_frequency=trial.suggest_categorical("averaging_frequency", [4, 16]),
        eval_every=1, log_model=False, run_name=f"trial-{trial.number}")

    def report(metrics: dict) -> bool:
        trial.report(metrics["eval_loss"], step=metrics["round"])
        return trial.should_prune()

    result = fit(train_df, mnist1d.mlp((128,)), config, eval_df=test_df, on_round=report)
    trial.set_user_attr("run_id", result.run_id)
    if trial.should_prune():
        raise optuna.TrialPruned()
    return result.history[-1]["eval_loss"]


# COMMAND ----------

# MAGIC %md
# MAGIC ## Search, every trial a child of one tuning run
# MAGIC A fit started while a run is active, with no `experiment_name` of its own, becomes that
# MAGIC run's child. The first three trials are given rather than sampled: two sound settings,
# MAGIC whose rounds set the median, then a learning rate a hundred times too small, which
# MAGIC falls behind that median and is pruned once the warmup round has passed.

# COMMAND ----------

optuna.logging.set_verbosity(optuna.logging.WARNING)
study = optuna.create_study(direction="minimize", sampler=optuna.samplers.TPESampler(seed=0),
                            pruner=optuna.pruners.MedianPruner(n_startup_trials=2,
                                                               n_warmup_steps=1))
for lr in (1e-2, 3e-3, 1e-4):
    study.enqueue_trial({"lr": lr, "averaging_frequency": 4})
with mlflow.start_run(run_name="tune-lr-and-averaging") as tuning:
    study.optimize(objective, n_trials=4)
    mlflow.log_params({f"best_{k}": v for k, v in study.best_params.items()})
    mlflow.log_metric("best_eval_loss", study.best_value)

pruned = [t.number for t in study.trials if t.state == optuna.trial.TrialState.PRUNED]
print(f"best {study.best_params} eval_loss {study.best_value:.4f}; pruned trials {pruned}")

# COMMAND ----------

# MAGIC %md
# MAGIC ## Register the best model
# MAGIC The best trial's parameters, trained again with its model logged and registered as a
# MAGIC new version (`registered_model_name`); `fit` returns once the version is ready.

# COMMAND ----------

best = TrainConfig(num_workers=2, epochs=EPOCHS, batch_size=50, optimizer="adam",
                   eval_every=1, run_name="tuned-best",
                   registered_model_name="sparkdl-avg-mnist1d-tuned", **study.best_params)
with mlflow.start_run(run_id=tuning.info.run_id):
    final = fit(train_df, mnist1d.mlp((128,)), best, eval_df=test_df)
version = max(int(v.version) for v in mlflow.MlflowClient().search_model_versions(
    "name='sparkdl-avg-mnist1d-tuned'"))
print(f"registered sparkdl-avg-mnist1d-tuned version {version} from run {final.run_id}")
