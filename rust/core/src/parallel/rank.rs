//! The rank group: one worker thread per rank, each owning a RuntimeStepper over its shard. Every stepped
//! operation is broadcast as a command that all ranks execute collectively (their forwards meet in the
//! collective); the group collects every rank's reply, checks that they agree, and answers with rank 0's.
//! A rank that fails fails the command on every rank (through the poisoned collective), never a hang.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

use super::collective::Collective;
use super::Fault;
use crate::error::{Error, Result};
use crate::ids::ResidentRef;
use crate::state::PoolCounts;
use crate::step::{
    AdmissionIntent, AdmissionResult, BatchResult, ImmutableDecodeBatch, ImmutableMixedBatch, ImmutablePrefillBatch, ImmutablePrefillGroup,
    StepResult,
};
use crate::stepper::RuntimeStepper;

/// One stepped operation, executed by every rank.
#[derive(Debug, Clone)]
#[allow(clippy::large_enum_variant)] // one command in flight at a time
pub enum RankCommand {
    /// The request itself travels as the payload: each rank reserves and seats it in its own state.
    Admit(AdmissionIntent),
    AdmitIntoGroup(AdmissionIntent),
    Prefill(ImmutablePrefillBatch),
    PrefillGroup(ImmutablePrefillGroup),
    Decode(ImmutableDecodeBatch),
    Mixed(ImmutableMixedBatch),
    Cancel(ResidentRef),
    AbortAll,
    Residents,
    Seated,
    Counts,
    SavePinnedPrefix(Vec<u32>),
    CaptureDecodeGraphs,
}

/// One rank's answer to a command.
#[derive(Debug, Clone, PartialEq)]
pub enum RankReply {
    Admission(AdmissionResult),
    Step(StepResult),
    Done,
    Residents(Vec<ResidentRef>),
    Seated(Vec<ResidentRef>),
    Counts(PoolCounts),
    Aborted(Vec<(ResidentRef, BatchResult)>),
    CachedTokens(usize),
    Captured(bool),
}

impl RankReply {
    /// Equal on every healthy rank; timings are the ranks' own and are left out.
    fn agrees_with(&self, other: &RankReply) -> bool {
        match (self, other) {
            (RankReply::Step(a), RankReply::Step(b)) => {
                let mut b = b.clone();
                b.execution = a.execution;
                *a == b
            }
            (a, b) => a == b,
        }
    }
}

struct RankLink {
    commands: Sender<RankCommand>,
    replies: Receiver<Result<RankReply>>,
}

struct Links {
    ranks: Vec<RankLink>,
    /// Each rank's outcome of the latest command, until taken.
    last: Vec<Option<Result<RankReply>>>,
    succeeded: bool,
    /// Set when the ranks can no longer be trusted to hold the same state (a panic, a disagreement).
    broken: Option<String>,
}

