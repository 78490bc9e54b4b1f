"""`file:DIR`: one file per page, written atomically, capped in size with LRU cleanup.

Layout: `DIR/<identity digest, 16 hex>/<page hash, 2 hex>/<page hash, 64 hex>.kv`. A page is
written to a temporary file in its final directory and renamed into place, so a reader sees
the whole page or none of it, and a crash leaves at most a stray `.tmp` (removed on open).
Recency is the files' modification time: a read touches the file, so the LRU order survives a
restart. With `max_bytes`, a write that takes the directory past the cap removes the least
recently used pages (of any identity) down to 90% of it.

Several processes may share a directory; each keeps its own view of the size, so the cap is
approximate then (each process holds the total it last saw plus its own writes).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from radixserve.cache.storage import StorageBackend, StorageIdentity, frame
from radixserve.errors import InvalidArgumentError


class FileStorage(StorageBackend):
    """Pages as files under `root` (see the module doc)."""

    def __init__(
        self, root: str | Path, identity: StorageIdentity, max_bytes: int | None = None
    ) -> None:
        super().__init__(identity)
        if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes < 1):
            raise InvalidArgumentError(f"max_bytes must be a positive integer, got {max_bytes!r}")
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.dir = self.root / self._id.hex()[:16]
        self._files: OrderedDict[Path, int] = OrderedDict()  # every page file, oldest first
        self._bytes = 0
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            self.stats.warn_once("mkdir", "KV storage %s is not usable (%s)", self.root, exc)
        self._scan()

    def _scan(self) -> None:
        found = []
        for path in self.root.glob("*/*/*"):
            try:
                if path.suffix == ".tmp":
                    path.unlink()
                    continue
                if path.suffix == ".kv":
                    st = path.stat()
                    found.append((st.st_mtime_ns, path, st.st_size))
            except OSError:
                continue
        for _, path, size in sorted(found):
            self._files[path] = size
            self._bytes += size

    def _path(self, page: bytes) -> Path:
        name = page.hex()
        return self.dir / name[:2] / f"{name}.kv"

    def size_bytes(self) -> int:
        """Bytes of page files in the directory, as this process last knew it."""
        return self._bytes

    def exists(self, pages: Sequence[bytes]) -> int:
        n = 0
        for page in pages:
            if not self._path(page).is_file():
                break
            n += 1
        return n

    def get(self, pages: Sequence[bytes]) -> list[bytes]:
        out = []
        for page in pages:
            path = self._path(page)
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                self.stats.misses += 1
                break
            except OSError as exc:
                self.stats.read_errors += 1
                self.stats.warn_once("read", "KV storage read failed (%s); recomputing", exc)
                break
            payload = self._checked(page, data, path)
            if payload is None:
                self._remove(path)
                break
            self._touch(path)
            out.append(payload)
        return out

    def set(self, pages: Sequence[bytes], payloads: Sequence[bytes]) -> int:
        if len(pages) != len(payloads):
            raise InvalidArgumentError("set needs one payload per page")
        done = 0
        for page, payload in zip(pages, payloads, strict=True):
            path = self._path(page)
            if path in self._files and path.is_file():
                self._touch(path)
                done += 1
                continue
            data = frame(self._id, page, payload)
            try:
                path.parent.mkdir(exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
                try:
                    with os.fdopen(fd, "wb") as f:
                        f.write(data)
                    os.replace(tmp, path)
                except BaseException:
                    Path(tmp).unlink(missing_ok=True)
                    raise
            except OSError as exc:
                self.stats.write_errors += 1
                self.stats.warn_once(
                    "write",
                    "KV storage write failed (%s); serving from device and host only",
                    exc,
                )
                break
            self._account(path, len(data))
            self.stats.stored += 1
            self.stats.bytes_written += len(data)
            done += 1
        if self.max_bytes is not None and self._bytes > self.max_bytes:
            self._shrink(int(self.max_bytes * 0.9))
        return done

    def clear(self) -> int:
        mine = [p for p in self._files if p.parent.parent == self.dir]
        for path in mine:
            self._remove(path)
        return len(mine)

    def _account(self, path: Path, size: int) -> None:
        self._bytes += size - self._files.pop(path, 0)
        self._files[path] = size

    def _touch(self, path: Path) -> None:
        if path in self._files:
            self._files.move_to_end(path)
        with contextlib.suppress(OSError):
            os.utime(path)

    def _remove(self, path: Path) -> None:
        self._bytes -= self._files.pop(path, 0)
        with contextlib.suppress(OSError):
            path.unlink()

    def _shrink(self, target: int) -> None:
        while self._bytes > target and self._files:
            path = next(iter(self._files))
            self._remove(path)
            self.stats.evicted += 1
