"""bench/gpu_smoke.py end to end in its `--tiny` CPU mode: the JSON it writes and the checks it makes."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
import gpu_smoke  # noqa: E402

OPD_ARMS = ("distill", "reverse_kl", "continuation", "divergence")


@pytest.mark.slow
def test_tiny_run_writes_equal_losses_forwards_and_opd_timings(tmp_path):
    out = tmp_path / "smoke" / "gpu_smoke.json"
    returned = gpu_smoke.main([str(out), "--tiny"])
    results = json.loads(out.read_text())
    assert results == json.loads(json.dumps(returned))
    size = gpu_smoke.SIZES["tiny"]
    generated = size["completion_tokens"]  # every rollout runs to full length (min_new_tokens)

    setup = results["setup"]
    assert setup["mode"] == "tiny" and setup["dtype"] == "float32"
    assert setup["teacher_parameters"] > setup["student_parameters"] > 0
    assert setup["vocab_size"] == 1024 and setup["trl"].startswith("1.16")

    # Stock vs StateLens: one step each, the same logged numbers and the same forward calls
    for kind, forwards in (("sft", 1), ("grpo", generated + 1)):
        run = results[kind]
        assert run["equal_loss"] is True
        assert run["extra_forwards_per_step"] == [0]
        assert run["stock"]["logs"] == run["statelens"]["logs"]
        assert run["stock"]["forwards_per_step"] == run["statelens"]["forwards_per_step"] == [{"student": forwards}]
        assert math.isfinite(run["stock"]["logs"][0]["loss"]) and run["stock"]["logs"][0]["grad_norm"] > 0
        assert set(run["max_relative_difference"]) >= {"loss", "grad_norm", "entropy"}
    assert "reward" in results["grpo"]["max_relative_difference"]

    # OPD vs DistillationTrainer(beta=1): one measured step after a warm-up, with forwards as the trainers promise
    opd = results["opd"]
    teacher_forwards = {
        "distill": 1,
        "reverse_kl": 1,
        "divergence": 1,
        "continuation": size["continuation_tokens"] + 1,
    }
    for arm in OPD_ARMS:
        run = opd[arm]
        assert len(run["step_seconds"]) == 1 and run["median_step_seconds"] > 0
        assert run["completion_tokens_per_second"] == pytest.approx(
            size["rollouts"] * generated / run["median_step_seconds"]
        )
        assert run["peak_memory_mb"] > 0
        assert run["forwards_per_step"] == [{"student": generated + 1, "teacher": teacher_forwards[arm]}]
        assert len(run["logs"]) == 2 and all(math.isfinite(log["loss"]) for log in run["logs"])
    for arm in OPD_ARMS[1:]:
        ratios = opd["ratios_to_distill"][arm]
        assert ratios["step_time"] == pytest.approx(
            opd[arm]["median_step_seconds"] / opd["distill"]["median_step_seconds"]
        )
        assert ratios["peak_memory"] > 0 and ratios["tokens_per_second"] > 0

    assert results["checks"] == {
        "sft_equal_loss": True,
        "sft_no_extra_forwards": True,
        "grpo_equal_loss": True,
        "grpo_no_extra_forwards": True,
        "opd_finite_losses": True,
    }
    assert results["ok"] is True and results["wall_seconds"] > 0


def test_compare_flags_a_loss_difference_and_extra_forwards():
    stock = {"logs": [{"loss": 2.0, "grad_norm": 1.0}], "forwards_per_step": [{"student": 9}]}
    lens = {"logs": [{"loss": 2.001, "grad_norm": 1.0}], "forwards_per_step": [{"student": 10}]}
    verdict = gpu_smoke.compare(stock, lens, ("loss", "grad_norm"), rtol=1e-6)
    assert verdict["equal_loss"] is False
    assert verdict["max_relative_difference"] == {"loss": pytest.approx(5e-4), "grad_norm": 0.0}
    assert verdict["extra_forwards_per_step"] == [1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown where no GPU is visible")
def test_without_a_gpu_it_asks_for_tiny(tmp_path, capsys):
    with pytest.raises(SystemExit):
        gpu_smoke.main([str(tmp_path / "out.json")])
    assert "--tiny" in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()


def test_fsdp2_config_is_an_fsdp2_launch_config():
    """recipes/accelerate/fsdp2.yaml, which the smoke check's FSDP2 case launches with: accelerate reads it as FSDP
    version 2, and knows every `fsdp_config` key (it would set an unknown one silently and ignore it)."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import launch_command_parser

    assert gpu_smoke.FSDP2_CONFIG.name == "fsdp2.yaml" and gpu_smoke.FSDP2_CONFIG.is_file()
    config = load_config_from_file(str(gpu_smoke.FSDP2_CONFIG))
    assert config.distributed_type == "FSDP" and config.fsdp_config["fsdp_version"] == 2
    assert config.fsdp_config["fsdp_state_dict_type"] == "FULL_STATE_DICT"  # the recipes save a full model
    known = vars(launch_command_parser().parse_args(["script.py"]))
    assert set(config.fsdp_config) <= set(known)


