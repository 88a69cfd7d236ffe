//! StepperHandle: what the stepped session, the engine and whole-batch dispatch drive. A single-rank
//! runtime locks its one RuntimeStepper; a tensor-parallel one broadcasts each operation to its rank group,
//! where every rank executes it collectively.

use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};
use crate::ids::ResidentRef;
use crate::parallel::rank::{RankCommand, RankGroup, RankReply};
use crate::state::PoolCounts;
use crate::step::{
    AdmissionIntent, AdmissionResult, BatchResult, ImmutableDecodeBatch, ImmutableMixedBatch, ImmutablePrefillBatch, ImmutablePrefillGroup,
    StepResult,
};
use crate::stepped::lock;
use crate::stepper::RuntimeStepper;

#[derive(Clone)]
pub enum StepperHandle {
    Local(Arc<Mutex<RuntimeStepper>>),
    Ranks(Arc<RankGroup>),
}

fn unexpected(reply: RankReply) -> Error {
    Error::Internal(format!("unexpected rank reply {reply:?}"))
}

impl StepperHandle {
    pub fn admit(&self, intent: AdmissionIntent) -> Result<AdmissionResult> {
        match self {
            Self::Local(s) => lock(s).admit(intent),
            Self::Ranks(g) => match g.execute(RankCommand::Admit(intent))? {
                RankReply::Admission(a) => Ok(a),
                other => Err(unexpected(other)),
            },
        }
    }

    pub fn admit_into_group(&self, intent: AdmissionIntent) -> Result<AdmissionResult> {
        match self {
            Self::Local(s) => lock(s).admit_into_group(intent),
            Self::Ranks(g) => match g.execute(RankCommand::AdmitIntoGroup(intent))? {
                RankReply::Admission(a) => Ok(a),
                other => Err(unexpected(other)),
            },
        }
    }

    pub fn prefill_group(&self, group: &ImmutablePrefillGroup) -> Result<StepResult> {
        match self {
            Self::Local(s) => lock(s).prefill_group(group),
            Self::Ranks(g) => step(g.execute(RankCommand::PrefillGroup(group.clone()))?),
        }
    }

    pub fn prefill(&self, batch: &ImmutablePrefillBatch) -> Result<StepResult> {
        match self {
            Self::Local(s) => lock(s).prefill(batch),
            Self::Ranks(g) => step(g.execute(RankCommand::Prefill(*batch))?),
        }
    }

    pub fn decode(&self, batch: &ImmutableDecodeBatch) -> Result<StepResult> {
        match self {
            Self::Local(s) => lock(s).decode(batch),
            Self::Ranks(g) => step(g.execute(RankCommand::Decode(batch.clone()))?),
        }
    }

    pub fn mixed(&self, batch: &ImmutableMixedBatch) -> Result<StepResult> {
        match self {
            Self::Local(s) => lock(s).mixed(batch),
            Self::Ranks(g) => step(g.execute(RankCommand::Mixed(batch.clone()))?),
        }
    }

    pub fn cancel(&self, r: ResidentRef) -> Result<()> {
        match self {
            Self::Local(s) => lock(s).cancel(r),
            Self::Ranks(g) => g.execute(RankCommand::Cancel(r)).map(|_| ()),
        }
    }

    /// Release every resident. On a failed rank group nothing more can be released: empty.
    pub fn abort_all(&self) -> Vec<(ResidentRef, BatchResult)> {
        match self {
            Self::Local(s) => lock(s).abort_all(),
            Self::Ranks(g) => match g.execute(RankCommand::AbortAll) {
                Ok(RankReply::Aborted(v)) => v,
                _ => Vec::new(),
            },
        }
    }

    pub fn residents(&self) -> Result<Vec<ResidentRef>> {
        match self {
            Self::Local(s) => Ok(lock(s).residents()),
            Self::Ranks(g) => match g.execute(RankCommand::Residents)? {
                RankReply::Residents(v) => Ok(v),
                other => Err(unexpected(other)),
            },
        }
    }

    /// The seated sequences, in admission order (`RuntimeStepper::seated`).
    pub fn seated(&self) -> Result<Vec<ResidentRef>> {
        match self {
            Self::Local(s) => Ok(lock(s).seated()),
            Self::Ranks(g) => match g.execute(RankCommand::Seated)? {
                RankReply::Seated(v) => Ok(v),
                other => Err(unexpected(other)),
            },
        }
    }

    /// Pool and cache counts (rank 0's, equal on every rank); zeros where a rank group has failed.
    pub fn counts(&self) -> PoolCounts {
        match self {
            Self::Local(s) => lock(s).counts(),
            Self::Ranks(g) => match g.execute(RankCommand::Counts) {
                Ok(RankReply::Counts(c)) => c,
                _ => PoolCounts::default(),
            },
        }
    }

    pub fn save_pinned_prefix(&self, ids: &[u32]) -> Result<usize> {
        match self {
            Self::Local(s) => lock(s).save_pinned_prefix(ids),
            Self::Ranks(g) => match g.execute(RankCommand::SavePinnedPrefix(ids.to_vec()))? {
                RankReply::CachedTokens(n) => Ok(n),
                other => Err(unexpected(other)),
            },
        }
    }

    pub fn capture_decode_graphs(&self) -> Result<bool> {
        match self {
            Self::Local(s) => lock(s).capture_decode_graphs(),
            Self::Ranks(g) => match g.execute(RankCommand::CaptureDecodeGraphs)? {
                RankReply::Captured(b) => Ok(b),
                other => Err(unexpected(other)),
            },
        }
    }
}

fn step(reply: RankReply) -> Result<StepResult> {
    match reply {
        RankReply::Step(s) => Ok(s),
        other => Err(unexpected(other)),
    }
}
