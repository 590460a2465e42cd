"""LLMEngine: add_request, step (plan -> batch -> forward -> sample -> commit), generate; and LLM.

Owns per-request side state the scheduler does not need (sampling generator, detokenizer).
Non-speculative decoding; the speculative step slots into the same five stages.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tokenizers import Tokenizer

from dspark_sglang.config import CacheConfig, Config, ConfigError, ModelConfig, SchedConfig
from dspark_sglang.engine.batch import build_batch
from dspark_sglang.engine.block_pool import BlockPool
from dspark_sglang.engine.detokenizer import IncrementalDetokenizer, find_stop
from dspark_sglang.engine.runner import ModelRunner
from dspark_sglang.engine.sampler import make_generator, sample, sampling_tensors
from dspark_sglang.engine.scheduler import Scheduler
from dspark_sglang.engine.sequence import FinishReason, Sequence
from dspark_sglang.types import SamplingParams, StepPlan, StepRecord


@dataclass
class RequestOutput:
    seq_id: int
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    num_preemptions: int = 0


@dataclass
class _ReqState:
    generator: torch.Generator
    detok: IncrementalDetokenizer | None
    text: str = ""
    new_ids: list[int] = field(default_factory=list)


def load_tokenizer(model_path: str) -> Tokenizer | None:
    f = Path(model_path) / "tokenizer.json"
    return Tokenizer.from_file(str(f)) if f.is_file() else None


def _generation_eos(model_path: str) -> tuple[int, ...]:
    f = Path(model_path) / "generation_config.json"
    if not f.is_file():
        return ()
    eos = json.loads(f.read_text()).get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))


class LLMEngine:
    def __init__(
        self,
        config: Config,
        tokenizer: Tokenizer | None = None,
        on_step: Callable[[StepRecord], None] | None = None,
    ) -> None:
        self.config = config
        self.runner = ModelRunner(config.model, config.cache)
        self.tokenizer = tokenizer or load_tokenizer(config.model.path)
        self.pool = BlockPool(self.runner.num_blocks, self.runner.page_size)
        eos = tuple(
            dict.fromkeys(self.runner.arch.eos_token_ids + _generation_eos(config.model.path))
        )
        self.scheduler = Scheduler(config.sched, self.pool, self.runner.max_model_len, eos)
        self.on_step = on_step
        self._state: dict[int, _ReqState] = {}
        self._seed_gen = torch.Generator().manual_seed(config.seed)
        self._step_no = 0

    # -- requests ---------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None) -> int:
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ConfigError("text prompt given but the model folder has no tokenizer.json")
            ids = self.tokenizer.encode(prompt, add_special_tokens=False).ids
        else:
            ids = [int(t) for t in prompt]
        vocab = self.runner.arch.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ConfigError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        seq = self.scheduler.add(ids, params)
        seed = params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_gen))
        detok = IncrementalDetokenizer(self.tokenizer, ids) if self.tokenizer else None
        self._state[seq.seq_id] = _ReqState(make_generator(seed, self.runner.device), detok)
        return seq.seq_id

    def abort(self, seq_id: int) -> None:
        self.scheduler.abort(seq_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return self._collect([])
        batch = build_batch(plan, self.scheduler.seqs, self.runner.page_size, self.runner.device)
        out = self.runner.forward(batch)
        seqs = [self.scheduler.seqs[i] for i in batch.sample_seq_ids]
        temps, top_ks, top_ps = sampling_tensors([s.params for s in seqs], self.runner.device)
        # Greedy rows draw no noise; passing None keeps the sampler free of a host sync.
        gens = [None if s.params.greedy else self._state[s.seq_id].generator for s in seqs]
        tokens = sample(out.logits, temps, top_ks, top_ps, gens).tolist()  # the one host sync
        touched = self.scheduler.commit(plan, dict(zip(batch.sample_seq_ids, tokens, strict=True)))
        self._record(plan, batch.num_tokens, batch.kv_tokens, out.expert_counts, t0)
        return self._collect(touched)

    def _record(
        self,
        plan: StepPlan,
        num_tokens: int,
        kv_tokens: int,
        counts: torch.Tensor | None,
        t0: float,
    ) -> None:
        self._step_no += 1
        if self.on_step is None:
            return
        decodes = sum(1 for s in plan.seqs if s.num_new_tokens == 1 and s.sample)
        self.on_step(
            StepRecord(
                step=self._step_no,
                num_reqs=len(plan.seqs),
                num_tokens=num_tokens,
                num_prefill_tokens=num_tokens - decodes,
                num_decode_reqs=decodes,
                kv_tokens=kv_tokens,
                step_seconds=time.perf_counter() - t0,
                routed_tokens_per_expert=tuple(counts.tolist()) if counts is not None else (),
            )
        )

    def _collect(self, touched: list[Sequence]) -> list[RequestOutput]:
        outs = []
        for seq in touched:
            st = self._state[seq.seq_id]
            tok = seq.output_ids[-1]
            st.new_ids.append(tok)
            if st.detok is not None:
                start = len(st.text)
                st.text += st.detok.step([tok])
                if seq.is_finished:  # emit bytes held back for an incomplete character
                    st.text += st.detok.flush()
                cut = find_stop(st.text, seq.params.stop, start)
                if cut is not None:
                    st.text = st.text[:cut]
                    if not seq.is_finished:
                        self.scheduler.finish(seq, FinishReason.STOP)
            outs.append(self._output(seq, st))
        # Aborted requests finish outside a step; report them once too.
        for sid in [i for i, s in self.scheduler.seqs.items() if s.is_finished]:
            seq = self.scheduler.pop_finished(sid)
            st = self._state.pop(sid)
            if seq not in touched:
                outs.append(self._output(seq, st))
        return outs

    def _output(self, seq: Sequence, st: _ReqState) -> RequestOutput:
        out = RequestOutput(
            seq_id=seq.seq_id,
            prompt_ids=seq.prompt_ids,
            output_ids=list(seq.output_ids),
            text=st.text,
            new_token_ids=st.new_ids,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason.value if seq.finish_reason else None,
            num_preemptions=seq.num_preemptions,
        )
        st.new_ids = []
        return out

    def generate(
        self,
        prompts: Seq[str | list[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ConfigError("generate: one SamplingParams per prompt, or a single one")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        done: dict[int, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generate")
        while len(done) < len(ids):
            for o in self.step():
                if o.finished:
                    done[o.seq_id] = o
                    if bar:
                        bar.update(1)
        if bar:
            bar.close()
        return [done[i] for i in ids]


class LLM(LLMEngine):
    """Offline entry point: `LLM("path/to/model").generate(["hello"], SamplingParams(...))`."""

    def __init__(self, model: str, seed: int = 0, **kwargs: object) -> None:
        groups = {ModelConfig: {}, CacheConfig: {}, SchedConfig: {}}
        for k, v in kwargs.items():
            owner = next((c for c in groups if k in c.__dataclass_fields__), None)
            if owner is None:
                raise ConfigError(f"LLM() got an unknown option {k!r}")
            groups[owner][k] = v
        super().__init__(
            Config(
                model=ModelConfig(path=model, **groups[ModelConfig]),
                cache=CacheConfig(**groups[CacheConfig]),
                sched=SchedConfig(**groups[SchedConfig]),
                seed=seed,
            )
        )
