"""State selection (issue 36, `skip_correct_rollouts`): the teacher does not score rollouts that are already correct,
they carry no teacher signal, the ledger says which were skipped or rechecked, and the teacher's counts drop by them."""

import json

import pytest
import torch
from cpu_settings import CPU
from datasets import Dataset
from vllm_test_server import TestTeacherServer

from trl_statelens import OnPolicyDistillConfig, OnPolicyDistillTrainer, StateLoggingCallback
from trl_statelens.lens.compute import matmul_parameters
from trl_statelens.opd.selection import RECHECKED, SCORED, SKIPPED, choose_rows, selection_generator

CORRECT = 1.0


def score_reward(completions, score, **kwargs):
    """Each row's reward is its dataset `score`: which rollouts are correct is fixed by the data."""
    return [float(s) for s in score]


def scored_dataset(math_dataset, n=16, extra=None):
    scores = [0.0, 1.0, 0.5, 1.5, 1.0, 0.0, 2.0, 0.9][: n // 2] * 2  # half the prompts reach CORRECT
    rows = {"prompt": math_dataset["prompt"][:n], "score": (scores * n)[:n], **(extra or {})}
    return Dataset.from_dict(rows)


def opd_config(tmp_path, **kwargs):
    defaults = dict(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=8, num_generations=2,
                    max_completion_length=8, learning_rate=1e-3, logging_steps=1, skip_correct_rollouts=True,
                    shuffle_dataset=False)  # fmt: skip
    if kwargs.get("skip_correct_rollouts", True):
        defaults["recheck_fraction"] = 0.0  # every correct rollout skipped, unless a test says otherwise
    defaults["preflight"] = (
        "off"  # these tests count training's own teacher calls and forwards; the preflight's are tested in test_preflight.py
    )
    return OnPolicyDistillConfig(**{**defaults, **CPU, **kwargs})


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def watch(trainer, teacher=True):
    """Record each training generation batch's output, and (with `teacher`) every row the teacher is asked to score
    or to compute a divergence on: its completion tokens, in order."""
    seen = {"batches": [], "scored": [], "divergence": []}
    generate_and_score = trainer._generate_and_score_completions

    def batches(inputs):
        output = generate_and_score(inputs)
        if trainer.model.training:
            seen["batches"].append(output)
        return output

    trainer._generate_and_score_completions = batches
    if teacher:
        watch_teacher(trainer.teacher, seen)
    return seen


def rows(output, codes=(SCORED, SKIPPED, RECHECKED)):
    ids, mask, selection = output["completion_ids"], output["completion_mask"], output["teacher_selection"]
    return [ids[i][mask[i].bool()].tolist() for i in range(ids.size(0)) if int(selection[i]) in codes]


@pytest.mark.parametrize("signal", ["reverse_kl", "divergence"])
def test_the_teacher_skips_exactly_the_correct_rollouts_and_the_ledger_says_which(
    tmp_path, student_path, teacher_path, math_dataset, signal
):
    """With no recheck, the rows the teacher scores (`reverse_kl`: `teacher.score`; an in-process `divergence`: its
    loss) are exactly the rollouts whose reward is below `correct_reward`; the ledger marks the others skipped, with
    weight 0 and no teacher log-prob, and counts them per step."""
    trainer = OnPolicyDistillTrainer(
        model=str(student_path),
        teacher_model=str(teacher_path),
        args=opd_config(tmp_path, max_steps=2, signal=signal),
        train_dataset=scored_dataset(math_dataset),
        reward_funcs=[score_reward],
        callbacks=[StateLoggingCallback(sample_rate=1.0)],
    )
    seen = watch(trainer)
    trainer.train()

    for output in seen["batches"]:
        correct = (output["rewards"] >= CORRECT).tolist()
        assert [int(c) for c in output["teacher_selection"]] == [SKIPPED if c else SCORED for c in correct]
        assert 0 < sum(correct) < len(correct)
    expected = sorted(row for output in seen["batches"] for row in rows(output, (SCORED,)))
    asked = seen["divergence"] if signal == "divergence" else seen["scored"]
    assert sorted(asked) == expected  # the teacher saw the scored rows, all of them, and nothing else

    states = read(tmp_path / "statelens" / "states.jsonl")
    steps = read(tmp_path / "statelens" / "steps.jsonl")
    for line, output in zip(steps, seen["batches"]):
        mine = [s for s in states if s["step"] == line["step"]]
        assert len(mine) == len(output["rewards"])  # every rollout is in the ledger, skipped or not
        skipped = [s for s in mine if s["skipped"] == "correct"]
        assert all((s["reward"] >= CORRECT) == (s["skipped"] == "correct") for s in mine)
        assert all(
            not s["teacher_scored"] and s["teacher_logp"] is None and set(s["weight"]) == {0.0} for s in skipped
        )
        assert all(s["teacher_scored"] and s["teacher_logp"] is not None for s in mine if s not in skipped)
        assert line["selection/skipped"] == len(skipped) == int((output["rewards"] >= CORRECT).sum())
        assert line["selection/rechecked"] == 0 and line["selection/correct"] == len(skipped)
        # supervised-token metrics count the scored rows only
        assert line["supervised_tokens"] == sum(s["num_supervised"] for s in mine if s not in skipped)
    skipped_frac = [e["teacher/skipped_frac"] for e in trainer.state.log_history if "teacher/skipped_frac" in e]
    assert skipped_frac == [line["selection/skipped"] / 8 for line in steps]  # 8 rollouts a step


def _loss_and_grad(trainer, batch):
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    grad = torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])
    return loss.detach(), grad


