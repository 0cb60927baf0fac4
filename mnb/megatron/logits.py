"""``mnb.logits(model, token_ids)``: fp32 next-token logits of any model mnb built, under any layout.

Inside a ``%%megatron`` cell, on every rank::

    model = mnb.from_hf("/models/Llama-3.2-1B")          # or mnb.gpt("tiny")
    out = mnb.logits(model, [[1, 2, 3, 4]])              # torch.Tensor [1, 4, vocab], fp32

The result is the same tensor on every rank: gathered over tp (the vocabulary), over cp
(the sequence, from Megatron's 2*cp-chunk layout) and broadcast from the last pipeline
stage.  Its last dimension is the checkpoint's real vocabulary: Megatron's padding rows are
cut before anything leaves this module.  Sequences are padded at the end to what sequence
and context parallelism need (causal attention: padding never changes earlier logits).

:func:`last_stage_logits` is the inner forward, for callers that need only the last stage's
result (generation): tokens and positions in, ``[b, s, vocab]`` out on the last pipeline
stage, ``None`` on the others.
"""

from __future__ import annotations

from typing import Any

import torch


def _as_tokens(token_ids: Any, vocab_size: int) -> torch.Tensor:
    """``token_ids`` as a ``[batch, tokens]`` int64 CPU tensor; ValueError for anything else."""
    try:
        tokens = torch.as_tensor(token_ids)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"token_ids must be a [batch, tokens] list or tensor of integers ({exc})") from None
    if tokens.numel() == 0:  # an empty list is a float tensor: say what is wrong, not its dtype
        raise ValueError(f"token_ids must be [batch, tokens] with at least one token, got shape {list(tokens.shape)}")
    if tokens.dtype.is_floating_point or tokens.dtype == torch.bool or tokens.dtype.is_complex:
        raise ValueError(f"token_ids must be integers, got {tokens.dtype}")
    if tokens.dim() == 1:
        tokens = tokens.unsqueeze(0)
    if tokens.dim() != 2 or tokens.numel() == 0:
        raise ValueError(f"token_ids must be [batch, tokens] with at least one token, got shape {list(tokens.shape)}")
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(f"token id {low if low < 0 else high} is outside the vocabulary [0, {vocab_size})")
    return tokens.to(torch.long).cpu()


def _multiple(parallel) -> int:
    """Sequence lengths the layout can split: 2*cp chunks, each a multiple of tp under sp."""
    sp = parallel.tp if parallel.sequence_parallel and parallel.tp > 1 else 1
    return 2 * parallel.cp * sp if parallel.cp > 1 else sp


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    if batch is None:  # a middle stage: its input arrives from the previous stage
        return model(None, None, None), _keep
    return model(batch["tokens"], batch["position_ids"], None), _keep


def _keep(output, non_loss_data: bool = False):
    return output.detach()


