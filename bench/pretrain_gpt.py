"""A ``pretrain_gpt.py`` for mnb's exported launches: Megatron-LM's training loop on a GPT built from the arguments.

    MEGATRON_LM=bench bash train.sh --transformer-impl local --no-gradient-accumulation-fusion ...

``train.sh`` is ``%mnb export torchrun`` (``mnb.export("torchrun", ...)``); it runs
``torchrun ... "$MEGATRON_LM/pretrain_gpt.py" ARGS``.  This file stands where a Megatron-LM
checkout's ``pretrain_gpt.py`` would: megatron-core 0.19.2's wheel ships ``megatron.training``
(arguments, ``pretrain()``, the GPT builder from the arguments) but not the entry scripts.
What it adds is what the entry script adds: the datasets (``GPTDataset`` over ``--data-path`` with
``--split``, or ``MockGPTDataset`` under ``--mock-data``, sampled with ``--seed``) and the forward
step with the per-token loss (``--calculate-per-token-loss``: the sum over the microbatch and its
token count, which Megatron-LM adds up over the global batch before it divides).

Every rank builds its own data loader (``is_distributed``); fine for the one-node layouts the
benchmark runs (bench/gpu_export_run.py), where each rank reads its data-parallel share.
``MNB_INIT_FINGERPRINT=FILE`` (benchmark only): at the first forward, before any optimizer step,
write a per-parameter digest of the initial bf16 weights to FILE (bench/gpu_export_run.py compares
it with the notebook model's).  It prints ``first step at T s`` (seconds since the script started)
when its first forward on the last pipeline stage is done, so that a cold torchrun and a warm
``%mnb run`` of it can be compared (bench/gpu_run_script.py, with ``--mock-data``).

Not runnable on CPU ranks: ``initialize_megatron`` asserts ``torch.cuda.is_available()``.
"""

import time

T0 = time.perf_counter()

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from functools import partial  # noqa: E402

import torch  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.utils import get_blend_from_list
from megatron.core.enums import ModelType
from megatron.training import get_args, get_tokenizer
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
from megatron.training.arguments import parse_and_validate_args
from megatron.training.training import pretrain

_FINGERPRINT = {"file": os.environ.get("MNB_INIT_FINGERPRINT")}
FIRST_STEP = {"at_s": None}


def datasets_provider(train_val_test_num_samples):
    args = get_args()
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=get_blend_from_list(args.data_path),
        split=args.split, path_to_cache=args.data_cache_path, tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss, create_attention_mask=False, mid_level_dataset_surplus=0.005)
    kind = MockGPTDataset if args.mock_data else GPTDataset
    return BlendedMegatronDatasetBuilder(kind, train_val_test_num_samples, lambda: True, config).build()


datasets_provider.is_distributed = True


def loss_func(loss_mask, output_tensor):
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.stack([loss.detach(), num_tokens.detach().float()])}


def forward_step(data_iterator, model):
    if _FINGERPRINT["file"]:
        from gpu_export_run import weights_fingerprint

        with open(_FINGERPRINT["file"], "w") as handle:
            json.dump(weights_fingerprint(model.named_parameters()), handle)
        _FINGERPRINT["file"] = None
    batch = next(data_iterator)
    tokens, labels, loss_mask, position_ids = (batch[k].cuda(non_blocking=True)
                                               for k in ("tokens", "labels", "loss_mask", "position_ids"))
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
    args = parse_and_validate_args()
    cfg = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
    pretrain(cfg, datasets_provider, ModelType.encoder_or_decoder, forward_step)
    sys.exit(0)
