import json
import math
import re
import warnings

import pytest
import torch
from cpu_settings import CPU
from datasets import Dataset
from transformers import AutoModelForCausalLM
from trl import DistillationConfig, DistillationTrainer

from trl_statelens import OnPolicyDistillConfig, OnPolicyDistillTrainer, StateLoggingCallback
from trl_statelens.lab import build_model
from trl_statelens.lens.records import STATE_SOURCES
from trl_statelens.teachers.in_process import rows_shifted


def opd_config(tmp_path, **kwargs):
    defaults = dict(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=8,
        num_generations=2,
        max_completion_length=16,
        learning_rate=1e-3,
    )
    return OnPolicyDistillConfig(**{**defaults, **CPU, **kwargs})


def log_history(trainer, key):
    return [entry[key] for entry in trainer.state.log_history if key in entry]


# ----- sanity: a teacher identical to the student says nothing ------------------------------------------------
@pytest.mark.parametrize("signal", ["reverse_kl", "divergence"])
def test_teacher_equal_to_student_gives_zero_kl_and_zero_gradient(tmp_path, math_trained_path, math_dataset, signal):
    trainer = OnPolicyDistillTrainer(
        model=str(math_trained_path),
        teacher_model=str(math_trained_path),
        args=opd_config(tmp_path, max_steps=1, signal=signal, temperature=1.0),
        train_dataset=math_dataset,
    )
    trainer.train()
    assert abs(log_history(trainer, "teacher_kl/sampled")[0]) < 1e-4
    assert log_history(trainer, "grad_norm")[0] < 1e-4


# ----- learning: the student moves toward a teacher with preferences -------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize(
    "signal, student, learning_rate",
    [
        # Reverse KL on the student's own samples (sampled or full-vocabulary) needs a student with some math
        # already: from a random-init one it first commits to modes the teacher dislikes, and the KL rises for
        # many steps (TRL's DistillationTrainer does the same). Cross-entropy on teacher tokens works from scratch.
        ("reverse_kl", "math_trained_path", 1e-3),
        ("continuation", "student_path", 5e-3),
        ("divergence", "math_trained_path", 1e-3),
    ],
)
def test_short_run_moves_the_student_toward_the_teacher(
    request, tmp_path, math_teacher_path, math_dataset, signal, student, learning_rate
):
    trainer = OnPolicyDistillTrainer(
        model=str(request.getfixturevalue(student)),
        teacher_model=str(math_teacher_path),
        args=opd_config(
            tmp_path,
            max_steps=30,
            signal=signal,
            learning_rate=learning_rate,
            **({"continuation_length": 8} if signal == "continuation" else {}),
        ),
        train_dataset=math_dataset,
    )
    trainer.train()
    # reverse_kl / divergence: the student's own tokens become likelier under the teacher;
    # continuation: the student's cross-entropy on the teacher's tokens falls
    curve = log_history(trainer, "loss" if signal == "continuation" else "teacher_kl/sampled")
    first, last = sum(curve[:5]) / 5, sum(curve[-5:]) / 5
    assert last < 0.8 * first, curve


