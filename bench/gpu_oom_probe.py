"""After an out-of-memory failure in ``mnb.train`` on a GPU rank, is the memory given back?

    python bench/gpu_oom_probe.py

Builds llama-1b, trains at a micro batch that cannot fit (OOM in the first forward), then drops
the model and collects: prints what is still allocated and, if much is, which objects hold the
largest CUDA tensors (their referrers' types, two levels up).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from mnb.controller import Pool  # noqa: E402

PROBE = r'''
def _probe():  # a function: its loop variables must not keep anything alive in the namespace
    import gc, types
    gc.collect(); torch.cuda.empty_cache()
    after = torch.cuda.memory_allocated() / 2**30
    print(f"allocated after the failed cell and gc: {after:.2f} GiB")
    if after <= 1:
        return
    big = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.is_cuda and o.numel() * o.element_size() > 2**28]
    print(len(big), "CUDA tensors over 256 MiB are alive")
    for t in big[:3]:
        for r in gc.get_referrers(t):
            if r is big or isinstance(r, types.FrameType):
                continue
            chain = [type(r).__name__]
            for x in gc.get_referrers(r)[:3]:
                if x is big or isinstance(x, types.FrameType):
                    continue
                chain.append(type(x).__name__ + "<-" + ",".join(type(y).__name__ for y in gc.get_referrers(x)[:4]))
            print(" ", tuple(t.shape), "held by", chain)
            break
model = None
_probe()
'''

pool = Pool.start(1, gpus=[0], timeout=600)
try:
    pool.run("model = mnb.gpt('llama-1b', seq_length=2048)\nbefore = torch.cuda.memory_allocated() / 2**30\n"
             "print(f'model built: {before:.2f} GiB')")
    try:
        pool.run("mnb.train(model, steps=2, micro_batch_size=96, global_batch_size=96, bf16=True)")
    except Exception as exc:
        print("provoked:", str(exc).splitlines()[1][:160])
    pool.run(PROBE)
    pool.run("model = mnb.gpt('llama-1b', seq_length=2048)\n"
             "mnb.train(model, steps=2, micro_batch_size=8, global_batch_size=16, bf16=True)\n"
             "print('the next model trains:', round(torch.cuda.max_memory_allocated() / 2**30, 1), 'GiB peak')")
finally:
    pool.stop()
