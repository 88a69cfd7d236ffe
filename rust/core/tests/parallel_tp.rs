//! Tensor parallelism on the CPU: TP = 2 and TP = 4 rank threads, each stepping its own shard, give the same
//! greedy ids as TP = 1 (and transformers) through the stepped API, dispatch and the engine; every rank keeps
//! the invariants; abort and a failing rank leave no rank waiting.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::*;
use stepllm_core::coordinator::RuntimeCoordinator;
use stepllm_core::engine::{EngineEvent, RequestEngine};
use stepllm_core::error::Error;
use stepllm_core::parallel::Fault;
use stepllm_core::request::FinishReason;
use stepllm_core::step::{AdmissionStatus, ImmutableDecodeBatch, ImmutablePrefillBatch, StepResult};
use stepllm_core::stepped::{SteppedExecution, SteppedRequest};

fn tp_coordinator(name: &str, tp: usize) -> RuntimeCoordinator {
    let mut c = small_config(name, 4, 1024, 4);
    c.parallel.tensor_parallel_size = tp;
    RuntimeCoordinator::new(c).expect("fixture model loads as a tensor-parallel group")
}

/// The invariants, on every rank; and every rank holds the same residents as the session reports.
fn check_every_rank(coord: &RuntimeCoordinator, stepped: Option<&SteppedRequest>) {
    let ranks = coord.per_rank_state().unwrap();
    assert_eq!(ranks.len(), coord.world_size());
    for (rank, (c, residents)) in ranks.iter().enumerate() {
        assert_eq!(c.free_slots + c.live_slots, c.slot_capacity, "rank {rank}");
        assert_eq!(c.free_blocks + c.leased_blocks + c.cached_blocks, c.total_blocks, "rank {rank}");
        assert_eq!(c.live_slots, residents.len(), "rank {rank}");
        assert_eq!(residents, &ranks[0].1, "rank {rank} residents differ from rank 0's");
        assert_eq!(c, &ranks[0].0, "rank {rank} counts differ from rank 0's");
    }
    if let Some(s) = stepped {
        let live = s.residents().unwrap();
        for r in &ranks[0].1 {
            assert!(live.contains(r));
        }
    }
}

/// After a step: every rank's own response agrees with the one returned.
fn check_rank_responses(coord: &RuntimeCoordinator, step: &StepResult) {
    assert!(coord.local_ranks_succeeded());
    if coord.world_size() == 1 {
        return;
    }
    for rank in 0..coord.world_size() {
        assert!(coord.owns_global_rank(rank));
        let mine = coord.take_rank_response(rank).expect("a step leaves a response per rank").unwrap();
        assert_eq!(mine.deltas, step.deltas, "rank {rank}");
        assert_eq!(mine.finished, step.finished, "rank {rank}");
        assert!(coord.take_rank_response(rank).is_none(), "taken once");
    }
    assert!(!coord.owns_global_rank(coord.world_size()));
}

fn collect(step: &StepResult, out: &mut BTreeMap<u64, Vec<u32>>) {
    for (_, b) in &step.finished {
        out.insert(b.identity.request_id, b.output_ids.clone());
    }
}

/// The stepped API with a mid-stream admission; returns ids by request id.
fn run_stepped(coord: &RuntimeCoordinator, rows: &[(Vec<u32>, Vec<u32>)]) -> BTreeMap<u64, Vec<u32>> {
    let (p0, g0) = &rows[0];
    let mut stepped = coord.begin_stepped(greedy_ids(p0, g0.len()), 1, 0).unwrap();
    check_every_rank(coord, Some(&stepped));
    let founder = stepped.residents().unwrap()[0];
    let mut out = BTreeMap::new();
    let first = stepped.prefill(&ImmutablePrefillBatch { target: founder }).unwrap();
    collect(&first, &mut out);
    let step = stepped.decode(&ImmutableDecodeBatch { residents: stepped.residents().unwrap() }).unwrap();
    check_rank_responses(coord, &step);
    collect(&step, &mut out);
    for (i, (p, g)) in rows.iter().enumerate().skip(1) {
        let intent = stepped.build_intent(greedy_ids(p, g.len()), i as u32, i as u64 + 1).unwrap();
        let adm = stepped.admit(intent).unwrap();
        assert_eq!(adm.status, AdmissionStatus::Admitted, "{:?}", adm.reason);
        let step = stepped.prefill(&ImmutablePrefillBatch { target: adm.resident.unwrap() }).unwrap();
        check_rank_responses(coord, &step);
        collect(&step, &mut out);
        check_every_rank(coord, Some(&stepped));
    }
    while !stepped.residents().unwrap().is_empty() {
        let step = stepped.decode(&ImmutableDecodeBatch { residents: stepped.residents().unwrap() }).unwrap();
        check_rank_responses(coord, &step);
        collect(&step, &mut out);
        check_every_rank(coord, Some(&stepped));
    }
    let founder_response = stepped.finish().unwrap();
    out.insert(1, founder_response.output_ids);
    check_every_rank(coord, None);
    let c = coord.counts();
    assert_eq!((c.live_slots, c.leased_blocks), (0, 0));
    out
}

