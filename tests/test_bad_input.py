"""Bad input gets a clear message before work starts, or a documented logged skip, and loses no finished work.

One test per row of docs/bad-input.md.
"""

import json
import logging
import math

import pytest
import torch
from cpu_settings import CPU
from datasets import Dataset
from transformers import AutoTokenizer, TrainerCallback
from trl import GRPOConfig, SFTConfig

from trl_statelens import StateLensGRPOTrainer, StateLensSFTTrainer, StateLoggingCallback
from trl_statelens.data import load_gsm8k


def constant_reward(completions, **kwargs):
    return [1.0] * len(completions)


def sft_args(tmp_path, **overrides):
    settings = dict(per_device_train_batch_size=2, max_steps=1)
    return SFTConfig(output_dir=str(tmp_path / "sft"), **{**CPU, **settings, **overrides})


def grpo_args(tmp_path, **overrides):
    settings = dict(per_device_train_batch_size=2, num_generations=2, max_completion_length=4, max_steps=1)
    return GRPOConfig(output_dir=str(tmp_path / "grpo"), **{**CPU, **settings, **overrides})


def grpo(student_path, tmp_path, dataset, reward=constant_reward, **overrides):
    return StateLensGRPOTrainer(
        model=str(student_path), reward_funcs=reward, args=grpo_args(tmp_path, **overrides), train_dataset=dataset
    )


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_empty_dataset(tmp_path, student_path, math_dataset):
    empty = math_dataset.select([])
    with pytest.raises(ValueError, match="train_dataset has no rows"):
        StateLensSFTTrainer(model=str(student_path), args=sft_args(tmp_path), train_dataset=empty)
    with pytest.raises(ValueError, match="train_dataset has no rows"):
        grpo(student_path, tmp_path, empty)
    with pytest.raises(ValueError, match="OnPolicyDistillTrainer: train_dataset has no rows"):
        opd(student_path, tmp_path / "no_teacher_needed", tmp_path, empty)  # refused before the teacher loads
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="no rows"):
        load_gsm8k(str(tmp_path / "empty.jsonl"))


def test_no_prompt_column(tmp_path, student_path, math_dataset):
    rows = math_dataset.select_columns(["question", "answer"])
    with pytest.raises(ValueError, match="no 'prompt' column .*found \\['question', 'answer'\\].*rename"):
        grpo(student_path, tmp_path, rows)
    with pytest.raises(ValueError, match="no 'text' or 'messages' or 'prompt' or 'input_ids' column"):
        StateLensSFTTrainer(model=str(student_path), args=sft_args(tmp_path), train_dataset=rows)


def test_prompt_longer_than_the_context(tmp_path, student_path, math_dataset, tokenizer):
    context = 512  # the `test`-size models' max_position_embeddings
    long_prompt = "Question: " + "Ava has 3 apples. " * 120 + "\nAnswer:"
    assert len(tokenizer(long_prompt).input_ids) > context
    rows = Dataset.from_list([*math_dataset.select_columns(["prompt", "completion"]).to_list()[:3],
                              {"prompt": long_prompt, "completion": " 3"}])  # fmt: skip
    with pytest.raises(ValueError, match="1 prompt\\(s\\) do not fit the model's context of 512 .*row 3"):
        grpo(student_path, tmp_path, rows.select_columns(["prompt"]))
    # a prompt that fits alone, but not with max_completion_length generated tokens after it
    with pytest.raises(ValueError, match="with 500 tokens after them"):
        grpo(student_path, tmp_path, rows.select(range(3)), max_completion_length=500)
    # OPD continuations: up to continuation_length teacher tokens after a full rollout
    with pytest.raises(ValueError, match="with 476 tokens after them"):
        opd(student_path, student_path, tmp_path, rows.select(range(3)), max_completion_length=460,
            signal="continuation", continuation_length=16)  # fmt: skip
    opd(student_path, student_path, tmp_path, rows.select(range(3)), max_completion_length=460)  # fits
    # SFT truncates to max_length; without a max_length, rows longer than the context are refused
    with pytest.raises(ValueError, match="do not fit the model's context of 512 tokens .*max_length=None"):
        StateLensSFTTrainer(model=str(student_path), args=sft_args(tmp_path, max_length=None), train_dataset=rows)


