"""Two processes (DDP over gloo on CPU, and DeepSpeed ZeRO): the ledger holds the states of both ranks, none lost,
none repeated; teachers make as many collective calls on every rank.

Each script ends with `trainer.end()` (or `accelerator.end_training()`), which destroys the process group. A rank that
exits without it can abort ("terminate called without an active exception", SIGABRT) when a gloo worker thread drops
the last reference to a collective's tensor while the interpreter is shutting down: the thread then needs the GIL,
and a thread that asks for it during finalization is ended with `pthread_exit`, which C++ turns into
`std::terminate`. 0 aborts in 58 runs of the DDP test without `end()` on a loaded 2-core machine; a rank aborts in 15
of 40 runs of `tests/scripts/gloo_exit_abort.py` (a collective that completes during shutdown) and in none of 30 with
the process group destroyed first. Under DeepSpeed gloo's groups outlive it: `tests/launching.py` says what a launch
forgives then, and why.
"""

import json
import sys
from pathlib import Path

import pytest
from launching import free_port, launch, run_ranks
from vllm_test_server import TestTeacherServer

SCRIPT = Path(__file__).parent / "scripts" / "statelens_two_ranks.py"


def launch_zero3(
    script: str, *args, outputs: Path, timeout: int, hang: str, stage: int = 3, mixed_precision: str = "no",
    launch_args: tuple[str, ...] = (),
) -> None:  # fmt: skip
    """`accelerate launch` two ZeRO-3 (or `stage`) ranks of `tests/scripts/<script>` with `args` (and `launch_args`
    for the launcher), writing into `outputs` (see `launching.launch`)."""
    accelerate = Path(sys.executable).parent / "accelerate"
    config = Path(__file__).parents[1] / "recipes" / "accelerate" / f"zero{stage}.yaml"
    command = [
        str(accelerate), "launch", "--config_file", str(config), "--num_processes", "2",
        "--mixed_precision", mixed_precision, "--main_process_port", str(free_port()), *launch_args,
        str(SCRIPT.parent / script), *map(str, args),
    ]  # fmt: skip
    launch(command, {"DS_ACCELERATOR": "cpu"}, timeout=timeout, hang=hang, outputs=outputs)


@pytest.mark.multiproc
@pytest.mark.slow
def test_two_ranks_record_every_supervised_token(tmp_path, student_path):
    accelerate = Path(sys.executable).parent / "accelerate"
    command = [
        str(accelerate), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
        str(SCRIPT), str(student_path), str(tmp_path),
    ]  # fmt: skip
    launch(command, {"TOKENIZERS_PARALLELISM": "false"}, timeout=300, outputs=tmp_path)

    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    for rank in ranks:  # what actually ran: two processes, distributed data parallel over gloo
        assert rank["world_size"] == 2
        assert rank["distributed_type"] in ("MULTI_CPU", "MULTI_GPU") and rank["backend"] == "gloo"

    def read(path):
        return [json.loads(line) for line in path.read_text().splitlines()]

    # SFT with gradient accumulation 2: a step is two micro-batches on each rank
    sft_steps = read(tmp_path / "sft" / "statelens" / "steps.jsonl")
    assert [line["step"] for line in sft_steps] == [1, 2, 3]
    per_rank = [rank["sft_tokens_per_micro_batch"] for rank in ranks]
    expected = [sum(tokens[2 * step] + tokens[2 * step + 1] for tokens in per_rank) for step in range(3)]
    assert [line["supervised_tokens"] for line in sft_steps] == expected
    assert per_rank[0] != per_rank[1]  # the ranks really saw different data
    sft_states = read(tmp_path / "sft" / "statelens" / "states.jsonl")
    assert {state["rank"] for state in sft_states} == {0, 1}
    assert sum(state["num_supervised"] for state in sft_states) == sum(expected)

    grpo_steps = read(tmp_path / "grpo" / "statelens" / "steps.jsonl")
    expected = [sum(rank["grpo_tokens_per_step"][step] for rank in ranks) for step in range(2)]
    assert [line["supervised_tokens"] for line in grpo_steps] == expected
    grpo_states = read(tmp_path / "grpo" / "statelens" / "states.jsonl")
    assert {state["rank"] for state in grpo_states} == {0, 1}
    # every prompt's group of rollouts, from both ranks, once: rank 0's rollouts come first in the gathered batch
    groups = read(tmp_path / "grpo" / "statelens" / "groups.jsonl")
    rollouts = [
        r for batch in zip(*(rank["grpo_rollouts"] for rank in ranks)) for rank_part in batch for r in rank_part
    ]
    assert len(rollouts) == 2 * 2 * 2  # 2 steps of 2 ranks x 2 rollouts
    assert [g["step"] for g in groups] == [1, 1, 2, 2]
    assert [(g["solution_steps"], r) for g in groups for r in g["rewards"]] == [tuple(r) for r in rollouts]

    opd_steps = read(tmp_path / "opd" / "statelens" / "steps.jsonl")
    expected = [sum(rank["opd_tokens_per_step"][step] for rank in ranks) for step in range(2)]
    assert [line["supervised_tokens"] for line in opd_steps] == expected
    opd_states = read(tmp_path / "opd" / "statelens" / "states.jsonl")
    assert {state["rank"] for state in opd_states} == {0, 1}
    assert sum(state["num_supervised"] for state in opd_states) == sum(expected)


