"""Print this rank's place in the pp x tp x rdp layout (run under torchrun or mpirun).

    torchrun --nproc-per-node 8 examples/rank_map.py --placement spread
"""

import argparse

import smp.torch as smp

parser = argparse.ArgumentParser()
parser.add_argument("--placement", default="cluster")
parser.add_argument("--pp", type=int, default=2)
parser.add_argument("--tp", type=int, default=2)
args = parser.parse_args()

smp.init({"pipeline_parallel_degree": args.pp, "tensor_parallel_degree": args.tp, "ddp": True,
          "placement_strategy": args.placement})
print(f"rank {smp.rank()}: pp={smp.pp_rank()} tp={smp.tp_rank()} rdp={smp.rdp_rank()} dp={smp.dp_rank()} "
      f"mp={smp.mp_rank()} | TP {smp.get_tp_group()} PP {smp.get_pp_group()} RDP {smp.get_rdp_group()} "
      f"DP {smp.get_dp_group()} MP {smp.get_mp_group()}", flush=True)
smp.barrier()
