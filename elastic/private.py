"""Files only their owner can read or steer: run directories, checkpoints, records, keys.

Every directory a run writes into is created 0700, and an existing one is used only if it is
this user's and nobody else can write to it (someone who can write to a folder can plant links
or files in it). Files are created 0600. A file is replaced through a fresh temporary name
opened with `O_EXCL | O_NOFOLLOW`, then renamed over the target (a rename replaces a planted
link, it never writes through it); a file that is appended to is opened with `O_NOFOLLOW` and
must be a regular file of this user with one link.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Iterable

from elastic.errors import ConfigError

_NOFOLLOW_CREATE = os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC


def refusal(path: str, st: os.stat_result) -> str | None:
    """Why a directory is not private to this user, or None if it is."""
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    if st.st_uid != os.geteuid():
        return (f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}): "
                "whoever owns it can replace what the run writes there")
    if st.st_mode & 0o022:
        return (f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}): "
                f"they could plant files or links in it; run `chmod go-w {path}`")
    return None


def make_private_dirs(path: str) -> None:
    """Creates `path` and its missing parents, each with mode 0700 (`os.makedirs` gives the
    parents 0777 less the umask: `~/.elastic` was readable by all, listing run names).
    Existing folders are left as they are."""
    missing = []
    head = os.path.abspath(path)
    while not os.path.isdir(head):
        missing.append(head)
        parent = os.path.dirname(head)
        if parent == head:
            break
        head = parent
    for folder in reversed(missing):
        with contextlib.suppress(FileExistsError):  # made meanwhile by another process
            os.mkdir(folder, 0o700)


def ensure_private_dir(path: str, setting: str) -> None:
    """Creates `path` (and missing parents) with mode 0700, or checks that an existing
    directory is this user's and writable by no one else.

    Args:
        path: the directory.
        setting: the setting that chose it, named in the error.

    Raises:
        ConfigError: the directory is another user's, writable by group or others, not a
            directory, or cannot be created.
    """
    try:
        make_private_dirs(path)
        st = os.stat(path)
    except OSError as e:
        raise ConfigError(f"{setting} {path!r} cannot be created: {e}") from e
    why = refusal(path, st)
    if why is not None:
        raise ConfigError(f"refusing {setting} {path!r}: {why}; choose another directory")


def write_private(path: str, data: bytes | Iterable[bytes], fsync: bool = True) -> None:
    """Replaces `path` with `data` (bytes, or chunks of them written as they come)
    atomically: a 0600 file under a fresh name, then renamed."""
    directory, base = os.path.split(path)
    tmp = os.path.join(directory, f".{base}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_EXCL | _NOFOLLOW_CREATE, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in (data,) if isinstance(data, bytes) else data:
                f.write(chunk)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def open_private_append(path: str) -> int:
    """A descriptor that appends to `path` (created 0600); never follows a link.

    Raises:
        ConfigError: `path` is a link, not a regular file, another user's, or has other
            hard links (each one a way for someone else to read or steer it).
    """
    try:
        # O_NONBLOCK: opening a planted FIFO must fail, not wait for a reader.
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK | _NOFOLLOW_CREATE, 0o600)
    except OSError as e:
        if os.path.islink(path):
            raise ConfigError(f"refusing to write {path}: it is a symbolic link (a run's "
                              "files are never written through a link); remove it") from e
        if os.path.lexists(path) and not stat.S_ISREG(os.lstat(path).st_mode):
            raise ConfigError(f"refusing to write {path}: it is not a regular file; "
                              "remove it") from e
        raise
    st = os.fstat(fd)
    why = None
    if not stat.S_ISREG(st.st_mode):
        why = "it is not a regular file"
    elif st.st_uid != os.geteuid():
        why = f"it belongs to uid {st.st_uid}"
    elif st.st_nlink != 1:
        why = f"it has {st.st_nlink} hard links"
    if why is not None:
        os.close(fd)
        raise ConfigError(f"refusing to write {path}: {why}; remove it")
    return fd
