"""Dual-batch overlap in decode: a decode step's sequences run as two micro-batches, so that the accelerator's work of
one (attention, router, shared and hot experts) runs while the CPU computes the other's routed experts.

The decoder (`MoEDecoderModel.forward`) hands a step here when `DualBatch.applies` says so. Per layer, micro-batch m
runs: finish its previous MoE layer (shared experts, then wait for its routed experts) -> attention -> route and
submit its routed experts to the CPU (`MoEBlock.start`), first for micro-batch 0, then for 1. Written out for two
consecutive MoE layers l and l+1:

    accelerator: attn_l(0) route_l(0) | shared_l-1(1) attn_l(1) route_l(1) | shared_l(0) attn_l+1(0) route_l+1(0) | ...
    CPU experts:        ... experts_l-1(1) | experts_l(0)                  | experts_l(1)                         | ...

Every `submit` queues on the C++ kernels' executor, which runs the jobs in order, so while micro-batch 0 waits for
its experts of layer l, the CPU is already done with them or on micro-batch 1's experts of layer l-1, and while the
accelerator attends micro-batch 1 at layer l the CPU computes micro-batch 0's experts of layer l. A dense layer
(DeepSeek-V3's first) runs its MLP in line. Each micro-batch is a contiguous half of the step's sequences with its
own attention metadata (`split_metadata`: its slot mapping, block tables and lengths), so each sequence writes and
reads its own KV blocks as in the whole step; in float32 the greedy tokens do not change (in bfloat16 a micro-batch's
row count can pick another kernel path and round differently, as any other batch composition can).

When it pays: the planner's estimate (`placement/estimate.decode` with and without dual_batch, per batch size:
`predicted_tiers`; a plan file's `TierPlan.dual_batch`) compares the step split in two against the step whole;
splitting costs each side two launches per layer and reads an expert once per micro-batch that routes to it, so it
pays when the accelerator's and the CPU's parts of a layer are of similar length. On the CPU alone (no accelerator) there is nothing to overlap: every kernel call (attention's
projections and decode kernel too) queues on the same executor as the experts.

Legend: T tokens of the step, S sequences, H hidden, V vocabulary.
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch

from hybridmoe.layers.moe.block import MoEBlock, PendingMoE
from hybridmoe.layers.norm import rms_norm
from hybridmoe.layers.paged_attention import AttentionMetadata
from hybridmoe.models.decoder import MoEDecoderModel, _metadata_to
from hybridmoe.placement import estimate

MIN_SEQS = 2  # a step of fewer sequences runs whole
HOST = torch.device("cpu")

# AttentionMetadata's fields and how split_metadata splits each: by token (slot_mapping), by sequence, or shared
SPLIT_BY_TOKEN, SPLIT_BY_SEQUENCE, SHARED = ("slot_mapping",), ("block_tables", "query_lens", "seq_lens",
                                                                  "dropped"), ("block_size",)


def split_metadata(meta: AttentionMetadata, num_seqs: int) -> tuple[AttentionMetadata, AttentionMetadata, int]:
    """The attention metadata of the first `num_seqs` sequences and of the rest, and the first part's token count
    (its rows of the step's [T, ...] tensors)."""
    known = set(SPLIT_BY_TOKEN + SPLIT_BY_SEQUENCE + SHARED)
    unknown = [f.name for f in fields(meta) if f.name not in known]
    if unknown:  # a field this split does not know how to cut would be shared wrongly
        raise TypeError(f"split_metadata does not know how to split AttentionMetadata.{', '.join(unknown)}")
    if not 0 < num_seqs < meta.num_seqs:
        raise ValueError(f"split at sequence {num_seqs} of {meta.num_seqs}")
    tokens = sum(meta.query_lens[:num_seqs])
    parts = []
    for seqs, rows in ((slice(0, num_seqs), slice(0, tokens)), (slice(num_seqs, None), slice(tokens, None))):
        parts.append(replace(meta, slot_mapping=meta.slot_mapping[rows], block_tables=meta.block_tables[seqs],
                             query_lens=meta.query_lens[seqs], seq_lens=meta.seq_lens[seqs],
                             dropped=meta.dropped[seqs] if meta.dropped is not None else None))
    return parts[0], parts[1], tokens


@dataclass
class DualBatch:
    """When the decoder splits a decode step, and how many steps it split (`steps`).

    tiers: the plan's decode tiers as (batch, dual_batch); a step of S sequences follows the smallest tier of at
    least S sequences (the largest when none is). None: every decode step of at least MIN_SEQS sequences."""

    tiers: tuple[tuple[int, bool], ...] | None = None
    steps: int = 0

    def wanted(self, num_seqs: int) -> bool:
        if num_seqs < MIN_SEQS:
            return False
        if self.tiers is None:
            return True
        ordered = sorted(self.tiers)
        return next((dual for batch, dual in ordered if batch >= num_seqs), ordered[-1][1])

    def applies(self, model: MoEDecoderModel, meta: AttentionMetadata) -> bool:
        """A decode-only step (one new token per sequence) the tiers want split, of a model with a MoE layer and
        no attention or layer observer (those see sequence indices, and layers, of the whole step)."""
        return (all(n == 1 for n in meta.query_lens) and self.wanted(meta.num_seqs)
                and any(isinstance(layer.mlp, MoEBlock) for layer in model.layers)
                and not any(layer.attention.observers for layer in model.layers) and not model.layer_observers)

    @torch.inference_mode()
    def forward(self, model: MoEDecoderModel, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, kv_caches: list[torch.Tensor],
                logits_indices: torch.Tensor | None) -> torch.Tensor:
        """MoEDecoderModel.forward of one step as two micro-batches (see the module docstring): input_ids,
        positions [T] -> logits [len(logits_indices) or T, V] float32 on the host."""
        self.steps += 1
        placed, eps = model.device_placement, model.config.rms_norm_eps
        device = placed.accel.device if placed is not None else HOST
        first, second, tokens = split_metadata(meta, meta.num_seqs // 2)
        pos = (positions[:tokens], positions[tokens:])
        inputs = [{HOST: (pos[m], part)} for m, part in enumerate((first, second))]
        if placed is not None and any(placed.attention):
            for m, part in enumerate((first, second)):
                inputs[m][device] = (pos[m].to(device), _metadata_to(part, device))
        h_all = model.embed[input_ids]  # [T, H] on the host
        h = [h_all[:tokens], h_all[tokens:]]
        pending: list[PendingMoE | None] = [None, None]

        def section(on_device: bool):
            return placed.stats.accel_section() if on_device else nullcontext()

        for i, (layer, cache) in enumerate(zip(model.layers, kv_caches)):
            attention_on = placed is not None and placed.attention[i]
            mlp_on = placed is not None and placed.mlp[i]
            for m in (0, 1):
                if pending[m] is not None:  # its previous MoE layer: shared experts, then the CPU's result
                    h[m] = h[m] + pending[m].block.finish(pending[m].call)
                    pending[m] = None
                where = device if attention_on else HOST
                h[m] = h[m].to(where)
                with section(attention_on):
                    h[m] = h[m] + layer.attention.forward(rms_norm(h[m], layer.input_norm, eps), *inputs[m][where],
                                                          cache)
                h[m] = h[m].to(device if mlp_on else HOST)
                x = rms_norm(h[m], layer.post_attention_norm, eps)
                if isinstance(layer.mlp, MoEBlock):
                    pending[m] = _Pending(layer.mlp, layer.mlp.start(x))
                else:
                    with section(mlp_on):
                        h[m] = h[m] + layer.mlp.forward(x)
        for m in (0, 1):
            if pending[m] is not None:
                h[m] = h[m] + pending[m].block.finish(pending[m].call)
        head_on = placed is not None and placed.lm_head
        out = torch.cat([part.to(device if head_on else HOST) for part in h])  # [T, H]
        if logits_indices is not None:
            out = out[logits_indices.to(out.device)]
        with section(head_on):
            logits = model.lm_head(rms_norm(out, model.norm, eps)).float()
        return logits.to(HOST)


OVERLAP_CHOICES = ("auto", "on", "off")


EVERY_BATCH_UP_TO = 64  # predicted per batch size up to this many sequences, then at powers of two


def predicted_tiers(builder, context: int, max_num_seqs: int) -> tuple[tuple[int, bool], ...]:
    """(batch, whether two micro-batches are predicted faster) for the decode batches an engine of max_num_seqs
    runs: `placement.estimate.decode` with and without dual_batch, routed experts on the CPU (as hybrid decode runs
    them), over the plan's PassBuilder (`builder`) at its `context`."""
    sizes = list(range(MIN_SEQS, min(max_num_seqs, EVERY_BATCH_UP_TO) + 1))
    size = EVERY_BATCH_UP_TO * 2
    while size < max_num_seqs:
        sizes.append(size)
        size *= 2
    if max_num_seqs > EVERY_BATCH_UP_TO:
        sizes.append(max_num_seqs)
    return tuple((batch, estimate.decode(builder, batch, context, True, "cpu").step_s
                  < estimate.decode(builder, batch, context, False, "cpu").step_s) for batch in sizes)


def plan_tiers(placement=None, plan_file: str | Path | None = None,
               max_num_seqs: int = 1) -> tuple[tuple[int, bool], ...]:
    """(batch, dual_batch) where the plan predicts it: per decode batch size from the planner's estimate when the
    engine planned here (`placement.plan` and its `builder`: predicted_tiers), else the tiers of a plan file written
    by `hybridmoe plan --json` (its "tiers"); () when there is neither."""
    if placement is not None and placement.plan is not None and placement.builder is not None:
        return predicted_tiers(placement.builder, placement.plan.context, max_num_seqs)
    if plan_file is None:
        return ()
    try:
        tiers = json.loads(Path(plan_file).read_text()).get("tiers") or []
        return tuple((int(t["batch"]), bool(t["dual_batch"])) for t in tiers)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return ()  # the plan file was read and checked at load; a file without tiers predicts nothing


def choose(overlap: str, hybrid: bool, tiers: tuple[tuple[int, bool], ...]) -> tuple[DualBatch | None, str]:
    """The DualBatch for EngineConfig.overlap, and a line saying what was chosen and why.

    "on": every decode step of at least MIN_SEQS sequences; "off": none; "auto": under hybrid execution (`hybrid`,
    a placed model), the steps whose plan tier predicts a gain (`tiers` from plan_tiers); on the plain CPU engine
    none: there attention and the routed experts run on the same cores, through the same kernel executor, so a split
    only adds per-call costs (docs/hybrid.md, "Dual-batch overlap")."""
    if overlap not in OVERLAP_CHOICES:
        raise ValueError(f"overlap must be auto, on or off, got {overlap!r}")
    if overlap == "off":
        return None, "dual-batch overlap: off"
    if overlap == "on":
        return DualBatch(), f"dual-batch overlap: on (decode steps of at least {MIN_SEQS} sequences)"
    if not hybrid:
        return None, "dual-batch overlap: off (the plain CPU engine: no accelerator to overlap with)"
    wanted = sorted(batch for batch, dual in tiers if dual)
    if not wanted:
        return None, "dual-batch overlap: off (" + ("the plan predicts no gain at any decode batch" if tiers else
                                                   "the plan has no decode tiers") + ")"
    return DualBatch(tiers), f"dual-batch overlap: on where the plan predicts a gain (batches of {_ranges(wanted)})"


def _ranges(values: list[int]) -> str:
    """Sorted ints as runs: [2, 3, 4, 8] -> '2-4, 8' sequences."""
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) + " sequences"


@dataclass
class _Pending:
    block: MoEBlock
    call: PendingMoE
