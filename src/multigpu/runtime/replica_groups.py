"""A worker's side of fault-tolerant replica groups: torchft's Manager, driven by the Session's step.

``multigpu launch --strategy ddp --fault-tolerant --replicas R`` starts R replica groups (each one
ordinary ddp process group) and a torchft lighthouse (:mod:`multigpu.launcher.fault_tolerant`). In
each worker, :class:`ReplicaSync` joins the groups that are alive into one quorum per step and
averages the gradients across them:

1. ``begin_step`` (at a window's first micro-step) starts the step's quorum on torchft's thread, so the
   round trip to the lighthouse overlaps the forward and backward;
2. ``average_gradients`` (in ``session.step``, after backward) waits for the quorum and all-reduces one
   flat buffer of the gradients over the groups of the quorum, through the Manager: no torchft DDP
   hook, whose future fails ``assert fut._fut`` when a peer dies inside the step and takes the healthy
   group down with it (https://github.com/meta-pytorch/torchft/issues/304); a failed all-reduce is
   recorded by the Manager instead;
3. ``commit`` asks the group whether every rank's step went through (torchft's ``should_commit``): a
   step during which a peer group failed is committed nowhere.

A restarted group heals before its first batch (``join``): the quorum names a healthy group, which
sends what :class:`multigpu.session.fault_tolerance.LiveState` collects (weights, optimizer, step
count, data position, random state) over torchft's HTTP transport; the restarted group loads it and
trains the same step as the others.

Every rank of a group must call each method at the same point of each step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from multigpu.errors import LaunchError

QUORUM_TIMEOUT_S = 60.0  # how long a quorum may wait for the lighthouse (a group that just restarted imports torch)
JOIN_TIMEOUT_S = 60.0  # how long the first groups wait for all R to arrive before the run starts


class ReplicaSync:
    """One group's membership in the run's quorum of replica groups (torchft's Manager, made at :meth:`join`).

    Args:
        group: this worker's replica group (0..groups-1).
        groups: how many replica groups the run has (the first step waits for all of them).
        lighthouse: the lighthouse's address (``http://host:port``).
        rank: this process's rank inside its group; ``group_size``: the group's process count.
        master_addr, master_port: the group's rendezvous store (the Manager meets its group there).
        state_dict, load_state_dict: what a healthy group sends to a restarted one, and how it is applied.
        timeout_s: how long an all-reduce or a commit waits for a peer group.
    """

    def __init__(
        self,
        *,
        group: int,
        groups: int,
        lighthouse: str,
        rank: int,
        group_size: int,
        master_addr: str,
        master_port: int,
        state_dict: Callable[[], dict[str, Any]],
        load_state_dict: Callable[[dict[str, Any]], None],
        timeout_s: float,
    ) -> None:
        self.group, self.groups, self.lighthouse = group, groups, lighthouse
        self.rank, self.group_size = rank, group_size
        self.master_addr, self.master_port = master_addr, master_port
        self._state_dict, self._load_state_dict = state_dict, load_state_dict
        self.timeout_s = timeout_s
        self._manager: Any = None
        self._quorum_started = False  # the quorum of the step in flight was started (by join or begin_step)
        self.healed = False  # this group loaded a healthy group's state at join

    # -- life cycle --------------------------------------------------------------------------------

    def join(self) -> None:
        """Meet the other groups before the first batch; a restarted group heals here. Idempotent.

        On a fresh run (every group at step 0) it waits until all ``groups`` are in the quorum, so that
        no group starts training alone; a group that finds the others at a later step loads the state of
        one of them (the Manager calls ``load_state_dict``) and goes on at their step.

        Raises:
            LaunchError: the other groups did not arrive within :data:`JOIN_TIMEOUT_S`.
        """
        if self._manager is not None:
            return
        self._manager = self._make_manager()
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while True:
            self._manager.start_quorum()
            self._manager.wait_quorum()
            if self._manager._healing:  # a restarted group: apply the state now, before its first batch
                self._manager._apply_pending_state_dict()
                self._manager._healing = False
                self.healed = True
            step = self._manager.current_step()
            if step > 0 or self._manager.num_participants() >= self.groups:
                break
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"replica group {self.group}: only {self._manager.num_participants()} of {self.groups} replica "
                    f"groups joined within {JOIN_TIMEOUT_S:g} s; check the other groups' output (or pass a smaller "
                    "--replicas)"
                )
            time.sleep(0.05)
        self._quorum_started = True  # this quorum is the first step's

    def close(self) -> None:
        """Stop this group's Manager (its heartbeat ends: the lighthouse drops the group)."""
        if self._manager is not None:
            self._manager.shutdown(wait=False)
            self._manager = None

    # -- one step ----------------------------------------------------------------------------------

    def begin_step(self) -> None:
        """Start this step's quorum in the background (overlapping forward and backward)."""
        self.join()
        if not self._quorum_started:
            self._manager.start_quorum()
            self._quorum_started = True

    def average_gradients(self, params: list[torch.Tensor]) -> None:
        """Average the ``.grad`` of ``params`` over the groups of this step's quorum (one flat all-reduce).

        A peer group that fails during it leaves the gradients undefined and the step uncommitted
        (:meth:`commit` says False); nothing is raised here.
        """
        self.begin_step()
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        self._manager.allreduce(flat).wait()  # errors are recorded by the Manager, not raised
        offset = 0
        for grad in grads:
            count = grad.numel()
            grad.copy_(flat[offset : offset + count].view_as(grad))
            offset += count

    def commit(self) -> bool:
        """Whether this step went through on every rank of the group and enough groups: step the optimizer only then."""
        self._quorum_started = False
        return bool(self._manager.should_commit())

    @property
    def participants(self) -> int:
        """How many replica groups trained the last quorum's step (0 before :meth:`join`)."""
        return 0 if self._manager is None else int(self._manager.num_participants())

    def _make_manager(self) -> Any:
        from torchft.manager import Manager  # the optional extra: imported only in a fault-tolerant run
        from torchft.process_group import ProcessGroupGloo

        timeout = timedelta(seconds=self.timeout_s)
        return Manager(
            pg=ProcessGroupGloo(timeout=timeout),
            load_state_dict=self._load_state_dict,
            state_dict=self._state_dict,
            min_replica_size=1,
            use_async_quorum=True,
            timeout=timeout,
            quorum_timeout=timedelta(seconds=QUORUM_TIMEOUT_S),
            connect_timeout=timedelta(seconds=QUORUM_TIMEOUT_S),
            rank=self.rank,
            world_size=self.group_size,
            store_addr=self.master_addr,
            store_port=self.master_port,
            lighthouse_addr=self.lighthouse,
            replica_id=f"multigpu_group_{self.group}",
            init_sync=False,  # every group builds the model from the same seed
        )
