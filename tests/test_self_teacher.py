"""The student as its own teacher behind a privileged prompt (`teacher_model_kind`, `SelfTeacher`)."""

import json
from types import SimpleNamespace

import pytest
import torch
from cpu_settings import CPU
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from trl_statelens import OnPolicyDistillConfig, OnPolicyDistillTrainer, StateLoggingCallback, collective
from trl_statelens.lens.compute import matmul_parameters
from trl_statelens.teachers import InProcessTeacher, SelfTeacher, resolve_rows


def opd_config(tmp_path, **kwargs):
    defaults = dict(
        output_dir=str(tmp_path),
        max_steps=1,
        per_device_train_batch_size=8,
        num_generations=2,
        max_completion_length=8,
        learning_rate=1e-3,
        teacher_model_kind="base",
    )
    defaults["preflight"] = (
        "off"  # these tests count training's own teacher calls and forwards; the preflight's are tested in test_preflight.py
    )
    return OnPolicyDistillConfig(**{**defaults, **CPU, **kwargs})


def with_context(dataset, contexts=None):
    """The dataset with a `privileged_context` column: `contexts` cycled over the rows, default each row's answer."""
    values = dataset["completion"] if contexts is None else [contexts[i % len(contexts)] for i in range(len(dataset))]
    return dataset.add_column("privileged_context", values)


def log_history(trainer, key):
    return [entry[key] for entry in trainer.state.log_history if key in entry]


# ----- a teacher shown nothing more is the student: nothing to learn -------------------------------------------
@pytest.mark.parametrize("signal", ["reverse_kl", "divergence"])
def test_base_teacher_with_empty_context_gives_zero_kl_and_zero_gradient(
    tmp_path, math_trained_path, math_dataset, signal
):
    trainer = OnPolicyDistillTrainer(
        model=str(math_trained_path),
        args=opd_config(tmp_path, signal=signal, teacher_prompt_template="{prompt}{privileged_context}"),
        train_dataset=with_context(math_dataset, [""]),
    )
    assert isinstance(trainer.teacher, SelfTeacher) and trainer.teacher.model is not trainer.model  # one copy
    trainer.train()
    assert log_history(trainer, "teacher_kl/sampled")[0] == 0.0
    assert log_history(trainer, "grad_norm")[0] == 0.0


# ----- positions line up across the two prompts' lengths --------------------------------------------------------
@pytest.mark.parametrize("signal", ["reverse_kl", "divergence"])
def test_teacher_logps_under_its_prompt_match_a_plain_forward(tmp_path, math_trained_path, math_dataset, signal):
    """Rows with privileged contexts of different lengths (so the teacher's prompts are left-padded differently from
    the student's and from each other): the teacher's log-prob of completion token j is a plain forward of
    [teacher prompt + completion] at that token, for the scores of reverse_kl and the divergence loss's alike."""
    contexts = ["", "Answer: 7", "The reference solution adds the apples, then the pears: 3 + 4 = 7."]
    template = "{prompt}\nHint: {privileged_context}"
    data = with_context(math_dataset, contexts)
    trainer = OnPolicyDistillTrainer(
        model=str(math_trained_path),
        args=opd_config(tmp_path, signal=signal, teacher_prompt_template=template),
        train_dataset=data,
        state_logging=False,
    )
    rows = [dict(row) for row in data.select(range(4)) for _ in range(2)]
    trainer.model.train()
    batch = trainer._generate_and_score_completions(rows)
    completion_ids, completion_mask = batch["completion_ids"], batch["completion_mask"]
    for row, ids in zip(rows, batch["teacher_prompt_ids"]):
        expected = trainer._tokenizer(
            template.format(prompt=row["prompt"], privileged_context=row["privileged_context"])
        )
        assert ids == expected["input_ids"]
    lengths = {len(ids) for ids in batch["teacher_prompt_ids"]}
    assert len(lengths) >= 3, lengths  # prompts of several lengths in one batch

    if signal == "reverse_kl":
        teacher_logps = resolve_rows(batch["teacher_scores"], completion_ids, completion_mask).logps
    else:
        assert batch["teacher_scores"] is None  # computed within the loss
        student = trainer.accelerator.unwrap_model(trainer.model)
        hidden = torch.zeros((*completion_ids.shape, student.config.hidden_size))
        teacher_logps = trainer.teacher.divergence_loss(
            student, hidden, batch, completion_mask.float(), 1.0, 1.0, trainer.temperature
        ).teacher_logps

    base = AutoModelForCausalLM.from_pretrained(math_trained_path).eval()
    assert_plain_forward_logps(base, batch, teacher_logps, trainer.temperature)


