"""[`StepCounts`]: what a training process counted in the optimizer step in progress, for that step's ledger line."""

from __future__ import annotations


class StepCounts:
    """This process's counts in the optimizer step in progress, by name: the teacher's token positions
    (`teacher_tokens`, [`StateRecorderMixin._count_teacher_tokens`]) and its prompts' extra context
    (`teacher_context_tokens`), and what the teacher-budget levers count (state selection in `opd/selection.py`, the
    teacher cache in `opd/cache.py`). A trainer with a teacher owns one (`trainer.step_counts`); the levers add to it
    and the step's ledger line takes what it reads at the step's end ([`take`], `StateLoggingCallback.on_step_end`,
    every process: the callers gather the counts over them).

    Every count belongs to one optimizer step (`trainer.state.global_step` when it was added): the first count added
    in a new step drops whatever the last step left, read or not, so nothing grows over a run in which no
    `StateLoggingCallback` reads them (`state_logging=False`), and a lever that needs a count of this step alone (the
    generation batches state selection drew in it) reads it from here. Training only: its callers count nothing while
    the model evaluates, between a step's end and the next step's first count.

    A count is a number, or a tensor that is summed elementwise (the teacher cache's sums).
    """

    def __init__(self, trainer):
        self._trainer = trainer
        self._step: int | None = None  # the optimizer step the counts belong to
        self._counts: dict = {}

    def add(self, **counts) -> None:
        """Add to the named counts of the step in progress (a new step's first call starts them from 0)."""
        step = self._trainer.state.global_step
        if step != self._step:
            self._step, self._counts = step, {}
        for name, value in counts.items():
            self._counts[name] = self._counts[name] + value if name in self._counts else value

    def peek(self, name: str, default=0):
        """The named count as it stands (of the last step anything was counted in), `default` where none was."""
        return self._counts.get(name, default)

    def take(self, *names: str) -> list:
        """The named counts (0 where none was added), each cleared: the step's, read once at its end."""
        return [self._counts.pop(name, 0) for name in names]

    def clear(self) -> None:
        self._step, self._counts = None, {}
