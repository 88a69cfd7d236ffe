//! RequestEngine: an actor thread that owns a coordinator's stepper and drives one operation per tick.
//! submit and cancel work from any thread; each request gets its own stream of events.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crate::coordinator::RuntimeCoordinator;
use crate::error::{Error, Result};
use crate::ids::{RequestId, ResidentRef};
use crate::intent::IntentBuilder;
use crate::request::{FinishReason, GenerationRequest, GenerationResponse};
use crate::state::PoolCounts;
use crate::prefill_group::{continue_seated_prompts, left_prompts_seated, seat_prefill_group, step_seated_group};
use crate::step::{AdmissionIntent, ImmutableDecodeBatch, StepResult, TokenDelta};
use crate::stepped::materialize;
use crate::stepper_handle::StepperHandle;

/// What a request's stream carries, in order: deltas, then exactly one Finished.
#[derive(Debug, Clone, PartialEq)]
pub enum EngineEvent {
    Delta(TokenDelta),
    Finished(GenerationResponse),
}

pub struct RequestHandle {
    pub id: RequestId,
    pub events: Receiver<EngineEvent>,
}

/// A snapshot of the engine's load and resources.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineStats {
    pub waiting: usize,
    pub running: usize,
    pub counts: PoolCounts,
    pub prompt_tokens: u64,
    pub cached_prompt_tokens: u64,
    pub generated_tokens: u64,
    pub finished: HashMap<String, u64>,
    pub steps: u64,
}

enum Command {
    // Boxed: an intent (prompt, sampling, stops) is far larger than the other commands.
    Submit { intent: Box<AdmissionIntent>, events: Sender<EngineEvent> },
    Cancel(RequestId),
    Shutdown,
}

pub struct RequestEngine {
    commands: Sender<Command>,
    thread: Option<JoinHandle<()>>,
    intents: Arc<IntentBuilder>,
    next_id: AtomicU64,
    stats: Arc<Mutex<EngineStats>>,
    coordinator: Arc<RuntimeCoordinator>,
}

impl RequestEngine {
    pub fn new(coordinator: RuntimeCoordinator) -> Result<Self> {
        // The engine drives the stepper for its whole life; no stepped session may run beside it.
        coordinator.claim_session()?.keep();
        // Decode from CUDA graphs, as a serving engine should (a no-op on the CPU; a failed capture decodes
        // eagerly with a warning).
        coordinator.capture_decoding_cuda_graph()?;
        let coordinator = Arc::new(coordinator);
        let (tx, rx) = channel();
        let stats = Arc::new(Mutex::new(EngineStats::default()));
        let actor = Actor {
            stepper: coordinator.stepper().clone(),
            commands: rx,
            waiting: VecDeque::new(),
            running: HashMap::new(),
            by_resident: HashMap::new(),
            stats: Arc::clone(&stats),
            max_prefill_tokens: coordinator.info().max_prefill_tokens,
            prompts_seated: false,
        };
        let thread = std::thread::Builder::new()
            .name("stepllm-engine".into())
            .spawn(move || actor.run())
            .map_err(|e| Error::Internal(format!("cannot start the engine thread: {e}")))?;
        Ok(Self { commands: tx, thread: Some(thread), intents: Arc::clone(coordinator.intents()), next_id: AtomicU64::new(1), stats, coordinator })
    }

    pub fn coordinator(&self) -> &RuntimeCoordinator {
        &self.coordinator
    }

    /// Validate and tokenize on the caller's thread (bad input raises here), then queue. A request whose
    /// prompt + max_tokens can never fit the KV cache raises too: the queue would only ever reject it.
    pub fn submit(&self, request: GenerationRequest) -> Result<RequestHandle> {
        let id = self.next_id.fetch_add(1, Ordering::SeqCst);
        let intent = self.intents.build(request, id, 0)?;
        self.intents.check_fits_kv_cache(&intent, self.coordinator.info().block_size)?;
        let (tx, rx) = channel();
        self.commands
            .send(Command::Submit { intent: Box::new(intent), events: tx })
            .map_err(|_| Error::Protocol("the engine has shut down; create a new one".into()))?;
        Ok(RequestHandle { id, events: rx })
    }

    /// The text of one token, special tokens included.
    pub fn decode_token(&self, token_id: u32) -> Result<String> {
        self.decode(&[token_id], false)
    }

    /// The text of a token sequence (a prompt given as ids, echoed by the server).
    pub fn decode(&self, token_ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.intents.tokenizer.decode(token_ids, skip_special_tokens)
    }

    /// The bytes of one token, which may be part of a UTF-8 character (see `Tokenizer::token_bytes`).
    pub fn token_bytes(&self, token_id: u32) -> Result<Vec<u8>> {
        self.intents.tokenizer.token_bytes(token_id)
    }