def assert_plain_forward_logps(base, batch, teacher_logps, temperature):
    """Each row's teacher log-prob of completion token j is a plain forward of `base` over [teacher prompt +
    completion] at that token."""
    completion_ids, completion_mask = batch["completion_ids"], batch["completion_mask"]
    for i, prompt in enumerate(batch["teacher_prompt_ids"]):
        completion = completion_ids[i][completion_mask[i].bool()]
        ids = torch.tensor(prompt + completion.tolist())[None]
        with torch.no_grad():
            logits = base(input_ids=ids).logits[0, len(prompt) - 1 : -1] / temperature
        direct = logits.log_softmax(-1).gather(-1, completion[:, None])[:, 0]
        torch.testing.assert_close(teacher_logps[i, : len(completion)], direct, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("peft", [False, True])
def test_a_shared_privileged_start_runs_once_and_scores_as_a_plain_forward(
    tmp_path, math_trained_path, math_dataset, peft
):
    """Worked examples as the privileged context, the same on every row and first in the teacher's prompt: a `base`
    teacher runs that shared start once for the whole run (a forward of it alone, once over two batches), and each
    completion token's log-prob is still a plain forward of [teacher prompt + completion] (for a PEFT student, of the
    base with the non-zero adapter disabled)."""
    from peft import LoraConfig

    context = " ".join(f"Example {i}: 3 + {i} = {3 + i}." for i in range(12))
    template = "{privileged_context}\nNow: {prompt}"
    data = with_context(math_dataset, [context])
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    trainer = OnPolicyDistillTrainer(
        model=str(math_trained_path),
        args=opd_config(tmp_path, teacher_prompt_template=template),
        train_dataset=data,
        peft_config=lora if peft else None,
        state_logging=False,
    )
    lengths = []
    model = trainer.accelerator.unwrap_model(trainer.teacher.model)

    def record(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None:
            lengths.append(ids.shape)

    model.register_forward_pre_hook(record, with_kwargs=True)
    rows = [dict(row) for row in data.select(range(4)) for _ in range(2)]
    trainer.model.train()
    base = AutoModelForCausalLM.from_pretrained(math_trained_path).eval()
    for _ in range(2):
        batch = trainer._generate_and_score_completions(rows)
        shared = trainer.teacher._shared_prefix_length(batch["teacher_prompt_ids"])
        assert shared >= 64 and len({len(p) for p in batch["teacher_prompt_ids"]}) > 1  # a shared start, then not
        teacher_logps = resolve_rows(batch["teacher_scores"], batch["completion_ids"], batch["completion_mask"]).logps
        assert_plain_forward_logps(base, batch, teacher_logps, trainer.temperature)
    assert lengths.count(torch.Size([1, shared])) == 1
    assert not any(shape[1] > shared for shape in lengths if shape[0] == 8)  # no full-prompt forward of the rows


def test_a_shared_privileged_start_counts_once_in_the_flops(tmp_path, math_trained_path, math_dataset):
    """The same worked examples before every row's prompt, run once for the run by the frozen `base` teacher (the
    same 4 prompts each step, so the same shared start): the teacher's FLOPs count that start each time its forward
    ran (once, at step 1) and each row's own tokens, not the start once per rollout. Counted by hand from each
    generation batch and the teacher's forwards of the start alone."""
    context = " ".join(f"Example {i}: 3 + {i} = {3 + i}." for i in range(12))
    trainer = OnPolicyDistillTrainer(
        model=str(math_trained_path),
        args=opd_config(tmp_path, max_steps=2, teacher_prompt_template="{privileged_context}\nNow: {prompt}"),
        train_dataset=with_context(math_dataset.select(range(4)), [context]),
        callbacks=[StateLoggingCallback(sample_rate=0.0)],
    )
    starts = []  # the lengths of the teacher's forwards of the shared start alone

    def record(module, args, kwargs):
        if args and kwargs.get("use_cache"):  # `model(start_ids, use_cache=True)`: the start alone
            starts.append(args[0].size(1))

    trainer.accelerator.unwrap_model(trainer.teacher.model).register_forward_pre_hook(record, with_kwargs=True)
    read_by_rows = []  # per step: the rows' teacher prompt and completion tokens, and the shared start's length
    generate_and_score = trainer._generate_and_score_completions

    def counted(inputs):
        output = generate_and_score(inputs)
        prompts = output["teacher_prompt_ids"]
        shared = trainer.teacher._shared_prefix_length(prompts)
        assert shared >= 64
        read_by_rows.append((sum(len(p) for p in prompts) + int(output["completion_mask"].sum()), shared))
        return output

    trainer._generate_and_score_completions = counted
    trainer.train()

    steps = [json.loads(line) for line in (tmp_path / "statelens" / "steps.jsonl").read_text().splitlines()]
    (shared,) = {shared for _, shared in read_by_rows}  # the same start on both steps
    assert starts == [shared]  # its forward ran once
    assert [line["teacher_prefix_run_tokens"] for line in steps] == [shared, 0]
    assert [line["teacher_prefix_shared_tokens"] for line in steps] == [8 * shared, 8 * shared]
    n = matmul_parameters(trainer.model)  # a self teacher's size
    for line, (rows, _), ran in zip(steps, read_by_rows, (1, 0)):
        assert line["flops/teacher_scoring"] == pytest.approx(2 * n * (rows - 8 * shared + ran * shared))


def test_conversational_prompt_fills_the_template_into_its_last_user_message(tmp_path, math_trained_path, world):
    """As TRL's SDFT: the system message stays, the last user message becomes the filled template (its text as
    `{prompt}`), and the whole is formatted with the chat template as the student's prompt is; a conversational
    privileged context reads as its messages' text."""
    from datasets import Dataset

    system = {"role": "system", "content": "Solve it."}
    problems = world.math("train", n=4)
    data = Dataset.from_list(
        [
            {
                "prompt": [system, {"role": "user", "content": row["question"]}],
                "privileged_context": [{"role": "assistant", "content": row["answer"]}],
            }
            for row in problems
        ]
    )
    trainer = OnPolicyDistillTrainer(
        model=str(math_trained_path), args=opd_config(tmp_path), train_dataset=data, state_logging=False
    )
    rows = [dict(row) for row in data for _ in range(2)]
    trainer.model.train()
    batch = trainer._generate_and_score_completions(rows)
    tokenizer = trainer._tokenizer
    for row, problem, teacher_ids, ids, mask in zip(
        rows, [p for p in problems for _ in range(2)], batch["teacher_prompt_ids"], batch["prompt_ids"],
        batch["prompt_mask"],
    ):  # fmt: skip
        filled = f"{problem['question']}\n\n{problem['answer']}"
        chat = dict(add_generation_prompt=True, tokenize=True, return_dict=True)
        expected = tokenizer.apply_chat_template([system, {"role": "user", "content": filled}], **chat)["input_ids"]
        assert teacher_ids == list(expected)
        assert ids[mask.bool()].tolist() == list(tokenizer.apply_chat_template(row["prompt"], **chat)["input_ids"])
    assert trainer.compute_loss(trainer.model, batch).isfinite()


def test_continuation_teacher_continues_the_prefix_after_its_own_prompt(tmp_path, math_trained_path, math_dataset):
    trainer = OnPolicyDistillTrainer(
        model=str(math_trained_path),
        args=opd_config(tmp_path, signal="continuation", continuation_length=4),
        train_dataset=with_context(math_dataset),
        state_logging=False,
    )
    asked = []
    generate = trainer.teacher.generate

    def spy(prompts, max_new_tokens, prefixes=None, teachers=None):
        asked.append(prompts)
        return generate(prompts, max_new_tokens, prefixes, teachers)

    trainer.teacher.generate = spy
    rows = [dict(row) for row in with_context(math_dataset).select(range(4)) for _ in range(2)]
    trainer.model.train()
    batch = trainer._generate_and_score_completions(rows)
    student_prompts = [p[m.bool()].tolist() for p, m in zip(batch["prompt_ids"], batch["prompt_mask"])]
    prompts = asked[-1]  # (the first call: the `teacher` state source's rollouts, none here)
    assert prompts == batch["teacher_prompt_ids"]  # every rollout was kept (none truncated at 8 tokens here)
    for teacher_prompt, student_prompt in zip(prompts, student_prompts):
        assert teacher_prompt[: len(student_prompt)] == student_prompt and len(teacher_prompt) > len(student_prompt)


def test_base_copy_runs_its_own_weights_when_it_generates(tmp_path, math_trained_path, math_dataset):
    """The copy's `forward` (what `generate` calls) is its own: GRPO's fused LM head on the student is a closure over
    the student's forward, which a plain deep copy would keep calling."""
    trainer = OnPolicyDistillTrainer(
        model=str(math_trained_path), args=opd_config(tmp_path), train_dataset=with_context(math_dataset)
    )
    with torch.no_grad():
        for param in trainer.model.parameters():  # the student moves on; the base teacher must not
            param.add_(torch.randn_like(param))
    ids = torch.tensor([trainer._tokenizer(math_dataset["prompt"][0])["input_ids"]])
    base = AutoModelForCausalLM.from_pretrained(math_trained_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(trainer.teacher.model(input_ids=ids).logits, base(input_ids=ids).logits)


# ----- the lens: the ledger says what the teacher saw ---------------------------------------------------------------
def test_ledger_records_the_teacher_prompt_and_its_extra_context(tmp_path, math_trained_path, math_dataset):
    trainer = OnPolicyDistillTrainer(
        model=str(math_trained_path),
        args=opd_config(tmp_path, teacher_prompt_template="{privileged_context}\n{prompt}"),
        train_dataset=with_context(math_dataset),
        callbacks=[StateLoggingCallback(sample_rate=1.0)],
    )
    trainer.train()
    lines = [json.loads(line) for line in open(tmp_path / "statelens" / "states.jsonl")]
    assert len(lines) == 8
    by_prompt = {row["prompt"]: row for row in with_context(math_dataset)}
    for line in lines:
        row = by_prompt[line["prompt"]]
        context_ids = trainer._tokenizer(row["privileged_context"] + "\n")["input_ids"]
        assert line["teacher_prompt"] == trainer._tokenizer.decode(
            trainer._tokenizer(row["privileged_context"] + "\n" + row["prompt"])["input_ids"]
        )
        assert line["teacher_context_len"] == len(context_ids) > 0
        assert line["teacher_logp"] is not None and len(line["teacher_logp"]) == line["num_supervised"]


# ----- EMA: moved by each step, kept in checkpoints ---------------------------------------------------------------
def test_ema_teacher_moves_toward_the_student_by_the_rate(tmp_path, math_trained_path, math_dataset):
    trainer = OnPolicyDistillTrainer(
        model=str(math_trained_path),
        args=opd_config(tmp_path, teacher_model_kind="ema", teacher_update_rate=0.25),
        train_dataset=with_context(math_dataset),
        state_logging=False,
    )
    start = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    student = dict(trainer.model.named_parameters())
    moved = False
    for name, averaged in trainer.teacher.model.named_parameters():
        expected = torch.lerp(start[name], student[name].detach(), 0.25)
        torch.testing.assert_close(averaged, expected, atol=0, rtol=0)
        moved |= not averaged.equal(start[name])
    assert moved


def test_ema_teacher_survives_kill_and_resume_byte_for_byte(tmp_path, math_trained_path, math_dataset):
    """Four steps straight, against a run killed with SIGKILL inside step 3 (a forked copy of this process: nothing
    runs after the kill) and resumed from its checkpoint-2: the same weights, EMA teacher, losses and ledger files
    (with each sequence's teacher prompt), byte for byte (one CPU thread: training is deterministic). Without the
    EMA in the checkpoint the resumed teacher would restart from the student's first weights."""
    import os
    import signal

    from transformers import TrainerCallback

    data = with_context(math_dataset)

    def trainer(output_dir, *callbacks):
        args = opd_config(
            output_dir, max_steps=4, per_device_train_batch_size=4, teacher_model_kind="ema",
            teacher_update_rate=0.5, save_strategy="steps", save_steps=2,
        )  # fmt: skip
        return OnPolicyDistillTrainer(
            model=str(math_trained_path), args=args, train_dataset=data,
            callbacks=[StateLoggingCallback(sample_rate=0.5), *callbacks],
        )  # fmt: skip

    class KillInStep3(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            if state.global_step == 2:  # two steps done and checkpointed, the third one's backward too
                os.kill(os.getpid(), signal.SIGKILL)

    straight = trainer(tmp_path / "straight")
    straight.train()
    saved = load_file(tmp_path / "straight" / "checkpoint-2" / SelfTeacher.EMA_FILE)
    assert saved.keys() == dict(straight.teacher.model.named_parameters()).keys()

    out = tmp_path / "killed"
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            trainer(out, KillInStep3()).train()
        finally:
            os._exit(1)  # reached only if the kill never came
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]

    resumed = trainer(out)
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    for (name, a), (_, b) in zip(straight.teacher.model.named_parameters(), resumed.teacher.model.named_parameters()):
        assert a.equal(b), name
    for (name, a), (_, b) in zip(straight.model.named_parameters(), resumed.model.named_parameters()):
        assert a.equal(b), name
    assert log_history(resumed, "loss") == log_history(straight, "loss")  # steps 1-2 come from the checkpoint
    final = load_file(out / "checkpoint-4" / SelfTeacher.EMA_FILE)
    reference = load_file(tmp_path / "straight" / "checkpoint-4" / SelfTeacher.EMA_FILE)
    assert final.keys() == reference.keys() and all(final[k].equal(reference[k]) for k in reference)
    for name in ("steps.jsonl", "states.jsonl"):
        ledger = (out / "statelens" / name).read_bytes()
        assert ledger == (tmp_path / "straight" / "statelens" / name).read_bytes(), name
    assert b'"teacher_prompt"' in (out / "statelens" / "states.jsonl").read_bytes()


def test_ema_teacher_of_bf16_weights_averages_in_fp32(tmp_path, math_trained_path, math_dataset):
    """A bf16 student and copy: the average is kept in fp32 and cast into the bf16 teacher after each update, so 20
    updates at rate 0.05 toward a student 1% away move the teacher 1 - 0.95^20 of the way, as the fp32 recurrence does
    (averaged in bf16, each increment rounds away: it moved 0.0 of the way). The teacher's weights are that fp32
    recurrence, cast to bf16."""
    trainer = OnPolicyDistillTrainer(
        model=str(math_trained_path),
        args=opd_config(tmp_path, teacher_model_kind="ema", model_init_kwargs={"dtype": "bfloat16"}),
        train_dataset=with_context(math_dataset),
        state_logging=False,
    )
    teacher = dict(trainer.teacher.model.named_parameters())
    assert {p.dtype for p in teacher.values()} == {torch.bfloat16}
    start = {name: p.detach().float() for name, p in teacher.items()}
    with torch.no_grad():
        for param in trainer.model.parameters():
            param.mul_(1.01)
    target = {name: p.detach().float() for name, p in trainer.model.named_parameters()}
    fp32 = {name: t.clone() for name, t in start.items()}
    for _ in range(20):
        trainer.teacher.weights.update_average(0.05)
        for name, average in fp32.items():
            average.lerp_(target[name], 0.05)
    moved = sum(((teacher[n].float() - start[n]) * (target[n] - start[n])).sum() for n in teacher)
    share = moved / sum(((target[n] - start[n]) ** 2).sum() for n in teacher)
    assert share >= 0.9 * (1 - 0.95**20), share
    for name, param in teacher.items():
        assert param.dtype == torch.bfloat16 and param.equal(fp32[name].to(torch.bfloat16)), name


# ----- live and PEFT: no copy ---------------------------------------------------------------------------------------
def test_live_teacher_is_the_student_and_trains(tmp_path, math_trained_path, math_dataset):
    trainer = OnPolicyDistillTrainer(
        model=str(math_trained_path),
        args=opd_config(tmp_path, teacher_model_kind="live", max_steps=2),
        train_dataset=with_context(math_dataset),
        state_logging=False,
    )
    assert trainer.teacher.model is trainer.model and trainer.teacher_model is trainer.model
    assert trainer.probe_teacher_model is None  # no probe teacher: the probe prompts hold no privileged context
    trainer.train()
    kl = log_history(trainer, "teacher_kl/sampled")
    assert len(kl) == 2 and all(k != 0.0 for k in kl)  # the context changes what the student predicts


def test_peft_base_teacher_is_the_student_with_its_adapter_disabled(tmp_path, math_trained_path, math_dataset):
    from peft import LoraConfig

    trainer = OnPolicyDistillTrainer(
        model=str(math_trained_path),
        args=opd_config(tmp_path, teacher_prompt_template="{prompt}{privileged_context}", learning_rate=5e-2),
        train_dataset=with_context(math_dataset, [""]),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
        state_logging=False,
    )
    assert trainer.teacher.model is trainer.model  # no copy
    rows = [dict(row) for row in with_context(math_dataset, [""]).select(range(4)) for _ in range(2)]
    trainer.model.train()
    batch = trainer._generate_and_score_completions(rows)
    teacher = resolve_rows(batch["teacher_scores"], batch["completion_ids"], batch["completion_mask"]).logps
    base = AutoModelForCausalLM.from_pretrained(math_trained_path).eval()
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    with torch.no_grad():
        logits = base(input_ids=ids, attention_mask=mask).logits[:, -batch["completion_ids"].size(1) - 1 : -1]
    direct = logits.log_softmax(-1).gather(-1, batch["completion_ids"][..., None])[..., 0] * batch["completion_mask"]
    torch.testing.assert_close(teacher, direct, atol=1e-5, rtol=1e-5)  # the base, not the (non-zero) adapter
    # and the adapter is on again for the student
    with torch.no_grad():
        student = trainer.model(input_ids=ids, attention_mask=mask).logits[
            :, -batch["completion_ids"].size(1) - 1 : -1
        ]
    assert not torch.allclose(student, logits, atol=1e-3)


# ----- PEFT with EMA: an average over the adapter only -------------------------------------------------------------
def lora_ema_trainer(output_dir, model_path, data, **kwargs):
    from peft import LoraConfig

    args = opd_config(output_dir, teacher_model_kind="ema", teacher_update_rate=0.25, learning_rate=5e-2, **kwargs)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return OnPolicyDistillTrainer(
        model=str(model_path), args=args, train_dataset=data, peft_config=lora, state_logging=False
    )


def test_peft_ema_teacher_averages_the_adapter_and_scores_with_it(tmp_path, math_trained_path, math_dataset):
    """One adapter copy, no model copy; after a step it is (1 - r) * initial + r * adapter, exactly; the teacher
    scores with it swapped into the student, which has its own adapter back after. `divergence`: the teacher runs
    while the student's graph is alive, and the step's backward must still work."""
    data = with_context(math_dataset)
    trainer = lora_ema_trainer(tmp_path, math_trained_path, data, signal="divergence")
    average = trainer.teacher.weights.average
    trained = {name: p for name, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainer.teacher.model is trainer.model and average.keys() == trained.keys()
    assert all("lora_" in name for name in average)  # the adapter only: the frozen base is shared
    start = {name: t.clone() for name, t in average.items()}
    trainer.train()
    assert log_history(trainer, "grad_norm")[0] > 0
    for name, param in trained.items():
        torch.testing.assert_close(average[name], torch.lerp(start[name], param.detach(), 0.25), atol=0, rtol=0)
    assert any(not average[name].equal(start[name]) for name in average)

    # the teacher's log-probs are the student module's with the averaged adapter written in
    tokenizer = trainer._tokenizer
    prompt = tokenizer(math_dataset["prompt"][0])["input_ids"]
    completion = tokenizer(math_dataset["completion"][0])["input_ids"]
    trainer.model.eval()
    own = {name: param.detach().clone() for name, param in trained.items()}
    rows = trainer.teacher.score([prompt], [completion])
    assert all(param.equal(own[name]) for name, param in trained.items())  # the student's adapter is back
    ids = torch.tensor([prompt + completion])
    scores = resolve_rows(rows, ids[:, len(prompt) :], torch.ones_like(ids[:, len(prompt) :])).logps[0]

    def logps():
        with torch.no_grad():
            logits = trainer.model(input_ids=ids).logits[0, len(prompt) - 1 : -1] / trainer.temperature
        return logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]

    student = logps()
    with torch.no_grad():
        for name, param in trained.items():
            param.copy_(average[name])
    torch.testing.assert_close(scores, logps(), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(scores, student, atol=1e-4)  # not the student's own adapter


def test_peft_ema_average_stays_fp32_when_deepspeed_casts_the_adapter(tmp_path, math_trained_path, math_dataset):
    """DeepSpeed with bf16 (ZeRO-1/2) casts every parameter in place after the average was made: the average stays
    fp32 and moves by the rule (no dtype clash in `lerp_`); the teacher scores with it cast to the adapter's dtype, and
    the student's own bf16 adapter is back after."""
    trainer = lora_ema_trainer(tmp_path, math_trained_path, with_context(math_dataset))
    with torch.no_grad():
        for param in trainer.model.parameters():  # what deepspeed/runtime/engine.py does under bf16
            param.data = param.data.to(torch.bfloat16)
    trained = {name: p for name, p in trainer.model.named_parameters() if p.requires_grad}
    with torch.no_grad():
        for param in trained.values():  # the adapter moves away from the average
            param.mul_(1.5)
    average = trainer.teacher.weights.average
    start = {name: t.clone() for name, t in average.items()}
    trainer.teacher.weights.update_average(0.05)
    for name, param in trained.items():
        assert average[name].dtype == torch.float32
        expected = torch.lerp(start[name], param.detach().float(), 0.05)
        torch.testing.assert_close(average[name], expected, atol=0, rtol=0)
        assert not average[name].equal(start[name])
    tokenizer = trainer._tokenizer
    prompt = tokenizer(math_dataset["prompt"][0])["input_ids"]
    completion = tokenizer(math_dataset["completion"][0])["input_ids"]
    own = {name: param.data_ptr() for name, param in trained.items()}
    trainer.model.eval()
    rows = trainer.teacher.score([prompt], [completion])
    ids = torch.tensor([completion])
    assert resolve_rows(rows, ids, torch.ones_like(ids)).logps.isfinite().all()
    for name, param in trained.items():  # the student's own bf16 adapter is back
        assert param.dtype == torch.bfloat16 and param.data_ptr() == own[name], name


def test_peft_ema_teacher_resumes_from_its_checkpoint(tmp_path, math_trained_path, math_dataset):
    """Two steps straight, checkpointed after each; resumed from checkpoint-1 in another run: the same adapter average
    (and student) as the straight run's, exactly. Without the average in the checkpoint it would restart from the
    adapter's initial weights."""
    data = with_context(math_dataset)
    kwargs = dict(max_steps=2, per_device_train_batch_size=4, save_strategy="steps", save_steps=1)
    straight = lora_ema_trainer(tmp_path / "straight", math_trained_path, data, **kwargs)
    straight.train()
    saved = load_file(tmp_path / "straight" / "checkpoint-1" / SelfTeacher.EMA_FILE)
    assert saved.keys() == straight.teacher.weights.average.keys()
    resumed = lora_ema_trainer(tmp_path / "resumed", math_trained_path, data, **kwargs)
    resumed.train(resume_from_checkpoint=str(tmp_path / "straight" / "checkpoint-1"))
    assert resumed.state.global_step == 2
    for name, average in straight.teacher.weights.average.items():
        assert resumed.teacher.weights.average[name].equal(average), name
    for (name, a), (_, b) in zip(straight.model.named_parameters(), resumed.model.named_parameters()):
        assert a.equal(b), name


# ----- refused clearly --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(teacher_model_kind="frozen"), "teacher_model_kind='frozen' is not one of"),
        (dict(teacher_prompt_template="{prompt} with a hint"), "lacks {privileged_context}"),
        (dict(teacher_prompt_template="Hint: {privileged_context}"), "lacks {prompt}"),
        (dict(teacher_model_kind="ema", teacher_update_rate=0.0), "teacher_update_rate must be in"),
        (dict(teacher_model_server_url="http://localhost:8000"), "set only one"),
    ],
)
def test_bad_self_teacher_config_is_rejected(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        opd_config(tmp_path, **kwargs)


def test_self_teacher_with_a_teacher_model_is_rejected(tmp_path, math_trained_path, teacher_path, math_dataset):
    with pytest.raises(ValueError, match="teacher_model must be omitted"):
        OnPolicyDistillTrainer(
            model=str(math_trained_path),
            teacher_model=str(teacher_path),
            args=opd_config(tmp_path),
            train_dataset=with_context(math_dataset),
        )


def test_dataset_without_privileged_context_is_rejected_before_the_model_loads(tmp_path, math_dataset):
    with pytest.raises(ValueError, match=r"teacher_prompt_template='\{prompt\}.*in a 'privileged_context' column"):
        OnPolicyDistillTrainer(model=str(tmp_path / "no-model"), args=opd_config(tmp_path), train_dataset=math_dataset)


def test_ema_teacher_under_fsdp_is_refused(tmp_path, monkeypatch):
    """FSDP shards the student into DTensors, which the average (of a copy, or of an adapter swapped into the student)
    cannot be combined with: refused when the trainer runs FSDP, a full-weight student's and a PEFT student's alike
    (under accelerate's FSDP2 a LoRA "ema" silently taught as the live student), and when the parameters the average
    is taken of are already sharded (`fully_shard` applied directly), before any copy is made. A full-weight student
    already sharded is refused as one that cannot be copied, "base" as well."""
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model
    from torch.distributed.fsdp import fully_shard

    def peft_model():
        return get_peft_model(torch.nn.Sequential(torch.nn.Linear(4, 4)), LoraConfig(r=2, target_modules=["0"]))

    args = opd_config(tmp_path, teacher_model_kind="ema")
    for model in (torch.nn.Linear(4, 4), peft_model()):
        plain = SimpleNamespace(args=args, model=model, is_fsdp_enabled=True)
        with pytest.raises(ValueError, match="teacher_model_kind='ema' under FSDP"):
            SelfTeacher(plain)

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = dist.device_mesh.init_device_mesh("cpu", (1,))
        peft = fully_shard(peft_model(), mesh=mesh)
        assert any(isinstance(p, DTensor) for p in peft.parameters() if p.requires_grad)
        with pytest.raises(ValueError, match="teacher_model_kind='ema' under FSDP"):
            SelfTeacher(SimpleNamespace(args=args, model=peft, is_fsdp_enabled=False))
        full = fully_shard(torch.nn.Linear(4, 4), mesh=mesh)
        for kind in ("base", "ema"):
            sharded = SimpleNamespace(args=opd_config(tmp_path, teacher_model_kind=kind), model=full)
            with pytest.raises(
                ValueError, match=f"teacher_model_kind='{kind}' with a student already sharded by FSDP2"
            ):
                SelfTeacher(sharded)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "zero", [{"zero_hpz_partition_size": 2}, {"offload_param": {"device": "nvme", "nvme_path": "/tmp"}}]
)
def test_ema_teacher_under_zero3_with_partitions_kept_elsewhere_is_refused(zero):
    """Under ZeRO-3 the average is written into each process's partitions of the teacher: hpZ keeps a second copy of
    a frozen model's partitions, NVMe offload swaps them out; refused, naming the setting."""
    from trl_statelens.teachers.self_teacher_weights import _refuse_unaligned_partitions

    plugin = SimpleNamespace(deepspeed_config={"zero_optimization": {"stage": 3, **zero}})
    with pytest.raises(ValueError, match="hpZ .* or NVMe parameter offload is not supported"):
        _refuse_unaligned_partitions(plugin)
    _refuse_unaligned_partitions(SimpleNamespace(deepspeed_config={"zero_optimization": {"stage": 3}}))


# ----- a teacher that shares the student leaves its training settings alone -----------------------------------------
def test_teacher_generation_keeps_the_students_gradient_checkpointing_kwargs(
    tmp_path, math_trained_path, math_dataset
):
    """TRL turns the student's gradient checkpointing off to generate and on again after with the kwargs it is given;
    a live teacher generating (`continuation`) passes the run's, so `use_reentrant=True` (which TRL forces for PEFT
    under ZeRO-3) survives the step instead of coming back as transformers' default (False)."""
    trainer = OnPolicyDistillTrainer(
        model=str(math_trained_path),
        args=opd_config(
            tmp_path,
            teacher_model_kind="live",
            signal="continuation",
            continuation_length=4,
            gradient_checkpointing=True,
            gradient_checkpointing_kwargs={"use_reentrant": True},
        ),  # fmt: skip
        train_dataset=with_context(math_dataset),
        state_logging=False,
    )
    asked = []
    generate = trainer.teacher.generate
    trainer.teacher.generate = lambda *a, **k: asked.append(a) or generate(*a, **k)
    trainer.train()
    assert asked  # the teacher generated
    layer = trainer.model.model.layers[0]
    assert layer.gradient_checkpointing and layer._gradient_checkpointing_func.keywords["use_reentrant"] is True


def test_copied_teacher_under_cast_lm_head_to_fp32_computes_with_its_own_head(
    tmp_path, math_trained_path, math_dataset
):
    """GRPO's `cast_lm_head_to_fp32` gives the student's head a forward that reads the student's head weight; the
    `"base"` copy must compute with its own: the student's head changes, the teacher's log-probs do not."""
    trainer = OnPolicyDistillTrainer(
        model=str(math_trained_path),
        args=opd_config(tmp_path, cast_lm_head_to_fp32=True),
        train_dataset=with_context(math_dataset),
        state_logging=False,
    )
    tokenizer = trainer._tokenizer
    prompt = tokenizer(math_dataset["prompt"][0])["input_ids"]
    completion = tokenizer(math_dataset["completion"][0])["input_ids"]
    ids = torch.tensor([completion])
    trainer.model.eval()

    def teacher_logps():
        rows = trainer.teacher.score([prompt], [completion])
        return resolve_rows(rows, ids, torch.ones_like(ids)).logps

    def teacher_logits():
        with torch.no_grad():
            return trainer.teacher.model(input_ids=torch.tensor([prompt + completion])).logits

    before, logits = teacher_logps(), teacher_logits()
    with torch.no_grad():
        trainer.model.get_output_embeddings().weight.add_(1.0)
    torch.testing.assert_close(teacher_logps(), before, atol=0, rtol=0)
    torch.testing.assert_close(teacher_logits(), logits, atol=0, rtol=0)  # what the teacher's `generate` runs


def test_peft_model_student_with_a_trained_adapter_warns_that_base_drops_it(
    tmp_path, math_trained_path, math_dataset, caplog
):
    """As TRL's SDFT: a student given as a PEFT model already carries an adapter, and `"base"` is its base model with
    that adapter disabled, not the student's weights at the start. A student whose adapter the trainer adds (from
    `peft_config`) starts as its base: no warning."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    student = get_peft_model(AutoModelForCausalLM.from_pretrained(math_trained_path), lora)
    with caplog.at_level("WARNING"):
        OnPolicyDistillTrainer(
            model=student, args=opd_config(tmp_path), train_dataset=with_context(math_dataset), state_logging=False
        )
    assert "base model with the adapter disabled" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        OnPolicyDistillTrainer(
            model=str(math_trained_path), args=opd_config(tmp_path), train_dataset=with_context(math_dataset),
            peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]), state_logging=False,
        )  # fmt: skip
    assert "adapter disabled" not in caplog.text


# ----- every row checked before training, on every process --------------------------------------------------------
def test_eval_dataset_without_privileged_context_is_rejected_before_the_model_loads(tmp_path, math_dataset):
    """The review's case: a held-out split that lacks the new column used to train until the first evaluation."""
    with pytest.raises(ValueError, match=r"in a 'privileged_context' column, absent from eval_dataset \(columns"):
        OnPolicyDistillTrainer(
            model=str(tmp_path / "no-model"),
            args=opd_config(tmp_path, eval_strategy="steps", eval_steps=1),
            train_dataset=with_context(math_dataset),
            eval_dataset=math_dataset,
        )


@pytest.mark.parametrize("split", ["train_dataset", "eval_dataset"])
def test_a_row_without_privileged_context_is_rejected_before_the_model_loads(tmp_path, math_dataset, split):
    """A `None` context used to raise on the one process whose batch drew the row, mid-training."""
    contexts = list(math_dataset["completion"])
    contexts[5] = None
    bad, good = with_context(math_dataset, contexts), with_context(math_dataset)
    datasets = {"train_dataset": bad, "eval_dataset": good} if split == "train_dataset" else {
        "train_dataset": good, "eval_dataset": bad}  # fmt: skip
    with pytest.raises(
        ValueError, match=f"{split}: 1 row\\(s\\) have no privileged_context \\(None\\) \\(the first: row 5"
    ):
        OnPolicyDistillTrainer(model=str(tmp_path / "no-model"), args=opd_config(tmp_path), **datasets)


def test_a_bad_row_on_one_process_stops_every_process(tmp_path, math_trained_path, math_dataset, monkeypatch):
    """An IterableDataset's rows are checked batch by batch: each process says whether its batch has a bad row
    (one gather) before the batch's first collective, so a bad row on another process stops this one too, instead
    of leaving it in the next collective until the launcher's timeout."""
    trainer = OnPolicyDistillTrainer(
        model=str(math_trained_path), args=opd_config(tmp_path), train_dataset=with_context(math_dataset)
    )
    rows = [dict(row) for row in with_context(math_dataset).select(range(4))]
    flags = []

    def two_processes(other_failed):  # this process's flag and another process's
        def gather_counts(accelerator, count):
            flags.append(count)
            return [count, other_failed]

        return gather_counts

    monkeypatch.setattr(collective, "gather_counts", two_processes(0))
    assert trainer._check_rows_on_every_rank(rows) == [None] * 4  # a self teacher routes nothing
    monkeypatch.setattr(collective, "gather_counts", two_processes(1))
    with pytest.raises(ValueError, match="process 1: a bad row in its batch"):
        trainer._check_rows_on_every_rank(rows)
    rows[2]["privileged_context"] = None
    with pytest.raises(ValueError, match=r"this batch: 1 row\(s\) have no privileged_context"):
        trainer._check_rows_on_every_rank(rows)
    assert flags == [0, 0, 1]  # this process said so before raising: the others stop with it


# ----- review 2026-12-04 ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind, signal", [("base", "divergence"), ("ema", "divergence"), ("base", "reverse_kl")])
def test_peft_self_teacher_divergence_projects_the_student_with_its_own_trained_head(
    tmp_path, math_trained_path, math_dataset, kind, signal
):
    """A LoRA student whose output layer is trained (`modules_to_save=["lm_head"]`), its head copy moved away from
    the base head after the teacher was made; the teacher reads the student's prompt (empty context), so it is the
    student at the start ("base": the adapter disabled; "ema": the average, made before the head moved) and differs
    from the student at the head only. The divergence loss must see that difference and send the head copy a
    gradient: the student is projected with its own head, outside the teacher's weights (PEFT's ModulesToSaveWrapper
    reads `original_module.weight` while adapters are disabled; "ema" swaps the average into the copy's `.data`).
    `reverse_kl` (the student's log-probs from its own forward) is the control: there the two disagree."""
    from peft import LoraConfig

    args = opd_config(
        tmp_path, learning_rate=1e-2, signal=signal, teacher_model_kind=kind,
        teacher_prompt_template="{prompt}{privileged_context}",
    )  # fmt: skip
    lora = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], modules_to_save=["lm_head"])  # LoRA B = 0
    trainer = OnPolicyDistillTrainer(
        model=str(math_trained_path), args=args, train_dataset=with_context(math_dataset, [""]).select(range(16)),
        peft_config=lora, state_logging=False,
    )  # fmt: skip
    copy_weight = trainer.model.get_output_embeddings().modules_to_save["default"].weight
    with torch.no_grad():
        copy_weight.add_(0.05 * torch.randn_like(copy_weight))  # the student's head now differs from the teacher's
    before = copy_weight.detach().clone()
    trainer.train()
    loss, kl = log_history(trainer, "loss")[0], log_history(trainer, "teacher_kl/sampled")[0]
    if signal == "reverse_kl":  # the student's own forward: it differs from its teacher
        assert abs(kl) > 1e-4
        return
    assert loss > 1e-4, f"divergence loss {loss}: the student was projected with the teacher's head"
    assert abs(kl) > 1e-4
    assert not torch.equal(copy_weight.detach(), before), "the trained head copy got no gradient"


