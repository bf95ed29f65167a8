"""A plain torchrun-style script: nothing ftrun-specific. Runs the same under torchrun.

    ftrun --nproc 2 examples/hello_dist.py
"""
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank())])
dist.all_reduce(t)
print(f"rank {dist.get_rank()}/{dist.get_world_size()}: sum of ranks = {t.item():.0f}", flush=True)
dist.destroy_process_group()
