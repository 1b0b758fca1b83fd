"""Writing files so that nothing a user had is lost when something fails, and reading small
ones (configs, JSON) with their size and kind checked first.

Every file mha writes goes through `write_atomically`: its whole content is built in memory
first (the frameworks' writers never touch the disk), then Python writes it to a temporary
file beside the destination, flushes it to the disk, checks it, and only then moves it over
the destination in one step (`os.replace`). A failure at any point (a full disk, a file-size
limit, a check that does not pass) is an exception that leaves the destination as it was and
removes the temporary file.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import stat
import tempfile
from collections.abc import Callable
from typing import Any


def check_destination(path: str | os.PathLike) -> str:
    """The destination as a string, or a ValueError saying why it cannot be written: a
    folder, a FIFO, a device or a socket (a rename would put a file in its place), a folder
    that does not exist, or a file that may not be written. A link is replaced, as a file."""
    name = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(name))
    if os.path.isdir(name):
        raise ValueError(f"{name} is a directory; give a file name to write")
    with contextlib.suppress(FileNotFoundError):
        mode = os.lstat(name).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
            raise ValueError(
                f"{name} is not a regular file (a FIFO, a device or a socket); mha replaces "
                "files only, and leaves it as it is"
            )
    if not os.path.isdir(directory):
        raise ValueError(f"cannot write {name}: the folder {directory} does not exist")
    # The file is replaced by a rename, which its own permissions do not stop: checked here
    if os.path.isfile(name) and (not os.access(name, os.W_OK) or not os.stat(name).st_mode & 0o222):
        raise ValueError(f"{name} is read-only; it is left as it was (make it writable first)")
    try:  # the folder takes a new file (a read-only mount refuses even root): tried, not read
        tempfile.TemporaryFile(dir=directory).close()
    except OSError as error:
        raise ValueError(f"cannot write {name}: {error.strerror or error}") from None
    return name


def write_atomically(
    path: str | os.PathLike,
    content: bytes,
    *,
    suffix: str = ".tmp",
    check: Callable[[str], None] | None = None,
) -> None:
    """Write `content` to a temporary file beside `path`, flush it to the disk, run
    `check(temporary_path)`, then move it over `path`. `suffix` ends the temporary file's name
    (a reader may go by the ending).

    Only Python writes to the disk here, so a failed write is an OSError (a framework's
    writer, h5py's, may crash the process instead when the disk refuses a write).

    The new file keeps the permissions of the file it replaces, and its owner where the
    process may give it (root); a new file gets those of any file the process creates (0666
    less the umask), not the private 0600 of a temporary file.

    Raises:
        ValueError: `path` is a folder or its folder does not exist, or `check` refused.
        OSError: the file could not be written; `path` is left as it was.
    """
    name = check_destination(path)
    directory = os.path.dirname(os.path.abspath(name))

    def failed(error: OSError) -> OSError:  # named by the destination, not the temporary file
        return OSError(
            f"writing {name} failed: {error.strerror or error}; {name} is left as it was"
        )

    try:
        handle, temporary = tempfile.mkstemp(dir=directory, prefix=".mha-", suffix=suffix)
    except OSError as error:
        raise failed(error) from error
    try:
        try:
            _write_and_flush(handle, content)
        except OSError as error:
            raise failed(error) from error
        if check is not None:
            check(temporary)
        try:
            os.chmod(temporary, _mode_for(name))
            _keep_owner(temporary, name)
            os.replace(temporary, name)
        except OSError as error:
            raise failed(error) from error
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    _flush_folder(directory)


def _write_and_flush(handle: int, content: bytes) -> None:
    # The bytes reach the disk before the rename, so a power loss never leaves an empty file
    with open(handle, "wb", closefd=True) as file:
        file.write(content)
        file.flush()
        os.fsync(file.fileno())


def _flush_folder(directory: str) -> None:
    # The rename is on the disk too; the file is already in place, so a folder that cannot
    # be synced (some file systems refuse) is no failure of the write
    with contextlib.suppress(OSError):
        handle = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(handle)
        finally:
            os.close(handle)


def _mode_for(name: str) -> int:
    try:
        return stat.S_IMODE(os.stat(name).st_mode)
    except FileNotFoundError:
        return 0o666 & ~_umask()


def _keep_owner(temporary: str, name: str) -> None:
    # A file replaced by a privileged process stays its owner's; others cannot give files away
    if not hasattr(os, "chown"):
        return
    with contextlib.suppress(OSError):
        owner = os.stat(name)
        if (owner.st_uid, owner.st_gid) != (os.getuid(), os.getgid()):
            os.chown(temporary, owner.st_uid, owner.st_gid)


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


def check_source(path: str | os.PathLike) -> str:
    """The name of `path`, a regular file to read (a link to one counts), before anything
    opens it: opening a FIFO waits for a writer, and a device reads without end.

    Raises:
        ValueError: `path` is a folder, a FIFO, a device or a socket.
        FileNotFoundError: nothing is there.
    """
    name = os.fspath(path)
    if not stat.S_ISREG(os.stat(name).st_mode):
        raise ValueError(f"{name} is not a regular file (a folder, a FIFO or a device)")
    return name


def read_bytes(path: str | os.PathLike, limit: int) -> bytes:
    """The bytes of a small regular file (a config), its size checked against `limit` first.

    Raises:
        ValueError: the file holds more than `limit` bytes, or is not a regular file.
        OSError: it cannot be read.
    """
    with open(check_source(path), "rb") as file:
        size = os.fstat(file.fileno()).st_size
        if size > limit:
            raise ValueError(f"it holds {size} bytes, more than mha reads there ({limit})")
        return file.read(limit + 1)[:limit]


def parse_json(text: str | bytes) -> Any:
    """A JSON document whose objects name each key once (else the last would silently win).

    Raises:
        ValueError: it is not UTF-8 text or not JSON, names a key twice or nests deeper than
            Python's parser goes.
    """
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except RecursionError:
        raise ValueError("its JSON nests deeper than Python's parser goes") from None
    except UnicodeDecodeError as error:  # its repr would hold every byte it was given
        raise ValueError(f"it is not UTF-8 text ({error.reason} at byte {error.start})") from None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # Counted once, not per key: a header may name hundreds of thousands of tensors
    counts = collections.Counter(key for key, _ in pairs)
    twice = sorted(key for key, count in counts.items() if count > 1)
    if twice:
        raise ValueError(f"it names {', '.join(map(repr, twice))} more than once")
    return dict(pairs)


def check_zip_archive(path: str | os.PathLike) -> None:
    """Check a zip archive (torch's file format) before a reader unpacks it: its entries are
    stored, as torch writes them, within the file's size, and each matches its CRC-32 (torch
    checks none, so a damaged file would load as other numbers). Files that are not zip
    archives (torch's legacy format) pass unchecked.

    Raises:
        ValueError: an entry is compressed, larger than the file, named twice, or fails its
            checksum.
    """
    import zipfile

    if not zipfile.is_zipfile(path):
        return
    with zipfile.ZipFile(path) as archive:
        entries = archive.infolist()
        names = [entry.filename for entry in entries]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:  # torch would read one of them, whichever its reader finds
            raise ValueError(f"it holds more than one entry named {', '.join(twice)}")
        if any("/code/__torch__" in name for name in names):
            raise ValueError("it is a TorchScript archive (torch.jit.save), not a state_dict")
        for entry in entries:
            if entry.compress_type != zipfile.ZIP_STORED:
                raise ValueError(f"its entry {entry.filename} is compressed; torch stores each")
        if sum(entry.file_size for entry in entries) > os.path.getsize(path):
            raise ValueError("its entries declare more bytes than the file holds")
        damaged = archive.testzip()
        if damaged is not None:
            raise ValueError(f"its entry {damaged} fails its checksum: the file is damaged")