def test_zero3_ema_checkpoint_gathers_offloaded_partitions_on_the_accelerators_device(tmp_path):
    """Under ZeRO-3 with CPU parameter offload the EMA's partitions (and their fp32 masters) live in host memory,
    and NCCL gathers only tensors on the process's GPU (accelerate's `gather` allocates its output there): each
    partition travels to `accelerator.device` for the gather, and the whole average is saved as gathered. Here the
    accelerator's device is `meta`, never the partition's own (two processes' partitions of a 5-element weight)."""
    from trl_statelens.teachers.self_teacher_weights import EMA_FILE, AveragedCopy

    weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)  # a ZeRO-3 parameter, released
    weight.ds_tensor, weight.ds_numel, weight.ds_shape = torch.arange(3.0), 5, torch.Size([5])  # partition on CPU
    model = torch.nn.Module()
    model.register_parameter("weight", weight)
    gathered = []

    class Accelerator:
        device = torch.device("meta")

        def unwrap_model(self, module):
            return module

        def gather(self, tensor):
            gathered.append(tensor.device)
            return torch.arange(6.0)  # both processes' partitions, the last one padded (as NCCL's, but on the CPU)

    ema = AveragedCopy.__new__(AveragedCopy)  # its state alone: no model copy, no DeepSpeed
    ema.trainer = SimpleNamespace(args=SimpleNamespace(should_save=True), accelerator=Accelerator())
    ema.zero3, ema.model, ema.master = True, model, {}
    ema.save(str(tmp_path))
    assert gathered == [torch.device("meta")], f"gathered on {gathered}, not on the accelerator's device"
    assert load_file(tmp_path / EMA_FILE)["weight"].equal(torch.arange(5.0))


