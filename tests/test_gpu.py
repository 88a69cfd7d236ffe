"""CUDA backend on a GPU (marker `gpu`; skipped without a GPU, torch or transformers).

Random-weight checkpoints of real shapes are made once per session (benchmarks/gpu_models.py) in
$STEPLLM_GPU_MODELS or a temporary folder. Checks: next-token log-probabilities against transformers in bf16
on the same GPU; GPU against our CPU backend; greedy agreement; CUDA-graph decode equals eager decode;
sampling options on the GPU.
"""

from __future__ import annotations

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

SHAPES = ["smollm2", "qwen3", "llama1b"]
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


def hf_logprobs(path: Path, ids: list[int]) -> "torch.Tensor":
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16).cuda().eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids], device="cuda")).logits[0].float()
    del model
    torch.cuda.empty_cache()
    return torch.log_softmax(logits, -1).cpu()


def test_device_error_is_clear_without_gpu_only_message() -> None:
    # On this machine the GPU exists; "auto" must pick it.
    info = coordinator(gpu_models.make("smollm2", Path(os.environ.get("STEPLLM_GPU_MODELS", "/tmp/gm"))), "auto").info()["device"]
    assert info.startswith("cuda"), info


def test_logprobs_match_transformers_bf16(shape: tuple[str, Path]) -> None:
    name, path = shape
    ref = hf_logprobs(path, PROMPT + [5])
    out = coordinator(path, "cuda").dispatch_request([stepllm.GenerationRequest(PROMPT, greedy(2, logprobs=20))])[0]
    lp = out.logprobs[0]
    expected = ref[len(PROMPT) - 1]
    top_ref = torch.topk(expected, 5).indices.tolist()
    assert lp.token_id == top_ref[0], (name, lp.token_id, top_ref)
    for tok, value in lp.top[:10]:
        # bf16 logits of magnitude ~L are exact to ~L/256: allow a few such steps.
        assert abs(value - expected[tok].item()) < 0.5 + 0.03 * abs(expected[tok].item()), (name, tok, value, expected[tok].item())


def test_gpu_greedy_matches_transformers(shape: tuple[str, Path]) -> None:
    import transformers

    name, path = shape
    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16).cuda().eval()
    with torch.no_grad():
        ref = model.generate(torch.tensor([PROMPT], device="cuda"), max_new_tokens=16, do_sample=False)[0, len(PROMPT):].tolist()
    del model
    out = coordinator(path, "cuda", graphs=True).dispatch_request([stepllm.GenerationRequest(PROMPT, greedy(16))])[0]
    agree = sum(a == b for a, b in zip(out.output_ids, ref))
    assert out.output_ids[:4] == ref[:4] and agree >= 12, (name, out.output_ids, ref)


@pytest.mark.parametrize("name", ["smollm2", "qwen3", "llama1b"])
def test_gpu_matches_cpu_backend(name: str, models_dir: Path) -> None:
    path = gpu_models.make(name, models_dir)
    reqs = [stepllm.GenerationRequest(PROMPT[: 10 + 7 * i], greedy(8, logprobs=5)) for i in range(3)]
    gpu = coordinator(path, "cuda").dispatch_request(reqs)
    cpu = coordinator(path, "cpu").dispatch_request(reqs)
    for g, c in zip(gpu, cpu):
        assert g.output_ids[:4] == c.output_ids[:4], (g.output_ids, c.output_ids)
        assert abs(g.logprobs[0].logprob - c.logprobs[0].logprob) < 0.5, (g.logprobs[0], c.logprobs[0])


def test_graph_decode_equals_eager(models_dir: Path) -> None:
    path = gpu_models.make("qwen3", models_dir)
    reqs = [stepllm.GenerationRequest(PROMPT[: 5 + 3 * i], greedy(24)) for i in range(6)]
    eager = coordinator(path, "cuda").dispatch_request(reqs)
    graphed = coordinator(path, "cuda", graphs=True).dispatch_request(reqs)
    assert [r.output_ids for r in eager] == [r.output_ids for r in graphed]


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
    # seeded draws do not depend on batch neighbours
    p = stepllm.SamplingParams(max_tokens=8, temperature=3.0, seed=11, ignore_eos=True)
    alone = coord.dispatch_request([stepllm.GenerationRequest(PROMPT, p)])[0].output_ids
    mixed = coord.dispatch_request([stepllm.GenerationRequest(PROMPT[:9], greedy(8)), stepllm.GenerationRequest(PROMPT, p)])
    assert mixed[1].output_ids == alone
