"""Writing files so that nothing a user had is lost when something fails.

Every file mha writes goes through `write_atomically`: the new content is written to a
temporary file beside the destination, checked, and only then moved over the destination in
one step (`os.replace`). A failure at any point (a full disk, an error while writing, a check
that does not pass) leaves the destination as it was and removes the temporary file.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Callable


def check_destination(path: str | os.PathLike) -> str:
    """The destination as a string, or a ValueError saying why it cannot be written."""
    name = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(name))
    if os.path.isdir(name):
        raise ValueError(f"{name} is a directory; give a file name to write")
    if not os.path.isdir(directory):
        raise ValueError(f"cannot write {name}: the folder {directory} does not exist")
    return name


def write_atomically(
    path: str | os.PathLike,
    write: Callable[[str], None],
    *,
    suffix: str = ".tmp",
    check: Callable[[str], None] | None = None,
    size: int | None = None,
) -> None:
    """Write a file through `write(temporary_path)`, then `check(temporary_path)`, then move it
    over `path`. `suffix` ends the temporary file's name (some writers ask for an ending).

    `size`, about the bytes the file will take, is checked against the free space first: a
    writer that runs out of disk may crash the process (h5py does) before it can clean up.

    The new file keeps the permissions of the file it replaces; a new file gets those of any
    file the process creates (0666 less the umask), not the private 0600 of a temporary file.
    """
    name = check_destination(path)
    directory = os.path.dirname(os.path.abspath(name))
    if size is not None:
        free = shutil.disk_usage(directory).free
        if free < size:
            raise OSError(
                f"not enough free space to write {name}: it takes about {size} bytes and "
                f"{free} are free; {name} is left as it was"
            )
    handle, temporary = tempfile.mkstemp(dir=directory, prefix=".mha-", suffix=suffix)
    os.close(handle)
    try:
        write(temporary)
        if check is not None:
            check(temporary)
        os.chmod(temporary, _mode_for(name))
        os.replace(temporary, name)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


def _mode_for(name: str) -> int:
    try:
        return stat.S_IMODE(os.stat(name).st_mode)
    except FileNotFoundError:
        return 0o666 & ~_umask()


def _umask() -> int:
    # Read where the system tells it; setting it to read it back races with other threads
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def read_bytes(path: str | os.PathLike, limit: int) -> bytes:
    """The bytes of a small file (a config), its size checked against `limit` first.

    Raises:
        ValueError: the file holds more than `limit` bytes.
        OSError: it cannot be read.
    """
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        if size > limit:
            raise ValueError(f"it holds {size} bytes, more than a config may ({limit})")
        return file.read(limit + 1)[:limit]
