"""Several teachers, each row answered by the one its `teacher_id` names: [`TeacherRouter`]."""

from __future__ import annotations

from contextlib import ExitStack, contextmanager

import torch

from ..heads import Divergence
from .base import Teacher
from .cross_tokenizer import teacher_in_process
from .served_cross_tokenizer import served_teacher


class TeacherRouter(Teacher):
    """Several teachers, each row answered by the one its `teacher_id` names (rows without one, or with `None`, by
    `default`): every method splits the rows by teacher, asks each teacher for its own, and puts the answers back in
    row order. Every teacher is asked on every rank, with or without rows of its own there (its model calls are
    collective under ZeRO-3: it makes as many as on the other ranks, on stand-ins where it has fewer rows).

    Args:
        teachers (`dict[str, Teacher]`): the teachers by name, in-process and served mixed.
        default (`str`): the teacher of rows without a `teacher_id`.
    """

    def __init__(self, teachers: dict[str, Teacher], default: str):
        self.teachers, self.default, self.names = teachers, default, tuple(teachers)
        # In-process teachers of another tokenizer may be among them: their rows' prompts are their own, and the
        # loss reads every row's signal (exact for the others) whenever one is, on every rank alike
        self.reads_student_ids = all(teacher.reads_student_ids for teacher in teachers.values())
        self.crosses_tokenizers = any(teacher.crosses_tokenizers for teacher in teachers.values())
        crossing = [teacher for teacher in teachers.values() if teacher.crosses_tokenizers]
        self.number_tokens = crossing[0].number_tokens if crossing else None

    @classmethod
    def connect(cls, trainer, loaded: dict[str, tuple]) -> TeacherRouter:
        """The teachers from [`load_teachers`], each prepared (in-process) or reached and checked (served) as a single
        teacher is; the first is the default. A check that fails names its teacher."""
        teachers = {}
        for name, (model, path, url) in loaded.items():
            try:
                if url is not None:
                    teachers[name] = served_teacher(trainer, path, url)
                else:
                    teachers[name] = teacher_in_process(trainer, model, path)
            except ValueError as error:
                raise ValueError(f"teacher {name!r}: {error}") from error
        return cls(teachers, default=next(iter(teachers)))

    def route(self, teacher_ids):
        names = [self.default if teacher_id is None else teacher_id for teacher_id in teacher_ids]
        unknown = sorted(set(names) - set(self.names))
        if unknown:
            raise ValueError(f"teacher_id {unknown} names no teacher; the teachers are {list(self.names)}")
        return names

    def prompts(self, student_prompts, rows):
        """Each row's prompt as its own teacher reads it (a teacher of another tokenizer: in its tokens)."""
        names = self.route([row.get("teacher_id") for row in rows])
        prompts = list(student_prompts)
        for name, teacher in self.teachers.items():
            mine = [i for i, routed in enumerate(names) if routed == name]
            if mine:
                answers = teacher.prompts([student_prompts[i] for i in mine], [rows[i] for i in mine])
                for i, prompt in zip(mine, answers, strict=True):
                    prompts[i] = prompt
        return prompts

    @contextmanager
    def session(self):
        with ExitStack() as stack:
            for teacher in self.teachers.values():
                stack.enter_context(teacher.session())
            yield

    def _rows_by_teacher(self, teachers: list[str] | None, num_rows: int) -> dict[str, list[int]]:
        teachers = teachers if teachers is not None else [self.default] * num_rows
        return {name: [i for i, t in enumerate(teachers) if t == name] for name in self.names}

    def generate(self, prompts, max_new_tokens, prefixes=None, teachers=None):
        written = [None] * len(prompts)
        for name, rows in self._rows_by_teacher(teachers, len(prompts)).items():
            row_prefixes = None if prefixes is None else [prefixes[i] for i in rows]
            answers = self.teachers[name].generate([prompts[i] for i in rows], max_new_tokens, row_prefixes)
            for i, answer in zip(rows, answers, strict=True):
                written[i] = answer
        return written

    def score(self, prompts, completions, distribution=False, teachers=None):
        scored = [None] * len(prompts)
        for name, rows in self._rows_by_teacher(teachers, len(prompts)).items():
            answers = self.teachers[name].score(
                [prompts[i] for i in rows], [completions[i] for i in rows], distribution
            )
            for i, answer in zip(rows, answers or [None] * len(rows), strict=True):
                scored[i] = answer
        return None if all(row is None for row in scored) else scored

    def divergence_loss(self, student, student_hidden, batch, loss_mask, normalizer, beta, temperature):
        """The sum of each teacher's loss on its rows (each already divided by the whole `normalizer`); the student's
        per-token values only when every teacher gave them; the leftover of a teacher of another tokenizer where it
        gave one (0 on the other teachers' rows: their distributions are compared whole)."""
        total = student_hidden.sum() * 0.0
        per_token = {
            field: torch.zeros_like(batch["completion_ids"], dtype=torch.float32)
            for field in ("teacher_logps", "logps", "entropies")
        }
        leftover = None
        for name, rows in self._rows_by_teacher(batch["teacher"], len(batch["teacher"])).items():
            index = torch.tensor(rows, dtype=torch.long, device=student_hidden.device)
            part = {
                key: batch[key][index] for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")
            }
            scores = batch["teacher_scores"]
            part["teacher_scores"] = [scores[i] for i in rows] if scores is not None else None
            answer = self.teachers[name].divergence_loss(
                student, student_hidden[index], part, loss_mask[index], normalizer, beta, temperature
            )
            total = total + answer.loss
            if answer.leftover is not None:
                if leftover is None:
                    leftover = torch.zeros_like(batch["completion_ids"], dtype=torch.float32)
                leftover[index] = answer.leftover.to(leftover.dtype)
            for field, values in per_token.items():
                if values is not None and getattr(answer, field) is not None:
                    values[index] = getattr(answer, field).to(values.dtype)
                else:
                    per_token[field] = None
        return Divergence(total, **per_token, leftover=leftover)
