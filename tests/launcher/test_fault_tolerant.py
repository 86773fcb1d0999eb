"""Fault-tolerant replica groups (``multigpu launch --fault-tolerant``) with real gloo processes and real kills.

One launch of three groups checks most of it (each launch costs the workers' imports, slow on a loaded
machine): group 1 is SIGKILLed at a random point inside a step and comes back forked from the launcher's
zygote; then the zygote is killed (its forked worker with it: group 1 is restarted again, as a new
interpreter), and once group 1 is back, group 2 is killed (a new interpreter too: no zygote is left).
The groups that stay go on in the same processes, the step of a kill is committed nowhere, each restarted
group receives the state live and every group holds the same weights at every committed step. The oracle:
until the first kill, the three groups' weights equal those of one ddp run of 3 processes (to float rounding).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest

from multigpu.cli.main import main
from multigpu.errors import ConfigError
from multigpu.launcher.launch import LaunchConfig
from tests.launching import alive, descendants, kill_tree, launch_workers, start_launch

pytestmark = pytest.mark.multiprocess

WORKER = "tests/launcher/fault_tolerant_worker.py"
PAUSE_S = 0.2  # each step's sleep inside its micro-step while the hold file exists
QUIET = {"RUST_LOG": "warn"}
EPOCH_BATCHES = 10  # the worker's 240 samples in global batches of 24


class Launch:
    """A running fault-tolerant launch whose output is drained in the background (a full pipe would block it)."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.proc = start_launch(*args, env={**QUIET, **(env or {})})
        self.out = self.err = ""
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        self.out, self.err = self.proc.communicate()

    def wait(self, timeout_s: float) -> int:
        self._reader.join(timeout_s)
        if self._reader.is_alive():
            kill_tree(self.proc)
            self._reader.join(10)
            raise AssertionError(f"the launch ran past {timeout_s}s and was killed\n{self.err[-3000:]}")
        return self.proc.returncode

    def stop(self) -> None:
        if self.proc.poll() is None:
            kill_tree(self.proc)


def run_to_end(*args: str, timeout_s: float) -> Launch:
    """A fault-tolerant ddp launch with ``args``, run to its end (past ``timeout_s``: killed, and the test fails)."""
    launch = Launch("--strategy", "ddp", "--fault-tolerant", *args)
    try:
        launch.wait(timeout_s)
    finally:
        launch.stop()
    return launch


def records(out: Path, group: int) -> list[dict]:
    path = out / f"group{group}-rank0.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def wait_for(condition, what: str, launch: Launch, timeout_s: float = 150) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if launch.proc.poll() is not None:
            raise AssertionError(f"the launch ended while waiting for {what}:\n{launch.err[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout_s}s:\n{launch.err[-3000:]}")
        time.sleep(0.05)


def kill_inside_a_step(out: Path, group: int) -> int:
    """SIGKILL the group's worker at a random point of the step after its last record; its pid."""
    last = records(out, group)[-1]
    time.sleep(random.uniform(0.0, PAUSE_S))
    os.kill(last["pid"], signal.SIGKILL)
    return last["pid"]


def back_after(out: Path, group: int, old_pids: set[int], commits: int) -> bool:
    new = [r for r in records(out, group) if r["pid"] not in old_pids and r["committed"]]
    return len(new) >= commits


def zygote_of(launcher: int) -> int:
    """The pid of the launcher's zygote (its child running multigpu.launcher.fault_tolerant_zygote)."""
    for pid in descendants(launcher):
        with contextlib.suppress(OSError):
            if b"fault_tolerant_zygote" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
    raise AssertionError(f"launcher {launcher} has no zygote")


