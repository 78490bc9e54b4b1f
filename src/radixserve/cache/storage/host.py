"""The host tier's store: pages in this process's memory, least recently used out first.

It sits behind the same batch interface as the persistent backends, so the tier code that
loads storage pages back into device slots loads host pages the same way. Nothing here is
framed or checked: the bytes never leave the process. Thread-safe.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from radixserve.cache.hashing import leading_pages
from radixserve.cache.storage import StorageBackend, StorageIdentity
from radixserve.errors import InvalidArgumentError


class HostStorage(StorageBackend):
    """At most `max_bytes` of pages in RAM (see the module doc)."""

    def __init__(self, identity: StorageIdentity, max_bytes: int) -> None:
        super().__init__(identity)
        if not isinstance(max_bytes, int) or max_bytes < 1:
            raise InvalidArgumentError(f"the host tier needs a size > 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._pages: OrderedDict[bytes, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def size_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._pages)

    def exists(self, pages: Sequence[bytes]) -> int:
        with self._lock:
            return leading_pages(pages, self._pages)

    def get(self, pages: Sequence[bytes]) -> list[bytes]:
        out = []
        with self._lock:
            for page in pages:
                payload = self._pages.get(page)
                if payload is None:
                    self.stats.misses += 1
                    break
                self._pages.move_to_end(page)
                out.append(payload)
        self.stats.hits += len(out)
        self.stats.bytes_read += sum(len(p) for p in out)
        return out

    def set(self, pages: Sequence[bytes], payloads: Sequence[bytes]) -> int:
        if len(pages) != len(payloads):
            raise InvalidArgumentError("set needs one payload per page")
        with self._lock:
            for page, payload in zip(pages, payloads, strict=True):
                if page in self._pages:
                    self._pages.move_to_end(page)
                    continue
                self._pages[page] = payload
                self._bytes += len(payload)
                self.stats.stored += 1
                self.stats.bytes_written += len(payload)
            while self._bytes > self.max_bytes and self._pages:
                _, dropped = self._pages.popitem(last=False)
                self._bytes -= len(dropped)
                self.stats.evicted += 1
        return len(pages)

    def clear(self) -> int:
        with self._lock:
            n = len(self._pages)
            self._pages.clear()
            self._bytes = 0
        return n
