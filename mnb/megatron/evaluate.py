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

import functools
import math
from typing import Any

import torch

from mnb.megatron import interrupts
from mnb.megatron.model import MegatronModel
from mnb.megatron.record import device_of

EVAL_SEED = 1234
"""Seed of the evaluation dataset (mock data, shuffles): the TrainConfig default, fixed."""


def evaluate(model: MegatronModel, *, data: str = "mock", batches: int = 1,
             micro_batch_size: int = 1) -> dict[str, Any]:
    """``{"loss", "perplexity", "tokens"}`` of ``model`` on ``batches`` batches of ``data``.

    ``data`` takes what ``mnb.train(data=...)`` takes ('mock', a corpus preset such as
    'stdlib', a folder or glob of text files, a .bin/.idx prefix).  One batch is
    ``micro_batch_size`` sequences per data-parallel rank.  The same on every rank; must
    run on every rank of the pool.  Kernel -> Interrupt stops every rank after the forward.
    """
    check(model, data, batches, micro_batch_size)
    with interrupts.deferred() as flag:
        result, stop = run_evaluation(model, data, batches, micro_batch_size, flag)
    if stop:
        raise KeyboardInterrupt("mnb.evaluate was interrupted (every rank finished the forward first); "
                                "the model is unchanged")
    return result


def check(model: Any, data: Any, batches: Any, micro_batch_size: Any) -> None:
    """Clear errors for bad arguments, before any rank starts a collective."""
    if not isinstance(model, MegatronModel):
        raise TypeError(f"mnb.evaluate needs a model built by mnb (mnb.gpt, mnb.from_hf), got {type(model).__name__}")
    for name, value in (("batches", batches), ("micro_batch_size", micro_batch_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if not isinstance(data, str) or not data:
        raise TypeError(f"data must be a string ('mock', 'stdlib', a text folder or a .bin/.idx prefix), got {data!r}")
    model.check_layout()


def run_evaluation(model: MegatronModel, data: str, batches: int, micro_batch_size: int,
                   flag: interrupts.InterruptFlag) -> tuple[dict[str, Any], bool]:
    """The evaluation, and whether any rank was interrupted (``flag``: the caller's, e.g. train's)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from mnb.megatron.batches import BatchPlan, microbatch_iterators, samples

    device = device_of()
    plan = BatchPlan(start_sample=0, micro_batch_size=micro_batch_size, num_microbatches=batches,
                     dp=model.parallel.dp, dp_rank=ps.get_data_parallel_rank())
    seq = model.config.seq_length
    dataset = samples(model, data, EVAL_SEED)  # training's reader: the model's tokenizer, its seq_length
    config = model.transformer_config
    timers, config.timers = config.timers, None  # a training's timeline records training only
    modes = [module.training for module in model.modules]
    try:
        for module in model.modules:
            module.eval()
        with torch.no_grad():
            losses = get_forward_backward_func()(
                forward_step_func=functools.partial(_forward_step, vocab=model.config.vocab_size),
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


def _forward_step(data_iterator, model, *, vocab: int):
    """Megatron forward_step_func: the per-token loss sum and token count of one microbatch.

    The loss is over the model's real vocabulary: Megatron's padding columns (up to a multiple
    of 128 * tp) are masked out of the softmax, so it is the loss :func:`mnb.logits` implies.
    """
    batch = next(data_iterator)
    if batch is None:  # middle pipeline stage
        return model(None, None, None), None
    output = model(batch.get("tokens"), batch.get("position_ids"), None)  # last stage: [b, s, V_pad/tp]
    labels = batch["labels"]
    mask = batch["loss_mask"].reshape(-1).float()

    def loss_func(output_tensor):
        losses = vocab_loss(output_tensor, labels, vocab)
        loss_sum = torch.sum(losses.reshape(-1) * mask)
        count = mask.sum()
        return loss_sum, count.to(torch.int), {"lm loss": torch.stack([loss_sum, count])}

    return output, loss_func


def vocab_loss(local_logits: torch.Tensor, labels: torch.Tensor, vocab: int) -> torch.Tensor:
    """Per-token cross entropy ``[b, s]`` from this tp rank's logits ``[b, s, V_pad/tp]``, padding excluded."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    local = local_logits.float()
    width = local.shape[-1]
    columns = torch.arange(width, device=local.device) + ps.get_tensor_model_parallel_rank() * width
    # A large finite value, not -inf: a tp shard made only of padding must not turn its max into -inf.
    local = local.masked_fill(columns >= vocab, -1e30)
    losses = vocab_parallel_cross_entropy(local.transpose(0, 1).contiguous(), labels.transpose(0, 1).contiguous())
    return losses.transpose(0, 1)
