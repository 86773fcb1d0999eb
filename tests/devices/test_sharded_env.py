"""What a process that shards its model (fsdp) is started with, per device type."""

from __future__ import annotations

import platform
import sys

import pytest

from multigpu.devices import get_device_type
from tests.launching import run_command

OURS = "glibc.malloc.mmap_threshold=131072:glibc.malloc.hugetlb=1"


def test_on_the_cpu_glibc_returns_large_freed_buffers_on_huge_pages() -> None:
    assert get_device_type("cpu").sharded_process_env({"PATH": "/bin"}) == {"GLIBC_TUNABLES": OURS}


def test_other_glibc_tunables_of_the_user_are_kept_before_ours() -> None:
    env = get_device_type("cpu").sharded_process_env({"GLIBC_TUNABLES": "glibc.rtld.optional_static_tls=2048"})
    assert env == {"GLIBC_TUNABLES": f"glibc.rtld.optional_static_tls=2048:{OURS}"}


@pytest.mark.parametrize(
    "environ",
    [
        {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"},
        {"MALLOC_MMAP_THRESHOLD_": "65536"},
        {"MALLOC_ARENA_MAX": "1"},
        {"MALLOC_CONF": "background_thread:true"},  # jemalloc's, preloaded
    ],
)
def test_a_user_who_configured_malloc_keeps_their_settings(environ: dict[str, str]) -> None:
    assert get_device_type("cpu").sharded_process_env(environ) == {}


def test_a_caching_allocator_needs_nothing() -> None:
    assert get_device_type("cuda").sharded_process_env({}) == {}


# Half of sixteen 16 MiB buffers freed, small tensors allocated between them: with glibc's default
# the freed half stays resident (255 of 256 MiB measured here); returned to the system, it goes.
_FREE_HALF = """
import re, torch
def rss_mib(): return int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) // 1024
first = torch.ones(1 << 22); del first  # by default, freeing a 16 MiB buffer raises the mmap threshold
base, big, small = rss_mib(), [], []
for _ in range(16):
    big.append(torch.ones(1 << 22))
    small.append(torch.ones(16))
del big[::2]
print(rss_mib() - base)
"""


@pytest.mark.multiprocess
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc tunables")
def test_a_process_started_with_them_gives_freed_buffers_back() -> None:
    env = {"PATH": "/usr/bin:/bin", **get_device_type("cpu").sharded_process_env({})}
    done = run_command([sys.executable, "-c", _FREE_HALF], env=env, timeout_s=60)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) <= 128 + 16  # MiB resident above the start: the live half, not all sixteen
