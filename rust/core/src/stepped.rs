//! SteppedExecution and its single-rank implementation, SteppedRequest: a founder request begun by the
//! coordinator, more requests admitted while it runs, and one operation per tick until none is resident.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::stepper_handle::StepperHandle;

use crate::error::{protocol, Error, Result};
use crate::ids::{RequestId, ResidentRef};
use crate::intent::IntentBuilder;
use crate::request::{GenerationRequest, GenerationResponse};
use crate::step::{
    AdmissionIntent, AdmissionResult, AdmissionStatus, BatchResult, ImmutableDecodeBatch, ImmutableMixedBatch,
    ImmutablePrefillBatch, ImmutablePrefillGroup, StepResult,
};
use crate::stepper::RuntimeStepper;
use crate::text::stop::truncate_at_stop;

/// The stepped control plane as the scheduler sees it.
pub trait SteppedExecution {
    /// Stage 1 of admission: validate and tokenize; touches no resident state.
    fn build_intent(&self, request: GenerationRequest, original_index: u32, request_id: RequestId) -> Result<AdmissionIntent>;
    /// Stages 2 and 3: reserve (refusable) and seat. An admitted sequence's prefill must be the next operation.
    fn admit(&mut self, intent: AdmissionIntent) -> Result<AdmissionResult>;
    /// Compute the seated target's prompt and sample its first token. A prompt longer than
    /// `Config::max_prefill_tokens` takes one chunk per call and stays seated until the last one.
    fn prefill(&mut self, batch: &ImmutablePrefillBatch) -> Result<StepResult>;
    /// Beyond the seed: admit while other admitted requests still wait for their prefill; one `prefill_group`
    /// tick then computes the whole seated group (admission order) in one forward.
    fn admit_into_group(&mut self, intent: AdmissionIntent) -> Result<AdmissionResult>;
    /// [`build_intent`](Self::build_intent) then [`admit`](Self::admit).
    fn admit_request(&mut self, request: GenerationRequest, original_index: u32, request_id: RequestId) -> Result<AdmissionResult> {
        let intent = self.build_intent(request, original_index, request_id)?;
        self.admit(intent)
    }
    /// [`build_intent`](Self::build_intent) then [`admit_into_group`](Self::admit_into_group).
    fn admit_request_into_group(
        &mut self,
        request: GenerationRequest,
        original_index: u32,
        request_id: RequestId,
    ) -> Result<AdmissionResult> {
        let intent = self.build_intent(request, original_index, request_id)?;
        self.admit_into_group(intent)
    }
    fn prefill_group(&mut self, group: &ImmutablePrefillGroup) -> Result<StepResult>;
    fn decode(&mut self, batch: &ImmutableDecodeBatch) -> Result<StepResult>;
    /// Beyond the seed: decode the listed residents and prefill the seated group in one forward.
    fn mixed(&mut self, batch: &ImmutableMixedBatch) -> Result<StepResult>;
    fn residents(&self) -> Result<Vec<ResidentRef>>;
    /// Beyond the seed: the seated sequences, in admission order, that the next prefill, prefill_group or mixed
    /// step must name (after a chunk of a longer prompt, those not yet at their prompt's end).
    fn seated(&self) -> Result<Vec<ResidentRef>>;
    fn materialize(&self, result: &BatchResult, stop_strings: &[String]) -> GenerationResponse;
    /// Once, when nothing is resident: the founder's response.
    fn finish(&mut self) -> Result<GenerationResponse>;
    /// Release everything; idempotent.
    fn abort(&mut self) -> Result<()>;
}

/// Turn a finished sequence's snapshot into the caller's response, trimming at stop strings.
pub fn materialize(result: &BatchResult, stop_strings: &[String]) -> GenerationResponse {
    let (output_text, extra_stop) = truncate_at_stop(&result.text, stop_strings);
    let stop_reason = result.stop_reason.clone().or(extra_stop);
    GenerationResponse {
        request_id: result.identity.request_id,
        original_index: result.identity.original_index,
        prompt_ids: result.prompt_ids.clone(),
        output_ids: result.output_ids.clone(),
        output_text,
        finish_reason: result.finish_reason,
        stop_reason,
        logprobs: result.logprobs.clone(),
        prompt_logprobs: result.prompt_logprobs.clone(),
        cached_prompt_tokens: result.cached_prompt_tokens,
        error: result.error.clone(),
    }
}

