//! Mixed steps: running residents decode in the same forward that prefills a newly seated group. Every
//! request gets what it gets alone, on one rank and under tensor parallelism; the step refuses misuse without
//! changing anything; and the engine lets running requests keep generating while new ones join.

mod common;

use common::*;
use stepllm_core::coordinator::RuntimeCoordinator;
use stepllm_core::engine::{EngineEvent, RequestEngine};
use stepllm_core::error::Error;
use stepllm_core::ids::ResidentRef;
use stepllm_core::request::FinishReason;
use stepllm_core::step::{ImmutableDecodeBatch, ImmutableMixedBatch, ImmutablePrefillGroup, SequenceWork};

const MAX_TOKENS: usize = 6;

fn alone(name: &str) -> Vec<Vec<u32>> {
    let coord = coordinator(name);
    group_prompts().iter().map(|p| coord.dispatch_request(vec![greedy_ids(p, MAX_TOKENS)]).unwrap().remove(0).output_ids).collect()
}

/// Request 1 prefilled and decoded twice, then requests 2 and 3 seated as a group: returns the stepper's
/// running resident and the seated targets.
fn one_running_two_seated(coord: &RuntimeCoordinator) -> (ResidentRef, Vec<ResidentRef>) {
    let stepper = coord.stepper();
    let p = group_prompts();
    let a = stepper.admit_into_group(greedy_intent(coord, &p[0], MAX_TOKENS, 1)).unwrap().resident.unwrap();
    stepper.prefill_group(&ImmutablePrefillGroup { targets: vec![a] }).unwrap();
    for _ in 0..2 {
        stepper.decode(&ImmutableDecodeBatch { residents: vec![a] }).unwrap();
    }
    let targets = (1..3).map(|i| stepper.admit_into_group(greedy_intent(coord, &p[i], MAX_TOKENS, i as u64 + 1)).unwrap().resident.unwrap()).collect();
    (a, targets)
}

#[test]
fn a_mixed_step_gives_every_request_what_it_gets_alone() {
    for name in ["llama", "qwen3"] {
        let alone = alone(name);
        for tp in [1, 2] {
            let mut config = small_config(name, 4, 1024, 4);
            config.parallel.tensor_parallel_size = tp;
            let coord = RuntimeCoordinator::new(config).unwrap();
            let stepper = coord.stepper();
            let (a, targets) = one_running_two_seated(&coord);
            let step = stepper.mixed(&ImmutableMixedBatch { residents: vec![a], targets: targets.clone() }).unwrap();
            let what = format!("{name}, TP={tp}");
            assert!(step.ok, "{what}");
            assert_eq!(step.work, SequenceWork::Mixed, "{what}");
            let works: Vec<_> = step.participants.iter().map(|d| (d.identity.resident, d.work, d.query_length)).collect();
            assert_eq!(
                works,
                vec![(a, SequenceWork::Decode, 1), (targets[0], SequenceWork::Context, 5), (targets[1], SequenceWork::Context, 21)],
                "{what}"
            );
            assert_eq!((step.execution.rows, step.execution.tokens), (3, 1 + 5 + 21), "{what}");
            // The running request gets its fourth token, each new one its first.
            assert_eq!(delta_of(&step, a), Some(vec![alone[0][3]]), "{what}");
            assert_eq!(delta_of(&step, targets[0]), Some(vec![alone[1][0]]), "{what}");
            assert_eq!(delta_of(&step, targets[1]), Some(vec![alone[2][0]]), "{what}");
            decode_to_the_end_as(stepper, &alone, &what);
            assert_idle(&coord);
        }
    }
}

#[test]
fn the_mixed_step_refuses_misuse_and_changes_nothing() {
    let coord = coordinator("llama");
    let stepper = coord.stepper();
    let (a, targets) = one_running_two_seated(&coord);
    let (b, c) = (targets[0], targets[1]);
    let counts = coord.counts();
    let refused = |residents: Vec<ResidentRef>, targets: Vec<ResidentRef>| {
        let e = stepper.mixed(&ImmutableMixedBatch { residents, targets }).unwrap_err();
        assert!(matches!(e, Error::Protocol(_)), "{e}");
        e.to_string()
    };
    assert!(refused(vec![a], vec![b]).contains("exactly the seated group"));
    assert!(refused(vec![a], vec![c, b]).contains("exactly the seated group"));
    assert!(refused(vec![], vec![b, c]).contains("empty"));
    assert!(refused(vec![a, b], vec![b, c]).contains("not prefilled"));
    assert!(refused(vec![a, a], vec![b, c]).contains("twice"));
    assert_eq!(coord.counts(), counts);
    assert_eq!(stepper.seated().unwrap(), vec![b, c]);
    // The right batch still goes through; afterwards nothing is seated, so a second one is refused.
    stepper.mixed(&ImmutableMixedBatch { residents: vec![a], targets: vec![b, c] }).unwrap();
    assert!(refused(vec![a], vec![b, c]).contains("nothing is seated"));
    decode_to_the_end(stepper);
    assert_idle(&coord);
}

#[test]
fn a_cancelled_resident_finishes_cancelled_in_a_mixed_step() {
    let coord = coordinator("llama");
    let stepper = coord.stepper();
    let (a, targets) = one_running_two_seated(&coord);
    stepper.cancel(a).unwrap();
    let step = stepper.mixed(&ImmutableMixedBatch { residents: vec![a], targets: targets.clone() }).unwrap();
    assert!(step.ok);
    assert_eq!(step.finished.len(), 1);
    assert_eq!((step.finished[0].0, step.finished[0].1.finish_reason), (a, FinishReason::Cancelled));
    assert_eq!(step.finished[0].1.output_ids.len(), 3, "no token was computed for the cancelled resident");
    let mut got: Vec<_> = step.deltas.iter().map(|(r, _)| *r).collect();
    got.sort();
    let mut want = targets.clone();
    want.sort();
    assert_eq!(got, want);
    assert_eq!(step.participants.len(), 2, "the cancelled resident was not scheduled");
    decode_to_the_end(stepper);
    assert_idle(&coord);
}

/// A request submitted while another runs joins through a mixed step: the running one gets a token in that
/// tick too, so the whole run takes exactly as many ticks as the longer request has tokens.
#[test]
fn the_engine_keeps_running_requests_generating_while_new_ones_join() {
    let long: Vec<u32> = (0..9).map(|i| (i * 13 + 5) % 400).collect();
    let short = group_prompts()[1].clone();
    let coord = coordinator("llama");
    let want_long = coord.dispatch_request(vec![greedy_ids(&long, 200)]).unwrap().remove(0).output_ids;
    let want_short = coord.dispatch_request(vec![greedy_ids(&short, 3)]).unwrap().remove(0).output_ids;
    let mut engine = RequestEngine::new(coordinator("llama")).unwrap();
    let first = engine.submit(greedy_ids(&long, 200)).unwrap();
    assert!(matches!(first.events.recv().unwrap(), EngineEvent::Delta(_)), "the long request is running");
    let second = engine.submit(greedy_ids(&short, 3)).unwrap();
    let finished = |h: stepllm_core::engine::RequestHandle| {
        h.events.iter().find_map(|e| match e {
            EngineEvent::Finished(r) => Some(r),
            _ => None,
        })
    };
    assert_eq!(finished(second).unwrap().output_ids, want_short);
    assert_eq!(finished(first).unwrap().output_ids, want_long);
    assert_eq!(engine.stats().steps, 200, "one tick per token of the long request: the short one joined in a mixed step");
    engine.shutdown();
}
