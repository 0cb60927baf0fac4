"""mnb.from_hf's one-pass reader on real safetensors files, in this process (no ranks, no layout).

Tiny checkpoints written by transformers (Llama bf16 in shards: GQA, gated MLP, untied vocab;
GPT-2 fp32: Conv1D stored ``[in, out]``, so Megatron's row slices are column slices on disk,
read strided).  For every tp rank of tp1 and tp2, :func:`mnb.megatron.hf.load.fill` must give
each parameter exactly what the old path gave (``safe_open(...).get_slice`` per slice, built by the
same rules), read every byte range at most once, read only this rank's slices (under tp2 the two
ranks together read the checkpoint once plus the replicated tensors once more), and stage only a
bounded amount at a time.
"""

from __future__ import annotations

import pytest
import torch

from mnb.hf_config import architecture, hf_config, read_config
from mnb.megatron.hf.load import Target, family_tensors, fill, heads_of
from mnb.megatron.hf.reader import Checkpoint, read_header
from mnb.megatron.hf.rules import read_local
from mnb.megatron.model import padded_vocab_size


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("hf-reader")
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                         intermediate_size=96, num_hidden_layers=3, vocab_size=301,
                                         max_position_embeddings=64, tie_word_embeddings=False))
    llama.to(torch.bfloat16).save_pretrained(root / "llama", max_shard_size="60KB")
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=64, n_head=4, n_layer=2, vocab_size=300, n_positions=64))
    gpt2.save_pretrained(root / "gpt2")
    return {"llama": root / "llama", "gpt2": root / "gpt2"}


class _Reference:
    """The old path: every slice through safetensors' own ``get_slice``."""

    device = torch.device("cpu")

    def __init__(self, checkpoint: Checkpoint) -> None:
        from safetensors import safe_open

        self.checkpoint = checkpoint
        self.files = {f: safe_open(str(checkpoint.folder / f), framework="pt") for f in checkpoint.files}

    def slice(self, key, dim, start, stop):
        part = self.files[self.checkpoint.tensors[key].file].get_slice(key)
        return part[start:stop] if dim == 0 else part[:, start:stop]


def _targets(folder, tp: int, r: int):
    cfg = hf_config(folder)
    rules = family_tensors(architecture(read_config(folder), "config.json"), cfg)
    checkpoint = Checkpoint(folder)
    ref, want, targets = _Reference(checkpoint), {}, []
    for name, rule in rules.items():
        if name == "output_layer.weight" and cfg.share_embeddings_and_output_weights:
            continue  # Megatron's output layer is the embedding's weight under pp1
        shape = None
        if rule.kind == "vocab":
            shape = (padded_vocab_size(cfg.vocab_size, tp) // tp, cfg.hidden_size)
        local = read_local(rule, ref, shape, tp, r, cfg.vocab_size, heads_of(cfg))
        want[name] = local.float()
        targets.append(Target(torch.full(local.shape, float("nan")), name, rule, tp, r))
    return cfg, checkpoint, targets, want


def _ranges(log) -> list[tuple[str, int, int]]:
    return sorted((s.file, a, b) for s in log.spans for a, b in s.ranges())


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_one_pass_reads_each_range_once_and_only_this_ranks_slices(folders, kind):
    folder = folders[kind]
    headers = {f: read_header(folder / f) for f in Checkpoint(folder).files}
    total = sum(i.end - i.begin for h in headers.values() for i in h.values())
    logs = {}
    for tp in (1, 2):
        for r in range(tp):
            cfg, checkpoint, targets, want = _targets(folder, tp, r)
            log = fill(targets, checkpoint, cfg.vocab_size, heads_of(cfg), buffer_bytes=8192, buffers=3, threads=2)
            for t in targets:
                torch.testing.assert_close(t.param, want[t.name], rtol=0, atol=0, msg=f"{kind} tp{tp} r{r} {t.name}")
            ranges = _ranges(log)
            for (f0, a0, b0), (f1, a1, b1) in zip(ranges, ranges[1:]):
                assert f0 != f1 or b0 <= a1, f"{kind} tp{tp} r{r}: {f0} bytes [{a1}, {b0}) read twice"
            assert log.bytes_read == sum(b - a for _, a, b in ranges)
            # staged at once: a few chunks in flight plus the slices of parameters still waiting
            biggest = max(t.param.numel() * 4 for t in targets)
            assert log.staged_peak_bytes <= 3 * 8192 + 2 * biggest, (kind, tp, r, log.staged_peak_bytes)
            assert log.staged_peak_bytes < total / 2, (kind, tp, r, log.staged_peak_bytes, total)
            logs[tp, r] = log
    assert logs[1, 0].bytes_read == total, "tp1 reads the whole checkpoint, once"
    replicated = sum(i.end - i.begin for h in headers.values() for name, i in h.items()
                     if len(i.shape) == 1 and not name.endswith(("c_attn.bias", "c_fc.bias"))
                     or name.endswith("wpe.weight"))
    # under tp2 the ranks share only the replicated tensors (norms, GPT-2's positions and output biases)
    assert logs[2, 0].bytes_read + logs[2, 1].bytes_read == total + replicated, kind
    assert _overlap(_ranges(logs[2, 0]), _ranges(logs[2, 1])) == replicated, kind
    for r in (0, 1):
        assert logs[2, r].bytes_read < 0.7 * total, (kind, r, logs[2, r].bytes_read, total)


def _overlap(a, b) -> int:
    """Bytes read by both of two sorted lists of disjoint ``(file, start, stop)``."""
    out, j = 0, 0
    for f, s, e in a:
        while j < len(b) and (b[j][0], b[j][2]) <= (f, s):
            j += 1
        k = j
        while k < len(b) and b[k][0] == f and b[k][1] < e:
            out += max(0, min(e, b[k][2]) - max(s, b[k][1]))
            k += 1
    return out


def test_headers_are_checked_before_any_read(tmp_path, folders):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(folders["gpt2"], bad)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])  # cut short: offsets past the end
    with pytest.raises(ValueError, match=r"bad/model.safetensors is not a readable safetensors file \(tensor "
                                         r".* data_offsets .* do not hold"):
        Checkpoint(bad)
    (bad / "model.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{nope")
    with pytest.raises(ValueError, match="header is not JSON"):
        Checkpoint(bad)
