"""bench_e2e's transformers rows: transformers' NemotronH on our model's weights (shared, not
copied), its decode steps timed inside `generate`."""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from e2e_common import free_memory, random_prompts, sync_fn

from replayserve.layers.mlp import MoE
from replayserve.models.nemotron_h import NemotronHForCausalLM


def hf_twin(model: NemotronHForCausalLM):  # noqa: ANN201 - transformers' NemotronHForCausalLM
    """transformers' NemotronH on our model's weights, sharing their memory (no copy)."""
    from transformers import NemotronHConfig
    from transformers import NemotronHForCausalLM as HFNemotronH

    with torch.device("meta"):
        hf = HFNemotronH(NemotronHConfig.from_dict(model.config.to_hf_dict()))
    # Our names are the checkpoint's (`backbone.*`); transformers' in-memory names use `model.*`.
    state = {("model." + k[len("backbone."):] if k.startswith("backbone.") else k): v
             for k, v in model.state_dict().items()}
    wanted = hf.state_dict().keys()
    for i, block in enumerate(model.backbone.layers):
        prefix = f"model.layers.{i}.mixer.experts"
        if isinstance(block.mixer, MoE) and f"{prefix}.up_proj" in wanted:
            # transformers stacks the routed experts in memory ((E, I, W) up, (E, W, I) down: our
            # stacks' layout), where the checkpoint has one tensor per expert.
            num = len(block.mixer.experts)
            w_up, w_down = block.mixer.stacked_experts()
            for e in range(num):
                del state[f"{prefix}.{e}.up_proj.weight"], state[f"{prefix}.{e}.down_proj.weight"]
            state[f"{prefix}.up_proj"], state[f"{prefix}.down_proj"] = w_up[:num], w_down[:num]
    hf.load_state_dict(state, strict=True, assign=True)
    return hf.eval()


def hf_rows(model: NemotronHForCausalLM, args: argparse.Namespace) -> list[dict]:
    """transformers' NemotronH sharing our weights: decode step times read inside `generate` by a
    logits processor (called once per generated token, after the device has finished the step)."""
    from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList
    from transformers import NemotronHForCausalLM as HFNemotronH

    device, sync = model.lm_head.weight.device, sync_fn(model.lm_head.weight.device)
    hf = hf_twin(model)
    hf.generation_config.eos_token_id = None  # never stop early (ignore_eos)

    class StepClock(LogitsProcessor):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            sync()
            self.times.append(time.perf_counter())
            return scores

    def generate(hf: HFNemotronH, batch: int, new_tokens: int) -> list[float]:
        clock = StepClock()
        ids = torch.tensor(random_prompts(batch, args.prompt_len, model.config.vocab_size, seed=args.seed + batch),
                           device=device)
        gen_cfg = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                   pad_token_id=model.config.pad_token_id, use_cache=True)
        with torch.inference_mode():
            hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gen_cfg,
                        logits_processor=LogitsProcessorList([clock]))
        return [b - a for a, b in zip(clock.times, clock.times[1:], strict=False)]

    rows = []
    try:
        generate(hf, 1, 2)  # warm-up
        for batch in args.hf_batch:
            row: dict = {"backend": "transformers", "batch": batch}
            try:
                steps = generate(hf, batch, args.warmup + args.steps + 1)[args.warmup:]
                row.update({"tok_s": batch / statistics.median(steps), "step_ms": 1e3 * statistics.median(steps)})
            except torch.OutOfMemoryError as e:
                row["skipped"] = "out of device memory (" + ". ".join(str(e).split(". ")[:2]) + ")"
            free_memory(device)
            rows.append(row)
            print(f"done transformers batch {batch}", file=sys.stderr, flush=True)
    finally:
        del hf
        free_memory(device)
    return rows
