"""``mnb.generate``: text out of the live sharded model, on every rank of the pool.

Inside a ``%%megatron`` cell (any layout: tp with or without sp, pp, vpp, dp, ep)::

    model = mnb.gpt("tiny")
    mnb.generate(model, "Once upon a time", max_new_tokens=32)          # -> one string
    mnb.generate(model, ["a", "longer prompt"], temperature=0.8, seed=1)  # -> list of strings
    mnb.generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=8)            # -> list of id lists

On CUDA ranks the decode runs in :mod:`mnb.megatron.decode_graphs` (static KV cache, CUDA graphs
of prefill and decode step, sampling on the GPU; :func:`decode_static`).  On CPU ranks (below) the
decode loop is mnb's, the modules and the KV cache are Megatron-Core's:

- every chunk is Megatron's ``GPTModel``, called with a
  ``megatron.core.inference.contexts.StaticInferenceContext`` (the same on 0.16 and 0.19):
  its attention layers keep keys and values per layer, so each step feeds one new token
  per prompt, never the prefix again.  Megatron's engines and text-generation controllers
  are not used: their direct mode is asyncio (which clashes with a kernel's running loop)
  and their static path calls CUDA-only helpers; this loop is plain synchronous code.
- prompts of different lengths share one batch the way Megatron's static controller does
  it: the prefix all prompts share in length is encoded at once, then every step feeds one
  position per prompt, the prompt's own token while the prompt lasts and the generated one
  after; no padding is ever attended to, so each continuation equals a one-prompt run.
- pipeline stages pass hidden states with point-to-point sends in the order of the virtual
  stages (vpp included); the last stage gathers the fp32 logits over tp (Megatron's
  ``runtime_gather_output``) and chooses the token; one all-reduce over all ranks per step
  carries the chosen tokens from one rank to all and the interrupt flag from any rank
  to all (see :mod:`mnb.megatron.interrupts`), so every rank stops at the same token.
- sampling draws one uniform number per prompt and step from a CPU generator seeded with
  ``seed`` and inverts the cumulative distribution of the fp32 logits: the same draws under
  every layout, so the same tokens unless two logits differ only in rounding at a boundary.
  The draws are taken in prompt order, so a sampled continuation depends on the prompt's place
  in the batch and on the other prompts (the same batch and seed give the same tokens; greedy
  decoding does not depend on the batch).
- sequence parallelism is switched off for the call (Megatron's own
  ``set_model_to_sequence_parallel``): one new token cannot be split over tp ranks.
"""

from __future__ import annotations

import contextlib
import numbers
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from mnb.megatron import events, interrupts
from mnb.megatron.model import MegatronModel
from mnb.megatron.record import device_of


@dataclass(frozen=True)
class Prompts:
    """Prompts as token ids, and how the caller gave them (to answer in the same shape)."""

    ids: list[list[int]]
    kind: str  # "text" (one string), "texts", "ids" (one list of ints), "id_lists"


def tokenizer_of(model: MegatronModel):
    """The model's tokenizer: a checkpoint's, mnb's byte tokenizer for ``mnb.gpt`` models,
    None for a Hugging Face checkpoint without ``tokenizer.json`` (token ids only)."""
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None and getattr(model, "hf", None) is None:
        from mnb.megatron.tokenizer import ByteTokenizer

        tokenizer = ByteTokenizer()
    return tokenizer


def end_ids(model: MegatronModel, tokenizer) -> set[int]:
    """Ids that end a continuation: a checkpoint's ``eos_token_id`` (what transformers'
    ``generate`` stops at), else the tokenizer's end-of-document id."""
    source = getattr(getattr(model, "hf", None), "config", None) or {}
    eos = source.get("eos_token_id") if isinstance(source, dict) else None
    if eos is None and tokenizer is not None:
        eos = getattr(tokenizer, "eod", None)
    ids = eos if isinstance(eos, (list, tuple)) else [eos]
    return {int(i) for i in ids if isinstance(i, int) and i >= 0}