def test_completions_all_empty_or_all_clipped(tmp_path, student_path, math_dataset, tokenizer):
    prompts = math_dataset.select_columns(["prompt"])
    # every completion empty: the model may only emit eos
    only_eos = [i for i in range(len(tokenizer)) if i != tokenizer.eos_token_id]
    trainer = grpo(student_path, tmp_path / "empty", prompts, generation_kwargs={"suppress_tokens": only_eos})
    trainer.train()
    (step,) = read_jsonl(tmp_path / "empty" / "grpo" / "statelens" / "steps.jsonl")
    assert step["supervised_tokens"] == step["sequences"] == 2  # the eos token of each completion, nothing else
    # every completion clipped at max_completion_length, and clipped completions masked out of the loss: a step
    # with nothing to supervise is still a step, logged with 0 supervised tokens
    trainer = grpo(student_path, tmp_path / "clipped", prompts, generation_kwargs={"suppress_tokens": [tokenizer.eos_token_id]}, mask_truncated_completions=True)  # fmt: skip
    trainer.train()
    (step,) = read_jsonl(tmp_path / "clipped" / "grpo" / "statelens" / "steps.jsonl")
    assert step["supervised_tokens"] == step["sequences"] == 0 and "state_nll" not in step
    logs = trainer.state.log_history[0]
    assert logs["completions/clipped_ratio"] == 1.0 and logs["loss"] == 0.0


def test_reward_function_that_raises_or_returns_nan(tmp_path, student_path, math_dataset):
    prompts = math_dataset.select_columns(["prompt"])

    def broken_reward(completions, trainer_state, **kwargs):
        if trainer_state.global_step == 1:
            raise ZeroDivisionError("division by zero")
        return [1.0] * len(completions)

    trainer = grpo(student_path, tmp_path / "raises", prompts, reward=broken_reward, max_steps=3)
    with pytest.raises(RuntimeError, match="reward function \\(broken_reward\\) raised ZeroDivisionError in step 2"):
        trainer.train()
    ledger = tmp_path / "raises" / "grpo" / "statelens"
    assert [line["step"] for line in read_jsonl(ledger / "steps.jsonl")] == [1]  # step 1 kept

    def nan_reward(completions, **kwargs):
        return [float("nan")] * len(completions)

    callback = StateLoggingCallback(sample_rate=1.0)
    trainer = StateLensGRPOTrainer(
        model=str(student_path), reward_funcs=[nan_reward, constant_reward], args=grpo_args(tmp_path / "nan"),
        train_dataset=prompts, callbacks=[callback],
    )  # fmt: skip
    trainer.train()  # NaN is "no score" for that function: the others still count
    states = read_jsonl(tmp_path / "nan" / "grpo" / "statelens" / "states.jsonl")
    assert [s["reward"] for s in states] == [1.0, 1.0]
    assert torch.isfinite(torch.tensor(trainer.state.log_history[0]["loss"]))


