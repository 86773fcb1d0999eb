"""Fault-tolerant replica groups over two nodes: two ``multigpu launch --fault-tolerant`` on loopback.

Each launcher is one node (``--nnodes 2 --node-rank 0|1``) running 2 groups of 1 worker: node 0's
groups are 0 and 1, node 1's 2 and 3; node 0's launcher starts the lighthouse at ``--lighthouse``,
node 1's connects to it. A group's own rendezvous stays on its node; the groups meet only at the
lighthouse, and a restarted group receives the state from a healthy one (possibly on the other
node) over torchft's HTTP transport. The oracle for the weights: every group holds the same digest
at every committed step (each group's first steps equal one ddp run's: tests/launcher/test_fault_tolerant.py).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from multigpu.errors import ConfigError, LaunchError
from multigpu.launcher.fault_tolerant import free_port, start_lighthouse
from multigpu.launcher.launch import LaunchConfig
from multigpu.runtime import world
from tests.launcher.test_fault_tolerant import PAUSE_S, WORKER, Launch, kill_inside_a_step, records
from tests.launching import alive, descendants, finished_pid, start_python

pytestmark = pytest.mark.multiprocess

GROUPS = 4  # 2 nodes of 2 groups


def launch_nodes(out: Path, steps: int, *, max_restarts: int = 1) -> list[Launch]:
    """Node 0's and node 1's launchers, meeting at a lighthouse on a port free now (node 0 binds it)."""
    lighthouse = f"127.0.0.1:{free_port()}"
    return [node_launch(out, steps, rank, lighthouse, max_restarts=max_restarts) for rank in (0, 1)]


def node_launch(out: Path, steps: int, rank: int, lighthouse: str, *, max_restarts: int = 1) -> Launch:
    return Launch(
        "--strategy", "ddp", "--fault-tolerant", "--replicas", "2", "--nproc-per-node", "1",
        "--max-restarts", str(max_restarts), "--nnodes", "2", "--node-rank", str(rank), "--lighthouse", lighthouse,
        WORKER, str(out), str(steps), str(PAUSE_S),
    )  # fmt: skip


def wait_for(condition, what: str, launches: list[Launch], timeout_s: float = 150) -> None:  # type: ignore[no-untyped-def]
    """Poll ``condition`` until it holds; fail naming ``what`` when a launch ends first or time runs out."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        for node, launch in enumerate(launches):
            if launch.proc.poll() is not None:
                raise AssertionError(f"node {node}'s launch ended while waiting for {what}:\n{launch.err[-3000:]}")
        if time.monotonic() > deadline:
            errs = "\n".join(launch.err[-1500:] for launch in launches)
            raise AssertionError(f"no {what} within {timeout_s}s:\n{errs}")
        time.sleep(0.05)


def committed_steps(out: Path, group: int) -> int:
    return sum(1 for r in records(out, group) if r["committed"])


def assert_same_weights_everywhere(out: Path, groups: range | list[int], total: int) -> None:
    """Every group's committed steps agree bit for bit with every other's, and each group reached ``total``."""
    digests: dict[int, str] = {}
    for group in groups:
        mine = [r for r in records(out, group) if r["committed"]]
        assert mine and mine[-1]["global_step"] == total, (group, mine[-1:] if mine else "no committed step")
        for r in mine:
            assert digests.setdefault(r["global_step"], r["digest"]) == r["digest"], (group, r["global_step"])
    assert sorted(digests) == list(range(1, total + 1))


