//! Differential property test: random admit / prefill / decode / cancel / abort / finish sequences run in
//! lockstep on a TP = 1 and a TP = 2 (or 4) coordinator. Every operation must have the same outcome shape on
//! both (ok or the same error kind, admission status, residents, finished refs and reasons, delta refs), and
//! after every operation every rank must hold the invariants and the same state as rank 0.
//! Token values are not compared: sums in a different order may flip a near-tie. STEPLLM_TP_CASES sets the
//! number of cases (default 200).

mod common;

use proptest::prelude::*;
use stepllm_core::coordinator::RuntimeCoordinator;
use stepllm_core::ids::ResidentRef;
use stepllm_core::request::{GenerationRequest, Prompt, SamplingParams};
use stepllm_core::step::{ImmutableDecodeBatch, ImmutableMixedBatch, ImmutablePrefillBatch, StepResult};
use stepllm_core::stepped::{SteppedExecution, SteppedRequest};

#[derive(Debug, Clone)]
enum Op {
    Begin { prompt: Vec<u32>, max_tokens: usize },
    Admit { prompt: Vec<u32>, max_tokens: usize, temperature: f32, salt: bool },
    AdmitOutOfVocab,
    Prefill(usize),
    Decode { mask: u8 },
    Mixed { mask: u8, target: usize },
    Cancel(usize),
    Abort,
    Finish,
}

fn prompt() -> impl Strategy<Value = Vec<u32>> {
    prop::collection::vec(0u32..4, 1..24)
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => (prompt(), 1usize..8).prop_map(|(prompt, max_tokens)| Op::Begin { prompt, max_tokens }),
        4 => (prompt(), 1usize..8, prop_oneof![Just(0.0f32), Just(0.8f32)], any::<bool>())
            .prop_map(|(prompt, max_tokens, temperature, salt)| Op::Admit { prompt, max_tokens, temperature, salt }),
        1 => Just(Op::AdmitOutOfVocab),
        4 => (0usize..8).prop_map(Op::Prefill),
        6 => any::<u8>().prop_map(|mask| Op::Decode { mask }),
        2 => (any::<u8>(), 0usize..8).prop_map(|(mask, target)| Op::Mixed { mask, target }),
        1 => (0usize..8).prop_map(Op::Cancel),
        1 => Just(Op::Abort),
        1 => Just(Op::Finish),
    ]
}

fn request(prompt: Vec<u32>, max_tokens: usize, temperature: f32) -> GenerationRequest {
    let s = SamplingParams { max_tokens, temperature, seed: Some(3), ignore_eos: true, ..Default::default() };
    GenerationRequest::new(Prompt::TokenIds(prompt), s)
}

/// An operation's outcome with token values left out.
fn shape_of_step(step: &StepResult) -> String {
    let finished: Vec<_> = step.finished.iter().map(|(r, b)| (*r, b.finish_reason, b.output_ids.len())).collect();
    let deltas: Vec<_> = step.deltas.iter().map(|(r, d)| (*r, d.token_ids.len())).collect();
    format!("ok={} work={:?} finished={finished:?} deltas={deltas:?}", step.ok, step.work)
}

fn shape<T>(r: &stepllm_core::Result<T>, ok: impl Fn(&T) -> String) -> String {
    match r {
        Ok(v) => ok(v),
        Err(e) => format!("error {:?}", std::mem::discriminant(e)),
    }
}

struct Side {
    coord: RuntimeCoordinator,
    stepped: Option<SteppedRequest>,
    next_id: u64,
}

impl Side {
    fn live(&self) -> Vec<ResidentRef> {
        self.stepped.as_ref().map(|s| s.residents().unwrap()).unwrap_or_default()
    }

