"""The README-style snippet from the API brief, verbatim, on the llama fixture."""

from __future__ import annotations

import textwrap

import pytest

from conftest import expected, model_dir

SNIPPET = textwrap.dedent(
    """
    import stepllm
    coord = stepllm.RuntimeCoordinator(stepllm.Config(model=MODEL_DIR, device="cpu", max_batch_size=4, kv_cache_tokens=4096))
    greedy = stepllm.SamplingParams(max_tokens=8, temperature=0.0)
    stepped = coord.begin_stepped(stepllm.GenerationRequest(prompt="The capital of France is", sampling=greedy), request_id=1)
    founder = stepped.residents()[0]
    first = stepped.prefill(stepllm.ImmutablePrefillBatch(target=founder))
    adm = stepped.admit(stepllm.GenerationRequest(prompt="Hello", sampling=greedy), original_index=1, request_id=2)
    assert adm.status == stepllm.AdmissionStatus.ADMITTED
    stepped.prefill(stepllm.ImmutablePrefillBatch(target=adm.ref))
    done = {}
    while stepped.residents():
        r = stepped.decode(stepllm.ImmutableDecodeBatch(residents=stepped.residents()))
        for ref, result in r.finished:
            done[ref] = stepped.materialize(result, stop_strings=[])
    founder_response = stepped.finish()
    print(founder_response.output_text, founder_response.output_ids, founder_response.finish_reason)
    llm = stepllm.LLM(model=MODEL_DIR, device="cpu")
    print(llm.generate(["The capital of France is"], stepllm.SamplingParams(max_tokens=16, temperature=0.0))[0].output_text)
    """
)


def run_snippet(source: str) -> dict:
    scope: dict = {"MODEL_DIR": model_dir("llama")}
    exec(compile(source, "<snippet>", "exec"), scope)
    return scope


def check_outputs(scope: dict) -> None:
    import stepllm

    rows = expected("llama")["rows"]
    # The llama fixture's first greedy token is id 0, one of its EOS ids: the founder ends at once.
    assert scope["founder_response"].output_ids == rows[0]["greedy_ids"][:1]
    assert scope["founder_response"].finish_reason == stepllm.FinishReason.EOS
    (hello,) = scope["done"].values()
    assert hello.output_ids == rows[1]["greedy_ids"][:8]
    assert hello.finish_reason == stepllm.FinishReason.LENGTH
    scope["llm"].close()


def test_snippet_verbatim() -> None:
    check_outputs(run_snippet(SNIPPET))


def test_snippet_with_founder_ref() -> None:
    """The same snippet taking the founder's ref from founder() rather than residents()[0]."""
    source = SNIPPET.replace("founder = stepped.residents()[0]", "founder = stepped.founder()")
    assert source != SNIPPET
    check_outputs(run_snippet(source))
