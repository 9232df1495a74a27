"""The replica: a task's model, optimizer, loss and data, and the local steps of the shared
schedule. Random state is a function of (seed, worker, step), so a restart from a checkpoint
draws exactly what the uninterrupted run drew."""

from __future__ import annotations

import numpy as np

from sparkdl_avg._config import TrainConfig
from sparkdl_avg.data.batches import TrainBatches
from sparkdl_avg.data.order import epoch_length, make_cut
from sparkdl_avg.data.partition import Partition
from sparkdl_avg.task.evaluate import evaluate_batches
from sparkdl_avg.task.spec import WorkerSpec


def step_seed(seed: int, rank: int, step: int) -> int:
    """The torch seed of worker `rank` from local step `step` on."""
    return int(np.random.SeedSequence([seed, rank, step + 1]).generate_state(1, np.uint64)[0]
               >> 1)


def check_frozen(model, expected: dict, rank: int) -> None:
    """Refuse (ModelError, final) a replica whose frozen tensors are not the driver's: they
    never travel, so replicas that differ there would average heads trained on different
    backbones."""
    from sparkdl_avg._errors import ModelError
    from sparkdl_avg.averaging.frozen import Fingerprint

    where = Fingerprint.from_dict(expected).difference(Fingerprint.of(model))
    if where is not None:
        raise ModelError(
            f"partition {rank} built other frozen weights than the driver's build of model_fn "
            f"({where}): frozen tensors are never sent, so every replica must build the same "
            "ones. Load them from a path every executor reads, and seed what model_fn draws "
            "at random (it runs under torch.manual_seed(TrainConfig.seed))")


def _check_device_memory(model, config: TrainConfig, row_bytes: int, device) -> None:
    """Fail before training, with the numbers, rather than out of memory in a round."""
    import torch

    from sparkdl_avg._errors import ClusterError
    from sparkdl_avg.averaging.flat_buffer import averaged_tensors
    from sparkdl_avg.task.device import device_shortfall

    slots = 2 if config.optimizer in ("adam", "adamw") else (1 if config.momentum else 0)
    if config.overlap_averaging:  # the exchange's two copies of the averaged buffer
        slots += 2 * (1 + (slots if config.average_optimizer_state else 0))
    problem = device_shortfall(
        # what trains: only it has gradients, optimizer state and a place in the flat buffer
        param_bytes=sum(t.numel() * t.element_size() for t in averaged_tensors(model)),
        optimizer_slots=slots, batch_bytes=config.batch_size * row_bytes,
        free_bytes=torch.cuda.mem_get_info(device)[0])
    if problem:
        raise ClusterError(f"{device}: {problem}")


def unfused_adam(config: TrainConfig, optimizer, dtype, device) -> str | None:
    """Why the built-in Adam (or AdamW) runs its per-tensor loop instead of the fused kernel
    it asked for (`_model.make_optimizer` falls back where the kernel is missing), or None."""
    import torch

    if config.optimizer not in ("adam", "adamw") or optimizer.defaults.get("fused"):
        return None
    return (f"fused Adam is unavailable for {dtype} parameters on {device.type} in torch "
            f"{torch.__version__}: the per-tensor Adam trains instead (about 2x slower a step "
            "on the CPU)")


