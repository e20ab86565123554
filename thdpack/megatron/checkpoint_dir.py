"""A run's ``checkpoint.dir``: who writes it, what is left in it, and which checkpoint in it to resume from.

    problem = unusable(directory)                  # None, or why it cannot hold checkpoints (before any setup)
    lock = DirLock.claim(directory, run_dir)        # one rank; raises DirInUse naming the host and pid holding it
    removed = remove_partials(directory)            # the .partial directories of saves that never finished
    point = resume_point(directory)                 # the newest complete checkpoint, and why newer ones were not
    ...
    lock.release()

The lock (``thdpack.lock``) names the host, pid, the pid's start time and the SLURM job of the run holding it. It
is stale, and taken over with a message, when that pid is gone from this host (or is another process now), or
when it was an earlier attempt of this SLURM job (a requeued job may start on another node).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from .checkpoint_manifest import Damage, read_manifest, verify

__all__ = [
    "LOCK",
    "TRACKER",
    "CheckpointWriteError",
    "DirInUse",
    "DirLock",
    "ResumePoint",
    "checkpoint_path",
    "iterations",
    "remove_partials",
    "resume_point",
    "tracked_iteration",
    "unusable",
]

TRACKER = "latest_checkpointed_iteration.txt"
LOCK = "thdpack.lock"
_ITERATION = re.compile(r"iter_(\d{7})")
log = logging.getLogger("thdpack")


def checkpoint_path(directory: str | os.PathLike, iteration: int) -> Path:
    return Path(directory) / f"iter_{iteration:07d}"


def tracked_iteration(directory: str | os.PathLike) -> int | None:
    """The iteration the tracker names, or None when there is no tracker or it holds no number."""
    try:
        text = (Path(directory) / TRACKER).read_text().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return int(text) if text.isdigit() else None


def iterations(directory: str | os.PathLike) -> list[int]:
    """The iterations of the checkpoint directories (``iter_XXXXXXX``, no ``.partial``), newest first."""
    found = []
    for path in Path(directory).iterdir() if Path(directory).is_dir() else ():
        match = _ITERATION.fullmatch(path.name)
        if match and path.is_dir():
            found.append(int(match.group(1)))
    return sorted(found, reverse=True)


def unusable(directory: str | os.PathLike) -> str | None:
    """Why ``directory`` cannot receive checkpoints (it or a parent is a regular file, it cannot be created or
    written), or None; it is created when missing. Checked by writing and removing a probe file."""
    path = Path(directory)
    for parent in (path, *path.parents):
        if parent.exists() and not parent.is_dir():
            return f"{parent} is a file, not a directory"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".probe-{socket.gethostname()}-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        return f"it cannot be written ({error.strerror or error})"
    return None


def remove_partials(directory: str | os.PathLike) -> list[Path]:
    """Remove the ``iter_XXXXXXX.partial`` directories of saves that did not finish; return them."""
    removed = []
    for path in sorted(Path(directory).glob("iter_*.partial")):
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


class CheckpointWriteError(OSError):
    """A save that could not be written (the disk is full); the previous checkpoint is kept and the message says
    which."""


class DirInUse(ValueError):
    """Another run holds the checkpoint directory's lock."""


def _process_start(pid: int) -> str | None:
    """The start time of ``pid`` in clock ticks since boot (tells a reused pid apart), None if there is none."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class DirLock:
    """The lock of one checkpoint directory, held by this process."""

    path: Path
    holder: dict
    took_over: str | None = None  # why the lock found there was stale, when it was

    @classmethod
    def claim(cls, directory: str | os.PathLike, run_dir: str | os.PathLike | None = None) -> DirLock:
        path = Path(directory) / LOCK
        path.parent.mkdir(parents=True, exist_ok=True)
        me = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "start": _process_start(os.getpid()),
            "job": os.environ.get("SLURM_JOB_ID"),
            "since": time.strftime("%Y-%m-%d %H:%M:%S"),
            "run_dir": str(run_dir) if run_dir is not None else None,
            "id": uuid.uuid4().hex,
        }
        took_over = None
        for _ in range(3):
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                text, holder = _read_lock(path)
                why = _stale(holder, me)
                if why is None:
                    raise DirInUse(_in_use_message(directory, path, holder)) from None
                if _read_lock(path)[0] == text:  # still that holder's: remove it, then race for O_EXCL again
                    path.unlink(missing_ok=True)
                took_over = why
                continue
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(me) + "\n")
                f.flush()
                os.fsync(f.fileno())
            return cls(path, me, took_over)
        raise DirInUse(f"{path}: could not take the lock (another run took it at the same moment)")

    def release(self) -> None:
        """Remove the lock if it is still this process's."""
        if _read_lock(self.path)[1].get("id") == self.holder["id"]:
            self.path.unlink(missing_ok=True)


