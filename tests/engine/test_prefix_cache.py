"""Prefix caching end to end: greedy outputs equal caching off (float64, CPU) in every mode and on
both SSM backends, the hit counts a constructed workload implies, and published boundary states
equal to the state recomputed from scratch for their prefix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from replayserve import LLM, SamplingParams
from replayserve.cache.hashing import ROOT_HASH, hash_block
from replayserve.config import ConfigError
from replayserve.engine.engine import Engine
from tests.conftest import assert_pools_full

BS = 4  # tokens per block: small, so short prompts span several blocks
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
MODES = [("baseline", "align"), ("baseline", "all"), ("replay", "align"), ("replay", "all")]


def _llm(model_dir: Path, backend: str = "baseline", mode: str | None = None, **kw: object) -> LLM:
    kw = {"max_num_seqs": 4, "max_model_len": 128, "max_num_batched_tokens": 32, "num_mamba_cache_slots": 32,
          "mamba_block_size": BS, "replay_window": 5, **kw}
    return LLM(model=str(model_dir), dtype="float64", device="cpu", block_size=BS, ssm_backend=backend,
               enable_prefix_caching=mode is not None, mamba_cache_mode=mode or "none", **kw)  # type: ignore[arg-type]


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SYSTEM = _tokens(18, 1)  # 4.5 blocks: the shared prefix ends inside a block


def _speculative(spec: str | None, draft_dir: Path | None = None) -> dict[str, object]:
    """LLM keyword arguments for an identity test's speculation: none, n-gram or a draft model."""
    if spec == "ngram":
        return {"speculative": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}}
    if spec == "draft":
        return {"speculative": {"method": "draft", "num_speculative_tokens": 2, "model": str(draft_dir)}}
    return {}


def _workload(engine: Engine) -> list[tuple[list[int], list[int]]]:
    """Every case the issue lists, through the engine's own API; returns (prompt, output) pairs in
    request order.

    A long shared system prompt (several requests at once and later ones), a second turn that
    extends a finished conversation, hits arriving while the donor is still decoding."""
    requests = []

    def add(prompt: list[int], max_tokens: int = 12) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        requests.append(engine.add_request(prompt, params))

    def drain() -> None:
        while engine.has_unfinished():
            engine.step()

    add(SYSTEM + _tokens(3, 2), max_tokens=30)  # the donor decodes long
    for _ in range(3):
        engine.step()
    add(SYSTEM + _tokens(5, 3))  # hits while the donor decodes
    add(SYSTEM[:10] + _tokens(7, 4))  # a prefix ending inside a block
    drain()
    first = requests[1]
    add(first.prompt_token_ids + first.output_token_ids + _tokens(6, 5))  # the second turn
    add(SYSTEM + _tokens(2, 6))
    add(SYSTEM + _tokens(9, 7))
    drain()
    return [(r.prompt_token_ids, r.output_token_ids) for r in requests]


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> list[tuple[list[int], list[int]]]:
    llm = _llm(tiny_model_dir)
    return _workload(llm.engine)


@pytest.mark.parametrize("grid", [BS, 16], ids=["grid4", "grid16"])
@pytest.mark.parametrize(("backend", "mode"), MODES + [("replay", "none")])
def test_outputs_equal_caching_off_and_hit(tiny_model_dir: Path, reference: list, backend: str,
                                         mode: str, grid: int) -> None:
    # grid 16 is the tiny model's SSD chunk: prefill boundary states come out of one scan; grid 4
    # is off that grid, so a prefill chunk is split at each boundary.
    llm = _llm(tiny_model_dir, backend, mode, mamba_block_size=grid)
    assert _workload(llm.engine) == reference
    metrics = llm.get_metrics()
    assert metrics["prefix_cache_queries"] > 0
    if mode == "none":  # attention blocks match, but a hybrid hit needs a Mamba state
        assert metrics["prefix_cache_hits"] == 0 and metrics["prefix_cache_attention_hits"] > 0
    else:
        assert metrics["prefix_cache_hits"] > 0
        assert check_boundary_states(llm, tiny_model_dir) > 0
    assert_pools_full(llm)


@pytest.mark.parametrize(("backend", "mode"), MODES)
def test_small_pools_evict_and_preempt_without_changing_outputs(tiny_model_dir: Path, reference: list,
                                                               backend: str, mode: str) -> None:
    # 24 blocks of 4 hold ~2 requests: blocks are evicted, requests preempted; 2 boundary slots.
    llm = _llm(tiny_model_dir, backend, mode, num_kv_blocks=24, max_model_len=96, num_mamba_cache_slots=2)
    assert _workload(llm.engine) == reference
    assert llm.engine.scheduler.num_preemptions > 0
    check_boundary_states(llm, tiny_model_dir)
    assert_pools_full(llm)


