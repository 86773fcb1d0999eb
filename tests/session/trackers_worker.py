"""Worker of the trackers' end-to-end test: a small ddp run logging to every tracker, stopped and resumed.

    multigpu launch --strategy ddp --nproc-per-node 2 [--max-restarts 1] tests/session/trackers_worker.py \
        FOLDER LAUNCH STEPS [EVENT N]...

Resumes from FOLDER/ckpt's latest checkpoint (and the trackers' runs saved with it), trains to STEPS,
logs ``loss`` and ``launch`` (LAUNCH plus torchrun's restarts, to tell the attempts apart) at every
step to all six trackers, each writing under FOLDER, and saves a checkpoint every 3 steps.
``preempt-at N``: rank 1 sends itself SIGTERM after step N; the ranks agree to stop a step later, save
and leave. ``crash-at N``: in the first attempt, rank 0 SIGKILLs itself right after logging step N (no
save, nothing closed); torchrun's restart then resumes. ``raise-at N``: every rank raises after logging
step N (the trackers that keep a status mark the run failed).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import multigpu
from multigpu.runtime.world import restart_count
from multigpu.session import Session

ALL = ("csv", "tensorboard", "mlflow", "wandb", "aim", "trackio")
RUN_NAME = "trk"


def options(folder: Path) -> dict[str, dict[str, object]]:
    quiet = {"silent": True, "console": "off", "x_disable_stats": True, "x_disable_machine_info": True}
    return {
        "mlflow": {"tracking_uri": f"sqlite:///{folder / 'mlflow.db'}"},
        "wandb": {"dir": str(folder), "settings": quiet},
        "aim": {"repo": str(folder / "aim"), "system_tracking_interval": None, "capture_terminal_logs": False},
        "trackio": {"auto_log_cpu": False, "auto_log_gpu": False},  # its store: TRACKIO_DIR
    }


def main() -> None:
    folder, launch, steps = Path(sys.argv[1]), int(sys.argv[2]) + restart_count(), int(sys.argv[3])
    events = {event: int(at) for event, at in zip(sys.argv[4::2], sys.argv[5::2])}
    if restart_count() > 0:
        events.pop("crash-at", None)  # the restarted attempt is the crash-resume
    os.chdir(folder)  # the default run folder (runs/<time>-ddp) goes under FOLDER
    config = {"trackers": ALL, "run_name": RUN_NAME, "tracker_options": options(folder)}
    with Session(strategy="ddp", seed=0, **config) as session:  # type: ignore[arg-type]
        model = session.setup_model(torch.nn.Linear(4, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        session.log_hparams({"lr": 0.1, "batch": 8})  # before the resume: held until the trackers open
        checkpoints = multigpu.Checkpointer(folder=folder / "ckpt", keep_last=None)
        # continues the saved tracker runs, in the first launch's run folder (no run_dir given): no code of ours
        resumed = checkpoints.resume(model=model, optimizer=optimizer)
        step = resumed.step if resumed else 0
        while step < steps:
            gen = torch.Generator().manual_seed(step)
            x = torch.randn(8, 4, generator=gen)[session.global_rank :: session.world_size]
            with session.micro_step(model):
                loss = F.mse_loss(model(x), x.sum(1, keepdim=True))
                session.backward(loss)
            session.step(optimizer)
            step += 1
            session.log({"loss": session.reduce(loss), "launch": launch}, step)
            if events.get("crash-at") == step and session.is_main_process:
                os.kill(os.getpid(), signal.SIGKILL)
            if events.get("raise-at") == step:
                raise RuntimeError(f"diverged at step {step}")
            stop = session.should_stop
            if events.get("preempt-at") == step and session.global_rank == 1:
                os.kill(os.getpid(), signal.SIGTERM)  # seen by the next read: both ranks stop one step later
            if stop or step % 3 == 0:
                checkpoints.save(step=step, model=model, optimizer=optimizer)  # with the trackers' runs
            if stop:
                print(f"stopped {session.global_rank} {step} {session.run_dir}", flush=True)
                return


if __name__ == "__main__":
    main()
