//! The stepped control plane end to end on the CPU, against transformers' greedy ids.

mod common;

use common::*;
use stepllm_core::error::Error;
use stepllm_core::request::{FinishReason, GenerationRequest, Prompt, SamplingParams};
use stepllm_core::step::{AdmissionStatus, ImmutableDecodeBatch, ImmutablePrefillBatch, StepResult};
use stepllm_core::stepped::{SteppedExecution, SteppedRequest};

/// Decode every resident until none is left; returns each finished request's output ids by request id.
fn drain(stepped: &mut SteppedRequest, out: &mut std::collections::BTreeMap<u64, Vec<u32>>) {
    while !stepped.residents().unwrap().is_empty() {
        let r = stepped.decode(&ImmutableDecodeBatch { residents: stepped.residents().unwrap() }).unwrap();
        collect(&r, out);
    }
}

fn collect(step: &StepResult, out: &mut std::collections::BTreeMap<u64, Vec<u32>>) {
    for (_, b) in &step.finished {
        out.insert(b.identity.request_id, b.output_ids.clone());
    }
}

#[test]
fn greedy_ids_match_transformers_for_every_fixture_with_a_mid_stream_admission() {
    for name in ["llama", "qwen2", "qwen3"] {
        let coord = coordinator(name);
        let rows = expected_rows(name);
        let (p0, g0) = &rows[0];
        let mut stepped = coord.begin_stepped(greedy_ids(p0, g0.len()), 1, 0).unwrap();
        let founder = stepped.residents().unwrap()[0];
        let first = stepped.prefill(&ImmutablePrefillBatch { target: founder }).unwrap();
        assert_eq!(first.deltas[0].1.token_ids.as_slice(), &[g0[0]], "{name}: founder's first token");
        let mut out = std::collections::BTreeMap::new();
        // one decode step, then admit the rest mid-stream
        let r = stepped.decode(&ImmutableDecodeBatch { residents: stepped.residents().unwrap() }).unwrap();
        collect(&r, &mut out);
        for (i, (p, g)) in rows.iter().enumerate().skip(1) {
            let intent = stepped.build_intent(greedy_ids(p, g.len()), i as u32, i as u64 + 1).unwrap();
            let adm = stepped.admit(intent).unwrap();
            assert_eq!(adm.status, AdmissionStatus::Admitted, "{name}: {:?}", adm.reason);
            let step = stepped.prefill(&ImmutablePrefillBatch { target: adm.resident.unwrap() }).unwrap();
            collect(&step, &mut out);
        }
        drain(&mut stepped, &mut out);
        let founder_response = stepped.finish().unwrap();
        assert_eq!(&founder_response.output_ids, g0, "{name}: founder");
        assert_eq!(founder_response.finish_reason, FinishReason::Length);
        for (i, (_, g)) in rows.iter().enumerate() {
            assert_eq!(&out[&(i as u64 + 1)], g, "{name}: row {i}");
        }
        assert_eq!(coord.counts().leased_blocks, 0);
        assert_eq!(coord.counts().live_slots, 0);
    }
}

#[test]
fn dispatch_request_matches_transformers() {
    let coord = coordinator("qwen2");
    let rows = expected_rows("qwen2");
    let requests = rows.iter().map(|(p, g)| greedy_ids(p, g.len())).collect();
    let responses = coord.dispatch_request(requests).unwrap();
    for ((_, g), r) in rows.iter().zip(&responses) {
        assert_eq!(&r.output_ids, g);
    }
}

#[test]
fn cache_hit_gives_the_same_greedy_output_as_a_miss() {
    let coord = coordinator("llama");
    let prompt: Vec<u32> = (0..23).map(|i| (i * 7 + 3) % 400).collect();
    let run = || coord.dispatch_request(vec![greedy_ids(&prompt, 10)]).unwrap().remove(0);
    let miss = run();
    let hit = run();
    assert_eq!(miss.cached_prompt_tokens, 0);
    assert_eq!(hit.cached_prompt_tokens, 20);
    assert_eq!(miss.output_ids, hit.output_ids);
}

