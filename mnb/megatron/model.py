"""``mnb.gpt``: this rank's part of a GPT model for the current layout.

Inside a ``%%megatron --tp 2 --pp 2`` cell (or after ``apply_layout``)::

    model = mnb.gpt("tiny")                       # preset from templates/presets/
    model = mnb.gpt("llama-1b", num_layers=8)     # Megatron TransformerConfig names
    model = mnb.gpt("tiny", hidden_dropout=0.1)   # unknown names go to TransformerConfig

The result is a :class:`MegatronModel`; ``mnb.train`` trains it and keeps the
DDP wrapper and optimizer on it, so a second ``mnb.train(model, ...)``
continues.  Initial weights do not depend on the layout (see
:mod:`mnb.megatron.weights`): tp=2, pp=2, dp=2 and a single rank all start
from the same model, so their losses can be compared step by step.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from mnb.config import TRANSFORMER_DEFAULTS, ModelConfig, ParallelConfig, model_config
from mnb.megatron import layout as _layout
from mnb.megatron.record import device_of

logger = logging.getLogger(__name__)

VOCAB_MULTIPLE = 128
"""Megatron-LM's default make_vocab_size_divisible_by (times tp)."""

MNB_DEFAULTS: dict[str, Any] = TRANSFORMER_DEFAULTS
"""TransformerConfig values mnb changes from Megatron's defaults (overridable; kept in mnb.config)."""