enum FounderState {
    /// Its prefill ran in `begin`; the first prefill tick with nothing seated reports this result.
    Unreported(StepResult),
    Running,
    Finished(BatchResult),
}

pub struct SteppedRequest {
    stepper: StepperHandle,
    intents: Arc<IntentBuilder>,
    /// The coordinator's "a stepped session is active" flag, cleared when this one closes.
    active: Arc<AtomicBool>,
    founder: ResidentRef,
    founder_state: FounderState,
    closed: bool,
}

impl SteppedRequest {
    /// Admit the founder and run its prefill. The caller has set `active`; on error it is cleared here.
    pub(crate) fn begin(
        stepper: StepperHandle,
        intents: Arc<IntentBuilder>,
        active: Arc<AtomicBool>,
        request: GenerationRequest,
        request_id: RequestId,
        original_index: u32,
    ) -> Result<Self> {
        let started = Self::seat_and_prefill_founder(&stepper, &intents, request, request_id, original_index);
        match started {
            Ok((founder, first)) => {
                let mut me = Self { stepper, intents, active, founder, founder_state: FounderState::Unreported(first.clone()), closed: false };
                me.observe(&first);
                if let FounderState::Finished(_) = me.founder_state {
                    me.founder_state = FounderState::Unreported(first);
                }
                Ok(me)
            }
            Err(e) => {
                active.store(false, Ordering::SeqCst);
                Err(e)
            }
        }
    }

    fn seat_and_prefill_founder(
        stepper: &StepperHandle,
        intents: &IntentBuilder,
        request: GenerationRequest,
        request_id: RequestId,
        original_index: u32,
    ) -> Result<(ResidentRef, StepResult)> {
        let intent = intents.build(request, request_id, original_index)?;
        let s = stepper;
        let adm = s.admit(intent)?;
        let founder = match adm.status {
            AdmissionStatus::Admitted => adm.resident.expect("admitted results carry a ref"),
            AdmissionStatus::NoCapacity => return protocol(format!("no capacity for the founder: {}", adm.reason.unwrap_or_default())),
            AdmissionStatus::Rejected => return Err(Error::InvalidRequest(adm.reason.unwrap_or_default())),
        };
        let founding = ImmutablePrefillBatch { target: founder };
        let mut first = s.prefill(&founding)?;
        // A founder prompt longer than max_prefill_tokens is computed one chunk per step; the session reports the
        // step that sampled its first token, as having published if any of its chunks did.
        let mut published = first.published_prefix;
        while s.seated()?.contains(&founder) {
            first = s.prefill(&founding)?;
            published |= first.published_prefix;
        }
        first.published_prefix = published;
        Ok((founder, first))
    }

    pub fn founder(&self) -> ResidentRef {
        self.founder
    }

    pub fn is_closed(&self) -> bool {
        self.closed
    }

    /// Pool and cache counts, for invariant checks.
    pub fn counts(&self) -> crate::state::PoolCounts {
        self.stepper.counts()
    }

    /// Latch a cancel for one resident; the next step naming it reports it finished.
    pub fn cancel(&mut self, r: ResidentRef) -> Result<()> {
        self.ensure_open()?;
        // A founder that its founding prefill already ended is still listed as resident until the prefill tick
        // reports it; there is nothing left to cancel, and that tick reports how it ended.
        let ended_founder = r == self.founder
            && matches!(self.founder_state, FounderState::Unreported(_))
            && !self.stepper.residents()?.contains(&r);
        if ended_founder {
            return Ok(());
        }
        self.stepper.cancel(r)
    }

    fn ensure_founder_reported(&self) -> Result<()> {
        match self.founder_state {
            FounderState::Unreported(_) => {
                protocol("the founder's first token has not been reported: call prefill(target=founder) first")
            }
            _ => Ok(()),
        }
    }

    fn ensure_open(&self) -> Result<()> {
        if self.closed {
            protocol("this stepped session is closed (finish() or abort() was called); begin a new one")
        } else {
            Ok(())
        }
    }

    fn observe(&mut self, result: &StepResult) {
        for (r, batch) in &result.finished {
            if *r == self.founder {
                self.founder_state = FounderState::Finished(batch.clone());
            }
        }
    }

    /// A step that needs the founder's first token reported (every step but the founder's prefill).
    fn step_after_founder(&mut self, step: impl FnOnce(&StepperHandle) -> Result<StepResult>) -> Result<StepResult> {
        self.ensure_open()?;
        self.ensure_founder_reported()?;
        let result = step(&self.stepper)?;
        self.observe(&result);
        Ok(result)
    }

