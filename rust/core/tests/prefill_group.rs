//! Batched prefill: several admitted requests prefilled in one forward give what each gives alone, the group
//! protocol refuses misuse without changing anything, and the schedulers respect the token budget.

mod common;

use std::collections::VecDeque;

use common::*;
use stepllm_core::coordinator::RuntimeCoordinator;
use stepllm_core::error::Error;
use stepllm_core::prefill_group::seat_prefill_group;
use stepllm_core::request::FinishReason;
use stepllm_core::step::{
    AdmissionIntent, ImmutableDecodeBatch, ImmutablePrefillBatch, ImmutablePrefillGroup, SequenceWork,
};
use stepllm_core::stepper_handle::StepperHandle;

fn is_protocol(e: Error) -> bool {
    matches!(e, Error::Protocol(_))
}

#[test]
fn a_group_prefill_gives_each_request_what_it_gets_alone() {
    for name in ["llama", "qwen3"] {
        let coord = coordinator(name);
        let mut alone = Vec::new();
        for (i, p) in group_prompts().iter().enumerate() {
            alone.push(coord.dispatch_request(vec![greedy_ids(p, 6)]).unwrap().remove(0).output_ids);
            assert_eq!(alone[i].len(), 6);
        }
        // A different coordinator so no prefix is cached: the group computes every prompt in full.
        let coord = coordinator(name);
        let stepper2 = coord.stepper();
        let targets: Vec<_> = group_prompts()
            .iter()
            .enumerate()
            .map(|(i, p)| stepper2.admit_into_group(greedy_intent(&coord, p, 6, i as u64 + 1)).unwrap().resident.unwrap())
            .collect();
        assert_eq!(stepper2.seated().unwrap(), targets);
        let step = stepper2.prefill_group(&ImmutablePrefillGroup { targets: targets.clone() }).unwrap();
        assert!(step.ok);
        assert_eq!(step.work, SequenceWork::Context);
        assert_eq!(step.participants.len(), 3);
        assert_eq!(step.execution.rows, 3);
        assert_eq!(step.execution.tokens, 13 + 5 + 21);
        for (i, r) in targets.iter().enumerate() {
            assert_eq!(delta_of(&step, *r), Some(vec![alone[i][0]]), "{name}: first token of request {i}");
        }
        decode_to_the_end_as(stepper2, &alone, name);
        assert_idle(&coord);
    }
}

#[test]
fn the_group_protocol_refuses_misuse_and_changes_nothing() {
    let coord = coordinator("llama");
    let stepper: &StepperHandle = coord.stepper();
    let p = group_prompts();
    let a = stepper.admit_into_group(greedy_intent(&coord, &p[0], 3, 1)).unwrap().resident.unwrap();
    let b = stepper.admit_into_group(greedy_intent(&coord, &p[1], 3, 2)).unwrap().resident.unwrap();
    let counts = coord.counts();
    // The seed's single-target prefill, a seed admit, a decode, a wrong or partial group: all refused.
    assert!(is_protocol(stepper.prefill(&ImmutablePrefillBatch { target: a }).unwrap_err()));
    assert!(is_protocol(stepper.admit(greedy_intent(&coord, &p[2], 3, 3)).unwrap_err()));
    assert!(is_protocol(stepper.decode(&ImmutableDecodeBatch { residents: vec![a, b] }).unwrap_err()));
    assert!(is_protocol(stepper.prefill_group(&ImmutablePrefillGroup { targets: vec![a] }).unwrap_err()));
    assert!(is_protocol(stepper.prefill_group(&ImmutablePrefillGroup { targets: vec![b, a] }).unwrap_err()));
    assert_eq!(coord.counts(), counts);
    // The right group still goes through, and everything is released at the end.
    let step = stepper.prefill_group(&ImmutablePrefillGroup { targets: vec![a, b] }).unwrap();
    assert_eq!(step.participants.len(), 2);
    assert!(is_protocol(stepper.prefill_group(&ImmutablePrefillGroup { targets: vec![a, b] }).unwrap_err()));
    decode_to_the_end(stepper);
    assert_idle(&coord);
}

#[test]
fn a_group_of_one_is_the_seed_protocol() {
    let coord = coordinator("llama");
    let stepper = coord.stepper();
    let r = stepper.admit_into_group(greedy_intent(&coord, &group_prompts()[0], 2, 1)).unwrap().resident.unwrap();
    let step = stepper.prefill(&ImmutablePrefillBatch { target: r }).unwrap();
    assert_eq!(step.participants.len(), 1);
    stepper.decode(&ImmutableDecodeBatch { residents: vec![r] }).unwrap();
    assert_idle(&coord);
}

