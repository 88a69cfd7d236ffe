//! Batched prefill for the schedulers (the engine and whole-batch dispatch): the heads of the queue are seated
//! as one group and prefilled in one tick, so a burst of requests costs a few large forwards instead of one
//! small forward each (vLLM's `max_num_batched_tokens` plays the same part). Order stays first come, first
//! served: the group stops at the first head that does not fit now. While other requests run, the group is
//! prefilled in the forward of their next decode step (a mixed step).

use std::collections::{HashSet, VecDeque};

use crate::error::Result;
use crate::ids::ResidentRef;
use crate::step::{AdmissionIntent, AdmissionStatus, ImmutableMixedBatch, ImmutablePrefillGroup, SequenceWork, StepResult};
use crate::stepper_handle::StepperHandle;

/// Default of `Config::max_prefill_tokens`: vLLM's default step budget for chunked prefill.
pub const DEFAULT_MAX_PREFILL_TOKENS: usize = 8192;

/// What seating a group did besides the admissions handed to `on_admitted`.
#[derive(Debug, Default)]
pub struct SeatedGroup {
    /// The seated residents, in admission order: the targets of the group's prefill (empty: none fit).
    pub targets: Vec<ResidentRef>,
    /// Why the head of the queue could not be admitted now, when nothing was.
    pub head_refused: Option<String>,
}

/// Admit heads of `waiting` into one prefill group while the group's prompt tokens stay within `max_tokens`
/// (a single prompt longer than that still goes, alone). Each admitted head leaves the queue through
/// `on_admitted` at once, so a failure later in the group loses no request; a REJECTED head leaves it through
/// `on_rejected`. A head that gets NO_CAPACITY, or would overflow the budget, ends the group and stays queued.
pub fn seat_prefill_group<T>(
    stepper: &StepperHandle,
    waiting: &mut VecDeque<T>,
    intent_of: impl Fn(&T) -> &AdmissionIntent,
    max_tokens: usize,
    mut on_admitted: impl FnMut(T, ResidentRef),
    mut on_rejected: impl FnMut(T, Option<String>),
) -> Result<SeatedGroup> {
    let mut group = SeatedGroup::default();
    let mut tokens = 0;
    while let Some(head) = waiting.front() {
        let intent = intent_of(head);
        let prompt = intent.prompt_ids.len();
        if !group.targets.is_empty() && tokens + prompt > max_tokens {
            break;
        }
        let adm = stepper.admit_into_group(intent.clone())?;
        match adm.status {
            AdmissionStatus::Admitted => {
                let resident = adm.resident.expect("an admitted request has a resident");
                tokens += prompt;
                group.targets.push(resident);
                on_admitted(waiting.pop_front().expect("the head exists"), resident);
            }
            AdmissionStatus::Rejected => on_rejected(waiting.pop_front().expect("the head exists"), adm.reason),
            AdmissionStatus::NoCapacity => {
                if group.targets.is_empty() {
                    group.head_refused = Some(adm.reason.unwrap_or_default());
                }
                break;
            }
        }
    }
    Ok(group)
}

/// Whether `step` computed a prompt chunk short of its prompt's end: its sequence stays seated, and the next step
/// must go on with the seated group (`StepperHandle::seated`). Lets a scheduler ask the stepper only then: under
/// tensor parallelism every question is a round trip to the ranks.
pub fn left_prompts_seated(step: &StepResult) -> bool {
    step.participants.iter().any(|d| d.work == SequenceWork::Context && !d.select_last_token_logits)
}

/// The step that goes on with the seated group when the last step left a prompt short of its end
/// (`left_prompts_seated`); None when it did not, or nothing is seated any more.
pub fn continue_seated_prompts(stepper: &StepperHandle, left_seated: bool) -> Result<Option<StepResult>> {
    if !left_seated {
        return Ok(None);
    }
    let seated = stepper.seated()?;
    if seated.is_empty() {
        return Ok(None);
    }
    step_seated_group(stepper, seated).map(Some)
}

/// Compute a seated group (`targets`, in admission order): in the same forward as one decode step of every
/// running resident when any is running (a mixed step), so running requests keep generating while the group
/// joins; alone otherwise.
pub fn step_seated_group(stepper: &StepperHandle, targets: Vec<ResidentRef>) -> Result<StepResult> {
    let seated: HashSet<ResidentRef> = targets.iter().copied().collect();
    let running: Vec<ResidentRef> = stepper.residents()?.into_iter().filter(|r| !seated.contains(r)).collect();
    if running.is_empty() {
        stepper.prefill_group(&ImmutablePrefillGroup { targets })
    } else {
        stepper.mixed(&ImmutableMixedBatch { residents: running, targets })
    }
}
