"""Outputs that replace earlier ones whole: a crash at any moment leaves the old result or
the new one, never a mix, plus at most a temporary entry that the next write names and
removes.

``replace_dir(out)`` is for a directory that is one result (an exported head, a converted
head): the new one is written into the sibling ``.NAME.tmp-PID``, then the old one is
renamed to ``.NAME.old-PID``, the new one to ``NAME``, and the old one removed.
``replace_files(src, dest, names, key)`` is for a group of files that lives in a shared
directory (the device check's JSON and plot in ``docs/results``): the old files move into
``dest/.KEY.old-PID`` (beside a manifest saying which existed), the new ones in from
``src``, and the backup is marked done (``.KEY.done-PID``) before it is removed.

``recover(out)`` (called by both before they write) finishes what a killed writer left:

- a backup directory without ``out``: the kill came between the two renames, so the old
  directory is put back;
- a backup directory beside a complete ``out``: the kill came after the new one was in
  place, so the backup is removed;
- a file group's backup with its manifest: the old files are put back and the new ones of
  the group removed (the swap had not finished); one marked done is removed;
- a temporary directory: an unfinished write, removed.

Entries of a process that is still running on this host are left alone. Each step says on
stderr what it did, naming the entry.

``kill_point(name)``: a test hook. With ``SPECJAX_KILL_AT=name`` in the environment the
process kills itself (SIGKILL) there, as a crash at that moment would; the points are named
in ``POINTS``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

KILL_ENV = "SPECJAX_KILL_AT"
MANIFEST = ".specjax-swap.json"  # in a file group's backup: which files it replaces

POINTS = ("written",         # the new result is complete in its temporary directory
          "old-moved",       # the old result is in its backup; the new one not yet in place
          "new-placed",      # the new result is in place; the backup not yet removed
          "half-placed",     # replace_files: the first new file is in place, not the rest
          "device-check-saved")  # scripts/device_check.py: a measurement saved mid-run


def plain_mode(f: str | Path) -> None:
    """Gives the file ``f`` the mode ``open(f, "w")`` would (0666 less the umask):
    safetensors' ``save_file`` creates its files 0600, which other users of a shared
    filesystem (a cluster's home, a team's head directory) could not read."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(f, 0o666 & ~mask)


class OutputError(ValueError):
    """An output that cannot be written where it was asked (one line naming what to fix)."""


def kill_point(name: str) -> None:
    """SIGKILL this process when ``SPECJAX_KILL_AT`` is ``name`` (a test hook)."""
    if os.environ.get(KILL_ENV) == name:
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def temp_path(out: Path, pid: int | None = None) -> Path:
    """The temporary sibling a write of ``out`` by process ``pid`` (this one) goes to."""
    return out.with_name(f".{out.name}.tmp-{os.getpid() if pid is None else pid}")


def backup_path(out: Path, pid: int | None = None) -> Path:
    """Where the old ``out`` waits while process ``pid`` (this one) puts the new one in."""
    return out.with_name(f".{out.name}.old-{os.getpid() if pid is None else pid}")


def _done_path(out: Path, pid: int | None = None) -> Path:
    return out.with_name(f".{out.name}.done-{os.getpid() if pid is None else pid}")


def _alive(pid: int) -> bool:
    """Whether another process ``pid`` runs on this host (this one counts as not: a
    leftover of its own is from a write that failed)."""
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def _leftovers(out: Path) -> dict[str, list[Path]]:
    """The siblings of ``out`` that dead writers left, by kind (tmp, old, done), newest
    first."""
    found: dict[str, list[Path]] = {"tmp": [], "old": [], "done": []}
    pat = re.compile(r"^\." + re.escape(out.name) + r"\.(tmp|old|done)-(\d+)$")
    try:
        entries = list(out.parent.iterdir())
    except OSError:  # no parent yet, or not readable: nothing to recover
        return found
    for p in entries:
        m = pat.match(p.name)
        if m and not _alive(int(m.group(2))):
            found[m.group(1)].append(p)
    for v in found.values():
        v.sort(key=lambda p: p.lstat().st_mtime, reverse=True)
    return found


def _say(msg: str) -> None:
    print(f"specjax: {msg}", file=sys.stderr, flush=True)


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    else:
        p.unlink(missing_ok=True)


def recover(out: str | Path, group: bool = False) -> list[str]:
    """Finishes or rolls back what writers of ``out`` that were killed left beside it (see
    the module's docstring); ``group``: ``out`` names a file group of ``replace_files``
    (``dest / key``), not a directory. Returns the lines it said."""
    out = Path(out).absolute()
    said: list[str] = []

    def say(msg: str) -> None:
        said.append(msg)
        _say(msg)

    left = _leftovers(out)
    for old in left["old"]:
        if group:
            _roll_back_files(old, out.parent, say)
        elif not os.path.lexists(out):
            os.rename(old, out)
            say(f"restored {out} from {old.name}: a write of it was killed between its renames")
        else:
            _remove(old)
            say(f"removed {old}: the previous {out.name}, left by a write killed after the new "
                f"one was in place")
    for p in left["done"] + left["tmp"]:
        _remove(p)
        say(f"removed {p}: an unfinished write of {out.name} left by a killed process")
    return said


