"""CUDA backend on a GPU (marker `gpu`; skipped without a GPU, torch or transformers).

Random-weight checkpoints of real shapes are made once per session (benchmarks/gpu_models.py) in
$STEPLLM_GPU_MODELS or a temporary folder. Checks: next-token log-probabilities against transformers in bf16
on the same GPU; GPU against our CPU backend; greedy agreement; the KV cache sized from the GPU's memory when
kv_cache_tokens is unset; CUDA-graph decode equals eager decode; the GEMV
kernels and the skinny GEMM against cuBLAS; sampling options on the GPU; the stepped API on the GPU (admission
mid-stream, prefix-cache hit vs miss, cancel and abort releasing everything); the fp8 KV cache against
transformers with a cache that rounds K and V to fp8, its memory, and its prefix-cache hits.

Tolerances scale with the logits' magnitude. The checkpoints' embeddings are scaled up (gpu_models.EMBED_SCALE),
so logits reach ~100-300 on llama1b, where one bf16 ulp is 0.5-2.0: a fixed absolute tolerance is either too
tight there or meaningless on the small shapes. So a logprob may differ from the reference by a few bf16 ulps of
the logits it is made of (`logprob_tol`), and greedy ids must agree until the reference's first near-tie
(`assert_greedy_agrees`). A wrong head, a wrong RoPE or a wrong norm moves logits by far more than a few ulps
and changes the argmax at positions whose top-2 gap is wide, so these checks still fail on such bugs.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

import stepllm

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)
try:
    stepllm.Config(device="cuda")
except stepllm.StepllmError as e:  # built without kernels, or no driver
    pytest.skip(f"stepllm CUDA backend unavailable: {e}", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu_models  # noqa: E402
from conftest import check_invariants, run_alone  # noqa: E402

SHAPES = ["smollm2", "qwen3", "llama1b", "llama3s", "qwen2", *gpu_models.GROUP_SHAPES]
PROMPT = [(7 * i + 3) % 397 + 2 for i in range(40)]


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    env = os.environ.get("STEPLLM_GPU_MODELS")
    return Path(env) if env else tmp_path_factory.mktemp("gpu_models")


@pytest.fixture(scope="session", params=SHAPES)
def shape(request: pytest.FixtureRequest, models_dir: Path) -> tuple[str, Path]:
    return request.param, gpu_models.make(request.param, models_dir)


def greedy(n: int, **kw) -> stepllm.SamplingParams:
    return stepllm.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def coordinator(path: Path, device: str, graphs: bool = False, **kw) -> stepllm.RuntimeCoordinator:
    cfg = stepllm.Config(model=str(path), device=device, max_batch_size=kw.pop("max_batch_size", 8), kv_cache_tokens=8192, **kw)
    coord = stepllm.RuntimeCoordinator(cfg)
    if graphs:
        assert coord.capture_decoding_cuda_graph()
    return coord


def hf_model(path: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16).cuda().eval()


def hf_logits(path: Path, seqs: list[list[int]], cache=None) -> list["torch.Tensor"]:
    """transformers' bf16 logits (as f32, on the host) at every position of each sequence, teacher-forced (each
    through a fresh `cache()` when given, e.g. fp8_rounded_cache)."""
    model = hf_model(path)
    out = [forced_logits(model, ids, cache() if cache else None) for ids in seqs]
    del model
    torch.cuda.empty_cache()
    return out


def forced_logits(model, ids: list[int], past_key_values=None) -> "torch.Tensor":
    """The model's logits at every position of `ids`, teacher-forced (through `past_key_values` when given)."""
    with torch.no_grad():
        out = model(torch.tensor([ids], device="cuda"), past_key_values=past_key_values, use_cache=True)
        return out.logits[0].float().cpu()


# A reference top-2 gap below this many bf16 ulps of the top logit is a tie that rounding alone can flip.
NEAR_TIE_ULPS = 4


def ulp_bf16(x: float) -> float:
    """Spacing of bf16 values at |x|: 8 significant bits, so 2**(e-7) for |x| in [2**e, 2**(e+1))."""
    x = abs(x)
    if x < 2.0**-126:
        return 2.0**-133
    _, e = math.frexp(x)  # x = m * 2**e with m in [0.5, 1)
    return 2.0 ** (e - 8)


def logprob_tol(row: "torch.Tensor", *tokens: int, ulps: int = 4) -> float:
    """How far a bf16 runtime's log-probability of `tokens` may sit from the reference at a position whose
    reference logits are `row`. log p(t) = logit(t) - logsumexp(logits), and logsumexp is dominated by the top
    logit; each carries the bf16 rounding of its magnitude, compounded over the layers. Allow `ulps` (4) ulps of the
    largest magnitude involved, plus a quarter nat for the small shapes (whose ulps are tiny)."""
    scale = max([abs(row.max().item())] + [abs(row[t].item()) for t in tokens])
    return 0.25 + ulps * ulp_bf16(scale)


def top2(rows: "torch.Tensor") -> list[tuple[int, int, float, float]]:
    """(best id, second id, best logit, second logit) of each row."""
    values, ids = torch.topk(rows, 2, dim=-1)
    return [(a, b, x, y) for (a, b), (x, y) in zip(ids.tolist(), values.tolist())]


def assert_greedy_agrees(
    got: list[int], ref: list[int], ref_top2: list[tuple[int, int, float, float]], what: object, ref_gaps: list[float] | None = None
) -> None:
    """Greedy ids `got` must equal the reference `ref` position by position. `ref_top2[k]` is transformers' top-2
    at position k, teacher-forced on `ref`. Where the top-2 gap is below NEAR_TIE_ULPS bf16 ulps of the top logit,
    rounding alone may pick either token: `got` may take either of the two, and once it takes the other one the
    sequences continue from different contexts, so nothing after that is compared. Everywhere else (wide gaps)
    a different id is a bug. transformers' logits are rounded to bf16, so its gap is known only to an ulp or two;
    `ref_gaps[k]`, when given, is the reference run's own top-2 gap there (from its reported log-probabilities,
    whose differences are the logits' differences), and a near tie by either measure counts."""
    n = min(len(got), len(ref), len(ref_top2))
    assert n > 0, (what, got, ref)
    for k in range(n):
        best, second, v1, v2 = ref_top2[k]
        gap = v1 - v2 if ref_gaps is None else min(v1 - v2, ref_gaps[k])
        near_tie = gap < NEAR_TIE_ULPS * ulp_bf16(v1)
        if got[k] == ref[k]:
            continue
        assert near_tie and got[k] in (best, second), (what, f"diverged at {k} with top-2 gap {gap:.3f}", got, ref, ref_top2[k])
        return


def top2_gaps(response: stepllm.GenerationResponse) -> list[float]:
    """The top-2 log-probability gap at each generated position of a response made with logprobs >= 2."""
    return [lp.top[0][1] - lp.top[1][1] for lp in response.logprobs]


