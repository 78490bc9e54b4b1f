"""KV storage backends: pages by chained hash, checked on read, isolated by model and tenant,
and never an exception for the store's own trouble. The file backend runs everywhere; the
Redis one against a real `redis-server` started here on loopback (skipped without it)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import numpy as np
import pytest

from radixserve.cache.hashing import hash_pages
from radixserve.cache.storage import StorageIdentity, frame, open_storage, unframe
from radixserve.errors import InvalidArgumentError

MODEL = StorageIdentity("smollm2-135m@sha256:ab12", "float32", "layers=2 kv_heads=1 dim=8", 4)


def pages(n: int, extra_key=None, start: int = 1) -> list[bytes]:
    return hash_pages(np.arange(start, start + 4 * n), 4, extra_key)


def payloads(n: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(64).astype(np.float32).tobytes() for _ in range(n)]


def test_frames_reject_foreign_truncated_and_corrupted_pages():
    ident, [page, other] = MODEL.digest, pages(2)
    data = frame(ident, page, b"kv bytes")
    assert unframe(ident, page, data) == b"kv bytes"
    assert unframe(ident, other, data) is None  # another page's file under this name
    foreign = StorageIdentity(MODEL.model, "bfloat16", MODEL.layout, 4).digest
    assert unframe(foreign, page, data) is None  # same model, other dtype
    assert unframe(ident, page, data[:-1]) is None
    flipped = bytearray(data)
    flipped[-1] ^= 1
    assert unframe(ident, page, bytes(flipped)) is None


def test_identity_names_model_dtype_layout_and_page_size():
    digests = {
        MODEL.digest,
        StorageIdentity("other-model", MODEL.dtype, MODEL.layout, 4).digest,
        StorageIdentity(MODEL.model, "bfloat16", MODEL.layout, 4).digest,
        StorageIdentity(MODEL.model, MODEL.dtype, "layers=3", 4).digest,
        StorageIdentity(MODEL.model, MODEL.dtype, MODEL.layout, 8).digest,
    }
    assert len(digests) == 5
    with pytest.raises(InvalidArgumentError):
        StorageIdentity("", "float32", "x", 4)
    with pytest.raises(InvalidArgumentError):
        StorageIdentity("m", "float32", "x", 0)


def test_bad_uris_are_refused():
    with pytest.raises(InvalidArgumentError, match="unknown storage URI"):
        open_storage("s3://bucket", MODEL)
    with pytest.raises(InvalidArgumentError, match="empty"):
        open_storage("", MODEL)


def _file(tmp_path, identity=MODEL, **options):
    return open_storage(f"file:{tmp_path}", identity, **options)


def test_file_pages_round_trip_and_survive_a_restart(tmp_path):
    store = _file(tmp_path)
    keys, values = pages(5), payloads(5)
    assert store.exists(keys) == 0
    assert store.set(keys[:3], values[:3]) == 3
    assert store.exists(keys) == 3  # the leading pages only
    assert store.get(keys) == values[:3]
    assert store.set(keys[1:3], values[1:3]) == 2  # already there: kept
    restarted = _file(tmp_path)
    assert restarted.get(keys[:3]) == values[:3]
    assert restarted.size_bytes() == store.size_bytes() > 3 * 256
    assert not list(tmp_path.rglob("*.tmp"))


def test_two_models_or_two_tenants_never_share_pages(tmp_path):
    store = _file(tmp_path)
    store.set(pages(3), payloads(3))
    other_model = _file(tmp_path, StorageIdentity("other", "float32", MODEL.layout, 4))
    assert other_model.exists(pages(3)) == 0 and other_model.get(pages(3)) == []
    assert store.exists(pages(3, extra_key="tenant-b")) == 0  # the salt changes every hash


def test_file_damage_reads_as_missing_and_is_dropped(tmp_path, caplog):
    store = _file(tmp_path)
    keys, values = pages(4), payloads(4)
    store.set(keys, values)
    files = {p.name: p for p in tmp_path.rglob("*.kv")}
    second = files[f"{keys[1].hex()}.kv"]
    second.write_bytes(second.read_bytes()[:-7])  # truncated
    assert store.get(keys) == values[:1]
    assert not second.exists() and store.stats.rejected == 1
    assert "truncated, corrupted or foreign" in caplog.text
    third = files[f"{keys[2].hex()}.kv"]
    shutil.copy(files[f"{keys[3].hex()}.kv"], third)  # another page's file under its name
    store.set(keys[1:2], values[1:2])
    assert store.get(keys) == values[:2]
    assert not third.exists()
    assert caplog.text.count("truncated, corrupted or foreign") == 1  # logged once


def test_the_size_cap_removes_least_recently_used_pages(tmp_path):
    one = len(frame(MODEL.digest, pages(1)[0], payloads(1)[0]))
    store = _file(tmp_path, max_bytes=10 * one)
    a, b = pages(6, start=1), pages(6, start=1000)
    store.set(a, payloads(6))
    store.get(a[:2])  # recently read: kept
    store.set(b, payloads(6, seed=1))
    assert store.size_bytes() <= 10 * one
    assert store.stats.evicted >= 2
    assert store.exists(a[:2]) == 2
    assert store.exists(b) == 6
    assert store.exists(a[2:]) == 0


def test_a_read_only_disk_warns_once_and_leaves_no_temporary_files(tmp_path, monkeypatch, caplog):
    store = _file(tmp_path)
    store.set(pages(1), payloads(1))

    def read_only(*args, **kwargs):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr("radixserve.cache.storage.file_backend.os.replace", read_only)
    assert store.set(pages(3, start=500), payloads(3)) == 0
    assert store.set(pages(3, start=900), payloads(3)) == 0
    assert store.get(pages(1)) == payloads(1)  # what is there still reads
    assert store.stats.write_errors == 2
    assert caplog.text.count("KV storage write failed") == 1
    assert not list(tmp_path.rglob("*.tmp"))


def test_a_full_disk_keeps_serving(tmp_path, monkeypatch, caplog):
    store = _file(tmp_path)

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("radixserve.cache.storage.file_backend.tempfile.mkstemp", full)
    assert store.set(pages(2), payloads(2)) == 0
    assert store.get(pages(2)) == []
    assert "No space left on device" in caplog.text


def test_a_writer_killed_mid_write_leaves_no_partial_page(tmp_path):
    """kill -9 a process that writes pages as fast as it can: after a restart every page that
    is visible reads back whole, and no temporary file is left."""
    import signal
    import sys
    import textwrap

    script = textwrap.dedent(
        f"""
        import numpy as np
        from radixserve.cache.hashing import hash_pages
        from radixserve.cache.storage import StorageIdentity, open_storage
        identity = StorageIdentity({MODEL.model!r}, {MODEL.dtype!r}, {MODEL.layout!r}, 4)
        store = open_storage({f"file:{tmp_path}"!r}, identity)
        payload = bytes(range(256)) * 1024  # 256 KiB pages: most of the time goes to writes
        keys = hash_pages(np.arange(1, 4 * 4000 + 1), 4)
        print("writing", flush=True)
        for key in keys:
            store.set([key], [payload])
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    time.sleep(0.5)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    store = _file(tmp_path)
    keys = pages(4000)
    visible = store.exists(keys)
    assert visible > 0
    assert len(store.get(keys)) == visible and store.stats.rejected == 0
    assert not list(tmp_path.rglob("*.tmp"))


