//! Property test: random admit / prefill / decode / cancel / abort / finish / bad-input sequences against the
//! real stepper on a tiny model, checking ARCHITECTURE.md's invariants after every operation. A step computes at
//! most PREFILL_BUDGET prompt tokens, so longer prompts are prefilled in chunks and stay seated in between.
//! PROPTEST_CASES sets the number of cases (CI runs 10,000).

mod common;

use std::collections::HashSet;

use proptest::prelude::*;
use proptest_state_machine::{prop_state_machine, ReferenceStateMachine, StateMachineTest};
use stepllm_core::coordinator::RuntimeCoordinator;
use stepllm_core::error::Error;
use stepllm_core::ids::ResidentRef;
use stepllm_core::request::{GenerationRequest, Prompt, SamplingParams};
use stepllm_core::state::PoolCounts;
use stepllm_core::step::{AdmissionStatus, ImmutableDecodeBatch, ImmutableMixedBatch, ImmutablePrefillBatch};
use stepllm_core::stepped::{SteppedExecution, SteppedRequest};

#[derive(Debug, Clone)]
enum Bad {
    EmptyPrompt,
    TokenOutOfVocab,
    ZeroMaxTokens,
    NegativeTemperature,
    TooLong,
}

#[derive(Debug, Clone)]
enum Op {
    Begin { prompt: Vec<u32>, max_tokens: usize },
    Admit { prompt: Vec<u32>, max_tokens: usize, temperature: f32, salt: bool },
    AdmitBad(Bad),
    PrefillSeated,
    PrefillOther(usize),
    Decode { mask: u8 },
    Mixed { mask: u8 },
    DecodeStale(usize),
    Cancel(usize),
    Abort,
    Finish,
}

fn prompt() -> impl Strategy<Value = Vec<u32>> {
    // few distinct tokens so prefixes repeat and the context cache gets hits
    prop::collection::vec(0u32..4, 1..30)
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => (prompt(), 1usize..10).prop_map(|(prompt, max_tokens)| Op::Begin { prompt, max_tokens }),
        4 => (prompt(), 1usize..10, prop_oneof![Just(0.0f32), Just(0.8f32)], any::<bool>())
            .prop_map(|(prompt, max_tokens, temperature, salt)| Op::Admit { prompt, max_tokens, temperature, salt }),
        1 => prop_oneof![
            Just(Bad::EmptyPrompt), Just(Bad::TokenOutOfVocab), Just(Bad::ZeroMaxTokens),
            Just(Bad::NegativeTemperature), Just(Bad::TooLong)
        ].prop_map(Op::AdmitBad),
        4 => Just(Op::PrefillSeated),
        1 => (0usize..8).prop_map(Op::PrefillOther),
        6 => any::<u8>().prop_map(|mask| Op::Decode { mask }),
        2 => any::<u8>().prop_map(|mask| Op::Mixed { mask }),
        1 => (0usize..8).prop_map(Op::DecodeStale),
        1 => (0usize..8).prop_map(Op::Cancel),
        1 => Just(Op::Abort),
        1 => Just(Op::Finish),
    ]
}

struct Reference;

impl ReferenceStateMachine for Reference {
    type State = ();
    type Transition = Op;
    fn init_state() -> BoxedStrategy<()> {
        Just(()).boxed()
    }
    fn transitions(_: &()) -> BoxedStrategy<Op> {
        op().boxed()
    }
    fn apply(_: (), _: &Op) {}
}

struct Sut {
    coord: RuntimeCoordinator,
    stepped: Option<SteppedRequest>,
    founder_reported: bool,
    seated: Option<ResidentRef>,
    live: HashSet<ResidentRef>,
    dead: Vec<ResidentRef>,
    next_id: u64,
}

const SLOTS: usize = 3;
const KV_TOKENS: usize = 64;
const PREFILL_BUDGET: usize = 8;

impl Sut {
    fn counts(&self) -> PoolCounts {
        self.coord.counts()
    }

    fn retire(&mut self, refs: impl IntoIterator<Item = ResidentRef>) {
        for r in refs {
            assert!(self.live.remove(&r), "finished ref {r:?} was not live");
            self.dead.push(r);
        }
    }

    fn request(prompt: Vec<u32>, max_tokens: usize, temperature: f32) -> GenerationRequest {
        let s = SamplingParams { max_tokens, temperature, seed: Some(3), ..Default::default() };
        GenerationRequest::new(Prompt::TokenIds(prompt), s)
    }

    fn pick_live(&self, i: usize) -> Option<ResidentRef> {
        let mut v: Vec<_> = self.live.iter().copied().collect();
        v.sort();
        (!v.is_empty()).then(|| v[i % v.len()])
    }

    fn expect_unchanged<T: std::fmt::Debug>(&self, before: PoolCounts, r: stepllm_core::Result<T>, what: &str) {
        assert!(r.is_err(), "{what} should fail, got {r:?}");
        assert_eq!(self.counts(), before, "{what} failed but changed state");
    }