def test_device_error_is_clear_without_gpu_only_message() -> None:
    # On this machine the GPU exists; "auto" must pick it.
    info = coordinator(gpu_models.make("smollm2", Path(os.environ.get("STEPLLM_GPU_MODELS", "/tmp/gm"))), "auto").info()["device"]
    assert info.startswith("cuda"), info


def test_a_shape_without_cuda_kernels_is_refused_by_name_and_auto_runs_it_on_the_cpu(capfd: pytest.CaptureFixture) -> None:
    """The llama fixture has head_dim 16, which no CUDA attention kernel covers: device="cuda" refuses it before
    loading, naming the shape, and device="auto" runs it on the CPU (with a warning) with the fixture's greedy ids."""
    fixture = Path(__file__).resolve().parent / "fixtures" / "llama"
    with pytest.raises(stepllm.ModelLoadError, match="head_dim 16 with 2 query heads per KV head"):
        coordinator(fixture, "cuda")
    rows = [r for r in json.loads((fixture / "expected.json").read_text())["rows"] if r["kind"] == "raw"]
    with stepllm.LLM(model=str(fixture), device="auto") as llm:
        assert llm.info()["device"].startswith("cpu"), llm.info()["device"]
        out = llm.generate([r["prompt_ids"] for r in rows], greedy(len(rows[0]["greedy_ids"])))
    assert [o.output_ids for o in out] == [r["greedy_ids"] for r in rows]
    assert "device=\"auto\" runs this model on the CPU" in capfd.readouterr().err


def assert_runs_agree(path: Path, prompts: list[list[int]], got: list, ref: list, what: object) -> None:
    """Each response of `got` against the reference run's `ref` (greedy, with logprobs): ids agree under the
    near-tie rule and the first token's log-probabilities within bf16 tolerance. The reference's logits are not
    reported, so the logit magnitudes (for the tolerances) and the near-ties come from transformers,
    teacher-forced on the reference's ids."""
    forced = hf_logits(path, [p + r.output_ids for p, r in zip(prompts, ref)])
    for p, g, r, logits in zip(prompts, got, ref, forced):
        rows = logits[len(p) - 1 : len(p) - 1 + len(r.output_ids)]
        assert_greedy_agrees(g.output_ids, r.output_ids, top2(rows), (what, len(p)), top2_gaps(r))
        first, want = g.logprobs[0], r.logprobs[0]
        tol = logprob_tol(rows[0], first.token_id, want.token_id) + 0.03 * abs(want.logprob)
        assert abs(first.logprob - want.logprob) < tol, (what, len(p), first, want, tol)


def test_logprobs_match_transformers_bf16(shape: tuple[str, Path]) -> None:
    name, path = shape
    (logits,) = hf_logits(path, [PROMPT + [5]])
    row = logits[len(PROMPT) - 1]
    expected = torch.log_softmax(row, -1)
    out = coordinator(path, "cuda").dispatch_request([stepllm.GenerationRequest(PROMPT, greedy(2, logprobs=20))])[0]
    lp = out.logprobs[0]
    ref_top = top2(row[None])
    assert_greedy_agrees([lp.token_id], [ref_top[0][0]], ref_top, name)
    for tok, value in lp.top[:10]:
        want = expected[tok].item()
        tol = logprob_tol(row, tok) + 0.03 * abs(want)
        assert abs(value - want) < tol, (name, tok, value, want, tol)


def test_prompt_logprobs_match_transformers_bf16(models_dir: Path) -> None:
    """Prompt logprobs on the GPU against transformers' teacher-forced logits: a 1,000-token prompt of the Qwen3
    shape, whose 152k vocabulary caps a step at about 440 scored positions (three chunks), beside a short prompt."""
    path = gpu_models.make("qwen3", models_dir)
    long = [(37 * i + 11) % 5000 + 3 for i in range(1000)]
    prompts = [long, PROMPT]
    refs = hf_logits(path, prompts)
    outs = coordinator(path, "cuda").dispatch_request([stepllm.GenerationRequest(p, greedy(1, prompt_logprobs=2)) for p in prompts])
    for prompt, out, ref in zip(prompts, outs, refs):
        assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        want = torch.log_softmax(ref, -1)
        for p, lp in enumerate(out.prompt_logprobs[1:]):
            token = prompt[p + 1]
            assert lp is not None and lp.token_id == token and len(lp.top) == 2
            tol = logprob_tol(ref[p], token) + 0.03 * abs(want[p, token].item())
            assert abs(lp.logprob - want[p, token].item()) < tol, (len(prompt), p, lp.logprob, want[p, token].item(), tol)


def assert_scored_consistently(lp: stepllm.TokenLogprob, top: int) -> None:
    """What one device-scored position (kernels/logprobs.cu) must satisfy exactly: `top` distinct alternatives, best
    first with ties to the lower id, none above 0, their probabilities summing to at most 1, and the token's own
    logprob equal, bit for bit, to its entry when it is among them (both are its logit less one log-sum-exp)."""
    assert len(lp.top) == top and len({i for i, _ in lp.top}) == top, lp
    for (a, x), (b, y) in zip(lp.top, lp.top[1:]):
        assert x > y or (x == y and a < b), lp
    assert all(v <= 0.0 for _, v in lp.top) and sum(math.exp(v) for _, v in lp.top) <= 1.0 + 1e-5, lp
    assert lp.logprob <= 0.0, lp
    if lp.token_id in dict(lp.top):
        assert dict(lp.top)[lp.token_id] == lp.logprob, lp


def test_device_scored_logprobs_are_consistent(models_dir: Path) -> None:
    """Sampled-token and prompt logprobs, both scored on the device: each position consistent in itself, and a
    greedy token is its position's best alternative."""
    path = gpu_models.make("smollm2", models_dir)
    out = coordinator(path, "cuda").dispatch_request([stepllm.GenerationRequest(PROMPT, greedy(6, logprobs=20, prompt_logprobs=5))])[0]
    assert len(out.logprobs) == 6 and out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(PROMPT)
    for token, lp in zip(out.output_ids, out.logprobs):
        assert lp.token_id == token and lp.top[0][0] == token, lp
        assert_scored_consistently(lp, 20)
    for token, lp in zip(PROMPT[1:], out.prompt_logprobs[1:]):
        assert lp is not None and lp.token_id == token
        assert_scored_consistently(lp, 5)


def test_gpu_greedy_matches_transformers(shape: tuple[str, Path]) -> None:
    import transformers

    name, path = shape
    model = hf_model(path)
    with torch.no_grad():
        ref = model.generate(torch.tensor([PROMPT], device="cuda"), max_new_tokens=16, do_sample=False)[0, len(PROMPT):].tolist()
    # the reference's logits at each generated position (row k predicts ref[k]), teacher-forced on its own ids
    rows = forced_logits(model, PROMPT + ref)[len(PROMPT) - 1 : len(PROMPT) - 1 + len(ref)]
    del model
    torch.cuda.empty_cache()
    out = coordinator(path, "cuda", graphs=True).dispatch_request([stepllm.GenerationRequest(PROMPT, greedy(16))])[0]
    assert len(out.output_ids) == 16
    assert_greedy_agrees(out.output_ids, ref, top2(rows), name)


