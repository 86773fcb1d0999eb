"""A DataParallel inside another one: must give one device's numbers and never hang.

Each test has a timeout: before the replica threads had an owner, these deadlocked (the inner
step's replicas waited for workers of a shared pool that the outer step's replicas occupied).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import multigpu
from multigpu.errors import ConfigError
from tests.models import assert_same_grads, mlp

pytestmark = pytest.mark.timeout(60, method="thread")  # a hang ends the run with a stack dump


class Student(nn.Module):
    """Distillation: the student adds a frozen teacher's outputs, computed in its own forward."""

    def __init__(self, teacher: nn.Module) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 3)
        self.teacher = teacher

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            soft = self.teacher(x)
        return self.lin(x) + soft.softmax(-1)


@pytest.mark.parametrize(("outer", "inner"), [(2, 2), (3, 4), (4, 2)])
@pytest.mark.parametrize("parallel_backward", [True, False])
def test_a_teacher_data_parallel_called_in_the_students_forward(
    outer: int, inner: int, parallel_backward: bool
) -> None:
    teacher = mlp()
    student = Student(multigpu.DataParallel(teacher, devices=f"cpu:{inner}"))
    ref = Student(mlp())
    ref.load_state_dict(student.state_dict())
    model = multigpu.DataParallel(student, devices=f"cpu:{outer}", parallel_backward=parallel_backward)
    for _ in range(3):  # repeated steps reuse the threads
        x = torch.randn(13, 8)
        out, want = model(x), ref(x)
        torch.testing.assert_close(out, want)
        out.sum().backward()
        want.sum().backward()
    assert_same_grads(student, ref)


@pytest.mark.parametrize("parallel_backward", [True, False])
def test_a_data_parallel_nested_inside_a_wrapped_model(parallel_backward: bool) -> None:
    body = mlp(16, 4)
    net = nn.Sequential(multigpu.DataParallel(body, devices="cpu:3", parallel_backward=parallel_backward), nn.Tanh())
    ref = nn.Sequential(mlp(16, 4), nn.Tanh())
    ref.load_state_dict(net.state_dict())
    model = multigpu.DataParallel(net, devices="cpu:2", parallel_backward=parallel_backward)
    x = torch.randn(9, 8)
    out, want = model(x), ref(x)
    torch.testing.assert_close(out, want)
    out.pow(2).sum().backward()
    want.pow(2).sum().backward()
    assert_same_grads(net, ref)


@pytest.mark.parametrize(
    "wrapped",
    [lambda: multigpu.DataParallel(mlp(), devices="cpu:2"), lambda: nn.DataParallel(mlp())],
    ids=["multigpu", "torch"],
)
def test_wrapping_a_wrapper_is_refused_with_the_fix(wrapped: object) -> None:
    with pytest.raises(ConfigError, match=r"module is already a DataParallel.*DataParallel\(model.module, \.\.\.\)"):
        multigpu.DataParallel(wrapped(), devices="cpu:2")  # type: ignore[operator]


def test_session_dp_on_a_model_that_is_already_a_data_parallel() -> None:
    with multigpu.Session(strategy="dp", devices="cpu:2") as session:
        with pytest.raises(ConfigError, match=r"module is already a DataParallel"):
            session.setup_model(multigpu.DataParallel(mlp(), devices="cpu:2"))
        model = session.setup_model(mlp())  # the bare model works as before
        assert model(torch.randn(4, 8)).shape == (4, 3)
