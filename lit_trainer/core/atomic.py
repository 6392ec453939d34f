"""Atomic writes for checkpoints, exports and caches: write under a temporary name, then rename.

Shared by the callbacks (checkpoints, HF exports), the modules (the DPO reference log-prob cache) and the CLI (run
records), so it lives in ``core``, below all of them: callbacks never import modules, and modules need not import a
callbacks-private helper.

A reader (a resume, a ``from_pretrained`` call, a person listing the run folder) must never mistake a half-written
file for a complete one. Every helper here follows one protocol:

1. the data is written under a *partial* name in the same folder as the target (``.<name>.partial``), a hidden
   name that no checkpoint glob (``*.ckpt``, ``checkpoint-*``) matches;
2. the partial file or folder gets the modes a plain ``open``/``mkdir`` would give under the user's umask
   (``0o666 & ~umask`` for files, ``0o777 & ~umask`` for folders): writers that stage through ``mkstemp``, such
   as safetensors' ``save_file`` behind ``save_pretrained``, leave ``0o600``, which on a shared cluster nobody
   else could read; then it is flushed to disk (``fsync``);
3. it is renamed onto the target name with ``os.replace``, which is atomic on POSIX and Windows for files on one
   file system, and the parent folder is flushed so the rename itself survives a power loss.

A crash before step 3 leaves only the partial name behind; :func:`is_partial` recognises it, so resume logic can
skip it, and :func:`remove_partials` cleans such leftovers up. A write that *fails* (an ``OSError``: a full disk, an
I/O error) removes its partial file or folder at once; when the file system is full (``ENOSPC``, or ``EDQUOT`` for a
quota) the caller turns the error into a :class:`NoSpaceError` (:func:`no_space_error`), one line that names what
could not be written, the folder, the space needed when known and the space free.

Folders (an HF ``save_pretrained`` export, a sharded checkpoint) cannot be renamed over a non-empty folder in
one step. :func:`commit` therefore moves the old folder aside to ``.<name>.old`` first, renames the new one into
place, then deletes the old one. A crash between the two renames leaves *no* folder at the target name (never a
partial one) and the previous complete folder at ``.<name>.old``.

The partial name is deterministic (no random suffix) so that every rank of a distributed job computes the same
name without communicating; it assumes one writer per target at a time, which is how checkpoint callbacks work
(only global rank 0 writes).

These helpers only handle local paths; :func:`is_local_path` tells callers when to fall back to their default
(for example fsspec's own transactions for object stores).

Example:
    >>> import os, tempfile
    >>> folder = tempfile.mkdtemp()
    >>> target = os.path.join(folder, "weights.bin")
    >>> with atomic_write(target) as tmp:
    ...     with open(tmp, "wb") as f:
    ...         _ = f.write(b"complete")
    >>> sorted(os.listdir(folder))
    ['weights.bin']
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import fsspec.utils

PARTIAL_SUFFIX = ".partial"
OLD_SUFFIX = ".old"

_PathLike = str | os.PathLike
_NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})


class NoSpaceError(OSError):
    """A checkpoint or export could not be written because its file system is full (or over quota).

    Raised from the ``OSError`` the write met (``raise ... from error``); its partial file or folder was removed, so
    nothing under the target name changed. ``str(error)`` is one line (no ``[Errno 28]`` prefix) naming the target,
    the folder, the space needed when known and the space free; callers that know how to continue (the
    ``lit-trainer`` command) add it.

    Attributes:
        target: the path that was being written.
        needed: about how many bytes it needs (``None``: unknown).
    """

    def __init__(self, message: str, target: Path, needed: int | None, code: int = errno.ENOSPC) -> None:
        super().__init__(code, message)
        self.target = target
        self.needed = needed

    def __str__(self) -> str:
        return str(self.strerror)


def is_out_of_space(error: BaseException) -> bool:
    """Whether ``error`` is a write that found its file system full (``ENOSPC``) or its quota used up (``EDQUOT``)."""
    return isinstance(error, OSError) and error.errno in _NO_SPACE


def format_bytes(size: int) -> str:
    """``size`` in the largest binary unit below it, one decimal.

    Example:
        >>> format_bytes(512), format_bytes(7_340_032), format_bytes(3 * 2**30)
        ('512 bytes', '7.0 MiB', '3.0 GiB')
    """
    if size < 1024:
        return f"{size} bytes"
    value, units = size / 1024, ["KiB", "MiB", "GiB", "TiB"]
    while value >= 1024 and len(units) > 1:
        value, units = value / 1024, units[1:]
    return f"{value:.1f} {units[0]}"


def _free(folder: Path) -> int | None:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def _device(path: Path) -> int | None:
    try:
        return os.stat(path).st_dev
    except OSError:
        return None


def no_space_error(error: OSError, what: str, target: _PathLike, needed: int | None = None) -> NoSpaceError:
    """The one-line :class:`NoSpaceError` for ``error``, met while writing ``what`` (e.g. ``"the checkpoint"``) to
    ``target``, after its partial file or folder was removed.

    The folder named is the target's, or the one the failing write was in when the error names it elsewhere
    (Lightning stages a checkpoint in the system's temporary folder, ``$TMPDIR``, before it moves it into place).

    Args:
        error: the ``OSError`` (``ENOSPC`` or ``EDQUOT``).
        what: what was being written, for the message.
        target: the path it was being written to.
        needed: about how many bytes it needs, when known.

    Example:
        >>> import errno, tempfile
        >>> folder = tempfile.mkdtemp()
        >>> full = OSError(errno.ENOSPC, "No space left on device")
        >>> print(no_space_error(full, "the checkpoint", f"{folder}/last.ckpt", 2**20))  # doctest: +ELLIPSIS
        Could not write the checkpoint .../last.ckpt: no space left on device in ... (about 1.0 MiB needed, ... free)...
    """
    target = Path(target)
    written = error.filename2 or error.filename  # shutil's copy names its source and its destination
    folder = Path(os.fsdecode(written)).parent if written else target.parent
    if folder.resolve().is_relative_to(target.parent.resolve()):  # the target's partial name (or folder) beside it
        folder = target.parent
    reason = "disk quota exceeded" if error.errno == errno.EDQUOT else "no space left on device"
    free = _free(folder)
    sizes = [f"about {format_bytes(needed)} needed"] if needed else []
    sizes += [f"{format_bytes(free)} free"] if free is not None else []
    where = str(folder) if folder == target.parent else f"{folder}, where it is written before it is moved into place"
    message = f"Could not write {what} {target}: {reason} in {where}" + (f" ({', '.join(sizes)})" if sizes else "")
    temp = Path(tempfile.gettempdir())
    if not written and _device(temp) not in (None, _device(folder)) and (temp_free := _free(temp)) is not None:
        message += f" (it may be staged in {temp} first, which has {format_bytes(temp_free)} free)"
    message += f". The partial write was removed; nothing was written under {target.name}."
    return NoSpaceError(message, target, needed, error.errno or errno.ENOSPC)


def is_local_path(path: _PathLike) -> bool:
    """Whether ``path`` is on the local file system (no ``s3://``-style protocol).

    Args:
        path: A file or folder path, possibly an fsspec URL.

    Returns:
        True for plain paths and ``file://`` URLs.
    """
    return fsspec.utils.get_protocol(str(path)) in ("file", "local")


def partial_path(final: _PathLike) -> Path:
    """The temporary name used while ``final`` is being written: ``<dir>/.<name>.partial``.

    Args:
        final: The path the data will have once complete.

    Returns:
        A sibling path in the same folder (so the final rename stays on one file system).
    """
    final = Path(final)
    return final.with_name(f".{final.name}{PARTIAL_SUFFIX}")


def is_partial(path: _PathLike) -> bool:
    """Whether ``path`` is an unfinished write (a partial name or a moved-aside old folder).

    Args:
        path: Any path.

    Returns:
        True when the name was produced by :func:`partial_path` or by :func:`commit`'s move-aside step.
    """
    name = Path(path).name
    return name.startswith(".") and (name.endswith(PARTIAL_SUFFIX) or name.endswith(OLD_SUFFIX))


def _fsync_one(path: Path) -> None:
    """Flush one file or one folder entry table to disk; silently skipped where the OS does not support it."""
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if path.is_dir() else 0)
    try:
        fd = os.open(path, flags)
    except OSError:  # e.g. folders cannot be opened on Windows
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    """Flush a file, or every file and sub-folder of a folder, to disk."""
    if not path.is_dir():
        _fsync_one(path)
        return
    for root, _, files in os.walk(path):
        for name in files:
            _fsync_one(Path(root) / name)
        _fsync_one(Path(root))


def current_umask() -> int:
    """The process's umask, read without changing it where Linux shows it (``/proc/self/status``).

    Elsewhere it is read by setting a restrictive mask (``0o077``) for an instant and restoring it, so a file another
    thread creates meanwhile is at worst private, never more open than asked.

    Returns:
        The umask, e.g. ``0o022``.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def apply_umask(path: _PathLike) -> None:
    """Give a file, or a folder and everything in it, the modes the user's umask gives new files and folders.

    Files get ``0o666 & ~umask`` (``0o777 & ~umask`` when any execute bit is set), folders ``0o777 & ~umask``;
    symbolic links are left alone. :func:`commit` calls it on the temporary path before the rename.

    Args:
        path: A local file or folder.
    """
    umask = current_umask()

    def chmod(p: Path) -> None:
        mode = os.lstat(p).st_mode
        if stat.S_ISLNK(mode):
            return
        full = 0o777 if stat.S_ISDIR(mode) or mode & 0o111 else 0o666
        os.chmod(p, full & ~umask)

    path = Path(path)
    chmod(path)
    if path.is_dir() and not path.is_symlink():
        for root, dirs, files in os.walk(path):
            for name in dirs + files:
                chmod(Path(root) / name)


def discard(path: _PathLike) -> None:
    """Delete a file, link or folder (with its content); nothing happens when it does not exist."""
    _remove(Path(path))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def commit(tmp: _PathLike, final: _PathLike, *, fsync: bool = True) -> None:
    """Move a finished temporary file or folder onto its final name.

    Args:
        tmp: The completely written temporary file or folder (usually :func:`partial_path` of ``final``).
        final: The target name. An existing file is replaced atomically; an existing folder is moved aside to
            ``.<name>.old``, replaced, then deleted. It gets the umask's modes (:func:`apply_umask`).
        fsync: Flush the data and the parent folder to disk before and after the rename.

    Raises:
        FileNotFoundError: If ``tmp`` does not exist.
    """
    tmp, final = Path(tmp), Path(final)
    if not (tmp.exists() or tmp.is_symlink()):
        raise FileNotFoundError(f"commit({str(tmp)!r}, {str(final)!r}): the temporary path does not exist.")
    apply_umask(tmp)
    if fsync:
        _fsync_tree(tmp)
    if tmp.is_dir() and final.is_dir() and not final.is_symlink():
        old = final.with_name(f".{final.name}{OLD_SUFFIX}")
        _remove(old)
        os.replace(final, old)
        os.replace(tmp, final)
        _remove(old)
    else:
        if final.is_dir() and not final.is_symlink():
            shutil.rmtree(final)
        os.replace(tmp, final)
    if fsync:
        _fsync_one(final.parent)


@contextlib.contextmanager
def _staged(final: _PathLike, fsync: bool, directory: bool) -> Iterator[Path]:
    """The temporary path of ``final`` (an empty folder if ``directory``), committed if the block succeeds."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = partial_path(final)
    _remove(tmp)
    if directory:
        tmp.mkdir()
    try:
        yield tmp
        commit(tmp, final, fsync=fsync)
    except BaseException:
        _remove(tmp)
        raise


def atomic_write(final: _PathLike, *, fsync: bool = True) -> contextlib.AbstractContextManager[Path]:
    """Context manager giving a temporary file path that becomes ``final`` only if the block succeeds.

    Args:
        final: The file to create or replace.
        fsync: See :func:`commit`.

    Yields:
        The temporary path to write to (its folder exists; the file does not).

    Raises:
        Exception: Whatever the block raises; the temporary file is then removed and ``final`` is untouched.

    Example:
        >>> import os, tempfile
        >>> target = os.path.join(tempfile.mkdtemp(), "a.txt")
        >>> with atomic_write(target) as tmp:
        ...     _ = tmp.write_text("hello")
        >>> open(target).read()
        'hello'
    """
    return _staged(final, fsync, directory=False)


def atomic_directory(final: _PathLike, *, fsync: bool = True) -> contextlib.AbstractContextManager[Path]:
    """Context manager giving an empty temporary folder that becomes ``final`` only if the block succeeds.

    Use it for multi-file outputs such as ``model.save_pretrained(tmp)`` + ``tokenizer.save_pretrained(tmp)``.
    ``final`` is the folder to create or replace as a whole (its old content is not merged); it yields the
    temporary folder (created, empty); ``fsync`` and a failing block are handled as by :func:`atomic_write`.

    Example:
        >>> import os, tempfile
        >>> target = os.path.join(tempfile.mkdtemp(), "best")
        >>> with atomic_directory(target) as tmp:
        ...     _ = (tmp / "config.json").write_text("{}")
        >>> os.listdir(target)
        ['config.json']
    """
    return _staged(final, fsync, directory=True)


def remove_partials(folder: _PathLike) -> list[Path]:
    """Delete leftovers of interrupted writes (names for which :func:`is_partial` is true) directly in ``folder``.

    Call it only where no write is in progress (for example on global rank 0 before training starts).

    Args:
        folder: The folder to clean; a missing folder is fine.

    Returns:
        The removed paths.
    """
    folder = Path(folder)
    if not folder.is_dir():
        return []
    removed = [p for p in folder.iterdir() if is_partial(p)]
    for p in removed:
        _remove(p)
    return removed
