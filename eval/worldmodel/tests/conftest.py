import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))   # eval/worldmodel: model, kvcache, train, dump_kv, rollout

try:
    import torch
    # The tests' tensors are tiny: one thread runs them in milliseconds, while a second
    # OpenMP thread on a busy two-core machine spins for seconds a call.
    torch.set_num_threads(1)
except ImportError:
    pass