# ----- parity with TRL's DistillationTrainer ------------------------------------------------------------------------
def _save_other_architecture(path, architecture, tokenizer, seed):
    """A tiny random-init model of another family with the lab vocabulary: Gemma2 (final logit soft-capping, set
    low so it matters) or Phi (an untied LM head with a bias, set non-zero so it matters)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, PhiConfig, PhiForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                  bos_token_id=None)  # fmt: skip
    if architecture == "gemma2":
        model = Gemma2ForCausalLM(
            Gemma2Config(**common, num_key_value_heads=2, head_dim=16, final_logit_softcapping=2.0)
        )
    else:
        model = PhiForCausalLM(PhiConfig(**common, tie_word_embeddings=False))
        assert model.lm_head.bias is not None
        torch.nn.init.normal_(model.lm_head.bias, std=1.0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.parametrize("architecture", ["qwen3", "gemma2", "phi"])
def test_divergence_beta1_matches_distillation_trainer_loss(
    tmp_path, tokenizer, student_path, math_trained_path, math_dataset, architecture
):
    if architecture != "qwen3":
        student_path = _save_other_architecture(tmp_path / "student", architecture, tokenizer, seed=0)
        math_trained_path = _save_other_architecture(tmp_path / "teacher", architecture, tokenizer, seed=1)
    ours = OnPolicyDistillTrainer(
        model=str(student_path),
        teacher_model=str(math_trained_path),
        args=opd_config(tmp_path / "ours", signal="divergence", jsd_beta=1.0),
        train_dataset=math_dataset,
    )
    prompts = [{"prompt": p} for p in math_dataset["prompt"][:4] for _ in range(2)]
    ours.model.train()
    batch = ours._generate_and_score_completions(prompts)

    stock = DistillationTrainer(
        model=str(student_path),
        teacher_model=str(math_trained_path),
        args=DistillationConfig(output_dir=str(tmp_path / "stock"), beta=1.0, max_completion_length=16, **CPU),
        train_dataset=math_dataset.select_columns(["prompt"]),
    )
    stock.model.load_state_dict(ours.model.state_dict())
    stock.model.train()
    stock_inputs = {k: batch[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
    stock_inputs["num_items_in_batch"] = batch["num_items_in_batch"]
    ours_loss = ours.compute_loss(ours.model, batch)
    stock_loss = stock.compute_loss(stock.model, stock_inputs)
    assert ours_loss.item() > 0
    torch.testing.assert_close(ours_loss, stock_loss, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("architecture", ["qwen3", "gemma2", "phi"])
def test_divergence_records_come_from_the_loss_pass_equal_to_separate_passes(
    tmp_path, monkeypatch, tokenizer, student_path, teacher_path, math_dataset, architecture
):
    """The ledger's student log-prob and entropy and teacher log-prob per supervised token come from the loss's own
    pass over the vocabulary (no `_head_logps` pass) and equal what separate passes give (the records before they
    did), with a logit soft-cap (gemma2) and an LM-head bias (phi)."""
    from trl.kernels import ChunkedLogProbFunction

    from trl_statelens.heads import _completion_hidden_states, _head_logps

    if architecture != "qwen3":
        student_path = _save_other_architecture(tmp_path / "student", architecture, tokenizer, seed=0)
        teacher_path = _save_other_architecture(tmp_path / "teacher", architecture, tokenizer, seed=1)
    trainer = OnPolicyDistillTrainer(
        model=str(student_path),
        teacher_model=str(teacher_path),
        args=opd_config(tmp_path, signal="divergence", jsd_beta=0.5, temperature=0.7),
        train_dataset=math_dataset,
    )
    trainer.model.train()
    batch = trainer._generate_and_score_completions(_prompts(math_dataset, 8))
    recorded, head_passes = {}, []
    record_states, forward = trainer._record_states, ChunkedLogProbFunction.forward
    trainer._record_states = lambda **kwargs: (recorded.update(kwargs), record_states(**kwargs))[1]
    counted = lambda ctx, *args: (head_passes.append(args[-1]), forward(ctx, *args))[1]  # noqa: E731
    monkeypatch.setattr(ChunkedLogProbFunction, "forward", staticmethod(counted))
    trainer.compute_loss(trainer.model, batch)
    monkeypatch.undo()
    assert head_passes == []  # no other pass over the vocabulary than the divergence kernel's

    supervised = recorded["supervised_mask"]
    assert supervised.sum() > 20
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    tokens, width = batch["completion_ids"], batch["completion_ids"].size(1)
    expected = {}
    with torch.no_grad():
        for name, model in (("student", trainer.model), ("teacher", trainer.teacher_model)):
            model = trainer.accelerator.unwrap_model(model)
            hidden = _completion_hidden_states(model, input_ids, attention_mask, width)
            expected[name] = _head_logps(model, hidden, tokens, trainer.temperature, True)
    pad = lambda x: torch.nn.functional.pad(x, (batch["prompt_ids"].size(1), 0))  # noqa: E731
    for field, want in (
        ("logps", expected["student"][0]),
        ("entropy", expected["student"][1]),
        ("teacher_logps", expected["teacher"][0]),
    ):
        torch.testing.assert_close(recorded[field][supervised], pad(want)[supervised], rtol=0, atol=2e-6)


@pytest.mark.parametrize("compact", [False, True])
def test_divergence_pass_gives_trl_loss_and_gradient(monkeypatch, student_path, teacher_path, compact):
    """`divergence_and_token_logps`'s loss and its gradients (student hidden states and head) are those of TRL's
    `_chunked_divergence_loss`, on a mask with unsupervised completion positions; its per-token values are the same
    whether every position is projected (CPU) or the wanted ones only (`compact`, as on Triton devices)."""
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    from trl_statelens import heads

    student = AutoModelForCausalLM.from_pretrained(student_path)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_path)
    torch.manual_seed(0)
    student_hidden = torch.randn(3, 5, student.config.hidden_size, requires_grad=True)
    teacher_hidden = torch.randn(3, 5, teacher.config.hidden_size)
    tokens = torch.randint(0, student.config.vocab_size, (3, 5))
    loss_mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 1, 1, 1], [0, 0, 0, 0, 0]])
    completion_mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    head, teacher_head = student.get_output_embeddings().weight, teacher.get_output_embeddings().weight

    def loss_and_grads(loss):
        student_hidden.grad, head.grad = None, None
        loss.backward()
        return loss.detach(), student_hidden.grad.clone(), head.grad.clone()

    stock = loss_and_grads(
        _chunked_divergence_loss(
            student_hidden, teacher_hidden, head, teacher_head, loss_mask, 0.5, num_items_in_batch=7.0, temperature=0.8
        )[0]
    )
    every_position = heads.divergence_and_token_logps(
        student, student_hidden, teacher, teacher_hidden, tokens, loss_mask, completion_mask, 0.5, 7.0, 0.8
    )
    monkeypatch.setattr(heads, "_use_triton", lambda device: compact)
    out = heads.divergence_and_token_logps(
        student, student_hidden, teacher, teacher_hidden, tokens, loss_mask, completion_mask, 0.5, 7.0, 0.8
    )
    ours = loss_and_grads(out.loss)
    assert ours[0] > 0
    for a, b in zip(ours, stock):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    wanted = completion_mask.bool()
    for field in ("logps", "entropies", "teacher_logps"):
        values = getattr(out, field)
        torch.testing.assert_close(values[wanted], getattr(every_position, field)[wanted], rtol=0, atol=1e-6)
        assert (values[wanted] != 0).all() and (values[~wanted] == 0).all()


def test_grpo_reward_metrics_are_logged_only_with_reward_functions(tmp_path, student_path, teacher_path, math_dataset):
    """Without reward functions GRPO still scores the rollouts (with `no_reward`): its constant reward metrics, the
    ledger's per-sequence reward of 0 and its reward groups are dropped. With one, they are all there."""

    def length_reward(completions, **kwargs):
        return [float(len(c)) for c in completions]

    reward_keys = {"reward", "reward_std", "frac_reward_zero_std"}
    for name, reward_funcs in (("none", None), ("one", [length_reward])):
        trainer = OnPolicyDistillTrainer(
            model=str(student_path),
            teacher_model=str(teacher_path),
            args=opd_config(tmp_path / name, max_steps=2, logging_steps=1),
            train_dataset=math_dataset,
            reward_funcs=reward_funcs,
            callbacks=[StateLoggingCallback(sample_rate=1.0)],
        )
        trainer.train()
        logged = {key for entry in trainer.state.log_history[:-1] for key in entry}  # the last one is the summary
        states = [json.loads(line) for line in open(tmp_path / name / "statelens" / "states.jsonl")]
        rewarded = {key for key in logged if key in reward_keys or key.startswith("rewards/")}
        groups = tmp_path / name / "statelens" / "groups.jsonl"
        if reward_funcs is None:
            assert rewarded == set() and "teacher_kl/sampled" in logged
            assert {s["reward"] for s in states} == {None}
            assert not groups.exists() and "statelens/reward_groups/spread_frac" not in logged
        else:
            assert rewarded == reward_keys | {"rewards/length_reward/mean", "rewards/length_reward/std"}
            assert all(s["reward"] > 0 for s in states)
            assert len(groups.read_text().splitlines()) == 2 * 8 // 2  # 2 steps of 8 rollouts, 2 a prompt