def as_prompts(prompts: Any, tokenizer) -> Prompts:
    """Token ids of ``prompts`` (a string, a list of strings, a list of ints, a list of id lists)."""
    if isinstance(prompts, str):
        return Prompts([_encode(prompts, tokenizer)], "text")
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise TypeError(
            "prompts must be a string, a non-empty list of strings, a list of token ids (one prompt) "
            f"or a list of token-id lists, got {type(prompts).__name__}{' (empty)' if prompts == [] else ''}"
        )
    if all(isinstance(p, str) for p in prompts):
        return Prompts([_encode(p, tokenizer) for p in prompts], "texts")
    if all(_is_id(p) for p in prompts):
        return Prompts([[int(t) for t in prompts]], "ids")
    if all(isinstance(p, (list, tuple)) and p and all(_is_id(t) for t in p) for p in prompts):
        return Prompts([[int(t) for t in p] for p in prompts], "id_lists")
    raise TypeError("prompts must be all strings, all token ids (one prompt), or all non-empty lists of "
                    "token ids (a batch); this list mixes them or holds an empty prompt")


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) or (
        isinstance(value, torch.Tensor) and value.ndim == 0 and not value.is_floating_point())


def _encode(text: str, tokenizer) -> list[int]:
    if tokenizer is None:
        raise ValueError("this model has no tokenizer (its Hugging Face folder has no tokenizer.json): "
                         "pass token ids, e.g. mnb.generate(model, [[1, 2, 3]])")
    ids = list(tokenizer.tokenize(text))
    if not ids:
        raise ValueError(f"prompt {text!r} has no tokens; give at least one character")
    return [int(t) for t in ids]


