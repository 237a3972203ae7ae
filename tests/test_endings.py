"""How completions end, per step: rollouts (`ends/*`), probes (`drift/ends_*`) and the teacher's view of the end."""

import json
import math

import pytest
import torch
from cpu_settings import CPU

from trl_statelens import OnPolicyDistillConfig, OnPolicyDistillTrainer, StateLensSFTTrainer, StateLoggingCallback
from trl_statelens.lens.endings import END_KINDS, answer_end_position, end_kinds, end_token_ids


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_end_kinds_tell_the_end_token_from_the_limit_and_a_stop():
    ids = torch.tensor([[5, 6, 2, 0], [5, 6, 7, 8], [5, 6, 0, 0]])  # 2 ends, 0 pads
    assert end_kinds(ids, end_ids=[2], limit=4, pad_id=0) == ["end_token", "length_limit", "stop"]


@pytest.mark.parametrize(
    "pieces, position",
    [
        (["3", " +", " 4", " =", " 7", "\n", "####", " 7", "\n", "####"], 8),  # the state after "#### 7"
        (["####", " 1", "2", "<|im_end|>"], 3),  # a number split in two tokens: after its last digit
        (["####", " 1", "2"], 3),  # the completion ends with the answer: the state after it
        (["The", " answer", " is", " 7"], None),
        (["####", " 1"], None),  # cut inside a number? no: " 1" then end; see next
    ][:4],
)
def test_answer_end_position_is_the_state_right_after_the_final_answer(pieces, position):
    assert answer_end_position(pieces) == position


@pytest.fixture(scope="module")
def opd_run(tmp_path_factory, math_trained_path, math_teacher_path, math_dataset):
    """Two OPD steps on the lab with 12-token rollouts (some end, most are cut) and probes every step."""
    out = tmp_path_factory.mktemp("ends")
    args = OnPolicyDistillConfig(
        output_dir=str(out), max_steps=2, per_device_train_batch_size=8, num_generations=2, max_completion_length=12,
        learning_rate=1e-3, **CPU,
    )  # fmt: skip
    probes = StateLoggingCallback(
        probe_prompts=math_dataset["prompt"][:6], probe_steps=1, probe_max_new_tokens=48, sample_rate=1.0
    )
    trainer = OnPolicyDistillTrainer(
        model=str(math_trained_path), teacher_model=str(math_teacher_path), args=args, train_dataset=math_dataset,
        callbacks=[probes],
    )  # fmt: skip
    trainer.train()
    return out, trainer


def test_rollout_ends_are_per_step_shares_and_the_cut_share_is_trls(opd_run):
    out, trainer = opd_run
    steps = read_jsonl(out / "statelens" / "steps.jsonl")
    clipped = [e["completions/clipped_ratio"] for e in trainer.state.log_history if "completions/clipped_ratio" in e]
    assert len(steps) == len(clipped) == 2
    for line, cut in zip(steps, clipped):
        assert sum(line[f"ends/{kind}"] for kind in END_KINDS) == pytest.approx(1.0)
        # no stop strings in training: every rollout not cut ended with the end token, as TRL counts it
        assert line["ends/length_limit"] == pytest.approx(cut) and line["ends/stop"] == 0.0
        assert 0.0 <= line["ends/repeats"] <= 1.0
    ended = [line for line in steps if line["ends/end_token"] > 0]
    assert ended, "no rollout ended inside 12 tokens: the fixture no longer tests the teacher's view of ends"
    assert all(line["teacher_end/logp_at_student_ends"] <= 0.0 for line in ended)
    assert all(0.0 <= line["ends/after_answer"] <= 1.0 for line in steps)
    logged = [e for e in trainer.state.log_history if "statelens/ends/end_token" in e]
    assert [e["statelens/ends/end_token"] for e in logged] == [line["ends/end_token"] for line in steps]


def test_ledger_sequences_say_how_they_ended(opd_run):
    out, _ = opd_run
    samples = read_jsonl(out / "statelens" / "states.jsonl")
    assert samples and all(s["end"] in END_KINDS and isinstance(s["repeats"], bool) for s in samples)
    for sample in samples:
        assert (sample["end"] == "length_limit") == (len(sample["tokens"]) == 12 and sample["end"] != "end_token")


def test_probes_record_their_ends_and_what_the_teacher_wants_after_the_answer(opd_run):
    out, _ = opd_run
    drift = read_jsonl(out / "statelens" / "drift.jsonl")
    assert [line["step"] for line in drift] == [1, 2]
    for line in drift:
        assert sum(line[f"ends_{kind}"] for kind in END_KINDS) == pytest.approx(1.0)
        assert 0.0 < line["answer_frac"] <= 1.0  # the lab student writes `#### N` within 48 tokens
        assert line["teacher_end/logp_after_answer"] <= 0.0 and line["student_end/logp_after_answer"] <= 0.0


