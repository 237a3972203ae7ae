"""Where a [`SelfTeacher`]'s weights come from, behind one small interface ([`TeacherWeights`]):

- [`SharedStudent`]: the student module itself, read without gradient (`"live"`; a PEFT student's `"base"`, with its
  adapter disabled for the teacher's calls);
- [`CopiedWeights`]: a frozen copy of a full-weight student, made before any step (`"base"`), and
  [`AveragedCopy`], that copy moved toward the student after every optimizer step (`"ema"`);
- [`AdapterAverage`]: a PEFT student's `"ema"`, an average of its trained (adapter) parameters only, swapped into the
  student module for the teacher's calls (the base is shared and frozen).

The two averages keep their update, save and load in `update_average`, `save` and `load`. Each is kept in fp32
whatever the weights' dtype, and cast into the teacher's (16-bit) weights after each update, or into the adapter's
dtype for each call: a 16-bit average rounds each small step away (20 updates at rate 0.05 toward a student 1% away
move a bf16 average not at all). Neither can be combined with FSDP's DTensor shards: `"ema"` is refused under FSDP.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager, nullcontext
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor
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

    def output_layer(self, model) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The teacher's output layer `(weight, bias)`, read inside `applied()`, for use after it (the divergence
        kernel projects the student outside it, and recomputes both projections in its backward): the parameters
        themselves (ZeRO-3 gathers them), which here stay the teacher's after `applied()` ends."""
        head = model.get_output_embeddings()
        return head.weight, head.bias

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
        if is_zero3(trainer):
            raise ValueError(
                "teacher_model_kind='ema' with a PEFT student under DeepSpeed ZeRO-3: the averaged adapter is "
                "swapped into the student module for the teacher's calls, which needs the adapter whole, and "
                "ZeRO-3 partitions it. Use ZeRO-2 (an adapter is small: partitioning it saves little), or "
                "teacher_model_kind='base' (adapter disabled) or 'live'"
            )
        super().__init__(trainer)
        # The base is frozen, so it is the same for student and teacher and is not copied
        self._trained = [(name, p) for name, p in self.model.named_parameters() if p.requires_grad]
        # name -> fp32 averaged tensor: DeepSpeed with bf16/fp16 casts the adapter in place when it prepares the
        # student, after this
        self.average = {name: p.detach().to(torch.float32, copy=True) for name, p in self._trained}

    @contextmanager
    def applied(self):
        """The averaged adapter in the student's parameters for the duration, the student's own back after.

        `param.data` is re-pointed at the average (itself when the adapter is fp32; cast to the adapter's dtype and
        device when DeepSpeed holds it in 16 bits or moved it) rather than written in place: in the `divergence` loss
        the teacher runs while the student's graph is alive, and an in-place write would bump the parameters' version
        counters and fail its backward. The student's tensors are back before that backward runs."""
        own = {name: param.data for name, param in self._trained}
        for name, param in self._trained:
            param.data = self.average[name].to(param.device, param.dtype)
        try:
            yield
        finally:
            for name, param in self._trained:
                param.data = own[name]

    def output_layer(self, model):
        """As [`TeacherWeights.output_layer`], but a trained output layer's (`modules_to_save`) parameters get the
        student's tensors back when `applied()` ends: their averaged tensors (detached, no copy) instead, so the
        divergence kernel's backward recomputes the teacher's logits from the average it ran with."""
        return tuple(None if t is None else t.detach() for t in super().output_layer(model))

    @torch.no_grad()
    def update_average(self, rate: float) -> None:
        """`average <- (1 - rate) * average + rate * adapter` in fp32, after an optimizer step (every process holds its
        own)."""
        for name, param in self._trained:
            # On the adapter's device: DeepSpeed moves the student there after the average was made
            average = self.average[name] = self.average[name].to(param.device)
            average.lerp_(param.detach().to(average.dtype), rate)

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
        self.trainer, self.zero3 = trainer, is_zero3(trainer)
        self.model = prepare_teacher_model(trainer, _student_copy(trainer, student_path))