@pytest.mark.parametrize(("backend", "mode"), MODES)
def test_constructed_workload_hits_the_expected_blocks(tiny_model_dir: Path, backend: str, mode: str) -> None:
    """N requests sharing a K-block prefix, one after another: (N - 1) * K blocks hit."""
    n, k = 4, 3
    llm = _llm(tiny_model_dir, backend, mode)
    for i in range(n):  # the suffix (1..4 tokens) keeps the last boundary at K blocks in align mode
        llm.generate([{"prompt_token_ids": SYSTEM[: k * BS] + _tokens(1 + i, 10 + i)}], GREEDY, use_tqdm=False)
    m = llm.get_metrics()
    assert m["prefix_cache_hits"] == (n - 1) * k * BS
    assert m["prefix_cache_queries"] == sum(k * BS + 1 + i for i in range(n))
    assert_pools_full(llm)


@pytest.mark.parametrize("backend", ["baseline", "replay"])
def test_align_keeps_the_last_grid_point_and_a_branch_point_without_stopping(tiny_model_dir: Path,
                                                                               backend: str) -> None:
    """On a grid of 8 tokens, every prompt below prefills in one step, and the states at its last
    grid point and at a branch point are kept all the same: later requests hit them."""
    llm = _llm(tiny_model_dir, backend, "align", mamba_block_size=8)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def run(prompt: list[int]) -> tuple[float, float]:
        llm.generate([{"prompt_token_ids": prompt}], one, use_tqdm=False)
        m = llm.get_metrics()
        return m["num_steps"], m["prefix_cache_hits"]

    assert run(SYSTEM[:12] + _tokens(2, 8)) == (1, 0)  # 14 tokens: the state at 8 is kept
    assert run(SYSTEM[:12] + _tokens(3, 9)) == (2, 8)
    head = _tokens(12, 20)
    assert run(head + _tokens(6, 21)) == (3, 8)  # no state at 8 for this head: only 16 is kept
    # KV matches 8 tokens but no state does: a branch point at 8, kept in passing.
    assert run(head[:10] + _tokens(10, 22)) == (4, 8)
    assert run(head[:10] + _tokens(11, 23)) == (5, 16)
    assert_pools_full(llm)


