"""The notebook kernel never imports torch or Megatron, even with a pool running."""

import subprocess
import sys

import pytest

CHECK = "import sys; bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron')); print(bad); assert not bad, bad"


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_notebook_side_modules_import_no_torch():
    result = run("import mnb, mnb.magics, mnb.controller, mnb.estimate, mnb.plot, mnb.runs, mnb.analysis, mnb.config, "
                 "mnb.protocol, mnb.errors, mnb.kernelspec, mnb.exports, mnb.megatron_lm, mnb.controller.slurm, "
                 "mnb.units, mnb.timeouts, mnb.progress, mnb.hf_config\n"
                 "mnb.export('slurm', model='tiny', gpus_per_node=2)\n" + CHECK)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
def test_kernel_stays_torch_free_after_load_ext_and_start():
    code = (
        "from IPython.core.interactiveshell import InteractiveShell\n"
        "ip = InteractiveShell.instance()\n"
        "ip.run_line_magic('load_ext', 'mnb')\n"
        "ip.run_line_magic('mnb', 'start -n 2 --device cpu')\n"
        "ip.run_cell_magic('megatron', '--tp 2', 'x = torch.ones(2) * rank')\n"
        "import mnb; print(mnb.pool().pull('x'))\n"
        "ip.run_line_magic('mnb', 'status')\n"
        + CHECK + "\n"
        "ip.run_line_magic('mnb', 'stop')\n"
    )
    result = run(code)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "array([1., 1.]" in result.stdout
