#!/bin/bash
# The GPT-2 example on several nodes under SLURM, one pipeline per node: from the repository's root,
#
#     sbatch examples/slurm_multinode.sh [the example's flags, e.g. --shard-replicas]
#
# srun starts one torchrun agent per node (--ntasks-per-node=1); the agents meet at the first node
# (a c10d rendezvous on port 29500) and each starts its node's processes, one per GPU. Ranks fill
# the nodes in order and rank d*N + k runs stage k of replica d, so --nproc-per-node N (the stages)
# puts one whole pipeline on each node: its hand-offs, every micro-batch, stay on the node, and only
# the replicas' gradient averaging, once per update, crosses the network. D = the number of nodes.
# With fewer processes per node than stages each pipeline spans several nodes instead (README,
# "Several nodes").
#
# Every node needs this checkout and its Python environment, and --out must be a folder every node
# reaches (a shared file system): each rank writes its part of every checkpoint there. Without GPUs,
# drop --gpus-per-node: the processes train on the CPU (gloo).
#SBATCH --job-name=pipeoptim-multinode
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=16
#SBATCH --time=00:30:00
#SBATCH --output=%x-%j.out
set -euo pipefail

stages=${STAGES:-4}  # N, the processes of each node
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
# gloo and NCCL find the interface from the host name; where that is not the one the nodes share:
# export GLOO_SOCKET_IFNAME=ib0 NCCL_SOCKET_IFNAME=ib0
export OMP_NUM_THREADS=1

srun --kill-on-bad-exit=1 torchrun \
    --nnodes "$SLURM_JOB_NUM_NODES" --nproc-per-node "$stages" \
    --rdzv-backend c10d --rdzv-endpoint "$head_node:29500" --rdzv-id "$SLURM_JOB_ID" \
    examples/transformers_causal_lm.py --stages "$stages" --out "runs/gpt2-slurm-$SLURM_JOB_ID" "$@"