    fn apply(&mut self, op: Op) {
        let before = self.counts();
        let id = self.next_id;
        self.next_id += 1;
        match op {
            Op::Begin { prompt, max_tokens } => {
                let r = self.coord.begin_stepped(Self::request(prompt, max_tokens, 0.0), id, 0);
                if self.stepped.is_some() {
                    return self.expect_unchanged(before, r.map(|_| ()), "begin while a session runs");
                }
                let s = r.expect("begin on an idle coordinator");
                let founder = s.founder();
                self.live.insert(founder);
                self.stepped = Some(s);
                self.founder_reported = false;
                let first = self.stepped.as_mut().unwrap().prefill(&ImmutablePrefillBatch { target: founder }).unwrap();
                self.founder_reported = true;
                self.retire(first.finished.iter().map(|(r, _)| *r));
            }
            Op::Admit { prompt, max_tokens, temperature, salt } => {
                let Some(s) = self.stepped.as_mut() else { return };
                let mut req = Self::request(prompt, max_tokens, temperature);
                req.cache_salt = salt.then(|| "s".to_string());
                let intent = s.build_intent(req, 0, id).expect("valid request");
                let adm = s.admit(intent);
                if self.seated.is_some() {
                    return self.expect_unchanged(before, adm, "admit while seated");
                }
                let adm = adm.unwrap();
                match adm.status {
                    AdmissionStatus::Admitted => {
                        let r = adm.resident.unwrap();
                        assert!(self.live.insert(r), "admitted ref {r:?} already live");
                        self.seated = Some(r);
                    }
                    AdmissionStatus::NoCapacity | AdmissionStatus::Rejected => {
                        assert!(adm.reason.is_some());
                        assert_eq!(self.counts(), before, "refused admission changed state");
                    }
                }
            }
            Op::AdmitBad(bad) => {
                let Some(s) = self.stepped.as_mut() else { return };
                let req = match bad {
                    Bad::EmptyPrompt => Self::request(vec![], 3, 0.0),
                    Bad::TokenOutOfVocab => Self::request(vec![1, 400], 3, 0.0),
                    Bad::ZeroMaxTokens => Self::request(vec![1], 0, 0.0),
                    Bad::NegativeTemperature => Self::request(vec![1], 3, -1.0),
                    Bad::TooLong => Self::request(vec![1; KV_TOKENS + 1], 3, 0.0),
                };
                let r = s.build_intent(req, 0, id);
                assert!(matches!(r, Err(Error::InvalidRequest(_))), "{r:?}");
                assert_eq!(self.counts(), before);
            }
            Op::PrefillSeated => {
                let Some(s) = self.stepped.as_mut() else { return };
                let Some(target) = self.seated.take() else {
                    let r = s.prefill(&ImmutablePrefillBatch { target: ResidentRef { slot: 0, epoch: 0 } });
                    return self.expect_unchanged(before, r, "prefill with nothing seated");
                };
                let step = s.prefill(&ImmutablePrefillBatch { target }).unwrap();
                let ended = step.finished.iter().any(|(r, _)| *r == target);
                // A cancelled target ends unscheduled; otherwise the step computed one chunk of its prompt.
                assert_eq!(step.participants.len(), usize::from(step.ok), "{step:?}");
                if let Some(chunk) = step.participants.first() {
                    assert!(chunk.query_length <= PREFILL_BUDGET, "{chunk:?}");
                    if !chunk.select_last_token_logits && !ended {
                        assert!(step.deltas.is_empty(), "a chunk short of the prompt's end samples nothing");
                        self.seated = Some(target);
                    }
                }
                self.retire(step.finished.iter().map(|(r, _)| *r));
            }
            Op::PrefillOther(i) => {
                let seated = self.seated;
                let picked = self.pick_live(i);
                let (Some(s), Some(target)) = (self.stepped.as_mut(), picked) else { return };
                if Some(target) == seated {
                    return;
                }
                let r = s.prefill(&ImmutablePrefillBatch { target });
                self.expect_unchanged(before, r, "prefill of a non-seated ref");
            }
            Op::Decode { mask } => {
                let Some(s) = self.stepped.as_mut() else { return };
                let mut live: Vec<_> = self.live.iter().copied().collect();
                live.sort();
                let chosen: Vec<_> = live.iter().enumerate().filter(|(i, _)| mask & (1 << (i % 8)) != 0).map(|(_, r)| *r).collect();
                let r = s.decode(&ImmutableDecodeBatch { residents: chosen.clone() });
                if chosen.is_empty() || self.seated.is_some() {
                    return self.expect_unchanged(before, r, "decode of nothing or while seated");
                }
                let step = r.unwrap();
                let finished: HashSet<_> = step.finished.iter().map(|(r, _)| *r).collect();
                for (r, d) in &step.deltas {
                    assert!(chosen.contains(r) && !finished.contains(r));
                    assert!(!d.token_ids.is_empty());
                }
                assert!(finished.iter().all(|r| chosen.contains(r)));
                self.retire(finished);
            }
            Op::Mixed { mask } => {
                let mut running: Vec<_> = self.live.iter().copied().filter(|r| Some(*r) != self.seated).collect();
                running.sort();
                let chosen: Vec<_> = running.iter().enumerate().filter(|(i, _)| mask & (1 << (i % 8)) != 0).map(|(_, r)| *r).collect();
                let targets: Vec<_> = self.seated.into_iter().collect();
                let Some(s) = self.stepped.as_mut() else { return };
                let r = s.mixed(&ImmutableMixedBatch { residents: chosen.clone(), targets: targets.clone() });
                if chosen.is_empty() || targets.is_empty() {
                    return self.expect_unchanged(before, r, "mixed step without residents or without a seated group");
                }
                let step = r.unwrap();
                self.seated = None;
                let prompt_work: Vec<_> = step.participants.iter().filter(|d| targets.contains(&d.identity.resident)).collect();
                assert!(prompt_work.iter().map(|d| d.query_length).sum::<usize>() <= PREFILL_BUDGET);
                let ended = |r: &ResidentRef| step.finished.iter().any(|(f, _)| f == r);
                if let Some(d) = prompt_work.iter().find(|d| !d.select_last_token_logits && !ended(&d.identity.resident)) {
                    self.seated = Some(d.identity.resident);
                }
                let named = |r: &ResidentRef| chosen.contains(r) || targets.contains(r);
                let finished: HashSet<_> = step.finished.iter().map(|(r, _)| *r).collect();
                for (r, d) in &step.deltas {
                    assert!(named(r) && !finished.contains(r));
                    assert!(!d.token_ids.is_empty());
                }
                assert!(finished.iter().all(named));
                self.retire(finished);
            }
            Op::DecodeStale(i) => {
                let (Some(s), false) = (self.stepped.as_mut(), self.dead.is_empty()) else { return };
                let stale = self.dead[i % self.dead.len()];
                let r = s.decode(&ImmutableDecodeBatch { residents: vec![stale] });
                assert!(matches!(r, Err(Error::StaleRef { .. }) | Err(Error::Protocol(_))), "{r:?}");
                assert_eq!(self.counts(), before);
            }
            Op::Cancel(i) => {
                let picked = self.pick_live(i);
                let (Some(s), Some(r)) = (self.stepped.as_mut(), picked) else { return };
                s.cancel(r).unwrap();
            }
            Op::Abort => {
                let Some(mut s) = self.stepped.take() else { return };
                s.abort().unwrap();
                s.abort().unwrap();
                assert!(matches!(s.decode(&ImmutableDecodeBatch { residents: vec![] }), Err(Error::Protocol(_))));
                let live: Vec<_> = self.live.drain().collect();
                self.dead.extend(live);
                self.seated = None;
                self.assert_idle();
            }
            Op::Finish => {
                let Some(s) = self.stepped.as_mut() else { return };
                let r = s.finish();
                if !self.live.is_empty() {
                    return self.expect_unchanged(before, r, "finish with residents");
                }
                r.unwrap();
                assert!(s.finish().is_err(), "finish twice");
                self.stepped = None;
                self.assert_idle();
            }
        }
    }

