"""Loading and reaching teachers: from paths, hub ids, LoRA folders and server URLs, as TRL's trainers load theirs."""

from __future__ import annotations

from contextlib import contextmanager

from transformers import PreTrainedModel
from transformers.utils.peft_utils import find_adapter_config_file
from trl.trainer.utils import create_model_from_path

from .server_client import TeacherServerClient
from .vocabulary import read_tokenizer, vocab_size


def load_teachers(teacher_models: dict, args) -> dict[str, tuple]:
    """`(model, path, url)` for each named teacher of [`OnPolicyDistillTrainer`]'s `teacher_model` dict: a string
    starting with `http://` or `https://` is a vLLM server's URL (nothing loaded), another string a path, hub id or
    LoRA folder loaded with [`load_teacher`], anything else a model instance."""
    if not teacher_models:
        raise ValueError(
            "teacher_model is an empty dict: give at least one teacher, name -> model, path or server URL"
        )
    loaded = {}
    for name, teacher in teacher_models.items():
        if isinstance(teacher, str) and teacher.startswith(("http://", "https://")):
            try:  # the settings a served teacher needs, checked in the config only for teacher_model_server_url
                args._check_teacher_server_settings()
            except ValueError as error:
                raise ValueError(f"teacher {name!r} is served at {teacher}: {error}") from error
            loaded[name] = (None, None, teacher)
        elif isinstance(teacher, str):
            loaded[name] = (load_teacher(teacher, args), teacher, None)
        else:
            loaded[name] = (teacher, None, None)
    return loaded


def load_teacher(name_or_path: str, args) -> PreTrainedModel:
    """Load a teacher given by path or hub id as TRL's trainers load theirs, for inference.

    `args.teacher_model_init_kwargs` go to `from_pretrained`; the dtype defaults to `"auto"` (a bf16 checkpoint
    stays bf16, as in TRL's `DistillationTrainer`) and, under multi-GPU DDP or DeepSpeed, `device_map` is `None` (as
    TRL's GRPO/Distillation trainers set it: ZeRO-3 rejects a device map and "auto" would put every rank's copy on
    the first GPU). A PEFT adapter folder (`adapter_config.json` plus adapter weights, what a LoRA SFT run saves)
    is loaded as its base model plus the adapter, merged: the teacher only runs inference.

    `args` is an [`OnPolicyDistillConfig`] or TRL's `DistillationConfig` (the recipes' stock arm loads its teacher
    here too, so both arms accept the same teacher folders).
    """
    kwargs = dict(args.teacher_model_init_kwargs or {})
    kwargs.setdefault("dtype", "auto")
    kwargs.setdefault("use_safetensors", True)  # no pickle files: weights only
    if args.distributed_state.distributed_type in ("MULTI_GPU", "DEEPSPEED"):
        kwargs["device_map"] = None
    kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    if find_adapter_config_file(name_or_path, revision=kwargs.get("revision")) is None:
        return create_model_from_path(name_or_path, **kwargs)
    from peft import PeftConfig, PeftModel

    revision = kwargs.pop("revision", None)  # the adapter's revision; its base model's is in adapter_config.json
    adapter = PeftConfig.from_pretrained(name_or_path, revision=revision)
    if adapter.revision is not None:
        kwargs["revision"] = adapter.revision
    # Under ZeRO-3, from_pretrained would partition the base as it loads, and PEFT would add the adapter's delta to
    # the empty shards: load and merge a whole model on each process; preparing the teacher partitions it after.
    with without_zero3_init():
        base = create_model_from_path(adapter.base_model_name_or_path, **kwargs)
        return PeftModel.from_pretrained(base, name_or_path, revision=revision).merge_and_unload()


@contextmanager
def without_zero3_init():
    """Load whole models, not ZeRO-3 partitions, even inside a ZeRO-3 run.

    Under ZeRO-3, `from_pretrained` partitions the weights across processes as it loads them (`zero.Init`, set up by
    `TrainingArguments` whatever accelerate's `zero3_init_flag` says, so accelerate's
    `zero3_init_context_manager(enable=False)` changes nothing then), a collective call: done by the main process
    alone (evaluation) it would wait forever for the others, and a LoRA adapter cannot be merged into empty shards.
    """
    from transformers.integrations import deepspeed

    saved = deepspeed._hf_deepspeed_config_weak_ref
    deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        deepspeed._hf_deepspeed_config_weak_ref = saved


def connect_served_teacher(url: str, student, student_tokenizer, path: str | None, args, top_k: int):
    """A [`TeacherServerClient`] at `url`, checked before any training work: reachable, serving a model with the student's
    vocabulary (and, when `path` names the teacher, the student's tokenizer), answering `top_k` log-probs per
    position. `args` (an [`OnPolicyDistillConfig`]) gives the `teacher_server_*` settings. The recipes' stock arm
    checks its server here too, since TRL's `ServerDistillationTrainer` checks none of this."""
    teacher_tokenizer = read_tokenizer(path)  # without one, the served vocabulary size is checked all the same
    student_vocab = vocab_size(student)
    if top_k > student_vocab:
        raise ValueError(
            f"teacher_top_k={top_k} is more than the student's vocabulary ({student_vocab} ids): set it to at most "
            f"{student_vocab} (that many is the exact divergence)"
        )
    return TeacherServerClient(
        url,
        student_tokenizer,
        student_vocab,
        teacher_tokenizer=teacher_tokenizer,
        timeout=args.teacher_server_timeout,
        max_retries=args.teacher_server_max_retries,
        retry_backoff=args.teacher_server_retry_backoff,
        chunk_size=args.teacher_server_chunk_size,
        top_k=top_k,
    )
