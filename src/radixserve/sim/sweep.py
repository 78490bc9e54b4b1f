"""Sweeps: a grid of lab runs in parallel processes, journalled so that an interrupted sweep
resumes where it stopped.

A cell is a dict of JSON values naming one run; its identity is its sorted JSON. Each result
is appended to the journal (JSON lines of {"cell", "result"}) as soon as it finishes and is
flushed, so a sweep killed at any point loses at most the cells still running. Run again with
the same journal, the sweep reads the finished cells back and runs only the others.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from radixserve.errors import InvalidArgumentError

log = logging.getLogger("radixserve")


def cell_key(cell: dict) -> str:
    """The identity of a cell: its JSON with sorted keys."""
    return json.dumps(cell, sort_keys=True)


def read_journal(path: Path) -> dict[str, dict]:
    """Finished cells by key. A torn last line (a sweep killed mid-write) is ignored."""
    done: dict[str, dict] = {}
    if not path.is_file():
        return done
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
            done[cell_key(record["cell"])] = record["result"]
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    return done


def run_grid(
    cells: Sequence[dict],
    run: Callable[[dict], dict],
    *,
    jobs: int = 1,
    journal: str | Path | None = None,
    initializer: Callable[..., None] | None = None,
    initargs: tuple = (),
    on_result: Callable[[dict, dict], None] | None = None,
    ray_address: str | None = None,
) -> list[dict]:
    """`run(cell)` for every cell not already in `journal`; the results, in `cells` order.

    With `jobs` > 1 the cells run in that many processes, each set up once by
    `initializer(*initargs)`; `run` and the cells must then be picklable. With `ray_address`
    (a Ray cluster's address, or `local` for a cluster started in this process) they run as
    Ray tasks instead, each worker process set up once the same way. `on_result(cell,
    result)` is called in this process as each new result arrives.
    """
    if not isinstance(jobs, int) or jobs < 1:
        raise InvalidArgumentError(f"jobs must be an integer >= 1, got {jobs!r}")
    path = Path(journal) if journal is not None else None
    done = read_journal(path) if path is not None else {}
    todo = [cell for cell in cells if cell_key(cell) not in done]
    if len(todo) < len(cells):
        log.info(
            "resuming: %d of %d cells are already in %s", len(cells) - len(todo), len(cells), path
        )
    handle = None
    if path is not None:
        handle = path.open("a")
        if path.stat().st_size and not path.read_bytes().endswith(b"\n"):
            handle.write("\n")  # end a line torn by a sweep killed mid-write

    def record(cell: dict, result: dict) -> None:
        done[cell_key(cell)] = result
        if handle is not None:
            handle.write(json.dumps({"cell": cell, "result": result}) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        if on_result is not None:
            on_result(cell, result)

    try:
        if ray_address is not None and todo:
            for cell, result in _run_on_ray(ray_address, todo, run, initializer, initargs):
                record(cell, result)
        elif jobs == 1 or len(todo) <= 1:
            if todo and initializer is not None:
                initializer(*initargs)
            for cell in todo:
                record(cell, run(cell))
        else:
            with ProcessPoolExecutor(jobs, initializer=initializer, initargs=initargs) as pool:
                futures = {pool.submit(run, cell): cell for cell in todo}
                for future in as_completed(futures):
                    record(futures[future], future.result())
    finally:
        if handle is not None:
            handle.close()
    return [done[cell_key(cell)] for cell in cells]


_SET_UP: set = set()  # in a Ray worker process: the (initializer, initargs) already run


def _ray_task(run, initializer, initargs, cell: dict) -> dict:
    key = (initializer, json.dumps(initargs, sort_keys=True, default=str))
    if initializer is not None and key not in _SET_UP:
        initializer(*initargs)
        _SET_UP.add(key)
    return run(cell)


def _run_on_ray(address: str, cells, run, initializer, initargs):
    """(cell, result) pairs as Ray tasks finish, on the cluster at `address`."""
    try:
        import ray
    except ImportError:
        raise InvalidArgumentError(
            "--ray needs Ray: pip install 'ray[serve]' (or radixserve[ray])"
        ) from None
    started = not ray.is_initialized()
    if started:
        ray.init(address=None if address == "local" else address, log_to_driver=False)
    try:
        task = ray.remote(_ray_task)
        pending = {task.remote(run, initializer, initargs, cell): cell for cell in cells}
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                yield pending.pop(ref), ray.get(ref)
    finally:
        if started:
            ray.shutdown()
