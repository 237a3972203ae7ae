"""FSDP2 (`fully_shard`) on 2 CPU processes over gloo, launched by tests/test_fsdp2.py in one of two ways:

    accelerate launch --config_file recipes/accelerate/fsdp2.yaml --num_processes 2 fsdp2_two_ranks.py \
        accelerate STUDENT TEACHER OUTPUT_DIR CASE[,CASE...]
    torchrun --nproc_per_node 2 fsdp2_two_ranks.py sharded STUDENT TEACHER OUTPUT_DIR

`accelerate`: the trainers under accelerate's FSDP2, the GPU recipe, each case next to the same run under DDP from the
same seed and data. accelerate 1.16 keeps the launch config's FSDP plugin only for GPU-like process types
(`AcceleratorState.__init__` in accelerate/state.py lists MULTI_GPU, MULTI_NPU, ... but not MULTI_CPU), so on a CPU
the same launch runs DDP, and no environment variable changes that. `fsdp2` names the process type GPU-like between a
trainer's device setup and the Accelerator it makes: accelerate then prepares the student as on GPUs
(`fsdp2_prepare_model`: `fully_shard` on each decoder layer, then on the root).

`sharded`: models that reach the trainers already sharded, without accelerate's plugin. `from_pretrained(
distributed_config=DistributedConfig(fsdp_size=2))` shards at load by the model's FSDP plan (transformers 5.24) and
marks the model, so the Trainer wraps it in nothing: OPD with such a student (and teacher) next to the same run under
DDP, and the self teacher's copies, refused. Then the package's pieces on a student and a teacher sharded by hand
(`fully_shard` on each decoder layer, then the root, as accelerate does), against the same computations on the
unsharded models in this process.

Each rank writes `OUTPUT_DIR/rank<i>.json`: what ran (distributed type, FSDP version, the models' DTensor parameters
and this rank's share of their elements when training began) and the numbers.
"""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the shared CPU settings

import torch  # noqa: E402
from accelerate import PartialState  # noqa: E402
from accelerate.utils import DistributedType  # noqa: E402
from cpu_settings import CPU  # noqa: E402
from datasets import Dataset  # noqa: E402
from peft import LoraConfig  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor, Shard  # noqa: E402
from transformers import AutoModelForCausalLM, TrainerCallback  # noqa: E402
from transformers.distributed import DistributedConfig  # noqa: E402
from trl import SFTConfig  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

import trl_statelens.opd.loss  # noqa: E402
from trl_statelens import (  # noqa: E402
    ForgettingForecast,
    OnPolicyDistillConfig,
    OnPolicyDistillTrainer,
    StateLensSFTTrainer,
    StateLoggingCallback,
)
from trl_statelens.heads import _completion_hidden_states, topk_tail_divergence  # noqa: E402
from trl_statelens.lab import LabWorld, format_plain  # noqa: E402
from trl_statelens.teachers import InProcessTeacher  # noqa: E402

torch.set_num_threads(1)
mode, student_path, teacher_path, output_dir = sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4])
rows = LabWorld(seed=0).math("train", n=8)
sft_data = Dataset.from_list([{"prompt": format_plain(r["question"]), "completion": " " + r["answer"]} for r in rows])
prompts = Dataset.from_list([{"prompt": format_plain(r["question"])} for r in rows])
with_context = Dataset.from_list(
    [{"prompt": format_plain(r["question"]), "privileged_context": r["answer"]} for r in rows]
)
PROBES = ["Question: 2 + 3 =", "Question: 7 - 4 ="]
TIMINGS = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"}


def fsdp2(args):
    """Make the next trainer built with `args` run accelerate's FSDP2 on this CPU (see the module docstring)."""
    assert args.device.type == "cpu"  # the trainer's device setup first: it resets accelerate's process state
    PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU


def at_load(path):
    return AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(fsdp_size=2))


def by_hand(path, training=False):
    """The model sharded as accelerate's FSDP2 shards a student, its fused LM head added first (as GRPO adds it)."""
    model = AutoModelForCausalLM.from_pretrained(path).train(training)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    for layer in model.model.layers:
        fully_shard(layer)
    return fully_shard(model)