pub struct RankGroup {
    links: Mutex<Links>,
    collective: Arc<Collective>,
    faults: Vec<Arc<AtomicU8>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl RankGroup {
    /// Start one worker thread per stepper; stepper `r` is rank `r`.
    pub fn start(steppers: Vec<RuntimeStepper>, collective: Arc<Collective>, faults: Vec<Arc<AtomicU8>>) -> Result<Self> {
        let mut ranks = Vec::new();
        let mut threads = Vec::new();
        for (rank, stepper) in steppers.into_iter().enumerate() {
            let (ctx, crx) = channel::<RankCommand>();
            let (rtx, rrx) = channel::<Result<RankReply>>();
            let collective = Arc::clone(&collective);
            let thread = std::thread::Builder::new()
                .name(format!("stepllm-rank-{rank}"))
                .spawn(move || rank_worker(rank, stepper, collective, crx, rtx))
                .map_err(|e| Error::Internal(format!("cannot start rank thread {rank}: {e}")))?;
            ranks.push(RankLink { commands: ctx, replies: rrx });
            threads.push(thread);
        }
        let world = ranks.len();
        let links = Links { ranks, last: vec![None; world], succeeded: true, broken: None };
        Ok(Self { links: Mutex::new(links), collective, faults, threads: Mutex::new(threads) })
    }

    pub fn world_size(&self) -> usize {
        self.faults.len()
    }

    fn lock(&self) -> MutexGuard<'_, Links> {
        self.links.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Broadcast `command`, wait for every rank, check that they agree; rank 0's reply.
    pub fn execute(&self, command: RankCommand) -> Result<RankReply> {
        let mut links = self.lock();
        if let Some(why) = &links.broken {
            return Err(Error::Device(format!("the tensor-parallel group is unusable: {why}")));
        }
        for (rank, link) in links.ranks.iter().enumerate() {
            if link.commands.send(command.clone()).is_err() {
                links.broken = Some(format!("rank {rank}'s thread has exited"));
                return Err(Error::Device(format!("tensor-parallel rank {rank}'s thread has exited")));
            }
        }
        let replies: Vec<Result<RankReply>> = links
            .ranks
            .iter()
            .enumerate()
            .map(|(rank, link)| link.replies.recv().unwrap_or_else(|_| Err(Error::Device(format!("tensor-parallel rank {rank}'s thread has exited")))))
            .collect();
        // Every rank is idle again: the collective may forget this command's failure.
        self.collective.reset();
        let first = replies[0].clone();
        let agree = replies.iter().all(|r| match (r, &first) {
            (Ok(a), Ok(b)) => a.agrees_with(b),
            (Err(a), Err(b)) => a.to_string() == b.to_string(),
            _ => false,
        });
        links.succeeded = replies.iter().all(|r| r.is_ok()) && agree;
        links.last = replies.iter().cloned().map(Some).collect();
        if !agree {
            let detail: Vec<String> = replies
                .iter()
                .enumerate()
                .map(|(rank, r)| format!("rank {rank}: {}", r.as_ref().map_or_else(|e| e.to_string(), |_| "ok".to_string())))
                .collect();
            let why = format!("ranks disagreed on a step ({})", detail.join("; "));
            links.broken = Some(why.clone());
            return Err(Error::Device(why));
        }
        first
    }

    /// Whether every rank succeeded, and agreed, in the latest command.
    pub fn local_ranks_succeeded(&self) -> bool {
        self.lock().succeeded
    }

    /// Rank `rank`'s own outcome of the latest command, once.
    pub fn take_rank_response(&self, rank: usize) -> Option<Result<RankReply>> {
        self.lock().last.get_mut(rank).and_then(Option::take)
    }

    /// Make rank `rank` suffer `fault` in its next collective (tests of rank failure).
    pub fn inject_fault(&self, rank: usize, fault: Fault) -> Result<()> {
        match self.faults.get(rank) {
            Some(f) => {
                f.store(fault as u8, Ordering::SeqCst);
                Ok(())
            }
            None => crate::error::invalid(format!("rank {rank} is outside the group of {}", self.world_size())),
        }
    }

    /// Every rank's own pool counts and residents (invariant checks on every rank).
    pub fn per_rank(&self, command: RankCommand) -> Result<Vec<RankReply>> {
        self.execute(command)?;
        let mut links = self.lock();
        links.last.iter_mut().map(|r| r.take().unwrap_or_else(|| Err(Error::Internal("no reply".into())))).collect()
    }
}

impl Drop for RankGroup {
    fn drop(&mut self) {
        // Closing the command channels ends every worker.
        self.lock().ranks.clear();
        for t in self.threads.lock().unwrap_or_else(|p| p.into_inner()).drain(..) {
            let _ = t.join();
        }
    }
}

fn rank_worker(rank: usize, mut stepper: RuntimeStepper, collective: Arc<Collective>, commands: Receiver<RankCommand>, replies: Sender<Result<RankReply>>) {
    while let Ok(command) = commands.recv() {
        let outcome = catch_unwind(AssertUnwindSafe(|| run_command(&mut stepper, command)));
        let reply = match outcome {
            Ok(r) => r,
            Err(_) => Err(collective.poison(format!("tensor-parallel rank {rank} panicked"))),
        };
        collective.depart();
        if replies.send(reply).is_err() {
            return;
        }
    }
}

fn run_command(s: &mut RuntimeStepper, command: RankCommand) -> Result<RankReply> {
    Ok(match command {
        RankCommand::Admit(intent) => RankReply::Admission(s.admit(intent)?),
        RankCommand::AdmitIntoGroup(intent) => RankReply::Admission(s.admit_into_group(intent)?),
        RankCommand::Prefill(batch) => RankReply::Step(s.prefill(&batch)?),
        RankCommand::PrefillGroup(group) => RankReply::Step(s.prefill_group(&group)?),
        RankCommand::Decode(batch) => RankReply::Step(s.decode(&batch)?),
        RankCommand::Mixed(batch) => RankReply::Step(s.mixed(&batch)?),
        RankCommand::Cancel(r) => {
            s.cancel(r)?;
            RankReply::Done
        }
        RankCommand::AbortAll => RankReply::Aborted(s.abort_all()),
        RankCommand::Residents => RankReply::Residents(s.residents()),
        RankCommand::Seated => RankReply::Seated(s.seated()),
        RankCommand::Counts => RankReply::Counts(s.counts()),
        RankCommand::SavePinnedPrefix(ids) => RankReply::CachedTokens(s.save_pinned_prefix(&ids)?),
        RankCommand::CaptureDecodeGraphs => RankReply::Captured(s.capture_decode_graphs()?),
    })
}
