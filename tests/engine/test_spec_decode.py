"""Speculative decoding end to end (float64, CPU): greedy output with spec on equals spec off for
both SSM backends, every cache mode and k in {1, 3, 5}, with chunked prefill, preemption and
prefix hits in play; accepted counts follow the test proposer's corruption pattern; memory."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from replayserve import LLM, SamplingParams
from replayserve.builtin.tiny import make_tiny
from replayserve.config import ConfigError
from replayserve.speculative.proposers import DraftRequest, OracleProposer
from tests.conftest import assert_pools_full
from tests.engine.test_prefix_cache import _llm, _workload, check_boundary_states

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (9, 30, 5, 17)]


@pytest.fixture(scope="module")
def greedy_paths(tiny_model_dir: Path) -> dict[tuple[int, ...], list[int]]:
    """Each prompt's greedy continuation with spec off: the oracle's knowledge and the reference."""
    llm = LLM(model=str(tiny_model_dir), dtype="float64", device="cpu", max_num_seqs=4)
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], GREEDY, use_tqdm=False)
    return {tuple(p): o.token_ids for p, o in zip(_prompts(), outs, strict=True)}


def _spec(proposer: object, k: int) -> dict:
    return {"method": "custom", "num_speculative_tokens": k, "proposer": proposer}


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("backend", ["baseline", "replay"])
def test_greedy_spec_equals_spec_off_with_chunking_and_preemption(tiny_model_dir: Path, greedy_paths: dict,
                                                                   backend: str, k: int) -> None:
    # A 10-token budget chunks prefills and squeezes drafts; 24 blocks of 4 force preemptions.
    proposer = OracleProposer(greedy_paths, corrupt_prob=0.4, vocab_size=512, seed=k)
    llm = LLM(model=str(tiny_model_dir), dtype="float64", device="cpu", max_num_seqs=4, block_size=4, num_kv_blocks=24,
              max_model_len=72, max_num_batched_tokens=10, ssm_backend=backend, replay_window=8,
              speculative=_spec(proposer, k))
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == list(greedy_paths.values())
    m = llm.get_metrics()
    assert m["num_preemptions"] > 0 and 0 < m["spec_num_accepted_tokens"] < m["spec_num_draft_tokens"]
    assert_pools_full(llm)


class _StepOracle(OracleProposer):
    """The oracle, noting the rows of each `propose_batch` call."""

    def __init__(self, continuations: dict, corrupt_prob: float, vocab_size: int, seed: int) -> None:
        super().__init__(continuations, corrupt_prob, vocab_size, seed)
        self.calls: list[list[DraftRequest]] = []

    def propose_batch(self, requests: Sequence[DraftRequest]) -> dict[str, tuple[int, ...]]:
        self.calls.append(list(requests))
        return super().propose_batch(requests)


def test_the_engine_asks_for_all_rows_drafts_in_one_call_a_step(tiny_model_dir: Path, greedy_paths: dict) -> None:
    proposer = _StepOracle(greedy_paths, corrupt_prob=0.3, vocab_size=512, seed=2)
    llm = LLM(model=str(tiny_model_dir), dtype="float64", device="cpu", max_num_seqs=4,
              speculative=_spec(proposer, 3))
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == list(greedy_paths.values())
    assert 0 < len(proposer.calls) <= llm.get_metrics()["num_steps"]
    assert max(len(call) for call in proposer.calls) == 4  # every decoding row in the same call
    assert all(1 <= r.room <= 3 and len({q.request_id for q in call}) == len(call)
               for call in proposer.calls for r in call)


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize(("backend", "mode"), [("baseline", "align"), ("baseline", "all"), ("replay", "none"),
                                               ("replay", "align"), ("replay", "all")])
def test_spec_with_prefix_hits_matches_and_publishes_exact_states(tiny_model_dir: Path, backend: str, mode: str,
                                                                  k: int) -> None:
    """The prefix-cache workload (shared prompts, second turns, hits while decoding) with drafts
    from its own greedy paths, a third corrupted: verifies cross block boundaries, which are
    published from accepted tokens only."""
    reference = _workload(_llm(tiny_model_dir).engine)
    proposer = OracleProposer({tuple(p): o for p, o in reference}, corrupt_prob=0.3, vocab_size=512, seed=k)
    llm = _llm(tiny_model_dir, backend, mode, replay_window=8, speculative=_spec(proposer, k))
    assert _workload(llm.engine) == reference
    m = llm.get_metrics()
    assert m["spec_num_draft_tokens"] > 0
    if mode != "none":
        assert m["prefix_cache_hits"] > 0 and check_boundary_states(llm, tiny_model_dir) > 0
    assert_pools_full(llm)


@pytest.mark.parametrize("prob", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("backend", ["baseline", "replay"])
def test_accepted_counts_follow_the_corruption_pattern(tiny_model_dir: Path, greedy_paths: dict, backend: str,
                                                       prob: float) -> None:
    k = 3
    proposer = OracleProposer(greedy_paths, corrupt_prob=prob, vocab_size=512, seed=7)
    llm = LLM(model=str(tiny_model_dir), dtype="float64", device="cpu", max_num_seqs=4, ssm_backend=backend,
              speculative=_spec(proposer, k))
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == list(greedy_paths.values())
    drafted = accepted = 0
    per_position = [0] * k
    for prompt in _prompts():  # replay the proposer's decisions along the greedy path
        pos = 1  # the prefill samples output 0; each verify starts after the last known token
        while pos < GREEDY.max_tokens:
            room = min(k, GREEDY.max_tokens - pos - 1)
            if room <= 0:
                pos += 1
                continue
            n = next((i for i in range(room) if proposer.is_corrupted(prompt, pos + i)), room)
            drafted, accepted = drafted + room, accepted + n
            for i in range(n):
                per_position[i] += 1
            pos += n + 1
    m = llm.get_metrics()
    assert (m["spec_num_draft_tokens"], m["spec_num_accepted_tokens"]) == (drafted, accepted)
    assert m["spec_accepted_per_position"] == per_position
    assert m["spec_acceptance_rate"] == (accepted / drafted if drafted else 0.0)


def test_sampling_with_spec_is_seeded_and_runs(tiny_model_dir: Path, greedy_paths: dict) -> None:
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=30, seed=11, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = LLM(model=str(tiny_model_dir), dtype="float64", device="cpu", max_num_seqs=4, ssm_backend="replay",
                  speculative=_spec(OracleProposer(greedy_paths, 0.2, 512), 3))
        runs.append([o.token_ids for o in llm.generate([{"prompt_token_ids": p} for p in _prompts()], params,
                                                        use_tqdm=False)])
        assert_pools_full(llm)
    assert runs[0] == runs[1] and all(len(t) == 30 for t in runs[0])


def test_replay_memory_does_not_grow_with_k_and_baseline_does(tiny_model_dir: Path) -> None:
    def state_bytes(backend: str, k: int | None) -> tuple[int, int]:
        spec = None if k is None else {"method": "ngram", "num_speculative_tokens": k}
        llm = LLM(model=str(tiny_model_dir), dtype="float32", max_num_seqs=4, ssm_backend=backend, replay_window=16,
                  speculative=spec)
        ssm = llm.engine.runner.ssm
        one_state = sum(t[0].numel() * t.element_size() for t in ssm.ssm_state)  # one slot, all layers
        return ssm.memory_bytes(), one_state

    slots = 4
    replay_1, state = state_bytes("replay", 1)
    replay_5, _ = state_bytes("replay", 5)
    # Only the rings lengthen (R = W + T): 4 more entries per slot, a small fraction of one state.
    assert replay_5 - replay_1 < 0.5 * state * slots
    base_0, _ = state_bytes("baseline", None)
    base_5, _ = state_bytes("baseline", 5)
    assert base_5 - base_0 >= 5 * state * slots  # native: one state per verified position


@pytest.mark.parametrize(("spec", "option"), [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"method": "draft", "num_speculative_tokens": 2}, "model"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "unknown keys"),
    ({"method": "custom", "num_speculative_tokens": 2}, "proposer"),
    ({"method": "mtp", "num_speculative_tokens": 2, "mtp_window": 0}, "mtp_window"),
])
def test_invalid_speculative_options_fail_at_construction(tiny_model_dir: Path, spec: dict, option: str) -> None:
    with pytest.raises(ConfigError, match=option):
        LLM(model=str(tiny_model_dir), dtype="float64", device="cpu", speculative=spec)


def test_replay_window_below_tokens_per_step_is_rejected(tiny_model_dir: Path) -> None:
    with pytest.raises(ConfigError, match="replay_window"):
        LLM(model=str(tiny_model_dir), dtype="float64", device="cpu", ssm_backend="replay", replay_window=3,
            speculative={"method": "ngram", "num_speculative_tokens": 3})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="runs the Triton kernels; exercised on the H200")
@pytest.mark.parametrize("backend", ["baseline", "replay"])
def test_spec_on_cuda_matches_spec_off(tiny_model_dir: Path, backend: str) -> None:
    """The Triton verify step (T = 4 rows, mixed lengths) and commit on CUDA (float32)."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=0)
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    off = LLM(model=str(tiny_model_dir), dtype="float32", device="cuda", max_num_seqs=4, ssm_backend=backend)
    want = off.generate(prompts, params, use_tqdm=False)
    proposer = OracleProposer({tuple(p["prompt_token_ids"]): o.token_ids for p, o in zip(prompts, want, strict=True)},
                              corrupt_prob=0.3, vocab_size=512, seed=2)
    llm = LLM(model=str(tiny_model_dir), dtype="float32", device="cuda", max_num_seqs=4, ssm_backend=backend,
              speculative=_spec(proposer, 3))
    got = llm.generate(prompts, params, use_tqdm=False)
    assert llm.get_metrics()["spec_num_accepted_tokens"] > 0
    for a, b in zip(want, got, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)) if x != y), 40)
        assert n >= 20
        for la, lb in zip(a.logprobs[:n], b.logprobs[:n], strict=True):
            assert abs(next(iter(la.values())).logprob - next(iter(lb.values())).logprob) < 2e-3
    assert_pools_full(llm)


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second tiny Nemotron-H (other weights, same vocabulary): an imperfect draft model."""
    return make_tiny(tmp_path_factory.mktemp("draft"), seed=1, layers="M*-")


@pytest.mark.parametrize(("backend", "mode"), [("baseline", None), ("replay", "all"), ("replay", "align")])
def test_draft_model_proposer_is_lossless(tiny_model_dir: Path, other_model_dir: Path, greedy_paths: dict,
                                          backend: str, mode: str | None) -> None:
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    rates = {}
    for name, draft in (("self", tiny_model_dir), ("other", other_model_dir)):
        llm = LLM(model=str(tiny_model_dir), dtype="float64", device="cpu", max_num_seqs=4, ssm_backend=backend,
                  replay_window=8, enable_prefix_caching=mode is not None, mamba_cache_mode=mode or "none",
                  speculative={"method": "draft", "num_speculative_tokens": 3, "model": str(draft)})
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outs] == list(greedy_paths.values())
        rates[name] = llm.get_metrics()["spec_acceptance_rate"]
        assert_pools_full(llm)
    assert rates["self"] == 1.0 and rates["other"] < 1.0  # the target as its own draft is always right


def test_draft_model_with_another_vocabulary_is_rejected(tiny_model_dir: Path, tmp_path: Path) -> None:
    draft = make_tiny(tmp_path / "v", seed=1, layers="M*", vocab_size=300)
    with pytest.raises(ConfigError, match="vocab_size"):
        LLM(model=str(tiny_model_dir), dtype="float64", device="cpu",
            speculative={"method": "draft", "num_speculative_tokens": 2, "model": str(draft)})


@pytest.fixture(scope="module")
def mtp_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Nemotron-H plus one MTP step of attention + MoE blocks (`mtp.layers.*`)."""
    return make_tiny(tmp_path_factory.mktemp("mtp"), seed=0, layers="M*-ME", num_nextn_predict_layers=1,
                     mtp_layer_types=("full_attention", "moe"))


