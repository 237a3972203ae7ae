"""Minimal reproduction (torch 2.13 CPU, Python 3.11, gloo): a process whose gloo collective completes while the
interpreter is shutting down aborts with "terminate called without an active exception" (SIGABRT, exit code -6).

    torchrun --nproc_per_node 2 tests/scripts/gloo_exit_abort.py            # a rank aborted in 15 of 40 runs here
    torchrun --nproc_per_node 2 tests/scripts/gloo_exit_abort.py --destroy  # 0 of 30

The collective's tensor is then referenced only from gloo's worker thread. When that thread drops it, it needs the
GIL to free the tensor's Python object; a thread asking for the GIL while Python finalizes is ended with
`pthread_exit`, whose unwinding through C++ code ends in `std::terminate`. Destroying the process group before the
script ends (`torch.distributed.destroy_process_group()`, which `Trainer.end()` / `Accelerator.end_training()` call)
waits for pending work and joins gloo's threads while Python is alive. The rank that joins the collective late and
the slow teardown only widen the window that a normal training script hits by chance (once in CI, 2026-11-30).
Not run by the tests (it aborts on purpose, and only sometimes).
"""

import sys
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
if rank == 1:
    time.sleep(1.0)  # joins the collective late: rank 0 is already shutting down by then
x = torch.ones(1000)
work = dist.all_reduce(x, async_op=True)
del x, work  # only gloo's worker thread holds the tensor (and its Python object) now


class SlowTeardown:
    """Keeps the interpreter finalizing (its modules are being torn down) while the collective completes."""

    def __del__(self, sleep=time.sleep):
        sleep(2.0)


if rank == 0:
    keep = SlowTeardown()
if "--destroy" in sys.argv:
    dist.destroy_process_group()
