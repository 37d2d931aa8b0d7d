#!/bin/bash
#SBATCH --job-name=llama-ft
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gres=gpu:8
#SBATCH --cpus-per-task=96
#SBATCH --time=24:00:00
#SBATCH --output=%x-%j.out
set -euo pipefail
module purge
module load gcc/12.2.0 cuda/12.4.1 nccl/2.21.5 openmpi/4.1.6
module load python/3.11
source /shared/apps/miniconda3/etc/profile.d/conda.sh
conda activate /shared/envs/torch-2.4
export NCCL_DEBUG=INFO
export NCCL_IB_HCA=mlx5_0,mlx5_1,mlx5_2,mlx5_3
export NCCL_SOCKET_IFNAME=ib0
export NCCL_NET_GDR_LEVEL=PHB
export NCCL_ASYNC_ERROR_HANDLING=1
export TORCH_NCCL_BLOCKING_WAIT=1
export CUDA_DEVICE_MAX_CONNECTIONS=1
export OMP_NUM_THREADS=12
export TOKENIZERS_PARALLELISM=false
export HF_HOME=/scratch/$USER/hf
export HF_TOKEN_PATH=/home/$USER/.cache/huggingface/token
export WANDB_API_KEY_FILE=$HOME/.config/wandb/key
export WANDB_PROJECT=llama-ft-2024
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_ADDR MASTER_PORT=29500
srun torchrun --nnodes=$SLURM_NNODES --nproc_per_node=8 \
  --rdzv_id=$SLURM_JOB_ID --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:$MASTER_PORT \
  train.py --model meta-llama/Meta-Llama-3-8B --tokenizer meta-llama/Meta-Llama-3-8B \
  --max_new_tokens 4096 --lr 2e-5 --output_dir /scratch/$USER/ckpt/$SLURM_JOB_ID
