"""The engine loop: requests in, incremental outputs out.

Each `step()` asks the scheduler which requests run how many tokens, runs them as one batched forward over the
paged KV cache, samples a token for every request that reached the end of its known tokens, detokenises
incrementally (stop strings), and reports what changed. Engine options are checked before the model loads
(`EngineConfig`, and the KV cache against the memory this machine has available). A request that fails validation
is refused with a clear error at `add_request`; a failure inside a step ends only the requests of that step, with
the error recorded, and the engine keeps serving the others. Every request that was added is reported finished
exactly once (an aborted one by the next `step()`; `has_unfinished_requests()` stays true until then).
"""

from __future__ import annotations

import itertools
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from numbers import Integral, Real
from pathlib import Path

import torch

from hybridmoe.accel.accelerator import DeviceMemoryError, parse_bytes, select_accelerator
from hybridmoe.accel.stats import RunStats
from hybridmoe.checkpoint.default_model import resolve_model_dir
from hybridmoe.config import load_config
from hybridmoe.kv.importance import WINDOW, AttentionImportance
from hybridmoe.layers.moe.block import MoEBlock
from hybridmoe.layers.moe.hybrid_backend import TimedOnDevice
from hybridmoe.models.dual_batch import OVERLAP_CHOICES, plan_tiers
from hybridmoe.models.dual_batch import choose as choose_dual_batch
from hybridmoe.models.loader import DTYPES, load_model, resolve_dtype
from hybridmoe.models.placement import load_plan_file, place_model, placement_report, plan_placement
from hybridmoe.models.transformed_weights import TransformedWeights
from hybridmoe.runtime.block_manager import BlockManager
from hybridmoe.runtime.detokenizer import IncrementalDetokenizer
from hybridmoe.runtime.logprobs import PromptLogprobs, TokenLogprobs, token_logprobs
from hybridmoe.runtime.model_runner import ModelRunner, SequenceChunk, torch_threads_for_step
from hybridmoe.runtime.request import Request, RequestStatus
from hybridmoe.runtime.sampler import Sampler
from hybridmoe.runtime.sampling_params import SamplingParams
from hybridmoe.runtime.scheduler import Scheduler, SchedulerStats
from hybridmoe.runtime.tokenizer import load_tokenizer


@dataclass
class EngineConfig:
    dtype: str = "auto"  # compute dtype: auto | bfloat16 | float32 | float16 (see models.loader.resolve_dtype)
    expert_backend: str = "cpu"  # routed experts: "cpu" (C++ kernels) | "torch" (reference)
    block_size: int = 16
    kv_cache_gb: float = 1.0  # memory for the paged KV cache
    # the KV cache's dtype: auto (the compute dtype) | bfloat16 | float16 | float32. A 16-bit cache under float32
    # compute holds twice the tokens and halves what decode attention reads (llama.cpp's default is float16)
    kv_cache_dtype: str = "auto"
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048  # token budget of one step (decode tokens first, then prefill chunks)
    max_model_len: int | None = None  # default: the model's max_position_embeddings, capped by the cache
    enable_prefix_caching: bool = True  # reuse the KV of full blocks an earlier request computed (docs/runtime.md)
    # hybrid execution (docs/hybrid.md): where the plan's resident parts run and within how much memory
    device: str = "auto"  # auto (CUDA when torch sees one, else the CPU) | cpu | cuda | cuda:N
    vram: str | int | None = None  # accelerator memory budget, e.g. "24GB" (None: CUDA's free memory - a reserve)
    num_gpus: int = 1  # accelerators for stream-loading prefill's expert parallelism
    stream_prefill: str = "auto"  # auto (from the plan's crossover) | on | off
    plan: str | None = None  # a plan file written by `hybridmoe plan --json` to execute instead of planning here
    routing: str | None = None  # routing statistics (`hybridmoe profile --routing-model`): which experts are hot
    profile: str | None = None  # hardware profile to plan with (default: ~/.cache/hybridmoe/profile.json if any)
    verbose: bool = False  # print the plan and what was placed where at load
    # dual-batch overlap of decode steps (docs/hybrid.md): auto (under hybrid execution where the plan predicts a
    # gain; off on the plain CPU engine) | on | off
    overlap: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {['auto', *DTYPES]}, got {self.kv_cache_dtype!r}")
        if self.overlap not in OVERLAP_CHOICES:
            raise ValueError(f"overlap must be auto, on or off, got {self.overlap!r}")
        if self.stream_prefill not in ("auto", "on", "off"):
            raise ValueError(f"stream_prefill must be auto, on or off, got {self.stream_prefill!r}")
        if not isinstance(self.num_gpus, Integral) or isinstance(self.num_gpus, bool) or self.num_gpus < 1:
            raise ValueError(f"num_gpus must be an integer >= 1, got {self.num_gpus!r}")
        kind = str(self.device).partition(":")[0]
        if kind not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        parse_bytes(self.vram)  # a ValueError naming the text when it is not a size
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be True or False, got {self.enable_prefix_caching!r}")
        value = self.kv_cache_gb
        if not isinstance(value, Real) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"kv_cache_gb must be a number > 0 (GB of memory for the KV cache), got {value!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if value is None and name == "max_model_len":
                continue
            if not isinstance(value, Integral) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def hybrid_wanted(cfg: EngineConfig) -> bool:
    """Whether parts run on an accelerator: on CUDA always (device auto with a GPU, or cuda); on the CPU stand-in
    only when a vram budget or a plan file is given (otherwise the plain all-CPU engine, which is the fastest on a
    machine without a GPU: the stand-in's copies and torch matmuls only cost time there)."""
    kind = str(cfg.device).partition(":")[0]
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    return kind == "cuda" or cfg.vram is not None or cfg.plan is not None