class PoisonAfterStep(TrainerCallback):
    """Turns one weight into NaN at the end of step `step`: the next step's loss and gradients are NaN."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.step:
            with torch.no_grad():
                model.get_input_embeddings().weight[:, 0] = float("nan")


def test_non_finite_loss_stops_before_the_optimizer_step(tmp_path, student_path, math_dataset):
    args = sft_args(tmp_path, max_steps=3, save_strategy="steps", save_steps=1, max_length=128)
    trainer = StateLensSFTTrainer(
        model=str(student_path), args=args, train_dataset=math_dataset, callbacks=[PoisonAfterStep(1)]
    )
    norm = trainer.model.model.norm.weight
    with pytest.raises(FloatingPointError, match="non-finite gradient norm \\(nan\\) in step 2.*after step 1"):
        trainer.train()
    assert torch.isfinite(norm).all()  # the NaN gradients never reached the weights
    out = tmp_path / "sft"
    assert [line["step"] for line in read_jsonl(out / "statelens" / "steps.jsonl")] == [1]
    assert (out / "checkpoint-1").is_dir()  # finished work is kept: resume from there


def simulate_native_fp16(trainer, monkeypatch, init_scale):
    """fp16 mixed precision as accelerate runs it on a GPU, on the CPU (which accelerate refuses fp16 for): a real
    `GradScaler` scales the loss in backward, the gradients are unscaled before clipping (the norm is the unscaled
    one), and the optimizer steps through the scaler, which skips a step whose gradients are not finite and halves its
    scale. Only the fp16 autocast is missing: overflows come from `init_scale` (float32 overflows past 2**128)."""
    accelerator = trainer.accelerator
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    accelerator.native_amp = True
    monkeypatch.setattr(type(accelerator), "mixed_precision", property(lambda self: "fp16"))  # unscale before clipping
    trainer.args.fp16 = True  # what a user sets (after construction: TrainingArguments refuses fp16 on the CPU)


class WeightChanges(TrainerCallback):
    """Per optimizer step: whether the weights changed."""

    def __init__(self):
        self.changed, self.last = [], None

    def on_step_end(self, args, state, control, model=None, **kwargs):
        now = model.model.norm.weight.detach().clone()
        self.changed.append(self.last is None or not torch.equal(now, self.last))
        self.last = now

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.last = model.model.norm.weight.detach().clone()


def test_fp16_overflow_steps_are_skipped_and_counted(tmp_path, student_path, math_dataset, monkeypatch):
    changes = WeightChanges()
    trainer = StateLensSFTTrainer(
        model=str(student_path),
        args=sft_args(tmp_path, max_steps=5, max_length=128, learning_rate=1e-2),
        train_dataset=math_dataset,
        callbacks=[changes],
    )
    simulate_native_fp16(trainer, monkeypatch, init_scale=2.0**127)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    skipped = [entry["statelens/skipped_overflow_steps"] for entry in logs]
    overflowed = [not math.isfinite(entry["grad_norm"]) for entry in logs]
    assert skipped == [int(o) for o in overflowed] and 1 <= sum(skipped) < 5  # the first steps overflow, then not
    assert trainer.accelerator.scaler.get_scale() == 2.0 ** (127 - sum(skipped))  # halved once per skipped step
    assert changes.changed == [not o for o in overflowed]  # skipped steps leave the weights as they were


def test_fp16_non_finite_gradients_stop_once_the_loss_scale_is_below_1(
    tmp_path, student_path, math_dataset, monkeypatch
):
    trainer = StateLensSFTTrainer(
        model=str(student_path),
        args=sft_args(tmp_path, max_steps=8, max_length=128),
        train_dataset=math_dataset,
    )
    with torch.no_grad():  # NaN loss and gradients at any scale
        trainer.model.get_input_embeddings().weight[:, 0] = float("nan")
    simulate_native_fp16(trainer, monkeypatch, init_scale=4.0)
    with pytest.raises(
        FloatingPointError, match="in step 4 with the fp16 loss scale already down to 0.5, after 3 overflow"
    ):
        trainer.train()  # skipped at scales 4, 2 and 1, then stopped
    assert [e["statelens/skipped_overflow_steps"] for e in trainer.state.log_history if "loss" in e] == [1, 1, 1]


@pytest.mark.parametrize("applied", [False, True])
def test_deepspeed_overflow_steps_it_skipped_are_counted_and_applied_ones_stop(applied):
    """Under DeepSpeed the engine steps inside backward (accelerate), before the trainer reads the norm: a step its
    loss scaler skipped is counted; a non-finite one it applied stops training. The guard's logic on a stand-in
    engine (DeepSpeed fp16 itself is not run here)."""
    from types import SimpleNamespace

    from trl_statelens.checks import FiniteGradientsMixin

    class Norm:
        def _get_grad_norm(self, model, grad_norm=None):
            return grad_norm

    class Trainer(FiniteGradientsMixin, Norm):
        pass

    engine = SimpleNamespace(was_step_applied=lambda: applied)
    trainer = Trainer()
    trainer.state = SimpleNamespace(global_step=6)
    trainer.accelerator = SimpleNamespace(deepspeed_engine_wrapped=SimpleNamespace(engine=engine), scaler=None)
    assert trainer._get_grad_norm(None, grad_norm=0.5) == 0.5
    if applied:
        with pytest.raises(FloatingPointError, match="in step 7, .*DeepSpeed applied the step"):
            trainer._get_grad_norm(None, grad_norm=float("inf"))
    else:
        assert trainer._get_grad_norm(None, grad_norm=float("inf")) == float("inf")
        assert trainer._skipped_overflow_steps == 1


def test_tokenizer_without_eos(tmp_path, student_path, math_dataset, tokenizer_path):
    broken = AutoTokenizer.from_pretrained(tokenizer_path)
    broken.pad_token, broken.eos_token = None, None
    with pytest.raises(ValueError, match="the tokenizer has no eos token: .*tokenizer.eos_token = "):
        StateLensGRPOTrainer(model=str(student_path), reward_funcs=constant_reward, args=grpo_args(tmp_path),
                             train_dataset=math_dataset, processing_class=broken)  # fmt: skip
    with pytest.raises(ValueError, match="the tokenizer has no eos token"):
        StateLensSFTTrainer(
            model=str(student_path), args=sft_args(tmp_path), train_dataset=math_dataset, processing_class=broken
        )
    broken.eos_token = "<|endoftext|>"  # no pad token is fine: TRL pads with eos
    StateLensSFTTrainer(
        model=str(student_path), args=sft_args(tmp_path), train_dataset=math_dataset, processing_class=broken
    )


def test_probe_prompts_longer_than_the_context(tmp_path, student_path, math_dataset):
    callback = StateLoggingCallback(probe_prompts=["Question: " + "Ava has 3 apples. " * 120], probe_max_new_tokens=8)
    trainer = StateLensSFTTrainer(
        model=str(student_path), args=sft_args(tmp_path, max_length=128), train_dataset=math_dataset,
        callbacks=[callback],
    )  # fmt: skip
    with pytest.raises(ValueError, match="probe prompt of \\d+ tokens plus probe_max_new_tokens=8 .* context of 512"):
        trainer.train()
    assert trainer.state.global_step == 0


def opd(student_path, teacher, tmp_path, dataset, **overrides):
    from trl_statelens import OnPolicyDistillConfig, OnPolicyDistillTrainer

    settings = dict(per_device_train_batch_size=2, num_generations=2, max_completion_length=4, max_steps=1)
    args = OnPolicyDistillConfig(output_dir=str(tmp_path / "opd"), **{**CPU, **settings, **overrides})
    return OnPolicyDistillTrainer(
        model=str(student_path), teacher_model=str(teacher), args=args, train_dataset=dataset
    )


def test_teacher_with_another_chat_template_warns(tmp_path, student_path, teacher_path, math_dataset, caplog):
    import shutil

    teacher = tmp_path / "teacher"
    shutil.copytree(teacher_path, teacher)
    prompts = math_dataset.select_columns(["prompt"])
    with caplog.at_level(logging.WARNING, logger="trl_statelens.opd.trainer"):
        opd(student_path, teacher, tmp_path, prompts)
    assert "chat template" not in caplog.text  # same tokenizer files: nothing to say
    retemplated = AutoTokenizer.from_pretrained(teacher)
    retemplated.chat_template = "{% for m in messages %}### {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    retemplated.save_pretrained(teacher)  # same vocabulary, another layout
    with caplog.at_level(logging.WARNING, logger="trl_statelens.opd.trainer"):
        opd(student_path, teacher, tmp_path, prompts)
    assert f"The teacher's chat template ({teacher}) differs from the student's" in caplog.text


def test_output_dir_with_another_runs_ledger(tmp_path, student_path, math_dataset):
    def trainer():
        return StateLensSFTTrainer(
            model=str(student_path), args=sft_args(tmp_path, max_length=128), train_dataset=math_dataset
        )

    trainer().train()
    ledger = tmp_path / "sft" / "statelens" / "steps.jsonl"
    first = ledger.read_bytes()
    with pytest.raises(ValueError, match="holds another run's state ledger \\(steps.jsonl.*--resume_from_checkpoint"):
        trainer().train()
    assert ledger.read_bytes() == first  # untouched


def test_malformed_gsm8k_answer_is_dropped_with_a_warning(tmp_path, caplog):
    rows = [{"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"} for i in range(4)]
    rows[2]["answer"] = "the answer is three"  # no final '#### N': it can be neither rewarded nor scored
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with caplog.at_level(logging.WARNING, logger="trl_statelens.data"):
        dataset = load_gsm8k(str(path))
    assert dataset["ground_truth"] == ["1", "2", "4"]
    assert "dropped 1 of 4 rows whose answer has no final '#### N' (rows [2])" in caplog.text
    path.write_text(json.dumps(rows[2]) + "\n")
    with pytest.raises(ValueError, match="no answer ends with a final '#### N'"):
        load_gsm8k(str(path))


# ----- loading safely: no pickle, no remote code ------------------------------------------------------------------
class WritesMarker:
    """Unpickling this object runs code: it creates `path`. A safe loader never gets that far."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_models_load_from_safetensors_only(tmp_path, tokenizer, student_path):
    from trl_statelens.evaluation import load_model_and_tokenizer
    from trl_statelens.lab import build_model

    pickled = tmp_path / "pickled"  # the weights in a pickle file, as older checkpoints ship them
    model = build_model("test", tokenizer)
    model.config.architectures = ["Qwen3ForCausalLM"]
    model.config.save_pretrained(pickled)
    torch.save(model.state_dict(), pickled / "pytorch_model.bin")
    tokenizer.save_pretrained(pickled)
    prompts = Dataset.from_list([{"prompt": "Question: 1 + 1?\nAnswer:"}] * 4)
    with pytest.raises(OSError, match="safetensors"):
        StateLensSFTTrainer(model=str(pickled), args=sft_args(tmp_path), train_dataset=prompts)
    with pytest.raises(OSError, match="safetensors"):
        StateLensGRPOTrainer(model=str(pickled), reward_funcs=constant_reward, args=grpo_args(tmp_path),
                             train_dataset=prompts)  # fmt: skip
    with pytest.raises(OSError, match="safetensors"):
        load_model_and_tokenizer(pickled, device="cpu")
    with pytest.raises(OSError, match="safetensors"):  # the OPD teacher too
        opd(student_path, pickled, tmp_path, prompts)