    fn assert_idle(&self) {
        let c = self.counts();
        assert_eq!((c.live_slots, c.leased_blocks), (0, 0), "an ended session left resources: {c:?}");
    }

    fn check(&self) {
        let c = self.counts();
        assert_eq!(c.free_slots + c.live_slots, c.slot_capacity);
        assert_eq!(c.free_blocks + c.leased_blocks + c.cached_blocks, c.total_blocks);
        assert!(c.pinned_blocks <= c.cached_blocks + c.leased_blocks);
        if let Some(s) = &self.stepped {
            assert_eq!(s.seated().unwrap(), self.seated.into_iter().collect::<Vec<_>>(), "seated() disagrees with the steps");
            let residents = s.residents().unwrap();
            let set: HashSet<_> = residents.iter().copied().collect();
            assert_eq!(set.len(), residents.len(), "a ref appears twice in residents()");
            assert_eq!(set, self.live, "residents() disagrees with what the steps reported");
            assert_eq!(c.live_slots, self.live.len());
            for d in &self.dead {
                assert!(!set.contains(d), "a finished ref is resident again");
            }
        } else {
            assert_eq!(c.live_slots, 0);
        }
    }
}

impl StateMachineTest for Sut {
    type SystemUnderTest = Self;
    type Reference = Reference;

    fn init_test(_: &()) -> Self {
        let mut config = common::small_config("llama", SLOTS, KV_TOKENS, 4);
        config.max_prefill_tokens = PREFILL_BUDGET;
        let coord = RuntimeCoordinator::new(config).unwrap();
        Sut { coord, stepped: None, founder_reported: false, seated: None, live: HashSet::new(), dead: Vec::new(), next_id: 1 }
    }

    fn apply(mut state: Self, _: &(), op: Op) -> Self {
        state.apply(op);
        state
    }

    fn check_invariants(state: &Self, _: &()) {
        state.check();
    }
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(10_000)
}

prop_state_machine! {
    #![proptest_config(ProptestConfig { cases: cases(), failure_persistence: None, ..ProptestConfig::default() })]
    #[test]
    fn stepped_runtime_keeps_its_invariants(sequential 1..30 => Sut);
}
