import json

import pytest
import torch
from cpu_settings import CPU
from datasets import Dataset
from transformers import AutoModelForCausalLM
from trl import DistillationConfig, DistillationTrainer

from trl_statelens import OnPolicyDistillConfig, OnPolicyDistillTrainer, StateLoggingCallback
from trl_statelens.lab import build_model


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
    assert abs(log_history(trainer, "teacher_kl")[0]) < 1e-4
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
        args=opd_config(tmp_path, max_steps=30, signal=signal, continuation_length=8, learning_rate=learning_rate),
        train_dataset=math_dataset,
    )
    trainer.train()
    # reverse_kl / divergence: the student's own tokens become likelier under the teacher;
    # continuation: the student's cross-entropy on the teacher's tokens falls
    curve = log_history(trainer, "loss" if signal == "continuation" else "teacher_kl")
    first, last = sum(curve[:5]) / 5, sum(curve[-5:]) / 5
    assert last < 0.8 * first, curve


# ----- parity with TRL's DistillationTrainer ------------------------------------------------------------------------
def test_divergence_beta1_matches_distillation_trainer_loss(tmp_path, student_path, math_trained_path, math_dataset):
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
        drawn.extend(trainer._row_sources)
        # dataset rows carry the reference answer, teacher-forced
        for source, ids, mask, row in zip(trainer._row_sources, out["completion_ids"], out["completion_mask"], inputs):
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
    # the ledger's teacher_kl averages the learner's own tokens only, as the trainer's metric does
    assert [s["teacher_kl"] for s in steps] == pytest.approx(log_history(trainer, "teacher_kl"), rel=1e-4, abs=1e-6)


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
    assert step["supervised_tokens"] > 0 and "teacher_kl" not in step and "teacher_nll" not in step
    assert len(log_history(trainer, "teacher_kl")) == 1  # the trainer's metric, on the student's own prefix


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
    assert log_history(trainer, "teacher_kl")
