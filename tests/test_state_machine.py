"""Hypothesis state machine over random admit / prefill / decode / cancel / abort / finish and bad input,
checking the ARCHITECTURE.md invariants after every step. A step computes at most PREFILL_BUDGET prompt tokens,
so longer prompts are prefilled in chunks and stay seated in between."""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import stepllm
from conftest import check_invariants, coordinator

CAPACITY = 3
BLOCK = 4
KV_TOKENS = 96  # 24 blocks: small enough that the budget refuses some requests
PREFILL_BUDGET = 8



def fresh_coordinator() -> stepllm.RuntimeCoordinator:
    # One per example: context-cache contents change what admission grants, so a shared runtime would make
    # examples depend on the ones before them (and hypothesis could not replay them).
    return coordinator("qwen3", max_batch_size=CAPACITY, kv_cache_tokens=KV_TOKENS, block_size=BLOCK,
                       max_prefill_tokens=PREFILL_BUDGET)


prompts = st.lists(st.integers(min_value=3, max_value=40), min_size=1, max_size=30)
max_tokens = st.integers(min_value=1, max_value=12)
samplings = st.one_of(
    st.builds(lambda n, eos: stepllm.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=eos), max_tokens, st.booleans()),
    st.builds(
        lambda n, seed, stop: stepllm.SamplingParams(max_tokens=n, temperature=1.0, seed=seed, stop=stop),
        max_tokens,
        st.integers(0, 2**32),
        st.sampled_from([None, ["a"], ["e", " t"]]),
    ),
)


class SteppedMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.coord = fresh_coordinator()
        self.stepped: stepllm.SteppedRequest | None = None
        self.live: set[stepllm.ResidentRef] = set()
        self.dead: set[stepllm.ResidentRef] = set()
        self.seated: stepllm.ResidentRef | None = None
        self.group: list[stepllm.ResidentRef] = []  # admitted into a group, waiting for prefill_group
        self.cancelled: set[stepllm.ResidentRef] = set()  # cancels latched; the next step naming them ends them
        self.founder_reported = False
        self.baseline: dict[str, int] = {}
        self.next_id = 1

    @initialize(prompt=prompts, sampling=samplings)
    def start(self, prompt: list[int], sampling: stepllm.SamplingParams) -> None:
        counts = self.coord.counts()
        assert counts["live_slots"] == 0 and counts["leased_blocks"] == 0
        self.open_session(prompt, sampling)

    def teardown(self) -> None:
        if self.stepped is not None:
            self.stepped.abort()

    # ------------------------------------------------------------------------------------------ helpers

    def request(self, prompt: list[int], sampling: stepllm.SamplingParams) -> stepllm.GenerationRequest:
        return stepllm.GenerationRequest(prompt, sampling)

    def absorb(self, step: stepllm.StepResult) -> None:
        for ref, delta in step.deltas:
            assert ref in self.live
            assert delta.token_ids
        for ref, result in step.finished:
            assert ref in self.live, (ref, self.live)
            assert result.identity.resident == ref
            self.live.discard(ref)
            self.dead.add(ref)
            event(f"finished {result.finish_reason}")
        assert not {r for r, _ in step.deltas} & {r for r, _ in step.finished}

    def still_seated(self, step: stepllm.StepResult, targets: list[stepllm.ResidentRef]) -> list[stepllm.ResidentRef]:
        """The targets a prefill-type step leaves seated: those whose chunk stopped short of the prompt's end.
        Cancelled targets end unscheduled; the others share the step's budget in admission order."""
        prompt_work = [p for p in step.participants if p.work == stepllm.SequenceWork.CONTEXT]
        assert [p.identity.resident for p in prompt_work] == [r for r in targets if r not in self.cancelled][:len(prompt_work)]
        assert sum(p.query_length for p in prompt_work) <= PREFILL_BUDGET
        done = {p.identity.resident for p in prompt_work if p.select_last_token_logits} | {r for r, _ in step.finished}
        for p in prompt_work:
            if not p.select_last_token_logits:
                event("a prompt chunk short of its prompt's end")
                assert p.identity.resident not in {r for r, _ in step.deltas}
        return [r for r in targets if r not in done]

    def session_open(self) -> bool:
        return self.stepped is not None

    def open_session(self, prompt: list[int], sampling: stepllm.SamplingParams) -> None:
        """A session is always open: the machine begins the next one as soon as one closes."""
        self.next_id += 1
        self.baseline = self.coord.counts()
        self.stepped = self.coord.begin_stepped(self.request(prompt, sampling), request_id=self.next_id)
        founder = self.stepped.founder()
        assert founder not in self.dead
        residents = set(self.stepped.residents())  # empty if the founder already ended on its first token
        assert residents <= {founder}
        self.live = {founder}  # tracked until its first prefill tick reports it
        self.founder_reported = False
        self.seated = None
        self.group = []
        self.cancelled = set()

    def refused(self, call: Any, exc: type[BaseException]) -> None:
        counts, residents = self.coord.counts(), self.stepped.residents() if self.stepped else []
        with pytest.raises(exc):
            call()
        assert self.coord.counts() == counts
        if self.stepped is not None:
            assert self.stepped.residents() == residents

    def closed(self) -> None:
        counts = self.coord.counts()
        skip = {"free_blocks", "cached_blocks", "pinned_blocks"}
        assert {k: v for k, v in counts.items() if k not in skip} == {k: v for k, v in self.baseline.items() if k not in skip}
        assert counts["leased_blocks"] == 0
        self.dead |= self.live
        self.live.clear()
        self.stepped, self.seated, self.founder_reported, self.group = None, None, False, []

    # ------------------------------------------------------------------------------------------ rules

    @precondition(lambda self: not self.founder_reported or self.seated is not None)
    @rule()
    def prefill(self) -> None:
        """The one prefill that is due: the founder's first report, or the seated sequence."""
        if not self.founder_reported:
            founder = self.stepped.founder()
            step = self.stepped.prefill(stepllm.ImmutablePrefillBatch(target=founder))
            assert [p.identity.resident for p in step.participants] == [founder]
            self.founder_reported = True
        else:
            target = self.seated
            step = self.stepped.prefill(stepllm.ImmutablePrefillBatch(target=target))
            self.seated = (self.still_seated(step, [target]) or [None])[0]
        assert step.work == stepllm.SequenceWork.CONTEXT
        self.absorb(step)

    def idle_between_steps(self) -> bool:
        """No prefill is due: the founder's first token is reported and nothing is seated."""
        return self.founder_reported and self.seated is None and not self.group

    # Rules that only apply between steps are not preconditioned on it: otherwise, while a chunked prompt stays
    # seated over several steps, most rules are disabled and hypothesis gives up drawing one. Out of turn, they
    # must be refused with nothing changed.

    @rule(prompt=prompts, sampling=samplings, budget=st.sampled_from(["as drawn", "tight", "never"]))
    def admit(self, prompt: list[int], sampling: stepllm.SamplingParams, budget: str) -> None:
        if not self.idle_between_steps():
            request = self.request(prompt, sampling)
            self.refused(lambda: self.stepped.admit(request, original_index=0, request_id=97), stepllm.ProtocolError)
            return
        if budget == "tight":  # fits an idle pool only: NO_CAPACITY while others hold blocks
            sampling = stepllm.SamplingParams(max_tokens=KV_TOKENS - len(prompt) - 1, temperature=0.0)
        elif budget == "never":  # within the context length but beyond the whole KV pool: REJECTED
            sampling = stepllm.SamplingParams(max_tokens=200, temperature=0.0)
        self.next_id += 1
        counts = self.coord.counts()
        adm = self.stepped.admit(self.request(prompt, sampling), original_index=self.next_id, request_id=self.next_id)
        event(f"admission {adm.status}")
        if adm.status == stepllm.AdmissionStatus.ADMITTED:
            assert adm.ref is not None and adm.ref not in self.dead and adm.ref not in self.live
            self.live.add(adm.ref)
            self.seated = adm.ref
        else:
            assert adm.ref is None and adm.reason
            assert self.coord.counts() == counts

    @precondition(lambda self: self.founder_reported and self.seated is None)
    @rule(prompt=prompts, sampling=samplings)
    def admit_into_group(self, prompt: list[int], sampling: stepllm.SamplingParams) -> None:
        """Beyond the seed: seat another request into the group that one prefill_group computes."""
        self.next_id += 1
        counts = self.coord.counts()
        adm = self.stepped.admit_into_group(self.request(prompt, sampling), original_index=self.next_id, request_id=self.next_id)
        event(f"group admission {adm.status}")
        if adm.status == stepllm.AdmissionStatus.ADMITTED:
            assert adm.ref is not None and adm.ref not in self.dead and adm.ref not in self.live
            self.live.add(adm.ref)
            self.group.append(adm.ref)
        else:
            assert adm.ref is None and adm.reason
            assert self.coord.counts() == counts

    @precondition(lambda self: bool(self.group))
    @rule()
    def prefill_group(self) -> None:
        group = self.group
        step = self.stepped.prefill_group(stepllm.ImmutablePrefillGroup(targets=group))
        self.group = self.still_seated(step, group)
        assert step.work == stepllm.SequenceWork.CONTEXT
        event(f"prefill group of {min(len(group), 3)}{'+' if len(group) > 3 else ''}")
        self.absorb(step)

    @precondition(lambda self: bool(self.group))
    @rule(data=st.data())
    def mixed(self, data: st.DataObject) -> None:
        """Beyond the seed: running residents decode in the forward that prefills the seated group."""
        running = [r for r in self.stepped.residents() if r not in self.group]
        if not running:
            return
        chosen = data.draw(st.lists(st.sampled_from(running), min_size=1, unique=True))
        group = self.group
        step = self.stepped.mixed(stepllm.ImmutableMixedBatch(residents=chosen, targets=group))
        assert step.work == stepllm.SequenceWork.MIXED
        self.group = self.still_seated(step, group)
        works = {p.identity.resident: p.work for p in step.participants}
        assert {r for r, w in works.items() if w == stepllm.SequenceWork.DECODE} <= set(chosen)
        event(f"mixed step: {min(len(chosen), 3)} decoding, {min(len(group), 3)} joining")
        self.absorb(step)

    @rule(data=st.data())
    def decode(self, data: st.DataObject) -> None:
        residents = self.stepped.residents()
        if not self.idle_between_steps():
            if residents:
                self.refused(lambda: self.stepped.decode(stepllm.ImmutableDecodeBatch(residents=residents[:1])), stepllm.ProtocolError)
            return
        if not residents:
            return
        chosen = data.draw(st.lists(st.sampled_from(residents), min_size=1, unique=True))
        step = self.stepped.decode(stepllm.ImmutableDecodeBatch(residents=chosen))
        assert step.work == stepllm.SequenceWork.DECODE
        assert {p.identity.resident for p in step.participants} <= set(chosen)
        self.absorb(step)

    @precondition(lambda self: self.founder_reported)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        residents = self.stepped.residents()
        if not residents:
            return
        ref = data.draw(st.sampled_from(residents))
        self.stepped.cancel(ref)
        self.cancelled.add(ref)

    @rule(prompt=prompts, sampling=samplings)
    def abort(self, prompt: list[int], sampling: stepllm.SamplingParams) -> None:
        self.stepped.abort()
        self.stepped.abort()
        self.closed()
        self.open_session(prompt, sampling)

    @rule(prompt=prompts, sampling=samplings)
    def finish(self, prompt: list[int], sampling: stepllm.SamplingParams) -> None:
        if not self.idle_between_steps() or self.stepped.residents():
            self.refused(self.stepped.finish, stepllm.ProtocolError)
            return
        response = self.stepped.finish()
        assert response.finish_reason in {
            stepllm.FinishReason.EOS, stepllm.FinishReason.LENGTH, stepllm.FinishReason.STOP, stepllm.FinishReason.CANCELLED,
        }
        self.closed()
        self.open_session(prompt, sampling)

    # ------------------------------------------------------------------------------------------ bad input

    @rule(kind=st.sampled_from(["request", "stale", "out_of_order", "second_session"]), data=st.data())
    def bad_input(self, kind: str, data: st.DataObject) -> None:
        """Something the runtime must refuse without changing anything."""
        if kind == "request":
            req = data.draw(st.sampled_from([
                stepllm.GenerationRequest([]),
                stepllm.GenerationRequest([1, 400]),
                stepllm.GenerationRequest([5] * (KV_TOKENS + 1)),
                stepllm.GenerationRequest([5], stepllm.SamplingParams(max_tokens=10_000)),
                stepllm.GenerationRequest([5], stepllm.SamplingParams(stop_token_ids=[999])),
            ]))
            self.refused(lambda: self.stepped.build_intent(req, 0, 99), stepllm.InvalidRequestError)
            self.refused(lambda: self.stepped.admit(req, 0, 99), stepllm.InvalidRequestError)
        elif kind == "stale":
            candidates = sorted(self.dead - self.live) or [stepllm.ResidentRef(slot=CAPACITY + 1, epoch=0)]
            stale = data.draw(st.sampled_from(candidates))
            self.refused(lambda: self.stepped.decode(stepllm.ImmutableDecodeBatch(residents=[stale])), stepllm.ProtocolError)
            self.refused(lambda: self.stepped.cancel(stale), stepllm.ProtocolError)
            self.refused(lambda: self.stepped.prefill_group(stepllm.ImmutablePrefillGroup(targets=[stale])), stepllm.ProtocolError)
            if self.founder_reported and self.seated is None and not self.group:
                self.refused(lambda: self.stepped.prefill(stepllm.ImmutablePrefillBatch(target=stale)), stepllm.ProtocolError)
        elif kind == "out_of_order":
            residents = self.stepped.residents()
            if not self.founder_reported:
                # decode before the founder's first token is reported
                self.refused(lambda: self.stepped.decode(stepllm.ImmutableDecodeBatch(residents=[self.stepped.founder()])), stepllm.ProtocolError)
            elif self.seated is not None:
                # decode / admit / other prefill while a seated prefill is pending
                self.refused(lambda: self.stepped.decode(stepllm.ImmutableDecodeBatch(residents=[self.seated])), stepllm.ProtocolError)
                self.refused(lambda: self.stepped.admit(stepllm.GenerationRequest([5, 6]), 0, 98), stepllm.ProtocolError)
                others = [r for r in residents if r != self.seated]
                if others:
                    self.refused(lambda: self.stepped.prefill(stepllm.ImmutablePrefillBatch(target=others[0])), stepllm.ProtocolError)
            elif self.group:
                # while a group waits for its prefill: decode, a seed admit, a group that is not exactly the seated one
                group = list(self.group)
                self.refused(lambda: self.stepped.decode(stepllm.ImmutableDecodeBatch(residents=group[:1])), stepllm.ProtocolError)
                self.refused(lambda: self.stepped.admit(stepllm.GenerationRequest([5, 6]), 0, 98), stepllm.ProtocolError)
                wrong = stepllm.ImmutablePrefillGroup(targets=group[::-1] + group[:1])
                self.refused(lambda: self.stepped.prefill_group(wrong), stepllm.ProtocolError)
            elif residents:
                # prefill of a running (not seated) ref; finish while residents live; a duplicate decode batch
                self.refused(lambda: self.stepped.prefill(stepllm.ImmutablePrefillBatch(target=residents[0])), stepllm.ProtocolError)
                self.refused(self.stepped.finish, stepllm.ProtocolError)
                self.refused(lambda: self.stepped.decode(stepllm.ImmutableDecodeBatch(residents=[residents[0]] * 2)), stepllm.ProtocolError)
            else:
                self.refused(lambda: self.stepped.decode(stepllm.ImmutableDecodeBatch(residents=[])), stepllm.ProtocolError)
        else:
            self.refused(lambda: self.coord.begin_stepped(stepllm.GenerationRequest([5, 6])), stepllm.ProtocolError)
            self.refused(lambda: self.coord.dispatch_request([stepllm.GenerationRequest([5, 6])]), stepllm.ProtocolError)

    # ------------------------------------------------------------------------------------------ invariants

    @invariant()
    def pools_add_up(self) -> None:
        check_invariants(self.coord.counts())

    @invariant()
    def residents_are_the_live_refs(self) -> None:
        if self.stepped is None:
            assert self.coord.counts()["live_slots"] == 0
            return
        residents = self.stepped.residents()
        assert len(residents) == len(set(residents)), residents
        assert self.stepped.seated() == ([self.seated] if self.seated is not None else self.group)
        tracked = set(self.live)
        if not self.founder_reported:
            tracked.discard(self.stepped.founder())
            assert set(residents) - tracked <= {self.stepped.founder()}
        else:
            assert set(residents) == tracked
        assert not set(residents) & (self.dead - self.live)
        live_slots = self.coord.counts()["live_slots"]
        if self.founder_reported:
            assert live_slots == len(residents)
        else:  # an unreported founder stays listed even if its founding prefill already ended it
            assert live_slots in (len(residents), len(residents) - 1)


SteppedMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestSteppedMachine = SteppedMachine.TestCase
