"""On-policy distillation on the users' path: truncated rollouts, GRPO settings the loss would ignore, MoE students,
teachers with a padded vocabulary, the discounted reverse-KL advantage on long rows."""

from types import SimpleNamespace

import pytest
import torch
from cpu_settings import CPU
from torch.utils._python_dispatch import TorchDispatchMode

from trl_statelens import OnPolicyDistillConfig, OnPolicyDistillTrainer


def opd_config(tmp_path, **kwargs):
    defaults = dict(
        output_dir=str(tmp_path),
        max_steps=1,
        per_device_train_batch_size=8,
        num_generations=2,
        max_completion_length=16,
        learning_rate=1e-3,
    )
    return OnPolicyDistillConfig(**{**defaults, **CPU, **kwargs})


def _rows(dataset, n):
    return [dataset[i] for i in range(n)]


# ----- truncated rollouts: mask_truncated_completions holds for every signal and state source -------------------------
def _truncate_even_rows(trainer):
    """Rollouts of even rows never sample eos (truncated at max_completion_length); odd rows end at once."""
    eos = trainer.eos_token_ids[0]

    def hook(module, inputs, logits):
        logits[0::2, ..., eos] = -1e4
        logits[1::2, ..., eos] = 1e4
        return logits

    trainer.model.get_output_embeddings().register_forward_hook(hook)


@pytest.fixture(scope="module")
def teacher_server(teacher_path):
    from vllm_test_server import TestTeacherServer

    with TestTeacherServer(teacher_path) as server:
        yield server


@pytest.mark.parametrize("mask_truncated, served", [(True, False), (True, True), (False, False)])
def test_continuation_supervises_nothing_on_a_masked_truncated_rollout(
    request, tmp_path, student_path, teacher_path, math_dataset, mask_truncated, served
):
    """GRPO trains nothing on a rollout it masked as truncated; the continuation signal must not turn it into a cut
    at 0 and a teacher continuation from the prompt."""
    server = dict(teacher_model_server_url=request.getfixturevalue("teacher_server").url) if served else {}
    trainer = OnPolicyDistillTrainer(
        model=str(student_path),
        teacher_model=None if served else str(teacher_path),
        args=opd_config(
            tmp_path,
            signal="continuation",
            continuation_length=4,
            max_completion_length=6,
            mask_truncated_completions=mask_truncated,
            **server,
        ),
        train_dataset=math_dataset,
        state_logging=False,
    )
    _truncate_even_rows(trainer)
    calls = []
    generate = trainer.teacher.generate

    def spy(
        prompts, n, prefixes=None, **kwargs
    ):  # the calls that ask the teacher for rows (the teacher source asks for none)
        if prompts:
            calls.append(len(prompts))
        return generate(prompts, n, prefixes, **kwargs)

    trainer.teacher.generate = spy
    trainer.model.train()
    batch = trainer._generate_and_score_completions(_rows(math_dataset, 4) * 2)
    supervised = batch["loss_mask"].sum(1)
    assert (supervised[1::2] > 0).all()  # finished rollouts: cut and continued
    if mask_truncated:  # as GRPO: truncated rollouts supervise nothing, and the teacher is not asked to continue them
        assert calls == [4] and supervised[0::2].sum() == 0 and batch["completion_mask"][0::2].sum() == 0
        assert batch["num_items_in_batch"] == supervised.sum()
    else:  # without the flag a truncated rollout is cut anywhere in its 6 tokens and continued
        assert calls == [8] and (supervised[0::2] > 0).all()


def test_dataset_reference_longer_than_the_limit_is_truncated_not_given_an_eos(
    tmp_path, student_path, teacher_path, math_dataset
):
    trainer = OnPolicyDistillTrainer(
        model=str(student_path),
        teacher_model=str(teacher_path),
        args=opd_config(
            tmp_path, max_completion_length=6, mask_truncated_completions=True, state_source_mix={"dataset": 1.0}
        ),
        train_dataset=math_dataset,
        state_logging=False,
    )
    eos = trainer.eos_token_ids[0]
    tokens = lambda text: trainer._tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    long_answer, short_answer = " 1234567890123", " 12"
    assert len(tokens(long_answer)) > 6 and len(tokens(short_answer)) < 5
    assert trainer._reference_ids(long_answer, 6) == tokens(long_answer)[:6]  # cut at the limit, no eos
    assert trainer._reference_ids(short_answer, 6) == tokens(short_answer) + [eos]
    exactly_six = trainer._tokenizer.decode(tokens(long_answer)[:6])
    assert trainer._reference_ids(exactly_six, 6) == tokens(long_answer)[:6]  # no room left for its eos: truncated
    rows = [{**row, "completion": answer} for row, answer in zip(_rows(math_dataset, 2), [long_answer, short_answer])]
    batch = trainer._generate_and_score_completions([rows[0], rows[0], rows[1], rows[1]])
    # the long reference is masked as GRPO masks a truncated rollout; the short one is supervised, eos included
    short = len(tokens(short_answer)) + 1
    assert batch["completion_mask"].sum(1).tolist() == [0, 0, short, short]
    assert trainer._resolve_teacher_logps(batch)[:2].abs().sum() == 0


