//! StepExecution's device timing: the stepper copies each forward's `ModelRunner::last_step_timing` into the
//! step it commits (CPU runners report none), caps the wait at the step's elapsed time, and reports nothing for
//! a step that ran no forward.

mod common;

use std::time::Duration;

use common::*;
use stepllm_core::coordinator::RuntimeCoordinator;
use stepllm_core::model::{ForwardBatch, StepTiming};
use stepllm_core::step::{AdmissionStatus, ImmutableDecodeBatch, ImmutablePrefillBatch, StepExecution, StepResult};
use stepllm_core::stepped::SteppedExecution;

fn check_cpu(step: &StepResult) {
    let e = step.execution;
    assert_eq!(e.device_wait_us, 0, "a CPU runner never waits on a device: {e:?}");
    assert!(e.device_wait_us <= e.elapsed_us, "{e:?}");
    assert!(!e.cuda_graph, "{e:?}");
}

#[test]
fn cpu_steps_report_no_device_wait() {
    let coord = coordinator("llama");
    let prompt: Vec<u32> = (0..9).map(|i| (i * 11 + 5) % 300).collect();
    let mut stepped = coord.begin_stepped(greedy_ids(&prompt, 4), 1, 0).unwrap();
    let founder = stepped.residents().unwrap()[0];
    let first = stepped.prefill(&ImmutablePrefillBatch { target: founder }).unwrap();
    check_cpu(&first);
    while !stepped.residents().unwrap().is_empty() {
        let step = stepped.decode(&ImmutableDecodeBatch { residents: stepped.residents().unwrap() }).unwrap();
        assert_eq!(step.execution.rows, 1);
        check_cpu(&step);
    }
    stepped.finish().unwrap();
}

/// A CPU runner that pretends to wait on a device: each forward sleeps `wait_us` and reports it, as replayed
/// from a graph when every sequence decodes one token (as the CUDA runner does for decode).
fn pretend_coordinator(wait_us: u64) -> RuntimeCoordinator {
    watched_coordinator(Box::new(move |batch: &ForwardBatch| {
        std::thread::sleep(Duration::from_micros(wait_us));
        Some(StepTiming { device_wait_us: wait_us, cuda_graph: batch.seqs.iter().all(|s| s.len == 1), metadata_on_device: false })
    }))
}

fn host_us(e: &StepExecution) -> u64 {
    e.elapsed_us - e.device_wait_us
}

#[test]
fn steps_carry_the_runners_device_wait_and_graph_flag() {
    const WAIT: u64 = 3_000;
    let coord = pretend_coordinator(WAIT);
    let prompt: Vec<u32> = (0..9).map(|i| (i * 11 + 5) % 300).collect();
    let mut stepped = coord.begin_stepped(greedy_ids(&prompt, 3), 1, 0).unwrap();
    let founder = stepped.residents().unwrap()[0];
    let first = stepped.prefill(&ImmutablePrefillBatch { target: founder }).unwrap();
    assert_eq!(first.execution.device_wait_us, WAIT, "{:?}", first.execution);
    assert!(first.execution.elapsed_us >= WAIT, "{:?}", first.execution);
    assert!(!first.execution.cuda_graph, "a prefill is reported as the runner says: not a graph");

    let step = stepped.decode(&ImmutableDecodeBatch { residents: vec![founder] }).unwrap();
    assert_eq!(step.execution.device_wait_us, WAIT, "{:?}", step.execution);
    assert!(step.execution.cuda_graph, "the decode's graph flag comes from the runner");

    // A request cancelled before its prefill runs no forward: its prefill step reports no device time, not
    // the previous forward's.
    let intent = stepped.build_intent(greedy_ids(&prompt, 3), 1, 2).unwrap();
    let adm = stepped.admit(intent).unwrap();
    assert_eq!(adm.status, AdmissionStatus::Admitted);
    let late = adm.resident.unwrap();
    stepped.cancel(late).unwrap();
    let cancelled = stepped.prefill(&ImmutablePrefillBatch { target: late }).unwrap();
    assert_eq!(cancelled.finished.len(), 1);
    assert_eq!(cancelled.execution.device_wait_us, 0, "{:?}", cancelled.execution);
    assert!(!cancelled.execution.cuda_graph);
    stepped.abort().unwrap();
}

#[test]
fn device_wait_is_capped_at_the_steps_elapsed_time() {
    // A runner whose clock claims more wait than the step lasted (here: absurdly more) must not make the
    // host time (elapsed - device_wait) underflow.
    let coord = watched_coordinator(Box::new(|_: &ForwardBatch| Some(StepTiming { device_wait_us: u64::MAX / 2, cuda_graph: false, metadata_on_device: false })));
    let mut stepped = coord.begin_stepped(greedy_ids(&[1, 2, 3, 4, 5], 2), 1, 0).unwrap();
    let founder = stepped.founder();
    let first = stepped.prefill(&ImmutablePrefillBatch { target: founder }).unwrap();
    assert_eq!(first.execution.device_wait_us, first.execution.elapsed_us);
    assert_eq!(host_us(&first.execution), 0);
    stepped.abort().unwrap();
}