#[test]
fn seeded_sampling_is_reproducible_and_independent_of_neighbours() {
    let coord = coordinator("llama");
    let sampled = |seed: u64| {
        let mut s = SamplingParams { max_tokens: 10, temperature: 1.0, seed: Some(seed), ignore_eos: true, ..Default::default() };
        s.top_p = 0.95;
        GenerationRequest::new(Prompt::TokenIds(vec![5, 6, 7]), s)
    };
    let alone = coord.dispatch_request(vec![sampled(42)]).unwrap().remove(0).output_ids;
    let crowd = coord.dispatch_request(vec![sampled(7), sampled(42), greedy_ids(&[9, 9, 9, 9], 12), sampled(1)]).unwrap();
    assert_eq!(crowd[1].output_ids, alone);
    let other = coord.dispatch_request(vec![sampled(43)]).unwrap().remove(0).output_ids;
    assert_ne!(other, alone, "different seeds should differ on a 400-token vocabulary");
}

#[test]
fn operations_in_the_wrong_order_are_protocol_errors_that_change_nothing() {
    let coord = coordinator("llama");
    let mut stepped = coord.begin_stepped(greedy_ids(&[1, 2, 3], 5), 1, 0).unwrap();
    let founder = stepped.founder();
    // decode before the founder's first token is reported
    assert!(matches!(stepped.decode(&ImmutableDecodeBatch { residents: vec![founder] }), Err(Error::Protocol(_))));
    stepped.prefill(&ImmutablePrefillBatch { target: founder }).unwrap();
    // prefill with nothing seated
    assert!(matches!(stepped.prefill(&ImmutablePrefillBatch { target: founder }), Err(Error::Protocol(_))));
    let adm = stepped.admit(stepped.build_intent(greedy_ids(&[4, 5], 3), 1, 2).unwrap()).unwrap();
    let seated = adm.resident.unwrap();
    let before = coord.counts();
    assert!(matches!(stepped.decode(&ImmutableDecodeBatch { residents: vec![founder] }), Err(Error::Protocol(_))));
    assert!(matches!(stepped.admit(stepped.build_intent(greedy_ids(&[4], 3), 2, 3).unwrap()), Err(Error::Protocol(_))));
    assert!(matches!(stepped.prefill(&ImmutablePrefillBatch { target: founder }), Err(Error::Protocol(_))));
    assert!(matches!(stepped.finish(), Err(Error::Protocol(_))));
    assert_eq!(coord.counts(), before);
    stepped.prefill(&ImmutablePrefillBatch { target: seated }).unwrap();
    // a second session cannot start while this one runs
    assert!(matches!(coord.begin_stepped(greedy_ids(&[1], 1), 9, 0), Err(Error::Protocol(_))));
    stepped.abort().unwrap();
    stepped.abort().unwrap();
    assert!(matches!(stepped.decode(&ImmutableDecodeBatch { residents: vec![seated] }), Err(Error::Protocol(_))));
    let after = coord.counts();
    assert_eq!((after.live_slots, after.leased_blocks), (0, 0));
    // stale refs are refused by a new session
    let mut again = coord.begin_stepped(greedy_ids(&[1, 2], 2), 1, 0).unwrap();
    let f = again.founder();
    again.prefill(&ImmutablePrefillBatch { target: f }).unwrap();
    assert!(matches!(again.decode(&ImmutableDecodeBatch { residents: vec![seated] }), Err(Error::StaleRef { .. })));
}