def test_a_killed_worker_on_node_1_is_restarted_there_and_every_group_of_both_nodes_ends_with_the_same_weights(
    tmp_path: Path,
) -> None:
    total = 1000  # held at PAUSE_S a step while the hold file exists; fast once the test removes it
    (tmp_path / "hold").touch()
    launches = launch_nodes(tmp_path, total)
    try:
        wait_for(
            lambda: all(committed_steps(tmp_path, g) >= 3 for g in range(GROUPS)), "3 steps in every group", launches
        )
        killed = kill_inside_a_step(tmp_path, 2)  # node 1's first group
        back = lambda: any(r["pid"] != killed and r["committed"] for r in records(tmp_path, 2))  # noqa: E731
        wait_for(back, "group 2 committing again", launches)
        (tmp_path / "hold").unlink()
        codes = [launch.wait(120) for launch in launches]
    finally:
        for launch in launches:
            launch.stop()
    assert codes == [0, 0], [launch.err[-2000:] for launch in launches]
    assert "replica group 2: rank 0 was killed by SIGKILL; restarting it (1 of 1)" in launches[1].err
    assert "restarting" not in launches[0].err
    for group in (0, 1, 3):  # never killed: one process each, every step committed in order or skipped by all
        assert len({r["pid"] for r in records(tmp_path, group)}) == 1
    restarted = [r for r in records(tmp_path, 2) if r["pid"] != killed]
    assert len({r["pid"] for r in restarted}) == 1 and restarted[0]["global_step"] > 3  # healed live, not from 0
    assert_same_weights_everywhere(tmp_path, range(GROUPS), total)


@pytest.mark.skipif(not os.environ.get("MULTIGPU_LONG"), reason="about 70 s: runs with MULTIGPU_LONG=1")
def test_a_lost_node_takes_its_workers_with_it_and_the_other_node_finishes_then_a_relaunched_node_rejoins_live(
    tmp_path: Path,
) -> None:
    total = 1000
    (tmp_path / "hold").touch()
    lighthouse = f"127.0.0.1:{free_port()}"
    launches = [node_launch(tmp_path, total, rank, lighthouse) for rank in (0, 1)]
    try:
        wait_for(
            lambda: all(committed_steps(tmp_path, g) >= 3 for g in range(GROUPS)), "3 steps in every group", launches
        )
        node1 = descendants(launches[1].proc.pid)  # its workers and its zygote
        lost = {r["pid"] for g in (2, 3) for r in records(tmp_path, g)}
        assert lost <= set(node1)
        os.kill(launches[1].proc.pid, signal.SIGKILL)  # the node's launcher dies at once, as with its machine
        launches[1].proc.wait(30)
        deadline = time.monotonic() + 30
        while alive(node1) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert alive(node1) == [], "node 1's workers outlived its launcher"
        before = {g: committed_steps(tmp_path, g) for g in (0, 1)}
        wait_for(
            lambda: all(committed_steps(tmp_path, g) >= before[g] + 3 for g in (0, 1)), "node 0 going on", launches[:1]
        )
        # node 1 comes back: its launcher starts groups 2 and 3 again, which receive the state live
        launches.append(node_launch(tmp_path, total, 1, lighthouse))
        rejoined = lambda: all(  # noqa: E731
            any(r["committed"] and r["pid"] not in lost for r in records(tmp_path, g)) for g in (2, 3)
        )
        wait_for(rejoined, "node 1's groups committing again", [launches[0], launches[2]])
        (tmp_path / "hold").unlink()
        codes = [launches[0].wait(120), launches[2].wait(120)]
    finally:
        for launch in launches:
            launch.stop()
    assert codes == [0, 0], [launch.err[-2000:] for launch in launches]
    assert "restarting" not in launches[0].err
    for group in (2, 3):
        fresh = [r for r in records(tmp_path, group) if r["pid"] not in lost]
        assert len({r["pid"] for r in fresh}) == 1 and fresh[0]["global_step"] > 3  # healed live, not from 0
    assert_same_weights_everywhere(tmp_path, range(GROUPS), total)


def test_several_nodes_need_the_lighthouse_and_no_master_address() -> None:
    # the groups rendezvous on their own node (loopback) and meet at the lighthouse: --master-addr has no use
    config = LaunchConfig(
        strategy="ddp", fault_tolerant=True, replicas=2, nnodes="2", node_rank=1, lighthouse="10.0.0.1:29600"
    )
    assert config.master_addr is None and config.rdzv_endpoint is None
    with pytest.raises(ConfigError, match="pass --lighthouse HOST:PORT to every node's launcher"):
        LaunchConfig(strategy="ddp", fault_tolerant=True, replicas=2, nnodes="2", node_rank=1)


