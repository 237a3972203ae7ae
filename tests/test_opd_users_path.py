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


# ----- truncated rollouts: mask_truncated_completions holds for every signal and state source ---------------------------
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
    generate = trainer._teacher_generate
    trainer._teacher_generate = lambda prefixes, n: calls.append(len(prefixes)) or generate(prefixes, n)
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
    assert trainer._reference_ids(long_answer) == tokens(long_answer)[:6]  # cut at the limit, no eos
    assert trainer._reference_ids(short_answer) == tokens(short_answer) + [eos]
    exactly_six = trainer._tokenizer.decode(tokens(long_answer)[:6])
    assert trainer._reference_ids(exactly_six) == tokens(long_answer)[:6]  # no room left for its eos: truncated
    rows = [{**row, "completion": answer} for row, answer in zip(_rows(math_dataset, 2), [long_answer, short_answer])]
    batch = trainer._generate_and_score_completions([rows[0], rows[0], rows[1], rows[1]])
    # the long reference is masked as GRPO masks a truncated rollout; the short one is supervised, eos included
    short = len(tokens(short_answer)) + 1
    assert batch["completion_mask"].sum(1).tolist() == [0, 0, short, short]
    assert batch["teacher_logps"][:2].abs().sum() == 0


# ----- kl_discount: O(B*T), the same advantages as the discount-matrix formula -----------------------------------------
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
