//! RuntimeStepper: one typed operation per tick (admit, prefill, decode), each committed as one StepResult.

use std::sync::Arc;
use std::time::Instant;

use crate::backend::KvCacheDtype;
use crate::error::{protocol, Error, Result};
use crate::ids::{ResidentRef, SequenceIdentity, StepId};
use crate::model::{ForwardBatch, ModelRunner, SeqSlice, StepTiming};
use crate::request::{FinishReason, SamplingParams};
use crate::sampling::{resolve_seed, Sampled, ScoreRow};
use crate::session::{Ending, GenerationSession, Phase, SequenceRow};
use crate::state::budget::{BlockBudget, Reservation};
use crate::state::context_cache::{extra_key, CommitPolicy, ContextCacheConfig};
use crate::state::slot_pool::SlotPool;
use crate::state::PoolCounts;
use crate::step::{
    AdmissionIntent, AdmissionResult, BatchResult, ImmutableDecodeBatch, ImmutableMixedBatch, ImmutablePrefillBatch,
    ImmutablePrefillGroup,
    ScheduledSequenceDescriptor, SequenceWork, StepExecution, StepResult,
};
use crate::text::stop::TextStream;
use crate::text::tokenizer::Tokenizer;

mod forward;
mod prompt_chunks;

#[derive(Debug, Clone, PartialEq)]
pub struct StepperConfig {
    pub max_batch_size: usize,
    pub num_blocks: usize,
    pub block_size: usize,
    pub max_model_len: usize,
    pub cache: ContextCacheConfig,
    pub kv_cache_dtype: KvCacheDtype,
    /// Most prompt tokens one step computes (Config::max_prefill_tokens): a longer prompt is computed in chunks
    /// over several prefill (or mixed) steps and stays seated until the chunk that samples its first token.
    pub max_prefill_tokens: usize,
}

pub struct RuntimeStepper {
    runner: Box<dyn ModelRunner>,
    tokenizer: Arc<Tokenizer>,
    eos_ids: Vec<u32>,
    config: StepperConfig,
    slots: SlotPool,
    budget: BlockBudget,
    session: GenerationSession,
    /// The seated sequences, in admission order, whose prefill must be the next operation: one after `admit`
    /// (the seed's protocol), one or more after `admit_into_group`, and those whose prompts are not all computed
    /// yet after a chunked prefill step.
    seated: Vec<ResidentRef>,
    next_step_id: StepId,
    unseeded_draws: u64,
    /// The last step's ForwardBatch, refilled by the next one so that a steady decode tick allocates no batch
    /// (each sequence's block-table Vec keeps its capacity).
    batch_scratch: ForwardBatch,
    /// The last step's forward order (`forward_order`) and its sort keys, refilled by the next one.
    order_scratch: Vec<ResidentRef>,
    order_keys: Vec<(u64, ResidentRef)>,
    /// The step's prompt positions scored for prompt logprobs, after its sampled rows in `logits_for`.
    scores: Vec<ScoreRow>,
    /// The step's rows that ended without being computed (cancelled before it, `end_latched`): the commit
    /// reports them beside its participants, so it need not look through every slot for ended rows.
    ended_unscheduled: Vec<ResidentRef>,
}

impl RuntimeStepper {
    pub fn new(mut runner: Box<dyn ModelRunner>, tokenizer: Arc<Tokenizer>, eos_ids: Vec<u32>, config: StepperConfig) -> Result<Self> {
        runner.allocate_kv_cache(config.num_blocks, config.block_size, config.kv_cache_dtype)?;
        Ok(Self {
            runner,
            tokenizer,
            eos_ids,
            slots: SlotPool::new(config.max_batch_size),
            budget: BlockBudget::new(config.num_blocks, config.block_size, config.cache.clone()),
            session: GenerationSession::with_capacity(config.max_batch_size),
            seated: Vec::new(),
            next_step_id: 1,
            unseeded_draws: 0,
            batch_scratch: ForwardBatch::default(),
            order_scratch: Vec::new(),
            order_keys: Vec::new(),
            scores: Vec::new(),
            ended_unscheduled: Vec::new(),
            config,
        })
    }

