"""The preflight (`trl_statelens.preflight`, docs/preflight.md): each check fires on a constructed bad case and stays
quiet on a good one; `strict` refuses before step 1, `off` writes nothing, every rank takes the main process's verdict."""

import json
from types import SimpleNamespace

import pytest
import torch
from cpu_settings import CPU
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, SFTConfig
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

import trl_statelens.preflight as preflight
import trl_statelens.preflight.opd as preflight_opd
from trl_statelens import OnPolicyDistillConfig, OnPolicyDistillTrainer, StateLensGRPOTrainer, StateLensSFTTrainer
from trl_statelens.preflight import PreflightCallback, PreflightFailed, run_preflight


def opd_trainer(tmp_path, student, teacher, dataset, **kwargs):
    defaults = dict(per_device_train_batch_size=8, num_generations=2, max_completion_length=64, max_steps=1)
    args = OnPolicyDistillConfig(output_dir=str(tmp_path), **{**defaults, **CPU, **kwargs})
    return OnPolicyDistillTrainer(model=str(student), teacher_model=teacher, args=args, train_dataset=dataset)


def checks(result) -> dict:
    return {check["name"]: check for check in result["checks"]}


def never_ends(path):
    """The model at `path` with its end token's logit pushed down by 30: it never ends an answer."""
    model = AutoModelForCausalLM.from_pretrained(path)
    eos = AutoTokenizer.from_pretrained(path).eos_token_id
    head = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=True)
    head.weight.data.copy_(model.lm_head.weight.data)
    head.bias.data.zero_()
    head.bias.data[eos] = -30.0
    model.lm_head, model.config.tie_word_embeddings = head, False
    return model


def test_teacher_whose_answers_never_end_fails_and_one_that_ends_passes(
    tmp_path, math_trained_path, math_teacher_path, math_dataset
):
    good = checks(run_preflight(opd_trainer(tmp_path, math_trained_path, str(math_teacher_path), math_dataset)))
    assert good["teacher/length_limit_share"]["verdict"] == "pass"
    assert good["teacher/format_share"]["verdict"] == "pass"
    assert good["teacher/end_after_answer"]["verdict"] != "fail"
    assert good["teacher/same_frame"]["verdict"] == "pass"
    assert good["teacher/over_context_share"]["verdict"] == "pass"
    assert good["teacher/kl_sampled"]["details"]["by_position_quarter"][0] is not None
    bad = checks(run_preflight(opd_trainer(tmp_path, math_trained_path, never_ends(math_teacher_path), math_dataset)))
    assert bad["teacher/length_limit_share"]["value"] >= 0.9 and bad["teacher/length_limit_share"]["verdict"] == "fail"
    assert bad["teacher/end_after_answer"]["value"] < 0.01 and bad["teacher/end_after_answer"]["verdict"] == "fail"
    # the teacher's end probability is read after its own answer line, not the student's
    assert good["teacher/end_after_answer"]["value"] > 10 * bad["teacher/end_after_answer"]["value"]


def test_turn_end_flagged_special_but_unnamed_is_checked(tokenizer):
    """The lab tokenizer, like Gemma 3's converted one, flags its turn tokens special without naming them among its
    special tokens: the check must still find `<|im_end|>` and fail where generation would not stop at it."""
    from trl_statelens.preflight.grpo import end_token_checks

    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end not in tokenizer.all_special_ids  # what made the check skip before
    for end_ids, verdict in (([tokenizer.eos_token_id], "fail"), ([tokenizer.eos_token_id, im_end], "pass")):
        trainer = SimpleNamespace(_tokenizer=tokenizer, eos_token_ids=end_ids,
                                  model=SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=end_ids)))  # fmt: skip
        (check,) = end_token_checks(trainer)
        assert (check.name, check.verdict) == ("end_tokens/turn_end_stops", verdict)
        assert check.details["turn_end"] == "<|im_end|>"


