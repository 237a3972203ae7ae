"""The real-model study's dev rule (recipes/studies/real_opd_study.py), on dev curves written by hand."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "recipes" / "studies"))
import real_opd_study as study  # noqa: E402


def write_curve(out: Path, name: str, scores: dict[int, float]) -> None:
    run = out / "dev" / name
    run.mkdir(parents=True)
    history = [{"step": s, study.DEV_METRIC: v} for s, v in scores.items()] + [{"step": 40, "loss": 0.1}]
    (run / "log_history.json").write_text(json.dumps(history))


def test_the_rule_takes_the_fewest_steps_within_the_margin_of_the_best_smoothed_score(tmp_path):
    write_curve(tmp_path, "C1", {10: 0.20, 20: 0.50, 30: 0.60, 40: 0.62})
    write_curve(tmp_path, "C2", {10: 0.30, 20: 0.58, 30: 0.66, 40: 0.70})
    chosen = study.choose(tmp_path, base=0.125, steps=[10, 20, 30, 40])
    # smoothed: C1 0.35 0.433 0.573 0.61; C2 0.44 0.513 0.647 0.68 -> best 0.68, within 0.05: C2 at 30 (0.647)
    assert chosen["best_smoothed"] == pytest.approx(0.68)
    assert (chosen["candidate"], chosen["steps"]) == ("C2", 30)
    assert chosen["dev"] == pytest.approx(0.66) and chosen["moves"]
    assert study.choose(tmp_path, base=0.60, steps=[10, 20, 30, 40])["moves"] is False  # 0.68 < 0.60 + 0.10


def test_a_candidate_without_a_score_at_a_step_stops_the_rule(tmp_path):
    write_curve(tmp_path, "C1", {10: 0.2, 20: 0.3, 30: 0.3, 40: 0.3})
    write_curve(tmp_path, "C2", {10: 0.2, 20: 0.3, 40: 0.3})
    with pytest.raises(ValueError, match=r"no dev score at steps \[30\]"):
        study.choose(tmp_path, base=0.1, steps=[10, 20, 30, 40])


def write_ends_curve(out: Path, name: str, clean: dict[int, float], repeats: dict[int, float]) -> None:
    run = out / "dev" / name
    run.mkdir(parents=True)
    history = [{"step": s, "eval/gsm8k/clean_format": v, "eval/gsm8k/repeats": repeats[s]} for s, v in clean.items()]
    (run / "log_history.json").write_text(json.dumps(history))


def test_the_ends_rule_smooths_backwards_keeps_the_repeat_guard_and_takes_the_fewest_steps(tmp_path):
    """The 2026-12-04 rule (STUDY.md): smoothed = mean of this and the previous scored step's clean share; pairs whose
    repeat share exceeds the base's + 0.05 are out; the fewest steps within 0.03 of the best, K1 first."""
    write_ends_curve(tmp_path, "K1", {10: 0.30, 20: 0.50, 30: 0.70, 40: 0.74}, {10: 0.2, 20: 0.2, 30: 0.5, 40: 0.2})
    write_ends_curve(tmp_path, "K2", {10: 0.40, 20: 0.60, 30: 0.66, 40: 0.64}, {10: 0.2, 20: 0.2, 30: 0.2, 40: 0.2})
    base = {"answer_found": 0.1, "clean_format": 0.0, "repeats": 0.40}
    chosen = study.choose_ends(tmp_path, base, [10, 20, 30, 40])
    # K1 smoothed 0.30 0.40 0.60(guard fails: 0.5 > 0.45) 0.72; K2 0.40 0.50 0.63 0.65 -> best 0.72, within 0.03:
    # only K1 at 40 (K2's 0.65 is 0.07 below)
    assert chosen["best_smoothed"] == pytest.approx(0.72)
    assert (chosen["candidate"], chosen["steps"], chosen["moves"]) == ("K1", 40, True)
    k1_30 = next(r for r in chosen["candidates"] if (r["candidate"], r["steps"]) == ("K1", 30))
    assert not k1_30["guard"] and k1_30["smoothed"] == pytest.approx(0.60)
    base["repeats"] = 0.10  # every pair's repeat share is over 0.15: nothing passes, nothing is chosen
    assert study.choose_ends(tmp_path, base, [10, 20, 30, 40])["candidate"] is None
    base.update(repeats=0.40, clean_format=0.65)  # best 0.72 < 0.65 + 0.10: it does not move
    assert study.choose_ends(tmp_path, base, [10, 20, 30, 40])["candidate"] is None


def test_the_demo_rule_takes_the_fewest_steps_that_reach_the_reference_and_fit_the_demo_time():
    curve = {10: 0.35, 20: 0.45}
    assert study.demo_steps(curve, reference=0.391, step_seconds=15) == 20  # step 10 is below the reference
    assert study.demo_steps({10: 0.40, 20: 0.45}, reference=0.391, step_seconds=15) == 10
    # 20 steps of 20 s plus the overhead is 640 s, over the 600 s a demo may take
    assert study.demo_steps(curve, reference=0.391, step_seconds=20) is None
    assert study.demo_steps(curve, reference=0.5, step_seconds=5) is None


