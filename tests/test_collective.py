"""Every teacher call that reaches a model is made as many times on every rank (`collective.py`), whatever rows each
rank holds: under ZeRO-3 each such call is a collective.

Two ranks are played by two threads of this process, each training its own trainer on its own rows; the patched
gather answers each with both ranks' counts, as the all-gather would. Their rows differ as two ranks' do: a router's
rows per teacher (3 of teacher a's rows on one, 1 on the other), the rows drawn for teacher states (none on one
rank), and the rollouts' lengths (2 and 5 tokens, with 2 positions per call of the output layer in a served
divergence).
"""

import threading
import traceback
from collections import Counter
from pathlib import Path

import pytest
from cpu_settings import CPU
from datasets import Dataset
from vllm_test_server import TestTeacherServer

from trl_statelens import OnPolicyDistillConfig, OnPolicyDistillTrainer, collective, heads
from trl_statelens.lab import format_plain

PACKAGE = Path(collective.__file__).parent


class UnmatchedGather(RuntimeError):
    """A gather one rank made and the other did not: real ranks would wait in it forever."""


class TwoRanks:
    """Two ranks played by two threads: the k-th `gather_counts` of each waits for the other's k-th and answers both
    with both counts. A gather the other rank never makes (it finished training, or did not make it within `timeout`
    s) raises [`UnmatchedGather`], with where each rank made its gathers. A rank's gather is matched once the other's
    is recorded, whatever that rank does next: one that finishes right after a shared gather breaks nothing."""

    def __init__(self, timeout: float = 120):
        self.timeout = timeout
        self.condition = threading.Condition()
        self.counts = ([], [])  # each rank's counts, gather by gather
        self.sites = ([], [])  # where in the package each rank made each gather
        self.finished = [False, False]
        self.local = threading.local()

    @property
    def gathered(self) -> list[list[int]]:
        """Both ranks' counts, gather by gather (the gathers both made)."""
        return [list(pair) for pair in zip(*self.counts)]

    def gather_counts(self, accelerator, count):
        rank = self.local.rank
        other = 1 - rank
        with self.condition:
            self.counts[rank].append(count)
            self.sites[rank].append(_package_call_site())
            number = len(self.counts[rank])
            self.condition.notify_all()
            self.condition.wait_for(lambda: len(self.counts[other]) >= number or self.finished[other], self.timeout)
            if len(self.counts[other]) < number:
                state = "finished training" if self.finished[other] else f"waited {self.timeout} s"
                raise UnmatchedGather(
                    f"rank {rank}'s gather {number} at {self.sites[rank][-1]} is not matched: rank {other} {state} "
                    f"after {len(self.counts[other])} gathers (rank {rank}'s: {self.sites[rank]}; rank {other}'s: "
                    f"{self.sites[other]})"
                )
            return [self.counts[0][number - 1], self.counts[1][number - 1]]

    def finish(self, rank: int) -> None:
        """Rank `rank` makes no more gathers: one the other still waits in fails at once."""
        with self.condition:
            self.finished[rank] = True
            self.condition.notify_all()

    def train(self, trainers):
        errors = [None, None]

        def run(rank):
            self.local.rank = rank
            try:
                trainers[rank].train()
            except BaseException as error:  # noqa: BLE001 (raised below, in the test's thread)
                errors[rank] = error
            self.finish(rank)

        threads = [threading.Thread(target=run, args=(rank,)) for rank in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        # A rank's own error first; an unmatched gather only says that the other rank stopped gathering
        for error in sorted((e for e in errors if e), key=lambda e: isinstance(e, UnmatchedGather)):
            raise error


def _package_call_site() -> str:
    """`module.py:function` of the package frame nearest the gather (outside `collective.py`)."""
    for frame in reversed(traceback.extract_stack()):
        path = Path(frame.filename)
        if path.is_relative_to(PACKAGE) and path.name != "collective.py":
            return f"{path.relative_to(PACKAGE)}:{frame.name}"
    return "outside the package"


class _Gathers:
    """A stand-in trainer whose `train` makes `number` gathers and returns at once."""

    def __init__(self, ranks: TwoRanks, number: int):
        self.ranks, self.number = ranks, number

    def train(self):
        for count in range(self.number):
            collective.gather_counts(None, count)


def test_two_ranks_answer_gathers_both_make_even_when_one_finishes_at_once(monkeypatch):
    """A rank that finishes right after a gather both made breaks nothing, however soon (the harness's 2026-12-05 CI
    failure: the barrier it used then was aborted by the finished rank before the other had left it)."""
    for _ in range(200):
        ranks = TwoRanks(timeout=10)
        monkeypatch.setattr(collective, "gather_counts", ranks.gather_counts)
        ranks.train([_Gathers(ranks, 2), _Gathers(ranks, 2)])
        assert ranks.gathered == [[0, 0], [1, 1]]


def test_two_ranks_refuse_a_gather_only_one_makes(monkeypatch):
    ranks = TwoRanks(timeout=10)
    monkeypatch.setattr(collective, "gather_counts", ranks.gather_counts)
    with pytest.raises(UnmatchedGather, match="rank 1's gather 3 .* rank 0 finished training after 2 gathers"):
        ranks.train([_Gathers(ranks, 2), _Gathers(ranks, 3)])


def count_model_calls(trainer, teacher_models: dict) -> Counter:
    """Calls that reach a model: each in-process teacher's forwards outside generation and its `generate` calls,
    and the student's output layer within the teacher's divergence loss, forward and backward (the student's own
    generation and loss project through the layer's weight, or call it per generated token, which is not the
    teacher's doing)."""
    calls, inside = Counter(), set()
    for name, model in teacher_models.items():
        model.get_decoder().register_forward_hook(
            lambda *args, name=name: calls.update([f"{name} forward"]) if "generate" not in inside else None
        )
        model.generate = _counted(model.generate, inside, "generate", calls, f"{name} generate")
    trainer.teacher.divergence_loss = _counted(trainer.teacher.divergence_loss, inside, "loss")
    head = trainer.accelerator.unwrap_model(trainer.model).get_output_embeddings()
    head.register_forward_hook(lambda *args: calls.update(["head forward"]) if "loss" in inside else None)
    head.register_full_backward_hook(lambda *args: calls.update(["head backward"]))
    return calls


def _counted(function, inside: set, scope: str, calls: Counter | None = None, key: str | None = None):
    def counted(*args, **kwargs):
        if calls is not None:
            calls.update([key])
        inside.add(scope)
        try:
            return function(*args, **kwargs)
        finally:
            inside.discard(scope)

    return counted


@pytest.fixture(scope="module")
def teacher_server(teacher_path):
    with TestTeacherServer(teacher_path) as server:
        yield server


# Rank 0's and rank 1's rows of one generation batch: teacher ids (a router's), and the run seed, which draws the
# state sources (seed 1: no teacher state among 4 rows, seed 0: three) and samples the rollouts
TEACHER_IDS = (["a", "a", "a", "b"], ["a", "b", "b", "b"])
SEEDS = (1, 0)
ROLLOUT_LENGTHS = (2, 5)


def rank_trainer(rank, kind, signal, source, world, tmp_path, student_path, teacher_path, url):
    rows = [
        {"prompt": format_plain(r["question"]), "privileged_context": r["answer"]}
        for r in world.math("train", n=8)[4 * rank : 4 * rank + 4]
    ]
    if kind == "router":
        rows = [{**row, "teacher_id": teacher_id} for row, teacher_id in zip(rows, TEACHER_IDS[rank], strict=True)]
    teacher_model = {"in_process": str(teacher_path), "router": {"a": str(teacher_path), "b": url}}.get(kind)
    kind_args = {"self": {"teacher_model_kind": "base"}, "served": {"teacher_model_server_url": url}}.get(kind, {})
    args = OnPolicyDistillConfig(
        **{**CPU, "seed": SEEDS[rank]},
        **kind_args,
        output_dir=str(tmp_path / f"rank{rank}"),
        max_steps=1,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        num_generations=1,
        shuffle_dataset=False,
        max_completion_length=ROLLOUT_LENGTHS[rank],
        learning_rate=1e-3,
        signal=signal,
        state_source_mix={"learner": 1.0} if source == "learner" else {"learner": 0.5, "teacher": 0.5},
        **({"continuation_length": 3} if signal == "continuation" else {}),
    )
    return OnPolicyDistillTrainer(
        model=str(student_path),
        teacher_model=teacher_model,
        args=args,
        train_dataset=Dataset.from_list(rows),
        state_logging=False,
    )


@pytest.mark.parametrize("source", ["learner", "teacher"])
@pytest.mark.parametrize("signal", ["reverse_kl", "divergence", "continuation"])
@pytest.mark.parametrize("kind", ["in_process", "self", "served", "router"])
def test_every_rank_makes_as_many_model_calls(
    kind, signal, source, world, tmp_path, student_path, teacher_path, teacher_server, monkeypatch
):
    ranks = TwoRanks()
    monkeypatch.setattr(collective, "gather_counts", ranks.gather_counts)
    monkeypatch.setattr(heads, "POSITION_CHUNK", 2)
    trainers = [
        rank_trainer(rank, kind, signal, source, world, tmp_path, student_path, teacher_path, teacher_server.url)
        for rank in range(2)
    ]
    calls = []
    for trainer in trainers:
        teacher = trainer.teacher
        in_process = (
            {"a": teacher.teachers["a"]} if kind == "router" else {} if kind == "served" else {"teacher": teacher}
        )
        models = {name: trainer.accelerator.unwrap_model(t.model) for name, t in in_process.items()}
        calls.append(count_model_calls(trainer, models))
    ranks.train(trainers)
    assert ranks.sites[0] == ranks.sites[1]  # the same gathers, in the same order, from the same places
    assert calls[0] == calls[1]
    assert [trainer.state.global_step for trainer in trainers] == [1, 1]
    # The case under test: the ranks' own work differed wherever their rows make it differ (a router's rows per
    # teacher, teacher states drawn on one rank only, rollouts of different lengths in a served divergence); a single
    # in-process teacher scores as many rows on every rank, and a served teacher's requests reach no model here
    differed = any(len(set(counts)) > 1 for counts in ranks.gathered)
    uneven = (
        kind == "router" or (kind == "served" and signal == "divergence") or (kind != "served" and source == "teacher")
    )
    assert differed == uneven, ranks.gathered