def test_remote_code_is_not_run(tmp_path, student_path):
    import shutil

    custom = tmp_path / "custom"
    shutil.copytree(student_path, custom)
    marker = tmp_path / "remote_code_ran"
    (custom / "evil.py").write_text(
        f"open({str(marker)!r}, 'w')\nfrom transformers import Qwen3Config as EvilConfig, Qwen3ForCausalLM as Evil\n"
    )
    config = json.loads((custom / "config.json").read_text())  # a model type only the folder's own code defines
    config.update(model_type="evil", auto_map={"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.Evil"})
    (custom / "config.json").write_text(json.dumps(config))
    prompts = Dataset.from_list([{"prompt": "Question: 1 + 1?\nAnswer:"}] * 4)
    with pytest.raises(ValueError, match="trust_remote_code"):
        StateLensGRPOTrainer(model=str(custom), reward_funcs=constant_reward, args=grpo_args(tmp_path),
                             train_dataset=prompts)  # fmt: skip
    assert not marker.exists()


def test_lab_pretraining_checkpoint_loads_without_unpickling_code(tmp_path, world, tokenizer):
    from trl_statelens.lab import build_model
    from trl_statelens.lab.build import pretrain

    marker = tmp_path / "pickle_code_ran"
    (tmp_path / "pretrain").mkdir()
    torch.save({"model": {}, "step": 1, "payload": WritesMarker(marker)}, tmp_path / "pretrain" / "ckpt.pt")
    with pytest.raises(Exception, match="Weights only load failed"):
        pretrain(build_model("test", tokenizer), tokenizer, world, tmp_path / "pretrain", log=lambda _: None,
                 max_steps=1, batch_size=2, block=32, eval_every=1)  # fmt: skip
    assert not marker.exists()


