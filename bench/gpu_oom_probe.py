"""After an out-of-memory failure in ``mnb.train`` on a GPU rank, is the memory given back?

    python bench/gpu_oom_probe.py                                        # OOM in the first forward
    python bench/gpu_oom_probe.py --preset llama-3b --mbs 4 --gbs 16     # on an H100: OOM at step 2

Builds the model, trains at a micro batch that cannot fit, then drops the model and collects: prints
what is still allocated and, if much is, which objects hold the largest CUDA tensors (paths of
referrers up to a module, a frame or the Rank); then whether the next model trains.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from mnb.controller import Pool  # noqa: E402

PROBE = r'''
def _probe():  # a function: nothing it creates stays in the namespace
    import gc, sys, types
    gc.collect(); torch.cuda.empty_cache()
    after = torch.cuda.memory_allocated() / 2**30
    print(f"allocated after the failed cell and gc: {after:.2f} GiB")
    if after <= 1:
        return
    print("sys.last_value:", type(getattr(sys, "last_value", None)).__name__,
          "sys.last_exc:", type(getattr(sys, "last_exc", None)).__name__)
    big = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.is_cuda
           and o.numel() * o.element_size() > 2**28]
    print(len(big), "CUDA tensors over 256 MiB are alive, largest", max(o.numel() * o.element_size() for o in big) / 2**30, "GiB")
    mine = {id(big), id(sys._getframe())}
    def describe(obj, child):
        if isinstance(obj, types.ModuleType):
            return "module " + obj.__name__
        if isinstance(obj, dict):
            keys = [k for k, v in obj.items() if v is child][:2]
            return f"dict[{keys!r}]"
        if isinstance(obj, types.FrameType):
            return f"frame {obj.f_code.co_name} ({obj.f_code.co_filename}:{obj.f_lineno})"
        if isinstance(obj, types.CellType):
            return "cell"
        return type(obj).__module__ + "." + type(obj).__qualname__
    # breadth-first up the referrers of the largest tensors, to a module, the Rank or a frame
    for target in sorted(big, key=lambda o: -o.numel() * o.element_size())[:2]:
        paths, seen = [[target]], {id(target)}
        for depth in range(7):
            nxt = []
            for path in paths:
                for ref in gc.get_referrers(path[-1]):
                    if id(ref) in mine or id(ref) in seen or ref is paths or ref is nxt or isinstance(ref, list) and ref is big:
                        continue
                    seen.add(id(ref))
                    nxt.append(path + [ref])
            paths = [p for p in nxt if not isinstance(p[-1], types.FrameType) or p[-1].f_code.co_name != "_probe"][:40]
            ends = [p for p in paths if isinstance(p[-1], (types.ModuleType, types.FrameType)) or type(p[-1]).__name__ == "Rank"]
            if ends:
                for p in ends[:4]:
                    print("  path:", " <- ".join(describe(p[i + 1], p[i]) for i in range(len(p) - 1)))
                break
        else:
            print("  no path to a module, frame or the Rank within 7 levels; last level:",
                  sorted({describe(p[-1], p[-2]) for p in paths})[:12])
model = None
_probe()
torch._dynamo.reset(); import gc; gc.collect(); torch.cuda.empty_cache()
print(f"after torch._dynamo.reset(): {torch.cuda.memory_allocated() / 2**30:.2f} GiB")
'''

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--preset", default="llama-1b")
parser.add_argument("--mbs", type=int, default=96, help="a micro batch that does not fit")
parser.add_argument("--gbs", type=int, default=96)
parser.add_argument("--steps", type=int, default=2)
args = parser.parse_args()
pool = Pool.start(1, gpus=[0], timeout=600)
try:
    pool.run(f"model = mnb.gpt({args.preset!r}, seq_length=2048)\nbefore = torch.cuda.memory_allocated() / 2**30\n"
             "print(f'model built: {before:.2f} GiB')")
    try:
        pool.run(f"mnb.train(model, steps={args.steps}, micro_batch_size={args.mbs}, global_batch_size={args.gbs}, "
                 "bf16=True)")
    except Exception as exc:
        print("provoked:", str(exc).splitlines()[1][:160])
    pool.run(PROBE)
    pool.run("model = mnb.gpt('llama-1b', seq_length=2048)\n"
             "mnb.train(model, steps=2, micro_batch_size=8, global_batch_size=16, bf16=True)\n"
             "print('the next model trains:', round(torch.cuda.max_memory_allocated() / 2**30, 1), 'GiB peak')")
finally:
    pool.stop()