@pytest.mark.parametrize("name", ["smollm2", "qwen3", "llama1b", "llama3s", "qwen2", *gpu_models.GROUP_SHAPES])
def test_gpu_matches_cpu_backend(name: str, models_dir: Path) -> None:
    path = gpu_models.make(name, models_dir)
    prompts = [PROMPT[: 10 + 7 * i] for i in range(3)]
    reqs = [stepllm.GenerationRequest(p, greedy(8, logprobs=5)) for p in prompts]
    gpu = coordinator(path, "cuda").dispatch_request(reqs)
    cpu = coordinator(path, "cpu").dispatch_request(reqs)
    # The CPU computes in f32 from the same bf16 weights: it is the reference sequence.
    assert_runs_agree(path, prompts, gpu, cpu, name)


def test_unset_sizes_fill_the_gpu_share(models_dir: Path) -> None:
    """Left unset on a GPU, max_batch_size is 256 and the KV cache takes the blocks that fit in
    gpu_memory_utilization of the device's memory beside what is in use (here also torch's), the weights and one
    step's activations: after a run with graphs the device stays inside that share, and a smaller share gives a
    smaller cache."""
    path = gpu_models.make("qwen3", models_dir)
    torch.cuda.empty_cache()
    small = stepllm.RuntimeCoordinator(stepllm.Config(model=str(path), device="cuda", gpu_memory_utilization=0.25))
    small_tokens = small.info()["kv_cache_tokens"]
    del small
    share = 0.5
    coord = stepllm.RuntimeCoordinator(stepllm.Config(model=str(path), device="cuda", gpu_memory_utilization=share))
    info = coord.info()
    assert info["max_batch_size"] == 256 and info["kv_cache_tokens"] > small_tokens > 16384, (info, small_tokens)
    assert coord.capture_decoding_cuda_graph()
    out = coord.dispatch_request([stepllm.GenerationRequest(PROMPT, greedy(8))] * 3)
    assert all(len(r.output_ids) == 8 for r in out)
    free, total = torch.cuda.mem_get_info()
    assert total - free <= share * total, (total - free, total, info["kv_cache_tokens"])


def test_graph_decode_equals_eager(models_dir: Path) -> None:
    path = gpu_models.make("qwen3", models_dir)
    reqs = [stepllm.GenerationRequest(PROMPT[: 5 + 3 * i], greedy(24)) for i in range(6)]
    eager = coordinator(path, "cuda").dispatch_request(reqs)
    graphed = coordinator(path, "cuda", graphs=True).dispatch_request(reqs)
    assert [r.output_ids for r in eager] == [r.output_ids for r in graphed]


def test_logprobs_of_some_rows_of_a_batch(models_dir: Path) -> None:
    """Rows that ask for logprobs come back in runs of consecutive rows (the sampler's one transfer per run) and are
    scored in parallel: in a batch where every other request asks, each asking request's logprobs must equal those
    of the same batch where every request asks (same batch, same kernels, so exactly), and the others have none."""
    path = gpu_models.make("qwen3", models_dir)
    prompts = [PROMPT[: 6 + 9 * i] for i in range(6)]

    def run(asking: set[int]) -> list:
        reqs = [stepllm.GenerationRequest(p, greedy(12, logprobs=3 if i in asking else None)) for i, p in enumerate(prompts)]
        return coordinator(path, "cuda", graphs=True).dispatch_request(reqs)

    some = run({0, 2, 3, 5})
    every = run(set(range(6)))
    assert [r.output_ids for r in some] == [r.output_ids for r in every]
    for i, (s, e) in enumerate(zip(some, every)):
        assert s.logprobs == (e.logprobs if i in {0, 2, 3, 5} else None), i