def test_context_length_reads_every_config_naming_of_the_position_limit():
    """GPT-2 style configs say `n_positions`: the prompt-length checks must see it too (they saw only Llama's name)."""
    from types import SimpleNamespace

    from trl_statelens.checks import context_length

    assert context_length(SimpleNamespace(config=SimpleNamespace(n_positions=64))) == 64
    assert context_length(SimpleNamespace(config=SimpleNamespace(max_position_embeddings=128))) == 128
    assert context_length(SimpleNamespace(config=SimpleNamespace(text_config=SimpleNamespace(n_ctx=32)))) == 32
    assert context_length(SimpleNamespace(config=SimpleNamespace())) is None


# ----- review 2026-12-04: settings that would do nothing, or do it wrong, refused ---------------------------------
def opd_config(tmp_path, **overrides):
    from trl_statelens import OnPolicyDistillConfig

    settings = dict(per_device_train_batch_size=2, num_generations=2, max_completion_length=4, max_steps=1)
    return OnPolicyDistillConfig(output_dir=str(tmp_path / "opd"), **{**CPU, **settings, **overrides})


def test_lora_on_the_output_layer_is_refused(tmp_path, student_path, teacher_path, math_dataset):
    """Every OPD loss projects the student through its output layer's `.weight`, a LoRA layer's base weight: the
    adapter's delta there would be ignored and never trained. TRL 1.16's GRPOTrainer refuses it (a `peft_config`
    naming `lm_head`, or a PEFT model given with it adapted); a trained output layer (`modules_to_save`) is read
    whole and accepted."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from trl_statelens import OnPolicyDistillTrainer

    lora = LoraConfig(r=2, target_modules=["q_proj", "lm_head"])
    message = "Applying a PEFT adapter to `lm_head` is not supported"
    with pytest.raises(ValueError, match=message):
        OnPolicyDistillTrainer(model=str(student_path), teacher_model=str(teacher_path), args=opd_config(tmp_path),
                               train_dataset=math_dataset, peft_config=lora)  # fmt: skip
    student = get_peft_model(AutoModelForCausalLM.from_pretrained(student_path), lora)
    with pytest.raises(ValueError, match=message):
        OnPolicyDistillTrainer(model=student, teacher_model=str(teacher_path), args=opd_config(tmp_path),
                               train_dataset=math_dataset)  # fmt: skip
    trained_head = LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["lm_head"])
    OnPolicyDistillTrainer(model=str(student_path), teacher_model=str(teacher_path), args=opd_config(tmp_path),
                           train_dataset=math_dataset, peft_config=trained_head, state_logging=False)  # fmt: skip


@pytest.mark.parametrize(
    "zero, message",
    [
        ({"mics_shard_size": 2}, "MiCS \\(mics_shard_size=2\\)"),
        ({"zero_quantized_nontrainable_weights": True}, "ZeRO\\+\\+ zero_quantized_nontrainable_weights"),
    ],
)
def test_ema_teacher_under_zero3_with_mics_or_quantized_frozen_weights_is_refused(zero, message):
    """MiCS cuts the partitions within shard groups (a resume would load another group's slice, or zeros), and
    ZeRO++ quantizes a frozen model's partitions (the EMA copy's: the average would run on quantized codes)."""
    from types import SimpleNamespace

    from trl_statelens.teachers.self_teacher_weights import _refuse_unaligned_partitions

    plugin = SimpleNamespace(deepspeed_config={"zero_optimization": {"stage": 3, **zero}})
    with pytest.raises(ValueError, match=f"teacher_model_kind='ema' under DeepSpeed ZeRO-3 with {message}"):
        _refuse_unaligned_partitions(plugin)
    off = {"mics_shard_size": -1, "zero_quantized_nontrainable_weights": False}  # DeepSpeed's defaults
    _refuse_unaligned_partitions(SimpleNamespace(deepspeed_config={"zero_optimization": {"stage": 3, **off}}))


def test_ema_teacher_with_save_only_model_is_refused(tmp_path):
    """The EMA is written beside the RNG states, which `save_only_model=True` skips: its checkpoints could not resume
    the teacher. Refused in the config; a checkpoint without the EMA file says what may have caused it."""
    from trl_statelens.teachers.self_teacher_weights import _saved_average

    with pytest.raises(ValueError, match="teacher_model_kind='ema' with save_only_model=True"):
        opd_config(tmp_path, teacher_model_kind="ema", save_only_model=True)
    opd_config(tmp_path, teacher_model_kind="base", save_only_model=True)  # nothing to resume: fine
    with pytest.raises(ValueError, match="holds no EMA teacher.* saved with save_only_model=True"):
        _saved_average(str(tmp_path))


@pytest.mark.parametrize(
    "setting", [dict(skip_correct_rollouts=True), dict(teacher_cache_steps=2, teacher_cache_max_staleness=0.05)]
)
def test_learner_state_levers_without_learner_states_are_refused(tmp_path, setting):
    """State selection skips correct `learner` rollouts only, and the cache's staleness is measured on `learner`
    tokens only: with no `learner` share nothing is ever skipped, and the staleness is always 0."""
    extra = {"signal": "divergence"} if "teacher_cache_steps" in setting else {}
    name = next(iter(setting)) if "skip_correct_rollouts" in setting else "teacher_cache_max_staleness"
    with pytest.raises(ValueError, match=f"{name}=.*learner states in state_source_mix"):
        opd_config(tmp_path, state_source_mix={"dataset": 1.0}, **setting, **extra)
    opd_config(tmp_path, state_source_mix={"learner": 0.5, "dataset": 0.5}, **setting, **extra)  # read: fine


def test_self_teacher_prompt_longer_than_the_context(tmp_path, math_trained_path, math_dataset, tokenizer):
    """A self teacher's prompt (the template filled with the row's privileged context: solved problems, a long hint)
    can pass the context where the student's prompt fits: checked as the student's are, at construction, before
    the teacher's copy is made."""
    from trl_statelens import OnPolicyDistillTrainer

    context = 512  # the `test`-size models' max_position_embeddings
    rows = math_dataset.select(range(4))
    long_context = "Ava has 3 apples. " * 120
    assert len(tokenizer(long_context).input_ids) > context
    contexts = [*rows["completion"][:2], long_context, rows["completion"][3]]
    data = rows.add_column("privileged_context", contexts)
    args = opd_config(tmp_path, teacher_model_kind="base")
    with pytest.raises(
        ValueError, match="1 self-teacher prompt\\(s\\) do not fit the model's context of 512 .*prompt, row 2"
    ):
        OnPolicyDistillTrainer(model=str(math_trained_path), args=args, train_dataset=data)
    with pytest.raises(ValueError, match="eval_dataset: 1 self-teacher prompt"):  # evaluation runs the same prompts
        OnPolicyDistillTrainer(model=str(math_trained_path), args=args, eval_dataset=data,
                               train_dataset=rows.add_column("privileged_context", rows["completion"]))  # fmt: skip
    fits = rows.add_column("privileged_context", rows["completion"])
    OnPolicyDistillTrainer(model=str(math_trained_path), args=args, train_dataset=fits, state_logging=False)