@pytest.mark.skipif(  # a SIGKILL inside a step, restart and live heal stay in every run: test_fault_tolerant_nodes.py
    not os.environ.get("MULTIGPU_LONG"), reason="about 75 s of CI's 15 minutes: runs with MULTIGPU_LONG=1"
)
def test_groups_outlive_two_kills_in_sequence_and_the_restarted_ones_rejoin_with_the_same_weights(
    tmp_path: Path,
) -> None:
    total = 1000  # held at PAUSE_S a step for up to 200 s (restarts under load); fast once the test removes the file
    (tmp_path / "hold").touch()
    launch = Launch(
        "--strategy", "ddp", "--fault-tolerant", "--replicas", "3", "--nproc-per-node", "1", "--max-restarts", "2",
        WORKER, str(tmp_path), str(total), str(PAUSE_S),
    )  # fmt: skip
    try:
        wait_for(lambda: all(len(records(tmp_path, g)) >= 3 for g in range(3)), "3 steps in every group", launch)
        first_pid = kill_inside_a_step(tmp_path, 1)
        wait_for(lambda: back_after(tmp_path, 1, {first_pid}, 2), "group 1 committing again", launch)
        forked = [r for r in records(tmp_path, 1) if r["pid"] != first_pid][-1]
        zygote = zygote_of(launch.proc.pid)
        assert forked["ppid"] == zygote  # the restart was forked from the warm spare
        os.kill(zygote, signal.SIGKILL)  # its worker cannot be watched any more: ended, and group 1 restarted
        wait_for(lambda: back_after(tmp_path, 1, {first_pid, forked["pid"]}, 2), "group 1 back again", launch)
        second_pid = kill_inside_a_step(tmp_path, 2)
        wait_for(lambda: back_after(tmp_path, 2, {second_pid}, 2), "group 2 committing again", launch)
        (tmp_path / "hold").unlink()
        assert launch.wait(120) == 0, launch.err[-3000:]
    finally:
        launch.stop()
    assert "replica group 1" in launch.err and "restarting it (2 of 2)" in launch.err
    assert "NCCL flight recorder" not in launch.err  # torchft's note has no meaning on gloo

    by_group = {g: records(tmp_path, g) for g in range(3)}
    # group 0 was never killed: one process, and every step of the run committed there in order
    survivor = by_group[0]
    assert len({r["pid"] for r in survivor}) == 1
    committed = [r["global_step"] for r in survivor if r["committed"]]
    assert committed == list(range(1, total + 1))
    # a step during which a group died is committed nowhere: the survivors return False for it
    assert any(not r["committed"] for r in survivor), "no uncommitted step on the survivor after two kills"
    # the data position moves on every step, committed or not (the failed step's samples are skipped)
    batches = [r["epoch"] * EPOCH_BATCHES + r["position"] for r in survivor]
    assert batches == list(range(batches[0], batches[0] + len(batches)))
    # every group holds bit-identical weights at each committed step, restarted groups included
    digests: dict[int, str] = {}
    positions: dict[int, tuple[int, int]] = {}
    for group in range(3):
        for r in by_group[group]:
            if r["committed"]:
                assert digests.setdefault(r["global_step"], r["digest"]) == r["digest"], (group, r)
                assert positions.setdefault(r["global_step"], (r["epoch"], r["position"])) == (
                    r["epoch"],
                    r["position"],
                ), (group, r)
    # until the first kill the groups trained as one ddp run of 3 processes does (the oracle), to float rounding:
    # DDP divides each rank's gradient by 3 before summing, torchft the sum
    last_before_kill = [r for r in by_group[1] if r["pid"] == first_pid][-1]
    # (by step, not by clock: the survivor may write its record of a step after group 1 wrote its own)
    before_kill = [r for r in survivor if r["committed"] and r["global_step"] <= last_before_kill["global_step"]]
    ddp_out = tmp_path / "ddp"
    ddp_out.mkdir()
    launch_workers(WORKER, str(ddp_out), str(len(before_kill)), nproc=3)
    ddp = records(ddp_out, 0)
    assert len(before_kill) >= 3
    for ours, theirs in zip(before_kill, ddp):
        assert max(abs(a - b) for a, b in zip(ours["weights"], theirs["weights"])) < 1e-6
    # the killed groups took up the run where it stood, not at step 1; without the zygote, as new interpreters
    for group, old in ((1, {first_pid, forked["pid"]}), (2, {second_pid})):
        restarted = [r for r in by_group[group] if r["pid"] not in old]
        assert len({r["pid"] for r in restarted}) == 1
        assert restarted[0]["ppid"] == launch.proc.pid  # started by the launcher itself: the fallback
        assert restarted[0]["global_step"] > 3
        assert restarted[-1]["global_step"] == total
    assert forked["global_step"] > 3