# ----- kl_discount: O(B*T), the same advantages as the discount-matrix formula ----------------------------------------
class _LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an operation returns."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(value, torch.Tensor):
                self.numel = max(self.numel, value.numel())
        return out


def _matrix_advantages(logps, teacher_logps, mask, gamma):
    """The formula as first written: a (T, T) matrix of discounts."""
    kl = (logps - teacher_logps) * mask
    steps = torch.arange(kl.size(1))
    lag = (steps[None, :] - steps[:, None]).double()
    discount = torch.where(lag >= 0, gamma ** lag.clamp(min=0), torch.zeros_like(lag))
    return -(kl @ discount.T) * mask


@pytest.mark.parametrize("gamma", [0.0, 0.5, 0.95, 1.0])
def test_discounted_advantages_match_the_matrix_formula_without_a_t_by_t_tensor(gamma):
    torch.manual_seed(0)
    rows, length = 3, 200
    logps, teacher_logps = -torch.rand(rows, length), -torch.rand(rows, length)
    mask = torch.ones(rows, length)
    mask[0, 150:] = 0  # padding at the end
    mask[1, 40:60] = 0  # tokens masked in the middle (tool outputs)
    mask[2, :] = 0  # a row masked whole (a truncated rollout)
    trainer = SimpleNamespace(args=SimpleNamespace(kl_discount=gamma))
    with _LargestTensor() as largest:
        advantages = OnPolicyDistillTrainer._reverse_kl_advantages(trainer, logps, teacher_logps, mask)
    expected = _matrix_advantages(logps.double(), teacher_logps.double(), mask.double(), gamma)
    torch.testing.assert_close(advantages, expected.float(), rtol=1e-5, atol=1e-5)
    assert largest.numel <= rows * length  # the discount matrix alone had length**2 = 40000 elements