def test_separate_teacher_prompt_with_its_context_longer_than_the_teachers_context(
    tmp_path, student_path, teacher_path, math_dataset, tokenizer
):
    """With `teacher_reads_context`, a separate teacher reads each row's privileged context before its prompt: checked
    against the teacher's context as a self teacher's prompts are, before training."""
    from trl_statelens import OnPolicyDistillTrainer

    rows = math_dataset.select(range(4))
    long_context = "Ava has 3 apples. " * 120
    assert len(tokenizer(long_context).input_ids) > 512  # the `test`-size models' max_position_embeddings
    data = rows.add_column("privileged_context", [*rows["completion"][:2], long_context, rows["completion"][3]])
    args = opd_config(tmp_path, teacher_reads_context=True)
    with pytest.raises(
        ValueError, match="1 teacher prompt\\(s\\) do not fit the teacher's context of 512 .*row 2.*privileged_context"
    ):
        OnPolicyDistillTrainer(model=str(student_path), teacher_model=str(teacher_path), args=args, train_dataset=data)
    fits = rows.add_column("privileged_context", rows["completion"])
    OnPolicyDistillTrainer(
        model=str(student_path), teacher_model=str(teacher_path), args=args, train_dataset=fits, state_logging=False
    )


def test_cross_tokenizer_teacher_prompt_longer_than_the_teachers_context(
    tmp_path, student_path, other_teacher_path, math_dataset
):
    """A teacher of another tokenizer reads each prompt in its own tokens (and chat template), against its own
    context: a prompt that fits the student's can overrun the teacher's, refused before training."""
    import shutil

    from trl_statelens import OnPolicyDistillTrainer

    short = tmp_path / "short_teacher"
    shutil.copytree(other_teacher_path, short)
    config = json.loads((short / "config.json").read_text())
    config["max_position_embeddings"] = 32  # shorter than the lab's prompts in its tokens
    (short / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="teacher prompt\\(s\\) do not fit the teacher's context of 32 .*own tokens"):
        OnPolicyDistillTrainer(
            model=str(student_path), teacher_model=str(short), args=opd_config(tmp_path),
            train_dataset=math_dataset.select(range(4)),
        )  # fmt: skip


