"""``mnb.evaluate``: the model's loss on held-out data, without touching its weights.

Inside a ``%%megatron`` cell, on every rank::

    model = mnb.gpt("tiny")
    mnb.evaluate(model, data="stdlib", batches=4, micro_batch_size=2)
    # -> {"loss": 5.61, "perplexity": 273.0, "tokens": 512}

and during training, every ``eval_every`` steps (recorded per step as ``eval_loss``,
``mnb.last_run.eval_losses``)::

    mnb.train(model, steps=50, data="stdlib", eval_data="my_text/", eval_every=10, eval_batches=4)

The forward is Megatron's own schedule with ``forward_only=True`` (1F1B or interleaved for
pp/vpp, cp chunks as in training), in eval mode and without autograd.  It reads the first
``batches * micro_batch_size * dp`` samples of ``data`` (samples are split over dp ranks as
training splits them), so every evaluation of one model sees the same tokens and its losses
can be compared over a run.  The samples come from training's own reader
(:func:`mnb.megatron.batches.samples`): text through the model's tokenizer (a Hugging Face
checkpoint's own), and the same tokens ``mnb.train`` reads from the same data with seed 1234.
``loss`` is the mean per-token loss over all of them (a sum over tokens, not a mean of batch
means), ``perplexity`` its exponential, ``tokens`` their number.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mnb.megatron import interrupts
from mnb.megatron.model import MegatronModel
from mnb.megatron.record import device_of

EVAL_SEED = 1234
"""Seed of the evaluation dataset (mock data, shuffles): the TrainConfig default, fixed."""


def evaluate(model: MegatronModel, *, data: str = "mock", batches: int | None = 1,
             micro_batch_size: int = 1, pack: bool = True, truncate: bool = False) -> dict[str, Any]:
    """``{"loss", "perplexity", "tokens"}`` of ``model`` on ``batches`` batches of ``data``.

    ``data`` takes what ``mnb.train(data=...)`` takes ('mock', a corpus preset such as
    'stdlib', a folder or glob of text files, a .bin/.idx prefix, instruction rows in ``.jsonl``
    files).  One batch is ``micro_batch_size`` sequences per data-parallel rank.
    ``batches=None``: every sample exactly once (every example of instruction data; every
    sequence of a text corpus's first epoch), the last batch filled with samples outside the
    loss.  Instruction data: ``pack`` several examples per sequence (each attends to itself
    alone; the loss is the same), ``truncate`` rows longer than a sequence instead of refusing
    them.  The same on every rank; must run on every rank of the pool.  Kernel -> Interrupt
    stops every rank after the forward.
    """
    check(model, data, batches, micro_batch_size)
    with interrupts.deferred() as flag:
        result, stop = run_evaluation(model, data, batches, micro_batch_size, flag, pack=pack, truncate=truncate)
    if stop:
        raise KeyboardInterrupt("mnb.evaluate was interrupted (every rank finished the forward first); "
                                "the model is unchanged")
    return result


def check(model: Any, data: Any, batches: Any, micro_batch_size: Any) -> None:
    """Clear errors for bad arguments, before any rank starts a collective."""
    if not isinstance(model, MegatronModel):
        raise TypeError(f"mnb.evaluate needs a model built by mnb (mnb.gpt, mnb.from_hf), got {type(model).__name__}")
    for name, value in (("batches", batches), ("micro_batch_size", micro_batch_size)):
        if name == "batches" and value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            extra = " or None (every sample once)" if name == "batches" else ""
            raise ValueError(f"{name} must be a positive integer{extra}, got {value!r}")
    if not isinstance(data, str) or not data:
        raise TypeError(f"data must be a string ('mock', 'stdlib', a text folder, a .bin/.idx prefix or "
                        f".jsonl instruction rows), got {data!r}")
    model.check_layout()


def run_evaluation(model: MegatronModel, data: str, batches: int | None, micro_batch_size: int,
                   flag: interrupts.InterruptFlag, *, pack: bool = True,
                   truncate: bool = False) -> tuple[dict[str, Any], bool]:
    """The evaluation, and whether any rank was interrupted (``flag``: the caller's, e.g. train's)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from mnb.megatron.batches import BatchPlan, Finite, forward_step, microbatch_iterators, samples

    device = device_of()
    seq = model.config.seq_length
    # training's reader: the model's tokenizer, its seq_length; instruction rows checked alike on every rank
    dataset = samples(model, data, EVAL_SEED, pack=pack, truncate=truncate)
    if batches is None:  # every sample once, in whole batches
        per_batch = micro_batch_size * model.parallel.dp
        batches = max(1, -(-dataset.epoch_size // per_batch))
        if model.parallel.vpp > 1:  # Megatron's interleaved schedule takes whole groups of pp microbatches
            pp = model.parallel.pp
            batches = -(-batches // pp) * pp
        dataset = Finite(dataset, dataset.epoch_size)
    plan = BatchPlan(start_sample=0, micro_batch_size=micro_batch_size, num_microbatches=batches,
                     dp=model.parallel.dp, dp_rank=ps.get_data_parallel_rank())
    config = model.transformer_config
    timers, config.timers = config.timers, None  # a training's timeline records training only
    modes = [module.training for module in model.modules]
    try:
        for module in model.modules:
            module.eval()
        with torch.no_grad():
            losses = get_forward_backward_func()(
                forward_step_func=forward_step,  # training's, so both use one loss rule
                data_iterator=microbatch_iterators(dataset, plan, 0, model.chunks, device),
                model=model.modules,
                num_microbatches=batches,
                seq_length=seq,
                micro_batch_size=micro_batch_size,
                decoder_seq_length=seq,
                forward_only=True,
            )
    finally:
        config.timers = timers
        for module, mode in zip(model.modules, modes):
            module.train(mode)
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0:
        for item in losses:  # every dp and cp rank here holds a disjoint part of the tokens
            totals[:2] += item["lm loss"].to(device=device, dtype=torch.float64)
    totals[2] = float(flag.requested)
    torch.distributed.all_reduce(totals)
    loss = float(totals[0] / totals[1]) if totals[1] > 0 else float("nan")
    result = {"loss": loss, "perplexity": math.exp(loss) if loss < 700 else float("inf"),
              "tokens": int(totals[1])}
    return result, bool(totals[2] > 0)