def check_settings(model: MegatronModel, max_new_tokens: int, temperature: float, top_k: int,
                   top_p: float, stop, seed: int = 0) -> list[str]:
    """Clear errors before any rank starts a collective; the stop strings as a list."""
    if not isinstance(model, MegatronModel):
        raise TypeError(f"mnb.generate needs a model built by mnb (mnb.gpt, mnb.from_hf), got "
                        f"{type(model).__name__}")
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0 (0: empty continuations, as transformers "
                         f"gives them), got {max_new_tokens!r}")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature!r}")
    if not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 = no top-k cut), got {top_k!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must lie in (0, 1] (1 = no nucleus cut), got {top_p!r}")
    if not isinstance(seed, numbers.Integral) or isinstance(seed, bool):
        raise TypeError(f"seed must be an integer (the sampling draws' seed; the same seed, the same draws), "
                        f"got {seed!r}")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if not all(isinstance(s, str) and s for s in stops):
        raise TypeError(f"stop must be a string or a list of non-empty strings, got {stop!r}")
    model.check_layout()
    if model.parallel.cp > 1:
        raise ValueError(
            f"mnb.generate does not run under context parallelism (cp={model.parallel.cp}): one new "
            "token cannot be split over cp ranks. Save the model (mnb.save) and load it under a layout "
            f"with cp=1, e.g. %%megatron --tp {model.parallel.tp * model.parallel.cp}"
        )
    return stops


def generate(model: MegatronModel, prompts: Any, *, max_new_tokens: int = 64, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int = 0, stop: str | Sequence[str] | None = None,
             stream: bool = True, compile: bool = False):
    """Continue ``prompts`` with ``model``; the continuations only, the same on every rank.

    Args:
        prompts: a string (returns a string), a list of strings (a list of strings), a list
            of ints (one prompt; returns a list of ints) or a list of id lists (a list of id
            lists).  Strings are tokenized with the model's tokenizer (mnb's byte tokenizer
            for ``mnb.gpt`` models).
        max_new_tokens: tokens generated per prompt at most (0: empty continuations).
        temperature: 0 = greedy (deterministic); > 0 samples from softmax(logits / temperature).
        top_k / top_p: keep the k most likely tokens (0 = all) / the smallest set whose
            probability reaches p (1 = all) before sampling.
        seed: seed of the sampling draws (the same draws under every layout).
        stop: a string or strings; a continuation ends where one appears (the stop string
            itself is not returned; token-id answers end with the token that completed it).
            The end token ends a continuation too (kept in token-id answers, as transformers
            keeps it): a checkpoint's ``eos_token_id``, else the tokenizer's end of document.
        stream: show each prompt's text growing in the notebook (plain text outside one).
        compile: on GPU ranks, fuse each layer's small operations (norms, RoPE, attention arithmetic,
            SwiGLU, residual adds) with ``torch.compile`` before the decode step is captured, for a
            compile of seconds the first time a batch and length bucket is decoded (Inductor's cache
            shortens it in later processes).  Faster than torch's own ops, but where Triton runs (torch's
            CUDA wheels) the default step's own kernels are faster still (llama-1b on an H200: 754 against
            677 tokens/s at batch 1; BENCHMARKS.md).  CPU ranks, MoE and Megatron-FSDP models (their steps
            run uncaptured) decode as they do without it.

    Must run on every rank of the pool (a ``%%megatron`` cell).  Kernel -> Interrupt stops
    every rank after the same token (KeyboardInterrupt); the pool stays usable.
    """
    stops = check_settings(model, max_new_tokens, temperature, top_k, top_p, stop, seed)
    if not isinstance(compile, bool):
        raise TypeError(f"compile must be True or False, not {compile!r}")
    tokenizer = tokenizer_of(model)
    if stops and tokenizer is None:
        raise ValueError("stop strings need a tokenizer, and this model has none (no tokenizer.json in its "
                         "Hugging Face folder): leave stop out, or load a checkpoint with its tokenizer")
    batch = as_prompts(prompts, tokenizer)
    limit, what = model.config.max_position_embeddings, "max_position_embeddings"
    if model.config.sliding_window is not None and model.config.sliding_window < limit:
        limit, what = model.config.sliding_window, "sliding_window (Megatron's local attention has none)"
    longest = max(len(p) for p in batch.ids)
    if longest + max_new_tokens > limit:
        raise ValueError(
            f"the longest prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) = "
            f"{longest + max_new_tokens} exceeds the model's {what} ({limit}); "
            "shorten the prompt or ask for fewer tokens")
    vocab = model.config.vocab_size
    bad = sorted({t for p in batch.ids for t in p if not 0 <= t < vocab})
    if bad:
        raise ValueError(f"token ids {bad[:5]} lie outside the model's vocabulary [0, {vocab})")
    if max_new_tokens == 0:  # nothing to decode: no forward, no collective (every rank returns alike)
        return answer(batch, [[] for _ in batch.ids], tokenizer, stops)
    view = Stream(batch, tokenizer) if stream else None
    from mnb.megatron import decode_graphs

    with interrupts.deferred() as flag:
        if decode_graphs.usable(model):
            outputs, stopped = decode_static(model, batch.ids, max_new_tokens,
                                             dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed),
                                             tokenizer, stops, flag, view, ends=end_ids(model, tokenizer),
                                             compile=compile)
        else:
            sampler = Sampler(temperature, top_k, top_p, seed, vocab)
            outputs, stopped = decode(model, batch.ids, max_new_tokens, sampler, tokenizer, stops, flag, view,
                                      ends=end_ids(model, tokenizer))
    if stopped:
        raise KeyboardInterrupt(
            f"mnb.generate stopped on every rank after {max(len(o) for o in outputs)} new tokens "
            "(interrupted); the pool and the model are ready for the next cell")
    return answer(batch, outputs, tokenizer, stops)


def answer(batch: Prompts, outputs: list[list[int]], tokenizer, stops: list[str]):
    """The continuations in the shape the prompts came in."""
    if batch.kind in ("ids", "id_lists"):
        return outputs[0] if batch.kind == "ids" else outputs
    texts = [cut_at_stop(tokenizer.detokenize(o), stops)[0] for o in outputs]
    return texts[0] if batch.kind == "text" else texts


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """``text`` up to the first stop string, and whether one was found."""
    ends = [text.find(s) for s in stops if s in text]
    return (text[: min(ends)], True) if ends else (text, False)