def _read_lock(path: Path) -> tuple[str, dict]:
    try:
        text = path.read_text()
        holder = json.loads(text)
        return text, holder if isinstance(holder, dict) else {}
    except (OSError, ValueError):
        return "", {}


def _stale(holder: dict, me: dict) -> str | None:
    """Why the lock of ``holder`` no longer stands for a running run, or None if it may."""
    if not holder:
        return "the lock file was empty or unreadable"
    pid, host = holder.get("pid"), holder.get("host")
    if me["job"] and holder.get("job") == me["job"]:
        return f"it was taken by an earlier attempt of SLURM job {me['job']} (pid {pid} on {host})"
    if host != me["host"] or not isinstance(pid, int):
        return None  # another host's process cannot be looked at from here
    if not _alive(pid):
        return f"pid {pid} on {host} has ended"
    if holder.get("start") is not None and _process_start(pid) != holder["start"]:
        return f"pid {pid} on {host} is another process now"
    return None


def _in_use_message(directory, path: Path, holder: dict) -> str:
    who = f"pid {holder.get('pid')} on host {holder.get('host')}"
    if holder.get("job"):
        who += f" (SLURM job {holder['job']})"
    since = f" since {holder['since']}" if holder.get("since") else ""
    run = f", run directory {holder['run_dir']}" if holder.get("run_dir") else ""
    return (
        f"checkpoint.dir {directory} is in use by {who}{since}{run}: one run writes a checkpoint directory at a "
        f"time. Wait for that run to end or set another checkpoint.dir; if that run is gone, delete {path}"
    )


@dataclass
class ResumePoint:
    """The checkpoint a run resumes from, and what was passed over to reach it (newest first)."""

    iteration: int
    path: Path
    passed_over: list[str] = field(default_factory=list)
    verified: bool = True  # False: a checkpoint without manifest.json (an older thdpack's)


def resume_point(directory: str | os.PathLike | None, check=None) -> ResumePoint | None:
    """The newest complete checkpoint under ``directory``: the tracker's, else (it is missing, or names a missing
    or damaged checkpoint) the newest other one that passes ``check(path) -> Damage | None`` (default:
    :func:`thdpack.megatron.checkpoint_manifest.verify` of every file). None when the directory holds no
    checkpoint; ValueError when it holds only damaged ones."""
    if directory is None or not Path(directory).is_dir():
        return None
    check = check or verify
    tracked = tracked_iteration(directory)
    found = iterations(directory)
    passed_over = []
    if (Path(directory) / TRACKER).exists() and tracked is None:
        passed_over.append(f"{Path(directory) / TRACKER} holds no iteration number")
    elif tracked is not None and tracked not in found:
        passed_over.append(
            f"{Path(directory) / TRACKER} names iteration {tracked}, whose directory is missing"
        )
    order = ([tracked] if tracked in found else []) + [i for i in found if i != tracked]
    for iteration in order:
        path = checkpoint_path(directory, iteration)
        damage: Damage | None = check(path)
        if damage is None:
            return ResumePoint(iteration, path, passed_over, verified=_has_manifest(path))
        passed_over.append(f"{path.name} is damaged: {damage}")
    if order or passed_over:
        raise ValueError(
            f"checkpoint.dir {directory} holds no complete checkpoint ({'; '.join(passed_over)}): move the damaged "
            "checkpoints aside to start from scratch"
        )
    return None


def _has_manifest(path: Path) -> bool:
    try:
        return read_manifest(path) is not None
    except Exception:  # noqa: BLE001 - verify() said the checkpoint is fine
        return False