def shares(model) -> dict:
    """The model's DTensor parameters, and this rank's and the whole model's element counts."""
    parameters = list(model.parameters())
    return {
        "parameters": len(parameters),
        "dtensor_parameters": sum(isinstance(p, DTensor) for p in parameters),
        "sharded_on_dim0": all(p.placements == (Shard(0),) for p in parameters if isinstance(p, DTensor)),
        "local_elements": sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in parameters),
        "elements": sum(p.numel() for p in parameters),
    }


class WhatRan(TrainerCallback):
    """What the trainer (`.trainer`, set once it is made) trains with once it is prepared: at the start of training,
    before any forward (FSDP2's root module keeps its own parameters whole after a forward)."""

    trainer, record = None, {}

    def on_train_begin(self, args, state, control, **kwargs):
        trainer = self.trainer
        plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
        self.record = {
            "distributed_type": trainer.accelerator.distributed_type.value,
            "fsdp_version": getattr(plugin, "fsdp_version", None),
            "model_class": type(trainer.model_wrapped).__name__,
            "student": shares(trainer.model),
        }
        teacher = getattr(trainer, "teacher", None)
        if teacher is not None:
            self.record["teacher"] = shares(teacher.model)
            self.record["teacher_is_student"] = teacher.model is trainer.model


def probe():
    return StateLoggingCallback(sample_rate=1.0, probe_steps=1, probe_prompts=PROBES, probe_max_new_tokens=4)


def sft(name):
    args = SFTConfig(str(output_dir / name), max_steps=2, per_device_train_batch_size=2, **CPU)
    return args, lambda callbacks: StateLensSFTTrainer(
        model=student_path, args=args, train_dataset=sft_data, callbacks=callbacks
    )


def opd(name, signal, kind=None, peft=False, student=student_path, teacher=teacher_path):
    """An OPD run of 2 steps: a separate teacher with teacher states in the mix, unless `kind` makes the student its
    own teacher. `student`, `teacher`: paths or instances."""
    args = OnPolicyDistillConfig(
        output_dir=str(output_dir / name),
        max_steps=2,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=4,
        learning_rate=1e-3,
        signal=signal,
        teacher_model_kind=kind,
        state_source_mix={"learner": 0.5, "teacher": 0.5} if kind is None else {"learner": 1.0},
        **({"continuation_length": 2} if signal == "continuation" else {}),
        **CPU,
    )
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return args, lambda callbacks: OnPolicyDistillTrainer(
        model=student,
        teacher_model=None if kind else teacher,
        args=args,
        train_dataset=with_context if kind else prompts,
        peft_config=lora if peft else None,
        callbacks=callbacks,
    )


def train(args, build) -> dict:
    """Train with `build` (`args` set up; both as `opd` and `sft` return them): what ran and the numbers each logged step reported (timings left out), or the error every rank raised (a
    refusal, or a crash that every rank meets at the same point)."""
    torch.manual_seed(0)  # the LoRA adapter's initial weights (init_lora_weights=False draws them)
    what_ran = WhatRan()
    try:
        trainer = what_ran.trainer = build([what_ran, probe()])
        # before the preflight's forwards (a callback placed first): FSDP2's root keeps its parameters whole after one
        trainer.callback_handler.callbacks.remove(what_ran)
        trainer.callback_handler.callbacks.insert(0, what_ran)
        trainer.train()
    except (ValueError, RuntimeError, AssertionError) as error:
        return {"error": f"{type(error).__name__}: {error}"}
    history = trainer.state.log_history
    logged = [{k: v for k, v in e.items() if isinstance(v, (int, float)) and k not in TIMINGS} for e in history]
    return {**what_ran.record, "logged": [entry for entry in logged if "loss" in entry]}


def forecast_refusal(args, build) -> str:
    """ForgettingForecast measures whole weights: what it says where each process holds a shard."""
    trainer = build([])
    trainer.add_callback(ForgettingForecast(trainer))
    try:
        trainer.train()
    except ValueError as error:
        return str(error)
    return "trained"