# ----- GRPO settings: applied or refused, never silently ignored ------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(top_entropy_quantile=0.2), "top_entropy_quantile=0.2: GRPO's high-entropy token mask"),
        (dict(entropy_coef=0.01), "entropy_coef=0.01, use_adaptive_entropy=False: GRPO's entropy bonus"),
        (dict(use_adaptive_entropy=True), "use_adaptive_entropy=True: GRPO's entropy bonus"),
        (dict(off_policy_mask_threshold=0.5), "off_policy_mask_threshold=0.5: GRPO's off-policy sequence mask"),
        (dict(epsilon=0.3), r"\{'epsilon': 0.3\}: these shape GRPO's clipped importance ratio"),
        (dict(epsilon_high=0.28), r"\{'epsilon_high': 0.28\}"),
        (dict(delta=2.0), r"\{'delta': 2.0\}"),
        (dict(importance_sampling_level="sequence"), r"\{'importance_sampling_level': 'sequence'\}"),
        (dict(signal="continuation", reward_weight=0.5), "reward_weight=0.5 with signal='continuation'"),
        (dict(signal="divergence", reward_weight=0.5), "reward_weight=0.5 with signal='divergence'"),
    ],
)
def test_grpo_loss_settings_no_opd_loss_reads_are_refused(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        opd_config(tmp_path, **kwargs)


def test_reward_weight_is_accepted_with_reverse_kl(tmp_path):
    assert opd_config(tmp_path, reward_weight=0.5).reward_weight == 0.5


@pytest.fixture(scope="module")
def moe_student_path(tmp_path_factory, tokenizer):
    """A tiny random-init Qwen3-MoE with the lab vocabulary; its config's router_aux_loss_coef is 0.001."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_experts=4, num_experts_per_tok=2, pad_token_id=tokenizer.pad_token_id,
                            eos_token_id=tokenizer.eos_token_id, bos_token_id=None)  # fmt: skip
    path = tmp_path_factory.mktemp("moe-student")
    Qwen3MoeForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.parametrize("signal", ["reverse_kl", "continuation", "divergence"])
def test_moe_router_aux_loss_is_added_as_grpo_adds_it(tmp_path, moe_student_path, teacher_path, math_dataset, signal):
    from trl import GRPOTrainer

    trainer = OnPolicyDistillTrainer(
        model=str(moe_student_path),
        teacher_model=str(teacher_path),
        args=opd_config(
            tmp_path,
            signal=signal,
            gradient_accumulation_steps=2,
            router_aux_loss_coef=0.5,
            **({"continuation_length": 4} if signal == "continuation" else {}),
        ),
        train_dataset=math_dataset,
        state_logging=False,
    )
    assert trainer.aux_loss_enabled and trainer.router_aux_loss_coef == 0.5
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2
    batch = trainer._generate_and_score_completions(_rows(math_dataset, 4) * 2)
    with_aux = trainer._compute_loss(trainer.model, batch)
    # GRPO's own aux loss on the same batch, through TRL's fused head
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    with torch.no_grad():
        _, _, aux_loss = GRPOTrainer._get_per_token_logps_and_entropies(
            trainer, trainer.model, input_ids, attention_mask, batch["completion_ids"].size(1), compute_aux_loss=True
        )
    assert aux_loss > 0
    trainer.aux_loss_enabled = False
    without_aux = trainer._compute_loss(trainer.model, batch)
    # GRPO: loss + router_aux_loss_coef * aux_loss / gradient accumulation steps
    torch.testing.assert_close(with_aux - without_aux, 0.5 * aux_loss / 2, rtol=1e-4, atol=1e-6)
    assert trainer._metrics["train"]["aux_loss"] == [pytest.approx(aux_loss.item(), rel=1e-5)]


# ----- a teacher whose output layer is padded past the student's vocabulary (same tokenizer) --------------------------
EXTRA_ROWS = 128  # Qwen2.5-7B (152064 rows) over Qwen2.5-0.5B (151936), at lab size


@pytest.fixture(scope="module")
def padded_teacher_path(tmp_path_factory, teacher_path, tokenizer):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_path)
    teacher.resize_token_embeddings(len(tokenizer) + EXTRA_ROWS)
    path = tmp_path_factory.mktemp("padded-teacher")
    teacher.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_reverse_kl_scores_the_students_ids_under_a_padded_teachers_whole_softmax(
    tmp_path, student_path, padded_teacher_path, math_dataset, tokenizer
):
    from transformers import AutoModelForCausalLM

    trainer = OnPolicyDistillTrainer(
        model=str(student_path),
        teacher_model=str(padded_teacher_path),
        args=opd_config(tmp_path),
        train_dataset=math_dataset,
        state_logging=False,
    )
    trainer.model.train()
    batch = trainer._generate_and_score_completions(_rows(math_dataset, 4) * 2)
    teacher = AutoModelForCausalLM.from_pretrained(padded_teacher_path)
    assert teacher.config.vocab_size == len(tokenizer) + EXTRA_ROWS
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    with torch.no_grad():
        logits = teacher(input_ids=input_ids, attention_mask=attention_mask).logits
    num_completion = batch["completion_ids"].size(1)
    logps = logits[:, -num_completion - 1 : -1].float().log_softmax(-1)  # over all rows, padding included
    expected = logps.gather(-1, batch["completion_ids"][..., None])[..., 0] * batch["completion_mask"]
    teacher_logps = trainer._resolve_teacher_logps(batch)
    torch.testing.assert_close(teacher_logps * batch["completion_mask"], expected, rtol=1e-4, atol=1e-4)
    loss = trainer._compute_loss(trainer.model, batch)
    assert torch.isfinite(loss) and loss.item() != 0.0


def test_continuation_teacher_with_a_padded_output_layer_never_writes_padding_ids(
    tmp_path, student_path, padded_teacher_path, math_dataset, tokenizer
):
    trainer = OnPolicyDistillTrainer(
        model=str(student_path),
        teacher_model=str(padded_teacher_path),
        args=opd_config(tmp_path, signal="continuation", continuation_length=6),
        train_dataset=math_dataset,
        state_logging=False,
    )
    teacher = trainer.accelerator.unwrap_model(trainer.teacher_model)
    student_vocab = len(tokenizer)

    def padding_first(module, inputs, logits):  # a teacher that would pick its padding rows if it could
        logits[..., student_vocab:] += 1e4
        return logits

    hook = teacher.get_output_embeddings().register_forward_hook(padding_first)
    prompt_ids = trainer._tokenizer(math_dataset["prompt"][:4])["input_ids"]
    continuations = trainer.teacher.generate(prompt_ids, 6)
    hook.remove()
    assert all(len(c) > 0 and max(c) < student_vocab for c in continuations)
    trainer.model.train()
    batch = trainer._generate_and_score_completions(_rows(math_dataset, 4) * 2)
    assert batch["completion_ids"].max() < student_vocab and batch["loss_mask"].sum() > 0
    assert torch.isfinite(trainer._compute_loss(trainer.model, batch))


def test_divergence_refuses_a_teacher_of_another_width_and_says_how_to_drop_the_padding(
    tmp_path, student_path, padded_teacher_path, math_dataset, tokenizer
):
    with pytest.raises(ValueError, match=rf"resize_token_embeddings\({len(tokenizer)}\)"):
        OnPolicyDistillTrainer(
            model=str(student_path),
            teacher_model=str(padded_teacher_path),
            args=opd_config(tmp_path, signal="divergence"),
            train_dataset=math_dataset,
        )