def memory_bytes() -> tuple[int, int]:
    """(available, total) bytes of this machine's memory: /proc/meminfo's MemAvailable and MemTotal (else sysconf's
    free and physical pages)."""
    try:
        with open("/proc/meminfo") as f:
            fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.strip()}
        return fields["MemAvailable"], fields["MemTotal"]
    except (OSError, KeyError, ValueError, IndexError):
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


def check_kv_cache_fits(kv_cache_gb: float) -> None:
    """Raise ValueError when kv_cache_gb (GB of 2**30 bytes) is more than the memory this machine has available."""
    available, total = memory_bytes()
    if kv_cache_gb * 2**30 > available:
        raise ValueError(f"kv_cache_gb={kv_cache_gb:g} is more than this machine can hold: "
                         f"{available / 2**30:.1f} GB of memory available ({total / 2**30:.1f} GB in all, "
                         f"GB = 2**30 bytes); choose a smaller kv_cache_gb")


@dataclass
class RequestOutput:
    req_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # all generated ids so far
    text: str  # all generated text so far (truncated at a stop string)
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    first_token_time: float | None = None
    arrival_time: float = 0.0
    new_logprobs: list[TokenLogprobs] | None = None  # one per new token, when SamplingParams.logprobs is set
    # every prompt token's (None for the first), once the prefill is done, when SamplingParams.prompt_logprobs is set
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass(frozen=True)
class CompletingPrompt:
    """A request whose prompt's KV the running step completes (see LLMEngine.set_prompt_kv_observer)."""

    req_id: str
    prompt_ids: list[int]
    block_table: list[int]


@dataclass
class AdoptedKV:
    """What `adopt_request`'s write_kv put into the cache, when it is not exactly what a prefill here computes."""

    dropped: torch.Tensor | None = None  # bool [prompt tokens]: positions whose KV was dropped (None: none was)
    exact: bool = True  # False: some of it is quantised or dropped (then never offered to the prefix cache)