CASES = {  # the `accelerate` launch runs those named on its command line
    "sft": sft,
    "reverse_kl": lambda name: opd(name, "reverse_kl"),
    "divergence": lambda name: opd(name, "divergence"),
    "continuation": lambda name: opd(name, "continuation"),
    "live": lambda name: opd(name, "divergence", "live"),
    "base": lambda name: opd(name, "reverse_kl", "base"),
    "lora_base": lambda name: opd(name, "reverse_kl", "base", peft=True),
    # An EMA teacher under FSDP2 is refused (review finding 16): the copy's plain tensors against the student's
    # DTensors, or for LoRA an average of the adapter parameters accelerate has since replaced with DTensors
    "ema": lambda name: opd(name, "reverse_kl", "ema"),
    "lora_ema": lambda name: opd(name, "divergence", "ema", peft=True),
}


def accelerate_cases(cases: list[str]) -> dict:
    report = {}
    for case in cases:
        args, build = CASES[case](f"{case}-fsdp2")
        fsdp2(args)
        report[f"{case}-fsdp2"] = train(args, build)
        if "error" not in report[f"{case}-fsdp2"]:  # a refusal has no DDP numbers to match
            report[f"{case}-ddp"] = train(*CASES[case](f"{case}-ddp"))
    if "sft" in cases:
        args, build = sft("forecast")
        fsdp2(args)
        report["forecast"] = forecast_refusal(args, build)
    return report


def sharded_cases() -> dict:
    report = {}
    # reverse_kl with the teacher sharded at load too, divergence with it whole (by path)
    teacher = at_load(teacher_path)
    report["reverse_kl-fsdp2"] = train(
        *opd("reverse_kl-fsdp2", "reverse_kl", student=at_load(student_path), teacher=teacher)
    )
    report["reverse_kl-ddp"] = train(*opd("reverse_kl-ddp", "reverse_kl"))
    report["divergence-fsdp2"] = train(*opd("divergence-fsdp2", "divergence", student=at_load(student_path)))
    report["divergence-ddp"] = train(*opd("divergence-ddp", "divergence"))
    # A LoRA student on a sharded base: its adapter is plain tensors, kept equal on every rank by the Trainer
    report["lora_ema-fsdp2"] = train(*opd("lora_ema-fsdp2", "divergence", "ema", True, at_load(student_path)))
    report["lora_ema-ddp"] = train(*opd("lora_ema-ddp", "divergence", "ema", True))
    # The self teacher's copies of a sharded full-weight student
    for kind in ("base", "ema"):
        report[f"{kind}-fsdp2"] = train(*opd(f"{kind}-fsdp2", "reverse_kl", kind, student=at_load(student_path)))
    report["forecast"] = forecast_refusal(*opd("forecast", "reverse_kl", student=at_load(student_path)))
    return report


