"""Where a [`SelfTeacher`]'s weights come from, behind one small interface ([`TeacherWeights`]):

- [`SharedStudent`]: the student module itself, read without gradient (`"live"`; a PEFT student's `"base"`, with its
  adapter disabled for the teacher's calls);
- [`CopiedWeights`]: a frozen copy of a full-weight student, made before any step (`"base"`), and
  [`AveragedCopy`], that copy moved toward the student after every optimizer step (`"ema"`);
- [`AdapterAverage`]: a PEFT student's `"ema"`, an average of its trained (adapter) parameters only, swapped into the
  student module for the teacher's calls (the base is shared and frozen).

The two averages keep their update, save and load in `update_average`, `save` and `load`.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import PreTrainedModel, TrainerCallback
from trl.trainer.utils import create_model_from_path

from .in_process import prepare_teacher_model

EMA_FILE = "statelens_ema_teacher.safetensors"  # in each checkpoint of an `"ema"` self teacher's run


class TeacherWeights:
    """A self teacher's weights: `model`, the module its forwards run; `generation_model`, the one its generation
    unwraps; `applied()`, the teacher's weights in place for the duration of one call. An average also moves after
    every optimizer step (`update_average`) and travels with each checkpoint (`save`, `load`)."""

    model = None

    @property
    def generation_model(self):
        return self.model

    def applied(self):
        return nullcontext()

    def save(self, output_dir: str) -> None:
        """Nothing to save: these weights are the student's, or a frozen copy made again at every start."""

    def load(self, checkpoint: str) -> None:
        """Nothing to load (see `save`)."""


class SharedStudent(TeacherWeights):
    """No copy: the teacher is the student module (the one every wrapper holds), read without gradient; with
    `adapter_off`, a PEFT student's base model (its adapter disabled for the call)."""

    def __init__(self, trainer, adapter_off: bool = False):
        self.trainer, self.model, self.adapter_off = trainer, trainer.model, adapter_off

    @property
    def generation_model(self):
        # The student as the trainer wrapped it (DDP, DeepSpeed engine, which under ZeRO-3 gathers the student's
        # shards): what GRPO itself generates with
        return self.trainer.model_wrapped

    def applied(self):
        if self.adapter_off:
            return self.trainer.accelerator.unwrap_model(self.model).disable_adapter()
        return nullcontext()


class AdapterAverage(SharedStudent):
    """A PEFT student's `"ema"`: one averaged copy of the parameters the optimizer trains (the adapter, and any
    `modules_to_save` copies), swapped into the student module for the teacher's calls. Refused under ZeRO-3, which
    partitions the adapter: the swap needs it whole."""

    def __init__(self, trainer):
        if _zero3(trainer):
            raise ValueError(
                "teacher_model_kind='ema' with a PEFT student under DeepSpeed ZeRO-3: the averaged adapter is "
                "swapped into the student module for the teacher's calls, which needs the adapter whole, and "
                "ZeRO-3 partitions it. Use ZeRO-2 (an adapter is small: partitioning it saves little), or "
                "teacher_model_kind='base' (adapter disabled) or 'live'"
            )
        super().__init__(trainer)
        # The base is frozen, so it is the same for student and teacher and is not copied
        self._trained = [(name, p) for name, p in self.model.named_parameters() if p.requires_grad]
        self.average = {name: p.detach().clone() for name, p in self._trained}  # name -> averaged tensor

    @contextmanager
    def applied(self):
        """The averaged adapter in the student's parameters for the duration, the student's own back after.

        The tensors are exchanged (`param.data` re-pointed, nothing copied, so no second adapter copy is made) rather
        than written in place: in the `divergence` loss the teacher runs while the student's graph is alive, and an
        in-place write would bump the parameters' version counters and fail its backward. The student's values are
        back before that backward runs."""
        average = self.average
        with torch.no_grad():
            for name, param in self._trained:
                param.data, average[name] = average[name], param.data
        try:
            yield
        finally:
            with torch.no_grad():
                for name, param in self._trained:
                    param.data, average[name] = average[name], param.data

    @torch.no_grad()
    def update_average(self, rate: float) -> None:
        """`average <- (1 - rate) * average + rate * adapter`, after an optimizer step (every process holds its own)."""
        for name, param in self._trained:
            self.average[name].lerp_(param.detach(), rate)

    def save(self, output_dir):
        if self.trainer.args.should_save:  # every process holds the same average: one writes it
            weights = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in self.average.items()}
            save_file(weights, str(Path(output_dir) / EMA_FILE))

    def load(self, checkpoint):
        with safe_open(str(_saved_average(checkpoint)), framework="pt") as tensors, torch.no_grad():
            for name, average in self.average.items():
                average.copy_(tensors.get_tensor(name))


