"""A worker's side of fault-tolerant replica groups: torchft's Manager, driven by the Session's step.

``multigpu launch --strategy ddp --fault-tolerant --replicas R`` starts R replica groups (each one
ordinary ddp process group) and a torchft lighthouse (:mod:`multigpu.launcher.fault_tolerant`). In
each worker, :class:`ReplicaSync` joins the groups that are alive into a quorum (when one is due) and
averages the gradients across them:

1. ``begin_step`` (at a window's first micro-step) starts the step's quorum on torchft's thread when one is
   due, so the round trip to the lighthouse overlaps the forward and backward; otherwise the step keeps
   the last quorum (:data:`QUORUM_INTERVAL_S`, :meth:`ReplicaSync.begin_step`);
2. the gradients are averaged over the groups of the quorum on its process group: with one process per
   group, DDP's own reducer hands each bucket (its flat buffers, the gradients views of them) to a comm
   hook of ours (:meth:`ReplicaSync.watch`) as backward makes it, so the all-reduce overlaps the rest of
   backward and the flattening stays in C++, as plain ddp's; with several, after backward (DDP has
   averaged inside the group by then), in ``average_gradients`` (in ``session.step``). Not torchft's DDP
   hook: its future fails ``assert fut._fut`` when a peer dies inside the step and takes the healthy
   group down with it (https://github.com/meta-pytorch/torchft/issues/304); ours records a failed
   all-reduce with the Manager and completes its future with the local bucket;
3. ``commit`` asks the group whether every rank's step went through (torchft's ``should_commit``, a
   vote inside the group; decided locally for a group of one process), then the groups of the quorum
   vote across (a MIN all-reduce): a step during which a peer group failed is committed nowhere, also
   when the all-reduce completed on some groups and failed on others. The same vote says whether the
   next step runs a quorum.

A restarted group heals before its first batch (``join``): the quorum names a healthy group, which
sends what :class:`multigpu.session.fault_tolerance.LiveState` collects (weights, optimizer and its
schedulers, step count, data position, random state, gradient scale) over torchft's HTTP transport; the restarted group loads it and
trains the same step as the others. A group that fell behind while alive (left out of a quorum) heals
inside a later step instead: torchft applies the state in its commit, the step commits the other
groups' gradients onto it, and the commit vote across groups also says that a group healed, after
which every group reseeds its random streams alike (:attr:`ReplicaSync.healed_in_step`).

Every rank of a group must call each method at the same point of each step.
"""

from __future__ import annotations

import logging
import time
import zlib
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import AllreduceOptions, ReduceOp
from torch.nn.parallel import DistributedDataParallel

from multigpu.errors import LaunchError
from multigpu.runtime.collectives import issuing

QUORUM_TIMEOUT_S = 60.0  # how long a quorum may wait for the lighthouse (a group that just restarted imports torch)
JOIN_TIMEOUT_S = 60.0  # how long the first groups wait for all R to arrive before the run starts
# A step runs a quorum only when one is due (:meth:`ReplicaSync.commit`): after a step that was not committed, after
# a quorum in which a group was behind, or once this long has passed since the last one (a restarted group waits
# at most about this long, plus a step, for the others to meet it). Well below the lighthouse's join timeout.
QUORUM_INTERVAL_S = 0.25
# How often a group's Manager tells the lighthouse it is alive (torchft's default: 0.1 s). Each heartbeat wakes the
# manager server's and the lighthouse's threads: at 0.1 s that was about 1% of a fault-tolerant step's CPU time on
# the 2-core machine. Four heartbeats fit in the lighthouse's 1 s timeout (launcher/fault_tolerant.py's LIGHTHOUSE),
# so a live group is not dropped for one late beat, and a dead group is still dropped 1 s after its last.
HEARTBEAT_INTERVAL_S = 0.25

_SUM = AllreduceOptions()  # the gradients' all-reduce across groups (one options object: it is only read)
_SUM.reduceOp = ReduceOp(ReduceOp.SUM)
_MIN = AllreduceOptions()
_MIN.reduceOp = ReduceOp(ReduceOp.MIN)