def test_the_teachers_end_view_is_its_log_prob_of_ending_right_after_the_answer(opd_run):
    """Recomputed by hand: the teacher's forward over each probe prompt and its completion up to the end of `#### N`,
    the log of its total probability on the end tokens there."""
    _, trainer = opd_run
    callback = next(cb for cb in trainer.callback_handler.callbacks if isinstance(cb, StateLoggingCallback))
    tokenizer = trainer.processing_class
    completions = callback._sample_probes()
    metrics, _ = callback._teacher_disagreement(completions)
    end_ids = end_token_ids(tokenizer, trainer.model)
    by_hand = []
    for prompt, completion in zip(callback._probe_texts(tokenizer), completions):
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
        answered = answer_end_position(tokenizer.batch_decode([[i] for i in completion_ids]))
        if answered is None:
            continue
        ids = torch.tensor([prompt_ids + completion_ids[:answered]])
        with torch.no_grad():
            logits = trainer.teacher.model(input_ids=ids).logits[0, -1].float()
        by_hand.append(torch.log_softmax(logits / trainer.temperature, -1)[end_ids].logsumexp(-1).item())
    assert by_hand and metrics["teacher_end/logp_after_answer"] == pytest.approx(sum(by_hand) / len(by_hand), abs=1e-4)


def test_sft_probes_record_their_ends_too(tmp_path, math_trained_path, math_dataset):
    from trl import SFTConfig

    probes = StateLoggingCallback(probe_prompts=math_dataset["prompt"][:4], probe_steps=1, probe_max_new_tokens=8)
    trainer = StateLensSFTTrainer(
        model=str(math_trained_path),
        args=SFTConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, **CPU),
        train_dataset=math_dataset,
        callbacks=[probes],
    )
    trainer.train()
    (line,) = read_jsonl(tmp_path / "statelens" / "drift.jsonl")
    assert sum(line[f"ends_{kind}"] for kind in END_KINDS) == pytest.approx(1.0)
    assert not math.isnan(line["ends_repeats"])
    assert "ends/end_token" not in read_jsonl(tmp_path / "statelens" / "steps.jsonl")[0]  # no rollouts in SFT


def test_after_answer_advantage_is_read_at_the_state_after_the_final_answer(tokenizer):
    from trl_statelens.opd.loss import after_answer_advantages

    rows = ["3 + 4 = 7\n#### 7" + tokenizer.eos_token, "#### 12\n#### 12", "no answer here"]
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in rows]
    width = max(map(len, ids))
    completion_ids = torch.tensor([row + [tokenizer.pad_token_id] * (width - len(row)) for row in ids])
    supervised = torch.tensor([[i < len(row) for i in range(width)] for row in ids])
    ends = completion_ids == tokenizer.eos_token_id
    logps = -torch.rand(completion_ids.shape)
    teacher_logps = -torch.rand(completion_ids.shape)
    found = after_answer_advantages(tokenizer, completion_ids, supervised, ends, logps, teacher_logps)
    states = [answer_end_position(tokenizer.batch_decode([[i] for i in row])) for row in ids[:2]]
    assert ids[0][states[0]] == tokenizer.eos_token_id and ids[1][states[1]] != tokenizer.eos_token_id
    assert found == [
        (True, pytest.approx((teacher_logps[0, states[0]] - logps[0, states[0]]).item())),
        (False, pytest.approx((teacher_logps[1, states[1]] - logps[1, states[1]]).item())),
    ]


def opd_config(tmp_path, **kwargs):
    defaults = dict(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, num_generations=2,
        max_completion_length=12, learning_rate=1e-3, temperature=1.0,
    )  # fmt: skip
    return OnPolicyDistillConfig(**{**defaults, **CPU, **kwargs})


def test_rollouts_cut_at_the_horizon_count_as_length_limit(tmp_path, student_path, teacher_path, math_dataset):
    """The `horizon` is the rollouts' real limit: a rollout that holds `horizon` tokens without an end was cut there,
    in `ends/*` (as TRL's `completions/clipped_ratio` says) and in the ledger's `end`."""
    probes = StateLoggingCallback(sample_rate=1.0)
    trainer = OnPolicyDistillTrainer(
        model=str(student_path), teacher_model=str(teacher_path), args=opd_config(tmp_path, horizon=3),
        train_dataset=math_dataset.select(range(8)), callbacks=[probes],
    )  # fmt: skip
    trainer.train()
    (line,) = read_jsonl(tmp_path / "statelens" / "steps.jsonl")
    (clipped,) = [
        e["completions/clipped_ratio"] for e in trainer.state.log_history if "completions/clipped_ratio" in e
    ]
    assert clipped > 0 and line["ends/length_limit"] == pytest.approx(clipped) and line["ends/stop"] == 0.0
    samples = read_jsonl(tmp_path / "statelens" / "states.jsonl")
    assert samples and all(len(s["tokens"]) <= 3 for s in samples)
    assert all(s["end"] == "length_limit" for s in samples if s["end"] != "end_token")


