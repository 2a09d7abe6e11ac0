"""The state of a fine-tuning run (:mod:`posenc.extend.finetune`): the checkpoint (trained parameters, optimizer,
scheduler, RNG states, step), written whole then renamed; the loss curve, one JSON line a step; and the few
``torch.distributed`` calls a sharded step makes (none where no process group is initialised)."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

from ..errors import ConfigError

_STATE_VERSION = 1
CHECKPOINT = "finetune-state.pt"
CURVE = "finetune-curve.jsonl"


# ---------------------------------------------------------------------------------------------- distributed
def world() -> tuple[int, int]:
    """``(rank, world size)`` of the initialised process group, ``(0, 1)`` without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_reduce(tensor: Any) -> Any:
    """Sum ``tensor`` over the ranks in place (nothing on one process); returns it."""
    import torch.distributed as dist

    if world()[1] > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def broadcast(tensor: Any) -> Any:
    """Rank 0's ``tensor`` on every rank, in place (nothing on one process); returns it."""
    import torch.distributed as dist

    if world()[1] > 1:
        dist.broadcast(tensor, src=0)
    return tensor


def barrier() -> None:
    """Wait for every rank (nothing on one process)."""
    import torch.distributed as dist

    if world()[1] > 1:
        dist.barrier()


# ---------------------------------------------------------------------------------------------- checkpoints
def trainable(model: Any) -> dict[str, Any]:
    """The parameters that train, by name (every weight in full mode; LoRA's adapters with peft)."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def rng_state() -> dict[str, Any]:
    """torch's and Python's random states (and CUDA's where it is in use)."""
    import torch

    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Put back the states :func:`rng_state` returned."""
    import torch

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(path: Path, step: int, model: Any, optimizer: Any, scheduler: Any, settings: dict[str, Any],
                    extra: dict[str, Any]) -> None:
    """Write the run's state after ``step`` steps to ``path``: whole to a temporary file, then renamed over it."""
    import torch

    state = {
        "version": _STATE_VERSION,
        "step": step,
        "settings": settings,
        "trainable": {n: p.detach().clone() for n, p in trainable(model).items()},
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": rng_state(),
        "extra": extra,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path, settings: dict[str, Any]) -> dict[str, Any] | None:
    """The state stored at ``path`` (``None`` where there is none). A checkpoint of other settings is refused, by
    the fields that differ, rather than continued as if it were this run's."""
    import torch

    if not path.is_file():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # a damaged file: said, not read as a run
        raise ConfigError(f"{path} is not a readable fine-tuning checkpoint ({e}); remove it or resume=False") from e
    if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
        raise ConfigError(f"{path} is not a posenc fine-tuning checkpoint of this version; remove it or resume=False")
    mine, theirs = settings, state["settings"]
    free = {"save_every", "eval_every"}
    if mine.get("schedule") == "constant" and int(state.get("step", 0)) <= int(mine.get("steps", 0)):
        free.add("steps")  # a constant rate after the warmup: going on to more steps changes no step already run
    differ = sorted(k for k in set(mine) | set(theirs) if k not in free and mine.get(k) != theirs.get(k))
    if differ:
        said = ", ".join(f"{k}: stored {theirs.get(k)!r}, asked {mine.get(k)!r}" for k in differ)
        raise ConfigError(
            f"{path} holds a fine-tuning run of other settings ({said}); give another out folder or resume=False"
        )
    return state


def read_curve(path: Path, upto: int) -> list[dict[str, Any]]:
    """The curve's records of steps ``<= upto`` (a line cut by an interrupted write is left out: redone)."""
    if not path.is_file():
        return []
    out = []
    for raw in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(raw)
        except json.JSONDecodeError:
            continue  # a line cut by an interrupted write: its step is run again
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] <= upto:
            out.append(rec)
    return out


def write_curve(path: Path, curve: list[dict[str, Any]]) -> None:
    """Write the curve whole (a temporary file renamed over it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in curve), encoding="utf-8")
    os.replace(tmp, path)


def append_curve(path: Path, record: dict[str, Any]) -> None:
    """Append one step's record and flush it to disk."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
