"""The replica: a task's model, optimizer, loss and data, and the local steps of the shared
schedule. Random state is a function of (seed, worker, step), so a restart from a checkpoint
draws exactly what the uninterrupted run drew."""

from __future__ import annotations

import numpy as np

from sparkdl_avg._config import TrainConfig
from sparkdl_avg.data.order import batch_slice, epoch_order
from sparkdl_avg.data.partition import Partition
from sparkdl_avg.task.evaluate import evaluate
from sparkdl_avg.task.spec import WorkerSpec


def step_seed(seed: int, rank: int, step: int) -> int:
    """The torch seed of worker `rank` from local step `step` on (-1: building the model)."""
    return int(np.random.SeedSequence([seed, rank, step + 1]).generate_state(1, np.uint64)[0]
               >> 1)


class Replica:
    def __init__(self, spec: WorkerSpec, config: TrainConfig, rank: int, data: Partition,
                 device) -> None:
        import cloudpickle
        import torch

        from sparkdl_avg._model import make_loss, model_dtype
        from sparkdl_avg.averaging.flat_buffer import wire_dtype

        torch.manual_seed(step_seed(config.seed, rank, -1))
        self.model = cloudpickle.loads(spec.model_fn)().to(device)
        self.dtype = model_dtype(self.model)
        x_train, x_eval = data.x_train.to(self.dtype), data.x_eval.to(self.dtype)
        y_train, y_eval = data.y_train, data.y_eval
        if not spec.long_labels:
            y_train, y_eval = y_train.to(self.dtype), y_eval.to(self.dtype)
        self.train_data, self.eval_data = (x_train, y_train), (x_eval, y_eval)
        self.wire_dtype = wire_dtype(self.dtype)
        self.loss_fn, _ = make_loss(cloudpickle.loads(spec.loss))
        self.optimizer = None
        self.config, self.schedule, self.classify = config, spec.schedule, spec.classify
        self.rank, self.device = rank, device
        self.step, self._order = 0, None

    def start(self, step: int = 0) -> None:
        """After the initial parameters are in: build the optimizer, enter training mode, and
        take up the data at `step` (a restart continues where its checkpoint left off)."""
        from sparkdl_avg._model import make_optimizer

        self.model.train()
        self.optimizer = make_optimizer(self.config, self.model.parameters())
        self.step, self._order = step, None

    def rewind(self, step: int) -> None:
        """Take up the data at `step` again (steps after it were lost with a server)."""
        self.step, self._order = step, None

    def run_steps(self, count: int) -> tuple[float, int]:
        """`count` local minibatch steps; returns (summed loss x batch size, samples)."""
        import torch

        cfg = self.config
        x, y = self.train_data
        n_rows = x.shape[0]
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        samples = 0
        torch.manual_seed(step_seed(cfg.seed, self.rank, self.step))
        for _ in range(count):
            epoch, in_epoch = divmod(self.step, self.schedule.steps_per_epoch)
            if in_epoch == 0 or self._order is None:
                self._order = torch.from_numpy(epoch_order(
                    n_rows, epoch=epoch, worker=self.rank, seed=cfg.seed, shuffle=cfg.shuffle,
                )).to(self.device)
            idx = self._order[batch_slice(in_epoch, cfg.batch_size, n_rows)]
            self.optimizer.zero_grad(set_to_none=True)
            loss = self.loss_fn(self.model(x[idx]), y[idx])
            loss.backward()
            self.optimizer.step()
            loss_sum += loss.detach().double() * idx.numel()
            samples += idx.numel()
            self.step += 1
        return float(loss_sum), samples

    def evaluate(self) -> dict:
        return evaluate(self.model, *self.eval_data, self.loss_fn, self.classify)
