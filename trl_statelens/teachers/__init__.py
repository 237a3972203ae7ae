"""The teacher of on-policy distillation, behind one interface whatever runs it.

[`OnPolicyDistillTrainer`] asks its teacher for three things, and calls nothing else (the interface, [`Teacher`], and
what it answers with are in `base.py`):

- `generate(prompts, max_new_tokens, prefixes)`: the teacher's own tokens after each prompt (and student prefix),
  for the `teacher` state source and the `continuation` signal;
- `score(prompts, completions, distribution)`: start scoring a batch's rows, the teacher's log-prob of each
  completion token and, with `distribution`, its next-token distribution at each completion position where it
  gives one ahead of the loss; the answer may come later ([`TeacherRow`], read with [`resolve_rows`]);
- `divergence_loss(...)`: the `divergence` loss between the student's next-token distributions and its own;

and, around those, `prompts(student_prompts, rows)`: the prompt it reads for each row (the student's, unless it is
shown more), which the trainer then passes to the three methods above; `save_state`/`load_state` with each checkpoint.

Its vocabulary and tokenizer are checked against the student's when it is made (`vocabulary.py`). The kinds, each in
its own module:

- [`InProcessTeacher`] (`in_process.py`): a model in the training processes (DDP, DeepSpeed ZeRO-3 and all), scored
  with the trainer's chunked LM-head path; its `divergence_loss` is TRL's exact full-vocabulary generalised JSD;
- [`ServedTeacher`] (`served.py`): a vLLM server reached through [`TeacherServerClient`] (`server_client.py`), whose
  scoring requests can run in the background while the student works (`teacher_server_overlap`); its
  `divergence_loss` uses the teacher's top-k log-probs plus a tail bucket ([`topk_tail_divergence`]);
- [`SelfTeacher`] (`self_teacher.py`): the student itself reading a prompt built from the row's prompt and its
  `privileged_context` (self-distillation with privileged context), with its weights from `self_teacher_weights.py`:
  the student's own (live, or a PEFT student's base), a copy (its weights at the start, or an exponential average),
  or an average of a PEFT student's adapter;
- [`CrossTokenizerTeacher`] (`cross_tokenizer.py`): an in-process teacher of another tokenizer, reading the rows as
  text in its own tokens, its log-probs carried back onto the student's (`byte_vocab.py`, `alignment.py`), the text
  it writes tokenized again for the student, and with `divergence` its distributions where both tokenizations cut;
- [`TeacherRouter`] (`router.py`): several teachers, each row sent to the teacher of its `teacher_id` (in-process and
  served mixed).

`loading.py` loads teachers given by path, hub id or LoRA folder, and reaches served ones.

Every rank calls every method with its own rows, none included: under ZeRO-3 each call that reaches a model (a
forward, a generation, an output layer) is collective, so each rank makes as many as the others, agreed through
`collective.py` and padded with stand-ins (a served teacher is asked for a rank's own rows only). Every method takes prompts and completions apart, and each row is answered on its own: so a router sends
each row to its own teacher, and a self teacher is handed its own prompts in place of the student's.
"""

from .base import ResolvedScores, RowScores, Teacher, TeacherRow, answered, resolve_rows, resolved_signal
from .cross_tokenizer import CrossTokenizerTeacher, teacher_in_process
from .cross_tokenizer_checks import check_before_loading
from .in_process import InProcessTeacher
from .loading import connect_served_teacher, load_teacher, load_teachers, without_zero3_init
from .router import TeacherRouter
from .self_teacher import SelfTeacher
from .served import ServedTeacher
from .served_cross_tokenizer import ServedCrossTokenizerTeacher, served_teacher
from .server_client import TeacherServerClient, TeacherServerError, client_without_local_vllm
from .vocabulary import read_tokenizer

__all__ = [
    "CrossTokenizerTeacher",
    "InProcessTeacher",
    "ResolvedScores",
    "RowScores",
    "SelfTeacher",
    "ServedCrossTokenizerTeacher",
    "ServedTeacher",
    "Teacher",
    "TeacherRouter",
    "TeacherRow",
    "TeacherServerClient",
    "TeacherServerError",
    "answered",
    "check_before_loading",
    "client_without_local_vllm",
    "connect_served_teacher",
    "load_teacher",
    "load_teachers",
    "read_tokenizer",
    "resolve_rows",
    "resolved_signal",
    "served_teacher",
    "teacher_in_process",
    "without_zero3_init",
]