# ----- test phase ---------------------------------------------------------------------------------------------------
def write_gsm8k(folder: Path, world) -> None:
    """A GSM8K folder of lab problems: `train.jsonl` the pool, `test.jsonl` the scored split."""
    study.write_rows(folder, {"train": world.math("train", n=12), "test": world.math("test", n=10)})


@pytest.mark.parametrize("view", ["solution", "shots"])
def test_the_teacher_is_scored_on_the_students_items_behind_its_own_view(tmp_path, world, tokenizer, view):
    from real_teacher_advantage import shots_context

    from trl_statelens.data import read_gsm8k_rows

    write_gsm8k(tmp_path, world)
    pool = read_gsm8k_rows(str(tmp_path), "train")
    student = study.GSM8KTask(str(tmp_path), "test", prompt_format="chat", limit=4)
    teacher = study.TeacherViewTask(view, pool, source=str(tmp_path), split="test", prompt_format="chat", limit=4)
    examples = student.examples()
    assert [e["question"] for e in teacher.examples()] == [e["question"] for e in examples]
    for prompt, example in zip(teacher.prompt_texts(tokenizer), examples):
        assert example["question"] in prompt
        assert (example["answer"] if view == "solution" else shots_context(pool)) in prompt
        assert prompt.endswith(student.prompt_texts(tokenizer)[0][-20:])  # the chat template's assistant turn