#[test]
fn stop_strings_and_max_tokens_finish_sequences() {
    let coord = coordinator("llama");
    let rows = expected_rows("llama");
    let (p, g) = &rows[0];
    let full = coord.dispatch_request(vec![greedy_ids(p, g.len())]).unwrap().remove(0);
    let text = full.output_text.clone();
    // a stop string taken from the middle of the greedy text
    let chars: Vec<char> = text.chars().collect();
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
    let mut req = greedy_ids(p, g.len());
    req.sampling.stop = vec![stop.clone()];
    let stopped = coord.dispatch_request(vec![req]).unwrap().remove(0);
    assert_eq!(stopped.finish_reason, FinishReason::Stop);
    assert_eq!(stopped.stop_reason.as_deref(), Some(stop.as_str()));
    assert!(text.starts_with(&stopped.output_text) && !stopped.output_text.contains(&stop));
    let short = coord.dispatch_request(vec![greedy_ids(p, 3)]).unwrap().remove(0);
    assert_eq!(short.output_ids, g[..3].to_vec());
    assert_eq!(short.finish_reason, FinishReason::Length);
}

#[test]
fn system_prompt_records_stay_pinned_and_are_hit() {
    let coord = coordinator("llama");
    let system: Vec<u32> = (10..30).collect();
    let cached = coord.gen_and_save_system_prompt_kv_cache(Prompt::TokenIds(system.clone())).unwrap();
    assert_eq!(cached, 20);
    assert_eq!(coord.counts().pinned_blocks, 5);
    let mut prompt = system.clone();
    prompt.extend([3, 4, 5]);
    let r = coord.dispatch_request(vec![greedy_ids(&prompt, 4)]).unwrap().remove(0);
    assert_eq!(r.cached_prompt_tokens, 20);
    let c = coord.counts();
    assert_eq!(c.free_blocks + c.leased_blocks + c.cached_blocks, c.total_blocks);
}

#[test]
fn commit_including_generated_tokens_lets_a_follow_up_hit_them() {
    use stepllm_core::state::context_cache::CommitPolicy;
    let mut config = small_config("llama", 4, 1024, 4);
    config.context_cache.commit = CommitPolicy::IncludingGenerated;
    let coord = stepllm_core::coordinator::RuntimeCoordinator::new(config).unwrap();
    let prompt: Vec<u32> = (0..9).map(|i| (i * 13 + 5) % 400).collect();
    let first = coord.dispatch_request(vec![greedy_ids(&prompt, 12)]).unwrap().remove(0);
    // the follow-up's prompt is the whole first conversation: prompt + generated tokens
    let mut follow: Vec<u32> = prompt.clone();
    follow.extend(&first.output_ids);
    let hit = coord.dispatch_request(vec![greedy_ids(&follow, 4)]).unwrap().remove(0);
    assert_eq!(hit.cached_prompt_tokens, 20, "blocks of generated tokens were published and hit");
    let plain = coordinator("llama").dispatch_request(vec![greedy_ids(&follow, 4)]).unwrap().remove(0);
    assert_eq!(plain.cached_prompt_tokens, 0);
    assert_eq!(hit.output_ids, plain.output_ids);
}

#[test]
fn max_records_bounds_the_cache_and_prefill_only_skips_generated_blocks() {
    let mut config = small_config("llama", 4, 1024, 4);
    config.context_cache.max_records = 3;
    let coord = stepllm_core::coordinator::RuntimeCoordinator::new(config).unwrap();
    let prompt: Vec<u32> = (0..30).map(|i| (i * 7 + 1) % 400).collect();
    coord.dispatch_request(vec![greedy_ids(&prompt, 12)]).unwrap();
    let c = coord.counts();
    assert_eq!(c.cached_blocks, 3, "{c:?}");
    assert_eq!(c.free_blocks + c.leased_blocks + c.cached_blocks, c.total_blocks);
    // the default commit policy (prefill only) never publishes generated tokens
    let mut follow = prompt.clone();
    follow.extend(coord.dispatch_request(vec![greedy_ids(&prompt, 12)]).unwrap().remove(0).output_ids);
    let again = coord.dispatch_request(vec![greedy_ids(&follow, 2)]).unwrap().remove(0);
    assert!(again.cached_prompt_tokens <= 28, "{}", again.cached_prompt_tokens);
}
