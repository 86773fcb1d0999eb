"""Two nodes for real: two network namespaces joined by a veth pair, one ``multigpu launch`` in each.

Each namespace has its own network stack (its own addresses, ports and loopback), so the launchers
meet over the veth link as two machines would. Needs root (``ip netns add``); skips with the reason
otherwise. gloo is told which interface to use (``GLOO_SOCKET_IFNAME``), as on any machine with
several interfaces: the host name resolves to an address the namespaces do not have.

The elastic restart test takes about a minute, so it runs only with ``MULTIGPU_LONG=1``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.launcher.two_node_worker import batch
from tests.launching import kill_tree, read_lines_until, start_launch

pytestmark = pytest.mark.multiprocess

WORKER = str(Path(__file__).with_name("two_node_worker.py"))
COLLECTIVE_TIMEOUT_S = 10


@dataclass(frozen=True)
class Node:
    namespace: str
    interface: str
    address: str

    def launch(self, *args: str) -> subprocess.Popen[str]:
        """``multigpu launch ARGS`` inside this node's namespace."""
        return start_launch(
            *args, wrapper=["ip", "netns", "exec", self.namespace, "env", f"GLOO_SOCKET_IFNAME={self.interface}"]
        )

    def pids(self) -> list[int]:
        """Every process running in this node's namespace."""
        listed = subprocess.run(["ip", "netns", "pids", self.namespace], capture_output=True, text=True, check=False)
        return [int(pid) for pid in listed.stdout.split()]

    def power_off(self) -> None:
        """SIGKILL every process of the node at once: a machine that dies."""
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture
def nodes() -> Iterator[tuple[Node, Node]]:
    if sys.platform != "linux" or shutil.which("ip") is None:
        pytest.skip("needs Linux network namespaces and the `ip` command (iproute2)")
    tag = uuid.uuid4().hex[:6]
    pair = (Node(f"mg{tag}a", f"mg{tag}a", "10.213.7.1"), Node(f"mg{tag}b", f"mg{tag}b", "10.213.7.2"))
    try:
        _ip("netns", "add", pair[0].namespace)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot create a network namespace here (needs root): {exc.stderr.strip()}")
    try:
        _ip("netns", "add", pair[1].namespace)
        _ip("link", "add", pair[0].interface, "type", "veth", "peer", "name", pair[1].interface)
        for node in pair:
            _ip("link", "set", node.interface, "netns", node.namespace)
            _ip("-n", node.namespace, "addr", "add", f"{node.address}/24", "dev", node.interface)
            _ip("-n", node.namespace, "link", "set", node.interface, "up")
            _ip("-n", node.namespace, "link", "set", "lo", "up")
        yield pair
    finally:
        for node in pair:
            node.power_off()
            subprocess.run(
                ["ip", "netns", "del", node.namespace], capture_output=True, check=False
            )  # the veth goes too


def _one_device_weights(steps: int) -> dict[str, torch.Tensor]:
    """The oracle: the worker's training on one device, uninterrupted (same seed, same global batches)."""
    torch.manual_seed(3)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        x, y = batch(step, 0, 1)
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    return model.state_dict()


def _finish(proc: subprocess.Popen[str], timeout_s: float) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        raise AssertionError(f"{proc.args} ran past {timeout_s} s") from None
    return proc.returncode, out, err


def test_a_node_that_dies_ends_the_other_within_the_collective_timeout(
    nodes: tuple[Node, Node], tmp_path: Path
) -> None:
    first, second = nodes
    common = ["--strategy", "ddp", "--nnodes", "2", "--nproc-per-node", "1", "--master-addr", first.address]
    common += ["--master-port", "29500", "--collective-timeout", str(COLLECTIVE_TIMEOUT_S)]
    launchers = [
        node.launch(*common, "--node-rank", str(rank), WORKER, str(tmp_path), "1000") for rank, node in enumerate(nodes)
    ]
    try:
        read_lines_until(launchers[0], "step 0 3", 1, timeout_s=120)  # training across both nodes
        second.power_off()
        died = time.monotonic()
        code, _, err = _finish(launchers[0], timeout_s=COLLECTIVE_TIMEOUT_S + 60)
        took = time.monotonic() - died
    finally:
        for proc in launchers:
            kill_tree(proc)
    assert code == 1
    assert took < COLLECTIVE_TIMEOUT_S + 30  # the collective timeout, plus the launcher's own shutdown
    # node 0's rank lost its peer on the other node: the summary names the rank, its error, and the peer's address
    assert "failed on rank 0 (local_rank 0, exit code" in err
    assert "PeerExitedError" in err or "CollectiveTimeoutError" in err
    assert f"[{second.address}]" in err or "CollectiveTimeoutError" in err
    assert first.pids() == [] and second.pids() == []  # nothing left on either node


@pytest.mark.skipif(not os.environ.get("MULTIGPU_LONG"), reason="about a minute: runs with MULTIGPU_LONG=1")
def test_an_elastic_run_resumes_from_the_latest_checkpoint_when_the_node_comes_back(
    nodes: tuple[Node, Node], tmp_path: Path
) -> None:
    first, second = nodes
    steps = 12
    common = ["--strategy", "ddp", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d"]
    common += ["--rdzv-endpoint", f"{first.address}:29400", "--rdzv-id", "two-nodes", "--max-restarts", "2"]
    common += ["--collective-timeout", str(COLLECTIVE_TIMEOUT_S), "--rdzv-conf", "join_timeout=120"]
    # is_host: torch guesses the rendezvous host by its host name, which here names neither namespace
    host = first.launch(
        *common, "--local-addr", first.address, "--rdzv-conf", "is_host=1", WORKER, str(tmp_path), str(steps)
    )
    join = [*common, "--local-addr", second.address, WORKER, str(tmp_path), str(steps)]
    launchers = [host, second.launch(*join)]
    try:
        read_lines_until(host, "start 0 0", 1, timeout_s=120)  # a fresh run: no checkpoint yet
        read_lines_until(host, "step 0 3", 1, timeout_s=60)
        second.power_off()  # mid-run: node 0's worker loses its peer, its agent restarts it and waits
        launchers.append(second.launch(*join))  # the node comes back
        code, out, err = _finish(host, timeout_s=240)
    finally:
        for proc in launchers:
            kill_tree(proc)
    assert code == 0, err[-3000:]
    starts = [int(line.split()[2]) for line in out.splitlines() if line.startswith("start 0 ")]
    assert len(starts) == 1 and starts[0] >= 3, out  # the restarted worker resumed, not from scratch
    got = torch.load(tmp_path / "final.pt")
    for key, want in _one_device_weights(steps).items():
        torch.testing.assert_close(got[key], want, rtol=1e-5, atol=1e-6, msg=key)
