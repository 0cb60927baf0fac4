"""What a fresh rank compiles during its first fused training step (device machine, 1 GPU).

    python bench/first_step_compiles.py

Starts a 1-GPU pool, builds llama-1b (2 layers) — ``mnb.gpt`` warms the fused
kernels — then trains one step at micro batch 1 and prints the time and the
functions Dynamo compiled during that step (``torch._dynamo.utils.compile_times``).
"""

from IPython.core.interactiveshell import InteractiveShell

shell = InteractiveShell.instance()
shell.run_line_magic("load_ext", "mnb")
shell.run_line_magic("mnb", "start -n 1 --gpus 0")
shell.run_cell_magic("megatron", "", """
import time, torch._dynamo.utils as dynamo_utils
t = time.perf_counter()
model = mnb.gpt('llama-1b', num_layers=2, seq_length=2048)
print('gpt_s', round(time.perf_counter() - t, 2))
print('after gpt:', dynamo_utils.compile_times(repr='str'))
frames = dict(dynamo_utils.counters['frames'])
t = time.perf_counter()
mnb.train(model, steps=1, micro_batch_size=1, global_batch_size=1, bf16=True)
print('first_step_s', round(time.perf_counter() - t, 2))
print('frames before', frames, 'after', dict(dynamo_utils.counters['frames']))
print('recompiles', dict(dynamo_utils.counters['recompiles']) if 'recompiles' in dynamo_utils.counters else None)
print('after step:', dynamo_utils.compile_times(repr='str'))
t = time.perf_counter()
mnb.train(model, steps=1, micro_batch_size=1, global_batch_size=1, bf16=True)
print('second_step_s', round(time.perf_counter() - t, 2))
""")
shell.run_line_magic("mnb", "stop")