# ----- the teacher-free control ----------------------------------------------------------------------------------
def test_constant_advantage_trains_the_same_whatever_the_teacher(
    tmp_path, math_trained_path, math_teacher_path, math_dataset
):
    """With `constant_advantage` the teacher only scores for the lens: two teachers that disagree give the same
    parameters after two steps, every supervised token carries the constant, and the teacher's KL is still logged.
    Without it the two teachers train the student apart."""

    def trained(name, teacher, **kwargs):
        trainer = OnPolicyDistillTrainer(
            model=str(math_trained_path),
            teacher_model=str(teacher),
            args=opd_config(tmp_path / name, max_steps=2, logging_steps=1, temperature=1.0, **kwargs),
            train_dataset=math_dataset,
        )
        trainer.train()
        return trainer, torch.cat([p.detach().flatten() for p in trainer.model.parameters()])

    control, control_params = trained("control", math_teacher_path, constant_advantage=-0.5)
    _, self_params = trained("self", math_trained_path, constant_advantage=-0.5)
    _, teacher_params = trained("teacher", math_teacher_path)
    _, equal_params = trained("equal", math_trained_path)
    assert torch.equal(control_params, self_params)
    assert not torch.allclose(teacher_params, equal_params)
    assert log_history(control, "statelens/weight/mean") == [pytest.approx(-0.5)] * 2
    assert all(kl > 0.01 for kl in log_history(control, "teacher_kl/sampled"))  # the lens still sees the teacher


# ----- the shuffled-teacher control -----------------------------------------------------------------------------
def test_rows_shifted_gives_each_row_another_rows_values_cut_or_repeated_to_its_length():
    lengths = torch.tensor([3, 5, 1, 4])
    mask = (torch.arange(5)[None, :] < lengths[:, None]).long()
    values = torch.arange(4 * 5 * 2, dtype=torch.float32).reshape(4, 5, 2)  # every (row, position) distinct
    shifted = rows_shifted(values, mask, 1)
    assert shifted.shape == values.shape
    sources = []
    for row in range(4):
        source = (row + 1) % 4
        sources.append(source)
        for position in range(5):
            assert torch.equal(shifted[row, position], values[source, position % lengths[source]])
    assert sorted(sources) == [0, 1, 2, 3] and all(s != r for r, s in enumerate(sources))  # a permutation, no row kept
    assert torch.equal(
        rows_shifted(values, mask, 4), values[torch.arange(4)[:, None], torch.arange(5) % lengths[:, None]]
    )