def assert_matches_cublas(path: Path, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch, what: object) -> None:
    """Greedy runs of `prompts` as one batch (graphs captured) with the projection kernels the environment selects,
    against the same run with every projection on cuBLAS (STEPLLM_GEMV_MAX_ROWS=0, STEPLLM_SKINNY_GEMM_MAX_ROWS=0)."""
    reqs = [stepllm.GenerationRequest(p, greedy(8, logprobs=5)) for p in prompts]
    ours = coordinator(path, "cuda", graphs=True, max_batch_size=len(prompts)).dispatch_request(reqs)
    monkeypatch.setenv("STEPLLM_GEMV_MAX_ROWS", "0")
    monkeypatch.setenv("STEPLLM_SKINNY_GEMM_MAX_ROWS", "0")
    ref = coordinator(path, "cuda", graphs=True, max_batch_size=len(prompts)).dispatch_request(reqs)
    assert_runs_agree(path, prompts, ours, ref, what)


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_gemv_batches_match_cublas(rows: int, models_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode batches of 1 and 2 rows go to our GEMV kernels (the bulk-copy family on Hopper for 1, the register
    family for 2), 3 and 4 to the skinny GEMM; the same requests with every projection on cuBLAS
    (STEPLLM_GEMV_MAX_ROWS=0, the skinny GEMM off) are the reference."""
    prompts = [PROMPT[: 8 + 5 * i] for i in range(rows)]
    assert_matches_cublas(gpu_models.make("qwen3", models_dir), prompts, monkeypatch, rows)


@pytest.mark.parametrize("rows", [3, 4])
def test_bulk_gemv_of_several_rows_matches_cublas(rows: int, models_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With STEPLLM_GEMV_MAX_ROWS=4, batches of 3 and 4 rows go to the GEMV kernels too (on Hopper the bulk-copy
    family, whose prologue stages every row's input and RMSNorm weights and whose residual-add epilogue stages each
    row's old outputs); every projection on cuBLAS is the reference."""
    prompts = [PROMPT[: 8 + 5 * i] for i in range(rows)]
    monkeypatch.setenv("STEPLLM_GEMV_MAX_ROWS", "4")
    assert_matches_cublas(gpu_models.make("qwen3", models_dir), prompts, monkeypatch, ("bulk", rows))


@pytest.mark.parametrize("name,rows", [("qwen3", 5), ("qwen3", 32), ("qwen3", 100), ("smollm2", 24), ("smollm2", 100)])
def test_skinny_gemm_batches_match_cublas(name: str, rows: int, models_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode batches of 3 to 16 rows go to the tensor-core skinny GEMM (kernels/skinny_gemm.cu) with the RMSNorm,
    the SiLU gating and the residual add fused; the same requests with those projections on cuBLAS
    (STEPLLM_SKINNY_GEMM_MAX_ROWS=0) are the reference. The shapes cover K split over blocks (Qwen3's O and down
    projections), K not a multiple of 256 (SmolLM2's 576 and 1536), partial token tiles (5, 100), and, with the
    limit raised, batches of 24 to 100 rows (over one block's 32 tokens at 100). (Not the Llama-3.2-1B shape: at
    these prompts its top-2 logits are 2-4 bf16 ulps apart, and every path, cuBLAS at batch 1 included, leaves
    transformers' sequence somewhere.)"""
    prompts = [PROMPT[: 3 + (7 * i) % 37] for i in range(rows)]
    monkeypatch.setenv("STEPLLM_SKINNY_GEMM_MAX_ROWS", str(max(rows, 16)))
    assert_matches_cublas(gpu_models.make(name, models_dir), prompts, monkeypatch, (name, rows))


def test_gpu_sampling_options(models_dir: Path) -> None:
    path = gpu_models.make("smollm2", models_dir)
    coord = coordinator(path, "cuda", graphs=True)

    def run(**kw):
        p = stepllm.SamplingParams(max_tokens=12, ignore_eos=True, **kw)
        return coord.dispatch_request([stepllm.GenerationRequest(PROMPT, p)])[0].output_ids

    g = run(temperature=0.0)
    assert run(temperature=0.7, top_k=1) == g
    assert run(temperature=1.0, seed=3) == run(temperature=1.0, seed=3)
    a = run(temperature=5.0, seed=3, top_k=50, top_p=0.9, min_p=0.01)
    assert a == run(temperature=5.0, seed=3, top_k=50, top_p=0.9, min_p=0.01)
    assert len(set(run(temperature=50.0, seed=9))) > 3  # flat distribution: varied tokens
    banned = g[0]
    assert run(temperature=0.0, logit_bias={banned: -100.0})[0] != banned
    rep = run(temperature=0.0, repetition_penalty=100.0, presence_penalty=2.0, frequency_penalty=1.0)
    assert len(rep) == 12
    # min_tokens bans the ending ids on the device sampler (bias pairs of -inf), greedy and random.
    for kw in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 4}):
        free = run(**kw)
        # A token first seen past the start, if the run has one (a random model's greedy run may repeat one token).
        k = next((i for i in range(1, len(free)) if free[i] not in free[:i]), 0)
        held = run(stop_token_ids=[free[k]], min_tokens=k + 4, **kw)
        assert free[k] not in held[: k + 4] and len(held) >= k + 4, (kw, free, held)
        if kw["temperature"] == 0.0:
            assert held[:k] == free[:k]
    # Seeded draws do not depend on batch neighbours: their tokens, their sampling. The batch's shape stays the
    # same (two rows, a 9-token neighbour), since on the GPU the kernels are chosen by batch size (GEMV, skinny
    # GEMM, cuBLAS), and a different size may round the logits differently, which a draw at temperature 3 can
    # notice; the CPU test in test_cache_and_batching.py also compares against the request alone.
    p = stepllm.SamplingParams(max_tokens=8, temperature=3.0, seed=11, ignore_eos=True)
    other = [(11 * i + 5) % 397 + 2 for i in range(9)]
    first = coord.dispatch_request([stepllm.GenerationRequest(PROMPT[:9], greedy(8)), stepllm.GenerationRequest(PROMPT, p)])
    p_other = stepllm.SamplingParams(max_tokens=8, temperature=1.0, seed=5, top_k=20, ignore_eos=True)
    second = coord.dispatch_request([stepllm.GenerationRequest(other, p_other), stepllm.GenerationRequest(PROMPT, p)])
    assert second[1].output_ids == first[1].output_ids


# ---------------------------------------------------------------------------------------- the stepped API on the GPU

def assert_logprobs_agree_until_near_tie(got: list, want: list, what: object) -> None:
    """Greedy tokens (with logprobs=2) agree until the reference's first near-tie (a log-probability gap of at most
    0.25), and every agreed token's log-probability is within the bf16 tolerance. Gaps move in steps of the logits'
    bf16 ulp (0.125 for top logits in [16, 32), as the random qwen3 checkpoint has), and each run's logits may sit
    an ulp from the other's, so a gap of two ulps can flip: reordering the decode attention's sums flipped one of
    exactly 0.25 (benchmarks/RESULTS.md, 2026-12-07)."""
    for i, (g, w) in enumerate(zip(got, want)):
        if g.token_id != w.token_id:
            (_, best), (_, second) = w.top[:2]
            assert best - second <= 0.25, (what, f"diverged at {i} with a log-probability gap of {best - second:.3f}")
            return
        assert abs(g.logprob - w.logprob) < 0.25 + 0.03 * abs(w.logprob), (what, i, g, w)


def assert_released(coord: stepllm.RuntimeCoordinator) -> None:
    c = coord.counts()
    check_invariants(c)
    assert c["live_slots"] == 0 and c["leased_blocks"] == 0, c


def decode_all(stepped: stepllm.SteppedRequest) -> tuple[dict[int, stepllm.GenerationResponse], list]:
    """Decode every resident to its end, then finish the session: (each request's response by original index,
    the founder's at 0; the executions of the decode steps)."""
    done: dict[int, stepllm.GenerationResponse] = {}
    executions = []
    while stepped.residents():
        step = stepped.decode(stepllm.ImmutableDecodeBatch(residents=stepped.residents()))
        executions.append(step.execution)
        for _, result in step.finished:
            done[result.identity.original_index] = stepped.materialize(result)
    done[0] = stepped.finish()
    return done, executions


def decode_session(coord: stepllm.RuntimeCoordinator, requests: list[stepllm.GenerationRequest],
                   decodes_before_admissions: int = 0) -> tuple[list[list[int]], list]:
    """One stepped session: the first request as its founder, prefilled and decoded `decodes_before_admissions`
    times; then the others admitted and prefilled, and every resident decoded to its end. Returns each request's
    tokens and the executions of the decode steps after the admissions."""
    stepped = coord.begin_stepped(requests[0])
    stepped.prefill(stepllm.ImmutablePrefillBatch(target=stepped.founder()))
    for _ in range(decodes_before_admissions):
        stepped.decode(stepllm.ImmutableDecodeBatch(residents=stepped.residents()))
    for i, request in enumerate(requests[1:], start=1):
        adm = stepped.admit(request, original_index=i, request_id=i + 1)
        stepped.prefill(stepllm.ImmutablePrefillBatch(target=adm.ref))
    done, executions = decode_all(stepped)
    return [done[i].output_ids for i in range(len(requests))], executions


def test_stepped_admission_mid_stream_on_gpu(models_dir: Path) -> None:
    """B admitted while A decodes from graphs gives what each gives alone; every decode step replays a graph."""
    path = gpu_models.make("smollm2", models_dir)
    a = stepllm.GenerationRequest(PROMPT, greedy(16))
    b = stepllm.GenerationRequest(PROMPT[:23], greedy(10))
    alone_a = run_alone(coordinator(path, "cuda", graphs=True), a)
    alone_b = run_alone(coordinator(path, "cuda", graphs=True), b)
    coord = coordinator(path, "cuda", graphs=True)
    (tokens_a, tokens_b), executions = decode_session(coord, [a, b], decodes_before_admissions=4)
    for ex in executions:
        assert ex.cuda_graph and 0 <= ex.device_wait_us <= ex.elapsed_us, ex
    assert tokens_a == alone_a.output_ids
    assert tokens_b == alone_b.output_ids
    assert_released(coord)


def test_mixed_step_on_gpu(models_dir: Path) -> None:
    """A decodes in the eager forward that prefills the group of B and C (a mixed step): each gives what it gives
    alone, and the decode steps after it replay graphs."""
    path = gpu_models.make("smollm2", models_dir)
    a = stepllm.GenerationRequest(PROMPT, greedy(16))
    joining = [stepllm.GenerationRequest(PROMPT[:23], greedy(10)), stepllm.GenerationRequest(PROMPT[5:], greedy(12))]
    alone = [run_alone(coordinator(path, "cuda", graphs=True), r).output_ids for r in [a, *joining]]
    coord = coordinator(path, "cuda", graphs=True)
    stepped = coord.begin_stepped(a)
    founder = stepped.founder()
    stepped.prefill(stepllm.ImmutablePrefillBatch(target=founder))
    for _ in range(4):
        stepped.decode(stepllm.ImmutableDecodeBatch(residents=[founder]))
    targets = [stepped.admit_into_group(r, original_index=i, request_id=i + 1).ref for i, r in enumerate(joining, start=1)]
    step = stepped.mixed(stepllm.ImmutableMixedBatch(residents=[founder], targets=targets))
    assert step.ok and step.work == stepllm.SequenceWork.MIXED and not step.execution.cuda_graph, step
    done, executions = decode_all(stepped)
    assert all(ex.cuda_graph for ex in executions), executions
    assert [done[k].output_ids for k in range(3)] == alone
    assert_released(coord)


@pytest.mark.parametrize("kv_cache_dtype,prefill_env", [("auto", None), ("fp8", ("STEPLLM_PREFILL_SPLITS", "4")),
                                                        ("auto", ("STEPLLM_PREFILL_M_TILES", "2"))])
def test_mixed_step_decode_rows_take_the_decode_kernel(kv_cache_dtype: str, prefill_env: tuple[str, str] | None,
                                                        models_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A mixed step's decode rows come first, and they, with a one-token prompt right after them, take the decode
    attention kernel, which rotates their q and k itself; the prompts after them take the RoPE kernel and the tiled
    prefill attention, whose blocks start past those rows: narrow blocks, narrow blocks whose keys are split and
    merged (STEPLLM_PREFILL_SPLITS=4; the merge starts past the rows too), or wide blocks (STEPLLM_PREFILL_M_TILES=2).
    Three requests decode (contexts up to 1,300, so the decode kernel splits keys) while a one-token and a 200-token
    prompt join. Each request's greedy ids agree until the first near-tie, with log-probabilities within the bf16
    tolerance, with the five computed as one group and decoded together, and with the same session under
    STEPLLM_NO_MIXED_DECODE_ROWS=1 (every row in the prefill kernel)."""
    if prefill_env:
        monkeypatch.setenv(*prefill_env)
    path = gpu_models.make("qwen3", models_dir)
    prompts = [[(7 * i + 3 * k) % 991 + 2 for i in range(n)] for k, n in enumerate((1300, 300, 40, 1, 200))]
    requests = [stepllm.GenerationRequest(p, greedy(8, logprobs=2)) for p in prompts]

    def session() -> list[stepllm.GenerationResponse]:
        coord = coordinator(path, "cuda", graphs=True, kv_cache_dtype=kv_cache_dtype)
        stepped = coord.begin_stepped(requests[0])
        running = [stepped.founder()]
        stepped.prefill(stepllm.ImmutablePrefillBatch(target=running[0]))
        for i in (1, 2):
            running.append(stepped.admit(requests[i], original_index=i, request_id=i + 1).ref)
            stepped.prefill(stepllm.ImmutablePrefillBatch(target=running[-1]))
        stepped.decode(stepllm.ImmutableDecodeBatch(residents=running))
        targets = [stepped.admit_into_group(requests[i], original_index=i, request_id=i + 1).ref for i in (3, 4)]
        step = stepped.mixed(stepllm.ImmutableMixedBatch(residents=running, targets=targets))
        assert step.ok and step.work == stepllm.SequenceWork.MIXED, step
        queries = sorted(p.query_length for p in step.participants if p.work == stepllm.SequenceWork.CONTEXT)
        assert queries == [1, 200], queries
        done, _ = decode_all(stepped)
        assert_released(coord)
        return [done[i] for i in range(len(requests))]

    whole = coordinator(path, "cuda", graphs=True, kv_cache_dtype=kv_cache_dtype).dispatch_request(requests)
    ours = session()
    monkeypatch.setenv("STEPLLM_NO_MIXED_DECODE_ROWS", "1")
    in_prefill_kernel = session()
    for k, (got, want, old) in enumerate(zip(ours, whole, in_prefill_kernel)):
        assert len(got.output_ids) == len(want.output_ids) == len(old.output_ids) == 8, k
        assert_logprobs_agree_until_near_tie(got.logprobs, want.logprobs, (k, "whole"))
        assert_logprobs_agree_until_near_tie(got.logprobs, old.logprobs, (k, "STEPLLM_NO_MIXED_DECODE_ROWS"))


def test_chunked_prefill_on_gpu(models_dir: Path) -> None:
    """With max_prefill_tokens=64 a prompt of 300 tokens is computed in five chunks, the later ones attending to
    the cached earlier ones (the prefill attention over a cached prefix) and the first four asking no logits; two
    more join in chunks while it decodes (mixed steps). Each request's greedy ids agree with its prompt computed
    whole until that run's first near-tie (log-probability gap <= 0.25), every agreed token's log-probability
    within the bf16 tolerance, and the decode steps after the chunks replay graphs."""
    path = gpu_models.make("qwen3", models_dir)
    prompts = [[(11 * i + 5 * k) % 997 + 2 for i in range(n)] for k, n in enumerate((300, 129, 40))]
    requests = [stepllm.GenerationRequest(p, greedy(8, logprobs=2)) for p in prompts]
    whole = coordinator(path, "cuda", graphs=True).dispatch_request(requests)
    coord = coordinator(path, "cuda", graphs=True, max_prefill_tokens=64)
    stepped = coord.begin_stepped(requests[0])
    founder = stepped.founder()
    first = stepped.prefill(stepllm.ImmutablePrefillBatch(target=founder))
    assert [(p.query_length, p.past_length, p.select_last_token_logits) for p in first.participants] == [(44, 256, True)]
    stepped.decode(stepllm.ImmutableDecodeBatch(residents=[founder]))
    targets = [stepped.admit_into_group(r, original_index=i, request_id=i + 1).ref for i, r in enumerate(requests[1:], start=1)]
    chunks = []
    while stepped.seated():
        step = stepped.mixed(stepllm.ImmutableMixedBatch(residents=[founder], targets=stepped.seated()))
        assert step.ok and not step.execution.cuda_graph, step
        chunks.append([p.query_length for p in step.participants if p.work == stepllm.SequenceWork.CONTEXT])
    assert chunks == [[64], [64], [1, 40]], chunks
    done, executions = decode_all(stepped)
    assert all(ex.cuda_graph for ex in executions), executions
    for k, want in enumerate(whole):
        assert len(done[k].output_ids) == len(want.output_ids) == 8, k
        assert_logprobs_agree_until_near_tie(done[k].logprobs, want.logprobs, k)
    assert_released(coord)


@pytest.mark.parametrize("beside_running", [False, True])
def test_chunked_long_prompt_splits_keys_on_gpu(beside_running: bool, models_dir: Path) -> None:
    """A 1,100-token prompt in chunks of 128: each later chunk has 2 query tiles per head over up to 18 K/V tiles,
    too few blocks for one wave, so the backend shares each tile's keys out over 4 blocks and merges them
    (PrefillSplitChoice); computed whole (288 blocks, no split) it must give the same greedy tokens until the first
    near-tie, with log-probabilities within the bf16 tolerance. beside_running: a short request decodes while the
    chunks are computed, so they are mixed steps whose decode row has a short context; only the chunk's query tiles
    count toward the split (`long_query_tiles`), and the short request must agree with its whole run too."""
    path = gpu_models.make("qwen3", models_dir)
    long = [(7 * i + 3) % 991 + 2 for i in range(1100)]
    short = [(5 * i + 1) % 397 + 2 for i in range(40)]
    prompts = [short, long] if beside_running else [long]
    requests = [stepllm.GenerationRequest(p, greedy(16, logprobs=2)) for p in prompts]
    whole = coordinator(path, "cuda", graphs=True).dispatch_request(requests)
    chunked_coord = coordinator(path, "cuda", graphs=True, max_prefill_tokens=128)
    chunked = chunked_coord.dispatch_request(requests)
    for k, (got, want) in enumerate(zip(chunked, whole)):
        assert len(got.output_ids) == len(want.output_ids) == 16, k
        assert_logprobs_agree_until_near_tie(got.logprobs, want.logprobs, k)
    assert_released(chunked_coord)


def test_graph_decode_of_long_contexts_equals_eager(models_dir: Path) -> None:
    """Two rows past 1024 tokens of context (block tables of 69 and 81 entries at the first step) decoded from a
    graph: every step replays one, and gives the tokens of the same steps run eagerly."""
    path = gpu_models.make("smollm2", models_dir)
    prompts = [[(7 * i + 3 * k) % 997 + 2 for i in range(n)] for k, n in enumerate((1100, 1290))]
    a, b = (stepllm.GenerationRequest(p, greedy(12)) for p in prompts)
    eager_coord, graphed_coord = coordinator(path, "cuda"), coordinator(path, "cuda", graphs=True)
    eager, eager_steps = decode_session(eager_coord, [a, b])
    graphed, steps = decode_session(graphed_coord, [a, b])
    assert not any(ex.cuda_graph for ex in eager_steps) and steps and all(ex.cuda_graph for ex in steps)
    assert graphed == eager
    assert [len(t) for t in graphed] == [12, 12]
    assert_released(eager_coord)
    assert_released(graphed_coord)


def test_graph_replays_continue_their_metadata_on_the_device(models_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode step that continues the replay before it (the same rows, one token on) takes its metadata from the
    device, moved on by the graph's first kernel, and gives the tokens of replays that upload it every step
    (STEPLLM_NO_DECODE_ADVANCE=1): greedy and seeded rows, rows ending at different steps, contexts crossing block
    boundaries and running past the blocks reserved with their last upload."""
    path = gpu_models.make("qwen3", models_dir)

    def params(k: int) -> stepllm.SamplingParams:
        n = [30, 100, 110, 130, 150][k]
        if k % 2 == 0:
            return greedy(n)
        return stepllm.SamplingParams(max_tokens=n, temperature=0.8, top_p=0.9, seed=k, ignore_eos=True)

    requests = [stepllm.GenerationRequest(PROMPT[: 9 + 7 * k], params(k)) for k in range(5)]
    moved, steps = decode_session(coordinator(path, "cuda", graphs=True), requests)
    monkeypatch.setenv("STEPLLM_NO_DECODE_ADVANCE", "1")
    uploaded, upload_steps = decode_session(coordinator(path, "cuda", graphs=True), requests)
    assert moved == uploaded
    assert [len(t) for t in moved] == [30, 100, 110, 130, 150]
    assert all(ex.cuda_graph for ex in steps + upload_steps)
    assert not any(ex.metadata_on_device for ex in upload_steps)
    # Uploads: the first step, the step after each row ends, and one whenever a row is about to run past the
    # blocks reserved beyond its context at the last upload (49 to 64 steps after it): at least once in the 70
    # steps between the first and the second row's end.
    on_device = sum(ex.metadata_on_device for ex in steps)
    assert 0.85 * len(steps) <= on_device < len(steps) - 5, (on_device, len(steps))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("tiling,splits", [("1", None), ("2", None), ("1", "3")])
@pytest.mark.parametrize("name", ["qwen3", "smollm2"])
def test_tiled_prefill_attention_matches_transformers(name: str, tiling: str, splits: str | None, kv_cache_dtype: str,
                                                      models_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompts long enough for the tensor-core prefill attention (several query tiles and K/V tiles, causal edges
    inside tiles, tiles wholly below a warp's causal edge), prefilled together as one group with a 1,100-token
    prompt whose query tiles outnumber the others', then a prompt whose first 160 tokens are cached (published by
    the first group's 300-token prompt), so the tiled kernel also attends over a cached prefix: the first token's
    log-probabilities must match transformers'. Both block shapes, forced: narrow (16 query rows a warp, 64-position
    tiles) and wide (32 rows a warp, 32-position tiles, which the backend picks for long prompts). Then narrow
    blocks with every query tile's keys split over three blocks and merged (the backend splits steps with few query
    tiles over many keys), which also leaves some splits of short tiles without keys. With an fp8 cache (f16
    products) the reference is transformers with a cache that rounds K and V to fp8, under the fp8 tolerances."""
    monkeypatch.setenv("STEPLLM_PREFILL_M_TILES", tiling)
    if splits is not None:
        monkeypatch.setenv("STEPLLM_PREFILL_SPLITS", splits)
    path = gpu_models.make(name, models_dir)
    long = [(11 * i + 5) % 397 + 2 for i in range(300)]
    longest = [(7 * i + 3) % 991 + 2 for i in range(1100)]
    prompts = [long[:150], PROMPT[:37], long, longest]
    extended = long[:160] + [(13 * i + 1) % 397 + 2 for i in range(100)]
    fp8 = kv_cache_dtype == "fp8"
    coord = coordinator(path, "cuda", kv_cache_dtype=kv_cache_dtype)
    assert (coord.info()["kv_cache_dtype"] == "fp8") == fp8
    outs = coord.dispatch_request([stepllm.GenerationRequest(p, greedy(1, logprobs=10)) for p in prompts])
    hit = coord.dispatch_request([stepllm.GenerationRequest(extended, greedy(1, logprobs=10))])[0]
    assert hit.cached_prompt_tokens == 160, hit.cached_prompt_tokens
    seqs = prompts + [extended]
    forced = hf_logits(path, seqs, fp8_rounded_cache if fp8 else None)
    for p, out, logits in zip(seqs, outs + [hit], forced):
        row = logits[len(p) - 1]
        expected = torch.log_softmax(row, -1)
        lp = out.logprobs[0]
        ref_top = top2(row[None])
        if fp8:
            assert_fp8_greedy_agrees([lp.token_id], [ref_top[0][0]], row[None], (name, len(p)))
        else:
            assert_greedy_agrees([lp.token_id], [ref_top[0][0]], ref_top, (name, len(p)))
        for tok, value in lp.top[:10]:
            want = expected[tok].item()
            tol = logprob_tol(row, tok, ulps=FP8_NEAR_TIE_ULPS if fp8 else 4) + 0.03 * abs(want)
            assert abs(value - want) < tol, (name, len(p), tok, value, want, tol)


def test_gpu_prefix_cache_hit_equals_miss(models_dir: Path) -> None:
    """A hit prefills only the prompt's tail, attending over cached KV blocks; the output must not change."""
    path = gpu_models.make("qwen3", models_dir)
    coord = coordinator(path, "cuda", graphs=True)
    request = stepllm.GenerationRequest(PROMPT, greedy(12))
    miss = run_alone(coord, request)
    hit = run_alone(coord, request)
    assert miss.cached_prompt_tokens == 0
    assert hit.cached_prompt_tokens == 32, hit.cached_prompt_tokens  # two full blocks of 16 of the 40 tokens
    assert hit.output_ids == miss.output_ids
    assert_released(coord)


def test_gpu_system_prompt_saved_in_chunks_is_hit(models_dir: Path) -> None:
    """A system prompt of 200 tokens saved with max_prefill_tokens=64 is computed in four forwards that ask no
    logits; a request that starts with it hits its 12 full blocks and agrees with the same request run with
    nothing cached (greedy ids until a near-tie, log-probabilities within the bf16 tolerance)."""
    path = gpu_models.make("qwen3", models_dir)
    system = [(13 * i + 7) % 997 + 2 for i in range(200)]
    request = stepllm.GenerationRequest(system + PROMPT[:9], greedy(12, logprobs=2))
    miss = run_alone(coordinator(path, "cuda", graphs=True), request)
    coord = coordinator(path, "cuda", graphs=True, max_prefill_tokens=64)
    assert coord.gen_and_save_system_prompt_kv_cache(system) == 192
    hit = run_alone(coord, request)
    assert (miss.cached_prompt_tokens, hit.cached_prompt_tokens) == (0, 192)
    assert_logprobs_agree_until_near_tie(hit.logprobs, miss.logprobs, "system prompt hit")
    assert_released(coord)


def test_gpu_cancel_and_abort_release_everything(models_dir: Path) -> None:
    path = gpu_models.make("smollm2", models_dir)
    coord = coordinator(path, "cuda", graphs=True)
    stepped = coord.begin_stepped(stepllm.GenerationRequest(PROMPT, greedy(30)))
    stepped.prefill(stepllm.ImmutablePrefillBatch(target=stepped.founder()))
    refs = []
    for i in range(3):
        adm = stepped.admit(stepllm.GenerationRequest(PROMPT[: 10 + 5 * i], greedy(30)), original_index=i + 1, request_id=i + 2)
        stepped.prefill(stepllm.ImmutablePrefillBatch(target=adm.ref))
        refs.append(adm.ref)
    for _ in range(3):
        stepped.decode(stepllm.ImmutableDecodeBatch(residents=stepped.residents()))
    stepped.cancel(refs[1])
    step = stepped.decode(stepllm.ImmutableDecodeBatch(residents=stepped.residents()))
    cancelled = [r for r, result in step.finished if result.finish_reason == stepllm.FinishReason.CANCELLED]
    assert cancelled == [refs[1]], step.finished
    assert refs[1] not in stepped.residents() and len(stepped.residents()) == 3
    stepped.abort()
    assert_released(coord)
    again = run_alone(coord, stepllm.GenerationRequest(PROMPT, greedy(8)))
    assert len(again.output_ids) == 8
    assert_released(coord)


# An e4m3 value has 4 significant bits to bf16's 8, so where bf16 rounding moves a K or V value across an fp8
# rounding boundary the stored value jumps by 2**4 bf16 ulps. Near-ties therefore widen with an fp8 cache.
FP8_NEAR_TIE_ULPS = 8


def assert_fp8_greedy_agrees(got: list[int], ref: list[int], rows: "torch.Tensor", what: object) -> None:
    """assert_greedy_agrees for an fp8 cache: at the first position where the ids differ, the reference must rate
    our token within FP8_NEAR_TIE_ULPS bf16 ulps of its own choice (`rows[k]`: its logits there, teacher-forced);
    nothing after that is compared. A wrong kernel moves logits by far more and diverges at a wide gap."""
    n = min(len(got), len(ref), len(rows))
    assert n > 0, (what, got, ref)
    for k in range(n):
        if got[k] == ref[k]:
            continue
        best, ours = rows[k][ref[k]].item(), rows[k][got[k]].item()
        tol = FP8_NEAR_TIE_ULPS * ulp_bf16(best)
        assert best - ours < tol, (what, f"diverged at {k}: reference logits {best:.3f} (its id) vs {ours:.3f} (ours)", got, ref, tol)
        return


def fp8_rounded_cache():
    """transformers' cache with every K and V rounded to fp8 e4m3 as it is stored, as stepllm's fp8 cache stores
    them (round to nearest, no scale): the reference for Config(kv_cache_dtype="fp8"). Attention then reads the
    rounded values for every position, the newest one included, as our kernels do."""
    import transformers

    class Fp8RoundedCache(transformers.DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            def rounded(x):
                return x.to(torch.float8_e4m3fn).to(x.dtype)

            return super().update(rounded(key_states), rounded(value_states), layer_idx, *args, **kwargs)

    return Fp8RoundedCache()


@pytest.mark.parametrize("name", SHAPES)
def test_fp8_kv_cache_matches_transformers_with_fp8_rounded_cache(name: str, models_dir: Path) -> None:
    """Config(kv_cache_dtype="fp8") against transformers whose cache rounds K and V to fp8: greedy ids under the
    near-tie rule and the first token's log-probabilities within the bf16 tolerances, both widened from 4 to
    FP8_NEAR_TIE_ULPS bf16 ulps. The prompts take every fp8
    path: a 9-token prompt the paged prefill attention, 40 and 150 tokens the tiled one, and the decode steps the
    rotating decode attention from CUDA graphs (a batch of 3 replays the 4-row graph with a dummy row); the three
    shapes take three kernel layouts (16 values per lane at head_dim 128, 8 at 64, q in shared memory at G = 4). The same
    run with a bf16 cache must differ somewhere, or the fp8 path was not taken."""
    path = gpu_models.make(name, models_dir)
    long = [(11 * i + 5) % 397 + 2 for i in range(150)]
    prompts = [PROMPT[:9], PROMPT, long]
    reqs = [stepllm.GenerationRequest(p, greedy(12, logprobs=10)) for p in prompts]
    coord = coordinator(path, "cuda", graphs=True, kv_cache_dtype="fp8")
    assert coord.info()["kv_cache_dtype"] == "fp8"
    got = coord.dispatch_request(reqs)
    del coord
    bf16 = coordinator(path, "cuda", graphs=True).dispatch_request(reqs)
    model = hf_model(path)
    for p, out in zip(prompts, got):
        with torch.no_grad():
            ids = torch.tensor([p], device="cuda")
            ref = model.generate(ids, max_new_tokens=12, do_sample=False, past_key_values=fp8_rounded_cache())[0, len(p):].tolist()
        rows = forced_logits(model, p + ref, fp8_rounded_cache())[len(p) - 1 : len(p) - 1 + len(ref)]
        assert_fp8_greedy_agrees(out.output_ids, ref, rows, (name, len(p)))
        expected = torch.log_softmax(rows[0], -1)
        for tok, value in out.logprobs[0].top[:10]:
            want = expected[tok].item()
            tol = logprob_tol(rows[0], tok, ulps=FP8_NEAR_TIE_ULPS) + 0.03 * abs(want)
            assert abs(value - want) < tol, (name, len(p), tok, value, want, tol)
    del model
    torch.cuda.empty_cache()
    assert any(g.logprobs[0].top != b.logprobs[0].top for g, b in zip(got, bf16)), "fp8 and bf16 caches gave identical logprobs"


def test_fp8_kv_cache_takes_half_the_memory(models_dir: Path) -> None:
    """An fp8 cache stores one byte per value: the same kv_cache_tokens take half the device memory of bf16."""
    import gc

    path = gpu_models.make("qwen3", models_dir)
    cfg = json.loads((path / "config.json").read_text())
    tokens = 32768

    def used(kv_cache_dtype: str) -> int:
        gc.collect()
        free_before, _ = torch.cuda.mem_get_info()
        coord = stepllm.RuntimeCoordinator(
            stepllm.Config(model=str(path), device="cuda", kv_cache_tokens=tokens, kv_cache_dtype=kv_cache_dtype)
        )
        free_after, _ = torch.cuda.mem_get_info()
        del coord
        gc.collect()
        return free_before - free_after

    saved = used("auto") - used("fp8")
    # one byte saved per value: K and V of every layer, KV head and head dimension, for each token
    expected = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * tokens
    assert abs(saved - expected) < 0.05 * expected, (saved, expected)


def test_fp8_prefix_cache_hit_equals_miss(models_dir: Path) -> None:
    """A hit's tail attends over cached fp8 blocks (the paged kernel over a cached prefix): same output as a miss."""
    path = gpu_models.make("smollm2", models_dir)
    coord = coordinator(path, "cuda", graphs=True, kv_cache_dtype="fp8")
    request = stepllm.GenerationRequest(PROMPT, greedy(12))
    miss = run_alone(coord, request)
    hit = run_alone(coord, request)
    assert hit.cached_prompt_tokens == 32, hit.cached_prompt_tokens
    assert hit.output_ids == miss.output_ids
    assert_released(coord)


@pytest.mark.parametrize("name,kv_cache_dtype", [("qwen3", "auto"), ("qwen3", "fp8"), ("smollm2", "auto"), ("smollm2", "fp8"),
                                                   ("qwen2", "auto"), *((g, "auto") for g in gpu_models.GROUP_SHAPES)])
def test_tensor_core_decode_attention_matches_cuda_core_kernel(name: str, kv_cache_dtype: str, models_dir: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode attention runs on tensor cores when the cache's block size is a multiple of 16
    (kernels/attention_mma.cuh); STEPLLM_NO_MMA_ATTENTION=1 keeps it on the CUDA-core loop, the reference here.
    Twenty requests, most of them 2,200 tokens long: at this batch the Qwen3 shape's blocks walk whole contexts
    unsplit (more than one window of 32 prefetched block-table entries per warp), the SmolLM2 shape's in 3 splits;
    short prompts leave partial 16-position steps. Greedy ids must agree until the reference's first near-tie, and
    every agreed token's log-probability within the bf16 tolerance. A block size of 32 (several 16-position
    steps per cache block) must give the same ids, and a block size of 8 takes the CUDA-core loop."""
    path = gpu_models.make(name, models_dir)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    prompts = [[(13 * i + 7 * j) % (vocab - 2) + 2 for i in range(2200)] for j in range(18)] + [PROMPT[:9], PROMPT]
    reqs = [stepllm.GenerationRequest(p, greedy(8, logprobs=2)) for p in prompts]

    def run(block_size: int = 16) -> list:
        cfg = stepllm.Config(model=str(path), device="cuda", max_batch_size=24, block_size=block_size,
                             kv_cache_tokens=24 * 2304, kv_cache_dtype=kv_cache_dtype)
        coord = stepllm.RuntimeCoordinator(cfg)
        assert coord.capture_decoding_cuda_graph()
        return coord.dispatch_request(reqs)

    ours = run()
    by_32 = run(32)
    monkeypatch.setenv("STEPLLM_NO_MMA_ATTENTION", "1")
    ref = run()
    by_8 = run(8)
    for k, (g, r, g32, g8) in enumerate(zip(ours, ref, by_32, by_8)):
        what = (name, kv_cache_dtype, k, len(prompts[k]))
        assert len(g.output_ids) == len(r.output_ids) == 8, what
        assert g32.output_ids == g.output_ids, (what, "block size 32", g32.output_ids, g.output_ids)
        assert g8.output_ids == r.output_ids, (what, "block size 8", g8.output_ids, r.output_ids)
        assert_logprobs_agree_until_near_tie(g.logprobs, r.logprobs, what)