    /// Cancel a request wherever it is; its stream ends with finish reason CANCELLED. Unknown ids are ignored.
    pub fn cancel(&self, id: RequestId) {
        let _ = self.commands.send(Command::Cancel(id));
    }

    pub fn stats(&self) -> EngineStats {
        let mut s = self.stats.lock().unwrap_or_else(|p| p.into_inner()).clone();
        s.counts = self.coordinator.counts();
        s
    }

    pub fn shutdown(&mut self) {
        let _ = self.commands.send(Command::Shutdown);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
            self.coordinator.release_session();
        }
    }
}

impl Drop for RequestEngine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn lock_stats(stats: &Mutex<EngineStats>) -> std::sync::MutexGuard<'_, EngineStats> {
    stats.lock().unwrap_or_else(|p| p.into_inner())
}

struct Running {
    events: Sender<EngineEvent>,
    resident: ResidentRef,
    streamed_tokens: usize,
    streamed_text: usize,
}

struct Actor {
    stepper: StepperHandle,
    commands: Receiver<Command>,
    waiting: VecDeque<(AdmissionIntent, Sender<EngineEvent>)>,
    running: HashMap<RequestId, Running>,
    /// The request of each live resident, so a step's deltas find their streams without a scan.
    by_resident: HashMap<ResidentRef, RequestId>,
    stats: Arc<Mutex<EngineStats>>,
    /// Prompt tokens one step computes (Config::max_prefill_tokens).
    max_prefill_tokens: usize,
    /// Whether the last step left a prompt seated short of its end (chunked prefill), so the next tick goes on
    /// with it.
    prompts_seated: bool,
}

impl Actor {
    fn run(mut self) {
        loop {
            let idle = self.waiting.is_empty() && self.running.is_empty();
            let first = if idle { self.commands.recv().ok() } else { self.commands.try_recv().ok() };
            let mut shutdown = idle && first.is_none();
            let mut batch: Vec<Command> = first.into_iter().collect();
            batch.extend(self.commands.try_iter());
            for cmd in batch {
                shutdown |= self.handle(cmd);
            }
            if shutdown {
                self.abort_everything();
                return;
            }
            if let Err(e) = self.tick() {
                self.fail_everything(&e);
            }
            self.publish_stats();
        }
    }

    /// Returns true on shutdown.
    fn handle(&mut self, cmd: Command) -> bool {
        match cmd {
            Command::Submit { intent, events } => self.waiting.push_back((*intent, events)),
            Command::Cancel(id) => self.cancel(id),
            Command::Shutdown => return true,
        }
        false
    }

    fn cancel(&mut self, id: RequestId) {
        if let Some(pos) = self.waiting.iter().position(|(i, _)| i.request_id == id) {
            let (intent, events) = self.waiting.remove(pos).expect("position is valid");
            self.count_finish(FinishReason::Cancelled);
            // As in `deliver`: stats() right after the caller hears of it must not list it as waiting.
            self.publish_stats();
            let _ = events.send(EngineEvent::Finished(intent.unstarted_response(FinishReason::Cancelled, None)));
        } else if let Some(run) = self.running.get(&id) {
            let _ = self.stepper.cancel(run.resident);
        }
    }

    /// One operation: seat the queue's heads as one prefill group when any fits, and prefill it in the same
    /// forward as a decode step of every running resident (a mixed step; a plain group prefill when none is
    /// running), so running requests keep generating while new ones join; else decode every resident. A prompt
    /// longer than `max_prefill_tokens` stays seated after its first chunk, and the next ticks compute the rest
    /// (with the running residents' decode steps) before anything new is seated.
    fn tick(&mut self) -> Result<()> {
        if let Some(step) = continue_seated_prompts(&self.stepper, self.prompts_seated)? {
            self.deliver(step);
            return Ok(());
        }
        if !self.waiting.is_empty() {
            let (running, by_resident, stats) = (&mut self.running, &mut self.by_resident, &self.stats);
            let mut rejected = Vec::new();
            let group = seat_prefill_group(
                &self.stepper,
                &mut self.waiting,
                |(intent, _)| intent,
                self.max_prefill_tokens,
                |(intent, events), resident| {
                    lock_stats(stats).prompt_tokens += intent.prompt_ids.len() as u64;
                    running.insert(intent.request_id, Running { events, resident, streamed_tokens: 0, streamed_text: 0 });
                    by_resident.insert(resident, intent.request_id);
                },
                |item, why| rejected.push((item, why)),
            );
            for ((intent, events), why) in rejected {
                let _ = events.send(EngineEvent::Finished(intent.unstarted_response(FinishReason::Error, why)));
                self.count_finish(FinishReason::Error);
            }
            let targets = group?.targets;
            if !targets.is_empty() {
                let step = step_seated_group(&self.stepper, targets)?;
                self.deliver(step);
                return Ok(());
            }
        }
        let residents = self.stepper.residents()?;
        if !residents.is_empty() {
            let step = self.stepper.decode(&ImmutableDecodeBatch { residents })?;
            self.deliver(step);
        }
        Ok(())
    }