@pytest.mark.parametrize("signal", ["reverse_kl", "divergence"])
def test_shifted_teacher_equal_to_student_trains_on_other_rollouts_values(
    tmp_path, math_trained_path, math_dataset, signal
):
    """A teacher equal to the student says nothing (the test above); with `teacher_row_shift` each rollout gets
    another rollout's values, so the KL and the gradient are no longer zero. Failed with the shift left out of either
    signal's path."""
    trainer = OnPolicyDistillTrainer(
        model=str(math_trained_path),
        teacher_model=str(math_trained_path),
        args=opd_config(tmp_path, max_steps=1, signal=signal, temperature=1.0, teacher_row_shift=1),
        train_dataset=math_dataset,
    )
    trainer.train()
    assert abs(log_history(trainer, "teacher_kl/sampled")[0]) > 1e-3  # 100x the unshifted bound above
    assert log_history(trainer, "grad_norm")[0] > 1e-2


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(teacher_row_shift=-1), "teacher_row_shift must be 0"),
        (dict(teacher_row_shift=1, signal="continuation"), "with signal='continuation'"),
        (dict(teacher_row_shift=1, constant_advantage=-0.5), "with constant_advantage"),
        (dict(teacher_row_shift=1, teacher_model_server_url="http://localhost:1"), "in-process teacher"),
    ],
)
def test_teacher_row_shift_refused_where_it_has_no_values_to_move(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        opd_config(tmp_path, **kwargs)


def test_constant_advantage_needs_reverse_kl(tmp_path):
    with pytest.raises(ValueError, match="constant_advantage=-0.5 with signal='divergence'"):
        opd_config(tmp_path, signal="divergence", constant_advantage=-0.5)


# ----- state sources ---------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_state_source_mix_is_honoured_per_sample_and_recorded(tmp_path, student_path, math_trained_path, math_dataset):
    mix = {"learner": 0.5, "dataset": 0.3, "teacher": 0.2}
    trainer = OnPolicyDistillTrainer(
        model=str(student_path),
        teacher_model=str(math_trained_path),
        args=opd_config(tmp_path, max_steps=8, state_source_mix=mix),
        train_dataset=math_dataset,
        callbacks=[StateLoggingCallback(sample_rate=1.0)],
    )
    drawn = []
    original = trainer._generate_and_score_completions

    def spy(inputs):
        out = original(inputs)
        sources = [STATE_SOURCES[code] for code in out["row_source"].tolist()]
        drawn.extend(sources)
        # dataset rows carry the reference answer, teacher-forced
        for source, ids, mask, row in zip(sources, out["completion_ids"], out["completion_mask"], inputs):
            if source == "dataset":
                text = trainer._tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
                assert text == row["completion"][: len(text)] and len(text) > 10
        return out

    trainer._generate_and_score_completions = spy
    trainer.train()
    assert len(drawn) == 64
    for source, p in mix.items():
        share = drawn.count(source) / len(drawn)
        assert abs(share - p) < 3 * (p * (1 - p) / len(drawn)) ** 0.5 + 1e-9, (source, share)

    # the ledger records every sequence's source; its token shares follow the sequence shares
    states = [json.loads(line) for line in open(tmp_path / "statelens" / "states.jsonl")]
    assert sorted(s["source"] for s in states) == sorted(drawn)
    steps = [json.loads(line) for line in open(tmp_path / "statelens" / "steps.jsonl")]
    assert [s["step"] for s in steps] == list(range(1, 9))
    for source in mix:
        tokens = sum(s[f"source_frac/{source}"] * s["supervised_tokens"] for s in steps)
        from_sequences = sum(s["num_supervised"] for s in states if s["source"] == source)
        assert tokens == pytest.approx(from_sequences)
    # the ledger's teacher_kl/supervised averages the learner's own tokens only, as the trainer's metric does
    supervised = [s["teacher_kl/supervised"] for s in steps]
    assert supervised == pytest.approx(log_history(trainer, "teacher_kl/sampled"), rel=1e-4, abs=1e-6)


def test_dataset_states_keep_their_reference_column_with_remove_unused_columns(
    tmp_path, student_path, teacher_path, math_dataset
):
    trainer = OnPolicyDistillTrainer(
        model=str(student_path),
        teacher_model=str(teacher_path),
        args=opd_config(tmp_path, max_steps=1, state_source_mix={"dataset": 1.0}, remove_unused_columns=True),
        train_dataset=math_dataset,
    )
    batches = []
    original = trainer._generate_and_score_completions

    def spy(inputs):
        batches.append((inputs, original(inputs)))
        return batches[-1][1]

    trainer._generate_and_score_completions = spy
    trainer.train()
    inputs, out = batches[0]
    assert set(inputs[0]) == {"prompt", "completion"}  # the other columns were removed, the reference kept
    for ids, mask, row in zip(out["completion_ids"], out["completion_mask"], inputs):
        text = trainer._tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
        assert text == row["completion"][: len(text)] and len(text) > 10


@pytest.mark.parametrize("resume_at, refused", [(1, True), (2, False)])
def test_resume_inside_a_generation_batch_is_refused(
    tmp_path, student_path, teacher_path, math_dataset, resume_at, refused
):
    """steps_per_generation=2 micro-batches with gradient_accumulation_steps=1: a generation batch spans two steps,
    so checkpoint-1 sits inside one and checkpoint-2 at its end."""

    def trainer(max_steps):
        config = dict(signal="continuation", continuation_length=2, max_completion_length=4, steps_per_generation=2)
        return OnPolicyDistillTrainer(
            model=str(student_path),
            teacher_model=str(teacher_path),
            args=opd_config(
                tmp_path,
                max_steps=max_steps,
                per_device_train_batch_size=2,
                save_strategy="steps",
                save_steps=1,
                **config,
            ),
            train_dataset=math_dataset,
            state_logging=False,
        )

    trainer(resume_at).train()
    resumed = trainer(3)
    checkpoint = str(tmp_path / f"checkpoint-{resume_at}")
    if refused:
        with pytest.raises(ValueError, match="checkpoint-1: it was saved after 1 micro-batches, inside a generation"):
            resumed.train(resume_from_checkpoint=checkpoint)
    else:
        resumed.train(resume_from_checkpoint=checkpoint)
        assert resumed.state.global_step == 3


def test_continuation_ledger_has_no_teacher_kl(tmp_path, student_path, math_trained_path, math_dataset):
    trainer = OnPolicyDistillTrainer(
        model=str(student_path),
        teacher_model=str(math_trained_path),
        args=opd_config(tmp_path, max_steps=1, signal="continuation", continuation_length=4),
        train_dataset=math_dataset,
        callbacks=[StateLoggingCallback()],
    )
    trainer.train()
    (step,) = [json.loads(line) for line in open(tmp_path / "statelens" / "steps.jsonl")]
    # every supervised token was written by the teacher: log p_S - log p_T there estimates no KL
    assert step["supervised_tokens"] > 0 and "teacher_kl/supervised" not in step and "teacher_nll" not in step
    assert len(log_history(trainer, "teacher_kl/sampled")) == 1  # the trainer's metric, on the student's own prefix


def test_teacher_continuation_ends_at_its_eos_despite_the_rollouts_min_new_tokens(
    tmp_path, student_path, teacher_path, math_dataset
):
    """`generation_kwargs={"min_new_tokens": ...}` holds the student's rollouts to a length; a teacher that ends its
    continuation at once still ends it there (a served teacher is sent no length floor either)."""
    trainer = OnPolicyDistillTrainer(
        model=str(student_path),
        teacher_model=str(teacher_path),
        args=opd_config(
            tmp_path, signal="continuation", continuation_length=6, generation_kwargs={"min_new_tokens": 8}
        ),
        train_dataset=math_dataset,
        state_logging=False,
    )
    teacher = trainer.accelerator.unwrap_model(trainer.teacher_model)
    eos = trainer.eos_token_ids[0]

    def eos_first(module, inputs, logits):  # this teacher always wants to stop
        logits[..., eos] += 1e4
        return logits

    teacher.get_output_embeddings().register_forward_hook(eos_first)
    prompt_ids = trainer._tokenizer(math_dataset["prompt"][:3])["input_ids"]
    assert trainer.teacher.generate(prompt_ids, 6) == [[eos]] * 3
    assert trainer.generation_config.min_new_tokens == 8  # the student's own rollouts keep their floor


def test_dataset_source_without_reference_column_fails_clearly(tmp_path, student_path, teacher_path, math_dataset):
    with pytest.raises(ValueError, match="reference answers in column 'completion'"):
        OnPolicyDistillTrainer(
            model=str(student_path),
            teacher_model=str(teacher_path),
            args=opd_config(tmp_path, state_source_mix={"learner": 0.5, "dataset": 0.5}),
            train_dataset=math_dataset.select_columns(["prompt"]),
        )


# ----- bad input fails before any generation -------------------------------------------------------------------------
def test_teacher_with_another_vocabulary_is_rejected(tmp_path, student_path, math_dataset):
    from trl_statelens.lab import LabWorld, build_tokenizer

    other_tokenizer = build_tokenizer(LabWorld(seed=1), vocab_size=700, num_documents=500)
    teacher = build_model("test", other_tokenizer)
    with pytest.raises(ValueError, match="GOLDTrainer"):
        OnPolicyDistillTrainer(
            model=str(student_path), teacher_model=teacher, args=opd_config(tmp_path), train_dataset=math_dataset
        )


def test_missing_prompt_column_is_rejected(tmp_path, student_path, teacher_path):
    data = Dataset.from_dict({"question": ["Ava has 3 apples."]})
    with pytest.raises(ValueError, match="no 'prompt' column"):
        OnPolicyDistillTrainer(
            model=str(student_path), teacher_model=str(teacher_path), args=opd_config(tmp_path), train_dataset=data
        )


@pytest.mark.parametrize("column", ["image", "images"])
def test_image_dataset_is_refused_before_any_model_loads(tmp_path, column):
    from PIL import Image

    image = Image.new("RGB", (4, 4), color=(255, 0, 0))
    prompt = [{"role": "user", "content": "What color is this square?"}]
    data = Dataset.from_dict({"prompt": [prompt], column: [image if column == "image" else [image]]})
    # Paths that do not exist: the refusal comes before the student or the teacher is loaded
    with pytest.raises(ValueError, match=f"image column \\('{column}'\\): OnPolicyDistillTrainer supports text only"):
        OnPolicyDistillTrainer(
            model=str(tmp_path / "no-student"),
            teacher_model=str(tmp_path / "no-teacher"),
            args=opd_config(tmp_path),
            train_dataset=data,
        )
    with pytest.raises(ValueError, match="image column"):  # evaluation data too
        OnPolicyDistillTrainer(
            model=str(tmp_path / "no-student"),
            teacher_model=str(tmp_path / "no-teacher"),
            args=opd_config(tmp_path),
            train_dataset=data.remove_columns(column),
            eval_dataset={"vision": data},
        )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(continuation_length=0), "continuation_length must be a positive"),
        (dict(state_source_mix={"learner": 0.5, "teacher": 0.2}), "sum to 1"),
        (dict(state_source_mix={"learner": 0.5, "web": 0.5}), "unknown sources"),
        (dict(signal="forward_kl"), "not one of"),
    ],
)
def test_bad_config_is_rejected(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        opd_config(tmp_path, **kwargs)


def test_teacher_is_frozen_and_in_eval_mode(tmp_path, student_path, teacher_path, math_dataset):
    trainer = OnPolicyDistillTrainer(
        model=str(student_path), teacher_model=str(teacher_path), args=opd_config(tmp_path), train_dataset=math_dataset
    )
    teacher = trainer.accelerator.unwrap_model(trainer.teacher_model)
    assert not teacher.training
    assert not any(p.requires_grad for p in teacher.parameters())
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    trainer.train()
    after = AutoModelForCausalLM.from_pretrained(teacher_path).state_dict()
    for key, value in teacher.state_dict().items():
        torch.testing.assert_close(value, before[key])
        torch.testing.assert_close(value, after[key])


def test_peft_student_with_gradient_accumulation_trains_only_the_adapter(
    tmp_path, math_trained_path, math_teacher_path, math_dataset
):
    from peft import LoraConfig

    trainer = OnPolicyDistillTrainer(
        model=str(math_trained_path),
        teacher_model=str(math_teacher_path),
        args=opd_config(tmp_path, max_steps=2, gradient_accumulation_steps=2, per_device_train_batch_size=4),
        train_dataset=math_dataset,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    base_before = {k: v.clone() for k, v in trainer.model.state_dict().items() if "lora" not in k}
    lora_before = {k: v.clone() for k, v in trainer.model.state_dict().items() if "lora_B" in k}
    trainer.train()
    after = trainer.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in base_before.items())
    assert any(not torch.equal(after[k], v) for k, v in lora_before.items())
    steps = [json.loads(line) for line in open(tmp_path / "statelens" / "steps.jsonl")]
    assert [s["step"] for s in steps] == [1, 2] and all(s["supervised_tokens"] > 0 for s in steps)


# ----- teachers as users give them: LoRA adapter folders, bf16 checkpoints, distributed loading ------------------------
@pytest.fixture(scope="module")
def lora_sft_path(tmp_path_factory, math_trained_path, math_dataset):
    """What a LoRA SFT run leaves: `adapter_config.json`, adapter weights and the tokenizer, no full model."""
    from peft import LoraConfig
    from trl import SFTConfig

    from trl_statelens import StateLensSFTTrainer

    out = tmp_path_factory.mktemp("lora_sft")
    sft = StateLensSFTTrainer(
        model=str(math_trained_path),
        args=SFTConfig(output_dir=str(out), max_steps=2, per_device_train_batch_size=8, learning_rate=1e-2, **CPU),
        train_dataset=math_dataset.select_columns(["prompt", "completion"]),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"),
        state_logging=False,
    )
    sft.train()
    sft.save_model(str(out))
    assert (out / "adapter_config.json").exists() and not (out / "model.safetensors").exists()
    return out


def test_lora_sft_output_is_a_teacher_merged_for_inference(tmp_path, lora_sft_path, math_trained_path, math_dataset):
    from peft import PeftModel

    trainer = OnPolicyDistillTrainer(
        model=str(math_trained_path),
        teacher_model=str(lora_sft_path),
        args=opd_config(tmp_path, max_steps=1),
        train_dataset=math_dataset,
    )
    teacher = trainer.accelerator.unwrap_model(trainer.teacher_model)
    assert not isinstance(teacher, PeftModel) and not any("lora" in name for name, _ in teacher.named_parameters())
    # base + adapter: the adapter's own outputs, and not the base model's
    base = AutoModelForCausalLM.from_pretrained(math_trained_path)
    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(math_trained_path), lora_sft_path)
    ids = trainer._tokenizer(math_dataset["prompt"][:2], return_tensors="pt", padding=True)
    with torch.no_grad():
        expected, ours, untrained = (m(**ids).logits for m in (with_adapter.eval(), teacher, base.eval()))
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)
    assert (ours - untrained).abs().max() > 1e-2
    trainer.train()
    assert log_history(trainer, "teacher_kl/sampled")


