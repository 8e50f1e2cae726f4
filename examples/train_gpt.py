"""Train the small GPT with autopar under torchrun:

    torchrun --nproc-per-node 4 examples/train_gpt.py --plan zero3 [--bf16]

On a machine with CUDA each rank takes the GPU of its LOCAL_RANK and the process group is
NCCL's; elsewhere gloo on the CPU. ``--bf16``: mixed precision (bf16 compute, fp32 masters,
fp32 gradient sums). Each rank prints its loss; rank 0 prints explain() at the end.
"""
import argparse
import os

import torch
import torch.distributed as dist

import autopar
from autopar.models import GPTConfig, TinyGPT, gpt_batch, lm_loss


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", default="zero3", choices=["ddp", "zero1", "zero2", "zero3"])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--bf16", action="store_true", help="mixed precision: Plan(param_dtype=torch.bfloat16)")
    args = ap.parse_args()
    device = torch.device("cpu")
    if torch.cuda.is_available():      # one GPU per process, as torchrun numbers them on the node
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    c = GPTConfig()
    tokens, targets = gpt_batch(c, 4 * dist.get_world_size())
    tokens, targets = tokens.to(device), targets.to(device)
    plan = autopar.Plan(dp=args.plan, param_dtype=torch.bfloat16 if args.bf16 else None)
    dm = autopar.compile(TinyGPT(c).to(device), autopar.Mesh(dp=dist.get_world_size()), example_inputs=(tokens,),
                         plan=plan)
    opt = dm.optimizer(torch.optim.AdamW, lr=1e-3)
    x, y = dm.shard_batch(tokens), dm.shard_batch(targets)
    for step in range(args.steps):
        loss = lm_loss(dm(x), y)
        loss.backward()
        dm.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        print(f"rank {dist.get_rank()} step {step} loss {loss.item():.4f}")
    if dist.get_rank() == 0:
        print(dm.explain())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
