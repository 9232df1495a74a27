import sparkdl_avg


def test_public_names_are_exactly_the_documented_surface():
    assert sorted(sparkdl_avg.__all__) == sorted([
        "ClusterError", "ConfigError", "DataCacheError", "DataError", "EarlyStopping",
        "FitResult", "Metric", "ModelError", "PreprocessError",
        "ProtocolError", "SPARK_CONF",
        "SparkdlAvgError", "TrainConfig", "TrainingError", "__version__", "fit", "local_session",
    ])
    for name in sparkdl_avg.__all__:
        assert hasattr(sparkdl_avg, name)


def test_every_error_derives_from_the_base():
    for name in ("ClusterError", "ConfigError", "DataCacheError", "DataError", "ModelError",
                 "PreprocessError", "ProtocolError",
                 "TrainingError"):
        assert issubclass(getattr(sparkdl_avg, name), sparkdl_avg.SparkdlAvgError)