class AveragedCopy(CopiedWeights):
    """The copy of [`CopiedWeights`], moved toward the student after every optimizer step (`"ema"`). The average is
    kept in fp32: a weight the teacher holds in 32 bits is its own average; one it holds in 16 bits has an fp32
    master here, cast into it after each update.

    Under ZeRO-3 each process keeps the fp32 average of its own partition of each parameter, updated from the
    student's partition of the same parameter (ZeRO-3 lays the two out alike): nothing is gathered, and each process
    holds its share of one fp32 copy of the model. Refused with hpZ or NVMe parameter offload, which keep the
    teacher's partitions elsewhere, MiCS, which cuts them per shard group, and ZeRO++ quantized frozen weights, which
    stores them quantized (`_refuse_unaligned_partitions`). With CPU parameter offload the partitions are in host
    memory, and are gathered on the process's GPU to be saved."""

    def __init__(self, trainer, student_path: str | None):
        self.trainer, self.zero3 = trainer, is_zero3(trainer)
        if self.zero3:
            _refuse_unaligned_partitions(trainer.accelerator.state.deepspeed_plugin)
        teacher = _student_copy(trainer, student_path)
        # The average's fp32 starting point, taken before the copy is prepared (DeepSpeed with bf16/fp16 casts every
        # parameter in place then): the copy's own tensors where they already are fp32. Under ZeRO-3 the copy is
        # loaded partitioned: each process starts from its partitions as loaded
        start = {} if self.zero3 else {name: p.detach().float() for name, p in teacher.named_parameters()}
        self.model = prepare_teacher_model(trainer, teacher)
        self.master = {}  # name -> fp32 average of a weight the teacher holds in 16 bits (its ZeRO-3 partition)
        for name, weight in self._named_parameters():
            if weight.dtype in (torch.float16, torch.bfloat16):
                local = _local(weight)
                self.master[name] = start.get(name, local).to(local.device, torch.float32)

    @torch.no_grad()
    def update_average(self, rate: float) -> None:
        """`average <- (1 - rate) * average + rate * student` in fp32, after an optimizer step (on every process: each
        holds its own copy, or under ZeRO-3 its partitions of it, updated from the student's partitions of the same
        parameters), then cast into the teacher's weights."""
        # The copy holds the student's parameters under the same names (tied ones once)
        student = dict(self.trainer.accelerator.unwrap_model(self.trainer.model).named_parameters())
        for name, weight, average in self._averages():
            average.lerp_(_local(student[name]).detach().to(average.dtype), rate)
            self._cast_into(weight, average)

    def save(self, output_dir):
        """The fp32 average, whole (so a resumed run continues it exactly)."""
        should_save = self.trainer.args.should_save  # every process holds the same average: one writes it
        weights = {}
        for name, weight, average in self._averages():
            if self.zero3:  # the processes' partitions, gathered (a collective: every process joins)
                average = _gathered(self.trainer.accelerator, average)[: weight.ds_numel].view(weight.ds_shape)
            if should_save:
                weights[name] = average.detach().to("cpu", copy=True).contiguous()
        if should_save:
            save_file(weights, str(Path(output_dir) / EMA_FILE))

    def load(self, checkpoint):
        # Each process reads the average into its own (under ZeRO-3, its partition of each tensor), then the weights
        with safe_open(str(_saved_average(checkpoint)), framework="pt") as tensors, torch.no_grad():
            for name, weight, average in self._averages():
                saved = tensors.get_tensor(name)
                if self.zero3:
                    saved = _partition(saved, average.numel(), self.trainer.accelerator.process_index)
                average.copy_(saved)
                self._cast_into(weight, average)

    def _named_parameters(self):
        return list(self.trainer.accelerator.unwrap_model(self.model).named_parameters())

    def _averages(self):
        """`(name, weight, average)` for each teacher parameter: its fp32 average (of this process's partition under
        ZeRO-3), the parameter's own (partition) where it is fp32."""
        return [(name, weight, self.master.get(name, _local(weight))) for name, weight in self._named_parameters()]

    def _cast_into(self, weight, average) -> None:
        """`average` into the teacher's `weight` (this process's partition of it under ZeRO-3), in its dtype."""
        local = _local(weight)
        if average is not local:
            local.copy_(average)
        if self.zero3:
            from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

            # A small parameter stays gathered between forwards (ZeRO-3's persistence threshold): drop the whole copy
            # of the old values, so the next forward gathers the new partitions
            if weight.ds_status == ZeroParamStatus.AVAILABLE:
                weight.partition()


