"""Which samples each rank reads, step by step.

The global batch of step ``i`` (counting from the model's first step) is
samples ``[c + i*G, c + (i+1)*G)`` of the dataset, ``G`` = global batch size,
``c`` = samples consumed by earlier ``train`` calls.  Like Megatron-LM's
``MegatronPretrainingSampler``, microbatch ``j`` of data-parallel rank ``d``
reads ``mbs`` samples starting at ``c + i*G + j*mbs*dp + d*mbs``.  So every
layout sees the same samples in each global batch (only their split over dp
ranks and microbatches changes); tp ranks read the same batch; cp ranks read
their chunks of its sequences; only the first and last pipeline stages read
data at all.

Sample ``k`` is the same whatever the run's length (:class:`EpochSamples`): a run of
10 steps and one of 20 start with the same batches, as do 10 steps in one call and
in two.  Megatron's ``GPTDataset`` shuffles over as many epochs as the requested
sample count needs, so sizing it by the run changed every sample from the first on
once the run outgrew one epoch of a small corpus.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

KEYS = ("tokens", "labels", "loss_mask", "position_ids")


@dataclass(frozen=True)
class BatchPlan:
    start_sample: int
    micro_batch_size: int
    num_microbatches: int
    dp: int
    dp_rank: int

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.dp * self.num_microbatches

    def indices(self, step: int, microbatch: int) -> range:
        """Dataset indices of ``microbatch`` on this dp rank in the call's ``step``-th step."""
        mbs = self.micro_batch_size
        first = (self.start_sample + step * self.global_batch_size
                 + microbatch * mbs * self.dp + self.dp_rank * mbs)
        return range(first, first + mbs)

    def dataset(self, tc, model) -> "EpochSamples":
        """The run's samples, numbered independently of its length (built collectively on all ranks)."""
        return samples(model, tc.data, tc.seed, pack=getattr(tc, "pack", True),
                       truncate=getattr(tc, "truncate", False))


def samples(model, data: str, seed: int, *, pack: bool = True, truncate: bool = False) -> "EpochSamples":
    """The samples of ``data`` as ``model`` reads them: the one place training and evaluation get data.

    Sequences of the model's ``seq_length``; text through the model's own tokenizer
    (``model.tokenizer``: a Hugging Face checkpoint's, or None for mnb's byte tokenizer);
    sample ``k`` independent of how many are read (:class:`EpochSamples`).  ``mnb.train`` reads
    ``data`` with ``seed`` from its ``consumed_samples`` on; ``mnb.evaluate`` reads the first
    samples with its fixed seed, so the same text and seed give both the same tokens.

    Instruction data (``.jsonl`` rows, :mod:`mnb.megatron.instructions`): examples shuffled by
    ``seed``, ``pack``-ed several to a sequence where the layout isolates them, rows longer
    than a sequence refused unless ``truncate``; its samples carry ``segment_ids`` when packed,
    which :func:`microbatch_iterators` turns into the attention mask every stage needs.
    A collective for text (Megatron builds its sample indices on global rank 0): call it on
    every rank.
    """
    from mnb.megatron import instructions

    files = instructions.files_of(data)
    if files is not None:
        return EpochSamples(instructions.samples(model, files, seed, pack=pack, truncate=truncate), seed)
    first_epoch = build_dataset(data, model.config, model.config.seq_length, 1, seed,
                                tokenizer=getattr(model, "tokenizer", None))
    return EpochSamples(first_epoch, seed)


class EpochSamples:
    """Samples ``0, 1, 2, ...`` without end: Megatron's first epoch in its own shuffled order, then
    each later epoch ``e`` in a permutation of that epoch drawn from ``(seed, e)``.

    Megatron's dataset is built for one sample (it then holds one whole epoch), never for the
    run's sample count: the count sets how many epochs Megatron shuffles together, which changed
    the order from the first sample on (a run of 20 steps started on other batches than one
    of 10).  Within the first epoch the samples are exactly Megatron's.
    """

    def __init__(self, first_epoch, seed: int):
        self.first_epoch = first_epoch
        self.seed = seed
        self.epoch_size = len(first_epoch)
        self._order: tuple[int, np.ndarray] | None = None  # the latest later epoch's permutation

    @property
    def packed(self) -> bool:
        """Whether samples carry ``segment_ids`` (packed instruction examples)."""
        return bool(getattr(self.first_epoch, "packed", False))

    @property
    def data_prefix(self) -> str | None:
        """The Megatron ``.bin/.idx`` prefix these samples are read from (text data: the one mnb built or
        was given), or None (mock tokens, instruction rows); ``%mnb export`` passes it as ``--data-path``."""
        prefix = getattr(getattr(self.first_epoch, "dataset", None), "path_prefix", None)
        return None if prefix is None else str(prefix)

    @property
    def packing(self) -> dict | None:
        """How full the sequences are (instruction data), for the run record; None for text."""
        summary = getattr(self.first_epoch, "summary", None)
        return summary() if summary is not None else None

    def __getitem__(self, index: int):
        epoch, within = divmod(int(index), self.epoch_size)
        if epoch:
            if self._order is None or self._order[0] != epoch:
                self._order = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.epoch_size))
            within = int(self._order[1][within])
        return self.first_epoch[within]


