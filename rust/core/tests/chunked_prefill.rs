//! Chunked prefill: a prompt longer than `max_prefill_tokens` is computed one chunk per step and stays seated
//! until the chunk that samples its first token. Every request gets what it gets with its prompt computed
//! whole, on one rank and under tensor parallelism; running requests keep decoding in the chunks' forwards; a
//! cancel mid-prompt releases everything; the chunks publish their blocks to the prefix cache; and prompt
//! logprobs scored chunk by chunk come whole with the request's first delta.

mod common;

use common::*;
use stepllm_core::coordinator::RuntimeCoordinator;
use stepllm_core::engine::{EngineEvent, RequestEngine, RequestHandle};
use stepllm_core::ids::ResidentRef;
use stepllm_core::request::{FinishReason, GenerationRequest, GenerationResponse};
use stepllm_core::stepped::SteppedExecution;
use stepllm_core::step::{ImmutableDecodeBatch, ImmutableMixedBatch, ImmutablePrefillBatch, SequenceWork, StepResult, TokenDelta};

const BUDGET: usize = 7;
const MAX_TOKENS: usize = 6;

/// 40 tokens: five chunks of 7 and one of 5 at the budget above.
fn long_prompt() -> Vec<u32> {
    (0..40).map(|i| (i * 29 + 11) % 400).collect()
}

fn chunked_coordinator(name: &str, tp: usize) -> RuntimeCoordinator {
    let mut config = small_config(name, 4, 1024, 4);
    config.max_prefill_tokens = BUDGET;
    config.parallel.tensor_parallel_size = tp;
    RuntimeCoordinator::new(config).unwrap()
}

fn whole(name: &str, prompt: &[u32], max_tokens: usize) -> Vec<u32> {
    coordinator(name).dispatch_request(vec![greedy_ids(prompt, max_tokens)]).unwrap().remove(0).output_ids
}

/// (query_length, past_length, select_last_token_logits) of the step's prefill participant `r`.
fn chunk_of(step: &StepResult, r: ResidentRef) -> (usize, usize, bool) {
    let d = step.participants.iter().find(|d| d.identity.resident == r).expect("a participant");
    assert_eq!(d.work, SequenceWork::Context);
    (d.query_length, d.past_length, d.select_last_token_logits)
}

#[test]
fn a_long_prompt_is_prefilled_in_chunks_and_gets_what_it_gets_whole() {
    let prompt = long_prompt();
    for name in ["llama", "qwen3"] {
        let want = whole(name, &prompt, MAX_TOKENS);
        for tp in [1, 2] {
            let what = format!("{name}, TP={tp}");
            let coord = chunked_coordinator(name, tp);
            let stepper = coord.stepper();
            let target = stepper.admit(greedy_intent(&coord, &prompt, MAX_TOKENS, 1)).unwrap().resident.unwrap();
            let mut chunks = Vec::new();
            loop {
                let step = stepper.prefill(&ImmutablePrefillBatch { target }).unwrap();
                assert!(step.ok, "{what}");
                assert_eq!(step.work, SequenceWork::Context, "{what}");
                let chunk = chunk_of(&step, target);
                chunks.push(chunk);
                assert_eq!(step.execution.tokens, chunk.0, "{what}");
                if !chunk.2 {
                    assert_eq!(delta_of(&step, target), None, "{what}: a chunk short of the prompt's end samples nothing");
                    assert_eq!(stepper.seated().unwrap(), vec![target], "{what}: the prompt stays seated");
                    let e = stepper.decode(&ImmutableDecodeBatch { residents: vec![target] }).unwrap_err();
                    assert!(e.to_string().contains("must be prefilled first"), "{what}: {e}");
                    continue;
                }
                assert_eq!(delta_of(&step, target), Some(vec![want[0]]), "{what}: the last chunk samples the first token");
                assert!(stepper.seated().unwrap().is_empty(), "{what}");
                break;
            }
            assert_eq!(
                chunks,
                vec![(7, 0, false), (7, 7, false), (7, 14, false), (7, 21, false), (7, 28, false), (5, 35, true)],
                "{what}"
            );
            let outputs = decode_to_the_end(stepper);
            assert_eq!(outputs[&1], want, "{what}");
            assert_idle(&coord);
        }
    }
}

