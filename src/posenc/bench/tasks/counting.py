"""The counting task of CoPE (Golovneva et al. 2024, "Contextual Position Encoding"), at reduced length.

A program of ``N`` statements (``N`` = the *input length*) over ``vars``
variables, followed by a print statement; the answer is the printed value::

    x = 0 ; pass ; pass ; x ++ ; y = 0 ; pass ; x ++ ; y ++ ; pass ; print x   ->   2

As in the paper's data generator, each statement is drawn with weights
``(set, pass, increment)``: ``set`` assigns 0 to a uniformly chosen variable,
``pass`` does nothing (a distractor), ``increment`` adds one to a variable
already set (uniform among them) unless that would exceed ``max_value``
(otherwise the statement is drawn again); the printed variable is uniform among
the variables set, and a program in which none was set is drawn again. To
answer, a model must find the last assignment of the printed variable and count
its increments since then -- counting statements, not tokens, which is what
CoPE's contextual positions are for.

The paper's weights are 1 : 50 : 7 for programs of up to 512 statements; our
default, 1 : 10 : 3, keeps a few assignments and increments in programs of
10-80 statements (``task_options={"weights": [1, 50, 7]}`` restores the paper's).

Tokens: ``x = 0 ;`` is 4 tokens, ``pass ;`` 2 and ``x ++ ;`` 3; the answer is one
value token ``0 .. max_value``. Default model: a decoder.
"""

from __future__ import annotations

import random
from typing import Any

from ...errors import ConfigError
from ..seq_training import FIRST, Example, SeqTask
from ..types import RunConfig, register_task

EQ, INC, SEMI, PASS, PRINT = FIRST, FIRST + 1, FIRST + 2, FIRST + 3, FIRST + 4
VAL0 = FIRST + 5  # value tokens VAL0 .. VAL0 + max_value; variables follow


def var0(opts: dict[str, Any]) -> int:
    """Token id of the first variable."""
    return VAL0 + opts["max_value"] + 1


@register_task
class CountingTask(SeqTask):
    name = "counting"
    description = "a program of set/pass/increment statements: the printed variable's value (CoPE's counting task)"
    metric = "accuracy"
    default_model = "decoder"
    # decoder runs read a BOS token first since 2026-11-23 (docs/diagnosis-kazemnejad.md): runs stored before
    # have other keys and are trained again, not reused
    version = "bos"
    multi_token = False
    defaults = {"vars": 3, "max_value": 10, "weights": (1.0, 10.0, 3.0)}

    def check_options(self, cfg: RunConfig, opts: dict[str, Any]) -> None:
        if not 1 <= opts["vars"] <= 26:
            raise ConfigError(f"task 'counting': vars must be in 1..26, got {opts['vars']}")
        if opts["max_value"] < 1:
            raise ConfigError(f"task 'counting': max_value must be >= 1, got {opts['max_value']}")
        w = opts["weights"]
        if (
            len(w) != 3
            or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0 for x in w)
            or w[0] <= 0
        ):
            raise ConfigError(
                f"task 'counting': weights must be three numbers >= 0 (set, pass, increment) with set > 0, got {w!r}"
            )

    def vocab_size(self, opts: dict[str, Any]) -> int:
        return var0(opts) + opts["vars"]

    def max_total(self, n: int, opts: dict[str, Any]) -> int:
        return 4 * n + 2 + 1 + 1

    def example(self, n: int, rng: random.Random, opts: dict[str, Any]) -> Example:
        v0, n_vars, top = var0(opts), opts["vars"], opts["max_value"]
        weights = [float(x) for x in opts["weights"]]
        for _ in range(1000):
            values: dict[int, int] = {}
            tokens: list[int] = []
            for _ in range(n):
                for _ in range(100):
                    op = rng.choices((0, 1, 2), weights)[0]
                    if op == 0:
                        var = rng.randrange(n_vars)
                        values[var] = 0
                        tokens += [v0 + var, EQ, VAL0, SEMI]
                        break
                    if op == 1:
                        tokens += [PASS, SEMI]
                        break
                    if values:
                        var = rng.choice(sorted(values))
                        if values[var] < top:
                            values[var] += 1
                            tokens += [v0 + var, INC, SEMI]
                            break
                else:
                    raise ConfigError(f"task 'counting': could not draw a statement with weights {weights}")
            if values:
                var = rng.choice(sorted(values))
                return tokens + [PRINT, v0 + var], [VAL0 + values[var]]
        raise ConfigError(
            f"task 'counting': no variable was set in 1000 programs of {n} statements; "
            f"raise the 'set' weight (weights={weights}) or the input length"
        )