@pytest.mark.parametrize(("backend", "mode"), [("baseline", None), ("replay", None), ("replay", "all")])
def test_mtp_proposer_is_lossless_and_reads_the_right_hidden_states(mtp_model_dir: Path, backend: str,
                                                                    mode: str | None) -> None:
    from replayserve.speculative.mtp import HiddenStore

    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    plain = LLM(model=str(mtp_model_dir), dtype="float64", device="cpu", max_num_seqs=4)
    plain.engine.runner.hidden_store = reference = HiddenStore()  # records without proposing
    reference.forget = lambda rid: None  # type: ignore[method-assign]  # keep them for the comparison
    want = plain.generate(prompts, GREEDY, use_tqdm=False)
    llm = LLM(model=str(mtp_model_dir), dtype="float64", device="cpu", max_num_seqs=4, ssm_backend=backend,
              replay_window=8, enable_prefix_caching=mode is not None, mamba_cache_mode=mode or "none",
              speculative={"method": "mtp", "num_speculative_tokens": 3})
    store = llm.engine.runner.hidden_store
    assert store is not None
    seen: dict[str, torch.Tensor] = {}
    forget = store.forget
    store.forget = lambda rid: (seen.__setitem__(rid, store.runs[rid][1]), forget(rid))  # type: ignore[method-assign]
    got = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert llm.get_metrics()["spec_num_draft_tokens"] > 0
    # Verify rows record only their kept positions: every stored state equals spec-off's there.
    for rid, run in seen.items():
        n = min(run.shape[0], reference.runs[rid][1].shape[0])
        assert n > len(_prompts()[int(rid)])
        torch.testing.assert_close(run[:n], reference.runs[rid][1][:n], rtol=1e-9, atol=1e-9)
    assert_pools_full(llm)