    fn close(&mut self) {
        self.closed = true;
        self.active.store(false, Ordering::SeqCst);
    }
}

impl SteppedExecution for SteppedRequest {
    fn build_intent(&self, request: GenerationRequest, original_index: u32, request_id: RequestId) -> Result<AdmissionIntent> {
        self.intents.build(request, request_id, original_index)
    }

    fn admit(&mut self, intent: AdmissionIntent) -> Result<AdmissionResult> {
        self.ensure_open()?;
        self.ensure_founder_reported()?;
        self.intents.check_intent(&intent)?;
        self.stepper.admit(intent)
    }

    fn prefill(&mut self, batch: &ImmutablePrefillBatch) -> Result<StepResult> {
        self.ensure_open()?;
        let seated = self.stepper.seated()?;
        if seated.is_empty() {
            if let FounderState::Unreported(_) = self.founder_state {
                if batch.target != self.founder {
                    return protocol(format!(
                        "the founder's first token is reported first: prefill target must be the founder (slot {}, epoch {})",
                        self.founder.slot, self.founder.epoch
                    ));
                }
                let FounderState::Unreported(first) = std::mem::replace(&mut self.founder_state, FounderState::Running) else { unreachable!() };
                self.observe(&first);
                return Ok(first);
            }
        }
        let result = self.stepper.prefill(batch)?;
        self.observe(&result);
        Ok(result)
    }

    fn admit_into_group(&mut self, intent: AdmissionIntent) -> Result<AdmissionResult> {
        self.ensure_open()?;
        self.ensure_founder_reported()?;
        self.intents.check_intent(&intent)?;
        self.stepper.admit_into_group(intent)
    }

    fn prefill_group(&mut self, group: &ImmutablePrefillGroup) -> Result<StepResult> {
        self.step_after_founder(|s| s.prefill_group(group))
    }

    fn decode(&mut self, batch: &ImmutableDecodeBatch) -> Result<StepResult> {
        self.step_after_founder(|s| s.decode(batch))
    }

    fn mixed(&mut self, batch: &ImmutableMixedBatch) -> Result<StepResult> {
        self.step_after_founder(|s| s.mixed(batch))
    }

    /// Live refs; an unreported founder counts as resident even when its founding prefill already ended it,
    /// so the caller can name it in the prefill tick that reports it.
    fn residents(&self) -> Result<Vec<ResidentRef>> {
        if self.closed {
            return Ok(Vec::new());
        }
        let mut live = self.stepper.residents()?;
        if matches!(self.founder_state, FounderState::Unreported(_)) && !live.contains(&self.founder) {
            live.insert(0, self.founder);
        }
        Ok(live)
    }

    fn seated(&self) -> Result<Vec<ResidentRef>> {
        if self.closed {
            return Ok(Vec::new());
        }
        self.stepper.seated()
    }

    fn materialize(&self, result: &BatchResult, stop_strings: &[String]) -> GenerationResponse {
        materialize(result, stop_strings)
    }

    fn finish(&mut self) -> Result<GenerationResponse> {
        self.ensure_open()?;
        let live = self.residents()?;
        if !live.is_empty() {
            return protocol(format!("finish() needs an idle session, but {} sequences are resident; decode them to the end or abort()", live.len()));
        }
        match &self.founder_state {
            FounderState::Finished(batch) => {
                let response = materialize(batch, &[]);
                self.close();
                Ok(response)
            }
            FounderState::Unreported(_) => protocol("the founder's first token has not been reported: call prefill(target=founder) first"),
            FounderState::Running => Err(Error::Internal("the founder is neither resident nor finished".into())),
        }
    }

    fn abort(&mut self) -> Result<()> {
        if !self.closed {
            self.stepper.abort_all();
            self.close();
        }
        Ok(())
    }
}

impl Drop for SteppedRequest {
    /// A session dropped without finish() or abort() must not leak slots or blocks.
    fn drop(&mut self) {
        let _ = self.abort();
    }
}

pub(crate) fn lock(stepper: &Mutex<RuntimeStepper>) -> MutexGuard<'_, RuntimeStepper> {
    // A panic while holding the lock leaves state we cannot trust less than a poisoned flag; keep serving.
    stepper.lock().unwrap_or_else(|p| p.into_inner())
}
