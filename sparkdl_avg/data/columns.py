"""The columns of a prepared partition, as `prepare` writes them and `partition` reads them."""

FEATURES, LABEL, INDEX, SPLIT = "features", "label", "_row", "_split"
"""array<float|double> features, the label, the global row number, train or eval."""
TRAIN, EVAL = 0, 1
"""Values of SPLIT."""