class CopiedWeights(TeacherWeights):
    """A frozen copy of a full-weight student, made here before any step and prepared as an in-process teacher is.

    Under DeepSpeed ZeRO-3 the student is partitioned before this is made, so a deep copy would hold empty shards:
    the copy is loaded again from the student's path, as the student was (partitioned as it loads, as TRL loads
    GRPO's reference model). A student given as a model instance has no path to load: refused there."""

    def __init__(self, trainer, student_path: str | None):
        self.trainer, self.zero3 = trainer, _zero3(trainer)
        if self.zero3:
            if student_path is None:
                raise ValueError(
                    f"teacher_model_kind={trainer.args.teacher_model_kind!r} under DeepSpeed ZeRO-3 with a student "
                    "given as a model instance: the student is already partitioned across processes, so the "
                    "teacher's copy is loaded again from the student's path, and an instance has none. Pass the "
                    "student as a path or hub id (model='path/to/model'), or use teacher_model_kind='live' (no copy)"
                )
            teacher = _load_like_student(student_path, trainer.args)
        else:
            teacher = copy.deepcopy(trainer.model)
            # GRPO patched the student's forward with its fused LM head, a closure over the student's own forward:
            # the copy would call the student's. Drop it; `prepare_teacher_model` adds the head to the copy itself.
            teacher.__dict__.pop("forward", None)
        self.model = prepare_teacher_model(trainer, teacher)


class AveragedCopy(CopiedWeights):
    """The copy of [`CopiedWeights`], moved toward the student after every optimizer step (`"ema"`); under ZeRO-3 the
    average is taken on gathered parameters, one pair at a time."""

    @torch.no_grad()
    def update_average(self, rate: float) -> None:
        """`teacher <- (1 - rate) * teacher + rate * student`, after an optimizer step (on every process: each holds
        its own copy, or its partitions of it under ZeRO-3)."""
        student = self.trainer.accelerator.unwrap_model(self.trainer.model)
        # The copy holds the student's parameters in the same order (tied ones once)
        pairs = zip(self._named_parameters(), student.named_parameters(), strict=True)
        for (name, averaged), (student_name, current) in pairs:
            assert name == student_name, (name, student_name)
            # Under ZeRO-3, one pair of parameters gathered at a time (never two whole models on a process); the
            # main process's result is broadcast back into every process's partition of the teacher
            with self._gathered(current), self._gathered(averaged, modifier_rank=0):
                if not self.zero3 or self.trainer.accelerator.is_main_process:
                    averaged.lerp_(current.detach().to(averaged.dtype), rate)

    def save(self, output_dir):
        should_save = self.trainer.args.should_save  # every process holds the same average: one writes it
        weights = {}
        for name, param in self._named_parameters():
            with self._gathered(param):  # collective under ZeRO-3: every process joins, one keeps the whole tensor
                if should_save:
                    weights[name] = param.detach().to("cpu", copy=True).contiguous()
        if should_save:
            save_file(weights, str(Path(output_dir) / EMA_FILE))

    def load(self, checkpoint):
        path = _saved_average(checkpoint)
        # Under ZeRO-3 the main process reads each tensor into the gathered parameter and it is broadcast into every
        # process's partition; otherwise each process reads it into its own copy
        reads = not self.zero3 or self.trainer.accelerator.is_main_process
        saved = safe_open(str(path), framework="pt") if reads else nullcontext()
        with saved as tensors, torch.no_grad():
            for name, param in self._named_parameters():
                with self._gathered(param, modifier_rank=0):
                    if reads:
                        param.copy_(tensors.get_tensor(name))

    def _named_parameters(self):
        return list(self.trainer.accelerator.unwrap_model(self.model).named_parameters())

    def _gathered(self, param, modifier_rank=None):
        """`param` whole on every process for the duration under ZeRO-3 (a collective); nothing otherwise."""
        if not self.zero3:
            return nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters([param], modifier_rank=modifier_rank)


class MovingAverage(TrainerCallback):
    """After every optimizer step, the average moves toward the student by `rate` (`weights.update_average`)."""

    def __init__(self, weights: AdapterAverage | AveragedCopy, rate: float):
        self.weights, self.rate = weights, rate

    def on_step_end(self, args, state, control, **kwargs):
        self.weights.update_average(self.rate)


def _zero3(trainer) -> bool:
    return trainer.is_deepspeed_enabled and trainer.accelerator.state.deepspeed_plugin.zero_stage == 3


def _saved_average(checkpoint: str) -> Path:
    path = Path(checkpoint) / EMA_FILE
    if not path.is_file():
        raise ValueError(
            f"{path} not found: {checkpoint} holds no EMA teacher, so this run cannot resume the one it averaged "
            "(a checkpoint from a run without teacher_model_kind='ema'?)"
        )
    return path


def _load_like_student(path: str, args) -> PreTrainedModel:
    """The student's weights loaded again from `path` with the student's own settings (`args.model_init_kwargs`, as
    GRPO loaded it), for a self teacher's copy under ZeRO-3. Loaded inside the run's ZeRO-3 init, as TRL loads GRPO's
    reference model: partitioned as it loads (a collective; every process builds the trainer), so no process ever
    holds a whole second model."""
    kwargs = dict(args.model_init_kwargs or {})
    kwargs["device_map"] = None  # ZeRO-3 rejects a device map
    kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    return create_model_from_path(path, **kwargs)