class _NoNcclRecorderNote(logging.Filter):
    """Drops torchft's warning that it cannot reset NCCL's flight recorder: these groups run gloo, which has none
    (torch builds without NCCL print it at every reconfiguration, once per group per quorum change)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Unable to reset NCCL flight recorder" not in record.getMessage()


NO_NCCL_RECORDER_NOTE = _NoNcclRecorderNote()


class ReplicaSync:
    """One group's membership in the run's quorum of replica groups (torchft's Manager, made at :meth:`join`).

    Args:
        group: this worker's replica group (0..groups-1).
        groups: how many replica groups the run has (the first step waits for all of them).
        lighthouse: the lighthouse's address (``http://host:port``).
        rank: this process's rank inside its group; ``group_size``: the group's process count.
        master_addr, master_port: the group's rendezvous store (the Manager meets its group there).
        state_dict, load_state_dict: what a healthy group sends to one behind, and how it is applied
            (``load_state_dict(state, inside_step)``: inside a step, or before the first batch).
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
        load_state_dict: Callable[[dict[str, Any], bool], None],
        timeout_s: float,
    ) -> None:
        self.group, self.groups, self.lighthouse = group, groups, lighthouse
        self.rank, self.group_size = rank, group_size
        self.master_addr, self.master_port = master_addr, master_port
        self._state_dict, self._load_state_dict = state_dict, load_state_dict
        self.timeout_s = timeout_s
        self._manager: Any = None
        self._quorum_started = False  # the step in flight has its quorum (started by join or begin_step, or kept)
        self._quorum_due = True  # the next step runs a quorum (decided alike on every group: commit's vote)
        self._last_quorum = 0.0  # time.monotonic() when this group last started one
        self._participants = 0  # the groups training the step in flight (its quorum's participants), once waited for
        self.quorums = 0  # how many quorums this group has started (at its join and at the steps one was due in)
        self.healed = False  # this group loaded a healthy group's state at join
        self.healed_in_step = False  # a group of the last step's quorum (this one or another) healed inside it
        self._joining = False  # a state received now is applied before the first batch
        self._received = False  # this group received a state inside the step in flight
        self._hooked: set[int] | None = None  # ids of the parameters DDP's reducer sums across groups (watch)
        self._model: DistributedDataParallel | None = None  # whose reducer hands its buckets to _sum_bucket
        self._buckets = 0  # DDP buckets handed to _sum_bucket in this step's backward (0: the reducer did not run)
        self._summing = False  # this step's buckets are summed as backward makes them (_layouts_agree)
        self._layout_quorum: int | None = None  # the quorum id whose groups were found to have the same buckets
        self._layout: int | None = None  # a digest of the reducer's buckets once rebuilt (_note_layout)
        self._flat: torch.Tensor | None = None  # the buffer of the gradients summed after backward, kept for the next
        # DDP looks for unused parameters: a parameter may have a gradient in some groups of a step only (a branch
        # taken by some groups' batches), and DDP, whose world is this group, leaves it None where it was unused
        self._may_lack = False
        self._slots: list[tuple[list[torch.Tensor], torch.Tensor]] = []  # this step's summed buckets (params, buffer)

    def watch(self, model: nn.Module) -> None:
        """Sum each of the model's DDP buckets across the groups as backward makes it (one process per group).

        With one process per group, DDP's reducer runs over a process group of one: its buckets (flat buffers the
        gradients are views of, a small first one, then ``bucket_cap_mb``) go to :meth:`_sum_bucket` instead of
        that group's all-reduce, in C++ as backward makes them, so the sum overlaps the rest of backward as plain
        ddp's does. Not for a model that is not a DDP module or already has a comm hook (a ``DDPOptions.comm_hook``):
        its gradients are summed after backward (:meth:`average_gradients`).
        """
        if isinstance(model, DistributedDataParallel):
            self._may_lack = self._may_lack or bool(model.find_unused_parameters)
        if self.group_size != 1 or self._hooked or not isinstance(model, DistributedDataParallel):
            return
        if model._comm_hooks:  # the script's compression hook: the reducer has one already
            return
        model.register_comm_hook(None, self._sum_bucket)
        self._model = model
        self._hooked = {id(p) for p in model.parameters() if p.requires_grad}
        self._note_layout()

    def _sum_bucket(self, _state, bucket):  # type: ignore[no-untyped-def]
        """(None, GradBucket) -> Future[Tensor], DDP's comm hook: ``bucket`` averaged over the groups of this step's
        quorum, in a future that never fails. No annotations: DDP's ``_check_comm_hook`` compares them with the
        classes themselves, and this module's postponed annotations are strings.

        The gradients are divided by the participants first (as DDP divides by its world size), then summed. A
        failed sum is recorded with the Manager (:meth:`commit` then says False) and the future completes with the
        bucket as it is: the reducer, and the backward that waits for it, go on as in any step, and the step is
        committed nowhere. torchft's own DDP hook fails its future there instead, which takes the healthy group
        down with it (``assert fut._fut``, https://github.com/meta-pytorch/torchft/issues/304). In a step where the
        groups' buckets may not match (:meth:`_layouts_agree`) the buckets are left alone and
        :meth:`average_gradients` sums every gradient after backward instead.
        """
        flat = bucket.buffer()
        if not self._buckets:  # the step's first bucket
            self.begin_step()
            self._summing = self._layouts_agree()
        self._buckets += 1
        work = self._start_sum(flat, divide=True) if self._summing else None
        if work is not None and self._may_lack:  # a parameter unused here may take its sum from this buffer
            self._slots.append((bucket.parameters(), flat))
        if work is None:
            done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            done.set_result(flat)
            return done
        manager = self._manager

        def settle(future: torch.futures.Future[Any]) -> torch.Tensor:  # on gloo's thread, once the sum ended
            try:
                future.value()
            except Exception as error:  # a peer group died inside it, or it timed out
                manager.report_error(error)
            return flat

        return work.get_future().then(settle)

    def _layouts_agree(self) -> bool:
        """Whether every group of this step's quorum has the same DDP buckets (which parameters, in which order), so
        that bucket n of one group is summed with bucket n of the others.

        A reducer's first backward puts every gradient in one bucket; the second forward rebuilds the buckets in the
        order the first backward produced the gradients. So a restarted group's first step has other buckets than
        the groups that trained on, and nothing says two groups' orders match. Once per process group (each quorum
        that changed, and the step after while a group has not rebuilt), the groups compare their layouts in one
        all-reduce of three numbers; on a difference the step is summed after backward (:meth:`average_gradients`).
        """
        manager = self._manager
        self._wait_quorum()
        if manager.errored() is not None:
            return False
        quorum = manager._quorum_id
        if quorum == self._layout_quorum:
            return True
        mark = -1 if self._layout is None else self._layout
        check = torch.tensor([mark, -mark, int(mark >= 0)], dtype=torch.int64)
        try:
            if not manager._pg.allreduce([check], _MIN).wait(timedelta(seconds=self.timeout_s)):
                raise TimeoutError(f"comparing the replica groups' gradient buckets took over {self.timeout_s:g} s")
        except Exception as error:  # a peer group died inside it: the step is committed nowhere
            manager.report_error(error)
            return False
        low, negated_high, all_rebuilt = check.tolist()
        if all_rebuilt == 1 and low == -negated_high:
            self._layout_quorum = quorum
            return True
        return False

    def _note_layout(self) -> None:
        """Digest the reducer's buckets once they are final (at :meth:`watch` and after backward: DDP's logger locks
        the reducer that calls :meth:`_sum_bucket`, so the hook cannot ask it).

        Final once rebuilt; or from the start where the reducer never rebuilds them (``find_unused_parameters``
        without ``static_graph``): its first buckets follow the parameters' order, the same in every group.
        """
        model = self._model
        if self._layout is not None or model is None:
            return
        if model._has_rebuilt_buckets:
            layout = model._get_ddp_logging_data().get("rebuilt_per_bucket_param_indices", "")  # each bucket's indices
        elif model.find_unused_parameters and not model.static_graph:
            layout = model._get_ddp_logging_data().get("bucket_sizes", "")
        else:
            return
        self._layout = zlib.crc32(str(layout).encode())

    def _flatten(self, params: list[torch.Tensor]) -> torch.Tensor:
        """The gradients of ``params`` in one flat buffer: the last step's where it fits (a new buffer of megabytes
        costs a page fault per 4 KiB at its first write, each step: DDP keeps its buckets' too)."""
        grads = [p.grad.reshape(-1) for p in params]  # type: ignore[union-attr]
        kept, numel = self._flat, sum(g.numel() for g in grads)
        if kept is None or kept.numel() != numel or any(g.dtype != kept.dtype for g in grads):
            self._flat = torch.cat(grads)
            return self._flat
        return torch.cat(grads, out=kept)

    def _start_sum(self, flat: torch.Tensor, *, divide: bool = False) -> Any:
        """Start summing ``flat`` over the groups of the quorum; its work, or None once this step has failed.

        What torchft's ``Manager.allreduce`` does, less its per-call futures (a continuation that divides, an error
        wrapper, a timer on torchft's event-loop thread): on a machine with few cores their CPU time was most of the
        fault-tolerant step's cost over ddp's. The group's process group already times out (the Manager's timeout), a
        failure is recorded by the Manager as its own are (``report_error``: :meth:`commit` then says False), and a
        group healing inside this step contributes zeros, as torchft's does. The division by the participants is
        folded into the copy back (:meth:`average_gradients`), or done here first (``divide``: DDP's buckets).
        """
        manager = self._manager
        self._wait_quorum()  # this step's process group is configured (or its configuration failed: recorded)
        if manager.errored() is not None:  # the step already failed: nothing it sends would be used
            return None
        if not manager.is_participating():
            flat.zero_()
        elif divide and self._participants > 1:
            flat.div_(self._participants)
        try:
            return manager._pg.allreduce([flat], _SUM)
        except Exception as error:  # the group's link failed as the all-reduce started
            manager.report_error(error)
            return None

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
            self._last_quorum, self.quorums = time.monotonic(), self.quorums + 1
            self._manager.wait_quorum()
            if self._manager._healing:  # a restarted group: apply the state now, before its first batch
                self._joining = True
                try:
                    self._manager._apply_pending_state_dict()
                finally:
                    self._joining = False
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
        self._model = None
        if self._manager is not None:
            self._manager.shutdown(wait=False)
            self._manager = None

    # -- one step ----------------------------------------------------------------------------------

    def begin_step(self) -> None:
        """Start this step's quorum in the background (overlapping forward and backward), if one is due.

        Otherwise the step keeps the last quorum: the same groups, process group and participants. A quorum costs
        a round trip through torchft's manager server and the lighthouse on three threads; with a few cores shared
        by the workers that was the largest part of the fault-tolerant step's cost over ddp's. A group that fails
        in such a step fails its all-reduce or the vote (the step is committed nowhere and the next one runs a
        quorum without it), as it would inside a step with a quorum.
        """
        self.join()
        if not self._quorum_started:
            if self._quorum_due:
                self._manager.start_quorum()
                self._last_quorum, self.quorums = time.monotonic(), self.quorums + 1
                self._participants = 0
            self._quorum_started = True

    @property
    def quorum_due(self) -> bool:
        """Whether the next :meth:`begin_step` starts a quorum (the only steps in which a group sends its state)."""
        return self._quorum_due or self._manager is None

    def _wait_quorum(self) -> int:
        """Wait for this step's quorum (once a step); its participants."""
        if not self._participants:
            self._manager.wait_quorum()
            self._participants = int(self._manager.num_participants())
        return self._participants

    def average_gradients(self, params: list[torch.Tensor]) -> None:
        """Average the ``.grad`` of ``params`` over the groups of this step's quorum.

        Those DDP's reducer summed in backward (:meth:`watch`) are done; the rest (every one with several processes
        per group, or when the reducer did not run) in one flat all-reduce now. A peer group that fails during it
        leaves the gradients undefined and the step uncommitted (:meth:`commit` says False); nothing is raised here.
        """
        self.begin_step()
        self._note_layout()
        summed, self._buckets = self._buckets > 0 and self._summing and self._hooked is not None, 0
        slots, self._slots = self._slots, []
        if self._may_lack:
            self._average_where_used(params, summed, slots)
            return
        rest = [p for p in params if p.grad is not None and not (summed and id(p) in self._hooked)]  # type: ignore[operator]
        if not rest:
            return
        flat = self._flatten(rest)
        work = self._start_sum(flat)
        participants = max(1, self._wait_quorum())
        if not self._finished(work):  # a failed all-reduce is recorded (commit says False), not raised
            self._flat = None  # one that failed may still write into its buffer: the next step takes a new one
            return
        offset = 0
        for param in rest:
            grad = param.grad
            assert grad is not None
            torch.div(flat[offset : offset + grad.numel()].view_as(grad), participants, out=grad)
            offset += grad.numel()

    def _average_where_used(
        self, params: list[torch.Tensor], summed: bool, slots: list[tuple[list[torch.Tensor], torch.Tensor]]
    ) -> None:
        """:meth:`average_gradients` where a parameter may have a gradient in some groups only (``_may_lack``).

        One all-reduce holds the gradients not summed in backward (zeros where this group has none, as DDP counts
        a rank's unused parameter) and, per trainable parameter, whether this group has its gradient. A parameter
        with one in any group gets the average in every group (one this group lacks, summed in backward, is read
        from its bucket); one no group has keeps None, as one device leaves it.
        """
        trained = [p for p in params if p.requires_grad]
        in_backward = {id(p) for p in trained if summed and id(p) in self._hooked}  # type: ignore[operator]
        rest = [p for p in trained if id(p) not in in_backward]
        if not trained:
            return
        dtype = next((p.grad.dtype for p in trained if p.grad is not None), trained[0].dtype)
        parts = [
            p.grad.reshape(-1).to(dtype) if p.grad is not None else p.new_zeros(p.numel(), dtype=dtype) for p in rest
        ]
        used = torch.tensor([float(p.grad is not None) for p in trained], dtype=dtype)
        flat = torch.cat([*parts, used])
        work = self._start_sum(flat)
        participants = max(1, self._wait_quorum())
        if not self._finished(work):  # a failed all-reduce is recorded (commit says False), not raised
            return
        anywhere = {id(p) for p, n in zip(trained, flat[flat.numel() - len(trained) :].tolist()) if n > 0}
        offset = 0
        for param in rest:
            size, offset = param.numel(), offset + param.numel()
            if id(param) in anywhere:
                mean = flat[offset - size : offset].view_as(param) / participants
                param.grad = mean.to(param.dtype) if param.grad is None else param.grad.copy_(mean)
        lacking = {id(p): p for p in trained if id(p) in in_backward and id(p) in anywhere and p.grad is None}
        for bucket_params, buffer in slots:  # summed (and divided) in backward: the bucket holds the average
            start = 0
            for param in bucket_params:
                if id(param) in lacking:
                    param.grad = buffer[start : start + param.numel()].view_as(param).clone()
                start += param.numel()

    def _finished(self, work: Any) -> bool:
        """Wait for an all-reduce of :meth:`_start_sum`; False (recorded by the Manager) where it failed."""
        if work is None:
            return False
        try:
            work.wait()
        except Exception as error:  # a peer group died inside it, or it timed out
            self._manager.report_error(error)
            return False
        return self._manager.errored() is None

    def commit(self) -> bool:
        """Whether this step went through on every group of the quorum: step the optimizer only then.

        torchft's ``should_commit`` agrees inside the group only: a peer killed inside the all-reduce can
        leave it complete on one group and failed on another, which would then commit a step the other
        does not. So the groups vote once more, across the quorum (:meth:`_agreed`): the step counts only
        where every group said yes and the vote itself went through.
        """
        self._quorum_started = False
        manager = self._manager
        self._received = False
        local = self._commits_locally()
        # a group behind receives the state here (torchft heals in it)
        here = self._should_commit_alone() if local else bool(manager.should_commit())
        size = self._quorum_size()
        # a group of this quorum was behind (it heals, or healed at its join, and trains nothing in it): the next
        # step's quorum counts it in; and a group restarted meanwhile waits for the others' next quorum to join
        due = self._wait_quorum() < size or time.monotonic() - self._last_quorum >= QUORUM_INTERVAL_S
        agreed, healed, due = self._agreed(here, self._received, due, size)
        self.healed_in_step = healed
        self._quorum_due = due or not agreed  # a failed step's next quorum leaves out a group that failed
        # torchft's Manager has no public way to count a step or take a counted one back: its counters are set
        # here, which is why the extra pins torchft below 0.3 (tests/launcher/test_fault_tolerant.py checks them)
        if local:  # what torchft's should_commit does with its counters, on the vote across the groups
            if agreed:
                manager._step += 1
                manager._batches_committed += self._participants
                manager._commit_failures = 0
            else:
                manager._commit_failures += 1  # the lighthouse then forms the next quorum anew (a fresh process group)
        elif here and not agreed:  # torchft counted the step: take it back, as no group applies it
            manager._step -= 1
            manager._batches_committed -= self._participants
            manager._commit_failures += 1
        if not agreed and size > 1:
            # A peer still blocked in this step's all-reduce (waiting for data this group will not send) fails
            # now rather than when the next quorum replaces the group: otherwise it misses that quorum.
            manager._pg.abort()
        return agreed

    def _commits_locally(self) -> bool:
        """Whether this group decides its own commit (:meth:`_should_commit_alone`) instead of torchft's
        ``should_commit``: one process per group, on the CPU (no accelerator stream for torchft to synchronize)."""
        return self.group_size == 1 and self._manager._recovery_stream is None

    def _should_commit_alone(self) -> bool:
        """torchft's ``should_commit`` for a group of one process, less its round trip to the group's manager
        server (which only ANDs the votes of the group's ranks: here, one) and its logging.

        That round trip crosses two of torchft's threads and gRPC each step; on a machine with few cores it cost
        about as much CPU time as the cross-group vote. The rest is torchft's: a failure the process group
        recorded counts, a state received in this step is applied here, the checkpoint stops being served.
        """
        manager = self._manager
        error = manager._pg.errored()
        if error is not None:
            manager.report_error(error)
        if manager._healing:  # a group left behind: torchft received the state in this step's quorum
            manager._apply_pending_state_dict()
        manager._checkpoint_transport.disallow_checkpoint()
        return self._wait_quorum() >= manager._min_replica_size and manager.errored() is None

    def _agreed(self, here: bool, healed: bool, due: bool, size: int) -> tuple[bool, bool, bool]:
        """Whether every group of the quorum commits (a MIN of the votes; False where the vote fails), whether a
        group of the quorum healed in this step and whether one wants a quorum at the next step (MINs of the
        negated flags: their MAX). ``size``: the groups in this step's process group.

        The vote runs on the quorum's process group itself, not through the Manager's all-reduce (which
        skips a group that has already failed, leaving the others to wait for it until the timeout), and
        a group that heals in this step votes too (torchft counts it out of the participants). With
        several processes per group, rank r of each group votes with rank r of the others; the group then
        takes the MIN of its ranks' outcomes over its own process group, so all its ranks agree.
        """
        manager = self._manager
        vote = torch.tensor([1.0 if here else 0.0, -1.0 if healed else 0.0, -1.0 if due else 0.0])
        if size > 1:
            options = AllreduceOptions()
            options.reduceOp = ReduceOp(ReduceOp.MIN)
            try:
                if not manager._pg.allreduce([vote], options).wait(timedelta(seconds=self.timeout_s)):
                    raise TimeoutError(f"the commit vote across replica groups took over {self.timeout_s:g} s")
            except Exception as error:  # a peer died inside the vote, or the group's link failed: no commit
                manager.report_error(error)
                vote.zero_()
        if self.group_size > 1:
            with issuing("all_reduce", [vote]):  # the group's own ranks: one answer for all of them
                dist.all_reduce(vote, op=dist.ReduceOp.MIN)
        agreed, anyone_healed, anyone_due = vote.tolist()
        return agreed == 1.0, healed or anyone_healed < 0, due or anyone_due < 0

    def _quorum_size(self) -> int:
        """The groups in this step's process group: the participants and any group healing in the step."""
        try:
            return int(self._manager._pg.size())
        except Exception:  # its configuration failed (recorded by the Manager): no vote over it
            return int(self._manager.num_participants())

    def _receive(self, state: dict[str, Any]) -> None:
        """Apply a healthy group's state (torchft calls it: at :meth:`join`, or inside a step's commit)."""
        inside_step = not self._joining
        self._received = self._received or inside_step
        self._load_state_dict(state, inside_step)

    @property
    def participants(self) -> int:
        """How many replica groups trained the last quorum's step (0 before :meth:`join`)."""
        return 0 if self._manager is None else int(self._manager.num_participants())

    def _make_manager(self) -> Any:
        from torchft.manager import Manager  # the optional extra: imported only in a fault-tolerant run
        from torchft.process_group import ProcessGroupGloo

        logging.getLogger("torchft.manager").addFilter(NO_NCCL_RECORDER_NOTE)  # once: a filter is kept as a set
        timeout = timedelta(seconds=self.timeout_s)
        return Manager(
            pg=ProcessGroupGloo(timeout=timeout),
            load_state_dict=self._receive,
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
            heartbeat_interval=timedelta(seconds=HEARTBEAT_INTERVAL_S),
        )
