#!/bin/bash
#SBATCH --gres=gpu:2
#SBATCH --container-mounts=/scratch:/scratch
srun --container-image=nvcr.io#nvidia/pytorch@sha256:5c8b1e0f3a7d9c2b4e6f8a0c1d3e5f7a9b0c2d4e6f8a1b3c5d7e9f0a2b4c6d8e \
  python train.py --data /scratch/imagenet --ssh-key-path ~/.ssh/id_ed25519.pub
apptainer exec --nv /shared/images/cuda-12.4.sif nvidia-smi
ssh-keygen -l -f ~/.ssh/id_ed25519.pub
cat ~/.ssh/id_ed25519.pub
# -----BEGIN PUBLIC KEY----- blocks and certificates are not secrets
openssl x509 -in /etc/ssl/certs/ca-certificates.crt -noout -subject