/// One budget is shared by a group in admission order: the first prompt's chunks come first, and a prompt
/// starts in the step where the one before it ends, if budget is left.
#[test]
fn a_group_shares_the_budget_in_admission_order() {
    let prompts = [long_prompt()[..10].to_vec(), group_prompts()[1].clone(), group_prompts()[0].clone()]; // 10, 5, 13
    let coord = chunked_coordinator("llama", 1);
    let stepper = coord.stepper();
    let targets: Vec<_> =
        prompts.iter().enumerate().map(|(i, p)| stepper.admit_into_group(greedy_intent(&coord, p, MAX_TOKENS, i as u64 + 1)).unwrap().resident.unwrap()).collect();
    let mut steps = Vec::new();
    while !stepper.seated().unwrap().is_empty() {
        let group = stepper.seated().unwrap();
        let step = stepper.prefill_group(&stepllm_core::step::ImmutablePrefillGroup { targets: group }).unwrap();
        let chunks: Vec<_> = targets.iter().filter(|r| step.participants.iter().any(|d| d.identity.resident == **r)).map(|&r| chunk_of(&step, r)).collect();
        assert!(chunks.iter().map(|c| c.0).sum::<usize>() <= BUDGET);
        steps.push(chunks);
    }
    assert_eq!(
        steps,
        vec![
            vec![(7, 0, false)],
            vec![(3, 7, true), (4, 0, false)],
            vec![(1, 4, true), (6, 0, false)],
            vec![(7, 6, true)],
        ]
    );
    let want: Vec<_> = prompts.iter().map(|p| whole("llama", p, MAX_TOKENS)).collect();
    decode_to_the_end_as(stepper, &want, "group");
    assert_idle(&coord);
}

#[test]
fn running_requests_decode_in_every_chunk_of_a_mixed_step() {
    let short = group_prompts()[1].clone();
    let prompt = long_prompt();
    for tp in [1, 2] {
        let coord = chunked_coordinator("qwen3", tp);
        let stepper = coord.stepper();
        let a = stepper.admit(greedy_intent(&coord, &short, 20, 1)).unwrap().resident.unwrap();
        stepper.prefill(&ImmutablePrefillBatch { target: a }).unwrap();
        let b = stepper.admit_into_group(greedy_intent(&coord, &prompt, MAX_TOKENS, 2)).unwrap().resident.unwrap();
        let mut a_tokens = 1;
        while !stepper.seated().unwrap().is_empty() {
            let step = stepper.mixed(&ImmutableMixedBatch { residents: vec![a], targets: vec![b] }).unwrap();
            assert_eq!(step.work, SequenceWork::Mixed);
            assert_eq!(delta_of(&step, a).map(|t| t.len()), Some(1), "TP={tp}: the running request gets a token in every chunk");
            a_tokens += 1;
            assert_eq!(delta_of(&step, b).is_some(), chunk_of(&step, b).2, "TP={tp}");
        }
        assert_eq!(a_tokens, 7, "TP={tp}: six chunks");
        decode_to_the_end_as(stepper, &[whole("qwen3", &short, 20), whole("qwen3", &prompt, MAX_TOKENS)], &format!("TP={tp}"));
        assert_idle(&coord);
    }
}

#[test]
fn a_cancel_between_chunks_ends_the_prompt_and_releases_everything() {
    let coord = chunked_coordinator("llama", 1);
    let stepper = coord.stepper();
    let target = stepper.admit(greedy_intent(&coord, &long_prompt(), MAX_TOKENS, 1)).unwrap().resident.unwrap();
    for _ in 0..2 {
        stepper.prefill(&ImmutablePrefillBatch { target }).unwrap();
    }
    stepper.cancel(target).unwrap();
    let step = stepper.prefill(&ImmutablePrefillBatch { target }).unwrap();
    assert!(!step.ok, "nothing ran");
    assert_eq!(step.finished.len(), 1);
    assert_eq!((step.finished[0].0, step.finished[0].1.finish_reason), (target, FinishReason::Cancelled));
    assert!(step.finished[0].1.output_ids.is_empty());
    assert!(stepper.seated().unwrap().is_empty());
    assert!(stepper.prefill(&ImmutablePrefillBatch { target }).is_err(), "the released ref is stale");
    assert_idle(&coord);
}

