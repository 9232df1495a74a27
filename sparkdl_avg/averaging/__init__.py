"""Averaging the replicas. `arithmetic`: the pure weighted average, divergence and finiteness
checks. `flat_buffer`: a replica's tensors in one contiguous buffer that moves as one block.
`optimizer_state`: which optimizer state is averaged with the parameters. The "driver"
transport: `coordinator` (the driver's side, a TCP server) and `driver_channel` (a task's
side), behind the task-side interface in `transport`."""