class MovingAverage(TrainerCallback):
    """After every optimizer step, the average moves toward the student by `rate` (`weights.update_average`)."""

    def __init__(self, weights: AdapterAverage | AveragedCopy, rate: float):
        self.weights, self.rate = weights, rate

    def on_step_end(self, args, state, control, **kwargs):
        self.weights.update_average(self.rate)


def is_zero3(trainer) -> bool:
    """Whether `trainer` runs under DeepSpeed ZeRO-3 (its parameters partitioned over the processes)."""
    return trainer.is_deepspeed_enabled and trainer.accelerator.state.deepspeed_plugin.zero_stage == 3


def refuse_average_under_fsdp(trainer) -> None:
    """`"ema"` (of a copy, or of a PEFT student's adapter) under FSDP, refused before anything is copied. accelerate's
    FSDP shards the student in `train()`, after the average is made: a copy's average would meet the student's
    DTensor shards (a crash after the first step), and the adapter tensors an adapter average swaps in are replaced by
    new DTensor parameters (it would silently teach as the live student). A student whose trained parameters are
    already DTensors (`fully_shard`) likewise; a LoRA adapter on a base sharded at load is plain tensors, and is
    averaged as under DDP."""
    trained = [p for p in trainer.model.parameters() if p.requires_grad]
    if trainer.is_fsdp_enabled or any(isinstance(p, DTensor) for p in trained):
        raise ValueError(
            "teacher_model_kind='ema' under FSDP is not supported: FSDP shards the student's parameters into "
            "DTensors, and the average (of a copy made unsharded, or of the adapter swapped into the student) "
            "cannot be combined with the shards. Use DDP or DeepSpeed (ZeRO-2 for a PEFT student) for an EMA "
            "teacher"
        )


def refuse_copying_sharded(student, kind: str) -> None:
    """A `"base"`/`"ema"` self teacher of a full-weight student is a copy of it, and FSDP2's modules refuse
    `copy.deepcopy` (with a bare assertion): refuse a student whose parameters are already DTensors. accelerate's
    FSDP2 shards the student later, in `train()`, after the copy is made."""
    if any(isinstance(p, DTensor) for p in student.parameters()):
        raise ValueError(
            f"teacher_model_kind={kind!r} with a student already sharded by FSDP2 (its parameters are DTensors, as "
            "`from_pretrained(distributed_config=...)` or `fully_shard` leave them): this teacher is a copy of the "
            "student, and an FSDP2 module cannot be copied. Use teacher_model_kind='live' (the student itself, no "
            "copy); a LoRA student (peft_config), whose 'base' teacher is its adapter disabled and whose 'ema' "
            "averages its adapter (no copy); or, for 'base', the student given unsharded, which accelerate's FSDP2 "
            "(recipes/accelerate/fsdp2.yaml) shards after the copy is made"
        )


def _student_copy(trainer, student_path: str | None) -> PreTrainedModel:
    """A copy of the full-weight student, not yet prepared. Under DeepSpeed ZeRO-3 the student is partitioned before
    this is made, so a deep copy would hold empty shards: the copy is loaded again from the student's path."""
    if is_zero3(trainer):
        if student_path is None:
            raise ValueError(
                f"teacher_model_kind={trainer.args.teacher_model_kind!r} under DeepSpeed ZeRO-3 with a student given "
                "as a model instance: the student is already partitioned across processes, so the teacher's copy is "
                "loaded again from the student's path, and an instance has none. Pass the student as a path or hub "
                "id (model='path/to/model'), or use teacher_model_kind='live' (no copy)"
            )
        return _load_like_student(student_path, trainer.args)
    teacher = copy.deepcopy(trainer.model)
    # GRPO patched the student's forward with its fused LM head, a closure over the student's own forward: the copy
    # would call the student's. Drop it; `prepare_teacher_model` adds the head to the copy itself.
    teacher.__dict__.pop("forward", None)
    # Likewise `cast_lm_head_to_fp32` gave the student's head a forward reading the student's head weight (a deep copy
    # keeps functions as they are): the copy's head projects in fp32 with its own weight
    head = teacher.get_output_embeddings()
    if "forward" in vars(head):
        head.forward = partial(_fp32_projection, head)
    return teacher