@pytest.mark.multiproc
@pytest.mark.slow
def test_zero3_opd_with_teacher_states_when_a_rank_draws_none(tmp_path, student_path):
    """Every rank takes part in teacher generation (a ZeRO-3 collective) even on batches where it drew no teacher
    row: the run finishes instead of waiting forever."""
    launch_zero3(
        "opd_zero3_teacher_mix.py",
        student_path,
        tmp_path,
        outputs=tmp_path,
        timeout=480,
        hang="ZeRO-3 ranks deadlocked (no exit in 480 s; a loaded 2-core machine once took 246 s)",
    )
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    for rank in ranks:
        assert (rank["world_size"], rank["zero_stage"], rank["global_step"]) == (2, 3, 2)
        assert rank["teacher_engine"] == "DeepSpeedEngine"
    # the case under test happened: a generation batch where one rank had teacher rows and the other none
    assert any(min(pair) == 0 < max(pair) for pair in zip(ranks[0]["teacher_rows"], ranks[1]["teacher_rows"]))


@pytest.mark.multiproc
@pytest.mark.slow
def test_zero3_opd_with_two_teachers_when_the_ranks_draw_different_ones(tmp_path, student_path, teacher_path):
    """Two in-process teachers under ZeRO-3, each row routed by its `teacher_id`: on a step where one rank has only
    teacher a's rows and the other only teacher b's, each teacher's collectives (scoring, generation for teacher
    states, the divergence loss) are joined by the rank without its rows, and the run finishes."""
    launch_zero3(
        "opd_zero3_two_teachers.py",
        student_path,
        teacher_path,
        tmp_path,
        outputs=tmp_path,
        timeout=480,
        hang="ZeRO-3 ranks deadlocked with two teachers (no exit in 480 s)",
    )
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]

    def read(path):
        return [json.loads(line) for line in path.read_text().splitlines()]

    for signal_name in ("reverse_kl", "divergence"):
        runs = [rank[signal_name] for rank in ranks]
        for run in runs:  # what actually ran: two ZeRO-3 processes, both teachers ZeRO-3 engines, every step
            assert (run["world_size"], run["zero_stage"], run["global_step"]) == (2, 3, 3)
            assert run["teacher_engines"] == {"a": "DeepSpeedEngine", "b": "DeepSpeedEngine"}
        drawn = [[set(step) for step in run["row_teachers"]] for run in runs]
        # the case under test happened: a step where each rank had rows of one teacher only, not the same one
        assert any(len(r0) == len(r1) == 1 and r0 != r1 for r0, r1 in zip(*drawn))
        # each rank's ledger shows the teachers its rows named, step by step (sample_rate=1: every sequence)
        states = read(tmp_path / signal_name / "statelens" / "states.jsonl")
        for rank in range(2):
            for step, teachers in enumerate(drawn[rank], start=1):
                assert {s["teacher"] for s in states if s["rank"] == rank and s["step"] == step} == teachers
        # per-teacher state metrics of every step, equal to a count of the ledger's sequences
        for line in read(tmp_path / signal_name / "statelens" / "steps.jsonl"):
            mine = [s for s in states if s["step"] == line["step"]]
            for name in ("a", "b"):
                assert line[f"supervised_tokens/{name}"] == sum(
                    s["num_supervised"] for s in mine if s["teacher"] == name
                )
            assert line["supervised_tokens/a"] + line["supervised_tokens/b"] == line["supervised_tokens"]
            shares = line["source_frac/teacher/a"] + line["source_frac/teacher/b"]
            assert shares == pytest.approx(line["source_frac/teacher"])
        assert any(
            line["source_frac/teacher"] > 0 for line in read(tmp_path / signal_name / "statelens" / "steps.jsonl")
        )
        for name in ("a", "b"):  # the trainer's per-teacher KL, on the steps where its rows had learner states
            assert any(f"teacher_kl/sampled/{name}" in entry for entry in runs[0]["log_history"])