def fused_shapes(cfg: ModelConfig, ceiling: int, *, swiglu: bool, device: torch.device | None = None) -> dict:
    """The widths :func:`mnb.megatron.fusions.warm_up` compiles for ``cfg`` under every tp dividing ``ceiling``:
    its loss, RoPE (when it has one) and, with ``swiglu``, its SwiGLU, each unless mnb's own Triton kernel runs
    it on ``device`` (they compile nothing: ``serves_models_on`` of :mod:`~mnb.megatron.loss_kernels`,
    :mod:`~mnb.megatron.rope_kernels` and :mod:`~mnb.megatron.swiglu_kernels`).  Without ``device``, all of
    them (what a GPU without mnb's kernels compiles)."""
    from mnb.megatron import fusions, loss_kernels, rope_kernels, swiglu_kernels

    def compiles(kernels, *width) -> bool:  # width: the head dimension RoPE's kernel is probed at
        return device is None or not kernels.serves_models_on(device, *width)

    heads = cfg.num_attention_heads
    rope = cfg.position_embedding_type == "rope" and compiles(rope_kernels, cfg.head_dim)
    return fusions.model_shapes(
        (cfg.ffn_hidden_size or 4 * cfg.hidden_size) if swiglu and compiles(swiglu_kernels) else None,
        (lambda tp: padded_vocab_size(cfg.vocab_size, tp)) if compiles(loss_kernels) else None,
        (cfg.head_dim, heads // (cfg.num_query_groups or heads)) if rope else None,
        ceiling,
    )


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """Pad like Megatron-LM: up to a multiple of 128 * tp."""
    multiple = VOCAB_MULTIPLE * tp
    return -(-vocab_size // multiple) * multiple


@dataclass(eq=False)  # identity semantics: models are tracked in a WeakSet
class MegatronModel:
    """This rank's model chunks plus everything train/save need.

    Attributes:
        chunks: the unwrapped ``GPTModel`` of each virtual stage (one unless vpp > 1).
        config: the :class:`ModelConfig` (``extra`` holds TransformerConfig overrides).
        transformer_config: the Megatron ``TransformerConfig`` shared by the chunks.
        parallel: the layout (dp filled in) the chunks were built for.
        padded_vocab_size: vocabulary after padding to a multiple of 128 * tp.
        seed: the seed of the initial weights.
        wrapped: DDP-wrapped chunks (``None`` until the first ``train``).
        optimizer: the Megatron optimizer (``None`` until the first ``train``).
        steps_done / consumed_samples: training progress across ``train`` calls.
    """

    chunks: list[torch.nn.Module]
    config: ModelConfig
    transformer_config: Any
    parallel: ParallelConfig
    padded_vocab_size: int
    seed: int
    layout_generation: int
    wrapped: list[torch.nn.Module] | None = None
    optimizer: Any = None
    precision: str | None = None
    use_distributed_optimizer: bool | None = None
    fusions: bool = False
    """Whether mnb's fused ops (norms, loss, RoPE, SwiGLU: :mod:`mnb.megatron.fusions`) run in this model."""
    compile_keys: tuple = ()
    """The compiled kernels this model's fused ops need (``fusions.warm_keys``; empty where mnb's own Triton
    kernels run them all): what ``mnb.train`` waits on before its steps run fused, this model's and no other's."""
    steps_done: int = 0
    consumed_samples: int = 0
    scheduler: Any = None
    """Megatron's ``OptimizerParamScheduler`` (``None`` until the first ``train``): the learning-rate
    schedule and its step count, continued by later calls (:mod:`mnb.megatron.schedule`)."""
    train_settings: dict = field(default_factory=dict)
    """The TrainConfig fields earlier ``train`` calls named (and the schedule's length): a later call's defaults."""
    history: list[dict] = field(default_factory=list)
    released: str | None = None
    """Why this model's memory was freed (its layout was replaced), or None."""
    tokenizer: Any = None
    """The model's tokenizer: None = mnb's byte tokenizer; :func:`mnb.from_hf` sets the checkpoint's."""
    hf: Any = None
    """Where :func:`mnb.from_hf` read the model (:class:`mnb.megatron.hf.load.Source`), or None."""
    lora: Any = None
    """The :class:`mnb.config.LoraConfig` of the adapters :func:`mnb.lora` added, or None."""
    user_model: bool = False
    """Built by the user's own code (``mnb.train(module, forward_step_func=...)``), not by :func:`gpt`:
    its TransformerConfig's recompute settings are left as they are unless ``recompute`` is given."""
    decoder: Any = None
    """``mnb.generate``'s static KV caches and CUDA graphs (:class:`mnb.megatron.decode_graphs.GraphDecoder`),
    kept across calls; None until the first call on a CUDA rank, and again once released."""

    @property
    def modules(self) -> list[torch.nn.Module]:
        """The chunks as training sees them (DDP-wrapped once trained)."""
        return self.wrapped if self.wrapped is not None else self.chunks

    def num_parameters_local(self) -> int:
        """Parameters held by this rank (its shard of every chunk)."""
        return sum(p.numel() for chunk in self.chunks for p in chunk.parameters())

    def release(self, reason: str) -> None:
        """Drop parameters, DDP buffers, optimizer state and decode graphs; the model cannot be used after.
        The first reason stays (a later layout change found it released already: its message named that one)."""
        if self.released:
            return
        self.decoder = None
        self.wrapped = None
        self.optimizer = None
        self.scheduler = None
        self.chunks = []
        self.released = reason

    def check_layout(self) -> None:
        """Raise if the process groups were rebuilt since this model was built."""
        if self.released:
            raise RuntimeError(
                f"this model ({self.config.name}, {self.parallel.describe()}) was released because "
                f"{self.released}; build it again with mnb.gpt(...) (or mnb.save before the change "
                "and mnb.load after it)"
            )
        now = _layout.require_layout()
        if _layout.generation() != self.layout_generation:
            raise RuntimeError(
                f"this model was built for layout '{self.parallel.describe()}' but the ranks now "
                f"run '{now.describe()}'; build it again with mnb.gpt(...) (or save and load it)"
            )

    def __repr__(self) -> str:
        return (
            f"MegatronModel({self.config.name!r}, {self.parallel.describe()}, "
            f"chunks={len(self.chunks)}, local_params={self.num_parameters_local():,})"
        )


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (GPT-2's ``gelu_new``)."""
    return F.gelu(x, approximate="tanh")


_ACTIVATIONS = {"gelu": F.gelu, "gelu_tanh": _gelu_tanh, "silu": F.silu}
_last_model: "weakref.ref[MegatronModel] | None" = None
_built: "weakref.WeakSet[MegatronModel]" = weakref.WeakSet()


def _release_models(old: ParallelConfig | None, new: ParallelConfig) -> None:
    """Free the memory of every model built for the layout being replaced.

    Their process groups are about to be destroyed, so they can never run again;
    the notebook's names may still point at them, so the parameters, DDP buffers
    and optimizer state are dropped here rather than when the names go.
    """
    release_all(f"the layout changed from '{old.describe() if old else '?'}' to '{new.describe()}'")


def release_all(reason: str) -> None:
    """Free every model this rank built (their process groups are going away), saying ``reason``."""
    for model in list(_built):
        model.release(reason)
    import gc

    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


_layout.on_layout_change(_release_models)


def current_model() -> MegatronModel | None:
    """The model most recently built by :func:`gpt` on this rank, if it is still alive."""
    return _last_model() if _last_model is not None else None


def transformer_config(cfg: ModelConfig, parallel: ParallelConfig, *, fusions: bool = False):
    """Megatron ``TransformerConfig`` for ``cfg`` under ``parallel`` (fp32 params).

    ``fusions`` routes Megatron's RoPE through :mod:`mnb.megatron.fusions`
    (``apply_rope_fusion``); explicit TransformerConfig overrides still win.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mnb.megatron import cpu

    known = {f.name for f in dataclasses.fields(TransformerConfig)}
    extra = dict(cfg.extra)
    unknown = sorted(k for k in extra if k not in known)
    if unknown:
        raise ValueError(
            f"unknown model settings {unknown}: not ModelConfig fields and not Megatron "
            "TransformerConfig fields (check the spelling against megatron.core TransformerConfig)"
        )
    kwargs: dict[str, Any] = dict(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        ffn_hidden_size=cfg.ffn,
        kv_channels=cfg.head_dim,
        normalization=cfg.normalization,
        gated_linear_unit=cfg.gated_linear_unit,
        activation_func=_ACTIVATIONS[cfg.activation],
        add_bias_linear=cfg.add_bias_linear,
        add_qkv_bias=cfg.add_qkv_bias,
        init_method_std=cfg.init_method_std,
        layernorm_epsilon=cfg.layernorm_epsilon,
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=_layout.megatron_vpp(parallel.vpp),
        context_parallel_size=parallel.cp,
        expert_model_parallel_size=parallel.ep,
        sequence_parallel=parallel.sequence_parallel and parallel.tp > 1,
        pipeline_dtype=torch.float32,
        params_dtype=torch.float32,
        # CPU ranks: build master weights on the CPU (no CUDA RNG tracker needed).
        use_cpu_initialization=cpu.installed() or not torch.cuda.is_available(),
        calculate_per_token_loss=True,
        **MNB_DEFAULTS,
    )
    if cfg.is_moe:
        kwargs.update(
            num_moe_experts=cfg.num_moe_experts,
            moe_router_topk=cfg.moe_router_topk,
            moe_ffn_hidden_size=cfg.moe_ffn,
            moe_token_dispatcher_type="alltoall" if parallel.ep > 1 else "allgather",
        )
    if parallel.vpp > 1:
        # Interleaved 1F1B with batched p2p sends activations and gradients to the same
        # peer in one batch_isend_irecv; when pp == 2 the peer is the same rank in both
        # directions and gloo pairs the messages in posting order, swapping them (seen as
        # wrong losses from the third microbatch on).  Megatron-LM's own default for
        # interleaving is unbatched, overlapped p2p, which posts the two directions on
        # different groups.
        kwargs.update(overlap_p2p_comm=True, batch_p2p_comm=False)
    if fusions and cfg.position_embedding_type == "rope":
        from mnb.megatron.fusions import install_rope

        kwargs["apply_rope_fusion"] = install_rope()
    kwargs.update(extra)
    return TransformerConfig(**kwargs)


def gpt(preset_or_config: str | ModelConfig | dict = "tiny", *, seed: int | None = None,
        init: str = "layout_invariant", fusions: bool | str = "auto",
        **overrides: Any) -> MegatronModel:
    """Build this rank's part of a GPT for the current layout.

    Args:
        preset_or_config: a preset name (``mnb.presets.preset_names()``), a dict of
            ModelConfig fields, or a ModelConfig.
        seed: seed of the initial weights (default: the layout's seed, 1234).
        init: ``"layout_invariant"`` (same initial model under every layout) or
            ``"megatron"`` (Megatron's own per-rank initialisation).
        fusions: ``"auto"`` (compiled loss, RoPE and activation kernels on CUDA
            ranks with Triton, Megatron's unfused ops on CPU ranks), ``True``
            (refused where they cannot run) or ``False``.  See
            :mod:`mnb.megatron.fusions`.
        **overrides: ModelConfig or Megatron TransformerConfig fields, e.g.
            ``num_layers=8``, ``hidden_dropout=0.1``.  ``sequence_parallel``
            defaults to the layout's (``%%megatron --sp``); dropout defaults to 0.

    Raises RuntimeError without a layout, ValueError when the model cannot be
    split as the layout says (numbers in the message).
    """
    parallel = _layout.require_layout()
    if "sequence_parallel" in overrides:
        parallel = dataclasses.replace(parallel, sequence_parallel=bool(overrides.pop("sequence_parallel")))
    cfg = model_config(preset_or_config, **overrides)
    if init not in ("layout_invariant", "megatron"):
        raise ValueError(f"init must be 'layout_invariant' or 'megatron', got {init!r}")
    return build_model(cfg, parallel, seed=seed, init=init, fusions=fusions)


def build_model(cfg: ModelConfig, parallel: ParallelConfig, *, seed: int | None = None,
                init: str = "layout_invariant", fusions: bool | str = "auto") -> MegatronModel:
    """This rank's chunks of ``cfg`` under ``parallel`` (:func:`gpt` after parsing its arguments).

    ``init="none"`` builds uninitialised weights (Megatron's ``perform_initialization=False``),
    for callers that fill every weight themselves (:func:`mnb.from_hf`).
    """
    cfg.check_parallel(parallel)
    if cfg.is_moe and parallel.tp > 1 and not parallel.sequence_parallel:
        raise ValueError(
            f"Megatron-Core trains MoE models with tp({parallel.tp}) > 1 only under sequence "
            "parallelism: use %%megatron --sp, or mnb.gpt(..., sequence_parallel=True)"
        )
    seed = 1234 if seed is None else seed
    from megatron.core import parallel_state as ps

    from mnb.megatron import compat
    from mnb.megatron import fusions as _fusions
    from mnb.megatron.spec import block_spec
    from mnb.megatron.weights import init_layout_invariant

    compat.apply()
    # A model dropped by the previous cell (DDP hooks and the optimizer form reference
    # cycles) is only freed by a collection: do it before allocating the next one, so a
    # rebuilt model does not briefly need twice the memory.
    import gc

    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()

    device = device_of()
    if cfg.fp8 is not None:  # before any collective: every rank refuses alike on a CPU or pre-Ada pool
        from mnb.megatron import fp8 as _fp8

        reason = _fp8.refusal(device)
        if reason:
            raise ValueError(reason)
    fused = _fusions.resolve(fusions, device)
    tconfig = transformer_config(cfg, parallel, fusions=fused)
    if init == "none":
        tconfig.perform_initialization = False
    model_class = _gpt_class(fused_loss=fused and not tconfig.cross_entropy_loss_fusion)
    vocab = padded_vocab_size(cfg.vocab_size, parallel.tp)
    interleaved = parallel.vpp > 1
    torch.manual_seed(seed)
    chunks = []
    for stage in range(parallel.vpp):
        vp_stage = stage if interleaved else None
        if interleaved:
            first = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage)
            last = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage)
        else:
            first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        chunk = model_class(
            config=tconfig,
            transformer_layer_spec=block_spec(cfg, tconfig, vp_stage=vp_stage, fused=fused),
            vocab_size=vocab,
            max_sequence_length=cfg.max_position_embeddings,
            pre_process=first,
            post_process=last,
            share_embeddings_and_output_weights=cfg.share_embeddings_and_output_weights,
            position_embedding_type=cfg.position_embedding_type,
            rotary_base=cfg.rotary_base,
            rope_scaling=cfg.rope_scaling,
            rope_scaling_factor=cfg.rope_scaling_factor,
            vp_stage=vp_stage,
        )
        chunk.real_vocab_size = cfg.vocab_size if cfg.vocab_size < vocab else None
        chunks.append(chunk)
    if device.type == "cuda":
        # Megatron's parallel layers allocate on the GPU themselves, but plain torch modules
        # of the local spec (norms) start on the CPU: move whole chunks, as Megatron-LM's
        # training loop does right after building.
        for chunk in chunks:
            chunk.cuda(device)
    if init == "layout_invariant":
        init_layout_invariant(chunks, tconfig, seed)
    if init == "none":
        mark_tensor_parallel(chunks)
    if cfg.fp8 is not None:
        from mnb.megatron import fp8 as _fp8

        _fp8.install(chunks, cfg.fp8)
    compile_keys: tuple = ()
    if fused:
        from mnb.megatron import background_compile, norm_kernels
        from mnb.megatron.spec import uses_fused_swiglu

        norm_kernels.runs_on(device, cfg.hidden_size)  # their probe at this width here, not inside a first forward
        # what mnb's own kernels do not run (fused_shapes probes them), compiled in the background, bf16, once
        # per process and width (fp32 training compiles its own): the first steps run the same arithmetic
        # unfused meanwhile (background_compile).  Where mnb's kernels run, nothing is left to compile.
        shapes = fused_shapes(cfg, _fusions.tp_ceiling(), swiglu=uses_fused_swiglu(chunks), device=device)
        compile_keys = tuple(_fusions.warm_keys(**shapes))
        if background_compile.start(device, shapes) is not None and torch.distributed.get_rank() == 0:
            kinds = _fusions.compiled_kinds(compile_keys)
            print(f"mnb: compiling the fused {kinds} kernels in the background; the first training steps run "
                  "them unfused until they are ready (mnb.gpt(..., fusions=False) skips them)", flush=True)
    global _last_model
    model = MegatronModel(
        chunks=chunks,
        config=cfg,
        transformer_config=tconfig,
        parallel=parallel,
        padded_vocab_size=vocab,
        seed=seed,
        layout_generation=_layout.generation(),
        fusions=fused,
        compile_keys=compile_keys,
    )
    _last_model = weakref.ref(model)
    _built.add(model)
    return model


def mark_tensor_parallel(chunks: list) -> None:
    """Tag each parallel layer's weight as split over tp, as Megatron does when it initialises them.

    Megatron sets ``tensor_model_parallel``/``partition_dim`` only inside its initialisers, so
    with ``perform_initialization=False`` (how ``mnb.from_hf`` builds, before it reads the
    checkpoint) those weights looked like tp duplicates: the gradient norm and its clipping
    counted their shard on tp rank 0 only, and a tp2 fine-tune clipped differently from tp1.
    """
    from megatron.core import tensor_parallel

    split = ((tensor_parallel.ColumnParallelLinear, 0), (tensor_parallel.RowParallelLinear, 1),
             (tensor_parallel.VocabParallelEmbedding, 0))
    for chunk in chunks:
        for module in chunk.modules():
            weight = getattr(module, "weight", None)
            dim = next((d for kind, d in split if isinstance(module, kind)), None)
            if dim is not None and weight is not None and not getattr(weight, "tensor_model_parallel", False):
                tensor_parallel.set_tensor_model_parallel_attributes(weight, True, dim, 1)


@functools.lru_cache(maxsize=2)
def _gpt_class(*, fused_loss: bool):
    """Megatron's ``GPTModel`` with mnb's one loss rule: the cross entropy over the real vocabulary.

    Megatron pads the vocabulary to a multiple of 128 * tp; its loss would count those padding
    columns in the softmax (an HF fine-tune's loss then differed from transformers').  Here they
    are hidden from the loss (:func:`hide_vocab_padding`) in training and evaluation alike.
    ``fused_loss``: the loss is :func:`mnb.megatron.fusions.language_model_loss`, same
    arithmetic as Megatron's unfused loss.  Parameters, state dicts and checkpoints are GPTModel's.
    """
    from megatron.core.models.gpt import GPTModel

    class MnbGPTModel(GPTModel):
        real_vocab_size: int | None = None  # set by build_model; None: no padding to hide

        def compute_language_model_loss(self, labels, logits):
            hide_vocab_padding(logits, self.real_vocab_size)
            if fused_loss:
                from mnb.megatron.fusions import language_model_loss

                return language_model_loss(labels, logits, self.pg_collection.tp)
            return super().compute_language_model_loss(labels, logits)

    if fused_loss:  # the name says which loss runs (tests and a user's type(model.chunks[0]) read it)
        MnbGPTModel.__name__ = MnbGPTModel.__qualname__ = "FusedLossGPTModel"
    return MnbGPTModel


def hide_vocab_padding(local_logits: torch.Tensor, vocab: int | None) -> torch.Tensor:
    """Set this tp rank's logits ``[..., V_pad/tp]`` of padding columns (ids >= ``vocab``) to the
    dtype's lowest value, in place, so a softmax gives them nothing (and they get no gradient)."""
    from megatron.core import parallel_state as ps

    if vocab is None:
        return local_logits
    width = local_logits.shape[-1]
    first = ps.get_tensor_model_parallel_rank() * width
    if first + width > vocab:
        local_logits[..., max(vocab - first, 0):] = torch.finfo(local_logits.dtype).min
    return local_logits
