"""Persistent KV storage behind the radix tree: pages kept by their chained page hash.

A backend stores one payload (a page's KV bytes) per page hash, behind a small batch
interface: `exists` (how many leading pages are present), `get` (their payloads) and `set`.
Every stored page is framed with a header naming the `StorageIdentity` it was written under
(model, dtype, KV layout, page size) and a checksum of its payload, and a page's key is its
chained hash, which already starts from the tenant's namespace (`cache.hashing`). So two
models, or two tenants, never read each other's KV: a foreign, truncated or corrupted page
reads as missing, and is dropped.

Backends never raise for the store's own trouble (a full or read-only disk, a server gone):
the page is not stored or not found, the failure is logged once per kind and counted in
`stats`, and the caller recomputes.

    open_storage("file:/var/cache/radixserve", identity, max_bytes=50 * 2**30)
    open_storage("redis://127.0.0.1:6379", identity)
"""

from __future__ import annotations

import hashlib
import logging
import struct
import zlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

from radixserve.errors import InvalidArgumentError

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<4sH32s32sQI")  # magic, version, identity, page hash, length, crc32
_MAGIC = b"RSKV"
_VERSION = 1


@dataclass(frozen=True)
class StorageIdentity:
    """What KV bytes are only valid for: the model, the KV dtype and layout, the page size."""

    model: str  # the model file's hash, or its name and revision
    dtype: str
    layout: str  # e.g. "layers=30 kv_heads=3 head_dim=64 k,v"
    page_size: int

    def __post_init__(self) -> None:
        if not self.model:
            raise InvalidArgumentError("a storage identity needs the model's identity")
        if not isinstance(self.page_size, int) or self.page_size < 1:
            raise InvalidArgumentError(f"page_size must be an integer >= 1, got {self.page_size}")

    @property
    def digest(self) -> bytes:
        text = f"{self.model}\0{self.dtype}\0{self.layout}\0{self.page_size}"
        return hashlib.sha256(text.encode()).digest()


@dataclass
class StorageStats:
    """Counters a backend keeps (pages and bytes)."""

    hits: int = 0
    misses: int = 0
    rejected: int = 0  # present but foreign, truncated or corrupted
    stored: int = 0
    write_errors: int = 0
    read_errors: int = 0
    evicted: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    warned: set[str] = field(default_factory=set)

    def warn_once(self, kind: str, message: str, *args) -> None:
        if kind not in self.warned:
            self.warned.add(kind)
            log.warning(message, *args)


def frame(identity: bytes, page: bytes, payload: bytes) -> bytes:
    """`payload` with the header that lets `unframe` check it."""
    header = _HEADER.pack(_MAGIC, _VERSION, identity, page, len(payload), zlib.crc32(payload))
    return header + payload


def unframe(identity: bytes, page: bytes, data: bytes) -> bytes | None:
    """The payload of a framed page, or None when it is not this identity's copy of `page`
    or is truncated or corrupted."""
    if len(data) < _HEADER.size:
        return None
    magic, version, ident, key, length, crc = _HEADER.unpack_from(data)
    if magic != _MAGIC or version != _VERSION or ident != identity or key != page:
        return None
    payload = data[_HEADER.size :]
    if len(payload) != length or zlib.crc32(payload) != crc:
        return None
    return payload


class StorageBackend(ABC):
    """Pages of one `StorageIdentity`, keyed by their chained page hash (32 bytes)."""

    def __init__(self, identity: StorageIdentity) -> None:
        self.identity = identity
        self._id = identity.digest
        self.stats = StorageStats()

    def _checked(self, page: bytes, data: bytes, where: object) -> bytes | None:
        """The payload of `page` as read (`data`), counted as a hit; None when it is
        truncated, corrupted or foreign (counted, and logged once): the caller drops it."""
        payload = unframe(self._id, page, data)
        if payload is None:
            self.stats.rejected += 1
            self.stats.warn_once(
                "rejected",
                "KV storage page %s is truncated, corrupted or foreign; dropped and recomputed "
                "(further ones are counted, not logged)",
                where,
            )
            return None
        self.stats.hits += 1
        self.stats.bytes_read += len(data)
        return payload

    @abstractmethod
    def exists(self, pages: Sequence[bytes]) -> int:
        """How many of `pages`, from the first, are stored (a cheap check: a page counted
        here may still read as missing if it turns out corrupted)."""

    @abstractmethod
    def get(self, pages: Sequence[bytes]) -> list[bytes]:
        """The payloads of the leading `pages` that are stored and intact; stops at the first
        that is not (so the result is a prefix of `pages`)."""

    @abstractmethod
    def set(self, pages: Sequence[bytes], payloads: Sequence[bytes]) -> int:
        """Store each page's payload (a page already stored is kept as is); return how many
        leading pages are stored afterwards."""

    # The tier asks through these: `chain` is a sequence's page hashes from its first page,
    # and only the pages from `start` on are meant. A backend whose pages are self-describing
    # (a chained hash names its whole prefix) ignores the head; one that keeps pages as a tree
    # (the host tier) walks it.

    def chain_exists(self, chain: Sequence[bytes], start: int = 0) -> int:
        """`exists(chain[start:])`."""
        return self.exists(chain[start:])

    def chain_get(self, chain: Sequence[bytes], start: int = 0) -> list[bytes]:
        """`get(chain[start:])`."""
        return self.get(chain[start:])

    def chain_set(self, chain: Sequence[bytes], start: int, payloads: Sequence[bytes]) -> int:
        """`set(chain[start:], payloads)`."""
        return self.set(chain[start:], payloads)

    @abstractmethod
    def clear(self) -> int:
        """Remove every page of this identity; return how many."""

    def close(self) -> None:  # noqa: B027 (most backends hold nothing to release)
        """Release connections and files."""


def open_storage(uri: str, identity: StorageIdentity, **options) -> StorageBackend:
    """A backend by URI: `file:DIR` (or a plain path) or `redis://HOST:PORT[/DB]`."""
    if not isinstance(uri, str) or not uri:
        raise InvalidArgumentError("the storage URI is empty", field="hicache_storage")
    if uri.startswith("redis://") or uri.startswith("rediss://"):
        from radixserve.cache.storage.redis_backend import RedisStorage

        return RedisStorage(uri, identity, **options)
    if "://" in uri:
        raise InvalidArgumentError(
            f"unknown storage URI {uri!r}: use file:DIR or redis://HOST:PORT",
            field="hicache_storage",
        )
    from radixserve.cache.storage.file_backend import FileStorage

    return FileStorage(uri.removeprefix("file:"), identity, **options)
