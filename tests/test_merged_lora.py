"""A LoRA student samples through its adapter merged into copies of its weights, and the originals come back."""

from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
from cpu_settings import CPU
from transformers import AutoModelForCausalLM

from trl_statelens import OnPolicyDistillConfig, OnPolicyDistillTrainer
from trl_statelens.merged_lora import merged_lora_for_sampling

peft = pytest.importorskip("peft")


def _lora_model(path, **config):
    torch.manual_seed(0)
    model = peft.get_peft_model(
        AutoModelForCausalLM.from_pretrained(path),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, **config),
    )
    with torch.no_grad():  # a trained adapter: B is zero at the start, which would hide a merge that does nothing
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    return model.eval()


def _trainer(merge=True):
    return SimpleNamespace(
        args=SimpleNamespace(merge_lora_for_sampling=merge, use_vllm=False),
        is_deepspeed_enabled=False,
        is_fsdp_enabled=False,
    )


@contextmanager
def _counting_adapter_calls(model):
    calls = []
    hooks = [
        module.register_forward_hook(lambda *_: calls.append(1))
        for name, module in model.named_modules()
        if name.endswith("lora_A.default")
    ]
    try:
        yield calls
    finally:
        for hook in hooks:
            hook.remove()


def test_merged_sampling_gives_the_adapters_outputs_without_running_it_and_restores_the_weights(student_path):
    model = _lora_model(student_path)
    ids = torch.tensor([[3, 5, 7, 9, 11, 13]])
    base = {name: (p.data_ptr(), p.detach().clone()) for name, p in model.named_parameters() if "lora" not in name}
    with torch.no_grad():
        expected = model(ids).logits
        with merged_lora_for_sampling(_trainer(), model), _counting_adapter_calls(model) as calls:
            merged = model(ids).logits
    assert calls == []  # the adapter did not run: its matmuls are what merging saves
    torch.testing.assert_close(merged, expected, rtol=1e-4, atol=1e-4)
    # the frozen base is the very tensors it was, bit for bit (an in-place W + dW - dW would not be)
    for name, p in model.named_parameters():
        if "lora" not in name:
            assert p.data_ptr() == base[name][0] and torch.equal(p, base[name][1]), name
    with torch.no_grad(), _counting_adapter_calls(model) as calls:
        torch.testing.assert_close(model(ids).logits, expected, rtol=0, atol=0)  # the adapter is back on
    assert calls


@pytest.mark.parametrize(
    "trainer, config",
    [(_trainer(merge=False), {}), (_trainer(), {"modules_to_save": ["lm_head"]}), (_trainer(), {"use_dora": True})],
    ids=["turned_off", "modules_to_save", "dora"],
)
def test_sampling_keeps_the_adapter_where_a_merge_is_not_exact_or_not_asked_for(student_path, trainer, config):
    model = _lora_model(student_path, **config)
    with torch.no_grad(), merged_lora_for_sampling(trainer, model), _counting_adapter_calls(model) as calls:
        model(torch.tensor([[3, 5, 7]]))
    assert calls


def _one_step(tmp_path, **settings) -> OnPolicyDistillConfig:
    """One OPD step of 8 short rollouts, no preflight."""
    defaults = dict(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=8, num_generations=2,
                    max_completion_length=8, learning_rate=1e-3, preflight="off")  # fmt: skip
    return OnPolicyDistillConfig(**{**defaults, **CPU, **settings})


@pytest.mark.parametrize("merge", [True, False])
def test_opd_rollouts_of_a_lora_student_sample_merged(
    tmp_path, math_trained_path, math_teacher_path, math_dataset, merge
):
    args = _one_step(tmp_path, merge_lora_for_sampling=merge)
    trainer = OnPolicyDistillTrainer(
        model=str(math_trained_path),
        teacher_model=str(math_teacher_path),
        args=args,
        train_dataset=math_dataset,
        peft_config=peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"),
    )
    student = trainer.accelerator.unwrap_model(trainer.model)
    base = {k: v.clone() for k, v in student.state_dict().items() if "lora" not in k}
    generate, during_generate = student.generate, []

    def counted_generate(*a, **kw):
        with _counting_adapter_calls(student) as calls:
            out = generate(*a, **kw)
        during_generate.append(len(calls))
        return out

    student.generate = counted_generate
    trainer.train()
    assert during_generate  # the rollouts were sampled through this model
    assert (max(during_generate) == 0) if merge else (min(during_generate) > 0)
    after = student.state_dict()
    assert all(torch.equal(after[k], v) for k, v in base.items())  # training still trains the adapter only


@pytest.mark.parametrize("bf16", [True, False])
def test_student_and_teacher_sample_in_the_precision_the_loss_runs_in(
    tmp_path, math_trained_path, math_teacher_path, math_dataset, bf16
):
    """With `bf16=True` on a CPU (an fp32 model under autocast) the student's rollouts, its probes and the teacher's
    written states decode under the same autocast as the loss's forward; without it, none does. Failed for the
    rollouts, probes and teacher states before `student_sampling` (TRL's generation decodes in fp32)."""
    from trl_statelens import StateLoggingCallback

    args = _one_step(tmp_path, state_source_mix={"learner": 0.5, "teacher": 0.5}, bf16=bf16)
    trainer = OnPolicyDistillTrainer(
        model=str(math_trained_path),
        teacher_model=str(math_teacher_path),
        args=args,
        train_dataset=math_dataset,
        callbacks=[
            StateLoggingCallback(
                probe_prompts=["Mia has 3 pens.", "Kai has 5 cups."], probe_steps=1, probe_max_new_tokens=4
            )
        ],
    )
    sampled = {"student": [], "teacher": []}  # per `generate` call, whether autocast was on inside it

    def recording(name, model):
        generate = model.generate

        def recorded(*args, **kwargs):
            sampled[name].append(torch.is_autocast_enabled("cpu"))
            return generate(*args, **kwargs)

        model.generate = recorded

    recording("student", trainer.accelerator.unwrap_model(trainer.model))
    recording("teacher", trainer.accelerator.unwrap_model(trainer.teacher_model))
    trainer.train()
    assert len(sampled["student"]) >= 3 and sampled["teacher"]  # rollouts and two probes; the teacher's states
    assert set(sampled["student"]) == {bf16} and set(sampled["teacher"]) == {bf16}
