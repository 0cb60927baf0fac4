"""Per-step memory readings for run records.

GPU ranks read PyTorch's caching allocator (``torch.cuda.memory_allocated``,
``max_memory_allocated``, ``memory_reserved``; the peak is reset at the start
of each step).  CPU ranks have no allocator statistics: they report the
process's resident set size (psutil RSS), with the peak taken as the largest
RSS sampled during the step (sampled whenever a schedule timer stops), so the
numbers include the Python interpreter, Megatron and the dataset.  Readings
carry ``source`` ("cuda" or "rss") so plots can label them.
"""

from __future__ import annotations

from typing import Any

import torch

MEMORY_POINTS = 4000
"""At most this many points of the CUDA allocator's bytes over time go into the meta file (each kept
point the largest of its stretch, so the peak is kept exactly)."""
BLOCK_BYTES = 512
"""The CUDA caching allocator's block rounding (``kMinBlockSize``): what ``allocated_bytes`` counts."""


class MemoryMeter:
    """Memory of this rank, step by step."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.source = "cuda" if self.device.type == "cuda" else "rss"
        self._process = None
        if self.source == "rss":
            import psutil

            self._process = psutil.Process()
        self._step_peak = 0
        self.peak_allocated_bytes = 0
        self.peak_reserved_bytes = 0

    def _rss(self) -> int:
        return int(self._process.memory_info().rss)

    def begin_step(self) -> None:
        if self.source == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._step_peak = self._rss()

    def sample(self) -> None:
        """Note the current RSS (CPU); a no-op on GPU, where the allocator tracks peaks."""
        if self.source == "rss":
            self._step_peak = max(self._step_peak, self._rss())

    def end_step(self) -> dict[str, int]:
        """{"mem_allocated_bytes", "mem_peak_bytes", "mem_reserved_bytes"} for the step just run."""
        if self.source == "cuda":
            reading = {
                "mem_allocated_bytes": int(torch.cuda.memory_allocated(self.device)),
                "mem_peak_bytes": int(torch.cuda.max_memory_allocated(self.device)),
                "mem_reserved_bytes": int(torch.cuda.memory_reserved(self.device)),
            }
            reserved_peak = int(torch.cuda.max_memory_reserved(self.device))
        else:
            rss = self._rss()
            self._step_peak = max(self._step_peak, rss)
            reading = {
                "mem_allocated_bytes": rss,
                "mem_peak_bytes": self._step_peak,
                "mem_reserved_bytes": rss,
            }
            reserved_peak = self._step_peak
        self.peak_allocated_bytes = max(self.peak_allocated_bytes, reading["mem_peak_bytes"])
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, reserved_peak)
        return reading

    def capacity_bytes(self) -> int | None:
        """Total memory of the GPU; None on CPU."""
        if self.source == "cuda":
            return int(torch.cuda.get_device_properties(self.device).total_memory)
        return None

    def now(self) -> dict[str, int | None]:
        """Current allocated / peak / reserved bytes, for error messages."""
        if self.source == "cuda":
            return {
                "allocated": int(torch.cuda.memory_allocated(self.device)),
                "peak": int(torch.cuda.max_memory_allocated(self.device)),
                "reserved": int(torch.cuda.memory_reserved(self.device)),
                "capacity": self.capacity_bytes(),
            }
        rss = self._rss()
        return {"allocated": rss, "peak": max(rss, self._step_peak), "reserved": rss, "capacity": None}

    def summary(self) -> dict[str, int | None]:
        return {
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "capacity_bytes": self.capacity_bytes(),
        }


class ComponentMeter:
    """What a rank holds, by component, counted from the tensors themselves (any device).

    - ``weights``: the storages of the model's parameters (bf16 copies, or the
      distributed optimizer's contiguous parameter buffer); under Megatron-FSDP its sharded
      buffers, and for ZeRO-3 the all-gather buckets held at once while the activations peak
      (the most held during each counted backward, when every microbatch activation is still
      held; :func:`mnb.megatron.fsdp.gathered_storages`), not at the moment of counting: the
      optimizer step gathers every bucket, whatever the prefetch holds at the peak;
    - ``gradients``: Megatron DDP's gradient buffers (``main_grad`` lives there);
    - ``optimizer``: every tensor the optimizer holds that is neither of those
      (fp32 master weights, Adam's moments; sharded by the distributed optimizer),
      but Adam's 0-dim step counters;
    - ``activations``: what autograd saves for backward, caught with
      ``torch.autograd.graph.saved_tensors_hooks`` while each microbatch's forward
      (and loss) runs, storages counted once, parameters (and ZeRO-3's gathered
      buckets) left out.  A
      microbatch's bytes are held until its backward ends; ``activations`` is the
      largest sum held at once (the microbatches in flight of the schedule).

    Storages are told apart by their data pointer, so views and tensors shared
    between ops count once.  Saved tensors are counted in the first
    ``COUNTED_STEPS`` steps of each ``mnb.train`` call only (a step saves the
    same tensors every time); later steps run without the hooks, at full speed.  ``peak`` is the allocator's peak on CUDA; on CPU,
    where no allocator keeps one, the counted static components plus the
    activations peak.
    """

    COUNTED_STEPS = 2

    def __init__(self) -> None:
        self.steps_begun = 0
        self.static_bytes = {"weights": 0, "gradients": 0, "optimizer": 0}
        self._known: set[int] = set()
        self._saving: dict[int, int] | None = None
        self._hooks = None
        self._held: dict[object, int] = {}
        self.activations_peak_bytes = 0
        self.microbatch_peak_bytes = 0
        self.observer = None
        """Called with the activation bytes held whenever they change (``--profile --memory``)."""
        self.always_count = False
        """Count saved tensors in every step, not the first ``COUNTED_STEPS`` (profiled steps)."""
        self._gathering: list = []
        """The ZeRO-3 chunks (Megatron-FSDP) whose gathered buckets come and go within a step."""
        self._gathered_at_count = 0
        self.gathered_peak_bytes: int | None = None
        """The most ZeRO-3 bucket bytes held at once while activations were held (None: not sampled)."""

    def count_static(self, model, optimizers: list) -> None:
        """Weights, gradient buffers and the optimizer's tensors of a prepared model (DDP + optimizer).

        Called before the steps, so activations never count these storages, and
        again after them: Adam creates its moments at its first step.
        """
        from mnb.megatron import fsdp

        self._known.clear()
        # Megatron-FSDP: this rank's shards live in its ParamAndGradBuffer (parameters are DTensors)
        sharded = [fsdp.buffer_tensors(w) for w in model.wrapped or [] if fsdp.is_fsdp(w)]
        weights = self._add(t for found in sharded for t in found["weights"])
        # ZeRO-3: the parameters are views of all-gather buckets, counted where the activations peak
        self._gathering = [w for w in model.wrapped or [] if fsdp.is_fsdp(w)
                           and w.ddp_config.data_parallel_sharding_strategy == "optim_grads_params"]
        self._gathered_at_count = self._add_storages(s for w in self._gathering for s in fsdp.gathered_storages(w))
        weights += self._add(p for chunk in model.chunks for p in chunk.parameters())
        buffers = [b for ddp in model.wrapped or [] if not fsdp.is_fsdp(ddp)
                   for b in (*getattr(ddp, "buffers", []), *getattr(ddp, "expert_parallel_buffers", []))]
        gradients = self._add(t for found in sharded for t in found["gradients"])
        gradients += self._add(b.grad_data for b in buffers if getattr(b, "grad_data", None) is not None)
        gradients += self._add(getattr(p, "main_grad", None) for chunk in model.chunks for p in chunk.parameters())
        state = []
        for opt in optimizers:
            inner = getattr(opt, "optimizer", opt)
            state += [p for group in getattr(inner, "param_groups", []) for p in group["params"]]
            # Adam's per-tensor step counters are 0-dim bookkeeping, not state that scales with the model
            state += [t for per_param in getattr(inner, "state", {}).values() for t in per_param.values()
                      if not (isinstance(t, torch.Tensor) and t.dim() == 0)]
        optimizer = self._add(state)
        self.static_bytes = {"weights": weights, "gradients": gradients, "optimizer": optimizer}

    def weights_bytes(self) -> int:
        """``weights``: the static storages, and ZeRO-3's buckets held at the activations' peak
        (those held when counted, where no forward or backward was sampled)."""
        if not self._gathering:
            return self.static_bytes["weights"]
        gathered = self.gathered_peak_bytes if self.gathered_peak_bytes is not None else self._gathered_at_count
        return self.static_bytes["weights"] + gathered

    def _gathered_now(self) -> dict[int, int]:
        """{data pointer: bytes} of the ZeRO-3 buckets gathered at this moment."""
        from mnb.megatron import fsdp

        return {s.data_ptr(): s.nbytes() for w in self._gathering for s in fsdp.gathered_storages(w)}

    def _sample_gathered(self) -> None:
        held = sum(self._gathered_now().values())
        self.gathered_peak_bytes = max(self.gathered_peak_bytes or 0, held)

    def _add_storages(self, storages) -> int:
        """Bytes of ``storages`` not counted yet (they become known)."""
        total = 0
        for storage in storages:
            if storage.data_ptr() not in self._known:
                self._known.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    def _add(self, tensors) -> int:
        """Bytes of the storages of ``tensors`` not counted yet (they become known)."""
        total = 0
        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor):
                continue
            tensor = _local(tensor)
            if tensor.numel() == 0:
                continue
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in self._known:
                self._known.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    # ----- the schedule's steps and each microbatch's forward / backward (TimelineRecorder calls these)
    def step_started(self) -> None:
        self.steps_begun += 1

    def forward_started(self) -> None:
        if self.steps_begun > self.COUNTED_STEPS and not self.always_count:
            return
        self._saving = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack if self._gathering else _unpack)
        self._hooks.__enter__()

    def forward_stopped(self, key: object) -> None:
        if self._hooks is None:
            return
        self._hooks.__exit__(None, None, None)
        self._hooks = None
        saved = sum(self._saving.values())
        self._saving = None
        self._held[key] = saved
        if self._gathering:
            self._sample_gathered()
        self.microbatch_peak_bytes = max(self.microbatch_peak_bytes, saved)
        self.activations_peak_bytes = max(self.activations_peak_bytes, sum(self._held.values()))
        if self.observer is not None:
            self.observer(sum(self._held.values()))

    def backward_stopped(self, key: object) -> None:
        self._held.pop(key, None)
        if self.observer is not None:
            self.observer(sum(self._held.values()))

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._saving is not None and tensor.numel():
            storage = tensor.untyped_storage()
            ptr = storage.data_ptr()
            if ptr and ptr not in self._known and not (self._gathering and ptr in self._gathered_now()):
                self._saving[ptr] = storage.nbytes()
        # Detached: a saved output kept as itself would hold its own grad_fn, a cycle through
        # autograd's C++ nodes that Python's collector cannot break.  Backward breaks it; a
        # forward that raised (out of memory) left every saved tensor allocated for good.
        return tensor.detach()

    def _unpack(self, tensor: torch.Tensor) -> torch.Tensor:
        """In a counted backward (ZeRO-3 only): note the buckets gathered at this moment."""
        self._sample_gathered()
        return tensor

    def end_run(self) -> None:
        """After the steps, also after a step that raised: no hook left on autograd's stack
        (a forward that raised never reached ``forward_stopped``), and microbatches that never
        ran backward (forward-only, or a failed step) not held across calls."""
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None
            self._saving = None
        self._held.clear()

    def summary(self, allocator_peak_bytes: int | None) -> dict[str, int | str]:
        static = {**self.static_bytes, "weights": self.weights_bytes()}
        counted = sum(static.values()) + self.activations_peak_bytes
        return {
            **static,
            "activations": self.activations_peak_bytes,
            "activations_per_microbatch": self.microbatch_peak_bytes,
            "peak": int(allocator_peak_bytes) if allocator_peak_bytes else counted,
            "peak_source": "allocator" if allocator_peak_bytes else "counted tensors",
        }


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def allocated_over_time(snapshot: dict[str, Any], device: int, perf_minus_wall_s: float,
                        points: int = MEMORY_POINTS) -> list[list[float]]:
    """``[perf_counter_s, bytes allocated]`` after each allocation and free of torch's memory snapshot.

    Replayed backwards from the snapshot's blocks (``active_allocated``: what is allocated when it
    was taken): an ``alloc`` added its size, a ``free_requested`` took it away, the moments the
    allocator's ``allocated_bytes`` moves, so the largest value is ``max_memory_allocated`` over the
    recorded span (checked on an H200: equal to the byte).  The trace notes requested sizes; the
    allocator counts blocks, rounded up to 512 bytes (its default, no ``roundup_power2_divisions``).
    ``time_us`` is the system clock's; ``perf_minus_wall_s`` moves it onto the shared clock.  Long
    series keep the largest point of each stretch, so the peak survives.
    """
    now = sum(block["size"] for segment in snapshot.get("segments", []) if segment.get("device", device) == device
              for block in segment.get("blocks", []) if block.get("state") == "active_allocated")
    traces = snapshot.get("device_traces") or []
    events = [e for e in (traces[device] if device < len(traces) else [])
              if e.get("action") in ("alloc", "free_requested")]
    series = []
    for event in reversed(events):
        series.append([event.get("time_us", 0) / 1e6 + perf_minus_wall_s, now])
        size = max(BLOCK_BYTES, -(-event["size"] // BLOCK_BYTES) * BLOCK_BYTES)
        now += -size if event["action"] == "alloc" else size
    if events:
        series.append([events[0].get("time_us", 0) / 1e6 + perf_minus_wall_s - 1e-6, now])
    series.reverse()
    if len(series) > points:
        stretch = -(-len(series) // points)
        series = [max(series[i:i + stretch], key=lambda p: p[1]) for i in range(0, len(series), stretch)]
    return series


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (Megatron-FSDP's parameters and optimizer state), else the tensor."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) and type(tensor).__name__ == "DTensor" else tensor