def test_cut_student_warns_when_distilled_and_fails_grpo(tmp_path, math_trained_path, math_teacher_path, math_dataset):
    # OPD's teacher is there to fix a student that does not end: its cut share is a warning at most
    trainer = opd_trainer(tmp_path, math_trained_path, str(math_teacher_path), math_dataset, max_completion_length=2)
    found = checks(run_preflight(trainer))["student/length_limit_share"]
    assert found["value"] == 1.0 and found["verdict"] == "warn" and found["fix"]
    trainer = opd_trainer(tmp_path, math_trained_path, str(math_teacher_path), math_dataset)
    assert checks(run_preflight(trainer))["student/length_limit_share"]["verdict"] == "pass"
    # GRPO's group of cut rollouts has reward std 0: the same share fails there
    trainer = grpo_trainer(tmp_path, math_trained_path, math_dataset, parity_reward, max_completion_length=2)
    found = checks(run_preflight(trainer))["student/length_limit_share"]
    assert found["value"] == 1.0 and found["verdict"] == "fail"


def test_teacher_end_after_answer_fails_at_its_line(
    tmp_path, monkeypatch, math_trained_path, math_teacher_path, math_dataset
):
    """The text-frame self teacher of the real model measured 0.271 (STUDY.md): a failure, not a warning."""
    monkeypatch.setattr(preflight_opd, "end_after_answer", lambda *args: (0.27, 16))
    trainer = opd_trainer(tmp_path, math_trained_path, str(math_teacher_path), math_dataset, max_completion_length=16)
    found = checks(run_preflight(trainer))["teacher/end_after_answer"]
    assert found["value"] == 0.27 and found["verdict"] == "fail"
    monkeypatch.setattr(preflight_opd, "end_after_answer", lambda *args: (0.31, 16))
    assert checks(run_preflight(trainer))["teacher/end_after_answer"]["verdict"] == "warn"


def test_teacher_prompt_over_its_context_fails(tmp_path, math_trained_path, math_teacher_path, math_dataset):
    teacher = AutoModelForCausalLM.from_pretrained(math_teacher_path)
    teacher.config.max_position_embeddings = 70  # a prompt of the lab is ~30 tokens, plus 64 to complete
    found = checks(run_preflight(opd_trainer(tmp_path, math_trained_path, teacher, math_dataset)))
    assert (
        found["teacher/over_context_share"]["value"] > 0 and found["teacher/over_context_share"]["verdict"] == "fail"
    )


def test_teacher_of_another_tokenizer_given_as_an_instance_is_named(
    tmp_path, student_path, other_teacher_path, math_dataset
):
    # An instance is read by the tokenizer saved where it was loaded from (its `name_or_path`): the trainer takes it
    # for a teacher of another tokenizer, and the preflight measures that the tokenizers differ and how they align
    model = AutoModelForCausalLM.from_pretrained(other_teacher_path)
    model.resize_token_embeddings(1024)
    saved = tmp_path / "wide_other_teacher"
    model.save_pretrained(saved)
    AutoTokenizer.from_pretrained(other_teacher_path).save_pretrained(saved)
    instance = AutoModelForCausalLM.from_pretrained(saved)
    found = checks(
        run_preflight(opd_trainer(tmp_path, student_path, instance, math_dataset, max_completion_length=16))
    )
    assert found["teacher/tokenizers_differ"]["verdict"] == "pass"
    # given by its path, it is read as a teacher of another tokenizer: the tokenizers differ, the alignment is measured
    by_path = opd_trainer(tmp_path, student_path, str(other_teacher_path), math_dataset, max_completion_length=16)
    found = checks(run_preflight(by_path))
    assert found["teacher/tokenizers_differ"]["verdict"] == "pass"
    assert 0 < found["teacher/alignment_exact_share"]["value"] <= 1
    assert "teacher/same_tokenizer" not in found


def parity_reward(completions, **kwargs):
    return [float(len(c) % 2) for c in completions]


def constant_reward(completions, **kwargs):
    return [1.0 for _ in completions]


def grpo_trainer(tmp_path, student, dataset, reward, max_completion_length=16, **kwargs):
    defaults = dict(per_device_train_batch_size=8, num_generations=4, max_steps=1)
    args = GRPOConfig(output_dir=str(tmp_path), max_completion_length=max_completion_length, **{**defaults, **CPU})
    return StateLensGRPOTrainer(model=str(student), reward_funcs=reward, args=args, train_dataset=dataset, **kwargs)