    fn deliver(&mut self, step: StepResult) {
        self.prompts_seated = left_prompts_seated(&step);
        let mut gone = Vec::new();
        let mut generated = 0u64;
        for (r, delta) in step.deltas {
            let Some(&id) = self.by_resident.get(&r) else { continue };
            let Some(run) = self.running.get_mut(&id) else { continue };
            run.streamed_tokens += delta.token_ids.len();
            run.streamed_text += delta.text.len();
            generated += delta.token_ids.len() as u64;
            if run.events.send(EngineEvent::Delta(delta)).is_err() {
                gone.push(id); // the caller dropped its stream: cancel so the next tick frees its slot
            }
        }
        self.add_stat(|s| {
            s.steps += 1;
            s.generated_tokens += generated;
        });
        let mut ended = Vec::new();
        for (_, batch) in step.finished {
            let id = batch.identity.request_id;
            let Some(run) = self.forget(id) else { continue };
            let response = materialize(&batch, &[]);
            let tail_tokens = &response.output_ids[run.streamed_tokens.min(response.output_ids.len())..];
            let tail_text = response.output_text.get(run.streamed_text..).unwrap_or("");
            self.add_stat(|s| {
                s.generated_tokens += tail_tokens.len() as u64;
                s.cached_prompt_tokens += batch.cached_prompt_tokens as u64;
            });
            if !tail_tokens.is_empty() || !tail_text.is_empty() {
                let logprobs = response.logprobs.as_ref().map(|l| l[run.streamed_tokens.min(l.len())..].to_vec());
                // A request that ends in the step of its first token streams the tail as its first delta.
                let prompt_logprobs = if run.streamed_tokens == 0 { response.prompt_logprobs.clone() } else { None };
                let tail = TokenDelta { token_ids: tail_tokens.into(), text: tail_text.into(), logprobs, prompt_logprobs };
                let _ = run.events.send(EngineEvent::Delta(tail));
            }
            self.count_finish(response.finish_reason);
            ended.push((run.events, response));
        }
        // Counted before the callers hear of it: stats() right after wait() must not list the request as running.
        if !ended.is_empty() {
            self.publish_stats();
        }
        for (events, response) in ended {
            let _ = events.send(EngineEvent::Finished(response));
        }
        for id in gone {
            self.cancel(id);
        }
    }

    fn abort_everything(&mut self) {
        for (_, batch) in self.stepper.abort_all() {
            if let Some(run) = self.forget(batch.identity.request_id) {
                let _ = run.events.send(EngineEvent::Finished(materialize(&batch, &[])));
            }
        }
        // Submits that raced the shutdown into the channel end cancelled too, never silently dropped.
        let late: Vec<Command> = self.commands.try_iter().collect();
        for cmd in late {
            if let Command::Submit { intent, events } = cmd {
                self.waiting.push_back((*intent, events));
            }
        }
        for (intent, events) in self.waiting.drain(..) {
            let _ = events.send(EngineEvent::Finished(intent.unstarted_response(FinishReason::Cancelled, None)));
        }
    }

    /// A step failed as a whole (a bug or a device failure): fail everyone, free everything, keep serving.
    fn fail_everything(&mut self, e: &Error) {
        for (_, batch) in self.stepper.abort_all() {
            if let Some(run) = self.forget(batch.identity.request_id) {
                let mut response = materialize(&batch, &[]);
                response.finish_reason = FinishReason::Error;
                response.error = Some(e.to_string());
                let _ = run.events.send(EngineEvent::Finished(response));
                self.count_finish(FinishReason::Error);
            }
        }
    }

    fn count_finish(&self, reason: FinishReason) {
        self.add_stat(|s| *s.finished.entry(reason.as_str().to_string()).or_default() += 1);
    }

    /// Stop tracking request `id` (finished, aborted or failed); returns its streams.
    fn forget(&mut self, id: RequestId) -> Option<Running> {
        let run = self.running.remove(&id)?;
        self.by_resident.remove(&run.resident);
        Some(run)
    }

    fn add_stat(&self, f: impl FnOnce(&mut EngineStats)) {
        f(&mut lock_stats(&self.stats));
    }

    fn publish_stats(&self) {
        let (waiting, running) = (self.waiting.len(), self.running.len());
        self.add_stat(|s| {
            s.waiting = waiting;
            s.running = running;
        });
    }
}

