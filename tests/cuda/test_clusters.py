"""On a GPU: launch_function's children use CUDA under nccl (the stop flag over a gloo side group, agreed
a step late), it refuses once the caller has initialised CUDA, and deterministic=True sets cuBLAS's
workspace. Each in a fresh interpreter: CUDA initialised in this pytest process would make later forks fail.
(Seen passing on one H200, torch 2.11.0+cu130, 2026-12-04, as a script of the same checks.)"""

from __future__ import annotations

import json

import pytest

from tests.launching import run_python_stdin

pytestmark = [pytest.mark.cuda, pytest.mark.multiprocess]  # both start processes (launch_function)

_CHILDREN_ON_THE_GPU = """
import json, os, signal
import torch
import torch.distributed as dist
import multigpu
from multigpu.session import Session

def train():
    with Session(strategy="ddp", deterministic=True) as session:
        model = session.setup_model(torch.nn.Linear(4, 2))
        with session.micro_step(model):
            session.backward(model(torch.randn(8, 4, device=session.device)).square().mean())
        reads = [session.should_stop]
        os.kill(os.getpid(), signal.SIGUSR1)
        reads += [session.should_stop, session.should_stop]  # the agreement in flight predates the signal
        return [str(session.device), dist.get_backend(), reads, os.environ.get("CUBLAS_WORKSPACE_CONFIG")]

print(json.dumps(multigpu.launch_function(train, nproc_per_node=1)))
"""

_REFUSED = """
import torch, multigpu
torch.zeros(1, device="cuda")
try:
    multigpu.launch_function(print, nproc_per_node=1)
except multigpu.LaunchError as exc:
    print("refused:", exc)
"""


def test_children_train_on_the_gpu_and_agree_to_stop_a_step_late() -> None:
    done = run_python_stdin(_CHILDREN_ON_THE_GPU, timeout_s=180)
    assert done.returncode == 0, done.stderr[-3000:]
    device, backend, reads, workspace = json.loads(done.stdout.strip().splitlines()[-1])
    assert (device, backend, reads, workspace) == ("cuda:0", "nccl", [False, False, True], ":4096:8")


def test_launch_function_refuses_once_cuda_is_initialised() -> None:
    done = run_python_stdin(_REFUSED, timeout_s=120)
    assert "refused: cuda is already initialised in this process" in done.stdout, done.stderr[-2000:]
    assert "restart the kernel" in done.stdout