    pub fn config(&self) -> &StepperConfig {
        &self.config
    }

    pub fn runner(&self) -> &dyn ModelRunner {
        self.runner.as_ref()
    }

    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    pub fn residents(&self) -> Vec<ResidentRef> {
        self.slots.live_refs()
    }

    /// The seated sequences, in admission order: the targets the next prefill, prefill_group or mixed step must
    /// name (empty when none is seated).
    pub fn seated(&self) -> Vec<ResidentRef> {
        self.seated.clone()
    }

    pub fn counts(&self) -> PoolCounts {
        PoolCounts {
            slot_capacity: self.slots.capacity(),
            free_slots: self.slots.free_count(),
            live_slots: self.slots.live_count(),
            ..self.budget.counts()
        }
    }

    /// Prompt + output tokens of a live sequence.
    pub fn sequence_len(&self, r: ResidentRef) -> Result<usize> {
        self.slots.validate(r)?;
        Ok(self.row(r)?.total_len())
    }

    /// Reserve and seat. NO_CAPACITY and REJECTED change nothing.
    pub fn admit(&mut self, intent: AdmissionIntent) -> Result<AdmissionResult> {
        self.refuse_if_seated("admit")?;
        self.seat(intent)
    }

    /// Admit into the seated group (beyond the seed): like `admit`, but requests admitted before may still be
    /// waiting for their prefill, and `prefill_group` computes all of them in one forward. Schedulers use it so
    /// that a burst of requests costs a few large prefill steps instead of one small step each.
    pub fn admit_into_group(&mut self, intent: AdmissionIntent) -> Result<AdmissionResult> {
        self.seat(intent)
    }

    fn seat(&mut self, intent: AdmissionIntent) -> Result<AdmissionResult> {
        let sampling = &intent.request.sampling;
        let key = extra_key(intent.request.lora_name.as_deref(), intent.request.cache_salt.as_deref());
        // Prompt logprobs need every prompt position's logits, so such a request computes its whole prompt.
        let reuse_cached = sampling.prompt_logprobs.is_none();
        if self.slots.free_count() == 0 {
            // A request that can never fit is rejected even while every slot is taken, not asked to retry.
            if let Some(why) = self.budget.never_fits(&intent.prompt_ids, sampling.max_tokens, key, reuse_cached) {
                return Ok(AdmissionResult::rejected(why));
            }
            return Ok(AdmissionResult::no_capacity(format!(
                "all {} resident slots are live; retry when a sequence finishes",
                self.slots.capacity()
            )));
        }
        let lease = match self.budget.reserve(&intent.prompt_ids, sampling.max_tokens, key, reuse_cached) {
            Reservation::Granted(lease) => lease,
            Reservation::NoCapacity(why) => return Ok(AdmissionResult::no_capacity(why)),
            Reservation::Rejected(why) => return Ok(AdmissionResult::rejected(why)),
        };
        let resident = self.slots.acquire().expect("a free slot was checked above");
        self.unseeded_draws += 1;
        let seed = resolve_seed(sampling, fresh_entropy(self.unseeded_draws));
        let row = SequenceRow {
            identity: SequenceIdentity { request_id: intent.request_id, original_index: intent.original_index, resident },
            stream: TextStream::with_options(
                sampling.stop.clone(),
                sampling.skip_special_tokens,
                sampling.include_stop_str_in_output,
                sampling.min_tokens,
            ),
            logprobs: sampling.logprobs.map(|_| Vec::new()),
            // The first prompt token has no logprob (nothing precedes it), as in vLLM.
            prompt_logprobs: sampling.prompt_logprobs.map(|_| vec![None]),
            ending_ids: self.ending_ids_banned_by_min_tokens(sampling),
            sampling: intent.request.sampling,
            computed: lease.cached_tokens,
            prefill_end: intent.prompt_ids.len(),
            cached_prompt_tokens: lease.cached_tokens,
            prompt_ids: intent.prompt_ids,
            output_ids: Vec::new(),
            lease,
            extra_key: key,
            watermark: 0,
            unreported_text: String::new(),
            phase: Phase::Seated,
            seed,
            latched: None,
            ending: None,
        };
        self.session.insert(row);
        self.seated.push(resident);
        Ok(AdmissionResult::admitted(resident))
    }