def test_the_supervisor_variable_is_read_and_a_bad_one_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MULTIGPU_SUPERVISOR", raising=False)
    assert world.supervisor_pid() is None
    monkeypatch.setenv("MULTIGPU_SUPERVISOR", "4194304")  # Linux's largest pid
    assert world.supervisor_pid() == 4194304
    monkeypatch.setenv("MULTIGPU_SUPERVISOR", "0")
    with pytest.raises(LaunchError, match=r"MULTIGPU_SUPERVISOR.*0.*is not a process id.*unset it"):
        world.supervisor_pid()


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_a_worker_whose_supervisor_is_already_gone_kills_itself_at_once() -> None:
    # the launcher died between starting the worker and the worker's request: nobody would signal it later
    child = start_python("-c", f"from multigpu.launcher.die_with_parent import die_with; die_with({finished_pid()})")
    child.communicate(timeout=60)
    assert child.returncode == -signal.SIGKILL
    child = start_python(
        "-c", "import os; from multigpu.launcher.die_with_parent import die_with; die_with(os.getppid())"
    )
    child.communicate(timeout=60)
    assert child.returncode == 0


@pytest.mark.skipif(not os.environ.get("MULTIGPU_LONG"), reason="about 90 s: runs with MULTIGPU_LONG=1")
def test_losing_node_0_ends_the_other_nodes_groups_within_the_quorum_timeout(tmp_path: Path) -> None:
    # the lighthouse lives in node 0's launcher: node 1's groups cannot form a quorum without it
    from multigpu.runtime.replica_groups import QUORUM_TIMEOUT_S

    (tmp_path / "hold").touch()
    launches = launch_nodes(tmp_path, 1000, max_restarts=2)  # not used: a restart could not reach the lighthouse
    try:
        wait_for(lambda: all(committed_steps(tmp_path, g) >= 3 for g in range(GROUPS)), "3 steps", launches)
        node0 = descendants(launches[0].proc.pid)
        os.kill(launches[0].proc.pid, signal.SIGKILL)
        lost = time.monotonic()
        code = launches[1].wait(QUORUM_TIMEOUT_S + 60)
        took = time.monotonic() - lost
    finally:
        for launch in launches:
            launch.stop()
    assert code == 1
    assert "every replica group of" in launches[1].err and "no restart is left" in launches[1].err
    assert "restarting it" not in launches[1].err and "not restarted: the lighthouse at" in launches[1].err
    assert took < QUORUM_TIMEOUT_S + 30
    assert alive(node0) == []


def test_a_group_is_not_restarted_while_the_lighthouse_does_not_answer(tmp_path: Path) -> None:
    # node 1 alone, its lighthouse (node 0's) gone: each restart would wait the whole quorum timeout for it and fail
    # again, (1 + --max-restarts) times. The script fails at its start here, so that the first loss comes at once.
    (tmp_path / "crash").touch()
    lighthouse = f"127.0.0.1:{free_port()}"  # nobody listens there
    launch = node_launch(tmp_path, 5, 1, lighthouse, max_restarts=2)
    try:
        code = launch.wait(90)
    finally:
        launch.stop()
    assert code == 1, launch.err[-3000:]
    assert "restarting it" not in launch.err
    for group in (2, 3):
        assert (
            f"replica group {group}: rank 0 exited with code 1; not restarted: the lighthouse at http://{lighthouse} "
            "does not answer (its node, node 0, was lost?) (restarts used: 0 of 2)"
        ) in launch.err


def test_an_elastic_node_count_or_an_int_one_is_judged_for_fault_tolerance() -> None:
    with pytest.raises(ConfigError, match=r"nnodes='1:2'.*pass a fixed count \(e.g. --nnodes 2\) and --node-rank"):
        LaunchConfig(strategy="ddp", fault_tolerant=True, replicas=2, nnodes="1:2", lighthouse="10.0.0.1:29600")
    # LaunchConfig(nnodes=2), as the other options take it: the fault-tolerant checks read the text form too
    config = LaunchConfig(strategy="ddp", fault_tolerant=True, replicas=2, nnodes=2, lighthouse="10.0.0.1:29600")  # type: ignore[arg-type]
    assert config.nnodes == "2"


def test_a_lighthouse_port_already_taken_on_node_0_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUST_LOG", "warn")  # what start_lighthouse sets in the launcher's process
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(LaunchError, match=rf"cannot start the lighthouse.*:{port}.*pass a port free on node 0"):
            start_lighthouse(f"0.0.0.0:{port}", groups=2)