class Replica:
    def __init__(self, spec: WorkerSpec, config: TrainConfig, rank: int, data: Partition,
                 device) -> None:
        import cloudpickle
        import torch

        from sparkdl_avg._model import heard_warnings, model_dtype, settle_modes
        from sparkdl_avg.averaging.flat_buffer import wire_dtype
        from sparkdl_avg.task.device import final_on_device_errors

        # as the driver builds it: what is frozen (never sent) comes out the same everywhere
        torch.manual_seed(config.seed)
        # model_fn's own error, not a ModelError: it built on the driver, so a failure here
        # (a shared path unreadable a moment) may pass on a restart. What its libraries warn
        # of (transformers', PEFT's) the driver showed once; each executor would repeat it
        with heard_warnings(replay=False) as heard:
            model = settle_modes(cloudpickle.loads(spec.model_fn)())
        self.warnings: list[str] = [f"model_fn warned: {w}" for w in dict.fromkeys(heard)
                                    if w not in spec.build_warnings]
        """What the driver should hear of (the task's report carries them)."""
        if spec.frozen is not None:  # on the host, before a GPU holds it
            check_frozen(model, spec.frozen, rank)
        with final_on_device_errors("move the model to", str(device)):
            self.model = model.to(device)
        self.dtype = model_dtype(self.model)
        self.data, self.schema = data, spec.model_schema or spec.schema
        self.preprocessor = _preprocessor(spec, config, rank, self.dtype, device)
        row_bytes = spec.schema.row_bytes(spec.ragged_values)
        # the same rows a chunk as the returned model scores (FitResult.score_rows)
        # sized by the rows the model gets: decoded, not as the bytes were carried
        self._eval_rows = config.eval_rows(self.schema.padded_row_bytes(spec.longest))
        self.batches = TrainBatches(
            data.train, cut=make_cut(row_bytes, config.shuffle_buffer_mb),
            seed=config.seed, worker=rank, shuffle=config.shuffle,
            batch_size=config.batch_size,
            steps_per_epoch=spec.schedule.micro_batches_per_epoch,
            total_steps=spec.schedule.total_micro_batches, device=device,
            epoch_rows=epoch_length(spec.train_rows), preprocess=self.preprocessor,
            threads=config.preprocess_threads, prefetch=config.prefetch_batches,
            # under the driver's round watchdog: the task says why before the driver gives up
            preprocess_timeout=0.8 * config.waits().round)
        self.wire_dtype = wire_dtype(self.dtype)
        if device.type == "cuda":
            _check_device_memory(self.model, config,
                                 self.schema.padded_row_bytes(spec.longest), device)
        self.objective = cloudpickle.loads(spec.loss)
        self.optimizer = self.steps = None
        self.config, self.schedule = config, spec.schedule
        self.rank, self.device = rank, device
        self.step = 0
        self.last_lr: float | None = None
        """The learning rate of the last optimizer step."""
        self.padded = self.positions = 0
        """Pad positions in the ragged inputs of the batches trained on, and all their
        positions (`pad_fraction`)."""

    def start(self, step: int = 0) -> None:
        """After the initial parameters are in: build the optimizer over what trains, and
        take up the data at `step` (a restart continues where its checkpoint left off). Each
        module trains in the mode `settle_modes` left it in."""
        from sparkdl_avg._model import make_optimizer
        from sparkdl_avg.task.optimizer_step import OptimizerSteps

        self.optimizer = make_optimizer(
            self.config, [p for p in self.model.parameters() if p.requires_grad])
        slower = unfused_adam(self.config, self.optimizer, self.dtype, self.device)
        if slower and slower not in self.warnings:
            self.warnings.append(slower)
        self.steps = OptimizerSteps(self.config, self.schedule, self.optimizer, self.model,
                                    self.device)
        self.rewind(step)

    def rewind(self, step: int) -> None:
        """Take up the data and the learning-rate schedule at optimizer step `step` (again,
        when steps after it were lost with a server)."""
        self.step = step
        self.batches.start(self.schedule.first_micro_batch(step))
        self.steps.at(step)

    def close(self) -> None:
        self.batches.close()

    def outcome(self) -> dict:
        """For the task's report: its warnings, the share of the ragged inputs' positions
        that were padding (None without ragged inputs), and the training thread's wait for
        minibatches."""
        return {"warnings": self.warnings,
                "pad_fraction": self.padded / self.positions if self.positions else None,
                "pad_positions": self.padded, "ragged_positions": self.positions,
                "batch_wait_s": self.batches.wait_s}

    def run_steps(self, count: int) -> tuple[float, int, float]:
        """`count` local optimizer steps; returns (summed loss x rows, rows, mean lr)."""
        import torch

        cfg = self.config
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        samples, lrs = 0, []
        torch.manual_seed(step_seed(cfg.seed, self.rank, self.step))
        for _ in range(count):
            step_loss, rows, lr = self.steps.run(self.step, self._next_batch,
                                                 self._forward_loss, self._weigh)
            loss_sum += step_loss
            samples += rows
            lrs.append(lr)
            self.last_lr = lr
            self.step += 1
        mean_lr = lrs[0] if len(set(lrs)) == 1 else sum(lrs) / len(lrs)  # exact when constant
        return float(loss_sum), samples, mean_lr

    def _next_batch(self):
        batch = self.batches.next()
        self.padded += batch.padded
        self.positions += batch.positions
        return batch

    def _weigh(self, batch):
        return self.objective.step_weight(batch.labels, batch.weights)

    def _forward_loss(self, batch):
        out = self.call(self.model, batch.inputs, self.objective.model_labels(batch.labels))
        return self.objective(out, batch.labels, batch.weights)

    def call(self, model, inputs, labels=None):
        """The model's output on a batch's inputs (`labels`: to forward, under
        loss="model"); an index out of an embedding's range (on the CPU: CUDA's device-side
        assert leaves no error to catch) is a final ModelError naming the integer inputs and
        the largest id each held."""
        try:
            return self.schema.call(model, inputs, labels)
        except IndexError as exc:
            if "out of range" not in str(exc):
                raise
            from sparkdl_avg._model import index_error

            raise index_error(self.schema, inputs, exc) from exc

    def evaluate(self) -> dict:
        if self.preprocessor is None:
            return evaluate_batches(self.model, self.data.eval.chunks(self._eval_rows),
                                    self.objective, self.call)
        from sparkdl_avg.data.feed import eval_feed

        # on a pool of its own (training's stays busy prefetching its steps), one chunk ahead
        args = self.batches.feed_args  # training's threads and timeout
        with eval_feed(self.data.eval, self._eval_rows, self.preprocessor, self.device,
                       threads=args["threads"], timeout=args["timeout"]) as chunks:
            return evaluate_batches(self.model, chunks, self.objective, self.call)


def _preprocessor(spec: WorkerSpec, config: TrainConfig, rank: int, dtype, device):
    """`fit(preprocess=)` as a `feed.Preprocessor`, or None."""
    if spec.preprocess is None:
        return None
    import cloudpickle

    from sparkdl_avg.data.feed import Preprocessor

    copied = device.type != "cpu"  # to a GPU: pinned, integers narrow until they are there
    return Preprocessor(cloudpickle.loads(spec.preprocess), spec.schema, spec.model_schema,
                        dtype, seed=config.seed, partition=rank, pin=device.type == "cuda",
                        narrow=copied)
