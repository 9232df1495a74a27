"""The regime DC-ASGD is about: as updates grow staler, does plain asynchronous SGD degrade
where delay compensation keeps converging?

A forced delay schedule over the server's real update rules (`_async_rules.ServerState`), in
one process: W workers take turns round-robin, each computing one minibatch gradient at the
parameters it pulled on its previous turn (so every update is W-1 updates stale), pushing
lr*g, and pulling. Same data, model, seed, learning rate and number of updates for every rule.

    python bench/staleness.py [--updates 3000] [--lr 0.1]
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import report  # noqa: E402

from sparkdl_avg.ps.rules import ALGORITHMS, make_rule  # noqa: E402


def load_mnist1d():
    from mnist1d.data import get_dataset_args, make_dataset

    d = make_dataset(get_dataset_args())
    f = lambda a: torch.from_numpy(np.asarray(a, np.float32))  # noqa: E731
    return f(d["x"]), torch.from_numpy(d["y"]).long(), f(d["x_test"]), torch.from_numpy(
        d["y_test"]).long()


def run(algorithm: str, workers: int, updates: int, lr: float, data, seed: int = 0) -> dict:
    x, y, xt, yt = data
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(40, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10))
    params = list(model.parameters())
    flat = torch.nn.utils.parameters_to_vector(params).detach().double().numpy().copy()
    server = make_rule(algorithm, flat, lr=lr)  # each rule's default lambda
    stale = {w: server.pull(w).copy() for w in range(workers)}
    rng = np.random.default_rng(seed)
    for t in range(updates):
        w = t % workers
        torch.nn.utils.vector_to_parameters(torch.from_numpy(stale[w]).float(), params)
        idx = torch.from_numpy(rng.integers(0, len(x), 64))
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        g = torch.nn.utils.parameters_to_vector([p.grad for p in params]).double().numpy()
        server.apply(w, lr * g)
        if not np.isfinite(server.params).all():
            return {"test_accuracy": None, "test_loss": None, "diverged_at_update": t}
        stale[w] = server.pull(w).copy()
    torch.nn.utils.vector_to_parameters(torch.from_numpy(server.params).float(), params)
    with torch.no_grad():
        out = model(xt)
        return {"test_accuracy": float((out.argmax(1) == yt).float().mean()),
                "test_loss": float(torch.nn.functional.cross_entropy(out, yt))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--updates", type=int, default=3000)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--workers", default="1,4,16,32,64")
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = load_mnist1d()
    table = {}
    for workers in [int(w) for w in args.workers.split(",")]:
        for algorithm in ALGORITHMS:
            result = run(algorithm, workers, args.updates, args.lr, data)
            table[f"staleness={workers - 1} {algorithm}"] = result
            print(workers - 1, algorithm, result, flush=True)
    report("staleness", {"updates": args.updates, "lr": args.lr, "results": table})


if __name__ == "__main__":
    main()
