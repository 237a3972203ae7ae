"""Every teacher call that reaches a model is made as many times on every rank (`collective.py`), whatever rows each
rank holds: under ZeRO-3 each such call is a collective.

Two ranks are played by two threads of this process, each training its own trainer on its own rows; the patched
gather answers each with both ranks' counts, as the all-gather would. Their rows differ as two ranks' do: a router's
rows per teacher (3 of teacher a's rows on one, 1 on the other), the rows drawn for teacher states (none on one
rank), and the rollouts' lengths (2 and 5 tokens, with 2 positions per call of the output layer in a served
divergence).
"""

import threading
from collections import Counter

import pytest
from cpu_settings import CPU
from datasets import Dataset
from vllm_test_server import TestTeacherServer

from trl_statelens import OnPolicyDistillConfig, OnPolicyDistillTrainer, collective, heads
from trl_statelens.lab import format_plain


class TwoRanks:
    """Two ranks played by two threads: `gather_counts` waits for both and answers each with both counts. A rank
    that makes a gather the other never makes fails with `threading.BrokenBarrierError` (the other has finished, or
    waited `timeout` s), where real ranks would wait forever."""

    def __init__(self, timeout: float = 120):
        self.barrier = threading.Barrier(2, timeout=timeout)
        self.counts = [0, 0]
        self.gathered = []  # both ranks' counts, gather by gather
        self.local = threading.local()

    def gather_counts(self, accelerator, count):
        rank = self.local.rank
        self.counts[rank] = count
        self.barrier.wait()
        counts = list(self.counts)
        if rank == 0:
            self.gathered.append(counts)
        self.barrier.wait()  # both have read before either writes its next count
        return counts

    def train(self, trainers):
        errors = [None, None]

        def run(rank):
            self.local.rank = rank
            try:
                trainers[rank].train()
            except BaseException as error:  # noqa: BLE001 (raised below, in the test's thread)
                errors[rank] = error
            self.barrier.abort()  # a rank done makes no more gathers: one the other still makes fails at once

        threads = [threading.Thread(target=run, args=(rank,)) for rank in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        # A rank's own error first; a broken barrier only says that the other rank stopped gathering
        for error in sorted((e for e in errors if e), key=lambda e: isinstance(e, threading.BrokenBarrierError)):
            raise error


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