class Sampler:
    """Greedy or seeded sampling over fp32 logits ``[batch, vocab]`` (on the choosing rank)."""

    def __init__(self, temperature: float, top_k: int, top_p: float, seed: int, vocab: int):
        self.temperature, self.top_k, self.top_p, self.vocab = temperature, top_k, top_p, vocab
        self.generator = torch.Generator().manual_seed(int(seed))

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits[:, : self.vocab].float()
        if self.temperature == 0:
            return logits.argmax(dim=-1).cpu()
        # One draw per prompt and step, taken before anything layout-dependent.
        draws = torch.rand(logits.shape[0], generator=self.generator, dtype=torch.float64)
        scaled = logits.cpu().double() / self.temperature
        order = torch.argsort(scaled, dim=-1, descending=True, stable=True)
        probs = torch.softmax(torch.gather(scaled, -1, order), dim=-1)
        if self.top_k:
            probs[:, self.top_k:] = 0
        if self.top_p < 1:
            before = torch.cumsum(probs, dim=-1) - probs  # probability of the better tokens
            probs[before >= self.top_p] = 0
        cdf = torch.cumsum(probs, dim=-1)
        picked = torch.searchsorted(cdf, (draws * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
        picked = picked.clamp(max=probs.shape[-1] - 1)
        return torch.gather(order, -1, picked.unsqueeze(-1)).squeeze(-1)


class Stream:
    """Each prompt's text so far, sent as ``generate`` events from global rank 0."""

    def __init__(self, batch: Prompts, tokenizer):
        self.batch, self.tokenizer = batch, tokenizer
        self.here = torch.distributed.get_rank() == 0
        self.prompts = [self._text(p) for p in batch.ids]

    def _text(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return " ".join(map(str, ids))
        try:
            return self.tokenizer.detokenize(ids)
        except Exception:  # noqa: BLE001 - a tokenizer that cannot show ids: show the ids
            return " ".join(map(str, ids))

    def show(self, outputs: list[list[int]], stops: list[str], final: bool) -> None:
        if not self.here:
            return
        texts = [self.prompts[i] + cut_at_stop(self._text(o), stops)[0] for i, o in enumerate(outputs)]
        events.emit("generate", {"texts": texts, "final": final})


@contextlib.contextmanager
def inference_mode(model: MegatronModel):
    """Eval mode, no autograd, sequence parallelism off; restored however the call ends."""
    from megatron.core.transformer.utils import set_model_to_sequence_parallel

    from mnb.megatron import fsdp

    sp = bool(model.transformer_config.sequence_parallel)
    modes = [chunk.training for chunk in model.chunks]
    fsdp.ready_for_direct_forward(model)  # the chunks are called directly, not through their wrappers
    try:
        for chunk in model.chunks:
            chunk.eval()
            if sp:
                set_model_to_sequence_parallel(chunk, False)
        with torch.no_grad():
            yield
    finally:
        for chunk, mode in zip(model.chunks, modes):
            chunk.train(mode)
            if sp:
                set_model_to_sequence_parallel(chunk, True)


def decode(model: MegatronModel, prompts: list[list[int]], max_new_tokens: int, sampler: Sampler,
           tokenizer, stops: list[str], flag: interrupts.InterruptFlag, view: Stream | None = None,
           ends: set[int] = frozenset()):
    """The KV-cached decode loop: new token ids per prompt, and whether an interrupt stopped it."""
    from megatron.core.inference.contexts import StaticInferenceContext

    device = device_of()
    lengths = [len(p) for p in prompts]
    batch, total = len(prompts), max(lengths) + max_new_tokens
    tokens = torch.zeros(batch, total, dtype=torch.long)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = torch.tensor(p)
    outputs: list[list[int]] = [[] for _ in prompts]
    done = [False] * batch
    pipe = Pipeline(model, device)
    context = StaticInferenceContext(batch, total)
    stopped = False
    with inference_mode(model):
        start = min(lengths)
        for position in range(start, total):
            offset = context.sequence_len_offset
            logits = pipe.last_logits(tokens[:, offset:position].to(device), offset, context)
            context.sequence_len_offset = position
            chosen = sampler(logits) if logits is not None else None
            chosen, stop_now = pipe.share(chosen, batch, flag.requested)
            for i in range(batch):
                if position < lengths[i]:  # still inside prompt i: its own token is the next input
                    continue
                tokens[i, position] = int(chosen[i]) if not done[i] else 0
                if done[i]:
                    continue
                done[i] = _append(outputs[i], int(chosen[i]), ends, max_new_tokens, stops, tokenizer)
            if view is not None:
                view.show(outputs, stops, final=all(done) or stop_now)
            if stop_now:
                stopped = True
                break
            if all(done):
                break
    return outputs, stopped


def _append(output: list[int], token: int, ends, max_new_tokens: int, stops: list[str], tokenizer) -> bool:
    """Add one new token to a continuation; True when it ended it (an end token, the length, a stop string).
    The one rule both decode paths end continuations by."""
    output.append(token)
    ended = token in ends or len(output) >= max_new_tokens
    if stops and not ended:
        ended = cut_at_stop(tokenizer.detokenize(output), stops)[1]
    return ended


def decode_static(model: MegatronModel, prompts: list[list[int]], max_new_tokens: int, sampling: dict,
                  tokenizer, stops: list[str], flag: interrupts.InterruptFlag, view: Stream | None = None,
                  ends: set[int] = frozenset(), compile: bool = False):
    """GPU ranks: the static-cache, CUDA-graph decode (:mod:`mnb.megatron.decode_graphs`); the
    new tokens come to the host every few tokens and end each continuation as :func:`decode` does."""
    from mnb.megatron import decode_graphs

    outputs: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)

    def on_block(tokens: torch.Tensor, last: bool) -> bool:
        rows = tokens.tolist()
        for i, row in enumerate(rows):
            for token in row[len(outputs[i]):]:
                if done[i]:
                    break
                done[i] = _append(outputs[i], token, ends, max_new_tokens, stops, tokenizer)
        if view is not None:
            view.show(outputs, stops, final=all(done) or last)
        return all(done)

    with inference_mode(model):
        decoder = decode_graphs.decoder_of(model)
        stopped = decoder.run(prompts, max_new_tokens, sampling, on_block, lambda: flag.requested, compile)
    return outputs, stopped


class Pipeline:
    """One forward of the model's chunks for new positions, across pipeline stages."""

    def __init__(self, model: MegatronModel, device: torch.device):
        from megatron.core import parallel_state as ps

        self.model, self.device = model, device
        self.pp = model.parallel.pp
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.group = ps.get_pipeline_model_parallel_group()
        self.next_rank = ps.get_pipeline_model_parallel_next_rank()
        self.prev_rank = ps.get_pipeline_model_parallel_prev_rank()
        self.dtype = next(model.chunks[0].parameters()).dtype
        self.hidden = model.config.hidden_size
        stages = self.pp * len(model.chunks)
        self.last_here = (stages - 1) % self.pp == self.pp_rank
        chooser = (self.last_here and ps.get_tensor_model_parallel_rank() == 0
                   and ps.get_data_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0)
        self.chooser = chooser

    def forward(self, tokens: torch.Tensor, offset: int = 0, context=None) -> torch.Tensor | None:
        """The last stage's output for ``tokens`` at positions ``offset...`` (other stages: None).

        Virtual stage ``v`` lives on pipeline rank ``v % pp`` as chunk ``v // pp``; each
        stage receives its input from the previous one and sends its output on.
        """
        batch, length = tokens.shape
        positions = torch.arange(offset, offset + length, device=self.device).unsqueeze(0).expand(batch, -1)
        stages = self.pp * len(self.model.chunks)
        output = None
        for stage in range(self.pp_rank, stages, self.pp):
            chunk = self.model.chunks[stage // self.pp]
            if stage > 0:
                received = torch.empty(length, batch, self.hidden, dtype=self.dtype, device=self.device)
                torch.distributed.recv(received, src=self.prev_rank, group=self.group)
                chunk.set_input_tensor(received)
            output = chunk(tokens, positions, None, inference_context=context, runtime_gather_output=True)
            if stage < stages - 1:
                torch.distributed.send(output.contiguous(), dst=self.next_rank, group=self.group)
                output = None
        return output

    def last_logits(self, new_tokens: torch.Tensor, offset: int, context) -> torch.Tensor | None:
        """fp32 logits ``[batch, vocab]`` of the last new position (on the last stage; else None)."""
        output = self.forward(new_tokens, offset, context)
        return None if output is None else output[:, -1, :].float()

    def share(self, chosen: torch.Tensor | None, batch: int, interrupted: bool) -> tuple[torch.Tensor, bool]:
        """The chooser's tokens on every rank, and whether any rank was interrupted (one all-reduce)."""
        payload = torch.zeros(batch + 1, dtype=torch.long)
        if self.chooser:
            payload[:batch] = chosen.to(torch.long)
        payload[batch] = int(interrupted)
        payload = payload.to(self.device)
        torch.distributed.all_reduce(payload)
        payload = payload.cpu()
        return payload[:batch], bool(payload[batch] > 0)
