"""One benchmark run across processes or machines with torchrun (DistributedDataParallel).

::

    torchrun --nproc_per_node 2 -m posenc.bench.ddp --task order --encoding rope --steps 300 --store results.sqlite
    torchrun --nnodes 2 --node_rank R --master_addr HOST --nproc_per_node 8 -m posenc.bench.ddp --config run.json ...
    torchrun --nproc_per_node 2 -m posenc.bench.ddp --import my_tasks.py --task my-task --encoding rope

Every rank builds the same model and draws the same batches from the same seed;
each keeps its share of the rows (:func:`posenc.bench.distributed.shard`) and DDP
averages the gradients, so the run is the same run as on one process (the same batches
and, in exact arithmetic, the same full-batch gradient at every step). Rank 0 writes the result (to ``--store`` or
``--result-json``); every rank checks that its parameters equal rank 0's at the end.
The backend is gloo (CPU) unless ``--backend nccl`` is given.

The numbers are not bit for bit a local run's, and cannot be: each rank sums its half of the batch and the ranks'
sums are added, in another order than one process adds them, with other threads. Training amplifies such
last-bit differences, as it does another CPU's or another thread count's: at the longest (extrapolation) lengths
two such runs of one seed can differ by several points of accuracy. Randomized positions and attention dropout
also draw per rank, for the rank's rows. The record says so (``extra.ddp``: ``data_parallel``, ``threads``,
``numerics``): compare a DDP run's numbers with other seeds' spread, not with one local run's. A task whose
loop does not call :func:`~posenc.bench.distributed.ddp_wrap` (the built-in language-modelling, tagging, text and
context-extension tasks among them) is run whole on every rank: ``data_parallel`` is then false and rank 0 says
so on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from ..errors import ConfigError
from .api import describe_error, load_tasks, run_one
from .distributed import last_wrapped, parameter_checksum
from .types import Job, RunConfig


def _config(args: argparse.Namespace) -> RunConfig:
    if args.config:
        return RunConfig.from_dict(json.loads(Path(args.config).read_text()))
    d: dict = {"task": args.task, "encoding": args.encoding, "seed": args.seed}
    for k in ("steps", "batch_size", "d_model", "n_layers", "n_heads"):
        if getattr(args, k) is not None:
            d[k] = getattr(args, k)
    if args.train_lengths:
        d["train_lengths"] = tuple(args.train_lengths)
    if args.test_lengths:
        d["test_lengths"] = tuple(args.test_lengths)
    return RunConfig(**d)


def _numerics(data_parallel: bool, world: int) -> str:
    """What a DDP run's numbers are, against a local run of the same config (stored in ``extra.ddp.numerics``)."""
    if data_parallel:
        return (
            f"data parallel over {world} ranks: the local run's batches and full-batch gradient, summed in another "
            "order (and with other threads) than one process sums them; training amplifies such rounding, so the "
            "metrics can differ from a local run of this seed as much as from a run on another CPU (randomized "
            "positions and dropout also draw per rank)"
        )
    return (
        f"not data parallel: the task's loop does not call posenc.bench.executors.ddp_wrap, so each of the {world} "
        "ranks ran the whole run alone (a local run with this process's threads); make the loop use ddp_wrap(model), "
        "shard(*batch) and mean_over_ranks(loss), or run it without --ddp"
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m posenc.bench.ddp", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="a RunConfig as JSON (instead of the flags below)")
    p.add_argument("--task", default="order")
    p.add_argument("--encoding", default="sinusoidal")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int)
    p.add_argument("--batch-size", dest="batch_size", type=int)
    p.add_argument("--d-model", dest="d_model", type=int)
    p.add_argument("--n-layers", dest="n_layers", type=int)
    p.add_argument("--n-heads", dest="n_heads", type=int)
    p.add_argument("--train-lengths", nargs=2, type=int)
    p.add_argument("--test-lengths", nargs="+", type=int)
    p.add_argument("--store", help="SQLite results store rank 0 writes the run to")
    p.add_argument("--result-json", help="file rank 0 writes {record, error} to (used by posenc bench --ddp)")
    p.add_argument("--backend", default="gloo")
    p.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MODULE|FILE",
        help="a module of tasks of your own to import first (repeatable)",
    )
    args = p.parse_args(argv)
    if args.imports:
        load_tasks(*args.imports)

    dist.init_process_group(backend=args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    record, error = None, None
    try:
        cfg = _config(args)
        if cfg.batch_size % world:
            raise ConfigError(f"batch_size={cfg.batch_size} must be divisible by the {world} DDP ranks")
        record = run_one(cfg)
        model = last_wrapped()
        sums = [0.0] * world
        if model is not None:
            dist.all_gather_object(sums, parameter_checksum(model))
        record["extra"] = {
            **record.get("extra", {}),
            "ddp": {
                "world_size": world,
                "backend": args.backend,
                "wrapped": model is not None,
                "data_parallel": model is not None,
                "threads": torch.get_num_threads(),
                "numerics": _numerics(model is not None, world),
                "parameter_checksums": sums,
                "in_sync": model is not None and all(abs(s - sums[0]) <= 1e-9 * max(1.0, abs(sums[0])) for s in sums),
            },
        }
    except Exception as exc:  # noqa: BLE001 -- reported by rank 0
        error = describe_error(exc)
    if rank == 0:
        if args.result_json:
            Path(args.result_json).write_text(json.dumps({"record": record, "error": error}))
        if args.store and record is not None:
            from .store import open_store

            open_store(args.store).add({**record, "label": Job(RunConfig.from_dict(record["config"])).label})
        if error:
            print(f"posenc.bench.ddp: {error}", file=sys.stderr)
        elif record is not None and not record["extra"]["ddp"]["data_parallel"]:
            print(f"posenc.bench.ddp: {record['extra']['ddp']['numerics']}", file=sys.stderr)
        if not error:
            print(json.dumps({"key": record["key"], "metrics": record["metrics"], "ddp": record["extra"]["ddp"]}))
    dist.destroy_process_group()
    return 0 if error is None else 1


if __name__ == "__main__":
    sys.exit(main())