def test_bf16_teacher_checkpoint_stays_bf16(tmp_path, tokenizer, student_path, math_dataset):
    path = tmp_path / "bf16_teacher"
    build_model("test", tokenizer, seed=1).to(torch.bfloat16).save_pretrained(path)
    tokenizer.save_pretrained(path)
    trainer = OnPolicyDistillTrainer(
        model=str(student_path), teacher_model=str(path), args=opd_config(tmp_path / "run"), train_dataset=math_dataset
    )
    teacher = trainer.accelerator.unwrap_model(trainer.teacher_model)
    assert {p.dtype for p in teacher.parameters()} == {torch.bfloat16}  # as TRL's DistillationTrainer loads it
    from trl_statelens.teachers import load_teacher

    forced = opd_config(tmp_path / "run", teacher_model_init_kwargs={"dtype": "float32"})
    assert {p.dtype for p in load_teacher(str(path), forced).parameters()} == {torch.float32}


@pytest.mark.parametrize("distributed_type, device_map", [("MULTI_GPU", None), ("DEEPSPEED", None), ("NO", "unset")])
def test_teacher_device_map_under_distributed_training_is_none(
    tmp_path, monkeypatch, teacher_path, distributed_type, device_map
):
    """TRL's trainers load with device_map=None under DDP and DeepSpeed: ZeRO-3 rejects a device map, and "auto"
    would put every rank's teacher on the first GPU. Elsewhere TRL's default applies (no device_map passed)."""
    from types import SimpleNamespace

    import trl_statelens.teachers.loading as loading
    from trl_statelens.teachers import load_teacher

    seen = {}
    monkeypatch.setattr(loading, "create_model_from_path", lambda path, **kwargs: seen.update(kwargs))
    args = opd_config(tmp_path, teacher_model_init_kwargs={"device_map": "auto"} if device_map is None else None)
    args.distributed_state = SimpleNamespace(distributed_type=distributed_type)
    load_teacher(str(teacher_path), args)
    assert seen.get("device_map", "unset") == device_map and seen["dtype"] == "auto"