def fsdp2_run(distributed_type="FSDP", fsdp_version=2, dtensors=24, losses=(0.5,), ledger=(1,)):
    return {"distributed_type": distributed_type, "fsdp_version": fsdp_version, "num_processes": 2,
            "parameters": 24, "dtensor_parameters": dtensors, "global_step": 1, "losses": list(losses),
            "ledger_steps": list(ledger)}  # fmt: skip


def test_fsdp2_checks_pass_a_sharded_run_and_fail_fallbacks():
    ranks = [{"process_index": i, **{kind: fsdp2_run() for kind in gpu_smoke.FSDP2_KINDS}} for i in range(2)]
    assert all(gpu_smoke.fsdp2_checks(ranks, 2).values())
    assert not gpu_smoke.fsdp2_checks(ranks[:1], 2)["fsdp2_all_ranks"]  # a rank wrote nothing
    for fallback in (fsdp2_run("MULTI_CPU", None, 0), fsdp2_run(dtensors=23), fsdp2_run(fsdp_version=1)):
        ranks[1]["grpo"] = fallback
        assert not gpu_smoke.fsdp2_checks(ranks, 2)["fsdp2_sharded"]
    ranks[1]["grpo"] = fsdp2_run(losses=(float("nan"),))
    assert not gpu_smoke.fsdp2_checks(ranks, 2)["fsdp2_trained"]
    ranks[0]["opd"] = fsdp2_run(ledger=())
    assert not gpu_smoke.fsdp2_checks(ranks, 2)["fsdp2_ledger"]


@pytest.mark.slow
@pytest.mark.multiproc
def test_fsdp2_case_runs_every_trainer_and_fails_on_the_cpu_fallback(tmp_path):
    """The FSDP2 case as a GPU machine runs it, on 2 CPU processes: accelerate 1.15 selects no FSDP on a CPU (DDP over
    gloo instead), so every trainer runs a step and writes its ledger, and `fsdp2_sharded` says it was not FSDP2."""
    out = tmp_path / "fsdp2.json"
    results = gpu_smoke.main([str(out), "--tiny", "--fsdp2-only"])
    fsdp2 = results["fsdp2"]
    assert fsdp2["returncode"] == 0, fsdp2["stderr_tail"]
    assert results["checks"] == {
        "fsdp2_exit_ok": True,
        "fsdp2_all_ranks": True,
        "fsdp2_sharded": False,
        "fsdp2_trained": True,
        "fsdp2_ledger": True,
    }
    assert results["ok"] is False and json.loads(out.read_text())["checks"] == results["checks"]
    for rank in fsdp2["ranks"]:
        for kind in gpu_smoke.FSDP2_KINDS:
            run = rank[kind]
            assert (run["distributed_type"], run["fsdp_version"], run["model_class"]) == (
                "MULTI_CPU", None, "DistributedDataParallel"
            )  # fmt: skip
            assert run["num_processes"] == 2 and run["dtensor_parameters"] == 0 < run["parameters"]
            assert run["global_step"] == 1 and all(map(math.isfinite, run["losses"]))
        assert rank["opd"]["teacher_class"] == "Qwen3ForCausalLM"
    assert [rank["opd"]["ledger_steps"] for rank in fsdp2["ranks"]] == [[1], None]  # the main process writes it