    /// EOS (unless ignored) and the request's stop_token_ids, which its sampler bans until `min_tokens` tokens
    /// are out; nothing for a request without `min_tokens`.
    fn ending_ids_banned_by_min_tokens(&self, sampling: &SamplingParams) -> Vec<u32> {
        if sampling.min_tokens == 0 {
            return Vec::new();
        }
        let eos = self.eos_ids.iter().filter(|_| !sampling.ignore_eos);
        let mut ids: Vec<u32> = eos.chain(&sampling.stop_token_ids).copied().collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    /// Compute the seated sequence's prompt and sample its first token; a prompt longer than
    /// `max_prefill_tokens` takes one chunk per call and stays seated until its last chunk.
    pub fn prefill(&mut self, batch: &ImmutablePrefillBatch) -> Result<StepResult> {
        let target = batch.target;
        self.slots.validate(target)?;
        match self.seated.as_slice() {
            [seated] if *seated == target => {}
            [] => return protocol("nothing is seated: admit a request before prefilling it"),
            [seated] => {
                return protocol(format!(
                    "the seated sequence (slot {}, epoch {}) must be prefilled next, not slot {} epoch {}",
                    seated.slot, seated.epoch, target.slot, target.epoch
                ))
            }
            group => {
                return protocol(format!(
                    "{} sequences are seated as a group: prefill them together with prefill_group",
                    group.len()
                ))
            }
        }
        self.run_step(SequenceWork::Context, &[], Instant::now())
    }

    /// Compute the prompts of the whole seated group in one forward and sample each one's first token. At most
    /// `max_prefill_tokens` prompt tokens are computed, in admission order: what is left stays seated.
    pub fn prefill_group(&mut self, group: &ImmutablePrefillGroup) -> Result<StepResult> {
        self.validate_group_targets("prefill_group", &group.targets)?;
        self.run_step(SequenceWork::Context, &[], Instant::now())
    }

    /// One generated token for each listed resident and the seated group's prompts (up to `max_prefill_tokens`
    /// of them, as in `prefill_group`), in one forward: the residents keep generating while the group joins.
    /// Both lists must be non-empty (a step with only one kind of work is `decode` or `prefill_group`).
    pub fn mixed(&mut self, batch: &ImmutableMixedBatch) -> Result<StepResult> {
        let started = Instant::now();
        self.validate_group_targets("a mixed step", &batch.targets)?;
        self.validate_decode_batch(&batch.residents)?;
        self.run_step(SequenceWork::Mixed, &batch.residents, started)
    }

    /// `targets` must be exactly the seated group, in admission order.
    fn validate_group_targets(&self, op: &str, targets: &[ResidentRef]) -> Result<()> {
        for &r in targets {
            self.slots.validate(r)?;
        }
        if self.seated.is_empty() {
            return protocol(format!("nothing is seated: admit requests before {op}"));
        }
        if targets != self.seated {
            return protocol(format!(
                "{op} must name exactly the seated group, in admission order ({} seated, {} named)",
                self.seated.len(),
                targets.len()
            ));
        }
        Ok(())
    }

    /// One generated token for each listed resident.
    pub fn decode(&mut self, batch: &ImmutableDecodeBatch) -> Result<StepResult> {
        let started = Instant::now();
        self.refuse_if_seated("decode")?;
        self.validate_decode_batch(&batch.residents)?;
        // Not `run_step` with no targets: this is the hot path, and the prompt bookkeeping of an empty group
        // measured about 500 instructions a tick (callgrind, host_tick).
        let computing = self.end_latched(&batch.residents)?;
        let descriptors = self.decode_descriptors(&computing);
        let (ok, timing) = self.compute(&computing, SequenceWork::Decode)?;
        let published = self.publish_generated(&computing)?;
        let clock = StepClock { rows: computing.len(), tokens: computing.len(), started, timing };
        self.commit(ok, SequenceWork::Decode, descriptors, clock, published)
    }

    /// With CommitPolicy::IncludingGenerated, publish the full blocks of each decoded row's generated tokens.
    fn publish_generated(&mut self, decoded: &[ResidentRef]) -> Result<bool> {
        let mut published = false;
        if self.budget.cache.config().commit == CommitPolicy::IncludingGenerated {
            for &r in decoded {
                published |= self.publish_prefix(r, CommitPolicy::IncludingGenerated)?;
            }
        }
        Ok(published)
    }

    /// A prefill or mixed step once validated: the `decoding` residents get one token each and the seated group
    /// its prompt chunks (`schedule_prompt_chunks`), in one forward; cancelled ones end unscheduled. A prefill
    /// step that computes no prompt (all were cancelled) is not ok.
    fn run_step(&mut self, work: SequenceWork, decoding: &[ResidentRef], started: Instant) -> Result<StepResult> {
        let targets = std::mem::take(&mut self.seated);
        let mut computing = self.end_latched(decoding)?;
        let decoded = computing.len();
        let joining = self.end_latched(&targets)?;
        let prefilling = self.schedule_prompt_chunks(&joining)?;
        let mut descriptors = self.decode_descriptors(&computing);
        descriptors.extend(self.prefill_descriptors(&prefilling)?);
        computing.extend_from_slice(&prefilling);
        let (computed, timing) = self.compute(&computing, work)?;
        let ok = computed && !(work == SequenceWork::Context && prefilling.is_empty());
        let published = self.finish_prompt_chunks(&targets, &prefilling)? | self.publish_generated(&computing[..decoded])?;
        let tokens = descriptors.iter().map(|d| d.query_length).sum();
        let clock = StepClock { rows: computing.len(), tokens, started, timing };
        self.commit(ok, work, descriptors, clock, published)
    }

    /// Each validated resident's decode work: one token after what it has computed.
    fn decode_descriptors(&self, residents: &[ResidentRef]) -> Vec<ScheduledSequenceDescriptor> {
        residents
            .iter()
            .map(|r| {
                let row = self.session.get(*r).expect("validated");
                ScheduledSequenceDescriptor {
                    identity: row.identity,
                    work: SequenceWork::Decode,
                    query_length: 1,
                    past_length: row.computed,
                    select_last_token_logits: true,
                }
            })
            .collect()
    }

    /// Compute a prompt's full blocks and pin them in the context cache (system prompts), in forwards of at most
    /// `max_prefill_tokens` tokens each, as any prompt. No slot is used; the blocks' leases are dropped again, so
    /// only the pinned cache records remain.
    pub fn save_pinned_prefix(&mut self, prompt_ids: &[u32]) -> Result<usize> {
        self.refuse_if_seated("saving a system prompt")?;
        if !self.budget.cache.config().enabled {
            return crate::error::invalid("the context cache is disabled (context_cache.enabled=False), so no system prompt can be saved");
        }
        if prompt_ids.len() >= self.config.max_model_len {
            return crate::error::invalid(format!(
                "the system prompt has {} tokens, but a request holds at most {} (max_model_len {} less one token to \
                 generate); shorten it or raise max_model_len",
                prompt_ids.len(),
                self.config.max_model_len - 1,
                self.config.max_model_len
            ));
        }
        let bs = self.config.block_size;
        let full = prompt_ids.len() / bs * bs;
        if full == 0 {
            return crate::error::invalid(format!(
                "the system prompt has {} tokens, fewer than one KV block ({bs}); nothing can be cached",
                prompt_ids.len()
            ));
        }
        let tokens = &prompt_ids[..full];
        let key = extra_key(None, None);
        let mut lease = match self.budget.reserve(tokens, 0, key, true) {
            Reservation::Granted(lease) => lease,
            Reservation::NoCapacity(why) => return protocol(format!("cannot cache the system prompt now: {why}")),
            Reservation::Rejected(why) => return crate::error::invalid(format!("the system prompt cannot be cached: {why}")),
        };
        // Pinned blocks stay for good: leave at least one block for requests.
        let newly_pinned = lease.blocks.iter().filter(|b| !self.budget.cache.is_pinned(**b)).count();
        if self.budget.cache.pinned_count() + newly_pinned >= self.budget.pool.total() {
            self.budget.release(&lease.blocks);
            return crate::error::invalid(format!(
                "pinning this system prompt's {} KV blocks would leave no block of the {} for requests ({} pinned \
                 already); raise kv_cache_tokens",
                lease.blocks.len(),
                self.budget.pool.total(),
                self.budget.cache.pinned_count()
            ));
        }
        let mut ran = Ok(Vec::new());
        let mut past = lease.cached_tokens;
        while past < full && ran.is_ok() {
            // Only the K/V are wanted: no logits.
            let end = full.min(past + self.config.max_prefill_tokens);
            let fb = ForwardBatch {
                tokens: tokens[past..end].to_vec(),
                positions: (past..end).map(|p| p as u32).collect(),
                seqs: vec![SeqSlice { start: 0, len: end - past, past_len: past, block_table: lease.blocks[..end.div_ceil(bs)].to_vec() }],
                logits_for: Vec::new(),
            };
            ran = self.runner.forward(&fb);
            past = end;
        }
        if ran.is_ok() {
            // Cached blocks it hit (an earlier request's) are pinned as well as the ones computed here.
            for &hash in &lease.hashes {
                self.budget.cache.pin_existing(hash);
            }
            self.budget.publish_computed(tokens, &[], &mut lease, full, key, true);
        }
        // What the cache kept: max_records may have refused some of the blocks.
        let pinned = self.budget.pinned_prefix_tokens(&lease);
        self.budget.release(&lease.blocks);
        ran.map(|_| pinned)
    }

    /// Latch a cancel: the next step that names the sequence reports it finished without computing it.
    pub fn cancel(&mut self, r: ResidentRef) -> Result<()> {
        self.slots.validate(r)?;
        let row = self.row_mut(r)?;
        if row.latched.is_none() && row.ending.is_none() {
            row.latched = Some(Ending { reason: FinishReason::Cancelled, stop_reason: None, error: None });
        }
        Ok(())
    }

    /// Release every resident (cancelled) and forget the seat. Idempotent.
    pub fn abort_all(&mut self) -> Vec<(ResidentRef, BatchResult)> {
        self.seated.clear();
        let mut out = Vec::new();
        for r in self.slots.live_refs() {
            if let Some(mut row) = self.session.remove(r) {
                if row.ending.is_none() {
                    row.ending = row.latched.take().or(Some(Ending { reason: FinishReason::Cancelled, stop_reason: None, error: None }));
                }
                self.budget.release(&row.lease.blocks);
                self.slots.release(r).expect("live ref");
                out.push((r, row.into_batch_result()));
            }
        }
        out
    }

    fn refuse_if_seated(&self, op: &str) -> Result<()> {
        match self.seated.as_slice() {
            [] => Ok(()),
            [s] => protocol(format!(
                "{op} is not allowed now: the seated sequence (slot {}, epoch {}) must be prefilled first",
                s.slot, s.epoch
            )),
            group => protocol(format!("{op} is not allowed now: the {} seated sequences must be prefilled first", group.len())),
        }
    }

    fn validate_decode_batch(&self, residents: &[ResidentRef]) -> Result<()> {
        if residents.is_empty() {
            return protocol("decode batch is empty: pass at least one resident");
        }
        // Indexed by slot (validated first, so in range): cheaper than hashing every ref each tick.
        let mut seen = vec![false; self.slots.capacity()];
        for &r in residents {
            self.slots.validate(r)?;
            if std::mem::replace(&mut seen[r.slot as usize], true) {
                return protocol(format!("decode batch names slot {} epoch {} twice", r.slot, r.epoch));
            }
            if self.row(r)?.phase != Phase::Running {
                return protocol(format!("slot {} epoch {} is not prefilled yet", r.slot, r.epoch));
            }
        }
        Ok(())
    }

    fn row(&self, r: ResidentRef) -> Result<&SequenceRow> {
        self.session.get(r).ok_or_else(|| missing_row(r))
    }

    fn row_mut(&mut self, r: ResidentRef) -> Result<&mut SequenceRow> {
        self.session.get_mut(r).ok_or_else(|| missing_row(r))
    }

    /// End every latched (cancelled) sequence of `refs` without computing it; returns the others.
    fn end_latched(&mut self, refs: &[ResidentRef]) -> Result<Vec<ResidentRef>> {
        let mut computing = Vec::with_capacity(refs.len());
        for &r in refs {
            let row = self.row_mut(r)?;
            match row.latched.take() {
                Some(ending) => {
                    row.ending = Some(ending);
                    self.ended_unscheduled.push(r);
                }
                None => computing.push(r),
            }
        }
        Ok(computing)
    }

    /// One forward over `refs` (a seated sequence's prompt chunk, a running one's last token), then a sampled
    /// token accepted for each that samples (all but seated rows short of their prompt's end). A failed forward
    /// ends every one of them with the error; the bool says whether the forward succeeded (true when there was
    /// nothing to compute).
    fn compute(&mut self, refs: &[ResidentRef], work: SequenceWork) -> Result<(bool, StepTiming)> {
        if refs.is_empty() {
            return Ok((true, StepTiming::default()));
        }
        let order = self.forward_order(refs, work);
        let batch = self.plan_forward(&order);
        let outcome = self.run_and_sample(&batch, &order);
        self.batch_scratch = batch;
        let timing = self.runner.last_step_timing();
        let result = match outcome {
            Ok((sampled, scored)) => {
                let mut sampled = sampled.into_iter();
                let mut scored = scored.into_iter();
                order
                    .iter()
                    .try_for_each(|r| {
                        let row = self.row_mut(*r)?;
                        row.record_prompt_logprobs(&mut scored);
                        let samples = row.samples();
                        row.computed = match row.phase {
                            Phase::Seated => row.prefill_end,
                            Phase::Running => row.computed + 1,
                        };
                        if !samples {
                            return Ok(());
                        }
                        match sampled.next() {
                            Some(s) => self.accept_token(*r, s),
                            None => Err(Error::Internal("the forward sampled fewer rows than asked".into())),
                        }
                    })
                    .map(|()| true)
            }
            Err(ending) => refs.iter().try_for_each(|r| self.row_mut(*r).map(|row| row.ending = Some(ending.clone()))).map(|()| false),
        };
        self.order_scratch = order;
        result.map(|ok| (ok, timing))
    }

    /// Capture decode CUDA graphs (GPU backends); false on the CPU.
    pub fn capture_decode_graphs(&mut self) -> Result<bool> {
        self.runner.capture_decode_graphs(self.config.max_batch_size)
    }

    /// Append a sampled token and decide whether the sequence ends with it.
    fn accept_token(&mut self, r: ResidentRef, s: Sampled) -> Result<()> {
        let max_model_len = self.config.max_model_len;
        let is_eos = self.eos_ids.contains(&s.token_id);
        // The row is borrowed from `session` directly (not through `row_mut`) so `tokenizer` stays borrowable.
        let row = self.session.get_mut(r).ok_or_else(|| missing_row(r))?;
        row.output_ids.push(s.token_id);
        if let (Some(list), Some(lp)) = (row.logprobs.as_mut(), s.logprob) {
            list.push(lp);
        }
        let ends_by_eos = is_eos && !row.sampling.ignore_eos;
        let ends_by_stop_token = row.sampling.stop_token_ids.contains(&s.token_id);
        // As vLLM: the token that ends the sequence (an EOS or a stop_token_ids id) keeps its id in the output but
        // adds no text (skip_special_tokens=False showed "<|im_end|>", a stop id such as "!" showed itself).
        let stopped = if ends_by_eos || ends_by_stop_token {
            None
        } else {
            row.stream.push_to(&self.tokenizer, s.token_id, &mut row.unreported_text)?
        };
        let end = |reason, stop_reason| Some(Ending { reason, stop_reason, error: None });
        row.ending = if ends_by_eos {
            end(FinishReason::Eos, None)
        } else if ends_by_stop_token {
            end(FinishReason::Stop, Some(s.token_id.to_string()))
        } else if let Some(stop) = stopped {
            end(FinishReason::Stop, Some(stop))
        } else if row.output_ids.len() >= row.sampling.max_tokens || row.total_len() >= max_model_len {
            end(FinishReason::Length, None)
        } else {
            None
        };
        Ok(())
    }

    fn publish_prefix(&mut self, r: ResidentRef, policy: CommitPolicy) -> Result<bool> {
        let row = self.session.get_mut(r).ok_or_else(|| Error::Internal("publish on a missing row".into()))?;
        if row.ending.as_ref().is_some_and(|e| e.reason == FinishReason::Error) {
            return Ok(false);
        }
        // The token list is passed in its two parts: copying it would cost O(context) every decode tick.
        let (output, computed): (&[u32], usize) = match policy {
            CommitPolicy::PrefillOnly => (&[], row.computed.min(row.prompt_ids.len())),
            CommitPolicy::IncludingGenerated => (&row.output_ids, row.computed),
        };
        Ok(self.budget.publish_computed(&row.prompt_ids, output, &mut row.lease, computed, row.extra_key, false))
    }

    /// Build the step's record: deltas for survivors, finished results for ended rows (released here).
    fn commit(
        &mut self,
        ok: bool,
        work: SequenceWork,
        participants: Vec<ScheduledSequenceDescriptor>,
        clock: StepClock,
        published_prefix: bool,
    ) -> Result<StepResult> {
        let mut deltas = Vec::with_capacity(participants.len());
        let mut finished = Vec::new();
        // Rows end only in a step that names them: as participants (a token, an error) or unscheduled.
        let mut touched: Vec<ResidentRef> = participants.iter().map(|p| p.identity.resident).collect();
        touched.append(&mut self.ended_unscheduled);
        touched.sort();
        touched.dedup();
        for r in touched {
            let ended = self.row(r)?.ending.is_some();
            if ended {
                let row = self.session.remove(r).expect("row exists");
                self.budget.release(&row.lease.blocks);
                self.slots.release(r)?;
                finished.push((r, row.into_batch_result()));
            } else if let Some(delta) = self.row_mut(r)?.take_delta() {
                deltas.push((r, delta));
            }
        }
        let step_id = self.next_step_id;
        self.next_step_id += 1;
        let execution = clock.stop();
        Ok(StepResult { ok, work, step_id, participants, execution, deltas, finished, published_prefix })
    }
}

fn missing_row(r: ResidentRef) -> Error {
    Error::Internal(format!("live slot {} has no session row", r.slot))
}

/// A step's measurements while it runs; [`StepClock::stop`] turns them into its execution record once the
/// record is built, so the step's host time covers its bookkeeping too.
struct StepClock {
    rows: usize,
    tokens: usize,
    started: Instant,
    timing: StepTiming,
}

impl StepClock {
    /// Wall time since `started`, with the runner's device wait and graph use for the step's forward. The device
    /// wait is measured by the runner on its own clock inside the step; it is capped at the step's elapsed time
    /// so that `elapsed_us - device_wait_us` (the step's host time) never underflows.
    fn stop(self) -> StepExecution {
        let elapsed_us = self.started.elapsed().as_micros() as u64;
        StepExecution {
            rows: self.rows,
            tokens: self.tokens,
            elapsed_us,
            device_wait_us: self.timing.device_wait_us.min(elapsed_us),
            cuda_graph: self.timing.cuda_graph,
            metadata_on_device: self.timing.metadata_on_device,
        }
    }
}

/// Entropy for unseeded requests: time and a counter, so two requests never share a stream.
fn fresh_entropy(counter: u64) -> u64 {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
    nanos ^ counter.wrapping_mul(0x9E37_79B9_7F4A_7C15)
}