def test_grpo_constant_reward_has_no_spread(tmp_path, student_path, math_dataset):
    quiet = checks(run_preflight(grpo_trainer(tmp_path, student_path, math_dataset, parity_reward)))
    assert quiet["rewards/spread_share"]["verdict"] == "pass"
    found = checks(run_preflight(grpo_trainer(tmp_path, student_path, math_dataset, constant_reward)))
    assert found["rewards/spread_share"]["value"] == 0.0 and found["rewards/spread_share"]["verdict"] == "fail"
    assert found["rewards/spread_share"]["details"]["groups"] == 4  # 16 rollouts in groups of 4


def sft_trainer(tmp_path, student, dataset, **kwargs):
    args = SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=1, **CPU)
    return StateLensSFTTrainer(model=str(student), args=args, train_dataset=dataset, **kwargs)


def test_sft_answers_whose_end_the_collator_masks_fail(tmp_path, student_path, math_dataset):
    data = math_dataset.select_columns(["prompt", "completion"])
    quiet = checks(run_preflight(sft_trainer(tmp_path, student_path, data)))
    assert quiet["data/ends_with_end_token"]["value"] == 1.0
    assert quiet["data/offpolicy_gap"]["verdict"] != "skipped"
    # pad == eos with a collator that masks padding by id (as transformers' language-modelling collator does): the
    # end of every answer is masked out of the loss
    tokenizer = AutoTokenizer.from_pretrained(student_path)
    tokenizer.pad_token = tokenizer.eos_token
    trl_collator = DataCollatorForLanguageModeling(pad_token_id=tokenizer.pad_token_id)

    def masks_padding_by_id(rows):
        batch = trl_collator(rows)
        batch["labels"][batch["input_ids"] == tokenizer.pad_token_id] = -100
        return batch

    trainer = sft_trainer(tmp_path, student_path, data, processing_class=tokenizer, data_collator=masks_padding_by_id)
    found = checks(run_preflight(trainer))
    assert found["data/ends_with_end_token"]["value"] == 0.0
    assert found["data/ends_with_end_token"]["verdict"] == "fail"
    assert found["data/ends_with_end_token"]["details"]["pad_is_eos"]


def test_strict_refuses_before_step_one_and_writes_the_file(tmp_path, student_path, math_dataset):
    trainer = grpo_trainer(tmp_path, student_path, math_dataset, constant_reward, preflight="strict")
    with pytest.raises(PreflightFailed, match="rewards/spread_share"):
        trainer.train()
    assert trainer.state.global_step == 0
    written = json.loads((tmp_path / "statelens" / "preflight.json").read_text())
    assert written["verdict"] == "fail" and written["seconds"] >= 0


def test_off_writes_nothing_and_warn_trains(tmp_path, student_path, math_dataset):
    trainer = grpo_trainer(tmp_path / "off", student_path, math_dataset, constant_reward, preflight="off")
    trainer.train()
    assert trainer.state.global_step == 1
    assert not (tmp_path / "off" / "statelens" / "preflight.json").exists()
    trainer = grpo_trainer(tmp_path / "warn", student_path, math_dataset, constant_reward)
    trainer.train()
    assert trainer.state.global_step == 1
    assert json.loads((tmp_path / "warn" / "statelens" / "preflight.json").read_text())["verdict"] == "fail"


def test_bad_setting_is_refused_before_loading(tmp_path, math_dataset):
    with pytest.raises(ValueError, match="preflight='loud'"):
        StateLensGRPOTrainer(
            model="no/such-model", reward_funcs=constant_reward, train_dataset=math_dataset, preflight="loud"
        )
    with pytest.raises(ValueError, match="preflight_prompts"):
        OnPolicyDistillConfig(output_dir=str(tmp_path), preflight_prompts=0, **CPU)


def test_resumed_run_skips_the_preflight(monkeypatch):
    ran = []
    monkeypatch.setattr(preflight, "run_preflight", lambda trainer: ran.append(trainer))
    callback = PreflightCallback("trainer")
    callback.on_train_begin(None, SimpleNamespace(global_step=5), None)
    assert ran == []
    callback.on_train_begin(None, SimpleNamespace(global_step=0), None)
    assert ran == ["trainer"]


