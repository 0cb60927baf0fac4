"""``%%megatron --fsdp``: Megatron-FSDP on CPU ranks (gloo), against Megatron DDP on the same ranks.

One 4-rank pool (``pool4``) serves the module; the cells run once (``runs``) and the tests read
what they left:

- tp2·dp2 with Megatron DDP, then the same under ``--fsdp`` (through the magic) and
  ``--fsdp optim_grads``: loss step by step (fp32, rtol 1e-4), the
  layout in the run record, and the memory by component (gradients and optimizer state
  halved where the strategy shards them over dp = 2);
- ``mnb.logits``/``mnb.generate`` of the FSDP model against the DDP model's;
- a checkpoint saved under fsdp2·tp2 loads, optimizer state included, under tp2·pp2 (Megatron DDP,
  distributed optimizer), whose own checkpoint loads under fsdp4 (dp4): the next losses are the
  saved run's own;
- what is refused, with what to do instead: ``--fsdp optim`` on CPU ranks (by the magic, and by
  ``mnb.train``), training a DDP model under ``--fsdp``, loading into a model FSDP already wraps, loading a non-distributed optimizer's state under ``--fsdp``.

Refusals made before any rank is touched (``--pp`` with ``--fsdp``, unknown strategies) are
tested in tests/test_magics.py.
"""

from __future__ import annotations

import pytest
import torch

from IPython.core.error import UsageError

from mnb.config import FSDP_OPTIM_ON_CPU, ParallelConfig

pytestmark = pytest.mark.slow

STEPS = 3
NEXT = 3
"""Steps after the save: the saved run's own continuation, against the loaded ones'."""
TRAIN = "micro_batch_size=1, global_batch_size=4, lr=1e-3, data='mock'"
STRATEGIES = ("optim_grads_params", "optim_grads")
"""``optim`` is refused on CPU ranks (mnb.config.FSDP_OPTIM_ON_CPU: its gradients are not DDP's on gloo)."""
SHARDS = {"optim_grads_params": ("gradients", "optimizer"), "optim_grads": ("gradients", "optimizer")}
"""The components each strategy divides by dp (the rest stay whole)."""

TRAIN_CELL = """
{name} = mnb.gpt('tiny')
_r = mnb.train({name}, steps={steps}, {train})
out[{key!r}] = dict(loss=[s['loss'] for s in _r['steps']], mem=_r['memory_components'], layout=_r['layout'])
"""

REFUSED = """
def refused(call):
    try:
        call()
    except ValueError as exc:
        return str(exc)
    return None
"""


@pytest.fixture(scope="module")
def module_pool(pool4):
    return pool4


