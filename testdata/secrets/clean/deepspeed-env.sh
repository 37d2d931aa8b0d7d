#!/bin/bash
#SBATCH -N 8
#SBATCH --exclusive
#SBATCH --gres=gpu:h100:8
source ~/miniforge3/bin/activate ds
export FI_PROVIDER=efa
export FI_EFA_USE_DEVICE_RDMA=1
export NCCL_PROTO=simple
export NCCL_TUNER_PLUGIN=/opt/aws-ofi-nccl/lib/libnccl-ofi-tuner.so
export AWS_REGION=us-east-1
export AWS_PROFILE=training
export AWS_SHARED_CREDENTIALS_FILE=$HOME/.aws/credentials
export HF_DATASETS_CACHE=/fsx/cache/datasets
export HF_HUB_ENABLE_HF_TRANSFER=1
hostfile=/tmp/hostfile.$SLURM_JOB_ID
scontrol show hostnames | sed 's/$/ slots=8/' > "$hostfile"
deepspeed --hostfile "$hostfile" pretrain.py --deepspeed ds_config_zero3.json \
  --tokenizer_name_or_path EleutherAI/gpt-neox-20b --save_interval 1000 \
  --pipeline_model_parallel_size 4 --tensor_model_parallel_size 8
