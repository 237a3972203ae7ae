"""What every training process must do as often as the others, in one home.

The counts and sums the processes exchange for the trainer's bookkeeping go through here ([`gather_counts`],
[`sum_over_ranks`]): a gather one process skips leaves the others waiting in it, and a test plays several processes
by patching this module alone (tests/test_collective.py). Callers reach these functions through the module
(`collective.gather_counts(...)`), never by importing their names. Besides the teachers' calls below: the trainer's
bad-row check (`opd/rollouts.py`), its per-step selection counts (`opd/trainer.py`) and teacher metrics
(`opd/loss.py`), state selection (`opd/selection.py`), the teacher cache (`opd/cache.py`) and the records' teacher
tokens (`lens/recorder.py`). Tensors that travel whole (the loss's `num_items_in_batch`, the records' table, an EMA
teacher's ZeRO-3 shards) are gathered where they are used.

How many model calls a teacher makes on each training process: the same number on all of them.

Under DeepSpeed ZeRO-3 every forward of a partitioned model gathers each layer's shards from all processes, and so
does every call of a partitioned output layer, forward and backward: collectives that each process must join, as
many times as the others. A teacher's work per process is not the same everywhere: a [`TeacherRouter`] gives each
process its own number of rows per teacher, the `teacher` state source and `continuation` draw rows per process,
and a loss supervises a different number of positions on each. So every teacher call that reaches a model first
agrees with the other processes on how many calls to make ([`agreed_calls`], [`agreed_chunks`], [`any_rank_has`])
and makes exactly that many: a process with less work of its own makes the rest on stand-ins (a one-row forward
whose answer it drops, an empty chunk of positions).

Where (in `teachers/`): `InProcessTeacher.generate` (one call while any process has rows), `InProcessTeacher.score`
(chunks of the per-device batch size), `InProcessTeacher.divergence_loss` (one call while any process has rows), and
`ServedTeacher.divergence_loss` (the student's output layer, per `heads.POSITION_CHUNK` supervised positions). A
[`SelfTeacher`] scores, writes and computes its loss through the first three; a router asks each of its teachers on
every process, rows or none. A served teacher's scoring and writing are requests to its server, no collective.
With state selection (`skip_correct_rollouts`), `opd/selection.py`'s `divergence_on_scored_rows` hands a process
whose rows were all skipped a stand-in inside the student's graph (so its output layer's gradient is collective
there too) and calls the student's output layer once per micro-batch on every process.
"""

from __future__ import annotations

import math

import torch


def gather_counts(accelerator, count: int) -> list[int]:
    """Every process's `count`, in process order: one all-gather, none in a single process."""
    if accelerator.num_processes == 1:
        return [count]
    return accelerator.gather(torch.tensor([count], device=accelerator.device)).tolist()


def sum_over_ranks(accelerator, values: torch.Tensor) -> list:
    """The elementwise sum of every process's `values` (a 1-D tensor of the same length everywhere), as a list: one
    all-gather."""
    return accelerator.gather(values.to(accelerator.device)[None]).sum(0).tolist()


def any_rank_has(accelerator, count: int) -> bool:
    """Whether any process has something (`count`, this process's own) to make a call with: then every process makes
    it, on a stand-in where it has nothing."""
    return agreed_calls(accelerator, min(count, 1)) > 0


def agreed_calls(accelerator, count: int) -> int:
    """The number of calls every process makes: the most that any process needs (`count`, this process's own)."""
    return max(gather_counts(accelerator, count))


def agreed_chunks(accelerator, num_items: int, chunk_size: int) -> list[slice]:
    """`num_items` in slices of `chunk_size`, as many slices as the process with the most chunks has: the slices
    past this process's own items are empty, where the caller makes its stand-in calls."""
    calls = agreed_calls(accelerator, math.ceil(num_items / chunk_size))
    return [slice(start, start + chunk_size) for start in range(0, calls * chunk_size, chunk_size)]