@pytest.fixture(scope="module")
def runs(module_pool, shell, tmp_path_factory) -> dict:
    pool = module_pool
    ck = tmp_path_factory.mktemp("fsdp") / "ck"
    ddp_ck = ck.with_name("ddp")
    tp2 = ParallelConfig(tp=2)
    pool.run("out = {}\n" + REFUSED + TRAIN_CELL.format(name="ref", key="ddp", steps=STEPS, train=TRAIN)
             + f"mnb.save({str(ddp_ck)!r}, ref)", layout=tp2, quiet=True)
    # through the magic, as a notebook does: --tp 2 --fsdp (bare: optim_grads_params)
    shell.run_cell_magic("megatron", "--tp 2 --fsdp --timeout 240", TRAIN_CELL.format(
        name="m3", key="optim_grads_params", steps=STEPS, train=TRAIN) + f"""
ids = [[1, 2, 3, 4, 5, 6, 7, 8]]
out['logits_diff'] = float((mnb.logits(m3, ids) - mnb.logits(ref, ids)).abs().max())
out['generated'] = [str(mnb.generate(m, [[1, 2, 3]], max_new_tokens=5)) for m in (m3, ref)]
out['ddp_model_under_fsdp'] = refused(lambda: mnb.train(ref, steps=1))
mnb.save({str(ck)!r}, m3)
out['next'] = [s['loss'] for s in mnb.train(m3, steps={NEXT})['steps']]
out['load_into_wrapped'] = refused(lambda: mnb.load({str(ck)!r}, m3))
""")
    for strategy in STRATEGIES[1:]:
        pool.run(TRAIN_CELL.format(name="m", key=strategy, steps=STEPS, train=TRAIN),
                 layout=ParallelConfig(tp=2, fsdp=strategy), quiet=True)
    with pytest.raises(UsageError) as refused:  # before any rank is touched
        shell.run_cell_magic("megatron", "--tp 2 --fsdp optim", "print('never runs')")
    pool.run("m = mnb.gpt('tiny')\nout['optim'] = refused(lambda: mnb.train(m, steps=1, " + TRAIN + "))",
             layout=ParallelConfig(tp=2, fsdp="optim"), quiet=True)
    # fsdp2 -> tp2*pp2 (distributed optimizer): NEXT - 1 steps, saved, then -> fsdp4 for the last one
    load_cell = """
{name} = mnb.gpt('tiny')
_info = mnb.load({ck!r}, {name})
_adam = {{float(s['step']) for o in getattr({name}.optimizer, 'chained_optimizers', [{name}.optimizer])
          for s in o.optimizer.state.values() if 'step' in s}}
_r = mnb.train({name}, steps={steps}, {train})
out[{key!r}] = dict(step=_info['step'], optimizer_loaded=_info['optimizer_loaded'], adam_steps=sorted(_adam),
                    loss=[s['loss'] for s in _r['steps']])
"""
    pool.run(load_cell.format(name="t", ck=str(ck), key="loaded tp2 pp2", train=TRAIN, steps=NEXT - 1)
             + f"mnb.save({str(ddp_ck)!r} + '-distopt', t)",
             layout=ParallelConfig(tp=2, pp=2), quiet=True)
    pool.run(load_cell.format(name="f", ck=str(ddp_ck) + "-distopt", key="loaded fsdp4", train=TRAIN, steps=1)
             + f"g = mnb.gpt('tiny')\nout['optimizer_under_fsdp'] = refused(lambda: mnb.load({str(ddp_ck)!r}, g))\n"
             f"out['weights_under_fsdp'] = mnb.load({str(ddp_ck)!r}, g, load_optimizer=False)['step']",
             layout=ParallelConfig(fsdp="optim_grads_params"), quiet=True)
    return {**pool.run("out", quiet=True)[0], "optim magic": str(refused.value)}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fsdp_loss_equals_ddp_step_by_step_and_shards_what_it_says(runs, strategy):
    ddp, run = runs["ddp"], runs[strategy]
    assert run["layout"]["fsdp"] == strategy and run["layout"]["tp"] == 2 and run["layout"]["dp"] == 2
    assert ddp["layout"]["fsdp"] is None
    torch.testing.assert_close(torch.tensor(run["loss"]), torch.tensor(ddp["loss"]), rtol=1e-4, atol=0)
    for component in ("gradients", "optimizer"):
        ratio = run["mem"][component] / ddp["mem"][component]
        if component in SHARDS[strategy]:
            assert 0.45 < ratio < 0.55, (strategy, component, run["mem"], ddp["mem"])  # dp = 2
        else:
            assert ratio > 0.95, (strategy, component, run["mem"], ddp["mem"])


def test_logits_and_generate_of_an_fsdp_model_are_the_ddp_model_s(runs):
    assert runs["logits_diff"] < 1e-4
    fsdp_text, ddp_text = runs["generated"]
    assert fsdp_text == ddp_text


def test_a_checkpoint_saved_under_fsdp_loads_under_tp2_pp2_and_under_fsdp4(runs):
    """With its optimizer state: the next losses are the saved run's own, not only the first one
    (a fresh Adam would take other steps from the second on), both ways: fsdp2 -> tp2*pp2's
    distributed optimizer, whose checkpoint -> fsdp4."""
    tp2pp2, fsdp4 = runs["loaded tp2 pp2"], runs["loaded fsdp4"]
    assert (tp2pp2["step"], fsdp4["step"]) == (STEPS, STEPS + NEXT - 1)
    assert tp2pp2["optimizer_loaded"] is fsdp4["optimizer_loaded"] is True
    assert (tp2pp2["adam_steps"], fsdp4["adam_steps"]) == ([STEPS], [STEPS + NEXT - 1])  # Adam's own count
    torch.testing.assert_close(torch.tensor(tp2pp2["loss"] + fsdp4["loss"]), torch.tensor(runs["next"]),
                               rtol=1e-5, atol=0)


def test_what_fsdp_cannot_do_is_refused_with_what_to_do(runs):
    assert runs["optim magic"] == runs["optim"] == FSDP_OPTIM_ON_CPU
    assert "wrapped with fsdp=None but the cell runs with fsdp='optim_grads_params'" in runs["ddp_model_under_fsdp"]
    assert "build a new one (mnb.gpt) under --fsdp and load into it before its first mnb.train" in \
        runs["load_into_wrapped"]
    assert "mnb.load(path, model, load_optimizer=False)" in runs["optimizer_under_fsdp"]
    assert runs["weights_under_fsdp"] == STEPS
