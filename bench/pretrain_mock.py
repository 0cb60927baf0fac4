"""Megatron-LM's ``pretrain()`` on mock data: the cold-vs-warm benchmark's workload (GPU only).

    torchrun --nproc-per-node 1 bench/pretrain_mock.py --num-layers 4 --hidden-size 1024 ...

Uses ``megatron.training`` as shipped in megatron-core 0.19.2's wheel: arguments
parsed by ``parse_and_validate_args``, the config container from
``pretrain_cfg_container_from_args`` + ``gpt_config_from_args``, Megatron's
``MockGPTDataset`` through ``BlendedMegatronDatasetBuilder``, and ``pretrain``.
Prints ``first step at T s`` (seconds since the script started) when its first
schedule call returns, so a cold torchrun and a warm ``%mnb run`` can be compared.

Not runnable on CPU ranks: ``initialize_megatron`` asserts ``torch.cuda.is_available()``
("Megatron requires CUDA") before anything else.
"""

import sys
import time

T0 = time.perf_counter()

from functools import partial  # noqa: E402

import torch  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.training import get_args, get_tokenizer  # noqa: E402
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args  # noqa: E402
from megatron.training.arguments import parse_and_validate_args  # noqa: E402
from megatron.training.training import pretrain  # noqa: E402

FIRST_STEP = {"at_s": None}


def datasets_provider(train_val_test_num_samples):
    args = get_args()
    config = GPTDatasetConfig(random_seed=args.seed, sequence_length=args.seq_length, reset_position_ids=False,
                              reset_attention_mask=False, eod_mask_loss=False, tokenizer=get_tokenizer(),
                              mid_level_dataset_surplus=0.005)
    return BlendedMegatronDatasetBuilder(MockGPTDataset, train_val_test_num_samples, lambda: True, config).build()


datasets_provider.is_distributed = True


def loss_func(loss_mask, output_tensor):
    losses = output_tensor.float().view(-1)
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    tokens, labels = batch["tokens"].cuda(non_blocking=True), batch["labels"].cuda(non_blocking=True)
    loss_mask, position_ids = batch["loss_mask"].cuda(), batch["position_ids"].cuda()
    output = model(tokens, position_ids, None, labels=labels)
    if FIRST_STEP["at_s"] is None and parallel_state.is_pipeline_last_stage():
        FIRST_STEP["at_s"] = time.perf_counter() - T0
        print(f"first step at {FIRST_STEP['at_s']:.2f} s", flush=True)
    return output, partial(loss_func, loss_mask)


def use_shipped_dataset_helpers() -> None:
    """megatron-core's wheel ships ``helpers_cpp`` built but not its Makefile, and Megatron-LM's
    ``initialize_megatron`` runs ``make`` on rank 0 anyway, which then fails ("No targets
    specified and no makefile found") and exits.  Keep the build when the shipped one imports."""
    import megatron.core.datasets.utils as dataset_utils

    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        return
    dataset_utils.compile_helpers = lambda: None


if __name__ == "__main__":
    use_shipped_dataset_helpers()
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer", "mock_data": True})
    cfg = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
    pretrain(cfg, datasets_provider, ModelType.encoder_or_decoder, forward_step)
    sys.exit(0)
