"""Page hashes: a chained SHA-256 digest per page of token ids.

The digest of a page is `sha256(previous_digest + tokens)`, where `tokens` are the page's token
ids as int32 little-endian and `previous_digest` is the digest of the page before it. The first
page of a sequence chains from the namespace's seed: empty for the default namespace, so the
hashes of equal token sequences agree across processes and with other engines that use this
scheme, and `sha256(repr(extra_key))` for any other namespace, so equal tokens under different
adapters or salts never share a hash.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Container, Hashable, Sequence

import numpy as np

TOKEN_DTYPE = np.dtype("<i4")
TOKEN_BYTES = TOKEN_DTYPE.itemsize


def namespace_seed(extra_key: Hashable | None) -> bytes:
    """The digest the first page of a sequence in namespace `extra_key` chains from."""
    if extra_key is None:
        return b""
    return hashlib.sha256(repr(extra_key).encode()).digest()


def chain_page_hashes(token_bytes: bytes, page_size: int, previous: bytes) -> list[bytes]:
    """Digests of the whole pages in `token_bytes` (int32 LE tokens), chained from `previous`."""
    step = page_size * TOKEN_BYTES
    digests = []
    for start in range(0, len(token_bytes) - step + 1, step):
        previous = hashlib.sha256(previous + token_bytes[start : start + step]).digest()
        digests.append(previous)
    return digests


def hash_pages(token_ids: object, page_size: int, extra_key: Hashable | None = None) -> list[bytes]:
    """The chained digests of every whole page of `token_ids`, from the start of a sequence."""
    data = np.asarray(token_ids).astype(TOKEN_DTYPE, copy=False).tobytes()
    return chain_page_hashes(data, page_size, namespace_seed(extra_key))


def leading_pages(hashes: Sequence[bytes], held: Container[bytes]) -> int:
    """How many of `hashes`, from the first, `held` contains."""
    n = 0
    for h in hashes:
        if h not in held:
            break
        n += 1
    return n


def remember_pages(pages: OrderedDict[bytes, None], hashes: Sequence[bytes], cap: int) -> None:
    """Add `hashes` as the newest of `pages`, keeping at most `cap` (oldest out)."""
    for h in hashes:
        pages[h] = None
        pages.move_to_end(h)
    while len(pages) > cap:
        pages.popitem(last=False)
