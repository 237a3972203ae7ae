"""FSDP2 (torch's `fully_shard`) on 2 CPU processes over gloo (`tests/scripts/fsdp2_two_ranks.py`).

Two ways a student is sharded, each case checked against the same run under DDP (same seed, data and steps; the
DDP run has whole weights on each process, so it is the unsharded computation):

- accelerate's FSDP2 plugin, launched with the GPU recipe `recipes/accelerate/fsdp2.yaml`. accelerate selects FSDP
  only for GPU-like process types, so the script names the CPU process type GPU-like before each trainer makes its
  Accelerator (one line; see the script): from there on accelerate's own FSDP2 path runs, as on GPUs;
- a model sharded before it reaches the trainer, at load by `from_pretrained(distributed_config=...)` (no accelerate
  plugin: the Trainer wraps it in nothing), and by hand with `fully_shard` for the package's pieces.

What ran is asserted first (FSDP2 and not a DDP fallback: every parameter of the student a DTensor sharded on dim 0
when training began, each rank holding its part of the elements), then the numbers: loss, grad norm, the teacher
metrics, the state records and the probe's drift of every logged step equal to DDP's.
"""

import json
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from cpu_settings import CPU
from launching import free_port, launch

from trl_statelens import OnPolicyDistillConfig, OnPolicyDistillTrainer

SCRIPT = Path(__file__).parent / "scripts" / "fsdp2_two_ranks.py"
FSDP2_CONFIG = Path(__file__).parents[1] / "recipes" / "accelerate" / "fsdp2.yaml"


def launched(test):
    """A test that launches 2 processes (tens of seconds)."""
    return pytest.mark.multiproc(pytest.mark.slow(test))


def two_ranks(launcher: list[str], *args, timeout: int) -> list[dict]:
    """Run the script on 2 processes with `launcher` and return each rank's report."""
    command = [*launcher, str(SCRIPT), *map(str, args)]
    output_dir = Path(args[3])
    launch(command, {"TOKENIZERS_PARALLELISM": "false"}, timeout=timeout, outputs=output_dir)
    return [json.loads((output_dir / f"rank{i}.json").read_text()) for i in range(2)]


def accelerate_fsdp2(tmp_path, student_path, teacher_path, cases: str) -> list[dict]:
    accelerate = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file", str(FSDP2_CONFIG),
                  "--num_processes", "2", "--main_process_port", str(free_port())]  # fmt: skip
    return two_ranks(accelerate, "accelerate", student_path, teacher_path, tmp_path, cases, timeout=360)


def assert_sharded(ranks, case, model="student"):
    """Every parameter a DTensor sharded on dim 0, each rank holding a part and the two parts the whole."""
    shares = [rank[case][model] for rank in ranks]
    assert shares[0]["dtensor_parameters"] == shares[0]["parameters"] > 0 and shares[0]["sharded_on_dim0"]
    assert all(share["local_elements"] < share["elements"] for share in shares)
    assert sum(share["local_elements"] for share in shares) == shares[0]["elements"]


def assert_whole(ranks, case, model):
    for rank in ranks:
        share = rank[case][model]
        assert share["dtensor_parameters"] == 0 and share["local_elements"] == share["elements"]


