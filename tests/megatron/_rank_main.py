"""Entry point of one test rank: python _rank_main.py FILE FUNCTION OUTDIR (see ranks.py)."""

import importlib.util
import json
import os
import sys
import traceback
from pathlib import Path


def main() -> None:
    path, name, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    rank = int(os.environ["RANK"])
    try:
        import torch

        torch.set_num_threads(1)
        if os.environ.get("MNB_TEST_CPU_MODE", "1") == "1":  # run_ranks(cpu_mode=False): Megatron's own CUDA calls
            from mnb.megatron import cpu

            cpu.install()
        torch.distributed.init_process_group("gloo")
        spec = importlib.util.spec_from_file_location(f"_mnb_test_{Path(path).stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        kwargs = json.loads((out / "kwargs.json").read_text())
        result = getattr(module, name)(**kwargs)
        (out / f"rank{rank}.json").write_text(json.dumps(result))
        torch.distributed.destroy_process_group()
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        sys.stdout.flush()
        os._exit(1)


if __name__ == "__main__":
    main()