def test_ledger_continuations_end_at_the_continuation_length(
    tmp_path, student_path, teacher_path, math_dataset, tokenizer
):
    """A `continuation` row's ledger sequence is the teacher's continuation: cut at `continuation_length`, not
    stopped short of `max_completion_length`."""
    probes = StateLoggingCallback(sample_rate=1.0)
    trainer = OnPolicyDistillTrainer(
        model=str(student_path), teacher_model=str(teacher_path),
        args=opd_config(tmp_path, signal="continuation", continuation_length=3), train_dataset=math_dataset.select(range(8)),
        callbacks=[probes],
    )  # fmt: skip
    trainer.train()
    samples = read_jsonl(tmp_path / "statelens" / "states.jsonl")
    assert samples and any(s["end"] == "length_limit" for s in samples)
    for sample in samples:
        tokens = sample["tokens"]
        cut = "length_limit" if len(tokens) == 3 else "stop"
        assert len(tokens) <= 3 and sample["end"] == ("end_token" if tokens[-1] == tokenizer.eos_token else cut)


def test_end_metrics_cover_every_micro_batch_when_a_generation_spans_two_steps(
    tmp_path, math_trained_path, math_teacher_path, math_dataset, tokenizer
):
    """`steps_per_generation` = 2 x `gradient_accumulation_steps`: step 1 samples the rollouts of both steps and trains
    on half of them, step 2 on the other half. `ends/after_answer` is the share of all of them that write `#### N`,
    and each step's `teacher_end/*` are over its own micro-batches, recomputed here from the ledger (every sequence
    sampled: the teacher's and the student's log-prob of each token)."""
    args = opd_config(tmp_path, max_steps=2, signal="divergence", steps_per_generation=2, max_completion_length=48)
    trainer = OnPolicyDistillTrainer(
        model=str(math_trained_path), teacher_model=str(math_teacher_path), args=args, train_dataset=math_dataset,
        callbacks=[StateLoggingCallback(sample_rate=1.0)],
    )  # fmt: skip
    trainer.train()
    steps = read_jsonl(tmp_path / "statelens" / "steps.jsonl")
    samples = read_jsonl(tmp_path / "statelens" / "states.jsonl")
    assert len(samples) == 8 and {s["step"] for s in samples} == {1, 2}  # 4 a step, all of them
    answered = [answer_end_position(s["tokens"]) for s in samples]
    assert any(answered), "no rollout writes #### N: the test no longer reads the state after the answer"
    assert steps[0]["ends/after_answer"] == pytest.approx(sum(a is not None for a in answered) / len(samples))
    assert "ends/after_answer" not in steps[1]  # step 2 samples nothing
    for line in steps:
        mine = [(s, a) for s, a in zip(samples, answered) if s["step"] == line["step"]]
        at_ends = [t for s, _ in mine for tok, t in zip(s["tokens"], s["teacher_logp"]) if tok == tokenizer.eos_token]
        if at_ends:
            assert line["teacher_end/logp_at_student_ends"] == pytest.approx(sum(at_ends) / len(at_ends), abs=1e-5)
        else:
            assert "teacher_end/logp_at_student_ends" not in line
        for name, ended in (("end", True), ("go_on", False)):
            advantages = [
                s["teacher_logp"][a] - s["logp"][a]
                for s, a in mine
                if a is not None and a < len(s["tokens"]) and (s["tokens"][a] == tokenizer.eos_token) == ended
            ]
            key = f"teacher_end/advantage_after_answer_{name}"
            assert line.get(key) == (
                pytest.approx(sum(advantages) / len(advantages), abs=1e-5) if advantages else None
            )
    assert any(k.startswith("teacher_end/advantage_after_answer") for line in steps for k in line)
    assert any(k.startswith("teacher_end/") for k in steps[1])


def test_teacher_end_metrics_read_only_the_states_the_student_sampled(
    tmp_path, math_trained_path, math_teacher_path, math_dataset, tokenizer
):
    """With `teacher` states in the mix, the teacher's log-prob of its own end tokens (high: it wrote them) is not the
    teacher's view of the student's ends: `teacher_end/logp_at_student_ends` reads the `learner` rows only."""
    args = opd_config(tmp_path, state_source_mix={"learner": 0.5, "teacher": 0.5}, max_completion_length=48)
    args.per_device_train_batch_size = 16
    trainer = OnPolicyDistillTrainer(
        model=str(math_trained_path), teacher_model=str(math_teacher_path), args=args, train_dataset=math_dataset,
        callbacks=[StateLoggingCallback(sample_rate=1.0)],
    )  # fmt: skip
    trainer.train()
    (line,) = read_jsonl(tmp_path / "statelens" / "steps.jsonl")
    samples = read_jsonl(tmp_path / "statelens" / "states.jsonl")

    def at_ends(source):
        return [
            t
            for s in samples
            if s["source"] == source
            for token, t in zip(s["tokens"], s["teacher_logp"])
            if token == tokenizer.eos_token
        ]

    learner, teacher = at_ends("learner"), at_ends("teacher")
    assert learner and teacher, "the test needs ends in both kinds of rows"
    assert line["teacher_end/logp_at_student_ends"] == pytest.approx(sum(learner) / len(learner), abs=1e-5)
