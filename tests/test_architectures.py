"""Beyond Qwen3: the drop-in claim on tiny random-init models of the families TRL users train.

Tied and untied LM heads, a fused-QKV one (Phi3), a soft-capped one (Gemma2, also scaled embeddings and
sliding-window layers) and an older absolute-position one (GPT2, with dropout on): StateLens SFT/GRPO train exactly
as stock TRL and write sensible state records, and the three on-policy distillation signals train, with a teacher
identical to the student saying nothing. Each model is built from a config with the tests' tokenizer in well under
a second."""

import math

import pytest
import torch
from cpu_settings import CPU
from datasets import Dataset
from test_grpo_trainer import digit_reward, grpo_config
from test_opd_trainer import log_history, opd_config
from test_sft_trainer import count_supervised_labels, read_jsonl, sft_config
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    GenerationConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
)
from trl import DistillationConfig, DistillationTrainer, GRPOTrainer, SFTTrainer

from trl_statelens import (
    OnPolicyDistillTrainer,
    StateLensGRPOTrainer,
    StateLensSFTTrainer,
    StateLoggingCallback,
)
from trl_statelens.lab import build_qwen3

HIDDEN, LAYERS, FFN, HEADS = 32, 2, 64, 4
# GQA where the family has it: 4 query heads, 2 key/value heads of width 8
DECODER = dict(
    hidden_size=HIDDEN,
    intermediate_size=FFN,
    num_hidden_layers=LAYERS,
    num_attention_heads=HEADS,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def build_family(family: str, tokenizer, seed: int):
    ids = dict(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    if family == "qwen3":  # tied head
        return build_qwen3(tokenizer, HIDDEN, LAYERS, FFN, seed=seed)
    if family == "llama":  # untied head
        model = LlamaForCausalLM(LlamaConfig(**DECODER, tie_word_embeddings=False, **ids))
    elif family == "mistral":  # untied head, sliding-window attention
        model = MistralForCausalLM(MistralConfig(**DECODER, head_dim=HIDDEN // HEADS, sliding_window=16, **ids))
    elif family == "phi3":  # fused qkv and gate-up projections, untied head
        model = Phi3ForCausalLM(Phi3Config(**DECODER, tie_word_embeddings=False, **ids))
    elif family == "gemma2":  # tied head, final logit soft-capping, scaled embeddings, sliding-window layers
        # Weights large enough for logits of a few units, with a cap they reach (at random init's 0.02 the logits
        # stay near 0.1, where a cap of 30 changes nothing)
        config = Gemma2Config(
            **DECODER,
            head_dim=HIDDEN // HEADS,
            sliding_window=16,
            initializer_range=0.5,
            final_logit_softcapping=5.0,
            **ids,
        )
        assert config.tie_word_embeddings
        model = Gemma2ForCausalLM(config)
    elif family == "gpt2":  # learned absolute positions, LayerNorm, Conv1D layers, dropout 0.1, tied head
        config = GPT2Config(n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=512, **ids)
        assert config.resid_pdrop > 0
        model = GPT2LMHeadModel(config)
    else:
        raise ValueError(family)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    return model


FAMILIES = ["qwen3", "llama", "mistral", "phi3", "gemma2", "gpt2"]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def family_paths(tmp_path_factory, tokenizer, family):
    """The family's student (seed 0) and another model of the same shape and vocabulary (seed 1), saved as
    checkpoints with the tokenizer."""
    paths = {}
    for name, seed in (("student", 0), ("teacher", 1)):
        path = tmp_path_factory.mktemp(f"{family}-{name}")
        build_family(family, tokenizer, seed).save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths[name] = str(path)
    return paths


def test_families_differ_in_what_matters(tokenizer):
    """The parametrization covers what it claims: tied and untied heads, soft-capping, absolute positions."""
    models = {family: build_family(family, tokenizer, 0) for family in FAMILIES}
    tied = {f for f, m in models.items() if m.get_output_embeddings().weight is m.get_input_embeddings().weight}
    assert tied == {"qwen3", "gemma2", "gpt2"}
    assert [f for f, m in models.items() if getattr(m.config, "final_logit_softcapping", None)] == ["gemma2"]
    assert hasattr(models["gpt2"].transformer, "wpe")  # learned absolute position embeddings
    assert all(m.config.vocab_size == len(tokenizer) for m in models.values())


def train_counting_forwards(trainer):
    """Train; return the per-step logs and the backbone's forward calls (every loss path calls it)."""
    calls = []
    trainer.model.base_model.register_forward_pre_hook(lambda module, args: calls.append(1))
    trainer.train()
    return [log for log in trainer.state.log_history if "loss" in log], len(calls)


def test_sft_same_training_as_stock(tmp_path, family_paths, tokenizer, math_dataset):
    runs = {}
    for name, trainer_cls in (("stock", SFTTrainer), ("lens", StateLensSFTTrainer)):
        args = sft_config(tmp_path, name, max_steps=2, max_length=512)
        callbacks = [StateLoggingCallback(sample_rate=1.0)] if name == "lens" else None
        # the forward counts are training's: the preflight's forwards before step 1 are left out (test_preflight.py)
        off = {"preflight": "off"} if name == "lens" else {}
        trainer = trainer_cls(
            **off,
            model=family_paths["student"],
            args=args,
            train_dataset=math_dataset.select(range(8)),  # two steps of 4 rows: nothing more to tokenize
            processing_class=tokenizer,
            callbacks=callbacks,
        )
        labels = count_supervised_labels(trainer)
        logs, calls = train_counting_forwards(trainer)
        runs[name] = trainer, logs, calls, labels
    (stock, stock_logs, stock_calls, _), (lens, lens_logs, lens_calls, label_counts) = runs["stock"], runs["lens"]
    assert [log["loss"] for log in lens_logs] == pytest.approx([log["loss"] for log in stock_logs], rel=1e-6)
    torch.testing.assert_close(lens.model.state_dict(), stock.model.state_dict())
    assert lens_calls == stock_calls == 2

    ledger = tmp_path / "lens" / "statelens"
    steps, states = read_jsonl(ledger / "steps.jsonl"), read_jsonl(ledger / "states.jsonl")
    assert [line["supervised_tokens"] for line in steps] == label_counts
    assert all(count > 0 for count in label_counts)
    assert len(states) == 2 * 4
    completions = {row["prompt"]: row["completion"] for row in math_dataset}
    for state in states:
        assert state["completion"] == completions[state["prompt"]] + tokenizer.eos_token
        assert state["prefix_len"] == list(range(state["num_supervised"]))
        assert all(math.isfinite(x) and x <= 0 for x in state["logp"])


def test_grpo_same_training_as_stock(tmp_path, family_paths, tokenizer, math_dataset):
    prompts = Dataset.from_dict({"prompt": math_dataset["prompt"][:8]})
    runs = {}
    for name, trainer_cls in (("stock", GRPOTrainer), ("lens", StateLensGRPOTrainer)):
        callbacks = [StateLoggingCallback(sample_rate=1.0)] if name == "lens" else None
        # the forward counts are training's: the preflight's forwards before step 1 are left out (test_preflight.py)
        off = {"preflight": "off"} if name == "lens" else {}
        trainer = trainer_cls(
            **off,
            model=family_paths["student"],
            reward_funcs=digit_reward,
            args=grpo_config(tmp_path, name, max_steps=2),
            train_dataset=prompts,
            processing_class=tokenizer,
            callbacks=callbacks,
        )
        runs[name] = (trainer, *train_counting_forwards(trainer))
    (stock, stock_logs, stock_calls), (lens, lens_logs, lens_calls) = runs["stock"], runs["lens"]
    for key in ("loss", "reward", "entropy", "completions/mean_length"):
        assert [log[key] for log in lens_logs] == pytest.approx([log[key] for log in stock_logs], rel=1e-6), key
    torch.testing.assert_close(lens.model.state_dict(), stock.model.state_dict())
    assert lens_calls == stock_calls

    ledger = tmp_path / "lens" / "statelens"
    steps, states = read_jsonl(ledger / "steps.jsonl"), read_jsonl(ledger / "states.jsonl")
    assert [line["step"] for line in steps] == [1, 2]
    for line, log in zip(steps, lens_logs):
        step_states = [state for state in states if state["step"] == line["step"]]
        assert len(step_states) == 4
        assert line["supervised_tokens"] == sum(state["num_supervised"] for state in step_states) > 0
        # completions are at most max_completion_length tokens, and every supervised token is one of them
        assert line["supervised_tokens"] == pytest.approx(4 * log["completions/mean_length"])
        for state in step_states:
            assert state["source"] == "learner"
            assert state["prefix_len"] == list(range(state["num_supervised"]))
            assert state["num_supervised"] <= 8


@pytest.mark.parametrize("signal", ["reverse_kl", "continuation", "divergence"])
def test_opd_signals_train_with_a_finite_loss(tmp_path, family_paths, math_dataset, signal):
    trainer = OnPolicyDistillTrainer(
        model=family_paths["student"],
        teacher_model=family_paths["teacher"],
        args=opd_config(
            tmp_path,
            max_steps=2,
            signal=signal,
            max_completion_length=8,
            **({"continuation_length": 4} if signal == "continuation" else {}),
        ),
        train_dataset=math_dataset,
    )
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    losses, kls = log_history(trainer, "loss"), log_history(trainer, "teacher_kl/sampled")
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert len(kls) == 2 and all(math.isfinite(x) for x in kls)
    assert all(g > 0 and math.isfinite(g) for g in log_history(trainer, "grad_norm"))
    assert any(not torch.equal(v, before[k]) for k, v in trainer.model.state_dict().items())


@pytest.mark.parametrize("signal", ["reverse_kl", "continuation", "divergence"])
def test_opd_teacher_equal_to_student_says_nothing(tmp_path, family_paths, math_dataset, signal):
    trainer = OnPolicyDistillTrainer(
        model=family_paths["student"],
        teacher_model=family_paths["student"],
        # GPT2's dropout would make the training student differ from the eval-mode teacher: TRL's switch turns it off
        args=opd_config(
            tmp_path,
            max_steps=1,
            signal=signal,
            temperature=1.0,
            disable_dropout=True,
            **({"continuation_length": 4} if signal == "continuation" else {}),
        ),
        train_dataset=math_dataset,
    )
    trainer.train()
    assert abs(log_history(trainer, "teacher_kl/sampled")[0]) < 1e-4
    if signal == "continuation":  # cross-entropy on the teacher's tokens: a gradient even from an equal teacher
        assert log_history(trainer, "grad_norm")[0] > 1e-3
    else:
        assert log_history(trainer, "grad_norm")[0] < 1e-4


@pytest.mark.parametrize("parity_family", FAMILIES)
def test_divergence_beta1_matches_distillation_trainer(tmp_path, tokenizer, math_dataset, parity_family):
    """The divergence loss with jsd_beta=1 is TRL's DistillationTrainer(beta=1) loss on the same batch."""
    paths = {}
    for name, seed in (("student", 0), ("teacher", 1)):
        paths[name] = str(tmp_path / name)
        build_family(parity_family, tokenizer, seed).save_pretrained(paths[name])
        tokenizer.save_pretrained(paths[name])
    ours = OnPolicyDistillTrainer(
        model=paths["student"],
        teacher_model=paths["teacher"],
        args=opd_config(tmp_path / "ours", signal="divergence", jsd_beta=1.0, max_completion_length=8),
        train_dataset=math_dataset,
    )
    ours.model.eval()  # no dropout: the two trainers draw their dropout masks differently
    batch = ours._generate_and_score_completions([{"prompt": p} for p in math_dataset["prompt"][:4] for _ in range(2)])
    stock = DistillationTrainer(
        model=paths["student"],
        teacher_model=paths["teacher"],
        args=DistillationConfig(output_dir=str(tmp_path / "stock"), beta=1.0, max_completion_length=8, **CPU),
        train_dataset=math_dataset.select_columns(["prompt"]),
    )
    stock.model.eval()
    inputs = {k: batch[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
    ours_loss = ours.compute_loss(ours.model, batch)
    stock_loss = stock.compute_loss(stock.model, {**inputs, "num_items_in_batch": batch["num_items_in_batch"]})
    assert ours_loss.item() > 0
    torch.testing.assert_close(ours_loss, stock_loss, rtol=1e-4, atol=1e-6)
