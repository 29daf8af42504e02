"""Protobuf <-> domain conversions of the engine worker (engine.proto, common.proto).

Kept apart from the servicer so it stays thin: SequenceDelta / EngineLoad / Rejection to
SequenceUpdate / EngineLoad messages (a delta is written into its step's SequenceUpdate in
place). Sampling parameters come off the wire through the codec the router also uses
(services/common/protocol/codec.py).
"""

from __future__ import annotations

from protos.sluice.v1 import common_pb2, engine_pb2
from services.engine.engine_loop import Rejection
from services.engine.outputs import EngineLoad, FinishReason, SequenceDelta

FINISH_REASONS_PB = {
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.STOP_STRING: common_pb2.FINISH_REASON_STOP_STRING,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
    FinishReason.ERROR: common_pb2.FINISH_REASON_ERROR,
}


def load_to_pb(load: EngineLoad) -> engine_pb2.EngineLoad:
    return engine_pb2.EngineLoad(
        free_blocks=load.free_blocks,
        total_blocks=load.total_blocks,
        running=load.running,
        waiting=load.waiting,
        resident_adapters=list(load.resident_adapters),
        loading_adapters=list(load.loading_adapters),
        lora_slots=load.lora_slots,
        lora_adapter_capacity=load.lora_adapter_capacity,
        queued_prompt_tokens=load.queued_prompt_tokens,
        prefill_tokens_per_s=load.prefill_tokens_per_s,
        decode_tokens_per_s=load.decode_tokens_per_s,
        finished_per_s=load.finished_per_s,
        finish_steps=list(load.finish_steps),
        finish_steps_of=load.finish_steps_of,
        stop_hazard=load.stop_hazard,
    )


def fill_update(update: engine_pb2.SequenceUpdate, request_id: str, delta: SequenceDelta) -> None:
    """Write `delta` into `update` in place (an `EngineStep.updates.add()`: no copy per step)."""
    update.request_id = request_id
    update.token_ids.extend(delta.new_token_ids)
    usage = update.usage
    usage.prompt_tokens = delta.num_prompt_tokens
    usage.completion_tokens = delta.num_output_tokens
    usage.cached_prompt_tokens = delta.num_cached_prompt_tokens
    if delta.logprobs:
        update.logprobs.extend(
            common_pb2.TokenLogprob(
                token_id=item.token_id,
                logprob=item.logprob,
                top=[common_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in item.top],
            )
            for item in delta.logprobs
        )
    if delta.finished or delta.finish_reason is not None:
        reason = delta.finish_reason or FinishReason.STOP
        update.finish_reason = FINISH_REASONS_PB[reason]
    if delta.error:
        update.error.code = delta.error_code
        update.error.message = delta.error


def rejection_to_pb(request_id: str, rejection: Rejection) -> engine_pb2.SequenceUpdate:
    return engine_pb2.SequenceUpdate(
        request_id=request_id,
        finish_reason=common_pb2.FINISH_REASON_ERROR,
        error=common_pb2.ItemError(code=rejection.code, message=rejection.message),
    )
