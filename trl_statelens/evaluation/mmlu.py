"""MMLU accuracy by log-likelihood, per subject and micro-averaged over all items."""

from __future__ import annotations

from ..data import read_source_rows, require_columns
from .protocols import SUBSET_RULES, check_protocol
from .scoring import argmax, choice_logprobs, mean, subset_rows

MMLU_HUB_ID = "cais/mmlu"
MMLU_SCORING = ("letter", "continuation")
LETTERS = "ABCDEFGHIJ"
MMLU_PROTOCOLS = {
    # Shots: the subject's dev rows, then other subjects' when it has too few.
    "statelens": {"num_shots": 0, "shot_pool": "subject-then-others"},
    # Shots: lm-eval's first_n sampler over the subject's dev rows (an error when it has too few).
    "lm-eval": {"num_shots": 0, "shot_pool": "subject-first-n"},
}


def _answer_index(answer) -> int:
    if isinstance(answer, str) and answer.strip().upper() in LETTERS:
        return LETTERS.index(answer.strip().upper())
    return int(answer)


def read_mmlu_rows(source: str, split: str, lab_seed: int = 0) -> list[dict]:
    from ..lab import LabWorld

    rows = read_source_rows(source, split, "all", lab_rows=lambda s: LabWorld(seed=lab_seed).kb(s))
    require_columns(rows, ("question", "choices", "answer"), f"MMLU source {source!r} split {split!r}")
    return [
        {
            "question": r["question"],
            "subject": r.get("subject") or "all",
            "choices": list(r["choices"]),
            "answer": _answer_index(r["answer"]),
        }
        for r in rows
    ]


