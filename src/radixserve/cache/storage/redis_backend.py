"""`redis://HOST:PORT[/DB]`: pages in a Redis server that several replicas or machines share.

A page is one Redis string, `radixserve:kv:<identity digest, 16 hex>:<page hash, 64 hex>`,
framed as every backend frames it. Batches go in one pipeline. Redis does its own eviction:
run the server with `maxmemory` and `maxmemory-policy allkeys-lru`, or give `ttl` (seconds)
so that pages expire; a read refreshes the TTL. A server that cannot be reached makes pages
read as missing and writes fail (logged once); serving goes on without it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from radixserve.cache.storage import StorageBackend, StorageIdentity, frame
from radixserve.errors import InvalidArgumentError


class RedisStorage(StorageBackend):
    """Pages in Redis (see the module doc). Needs the `redis` client (`pip install redis`)."""

    def __init__(
        self,
        uri: str,
        identity: StorageIdentity,
        ttl: float | None = None,
        timeout: float = 2.0,
    ) -> None:
        super().__init__(identity)
        try:
            import redis
        except ImportError:
            raise InvalidArgumentError(
                "redis:// storage needs the redis client: pip install 'radixserve[redis]'",
                field="hicache_storage",
            ) from None
        self._errors = (redis.RedisError, OSError)
        self.client = redis.Redis.from_url(
            uri, socket_timeout=timeout, socket_connect_timeout=timeout
        )
        self.ttl = None if ttl is None else max(1, int(ttl))
        self.prefix = f"radixserve:kv:{self._id.hex()[:16]}:"

    def _key(self, page: bytes) -> str:
        return self.prefix + page.hex()

    def exists(self, pages: Sequence[bytes]) -> int:
        if not pages:
            return 0
        try:
            pipe = self.client.pipeline(transaction=False)
            for page in pages:
                pipe.exists(self._key(page))
            present = pipe.execute()
        except self._errors as exc:
            self.stats.read_errors += 1
            self.stats.warn_once("read", "KV storage (redis) unreachable (%s)", exc)
            return 0
        n = 0
        for hit in present:
            if not hit:
                break
            n += 1
        return n

    def get(self, pages: Sequence[bytes]) -> list[bytes]:
        if not pages:
            return []
        try:
            found = self.client.mget([self._key(p) for p in pages])
        except self._errors as exc:
            self.stats.read_errors += 1
            self.stats.warn_once("read", "KV storage (redis) unreachable (%s); recomputing", exc)
            return []
        out = []
        for page, data in zip(pages, found, strict=True):
            if data is None:
                self.stats.misses += 1
                break
            payload = self._checked(page, data, self._key(page))
            if payload is None:
                self._delete(page)
                break
            out.append(payload)
        if out and self.ttl is not None:
            try:
                pipe = self.client.pipeline(transaction=False)
                for page in pages[: len(out)]:
                    pipe.expire(self._key(page), self.ttl)
                pipe.execute()
            except self._errors:
                pass
        return out

    def set(self, pages: Sequence[bytes], payloads: Sequence[bytes]) -> int:
        if len(pages) != len(payloads):
            raise InvalidArgumentError("set needs one payload per page")
        if not pages:
            return 0
        try:
            pipe = self.client.pipeline(transaction=False)
            for page, payload in zip(pages, payloads, strict=True):
                pipe.set(self._key(page), frame(self._id, page, payload), ex=self.ttl, nx=True)
            pipe.execute()
        except self._errors as exc:
            self.stats.write_errors += 1
            self.stats.warn_once(
                "write", "KV storage (redis) write failed (%s); serving without it", exc
            )
            return 0
        self.stats.stored += len(pages)
        self.stats.bytes_written += sum(len(p) for p in payloads)
        return len(pages)

    def clear(self) -> int:
        removed = 0
        try:
            for key in self.client.scan_iter(match=self.prefix + "*", count=1000):
                removed += self.client.delete(key)
        except self._errors as exc:
            self.stats.warn_once("write", "KV storage (redis) clear failed (%s)", exc)
        return removed

    def _delete(self, page: bytes) -> None:
        with contextlib.suppress(self._errors):
            self.client.delete(self._key(page))

    def close(self) -> None:
        self.client.close()
