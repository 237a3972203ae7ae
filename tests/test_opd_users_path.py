"""On-policy distillation on the users' path: truncated rollouts, GRPO settings the loss would ignore, MoE students,
teachers with a padded vocabulary, the discounted reverse-KL advantage on long rows."""

from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trl_statelens import OnPolicyDistillTrainer


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
