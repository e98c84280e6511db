"""Checkpoints as commits: atomic saves, one agreement on every save, and an autoresume that takes
the newest complete checkpoint.

A save is committed when its files are whole under their final names:
- the full format (rank 0's `.pt`, or `.tar.*` / compressed `.pt.*`): written under a temporary
  name in the same folder (`.partial-<name>`), fsynced, renamed, and the folder fsynced;
- the sharded format (DCP folders): torch's `FileSystemWriter` writes and fsyncs every rank's
  shard, then `.metadata` (under a temporary name, renamed) once every rank has written: a folder
  without `.metadata` never committed.
Then every rank joins one agreement round (`all_gather_object` of each rank's failure or None)
before Composer moves `latest` or rotates old checkpoints. A save that failed anywhere (disk full, an
I/O error) fails on every rank: the temporary file is removed, `latest` and the kept checkpoints
stay as they were, and `save_failure` decides: `continue` (the default; one error line naming the
rank and the path, training goes on) or `stop` (every rank raises the same error). Never a hang:
only rank 0 writes a full checkpoint, and its failure is held until Composer's own barrier has
passed; DCP gives a write error on one rank to every rank itself.

Autoresume (`autoresume=True`), at `Event.BEFORE_LOAD` (right before Composer reads `latest`): the
checkpoints in the save folder whose names match the save filename (sharded: the DCP folder name),
newest first, are checked until one is complete on every node (the local rank 0 of each node
checks; one agreement round): a full `.pt` must be a whole zip archive whose records match their
CRC-32 checksums (`zipfile.testzip`; a torch.load of a corrupted record can succeed silently), a tar
archive must list its members, a DCP folder needs its `.metadata` and every shard file it names at
its full length. `latest` is then pointed at that checkpoint (an atomic symlink swap) with one line
naming what was skipped and why; the incomplete ones are renamed `<name>.incomplete` (kept for a
look; Composer refuses to start where a checkpoint name ahead of the resume point exists); where `latest` already points there nothing is said. Where
checkpoints exist and none is complete, every rank raises one error listing what was tried. Left-
over `.partial-*` files are removed.

Not covered: compressed `.pt.*` files (an external compressor writes them; only the atomic rename
and a non-empty file vouch for them), checksums of DCP shards (torch writes none), and remote
(object store) save folders, which Composer's uploader handles after the local commit.

Owns: the commit protocol, checkpoint validation, the autoresume choice, `save_failure`. May not
touch: what a checkpoint holds (Composer's state dict; `checkpointing` for DCP templates).
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import pickle
import re
import string
import tarfile
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Optional

from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist

from automicro.config import SAVE_FAILURES
from automicro.composer import _composer_internals as composer_internals
log = logging.getLogger(__name__)

PARTIAL_PREFIX = ".partial-"
DCP_METADATA = ".metadata"
INCOMPLETE_SUFFIX = ".incomplete"

# The points of a save the fault kit (`automicro.testing.checkpoint_faults`) listens at:
# before_write (nothing written yet), written (whole under the temporary name / every shard
# written, before `.metadata`), renamed (under the final name / `.metadata` written), committed
# (every rank agreed, before Composer moves `latest`).
SAVE_POINTS = ("before_write", "written", "renamed", "committed")
_listeners: list[Callable[[str, str], None]] = []


def listen(listener: Callable[[str, str], None]) -> Callable[[], None]:
    """Call `listener(point, path)` at each save point on this rank; returns the undo."""
    _listeners.append(listener)
    return lambda: _listeners.remove(listener) if listener in _listeners else None


def _fire(point: str, path: str) -> None:
    for listener in list(_listeners):
        listener(point, path)


def check_save_failure(value: Any) -> str:
    if value not in SAVE_FAILURES or not isinstance(value, str):
        raise ValueError(
            f"automicro.Trainer: save_failure={value!r}: must be 'continue' (an error line, training goes on) or "
            "'stop' (every rank stops with the error) (YAML key `save_failure`)"
        )
    return value


class CheckpointSaveFailed(RuntimeError):
    """A save that failed on one or more ranks, raised on every rank after the agreement round."""

    def __init__(self, failures: dict[int, tuple[str, str]]) -> None:
        self.failures = failures
        parts = [f"rank {rank} ({path}: {error})" for rank, (path, error) in sorted(failures.items())]
        super().__init__("checkpoint save failed on " + ", ".join(parts))


# --- the save side -----------------------------------------------------------------------------

_pending_failure: list[tuple[str, str]] = []  # this rank's writer failure, held until the agreement


def _describe(error: BaseException) -> str:
    text = str(error) or type(error).__name__
    return text if isinstance(error, OSError) else f"{type(error).__name__}: {text}"


def fsync_folder(folder: str) -> None:
    """Make a rename inside `folder` durable (best effort: some filesystems refuse a folder fsync)."""
    try:
        fd = os.open(folder or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_files(folder: str) -> None:
    """fsync every file under `folder` (before the folder is renamed into place)."""
    for root, _, names in os.walk(folder):
        for name in names:
            with open(os.path.join(root, name), "rb") as handle:
                os.fsync(handle.fileno())


def write_atomically(write: Callable[[Any, str], None], state_dict: Any, filename: str) -> None:
    """Composer's full-checkpoint writer (`write(state_dict, path)`), made atomic: the file appears
    under `filename` whole or not at all. A failure is held for the agreement round (Composer's
    barrier follows on every rank; raising here would skip it on this rank alone)."""
    folder, name = os.path.split(filename)
    partial = os.path.join(folder, PARTIAL_PREFIX + name)
    try:
        _fire("before_write", partial)
        write(state_dict, partial)
        with open(partial, "rb+") as handle:
            os.fsync(handle.fileno())
        _fire("written", partial)
        os.replace(partial, filename)
        fsync_folder(folder)
        _fire("renamed", filename)
    except Exception as error:  # noqa: BLE001 - held and raised on every rank after the agreement
        try:
            os.remove(partial)
        except OSError:
            pass
        _pending_failure.append((filename, _describe(error)))


def committing_save(save: Callable[..., Optional[str]], state: Any, filename: str, **kwargs: Any) -> Optional[str]:
    """Composer's `save_checkpoint`, then one agreement round: every rank returns, or every rank
    raises `CheckpointSaveFailed` (before Composer moves `latest` or rotates)."""
    del _pending_failure[:]
    failure: Optional[tuple[str, str]] = None
    saved: Optional[str] = None
    try:
        saved = save(state, filename, **kwargs)
    except BaseException as error:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        if isinstance(error, (KeyboardInterrupt, SystemExit, GeneratorExit)):
            raise
        failure = _dcp_failure(error, state, filename) or (filename, _describe(error))
    if _pending_failure:
        failure = _pending_failure[0]
        del _pending_failure[:]
    gathered = dist.all_gather_object(failure)
    failures: dict[int, tuple[str, str]] = {}
    for rank, item in enumerate(gathered):
        if item is not None:
            failures.update(item if isinstance(item, dict) else {rank: tuple(item)})
    if failures:
        if state.fsdp_sharded_state_dict_enabled and dist.get_global_rank() == 0:
            _remove_uncommitted_folder(composer_internals.sharded_save_folder(state, filename))
        raise CheckpointSaveFailed(failures)
    _fire("committed", saved or "")
    return saved


def _dcp_failure(error: BaseException, state: Any, filename: str) -> Optional[dict[int, tuple[str, str]]]:
    """DCP's `CheckpointException` names each failing rank: the same dict on every rank."""
    failures = getattr(error, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return None
    folder = composer_internals.sharded_save_folder(state, filename)
    out: dict[int, tuple[str, str]] = {}
    for rank, item in failures.items():
        cause = item[0] if isinstance(item, tuple) and item else item
        out[int(rank)] = (os.path.join(folder, f"__{int(rank)}_0.distcp"), _describe(cause) if isinstance(cause, BaseException) else str(cause))
    return out


def _remove_uncommitted_folder(folder: str) -> None:
    """A DCP folder whose save failed: remove it unless it holds a committed `.metadata` (the same
    name saved before, e.g. by an earlier launch)."""
    if folder and os.path.isdir(folder) and not os.path.exists(os.path.join(folder, DCP_METADATA)):
        import shutil

        shutil.rmtree(folder, ignore_errors=True)


@functools.cache
def firing_writer_class() -> type:
    """torch's DCP `FileSystemWriter`, firing the save points: before_write and written around this
    rank's shards, renamed once the coordinator wrote `.metadata` (the commit)."""
    from torch.distributed.checkpoint import FileSystemWriter

    class FiringFileSystemWriter(FileSystemWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            _fire("before_write", str(self.path))
            future = super().write_data(plan, planner)
            future.wait()
            _fire("written", str(self.path))
            return future

        def finish(self, metadata: Any, results: Any) -> None:
            super().finish(metadata, results)
            _fire("renamed", str(self.path))

    return FiringFileSystemWriter


# --- validation ----------------------------------------------------------------------------------


def checkpoint_problem(path: str) -> Optional[str]:
    """Why the checkpoint at `path` is not complete, or None."""
    if os.path.isdir(path):
        return dcp_problem(path)
    if not os.path.exists(path):
        return "missing"
    size = os.path.getsize(path)
    if size == 0:
        return "empty file"
    if re.search(r"\.(tar(\.\w+)?|tgz)$", path):  # Composer picks the format by the extension too
        try:
            with tarfile.open(path) as archive:
                members = archive.getmembers()
        except (tarfile.TarError, EOFError, OSError) as error:
            return f"not a whole tar archive ({error})"
        return None if members else "an empty tar archive"
    if re.search(r"\.pt\.\w+$", path):  # compressed by an external tool: the atomic rename vouches
        return None
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, EOFError, OSError, ValueError) as error:
        return f"not a whole zip archive, {size} bytes ({error})"
    if bad is not None:
        return f"checksum mismatch in record {bad}"
    return None


def dcp_problem(folder: str) -> Optional[str]:
    metadata_path = os.path.join(folder, DCP_METADATA)
    if not os.path.exists(metadata_path):
        return f"no {DCP_METADATA}: the save did not commit"
    try:
        with open(metadata_path, "rb") as handle:
            metadata = pickle.load(handle)
    except Exception as error:  # noqa: BLE001 - any unreadable metadata
        return f"unreadable {DCP_METADATA} ({type(error).__name__}: {error})"
    needed: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        relative = str(getattr(info, "relative_path", ""))
        end = int(getattr(info, "offset", 0)) + int(getattr(info, "length", 0))
        needed[relative] = max(needed.get(relative, 0), end)
    if not needed:
        return f"{DCP_METADATA} names no shard files"
    for relative, end in sorted(needed.items()):
        shard = os.path.join(folder, relative)
        if not os.path.exists(shard):
            return f"shard {relative} is missing"
        size = os.path.getsize(shard)
        if size < end:
            return f"shard {relative} is cut short ({size} of {end} bytes)"
    return None


# --- finding the checkpoints of a run --------------------------------------------------------------

_ORDER = ("epoch", "batch", "sample", "token")
_NUMERIC = {
    "epoch", "batch", "batch_in_epoch", "sample", "sample_in_epoch", "token", "token_in_epoch", "rank",
    "local_rank", "world_size", "local_world_size", "node_rank",
}


def name_pattern(template: str, run_name: str) -> re.Pattern[str]:
    """A regex for the file names Composer's format string `template` gives rank 0 of `run_name`."""
    out, groups = [], set()
    for literal, field, _spec, _conv in string.Formatter().parse(template):
        out.append(re.escape(literal))
        if field is None:
            continue
        if field == "run_name":
            out.append(re.escape(run_name))
        elif field == "rank":
            out.append("0")
        elif field in _NUMERIC and field not in groups:
            groups.add(field)
            out.append(f"(?P<{field}>\\d+)")
        elif field in _NUMERIC:
            out.append("\\d+")
        else:
            out.append(".+?")
    return re.compile("^" + "".join(out) + "$")


@dataclass(frozen=True)
class Candidate:
    path: str
    order: tuple[float, ...]

    @property
    def name(self) -> str:
        return os.path.basename(self.path)


def find_candidates(folder: str, template: str, run_name: str, sharded: bool) -> list[Candidate]:
    """The checkpoints in `folder` whose names match `template` (sharded: folders), newest first."""
    if not os.path.isdir(folder):
        return []
    sub, leaf = os.path.split(template)
    base = os.path.join(folder, sub) if sub else folder
    if not os.path.isdir(base):
        return []
    pattern = name_pattern(leaf, run_name)
    found = []
    for entry in os.scandir(base):
        if entry.name.startswith(PARTIAL_PREFIX) or entry.is_dir(follow_symlinks=False) != sharded:
            continue
        if entry.is_symlink():
            continue
        match = pattern.match(entry.name)
        if match is None:
            continue
        values = match.groupdict()
        order = tuple(float(values[key]) for key in _ORDER if values.get(key) is not None)
        found.append(Candidate(entry.path, order + (entry.stat().st_mtime,)))
    return sorted(found, key=lambda c: c.order, reverse=True)


def remove_partials(folder: str) -> list[str]:
    removed = []
    if os.path.isdir(folder):
        for entry in os.scandir(folder):
            if entry.name.startswith(PARTIAL_PREFIX) and entry.is_file(follow_symlinks=False):
                try:
                    os.remove(entry.path)
                    removed.append(entry.name)
                except OSError:
                    pass
    return removed


def set_aside(path: str) -> None:
    """An incomplete checkpoint renamed to `<name>.incomplete` (`.incomplete.1`, ... where taken; a
    later save may reuse its name). Nothing is deleted: on a shared filesystem every node's checker
    may try, and the first one moves it."""
    aside, n = path + INCOMPLETE_SUFFIX, 0
    while os.path.lexists(aside):
        n += 1
        aside = f"{path}{INCOMPLETE_SUFFIX}.{n}"
    try:
        os.rename(path, aside)
    except FileNotFoundError:  # another node on the same filesystem moved it first
        pass


def point_symlink(link: str, target: str) -> None:
    """Point `link` at `target` (relative) in one step: a new symlink renamed over the old."""
    os.makedirs(os.path.dirname(link) or ".", exist_ok=True)
    temporary = f"{link}.automicro-{os.getpid()}"
    try:
        os.remove(temporary)
    except FileNotFoundError:
        pass
    os.symlink(os.path.relpath(target, os.path.dirname(link) or "."), temporary)
    os.replace(temporary, link)


def choose(verdicts: Iterable[Optional[dict[str, Optional[str]]]], names: list[str]) -> tuple[Optional[str], dict[str, str]]:
    """The newest of `names` (newest first) that no node found incomplete, and why each newer one
    was skipped. A verdict: {name: problem or None} from a node's local rank 0 (None: a rank that
    does not check); a name a node did not reach is not held against it."""
    problems: dict[str, str] = {}
    checked = [v for v in verdicts if v is not None]
    for name in names:
        found = [v[name] for v in checked if name in v]
        bad = [p for p in found if p is not None]
        if found and not bad:
            return name, problems
        if bad:
            problems[name] = bad[0]
    return None, problems


class CommittedCheckpoints(Callback):
    """Atomic saves, an agreed commit and `save_failure` on every save, and autoresume from the
    newest complete checkpoint (added by `automicro.Trainer` whenever it saves or autoresumes)."""

    def __init__(self, autoresume: bool = False, save_failure: str = "continue") -> None:
        self.autoresume = bool(autoresume)
        self.save_failure = check_save_failure(save_failure)
        self.failed_saves = 0
        self.resumed_from: Optional[str] = None
        self.skipped: dict[str, str] = {}

    def before_load(self, state: State, logger: Logger) -> None:
        composer_internals.install_atomic_checkpoint_writes(write_atomically, committing_save, firing_writer_class())
        saver = composer_internals.checkpoint_saver(state)
        if saver is None:
            return
        composer_internals.wrap_checkpoint_save(saver, self._save)
        if self.autoresume:
            self._resume_from_newest_complete(state, saver)

    # -- saving --
    def _save(self, composer_save: Callable[[State, Logger], None], saver: Any, state: State, logger: Logger) -> None:
        try:
            composer_save(state, logger)
        except CheckpointSaveFailed as failed:
            self.failed_saves += 1
            composer_internals.forget_failed_checkpoint(saver, state)
            # Rank 0 keeps the record of a full checkpoint's saves: every rank names what it names.
            last = next((p for p in dist.all_gather_object(composer_internals.last_saved_checkpoint(saver)) if p), None)
            if last and state.fsdp_sharded_state_dict_enabled:
                last = os.path.dirname(last)  # the DCP folder, not this rank's shard
            kept = f"the last good checkpoint is {last}" if last else "no checkpoint of this run is saved yet"
            if self.save_failure == "stop":
                raise RuntimeError(
                    f"automicro: {failed} at batch {int(state.timestamp.batch)}; {kept}; stopping (save_failure: stop; "
                    "save_failure: continue trains on)"
                ) from None
            if dist.get_global_rank() == 0:
                print(
                    f"[automicro] error: {failed} at batch {int(state.timestamp.batch)}; {kept}; `latest` unchanged; "
                    "training continues (save_failure: continue)",
                    flush=True,
                )
            log.error("automicro: %s", failed)

    # -- resuming --
    def _resume_from_newest_complete(self, state: State, saver: Any) -> None:
        names = composer_internals.checkpoint_names(state, saver)
        if names is None:
            return
        folder, template, latest = names
        sharded = bool(state.fsdp_sharded_state_dict_enabled)
        candidates = find_candidates(folder, template, state.run_name, sharded)
        checker = dist.get_local_rank() == 0
        base = os.path.join(folder, os.path.dirname(template))
        verdict: Optional[dict[str, Optional[str]]] = None
        if checker:
            remove_partials(base)
            verdict = {}
            for candidate in candidates:
                problem = checkpoint_problem(candidate.path)
                verdict[candidate.name] = problem
                if problem is None:
                    break
        # One agreement round: rank 0's candidate list and latest, every node's verdicts.
        gathered = dist.all_gather_object((verdict, [c.name for c in candidates], latest))
        verdicts = [item[0] for item in gathered]
        names_newest_first, latest = gathered[0][1], gathered[0][2]
        if not names_newest_first:
            return
        chosen, skipped = choose(verdicts, names_newest_first)
        if chosen is None:
            tried = "; ".join(f"{name}: {why}" for name, why in skipped.items())
            raise RuntimeError(
                f"automicro: autoresume found no complete checkpoint in {base} (tried {tried}); move them aside "
                "to start fresh, or point load_path at a checkpoint you trust and set autoresume: false"
            )
        target = os.path.join(base, chosen)
        current = os.path.realpath(latest) if os.path.lexists(latest) else None
        if checker:
            for name in skipped:  # aside, kept for a look: Composer refuses to save over a name ahead
                set_aside(os.path.join(base, name))
            if current != os.path.realpath(target):
                point_symlink(latest, target)
        dist.barrier()
        self.resumed_from, self.skipped = target, skipped
        if dist.get_global_rank() != 0:
            return
        if skipped:
            why = "; ".join(f"{os.path.join(base, name)} is incomplete ({problem})" for name, problem in skipped.items())
            print(f"[automicro] checkpoint {why}; resuming from {chosen} (set aside as *{INCOMPLETE_SUFFIX})", flush=True)
        elif current != os.path.realpath(target):
            before = os.path.basename(current) if current else "nothing"
            print(
                f"[automicro] checkpoint {chosen} is complete but `latest` pointed at {before} (the save was cut short "
                f"before it moved); resuming from {chosen}",
                flush=True,
            )

    def state_dict(self) -> dict[str, Any]:
        return {"failed_saves": self.failed_saves}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.failed_saves = int((state or {}).get("failed_saves", 0))


def disk_full(path: str) -> OSError:
    """The error a full disk gives (`errno.ENOSPC`), for the fault kit."""
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


__all__ = [
    "CheckpointSaveFailed",
    "CommittedCheckpoints",
    "SAVE_FAILURES",
    "SAVE_POINTS",
    "check_save_failure",
    "checkpoint_problem",
    "choose",
    "committing_save",
    "dcp_problem",
    "find_candidates",
    "listen",
    "name_pattern",
    "point_symlink",
    "write_atomically",
]
