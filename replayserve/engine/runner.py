"""Runs a StepPlan on the model: builds the StepContext, owns the KV cache and the SSM backend."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch

from replayserve.cache.memory import kv_cache_torch_dtype
from replayserve.config import EngineConfig, ModelConfig
from replayserve.engine.cuda_graph import DecodeGraphs
from replayserve.engine.prompt_logprobs import PromptScores, score_prompt
from replayserve.engine.sampler import PendingSample, SampleResult, collect_sample, launch_sample, sample
from replayserve.engine.scheduler import StepPlan
from replayserve.layers.granite_ffn import SoftmaxMoE
from replayserve.layers.mamba2 import Mamba2Mixer
from replayserve.layers.mlp import MoE
from replayserve.layers.qwen_moe import SparseMoeBlock
from replayserve.layers.step_context import StepContext
from replayserve.models.nemotron_h import NemotronHForCausalLM
from replayserve.ops.dispatch import use_triton
from replayserve.ops.token_bitmask import TokenMask
from replayserve.sampling_params import SamplingParams
from replayserve.ssm.baseline import BaselineBackend
from replayserve.ssm.gated_delta_baseline import GatedDeltaBaselineBackend
from replayserve.ssm.gated_delta_replay import GatedDeltaReplayBackend
from replayserve.ssm.layout import GatedDeltaLayout, MambaLayout
from replayserve.ssm.replay import ReplayBackend
from replayserve.ssm.slot_state import SlotStateBackend
from replayserve.transfer import to_device

if TYPE_CHECKING:
    from replayserve.speculative.mtp import HiddenStore
    from replayserve.speculative.proposers import Proposer

logger = logging.getLogger(__name__)


def make_ssm_backend(config: EngineConfig, dtype: torch.dtype, device: torch.device,
                     model: ModelConfig | None = None) -> SlotStateBackend:
    """Slots 0..max_num_seqs-1 are live; the prefix cache's boundary slots follow them, and the
    last slot is the pad slot of padded decode rows (no pool hands it out). model: the shapes to
    hold, when not config.model's (a tensor-parallel rank's slice)."""
    model = model or config.model
    num_slots = config.max_num_seqs + config.resolved_num_mamba_cache_slots + 1
    tokens = config.tokens_per_step
    if model.num_gated_delta_layers:
        if config.ssm_backend == "replay":
            return GatedDeltaReplayBackend(GatedDeltaLayout.from_config(
                model, num_slots, dtype, tokens, window=config.resolved_replay_window), device)
        return GatedDeltaBaselineBackend(GatedDeltaLayout.from_config(
            model, num_slots, dtype, tokens, max_rows=config.max_num_seqs), device)
    if config.ssm_backend == "replay":
        layout = MambaLayout.from_config(model, num_slots, dtype, window=config.resolved_replay_window,
                                         tokens_per_step=tokens)
        return ReplayBackend(layout, device)
    return BaselineBackend(MambaLayout.from_config(model, num_slots, dtype, tokens_per_step=tokens), device)


class StepOutput(NamedTuple):
    """What a step computed: one SampleResult per sampling sequence (in plan order), and the
    prompt log-probabilities of the sequences with prompt_targets, by request id."""

    samples: list[SampleResult]
    prompt_scores: dict[str, PromptScores]


def graphs_off_reason(model: torch.nn.Module, weight: torch.Tensor) -> str | None:
    """Why `model`'s decode steps, on weights like `weight` (dtype, device), cannot be captured as CUDA
    graphs; None when they can. The MoE layers' Triton path is sync-free: every MoE layer of a loaded
    model runs its experts from stacks, FP8 ones included (the Qwen MoEs' gate and up requantized to
    one scale per expert). The reference expert loop of the other dtypes asks the host which experts
    are in use."""
    moes = [m for m in model.modules() if isinstance(m, MoE | SoftmaxMoE | SparseMoeBlock)]
    if moes and not use_triton(weight):
        return (f"MoE layers in {weight.dtype} run the reference expert loop, which syncs on the host; use "
                "float32, bfloat16 or float16")
    return None


class Runner:
    def __init__(self, config: EngineConfig, model: NemotronHForCausalLM,
                 hidden_store: HiddenStore | None = None) -> None:
        """hidden_store: where the final hidden states of computed positions are recorded for the
        MTP proposer, which reads them (the composition root hands both the same store)."""
        self.config = config
        self.model = model
        weight = model.backbone.embeddings.weight
        self.device, self.dtype = weight.device, weight.dtype
        m = model.config  # the shapes this process holds: a tensor-parallel rank's slice of config.model
        # One block more than the pool hands out: the pad block of padded decode rows.
        self.pad_block = config.resolved_num_kv_blocks
        kv_dtype = kv_cache_torch_dtype(config, self.dtype)
        kv_shape = (config.resolved_num_kv_blocks + 1, config.block_size, m.num_key_value_heads, m.head_dim)
        self.kv_caches = [
            (torch.zeros(kv_shape, dtype=kv_dtype, device=self.device),
             torch.zeros(kv_shape, dtype=kv_dtype, device=self.device))
            for _ in range(m.num_attention_layers)
        ]
        self.ssm = make_ssm_backend(config, self.dtype, self.device, m)
        self.hidden_store = hidden_store
        self._mixers = sorted((m for m in model.modules() if isinstance(m, Mamba2Mixer)), key=lambda m: m.mamba_index)
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and not config.enforce_eager:
            reason = graphs_off_reason(model, weight)
            if reason is not None:
                logger.info("CUDA graphs are off: %s", reason)
            else:
                self.graphs = self.make_decode_graphs(capture=True)
        if config.async_scheduling and self.graphs is None:
            # Async steps need the fixed-shape decode path (no host sync inside the forward);
            # without graphs (CPU, enforce_eager) it runs eagerly.
            self.graphs = self.make_decode_graphs(capture=False)

    def make_decode_graphs(self, capture: bool) -> DecodeGraphs:
        """The padded fixed-shape decode path: replayed as CUDA graphs (capture) or run eagerly."""
        c = self.config
        return DecodeGraphs(self._forward, c.max_num_seqs, c.tokens_per_step, c.blocks_per_seq, c.block_size,
                            self.pad_block, self.ssm.layout.num_slots - 1, self.device,
                            keep=lambda: self.ssm.verify_windows, restore=self._restore_windows, capture=capture)

    @torch.inference_mode()
    def prepare_for_serving(self) -> tuple[tuple[int, int], ...]:
        """What a few dummy steps cannot reach, before serving: each distinct MoE layer (Nemotron-H's,
        Granite 4.0-H's, the Qwen MoEs') run on zeros at every token count a step can have, outputs
        dropped, so that on CUDA each count's launches compile their kernel variants now; then the
        decode graph of every (batch size, width) a step can take (`DecodeGraphs.prepare_all`).
        Returns those shapes (none without the fixed-shape decode path).

        No short list of counts would do: the routing's tiles follow the count's power of two, the
        alignment's the pairs' (top_k, plus Nemotron-H's folded shared expert up to
        FOLD_SHARED_MAX_TOKENS tokens), the GEMM tiles the pairs per expert."""
        max_tokens = self.config.max_num_batched_tokens
        x = torch.zeros(max_tokens, self.model.config.hidden_size, dtype=self.dtype, device=self.device)
        swept: set[tuple] = set()
        for moe in (m for m in self.model.modules() if isinstance(m, MoE | SoftmaxMoE | SparseMoeBlock)):
            shapes = tuple((p.shape, p.dtype) for p in moe.parameters())
            if shapes not in swept:  # layers of one shape launch the same kernel variants
                swept.add(shapes)
                for n in range(1, max_tokens + 1):
                    # `forward`, not a call: under tensor parallelism a hook all-reduces the layer's
                    # output, and this runs on each rank alone.
                    moe.forward(x[:n])
        return self.graphs.prepare_all() if self.graphs is not None else ()

    def _restore_windows(self, windows: dict[int, torch.Tensor]) -> None:
        self.ssm.verify_windows = windows

    def _forward(self, input_ids: torch.Tensor, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        """The graphed part of a decode step: the SSM backend's begin_step, hidden states and
        logits of every row, and for plain decode (each row keeps its one token) the end_step.
        Captured with them, ReplaySSM's cursor kernels cost no launch and no gap between graphs."""
        assert ctx.row_slots is not None and ctx.decode_num_tokens is not None
        self.ssm.begin_step(ctx.row_slots, ctx.decode_num_tokens)
        hidden = self.model(input_ids, ctx, self.kv_caches, self.ssm)
        logits = self.model.compute_logits(hidden)
        if ctx.uniform_decode == 1:
            self.ssm.end_step(ctx.row_slots, ctx.decode_num_tokens)
        return hidden, logits

    def build_context(self, plan: StepPlan) -> tuple[torch.Tensor, StepContext]:
        bs = self.config.block_size
        ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        starts = [0]
        for seq in plan.seqs:
            pos = range(seq.start_pos, seq.start_pos + len(seq.token_ids))
            ids.extend(seq.token_ids)
            positions.extend(pos)
            slot_mapping.extend(seq.block_table[p // bs] * bs + p % bs for p in pos)
            starts.append(starts[-1] + len(seq.token_ids))
        width = max(len(s.block_table) for s in plan.seqs)
        tables = [list(s.block_table) + [-1] * (width - len(s.block_table)) for s in plan.seqs]

        dev = self._ids

        ctx = StepContext(
            positions=dev(positions),
            slot_mapping=dev(slot_mapping),
            query_start_loc=dev(starts),
            seq_lens=dev([s.start_pos + len(s.token_ids) for s in plan.seqs]),
            block_tables=dev(tables),
            state_slots=dev([s.state_slot for s in plan.seqs]),
            num_decodes=sum(s.is_decode for s in plan.seqs),
            query_lens=tuple(len(s.token_ids) for s in plan.seqs),
            state_slot_list=tuple(s.state_slot for s in plan.seqs),
            prefill_captures=tuple(tuple((w.position - s.start_pos, w.slot) for w in s.boundary_writes)
                                   for s in plan.seqs if not s.is_decode),
            prefill_starts=tuple(s.start_pos for s in plan.seqs if not s.is_decode),
        )
        if self._mixers and ctx.num_decodes < len(plan.seqs) and use_triton(self.model.backbone.embeddings.weight):
            # The packed prefill kernels' metadata, once for every Mamba layer (CUDA; elsewhere the
            # layers run each sequence by itself). Imported here: the module imports Triton.
            from replayserve.ssm.packed_prefill import build_prefill_plan

            ctx = dataclasses.replace(ctx, prefill_plan=build_prefill_plan(
                ctx.prefill_segments(), self.model.config.chunk_size, self.device))
        return dev(ids), ctx

    @torch.inference_mode()
    def execute(
        self, plan: StepPlan, params: list[SamplingParams], generators: list[torch.Generator | None],
        histories: list[tuple[list[int], list[int]]] | None = None,
        grammar_masks: Callable[[], TokenMask | None] | None = None,
    ) -> StepOutput:
        """Runs the step; returns one result per sampling sequence and the prompt scores asked for.

        params, generators and (when some row uses penalties or min_tokens) histories, the
        (prompt, output) tokens so far, are given for the sequences with `sample` set, in plan order.
        grammar_masks: fills the constrained rows' token masks on the host (None: no row is
        constrained now); called once the forward is queued, so it runs while the device computes.
        """
        if plan.reset_slots:
            self.ssm.reset_slots(self._ids(plan.reset_slots))
        if plan.state_copies:
            src, dst = zip(*plan.state_copies, strict=True)
            self.ssm.copy_slots(self._ids(src), self._ids(dst))
        width = self.graphs.width(plan) if self.graphs is not None else None
        if width is not None:
            hidden, logits, decode_slots = self._forward_graphed(plan, width)
        else:
            input_ids, ctx = self.build_context(plan)
            decode_slots = ctx.state_slots[: ctx.num_decodes]
            if ctx.num_decodes:
                self.ssm.begin_step(decode_slots, self._ids(ctx.decode_lens, torch.int32))
            hidden = self.model(input_ids, ctx, self.kv_caches, self.ssm)
            logits = None
        scores = self._score_prompts(plan, hidden) if width is None else {}  # graphed steps only decode
        grammar = grammar_masks() if grammar_masks is not None else None
        results: list[SampleResult] = []
        if width == 1:  # a graphed plain decode step: row i samples at its one token, logits row i
            results = self._draw(logits, params, generators, None, histories, grammar)
            picks: list[range] = []
        else:  # logits at each sampling row's last token, and at every token of a verify row
            picks = self._picks(plan)
        if picks:
            rows = [i for r in picks for i in r]
            if logits is None:
                logits = self.model.compute_logits(hidden[self._ids(rows)])
            else:  # graphed logits cover every token
                logits = logits[: len(rows)] if rows == list(range(len(rows))) else logits[self._ids(rows)]
            results = self._sample(plan, picks, logits, params, generators, histories, grammar)
        if self.hidden_store is not None:
            self._record_hidden(plan, hidden, results)
        if decode_slots.numel():
            # After sampling, once for all Mamba layers: the tokens each decode row keeps (a
            # graphed plain decode step committed its one token in the graph).
            kept = [len(r.tokens) for r in results[: decode_slots.numel()]]
            if width != 1:
                self.ssm.end_step(decode_slots, self._ids(kept, torch.int32))
            self._publish_decode_boundaries(plan, kept)
        return StepOutput(results, scores)

    @torch.inference_mode()
    def launch_decode(self, plan: StepPlan, params: list[SamplingParams], generators: list[torch.Generator | None],
                      fed: torch.Tensor | None = None,
                      grammar_masks: Callable[[], TokenMask | None] | None = None) -> PendingSample:
        """Queues a plain decode step (`Scheduler.overlappable`: one token per row, nothing to
        publish) on the fixed-shape decode path, its sampling and the transfer of its tokens,
        without waiting for the device; `collect` reads the results. The SSM backend's
        begin_step and end_step run inside the forward. fed: the previous step's sampled tokens
        (R,) int64 on the device when the plan has `fed_rows`. params and generators: per row.
        grammar_masks: as `execute`'s, called once the forward is queued."""
        return self.launch_decode_sample(self.launch_decode_forward(plan, fed), params, generators, grammar_masks)

    @torch.inference_mode()
    def launch_decode_forward(self, plan: StepPlan, fed: torch.Tensor | None = None) -> torch.Tensor:
        """The forward of `launch_decode` alone: the rows' logits (R, V), on the device, valid until
        the next decode forward is queued (they are the graph's output buffer)."""
        assert self.graphs is not None, "launch_decode needs the fixed-shape decode path (async_scheduling)"
        assert not (plan.reset_slots or plan.state_copies)
        bucket = self.graphs.load(plan, 1, fed)
        _, logits = self.graphs.run(bucket, 1)
        return logits[: len(plan.seqs)]

    @torch.inference_mode()
    def launch_decode_sample(self, logits: torch.Tensor, params: list[SamplingParams],
                             generators: list[torch.Generator | None],
                             grammar_masks: Callable[[], TokenMask | None] | None = None) -> PendingSample:
        """The sampling of `launch_decode` on `launch_decode_forward`'s logits, masked as `grammar_masks`
        fills them (called first, under inference mode like the rest of the step)."""
        grammar = grammar_masks() if grammar_masks is not None else None
        return launch_sample(logits, params, generators, eos_token_ids=self.config.model.eos_token_ids, grammar=grammar)

    @staticmethod
    def collect(pending: PendingSample) -> list[SampleResult]:
        """Waits for a launched step's tokens (its one host sync): one SampleResult per row."""
        return collect_sample(pending)

    def _score_prompts(self, plan: StepPlan, hidden: torch.Tensor) -> dict[str, PromptScores]:
        """Prompt log-probabilities of the chunks that carry prompt_targets (prefill chunks: a
        graphed decode step has none), from the leading positions' hidden states (T, D)."""
        scores: dict[str, PromptScores] = {}
        offset = 0
        for seq in plan.seqs:
            if seq.prompt_targets:
                rows = hidden[offset : offset + len(seq.prompt_targets)]
                scores[seq.request_id] = score_prompt(rows, seq.prompt_targets, seq.prompt_top_k,
                                                      self.model.compute_logits)
            offset += len(seq.token_ids)
        return scores

    @staticmethod
    def _picks(plan: StepPlan) -> list[range]:
        """Token positions whose logits each sampling row samples from, in plan order."""
        picks: list[range] = []
        end = 0
        for seq in plan.seqs:
            end += len(seq.token_ids)
            if seq.sample:
                picks.append(range(end - 1 - seq.num_drafts, end))
        return picks

    def _forward_graphed(self, plan: StepPlan, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A decode-only step through the CUDA graph of its bucket and width: hidden states
        (T, D) and logits (T, V) of the plan's tokens laid end to end (padding dropped), as the
        eager forward would give them, and the rows' state slots."""
        assert self.graphs is not None
        rows = len(plan.seqs)
        bucket = self.graphs.load(plan, width)
        slots = self.graphs.state_slots[:rows]
        hidden, logits = self.graphs.run(bucket, width)
        if width == 1:
            return hidden[:rows], logits[:rows], slots
        real = self._ids([i * width + j for i, s in enumerate(plan.seqs) for j in range(len(s.token_ids))])
        return hidden[real], logits[real], slots

    def _sample(self, plan: StepPlan, picks: list[range], logits: torch.Tensor, params: list[SamplingParams],
                generators: list[torch.Generator | None], histories: list[tuple[list[int], list[int]]] | None,
                grammar: TokenMask | None) -> list[SampleResult]:
        """All sampling rows as one batch on the device, one transfer to the host. A row's logits are
        at its last len(pick) tokens; the ones after the first are its drafts (a verify row)."""
        sampling = [s for s in plan.seqs if s.sample]
        drafts = [s.token_ids[len(s.token_ids) - len(r) + 1 :] for s, r in zip(sampling, picks, strict=True)]
        return self._draw(logits, params, generators, drafts, histories, grammar)

    def _draw(self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
              drafts: list[tuple[int, ...]] | None, histories: list[tuple[list[int], list[int]]] | None,
              grammar: TokenMask | None = None) -> list[SampleResult]:
        """The step's sampling (`sampler.sample`); tensor-parallel workers take rank 0's instead."""
        return sample(logits, params, generators, drafts, histories, self.config.model.eos_token_ids, grammar)

    def forget(self, request_id: str) -> None:
        """Drops what the runner keeps for a finished request (the MTP proposer's hidden states)."""
        if self.hidden_store is not None:
            self.hidden_store.forget(request_id)

    def mirror(self, proposer: Proposer) -> Proposer:
        """A proposer that runs this runner's model; tensor parallelism runs it on every rank."""
        return proposer

    def _record_hidden(self, plan: StepPlan, hidden: torch.Tensor, results: list[SampleResult]) -> None:
        """Final hidden states of the positions this step computed for good (a verify row: the
        tokens it kept), for the MTP proposer."""
        assert self.hidden_store is not None
        kept = iter(len(r.tokens) for r in results)  # one per sampling row, in plan order
        offset = 0
        for seq in plan.seqs:
            n = len(seq.token_ids)
            emitted = next(kept) if seq.sample else 0
            valid = emitted if seq.num_drafts else n  # a verify keeps only its accepted tokens
            self.hidden_store.record(seq.request_id, seq.start_pos, hidden[offset : offset + valid])
            offset += n

    def _ids(self, values: tuple[int, ...] | list[int] | list[list[int]],
             dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """A host list on the device, without stalling the stream."""
        return to_device(torch.tensor(values, dtype=dtype), self.device)

    def _publish_decode_boundaries(self, plan: StepPlan, kept: list[int]) -> None:
        """Canonical states of decode rows that reached a block boundary, into their boundary slots
        (prefill rows captured theirs in the forward); `kept` are the rows' committed token counts."""
        rows = [(i, s.state_slot, w.slot, s.start_pos + kept[i] - w.position)
                for i, s in enumerate(plan.seqs) if s.is_decode for w in s.boundary_writes
                if w.position <= s.start_pos + kept[i]]
        if rows:
            index, src, dst, lag = zip(*rows, strict=True)
            self.ssm.publish(self._ids(index), self._ids(src), self._ids(dst), self._ids(lag, torch.int32),
                             self.mamba_A())

    def mamba_A(self) -> list[torch.Tensor]:
        """A (H,) of every Mamba layer, in layer order."""
        return [m.params().A for m in self._mixers]
