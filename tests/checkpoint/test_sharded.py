"""The Checkpointer under fsdp, in this process: a 1-rank gloo group, a model sharded by FSDP2, real files.

What two real processes add (world size 2, a SIGKILL mid-save, loading at another world size) is
in test_sharded_multiprocess.py; everything that one rank shows is checked here, where it is cheap.
"""

from __future__ import annotations

import os
import pickle
import resource
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import sklearn.datasets  # noqa: F401 (see below)
import torch
import torch._dynamo
import torch.distributed as dist

import multigpu
import multigpu.checkpoint as ckpt
from multigpu.checkpoint.atomic import is_temporary
from multigpu.checkpoint.dcp import MANIFEST_FILE, METADATA_FILE
from multigpu.checkpoint.formats import read_tensors
from multigpu.cli.main import main
from multigpu.errors import CheckpointError
from tests.checkpoint import _sharded as sh
from tests.checkpoint import _training as tr
from tests.checkpoint._renames import before_every_rename

STEPS = 6

# Both set environment variables when first imported (KMP_INIT_AT_FORK; TORCHINDUCTOR_CACHE_DIR,
# which fully_shard's first call imports): imported with this module, not inside a test, whose
# guard (tests/conftest.py) would take them for the test's own changes.


@pytest.fixture
def group() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _train(folder: Path | None, steps: range, run: sh.Run, *, save_at: tuple[int, ...] = ()) -> None:
    """Train ``steps``; save as step ``n`` whenever ``n`` steps are done and ``n`` is in ``save_at``."""
    checkpointer = ckpt.Checkpointer(folder=folder, keep_last=2) if folder else None

    def maybe_save(done: int) -> None:
        if checkpointer and done in save_at:
            checkpointer.save(step=done, model=run.model, optimizer=run.optimizer, scheduler=run.scheduler)

    maybe_save(steps.start)
    for step in steps:
        sh.train_step(run, step)
        maybe_save(step + 1)


def _fresh_run() -> sh.Run:
    tr.seed_everything(100)
    return sh.build_run(sh.sharded_model())


@pytest.mark.parametrize("saved_at", [3, 0], ids=["mid-run", "before-the-first-step"])
def test_resume_continues_bit_for_bit(group: None, tmp_path: Path, saved_at: int) -> None:
    straight = _fresh_run()
    _train(None, range(STEPS), straight)
    want, draws = sh.full_weights(straight.model), sh.random_draws()
    want_optimizer = sh.local(straight.optimizer.state_dict())

    first = _fresh_run()
    _train(tmp_path, range(saved_at + 1), first, save_at=(saved_at,))  # saves, then trains on (lost)
    tr.seed_everything(7)  # the resumed process starts with other random states
    resumed = sh.build_run(sh.sharded_model())
    back = ckpt.Checkpointer(folder=tmp_path).resume(
        model=resumed.model, optimizer=resumed.optimizer, scheduler=resumed.scheduler
    )
    assert back is not None and back.step == saved_at and back.saved_world_size == 1
    _train(None, range(saved_at, STEPS), resumed)

    got = sh.full_weights(resumed.model)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert str(sh.random_draws()) == str(draws)
    got_optimizer = sh.local(resumed.optimizer.state_dict())
    assert str(got_optimizer) == str(want_optimizer)  # steps, exp_avg, exp_avg_sq, lr: every value printed


def test_the_step_folder_holds_shards_an_index_a_manifest_and_the_state(group: None, tmp_path: Path) -> None:
    run = _fresh_run()
    _train(tmp_path, range(3), run, save_at=(1, 2, 3))
    assert ckpt.Checkpointer(folder=tmp_path).steps() == [2, 3]  # keep_last=2 pruned step 1
    folder = ckpt.find_latest(tmp_path)
    assert folder == tmp_path / "step-00000003"
    assert sorted(p.name for p in folder.iterdir()) == [".metadata", "__0_0.distcp", "manifest.json", "state.pt"]
    assert not [p for p in tmp_path.iterdir() if is_temporary(p)]
    # The folder is itself a DCP checkpoint: torch reads it without multigpu.
    state = {"model.0.weight": torch.empty(48, 64)}
    torch.distributed.checkpoint.load(state, checkpoint_id=folder)
    assert torch.equal(state["model.0.weight"], sh.full_weights(run.model)["0.weight"])


