"""The driver's side of a fit: the plan (`plan`), the cluster checks (`cluster`), the barrier
job of training tasks (`barrier`), the one restart loop (`restarts`), checkpoints and resume
(`checkpoints`), and the two modes' drivers (`sync`, `asynchronous`)."""