class LLMEngine:
    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None, show_progress: bool | None = None,
                 transformed: TransformedWeights | None = None):
        """model_dir: a local Hugging Face model directory, or `demo` (the embedded demo model). transformed: where
        the weights the loader makes go (None: this process; `serve --pd`'s workers share a segment)."""
        self.config = cfg = config or EngineConfig()
        check_kv_cache_fits(cfg.kv_cache_gb)
        self.model_dir = model_dir = resolve_model_dir(model_dir)
        self.model_config = load_config(model_dir)
        self.tokenizer = load_tokenizer(model_dir)
        self.model = load_model(model_dir, resolve_dtype(cfg.dtype), cfg.expert_backend,
                                config=self.model_config, show_progress=show_progress, transformed=transformed)
        kv_dtype = self.model.dtype if cfg.kv_cache_dtype == "auto" else DTYPES[cfg.kv_cache_dtype]
        num_blocks = ModelRunner.blocks_for_memory(self.model, int(cfg.kv_cache_gb * 2**30), cfg.block_size, kv_dtype)
        if num_blocks == 0:
            block_bytes = self.model.kv_bytes_per_token(kv_dtype) * cfg.block_size
            raise ValueError(f"kv_cache_gb={cfg.kv_cache_gb:g} holds no KV block: one block of {cfg.block_size} "
                             f"tokens of this model takes {block_bytes} bytes ({block_bytes / 2**30:.3g} GB)")
        self.accel, self.placement, self.run_stats = None, None, RunStats()
        self._attached: list = []  # what close() stops
        if hybrid_wanted(cfg):
            self._place(num_blocks * cfg.block_size * self.model.kv_bytes_per_token(kv_dtype))
        self.runner = ModelRunner(self.model, num_blocks, cfg.block_size, kv_dtype)
        hybrid = self.placement is not None
        tiers = plan_tiers(self.placement, cfg.plan, cfg.max_num_seqs) if hybrid and cfg.overlap == "auto" else ()
        self.model.dual_batch, self.overlap_note = choose_dual_batch(cfg.overlap, hybrid, tiers)
        self._stream_gate: list = []  # MoE blocks whose streaming prefill is switched per step (stream_prefill="on")
        self._stream_stats = None  # stream-loading prefill's StreamStats, read after each step
        try:
            self._attach_prefill(model_dir)
        except BaseException:
            self.close()
            raise
        if self.placement is not None and cfg.verbose:
            print(placement_report(self.placement, self.accel), file=sys.stderr)
        if cfg.verbose and self.prefill_note:
            print(self.prefill_note, file=sys.stderr)
        if cfg.verbose:
            print(self.overlap_note, file=sys.stderr)
        wanted = cfg.max_model_len or self.model_config.max_position_embeddings
        cache_tokens = num_blocks * cfg.block_size
        self.max_model_len = min(wanted, cache_tokens)
        source = (f"set by the KV cache: kv_cache_gb={cfg.kv_cache_gb:g} holds {cache_tokens} tokens"
                  if cache_tokens < wanted else
                  "set by EngineConfig.max_model_len" if cfg.max_model_len else
                  "the model's max_position_embeddings")
        self.scheduler = Scheduler(BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching),
                                   cfg.max_num_seqs, cfg.max_num_batched_tokens, self.max_model_len, source)
        self.sampler = Sampler()
        self._ids = itertools.count()
        self._states: dict[str, _RequestState] = {}
        self._importance_window: int | None = None  # set_prompt_importance
        self._prompt_kv_observer = None  # set_prompt_kv_observer
        self._reserved: set[str] = set()  # reserve_adoption's requests, until complete_adoption or cancel_adoption

    def _place(self, kv_cache_bytes: int) -> None:
        """Plan (or read the plan file) and move the resident parts onto the accelerator (models/placement.py)."""
        cfg = self.config
        budget = parse_bytes(cfg.vram)
        if cfg.plan is not None:
            placement, plan_budget = load_plan_file(cfg.plan, self.model_config, self.model.dtype, cfg.routing)
            self.accel = select_accelerator(cfg.device, budget if budget is not None else int(plan_budget))
        else:
            self.accel = select_accelerator(cfg.device, budget)
            if self.accel.ledger.budget is None:
                raise ValueError("hybrid execution needs a vram budget on the CPU stand-in (e.g. vram='2GB')")
            placement = plan_placement(self.model, self.accel, self.accel.ledger.budget, kv_cache_bytes,
                                       cfg.max_num_seqs, cfg.num_gpus, cfg.routing, cfg.profile,
                                       Path(self.model_dir).name.lower())
        self.run_stats = RunStats(self.accel.ledger, self.accel.is_cuda)
        place_model(self.model, placement, self.accel, self.run_stats)
        self.placement = placement

    def _attach_prefill(self, model_dir: Path) -> None:
        """Stream-loading prefill (layers/moe/stream_prefill.py), over num_gpus ranks with expert parallelism when
        num_gpus > 1 (parallel/): "on" for every step that prefills, "auto" for chunks from the plan's crossover on
        (off without a plan, or when the plan predicts none, or when its device slots do not fit the budget)."""
        cfg, plan = self.config, self.placement.plan if self.placement is not None else None
        self.prefill_note = ""
        if cfg.stream_prefill == "off":
            if cfg.num_gpus > 1:
                raise ValueError(f"num_gpus={cfg.num_gpus} runs stream-loading prefill over the ranks; "
                                 "stream_prefill='off' leaves nothing for them to do")
            return
        if cfg.stream_prefill == "auto":
            crossover = plan.crossover_tokens if plan is not None else None
            if crossover is None:
                self.prefill_note = ("stream-loading prefill: off (" + ("the plan predicts no prompt length where "
                                     "it wins" if plan is not None else "no plan: the plain CPU engine") + ")")
                if cfg.num_gpus > 1:
                    raise ValueError(f"num_gpus={cfg.num_gpus}: stream_prefill='auto' found no crossover "
                                     f"({self.prefill_note}); give stream_prefill='on' to use the ranks")
                return
            min_tokens = max(crossover, cfg.max_num_seqs + 1)  # a decode-only step never streams
        else:
            min_tokens = 1  # every step with a prefill chunk streams (switched per step in _run)
        if self.accel is None:  # the stand-in without a budget: an unbounded one for the slots
            self.accel = select_accelerator(cfg.device, parse_bytes(cfg.vram))
            self.run_stats = RunStats(self.accel.ledger, self.accel.is_cuda)
        if cfg.num_gpus > 1:
            from hybridmoe.parallel.attach import attach_expert_parallel

            parallel = attach_expert_parallel(self.model, model_dir, cfg.num_gpus, self.accel, min_tokens)
            self._attached.append(parallel.close)
            what = f"over {parallel.world_size} ranks (expert parallelism)"
        else:
            from hybridmoe.layers.moe.stream_prefill import StreamPrefill, fitting_slot_bytes, planned_copy

            builder = self.placement.builder if self.placement is not None else None
            copy = planned_copy(builder) if plan is not None and cfg.stream_prefill == "auto" else "all"
            # the plan's slot (a layer's experts, at most 1 GiB), cut to what the budget has left for two
            slot_bytes = fitting_slot_bytes(self.accel, self._planned_slot_bytes(builder))
            try:
                slp = StreamPrefill(self.model, self.accel, min_tokens, copy, slot_bytes=slot_bytes)
            except DeviceMemoryError as error:
                if cfg.stream_prefill == "on":
                    raise
                self.prefill_note = f"stream-loading prefill: off (its device slots do not fit: {error})"
                return
            self._attached.append(slp.detach)
            self._stream_stats = slp.stats
            for block in slp.blocks:  # its grouped matmuls count as accelerator time
                block.prefill_experts = TimedOnDevice(block.prefill_experts, self.run_stats)
            what = "on this accelerator"
        blocks = [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, MoEBlock)]
        if cfg.stream_prefill == "on":
            self._stream_gate = blocks
        self.prefill_note = (f"stream-loading prefill {what}: " + ("every prefill step" if cfg.stream_prefill == "on"
                             else f"chunks of at least {min_tokens} tokens (the plan's crossover)"))

    @staticmethod
    def _planned_slot_bytes(builder) -> float | None:
        """The planner's stream-loading slot size for this model (placement/estimate.py `stream_slots`), or None
        (no plan: the streamer's default, the same 1 GiB cap)."""
        if builder is None:
            return None
        from hybridmoe.placement.estimate import stream_slots

        return stream_slots(builder, None)[0]

    def close(self) -> None:
        """Stop what the engine started beside the model (expert-parallel worker ranks) and free stream-loading
        prefill's device slots; idempotent. The engine can still decode afterwards, without them."""
        attached, self._attached = self._attached, []
        for part in attached:
            part()

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    req_id: str | None = None) -> str:
        """Queue a prompt (text, or token ids); raises ValueError with the reason when it cannot be served."""
        params = params or SamplingParams()
        if len(prompt) == 0:
            raise ValueError("the prompt is empty")
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}): got {bad[:5]}")
        req_id = req_id if req_id is not None else f"req-{next(self._ids)}"
        if req_id in self._states:
            raise ValueError(f"request id {req_id!r} is already in use")
        request = Request(req_id=req_id, prompt_token_ids=prompt_ids, sampling_params=params,
                          eos_token_ids=tuple(self.tokenizer.eos_token_ids), arrival_time=time.monotonic())
        self.scheduler.add_request(request)  # validates lengths against the cache
        generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, skip_special_tokens=params.skip_special_tokens,
                                       stop=params.stop, min_tokens=params.min_tokens)
        prompt_logprobs = (PromptLogprobs(prompt_ids, params.prompt_logprobs)
                           if params.prompt_logprobs is not None else None)
        self._states[req_id] = _RequestState(request, generator, detok, prompt_logprobs)
        return req_id

    def set_prompt_importance(self, on: bool, window: int = WINDOW) -> None:
        """Score each prompt's tokens by attention importance while it prefills (kv/importance.py: the attention
        mass each token receives from the prompt's last `window` queries, an observer on the forward that computes
        the prompt's last token; that step skips the C++ decode kernel; a prompt found in the prefix cache still
        computes its last `window` tokens). `prompt_importance(req_id)` reads it."""
        self._importance_window = window if on else None
        self.scheduler.min_computed_tail = window if on else 1

    def set_prompt_kv_observer(self, observe: Callable[[int, list[CompletingPrompt]], None] | None) -> None:
        """Call observe(layer_index, prompts) after each layer of every step that completes prompts (the step
        whose chunk ends a request's prompt), prompts listing them: their KV at that layer is all in the cache
        then, while the later layers are still to be computed. The PD prefill worker sends it from there. None
        removes it."""
        self._prompt_kv_observer = observe

    def prompt_importance(self, req_id: str) -> torch.Tensor | None:
        """float32 [prompt tokens]: req_id's attention importance (None until its prefill is complete, or when
        set_prompt_importance is off)."""
        return self._states[req_id].importance

    def abort_request(self, req_id: str) -> None:
        """End req_id at the next step (finish_reason "abort"); a reserved adoption, which never ran, is cancelled
        at once. Unknown ids are ignored."""
        if req_id in self._reserved:
            self.cancel_adoption(req_id)
        elif req_id in self._states:
            self.scheduler.abort_request(req_id)

    # ---- prefill/decode disaggregation (hybridmoe.disagg): a request moves between two engines with its KV ----

    def detach_request(self, req_id: str) -> torch.Generator | None:
        """Forget req_id without reporting it: another engine carries on with it (its KV was copied out of this
        engine's cache first). Its blocks are freed (full ones stay in the prefix cache); returns its sampling
        generator (seeded requests), whose state the other engine continues from."""
        state = self._states.pop(req_id)
        self.scheduler.finish_request(req_id, RequestStatus.FINISHED_ABORTED, "detached")
        return state.generator

    def can_adopt(self, num_tokens: int) -> bool:
        """Whether the free KV blocks hold a request of num_tokens computed tokens plus its next one."""
        manager = self.scheduler.block_manager
        return manager.blocks_needed(num_tokens + 1) <= manager.num_free_blocks

    def adopt_request(self, prompt_ids: list[int], params: SamplingParams, req_id: str, first_token: int,
                      write_kv, generator_state: torch.Tensor | None = None) -> None:
        """Take over a request whose prompt another engine prefilled and whose first token it sampled and
        reported: the request runs here from its second token on. write_kv(block_table) fills this engine's
        cache (`runner.kv_caches`) with the prompt's KV at the table's slots and returns None when that is what a
        prefill here would compute, else an AdoptedKV: a compressed prompt, whose dropped positions the request's
        attention masks (their positions kept: the next token is at position len(prompt_ids)) and whose blocks
        are not offered to the prefix cache, until a preemption makes it recompute its prompt. Raises ValueError
        when the request cannot be served here (as add_request), or when the KV blocks are not free (check
        can_adopt first)."""
        table = self.reserve_adoption(prompt_ids, params, req_id)
        try:
            adopted = write_kv(table)
        except BaseException:
            self.cancel_adoption(req_id)
            raise
        self.complete_adoption(req_id, first_token, adopted, generator_state)

    def reserve_adoption(self, prompt_ids: list[int], params: SamplingParams, req_id: str) -> list[int]:
        """adopt_request in three parts, for a prompt whose KV arrives over several steps: this one takes the KV
        blocks and returns the block table to write the prompt's KV into; the request waits outside the
        scheduler's queues (never scheduled) until complete_adoption, or cancel_adoption gives the blocks back.
        Raises ValueError as adopt_request does."""
        self.add_request(prompt_ids, params, req_id)
        request = self._states[req_id].request
        scheduler, manager = self.scheduler, self.scheduler.block_manager
        scheduler.waiting.remove(request)
        if not manager.allocate_slots(request, len(prompt_ids) + 1):
            self.cancel_adoption(req_id)
            raise ValueError(f"request {req_id!r}: no free KV blocks for its {len(prompt_ids)} tokens")
        self._reserved.add(req_id)
        return manager.get_block_table(req_id)

    def cancel_adoption(self, req_id: str) -> None:
        """Give back a reserved adoption's blocks and forget it (nothing is reported)."""
        self._reserved.discard(req_id)
        del self._states[req_id]
        self.scheduler.finish_request(req_id, RequestStatus.FINISHED_ABORTED)

    def complete_adoption(self, req_id: str, first_token: int, adopted: AdoptedKV | None = None,
                          generator_state: torch.Tensor | None = None) -> None:
        """The reserved request's KV is all written (adopted: as write_kv returns it): it runs from its second
        token on."""
        self._reserved.remove(req_id)
        state = self._states[req_id]
        request = state.request
        scheduler, manager = self.scheduler, self.scheduler.block_manager
        request.num_computed_tokens = request.num_prompt_tokens
        if adopted is not None:
            dropped = adopted.dropped if adopted.dropped is not None and bool(adopted.dropped.any()) else None
            request.kv_dropped = None if dropped is None else dropped.to(torch.bool).cpu()
            request.kv_exact = adopted.exact and dropped is None
        manager.cache_full_blocks(request)
        request.status = RequestStatus.RUNNING
        scheduler.running.append(request)
        request.append_output_token(first_token)  # the prefilling engine ended requests that stop here
        state.detok.add(first_token)  # its text went out with the prefilling engine's output
        state.first_token_time = time.monotonic()
        if generator_state is not None and state.generator is not None:
            state.generator.set_state(generator_state)

    def stats(self) -> SchedulerStats:
        """Requests running and waiting, KV blocks used / free / cached, and cumulative counters (prefix-cache
        queries and hits and tokens computed, in tokens; preemptions): see SchedulerStats, docs/runtime.md."""
        return self.scheduler.stats()

    def has_unfinished_requests(self) -> bool:
        """True while a request runs or waits, or has finished without being reported yet (aborted); not for
        adoptions that only wait for their KV (reserve_adoption): there is nothing to step for them."""
        reserved = len(self._reserved)
        return self.scheduler.num_unfinished_requests > reserved or len(self._states) > reserved

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; returns an output for every request that produced tokens or finished."""
        sched = self.scheduler.schedule()
        outputs: dict[str, RequestOutput] = {}
        if sched.scheduled:
            try:
                sampled, logprobs = self._run(sched)
            except Exception as exc:  # a failed step ends its own requests, never the engine
                for item in sched.scheduled:
                    req = item.request
                    self.scheduler.finish_request(req.req_id, RequestStatus.FINISHED_ERROR, "error")
                    req.error = f"{type(exc).__name__}: {exc}"
                sampled = None
            if sampled is not None:
                finished = {r.req_id for r in self.scheduler.update_from_output(sched, sampled)}
                for req_id, token in sampled.items():
                    state = self._states[req_id]
                    new_text = state.detok.add(token)
                    state.new_ids.append(token)
                    state.new_text += new_text
                    if req_id in logprobs:
                        state.new_logprobs.append(logprobs[req_id])
                    if state.first_token_time is None:
                        state.first_token_time = time.monotonic()
                    if state.detok.stopped and req_id not in finished:
                        self.scheduler.finish_request(req_id, RequestStatus.FINISHED_STOPPED, "stop")
        for req_id, state in list(self._states.items()):
            if state.new_ids or state.request.status.is_finished:
                outputs[req_id] = state.take_output()
            if state.request.status.is_finished:
                del self._states[req_id]
        return list(outputs.values())

    def _run(self, sched) -> tuple[dict[str, int], dict[str, TokenLogprobs]]:
        """One forward and sampling: the sampled id, and its logprobs where asked, of each request that samples."""
        if any(item.request.kv_dropped is not None for item in sched.scheduled):
            # sequences with dropped keys after the plain decodes: those stay the C++ decode kernel's batch
            sched.scheduled.sort(key=lambda item: item.num_new_tokens != 1 or item.request.kv_dropped is not None)
        chunks, sample_rows, scoring_prompt = [], [], []
        for i, item in enumerate(sched.scheduled):
            req, start = item.request, item.request.num_computed_tokens
            chunks.append(SequenceChunk(req.all_token_ids[start:start + item.num_new_tokens], start, item.block_table,
                                        req.kv_dropped))
            if start + item.num_new_tokens >= req.num_tokens:
                sample_rows.append(i)
            prompt_logprobs = self._states[req.req_id].prompt_logprobs
            if prompt_logprobs is not None and prompt_logprobs.wants(start, item.num_new_tokens):
                scoring_prompt.append(i)
        stats = self.run_stats
        decode_only = all(item.num_new_tokens == 1 for item in sched.scheduled)
        for block in self._stream_gate:  # stream_prefill="on": steps with a prefill chunk stream, decode steps not
            block.prefill_min_tokens = sys.maxsize if decode_only else 1
        streamed = self._stream_stats() if self._stream_stats is not None else None
        stats.begin_step("decode" if decode_only else "prefill")
        wanted = self._importance_window is not None or self._prompt_kv_observer is not None
        completing = self._completing_prompts(sched) if wanted else []  # none looked for: nothing on decode steps
        trackers = ({i: AttentionImportance(sched.scheduled[i].request.num_prompt_tokens, self._importance_window,
                                            seq=i) for i in completing} if self._importance_window is not None else {})
        remove = self.model.add_attention_observer(_dispatch(trackers)) if trackers else None
        layer_hook = self._prompt_kv_hook(sched, completing)
        try:
            with torch_threads_for_step(sum(item.num_new_tokens for item in sched.scheduled)):  # sampling included
                result = self._forward_and_sample(sched, chunks, sample_rows, scoring_prompt, streamed)
        finally:
            if remove is not None:
                remove()
            if layer_hook is not None:
                self.model.layer_observers.remove(layer_hook)
        for i, tracker in trackers.items():
            self._states[sched.scheduled[i].request.req_id].importance = tracker.scores()
        return result

    @staticmethod
    def _completing_prompts(sched) -> list[int]:
        """The indices of this step's sequences whose chunk ends their prompt (before any output)."""
        completing = []
        for i, item in enumerate(sched.scheduled):
            req = item.request
            start, n = req.num_computed_tokens, req.num_prompt_tokens
            if req.num_output_tokens == 0 and start < n <= start + item.num_new_tokens:
                completing.append(i)
        return completing

    def _prompt_kv_hook(self, sched, completing: list[int]) -> Callable[[int], None] | None:
        """The model's layer observer that calls the prompt-KV observer for this step (None: nothing to call)."""
        observe = self._prompt_kv_observer
        if observe is None or not completing:
            return None
        prompts = [CompletingPrompt(item.request.req_id, list(item.request.prompt_token_ids), list(item.block_table))
                   for item in (sched.scheduled[i] for i in completing)]

        def hook(layer: int) -> None:
            observe(layer, prompts)

        self.model.layer_observers.append(hook)
        return hook

    def _forward_and_sample(self, sched, chunks, sample_rows, scoring_prompt, streamed):
        """_run's forward, prompt scoring and sampling (inside its torch thread scope)."""
        stats = self.run_stats
        logits = self.runner.forward(chunks, all_logits=bool(scoring_prompt))  # [S, V], or [T, V] when scoring
        if streamed is not None:
            now = self._stream_stats()
            stats.add_streamed(now.bytes - streamed.bytes, now.copy_s - streamed.copy_s)
        stats.end_step(sum(item.num_new_tokens for item in sched.scheduled))
        if scoring_prompt:  # every position's logits: score the prompt tokens, keep each chunk's last row
            ends = torch.tensor([len(c.token_ids) for c in chunks]).cumsum(0)  # [S]
            for i in scoring_prompt:
                item = sched.scheduled[i]
                self._states[item.request.req_id].prompt_logprobs.add_chunk(
                    logits[int(ends[i]) - item.num_new_tokens:int(ends[i])], item.request.num_computed_tokens)
            logits = logits[ends - 1]  # [S, V]
        if not sample_rows:
            return {}, {}
        reqs = [sched.scheduled[i].request for i in sample_rows]
        if len(sample_rows) < logits.shape[0]:  # sample_rows ascend: all of them is every row
            logits = logits[sample_rows]  # [R, V]
        tokens = self.sampler.sample(
            _without_early_stops(logits, reqs), [r.sampling_params for r in reqs],
            [self._states[r.req_id].generator for r in reqs], [r.all_token_ids for r in reqs],
            [r.output_token_ids for r in reqs],
        ).tolist()
        sampled = {r.req_id: int(t) for r, t in zip(reqs, tokens)}
        logprobs = {}
        for k in sorted({r.sampling_params.logprobs for r in reqs if r.sampling_params.logprobs is not None}):
            rows = [j for j, r in enumerate(reqs) if r.sampling_params.logprobs == k]
            values = token_logprobs(logits[rows], [tokens[j] for j in rows], k)
            logprobs.update((reqs[j].req_id, v) for j, v in zip(rows, values))
        return sampled, logprobs


