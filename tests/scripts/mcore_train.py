"""Train a small GPT with Megatron-Core, in the style of Megatron-LM's examples/run_simple_mcore_train_loop.py.

    torchrun --nproc-per-node 2 tests/scripts/mcore_train.py --tp 2 --steps 3 --ckpt /tmp/ckpt

A model provider, Megatron's mock GPT dataset, DDP + Megatron's optimizer,
``get_forward_backward_func`` with ``finalize_model_grads``, then a distributed
checkpoint saved and loaded back into a fresh model.  Written for GPUs (``nccl``,
``set_device``, ``.cuda()``).
"""

import argparse
import os
from functools import partial
from importlib.metadata import version

import torch
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.tokenizers import MegatronTokenizer
from megatron.core.transformer.transformer_config import TransformerConfig

SEQ, VOCAB = 32, 256


def initialize_distributed(tp: int, pp: int) -> None:
    parallel_state.destroy_model_parallel()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.distributed.init_process_group(backend="nccl", world_size=world_size, rank=rank)
    parallel_state.initialize_model_parallel(tp, pp)


def model_provider() -> GPTModel:
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                               pipeline_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                    max_sequence_length=SEQ)


def get_train_data_iterator(samples: int):
    library = "null" if version("megatron-core").startswith("0.16") else "null-text"  # renamed in 0.17+
    tokenizer = MegatronTokenizer.from_pretrained(metadata_path={"library": library}, vocab_size=VOCAB - 8)
    config = GPTDatasetConfig(random_seed=0, sequence_length=SEQ, reset_position_ids=False,
                              reset_attention_mask=False, eod_mask_loss=False, tokenizer=tokenizer)
    datasets = BlendedMegatronDatasetBuilder(MockGPTDataset, [samples, None, None], lambda: True, config).build()
    return iter(torch.utils.data.DataLoader(datasets[0], batch_size=2, shuffle=False))


def forward_step_func(data_iterator, model):
    def loss_func(loss_mask, output_tensor):
        losses = output_tensor.float()
        loss_mask = loss_mask.view(-1).float()
        loss = torch.sum(losses.view(-1) * loss_mask) / loss_mask.sum()
        return loss, {"lm loss": loss.detach()}

    data = next(data_iterator)
    tokens, labels = data["tokens"].cuda(), data["labels"].cuda()
    position_ids, loss_mask = data["position_ids"].cuda(), data["loss_mask"].cuda()
    output_tensor = model(tokens, position_ids, None, labels=labels)
    return output_tensor, partial(loss_func, loss_mask)


def save_distributed_checkpoint(checkpoint_path, gpt_model):
    dist_checkpointing.save(sharded_state_dict=gpt_model.sharded_state_dict(prefix=""), checkpoint_dir=checkpoint_path)


def load_distributed_checkpoint(checkpoint_path, gpt_model):
    state_dict = dist_checkpointing.load(sharded_state_dict=gpt_model.sharded_state_dict(prefix=""),
                                         checkpoint_dir=checkpoint_path)
    gpt_model.load_state_dict(state_dict)
    return gpt_model


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--ckpt", required=True)
    args = parser.parse_args()

    initialize_distributed(tp=args.tp, pp=1)
    model_parallel_cuda_manual_seed(123)
    gpt_model = model_provider().cuda()
    ddp_model = DistributedDataParallel(gpt_model.config, DistributedDataParallelConfig(), gpt_model)
    gpt_model.config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=3e-3), [ddp_model])
    dp = parallel_state.get_data_parallel_world_size()
    train_iterator = get_train_data_iterator(samples=args.steps * args.microbatches * 2 * dp)
    forward_backward_func = get_forward_backward_func()

    losses = []
    for step in range(args.steps):
        ddp_model.zero_grad_buffer()
        optimizer.zero_grad()
        losses_reduced = forward_backward_func(
            forward_step_func=forward_step_func, data_iterator=train_iterator, model=[ddp_model],
            num_microbatches=args.microbatches, seq_length=SEQ, micro_batch_size=2, decoder_seq_length=SEQ,
            forward_only=False)
        update_successful, grad_norm, _ = optimizer.step()
        losses.append(sum(float(x["lm loss"]) for x in losses_reduced) / len(losses_reduced))
        print(f"step {step}: loss {losses[-1]:.4f}")

    os.makedirs(args.ckpt, exist_ok=True)
    save_distributed_checkpoint(args.ckpt, gpt_model)
    reloaded = load_distributed_checkpoint(args.ckpt, model_provider().cuda())
    same = all(torch.equal(a, b) for a, b in zip(gpt_model.state_dict().values(), reloaded.state_dict().values())
               if isinstance(a, torch.Tensor))
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    print(f"checkpoint reloaded identical: {same}; tp {tp_size}")
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