/// Each chunk publishes the full blocks it computed, so the same prompt later hits as much of the cache as
/// after a whole-prompt prefill.
#[test]
fn chunks_publish_their_blocks_to_the_prefix_cache() {
    let prompt = long_prompt();
    let cached_on_second_run = |coord: &RuntimeCoordinator| {
        let run = || coord.dispatch_request(vec![greedy_ids(&prompt, MAX_TOKENS)]).unwrap().remove(0);
        let first = run();
        let second = run();
        assert_eq!(first.output_ids, second.output_ids);
        second.cached_prompt_tokens
    };
    let whole_cached = cached_on_second_run(&coordinator("llama"));
    assert!(whole_cached >= 32, "{whole_cached}");
    let coord = chunked_coordinator("llama", 1);
    let stepper = coord.stepper();
    let target = stepper.admit(greedy_intent(&coord, &prompt, MAX_TOKENS, 1)).unwrap().resident.unwrap();
    let step = stepper.prefill(&ImmutablePrefillBatch { target }).unwrap();
    assert!(step.published_prefix, "the first chunk (7 tokens) fills a block of 4");
    stepper.abort_all();
    assert_eq!(cached_on_second_run(&coord), whole_cached);
}

#[test]
fn a_stepped_founder_with_a_long_prompt_reports_its_first_token_once() {
    let prompt = long_prompt();
    let want = whole("llama", &prompt, MAX_TOKENS);
    let coord = chunked_coordinator("llama", 1);
    let mut stepped = coord.begin_stepped(greedy_ids(&prompt, MAX_TOKENS), 1, 0).unwrap();
    let founder = stepped.founder();
    let first = stepped.prefill(&ImmutablePrefillBatch { target: founder }).unwrap();
    assert_eq!(delta_of(&first, founder), Some(vec![want[0]]));
    assert_eq!(chunk_of(&first, founder), (5, 35, true), "the step reported is the last chunk's");
    assert!(first.published_prefix, "earlier chunks published blocks");
    while !stepped.residents().unwrap().is_empty() {
        stepped.decode(&ImmutableDecodeBatch { residents: stepped.residents().unwrap() }).unwrap();
    }
    assert_eq!(stepped.finish().unwrap().output_ids, want);
    assert_idle(&coord);
}

fn finished(h: RequestHandle) -> GenerationResponse {
    h.events
        .iter()
        .find_map(|e| match e {
            EngineEvent::Finished(r) => Some(r),
            _ => None,
        })
        .expect("the request finishes")
}

/// A long prompt submitted while another request runs is computed in chunks, each in a mixed step with the
/// running request's next token: the run takes exactly as many ticks as the running request has tokens.
#[test]
fn the_engine_chunks_a_long_prompt_while_running_requests_keep_generating() {
    let running = group_prompts()[1].clone(); // 5 tokens: one chunk
    let prompt = long_prompt();
    let want_running = whole("llama", &running, 60);
    let want_long = whole("llama", &prompt, 3);
    let mut engine = RequestEngine::new(chunked_coordinator("llama", 1)).unwrap();
    let first = engine.submit(greedy_ids(&running, 60)).unwrap();
    assert!(matches!(first.events.recv().unwrap(), EngineEvent::Delta(_)), "the first request is running");
    let second = engine.submit(greedy_ids(&prompt, 3)).unwrap();
    assert_eq!(finished(second).output_ids, want_long);
    assert_eq!(finished(first).output_ids, want_running);
    assert_eq!(engine.stats().steps, 60, "one tick per token of the running request: every chunk rode a decode step");
    engine.shutdown();
}

