"""The Engine: tokenizer -> scheduler -> model -> sampler -> detokenizer, one step at a time.

    engine = Engine()                                   # the embedded SmolLM2-135M-Instruct
    [result] = engine.generate("The capital of France is", {"max_new_tokens": 16})
    result.text, result.token_ids, result.finish_reason, result.usage

`Engine.step()` is the whole loop body: `scheduler.step()`, one model forward over the batch,
sampling, `scheduler.process_batch_result()`, incremental detokenization and stop strings.
The engine is not thread-safe; the server runs it on a thread of its own.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field

import numpy as np
import torch

from radixserve.cache.allocator import PagedTokenToKVPoolAllocator
from radixserve.cache.radix import RadixCache
from radixserve.cache.storage import StorageIdentity, open_storage
from radixserve.cache.storage.host import HostStorage
from radixserve.cache.tiers import PrefetchCostModel, StorageIO, StorageTier, TieredCache
from radixserve.config import EngineConfig
from radixserve.errors import EngineError, InvalidArgumentError
from radixserve.model.aot import AOTDecode
from radixserve.model.attention import AttentionMetadata, make_attention_backend, plan_cascade
from radixserve.model.compiled import CompiledDecode, warm_up_batch_sizes
from radixserve.model.cuda_graph import MAX_WIDTH as GRAPH_MAX_WIDTH
from radixserve.model.cuda_graph import CudaGraphDecode
from radixserve.model.grammar import GrammarBackend, GrammarSpec
from radixserve.model.kv import CastingCopier, KVPool
from radixserve.model.loader import load_model, model_identity
from radixserve.model.sampling import SampleOutput, SamplingState, sample
from radixserve.model.tokenizer import IncrementalDetokenizer
from radixserve.sched.request import FinishReason, Req, SamplingParams, prepare_request
from radixserve.sched.scheduler import Batch, ForwardMode, Scheduler, SchedulerConfig

log = logging.getLogger(__name__)

# A pure decode step leaves its compiled graph for cascade attention (run eagerly) only when
# its rows would re-read at least this many shared prefix slots a layer (see `_forward`).
CASCADE_STEP_REPEATED = 8192
# Eager cascade attention (no --compile) only past this many re-read slots a layer. On the
# embedded model, 2 cores, decode steps over 512-token shared prompts, medians of 3 runs:
# 512 re-read lost (55.6 against 48.1 ms a step), 2,048 won (50.6 against 68.1), 10,240 won
# (82.4 against 148.4).
CASCADE_EAGER_REPEATED = 2048

DEFAULT_KV_CACHE_TOKENS = 16_384


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class GenerateResult:
    """One finished request: its text, its output token ids, why it ended, and usage.

    `finish_reason` is `stop`, `length` or `abort`; an abort has an `error` message and an
    `abort_cause` (`radixserve.sched.request.ABORT_CAUSES`): `error` means a model step
    failed on this request's batch.
    """

    rid: str
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    error: str | None = None
    abort_cause: str | None = None
    logprobs: list[SampleOutput] | None = None
    meta: dict = field(default_factory=dict)


@dataclass
class StreamChunk:
    """What one request produced in one engine step."""

    rid: str
    text: str
    token_ids: list[int]
    finished: bool = False
    result: GenerateResult | None = None


@dataclass
class _Live:
    req: Req
    sampling: SamplingState
    detok: IncrementalDetokenizer
    seen: int = 0
    logprobs: list[SampleOutput] = field(default_factory=list)
    host_tokens: int = 0  # prompt tokens loaded from the host tier


class Engine:
    """A serving engine over one model. Keyword arguments are `EngineConfig` fields."""

    def __init__(self, model: str | None = None, **options) -> None:
        self.config = config = EngineConfig(model=model, **options)
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        if config.device.startswith("cuda") and not torch.cuda.is_available():
            raise InvalidArgumentError("device=cuda was asked for but CUDA is not available")
        self.device = torch.device(config.device)
        loaded = load_model(
            config.model, config.dtype, self.device, config.weight_format, config.resolved_dtype
        )
        self.dtype = loaded.dtype
        self.weight_format = loaded.format.weight_format
        self.model, self.tokenizer, self.model_name = loaded.model, loaded.tokenizer, loaded.name
        mc = self.model.config
        self.max_context = min(config.max_context or loaded.max_context, loaded.max_context)
        page = config.page_size
        kv_tokens = config.kv_cache_tokens or DEFAULT_KV_CACHE_TOKENS
        kv_tokens = -(-kv_tokens // page) * page
        self.allocator = PagedTokenToKVPoolAllocator(kv_tokens, page)
        self.cache = RadixCache(
            self.allocator,
            page_size=page,
            eviction_policy=config.eviction_policy,
            disable=not config.enable_radix_cache,
            enable_kv_events=config.enable_kv_events,
        )
        sched_config = SchedulerConfig(
            schedule_policy=config.schedule_policy,
            max_running_requests=config.max_running_requests,
            chunked_prefill_size=max(config.chunked_prefill_size, page),
            enable_mixed_chunk=config.enable_mixed_chunk,
            **config.scheduler_options,
        )
        self.scheduler = Scheduler(self.cache, sched_config)
        self.kv = KVPool(
            mc.num_hidden_layers,
            self.allocator.num_slots,
            mc.num_key_value_heads,
            mc.head_dim,
            self.dtype,
            self.device,
        )
        tiered = config.hicache_storage or config.hicache_size_gb
        identity = self._kv_identity(loaded.source) if tiered else None
        self.host_tier = self._open_host_tier(identity) if config.hicache_size_gb else None
        self.storage_io = self._open_storage(identity) if config.hicache_storage else None
        if self.host_tier is not None:
            self.scheduler.before_admit = self._load_from_host
        storage_tier = self.storage_io.tier if self.storage_io is not None else None
        self.tiers = TieredCache(self.cache, self.host_tier, storage_tier)
        """The device tree with its tiers: `tiers.match_prefix` reports each tier's length."""
        self.attention = make_attention_backend("torch", decode=config.decode_attention)
        self.compiled_decode: CompiledDecode | CudaGraphDecode | None = (
            self._compile_decode() if config.compile or config.compile_aot else None
        )
        if self.device.type == "cuda" and config.cuda_graph:
            self.compiled_decode = self._capture_decode(self.compiled_decode)
        self._live: dict[str, _Live] = {}
        self.failed_steps = 0
        self._sampling_started = False
        self._spared: set[str] = set()  # decode entries spared by the last failed step
        self._ids = itertools.count()
        self._seeds = np.random.default_rng(config.seed)
        self._grammar: GrammarBackend | None = None
        self._grammar_lock = threading.Lock()
        self._compiling: dict[str, Future] = {}  # requests whose grammar is being compiled
        # requests waiting for their prefix to load from storage -> their grammar, if any
        self._loading: dict[str, Future | None] = {}
        self._ended: list[Req] = []  # requests that ended before reaching the scheduler
        log.info(
            "model %s (%s, %.1fM parameters, %d layers, context %d) on %s in %s",
            self.model_name,
            loaded.source,
            mc.num_parameters() / 1e6,
            mc.num_hidden_layers,
            self.max_context,
            self.device,
            str(self.dtype).removeprefix("torch."),
        )
        log.info("%s", loaded.describe_format())
        log.info(
            "KV cache: %d tokens (%.1f MiB), page size %d; radix cache %s, eviction %s, "
            "schedule %s, chunked prefill %d, max running %d",
            kv_tokens,
            self.kv.nbytes() / 2**20,
            page,
            "on" if config.enable_radix_cache else "off",
            config.eviction_policy,
            config.schedule_policy,
            sched_config.chunked_prefill_size,
            config.max_running_requests,
        )

    def _kv_identity(self, source: str) -> StorageIdentity:
        """What this engine's KV pages are valid for (model, weights, dtype, layout, page)."""
        mc = self.model.config
        return StorageIdentity(
            model=f"{model_identity(source)}:{self.weight_format}",
            dtype=str(self.dtype).removeprefix("torch."),
            layout=f"llama layers={mc.num_hidden_layers} kv_heads={mc.num_key_value_heads} "
            f"head_dim={mc.head_dim} k,v",
            page_size=self.config.hicache_page_size,
        )

    def _open_host_tier(self, identity: StorageIdentity) -> StorageTier:
        """The host-memory tier of `hicache_size_gb`, written as `hicache_write_policy` says."""
        config = self.config
        host = HostStorage(
            identity, int(config.hicache_size_gb * 2**30), config.hicache_eviction_policy
        )
        dtype = getattr(torch, config.hicache_host_dtype) if config.hicache_host_dtype else None
        copier = self.kv if dtype in (None, self.dtype) else CastingCopier(self.kv, dtype)
        tier = StorageTier(self.cache, host, copier, config.hicache_page_size)
        if config.hicache_write_policy == "write_back":
            self.cache.evict_listener = lambda node: tier.store(tier.plan_evicted(node))
        log.info(
            "KV host tier: %.2f GB (%d tokens in %s), pages of %d tokens, %s, eviction %s",
            config.hicache_size_gb,
            host.max_bytes // self.kv.page_bytes(1, dtype),
            str(dtype or self.dtype).removeprefix("torch."),
            config.hicache_page_size,
            config.hicache_write_policy,
            config.hicache_eviction_policy,
        )
        return tier

    def _open_storage(self, identity: StorageIdentity) -> StorageIO:
        """The storage tier `hicache_storage` names, for this model's KV layout."""
        config = self.config
        cap = config.hicache_storage_size_gb
        file_cap = cap and "://" not in config.hicache_storage
        options = {"max_bytes": int(cap * 2**30)} if file_cap else {}
        storage = open_storage(config.hicache_storage, identity, **options)
        tier = StorageTier(self.cache, storage, self.kv, config.hicache_page_size)
        cost = PrefetchCostModel(self.kv.page_bytes(1))
        log.info(
            "KV storage %s: pages of %d tokens (%.1f MiB), prefetch %s",
            config.hicache_storage,
            config.hicache_page_size,
            self.kv.page_bytes(config.hicache_page_size) / 2**20,
            config.hicache_prefetch,
        )
        return StorageIO(tier, cost, config.hicache_prefetch, config.hicache_prefetch_timeout)

    def _compile_decode(self) -> CompiledDecode | None:
        """The compiled decode path, warmed for every batch-size class; None (eager) when
        compiling fails, with the reason logged."""
        compiled = CompiledDecode(self.model, self.kv, self.device)
        if self.config.compile_aot:
            compiled.aot = self._build_aot()
        sizes = warm_up_batch_sizes(self.model, self.config.max_running_requests)
        log.info("compiling the decode step for batch sizes %s", ",".join(map(str, sizes)))
        try:
            seconds = compiled.warm_up(sizes, lambda rows: self._set_threads(rows == 1))
        except Exception as exc:  # any compiler failure means: stay eager
            log.warning("torch.compile failed, decoding eagerly: %s", str(exc).splitlines()[0])
            return None
        if self.device.type == "cpu":  # mixed batches' decode rows
            self._set_threads(False)
            try:
                seconds += self.attention.compile_decode(
                    self.kv.k[0], self.kv.v[0], self.model.config.num_attention_heads
                )
            except Exception as exc:
                log.warning("compiling decode attention failed: %s", str(exc).splitlines()[0])
        log.info(
            "compiled the decode step in %.1f s (later starts reuse the on-disk cache)", seconds
        )
        return compiled

    def _capture_decode(self, compiled: CompiledDecode | None):
        """Decode steps replayed from CUDA graphs of the compiled step, or of the eager one;
        `compiled` unchanged when capturing fails or a replay disagrees with the eager step,
        with the reason logged."""
        step = compiled.step if compiled is not None else self.model.decode_step
        width = min(self.max_context, GRAPH_MAX_WIDTH)
        graphs = CudaGraphDecode(
            step, self.kv, self.device, self.config.max_running_requests, width
        )
        try:
            seconds = graphs.warm_up()
            graphs.verify(self.model.config.vocab_size)
        except Exception as exc:  # a step that cannot be captured runs without graphs
            log.warning("CUDA graph capture failed, decoding without graphs: %s", exc)
            return compiled
        log.info(
            "captured %d decode graphs (batch buckets %s) in %.1f s; wider contexts are "
            "captured on first use",
            len(graphs.graphs),
            ",".join(map(str, graphs.buckets)),
            seconds,
        )
        return graphs

    def _build_aot(self) -> AOTDecode | None:
        """The batch-1 step compiled ahead of time; None (torch.compile serves batch 1 too)
        when it cannot be built, with the reason logged."""
        if self.device.type != "cpu":
            log.warning("--compile-aot is implemented for the CPU only; ignored on %s", self.device)
            return None
        try:
            self._set_threads(True)
            return AOTDecode.build(self.model, self.kv)
        except Exception as exc:  # any export or compiler failure: keep torch.compile's graph
            log.warning("AOTInductor failed, batch 1 stays on torch.compile: %s", exc)
            return None

    # -- requests ---------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | Sequence[int],
        sampling_params: dict | SamplingParams | None = None,
        rid: str | None = None,
        priority: int = 0,
        extra_key=None,
    ) -> str:
        """Queue one request (text or token ids); returns its id. Bad input raises ValueError."""
        ids, params = self.prepare_request(prompt, sampling_params)
        return self.add_prepared(ids, params, rid, priority, extra_key)

    def add_prepared(
        self,
        ids: list[int],
        params: SamplingParams,
        rid: str | None = None,
        priority: int = 0,
        extra_key=None,
    ) -> str:
        """Queue what `prepare_request` returned, without checking it again; returns the id."""
        rid = rid if rid is not None else f"req-{next(self._ids)}"
        if rid in self._live:
            raise InvalidArgumentError(f"request id {rid!r} is already running")
        req = Req(
            rid,
            np.asarray(ids, dtype=np.int32),
            params,
            priority=priority,
            extra_key=extra_key,
            eos_token_ids=self.tokenizer.eos_token_ids,
        )
        state = SamplingState.create(
            params, req.input_ids, self.device, int(self._seeds.integers(2**62))
        )
        compiled = self.compile_grammar(params)
        self._live[rid] = _Live(req, state, IncrementalDetokenizer(self.tokenizer, params.stop))
        if self.storage_io is not None and self.storage_io.begin(rid, req.input_ids, extra_key):
            self._loading[rid] = compiled
        else:
            self._enqueue(rid, compiled)
        return rid

    def _load_from_host(self, req: Req) -> None:
        """Before `req` is first admitted: what the host tier holds past the tree's prefix
        goes into device slots (all of it or none)."""
        tier = self.host_tier
        plan = tier.plan_load(req.token_ids(req.seq_len - 1), req.extra_key)
        if plan is not None:
            loaded = tier.admit(plan, tier.fetch(plan))
            live = self._live.get(req.rid)
            if live is not None:
                live.host_tokens += loaded

    def _enqueue(self, rid: str, compiled: Future | None) -> None:
        """To the scheduler, or to wait for its grammar."""
        if compiled is None:
            self.scheduler.add_request(self._live[rid].req)
        else:
            self._compiling[rid] = compiled
            self._admit_compiled()

    def compile_grammar(self, params: SamplingParams) -> Future | None:
        """A future of the compiled grammar `params` asks for (None when it asks for none).

        Compiling runs on a thread of its own and is cached by the grammar's text; a request
        waits outside the scheduler's batches until its grammar is ready, so no step waits on
        it. The future raises `InvalidArgumentError` (naming the field) for a bad grammar.
        """
        if params.grammar is None:
            return None
        return self.grammar_backend().compile(GrammarSpec(*params.grammar))

    def grammar_backend(self) -> GrammarBackend:
        """The grammar compiler for this model's vocabulary, built on first use (about a
        second for a 49k vocabulary; `radixserve serve` builds it at startup). Raises
        `InvalidArgumentError` when xgrammar is not installed."""
        with self._grammar_lock:
            if self._grammar is None:
                self._grammar = GrammarBackend(self.tokenizer, self.model.config.vocab_size)
            return self._grammar

    def _admit_compiled(self) -> None:
        """Queue the requests whose grammar has compiled; end those whose grammar failed."""
        for rid, future in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[rid]
            live = self._live[rid]
            error = future.exception()
            if error is not None:
                live.req.finish_reason = FinishReason("abort", message=str(error), cause="invalid")
                self._ended.append(live.req)
                continue
            live.sampling.matcher = self._grammar.matcher(future.result())
            self.scheduler.add_request(live.req)

    def prepare_request(
        self, prompt: str | Sequence[int], sampling_params: dict | SamplingParams | None = None
    ) -> tuple[list[int], SamplingParams]:
        """The token ids and sampling params `add_request` would queue; bad input raises
        ValueError (`InvalidArgumentError` naming the field). Changes nothing."""
        return prepare_request(
            prompt, sampling_params, self.tokenizer, self.model.config.vocab_size, self.max_context
        )

    def abort(
        self, rid: str, message: str = "aborted by the client", cause: str = "client"
    ) -> bool:
        """Abort a request; its slots are freed and its result says `cause`.

        The final chunk comes out of the next `step()`. False if it is not running.
        """
        waiting = rid in self._loading
        if waiting:
            self.storage_io.cancel(rid)
            self._loading.pop(rid)
        if self._compiling.pop(rid, None) is not None or waiting:
            live = self._live[rid]
            live.req.finish_reason = FinishReason("abort", message=message, cause=cause)
            self._ended.append(live.req)
            return True
        return self.scheduler.abort(rid, message, cause)

    def request_ids(self) -> list[str]:
        """The ids of every request queued (its grammar compiling included) or running."""
        return [*self._loading, *self._compiling, *self.scheduler.request_ids()]

    def has_work(self) -> bool:
        """True while a request is queued or running, or an ended one awaits its final chunk."""
        return bool(
            self.scheduler.has_work()
            or self.scheduler.has_finished()
            or self._compiling
            or self._loading
            or self._ended
        )

    # -- the loop ---------------------------------------------------------------------------

    def step(self) -> list[StreamChunk]:
        """One scheduler step and model forward; what each affected request produced.

        If the forward, the sampler or the bookkeeping after them fails, only the requests of
        that batch end, as `abort` with cause `error` and the exception's class and message;
        every other request goes on, and no slot leaks. When the model itself fails on a mixed
        batch, its decode entries are spared: they changed nothing yet and decode again next
        step, so a prompt that breaks the model does not take the running streams with it. If
        the scheduler itself fails, the exception propagates and `recover()` is the way back.
        """
        chunks: dict[str, StreamChunk] = {}
        if self.storage_io is not None:
            if self._loading and not self.scheduler.has_work() and not self._compiling:
                self.storage_io.wait(0.01)  # nothing else to do: wait a little, not spin
            for rid in self.storage_io.ready():
                if rid in self._loading:
                    self._enqueue(rid, self._loading.pop(rid))
        if self._compiling:
            if not self.scheduler.has_work():  # nothing else to do: wait a little, not spin
                wait_futures(list(self._compiling.values()), 0.01, FIRST_COMPLETED)
            self._admit_compiled()
        batch = self.scheduler.step()
        if batch is not None:
            self._sampling_started = False
            try:
                started = time.perf_counter()
                tokens = self._forward(batch)
                if self.storage_io is not None and batch.mode is ForwardMode.EXTEND:
                    prefilled = sum(len(e.token_ids) for e in batch.entries if not e.is_decode)
                    seconds = time.perf_counter() - started
                    self.storage_io.cost.observe_prefill(prefilled, seconds)
                self.scheduler.process_batch_result(batch, tokens)
                for entry in batch.entries:
                    if entry.sample:
                        self._emit(entry.req, chunks)
            except Exception as exc:
                self._fail(self._doomed(batch), exc, chunks)
            else:
                self._spared.clear()
        ended, self._ended = self._ended, []
        for req in [*ended, *self.scheduler.pop_finished()]:
            self._finish(req, chunks)
        return list(chunks.values())

    def _doomed(self, batch: Batch) -> list[str]:
        """The requests a failed batch takes down: all, except, when the model failed on a
        mixed batch, decode entries not already spared by the failure just before."""
        mixed = batch.mode is ForwardMode.EXTEND and not self._sampling_started
        doomed = []
        for entry in batch.entries:
            rid = entry.req.rid
            if mixed and entry.is_decode and rid not in self._spared:
                self._spared.add(rid)
            else:
                doomed.append(rid)
        return doomed

    def recover(self, exc: BaseException) -> list[StreamChunk]:
        """After `step()` raised: end every request as `abort` (cause `error`) and check state.

        Returns the final chunks. Raises `EngineError` when the scheduler or the cache is left
        inconsistent, since the engine cannot serve on from there.
        """
        chunks: dict[str, StreamChunk] = {}
        self._fail(self.scheduler.request_ids(), exc, chunks)
        for req in self.scheduler.pop_finished():
            self._finish(req, chunks)
        lost = [live.req for live in self._live.values() if live.req.rid not in chunks]
        for req in lost:  # the scheduler no longer knows them: end them here
            req.finish_reason = FinishReason(
                "abort", message=f"the engine lost this request ({_describe(exc)})", cause="error"
            )
            self._finish(req, chunks)
        return list(chunks.values())

    def _fail(self, rids: list[str], exc: BaseException, chunks: dict[str, StreamChunk]) -> None:
        self.failed_steps += 1
        log.error(
            "engine step failed on %d request(s): %s", len(rids), _describe(exc), exc_info=exc
        )
        message = f"the engine failed on this request's batch ({_describe(exc)})"
        for rid in rids:
            self.scheduler.abort(rid, message, cause="error")
        try:
            self.scheduler.check_invariants()
        except Exception as broken:
            raise EngineError(
                f"engine state is inconsistent after a failed step: {broken}"
            ) from exc

    def _emit(self, req: Req, chunks: dict[str, StreamChunk]) -> None:
        live = self._live.get(req.rid)
        if live is None:
            return
        self._push_new_tokens(req, live, chunks)
        if req.finished or self._ended_by_output(req, live):
            return
        forced = self._jump_forward(live)
        if forced:
            self.scheduler.append_forced(req.rid, forced)
            self._push_new_tokens(req, live, chunks)
            if not req.finished:
                self._ended_by_output(req, live)

    def _jump_forward(self, live: _Live) -> list[int]:
        """The tokens the request's grammar forces next (none without jump-forward, without a
        grammar, or when logprobs are asked for, since forced tokens have none)."""
        matcher = live.sampling.matcher
        if matcher is None or not self.config.enable_jump_forward:
            return []
        if live.req.sampling.logprobs is not None or matcher.stuck or matcher.terminated:
            return []
        return matcher.jump_forward_tokens()

    def _ended_by_output(self, req: Req, live: _Live) -> bool:
        """End `req` if its output so far calls for it (a stop string, or its grammar done,
        stuck or broken); True if it did."""
        matcher = live.sampling.matcher
        if live.detok.stopped is not None:
            self.scheduler.finish(req.rid, FinishReason("stop", matched=live.detok.stopped))
        elif matcher is not None and matcher.stuck:
            self.scheduler.abort(
                req.rid,
                "the grammar allows no token of this model's vocabulary after "
                f"{len(req.output_ids) - 1} output token(s)",
                cause="invalid",
            )
        elif matcher is not None and matcher.rejected is not None:
            self.scheduler.abort(
                req.rid,
                f"the grammar refused sampled token {matcher.rejected}",
                cause="error",
            )
        elif matcher is not None and matcher.terminated:
            self.scheduler.finish(req.rid, FinishReason("stop", matched=req.output_ids[-1]))
        else:
            return False
        return True

    def _push_new_tokens(self, req: Req, live: _Live, chunks: dict[str, StreamChunk]) -> None:
        new_ids = req.output_ids[live.seen :]
        chunk = chunks.setdefault(req.rid, StreamChunk(req.rid, "", []))
        if not new_ids:
            return
        live.seen = len(req.output_ids)
        for token in new_ids:
            live.sampling.observe(token)
        chunk.text += live.detok.push(new_ids)
        chunk.token_ids.extend(new_ids)

    def _finish(self, req: Req, chunks: dict[str, StreamChunk]) -> None:
        live = self._live.pop(req.rid, None)
        if live is None:
            return
        storage_tokens = 0
        if self.host_tier is not None and self.config.hicache_write_policy != "write_back":
            selective = self.config.hicache_write_policy == "write_through_selective"
            hits = self.config.hicache_write_through_threshold if selective else 1
            tier = self.host_tier
            tier.store(tier.plan_store(req.token_ids(), req.extra_key, min_hits=hits))
        if self.storage_io is not None:
            if req.rid in self._loading:
                del self._loading[req.rid]
                self.storage_io.cancel(req.rid)
            storage_tokens = self.storage_io.loaded.pop(req.rid, 0)
            self.storage_io.write(req.token_ids(), req.extra_key)  # what the tree holds of it
        self._push_new_tokens(req, live, chunks)
        chunk = chunks[req.rid]
        chunk.text += live.detok.flush()
        reason = req.finish_reason
        chunk.finished = True
        chunk.result = GenerateResult(
            rid=req.rid,
            text=live.detok.text,
            token_ids=list(req.output_ids),
            finish_reason=reason.kind,
            usage=Usage(len(req.input_ids), len(req.output_ids), req.cached_tokens or 0),
            error=reason.message if reason.kind == "abort" else None,
            abort_cause=reason.cause,
            logprobs=live.logprobs if req.sampling.logprobs is not None else None,
            meta={
                "matched_stop": reason.matched,
                "retractions": req.num_retractions,
                "queue_time": (req.first_scheduled_time or req.queued_time) - req.queued_time,
                "ttft": None
                if req.first_token_time is None
                else req.first_token_time - req.queued_time,
                "e2e": (req.finish_time or req.queued_time) - req.queued_time,
                "storage_tokens": storage_tokens,
                "host_tokens": live.host_tokens,
            },
        )

    def _forward(self, batch: Batch) -> list[int]:
        """Run the model on `batch` and sample; one token per entry (0 where none is sampled)."""
        entries = batch.entries
        self._set_threads(len(entries) == 1 and len(entries[0].token_ids) == 1)
        dev = self.device
        ids = np.concatenate([e.token_ids for e in entries]).astype(np.int64)
        new_slots = np.concatenate([e.new_slots for e in entries])
        lens = [len(e.token_ids) for e in entries]
        prefix = [len(e.prefix_slots) for e in entries]
        positions = np.concatenate(
            [np.arange(p, p + n, dtype=np.int64) for p, n in zip(prefix, lens, strict=True)]
        )
        sampled = [i for i, e in enumerate(entries) if e.sample]
        is_decode = batch.mode is ForwardMode.DECODE
        decodes = len(entries) if is_decode else sum(e.is_decode for e in entries)
        extends = len(entries) - decodes  # decode entries of a mixed batch come last
        compiled_step = is_decode and self.compiled_decode is not None
        table = cascade = None
        # Rows sharing a prefix attend to it once (cascade attention) when that saves enough
        # re-reading of the shared slots: a pure decode step gives up its compiled graph for
        # it (about 12 ms more a step on the embedded model on 2 cores), and the eager form
        # costs a few more ops a layer than attention per row. The compiled kernel in a step
        # that is eager anyway costs nothing more. On the CPU only: on CUDA the step is a
        # graph, and the cascade is unmeasured there.
        if decodes > 1 and dev.type == "cpu" and getattr(self.attention, "supports_cascade", False):
            if compiled_step:
                bar = CASCADE_STEP_REPEATED
            elif getattr(self.attention, "compiled_cascade", None) is None:
                bar = CASCADE_EAGER_REPEATED
            else:
                bar = 0
            # No plan re-reads more than every other row re-reading the longest prefix.
            if (decodes - 1) * max(prefix[extends:]) >= bar:
                table = self._decode_table(entries[extends:])
                cascade = plan_cascade(table, np.asarray(prefix[extends:]) + 1)
                if cascade is not None and cascade.repeated < bar:
                    cascade = None
        if compiled_step and cascade is None:
            logits = self._compiled_forward(entries, ids, positions, new_slots)
            if logits is not None:
                rows = logits if len(sampled) == len(entries) else logits[sampled]
                return self._sample(entries, rows, sampled)
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64).tolist()
        sample_rows = [starts[i] + lens[i] - 1 for i in sampled]
        meta = AttentionMetadata(
            is_decode=is_decode,
            new_slots=torch.from_numpy(new_slots).to(dev),
            sample_indices=torch.tensor(sample_rows, dtype=torch.long, device=dev),
            starts=starts[:extends],
            new_lens=lens[:extends],
            prefix_lens=prefix[:extends],
            context_slots=[
                torch.from_numpy(np.concatenate([e.prefix_slots, e.new_slots])).to(dev)
                for e in entries[:extends]
            ],
            decode_rows=0 if is_decode else decodes,
        )
        if decodes:
            if table is None:
                table = self._decode_table(entries[extends:])
            mask = np.arange(table.shape[1])[None, :] <= np.asarray(prefix[extends:])[:, None]
            meta.decode_slots = torch.from_numpy(table).to(dev)
            meta.decode_mask = torch.from_numpy(mask).to(dev)
            meta.cascade = cascade  # planned on the CPU, where the step runs
        logits = self.model(
            torch.from_numpy(ids).to(dev),
            torch.from_numpy(positions).to(dev),
            self.kv,
            meta,
            self.attention,
        )
        return self._sample(entries, logits, sampled)

    @staticmethod
    def _decode_table(rows) -> np.ndarray:
        """Each decode entry's context slots, its prefix then its new token, padded with 0."""
        width = max(len(e.prefix_slots) for e in rows) + 1
        table = np.zeros((len(rows), width), dtype=np.int64)
        for row, e in enumerate(rows):
            table[row, : len(e.prefix_slots)] = e.prefix_slots
            table[row, len(e.prefix_slots)] = e.new_slots[0]
        return table

    def _set_threads(self, one_token: bool) -> None:
        """`threads` for a step of one token, `threads_batch` for every larger step, as
        llama.cpp's -t and -tb; nothing changes unless `threads_batch` is set. Graphs are
        compiled under the count they will run with: inductor sizes its loops to it."""
        config = self.config
        if config.threads_batch is None:
            return
        want = config.threads if one_token else config.threads_batch
        if want is not None and want != torch.get_num_threads():
            torch.set_num_threads(want)

    def _compiled_forward(self, entries, ids, positions, new_slots) -> torch.Tensor | None:
        """Logits of a decode batch from the compiled graph; None (run it eagerly) when the
        graph fails, which also turns the compiled path off for good."""
        try:
            return self.compiled_decode(
                ids, positions, [e.prefix_slots for e in entries], new_slots
            )
        except Exception as exc:  # the eager path can still run this step
            log.warning("compiled decode failed, decoding eagerly from now on: %s", exc)
            self.compiled_decode = None
            return None

    def _sample(self, entries, logits: torch.Tensor, sampled: list[int]) -> list[int]:
        out = [0] * len(entries)
        if not sampled:
            return out
        states = [self._live[entries[i].req.rid].sampling for i in sampled]
        self._sampling_started = True  # from here a failure may have touched sampler state
        for i, result in zip(sampled, sample(logits, states), strict=True):
            out[i] = result.token
            if result.logprob is not None:
                self._live[entries[i].req.rid].logprobs.append(result)
        return out

    # -- convenience ------------------------------------------------------------------------

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: dict | SamplingParams | Sequence | None = None,
    ) -> list[GenerateResult]:
        """Run prompts (text or token ids) to completion; one result per prompt, in order."""
        batch = _as_prompt_list(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(batch):
                raise InvalidArgumentError("give one sampling_params per prompt, or one for all")
            params = list(sampling_params)
        else:
            params = [sampling_params] * len(batch)
        rids = [self.add_request(p, sp) for p, sp in zip(batch, params, strict=True)]
        wanted = set(rids)
        results: dict[str, GenerateResult] = {}
        while wanted - results.keys():
            self._check_not_lost(wanted - results.keys())
            for chunk in self.step():
                if chunk.finished and chunk.rid in wanted:
                    results[chunk.rid] = chunk.result
        return [results[r] for r in rids]

    def _check_not_lost(self, rids) -> None:
        if not self.has_work():
            raise EngineError(f"request(s) {sorted(rids)} were lost: the engine has no work left")

    def stream(
        self, prompt: str | Sequence[int], sampling_params: dict | SamplingParams | None = None
    ) -> Iterator[str]:
        """Yield the text of one request piece by piece, as it is generated."""
        rid = self.add_request(prompt, sampling_params)
        try:
            while True:
                self._check_not_lost([rid])
                for chunk in self.step():
                    if chunk.rid != rid:
                        continue
                    if chunk.text:
                        yield chunk.text
                    if chunk.finished:
                        return
        finally:
            if rid in self._live:
                self.abort(rid)
                self.step()

    def chat(
        self, messages: Sequence[dict], sampling_params: dict | SamplingParams | None = None
    ) -> GenerateResult:
        """Generate the assistant's answer to `messages` with the model's chat template."""
        prompt = self.tokenizer.apply_chat_template(messages)
        ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        return self.generate([ids], sampling_params)[0]

    def check_invariants(self) -> None:
        """The scheduler's, the cache's and the host tier's invariants (slot and page
        accounting included)."""
        self.scheduler.check_invariants()
        if self.host_tier is not None:
            self.host_tier.storage.check_invariants()


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, np.ndarray):
        prompts = prompts.tolist()
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise InvalidArgumentError("prompts must be a string, token ids, or a non-empty list")
    if all(isinstance(t, (int, np.integer)) for t in prompts):
        return [list(prompts)]
    return list(prompts)
