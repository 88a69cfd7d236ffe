//! The order a decode step hands its rows to the model runner: longest context first (RuntimeStepper's
//! `forward_order`), whatever order the caller lists the residents in; and each row still gets its own token.

mod common;

use std::sync::{Arc, Mutex};

use common::*;
use stepllm_core::model::ForwardBatch;
use stepllm_core::step::{AdmissionStatus, ImmutableDecodeBatch, ImmutablePrefillBatch};
use stepllm_core::stepped::{SteppedExecution, SteppedRequest};

/// Every decode forward's past lengths, in the order the runner got its rows.
type Seen = Arc<Mutex<Vec<Vec<usize>>>>;

fn prompt(len: usize, salt: usize) -> Vec<u32> {
    (0..len).map(|i| ((i * 7 + salt * 13 + 3) % 250) as u32 + 5).collect()
}

/// Admit `prompt` as request `index + 1` and prefill it.
fn seat(stepped: &mut SteppedRequest, prompt: &[u32], new: usize, index: usize) {
    let intent = stepped.build_intent(greedy_ids(prompt, new), index as u32, index as u64 + 1).unwrap();
    let adm = stepped.admit(intent).unwrap();
    assert_eq!(adm.status, AdmissionStatus::Admitted, "{:?}", adm.reason);
    stepped.prefill(&ImmutablePrefillBatch { target: adm.resident.unwrap() }).unwrap();
}

/// Greedy ids of each prompt decoded together, each step listing the residents in slot order (here the
/// admission order, whose contexts are not sorted).
fn decode_together(prompts: &[Vec<u32>], new: usize, seen: &Seen) -> Vec<Vec<u32>> {
    let seen = seen.clone();
    let coord = watched_coordinator(Box::new(move |batch: &ForwardBatch| {
        if batch.seqs.iter().all(|s| s.len == 1) {
            seen.lock().unwrap().push(batch.seqs.iter().map(|s| s.past_len).collect());
        }
        None
    }));
    let mut stepped = coord.begin_stepped(greedy_ids(&prompts[0], new), 1, 0).unwrap();
    stepped.prefill(&ImmutablePrefillBatch { target: stepped.founder() }).unwrap();
    for (i, p) in prompts.iter().enumerate().skip(1) {
        seat(&mut stepped, p, new, i);
    }
    let mut out = vec![Vec::new(); prompts.len()];
    while !stepped.residents().unwrap().is_empty() {
        let step = stepped.decode(&ImmutableDecodeBatch { residents: stepped.residents().unwrap() }).unwrap();
        for (_, b) in &step.finished {
            out[b.identity.request_id as usize - 1] = b.output_ids.clone();
        }
    }
    stepped.finish().unwrap();
    out
}

fn decode_alone(prompt: &[u32], new: usize) -> Vec<u32> {
    let coord = coordinator("llama");
    coord.dispatch_request(vec![greedy_ids(prompt, new)]).unwrap().remove(0).output_ids
}

#[test]
fn decode_rows_reach_the_runner_longest_context_first_and_keep_their_tokens() {
    let prompts = vec![prompt(5, 0), prompt(40, 1), prompt(17, 2), prompt(26, 3)];
    let new = 6;
    let seen: Seen = Arc::default();
    let together = decode_together(&prompts, new, &seen);

    let seen = seen.lock().unwrap();
    assert!(!seen.is_empty(), "no decode forward was recorded");
    for past in seen.iter() {
        assert!(past.windows(2).all(|w| w[0] >= w[1]), "decode rows not longest first: {past:?}");
    }
    assert!(seen.iter().any(|past| past.len() == prompts.len()), "no decode step had every row: {seen:?}");
    for (i, p) in prompts.iter().enumerate() {
        assert_eq!(together[i], decode_alone(p, new), "request {i} (prompt of {} tokens) got other tokens in a batch", p.len());
    }
}
