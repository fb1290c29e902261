"""CUDA graphs of decode steps: the buckets, and (on CUDA) graphed decode equal to eager decode
in float32 over 200 greedy tokens, both backends, with prefix caching and speculation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from replayserve import LLM, SamplingParams
from replayserve.builtin.tiny import make_tiny
from replayserve.engine.cuda_graph import capture_buckets
from tests.conftest import assert_pools_full


def test_capture_buckets() -> None:
    assert capture_buckets(1) == (1,)
    assert capture_buckets(6) == (1, 2, 4, 6)
    assert capture_buckets(40) == (1, 2, 4, 8, 16, 32, 40)
    assert capture_buckets(64) == (1, 2, 4, 8, 16, 32, 48, 64)


@pytest.fixture(scope="module", params=["M*-M*-", "M*EM*E"], ids=["dense", "moe"])
def graph_model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Mamba, attention and MLP layers, or MoE layers in place of the MLPs (their Triton path is
    sync-free, so they are captured too)."""
    return make_tiny(tmp_path_factory.mktemp("graph"), seed=0, layers=request.param)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU; exercised on the H200")
@pytest.mark.parametrize("backend", ["baseline", "replay"])
# Cache sizes given: sized from memory, every test worker sharing the GPU would want its share.
@pytest.mark.parametrize("extra", [{}, {"enable_prefix_caching": True, "mamba_cache_mode": "align",
                                        "num_kv_blocks": 160, "num_mamba_cache_slots": 16},
                                   {"speculative": {"method": "ngram", "num_speculative_tokens": 3}}])
def test_graphed_decode_equals_eager(graph_model_dir: Path, backend: str, extra: dict) -> None:
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 500, (n,), generator=gen).tolist()} for n in (5, 17, 30, 9, 3)]
    prompts.append(prompts[1])  # a prefix hit when caching is on
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True, logprobs=2)
    outs = {}
    for eager in (True, False):
        llm = LLM(model=str(graph_model_dir), dtype="float32", device="cuda", max_num_seqs=8, max_model_len=256,
                  ssm_backend=backend, enforce_eager=eager, **extra)
        outs[eager] = llm.generate(prompts, params, use_tqdm=False)
        graphs = llm.engine.runner.graphs
        assert (graphs is None) == eager
        if not eager:
            assert graphs._graphs, "no decode step ran through a graph"
        assert_pools_full(llm)
    for a, b in zip(outs[True], outs[False], strict=True):
        assert_equal_up_to_a_tie(a, b)


def assert_equal_up_to_a_tie(eager, graphed, tol: float = 1e-4) -> None:  # noqa: ANN001 - CompletionOutput
    """Same greedy tokens and log-probabilities, up to the first float32 near-tie: graphed rows are
    padded to a bucket, so cuBLAS may pick another kernel and round differently; where the tokens
    part, the two candidates must be within `tol` of each other in the eager run's top 2."""
    for i, (x, y) in enumerate(zip(eager.token_ids, graphed.token_ids, strict=True)):
        le, lg = eager.logprobs[i], graphed.logprobs[i]
        if x != y:
            assert y in le and abs(le[x].logprob - le[y].logprob) < tol, f"token {i}: {x} != {y}, not a tie"
            return
        assert abs(le[x].logprob - lg[y].logprob) < tol


@pytest.mark.parametrize(("backend", "extra"), [
    ("baseline", {}),
    ("replay", {"enable_prefix_caching": True, "mamba_cache_mode": "all"}),
    ("baseline", {"speculative": {"method": "ngram", "num_speculative_tokens": 3}}),
    ("replay", {"speculative": {"method": "mtp", "num_speculative_tokens": 2}}),
])
def test_padded_fixed_shape_decode_equals_the_plain_path(mtp_dense_dir: Path, backend: str, extra: dict) -> None:
    """The graphs' forward run eagerly (float64, CPU): rows padded to a bucket, verify rows to
    1 + k tokens, pad rows on the pad block and pad slot; tokens equal the plain path's."""
    gen = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(3, 500, (n,), generator=gen).tolist()} for n in (5, 17, 30, 9, 3)]
    prompts.append({"prompt_token_ids": prompts[1]["prompt_token_ids"] * 2})  # repeats: n-gram drafts
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = []
    for padded in (False, True):
        llm = LLM(model=str(mtp_dense_dir), dtype="float64", device="cpu", max_num_seqs=6, max_model_len=128,
                  block_size=4, ssm_backend=backend, replay_window=6, **extra)
        if padded:
            llm.engine.runner.graphs = llm.engine.runner.make_decode_graphs(capture=False)
        outs.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        assert_pools_full(llm)
    assert outs[0] == outs[1]


@pytest.fixture(scope="module")
def mtp_dense_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("mtpdense"), seed=0, layers="M*-M*-", num_nextn_predict_layers=1,
                     mtp_layer_types=("full_attention", "mlp"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the one-row GEMV runs in half precision on CUDA")
@pytest.mark.parametrize("backend", ["baseline", "replay"])
def test_batch1_conv_in_the_gemv_equals_the_conv_kernel(graph_model_dir: Path, backend: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 decode at one row, graphed and eager: the conv update in the in_proj GEMV's epilogue
    gives the conv kernel's tokens and log-probabilities exactly (same roundings, same tap order)."""
    import replayserve.layers.mamba2 as mamba2
    import replayserve.ops.gemv_triton as gemv

    calls = []
    fused_call = gemv.gemv_conv_triton
    monkeypatch.setattr(gemv, "gemv_conv_triton", lambda *a, **k: calls.append(1) or fused_call(*a, **k))
    prompt = {"prompt_token_ids": torch.randint(3, 500, (21,), generator=torch.Generator().manual_seed(4)).tolist()}
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=2)
    outs = {}
    for fused in (True, False):
        monkeypatch.setattr(mamba2, "FUSED_CONV_AT_ONE_ROW", fused)
        calls.clear()
        for eager in (True, False):
            llm = LLM(model=str(graph_model_dir), dtype="bfloat16", device="cuda", max_num_seqs=1, max_model_len=128,
                      ssm_backend=backend, enforce_eager=eager, num_kv_blocks=32, num_mamba_cache_slots=2)
            outs[fused, eager] = llm.generate([prompt], params, use_tqdm=False)[0]
            assert_pools_full(llm)
        assert bool(calls) == fused  # the switch picks the path
    for eager in (True, False):
        a, b = outs[True, eager], outs[False, eager]
        assert a.token_ids == b.token_ids
        assert [d[t].logprob for d, t in zip(a.logprobs, a.token_ids, strict=True)] == \
               [d[t].logprob for d, t in zip(b.logprobs, b.token_ids, strict=True)]