# -- Redis ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    pytest.importorskip("redis", reason="the redis client is not installed (redis extra)")
    server = shutil.which("redis-server")
    if server is None:
        pytest.skip("redis-server is not installed (Debian package redis-server)")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        [server, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
         "--dir", str(workdir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    else:
        proc.kill()
        pytest.fail("redis-server did not start")
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(10)


def test_redis_pages_round_trip_and_are_shared_between_clients(redis_url):
    writer, reader = open_storage(redis_url, MODEL), open_storage(redis_url, MODEL)
    writer.clear()
    keys, values = pages(4), payloads(4)
    assert writer.set(keys[:3], values[:3]) == 3
    assert reader.exists(keys) == 3
    assert reader.get(keys) == values[:3]
    foreign = open_storage(redis_url, StorageIdentity("other", "float32", MODEL.layout, 4))
    assert foreign.exists(keys) == 0 and foreign.get(keys) == []
    assert writer.clear() == 3


def test_redis_damage_and_an_unreachable_server(redis_url, caplog):
    store = open_storage(redis_url, MODEL)
    store.clear()
    keys, values = pages(2), payloads(2)
    store.set(keys, values)
    store.client.set(store._key(keys[1]), b"garbage")
    assert store.get(keys) == values[:1]
    assert store.client.get(store._key(keys[1])) is None and store.stats.rejected == 1
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"redis://127.0.0.1:{sock.getsockname()[1]}/0"
    gone = open_storage(dead, MODEL, timeout=0.5)
    assert gone.set(keys, values) == 0
    assert gone.exists(keys) == 0 and gone.get(keys) == []
    assert "unreachable" in caplog.text or "write failed" in caplog.text


def test_a_redis_that_never_answers_costs_one_bounded_timeout():
    pytest.importorskip("redis", reason="the redis client is not installed (redis extra)")
    with socket.socket() as silent:  # accepts connections, never replies
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        store = open_storage(f"redis://127.0.0.1:{silent.getsockname()[1]}/0", MODEL, timeout=0.3)
        start = time.monotonic()
        assert store.get(pages(2)) == []
        assert store.set(pages(2), payloads(2)) == 0
        assert time.monotonic() - start < 3
        assert store.stats.read_errors == 1 and store.stats.write_errors == 1