def test_two_ranks_take_the_main_process_verdict(tmp_path, monkeypatch):
    """Rank 1 measures a pass, rank 0 a failure: the broadcast gives both rank 0's, so both refuse under `strict`, and
    only rank 0 writes the file."""
    bad = preflight.Check("student/length_limit_share", 1.0, "fail >= 0.9", "fail", "raise max_completion_length")
    good = preflight.Check("student/length_limit_share", 0.1, "fail >= 0.9", "pass")
    broadcast = {}

    def from_main_process(accelerator, value):
        if accelerator.is_main_process:
            broadcast["value"] = value
        return broadcast["value"]

    monkeypatch.setattr(preflight.collective, "from_main_process", from_main_process)
    refusals = []
    for rank, measured in ((0, bad), (1, good)):
        monkeypatch.setattr(preflight, "measure", lambda trainer, prompts, measured=measured: [measured])
        trainer = SimpleNamespace(
            accelerator=SimpleNamespace(is_main_process=rank == 0, num_processes=2),
            args=SimpleNamespace(output_dir=str(tmp_path / f"rank{rank}")),
        )
        with pytest.raises(PreflightFailed) as refused:
            run_preflight(trainer, mode="strict", prompts=4)
        refusals.append(str(refused.value))
    assert refusals[0] == refusals[1]
    assert (tmp_path / "rank0" / "statelens" / "preflight.json").exists()
    assert not (tmp_path / "rank1" / "statelens").exists()


def test_report_and_states_page_show_the_flagged_checks(tmp_path):
    from trl_statelens.preflight.verdicts import summary, write_summary
    from trl_statelens.reports.preflight import preflight_html, preflight_rows
    from trl_statelens.reports.states_page import PAGE

    failing = preflight.Check("teacher/end_after_answer", 0.1, "warn <= 0.5, fail <= 0.2", "fail", "chat turns")
    write_summary(tmp_path / "run", summary("OnPolicyDistillTrainer", [failing], 1.0, 16))
    runs = [SimpleNamespace(path=tmp_path / "run", label="opd"), SimpleNamespace(path=tmp_path / "none", label="x")]
    assert preflight_rows(runs) == [
        ["opd", "fail", "teacher/end_after_answer", "0.1", failing.threshold, "chat turns"]
    ]
    assert "teacher/end_after_answer" in preflight_html(runs) and "{preflight}" in PAGE
    assert preflight_html(runs[1:]) == ""


def trained(trainer) -> tuple[list[float], dict]:
    """Train, then the logged losses and the final weights."""
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return losses, {name: weight.detach().clone() for name, weight in trainer.model.state_dict().items()}


@pytest.mark.parametrize("recipe", ["opd", "sft"])
def test_training_is_the_same_with_the_preflight_on(tmp_path, recipe, student_path, teacher_path, math_dataset):
    """The preflight samples in a forked random state and leaves the model as it found it: a run with it on has the
    same losses and final weights as the run with it off."""
    runs = {}
    for mode in ("warn", "off"):
        out = tmp_path / mode
        if recipe == "opd":
            trainer = opd_trainer(out, student_path, str(teacher_path), math_dataset, max_steps=2,
                                  max_completion_length=16, preflight=mode, preflight_prompts=4)  # fmt: skip
        else:
            # with dropout, so that SFT's steps read the global random state as OPD's sampling does
            model = AutoModelForCausalLM.from_pretrained(student_path, attention_dropout=0.3)
            data = math_dataset.select_columns(["prompt", "completion"])
            args = SFTConfig(output_dir=str(out), per_device_train_batch_size=4, max_steps=2, **CPU)
            trainer = StateLensSFTTrainer(model=model, args=args, train_dataset=data, preflight=mode)
        runs[mode] = trained(trainer)
        assert (out / "statelens" / "preflight.json").exists() == (mode == "warn")
    (losses_on, weights_on), (losses_off, weights_off) = runs["warn"], runs["off"]
    assert len(losses_on) == 2 and losses_on == losses_off
    assert all(torch.equal(weights_on[name], weights_off[name]) for name in weights_off)