def test_a_shared_privileged_start_is_written_after_once_with_the_plain_writers_tokens(
    tmp_path, math_trained_path, math_dataset
):
    """The teacher writes after the same worked examples on every row (preflight answers, `teacher` states,
    continuations): `generate` goes on from the start's keys and values, run once for the frozen `base` teacher over
    two calls, and each row gets the tokens a plain left-padded `generate` of its whole prompt gives (greedy)."""
    context = " ".join(f"Example {i}: 3 + {i} = {3 + i}." for i in range(12))
    trainer = OnPolicyDistillTrainer(
        model=str(math_trained_path),
        args=opd_config(tmp_path, teacher_prompt_template="{privileged_context}\nNow: {prompt}"),
        train_dataset=with_context(math_dataset, [context]),
        state_logging=False,
    )
    teacher = trainer.teacher
    rows = [dict(row) for row in with_context(math_dataset, [context]).select(range(4))]
    prompts = teacher.prompts(None, rows)
    model = trainer.accelerator.unwrap_model(teacher.generation_model)
    starts = []
    model.register_forward_pre_hook(
        lambda module, args, kwargs: starts.append(1) if kwargs.get("use_cache") and args else None, with_kwargs=True
    )
    pad_id = trainer._tokenizer.pad_token_id
    plain = InProcessTeacher._generation_inputs(teacher, prompts, pad_id)
    for _ in range(2):
        shared = teacher._generation_inputs(prompts, pad_id)
        assert "past_key_values" in shared and shared["past_key_values"].get_seq_length() >= 64
        with torch.no_grad():
            ours, theirs = (
                model.generate(**inputs, max_new_tokens=8, do_sample=False, pad_token_id=pad_id)
                for inputs in (shared, plain)
            )
        assert ours[:, shared["input_ids"].size(1) :].tolist() == theirs[:, plain["input_ids"].size(1) :].tolist()
    assert len(starts) == 1  # the start's forward ran once for both calls