def test_every_block_is_hashed_once(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lookups while a request waits, its admission and its growth share one chain of hashes."""
    import replayserve.cache.hashing as hashing

    calls: list[int] = []
    digest = hashing._digest
    monkeypatch.setattr(hashing, "_digest", lambda *a: calls.append(1) or digest(*a))
    llm = _llm(tiny_model_dir, "baseline", "all", max_num_seqs=1)
    prompts = [{"prompt_token_ids": _tokens(22, 30 + i)} for i in range(3)]  # two wait behind the first
    llm.generate(prompts, GREEDY, use_tqdm=False)
    assert len(calls) == 3 * ((22 + GREEDY.max_tokens) // BS)  # 34 tokens each: 8 full blocks
    assert_pools_full(llm)


def test_a_request_never_hits_its_whole_prompt(tiny_model_dir: Path) -> None:
    llm = _llm(tiny_model_dir, "baseline", "all")
    prompt = {"prompt_token_ids": SYSTEM[:16]}  # exactly 4 blocks
    first = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    second = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert second.token_ids == first.token_ids
    assert llm.get_metrics()["prefix_cache_hits"] == 12  # 3 blocks: the last token is computed again


def test_cache_salt_separates_prefixes(tiny_model_dir: Path) -> None:
    llm = _llm(tiny_model_dir, "baseline", "all")
    prompt = {"prompt_token_ids": SYSTEM}
    llm.generate([prompt], GREEDY, use_tqdm=False, cache_salt="a")
    llm.generate([prompt], GREEDY, use_tqdm=False, cache_salt="b")
    assert llm.get_metrics()["prefix_cache_hits"] == 0
    llm.generate([prompt], GREEDY, use_tqdm=False, cache_salt="a")
    assert llm.get_metrics()["prefix_cache_hits"] == 16


@pytest.mark.parametrize(("option", "kw"), [
    ("mamba_cache_mode", {"mamba_cache_mode": "all"}),
    ("mamba_cache_mode", {"enable_prefix_caching": True, "mamba_cache_mode": "every"}),
    ("num_mamba_cache_slots", {"enable_prefix_caching": True, "mamba_cache_mode": "all", "num_mamba_cache_slots": 0}),
    ("mamba_block_size", {"enable_prefix_caching": True, "mamba_cache_mode": "all", "mamba_block_size": 6}),
])
def test_invalid_cache_options_fail_at_construction(tiny_model_dir: Path, option: str, kw: dict) -> None:
    with pytest.raises(ConfigError, match=option):
        LLM(model=str(tiny_model_dir), dtype="float64", device="cpu", block_size=BS, **kw)


# -- published states against a from-scratch recomputation -------------------------------------

def recompute_state(model_dir: Path, tokens: list[int], cache: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(conv, ssm) state of every Mamba layer after prefilling `tokens` from zeros, caching off."""
    key = tuple(tokens)
    if key not in cache:
        # One step prefills the whole prefix: no chunking.
        llm = cache.setdefault("llm", None) or _llm(model_dir, max_num_seqs=1, max_num_batched_tokens=256)
        cache["llm"] = llm
        engine = llm.engine
        request = engine.add_request(tokens, SamplingParams(temperature=0.0, max_tokens=1))
        plan = engine.scheduler.schedule()
        engine.runner.execute(plan, [request.params], [None])
        slot = plan.seqs[0].state_slot
        ssm = engine.runner.ssm
        cache[key] = [(ssm.conv_state[i][slot].clone(), ssm.ssm_state[i][slot].clone())
                      for i in range(ssm.layout.num_layers)]
        engine.scheduler.update(plan)
        request.output_token_ids.append(0)
        engine.abort(request)
    return cache[key]


def check_boundary_states(llm: LLM, model_dir: Path, cache: dict | None = None) -> int:
    """Every published boundary state equals the state recomputed for its prefix; the prefix is
    rebuilt from the chain of published KV block keys, which must hash to their ids' hashes."""
    cache = {} if cache is None else cache
    mgr, ssm = llm.engine.cache, llm.engine.runner.ssm
    if mgr.states is None:
        return 0
    ids = [(mgr.kv, b) for b in range(mgr.kv.size)]
    ids += [(mgr.states, s) for s in range(mgr.live.size, mgr.live.size + mgr.states.size)]
    keys = {pool.hash_of(i): pool.key_of(i) for pool, i in ids if pool.hash_of(i) is not None}
    for h, key in keys.items():  # hashes never map to the wrong tokens
        assert hash_block(key) == h
    checked = 0
    for slot in range(mgr.live.size, mgr.live.size + mgr.states.size):
        h = mgr.states.hash_of(slot)
        if h is None:
            continue
        tokens: list[int] = []
        while h in keys:  # walk the chain back to the root
            tokens = list(keys[h].tokens) + tokens
            h = keys[h].parent
        if h != ROOT_HASH:
            continue  # an ancestor was evicted from both pools: the prefix cannot be rebuilt here
        for layer, (conv, state) in enumerate(recompute_state(model_dir, tokens, cache)):
            torch.testing.assert_close(ssm.conv_state[layer][slot], conv, rtol=1e-9, atol=1e-12)
            torch.testing.assert_close(ssm.ssm_state[layer][slot], state, rtol=1e-9, atol=1e-12)
        checked += 1
    return checked


@pytest.mark.parametrize("backend", ["baseline", "replay"])
def test_a_step_that_raises_loses_nothing_and_serving_continues(tiny_model_dir: Path, reference: list,
                                                                 backend: str) -> None:
    """An exception in the middle of the forward (after the first Mamba layer wrote its state) of
    steps that planned hit copies and boundary writes: the step's requests are recomputed, its
    slots freed unpublished, and the outputs stay exact."""
    llm = _llm(tiny_model_dir, backend, "all")
    engine, failures = llm.engine, []
    last = engine.runner.model.backbone.layers[-1].mixer
    real_forward, real_schedule, real_step = last.forward, engine.scheduler.schedule, engine.step
    armed = {"on": False}

    def schedule(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - arm the failure for the first plans that copy and publish states
        plan = real_schedule(*args, **kwargs)
        armed["on"] = len(failures) < 3 and bool(plan.state_copies or any(s.boundary_writes for s in plan.seqs))
        return plan

    def failing_layer(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if armed["on"]:
            raise RuntimeError("injected failure")
        return real_forward(*args, **kwargs)

    def tolerant_step():  # noqa: ANN202 - the workload keeps stepping after a failed step
        try:
            return real_step()
        except RuntimeError:
            failures.append(1)
            engine.cache.check()
            return []

    engine.scheduler.schedule, last.forward, engine.step = schedule, failing_layer, tolerant_step
    assert _workload(engine) == reference
    assert len(failures) == 3
    check_boundary_states(llm, tiny_model_dir)
    assert_pools_full(llm)


def test_prefix_caching_alone_picks_align_for_a_hybrid_model(tiny_model_dir: Path, tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """Without a mamba_cache_mode, 'none' would never hit on a Mamba model: 'align' is chosen and
    logged, and a repeated prompt hits; a model without Mamba layers keeps 'none'."""
    import logging

    from replayserve.builtin.tiny import make_tiny

    with caplog.at_level(logging.INFO, logger="replayserve.config.options"):
        llm = LLM(model=str(tiny_model_dir), dtype="float64", device="cpu", block_size=BS,
                  enable_prefix_caching=True)
    assert llm.config.mamba_cache_mode == "align"
    assert any("mamba_cache_mode='align'" in r.getMessage() for r in caplog.records)
    prompt = {"prompt_token_ids": _tokens(100, 9)}
    first, second = (llm.generate(prompt, GREEDY, use_tqdm=False)[0] for _ in range(2))
    assert first.token_ids == second.token_ids and llm.get_metrics()["prefix_cache_hits"] > 0
    attention_only = make_tiny(tmp_path / "attn", layers="*-")
    assert LLM(model=str(attention_only), dtype="float64", device="cpu",
               enable_prefix_caching=True).config.mamba_cache_mode == "none"
    assert LLM(model=str(tiny_model_dir), dtype="float64", device="cpu").config.mamba_cache_mode == "none"
