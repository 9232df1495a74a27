"""Scoring with a trained model: the DataFrame's input columns read as the fit read them
(`columns`), the model's outputs written as Spark columns (`outputs`), on the executors
(`udf`)."""