    fn apply(&mut self, op: &Op) -> String {
        let id = self.next_id;
        self.next_id += 1;
        let live = self.live();
        let pick = |i: usize| (!live.is_empty()).then(|| live[i % live.len()]);
        match op {
            Op::Begin { prompt, max_tokens } => {
                if self.stepped.is_some() {
                    return shape(&self.coord.begin_stepped(request(prompt.clone(), *max_tokens, 0.0), id, 0).map(|_| ()), |_| "begun".into());
                }
                let mut s = self.coord.begin_stepped(request(prompt.clone(), *max_tokens, 0.0), id, 0).unwrap();
                let first = s.prefill(&ImmutablePrefillBatch { target: s.founder() });
                self.stepped = Some(s);
                shape(&first, shape_of_step)
            }
            Op::Admit { prompt, max_tokens, temperature, salt } => {
                let Some(s) = self.stepped.as_mut() else { return "idle".into() };
                let mut req = request(prompt.clone(), *max_tokens, *temperature);
                req.cache_salt = salt.then(|| "s".to_string());
                let intent = s.build_intent(req, 0, id).unwrap();
                shape(&s.admit(intent), |a| format!("{:?} {:?}", a.status, a.resident))
            }
            Op::AdmitOutOfVocab => {
                let Some(s) = self.stepped.as_mut() else { return "idle".into() };
                shape(&s.build_intent(request(vec![1, 400], 3, 0.0), 0, id), |_| "built".into())
            }
            Op::Prefill(i) => {
                let Some(target) = pick(*i) else { return "none".into() };
                let s = self.stepped.as_mut().unwrap();
                shape(&s.prefill(&ImmutablePrefillBatch { target }), shape_of_step)
            }
            Op::Decode { mask } => {
                let Some(s) = self.stepped.as_mut() else { return "idle".into() };
                let chosen: Vec<_> = live.iter().enumerate().filter(|(i, _)| mask & (1 << (i % 8)) != 0).map(|(_, r)| *r).collect();
                shape(&s.decode(&ImmutableDecodeBatch { residents: chosen }), shape_of_step)
            }
            Op::Mixed { mask, target } => {
                let Some(target) = pick(*target) else { return "none".into() };
                let s = self.stepped.as_mut().unwrap();
                let others = live.iter().filter(|r| **r != target);
                let chosen: Vec<_> = others.enumerate().filter(|(i, _)| mask & (1 << (i % 8)) != 0).map(|(_, r)| *r).collect();
                shape(&s.mixed(&ImmutableMixedBatch { residents: chosen, targets: vec![target] }), shape_of_step)
            }
            Op::Cancel(i) => {
                let Some(r) = pick(*i) else { return "none".into() };
                shape(&self.stepped.as_mut().unwrap().cancel(r), |_| "cancelled".into())
            }
            Op::Abort => {
                let Some(mut s) = self.stepped.take() else { return "idle".into() };
                shape(&s.abort(), |_| "aborted".into())
            }
            Op::Finish => {
                let Some(s) = self.stepped.as_mut() else { return "idle".into() };
                let r = s.finish();
                if r.is_ok() {
                    self.stepped = None;
                }
                shape(&r, |resp| format!("finished {:?} {}", resp.finish_reason, resp.output_ids.len()))
            }
        }
    }
}

fn check_every_rank(side: &Side) {
    let ranks = side.coord.per_rank_state().unwrap();
    let live = side.live();
    for (rank, (c, residents)) in ranks.iter().enumerate() {
        assert_eq!(c.free_slots + c.live_slots, c.slot_capacity, "rank {rank}");
        assert_eq!(c.free_blocks + c.leased_blocks + c.cached_blocks, c.total_blocks, "rank {rank}");
        assert_eq!((c, residents), (&ranks[0].0, &ranks[0].1), "rank {rank} differs from rank 0");
        for r in residents {
            assert!(live.contains(r), "rank {rank} holds {r:?}, which the session does not report");
        }
    }
}

fn cases() -> u32 {
    std::env::var("STEPLLM_TP_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(200)
}

fn side(tp: usize) -> Side {
    let mut c = common::small_config("llama", 3, 64, 4);
    c.parallel.tensor_parallel_size = tp;
    Side { coord: RuntimeCoordinator::new(c).unwrap(), stepped: None, next_id: 1 }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), failure_persistence: None, ..ProptestConfig::default() })]
    #[test]
    fn tensor_parallel_runs_every_operation_like_a_single_rank(ops in prop::collection::vec(op(), 1..30), four in any::<bool>()) {
        let mut single = side(1);
        let mut parallel = side(if four { 4 } else { 2 });
        for op in &ops {
            let (a, b) = (single.apply(op), parallel.apply(op));
            prop_assert_eq!(&a, &b, "{:?}", op);
            check_every_rank(&parallel);
            prop_assert_eq!(single.live(), parallel.live());
            prop_assert_eq!(single.coord.counts().live_slots, parallel.coord.counts().live_slots);
        }
    }
}
