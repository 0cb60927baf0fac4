"""Megatron-Core's ``pipeline_model_parallel_layout`` string: read as Megatron-Core reads it, and written for
uneven end stages under interleaving (what its first/last-stage options cannot express).

Kept apart from :mod:`mnb.config` (which re-exports both functions): a syntax of its own, read by
``ModelConfig.layers_per_virtual_stage``, the planner and the export.
"""

from __future__ import annotations

_LAYOUT_CHARS = {"E": "embedding", "L": "loss", "t": "decoder", "m": "mtp"}


def parse_pipeline_layout(layout: str | list, pp: int) -> list[str]:
    """Megatron-Core's ``pipeline_model_parallel_layout`` as one string per virtual stage.

    The string form as Megatron-Core 0.16/0.19 parses it (``PipelineParallelLayerLayout``):
    ``|`` separates virtual stages, ``,`` is cosmetic, ``(...)*n`` and ``x*n`` repeat;
    ``E`` embedding, ``t`` a decoder layer, ``m`` an MTP layer, ``L`` the loss.  A list of
    lists of those names (``"embedding"``, ``"decoder"``, ...) is accepted too.  The number
    of virtual stages must be a multiple of ``pp``; ``E`` opens the first, ``L`` ends the last.

    >>> parse_pipeline_layout("Et|(tt|)*2,tL", 2)
    ['Et', 'tt', 'tt', 'tL']
    """
    import re

    if isinstance(layout, str):
        text = layout.replace(",", "")
        text = re.sub(r"\(([^)]+)\)\*(\d+)", lambda x: x.group(1) * int(x.group(2)), text)
        text = re.sub(r"(.)\*(\d+)", lambda x: x.group(1) * int(x.group(2)), text)
        stages = text.split("|")
    elif isinstance(layout, (list, tuple)) and all(isinstance(row, (list, tuple)) for row in layout):
        names = {v: k for k, v in _LAYOUT_CHARS.items()}
        try:
            stages = ["".join(names[str(x).strip().lower()] for x in row) for row in layout]
        except KeyError as exc:
            raise ValueError(f"pipeline_model_parallel_layout names {exc.args[0]!r}; use "
                             f"{', '.join(names)}") from None
    else:
        raise ValueError(f"pipeline_model_parallel_layout must be a string like 'Ettt|(tttt|)*30,tttL' or a list "
                         f"of lists, got {type(layout).__name__}")
    bad = sorted({c for stage in stages for c in stage if c not in _LAYOUT_CHARS})
    if bad:
        raise ValueError(f"pipeline_model_parallel_layout {layout!r} has {bad}; its letters are "
                         + ", ".join(f"{c} ({n})" for c, n in _LAYOUT_CHARS.items()))
    if len(stages) % pp:
        raise ValueError(f"pipeline_model_parallel_layout has {len(stages)} virtual stages, not a multiple of pp({pp})")
    flat = "".join(stages)
    if not flat.startswith("E") or not flat.endswith("L") or flat.count("E") != 1 or flat.count("L") != 1:
        raise ValueError(f"pipeline_model_parallel_layout {layout!r}: the embedding E must open the first virtual "
                         "stage and the loss L end the last, once each (Megatron-Core's rule)")
    return stages


def uneven_pipeline_layout(num_layers: int, pp: int, vpp: int, *, first: int | None = None,
                           last: int | None = None) -> str:
    """The ``pipeline_model_parallel_layout`` of uneven end stages under interleaving.

    ``first`` / ``last`` layers on the first / last rank (as ``num_layers_in_first/last_pipeline_stage``
    mean), the others sharing the rest evenly; each rank's layers spread over its ``vpp``
    chunks as evenly as they go, the chunks with the embedding and the loss taking the fewer.
    Megatron-Core runs this where its first/last options refuse a count vpp does not divide.

    >>> uneven_pipeline_layout(126, 16, 2, first=7, last=7)   # Llama 3 405B's stages, interleaved
    'Ettt|,(tttt|)*30,tttL'
    """
    ends = [n for n in (first, last) if n is not None]
    middle = pp - len(ends)
    rest = num_layers - sum(ends)
    if pp < 2 or any(n < 0 for n in ends) or rest < 0 or (middle == 0 and rest) or (middle and rest % middle):
        raise ValueError(f"num_layers({num_layers}) with first={first}, last={last} does not split over pp({pp}): "
                         "the other stages need an equal share of the rest")
    share = rest // middle if middle else 0
    per_rank = [first if first is not None else share] + [share] * (pp - 2) + [last if last is not None else share]
    chunks = [[n // vpp + (1 if c < n % vpp else 0) for c in range(vpp)] for n in per_rank]
    chunks[0].reverse()  # the embedding's chunk takes the fewer layers, as the loss's (the last) does
    stages = ["t" * chunks[i % pp][i // pp] for i in range(pp * vpp)]
    if pp * vpp == 1:
        return "E" + stages[0] + "L"
    runs: list[list] = []  # the middle stages, repeats written as Megatron's (...|)*n
    for stage in stages[1:-1]:
        if runs and runs[-1][0] == stage:
            runs[-1][1] += 1
        else:
            runs.append([stage, 1])
    middle = [f"({stage}|)*{n}" if n > 1 else f"{stage}|" for stage, n in runs]
    return ",".join(["E" + stages[0] + "|", *middle, stages[-1] + "L"])