def assert_same_numbers(run, reference):
    """The two runs logged the same numbers at every step (FSDP2 reduces gradients in another order: 1e-5)."""
    assert len(run["logged"]) == len(reference["logged"]) == 2
    for step, expected in zip(run["logged"], reference["logged"]):
        assert step.keys() == expected.keys()
        assert {"loss", "grad_norm", "statelens/supervised_tokens", "statelens/drift/base_kl"} <= step.keys()
        for name, value in expected.items():
            assert step[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name


def assert_ddp(ranks, case):
    run = ranks[0][f"{case}-ddp"]
    assert (run["distributed_type"], run["model_class"]) == ("MULTI_CPU", "DistributedDataParallel")


@launched
def test_accelerate_fsdp2_trains_sft_and_opd_as_ddp(tmp_path, student_path, teacher_path):
    """The GPU recipe's FSDP2 on CPU: SFT, and OPD with a separate teacher (each signal, teacher states in the mix),
    shard the student and log DDP's numbers; the in-process teacher is prepared whole on each process,
    as TRL's DistillationTrainer prepares its own; ForgettingForecast refuses."""
    ranks = accelerate_fsdp2(tmp_path, student_path, teacher_path, "sft,reverse_kl,divergence,continuation")
    for case in ("sft", "reverse_kl", "divergence", "continuation"):
        run = ranks[0][f"{case}-fsdp2"]
        assert (run["distributed_type"], run["fsdp_version"], run["model_class"]) == (
            "FSDP",
            2,
            "FSDPQwen3ForCausalLM",
        )
        assert_sharded(ranks, f"{case}-fsdp2")
        assert_ddp(ranks, case)
        assert_same_numbers(run, ranks[0][f"{case}-ddp"])
        if case != "sft":
            assert_whole(ranks, f"{case}-fsdp2", "teacher")
            assert run["logged"][0]["teacher_kl/sampled"] != 0.0
    assert all("ForgettingForecast does not support FSDP" in rank["forecast"] for rank in ranks)


@pytest.fixture(scope="module")
def self_teacher_runs(tmp_path_factory, student_path, teacher_path):
    cases = "live,base,lora_base,ema,lora_ema"
    return accelerate_fsdp2(tmp_path_factory.mktemp("fsdp2"), student_path, teacher_path, cases)


@launched
def test_accelerate_fsdp2_self_teacher_live_and_base(self_teacher_runs):
    """Under accelerate's FSDP2 the live teacher is the sharded student itself; a full-weight student's base teacher is
    a whole copy made before accelerate shards the student; a LoRA student's is its adapter disabled. Each logs
    DDP's numbers."""
    ranks = self_teacher_runs
    for case in ("live", "base", "lora_base"):
        run = ranks[0][f"{case}-fsdp2"]
        assert (run["distributed_type"], run["fsdp_version"]) == ("FSDP", 2)
        assert_sharded(ranks, f"{case}-fsdp2")
        assert_ddp(ranks, case)
        assert_same_numbers(run, ranks[0][f"{case}-ddp"])
    assert ranks[0]["live-fsdp2"]["teacher_is_student"] and ranks[0]["lora_base-fsdp2"]["teacher_is_student"]
    assert not ranks[0]["base-fsdp2"]["teacher_is_student"]
    assert_whole(ranks, "base-fsdp2", "teacher")


@launched
def test_accelerate_fsdp2_ema_teacher_is_refused(self_teacher_runs):
    """An EMA teacher under accelerate's FSDP2 is refused on every rank before training, a full-weight student's (its
    copy's average crashed at the end of step 1 against the student's DTensors) and a LoRA student's (its average
    was of adapter tensors accelerate then replaced: it taught as the live student, silently)."""
    for case in ("ema", "lora_ema"):
        for rank in self_teacher_runs:
            error = rank[f"{case}-fsdp2"]["error"]
            assert error.startswith("ValueError: teacher_model_kind='ema' under FSDP is not supported"), error


@launched
def test_student_sharded_before_the_trainer(tmp_path, student_path, teacher_path):
    """A student sharded at load (`from_pretrained(distributed_config=...)`): the Trainer wraps it in nothing and
    OPD logs DDP's numbers, with a teacher sharded at load too (prepared as it is, each rank its part) or whole, and
    with a LoRA student's EMA teacher (its adapter averaged); the self teacher's copies are refused with the reason
    (FSDP2 modules cannot be deep-copied: a bare AssertionError before), and so is ForgettingForecast. Then the pieces
    on models sharded by hand, equal to the unsharded computation."""
    torchrun = [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", "2", "--standalone"]
    ranks = two_ranks(torchrun, "sharded", student_path, teacher_path, tmp_path, timeout=360)
    for case in ("reverse_kl", "divergence", "lora_ema"):
        run = ranks[0][f"{case}-fsdp2"]
        assert run["distributed_type"] == "MULTI_CPU" and run["fsdp_version"] is None  # no accelerate plugin...
        assert run["model_class"] in ("FSDPQwen3ForCausalLM", "PeftModel")  # ...and no DDP around the model
        assert_ddp(ranks, case)
        assert_same_numbers(run, ranks[0][f"{case}-ddp"])
    assert_sharded(ranks, "reverse_kl-fsdp2")
    assert_sharded(ranks, "reverse_kl-fsdp2", "teacher")
    assert_sharded(ranks, "divergence-fsdp2")
    assert_whole(ranks, "divergence-fsdp2", "teacher")
    adapter = ranks[0]["lora_ema-fsdp2"]["student"]  # the base sharded, the adapter plain on every rank
    assert 0 < adapter["dtensor_parameters"] < adapter["parameters"]
    for rank in ranks:
        for kind in ("base", "ema"):
            error = rank[f"{kind}-fsdp2"]["error"]
            assert error.startswith(f"ValueError: teacher_model_kind={kind!r} with a student already sharded by FSDP2")
            assert "cannot be copied" in error and "teacher_model_kind='live'" in error and "LoRA" in error
        assert "ForgettingForecast does not support FSDP" in rank["forecast"]

    for rank in ranks:
        pieces = rank["pieces"]
        # The trainer's log-prob path, both branches: TRL's on a DTensor head, the package's once the root holds it
        # whole; log-probs, entropies and the gradient of their sum (FSDP2's, gathered) as the unsharded model's
        assert (pieces["head_at_rest"]["head_is_dtensor"], pieces["head_at_rest"]["package_path"]) == (True, False)
        assert (pieces["after_forward"]["head_is_dtensor"], pieces["after_forward"]["package_path"]) == (False, True)
        for branch in ("head_at_rest", "after_forward"):
            assert pieces[branch]["logps_diff"] < 1e-5 and pieces[branch]["entropy_diff"] < 1e-5
            assert pieces[branch]["grad_diff"] < 1e-5
        topk = pieces["topk_divergence"]  # a served teacher's top-k divergence, in the student's forward
        assert topk["loss"] > 0 and topk["grad_max"] > 0
        assert topk["loss_diff"] < 1e-6 and topk["grad_diff"] < 1e-6
        teacher = pieces["teacher"]  # an in-process teacher sharded by hand: prepared as it is, not gathered
        assert teacher["model_class"] == "FSDPQwen3ForCausalLM" and teacher["head_was_dtensor"]
        assert teacher["dtensor_parameters"] == teacher["parameters"] and teacher["sharded_on_dim0"]
        assert teacher["local_elements"] < teacher["elements"]
        assert teacher["divergence_diff"] < 1e-6 and teacher["teacher_logps_diff"] < 1e-6
        assert teacher["score_diff"] < 1e-6


@pytest.mark.parametrize("teacher", ["same_tokenizer", "other_tokenizer", "two_teachers", "base_copy"])
def test_teachers_sit_on_the_accelerators_device_under_fsdp2(
    tmp_path, student_path, teacher_path, other_teacher_path, math_dataset, teacher
):
    """Under accelerate's FSDP every in-process teacher is set up on the accelerator's device.

    The cause of the failed GPU run (BENCHMARKS.md section 7: an embedding with its weight on the CPU called with its
    input on `cuda:0`): a launched process loads the teacher on the CPU (its `PartialState` says `MULTI_GPU`, so
    `load_teacher` passes `device_map=None`, as TRL does; a "base" self teacher is a copy of the student, which is
    on the CPU until `train()` shards it), and `prepare_teacher_model` then called `accelerator.prepare_model(model,
    evaluation_mode=True)`, which under `DistributedType.FSDP` does not move a model to the device (its
    `device_placement` defaults to False there, placement being left to the sharding, which a model prepared for
    evaluation never gets). `train()` moved the sharded student and so the rollouts to `cuda:0`; the teacher's first
    forward on them met its embedding on the CPU. TRL's own `DistillationTrainer` prepares its teacher the same way.

    One CPU process stands in for the GPU run: the accelerator reports FSDP and the device `meta`, so a teacher left
    where it was loaded or copied sits on the CPU, not on `meta`. The student is placed later, by `train()`'s
    sharding."""
    teachers = {
        "same_tokenizer": str(teacher_path),
        "other_tokenizer": str(other_teacher_path),
        "two_teachers": {"same": str(teacher_path), "other": str(other_teacher_path)},
        "base_copy": None,
    }[teacher]
    config = dict(teacher_model_kind="base") if teacher == "base_copy" else {}
    data = math_dataset.add_column("privileged_context", math_dataset["completion"])
    as_fsdp = mock.patch.object(Accelerator, "distributed_type", new_callable=mock.PropertyMock)
    on_meta = mock.patch.object(Accelerator, "device", new_callable=mock.PropertyMock)
    with as_fsdp as distributed_type, on_meta as device:
        distributed_type.return_value, device.return_value = DistributedType.FSDP, torch.device("meta")
        trainer = OnPolicyDistillTrainer(
            model=str(student_path),
            teacher_model=teachers,
            args=OnPolicyDistillConfig(
                str(tmp_path),
                max_steps=1,
                per_device_train_batch_size=8,
                num_generations=2,
                max_completion_length=8,
                **config,
                **CPU,
            ),
            train_dataset=data,
        )
        in_process = getattr(trainer.teacher, "teachers", {"teacher": trainer.teacher})
        assert len(in_process) == (2 if teacher == "two_teachers" else 1)
        for name, each in in_process.items():
            devices = {str(p.device) for p in trainer.accelerator.unwrap_model(each.model).parameters()}
            assert devices == {"meta"}, f"{name} on {devices}, not on the accelerator's device"
