"""What a bug report needs: versions, devices with memory, backends, relevant environment variables.

This is the one place that reads the distributed/CUDA environment variables *for display*; the
runtime reads the ones it acts on in its own single place. Devices and library versions come from
the device types (:mod:`multigpu.devices`).
"""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from multigpu.core.units import format_bytes
from multigpu.core.version import installed_version
from multigpu.devices import device_type_names, get_device_type
from multigpu.runtime.world import scheduler_report

# Variables that change how multi-device training behaves (prefixes end with "_").
ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_", "TORCHELASTIC_", "PET_", "SLURM_", "OMPI_COMM_WORLD_", "PMI_")
ENV_NAMES = (
    "CUDA_VISIBLE_DEVICES",
    "CUDA_LAUNCH_BLOCKING",
    "PYTORCH_CUDA_ALLOC_CONF",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "TORCH_DISTRIBUTED_DEBUG",
    "TORCH_CPP_LOG_LEVEL",
)


@dataclass
class EnvReport:
    """Sections of ``name: value`` lines, in print order."""

    sections: dict[str, dict[str, str]] = field(default_factory=dict)

    def to_text(self) -> str:
        """Plain text, ready to paste into an issue."""
        lines: list[str] = []
        for title, rows in self.sections.items():
            lines.append(f"{title}:")
            lines += [f"  {key}: {value}" for key, value in rows.items()] or ["  (none)"]
        return "\n".join(lines)


def collect_env() -> EnvReport:
    """Gather versions, devices, backends and environment variables of this process.

    Returns:
        The report; ``.to_text()`` for pasting.

    Example:
        >>> "torch" in collect_env().sections["versions"]
        True
    """
    return EnvReport(
        sections={
            "versions": _versions(),
            "devices": _devices(),
            "backends": _backends(),
            "start (scheduler)": scheduler_report(),
            "environment variables": _env_vars(),
        }
    )


def _accelerators() -> list[str]:
    """Every registered device type but the CPU, in registration order."""
    return [name for name in device_type_names() if name != "cpu"]


def _versions() -> dict[str, str]:
    rows = {
        "multigpu": installed_version(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda (torch built with)": str(torch.version.cuda or "-"),
    }
    for name in _accelerators():
        rows.update(get_device_type(name).versions())  # e.g. cudnn and nccl from the CUDA type
    return rows


def _devices() -> dict[str, str]:
    cpu_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    rows = {
        "cpu": f"{platform.processor() or platform.machine()}, {os.cpu_count()} logical cores, "
        f"{format_bytes(cpu_memory)}, torch threads {torch.get_num_threads()}"
    }
    for name in _accelerators():
        kind = get_device_type(name)
        for index in range(kind.device_count()):
            rows[f"{name}:{index}"] = kind.describe(index)
    return rows


def _backends() -> dict[str, str]:
    def flag(value: bool) -> str:
        return "yes" if value else "no"

    return {
        "distributed": flag(dist.is_available()),
        "gloo": flag(dist.is_available() and dist.is_gloo_available()),
        "nccl": flag(dist.is_available() and dist.is_nccl_available()),
        "mpi": flag(dist.is_available() and dist.is_mpi_available()),
        **{name: flag(get_device_type(name).is_available()) for name in _accelerators()},
    }


def _env_vars() -> dict[str, str]:
    names = set(ENV_NAMES) | {k for k in os.environ if k.startswith(ENV_PREFIXES)}
    return {name: os.environ[name] for name in sorted(names) if name in os.environ}
