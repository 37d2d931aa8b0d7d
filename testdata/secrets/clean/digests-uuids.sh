#!/bin/bash
#SBATCH -p gpu
#SBATCH --gres=gpu:a100:1
# Checksums of the weights, checked before the run.
cat > weights.sha256 <<'SUMS'
9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08  model-00001-of-00004.safetensors
e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855  model-00002-of-00004.safetensors
2c26b46b68ffc68ff99b453c1d30413413422d706483bfa0f98a5e886266e7ae  model-00003-of-00004.safetensors
SUMS
sha256sum -c weights.sha256
export CUDA_VISIBLE_DEVICES=GPU-5a3e1c2f-9b8d-4e7a-a1c3-0f2d4b6e8a9c
export RUN_ID=3f2b8c1e-7d4a-4f6b-9e2c-1a5d8b0c7e3f
export GIT_COMMIT=4b825dc642cb6eb9a060e54bf8d69288fbee4904
export IMAGE=nvcr.io/nvidia/pytorch@sha256:0d2b5e3c9f1a7b4e6d8c2a0f9e1b3d5c7a9e0f2b4d6c8a1e3f5b7d9c0a2e4f6b
python -c 'import torch; print(torch.cuda.get_device_name(0))'
python eval.py --checkpoint /scratch/ckpt/step-120000 --seed 1234567890
