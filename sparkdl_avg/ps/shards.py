"""A sharded parameter server as pure functions: which slice of the flat parameters each of K
shards owns, the address list a user gives, and one report or answer from K.

Each shard is an ordinary parameter server holding its slice (`bounds`), so the update
rules, the staleness gates, checkpoints and restarts work per shard unchanged. Every worker
pushes each of its updates to every shard and waits for all of them before it goes on, so
every shard applies each worker's updates in that worker's order: the workers' progress and
the staleness bound's clocks agree across shards. Updates of *different* workers may
interleave differently on different shards, as they may arrive at one server in either
order; with `staleness_bound=0` every shard applies a round's pushes before any read, so
lockstep stays exactly synchronous.

One report from K (`merge_reports`): what counts updates is what *every* shard has
(`applied`, each worker's `progress` and clock: the minimum; `samples` and `loss_sum`: those
of the shard with the fewest applied); refusals are summed (each shard refuses on its own);
a worker's staleness is its most stale shard's, with `max` over all shards; `stopped` if any
shard stopped; a failed checkpoint save if any shard's failed (the first shard's, naming its
file); the evaluation requests and results are shard 0's (every worker answers every
shard with the same sums), a request pending only where every shard holds one.
"""

from __future__ import annotations

from sparkdl_avg._errors import ConfigError
from sparkdl_avg.net import messages as msg

MAX_SHARDS = 64
"""Each worker holds a connection and a thread per shard."""


def bounds(numel: int, shards: int) -> list[tuple[int, int]]:
    """Shard k owns the flat parameters [k*numel//shards, (k+1)*numel//shards): contiguous,
    in order, covering all, their sizes differing by at most one."""
    if shards < 1 or numel < shards:
        raise ConfigError(f"ps_shards={shards} needs a model of at least {shards} "
                          f"parameters (this one has {numel})")
    return [(k * numel // shards, (k + 1) * numel // shards) for k in range(shards)]


def shard_name(k: int, shards: int) -> str:
    """The name of shard k's checkpoint file (without .npz); one server keeps the old name."""
    return "parameter-server" if shards == 1 else f"parameter-server-{k}-of-{shards}"


def parse_addresses(text: str, name: str = "ps_address") -> list[tuple[str, int]]:
    """'host:port' or 'host:port,host:port,...' (shard order) as (host, port) pairs, each
    address once."""
    out = []
    for part in str(text).split(","):
        host, _, port = part.strip().rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"{name}={text!r} must be 'host:port', or for ps_shards > 1 a "
                              "comma-separated list of them in shard order")
        out.append((host, int(port)))
    if len(set(out)) != len(out):
        raise ConfigError(f"{name}={text!r} names an address twice: each shard is a server "
                          "of its own")
    return out


def merge_acks(acks: list[msg.Ack]) -> msg.Ack:
    """One answer from the shards that were asked (in shard order)."""
    if not acks:
        return msg.Ack(applied=0)
    offers = [a.evaluate for a in acks if a.evaluate is not None]
    return msg.Ack(applied=min(a.applied for a in acks),
                   staleness=max(a.staleness for a in acks),
                   evaluate=offers[0] if offers else None,
                   done=all(a.done for a in acks), stop=any(a.stop for a in acks))


def merge_reports(reports: list[dict]) -> dict:
    """One server's stats from K shards' (see the module's docstring for each rule), with a
    short per-shard summary under "shards"."""
    if len(reports) == 1:
        return reports[0]
    fewest = min(reports, key=lambda r: r["applied"])
    refused: dict[str, int] = {}
    for r in reports:
        for reason, n in r["refused"].items():
            refused[reason] = refused.get(reason, 0) + n
    staleness = {}
    for worker in sorted({w for r in reports for w in r["staleness"]}):
        views = [r["staleness"][worker] for r in reports if worker in r["staleness"]]
        worst = max(views, key=lambda s: s["mean"])
        staleness[worker] = {**worst, "max": max(s["max"] for s in views)}
    return {"applied": fewest["applied"], "refused": refused,
            "clocks": _least(r["clocks"] for r in reports),
            "progress": _least(r["progress"] for r in reports),
            "samples": fewest["samples"], "loss_sum": fewest["loss_sum"],
            "staleness": staleness, "evaluations": _evaluations(reports),
            "lr": reports[0]["lr"], "stopped": any(r["stopped"] for r in reports),
            "checkpoint_error": next((r["checkpoint_error"] for r in reports
                                      if r.get("checkpoint_error")), None),
            "shards": [{"applied": r["applied"], "progress": r["progress"],
                        "refused": r["refused"]} for r in reports]}


def _least(dicts) -> dict:
    """Per key, the least value; a key one shard lacks counts as 0 there."""
    dicts = list(dicts)
    keys = set().union(*dicts)
    return {k: min(d.get(k, 0) for d in dicts) for k in sorted(keys, key=int)}


def _evaluations(reports: list[dict]) -> dict:
    """Shard 0's requests and results. A request is pending only where every shard holds
    one; made at each shard's report's moment (the driver's EVALUATE reached them all), it
    counts as made at the merged `applied`; made at other moments, its `applied` is None,
    and the driver does not follow it."""
    first = dict(reports[0]["evaluations"])
    pendings = [r["evaluations"]["pending"] for r in reports]
    if None in pendings:
        first["pending"] = None
    elif not any(p["final"] for p in pendings):
        fresh = all(p["applied"] == r["applied"]
                    for p, r in zip(pendings, reports, strict=True))
        first["pending"] = {**pendings[0], "applied": min(r["applied"] for r in reports)
                            if fresh else None}
    return first
