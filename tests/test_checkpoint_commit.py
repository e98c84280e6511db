"""Checkpoints as commits (`automicro.composer.checkpoint_commit`), in this process: what counts
as a complete checkpoint (full `.pt`, tar, DCP folder), which one autoresume takes, the atomic
writer under a full disk, and a real SIGKILL at each point of a save (a forked child). The 2-rank
runs (autoresume, a full disk with continue / stop, both formats) are in test_checkpoint.py's
process group; the launcher run (a truncated checkpoint, the issue's command) in test_e2e.py."""

from __future__ import annotations

import os
import signal
import tarfile
import zipfile
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp

from automicro.config import ConfigError, load_config
from automicro.composer import checkpoint_commit as commit
from automicro.testing.checkpoint_faults import CheckpointFault


def _pt(path, value=0.0):
    torch.save({"state": {"w": torch.full((4096,), value)}, "rng": [1, 2]}, path)
    return str(path)


def test_a_whole_pt_is_complete_and_a_cut_empty_or_corrupted_one_is_not(tmp_path):
    good = _pt(tmp_path / "ep0-ba2-rank0.pt")
    assert commit.checkpoint_problem(good) is None
    data = open(good, "rb").read()
    cut = tmp_path / "cut.pt"
    cut.write_bytes(data[: len(data) // 2])
    assert commit.checkpoint_problem(str(cut)).startswith("not a whole zip archive")
    (tmp_path / "empty.pt").write_bytes(b"")
    assert commit.checkpoint_problem(str(tmp_path / "empty.pt")) == "empty file"
    assert commit.checkpoint_problem(str(tmp_path / "absent.pt")) == "missing"
    # One flipped byte inside a tensor's record: torch.load reads it without a word, the CRC does not.
    name = next(n for n in zipfile.ZipFile(good).namelist() if "/data/" in n)
    flipped = bytearray(data)
    flipped[data.index(torch.full((4096,), 0.0).numpy().tobytes()[:64]) + 100] ^= 0xFF
    (tmp_path / "flip.pt").write_bytes(bytes(flipped))
    torch.load(tmp_path / "flip.pt", weights_only=False)  # no error: why the checksum is checked
    assert commit.checkpoint_problem(str(tmp_path / "flip.pt")) == f"checksum mismatch in record {name}"


def test_tar_checkpoints_are_checked_by_listing_them(tmp_path):
    inner = _pt(tmp_path / "composer_states.pt")
    archive = tmp_path / "ep0-ba2-rank0.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(inner, arcname="composer_states.pt")
    assert commit.checkpoint_problem(str(archive)) is None
    data = archive.read_bytes()
    archive.write_bytes(data[: len(data) // 2])
    assert commit.checkpoint_problem(str(archive)).startswith("not a whole tar archive")


def _dcp(folder):
    dcp.save({"w": torch.arange(4096.0), "b": torch.ones(16)}, storage_writer=dcp.FileSystemWriter(str(folder)))
    return str(folder)


def test_a_dcp_folder_needs_its_metadata_and_every_shard_at_full_length(tmp_path):
    folder = _dcp(tmp_path / "ep0-ba2")
    assert commit.checkpoint_problem(folder) is None
    shard = next(p for p in os.listdir(folder) if p.endswith(".distcp"))
    size = os.path.getsize(os.path.join(folder, shard))
    os.truncate(os.path.join(folder, shard), size - 10)
    assert commit.checkpoint_problem(folder) == f"shard {shard} is cut short ({size - 10} of {size} bytes)"
    os.remove(os.path.join(folder, shard))
    assert commit.checkpoint_problem(folder) == f"shard {shard} is missing"
    os.remove(os.path.join(folder, ".metadata"))
    assert commit.checkpoint_problem(folder) == "no .metadata: the save did not commit"
    (tmp_path / "ep0-ba2" / ".metadata").write_bytes(b"not a pickle")
    assert commit.checkpoint_problem(folder).startswith("unreadable .metadata")


def test_candidates_are_the_names_of_the_save_template_newest_first(tmp_path):
    for batch in (2, 9, 10):
        _pt(tmp_path / f"ep0-ba{batch}-rank0.pt")
    _pt(tmp_path / "ep0-ba11-rank1.pt")  # another rank's name
    _pt(tmp_path / ".partial-ep0-ba12-rank0.pt")  # never committed
    _pt(tmp_path / "ep0-ba3-rank0.pt.incomplete")  # set aside earlier
    os.symlink("ep0-ba10-rank0.pt", tmp_path / "latest-rank0.pt")
    (tmp_path / "ep0-ba4").mkdir()
    names = [c.name for c in commit.find_candidates(str(tmp_path), "ep{epoch}-ba{batch}-rank{rank}.pt", "run", sharded=False)]
    assert names == ["ep0-ba10-rank0.pt", "ep0-ba9-rank0.pt", "ep0-ba2-rank0.pt"]  # numeric order, not by name
    sharded = commit.find_candidates(str(tmp_path), "ep{epoch}-ba{batch}", "run", sharded=True)
    assert [c.name for c in sharded] == ["ep0-ba4"]
    run_named = commit.name_pattern("{run_name}/ep{epoch}-ba{batch}-rank{rank}.pt".split("/")[1], "my-run")
    assert run_named.match("ep1-ba20-rank0.pt").groupdict() == {"epoch": "1", "batch": "20"}
    assert commit.find_candidates(str(tmp_path / "nowhere"), "ep{epoch}-ba{batch}-rank{rank}.pt", "run", False) == []


def test_the_choice_is_the_newest_checkpoint_no_node_found_incomplete():
    names = ["c", "b", "a"]
    # Node 0 found c cut short; node 1 (its own disk) found it whole: neither takes c.
    chosen, skipped = commit.choose([{"c": "cut", "b": None}, None, {"c": None}, None], names)
    assert chosen == "b" and skipped == {"c": "cut"}
    assert commit.choose([{"c": None}], names) == ("c", {})
    chosen, skipped = commit.choose([{"c": "cut", "b": "missing", "a": "empty file"}], names)
    assert chosen is None and skipped == {"c": "cut", "b": "missing", "a": "empty file"}


def test_the_atomic_writer_leaves_the_whole_file_or_nothing_and_holds_the_failure(tmp_path):
    target = str(tmp_path / "ep0-ba2-rank0.pt")
    commit.write_atomically(lambda state, path: torch.save(state, path), {"w": torch.ones(3)}, target)
    assert commit.checkpoint_problem(target) is None and sorted(os.listdir(tmp_path)) == ["ep0-ba2-rank0.pt"]
    assert commit._pending_failure == []

    def half_then_full_disk(state, path):
        with open(path, "wb") as handle:
            handle.write(b"x" * 1000)
        raise commit.disk_full(path)

    second = str(tmp_path / "ep0-ba4-rank0.pt")
    commit.write_atomically(half_then_full_disk, {}, second)  # held, not raised: Composer's barrier follows
    assert sorted(os.listdir(tmp_path)) == ["ep0-ba2-rank0.pt"], "neither the file nor its partial is left"
    assert commit._pending_failure == [(second, f"[Errno 28] No space left on device: '{tmp_path}/.partial-ep0-ba4-rank0.pt'")]
    commit._pending_failure.clear()


def test_latest_is_swapped_in_one_step(tmp_path):
    for name in ("a.pt", "b.pt"):
        _pt(tmp_path / name)
    link = str(tmp_path / "latest-rank0.pt")
    commit.point_symlink(link, str(tmp_path / "a.pt"))
    commit.point_symlink(link, str(tmp_path / "b.pt"))
    assert os.readlink(link) == "b.pt" and sorted(os.listdir(tmp_path)) == ["a.pt", "b.pt", "latest-rank0.pt"]


# A real SIGKILL at each point of a full save (in a forked child: nothing else of this process runs
# there), then what the next launch's autoresume makes of the folder.
KILLS = {
    "before_write": ([], "ep0-ba2-rank0.pt"),
    "mid_write": ([".partial-ep0-ba4-rank0.pt"], "ep0-ba2-rank0.pt"),
    "before_rename": ([".partial-ep0-ba4-rank0.pt"], "ep0-ba2-rank0.pt"),
    "before_latest": (["ep0-ba4-rank0.pt"], "ep0-ba4-rank0.pt"),
}


@pytest.mark.parametrize("at", sorted(KILLS))
def test_a_sigkill_at_each_point_of_a_save_leaves_a_folder_autoresume_resumes_from(tmp_path, at):
    _pt(tmp_path / "ep0-ba2-rank0.pt", 2.0)
    os.symlink("ep0-ba2-rank0.pt", tmp_path / "latest-rank0.pt")
    target = str(tmp_path / "ep0-ba4-rank0.pt")
    pid = os.fork()
    if pid == 0:  # the child: one save through the commit protocol, killed at `at`
        try:
            fault = CheckpointFault(at, batch=4)
            fault._state = SimpleNamespace(timestamp=SimpleNamespace(batch=4))
            commit.write_atomically(lambda state, path: torch.save(state, path), {"w": torch.full((4096,), 4.0)}, target)
            commit._fire("committed", target)  # every rank agreed; next Composer would move `latest`
        finally:
            os._exit(3)  # reached only if the kill did not happen
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
    left, resume = KILLS[at]
    assert sorted(os.listdir(tmp_path)) == sorted(["ep0-ba2-rank0.pt", "latest-rank0.pt"] + left)
    if at == "mid_write":
        assert commit.checkpoint_problem(str(tmp_path / left[0])) is not None, "the partial file is cut"
    assert os.readlink(tmp_path / "latest-rank0.pt") == "ep0-ba2-rank0.pt", "`latest` never moved"
    candidates = commit.find_candidates(str(tmp_path), "ep{epoch}-ba{batch}-rank{rank}.pt", "run", sharded=False)
    chosen, skipped = commit.choose([{c.name: commit.checkpoint_problem(c.path) for c in candidates}], [c.name for c in candidates])
    assert chosen == resume and skipped == {}
    assert commit.remove_partials(str(tmp_path)) == [n for n in left if n.startswith(".partial-")]


# The same for a sharded save (one process: rank 0 is the coordinator that writes `.metadata`).
DCP_KILLS = {
    "before_write": [],
    "mid_write": ["__0_0.distcp"],  # cut to half
    "before_rename": ["__0_0.distcp"],  # whole, no .metadata
}


@pytest.mark.parametrize("at", sorted(DCP_KILLS))
def test_a_sigkill_during_a_sharded_save_leaves_a_folder_without_metadata(tmp_path, at):
    _dcp(tmp_path / "ep0-ba2")
    folder = tmp_path / "ep0-ba4"
    pid = os.fork()
    if pid == 0:
        try:
            fault = CheckpointFault(at, batch=4)
            fault._state = SimpleNamespace(timestamp=SimpleNamespace(batch=4))
            state = {"w": torch.arange(4096.0), "b": torch.ones(16)}
            dcp.save(state, storage_writer=commit.firing_writer_class()(str(folder)))
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
    left = sorted(os.listdir(folder)) if folder.exists() else []
    assert left == DCP_KILLS[at], left
    if left:
        assert commit.checkpoint_problem(str(folder)) == "no .metadata: the save did not commit"
    candidates = commit.find_candidates(str(tmp_path), "ep{epoch}-ba{batch}", "run", sharded=True)
    verdict = {c.name: commit.checkpoint_problem(c.path) for c in candidates}
    assert commit.choose([verdict], [c.name for c in candidates])[0] == "ep0-ba2"


def test_bad_settings_name_the_key_and_the_choices():
    with pytest.raises(ValueError, match=r"save_failure='ignore': must be 'continue' .* or 'stop'"):
        commit.check_save_failure("ignore")
    with pytest.raises(ValueError, match=r"checkpoint_fault: at='during'"):
        CheckpointFault("during")
    with pytest.raises(ValueError, match=r"batch=0"):
        CheckpointFault("truncate", batch=0)
    with pytest.raises(ConfigError, match=r"save_failure='ignore': must be one of continue, stop"):
        load_config("configs/tiny-cpu.yaml", ["save_failure=ignore"])
    cfg = load_config("configs/tiny-cpu.yaml", ["save_failure=stop", "callbacks.checkpoint_fault={at: mid_write, batch: 4}"])
    assert cfg.save_failure == "stop" and cfg.callbacks["checkpoint_fault"] == {"at": "mid_write", "batch": 4}


# ---- one rank, through automicro.Trainer (no FSDP: no process group in this pytest process) ------


def _trainer(folder, batches, **kwargs):
    import automicro
    from tests.automicro_cases import make_loader
    from tests.toy_models import ComposerStack

    torch.manual_seed(0)
    model = ComposerStack(width=8)
    return automicro.Trainer(
        model=model, train_dataloader=make_loader(1, 6), max_duration=f"{batches}ba",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1), device="cpu", device_train_microbatch_size=4,
        save_folder=str(folder), save_interval="2ba", run_name="one", loggers=[], progress_bar=False,
        log_to_console=False, **kwargs,
    )


def test_one_rank_resumes_past_a_latest_left_behind_and_a_cut_newest_and_refuses_when_none_is_whole(tmp_path, capsys):
    first = _trainer(tmp_path, 6)
    first.fit()
    first.close()
    # A save killed before `latest` moved (batch 6's file whole, `latest` still at 4), then batch 6's file cut.
    commit.point_symlink(str(tmp_path / "latest-rank0.pt"), str(tmp_path / "ep0-ba4-rank0.pt"))
    resumed = _trainer(tmp_path, 6, autoresume=True)
    assert int(resumed.state.timestamp.batch) == 6
    assert "resuming from ep0-ba6-rank0.pt" in capsys.readouterr().out
    assert os.readlink(tmp_path / "latest-rank0.pt") == "ep0-ba6-rank0.pt"
    resumed.close()
    # `latest` gone (Composer removes it, then makes the new one: a kill in between): still resumed.
    os.remove(tmp_path / "latest-rank0.pt")
    resumed = _trainer(tmp_path, 6, autoresume=True)
    assert int(resumed.state.timestamp.batch) == 6
    assert "complete but `latest` pointed at nothing" in capsys.readouterr().out
    resumed.close()
    data = (tmp_path / "ep0-ba6-rank0.pt").read_bytes()
    (tmp_path / "ep0-ba6-rank0.pt").write_bytes(data[:1000])
    resumed = _trainer(tmp_path, 6, autoresume=True)
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if "is incomplete" in line)
    assert line == (
        f"[automicro] checkpoint {tmp_path}/ep0-ba6-rank0.pt is incomplete (not a whole zip archive, 1000 bytes (File is not "
        "a zip file)); resuming from ep0-ba4-rank0.pt (set aside as *.incomplete)"
    )
    assert int(resumed.state.timestamp.batch) == 4
    resumed.close()
    for name in ("ep0-ba2-rank0.pt", "ep0-ba4-rank0.pt"):
        (tmp_path / name).write_bytes(b"")
    with pytest.raises(RuntimeError, match=r"autoresume found no complete checkpoint in .*\(tried ep0-ba4-rank0.pt: empty file; ep0-ba2-rank0.pt: empty file\)"):
        _trainer(tmp_path, 6, autoresume=True)
