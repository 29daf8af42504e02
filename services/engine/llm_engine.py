"""LLMEngine: one engine's request lifecycle over the scheduler, model runner and sampler.

Not thread-safe: one thread drives it (the worker's forward loop, or `LLM.generate`). Each
`step()` schedules one forward pass (decodes, chunked prefills), runs it, samples the sequences
whose logits came back, checks their stop conditions and returns every sequence's news in one
`StepOutput`, plus the engine's load. Requests are validated at `add_request` with messages meant
for the caller; an aborted request's blocks are freed at once and it is reported once, with
finish reason ABORT, by the next step. The runner (model_runner.ModelRunner) declares its
capabilities: with an argmax-only greedy step, all-greedy steps skip the logits; with steps
launched without waiting (the CUDA fast path's `launch_greedy`), all-greedy steps overlap: each
`step()` launches the next step before reading this one's sampled ids
(services/engine/overlap.py); outputs are the same.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from services.common.errors import (
    AlreadyExistsError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    SluiceError,
)
from services.common.protocol import finish_profile
from services.common.protocol.adapter_record import AdapterRecord, validate_adapter_name
from services.common.protocol.sampling_params import SamplingParams, validate_prompt_token_ids
from services.engine import compile_watch, overlap
from services.engine.block_manager import BlockManager
from services.engine.config import EngineConfig
from services.engine.forward_batch import ScheduledBatch
from services.engine.load_rates import StepRates
from services.engine.lora.config import LoRAConfig
from services.engine.outputs import (
    EngineLoad,
    FinishReason,
    SequenceDelta,
    StepOutput,
    TokenLogprob,
)
from services.engine.overlap import (
    LaunchedStep,
    OverlappedSteps,
    can_schedule_ahead,
    hold_back_ahead,
)
from services.engine.sampler import Sampler, SamplerOutput
from services.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from services.engine.sequence import Sequence
from services.engine.step_budget import build_step_budget
from services.engine.step_stats import QueueState, StepStats
from services.engine.swap_space import GIB, HostBlocks, default_swap_space_gib
from services.engine.warmup import WarmupReport, plan_warmup, warm_up

if TYPE_CHECKING:  # the runner modules import torch; the engine's policy code does not
    from services.common.model_files import ModelFiles
    from services.engine.kv_swap import KVSwapper
    from services.engine.lora.engine_adapters import EngineAdapters
    from services.engine.model_runner import ModelRunner, PendingTokens

logger = logging.getLogger(__name__)

MAX_REQUEST_ID_CHARS = 256


@dataclass(frozen=True)
class EngineInfo:
    """What a caller needs to know about a running engine (sent by the worker's Info RPC)."""

    model_name: str
    max_model_len: int
    vocab_size: int
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    eos_token_ids: tuple[int, ...]
    backend: str
    device: str
    dtype: str
    target_step_ms: float = 0.0  # step-time target of chunked prefill (0: off)
    execution_path: str = ""  # how steps run (the runner's `execution_path`), for the logs
    max_loras: int = 0  # LoRA device slots (0: adapters off)
    max_lora_rank: int = 0
    max_inflight: int = 0  # requests taken in flight at once (0: max_num_seqs)


def _check_lora_supported(config: EngineConfig) -> None:
    """Refuse LoRA adapters where the forward would not apply them, before building anything."""
    from services.engine.runner_factory import FORWARD_BACKEND_RUNNERS

    if not LoRAConfig.from_engine_config(config).enabled:
        return
    if config.backend in FORWARD_BACKEND_RUNNERS:
        raise FailedPreconditionError(
            f"LoRA adapters (--adapter-root) are not served by the {config.backend} backend; "
            "use the torch backend or leave --adapter-root unset"
        )


class LLMEngine(OverlappedSteps):
    """Continuous-batching engine over one model runner."""

    def __init__(self, config: EngineConfig, *, model_runner: ModelRunner | None = None) -> None:
        from services.engine.device_limits import resolve_limits

        _check_lora_supported(config)
        if model_runner is None:
            config, model_runner = self._build_runner(config)
        else:
            config, limits = resolve_limits(
                config, model_runner.model_config, str(model_runner.device)
            )
            logger.info("step limits: %s", limits)
        self.config = config
        self.runner: ModelRunner = model_runner
        self.model_files: ModelFiles | None = model_runner.model_files
        model_config = model_runner.model_config
        self.block_manager = BlockManager(
            model_runner.num_blocks, model_runner.block_size, config.enable_prefix_caching
        )
        max_model_len = int(model_config.max_model_len)
        if config.max_model_len is not None:
            max_model_len = min(max_model_len, config.max_model_len)
        # LoRA adapters (services/engine/lora/), when config.adapter_root is set.
        self._adapter_load_done = threading.Event()
        self.on_adapter_load_done: Callable[[], None] | None = None  # e.g. wake the step loop
        self._idle_for_adapters = False
        lora_config = LoRAConfig.from_engine_config(config)
        self.adapters: EngineAdapters | None = None
        if lora_config.enabled:
            self.adapters = self._build_adapters(lora_config, config, model_runner)
        self.kv_swap = self._build_swap(config, lora_config, model_runner)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=max_model_len,
            ),
            self.block_manager,
            adapter_slots=self.adapters.gate if self.adapters is not None else None,
            prefill_budget=build_step_budget(config, lambda: self.rates.step_cost()),
            host_blocks=HostBlocks(self.kv_swap.num_blocks) if self.kv_swap is not None else None,
        )
        if self.kv_swap is not None:
            self.scheduler.on_swaps = self.kv_swap.apply
        eos = tuple(int(token) for token in model_config.eos_token_ids)
        self.sampler = Sampler(eos, seed=config.seed)
        # What the runner declares it can do decides the step paths; None: not taken.
        capabilities = model_runner.capabilities
        # The all-greedy fast path (argmax ids without logits); otherwise the sampler.
        self._execute_greedy: Callable[[ScheduledBatch], Any] | None = (
            model_runner.execute_greedy if capabilities.greedy_ids else None
        )
        # Overlapped greedy steps (services/engine/overlap.py), where the runner can launch a
        # step without waiting for it (the CUDA fast path); others keep the plain path.
        self._launch_greedy: Callable[[ScheduledBatch], PendingTokens] | None = (
            model_runner.launch_greedy if capabilities.supports_overlap else None
        )
        if self.adapters is not None and self._launch_greedy is not None:
            self._launch_greedy = self._with_adapters(self._launch_greedy)
        self._overlap_max_batch = capabilities.overlap_max_batch
        self._overlap_mixed = capabilities.supports_overlap and capabilities.overlap_mixed
        self._launched: LaunchedStep | None = None
        self._last_collected = 0.0  # perf_counter when a launched step's ids were last read
        self.host_wait_s = 0.0  # blocked reading launched steps' ids (overlap.py)
        self.num_overlapped_steps = 0
        # Steps that were not planned ahead, by why not (overlap.py's reasons): each one waited
        # for the step before it to be read before it was planned.
        self.plain_step_reasons: Counter[str] = Counter()
        self._not_ahead = overlap.IDLE  # why the next step is not planned ahead (if it is not)
        self.info = EngineInfo(
            model_name=str(model_config.name),
            max_model_len=max_model_len,
            vocab_size=int(model_config.vocab_size),
            block_size=model_runner.block_size,
            num_blocks=model_runner.num_blocks,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            target_step_ms=config.target_step_ms,
            eos_token_ids=eos,
            backend=config.backend,
            device=str(model_runner.device),
            dtype=str(model_runner.dtype).removeprefix("torch."),
            execution_path=str(
                getattr(model_runner, "execution_path", "") or f"{config.backend} ops"
            ),
            max_loras=lora_config.max_loras if lora_config.enabled else 0,
            max_lora_rank=lora_config.max_lora_rank if lora_config.enabled else 0,
            max_inflight=(
                self.adapters.inflight_capacity(config.max_num_seqs)
                if self.adapters is not None
                else config.max_num_seqs
            ),
        )
        self._eos = frozenset(eos)
        self._max_model_len = max_model_len
        self._requests: dict[str, Sequence] = {}
        # seq_ids of live requests that may sample other than plain argmax at some step: while
        # there are none, a step planned ahead skips the scan of the waiting and paused ones.
        self._maybe_sampling: set[int] = set()
        self._aborted: list[SequenceDelta] = []
        self._seq_ids = itertools.count()
        self.rates = StepRates()
        self.stats = StepStats(config.stats_log_interval_s)

    @staticmethod
    def _build_runner(config: EngineConfig) -> tuple[EngineConfig, ModelRunner]:
        """The runner for `config`, and `config` with its unset step limits sized for the
        device and the model (services/engine/device_limits.py) before the runner is built."""
        from services.common.model_files import resolve_model
        from services.engine.device_limits import resolve_limits
        from services.engine.model_runner import load_model_config
        from services.engine.runner_factory import create_model_runner

        files = resolve_model(config.model)
        model_config = load_model_config(files, config.max_model_len)
        config, limits = resolve_limits(config, model_config, config.resolved_device())
        logger.info("step limits: %s", limits)
        return config, create_model_runner(config, files)

    def _build_adapters(
        self, lora_config: LoRAConfig, config: EngineConfig, runner: ModelRunner
    ) -> EngineAdapters:
        """The engine's LoRA parts, bound to the runner's model (its `bind_lora`)."""
        from services.engine.lora.engine_adapters import EngineAdapters

        bind = getattr(runner, "bind_lora", None)
        if bind is None:
            raise FailedPreconditionError(
                f"LoRA adapters (--adapter-root) are not served by the {type(runner).__name__} "
                "runner; leave --adapter-root unset"
            )
        max_rows = max(config.max_num_batched_tokens, runner.lora_max_rows(config))
        adapters = EngineAdapters(
            lora_config,
            runner.model_config,
            dtype=runner.dtype,
            device=runner.device,
            kernels=runner.lora_kernels,
            max_rows=max_rows,
            on_load_done=self._adapter_loaded,
        )
        bind(adapters)
        logger.info(
            "LoRA adapters from %s: %d device slots, %d in host memory (loaded by %d threads), "
            "rank <= %d, %s kernels",
            lora_config.adapter_root,
            lora_config.max_loras,
            lora_config.max_cpu_loras,
            lora_config.load_workers,
            lora_config.max_lora_rank,
            runner.lora_kernels,
        )
        return adapters

    def _build_swap(
        self, config: EngineConfig, lora_config: LoRAConfig, runner: ModelRunner
    ) -> KVSwapper | None:
        """Host swap space for paused sequences' KV (`swap_space_gib`), or None."""
        time_sliced = lora_config.enabled and lora_config.slot_quantum_ms > 0
        device = str(runner.device).partition(":")[0]
        gib = config.swap_space_gib
        if gib is None:
            gib = default_swap_space_gib(device_type=device, time_sliced=time_sliced)
        if gib <= 0:
            return None
        if not time_sliced:
            logger.info(
                "swap space unused: only sequences paused for a LoRA slot turn are swapped "
                "out (adapters off or lora_slot_quantum_ms 0)"
            )
            return None
        cache = getattr(runner, "kv_cache", None)
        if cache is None:
            logger.info("swap space unused: the %s runner keeps no KV tensors here", device)
            return None
        from services.engine.kv_swap import KVSwapper

        per_block = sum(k.nbytes + v.nbytes for k, v in cache.layers) // cache.num_blocks
        num_blocks = int(gib * GIB) // per_block
        if num_blocks < 1:
            return None
        started = time.perf_counter()
        try:
            swapper = KVSwapper(cache.layers, num_blocks, getattr(cache, "stacked", None))
        except (RuntimeError, MemoryError) as exc:  # e.g. pinned memory refused: serve without
            logger.warning(
                "no KV swap space: %.1f GiB of host memory could not be allocated (%s); paused "
                "sequences keep their KV blocks on the device (set --swap-space-gib lower)",
                gib,
                exc,
            )
            return None
        logger.info(
            "KV swap space for paused sequences: %d blocks (%.1f GiB of %s host memory, "
            "%d tokens) in %.1fs",
            num_blocks,
            swapper.nbytes / GIB,
            "pinned" if device == "cuda" else "plain",
            num_blocks * cache.block_size,
            time.perf_counter() - started,
        )
        return swapper

    def _with_adapters(self, run: Callable[[ScheduledBatch], Any]) -> Callable[..., Any]:
        """`run` preceded by telling the LoRA runtime which rows use which slot."""
        adapters = self.adapters

        def run_with_adapters(batch: ScheduledBatch) -> Any:
            adapters.begin_step(batch)
            return run(batch)

        return run_with_adapters

    def _adapter_loaded(self) -> None:
        """On a loader thread: an adapter load ended; wake whoever waits for it."""
        self._adapter_load_done.set()
        callback = self.on_adapter_load_done
        if callback is not None:
            callback()

    def waiting_for_adapters(self) -> bool:
        """True when the last step ran nothing because every live request waits for an
        adapter load: a driver may sleep until `on_adapter_load_done` (or a new request)."""
        return self._idle_for_adapters and not self._aborted

    def wait_for_adapter_load(self, timeout_s: float) -> bool:
        """Block until an adapter load ends (or timeout); whether one ended."""
        ended = self._adapter_load_done.wait(timeout_s)
        self._adapter_load_done.clear()
        return ended

    # ---- adapters -------------------------------------------------------------------------
    def inspect_adapter(self, name: str, path: str) -> AdapterRecord:
        """Validate an adapter under the adapter root (thread-safe: reads files only)."""
        if self.adapters is None:
            raise FailedPreconditionError("LoRA adapters are off (no --adapter-root)")
        return self.adapters.inspect(name, path)

    def register_adapter(self, record: AdapterRecord) -> None:
        """Register (or re-register with new files) an adapter by name."""
        if self.adapters is None:
            raise FailedPreconditionError("LoRA adapters are off (no --adapter-root)")
        self.adapters.register(record)

    # ---- requests -------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        adapter: str | None = None,
        priority: int = 0,
        adapter_spec: AdapterRecord | None = None,
    ) -> None:
        """Validate and queue a request; raises a SluiceError subclass on bad input.

        `adapter` names a LoRA adapter (None or "": the base model); `adapter_spec`, when given,
        registers it first (its files are read and verified when it loads)."""
        if not isinstance(request_id, str) or not request_id:
            raise InvalidArgumentError("request_id must be a non-empty string")
        if len(request_id) > MAX_REQUEST_ID_CHARS:
            raise InvalidArgumentError(
                f"request_id may have at most {MAX_REQUEST_ID_CHARS} characters"
            )
        if not isinstance(params, SamplingParams):
            raise InvalidArgumentError("params must be a SamplingParams")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidArgumentError(f"priority must be an integer, got {priority!r}")
        if not isinstance(prompt_token_ids, (list, tuple)):
            raise InvalidArgumentError("prompt_token_ids must be a list of integers")
        prompt = list(prompt_token_ids)
        validate_prompt_token_ids(prompt, self.info.vocab_size)
        params.validate_for_model(len(prompt), self.info.max_model_len, self.info.vocab_size)
        if request_id in self._requests:
            raise AlreadyExistsError(f"request {request_id!r} is already running")
        adapter = adapter or None
        if adapter is not None:
            if self.adapters is None:
                raise NotFoundError(f"unknown adapter {adapter!r} (LoRA adapters are off)")
            validate_adapter_name(adapter)
            if adapter_spec is not None:
                if adapter_spec.name != adapter:
                    raise InvalidArgumentError(
                        f"adapter_spec names {adapter_spec.name!r}, the request {adapter!r}"
                    )
                self.adapters.ensure_registered(adapter_spec)
        seq = Sequence(
            seq_id=next(self._seq_ids),
            request_id=request_id,
            prompt_token_ids=prompt,
            params=params,
            adapter=adapter,
            priority=priority,
        )
        if adapter is not None:
            # NOT_FOUND for an unknown name, before anything is queued.
            record = self.adapters.gate.hold(seq)
            seq.adapter_id = f"{record.name}@{record.sha256}"  # the prefix cache's key
        try:
            self.scheduler.add(seq)  # raises ResourceExhaustedError if it can never fit
        except BaseException:
            if self.adapters is not None:
                self.adapters.gate.drop(seq)
            raise
        self._requests[request_id] = seq
        if seq.argmax_from > 0:
            self._maybe_sampling.add(seq.seq_id)

    def abort(self, request_id: str) -> bool:
        """Stop a live request and free its blocks; False if it is unknown or already done."""
        seq = self._requests.get(request_id)
        if seq is None:
            return False
        self._retire(seq, FinishReason.ABORT)
        self._aborted.append(self._delta(seq, [], None, FinishReason.ABORT))
        return True

    def has_unfinished(self) -> bool:
        return bool(self._requests or self._aborted)

    def shutdown(self) -> None:
        """Stop background work (adapter loads)."""
        if self.adapters is not None:
            self.adapters.shutdown()

    def load(self) -> EngineLoad:
        rates = self.rates
        adapters = self.adapters
        finish_steps, finish_steps_of = self._finish_profile()
        return EngineLoad(
            free_blocks=self.block_manager.num_free_blocks,
            total_blocks=self.block_manager.num_blocks,
            running=self.scheduler.num_running,
            waiting=self.scheduler.num_waiting,
            resident_adapters=adapters.resident() if adapters is not None else (),
            loading_adapters=adapters.loading() if adapters is not None else (),
            lora_slots=self.info.max_loras,
            lora_adapter_capacity=adapters.adapter_capacity if adapters is not None else 0,
            queued_prompt_tokens=self._queued_prompt_tokens(),
            prefill_tokens_per_s=rates.prefill_tokens_per_s,
            decode_tokens_per_s=rates.decode_tokens_per_s,
            finished_per_s=rates.finished_per_s,
            finish_steps=finish_steps,
            finish_steps_of=finish_steps_of,
            stop_hazard=rates.stop_hazard,
        )

    def _finish_profile(self) -> tuple[tuple[int, ...], int]:
        """Steps until each sequence of the running batch reaches its max_tokens, as a sampled
        profile (finish_profile.sample); prompt + max_tokens never passes the model's length
        (add_request checks), so max_tokens is each one's limit. Taken every step (~40 us at
        512 sequences on a 2-vCPU host): a profile kept between steps would show sequences
        that have finished since as slots about to free."""
        running = self.scheduler.running
        if not running:
            return (), 0
        return finish_profile.sample(
            [seq.params.max_tokens - len(seq.output_token_ids) for seq in running]
        )

    def _queue_state(self) -> QueueState:
        """Sequences, KV use and LoRA counters now, for the stats line."""
        scheduler, blocks, adapters = self.scheduler, self.block_manager, self.adapters
        return QueueState(
            running=len(scheduler.running),
            paused=len(scheduler.paused),
            waiting=scheduler.num_waiting,
            used_blocks=blocks.num_blocks - blocks.num_free_blocks,
            total_blocks=blocks.num_blocks,
            slot_writes=adapters.manager.num_slot_writes if adapters is not None else 0,
            pauses=scheduler.num_pauses,
            swapped=scheduler.num_swapped if scheduler.host_blocks is not None else -1,
            swap_outs=scheduler.num_swap_outs,
            resident_adapters=len(adapters.resident()) if adapters is not None else -1,
            plain_step_reasons=(
                dict(self.plain_step_reasons) if self._launch_greedy is not None else None
            ),
            host_wait_s=self.host_wait_s,
        )

    def _queued_prompt_tokens(self) -> int:
        """Prompt tokens of waiting sequences and of running ones still prefilling."""
        total = 0
        for _, _, seq in self.scheduler.waiting:  # a preempted one recomputes its outputs too
            total += len(seq.token_ids) - seq.num_computed_tokens
        for seq in self.scheduler.running:
            left = len(seq.prompt_token_ids) - seq.num_computed_tokens
            if left > 0:
                total += left
        return max(total, 0)

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    # ---- one step -------------------------------------------------------------------------
    def step(self) -> StepOutput:
        """Run one step; every sequence's news and the engine's load (with measured rates)."""
        output = self._step()
        decoded = finished = stopped_early = 0
        for delta in output.deltas:
            decoded += len(delta.new_token_ids)
            if delta.finished:
                finished += 1
                stopped_early += delta.finish_reason is not FinishReason.LENGTH
        prefill_tokens = max(output.num_batched_tokens - decoded, 0)
        self.rates.record(
            output.step_time_s,
            prefill_tokens=prefill_tokens,
            decode_tokens=decoded,
            finished=finished,
            stopped_early=stopped_early,
        )
        self.stats.record(
            output.step_time_s, prefill_tokens, decoded, planned_ahead=output.planned_ahead
        )
        if self.stats.due():
            logger.info("%s", self.stats.line(self._queue_state()))
        return output

    def warm_up(self) -> WarmupReport:
        """Run every step shape this engine can take once (services/engine/warmup.py), so the
        first requests find kernels compiled and graphs replayed; call before serving."""
        info = self.info
        plan = plan_warmup(
            device_type=str(self.runner.device).partition(":")[0],
            max_num_seqs=info.max_num_seqs,
            max_num_batched_tokens=info.max_num_batched_tokens,
            max_model_len=info.max_model_len,
            num_blocks=info.num_blocks,
            block_size=info.block_size,
            decode_batches=getattr(self.runner.capabilities, "graph_batch_sizes", ()),
        )
        if self.has_unfinished():
            raise FailedPreconditionError("warm up an engine before it takes requests")
        budget, self.scheduler.prefill_budget = self.scheduler.prefill_budget, None
        try:  # the planned step shapes, not cut by a step-time target
            report = warm_up(self, plan, seed=self.config.seed)
        finally:
            self.scheduler.prefill_budget = budget
        if self.adapters is not None:  # the LoRA kernels' variants for the same step sizes
            launches = self.adapters.warm_up((*plan.prefill_token_counts, *plan.decode_batches))
            logger.info("LoRA kernels warmed: %d launches", launches)
        self.rates.reset()
        if str(self.runner.device).startswith("cuda"):
            compile_watch.arm()  # a kernel compiled from here on is a serving stall: say so
        return report

    def _step(self) -> StepOutput:
        started = time.perf_counter()
        deltas, self._aborted = self._aborted, []
        self._idle_for_adapters = False
        if self.adapters is not None:
            self._poll_adapters(deltas)
        launched, self._launched = self._launched, None
        if launched is not None and launched.all_finished:
            launched = None  # every sequence of it stopped or was aborted: nothing to read
            self._not_ahead = overlap.ENDED
        planned_ahead = launched is not None
        if launched is None:
            plan = self.scheduler.schedule()
            if plan.is_empty and self.scheduler.resumed_last:
                plan = self.scheduler.schedule()  # the resumed run from the next plan on
            if plan.is_empty and self.adapters is not None and self.adapters.wait_for_slot_writes():
                plan = self.scheduler.schedule()  # nothing else to run: the swaps have landed
            if plan.is_empty:
                self._idle_for_adapters = (
                    not deltas
                    and self.adapters is not None
                    and bool(self._requests)
                    and not self.scheduler.paused
                )
                self._not_ahead = overlap.IDLE
                return StepOutput(deltas, self.load(), time.perf_counter() - started, 0)
            if self._launch_greedy is not None:
                self.plain_step_reasons[self._not_ahead] += 1
            self._not_ahead = overlap.IDLE
            if self._launch_greedy is None or not self._plain_greedy(plan.scheduled):
                self._not_ahead = overlap.SAMPLING_RUNNING  # the next waits for this one too
                return self._run(plan, deltas, started)
            launched = self._launch(plan, deltas)
            if launched is None:
                self._not_ahead = overlap.LAUNCH_FAILED
                elapsed = time.perf_counter() - started
                return StepOutput(deltas, self.load(), elapsed, plan.batch.num_tokens)
        ahead = self._launch_ahead(launched, deltas)
        if not self._collect(launched, deltas):
            ahead = self._fail_step(ahead, deltas, "its previous step failed")
            self._not_ahead = overlap.STEP_FAILED
        if ahead is not None:
            if ahead.all_finished:
                self._not_ahead = overlap.ENDED
            else:
                self._launched = ahead
                self.num_overlapped_steps += 1
        # The launched step's own time (what the rates and the stats count), not this call's:
        # its launch may have been planned during the last call, and the next one's host work
        # was done in this one. From its launch, or from when the step before it was read if
        # that came later (run back to back), to now; the runner's device timing where given.
        done = time.perf_counter()
        device_time = getattr(launched.handle, "device_time_s", None)
        if device_time is not None:  # the device's own measure (CUDA events), when it has one
            elapsed = device_time()
        else:
            elapsed = done - max(launched.launched_at, self._last_collected)
        self._last_collected = done
        return StepOutput(
            deltas, self.load(), elapsed, launched.num_tokens, planned_ahead=planned_ahead
        )

    def _launch_ahead(
        self, launched: LaunchedStep, deltas: list[SequenceDelta]
    ) -> LaunchedStep | None:
        """Plan and launch the next step while `launched` runs, where that changes nothing
        (services/engine/overlap.py); None where it cannot or there is nothing to run (why not
        is kept for the next step's count)."""
        plain_greedy = self._plain_greedy_one
        if self._overlap_mixed:
            # A plan that only pauses and resumes (the resumed run from the next plan on) is
            # empty: plan once more, still ahead, so the resumed run at once.
            for _ in range(2):
                hold = hold_back_ahead(
                    launched,
                    self.scheduler,
                    self.block_manager,
                    max_model_len=self.info.max_model_len,
                    plain_greedy=plain_greedy,
                    queued_greedy=self._execute_greedy is not None and not self._maybe_sampling,
                )
                if isinstance(hold, str):
                    self._not_ahead = hold
                    return None
                plan = self.scheduler.schedule(hold=hold)
                if not plan.is_empty:
                    return self._launch_ahead_plan(plan, deltas)
                if not self.scheduler.resumed_last:
                    break
            self._not_ahead = overlap.EMPTY_PLAN
            return None
        if not can_schedule_ahead(
            launched,
            self.scheduler,
            self.block_manager,
            max_batch=self._overlap_max_batch,
            max_model_len=self.info.max_model_len,
            plain_greedy=plain_greedy,
        ):
            self._not_ahead = overlap.RUNNING_SET_MAY_CHANGE
            return None
        plan = self.scheduler.schedule(rotate=False)
        return self._launch_ahead_plan(plan, deltas, pure_decode=True)

    def _launch_ahead_plan(
        self, plan: SchedulerOutput, deltas: list[SequenceDelta], *, pure_decode: bool = False
    ) -> LaunchedStep | None:
        ahead = self._launch(plan, deltas, continuation=True, pure_decode=pure_decode)
        if ahead is None:
            self._not_ahead = overlap.LAUNCH_FAILED
        return ahead

    def _run(
        self, plan: SchedulerOutput, deltas: list[SequenceDelta], started: float
    ) -> StepOutput:
        """One step the plain way: run it, wait for its logits or ids, sample, stop checks."""
        num_tokens = plan.batch.num_tokens
        try:
            greedy = self._plain_greedy(plan.scheduled)
            if self.adapters is not None:
                self.adapters.begin_step(plan.batch)
            if greedy:
                token_tensor = self._execute_greedy(plan.batch)
            else:
                logits = self.runner.execute(plan.batch)
            to_sample = self._advance(plan.scheduled)
            if not to_sample:
                sampled = None
            elif greedy:
                tokens = token_tensor.tolist()
                sampled = SamplerOutput(token_ids=tokens, logprobs=[None] * len(tokens))
            else:
                sampled = self.sampler.sample(logits, to_sample)
        except Exception as exc:  # a failed step fails its requests, never the engine
            logger.exception("forward step failed")
            for seq, _ in plan.scheduled:
                deltas.append(self._fail(seq, f"the engine failed this request: {exc}"))
            return StepOutput(deltas, self.load(), time.perf_counter() - started, num_tokens)

        if sampled is not None:
            for seq, token, logprob in zip(
                to_sample, sampled.token_ids, sampled.logprobs, strict=True
            ):
                seq.append_token(token, logprob)
                reason = self._stop_reason(seq, token)
                if reason is not None:
                    self._retire(seq, reason)
                deltas.append(self._delta(seq, [token], logprob, reason))
        return StepOutput(deltas, self.load(), time.perf_counter() - started, num_tokens)

    def _advance(self, scheduled: list[tuple[Sequence, int]]) -> list[Sequence]:
        """Count the step's tokens as computed, register newly full blocks in the prefix cache;
        the sequences that sample this step (their last known token was computed)."""
        register = self.block_manager.register_computed_blocks
        block_size = self.block_manager.block_size
        to_sample: list[Sequence] = []
        for seq, count in scheduled:
            computed = seq.num_computed_tokens + count
            seq.num_computed_tokens = computed
            if computed // block_size > seq.num_hashed_blocks:  # a block became full
                register(seq)
            if computed == len(seq.token_ids):
                to_sample.append(seq)
        return to_sample

    def _plain_greedy_one(self, seq: Sequence) -> bool:
        """`_plain_greedy` of one sequence (asked of every running one each step a step is
        planned ahead, and of every waiting and paused one while a live request may sample:
        kept to one comparison)."""
        return self._execute_greedy is not None and len(seq.output_token_ids) >= seq.argmax_from

    def _plain_greedy(self, scheduled: Iterable[tuple[Sequence, int]]) -> bool:
        """Whether every scheduled sequence samples plain argmax (the sampler would do nothing
        else): temperature 0, no logprobs, no penalties, min_tokens reached. Then the runner's
        `execute_greedy` skips building the [rows, vocab] logits."""
        if self._execute_greedy is None:
            return False
        return all(len(seq.output_token_ids) >= seq.argmax_from for seq, _ in scheduled)

    def _stop_reason(self, seq: Sequence, token: int, pending: int = 0) -> FinishReason | None:
        """Why `seq` stops at `token` (its newest token, `pending` placeholders after it)."""
        params = seq.params
        num_outputs = len(seq.output_token_ids) - pending
        if num_outputs >= params.min_tokens:
            if token in self._eos and not params.ignore_eos:
                return FinishReason.STOP
            if params.stop_token_ids and token in params.stop_token_ids:
                return FinishReason.STOP
        if num_outputs >= params.max_tokens:
            return FinishReason.LENGTH
        if len(seq.token_ids) - pending >= self._max_model_len:
            return FinishReason.LENGTH
        return None

    def _poll_adapters(self, deltas: list[SequenceDelta]) -> None:
        """Land finished adapter loads; end the requests whose adapter failed to load."""
        failures = self.adapters.gate.poll()
        if not failures:
            return
        by_id = {seq.seq_id: seq for seq in self._requests.values()}
        for seq_id, error in failures:
            seq = by_id.get(seq_id)
            if seq is not None:
                deltas.append(self._fail(seq, error.message, error))

    def _retire(self, seq: Sequence, reason: FinishReason) -> None:
        """`seq` ends for `reason`: out of the request table and the scheduler, blocks freed."""
        self._requests.pop(seq.request_id, None)
        self._maybe_sampling.discard(seq.seq_id)
        self.scheduler.finish(seq)
        seq.finish_reason = reason

    def _fail(self, seq: Sequence, message: str, error: SluiceError | None = None) -> SequenceDelta:
        self._retire(seq, FinishReason.ERROR)
        delta = self._delta(seq, [], None, FinishReason.ERROR)
        delta.error = message
        if error is not None:
            delta.error_code = error.code
        return delta

    @staticmethod
    def _delta(
        seq: Sequence,
        tokens: list[int],
        logprob: TokenLogprob | None,
        reason: FinishReason | None,
    ) -> SequenceDelta:
        return SequenceDelta(
            request_id=seq.request_id,
            new_token_ids=tokens,
            logprobs=[logprob] if logprob is not None else None,
            finished=reason is not None,
            finish_reason=reason,
            num_prompt_tokens=len(seq.prompt_token_ids),
            num_output_tokens=len(seq.output_token_ids) - seq.num_pending_tokens,
            num_cached_prompt_tokens=seq.num_cached_prompt_tokens,
        )