@pytest.mark.multiproc
@pytest.mark.slow
def test_zero3_teachers_with_rows_split_unevenly_across_ranks_run_as_many_forwards(
    tmp_path, student_path, teacher_path
):
    """Two in-process teachers under ZeRO-3 with gradient accumulation 2: one rank holds 3 of teacher a's rows and 1
    of b's, the other the reverse. Scored in chunks of 2 rows, each teacher has 2 chunks of its own on one rank and 1
    on the other; every chunk's forward gathers that teacher's shards from both ranks, so both run 2 (one on a
    stand-in) and the run finishes. (Before `collective.py` it waited forever at the first step.)"""
    launch_zero3(
        "opd_zero3_uneven_teachers.py",
        student_path,
        teacher_path,
        tmp_path,
        outputs=tmp_path,
        timeout=480,
        hang="ZeRO-3 ranks deadlocked with teachers split unevenly (no exit in 480 s)",
        launch_args=("--gradient_accumulation_steps", "2"),
    )
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    for rank in ranks:  # what actually ran: two ZeRO-3 processes, both teachers ZeRO-3 engines, every step
        assert (rank["world_size"], rank["zero_stage"], rank["global_step"]) == (2, 3, 2)
        assert (rank["gradient_accumulation_steps"], rank["steps_per_generation"]) == (2, 2)
        assert rank["teacher_engines"] == {"a": "DeepSpeedEngine", "b": "DeepSpeedEngine"}
    # the case under test: each generation batch, 3 rows of a teacher on one rank and 1 on the other
    assert ranks[0]["rows_per_teacher"] == [{"a": 3, "b": 1}] * 2
    assert ranks[1]["rows_per_teacher"] == [{"a": 1, "b": 3}] * 2
    # as many forwards of each teacher on both ranks: 2 chunks per generation batch
    assert ranks[0]["teacher_forwards"] == ranks[1]["teacher_forwards"] == {"a": 4, "b": 4}


