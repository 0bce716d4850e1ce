"""Named shared-memory segments: files in /dev/shm (POSIX shared memory on Linux) mapped by several processes.

Every segment's name starts with its owner's prefix (`owner_prefix(pid)`: the front's process id), so that
`sweep(prefix)` removes whatever a crashed worker left behind, and nothing of another server. Python's
multiprocessing.shared_memory is not used: before 3.13 every process that attaches registers the segment with
its own resource tracker, which unlinks it when that process exits (and warns of a leak).
"""

from __future__ import annotations

import mmap
import os
import tempfile
from pathlib import Path

PREFIX = "hybridmoe-pd-"


def shm_dir() -> Path:
    """Where segments live: /dev/shm where the system has it, else the temporary directory."""
    path = Path("/dev/shm")
    return path if path.is_dir() and os.access(path, os.W_OK) else Path(tempfile.gettempdir())


def owner_prefix(pid: int | None = None) -> str:
    """The name prefix of the segments a front (pid, default this process) and its workers create."""
    return f"{PREFIX}{os.getpid() if pid is None else pid}-"


def list_segments(prefix: str = PREFIX) -> list[Path]:
    """Segments whose names start with prefix (default: every PD segment of this machine)."""
    return sorted(shm_dir().glob(prefix + "*"))


def sweep(prefix: str) -> int:
    """Remove every segment whose name starts with prefix; returns how many there were."""
    removed = 0
    for path in list_segments(prefix):
        try:
            path.unlink()
            removed += 1
        except FileNotFoundError:
            pass
    return removed


class Segment:
    """One mapped segment: `Segment.create(name, size)` or `Segment.attach(name)`; `buf` is its memory (read-only
    when mapped with readonly=True)."""

    def __init__(self, name: str, fd: int, size: int, readonly: bool = False):
        """Maps size bytes of the open segment fd (which it closes)."""
        self.name, self.size = name, size
        try:
            access = mmap.ACCESS_READ if readonly else mmap.ACCESS_WRITE
            self._map = mmap.mmap(fd, size, access=access) if size else None
        finally:
            os.close(fd)
        self.buf = memoryview(self._map) if self._map is not None else memoryview(b"")

    @staticmethod
    def create(name: str, size: int) -> "Segment":
        fd = os.open(shm_dir() / name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            os.unlink(shm_dir() / name)
            raise
        return Segment(name, fd, size)

    @staticmethod
    def attach(name: str) -> "Segment":
        try:
            fd = os.open(shm_dir() / name, os.O_RDWR)
        except FileNotFoundError:
            raise FileNotFoundError(f"shared-memory segment {name!r} does not exist (its sender died, or it was "
                                    "already taken)") from None
        return Segment(name, fd, os.fstat(fd).st_size)

    def close(self) -> None:
        """Unmap. Views of buf still held elsewhere (a traceback's frames) keep the mapping alive until they go."""
        try:
            self.buf.release()
            if self._map is not None:
                self._map.close()
        except BufferError:
            pass  # unmapped when the last view is collected
        self._map = None

    def unlink(self) -> None:
        try:
            os.unlink(shm_dir() / self.name)
        except FileNotFoundError:
            pass

    def __enter__(self) -> "Segment":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def remove(name: str) -> None:
    """Unlink segment `name` (no error when it is gone already)."""
    try:
        os.unlink(shm_dir() / name)
    except FileNotFoundError:
        pass
