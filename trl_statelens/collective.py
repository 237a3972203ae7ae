"""What every training process must do as often as the others, in one home.

The counts and sums the processes exchange for the trainer's bookkeeping go through here ([`gather_counts`],
[`sum_over_ranks`]): a gather one process skips leaves the others waiting in it, and a test plays several processes
by patching this module alone (tests/test_collective.py). Callers reach these functions through the module
(`collective.gather_counts(...)`), never by importing their names (grep for `collective.` to find them). What the
main process alone knows reaches the others through [`from_main_process`], and a failure on one process (a bad row, a
row a teacher cannot read, a served teacher's failed request) is raised on all of them through [`raise_together`].
Tensors that travel whole (the loss's `num_items_in_batch`, the records' table, an EMA teacher's ZeRO-3 shards) are
gathered where they are used.

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
every process, rows or none. A served teacher's scoring and writing are requests to its server, no model call; only
whether one failed is gathered, on every process, rows or none ([`raise_together`]: `ServedTeacher`). With state
selection (`skip_correct_rollouts`), `opd/selection.py`'s `divergence_on_scored_rows` hands a process whose rows were
all skipped a stand-in row and calls the student's output layer once per micro-batch on every process.
A `divergence_loss` stand-in row, the in-process teacher's and state selection's alike, is [`stand_in_row`]'s: its
student hidden state is zeros inside the student's graph, so the backward reaches the same student parameters on
every process.
"""

from __future__ import annotations

import math

import torch
from accelerate.utils import broadcast_object_list


def gather_counts(accelerator, count: int) -> list[int]:
    """Every process's `count`, in process order: one all-gather, none in a single process."""
    if accelerator.num_processes == 1:
        return [count]
    return accelerator.gather(torch.tensor([count], device=accelerator.device)).tolist()


def sum_over_ranks(accelerator, values: torch.Tensor) -> list:
    """The elementwise sum of every process's `values` (a 1-D tensor of the same length everywhere), as a list: one
    all-gather."""
    return accelerator.gather(values.to(accelerator.device)[None]).sum(0).tolist()


def from_main_process(accelerator, value):
    """The main process's `value` (any object pickle carries) on every process: one broadcast, none in a single
    process. What only the main process knows (the ledger it writes) reaches the others here, so that every process
    decides alike (a process that stops training alone leaves the others waiting in their next collective)."""
    if accelerator.num_processes == 1:
        return value
    return broadcast_object_list([value])[0]


def raise_together(accelerator, error: BaseException | None, what: str, error_type: type = RuntimeError) -> None:
    """Raise on every process when any process failed (`error`: this process's own failure, `None` if it had none):
    its own `error` where it failed, elsewhere an `error_type` naming the process(es) that did (`what` says what
    failed there; their own errors are in their logs). Every process calls it as often as the others, failed or not:
    one all-gather of a failure flag, none in a single process. Raised on its own process only, a failure would leave
    the others waiting in their next collective until the launcher's (or NCCL's) timeout."""
    failed = gather_counts(accelerator, int(error is not None))
    if error is not None:
        raise error
    if any(failed):
        processes = ", ".join(str(rank) for rank, flag in enumerate(failed) if flag)
        raise error_type(
            f"process {processes}: {what} (its error is in its log); every process stops here, so that none is left "
            "waiting for it in a collective"
        )


def any_rank_has(accelerator, count: int) -> bool:
    """Whether any process has something (`count`, this process's own) to make a call with: then every process makes
    it, on a stand-in where it has nothing."""
    return agreed_calls(accelerator, min(count, 1)) > 0


def agreed_calls(accelerator, count: int) -> int:
    """The number of calls every process makes: the most that any process needs (`count`, this process's own)."""
    return max(gather_counts(accelerator, count))


def stand_in_row(batch: dict, student_hidden: torch.Tensor, pad_id: int) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """`(row, hidden, loss_mask)` for a `divergence_loss` call a process makes with no rows of its own, to join the
    other processes' (`batch`: its micro-batch, or its part for one teacher, maybe empty; `student_hidden`: the
    student's final hidden states of those rows, `(B, T, H)`, maybe `B = 0`).

    `row`: one pad-token prompt and completion, no teacher scores (a served teacher compares nothing on it), the
    batch's first row's teacher where it has rows and names them (a router sends the row to that teacher), a pad-token
    teacher prompt where it carries teacher prompts (a self teacher's). `loss_mask`: zero, so it supervises nothing.

    `hidden` `(1, 1, H)`: zeros *inside the student's graph* (`student_hidden.sum() * 0.0`, which an empty
    `student_hidden` has too). The stand-in's loss is 0 and so is every gradient it sends back, but its backward
    reaches the same student parameters as a process with rows: the body through `student_hidden`, the output layer
    through the loss kernel. Under ZeRO-3 each of those gradients is a collective (a reduce-scatter), so a process
    whose backward skipped one would leave the others waiting in it."""
    device = batch["completion_ids"].device
    ids = torch.full((1, 1), pad_id, dtype=torch.long, device=device)
    row = {
        "prompt_ids": ids,
        "prompt_mask": torch.ones_like(ids),
        "completion_ids": ids,
        "completion_mask": torch.ones_like(ids),
        "teacher_scores": None,
    }
    if batch.get("teacher") and batch["completion_ids"].size(0):
        row["teacher"] = batch["teacher"][:1]
    if "teacher_prompt_ids" in batch:
        row["teacher_prompt_ids"] = None if batch["teacher_prompt_ids"] is None else [[pad_id]]
    hidden = student_hidden.new_zeros((1, 1, student_hidden.size(-1))) + student_hidden.sum() * 0.0
    return row, hidden, torch.zeros((1, 1), device=device)


def agreed_chunks(accelerator, num_items: int, chunk_size: int) -> list[slice]:
    """`num_items` in slices of `chunk_size`, as many slices as the process with the most chunks has: the slices
    past this process's own items are empty, where the caller makes its stand-in calls."""
    calls = agreed_calls(accelerator, math.ceil(num_items / chunk_size))
    return [slice(start, start + chunk_size) for start in range(0, calls * chunk_size, chunk_size)]