def pieces(trainer) -> dict:
    """The package's pieces on models sharded by hand, against the unsharded models: each rank gives the same inputs,
    so FSDP2's gradient (the mean over ranks) is the one-process gradient."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, 1000, (2, 9), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :2] = 0  # a left-padded row
    completion = input_ids[:, -4:]
    reference = AutoModelForCausalLM.from_pretrained(student_path).train()
    logps = reference(input_ids=input_ids, attention_mask=attention_mask).logits[:, -5:-1].log_softmax(-1)
    expected_logps = logps.gather(-1, completion[..., None])[..., 0]
    expected_entropy = -(logps.exp() * logps).sum(-1)
    expected_logps.sum().backward()
    expected_grads = {name: p.grad.clone() for name, p in reference.named_parameters()}
    reference.zero_grad()

    def grad_diff(model):
        grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
        assert grads.keys() == expected_grads.keys()
        return max((grads[name] - expected_grads[name]).abs().max().item() for name in grads)

    report = {}
    # The trainer's log-prob path: TRL's while the head is a DTensor (at rest), the package's once a forward (here
    # one without gradient, as GRPO's generation) has left the root's parameters whole
    package_calls = []
    package_path = trl_statelens.opd.loss._completion_logps_and_entropies
    trl_statelens.opd.loss._completion_logps_and_entropies = lambda *a: package_calls.append(1) or package_path(*a)
    student = by_hand(student_path, training=True)
    for branch in ("head_at_rest", "after_forward"):
        if branch == "after_forward":
            with torch.no_grad():
                student(input_ids=input_ids, attention_mask=attention_mask)
        head = student.get_output_embeddings().weight
        package_calls.clear()
        logps, entropy, _ = trainer._get_per_token_logps_and_entropies(
            student, input_ids, attention_mask, 4, compute_entropy=True
        )
        logps.sum().backward()
        report[branch] = {
            "head_is_dtensor": isinstance(head, DTensor),
            "package_path": bool(package_calls),
            "logps_diff": (logps - expected_logps).abs().max().item(),
            "entropy_diff": (entropy - expected_entropy).abs().max().item(),
            "grad_diff": grad_diff(student),
        }
        student.zero_grad()
    trl_statelens.opd.loss._completion_logps_and_entropies = package_path

    # A served teacher's top-k divergence, inside the student's forward as the trainer runs it
    top_ids = torch.randint(0, 1000, (2, 4, 3), generator=generator)
    top_logps = torch.rand(2, 4, 3, generator=generator).log() - 2.0
    loss_mask = attention_mask[:, -4:].float()

    def topk_loss(model):
        hidden = _completion_hidden_states(model, input_ids, attention_mask, 4)
        return topk_tail_divergence(model, hidden, top_ids, top_logps, loss_mask, 0.5, 8.0)

    expected = topk_loss(reference)
    expected.backward()
    expected_grads = {name: p.grad.clone() for name, p in reference.named_parameters()}
    student = by_hand(student_path, training=True)
    loss = trainer._forward_redirection(student, student, topk_loss, student)
    loss.backward()
    report["topk_divergence"] = {
        "loss": expected.item(),
        "loss_diff": (loss - expected).abs().item(),
        "grad_max": max(grad.abs().max().item() for grad in expected_grads.values()),
        "grad_diff": grad_diff(student),
    }

    # An in-process teacher sharded by hand: prepared as it is (no copy gathered whole), scoring and computing the
    # divergence with its head a DTensor at rest, as the whole teacher does
    whole = InProcessTeacher(trainer, AutoModelForCausalLM.from_pretrained(teacher_path))
    sharded = InProcessTeacher(trainer, by_hand(teacher_path))
    prepared = {**shares(sharded.model), "model_class": type(sharded.model).__name__}
    head = sharded.model.get_output_embeddings().weight
    batch = {
        "prompt_ids": input_ids[:, :5],
        "prompt_mask": attention_mask[:, :5],
        "completion_ids": completion,
        "completion_mask": attention_mask[:, 5:],
    }
    hidden = torch.randn(2, 4, reference.config.hidden_size, generator=generator)
    loss, teacher_logps, *_ = sharded.divergence_loss(reference, hidden, batch, loss_mask, 8.0, 0.5, 1.0)
    expected, expected_teacher_logps, *_ = whole.divergence_loss(reference, hidden, batch, loss_mask, 8.0, 0.5, 1.0)
    rows = ([[5, 6, 7], [8, 9]], [[10, 11, 12], [13]])
    scores = [row.scores.result()[row.index].logps for row in sharded.score(*rows)]
    expected_scores = [row.scores.result()[row.index].logps for row in whole.score(*rows)]
    report["teacher"] = {
        **prepared,
        "head_was_dtensor": isinstance(head, DTensor),
        "divergence_diff": (loss - expected).abs().item(),
        "teacher_logps_diff": (teacher_logps - expected_teacher_logps).abs().max().item(),
        "score_diff": max((a - b).abs().max().item() for a, b in zip(scores, expected_scores, strict=True)),
    }
    return report


if mode == "accelerate":
    report = accelerate_cases(sys.argv[5].split(","))
else:
    report = sharded_cases()
    args, build = opd("pieces", "divergence")
    report["pieces"] = pieces(build([]))
rank = torch.distributed.get_rank()
(output_dir / f"rank{rank}.json").write_text(json.dumps(report, indent=1))
torch.distributed.destroy_process_group()  # before exit: a gloo thread alive at shutdown can abort the process