@pytest.mark.multiproc
@pytest.mark.slow
def test_zero3_served_divergence_calls_the_output_layer_as_often_on_every_rank(tmp_path, student_path, teacher_path):
    """A served teacher's `divergence` under ZeRO-3, with `heads.POSITION_CHUNK` set to 2: the ranks supervise
    different numbers of positions (on the first step one rank none, its rows masked as truncated), and every call
    of the student's output layer gathers its shards from both ranks: both make as many calls (empty chunks where
    a rank has fewer positions) and the run finishes. (Before `collective.py` it waited forever at the first step.)"""
    with TestTeacherServer(teacher_path) as server:
        launch_zero3(
            "served_teacher_zero3_divergence.py",
            student_path,
            server.url,
            tmp_path,
            outputs=tmp_path,
            timeout=480,
            hang="ZeRO-3 ranks deadlocked in the served divergence (no exit in 480 s)",
        )
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    for rank in ranks:  # what actually ran: two ZeRO-3 processes, every step, chunks of 2 positions
        assert (rank["world_size"], rank["zero_stage"], rank["global_step"]) == (2, 3, 2)
        assert rank["student_engine"] == "DeepSpeedEngine" and rank["position_chunk"] == 2
    positions = [rank["supervised_positions"] for rank in ranks]
    # the case under test: on the first step rank 0 supervises nothing and rank 1 several chunks' worth; on the
    # second, both ranks several chunks, not as many
    assert positions[0][0] == 0 and positions[1][0] > 2
    assert 2 < positions[0][1] and -(-positions[0][1] // 2) != -(-positions[1][1] // 2)
    chunks = [[-(-n // 2) for n in steps] for steps in positions]
    # each step's loss calls the layer once per chunk of the rank with the most (at least once), on both ranks
    expected = [max(a, b, 1) for a, b in zip(*chunks)]
    assert ranks[0]["loss_head_calls"] == ranks[1]["loss_head_calls"] == expected


@pytest.mark.multiproc
@pytest.mark.slow
def test_another_runs_ledger_is_refused_on_every_rank(tmp_path, student_path):
    """The main process finds the ledger; every rank raises the same error, none is left waiting for the others."""
    ledger = tmp_path / "run" / "statelens"
    ledger.mkdir(parents=True)
    (ledger / "steps.jsonl").write_text('{"step": 1}\n')
    accelerate = Path(sys.executable).parent / "accelerate"
    command = [
        str(accelerate), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
        str(SCRIPT.parent / "ledger_refused_two_ranks.py"), str(student_path), str(tmp_path),
    ]  # fmt: skip
    stderr = run_ranks(command, {"TOKENIZERS_PARALLELISM": "false"}, 180, "a rank hung (no exit in 180 s)").stderr
    outcomes = [
        (tmp_path / f"rank{i}.txt").read_text() if (tmp_path / f"rank{i}.txt").exists() else None for i in (0, 1)
    ]
    assert all(o is not None and "holds another run's state ledger (steps.jsonl)" in o for o in outcomes), (
        outcomes,
        stderr[-3000:],
    )
    assert (ledger / "steps.jsonl").read_text() == '{"step": 1}\n'  # untouched


@pytest.mark.multiproc
@pytest.mark.slow
def test_zero3_self_teachers_train_with_and_without_a_copy(tmp_path, student_path):
    """A live self teacher under ZeRO-3 is the partitioned student (scoring through its parameter hooks, generating
    through its engine, a second forward inside its own for divergence): two steps per signal with teacher states in
    the mix, the same on both ranks; a LoRA student's base teacher (adapter disabled, no copy) with divergence. A
    full-weight student's base and EMA teachers are a copy loaded again from its path, a ZeRO-3 engine of their own:
    base reads the student's weights exactly (teacher_kl 0 with an empty context); the EMA follows its update rule on
    gathered weights, is checkpointed whole and resumed; a student given as an instance is refused for a copy, and so
    is a LoRA student's EMA."""
    launch_zero3(
        "opd_zero3_self_teacher.py",
        student_path,
        tmp_path,
        outputs=tmp_path,
        timeout=600,
        hang="ZeRO-3 ranks did not finish in 600 s",
    )
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    assert ranks[0] == ranks[1]  # metrics are gathered, weights compared whole: both ranks report the same
    assert (ranks[0]["world_size"], ranks[0]["zero_stage"]) == (2, 3)
    for signal_name in ("reverse_kl", "divergence", "continuation", "lora_base"):
        run = ranks[0][signal_name]
        assert run["global_step"] == 2 and len(run["teacher_kl"]) == 2
        assert run["teacher_kl"][0] != 0.0  # the privileged context changes what the teacher predicts
    for rank in ranks:
        base = rank["full_base"]
        assert base["global_step"] == 1 and base["teacher_engine"] == "DeepSpeedEngine"
        assert not base["teacher_is_student"]
        assert base["teacher_kl"] == [0.0]  # the copy is the student's weights, and reads the student's prompt
        ema = rank["ema"]
        assert ema["global_step"] == 1 and ema["resumed_global_step"] == 2
        assert ema["teacher_engine"] == "DeepSpeedEngine"
        assert ema["moved"] > 1e-6  # the step moved the average...
        assert ema["update_rule_diff"] < 1e-6  # ...to (1 - r) * initial + r * student, on every partition
        assert ema["saved_diff"] == 0.0  # the checkpoint holds the whole average
        assert ema["resumed_diff"] < 1e-6  # resumed from the saved average, not from the path's weights
        assert "Pass the student as a path" in rank["instance_base"]
        assert "'ema' with a PEFT student under DeepSpeed ZeRO-3" in rank["lora_ema"]


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_ema_self_teacher_averages_in_fp32_under_deepspeed(tmp_path, student_path, stage):
    """DeepSpeed with bf16 casts the student and the teacher's copy to bf16 after the average was made. ZeRO-2: a LoRA
    student's "ema" trains past step 1 (it crashed there: fp32 average, bf16 adapter) with its average still fp32 and
    following the rule exactly. ZeRO-2 and ZeRO-3: a full-weight student's "ema" keeps an fp32 average (each rank its
    own partitions under ZeRO-3) that follows the rule exactly from the bf16 student's weights, saved whole in fp32,
    with the bf16 teacher its cast, also after the step at which ZeRO-3 keeps small parameters gathered; under
    ZeRO-3 a resumed run continues the saved average exactly."""
    launch_zero3(
        "opd_bf16_ema.py", student_path, tmp_path, stage, outputs=tmp_path, stage=stage, mixed_precision="bf16", timeout=480,
        hang=f"ZeRO-{stage} ranks did not finish in 480 s",
    )  # fmt: skip
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    assert ranks[0] == ranks[1]
    report = ranks[0]
    assert (report["world_size"], report["zero_stage"], report["bf16"]) == (2, stage, True)
    if stage == 2:
        lora = report["lora_ema"]
        assert lora["global_step"] == 2
        assert lora["adapter_dtypes"] == ["torch.bfloat16"] and lora["average_dtypes"] == ["torch.float32"]
        assert lora["moved"] > 0 and lora["update_rule_diff"] == 0.0
    full = report["full_ema"]
    assert full["global_step"] == 2
    assert full["teacher_dtypes"] == ["torch.bfloat16"] and full["saved_dtypes"] == ["torch.float32"]
    assert full["rule_diffs"] == [0.0, 0.0]  # the fp32 average follows the rule, step after step
    assert full["teacher_cast_diff"] == 0.0  # the teacher computes with the average cast to bf16
    assert full["moved"] > 0 and full["bf16_moved"] > 0
    if stage == 3:
        assert full["resumed_global_step"] == 2 and full["resumed_rule_diff"] == 0.0
