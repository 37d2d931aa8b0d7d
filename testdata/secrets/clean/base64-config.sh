#!/bin/bash
#SBATCH --job-name=sweep
#SBATCH --array=0-31
#SBATCH --mem=64G
# The sweep's config, base64 of a JSON file (no secret in it).
CONFIG_B64='eyJsciI6IDAuMDAwMSwgImJhdGNoX3NpemUiOiAyNTYsICJlcG9jaHMiOiAxMDAsICJvcHRpbWl6ZXIiOiAiYWRhbXcifQ=='
echo "$CONFIG_B64" | base64 -d > config.json
export PYTHONHASHSEED=0
export XLA_FLAGS=--xla_gpu_cuda_data_dir=/usr/local/cuda
export MAX_TOKENS=8192
export SECRET_NAME=projects/ml-team/secrets/db-password/versions/latest
export PASSWORD_FILE=/home/alice/.config/db/password
export API_TOKEN=$(cat "$HOME/.config/api/token")
export GITHUB_TOKEN="${GITHUB_TOKEN:?set it in your secret manager}"
python sweep.py --config config.json --index "$SLURM_ARRAY_TASK_ID"