def test_a_shared_privileged_start_counts_once_in_the_teachers_writing(tmp_path, math_trained_path, math_dataset):
    """The teacher writes every rollout (`teacher` states) after the same worked examples: its writing's FLOPs count
    its prompts with that start once (it ran at step 1 only: the frozen `base` teacher) and the tokens it wrote."""
    context = " ".join(f"Example {i}: 3 + {i} = {3 + i}." for i in range(12))
    trainer = OnPolicyDistillTrainer(
        model=str(math_trained_path),
        args=opd_config(
            tmp_path,
            max_steps=2,
            state_source_mix={"teacher": 1.0},
            teacher_prompt_template="{privileged_context}\nNow: {prompt}",
        ),  # fmt: skip
        train_dataset=with_context(math_dataset.select(range(4)), [context]),
        callbacks=[StateLoggingCallback(sample_rate=0.0)],
    )
    written = []  # per step: the rows' prompt tokens, the written tokens, the shared start
    generate = trainer.teacher.generate

    def counted(prompts, max_new_tokens, prefixes=None, teachers=None):
        rollouts = generate(prompts, max_new_tokens, prefixes, teachers)
        shared = trainer.teacher._shared_prefix_length(prompts)
        written.append((sum(map(len, prompts)), sum(map(len, rollouts)), shared, len(prompts)))
        return rollouts

    trainer.teacher.generate = counted
    trainer.train()
    steps = [json.loads(line) for line in (tmp_path / "statelens" / "steps.jsonl").read_text().splitlines()]
    n = matmul_parameters(trainer.model)
    assert len(written) == 2 and all(shared >= 64 for *_, shared, _ in written)
    for line, (prompt_tokens, tokens, shared, rows), ran in zip(steps, written, (1, 0)):
        assert line["teacher_writing_prefix_saved"] == rows * shared - ran * shared
        ran_over = prompt_tokens - rows * shared + ran * shared + tokens
        assert line["flops/teacher_writing"] == pytest.approx(2 * n * ran_over)