def test_mtp_configuration_errors(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="MTP layers"):
        LLM(model=str(tiny_model_dir), dtype="float64", device="cpu",
            speculative={"method": "mtp", "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="num_nextn_predict_layers"):
        make_tiny(tmp_path / "two", layers="M*", num_nextn_predict_layers=2, mtp_layer_types=("moe",))
    with pytest.raises(ConfigError, match="mtp_layers_block_type"):
        make_tiny(tmp_path / "mamba", layers="M*", num_nextn_predict_layers=1, mtp_layer_types=("linear_attention",))


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("mode", [None, "align", "all"])
@pytest.mark.parametrize("backend", ["baseline", "replay"])
@pytest.mark.parametrize("method", ["ngram", "draft", "mtp"])
def test_every_proposer_is_lossless_with_prefix_hits_and_small_pools(mtp_model_dir: Path, other_model_dir: Path,
                                                                      method: str, backend: str,
                                                                      mode: str | None, k: int) -> None:
    """The prefix-cache workload (shared prompts, second turns, hits while decoding, chunked
    prefills) on small pools (evictions, preemptions) with each real proposer."""
    small = {"num_kv_blocks": 24, "max_model_len": 96, "num_mamba_cache_slots": 2}
    reference = _workload(_llm(mtp_model_dir, **small).engine)
    spec = {"method": method, "num_speculative_tokens": k}
    if method == "draft":
        spec["model"] = str(other_model_dir)
    llm = _llm(mtp_model_dir, backend, mode, replay_window=8, speculative=spec, **small)
    assert _workload(llm.engine) == reference
    assert llm.get_metrics()["spec_num_draft_tokens"] > 0
    if mode is not None:
        check_boundary_states(llm, mtp_model_dir)
    assert_pools_full(llm)


def test_draft_model_keeps_a_boundary_state_per_running_request(tiny_model_dir: Path, other_model_dir: Path) -> None:
    """Proposals for the running requests interleave: the draft engine must keep each one's
    newest boundary state between its calls, so a call prefills little more than one block."""
    llm = LLM(model=str(tiny_model_dir), dtype="float64", device="cpu", max_num_seqs=4,
              speculative={"method": "draft", "num_speculative_tokens": 3, "model": str(other_model_dir)})
    llm.generate([{"prompt_token_ids": p} for p in _prompts()], GREEDY, use_tqdm=False)
    draft = llm.engine.proposer.llm  # type: ignore[union-attr]
    m = draft.get_metrics()
    assert m["prefix_cache_queries"] > 0 and m["prefix_cache_hit_rate"] > 0.6, m  # 0.0 with one slot
    assert draft.engine.cache.states is not None and draft.engine.cache.states.size >= 4 * 4