/// A system prompt saved to the cache is computed in chunks of the budget as well; a request after it hits its
/// blocks and gets what it gets with nothing cached.
#[test]
fn a_system_prompt_is_computed_in_chunks_too() {
    use stepllm_core::request::Prompt;
    let system: Vec<u32> = (0..26).map(|i| (i * 17 + 9) % 400).collect();
    let coord = chunked_coordinator("llama", 1);
    assert_eq!(coord.gen_and_save_system_prompt_kv_cache(Prompt::TokenIds(system.clone())).unwrap(), 24);
    assert_eq!(coord.counts().pinned_blocks, 6);
    let mut prompt = system.clone();
    prompt.extend([3, 4, 5]);
    let hit = coord.dispatch_request(vec![greedy_ids(&prompt, MAX_TOKENS)]).unwrap().remove(0);
    assert_eq!(hit.cached_prompt_tokens, 24);
    assert_eq!(hit.output_ids, whole("llama", &prompt, MAX_TOKENS));
}

fn with_prompt_logprobs(prompt: &[u32], max_tokens: usize) -> GenerationRequest {
    let mut request = greedy_ids(prompt, max_tokens);
    request.sampling.prompt_logprobs = Some(2);
    request
}

/// A request's stream: its deltas, then its response.
fn deltas_and_response(h: RequestHandle) -> (Vec<TokenDelta>, GenerationResponse) {
    let mut deltas = Vec::new();
    for event in h.events.iter() {
        match event {
            EngineEvent::Delta(d) => deltas.push(d),
            EngineEvent::Finished(r) => return (deltas, r),
        }
    }
    panic!("the stream ended without a response")
}

/// The prompt logprobs come whole with a request's first delta (so a stream can send an echoed prompt's logprobs
/// before its tokens) and with no other, equal to the finished result's: with the prompt in chunks or whole, and
/// from the engine, where a request that ends in the step of its first token streams its tail as that delta.
#[test]
fn prompt_logprobs_come_whole_with_the_first_delta_only() {
    let prompt = long_prompt();
    for (what, coord) in [("chunked", chunked_coordinator("llama", 1)), ("whole", coordinator("llama"))] {
        let stepper = coord.stepper();
        let intent = coord.intents().build(with_prompt_logprobs(&prompt, MAX_TOKENS), 1, 0).unwrap();
        let target = stepper.admit(intent).unwrap().resident.unwrap();
        let mut deltas = Vec::new();
        let result = loop {
            let step = if stepper.seated().unwrap().is_empty() {
                stepper.decode(&ImmutableDecodeBatch { residents: vec![target] }).unwrap()
            } else {
                stepper.prefill(&ImmutablePrefillBatch { target }).unwrap()
            };
            deltas.extend(step.deltas.into_iter().map(|(_, d)| d));
            if let Some((_, result)) = step.finished.into_iter().next() {
                break result;
            }
        };
        let want = result.prompt_logprobs.expect("asked for");
        assert_eq!(want.len(), prompt.len(), "{what}");
        assert!(want[0].is_none() && want[1..].iter().all(Option::is_some), "{what}");
        assert_eq!(deltas.len(), MAX_TOKENS - 1, "{what}: the last token comes with the result");
        assert_eq!(deltas[0].prompt_logprobs.as_ref(), Some(&want), "{what}");
        assert!(deltas[1..].iter().all(|d| d.prompt_logprobs.is_none()), "{what}");
        assert_idle(&coord);
    }
    let mut engine = RequestEngine::new(chunked_coordinator("llama", 1)).unwrap();
    for max_tokens in [MAX_TOKENS, 1] {
        let asked = engine.submit(with_prompt_logprobs(&prompt, max_tokens)).unwrap();
        let plain = engine.submit(greedy_ids(&prompt, max_tokens)).unwrap();
        let (deltas, response) = deltas_and_response(asked);
        assert_eq!(deltas.iter().map(|d| d.token_ids.len()).sum::<usize>(), max_tokens);
        assert!(response.prompt_logprobs.as_ref().is_some_and(|l| l.len() == prompt.len()), "max_tokens {max_tokens}");
        assert_eq!(deltas[0].prompt_logprobs, response.prompt_logprobs, "max_tokens {max_tokens}");
        assert!(deltas[1..].iter().all(|d| d.prompt_logprobs.is_none()), "max_tokens {max_tokens}");
        let (deltas, response) = deltas_and_response(plain);
        assert!(response.prompt_logprobs.is_none() && deltas.iter().all(|d| d.prompt_logprobs.is_none()));
    }
    engine.shutdown();
}