@pytest.mark.parametrize("signal", ["reverse_kl", "divergence"])
def test_a_skipped_rollout_carries_no_teacher_signal(tmp_path, student_path, teacher_path, math_dataset, signal):
    """The loss and its gradient do not change when a skipped rollout's tokens, and so whatever the teacher would
    say about them (its scores of those rows are replaced with noise too), are changed; a scored row's change does."""
    trainer = OnPolicyDistillTrainer(
        model=str(student_path),
        teacher_model=str(teacher_path),
        args=opd_config(tmp_path, signal=signal),
        train_dataset=scored_dataset(math_dataset),
        reward_funcs=[score_reward],
    )
    trainer.model.train()
    batch = trainer._generate_and_score_completions(list(trainer.train_dataset.select(range(8))))
    codes = batch["teacher_selection"].tolist()
    assert SKIPPED in codes and SCORED in codes
    loss, grad = _loss_and_grad(trainer, batch)

    def changed(codes_to_change):
        other = dict(batch)
        ids = batch["completion_ids"].clone()
        for i, code in enumerate(codes):
            if code in codes_to_change:
                ids[i] = (ids[i] + 7 + i) % 100 + 5
        other["completion_ids"] = ids
        if batch["teacher_scores"] is not None:
            scores = list(batch["teacher_scores"])
            for i, code in enumerate(codes):
                if code == SKIPPED:
                    noise = -torch.rand(ids.size(1)) * 10
                    scores[i] = type(scores[i])(_answered(noise), 0)
            other["teacher_scores"] = scores
        return _loss_and_grad(trainer, other)

    skipped_loss, skipped_grad = changed({SKIPPED})
    torch.testing.assert_close(skipped_loss, loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(skipped_grad, grad, atol=1e-6, rtol=1e-5)
    scored_loss, _ = changed({SCORED})  # the control: a scored row's tokens do move the loss
    assert not torch.allclose(scored_loss, loss)


def _answered(logps):
    from trl_statelens.teachers import RowScores, answered

    return answered([RowScores(logps)])


def test_teacher_tokens_and_flops_drop_by_exactly_the_skipped_rows(tmp_path, student_path, teacher_path, math_dataset):
    """Against the same first step without the lever (the same rollouts: the teacher does not sample them),
    `teacher_tokens` drops by the skipped rows' completion tokens and the teacher FLOPs by 2 N_T times their prompt and
    completion tokens, counted by hand from the batch."""
    lines, outputs = {}, {}
    for skip in (False, True):
        out = tmp_path / str(skip)
        trainer = OnPolicyDistillTrainer(
            model=str(student_path),
            teacher_model=str(teacher_path),
            args=opd_config(out, skip_correct_rollouts=skip),
            train_dataset=scored_dataset(math_dataset),
            reward_funcs=[score_reward],
            callbacks=[StateLoggingCallback(sample_rate=0.0)],
        )
        seen = watch(trainer)
        trainer.train()
        (lines[skip],) = read(out / "statelens" / "steps.jsonl")
        (outputs[skip],) = seen["batches"]
    on, off = lines[True], lines[False]
    output = outputs[True]
    assert torch.equal(outputs[False]["completion_ids"], output["completion_ids"])  # the same rollouts
    skipped = output["teacher_selection"] == SKIPPED
    completion_tokens = int(output["completion_mask"][skipped].sum())
    prompt_tokens = int(output["prompt_mask"][skipped].sum())
    assert completion_tokens > 0
    assert off["teacher_tokens"] - on["teacher_tokens"] == completion_tokens
    assert on["teacher_tokens"] == int(output["completion_mask"][~skipped].sum())
    assert on["teacher_skipped_tokens"] == prompt_tokens + completion_tokens and "teacher_skipped_tokens" not in off
    teacher_size = matmul_parameters(trainer.teacher.model)
    saved = off["flops/teacher_scoring"] - on["flops/teacher_scoring"]
    assert saved == pytest.approx(2 * teacher_size * (prompt_tokens + completion_tokens), rel=1e-9)
    assert on["flops/student_training"] == off["flops/student_training"]  # the student still trains on every token


def test_the_recheck_floor_scores_its_share_the_same_way_every_time(
    tmp_path, student_path, teacher_path, math_dataset
):
    """Every rollout correct, `recheck_fraction=0.5`: each generation batch of 8 has the teacher score exactly 4 of
    them (`recheck` in the ledger), the same 4 in a second run with the same seed, other ones at the next step."""
    codes = []
    for run in range(2):
        out = tmp_path / str(run)
        trainer = OnPolicyDistillTrainer(
            model=str(student_path),
            teacher_model=str(teacher_path),
            args=opd_config(out, max_steps=2, recheck_fraction=0.5),
            train_dataset=scored_dataset(math_dataset).map(lambda row: {"score": 1.0}),
            reward_funcs=[score_reward],
            callbacks=[StateLoggingCallback(sample_rate=1.0)],
        )
        seen = watch(trainer)
        trainer.train()
        codes.append([output["teacher_selection"].tolist() for output in seen["batches"]])
        assert sorted(seen["scored"]) == sorted(row for o in seen["batches"] for row in rows(o, (RECHECKED,)))
        for line in read(out / "statelens" / "steps.jsonl"):
            assert (line["selection/rechecked"], line["selection/skipped"], line["selection/correct"]) == (4, 4, 8)
        states = read(out / "statelens" / "states.jsonl")
        assert sum(s["recheck"] for s in states) == 8 and all(s["recheck"] == s["teacher_scored"] for s in states)
    assert codes[0] == codes[1]
    assert all(step.count(RECHECKED) == 4 for step in codes[0])
    assert codes[0][0] != codes[0][1]


def test_a_resumed_run_rechecks_the_same_rollouts(tmp_path, student_path, teacher_path, math_dataset):
    """The rechecks of step 2 resumed from step 1's checkpoint are the uninterrupted run's."""

    def run(out, resume=None):
        trainer = OnPolicyDistillTrainer(
            model=str(student_path),
            teacher_model=str(teacher_path),
            args=opd_config(out, max_steps=2, recheck_fraction=0.5, save_strategy="steps", save_steps=1),
            train_dataset=scored_dataset(math_dataset).map(lambda row: {"score": 1.0}),
            reward_funcs=[score_reward],
        )
        seen = watch(trainer)
        trainer.train(resume_from_checkpoint=resume)
        return [output["teacher_selection"].tolist() for output in seen["batches"]]

    uninterrupted = run(tmp_path / "whole")
    resumed = run(tmp_path / "whole", resume=str(tmp_path / "whole" / "checkpoint-1"))
    assert len(uninterrupted) == 2 and resumed == uninterrupted[1:]
    assert uninterrupted[0] != uninterrupted[1]


def test_choose_rows_draws_its_share_and_only_among_the_students_correct_rollouts():
    rewards = torch.tensor([1.0, 0.0, 2.0, float("nan"), 1.0, 1.0, 0.99, 1.0])
    eligible = [True] * 7 + [False]  # the last row's states came from the dataset or the teacher
    correct = {0, 2, 4, 5}
    for fraction, expected in ((0.0, 0), (0.5, 2), (1.0, 4)):
        codes = choose_rows(rewards, eligible, 1.0, fraction, selection_generator(0, 0, 3, 0))
        assert {i for i, c in enumerate(codes) if c != SCORED} == correct
        assert codes.count(RECHECKED) == expected
    # a share that is no whole number of rows: floor(f n + u), f n on average
    counts = [
        choose_rows(rewards, eligible, 1.0, 0.3, selection_generator(0, 0, step, 0)).count(RECHECKED)
        for step in range(400)
    ]
    assert set(counts) == {1, 2} and sum(counts) / len(counts) == pytest.approx(1.2, abs=0.1)
    same = choose_rows(rewards, eligible, 1.0, 0.5, selection_generator(0, 1, 3, 0))
    assert same == choose_rows(rewards, eligible, 1.0, 0.5, selection_generator(0, 1, 3, 0))


@pytest.mark.parametrize("kind", ["served", "two_teachers", "self"])
def test_every_teacher_kind_scores_only_the_rows_not_skipped(tmp_path, student_path, teacher_path, math_dataset, kind):
    """A served teacher (`reverse_kl` and its top-k `divergence`), two in-process teachers routed per row, and the
    student as its own teacher: each is asked for exactly the rows not skipped, and the run trains."""
    extra = {}
    teacher_model, settings = str(teacher_path), {}
    if kind == "two_teachers":
        teacher_model = {"a": str(teacher_path), "b": str(student_path)}
        extra = {"teacher_id": ["a", "b"] * 8}
    elif kind == "self":
        teacher_model, settings = None, {"teacher_model_kind": "live"}
        extra = {"privileged_context": ["The answer is 4."] * 16}
    server = TestTeacherServer(teacher_path) if kind == "served" else None
    try:
        if server is not None:
            server.__enter__()
            teacher_model, settings = None, {"teacher_model_server_url": server.url, "teacher_server_overlap": True}
        for signal in ("reverse_kl", "divergence"):
            out = tmp_path / signal
            trainer = OnPolicyDistillTrainer(
                model=str(student_path),
                teacher_model=teacher_model,
                args=opd_config(out, signal=signal, **settings),
                train_dataset=scored_dataset(math_dataset, extra=extra),
                reward_funcs=[score_reward],
                callbacks=[StateLoggingCallback(sample_rate=1.0)],
            )
            seen = watch(trainer, teacher=kind != "two_teachers")
            if kind == "two_teachers":  # what each routed teacher is asked for, its own rows, instead of the router
                for teacher in trainer.teacher.teachers.values():
                    watch_teacher(teacher, seen)
            trainer.train()
            (output,) = seen["batches"]
            served_divergence = kind == "served" and signal == "divergence"
            asked = seen["divergence"] if signal == "divergence" and not served_divergence else seen["scored"]
            assert sorted(asked) == sorted(rows(output, (SCORED,))), (kind, signal)
            (line,) = read(out / "statelens" / "steps.jsonl")
            assert line["selection/skipped"] == int((output["teacher_selection"] == SKIPPED).sum()) > 0
            states = read(out / "statelens" / "states.jsonl")
            assert {s["skipped"] for s in states} == {"correct", None}
    finally:
        if server is not None:
            server.__exit__(None, None, None)


def watch_teacher(teacher, seen):
    """Record into `seen` every row `teacher` is asked to score or to compute a divergence on."""
    score, divergence_loss = teacher.score, teacher.divergence_loss

    def scoring(prompts, completions, *args, **kwargs):
        seen["scored"] += [list(c) for c in completions]
        return score(prompts, completions, *args, **kwargs)

    def divergence(student, hidden, batch, *args, **kwargs):
        ids, mask = batch["completion_ids"], batch["completion_mask"]
        seen["divergence"] += [ids[i][mask[i].bool()].tolist() for i in range(ids.size(0))]
        return divergence_loss(student, hidden, batch, *args, **kwargs)

    teacher.score, teacher.divergence_loss = scoring, divergence


def test_without_the_lever_nothing_is_selected(tmp_path, student_path, teacher_path, math_dataset):
    """Off (the default), every rollout is scored where it was before (in `_generate`, before the rewards), the batch
    carries no selection and the ledger no selection fields."""
    trainer = OnPolicyDistillTrainer(
        model=str(student_path),
        teacher_model=str(teacher_path),
        args=opd_config(tmp_path, skip_correct_rollouts=False),
        train_dataset=scored_dataset(math_dataset),
        reward_funcs=[score_reward],
        callbacks=[StateLoggingCallback(sample_rate=1.0)],
    )
    seen = watch(trainer)
    trainer.train()
    (output,) = seen["batches"]
    assert "teacher_selection" not in output and len(seen["scored"]) == 8
    (line,) = read(tmp_path / "statelens" / "steps.jsonl")
    assert not any(key.startswith("selection/") for key in line) and "teacher_skipped_tokens" not in line
    assert all("skipped" not in s for s in read(tmp_path / "statelens" / "states.jsonl"))


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"recheck_fraction": 1.5}, "recheck_fraction must be a share in \\[0, 1\\]"),
        ({"recheck_fraction": -0.1}, "recheck_fraction must be a share in \\[0, 1\\]"),
        ({"signal": "continuation"}, "skip_correct_rollouts=True with signal='continuation'"),
        ({"reward_weight": 0.5}, "would lose its reward advantage too"),
        ({"skip_correct_rollouts": False, "correct_reward": 0.5}, "correct_reward=0.5 \\(read only with skip_corr"),
        ({"skip_correct_rollouts": False, "recheck_fraction": 0.3}, "recheck_fraction=0.3 \\(read only with skip_c"),
    ],
)
def test_bad_state_selection_settings_are_refused_with_the_fix(tmp_path, settings, message):
    with pytest.raises(ValueError, match=message):
        opd_config(tmp_path, **settings)