def test_a_resaved_step_is_swapped_in_whole(group: None, tmp_path: Path) -> None:
    run = _fresh_run()
    checkpointer = ckpt.Checkpointer(folder=tmp_path)
    checkpointer.save(step=5, model=run.model, optimizer=run.optimizer)
    sh.train_step(run, 0)
    checkpointer.save(step=5, model=run.model, optimizer=run.optimizer)  # the same step again, newer weights
    assert ckpt.find_latest(tmp_path) == tmp_path / "step-00000005"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".multigpu.lock", "step-00000005"]
    bare = tr.build_model()
    multigpu.load(bare, tmp_path / "step-00000005")
    assert all(torch.equal(bare.state_dict()[k], v) for k, v in sh.full_weights(run.model).items())


def test_resume_into_an_unsharded_model_without_a_process_group(tmp_path: Path) -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        run = _fresh_run()
        _train(tmp_path, range(2), run, save_at=(2,))
        want = sh.full_weights(run.model)
    finally:
        dist.destroy_process_group()
    bare = sh.build_run(tr.build_model())
    back = ckpt.Checkpointer(folder=tmp_path).resume(model=bare.model, optimizer=bare.optimizer)
    assert back is not None and back.step == 2
    assert all(torch.equal(bare.model.state_dict()[k], want[k]) for k in want)
    assert [float(s["step"]) for s in bare.optimizer.state_dict()["state"].values()] == [2.0] * 4


def test_inspect_and_convert_a_sharded_checkpoint(
    group: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _fresh_run()
    _train(tmp_path / "run", range(2), run, save_at=(2,))
    want = sh.full_weights(run.model)
    sh.train_step(run, 2)  # the live model moves on; the checkpoint must not
    assert main(["ckpt", "inspect", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "step-00000002" in out and "dcp (torch.distributed.checkpoint, sharded)" in out
    assert "saved step        2" in out and "shard files       1" in out and "optimizer         True" in out
    assert "0.weight" in out and "[48, 64]" in out and "float32" in out and "3.bias" in out
    converted = tmp_path / "model.safetensors"
    assert main(["ckpt", "convert", str(tmp_path / "run"), str(converted)]) == 0
    bare = multigpu.load(tr.build_model(), converted)
    assert list(bare.state_dict()) == list(want)
    assert all(torch.equal(bare.state_dict()[k], want[k]) for k in want)
    assert read_tensors(converted)[1].get("step") == "2"


def _saved(tmp_path: Path) -> Path:
    run = _fresh_run()
    _train(tmp_path, range(2), run, save_at=(1, 2))
    return tmp_path / "step-00000002"


def _truncate(folder: Path) -> None:
    shard = folder / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])


def _flip(folder: Path) -> None:
    shard = folder / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))


class _Evil:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, ("echo code ran > /dev/null",))


def _evil_index(folder: Path) -> None:
    (folder / METADATA_FILE).write_bytes(pickle.dumps(_Evil()))


def _escaping_index(folder: Path) -> None:
    index = torch.distributed.checkpoint.FileSystemReader(folder).read_metadata()
    for info in index.storage_data.values():
        info.relative_path = "../../etc/passwd"
    (folder / METADATA_FILE).write_bytes(pickle.dumps(index))


def _state_of_another_save(folder: Path) -> None:
    shutil.copy(folder.with_name("step-00000001") / "state.pt", folder / "state.pt")