def test_a_step_that_fails_on_one_group_after_its_all_reduce_went_through_is_committed_on_no_group(
    tmp_path: Path,
) -> None:
    # torchft's commit vote is inside a group: without the vote across groups, group 0 would commit step 4
    # and group 1 would not (then receive group 0's state at the next quorum: its count would skip 4)
    (tmp_path / "fail").write_text("1 3")  # group 1's step from global_step 3 fails, on group 1 only
    (tmp_path / "interval").write_text("600")
    (tmp_path / "find_unused").touch()  # DDP never rebuilds its buckets: they match from the first step
    launch = run_to_end(
        "--replicas", "2", "--nproc-per-node", "1", "--max-restarts", "1", WORKER, str(tmp_path), "6", timeout_s=150
    )
    assert launch.proc.returncode == 0, launch.err[-3000:]
    by_group = {g: records(tmp_path, g) for g in range(2)}
    for group in (0, 1):
        assert len({r["pid"] for r in by_group[group]}) == 1  # no restart: the failure is the step's, not the group's
        assert [r["global_step"] for r in by_group[group] if not r["committed"]] == [3], (group, by_group[group])
        assert [r["global_step"] for r in by_group[group] if r["committed"]] == list(range(1, 7))
    # every step's buckets are summed in backward: the groups' buckets (never rebuilt under find_unused_parameters)
    # were found alike at the first quorum, and again at the failed step's new one
    for group in (0, 1):
        assert [r["in_backward"] for r in by_group[group]] == [True] * 7, by_group[group]
    for step in range(1, 7):
        (ours,) = [r["digest"] for r in by_group[0] if r["committed"] and r["global_step"] == step]
        (theirs,) = [r["digest"] for r in by_group[1] if r["committed"] and r["global_step"] == step]
        assert ours == theirs, step
    # a quorum runs when one is due, not at every step: the step after the failed one runs one (it would leave
    # out a group that failed); the others keep the last quorum (the interval is longer than the run)
    for group in (0, 1):
        quorums = [r["quorums"] for r in by_group[group]]
        failed = [r["committed"] for r in by_group[group]].index(False)
        assert [b - a for a, b in itertools.pairwise(quorums)] == [int(i == failed) for i in range(6)], quorums


def global_batches(groups: int, epochs: int) -> dict[tuple[int, ...], tuple[int, int]]:
    """Each group's share of each global batch of the worker's loader, as dataset indices: its (epoch, batch)."""
    import torch
    from torch.utils.data import TensorDataset

    from multigpu.runtime.data import ShardSpec, build_epoch_loader

    found = {}
    for group in range(groups):
        loader = build_epoch_loader(
            TensorDataset(torch.arange(240)), global_batch=24, shard=ShardSpec(world_size=groups, rank=group)
        )
        for epoch in range(epochs):
            for k, (indices,) in enumerate(loader):
                found[tuple(indices.tolist())] = (epoch, k)
    return found