def _dispatch(trackers: dict[int, AttentionImportance]):
    """One attention observer feeding each tracked sequence's AttentionImportance (the others cost nothing)."""

    def observe(layer: int, seq: int, q: torch.Tensor, k: torch.Tensor, scale: float) -> None:
        tracker = trackers.get(seq)
        if tracker is not None:
            tracker(layer, seq, q, k, scale)

    return observe


def _without_early_stops(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """logits [R, V] with EOS and stop_token_ids at -inf in the rows that have not reached min_tokens (a copy when
    any row changes)."""
    rows, ids = [], []
    for row, request in enumerate(requests):
        params = request.sampling_params
        if request.num_output_tokens < params.min_tokens:
            banned = {*params.stop_token_ids, *(() if params.ignore_eos else request.eos_token_ids)}
            banned = [t for t in banned if t < logits.shape[1]]
            rows += [row] * len(banned)
            ids += banned
    if not rows:
        return logits
    logits = logits.clone()
    logits[torch.tensor(rows), torch.tensor(ids)] = -torch.inf
    return logits


class _RequestState:
    def __init__(self, request: Request, generator: torch.Generator | None, detok: IncrementalDetokenizer,
                 prompt_logprobs: PromptLogprobs | None):
        self.request, self.generator, self.detok = request, generator, detok
        self.prompt_logprobs = prompt_logprobs
        self.new_ids: list[int] = []
        self.new_text = ""
        self.new_logprobs: list[TokenLogprobs] = []
        self.first_token_time: float | None = None
        self.importance: torch.Tensor | None = None  # attention importance of the prompt (set_prompt_importance)

    def take_output(self) -> RequestOutput:
        req = self.request
        if req.status.is_finished:  # what the detokenizer held back (a partial character, a stop-string prefix)
            self.new_text += self.detok.flush()
        out = RequestOutput(
            req_id=req.req_id, prompt_token_ids=req.prompt_token_ids, token_ids=list(req.output_token_ids),
            text=self.detok.text, new_token_ids=self.new_ids, new_text=self.new_text,
            finished=req.status.is_finished, finish_reason=req.finish_reason, error=req.error,
            first_token_time=self.first_token_time, arrival_time=req.arrival_time,
            new_logprobs=self.new_logprobs if req.sampling_params.logprobs is not None else None,
            prompt_logprobs=(self.prompt_logprobs.values
                             if self.prompt_logprobs is not None and self.prompt_logprobs.complete else None),
        )
        self.new_ids, self.new_text, self.new_logprobs = [], "", []
        return out