DAMAGE = {
    "no index": (lambda f: (f / METADATA_FILE).unlink(), r"\.metadata', DCP's index of the checkpoint, is missing"),
    "truncated shard": (_truncate, r"__0_0\.distcp' has \d+ bytes; the manifest records \d+ \(the file was truncated"),
    "truncated index": (
        lambda f: (f / METADATA_FILE).write_bytes((f / METADATA_FILE).read_bytes()[:200]),
        r"\.metadata' is not a readable DCP index \((EOFError|UnpicklingError)",
    ),
    "flipped bit": (_flip, r"__0_0\.distcp' does not match the CRC-32 its manifest records"),
    "missing shard": (
        lambda f: (f / "__0_0.distcp").unlink(),
        r"__0_0\.distcp', a file of the checkpoint, is missing",
    ),
    "code in the index": (
        _evil_index,
        r"\.metadata' is not a readable DCP index \(UnpicklingError: posix.system is not part",
    ),
    "index leaving the folder": (
        _escaping_index,
        r"the file of .* is '\.\./\.\./etc/passwd'; expected a plain file name",
    ),
    "manifest not JSON": (lambda f: (f / MANIFEST_FILE).write_text("{"), r"manifest\.json' is not valid JSON"),
    "state of another save": (
        _state_of_another_save,
        r"state\.pt': entry 'step' is 1; expected 2, the step in the folder",
    ),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_sharded_checkpoint_is_refused_naming_the_file_and_nothing_changes(
    group: None, tmp_path: Path, damage: str
) -> None:
    folder = _saved(tmp_path)
    harm, message = DAMAGE[damage]
    harm(folder)
    run = sh.build_run(sh.sharded_model())
    before = sh.full_weights(run.model)
    with pytest.raises(CheckpointError, match=message) as raised:
        ckpt.Checkpointer(folder=tmp_path).resume(model=run.model, optimizer=run.optimizer, path=folder)
    if damage != "state of another save":
        assert "Resume from another step" in str(raised.value)
    assert all(torch.equal(v, before[k]) for k, v in sh.full_weights(run.model).items())
    assert not run.optimizer.state  # an optimizer that had not stepped is left without state


def test_weights_and_state_of_two_saves_of_one_step_are_not_resumed_together(group: None, tmp_path: Path) -> None:
    run = _fresh_run()
    checkpointer = ckpt.Checkpointer(folder=tmp_path / "a")
    checkpointer.save(step=2, model=run.model, optimizer=run.optimizer)
    sh.train_step(run, 0)
    ckpt.Checkpointer(folder=tmp_path / "b").save(step=2, model=run.model, optimizer=run.optimizer)
    shutil.copy(tmp_path / "b" / "step-00000002" / "state.pt", tmp_path / "a" / "step-00000002" / "state.pt")
    with pytest.raises(
        CheckpointError, match=r"state\.pt': its model checksum is 'dcp:crc32:.*the shards' in manifest"
    ):
        checkpointer.resume(model=run.model, optimizer=run.optimizer)


def test_a_step_folder_missing_its_index_is_skipped_for_the_previous_one(group: None, tmp_path: Path) -> None:
    folder = _saved(tmp_path)
    (folder / METADATA_FILE).unlink()
    with pytest.warns(RuntimeWarning, match=r"ignoring 1 entries .* step-00000002"):
        assert ckpt.find_latest(tmp_path) == tmp_path / "step-00000001"


def test_a_model_or_optimizer_that_does_not_fit_is_refused(group: None, tmp_path: Path) -> None:
    _saved(tmp_path)
    wider = sh.build_run(
        multigpu.strategies.fsdp.apply_fsdp(
            torch.nn.Sequential(
                torch.nn.Linear(64, 40), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(40, 10)
            ),
            torch.device("cpu"),
            multigpu.strategies.fsdp.FSDPOptions(),
            "fp32",
        )
    )
    with pytest.raises(
        CheckpointError,
        match=r"does not match FSDPSequential: 3 shape differs: 0\.weight: file \(48, 64\) vs model \(40, 64\)",
    ):
        ckpt.Checkpointer(folder=tmp_path).resume(model=wider.model)
    model = sh.sharded_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sgd.step()  # no gradients: no state, but SGD with momentum ends up with none anyway
    with pytest.raises(
        CheckpointError, match=r"optimizer state in .* does not fit the optimizer passed to resume \(missing"
    ):
        ckpt.Checkpointer(folder=tmp_path).resume(model=model, optimizer=_with_momentum(sgd, model))


def _with_momentum(sgd: torch.optim.SGD, model: torch.nn.Module) -> torch.optim.SGD:
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    sgd.step()
    sgd.zero_grad(set_to_none=True)
    return sgd


def test_an_unsharded_checkpoint_is_refused_by_a_sharded_model_with_the_fix(group: None, tmp_path: Path) -> None:
    plain = sh.build_run(tr.build_model())
    ckpt.Checkpointer(folder=tmp_path).save(step=1, model=plain.model, optimizer=plain.optimizer)
    run = sh.build_run(sh.sharded_model())
    with pytest.raises(CheckpointError, match=r"unsharded checkpoint .* multigpu\.load\(model, '.*step-00000001'\)"):
        ckpt.Checkpointer(folder=tmp_path).resume(model=run.model, optimizer=run.optimizer)


def test_a_size_limit_during_the_shard_write_leaves_the_previous_checkpoint_and_no_temporary(
    group: None, tmp_path: Path
) -> None:
    folder = _saved(tmp_path)
    run = _fresh_run()
    sh.train_step(run, 0)  # AdamW state: the shards are tens of KiB
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (8192, hard))  # writes past 8 KiB fail with EFBIG
    try:
        with pytest.raises(
            CheckpointError,
            match=r"could not write checkpoint .*step-00000003'?: File too large \(errno 27\): a file-size limit was hit, "
            r"not a full disk: .* at most 8192 bytes \(RLIMIT_FSIZE, ulimit -f\)\. The previous checkpoint is unchanged",
        ):
            ckpt.Checkpointer(folder=tmp_path).save(step=3, model=run.model, optimizer=run.optimizer)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert ckpt.find_latest(tmp_path) == folder
    assert not [p for p in tmp_path.iterdir() if is_temporary(p)]