@contextmanager
def replace_dir(out: str | Path, what: str | None = None) -> Iterator[Path]:
    """Yields an empty temporary directory beside ``out``; when the block ends without an
    exception, that directory replaces ``out`` whole (old -> backup, new -> ``out``, backup
    removed). On an exception the temporary directory is removed and ``out`` is unchanged.
    ``OutputError`` (one line, naming ``what``, default ``out``) when ``out``'s directory
    cannot hold it: below a file, or not writable."""
    out = Path(out).absolute()
    name = what or str(out)
    recover(out)
    tmp = temp_path(out)
    _make_parent(out, name)
    try:
        tmp.mkdir()
    except OSError as e:
        raise OutputError(f"{name} cannot be written: {e.strerror or e} ({out.parent})") from None
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    kill_point("written")
    backup = backup_path(out)
    had = os.path.lexists(out)
    if had:
        os.rename(out, backup)
    kill_point("old-moved")
    os.rename(tmp, out)
    kill_point("new-placed")
    if had:
        _remove(backup)


def _make_parent(out: Path, name: str) -> None:
    """Creates ``out``'s parent directories; ``OutputError`` naming the file in the way or
    the directory that cannot be written."""
    _check_parent(out, name)
    out.parent.mkdir(parents=True, exist_ok=True)


def _check_parent(out: Path, name: str) -> None:
    """``OutputError`` unless ``out``'s nearest existing ancestor is a directory this
    process may write to."""
    probe = out.parent
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise OutputError(f"{name} cannot be written: {probe} is a file, not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise OutputError(f"{name} cannot be written: {probe} is not writable")


def check_writable(out: str | Path, what: str | None = None) -> None:
    """``OutputError`` (one line, naming ``what``) unless ``replace_dir(out)`` could write:
    ``out`` is absent or a directory, below a directory this process may write to."""
    out = Path(out).absolute()
    name = what or str(out)
    if os.path.lexists(out) and not out.is_dir():
        raise OutputError(f"{name} is a file; give a directory path")
    _check_parent(out, name)


# ----------------------------------------------------------------------------- file groups

def replace_files(src: Path, dest: Path, names: Sequence[str], key: str) -> None:
    """Moves the files ``names`` of ``src`` into ``dest`` as one group: the group's earlier
    files (those of ``names`` already in ``dest``) are kept in ``dest/.KEY.old-PID`` until
    every new one is in place, so a kill leaves the old group or the new one
    (``recover(dest / key)`` rolls an unfinished swap back). A name missing from ``src``
    leaves the group without that file."""
    src, dest = Path(src).absolute(), Path(dest).absolute()
    target = dest / key
    backup = backup_path(target)
    dest.mkdir(parents=True, exist_ok=True)
    backup.mkdir()
    old = [n for n in names if os.path.lexists(dest / n)]
    tmp = backup / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"old": old, "names": list(names)}))
    os.replace(tmp, backup / MANIFEST)
    for n in old:
        os.rename(dest / n, backup / n)
    kill_point("old-moved")
    for i, n in enumerate(names):
        if (src / n).exists():
            os.replace(src / n, dest / n)
            if i == 0:
                kill_point("half-placed")
    done = _done_path(target)
    os.rename(backup, done)  # the commit: a recovery now keeps the new group
    kill_point("new-placed")
    _remove(done)


def _roll_back_files(backup: Path, dest: Path, say) -> None:
    """Puts back the file group ``backup`` holds (its manifest names the group and which
    files existed), removing the new files of the group."""
    try:
        man = json.loads((backup / MANIFEST).read_text())
        old, names = set(man["old"]), list(man["names"])
    except (OSError, ValueError, KeyError, TypeError):  # no manifest yet: nothing was moved
        _remove(backup)
        return
    for n in names:
        if (backup / n).exists():
            os.replace(backup / n, dest / n)
        elif n not in old and os.path.lexists(dest / n):
            (dest / n).unlink()
    _remove(backup)
    say(f"restored {', '.join(n for n in names if n in old) or 'nothing'} in {dest} from "
        f"{backup.name}: a replacement of them was killed before it finished")


def recover_files(dest: str | Path, key: str) -> list[str]:
    """``recover`` for the file group ``key`` in ``dest`` (``replace_files``)."""
    return recover(Path(dest).absolute() / key, group=True)


__all__ = ["OutputError", "replace_dir", "replace_files", "recover", "recover_files",
           "check_writable", "kill_point", "temp_path", "backup_path", "KILL_ENV", "POINTS"]