#[test]
fn a_cancelled_member_finishes_cancelled_while_the_rest_are_prefilled() {
    let coord = coordinator("llama");
    let stepper = coord.stepper();
    let p = group_prompts();
    let a = stepper.admit_into_group(greedy_intent(&coord, &p[0], 3, 1)).unwrap().resident.unwrap();
    let b = stepper.admit_into_group(greedy_intent(&coord, &p[1], 3, 2)).unwrap().resident.unwrap();
    stepper.cancel(a).unwrap();
    let step = stepper.prefill_group(&ImmutablePrefillGroup { targets: vec![a, b] }).unwrap();
    assert!(step.ok);
    assert_eq!(step.finished.len(), 1);
    assert_eq!(step.finished[0].0, a);
    assert_eq!(step.finished[0].1.finish_reason, FinishReason::Cancelled);
    assert_eq!(step.deltas.len(), 1);
    assert_eq!(step.deltas[0].0, b);
    decode_to_the_end(stepper);
    assert_idle(&coord);
}

#[test]
fn seating_stops_at_the_token_budget_and_at_no_capacity_but_passes_rejections() {
    let coord = RuntimeCoordinator::new(small_config("llama", 4, 128, 4)).unwrap(); // 4 slots, 128 KV tokens
    let stepper = coord.stepper();
    let p = group_prompts(); // 13, 5 and 21 tokens
    let too_long = greedy_intent(&coord, &p[0], 200, 9); // can never fit the KV cache: rejected at admission
    let mut waiting: VecDeque<AdmissionIntent> =
        vec![too_long, greedy_intent(&coord, &p[0], 3, 1), greedy_intent(&coord, &p[1], 3, 2), greedy_intent(&coord, &p[2], 3, 3)].into();
    let (mut admitted, mut rejected) = (Vec::new(), Vec::new());
    let group = seat_prefill_group(stepper, &mut waiting, |i| i, 18, |i, r| admitted.push((i.request_id, r)), |i, why| {
        rejected.push((i.request_id, why))
    })
    .unwrap();
    // 13 + 5 fit the budget of 18; the 21-token prompt waits for the next group.
    assert_eq!(admitted.iter().map(|(id, _)| *id).collect::<Vec<_>>(), vec![1, 2]);
    assert_eq!(group.targets, admitted.iter().map(|(_, r)| *r).collect::<Vec<_>>());
    assert_eq!(rejected.len(), 1);
    assert_eq!(rejected[0].0, 9);
    assert!(rejected[0].1.as_deref().unwrap_or("").contains("KV"), "{:?}", rejected[0].1);
    assert_eq!(waiting.len(), 1);
    stepper.prefill_group(&ImmutablePrefillGroup { targets: group.targets }).unwrap();
    // A prompt longer than the whole budget still goes, alone.
    let group = seat_prefill_group(stepper, &mut waiting, |i| i, 4, |_, _| {}, |_, _| {}).unwrap();
    assert_eq!(group.targets.len(), 1);
    assert!(waiting.is_empty());
    stepper.prefill_group(&ImmutablePrefillGroup { targets: group.targets }).unwrap();
    // The fourth slot takes one more; the fifth request finds no slot and stays queued, refused at the head.
    waiting.extend([greedy_intent(&coord, &p[1], 3, 4), greedy_intent(&coord, &p[1], 3, 5)]);
    let group = seat_prefill_group(stepper, &mut waiting, |i| i, 1000, |_, _| {}, |_, _| {}).unwrap();
    assert_eq!(group.targets.len(), 1);
    assert_eq!(group.head_refused, None);
    stepper.prefill_group(&ImmutablePrefillGroup { targets: group.targets }).unwrap();
    let group = seat_prefill_group(stepper, &mut waiting, |i| i, 1000, |_, _| {}, |_, _| {}).unwrap();
    assert!(group.targets.is_empty());
    assert!(group.head_refused.is_some());
    assert_eq!(waiting.len(), 1);
    decode_to_the_end(stepper);
    assert_idle(&coord);
}

#[test]
fn dispatch_gives_the_same_outputs_whatever_the_prefill_budget() {
    let rows = expected_rows("qwen2");
    let requests = || rows.iter().map(|(p, g)| greedy_ids(p, g.len())).collect::<Vec<_>>();
    for budget in [1, 16, 8192] {
        let mut config = small_config("qwen2", 4, 1024, 4);
        config.max_prefill_tokens = budget;
        let coord = RuntimeCoordinator::new(config).unwrap();
        let responses = coord.dispatch_request(requests()).unwrap();
        for ((_, g), r) in rows.iter().zip(&responses) {
            assert_eq!(&r.output_ids, g, "budget {budget}");
        }
        assert_idle(&coord);
    }
}

#[test]
fn max_prefill_tokens_zero_is_refused() {
    let mut config = small_config("qwen2", 4, 1024, 4);
    config.max_prefill_tokens = 0;
    let err = RuntimeCoordinator::new(config).err().expect("refused");
    assert!(err.to_string().contains("max_prefill_tokens"), "{err}");
}