def _local(param: torch.Tensor) -> torch.Tensor:
    """The part of `param` this process holds: its ZeRO-3 partition (flat), or the parameter itself."""
    return param.ds_tensor if hasattr(param, "ds_tensor") else param


def _gathered(accelerator, tensor: torch.Tensor) -> torch.Tensor:
    """Every process's `tensor` (its ZeRO-3 partition) concatenated, on `tensor`'s device. Gathered on the
    accelerator's device: with CPU parameter offload the partitions live in host memory, and NCCL gathers only
    tensors on the process's GPU (accelerate's `gather` allocates its output there)."""
    return accelerator.gather(tensor.to(accelerator.device)).to(tensor.device)


def _partition(tensor: torch.Tensor, size: int, rank: int) -> torch.Tensor:
    """Process `rank`'s ZeRO-3 partition of `tensor`: its `size` elements of the flattened tensor, the last one padded
    at the end (ZeRO-3 splits a parameter evenly across the processes)."""
    part = tensor.flatten()[rank * size : (rank + 1) * size]
    return torch.cat([part, part.new_zeros(size - part.numel())])


def _refuse_unaligned_partitions(plugin) -> None:
    """A full-weight EMA under ZeRO-3 is updated in each process's partitions of the student and the teacher: refuse
    the settings that keep the teacher's partitions elsewhere."""
    zero = plugin.deepspeed_config.get("zero_optimization", {})
    if zero.get("zero_hpz_partition_size", 1) > 1 or (zero.get("offload_param") or {}).get("device") == "nvme":
        raise ValueError(
            "teacher_model_kind='ema' under DeepSpeed ZeRO-3 with hpZ (zero_hpz_partition_size > 1) or NVMe parameter "
            "offload is not supported: the average is written into each process's partition of the teacher, and hpZ "
            "keeps a second copy of a frozen model's partitions that would not follow (NVMe offload swaps them out). "
            "Turn these off, or use teacher_model_kind='base' or 'live'"
        )
    # (DeepSpeed 0.19.8 refuses `mics_shard_size` itself, as removed; refused here too, with the reason)
    mics = zero.get("mics_shard_size", -1)
    settings = {
        f"MiCS (mics_shard_size={mics})": isinstance(mics, int) and mics > 0,
        "ZeRO++ zero_quantized_nontrainable_weights": zero.get("zero_quantized_nontrainable_weights", False),
    }
    unsupported = [name for name, on in settings.items() if on]
    if unsupported:
        raise ValueError(
            f"teacher_model_kind='ema' under DeepSpeed ZeRO-3 with {' and '.join(unsupported)} is not supported: the "
            "average is kept per process for its partition of each parameter, saved gathered over all processes and "
            "read back by process index. MiCS cuts the partitions within shard groups (a resume would read another "
            "group's slice, or zeros), and quantized frozen weights store the teacher copy's partitions as quantized "
            "codes (the average would run on them). Turn this off, or use teacher_model_kind='base' or 'live'"
        )


def _fp32_projection(head, hidden_states: torch.Tensor) -> torch.Tensor:
    """`head`'s projection in fp32 (what GRPO's `cast_lm_head_to_fp32` makes an LM head compute)."""
    bias = None if head.bias is None else head.bias.float()
    return F.linear(hidden_states.float(), head.weight.float(), bias)


def _saved_average(checkpoint: str) -> Path:
    path = Path(checkpoint) / EMA_FILE
    if not path.is_file():
        raise ValueError(
            f"{path} not found: {checkpoint} holds no EMA teacher, so this run cannot resume the one it averaged. "
            "A checkpoint of a run without teacher_model_kind='ema' holds none, and neither does one saved with "
            "save_only_model=True (which skips it; the config now refuses that with 'ema'). Resume from a full "
            "checkpoint of an 'ema' run, or start the run again"
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