#[test]
fn tp2_and_tp4_match_tp1_and_transformers_through_the_stepped_api() {
    for name in ["llama", "qwen2", "qwen3"] {
        let rows = expected_rows(name);
        let single = run_stepped(&coordinator(name), &rows);
        for (i, (_, g)) in rows.iter().enumerate() {
            assert_eq!(&single[&(i as u64 + 1)], g, "{name}: TP=1 row {i}");
        }
        for tp in [2, 4] {
            let coord = tp_coordinator(name, tp);
            assert_eq!(coord.world_size(), tp);
            assert!(coord.supports_stepped_execution());
            assert_eq!(run_stepped(&coord, &rows), single, "{name}: TP={tp} differs from TP=1");
        }
    }
}

#[test]
fn dispatch_and_engine_match_tp1() {
    let rows = expected_rows("qwen2");
    let requests = || rows.iter().map(|(p, g)| greedy_ids(p, g.len())).collect::<Vec<_>>();
    let single: Vec<Vec<u32>> = coordinator("qwen2").dispatch_request(requests()).unwrap().into_iter().map(|r| r.output_ids).collect();
    for tp in [2, 4] {
        let coord = tp_coordinator("qwen2", tp);
        let got: Vec<Vec<u32>> = coord.dispatch_request(requests()).unwrap().into_iter().map(|r| r.output_ids).collect();
        assert_eq!(got, single, "dispatch TP={tp}");
        check_every_rank(&coord, None);
        let mut engine = RequestEngine::new(coord).unwrap();
        let handles: Vec<_> = requests().into_iter().map(|r| engine.submit(r).unwrap()).collect();
        for (h, want) in handles.into_iter().zip(&single) {
            let finished = h
                .events
                .iter()
                .find_map(|e| match e {
                    EngineEvent::Finished(r) => Some(r),
                    _ => None,
                })
                .unwrap();
            assert_eq!(&finished.output_ids, want, "engine TP={tp}");
        }
        engine.shutdown();
    }
}

#[test]
fn abort_releases_every_rank() {
    let coord = tp_coordinator("llama", 4);
    let before = coord.per_rank_state().unwrap();
    let rows = expected_rows("llama");
    let mut stepped = coord.begin_stepped(greedy_ids(&rows[0].0, 8), 1, 0).unwrap();
    let founder = stepped.residents().unwrap()[0];
    stepped.prefill(&ImmutablePrefillBatch { target: founder }).unwrap();
    let intent = stepped.build_intent(greedy_ids(&rows[1].0, 8), 1, 2).unwrap();
    let adm = stepped.admit(intent).unwrap();
    stepped.prefill(&ImmutablePrefillBatch { target: adm.resident.unwrap() }).unwrap();
    stepped.decode(&ImmutableDecodeBatch { residents: stepped.residents().unwrap() }).unwrap();
    check_every_rank(&coord, Some(&stepped));
    stepped.abort().unwrap();
    stepped.abort().unwrap();
    assert!(stepped.residents().unwrap().is_empty());
    let after = coord.per_rank_state().unwrap();
    for ((b, _), (a, r)) in before.iter().zip(&after) {
        assert!(r.is_empty());
        assert_eq!((a.live_slots, a.leased_blocks), (b.live_slots, b.leased_blocks));
    }
    // the coordinator serves a new session afterwards
    let mut again = coord.begin_stepped(greedy_ids(&rows[0].0, 2), 1, 0).unwrap();
    again.abort().unwrap();
}

#[test]
fn a_failing_rank_fails_the_step_on_every_rank_without_hanging() {
    for failing in [0, 1, 3] {
        let coord = tp_coordinator("qwen3", 4);
        let rows = expected_rows("qwen3");
        let mut stepped = coord.begin_stepped(greedy_ids(&rows[0].0, 6), 1, 0).unwrap();
        let founder = stepped.residents().unwrap()[0];
        stepped.prefill(&ImmutablePrefillBatch { target: founder }).unwrap();
        coord.inject_rank_fault(failing, Fault::Error).unwrap();
        let started = Instant::now();
        let step = stepped.decode(&ImmutableDecodeBatch { residents: stepped.residents().unwrap() });
        assert!(started.elapsed() < Duration::from_secs(30), "a rank was left waiting");
        // The forward failed on every rank alike: the sequence ends with an error, the same on every rank.
        let step = step.unwrap();
        assert_eq!(step.finished.len(), 1);
        let (_, batch) = &step.finished[0];
        assert_eq!(batch.finish_reason, FinishReason::Error);
        assert!(batch.error.as_deref().unwrap_or_default().contains(&format!("rank {failing}")), "{:?}", batch.error);
        for rank in 0..4 {
            let mine = coord.take_rank_response(rank).unwrap().unwrap();
            assert_eq!(mine.finished, step.finished);
        }
        check_every_rank(&coord, Some(&stepped));
        assert!(stepped.residents().unwrap().is_empty());
        stepped.finish().unwrap();
        // the group recovers: the next session runs normally
        let out = run_stepped(&coord, &rows[..1]);
        assert_eq!(out[&1], rows[0].1);
    }
}