def test_state_selection_without_reward_functions_is_refused_before_any_model_loads(tmp_path, math_dataset):
    with pytest.raises(ValueError, match="no reward_funcs were given.*Pass reward_funcs"):
        OnPolicyDistillTrainer(
            model="no/such-model",  # never loaded: the refusal comes first
            teacher_model="no/such-teacher",
            args=opd_config(tmp_path),
            train_dataset=scored_dataset(math_dataset),
        )


def test_the_stock_configs_refuse_state_selection(tmp_path):
    with pytest.raises(ValueError, match="skip_correct_rollouts=True: TRL's DistillationConfig has the teacher score"):
        opd_config(tmp_path).to_distillation_config()


@pytest.mark.multiproc
@pytest.mark.slow
def test_zero3_a_rank_whose_rollouts_are_all_skipped_still_joins_the_teachers_collectives(
    tmp_path, student_path, teacher_path
):
    """Two ZeRO-3 processes, every rollout correct on rank 1 and none on rank 0, no recheck: rank 1 sends the teacher
    no row, yet joins every teacher forward (`reverse_kl` scoring, the `divergence` loss) and output-layer call on
    stand-ins, so the run finishes; the ledger's sequences show what each rank skipped."""
    from test_multiprocess import launch_zero3

    launch_zero3(
        "opd_zero3_state_selection.py",
        student_path,
        teacher_path,
        tmp_path,
        outputs=tmp_path,
        timeout=480,
        hang="ZeRO-3 ranks deadlocked with a rank whose rollouts were all skipped (no exit in 480 s)",
    )
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    for signal in ("reverse_kl", "divergence"):
        runs = [rank[signal] for rank in ranks]
        for run in runs:  # what actually ran: two ZeRO-3 processes, the teacher a ZeRO-3 engine, every step
            assert (run["world_size"], run["zero_stage"], run["global_step"]) == (2, 3, 2)
            assert run["teacher_engine"] == "DeepSpeedEngine"
        # the case under test: rank 0 scored every row, rank 1 skipped every row, at every step
        assert runs[0]["selections"] == [[SCORED] * 2] * 2 and runs[1]["selections"] == [[SKIPPED] * 2] * 2
        assert runs[0]["teacher_forwards"] == runs[1]["teacher_forwards"] > 0  # rank 1's on stand-ins
        states = read(tmp_path / signal / "statelens" / "states.jsonl")
        for step in (1, 2):
            by_rank = [[s["skipped"] for s in states if s["rank"] == r and s["step"] == step] for r in range(2)]
            assert by_rank == [[None, None], ["correct", "correct"]]
        for line in read(tmp_path / signal / "statelens" / "steps.jsonl"):
            assert (line["selection/skipped"], line["selection/correct"]) == (2, 2)
            assert line["sequences"] == 2  # the supervised ones: rank 0's