def test_a_size_limit_inside_a_tensor_write_is_named_as_such(group: None, tmp_path: Path) -> None:
    # DCP writes a tensor with torch.save, which turns the EFBIG into "RuntimeError: ... unexpected pos"
    # (the OSError only its context, lost when DCP gathers the ranks' failures): here the first tensor.
    folder = _saved(tmp_path)
    run = _fresh_run()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (8192, hard))
    try:
        with pytest.raises(
            CheckpointError, match=r"File too large \(errno 27\): a file-size limit was hit, not a full"
        ):
            ckpt.Checkpointer(folder=tmp_path).save(step=3, model=run.model)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert ckpt.find_latest(tmp_path) == folder
    assert not [p for p in tmp_path.iterdir() if is_temporary(p)]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # torch's own save, alone: as meant
def test_a_folder_that_passes_the_checks_but_fails_in_dcp_is_a_checkpoint_error(tmp_path: Path) -> None:
    # A DCP folder written by torch itself (no manifest, so no checksums), whose index sends each
    # tensor to the other's bytes: only DCP's reading finds out.
    torch.distributed.checkpoint.save({"a": torch.ones(4), "b": torch.ones(2, 3)}, checkpoint_id=tmp_path, no_dist=True)
    index = torch.distributed.checkpoint.FileSystemReader(tmp_path).read_metadata()
    first, second = index.storage_data
    index.storage_data[first], index.storage_data[second] = index.storage_data[second], index.storage_data[first]
    (tmp_path / METADATA_FILE).write_bytes(pickle.dumps(index))
    with pytest.raises(
        CheckpointError,
        match=r"reading the tensors of .* failed \(rank 0: AssertionError: .*mismatch sizes.*\); the folder is damaged",
    ):
        multigpu.load(torch.nn.Module(), tmp_path)


def test_inspect_and_convert_of_a_damaged_folder_fail_in_one_line(
    group: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _saved(tmp_path)
    _truncate(folder)
    assert main(["ckpt", "inspect", str(folder)]) == 1
    assert main(["ckpt", "convert", str(tmp_path), str(tmp_path / "out.safetensors")]) == 1
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 2 and all("__0_0.distcp' has" in e and "truncated" in e for e in errors), errors
    assert not (tmp_path / "out.safetensors").exists()


@pytest.mark.parametrize("step", [2, 1], ids=["next-step", "resave"])
def test_the_latest_checkpoint_is_whole_at_every_rename_of_a_sharded_save(
    group: None, tmp_path: Path, step: int
) -> None:
    # A kill lands between two system calls; the ones that change what a name points at are renames.
    run = _fresh_run()
    checkpointer = ckpt.Checkpointer(folder=tmp_path)
    checkpointer.save(step=1, model=run.model, optimizer=run.optimizer)
    sh.train_step(run, 0)
    seen: list[tuple[Path | None, int | None]] = []

    def look() -> None:
        latest = ckpt.find_latest(tmp_path)
        resumed = ckpt.Checkpointer(folder=tmp_path).resume(model=sh.sharded_model()) if latest else None
        seen.append((latest, resumed.step if resumed else None))

    with before_every_rename(look):
        checkpointer.save(step=step, model=run.model, optimizer=run.optimizer)
    assert len(seen) >= 3, seen  # DCP's index, the manifest, state.pt, the folder
    assert all(latest is not None and found in (1, step) for latest, found in seen), seen
    assert ckpt.find_latest(tmp_path) == tmp_path / f"step-{step:08d}"
