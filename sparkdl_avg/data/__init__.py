"""The data's way from the user's DataFrame into a task's tensors. `prepare`: the Spark side
(validation, row numbering, one partition per worker). `partition`: the task side (a
partition's Arrow batches to tensors on the task's device). `order`: which rows each worker
holds and which rows each step uses. `columns`: the names both sides agree on."""