#[test]
fn a_panicking_rank_fails_the_step_and_the_group_without_hanging() {
    let coord = tp_coordinator("llama", 2);
    let rows = expected_rows("llama");
    let mut stepped = coord.begin_stepped(greedy_ids(&rows[0].0, 6), 1, 0).unwrap();
    let founder = stepped.residents().unwrap()[0];
    stepped.prefill(&ImmutablePrefillBatch { target: founder }).unwrap();
    coord.inject_rank_fault(1, Fault::Panic).unwrap();
    let started = Instant::now();
    let err = stepped.decode(&ImmutableDecodeBatch { residents: vec![founder] }).unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(30), "a rank was left waiting");
    assert!(matches!(err, Error::Device(_)), "{err}");
    assert!(err.to_string().contains("rank 1 panicked"), "{err}");
    assert!(!coord.local_ranks_succeeded());
    assert!(coord.take_rank_response(1).unwrap().is_err());
    // The ranks can no longer be trusted to agree: every later command fails at once, nothing hangs.
    assert!(stepped.decode(&ImmutableDecodeBatch { residents: vec![founder] }).is_err());
    assert!(coord.per_rank_state().is_err());
    stepped.abort().unwrap();
    drop(stepped);
    drop(coord); // joins every rank thread
}

#[test]
fn unsplittable_shapes_and_bad_parallel_configs_are_clear_errors() {
    let mut c = small_config("llama", 4, 1024, 4);
    c.parallel.tensor_parallel_size = 3;
    let err = RuntimeCoordinator::new(c).err().expect("3 does not divide 4 heads");
    assert!(matches!(err, Error::Load(_)), "{err}");
    assert!(err.to_string().contains("num_attention_heads"), "{err}");

    let mut c = small_config("llama", 4, 1024, 4);
    c.parallel.tensor_parallel_size = 2;
    c.parallel.devices = vec![0];
    assert!(matches!(RuntimeCoordinator::new(c).err(), Some(Error::InvalidRequest(_))));

    let mut c = small_config("llama", 4, 1024, 4);
    c.parallel.tensor_parallel_size = 0;
    assert!(matches!(RuntimeCoordinator::new(c).err(), Some(Error::InvalidRequest(_))));

    let single = coordinator("llama");
    assert_eq!(single.world_size(), 1);
    assert!(single.local_ranks_succeeded());
    assert!(single.take_rank_response(0).is_none());
    assert!(single.inject_rank_fault(0, Fault::Error).is_err());
}

#[test]
fn sharding_works_with_every_cpu_weight_dtype() {
    use stepllm_core::model::WeightDtype;
    let rows = expected_rows("llama");
    let requests = || rows.iter().map(|(p, g)| greedy_ids(p, g.len())).collect::<Vec<_>>();
    for dtype in [WeightDtype::Bf16, WeightDtype::Int8, WeightDtype::A8] {
        let run = |tp: usize| {
            let mut c = small_config("llama", 4, 1024, 4);
            c.parallel.tensor_parallel_size = tp;
            c.dtype = Some(dtype);
            RuntimeCoordinator::new(c).unwrap().dispatch_request(requests()).unwrap()
        };
        let single = run(1);
        let parallel = run(2);
        for (s, p) in single.iter().zip(&parallel) {
            assert_eq!(p.output_ids.len(), s.output_ids.len(), "{dtype:?}");
            assert_eq!(p.finish_reason, FinishReason::Length);
        }
        if dtype != WeightDtype::Int8 {
            // bf16 rounds each weight alone, and a8 each group of 32 along a row (activations too), so a shard
            // cut at multiples of 32 holds the same values as the whole model; int8's scale is the whole row's.
            let ids = |v: &Vec<stepllm_core::request::GenerationResponse>| v.iter().map(|r| r.output_ids.clone()).collect::<Vec<_>>();
            assert_eq!(ids(&parallel), ids(&single), "{dtype:?}");
        }
    }
}