def test_reference_nll_is_the_models_loss_on_the_solution_tokens(tmp_path, world, student_path):
    """Per item, the mean NLL of the reference solution's tokens after the student's chat prompt: the model's own
    loss with the prompt's labels masked."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    write_gsm8k(tmp_path / "gsm8k", world)
    nll = study.reference_nll(str(student_path), tmp_path, smoke=True)
    tokenizer = AutoTokenizer.from_pretrained(student_path)
    model = AutoModelForCausalLM.from_pretrained(student_path).eval()
    examples = study.GSM8KTask(str(tmp_path / "gsm8k"), "test", prompt_format="chat", limit=2).examples()
    assert sorted(nll) == sorted(e["question"] for e in examples)
    for e in examples:
        prompt = tokenizer.apply_chat_template(
            study.chat_prompt(e["question"]), add_generation_prompt=True, tokenize=False
        )
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        ids = torch.tensor([prompt_ids + tokenizer(e["answer"], add_special_tokens=False)["input_ids"]])
        labels = ids.clone()
        labels[0, : len(prompt_ids)] = -100
        with torch.no_grad():
            assert nll[e["question"]] == pytest.approx(model(ids, labels=labels).loss.item(), rel=1e-5)


def write_items(path: Path, gsm8k: list[tuple[str, str | None, bool]], truthfulqa: list[tuple[str, float]]) -> Path:
    lines = [
        {"task": "gsm8k", "question": q, "strict": a, "correct_strict": c, "correct_flexible": c,
         "output": "" if a is None else f"#### {a}\n" * (1 + c)}  # a right answer repeats its line here
        for q, a, c in gsm8k
    ]  # fmt: skip
    lines += [{"task": "truthfulqa", "question": q, "mc1": v, "mc2": v / 2} for q, v in truthfulqa]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return path


def test_arms_are_paired_by_question_and_the_format_is_a_strict_answer_found(tmp_path):
    base = write_items(
        tmp_path / "base.jsonl", [("a", None, False), ("b", "3", True), ("c", None, False)], [("t", 0.0)]
    )
    # the same items in another order: OPD found a `#### N` answer on a and c, got c right
    opd = write_items(tmp_path / "opd.jsonl", [("c", "5", True), ("a", "7", False), ("b", "3", True)], [("t", 1.0)])
    before, after = (
        study.arm_scores(base, {"a": 2.0, "b": 1.0, "c": 1.0}),
        study.arm_scores(opd, {"a": 1.0, "b": 1.0, "c": 1.0}),
    )
    assert before["format"] == {"a": 0.0, "b": 1.0, "c": 0.0}
    change = {m: study.paired(after[m], before[m]) for m in after}
    assert change["format"]["difference"] == pytest.approx(2 / 3) and change["format"]["items"] == 3
    assert change["strict"]["difference"] == pytest.approx(1 / 3)
    assert after["repeats"] == {"a": 0.0, "b": 1.0, "c": 1.0} and before["repeats"] == {"a": 0.0, "b": 1.0, "c": 0.0}
    assert change["nll"]["difference"] == pytest.approx(-1 / 3)
    assert change["mc1"]["difference"] == 1.0 and change["mc2"]["difference"] == 0.5
    assert change["format"]["low"] <= change["format"]["difference"] <= change["format"]["high"]


def test_the_sft_baseline_config_reads_the_whole_pool_and_stops_at_the_opd_runs_flops(tmp_path):
    from trl import ModelConfig, SFTConfig, TrlParser

    sys.path.insert(0, str(Path(__file__).parents[1] / "recipes"))
    from sft import SFTScriptArguments

    command = study.sft_test_command(tmp_path / "data-test", tmp_path, max_flops=1.5e15, smoke=False)
    parser = TrlParser((SFTScriptArguments, SFTConfig, ModelConfig))
    args, training, model = parser.parse_args_and_config(args=command[2:])
    assert args.max_flops == 1.5e15 and args.train_size is None and args.prompt_format == "chat"
    assert args.eval_limit == "gsm8k=250,truthfulqa=200" and args.eval_before is False
    assert (training.per_device_train_batch_size, training.learning_rate, training.lr_scheduler_type) == (
        8,
        2e-4,
        "constant",
    )
    assert (model.use_peft, model.lora_r, model.lora_alpha) == (True, 16, 32)
    assert training.max_steps > 1.5e15 / (6 * 135e6 * 8 * 512)  # the FLOPs, not max_steps, end the run


def test_the_lens_summary_reads_the_runs_records_first_steps_against_last(tmp_path):
    """Hand-written records: the first and last `window` steps' means, and the sampled KL (`logp - teacher_logp`)
    of the ledger's sequences split by tokens holding a digit and by position, in each half of the run."""
    ledger = tmp_path / "statelens"
    ledger.mkdir()
    steps = [{"step": s, "teacher_kl/supervised": s / 10, "teacher_nll": 1.0, "offpolicy_gap": 0.1 * s,
              "state_nll": 2.0} for s in range(1, 7)]  # fmt: skip
    (ledger / "steps.jsonl").write_text("\n".join(json.dumps(line) for line in steps))
    history = [{"step": s, "completions/mean_length": 10 * s, "completions/clipped_ratio": 1.0} for s in range(1, 7)]
    (tmp_path / "log_history.json").write_text(json.dumps(history + [{"step": 6, "train_runtime": 1.0}]))
    samples = [
        {"step": 2, "tokens": ["The", " 4", "2"], "prefix_len": [0, 1, 20], "logp": [-1.0, -2.0, -1.0],
         "teacher_logp": [-1.5, -2.0, -0.5], "teacher_context_len": 800},
        {"step": 6, "tokens": ["So"], "prefix_len": [70], "logp": [-1.0], "teacher_logp": [-1.25],
         "teacher_context_len": 900},
    ]  # fmt: skip
    (ledger / "states.jsonl").write_text("\n".join(json.dumps(s) for s in samples))
    lens = study.lens_summary(tmp_path, window=2)
    assert lens["teacher_kl/supervised"] == {"first": pytest.approx(0.15), "last": pytest.approx(0.55)}
    assert lens["completions/mean_length"] == {"first": 15, "last": 55}
    first, second = lens["samples_first_half"], lens["samples_second_half"]
    assert (first["sequences"], first["tokens"], second["tokens"]) == (1, 3, 1)
    assert first["number_frac"] == pytest.approx(2 / 3)
    assert first["kl_number"] == pytest.approx((0.0 - 0.5) / 2) and first["kl_other"] == pytest.approx(0.5)
    assert first["kl_by_position"] == {"0-15": pytest.approx(0.25), "16-31": pytest.approx(-0.5)}
    assert second["kl_number"] is None and second["kl_by_position"] == {"64-127": pytest.approx(0.25)}
    assert lens["teacher_context_per_rollout"] == 850 and "drift_last" not in lens


def test_honest_flops_replays_the_shared_start_as_the_base_teacher_runs_it():
    """`honest_flops.py`'s replay: a step's shared start is what every row's prompt begins with (never a whole prompt,
    none below the self teacher's minimum); the `base` teacher's forward of it runs again only when it changes; the
    SFT step at a budget is the first whose `flops_total/total` reaches it."""
    import honest_flops

    start = list(range(100))
    same = [[*start, 500, 1], [*start, 501, 2]]
    longer = [[*start, 7, 500], [*start, 7, 501]]  # the rows' questions share a first word: a longer start
    short = [[1, 2, 3, 4], [1, 2, 3, 5]]  # below SHARED_PREFIX_MIN_TOKENS: no shared forward
    replay = honest_flops.replay_shared_starts([same, same, longer, same, short])
    assert replay == [(100, True), (100, False), (101, True), (100, True), (0, False)]
    ledger = [{"step": s, "flops_total/total": 10.0 * s} for s in range(1, 6)]
    assert honest_flops.first_step_reaching(ledger, 25.0)["step"] == 3
    assert honest_flops.first_step_reaching(ledger, 30.0)["step"] == 3