def test_a_group_left_out_of_a_quorum_heals_inside_a_step_and_trains_the_others_batches_from_then_on(
    tmp_path: Path,
) -> None:
    # group 2 stalls 6 s between steps, from step 3 on before a step that runs a quorum (its heartbeat goes on):
    # past the lighthouse's 5 s join timeout, groups 0 and 1 go on without it (three groups: the lighthouse forms a quorum of a majority only), and
    # group 2 then heals inside its next step (torchft applies the state in its commit)
    import torch

    from multigpu.session.coordination import rank_seed

    total = 80
    (tmp_path / "stall").write_text("2 3 6")
    (tmp_path / "hold").touch()  # 0.1 s a step until group 2 is back (it removes the file): the others still run
    launch = run_to_end(
        "--replicas", "3", "--nproc-per-node", "1", WORKER, str(tmp_path), str(total), "0.1", timeout_s=120
    )  # fmt: skip
    assert launch.proc.returncode == 0, launch.err[-3000:]
    by_group = {g: records(tmp_path, g) for g in range(3)}
    assert len({r["pid"] for r in by_group[2]}) == 1  # alive throughout: no restart, a heal inside a step
    steps = [r["global_step"] for r in by_group[2]]
    (healed,) = [i for i in range(1, len(steps)) if steps[i] > steps[i - 1] + 1]  # it took the others' count
    heal_step = steps[healed]
    assert steps[healed - 1] >= 3 and heal_step > steps[healed - 1] + 2, steps  # stalled before a due quorum
    batch_of = global_batches(3, total // EPOCH_BATCHES + 2)
    trained = {
        g: {r["global_step"]: batch_of[tuple(r["samples"])] for r in by_group[g] if r["committed"]} for g in range(3)
    }
    # groups 0 and 1 trained one global batch per step throughout; group 2, from the step after its heal, the same
    for group in (0, 1):
        assert list(trained[group].items()) == [(s, divmod(s - 1, EPOCH_BATCHES)) for s in range(1, total + 1)]
    after = [s for s in trained[2] if s > heal_step]
    assert after == list(range(heal_step + 1, total + 1))
    assert [trained[2][s] for s in after] == [trained[0][s] for s in after]
    for step in range(1, total + 1):  # the same weights and loader position in every group that committed it
        committed = [r for g in range(3) for r in by_group[g] if r["committed"] and r["global_step"] == step]
        assert len({(r["digest"], r["epoch"], r["position"]) for r in committed}) == 1, (step, committed)
    # after the healing step every group reseeded its stream from the seed and that step (seed_per_rank)
    for group in range(3):
        (record,) = [r for r in by_group[group] if r["committed"] and r["global_step"] == heal_step]
        torch.manual_seed(rank_seed(heal_step, group))
        assert record["rng"] == hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()[:16], group


def test_sigterm_to_the_launcher_stops_every_group_at_its_loop_in_bounded_time_and_leaves_no_process(
    tmp_path: Path,
) -> None:
    (tmp_path / "hold").touch()
    scontrol = tmp_path / "bin" / "scontrol"  # SLURM's, which --requeue runs once the launch was pre-empted
    scontrol.parent.mkdir()
    scontrol.write_text(f'#!/bin/sh\necho "$@" > {tmp_path / "requeued"}\n')
    scontrol.chmod(0o755)
    launch = Launch(
        "--strategy", "ddp", "--fault-tolerant", "--replicas", "2", "--nproc-per-node", "1", "--max-restarts", "1",
        "--grace-period", "60", "--requeue", WORKER, str(tmp_path), "1000", str(PAUSE_S),
        env={"PATH": f"{scontrol.parent}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "4242"},
    )  # fmt: skip
    try:
        wait_for(lambda: all(len(records(tmp_path, g)) >= 3 for g in range(2)), "3 steps in every group", launch)
        started = descendants(launch.proc.pid)  # the workers and the zygote
        assert zygote_of(launch.proc.pid) in started
        signalled = time.monotonic()
        launch.proc.send_signal(signal.SIGTERM)  # a scheduler pre-empting the whole job
        code = launch.wait(90)
        took = time.monotonic() - signalled
    finally:
        launch.stop()
    assert code == 128 + signal.SIGTERM, launch.err[-3000:]
    assert took < 60, "a group was killed at the end of the grace period instead of leaving its loop"
    assert "SIGTERM: every replica group stopped" in launch.err
    for group in (0, 1):
        # each group left at session.should_stop (where a script saves), none was restarted or killed
        assert f"replica group {group}: rank 0 left its loop at SIGTERM" in launch.err
        (stopped,) = tmp_path.glob(f"stopped-group{group}-*.json")
        assert json.loads(stopped.read_text())["global_step"] >= 3
    assert "restarting it" not in launch.err
    assert not alive(started)  # no worker, no zygote left
    assert (tmp_path / "requeued").read_text().split() == ["requeue", "4242"]  # --requeue holds here too


def test_sigterm_to_one_worker_is_its_groups_loss_the_group_is_restarted_and_the_run_finishes(tmp_path: Path) -> None:
    # the script steps a StepLR and loops over the loader itself: the restarted group takes up the others' schedule
    # and their batch from its first one (it joins as the loop's iteration starts, not at its first micro-step)
    (tmp_path / "hold").touch()
    (tmp_path / "scheduler").write_text("7 0.9")
    (tmp_path / "raw").touch()
    launch = Launch(
        "--strategy", "ddp", "--fault-tolerant", "--replicas", "2", "--nproc-per-node", "1", "--max-restarts", "1",
        WORKER, str(tmp_path), "400", str(PAUSE_S),
    )  # fmt: skip
    try:
        wait_for(lambda: all(len(records(tmp_path, g)) >= 3 for g in range(2)), "3 steps in every group", launch)
        victim = records(tmp_path, 1)[-1]["pid"]
        os.kill(victim, signal.SIGTERM)  # not through the launcher: only this group is stopped
        wait_for(lambda: back_after(tmp_path, 1, {victim}, 2), "group 1 committing again", launch)
        (tmp_path / "hold").unlink()
        assert launch.wait(120) == 0, launch.err[-3000:]
    finally:
        launch.stop()
    # the script left its loop at the signal (where it would save), and the launcher took the group as lost
    assert (tmp_path / f"stopped-group1-{victim}.json").exists()
    assert "replica group 1: rank 0 left its loop at SIGTERM (session.should_stop; exit code 143); restarting it" in (
        launch.err
    )
    assert len({r["pid"] for r in records(tmp_path, 0)}) == 1  # the other group went on in its process
    assert records(tmp_path, 1)[-1]["global_step"] == 400
    assert not list(tmp_path.glob("stopped-group0-*.json"))
    # every group holds bit-identical weights, loader position and learning rate at each committed step, and the
    # scheduler counts every committed step, in the restarted group too
    committed = [r for group in (0, 1) for r in records(tmp_path, group) if r["committed"]]
    by_step: dict[int, set[tuple]] = {}
    for r in committed:
        by_step.setdefault(r["global_step"], set()).add((r["digest"], r["epoch"], r["position"], r["lr"]))
    assert sorted(by_step) == list(range(1, 401))
    assert all(len(states) == 1 for states in by_step.values()), [s for s in by_step.items() if len(s[1]) > 1][:3]
    assert all(r["schedule"] == r["global_step"] for r in committed)
    restarted = [r for r in records(tmp_path, 1) if r["pid"] != victim and r["committed"]]
    assert len({r["lr"] for r in restarted}) > 2  # the schedule moved the rate after the restart
    # the restarted group's first two steps (its reducer's one bucket, then buckets not yet compared) are summed after
    # backward, on both groups alike (else bucket n of one would be summed with another's bucket n); then in it again
    first = restarted[0]["global_step"]
    for group in (0, 1):
        summed = {r["global_step"]: r["in_backward"] for r in records(tmp_path, group) if r["committed"]}
        assert [summed[s] for s in range(first, first + 3)] == [False, False, True], (group, first)
        assert summed[400] is True


def test_groups_of_two_processes_commit_every_step_with_the_same_weights_on_all_four_ranks(tmp_path: Path) -> None:
    # the commit vote across groups, then inside each group (its ranks take one answer): P = 2 per group
    launch = run_to_end("--replicas", "2", "--nproc-per-node", "2", WORKER, str(tmp_path), "6", timeout_s=180)
    assert launch.proc.returncode == 0, launch.err[-3000:]
    ranks = [
        [json.loads(line) for line in (tmp_path / f"group{g}-rank{r}.jsonl").read_text().splitlines()]
        for g in (0, 1)
        for r in (0, 1)
    ]
    for steps in ranks:
        assert [(s["global_step"], s["committed"]) for s in steps] == [(n, True) for n in range(1, 7)]
        assert [s["digest"] for s in steps] == [s["digest"] for s in ranks[0]]
    assert len({s["first"] for steps in ranks for s in steps[:1]}) == 4  # four shares of the first global batch


def test_every_group_dead_ends_the_launch_non_zero_naming_each_group(tmp_path: Path) -> None:
    (tmp_path / "crash").touch()
    started = time.monotonic()
    launch = run_to_end(
        "--replicas", "2", "--nproc-per-node", "1", "--max-restarts", "1", WORKER, str(tmp_path), "5", timeout_s=120
    )
    assert launch.proc.returncode == 1, launch.err[-3000:]
    assert "every replica group" in launch.err
    for group in (0, 1):
        assert f"replica group {group}: rank 0 exited with code 1 (restarts used: 1 of 1)" in launch.err
    assert time.monotonic() - started < 120


def test_fault_tolerant_without_two_replicas_is_refused_naming_the_flag() -> None:
    with pytest.raises(ConfigError, match="--fault-tolerant needs --replicas R with R >= 2"):
        LaunchConfig(strategy="ddp", fault_tolerant=True)
    with pytest.raises(ConfigError, match="add --fault-tolerant"):
        LaunchConfig(strategy="ddp", replicas=2)
    with pytest.raises(ConfigError, match="pass --strategy ddp"):
        LaunchConfig(strategy="fsdp", fault_tolerant=True, replicas=2)


def test_cli_refuses_fault_tolerant_without_replicas(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('never runs')\n")
    assert main(["launch", "--strategy", "ddp", "--fault-tolerant", str(script)]) == 2
    assert "--fault-tolerant needs --replicas R with R >= 2" in capsys.readouterr().err
