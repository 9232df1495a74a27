"""Everything that runs inside a Spark training task: the entry point (`entry.run_task`), what
it receives (`spec`) and reports (`report`), its device (`device`), the replica (`replica`),
the two training loops (`sync_loop`, `async_loop`), evaluation (`evaluate`) and the state a
worker hands to checkpoints (`worker_state`). Heavy imports happen inside the task."""