class MMLUTask:
    """MMLU accuracy by log-likelihood, per subject and micro-averaged over all items (lm-eval's ``mmlu`` group
    average, ``weight_by_size``).

    Args:
        source: ``"cais/mmlu"`` (config ``all``), a local file or a folder with ``test.jsonl`` (and ``dev.jsonl``
            for shots) in the ``cais/mmlu`` columns ``question, subject, choices, answer``, or ``"lab"``.
        split: ``"test"``.
        protocol: ``"statelens"`` or ``"lm-eval"``: both 0-shot by default with the same letter prompt; they differ
            in where shots come from when there are too few of the subject (see ``MMLU_PROTOCOLS``) and in
            ``limit``.
        num_shots: exemplars from the ``dev`` split, of the same subject, in file order.
        scoring: ``"letter"`` (log-likelihood of `` A``..`` D`` after ``The following are multiple choice questions
            (with answers) about {subject}.``, the question and its lettered choices, lm-eval's ``mmlu``) or
            ``"continuation"`` (log-likelihood of each choice's text after ``Question: ...\\nAnswer:``). Default:
            ``letter``, and ``continuation`` for the lab under ``statelens`` (its base model never learned letter
            answers).
        subjects: only these subjects.
        limit / seed: ``limit`` questions (after the subject filter): under ``statelens`` chosen by a hash of the
            question seeded with ``seed``; under ``lm-eval`` the first ``limit`` of each subject, as lm-eval's
            ``--limit`` on the ``mmlu`` group (one task per subject).
    """

    name = "mmlu"
    primary_metric = "accuracy"

    def __init__(
        self,
        source: str = MMLU_HUB_ID,
        split: str | None = None,
        *,
        protocol: str = "statelens",
        num_shots: int | None = None,
        scoring: str | None = None,
        subjects: list[str] | None = None,
        limit: int | None = None,
        seed: int = 0,
        batch_size: int = 16,
        lab_seed: int = 0,
    ):
        self.source, self.split, self.protocol = str(source), split or "test", check_protocol(protocol)
        lab_default = "continuation" if self.source == "lab" and protocol == "statelens" else "letter"
        self.scoring = scoring or lab_default
        if self.scoring not in MMLU_SCORING:
            raise ValueError(f"unknown MMLU scoring {self.scoring!r}: use one of {MMLU_SCORING}")
        self.num_shots = MMLU_PROTOCOLS[protocol]["num_shots"] if num_shots is None else num_shots
        self.subjects = subjects
        self.limit, self.seed, self.batch_size, self.lab_seed = limit, seed, batch_size, lab_seed
        self._rows = None
        self._dev = None

    def settings(self) -> dict:
        return {
            "protocol": self.protocol,
            "source": self.source,
            "split": self.split,
            "num_shots": self.num_shots,
            "shot_pool": MMLU_PROTOCOLS[self.protocol]["shot_pool"],
            "scoring": self.scoring,
            "subjects": self.subjects,
            "limit": self.limit,
            "subset": SUBSET_RULES[self.protocol],
            "seed": self.seed,
        }

    def rows(self) -> list[dict]:
        if self._rows is None:
            rows = read_mmlu_rows(self.source, self.split, self.lab_seed)
            if self.subjects:
                rows = [r for r in rows if r["subject"] in set(self.subjects)]
                if not rows:
                    raise ValueError(f"no MMLU rows for subjects {self.subjects}: check the subject names")
            if SUBSET_RULES[self.protocol] == "first":  # lm-eval's --limit applies to each subject's task
                by_subject = {}
                for row in rows:
                    by_subject.setdefault(row["subject"], []).append(row)
                self._rows = [r for group in by_subject.values() for r in subset_rows(group, self.limit, 0, "first")]
            else:
                self._rows = subset_rows(rows, self.limit, self.seed, SUBSET_RULES[self.protocol])
        return self._rows

    def load(self) -> list[dict]:
        """Read the rows and, with shots, the dev rows (so a missing split fails before any task runs)."""
        for row in self.rows():
            self.shots(row["subject"])
        return self.rows()

    def shots(self, subject: str) -> list[dict]:
        if self.num_shots <= 0:
            return []
        if self._dev is None:
            self._dev = read_mmlu_rows(self.source, "dev", self.lab_seed)
        same = [r for r in self._dev if r["subject"] == subject]
        if len(same) >= self.num_shots:
            return same[: self.num_shots]
        if MMLU_PROTOCOLS[self.protocol]["shot_pool"] == "subject-first-n":
            raise ValueError(
                f"num_shots={self.num_shots} but the dev split has {len(same)} {subject!r} rows: "
                "lower the MMLU shots or add dev rows"
            )
        return (same + [r for r in self._dev if r["subject"] != subject])[: self.num_shots]

    def letter_block(self, row: dict, with_answer: bool) -> str:
        lines = [row["question"].strip()] + [f"{LETTERS[i]}. {c}" for i, c in enumerate(row["choices"])]
        answer = f"Answer: {LETTERS[row['answer']]}" if with_answer else "Answer:"
        return "\n".join(lines + [answer])

    def context(self, row: dict) -> str:
        shots = self.shots(row["subject"])
        if self.scoring == "letter":
            header = (
                f"The following are multiple choice questions (with answers) about {row['subject'].replace('_', ' ')}."
            )
            blocks = [self.letter_block(s, True) for s in shots] + [self.letter_block(row, False)]
            return header + "\n\n" + "\n\n".join(blocks)
        blocks = [f"Question: {s['question']}\nAnswer: {s['choices'][s['answer']]}" for s in shots]
        return "\n\n".join(blocks + [f"Question: {row['question']}\nAnswer:"])

    def continuations(self, row: dict) -> list[str]:
        if self.scoring == "letter":
            return [f" {LETTERS[i]}" for i in range(len(row["choices"]))]
        return [f" {c}" for c in row["choices"]]

    def evaluate(self, model, tokenizer, progress: bool = True) -> dict:
        rows = self.rows()
        items = [(self.context(r), self.continuations(r)) for r in rows]
        scores = choice_logprobs(model, tokenizer, items, self.batch_size, "mmlu: scoring", progress)
        records = []
        for row, (_, continuations), row_scores in zip(rows, items, scores):
            logprobs = [s for s, _ in row_scores]
            per_char = [s / len(c[1:]) for s, c in zip(logprobs, continuations)]  # c is " " + choice
            records.append(
                {
                    "question": row["question"],
                    "subject": row["subject"],
                    "answer": row["answer"],
                    "logprobs": logprobs,
                    "prediction": argmax(logprobs),
                    "correct": float(argmax(logprobs) == row["answer"]),
                    "correct_norm": float(argmax(per_char) == row["answer"]),
                }
            )
        subjects = sorted({r["subject"] for r in records})
        per_subject = {s: mean([r["correct"] for r in records if r["subject"] == s]) for s in subjects}
        metrics = {
            "accuracy": mean([r["correct"] for r in records]),
            "accuracy_macro": mean(list(per_subject.values())),
            "num_items": len(records),
        }
        if self.scoring == "continuation":  # a letter has one length: normalising changes nothing
            metrics["accuracy_norm"] = mean([r["correct_norm"] for r in records])
        return {"metrics": metrics, "subjects": per_subject, "records": records}