def last_stage_logits(model, tokens: torch.Tensor, position_ids: torch.Tensor | None = None
                      ) -> torch.Tensor | None:
    """This rank's logits for ``tokens`` ``[b, s]`` (positions default ``0..s-1``); collective.

    On the last pipeline stage: fp32 ``[b, s, vocab]``, gathered over tp and cp and cut to
    the real vocabulary; on the other stages ``None``.  ``s`` need not suit the layout:
    the sequence is padded at the end for sp/cp and the padding cut again.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from mnb.megatron.context_parallel import gather_sequence, split_batch
    from mnb.megatron.record import device_of

    model.check_layout()
    parallel, cfg = model.parallel, model.config
    batch, seq = tokens.shape
    padded = -(-seq // _multiple(parallel)) * _multiple(parallel)
    if cfg.position_embedding_type == "learned_absolute" and padded > cfg.max_position_embeddings:
        raise ValueError(f"{seq} tokens (padded to {padded} for the layout) exceed max_position_embeddings"
                         f"({cfg.max_position_embeddings}) of this model's learned positions; pass fewer tokens")
    if cfg.sliding_window is not None and seq > cfg.sliding_window:
        raise ValueError(f"{seq} tokens exceed this model's sliding_window ({cfg.sliding_window}): Megatron's local "
                         "attention has no sliding window, so past it the logits would not be the model's; pass at "
                         f"most {cfg.sliding_window} tokens")
    device = device_of()
    if position_ids is None:
        position_ids = torch.arange(seq).expand(batch, seq)
    pad = padded - seq
    tokens = torch.nn.functional.pad(tokens, (0, pad)).to(device)
    position_ids = torch.nn.functional.pad(position_ids.to(torch.long), (0, pad)).to(device)
    # The interleaved schedule needs at least pp microbatches: split the batch, padding it with copies.
    microbatches = parallel.pp if parallel.vpp > 1 else 1
    mbs = -(-batch // microbatches)
    extra = mbs * microbatches - batch
    if extra:
        tokens = torch.cat([tokens, tokens[-1:].expand(extra, -1)])
        position_ids = torch.cat([position_ids, position_ids[-1:].expand(extra, -1)])
    cp_group = ps.get_context_parallel_group()
    parts = [split_batch({"tokens": tokens[i * mbs:(i + 1) * mbs], "position_ids": position_ids[i * mbs:(i + 1) * mbs]},
                         cp_group) for i in range(microbatches)]
    chunks = model.modules
    iterators = []
    for chunk in model.chunks:
        ends = getattr(chunk, "pre_process", True) or getattr(chunk, "post_process", True)
        iterators.append(iter(parts if ends else [None] * microbatches))
    config = model.transformer_config
    was_training = [c.training for c in chunks]
    timers, config.timers = config.timers, None
    try:
        for c in chunks:
            c.eval()
        with torch.no_grad():
            outputs = get_forward_backward_func()(
                forward_step_func=_forward_step,
                data_iterator=iterators if len(iterators) > 1 else iterators[0],
                model=chunks if len(chunks) > 1 else chunks[0],
                num_microbatches=microbatches, seq_length=padded, micro_batch_size=mbs,
                decoder_seq_length=padded, forward_only=True, collect_non_loss_data=True,
            )
    finally:
        config.timers = timers
        for c, mode in zip(chunks, was_training):
            c.train(mode)
    if not ps.is_pipeline_last_stage():
        return None
    local = torch.cat([o.float() for o in outputs])  # [b', s/cp, V_pad/tp]
    tp_group = ps.get_tensor_model_parallel_group()
    if tp_group.size() > 1:
        shards = [torch.empty_like(local) for _ in range(tp_group.size())]
        torch.distributed.all_gather(shards, local.contiguous(), group=tp_group)
        local = torch.cat(shards, dim=-1)
    local = local[..., :cfg.vocab_size]
    full = gather_sequence(local.transpose(0, 1).contiguous(), cp_group).transpose(0, 1)
    return full[:batch, :seq].contiguous()


def logits(model, token_ids: Any) -> torch.Tensor:
    """fp32 logits ``[batch, tokens, vocab]`` of ``model`` for ``token_ids``, the same on every rank.

    ``token_ids``: a list of token lists (equal lengths), a 1-D list (one sequence) or an integer
    tensor.  ``vocab`` is the model's real vocabulary (``model.config.vocab_size``), never Megatron's
    padded one.  Collective: call it on every rank of the pool (any layout).
    """
    from megatron.core import parallel_state as ps

    from mnb.megatron.record import device_of

    tokens = _as_tokens(token_ids, model.config.vocab_size)
    out = last_stage_logits(model, tokens)
    if ps.get_pipeline_model_parallel_world_size() > 1:
        shape = (tokens.shape[0], tokens.shape[1], model.config.vocab_size)
        if out is None:
            out = torch.empty(shape, dtype=torch.float32, device=device_of())
        group = ps.get_pipeline_model_parallel_group()
        torch.distributed.broadcast(out, src=ps.get_pipeline_model_parallel_last_rank(), group=group)
    return out