def build_dataset(data: str, model_config, seq_length: int, num_samples: int, seed: int, *,
                  tokenizer):
    """``mnb.megatron.data.dataset_for`` (mock, corpus presets, text folders, .bin/.idx).

    Text is tokenized with ``tokenizer`` (None: mnb's byte tokenizer), which has no default: a
    caller that forgot it read a checkpoint's text as bytes.  Reading a model's data, call
    :func:`samples`, which passes the model's own.
    """
    try:
        from mnb.megatron.data import dataset_for
    except ImportError as err:
        if data != "mock":
            raise RuntimeError(
                f"data={data!r} needs mnb.megatron.data.dataset_for, which failed to import "
                f"({err}); use data='mock' or repair the installation"
            ) from err
        return _mock_dataset(model_config.vocab_size, seq_length, num_samples, seed)
    return dataset_for(data, model_config, seq_length, num_samples, seed, tokenizer=tokenizer)


def _mock_dataset(vocab_size: int, seq_length: int, num_samples: int, seed: int):
    """Megatron's MockGPTDataset, without mnb.megatron.data (fallback only)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
    )
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset

    class _Tokenizer:
        vocab_size = vocab_size
        eod = vocab_size - 1
        unique_identifiers = {"class": "mnb-mock", "vocab_size": vocab_size}

    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False,
        tokenizer=_Tokenizer(),
    )
    config.split_matrix = convert_split_vector_to_split_matrix([1.0, 0.0, 0.0])
    train, _, _ = BlendedMegatronDatasetBuilder(
        MockGPTDataset, [num_samples, None, None], lambda: True, config
    ).build()
    return train


def _collate(dataset, indices: range, device) -> dict[str, torch.Tensor]:
    items = [dataset[i] for i in indices]
    batch = {key: torch.stack([torch.as_tensor(item[key]) for item in items])
             for key in (*KEYS, "segment_ids") if key in items[0]}
    if "segment_ids" in batch:  # packed examples: each attends to itself alone
        from mnb.megatron.instructions import attention_mask

        batch["attention_mask"] = attention_mask(batch.pop("segment_ids"))
    if device.type != "cuda":
        return batch
    # A copy from pageable host memory waits for the GPU to finish its queued work,
    # which would stall the CPU once per microbatch and leave the GPU idle while the
    # next forward is launched; pinned memory + non_blocking keeps the queue full.
    return {key: value.pin_memory().to(device, non_blocking=True) for key, value in batch.items()}


def _microbatches(dataset, plan: BatchPlan, step: int, device):
    from megatron.core import parallel_state as ps

    from mnb.megatron.context_parallel import split_batch

    group = ps.get_context_parallel_group()
    # Every microbatch of the step is copied up front, before the schedule's first kernel.
    batches = [_collate(dataset, plan.indices(step, j), device) for j in range(plan.num_microbatches)]
    # Context parallelism: this rank's 2 of the 2*cp sequence chunks (Megatron's split).
    return iter([split_batch(batch, group) for batch in batches])


def microbatch_iterators(dataset, plan: BatchPlan, step: int, chunks, device) -> list:
    """One iterator per model chunk; chunks without embedding or loss get ``None``s, or, for
    packed examples, ``{"attention_mask"}`` alone (every stage's attention needs it)."""
    iterators = []
    packed = getattr(dataset, "packed", False)
    for chunk in chunks:
        if getattr(chunk, "pre_process", True) or getattr(chunk, "post_process", True):
            iterators.append(_microbatches(dataset, plan, step, device))
        elif packed:
            iterators.append(iter([{"attention_mask": batch["attention_mask"]}
                                   for batch in _microbatches(dataset, plan, step, device)]))
        else:
            iterators.append(iter([None] * plan.num_microbatches))
    return iterators


def model_inputs(batch: dict | None) -> tuple:
    """``(tokens, position_ids, attention_mask)`` of a microbatch for ``GPTModel.forward``
    (``None``s where the stage reads none)."""
    if batch is None:
        return None, None, None
    return batch.get("tokens"), batch.get("position_ids"), batch.get("attention_mask")


class Finite:
    """The first ``count`` samples of ``dataset``, then samples with nothing in the loss:
    ``mnb.evaluate(batches=None)`` reads every sample once in whole batches."""

    def __init__(self, dataset, count: int) -> None:
        self.dataset, self.count = dataset, count
        self.packed = getattr(dataset, "packed", False)

    def __getitem__(self, index: int):
        if index < self.count:
            return self.dataset[index]
        item = dict(self.dataset[0])
        item["loss_mask"] = torch.zeros_like(torch.as_tensor(item["loss_mask"]))
        return item


def forward_step(data_iterator, model):
    """Megatron ``forward_step_func`` of ``mnb.train`` and ``mnb.evaluate``: one loss rule.

    One microbatch through one model chunk; the last stage's loss function returns the sum of
    the per-token losses where ``loss_mask`` is set and their count (``calculate_per_token_loss``).
    The per-token loss is the model's own (``MnbGPTModel.compute_language_model_loss``): the
    cross entropy over the real vocabulary, Megatron's padding columns hidden, as transformers
    computes it for a Hugging Face checkpoint.
    """
    batch = next(data_iterator)
    labels = None if batch is None else batch.get("labels")
    if labels is None:  # middle pipeline stage: input comes from the previous stage
        return model(*model_inputs(batch)), None
    output = model(*model_inputs(batch), labels=labels)
    loss_mask = batch["loss_mask"]

    def loss_func(output_tensor):
        losses = output_tensor.float().reshape(-1)
        mask = loss_mask.reshape(-1).float()
        loss_sum = torch.sum(losses * mask)
        num_tokens = mask.sum().to(torch.int)
        report = torch.stack([loss_sum.detach(), num_tokens.detach().float()])
        return loss_sum, num_tokens, {"lm loss": report}

    return output, loss_func