@pytest.mark.parametrize("trainer", ["sft", "grpo", "opd"])
def test_unknown_guards_or_preflight_mode_is_refused_before_any_model_loads(tmp_path, math_dataset, trainer):
    """No model named here exists: each refusal comes before any loading."""
    from trl_statelens import OnPolicyDistillConfig, OnPolicyDistillTrainer

    def build(guards="warn", preflight="warn", preflight_prompts=16):
        if trainer == "opd":  # the config's fields; the config refuses its own preflight settings
            args = OnPolicyDistillConfig(output_dir=str(tmp_path), guards=guards, preflight=preflight,
                                         preflight_prompts=preflight_prompts, **CPU)  # fmt: skip
            return OnPolicyDistillTrainer(model="no/such-model", teacher_model="no/such-teacher", args=args,
                                          train_dataset=math_dataset)  # fmt: skip
        settings = dict(guards=guards, preflight=preflight, preflight_prompts=preflight_prompts)
        if trainer == "sft":
            return StateLensSFTTrainer(model="no/such-model", args=sft_args(tmp_path), train_dataset=math_dataset,
                                       **settings)  # fmt: skip
        return StateLensGRPOTrainer(model="no/such-model", reward_funcs=constant_reward, args=grpo_args(tmp_path),
                                    train_dataset=math_dataset, **settings)  # fmt: skip

    with pytest.raises(ValueError, match=r"guards must be one of \('warn', 'stop', 'off'\).*got 'halt'"):
        build(guards="halt")
    with pytest.raises(ValueError, match=r"preflight='loud' is not one of \('warn', 'strict', 'off'\)"):
        build(preflight="loud")
    with pytest.raises(ValueError, match="preflight_prompts must be at least 1 training prompt, got 0"):
        build(preflight_prompts=0)