# ----- GRPO's settings: applied or refused, never silently ignored -----------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(beta=0.04), "beta=0.04: GRPO's KL penalty"),
        (dict(loss_type="grpo"), "leave loss_type='dapo'"),
        (dict(num_iterations=2), "Set num_iterations=1"),
        (dict(gradient_accumulation_steps=1, steps_per_generation=2), "does not divide gradient_accumulation_steps"),
    ],
)
def test_grpo_settings_opd_does_not_apply_are_refused(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        opd_config(tmp_path, **kwargs)
    if "steps_per_generation" in kwargs:  # supervision at given states has no sampled-token gradient: allowed
        opd_config(tmp_path, signal="continuation", **kwargs)


def test_command_line_json_for_dict_fields(tmp_path):
    from trl import TrlParser

    (args,) = TrlParser((OnPolicyDistillConfig,)).parse_args_and_config(
        args=[
            "--output_dir",
            str(tmp_path),
            "--use_cpu",
            "true",
            "--bf16",
            "false",
            "--state_source_mix",
            '{"learner": 0.8, "teacher": 0.2}',
            "--teacher_model_init_kwargs",
            '{"dtype": "bfloat16"}',
        ]  # fmt: skip
    )
    assert args.state_source_mix == {"learner": 0.8, "teacher": 0.2}
    assert args.teacher_model_init_kwargs == {"dtype": "bfloat16"}


def _prompts(math_dataset, n):
    return [{"prompt": p, "completion": c} for p, c in zip(math_dataset["prompt"][:n], math_dataset["completion"])]


def _student_logps(trainer, batch):
    """The student's log-prob of every completion token of a generation batch, in one forward."""
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    logps, _, _ = trainer._get_per_token_logps_and_entropies(
        trainer.model, input_ids, attention_mask, batch["completion_ids"].size(1)
    )
    return logps


def _rows_per_call(module, seen):
    """Record the batch size of every forward of `module` that is not a cached decoding step."""
    return module.register_forward_pre_hook(
        lambda _, args, kwargs: seen.append(kwargs["input_ids"].size(0)) if kwargs.get("use_cache") is False else None,
        with_kwargs=True,
    )


def test_rollout_scoring_runs_no_unused_student_forward_and_chunks_the_teacher(
    tmp_path, student_path, teacher_path, math_dataset
):
    """steps_per_generation=2 > GA=1 makes GRPO score the rollouts with the student (old log-probs for clipping),
    which no OPD loss reads; the teacher scores the generation batch per_device_train_batch_size rows at a time."""
    trainer = OnPolicyDistillTrainer(
        model=str(student_path),
        teacher_model=str(teacher_path),
        args=opd_config(tmp_path, signal="divergence", per_device_train_batch_size=4, steps_per_generation=2),
        train_dataset=math_dataset,
    )
    trainer.model.train()
    student_rows, teacher_rows = [], []
    _rows_per_call(trainer.model.get_decoder(), student_rows)
    _rows_per_call(trainer.accelerator.unwrap_model(trainer.teacher_model).get_decoder(), teacher_rows)
    trainer.args.signal = "reverse_kl"  # scores the rollouts with the teacher (the check above is at config time)
    batch = trainer._generate_and_score_completions(_prompts(math_dataset, 4) * 2)
    assert batch["completion_ids"].size(0) == 8 and "old_per_token_logps" not in batch
    assert student_rows == [] and teacher_rows == [4, 4]


@pytest.mark.parametrize("accumulation, steps_per_generation", [(1, 1), (1, 2), (2, 2), (2, 1), (4, 2), (1, 4)])
def test_loss_is_the_token_mean_for_any_accumulation_and_generation_steps(
    tmp_path, student_path, teacher_path, math_dataset, accumulation, steps_per_generation
):
    """GRPO's DAPO normalisation: summed over a generation batch's micro-batches, the losses make
    steps_per_generation / GA optimizer steps' worth of the token mean (one step's worth per GA micro-batches)."""
    from trl.trainer.utils import split_tensor_dict

    trainer = OnPolicyDistillTrainer(
        model=str(student_path),
        teacher_model=str(teacher_path),
        args=opd_config(
            tmp_path,
            signal="continuation",
            continuation_length=4,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=accumulation,
            steps_per_generation=steps_per_generation,
        ),
        train_dataset=math_dataset,
        state_logging=False,
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = accumulation
    batch = trainer._generate_and_score_completions(_prompts(math_dataset, steps_per_generation) * 2)
    losses = [trainer._compute_loss(trainer.model, micro) for micro in split_tensor_dict(batch, steps_per_generation)]
    logps = _student_logps(trainer, batch)
    token_mean = -(logps * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
    optimizer_steps = steps_per_generation / accumulation
    torch.testing.assert_close(sum(losses) / optimizer_steps, token_mean, rtol=1e-5, atol=1e-6)


# ----- vLLM: no generation_config, importance sampling ------------------------------------------------------------------
def test_without_generation_config_teacher_and_probes_use_the_trainers_sampling_fields(
    tmp_path, student_path, teacher_path, math_dataset
):
    """GRPO keeps no `generation_config` under vLLM: the teacher and the probes sample with the trainer's fields."""
    from trl_statelens.lens.probes import trainer_generation_config

    trainer = OnPolicyDistillTrainer(
        model=str(student_path),
        teacher_model=str(teacher_path),
        args=opd_config(
            tmp_path,
            signal="continuation",
            continuation_length=4,
            temperature=0.7,
            top_p=0.9,
            top_k=20,
            min_p=0.05,
            repetition_penalty=1.1,
        ),
        train_dataset=math_dataset,
        callbacks=[StateLoggingCallback(probe_prompts=math_dataset["prompt"][:2], probe_steps=1)],
    )
    with_config = trainer.generation_config.to_dict()
    del trainer.generation_config
    built = trainer_generation_config(trainer).to_dict()
    for key in ("max_new_tokens", "do_sample", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                "eos_token_id", "pad_token_id"):  # fmt: skip
        assert built[key] == with_config[key], key
    callback = next(cb for cb in trainer.callback_handler.callbacks if isinstance(cb, StateLoggingCallback))
    probe = callback._probe_generation_config(trainer.model)
    assert (probe.temperature, probe.max_new_tokens) == (0.7, 16)
    prompt_ids = trainer._tokenizer(math_dataset["prompt"][:2])["input_ids"]
    continuations = trainer.teacher.generate(prompt_ids, 4)  # the continuation signal's teacher call
    assert len(continuations) == 2 and all(0 < len(c) <= 4 for c in continuations)


def test_vllm_importance_sampling_ratio_weights_the_reverse_kl_loss(
    tmp_path, student_path, teacher_path, math_dataset
):
    """With vLLM, GRPO multiplies each token's policy-gradient term by the vLLM/trainer importance ratio; the
    reverse_kl loss does too (simulated: vLLM is not installed here, the ratio is given in the batch)."""
    trainer = OnPolicyDistillTrainer(
        model=str(student_path),
        teacher_model=str(teacher_path),
        args=opd_config(tmp_path),
        train_dataset=math_dataset,
        state_logging=False,
    )
    trainer.model.train()
    batch = trainer._generate_and_score_completions(_prompts(math_dataset, 4) * 2)
    plain = trainer._compute_loss(trainer.model, batch)
    trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
    ratio = torch.rand_like(batch["completion_mask"], dtype=torch.float32)
    corrected = trainer._compute_loss(trainer.model, {**batch, "importance_sampling_ratio": ratio})
    mask, logps = batch["completion_mask"], _student_logps(trainer, batch)
    # A_t = -(log p_S - log p_T), loss = -sum A_t * ratio_t * log p_S / N
    teacher_logps = trainer._resolve_teacher_logps(batch)  # the batch holds the teacher's rows, read in the loss
    expected = ((logps - teacher_logps) * logps * mask * ratio).sum() / mask.sum()
    torch.testing.assert_close(corrected.detach(), expected.detach(), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(corrected, plain)


# ----- tool outputs are not supervised -----------------------------------------------------------------------------------
@pytest.mark.parametrize("signal", ["reverse_kl", "continuation", "divergence"])
def test_tool_mask_removes_tokens_from_the_loss(tmp_path, student_path, teacher_path, math_dataset, signal):
    trainer = OnPolicyDistillTrainer(
        model=str(student_path),
        teacher_model=str(teacher_path),
        args=opd_config(tmp_path, signal=signal, **({"continuation_length": 4} if signal == "continuation" else {})),
        train_dataset=math_dataset,
        state_logging=False,
    )
    trainer.model.train()
    batch = trainer._generate_and_score_completions(_prompts(math_dataset, 4) * 2)
    full = trainer._compute_loss(trainer.model, batch)
    tool_mask = torch.ones_like(batch["completion_mask"])
    assert trainer._compute_loss(trainer.model, {**batch, "tool_mask": tool_mask}).item() == pytest.approx(full.item())
    tool_mask[:, :] = 0  # every completion token came from a tool
    assert trainer._compute_loss(trainer.model, {**batch, "tool_mask": tool_mask}).item() == 0.0


@pytest.mark.parametrize("signal", ["reverse_kl", "divergence", "continuation"])
def test_one_rollout_per_prompt_puts_a_distinct_prompt_in_every_row(
    tmp_path, student_path, teacher_path, math_dataset, signal
):
    """num_generations=1 (TRL's DistillationTrainer draws one rollout per prompt): 8 rollouts, 8 prompts a step."""
    seen = {}
    for generations in (1, 2):
        out = tmp_path / f"g{generations}"
        trainer = OnPolicyDistillTrainer(
            model=str(student_path),
            teacher_model=str(teacher_path),
            args=opd_config(out, max_steps=2, signal=signal, num_generations=generations),
            train_dataset=math_dataset,
            callbacks=[StateLoggingCallback(sample_rate=1.0)],
        )
        trainer.train()
        states = [json.loads(line) for line in (out / "statelens" / "states.jsonl").read_text().splitlines()]
        for step in (1, 2):
            # the question: the ledger's prompt text runs to the first supervised token (a continuation's cut)
            prompts = [s["prompt"].split("\nAnswer:")[0] for s in states if s["step"] == step]
            seen[generations, step] = (len(prompts), len(set(prompts)))
        assert all(torch.isfinite(torch.tensor(log_history(trainer, "loss"))))
    assert seen[1, 1] == seen[1, 2] == (8, 8)
    assert seen[2, 1] == seen[2, 2] == (8, 4)


def test_one_rollout_per_prompt_refuses_a_reward_advantage(tmp_path):
    with pytest.raises(ValueError, match="num_generations=1 with reward_weight"):
        opd_config(tmp_path, num_generations=1, reward_weight=0.5)


# ----- evaluation data, OPD's own settings, one rollout per prompt -----------------------------------------------
@pytest.mark.parametrize(
    "kwargs, teacher, eval_rows, message",
    [
        # the `dataset` state source reads each eval row's reference answer too
        (dict(state_source_mix={"learner": 0.5, "dataset": 0.5}), "one", lambda d: d.select_columns(["prompt"]),
         r"reference answers in column 'completion', absent from eval_dataset\['held_out'\]"),
        # routed rows: eval teacher ids must name given teachers
        ({}, "two", lambda d: d.add_column("teacher_id", ["a", "web"] * (len(d) // 2)),
         r"teacher_id column of eval_dataset\['held_out'\] names teachers that are not given: \['web'\]"),
    ],
)  # fmt: skip
def test_eval_dataset_is_checked_like_the_training_data_before_any_model_loads(
    tmp_path, math_dataset, kwargs, teacher, eval_rows, message
):
    """Evaluation runs the same row logic as training: without this check the run trains until its first evaluation
    and dies there. Paths that do not exist: the refusal comes before the student or a teacher is loaded."""
    teachers = {"a": str(tmp_path / "no-a"), "b": str(tmp_path / "no-b")}
    with pytest.raises(ValueError, match=message):
        OnPolicyDistillTrainer(
            model=str(tmp_path / "no-student"),
            teacher_model=teachers if teacher == "two" else str(tmp_path / "no-teacher"),
            args=opd_config(tmp_path, eval_strategy="steps", eval_steps=1, **kwargs),
            train_dataset=math_dataset,
            eval_dataset={"held_out": eval_rows(math_dataset.select(range(8)))},
        )


def test_images_inside_prompt_messages_are_refused_before_any_model_loads(tmp_path):
    """GRPO takes images from `{"type": "image"}` content parts too, not only from an image column."""
    from PIL import Image

    image = Image.new("RGB", (4, 4), color=(255, 0, 0))
    text = [{"role": "user", "content": [{"type": "text", "text": "What color is this square?"}]}]
    with_image = [
        {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "What color?"}]}
    ]
    data = Dataset.from_dict({"prompt": [text, with_image]})
    assert set(data.column_names) == {"prompt"}
    for train, evaluation in ((data, None), (data.select([0]), data)):
        with pytest.raises(ValueError, match=r"1 row\(s\) hold an image in their prompt messages.*the first: row 1"):
            OnPolicyDistillTrainer(
                model=str(tmp_path / "no-student"),
                teacher_model=str(tmp_path / "no-teacher"),
                args=opd_config(tmp_path),
                train_dataset=train,
                eval_dataset=evaluation,
            )


@pytest.mark.parametrize(
    "kwargs, unread",
    [
        (dict(signal="divergence", kl_discount=0.5), "kl_discount=0.5 (read only with signal='reverse_kl'"),
        (dict(signal="reverse_kl", jsd_beta=0.0), "jsd_beta=0.0 (read only with signal='divergence'"),
        (dict(signal="divergence", continuation_length=4), "continuation_length=4 (read only with signal='cont"),
        (dict(teacher_update_rate=0.1), "teacher_update_rate=0.1 (read only with teacher_model_kind='ema'"),
        (dict(teacher_model_kind="base", teacher_update_rate=0.1), "teacher_update_rate=0.1 (read only with"),
        (dict(teacher_prompt_template="{prompt} {privileged_context}"), "read only with a teacher_model_kind"),
        (dict(signal="reverse_kl", teacher_model_kind="live", teacher_top_k=8), "teacher_top_k=8 (read only with a"),
        (dict(signal="divergence", teacher_model_kind="live", teacher_top_k=8), "teacher_top_k=8 (read only"),
        (dict(teacher_model_kind="live", teacher_server_timeout=5.0), "teacher_server_timeout=5.0 (read only with"),
        (dict(teacher_model_kind="live", teacher_model_init_kwargs={"dtype": "float32"}), "teacher_model_init_kw"),
        (dict(teacher_model_server_url="http://localhost:8000", teacher_model_init_kwargs={"dtype": "float32"}),
         "teacher_model_init_kwargs={'dtype': 'float32'} (read only with a teacher loaded from a path"),
    ],
)  # fmt: skip
def test_settings_the_run_never_reads_are_refused(tmp_path, kwargs, unread):
    """As GRPO's settings that no OPD loss reads: a set value that would train exactly as the default is refused."""
    with pytest.raises(ValueError, match=re.escape(unread) + ".*never reads it"):
        opd_config(tmp_path, **kwargs)
    # Where something reads it, the same value is accepted
    reads = {"kl_discount": dict(signal="reverse_kl"), "jsd_beta": dict(signal="divergence"),
             "continuation_length": dict(signal="continuation"), "teacher_top_k": dict(signal="divergence"),
             "teacher_update_rate": dict(teacher_model_kind="ema")}  # fmt: skip
    name = unread.split("=")[0]
    if name in reads:
        opd_config(tmp_path, **{name: kwargs[name], **reads[name]})


def test_teacher_settings_are_checked_against_the_teachers_given(tmp_path, math_dataset, tokenizer):
    """Whether a teacher is served or loaded from a path is known from `teacher_model`: checked before any load."""
    instance = build_model("test", tokenizer)
    with pytest.raises(ValueError, match="teacher_model_init_kwargs=.*read only with a teacher loaded from a path"):
        OnPolicyDistillTrainer(
            model=str(tmp_path / "no-student"),
            teacher_model={"a": instance, "b": "http://127.0.0.1:1"},  # instances and URLs load nothing
            args=opd_config(tmp_path, teacher_model_init_kwargs={"dtype": "float32"}),
            train_dataset=math_dataset,
        )
    with pytest.raises(ValueError, match="teacher_top_k=8 .*read only with a served teacher"):
        OnPolicyDistillTrainer(
            model=str(tmp_path / "no-student"),
            teacher_model=str(tmp_path / "no-teacher"),  # in the process: the exact divergence, no top-k
            args=opd_config(tmp_path, signal="divergence", teacher_top_k=8),
            train_dataset=math_dataset,
        )


def test_reverse_kl_on_dataset_or_teacher_states_warns_that_it_is_a_heuristic(tmp_path):
    """The sampled-token loss is a reverse-KL policy gradient only on the student's own samples."""
    for source in ("dataset", "teacher"):
        with pytest.warns(UserWarning, match=f"reverse_kl' with {source} states.*heuristic rather than a KL"):
            opd_config(tmp_path, signal="reverse_kl", state_source_mix={"learner": 0.5, source: 0.5})
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        opd_config(tmp_path, signal="divergence", state_source_mix={"learner": 0.5, "teacher": 0.5})
        opd_config(tmp_path, signal="reverse_kl")  # the student's own states: the real gradient


@pytest.mark.parametrize("batch_size", [1, 3])
def test_one_rollout_per_prompt_takes_any_batch_size(tmp_path, batch_size):
    """GRPO's group checks (generation and global eval batch divisible by num_generations) hold for groups of one
    whatever the batch; the real sizes come back after them."""
    for accumulation in (1, 2):
        args = opd_config(
            tmp_path,
            num_generations=1,
            per_device_train_batch_size=batch_size,
            gradient_accumulation_steps=accumulation,
            eval_strategy="steps",
            per_device_eval_batch_size=batch_size,
        )
        assert (args.num_generations, args.num_generations_eval) == (1, 1)
        assert (args.per_device_train_batch_size, args.per_device_eval_batch_size) == (batch_size, batch_size)
        assert args.steps_per_generation == accumulation
        assert args.generation_batch_size == batch_size * accumulation
    given = opd_config(tmp_path, signal="divergence", num_generations=1, per_device_train_batch_size=3,
                       generation_batch_size=9)  # fmt: skip
    assert (given.generation_batch_size, given.steps_per_generation) == (9, 3)
    # GRPO's checks still hold where they are real: groups of 2 in evaluation, a generation batch of whole batches
    with pytest.raises(ValueError, match="must be divisible by the number of generations used for evaluation"):
        opd_config(tmp_path, num_generations=1, num_generations_eval=2, per_device_train_batch_size=batch_size,
                   eval_strategy="steps", per_device_eval_batch_size=3)  # fmt: skip
    with pytest.raises(ValueError, match=r"generation_batch_size \(3\) must be divisible by the global batch size"):
        opd_config(tmp_path, signal="divergence", num_generations=1, per_device_train_batch_size=2,
                   generation_batch_size=3)  # fmt: skip


def test_one_rollout_per_prompt_trains_with_a_batch_of_one(tmp_path, student_path, teacher_path, math_dataset):
    trainer = OnPolicyDistillTrainer(
        model=str(student_path),
        teacher_model=str(teacher_path),
        args=opd_config(tmp_path, max_steps=1, num_generations=1, per_device_train_batch_size=1),
        train_dataset=math_dataset,
        callbacks=[StateLoggingCallback(sample_rate=1.0)],
    )
    trainer.train()
    (loss,) = log_history(trainer, "loss")
    assert math.isfinite(loss) and trainer.state.global_step == 1
    (step,) = [json.loads(line) for line in (tmp_path / "statelens" / "steps.jsonl").read_text().splitlines()]
    assert step["sequences"] == 1 and step["supervised_tokens"] > 0  # one rollout of one prompt
